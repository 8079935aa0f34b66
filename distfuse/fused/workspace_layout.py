"""The layout of a workspace buffer and one rank's view of it: the header, the data region, the peer table.

Every backend (the loopback, the ``/dev/shm`` segments, CUDA symmetric memory) lays its
buffers out alike, so the launchers read one :class:`RankBuffers` whatever the backend.

Layout of every rank's buffer (the same on all ranks, so one offset serves every peer)::

    [ header: int32 flags [W, W] | counters [W] | sigs [W] | pad to 256 B ][ data: nbytes ]

* ``flags[chunk, source]``: raised by ``source`` (a release store of the op's *epoch*)
  when its part of ``chunk`` has landed in this buffer.  Epochs count the claims of the
  workspace (every rank counts the same), so flags never need resetting: a stale flag
  holds an older epoch.
* ``counters``: local tile counters; the last program of a producer grid raises the flag
  (:func:`distfuse.kernels.jit_helpers.arrive`), and resets its counter.
* ``sigs[source]``: written by ``source`` before its flags: a hash of the shapes and dtypes
  every rank of the op must agree on (:mod:`distfuse.kernels.signature`).

The status words, where a consumer reports a flag wait that gave up (the epoch:
:class:`~distfuse.errors.CollectiveTimeoutError`) or a peer whose signature differs
(:class:`~distfuse.errors.ShapeError`), are not in the buffer: every consumer launch gets its
own, in host memory this process reads without a copy (:mod:`distfuse.fused.status_slots`).

Every rank holds an int64 table of the peers' data and flag addresses *in its own address
space* (on the workspace device), which Triton kernels cast with ``.to(tl.pointer_type(..))``.
Every flag word has exactly one writer (its source) and every counter is local, so no word
sees read-modify-writes from two processes: the Triton interpreter's atomics, which are
plain numpy read-modify-writes, are safe across ``/dev/shm`` peers.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.fused.status_slots import StatusSlots, words_clear

#: Deferred checks pending in one claim past which a launch reads the finished ones (``check_deferred(wait=False)``:
#: it waits for the GPU only beyond ``workspace.MAX_DEFERRED`` unfinished ones, as a claim does).
DRAIN_DEFERRED = 16

__all__ = ["RankBuffers", "PendingCheck", "header_bytes"]


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
    status_slots: StatusSlots
    _events: list
    _last_stream: object
    _last_raw_stream: int | None

    def wait_producers(self) -> None: ...

    def raise_on_status(self, status: torch.Tensor, rank: int, epoch: int | None, op: str, what: str,
                        sig_what: str | None = None) -> None: ...


# CPU segments grow in pages; CUDA symmetric allocations in 2 MiB (the driver's mapping granularity).
_CPU_GRANULE = 4096
_CUDA_GRANULE = 2 << 20
_HEADER_ALIGN = 256

def header_bytes(world_size: int) -> int:
    """Bytes of the flag/counter/signature header of a W-rank workspace (256-byte aligned)."""
    words = world_size * world_size + 2 * world_size
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
        flags, counters, sigs: this rank's own header tensors.
        status: int32 ``[W]``, the status words of this rank's next consumer launch (a slot of
            :mod:`distfuse.fused.status_slots`, taken at first use, let go by :meth:`check_status`).
        last_status: the words the last check read (or will read, deferred), for tests and debugging.
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
        self.sigs = words[W * W + W: W * W + 2 * W]
        self._slot: torch.Tensor | None = None
        self._slot_captured = False  # the slot was handed to a launch captured in a CUDA graph
        self.last_status: torch.Tensor | None = None
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

    @property
    def status(self) -> torch.Tensor:
        """The status words of this rank's next consumer launch (pass them to the kernel, then :meth:`check_status`).

        The same slot until a check lets it go, so a launcher may read the attribute more than
        once.  While a stream captures a CUDA graph, every captured launch of this rank shares
        one slot, which the workspace then keeps for good; the first launch after the capture
        takes a fresh one.
        """
        slot = self._slot
        if slot is None or (self._slot_captured and not torch.cuda.is_current_stream_capturing()):
            slot = self._slot = self._owner.status_slots.take()
            self._slot_captured = False
        return slot

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

    def check_status(self, op: str, what: str, sig_what: str | None = None) -> None:
        """Raise if a flag wait of the last consumer launch gave up (on every rank that saw it).

        A timed-out wait has already poisoned what it would have read (NaN), so a stale
        result can never pass for a good one; this turns it into a host-side error that
        names the op (``what``: what the launch waited for; ``sig_what``: this rank's call, for
        a launch that also compared the peers' signature words).  The launch wrote into
        :attr:`status`, its own slot; this lets it go:

        * ``sync`` (CPU by default, ``DISTFUSE_DEBUG=1``, ``DISTFUSE_STATUS_CHECK=sync``, or a
          workspace with ``strict`` set): read the words now, before the op returns (on CUDA
          after a sync of the current stream).
        * ``deferred`` (CUDA by default; CPU when forced): record the launch's end (an event on
          CUDA) and raise at a later claim of the workspace, the next one once the GPU has
          finished this launch (:meth:`_Workspace.check_deferred`), or at the sync point
          :func:`distfuse.fused.workspace.check_pending`.  No host sync and, with mapped
          status words (:mod:`distfuse.fused.status_slots`), no copy in the op.
        * CUDA while the stream captures a graph: nothing now (no host work can be captured).
          The slot is kept for good: a wait that gave up during a replay raises at the next
          claim of the workspace; until then its output holds NaN.
        """
        owner = self._owner
        slot = self.status
        cuda = self.device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            if not self._slot_captured:
                owner.status_slots.keep_captured(slot, self.rank, op, what)
                self._slot_captured = True
            return
        self._slot = None
        self.last_status = slot
        if owner.strict or owner.status_mode == "sync":
            owner.raise_on_status(self.read_status_now(slot), self.rank, self.epoch, op, what, sig_what)
            return
        event = None
        words = slot
        if cuda:
            words = owner.status_slots.snapshot(slot)
            event = owner._events.pop() if owner._events else torch.cuda.Event()
            event.record(self._current_stream())
        owner.deferred.append(PendingCheck(words, event, self.rank, self.epoch, op, what, slot, sig_what))
        if len(owner.deferred) >= DRAIN_DEFERRED:
            # Launches within one claim (a loop over a loopback's virtual ranks, a benchmark's timing loop): read the
            # finished ones now, so their slots and events go back to the pools.  Only a claim read them before:
            # a long loop took a new CUDA event at every launch and a new block of pinned slots every 256.
            owner.check_deferred(wait=False)

    def _current_stream(self):
        """The current CUDA stream, where the launch just went: the claim's stream object when the raw handle says it
        is still current (one C call; ``torch.cuda.current_stream`` is Python), else asked for."""
        owner = self._owner
        if torch._C._cuda_getCurrentRawStream(self.device.index) == owner._last_raw_stream:
            return owner._last_stream
        return torch.cuda.current_stream(self.device)

    def read_status_now(self, slot: torch.Tensor | None = None) -> torch.Tensor:
        """The words of ``slot`` (default: :attr:`status`) on the host, once every launch issued so far on the
        current stream has finished (a sync on CUDA: the error paths and ``sync`` mode only).

        Lets the slot go: back to the pool if clear, kept aside otherwise (the caller raises).
        """
        slot = self.status if slot is None else slot
        if slot is self._slot:
            self._slot = None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.last_status = slot
        words = self._owner.status_slots.read(slot)
        if words_clear(words):
            self._owner.status_slots.give_back(slot)
        return words


class PendingCheck(NamedTuple):
    """One deferred status check: the words to read (the slot itself where mapped, else its pinned copy), the
    CUDA event after the launch (None on CPU), who and what, the slot to give back once found clear, and this
    rank's call where the launch also compared signatures."""

    words: torch.Tensor
    event: object
    rank: int
    epoch: int
    op: str
    what: str
    slot: torch.Tensor | None = None
    sig_what: str | None = None


def _address_table(ptrs: list[int], W: int, device) -> torch.Tensor:
    """int64 ``[2, W]`` from the buffers' base addresses: row 0 the data regions, row 1 the flag words."""
    hdr = header_bytes(W)
    misaligned = [r for r, p in enumerate(ptrs) if (p + hdr) % 16]
    if misaligned:  # the GEMM epilogue's 16-byte remote stores rely on it (kernels/matmul_reduce_scatter.py)
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: the data regions of rank(s) {misaligned} are not "
                               f"16-byte aligned ({[hex(ptrs[r] + hdr) for r in misaligned]})")
    return torch.tensor([[p + hdr for p in ptrs], list(ptrs)], dtype=torch.int64, device=device)
