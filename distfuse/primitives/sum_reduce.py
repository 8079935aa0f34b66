"""SumReduce: every ``P_y`` worker receives the sum of the ``P_x`` blocks that map to it.

The adjoint of Broadcast: ``SumReduce(P_x, P_y, transpose_src=ts, transpose_dest=td)``
is exactly the adjoint of ``Broadcast(P_y, P_x, transpose_src=td, transpose_dest=ts)``,
so P_y's (effective) shape must broadcast to P_x's and ``dim(P_y) <= dim(P_x)``.

Per worker (``j(i)`` the P_y worker that P_x worker ``i`` reduces into)::

    forward   y_j  = sum over {i : j(i) = j} of x_i        on every P_y worker j
    adjoint   dx_i = clone(dy_{j(i)})                      on every P_x worker i   (a Broadcast)

The blocks summed into one worker must share a shape and all P_x blocks a dtype; the
sum is accumulated in fp32 for bf16/fp16 and rounded once.  A block has ``dim(P_x)``
dimensions.  The worker roles are Broadcast's four cases: P_x workers pass a block, P_y
workers get a sum, the others a zero-volume tensor.

It is Broadcast's op pair walked the other way (``sum_reduce_blocks``,
``distfuse::broadcast_adjoint``) and Broadcast's module
(:class:`~distfuse.primitives.broadcast.PlanModule`): see :mod:`~distfuse.primitives.broadcast`
for the placeholders that must require grad, the agreed metadata, the identity case and
debug mode.  :func:`sum_reduce` takes the output shape instead of agreeing on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse.geometry.broadcast_plan import BroadcastPlan
from distfuse.primitives.broadcast import PlanModule, move_blocks, move_of

__all__ = ["SumReduce", "sum_reduce", "sum_reduce_plan"]


def sum_reduce_plan(P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False) -> BroadcastPlan:
    """The plan of ``SumReduce(P_x, P_y, ...)``: the Broadcast plan from P_y to P_x, walked backwards, its handle
    made at once (pure Python; :class:`PartitionError` when P_y does not broadcast to P_x)."""
    return move_of(BroadcastPlan("SumReduce", P_y, P_x, transpose_dest, transpose_src, "P_y", "P_x")).plan


def sum_reduce(x: torch.Tensor, plan: BroadcastPlan, y_shape: Sequence[int] | None = None,
               y_dtype: torch.dtype | None = None, preserve_batch: bool = True, P_union=None,
               memory_format: torch.memory_format | None = None, agree: bool = False) -> torch.Tensor:
    """Functional SumReduce along ``plan`` (from :func:`sum_reduce_plan`), no metadata exchange.

    Args:
        x: this worker's block on P_x workers, a zero-volume tensor elsewhere.
        plan: ``sum_reduce_plan(P_x, P_y, ...)``.
        y_shape: on P_y workers, the shape of the blocks summed into this worker; ignored elsewhere.
        y_dtype: their dtype (default ``x.dtype``).
        preserve_batch, P_union, memory_format, agree: as for
            :func:`~distfuse.primitives.broadcast.broadcast` (``memory_format``: the layout
            the blocks travel in and the sum comes back in).
    """
    return move_blocks(x, plan, False, y_shape, y_dtype, preserve_batch, P_union, memory_format, agree)


class SumReduce(PlanModule):
    """``SumReduce(P_x, P_y, transpose_src=False, transpose_dest=False, preserve_batch=True)``: sum blocks of ``x``
    from ``P_x`` into ``P_y`` (the adjoint of a Broadcast from P_y to P_x).  See
    :class:`~distfuse.primitives.broadcast.PlanModule`; use :func:`sum_reduce` with ``self.plan`` when the shapes
    are known."""

    forward_walk = False
    plan_of = staticmethod(sum_reduce_plan)
