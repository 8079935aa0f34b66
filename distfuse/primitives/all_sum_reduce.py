"""AllSumReduce: every worker gets the sum over its sub-grid along the chosen partition axes.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid through this worker along
``axes_reduce``; every worker of ``S`` passes the same shape)::

    x  [*shape]   this worker's tensor
    y  [*shape]   sum of x over the workers of S, on every one of them

The tensor need not be partitioned by ``P_x`` (DistDL allows any shape, e.g. the
per-channel statistics of a batch norm).  Self-adjoint: the backward is the same
all-reduce on the gradient, through this Function again, so gradients of any order are
exact.  The output is always a new tensor.

Cost: one ``all_reduce`` on the sub-grid's group, in the data's dtype unless
``reduce_dtype`` says otherwise (:mod:`~distfuse.primitives._axes`).  The module checks
that every worker passes the same shape and dtype under the agreement protocol
(:mod:`~distfuse.primitives._agreement`); the functional form only with ``agree=True``
(or ``DISTFUSE_DEBUG=1``).

The replicated forms, an op pair (:mod:`~distfuse.primitives._op_pair`) over a
:class:`SubGridSum` (the layer's name and the sub-grid ``S``, named by handle)::

    distfuse::replicate(w, h)          -> w (a copy)          adjoint: the sum of the gradients over S
    distfuse::replicate_adjoint(v, h)  -> the sum of v over S  adjoint: the identity (a copy)

``replicate`` is how a parameter held by every worker of ``S`` (a norm's weight) enters a
computation: each copy's uses are terms of one sum, so every copy gets the global gradient
and the copies stay equal with no further message.  ``replicated_sum`` is a sum whose
result is one replicated value (a loss, an instance norm's running statistics): every
worker seeds the same gradient, so summing the gradients back would count it once per
worker; its adjoint is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse.partition import CartesianPartition, check_current_world
from distfuse.primitives._agreement import AgreementSite, run_agreed
from distfuse.primitives._axes import all_reduce_sum, axes_subgrid, check_input
from distfuse.primitives._axes_flagged import all_reduce_sum_flagged
from distfuse.primitives._call_agreement import agree_on_tensor
from distfuse.primitives._common import gather_metadata, same_shape_and_dtype
from distfuse.primitives._flag_deferred import poisoned_stand_in
from distfuse.primitives._flag_transport import flags_deferred
from distfuse.primitives._gather_scatter import AxesModule
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import op_pair

__all__ = ["AllSumReduce", "AllSumReduceFunction", "all_sum_reduce", "agreed_all_sum_reduce", "axes_subgrid",
           "SubGridSum", "replicate", "replicated_sum"]

_OP = "AllSumReduce"


class AllSumReduceFunction(torch.autograd.Function):
    """Autograd Function of :func:`all_sum_reduce` on an active worker of a sub-grid of more than one worker;
    the backward applies it to the gradient (self-adjoint, so differentiable)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, P_sub: CartesianPartition, reduce_dtype: torch.dtype | None,
                summed: torch.Tensor | None = None):
        ctx.P_sub, ctx.reduce_dtype = P_sub, reduce_dtype
        return summed if summed is not None else all_reduce_sum(_OP, P_sub, x, reduce_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return AllSumReduceFunction.apply(dy, ctx.P_sub, ctx.reduce_dtype), None, None, None


def all_sum_reduce(x: torch.Tensor, P_sub: CartesianPartition,
                   reduce_dtype: torch.dtype | None = None, agree: bool = False) -> torch.Tensor:
    """Sum ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`), autograd-aware.

    Collective over ``P_sub`` only.  ``agree=True`` checks that every worker passes the same
    shape, dtype and grad flag before any data moves, as :func:`~distfuse.primitives.all_gather.all_gather` does.
    """
    if agree and P_sub.active:
        agree_on_tensor(P_sub, _OP, x, lambda: check_input(_OP, P_sub, x, ndim=None),
                        shape=tuple(getattr(x, "shape", ())))
    if not check_input(_OP, P_sub, x, ndim=None) or P_sub.size == 1:
        return x.clone()
    return AllSumReduceFunction.apply(x, P_sub, reduce_dtype)


def agreed_all_sum_reduce(x: torch.Tensor, P_sub: CartesianPartition, site: AgreementSite, *,
                          reduce_dtype: torch.dtype | None = None, op: str = _OP) -> torch.Tensor:
    """:func:`all_sum_reduce` with every worker's shape and dtype checked under the agreement protocol (active
    workers of a sub-grid of more than one worker only)."""
    check_current_world(P_sub, op)
    ok = x.device.type == P_sub.device.type

    def attempt(changed: bool):
        shape, dtype = site.state
        mine = x if not changed else poisoned_stand_in(shape, dtype, P_sub.device, x)
        if flags_deferred(P_sub.device):  # the flag is read one call later (_flag_deferred)
            flagged = site.deferred.round(P_sub, changed, op, site.forget)
            summed = None if flagged else all_reduce_sum(op, P_sub, mine.detach(), reduce_dtype)
        else:
            summed, flagged = all_reduce_sum_flagged(op, P_sub, mine.detach(), changed, reduce_dtype)
        if flagged:
            return None, True
        return AllSumReduceFunction.apply(mine, P_sub, reduce_dtype, summed), False

    def slow():
        state = same_shape_and_dtype(op, P_sub, gather_metadata(P_sub, x, op=op), "a tensor")
        return AllSumReduceFunction.apply(x, P_sub, reduce_dtype), state

    return run_agreed(site, (tuple(x.shape), x.dtype, x.device.type), ok, attempt, slow)


class AllSumReduce(AxesModule):
    """Sum-reduce within ``P_x`` along ``axes_reduce`` (or along every axis not in ``axes_keep``); see the module
    doc.  Arguments and construction: :class:`~distfuse.primitives._gather_scatter.AxesModule`."""

    op, axes_name = _OP, "axes_reduce"

    def __init__(self, P_x: CartesianPartition, axes_reduce: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__(P_x, axes_reduce, axes_keep, reduce_dtype)

    def _agree_on(self) -> None:
        self.agreement = AgreementSite(_OP)  # the flag rides in the all-reduce (agreed_all_sum_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._functional(x):
            return all_sum_reduce(x, self.P_sub, self.reduce_dtype)
        return agreed_all_sum_reduce(x, self.P_sub, self.agreement, reduce_dtype=self.reduce_dtype)


class SubGridSum(HandleOwner):
    """The context of the replicated forms' handle: the layer's name ``op`` and the sub-grid ``P``."""

    def __init__(self, op: str, P: CartesianPartition):
        self.op, self.P = op, P
        self.handle = new_handle(self)


def _copy(w: torch.Tensor, handle: int) -> torch.Tensor:
    return w.clone()


def _sum(v: torch.Tensor, handle: int) -> torch.Tensor:
    ctx: SubGridSum = lookup(handle)
    return v.clone() if ctx.P.size == 1 else all_reduce_sum(ctx.op, ctx.P, v.contiguous())


replicate, replicated_sum = op_pair("replicate", _copy, lambda w, handle: torch.empty_like(w), _sum,
                                    lambda v, handle: torch.empty_like(v, memory_format=torch.contiguous_format),
                                    adjoint_args=lambda w, handle: (handle,),
                                    forward_args=lambda v, handle: (handle,))
