"""The CUDA backend of :class:`~distfuse.fused.symmetric.SymmetricWorkspace`: torch symmetric memory.

``torch.distributed._symmetric_memory`` (2.6+: ``empty`` + ``rendezvous``; 2.5:
``_SymmetricMemory.empty_strided_p2p``).  The barrier is the handle's device barrier, on
the current stream, with a timeout.  Consumers spin on flags on the device, bounded by
the workspace timeout (:func:`distfuse.kernels._utils.spin_limit`).  A peer's address is
its allocation base plus *its own* offset in that allocation (:func:`_peer_addresses`).
Ranks that share one GPU are refused unless ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``
(see :func:`~distfuse.fused.symmetric_availability._group_verdict`).
"""

from __future__ import annotations

import os
import warnings

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.fused.workspace_layout import header_bytes
from distfuse.partition import Partition


def _spin_limit(timeout_s: float) -> int:
    from distfuse.kernels._utils import spin_limit

    return spin_limit(timeout_s)


def _symm_mem_api() -> str | None:
    """Which torch symmetric-memory allocation API exists: "rendezvous" (2.6+), "p2p" (2.5) or None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    if hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous"):
        return "rendezvous"
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError:
        return None
    return "p2p" if hasattr(_SymmetricMemory, "empty_strided_p2p") else None


ALLOW_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _allow_overlapping_devices() -> bool:
    """Whether torch's rendezvous accepts ranks that share a GPU: exactly ``"1"`` in
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES``, as torch reads it."""
    return os.environ.get(ALLOW_OVERLAP_ENV, "") == "1"


def _device_uuid(index: int) -> str:
    """The GPU's uuid, or "" where torch does not report one (never the index as a stand-in: under per-rank
    ``CUDA_VISIBLE_DEVICES`` every rank's GPU is ``cuda:0``, and equal indices would read as one shared GPU)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else ""


def _peer_addresses(bases: list[int], offsets: list[int], sizes: list[int | None], group_ranks: list[int],
                    partition_ranks: tuple[int, ...] | list[int], total: int) -> list[int]:
    """Every rank's workspace address, in partition-rank order, from its allocation base and offset (pure).

    ``bases`` (torch's ``buffer_ptrs``, mapped into this process), ``offsets`` (where each
    rank's tensor lies in its allocation) and ``sizes`` (each allocation's ``buffer_size``,
    None where torch does not report it) are in group-rank order (the world ranks of
    ``group_ranks``); the slots follow ``partition_ranks``.  Each peer's own offset counts:
    torch's symmetric pool need not place the buffer alike on every rank.  Raises
    :class:`UnsupportedError` naming a rank whose ``total``-byte buffer lies outside its allocation.
    """
    if not len(bases) == len(offsets) == len(sizes) == len(group_ranks):
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: {len(bases)} buffer pointers, {len(offsets)} offsets "
                               f"and {len(sizes)} sizes for a group of {len(group_ranks)} ranks")
    out = []
    for p, world in enumerate(partition_ranks):
        g = group_ranks.index(world)
        off, size = int(offsets[g]), sizes[g]
        limit = int(size) - total if size is not None else None
        if off < 0 or (limit is not None and off > limit):
            raise UnsupportedError(
                f"{where('SymmetricWorkspace')}: the symmetric buffer of partition rank {p} (world rank {world}) lies "
                f"outside its allocation: expected an offset in [0, {limit if limit is not None else 'size - total'}] "
                f"(allocation {size} bytes, buffer {total} bytes), got {off}")
        out.append(int(bases[g]) + off)
    return out


def setup_cuda(ws, P: Partition, total: int, api: str | None) -> tuple[torch.Tensor, list[int]]:
    """Allocate and rendezvous the CUDA buffer of ``ws`` (a ``SymmetricWorkspace``); collective over ``P``.

    ``api``: :func:`_symm_mem_api`'s answer.  Returns this rank's buffer and every rank's
    address in partition-rank order; sets ``ws._handle`` and ``ws._cuda_buf``.
    """
    if api is None:
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: torch {torch.__version__} has no "
                               "torch.distributed._symmetric_memory allocation API")
    import torch.distributed._symmetric_memory as symm_mem

    group_name = P.group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    # 2.5-2.7 need the group registered; later versions deprecate the call (and resolve groups themselves).
    if enable is not None and not hasattr(enable, "__deprecated__") and not (is_enabled and
                                                                             is_enabled(group_name)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    try:
        with torch.cuda.device(ws.device):
            if api == "rendezvous":
                buf = symm_mem.empty(total, dtype=torch.uint8, device=ws.device)
                handle = symm_mem.rendezvous(buf, P.group)
            else:  # torch 2.5
                from torch._C._distributed_c10d import _SymmetricMemory

                buf = _SymmetricMemory.empty_strided_p2p((total,), (1,), torch.uint8, ws.device, group_name)
                handle = _SymmetricMemory.rendezvous(buf)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: CUDA symmetric memory allocation of {total} "
                               f"bytes over ranks {list(P.ranks)} failed (are the GPUs P2P-capable?): {exc}"
                               ) from exc
    buf[: header_bytes(P.size)].zero_()
    ws._handle = handle
    ws._cuda_buf = buf
    ws.barrier("SymmetricWorkspace.setup")  # peers see zeroed headers before any op
    # Where this rank's tensor lies in its allocation (`buffer_ptrs` holds the allocations' bases where torch has a
    # symmetric mempool); every rank's offset and allocation size are gathered, in group-rank order.
    by_group_rank = [int(ptr) for ptr in handle.buffer_ptrs]
    sorted_ranks = sorted(P.ranks)
    own_offset = buf.data_ptr() - by_group_rank[sorted_ranks.index(P.ranks[ws.rank])]
    size = getattr(handle, "buffer_size", None)
    rows = ws._gather_ints(P, [own_offset, int(size) if size is not None else -1], " to exchange buffer offsets")
    ptrs = _peer_addresses(by_group_rank, [r[0] for r in rows], [r[1] if r[1] >= 0 else None for r in rows],
                           sorted_ranks, P.ranks, total)
    if ptrs[ws.rank] != buf.data_ptr():
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: the peer table puts this rank's own buffer at "
                               f"{ptrs[ws.rank]:#x}, but it lies at {buf.data_ptr():#x}")
    # Where each peer's buffer lies for the handle's own views (handle.get_buffer(group rank, sizes, dtype, offset),
    # distfuse.fused.peer_views): its group rank and its offset in its allocation, by partition rank.
    ws._peer_locations = [(sorted_ranks.index(world), ptrs[p] - by_group_rank[sorted_ranks.index(world)])
                          for p, world in enumerate(P.ranks)]
    return buf, ptrs

