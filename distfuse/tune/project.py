"""Projected crossover entries: one-GPU kernel measurements plus a stated interconnect model.

``distfuse-tune project`` (``python -m distfuse.tune.project``) builds the table the package
ships (``distfuse/fused/crossover_shipped.json``) from the GPU lab's result files in
``bench/results/`` (put there by ``scripts/lab_record.py collect``) and the model below::

    python -m distfuse.tune.project                   # rewrite the shipped table from bench/results
    python -m distfuse.tune.project --check           # exit 1 if the shipped table is not what the inputs give
    distfuse-tune project --out ~/.cache/distfuse/crossover.json   # merge into a user's table instead

Measured: on one GPU, each rank's kernels of a W-way fused op in loopback (W virtual ranks,
"remote" stores landing in local HBM) and, in the same process, the anchors ``torch.mm``
(cuBLAS) on the same per-rank GEMM and a device copy of the same bytes
(``bench/bench_gemm_fused.py``; rows ``op``, ``provider``, ``anchor``, ``shape``, ``dtype``,
median ``ms``, ``ms_q20``/``ms_q80``).  The halo conv's rows (``bench/bench_halo_conv.py``,
mode ``full``) time fused staging + cuDNN against the layers' unfused staging (``pieces``) and ``torch.cat``
staging, each + the same cuDNN.

Modelled, per rank and forward (``S`` the bytes the collective moves: the partial product
``[m, n]`` of a reduce-scatter or all-reduce, the gathered operand ``[m, k]`` of an
all-gather; ``W`` the tensor-parallel world size)::

    reduce-scatter  unfused = t_cublas + a_nccl + (W-1)/W S / B_nccl
                    fused   = max(t_gemm_scatter, (W-1)/W S / B_store) + t_reduce + a_sig
     cublas, whole  fused   = t_cublas + max(t_gemm_scatter - t_cublas, (W-1)/W S / B_store) + t_reduce + a_sig
                              (the cuBLAS provider's rows where its whole-GEMM schedule ran: the scatter follows
                              the GEMM, so only the scatter's stores meet the wire)
    all-gather      unfused = a_nccl + (W-1)/W S / B_nccl + t_cublas
                    fused   = max(t_push, (W-1)/W S / B_store) + t_gathered_gemm + a_sig     (push, then GEMM)
       copy_engine  fused   = max(t_gathered_gemm, max(t_push_ce, (W-1)/W S / B_store) + t_gathered_gemm / W) + a_sig
    all-reduce      unfused = t_cublas + a_nccl + 2 (W-1)/W S / B_nccl_ar
                    fused   = max(t_gemm_push, (W-1) S / B_store) + t_reduce + a_sig          (one-shot)
    halo conv       unfused = t_pieces_full, fused = t_fused_full  (both exchange the same halos: no interconnect
                              term; t_pieces_full is the layers' own unfused step, and a file without its rows
                              takes torch.cat's step, t_cat_full, in its place; an entry's kernels.anchor names it)

The fused GEMM's remote stores overlap its compute.  The bandwidth kernels (``t_reduce``,
``t_push``) are scaled by the bytes they move at the target ``W`` (``(W+1)/W S`` for a chunk
reduction, ``(W+1) S`` for the all-reduce slots, ``S`` for a push); the per-rank GEMM times
do not depend on ``W``, so one lab run at ``W = 8`` projects TP 2, 4 and 8, keyed by the
per-rank ``m*n*k``.

The interconnect, :data:`NVLINK4_HGX` (H100 SXM5 / H200 SXM on an HGX baseboard), nominal
(pessimistic end):

* NVLink 4: 900 GB/s bidirectional, 450 GB/s per direction per GPU (18 links x 25 GB/s), every
  pair at full rate through third-generation NVSwitch (NVIDIA H100 datasheet and whitepaper,
  H200 datasheet; "Upgrading Multi-GPU Interconnectivity with the Third-Generation NVIDIA
  NVSwitch", NVIDIA technical blog, 2022).
* NCCL reduce-scatter / all-gather bus bandwidth 360 GB/s (450), latency 12 us (6): assumed,
  ring/NVLS reaching 75-85% of the link for tens of MB, 5-20 us for small messages; ``busbw``
  as in nccl-tests (time = ``(W-1)/W S / busbw``).
* NCCL all-reduce bus bandwidth 450 GB/s (480): nccl-tests on 8 x H100 SXM5 with NVLink SHARP
  report 460-480 GB/s at large sizes (e.g. Alaya New, "NCCL-tests in practice", 2026).
* Fused stores 360 GB/s (270): SM-issued 16-byte stores into peers' symmetric buffers.
* Fused signalling 6 us (12): flag release/acquire over NVLink plus two agreement launches.

On a real node ``distfuse-tune`` under ``torchrun`` measures both paths; its ``"source":
"measured"`` entries replace these.

Gain and margin.  ``gain = unfused / fused - 1`` with the median kernel times and nominal
figures; the pessimistic gain takes the fused kernels at their 80th percentile and the
anchors at their 20th (at least :data:`NOISE` apart), the interconnect at its pessimistic
end, and kernels borrowed from another device or dtype :data:`TRANSFER` slower;
``margin = gain - pessimistic gain``.  A size *qualifies* where ``gain >= min_gain`` (default
:data:`MIN_GAIN`) and ``gain - margin > 0``; the entry fuses on the contiguous run of
qualifying sizes with the largest total gain (:func:`qualifying_interval`), else it is
``"fused": "never"``.  Its ``gain``/``margin`` is the decisive point
(:func:`distfuse.tune.crossover_fit.decisive`).

Devices without rows of their own borrow another Hopper GPU's kernels (:data:`DEVICES`):
GEMM times scaled by the ratio of the GEMM rates, bandwidth kernels by that of the copy
bandwidths; fp16 without rows borrows bf16's (same width, same tensor-core rate).  Each
entry names where its kernels came from (``kernels``).  Only the forward is modelled; the
backward of each GEMM fusion is its dual op, which has its own entry.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from distfuse.fused import registry
from distfuse.fused.crossover_table import FORMAT, SHIPPED, check_entry, table_key
from distfuse.kernels.matmul_scatter_select import cublas_whole
from distfuse.tune.crossover_fit import Crossover, decisive, interval_text, provider_choice
from distfuse.tune.table import write_table, write_text_atomic

__all__ = ["Ends", "Interconnect", "DeviceModel", "OpModel", "NVLINK4_HGX", "DEVICES", "OP_MODELS", "MIN_GAIN",
           "NOISE", "TRANSFER", "WORLD_SIZES", "DTYPES", "RESULTS", "load_rows", "project_table", "qualifying_interval",
           "main"]

MIN_GAIN = 0.10  # fuse by default only where the projected gain is at least 10%
NOISE = 0.03  # the least spread assumed of a kernel time (rows without quantiles; quantiles tighter than this)
TRANSFER = 0.10  # pessimistic slowdown of fused kernels measured on another device or dtype
WORLD_SIZES = (2, 4, 8)
DTYPES = ("bfloat16", "float16")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class Ends:
    """A figure at its nominal value and at its pessimistic end (the end that favours the unfused path)."""

    nominal: float
    pessimistic: float

    def at(self, pessimistic: bool) -> float:
        return self.pessimistic if pessimistic else self.nominal


@dataclass(frozen=True)
class Interconnect:
    """The stated interconnect model (see the module doc for the sources)."""

    name: str
    link_gbps: float  # per direction per GPU
    nccl_gbps: Ends  # reduce-scatter / all-gather bus bandwidth
    nccl_ar_gbps: Ends  # all-reduce bus bandwidth
    nccl_us: Ends  # a NCCL collective's latency
    store_gbps: Ends  # the fused kernels' remote stores
    signal_us: Ends  # the fused op's flags and agreement launches


NVLINK4_HGX = Interconnect(
    name="NVLink 4 via NVSwitch (HGX H100/H200 8-GPU): 900 GB/s bidirectional, 450 GB/s per direction per GPU",
    link_gbps=450.0, nccl_gbps=Ends(360.0, 450.0), nccl_ar_gbps=Ends(450.0, 480.0), nccl_us=Ends(12.0, 6.0),
    store_gbps=Ends(360.0, 270.0), signal_us=Ends(6.0, 12.0))


@dataclass(frozen=True)
class DeviceModel:
    """A target device: the name dispatch keys on, its anchors' rates (to transfer kernels), its interconnect."""

    name: str  # torch.cuda.get_device_name
    copy_gbps: float
    gemm_tflops: float
    interconnect: Interconnect = NVLINK4_HGX
    matches: tuple[str, ...] = ()  # result files' device names that are this device


#: The devices the shipped table covers (DESIGN.md's measured copy bandwidth and bf16 GEMM rate).
DEVICES: dict[str, DeviceModel] = {
    "NVIDIA H100 80GB HBM3": DeviceModel("NVIDIA H100 80GB HBM3", 3000.0, 800.0,
                                         matches=("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3")),
    "NVIDIA H200": DeviceModel("NVIDIA H200", 4300.0, 785.0, matches=("NVIDIA H200", "NVIDIA-H200")),
}


@dataclass(frozen=True)
class OpModel:
    """How one registry op is projected: its kernel rows and the shape of its model.

    ``kind``: ``rs`` (GEMM + reduce-scatter), ``ag`` (all-gather + GEMM), ``ar`` (GEMM + one-shot
    all-reduce) or ``local`` (no interconnect term: the halo conv).  ``gemm`` / ``bw``: the ``op``
    of the GEMM and bandwidth kernel rows (``bench/bench_gemm_fused.py``'s ``SIDES``); ``zero``: the
    rows' ``shape.zero`` tag (the ZeRO weight streaming), None for rows without one.
    """

    kind: str
    gemm: str
    bw: str | None = None
    zero: str | None = None
    mode: str = "fwd"
    anchor: str = "cublas"
    #: the anchor of a file without ``anchor`` rows (the halo conv's results before its ``pieces`` rows existed)
    fallback: str | None = None


#: One model per projected registry op (``FusedOp.projected``; a test checks that each has one).
OP_MODELS: dict[str, OpModel] = {
    registry.MATMUL_REDUCE_SCATTER.name: OpModel("rs", "matmul_scatter", "chunk_reduce"),
    registry.ALL_GATHER_MATMUL.name: OpModel("ag", "gathered_matmul", "ag_push"),
    registry.MATMUL_REDUCE_SCATTER_FEATURES.name: OpModel("rs", "matmul_scatter_columns", "column_reduce"),
    registry.ALL_GATHER_FEATURES_MATMUL.name: OpModel("ag", "gathered_k_matmul", "ag_push_columns"),
    registry.MATMUL_ALL_REDUCE.name: OpModel("ar", "matmul_push", "all_reduce_slots"),
    registry.ZERO_LINEAR_ROWS.name: OpModel("ag", "gathered_matmul", "ag_push", zero="rows"),
    registry.ZERO_LINEAR_COLUMNS.name: OpModel("ag", "gathered_k_matmul", "ag_push_columns", zero="columns"),
    # the layers' unfused step (stage_from_pieces, unstage_to_pieces), else torch.cat's where a file has no such rows
    registry.HALO_CONV.name: OpModel("local", "halo_conv", mode="full", anchor="pieces", fallback="cat"),
}

#: Row providers that are the op's default provider under another name (``fused``: the first in the registry).
_DEFAULT_ROW_PROVIDER = "fused"
_ANCHORS = ("cublas", "copy", "cat", "distdl", "symm_mem", "pieces")


# ---------------------------------------------------------------- rows


@dataclass(frozen=True)
class Timed:
    """One row's time: median and 20th/80th percentiles (ms)."""

    ms: float
    q20: float
    q80: float

    @classmethod
    def of(cls, row: dict) -> Timed:
        ms = float(row["ms"])
        return cls(ms, float(row.get("ms_q20") or ms), float(row.get("ms_q80") or ms))

    def fused_end(self, pessimistic: bool, transfer: float) -> float:
        return max(self.q80, self.ms * (1 + NOISE)) * (1 + transfer) if pessimistic else self.ms

    def anchor_end(self, pessimistic: bool) -> float:
        return min(self.q20, self.ms * (1 - NOISE)) if pessimistic else self.ms


@dataclass
class ResultFile:
    path: str
    device: str
    date: str
    commit: str | None
    rows: list[dict] = field(default_factory=list)


def load_rows(results: Path | str = RESULTS) -> list[ResultFile]:
    """The GPU result files under ``results`` (``*.json`` whose ``env.device`` names an NVIDIA GPU and that hold
    rows), oldest first."""
    out = []
    for name in sorted(glob.glob(str(Path(results) / "*.json"))):
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, ValueError):
            continue
        env = data.get("env") if isinstance(data, dict) else None
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(env, dict) or not isinstance(rows, list) or data.get("smoke"):
            continue
        device = str(env.get("device") or "")
        if "NVIDIA" not in device or env.get("dry_run"):
            continue
        out.append(ResultFile(Path(name).name, device, str(env.get("date") or ""), env.get("commit"),
                              [r for r in rows if isinstance(r, dict) and r.get("ms")]))
    out.sort(key=lambda f: (f.date, f.path))
    return out


def _device_of(name: str) -> DeviceModel | None:
    return next((d for d in DEVICES.values() if name in (d.name, *d.matches)), None)


@dataclass
class Case:
    """One shape's kernel times for one op, all from one result file (one run)."""

    size: float
    m: int
    n: int
    k: int
    world: int  # the world size the rows were measured at
    anchor: Timed  # cuBLAS (GEMM ops) or the unfused step (halo: pieces staging + conv, else cat's)
    gemm: dict[str, Timed]  # row provider -> the fused GEMM (or the fused halo conv)
    bw: dict[str, Timed] = field(default_factory=dict)  # row provider -> the bandwidth kernel
    anchor_name: str = "cublas"  # the anchor's row provider


def cases_for(op: str, f: ResultFile, dtype: str) -> list[Case]:
    """The complete cases of ``op`` in one result file at ``dtype``: every row the op's model needs, same run."""
    model = OP_MODELS[op]
    by: dict[tuple, dict[str, dict]] = {}
    for r in f.rows:
        if r.get("dtype") != dtype or r.get("extra", {}).get("projection"):
            continue
        name, s = registry.RENAMED_KERNELS.get(r.get("op"), r.get("op")), r.get("shape") or {}
        if name not in (model.gemm, model.bw) or r.get("mode", "fwd") != model.mode:
            continue
        if model.kind == "local":  # the halo conv's rows: keyed by their whole shape
            if "C" not in s:
                continue
            shape = tuple(sorted(s.items()))
        elif all(k in s for k in ("m", "n", "k")) and s.get("zero") == model.zero:
            shape = int(s["m"]), int(s["n"]), int(s["k"]), s.get("zero")
        else:
            continue
        by.setdefault(("gemm" if name == model.gemm else "bw", shape), {})[r["provider"]] = r
    out = []
    for (part, shape), provs in sorted(by.items(), key=lambda kv: str(kv[0])):
        if part != "gemm":
            continue
        name = model.anchor if model.anchor in provs or model.fallback is None else model.fallback
        anchor = provs.get(name)
        fused = {p: Timed.of(r) for p, r in provs.items() if p not in _ANCHORS}
        if anchor is None or _DEFAULT_ROW_PROVIDER not in fused:
            continue
        if model.kind == "local":  # sized as the layers size it: the block's elements (registry.halo_elements)
            s = dict(shape)
            elements = int(s.get("batch", 1)) * int(s["C"]) * int(s.get("n", 1)) ** int(s.get("nd", 2))
            size = registry.size_of(op, dict(elements=elements))
            out.append(Case(size, 0, 0, 0, int(anchor.get("world_size") or 1), Timed.of(anchor), fused,
                            anchor_name=name))
            continue
        bw = {p: Timed.of(r) for p, r in by.get(("bw", shape), {}).items() if p not in _ANCHORS}
        if _DEFAULT_ROW_PROVIDER not in bw:
            continue
        m, n, k, _ = shape
        out.append(Case(registry.size_of(op, dict(m=m, n=n, k=k)), m, n, k, int(anchor.get("world_size") or 8),
                        Timed.of(anchor), fused, bw))
    return out


# ---------------------------------------------------------------- the model


def _provider(op: str, row_provider: str) -> str:
    return registry.get(op).providers[0] if row_provider == _DEFAULT_ROW_PROVIDER else row_provider


def _bw_scale(kind: str, w: int, w0: int) -> float:
    """Bytes a bandwidth kernel moves at world size ``w`` over those at ``w0`` (see the module doc)."""
    if kind == "rs":
        return ((w + 1) / w) / ((w0 + 1) / w0)
    if kind == "ar":
        return (w + 1) / (w0 + 1)
    return 1.0


def project_case(op: str, case: Case, w: int, itemsize: int, ic: Interconnect, *, pessimistic: bool,
                 transfer: float = 0.0, gemm_scale: float = 1.0,
                 bw_scale: float = 1.0) -> tuple[float, dict[str, float]]:
    """``(unfused_ms, {provider: fused_ms})`` of one case at world size ``w`` (one end of every input)."""
    model = OP_MODELS[op]
    anchor = case.anchor.anchor_end(pessimistic) * gemm_scale
    fused_gemm = {p: t.fused_end(pessimistic, transfer) * gemm_scale for p, t in case.gemm.items()}
    known = registry.get(op).providers
    fused_gemm = {p: t for p, t in fused_gemm.items() if _provider(op, p) in known}
    if model.kind == "local":
        return anchor, {_provider(op, p): t for p, t in fused_gemm.items()}
    scale = _bw_scale(model.kind, w, case.world) * bw_scale
    bw = {p: t.fused_end(pessimistic, transfer) * scale for p, t in case.bw.items()}
    nbytes = case.m * (case.n if model.kind in ("rs", "ar") else case.k) * itemsize
    frac = (w - 1) / w
    nccl_s = ic.nccl_us.at(pessimistic) * 1e-6
    store = nbytes / (ic.store_gbps.at(pessimistic) * 1e9)
    sig_ms = ic.signal_us.at(pessimistic) * 1e-3
    if model.kind == "ar":  # one-shot: every peer's whole partial product
        nccl_wire = 2 * frac * nbytes / (ic.nccl_ar_gbps.at(pessimistic) * 1e9)
        wire = (w - 1) * store * 1e3
    else:
        nccl_wire = frac * nbytes / (ic.nccl_gbps.at(pessimistic) * 1e9)
        wire = frac * store * 1e3
    unfused = anchor + (nccl_s + nccl_wire) * 1e3
    if model.kind != "ag":  # the GEMM with its stores, then the reduction
        reduce = bw[_DEFAULT_ROW_PROVIDER]
        fused = {}
        for p, t in fused_gemm.items():
            name = _provider(op, p)
            if name == "cublas_chunks" and model.kind == "rs" and cublas_whole(case.m, case.world):
                # the whole-GEMM schedule ran: cuBLAS's GEMM, then the scatter, whose stores are the wire: serial
                fused[name] = anchor + max(t - anchor, wire) + reduce + sig_ms
            else:
                fused[name] = max(t, wire) + reduce + sig_ms
        return unfused, fused
    gemm = fused_gemm[_DEFAULT_ROW_PROVIDER]  # ag: the push (one provider per push row), then the gathered GEMM
    fused = {}
    for p, t in bw.items():
        name = _provider(op, p)
        if name not in known:
            continue
        if name == "copy_engine":  # DMA on side streams, overlapping the GEMM, which takes its own chunk first
            fused[name] = max(gemm, max(t, wire) + gemm / w) + sig_ms
        else:
            fused[name] = max(t, wire) + gemm + sig_ms
    return unfused, fused


@dataclass
class Point:
    size: float
    gain: float
    margin: float
    fused_ms: float
    unfused_ms: float
    provider: str
    provider_ms: dict[str, float]

    def qualifies(self, min_gain: float = MIN_GAIN) -> bool:
        return self.gain >= min_gain - 1e-12 and self.gain - self.margin > 0


def qualifying_interval(points: Sequence[Point], min_gain: float = MIN_GAIN) -> tuple[str, float | None, float | None]:
    """``(fused, min_size, max_size)``: the contiguous run of qualifying sizes with the largest total gain.

    ``fused`` is ``"never"`` (no size qualifies), ``"always"`` (every size does) or ``"interval"``;
    a bound is None where the run reaches the smallest / largest size evaluated, else it is the
    run's own end (no interpolation into sizes the projection did not evaluate).
    """
    pts = sorted(points, key=lambda p: p.size)
    best, best_run, run = -math.inf, None, None
    for i, p in enumerate(pts):
        if p.qualifies(min_gain):
            run = (run[0], i, run[2] + p.gain) if run else (i, i, p.gain)
            if run[2] > best:
                best, best_run = run[2], run
        else:
            run = None
    if best_run is None:
        return "never", None, None
    lo = None if best_run[0] == 0 else pts[best_run[0]].size
    hi = None if best_run[1] == len(pts) - 1 else pts[best_run[1]].size
    return ("always" if lo is None and hi is None else "interval"), lo, hi


def _sig(x: float, digits: int = 5) -> float:
    return float(f"{x:.{digits}g}")


def _entry(op: str, points: list[Point], min_gain: float, kernels: dict, mode: str, ic: Interconnect) -> dict:
    fused, lo, hi = qualifying_interval(points, min_gain)
    pts = sorted(points, key=lambda p: p.size)
    excluded = tuple(p.size for p in pts if p.qualifies(min_gain) and not registry.in_interval(p.size, lo, hi))
    entry = Crossover(lo, hi, fused, excluded_wins=excluded).entry()
    gain, margin = decisive([[p.size, p.gain, p.margin] for p in pts], fused, lo, hi)
    entry.update(size_key=registry.get(op).size_key, source="projected", mode=mode, min_gain=min_gain, model=ic.name,
                 kernels=kernels, gain=_sig(gain, 4), margin=_sig(margin, 4),
                 gains=[[p.size, _sig(p.gain, 4), _sig(p.margin, 4)] for p in pts],
                 points=[[p.size, _sig(p.fused_ms), _sig(p.unfused_ms)] for p in pts])
    if len({n for p in pts for n in p.provider_ms}) > 1:
        entry.update(provider_choice([[p.size, p.provider] for p in pts]))
    return entry


def _sources(files: list[ResultFile], device: DeviceModel, op: str, dtype: str):
    """The newest file with complete cases of ``op``, preferring this device, then this dtype: ``(file, dtype,
    cases, day's files)``, or None.

    ``cases`` also hold those of every other file of that device and day with cases at that dtype (a rerun after
    a fix, ``scripts/lab_record.py collect --tag``), named in ``day's files``: a size's point is its worst case
    (:func:`_points`), so a size timed in two runs of one day takes the run that was worse for the fused path.
    Eager rows of one commit have moved by a factor of two between two runs of an H200 host (2026-11-28), and a
    default that flips with the host's noise is no default.
    """
    other16 = [d for d in DTYPES if d != dtype]
    same = [f for f in files if _device_of(f.device) is device]
    others = [f for f in files if f not in same and _device_of(f.device) is not None]
    for group in (same, others):
        for dt in [dtype, *other16]:
            for f in reversed(group):
                cs = cases_for(op, f, dt)
                if cs:
                    day = [f]
                    for g in reversed(group):
                        more = cases_for(op, g, dt) if g is not f and g.date[:10] == f.date[:10] and \
                            _device_of(g.device) is _device_of(f.device) else []
                        if more:
                            cs = cs + more
                            day.append(g)
                    return f, dt, cs, day
    return None


def project_entries(files: list[ResultFile], devices: Sequence[DeviceModel], ops: Sequence[str],
                    world_sizes: Sequence[int] = WORLD_SIZES, dtypes: Sequence[str] = DTYPES,
                    min_gain: float = MIN_GAIN) -> tuple[dict, list[str]]:
    """Every projected entry: ``({table key: entry}, notes)``."""
    entries, notes = {}, []
    for device in devices:
        for dtype in dtypes:
            itemsize = getattr(torch, dtype).itemsize
            for op in ops:
                src = _sources(files, device, op, dtype)
                if src is None:
                    notes.append(f"{device.name} {dtype} {op}: no kernel rows in the results; no entry")
                    continue
                f, src_dtype, cases, day = src
                src_dev = _device_of(f.device)
                transfer = TRANSFER if src_dev is not device or src_dtype != dtype else 0.0
                gemm_scale = src_dev.gemm_tflops / device.gemm_tflops
                bw_scale = src_dev.copy_gbps / device.copy_gbps
                kernels = {"file": f.path, "device": f.device, "date": f.date, "dtype": src_dtype,
                           "world_size": cases[0].world, "anchor": "+".join(sorted({c.anchor_name for c in cases}))}
                if f.commit:
                    kernels["commit"] = f.commit
                if len(day) > 1:  # the same day's other runs, whose worse cases the points took
                    kernels["also"] = sorted(g.path for g in day[1:])
                for w in world_sizes:
                    points = _points(op, cases, w, itemsize, device.interconnect, transfer, gemm_scale, bw_scale)
                    if points:
                        entries[table_key(device.name, w, getattr(torch, dtype), op)] = _entry(
                            op, points, min_gain, kernels, OP_MODELS[op].mode, device.interconnect)
    return entries, notes


def _points(op, cases, w, itemsize, ic, transfer, gemm_scale, bw_scale) -> list[Point]:
    """One point per size: its worst case (several shapes may share a size: the halo conv's extents)."""
    by_size: dict[float, Point] = {}
    for case in cases:
        kw = dict(transfer=transfer, gemm_scale=gemm_scale, bw_scale=bw_scale)
        unfused, fused = project_case(op, case, w, itemsize, ic, pessimistic=False, **kw)
        if not fused:
            continue
        best = min(fused, key=fused.get)
        p_unfused, p_fused = project_case(op, case, w, itemsize, ic, pessimistic=True, **kw)
        gain = unfused / fused[best] - 1
        pess = p_unfused / p_fused[best] - 1
        pt = Point(case.size, gain, max(gain - pess, 0.0), fused[best], unfused, best, fused)
        if case.size not in by_size or pt.gain < by_size[case.size].gain:
            by_size[case.size] = pt
    return list(by_size.values())


def project_table(results: Path | str = RESULTS, *, devices: Sequence[str] | None = None,
                  ops: Sequence[str] | None = None, world_sizes: Sequence[int] = WORLD_SIZES,
                  dtypes: Sequence[str] = DTYPES, min_gain: float = MIN_GAIN) -> dict:
    """The whole projected table (entries and ``_meta``) from the result files under ``results``; deterministic."""
    files = load_rows(results)
    devs = [DEVICES[d] for d in (devices or DEVICES)]
    entries, notes = project_entries(files, devs, list(ops or OP_MODELS), world_sizes, dtypes, min_gain)
    for k, v in entries.items():
        check_entry("(projected)", k, v)
    used = sorted({e["kernels"]["file"] for e in entries.values()})
    inputs = [dict(file=f.path, device=f.device, date=f.date, commit=f.commit) for f in files if f.path in used]
    model = dict(interconnect={"NVLINK4_HGX": asdict(NVLINK4_HGX)},  # the figures, their ends and the rule
                 devices={n: dict(copy_gbps=d.copy_gbps, gemm_tflops=d.gemm_tflops) for n, d in DEVICES.items()},
                 min_gain=MIN_GAIN, noise=NOISE, transfer=TRANSFER, generator="distfuse.tune.project")
    return dict(entries, _meta=dict(format=FORMAT, written_by="distfuse-tune project", model=model, inputs=inputs,
                                    notes=notes, world_sizes=list(world_sizes), dtypes=list(dtypes)))


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def summary(table: dict) -> str:
    lines = []
    for key in sorted(k for k in table if "|" in k):
        e = table[key]
        verdict = "unfused" if e["fused"] == "never" else f"FUSED for {interval_text(e, 3)}"
        gains = ", ".join(f"{g:+.0%}" for _, g, _ in e["gains"])
        lines.append(f"{key}: {verdict}; gain {e['gain']:+.1%} ± {e['margin']:.1%} (by size: {gains})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="distfuse-tune project", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help=f"the lab's result files (default {RESULTS})")
    p.add_argument("--out", type=Path, default=None,
                   help=f"where to write (default: the shipped table {SHIPPED}, rewritten whole); another path is "
                        "merged into (its measured entries are kept)")
    p.add_argument("--devices", nargs="+", default=None, choices=sorted(DEVICES))
    p.add_argument("--ops", nargs="+", default=None, choices=sorted(OP_MODELS))
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--min-gain", type=float, default=MIN_GAIN, help="fuse where the projected gain is at least this")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the output differs from --out")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if not load_rows(args.results):  # e.g. an installed package, whose default results folder does not exist
        print(f"distfuse-tune project: no GPU result files (bench/results JSON with env.device NVIDIA...) under "
              f"{args.results}; pass --results", file=sys.stderr)
        return 1
    table = project_table(args.results, devices=args.devices, ops=args.ops, world_sizes=args.world_sizes,
                          dtypes=args.dtypes, min_gain=args.min_gain)
    out = args.out or SHIPPED
    if not args.quiet:
        print(summary(table))
        for n in table["_meta"]["notes"]:
            print(f"note: {n}")
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != dumps(table):
            print(f"{out} differs from what {args.results} gives: run python -m distfuse.tune.project", file=sys.stderr)
            return 1
        print(f"{out} is what {args.results} gives")
        return 0
    if args.out is None:  # the shipped table: rewritten whole, deterministic, atomically
        write_text_atomic(out, dumps(table))
    else:
        entries = {k: v for k, v in table.items() if "|" in k}
        write_table(out, entries, extra_meta={"projected": table["_meta"]})
    n_fused = sum(1 for k, v in table.items() if "|" in k and v["fused"] != "never")
    print(f"wrote {sum(1 for k in table if '|' in k)} projected entries ({n_fused} fuse somewhere) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
