"""chunk_reduce, kernel floor: the consumer half of matmul_reduce_scatter, summing the W partials of this rank's chunk.

The producer (:func:`distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, or its
persistent and library-GEMM variants) stores every source's partial of chunk ``r`` into
owner ``r``'s workspace: W slots of ``[B_, len_r, N]`` in ``partial_dtype``, rows
:func:`slot_row_stride` elements apart, and raises ``flags[r, source]`` when a slot is
complete.  This module holds the other side, a pure bandwidth kernel: every program polls
the W flags of its chunk together (:func:`wait_all_flags`), then sums the W slots in fp32
in source order, adds the bias once and rounds once.  It lives apart from the producer
because several producers share it (the row-chunk and feature-chunk reduce-scatters, the
library-GEMM producer, the one-shot all-reduce), and the slot layout it reads is the
contract between them; :func:`launch_reduce` is the one launch all of them go through.

Built for the roofline (bytes moved per output element: W slot reads + 1 write, nothing
else; the bias is ``N`` elements, read from L2)::

    grid      PER_SM programs per SM, each with W * BLOCK * itemsize = 16 KB of loads in flight, at
              most one program per block: 48-128 KB per SM (:func:`~distfuse.kernels._utils.pinned_reduce_config`)
    layout    slot rows as wide as output rows (ld == N, every N % 16 == 0 width): one flat
              walk over B_ * len_r * N elements, BLOCK elements per program iteration,
              16-byte loads and stores (contiguous, BLOCK-aligned offsets); otherwise
              [BLOCK // BLOCK_C, BLOCK_C] row blocks (loads still 16-byte)
    loop      persistent grid stride: blocks pid, pid + P, ...; the flag poll and its CTA
              barrier are paid once per program, not once per block
    sums      W independent loads per block (unrolled: all in flight), fp32, source order

Synchronisation as in :mod:`distfuse.kernels.matmul_reduce_scatter`.  A flag that never
came poisons the chunk with NaN and the launcher raises on the status word (or, with
deferred status checks, the next claim of the workspace does, before any later op can use
the result).  Nothing in the launch reads device memory on the host.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import (
    CPU_CHUNK_REDUCE_CONFIG,
    INTERPRET,
    POLL_LOADS,
    POLL_LOADS_EXPLICIT,
    TIMED_WAITS,
    BoundedMemo,
    check_bias,
    claimed_rank_view,
    output_buffer,
    pinned_reduce_config,
    round_bf16,
    timeout_arg,
)
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import cast_out, globaltimer, poll_flags
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.persistent import persistent_programs
from distfuse.kernels.signature import (
    SCATTER_FLAGS,
    check_signatures,
    consumer_flags,
    peer_signatures,
    signatures_agree,
)
from distfuse.kernels.tile_table import device_name, measured_tile

__all__ = ["chunk_reduce", "reduce_slots", "launch_reduce", "reduce_meta", "slot_row_stride", "wait_all_flags"]


@triton.jit
def wait_all_flags(flags_ptr, W, W_BLOCK: tl.constexpr, epoch, status_ptr, timeout_ns, TIMED: tl.constexpr,
                   POLL_LOADS: tl.constexpr):
    """Poll the W flags ``flags_ptr[0:W]`` together until each equals ``epoch``; one CTA barrier; returns
    ``(all arrived, pending)``, ``pending`` the ``[W_BLOCK]`` mask of the sources whose flag never came.

    ``W <= W_BLOCK`` (a power of two).  One vector of acquire loads (system scope) per
    round, so a wait costs one round trip whatever W is, instead of W dependent waits each followed by a barrier (as
    :func:`~distfuse.kernels.jit_helpers.wait_flag` does for one flag).  The bound and the
    failure semantics are ``wait_flag``'s: ``TIMED`` (compiled) bounds the wait by
    ``%globaltimer``, untimed (interpreter) by ``timeout_ns`` extra rounds; every source
    whose flag never came gets ``epoch`` in its status word ``status_ptr[src]`` and the
    caller poisons its result.  Only flags still pending are reloaded.  ``POLL_LOADS``: acquire loads
    instead of acquire atomics (:func:`~distfuse.kernels.jit_helpers.poll_flags`).
    """
    offs = tl.arange(0, W_BLOCK)
    valid = offs < W
    val = poll_flags(flags_ptr, offs, valid, POLL_LOADS)
    pending = valid & (val != epoch)
    n_pending = tl.sum(pending.to(tl.int32), axis=0)
    if TIMED:
        start = globaltimer()
    waited = tl.full([], 0, tl.int64)  # nanoseconds (TIMED) or extra rounds; typed: a loop-carried value
    while (n_pending > 0) & (waited < timeout_ns):
        again = poll_flags(flags_ptr, offs, pending, POLL_LOADS)
        pending = pending & (again != epoch)
        n_pending = tl.sum(pending.to(tl.int32), axis=0)
        if TIMED:
            waited = globaltimer() - start
        else:
            waited += 1
    if n_pending > 0:
        tl.store(status_ptr + offs, tl.full([W_BLOCK], 0, tl.int32) + epoch, mask=pending)  # plain: see wait_flag
    # One barrier: every thread of the program reads the partials after the flags, not only those that polled.
    tl.debug_barrier()
    return n_pending == 0, pending


@triton.jit
def _sum_sources(slots_ptr, offs, mask, slot_elems, W_UNROLL: tl.constexpr):
    """fp32 sum over the W slots of the elements ``offs`` (slot-relative), in source order 0, 1, ..., W - 1.

    The W loads are independent (unrolled), so they are all in flight at once; slots are
    ``slot_elems`` apart, a multiple of 16 elements (rows padded to 16, see :func:`slot_row_stride`).
    """
    acc = tl.load(slots_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for src in tl.static_range(1, W_UNROLL):
        slot = slots_ptr + tl.multiple_of(slot_elems.to(tl.int64) * src, 16)
        acc += tl.load(slot + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _block(blk, n_rows, N, ld, num_c, FLAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Block ``blk`` of the output: ``(slot offsets, output offsets, mask, columns)`` in the layout of the module
    doc (``FLAT``: ``BLOCK`` consecutive elements; else ``[BLOCK // BLOCK_C, BLOCK_C]`` rows, ``num_c`` column
    blocks a row block).  The peeled first block and the loop find their blocks through it (a block past the
    last one is all masked)."""
    if FLAT:
        numel = n_rows.to(tl.int64) * N
        offs = blk * tl.full([], BLOCK, tl.int64) + tl.arange(0, BLOCK)  # int64: chunks may pass 2^31
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        return offs, offs, offs < numel, offs % N
    else:
        BLOCK_R: tl.constexpr = BLOCK // BLOCK_C
        offs_r = (blk // num_c).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = (blk % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_c = tl.max_contiguous(tl.multiple_of(offs_c, BLOCK_C), BLOCK_C)
        mask = (offs_r < n_rows)[:, None] & (offs_c < N)[None, :]
        return (offs_r[:, None] * tl.multiple_of(ld, 16) + offs_c[None, :], offs_r[:, None] * N + offs_c[None, :],
                mask, offs_c[None, :])


@triton.jit
def _store_block(acc, ok, out_ptr, bias_ptr, stride_bias, dst, mask, cols, N, HAS_BIAS: tl.constexpr,
                 ROUND_BF16: tl.constexpr):
    """``acc`` (the fp32 sums of one block; NaN unless ``ok``) plus the bias, rounded once into ``out``."""
    acc = tl.where(ok, acc, float("nan"))
    if HAS_BIAS:  # by column only (a row block's [1, BLOCK_C]; a flat block's columns are all < N)
        acc += tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, cast_out(acc, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit(do_not_specialize=["rank", "timeout", "slot_elems", "sig"])
def _chunk_reduce_kernel(
    slots_ptr, out_ptr, bias_ptr, flags_ptr, status_ptr, sigs_ptr,
    n_rows, N, ld, slot_elems, rank, epoch_ptr, timeout, stride_bias, sig,
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, TIMED: tl.constexpr, FLAT: tl.constexpr,
    CHECK_SIG: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, W_UNROLL: tl.constexpr,
    W_BLOCK: tl.constexpr, POLL_LOADS: tl.constexpr,
):
    """out[row, col] = sum over the W sources of slot[src][row, col] (fp32) + bias[col], on a persistent grid.

    ``W_UNROLL`` is W (a constexpr: the loads are unrolled), ``W_BLOCK`` the next power of
    two (the flag vector); ``POLL_LOADS``: poll the flags with acquire loads, not atomics; ``FLAT``:
    ``ld == N`` (the module doc's layouts; with ``N % 16 == 0`` known to the compiler, the flat
    walk's loads and stores are 16 bytes wide).  The W partials
    are added in source order whatever order the flags came in: the result is bitwise the
    same run to run and for every grid.  A source whose flag never came makes the whole
    chunk NaN.  ``CHECK_SIG``: the peers' signature words must equal ``sig``
    (:func:`~distfuse.kernels.signature.peer_signatures`), else the chunk is NaN too: the agreement check without
    a launch of its own.  The words are loaded right after the flag wait, then the program's first block's W
    loads are issued, then the words are compared: their round trip overlaps the first block's loads instead of
    preceding them.  Every program has a first block (the grid is at most one program per block).
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    ok, pending = wait_all_flags(flags_ptr + rank * W_UNROLL, W_UNROLL, W_BLOCK, epoch, status_ptr, timeout, TIMED,
                                 POLL_LOADS)
    num_c = tl.cdiv(N, BLOCK_C)
    if FLAT:
        num_blocks = tl.cdiv(n_rows.to(tl.int64) * N, BLOCK).to(tl.int32)
    else:
        num_blocks = tl.cdiv(n_rows, BLOCK // BLOCK_C) * num_c
    first = pid
    if CHECK_SIG:  # the first block by hand: its loads in flight while the words come
        got = peer_signatures(sigs_ptr, sig, pending, rank, W_UNROLL, W_BLOCK)
        src, dst, mask, cols = _block(pid, n_rows, N, ld, num_c, FLAT, BLOCK, BLOCK_C)
        acc = _sum_sources(slots_ptr, src, mask, slot_elems, W_UNROLL)
        ok = ok & signatures_agree(got, sig, status_ptr, pid == 0, W_BLOCK)
        _store_block(acc, ok, out_ptr, bias_ptr, stride_bias, dst, mask, cols, N, HAS_BIAS, ROUND_BF16)
        first = pid + num_progs
    for blk in range(first, num_blocks, num_progs):
        src, dst, mask, cols = _block(blk, n_rows, N, ld, num_c, FLAT, BLOCK, BLOCK_C)
        acc = _sum_sources(slots_ptr, src, mask, slot_elems, W_UNROLL)
        _store_block(acc, ok, out_ptr, bias_ptr, stride_bias, dst, mask, cols, N, HAS_BIAS, ROUND_BF16)


#: The launches of :func:`_chunk_reduce_kernel`, through its binary once the JIT has chosen it (:mod:`.launch_cache`).
_CHUNK_REDUCE = cached_launch(_chunk_reduce_kernel)


def slot_row_stride(N: int) -> int:
    """Row stride of a slot: ``N`` padded to 16 elements, so every row starts 16-element aligned
    and the GEMM's remote stores can be 16 bytes wide."""
    return -(-N // 16) * 16


def reduce_meta(rows: int, cols: int, ld: int, partial_dtype: torch.dtype, world_size: int,
                config: dict | None = None) -> dict:
    """Launch meta of one reduction: ``BLOCK``, ``BLOCK_C``, ``FLAT``, ``PER_SM``, ``num_warps``, ``POLL_LOADS``
    (and ``PROGRAMS`` if ``config`` gives it).

    ``config`` (tests, the diagnosis): ``BLOCK`` and optionally ``PROGRAMS``, ``num_warps``, ``POLL_LOADS`` (default
    :data:`~distfuse.kernels._utils.POLL_LOADS`; always False under the interpreter).  Otherwise the
    pinned config of the partials' dtype and the world size
    (:func:`~distfuse.kernels._utils.pinned_reduce_config`; never autotuned: one rule on every
    rank), or the CPU config under the interpreter.
    """
    if config is not None:
        meta = dict(config)
    elif INTERPRET:
        meta = dict(CPU_CHUNK_REDUCE_CONFIG)
    else:
        meta = pinned_reduce_config(rows * cols, partial_dtype, world_size)
    meta.setdefault("num_warps", 4)
    meta.setdefault("PER_SM", 1)
    meta["POLL_LOADS"] = bool(meta.get("POLL_LOADS", POLL_LOADS)) and not INTERPRET  # inline PTX: compiled only
    meta["FLAT"] = ld == cols
    meta["BLOCK_C"] = min(256, next_power_of_2(max(cols, 1)), meta["BLOCK"])
    return meta


def launch_reduce(op: str, st, slots: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, rows: int,
                  cols: int, ld: int, slot_elems: int, rank: int, world_size: int, *,
                  config: dict | None = None, sig: int | None = None) -> dict:
    """Sum the W slots ``[rows, cols]`` (rows ``ld`` apart, slots ``slot_elems`` apart) into ``out``; returns the meta.

    The one launch of :func:`_chunk_reduce_kernel` (``chunk_reduce``, ``column_reduce`` and
    the one-shot all-reduce).  The caller has checked ``out`` (contiguous ``[rows, cols]``)
    and ``bias`` (``[cols]``), and reads the status words afterwards.  ``rows * cols == 0``
    launches nothing.  The launch geometry comes from :func:`reduce_plan` (cached per shape
    without ``config``), so a steady call spends its host time on the launch itself.
    ``sig``: also compare the peers' published signature words with it (``CHECK_SIG``).
    """
    if config is None and rows * cols > 0:  # the hot path: one lookup, then the bound launch
        key = (rows, cols, ld, slots.dtype, world_size, out.device, slot_elems, rank, bias is None, out.dtype,
               sig is None)
        hit = _BOUND.get(key)
        if hit is None:
            meta, kw, programs = reduce_plan(rows, cols, ld, slots.dtype, world_size, out.device)
            hit = _BOUND.keep(key, (dict(meta, programs=programs), _CHUNK_REDUCE.bind(
                (programs,), (rows, cols, ld, slot_elems, rank), _reduce_constexprs(kw, bias, out, sig, world_size),
                split=6)))
        hit[1](slots, out, bias if bias is not None else out, st.flags, st.status, st.sigs, st.epoch_dev,
               timeout_arg(st), bias.stride(0) if bias is not None else 0, sig if sig is not None else 0)
        return hit[0]
    if config is None:
        meta, kw, programs = reduce_plan(rows, cols, ld, slots.dtype, world_size, out.device)
    else:
        meta, kw, programs = _reduce_plan(rows, cols, ld, slots.dtype, world_size, out.device, config)
    if rows * cols == 0:
        return meta
    _CHUNK_REDUCE[(programs,)](
        slots, out, bias if bias is not None else out, st.flags, st.status, st.sigs,
        rows, cols, ld, slot_elems, rank, st.epoch_dev, timeout_arg(st), bias.stride(0) if bias is not None else 0,
        sig if sig is not None else 0, **_reduce_constexprs(kw, bias, out, sig, world_size),
    )
    return dict(meta, programs=programs)


#: The bound launches of :func:`launch_reduce`'s hot path (no ``config``), per shape, rank, slot spacing and the
#: dtypes and flags its constexprs depend on: ``(meta returned, BoundLaunch)``.  A call pays one lookup and the
#: fingerprint of its buffers, not the plan's, the constexprs' and the scalars' again.
_BOUND = BoundedMemo(1024)


def _reduce_constexprs(kw: dict, bias: torch.Tensor | None, out: torch.Tensor, sig: int | None,
                       world_size: int) -> dict:
    """The constexprs and launch options of one reduction: the plan's ``kw`` and those the call's operands decide."""
    return dict(HAS_BIAS=bias is not None, ROUND_BF16=round_bf16(out.dtype), TIMED=TIMED_WAITS,
                CHECK_SIG=sig is not None, W_UNROLL=world_size, W_BLOCK=next_power_of_2(world_size), **kw)


def _reduce_plan(rows: int, cols: int, ld: int, partial_dtype: torch.dtype, world_size: int, device: torch.device,
                 config: dict | None) -> tuple[dict, dict, int]:
    """``(meta, kernel kwargs, programs)`` of one reduction (see :func:`reduce_meta`)."""
    meta = reduce_meta(rows, cols, ld, partial_dtype, world_size, config)
    kw = {k: v for k, v in meta.items() if k not in ("PER_SM", "PROGRAMS")}
    if meta["FLAT"]:
        blocks = cdiv(rows * cols, meta["BLOCK"])
    else:
        blocks = cdiv(rows, meta["BLOCK"] // meta["BLOCK_C"]) * cdiv(cols, meta["BLOCK_C"])
    programs = min(blocks, persistent_programs(device, meta.get("PROGRAMS"), per_sm=meta["PER_SM"]))
    return meta, kw, programs


@functools.lru_cache(maxsize=1024)
def reduce_plan(rows: int, cols: int, ld: int, partial_dtype: torch.dtype, world_size: int,
                device: torch.device) -> tuple[dict, dict, int]:
    """:func:`_reduce_plan` with the measured config of this device and shape
    (:func:`~distfuse.kernels.tile_table.measured_tile`: ``BLOCK``, ``PER_SM``, ``num_warps``, and the flag poll
    ``POLL_LOADS`` where the measurement chose it, unless ``DISTFUSE_FLAG_POLL`` is set) or else the pinned one,
    cached per shape: a pure function of its arguments (the tables, the pinned rule and the SM count), whose
    Python would otherwise cost every call.  Callers must not mutate the result."""
    measured = None if INTERPRET else measured_tile("chunk_reduce", _chunk_reduce_kernel, device_name(device),
                                                    partial_dtype, rows * world_size, cols, 0, world_size)
    if measured is not None and POLL_LOADS_EXPLICIT:
        measured.pop("POLL_LOADS", None)  # the user's setting decides the poll
    return _reduce_plan(rows, cols, ld, partial_dtype, world_size, device, measured)


def reduce_slots(op: str, ws, rank: int, world_size: int, shape: tuple, ld: int, *, partial_dtype: torch.dtype,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, out: torch.Tensor | None, config: dict | None,
                 what: str, shape_name: str, slot_elems: int | None = None,
                 agreement: tuple[int, str] | None = None) -> torch.Tensor:
    """Consume: sum the W slots of this rank's data region into ``shape`` (``[..., cols]``); returns the output.

    Slot rows are ``ld`` apart, slots ``slot_elems`` apart (default: the rows of ``shape``
    times ``ld``); :func:`launch_reduce` waits ``flags[rank, src]`` of every source and sums
    the slots and ``bias [cols]`` as the module doc says.  ``what`` names the partials in the
    error, ``shape_name`` the output's shape.

    ``agreement``: ``(sig, description of this rank's call)``; the kernel also checks that every
    peer published ``sig`` (:mod:`distfuse.kernels.signature`; the flags it waits on are the
    reduce-scatter layout's), in place of a separate
    :func:`~distfuse.kernels.signature.check_signatures` launch and status check.  An empty
    output launches no kernel, so it takes the separate check: every rank still raises.
    """
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    out = output_buffer(op, out, shape, out_dtype, ws.device, shape_name)
    check_bias(op, bias, cols, ws.device)
    slot_elems = rows * ld if slot_elems is None else slot_elems
    slots = st.data(partial_dtype, world_size * slot_elems, op=op, cached=True)
    st.wait_producers()  # collective on CPU: every rank calls it, even with nothing to reduce
    sig, sig_what = agreement if agreement is not None else (None, None)
    if world_size == 1:
        sig = None  # no peer to agree with
    if out.numel() > 0:
        launch_reduce(op, st, slots, out, bias, rows, cols, ld, slot_elems, rank, world_size, config=config, sig=sig)
        st.check_status(op, what, sig_what)
    elif sig is not None:
        check_signatures(ws, rank, world_size, sig, out, **consumer_flags(SCATTER_FLAGS, rank, world_size), op=op,
                         what=sig_what)
    return out


def chunk_reduce(ws, rank: int, world_size: int, batch: int, n: int, N: int, *, partial_dtype: torch.dtype,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None, config: dict | None = None,
                 agreement: tuple[int, str] | None = None) -> torch.Tensor:
    """Consume: sum the W partial slots of this rank's chunk (fp32), add ``bias`` once, round once.

    Args:
        ws, rank, world_size: as for :func:`matmul_scatter` (same claim).
        batch, n, N: B_, the full sequence extent and the output features of the GEMM.
        partial_dtype: the dtype :func:`matmul_scatter` wrote (``a.dtype`` unless overridden).
        bias: optional ``[N]``.
        out_dtype: output dtype (default ``partial_dtype``).
        out: optional preallocated contiguous ``[..., len_rank, N]`` output (``batch`` rows of ``len_rank``).
        config: explicit ``BLOCK`` (and ``PROGRAMS``, ``num_warps``), for tests; default the pinned config.
        agreement: ``(sig, what)``: check the peers' signature words in the same kernel (:func:`reduce_slots`).

    Returns:
        ``[batch, len_rank, N]`` with ``len_rank = block_extent(n, W, rank)``.
    """
    ld = slot_row_stride(N)
    return reduce_slots("chunk_reduce", ws, rank, world_size, (batch, block_extent(n, world_size, rank), N), ld,
                        partial_dtype=partial_dtype, bias=bias, out_dtype=out_dtype or partial_dtype, out=out,
                        config=config, what=f"partials of chunk {rank}", shape_name="[..., len_rank, N]",
                        slot_elems=batch * cdiv(n, world_size) * ld, agreement=agreement)
