"""Repartition: move a tensor from its balanced decomposition over ``P_x`` to its decomposition over ``P_y``.

Shapes (``G`` the global shape, ``B(G, P, i)`` the balanced block of worker ``i``)::

    x   B(G, P_x, index in P_x)    on workers of P_x; zero-volume elsewhere
    y   B(G, P_y, index in P_y)    on workers of P_y; zero-volume elsewhere

Any two Cartesian partitions of the same dimension work: one worker to many, many to
one, different grid shapes, overlapping, disjoint or reordered worker sets, extra
world ranks in neither, and extents smaller than a partition (empty blocks).  Each
worker of ``P_x`` sends the box intersection of its block with every ``P_y`` block to
that block's worker; all messages go in one batched point-to-point round
(:func:`~distfuse.primitives._common.exchange`), a message to oneself is a local copy.
Between two world ranks there is at most one message per direction (a rank holds one
block of each partition), so matching needs no tags; both ends still enumerate in
row-major block order, receivers by ``P_x`` block and senders by ``P_y`` block.

Adjoint: the repartition of the gradient from ``P_y`` back to ``P_x`` (the map is a
permutation of elements, so its adjoint is its inverse).

Global shape.  A worker active only in ``P_y`` holds no data and cannot know ``G`` or
the dtype, and no single ``P_x`` block determines ``G`` (a block of 3 out of 2 workers
may come from 5 or 6).  :class:`Repartition` therefore gathers one record per worker of
``P_x ∪ P_y``: ``(ndim, dtype, requires_grad, problem flag, shape)`` as ``4 + 8`` int64
on the host, all-gathered on the union's gloo group (no device sync, but a
latency-bound collective: on the 2-core dev box, loaded, 2 ranks, 32x32 fp32 blocks,
2.7 ms of a 10 ms call).  Every worker then validates every record, so a bad block
raises the same error on all workers instead of a hang.  The gather runs on the first
call and when some worker's signature (local shape, dtype, device type, grad mode and
``requires_grad``) changed; while they repeat, a one-element flag all-reduce on the
same host group replaces it (the agreement protocol,
:func:`~distfuse.primitives._agreement.agreed_by_flag_round`; no data message reaches
every worker, so the flag cannot ride on one).  Pass ``global_shape`` to skip both.  The functional form
:func:`repartition` takes ``G`` explicitly and skips the gather; its checks are local.

Unlike DistDL, the records also carry ``requires_grad``: if any worker's input requires
grad, every worker's output does, so workers that hold no input still run the adjoint
and nobody waits for a gradient that never comes.  ``backward`` must still be called
on every worker of the union (on a zero-volume output where a worker holds nothing),
and grad mode must agree: a worker under ``torch.no_grad`` cannot be promoted, and its
peers' adjoint then waits for it until the process-group timeout.

Workers: in both partitions, block in and block out; only in ``P_x``, block in and a
zero-volume tensor out (``[b, 0]`` keeping the input's first extent if
``preserve_batch``); only in ``P_y``, zero-volume in and block out; in neither, a clone
of the zero-volume input out (``[0]`` without ``preserve_batch``), with no
communication.

The helpers :func:`~distfuse.primitives.distribute.distribute_tensor` (one world rank's global
tensor to its blocks on ``P``) and :func:`~distfuse.primitives.distribute.collect_tensor` (the
reverse, ``primitives/distribute.py``) are repartitions from and to a
one-worker partition, so they are differentiable too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distfuse import debug
from distfuse.errors import expect
from distfuse.geometry.decomposition import block_range, local_shape, owner_of
from distfuse.partition import CartesianPartition, Partition, union_partition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._common import exchange
from distfuse.primitives._repartition_records import (
    _check_local,
    _check_partitions,
    _gather_records,
    _idle_output,
    _outside,
    _resolve,
    _union_of,
)

__all__ = ["Repartition", "RepartitionFunction", "repartition"]

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
        hits = []
        for j in range(owner_of(n, p_dst, lo), owner_of(n, p_dst, hi - 1) + 1):
            a, b = block_range(n, p_dst, j)
            hits.append((j, (max(a, lo), min(b, hi))))
        per_dim.append(hits)
    return [(tuple(j for j, _ in combo), tuple(r for _, r in combo)) for combo in itertools.product(*per_dim)]


def _relative(box: Sequence[tuple[int, int]], start: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, start, strict=True))


def _block_start(global_shape, P: CartesianPartition, index) -> tuple[int, ...]:
    return tuple(block_range(n, p, i)[0] for n, p, i in zip(global_shape, P.shape, index, strict=True))


# ---------------------------------------------------------------- the data movement


@dataclass(frozen=True)
class _Move:
    """One direction of a repartition on this worker, enough to run it and to build its adjoint.

    ``idle_*`` give the output of a worker that receives nothing (not in ``P_dst``); in
    the adjoint that is the zero gradient of the forward's input, so it keeps that
    input's device even where a placeholder sat on the host under NCCL.  ``dtype`` is
    the dtype of the data on the wire.
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
    sends, recvs, staged = [], [], []
    if P_src.active:
        start = _block_start(G, P_src, P_src.index)
        for j, box in overlaps(G, P_src.shape, P_src.index, P_dst.shape):
            sends.append((P_dst.ranks[P_dst.rank_of(j)], x[_relative(box, start)].contiguous()))
    if not P_dst.active:
        exchange(sends, recvs, op=mv.op)
        return torch.zeros(mv.idle_shape, dtype=mv.idle_dtype, device=mv.idle_device)
    shape = local_shape(G, P_dst.shape, P_dst.index)
    if debug.enabled() and mv.dtype.is_floating_point:
        out = torch.full(shape, float("nan"), dtype=mv.dtype, device=P_dst.device)  # a missed box shows as NaN
    else:
        out = torch.empty(shape, dtype=mv.dtype, device=P_dst.device)  # the boxes tile the block exactly
    start = _block_start(G, P_dst, P_dst.index)
    for i, box in overlaps(G, P_dst.shape, P_dst.index, P_src.shape):
        view = out[_relative(box, start)]
        # A box spanning whole trailing extents is a contiguous view: receive in place, no extra copy.
        buf = view if view.is_contiguous() else torch.empty(view.shape, dtype=mv.dtype, device=out.device)
        recvs.append((P_src.ranks[P_src.rank_of(i)], buf))
        if buf is not view:
            staged.append((view, buf))
    exchange(sends, recvs, op=mv.op)
    for view, buf in staged:
        view.copy_(buf)
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
    idle_shape, idle_dtype = _idle_output(x, P_x, preserve_batch, dtype)
    return RepartitionFunction.apply(x, _Move(P_x, P_y, tuple(G), dtype, idle_shape, idle_dtype, x.device, op))


# ---------------------------------------------------------------- public API


def repartition(x: torch.Tensor, P_x: CartesianPartition, P_y: CartesianPartition, global_shape: Sequence[int],
                preserve_batch: bool = True, dtype: torch.dtype | None = None, agree: bool = False,
                _op: str = "repartition") -> torch.Tensor:
    """Repartition ``x`` from ``P_x`` to ``P_y`` with the global shape given: no metadata collective.

    Every worker of ``P_x ∪ P_y`` must call it with the same ``global_shape``.  Workers
    outside ``P_x`` pass a zero-volume tensor (``requires_grad=True`` if the adjoint must
    run there: no agreement is gathered here); their output dtype is ``dtype``, or the
    placeholder's dtype when ``dtype`` is None.  It must be the dtype of the data:
    gloo receives a bf16 message into an fp32 buffer without any error (checked here),
    leaving garbage.  On ``P_x`` workers a given ``dtype`` must equal ``x.dtype``.

    Checks are local: a wrong block raises on its own worker only, and its peers then
    wait until the process-group timeout, unless ``agree=True``: then every worker of
    ``P_x ∪ P_y`` runs its checks and raises the same error if any worker's fail, at the
    cost of one one-element host all-reduce per call
    (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).  With
    ``DISTFUSE_DEBUG=1`` the workers first check that they agree on the partitions,
    ``global_shape`` and dtype.  With either, the first call for a pair of partitions is
    collective over the world (it creates their union).
    """
    op = _op
    _check_partitions(op, P_x, P_y)
    G = tuple(int(n) for n in global_shape)
    given = dtype
    dtype = x.dtype if dtype is None else dtype

    def checks() -> None:
        if given is not None and P_x.active and x.dtype != given:
            raise expect(op, "dtype of the input", given, x.dtype)
        if P_x == P_y or P_x.active or P_y.active:
            _check_local(op, P_x, x, G)

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
    """Redistribute a tensor from its balanced decomposition over ``P_x`` to the one over ``P_y``.

    Args:
        P_x, P_y: CartesianPartitions with as many dimensions as the tensor.
        preserve_batch: zero-volume outputs keep the input's first extent (DistDL's option).

    Construction is collective over the world (it creates the union partition).  The
    call's records (a small host-side record per union worker) are agreed on under the
    agreement protocol: gathered on the first call and on a change, a one-element flag
    round otherwise (``agreement`` counts them; see the module docstring); pass
    ``global_shape=`` (and ``dtype=``) to :meth:`forward` to skip it and get the
    functional form's local checks instead.  Identical partitions return a
    clone.
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
