"""The CPU backend of :class:`~distfuse.fused.symmetric.SymmetricWorkspace`: POSIX shared memory in ``/dev/shm``.

One POSIX shared-memory segment per rank, mapped by every rank of the host.  Set-up is
leak-free: create, barrier, map all peers, barrier, then every rank unlinks every name;
the mappings keep the memory alive, so ``/dev/shm`` holds nothing once set-up returns on
any rank, even if a process dies later.  During set-up the names are also unlinked in
``finally`` and at exit.  Names are
``distfuse-<pid of rank 0>-<random token>-<crc of the group ranks>-g<generation>-r<rank>``.
The barrier is ``monitored_barrier`` on ``P.meta_group`` (gloo) with the group timeout
(it names the rank that did not arrive); it also stands in for the flags: the consumer
checks each flag once after it and raises if one is missing.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import zlib
from collections.abc import Callable

import torch

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.partition import Partition

SHM_DIR = "/dev/shm"
SHM_PREFIX = "distfuse-"

_PENDING_UNLINK: set[str] = set()


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    _PENDING_UNLINK.discard(name)


def _unlink_pending() -> None:
    for name in list(_PENDING_UNLINK):
        _unlink(name)


atexit.register(_unlink_pending)


def setup_shm(ws, P: Partition, total: int, agreed: dict, fault: Callable[[str], None]) -> list[torch.Tensor]:
    """Create, map and unlink the segments of ``ws`` (a ``SymmetricWorkspace``); returns every rank's buffer.

    Collective over ``P``.  ``fault(step)`` is called after each set-up step (a test hook).
    Sets ``ws.segment_names`` and, on success, ``ws._maps``.
    """
    if not os.path.isdir(SHM_DIR):
        raise UnsupportedError(f"{where('SymmetricWorkspace')}: {SHM_DIR} does not exist; the CPU backend needs "
                               "POSIX shared memory")
    crc = zlib.crc32(repr(P.ranks).encode())
    prefix = f"{SHM_PREFIX}{agreed['pid']}-{agreed['token']:08x}-{crc:08x}-g{ws.generation}"
    names = [f"{prefix}-r{r}" for r in range(P.size)]
    ws.segment_names = names
    own = names[ws.rank]
    maps: list[mmap.mmap | None] = [None] * P.size
    _PENDING_UNLINK.add(own)
    ok = False
    try:
        fd = os.open(os.path.join(SHM_DIR, own), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)  # zero-filled: flags start at 0, below every epoch
            maps[ws.rank] = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        fault("after_create")
        ws.barrier("SymmetricWorkspace.setup")  # every segment exists
        for r, name in enumerate(names):
            if r == ws.rank:
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
        fault("after_map")
        ws.barrier("SymmetricWorkspace.setup")  # every rank has mapped every segment
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
    ws._maps = maps
    return [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
