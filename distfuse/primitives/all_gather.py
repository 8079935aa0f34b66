"""AllGather: every worker gets the concatenation of its sub-grid's blocks along the gathered dimensions.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid along ``axes_all_gather``,
``A`` the gathered axes; partition dimension ``d`` splits tensor dimension ``d``)::

    x  [n_0, ..., n_k]   this worker's block
    y  [N_0, ..., N_k]   N_d = sum of the blocks' extents along d for d in A, N_d = n_d otherwise;
                         the blocks concatenated in index order, the same on every worker of S

Several axes may be gathered at once (DistDL allows one).  Blocks may be uneven and
may be empty (an extent smaller than the partition); they need not be the balanced
decomposition, only tile.

Adjoint: a reduce-scatter.  Each worker's input gradient is the sum, over the workers
of ``S``, of their output gradients restricted to this worker's block.

Cost: blocks are padded to the largest block and moved with one flat all-gather on the
sub-grid's group (``_axes.py``).  The receivers must know every block's extent: the
module exchanges the local shapes first with :func:`~distfuse.primitives._common.gather_metadata`,
one host-side all-gather of 10 int64 per worker on the gloo metadata group (no device
synchronisation).  It is latency-bound: on the 2-core CI machine (gloo, 2 ranks, busy)
the exchange took 1.0 ms and the gather of a 64 x 64 fp32 block 0.8 ms (best of 5 x 200
calls), so it more than doubles a small gather.  Layers that know the full shape pass it
to :func:`all_gather` (or ``forward``) as ``out_shape`` and skip the exchange; the blocks
are then the balanced decomposition of ``out_shape``.  The backward needs no metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from distfuse.errors import expect
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import (
    BlockLayout,
    axes_subgrid,
    balanced_layout,
    check_input,
    check_partition,
    gather_blocks,
    gathered_layout,
    resolve_axes,
    scatter_sum_blocks,
)

__all__ = ["AllGather", "AllGatherFunction", "all_gather", "axes_subgrid"]

_OP = "AllGather"


class AllGatherFunction(torch.autograd.Function):
    """Autograd Function of :func:`all_gather` on an active worker of a sub-grid of more than one worker."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, P_sub: CartesianPartition, layout: BlockLayout,
                reduce_dtype: torch.dtype | None):
        ctx.P_sub, ctx.layout, ctx.reduce_dtype = P_sub, layout, reduce_dtype
        return gather_blocks(_OP, P_sub, layout, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        return scatter_sum_blocks(_OP, ctx.P_sub, ctx.layout, dy, ctx.reduce_dtype), None, None, None


def all_gather(x: torch.Tensor, P_sub: CartesianPartition, out_shape: Sequence[int] | None = None,
               reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`), autograd-aware.

    Args:
        x: this worker's block, one tensor dimension per partition dimension.
        P_sub: the sub-grid; it has extent > 1 exactly in the gathered dimensions.
        out_shape: the output shape, if known (full extents along the gathered dimensions,
            local ones elsewhere); the blocks are then its balanced decomposition and no
            metadata is exchanged.  Every worker of ``P_sub`` must pass the same value.
        reduce_dtype: dtype the backward's reduce-scatter adds in; default the gradient's.
    """
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
    return AllGatherFunction.apply(x, P_sub, layout, reduce_dtype)


class AllGather(nn.Module):
    """All-gather within ``P_x`` along ``axes_all_gather`` (or every axis not in ``axes_keep``); see the module doc.

    Args:
        P_x: the Cartesian partition.
        axes_all_gather: partition axes to gather along.  Give exactly one of this and ``axes_keep``.
        axes_keep: partition axes *not* to gather along.
        reduce_dtype: dtype the backward's reduce-scatter adds in (e.g. ``torch.float32`` for bf16).

    Construction creates the sub-grids, which is collective over the whole world: every
    world rank, active in ``P_x`` or not, must construct the module.
    """

    def __init__(self, P_x: CartesianPartition, axes_all_gather: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        check_partition(_OP, P_x)
        self.P_x = P_x
        self.axes_all_gather = resolve_axes(_OP, P_x, axes_all_gather, axes_keep, "axes_all_gather")
        self.axes_keep = tuple(d for d in range(P_x.dim) if d not in self.axes_all_gather)
        self.reduce_dtype = reduce_dtype
        self.P_sub = axes_subgrid(P_x, self.axes_all_gather)

    def forward(self, x: torch.Tensor, out_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Gather ``x``; pass ``out_shape`` to skip the metadata exchange (see :func:`all_gather`)."""
        return all_gather(x, self.P_sub, out_shape, self.reduce_dtype)

    def extra_repr(self) -> str:
        return f"P_x={list(self.P_x.shape)}, axes_all_gather={self.axes_all_gather}, reduce_dtype={self.reduce_dtype}"
