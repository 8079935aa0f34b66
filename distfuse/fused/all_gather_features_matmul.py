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
:mod:`distfuse.fused.matmul_common`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    check_linear_args,
    check_loopback_counts,
    check_member,
    check_partial_dtype,
    features_workspace_bytes,
    gathered_phases,
    require_available,
    run_phases,
)
from distfuse.fused.matmul_phases import run_all_gather_features_matmul, run_matmul_reduce_scatter_features
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels.signature import GATHER_FLAGS
from distfuse.partition import Partition

__all__ = ["PHASES", "all_gather_features_matmul", "all_gather_features_matmul_plan",
           "all_gather_features_matmul_loopback", "all_gather_features_matmul_workspace_bytes"]

_OP = "all_gather_features_matmul"


def all_gather_features_matmul_workspace_bytes(rows: int, K: int, world_size: int, dtype: torch.dtype,
                                               partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes on every rank, forward and backward: the gathered ``[rows, K]``, or the backward's W
    column slots of ``dx`` (in ``partial_dtype``); 0 at world size 1."""
    return features_workspace_bytes(rows, K, world_size, dtype, partial_dtype)


class _Plan(NamedTuple):
    comm: Comm
    k: int
    has_bias: bool
    K: int
    keep_gathered: bool
    partial_dtype: torch.dtype | None
    nbytes: int


#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): the backward is
#: matmul_reduce_scatter_features's forward phase, the gathered input kept for the weight gradient or gathered again.
PHASES = gathered_phases(
    _OP,
    lambda plan, op, xs, weights, biases, keep: run_all_gather_features_matmul(plan.comm, op, xs, weights, biases,
                                                                                keep, plan.nbytes),
    lambda plan, op, blocks: plan.comm.start_gather(op, blocks, plan.K, features=True),
    lambda plan, op, dys, weights_t: run_matmul_reduce_scatter_features(plan.comm, op, dys, weights_t,
                                                                        [None] * plan.k, plan.partial_dtype,
                                                                        plan.nbytes))


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
    plan = all_gather_features_matmul_plan(x, weight, bias, P_sub, keep_gathered, partial_dtype=partial_dtype)
    return run_phases(PHASES, plan, [x], [weight], [bias])[0]


def all_gather_features_matmul_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    P_sub: Partition, keep_gathered: bool = True, *,
                                    partial_dtype: torch.dtype | None = None) -> _Plan:
    """:func:`all_gather_features_matmul`'s checks and plan: what its phases run on (collective where the checks
    refuse, see :mod:`distfuse.fused.agreement`)."""
    check_member(_OP, P_sub)
    W, r = P_sub.size, P_sub.rank
    with refusal(_OP, P_sub, x, GATHER_FLAGS, nbytes=lambda: all_gather_features_matmul_workspace_bytes(
            math.prod(x.shape[:-1]), weight.shape[1], W, x.dtype, partial_dtype)):
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            raise expect(_OP, "x and weight types", "torch.Tensor", (type(x).__name__, type(weight).__name__))
        if x.dim() < 2 or weight.dim() != 2:
            raise ShapeError(f"{where(_OP)}: expected x [*, K_r] (at least 2 dims) and weight [N_r, K], got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        K = weight.shape[1]
        if x.shape[-1] != block_extent(K, W, r):
            raise ShapeError(f"{where(_OP)}: x has {x.shape[-1]} features; block {r} of K={K} over {W} workers "
                             f"has {block_extent(K, W, r)} (x must be the balanced block of the weight's input "
                             "features)")
        # The common checks (dtypes, devices, bias) on the weight's columns that multiply x.
        check_linear_args(_OP, x, weight[:, :x.shape[-1]], bias, P_sub.device)
        check_partial_dtype(_OP, partial_dtype)
    require_available(_OP, P_sub, x.device)
    rows = math.prod(x.shape[:-1])
    debug.check_agreement(_OP, P_sub.ranks, P_sub.meta_group,
                          same=dict(rows=rows, K=K, dtype=str(x.dtype), bias=bias is not None,
                                    keep_gathered=bool(keep_gathered), partial_dtype=str(partial_dtype)),
                          info=dict(x=tuple(x.shape), weight=tuple(weight.shape)))
    return _Plan(Comm(P=P_sub, device=x.device), 1, bias is not None, K, bool(keep_gathered), partial_dtype,
                 all_gather_features_matmul_workspace_bytes(rows, K, W, x.dtype, partial_dtype))


def all_gather_features_matmul_loopback(xs, weights, biases, ws: LoopbackWorkspace, *, keep_gathered: bool = True,
                                        partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`all_gather_features_matmul` for all W virtual ranks of a loopback workspace, autograd-aware.

    ``xs[r]`` ``[*, K_r]`` (the balanced blocks of K, in order), ``weights[r]`` ``[N_r, K]``
    and ``biases[r]`` ``[N_r]`` (or ``biases=None``).  Returns the W outputs ``[*, N_r]``.
    """
    op = f"{_OP}_loopback"
    W = ws.world_size
    check_loopback_counts(op, W, xs, weights, biases)
    K = sum(x.shape[-1] for x in xs)
    for r, x in enumerate(xs):
        w = weights[r]
        if x.shape[-1] != block_extent(K, W, r) or x.shape[:-1] != xs[0].shape[:-1] or w.dim() != 2 \
                or w.shape[1] != K or x.device != ws.device:
            raise expect(op, f"x[{r}] (balanced block {r} of K={K}, same rows) and weights[{r}] [N_r, K]",
                         ((*xs[0].shape[:-1], block_extent(K, W, r)), K, ws.device),
                         (tuple(x.shape), tuple(w.shape), x.device))
        check_linear_args(op, x, w[:, :x.shape[-1]], None if biases is None else biases[r])
    x0 = xs[0]
    plan = _Plan(Comm(loopback=ws), W, biases is not None, K, bool(keep_gathered), partial_dtype,
                 all_gather_features_matmul_workspace_bytes(math.prod(x0.shape[:-1]), K, W, x0.dtype, partial_dtype))
    return run_phases(PHASES, plan, xs, weights, biases)
