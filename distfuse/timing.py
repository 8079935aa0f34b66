"""The one timer: what ``bench/`` (through ``bench/harness.py``) and ``distfuse-tune`` time with.

Policy:

* A warm-up of ``warmup`` untimed runs, then ``reps`` timed runs.
* CUDA: each run bracketed by CUDA events, after flushing L2 (a 256 MB write) so that
  every run reads its inputs from HBM.  Pair it with inputs rotated over enough copies
  to exceed L2 (:func:`rotations`, :func:`rotating`).
* CUDA, one process: the runs are issued back to back and read after one synchronise at
  the end, as ``triton.testing.do_bench`` does (and ``bench/bench_halo_conv.py`` with it).
  The host issues a run while the device still flushes and runs the previous ones, as a
  training step's host runs ahead of its GPU, so a run's host time shows only where it
  outlasts the device's work (its flush and the runs before).  ``synced=True`` times each run
  once the previous one has synchronised instead: a cold call, whose host time shows wherever
  it outlasts its flush alone (the benchmarks record that time beside, ``ms_synced``).
  Multi-rank timing is always synced (the barrier and the all-reduce of each repetition).
* CPU: ``time.perf_counter`` around each run.  CPU times are for smoke runs and
  CPU-vs-CPU ratios only, never GPU claims.
* Multi-rank (``sync_group``): ranks start each repetition together (a barrier outside
  the timed region) and the repetition's time is the slowest rank's (an all-reduce MAX
  outside the timed region), because a collective finishes when its last rank does.
  ``sync_group`` must all-reduce a CPU tensor: gloo, or under NCCL
  ``distfuse.groups.metadata_group()`` / a partition's ``meta_group``.
* Summaries: the median and the 20th / 80th percentiles (:func:`summarize`).

This module lives in the package (not in ``bench/``, which is not installed) so that the
installed ``distfuse-tune`` and the benchmarks share it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["QUANTILES", "L2_FLUSH_BYTES", "summarize", "median", "time_samples", "time_fn", "time_interleaved",
           "issued_back_to_back", "rotations", "rotating"]

QUANTILES = (0.5, 0.2, 0.8)
L2_FLUSH_BYTES = 256 * 2**20


def summarize(times: list[float]) -> tuple[float, float, float]:
    """Median, q20, q80 (the quantiles :data:`QUANTILES`) of per-run times."""
    times = list(times)
    if not times:
        raise ValueError("summarize: no times")
    if len(times) == 1:
        return times[0], times[0], times[0]
    qs = statistics.quantiles(times, n=100, method="inclusive")
    return statistics.median(times), qs[19], qs[79]


def median(times: list[float]) -> float:
    return statistics.median(times)


def time_samples(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, device: torch.device | None = None,
                 sync_group=None, synced: bool = False) -> list[float]:
    """The per-run times of ``fn()`` in ms (warm-up, L2 flush on CUDA, slowest rank per repetition).

    CUDA runs of one process are issued back to back (one synchronise after the last) unless ``synced``; with a
    ``sync_group`` each repetition synchronises (see the module doc)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if cuda else None
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
        if sync_group is None and not synced:
            return issued_back_to_back(fn, reps, flush.zero_, torch.cuda.Event)
    times = []
    for _ in range(reps):
        if sync_group is not None:
            dist.barrier(group=sync_group)
        if cuda:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if sync_group is not None:
            t = torch.tensor([ms], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sync_group)
            ms = float(t)
        times.append(ms)
    return times


def issued_back_to_back(fn: Callable[[], object], reps: int, flush: Callable[[], object], event) -> list[float]:
    """``reps`` runs of ``fn`` issued without a synchronise between them, each after ``flush()`` and between two
    events of ``event(enable_timing=True)`` (``torch.cuda.Event``); the times in ms, read once the last run's end
    event has completed.  The events of run ``i`` bracket only run ``i``: the next flush is issued after its end
    event, so a run's time is its own device time plus any wait for the host, never a flush."""
    marks = []
    for _ in range(reps):
        flush()
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        fn()
        end.record()
        marks.append((start, end))
    if not marks:
        return []
    marks[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in marks]


def time_fn(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, device: torch.device | None = None,
            sync_group=None, synced: bool = False) -> tuple[float, float, float]:
    """Median, q20, q80 of ``fn``'s time in ms (:func:`time_samples`, then :func:`summarize`)."""
    return summarize(time_samples(fn, warmup=warmup, reps=reps, device=device, sync_group=sync_group, synced=synced))


def time_interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 3, rounds: int = 5, reps: int = 5,
                     device: torch.device | None = None, sync_group=None) -> dict[str, list[float]]:
    """Per-run times (ms) of several providers, taken in alternating rounds.

    Each round runs every provider for ``reps`` timed runs (after one untimed run; the
    first round after ``warmup`` untimed runs), alternating the order from round to
    round, so that a change of machine load (other jobs on a shared CPU, clocks) falls on
    all providers alike instead of on whichever ran last.  Summarize each list with
    :func:`summarize`.  Same timing rules as :func:`time_samples`.
    """
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            out[n] += time_samples(fns[n], warmup=warmup if r == 0 else 1, reps=reps, device=device,
                                   sync_group=sync_group)
    return out


def rotations(set_bytes: int, device: torch.device, budget_bytes: int = 4 * 2**30) -> int:
    """Input copies so that a full rotation exceeds L2 four times (capped at 8 and by a memory budget); 1 off CUDA."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20) or 64 * 2**20
    want = math.ceil(4 * l2 / max(1, set_bytes))
    return max(1, min(8, want, budget_bytes // max(1, set_bytes)))


def rotating(fn: Callable[[int], object], n: int) -> Callable[[], object]:
    """``fn(i)`` on input copy ``i % n``, ``i`` counting calls: a timer's ``fn()`` that walks the copies."""
    calls = itertools.count()
    return lambda: fn(next(calls) % n)
