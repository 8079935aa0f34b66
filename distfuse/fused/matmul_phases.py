"""What the two GEMM fusions share: availability, argument checks, where an op runs, and their two fused phases.

The ops themselves live one per module: :mod:`distfuse.fused.matmul_reduce_scatter`
(GEMM + reduce-scatter forward, all-gather + GEMM backward) and
:mod:`distfuse.fused.all_gather_matmul` (the mirror image).  Each op's backward is the
other op's forward phase, so both directions of both ops are the two functions here:

====================================  ==========================================================================
:func:`run_matmul_reduce_scatter`     ``x [*, n, K] -> reduce_scatter_n(x @ weight.T) + bias``  ``[*, n_r, N]``
                                      (``matmul_scatter`` stores each tile in its owner's slot; ``chunk_reduce``
                                      sums the W partials in fp32 and adds the bias once)
:func:`run_all_gather_matmul`         ``x [*, n_r, K] -> all_gather_n(x) @ weight.T + bias``    ``[*, n, N]``
                                      (``ag_push`` copies the block into every peer; ``gathered_matmul``
                                      multiplies the chunks as they land; optionally returns the gathered input)
====================================  ==========================================================================

Every kernel launch of both ops happens in these two functions, each inside one claim
of the workspace (``ws.in_flight``: one fused op in flight per workspace).  They loop over
the ranks of a :class:`Comm`: this rank on a real group, or every virtual rank of a
loopback workspace, so one code path serves training and single-process testing.  The
kernel modules are imported qualified (``reduce_scatter_kernels.matmul_scatter``): their
one-shot ops share the names of the autograd ops here, one floor down.

World size 1: both phases are a plain ``F.linear`` (no workspace, no communication).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distfuse.kernels.all_gather_matmul as all_gather_kernels
import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.fused.symmetric import get_workspace, symmetric_memory_available
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import FLOAT_DTYPES
from distfuse.partition import Partition

__all__ = [
    "fused_linear_available",
    "require_available",
    "check_linear_args",
    "workspace_bytes",
    "Comm",
    "Done",
    "RowGather",
    "alloc_output",
    "run_matmul_reduce_scatter",
    "run_all_gather_matmul",
    "split_inputs",
    "grads_needed",
    "flat_rows",
]


# ---------------------------------------------------------------- availability, arguments and sizes


def fused_linear_available(P_sub: Partition, device=None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Whether the fused GEMM ops can run on ``P_sub`` (and ``dtype``), and why not.

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


def require_available(op: str, P_sub: Partition, device) -> None:
    """Raise on every rank (the verdict is collective, hence the same everywhere) where the fused path cannot run."""
    if P_sub.size > 1:
        ok, why = symmetric_memory_available(P_sub, device)
        if not ok:
            raise UnsupportedError(f"{where(op)}: the fused path cannot run here ({why}); check "
                                   "fused_linear_available first and use the unfused composition")


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

    A GEMM fusion and its backward move the same tensor shape in opposite directions: the
    reduce-scatter phase's W partial slots
    (:func:`~distfuse.kernels.matmul_reduce_scatter.matmul_scatter_workspace_bytes`, in
    ``partial_dtype``) or the all-gather phase's gathered copy
    (:func:`~distfuse.kernels.all_gather_matmul.gathered_matmul_workspace_bytes`, in
    ``dtype``).  0 at world size 1.  ``batch`` is the product of the leading dims.
    """
    if world_size == 1:
        return 0
    return max(reduce_scatter_kernels.matmul_scatter_workspace_bytes(batch, n, features, world_size,
                                                                     partial_dtype or dtype),
               all_gather_kernels.gathered_matmul_workspace_bytes(batch, n, features, dtype))


# ---------------------------------------------------------------- where an op runs


class Comm:
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
            return Done([full] * len(xs))
        return RowGather(self.P, xs[0], n)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and not self.is_loopback:
            dist.all_reduce(t, group=self.P.group)
        return t


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


def alloc_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer for a kernel; NaN-filled in debug mode so that an element no kernel wrote shows up."""
    if debug.enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------- the two fused phases


def run_matmul_reduce_scatter(comm: Comm, op: str, xs, weights, biases, n: int, partial_dtype,
                              nbytes: int) -> list[torch.Tensor]:
    """GEMM + reduce-scatter for every rank of ``comm``, in one claim: ``x [*, n, K] -> [*, n_r, N_out]``.

    ``weights[i]`` is ``[N_out, K]`` (any strides); ``biases[i]`` ``[N_out]`` or None.
    Every producer runs before any reducer: in loopback the reducers read every virtual
    rank's partials.
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
            reduce_scatter_kernels.matmul_scatter(x, w, ws, r, W, partial_dtype=partial_dtype or x.dtype)
        for r, x, b in zip(comm.ranks, xs, biases, strict=True):
            len_r = block_extent(n, W, r)
            out = alloc_output((B, len_r, N_out), x.dtype, x.device)
            reduce_scatter_kernels.chunk_reduce(ws, r, W, B, n, N_out, partial_dtype=partial_dtype or x.dtype, bias=b,
                                                out_dtype=x.dtype, out=out)
            outs.append(out.view(*lead, len_r, N_out))
    return outs


def run_all_gather_matmul(comm: Comm, op: str, shards, weights, biases, n: int, return_gathered: bool, nbytes: int):
    """All-gather + GEMM for every rank of ``comm``, in one claim: ``shard [*, n_r, K] -> [*, n, N_out]``.

    Returns ``(ys, gathered)``; ``gathered[i]`` is the gathered ``[*, n, K]`` when
    ``return_gathered`` (else None).  Every push runs before any GEMM (see the kernels'
    module doc: a grid of spinning GEMM programs must never keep a push from running).
    """
    W = comm.world_size
    if W == 1:
        ys = [F.linear(x, w, b) for x, w, b in zip(shards, weights, biases, strict=True)]
        return ys, [x if return_gathered else None for x in shards]
    ws = comm.workspace(op, nbytes)
    ys, gathered = [], []
    with ws.in_flight(op):
        for r, x in zip(comm.ranks, shards, strict=True):
            all_gather_kernels.ag_push(x, ws, r, W, n)
        for r, x, w, b in zip(comm.ranks, shards, weights, biases, strict=True):
            lead = x.shape[:-2]
            out = alloc_output((*lead, n, w.shape[0]), x.dtype, x.device)
            # A zero-width weight launches no GEMM (hence no flag wait): its gathered copy would race, and
            # the caller's product with it is empty anyway.
            want = return_gathered and w.shape[0] > 0
            res = all_gather_kernels.gathered_matmul(x, w, ws, r, W, n, bias=b, out=out, return_gathered=want)
            if want:
                ys.append(res[0])
                gathered.append(res[1])
            else:
                ys.append(res)
                gathered.append(x.new_zeros(*lead, n, x.shape[-1]) if return_gathered else None)
    return ys, gathered


# ---------------------------------------------------------------- the autograd Functions' plumbing
# Both ops' Functions take ``apply(plan, *xs, *weights, *biases)``: k tensors of each kind, one per rank this
# process launches (k = 1 on a real group, W in loopback), biases only when the op has them.


def split_inputs(tensors, k: int, has_bias: bool):
    """``(xs, weights, biases)`` of a Function's flat inputs; ``biases`` is k Nones without a bias."""
    return tensors[:k], tensors[k:2 * k], tensors[2 * k:3 * k] if has_bias else (None,) * k


def grads_needed(needs_input_grad, k: int, has_bias: bool) -> tuple[bool, bool, bool]:
    """``(dx, dweight, dbias)`` wanted, from ``ctx.needs_input_grad`` (the plan's entry first)."""
    needs = needs_input_grad[1:]
    return any(needs[:k]), any(needs[k:2 * k]), has_bias and any(needs[2 * k:3 * k])


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[*, m, F] -> [prod(*) * m, F]``: the operand layout of the weight-gradient GEMMs."""
    return t.reshape(-1, t.shape[-1])
