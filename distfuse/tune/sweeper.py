"""The sweep: time both paths of every op over its shape grid on the initialised world (every rank calls it).

Ops, size keys, grids, availability probes and timing cases come from the registry
(:mod:`distfuse.fused.registry`); the timer is :mod:`distfuse.timing`'s (the slowest rank per
repetition, agreed on the measured group's gloo ``meta_group``; median of ``reps``).

Where the fused path is not timed, the sweep times the unfused providers only, says why in
the notes and writes no entry: on CPU (the fused kernels would run in the Triton
interpreter, whose times mean nothing; ``interpreted=True`` times them anyway, for tests of
the plumbing: entries keyed ``cpu|...`` that dispatch never reads), where an op's
``available`` probe rules it out, and at world size 1 (:func:`one_process_note`).  Entries
are ``"source": "measured"``, with each point's spread (``fused_q80``, ``unfused_q20``) and
the kernel each provider ran (``kernels``, :func:`distfuse.fused.providers.last_kernel`: a
provider that fell back is named by the kernel that actually ran).
"""

from __future__ import annotations

import datetime as _dt
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from distfuse.fused import registry
from distfuse.fused.crossover_table import table_key
from distfuse.groups import metadata_group
from distfuse.timing import rotating, summarize, time_samples
from distfuse.tune.autotune_cache import autotuners, cache_keys, harvest_autotune_caches
from distfuse.tune.cases import CaseContext
from distfuse.tune.crossover_fit import entry_for, interval_text

__all__ = ["SweepResult", "default_grid", "sweep", "fused_available", "run_meta", "summary", "one_process_note",
           "Timer"]

#: ``timer(label, fn, rotations, timing) -> per-run ms``: how the sweep times one path.  ``label`` is
#: ``"unfused"``, ``"fused"`` or ``"fused:<provider>"``; ``fn(i)`` runs on input copy ``i``; ``timing`` holds
#: :func:`distfuse.timing.time_samples`' keywords.  Tests pass a synthetic one.
Timer = Callable[[str, Callable[[int], object], int, dict], list]


def default_grid(op: str, world: int, *, quick: bool = False, **options) -> list[dict]:
    """Per-rank shapes of ``op`` at world size ``world`` (the op's registered ``grid``; the dicts its size reads).

    ``options``: ``m``, ``hidden``, ``ffn`` (linears), ``channels``, ``extent``, ``nd`` (halo conv);
    ``quick``: tiny shapes for CI (CPU, seconds).
    """
    return registry.resolve(registry.get(op).grid)(op, world, quick=quick, **options)


def fused_available(op: str, P, device: torch.device, dtype, interpreted: bool = False) -> tuple[bool, str]:
    """Whether this sweep may time the fused path (the op's probe may be collective over ``P``).

    ``interpreted``: on CPU too (the kernels interpreted: plumbing tests, not measurements)."""
    spec = registry.get(op)
    if device.type != "cuda" and not interpreted:
        return False, (f"{device.type}: the fused kernels would run in the Triton interpreter (not timed); the "
                       "production path there is unfused, so no fused entries are written")
    if spec.available is None:
        return True, ""
    return registry.resolve(spec.available)(P, device, dtype)


@dataclass
class SweepResult:
    device_name: str
    entries: dict = field(default_factory=dict)
    triton_configs: dict = field(default_factory=dict)
    sweeps: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # "device|world" -> [notes]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def one_process_note(world_sizes: Sequence[int]) -> str | None:
    """Why nothing is measured when every measured group has one rank (None when some group has more)."""
    if any(w > 1 for w in world_sizes):
        return None
    return ("one process: at world size 1 no op has communication to fuse, so fused against unfused cannot be "
            "measured here; run under torchrun on a multi-GPU node (torchrun --nproc-per-node 8 -m distfuse.tune "
            "--world-sizes 2 4 8), or project entries from the GPU lab's one-GPU kernel rows with "
            "`distfuse-tune project` (docs/gpu.md)")


def sweep(ops: Sequence[str], dtypes: Sequence[torch.dtype], world_sizes: Sequence[int] | None = None, *,
          grid: Callable[[str, int], list[dict]] | None = None, full: bool = True, warmup: int = 3, reps: int = 10,
          margin: float = 0.0, progress: bool = True, timer: Timer | None = None,
          interpreted: bool = False) -> SweepResult:
    """Time both paths of every op over its grid on the initialised world; every rank calls it, rank 0 gets it all.

    ``world_sizes``: groups of the first ``w`` ranks to measure (default: the whole world).
    ``grid(op, w)``: the shapes (default :func:`default_grid`).  ``timer``: see :data:`Timer`
    (default: :func:`distfuse.timing.time_samples`).  ``interpreted``: time the fused path on CPU
    too (see :func:`fused_available`).
    """
    from distfuse.fused.providers import last_kernel
    from distfuse.layers.dispatch import device_caps
    from distfuse.partition import Partition

    specs = [registry.get(op) for op in ops]  # unknown ops fail before any collective
    world = dist.get_world_size()
    me = dist.get_rank()
    world_sizes = list(world_sizes or [world])
    bad = [w for w in world_sizes if not 1 <= w <= world]
    if bad:
        raise ValueError(f"distfuse-tune: world sizes {bad} are outside 1..{world}")
    P_world = Partition.world()
    device = P_world.device
    name = device_caps(device).name  # the name select_path keys on
    grid = grid or default_grid
    timer = timer or (lambda label, fn, n_rot, timing: time_samples(rotating(fn, n_rot), **timing))
    res = SweepResult(name)
    note = one_process_note(world_sizes)
    if note:
        res.notes.setdefault(f"{name}|1", []).append(note)

    show = progress and me == 0
    mode = "full" if full else "fwd"
    for w in world_sizes:
        P_w = P_world.create_partition_inclusive(range(w))
        P_sub = P_w.create_cartesian_topology_partition([1, w, 1])  # [batch, sequence, features]
        notes = res.notes.setdefault(f"{name}|{w}", [])
        timing = dict(warmup=warmup, reps=reps, device=device, sync_group=P_sub.meta_group)
        for spec in specs:
            op = spec.name
            make_case = registry.resolve(spec.case)
            for dtype in dtypes:
                key = table_key(name, w, dtype, op)
                ok, why = fused_available(op, P_sub, device, dtype, interpreted) if P_sub.active \
                    else (False, "inactive")
                if P_sub.active and not ok:
                    notes.append(f"{op} {_dtype_name(dtype)}: fused not timed: {why}")
                tuners = autotuners()
                before = cache_keys(tuners)
                points = []
                ctx = CaseContext(dtype, device, w, range(w), P_sub, full, ok)
                for shape in tqdm(grid(op, w), desc=f"{op} {_dtype_name(dtype)} W={w}", leave=False, file=sys.stderr,
                                  disable=not show):
                    case = make_case(op, shape, ctx)
                    if case is None or not P_sub.active:
                        continue
                    u = summarize(timer("unfused", case.unfused, case.rotations, timing))
                    point = dict(shape=dict(shape), size=spec.size_of(shape), fused_ms=None, unfused_ms=u[0],
                                 unfused_q20=u[1])
                    err = case.check("unfused")
                    if err:
                        raise RuntimeError(f"distfuse-tune: {op} {shape}: {err}")
                    if case.fused is not None:
                        # Every provider of the fused path (or the one fused path); the fastest is the fused time.
                        fns = case.providers or {None: case.fused}
                        times, kernels = {}, {}
                        for p, fn in fns.items():
                            times[p] = summarize(timer("fused" if p is None else f"fused:{p}", fn, case.rotations,
                                                       timing))
                            choice = last_kernel(op)
                            if choice is not None:  # the kernel that ran (a provider's fallback is named)
                                kernels[p or "fused"] = choice.kernel
                        best = min(times, key=lambda p: times[p][0])
                        point["fused_ms"], point["fused_q80"] = times[best][0], times[best][2]
                        if case.providers:
                            point["provider_ms"] = {p: t[0] for p, t in times.items()}
                            point["provider"] = best
                        if kernels:
                            point["kernels"] = kernels
                        err = case.check("fused")
                        if err:  # the forced path did not run: do not record a time for it
                            point["fused_ms"] = None
                            notes.append(f"{op} {shape}: {err}")
                    points.append(point)
                    case.cleanup()
                    del case
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if me != 0:
                    continue
                res.sweeps[key] = dict(size_key=spec.size_key, mode=mode, points=points)
                if any(p["fused_ms"] is not None for p in points):
                    res.entries[key] = entry_for(op, points, margin, mode=mode, date=_now())
                configs = harvest_autotune_caches(tuners, before)
                if configs:
                    res.triton_configs[key] = configs
        dist.barrier(group=metadata_group())  # ranks outside this group wait here (host side, DISTFUSE_TIMEOUT)
    return res


def run_meta(res: SweepResult, args_summary: dict) -> dict:
    """``_meta.runs`` of a sweep: versions, date, notes and the arguments, per ``device|world``."""
    import triton

    import distfuse

    date = _now()
    return {k: dict(date=date, torch=torch.__version__, triton=triton.__version__, distfuse=distfuse.__version__,
                    cuda=torch.version.cuda, notes=v, args=args_summary) for k, v in res.notes.items()}


def summary(res: SweepResult) -> str:
    """A human-readable report of a sweep: per key, the verdict and the points."""
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
            verdict = f"fused for {interval_text(entry, 4)}"
        lines.append(f"{key}: {len(sw['points'])} shapes; {verdict}")
        for p in sw["points"]:
            f = "-" if p["fused_ms"] is None else f"{p['fused_ms']:.4f}"
            by = f" ({p['provider']})" if p.get("provider") else ""
            lines.append(f"    {sw['size_key']}={p['size']:<14.6g} unfused {p['unfused_ms']:.4f} ms  fused {f} ms{by}")
    for k, notes in res.notes.items():
        lines += [f"note {k}: {n}" for n in notes]
    return "\n".join(lines)
