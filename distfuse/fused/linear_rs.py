"""Fused row-parallel linear (sequence parallel): GEMM + reduce-scatter forward, all-gather + GEMM backward.

Worker ``r`` of the ``W`` model-parallel workers of ``P_sub`` holds input-feature block
``r`` and, on output, sequence block ``r`` (``*`` any leading dims, ``n_r`` the balanced
block ``r`` of ``n``, so ``n`` need not divide by ``W``)::

    x        [*, n, K_r]    full sequence, this worker's input features
    weight   [N, K_r]       nn.Linear layout, split along the input features
    bias     [N]            replicated: the same values on every worker of P_sub
    forward  y_r = reduce_scatter_n(x @ weight.T)[block r] + bias               [*, n_r, N]
             gemm_rs stores each tile into its owner's symmetric slot; chunk_reduce sums
             the W partials in fp32 and adds the bias once
    dgrad    dx  = all_gather_n(dy) @ weight                                     [*, n, K_r]
             ag_push + ag_gemm_consume(dy, weight.t(), return_gathered=True)
    wgrad    dW  = g.T @ x   with g = all_gather_n(dy), the copy the AG kernel returns   [N, K_r]
             db  = sum of dy over this worker's rows  (a partial: see Bias)         [N]

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

Every rank of ``P_sub`` must pass a bias, or none.

Workspace.  Both directions run on the cached symmetric workspace of ``P_sub``
(:func:`~distfuse.fused.symmetric.get_workspace`), requested once with the max of the two
kernels' needs (:func:`linear_rs_workspace_bytes`).  The forward and the backward each
claim it (``ws.in_flight``): one fused op in flight per workspace, so a second fused op
cannot run on it between this op's launches.  Outputs never alias the workspace.

Why this exists.  No public library offers eager-mode fused all-gather/reduce-scatter
GEMMs with autograd: Flux and Triton-distributed ship forward kernels only, and torch's
``torch.ops.symm_mem.fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul`` get a
backward only through torch.compile's async-TP pass (the micro-pipeline TP graph
rewrite).  Here each op's backward is the other fused op.

World size 1: a plain ``F.linear`` (no workspace, no communication).  Where symmetric
memory is unavailable (several hosts, no P2P, CPU without the Triton interpreter), the
functional forms must not be called: ask :func:`fused_linear_available` first and fall
back to the unfused composition (``F.linear`` + the ReduceScatter / AllGather
primitives), logging the reason once with
:func:`~distfuse.fused.symmetric.log_fallback_once`.

This file also holds what the all-gather op (``linear_ag.py``) shares: the two fused
phases, the row gather used when the gathered input is not kept, availability and the
loopback plumbing.  All kernel launches of both ops happen in :func:`_rs_phase` and
:func:`_ag_phase`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.fused.symmetric import LoopbackWorkspace, get_workspace, symmetric_memory_available
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import FLOAT_DTYPES
from distfuse.kernels.ag_gemm import ag_gemm_consume, ag_gemm_workspace_bytes, ag_push
from distfuse.kernels.gemm_rs import chunk_reduce, gemm_rs, gemm_rs_workspace_bytes
from distfuse.partition import Partition

__all__ = [
    "MatmulReduceScatter",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_loopback",
    "linear_rs_workspace_bytes",
    "fused_linear_available",
]

_OP = "matmul_reduce_scatter"
BIAS_GRADS = ("partial", "sum")


# ---------------------------------------------------------------- availability and sizes


def fused_linear_available(P_sub: Partition, device=None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Whether the fused linear ops can run on ``P_sub`` (and ``dtype``), and why not.

    True at world size 1 (a local GEMM, nothing to share).  Otherwise it is
    :func:`~distfuse.fused.symmetric.symmetric_memory_available`, which is **collective
    over P_sub the first time** (per group and device; cached afterwards): every rank of
    ``P_sub`` must call it, and all get the same answer.  The dtype check is local.

    Layers use it as::

        ok, why = fused_linear_available(P_sub, x.device, x.dtype)
        if not ok:
            log_fallback_once(why)   # then the unfused composition
    """
    if not P_sub.active:
        return False, "this rank is not in the partition"
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return False, f"the fused linear kernels support {[str(d) for d in FLOAT_DTYPES]}, not {dtype}"
    if P_sub.size == 1:
        return True, "world size 1: a local GEMM, no communication"
    return symmetric_memory_available(P_sub, device)


def _require_available(op: str, P_sub: Partition, device) -> None:
    """Raise on every rank (the verdict is collective, hence the same everywhere) where the fused path cannot run."""
    if P_sub.size > 1:
        ok, why = symmetric_memory_available(P_sub, device)
        if not ok:
            raise UnsupportedError(f"{where(op)}: the fused path cannot run here ({why}); check "
                                   "fused_linear_available first and use the unfused composition")


def linear_rs_workspace_bytes(batch: int, n: int, N: int, world_size: int, dtype: torch.dtype,
                              partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes :func:`matmul_reduce_scatter` needs on every rank (forward and backward).

    The forward's W partial slots (:func:`~distfuse.kernels.gemm_rs.gemm_rs_workspace_bytes`)
    or the backward's gathered ``dy`` ``[B_, n, N]``, whichever is larger; 0 at world size 1.
    ``batch`` is the product of the leading dims.
    """
    if world_size == 1:
        return 0
    return max(gemm_rs_workspace_bytes(batch, n, N, world_size, partial_dtype or dtype),
               ag_gemm_workspace_bytes(batch, n, N, dtype))


# ---------------------------------------------------------------- where an op runs


class _Comm:
    """Where one fused op runs: this rank of a real group, or every virtual rank of a loopback workspace.

    ``ranks`` are the (virtual) ranks this process launches for: ``(P.rank,)`` on a real
    group, ``0..W-1`` in loopback.  The phases below loop over them, so one code path
    serves both.
    """

    def __init__(self, P: Partition | None = None, loopback: LoopbackWorkspace | None = None,
                 device: torch.device | None = None):
        self.P = P
        self._loopback = loopback
        if loopback is not None:
            self.world_size = loopback.world_size
            self.ranks = tuple(range(self.world_size))
            self.device = loopback.device
        else:
            self.world_size = P.size
            self.ranks = (P.rank,)
            self.device = device

    @property
    def is_loopback(self) -> bool:
        return self._loopback is not None

    def workspace(self, op: str, nbytes: int):
        if self._loopback is not None:
            if self._loopback.nbytes < nbytes:
                raise ShapeError(f"{where(op)}: loopback workspace: expected at least {nbytes} data bytes, got "
                                 f"{self._loopback.nbytes}")
            return self._loopback
        return get_workspace(self.P, nbytes, self.device)

    def start_gather(self, op: str, xs, n: int):
        """Start gathering every rank's rows ``[B_, n_r, K]`` into ``[B_, n, K]``; ``.wait()`` gives one per rank.

        Used by the all-gather op's backward when the forward did not keep its gathered
        input.  On CUDA the collective is asynchronous (NCCL on its own stream) so that it
        overlaps the dgrad GEMM + reduce-scatter issued after it; on gloo it completes
        here, because a pending gloo collective and the workspace's monitored barrier
        would share the group.
        """
        if self.is_loopback or self.world_size == 1:
            full = torch.cat(list(xs), dim=-2)
            return _Done([full] * len(xs))
        return _RowGather(self.P, xs[0], n)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and not self.is_loopback:
            dist.all_reduce(t, group=self.P.group)
        return t


class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _RowGather:
    """All-gather of sequence blocks ``[B_, n_r, K]`` over ``P`` (padded to ``ceil(n / W)`` rows: gloo and NCCL
    need equal blocks), reassembled in partition order."""

    def __init__(self, P: Partition, x: torch.Tensor, n: int):
        W = P.size
        self.lead = x.shape[:-2]
        len_r, K = x.shape[-2:]
        B = math.prod(self.lead)
        x = x.reshape(B, len_r, K)
        q1 = -(-n // W)
        self.P, self.n, self.shape = P, n, (B, q1, K)
        if len_r == q1 and x.is_contiguous():
            block = x
        else:
            block = x.new_zeros(B, q1, K)
            block[:, :len_r] = x
        self.out = x.new_empty(W * B * q1 * K)
        # Slot g of a flat collective belongs to the member with the g-th smallest world rank
        # (new_group sorts), not necessarily partition rank g.
        self.slots = [dist.get_group_rank(P.group, r) for r in P.ranks]
        self.block = block  # alive until the (possibly asynchronous) collective has read it
        self.work = None
        if self.out.numel():
            async_op = x.device.type == "cuda"
            work = all_gather_flat(self.out, block, group=P.group, async_op=async_op)
            self.work = work if async_op else None

    def wait(self):
        if self.work is not None:
            self.work.wait()
        W = self.P.size
        B, q1, K = self.shape
        blocks = self.out.view(W, B, q1, K)
        parts = [blocks[self.slots[j], :, :block_extent(self.n, W, j)] for j in range(W)]
        return [torch.cat(parts, dim=1).view(*self.lead, self.n, K)]


def _alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer for a kernel; NaN-filled in debug mode so that an element no kernel wrote shows up."""
    if debug.enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------- the two fused phases


def _rs_phase(comm: _Comm, op: str, xs, weights, biases, n: int, partial_dtype, nbytes: int) -> list[torch.Tensor]:
    """GEMM + reduce-scatter for every rank of ``comm``, in one claim: ``x [*, n, K] -> [*, n_r, N_out]``.

    ``weights[i]`` is ``[N_out, K]`` (any strides); ``biases[i]`` ``[N_out]`` or None.
    """
    W = comm.world_size
    if W == 1:
        return [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases, strict=True)]
    ws = comm.workspace(op, nbytes)
    lead = xs[0].shape[:-2]
    B = math.prod(lead)
    N_out = weights[0].shape[0]
    outs = []
    with ws.in_flight(op):
        for r, x, w in zip(comm.ranks, xs, weights, strict=True):
            gemm_rs(x, w, ws, r, W, partial_dtype=partial_dtype or x.dtype)
        for r, x, b in zip(comm.ranks, xs, biases, strict=True):
            len_r = block_extent(n, W, r)
            out = _alloc((B, len_r, N_out), x.dtype, x.device)
            chunk_reduce(ws, r, W, B, n, N_out, partial_dtype=partial_dtype or x.dtype, bias=b, out_dtype=x.dtype,
                         out=out)
            outs.append(out.view(*lead, len_r, N_out))
    return outs


def _ag_phase(comm: _Comm, op: str, shards, weights, biases, n: int, return_gathered: bool, nbytes: int):
    """All-gather + GEMM for every rank of ``comm``, in one claim: ``shard [*, n_r, K] -> [*, n, N_out]``.

    Returns ``(ys, gathered)``; ``gathered[i]`` is the gathered ``[*, n, K]`` when
    ``return_gathered`` (else None).
    """
    W = comm.world_size
    if W == 1:
        ys = [F.linear(x, w, b) for x, w, b in zip(shards, weights, biases, strict=True)]
        return ys, [x if return_gathered else None for x in shards]
    ws = comm.workspace(op, nbytes)
    ys, gathered = [], []
    with ws.in_flight(op):
        for r, x in zip(comm.ranks, shards, strict=True):
            ag_push(x, ws, r, W, n)
        for r, x, w, b in zip(comm.ranks, shards, weights, biases, strict=True):
            lead = x.shape[:-2]
            out = _alloc((*lead, n, w.shape[0]), x.dtype, x.device)
            # A zero-width weight launches no GEMM (hence no flag wait): its gathered copy would race, and
            # the caller's product with it is empty anyway.
            want = return_gathered and w.shape[0] > 0
            res = ag_gemm_consume(x, w, ws, r, W, n, bias=b, out=out, return_gathered=want)
            if want:
                ys.append(res[0])
                gathered.append(res[1])
            else:
                ys.append(res)
                gathered.append(x.new_zeros(*lead, n, x.shape[-1]) if return_gathered else None)
    return ys, gathered


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[*, m, F] -> [prod(*) * m, F]``."""
    return t.reshape(-1, t.shape[-1])


# ---------------------------------------------------------------- autograd


class _RSPlan(NamedTuple):
    comm: _Comm
    k: int  # tensors per kind (ranks launched by this process)
    has_bias: bool
    n: int
    partial_dtype: torch.dtype | None
    bias_grad: str
    nbytes: int


class MatmulReduceScatter(torch.autograd.Function):
    """Autograd Function of :func:`matmul_reduce_scatter` (and its loopback form); see the module doc.

    ``apply(plan, *xs, *weights, *biases)``: one tensor of each kind per rank this process
    launches (one on a real group, W in loopback).  Use the functional forms.
    """

    @staticmethod
    def forward(ctx, plan: _RSPlan, *tensors):
        k = plan.k
        xs, weights = tensors[:k], tensors[k:2 * k]
        biases = tensors[2 * k:3 * k] if plan.has_bias else (None,) * k
        ys = _rs_phase(plan.comm, f"{_OP}.forward", xs, weights, biases, plan.n, plan.partial_dtype, plan.nbytes)
        ctx.plan = plan
        ctx.save_for_backward(*xs, *weights)
        return ys[0] if k == 1 else tuple(ys)

    @staticmethod
    @once_differentiable
    def backward(ctx, *dys):
        plan = ctx.plan
        k, comm = plan.k, plan.comm
        saved = ctx.saved_tensors
        xs, weights = saved[:k], saved[k:]
        needs = ctx.needs_input_grad[1:]
        need_dx, need_dw = any(needs[:k]), any(needs[k:2 * k])
        need_db = plan.has_bias and any(needs[2 * k:3 * k])
        dys = [dy.contiguous() for dy in dys]
        dxs, dws, dbs = [None] * k, [None] * k, [None] * k
        if need_dx or need_dw:
            # dx = all_gather(dy) @ W; the kernel hands back the gathered dy for the weight gradient.
            dxs_all, gathered = _ag_phase(comm, f"{_OP}.backward", dys, [w.t() for w in weights], [None] * k, plan.n,
                                          need_dw, plan.nbytes)
            if need_dx:
                dxs = dxs_all
            if need_dw:
                dws = [_rows(g).t() @ _rows(x) for g, x in zip(gathered, xs, strict=True)]
        if need_db:
            if plan.bias_grad == "sum":
                dbs = [comm.all_reduce_(_rows(dy).sum(0, dtype=torch.float32)).to(dy.dtype) for dy in dys]
            else:
                dbs = [_rows(dy).sum(0) for dy in dys]
        return (None, *dxs, *dws, *(dbs if plan.has_bias else ()))


def _check_rs_args(op: str, x, weight, bias, device=None) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise expect(op, "x and weight types", "torch.Tensor", (type(x).__name__, type(weight).__name__))
    if x.dim() < 2 or weight.dim() != 2:
        raise ShapeError(f"{where(op)}: expected x [*, n, K_r] and weight [N, K_r], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise expect(op, f"weight input features (x.shape[-1]; weight {tuple(weight.shape)})", x.shape[-1],
                     weight.shape[1])
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise UnsupportedError(f"{where(op)}: dtypes: expected x and weight of one dtype among "
                               f"{[str(d) for d in FLOAT_DTYPES]}, got {x.dtype} and {weight.dtype}")
    if weight.device != x.device or (device is not None and x.device.type != device.type):
        want = x.device if device is None else f"one {device.type} device"
        raise expect(op, "devices of x and weight", want, (x.device, weight.device))
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise expect(op, "bias (shape [N], x's dtype and device)", ((weight.shape[0],), x.dtype, x.device),
                     (tuple(bias.shape), bias.dtype, bias.device))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, P_sub: Partition, *,
                          partial_dtype: torch.dtype | None = None, bias_grad: str = "partial") -> torch.Tensor:
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

    Returns:
        ``[*, n_r, N]``: this worker's sequence block of the reduced output.

    Collective over ``P_sub`` in forward and backward (every rank calls it with the same
    ``n``, ``N``, leading dims, dtype and bias presence; ``DISTFUSE_DEBUG=1`` checks).
    """
    if not P_sub.active:
        raise PartitionError(f"{where(_OP)}: this rank is not in P_sub {list(P_sub.ranks)}")
    _check_rs_args(_OP, x, weight, bias, P_sub.device)
    if bias_grad not in BIAS_GRADS:
        raise expect(_OP, "bias_grad", " or ".join(BIAS_GRADS), repr(bias_grad), cls=UnsupportedError)
    if partial_dtype is not None and partial_dtype not in FLOAT_DTYPES:
        raise expect(_OP, "partial_dtype", FLOAT_DTYPES, partial_dtype, cls=UnsupportedError)
    _require_available(_OP, P_sub, x.device)
    W = P_sub.size
    n, N = x.shape[-2], weight.shape[0]
    B = math.prod(x.shape[:-2])
    debug.check_agreement(_OP, P_sub.ranks, P_sub.meta_group,
                          same=dict(n=n, N=N, lead=tuple(x.shape[:-2]), dtype=str(x.dtype), bias=bias is not None,
                                    partial_dtype=str(partial_dtype), bias_grad=bias_grad),
                          info=dict(x=tuple(x.shape)))
    plan = _RSPlan(_Comm(P=P_sub, device=x.device), 1, bias is not None, n, partial_dtype, bias_grad,
                   linear_rs_workspace_bytes(B, n, N, W, x.dtype, partial_dtype))
    tensors = (x, weight) + ((bias,) if bias is not None else ())
    return MatmulReduceScatter.apply(plan, *tensors)


def matmul_reduce_scatter_loopback(xs, weights, bias: torch.Tensor | None, ws: LoopbackWorkspace, *,
                                   partial_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`matmul_reduce_scatter` for all W virtual ranks of a loopback workspace, in one process, autograd-aware.

    ``xs[r]`` ``[*, n, K_r]`` and ``weights[r]`` ``[N, K_r]`` are virtual rank ``r``'s;
    ``bias`` ``[N]`` is the one shared tensor (its gradient accumulates every rank's
    partial, i.e. the full gradient).  Returns the W outputs ``[*, n_r, N]``.  For
    testing and single-GPU timing; size ``ws`` with :func:`linear_rs_workspace_bytes`.
    """
    op = f"{_OP}_loopback"
    W = ws.world_size
    if len(xs) != W or len(weights) != W:
        raise expect(op, "number of inputs and weights (the workspace's world size)", W, (len(xs), len(weights)))
    for x, w in zip(xs, weights, strict=True):
        _check_rs_args(op, x, w, bias)
        if x.shape[:-1] != xs[0].shape[:-1] or w.shape[0] != weights[0].shape[0] or x.device != ws.device:
            raise expect(op, "x shapes [*, n, K_r] alike but for K_r, N alike, the workspace's device",
                         (tuple(xs[0].shape[:-1]), weights[0].shape[0], ws.device),
                         (tuple(x.shape[:-1]), w.shape[0], x.device))
    x0 = xs[0]
    n, N = x0.shape[-2], weights[0].shape[0]
    plan = _RSPlan(_Comm(loopback=ws), W, bias is not None, n, partial_dtype, "partial",
                   linear_rs_workspace_bytes(math.prod(x0.shape[:-2]), n, N, W, x0.dtype, partial_dtype))
    tensors = (*xs, *weights) + ((bias,) * W if bias is not None else ())
    out = MatmulReduceScatter.apply(plan, *tensors)
    return [out] if W == 1 else list(out)
