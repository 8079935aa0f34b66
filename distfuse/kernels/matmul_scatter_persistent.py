"""matmul_scatter, persistent form: tensor-descriptor loads, grouped tiles, tile and K loops fused, one flag per chunk.

The same producer as :func:`distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, with
the same outputs (the W slots and flags that :func:`~distfuse.kernels.matmul_reduce_scatter.chunk_reduce`
consumes) and the same precision, built to reach the hardware::

    a       [B_, n, K]   rows flattened to [B_ * n, K] (K contiguous)
    weight  [N, K]       K contiguous, or [K, N] N contiguous (``weight.t()`` of a contiguous [K, N])
    chunk c  = rows [start_c, start_c + len_c) of every batch entry (balanced decomposition of n over W)
    slot     owner c's slot for this rank: [B_, len_c, N] in partial_dtype, rows ``ld`` apart

How it differs from the one-tile-per-program kernel:

* **Persistent grid.**  At most one program per SM; program ``p`` computes tiles
  ``p, p + P, p + 2P, ...`` of the W * T tiles (T tiles per chunk), the chunks in the
  pointer kernel's rank-rotated order and the tiles of a chunk in the grouped order.
* **Host-side tensor descriptors** (:mod:`distfuse.kernels.persistent`: safe from any
  thread).  A row tile never crosses a batch entry (T counts ``ceil(ceil(n / W) / BLOCK_M)``
  row tiles per batch entry), so each A tile is one rectangular box of the ``[B_ * n, K]``
  view; rows past the chunk's end are loaded and masked at the store.
* **The tile loop and the K loop are one loop** (``FLATTEN``, the default: ``tl.range(...,
  flatten=True)``, as in Triton's persistent matmul tutorial).  The compiler's pipeliner then
  runs across tiles: the next tile's first operand loads are in flight while this tile's
  epilogue converts and stores, where a K loop per tile drains its pipeline at every tile
  and refills it after the stores.  At K = 1792 (LLaMA-3 8B at TP 8, 28 K steps of 64) the
  nested form pays that once every 28 steps.  Compiled for sm_90 (Triton 3.6 and 3.9) the
  fused loop keeps three or four stages of TMA buffers and needs fewer registers than the
  nested one (194-198 against 238 at 128x256x64, 8 warps); the compile audit fails any
  persistent config whose loop is not multi-buffered (``pipelined``).
* **One signal per chunk.**  Tiles are counted on a per-chunk counter (acq_rel, GPU scope);
  the arrival that completes the count resets it and raises the owner's flag (release,
  system scope: cumulative, so it publishes every tile's stores that the count observed).
  A CTA barrier orders all threads' stores before a count, and the pipeliner does not take
  a loop that holds a barrier, so the two forms count differently:

  - fused loop: each program counts its tiles of every chunk once, after its last tile
    (:func:`_arrive_program`; one add per chunk it holds).  An owner's flag rises when the
    last program holding one of its tiles ends.  ``chunk_reduce`` runs after the producer
    on the same stream, so only a rank behind its peers would see it later than below;
  - nested loops (``FLATTEN=False``): a tile's arrival is issued after the *next* tile's K
    loop, so its remote stores drain over NVLink while the next tile computes, and no tile
    waits for its own stores to be acknowledged.
* The remote stores are the pointer kernel's 16-byte ones (checked by the compile audit).

Where the descriptors cannot read the operands, :func:`matmul_scatter_persistent` refuses
(:class:`~distfuse.errors.UnsupportedError`, with :func:`persistent_supported`'s reason);
falling back to the pointer kernel is the selector's decision
(:mod:`distfuse.kernels.matmul_scatter_select`), which names the kernel that ran and why.
``bench/bench_gemm_fused.py`` times it where a GPU is present.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, where
from distfuse.kernels._utils import (
    CPU_GEMM_CONFIG,
    HAS_CUDA,
    INTERPRET,
    check_producer_args,
    claimed_rank_view,
    input_precision,
    pinned_gemm_config,
    round_bf16,
)
from distfuse.kernels.chunk_reduce import slot_row_stride
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.jit_helpers import balanced_chunk, cast_out, chunk_tiling, grouped_tile, raise_flag, tma_tile
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.persistent import (
    chunk_tiles,
    descriptor_problem,
    persistent_programs,
    rows_descriptor,
    weight_descriptor,
)

__all__ = ["matmul_scatter_persistent", "persistent_supported", "FLATTEN"]

#: The default of the kernel's ``FLATTEN`` (a config's ``"FLATTEN"`` overrides it): the tile loop and the K loop
#: as one software-pipelined loop, arrivals counted once per program (see :func:`_arrive_program`).
FLATTEN = True


@triton.jit
def _arrive_tile(counter_ptr, chunk, tiles_per_chunk, flag_ptrs, W, rank, epoch):
    """Count one finished tile of ``chunk``; the tile that completes the count raises the owner's flag.

    :func:`~distfuse.kernels.jit_helpers.arrive`'s protocol, per chunk, with the acq_rel count
    at GPU scope (all counting programs run on this GPU) and the flag released at system scope.
    """
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr + chunk, 1, sem="acq_rel", scope="gpu")
    if old == tiles_per_chunk - 1:
        tl.atomic_xchg(counter_ptr + chunk, 0, sem="relaxed", scope="gpu")
        flag = tl.load(flag_ptrs + chunk).to(tl.pointer_type(tl.int32)) + chunk * W + rank
        raise_flag(flag, epoch)


@triton.jit(do_not_specialize=["rank", "src_offset"])
def _matmul_scatter_persistent_kernel(
    a_desc, b_desc, slots_ptr, data_ptrs, flag_ptrs, counter_ptr,
    n_batch, n, N, ld, K, rank, W, epoch_ptr, src_offset,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent grid (at most one program per SM); see the module doc.

    ``a_desc``: host descriptor of the ``[B_ * n, K]`` view of ``a`` (blocks ``[BLOCK_M, BLOCK_K]``);
    ``b_desc``: of the weight, ``[N, K]`` (``B_KMAJOR`` False, blocks ``[BLOCK_N, BLOCK_K]``) or
    ``[K, N]`` (True, blocks ``[BLOCK_K, BLOCK_N]``).  ``FLATTEN``: the tile loop and the K loop are one
    loop for the compiler's pipeliner (``tl.range(..., flatten=True)``), so the next tile's first loads
    are in flight while this tile's epilogue stores; every tile then runs the whole K loop (an empty
    tile's rows are loaded and masked at the store), and the epilogue recomputes its tile's place
    from its own counter instead of carrying the prologue's values across the loop.
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_m, num_pid_m, num_pid_n, tiles_per_chunk, total = chunk_tiling(n, W, n_batch, N, BLOCK_M, BLOCK_N)
    esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
    own_base = tl.load(data_ptrs + rank)
    pending = tl.full([], -1, tl.int32)  # chunk of the tile whose arrival is deferred (-1: none)
    t_out = pid - num_progs  # FLATTEN: the epilogue's tile, on its own counter
    for t in tl.range(pid, total, num_progs, flatten=FLATTEN):
        chunk, start_c, len_c, b_idx, row0, col0 = _tile_place(t, rank, n, W, tiles_per_chunk, tiles_m, num_pid_m,
                                                               num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        if FLATTEN:  # one uniform K loop per tile: what lets the compiler fuse the two loops
            acc = tma_tile(a_desc, b_idx * n + start_c + row0, b_desc, col0, K, B_KMAJOR, UPCAST, INPUT_PRECISION,
                           BLOCK_M, BLOCK_N, BLOCK_K)
            t_out += num_progs
            chunk, start_c, len_c, b_idx, row0, col0 = _tile_place(t_out, rank, n, W, tiles_per_chunk, tiles_m,
                                                                   num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if row0 < len_c:  # the smaller chunks' last row tiles are empty
                acc = tma_tile(a_desc, b_idx * n + start_c + row0, b_desc, col0, K, B_KMAJOR, UPCAST,
                               INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            # The previous tile's stores have drained while this tile's K loop ran: count it now.
            if pending >= 0:
                _arrive_tile(counter_ptr, pending, tiles_per_chunk, flag_ptrs, W, rank, epoch)
        offs_r = row0 + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        mask = (offs_r < len_c)[:, None] & (offs_n < N)[None, :]
        rows = (b_idx * len_c + offs_r).to(tl.int64)  # slot rows: [B_, len_c] flattened
        delta = (tl.load(data_ptrs + chunk) - own_base) // esize
        dst = slots_ptr + tl.multiple_of(delta + src_offset, 16)
        out = cast_out(acc, slots_ptr.dtype.element_ty, ROUND_BF16)
        tl.store(dst + rows[:, None] * tl.multiple_of(ld, 16) + offs_n[None, :], out, mask=mask)
        pending = chunk
    if FLATTEN:
        _arrive_program(counter_ptr, flag_ptrs, pid, num_progs, tiles_per_chunk, W, rank, epoch)
    elif pending >= 0:
        _arrive_tile(counter_ptr, pending, tiles_per_chunk, flag_ptrs, W, rank, epoch)


@triton.jit
def _arrive_program(counter_ptr, flag_ptrs, pid, num_progs, tiles_per_chunk, W, rank, epoch):
    """After the program's last tile (FLATTEN): count its tiles of every chunk at once, one acq_rel add per chunk
    it touched; the arrival that completes a chunk's count raises the owner's flag, as :func:`_arrive_tile` does.

    Why not per tile: the CTA barrier that orders every thread's stores before the count is a barrier inside
    the tile loop, and the compiler does not software-pipeline a loop that holds one (Triton 3.6, sm_90), so
    the flattened loop would lose the very overlap it is for.  The cost: an owner's flag rises when the last
    program that holds one of its tiles ends, not when its last tile ends; ``chunk_reduce`` runs after the
    producer on the same stream, so only a rank running behind its peers would see the difference.
    Program ``pid`` holds tiles ``pid + j * num_progs``; of step ``s`` (tiles ``[s * T, (s + 1) * T)``) it
    holds ``ceil((hi - pid) / P) - ceil((lo - pid) / P)``, each bound clipped at 0.
    """
    tl.debug_barrier()
    s = tl.full([], 0, tl.int32)  # typed: a loop-carried counter keeps one type when compiled
    while s < W:  # a while loop: no runtime range bound (see kernels/halo_programs.py)
        lo = s * tiles_per_chunk
        first = (tl.maximum(lo - pid, 0) + num_progs - 1) // num_progs
        end = (tl.maximum(lo + tiles_per_chunk - pid, 0) + num_progs - 1) // num_progs
        mine = end - first
        if mine > 0:
            chunk = (rank + 1 + s) % W
            old = tl.atomic_add(counter_ptr + chunk, mine, sem="acq_rel", scope="gpu")
            if old + mine == tiles_per_chunk:
                tl.atomic_xchg(counter_ptr + chunk, 0, sem="relaxed", scope="gpu")
                raise_flag(tl.load(flag_ptrs + chunk).to(tl.pointer_type(tl.int32)) + chunk * W + rank, epoch)
        s += 1


@triton.jit
def _tile_place(t, rank, n, W, tiles_per_chunk, tiles_m, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t`` of the persistent grid: ``(chunk, start_c, len_c, b_idx, row0, col0)``, its chunk (in the
    rank-rotated order), the chunk's rows, its batch entry, its first row inside the chunk and its first column."""
    chunk = (rank + 1 + t // tiles_per_chunk) % W
    start_c, len_c = balanced_chunk(chunk, n, W)
    pid_m, pid_n = grouped_tile(t % tiles_per_chunk, num_pid_m, num_pid_n, GROUP_M)
    return chunk, start_c, len_c, pid_m // tiles_m, (pid_m % tiles_m) * BLOCK_M, pid_n * BLOCK_N


def persistent_supported(a3: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether the descriptor kernel can read ``a3 [B_, n, K]`` and ``weight [N, K]``; else why not
    (:func:`~distfuse.kernels.persistent.descriptor_problem`)."""
    B, n, K = a3.shape
    if min(B, n, K, weight.shape[0]) == 0:
        return False, "an empty extent"
    why = descriptor_problem(a3, weight, "a", "n")
    return not why, why


def matmul_scatter_persistent(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                              partial_dtype: torch.dtype | None = None, config: dict | None = None,
                              checked: bool = False) -> None:
    """Produce, like :func:`~distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, with the persistent kernel.

    Same arguments and the same slots and flags; finish with ``chunk_reduce``.  ``config`` may set ``FLATTEN``
    (default :data:`FLATTEN`) and
    may add ``PROGRAMS`` (the persistent grid's size; default one per SM on CUDA, 2 under
    the interpreter).  Raises :class:`~distfuse.errors.UnsupportedError` where
    :func:`persistent_supported` says no; :func:`~distfuse.kernels.matmul_scatter_select.select_scatter_kernel`
    picks the pointer kernel for such operands and says so.  ``checked``: that selector has just
    said yes for these operands (a hot path skips asking twice).
    """
    op = "matmul_scatter_persistent"
    partial_dtype = check_producer_args(op, a, weight, partial_dtype)
    W = world_size
    n, K, N = a.shape[-2], a.shape[-1], weight.shape[0]
    a3 = a.reshape(math.prod(a.shape[:-2]), n, K)
    ok, why = (True, "") if checked else persistent_supported(a3, weight)
    if not ok:
        raise UnsupportedError(f"{where(op)}: tensor descriptors cannot read these operands: {why} (the selector, "
                               "distfuse.kernels.matmul_scatter_select, runs the pointer kernel for them)")
    st = claimed_rank_view(op, ws, rank, W, a.device)
    n_batch = a3.shape[0]
    ld = slot_row_stride(N)
    q1 = cdiv(n, W)
    slot_elems = n_batch * q1 * ld
    slots = st.data(partial_dtype, W * slot_elems, op=op, cached=True)
    # Block sizes: the caller's, the CPU config, or the pinned GPU rule, with its num_stages (TMA loads pipeline like
    # pointer loads).  Never autotuned, not even in loopback: the grid depends on the SM count, and one rule on every
    # rank keeps the ranks' tilings alike.
    meta = {k: v for k, v in (config or {}).items() if k not in ("kernel", "PROGRAMS")}
    if "BLOCK_M" not in meta:
        cpu = INTERPRET or not HAS_CUDA
        meta = dict(CPU_GEMM_CONFIG) if cpu else pinned_gemm_config(a.dtype, n_batch * q1, N, "persistent")
    meta.setdefault("FLATTEN", FLATTEN)
    programs = min(chunk_tiles(meta, n_batch, q1, W, N), persistent_programs(a.device, (config or {}).get("PROGRAMS")))
    a_desc = rows_descriptor(a3, meta["BLOCK_M"], meta["BLOCK_K"])
    b_desc, b_kmajor = weight_descriptor(weight, meta["BLOCK_N"], meta["BLOCK_K"])
    cached_launch(_matmul_scatter_persistent_kernel)[(programs,)](
        a_desc, b_desc, slots, st.data_ptrs, st.flag_ptrs, st.counters,
        n_batch, n, N, ld, K, rank, W, st.epoch_dev, rank * slot_elems,
        B_KMAJOR=b_kmajor, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(a.dtype),
        ROUND_BF16=round_bf16(partial_dtype), **meta,
    )
