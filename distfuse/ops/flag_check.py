"""``distfuse::flag_check``: the agreement flag round of a layer without a collective, as a custom op.

The pooling, upsampling and normalisation layers have no data collective that reaches
every worker (their halo exchange is between neighbours only, and a plan without halos
sends nothing), so in eager calls they agree through
:func:`~distfuse.primitives._agreement.flag_round`: a one-element host all-reduce of the
workers' flags on the partition's meta group.  A host collective cannot be traced, so a
compiled forward runs the same round through this op::

    x        any tensor of the call (the op reads nothing from it; it only carries the
             device for dispatch)
    changed  this worker's flag: its call differs from the one agreed in the last eager
             call (a compile-time constant of its graph: the compiler guards on the
             signature, so a changed call retraces with ``changed`` set)
    returns  nothing; raises the same ShapeError on every worker of the partition when any
             worker's flag is set, after the round (no worker is left waiting)

The round runs on the host-side gloo group and reads no device tensor, so it needs no
CUDA sync.  It is an ``ORDERED`` effect like the other communication ops, so it stays
in program order with the halo round that follows it on every worker, and is never
dropped although its result is unused.  It has no gradient (the flag is not data).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distfuse.errors import ShapeError, where
from distfuse.primitives._agreement import flag_round
from distfuse.primitives._handles import lookup, new_handle

__all__ = ["FlagRound", "flag_check"]


class FlagRound:
    """What the op needs: the layer's name, its partition and what to do when a flag is set.

    ``on_flag`` runs on every worker when some worker flagged (the layer forgets its
    agreement there, so that the next eager call agrees afresh).  ``handle`` names it in
    graphs.
    """

    def __init__(self, op: str, P, on_flag: Callable[[], None]):
        self.op, self.P, self.on_flag = op, P, on_flag
        self.handle = new_handle(self)


@torch.library.custom_op("distfuse::flag_check", mutates_args=())
def flag_check(x: torch.Tensor, handle: int, changed: bool) -> None:
    """Every worker's flag summed (a host all-reduce); raises on every worker when any is set."""
    ctx: FlagRound = lookup(handle)
    if flag_round(ctx.P, changed, ctx.op):
        ctx.on_flag()
        raise ShapeError(f"{where(ctx.op)}: a worker called this compiled layer with inputs (shape, dtype, grad "
                         "flags, autocast) other than those agreed in its last eager call; every worker raises "
                         "here. Call it once eagerly with the new inputs (every worker), then the compiled region "
                         "again")


@flag_check.register_fake
def _(x, handle, changed):
    return None


# Program order on every rank (see distfuse/ops/halo.py); the effect also keeps the unused call in the graph.
torch.library._register_effectful_op(flag_check._qualname, torch.library.EffectType.ORDERED)
