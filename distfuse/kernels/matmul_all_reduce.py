"""matmul_all_reduce, kernel floor: every rank's GEMM partial summed into a replicated output over symmetric buffers.

The general linear (broadcast, GEMM, sum-reduce over a row of the weight grid) and the
row-parallel linear with a replicated output::

    a       [M, K_r]     this rank's input (its block of the input features)
    weight  [N, K_r]     nn.Linear layout, any strides
    bias    [N] or None  added to this rank's partial (one rank of the group passes it)
    forward y = sum_r (a_r @ weight_r.T + bias_r)                  -> [M, N] on every rank
    adjoint da_r = all_reduce(dy) @ weight_r: a reduce-scatter of dy (no GEMM to fuse it into), then
            :func:`~distfuse.kernels.all_gather_features_matmul.ag_push_columns` + ``gathered_k_matmul``
            with ``weight_r.t()`` (see :mod:`distfuse.fused.matmul_all_reduce`); no kernel of its own

Two algorithms, chosen per call by output size (see
:func:`distfuse.fused.matmul_all_reduce.pick_algorithm`):

* **one-shot** (small outputs: latency-bound): :func:`matmul_push` computes each tile once
  and stores it into slot ``rank`` of every rank's buffer (``[M, pad16(N)]`` slots, 16-byte
  stores), then raises ``flags[q, rank]`` on every rank ``q``; :func:`all_reduce_slots`
  waits for the W flags and sums the W slots in source order in fp32
  (:mod:`distfuse.kernels.chunk_reduce`).  Every rank adds the same
  values in the same order, so the replicas are bit-identical.  Traffic: the whole
  partial to every peer (W - 1 times the output per rank).
* **two-shot** (large outputs: bandwidth-bound): reduce-scatter then all-gather, each in
  one claim of the workspace.  Claim 1 is the GEMM + reduce-scatter along the features of
  :mod:`distfuse.kernels.matmul_reduce_scatter_features` (``matmul_scatter_columns`` with
  the producer-side bias, ``column_reduce``): rank ``r`` holds the reduced columns ``r``.
  Claim 2 pushes them into every peer (``ag_push_columns``) and :func:`gather_columns`
  copies the gathered ``[M, N]`` out, waiting for each chunk's flag.  Traffic: about
  2 (W - 1) / W of the output per rank.  The two claims' entry barrier keeps the pushes
  of claim 2 off slots a slow peer is still reducing.

Precision: each partial is rounded once to ``partial_dtype``; the sum is in fp32 and
rounded once (two-shot: the gathered chunks are copied bit for bit).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import (
    FLOAT_DTYPES,
    INTERPRET,
    TIMED_WAITS,
    claimed_rank_view,
    flatten_rows,
    gemm_autotuners,
    output_buffer,
    summed_partials,
    tile_grid,
    timeout_arg,
)
from distfuse.kernels.chunk_reduce import reduce_slots, slot_row_stride
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.jit_helpers import (
    arrive,
    balanced_chunk,
    cast_out,
    matmul_tile,
    raise_flag,
    tile_offsets,
    wait_flag,
)

__all__ = ["matmul_push", "all_reduce_slots", "gather_columns", "one_shot_workspace_bytes", "two_shot_workspace_bytes",
           "matmul_all_reduce_loopback", "matmul_all_reduce_reference"]


@triton.jit(do_not_specialize=["rank", "src_offset"])
def _matmul_push_kernel(
    a_ptr, b_ptr, bias_ptr, slots_ptr, data_ptrs, flag_ptrs, counter_ptr,
    M, N, ld, K, rank, W, epoch_ptr, src_offset,
    stride_am, stride_bn, stride_bk, stride_bias,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One output tile, computed once and stored into slot ``rank`` of every rank (peers first, own last)."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    offs_m, offs_n, mask_m, mask_n = tile_offsets(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), M, N, GROUP_M, BLOCK_M,
                                                  BLOCK_N)
    acc = matmul_tile(a_ptr + offs_m.to(tl.int64) * stride_am, mask_m, b_ptr, offs_n, mask_n, K, stride_bk, stride_bn,
                      UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = cast_out(acc, slots_ptr.dtype.element_ty, ROUND_BF16)
    esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
    offs = offs_m.to(tl.int64)[:, None] * tl.multiple_of(ld, 16) + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    for j in range(0, W):
        q = (rank + 1 + j) % W
        # Addressed from this rank's aligned slots_ptr plus a distance that is a multiple of 16 elements (see
        # matmul_reduce_scatter.py), so the stores into peers are 16 bytes wide.
        delta = (tl.load(data_ptrs + q) - tl.load(data_ptrs + rank)) // esize
        tl.store(slots_ptr + tl.multiple_of(delta + src_offset, 16) + offs, out, mask=mask)
    if arrive(counter_ptr + rank):
        for j in range(0, W):
            q = (rank + 1 + j) % W
            raise_flag(tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32)) + q * W + rank, epoch)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _gather_columns_kernel(
    own_ptr, gathered_ptr, out_ptr, flags_ptr, status_ptr,
    M, N, rank, W, epoch_ptr, timeout, stride_own,
    TIMED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (tiles of the widest column chunk, W): chunk = (rank - step) % W, own first; copy it into ``out``.

    The own chunk comes from the reduced block itself, the others from the gathered buffer
    after their flag; a chunk whose flag never came is stored as NaN (the launcher raises).
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    step = tl.program_id(1)
    chunk = (rank - step + W) % W
    start_c, len_c = balanced_chunk(chunk, N, W)
    num_pid_n = tl.cdiv(len_c, BLOCK_N)
    if pid < tl.cdiv(M, BLOCK_M) * num_pid_n:
        ok = True
        if chunk != rank:
            ok = wait_flag(flags_ptr + chunk * W + chunk, epoch, status_ptr + chunk, timeout, TIMED)
        offs_m = (pid // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_m.to(tl.int64)[:, None]
        mask = (offs_m < M)[:, None] & (offs_n < len_c)[None, :]
        src = tl.where(chunk == rank, own_ptr + rows * stride_own + offs_n[None, :],
                       gathered_ptr + rows * N + start_c + offs_n[None, :])
        tile = tl.load(src, mask=mask)
        tile = tl.where(ok, tile, float("nan"))
        tl.store(out_ptr + rows * N + start_c + offs_n[None, :], tile.to(out_ptr.dtype.element_ty), mask=mask)


_matmul_push_tuned = gemm_autotuners(_matmul_push_kernel, ["M", "N", "K"])

# One copy config: the copy is memory-bound, 2-4k elements per program saturate HBM.
_GATHER_CONFIG = dict(BLOCK_M=32, BLOCK_N=64)
_CPU_GATHER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32)


def one_shot_workspace_bytes(rows: int, N: int, world_size: int, partial_dtype: torch.dtype) -> int:
    """Data bytes of the one-shot algorithm on every rank: W slots ``[rows, pad16(N)]``."""
    return world_size * rows * slot_row_stride(N) * partial_dtype.itemsize


def two_shot_workspace_bytes(rows: int, N: int, world_size: int, dtype: torch.dtype,
                             partial_dtype: torch.dtype) -> int:
    """Data bytes of the two-shot algorithm: the column slots of claim 1 or the gathered ``[rows, N]`` of claim 2."""
    return max(rs_features_kernels.matmul_scatter_columns_workspace_bytes(rows, N, world_size, partial_dtype),
               ag_features_kernels.gathered_k_workspace_bytes(rows, N, dtype))


def _rows2(op: str, a: torch.Tensor) -> torch.Tensor:
    if a.dim() < 1 or a.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"{where(op)}: expected a float tensor [..., K] of {FLOAT_DTYPES}, got "
                               f"{a.dtype} {tuple(a.shape)}")
    return flatten_rows(a)


def matmul_push(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                partial_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
                config: dict | None = None) -> None:
    """One-shot producer: ``a @ weight.T (+ bias)`` stored into slot ``rank`` of every rank, then their flags raised.

    ``a [..., K]``, ``weight [N, K]`` (any strides), ``bias [N]`` or None.  Call inside
    ``ws.in_flight`` (data region: :func:`one_shot_workspace_bytes`), then
    :func:`all_reduce_slots` on every rank.
    """
    op = "matmul_push"
    a2 = _rows2(op, a)
    if weight.dim() != 2 or weight.shape[1] != a2.shape[1] or weight.dtype != a.dtype:
        raise ShapeError(f"{where(op)}: expected weight [N, K={a2.shape[1]}] of {a.dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    N = weight.shape[0]
    rs_features_kernels.launch_slot_producer(op, (_matmul_push_tuned, _matmul_push_kernel), a, weight, ws, rank,
                                             world_size, partial_dtype=partial_dtype or a.dtype, bias=bias,
                                             ld=slot_row_stride(N), cols=N, steps=None, config=config)


def all_reduce_slots(ws, rank: int, world_size: int, rows: int, N: int, *, partial_dtype: torch.dtype,
                     out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                     config: dict | None = None, agreement: tuple[int, str] | None = None) -> torch.Tensor:
    """One-shot consumer: the W slots ``[rows, N]`` summed in source order (fp32), rounded once; ``[rows, N]``.

    ``agreement``: ``(sig, what)``, checked in the same kernel (:func:`~distfuse.kernels.chunk_reduce.reduce_slots`).
    """
    return reduce_slots("all_reduce_slots", ws, rank, world_size, (rows, N), slot_row_stride(N),
                        partial_dtype=partial_dtype, bias=None, out_dtype=out_dtype or partial_dtype, out=out,
                        config=config, what="the peers' partial products", shape_name="[..., cols]",
                        agreement=agreement)


def gather_columns(own: torch.Tensor, ws, rank: int, world_size: int, N: int, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Two-shot consumer of claim 2: ``[rows, N]`` from the own reduced columns ``own [rows, N_rank]`` and the
    peers' columns pushed by ``ag_push_columns`` (each after its flag).  Call after ``ag_push_columns`` on
    every rank, inside the same claim."""
    op = "gather_columns"
    st = claimed_rank_view(op, ws, rank, world_size, own.device)
    W = world_size
    own2 = _rows2(op, own)
    rows = own2.shape[0]
    if own2.shape[1] != block_extent(N, W, rank):
        raise ShapeError(f"{where(op)}: own columns: expected block {rank} of N={N} over {W} "
                         f"({block_extent(N, W, rank)}), got {own2.shape[1]}")
    out = output_buffer(op, out, (rows, N), own.dtype, own.device, "[..., N]")
    gathered = st.data(own.dtype, rows * N, op=op)
    st.wait_producers()  # collective on CPU
    if rows > 0 and N > 0:
        meta = dict(_CPU_GATHER_CONFIG if INTERPRET else _GATHER_CONFIG)
        _gather_columns_kernel[tile_grid(rows, cdiv(N, W), W)](own2, gathered, out, st.flags, st.status, rows, N,
                                                               rank, W, st.epoch_dev, timeout_arg(st), own2.stride(0),
                                                               TIMED=TIMED_WAITS, **meta)
        st.check_status(op, "the peers' reduced columns")
    return out


def matmul_all_reduce_loopback(a_list, weight_list, ws, *, bias: torch.Tensor | None = None,
                               algorithm: str = "one_shot", partial_dtype: torch.dtype | None = None):
    """Every virtual rank of a loopback workspace (no autograd); virtual rank 0 adds ``bias``.  Returns W outputs."""
    W = ws.world_size
    a0 = a_list[0]
    rows, N = math.prod(a0.shape[:-1]), weight_list[0].shape[0]
    pd = partial_dtype or a0.dtype
    biases = [bias] + [None] * (W - 1)
    if algorithm == "one_shot":
        with ws.in_flight("matmul_all_reduce_loopback"):
            for r in range(W):
                matmul_push(a_list[r], weight_list[r], ws, r, W, partial_dtype=pd, bias=biases[r])
            return [all_reduce_slots(ws, r, W, rows, N, partial_dtype=pd, out_dtype=a0.dtype) for r in range(W)]
    with ws.in_flight("matmul_all_reduce_loopback.reduce_scatter"):
        for r in range(W):
            rs_features_kernels.matmul_scatter_columns(a_list[r], weight_list[r], ws, r, W, partial_dtype=pd,
                                                       bias=biases[r])
        owns = [rs_features_kernels.column_reduce(ws, r, W, rows, N, partial_dtype=pd, out_dtype=a0.dtype)
                for r in range(W)]
    with ws.in_flight("matmul_all_reduce_loopback.all_gather"):
        for r in range(W):
            ag_features_kernels.ag_push_columns(owns[r], ws, r, W, N)
        return [gather_columns(owns[r], ws, r, W, N) for r in range(W)]


def matmul_all_reduce_reference(a_list, weight_list, *, bias: torch.Tensor | None = None,
                                partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference ``[M, N]`` with the kernels' roundings: each partial (rank 0's with the bias) in fp32,
    rounded to ``partial_dtype``; summed in fp32 in rank order; rounded once."""
    a0 = a_list[0]
    parts = [flatten_rows(a).float() @ w.float().t() for a, w in zip(a_list, weight_list, strict=True)]
    if bias is not None:
        parts[0] = parts[0] + bias.float()
    return summed_partials(parts, partial_dtype or a0.dtype, None, a0.dtype)

