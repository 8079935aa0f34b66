"""Sub-grid collectives and packed broadcasts as custom ops (see :mod:`distfuse.ops`).

Shapes (``P_sub`` a sub-grid, ``layout = balanced_layout(P_sub, full_shape)``, ``x_me`` this
worker's block of it)::

    distfuse::gather(x_me, h, full_shape)                  -> full          adjoint: scatter_sum
    distfuse::scatter_sum(full, h, full_shape)             -> x_me          adjoint: gather
    distfuse::agreed_gather(x_me, h, changed, full_shape)  -> full          the flagged all-gather
    distfuse::agreed_scatter_sum(full, h, changed, full_shape) -> x_me      the flagged reduce-scatter
    distfuse::broadcast_packed(flat, anchor, h, n)         -> [1, n] on the plan's destinations
    distfuse::sum_packed(grad, h, n, flat_shape)           -> the sum onto the sources (their flat's shape)

The ``agreed_*`` forms carry the agreement flag of :mod:`~distfuse.primitives._agreement`
(the linear layers' steady state); a set flag raises the same
:class:`~distfuse.errors.ShapeError` on every worker of the sub-grid, after the
collective, and forgets the site's agreement.  ``anchor`` is an empty tensor that
requires grad under grad mode: a worker that only receives parameters then still runs
the sum-reduce its sources wait for (eager code promotes a placeholder instead, which a
compiled graph cannot create).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, where
from distfuse.primitives._axes import balanced_layout, gather_blocks, scatter_sum_blocks
from distfuse.primitives._axes_flagged import gather_blocks_flagged, scatter_sum_blocks_flagged
from distfuse.primitives._handles import lookup, new_handle
from distfuse.primitives.broadcast import copy_blocks, sum_blocks

__all__ = ["FlaggedSite", "gather", "scatter_sum", "agreed_gather", "agreed_scatter_sum", "broadcast_packed",
           "sum_packed", "GRAD_ANCHOR", "NO_ANCHOR", "PackedBroadcast"]

#: The ``anchor`` of :func:`broadcast_packed` under grad mode (a leaf, never given a gradient).
GRAD_ANCHOR = torch.empty(0, requires_grad=True)
NO_ANCHOR = torch.empty(0)


class FlaggedSite:
    """A sub-grid collective's context: op name, sub-grid, the caller's agreement site, the reduce dtype."""

    def __init__(self, op: str, P_sub, site, reduce_dtype: torch.dtype | None = None):
        self.op, self.P_sub, self.site, self.reduce_dtype = op, P_sub, site, reduce_dtype
        self.handle = new_handle(self)

    def layout(self, full_shape):
        return balanced_layout(self.P_sub, tuple(int(n) for n in full_shape))

    def raise_flagged(self):
        self.site.forget()
        raise ShapeError(f"{where(self.op)}: a worker called this compiled layer with inputs (shape, dtype, "
                         "autocast) other than those agreed in its last eager call; every worker raises here. Call "
                         "it once eagerly with the new inputs (every worker), then the compiled region again")


class PackedBroadcast:
    """A broadcast plan's context (a linear layer's parameter broadcast: owners -> users)."""

    def __init__(self, plan, op: str = "ParamBroadcast"):
        self.plan, self.op = plan, op
        me = dist.get_rank()
        self.is_src, self.is_dst = plan.is_src(me), plan.is_dst(me)
        self.handle = new_handle(self)


# ---------------------------------------------------------------- gather / scatter-sum


@torch.library.custom_op("distfuse::gather", mutates_args=())
def gather(x: torch.Tensor, handle: int, full_shape: list[int]) -> torch.Tensor:
    """Every worker's block of ``full_shape`` concatenated (the sub-grid's all-gather)."""
    ctx: FlaggedSite = lookup(handle)
    return gather_blocks(ctx.op, ctx.P_sub, ctx.layout(full_shape), x).clone()


@gather.register_fake
def _(x, handle, full_shape):
    return x.new_empty(tuple(full_shape))


@torch.library.custom_op("distfuse::scatter_sum", mutates_args=())
def scatter_sum(full: torch.Tensor, handle: int, full_shape: list[int]) -> torch.Tensor:
    """This worker's block of the sum of every worker's ``full`` (the sub-grid's reduce-scatter)."""
    ctx: FlaggedSite = lookup(handle)
    return scatter_sum_blocks(ctx.op, ctx.P_sub, ctx.layout(full_shape), full, ctx.reduce_dtype).clone()


@scatter_sum.register_fake
def _(full, handle, full_shape):
    layout = lookup(handle).layout(full_shape)
    return full.new_empty(layout.extents[layout.me])


@torch.library.custom_op("distfuse::agreed_gather", mutates_args=())
def agreed_gather(x: torch.Tensor, handle: int, changed: bool, full_shape: list[int]) -> torch.Tensor:
    """:func:`gather` with the agreement flag; a worker with ``changed`` sends zeros, and every worker raises."""
    ctx: FlaggedSite = lookup(handle)
    layout = ctx.layout(full_shape)
    send = x if not changed else torch.zeros(layout.extents[layout.me], dtype=x.dtype, device=x.device)
    gathered, flagged = gather_blocks_flagged(ctx.op, ctx.P_sub, layout, send, changed)
    if flagged:
        ctx.raise_flagged()
    return gathered.clone()


@agreed_gather.register_fake
def _(x, handle, changed, full_shape):
    return x.new_empty(tuple(full_shape))


@torch.library.custom_op("distfuse::agreed_scatter_sum", mutates_args=())
def agreed_scatter_sum(full: torch.Tensor, handle: int, changed: bool, full_shape: list[int]) -> torch.Tensor:
    """:func:`scatter_sum` with the agreement flag (see :func:`agreed_gather`)."""
    ctx: FlaggedSite = lookup(handle)
    layout = ctx.layout(full_shape)
    send = full if not changed else torch.zeros(layout.shape, dtype=full.dtype, device=full.device)
    block, flagged = scatter_sum_blocks_flagged(ctx.op, ctx.P_sub, layout, send, changed, ctx.reduce_dtype)
    if flagged:
        ctx.raise_flagged()
    return block.clone()


@agreed_scatter_sum.register_fake
def _(full, handle, changed, full_shape):
    layout = lookup(handle).layout(full_shape)
    return full.new_empty(layout.extents[layout.me])


def _setup_gather(ctx, inputs, output):
    ctx.handle, ctx.full_shape = inputs[1], list(inputs[-1])


def _gather_backward(ctx, dy):
    return scatter_sum(dy, ctx.handle, ctx.full_shape), None, None


def _scatter_backward(ctx, dy):
    return gather(dy, ctx.handle, ctx.full_shape), None, None


def _agreed_gather_backward(ctx, dy):
    return scatter_sum(dy, ctx.handle, ctx.full_shape), None, None, None


def _agreed_scatter_backward(ctx, dy):
    return gather(dy, ctx.handle, ctx.full_shape), None, None, None


gather.register_autograd(_gather_backward, setup_context=_setup_gather)
scatter_sum.register_autograd(_scatter_backward, setup_context=_setup_gather)
agreed_gather.register_autograd(_agreed_gather_backward, setup_context=_setup_gather)
agreed_scatter_sum.register_autograd(_agreed_scatter_backward, setup_context=_setup_gather)


# ---------------------------------------------------------------- packed parameter broadcast


@torch.library.custom_op("distfuse::broadcast_packed", mutates_args=())
def broadcast_packed(flat: torch.Tensor, anchor: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    """The sources' ``[1, n]`` on every destination (``[0]`` on a source that is no destination)."""
    ctx: PackedBroadcast = lookup(handle)
    out = copy_blocks(ctx.plan, flat if ctx.is_src else None, (1, n), flat.dtype, flat.device)
    return out if out is not None else flat.new_empty((0,))


@broadcast_packed.register_fake
def _(flat, anchor, handle, n):
    return flat.new_empty((1, n) if lookup(handle).is_dst else (0,))


@torch.library.custom_op("distfuse::sum_packed", mutates_args=())
def sum_packed(grad: torch.Tensor, handle: int, n: int, flat_shape: list[int]) -> torch.Tensor:
    """The adjoint: the destinations' ``[1, n]`` gradients summed onto their source (zeros of ``flat_shape``
    elsewhere)."""
    ctx: PackedBroadcast = lookup(handle)
    out = sum_blocks(ctx.plan, grad if ctx.is_dst else None, (1, n), grad.dtype, grad.device)
    return out.clone() if out is not None else grad.new_zeros(tuple(flat_shape))


@sum_packed.register_fake
def _(grad, handle, n, flat_shape):
    return grad.new_empty(tuple(flat_shape))


def _setup_packed(ctx, inputs, output):
    flat, _, handle, n = inputs
    ctx.handle, ctx.n, ctx.flat_shape = handle, n, list(flat.shape)


def _packed_backward(ctx, grad):
    return sum_packed(grad, ctx.handle, ctx.n, ctx.flat_shape), None, None, None


broadcast_packed.register_autograd(_packed_backward, setup_context=_setup_packed)

# Program order on every rank (see distfuse/ops/halo.py).
for _op in (gather, scatter_sum, agreed_gather, agreed_scatter_sum, broadcast_packed, sum_packed):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
