"""matmul_reduce_scatter, kernel floor: each GEMM output tile is stored straight into its owner's symmetric buffer.

Row-parallel linear forward, and the column-parallel linear's input gradient::

    a       [B_, n, K]   this rank's input (leading dims flattened to B_; K is its shard)
    weight  [N, K]       nn.Linear layout; any strides (pass ``w.t()`` for a [K, N] operand)
    forward out_r = sum_p (a_p @ weight_p.T)[:, start_r:stop_r] + bias     -> [B_, len_r, N]
    adjoint da_p  = all_gather(d out) @ weight_p
                    (:func:`distfuse.kernels.all_gather_matmul.gathered_matmul` with ``weight_p.t()``)

Two launches per rank, inside one claim of the workspace: :func:`matmul_scatter` (the
producer: GEMM whose epilogue scatters each tile to the rank that owns its rows) and
:func:`chunk_reduce` (the consumer, :mod:`distfuse.kernels.chunk_reduce`, shared by every
producer of these slots; it and :func:`slot_row_stride` are re-exported here).
:func:`matmul_reduce_scatter` is both, as one op on a real group; the autograd op of the
same name (:mod:`distfuse.fused.matmul_reduce_scatter`) builds on the two launches.

Chunk r is the rows ``[start_r, stop_r)`` of the sequence dim n (balanced decomposition of
n over W), for every batch index: the GEMM remaps tile row m of the chunk to
``a[m // len_r, start_r + m % len_r]``.  Owner r's data region holds W slots, one per
source, each ``[B_, len_r, N]`` in ``partial_dtype`` with rows ``ld`` apart (N padded to 16
elements, so remote stores are 16 bytes wide; slot stride ``B_ * ceil(n / W) * ld``
elements, the same on every owner).

Schedule (W = 4, rank 1).  Each rank writes its chunks in rank-rotated order, so at any
moment the W ranks write into W different owners, and its own chunk (no link traffic)
comes last::

    rank 1  matmul_scatter | chunk 2 -> rank 2 | chunk 3 -> rank 3 | chunk 0 -> rank 0 | chunk 1 (own) |
                           each chunk's last tile raises flags[chunk, 1] on the owner
    rank 1  chunk_reduce   | poll flags[1, 0:4] together, one barrier; per block 4 independent loads,
                           | fp32 sum in source order 0, 1, 2, 3; + bias; one rounding (persistent grid)

Synchronisation: on CUDA the consumer spins on the flags (bounded by the workspace
timeout); on CPU (``/dev/shm`` + interpreter) a host barrier orders producers before the
consumer and the consumer checks each flag once.  Producers never wait, so the protocol
cannot deadlock.

Precision: tiles accumulate in fp32 and are rounded once to ``partial_dtype`` (the output
dtype by default: the bytes on the wire of NCCL's reduce-scatter); the reduction sums the
W partials in fp32 and rounds once.  ``partial_dtype=torch.float32`` leaves a single
rounding overall at twice the traffic for 16-bit outputs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, expect
from distfuse.geometry.decomposition import block_range
from distfuse.kernels._utils import (
    INTERPRET,
    check_producer_args,
    claimed_rank_view,
    flatten_rows,
    gemm_autotuners,
    input_precision,
    pick_gemm_launch,
    round_bf16,
    summed_partials,
    tile_grid,
)
from distfuse.kernels.chunk_reduce import chunk_reduce, slot_row_stride  # re-exported: the op's public API
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.jit_helpers import (
    arrive,
    balanced_chunk,
    cast_out,
    chunk_rows,
    matmul_tile,
    raise_flag,
    tile_offsets,
)
from distfuse.kernels.launch_cache import cached_launch

__all__ = ["matmul_scatter", "chunk_reduce", "matmul_reduce_scatter", "matmul_reduce_scatter_loopback",
           "matmul_reduce_scatter_reference", "matmul_scatter_workspace_bytes", "slot_row_stride"]


# Per-call integers (rank, offsets, timeouts) must not be specialised: Triton specialises
# integer arguments equal to 1 or divisible by 16, so rank 1 or offset 16 would each compile
# a new kernel on one rank while its peers spin.  The epoch is no argument: every kernel
# loads it from the workspace's device word (``epoch_ptr``), which claims advance in stream
# order, so a captured CUDA graph raises and expects a new epoch at every replay.
@triton.jit(do_not_specialize=["rank", "src_offset", "slot_elems"])
def _matmul_scatter_kernel(
    a_ptr, b_ptr, slots_ptr, data_ptrs, flag_ptrs, counter_ptr,
    n_batch, n, N, ld, K, rank, W, epoch_ptr, src_offset, slot_elems,
    stride_ab, stride_an, stride_bn, stride_bk,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grid (tiles of the largest chunk, W): axis 1 is the step of the rotation, chunk = (rank + 1 + step) % W."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    step = tl.program_id(1)
    chunk = (rank + 1 + step) % W
    start_c, len_c = balanced_chunk(chunk, n, W)
    M_c = n_batch * len_c
    num_pid_m = tl.cdiv(M_c, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if pid < num_pid_m * num_pid_n:
        offs_m, offs_n, mask_m, mask_n = tile_offsets(pid, num_pid_m, num_pid_n, M_c, N, GROUP_M, BLOCK_M, BLOCK_N)
        # Row remap: chunk row m is (batch m // len_c, sequence row start_c + m % len_c).
        b_idx, i_idx = chunk_rows(offs_m, len_c, start_c)
        a_rows = a_ptr + b_idx * stride_ab + i_idx * stride_an
        acc = matmul_tile(a_rows, mask_m, b_ptr, offs_n, mask_n, K, stride_bk, stride_bn,
                          UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        # Epilogue: store into owner `chunk`'s slot for source `rank`, laid out [B_, len_c, N].
        # Vectorised remote stores: Triton cannot see the alignment of a pointer made from an
        # int64 table entry, so the peer's region is addressed from this rank's own ``slots_ptr``
        # (an aligned pointer argument) plus the distance between the two regions in elements.
        # That distance, the slot offset and the padded row stride ``ld`` are multiples of 16
        # elements (regions start 16-byte aligned; the host pads ld and the slots), which
        # multiple_of states, so each thread stores 16 bytes at a time.
        esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
        delta = (tl.load(data_ptrs + chunk) - tl.load(data_ptrs + rank)) // esize
        dst = slots_ptr + tl.multiple_of(delta + src_offset, 16)
        out = cast_out(acc, slots_ptr.dtype.element_ty, ROUND_BF16)
        tl.store(dst + offs_m.to(tl.int64)[:, None] * tl.multiple_of(ld, 16) + offs_n[None, :], out,
                 mask=mask_m[:, None] & mask_n[None, :])
    if arrive(counter_ptr + chunk):
        flag = tl.load(flag_ptrs + chunk).to(tl.pointer_type(tl.int32)) + chunk * W + rank
        raise_flag(flag, epoch)


_matmul_scatter_tuned = gemm_autotuners(_matmul_scatter_kernel, ["n_batch", "n", "N", "K"])


def matmul_scatter_workspace_bytes(batch: int, n: int, N: int, world_size: int,
                                   partial_dtype: torch.dtype = torch.bfloat16) -> int:
    """Data bytes one :func:`matmul_scatter` needs in every rank's workspace: W slots of ``[B_, ceil(n / W), ld]``.

    ``ld`` is :func:`slot_row_stride` (N padded to 16 elements).
    """
    return world_size * batch * cdiv(n, world_size) * slot_row_stride(N) * partial_dtype.itemsize


def matmul_scatter(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                   partial_dtype: torch.dtype | None = None, config: dict | None = None) -> None:
    """Produce: compute ``a @ weight.T`` chunk by chunk and store chunk r into rank r's slot for this rank.

    Args:
        a: ``[..., n, K]`` (leading dims are the batch B_), bf16, fp16 or fp32.
        weight: ``[N, K]``, same dtype as ``a``, any strides.
        ws: a :class:`~distfuse.fused.symmetric.SymmetricWorkspace` (or loopback) claimed
            with ``ws.in_flight``; its data region needs :func:`matmul_scatter_workspace_bytes`.
        rank, world_size: this rank and the group size (virtual rank in loopback).
        partial_dtype: dtype of the partials in the slots (default ``a.dtype``).
        config: explicit block sizes (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``;
            optional ``num_warps``/``num_stages``) instead of autotuning / the CPU config.

    This is the pointer kernel only; the persistent tensor-descriptor form is
    :mod:`distfuse.kernels.matmul_scatter_persistent`, and the one place that chooses
    between them (and names the kernel that ran) is
    :func:`distfuse.kernels.matmul_scatter_select.select_scatter_kernel`.  Finish with
    :func:`chunk_reduce` on every rank, inside the same claim.
    """
    if config is not None and config.get("kernel", "pointer") != "pointer":
        raise expect("matmul_scatter", "config['kernel']", "'pointer' (choose other kernels with "
                     "distfuse.kernels.matmul_scatter_select)", repr(config["kernel"]), cls=UnsupportedError)
    config = None if config is None else {k: v for k, v in config.items() if k != "kernel"}
    op = "matmul_scatter"
    partial_dtype = check_producer_args(op, a, weight, partial_dtype)
    st = claimed_rank_view(op, ws, rank, world_size, a.device)
    W = world_size
    a3 = flatten_rows(a, 2)
    n_batch, n, K = a3.shape
    N = weight.shape[0]
    ld = slot_row_stride(N)
    m_max = n_batch * cdiv(n, W)  # rows of the largest chunk
    slot_elems = m_max * ld
    slots = st.data(partial_dtype, W * slot_elems, op=op, cached=True)
    kernel, meta = pick_gemm_launch(_matmul_scatter_tuned, _matmul_scatter_kernel, a.dtype, m_max, N, config, ws)
    cached_launch(kernel)[tile_grid(m_max, N, W, at_least=1)](
        a3, weight, slots, st.data_ptrs, st.flag_ptrs, st.counters,
        n_batch, n, N, ld, K, rank, W, st.epoch_dev, rank * slot_elems, slot_elems,
        a3.stride(0), a3.stride(1), weight.stride(0), weight.stride(1),
        UPCAST=INTERPRET, INPUT_PRECISION=input_precision(a.dtype), ROUND_BF16=round_bf16(partial_dtype),
        **meta,
    )


def matmul_reduce_scatter(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                          partial_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One fused op on a real group: claim ``ws``, :func:`matmul_scatter`, :func:`chunk_reduce`.

    ``a [..., n, K] -> [..., len_rank, N]`` (the leading dims of ``a``); no autograd (see
    :func:`distfuse.fused.matmul_reduce_scatter.matmul_reduce_scatter` for the trainable op).
    """
    n, N = a.shape[-2], weight.shape[0]
    batch = math.prod(a.shape[:-2])
    partial_dtype = partial_dtype or a.dtype
    with ws.in_flight("matmul_reduce_scatter"):
        matmul_scatter(a, weight, ws, rank, world_size, partial_dtype=partial_dtype)
        y = chunk_reduce(ws, rank, world_size, batch, n, N, partial_dtype=partial_dtype, bias=bias,
                         out_dtype=out_dtype or a.dtype, out=out)
    return y.view(*a.shape[:-2], y.shape[1], N)


def matmul_reduce_scatter_loopback(a_list, weight_list, ws, *, bias: torch.Tensor | None = None,
                                   out_dtype: torch.dtype | None = None, partial_dtype: torch.dtype | None = None,
                                   outs=None, config: dict | None = None) -> list[torch.Tensor]:
    """Every virtual rank of a :class:`~distfuse.fused.workspace.LoopbackWorkspace`: all producers, then all reducers.

    Returns the W outputs ``[B_, len_r, N]`` in rank order.
    """
    W = ws.world_size
    a0 = a_list[0]
    n, N = a0.shape[-2], weight_list[0].shape[0]
    batch = math.prod(a0.shape[:-2])
    partial_dtype = partial_dtype or a0.dtype
    with ws.in_flight("matmul_reduce_scatter_loopback"):
        for r in range(W):
            matmul_scatter(a_list[r], weight_list[r], ws, r, W, partial_dtype=partial_dtype, config=config)
        return [chunk_reduce(ws, r, W, batch, n, N, partial_dtype=partial_dtype, bias=bias,
                             out_dtype=out_dtype or a0.dtype, out=None if outs is None else outs[r])
                for r in range(W)]


def matmul_reduce_scatter_reference(a_list, weight_list, rank: int, *, bias: torch.Tensor | None = None,
                                    out_dtype: torch.dtype | None = None,
                                    partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference of rank ``rank``'s output, with the kernels' roundings.

    Each partial ``a_p @ weight_p.T`` is computed in fp32 and rounded to ``partial_dtype``;
    the W partials of the chunk and the bias are summed in fp32 and rounded once to
    ``out_dtype``.  Returns ``[B_, len_rank, N]``.
    """
    a0 = a_list[0]
    start, stop = block_range(a0.shape[-2], len(a_list), rank)
    parts = (flatten_rows(a, 2)[:, start:stop].float() @ w.float().t()
             for a, w in zip(a_list, weight_list, strict=True))
    return summed_partials(parts, partial_dtype or a0.dtype, bias, out_dtype or a0.dtype)
