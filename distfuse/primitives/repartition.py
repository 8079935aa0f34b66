"""Repartition: move a tensor from its balanced decomposition over ``P_x`` to its decomposition over ``P_y``.

Shapes (``G`` the global shape, ``B(G, P, i)`` the balanced block of worker ``i``)::

    x   B(G, P_x, index in P_x)    on workers of P_x
    y   B(G, P_y, index in P_y)    on workers of P_y

Other workers pass and get zero-volume tensors (``[b, 0]`` with ``preserve_batch``; a
clone of the input, with no communication, on workers in neither partition).

Any two Cartesian partitions of the same dimension work: one worker to many, many to
one, different grid shapes, overlapping, disjoint or reordered worker sets, and empty
blocks.  Each worker of ``P_x`` sends the intersection of its block with every ``P_y``
block to that block's worker, all in one batched point-to-point round
(:func:`~distfuse.primitives._common.exchange`; at most one message per direction
between two ranks, so no tags).  Adjoint: the repartition of the gradient from ``P_y``
back to ``P_x`` (the map permutes elements, so its adjoint is its inverse).

Global shape.  A worker active only in ``P_y`` cannot know ``G`` or the dtype, and no
single ``P_x`` block determines ``G`` (a block of 3 out of 2 workers may come from 5 or
6), so :class:`Repartition` agrees on one record per worker of ``P_x ∪ P_y``
(``_gather_records``) with its flag in a host round
(:func:`~distfuse.primitives._agreement.agreed_by_flag_round`: no data message reaches
every worker); every worker validates every record (``_resolve``), so a bad block raises
the same error everywhere instead of a hang.  :func:`repartition` takes ``G`` and checks
locally.  Unlike DistDL, the records carry ``requires_grad``: if any worker's input
requires grad, every worker's output does, so workers that hold no input still run the
adjoint (``backward`` must run on every worker of the union, with grad mode on).
:mod:`~distfuse.primitives.distribute` builds on it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distfuse import debug
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import block_range, local_shape, local_start, owner_of
from distfuse.groups import WorldTable
from distfuse.partition import CartesianPartition, Partition, union_partition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._axes import check_cartesian
from distfuse.primitives._common import balanced_global_shape, cached, exchange, exchange_into, gather_records, poison

__all__ = ["Repartition", "RepartitionFunction", "repartition"]

# ---------------------------------------------------------------- checks and the per-call records
#
# One record per worker of P_x ∪ P_y: [ndim, dtype code, requires_grad, problem, shape...], 4 + 8 int64.
_MAX_DIM = 8
_HEAD = 4
_OK, _BAD_DEVICE, _TOO_MANY_DIMS = 0, 1, 2
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]

# Union partitions for the functional form's debug check, keyed by the two partitions.
_UNIONS: WorldTable = WorldTable()


def _check_partitions(op: str, P_x, P_y) -> None:
    check_cartesian(op, P_x, "P_x")
    check_cartesian(op, P_y, "P_y")
    if P_x.dim != P_y.dim:
        raise expect(op, "P_y.dim (partition dimensions must match one to one)", P_x.dim, P_y.dim, PartitionError)


def _idle_shape(x: torch.Tensor, P_x, preserve_batch: bool) -> tuple[int, ...]:
    """Shape of the zero-volume output of a union worker that is not in ``P_y``.

    In ``P_x``: ``[b, 0]`` with the input's first extent (DistDL's ``preserve_batch``).
    In neither (a helper's extra union worker): the input's own zero-volume shape.
    """
    if not preserve_batch:
        return (0,)
    if not P_x.active:
        return tuple(x.shape)
    return (int(x.shape[0]), 0) if x.dim() > 0 else (0,)


def _outside(op: str, x: torch.Tensor, preserve_batch: bool) -> torch.Tensor:
    """A worker in neither partition: no communication; a clone of its zero-volume input."""
    if x.numel() != 0:
        raise ShapeError(f"{where(op)}: this rank is in neither P_x nor P_y, so it must pass a zero-volume "
                         f"tensor; got shape {tuple(x.shape)}")
    return x.clone() if preserve_batch else x.reshape(0)


def _gather_records(P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                    op: str = "Repartition") -> list[tuple]:
    """Every union worker's ``(shape, dtype, requires_grad, problem)`` in union order; host-side gloo."""
    problem = _OK
    if P_x.active and x.device.type != P_x.device.type:
        problem = _BAD_DEVICE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
    rec = [min(x.dim(), _MAX_DIM), _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1,
           int(x.requires_grad and torch.is_grad_enabled()), problem] + [-1] * _MAX_DIM
    if problem == _OK:
        rec[_HEAD:_HEAD + x.dim()] = x.shape
    rows = gather_records(op, P_union, rec)
    return [(tuple(r[_HEAD:_HEAD + r[0]]), _DTYPES[r[1]] if r[1] >= 0 else None, bool(r[2]), r[3]) for r in rows]


def _resolve(op: str, P_union: Partition, P_x: CartesianPartition, records: list[tuple]):
    """Validate every record identically on every worker; return ``(global shape, dtype, any requires_grad)``."""
    pos = {w: k for k, w in enumerate(P_union.ranks)}
    in_x = set(P_x.ranks)
    for w, (shape, _, _, problem) in zip(P_union.ranks, records, strict=True):
        if problem == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_x.device.type, "another device")
        if problem == _TOO_MANY_DIMS:
            raise ShapeError(f"{where(op)}: world rank {w} passed a tensor of more than {_MAX_DIM} dimensions")
        if w not in in_x and math.prod(shape) != 0:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor; "
                             f"got shape {shape}")
    x_recs = [records[pos[w]] for w in P_x.ranks]  # in P_x partition order
    dtypes = {d for _, d, _, _ in x_recs}
    if len(dtypes) != 1 or None in dtypes:
        raise ShapeError(f"{where(op)}: the workers of P_x must agree on a supported dtype; got "
                         f"{ {P_x.ranks[r]: str(d) for r, (_, d, _, _) in enumerate(x_recs)} } (world rank: dtype)")
    G = balanced_global_shape(op, P_x, [shape for shape, _, _, _ in x_recs], lambda G, r, want, got: expect(
        op, f"local input shape on world rank {P_x.ranks[r]} (P_x index {P_x.index_of(r)}; the blocks must be the "
        f"balanced decomposition of the global shape {G} inferred from them)", want, got))
    return G, dtypes.pop(), any(rg for _, _, rg, _ in records)


def _union_of(P_x: CartesianPartition, P_y: CartesianPartition) -> Partition:
    return cached(_UNIONS.current(), (P_x.ranks, P_x.shape, P_y.ranks, P_y.shape), lambda: union_partition(P_x, P_y))


# ---------------------------------------------------------------- geometry


def overlaps(global_shape: Sequence[int], src_shape: Sequence[int], src_index: Sequence[int],
             dst_shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """Non-empty intersections of block ``src_index`` of one decomposition with the blocks of another.

    Returns ``(dst_index, ((lo, hi) per dim))`` in row-major ``dst_index`` order, with
    global half-open ranges.  Per dimension only the destination blocks that own the
    first to the last element of the source range are visited, so the cost is the
    number of messages, not the size of the destination partition.
    """
    per_dim = []
    for n, p_src, i, p_dst in zip(global_shape, src_shape, src_index, dst_shape, strict=True):
        lo, hi = block_range(n, p_src, i)
        if lo >= hi:
            return []
        owners = range(owner_of(n, p_dst, lo), owner_of(n, p_dst, hi - 1) + 1)
        per_dim.append([(j, (max(a, lo), min(b, hi))) for j in owners for a, b in [block_range(n, p_dst, j)]])
    return [(tuple(j for j, _ in combo), tuple(r for _, r in combo)) for combo in itertools.product(*per_dim)]


def _relative(box: Sequence[tuple[int, int]], start: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, start, strict=True))


# ---------------------------------------------------------------- the data movement


@dataclass(frozen=True)
class _Move:
    """One direction of a repartition on this worker, enough to run it and to build its adjoint.

    ``idle_*`` give the output of a worker not in ``P_dst``: in the adjoint the zero gradient
    of the forward's input, on its device even where a placeholder sat on the host under
    NCCL.  ``dtype`` is the dtype of the data on the wire.
    """

    P_src: CartesianPartition
    P_dst: CartesianPartition
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    idle_shape: tuple[int, ...]
    idle_dtype: torch.dtype
    idle_device: torch.device
    op: str = "Repartition"  # named in a failure of the exchange


def _run(x: torch.Tensor, mv: _Move) -> torch.Tensor:
    """Send this worker's boxes, receive its block; one round of point-to-point messages."""
    G, P_src, P_dst = mv.global_shape, mv.P_src, mv.P_dst
    sends = []
    if P_src.active:
        start = local_start(G, P_src.shape, P_src.index)
        sends = [(P_dst.ranks[P_dst.rank_of(j)], x[_relative(box, start)].contiguous())
                 for j, box in overlaps(G, P_src.shape, P_src.index, P_dst.shape)]
    if not P_dst.active:
        exchange(sends, [], op=mv.op)
        return torch.zeros(mv.idle_shape, dtype=mv.idle_dtype, device=mv.idle_device)
    shape = local_shape(G, P_dst.shape, P_dst.index)
    out = poison(torch.empty(shape, dtype=mv.dtype, device=P_dst.device))  # the boxes tile the block exactly
    start = local_start(G, P_dst.shape, P_dst.index)
    exchange_into(sends, [(P_src.ranks[P_src.rank_of(i)], out[_relative(box, start)])
                          for i, box in overlaps(G, P_dst.shape, P_dst.index, P_src.shape)], op=mv.op)
    return out


class RepartitionFunction(torch.autograd.Function):
    """Autograd Function of one repartition; the backward is the reverse repartition (itself differentiable)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mv: _Move) -> torch.Tensor:
        op = mv.op if mv.op.endswith(" (adjoint)") else f"{mv.op} (adjoint)"
        ctx.back = _Move(mv.P_dst, mv.P_src, mv.global_shape, mv.dtype, tuple(x.shape), x.dtype, x.device, op)
        return _run(x, mv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return RepartitionFunction.apply(grad, ctx.back), None


def _apply(x: torch.Tensor, P_x, P_y, G, dtype, preserve_batch: bool, promote: bool,
           op: str = "Repartition") -> torch.Tensor:
    if promote and not x.requires_grad:
        x = x.detach().requires_grad_(True)  # see the module docstring: every worker then runs the adjoint
    idle_shape = _idle_shape(x, P_x, preserve_batch)
    return RepartitionFunction.apply(x, _Move(P_x, P_y, tuple(G), dtype, idle_shape, dtype, x.device, op))


# ---------------------------------------------------------------- public API


def repartition(x: torch.Tensor, P_x: CartesianPartition, P_y: CartesianPartition, global_shape: Sequence[int],
                preserve_batch: bool = True, dtype: torch.dtype | None = None, agree: bool = False,
                _op: str = "repartition") -> torch.Tensor:
    """Repartition ``x`` from ``P_x`` to ``P_y`` with the global shape given: no metadata collective.

    Every worker of ``P_x ∪ P_y`` must call it with the same ``global_shape``.  Workers
    outside ``P_x`` pass a zero-volume tensor (``requires_grad=True`` if the adjoint must
    run there); their output dtype is ``dtype``, or the placeholder's when ``dtype`` is
    None.  It must be the dtype of the data: gloo receives a bf16 message into an fp32
    buffer without any error, leaving garbage.  On ``P_x`` workers a given ``dtype`` must
    equal ``x.dtype`` (checked).

    Checks are local (a wrong block raises on its own worker, its peers waiting until the
    timeout) unless ``agree=True``: then every worker of ``P_x ∪ P_y`` raises the same error
    (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).  With ``DISTFUSE_DEBUG=1``
    the workers first check that they agree on the partitions, ``global_shape`` and dtype.
    With either, the first call for a pair of partitions is collective over the world (it
    creates their union).
    """
    op = _op
    _check_partitions(op, P_x, P_y)
    G = tuple(int(n) for n in global_shape)
    given = dtype
    dtype = x.dtype if dtype is None else dtype

    def checks() -> None:  # local: no communication
        if given is not None and P_x.active and x.dtype != given:
            raise expect(op, "dtype of the input", given, x.dtype)
        if not (P_x == P_y or P_x.active or P_y.active):
            return
        if len(G) != P_x.dim:
            raise expect(op, "length of global_shape (one entry per partition dimension)", P_x.dim, len(G))
        if not P_x.active:
            if x.numel() != 0:
                raise ShapeError(f"{where(op)}: this rank is not in P_x, so it must pass a zero-volume tensor; got "
                                 f"shape {tuple(x.shape)}")
            return
        if x.dim() != P_x.dim:
            raise expect(op, "number of tensor dimensions (one per partition dimension)", P_x.dim, x.dim())
        if x.device.type != P_x.device.type:
            raise expect(op, "device type", P_x.device.type, x.device.type)
        want = local_shape(G, P_x.shape, P_x.index)
        if tuple(x.shape) != want:
            raise expect(op, f"local input shape (P_x index {P_x.index} of global shape {G})", want, tuple(x.shape))

    if agree and P_x != P_y and _union_of(P_x, P_y).active:
        agree_on_local_checks(_union_of(P_x, P_y), op, checks)
    else:
        checks()
    if debug.enabled():
        P_union = _union_of(P_x, P_y)
        if P_union.active:
            debug.check_agreement(op, P_union.ranks, P_union.meta_group,
                                  same=dict(P_x=(P_x.ranks, P_x.shape), P_y=(P_y.ranks, P_y.shape),
                                            global_shape=G, dtype=str(dtype), preserve_batch=preserve_batch),
                                  info=dict(shape=tuple(x.shape)))
    if P_x == P_y:
        return x.clone()
    if not (P_x.active or P_y.active):
        return _outside(op, x, preserve_batch)
    return _apply(x, P_x, P_y, G, dtype, preserve_batch, promote=False, op=op)


class Repartition(nn.Module):
    """Redistribute a tensor from its balanced decomposition over ``P_x`` (a CartesianPartition with as many
    dimensions as the tensor) to the one over ``P_y``; ``preserve_batch``: zero-volume outputs keep the input's
    first extent (DistDL's option).

    Construction is collective over the world (it creates the union partition).  The
    records are agreed on as the module docstring says (``agreement`` counts the calls
    and the gathers); ``global_shape=`` (and ``dtype=``) to :meth:`forward` skips that for
    the functional form's local checks.  Identical partitions return a clone.
    """

    def __init__(self, P_x: CartesianPartition, P_y: CartesianPartition, preserve_batch: bool = True,
                 _op: str = "Repartition", _extra: Partition | None = None):
        super().__init__()
        _check_partitions(_op, P_x, P_y)
        self.P_x, self.P_y, self.preserve_batch, self._op = P_x, P_y, preserve_batch, _op
        # With ``_extra`` even equal partitions take the general path (a self-copy per worker), so that the
        # extra workers still learn the dtype and the requires_grad flag.
        self.identity = P_x == P_y and _extra is None
        # ``_extra`` (the helpers pass the world) joins the metadata gather without holding data, so that
        # its workers, too, get zero-volume outputs of the data's dtype that take part in autograd.
        self.P_union = union_partition(P_x, P_y, *([_extra] if _extra is not None else []))
        self.agreement = AgreementSite(_op)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}@{list(self.P_x.ranks)}, P_y={list(self.P_y.shape)}@"
                f"{list(self.P_y.ranks)}, preserve_batch={self.preserve_batch}")

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """Repartition ``x``; with ``global_shape`` (and ``dtype``) given, as :func:`repartition` does."""
        op, P_x, P_y = self._op, self.P_x, self.P_y
        if global_shape is not None:
            return repartition(x, P_x, P_y, global_shape, self.preserve_batch, dtype, _op=op)
        if self.identity:
            if P_x.active and x.dim() != P_x.dim:
                raise expect(op, "number of tensor dimensions (one per partition dimension)", P_x.dim, x.dim())
            return x.clone()
        if not self.P_union.active:
            return _outside(op, x, self.preserve_batch)
        debug.check_agreement(op, self.P_union.ranks, self.P_union.meta_group,
                              same=dict(P_x=(P_x.ranks, P_x.shape), P_y=(P_y.ranks, P_y.shape),
                                        preserve_batch=self.preserve_batch),
                              info=dict(shape=tuple(x.shape), dtype=str(x.dtype)))
        signature = (tuple(x.shape), x.dtype, x.device.type, bool(x.requires_grad and torch.is_grad_enabled()))
        G, dtype, any_grad = agreed_by_flag_round(
            self.agreement, self.P_union, op, signature, True,
            lambda: _resolve(op, self.P_union, P_x, _gather_records(self.P_union, P_x, x, op)))
        return _apply(x, P_x, P_y, G, dtype, self.preserve_batch, promote=any_grad and torch.is_grad_enabled(),
                      op=op)
