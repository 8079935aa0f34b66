"""``distfuse::flagged_root_broadcast``: a root's packed parameters to every worker, with agreement flags.

The feature convolution's per-call parameter movement as a custom op, so that a compiled
forward carries its agreement check (:mod:`distfuse.primitives._agreement`) without a
host-side gather and without a graph break::

    flat    [n] on the root, a [0] placeholder elsewhere (dtype: the agreed parameter dtype)
    anchor  [0], requires grad when the parameters' gradients are wanted (see below)
    forward every worker sends the root its flag (1 element); the root broadcasts
            [flat, sum of flags] (n + 1 elements) to every worker of the partition
    returns [n] on every worker
    adjoint dflat = sum over workers of dout, onto the root ([n] there, [0] elsewhere)

The flags are read inside the op, where a host read is allowed (it runs eagerly, outside
the compiled code): if any worker flagged a call that differs from the agreed one, every
worker raises the same :class:`~distfuse.errors.ShapeError` after the round and forgets
the agreement (``on_flag``), so the next eager call agrees afresh.  No worker is left
waiting.  On a CUDA partition the flags take the host round of
:mod:`~distfuse.primitives._flag_transport` instead (no device read, no sync), as in
the eager layer.

The placeholder must not be a graph constant: inductor folds ops whose inputs are all
constants at compile time, which ran this round on the non-root workers while the root
was compiling (gloo "Received data size doesn't match").  The layer passes an empty view
of its input; ``anchor`` (an empty leaf made in eager code) makes the output require grad
where the parameters need gradients, so every worker runs the adjoint its root waits for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, where
from distfuse.primitives._common import exchange
from distfuse.primitives._flag_transport import any_flag_on_host, flags_on_host
from distfuse.primitives._handles import lookup, new_handle
from distfuse.primitives.broadcast import copy_blocks, sum_blocks

__all__ = ["RootBroadcast", "flagged_root_broadcast"]


class RootBroadcast:
    """What the op needs: the broadcast plan (root -> P), the root, the workers, the message rank.

    ``on_flag`` runs on every worker when some worker flagged (the layer forgets its
    agreement there).  ``handle`` names it in graphs.
    """

    def __init__(self, op: str, plan, root: int, ranks, ndim: int, on_flag: Callable[[], None], partition=None):
        self.op, self.plan, self.root, self.ranks, self.ndim, self.on_flag = op, plan, root, list(ranks), ndim, on_flag
        self.partition = partition  # the workers' partition: its meta group carries the flags on CUDA
        self.handle = new_handle(self)

    def shape(self, n: int) -> tuple[int, ...]:
        return (1,) * (self.ndim - 1) + (n,)


@torch.library.custom_op("distfuse::flagged_root_broadcast", mutates_args=())
def flagged_root_broadcast(flat: torch.Tensor, anchor: torch.Tensor, handle: int, changed: bool,
                           n: int) -> torch.Tensor:
    """``flat`` (root's ``[n]``) on every worker; raises on every worker when any worker's ``changed`` is set."""
    ctx: RootBroadcast = lookup(handle)
    me = dist.get_rank()
    on_host = ctx.partition is not None and flags_on_host(ctx.partition.device)
    if on_host and any_flag_on_host(ctx.partition, changed, ctx.op):  # CUDA: no device read (_flag_transport)
        flagged = True
    else:
        mine = torch.full((1,), 1.0 if changed and not on_host else 0.0, dtype=flat.dtype, device=flat.device)
        others = [w for w in ctx.ranks if w != ctx.root]
        msg = None
        if me == ctx.root:
            got = [] if on_host else [torch.empty_like(mine) for _ in others]
            if got:
                exchange([], list(zip(others, got, strict=True)), op=ctx.op)
            msg = torch.cat([flat.reshape(-1), sum(got, mine)]).view(ctx.shape(n + 1))
        elif not on_host:
            exchange([(ctx.root, mine)], [], op=ctx.op)
        out = copy_blocks(ctx.plan, msg, ctx.shape(n + 1), flat.dtype, flat.device).view(-1)
        # Inside the op: a host read the compiled graph never sees (in band only: free for CPU tensors).
        flagged = not on_host and bool(out[n] != 0)
    if flagged:
        ctx.on_flag()
        raise ShapeError(f"{where(ctx.op)}: a worker called this compiled layer with inputs (shape, dtype, grad "
                         "flags) other than those agreed in its last eager call; every worker raises here. Call it "
                         "once eagerly with the new inputs (every worker), then the compiled region again")
    return out[:n].clone()


@flagged_root_broadcast.register_fake
def _(flat, anchor, handle, changed, n):
    return flat.new_empty((n,))


@torch.library.custom_op("distfuse::root_sum_reduce", mutates_args=())
def root_sum_reduce(grad: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    """The adjoint: every worker's ``[n]`` summed onto the root (``[n]`` there, ``[0]`` elsewhere)."""
    ctx: RootBroadcast = lookup(handle)
    padded = torch.cat([grad.reshape(-1), grad.new_zeros(1)]).view(ctx.shape(n + 1))  # the flag's slot: zero
    out = sum_blocks(ctx.plan, padded, ctx.shape(n + 1), grad.dtype, grad.device)
    if dist.get_rank() == ctx.root:
        return out.reshape(-1)[:n].clone()
    return grad.new_zeros((0,))


@root_sum_reduce.register_fake
def _(grad, handle, n):
    ctx: RootBroadcast = lookup(handle)
    return grad.new_empty((n,) if dist.get_rank() == ctx.root else (0,))


def _setup(ctx, inputs, output):
    ctx.handle, ctx.n = inputs[2], inputs[4]


def _backward(ctx, grad):
    return root_sum_reduce(grad, ctx.handle, ctx.n), None, None, None, None


flagged_root_broadcast.register_autograd(_backward, setup_context=_setup)

# Program order on every rank (see distfuse/ops/halo.py).
for _op in (flagged_root_broadcast, root_sum_reduce):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
