"""Pools of forked gloo ranks that run test functions, reused across tests.

A forked gloo world starts far faster than a spawned one, and a pool that stays up costs
nothing per test.  :func:`run_ranks` sends a module-level function (pickled by reference) to
every rank of the pool for ``world_size`` and returns the per-rank results.

Guarantees:

* **Every call has a deadline.**  Past it, every rank of the pool is killed and
  :class:`RankTimeout` names the ranks that did not answer.  Collectives inside the ranks
  also carry the process-group timeout, so a mismatched collective becomes an error rather
  than a hang.
* **Every rank's exception comes back with its rank id** (:class:`RankFailure`), and with
  the time from the start of the call to that rank's answer (``RankFailure.times``).  After
  the first error the pool waits a grace period for the others' errors (see
  :func:`run_ranks`), so that a peer blocked in a collective reports its own timeout instead
  of being killed.
* **A pool that failed is rebuilt** before its next use, because a rank that raised may have
  left peers inside a collective.

Children call ``torch.set_num_threads(1)`` first: forked children of a parent that already
used OpenMP otherwise hang, and one thread per rank is right on small CI machines anyway.

Never make a process group in the process that forks the pools: after one was made, used for
a backward and destroyed there, pools forked later stalled in their compiled calls (a flag
round timed out).  Run such work on a pool's rank (``run_ranks(1, fn)``) or in a fresh
process.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["RankPool", "RankFailure", "RankTimeout", "run_ranks", "discard_pool", "shutdown_pools"]

DEFAULT_CALL_TIMEOUT = float(os.environ.get("DISTFUSE_TEST_TIMEOUT", "120"))
# Collectives in test ranks time out well inside the call deadline, so that a rank
# stuck in a mismatched collective reports an error instead of being killed.
DEFAULT_PG_TIMEOUT = float(os.environ.get("DISTFUSE_TEST_PG_TIMEOUT", "30"))


class RankFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank id to its formatted traceback.

    ``times`` maps rank id to the seconds from the start of the call to that rank's answer
    (error or result); ranks that never answered have no entry.
    """

    def __init__(self, errors: dict[int, str], world_size: int, times: dict[int, float] | None = None):
        self.errors = errors
        self.times = dict(times or {})
        body = "\n".join(f"--- rank {r} of {world_size} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {world_size} ranks raised:\n{body}")


class RankTimeout(TimeoutError):
    """Ranks did not answer within the deadline; the pool was killed."""


def _worker_main(rank: int, world_size: int, init_file: str, conn, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["DISTFUSE_TIMEOUT"] = str(pg_timeout)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
    except Exception:  # report the start-up failure to the parent and exit
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    profile = _rank_profiler(rank, world_size)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break  # parent went away
        task = pickle.loads(payload)
        if task is None:
            break
        fn, args, kwargs = task
        try:
            if profile is not None:
                profile.enable()
            try:
                data = pickle.dumps(("ok", fn(*args, **kwargs)))
            finally:
                if profile is not None:
                    profile.disable()
                    profile.dump_stats(profile.path)
        except BaseException:  # noqa: B036 - every failure must reach the parent with its rank id
            data = pickle.dumps(("err", traceback.format_exc()))
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            break
    with contextlib.suppress(Exception):  # best effort at exit
        dist.destroy_process_group()


def _rank_profiler(rank: int, world_size: int):
    """A ``cProfile.Profile`` for this rank where ``DISTFUSE_POOL_PROFILE`` names a folder (else None): the pool's
    tasks run under it, and its stats go to ``<folder>/w<world_size>r<rank>-<pid>.prof`` after each task (a killed
    pool keeps what its last finished task wrote), to see where a suite's rank time goes (``pstats``)."""
    folder = os.environ.get("DISTFUSE_POOL_PROFILE")
    if not folder:
        return None
    import cProfile

    os.makedirs(folder, exist_ok=True)
    profile = cProfile.Profile()
    profile.path = os.path.join(folder, f"w{world_size}r{rank}-{os.getpid()}.prof")
    return profile


def _warm_parent_imports() -> None:
    """Import, once in the parent, what every rank would otherwise import on first use (a process's first
    backward imports sympy, its first ``assert_close`` ``torch.distributed.tensor``): forked children inherit
    the parent's modules, so this saves the imports in every rank of every pool."""
    import torch
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


class RankPool:
    """``world_size`` forked processes joined in one gloo world."""

    def __init__(self, world_size: int, pg_timeout: float = DEFAULT_PG_TIMEOUT, start_timeout: float = 60.0,
                 error_grace: float = 2.0):
        _warm_parent_imports()
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.error_grace = error_grace
        self.broken = False
        ctx = mp.get_context("fork")
        fd, self._init_file = tempfile.mkstemp(prefix="distfuse-pg-")
        os.close(fd)
        os.unlink(self._init_file)  # FileStore creates it; a stale file would confuse it
        self._procs, self._conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, self._init_file, child, pg_timeout),
                               daemon=True, name=f"distfuse-rank{rank}of{world_size}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> dict[int, tuple]:
        """Every rank's reply; on an error or past ``timeout`` the pool is closed and RankFailure / RankTimeout
        raised."""
        start = time.monotonic()
        deadline = start + timeout
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        replies: dict[int, tuple] = {}
        self.last_times: dict[int, float] = {}
        first_error_at = None
        while pending:
            now = time.monotonic()
            wait = deadline - now
            if first_error_at is not None:
                # Once one rank failed, give the others a grace period to report theirs.
                wait = min(wait, first_error_at + self.error_grace - now)
            if wait <= 0:
                break
            for conn in mpc.wait(list(pending), timeout=wait):
                rank = pending.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(1.0)  # the exit code is known only once the process is reaped
                    code = self._procs[rank].exitcode
                    replies[rank] = ("err", f"rank {rank} died (exit code {code}) during {what}")
                self.last_times[rank] = time.monotonic() - start
                if replies[rank][0] == "err" and first_error_at is None:
                    first_error_at = time.monotonic()
        errors = {r: body for r, (kind, body) in replies.items() if kind == "err"}
        if errors or pending:
            self.close()
        missing = sorted(pending.values())
        if errors:
            errors.update({r: f"no answer within the grace period ({self.error_grace:.0f} s) after rank "
                              f"{min(errors)} failed" for r in missing})
            raise RankFailure(errors, self.world_size, self.last_times)
        if missing:
            raise RankTimeout(f"ranks {missing} of {self.world_size} did not finish {what} within {timeout:.0f} s; "
                              "the pool was killed")
        return replies

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("RankPool: this pool failed earlier; get a new one from run_ranks")
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        deadline = timeout if timeout is not None else DEFAULT_CALL_TIMEOUT
        replies = self._collect(deadline, getattr(fn, "__name__", "task"))
        return [replies[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        self.broken = True
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 1.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._init_file)


_POOLS: dict[tuple[int, float], RankPool] = {}


def _pool_key(world_size: int, pg_timeout: float | None) -> tuple[int, float]:
    return world_size, float(pg_timeout) if pg_timeout is not None else DEFAULT_PG_TIMEOUT


def run_ranks(world_size: int, fn, *args, timeout: float | None = None, pg_timeout: float | None = None,
              **kwargs) -> list:
    """Run ``fn`` on every rank of a (reused) pool of ``world_size`` gloo ranks.

    ``fn`` must be importable by reference (a module-level function).  Returns the
    per-rank results in rank order; raises :class:`RankFailure` or :class:`RankTimeout`.

    ``pg_timeout`` (seconds) selects a pool whose process groups (and ``DISTFUSE_TIMEOUT``)
    use that timeout instead of the default; pools are kept per ``(world_size,
    pg_timeout)``.  Such a pool waits ``pg_timeout + 5`` s after a first error for the
    other ranks' own errors (fault-injection tests); the default pools wait 2 s.  ``timeout`` and ``pg_timeout`` are
    taken by the harness, not passed to ``fn``.
    """
    key = _pool_key(world_size, pg_timeout)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        grace = 2.0 if pg_timeout is None else float(pg_timeout) + 5.0
        pool = _POOLS[key] = RankPool(world_size, pg_timeout=key[1], error_grace=grace)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def discard_pool(world_size: int, pg_timeout: float | None = None) -> None:
    """Close the pool for ``(world_size, pg_timeout)`` so that the next call starts a fresh one.

    For tests whose ranks caught a collective timeout themselves: the pool did not fail,
    but its process groups are spent (gloo closes the pairs of a timed-out group).
    """
    pool = _POOLS.pop(_pool_key(world_size, pg_timeout), None)
    if pool is not None and not pool.broken:
        pool.close()


def shutdown_pools() -> None:
    for pool in _POOLS.values():
        if not pool.broken:
            pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
