"""Shared plumbing of the primitives: input checks, host-side metadata and one-round point-to-point exchange.

Cross-partition primitives (Broadcast, SumReduce, Repartition, HaloExchange) post all of a
rank's point-to-point messages on the world group in one ``batch_isend_irecv``, then wait:
no rank blocks in one transfer while its peer blocks in another, so arbitrary overlapping
partitions cannot deadlock.  Tensors stay on their device.  Messages between two ranks are
matched in posting order, so both sides enumerate them in the same canonical order (the
plans sort by a key both sides compute identically).

Failures.  A peer that raised before its matching call, or made a different call, leaves
this rank's ``torch.distributed`` call waiting until distfuse's timeout (``DISTFUSE_TIMEOUT``:
the rounds run on distfuse's own groups, never on the default group and its 30-minute
default); a peer that exits fails it at once, when its connection closes
(``docs/benchmarks.md``, "Failure latency").  gloo reports either as a bare ``RuntimeError``
naming a C++ source line; :func:`collective_guard` turns it into a
:class:`~distfuse.errors.CollectiveTimeoutError` that names the op, this rank, the peers it
was waiting for and the timeout in force.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import CollectiveTimeoutError, DistfuseError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.groups import group_timeout, timeout_label, world_group
from distfuse.partition import Partition
from distfuse.primitives._layout import wire_view

__all__ = ["local_error", "exchange", "exchange_into", "check_inactive_input", "same_shape_and_dtype", "cached",
           "poison", "gather_metadata", "gather_records", "summed_extents", "infer_global_shape",
           "balanced_global_shape", "collective_guard", "dtype_code", "dtype_of_code", "first_order_only"]


def local_error(check: Callable[[], None]) -> DistfuseError | None:
    """The distfuse error ``check()`` raises, or None: a local check's outcome, to be agreed on, not raised here."""
    try:
        check()
    except DistfuseError as exc:
        return exc
    return None


@contextlib.contextmanager
def collective_guard(op: str, what: str, peers: Iterable[int] | None = None, group=None):
    """Run ``torch.distributed`` calls; re-raise their failure as :class:`CollectiveTimeoutError`.

    The message names the op, this rank, the call, the world ranks it waited for and the
    timeout of ``group`` (default distfuse's world group).  Errors distfuse raised on
    purpose pass through.  Wrap only the communication, so that local programming errors
    keep their own type.
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
    """Post all ``(world_peer, tensor)`` sends and receives in one batch on distfuse's world group and wait.

    A message to this rank itself is a local copy and must appear in both lists in the same
    relative order.  Tensors must be contiguous, or dense in ``channels_last`` (``_3d``)
    with the peer's tensor in the same format.  ``op`` names the primitive in a failure.
    """
    me = dist.get_rank()
    for src, dst in zip([t for peer, t in sends if peer == me], [t for peer, t in recvs if peer == me], strict=True):
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


def exchange_into(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                  op: str) -> None:
    """:func:`exchange` receiving into views of a block: a contiguous view (a box spanning whole trailing extents)
    receives in place, any other through a buffer copied into it afterwards."""
    bufs = [(peer, v if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype, device=v.device))
            for peer, v in recvs]
    exchange(sends, bufs, op=op)
    for (_, view), (_, buf) in zip(recvs, bufs, strict=True):
        if buf is not view:
            view.copy_(buf)


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
    worker raises :class:`~distfuse.errors.UnsupportedError` at the same point and none is
    left waiting (torch's ``once_differentiable`` raises only in the second backward, where
    it reaches the op, naming neither op nor layer).  ``why`` names the op and the way out,
    e.g. ``"the fused halo convolution (the unfused path, DISTFUSE_PATH=unfused, computes them exactly)"``.
    """
    if not (torch.is_grad_enabled() and y.requires_grad):
        return y
    return _FirstOrderOnly.apply(y, op, why)


def check_inactive_input(op: str, x: torch.Tensor) -> None:
    """An inactive worker must pass a zero-volume tensor."""
    if x.numel() != 0:
        raise ShapeError(f"{where(op)}: this rank is not active in the input partition, so it must pass a "
                         f"zero-volume tensor; got shape {tuple(x.shape)}")


def cached(table: dict, key, make: Callable[[], Any], limit: int | None = None) -> Any:
    """``table[key]``, made by ``make()`` on first use; a table of ``limit`` entries is cleared first, so that
    varying shapes (sequence lengths) cannot grow it without bound."""
    value = table.get(key)
    if value is None:
        if limit is not None and len(table) >= limit:
            table.clear()
        value = table[key] = make()
    return value


def poison(buf: torch.Tensor) -> torch.Tensor:
    """``buf``, NaN-filled in debug mode (floating dtypes), so that an element no message wrote cannot pass a test."""
    if debug.enabled() and buf.is_floating_point():
        buf.fill_(float("nan"))
    return buf


_DTYPE_CODES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int8, torch.uint8, torch.bool]
_DEVICE_CODES = ["cpu", "cuda", "meta", "xpu", "mps", "hpu"]
_TOO_MANY_DIMS = -2  # a record's ndim slot for a tensor of more than max_dim dimensions


def gather_metadata(P: Partition, x: torch.Tensor, max_dim: int = 8,
                    op: str = "gather_metadata") -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every worker's local ``(shape, dtype)`` over ``P``, in partition-rank order (:func:`gather_records`).

    Must be called by every active worker of ``P``.  A tensor of more than ``max_dim``
    dimensions, and a non-empty tensor off ``P``'s device type, are recorded as such and
    refused after the gather, on every worker alike (raising before it would leave the
    peers waiting in the gather until the timeout).  Empty placeholders may sit on any
    device (under NCCL they are usually on the host).
    """
    too_many = x.dim() > max_dim  # recorded, not raised here: every worker raises it after the gather
    dev = x.device.type
    device = (_DEVICE_CODES.index(dev) if dev in _DEVICE_CODES else len(_DEVICE_CODES)) if x.numel() else -1
    mine = [_TOO_MANY_DIMS if too_many else x.dim(), dtype_code(x.dtype), device] + [-1] * max_dim
    if not too_many:
        mine[3:3 + x.dim()] = x.shape
    rows = gather_records(op, P, mine)
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
    return [(tuple(r[3:3 + r[0]]), dtype_of_code(r[1])) for r in rows]


def same_shape_and_dtype(op: str, P: Partition, meta: list, what: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The one ``(shape, dtype)`` of :func:`gather_metadata`'s ``meta``; else the same :class:`ShapeError` on every
    worker, naming each one's (``what``: the tensor every worker must pass)."""
    if len(set(meta)) != 1 or meta[0][1] is None:
        rows = ", ".join(f"world rank {r}: {tuple(s)} {dt}" for r, (s, dt) in zip(P.ranks, meta, strict=True))
        raise ShapeError(f"{where(op)}: every worker must pass {what} of the same shape and dtype; got {rows}")
    return tuple(meta[0][0]), meta[0][1]


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
    """Global shape of the tensor whose blocks the workers of CartesianPartition ``P`` hold (:func:`gather_metadata`);
    every worker raises the same :class:`ShapeError` unless the blocks are its balanced decomposition."""
    meta = gather_metadata(P, x, op=op)
    if len({d for _, d in meta}) != 1:
        raise ShapeError(f"{where(op)}: workers disagree on dtype: "
                         f"{ {P.ranks[r]: str(d) for r, (_, d) in enumerate(meta)} }")
    return balanced_global_shape(op, P, [s for s, _ in meta], lambda G, r, want, got: ShapeError(
        f"{where(op)}: the local blocks are not the balanced decomposition of the global shape {G} over the "
        f"partition {P.shape}: world rank {P.ranks[r]} (index {P.index_of(r)}) expected local shape {want}, got {got}"))


def balanced_global_shape(op: str, P, shapes: Sequence[Sequence[int]],
                          misfit: Callable[..., DistfuseError]) -> tuple[int, ...]:
    """The global shape ``G`` of which ``shapes`` (in partition-rank order of Cartesian ``P``, the same on every
    worker) are the balanced blocks; else every worker raises the same error, ``misfit(G, r, want, got)`` for a
    block of the wrong shape."""
    for r, shape in enumerate(shapes):
        if len(shape) != P.dim:
            raise expect(op, f"number of tensor dimensions on world rank {P.ranks[r]} (one per partition dimension)",
                         P.dim, len(shape))
    global_shape = summed_extents(P, shapes)
    for r, shape in enumerate(shapes):
        want = local_shape(global_shape, P.shape, P.index_of(r))
        if tuple(shape) != want:
            raise misfit(global_shape, r, want, tuple(shape))
    return global_shape


def summed_extents(P, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The global shape of blocks ``shapes`` (in partition-rank order of Cartesian ``P``): along each dimension ``d``,
    the sum of the extents of the blocks on the axis through index 0 (the caller checks that every block fits)."""
    return tuple(sum(shapes[P.rank_of([k if e == d else 0 for e in range(P.dim)])][d] for k in range(P.shape[d]))
                 for d in range(P.dim))
