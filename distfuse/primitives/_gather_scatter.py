"""The AllGather / ReduceScatter op pair: each the other's adjoint, one definition for every mode.

Shapes (``P_sub`` a sub-grid, ``layout`` the blocks' :class:`~distfuse.primitives._axes.BlockLayout`,
``x_me`` this worker's block)::

    distfuse::all_gather(x_me, handle, blocks, reduce_dtype, flag)          -> full   [layout.shape]
    distfuse::all_gather_adjoint(full, handle, blocks, reduce_dtype, flag)  -> x_me   the reduce-scatter:
                                                                                      this worker's block of
                                                                                      the sum over P_sub

``handle`` names a :class:`BlockCollective` (the sub-grid and the op name errors carry);
``blocks`` is every sub-grid worker's block extents, flattened in sub-grid rank order
(:attr:`BlockLayout.blocks`): the layout, including uneven tilings.  ``reduce_dtype`` is
the dtype sums are added in (None: the data's).  They live in one file because each
needs the other: the all-gather's adjoint is the reduce-scatter and back, so gradients of
any order are exact (a gradient penalty differentiates through both).

``flag`` carries the agreement flag of :mod:`~distfuse.primitives._agreement` in the
data: -1 sends none (the unflagged collective, a known layout), 0 or 1 this worker's
flag (1: its call changed, it sends zeros of the agreed block).  When any worker's flag
is set every worker raises :class:`~distfuse.primitives.agreement_session.FlaggedCallError`,
after the collective and after the context's ``on_flag`` (a layer's session forgets its
agreement): a settled eager call catches it and gathers the metadata
(:meth:`~distfuse.primitives.agreement_session.AgreementSession.agree_in`), a replayed one
raises it on every worker.  The adjoints never carry a flag (the backward needs no
metadata).

Both are op pairs (:func:`~distfuse.primitives._op_pair.op_pair`): the custom ops while
compiling, the same two implementations through a generated ``autograd.Function`` in
eager calls.  :mod:`~distfuse.primitives.all_gather` and
:mod:`~distfuse.primitives.reduce_scatter` hold the functional forms and the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import (
    BlockLayout,
    axes_subgrid,
    check_partition,
    gather_blocks,
    layout_from_shapes,
    resolve_axes,
    scatter_sum_blocks,
)
from distfuse.primitives._axes_flagged import gather_blocks_flagged, scatter_sum_blocks_flagged
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import op_pair
from distfuse.primitives.agreement_session import AgreementSession, flagged_error

__all__ = ["BlockCollective", "all_gather_op", "reduce_scatter_op", "collective_of", "AxesModule"]


class BlockCollective(HandleOwner):
    """The context of the op pair's calls on one sub-grid: ``op`` (the name errors carry), ``P_sub``, and
    ``on_flag``, run on every worker when a flag was set (None: nothing).  ``handle`` names it in graphs."""

    def __init__(self, op: str, P_sub: CartesianPartition, on_flag: Callable[[], None] | None = None):
        self.op, self.P_sub, self.on_flag = op, P_sub, on_flag
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}
        self.handle = new_handle(self)

    def layout(self, blocks: Sequence[int]) -> BlockLayout:
        """The layout of the flattened block extents ``blocks`` (cached; cleared past 1024 shapes)."""
        key = tuple(blocks)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 1024:
                self._layouts.clear()
            k = self.P_sub.dim
            shapes = [key[j * k:(j + 1) * k] for j in range(self.P_sub.size)]
            layout = self._layouts[key] = layout_from_shapes(self.op, self.P_sub, shapes)
        return layout

    def flagged(self):
        if self.on_flag is not None:
            self.on_flag()
        raise flagged_error(self.op)


_SHARED: dict[tuple, BlockCollective] = {}


def collective_of(op: str, P_sub: CartesianPartition) -> BlockCollective:
    """A context without ``on_flag`` shared by the functional forms' calls on ``P_sub`` (cached by op and ranks, as
    the sub-grids' groups are)."""
    key = (op, tuple(P_sub.ranks), tuple(P_sub.shape))
    ctx = _SHARED.get(key)
    if ctx is None:
        ctx = _SHARED[key] = BlockCollective(op, P_sub)
    return ctx


def _gather(x: torch.Tensor, handle: int, blocks: list[int], reduce_dtype: torch.dtype | None,
            flag: int) -> torch.Tensor:
    """Every worker's block concatenated in index order; ``x`` has this worker's extents of ``blocks``."""
    ctx: BlockCollective = lookup(handle)
    layout = ctx.layout(blocks)
    if flag < 0:
        return gather_blocks(ctx.op, ctx.P_sub, layout, x)
    gathered, flagged = gather_blocks_flagged(ctx.op, ctx.P_sub, layout, x, flag > 0)
    if flagged:
        ctx.flagged()
    return gathered


def _gather_fake(x, handle, blocks, reduce_dtype, flag):
    return x.new_empty(lookup(handle).layout(blocks).shape)


def _scatter(full: torch.Tensor, handle: int, blocks: list[int], reduce_dtype: torch.dtype | None,
             flag: int) -> torch.Tensor:
    """This worker's block of the sum over the sub-grid of every worker's ``full`` (added in ``reduce_dtype``)."""
    ctx: BlockCollective = lookup(handle)
    layout = ctx.layout(blocks)
    if flag < 0:
        return scatter_sum_blocks(ctx.op, ctx.P_sub, layout, full, reduce_dtype)
    block, flagged = scatter_sum_blocks_flagged(ctx.op, ctx.P_sub, layout, full, flag > 0, reduce_dtype)
    if flagged:
        ctx.flagged()
    return block


def _scatter_fake(full, handle, blocks, reduce_dtype, flag):
    layout = lookup(handle).layout(blocks)
    return full.new_empty(layout.extents[layout.me])


def _unflagged(t, handle, blocks, reduce_dtype, flag):
    return handle, blocks, reduce_dtype, -1


all_gather_op, reduce_scatter_op = op_pair("all_gather", _gather, _gather_fake, _scatter, _scatter_fake,
                                           adjoint_args=_unflagged, forward_args=_unflagged)


class AxesModule(nn.Module):
    """What the AllGather and ReduceScatter modules share: ``P_x``, the axes they act along, the sub-grid, and its
    agreement session (``agreement`` its site) with the op pair's context whose flag forgets it.

    ``axes_name`` is the subclass's argument (``axes_all_gather``, ``axes_reduce_scatter``):
    give exactly one of it and ``axes_keep``.  Construction creates the sub-grids, which is
    collective over the whole world: every world rank, active in ``P_x`` or not, constructs
    the module.
    """

    op = ""
    axes_name = ""

    def __init__(self, P_x: CartesianPartition, axes, axes_keep, reduce_dtype: torch.dtype | None):
        super().__init__()
        check_partition(self.op, P_x)
        self.P_x = P_x
        self.axes = resolve_axes(self.op, P_x, axes, axes_keep, self.axes_name)
        self.axes_keep = tuple(d for d in range(P_x.dim) if d not in self.axes)
        self.reduce_dtype = reduce_dtype
        self.P_sub = axes_subgrid(P_x, self.axes)
        self.session = AgreementSession(self.op, self.P_sub)
        self.agreement = self.session.site
        self._ctx = BlockCollective(self.op, self.P_sub, self.session.forget)

    def extra_repr(self) -> str:
        return f"P_x={list(self.P_x.shape)}, {self.axes_name}={self.axes}, reduce_dtype={self.reduce_dtype}"
