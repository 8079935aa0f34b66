"""One benchmark harness: timing, environment capture, result rows and JSON.

Timing is the package's one timer, :mod:`distfuse.timing` (``distfuse-tune`` uses it too),
re-exported here as :func:`time_fn`, :func:`time_samples`, :func:`time_interleaved` and
:func:`summarize`:

* CUDA: CUDA-event timing after a warm-up, with the L2 cache flushed between runs (a
  256 MB write) so that every run reads its inputs from HBM, and quantiles
  [0.5, 0.2, 0.8] of the per-run times.
* CPU: ``time.perf_counter`` around each run after a warm-up; the same quantiles.
  CPU numbers are for smoke runs and CPU-vs-CPU ratios only, never GPU claims.

Multi-rank timings take, per repetition, the slowest rank's time (one all-reduce MAX
per repetition outside the timed region), because a collective finishes when its last
rank does.

Every row records op, provider, mode (fwd/bwd/full), shape, dtype, world size, device
(name and clocks through pynvml on GPUs), torch / triton / distfuse versions, the git
commit, the time quantiles, the rate (TFLOP/s or GB/s), the ratio to the anchor
measured in the same run, and peak memory.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from distfuse.timing import QUANTILES, summarize, time_fn, time_interleaved, time_samples

__all__ = ["Row", "QUANTILES", "environment", "summarize", "time_samples", "time_fn", "time_interleaved",
           "under_torchrun", "init_torchrun", "track_peak_memory", "add_ratios", "write_results", "results_path",
           "write_json", "print_table", "graphed", "settings",
           "run_multirank", "multirank_main", "DTYPES", "RESULTS"]

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    op: str
    provider: str
    mode: str
    shape: dict
    dtype: str
    world_size: int
    ms: float  # median
    ms_q20: float
    ms_q80: float
    rate: float | None = None  # TFLOP/s or GB/s, see rate_unit
    rate_unit: str | None = None
    anchor: str | None = None  # provider this row's ratio is against
    ratio: float | None = None  # ms / anchor ms (lower is better)
    peak_mem_mb: float | None = None
    extra: dict = field(default_factory=dict)
    kernel: str | None = None  # the kernel that actually ran (a provider may fall back: see matmul_scatter_select)


def environment() -> dict:
    """Device, clocks, versions and the ``DISTFUSE_*`` settings for the result file."""
    import triton

    import distfuse

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "distfuse": distfuse.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": os.environ.get("DISTFUSE_COMMIT") or _git_commit(),  # set where the tree has no .git
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "settings": settings(),
        "tile_tables": tile_tables(),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env.update(_nvml())
    return env


def tile_tables() -> dict:
    """The measured-tile tables this run's pinned rules read (``distfuse.kernels.tile_table``: the user's, then the
    shipped one), each with its entries per kernel, or why it is ignored; ``{"off": {}}`` under
    ``DISTFUSE_TILE_TABLE=off``.  A run with a table of this call's measurements (``scripts/gpu_first_call.sh``'s
    pinned reruns) says so here."""
    from distfuse.errors import ConfigError
    from distfuse.kernels import tile_table as tt

    user = tt.user_tiles_path()
    out: dict = {}
    for path in ([user, tt.SHIPPED_TILES] if user is not None else []):
        try:
            entries = tt.load_tiles(path)
        except ConfigError as exc:  # the rules ignore a malformed table (with a warning): say why here
            out[str(path)] = f"ignored: {exc}"
            continue
        counts: dict = {}
        for e in entries:
            counts[e["kernel"]] = counts.get(e["kernel"], 0) + 1
        out[str(path)] = counts
    return out or {"off": {}}


def settings() -> dict:
    """The ``DISTFUSE_*`` settings a run is measured under (the lab's ``DISTFUSE_TIMEOUT`` and ``DISTFUSE_AUTOTUNE``,
    a launch path its canary switched: ``DISTFUSE_FAST_LAUNCH``, ``DISTFUSE_LAUNCH_CACHE``), the commit apart: so a
    result file says how it ran."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DISTFUSE_") and k != "DISTFUSE_COMMIT"}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _nvml() -> dict:
    try:
        import pynvml
    except ImportError:
        return {"nvml": "nvidia-ml-py not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound without a GPU
        return {"nvml": f"no GPU ({exc})"}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return {
            "nvml_name": pynvml.nvmlDeviceGetName(h),
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
        }
    finally:
        pynvml.nvmlShutdown()


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its rendezvous variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_torchrun(timeout_s: float = 600.0) -> None:
    """Join the torchrun world: NCCL with one GPU per rank (``LOCAL_RANK``) when CUDA is there, else gloo."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=_dt.timedelta(seconds=timeout_s))
    else:
        dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def track_peak_memory(device: torch.device | None):
    """``with track_peak_memory(dev) as peak: ...``; then ``peak["mb"]`` is the peak CUDA memory allocated
    inside the block (MiB), or None off CUDA (no allocator statistics there)."""
    peak: dict = {"mb": None}
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield peak
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            peak["mb"] = torch.cuda.max_memory_allocated(device) / 2**20


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after one warm call on a side stream); returns the graph's ``replay``.

    The benchmarks' graph rows time that replay: the device work of a call without its host work, as a step
    captured in ``torch.cuda.graph`` (or ``torch.compile(mode="reduce-overhead")``) runs it."""
    return graph_capture(fn)[0]


def graph_capture(fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """``(replay, outputs)``: :func:`graphed`'s capture, with what the captured call of ``fn`` returned (tensors that
    every replay rewrites: a benchmark can check a replay's results against an eager call's)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph.replay, outs


def add_ratios(rows: list[Row], anchor: str, key: Callable[[Row], tuple] | None = None) -> None:
    """Set ``ratio = ms / anchor's ms`` for rows sharing (op, mode, shape, dtype, world size)."""
    key = key or (lambda r: (r.op, r.mode, json.dumps(r.shape, sort_keys=True), r.dtype, r.world_size))
    anchors = {key(r): r for r in rows if r.provider == anchor}
    for r in rows:
        a = anchors.get(key(r))
        if a is not None and a.ms > 0:
            r.anchor, r.ratio = anchor, r.ms / a.ms


def results_path(name: str, env: dict, out_dir: Path | None = None, smoke: bool = False) -> Path:
    """``<out_dir>/<name>-<device>-<date>.json`` (``-smoke`` for smoke runs); the name keeps ``[A-Za-z0-9._-]``."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS
    device = re.sub(r"[^A-Za-z0-9._-]", "_", str(env["device"]))
    stamp = env["date"][:10]
    return out_dir / f"{name}-{device}-{stamp}{'-smoke' if smoke else ''}.json"


def write_json(path: Path, env: dict, rows: list, smoke: bool = False, **extra) -> Path:
    """Write ``{env, smoke, rows, **extra}`` to ``path`` atomically (a temporary file, then a rename).

    Benchmarks call it after every case, so a run cut off by a time limit leaves a valid file
    with every row measured so far (``rows``: :class:`Row` or dicts).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"env": env, "smoke": smoke, **extra, "rows": [asdict(r) if isinstance(r, Row) else r for r in rows]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_results(name: str, rows: list[Row], env: dict | None = None, out_dir: Path | None = None,
                  smoke: bool = False) -> Path:
    """Write ``{env, rows}`` to ``bench/results/<name>-<device>-<date>.json`` (``-smoke`` for smoke runs)."""
    env = env or environment()
    return write_json(results_path(name, env, out_dir, smoke), env, rows, smoke)


def print_table(rows: list[Row]) -> None:
    shapes = [",".join(f"{k}={v}" for k, v in r.shape.items()) for r in rows]
    wp = max([14] + [len(r.provider) + 1 for r in rows])
    ws = max([44] + [len(s) + 1 for s in shapes])
    head = f"{'op':<22}{'provider':<{wp}}{'mode':<6}{'dtype':<10}{'W':>3} {'shape':<{ws}}{'ms':>10}{'ratio':>8}"
    print(head)
    print("-" * len(head))
    for r, shape in zip(rows, shapes, strict=True):
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else ""
        print(f"{r.op:<22}{r.provider:<{wp}}{r.mode:<6}{r.dtype:<10}{r.world_size:>3} {shape:<{ws}}"
              f"{r.ms:>10.3f}{ratio:>8}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_multirank(bench_rank: Callable[[dict], list[dict]], config: Callable[[bool, torch.dtype, bool], dict],
                  anchor: str, smoke: bool, world_size: int, dtype: torch.dtype) -> list[Row]:
    """Rows of a multi-rank bench, ratios to ``anchor`` set.

    Inside an initialised process group (torchrun) ``bench_rank`` runs on the current
    world and ``world_size`` is ignored; otherwise on ``world_size`` forked gloo CPU ranks.
    ``config(smoke, dtype, cuda)`` builds the per-rank configuration.
    """
    if not dist.is_initialized() and under_torchrun():
        init_torchrun()
    if dist.is_initialized():
        raw = bench_rank(config(smoke, dtype, dist.get_backend() == "nccl"))
    else:
        from distfuse.testing import run_ranks

        raw = run_ranks(world_size, bench_rank, config(smoke, dtype, False), timeout=3600)[0]
    rows = [Row(**r) for r in raw]
    add_ratios(rows, anchor)
    return rows


def multirank_main(name: str, description: str, run: Callable[..., list[Row]], argv: list[str] | None = None) -> int:
    """The command line of a multi-rank bench: ``--smoke``, ``--world-size N [N ...]``, ``--dtype``, ``--out``."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few runs (checks that it works)")
    p.add_argument("--world-size", type=int, nargs="+", default=[4],
                   help="self-spawned gloo CPU ranks; several values run one after the other into one result file "
                        "(ignored under torchrun)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    sizes = args.world_size[:1] if (dist.is_initialized() or under_torchrun()) else args.world_size
    rows = []
    for w in sizes:
        rows += run(smoke=args.smoke, world_size=w, dtype=DTYPES[args.dtype])
        if not dist.is_initialized():
            from distfuse.testing import shutdown_pools

            shutdown_pools()  # the next world size gets its own ranks; these would sit idle
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.destroy_process_group()
        return 0
    env = environment()
    env["backend"] = dist.get_backend() if dist.is_initialized() else "gloo (self-spawned CPU ranks)"
    if env["device"] == "cpu":
        print("CPU/gloo timings (1 thread per rank, shared cores): ratios between CPU providers, not GPU results")
    print_table(rows)
    path = write_results(name, rows, env=env, out_dir=args.out, smoke=args.smoke)
    print(f"wrote {len(rows)} rows to {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
