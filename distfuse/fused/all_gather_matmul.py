"""all_gather_matmul: the fused column-parallel linear, all-gather + GEMM forward, GEMM + reduce-scatter backward.

Worker ``r`` of the ``W`` model-parallel workers of ``P_sub`` holds sequence block ``r``
of the input and output-feature block ``r`` of the weight (``*`` any leading dims,
``n_r`` the balanced block ``r`` of ``n``, so ``n`` need not divide by ``W``)::

    x        [*, n_r, K]     this worker's sequence block, all input features
    weight   [N_r, K]        nn.Linear layout, split along the output features
    bias     [N_r]           split like the weight's rows
    forward  y   = all_gather_n(x) @ weight.T + bias                            [*, n, N_r]
             the push copies x into every peer's symmetric buffer (provider "triton": a copy
             kernel before the GEMM; "copy_engine": DMA on a side stream, overlapping it);
             gathered_matmul multiplies chunk by chunk as they land (local chunk first)
    dgrad    dx  = reduce_scatter_n(dy @ weight)[block r]                      [*, n_r, K]
             matmul_scatter(dy, weight.t()) + chunk_reduce
    wgrad    dW  = dy.T @ g   with g = all_gather_n(x)                          [N_r, K]
             g kept from the forward (``keep_gathered=True``, gathered_matmul's copy) or
             gathered again in the backward (``keep_gathered=False``)
             db  = sum of dy over all n rows                                    [N_r]  (complete: b is sharded)

``keep_gathered`` trades memory for communication: True holds ``[*, n, K]`` (W times the
input block) from forward to backward and the backward moves only ``dy``'s partials;
False holds just the block and gathers it again (Megatron's choice for sequence
parallelism; :meth:`~distfuse.fused.matmul_common.Comm.start_gather`, overlapping the
fused dgrad on CUDA).

Workspace, availability, world size 1 and the reason for the op:
:mod:`distfuse.fused.matmul_common`.  The kernel floor has a one-shot op of the same name without autograd
(:func:`distfuse.kernels.all_gather_matmul.all_gather_matmul`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    check_linear_args,
    check_loopback_counts,
    check_member,
    check_partial_dtype,
    fused_linear_available,
    gathered_phases,
    require_available,
    run_phases,
    workspace_bytes,
)
from distfuse.fused.matmul_phases import run_all_gather_matmul, run_matmul_reduce_scatter
from distfuse.fused.providers import pick_provider
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels.signature import GATHER_FLAGS
from distfuse.partition import Partition

__all__ = ["PHASES", "all_gather_matmul", "all_gather_matmul_plan", "all_gather_matmul_loopback",
           "all_gather_matmul_workspace_bytes", "fused_linear_available"]

_OP = "all_gather_matmul"


def all_gather_matmul_workspace_bytes(batch: int, n: int, K: int, world_size: int, dtype: torch.dtype,
                                      partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes :func:`all_gather_matmul` needs on every rank: the forward's gathered ``[B_, n, K]``
    or the backward's W partial slots of ``dx`` (:func:`~distfuse.fused.matmul_common.workspace_bytes`)."""
    return workspace_bytes(batch, n, K, world_size, dtype, partial_dtype)


class _AGPlan(NamedTuple):
    comm: Comm
    k: int
    has_bias: bool
    n: int
    keep_gathered: bool
    partial_dtype: torch.dtype | None
    nbytes: int
    provider: str = "triton"


#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): the backward is matmul_reduce_scatter's
#: forward phase, the gathered input kept for the weight gradient or gathered again.
PHASES = gathered_phases(
    _OP,
    lambda plan, op, xs, weights, biases, keep: run_all_gather_matmul(plan.comm, op, xs, weights, biases, plan.n, keep,
                                                                       plan.nbytes, push=plan.provider),
    lambda plan, op, blocks: plan.comm.start_gather(op, blocks, plan.n),
    lambda plan, op, dys, weights_t: run_matmul_reduce_scatter(plan.comm, op, dys, weights_t, [None] * plan.k, plan.n,
                                                               plan.partial_dtype, plan.nbytes))


def _infer_n(P: Partition, rows: int) -> int:
    """The full sequence extent: the sum of the blocks (one int64 all-reduce on the gloo metadata group)."""
    t = torch.tensor([rows], dtype=torch.int64)
    dist.all_reduce(t, group=P.meta_group)
    return int(t)


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                      keep_gathered: bool = True, *, n: int | None = None,
                      partial_dtype: torch.dtype | None = None, provider: str | None = None) -> torch.Tensor:
    """Fused ``all_gather_n(x) @ weight.T + bias`` over the model-parallel workers ``P_sub``, autograd-aware.

    Args:
        x: ``[*, n_r, K]``: this worker's sequence block (block ``r`` of the balanced
            decomposition of ``n``, ``r`` its rank in ``P_sub``), all input features.
        weight: ``[N_r, K]``, x's dtype (fp32, fp16 or bf16) and device.
        bias: ``[N_r]`` or None; every rank passes one, or none.
        P_sub: the model-parallel workers.  Must satisfy :func:`fused_linear_available`.
        keep_gathered: keep the gathered input from forward to backward for the weight
            gradient (True), or gather it again in the backward (False, less memory).
        n: the full sequence extent.  Pass it when known: without it the ranks sum their
            block extents (one host-side all-reduce on the metadata group per call).
        partial_dtype: dtype of the backward's dx partial sums on the wire (default x's).
        provider: the forward's push (:mod:`distfuse.fused.providers`); None picks it per
            shape (:func:`~distfuse.fused.providers.select_provider`).  The same outputs
            whichever runs; every rank must use the same one.

    Returns ``[*, n, N_r]``.
    Collective over ``P_sub`` in forward and backward (every rank calls it with the same
    ``n``, ``K``, leading dims, dtype, bias presence and ``keep_gathered``;
    ``DISTFUSE_DEBUG=1`` checks).
    """
    plan = all_gather_matmul_plan(x, weight, bias, P_sub, keep_gathered, n=n, partial_dtype=partial_dtype,
                                  provider=provider)
    return run_phases(PHASES, plan, [x], [weight], [bias])[0]


def all_gather_matmul_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                           keep_gathered: bool = True, *, n: int | None = None,
                           partial_dtype: torch.dtype | None = None, provider: str | None = None) -> _AGPlan:
    """:func:`all_gather_matmul`'s checks and plan: what its phases run on (collective where the checks refuse,
    see :mod:`distfuse.fused.agreement`)."""
    check_member(_OP, P_sub)
    W, r = P_sub.size, P_sub.rank
    if n is None:  # before any check: a rank whose checks fail still takes part in this sum
        rows = x.shape[-2] if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0
        n = rows if W == 1 else _infer_n(P_sub, rows)
    n = int(n)
    with refusal(_OP, P_sub, x, GATHER_FLAGS, nbytes=lambda: all_gather_matmul_workspace_bytes(
            math.prod(x.shape[:-2]), n, x.shape[-1], W, x.dtype, partial_dtype)):
        check_linear_args(_OP, x, weight, bias, P_sub.device)
        check_partial_dtype(_OP, partial_dtype)
        rows = x.shape[-2]
        if n < 0 or block_extent(n, W, r) != rows:
            raise ShapeError(f"{where(_OP)}: x has {rows} rows; block {r} of n={n} over {W} workers has "
                             f"{block_extent(n, W, r) if n >= 0 else 'none'} (x must be the balanced block)")
        provider = pick_provider(_OP, provider, x, math.prod(x.shape[:-2]) * n, weight.shape[0], W)
    require_available(_OP, P_sub, x.device)
    K = x.shape[-1]
    B = math.prod(x.shape[:-2])
    debug.check_agreement(_OP, P_sub.ranks, P_sub.meta_group,
                          same=dict(n=n, K=K, lead=tuple(x.shape[:-2]), dtype=str(x.dtype), bias=bias is not None,
                                    keep_gathered=bool(keep_gathered), partial_dtype=str(partial_dtype),
                                    provider=provider),
                          info=dict(x=tuple(x.shape), weight=tuple(weight.shape)))
    return _AGPlan(Comm(P=P_sub, device=x.device), 1, bias is not None, n, bool(keep_gathered), partial_dtype,
                   all_gather_matmul_workspace_bytes(B, n, K, W, x.dtype, partial_dtype), provider)


def all_gather_matmul_loopback(xs, weights, biases, ws: LoopbackWorkspace, *, keep_gathered: bool = True,
                               partial_dtype: torch.dtype | None = None,
                               provider: str | None = None) -> list[torch.Tensor]:
    """:func:`all_gather_matmul` for all W virtual ranks of a loopback workspace, in one process, autograd-aware.

    ``xs[r]`` ``[*, n_r, K]`` (the balanced blocks, in order), ``weights[r]`` ``[N_r, K]``
    and ``biases[r]`` ``[N_r]`` (or ``biases=None``) are virtual rank ``r``'s.  Returns the
    W outputs ``[*, n, N_r]``.  ``provider`` as for :func:`all_gather_matmul`.
    """
    op = f"{_OP}_loopback"
    W = ws.world_size
    check_loopback_counts(op, W, xs, weights, biases)
    n = sum(x.shape[-2] for x in xs)
    for r, x in enumerate(xs):
        check_linear_args(op, x, weights[r], None if biases is None else biases[r])
        if x.shape[-2] != block_extent(n, W, r) or x.shape[:-2] != xs[0].shape[:-2] or x.shape[-1] != xs[0].shape[-1] \
                or x.device != ws.device:
            raise expect(op, f"x[{r}] shape (balanced block {r} of n={n}, same leading dims and K) and device",
                         ((*xs[0].shape[:-2], block_extent(n, W, r), xs[0].shape[-1]), ws.device),
                         (tuple(x.shape), x.device))
    x0 = xs[0]
    nbytes = all_gather_matmul_workspace_bytes(math.prod(x0.shape[:-2]), n, x0.shape[-1], W, x0.dtype, partial_dtype)
    plan = _AGPlan(Comm(loopback=ws), W, biases is not None, n, bool(keep_gathered), partial_dtype, nbytes,
                   pick_provider(_OP, provider, x0, math.prod(x0.shape[:-2]) * n, weights[0].shape[0], W))
    return run_phases(PHASES, plan, xs, weights, biases)
