"""matmul_all_reduce: GEMM + all-reduce over symmetric buffers, every rank's partial product summed on every rank.

Worker ``r`` of the ``W`` workers of ``P_sub`` holds input-feature block ``r`` (all rows)
and the matching columns of the weight (``*`` any leading dims)::

    x        [*, K_r]       every row, this worker's input features
    weight   [N, K_r]       nn.Linear layout, split along the input features
    bias     [N] or None    added to this worker's partial: pass it on one worker (or split it)
    forward  y   = sum_r (x_r @ weight_r.T + bias_r)                    [*, N] on every worker
    dgrad    dx  = g @ weight            g: the gradient of y (see grad_output)
             "sum": g = all_reduce(dy) = all_gather_N(h), h = reduce_scatter_N(dy)   h [*, N_r]
                    dx = all_gather_N(h) @ weight: the forward phase of all_gather_features_matmul
                    (ag_push_columns + gathered_k_matmul with weight.t() [K_r, N]), which hands g back
    wgrad    dW  = g.T @ x,   db = sum of g over the rows (on the workers that passed a bias)

``grad_output`` says which of two forms the op serves:

* ``"sum"`` (the adjoint; DistDL's AllSumReduce convention), for the general
  :class:`~distfuse.layers.DistributedLinear` (broadcast, GEMM, sum-reduce): each row of the
  weight grid all-reduces its partials and the row's ``P_y`` worker keeps the result (the
  others pass a zero gradient back).  ``g = all_reduce(dy)`` is taken as the two halves of
  a two-shot all-reduce: the all-gather half is exactly the input of a GEMM along its K
  dim, which :mod:`distfuse.fused.all_gather_features_matmul` fuses (``dx`` reads ``h``'s
  column chunks as their flags come up; the gathered ``g``, bit-identical on every worker,
  serves ``dW`` and ``db``).  The reduce-scatter half stays a plain collective (fp32,
  rounded once): ``dy`` arrives whole, so no GEMM epilogue could carry it.  Bytes on the
  links are a ring all-reduce's; the gain is that the all-gather half overlaps the dgrad GEMM.
* ``"replicated"``, for the row-parallel linear with a replicated output (DTensor's
  ``RowwiseParallel`` default, Megatron's ``RowParallelLinear``): ``g = dy``, correct only
  when every worker's ``dy`` is the same full gradient (a replicated loss; with ``"sum"``
  it would count W times).  The backward moves nothing.

Algorithms (:func:`pick_algorithm`, or ``algorithm=``): **one-shot** for small outputs
(each tile stored once into every peer's slot, each worker sums the W slots: one claim,
one flag round) and **two-shot** for large ones (GEMM + reduce-scatter along the
features, then an all-gather of the reduced columns: about 2 (W - 1) / W of the output
per worker on the links instead of W - 1).  Both sum the partials in fp32 in rank order,
so every worker's copy is bit-identical; see :mod:`distfuse.kernels.matmul_all_reduce`.
Workspace, availability and world size 1: :mod:`distfuse.fused.matmul_common` (the
unfused composition is ``F.linear`` + AllSumReduce).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
from distfuse import debug
from distfuse.errors import UnsupportedError, expect
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    Phases,
    check_linear_args,
    check_loopback_counts,
    check_member,
    check_partial_dtype,
    flat_rows,
    require_available,
    run_phases,
)
from distfuse.fused.matmul_phases import gather_and_consume, run_matmul_all_reduce
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.kernels.all_gather_features_matmul import gathered_k_workspace_bytes
from distfuse.kernels.signature import SCATTER_FLAGS
from distfuse.partition import Partition

__all__ = ["PHASES", "matmul_all_reduce", "matmul_all_reduce_plan", "matmul_all_reduce_loopback",
           "matmul_all_reduce_workspace_bytes", "pick_algorithm", "ONE_SHOT_MAX_BYTES", "ALGORITHMS", "GRAD_OUTPUTS"]

_OP = "matmul_all_reduce"
ALGORITHMS = ("auto", "one_shot", "two_shot")
GRAD_OUTPUTS = ("sum", "replicated")
#: Largest output (bytes per worker) the one-shot algorithm takes under ``algorithm="auto"``: a starting point, not
#: a measurement (one-shot moves W - 1 copies of the output per worker in one flag round, two-shot about two in two).
ONE_SHOT_MAX_BYTES = 256 << 10


def pick_algorithm(rows: int, N: int, dtype: torch.dtype, algorithm: str = "auto") -> str:
    """``"one_shot"`` or ``"two_shot"`` for a ``[rows, N]`` output (``auto``: by :data:`ONE_SHOT_MAX_BYTES`)."""
    if algorithm not in ALGORITHMS:
        raise expect(_OP, "algorithm", " or ".join(ALGORITHMS), repr(algorithm), cls=UnsupportedError)
    if algorithm != "auto":
        return algorithm
    return "one_shot" if rows * N * dtype.itemsize <= ONE_SHOT_MAX_BYTES else "two_shot"


def matmul_all_reduce_workspace_bytes(rows: int, N: int, world_size: int, dtype: torch.dtype, algorithm: str,
                                      partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes on every rank for ``algorithm`` (``"one_shot"`` / ``"two_shot"``); 0 at world size 1."""
    if world_size == 1:
        return 0
    pd = partial_dtype or dtype
    if algorithm == "one_shot":
        forward = all_reduce_kernels.one_shot_workspace_bytes(rows, N, world_size, pd)
    else:
        forward = all_reduce_kernels.two_shot_workspace_bytes(rows, N, world_size, dtype, pd)
    # The backward's all-gather half: the gathered [rows, N] gradient (never more than the forward's: asked for
    # so that the one request serves both directions).
    return max(forward, gathered_k_workspace_bytes(rows, N, dtype))


class _Plan(NamedTuple):
    comm: Comm
    k: int  # inputs and weights: one per rank this process launches
    bias_at: tuple  # which of the k ranks pass a bias (in order)
    algorithm: str
    grad_output: str
    partial_dtype: torch.dtype | None
    nbytes: int


def _forward(plan: _Plan, needs, xs, weights, biases):
    return run_matmul_all_reduce(plan.comm, f"{_OP}.forward", xs, weights, biases, plan.algorithm,
                                 plan.partial_dtype, plan.nbytes), []


def _backward(plan: _Plan, needs, xs, weights, biases, extras, dys):
    comm = plan.comm
    need_dx, need_dw, _ = needs
    gs = [flat_rows(dy) for dy in dys]
    if plan.grad_output == "sum" and comm.world_size > 1:
        # g = all_gather_N(reduce_scatter_N(dy)) (see the module doc), the all-gather half fused with dx_r = g @ W_r.
        # Every rank runs both halves whatever it needs (they are collective); copies, never dy itself.
        hs = comm.reduce_scatter(gs, -1, gs[0].shape[1], torch.float32)
        dxs, gs = gather_and_consume(comm, f"{_OP}.backward", hs, [w.t() for w in weights], [None] * plan.k,
                                     axis="features", extent=gs[0].shape[1], return_gathered=True, nbytes=plan.nbytes)
        dxs = [dx.view(x.shape) if need_dx else None for dx, x in zip(dxs, xs, strict=True)]
    else:
        # grad_output="replicated" (or one rank): every rank's dy is already the whole gradient, nothing moves.
        dxs = [(g @ w).view(x.shape) if need_dx else None for g, w, x in zip(gs, weights, xs, strict=True)]
    dws = [g.t() @ flat_rows(x) if need_dw else None for g, x in zip(gs, xs, strict=True)]
    dbs = [g.sum(0) if b is not None else None for g, b in zip(gs, biases, strict=True)]
    return dxs, dws, dbs


#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`).
PHASES = Phases(_forward, _backward)


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition, *,
                      grad_output: str = "sum", algorithm: str = "auto",
                      partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused ``sum over P_sub of (x @ weight.T + bias)``, the result on every worker, autograd-aware.

    Args:
        x: ``[*, K_r]`` (at least 2 dims), every row and this worker's input features.
        weight: ``[N, K_r]``, x's dtype (fp32, fp16 or bf16) and device.
        bias: ``[N]`` added to this worker's partial, or None.  Workers may differ (pass it on
            one worker to add it once).
        P_sub: the workers whose partials are summed; must satisfy
            :func:`~distfuse.fused.matmul_common.fused_linear_available`.
        grad_output: ``"sum"`` (the adjoint) or ``"replicated"`` (every worker's gradient is
            already the full one); see the module doc.
        algorithm: ``"auto"`` (:func:`pick_algorithm`), ``"one_shot"`` or ``"two_shot"``.
        partial_dtype: dtype of the partial products on the wire (default x's).

    Returns ``[*, N]``, the same values on every worker of ``P_sub``.
    Collective over ``P_sub`` in forward (and in backward with ``grad_output="sum"``): every
    worker passes the same rows, ``N``, dtype, ``grad_output`` and ``algorithm``
    (``DISTFUSE_DEBUG=1`` checks).
    """
    plan = matmul_all_reduce_plan(x, weight, bias, P_sub, grad_output=grad_output, algorithm=algorithm,
                                  partial_dtype=partial_dtype)
    return run_phases(PHASES, plan, [x], [weight], [bias])[0]


def matmul_all_reduce_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition, *,
                           grad_output: str = "sum", algorithm: str = "auto",
                           partial_dtype: torch.dtype | None = None) -> _Plan:
    """:func:`matmul_all_reduce`'s checks and plan: what its phases run on (collective where the checks refuse,
    see :mod:`distfuse.fused.agreement`)."""
    check_member(_OP, P_sub)
    W = P_sub.size
    # Both algorithms' first claim, where a refusal reaches the peers, has the reduce-scatter flag layout.
    with refusal(_OP, P_sub, x, SCATTER_FLAGS, nbytes=lambda: matmul_all_reduce_workspace_bytes(
            math.prod(x.shape[:-1]), weight.shape[0], W, x.dtype,
            pick_algorithm(math.prod(x.shape[:-1]), weight.shape[0], x.dtype, algorithm), partial_dtype)):
        check_linear_args(_OP, x, weight, bias, P_sub.device)
        if grad_output not in GRAD_OUTPUTS:
            raise expect(_OP, "grad_output", " or ".join(GRAD_OUTPUTS), repr(grad_output), cls=UnsupportedError)
        check_partial_dtype(_OP, partial_dtype)
        rows, N = math.prod(x.shape[:-1]), weight.shape[0]
        algorithm = pick_algorithm(rows, N, x.dtype, algorithm)
    require_available(_OP, P_sub, x.device)
    debug.check_agreement(_OP, P_sub.ranks, P_sub.meta_group,
                          same=dict(rows=rows, N=N, dtype=str(x.dtype), grad_output=grad_output, algorithm=algorithm,
                                    partial_dtype=str(partial_dtype)),
                          info=dict(x=tuple(x.shape), bias=bias is not None))
    return _Plan(Comm(P=P_sub, device=x.device), 1, (0,) if bias is not None else (), algorithm, grad_output,
                 partial_dtype, matmul_all_reduce_workspace_bytes(rows, N, W, x.dtype, algorithm, partial_dtype))


def matmul_all_reduce_loopback(xs, weights, bias: torch.Tensor | None, ws: LoopbackWorkspace, *,
                               grad_output: str = "sum", algorithm: str = "auto",
                               partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`matmul_all_reduce` for all W virtual ranks of a loopback workspace, autograd-aware.

    ``xs[r]`` ``[*, K_r]`` and ``weights[r]`` ``[N, K_r]``; ``bias`` ``[N]`` is added by
    virtual rank 0.  Returns the W (equal) outputs ``[*, N]``.
    """
    op = f"{_OP}_loopback"
    W = ws.world_size
    check_loopback_counts(op, W, xs, weights)
    for r, (x, w) in enumerate(zip(xs, weights, strict=True)):
        check_linear_args(op, x, w, bias if r == 0 else None)
        if x.shape[:-1] != xs[0].shape[:-1] or w.shape[0] != weights[0].shape[0] or x.device != ws.device:
            raise expect(op, "x rows alike, N alike, the workspace's device",
                         (tuple(xs[0].shape[:-1]), weights[0].shape[0], ws.device),
                         (tuple(x.shape[:-1]), w.shape[0], x.device))
    x0 = xs[0]
    rows, N = math.prod(x0.shape[:-1]), weights[0].shape[0]
    algorithm = pick_algorithm(rows, N, x0.dtype, algorithm)
    plan = _Plan(Comm(loopback=ws), W, (0,) if bias is not None else (), algorithm, grad_output, partial_dtype,
                 matmul_all_reduce_workspace_bytes(rows, N, W, x0.dtype, algorithm, partial_dtype))
    return run_phases(PHASES, plan, xs, weights, [bias] + [None] * (W - 1))
