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
:mod:`distfuse.fused.matmul_common`.  The op is declared on the pipeline (``SPEC``, a
:class:`~distfuse.fused.matmul_phases.PipelineLinear`), which gives its plan, loopback form
and autograd.  The kernel floor has a one-shot op of the same name without autograd
(:func:`distfuse.kernels.all_gather_matmul.all_gather_matmul`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, where
from distfuse.fused.matmul_common import check_linear_args, fused_linear_available, workspace_bytes
from distfuse.fused.matmul_phases import LinearPlan, PipelineLinear
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.partition import Partition

__all__ = ["PHASES", "all_gather_matmul", "all_gather_matmul_plan", "all_gather_matmul_loopback",
           "all_gather_matmul_workspace_bytes", "fused_linear_available"]


def all_gather_matmul_workspace_bytes(batch: int, n: int, K: int, world_size: int, dtype: torch.dtype,
                                      partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes :func:`all_gather_matmul` needs on every rank: the forward's gathered ``[B_, n, K]``
    or the backward's W partial slots of ``dx`` (:func:`~distfuse.fused.matmul_common.workspace_bytes`)."""
    return workspace_bytes(batch, n, K, world_size, dtype, partial_dtype)


class _AllGatherMatmul(PipelineLinear):
    name, axis, scatters = "all_gather_matmul", "rows", False

    def agreed_extent(self, P_sub, x, n):
        """``n``, or the sum of the blocks (one int64 all-reduce on the gloo metadata group)."""
        if n is None:
            rows = x.shape[-2] if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0
            if P_sub.size == 1:
                return rows
            t = torch.tensor([rows], dtype=torch.int64)
            dist.all_reduce(t, group=P_sub.meta_group)
            return int(t)
        return int(n)

    def check(self, op, x, weight, bias, W, r, n, device):
        check_linear_args(op, x, weight, bias, device)
        rows = x.shape[-2]
        if n < 0 or block_extent(n, W, r) != rows:
            raise ShapeError(f"{where(op)}: x has {rows} rows; balanced block {r} of n={n} over {W} workers has "
                             f"{block_extent(n, W, r) if n >= 0 else 'none'} (x must be the balanced block)")
        return n

    def nbytes(self, x, weight, n, W, partial_dtype):
        return all_gather_matmul_workspace_bytes(math.prod(x.shape[:-2]), n, x.shape[-1], W, x.dtype, partial_dtype)


SPEC = _AllGatherMatmul()
#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): the backward is matmul_reduce_scatter's
#: forward phase, the gathered input kept for the weight gradient or gathered again.
PHASES = SPEC.phases


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
    return SPEC(x, weight, bias, P_sub, keep_gathered=keep_gathered, n=n, partial_dtype=partial_dtype,
                provider=provider)


def all_gather_matmul_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                           keep_gathered: bool = True, *, n: int | None = None,
                           partial_dtype: torch.dtype | None = None, provider: str | None = None) -> LinearPlan:
    """:func:`all_gather_matmul`'s checks and plan (:meth:`~distfuse.fused.matmul_phases.PipelineLinear.plan`)."""
    return SPEC.plan(x, weight, bias, P_sub, keep_gathered=keep_gathered, n=n, partial_dtype=partial_dtype,
                     provider=provider)


def all_gather_matmul_loopback(xs, weights, biases, ws: LoopbackWorkspace, *, keep_gathered: bool = True,
                               partial_dtype: torch.dtype | None = None,
                               provider: str | None = None) -> list[torch.Tensor]:
    """:func:`all_gather_matmul` for all W virtual ranks of a loopback workspace, in one process, autograd-aware.

    ``xs[r]`` ``[*, n_r, K]`` (the balanced blocks, in order), ``weights[r]`` ``[N_r, K]``
    and ``biases[r]`` ``[N_r]`` (or ``biases=None``) are virtual rank ``r``'s.  Returns the
    W outputs ``[*, n, N_r]``.  ``provider`` as for :func:`all_gather_matmul`.
    """
    return SPEC.loopback(xs, weights, biases, ws, keep_gathered=keep_gathered, partial_dtype=partial_dtype,
                         provider=provider)
