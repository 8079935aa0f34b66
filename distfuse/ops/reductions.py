"""Sub-grid sums as custom ops: the norms' replicated parameters and the losses' replicated total.

Shapes (``P`` the sub-grid of the handle's :class:`~distfuse.ops.collectives.FlaggedSite`)::

    distfuse::all_sum(x, h)            -> the sum of x over P          no autograd (used inside adjoints
                                                                        and under no_grad)
    distfuse::replicate(w, h)          -> w (a copy)                   adjoint: all_sum(dw) over P
    distfuse::replicated_total(v, h)   -> the sum of v over P          adjoint: the identity
        v = [..., failure count per worker of P] (the losses' message); a CPU sum with a count
        set raises the same ShapeError on every worker

``replicate`` is how a parameter held by every worker of ``P`` enters a compiled graph:
each worker's forward uses of its copy are terms of one sum, so its gradient is the sum
of the workers' local gradients (every copy gets the global gradient and an optimizer
keeps them equal).  ``replicated_total`` is the losses' reduction: every worker holds the
same scalar and seeds the same gradient, so summing the incoming gradients would count
the loss once per worker; the adjoint is the identity.  Its message ends with one failure
count per worker (the entries of its block that torch's loss would refuse, counted in the
compiled graph, see ``distfuse/layers/_loss_compiled.py``); the op reads them after the sum,
where a host read is allowed (the op runs eagerly), so every worker raises together and
nobody is left waiting.  On a device the counts are not read (no sync; the graph makes
the loss NaN instead).  The eager implementations call
:func:`~distfuse.primitives._axes.all_reduce_sum`, as the eager layers do, so compiled and
eager runs send the same messages and sum in the same order (bitwise equal results).
"""

from __future__ import annotations

import torch

from distfuse.errors import ShapeError, where
from distfuse.ops.collectives import FlaggedSite
from distfuse.primitives._axes import all_reduce_sum
from distfuse.primitives._handles import lookup

__all__ = ["all_sum", "replicate", "replicated_total"]


@torch.library.custom_op("distfuse::all_sum", mutates_args=())
def all_sum(x: torch.Tensor, handle: int) -> torch.Tensor:
    """The sum of ``x`` over the handle's sub-grid, on every worker of it (a new tensor)."""
    ctx: FlaggedSite = lookup(handle)
    return all_reduce_sum(ctx.op, ctx.P_sub, x.contiguous())


@all_sum.register_fake
def _(x, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("distfuse::replicate", mutates_args=())
def replicate(w: torch.Tensor, handle: int) -> torch.Tensor:
    """A copy of ``w`` (a custom op may not return its input); the adjoint sums the gradient over the sub-grid."""
    return w.clone()


@replicate.register_fake
def _(w, handle):
    return torch.empty_like(w)


@torch.library.custom_op("distfuse::replicated_total", mutates_args=())
def replicated_total(partial: torch.Tensor, handle: int) -> torch.Tensor:
    """The sum of ``partial`` over the handle's sub-grid, as one replicated value (see the module docstring)."""
    ctx: FlaggedSite = lookup(handle)
    total = partial.clone() if ctx.P_sub.size == 1 else all_reduce_sum(ctx.op, ctx.P_sub, partial)
    if total.device.type == "cpu":  # a host read inside the op: free for a CPU tensor
        counts = total[-ctx.P_sub.size:].tolist()
        failed = [w for w, n in zip(ctx.P_sub.ranks, counts, strict=True) if n]
        if failed:
            raise ShapeError(f"{where(ctx.op)}: torch's {ctx.op.removeprefix('Distributed')} refused the blocks of "
                             f"world ranks {failed} (bad values: a class index out of range, or a BCE input or target "
                             "outside [0, 1]); found by the compiled graph's check, raised on every worker")
    return total


@replicated_total.register_fake
def _(partial, handle):
    return torch.empty_like(partial, memory_format=torch.contiguous_format)


def _setup_handle(ctx, inputs, output):
    ctx.handle = inputs[1]


def _replicate_backward(ctx, dw):
    return all_sum(dw, ctx.handle), None


def _identity_backward(ctx, grad):
    return grad, None


replicate.register_autograd(_replicate_backward, setup_context=_setup_handle)
replicated_total.register_autograd(_identity_backward, setup_context=_setup_handle)

# Program order on every rank (see distfuse/ops/halo.py); ``replicate`` sends nothing (its adjoint does).
for _op in (all_sum, replicated_total):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
