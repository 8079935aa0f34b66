"""ReduceScatter: sum full-extent partial tensors over a sub-grid and keep this worker's block.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid along ``axes_reduce_scatter``,
``A`` those axes; partition dimension ``d`` splits tensor dimension ``d``)::

    x  [N_0, ..., N_k]   a partial sum, full extent along the dimensions in A; every worker
                         of S passes the same shape
    y  [n_0, ..., n_k]   this worker's block of sum_S x: n_d = block_extent(N_d, |S_d|, index_d)
                         for d in A (the balanced decomposition, possibly empty), n_d = N_d otherwise

Several axes may be reduce-scattered at once (DistDL allows one).

Adjoint: an all-gather of the output gradient's blocks, which are the balanced
decomposition of the input shape, so no metadata is exchanged in either direction.

Cost: one flat reduce-scatter of ``|S| * prod(largest block)`` elements on the
sub-grid's group (``_axes.py``); uneven blocks travel padded to the largest block,
which gloo needs (e.g. 10 over 4 workers moves 4 x 3 = 12 elements).  bf16/fp16 add in
their own dtype unless ``reduce_dtype`` says otherwise.  Every worker must pass the
same shape; ``DISTFUSE_DEBUG=1`` checks this (otherwise a mismatch ends in a collective
error or the group's timeout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import (
    BlockLayout,
    axes_subgrid,
    balanced_layout,
    check_input,
    check_partition,
    gather_blocks,
    resolve_axes,
    scatter_sum_blocks,
)

__all__ = ["ReduceScatter", "ReduceScatterFunction", "reduce_scatter", "axes_subgrid"]

_OP = "ReduceScatter"


class ReduceScatterFunction(torch.autograd.Function):
    """Autograd Function of :func:`reduce_scatter` on an active worker of a sub-grid of more than one worker."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, P_sub: CartesianPartition, layout: BlockLayout,
                reduce_dtype: torch.dtype | None):
        ctx.P_sub, ctx.layout = P_sub, layout
        return scatter_sum_blocks(_OP, P_sub, layout, x, reduce_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        return gather_blocks(_OP, ctx.P_sub, ctx.layout, dy), None, None, None


def reduce_scatter(x: torch.Tensor, P_sub: CartesianPartition,
                   reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reduce-scatter ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`).

    Autograd-aware.  The full shape is ``x``'s own, so nothing but the data moves.

    Args:
        x: this worker's full-extent partial tensor, one dimension per partition dimension.
        P_sub: the sub-grid; it has extent > 1 exactly in the reduce-scattered dimensions.
        reduce_dtype: dtype the forward sum is added in; default ``x``'s.
    """
    if not check_input(_OP, P_sub, x, ndim=P_sub.dim):
        return x.clone()
    if P_sub.size == 1:
        return x.clone()
    return ReduceScatterFunction.apply(x, P_sub, balanced_layout(P_sub, x.shape), reduce_dtype)


class ReduceScatter(nn.Module):
    """Reduce-scatter within ``P_x`` along ``axes_reduce_scatter`` (or every axis not in ``axes_keep``).

    See the module doc for shapes and the adjoint.

    Args:
        P_x: the Cartesian partition.
        axes_reduce_scatter: partition axes to sum and split along.  Give exactly one of this and ``axes_keep``.
        axes_keep: partition axes *not* to sum along.
        reduce_dtype: dtype the sum is added in (e.g. ``torch.float32`` for bf16 inputs); default the input's.

    Construction creates the sub-grids, which is collective over the whole world: every
    world rank, active in ``P_x`` or not, must construct the module.
    """

    def __init__(self, P_x: CartesianPartition, axes_reduce_scatter: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        check_partition(_OP, P_x)
        self.P_x = P_x
        self.axes_reduce_scatter = resolve_axes(_OP, P_x, axes_reduce_scatter, axes_keep, "axes_reduce_scatter")
        self.axes_keep = tuple(d for d in range(P_x.dim) if d not in self.axes_reduce_scatter)
        self.reduce_dtype = reduce_dtype
        self.P_sub = axes_subgrid(P_x, self.axes_reduce_scatter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(x, self.P_sub, self.reduce_dtype)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, axes_reduce_scatter={self.axes_reduce_scatter}, "
                f"reduce_dtype={self.reduce_dtype}")
