"""Shared plumbing of the primitives: input checks and one-round point-to-point exchange.

Cross-partition primitives (Broadcast, SumReduce, Repartition, HaloExchange) are all a
set of point-to-point messages on the world group, posted together with
``batch_isend_irecv`` and then waited on.  Posting every send and receive of a rank in
one batch is what makes arbitrary overlapping partitions deadlock-free: no rank blocks
in one transfer while its peer blocks in another.  NCCL fuses a batch into one group
call; gloo runs the transfers concurrently.  Tensors stay on their device: there is no
host staging.

Messages between one pair of ranks are matched in posting order, so both sides must
enumerate their messages in the same canonical order (the plans sort by a key both
sides compute identically).

Failures.  A peer that raised before its matching call, died, or made a different
call leaves this rank's ``torch.distributed`` call waiting until distfuse's timeout
(``DISTFUSE_TIMEOUT``: the rounds run on distfuse's own world group, created with it,
never on the default group and its 30-minute default), or failing at once when the
peer's connection closes.  gloo reports either as a bare ``RuntimeError`` naming a C++
source line; :func:`collective_guard` turns it into a
:class:`~distfuse.errors.CollectiveTimeoutError` that names the op, this rank, the peers
it was waiting for and the timeout in force, and chains the original.  Peers of a rank
that raises get the error when the timeout runs out, peers of a rank that exits within
0.1 s (``docs/benchmarks.md``, "Failure latency").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from distfuse._compat import all_gather_flat
from distfuse.errors import CollectiveTimeoutError, DistfuseError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.groups import group_timeout, timeout_label, world_group
from distfuse.partition import Partition, zero_volume_tensor
from distfuse.primitives._layout import wire_view

__all__ = ["exchange", "check_inactive_input", "empty_like_batch", "gather_metadata", "gather_records",
           "infer_global_shape", "collective_guard", "dtype_code", "dtype_of_code", "first_order_only"]


@contextlib.contextmanager
def collective_guard(op: str, what: str, peers: Iterable[int] | None = None, group=None):
    """Run ``torch.distributed`` calls; re-raise their failure as :class:`CollectiveTimeoutError`.

    The message names the op, this rank, the call, the world ranks it waited for and the
    timeout in force (that of ``group``, default distfuse's world group; see
    :func:`~distfuse.partition.group_timeout`).  Errors distfuse raised on purpose pass
    through unchanged.  Wrap only the communication itself, so that local programming
    errors keep their own type.
    """
    try:
        yield
    except DistfuseError:
        raise
    except RuntimeError as exc:
        peer_txt = f" with world ranks {sorted(set(peers))}" if peers is not None else ""
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectiveTimeoutError(
            f"{where(op)}: {what}{peer_txt} did not complete within the timeout in force "
            f"({timeout_label(group_timeout(group))}): {cause}. A peer that raised, died or made a "
            "different call ends here") from exc


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             op: str = "exchange") -> None:
    """Post all ``(world_peer, tensor)`` sends and receives in one batch and wait for them.

    The messages go over distfuse's world group (:func:`~distfuse.groups.world_group`),
    whose timeout is ``DISTFUSE_TIMEOUT``.  A message to this rank itself is a local copy
    and must appear in both lists in the same relative order.  Tensors must be
    contiguous, or dense in ``channels_last`` (``_3d``) with the peer's tensor in the same
    format.  ``op`` names the primitive in a failure (see :func:`collective_guard`).
    """
    me = dist.get_rank()
    self_sends = [t for peer, t in sends if peer == me]
    self_recvs = [t for peer, t in recvs if peer == me]
    if len(self_sends) != len(self_recvs):
        raise RuntimeError(f"{where(op)}: {len(self_sends)} self-sends but {len(self_recvs)} self-receives")
    for src, dst in zip(self_sends, self_recvs, strict=True):
        dst.copy_(src)
    group = world_group()
    # channels_last blocks travel as the contiguous [B, H, W, C] view of their memory (no copy; see _layout)
    ops = [dist.P2POp(dist.isend, wire_view(t), peer, group=group) for peer, t in sends if peer != me and t.numel()]
    ops += [dist.P2POp(dist.irecv, wire_view(t), peer, group=group) for peer, t in recvs if peer != me and t.numel()]
    if not ops:
        return
    with collective_guard(op, "point-to-point exchange", (o.peer for o in ops), group):
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses ``create_graph=True`` (see :func:`first_order_only`)."""

    @staticmethod
    def forward(ctx, y, op: str, why: str):
        ctx.op, ctx.why = op, why
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: a higher-order gradient is being built
            raise UnsupportedError(f"{where(ctx.op)}: higher-order gradients (backward with create_graph=True) "
                                   f"through {ctx.why} are not supported")
        return dy, None, None


def first_order_only(y: torch.Tensor, op: str, why: str) -> torch.Tensor:
    """``y``, refusing a backward with ``create_graph=True`` by name: for ops with first-order gradients only.

    It refuses in the first backward, before the op's own backward sends anything, so every
    worker that differentiates with ``create_graph=True`` raises
    :class:`~distfuse.errors.UnsupportedError` at the same point and none is left waiting.
    torch's ``once_differentiable`` would raise later, in the second backward, and only
    where that backward reaches the op, with a message that names neither the op nor the
    layer.  ``why`` names the op and the way out, e.g. ``"the fused halo convolution (the
    unfused path, DISTFUSE_PATH=unfused, computes them exactly)"``.
    """
    if not (torch.is_grad_enabled() and y.requires_grad):
        return y
    return _FirstOrderOnly.apply(y, op, why)


def check_inactive_input(op: str, x: torch.Tensor) -> None:
    """An inactive worker must pass a zero-volume tensor."""
    if x.numel() != 0:
        raise ShapeError(f"{where(op)}: this rank is not active in the input partition, so it must pass a "
                         f"zero-volume tensor; got shape {tuple(x.shape)}")


def empty_like_batch(x: torch.Tensor, preserve_batch: bool, batch: int | None = None) -> torch.Tensor:
    """The zero-volume output of a worker that receives nothing, keeping the batch size if asked."""
    b = (batch if batch is not None else (x.shape[0] if x.dim() > 0 else None)) if preserve_batch else None
    return zero_volume_tensor(b, dtype=x.dtype, device=x.device, requires_grad=False)


_DTYPE_CODES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int8, torch.uint8, torch.bool]
_DEVICE_CODES = ["cpu", "cuda", "meta", "xpu", "mps", "hpu"]
_TOO_MANY_DIMS = -2  # a record's ndim slot for a tensor of more than max_dim dimensions


def gather_metadata(P: Partition, x: torch.Tensor, max_dim: int = 8,
                    op: str = "gather_metadata") -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every worker's local ``(shape, dtype)`` over ``P``, in partition-rank order.

    Host-side only: a fixed-size int64 CPU tensor is all-gathered on ``P.meta_group``
    (gloo), so no device synchronisation happens even under NCCL.  Cost: one small
    collective (tens of microseconds within a node).  Must be called by every active
    worker of ``P``.

    A tensor of more than ``max_dim`` dimensions is recorded as such and refused after
    the gather, on every worker alike (raising before it would leave the peers waiting in
    the gather until the timeout).

    The record also carries the device type of every non-empty tensor: a worker whose
    data is not on ``P``'s device type makes every worker raise the same
    :class:`ShapeError` (found before, the check ran on that worker alone after the
    gather, and its peers waited for it until the timeout).  Empty placeholders may sit
    anywhere (under NCCL they are usually on the host).
    """
    code = _DTYPE_CODES.index(x.dtype) if x.dtype in _DTYPE_CODES else -1
    width = max_dim + 3
    mine = torch.full((width,), -1, dtype=torch.int64)
    too_many = x.dim() > max_dim  # recorded, not raised here: every worker raises it after the gather
    mine[0] = _TOO_MANY_DIMS if too_many else x.dim()
    mine[1] = code
    if x.numel() > 0:
        dev = x.device.type
        mine[2] = _DEVICE_CODES.index(dev) if dev in _DEVICE_CODES else len(_DEVICE_CODES)
    if not too_many:
        mine[3:3 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    out = torch.empty(P.size * width, dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P.ranks):
        all_gather_flat(out, mine, group=P.meta_group)
    # torch.distributed.new_group sorts its ranks: slot g belongs to the g-th smallest
    # world rank, which is not partition rank g when a partition lists its ranks out of order.
    by_world = dict(zip(sorted(P.ranks), out.view(P.size, width).tolist(), strict=True))
    rows = [by_world[r] for r in P.ranks]
    over = [w for w, r in zip(P.ranks, rows, strict=True) if r[0] == _TOO_MANY_DIMS]
    if over:
        raise ShapeError(f"{where(op)}: tensors of more than {max_dim} dimensions are not supported; world rank(s) "
                         f"{sorted(over)} passed one")
    want = P.device.type
    names = _DEVICE_CODES + ["another device"]
    bad = {w: names[r[2]] for w, r in zip(P.ranks, rows, strict=True) if r[2] >= 0 and names[r[2]] != want}
    if bad:
        raise ShapeError(f"{where(op)}: input device type: expected {want} on every worker, got "
                         f"{', '.join(f'world rank {w}: {d}' for w, d in sorted(bad.items()))}")
    return [(tuple(r[3:3 + r[0]]), _DTYPE_CODES[r[1]] if r[1] >= 0 else None) for r in rows]


def dtype_code(dtype: torch.dtype | None) -> int:
    """A small integer naming ``dtype`` in host-side records (-1: not one distfuse moves)."""
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1


def dtype_of_code(code: int) -> torch.dtype | None:
    return _DTYPE_CODES[code] if 0 <= code < len(_DTYPE_CODES) else None


def gather_records(op: str, P: Partition, record: Sequence[int]) -> list[list[int]]:
    """Every worker's fixed-length int64 ``record`` over ``P``, in partition-rank order (host-side gloo).

    The building block of the agreement checks' slow path: each layer packs what its
    checks need (shapes, dtypes, grad flags, a local problem code) and every worker then
    evaluates every record alike, so a bad input raises the same error everywhere.
    """
    mine = torch.tensor([int(v) for v in record], dtype=torch.int64)
    out = torch.empty(P.size * mine.numel(), dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P.ranks):
        all_gather_flat(out, mine, group=P.meta_group)
    # Slot g belongs to the g-th smallest world rank (new_group sorts its ranks), not to partition rank g.
    by_world = dict(zip(sorted(P.ranks), out.view(P.size, mine.numel()).tolist(), strict=True))
    return [by_world[r] for r in P.ranks]


def infer_global_shape(op: str, P, x: torch.Tensor) -> tuple[int, ...]:
    """Global shape of the tensor whose blocks the workers of CartesianPartition ``P`` hold.

    Gathers every worker's local shape (host-side, :func:`gather_metadata`) and checks
    that the blocks are the balanced decomposition of the global shape, so every
    worker raises the same :class:`ShapeError` when any block is off.
    """
    meta = gather_metadata(P, x, op=op)
    if x.dim() != P.dim:
        raise expect(op, "number of tensor dimensions (one per partition dimension)", P.dim, x.dim())
    dims = {len(s) for s, _ in meta}
    if dims != {P.dim}:
        bad = {P.ranks[r]: s for r, (s, _) in enumerate(meta) if len(s) != P.dim}
        raise ShapeError(f"{where(op)}: every worker's tensor must have {P.dim} dimensions; got {bad} (world rank: "
                         "local shape)")
    dtypes = {d for _, d in meta}
    if len(dtypes) != 1:
        raise ShapeError(f"{where(op)}: workers disagree on dtype: "
                         f"{ {P.ranks[r]: str(d) for r, (_, d) in enumerate(meta)} }")
    global_shape = []
    for d in range(P.dim):
        total = 0
        for r, (shape, _) in enumerate(meta):
            idx = P.index_of(r)
            if all(i == 0 for k, i in enumerate(idx) if k != d):
                total += shape[d]
        global_shape.append(total)
    for r, (shape, _) in enumerate(meta):
        want = local_shape(global_shape, P.shape, P.index_of(r))
        if tuple(shape) != want:
            raise ShapeError(
                f"{where(op)}: the local blocks are not the balanced decomposition of the global shape "
                f"{tuple(global_shape)} over the partition {P.shape}: world rank {P.ranks[r]} (index "
                f"{P.index_of(r)}) expected local shape {want}, got {tuple(shape)}")
    return tuple(global_shape)
