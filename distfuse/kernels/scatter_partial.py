"""scatter_partial: a computed partial product's rows into their owners' slots, one flag per chunk, one launch.

The second half of the cuBLAS provider's whole-GEMM schedule
(:mod:`distfuse.fused.matmul_reduce_scatter_cublas`)::

    partial [B_, n, N]   this rank's a @ weight.T, computed by one library GEMM (contiguous, partial_dtype)
    chunk c  = rows [start_c, start_c + len_c) of every batch entry (balanced decomposition of n over W)
    slot     owner c's slot for this rank: [B_, len_c, N] in partial_dtype, rows ``ld`` apart

Why a schedule of its own: where a chunk is shorter than a library GEMM's row tile (LLaMA-3 at TP 8
and M = 512: 64-row chunks), the one-GEMM-per-chunk schedule runs W tile-quantised GEMMs and W flag
launches (the H200 at ``a6bfa8c``: 69 us graph-timed at 8B against cuBLAS's 15.5 us for the whole
GEMM).  One GEMM of all rows, then this copy (the partial's bytes read once and written once, in
16-byte vectors where ``N`` allows), costs the library GEMM plus a copy of its output.

The rows are walked in row tiles over each batch entry's ``n`` rows whatever the chunks, with the
persistent producer's ``SPAN`` epilogue (``_store_span_rows`` of
:mod:`~distfuse.kernels.matmul_scatter_persistent`): each row finds its chunk, its owner's slot and
its slot row.  Each program counts its tiles of every chunk and adds them once, after its last tile
(that module's ``_arrive_counts``): the add that completes a chunk's count raises the owner's flag
(release, system scope), and an empty chunk's flag is raised by program 0.  The slots and flags are
those ``chunk_reduce`` reads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from distfuse.errors import ShapeError, where
from distfuse.kernels._utils import HAS_CUDA, INTERPRET, claimed_rank_view
from distfuse.kernels.chunk_flag import raise_every_chunk_flag_kernel
from distfuse.kernels.chunk_reduce import slot_row_stride
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.matmul_scatter_persistent import _arrive_counts, _chunk_of, _store_span_rows
from distfuse.kernels.persistent import persistent_programs

__all__ = ["scatter_partial", "scatter_partial_blocks", "gpu_blocks", "sweep_configs"]

#: Programs per SM at most (a copy wants several resident programs to keep enough bytes in flight).
PROGRAMS_PER_SM = 4


@triton.jit(do_not_specialize=["rank", "src_offset"])
def _scatter_partial_kernel(
    src, slots_ptr, data_ptrs, flag_ptrs, counter_ptr,
    n_batch, n, N, ld, rank, W, epoch_ptr, src_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_BLOCK: tl.constexpr,
):
    """Grid-stride over the ``B_ * ceil(n / BLOCK_M) * ceil(N / BLOCK_N)`` tiles of ``src [B_, n, N]`` (row-major:
    neighbouring programs take neighbouring column tiles of one row tile); see the module doc."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_m = tl.cdiv(n, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total = n_batch * tiles_m * num_pid_n
    esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
    own_base = tl.load(data_ptrs + rank)
    counts = tl.zeros([W_BLOCK], dtype=tl.int32)  # this program's tiles of each chunk
    chunk_ids = tl.arange(0, W_BLOCK)
    for t in tl.range(pid, total, num_progs):
        pid_m = t // num_pid_n
        b_idx = pid_m // tiles_m
        row0 = (pid_m % tiles_m) * BLOCK_M
        offs_n = (t % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        i = row0 + tl.arange(0, BLOCK_M)
        rows = (b_idx * n + i).to(tl.int64) * N
        vals = tl.load(src + rows[:, None] + offs_n[None, :], mask=(i < n)[:, None] & (offs_n < N)[None, :])
        _store_span_rows(vals, slots_ptr, data_ptrs, own_base, esize, src_offset, ld, b_idx, row0, offs_n, n, N, W,
                         BLOCK_M)
        c_lo = _chunk_of(row0, n, W)
        c_hi = _chunk_of(tl.minimum(row0 + BLOCK_M, n) - 1, n, W)
        counts += ((chunk_ids >= c_lo) & (chunk_ids <= c_hi)).to(tl.int32)
    _arrive_counts(counts, chunk_ids, counter_ptr, flag_ptrs, pid, W, rank, epoch, n, n_batch, num_pid_n, 0, True,
                   BLOCK_M)


def gpu_blocks(itemsize: int) -> dict:
    """The GPU launch: 16 KB tiles of 64 rows of 256 bytes, 4 warps (eight 16-byte vectors a thread; the compile
    audit builds it for sm_90)."""
    return dict(BLOCK_M=64, BLOCK_N=256 // itemsize, num_warps=4)


def sweep_configs(itemsize: int) -> list[dict]:
    """The tile configs the GPU sweep times (``scripts/gpu_diagnose.py --sections scatter``; the CUDA tests check
    each first): rows of 256 bytes, 16 to 128 rows a tile, 2 to 8 warps, 2 to 16 programs per SM."""
    return [dict(BLOCK_M=m, BLOCK_N=256 // itemsize, num_warps=w, PER_SM=p)
            for m, w, p in ((16, 2, 8), (32, 4, 8), (32, 2, 16), (64, 4, PROGRAMS_PER_SM), (64, 8, 4), (128, 8, 2))]


def scatter_partial_blocks(itemsize: int, device: torch.device) -> dict:
    """``BLOCK_M``, ``BLOCK_N`` and ``num_warps`` of a launch: :func:`gpu_blocks` on a GPU, small tiles under the
    interpreter (its cost is per element of a tile)."""
    if INTERPRET or not HAS_CUDA or device.type != "cuda":
        return dict(BLOCK_M=8, BLOCK_N=16, num_warps=1)
    return gpu_blocks(itemsize)


def scatter_partial(partial: torch.Tensor, ws, rank: int, world_size: int, *, config: dict | None = None) -> None:
    """Copy ``partial [..., n, N]`` (contiguous, the partials' dtype) into the W owners' slots for ``rank`` and raise
    every owner's flag for it, in one launch: the slots and flags of a GEMM + scatter producer, for ``chunk_reduce``.

    ``ws``: the workspace claimed for the op (:func:`~distfuse.kernels._utils.claimed_rank_view` checks it).  The
    flags rise in stream order after the copies (each program's arrival follows its stores); an empty launch
    (no row or no column) still raises every flag.  ``config`` (tests, the GPU sweep of
    ``scripts/gpu_diagnose.py --sections scatter``): ``BLOCK_M``, ``BLOCK_N``, ``num_warps`` and ``PER_SM``
    (programs per SM at most) in place of :func:`scatter_partial_blocks` and :data:`PROGRAMS_PER_SM`.
    """
    op = "scatter_partial"
    if partial.dim() < 2 or not partial.is_contiguous():
        raise ShapeError(f"{where(op)}: expected a contiguous partial [..., n, N], got shape {tuple(partial.shape)} "
                         f"and strides {partial.stride()}")
    W = world_size
    st = claimed_rank_view(op, ws, rank, W, partial.device)
    n, N = partial.shape[-2], partial.shape[-1]
    n_batch = math.prod(partial.shape[:-2])
    ld = slot_row_stride(N)
    slot_elems = n_batch * cdiv(n, W) * ld
    slots = st.data(partial.dtype, W * slot_elems, op=op, cached=True)
    meta = dict(scatter_partial_blocks(partial.dtype.itemsize, partial.device) if config is None else config)
    per_sm = meta.pop("PER_SM", PROGRAMS_PER_SM)
    tiles = n_batch * cdiv(n, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
    if tiles == 0:  # nothing to copy: the flags alone, in stream order
        cached_launch(raise_every_chunk_flag_kernel)[(1,)](st.flag_ptrs, W, rank, st.epoch_dev)
        return
    programs = min(tiles, persistent_programs(partial.device, per_sm=per_sm))
    cached_launch(_scatter_partial_kernel)[(programs,)](
        partial, slots, st.data_ptrs, st.flag_ptrs, st.counters, n_batch, n, N, ld, rank, W, st.epoch_dev,
        rank * slot_elems, W_BLOCK=next_power_of_2(W), **meta)
