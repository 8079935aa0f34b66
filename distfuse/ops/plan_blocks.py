"""Blocks moved along a broadcast plan, both ways, as custom ops (see :mod:`distfuse.ops`).

A :class:`~distfuse.geometry.broadcast_plan.BroadcastPlan` pairs each source worker with
its destinations.  The two walks of it are each other's adjoint::

    distfuse::plan_copy(t, anchor, h, out_shape)  sources send t; a destination returns its source's block
                                                  [out_shape]; others [0]          adjoint: the sum onto sources
    distfuse::plan_sum(t, anchor, h, out_shape)   destinations send t; a source returns the sum of its
                                                  destinations' blocks [out_shape]; others [0]   adjoint: the copy

``h`` names a :class:`~distfuse.ops.collectives.PackedBroadcast` (the plan).  They are
:class:`~distfuse.primitives.broadcast.BroadcastFunction` and
:class:`~distfuse.primitives.sum_reduce.SumReduceFunction` with ``preserve_batch=False``
(the same ``copy_blocks`` / ``sum_blocks`` rounds, so compiled and eager agree bitwise):
``DistributedLinear`` broadcasts the input blocks down the columns of its weight grid
with the first and sum-reduces the partial products along its rows with the second.
``anchor`` is an empty tensor that requires grad under grad mode, so that a worker that
only receives still runs the adjoint its peers wait for.  A worker that is not on the
receiving side passes (and gets the gradient of) a zero-volume placeholder.
"""

from __future__ import annotations

import torch

from distfuse.primitives._handles import lookup
from distfuse.primitives.broadcast import copy_blocks, sum_blocks

__all__ = ["plan_copy", "plan_sum"]


def _copy(t, handle, out_shape):
    ctx = lookup(handle)
    return copy_blocks(ctx.plan, t if ctx.is_src else None, tuple(out_shape), t.dtype, t.device)


def _sum(t, handle, out_shape):
    ctx = lookup(handle)
    return sum_blocks(ctx.plan, t if ctx.is_dst else None, tuple(out_shape), t.dtype, t.device)


@torch.library.custom_op("distfuse::plan_copy", mutates_args=())
def plan_copy(t: torch.Tensor, anchor: torch.Tensor, handle: int, out_shape: list[int]) -> torch.Tensor:
    """The sources' blocks on their destinations (``[out_shape]``); ``[0]`` on a worker that is no destination."""
    out = _copy(t, handle, out_shape)
    return out if out is not None else t.new_empty((0,))


@plan_copy.register_fake
def _(t, anchor, handle, out_shape):
    return t.new_empty(tuple(out_shape) if lookup(handle).is_dst else (0,))


@torch.library.custom_op("distfuse::plan_copy_adjoint", mutates_args=())
def plan_copy_adjoint(grad: torch.Tensor, handle: int, t_shape: list[int]) -> torch.Tensor:
    """The destinations' gradients summed onto their source (zeros of ``t_shape`` on a worker that is none)."""
    out = _sum(grad, handle, t_shape)
    return out if out is not None else grad.new_zeros(tuple(t_shape))


@plan_copy_adjoint.register_fake
def _(grad, handle, t_shape):
    return grad.new_empty(tuple(t_shape))


@torch.library.custom_op("distfuse::plan_sum", mutates_args=())
def plan_sum(t: torch.Tensor, anchor: torch.Tensor, handle: int, out_shape: list[int]) -> torch.Tensor:
    """The sum of the destinations' blocks on their source (``[out_shape]``); ``[0]`` on a worker that is none."""
    out = _sum(t, handle, out_shape)
    return out if out is not None else t.new_empty((0,))


@plan_sum.register_fake
def _(t, anchor, handle, out_shape):
    return t.new_empty(tuple(out_shape) if lookup(handle).is_src else (0,))


@torch.library.custom_op("distfuse::plan_sum_adjoint", mutates_args=())
def plan_sum_adjoint(grad: torch.Tensor, handle: int, t_shape: list[int]) -> torch.Tensor:
    """The source's gradient copied to each of its destinations (zeros of ``t_shape`` on a worker that is none)."""
    out = _copy(grad, handle, t_shape)
    return out if out is not None else grad.new_zeros(tuple(t_shape))


@plan_sum_adjoint.register_fake
def _(grad, handle, t_shape):
    return grad.new_empty(tuple(t_shape))


def _setup(ctx, inputs, output):
    t, _, handle, _ = inputs
    ctx.handle, ctx.t_shape = handle, list(t.shape)


def _copy_backward(ctx, grad):
    return plan_copy_adjoint(grad.contiguous(), ctx.handle, ctx.t_shape), None, None, None


def _sum_backward(ctx, grad):
    return plan_sum_adjoint(grad.contiguous(), ctx.handle, ctx.t_shape), None, None, None


plan_copy.register_autograd(_copy_backward, setup_context=_setup)
plan_sum.register_autograd(_sum_backward, setup_context=_setup)

# Program order on every rank (see distfuse/ops/halo.py).
for _op in (plan_copy, plan_copy_adjoint, plan_sum, plan_sum_adjoint):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
