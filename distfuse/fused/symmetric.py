"""Symmetric workspaces: a buffer of the same size on every rank of a group, writable by every peer.

The public entry points: :class:`SymmetricWorkspace` (this rank's share over a real
group) and the per-(group, device) cache (:func:`get_workspace`, :func:`close_all`).  The
rest lives in :mod:`~distfuse.fused.symmetric_availability` (the collective availability
probe), :mod:`~distfuse.fused.workspace` (the concurrency rule, :class:`LoopbackWorkspace`,
the error classes), :mod:`~distfuse.fused.workspace_layout` (the buffer layout and
:class:`RankBuffers`) and the backends :mod:`~distfuse.fused.workspace_shm` (CPU) and
:mod:`~distfuse.fused.workspace_cuda` (CUDA); their public names are re-exported here.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import CollectiveTimeoutError, PartitionError, where
from distfuse.fused.symmetric_availability import (  # noqa: F401 - re-exported: public entry points
    _key,
    _norm_device,
    log_fallback_once,
    symmetric_memory_available,
)
from distfuse.fused.workspace import (  # noqa: F401 - re-exported: the workspace API has always lived here
    LoopbackWorkspace,
    WorkspaceBrokenError,
    WorkspaceBusyError,
    _Workspace,
)
from distfuse.fused.workspace_cuda import (  # noqa: F401 - re-exported
    ALLOW_OVERLAP_ENV,
    _allow_overlapping_devices,
    _peer_addresses,
    _spin_limit,
    _symm_mem_api,
    setup_cuda,
)
from distfuse.fused.workspace_layout import (  # noqa: F401 - re-exported
    _CPU_GRANULE,
    _CUDA_GRANULE,
    RankBuffers,
    _address_table,
    _round_up,
    header_bytes,
)
from distfuse.fused.workspace_shm import SHM_DIR, SHM_PREFIX, _unlink_pending, setup_shm  # noqa: F401
from distfuse.groups import WorldTable
from distfuse.partition import Partition

__all__ = ["SymmetricWorkspace", "LoopbackWorkspace", "RankBuffers", "WorkspaceBusyError", "WorkspaceBrokenError",
           "get_workspace", "cached_workspace", "close_all", "symmetric_memory_available", "log_fallback_once",
           "header_bytes"]

# Test hook: a set-up step name at which this process raises (e.g. "after_create").
_inject_fault_for_tests: str | None = None


def _maybe_fault(step: str) -> None:
    if _inject_fault_for_tests == step:
        raise RuntimeError(f"injected fault at set-up step {step!r}")


class SymmetricWorkspace(_Workspace):
    """This rank's share of a symmetric workspace over partition ``P`` (collective to create).

    Prefer :func:`get_workspace`, which caches one per (group ranks, device) and grows it.

    Attributes beyond :class:`RankBuffers` (``ws.rank_view(ws.rank)`` is this rank's view):
        rank, world_size, nbytes (data capacity, the max over ranks, rounded up),
        backend (``"shm"`` or ``"cuda"``), generation, segment_names (CPU; already unlinked).
    """

    def __init__(self, P: Partition, nbytes: int, device=None, *, generation: int = 1,
                 timeout: float | None = None):
        if not P.active:
            raise PartitionError(f"{where('SymmetricWorkspace')}: this rank is not in the partition {list(P.ranks)}")
        device = _norm_device(P, device)
        self.backend = "shm" if device.type == "cpu" else "cuda"
        granule = _CPU_GRANULE if self.backend == "shm" else _CUDA_GRANULE
        super().__init__(P.size, _round_up(nbytes, granule), device, timeout)
        self.rank = P.rank
        self.ranks = P.ranks
        self.generation = generation
        self.segment_names: list[str] = []
        self._meta_group = P.meta_group
        self._maps: list[mmap.mmap] = []
        self._handle = None
        W = self.world_size
        # Every rank must use the same size: agree on the max (and on rank 0's name token).
        agreed = self._agree(P)
        self.nbytes = agreed["nbytes"]
        total = header_bytes(W) + self.nbytes
        if self.backend == "shm":
            bufs = setup_shm(self, P, total, agreed, _maybe_fault)
            own, ptrs = bufs[self.rank], [b.data_ptr() for b in bufs]
        else:
            own, ptrs = self._setup_cuda(P, total)
            bufs = [own]
            self.max_spin = _spin_limit(self.timeout)
        self._bufs = bufs
        self._table = _address_table(ptrs, W, device)
        self._view = RankBuffers(self, self.rank, own, self._table)

    # ---- set-up
    def _agree(self, P: Partition) -> dict:
        rows = self._gather_ints(P, [os.getpid(), secrets.randbits(31), self.nbytes])
        return dict(pid=rows[0][0], token=rows[0][1], nbytes=max(r[2] for r in rows))

    def _gather_ints(self, P: Partition, values: list[int], purpose: str = "") -> list[list[int]]:
        """Every rank's ``values`` (int64) in group-rank order: a set-up step (``purpose``: what it is for)."""
        out = torch.empty(len(values) * P.size, dtype=torch.int64)
        try:
            all_gather_flat(out, torch.tensor(values, dtype=torch.int64), group=P.meta_group)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"{where('SymmetricWorkspace')}: set-up is collective over ranks "
                                         f"{list(P.ranks)}, but not every rank arrived{purpose}: {exc}") from exc
        return out.view(P.size, len(values)).tolist()

    def _setup_cuda(self, P: Partition, total: int) -> tuple[torch.Tensor, list[int]]:
        return setup_cuda(self, P, total, _symm_mem_api())

    # ---- this rank's share, without going through rank_view
    @property
    def buffer(self) -> torch.Tensor:
        """This rank's data region (uint8, ``nbytes``)."""
        return self._view.data(torch.uint8, self._view.nbytes)

    def view(self, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """A 1-D ``dtype`` view of this rank's data region, ``offset`` bytes in."""
        return self._view.data(dtype, numel, offset)

    @property
    def peer_ptrs(self) -> torch.Tensor:
        """int64 ``[W]`` on the device: every peer's data region in this process's address space."""
        return self._view.data_ptrs

    @property
    def flags(self) -> torch.Tensor:
        """This rank's int32 ``[W, W]`` flags, indexed ``[chunk, source]``."""
        return self._view.flags

    # ---- interface
    def rank_view(self, rank: int) -> RankBuffers:
        if rank != self.rank:
            raise PartitionError(f"{where('SymmetricWorkspace')}: this process is rank {self.rank} of the "
                                 f"workspace group, got rank {rank}")
        return self._view

    def barrier(self, op: str = "barrier") -> None:
        """Wait for every rank of the group (timeout: ``self.timeout`` seconds).

        CPU: ``monitored_barrier`` on the gloo metadata group; it names the rank that did
        not arrive.  CUDA: the symmetric-memory device barrier on the current stream.
        """
        if self.world_size == 1:
            return
        if self.backend == "cuda":
            try:
                self._handle.barrier(channel=0, timeout_ms=int(self.timeout * 1000))
            except TypeError:  # torch 2.5: no timeout argument
                self._handle.barrier(channel=0)
            return
        try:
            dist.monitored_barrier(group=self._meta_group, timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise CollectiveTimeoutError(
                f"{where(op)}: workspace barrier over ranks {list(self.ranks)} did not complete within "
                f"{self.timeout:.1f} s (a peer failed or is not in the same op): {exc}") from exc

    def wait_producers(self) -> None:
        if self.backend == "shm":
            self.barrier("wait_producers")

    def close(self) -> None:
        """Free this rank's share (local: peers keep their mappings of it alive until they close)."""
        if self.closed:
            return
        self.closed = True
        self._view = None
        self._bufs = []
        self._table = None
        self._handle = None
        self._cuda_buf = None
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a typed view is still alive; the mapping goes when it does
                m.close()
        self._maps = []

    def __repr__(self) -> str:
        return (f"SymmetricWorkspace(backend={self.backend}, ranks={list(self.ranks)}, rank={self.rank}, "
                f"nbytes={self.nbytes}, gen={self.generation}, epoch={self.epoch}, broken={self.broken})")


# ---------------------------------------------------------------- cache

_CACHE: WorldTable = WorldTable(drop=lambda ws: ws.close())  # (ranks, device) -> workspace, per world
_GENERATION: WorldTable = WorldTable()  # (ranks, device) -> workspaces made, per world: every rank counts alike


def get_workspace(P: Partition, nbytes: int, device=None, *, timeout: float | None = None) -> SymmetricWorkspace:
    """The cached workspace of ``P`` on ``device`` with at least ``nbytes`` of data; created or grown here.

    Creating and growing are **collective over P**: every rank of ``P`` must call this with
    the same ``nbytes`` (the size of one op's traffic, the same on every rank).  A cached
    workspace that is large enough is returned without communication, so a rank that asks
    for more than its peers would enter the set-up alone and time out; set
    ``DISTFUSE_DEBUG=1`` to check agreement on every call.  When set-up does run, the ranks
    take the max of their requests.  ``timeout`` (seconds) bounds barriers and flag waits
    (default: the group timeout, ``DISTFUSE_TIMEOUT``).  A broken workspace is replaced.
    """
    if not P.active:
        raise PartitionError(f"{where('get_workspace')}: this rank is not in the partition {list(P.ranks)}")
    device = _norm_device(P, device)
    debug.check_agreement("get_workspace", P.ranks, P.meta_group, same=dict(nbytes=int(nbytes), device=device.type))
    key = _key(P, device)
    ws = _CACHE.current().get(key)
    if ws is not None and not ws.closed and not ws.broken and ws.nbytes >= nbytes:
        if timeout is not None:
            ws.timeout = float(timeout)
            if ws.backend == "cuda":
                ws.max_spin = _spin_limit(ws.timeout)
        return ws
    if ws is not None:
        if ws.in_use:
            raise WorkspaceBusyError(f"{where('get_workspace')}: cannot grow the workspace while {ws.in_use!r} "
                                     "has it in flight")
        ws.close()
    generations = _GENERATION.current()
    gen = generations[key] = generations.get(key, 0) + 1
    ws = SymmetricWorkspace(P, nbytes, device, generation=gen, timeout=timeout)
    _CACHE[key] = ws
    return ws


def cached_workspace(P: Partition, device=None) -> SymmetricWorkspace | None:
    """The cached workspace of ``P`` on ``device`` if it can serve an op (open, not broken), else None; local."""
    ws = _CACHE.current().get(_key(P, _norm_device(P, device)))
    return ws if ws is not None and not ws.closed and not ws.broken else None


def close_all() -> None:
    """Free every cached workspace of this process (registered with atexit)."""
    for ws in list(_CACHE.values()):
        ws.close()
    _CACHE.clear()
    _unlink_pending()


atexit.register(close_all)
