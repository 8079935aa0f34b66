"""The ring attention's fused transport: each step pushes the block into the next worker's symmetric buffer.

The unfused ring (:mod:`distfuse.layers.attention_ring`) sends each K/V block (and, in the
backward, each dK/dV accumulator) to the next worker with ``isend`` / ``irecv``.  Here the
sender writes it straight into the receiver's slot of the ring's symmetric workspace
(:func:`~distfuse.fused.symmetric.get_workspace` over ``P_cp``), so no receive is posted and
no staging copy runs in the library; the receiver reads its own slot::

    workspace data region    [channel 0 (K/V), channel 1 (dK/dV)] x [slot 0, slot 1] x slot_bytes
    exchange e on channel c  post:   block -> next worker's slot (c, e % 2)       (CUDA: a side stream, so the copy
                                                                                   engine overlaps the step's math)
                             finish: the op's stream waits for the push; the workspace barrier; copy the
                                     own slot (c, e % 2) out
    adjoint                  none of its own: the ring's backward is a second ring (the dK/dV channel)

Why two slots per channel and one barrier per exchange are enough: a worker copies its slot
out right after the barrier of exchange ``e``, before it reaches any later barrier, and the
slot is written again only by exchange ``e + 2``, which its sender posts after the barrier of
exchange ``e + 1``.  The two channels interleave in the backward (the K/V ring and the dK/dV
ring run together), and every worker runs the same sequence of exchanges (the geometry is
agreed), so the barriers pair up.

CPU (``/dev/shm``, the Triton-free host path): the copies are host memcpys into the peer's
mapping and the barrier is the workspace's monitored barrier: this checks the protocol, not
its speed.  CUDA: the push is a ``copy_`` between two CUDA tensors on a side stream (a DMA
over NVLink between GPUs of one node) and the barrier the symmetric-memory device barrier on
the op's stream; the ring's math on the current block overlaps the push of the next.  Not
measured on a GPU yet.
"""

from __future__ import annotations

import torch

from distfuse.errors import ShapeError, where
from distfuse.fused.peer_views import peer_data
from distfuse.fused.symmetric import get_workspace
from distfuse.partition import Partition

__all__ = ["SymmetricRing", "ring_workspace_bytes"]

_ALIGN = 256
CHANNELS = 2  # K/V, dK/dV


def ring_workspace_bytes(slot_bytes: int) -> int:
    """The data bytes a ring over messages of at most ``slot_bytes`` needs: two channels, two slots each."""
    slot = -(-max(int(slot_bytes), 1) // _ALIGN) * _ALIGN
    return CHANNELS * 2 * slot


class SymmetricRing:
    """One ring call's transport over ``P``'s symmetric workspace: ``with SymmetricRing(...) as ring:`` claims it.

    ``post(channel, block, recv_numel)`` pushes ``block`` into the next worker's slot and returns the pending
    exchange ``(channel, slot, recv_numel, dtype, side stream or None)``; ``finish(pending)`` returns the block the
    previous worker pushed into this worker's slot (``recv_numel`` elements of ``block``'s dtype, a new tensor).
    """

    def __init__(self, P: Partition, device, slot_bytes: int, op: str):
        self.P, self.op = P, op
        self.slot_bytes = ring_workspace_bytes(slot_bytes) // (CHANNELS * 2)
        self.ws = get_workspace(P, ring_workspace_bytes(slot_bytes), device)
        self.next = (P.rank + 1) % P.size
        self._exchanges = [0] * CHANNELS
        self._claim = self.ws.in_flight(self.op)

    def __enter__(self) -> SymmetricRing:
        self._claim.__enter__()
        self.view = self.ws.rank_view(self.P.rank)
        return self

    def __exit__(self, *exc) -> bool:
        return bool(self._claim.__exit__(*exc))

    def _offset(self, channel: int, slot: int) -> int:
        return (channel * 2 + slot) * self.slot_bytes

    def post(self, channel: int, block: torch.Tensor, recv_numel: int) -> tuple:
        if max(block.numel(), recv_numel) * block.dtype.itemsize > self.slot_bytes:
            raise ShapeError(f"{where(self.op)}: a ring message of {max(block.numel(), recv_numel)} {block.dtype} "
                             f"elements does not fit the {self.slot_bytes}-byte slot")
        slot = self._exchanges[channel] % 2
        self._exchanges[channel] += 1
        block = block.reshape(-1)
        dest = peer_data(self.view, self.next, block.dtype, block.numel(), self._offset(channel, slot))
        side = None
        if block.device.type == "cuda":
            from distfuse.fused.all_gather_copy_engine import side_streams

            side = side_streams(self.ws, 1)[0]
            side.wait_stream(torch.cuda.current_stream(block.device))
            with torch.cuda.stream(side):
                dest.copy_(block, non_blocking=True)
            block.record_stream(side)
        else:
            dest.copy_(block)
        return channel, slot, recv_numel, block.dtype, side

    def finish(self, pending: tuple) -> torch.Tensor:
        channel, slot, numel, dtype, side = pending
        if side is not None:
            torch.cuda.current_stream(self.ws.device).wait_stream(side)
        self.ws.barrier(self.op)
        return self.view.data(dtype, numel, self._offset(channel, slot), op=self.op).clone()
