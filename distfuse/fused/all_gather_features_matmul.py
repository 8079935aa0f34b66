"""all_gather_features_matmul: DistDL's all-gather linear fused, all-gather along the features + GEMM.

Worker ``r`` of the ``W`` model-parallel workers of ``P_sub`` holds input-feature block
``r`` and output-feature block ``r`` of the weight (``*`` any leading dims, all rows on
every worker; ``K_r``/``N_r`` balanced blocks, so neither need divide by ``W``)::

    x        [*, K_r]     every row, this worker's input features
    weight   [N_r, K]     nn.Linear layout, split along the output features
    bias     [N_r]        split like the weight's rows
    forward  y   = all_gather_K(x) @ weight.T + bias                           [*, N_r]
             ag_push_columns copies x into every peer's gathered buffer; gathered_k_matmul
             walks the K chunks as their flags come up, own chunk first, in a fixed order
             (results are identical run to run)
    dgrad    dx  = reduce_scatter_K(dy @ weight)[:, block r]                   [*, K_r]
             matmul_scatter_columns(dy, weight.t()) + column_reduce: the forward of
             :mod:`distfuse.fused.matmul_reduce_scatter_features`
    wgrad    dW  = dy.T @ g   with g = all_gather_K(x)                          [N_r, K]
             g kept from the forward (``keep_gathered=True``) or gathered again
             db  = sum of dy over the rows                                     [N_r]

This is the layout of :class:`~distfuse.layers.DistributedLinearAllGather` built with
``P_y`` alone (its ZeRO variant streams the weight into the GEMM instead, see
:mod:`distfuse.fused.zero_linear`); the sequence-parallel form (``P_x`` given) is
:mod:`distfuse.fused.all_gather_matmul`, whose ``keep_gathered`` this one shares (True
holds ``[*, K]`` from forward to backward).  Workspace, availability and world size 1:
:mod:`distfuse.fused.matmul_common`.  The op is declared on the pipeline (``SPEC``, a
:class:`~distfuse.fused.matmul_phases.PipelineLinear`), which gives its plan, loopback form
and autograd.
"""

from __future__ import annotations

import math

import torch

from distfuse.errors import ShapeError, expect, where
from distfuse.fused.matmul_common import check_linear_args, features_workspace_bytes
from distfuse.fused.matmul_phases import LinearPlan, PipelineLinear
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.partition import Partition

__all__ = ["PHASES", "all_gather_features_matmul", "all_gather_features_matmul_plan",
           "all_gather_features_matmul_loopback", "all_gather_features_matmul_workspace_bytes"]


def all_gather_features_matmul_workspace_bytes(rows: int, K: int, world_size: int, dtype: torch.dtype,
                                               partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes on every rank, forward and backward: the gathered ``[rows, K]``, or the backward's W
    column slots of ``dx`` (in ``partial_dtype``); 0 at world size 1."""
    return features_workspace_bytes(rows, K, world_size, dtype, partial_dtype)


class _AllGatherFeaturesMatmul(PipelineLinear):
    name, axis, scatters = "all_gather_features_matmul", "features", False

    def check(self, op, x, weight, bias, W, r, K, device):
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            raise expect(op, "x and weight types", "torch.Tensor", (type(x).__name__, type(weight).__name__))
        if x.dim() < 2 or weight.dim() != 2:
            raise ShapeError(f"{where(op)}: expected x [*, K_r] (at least 2 dims) and weight [N_r, K], got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        K = weight.shape[1] if K is None else K
        if weight.shape[1] != K:
            raise expect(op, "weight input features (K, the sum of the blocks)", K, weight.shape[1])
        if x.shape[-1] != block_extent(K, W, r):
            raise ShapeError(f"{where(op)}: x has {x.shape[-1]} features; balanced block {r} of K={K} over {W} "
                             f"workers has {block_extent(K, W, r)} (x must be the balanced block of the weight's "
                             "input features)")
        # The common checks (dtypes, devices, bias) on the weight's columns that multiply x.
        check_linear_args(op, x, weight[:, :x.shape[-1]], bias, device)
        return K

    def nbytes(self, x, weight, K, W, partial_dtype):
        return all_gather_features_matmul_workspace_bytes(math.prod(x.shape[:-1]), weight.shape[1], W, x.dtype,
                                                          partial_dtype)


SPEC = _AllGatherFeaturesMatmul()
#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): the backward is
#: matmul_reduce_scatter_features's forward phase, the gathered input kept for the weight gradient or gathered again.
PHASES = SPEC.phases


def all_gather_features_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                               keep_gathered: bool = True, *,
                               partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused ``all_gather_K(x) @ weight.T + bias`` over the model-parallel workers ``P_sub``, autograd-aware.

    Args:
        x: ``[*, K_r]`` (at least 2 dims): every row, input-feature block ``r`` (``r`` this
            rank's index in ``P_sub``) of the balanced decomposition of ``K = weight.shape[1]``.
        weight: ``[N_r, K]``, x's dtype (fp32, fp16 or bf16) and device.
        bias: ``[N_r]`` or None; every rank passes one, or none.
        P_sub: the model-parallel workers.  Must satisfy
            :func:`~distfuse.fused.matmul_common.fused_linear_available`.
        keep_gathered: keep the gathered input for the weight gradient (True) or gather it
            again in the backward (False, less memory).
        partial_dtype: dtype of the backward's dx partial sums on the wire (default x's).

    Returns ``[*, N_r]``.
    Collective over ``P_sub`` in forward and backward (same row count, ``K``, dtype, bias
    presence and ``keep_gathered`` on every rank; ``DISTFUSE_DEBUG=1`` checks).
    """
    return SPEC(x, weight, bias, P_sub, keep_gathered=keep_gathered, partial_dtype=partial_dtype)


def all_gather_features_matmul_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    P_sub: Partition, keep_gathered: bool = True, *,
                                    partial_dtype: torch.dtype | None = None) -> LinearPlan:
    """:func:`all_gather_features_matmul`'s checks and plan
    (:meth:`~distfuse.fused.matmul_phases.PipelineLinear.plan`)."""
    return SPEC.plan(x, weight, bias, P_sub, keep_gathered=keep_gathered, partial_dtype=partial_dtype)


def all_gather_features_matmul_loopback(xs, weights, biases, ws: LoopbackWorkspace, *, keep_gathered: bool = True,
                                        partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`all_gather_features_matmul` for all W virtual ranks of a loopback workspace, autograd-aware.

    ``xs[r]`` ``[*, K_r]`` (the balanced blocks of K, in order), ``weights[r]`` ``[N_r, K]``
    and ``biases[r]`` ``[N_r]`` (or ``biases=None``).  Returns the W outputs ``[*, N_r]``.
    """
    return SPEC.loopback(xs, weights, biases, ws, keep_gathered=keep_gathered, partial_dtype=partial_dtype)
