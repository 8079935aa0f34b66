"""SumReduce: every ``P_y`` worker receives the sum of the ``P_x`` blocks that map to it.

The adjoint of Broadcast: ``SumReduce(P_x, P_y, transpose_src=ts, transpose_dest=td)``
is exactly the adjoint of ``Broadcast(P_y, P_x, transpose_src=td, transpose_dest=ts)``.
``transpose_src`` reverses P_x's partition shape and ``transpose_dest`` P_y's; then
P_y's (effective) shape must broadcast to P_x's, so ``dim(P_y) <= dim(P_x)``.

Per worker (``j(i)`` the P_y worker that P_x worker ``i`` reduces into)::

    forward   y_j  = sum over {i : j(i) = j} of x_i        on every P_y worker j
    adjoint   dx_i = clone(dy_{j(i)})                      on every P_x worker i   (a Broadcast)

The blocks summed into one worker must share a shape and all P_x blocks a dtype; the
sum is taken in that dtype, accumulated in fp32 for bf16/fp16 and rounded once.  A
block must have ``dim(P_x)`` dimensions (one per partition dimension).

Worker roles (the same four cases as Broadcast, with P_x and P_y swapped for the
adjoint):

============  ==========================  =====================================================
active in     forward takes -> returns    adjoint takes -> returns
============  ==========================  =====================================================
P_x and P_y   block -> (other) sum        dy block -> dx block
P_x only      block -> zero-volume [1]_   zero-volume -> dx block
P_y only      zero-volume -> sum          dy block -> zero-volume (the placeholder's shape)
neither       zero-volume -> its clone    zero-volume -> zero-volume
============  ==========================  =====================================================

.. [1] ``[batch, 0]`` with ``preserve_batch=True`` (the default), else ``[0]``.

As for Broadcast: pass ``zero_volume_tensor(requires_grad=True)`` on P_y-only workers
when training, so that the adjoint runs there; the module agrees on block shapes over
``union_partition(P_x, P_y)`` (host gloo, ten int64 per worker, gathered on the first
call and when some worker's block changed, a one-element flag round while they repeat:
:func:`~distfuse.primitives.broadcast.agreed_metadata`) and checks them, raising the
same error on every rank; :func:`sum_reduce` takes the output shape instead and skips
that; the identity case is a clone; debug mode checks
agreement and NaN-poisons receive buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.broadcast_plan import BroadcastPlan, check_gathered_inputs
from distfuse.partition import union_partition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks
from distfuse.primitives._common import check_inactive_input, empty_like_batch
from distfuse.primitives.broadcast import agreed_metadata, copy_blocks, sum_blocks

__all__ = ["SumReduce", "SumReduceFunction", "SumReduceAdjointFunction", "sum_reduce", "sum_reduce_plan"]


def sum_reduce_plan(P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False) -> BroadcastPlan:
    """The plan of ``SumReduce(P_x, P_y, ...)``: the Broadcast plan from P_y to P_x, walked backwards.

    Pure Python; raises :class:`PartitionError` when P_y does not broadcast to P_x.
    """
    return BroadcastPlan("SumReduce", P_y, P_x, transpose_dest, transpose_src, "P_y", "P_x")


class SumReduceFunction(torch.autograd.Function):
    """Autograd form of :func:`sum_reduce`; its backward is :class:`SumReduceAdjointFunction` (the Broadcast).

    Both are differentiable (each one's backward is the other), so gradients of any
    order through a sum-reduce are exact.
    """

    @staticmethod
    def forward(ctx, x, plan: BroadcastPlan, y_shape, y_dtype, preserve_batch: bool, memory_format=None):
        me = dist.get_rank()
        ctx.plan, ctx.preserve_batch, ctx.memory_format = plan, preserve_batch, memory_format
        ctx.x_shape, ctx.x_dtype, ctx.x_device = x.shape, x.dtype, x.device
        # In the plan, P_y is the source side and P_x the destination side.
        device = x.device if plan.is_dst(me) else plan.src_partition.device
        y = sum_blocks(plan, x if plan.is_dst(me) else None, y_shape, y_dtype, device, memory_format)
        if y is None:
            y = empty_like_batch(x, preserve_batch) if plan.is_dst(me) else x.clone()
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = SumReduceAdjointFunction.apply(dy, ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.x_device, ctx.preserve_batch,
                                            ctx.memory_format)
        return dx, None, None, None, None, None


class SumReduceAdjointFunction(torch.autograd.Function):
    """The adjoint of :class:`SumReduceFunction`: every P_x worker gets a copy of its P_y worker's ``dy``.

    ``dx`` has the forward input's shape, dtype and device (zeros outside P_x: the
    gradient of the placeholder).  Its backward is the sum-reduce again.
    """

    @staticmethod
    def forward(ctx, dy, plan: BroadcastPlan, x_shape, x_dtype, x_device, preserve_batch: bool, memory_format=None):
        me = dist.get_rank()
        ctx.plan, ctx.preserve_batch, ctx.memory_format = plan, preserve_batch, memory_format
        ctx.dy_shape, ctx.dy_dtype = tuple(dy.shape), dy.dtype
        dx = copy_blocks(plan, dy if plan.is_src(me) else None, x_shape, x_dtype, x_device, memory_format)
        if dx is None:  # not in P_x: the gradient of the zero-volume placeholder
            dx = torch.zeros(x_shape, dtype=x_dtype, device=x_device)
        return dx

    @staticmethod
    def backward(ctx, ddx):
        ddy = SumReduceFunction.apply(ddx, ctx.plan, ctx.dy_shape if ctx.plan.is_src(dist.get_rank())
                                      else None, ctx.dy_dtype, ctx.preserve_batch, ctx.memory_format)
        return ddy, None, None, None, None, None, None


def _check_args(plan: BroadcastPlan, x: torch.Tensor, y_shape, y_dtype) -> None:
    """:func:`sum_reduce`'s local checks of this worker's arguments (no communication)."""
    op = plan.op
    me = dist.get_rank()
    in_x, in_y = plan.is_dst(me), plan.is_src(me)
    if in_x:
        if x.dim() != plan.ndim:
            raise expect(op, "number of tensor dimensions (one per dimension of P_x)", plan.ndim, x.dim())
        if x.device.type != plan.dst_partition.device.type:
            raise expect(op, "device", plan.dst_partition.device, x.device)
    else:
        check_inactive_input(op, x)
    if in_y:
        if y_shape is None:
            raise ShapeError(f"{where(op)}: this rank is active in P_y, so the functional sum_reduce needs y_shape "
                             "(the shape of the blocks summed into it); the SumReduce module infers it")
        if len(y_shape) != plan.ndim:
            raise expect(op, "number of dimensions of y_shape (one per dimension of P_x)", plan.ndim, len(y_shape))
        if in_x and y_dtype != x.dtype:
            raise expect(op, "y_dtype (the sum keeps the dtype of the P_x blocks)", x.dtype, y_dtype)
    if plan.identity and (in_x or in_y) and tuple(y_shape) != tuple(x.shape):
        raise expect(op, "y_shape (this worker sums only its own block)", tuple(x.shape), tuple(y_shape))


def sum_reduce(x: torch.Tensor, plan: BroadcastPlan, y_shape: Sequence[int] | None = None,
               y_dtype: torch.dtype | None = None, preserve_batch: bool = True, P_union=None,
               memory_format: torch.memory_format | None = None, agree: bool = False) -> torch.Tensor:
    """Functional SumReduce along ``plan`` (from :func:`sum_reduce_plan`), no metadata exchange.

    Args:
        x: this worker's block on P_x workers, a zero-volume tensor elsewhere.
        plan: ``sum_reduce_plan(P_x, P_y, ...)``.
        y_shape: on P_y workers, the shape of the blocks summed into this worker; ignored elsewhere.
        y_dtype: their dtype (default ``x.dtype``).
        preserve_batch: P_x-only workers return ``[x.shape[0], 0]`` instead of ``[0]``.
        P_union: a partition over every worker of P_x and P_y; used for ``agree`` and the
            debug-mode agreement check.
        memory_format: the layout the blocks travel in and the sum comes back in
            (``channels_last`` for a 4-D block); every worker of the plan must pass the
            same one.  Default: contiguous.
        agree: make a failure of the local checks an error on every worker of ``P_union``
            (required then), instead of on the failing worker alone while its peers wait
            in the exchange until the timeout: one one-element host all-reduce per call
            (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).
    """
    op = plan.op
    me = dist.get_rank()
    in_x, in_y = plan.is_dst(me), plan.is_src(me)
    y_dtype = x.dtype if y_dtype is None else y_dtype
    if agree and P_union is None:
        raise ShapeError(f"{where(op)}: agree=True needs P_union (the workers that agree on the checks)")
    if agree and P_union.active and not plan.identity:
        agree_on_local_checks(P_union, op, lambda: _check_args(plan, x, y_shape, y_dtype))
    else:
        _check_args(plan, x, y_shape, y_dtype)
    if not (in_x or in_y) or plan.identity:
        return x.clone()
    if P_union is not None and debug.enabled():
        debug.check_agreement(
            op, P_union.ranks, P_union.meta_group,
            same={"plan": plan.signature, "dtype": str(x.dtype if in_x else y_dtype),
                  "ndim": x.dim() if in_x else len(y_shape)},
            info={"x": tuple(x.shape) if in_x else None, "y": tuple(y_shape) if in_y else None},
        )
    return SumReduceFunction.apply(x, plan, tuple(y_shape) if in_y else None, y_dtype, preserve_batch,
                                   memory_format)


class SumReduce(nn.Module):
    """Sum blocks of ``x`` from ``P_x`` into ``P_y`` (the adjoint of a Broadcast from P_y to P_x).

    Construction is collective over the world (it creates ``union_partition(P_x, P_y)``)
    and raises :class:`PartitionError` on every rank when P_y does not broadcast to P_x.
    Block shapes are agreed over the union (gathered on the first call and on a change, a
    flag round otherwise; ``agreement`` counts them); use :func:`sum_reduce` with
    ``self.plan`` when the shapes are known.
    """

    def __init__(self, P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False,
                 preserve_batch: bool = True):
        super().__init__()
        self.P_x, self.P_y = P_x, P_y
        self.transpose_src, self.transpose_dest = bool(transpose_src), bool(transpose_dest)
        self.preserve_batch = bool(preserve_batch)
        self.plan = sum_reduce_plan(P_x, P_y, transpose_src, transpose_dest)
        self.P_union = union_partition(P_x, P_y)
        self.agreement = AgreementSite(self.plan.op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        me = dist.get_rank()
        if not self.P_union.active:
            check_inactive_input(plan.op, x)
            return x.clone()
        if plan.identity:
            return sum_reduce(x, plan, tuple(x.shape), x.dtype, self.preserve_batch)
        meta = agreed_metadata(self.agreement, self.P_union, plan.op, x, lambda m: check_gathered_inputs(
            plan, self.P_union.ranks, m, data_on="dst", data_name="P_x"))
        y_shape = y_dtype = None
        if plan.is_src(me):
            y_shape, y_dtype = meta[self.P_union.ranks.index(plan.dests_of(me)[0])]
        return sum_reduce(x, plan, y_shape, y_dtype, self.preserve_batch, self.P_union)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.plan.dst_ranks)}, P_y={list(self.plan.src_ranks)}, "
                f"transpose_src={self.transpose_src}, transpose_dest={self.transpose_dest}, "
                f"preserve_batch={self.preserve_batch}")
