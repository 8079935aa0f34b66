"""The ``@triton.jit`` helpers the kernel files share: rounding, chunk geometry, tile order, the flag protocol.

:func:`cast_out` is the one fp32 -> output-dtype conversion of every kernel; the GEMM fusions share the chunk
geometry, the grouped tile order and the K loop of one output tile (:func:`matmul_tile`, :func:`tma_tile`).
Host-side flags and configs are in :mod:`distfuse.kernels._utils`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["cast_out", "balanced_chunk", "chunk_rows", "grouped_tile", "tile_offsets", "matmul_tile", "tma_tile",
           "globaltimer", "poll_flags", "wait_flag", "arrive", "raise_flag", "store_word_kernel", "magic_div"]


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Convert fp32 ``x`` to ``DTYPE`` with round-to-nearest-even.

    The interpreter truncates fp32 -> bf16 (``1 + 2^-8 + 2^-9`` becomes 1.0, torch gives
    1.0078), so with ``ROUND_BF16`` (interpreter and a bf16 target, see
    :func:`round_bf16`) the rounding is done on the bits: add ``0x7FFF`` plus the lowest
    kept bit, then drop the low half.  NaNs keep the plain conversion (the bit trick can
    carry a NaN payload into infinity).  On GPUs the hardware ``cvt.rn`` already rounds
    to nearest even.
    """
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def balanced_chunk(chunk, n, W):
    """``(start, length)`` of chunk ``chunk`` of ``n`` rows over ``W``: the balanced decomposition.

    The first ``n % W`` chunks have ``n // W + 1`` rows, the others ``n // W``; the device
    twin of :func:`distfuse.geometry.decomposition.block_range`, so that the kernels and
    the host agree on every chunk boundary (``n`` need not divide by ``W``).
    """
    q = n // W
    rem = n % W
    length = q + (chunk < rem).to(tl.int32)
    start = chunk * q + tl.minimum(chunk, rem)
    return start, length


@triton.jit
def chunk_rows(offs_m, length, first_row):
    """``(m // length, first_row + m % length)`` (int64): batch and row of the flat tile rows ``offs_m`` of a chunk.

    The GEMMs tile the ``length`` rows of a chunk, for every batch entry, as one flat
    ``B_ * length`` dim; this maps a tile row back to ``(batch, row)`` of the tensor, the
    chunk starting at row ``first_row`` (0 for a tensor that holds just the chunk).  An
    empty chunk (``length`` 0) divides by 1 instead: all its rows are masked.
    """
    len_safe = tl.maximum(length, 1)
    return (offs_m // len_safe).to(tl.int64), (first_row + offs_m % len_safe).to(tl.int64)


@triton.jit
def chunk_tiling(n, W, n_batch, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The persistent GEMMs' tile grid over ``W`` chunks of ``n`` rows (``B_`` = ``n_batch`` entries each):
    ``(tiles_m, num_pid_m, num_pid_n, tiles_per_chunk, total)``.

    Every chunk gets the row tiles of the largest one (``cdiv(cdiv(n, W), BLOCK_M)`` per batch
    entry), so tile ``t`` is tile ``t % tiles_per_chunk`` of step ``t // tiles_per_chunk``
    whatever the chunk; the smaller chunks' last row tiles are empty.
    """
    tiles_m = tl.cdiv(tl.cdiv(n, W), BLOCK_M)
    num_pid_m = n_batch * tiles_m
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_chunk = num_pid_m * num_pid_n
    return tiles_m, num_pid_m, num_pid_n, tiles_per_chunk, W * tiles_per_chunk


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` over a ``num_pid_m x num_pid_n`` tile grid, in grouped order.

    Consecutive programs walk ``GROUP_M`` row tiles down one column of tiles before moving
    to the next column, so programs running together share the weight columns they read
    from L2 (Triton's matmul tutorial ordering; the last group may be shorter).
    """
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def tile_offsets(pid, num_pid_m, num_pid_n, M, N, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """``(offs_m, offs_n, mask_m, mask_n)``: the rows and columns of program ``pid``'s tile of an ``M x N`` output
    (:func:`grouped_tile` order), and which of them lie inside it."""
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def matmul_tile(a_rows, mask_m, b_ptr, offs_n, mask_n, K, stride_bk, stride_bn,
                UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One fp32 output tile ``[BLOCK_M, BLOCK_N] = A[rows, :K] @ B[:K, cols]``.

    ``a_rows`` ``[BLOCK_M]`` points at the first element of each A row (rows may come from
    anywhere: a remapped chunk, the shard or the gathered buffer; K is contiguous);
    ``B[k, j]`` is at ``b_ptr + k * stride_bk + j * stride_bn`` (an ``[N, K]`` weight read
    transposed).  Masked rows, columns and the K tail load zeros.  ``UPCAST`` converts
    16-bit operands to fp32 before the dot (the interpreter's bf16 dot is wrong).
    """
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # int64 offsets: a weight of 2^31 elements or more must not wrap.
        b = tl.load(b_ptr + offs_k.to(tl.int64)[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def tma_tile(a_desc, a_row, b_desc, col0, K, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr,
             INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`matmul_tile` through tensor descriptors (TMA loads; the persistent GEMMs): fp32 ``[BLOCK_M, BLOCK_N]``
    = A rows ``a_row ...`` (``a_desc``) @ weight columns ``col0 ...`` over all of K; ``b_desc`` reads the weight as
    ``[N, K]`` or (``B_KMAJOR``) as ``[K, N]``."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([a_row, k0])
        if B_KMAJOR:
            b = b_desc.load([k0, col0])
        else:
            b = b_desc.load([col0, k0]).T
        if UPCAST:  # the interpreter's 16-bit dot is wrong
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def poll_flags(base_ptr, offs, mask, LOADS: tl.constexpr):
    """The int32 flag words ``base_ptr[offs]`` where ``mask``, each read with acquire semantics at system scope.

    ``LOADS`` False: ``atom.global.sys.acquire.add`` of 0, one per word (a read-modify-write: the programs that poll
    one word are served one after another at its L2 slice).  ``LOADS`` True (compiled kernels only: inline PTX):
    ``ld.acquire.sys.global``, a load, which L2 serves to every poller of the word at once; masked lanes read
    ``base_ptr[0]`` and return 0.  Both are acquire operations on the flag, so the program's later loads see
    what the release that raised it published (the caller's CTA barrier extends that to every thread).
    """
    if LOADS:
        words = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l",
                                          [base_ptr + tl.where(mask, offs, 0)], dtype=tl.int32, is_pure=False, pack=1)
        return tl.where(mask, words, 0)
    else:
        return tl.atomic_add(base_ptr + offs, 0, mask=mask, sem="acquire", scope="sys")


@triton.jit
def globaltimer():
    """The GPU's nanosecond clock (``%globaltimer``), for time-bounded waits (compiled kernels only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def wait_flag(flag_ptr, epoch, status_ptr, timeout_ns, TIMED: tl.constexpr):
    """Spin until ``*flag_ptr == epoch`` (acquire, system scope); give up after ``timeout_ns``; return success.

    ``TIMED`` (compiled kernels): the bound is wall time read from ``%globaltimer``, so it
    holds whatever a load costs on this GPU and link.  Untimed (the interpreter, where a
    host barrier has already ordered the producers before the consumer): ``timeout_ns``
    counts extra loads, and the CPU path passes 0 (one check).  On failure
    ``*status_ptr`` is set to ``epoch``: a device kernel cannot raise, so the launcher
    reads the status word and raises on the host, and the caller poisons what it would
    have read (NaN), so a result built from stale data can never pass for a good one.
    A plain store, not an atomic: on CUDA the word is pinned host memory
    (:mod:`distfuse.fused.status_slots`), where atomics over PCIe are not guaranteed, and
    every thread that stores it stores the same value.
    """
    val = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if TIMED:
        start = globaltimer()
    waited = tl.full([], 0, tl.int64)  # nanoseconds (TIMED) or extra loads; typed: a loop-carried value
    while (val != epoch) & (waited < timeout_ns):
        val = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if TIMED:
            waited = globaltimer() - start
        else:
            waited += 1
    ok = val == epoch
    if not ok:
        tl.store(status_ptr, epoch)
    # Every thread of the program reads the data after the flag, not only the one that spun.
    tl.debug_barrier()
    return ok


@triton.jit
def arrive(counter_ptr):
    """Count this program as done; return True in the last program of the grid's axis 0.

    Tile counts depend on the block sizes (which autotuning may choose differently on
    every rank), so a consumer cannot know how many tiles to expect.  Instead the
    producer counts its own programs in a local counter and only the last one raises
    the flag, whose value (the op's epoch) does not depend on tiling.  The CTA barrier
    orders all threads' stores before the acq_rel increment; release is cumulative, so
    the last program's flag release (:func:`raise_flag`) also publishes the other
    programs' stores, which its increment observed.  The last program resets the
    counter for the next op: nothing else touches it until this kernel has finished.
    """
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = old == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def raise_flag(flag_ptr, epoch):
    """Publish ``*flag_ptr = epoch`` with release semantics at system scope (peers read it over NVLink)."""
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def store_word_kernel(word_ptr, value):
    """One program: ``*word_ptr = value``.  The probe that a kernel's store reaches pinned host memory
    (:func:`distfuse.fused.status_slots.mapped_host_words`)."""
    tl.store(word_ptr, value)


@triton.jit
def magic_div(n, m, shift):
    """``n // d`` for int32 ``0 <= n < 2^31`` by the multiplier ``(m, shift)`` of
    :func:`~distfuse.kernels.halo_programs.magic_divisor` (``d`` >= 1; both tensors or run-time integers):
    ``umulhi(2n, m) >> shift``, three 32-bit instructions instead of a runtime division (about twenty on a GPU) or
    a 64-bit multiply."""
    return (tl.umulhi((n * 2).to(tl.uint32), m.to(tl.uint32)) >> shift.to(tl.uint32)).to(tl.int32)
