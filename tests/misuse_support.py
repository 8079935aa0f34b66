"""Helpers shared by the misuse tests: catching a rank's outcome, a refusal while compiling, and partitions with a
long timeout."""

from __future__ import annotations

import os
import time

from torch.distributed.constants import default_pg_timeout

from distfuse import Partition
from distfuse.testing import run_ranks

#: torch's default process-group timeout (30 minutes): misuse runs in a world group left at it, so a hang shows
#: as the harness's deadline being missed, never hidden behind a short group timeout.
PG_DEFAULT = default_pg_timeout.total_seconds()

__all__ = ["catch", "tracing_refusal", "patient_grid", "run_misuse", "PG_DEFAULT"]


def catch(fn):
    """``("ok", result)`` or ``(error type, message, seconds)``: what a rank's call did, and how fast it failed."""
    t0 = time.monotonic()
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect every kind
        return type(exc).__name__, str(exc), time.monotonic() - t0


def tracing_refusal(call) -> str | None:
    """The distfuse refusal ``call()`` raised, typically while ``torch.compile`` traced it (None when it ran)."""
    from distfuse.errors import UnsupportedError

    try:
        call()
    except UnsupportedError as exc:
        return str(exc)
    except Exception as exc:  # dynamo may wrap the error raised while tracing
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {cause}"
    return None


def patient_grid(cache: dict, ranks, shape, timeout: str = "60"):
    """A Cartesian partition over ``ranks`` whose groups wait ``DISTFUSE_TIMEOUT=timeout`` (cached in ``cache``).

    distfuse's world groups are made first with ``DISTFUSE_TIMEOUT=3``, as in the other
    misuse tests; a prompt error then proves the flag or round reached every rank, not a
    timeout of the partition's own groups.
    """
    key = (tuple(ranks), tuple(shape))
    if key not in cache:
        if "world" not in cache:
            os.environ["DISTFUSE_TIMEOUT"] = "3"
            cache["world"] = Partition.world()
        os.environ["DISTFUSE_TIMEOUT"] = timeout
        cache[key] = cache["world"].create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return cache[key]


def _with_distfuse_timeout(seconds: str, fn, *args):
    os.environ["DISTFUSE_TIMEOUT"] = seconds
    return fn(*args)


def run_misuse(world: int, fn, *args, seconds: str = "10", timeout: float = 120):
    """``run_ranks(world, fn, *args)`` in a pool whose world group keeps torch's default timeout, with
    ``DISTFUSE_TIMEOUT=seconds`` in the ranks: every misuse must fail by name within distfuse's own timeout,
    and the harness's ``timeout`` catches a call that would hang instead."""
    return run_ranks(world, _with_distfuse_timeout, seconds, fn, *args, pg_timeout=PG_DEFAULT, timeout=timeout)
