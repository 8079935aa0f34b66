"""matmul_reduce_scatter's second producer: library GEMMs, per chunk into its owner's slot, or whole then scattered.

Chunks of at least ``CUBLAS_WHOLE_ROWS`` rows (128): the design of torch's async tensor parallelism,
on distfuse's workspaces::

    a       [B_, n, K]   this rank's input;  weight [N, K]
    for step in 0 .. W-1 (chunk c = (rank + 1 + step) % W; the own chunk last):
        torch.matmul(a[:, start_c:stop_c], weight.T, out=<owner c's slot for this rank>)   [B_, len_c, N]
    raise every owner's flag [c, rank] = epoch, one launch, in stream order after the last GEMM
    then chunk_reduce on every rank (the same consumer as the Triton producers)

One flag launch, not one after each chunk's GEMM: each was a dependent launch between two
GEMMs, and every rank's ``chunk_reduce`` runs after its own producer on the same stream, so a
flag raised before a source's last GEMM helped only an owner running ahead of that source.
On the H200 at ``a6bfa8c`` (LLaMA-3 8B, M = 8192, TP 8) the eight chunk GEMMs with eight flag
launches took 197 us graph-timed and 426 us eager against 157 us for cuBLAS's whole GEMM.

Shorter chunks (:func:`~distfuse.kernels.matmul_scatter_select.cublas_whole`; LLaMA-3 at TP 8 and
M = 512: 64 rows): one GEMM of every row into a local ``[B_, n, N]`` partial, then
:func:`~distfuse.kernels.scatter_partial.scatter_partial` copies each row into its owner's slot and
raises the flags, one launch.  A chunk GEMM shorter than the library's row tile is tile-quantised,
and W of them cost W launches; the whole GEMM costs cuBLAS's time for the shape plus a copy of
its output.

The GEMM is cuBLAS on CUDA, so this provider wins where the Triton GEMMs lose to the
library (small chunks, shapes the pinned tiles fit badly); per chunk its cost is W GEMM
launches and no overlap of a chunk's GEMM with its own stores.  The slot view is the owner's
memory, checked (:mod:`distfuse.fused.peer_views`), so a GEMM can never write a silent copy.
Flags: :func:`raise_every_chunk_flag`, in stream order after the GEMMs on CUDA (no host
sync); on CPU the consumer's host barrier orders the host writes before the reads.
Precision: fp32 partials of 16-bit inputs use cuBLAS's fp32 output (``out_dtype``) on
CUDA, an fp32 GEMM of the upcast operands on CPU: one rounding, like the Triton producer.
"""

from __future__ import annotations

import math

import torch

from distfuse.fused.peer_views import peer_data, peer_flag
from distfuse.geometry.decomposition import block_range
from distfuse.kernels._utils import check_producer_args, claimed_rank_view
from distfuse.kernels.chunk_flag import raise_every_chunk_flag_kernel
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.matmul_reduce_scatter import slot_row_stride
from distfuse.kernels.matmul_scatter_select import cublas_whole
from distfuse.kernels.scatter_partial import scatter_partial

__all__ = ["matmul_scatter_cublas", "raise_every_chunk_flag"]


def raise_every_chunk_flag(view, rank: int) -> None:
    """Raise every owner's flag ``[c, rank]`` to the op's epoch: stream-ordered on CUDA, host writes on CPU.

    On CUDA one one-program Triton kernel (:mod:`distfuse.kernels.chunk_flag`) stores the
    device epoch with a system-scope release per owner, read when it executes, so a CUDA graph
    replay raises the replay's epoch.
    """
    W = view.world_size
    if view.device.type == "cuda":
        cached_launch(raise_every_chunk_flag_kernel)[(1,)](view.flag_ptrs, W, rank, view.epoch_dev)
        return
    for chunk in range(W):
        peer_flag(view, chunk, chunk, rank).copy_(view.epoch_dev)


def _whole_gemm(a3: torch.Tensor, weight: torch.Tensor, partial_dtype: torch.dtype) -> torch.Tensor:
    """``a3 @ weight.T`` as a new contiguous ``[B_, n, N]`` tensor in ``partial_dtype``, rounded once (the whole-GEMM
    schedule's partial: no copy into a buffer of its own; the per-chunk schedule copies it into a slot where the
    dtypes differ)."""
    if partial_dtype == a3.dtype:
        return torch.matmul(a3, weight.t())
    if a3.device.type == "cuda" and partial_dtype == torch.float32 and a3.shape[0] > 0:
        try:  # cuBLAS: 16-bit operands, fp32 output (one entry, the common case, without a stacking copy)
            parts = [torch.mm(a3[b], weight.t(), out_dtype=torch.float32) for b in range(a3.shape[0])]
            return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=): the upcast GEMM below
            pass
    return torch.matmul(a3.to(torch.float32), weight.t().to(torch.float32)).to(partial_dtype)


def matmul_scatter_cublas(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                          partial_dtype: torch.dtype | None = None, whole: bool | None = None) -> None:
    """Produce, like :func:`distfuse.kernels.matmul_reduce_scatter.matmul_scatter` (its arguments but ``config``),
    with library GEMMs: one per chunk, or one of every row, then one scatter launch (``whole``; default
    :func:`~distfuse.kernels.matmul_scatter_select.cublas_whole` of the shape, which every rank computes alike).

    Writes the same slots and raises the same flags as the Triton producers; finish with
    :func:`~distfuse.kernels.matmul_reduce_scatter.chunk_reduce` on every rank.
    """
    op = "matmul_scatter_cublas"
    partial_dtype = check_producer_args(op, a, weight, partial_dtype)
    st = claimed_rank_view(op, ws, rank, world_size, a.device)
    W = world_size
    n, K, N = a.shape[-2], a.shape[-1], weight.shape[0]
    a3 = a.reshape(math.prod(a.shape[:-2]), n, K)
    B = a3.shape[0]
    ld = slot_row_stride(N)
    q1 = -(-n // W)
    slot_elems = B * q1 * ld
    st.data(partial_dtype, W * slot_elems, op=op)  # checks the capacity, the same on every rank
    if cublas_whole(n, W) if whole is None else whole:  # short chunks: one GEMM of every row, then one scatter
        scatter_partial(_whole_gemm(a3, weight, partial_dtype), ws, rank, W)
        return
    for step in range(W):
        chunk = (rank + 1 + step) % W
        start, stop = block_range(n, W, chunk)
        if stop > start and N > 0 and B > 0:
            slot = peer_data(st, chunk, partial_dtype, slot_elems, rank * slot_elems * partial_dtype.itemsize)
            L = stop - start
            dst = slot[: B * L * ld].view(B, L, ld)[:, :, :N]  # the slot holds [B_, len_c] rows, ld apart
            if K == 0:
                dst.zero_()
            elif partial_dtype == a.dtype:
                torch.matmul(a3[:, start:stop], weight.t(), out=dst)  # straight into the owner's slot
            else:
                dst.copy_(_whole_gemm(a3[:, start:stop], weight, partial_dtype))
    raise_every_chunk_flag(st, rank)  # one launch after the last GEMM (see the module doc)
