"""chunk_reduce, kernel floor: the consumer half of matmul_reduce_scatter, summing the W partials of this rank's chunk.

The producer (:func:`distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, or its
persistent and library-GEMM variants) stores every source's partial of chunk ``r`` into
owner ``r``'s workspace: W slots of ``[B_, len_r, N]`` in ``partial_dtype``, rows
:func:`slot_row_stride` elements apart, and raises ``flags[r, source]`` when a slot is
complete.  This module holds the other side: one persistent grid that polls the W flags
of its chunk together (:func:`wait_all_flags`), then sums the W slots in fp32 in source
order, adds the bias once and rounds once.  It lives apart from the producer because
several producers share it (the row-chunk and feature-chunk reduce-scatters, the
library-GEMM producer), and the slot layout it reads is the contract between them.

Synchronisation: on CUDA the consumer spins on the flags (bounded by the workspace
timeout); on CPU (``/dev/shm`` + interpreter) a host barrier orders producers before the
consumer and the consumer checks each flag once.  A flag that never came poisons the
chunk with NaN and the launcher raises on the status word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import (
    AUTOTUNE,
    CPU_CHUNK_REDUCE_CONFIG,
    TIMED_WAITS,
    check_bias,
    claimed_rank_view,
    config_of,
    get_chunk_reduce_configs,
    output_buffer,
    pick_launch,
    round_bf16,
    timeout_arg,
    ws_may_tune,
)
from distfuse.kernels.jit_helpers import cast_out, globaltimer
from distfuse.kernels.persistent import persistent_programs

__all__ = ["chunk_reduce", "slot_row_stride", "wait_all_flags"]


@triton.jit
def wait_all_flags(flags_ptr, W, W_BLOCK: tl.constexpr, epoch, status_ptr, timeout_ns, TIMED: tl.constexpr):
    """Poll the W flags ``flags_ptr[0:W]`` together until each equals ``epoch``; one CTA barrier; all arrived?

    ``W <= W_BLOCK`` (a power of two).  One vector of acquire loads (system scope) per
    round, so a wait costs one round trip whatever W is, instead of W dependent waits each followed by a barrier (as
    :func:`~distfuse.kernels.jit_helpers.wait_flag` does for one flag).  The bound and the
    failure semantics are ``wait_flag``'s: ``TIMED`` (compiled) bounds the wait by
    ``%globaltimer``, untimed (interpreter) by ``timeout_ns`` extra rounds; every source
    whose flag never came gets ``epoch`` in its status word ``status_ptr[src]`` and the
    caller poisons its result.  Only flags still pending are reloaded.
    """
    offs = tl.arange(0, W_BLOCK)
    valid = offs < W
    val = tl.atomic_add(flags_ptr + offs, 0, mask=valid, sem="acquire", scope="sys")
    pending = valid & (val != epoch)
    n_pending = tl.sum(pending.to(tl.int32), axis=0)
    if TIMED:
        start = globaltimer()
        elapsed = tl.full([], 0, tl.int64)
        while (n_pending > 0) & (elapsed < timeout_ns):
            again = tl.atomic_add(flags_ptr + offs, 0, mask=pending, sem="acquire", scope="sys")
            pending = pending & (again != epoch)
            n_pending = tl.sum(pending.to(tl.int32), axis=0)
            elapsed = globaltimer() - start
    else:
        spins = tl.full([], 0, tl.int64)  # a typed loop-carried counter
        while (n_pending > 0) & (spins < timeout_ns):
            again = tl.atomic_add(flags_ptr + offs, 0, mask=pending, sem="acquire", scope="sys")
            pending = pending & (again != epoch)
            n_pending = tl.sum(pending.to(tl.int32), axis=0)
            spins += 1
    if n_pending > 0:
        tl.atomic_xchg(status_ptr + offs, tl.full([W_BLOCK], 0, tl.int32) + epoch, mask=pending)
    # One barrier: every thread of the program reads the partials after the flags, not only those that polled.
    tl.debug_barrier()
    return n_pending == 0


@triton.jit(do_not_specialize=["rank", "timeout", "slot_elems"])
def _chunk_reduce_kernel(
    slots_ptr, out_ptr, bias_ptr, flags_ptr, status_ptr,
    n_rows, N, ld, slot_elems, rank, W, epoch_ptr, timeout, stride_bias,
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, TIMED: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr, W_UNROLL: tl.constexpr = 0, W_BLOCK: tl.constexpr = 128,
):
    """out[row, col] = sum over sources of slot[src][row, col] (fp32) + bias[col]: a persistent grid of programs.

    Slot rows are ``ld`` elements apart (N padded to 16 elements, see
    :func:`slot_row_stride`), output rows ``N``: blocks of ``BLOCK // BLOCK_C`` rows by
    ``BLOCK_C`` columns keep both sides contiguous, so loads and stores are vectorised.

    Each program first polls all W flags of its chunk at once and passes one barrier
    (:func:`wait_all_flags`; ``W_BLOCK`` >= W, a power of two), then walks the blocks
    ``pid, pid + num_programs, ...``; per block the W partial tiles are W independent loads
    summed in the fixed order src = 0, 1, ..., W - 1, whatever order the flags came in: the
    result is bitwise the same run to run.  ``W_UNROLL`` = W (a constexpr) unrolls the
    loads so they are all in flight at once; 0 keeps a runtime loop over W (same sums).  The grid is at most the
    GPU's SM count, so the flags are polled once per SM rather than once per block.
    If a source's flag never came (the wait timed out) the whole chunk is NaN, so it can
    never pass for a good one; the launcher raises on the status word.
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    BLOCK_R: tl.constexpr = BLOCK // BLOCK_C
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_c = tl.cdiv(N, BLOCK_C)
    num_blocks = tl.cdiv(n_rows, BLOCK_R) * num_c
    ok = wait_all_flags(flags_ptr + rank * W, W, W_BLOCK, epoch, status_ptr, timeout, TIMED)
    for blk in range(pid, num_blocks, num_progs):
        offs_r = (blk // num_c).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = (blk % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (offs_r < n_rows)[:, None] & (offs_c < N)[None, :]
        src_offs = offs_r[:, None] * tl.multiple_of(ld, 16) + offs_c[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        if W_UNROLL > 0:
            for src in tl.static_range(W_UNROLL):
                slot = slots_ptr + tl.multiple_of(slot_elems.to(tl.int64) * src, 16)  # ld-padded slots: 16-aligned
                acc += tl.load(slot + src_offs, mask=mask, other=0.0).to(tl.float32)
        else:
            for src in range(0, W):
                slot = slots_ptr + tl.multiple_of(slot_elems.to(tl.int64) * src, 16)
                acc += tl.load(slot + src_offs, mask=mask, other=0.0).to(tl.float32)
        acc = tl.where(ok, acc, float("nan"))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c * stride_bias, mask=offs_c < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_r[:, None] * N + offs_c[None, :], cast_out(acc, out_ptr.dtype.element_ty, ROUND_BF16),
                 mask=mask)


# Autotuner (CUDA, loopback ops only: see pinned_gemm_config).
_chunk_reduce_tuned = triton.autotune(get_chunk_reduce_configs(), key=["n_rows", "N", "W"])(_chunk_reduce_kernel) \
    if AUTOTUNE else None


def slot_row_stride(N: int) -> int:
    """Row stride of a slot: ``N`` padded to 16 elements, so every row starts 16-element aligned
    and the GEMM's remote stores can be 16 bytes wide."""
    return -(-N // 16) * 16



def chunk_reduce(ws, rank: int, world_size: int, batch: int, n: int, N: int, *, partial_dtype: torch.dtype,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Consume: sum the W partial slots of this rank's chunk (fp32), add ``bias`` once, round once.

    Args:
        ws, rank, world_size: as for :func:`matmul_scatter` (same claim).
        batch, n, N: B_, the full sequence extent and the output features of the GEMM.
        partial_dtype: the dtype :func:`matmul_scatter` wrote (``a.dtype`` unless overridden).
        bias: optional ``[N]``.
        out_dtype: output dtype (default ``partial_dtype``).
        out: optional preallocated contiguous ``[..., len_rank, N]`` output (``batch`` rows of ``len_rank``).

    Returns:
        ``[batch, len_rank, N]`` with ``len_rank = block_extent(n, W, rank)``.
    """
    op = "chunk_reduce"
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    W = world_size
    out_dtype = out_dtype or partial_dtype
    len_r = block_extent(n, W, rank)
    out = output_buffer(op, out, (batch, len_r, N), out_dtype, ws.device, "[..., len_rank, N]")
    check_bias(op, bias, N, ws.device)
    ld = slot_row_stride(N)
    slot_elems = batch * (-(-n // W)) * ld
    slots = st.data(partial_dtype, W * slot_elems, op=op)
    st.wait_producers()  # collective on CPU: every rank calls it, even with an empty chunk
    numel = out.numel()
    if numel > 0:
        kernel, meta = pick_launch(_chunk_reduce_tuned, _chunk_reduce_kernel, CPU_CHUNK_REDUCE_CONFIG,
                                   config_of(get_chunk_reduce_configs(), 1), config, may_tune=ws_may_tune(ws))
        n_rows = batch * len_r
        block_c = min(256, triton.next_power_of_2(N), meta.get("BLOCK", 1024))

        programs = persistent_programs(ws.device, meta.pop("PROGRAMS", None))

        def grid(META):
            blocks = triton.cdiv(n_rows, META["BLOCK"] // block_c) * triton.cdiv(N, block_c)
            return (min(blocks, programs),)

        kernel[grid](
            slots, out, bias if bias is not None else out, st.flags, st.status,
            n_rows, N, ld, slot_elems, rank, W, st.epoch_dev, timeout_arg(st),
            bias.stride(0) if bias is not None else 0,
            HAS_BIAS=bias is not None, ROUND_BF16=round_bf16(out_dtype), TIMED=TIMED_WAITS, BLOCK_C=block_c,
            W_UNROLL=W, W_BLOCK=triton.next_power_of_2(W), **meta,
        )
        st.check_status(op, f"partials of chunk {rank}")
    return out
