"""``distfuse-tune``: measure fused against unfused over shapes, write the crossover table that dispatch reads.

Run it once per cluster (device type x world size x dtype), on every rank::

    torchrun --nproc-per-node 8 -m distfuse.tune --dtype bfloat16      # NCCL, all 8 GPUs
    torchrun --nproc-per-node 8 -m distfuse.tune --world-sizes 2 4 8   # also the TP=2 and TP=4 groups
    distfuse-tune --quick                                             # one process (world size 1)

For each op (``linear_rs``, ``linear_ag``, ``halo_conv``), dtype and world size it times
the fused and the unfused path over a grid of shapes (:func:`default_grid`), finds the
size interval where fused wins (:func:`crossover`) and writes, on rank 0, one entry per
``table_key(device, world, dtype, op)`` into the JSON file that
:func:`distfuse.layers.dispatch.load_table` reads (``--out``, else
``$DISTFUSE_TUNE_TABLE``, else ``~/.cache/distfuse/crossover.json``).  Entries of other
devices and world sizes already in the file are kept.

File layout (keys with a ``|`` are crossover entries; the rest are sections dispatch ignores)::

    {
      "NVIDIA H200|8|bfloat16|linear_rs": {"min_size": 3.1e9, "fused": "interval", "size_key": "macs",
                                           "points": [[size, fused_ms, unfused_ms], ...], ...},
      "triton_configs": {"NVIDIA H200|8|bfloat16|linear_rs": {"gemm_rs": [{"key": [...], "kwargs": {...},
                                                                             "num_warps": 8, "num_stages": 3}]}},
      "sweeps": {"<key>": {"size_key": ..., "points": [{"shape": ..., "size": ..., "fused_ms": ...,
                                                       "unfused_ms": ...}]}},
      "_meta": {"format": 1, "runs": {"NVIDIA H200|8": {"date": ..., "torch": ..., "notes": [...]}}}
    }

An entry means: fused when ``min_size <= size <= max_size`` (a missing bound is open),
``size`` being :func:`distfuse.layers.dispatch.size_of` (channels for halo_conv, the
per-rank ``m*n*k`` for the linears).  "Fused never" is written as ``max_size: -1``.

Triton configs.  On CUDA the GEMM kernels autotune (``DISTFUSE_AUTOTUNE``); after each
sweep the configs the autotuners picked (``Autotuner.cache``: key -> ``triton.Config``)
are saved under ``triton_configs``.  :func:`seed_autotune_caches` puts them back into the
autotuners' caches in a later process (same device, world size, dtype and Triton
version), so the first launch of a tuned shape skips the benchmarking; a launcher can
also pass one of them as its explicit ``config=`` (``gemm_rs`` and ``ag_push`` take one).

Timing.  Per repetition the slowest rank's time (host all-reduce MAX on the gloo
metadata group, outside the timed region), after a barrier; median of ``--reps``.  On
CUDA: CUDA events, L2 flushed (256 MB write) before every run, random inputs rotated
over enough copies to exceed L2 four times.  (This is the policy of ``bench/harness.py``;
the installed package cannot import ``bench/``, which is not installed, so the timer is
repeated here.)

CPU / gloo.  The production path on CPU is unfused and the fused kernels would run in
the Triton interpreter, whose times mean nothing: the sweep times the unfused providers
only, records "fused unavailable" in ``_meta`` and writes no crossover entries.  The
same holds on GPUs without symmetric memory between the ranks (no P2P) for the linears.
World size 1 has nothing to fuse for the linears (both paths are one GEMM): skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from distfuse.layers.dispatch import SIZE_KEYS, _table_path, size_of, table_key
from distfuse.partition import cuda_backend_of

__all__ = [
    "Crossover",
    "crossover",
    "default_grid",
    "entry_for",
    "write_table",
    "harvest_autotune_caches",
    "seed_autotune_caches",
    "config_to_json",
    "sweep",
    "main",
]

OPS = ("linear_rs", "linear_ag", "halo_conv")
SECTIONS = ("triton_configs", "sweeps", "_meta")
FORMAT = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NEVER = -1.0  # max_size of a "fused never" entry: every size is >= 0


# ---------------------------------------------------------------- crossover extraction (pure)


@dataclass(frozen=True)
class Crossover:
    """Where fused beats unfused, from measured points.

    ``min_size``/``max_size`` are None where the interval is open (fused already wins at
    the smallest / still wins at the largest size measured; the table then extends it).
    """

    min_size: float | None
    max_size: float | None
    fused: str  # "interval", "always" or "never"
    wins: tuple[float, ...] = ()  # sizes where fused won (by more than the margin)
    excluded_wins: tuple[float, ...] = ()  # wins outside the chosen interval (isolated: treated as noise)

    def fused_at(self, size: float) -> bool:
        if self.fused == "never":
            return False
        lo = -math.inf if self.min_size is None else self.min_size
        hi = math.inf if self.max_size is None else self.max_size
        return lo <= size <= hi

    def entry(self) -> dict:
        """The table entry dispatch reads (``min_size``/``max_size``) plus what it rests on."""
        out: dict = {"fused": self.fused}
        if self.fused == "never":
            out["max_size"] = NEVER
            return out
        if self.min_size is not None:
            out["min_size"] = self.min_size
        if self.max_size is not None:
            out["max_size"] = self.max_size
        if self.excluded_wins:
            out["excluded_wins"] = list(self.excluded_wins)
        return out


def _crossing(s0: float, g0: float, s1: float, g1: float) -> float:
    """Size where the gain crosses zero between (s0, g0) and (s1, g1) (opposite signs or a zero), log-interpolated."""
    if g0 == g1:
        return s0
    t = g0 / (g0 - g1)
    if s0 > 0 and s1 > 0:
        return float(math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0))))
    return float(s0 + t * (s1 - s0))


def crossover(points: Iterable[tuple[float, float | None, float]], margin: float = 0.0) -> Crossover:
    """The size interval where fused wins, from ``(size, fused_ms, unfused_ms)`` points.

    The gain at a point is ``log(unfused_ms / (fused_ms * (1 + margin)))``: positive when
    fused is faster by more than ``margin``.  Points of equal size are averaged (in the
    log).  The interval is the contiguous run of sizes with the largest total gain (a
    maximum-subarray), so one noisy loss inside a winning region does not split it, and
    an isolated noisy win outside it is reported in ``excluded_wins`` instead of
    becoming a second interval (dispatch reads one).  Its bounds are where the gain
    crosses zero between the last losing and first winning sizes, interpolated in
    log-size (sizes span decades); an interval reaching the smallest or the largest
    size measured is left open on that side.  Points without a fused time are ignored.
    """
    by_size: dict[float, list[float]] = {}
    for size, fused_ms, unfused_ms in points:
        if fused_ms is None or unfused_ms is None or not (fused_ms > 0 and unfused_ms > 0):
            continue
        by_size.setdefault(float(size), []).append(math.log(unfused_ms / (fused_ms * (1.0 + margin))))
    if not by_size:
        raise ValueError("crossover: no point has both a fused and an unfused time")
    sizes = sorted(by_size)
    gains = [sum(by_size[s]) / len(by_size[s]) for s in sizes]
    wins = tuple(s for s, g in zip(sizes, gains, strict=True) if g > 0)
    # Kadane: the run [lo, hi] with the largest sum of gains (strictly positive, else "never").
    best, best_lo, best_hi = 0.0, -1, -1
    run, run_lo = 0.0, 0
    for i, g in enumerate(gains):
        if run <= 0:
            run, run_lo = g, i
        else:
            run += g
        if run > best:
            best, best_lo, best_hi = run, run_lo, i
    if best_lo < 0:
        return Crossover(None, None, "never", wins, wins)
    # A maximal run starts and ends on a win; trim zero-gain ends so the bounds sit on wins.
    while gains[best_lo] <= 0:
        best_lo += 1
    while gains[best_hi] <= 0:
        best_hi -= 1
    lo = None if best_lo == 0 else _crossing(sizes[best_lo - 1], gains[best_lo - 1], sizes[best_lo], gains[best_lo])
    hi = None if best_hi == len(sizes) - 1 else _crossing(sizes[best_hi], gains[best_hi], sizes[best_hi + 1],
                                                          gains[best_hi + 1])
    excluded = tuple(s for s in wins if not sizes[best_lo] <= s <= sizes[best_hi])
    kind = "always" if lo is None and hi is None else "interval"
    return Crossover(lo, hi, kind, wins, excluded)


# ---------------------------------------------------------------- table file


def entry_for(op: str, points: Sequence[dict], margin: float = 0.0, **info) -> dict:
    """Table entry for measured sweep points (dicts with ``size``, ``fused_ms``, ``unfused_ms``)."""
    xo = crossover([(p["size"], p.get("fused_ms"), p["unfused_ms"]) for p in points], margin)
    entry = xo.entry()
    entry.update(size_key=SIZE_KEYS[op], margin=margin,
                 points=[[p["size"], p.get("fused_ms"), p["unfused_ms"]] for p in points], **info)
    return entry


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_table(path: Path | str | None, entries: dict | None = None, *, triton_configs: dict | None = None,
                sweeps: dict | None = None, run_meta: dict | None = None) -> Path:
    """Merge into the crossover table at ``path`` (default: where dispatch looks) and write it atomically.

    ``entries``: ``table_key -> entry``; ``triton_configs`` and ``sweeps``: keyed the same;
    ``run_meta``: ``"device|world" -> info`` for ``_meta.runs``.  Keys already in the file
    and not given are kept (other devices, world sizes, dtypes, ops).
    """
    path = Path(path) if path is not None else _table_path()
    table = _read_json(path)
    for k, v in (entries or {}).items():
        if "|" not in k:
            raise ValueError(f"write_table: {k!r} is not a table key (device|world|dtype|op)")
        table[k] = v
    for section, new in (("triton_configs", triton_configs), ("sweeps", sweeps)):
        if new:
            table.setdefault(section, {}).update(new)
    meta = table.setdefault("_meta", {})
    meta.update(format=FORMAT, written_by="distfuse-tune")
    if run_meta:
        meta.setdefault("runs", {}).update(run_meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".crossover-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # readers (dispatch re-reads on mtime change) never see a half-written file
    return path


# ---------------------------------------------------------------- Triton autotune caches


def config_to_json(cfg) -> dict:
    """A ``triton.Config`` as JSON (kwargs, num_warps, num_stages, and num_ctas / maxnreg when set)."""
    out = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if getattr(cfg, "num_ctas", 1) not in (None, 1):
        out["num_ctas"] = cfg.num_ctas
    if getattr(cfg, "maxnreg", None) is not None:
        out["maxnreg"] = cfg.maxnreg
    return out


def _key_to_json(key) -> list:
    return [k if isinstance(k, (int, float, str, bool)) or k is None else str(k) for k in key]


def _autotuners() -> dict:
    """The GEMM kernels' ``triton.autotune`` objects (None entries dropped: no autotuning without CUDA)."""
    try:
        from distfuse.kernels import ag_gemm, gemm_rs
    except Exception:  # noqa: BLE001 - kernels unavailable (no Triton): nothing to harvest
        return {}
    tuners = {"chunk_reduce": getattr(gemm_rs, "_chunk_reduce_tuned", None),
              "ag_push": getattr(ag_gemm, "_push_tuned", None)}
    # The GEMMs have one autotuner per operand size (fp32 tiles have their own configs).
    for name, by_size in (("gemm_rs", getattr(gemm_rs, "_gemm_rs_tuned", {})),
                          ("ag_gemm", getattr(ag_gemm, "_ag_gemm_tuned", {}))):
        for size, tuner in (by_size or {}).items():
            tuners[name if size == 2 else f"{name}_fp32"] = tuner
    return {k: v for k, v in tuners.items() if v is not None and isinstance(getattr(v, "cache", None), dict)}


def harvest_autotune_caches(tuners: dict | None = None, skip: dict | None = None) -> dict:
    """``kernel -> [{"key": [...], **config}]`` from the autotuners' caches, minus the keys in ``skip``.

    ``skip`` is an earlier harvest (``kernel -> set of key tuples``, see :func:`_cache_keys`),
    so that each sweep records the configs its own shapes produced.
    """
    tuners = _autotuners() if tuners is None else tuners
    out = {}
    for name, tuner in tuners.items():
        seen = (skip or {}).get(name, set())
        got = [dict(key=_key_to_json(k), **config_to_json(c)) for k, c in tuner.cache.items() if k not in seen]
        if got:
            out[name] = got
    return out


def _cache_keys(tuners: dict) -> dict:
    return {name: set(t.cache) for name, t in tuners.items()}


def seed_autotune_caches(table: dict | None = None, device_name: str | None = None, world_size: int | None = None,
                         dtype: torch.dtype | None = None, tuners: dict | None = None) -> int:
    """Put saved configs back into the autotuners' caches; returns how many were seeded.

    Only entries of this device (and world size / dtype when given) are used, and only
    when the table was written by the installed Triton version (autotune keys and
    config semantics may change between versions).  Call it before the first fused launch.
    """
    import triton

    from distfuse.layers.dispatch import load_table

    table = load_table() if table is None else table
    tuners = _autotuners() if tuners is None else tuners
    saved = table.get("triton_configs", {})
    runs = table.get("_meta", {}).get("runs", {})
    n = 0
    for key, kernels in saved.items():
        dev, world, dt, _op = key.split("|")
        if (device_name is not None and dev != device_name) or (world_size is not None and int(world) != world_size) \
                or (dtype is not None and dt != str(dtype).removeprefix("torch.")):
            continue
        if runs.get(f"{dev}|{world}", {}).get("triton") != triton.__version__:
            continue  # written by another Triton version (or unknown): its keys and configs may not apply
        for name, configs in kernels.items():
            tuner = tuners.get(name)
            if tuner is None:
                continue
            for c in configs:
                extra = {k: c[k] for k in ("num_ctas", "maxnreg") if k in c}
                tuner.cache[tuple(c["key"])] = triton.Config(dict(c["kwargs"]), num_warps=c["num_warps"],
                                                             num_stages=c["num_stages"], **extra)
                n += 1
    return n


# ---------------------------------------------------------------- shape grids


def _split(world: int, nd: int) -> tuple[int, ...]:
    """A near-square grid of ``world`` workers over ``nd`` axes (prime factors, largest first, to the smallest axis)."""
    factors, n, p = [], world, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    grid = [1] * nd
    for f in sorted(factors, reverse=True):
        grid[grid.index(min(grid))] *= f
    return tuple(sorted(grid))


def default_grid(op: str, world: int, *, quick: bool = False, m: Sequence[int] | None = None, hidden: int | None = None,
                 ffn: int | None = None, channels: Sequence[int] | None = None, extent: int | None = None,
                 nd: int = 2) -> list[dict]:
    """Per-rank shapes of ``op`` at world size ``world`` (the dict :func:`size_of` and the timers read).

    Linears: an MLP of ``hidden`` and ``ffn`` sizes (LLaMA-3 8B: 4096 and 14336) over
    sequence lengths ``m`` (decode to long prefill).  RS (down projection) runs the
    per-rank GEMM ``m x hidden x ffn/W``; AG (up projection) ``m x ffn/W x hidden``.
    Halo conv: ``channels`` in and out, a ``extent^nd`` block per rank, kernel 3.
    ``quick``: tiny shapes for CI (CPU, seconds).
    """
    if op in ("linear_rs", "linear_ag"):
        ms = list(m or ((8, 32) if quick else (64, 256, 1024, 4096, 16384)))
        h = hidden or (32 if quick else 4096)
        f = ffn or (64 if quick else 14336)
        part = max(1, f // world)
        if op == "linear_rs":
            return [dict(m=mm, n=h, k=part) for mm in ms]
        return [dict(m=mm, n=part, k=h) for mm in ms]
    if op == "halo_conv":
        cs = list(channels or ((2, 4) if quick else (8, 16, 32, 64, 128, 256)))
        e = extent or (8 if quick else 128)
        return [dict(channels=c, extent=e, nd=nd, kernel=3, batch=1) for c in cs]
    raise KeyError(f"distfuse-tune: unknown op {op!r}; known: {list(OPS)}")


# ---------------------------------------------------------------- timing


class _Timer:
    """Median ms over ranks (max per repetition); CUDA events + L2 flush on GPUs, perf_counter on CPU."""

    def __init__(self, device: torch.device, group, warmup: int, reps: int):
        self.device, self.group, self.warmup, self.reps = device, group, warmup, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[int], object], rotations: int) -> float:
        for i in range(self.warmup):
            fn(i % rotations)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        times = []
        for i in range(self.reps):
            if self.group is not None:
                dist.barrier(group=self.group)
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i % rotations)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn(i % rotations)
                ms = (time.perf_counter() - t0) * 1e3
            if self.group is not None:
                t = torch.tensor([ms], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                ms = float(t)
            times.append(ms)
        times.sort()
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def _rotations(set_bytes: int, device: torch.device, budget_bytes: int = 4 * 2**30) -> int:
    """Input copies so that a full rotation exceeds L2 four times (capped at 8 and by a memory budget)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20) or 64 * 2**20
    want = math.ceil(4 * l2 / max(1, set_bytes))
    return max(1, min(8, want, budget_bytes // max(1, set_bytes)))


@contextlib.contextmanager
def _forced_path(path: str):
    old = os.environ.get("DISTFUSE_PATH")
    os.environ["DISTFUSE_PATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISTFUSE_PATH", None)
        else:
            os.environ["DISTFUSE_PATH"] = old


# ---------------------------------------------------------------- cases: (fused fn, unfused fn) per shape


@dataclass
class _Case:
    unfused: Callable[[int], object]
    fused: Callable[[int], object] | None
    rotations: int
    check: Callable[[str], str | None] = lambda path: None  # after a call on ``path``: an error, or None
    cleanup: Callable[[], None] = lambda: None


def _randn(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _linear_case(op: str, shape: dict, dtype, device, P_sub, full: bool, fused_ok: bool) -> _Case:
    import torch.nn.functional as F

    from distfuse.decomposition import block_extent
    from distfuse.fused.linear_ag import all_gather_matmul
    from distfuse.fused.linear_rs import matmul_reduce_scatter
    from distfuse.primitives.all_gather import all_gather
    from distfuse.primitives.reduce_scatter import reduce_scatter

    W, r = P_sub.size, P_sub.rank
    m, n, k = shape["m"], shape["n"], shape["k"]
    gen = torch.Generator().manual_seed(1234 + 7 * r)
    esize = torch.empty(0, dtype=dtype).element_size()
    rows = m if op == "linear_rs" else block_extent(m, W, r)
    out_rows = block_extent(m, W, r) if op == "linear_rs" else m
    set_bytes = esize * (rows * k + out_rows * n + (m * n if op == "linear_rs" else m * k))
    R = _rotations(set_bytes, device)
    xs = [_randn((1, rows, k), gen, dtype, device).requires_grad_(full) for _ in range(R)]
    w = _randn((n, k), gen, dtype, device, 1.0 / math.sqrt(k)).requires_grad_(full)
    dys = [_randn((1, out_rows, n), gen, dtype, device) for _ in range(R)] if full else None

    def finish(y, i):
        if full:
            xs[i].grad, w.grad = None, None
            y.backward(dys[i])
        return y

    ctx = contextlib.nullcontext if full else torch.no_grad
    if op == "linear_rs":
        def unfused(i):
            with ctx():
                return finish(reduce_scatter(F.linear(xs[i], w), P_sub), i)

        def fused(i):
            with ctx():
                return finish(matmul_reduce_scatter(xs[i], w, None, P_sub), i)
    else:
        def unfused(i):
            with ctx():
                return finish(F.linear(all_gather(xs[i], P_sub, (1, m, k)), w), i)

        def fused(i):
            with ctx():
                return finish(all_gather_matmul(xs[i], w, None, P_sub, n=m), i)
    return _Case(unfused, fused if fused_ok else None, R)


def _halo_case(shape: dict, dtype, device, world: int, world_ranks: Sequence[int], full: bool,
               fused_ok: bool) -> _Case:
    """A feature-distributed ConvNd on a near-square grid; the path is forced with ``DISTFUSE_PATH``.

    Construction is collective over the whole world (partitions); only active ranks time.
    """
    from distfuse import Partition
    from distfuse.layers import DistributedConv1d, DistributedConv2d, DistributedConv3d

    nd, c, e = shape["nd"], shape["channels"], shape["extent"]
    grid = _split(world, nd)
    P = Partition.world(device=device).create_partition_inclusive(world_ranks)
    P_x = P.create_cartesian_topology_partition([1, 1, *grid])
    cls = {1: DistributedConv1d, 2: DistributedConv2d, 3: DistributedConv3d}[nd]
    k = shape.get("kernel", 3)
    layer = cls(P_x, c, c, k, padding=k // 2, device=device, dtype=dtype)
    if not P_x.active:
        return _Case(lambda i: None, None, 1)
    layer.requires_grad_(full)
    gen = torch.Generator().manual_seed(99 + P_x.rank)
    b = shape.get("batch", 1)
    esize = torch.empty(0, dtype=dtype).element_size()
    set_bytes = 3 * esize * b * c * (e + 2) ** nd
    R = _rotations(set_bytes, device)
    xs = [_randn((b, c, *(e,) * nd), gen, dtype, device).requires_grad_(full) for _ in range(R)]
    dys = [_randn((b, c, *(e,) * nd), gen, dtype, device) for _ in range(R)] if full else None
    ctx = contextlib.nullcontext if full else torch.no_grad

    def call(path):
        def fn(i):
            with _forced_path(path), ctx():
                y = layer(xs[i])
                if full:
                    xs[i].grad = None
                    layer.zero_grad(set_to_none=True)
                    y.backward(dys[i])
                return y
        return fn

    def check(path):
        if layer.last_path != path:
            return f"asked for the {path} path, the layer ran {layer.last_path} ({layer.last_decision.reason})"
        return None

    return _Case(call("unfused"), call("fused") if fused_ok else None, R, check)


# ---------------------------------------------------------------- availability


def _fused_available(op: str, P, device: torch.device, dtype) -> tuple[bool, str]:
    """Whether this sweep may time the fused path; collective over ``P`` for the linears (symmetric memory probe)."""
    if device.type != "cuda":
        return False, (f"{device.type}: the fused kernels would run in the Triton interpreter (not timed); the "
                       "production path there is unfused, so no fused entries are written")
    if op in ("linear_rs", "linear_ag"):
        if P.size == 1:
            return False, "world size 1: both paths are one GEMM, nothing to fuse"
        from distfuse.fused.linear_rs import fused_linear_available

        return fused_linear_available(P, device, dtype)
    return True, ""


# ---------------------------------------------------------------- the sweep (every rank)


@dataclass
class SweepResult:
    device_name: str
    entries: dict = field(default_factory=dict)
    triton_configs: dict = field(default_factory=dict)
    sweeps: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # "device|world" -> [notes]


def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


def sweep(ops: Sequence[str], dtypes: Sequence[torch.dtype], world_sizes: Sequence[int] | None = None, *,
          grid: Callable[[str, int], list[dict]] | None = None, full: bool = True, warmup: int = 3, reps: int = 10,
          margin: float = 0.0, progress: bool = True) -> SweepResult:
    """Time both paths of every op over its grid on the initialised world; every rank calls it, rank 0 gets it all.

    ``world_sizes``: groups of the first ``w`` ranks to measure (default: the whole world).
    """
    from distfuse import Partition
    from distfuse.layers.dispatch import device_caps

    world = dist.get_world_size()
    me = dist.get_rank()
    world_sizes = list(world_sizes or [world])
    bad = [w for w in world_sizes if not 1 <= w <= world]
    if bad:
        raise ValueError(f"distfuse-tune: world sizes {bad} are outside 1..{world}")
    P_world = Partition.world()
    device = P_world.device
    name = device_caps(device).name  # the name select_path keys on
    grid = grid or (lambda op, w: default_grid(op, w))
    res = SweepResult(name)
    show = progress and me == 0
    for w in world_sizes:
        P_w = P_world.create_partition_inclusive(range(w))
        P_sub = P_w.create_cartesian_topology_partition([1, w, 1])  # [batch, sequence, features]
        notes = res.notes.setdefault(f"{name}|{w}", [])
        for op in ops:
            for dtype in dtypes:
                key = table_key(name, w, dtype, op)
                ok, why = _fused_available(op, P_sub, device, dtype) if P_sub.active else (False, "inactive")
                if P_sub.active and not ok:
                    notes.append(f"{op} {str(dtype).removeprefix('torch.')}: fused not timed: {why}")
                tuners = _autotuners()
                before = _cache_keys(tuners)
                points = []
                timer = _Timer(device, P_sub.meta_group, warmup, reps) if P_sub.active else None
                for shape in _progress(grid(op, w), f"{op} {str(dtype).removeprefix('torch.')} W={w}", show):
                    if op == "halo_conv":
                        case = _halo_case(shape, dtype, device, w, range(w), full, ok)
                    elif P_sub.active:
                        case = _linear_case(op, shape, dtype, device, P_sub, full, ok)
                    else:
                        case = None
                    if case is None or timer is None:
                        continue
                    point = dict(shape=dict(shape), size=size_of(op, shape), fused_ms=None,
                                 unfused_ms=timer(case.unfused, case.rotations))
                    err = case.check("unfused")
                    if err:
                        raise RuntimeError(f"distfuse-tune: {op} {shape}: {err}")
                    if case.fused is not None:
                        point["fused_ms"] = timer(case.fused, case.rotations)
                        err = case.check("fused")
                        if err:  # the forced path did not run: do not record a time for it
                            point["fused_ms"] = None
                            notes.append(f"{op} {shape}: {err}")
                    points.append(point)
                    del case
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if me != 0:
                    continue
                res.sweeps[key] = dict(size_key=SIZE_KEYS[op], mode="full" if full else "fwd", points=points)
                if any(p["fused_ms"] is not None for p in points):
                    res.entries[key] = entry_for(op, points, margin, mode="full" if full else "fwd",
                                                 date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
                configs = harvest_autotune_caches(tuners, before)
                if configs:
                    res.triton_configs[key] = configs
        dist.barrier()  # ranks outside this group wait here (host side)
    return res


def _run_meta(res: SweepResult, args_summary: dict) -> dict:
    import triton

    import distfuse

    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return {k: dict(date=date, torch=torch.__version__, triton=triton.__version__, distfuse=distfuse.__version__,
                    cuda=torch.version.cuda, notes=v, args=args_summary) for k, v in res.notes.items()}


def _summary(res: SweepResult) -> str:
    lines = []
    for key, sw in sorted(res.sweeps.items()):
        entry = res.entries.get(key)
        if entry is None:
            verdict = "no entry (fused not timed)"
        elif entry["fused"] == "never":
            verdict = "fused never wins"
        elif entry["fused"] == "always":
            verdict = "fused wins at every size measured"
        else:
            lo, hi = entry.get("min_size"), entry.get("max_size")
            verdict = f"fused for {sw['size_key']} in [{'-inf' if lo is None else f'{lo:.4g}'}, " \
                      f"{'inf' if hi is None else f'{hi:.4g}'}]"
        lines.append(f"{key}: {len(sw['points'])} shapes; {verdict}")
        for p in sw["points"]:
            f = "-" if p["fused_ms"] is None else f"{p['fused_ms']:.4f}"
            lines.append(f"    {sw['size_key']}={p['size']:<14.6g} unfused {p['unfused_ms']:.4f} ms  fused {f} ms")
    for k, notes in res.notes.items():
        lines += [f"note {k}: {n}" for n in notes]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def _parse(argv=None):
    p = argparse.ArgumentParser(prog="distfuse-tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run under torchrun for more than one rank; the table is written by rank 0.")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="measure groups of the first N ranks (default: the whole world)")
    p.add_argument("--mode", choices=("full", "fwd"), default="full", help="time forward+backward (default) or forward")
    p.add_argument("--m", type=int, nargs="+", default=None, help="linears: sequence rows (per-rank GEMM m)")
    p.add_argument("--hidden", type=int, default=None, help="linears: model width (default 4096)")
    p.add_argument("--ffn", type=int, default=None, help="linears: MLP width, split over the ranks (default 14336)")
    p.add_argument("--channels", type=int, nargs="+", default=None, help="halo_conv: channel counts")
    p.add_argument("--extent", type=int, default=None, help="halo_conv: per-rank spatial extent (default 128)")
    p.add_argument("--nd", type=int, default=2, choices=(1, 2, 3), help="halo_conv: spatial dims")
    p.add_argument("--quick", action="store_true", help="tiny grid and few repetitions (CI; seconds)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--margin", type=float, default=0.0,
                   help="fused must win by this fraction to count (e.g. 0.03 keeps noise on the unfused side)")
    p.add_argument("--out", type=Path, default=None,
                   help="table path (default $DISTFUSE_TUNE_TABLE, else ~/.cache/distfuse/crossover.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _init_dist() -> bool:
    """Initialise torch.distributed from torchrun's environment, or a one-rank world; True if we did it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=float(os.environ.get("DISTFUSE_TIMEOUT", "600")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def run(args) -> SweepResult:
    """The sweep for parsed arguments on the initialised world; rank 0 writes the table unless ``dry_run``."""
    cuda = torch.cuda.is_available() and cuda_backend_of() == "nccl"  # "undefined" under init_process_group()
    dtypes = [DTYPES[d] for d in (args.dtype or (["bfloat16"] if cuda else ["float32"]))]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)

    def grid(op, w):
        return default_grid(op, w, quick=args.quick, m=args.m, hidden=args.hidden, ffn=args.ffn,
                            channels=args.channels, extent=args.extent, nd=args.nd)

    res = sweep(args.ops, dtypes, args.world_sizes, grid=grid, full=args.mode == "full", warmup=warmup, reps=reps,
                margin=args.margin, progress=not args.no_progress)
    if dist.get_rank() == 0:
        print(_summary(res))
        if not args.dry_run:
            summary = dict(mode=args.mode, reps=reps, warmup=warmup, margin=args.margin, quick=args.quick,
                           world=dist.get_world_size())
            path = write_table(args.out, res.entries, triton_configs=res.triton_configs, sweeps=res.sweeps,
                               run_meta=_run_meta(res, summary))
            print(f"wrote {len(res.entries)} crossover entries to {path}")
            if not res.entries:
                print("no fused path was timed here, so no crossover entries were written (see the notes)")
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        # The kernels are imported (not timed) on CPU; without a GPU Triton needs its interpreter to import them.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    owned = _init_dist()
    try:
        run(args)
    finally:
        if owned:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
