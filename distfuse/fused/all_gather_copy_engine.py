"""all_gather_matmul's second push: the shard copied into every peer by the copy engines, on a side stream.

The Triton push (:func:`~distfuse.kernels.all_gather_matmul.ag_push`) runs on the op's
stream and finishes before the GEMM starts.  This push overlaps the GEMM instead::

    a_shard [B_, len_r, K]   this rank's rows [start_r, stop_r) of the gathered [B_, n, K]
    side stream (waits for the op's stream: the shard's producer and the claim's barrier)
        for j in 1 .. W-1 (peer = (rank + j) % W, the order the GEMMs consume in):
            peer's gathered[b, start_r:stop_r] <- a_shard[b]   one DMA per batch entry  [len_r, K]
            peer's flags[rank, rank] <- the device epoch        a 4-byte DMA, after the copies
    op's stream: gathered_matmul: the local chunk first (no wait), then each peer chunk as its flag lands
    end of the claim: the op's stream waits for the side stream (an event)

Why the copy engines.  The copies are ``copy_`` between contiguous rows of two CUDA
tensors, which torch issues as ``cudaMemcpyAsync``: the DMA engines move the bytes over
NVLink and no SM is taken from the GEMM.  The flag is a 4-byte ``copy_`` of the
workspace's device epoch, so it too needs no SM.  That matters for correctness, not only
speed: the GEMM's programs of the peer chunks spin on the flags, and a grid of spinning
programs may fill every SM; a push or flag *kernel* on the side stream could then wait
for an SM that only the peers' flags free, and each GPU would wait on the other until
the flag wait times out.  A copy-engine operation never waits for an SM.  Stream order
puts the flag after the chunk's copies, and the DMA engine completes a copy (its bytes
in the peer's memory) before the next operation of the stream starts.
``torch.ops.symm_mem.stream_write_value32_`` (a stream memory operation with a fence)
would also do, but its value is fixed when it is issued, so a captured CUDA graph would
replay a stale epoch; the 4-byte copy reads the device epoch when it executes.

Batches: one DMA per batch entry and peer (``B_ * (W - 1)`` copies; a strided copy would
be an SM kernel, see above), so this push suits few leading entries with many rows each.

Streams (CUDA).  The side stream waits for the op's stream before the first copy; the
shard is ``record_stream``-ed on the side stream so that the caching allocator does not
hand its memory out while the DMA may still read it; the claim ends with the op's stream
waiting for an event recorded after the last flag
(:meth:`~distfuse.fused.workspace._Workspace.track_side_stream`), so the next claim's
barrier, and any op after it, comes after the push; a CUDA graph capture forks into the
side stream and joins it back the same way.

CPU (``/dev/shm`` and loopback): the "side stream" is the host, in order: each copy
into the peer's mapping, then its flag (the device epoch copied into the flag word);
the consumer's host barrier (:meth:`RankBuffers.wait_producers`) orders them before the
reads.  Not timed on a GPU yet.
"""

from __future__ import annotations

import torch

from distfuse.fused.matmul_reduce_scatter_cublas import peer_flag, peer_tensor
from distfuse.geometry.decomposition import block_range
from distfuse.kernels._utils import claimed_rank_view
from distfuse.kernels.all_gather_matmul import _shard3

__all__ = ["ag_push_copy_engine", "side_stream"]


def side_stream(ws) -> torch.cuda.Stream:
    """The workspace's side stream for copy-engine pushes (created on first use, one per workspace)."""
    stream = getattr(ws, "_copy_stream", None)
    if stream is None:
        stream = ws._copy_stream = torch.cuda.Stream(device=ws.device)
    return stream


def _push_rows(x: torch.Tensor, view, rank: int, W: int, n: int) -> None:
    """Copy ``x`` ``[B_, len_r, K]`` into every peer's gathered rows, each peer's flag right after its rows."""
    B, len_r, K = x.shape
    start = block_range(n, W, rank)[0]
    for j in range(1, W):
        peer = (rank + j) % W
        if B * len_r * K:
            gathered = peer_tensor(view, peer, x.dtype, B * n * K).view(B, n, K)
            for b in range(B):  # contiguous rows on both sides: one memcpy (DMA) each
                gathered[b, start: start + len_r].copy_(x[b], non_blocking=True)
        peer_flag(view, peer, rank, rank).copy_(view.epoch_dev, non_blocking=True)


def ag_push_copy_engine(a_shard: torch.Tensor, ws, rank: int, world_size: int, n: int) -> None:
    """Produce like :func:`~distfuse.kernels.all_gather_matmul.ag_push`: the same rows and flags, by DMA.

    Args:
        a_shard: ``[..., len_rank, K]``, block ``rank`` of the balanced decomposition of ``n``.
        ws: the workspace, claimed (``ws.in_flight``), with
            :func:`~distfuse.kernels.all_gather_matmul.gathered_matmul_workspace_bytes` of data.
        rank, world_size: this rank and the group size (virtual rank in loopback).
        n: the full extent of the gathered dim.

    On CUDA the copies run on the workspace's side stream and overlap the GEMM that
    :func:`~distfuse.kernels.all_gather_matmul.gathered_matmul` then issues on the op's
    stream (see the module doc); on CPU they run on the host before it returns.
    """
    op = "ag_push_copy_engine"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    x = _shard3(op, a_shard, n, rank, W)
    if x.numel() and not x.is_contiguous():
        x = x.contiguous()  # rows must be contiguous for one DMA each (on the op's stream, before the fork)
    st.data(x.dtype, x.shape[0] * n * x.shape[2], op=op)  # the capacity, the same on every rank
    if W == 1:
        return
    if x.device.type != "cuda":
        _push_rows(x, st, rank, W, n)
        return
    side = side_stream(ws)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        _push_rows(x, st, rank, W, n)
    x.record_stream(side)
    if getattr(ws, "backend", None) == "loopback":
        # Loopback consumers check each flag once (every producer ran earlier on their stream): join now.
        torch.cuda.current_stream(x.device).wait_stream(side)
    else:
        ws.track_side_stream(side)
