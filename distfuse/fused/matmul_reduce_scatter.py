"""matmul_reduce_scatter: the fused row-parallel linear, GEMM + reduce-scatter forward, all-gather + GEMM backward.

Worker ``r`` of the ``W`` model-parallel workers of ``P_sub`` holds input-feature block
``r`` and, on output, sequence block ``r`` (``*`` any leading dims, ``n_r`` the balanced
block ``r`` of ``n``, so ``n`` need not divide by ``W``)::

    x        [*, n, K_r]    full sequence, this worker's input features
    weight   [N, K_r]       nn.Linear layout, split along the input features
    bias     [N]            replicated: the same values on every worker of P_sub
    forward  y_r = reduce_scatter_n(x @ weight.T)[block r] + bias               [*, n_r, N]
             matmul_scatter stores each tile into its owner's symmetric slot; chunk_reduce
             sums the W partials in fp32 and adds the bias once
    dgrad    dx  = all_gather_n(dy) @ weight                                     [*, n, K_r]
             ag_push + gathered_matmul(dy, weight.t(), return_gathered=True)
    wgrad    dW  = g.T @ x   with g = all_gather_n(dy), the copy gathered_matmul returns   [N, K_r]
             db  = sum of dy over this worker's rows  (a partial: see Bias)         [N]

The forward's producer is one of the providers of :mod:`distfuse.fused.providers`
(``"triton"``, ``"triton_persistent"``, ``"cublas_chunks"``; ``chunk_reduce`` consumes
whichever ran).

Bias.  Every output element gets the bias exactly once: worker ``r`` adds its copy to its
own rows only.  Its gradient on worker ``r`` therefore covers only those rows, and the
gradient of the one shared parameter is the sum of the W partials.  Two set-ups are
correct, and ``bias_grad`` says which one the caller uses:

* ``"partial"`` (default; distfuse's layers): the bias lives on one owner and reaches the
  workers through a Broadcast, whose adjoint sums the partials.  Same convention as the
  weight gradients of ``fused/halo_conv.py``.
* ``"sum"``: every worker keeps a replica updated by its own optimizer (Megatron-style
  sequence parallelism).  The backward all-reduces the partials over ``P_sub`` (one
  ``N``-element fp32 all-reduce), so every replica gets the full gradient and stays in
  step.  Combined with a Broadcast it would count the gradient W times.

Every rank of ``P_sub`` must pass a bias, or none.  Workspace, availability, world size 1
and the reason for the op: :mod:`distfuse.fused.matmul_common`.  The op is declared on the
pipeline (``SPEC``, a :class:`~distfuse.fused.matmul_phases.PipelineLinear`), which gives its
plan, loopback form and autograd.  The kernel floor has a one-shot op of the same name
without autograd (:func:`distfuse.kernels.matmul_reduce_scatter.matmul_reduce_scatter`).
"""

from __future__ import annotations

import math

import torch

from distfuse.fused.matmul_common import (
    check_linear_args,
    check_loopback_counts,
    fused_linear_available,
    workspace_bytes,
)
from distfuse.fused.matmul_phases import BIAS_GRADS, LinearPlan, PipelineLinear
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.partition import Partition

__all__ = ["PHASES", "matmul_reduce_scatter", "matmul_reduce_scatter_plan", "matmul_reduce_scatter_loopback",
           "matmul_reduce_scatter_workspace_bytes", "fused_linear_available", "BIAS_GRADS"]


def matmul_reduce_scatter_workspace_bytes(batch: int, n: int, N: int, world_size: int, dtype: torch.dtype,
                                          partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes :func:`matmul_reduce_scatter` needs on every rank: the forward's W partial slots of
    ``[B_, ceil(n / W), N]`` or the backward's gathered ``dy`` ``[B_, n, N]`` (see
    :func:`~distfuse.fused.matmul_common.workspace_bytes`)."""
    return workspace_bytes(batch, n, N, world_size, dtype, partial_dtype)


class _MatmulReduceScatter(PipelineLinear):
    name, axis, scatters = "matmul_reduce_scatter", "rows", True

    def check(self, op, x, weight, bias, W, r, extent, device):
        check_linear_args(op, x, weight, bias, device)
        return x.shape[-2]

    def nbytes(self, x, weight, extent, W, partial_dtype):
        return matmul_reduce_scatter_workspace_bytes(math.prod(x.shape[:-2]), x.shape[-2], weight.shape[0], W,
                                                     x.dtype, partial_dtype)


SPEC = _MatmulReduceScatter()
#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): dgrad is all_gather_matmul's forward phase.
PHASES = SPEC.phases


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition, *,
                          partial_dtype: torch.dtype | None = None, bias_grad: str = "partial",
                          provider: str | None = None) -> torch.Tensor:
    """Fused ``reduce_scatter_n(x @ weight.T) + bias`` over the model-parallel workers ``P_sub``, autograd-aware.

    Args:
        x: ``[*, n, K_r]``: the full sequence and this worker's input features (``*`` may be empty).
        weight: ``[N, K_r]``, x's dtype (fp32, fp16 or bf16) and device.
        bias: ``[N]`` (replicated over ``P_sub``) or None; every rank passes one, or none.
        P_sub: the model-parallel workers; partition rank ``r`` receives sequence block ``r``
            (the balanced decomposition of ``n``).  Must satisfy :func:`fused_linear_available`.
        partial_dtype: dtype of the partial sums on the wire (default x's; ``torch.float32``
            leaves one rounding for 16-bit outputs at twice the traffic).  The backward
            all-gathers ``dy`` in its own dtype (a gather does not round).
        bias_grad: ``"partial"`` (the sum of ``dy`` over this worker's rows; the caller's
            Broadcast adjoint sums them) or ``"sum"`` (all-reduced over ``P_sub``; for
            replicas updated independently).  See the module doc.
        provider: the forward's producer (:mod:`distfuse.fused.providers`); None picks it per
            shape (:func:`~distfuse.fused.providers.select_provider`).  The same outputs
            whichever runs; every rank must use the same one.

    Returns ``[*, n_r, N]``: this worker's sequence block of the reduced output.
    Collective over ``P_sub`` in forward and backward (every rank calls it with the same
    ``n``, ``N``, leading dims, dtype and bias presence; ``DISTFUSE_DEBUG=1`` checks).
    """
    return SPEC(x, weight, bias, P_sub, partial_dtype=partial_dtype, bias_grad=bias_grad, provider=provider)


def matmul_reduce_scatter_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                               *, partial_dtype: torch.dtype | None = None, bias_grad: str = "partial",
                               provider: str | None = None) -> LinearPlan:
    """:func:`matmul_reduce_scatter`'s checks and plan (:meth:`~distfuse.fused.matmul_phases.PipelineLinear.plan`)."""
    return SPEC.plan(x, weight, bias, P_sub, partial_dtype=partial_dtype, bias_grad=bias_grad, provider=provider)


def matmul_reduce_scatter_loopback(xs, weights, bias: torch.Tensor | None, ws: LoopbackWorkspace, *,
                                   partial_dtype: torch.dtype | None = None,
                                   provider: str | None = None) -> list[torch.Tensor]:
    """:func:`matmul_reduce_scatter` for all W virtual ranks of a loopback workspace, in one process, autograd-aware.

    ``xs[r]`` ``[*, n, K_r]`` and ``weights[r]`` ``[N, K_r]`` are virtual rank ``r``'s;
    ``bias`` ``[N]`` is the one shared tensor (its gradient accumulates every rank's
    partial, i.e. the full gradient).  Returns the W outputs ``[*, n_r, N]``.  ``provider``
    as for :func:`matmul_reduce_scatter`.
    """
    check_loopback_counts(f"{SPEC.name}_loopback", ws.world_size, xs, weights)  # one bias, shared
    return SPEC.loopback(xs, weights, None if bias is None else [bias] * len(xs), ws, partial_dtype=partial_dtype,
                         provider=provider)
