"""matmul_reduce_scatter_features: DistDL's reduce-scatter linear fused, GEMM + reduce-scatter along the features.

Worker ``r`` of the ``W`` model-parallel workers of ``P_sub`` holds input-feature block
``r`` and, on output, output-feature block ``r`` (``*`` any leading dims, all rows on
every worker; ``K_r``/``N_r`` the balanced blocks, so neither need divide by ``W``)::

    x        [*, K_r]     every row, this worker's input features
    weight   [N, K_r]     nn.Linear layout, split along the input features
    bias     [N_r]        this worker's block of the bias (split like the output)
    forward  y_r = reduce_scatter_N(x @ weight.T)[:, block r] + bias_r        [*, N_r]
             matmul_scatter_columns stores each tile's columns into their owner's slot;
             column_reduce sums the W partials in fp32 and adds the bias block once
    dgrad    dx  = all_gather_N(dy) @ weight                                   [*, K_r]
             ag_push_columns + gathered_k_matmul(dy, weight.t(), return_gathered=True):
             the forward of :mod:`distfuse.fused.all_gather_features_matmul`
    wgrad    dW  = g.T @ x   with g = all_gather_N(dy), the copy gathered_k_matmul returns   [N, K_r]
             db  = sum of dy over the rows                                     [N_r] (complete: b is split)

This is the layout of :class:`~distfuse.layers.DistributedLinearReduceScatter` built with
``P_x`` alone (its ZeRO variant streams the weight into the GEMM instead, see
:mod:`distfuse.fused.zero_linear`); the sequence-parallel form (``P_y`` given) is
:mod:`distfuse.fused.matmul_reduce_scatter`.  Workspace, availability and world size 1:
:mod:`distfuse.fused.matmul_common` (the unfused composition is ``F.linear`` + ReduceScatter).
The op is declared on the pipeline (``SPEC``, a :class:`~distfuse.fused.matmul_phases.PipelineLinear`),
which gives its plan, loopback form and autograd.
"""

from __future__ import annotations

import math

import torch

from distfuse.errors import expect
from distfuse.fused.matmul_common import check_linear_args, features_workspace_bytes
from distfuse.fused.matmul_phases import LinearPlan, PipelineLinear
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.partition import Partition

__all__ = ["PHASES", "matmul_reduce_scatter_features", "matmul_reduce_scatter_features_plan",
           "matmul_reduce_scatter_features_loopback", "matmul_reduce_scatter_features_workspace_bytes",
           "check_feature_bias"]


def matmul_reduce_scatter_features_workspace_bytes(rows: int, N: int, world_size: int, dtype: torch.dtype,
                                                   partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes on every rank, forward and backward: W column slots ``[rows, ceil(N / W)]`` (padded)
    in ``partial_dtype``, or the backward's gathered ``dy`` ``[rows, N]``; 0 at world size 1."""
    return features_workspace_bytes(rows, N, world_size, dtype, partial_dtype)


def check_feature_bias(op: str, bias, N: int, world_size: int, rank: int, x: torch.Tensor) -> None:
    """``bias`` is None or block ``rank`` of ``N`` over ``world_size`` (``[N_rank]``), x's dtype and device."""
    if bias is None:
        return
    want = (block_extent(N, world_size, rank),)
    if tuple(bias.shape) != want or bias.dtype != x.dtype or bias.device != x.device:
        raise expect(op, f"bias (block {rank} of {N} features over {world_size}, x's dtype and device)",
                     (want, x.dtype, x.device), (tuple(bias.shape), bias.dtype, bias.device))


class _MatmulReduceScatterFeatures(PipelineLinear):
    name, axis, scatters = "matmul_reduce_scatter_features", "features", True

    def check(self, op, x, weight, bias, W, r, extent, device):
        check_linear_args(op, x, weight, None, device)
        check_feature_bias(op, bias, weight.shape[0], W, r, x)
        return weight.shape[0]

    def nbytes(self, x, weight, extent, W, partial_dtype):
        return matmul_reduce_scatter_features_workspace_bytes(math.prod(x.shape[:-1]), weight.shape[0], W, x.dtype,
                                                              partial_dtype)


SPEC = _MatmulReduceScatterFeatures()
#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): dgrad is all_gather_features_matmul's
#: forward phase with W.t() [K_r, N], which hands back the gathered dy.
PHASES = SPEC.phases


def matmul_reduce_scatter_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   P_sub: Partition, *, partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused ``reduce_scatter_N(x @ weight.T)[:, block r] + bias`` over the model-parallel workers ``P_sub``.

    Args:
        x: ``[*, K_r]`` (at least 2 dims): every row, this worker's input-feature block.
        weight: ``[N, K_r]``, x's dtype (fp32, fp16 or bf16) and device.
        bias: ``[N_r]`` (block ``r`` of the bias, ``r`` this rank's index in ``P_sub``) or
            None; every rank passes one, or none.
        P_sub: the model-parallel workers; partition rank ``r`` receives output-feature block
            ``r``.  Must satisfy :func:`~distfuse.fused.matmul_common.fused_linear_available`.
        partial_dtype: dtype of the partial sums on the wire (default x's).

    Returns ``[*, N_r]``, autograd-aware (gradients for x, weight and bias).
    Collective over ``P_sub`` in forward and backward (every rank calls it with the same
    row count, ``N``, dtype and bias presence; ``DISTFUSE_DEBUG=1`` checks).
    """
    return SPEC(x, weight, bias, P_sub, partial_dtype=partial_dtype)


def matmul_reduce_scatter_features_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                        P_sub: Partition, *, partial_dtype: torch.dtype | None = None) -> LinearPlan:
    """:func:`matmul_reduce_scatter_features`'s checks and plan
    (:meth:`~distfuse.fused.matmul_phases.PipelineLinear.plan`)."""
    return SPEC.plan(x, weight, bias, P_sub, partial_dtype=partial_dtype)


def matmul_reduce_scatter_features_loopback(xs, weights, biases, ws: LoopbackWorkspace, *,
                                            partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`matmul_reduce_scatter_features` for all W virtual ranks of a loopback workspace, autograd-aware.

    ``xs[r]`` ``[*, K_r]``, ``weights[r]`` ``[N, K_r]`` and ``biases[r]`` ``[N_r]`` (or
    ``biases=None``) are virtual rank ``r``'s.  Returns the W outputs ``[*, N_r]``.
    """
    return SPEC.loopback(xs, weights, biases, ws, partial_dtype=partial_dtype)
