"""The agreement flag round of a partition on one host: a shared-memory board, not a gloo all-reduce.

On the meta group the agreement flag round that a device partition takes before every
checked call (:func:`~distfuse.primitives._agreement.flag_round`) is a gloo all-reduce of
one integer, a TCP round trip through every rank: tens of microseconds on an idle node, far
more on a loaded one.  When every worker of the partition runs on one host (a GPU node's
tensor-parallel group), the round needs no message at all: the workers share a small
segment of ``/dev/shm``, each writes its word, and each reads the others'::

    board   int64 [W, 8]      one 64-byte line per worker (no false sharing); words 0 and 1 used
    round k worker r writes   board[r, k % 2] = 2 k + flag_r
            then waits until  board[p, k % 2] >= 2 k   for every peer p
            any flag          = any(board[p, k % 2] - 2 k)

A worker can be at most one round ahead of the slowest (it cannot finish round ``k + 1``
before every peer has written it), so a peer's word for round ``k`` is never overwritten
before it is read: two words per worker suffice, and each word is written whole (one
aligned 8-byte store), so no ordering between stores is relied on.  The wait spins
briefly, then yields the core (ranks oversubscribe CPU cores in tests), and ends after
the meta group's timeout (``DISTFUSE_TIMEOUT``) in a :class:`~distfuse.errors.CollectiveTimeoutError`
that names the peers that did not arrive, as the gloo round would.

Set-up is collective over the meta group, once per group, at its first round: the
workers compare host names, worker 0 creates the segment, the others map it, and one gloo
all-reduce both confirms that every worker mapped it and serves as the barrier after which
the name is unlinked (nothing is left in ``/dev/shm``, even if a process dies later).
Where any worker is on another host, cannot map the segment, or ``DISTFUSE_FLAG_BOARD=0``
is set (on every worker), every worker keeps the gloo round for that group.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import time

import torch
import torch.distributed as dist

from distfuse.errors import CollectiveTimeoutError, where
from distfuse.groups import WorldTable, group_timeout, timeout_label
from distfuse.primitives._common import collective_guard

__all__ = ["FlagBoard", "flag_board", "rounds_taken", "BOARD_VARIABLE"]

BOARD_VARIABLE = "DISTFUSE_FLAG_BOARD"
_SHM_DIR = "/dev/shm"
_LINE = 8  # int64 words per worker: one 64-byte cache line
_SPINS = 50  # reads before the wait starts yielding the core (ranks may oversubscribe the cores)

#: id(meta group) -> (the group, its board or None), per world: None keeps the gloo round for that group.
_BOARDS: WorldTable = WorldTable()


class FlagBoard:
    """The board of one meta group: :meth:`round` is :func:`~distfuse.primitives._agreement.flag_round`'s
    all-reduce of one flag over the group's workers, through shared memory."""

    def __init__(self, mapping: mmap.mmap, rank: int, world_ranks: tuple[int, ...], timeout_s: float):
        self._map = mapping  # kept open for the process's life: the peers' words live in it
        self._words = memoryview(mapping).cast("q")
        self.rank, self.world_ranks, self.timeout_s = rank, world_ranks, timeout_s
        self.rounds = 0

    def round(self, flag: bool, op: str) -> bool:
        """Whether any worker set its flag in this round (collective over the group's workers, in order)."""
        self.rounds += 1
        k, words, W = self.rounds, self._words, len(self.world_ranks)
        base, parity = 2 * k, k % 2
        words[self.rank * _LINE + parity] = base + (1 if flag else 0)
        spins, start = 0, None
        while True:  # a word read at >= base stays until this worker's next round (module docstring)
            seen = [words[p * _LINE + parity] for p in range(W)]
            waiting = [p for p in range(W) if seen[p] < base]
            if not waiting:
                return any(value > base for value in seen)
            spins += 1
            if spins > _SPINS:
                start = start if start is not None else time.monotonic()
                if time.monotonic() - start > self.timeout_s:
                    missing = sorted(self.world_ranks[p] for p in waiting)
                    raise CollectiveTimeoutError(
                        f"{where(op)}: agreement flag all-reduce with world ranks {sorted(self.world_ranks)} did not "
                        f"complete within the timeout in force ({timeout_label(self.timeout_s)}): world ranks "
                        f"{missing} did not reach the round on the shared-memory flag board. A peer that raised, died "
                        "or made a different call ends here")
                time.sleep(0 if spins < 4 * _SPINS else 50e-6)


def flag_board(P, op: str = "flag_round") -> FlagBoard | None:
    """The board of ``P``'s meta group (made at its first round: collective), or None where the group keeps gloo."""
    group = P.meta_group
    boards = _BOARDS.current()
    entry = boards.get(id(group))
    if entry is None or entry[0] is not group:
        with collective_guard(op, "agreement flag board set-up", P.ranks, group):
            entry = (group, _set_up(group))
        boards[id(group)] = entry
    return entry[1]


def rounds_taken() -> int:
    """The flag rounds this process has taken on boards (no message moves in them: what a message count misses)."""
    return sum(board.rounds for _, board in _BOARDS.values() if board is not None)


def _set_up(group) -> FlagBoard | None:
    """Collective over ``group``: the board where every worker shares this host and maps it, else None everywhere."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    world_ranks = tuple(dist.get_process_group_ranks(group))
    wanted = os.environ.get(BOARD_VARIABLE, "1") != "0" and os.path.isdir(_SHM_DIR)
    hosts: list = [None] * W
    dist.all_gather_object(hosts, (socket.gethostname(), wanted), group=group)
    if not all(ok for _, ok in hosts) or len({h for h, _ in hosts}) != 1:
        return None
    size = W * _LINE * 8
    name = [f"distfuse-flags-{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else ""]
    mapping = _map(name[0], size, os.O_CREAT | os.O_EXCL | os.O_RDWR) if rank == 0 else None
    try:
        dist.broadcast_object_list(name, src=world_ranks[0], group=group)
        if rank != 0:
            mapping = _map(name[0], size, os.O_RDWR)
        failed = torch.tensor([0 if mapping is not None else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=group)  # every worker mapped it, or none keeps it; also the barrier before unlink
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_SHM_DIR, name[0]))
    if int(failed[0]) != 0:
        if mapping is not None:
            mapping.close()
        return None
    return FlagBoard(mapping, rank, world_ranks, group_timeout(group))


def _map(name: str, size: int, flags: int) -> mmap.mmap | None:
    """The segment ``name`` of ``/dev/shm`` opened with ``flags`` (created zero-filled, below every round's words,
    with ``O_CREAT``) and mapped; None where that fails (every worker then keeps gloo)."""
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), flags, 0o600)
        try:
            if flags & os.O_CREAT:
                os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None
