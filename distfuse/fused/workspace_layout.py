"""The layout of a workspace buffer and one rank's view of it: the header, the data region, the peer table.

Every backend (the loopback, the ``/dev/shm`` segments, CUDA symmetric memory) lays its
buffers out alike, so the launchers read one :class:`RankBuffers` whatever the backend.

Layout of every rank's buffer (the same on all ranks, so one offset serves every peer)::

    [ header: int32 flags [W, W] | counters [W] | status [W] | sigs [W] | pad to 256 B ][ data: nbytes ]

* ``flags[chunk, source]``: raised by ``source`` (a release store of the op's *epoch*)
  when its part of ``chunk`` has landed in this buffer.  Epochs count the claims of the
  workspace (every rank counts the same), so flags never need resetting: a stale flag
  holds an older epoch.
* ``counters``: local tile counters; the last program of a producer grid raises the flag
  (:func:`distfuse.kernels.jit_helpers.arrive`), and resets its counter.
* ``status``: local error words; a flag wait that gives up writes the epoch there and the
  launcher raises on the host (:class:`~distfuse.errors.CollectiveTimeoutError`); a peer
  whose signature differs gets ``-1`` there (:class:`~distfuse.errors.ShapeError`).
* ``sigs[source]``: written by ``source`` before its flags: a hash of the shapes and dtypes
  every rank of the op must agree on (:mod:`distfuse.kernels.signature`).

Every rank holds an int64 table of the peers' data and flag addresses *in its own address
space* (on the workspace device), which Triton kernels cast with ``.to(tl.pointer_type(..))``.
Every flag word has exactly one writer (its source) and every counter and status word is
local, so no word sees read-modify-writes from two processes: the Triton interpreter's
atomics, which are plain numpy read-modify-writes, are safe across ``/dev/shm`` peers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distfuse.errors import ShapeError, UnsupportedError, where

__all__ = ["RankBuffers", "header_bytes"]


class _Owner(Protocol):
    """What a rank's view reads from the workspace that owns it (:class:`distfuse.fused.workspace._Workspace`)."""

    world_size: int
    epoch: int
    epoch_dev: torch.Tensor
    max_spin: int
    timeout: float
    strict: bool
    status_mode: str
    deferred: list

    def wait_producers(self) -> None: ...

    def raise_on_status(self, status: torch.Tensor, rank: int, epoch: int, op: str, what: str) -> None: ...


# CPU segments grow in pages; CUDA symmetric allocations in 2 MiB (the driver's mapping granularity).
_CPU_GRANULE = 4096
_CUDA_GRANULE = 2 << 20
_HEADER_ALIGN = 256

def header_bytes(world_size: int) -> int:
    """Bytes of the flag/counter/status header of a W-rank workspace (256-byte aligned)."""
    words = world_size * world_size + 3 * world_size
    return -(-4 * words // _HEADER_ALIGN) * _HEADER_ALIGN


def _round_up(n: int, granule: int) -> int:
    return max(granule, -(-int(n) // granule) * granule)


def _owners(name: str, doc: str) -> property:
    """A read-only attribute of :class:`RankBuffers` that is its owning workspace's ``name``."""
    return property(lambda view: getattr(view._owner, name), doc=doc)


class RankBuffers:
    """One rank's view of a workspace: what a launcher needs to read, write and signal.

    Attributes:
        rank, world_size: the (virtual) rank and the group size.
        data_ptrs: int64 ``[W]`` on the device: every peer's data region, in this
            process's address space.
        flag_ptrs: int64 ``[W]``: every peer's ``flags`` (int32 ``[W, W]``, chunk-major).
        flags, counters, status, sigs: this rank's own header tensors.
        nbytes: capacity of the data region.
    """

    def __init__(self, owner: _Owner, rank: int, buf: torch.Tensor, table: torch.Tensor):
        W = owner.world_size
        self._owner = owner
        self.rank = rank
        self.world_size = W
        self.device = buf.device
        words = buf[: header_bytes(W)].view(torch.int32)
        self.flags = words[: W * W].view(W, W)
        self.counters = words[W * W: W * W + W]
        self.status = words[W * W + W: W * W + 2 * W]
        self.sigs = words[W * W + 2 * W: W * W + 3 * W]
        self._data = buf[header_bytes(W):]
        self._views: dict = {}  # data(..., cached=True)
        self.nbytes = self._data.numel()
        self.data_ptrs = table[0]
        self.flag_ptrs = table[1]

    epoch = _owners("epoch", "The epoch of the op in flight (flags of this op carry it).")
    epoch_dev = _owners("epoch_dev", "int32 ``[1]`` on the workspace device: the epoch the kernels read (advanced "
                                     "in stream order per claim).")
    max_spin = _owners("max_spin", "Extra flag loads an interpreted consumer may spin (0: one check, the producers "
                                   "ran first).")
    timeout = _owners("timeout", "Seconds a compiled consumer's flag wait may last (the workspace timeout).")

    def data(self, dtype: torch.dtype, numel: int, offset: int = 0, op: str = "workspace", *,
             cached: bool = False) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements of this rank's data region, ``offset`` bytes in.

        ``cached``: reuse the view made by an earlier call with the same arguments (a hot path that
        only hands the view to a kernel saves the two torch ops; never for a view torch writes into
        in place, which autograd or inference mode could otherwise track across calls).
        """
        if cached:
            key = (dtype, numel, offset)
            view = self._views.get(key)
            if view is None:
                if len(self._views) >= 64:  # shapes that keep changing: bounded, like any per-shape cache here
                    self._views.clear()
                view = self._views[key] = self.data(dtype, numel, offset, op)
            return view
        esize = dtype.itemsize
        need = offset + numel * esize
        if offset % esize:
            raise ShapeError(f"{where(op)}: workspace offset {offset} is not a multiple of the {dtype} size {esize}")
        if need > self.nbytes:
            raise ShapeError(f"{where(op)}: workspace data region: expected at least {need} bytes, got "
                             f"{self.nbytes}; ask get_workspace for {need} bytes (the same on every rank)")
        return self._data[offset: need].view(dtype)

    def wait_producers(self) -> None:
        """Order the peers' producer kernels before this rank's consumer.

        CPU: a host barrier stands in for the flags (the consumer kernel then checks each
        flag once).  CUDA and loopback: nothing; the consumer spins on the flags (CUDA) or
        runs after every producer (loopback launches are sequential).
        """
        self._owner.wait_producers()

    def check_status(self, op: str, what: str) -> None:
        """Raise if a flag wait of the last consumer kernel gave up (on every rank that saw it).

        A timed-out wait has already poisoned what it would have read (NaN), so a stale
        result can never pass for a good one; this turns it into a host-side error that
        names the op:

        * ``sync`` (CPU by default, ``DISTFUSE_DEBUG=1``, ``DISTFUSE_STATUS_CHECK=sync``, or a
          workspace with ``strict`` set): read the status words now, before the op returns
          (on CUDA a device sync, twice per fused op: consumer and signature check).
        * ``deferred`` (CUDA by default; CPU when forced): copy them (to pinned host memory
          behind an event on CUDA) and raise at a later claim of the workspace, the next one
          once the GPU has finished this op (:meth:`_Workspace.check_deferred`), or at the
          sync point :func:`distfuse.fused.workspace.check_pending`.  No host sync in the op.
        * CUDA while the stream captures a graph: nothing (no host work can be captured).
          Status words are never cleared (a workspace that raised is replaced), so a wait
          that gave up during a replay raises at the next eager check of the workspace;
          until then its output holds NaN.
        """
        owner = self._owner
        cuda = self.status.device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            return
        if owner.strict or owner.status_mode == "sync":
            owner.raise_on_status(self.status if cuda else self.status.clone(), self.rank, self.epoch, op, what)
            return
        if not cuda:
            owner.deferred.append((self.status.clone(), None, self.rank, self.epoch, op, what))
            return
        host, event = owner.status_copy_buffers(self.status)
        host.copy_(self.status, non_blocking=True)
        event.record()
        owner.deferred.append((host, event, self.rank, self.epoch, op, what))


def _address_table(ptrs: list[int], W: int, device) -> torch.Tensor:
    """int64 ``[2, W]`` from the buffers' base addresses: row 0 the data regions, row 1 the flag words."""
    hdr = header_bytes(W)
    misaligned = [r for r, p in enumerate(ptrs) if (p + hdr) % 16]
    if misaligned:  # the GEMM epilogue's 16-byte remote stores rely on it (kernels/matmul_reduce_scatter.py)
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: the data regions of rank(s) {misaligned} are not "
                               f"16-byte aligned ({[hex(ptrs[r] + hdr) for r in misaligned]})")
    return torch.tensor([[p + hdr for p in ptrs], list(ptrs)], dtype=torch.int64, device=device)
