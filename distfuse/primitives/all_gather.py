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

from distfuse.errors import expect
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import axes_subgrid, balanced_layout, check_input, gathered_layout
from distfuse.primitives._call_agreement import agree_on_tensor
from distfuse.primitives._flag_deferred import poisoned_stand_in
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
    out_shape = None if out_shape is None else tuple(int(n) for n in out_shape)
    if agree and P_sub.active:
        agree_on_tensor(P_sub, _OP, x, lambda: _check(x, P_sub, out_shape, True), out_shape=out_shape)
    if not _check(x, P_sub, out_shape, P_sub.size == 1) or P_sub.size == 1:
        return x.clone()
    layout = balanced_layout(P_sub, out_shape) if out_shape is not None else gathered_layout(_OP, P_sub, x)[0]
    return all_gather_op(x, collective_of(_OP, P_sub).handle, layout.blocks, reduce_dtype, -1)


def _check(x, P_sub: CartesianPartition, out_shape: tuple[int, ...] | None, block: bool) -> bool:
    """:func:`all_gather`'s local checks (False: this worker is inactive); ``block``: that ``x`` is the balanced block
    of ``out_shape`` too (else the gather checks it, in debug mode on every worker alike)."""
    if not check_input(_OP, P_sub, x, ndim=P_sub.dim):
        return False
    if out_shape is not None and len(out_shape) != P_sub.dim:
        raise expect(_OP, "number of dimensions of out_shape", P_sub.dim, len(out_shape))
    if out_shape is not None and block:
        layout = balanced_layout(P_sub, out_shape)
        if tuple(x.shape) != layout.extents[layout.me]:
            raise expect(_OP, "local block shape (the balanced block of out_shape)", layout.extents[layout.me],
                         tuple(x.shape))
    return True


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
        send = x if flag != 1 else poisoned_stand_in(layout.extents[layout.me], dtype, P_sub.device, x)
        return all_gather_op(send, ctx.handle, layout.blocks, reduce_dtype, flag)

    def gather():
        layout, dtype = gathered_layout(op, P_sub, x)
        if check is not None:
            check(list(layout.extents), dtype)
        return all_gather_op(x, ctx.handle, layout.blocks, reduce_dtype, -1), (layout, dtype)

    return session.agree_in((tuple(x.shape), x.dtype, x.device.type, *extra), ok, run, gather)


class AllGather(AxesModule):
    """All-gather within ``P_x`` along ``axes_all_gather`` (or every axis not in ``axes_keep``); see the module doc.
    Arguments and construction: :class:`~distfuse.primitives._gather_scatter.AxesModule` (``reduce_dtype``: the
    dtype the backward's reduce-scatter adds in)."""

    op, axes_name = _OP, "axes_all_gather"

    def __init__(self, P_x: CartesianPartition, axes_all_gather: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__(P_x, axes_all_gather, axes_keep, reduce_dtype)

    def forward(self, x: torch.Tensor, out_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Gather ``x``; ``out_shape`` skips the agreement protocol (see :func:`all_gather`)."""
        if out_shape is not None or self._functional(x):
            return all_gather(x, self.P_sub, out_shape, self.reduce_dtype)
        return agreed_all_gather(x, self._ctx, self.session, reduce_dtype=self.reduce_dtype)
