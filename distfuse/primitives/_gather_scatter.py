"""The AllGather / ReduceScatter op pair: each the other's adjoint, one definition for every mode.

Shapes (``P_sub`` a sub-grid, ``layout`` the blocks' :class:`~distfuse.primitives._axes.BlockLayout`,
``x_me`` this worker's block)::

    distfuse::all_gather(x_me, handle, blocks, reduce_dtype, flag)          -> full   [layout.shape]
    distfuse::all_gather_adjoint(full, handle, blocks, reduce_dtype, flag)  -> x_me   the reduce-scatter:
                                                                                      this worker's block of
                                                                                      the sum over P_sub

``handle`` names a :class:`BlockCollective` (the sub-grid and the op name errors carry);
``blocks`` is every sub-grid worker's block extents, flattened in sub-grid rank order
(:attr:`BlockLayout.blocks`), uneven tilings included.  ``reduce_dtype`` is the dtype sums
are added in (None: the data's).  Each op is the other's backward (:func:`~distfuse.primitives._op_pair.op_pair`),
so gradients of any order are exact (a gradient penalty differentiates through both), in every mode.

``flag`` carries the agreement flag in the data (:mod:`~distfuse.primitives._axes_flagged`):
-1 sends none, 0 or 1 this worker's flag.  When any worker's is set every worker runs the
context's ``on_flag`` and raises :class:`~distfuse.primitives.agreement_session.FlaggedCallError`
(:meth:`~distfuse.primitives.agreement_session.AgreementSession.agree_in`).  Under the
deferred transport (CUDA; :mod:`~distfuse.primitives._flag_deferred`) the flag is read one
call later instead, and a call that only some workers flagged runs with the agreed sizes
(the flagged workers' stand-ins are NaN).  The adjoints never carry a flag (the backward
needs no metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from distfuse import debug
from distfuse.groups import WorldTable
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
from distfuse.primitives._common import cached
from distfuse.primitives._flag_deferred import DeferredFlags
from distfuse.primitives._flag_transport import flags_deferred
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import op_pair
from distfuse.primitives.agreement_session import AgreementSession, flagged_error

__all__ = ["BlockCollective", "all_gather_op", "reduce_scatter_op", "collective_of", "AxesModule"]


class BlockCollective(HandleOwner):
    """The context of the op pair's calls on one sub-grid: ``op`` (the name errors carry), ``P_sub``, and
    ``on_flag``, run on every worker when a flag was set (None: nothing); ``deferred``, its flags under the
    deferred transport.  ``handle`` names it in graphs."""

    def __init__(self, op: str, P_sub: CartesianPartition, on_flag: Callable[[], None] | None = None):
        self.op, self.P_sub, self.on_flag = op, P_sub, on_flag
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}
        self.deferred = DeferredFlags()
        self.handle = new_handle(self)

    def layout(self, blocks: Sequence[int]) -> BlockLayout:
        """The layout of the flattened block extents ``blocks`` (cached; cleared past 1024 shapes)."""
        key, k = tuple(blocks), self.P_sub.dim
        return cached(self._layouts, key, lambda: layout_from_shapes(
            self.op, self.P_sub, [key[j * k:(j + 1) * k] for j in range(self.P_sub.size)]), limit=1024)

    def run(self, plain: Callable, flagged: Callable, t: torch.Tensor, blocks: Sequence[int], flag: int, *extra):
        """``plain(op, P_sub, layout, t, *extra)``, or with ``flag >= 0`` its ``flagged`` form, which raises
        :func:`~distfuse.primitives.agreement_session.flagged_error` on every worker (after ``on_flag``) when any
        flag was set."""
        if flag < 0:
            return plain(self.op, self.P_sub, self.layout(blocks), t, *extra)
        if flags_deferred(self.P_sub.device):
            any_flag = self.deferred.round(self.P_sub, flag > 0, self.op, self.on_flag)
            out = None if any_flag else plain(self.op, self.P_sub, self.layout(blocks), t, *extra)
        else:
            out, any_flag = flagged(self.op, self.P_sub, self.layout(blocks), t, flag > 0, *extra)
        if any_flag:
            if self.on_flag is not None:
                self.on_flag()
            raise flagged_error(self.op)
        return out


_SHARED: WorldTable = WorldTable()


def collective_of(op: str, P_sub: CartesianPartition) -> BlockCollective:
    """A context without ``on_flag`` shared by the functional forms' calls on ``P_sub`` (cached by op and ranks, as
    the sub-grids' groups are)."""
    return cached(_SHARED.current(), (op, tuple(P_sub.ranks), tuple(P_sub.shape)), lambda: BlockCollective(op, P_sub))


def _gather(x: torch.Tensor, handle: int, blocks: list[int], reduce_dtype: torch.dtype | None,
            flag: int) -> torch.Tensor:
    """Every worker's block concatenated in index order; ``x`` has this worker's extents of ``blocks``."""
    return lookup(handle).run(gather_blocks, gather_blocks_flagged, x, blocks, flag)


def _gather_fake(x, handle, blocks, reduce_dtype, flag):
    return x.new_empty(lookup(handle).layout(blocks).shape)


def _scatter(full: torch.Tensor, handle: int, blocks: list[int], reduce_dtype: torch.dtype | None,
             flag: int) -> torch.Tensor:
    """This worker's block of the sum over the sub-grid of every worker's ``full`` (added in ``reduce_dtype``)."""
    return lookup(handle).run(scatter_sum_blocks, scatter_sum_blocks_flagged, full, blocks, flag, reduce_dtype)


def _scatter_fake(full, handle, blocks, reduce_dtype, flag):
    layout = lookup(handle).layout(blocks)
    return full.new_empty(layout.extents[layout.me])


def _unflagged(t, handle, blocks, reduce_dtype, flag):
    return handle, blocks, reduce_dtype, -1


all_gather_op, reduce_scatter_op = op_pair("all_gather", _gather, _gather_fake, _scatter, _scatter_fake,
                                           adjoint_args=_unflagged, forward_args=_unflagged)


class AxesModule(nn.Module):
    """What the AllGather, ReduceScatter and AllSumReduce modules share: ``P_x``, the axes they act along and the
    sub-grid; :meth:`_agree_on` sets up the agreement (here: a session whose flag rides in the op pair).

    Arguments: ``P_x``, the Cartesian partition; the axes to act along (the subclass's
    ``axes_name``: ``axes_all_gather``, ``axes_reduce_scatter``, ``axes_reduce``) or
    ``axes_keep``, the axes *not* to act along (exactly one of the two); ``reduce_dtype``,
    the dtype sums are added in (e.g. ``torch.float32`` for bf16; default the data's).
    Construction creates the sub-grids, which is collective over the whole world: every
    world rank, active in ``P_x`` or not, constructs the module.
    """

    op = ""
    axes_name = ""

    def __init__(self, P_x: CartesianPartition, axes, axes_keep, reduce_dtype: torch.dtype | None):
        super().__init__()
        check_partition(self.op, P_x)
        self.P_x = P_x
        self.axes = resolve_axes(self.op, P_x, axes, axes_keep, self.axes_name)
        setattr(self, self.axes_name, self.axes)  # axes_all_gather, ...: the argument's name
        self.axes_keep = tuple(d for d in range(P_x.dim) if d not in self.axes)
        self.reduce_dtype = reduce_dtype
        self.P_sub = axes_subgrid(P_x, self.axes)
        self._agree_on()

    def _agree_on(self) -> None:
        """The agreement of the sub-grid's calls: ``session``, its site ``agreement``, and the op pair's context."""
        self.session = AgreementSession(self.op, self.P_sub)
        self.agreement = self.session.site
        self._ctx = BlockCollective(self.op, self.P_sub, self.session.forget)

    def _functional(self, x) -> bool:
        """Whether a call runs the functional form: no agreement for an inactive worker, a one-worker sub-grid, an
        input that is not a tensor (refused there by name), or in debug mode (which compares every call instead)."""
        P_sub = self.P_sub
        return not P_sub.active or P_sub.size == 1 or not isinstance(x, torch.Tensor) or debug.enabled()

    def extra_repr(self) -> str:
        return f"P_x={list(self.P_x.shape)}, {self.axes_name}={self.axes}, reduce_dtype={self.reduce_dtype}"
