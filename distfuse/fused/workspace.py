"""Workspace machinery shared by every backend: the concurrency rule, the shared base, the loopback.

CONCURRENCY RULE: ONE FUSED OP IN FLIGHT PER WORKSPACE.  An op claims its workspace with
``with ws.in_flight("op"):`` for all of its launches; a second claim before the first ends
raises :class:`WorkspaceBusyError`.  Ops on one workspace run in the same order on every
rank (they are collective), and on CUDA they are issued to one stream (a change of
stream between ops is ordered with ``wait_stream``).  Each claim starts with a barrier
over the group, so no peer writes into a buffer that its owner may still be reading
from the previous op.

Epochs live on the device (``epoch_dev``, int32 ``[1]`` per workspace): every claim advances
it with stream-ordered element-wise ops and every kernel loads it, so no kernel argument
carries a per-call host value and a captured CUDA graph raises and expects a new epoch at
each replay.  The host ``epoch`` counts the same claims (for messages); it falls behind the
device's when graphs replay claims, which nothing depends on.

The buffer layout and :class:`RankBuffers` (re-exported here) live in
:mod:`distfuse.fused.workspace_layout`; the real groups' workspace in
:mod:`distfuse.fused.symmetric`.  :class:`LoopbackWorkspace`: W virtual peers in one process.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import weakref

import torch

from distfuse import debug
from distfuse.errors import (
    CollectiveTimeoutError,
    DistfuseError,
    PartitionError,
    ShapeError,
    where,
)
from distfuse.fused.status_slots import StatusSlots, words_clear
from distfuse.fused.workspace_layout import (  # RankBuffers and header_bytes re-exported: the workspace API
    _CPU_GRANULE,
    PendingCheck,
    RankBuffers,
    _address_table,
    _round_up,
    header_bytes,
)
from distfuse.groups import default_timeout
from distfuse.primitives._flag_deferred import check_deferred_flags

__all__ = ["LoopbackWorkspace", "RankBuffers", "WorkspaceBusyError", "WorkspaceBrokenError", "header_bytes",
           "status_check_mode", "check_pending"]


class WorkspaceBusyError(DistfuseError):
    """A fused op claimed a workspace that another op has in flight."""


class WorkspaceBrokenError(DistfuseError):
    """The workspace saw an error mid-op; peers may still write into it, so it must not be reused."""


class _Workspace(abc.ABC):
    """Shared machinery: the in-flight claim, epochs, strictness, closing."""

    backend = "none"

    def __init__(self, world_size: int, nbytes: int, device: torch.device, timeout: float | None):
        self.world_size = int(world_size)
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.timeout = float(timeout) if timeout is not None else default_timeout().total_seconds()
        self.epoch = 0
        self.epoch_dev = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._side_events: list = []  # events of side streams (copy-engine pushes) the op's stream joins at its end
        self.broken = False
        self.closed = False
        # Read the status words right after each consumer (a host sync on CUDA): DISTFUSE_DEBUG=1, or tests.
        self.strict = debug.enabled()
        self.status_mode = status_check_mode(self.device)
        self.deferred: list[PendingCheck] = []  # deferred mode only
        self.status_slots = StatusSlots(self.world_size, self.device)  # the consumers' per-launch status words
        self._events: list = []  # CUDA events of deferred checks already done, for the next ones
        _WORKSPACES.add(self)  # for check_pending
        self.max_spin = 0
        self._busy: str | None = None
        self._lock = threading.Lock()
        self._last_stream = None  # the stream of the last claim (CUDA): a claim on another stream waits for it
        self._last_raw_stream = None

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
            if self._busy is None and (self.deferred or self.status_slots.captured):
                self._busy = op
                try:
                    self.check_deferred(wait=False)
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
                # The raw handle first (one C call): the Stream object only when the stream changed.
                raw = torch._C._cuda_getCurrentRawStream(self.device.index)
                if raw != self._last_raw_stream:
                    cur = torch.cuda.current_stream(self.device)
                    if self._last_stream is not None:
                        cur.wait_stream(self._last_stream)
                    self._last_stream, self._last_raw_stream = cur, raw
            # Two stream-ordered element-wise ops, no host value: a captured CUDA graph advances it at every replay.
            self.epoch_dev.remainder_(2**31 - 2).add_(1)
            self.barrier(op)
            yield self.epoch
            events, self._side_events = self._side_events, []
            for event in events:  # the side streams (track_side_stream) join the op's stream
                torch.cuda.current_stream(self.device).wait_event(event)
        except BaseException:
            self.broken = True
            raise
        finally:
            self._busy = None

    def track_side_stream(self, stream) -> None:
        """Record the end of ``stream``'s work (a copy-engine push) for this op: the op's stream waits for it before
        the claim ends, so no later op starts while the push may still write (see
        :mod:`~distfuse.fused.all_gather_copy_engine`)."""
        event = torch.cuda.Event()
        event.record(stream)
        self._side_events.append(event)

    def raise_on_status(self, status: torch.Tensor, rank: int, epoch: int | None, op: str, what: str,
                        sig_what: str | None = None) -> None:
        """Raise if any status word is set (reads ``status``: a sync where it is a CUDA tensor).

        :class:`ShapeError` where a peer's signature differed (``-1``: the ranks entered the op
        with different shapes or dtypes), else :class:`CollectiveTimeoutError` (a flag wait
        gave up).  Either way the workspace is broken (a slot that reported a failure is never
        reused).  ``epoch`` None: the launch was captured in a CUDA graph, and a replay failed.
        ``sig_what`` (a consumer that also compared signatures): this rank's call, named in a
        disagreement instead of ``what``.
        """
        if status.device.type == "cpu" and words_clear(status):
            return  # the steady state: host words read in place, no torch op
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
                    f"{'; '.join(why)} ({sig_what or what}); every rank of the group must call it with the same "
                    "extents and dtypes.  The op's output holds NaN.")
            raise CollectiveTimeoutError(
                f"{where(op)}: rank {rank} of {self.world_size}: {what}: expected flag epoch "
                f"{epoch if epoch is not None else f'{max(words)} (in a CUDA graph replay)'}, but the flag "
                f"of peer(s) {bad} was not raised within the wait (timeout {self.timeout:.1f} s); a peer failed, "
                "or ranks issued different op sequences.  The op's output holds NaN where the data never came.")

    def check_deferred(self, wait: bool = True) -> None:
        """Raise for a flag wait that gave up in an earlier op (deferred status checks).

        ``wait=True`` (a sync point: :func:`check_pending`) waits for every pending launch.
        ``wait=False`` (the next claim of the workspace) reads the launches whose event has
        completed and keeps the others, so a claim never waits for the GPU to finish the
        previous op; only past :data:`MAX_DEFERRED` pending launches does it wait for the
        oldest (a bound on how late an error can surface).  Then the slots of launches
        captured in CUDA graphs, which a replay may have written since.
        """
        pending, self.deferred = self.deferred, []
        for i, check in enumerate(pending):
            event = check.event
            if event is not None and not event.query():
                if not wait and len(pending) - i <= MAX_DEFERRED:
                    self.deferred.append(check)
                    continue
                event.synchronize()
            try:
                self.raise_on_status(check.words, check.rank, check.epoch, check.op, check.what, check.sig_what)
            except BaseException:
                self.deferred = []  # the workspace is broken: nothing later on it is meaningful
                raise
            if check.slot is not None:
                self.status_slots.give_back(check.slot)
            if event is not None and len(self._events) < MAX_DEFERRED + 2:
                self._events.append(event)  # recorded and done with: the next deferred check records it again
        if self.status_slots.captured:
            failed = self.status_slots.captured_failure(wait)
            if failed is not None:
                words, rank, op, what = failed
                self.raise_on_status(words, rank, None, op, what)

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


STATUS_CHECK_MODES = ("auto", "sync", "deferred")

#: Deferred status copies a workspace keeps before a claim waits for the oldest (see ``check_deferred``).
MAX_DEFERRED = 4

#: Workspaces that may hold deferred status checks (weak: a closed workspace drops out).
_WORKSPACES: weakref.WeakSet = weakref.WeakSet()
# A forked child ran none of its parent's ops: it must not raise their pending failures at its own sync points
# (a pool of forked ranks, a DataLoader worker), nor wait on the parent's device work.
os.register_at_fork(after_in_child=_WORKSPACES.clear)


def status_check_mode(device: torch.device | str | None = None) -> str:
    """When a consumer's flag-wait status words are read (see ``RankBuffers.check_status``): "sync" or "deferred".

    ``DISTFUSE_STATUS_CHECK=sync|deferred`` decides; unset (or ``auto``): ``sync`` on CPU and
    under ``DISTFUSE_DEBUG=1``, ``deferred`` on CUDA, where a sync read would stall the host
    after every fused op (``torch.nonzero(status).tolist()``, twice per op).
    """
    mode = os.environ.get("DISTFUSE_STATUS_CHECK", "auto").strip().lower() or "auto"
    if mode not in STATUS_CHECK_MODES:
        raise ValueError(f"DISTFUSE_STATUS_CHECK={mode!r}: expected one of {STATUS_CHECK_MODES}")
    if mode != "auto":
        return mode
    cuda = device is not None and torch.device(device).type == "cuda"
    return "deferred" if cuda and not debug.enabled() else "sync"


def check_pending() -> None:
    """A sync point: raise now for any fused op whose flag wait gave up, on any workspace of this process, and for
    any call whose workers disagreed under the deferred agreement transport (``distfuse.check_pending``).

    With deferred status checks (the CUDA default) a failed op raises at the next fused op on
    its workspace once the GPU has finished it, and a disagreement at the next call of its
    layer (:mod:`distfuse.primitives._flag_deferred`); call this on every worker at the same
    place (before ``optimizer.step()``, so that no step applies a disagreeing call's NaN) to
    wait for every pending check and raise the first failure by name.  Cheap when nothing is pending.
    """
    check_deferred_flags()
    for ws in list(_WORKSPACES):
        if ws.deferred or ws.status_slots.captured:
            ws.check_deferred(wait=True)


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


