"""all_gather_matmul's second push: the shard copied into every peer by the copy engines, on a side stream.

The Triton push (:func:`~distfuse.kernels.all_gather_matmul.ag_push`) runs on the op's
stream and finishes before the GEMM starts.  This push overlaps the GEMM instead::

    a_shard [B_, len_r, K]   this rank's rows [start_r, stop_r) of the gathered [B_, n, K]
    side stream j, one per peer (each waits for the op's stream: the shard's producer, the claim's barrier)
        peer = (rank + j) % W, j = 1 .. W-1 (the order the GEMMs consume in):
            peer's gathered[b, start_r:stop_r] <- a_shard[b]   one DMA per batch entry  [len_r, K]
            peer's flags[rank, rank] <- the device epoch        a 4-byte DMA, after the copies
    op's stream: gathered_matmul: the local chunk first (no wait), then each peer chunk as its flag lands
    end of the claim: the op's stream waits for every side stream (one event each)

One stream per peer, so the W - 1 pushes go out together (one link and DMA engine per
peer on an NVLink node).  Batches: one DMA per batch entry and peer (a strided copy would
be an SM kernel), so this push suits few leading entries with many rows each.

Why the copy engines.  ``copy_`` between contiguous rows of two CUDA tensors is a
``cudaMemcpyAsync``: no SM is taken from the GEMM, and the flag (a 4-byte ``copy_`` of
the workspace's device epoch) needs none either.  That matters for correctness: the
GEMM's programs spin on the flags and may fill every SM, so a push or flag *kernel* on
the side stream could wait for an SM that only the peers' flags free, a deadlock until
the flag wait times out.  Stream order puts the flag after the chunk's copies.
``torch.ops.symm_mem.stream_write_value32_`` would fix its value when issued, so a
captured CUDA graph would replay a stale epoch; the 4-byte copy reads the device epoch
when it executes.

Streams (CUDA).  The shard is ``record_stream``-ed on every side stream (the caching
allocator must not hand its memory out while a DMA may read it); the claim ends with the
op's stream waiting for an event after each stream's flag
(:meth:`~distfuse.fused.workspace._Workspace.track_side_stream`), so no later op starts
while the push may still write, and a CUDA graph capture joins the side streams back.
Peer views come from :mod:`distfuse.fused.peer_views` (checked to alias the peer's memory).

On one GPU (loopback, or two processes sharing a GPU) a device-to-device ``copy_`` is a
copy kernel on the SMs, not a DMA over a link: this path there checks the protocol, not
the copy engines or the overlap (results from one GPU say so: ``loopback``).  CPU
(``/dev/shm`` and loopback): the host copies into each peer's mapping, then its flag, in
order; the consumer's host barrier (:meth:`RankBuffers.wait_producers`) orders them
before the reads.
"""

from __future__ import annotations

import torch

from distfuse.fused.peer_views import peer_data, peer_flag
from distfuse.geometry.decomposition import block_range
from distfuse.kernels._utils import claimed_rank_view
from distfuse.kernels.all_gather_matmul import _shard3

__all__ = ["ag_push_copy_engine", "side_streams"]


def side_streams(ws, count: int) -> list[torch.cuda.Stream]:
    """``count`` side streams of the workspace for copy-engine pushes, one per peer (created on first use, kept)."""
    streams = getattr(ws, "_copy_streams", None) or []
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device=ws.device))
    ws._copy_streams = streams
    return streams[:count]


def _push_peer(x: torch.Tensor, view, rank: int, peer: int, W: int, n: int) -> None:
    """Copy ``x`` ``[B_, len_r, K]`` into ``peer``'s gathered rows, then raise ``peer``'s flag ``[rank, rank]``."""
    B, len_r, K = x.shape
    start = block_range(n, W, rank)[0]
    if B * len_r * K:
        gathered = peer_data(view, peer, x.dtype, B * n * K).view(B, n, K)
        for b in range(B):  # contiguous rows on both sides: one memcpy (DMA) each
            gathered[b, start: start + len_r].copy_(x[b], non_blocking=True)
    peer_flag(view, peer, rank, rank).copy_(view.epoch_dev, non_blocking=True)


def ag_push_copy_engine(a_shard: torch.Tensor, ws, rank: int, world_size: int, n: int) -> None:
    """Produce like :func:`~distfuse.kernels.all_gather_matmul.ag_push` (its arguments but ``config``): the same
    rows and flags, by DMA.

    On CUDA the copies run on the workspace's side streams (one per peer) and overlap the
    GEMM that :func:`~distfuse.kernels.all_gather_matmul.gathered_matmul` then issues on the
    op's stream (see the module doc); on CPU they run on the host before it returns.
    """
    op = "ag_push_copy_engine"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    x = _shard3(op, a_shard, n, rank, W)
    x = x.contiguous()  # rows must be contiguous for one DMA each (on the op's stream, before the fork)
    st.data(x.dtype, x.shape[0] * n * x.shape[2], op=op)  # the capacity, the same on every rank
    if W == 1:
        return
    peers = [(rank + j) % W for j in range(1, W)]
    if x.device.type != "cuda":
        for peer in peers:
            _push_peer(x, st, rank, peer, W, n)
        return
    current = torch.cuda.current_stream(x.device)
    for peer, side in zip(peers, side_streams(ws, W - 1), strict=True):
        side.wait_stream(current)
        with torch.cuda.stream(side):
            _push_peer(x, st, rank, peer, W, n)
        x.record_stream(side)
        if getattr(ws, "backend", None) == "loopback":
            # Loopback consumers check each flag once (every producer ran earlier on their stream): join now.
            current.wait_stream(side)
        else:
            ws.track_side_stream(side)
