"""Workspace machinery shared by every backend: the concurrency rule, the layout, the loopback.

CONCURRENCY RULE: ONE FUSED OP IN FLIGHT PER WORKSPACE.  An op claims its workspace with
``with ws.in_flight("op"):`` for all of its launches; a second claim before the first ends
raises :class:`WorkspaceBusyError`.  Ops on one workspace run in the same order on every
rank (they are collective), and on CUDA they are issued to one stream (a change of
stream between ops is ordered with ``wait_stream``).  Each claim starts with a barrier
over the group, so no peer writes into a buffer that its owner may still be reading
from the previous op.

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

Epochs live on the device (``epoch_dev``, int32 ``[1]`` per workspace): every claim advances
it with stream-ordered element-wise ops and every kernel loads it, so no kernel argument
carries a per-call host value and a captured CUDA graph raises and expects a new epoch at
each replay.  The host ``epoch`` counts the same claims (for messages); it falls behind the
device's when graphs replay claims, which nothing depends on.

Every rank holds an int64 table of the peers' data and flag addresses *in its own address
space* (on the workspace device), which Triton kernels cast with ``.to(tl.pointer_type(..))``.
Every flag word has exactly one writer (its source) and every counter and status word is
local, so no word sees read-modify-writes from two processes: the Triton interpreter's
atomics, which are plain numpy read-modify-writes, are safe across ``/dev/shm`` peers.

**Loopback** (:class:`LoopbackWorkspace`): W virtual peers in one process, W buffers on one
device behind the same interface, for testing and benchmarking kernels without a group.
The real groups' workspace, :class:`~distfuse.fused.symmetric.SymmetricWorkspace`, lives
in :mod:`distfuse.fused.symmetric`; its backends in :mod:`distfuse.fused.workspace_shm`
and :mod:`distfuse.fused.workspace_cuda`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading

import torch

from distfuse import debug
from distfuse.errors import (
    CollectiveTimeoutError,
    DistfuseError,
    PartitionError,
    ShapeError,
    UnsupportedError,
    where,
)
from distfuse.groups import default_timeout

__all__ = [
    "LoopbackWorkspace",
    "RankBuffers",
    "WorkspaceBusyError",
    "WorkspaceBrokenError",
    "header_bytes",
    "status_check_mode",
]

# CPU segments grow in pages; CUDA symmetric allocations in 2 MiB (the driver's mapping granularity).
_CPU_GRANULE = 4096
_CUDA_GRANULE = 2 << 20
_HEADER_ALIGN = 256


class WorkspaceBusyError(DistfuseError):
    """A fused op claimed a workspace that another op has in flight."""


class WorkspaceBrokenError(DistfuseError):
    """The workspace saw an error mid-op; peers may still write into it, so it must not be reused."""


def header_bytes(world_size: int) -> int:
    """Bytes of the flag/counter/status header of a W-rank workspace (256-byte aligned)."""
    words = world_size * world_size + 3 * world_size
    return -(-4 * words // _HEADER_ALIGN) * _HEADER_ALIGN


def _round_up(n: int, granule: int) -> int:
    return max(granule, -(-int(n) // granule) * granule)


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

    def __init__(self, owner: _Workspace, rank: int, buf: torch.Tensor, table: torch.Tensor):
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
        self.nbytes = self._data.numel()
        self.data_ptrs = table[0]
        self.flag_ptrs = table[1]

    @property
    def epoch(self) -> int:
        """The epoch of the op in flight (flags of this op carry it)."""
        return self._owner.epoch

    @property
    def epoch_dev(self) -> torch.Tensor:
        """int32 ``[1]`` on the workspace device: the epoch the kernels read (advanced in stream order per claim)."""
        return self._owner.epoch_dev

    @property
    def max_spin(self) -> int:
        """Extra flag loads an interpreted consumer may spin (0: one check, the producers ran first)."""
        return self._owner.max_spin

    @property
    def timeout(self) -> float:
        """Seconds a compiled consumer's flag wait may last (the workspace timeout)."""
        return self._owner.timeout

    def data(self, dtype: torch.dtype, numel: int, offset: int = 0, op: str = "workspace") -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements of this rank's data region, ``offset`` bytes in."""
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
        result can never pass for a good one; this turns it into a host-side error:

        * CPU, ``DISTFUSE_DEBUG=1``, and CUDA by default (``DISTFUSE_STATUS_CHECK=sync``):
          read the status words now, a device sync, before the op returns its result.
        * CUDA with ``DISTFUSE_STATUS_CHECK=deferred``: copy them to pinned host memory
          behind an event, and raise at the next claim of the workspace (the next fused
          op) or at :meth:`_Workspace.check_deferred`.  No host sync in the op: for
          overlap, at the price of raising one op late.
        * CUDA while the stream captures a graph: nothing (no host work can be captured).
          Status words are never cleared (a workspace that raised is replaced), so a wait
          that gave up during a replay raises at the next eager check of the workspace;
          until then its output holds NaN.
        """
        owner = self._owner
        if self.status.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # No host work can be captured.  A wait that gives up in a replay still poisons its output with NaN
            # and leaves its status word set; the next eager check of this workspace raises on it.
            return
        if owner.strict or owner.status_mode == "sync" or self.status.device.type != "cuda":
            owner.raise_on_status(self.status.clone() if self.status.device.type == "cpu" else self.status,
                                  self.rank, self.epoch, op, what)
            return
        host = torch.empty(self.status.shape, dtype=self.status.dtype, pin_memory=True)
        host.copy_(self.status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        owner.deferred.append((host, event, self.rank, self.epoch, op, what))


class _Workspace(abc.ABC):
    """Shared machinery: the in-flight claim, epochs, strictness, closing."""

    backend = "none"

    def __init__(self, world_size: int, nbytes: int, device: torch.device, timeout: float | None):
        self.world_size = int(world_size)
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.timeout = float(timeout) if timeout is not None else default_timeout().total_seconds()
        self.epoch = 0
        # The epoch the kernels read and the flags carry, on the device: advanced in stream order at every claim
        # (see `in_flight`), so that a CUDA graph replay advances it too; the host `epoch` counts the same claims
        # for messages and stays equal to it until a graph replays claims the host never saw.
        self.epoch_dev = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._side_events: list = []  # events of side streams (copy-engine pushes) the op's stream joins at its end
        self.broken = False
        self.closed = False
        self.strict = self.device.type == "cpu" or debug.enabled()
        self.status_mode = status_check_mode()
        self.deferred: list = []  # (pinned status copy, event, rank, epoch, op, what), deferred mode only
        self.max_spin = 0
        self._busy: str | None = None
        self._lock = threading.Lock()
        self._last_stream = None

    # ---- the concurrency rule
    @contextlib.contextmanager
    def in_flight(self, op: str):
        """Claim the workspace for one fused op; yields the op's epoch.

        Raises :class:`WorkspaceBusyError` if another op holds it.  Starts with the entry
        barrier.  An exception inside marks the workspace broken: peers may be mid-op.
        """
        with self._lock:
            if self.closed:
                raise WorkspaceBrokenError(f"{where(op)}: the workspace is closed; get a new one from get_workspace")
            if self.broken:
                raise WorkspaceBrokenError(f"{where(op)}: the workspace failed during an earlier op; get a fresh one "
                                           "from get_workspace (collective over the group)")
            if self._busy is None and self.deferred:
                self._busy = op
                try:
                    self.check_deferred()
                except BaseException:
                    self.broken = True
                    raise
                finally:
                    self._busy = None
            if self._busy is not None:
                raise WorkspaceBusyError(
                    f"{where(op)}: the workspace is in use by {self._busy!r}: one fused op in flight per workspace "
                    f"(finish {self._busy!r} first, or give concurrent ops separate workspaces)")
            self._busy = op
        try:
            self.epoch = self.epoch % (2**31 - 2) + 1  # never 0, the value of a fresh flag
            if self.device.type == "cuda":
                cur = torch.cuda.current_stream(self.device)
                if self._last_stream is not None and self._last_stream != cur:
                    cur.wait_stream(self._last_stream)
                self._last_stream = cur
            # Two stream-ordered element-wise ops, no host value: a captured CUDA graph advances it at every replay.
            self.epoch_dev.remainder_(2**31 - 2).add_(1)
            self.barrier(op)
            yield self.epoch
            self._join_side_streams()
        except BaseException:
            self.broken = True
            raise
        finally:
            self._busy = None

    def track_side_stream(self, stream) -> None:
        """Record the end of ``stream``'s work for this op: the op's stream waits for it before the claim ends.

        A push issued on a side stream (the copy-engine all-gather push) writes into the peers'
        buffers; the op's stream waits for it at the end of the claim, so no later op (whose
        entry barrier runs on that stream) can start while the push may still write, and a
        CUDA graph capture joins the side stream back before it ends.
        """
        event = torch.cuda.Event()
        event.record(stream)
        self._side_events.append(event)

    def _join_side_streams(self) -> None:
        events, self._side_events = self._side_events, []
        if events:
            cur = torch.cuda.current_stream(self.device)
            for event in events:
                cur.wait_event(event)

    def raise_on_status(self, status: torch.Tensor, rank: int, epoch: int, op: str, what: str) -> None:
        """Raise if any status word is set (reads ``status``: a sync on CUDA).

        :class:`ShapeError` where a peer's signature differed (``-1``: the ranks entered the op
        with different shapes or dtypes), else :class:`CollectiveTimeoutError` (a flag wait
        gave up).  Either way the workspace is broken (status words are never cleared).
        """
        bad = torch.nonzero(status).flatten().tolist()
        if bad:
            self.broken = True
            words = status.tolist()
            mismatched = [p for p in bad if words[p] < 0]
            if mismatched:
                # The reserved words of distfuse.kernels.signature: -2 a peer refused its input, -3 it needed more room.
                refused = [p for p in mismatched if words[p] == -2]
                grow = [p for p in mismatched if words[p] == -3]
                why = []
                if refused:
                    why.append(f"peer(s) {refused} refused their input (their own error says why) and took part "
                               "without data")
                if grow:
                    why.append(f"peer(s) {grow} needed a larger workspace than the cached one, which this rank's call "
                               "fits: they entered with larger extents")
                if len(refused) + len(grow) < len(mismatched):
                    why.append(f"peer(s) {[p for p in mismatched if p not in refused + grow]} entered it with a "
                               "signature different from this rank's")
                raise ShapeError(
                    f"{where(op)}: rank {rank} of {self.world_size}: the ranks disagree on the op's shapes or dtypes: "
                    f"{'; '.join(why)} ({what}); every rank of the group must call it with the same extents and "
                    "dtypes.  The op's output holds NaN.")
            raise CollectiveTimeoutError(
                f"{where(op)}: rank {rank} of {self.world_size}: {what}: expected flag epoch {epoch}, but the flag "
                f"of peer(s) {bad} was not raised within the wait (timeout {self.timeout:.1f} s); a peer failed, "
                "or ranks issued different op sequences.  The op's output holds NaN where the data never came.")

    def check_deferred(self) -> None:
        """Raise for a flag wait that gave up in an earlier op (``DISTFUSE_STATUS_CHECK=deferred``)."""
        pending, self.deferred = self.deferred, []
        for host, event, rank, epoch, op, what in pending:
            event.synchronize()
            self.raise_on_status(host, rank, epoch, op, what)

    def require_in_flight(self, op: str) -> None:
        """Launchers call this: their flags need the epoch of a claimed op."""
        if self._busy is None:
            raise WorkspaceBusyError(f"{where(op)}: launch outside an op: wrap the launches of one fused op in "
                                     "`with ws.in_flight(name):` (it sets the epoch the flags carry)")

    @property
    def in_use(self) -> str | None:
        return self._busy

    # ---- backends override these
    @abc.abstractmethod
    def barrier(self, op: str = "barrier") -> None:
        """Wait for every rank of the group."""

    def wait_producers(self) -> None:  # noqa: B027 - optional hook: only the CPU backend needs a barrier here
        """Make the peers' pushes visible before a consumer reads them (nothing to do by default)."""

    @abc.abstractmethod
    def rank_view(self, rank: int) -> RankBuffers:
        """The buffers of ``rank`` (this process's own rank on a real group)."""

    def close(self) -> None:
        self.closed = True


STATUS_CHECK_MODES = ("sync", "deferred")


def status_check_mode() -> str:
    """``DISTFUSE_STATUS_CHECK``: when a CUDA consumer's flag-wait status is read (see ``check_status``)."""
    mode = os.environ.get("DISTFUSE_STATUS_CHECK", "sync").strip().lower() or "sync"
    if mode not in STATUS_CHECK_MODES:
        raise ValueError(f"DISTFUSE_STATUS_CHECK={mode!r}: expected one of {STATUS_CHECK_MODES}")
    return mode


def _address_table(ptrs: list[int], W: int, device) -> torch.Tensor:
    """int64 ``[2, W]`` from the buffers' base addresses: row 0 the data regions, row 1 the flag words."""
    hdr = header_bytes(W)
    misaligned = [r for r, p in enumerate(ptrs) if (p + hdr) % 16]
    if misaligned:  # the GEMM epilogue's 16-byte remote stores rely on it (kernels/matmul_reduce_scatter.py)
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: the data regions of rank(s) {misaligned} are not "
                               f"16-byte aligned ({[hex(ptrs[r] + hdr) for r in misaligned]})")
    return torch.tensor([[p + hdr for p in ptrs], list(ptrs)], dtype=torch.int64, device=device)


# ---------------------------------------------------------------- loopback


class LoopbackWorkspace(_Workspace):
    """W virtual peers in one process: W buffers on one device, one address table.

    For testing kernels in a single CPU process (interpreter) and for timing them on a
    single GPU.  Launch each virtual rank's producer, then each one's consumer::

        ws = LoopbackWorkspace(W, nbytes, device)
        with ws.in_flight("test"):
            for r in range(W): matmul_scatter(a[r], w[r], ws, r, W)
            outs = [chunk_reduce(ws, r, W, ...) for r in range(W)]

    The barrier is a no-op and consumers do not spin (the producers have finished).
    """

    backend = "loopback"

    def __init__(self, world_size: int, nbytes: int, device=None, timeout: float | None = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(world_size, _round_up(nbytes, _CPU_GRANULE), device, timeout)
        W = self.world_size
        total = header_bytes(W) + self.nbytes
        self._bufs = [torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(W)]
        self._table = _address_table([b.data_ptr() for b in self._bufs], W, device)
        self._views = [RankBuffers(self, r, self._bufs[r], self._table) for r in range(W)]

    def barrier(self, op: str = "barrier") -> None:
        pass

    def rank_view(self, rank: int) -> RankBuffers:
        if not 0 <= rank < self.world_size:
            raise PartitionError(f"{where('LoopbackWorkspace')}: virtual rank {rank} is outside [0, {self.world_size})")
        return self._views[rank]

    def close(self) -> None:
        self._views, self._bufs = [], []
        self.closed = True


