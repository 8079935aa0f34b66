"""AllSumReduce: every worker gets the sum over its sub-grid along the chosen partition axes.

Shapes (``P_x`` a Cartesian partition, ``S`` the sub-grid through this worker along
``axes_reduce``; every worker of ``S`` passes the same shape)::

    x  [*shape]   this worker's tensor
    y  [*shape]   sum of x over the workers of S, on every one of them

The tensor need not be partitioned by ``P_x`` (DistDL allows any shape, e.g. the
per-channel statistics of a batch norm), so its number of dimensions is free.

Adjoint: AllSumReduce is self-adjoint, the backward is the same all-reduce on the
gradient.  The output is always a new tensor: an identity (a sub-grid of one worker)
returns a clone, and an inactive worker returns a clone of its zero-volume input.

Cost: one ``all_reduce`` on the sub-grid's group (NCCL on GPUs: no host round trip).
bf16/fp16 are added in their own dtype unless ``reduce_dtype`` says otherwise (see
``_axes.py``).  ``DISTFUSE_DEBUG=1`` first checks that every worker of the sub-grid
passes the same shape and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import all_reduce_sum, axes_subgrid, check_input, check_partition, resolve_axes

__all__ = ["AllSumReduce", "AllSumReduceFunction", "all_sum_reduce", "axes_subgrid"]

_OP = "AllSumReduce"


class AllSumReduceFunction(torch.autograd.Function):
    """Autograd Function of :func:`all_sum_reduce` on an active worker of a sub-grid of more than one worker."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, P_sub: CartesianPartition, reduce_dtype: torch.dtype | None):
        ctx.P_sub, ctx.reduce_dtype = P_sub, reduce_dtype
        return all_reduce_sum(_OP, P_sub, x, reduce_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        return all_reduce_sum(_OP, ctx.P_sub, dy, ctx.reduce_dtype), None, None


def all_sum_reduce(x: torch.Tensor, P_sub: CartesianPartition,
                   reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum ``x`` over the sub-grid ``P_sub`` (from :func:`~distfuse.primitives._axes.axes_subgrid`), autograd-aware.

    Layers call this with a sub-grid they created once; creating one is collective over
    the world, calling this is collective over ``P_sub`` only.
    """
    if not check_input(_OP, P_sub, x, ndim=None):
        return x.clone()
    if P_sub.size == 1:
        return x.clone()
    return AllSumReduceFunction.apply(x, P_sub, reduce_dtype)


class AllSumReduce(nn.Module):
    """Sum-reduce within ``P_x`` along ``axes_reduce`` (or along every axis not in ``axes_keep``); see the module doc.

    Args:
        P_x: the Cartesian partition.
        axes_reduce: partition axes to sum along.  Give exactly one of this and ``axes_keep``.
        axes_keep: partition axes *not* to sum along.
        reduce_dtype: dtype to add in (e.g. ``torch.float32`` for bf16 inputs); default the input's.

    Construction creates the sub-grids, which is collective over the whole world: every
    world rank, active in ``P_x`` or not, must construct the module.
    """

    def __init__(self, P_x: CartesianPartition, axes_reduce: Sequence[int] | int | None = None,
                 axes_keep: Sequence[int] | int | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        check_partition(_OP, P_x)
        self.P_x = P_x
        self.axes_reduce = resolve_axes(_OP, P_x, axes_reduce, axes_keep, "axes_reduce")
        self.axes_keep = tuple(d for d in range(P_x.dim) if d not in self.axes_reduce)
        self.reduce_dtype = reduce_dtype
        self.P_sub = axes_subgrid(P_x, self.axes_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_sum_reduce(x, self.P_sub, self.reduce_dtype)

    def extra_repr(self) -> str:
        return f"P_x={list(self.P_x.shape)}, axes_reduce={self.axes_reduce}, reduce_dtype={self.reduce_dtype}"
