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
  row tiles per batch entry, or ``ceil(n / BLOCK_M)`` with ``SPAN``), so each A tile is one
  rectangular box of the ``[B_ * n, K]`` view; rows past the chunk's end (past ``n`` with
  ``SPAN``) are loaded and masked at the store.
* **The tile loop and the K loop are one loop** (``FLATTEN``, the default: ``tl.range(...,
  flatten=True)``, as in Triton's persistent matmul tutorial).  The compiler's pipeliner then
  runs across tiles: the next tile's first operand loads are in flight while this tile's
  epilogue converts and stores, where a K loop per tile drains its pipeline at every tile
  and refills it after the stores.  At K = 1792 (LLaMA-3 8B at TP 8, 28 K steps of 64) the
  nested form pays that once every 28 steps.  Compiled for sm_90 (Triton 3.6 and 3.9) the
  fused loop keeps three or four stages of TMA buffers and needs fewer registers than the
  nested one (194-199 against 238-246 at 128x256x64, 8 warps); the compile audit fails any
  persistent config whose loop is not multi-buffered (``pipelined``).
* **Row tiles may span chunks** (``SPAN``, chosen by :func:`span_wins`).  Chunk-aligned row
  tiles compute ``W * ceil(ceil(n / W) / BLOCK_M) * BLOCK_M`` rows: at TP 8 and M = 512 the
  chunks are 64 rows, so a 128-row tile is half idle, and a 64-row tile reads 40 KB of
  operands a K step for 1M FMAs where a 128x256 one reads 48 KB for 2M.  On the H200
  (``a6bfa8c``) that producer took 1.7-1.8 times cuBLAS's kernel time; its tile count and
  bytes per FLOP point at L2 bandwidth.  With ``SPAN`` the row tiles cover each batch entry's
  ``n`` rows whatever the chunks (starting at chunk ``rank + 1``'s first row tile, as the
  chunks rotate without it); each row finds its chunk, its owner's slot and its slot row in
  the epilogue (:func:`_store_span_rows`), and a tile counts once for every chunk its rows
  touch.  The pinned rule picks the tile from the whole GEMM's rows, then SPAN where
  chunk-aligned rows would waste more than :data:`SPAN_WASTE` (:func:`_pinned_config`).
* **One signal per chunk.**  Tiles are counted on a per-chunk counter (acq_rel, GPU scope);
  the arrival that completes the count resets it and raises the owner's flag (release,
  system scope: cumulative, so it publishes every tile's stores that the count observed).
  A CTA barrier orders all threads' stores before a count, and the pipeliner does not take
  a loop that holds a barrier, so the two forms count differently:

  - fused loop, or ``SPAN``: each program counts its tiles of every chunk once, after its
    last tile (:func:`_arrive_counts`; one add per chunk it holds).  An owner's flag rises
    when the last program holding one of its tiles ends.  ``chunk_reduce`` runs after the
    producer on the same stream, so only a rank behind its peers would see it later than below;
  - nested loops without SPAN: a tile's arrival is issued after the *next* tile's K
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

import functools
import math

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, where
from distfuse.kernels._utils import (
    CPU_GEMM_CONFIG,
    HAS_CUDA,
    INTERPRET,
    BoundedMemo,
    check_producer_args,
    claimed_rank_view,
    input_precision,
    round_bf16,
)
from distfuse.kernels.chunk_reduce import slot_row_stride
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import balanced_chunk, cast_out, chunk_tiling, grouped_tile, raise_flag, tma_tile
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.persistent import (
    chunk_tiles,
    descriptor_problem,
    fill_waves,
    persistent_programs,
    rows_descriptor,
    weight_descriptor,
)
from distfuse.kernels.tile_table import device_name, measured_tile

__all__ = ["matmul_scatter_persistent", "persistent_supported", "span_wins", "scatter_tiles", "FLATTEN", "SPAN_WASTE"]

#: The default of the kernel's ``FLATTEN`` (a config's ``"FLATTEN"`` overrides it): the tile loop and the K loop
#: as one software-pipelined loop, arrivals counted once per program (see :func:`_arrive_counts`).
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
    SPAN: tl.constexpr, W_BLOCK: tl.constexpr,
):
    """Persistent grid (at most one program per SM); see the module doc.

    ``a_desc``: host descriptor of the ``[B_ * n, K]`` view of ``a`` (blocks ``[BLOCK_M, BLOCK_K]``);
    ``b_desc``: of the weight, ``[N, K]`` (``B_KMAJOR`` False, blocks ``[BLOCK_N, BLOCK_K]``) or
    ``[K, N]`` (True, blocks ``[BLOCK_K, BLOCK_N]``).  ``FLATTEN``: the tile loop and the K loop are one
    loop for the compiler's pipeliner (``tl.range(..., flatten=True)``), so the next tile's first loads
    are in flight while this tile's epilogue stores; every tile then runs the whole K loop (an empty
    tile's rows are loaded and masked at the store), and the epilogue recomputes its tile's place
    from its own counter instead of carrying the prologue's values across the loop.  ``SPAN``: row
    tiles cover a batch entry's ``n`` rows whatever the chunks (a tile may hold rows of several
    owners; each row finds its chunk and slot in the epilogue), not each chunk's rows apart.
    ``W_BLOCK``: a power of two >= W (the per-chunk tile counts of :func:`_arrive_counts`).
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    if SPAN:  # row tiles over [0, n) of each batch entry, starting at chunk rank + 1's first row tile
        tiles_m = tl.cdiv(n, BLOCK_M)
        num_pid_m = n_batch * tiles_m
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_per_chunk = 0  # unused: a chunk's count is its rows' tiles (_arrive_counts)
        total = num_pid_m * num_pid_n
        rot = balanced_chunk((rank + 1) % W, n, W)[0] // BLOCK_M
    else:
        tiles_m, num_pid_m, num_pid_n, tiles_per_chunk, total = chunk_tiling(n, W, n_batch, N, BLOCK_M, BLOCK_N)
        rot = 0
    esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
    own_base = tl.load(data_ptrs + rank)
    pending = tl.full([], -1, tl.int32)  # chunk of the tile whose arrival is deferred (-1: none)
    counts = tl.zeros([W_BLOCK], dtype=tl.int32)  # FLATTEN or SPAN: this program's tiles of each chunk
    chunk_ids = tl.arange(0, W_BLOCK)
    t_out = pid - num_progs  # FLATTEN: the epilogue's tile, on its own counter
    for t in tl.range(pid, total, num_progs, flatten=FLATTEN):
        if SPAN:
            b_idx, row0, col0 = _span_place(t, tiles_m, num_pid_m, num_pid_n, rot, BLOCK_M, BLOCK_N, GROUP_M)
            a_row = b_idx * n + row0
        else:
            chunk, start_c, len_c, b_idx, row0, col0 = _tile_place(t, rank, n, W, tiles_per_chunk, tiles_m,
                                                                   num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
            a_row = b_idx * n + start_c + row0
        if FLATTEN:  # one uniform K loop per tile: what lets the compiler fuse the two loops
            acc = tma_tile(a_desc, a_row, b_desc, col0, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                           BLOCK_K)
            t_out += num_progs
            if SPAN:
                b_idx, row0, col0 = _span_place(t_out, tiles_m, num_pid_m, num_pid_n, rot, BLOCK_M, BLOCK_N, GROUP_M)
            else:
                chunk, start_c, len_c, b_idx, row0, col0 = _tile_place(t_out, rank, n, W, tiles_per_chunk, tiles_m,
                                                                       num_pid_m, num_pid_n, BLOCK_M, BLOCK_N,
                                                                       GROUP_M)
        elif SPAN:  # no empty tile: every row tile holds rows of [0, n)
            acc = tma_tile(a_desc, a_row, b_desc, col0, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                           BLOCK_K)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if row0 < len_c:  # the smaller chunks' last row tiles are empty
                acc = tma_tile(a_desc, a_row, b_desc, col0, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_K)
            # The previous tile's stores have drained while this tile's K loop ran: count it now.
            if pending >= 0:
                _arrive_tile(counter_ptr, pending, tiles_per_chunk, flag_ptrs, W, rank, epoch)
        out = cast_out(acc, slots_ptr.dtype.element_ty, ROUND_BF16)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        if SPAN:
            if BLOCK_N >= 256:  # two column halves: half the pointer registers live at once (255 a thread else)
                HALF: tl.constexpr = BLOCK_N // 2
                out0, out1 = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, HALF)), (0, 2, 1)))
                _store_span_rows(out0, slots_ptr, data_ptrs, own_base, esize, src_offset, ld, b_idx, row0,
                                 col0 + tl.arange(0, HALF), n, N, W, BLOCK_M)
                _store_span_rows(out1, slots_ptr, data_ptrs, own_base, esize, src_offset, ld, b_idx, row0,
                                 col0 + HALF + tl.arange(0, HALF), n, N, W, BLOCK_M)
            else:
                _store_span_rows(out, slots_ptr, data_ptrs, own_base, esize, src_offset, ld, b_idx, row0, offs_n, n,
                                 N, W, BLOCK_M)
            # the tile's chunks: those of its first and last row (scalars: a reduction would put a barrier here)
            c_lo = _chunk_of(row0, n, W)
            c_hi = _chunk_of(tl.minimum(row0 + BLOCK_M, n) - 1, n, W)
            counts += ((chunk_ids >= c_lo) & (chunk_ids <= c_hi)).to(tl.int32)
        else:
            offs_r = row0 + tl.arange(0, BLOCK_M)
            mask = (offs_r < len_c)[:, None] & (offs_n < N)[None, :]
            rows = (b_idx * len_c + offs_r).to(tl.int64)  # slot rows: [B_, len_c] flattened
            delta = (tl.load(data_ptrs + chunk) - own_base) // esize
            dst = slots_ptr + tl.multiple_of(delta + src_offset, 16)
            tl.store(dst + rows[:, None] * tl.multiple_of(ld, 16) + offs_n[None, :], out, mask=mask)
            if FLATTEN:
                counts += (chunk_ids == chunk).to(tl.int32)
            else:  # counted after the next tile's K loop
                pending = chunk
    if FLATTEN or SPAN:
        _arrive_counts(counts, chunk_ids, counter_ptr, flag_ptrs, pid, W, rank, epoch, n, n_batch, num_pid_n,
                       tiles_per_chunk, SPAN, BLOCK_M)
    elif pending >= 0:
        _arrive_tile(counter_ptr, pending, tiles_per_chunk, flag_ptrs, W, rank, epoch)


@triton.jit
def _arrive_counts(counts, chunk_ids, counter_ptr, flag_ptrs, pid, W, rank, epoch, n, n_batch, num_pid_n,
                   tiles_per_chunk, SPAN: tl.constexpr, BLOCK_M: tl.constexpr):
    """After the program's last tile (FLATTEN or SPAN): add its tiles of every chunk (``counts``) to the chunk's
    counter at once, one acq_rel add per chunk it holds; the add that completes a chunk's count raises the owner's
    flag, as :func:`_arrive_tile` does.

    Why not per tile: the CTA barrier that orders every thread's stores before a count would sit inside the
    tile loop, and the compiler does not software-pipeline a loop that holds one (Triton 3.6, sm_90), so the
    flattened loop would lose the very overlap it is for.  The cost: an owner's flag rises when the last
    program that holds one of its tiles ends, not when its last tile ends; ``chunk_reduce`` runs after the
    producer on the same stream, so only a rank running behind its peers would see the difference.
    A chunk's count is ``tiles_per_chunk`` (chunk tiles), or with SPAN ``B_ * ceil(N / BLOCK_N)`` times the row
    tiles its rows touch; an empty chunk then has no tile, and program 0 raises its flag.
    """
    tl.debug_barrier()
    c = tl.full([], 0, tl.int32)  # typed: a loop-carried counter keeps one type when compiled
    while c < W:  # a while loop: no runtime range bound (see kernels/halo_programs.py)
        mine = tl.sum(tl.where(chunk_ids == c, counts, 0))
        if SPAN:
            start_c, len_c = balanced_chunk(c, n, W)
            expected = tl.where(len_c > 0, (start_c + len_c - 1) // BLOCK_M - start_c // BLOCK_M + 1, 0)
            expected = expected * n_batch * num_pid_n
        else:
            expected = tiles_per_chunk
        flag = tl.load(flag_ptrs + c).to(tl.pointer_type(tl.int32)) + c * W + rank
        if mine > 0:
            old = tl.atomic_add(counter_ptr + c, mine, sem="acq_rel", scope="gpu")
            if old + mine == expected:
                tl.atomic_xchg(counter_ptr + c, 0, sem="relaxed", scope="gpu")
                raise_flag(flag, epoch)
        elif (expected == 0) & (pid == 0):  # an empty chunk (SPAN): nothing to publish but the flag
            raise_flag(flag, epoch)
        c += 1


@triton.jit
def _tile_place(t, rank, n, W, tiles_per_chunk, tiles_m, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t`` of the persistent grid: ``(chunk, start_c, len_c, b_idx, row0, col0)``, its chunk (in the
    rank-rotated order), the chunk's rows, its batch entry, its first row inside the chunk and its first column."""
    chunk = (rank + 1 + t // tiles_per_chunk) % W
    start_c, len_c = balanced_chunk(chunk, n, W)
    pid_m, pid_n = grouped_tile(t % tiles_per_chunk, num_pid_m, num_pid_n, GROUP_M)
    return chunk, start_c, len_c, pid_m // tiles_m, (pid_m % tiles_m) * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _span_place(t, tiles_m, num_pid_m, num_pid_n, rot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """SPAN tile ``t``: ``(b_idx, row0, col0)``, its batch entry, its first row in ``[0, n)`` and its first column;
    the row tiles of an entry start at ``rot`` (chunk rank + 1's first row tile), as the chunks do without SPAN."""
    pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
    return pid_m // tiles_m, ((pid_m % tiles_m + rot) % tiles_m) * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _chunk_of(i, n, W):
    """The chunk of row ``i`` of ``n`` over ``W`` (the inverse of :func:`balanced_chunk`): the first ``n % W`` chunks
    hold ``n // W + 1`` rows each, the rest ``n // W``."""
    q = n // W
    big = (n % W) * (q + 1)  # the rows of the longer chunks
    return tl.where(i < big, i // (q + 1), n % W + (i - big) // tl.maximum(q, 1))


@triton.jit
def _store_span_rows(out, slots_ptr, data_ptrs, own_base, esize, src_offset, ld, b_idx, row0, offs_n, n, N, W,
                     BLOCK_M: tl.constexpr):
    """SPAN epilogue: rows ``row0 ...`` of batch entry ``b_idx``, each into its own chunk's owner's slot, at slot row
    ``b_idx * len_c + i - start_c`` (rows ``ld`` apart, as without SPAN); rows past ``n`` are not stored."""
    i = row0 + tl.arange(0, BLOCK_M)
    valid = i < n
    c = tl.where(valid, _chunk_of(i, n, W), 0)
    start_c, len_c = balanced_chunk(c, n, W)
    delta = (tl.load(data_ptrs + c) - own_base) // esize  # the owner's slot base, per row
    rows = tl.multiple_of(delta + src_offset + (b_idx * len_c + i - start_c).to(tl.int64) * ld, 16)
    tl.store(slots_ptr + rows[:, None] + offs_n[None, :], out, mask=valid[:, None] & (offs_n < N)[None, :])


#: SPAN when chunk-aligned row tiles would compute this many more rows than there are, or more (1/8: 12.5%).
SPAN_WASTE = 0.125


def span_wins(block_m: int, n: int, W: int) -> bool:
    """Whether row tiles of ``block_m`` rows should span chunks (``SPAN``): chunk-aligned tiles compute
    ``W * ceil(ceil(n / W) / block_m) * block_m`` rows for ``n``, and more than :data:`SPAN_WASTE` extra is
    compute thrown away (LLaMA-3 at TP 8, M = 512: 64-row chunks in 128-row tiles, half of it)."""
    return W * cdiv(cdiv(n, W), block_m) * block_m > n * (1 + SPAN_WASTE)


def scatter_tiles(meta: dict, n_batch: int, n: int, W: int, N: int) -> int:
    """Tiles of one launch: chunk-aligned (:func:`~distfuse.kernels.persistent.chunk_tiles`) or, with ``SPAN``,
    ``B_ * ceil(n / BLOCK_M) * ceil(N / BLOCK_N)``."""
    if meta.get("SPAN"):
        return n_batch * cdiv(n, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
    return chunk_tiles(meta, n_batch, cdiv(n, W), W, N)


@functools.lru_cache(maxsize=256)
def _pinned_config(dtype: torch.dtype, n_batch: int, n: int, W: int, N: int, programs: int) -> dict:
    """The pinned GPU rule, cached per shape (callers copy the result): never autotuned (the grid depends on the
    SM count, and one rule on every rank keeps the ranks' tilings alike).

    The tile is the whole GEMM's, ``B_ * n`` rows by ``N`` (:func:`~distfuse.kernels._utils.pinned_gemm_config`,
    family ``persistent``), walked down the family's list to the first whose tiles keep the grid at least
    :data:`~distfuse.kernels.persistent.WAVE_TARGET` busy in its last wave (else the busiest),
    as the all-gather consumer's rule does; ``SPAN`` where chunk-aligned rows would waste it
    (:func:`span_wins`).  The tile is chosen from the GEMM's rows, not the chunk's, because a tile's
    operand bytes per FLOP set the L2 traffic: at M = 512 the 64-row chunks took 64x256 tiles, 40 KB a
    K step for 1M FMAs (a 128x256 tile: 48 KB for 2M).  Reasoned from the a6bfa8c H200 rows (the M = 512
    producer 1.7-1.8x cuBLAS's time), not measured yet: section ``forms`` of ``scripts/gpu_diagnose.py``
    times this rule against the chunk-aligned one.
    """
    chosen = fill_waves(dtype, n_batch * n, N, "persistent",
                        lambda c: scatter_tiles(dict(c, SPAN=span_wins(c["BLOCK_M"], n, W)), n_batch, n, W, N),
                        programs)
    return dict(chosen, SPAN=span_wins(chosen["BLOCK_M"], n, W))


def _default_blocks(dtype: torch.dtype, n_batch: int, n: int, W: int, N: int, K: int, device: torch.device,
                    sms: int) -> dict:
    """A copy of the default block sizes: the CPU config under the interpreter, else the measured tile of this
    device and shape (:func:`~distfuse.kernels.tile_table.measured_tile`; its ``FLATTEN`` and ``SPAN`` where it
    gives them), else the pinned rule."""
    if INTERPRET or not HAS_CUDA:
        return dict(CPU_GEMM_CONFIG)
    measured = measured_tile("matmul_scatter_persistent", _matmul_scatter_persistent_kernel, device_name(device),
                             dtype, n_batch * n, N, K, W)
    return measured if measured is not None else dict(_pinned_config(dtype, n_batch, n, W, N, sms))


def _complete(meta: dict, n_batch: int, n: int, W: int, N: int, sms: int) -> tuple[dict, int]:
    """``(meta, programs)``: ``meta`` with the defaults of ``FLATTEN`` and ``SPAN`` and with ``W_BLOCK``, and the
    persistent grid's size (at most ``sms``, at most one program per tile)."""
    meta.setdefault("FLATTEN", FLATTEN)
    meta.setdefault("SPAN", span_wins(meta["BLOCK_M"], n, W))
    meta["W_BLOCK"] = next_power_of_2(W)
    return meta, min(scatter_tiles(meta, n_batch, n, W, N), sms)


@functools.lru_cache(maxsize=256)
def _default_launch(dtype: torch.dtype, n_batch: int, n: int, W: int, N: int, K: int,
                    device: torch.device) -> tuple[dict, int]:
    """:func:`_complete` of the default blocks, cached per shape and device: a call without a config pays one lookup
    for its launch geometry, not the rule's Python or the tile table (callers never mutate the dict)."""
    sms = persistent_programs(device)
    return _complete(_default_blocks(dtype, n_batch, n, W, N, K, device, sms), n_batch, n, W, N, sms)


def persistent_supported(a3: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether the descriptor kernel can read ``a3 [B_, n, K]`` and ``weight [N, K]``; else why not
    (:func:`~distfuse.kernels.persistent.descriptor_problem`)."""
    B, n, K = a3.shape
    if min(B, n, K, weight.shape[0]) == 0:
        return False, "an empty extent"
    why = descriptor_problem(a3, weight, "a", "n")
    return not why, why


#: The bound launches of :func:`matmul_scatter_persistent`'s hot path (no ``config``), per shape, rank, weight
#: layout and dtypes (:class:`~distfuse.kernels.launch_cache.BoundLaunch`): a call fingerprints its buffers and
#: descriptors, not the geometry's scalars and constexprs again.
_BOUND = BoundedMemo(512)


def matmul_scatter_persistent(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                              partial_dtype: torch.dtype | None = None, config: dict | None = None,
                              checked: bool = False) -> None:
    """Produce, like :func:`~distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, with the persistent kernel.

    Same arguments and the same slots and flags; finish with ``chunk_reduce``.  ``config`` may set ``FLATTEN``
    (default :data:`FLATTEN`), ``SPAN`` (default :func:`span_wins` of its ``BLOCK_M``) and
    ``PROGRAMS`` (the persistent grid's size; default one per SM on CUDA, 2 under
    the interpreter).  Raises :class:`~distfuse.errors.UnsupportedError` where
    :func:`persistent_supported` says no; :func:`~distfuse.kernels.matmul_scatter_select.select_scatter_kernel`
    picks the pointer kernel for such operands and says so.  ``checked``: that selector has just
    said yes for these operands (a hot path skips asking twice).
    """
    op = "matmul_scatter_persistent"
    partial_dtype = check_producer_args(op, a, weight, partial_dtype)
    W = world_size
    n, K, N = a.shape[-2], a.shape[-1], weight.shape[0]
    a3 = a if a.dim() == 3 else a.reshape(math.prod(a.shape[:-2]), n, K)  # [B_, n, K]: the common case, no reshape
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
    if config is None:  # the hot path: the whole launch geometry and its binding, cached per shape
        meta, programs = _default_launch(a.dtype, n_batch, n, W, N, K, a.device)
        a_desc = rows_descriptor(a3, meta["BLOCK_M"], meta["BLOCK_K"])
        b_desc, b_kmajor = weight_descriptor(weight, meta["BLOCK_N"], meta["BLOCK_K"])
        key = (a.dtype, n_batch, n, W, N, K, a.device, rank, b_kmajor, partial_dtype,
               input_precision(a.dtype))  # fp32: torch's TF32 setting at this call, which a user may change
        bound = _BOUND.get(key) or _BOUND.keep(key, cached_launch(_matmul_scatter_persistent_kernel).bind(
            (programs,), (n_batch, n, N, ld, K, rank, W),
            dict(B_KMAJOR=b_kmajor, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(a.dtype),
                 ROUND_BF16=round_bf16(partial_dtype), **meta), split=6))
        bound(a_desc, b_desc, slots, st.data_ptrs, st.flag_ptrs, st.counters, st.epoch_dev, rank * slot_elems)
        return
    else:
        sms = persistent_programs(a.device, config.get("PROGRAMS"))
        meta = {k: v for k, v in config.items() if k not in ("kernel", "PROGRAMS")}
        if "BLOCK_M" not in meta:  # the default tile, with the config's other keys (FLATTEN, SPAN) kept
            meta = {**_default_blocks(a.dtype, n_batch, n, W, N, K, a.device, sms), **meta}
        meta, programs = _complete(meta, n_batch, n, W, N, sms)
    a_desc = rows_descriptor(a3, meta["BLOCK_M"], meta["BLOCK_K"])
    b_desc, b_kmajor = weight_descriptor(weight, meta["BLOCK_N"], meta["BLOCK_K"])
    cached_launch(_matmul_scatter_persistent_kernel)[(programs,)](
        a_desc, b_desc, slots, st.data_ptrs, st.flag_ptrs, st.counters,
        n_batch, n, N, ld, K, rank, W, st.epoch_dev, rank * slot_elems,
        B_KMAJOR=b_kmajor, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(a.dtype),
        ROUND_BF16=round_bf16(partial_dtype), **meta,
    )
