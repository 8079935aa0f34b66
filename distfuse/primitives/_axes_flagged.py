"""The flagged forms of the block collectives of :mod:`distfuse.primitives._axes`: one agreement flag rides with
the data (:mod:`distfuse.primitives._agreement`), or, on a CUDA partition, takes the host round of
:mod:`distfuse.primitives._flag_transport` before the plain collective (reading a received flag would
synchronise the device on every call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distfuse._compat import all_gather_flat, reduce_scatter_flat
from distfuse.errors import expect
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import (
    BlockLayout,
    all_reduce_sum,
    box,
    debug_agree,
    gather_blocks,
    my_block,
    pack_blocks,
    scatter_sum_blocks,
    unpack_blocks,
)
from distfuse.primitives._common import collective_guard, poison
from distfuse.primitives._flag_transport import any_flag_on_host, flags_on_host

__all__ = ["gather_blocks_flagged", "scatter_sum_blocks_flagged", "all_reduce_sum_flagged"]


def _slot(n: int) -> int:
    """Elements per worker's slot: its ``n`` data elements, the flag, and padding (never read) to a multiple of 16,
    so that every slot starts 64-byte aligned, as the unflagged blocks of the usual sizes do (vectorised chunks)."""
    return (n + 1 + 15) // 16 * 16


def _flag_set(flags: torch.Tensor) -> bool:
    """Whether any flag element is non-zero; a host read (free on CPU, waits for the collective on CUDA)."""
    return bool(flags.ne(0).any())


def gather_blocks_flagged(op: str, P_sub: CartesianPartition, layout: BlockLayout, x: torch.Tensor,
                          flag: bool) -> tuple[torch.Tensor | None, bool]:
    """:func:`gather_blocks` with a flag per message: ``(gathered, any flag set)``; ``gathered`` is None when set.

    One flat all-gather of ``P * slot`` elements (:func:`_slot`); the flag follows the
    block in every worker's slot.  ``x`` must have this worker's extent of ``layout``.
    """
    if flags_on_host(P_sub.device):  # CUDA: the flags' host round, then the plain collective (_flag_transport)
        if any_flag_on_host(P_sub, flag, op):
            return None, True
        return gather_blocks(op, P_sub, layout, x), False
    if tuple(x.shape) != layout.extents[layout.me]:
        raise expect(op, "local block shape", layout.extents[layout.me], tuple(x.shape))
    debug_agree(op, P_sub, x, {"gathered shape": layout.shape, "pad": layout.pad, "flagged": True})
    n = layout.block_numel
    slot = _slot(n)
    send = poison(x.new_empty((slot,)))
    if n:
        send[:n].view(layout.pad)[box(x.shape)] = x
    send[n] = 1 if flag else 0
    buf = poison(x.new_empty((P_sub.size * slot,)))
    with collective_guard(op, "all-gather", P_sub.ranks):
        all_gather_flat(buf, send, group=P_sub.group)
    rows = buf.view(P_sub.size, slot)
    if _flag_set(rows[:, n]):
        return None, True
    return unpack_blocks(rows, layout, x), False


def scatter_sum_blocks_flagged(op: str, P_sub: CartesianPartition, layout: BlockLayout, full: torch.Tensor,
                               flag: bool, reduce_dtype: torch.dtype | None = None
                               ) -> tuple[torch.Tensor | None, bool]:
    """:func:`scatter_sum_blocks` with a flag per chunk: ``(this worker's block, any flag set)``.

    Every chunk of the flat ``[P, slot]`` message (:func:`_slot`) carries this worker's flag
    after the block, so every worker receives the sum of all flags.  The block is None when
    a flag is set.
    """
    if flags_on_host(P_sub.device):
        if any_flag_on_host(P_sub, flag, op):
            return None, True
        return scatter_sum_blocks(op, P_sub, layout, full, reduce_dtype), False
    wire = reduce_dtype if reduce_dtype is not None else full.dtype
    if tuple(full.shape) != layout.shape:
        raise expect(op, "full (partial-sum) tensor shape", layout.shape, tuple(full.shape))
    debug_agree(op, P_sub, full, {"full shape": layout.shape, "reduce dtype": str(wire), "flagged": True})
    n = layout.block_numel
    slot = _slot(n)
    send = poison(full.new_empty((P_sub.size, slot), dtype=wire))
    if n:
        pack_blocks(full, layout, send)
    send[:, n] = 1 if flag else 0
    recv = poison(full.new_empty((slot,), dtype=wire))
    with collective_guard(op, "reduce-scatter", P_sub.ranks):
        reduce_scatter_flat(recv, send.reshape(-1), group=P_sub.group)
    if _flag_set(recv[n:n + 1]):
        return None, True
    if n == 0:
        return full.new_zeros(layout.extents[layout.me]), False
    return my_block(recv, layout, full.dtype), False


def all_reduce_sum_flagged(op: str, P_sub: CartesianPartition, x: torch.Tensor, flag: bool,
                           reduce_dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, bool]:
    """:func:`all_reduce_sum` with one flag element appended: ``(the sum, any flag set)``; None when set."""
    if flags_on_host(P_sub.device):
        if any_flag_on_host(P_sub, flag, op):
            return None, True
        return all_reduce_sum(op, P_sub, x, reduce_dtype), False
    wire = reduce_dtype if reduce_dtype is not None else x.dtype
    debug_agree(op, P_sub, x, {"shape": tuple(x.shape), "reduce dtype": str(wire), "flagged": True})
    y = torch.empty(x.numel() + 1, dtype=wire, device=x.device)
    y[:-1].view(x.shape).copy_(x)
    y[-1] = 1 if flag else 0
    with collective_guard(op, "all-reduce", P_sub.ranks):
        dist.all_reduce(y, group=P_sub.group)
    if _flag_set(y[-1:]):
        return None, True
    return y[:-1].view(x.shape).to(dtype=x.dtype), False
