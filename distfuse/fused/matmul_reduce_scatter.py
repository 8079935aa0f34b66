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
and the reason for the op: :mod:`distfuse.fused.matmul_common`.  The kernel floor has a
one-shot op of the same name without autograd
(:func:`distfuse.kernels.matmul_reduce_scatter.matmul_reduce_scatter`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from distfuse import debug
from distfuse.errors import UnsupportedError, expect
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    check_linear_args,
    check_loopback_counts,
    check_member,
    check_partial_dtype,
    fused_linear_available,
    require_available,
    run_phases,
    scattered_phases,
    workspace_bytes,
)
from distfuse.fused.matmul_phases import run_all_gather_matmul, run_matmul_reduce_scatter
from distfuse.fused.providers import pick_provider, record_kernel
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.kernels.matmul_scatter_select import KernelChoice
from distfuse.kernels.signature import SCATTER_FLAGS
from distfuse.partition import Partition

__all__ = ["PHASES", "matmul_reduce_scatter", "matmul_reduce_scatter_plan", "matmul_reduce_scatter_loopback",
           "matmul_reduce_scatter_workspace_bytes", "fused_linear_available"]

_OP = "matmul_reduce_scatter"
BIAS_GRADS = ("partial", "sum")


def matmul_reduce_scatter_workspace_bytes(batch: int, n: int, N: int, world_size: int, dtype: torch.dtype,
                                          partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes :func:`matmul_reduce_scatter` needs on every rank: the forward's W partial slots of
    ``[B_, ceil(n / W), N]`` or the backward's gathered ``dy`` ``[B_, n, N]`` (see
    :func:`~distfuse.fused.matmul_common.workspace_bytes`)."""
    return workspace_bytes(batch, n, N, world_size, dtype, partial_dtype)


class _RSPlan(NamedTuple):
    comm: Comm
    k: int  # tensors per kind (ranks launched by this process)
    has_bias: bool
    n: int
    partial_dtype: torch.dtype | None
    bias_grad: str
    nbytes: int
    provider: str = "triton"


def _forward(plan: _RSPlan, op: str, xs, weights, biases) -> list[torch.Tensor]:
    """The forward phase with the plan's producer (the ``"triton"`` one launched directly, as in the backwards)."""
    producer = plan.provider
    if plan.provider == "triton" or plan.comm.world_size == 1:
        # The kernel that runs is recorded like run_producer's (last_kernel): one world has no producer at all.
        record_kernel(_OP, KernelChoice(plan.provider, "matmul_scatter", "one program per tile, pointer loads")
                      if plan.comm.world_size > 1 else
                      KernelChoice(plan.provider, "F.linear", "world size 1: a local GEMM"))
        producer = None
    return run_matmul_reduce_scatter(plan.comm, op, xs, weights, biases, plan.n, plan.partial_dtype, plan.nbytes,
                                     provider=producer)


#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): dgrad is all_gather_matmul's forward phase.
PHASES = scattered_phases(
    _OP, _forward,
    lambda plan, op, dys, weights_t, keep: run_all_gather_matmul(plan.comm, op, dys, weights_t, [None] * plan.k,
                                                                 plan.n, keep, plan.nbytes))


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
    plan = matmul_reduce_scatter_plan(x, weight, bias, P_sub, partial_dtype=partial_dtype, bias_grad=bias_grad,
                                      provider=provider)
    return run_phases(PHASES, plan, [x], [weight], [bias])[0]


def matmul_reduce_scatter_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition,
                               *, partial_dtype: torch.dtype | None = None, bias_grad: str = "partial",
                               provider: str | None = None) -> _RSPlan:
    """:func:`matmul_reduce_scatter`'s checks and plan: what its phases run on (collective where the checks
    refuse, see :mod:`distfuse.fused.agreement`)."""
    check_member(_OP, P_sub)
    W = P_sub.size
    with refusal(_OP, P_sub, x, SCATTER_FLAGS, nbytes=lambda: matmul_reduce_scatter_workspace_bytes(
            math.prod(x.shape[:-2]), x.shape[-2], weight.shape[0], W, x.dtype, partial_dtype)):
        check_linear_args(_OP, x, weight, bias, P_sub.device)
        if bias_grad not in BIAS_GRADS:
            raise expect(_OP, "bias_grad", " or ".join(BIAS_GRADS), repr(bias_grad), cls=UnsupportedError)
        check_partial_dtype(_OP, partial_dtype)
        provider = pick_provider(_OP, provider, x, math.prod(x.shape[:-1]), weight.shape[0], W)
    require_available(_OP, P_sub, x.device)
    n, N = x.shape[-2], weight.shape[0]
    B = math.prod(x.shape[:-2])
    debug.check_agreement(_OP, P_sub.ranks, P_sub.meta_group,
                          same=dict(n=n, N=N, lead=tuple(x.shape[:-2]), dtype=str(x.dtype), bias=bias is not None,
                                    partial_dtype=str(partial_dtype), bias_grad=bias_grad, provider=provider),
                          info=dict(x=tuple(x.shape)))
    return _RSPlan(Comm(P=P_sub, device=x.device), 1, bias is not None, n, partial_dtype, bias_grad,
                   matmul_reduce_scatter_workspace_bytes(B, n, N, W, x.dtype, partial_dtype), provider)


def matmul_reduce_scatter_loopback(xs, weights, bias: torch.Tensor | None, ws: LoopbackWorkspace, *,
                                   partial_dtype: torch.dtype | None = None,
                                   provider: str | None = None) -> list[torch.Tensor]:
    """:func:`matmul_reduce_scatter` for all W virtual ranks of a loopback workspace, in one process, autograd-aware.

    ``xs[r]`` ``[*, n, K_r]`` and ``weights[r]`` ``[N, K_r]`` are virtual rank ``r``'s;
    ``bias`` ``[N]`` is the one shared tensor (its gradient accumulates every rank's
    partial, i.e. the full gradient).  Returns the W outputs ``[*, n_r, N]``.  ``provider``
    as for :func:`matmul_reduce_scatter`.
    """
    op = f"{_OP}_loopback"
    W = ws.world_size
    check_loopback_counts(op, W, xs, weights)
    for x, w in zip(xs, weights, strict=True):
        check_linear_args(op, x, w, bias)
        if x.shape[:-1] != xs[0].shape[:-1] or w.shape[0] != weights[0].shape[0] or x.device != ws.device:
            raise expect(op, "x shapes [*, n, K_r] alike but for K_r, N alike, the workspace's device",
                         (tuple(xs[0].shape[:-1]), weights[0].shape[0], ws.device),
                         (tuple(x.shape[:-1]), w.shape[0], x.device))
    x0 = xs[0]
    n, N = x0.shape[-2], weights[0].shape[0]
    plan = _RSPlan(Comm(loopback=ws), W, bias is not None, n, partial_dtype, "partial",
                   matmul_reduce_scatter_workspace_bytes(math.prod(x0.shape[:-2]), n, N, W, x0.dtype, partial_dtype),
                   pick_provider(_OP, provider, x0, math.prod(x0.shape[:-1]), N, W))
    return run_phases(PHASES, plan, xs, weights, [bias] * W if bias is not None else None)
