"""gathered_matmul, persistent form: TMA loads of the local shard and of each peer chunk, one wait per chunk.

The consumer of :func:`~distfuse.kernels.all_gather_matmul.ag_push` (or of the copy-engine
push), with the same inputs and output as the one-tile-per-program kernel, built for the
roofline (a GEMM: 2 * B_ * n * N * K FLOPs over B_ * n * K + N * K + B_ * n * N elements,
compute-bound at the MLP shapes, so the target is cuBLAS's rate)::

    x       [B_, len_p, K]  this rank's rows (the local chunk), rows flattened to [B_ * len_p, K]
    gathered[B_, n, K]      this rank's workspace: the peers' rows, pushed there (own rows absent)
    weight  [N, K]          K contiguous, or [K, N] N contiguous (``w.t()`` of a contiguous [K, N])
    y       [B_, n, N]      = gather(x) @ weight.T + bias

* **Persistent grid, chunk-major tile order**, as in :mod:`distfuse.kernels.matmul_scatter_persistent`
  (grouped tiles; a row tile never crosses a batch entry, so every A tile is one rectangular
  box of a descriptor), the chunks in the pointer kernel's arrival order (local first, no wait).
* **One poll for every chunk, a wait only for a chunk still missing.**  A program's chunk index never
  decreases along its tiles.  At its first tile of a peer chunk it has not yet seen arrive, it
  loads every chunk's flag at once (one vector of acquire loads, system scope, one CTA barrier:
  :func:`_poll_chunks`) and keeps the mask of those that have arrived; a chunk already in the
  mask needs no flag traffic at all, and only one still missing is waited for (``wait_flag``).
  Where the pushes are done before the consumer reaches its peer chunks (the pushes are a copy,
  the consumer a GEMM), a program makes one memory round trip for all its chunks: at the
  LLaMA-3 shapes a chunk holds fewer tiles than there are programs, so nearly every tile of a
  program is in a new chunk, and the one wait per chunk of the earlier form was one acquire
  round trip (and a CTA barrier) before almost every tile's K loop.  None is inside a K loop.
  A chunk whose flag never came is stored as NaN by every tile that read it; the launcher
  raises on the status word.
* **Host-side tensor descriptors** (:mod:`distfuse.kernels.persistent`) for ``x``, the
  gathered buffer and the weight.  One K loop serves both sources: the tile picks its
  descriptor (shard or workspace) before the loop, so there is one set of pipeline buffers
  (a loop per source doubled the shared memory past sm_90's 227 KB at the 128-row tiles).
  After a peer's flag a ``fence.proxy.async.global`` orders the acquire before the TMA
  (async-proxy) reads.
* **Epilogue.**  Bias in fp32, one rounding, masked 16-byte pointer stores (a TMA store
  box would write rows of the next chunk), split in two column halves
  (``EPILOGUE_SUBTILE``, the tutorial's subtiled epilogue): the same shared memory, fewer
  live registers.

Which kernel runs a call is decided in one place, :mod:`distfuse.kernels.gathered_matmul_select`;
this module refuses operands its descriptors cannot read (:func:`gathered_persistent_supported`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, where
from distfuse.kernels._utils import (
    CPU_GEMM_CONFIG,
    INTERPRET,
    TIMED_WAITS,
    BoundedMemo,
    input_precision,
    round_bf16,
    timeout_arg,
)
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import balanced_chunk, cast_out, chunk_tiling, grouped_tile, tma_tile, wait_flag
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.persistent import (
    checked_descriptor,
    chunk_tiles,
    descriptor_problem,
    fill_waves,
    persistent_programs,
    rows_descriptor,
    weight_descriptor,
)
from distfuse.kernels.tile_table import device_name, measured_tile

__all__ = ["gathered_persistent_supported", "gathered_persistent_config", "launch_gathered_persistent"]


@triton.jit
def _async_proxy_fence():
    """``fence.proxy.async.global``: order this thread's generic-proxy accesses (the flag's acquire) before its
    later async-proxy ones (the TMA loads of the chunk the flag published).  Compiled kernels only."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _poll_chunks(flags_ptr, W, epoch, W_BLOCK: tl.constexpr):
    """The ``[W_BLOCK]`` mask of the chunks whose push has arrived: every chunk's flag ``flags[c, c]`` loaded at once
    (acquire, system scope: the chunk's rows may be read after it), then one CTA barrier, so every thread of the
    program reads after the poll, as after :func:`~distfuse.kernels.jit_helpers.wait_flag`."""
    c = tl.arange(0, W_BLOCK)
    val = tl.atomic_add(flags_ptr + c * W + c, 0, mask=c < W, sem="acquire", scope="sys")
    tl.debug_barrier()
    return (c < W) & (val == epoch)


@triton.jit
def _finish(y_ptr, acc, bias_ptr, stride_bias, rows, mask_r, offs_n, N, ok, HAS_BIAS: tl.constexpr,
            ROUND_BF16: tl.constexpr):
    """Bias (fp32), NaN where the chunk never arrived, one rounding, masked store into ``y [*, N]`` rows ``rows``."""
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(ok, acc, float("nan"))
    tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], cast_out(acc, y_ptr.dtype.element_ty, ROUND_BF16),
             mask=mask_r[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["rank", "timeout"])
def _gathered_matmul_persistent_kernel(
    x_desc, g_desc, b_desc, bias_ptr, y_ptr, flags_ptr, status_ptr,
    n_batch, n, N, K, len_p, rank, W, epoch_ptr, timeout, stride_bias,
    HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr, TIMED: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_BLOCK: tl.constexpr,
):
    """Persistent grid (at most one program per SM); see the module doc.

    ``x_desc``: the ``[B_ * len_p, K]`` rows of the shard (blocks ``[BLOCK_M, BLOCK_K]``);
    ``g_desc``: the ``[B_ * n, K]`` gathered buffer; ``b_desc``: the weight, ``[N, K]``
    (``B_KMAJOR`` False, blocks ``[BLOCK_N, BLOCK_K]``) or ``[K, N]`` (True, ``[BLOCK_K, BLOCK_N]``).
    ``W_BLOCK``: the next power of two of W (the flag poll's vector).
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_m, num_pid_m, num_pid_n, tiles_per_chunk, total = chunk_tiling(n, W, n_batch, N, BLOCK_M, BLOCK_N)
    seen = tl.full([], 0, tl.int32)  # the step (chunk order) this program has waited for; 0: the local chunk
    ok = seen == 0  # the current chunk's data arrived (int1; the local chunk always has)
    lanes = tl.arange(0, W_BLOCK)
    arrived = lanes < 0  # the chunks this program has seen arrive, by an acquire it made (none yet)
    for t in range(pid, total, num_progs):
        step = t // tiles_per_chunk
        chunk = (rank - step + W) % W
        start_c, len_c = balanced_chunk(chunk, n, W)
        pid_m, pid_n = grouped_tile(t % tiles_per_chunk, num_pid_m, num_pid_n, GROUP_M)
        b_idx = pid_m // tiles_m
        row0 = (pid_m % tiles_m) * BLOCK_M  # first row of the tile inside the chunk
        col0 = pid_n * BLOCK_N
        if row0 < len_c:  # the smaller chunks' last row tiles are empty
            if step != seen:  # this program's first tile of a peer chunk
                if tl.sum((arrived & (lanes == chunk)).to(tl.int32), axis=0) == 0:  # not seen arrive yet: poll all
                    arrived = _poll_chunks(flags_ptr, W, epoch, W_BLOCK)
                    if tl.sum((arrived & (lanes == chunk)).to(tl.int32), axis=0) == 0:  # still missing: wait for it
                        ok = wait_flag(flags_ptr + chunk * W + chunk, epoch, status_ptr + chunk, timeout, TIMED)
                    else:
                        ok = seen >= 0  # true (int1, as wait_flag returns)
                    if TIMED:  # the peers' rows were published to generic-proxy reads; TMA reads via the async proxy
                        _async_proxy_fence()
                else:  # acquired by an earlier poll of this program, fenced after it
                    ok = seen >= 0
                seen = step
            # One K loop (one set of pipeline buffers): the local chunk reads the shard, the others the workspace.
            if step == 0:
                a_desc = x_desc
                a_row = b_idx * len_p + row0
            else:
                a_desc = g_desc
                a_row = b_idx * n + start_c + row0
            acc = tma_tile(a_desc, a_row, b_desc, col0, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            offs_r = row0 + tl.arange(0, BLOCK_M)
            rows = (b_idx * n + start_c + offs_r).to(tl.int64)  # rows of y [B_ * n, N]
            mask_r = offs_r < len_c
            if EPILOGUE_SUBTILE:  # two [BLOCK_M, BLOCK_N // 2] halves: fewer registers live in the epilogue
                HALF: tl.constexpr = BLOCK_N // 2
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
                _finish(y_ptr, acc0, bias_ptr, stride_bias, rows, mask_r, col0 + tl.arange(0, HALF), N, ok,
                        HAS_BIAS, ROUND_BF16)
                _finish(y_ptr, acc1, bias_ptr, stride_bias, rows, mask_r, col0 + HALF + tl.arange(0, HALF), N, ok,
                        HAS_BIAS, ROUND_BF16)
            else:
                _finish(y_ptr, acc, bias_ptr, stride_bias, rows, mask_r, col0 + tl.arange(0, BLOCK_N), N, ok,
                        HAS_BIAS, ROUND_BF16)


def gathered_persistent_supported(x3: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether the descriptors can read the shard ``x3 [B_, len_p, K]``, the gathered ``[B_, n, K]`` and ``weight``.

    The gathered rows are ``K`` elements apart from a 16-byte aligned workspace base, so they
    need ``K * itemsize % 16 == 0``; the shard and the weight as in
    :func:`~distfuse.kernels.persistent.descriptor_problem` (an empty shard is never read).
    """
    B, _, K = x3.shape
    esize = x3.element_size()
    if min(B, K, weight.shape[0]) == 0:
        return False, "an empty extent"
    if (K * esize) % 16:
        return False, f"K * itemsize = {K * esize} bytes is not a multiple of 16 (the gathered rows' stride)"
    why = descriptor_problem(x3, weight, "the shard", "len")
    return not why, why


def gathered_persistent_config(dtype: torch.dtype, batch: int, q1: int, W: int, N: int, programs: int,
                               config: dict | None = None, *, K: int = 0, device_name: str | None = None) -> dict:
    """Block sizes of one launch: ``config`` (tests), the CPU config (interpreter), the measured tile of
    ``device_name`` for this shape (``K`` the GEMM's depth; :func:`~distfuse.kernels.tile_table.measured_tile`),
    or the pinned rule.

    ``batch * q1`` rows per chunk (the largest), ``W`` chunks, ``N`` output features,
    ``programs`` the persistent grid's size (the SM count on CUDA).  The pinned rule
    (never autotuned: the grid depends on the SM count, and one rule on every rank keeps
    the ranks alike) starts from the bucket's tile of the ``gathered_persistent`` family
    (:func:`~distfuse.kernels._utils.pinned_gemm_config`) and goes down the family's list
    to the first tile whose last wave of tiles keeps the grid at least :data:`~distfuse.kernels.persistent.WAVE_TARGET`
    busy (else the busiest): a compute-bound persistent GEMM loses a whole tile time per
    program to a short last wave (448 tiles of 128x256 on 132 SMs: 85% busy; 896 tiles of
    128x128: 97%).  The trade against a smaller tile's lower efficiency is reasoned, not measured.
    """
    blocks = {k: v for k, v in (config or {}).items() if k != "PROGRAMS"}
    if "BLOCK_M" in blocks:
        blocks.setdefault("EPILOGUE_SUBTILE", False)
        return blocks
    if INTERPRET:
        return dict(CPU_GEMM_CONFIG, EPILOGUE_SUBTILE=False)
    measured = measured_tile("gathered_matmul_persistent", _gathered_matmul_persistent_kernel, device_name, dtype,
                             batch * q1 * W, N, K, W)
    if measured is not None:
        measured.setdefault("EPILOGUE_SUBTILE", True)
        return measured
    return dict(_pinned_config(dtype, batch, q1, W, N, programs))


@functools.lru_cache(maxsize=256)
def _pinned_config(dtype: torch.dtype, batch: int, q1: int, W: int, N: int, programs: int) -> dict:
    """The pinned rule of :func:`gathered_persistent_config`, cached per shape: a pure function whose Python (the
    family's configs and the wave walk) would cost every call.  Callers copy the result."""
    chosen = fill_waves(dtype, batch * q1, N, "gathered_persistent", lambda c: chunk_tiles(c, batch, q1, W, N),
                        programs)
    # The split epilogue costs no shared memory and saves registers (the compile audit), so every pinned config
    # takes it.
    return dict(chosen, EPILOGUE_SUBTILE=True)


@functools.lru_cache(maxsize=256)
def _default_launch(dtype: torch.dtype, batch: int, q1: int, W: int, N: int, K: int,
                    device: torch.device) -> tuple[dict, int]:
    """``(meta, programs)`` of a launch without a config, cached per shape and device (callers never mutate it): a
    call pays one lookup, not the grid's size, the config's copies, the tile table and the tile count."""
    grid = persistent_programs(device)
    meta = gathered_persistent_config(dtype, batch, q1, W, N, grid, K=K, device_name=device_name(device))
    return meta, min(chunk_tiles(meta, batch, q1, W, N), grid)


def launch_gathered_persistent(x3: torch.Tensor, gathered: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, out: torch.Tensor, st, rank: int, world_size: int, n: int,
                               *, config: dict | None = None, checked: bool = False) -> dict:
    """Launch the persistent consumer; returns the launch meta (block sizes, ``programs``).

    ``x3`` ``[B_, len_p, K]`` and ``weight`` are checked by the caller
    (:func:`~distfuse.kernels.all_gather_matmul.gathered_matmul`), ``gathered`` is this rank's
    ``[B_ * n * K]`` workspace view, ``out`` the contiguous ``[B_, n, N]`` output.  ``config``
    may add ``PROGRAMS`` (the grid; default one per SM on CUDA, 2 under the interpreter).
    Raises :class:`~distfuse.errors.UnsupportedError` where :func:`gathered_persistent_supported`
    says no (the selector runs the pointer kernel for such operands); ``checked``: the caller's
    selector has just asked it about these operands (a hot path skips asking twice).
    """
    ok, why = (True, "") if checked else gathered_persistent_supported(x3, weight)
    if not ok:
        raise UnsupportedError(f"{where('gathered_matmul_persistent')}: tensor descriptors cannot read these "
                               f"operands: {why} (the selector, distfuse.kernels.gathered_matmul_select, runs the "
                               "pointer kernel for them)")
    W = world_size
    B, len_p, K = x3.shape
    N = weight.shape[0]
    q1 = cdiv(n, W)
    if config is None:  # the hot path: the launch geometry and its binding, cached per shape
        meta, programs = _default_launch(x3.dtype, B, q1, W, N, K, x3.device)
        bm, bk = meta["BLOCK_M"], meta["BLOCK_K"]
        g_desc = checked_descriptor(gathered, [B * n, K], [K, 1], [bm, bk])
        x_desc = rows_descriptor(x3, bm, bk) if len_p > 0 else g_desc
        b_desc, b_kmajor = weight_descriptor(weight, meta["BLOCK_N"], bk)
        key = (x3.dtype, B, n, len_p, W, N, K, x3.device, rank, b_kmajor, bias is None, out.dtype,
               input_precision(x3.dtype))  # fp32: torch's TF32 setting at this call, which a user may change
        bound = _BOUND.get(key) or _BOUND.keep(key, cached_launch(_gathered_matmul_persistent_kernel).bind(
            (programs,), (B, n, N, K, len_p, rank, W), _constexprs(meta, bias, b_kmajor, x3.dtype, out.dtype, W),
            split=7))
        bound(x_desc, g_desc, b_desc, bias if bias is not None else out, out, st.flags, st.status, st.epoch_dev,
              timeout_arg(st), bias.stride(0) if bias is not None else 0)
        return dict(meta, programs=programs)
    else:
        grid = persistent_programs(x3.device, config.get("PROGRAMS"))
        meta = gathered_persistent_config(x3.dtype, B, q1, W, N, grid, config)
        programs = min(chunk_tiles(meta, B, q1, W, N), grid)
    bm, bk = meta["BLOCK_M"], meta["BLOCK_K"]
    g_desc = checked_descriptor(gathered, [B * n, K], [K, 1], [bm, bk])  # K * itemsize % 16 == 0: supported
    # An empty shard has no tiles: it gets a descriptor that is never read.
    x_desc = rows_descriptor(x3, bm, bk) if len_p > 0 else g_desc
    b_desc, b_kmajor = weight_descriptor(weight, meta["BLOCK_N"], bk)
    cached_launch(_gathered_matmul_persistent_kernel)[(programs,)](
        x_desc, g_desc, b_desc, bias if bias is not None else out, out, st.flags, st.status,
        B, n, N, K, len_p, rank, W, st.epoch_dev, timeout_arg(st), bias.stride(0) if bias is not None else 0,
        **_constexprs(meta, bias, b_kmajor, x3.dtype, out.dtype, W),
    )
    return dict(meta, programs=programs)


#: The bound launches of :func:`launch_gathered_persistent`'s hot path (no ``config``), per shape, rank, weight
#: layout, bias and dtypes (:class:`~distfuse.kernels.launch_cache.BoundLaunch`).
_BOUND = BoundedMemo(512)


def _constexprs(meta: dict, bias, b_kmajor: bool, dtype: torch.dtype, out_dtype: torch.dtype, W: int) -> dict:
    """The consumer's constexprs and launch options: the launch meta's and those the operands decide."""
    return dict(HAS_BIAS=bias is not None, B_KMAJOR=b_kmajor, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(dtype),
                ROUND_BF16=round_bf16(out_dtype), TIMED=TIMED_WAITS, W_BLOCK=next_power_of_2(W), **meta)

