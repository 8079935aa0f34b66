"""A first call's answers in one page: what the GPU lab and its diagnosis say to the questions ``docs/gpu.md`` asks.

    python scripts/lab_digest.py DIR            # an unpacked lab.tgz (scripts/gpu_first_call.sh) or a lab's $OUT
    python scripts/lab_digest.py --results bench/results --tag 2026-11-29   # the collected files of one call

The lab's own output ends with the ratios of issue 21's table; this reads the rest, file by file, and prints one
short block per question (a block whose rows are absent says so):

* **canary**: the launch path the lab ran with (``probe.json``'s ``launch_canary``: each child, the setting kept);
* **tests**: passed, failed, skipped, and the failures' names (``tests.json``);
* **latency**: per call, the eager row against its graph replay, and the host's time after a synchronise against
  the L2 flush that hides it (``diagnose``, section ``latency``): which eager rows the host still binds;
* **eager timing**: each eager GEMM row's ratio with its runs issued back to back (the row), with cold calls
  (``extra.ms_synced``) and in its graph replay;
* **W streams**: ``chunk_reduce`` against torch's own sum of the same partials, graph-timed;
* **flag polls**: ``chunk_reduce`` with its flags polled by loads against atomics, per model, with the gain that
  ``distfuse-tune tiles --write`` would turn into a measured tile (``reduce:poll``);
* **Triton's mainloop**: the plain persistent Triton GEMM against cuBLAS per side (``forms``);
* **the NCHW layout**: per staging shape, torch's contiguous and strided copies of the window's bytes, this
  kernel's copy of the window alone and the staging, each against the copy of the staged bytes (``halo_tiles``),
  the row probe's whole rows and flat words against its window alone (``bench/halo_rows_probe.py``), and the
  staging's words form against the split launch and the default two passes (``halo_stage_words``);
* **halo conv steps**: the fused step against ``cat``'s and the layers' own unfused step's (``pieces``), loop and
  host time per shape (``halo_full``);
* **pinned staging** and **pinned GEMM tiles**: the halo and GEMM phases' fused rows against their reruns with
  the configs this call pinned (``halo_conv-*-pinned.json``, ``gemm_fused-*-pinned.json``,
  ``scripts/gpu_first_call.sh`` step 2c), per shape, mode and provider, with the config each took and its source;
* **launcher**: the host time of each way of launching a binary (``attrib``);
* **host**: the device host's Python on the launchers (``host_cost.json``).

Reads only; the numbers are the files' own (us unless named).  ``tests/test_gpu_lab.py`` runs it on a dry run's
files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lab_record beside it, however this file is loaded
from lab_record import FUSED, ratio_to  # noqa: E402 - after the path it is found by

NAMES = {"probe": ("probe.json", "gpu_lab_probe-"), "tests": ("tests.json", "gpu_lab_tests-"),
         "diagnose": ("diagnose.json", "diagnose-"), "host_cost": ("host_cost.json", "host_cost-")}


def _load(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def find_files(folder: Path | None = None, results: Path | None = None, tag: str | None = None) -> dict:
    """``{kind: path or None}`` of one call's files: in ``folder`` by their lab names, or in ``results`` by their
    collected names containing ``tag`` (the newest matching file of each kind); the kinds ``halo`` and ``gemm``
    (and ``_pinned``) are the halo and GEMM benchmarks' files (and their pinned reruns')."""
    out = {}
    for kind, (lab_name, prefix) in NAMES.items():
        if folder is not None:
            out[kind] = folder / lab_name if (folder / lab_name).exists() else None
        else:
            found = sorted(p for p in Path(results).glob(f"{prefix}*.json") if not tag or tag in p.name)
            out[kind] = found[-1] if found else None
    for kind, prefix in (("halo", "halo_conv-"), ("gemm", "gemm_fused-")):
        found = sorted(p for p in Path(folder if folder is not None else results).glob(f"{prefix}*.json")
                       if folder is not None or not tag or tag in p.name)
        out[f"{kind}_pinned"] = next((p for p in reversed(found) if "-pinned" in p.name), None)
        out[kind] = next((p for p in reversed(found) if "-pinned" not in p.name), None)
    return out


def _us(row: dict, *keys) -> float | None:
    for k in keys:
        v = row.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def canary_block(probe: dict) -> list[str]:
    c = probe.get("launch_canary")
    if not c:
        return ["no launch_canary in probe.json (a lab before the canary, or its phase did not run)"]
    lines = [f"the lab ran with: {c.get('export') or 'the defaults'}"]
    for r in c.get("runs", []):
        setting = " ".join(f"{k}={v}" for k, v in sorted(r.get("env", {}).items())) or "defaults"
        what = "ok" if r.get("ok") else "FAILED" + (" (inconclusive)" if r.get("inconclusive") else "")
        detail = {k: r[k] for k in ("seconds", "why", "problems", "warnings", "hits", "launcher", "descriptor_maps")
                  if r.get(k) not in (None, [], {})}
        lines.append(f"  {setting}: {what} {json.dumps(detail)[:400]}")
    return lines


def tests_block(tests: dict) -> list[str]:
    if not tests:
        return ["no tests.json"]
    lines = [f"passed {tests.get('passed')}, failed {tests.get('failed')}, skipped {tests.get('skipped')} of "
             f"{tests.get('tests')} in {tests.get('seconds')} s (finished: {tests.get('finished')})"]
    for f in tests.get("failures", [])[:12]:
        lines.append(f"  FAILED {f.get('test')} ({f.get('when')}): {str(f.get('message', ''))[:160]}")
    return lines


def _rows(diag: dict, section: str) -> list[dict]:
    return [r for r in diag.get("rows", []) if r.get("section") == section and "error" not in r]


def latency_block(diag: dict) -> list[str]:
    rows = _rows(diag, "latency")
    if not rows:
        return ["no latency rows"]
    lines = ["call                              eager   graph  host(sync)  flush   eager-graph"]
    for r in rows:
        name = r["op"] + (f" {r.get('format')}" if r.get("format") else "")
        eager, graph, host, flush = (_us(r, k) for k in ("eager_us", "graph_us", "host_us", "flush_us"))
        gap = None if eager is None or graph is None else eager - graph
        bound = " host-bound" if host is not None and flush is not None and host > flush else ""
        lines.append(f"  {name:32s}{_fmt(eager):>7} {_fmt(graph):>7} {_fmt(host):>10} {_fmt(flush):>6} "
                     f"{_fmt(gap):>10}{bound}")
    return lines


def streams_block(diag: dict) -> list[str]:
    """``chunk_reduce`` against torch's own sum of the same W partials (the same bytes: W chunks read, one
    written), graph-timed; the copy anchor of the same bytes is in the gemm phase's file."""
    by = {r["op"]: r for r in _rows(diag, "latency")}
    reduce, total = (_us(by.get(k, {}), "graph_us", "eager_us") for k in ("chunk_reduce", "torch_sum"))
    if reduce is None:
        return ["no chunk_reduce latency row"]
    lines = [f"graph us: chunk_reduce {_fmt(reduce)}, torch_sum {_fmt(total)}"]
    if total:
        lines.append(f"  torch_sum / chunk_reduce time: {total / reduce:.2f} (near 1 or above: reading W streams at "
                     "once is the limit, not this kernel)")
    return lines


def polls_block(diag: dict) -> list[str]:
    rows = [r for r in diag.get("rows", []) if r.get("section") == "reduce:poll"]
    if not rows:
        return ["no reduce:poll rows"]
    lines = []
    models = sorted({r.get("model") for r in rows}, key=str)
    for model in models:
        mine = {r.get("poll"): r for r in rows if r.get("model") == model}
        if any("error" in r for r in mine.values()):
            lines.append(f"  {model}: error {next(r['error'] for r in mine.values() if 'error' in r)[:200]}")
            continue
        a, ld = (_us(mine.get(p, {}), "graph_us", "loop_us") for p in ("atomic", "load"))
        gain = None if not a or not ld else a / ld - 1
        same = all(r.get("matches_atomic") for r in mine.values())
        lines.append(f"  {model}: atomic {_fmt(a)}, load {_fmt(ld)}"
                     + (f", loads {gain:+.1%}" if gain is not None else "") + f", bitwise equal: {same}"
                     + (f", loads ran: {mine['load'].get('poll_loads')}" if "load" in mine else ""))
    return lines


def mainloop_block(diag: dict) -> list[str]:
    rows = _rows(diag, "forms")
    gemm = [r for r in rows if r.get("op") == "triton_gemm"]
    if not gemm:
        return ["no triton_gemm rows"]
    lines = []
    for r in gemm:
        anchor = next((a for a in rows if a.get("op") == "cublas_anchor" and a.get("side") == r.get("side")
                       and a.get("model") == r.get("model") and a.get("m") == r.get("m")), {})
        t, c = _us(r, "graph_us", "loop_us"), _us(anchor, "graph_us", "loop_us")
        ratio = f"{c / t:.2f} of cuBLAS" if t and c else "no anchor"
        lines.append(f"  {r.get('model')} {r.get('side')} M={r.get('m')} N={r.get('n')} K={r.get('k')}: "
                     f"Triton {_fmt(t)} us, cuBLAS {_fmt(c)} us: {ratio} (correct: {r.get('ok')})")
    return lines


def layout_block(diag: dict) -> list[str]:
    rows = _rows(diag, "halo_tiles")
    if not rows:
        return ["no halo_tiles rows"]
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r.get("nd"), r.get("C"), r.get("n"), r.get("format")), []).append(r)
    lines = ["shape                    copy  window: contiguous strided(torch) kernel  staging(split)   (us; "
             "x = of the copy)"]
    for (nd, c, n, fmt), mine in shapes.items():
        by = {r["op"]: r for r in mine if "tile" not in r}

        def time_of(op, by=by):
            return _us(by.get(op, {}), "kernel_us", "loop_us", "graph_us")

        copy = time_of("copy")

        def cell(op, copy=copy):
            v = time_of(op)
            return "-" if v is None else f"{v:.1f}" + (f" ({copy / v:.2f}x)" if copy and op != "copy" else "")

        lines.append(f"  {nd}-D C={c} n={n} {fmt:13s} {cell('copy'):>7}  {cell('copy window (contiguous)'):>14} "
                     f"{cell('copy window (strided, torch)'):>14} {cell('halo_stage region=window'):>14} "
                     f"{cell('halo_stage split=True'):>14}")
        if "rows probe (whole rows)" in by:  # NCHW: whole rows against the window's rows (bench/halo_rows_probe.py)
            probe = [cell("rows probe (whole rows)"), cell("rows probe (whole rows, paired)"),
                     cell("rows probe (flat words)"), cell("rows probe (flat words, gathered)"),
                     cell("rows probe (window)", copy=time_of("copy window (contiguous)"))]
            lines.append(f"    rows probe: whole rows {probe[0]}, paired {probe[1]}, flat words {probe[2]}, gathered "
                         f"{probe[3]} (x of the copy); window alone {probe[4]} (x of the window's contiguous copy); "
                         "exact: "
                         f"{all(by[op].get('exact') for op in by if op.startswith('rows probe'))}")
        if "halo_stage words=True" in by:  # NCHW: the staging's window rows as flat words (halo_stage_words)
            lines.append(f"    words form: one pass {cell('halo_stage words=True')} against split "
                         f"{cell('halo_stage split=True')}; two passes {cell('halo_stage two passes words=True')} "
                         f"against {cell('halo_stage two passes')} (x of the copy); exact: "
                         f"{all(by[op].get('exact') for op in by if 'words' in op or 'two passes' in op)}")
    return lines


def halo_steps_block(diag: dict) -> list[str]:
    """Per shape of ``halo_full``: the fused step's loop time against ``cat``'s and the layers' own unfused step's
    (``pieces``, small shapes), and each step's host time after a synchronise: whether the fused step loses where
    the host binds, and to which of the two."""
    rows = [r for r in _rows(diag, "halo_full") if not str(r.get("op", "")).endswith("(cprofile)")]
    if not rows:
        return ["no halo_full rows"]
    by: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault((r.get("nd"), r.get("C"), r.get("n"), r.get("format")), {})[r["op"]] = r
    lines = ["shape                            loop: fused    cat pieces   host: fused    cat pieces  cat/fused"]
    for (nd, c, n, fmt), ops in by.items():
        loop = [_us(ops[o], "loop_us") if o in ops else None for o in ("fused", "cat", "pieces")]
        host = [_us(ops[o], "host_us") if o in ops else None for o in ("fused", "cat", "pieces")]
        ratio = f"{loop[1] / loop[0]:.2f}" if loop[0] and loop[1] else "-"
        shape = f"{nd}-D C={c} n={n} {fmt or ''}"
        lines.append(f"  {shape:34s}" + "".join(f"{_fmt(v):>7}" for v in loop) + "      "
                     + "".join(f"{_fmt(v):>7}" for v in host) + f"{ratio:>11}")
    return lines


def pinned_block(lab: dict, pinned: dict, what: str) -> list[str]:
    """Per op, shape, mode and fused provider: the row's ratio to its anchor in the lab's phase and in its rerun
    with this call's pinned configs, and the config the rerun's kernel took with its source (``extra.stage_config``
    / ``stage_config_source`` of the halo bench, ``extra.config`` / ``config_source`` of the GEMM bench; the rows
    that name none are left out)."""
    if not pinned.get("rows"):
        return [f"no pinned {what} rerun (no config beat the rules' own choice, or no time was left)"]

    def fused(doc):  # (op, shape, mode, provider) -> (the row, its ratio as the targets read it: higher is better)
        rows = {(r.get("op"), json.dumps(r.get("shape"), sort_keys=True), r.get("mode"), r.get("provider")): r
                for r in doc.get("rows", [])}
        out = {}
        for (op, shape, mode, provider), r in rows.items():
            a = rows.get((op, shape, mode, r.get("anchor")))
            extra = r.get("extra", {})
            if provider not in FUSED or a is None or not ("stage_config" in extra or "config" in extra):
                continue
            out[(op, shape, mode, provider)] = (r, ratio_to(r, a))
        return out
    before, rerun = fused(lab), fused(pinned)
    lines = ["op / shape / mode / provider                            lab pinned  (x of the anchor) config (source)"]
    for key, (r, q) in rerun.items():
        shape = json.loads(key[1]) if key[1] != "null" else {}
        extra = r.get("extra", {})
        config = extra.get("stage_config", extra.get("config", {}))
        source = extra.get("stage_config_source", extra.get("config_source", "?"))
        name = " ".join(f"{k}={v}" for k, v in shape.items() if k in ("model", "m", "nd", "C", "n", "format"))
        label = f"{key[0]} {name} {key[2]} {key[3]}"
        lines.append(f"  {label:52s} {_ratio(before.get(key, (None, None))[1]):>6} {_ratio(q):>6}  "
                     f"{','.join(f'{k}={v}' for k, v in sorted(config.items()))} ({source})")
    return lines


def eager_block(gemm: dict) -> list[str]:
    """Per eager row of the GEMM bench at M >= 4096 that carries its cold calls' time (``extra.ms_synced``) and whose
    anchor does: its ratio to the anchor with the runs issued back to back (the row's ``ms``, what the targets
    read), with cold calls (each after a synchronise: the eager timing before 2026-11-29), and in the graph replay
    where the file has one: how much of an eager row's loss was the host's."""
    rows = {(r.get("op"), json.dumps(r.get("shape"), sort_keys=True), r.get("mode"), r.get("provider")): r
            for r in gemm.get("rows", [])}
    lines = ["op / shape / provider                                  back-to-back  cold  graph"]
    for (op, shape, mode, provider), r in rows.items():
        a = rows.get((op, shape, mode, r.get("anchor")))
        cold, cold_a = r.get("extra", {}).get("ms_synced"), (a or {}).get("extra", {}).get("ms_synced")
        if (mode != "fwd" or provider not in FUSED or a is None or not cold or not cold_a
                or json.loads(shape).get("m", 0) < 4096):  # the targets' shapes: one page
            continue
        g, ga = rows.get((op, shape, "graph", provider)), rows.get((op, shape, "graph", r.get("anchor")))
        name = " ".join(f"{k}={v}" for k, v in json.loads(shape).items() if k in ("model", "m"))
        lines.append(f"  {op + ' ' + name + ' ' + provider:54s} {_ratio(ratio_to(r, a)):>12} {_ratio(cold_a / cold):>5}"
                     f" {_ratio(ratio_to(g, ga) if g and ga else None):>6}")
    return lines if len(lines) > 1 else ["no eager rows with their cold calls' time (extra.ms_synced: CUDA only)"]


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def attrib_block(diag: dict) -> list[str]:
    rows = _rows(diag, "attrib")
    if not rows:
        return ["no attrib rows"]
    return [f"  {r['op'][:70]:70s} host {_fmt(_us(r, 'host_us'))} us" for r in rows]


def host_block(host: dict) -> list[str]:
    us = host.get("us_per_call")
    if not us:
        return ["no host_cost.json"]
    return [f"  {k}: {v} us" for k, v in us.items()] + [f"  on {host.get('env', {}).get('host_cpu', '?')}"]


def digest(files: dict) -> str:
    probe, tests, diag, host = (_load(files.get(k)) for k in ("probe", "tests", "diagnose", "host_cost"))
    blocks = [("canary (the launch path)", canary_block(probe)), ("tests", tests_block(tests)),
              ("latency (eager rows against graph replays; us)", latency_block(diag)),
              ("eager timing (GEMM rows' ratios: runs back to back, cold calls, graph)",
               eager_block(_load(files.get("gemm")))),
              ("W streams (chunk_reduce against torch's sum of the same bytes)", streams_block(diag)),
              ("flag polls (graph us)", polls_block(diag)), ("Triton's mainloop (forms)", mainloop_block(diag)),
              ("the NCHW layout (halo_tiles)", layout_block(diag)),
              ("halo conv steps (halo_full; us a step)", halo_steps_block(diag)),
              ("pinned staging (fused rows' ratios: the lab's halo phase, then its rerun with this call's configs)",
               pinned_block(_load(files.get("halo")), _load(files.get("halo_pinned")), "halo")),
              ("pinned GEMM tiles (the same for the GEMM phase at the swept M)",
               pinned_block(_load(files.get("gemm")), _load(files.get("gemm_pinned")), "gemm")),
              ("launcher (attrib)", attrib_block(diag)),
              ("host (host_cost.json, stubbed launches)", host_block(host))]
    env = diag.get("env", {})
    head = (f"lab digest: {env.get('device', '?')} {env.get('date', '?')} commit {env.get('commit', '?')} "
            f"settings {json.dumps(env.get('settings', {}))}")
    return "\n".join([head] + [f"== {title}\n" + "\n".join(lines) for title, lines in blocks])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", help="an unpacked lab.tgz or a lab's $OUT")
    p.add_argument("--results", help="a folder of collected files (bench/results)")
    p.add_argument("--tag", help="with --results: a string the files' names contain (a date, a tag)")
    args = p.parse_args(argv)
    if not args.folder and not args.results:
        p.error("give a folder or --results")
    files = find_files(Path(args.folder)) if args.folder else find_files(results=Path(args.results), tag=args.tag)
    print(digest(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
