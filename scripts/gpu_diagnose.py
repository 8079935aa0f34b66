"""Where a fused GEMM op's time goes on one GPU: host issue time, kernel time, and per-config kernel sweeps.

    python scripts/gpu_diagnose.py --json $OUT/diagnose.json            # on the device machine
    python scripts/gpu_diagnose.py --dry-run --json /tmp/diagnose.json  # here: tiny shapes, interpreted

The lab's benchmark (``bench/bench_gemm_fused.py``) times one call between CUDA events after an
L2 flush, so a call whose host work outlasts the flush shows its host time as GPU time.  This
script separates the two, per op of the loopback sides (LLaMA-3 MLP at TP 8, bf16):

* ``host_us``: host time per call, ``calls`` calls issued back to back with no sync;
* ``loop_us``: GPU time per call over the same back-to-back calls (host work overlaps the GPU's,
  so this is the kernel's time wherever the host keeps ahead);
* ``kernel_us``: the device time of the kernels alone (``torch.profiler``), per call, and their names;
* ``cprofile``: the top host functions by own time (text, in the log).

Then the sweeps, at the large shapes, by ``loop_us`` against cuBLAS (or the device copy) in the
same run: the pointer and persistent GEMM + scatter kernels and the persistent all-gather
consumer over block configs, and ``chunk_reduce`` over BLOCK x programs x warps.  A config that
does not compile or fails records its error.  Each section stops at its time budget.

Section ``latency`` times what an eager benchmark row adds to a call's device time: the call after a synchronise,
with and without the L2 flush the benchmark issues first, its host time, and its graph replay
(:func:`call_latency`).  Section ``attrib`` splits one ``chunk_reduce`` call into its parts, the Triton launch
both through the JIT and through the compiled kernel's runner (what a launch costs without the JIT's per-call
argument binding).
Section ``forms`` times the persistent producer's forms against cuBLAS at every model and M: the pinned rule,
its loops nested, its ``SPAN`` flipped, the other 128-row tile, and the chunk-row tiles of ``a6bfa8c``
(:mod:`distfuse.kernels.matmul_scatter_persistent`); then a plain persistent Triton GEMM
(:mod:`bench.triton_gemm_anchor`, ``triton_gemm``) beside cuBLAS (``cublas_anchor``) at both sides' GEMM shapes:
the ceiling of a Triton GEMM with the compiler at hand, which the GEMM + scatter and all-gather targets sit under.
Section ``halo`` times the one-launch staging against the copy, the fused halo conv step against the ``cat``
baseline's (``halo_full``: host time at small shapes, every kernel's device time at large ones), and sweeps the
staging's tiles and warps with and without its alignment promises (``halo_tiles``, each config checked bit-exact
first), and times the staging by part (the regions ``local`` and ``remote``, and ``window``: the window's copy
alone, to tell its cost from the border's in NCHW, where the border took 112 of 124 us at [1, 256, 64^3]).

Every row holds the measured numbers only.  The sweep and ``forms`` rows also name the launch config that ran
(``meta``) and whether it was the default (``default``), and ``env`` holds the kernels' fingerprints, so that
``distfuse-tune tiles`` (:mod:`distfuse.tune.tiles`) can turn them into measured tiles for the pinned rules.
"""

# ruff: noqa: B023 - every closure below is called at once (by `guarded`), inside the iteration that made it
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # model -> (rs: n, k), (ag: n, k): the per-rank GEMMs of the LLaMA-3 MLP at TP 8
    "llama3-8b": ((4096, 1792), (1792, 4096)),
    "llama3-70b": ((8192, 3584), (3584, 8192)),
}
GEMM_CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
    # for M = 512 at TP 8 (64-row chunks, which a 128-row tile half idles): --sweep-m 512; 64x128x64 with 8 warps is
    # the consumer's pinned tile there (python -m distfuse.tune.tiles needs the default's row to compare with)
    (64, 128, 64, 4, 4), (64, 128, 64, 8, 4), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4),
]
REDUCE_BLOCKS, REDUCE_PROGRAMS_PER_SM, REDUCE_WARPS = (1024, 2048, 4096), (1, 2, 4, 8), (4, 8)


def sweep_configs(m: int, W: int) -> list[tuple]:
    """The tile sweep's configs at ``m`` rows: the 64-row tiles only where a chunk (``m / W`` rows) is under 256 rows,
    where a 128-row tile would idle; at larger M they cannot win and their compiles would take the sweep's time."""
    return [c for c in GEMM_CONFIGS if c[0] >= 128 or -(-m // W) < 256]


def producer_forms(torch, Side, shapes, ms, W, dtype, device, record, clock):
    """Section ``forms``: cuBLAS and the persistent GEMM + scatter producer in four forms, at every model and M,
    each timed as back-to-back calls (``loop_us``), one CUDA-graph replay after an L2 flush (``graph_us``) and
    by the profiler (``kernel_us``):

    * ``pinned``: the default launch (a measured tile, else the pinned rule's tile with its ``SPAN`` and the
      fused loops, ``FLATTEN``);
    * ``nested``: the same tile and SPAN, a K loop per tile (``FLATTEN=False``);
    * ``span_flipped``: the same tile and loops, ``SPAN`` the other way;
    * ``tile_flipped``: the other 128-row tile (128x128 for a 128x256 rule, else 128x256), its SPAN by the rule;
    * ``chunk_rows``: the form measured at ``a6bfa8c``: the tile of the chunk's rows, per-chunk row tiles, nested.
    """
    from distfuse.fused.providers import run_producer
    from distfuse.kernels import matmul_scatter_persistent as mscp
    from distfuse.kernels._utils import pinned_gemm_config
    from distfuse.kernels.persistent import persistent_programs
    from distfuse.kernels.tile_table import portable_config

    cuda = device.type == "cuda"
    for model, (rs, _ag) in shapes.items():
        n, k = rs
        for m in ms:
            if clock.left() < 20:
                return
            side = Side("rs", m, n, k, W, dtype, device)
            shape = dict(model=model, side="rs", m=m, n=n, k=k)
            record(section="forms", op="cublas", **shape,
                   **measure(torch, side.cublas, device, 10, profile=cuda, graph=cuda))
            side.prepare()
            try:
                if cuda:  # the default launch (a measured tile, else the rule), W_BLOCK left to the launcher
                    pinned = portable_config(mscp._default_launch(dtype, 1, m, W, n, k, device)[0])
                    old = dict(pinned_gemm_config(dtype, -(-m // W), n, "persistent"), FLATTEN=False, SPAN=False)
                else:
                    pinned = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, FLATTEN=True, SPAN=True)
                    old = dict(pinned, FLATTEN=False, SPAN=False)
                # the other of the two 128-row tiles the rule picks between (128x256 and 128x128), SPAN by its rule
                other = (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
                         if pinned["BLOCK_N"] >= 256 else
                         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3))
                other = dict(other, FLATTEN=True, SPAN=mscp.span_wins(128, m, W)) if cuda else dict(pinned, BLOCK_N=8)
                forms = {"pinned": pinned, "nested": dict(pinned, FLATTEN=False),
                         "span_flipped": dict(pinned, SPAN=not pinned["SPAN"]), "tile_flipped": other,
                         "chunk_rows": old}
                for form, cfg in forms.items():
                    if clock.left() < 15:
                        return
                    meta = portable_config(mscp._complete(dict(cfg), 1, m, W, n, persistent_programs(device))[0])
                    record(section="forms", op="matmul_scatter_persistent", form=form, config=cfg, meta=meta,
                           default=form == "pinned", **shape,
                           **measure(torch, lambda cfg=cfg: run_producer("triton_persistent", side.a, side.weight,
                                                                         side.ws, 0, W, dtype, config=cfg),
                                     device, 10, profile=cuda, graph=cuda))
            finally:
                side.release()
            if cuda:
                torch.cuda.empty_cache()
    gemm_anchors(torch, shapes, ms, dtype, device, record, clock)


def gemm_anchors(torch, shapes, ms, dtype, device, record, clock):
    """Part of section ``forms``: cuBLAS and a plain persistent Triton GEMM (:mod:`bench.triton_gemm_anchor`: the
    producer's loop and tiles, a TMA store, no scatter) at both sides' GEMM shapes (the producer's ``[m, k] @ [n,
    k]^T`` and the all-gather consumer's), at the two 128-row tiles of the pinned rules (M = 512: the 64-row one
    too).  Where this GEMM alone stays under 0.90 of cuBLAS, the gap is the compiler's mainloop, which no epilogue
    closes.  Each anchor's output is checked against cuBLAS's first (``max_err`` against the bf16 rounding bound of
    a K-term fp32 sum, ``ok``)."""
    from bench.triton_gemm_anchor import gemm_anchor

    cuda = device.type == "cuda"
    tiles = ([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4)] if cuda else [(16, 16, 16, 4, 2)])
    for model, (rs, ag) in shapes.items():
        for side_name, (n, k) in (("rs", rs), ("ag", ag)):
            for m in ms:
                if clock.left() < 20:
                    return
                # the operands alone (a side's loopback workspaces would hold a gigabyte for nothing here)
                gen = torch.Generator(device="cpu").manual_seed(m + n + k)
                a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
                b = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=dtype)
                shape = dict(model=model, side=side_name, m=m, n=n, k=k)
                record(section="forms", op="cublas_anchor", **shape,
                       **measure(torch, lambda a=a, b=b: torch.mm(a, b.t()), device, 10, profile=cuda, graph=cuda))
                want = torch.mm(a.float(), b.float().t())
                bound = 2.0 ** -7 * float(want.abs().max()) + k * 2.0 ** -24 * float(
                    (a.float().abs() @ b.float().abs().t()).max())  # one bf16 rounding + a K-term fp32 sum
                for bm, bn, bk, warps, stages in tiles + ([(64, 128, 64, 4, 4)] if cuda and m <= 512 else []):
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
                    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                    gemm_anchor(a, b, cfg, out=out)
                    err = float((out.float() - want).abs().max())
                    record(section="forms", op="triton_gemm", config=cfg, max_err=err, bound=bound,
                           ok=bool(err <= bound), **shape,
                           **measure(torch, lambda a=a, b=b, cfg=cfg, out=out: gemm_anchor(a, b, cfg, out=out),
                                     device, 10, profile=cuda, graph=cuda))
                a = b = want = None
                if cuda:
                    torch.cuda.empty_cache()


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted, tiny shapes: the pipeline only")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--graph", action="store_true", help="sweeps: also time each config replayed from a CUDA graph")
    p.add_argument("--sweep-m", type=int, nargs="+", default=None, help="sweeps: GEMM rows (default the largest M)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole script")
    p.add_argument("--append", action="store_true",
                   help="add the rows to those of --json where it holds an earlier run's (its env is kept, its "
                        "seconds summed): a diagnosis run in two parts, one file")
    p.add_argument("--sections", nargs="+",
                   default=["host", "attrib", "latency", "scatter", "forms", "halo", "gemm", "persistent",
                            "gathered", "reduce"])
    return p.parse_args(argv)


class Clock:
    def __init__(self, budget):
        self.t0, self.budget = time.monotonic(), budget

    def left(self):
        return self.budget - (time.monotonic() - self.t0)


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(torch, fn, device, calls, profile=True, graph=False):
    """host_us, loop_us, kernel_us (+ kernel names) of ``fn`` (see the module doc); ``graph``: also
    ``graph_us``, the median of single CUDA-graph replays after an L2 flush (as the benchmark's graph rows)."""
    if graph and device.type == "cuda":
        from bench.harness import graphed
        from distfuse.timing import time_fn

        graph_us = time_fn(graphed(fn), warmup=2, reps=10, device=device)[0] * 1e3
        return dict(measure(torch, fn, device, calls, profile=profile), graph_us=graph_us)
    fn()
    _sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    _sync(torch, device)
    row = dict(host_us=host_us)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        row["loop_us"] = start.elapsed_time(end) / calls * 1e3
    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        n = 5
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(n):
                fn()
            _sync(torch, device)
        total, names = 0.0, {}
        for evt in p.key_averages():
            t = getattr(evt, "self_device_time_total", None)
            if t is None:
                t = getattr(evt, "self_cuda_time_total", 0.0)
            if t > 0:
                total += t
                names[evt.key[:60]] = round(t / n, 2)
        row["kernel_us"] = total / n
        row["kernels"] = names
    return row


def cprofile_rows(fn, calls, top=16) -> list[dict]:
    """The ``top`` functions by own time over ``max(calls, 200)`` calls of ``fn``: per function its own and
    cumulative microseconds and its calls, per call of ``fn`` (pstats' seconds per ncalls round to 0.000 at these
    costs).  The profiler's own cost inflates functions that make many small calls."""
    calls = max(calls, 200)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO()).stats
    out = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        out.append(dict(function=f"{os.path.basename(path)}:{line}({name})" if line else name,
                        own_us=round(tt / calls * 1e6, 2), cum_us=round(ct / calls * 1e6, 2),
                        calls=round(nc / calls, 2)))
    return out


def cprofile_text(rows: list[dict]) -> str:
    """:func:`cprofile_rows` as a table."""
    lines = ["  own us  cum us  calls/call  function"]
    lines += [f"{r['own_us']:8.2f} {r['cum_us']:7.2f} {r['calls']:10.1f}  {r['function']}" for r in rows]
    return "\n".join(lines)


def cprofile_record(record, section: str, op: str, fn, calls, **fields) -> None:
    """:func:`cprofile_rows` of ``fn``, recorded (row ``op + " (cprofile)"`` of ``section``: a device call's logs
    are not kept, its JSON is) and printed."""
    rows = cprofile_rows(fn, calls)
    record(section=section, op=f"{op} (cprofile)", **fields, cprofile=rows)
    print(f"cprofile {section} {op} {fields}:\n" + cprofile_text(rows), flush=True)


def compiled_runner(st, slots, out, rows, N, ld, slot_elems, W):
    """Two no-argument launches of ``chunk_reduce``'s kernel, or None under the interpreter: ``(runner, jit)``.

    ``runner`` goes through its ``CompiledKernel`` (``binary[grid](*args)``, every argument in order, constexprs
    included): what a launch costs once the JIT's per-call work (binding and specialising the arguments, the cache
    key, the globals check) is skipped.  ``jit`` is the JIT's own launch (``kernel[grid](...)``).  Both launch the
    same binary on the same buffers; ``launch_reduce`` (``distfuse.kernels.launch_cache``) sits between them."""
    from distfuse.kernels import chunk_reduce as cr
    from distfuse.kernels._utils import TIMED_WAITS, round_bf16, timeout_arg
    from distfuse.kernels.host_ints import next_power_of_2

    _meta, kw, programs = cr.reduce_plan(rows, N, ld, slots.dtype, W, out.device)
    args = [slots, out, out, st.flags, st.status, st.sigs, rows, N, ld, slot_elems, 0, st.epoch_dev, timeout_arg(st),
            0, 0]
    consts = dict(HAS_BIAS=False, ROUND_BF16=round_bf16(out.dtype), TIMED=TIMED_WAITS, CHECK_SIG=False, W_UNROLL=W,
                  W_BLOCK=next_power_of_2(W), **kw)
    compiled = cr._chunk_reduce_kernel[(programs,)](*args, **consts)
    if compiled is None or not hasattr(compiled, "function"):
        return None
    names = cr._chunk_reduce_kernel.arg_names
    full = args + [consts[name] for name in names[len(args):]]
    launch = compiled[(programs, 1, 1)]
    return lambda: launch(*full), lambda: cr._chunk_reduce_kernel[(programs,)](*args, **consts)


def direct_launches(st, slots, out, rows, N, ld, slot_elems, W) -> dict:
    """The launch cache's own two levels on ``chunk_reduce``'s kernel (warm): a hit as ``launch_reduce`` makes it
    (fingerprint, then the binary's launcher called directly), and that launcher alone with the stream read once
    (what a hit costs without its fingerprint), with the tensors as tensors and with the device ones by address (what
    a hit passes: the launcher's ``data_ptr`` call and ``cuPointerGetAttribute`` per pointer, or neither), and the C
    launcher behind it called as a hit calls it (:func:`~distfuse.kernels.raw_launch.fast_launcher`):
    ``{name: no-argument launch}``, empty without a direct launcher."""
    from distfuse.kernels import chunk_reduce as cr
    from distfuse.kernels._utils import TIMED_WAITS, round_bf16, timeout_arg
    from distfuse.kernels.host_ints import next_power_of_2
    from distfuse.kernels.launch_cache import by_address, cached_launch, direct_launcher
    from distfuse.kernels.raw_launch import fast_launcher

    _meta, kw, programs = cr.reduce_plan(rows, N, ld, slots.dtype, W, out.device)
    args = [slots, out, out, st.flags, st.status, st.sigs, rows, N, ld, slot_elems, 0, st.epoch_dev, timeout_arg(st),
            0, 0]
    consts = dict(HAS_BIAS=False, ROUND_BF16=round_bf16(out.dtype), TIMED=TIMED_WAITS, CHECK_SIG=False, W_UNROLL=W,
                  W_BLOCK=next_power_of_2(W), **kw)
    cache = cached_launch(cr._chunk_reduce_kernel)
    binary = cache[(programs,)](*args, **consts)
    direct = direct_launcher(binary) if binary is not None else None
    if direct is None:
        return {}
    run, function, packed = direct
    names = cr._chunk_reduce_kernel.arg_names
    full = args + [consts[name] for name in names[len(args):]]
    addressed = [by_address(a) for a in full]
    raw, mid = fast_launcher(run, packed)
    import torch

    stream = torch._C._cuda_getCurrentRawStream(out.device.index)
    return {"the launch cache's hit (fingerprint + the launcher)": lambda: cache[(programs,)](*args, **consts),
            "the binary's launcher alone (run(...), no hooks)": lambda: run(programs, 1, 1, stream, function, packed,
                                                                           None, None, None, *full),
            "the binary's launcher alone, device tensors by address": lambda: run(
                programs, 1, 1, stream, function, packed, None, None, None, *addressed),
            "the C launcher as a hit calls it (device tensors by address)": lambda: raw(
                programs, 1, 1, stream, function, *mid, *addressed)}


def attribute(torch, Side, shapes, m, W, dtype, device, calls, record) -> None:
    """Host time of chunk_reduce and gathered_matmul, whole and by part (checks, allocation, launch, status)."""
    from distfuse.geometry.decomposition import block_extent
    from distfuse.kernels.chunk_reduce import launch_reduce, slot_row_stride
    from distfuse.kernels.gathered_matmul_persistent import launch_gathered_persistent

    model, ((n_rs, k_rs), (n_ag, k_ag)) = next(iter(shapes.items()))
    side = Side("rs", m, n_rs, k_rs, W, dtype, device)
    side.prepare()
    try:
        st = side.ws.rank_view(0)
        N = side.n
        ld = slot_row_stride(N)
        slot_elems = (-(-m // W)) * ld
        slots = st.data(dtype, W * slot_elems)
        rows = block_extent(m, W, 0)
        out = torch.empty(rows, N, dtype=dtype, device=device)
        try:
            runner, jit = compiled_runner(st, slots, out, rows, N, ld, slot_elems, W) or (None, None)
        except Exception as exc:  # noqa: BLE001 - Triton-version specific: recorded, the section goes on
            record(section="attrib", op="compiled kernel's runner", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            runner = jit = None
        parts = {
            "chunk_reduce (whole call)": side.chunk_reduce,
            "chunk_reduce with out=": lambda: side.chunk_reduce(out=out),
            "launch_reduce (the Triton launch, cached)": lambda: launch_reduce("chunk_reduce", st, slots, out, None,
                                                                             rows, N, ld, slot_elems, 0, W),
            "check_status (deferred)": lambda: st.check_status("chunk_reduce", "diag"),
            "torch.empty (the output)": lambda: torch.empty(rows, N, dtype=dtype, device=device),
        }
        if runner is not None:  # the same launch without the JIT's binder, cache key and globals check
            parts["compiled kernel's runner (the launch alone)"] = runner
            parts["the JIT's launch (kernel[grid](...), no cache)"] = jit
            try:
                parts.update(direct_launches(st, slots, out, rows, N, ld, slot_elems, W))
            except Exception as exc:  # noqa: BLE001 - Triton-version specific: recorded, the section goes on
                record(section="attrib", op="direct launches", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        for name, fn in parts.items():
            record(section="attrib", op=name, model=model, m=m, **measure(torch, fn, device, calls, profile=False))
        if device.type == "cuda":
            cprofile_record(record, "attrib", "chunk_reduce (whole call)", side.chunk_reduce, calls, model=model, m=m)
    finally:
        side.release()
    side = Side("ag", m, n_ag, k_ag, W, dtype, device)
    side.prepare()
    try:
        st = side.ws.rank_view(0)
        x = side.shards[0]
        gathered = st.data(dtype, m * side.k)
        parts = {
            "gathered_matmul (whole call)": side.fused_gemm,
            "launch_gathered_persistent (descriptors + launch)": lambda: launch_gathered_persistent(
                x, gathered, side.weight, None, side.out.view(1, m, side.n), st, 0, W, m),
        }
        for name, fn in parts.items():
            record(section="attrib", op=name, model=model, m=m, **measure(torch, fn, device, calls, profile=False))
        if device.type == "cuda":
            cprofile_record(record, "attrib", "gathered_matmul (whole call)", side.fused_gemm, calls, model=model, m=m)
    finally:
        side.release()


def scatter_sweep(torch, Side, shapes, W, dtype, device, calls, record, cuda, clock) -> None:
    """The cuBLAS provider's whole-GEMM schedule at M = 512 (its rule's shapes), in parts: cuBLAS's GEMM, the copy of
    its output's bytes, ``scatter_partial`` over its tile configs (:func:`~distfuse.kernels.scatter_partial.
    sweep_configs`, the default marked) and the whole producer, each loop- and graph-timed."""
    from distfuse.fused.providers import run_producer
    from distfuse.kernels import scatter_partial as sp

    m = 512 if cuda else 8
    default = dict(sp.scatter_partial_blocks(dtype.itemsize, device), PER_SM=sp.PROGRAMS_PER_SM)
    configs = sp.sweep_configs(dtype.itemsize) if cuda else [dict(default)]
    for model, ((n, k), _) in shapes.items():
        if clock.left() < 20:
            return
        side = Side("rs", m, n, k, W, dtype, device, provider="cublas_chunks")
        shape = dict(model=model, side="rs", m=m, n=n, k=k)
        partial = torch.matmul(side.a, side.weight.t()).contiguous()
        dst = torch.empty_like(partial)
        record(section="scatter", op="cublas", **shape, **measure(torch, side.cublas, device, calls, graph=cuda))
        record(section="scatter", op="copy", **shape, bytes=partial.numel() * partial.element_size(),
               **measure(torch, lambda dst=dst, partial=partial: dst.copy_(partial), device, calls, profile=False,
                         graph=cuda))
        side.prepare()
        try:
            record(section="scatter", op="producer:cublas_chunks", **shape,
                   **measure(torch, lambda: run_producer("cublas_chunks", side.a, side.weight, side.ws, 0, W, dtype),
                             device, calls, graph=cuda))
            for cfg in configs:
                if clock.left() < 10:
                    break
                record(section="scatter", op="scatter_partial", **shape, config=cfg, default=cfg == default,
                       **measure(torch, lambda cfg=cfg, partial=partial: sp.scatter_partial(partial, side.ws, 0, W,
                                                                                           config=cfg),
                                 device, calls, profile=False, graph=cuda))
        finally:
            side.release()
        side = partial = dst = None
        if cuda:
            torch.cuda.empty_cache()


def call_latency(torch, fn, device, reps=20) -> dict:
    """What the benchmarks' eager rows add to a call's device time, in parts (medians over ``reps``; us).

    * ``eager_us``: a cold call (the benchmarks' eager timing before 2026-11-29, their ``extra.ms_synced`` since):
      CUDA events around the call, after an L2 flush (a 256 MB write the host's issue overlaps), once the previous
      call has synchronised;
    * ``noflush_us``: the same without the flush, so the host's time to the launch is exposed in full;
    * ``host_us``: the call's host time just after a synchronise (a cold call, as each timed one is);
    * ``graph_us``: the call replayed from a CUDA graph (no host work).

    ``eager_us - graph_us`` is what the host added to the eager row; ``host_us`` against the flush's time says why.
    """
    from bench.harness import graphed
    from distfuse.timing import L2_FLUSH_BYTES, median, time_fn

    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    _sync(torch, device)
    eager, noflush, host, flush_ms = [], [], [], []
    for _ in range(reps):
        for flushed, out in ((True, eager), (False, noflush)):
            if cuda:
                e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                e0.record()
                if flushed:
                    flush.zero_()
                e1.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                e2.record()
                e2.synchronize()
                out.append(e1.elapsed_time(e2) * 1e3)
                if flushed:
                    flush_ms.append(e0.elapsed_time(e1) * 1e3)
                    host.append((t1 - t0) * 1e6)
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
                if flushed:
                    host.append(out[-1])
    row = dict(eager_us=median(eager), noflush_us=median(noflush), host_us=median(host))
    if cuda:
        row.update(flush_us=median(flush_ms), graph_us=time_fn(graphed(fn), warmup=2, reps=10, device=device)[0] * 1e3)
    return row


def latency_section(torch, Side, shapes, W, dtype, device, record, cuda) -> None:
    """:func:`call_latency` of the copy anchor, ``chunk_reduce``, the persistent producer, the gathered consumer
    (LLaMA-3 8B, M = 8192) and the halo staging (2-D C = 64 n = 512, both formats): the eager rows that lost most
    to their graph rows on 2026-11-28; and torch's sum of a chunk's W partials (``torch_sum``), the bytes
    ``chunk_reduce`` moves summed by another kernel (its graph row against ``chunk_reduce``'s: how far a W-stream
    read sits from the copy's speed at this size, 0.82 of it for ``chunk_reduce`` there); then ``chunk_reduce``'s
    two flag polls at every model's size (:func:`flag_poll_rows`)."""
    from bench.bench_halo_conv import Case, stage_fused

    (rs, ag) = shapes["llama3-8b"] if cuda else next(iter(shapes.values()))
    m = 8192 if cuda else 8
    side = Side("rs", m, rs[0], rs[1], W, dtype, device, provider="triton_persistent")
    dst = torch.empty_like(side.out)
    record(section="latency", op="copy", m=m, **call_latency(torch, lambda: dst.copy_(side.out), device))
    record(section="latency", op="cublas", m=m, **call_latency(torch, side.cublas, device))
    side.prepare()
    try:
        record(section="latency", op="producer:triton_persistent", m=m, **call_latency(torch, side.fused_gemm, device))
        record(section="latency", op="chunk_reduce", m=m, **call_latency(torch, side.chunk_reduce, device))
    finally:
        side.release()
    # torch's own sum of the W partials of a chunk (the bytes chunk_reduce moves: W chunks read, one written, fp32
    # inside): another kernel's ceiling for reading W streams at once, beside the copy's
    parts = torch.randn(W, -(-m // W), rs[0], device=device).to(dtype)
    summed = torch.empty(parts.shape[1:], device=device, dtype=dtype)
    record(section="latency", op="torch_sum", m=m,
           **call_latency(torch, lambda: torch.sum(parts, dim=0, out=summed), device))
    parts = summed = None
    side = Side("ag", m, ag[0], ag[1], W, dtype, device)
    side.prepare()
    try:
        record(section="latency", op="gathered_matmul", m=m, **call_latency(torch, side.fused_gemm, device))
    finally:
        side.release()
    side = None
    for cl in (False, True):
        case = Case(2, 1, 64 if cuda else 2, 512 if cuda else 4, 1, dtype, device, channels_last=cl)
        record(section="latency", op="halo_stage", nd=2, C=case.x.shape[1], n=case.x.shape[-1],
               format="channels_last" if cl else "nchw",
               **call_latency(torch, lambda case=case: stage_fused(case, case.x, case.recv), device))
    case = None
    # chunk_reduce's two flag polls at every model's size (the tile table keys on the shape), last: a failure here
    # costs only these rows (an error row per model)
    for model, (rs, _) in shapes.items():
        side = Side("rs", m, rs[0], rs[1], W, dtype, device, provider="triton_persistent")
        try:
            side.prepare()
            try:
                flag_poll_rows(torch, side, model, W, dtype, device, record, cuda)
            finally:
                side.release()
        except Exception as exc:  # noqa: BLE001 - recorded, the next model goes on
            record(section="reduce:poll", op="chunk_reduce (poll)", model=model, m=m,
                   error=f"{type(exc).__name__}: {str(exc)[:300]}")
        side = None
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.empty_cache()


def flag_poll_rows(torch, side, model, W, dtype, device, record, cuda) -> None:
    """``chunk_reduce`` at its default launch with its W flags polled both ways (``poll``: ``atomic``, the default,
    or ``load``, ``DISTFUSE_FLAG_POLL=load``), graph-timed: whether the 1 056 programs' acquire atomics on the same
    eight words are the 3-5 us it spends over the copy (``docs/gpu.md``).  Rows of section ``reduce:poll``, op
    ``chunk_reduce (poll)``, with the launch's ``meta`` and whether it is the ``default`` one, as the ``reduce``
    section's rows: ``distfuse-tune tiles --write`` turns a poll that beats the default by its margin into a
    measured tile (``POLL_LOADS``) of this shape.  ``poll_loads`` says what ran (the interpreter always polls with
    atomics), ``matches_atomic`` that its output is bitwise the atomic poll's and free of NaN."""
    from distfuse.geometry.decomposition import block_extent
    from distfuse.kernels._utils import INTERPRET
    from distfuse.kernels.chunk_reduce import reduce_plan, slot_row_stride
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce
    from distfuse.kernels.persistent import persistent_programs

    m = side.m
    meta = reduce_plan(block_extent(m, W, 0), side.n, slot_row_stride(side.n), dtype, W, device)[0]
    programs = meta["PER_SM"] * (persistent_programs(device) if cuda else 1)
    outs = {}
    for loads in (False, True):
        cfg = dict(BLOCK=meta["BLOCK"], PROGRAMS=programs, num_warps=meta["num_warps"], POLL_LOADS=loads)

        def run(cfg=cfg):
            return chunk_reduce(side.ws, 0, W, 1, side.m, side.n, partial_dtype=dtype, out=side.out[: side.m // W],
                                config=cfg)

        outs[loads] = run().clone()
        ran = loads and not INTERPRET
        record(section="reduce:poll", op="chunk_reduce (poll)", poll="load" if loads else "atomic", poll_loads=ran,
               model=model, m=m, n=side.n, k=side.k, config=cfg,
               meta=dict(BLOCK=meta["BLOCK"], PER_SM=meta["PER_SM"], num_warps=meta["num_warps"], POLL_LOADS=ran),
               default=ran == meta["POLL_LOADS"],
               matches_atomic=bool(torch.equal(outs[loads], outs[False])) and not outs[loads].isnan().any().item(),
               **measure(torch, run, device, 20, profile=False, graph=cuda))


def halo_stage_times(torch, device, dtype, calls, record, cuda) -> None:
    """Host, loop, kernel and graph time of the fused halo staging and of the copy of the staged bytes, in NCHW and
    channels last."""
    from bench.bench_halo_conv import Case, stage_fused

    shapes = [(3, 64, 64), (3, 256, 64), (2, 256, 512)] if cuda else [(2, 2, 4)]
    for (nd, c, n), cl in itertools.product(shapes, (False, True)):  # NCHW, and channels last (16-byte rows)
        case = Case(nd, 1, c, n, 1, dtype, device, channels_last=cl)
        dst = torch.empty(case.staged_shape, device=device, dtype=dtype, memory_format=case.fmt)
        shape = dict(nd=nd, C=c, n=n, format="channels_last" if cl else "nchw",
                     staged_bytes=dst.numel() * dst.element_size())
        record(section="halo", op="halo_stage", **shape,
               **measure(torch, lambda case=case: stage_fused(case, case.x, case.recv), device, calls, graph=cuda))
        record(section="halo", op="copy", **shape,
               **measure(torch, lambda case=case, dst=dst: dst.copy_(case.staged_ref), device, calls, graph=cuda))


def halo_tile_sweep(torch, device, dtype, calls, record, cuda, clock) -> None:
    """Kernel time of the one-launch staging per tile config, with and without the row-alignment hints, against the
    copy of the staged bytes (the pinned config, :func:`~distfuse.kernels.halo_programs.stage_tile`, was chosen
    without a GPU), in NCHW and in channels last (rows of ``L_last * C`` elements: ``format`` in the rows).  Each
    config's output is checked bit-exact against the torch reference first."""
    from bench.bench_halo_conv import Case
    from distfuse.kernels import halo_programs as hp

    shapes = ([(3, 64, 64, False), (3, 256, 64, False), (2, 64, 512, False), (2, 256, 512, False),
               (3, 64, 64, True), (2, 256, 512, True)] if cuda else [(2, 2, 8, False), (2, 2, 8, True)])
    # 1024 and 2048 elements: in 3-D NCHW the smallest tile swept so far (4096) was the fastest, 125 us against 159
    # at 8192 and 161 at 16384 ([1, 256, 64^3], H200, 2026-11-28)
    configs = ([(e, w) for e in (4096, 8192, 16384) for w in (4, 8)] + [(1024, 4), (2048, 4)]) if cuda else [(64, 4)]
    for nd, c, n, cl in shapes:
        case = Case(nd, 1, c, n, 1, dtype, device, channels_last=cl)
        out = torch.empty(case.staged_shape, device=device, dtype=dtype, memory_format=case.fmt)
        shape = dict(nd=nd, C=c, n=n, format="channels_last" if cl else "nchw",
                     staged_bytes=out.numel() * out.element_size())
        dst = torch.empty_like(out)
        # the kernels' view: LEAD vectors of TRAIL elements per spatial position (channels last: B and C)
        trail = c if cl else 1
        lead = case.x.numel() // math.prod(case.x.shape[2:]) // trail
        # The rows of whole stagings carry their config and the tile table's key (M, N, K: distfuse-tune tiles),
        # marked default where the staging's own choice (rules, or a measured entry) is the same config, and are
        # timed from CUDA-graph replays too (graph_us: the kernels without the host, which the table compares); the
        # copy of the staged bytes, their anchor, carries the key too
        default_launch = hp.stage_launch(case.plan, case.index, lead, device, "all", None, None, trail, None, None,
                                         dtype)
        key = dict(key=hp.stage_key(default_launch, lead, trail))
        default_config = hp.stage_config(default_launch, case.x.element_size())

        def tabled(launch):  # a whole staging's row fields for the tile table
            config = hp.stage_config(launch, case.x.element_size())
            return dict(meta=config, default=config == default_config, **key)
        record(section="halo_tiles", op="copy", **shape, **key,
               **measure(torch, lambda dst=dst, case=case: dst.copy_(case.staged_ref), device, calls, graph=cuda))
        # The window's bytes alone: copied contiguously, and by torch's own strided copy into the staged layout (its
        # rows L_last apart, at an offset of the halo): what the layout costs any copy, beside region=window below
        # (this kernel's copy of the same window). If torch's strided copy is as far from the contiguous one as the
        # staging is from the copy of the staged bytes, the gap is the layout's, not the kernel's.
        window = dst[(slice(None), slice(None)) + (slice(case.h, case.h + n),) * nd]
        flat = torch.empty_like(case.x)
        record(section="halo_tiles", op="copy window (contiguous)", **shape,
               **measure(torch, lambda flat=flat, case=case: flat.copy_(case.x), device, calls))
        window.fill_(float("nan"))
        window.copy_(case.x)
        record(section="halo_tiles", op="copy window (strided, torch)", **shape,
               exact=bool(torch.equal(window, case.x)),
               **measure(torch, lambda window=window, case=case: window.copy_(case.x), device, calls))
        if not cl:
            rows_probe_rows(torch, case, shape, device, calls, record)
        # The pinned tile, by region: the window and x's pieces, then recv's pieces, then the window's copy alone
        # ("window": no column beside it and no slab, a diagnosis region of stage_launch); then the slabs both ways
        # (one piece per row, the stage_launch default where it applies, against the table walk per element) and
        # the launch both ways (the window's programs and the slabs' apart, hp.STAGE_SPLIT, the GPU default, against
        # one launch of both), each checked bit for bit first
        variants = [(f"halo_stage region={region}", dict(region=region)) for region in ("local", "remote", "window")]
        variants += [(f"halo_stage slab_rows={flag}", dict(region="all", slab_rows=flag)) for flag in (True, False)]
        variants += [(f"halo_stage split={flag}", dict(region="all", split=flag)) for flag in (True, False)]
        variants += [("halo_stage region=local split=False", dict(region="local", split=False))]  # remote: no split
        if not cl:  # the window's rows as flat words, then the strips and the slabs (halo_stage_words), forced
            variants += [("halo_stage words=True", dict(region="all", words=True))]
        for name, how in variants:
            try:
                launch = hp.stage_launch(case.plan, case.index, lead, device, how["region"], None,
                                         how.get("slab_rows"), trail, how.get("split"), how.get("words"))
            except ValueError as exc:  # slab_rows=True where the window's columns are not one linear segment
                record(section="halo_tiles", op=name, **shape, error=str(exc)[:200])
                continue
            extra, graph = {}, False
            if ("slab_rows" in how or "split" in how or "words" in how) and how["region"] == "all":
                out.fill_(float("nan"))
                hp.launch_stage(out, case.x, case.recv, launch)
                extra = dict(exact=bool(torch.equal(out, case.staged_ref)))
                if "slab_rows" not in how:  # a config the table can hold (slab_rows is the rules' alone)
                    extra, graph = dict(extra, **tabled(launch)), cuda
            elif "split" in how:  # a pass of one region: bitwise the same region's default launch, the rest untouched
                want = torch.full_like(out, 7.0)
                hp.launch_stage(want, case.x, case.recv, hp.stage_launch(case.plan, case.index, lead, device,
                                                                           how["region"], None, None, trail))
                out.fill_(7.0)
                hp.launch_stage(out, case.x, case.recv, launch)
                extra = dict(exact=bool(torch.equal(out, want)))
            record(section="halo_tiles", op=name, **shape, **extra,
                   **measure(torch, lambda out=out, case=case, launch=launch: hp.launch_stage(out, case.x, case.recv,
                                                                                             launch),
                             device, calls, graph=graph))
        if not cl:  # the layers' two passes (local, then remote), by default and with the words form's local pass
            two_pass_rows(torch, hp, case, shape, lead, device, calls, record)
        for elems, warps in configs:
            if clock.left() < 15:
                return
            bx = hp.stage_tile(n * trail, (n + 2) * trail, 1, device, None)[1] if cuda else n * trail
            br = max(1, elems // bx)
            # STRIP_X: one element a thread in NCHW; in channels last a chunk of one spatial column's channels, at
            # most 8 elements a thread (stage_launch's own choice)
            strip = (min(hp.pow2_divisor(trail, cap=1 << 30), max(1, 8 * 32 * warps // br)) if cl
                     else max(1, 32 * warps // br))
            tile = (br, bx, max(1, bx // hp.STAGE_SLAB_SPLIT), strip, warps)
            base = hp.stage_launch(case.plan, case.index, lead, device, "all", tile, None, trail)
            for hints in (True, False):
                off = dict(X_ALIGN=1, OUT_ALIGN=1, SLAB_ALIGN=1, STRIP_ALIGN=min(1, base.meta.get("STRIP_ALIGN", 0)))
                launch = base if hints else base._replace(meta=dict(base.meta, **off), bound={})  # its own binding
                out.fill_(float("nan"))
                hp.launch_stage(out, case.x, case.recv, launch)
                exact = bool(torch.equal(out, case.staged_ref))
                row = measure(torch, lambda out=out, case=case, launch=launch: hp.launch_stage(out, case.x, case.recv,
                                                                                              launch),
                              device, calls, graph=cuda and hints)
                record(section="halo_tiles", op="halo_stage", **shape, tile=list(tile), hints=hints, exact=exact,
                       x_align=launch.meta["X_ALIGN"], out_align=launch.meta["OUT_ALIGN"],
                       **(tabled(launch) if hints else {}), **row)


def two_pass_rows(torch, hp, case, shape, lead, device, calls, record) -> None:
    """The overlap's two passes into one output, as the layers stage on GPUs: rows ``halo_stage two passes`` (the
    default launches) and ``halo_stage two passes words=True`` (the local pass in the words form, which leaves the
    received elements of its groups 0 for the remote pass), each checked bit for bit against the reference first."""
    out = torch.empty_like(case.staged_ref)
    for name, words in (("halo_stage two passes", None), ("halo_stage two passes words=True", True)):
        local = hp.stage_launch(case.plan, case.index, lead, device, "local", None, None, 1, None, words)
        remote = hp.stage_launch(case.plan, case.index, lead, device, "remote", None, None, 1)

        def both(local=local, remote=remote):
            hp.launch_stage(out, case.x, case.recv, local)
            hp.launch_stage(out, case.x, case.recv, remote)

        out.fill_(float("nan"))
        both()
        record(section="halo_tiles", op=name, **shape, exact=bool(torch.equal(out, case.staged_ref)),
               words_form=bool(local.words), **measure(torch, both, device, calls))


def rows_probe_rows(torch, case, shape, device, calls, record) -> None:
    """The NCHW staged layout written by whole rows per program, against the window's rows alone
    (``bench/halo_rows_probe.py``, zero padding, no exchange): rows ``rows probe (whole rows)``, ``(whole rows,
    paired)``, ``(flat words)``, ``(flat words, gathered)`` and ``(window)`` of section ``halo_tiles``, each
    checked bit for bit first (the window's against a poisoned border, which must stay poisoned).  Read the whole
    rows and the flat words against ``copy`` (the staged bytes) and ``window`` against ``copy window
    (contiguous)`` (the block's): whether piecemeal sectors at the rows' ends, or one-element stores, keep the 3-D
    NCHW staging at 0.57-0.65 of its copy, and whether the flat words' 16-byte stores reach the copy where the rows
    do not."""
    from bench.halo_rows_probe import probe_reference, rows_probe, words_probe

    x, h = case.x, case.h
    want = probe_reference(x, h)
    out = torch.empty_like(want)
    inner = (slice(None), slice(None)) + tuple(slice(h, h + e) for e in x.shape[2:])
    forms = (("whole rows", True, lambda: rows_probe(x, out, h, faces=True)),
             ("whole rows, paired", True, lambda: rows_probe(x, out, h, faces=True, paired=True)),
             ("flat words", True, lambda: words_probe(x, out, h)),
             ("flat words, gathered", True, lambda: words_probe(x, out, h, gather=True)),
             ("window", False, lambda: rows_probe(x, out, h, faces=False)))
    for name, faces, write in forms:
        out.fill_(float("nan"))
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a row, not the end of the section
            record(section="halo_tiles", op=f"rows probe ({name})", **shape, error=f"{type(exc).__name__}: {exc}"[:300])
            continue
        if faces:
            exact = bool(torch.equal(out, want))
        else:
            border = torch.ones(out.shape, dtype=torch.bool, device=out.device)
            border[inner] = False
            exact = bool(torch.equal(out[inner], x)) and bool(out[border].isnan().all())
        record(section="halo_tiles", op=f"rows probe ({name})", **shape, exact=exact,
               bytes=(want if faces else x).numel() * x.element_size(), **measure(torch, write, device, calls))


def halo_full_host(torch, device, dtype, calls, record, cuda) -> None:
    """The fused halo conv step (staging, cuDNN, unstage, accumulate) against the cat baseline's: host time at the
    small shapes (where the step is bound by it), and at the large ones the device time of every kernel of a step
    (``kernels``: where the backward's time goes, the conv's kernels being the same in both).  At the small shapes
    also the layers' own unfused step (``pieces``: what dispatch weighs the fused step against)."""
    from bench.bench_halo_conv import Case, full_step, step_leaves

    small = [(2, 64, 64, False), (3, 64, 64, False)] if cuda else [(2, 2, 4, False)]
    # 2-D C=64 n=512: the fused step lost to cat by 290 us (NCHW) and 410 us (channels last) on 2026-11-28
    large = ([(2, 64, 512, False), (2, 64, 512, True), (2, 256, 512, False), (3, 256, 64, False)] if cuda
             else [(3, 2, 4, False), (2, 2, 4, True)])
    for nd, c, n, cl in small + large:
        case = Case(nd, 1, c, n, 1, dtype, device, channels_last=cl)
        for provider in ("fused", "cat") + (("pieces",) if (nd, c, n, cl) in small else ()):
            inputs = step_leaves(case, provider)

            def step(case=case, p=provider, inputs=inputs):
                return full_step(case, p, *inputs)

            profile = (nd, c, n, cl) in large
            record(section="halo_full", op=provider, nd=nd, C=c, n=n, format="channels_last" if cl else "nchw",
                   **measure(torch, step, device, calls if not profile else max(3, calls // 5), profile=profile))
            if cuda and not profile:  # where the host time goes, in both steps
                cprofile_record(record, "halo_full", provider, step, calls, nd=nd, C=c, n=n,
                                format="channels_last" if cl else "nchw")
        case = None


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from bench.bench_gemm_fused import Side

    clock = Clock(args.budget)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    W = 8 if cuda else 2
    shapes = SHAPES if cuda else {"tiny": ((48, 16), (16, 48))}
    ms = (512, 8192) if cuda else (8,)
    dtype = torch.bfloat16 if cuda else torch.float32
    calls = args.calls if cuda else 2
    rows: list[dict] = []
    from bench.harness import settings

    env = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               commit=os.environ.get("DISTFUSE_COMMIT", "unknown"), date=time.strftime("%Y-%m-%d"), dry_run=not cuda,
               settings=settings())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    from distfuse.kernels.persistent import persistent_programs
    from distfuse.kernels.tile_table import dtype_name
    from distfuse.tune.tiles import current_fingerprints

    # what python -m distfuse.tune.tiles needs to turn the sweeps into measured tiles
    env.update(W=W, dtype=dtype_name(dtype), sms=persistent_programs(device), fingerprints=current_fingerprints())
    earlier = 0.0
    if args.append and args.json.exists():  # the first part's rows and env (same device, commit and date)
        first = json.loads(args.json.read_text())
        rows.extend(first.get("rows", []))
        env, earlier = dict(first.get("env", env)), float(first.get("env", {}).get("seconds") or 0.0)

    def save():
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))

    def record(**row):
        rows.append(row)
        short = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "kernels"}
        print("diag:", json.dumps(short), flush=True)
        if "kernels" in row:
            print("      kernels:", row["kernels"], flush=True)
        save()

    def guarded(section, what, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            record(section=section, what=what, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            _sync(torch, device) if cuda else None
            return None

    # ---- host vs kernel, per op
    if "host" in args.sections:
        for model, (rs, ag) in shapes.items():
            for m in ms:
                if clock.left() < 30:
                    break
                for side_name, (n, k) in (("rs", rs), ("ag", ag)):
                    side = Side(side_name, m, n, k, W, dtype, device)
                    shape = dict(model=model, side=side_name, m=m, n=n, k=k)
                    guarded("host", "cublas", lambda: record(section="host", op="cublas", **shape,
                                                             **measure(torch, side.cublas, device, calls)))
                    providers = ("triton", "triton_persistent", "cublas_chunks") if side_name == "rs" else \
                        ("triton", "copy_engine")
                    for prov in providers:
                        side.provider = prov

                        def one(prov=prov):
                            side.prepare()
                            try:
                                fn = side.fused_gemm if side_name == "rs" else side.push
                                record(section="host", op=("producer:" if side_name == "rs" else "push:") + prov,
                                       **shape, **measure(torch, fn, device, calls))
                                if m == 512 and model == "llama3-8b" and cuda:
                                    cprofile_record(record, "host", ("producer:" if side_name == "rs" else "push:")
                                                    + prov, fn, calls, **shape)
                                if prov == "triton":
                                    fn2 = side.chunk_reduce if side_name == "rs" else side.fused_gemm
                                    name = "chunk_reduce" if side_name == "rs" else "gathered_matmul"
                                    record(section="host", op=name, **shape, **measure(torch, fn2, device, calls))
                                    if m == 512 and model == "llama3-8b" and cuda:
                                        cprofile_record(record, "host", name, fn2, calls, **shape)
                            finally:
                                side.release()

                        guarded("host", f"{side_name}:{prov}:{m}", one)
                    side.provider = "triton"
                    side = None  # free before the next shape
                    if cuda:
                        torch.cuda.empty_cache()

    # ---- where a consumer's host time goes: the whole call against its parts, at one large shape
    if "attrib" in args.sections and clock.left() > 30:
        guarded("attrib", "parts", lambda: attribute(torch, Side, shapes, ms[-1], W, dtype, device, calls, record))

    # ---- what the host adds to an eager row: the call's time after a synchronise, with and without the flush
    if "latency" in args.sections and clock.left() > 20:
        guarded("latency", "calls", lambda: latency_section(torch, Side, shapes, W, dtype, device, record, cuda))

    # ---- the cuBLAS provider's whole-GEMM schedule at M = 512: the scatter's tiles
    if "scatter" in args.sections and clock.left() > 20:
        guarded("scatter", "sweep", lambda: scatter_sweep(torch, Side, shapes, W, dtype, device, calls, record, cuda,
                                                          clock))

    # ---- the halo staging: host or kernel?
    if "halo" in args.sections and clock.left() > 20:
        guarded("halo", "stage", lambda: halo_stage_times(torch, device, dtype, calls, record, cuda))
        guarded("halo", "full", lambda: halo_full_host(torch, device, dtype, calls, record, cuda))
        guarded("halo", "tiles", lambda: halo_tile_sweep(torch, device, dtype, calls, record, cuda, clock))

    # ---- the persistent producer's forms (FLATTEN, SPAN, tiles) at every model and M: the defaults' evidence
    if "forms" in args.sections and clock.left() > 30:
        guarded("forms", "producer", lambda: producer_forms(torch, Side, shapes, ms, W, dtype, device, record, clock))

    big = [(model, rs, ag) for model, (rs, ag) in shapes.items()]
    m_big = ms[-1]

    def gemm_sweep(section, side_name, launch_for, meta_for=None):
        for model, rs, ag in big:
            n, k = rs if side_name == "rs" else ag
            for m_sweep in (args.sweep_m or [m_big]) if cuda else [m_big]:
                side = Side(side_name, m_sweep, n, k, W, dtype, device)
                shape = dict(model=model, side=side_name, m=m_sweep, n=n, k=k)
                guarded(section, "cublas", lambda: record(section=section, op="cublas", **shape, **measure(
                    torch, side.cublas, device, 10, profile=False, graph=args.graph)))
                side.prepare()
                try:
                    for cfg in (sweep_configs(m_sweep, W) if cuda else [(4, 16, 16, 4, 1)]):
                        if clock.left() < 20:
                            return
                        bm, bn, bk, w, s = cfg
                        config = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
                        fn = launch_for(side, config)
                        tile = meta_for(side, config) if meta_for else {}  # meta, default: for distfuse.tune.tiles
                        guarded(section, str(cfg), lambda fn=fn, cfg=cfg, tile=tile: record(
                            section=section, op=section, config=list(cfg), **tile, **shape,
                            **measure(torch, fn, device, 10, profile=False, graph=args.graph)))
                finally:
                    side.release()
                side = None  # free before the next shape
                if cuda:
                    torch.cuda.empty_cache()

    if "reduce" in args.sections and clock.left() > 30:
        from distfuse.kernels.persistent import persistent_programs

        sms = persistent_programs(device) if cuda else 2
        for model, rs, _ in big:
            n, k = rs
            side = Side("rs", m_big, n, k, W, dtype, device)
            shape = dict(model=model, side="rs", m=m_big, n=n, k=k, bytes=side.reduce_bytes())
            src = torch.empty(side.reduce_bytes() // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            from distfuse.geometry.decomposition import block_extent
            from distfuse.kernels.chunk_reduce import reduce_plan, slot_row_stride

            plan = reduce_plan(block_extent(m_big, W, 0), n, slot_row_stride(n), dtype, W, device)[0]
            reduce_default = {key: plan[key] for key in ("BLOCK", "PER_SM", "num_warps", "POLL_LOADS")}
            guarded("reduce", "copy", lambda: record(section="reduce", op="copy", **shape, **measure(
                torch, lambda: dst.copy_(src), device, 20, profile=False, graph=args.graph)))
            side.prepare()
            try:
                for block in (REDUCE_BLOCKS if cuda else (16,)):
                    for per_sm in (REDUCE_PROGRAMS_PER_SM if cuda else (1,)):
                        for warps in (REDUCE_WARPS if cuda else (1,)):
                            if clock.left() < 15:
                                break
                            polls = (plan["POLL_LOADS"],)  # the default poll; the default tile both ways
                            if (block, per_sm, warps) == tuple(reduce_default[k] for k in ("BLOCK", "PER_SM",
                                                                                          "num_warps")) and cuda:
                                polls += (not plan["POLL_LOADS"],)
                            for loads in polls:
                                cfg = dict(BLOCK=block, PROGRAMS=per_sm * sms, num_warps=warps, POLL_LOADS=loads)

                                def run(cfg=cfg):
                                    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce

                                    return chunk_reduce(side.ws, 0, W, 1, side.m, side.n, partial_dtype=dtype,
                                                        out=side.out[: side.m // W], config=cfg)

                                meta = dict(BLOCK=block, PER_SM=per_sm, num_warps=warps, POLL_LOADS=loads)
                                guarded("reduce", str(cfg), lambda run=run, cfg=cfg, per_sm=per_sm, meta=meta: record(
                                    section="reduce", op="chunk_reduce", config=dict(cfg, per_sm=per_sm), meta=meta,
                                    default=meta == reduce_default, **shape,
                                    **measure(torch, run, device, 20, profile=False, graph=args.graph)))
            finally:
                side.release()
            side = src = dst = None  # free before the next shape
            if cuda:
                torch.cuda.empty_cache()
    if "gemm" in args.sections and clock.left() > 30:
        from distfuse.kernels.matmul_reduce_scatter import matmul_scatter

        gemm_sweep("matmul_scatter", "rs",
                   lambda side, c: (lambda: matmul_scatter(side.a, side.weight, side.ws, 0, W, config=c)))
    if "persistent" in args.sections and clock.left() > 30:
        from distfuse.fused.providers import run_producer
        from distfuse.kernels import matmul_scatter_persistent as mscp
        from distfuse.kernels.tile_table import portable_config

        def producer_meta(side, c):
            meta = portable_config(mscp._complete(dict(c), 1, side.m, W, side.n, env["sms"])[0])
            default = portable_config(mscp._default_launch(dtype, 1, side.m, W, side.n, side.k, device)[0])
            return dict(meta=meta, default=meta == default)

        gemm_sweep("matmul_scatter_persistent", "rs", lambda side, c: (
            lambda: run_producer("triton_persistent", side.a, side.weight, side.ws, 0, W, dtype, config=c)),
            producer_meta)
    if "gathered" in args.sections and clock.left() > 30:
        from distfuse.kernels import gathered_matmul_persistent as gmp
        from distfuse.kernels.all_gather_matmul import gathered_matmul
        from distfuse.kernels.tile_table import portable_config

        def consumer_meta(side, c, sub):
            q1 = -(-side.m // W)
            meta = portable_config(gmp.gathered_persistent_config(dtype, 1, q1, W, side.n, env["sms"],
                                                                  dict(c, EPILOGUE_SUBTILE=sub)))
            default = portable_config(gmp._default_launch(dtype, 1, q1, W, side.n, side.k, device)[0])
            return dict(meta=meta, default=meta == default)

        for sub in (True, False):
            gemm_sweep(f"gathered_matmul_persistent:subtile={sub}", "ag", lambda side, c, sub=sub: (
                lambda: gathered_matmul(side.shards[0], side.weight, side.ws, 0, W, side.m, out=side.out3,
                                        config=dict(c, EPILOGUE_SUBTILE=sub),
                                        kernel="gathered_matmul_persistent" if cuda else None)),
                lambda side, c, sub=sub: consumer_meta(side, c, sub))
    env["seconds"] = round(earlier + time.monotonic() - clock.t0, 1)
    save()
    print(f"diag: {len(rows)} rows in {env['seconds']} s -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
