"""The registered benchmark suites behind ``python -m bench run SUITE``.

Each suite is a :class:`Suite`: a runner that takes :class:`RunOptions` and returns a
:class:`SuiteResult` (harness :class:`~bench.harness.Row` objects plus a status), and the
provider roles (fused, unfused, anchor) per op that plots and crossovers use.

==============  ===================================  =========================================================
suite           file (owner's entry point)           where it runs
==============  ===================================  =========================================================
linear_layers   ``bench_linear_layers.run``          forked gloo CPU ranks, or the torchrun world (NCCL)
conv_layers     ``bench_conv_layers.run``            forked gloo CPU ranks, or the torchrun world (NCCL)
agreement       ``bench_agreement.run``              forked gloo CPU ranks, or the torchrun world (NCCL)
attention       ``bench_attention.suite``            forked gloo CPU ranks, or the torchrun world (NCCL);
                                                     on CUDA also one rank's block in-process
halo_conv       ``bench_halo_conv.main``, wrapped    one GPU; CPU ``--smoke``: its interpreter correctness pass
gemm_fused      ``bench_gemm_fused.sweep``, wrapped  one GPU; CPU ``--smoke``: its interpreter correctness pass
==============  ===================================  =========================================================

The two GPU benches do not expose ``run()``: ``halo_conv`` has only ``main(argv)``, which
writes its own JSON rows (plain dicts); the wrapper calls it in-process per (dims,
channels) group into a temporary file and converts the rows (:func:`halo_rows`).
``gemm_fused`` exposes ``sweep()``, which returns harness rows; the wrapper calls it per
(model, m) case.  Both GPU suites are skipped without CUDA unless ``--smoke`` (their
interpreted kernels would give CPU times that mean nothing); with ``--smoke`` on CPU they
run their correctness passes and return no rows (status ``checked``).

Add a suite with :func:`register`.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed

from bench.harness import Row, add_ratios, track_peak_memory
from distfuse.fused import registry

__all__ = ["RunOptions", "SuiteResult", "Suite", "SUITES", "register", "has_cuda", "halo_rows", "dtype_name"]

BENCH = Path(__file__).resolve().parent


@dataclass
class RunOptions:
    smoke: bool = False
    world_size: int = 4
    dtype: torch.dtype = torch.float32
    progress: bool | None = None  # tqdm's ``disable``: None = bars only on a terminal


@dataclass
class SuiteResult:
    rows: list[Row]
    status: str  # "ok" (rows), "checked" (correctness pass, no timings), "skipped", "unavailable", "failed"
    message: str = ""
    roles: dict = field(default_factory=dict)  # op -> {"fused": provider, "unfused": provider, "anchor": provider}


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    runner: Callable[[RunOptions], SuiteResult]
    gpu_only: bool = False  # without CUDA: skipped unless --smoke
    single_process: bool = False  # one GPU: under torchrun, rank 0 runs it after the multi-rank suites


SUITES: dict[str, Suite] = {}


def register(suite: Suite) -> Suite:
    SUITES[suite.name] = suite
    return suite


def has_cuda() -> bool:
    return torch.cuda.is_available()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def progress(items, desc: str, opts: RunOptions):
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=(not opts.progress) if opts.progress is not None else None,
                file=sys.stderr, leave=False)


# ---------------------------------------------------------------- the layer benches (another engineer's files)


def _layer_suite(module: str, roles: dict) -> Callable[[RunOptions], SuiteResult]:
    def runner(opts: RunOptions) -> SuiteResult:
        try:
            mod = importlib.import_module(f"bench.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"bench.{module}":
                return SuiteResult([], "unavailable", f"bench/{module}.py does not exist yet")
            raise
        if hasattr(mod, "run"):
            rows = [r if isinstance(r, Row) else Row(**r)
                    for r in mod.run(smoke=opts.smoke, world_size=opts.world_size, dtype=opts.dtype)]
            return SuiteResult(rows, "ok", "", roles)
        # No callable entry point: run its main in a subprocess; its rows stay in its own output files.
        cmd = [sys.executable, str(BENCH / f"{module}.py"), "--world-size", str(opts.world_size),
               "--dtype", dtype_name(opts.dtype)] + (["--smoke"] if opts.smoke else [])
        rc = subprocess.run(cmd, check=False).returncode
        return SuiteResult([], "ok" if rc == 0 else "failed", f"ran {module}.main in a subprocess (rc={rc}); "
                                                               "its rows are in its own results file", roles)

    return runner


def _op_roles(ops, **roles) -> dict:
    return {op: dict(roles) for op in ops}


register(Suite(
    "linear_layers", "tensor-parallel Linear layers (all-gather / reduce-scatter, MLP pairs) vs DTensor TP",
    _layer_suite("bench_linear_layers", _op_roles(
        ["mlp_seqpar", "linear_ag_seqpar", "linear_rs_seqpar", "mlp_feat", "linear_ag_feat", "linear_rs_feat"],
        unfused="distfuse", anchor="dtensor"))))
register(Suite(
    "conv_layers", "feature-distributed Conv2d/3d (unfused, fused on CUDA) vs torch.cat halo staging",
    _layer_suite("bench_conv_layers", _op_roles(["feature_conv2d", "feature_conv3d"], fused="distfuse_fused",
                                                unfused="distfuse", anchor="cat"))))
register(Suite(
    "spatial_layers", "distributed MaxPool/AvgPool/Upsample (unfused, static shapes, fused on CUDA) vs torch.cat "
    "halo staging",
    _layer_suite("bench_spatial_layers", _op_roles(["max_pool2d", "avg_pool2d", "max_pool3d", "upsample_bilinear"],
                                                   fused="distfuse_fused", unfused="distfuse", anchor="cat"))))
register(Suite(
    "conv_transpose", "feature-distributed ConvTranspose2d/3d vs torch.cat halo staging",
    _layer_suite("bench_conv_transpose", _op_roles(["conv_transpose2d", "conv_transpose3d"],
                                                   unfused="distfuse", anchor="cat"))))
register(Suite(
    "agreement", "steady-state cost of the agreement checks per layer vs the same layer trusted (no check)",
    _layer_suite("bench_agreement", _op_roles(
        ["feature_conv2d", "general_conv2d", "max_pool2d", "halo_exchange", "broadcast", "linear_all_gather",
         "linear_reduce_scatter", "general_linear"], unfused="agreed", anchor="trusted"))))


def _run_attention(opts: RunOptions) -> SuiteResult:
    # Its own wrapper (not _layer_suite): the status says which anchor ran and why context_parallel did not.
    from bench.bench_attention import suite

    return suite(opts)


register(Suite(
    "attention", "ring attention (contiguous, zig-zag) fwd+bwd vs DTensor context_parallel or all-gather+SDPA; "
    "DistributedMultiheadAttention grids vs heads-only TP; on CUDA one rank's block vs SDPA and its message vs copy_",
    _run_attention))


# ---------------------------------------------------------------- halo staging / halo conv (one GPU)


def halo_rows(data: dict) -> list[Row]:
    """Rows of ``bench_halo_conv``'s own JSON (``{meta, rows: [dict]}``) as harness rows, ratios set.

    ``stage`` rows are against ``copy`` (the device-to-device copy of the staged bytes, the
    ceiling); ``full`` rows (staging + conv fwd + bwd) against ``distdl`` (F.pad + clone + slices).
    """
    shape_keys = ("nd", "batch", "channels", "extent", "halo")
    rows = []
    for d in data["rows"]:
        extra = {k: d[k] for k in ("pct_of_copy",) if k in d}
        rows.append(Row(op=d.get("op", registry.HALO_CONV.name), provider=d["provider"], mode=d["mode"],
                        shape={k: d[k] for k in shape_keys if k in d}, dtype=d["dtype"],
                        world_size=int(d.get("world_size", 1)), ms=d["ms"], ms_q20=d.get("ms_p20", d["ms"]),
                        ms_q80=d.get("ms_p80", d["ms"]), rate=d.get("gbs"),
                        rate_unit="GB/s" if "gbs" in d else None, extra=extra))
    add_ratios([r for r in rows if r.mode == "stage"], "copy")
    add_ratios([r for r in rows if r.mode != "stage"], "distdl")
    return rows


# unfused: distfuse's own unfused staging (the layers' path where dispatch does not fuse), as in the other suites
HALO_ROLES = {registry.HALO_CONV.name: dict(fused="fused", unfused="pieces", anchor="copy")}


def _run_halo(opts: RunOptions) -> SuiteResult:
    import bench.bench_halo_conv as h

    if not has_cuda():
        rc = h.smoke()
        return SuiteResult([], "checked" if rc == 0 else "failed",
                           "CPU: correctness of fused, distdl, cat and pieces staging under the Triton interpreter; "
                           "no timings")
    dt = dtype_name(opts.dtype)
    if opts.smoke:
        groups = [(2, 16)]
        extra_args = ["--extents", "64", "--halos", "1"]
    else:
        groups = [(nd, c) for nd in (2, 3) for c in (16, 32, 64, 128, 256)]
        extra_args = []
    rows: list[Row] = []
    device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory() as tmp:
        for nd, c in progress(groups, "halo_conv", opts):
            out = Path(tmp) / f"halo-{nd}-{c}.json"
            argv = ["--dims", str(nd), "--channels", str(c), "--dtypes", dt, "--out", str(out)] + extra_args
            with track_peak_memory(device) as peak:
                rc = h.main(argv)
            if rc != 0:
                return SuiteResult(rows, "failed", f"bench_halo_conv.main({argv}) returned {rc}", HALO_ROLES)
            if not out.exists():  # every shape of the group was over --max-gib
                continue
            group = halo_rows(json.loads(out.read_text()))
            for r in group:  # the group's peak, not a provider's: the providers run interleaved with their copies
                r.extra["group_peak_mem_mb"] = peak["mb"]
            rows += group
    return SuiteResult(rows, "ok", "one GPU; received halos simulated, no communication timed", HALO_ROLES)


# ---------------------------------------------------------------- fused GEMM + RS / AG + GEMM (one GPU)


def _gemm_roles(world: int) -> dict:
    from bench.bench_gemm_fused import SIDES

    roles = _op_roles([side["gemm"] for side in SIDES.values()], fused="fused", anchor="cublas")
    roles.update(_op_roles([side["bw"] for side in SIDES.values()], fused="fused", anchor="copy"))
    roles.update(_op_roles([getattr(registry, side["op"]).name for side in SIDES.values()],
                           fused=f"projection-fused-{world}gpu", unfused=f"projection-unfused-{world}gpu",
                           anchor=f"projection-unfused-{world}gpu"))
    return roles


def _run_gemm(opts: RunOptions) -> SuiteResult:
    import bench.bench_gemm_fused as g

    if not has_cuda():
        rc = g.smoke()
        return SuiteResult([], "checked" if rc == 0 else "failed",
                           "CPU: correctness of matmul_scatter, chunk_reduce, ag_push, gathered_matmul and the "
                           "loopback autograd ops under the Triton interpreter; no timings")
    device = torch.device("cuda", torch.cuda.current_device())
    W = opts.world_size
    if opts.smoke:
        models, ms, reps, symm = {"llama3-8b": g.MODELS["llama3-8b"]}, (64,), 5, None
    elif torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # Under a multi-rank torchrun only rank 0 runs this suite; SymmMem would use the world group, whose
        # ops are collective over ranks that have moved on.
        models, ms, reps, symm = g.MODELS, g.M_TRAIN + g.M_DECODE, 20, None
        print("gemm_fused: symm_mem provider not run (multi-rank world; it runs on a one-rank group only)")
    else:
        models, ms, reps, symm = g.MODELS, g.M_TRAIN + g.M_DECODE, 20, g.SymmMem()
    if symm is not None and symm.error:
        print(f"gemm_fused: symm_mem provider not run: {symm.error}")
    try:
        rows = gemm_sweep(opts, device, models, ms, reps, symm)
    finally:
        if symm is not None:
            symm.close()
    return SuiteResult(rows, "ok", f"one GPU, {W} virtual ranks (loopback); projection-* rows are modelled, "
                                   "not measured", _gemm_roles(W))


def gemm_sweep(opts: RunOptions, device: torch.device, models: dict, ms, reps: int, symm=None) -> list[Row]:
    """``bench_gemm_fused.sweep`` one (model, m) case at a time (a progress bar; each case's peak memory)."""
    import bench.bench_gemm_fused as g

    rows: list[Row] = []
    cases = [(model, m) for model in models for m in ms]
    for model, m in progress(cases, "gemm_fused", opts):
        with track_peak_memory(device) as peak:
            got = g.sweep({model: models[model]}, (m,), opts.world_size, dtype_name(opts.dtype), reps, device, symm)
        for r in got:
            r.extra["case_peak_mem_mb"] = peak["mb"]
        rows += got
    return rows


register(Suite("halo_conv", "halo staging and staging+conv fwd/bwd: fused Triton vs F.pad/clone and torch.cat",
               _run_halo, gpu_only=True, single_process=True))
register(Suite("gemm_fused", "fused GEMM+reduce-scatter / all-gather+GEMM kernels vs cuBLAS and the copy ceiling",
               _run_gemm, gpu_only=True, single_process=True))
