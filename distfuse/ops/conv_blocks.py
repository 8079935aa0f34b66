"""The channel and general convolutions' data movement as custom ops: block moves and the halo round.

The channel and general convolutions broadcast the input blocks from P_x to the weight
workers and sum-reduce the partial outputs onto P_y; a ``channels_last`` input travels
and comes back ``channels_last`` (:mod:`~distfuse.primitives._layout`).  These are
:class:`~distfuse.primitives.broadcast.BroadcastFunction` and
:class:`~distfuse.primitives.sum_reduce.SumReduceFunction` with that format as an
argument (``fmt``: 0 contiguous, 1 channels_last, 2 channels_last_3d), calling the same
``copy_blocks`` / ``sum_blocks`` rounds, so compiled and eager calls send the same
messages and agree bitwise::

    distfuse::block_broadcast(t, anchor, h, out_shape, fmt)    sources send t; a destination returns its
                                                               source's block [out_shape]; others [0]
        adjoint  distfuse::block_broadcast_adjoint              the destinations' gradients summed onto
                                                               their source (zeros of t's shape elsewhere)
    distfuse::block_sum_reduce(t, anchor, h, out_shape, fmt, ties)  the plan walked backwards: destinations
                                                               send t; a source returns their sum [out_shape]
        adjoint  distfuse::block_sum_reduce_adjoint             the source's gradient copied to each of its
                                                               destinations

    distfuse::conv_halo(x, anchor, h, G)                       the halo round of the input workers (P_x):
                                                               the staged block; a copy of the placeholder
                                                               on the other workers of the union
        adjoint  distfuse::conv_halo_adjoint                    the halo adjoint on P_x; zeros elsewhere

``conv_halo`` is ``distfuse::halo_exchange`` (:mod:`~distfuse.ops.halo`, the same
``halo_forward`` / ``halo_adjoint`` rounds) made callable on workers outside the
exchange's partition, so that every worker of a general convolution traces the same
sequence of ops.  ``h`` there names the
:class:`~distfuse.primitives.halo_exchange.HaloExchange`.

For the block moves, ``h`` names a :class:`~distfuse.ops.collectives.PackedBroadcast`
(the plan and this worker's roles in it).  ``anchor`` is an empty tensor that requires grad when the
adjoint must run (:data:`~distfuse.ops.collectives.GRAD_ANCHOR`): a worker that only
receives, or whose block does not require grad, then still runs the adjoint round its
peers wait for, as eager code does by promoting a placeholder.  Outputs and gradients
are dense in ``fmt`` in the eager and the fake implementation alike.  ``distfuse::plan_copy``
/ ``plan_sum`` (:mod:`~distfuse.ops.plan_blocks`) are the contiguous 2-D forms the
linear layer uses.
"""

from __future__ import annotations

import torch

from distfuse.primitives._handles import lookup
from distfuse.primitives._layout import empty_in, format_code, format_of_code, memory_format_of
from distfuse.primitives.broadcast import copy_blocks, sum_blocks
from distfuse.primitives.halo_exchange import halo_adjoint, halo_forward

__all__ = ["block_broadcast", "block_sum_reduce", "conv_halo"]


def _copy(t, handle, out_shape, fmt):
    ctx = lookup(handle)
    return copy_blocks(ctx.plan, t if ctx.is_src else None, tuple(out_shape), t.dtype, t.device, format_of_code(fmt))


def _sum(t, handle, out_shape, fmt):
    ctx = lookup(handle)
    return sum_blocks(ctx.plan, t if ctx.is_dst else None, tuple(out_shape), t.dtype, t.device, format_of_code(fmt))


def _fake(t, shape, fmt, present: bool):
    return empty_in(tuple(shape), format_of_code(fmt), dtype=t.dtype, device=t.device) if present else \
        t.new_empty((0,))


@torch.library.custom_op("distfuse::block_broadcast", mutates_args=())
def block_broadcast(t: torch.Tensor, anchor: torch.Tensor, handle: int, out_shape: list[int],
                    fmt: int) -> torch.Tensor:
    """The source's block on each destination (``[out_shape]`` in ``fmt``); ``[0]`` on a worker that is none."""
    out = _copy(t, handle, out_shape, fmt)
    return out if out is not None else t.new_empty((0,))


@block_broadcast.register_fake
def _(t, anchor, handle, out_shape, fmt):
    return _fake(t, out_shape, fmt, lookup(handle).is_dst)


@torch.library.custom_op("distfuse::block_broadcast_adjoint", mutates_args=())
def block_broadcast_adjoint(grad: torch.Tensor, handle: int, t_shape: list[int], fmt: int) -> torch.Tensor:
    """The destinations' gradients summed onto their source (``[t_shape]``; zeros on a worker that is none)."""
    out = _sum(grad, handle, t_shape, fmt)
    return out if out is not None else grad.new_zeros(tuple(t_shape))


@block_broadcast_adjoint.register_fake
def _(grad, handle, t_shape, fmt):
    return _fake(grad, t_shape, fmt if lookup(handle).is_src else 0, True)


@torch.library.custom_op("distfuse::block_sum_reduce", mutates_args=())
def block_sum_reduce(t: torch.Tensor, anchor: torch.Tensor, handle: int, out_shape: list[int], fmt: int,
                     ties: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the destinations' blocks on their source (``[out_shape]`` in ``fmt``); ``[0]`` elsewhere.

    ``ties``: zero-volume outputs of earlier moves that this worker does not use (it takes
    no part in them); they get zero gradients, so the adjoints of those moves run here too
    (sending nothing) and every worker's backward graph holds the same ops.
    """
    out = _sum(t, handle, out_shape, fmt)
    return out if out is not None else t.new_empty((0,))


@block_sum_reduce.register_fake
def _(t, anchor, handle, out_shape, fmt, ties):
    return _fake(t, out_shape, fmt, lookup(handle).is_src)


@torch.library.custom_op("distfuse::block_sum_reduce_adjoint", mutates_args=())
def block_sum_reduce_adjoint(grad: torch.Tensor, handle: int, t_shape: list[int], fmt: int) -> torch.Tensor:
    """The source's gradient copied to each of its destinations (``[t_shape]``; zeros on a worker that is none)."""
    out = _copy(grad, handle, t_shape, fmt)
    return out if out is not None else grad.new_zeros(tuple(t_shape))


@block_sum_reduce_adjoint.register_fake
def _(grad, handle, t_shape, fmt):
    return _fake(grad, t_shape, fmt if lookup(handle).is_dst else 0, True)


def _setup(ctx, inputs, output):
    t, _, handle, _, fmt = inputs[:5]
    ctx.handle, ctx.t_shape, ctx.fmt = handle, list(t.shape), fmt
    ctx.ties = [(tuple(u.shape), u.dtype, u.device) for u in inputs[5]] if len(inputs) > 5 else []


def _broadcast_backward(ctx, grad):
    return block_broadcast_adjoint(grad, ctx.handle, ctx.t_shape, ctx.fmt), None, None, None, None


def _sum_reduce_backward(ctx, grad):
    ties = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.ties]
    return block_sum_reduce_adjoint(grad, ctx.handle, ctx.t_shape, ctx.fmt), None, None, None, None, ties


def _setup_adjoint(ctx, inputs, output):
    grad, handle, _, fmt = inputs
    ctx.handle, ctx.grad_shape, ctx.fmt = handle, list(grad.shape), fmt


def _broadcast_adjoint_backward(ctx, ggrad):
    # The adjoint's adjoint is the broadcast again: gradients of any order are exact, as in eager code.
    return block_broadcast(ggrad, ggrad.new_empty((0,)), ctx.handle, ctx.grad_shape, ctx.fmt), None, None, None


def _sum_reduce_adjoint_backward(ctx, ggrad):
    return block_sum_reduce(ggrad, ggrad.new_empty((0,)), ctx.handle, ctx.grad_shape, ctx.fmt, []), None, None, None


block_broadcast.register_autograd(_broadcast_backward, setup_context=_setup)
block_sum_reduce.register_autograd(_sum_reduce_backward, setup_context=_setup)
block_broadcast_adjoint.register_autograd(_broadcast_adjoint_backward, setup_context=_setup_adjoint)
block_sum_reduce_adjoint.register_autograd(_sum_reduce_adjoint_backward, setup_context=_setup_adjoint)



# ---------------------------------------------------------------- the input workers' halo round


def _halo_geometry(handle: int, global_shape):
    halo = lookup(handle)
    if not halo.P_x.active:
        return halo, None, None
    return halo, halo.plan(tuple(global_shape)), halo.P_x.index[halo.P_x.dim - halo.nd:]


@torch.library.custom_op("distfuse::conv_halo", mutates_args=())
def conv_halo(x: torch.Tensor, anchor: torch.Tensor, handle: int, global_shape: list[int]) -> torch.Tensor:
    """The staged block on the exchange's workers (one halo round); a copy of ``x`` on any other worker."""
    halo, plan, index = _halo_geometry(handle, global_shape)
    if plan is None:
        return x.clone()
    return halo_forward(x, plan, index, halo.world_of_fn(), halo._op)


@conv_halo.register_fake
def _(x, anchor, handle, global_shape):
    _, plan, index = _halo_geometry(handle, global_shape)
    if plan is None:
        return torch.empty_like(x)
    lead = tuple(x.shape[: x.dim() - len(plan.axes)])
    return empty_in(lead + plan.staged_shape(index), memory_format_of(x), dtype=x.dtype, device=x.device)


@torch.library.custom_op("distfuse::conv_halo_adjoint", mutates_args=())
def conv_halo_adjoint(grad: torch.Tensor, handle: int, global_shape: list[int], x_shape: list[int],
                      x_format: int) -> torch.Tensor:
    """Every staged box's gradient sent home and accumulated, ``[x_shape]`` (zeros off the exchange)."""
    halo, plan, index = _halo_geometry(handle, global_shape)
    if plan is None:
        return grad.new_zeros(tuple(x_shape))
    return halo_adjoint(grad, plan, index, halo.world_of_fn(), tuple(x_shape), halo._op, format_of_code(x_format))


@conv_halo_adjoint.register_fake
def _(grad, handle, global_shape, x_shape, x_format):
    _, plan, _ = _halo_geometry(handle, global_shape)
    fmt = format_of_code(x_format) if plan is not None else torch.contiguous_format
    return empty_in(tuple(x_shape), fmt, dtype=grad.dtype, device=grad.device)


def _setup_halo(ctx, inputs, output):
    x, _, handle, global_shape = inputs
    ctx.args = (handle, list(global_shape), list(x.shape), format_code(memory_format_of(x)))


def _halo_backward(ctx, grad):
    return conv_halo_adjoint(grad, *ctx.args), None, None, None


def _setup_halo_adjoint(ctx, inputs, output):
    ctx.args = (inputs[1], list(inputs[2]))


def _halo_adjoint_backward(ctx, ggrad_x):
    return conv_halo(ggrad_x, ggrad_x.new_empty((0,)), *ctx.args), None, None, None, None


conv_halo.register_autograd(_halo_backward, setup_context=_setup_halo)
conv_halo_adjoint.register_autograd(_halo_adjoint_backward, setup_context=_setup_halo_adjoint)

# Program order on every rank (see distfuse/ops/halo.py).
for _op in (block_broadcast, block_broadcast_adjoint, block_sum_reduce, block_sum_reduce_adjoint, conv_halo,
            conv_halo_adjoint):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
