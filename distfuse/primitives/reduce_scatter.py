"""ReduceScatter: sum full-extent partial tensors over a sub-grid and keep this worker's block.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid along ``axes_reduce_scatter``,
``A`` those axes; partition dimension ``d`` splits tensor dimension ``d``)::

    x  [N_0, ..., N_k]   a partial sum, full extent along the dimensions in A; every worker
                         of S passes the same shape
    y  [n_0, ..., n_k]   this worker's block of sum_S x: n_d = block_extent(N_d, |S_d|, index_d)
                         for d in A (the balanced decomposition, possibly empty), n_d = N_d otherwise

Several axes may be reduce-scattered at once (DistDL allows one).  Adjoint: an all-gather
of the output gradient's blocks (the balanced decomposition of the input shape, so no
metadata moves in either direction), the other half of the op pair of
:mod:`~distfuse.primitives._gather_scatter`.

Cost: one flat reduce-scatter of ``|S| * prod(largest block)`` elements on the sub-grid's
group (:mod:`~distfuse.primitives._axes`; 10 over 4 workers moves 4 x 3 = 12), in the
data's dtype unless ``reduce_dtype`` says otherwise.  Every worker must pass the same
shape and dtype: the module checks it under the agreement protocol, raising the same
:class:`~distfuse.errors.ShapeError` on every worker; the functional form only with
``agree=True`` (or ``DISTFUSE_DEBUG=1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import axes_subgrid, balanced_layout, check_block_dims, check_input
from distfuse.primitives._call_agreement import agree_on_tensor
from distfuse.primitives._common import gather_metadata, same_shape_and_dtype
from distfuse.primitives._flag_deferred import poisoned_stand_in
from distfuse.primitives._gather_scatter import AxesModule, BlockCollective, collective_of, reduce_scatter_op
from distfuse.primitives.agreement_session import AgreementSession

__all__ = ["ReduceScatter", "reduce_scatter", "agreed_reduce_scatter", "axes_subgrid"]

_OP = "ReduceScatter"


def reduce_scatter(x: torch.Tensor, P_sub: CartesianPartition,
                   reduce_dtype: torch.dtype | None = None, agree: bool = False) -> torch.Tensor:
    """Reduce-scatter ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`),
    autograd-aware; the full shape is ``x``'s own, so nothing but the data moves.

    Args:
        x: this worker's full-extent partial tensor, one dimension per partition dimension.
        P_sub: the sub-grid; it has extent > 1 exactly in the reduce-scattered dimensions.
        reduce_dtype: dtype the forward sum is added in; default ``x``'s.
        agree: check that every worker passes the same shape, dtype and grad flag before any
            data moves, as :func:`~distfuse.primitives.all_gather.all_gather` does.
    """
    if agree and P_sub.active:
        agree_on_tensor(P_sub, _OP, x, lambda: check_input(_OP, P_sub, x, ndim=P_sub.dim),
                        shape=tuple(getattr(x, "shape", ())))
    if not check_input(_OP, P_sub, x, ndim=P_sub.dim) or P_sub.size == 1:
        return x.clone()
    return reduce_scatter_op(x, collective_of(_OP, P_sub).handle, balanced_layout(P_sub, x.shape).blocks,
                             reduce_dtype, -1)


def agreed_reduce_scatter(x: torch.Tensor, ctx: BlockCollective, session: AgreementSession, *,
                          reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`reduce_scatter` with every worker's shape and dtype checked under the agreement protocol, every mode.

    ``ctx`` and ``session`` as for :func:`~distfuse.primitives.all_gather.agreed_all_gather`: the flag rides in
    the reduce-scatter.  Active workers of a sub-grid of more than one worker only.
    """
    op, P_sub = ctx.op, ctx.P_sub
    ok = x.dim() == P_sub.dim and x.device.type == P_sub.device.type

    def run(state, flag: int) -> torch.Tensor:
        shape, dtype = state
        full = x if flag != 1 else poisoned_stand_in(shape, dtype, P_sub.device, x)
        return reduce_scatter_op(full, ctx.handle, balanced_layout(P_sub, shape).blocks, reduce_dtype, flag)

    def gather():
        meta = gather_metadata(P_sub, x, op=op)
        check_block_dims(op, P_sub, [s for s, _ in meta])
        shape, dtype = same_shape_and_dtype(op, P_sub, meta, "a full-extent tensor")
        return reduce_scatter_op(x, ctx.handle, balanced_layout(P_sub, shape).blocks, reduce_dtype, -1), (shape, dtype)

    return session.agree_in((tuple(x.shape), x.dtype, x.device.type), ok, run, gather)


class ReduceScatter(AxesModule):
    """Reduce-scatter within ``P_x`` along ``axes_reduce_scatter`` (or every axis not in ``axes_keep``); see the
    module doc.  Arguments and construction: :class:`~distfuse.primitives._gather_scatter.AxesModule`."""

    op, axes_name = _OP, "axes_reduce_scatter"

    def __init__(self, P_x: CartesianPartition, axes_reduce_scatter: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__(P_x, axes_reduce_scatter, axes_keep, reduce_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._functional(x):
            return reduce_scatter(x, self.P_sub, self.reduce_dtype)
        return agreed_reduce_scatter(x, self._ctx, self.session, reduce_dtype=self.reduce_dtype)
