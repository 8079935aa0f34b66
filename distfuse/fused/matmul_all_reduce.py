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
unfused composition is ``F.linear`` + AllSumReduce).  The op is declared on the pipeline
(``SPEC``, a :class:`~distfuse.fused.matmul_phases.PipelineLinear` with its own phases),
which gives its plan and loopback form: ``algorithm`` is its forward's kernel choice,
``grad_output`` its gradient option.
"""

from __future__ import annotations

import math

import torch

import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
from distfuse.errors import UnsupportedError, expect
from distfuse.fused.matmul_common import check_linear_args, flat_rows
from distfuse.fused.matmul_phases import LinearPlan, PipelineLinear, gather_and_consume, run_matmul_all_reduce
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.kernels.all_gather_features_matmul import gathered_k_workspace_bytes
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


class _MatmulAllReduce(PipelineLinear):
    """The pipeline's scattering features linear with a forward of its own (one-shot or two-shot) and a bias on any
    rank; its plan's ``provider`` is the algorithm, ``grad`` the ``grad_output``."""

    name, axis, scatters = _OP, "features", True
    grad_option, choice_option, grad_values, bias_alike = "grad_output", "algorithm", GRAD_OUTPUTS, False

    def check(self, op, x, weight, bias, W, r, extent, device):
        check_linear_args(op, x, weight, bias, device)
        return weight.shape[0]

    def choose(self, x, weight, extent, W, choice):
        return pick_algorithm(math.prod(x.shape[:-1]), weight.shape[0], x.dtype, choice)

    def request(self, x, weight, extent, W, partial_dtype, choice):
        return matmul_all_reduce_workspace_bytes(math.prod(x.shape[:-1]), weight.shape[0], W, x.dtype,
                                                 self.choose(x, weight, extent, W, choice), partial_dtype)

    def out_shape(self, x, weight, W, r, n):
        return (*x.shape[:-1], weight.shape[0])

    def forward(self, plan: LinearPlan, needs, xs, weights, biases):
        return run_matmul_all_reduce(plan.comm, f"{_OP}.forward", xs, weights, biases, plan.provider,
                                     plan.partial_dtype, plan.nbytes), []

    def backward(self, plan: LinearPlan, needs, xs, weights, biases, extras, dys):
        comm = plan.comm
        need_dx, need_dw, _ = needs
        gs = [flat_rows(dy) for dy in dys]
        if plan.grad == "sum" and comm.world_size > 1:
            # g = all_gather_N(reduce_scatter_N(dy)) (see the module doc), the all-gather half fused with
            # dx_r = g @ W_r.  Every rank runs both halves whatever it needs (they are collective); copies, never dy.
            hs = comm.reduce_scatter(gs, -1, gs[0].shape[1], torch.float32)
            dxs, gs = gather_and_consume(comm, f"{_OP}.backward", hs, [w.t() for w in weights], [None] * plan.k,
                                         axis="features", extent=gs[0].shape[1], return_gathered=True,
                                         nbytes=plan.nbytes)
            dxs = [dx.view(x.shape) if need_dx else None for dx, x in zip(dxs, xs, strict=True)]
        else:
            # grad_output="replicated" (or one rank): every rank's dy is already the whole gradient, nothing moves.
            dxs = [(g @ w).view(x.shape) if need_dx else None for g, w, x in zip(gs, weights, xs, strict=True)]
        dws = [g.t() @ flat_rows(x) if need_dw else None for g, x in zip(gs, xs, strict=True)]
        dbs = [g.sum(0) if b is not None else None for g, b in zip(gs, biases, strict=True)]
        return dxs, dws, dbs


SPEC = _MatmulAllReduce()
#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`).
PHASES = SPEC.phases


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
    return SPEC(x, weight, bias, P_sub, partial_dtype=partial_dtype, bias_grad=grad_output, provider=algorithm)


def matmul_all_reduce_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition, *,
                           grad_output: str = "sum", algorithm: str = "auto",
                           partial_dtype: torch.dtype | None = None) -> LinearPlan:
    """:func:`matmul_all_reduce`'s checks and plan (:meth:`~distfuse.fused.matmul_phases.PipelineLinear.plan`)."""
    return SPEC.plan(x, weight, bias, P_sub, partial_dtype=partial_dtype, bias_grad=grad_output, provider=algorithm)


def matmul_all_reduce_loopback(xs, weights, bias: torch.Tensor | None, ws: LoopbackWorkspace, *,
                               grad_output: str = "sum", algorithm: str = "auto",
                               partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`matmul_all_reduce` for all W virtual ranks of a loopback workspace, autograd-aware.

    ``xs[r]`` ``[*, K_r]`` and ``weights[r]`` ``[N, K_r]``; ``bias`` ``[N]`` is added by
    virtual rank 0.  Returns the W (equal) outputs ``[*, N]``.
    """
    biases = None if bias is None else [bias] + [None] * (ws.world_size - 1)
    return SPEC.loopback(xs, weights, biases, ws, partial_dtype=partial_dtype, bias_grad=grad_output,
                         provider=algorithm)
