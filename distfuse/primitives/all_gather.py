"""AllGather: every worker gets the concatenation of its sub-grid's blocks along the gathered dimensions.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid along ``axes_all_gather``,
``A`` the gathered axes; partition dimension ``d`` splits tensor dimension ``d``)::

    x  [n_0, ..., n_k]   this worker's block
    y  [N_0, ..., N_k]   N_d = sum of the blocks' extents along d for d in A, N_d = n_d otherwise;
                         the blocks concatenated in index order, the same on every worker of S

Several axes may be gathered at once (DistDL allows one).  Blocks may be uneven or empty;
they need only tile.  Adjoint: a reduce-scatter (each worker's input gradient is the sum
over ``S`` of the output gradients restricted to its block), the other half of the op
pair of :mod:`~distfuse.primitives._gather_scatter`.

Cost: blocks are padded to the largest block and moved with one flat all-gather on the
sub-grid's group (:mod:`~distfuse.primitives._axes`).  The receivers must know every
block's extent: the module learns them under the agreement protocol
(:func:`agreed_all_gather`), so blocks that disagree (rows, dtype, even fp16 against
bf16) raise the same :class:`~distfuse.errors.ShapeError` on every worker instead of
aborting in gloo or returning garbage.  Callers that know the full shape pass it as
``out_shape``: no exchange, local checks only.  The backward needs no metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import (
    axes_subgrid,
    balanced_layout,
    check_input,
    gathered_layout,
    layout_from_shapes,
)
from distfuse.primitives._call_agreement import agree_on_tensor
from distfuse.primitives._common import gather_metadata
from distfuse.primitives._gather_scatter import AxesModule, BlockCollective, all_gather_op, collective_of
from distfuse.primitives.agreement_session import AgreementSession

__all__ = ["AllGather", "all_gather", "agreed_all_gather", "axes_subgrid"]

_OP = "AllGather"


def all_gather(x: torch.Tensor, P_sub: CartesianPartition, out_shape: Sequence[int] | None = None,
               reduce_dtype: torch.dtype | None = None, agree: bool = False) -> torch.Tensor:
    """Gather ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`), autograd-aware.

    Args:
        x: this worker's block, one tensor dimension per partition dimension.
        P_sub: the sub-grid; it has extent > 1 exactly in the gathered dimensions.
        out_shape: the output shape, if known (full extents along the gathered dimensions,
            local ones elsewhere); the blocks are then its balanced decomposition and no
            metadata is exchanged.  Every worker of ``P_sub`` must pass the same value.
        reduce_dtype: dtype the backward's reduce-scatter adds in; default the gradient's.
        agree: check that every worker passes the same ``out_shape``, dtype and grad flag,
            and a block of the right shape, before any data moves (one host round,
            :func:`~distfuse.primitives._call_agreement.agree_on_call`); without it the
            call trusts its arguments, as the layers that call it do.
    """
    if agree and P_sub.active:
        _agree(x, P_sub, out_shape)
    if not check_input(_OP, P_sub, x, ndim=P_sub.dim):
        return x.clone()
    if out_shape is not None:
        out_shape = tuple(int(n) for n in out_shape)
        if len(out_shape) != P_sub.dim:
            raise expect(_OP, "number of dimensions of out_shape", P_sub.dim, len(out_shape))
    if P_sub.size == 1:
        if out_shape is not None and out_shape != tuple(x.shape):
            raise expect(_OP, "local block shape (a one-worker gather is an identity)", out_shape, tuple(x.shape))
        return x.clone()
    layout = balanced_layout(P_sub, out_shape) if out_shape is not None else gathered_layout(_OP, P_sub, x)
    return all_gather_op(x, collective_of(_OP, P_sub).handle, layout.blocks, reduce_dtype, -1)


def _agree(x, P_sub: CartesianPartition, out_shape) -> None:
    """:func:`all_gather`'s ``agree=True``: every worker's arguments and block checked in one host round."""
    def checks():
        check_input(_OP, P_sub, x, ndim=P_sub.dim)
        if out_shape is not None:
            if len(out_shape) != P_sub.dim:
                raise expect(_OP, "number of dimensions of out_shape", P_sub.dim, len(out_shape))
            layout = balanced_layout(P_sub, tuple(int(n) for n in out_shape))
            if tuple(x.shape) != layout.extents[layout.me]:
                raise expect(_OP, "local block shape (the balanced block of out_shape)", layout.extents[layout.me],
                             tuple(x.shape))

    agree_on_tensor(P_sub, _OP, x, checks, out_shape=None if out_shape is None else tuple(int(n) for n in out_shape))


def agreed_all_gather(x: torch.Tensor, ctx: BlockCollective, session: AgreementSession, *, extra=(),
                      locally_ok: bool = True, check=None, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather ``x`` over ``ctx.P_sub`` with blocks learnt under the agreement protocol; autograd-aware, every mode.

    ``ctx`` is the caller's :class:`~distfuse.primitives._gather_scatter.BlockCollective`
    (its ``on_flag`` the session's ``forget``), ``session`` its
    :class:`~distfuse.primitives.agreement_session.AgreementSession`; the flag rides in the
    gather.  The slow path gathers every worker's ``(shape, dtype)`` (the signature is
    ``(shape, dtype, device type, *extra)``): one dtype, blocks that tile, and the caller's
    ``check(shapes, dtype)``.  Active workers of a sub-grid of more than one worker only.
    """
    op, P_sub = ctx.op, ctx.P_sub
    ok = locally_ok and x.dim() == P_sub.dim and x.device.type == P_sub.device.type

    def run(state, flag: int) -> torch.Tensor:
        layout, dtype = state
        send = x if flag != 1 else torch.zeros(layout.extents[layout.me], dtype=dtype, device=P_sub.device)
        return all_gather_op(send, ctx.handle, layout.blocks, reduce_dtype, flag)

    def gather():
        meta = gather_metadata(P_sub, x, op=op)
        for r, (s, _) in zip(P_sub.ranks, meta, strict=True):
            if len(s) != P_sub.dim:
                raise expect(op, f"number of tensor dimensions (one per partition dimension) of world rank {r}'s "
                             "block", P_sub.dim, len(s))
        dtypes = {dt for _, dt in meta}
        if len(dtypes) != 1 or None in dtypes:
            rows = ", ".join(f"rank {r}: {dt}" for r, (_, dt) in zip(P_sub.ranks, meta, strict=True))
            raise ShapeError(f"{where(op)}: every worker must pass the same dtype; got {rows} (world rank: dtype)")
        shapes = [s for s, _ in meta]
        layout = layout_from_shapes(op, P_sub, shapes)
        dtype = dtypes.pop()
        if check is not None:
            check(shapes, dtype)
        return all_gather_op(x, ctx.handle, layout.blocks, reduce_dtype, -1), (layout, dtype)

    return session.agree_in((tuple(x.shape), x.dtype, x.device.type, *extra), ok, run, gather)


class AllGather(AxesModule):
    """All-gather within ``P_x`` along ``axes_all_gather`` (or every axis not in ``axes_keep``); see the module doc.

    Arguments and construction: :class:`~distfuse.primitives._gather_scatter.AxesModule`
    (``reduce_dtype``: the dtype the backward's reduce-scatter adds in).
    """

    op, axes_name = _OP, "axes_all_gather"

    def __init__(self, P_x: CartesianPartition, axes_all_gather: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__(P_x, axes_all_gather, axes_keep, reduce_dtype)
        self.axes_all_gather = self.axes

    def forward(self, x: torch.Tensor, out_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Gather ``x``; ``out_shape`` skips the agreement protocol (see :func:`all_gather`)."""
        P_sub = self.P_sub
        if (out_shape is not None or not P_sub.active or P_sub.size == 1 or not isinstance(x, torch.Tensor)
                or debug.enabled()):  # debug mode gathers and compares every call instead
            return all_gather(x, P_sub, out_shape, self.reduce_dtype)
        return agreed_all_gather(x, self._ctx, self.session, reduce_dtype=self.reduce_dtype)
