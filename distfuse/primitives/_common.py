"""Shared plumbing of the primitives: input checks and one-round point-to-point exchange.

Cross-partition primitives (Broadcast, SumReduce, Repartition, HaloExchange) are all a
set of point-to-point messages on the world group, posted together with
``batch_isend_irecv`` and then waited on.  Posting every send and receive of a rank in
one batch is what makes arbitrary overlapping partitions deadlock-free: no rank blocks
in one transfer while its peer blocks in another.  NCCL fuses a batch into one group
call; gloo runs the transfers concurrently.  Tensors stay on their device: there is no
host staging.

Messages between one pair of ranks are matched in posting order, so both sides must
enumerate their messages in the same canonical order (the plans sort by a key both
sides compute identically).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, expect, where
from distfuse.partition import Partition, zero_volume_tensor

__all__ = ["exchange", "check_inactive_input", "check_active_input", "empty_like_batch"]


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Post all ``(world_peer, tensor)`` sends and receives in one batch and wait for them.

    A message to this rank itself is a local copy and must appear in both lists in the
    same relative order.  Tensors must be contiguous.
    """
    me = dist.get_rank()
    self_sends = [t for peer, t in sends if peer == me]
    self_recvs = [t for peer, t in recvs if peer == me]
    if len(self_sends) != len(self_recvs):
        raise RuntimeError(f"{where('exchange')}: {len(self_sends)} self-sends but {len(self_recvs)} self-receives")
    for src, dst in zip(self_sends, self_recvs, strict=True):
        dst.copy_(src)
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends if peer != me and t.numel() > 0]
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs if peer != me and t.numel() > 0]
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def check_inactive_input(op: str, x: torch.Tensor) -> None:
    """An inactive worker must pass a zero-volume tensor."""
    if x.numel() != 0:
        raise ShapeError(f"{where(op)}: this rank is not active in the input partition, so it must pass a "
                         f"zero-volume tensor; got shape {tuple(x.shape)}")


def check_active_input(op: str, x: torch.Tensor, P: Partition, expected_shape=None, ndim: int | None = None) -> None:
    """Check an active worker's input: its number of dimensions, device and (if known) shape."""
    if ndim is not None and x.dim() != ndim:
        raise expect(op, "number of tensor dimensions (one per partition dimension)", ndim, x.dim())
    if x.device.type != P.device.type:
        raise expect(op, "device", P.device, x.device)
    if expected_shape is not None and tuple(x.shape) != tuple(expected_shape):
        raise expect(op, "local input shape", tuple(expected_shape), tuple(x.shape))


def empty_like_batch(x: torch.Tensor, preserve_batch: bool, batch: int | None = None) -> torch.Tensor:
    """The zero-volume output of a worker that receives nothing, keeping the batch size if asked."""
    b = (batch if batch is not None else (x.shape[0] if x.dim() > 0 else None)) if preserve_batch else None
    return zero_volume_tensor(b, dtype=x.dtype, device=x.device, requires_grad=False)
