"""What the GEMM fusions share besides their phases: availability, checks, sizes, where an op runs, autograd.

The fused linears (one module each: :mod:`~distfuse.fused.matmul_reduce_scatter`,
:mod:`~distfuse.fused.all_gather_matmul`, their ``_features`` forms,
:mod:`~distfuse.fused.matmul_all_reduce`) share these rules, stated here once:

* **Workspace.**  An op runs on the cached symmetric workspace of its group
  (:func:`~distfuse.fused.symmetric.get_workspace`), asked for once with the larger of its
  two phases' needs (the op's ``*_workspace_bytes``); the forward and the backward each
  claim it (one fused op in flight per workspace).  Outputs never alias it.
* **Availability.**  At world size 1 an op is a plain ``F.linear``.  Where symmetric memory
  is unavailable (several hosts, no P2P, CPU without the Triton interpreter) the ops must
  not be called: ask :func:`fused_linear_available` first and fall back to the unfused
  composition (``F.linear`` + the matching primitive), logging the reason once with
  :func:`~distfuse.fused.symmetric_availability.log_fallback_once`.
* **Autograd.**  Each op's backward is its mirror's forward phase: the ops are declared on
  one pipeline, :mod:`distfuse.fused.matmul_phases`, where every kernel launch is.
  :class:`Phases` holds an op's two phases, run eagerly by :func:`run_phases` and compiled
  as a custom op pair (:mod:`distfuse.ops.fused_linear`).
  Why: no public library offers eager-mode fused all-gather/reduce-scatter GEMMs with
  autograd (Flux and Triton-distributed ship forward kernels only; torch's
  ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul`` get a
  backward only through torch.compile's async-TP pass).
* **Loopback.**  Each op's ``*_loopback`` form runs all W virtual ranks of a
  :class:`~distfuse.fused.workspace.LoopbackWorkspace` in one process, autograd-aware (testing,
  single-GPU timing).

:class:`Comm` says where an op runs and holds the plain collectives the ops fall back on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
import distfuse.kernels.all_gather_matmul as all_gather_kernels
import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
from distfuse._compat import all_gather_flat, reduce_scatter_flat
from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.fused.agreement import agreed_workspace
from distfuse.fused.symmetric_availability import symmetric_memory_available
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels._utils import FLOAT_DTYPES
from distfuse.partition import Partition

__all__ = ["fused_linear_available", "require_available", "check_partial_dtype", "check_loopback_counts",
           "check_linear_args", "workspace_bytes", "features_workspace_bytes", "Comm", "Done", "RowGather",
           "ColumnGather", "reduce_scatter_dim", "Phases", "run_phases", "flat_rows"]


def fused_linear_available(P_sub: Partition, device=None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Whether the fused GEMM ops can run on ``P_sub`` (and ``dtype``), and why not ("Availability" above).

    True at world size 1, else :func:`~distfuse.fused.symmetric_availability.symmetric_memory_available`:
    **collective over P_sub the first time** (cached afterwards), the same answer on every rank.  The dtype
    check is local.
    """
    if not P_sub.active:
        return False, "this rank is not in the partition"
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return False, f"the fused linear kernels support {[str(d) for d in FLOAT_DTYPES]}, not {dtype}"
    if P_sub.size == 1:
        return True, "world size 1: a local GEMM, no communication"
    return symmetric_memory_available(P_sub, device)


def require_available(op: str, P_sub: Partition, device) -> None:
    """Raise on every rank (the verdict is collective, hence the same everywhere) where the fused path cannot run."""
    if P_sub.size > 1:
        ok, why = symmetric_memory_available(P_sub, device)
        if not ok:
            raise UnsupportedError(f"{where(op)}: the fused path cannot run here ({why}); check "
                                   "fused_linear_available first and use the unfused composition")


def check_partial_dtype(op: str, partial_dtype) -> None:
    """``partial_dtype`` is None (the input's) or one of the float dtypes the kernels take."""
    if partial_dtype is not None and partial_dtype not in FLOAT_DTYPES:
        raise expect(op, "partial_dtype", FLOAT_DTYPES, partial_dtype, cls=UnsupportedError)


def check_loopback_counts(op: str, world_size: int, xs, weights, *biases) -> None:
    """``xs`` and ``weights`` (and ``biases``, where passed: a list or None) hold one tensor per virtual rank."""
    counts = (len(xs), len(weights), *(None if b is None else len(b) for b in biases))
    if any(c not in (None, world_size) for c in counts):
        what = "inputs, weights and biases" if biases else "inputs and weights"
        raise expect(op, f"number of {what} (the workspace's world size)", world_size, counts)


def check_linear_args(op: str, x, weight, bias, device=None) -> None:
    """Check ``x [*, rows, K]``, ``weight [N, K]``, ``bias [N]`` or None: one float dtype, one device.

    With ``device``, x must also be on a device of its type (``P_sub.device``).
    """
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


def workspace_bytes(batch: int, n: int, features: int, world_size: int, dtype: torch.dtype,
                    partial_dtype: torch.dtype | None = None) -> int:
    """Workspace data bytes on every rank for both phases over ``[B_, n, features]``, whichever needs more.

    A GEMM fusion and its backward move the same shape in opposite directions: the
    reduce-scatter phase's W partial slots (in ``partial_dtype``) or the all-gather phase's
    gathered copy (in ``dtype``).  0 at world size 1.  ``batch``: the product of the leading dims.
    """
    if world_size == 1:
        return 0
    return max(reduce_scatter_kernels.matmul_scatter_workspace_bytes(batch, n, features, world_size,
                                                                     partial_dtype or dtype),
               all_gather_kernels.gathered_matmul_workspace_bytes(batch, n, features, dtype))


def features_workspace_bytes(rows: int, features: int, world_size: int, dtype: torch.dtype,
                             partial_dtype: torch.dtype | None = None) -> int:
    """:func:`workspace_bytes` of the feature-direction pair over ``[rows, features]``: the W column slots of the
    reduce-scatter phase (in ``partial_dtype``) or the gathered ``[rows, features]`` of the all-gather phase."""
    if world_size == 1:
        return 0
    return max(rs_features_kernels.matmul_scatter_columns_workspace_bytes(rows, features, world_size,
                                                                          partial_dtype or dtype),
               ag_features_kernels.gathered_k_workspace_bytes(rows, features, dtype))


class Comm:
    """Where one fused op runs: this rank of a real group, or every virtual rank of a loopback workspace.

    ``ranks`` are the (virtual) ranks this process launches for: ``(P.rank,)`` on a real
    group, ``0..W-1`` in loopback; the phases loop over them, so one code path serves both.
    Neither ``P`` nor ``loopback``: a group of one (every phase a local GEMM, every collective a copy).
    """

    def __init__(self, P: Partition | None = None, loopback: LoopbackWorkspace | None = None,
                 device: torch.device | None = None):
        self.P = P
        self._loopback = loopback
        self.is_loopback = loopback is not None
        if loopback is not None:
            self.world_size = loopback.world_size
            self.ranks = tuple(range(self.world_size))
            self.device = loopback.device
        elif P is None:
            self.world_size, self.ranks, self.device = 1, (0,), device
        else:
            self.world_size = P.size
            self.ranks = (P.rank,)
            self.device = device

    def workspace(self, op: str, nbytes: int, layout: str):
        """The workspace for a phase that needs ``nbytes`` on every rank; ``layout`` is the phase consumer's flag
        layout, for the collective growth (:func:`~distfuse.fused.agreement.agreed_workspace`)."""
        if self._loopback is not None:
            if self._loopback.nbytes < nbytes:
                raise ShapeError(f"{where(op)}: loopback workspace: expected at least {nbytes} data bytes, got "
                                 f"{self._loopback.nbytes}")
            return self._loopback
        return agreed_workspace(self.P, self.device, op, nbytes, layout)

    def start_gather(self, op: str, xs, extent: int, features: bool = False):
        """Start gathering every rank's block into the whole; ``.wait()`` gives one per rank.

        Rows ``[B_, n_r, K]`` into ``[B_, n, K]``, or with ``features`` columns ``[*, K_r]`` into
        ``[*, K]`` (``extent``: n or K).  For a backward whose forward did not keep its gathered
        input.  On CUDA the collective is asynchronous (NCCL on its own stream), overlapping the
        dgrad issued after it; on gloo it completes here (a pending gloo collective would share
        the group with the workspace's monitored barrier).
        """
        if self.is_loopback or self.world_size == 1:
            full = torch.cat(list(xs), dim=-1 if features else -2)
            return Done([full] * len(xs))
        return (ColumnGather if features else RowGather)(self.P, xs[0], extent)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and not self.is_loopback:
            dist.all_reduce(t, group=self.P.group)
        return t

    def reduce_scatter(self, xs, dim: int, n: int, reduce_dtype: torch.dtype) -> list[torch.Tensor]:
        """Sum every rank's ``x`` (extent ``n`` along ``dim``) and keep each rank's balanced block of ``dim``.

        A plain collective, for a sum no GEMM of the op precedes (no tile epilogue to fuse it
        into): added in ``reduce_dtype``, rounded once to x's dtype; one contiguous block per
        rank launched.  Loopback adds the virtual ranks in rank order.
        """
        if self.world_size == 1:
            return [x.contiguous() for x in xs]
        if self.is_loopback:
            total = sum(x.to(reduce_dtype) for x in xs)
            return [total.narrow(dim, *_start_len(n, self.world_size, r)).to(x.dtype).contiguous()
                    for r, x in zip(self.ranks, xs, strict=True)]
        return [reduce_scatter_dim(self.P, xs[0], dim, n, reduce_dtype)]


class Done:
    """A result that is already there, behind the ``.wait()`` of a pending one (:class:`RowGather`)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class RowGather:
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


def _start_len(n: int, W: int, r: int) -> tuple[int, int]:
    start, stop = block_range(n, W, r)
    return start, stop - start


def reduce_scatter_dim(P: Partition, x: torch.Tensor, dim: int, n: int, reduce_dtype: torch.dtype) -> torch.Tensor:
    """Plain reduce-scatter over ``P`` along ``dim`` of ``x`` (extent ``n``): this rank's balanced block of the sum.

    Blocks travel padded to ``ceil(n / W)`` (gloo and NCCL need equal blocks) in
    ``reduce_dtype``, each in the slot of its owner's group rank (see :class:`RowGather`);
    the packing copy also does the transpose a feature split needs.  Returns a contiguous
    tensor of x's dtype, ``x``'s shape with ``dim`` cut to this rank's block.
    """
    W, r = P.size, P.rank
    xt = x.movedim(dim, 0)
    rest = xt.shape[1:]
    q1 = -(-n // W)
    send = xt.new_zeros((W, q1, *rest), dtype=reduce_dtype)
    for j, world_rank in enumerate(P.ranks):
        start, length = _start_len(n, W, j)
        send[dist.get_group_rank(P.group, world_rank), :length] = xt[start:start + length]
    recv = send.new_empty((q1, *rest))
    if recv.numel():  # the extents agree over P, so every rank skips together
        reduce_scatter_flat(recv, send, group=P.group)
    block = recv[:_start_len(n, W, r)[1]].movedim(0, dim)
    return block.to(x.dtype).contiguous()


class ColumnGather:
    """All-gather of feature blocks ``[*, K_r]`` over ``P`` into ``[*, K]``: a :class:`RowGather` of the
    transposed ``[K_r, rows]`` blocks (one transposing copy each way), reassembled in partition order."""

    def __init__(self, P: Partition, x: torch.Tensor, K: int):
        self.lead, self.K = x.shape[:-1], K
        self.rows = RowGather(P, flat_rows(x).t(), K)

    def wait(self):
        (g,) = self.rows.wait()  # [K, rows]
        return [g.t().reshape(*self.lead, self.K)]


class Phases(NamedTuple):
    """A fused op's autograd, as its two phases (one tensor of each kind per rank the process launches)::

        forward(plan, needs, xs, weights, biases)                -> (ys, extras)
        backward(plan, needs, xs, weights, biases, extras, dys)  -> (dxs, dweights, dbiases)

    ``needs`` is ``(dx, dweight, dbias)``: which gradients the call wants (a phase keeps and
    moves only what they need); ``biases`` holds None for a rank without one; ``extras``
    are the new tensors the forward keeps for the backward (the gathered input).
    :func:`run_phases` makes them one eager autograd call, :mod:`distfuse.ops.fused_linear`
    a custom op pair, so eager and compiled calls launch the same kernels.
    """

    forward: Callable
    backward: Callable


class _PhasesFunction(torch.autograd.Function):
    """``apply(phases, plan, k, bias_at, *xs, *weights, *biases at bias_at)``; first-order (the phases' backward
    has no gradient of its own)."""

    @staticmethod
    def forward(ctx, phases: Phases, plan, k: int, bias_at: tuple, *tensors):
        xs, weights, biases = _split(tensors, k, bias_at)
        needs = ctx.needs_input_grad[4:]
        ctx.needs = (any(needs[:k]), any(needs[k:2 * k]), any(needs[2 * k:]))
        ys, extras = phases.forward(plan, ctx.needs, xs, weights, biases)
        ctx.phases, ctx.plan, ctx.k, ctx.bias_at = phases, plan, k, bias_at
        ctx.save_for_backward(*tensors, *extras)
        return ys[0] if k == 1 else tuple(ys)

    @staticmethod
    @once_differentiable
    def backward(ctx, *dys):
        k, bias_at = ctx.k, ctx.bias_at
        saved = ctx.saved_tensors
        n = 2 * k + len(bias_at)
        xs, weights, biases = _split(saved[:n], k, bias_at)
        dxs, dws, dbs = ctx.phases.backward(ctx.plan, ctx.needs, xs, weights, biases, list(saved[n:]),
                                            [dy.contiguous() for dy in dys])
        return (None, None, None, None, *dxs, *dws, *(dbs[i] for i in bias_at))


def _split(tensors, k: int, bias_at: tuple) -> tuple[list, list, list]:
    given = dict(zip(bias_at, tensors[2 * k:], strict=True))
    return list(tensors[:k]), list(tensors[k:2 * k]), [given.get(i) for i in range(k)]


def run_phases(phases: Phases, plan, xs, weights, biases) -> list[torch.Tensor]:
    """The fused op's outputs, one per rank launched, autograd-aware (``biases``: None or a bias per rank, None
    where a rank has none)."""
    k = len(xs)
    biases = list(biases) if biases is not None else [None] * k
    bias_at = tuple(i for i, b in enumerate(biases) if b is not None)
    out = _PhasesFunction.apply(phases, plan, k, bias_at, *xs, *weights, *(biases[i] for i in bias_at))
    return [out] if k == 1 else list(out)


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[*, m, F] -> [prod(*) * m, F]``: the operand layout of the weight-gradient GEMMs."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: ambiguous when F is 0
