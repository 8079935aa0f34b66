"""``distfuse::halo_exchange`` and its adjoint as custom ops (see :mod:`distfuse.ops`).

Shapes (worker at spatial index ``s`` of the exchange's partition)::

    x       [*lead, *n_s]     -> staged [*lead, *L_s]     L_s = plan.staged_shape(s)
    adjoint dstaged [*lead, *L_s] -> dx [*lead, *n_s]

``handle`` names the :class:`~distfuse.primitives.halo_exchange.HaloExchange` (its
partition, kernel, stride, dilation, padding); ``global_shape`` picks the plan.  The
staged input and the block gradient are in the block's memory format (``x_format``:
0 contiguous, 1 channels_last, 2 channels_last_3d), in eager and fake alike.  Each op's
backward is the other, so double backward through a compiled halo exchange is exact.
"""

from __future__ import annotations

import torch

from distfuse.primitives._handles import lookup
from distfuse.primitives._layout import empty_in, format_code, format_of_code, memory_format_of
from distfuse.primitives.halo_exchange import halo_adjoint, halo_forward

__all__ = ["halo_exchange", "halo_exchange_adjoint"]


def _geometry(handle: int, global_shape):
    halo = lookup(handle)
    plan = halo.plan(tuple(global_shape))
    index = halo.P_x.index[halo.P_x.dim - halo.nd:]
    return halo, plan, index


@torch.library.custom_op("distfuse::halo_exchange", mutates_args=())
def halo_exchange(x: torch.Tensor, handle: int, global_shape: list[int]) -> torch.Tensor:
    """Stage ``x`` (this worker's block) with its halos and the boundary padding; one exchange round."""
    halo, plan, index = _geometry(handle, global_shape)
    return halo_forward(x, plan, index, halo.world_of_fn(), halo._op)


@halo_exchange.register_fake
def _(x, handle, global_shape):
    _, plan, index = _geometry(handle, global_shape)
    lead = tuple(x.shape[: x.dim() - len(plan.axes)])
    return empty_in(lead + plan.staged_shape(index), memory_format_of(x), dtype=x.dtype, device=x.device)


@torch.library.custom_op("distfuse::halo_exchange_adjoint", mutates_args=())
def halo_exchange_adjoint(grad: torch.Tensor, handle: int, global_shape: list[int], x_shape: list[int],
                          x_format: int) -> torch.Tensor:
    """Send every staged box's gradient home and accumulate: ``[x_shape]`` in ``x_format``."""
    halo, plan, index = _geometry(handle, global_shape)
    return halo_adjoint(grad, plan, index, halo.world_of_fn(), tuple(x_shape), halo._op, format_of_code(x_format))


@halo_exchange_adjoint.register_fake
def _(grad, handle, global_shape, x_shape, x_format):
    return empty_in(tuple(x_shape), format_of_code(x_format), dtype=grad.dtype, device=grad.device)


def _setup(ctx, inputs, output):
    x, handle, global_shape = inputs
    ctx.args = (handle, list(global_shape), list(x.shape), format_code(memory_format_of(x)))


def _backward(ctx, grad):
    return halo_exchange_adjoint(grad, *ctx.args), None, None


def _setup_adjoint(ctx, inputs, output):
    _, handle, global_shape, _, _ = inputs
    ctx.args = (handle, list(global_shape))


def _backward_adjoint(ctx, ggrad_x):
    return halo_exchange(ggrad_x, *ctx.args), None, None, None, None


halo_exchange.register_autograd(_backward, setup_context=_setup)
halo_exchange_adjoint.register_autograd(_backward_adjoint, setup_context=_setup_adjoint)

# Communication must run in program order on every rank: an ORDERED effect keeps the compiler (inductor's
# scheduler, AOT's partitioner) from reordering these ops against one another (a reordered pair of rounds on
# one rank met its peers' other round: gloo "Received data size doesn't match" under inductor).
for _op in (halo_exchange, halo_exchange_adjoint):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
