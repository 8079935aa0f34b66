"""Symmetric workspaces: a buffer of the same size on every rank of a group, writable by every peer.

CONCURRENCY RULE: ONE FUSED OP IN FLIGHT PER WORKSPACE.  An op claims its workspace with
``with ws.in_flight("op"):`` for all of its launches; a second claim before the first ends
raises :class:`WorkspaceBusyError`.  Ops on one workspace run in the same order on every
rank (they are collective), and on CUDA they are issued to one stream (a change of
stream between ops is ordered with ``wait_stream``).  Each claim starts with a barrier
over the group, so no peer writes into a buffer that its owner may still be reading
from the previous op.

Layout of every rank's buffer (the same on all ranks, so one offset serves every peer)::

    [ header: int32 flags [W, W] | int32 counters [W] | int32 status [W] | pad to 256 B ][ data: nbytes ]

* ``flags[chunk, source]``: raised by ``source`` (a release store of the op's *epoch*)
  when its part of ``chunk`` has landed in this buffer.  Epochs count the claims of the
  workspace (every rank counts the same), so flags never need resetting: a stale flag
  holds an older epoch.
* ``counters``: local tile counters; the last program of a producer grid raises the flag
  (:func:`distfuse.kernels._utils.arrive`), and resets its counter.
* ``status``: local error words; a flag wait that gives up writes the epoch there and the
  launcher raises on the host.

Every rank holds an int64 table of the peers' data and flag addresses *in its own address
space* (on the workspace device), which Triton kernels cast with ``.to(tl.pointer_type(..))``.
Every flag word has exactly one writer (its source) and every counter and status word is
local, so no word sees read-modify-writes from two processes: the Triton interpreter's
atomics, which are plain numpy read-modify-writes, are safe across ``/dev/shm`` peers.

Backends:

* **CUDA**: ``torch.distributed._symmetric_memory`` (2.6+: ``empty`` + ``rendezvous``; 2.5:
  ``_SymmetricMemory.empty_strided_p2p``).  The barrier is the handle's device barrier, on
  the current stream, with a timeout.  Consumers spin on flags on the device, bounded by
  the workspace timeout (:func:`distfuse.kernels._utils.spin_limit`).  A peer's address is
  its allocation base (``buffer_ptrs``) plus *its own* offset in that allocation, gathered at
  set-up: torch's symmetric pool may place the buffer differently on each rank.  Ranks that
  share one GPU are refused unless ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (torch's
  rendezvous rejects them otherwise; see :func:`symmetric_memory_available`).
* **CPU** (``/dev/shm``): one POSIX shared-memory segment per rank, mapped by every rank of
  the host.  Set-up is leak-free: create, barrier, map all peers, barrier, then every rank
  unlinks every name; the mappings keep the memory alive, so ``/dev/shm`` holds nothing
  once set-up returns on any rank, even if a process dies later.  During set-up the names
  are also unlinked in ``finally`` and at exit.  Names are
  ``distfuse-<pid of rank 0>-<random token>-<crc of the group ranks>-g<generation>-r<rank>``.
  The barrier is ``monitored_barrier`` on ``P.meta_group`` (gloo) with the group timeout
  (it names the rank that did not arrive); it also stands in for the flags: the consumer
  checks each flag once after it and raises if one is missing.
* **Loopback** (:class:`LoopbackWorkspace`): W virtual peers in one process, W buffers on one
  device behind the same interface, for testing and benchmarking kernels without a group.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import logging
import mmap
import os
import secrets
import threading
import warnings
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import (
    CollectiveTimeoutError,
    DistfuseError,
    PartitionError,
    ShapeError,
    UnsupportedError,
    where,
)
from distfuse.partition import Partition, default_timeout

__all__ = [
    "SymmetricWorkspace",
    "LoopbackWorkspace",
    "RankBuffers",
    "WorkspaceBusyError",
    "WorkspaceBrokenError",
    "get_workspace",
    "close_all",
    "symmetric_memory_available",
    "log_fallback_once",
    "header_bytes",
]

logger = logging.getLogger("distfuse.fused")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "distfuse-"
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
    words = world_size * world_size + 2 * world_size
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
        flags, counters, status: this rank's own header tensors.
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
        self._data = buf[header_bytes(W):]
        self.nbytes = self._data.numel()
        self.data_ptrs = table[0]
        self.flag_ptrs = table[1]

    @property
    def epoch(self) -> int:
        """The epoch of the op in flight (flags of this op carry it)."""
        return self._owner.epoch

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
          overlap and CUDA-graph capture, at the price of raising one op late.
        """
        owner = self._owner
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
            self.barrier(op)
            yield self.epoch
        except BaseException:
            self.broken = True
            raise
        finally:
            self._busy = None

    def raise_on_status(self, status: torch.Tensor, rank: int, epoch: int, op: str, what: str) -> None:
        """Raise :class:`CollectiveTimeoutError` if any status word is set (reads ``status``: a sync on CUDA)."""
        bad = torch.nonzero(status).flatten().tolist()
        if bad:
            self.broken = True
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


def _address_table(ptrs: list[int], W: int, device) -> torch.Tensor:
    """int64 ``[2, W]`` from the buffers' base addresses: row 0 the data regions, row 1 the flag words."""
    hdr = header_bytes(W)
    misaligned = [r for r, p in enumerate(ptrs) if (p + hdr) % 16]
    if misaligned:  # the GEMM epilogue's 16-byte remote stores rely on it (kernels/matmul_reduce_scatter.py)
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: the data regions of rank(s) {misaligned} are not "
                               f"16-byte aligned ({[hex(ptrs[r] + hdr) for r in misaligned]})")
    return torch.tensor([[p + hdr for p in ptrs], list(ptrs)], dtype=torch.int64, device=device)


def _peer_addresses(bases: list[int], offsets: list[int], sizes: list[int | None], group_ranks: list[int],
                    partition_ranks: tuple[int, ...] | list[int], total: int) -> list[int]:
    """Every rank's workspace address, in partition-rank order, from its allocation base and offset (pure).

    ``bases`` (torch's ``buffer_ptrs``, already mapped into this process), ``offsets`` (where
    each rank's tensor lies in its allocation) and ``sizes`` (each allocation's
    ``buffer_size``, None where torch does not report it) are in group-rank order, the
    world ranks of ``group_ranks``; the workspace slots follow ``partition_ranks``, which
    may list them in another order.  Each peer's address is its own base plus its own
    offset: torch's symmetric pool need not place the buffer at the same offset on every
    rank, so one rank's offset says nothing about another's.  Raises
    :class:`UnsupportedError` naming the rank whose ``total``-byte buffer does not lie
    within its allocation.
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


# ---------------------------------------------------------------- real groups

_PENDING_UNLINK: set[str] = set()
# Test hook: a set-up step name at which this process raises (e.g. "after_create").
_inject_fault_for_tests: str | None = None


def _maybe_fault(step: str) -> None:
    if _inject_fault_for_tests == step:
        raise RuntimeError(f"injected fault at set-up step {step!r}")


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    _PENDING_UNLINK.discard(name)


def _unlink_pending() -> None:
    for name in list(_PENDING_UNLINK):
        _unlink(name)


atexit.register(_unlink_pending)


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
        device = torch.device(device) if device is not None else P.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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
            bufs = self._setup_shm(P, total, agreed)
            own, ptrs = bufs[self.rank], [b.data_ptr() for b in bufs]
        else:
            own, ptrs = self._setup_cuda(P, total)
            bufs = [own]
        self._bufs = bufs
        self._table = _address_table(ptrs, W, device)
        self._view = RankBuffers(self, self.rank, own, self._table)
        if self.backend == "cuda":
            self.max_spin = _spin_limit(self.timeout)

    # ---- set-up
    def _agree(self, P: Partition) -> dict:
        mine = torch.tensor([os.getpid(), secrets.randbits(31), self.nbytes], dtype=torch.int64)
        out = torch.empty(3 * P.size, dtype=torch.int64)
        try:
            all_gather_flat(out, mine, group=P.meta_group)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"{where('SymmetricWorkspace')}: set-up is collective over ranks "
                                         f"{list(P.ranks)}, but not every rank arrived: {exc}") from exc
        rows = out.view(P.size, 3).tolist()
        return dict(pid=rows[0][0], token=rows[0][1], nbytes=max(r[2] for r in rows))

    def _setup_shm(self, P: Partition, total: int, agreed: dict) -> list[torch.Tensor]:
        if not os.path.isdir(SHM_DIR):
            raise UnsupportedError(f"{where('SymmetricWorkspace')}: {SHM_DIR} does not exist; the CPU backend needs "
                                   "POSIX shared memory")
        crc = zlib.crc32(repr(P.ranks).encode())
        prefix = f"{SHM_PREFIX}{agreed['pid']}-{agreed['token']:08x}-{crc:08x}-g{self.generation}"
        names = [f"{prefix}-r{r}" for r in range(P.size)]
        self.segment_names = names
        own = names[self.rank]
        maps: list[mmap.mmap | None] = [None] * P.size
        _PENDING_UNLINK.add(own)
        ok = False
        try:
            fd = os.open(os.path.join(SHM_DIR, own), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)  # zero-filled: flags start at 0, below every epoch
                maps[self.rank] = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            _maybe_fault("after_create")
            self.barrier("SymmetricWorkspace.setup")  # every segment exists
            for r, name in enumerate(names):
                if r == self.rank:
                    continue
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    if size != total:
                        raise ShapeError(f"{where('SymmetricWorkspace')}: segment of rank {r}: expected {total} "
                                         f"bytes, got {size}")
                    maps[r] = mmap.mmap(fd, total)
                finally:
                    os.close(fd)
            _maybe_fault("after_map")
            self.barrier("SymmetricWorkspace.setup")  # every rank has mapped every segment
            ok = True
        finally:
            # Success: every rank unlinks every name (idempotent), so none is left once set-up returns on
            # any rank.  Failure: set-up fails on every rank (the barriers time out), and a peer may
            # have died without running its own `finally`; unlinking all names covers it too.
            for name in names:
                _unlink(name)
            if not ok:
                for m in maps:
                    if m is not None:
                        m.close()
        self._maps = maps
        return [torch.frombuffer(m, dtype=torch.uint8) for m in maps]

    def _setup_cuda(self, P: Partition, total: int) -> tuple[torch.Tensor, list[int]]:
        api = _symm_mem_api()
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
            with torch.cuda.device(self.device):
                if api == "rendezvous":
                    buf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
                    handle = symm_mem.rendezvous(buf, P.group)
                else:  # torch 2.5
                    from torch._C._distributed_c10d import _SymmetricMemory

                    buf = _SymmetricMemory.empty_strided_p2p((total,), (1,), torch.uint8, self.device, group_name)
                    handle = _SymmetricMemory.rendezvous(buf)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise UnsupportedError(f"{where('SymmetricWorkspace')}: CUDA symmetric memory allocation of {total} "
                                   f"bytes over ranks {list(P.ranks)} failed (are the GPUs P2P-capable?): {exc}"
                                   ) from exc
        buf[: header_bytes(P.size)].zero_()
        self._handle = handle
        self._cuda_buf = buf
        self.barrier("SymmetricWorkspace.setup")  # peers see zeroed headers before any op
        # Where this rank's tensor lies in its allocation: torch versions with a symmetric mempool
        # report the allocation's base in `buffer_ptrs` (0 offset where they point at the tensor).
        # The pool may place the tensor at a different offset on each rank, so every rank's offset
        # (and allocation size) is gathered; `buffer_ptrs` and the gather are both in group-rank order.
        by_group_rank = [int(ptr) for ptr in handle.buffer_ptrs]
        sorted_ranks = sorted(P.ranks)
        own_offset = buf.data_ptr() - by_group_rank[sorted_ranks.index(P.ranks[self.rank])]
        size = getattr(handle, "buffer_size", None)
        mine = torch.tensor([own_offset, int(size) if size is not None else -1], dtype=torch.int64)
        gathered = torch.empty(2 * P.size, dtype=torch.int64)
        try:
            all_gather_flat(gathered, mine, group=P.meta_group)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"{where('SymmetricWorkspace')}: set-up is collective over ranks "
                                         f"{list(P.ranks)}, but not every rank arrived to exchange buffer "
                                         f"offsets: {exc}") from exc
        rows = gathered.view(P.size, 2).tolist()
        ptrs = _peer_addresses(by_group_rank, [r[0] for r in rows], [r[1] if r[1] >= 0 else None for r in rows],
                               sorted_ranks, P.ranks, total)
        if ptrs[self.rank] != buf.data_ptr():
            raise UnsupportedError(f"{where('SymmetricWorkspace')}: the peer table puts this rank's own buffer at "
                                   f"{ptrs[self.rank]:#x}, but it lies at {buf.data_ptr():#x}")
        return buf, ptrs

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
            try:
                m.close()
            except BufferError:  # a typed view is still alive; the mapping goes when it does
                pass
        self._maps = []

    def __repr__(self) -> str:
        return (f"SymmetricWorkspace(backend={self.backend}, ranks={list(self.ranks)}, rank={self.rank}, "
                f"nbytes={self.nbytes}, gen={self.generation}, epoch={self.epoch}, broken={self.broken})")


STATUS_CHECK_MODES = ("sync", "deferred")


def status_check_mode() -> str:
    """``DISTFUSE_STATUS_CHECK``: when a CUDA consumer's flag-wait status is read (see ``check_status``)."""
    mode = os.environ.get("DISTFUSE_STATUS_CHECK", "sync").strip().lower() or "sync"
    if mode not in STATUS_CHECK_MODES:
        raise ValueError(f"DISTFUSE_STATUS_CHECK={mode!r}: expected one of {STATUS_CHECK_MODES}")
    return mode


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


# ---------------------------------------------------------------- cache

_CACHE: dict[tuple, SymmetricWorkspace] = {}
_GENERATION: dict[tuple, int] = {}


def _key(P: Partition, device: torch.device) -> tuple:
    return (P.ranks, str(device))


def _norm_device(P: Partition, device) -> torch.device:
    device = torch.device(device) if device is not None else P.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
    ws = _CACHE.get(key)
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
    gen = _GENERATION[key] = _GENERATION.get(key, 0) + 1
    ws = SymmetricWorkspace(P, nbytes, device, generation=gen, timeout=timeout)
    _CACHE[key] = ws
    return ws


def close_all() -> None:
    """Free every cached workspace of this process (registered with atexit)."""
    for ws in list(_CACHE.values()):
        ws.close()
    _CACHE.clear()
    _unlink_pending()


atexit.register(close_all)


# ---------------------------------------------------------------- availability

_AVAILABLE: dict[tuple, tuple[bool, str]] = {}
_LOGGED: set[str] = set()


def _local_verdict(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
            return False, f"{SHM_DIR} is missing or not writable"
        from distfuse.kernels._utils import INTERPRET

        if not INTERPRET:
            return False, "Triton kernels on CPU need TRITON_INTERPRET=1 set before distfuse.kernels is imported"
        return True, "CPU shared memory (/dev/shm) with the Triton interpreter"
    if device.type != "cuda":
        return False, f"no symmetric memory backend for device type {device.type}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if _symm_mem_api() is None:
        return False, f"torch {torch.__version__} has no torch.distributed._symmetric_memory allocation API"
    return True, "CUDA symmetric memory"


ALLOW_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _allow_overlapping_devices() -> bool:
    """Whether torch's rendezvous accepts ranks that share a GPU: ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``.

    torch reads the variable as a strict boolean flag (``"1"`` on, ``"0"`` off), so
    exactly ``"1"`` counts here too.
    """
    return os.environ.get(ALLOW_OVERLAP_ENV, "") == "1"


def _device_uuid(index: int) -> str:
    """The GPU's uuid, or "" where torch does not report one.

    Not the index as a stand-in: under per-rank ``CUDA_VISIBLE_DEVICES`` every rank's GPU
    is ``cuda:0``, and equal indices would read as one shared GPU.
    """
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else ""


def _group_verdict(ok: bool, reason: str, infos: list, group_ranks: list[int], device_index: int | None, *,
                   visible: dict[str, int], can_access, allow_overlapping: bool) -> tuple[bool, str]:
    """This rank's verdict on symmetric memory over a group, from every rank's gathered facts (pure).

    Args:
        ok, reason: this rank's local verdict (:func:`_local_verdict`).
        infos: ``(hostname, gpu uuid or "", device name, ok, reason)`` of every rank, in
            the gather's order (group-rank order: sorted world ranks).
        group_ranks: the world rank of each entry of ``infos``, to name ranks in reasons.
        device_index: this rank's CUDA device index (None on CPU).
        visible: uuid -> local index of the GPUs this process sees.
        can_access: ``can_access(i, j)``, whether local GPU ``i`` reaches local GPU ``j`` (P2P).
        allow_overlapping: ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` on this rank.

    Unavailable when the ranks span several hosts; when two ranks of one host hold the
    same GPU (torch's rendezvous rejects that unless ``allow_overlapping``: the mode in
    which a one-GPU machine runs the real CUDA path with two processes); when a peer's
    GPU is visible here but not reachable by P2P.
    """
    if not ok:
        return ok, reason
    hosts = sorted({info[0] for info in infos})
    if len(hosts) > 1:
        return False, (f"ranks {list(group_ranks)} span {len(hosts)} hosts ({', '.join(hosts[:4])}); symmetric "
                       "memory needs one host")
    if device_index is None:
        return ok, reason
    holders: dict[str, list[int]] = {}
    for g, info in enumerate(infos):
        if info[1]:
            holders.setdefault(info[1], []).append(g)
    shared = {uuid: gs for uuid, gs in holders.items() if len(gs) > 1}
    if shared and not allow_overlapping:
        uuid, gs = next(iter(shared.items()))
        who = ", ".join(f"{group_ranks[g]} ({infos[g][2]})" for g in gs)
        return False, (f"world ranks {who} share one GPU (uuid {uuid}) on host {hosts[0]}; torch's "
                       "symmetric-memory rendezvous rejects ranks on the same device: give each rank its own GPU "
                       f"(torch.cuda.set_device(local_rank)), or set {ALLOW_OVERLAP_ENV}=1 on every rank to allow it "
                       "(for testing the CUDA path with several processes on one GPU)")
    for g, info in enumerate(infos):
        j = visible.get(info[1]) if info[1] else None
        # A peer GPU hidden by CUDA_VISIBLE_DEVICES cannot be checked here; allocation will tell.
        if j is not None and j != device_index and not can_access(device_index, j):
            return False, f"no P2P access from cuda:{device_index} to cuda:{j} (world rank {group_ranks[g]})"
    if shared:
        return ok, f"{reason} (ranks share GPUs; {ALLOW_OVERLAP_ENV}=1)"
    return ok, reason


def symmetric_memory_available(P: Partition, device=None) -> tuple[bool, str]:
    """Whether ``P`` can use symmetric workspaces on ``device``, and why (cached per group and device).

    False when the ranks span several hosts, when two ranks share one GPU (unless
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, which torch's rendezvous needs for
    that), when GPUs of one host cannot reach each other (no P2P), when torch lacks
    symmetric memory, or on CPU without ``/dev/shm`` or the Triton interpreter.
    Collective over ``P`` the first time (two small gathers on ``P.meta_group``), so
    every rank of ``P`` gets the same answer; cached afterwards.
    """
    if not P.active:
        return False, "this rank is not in the partition"
    device = _norm_device(P, device)
    key = _key(P, device)
    if key in _AVAILABLE:
        return _AVAILABLE[key]
    ok, reason = _local_verdict(device)
    if P.size == 1:
        _AVAILABLE[key] = (ok, reason)
        return ok, reason
    import socket

    cuda = ok and device.type == "cuda"
    uuid = _device_uuid(device.index) if cuda else ""
    infos: list = [None] * P.size
    dist.all_gather_object(infos, (socket.gethostname(), uuid, str(device), ok, reason), group=P.meta_group)
    # The gathers are in group-rank order: torch's new_group sorts the ranks.
    group_ranks = sorted(P.ranks)
    visible = {}
    if cuda:
        visible = {u: i for i in range(torch.cuda.device_count()) if (u := _device_uuid(i))}
    ok, reason = _group_verdict(ok, reason, infos, group_ranks, device.index if cuda else None, visible=visible,
                                can_access=torch.cuda.can_device_access_peer,
                                allow_overlapping=_allow_overlapping_devices())
    verdicts: list = [None] * P.size
    dist.all_gather_object(verdicts, (ok, reason), group=P.meta_group)
    for g, (v_ok, v_reason) in enumerate(verdicts):
        if not v_ok:
            ok, reason = False, f"world rank {group_ranks[g]}: {v_reason}"
            break
    _AVAILABLE[key] = (ok, reason)
    return ok, reason


def log_fallback_once(reason: str) -> bool:
    """Log (warning, logger ``distfuse.fused``) that the unfused path is used because of ``reason``, once per reason.

    Returns True if this call logged.
    """
    if reason in _LOGGED:
        return False
    _LOGGED.add(reason)
    logger.warning("distfuse: fused kernels unavailable, using the unfused path: %s", reason)
    return True
