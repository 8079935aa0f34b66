"""Bookkeeping of ``scripts/gpu_lab.sh``: the lab's summary file, the tests' JSON, the ratios, the dry-run check.

Subcommands (the lab calls each after the step it records; none imports torch except ``init``):

* ``init --out DIR --budget S``: ``DIR/lab.json`` with ``env`` (device, versions, commit, date:
  ``bench.harness.environment``), the budget and the planned phases;
* ``phase --out DIR --name N --cap S --limit S --rc RC --seconds S [--file F]``: append one
  phase record (status ok / failed / timed out / skipped) and rewrite ``lab.json`` at once;
* ``tests JSONL JSON --rc RC``: the test phase's outcomes (``scripts/lab_pytest.py`` writes one line
  per test as it ends) as JSON: counts, and every failure with its message;
* ``ratios --out DIR``: the decisive ratios of issue 21's table from the result files in
  ``DIR`` (the same rule as the project's ``gpu_ratios`` tool: anchor time over row time, or
  row rate over anchor rate, best fused provider per shape, worst shape), printed and saved
  into ``lab.json``;
* ``check --out DIR [--ratios-tool PATH]``: the dry-run's check of the phase structure, the
  caps, the files under ``DIR`` (at most 8, names the device tool brings back), the row
  schema (op, provider, anchor, shape, dtype, median ms, the anchor row in the same file),
  and, given the ``gpu_ratios`` tool, that it reads every target from these files.

The lab writes at most 8 files under ``$OUT`` (the device tool brings back no more):
``lab.json``, ``lab.log``, ``probe.json``, ``tests.json``, ``gemm_fused-<device>-<date>.json``,
``halo_conv-<device>-<date>.json``, ``two_process.json``, ``attention-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The phases, in order of value, and each one's cap in seconds (the lab's whole budget: 540 s = 9 minutes).
# The halo phase's rows doubled after 2026-11-28 (graph replays of the whole steps, the two passes, the words form,
# the layers' unfused step), when it took 51 s for 120 rows; gemm took 17-20 s, two_process 27-33 s and attention
# 18-23 s of their caps, which give it the time.
PHASES = (("probe", 30), ("canary", 90), ("tests", 140), ("gemm", 60), ("halo", 110), ("two_process", 55),
          ("attention", 45))
BUDGET_S = 540
MAX_FILES = 8
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
ROW_KEYS = ("op", "provider", "anchor", "shape", "dtype", "ms")
#: issue 21's table: name, op matcher, anchor provider, large-shape test, target (as gpu_ratios reads them).
_GEMM_TARGETS = [
    ("gemm+scatter vs cuBLAS (M>=4096)", ("matmul_scatter", "gemm_rs", "matmul_reduce_scatter"), "cublas",
     lambda s: s.get("m", 0) >= 4096, 0.90),
    ("gemm+scatter vs cuBLAS (M=512)", ("matmul_scatter", "gemm_rs", "matmul_reduce_scatter"), "cublas",
     lambda s: s.get("m", 0) == 512, 0.75),
    ("chunk_reduce vs copy (M>=4096)", ("chunk_reduce",), "copy", lambda s: s.get("m", 0) >= 4096, 0.85),
    ("all-gather+GEMM vs cuBLAS (M>=4096)", ("gathered_matmul", "ag_gemm", "all_gather_matmul"), "cublas",
     lambda s: s.get("m", 0) >= 4096, 0.90),
]
# Each GEMM target twice: eager calls (mode "fwd": the host's launch work included wherever it outlasts the
# L2 flush before the timed call) and CUDA-graph replays (mode "graph": the device work alone).
TARGETS = [
    *[t + ("fwd",) for t in _GEMM_TARGETS],
    *[(f"{t[0]} [graph]",) + t[1:] + ("graph",) for t in _GEMM_TARGETS],
    ("halo staging vs copy (>= 16M elements)", ("halo_conv",), "copy",
     lambda s: s.get("C", 0) * s.get("n", 0) ** s.get("nd", 2) >= 16e6, 0.90, "stage"),
    ("halo staging vs copy (>= 16M elements) [graph]", ("halo_stage",), "copy",
     lambda s: s.get("C", 0) * s.get("n", 0) ** s.get("nd", 2) >= 16e6, 0.90, "graph"),
    ("fused halo conv vs cat+cuDNN (every shape)", ("halo_conv",), "cat", lambda s: True, 0.97, "full"),
]
FUSED = {"fused", "triton", "triton_persistent", "cublas_chunks", "copy_engine", "persistent"}


def _load(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _save(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- init / phase


def cmd_init(args) -> int:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.harness import environment

        env = environment()
    except Exception as exc:  # noqa: BLE001 - the lab goes on; the summary says why env is thin
        env = dict(error=f"{type(exc).__name__}: {exc}", commit=os.environ.get("DISTFUSE_COMMIT"))
    env["dry_run"] = os.environ.get("DISTFUSE_LAB_DRY_RUN", "0") not in ("", "0")
    data = dict(env=env, budget_s=args.budget, planned=[dict(name=n, cap_s=c) for n, c in PHASES], phases=[])
    _save(Path(args.out) / "lab.json", data)
    print(f"lab: {env.get('device')} torch {env.get('torch')} triton {env.get('triton')} commit {env.get('commit')}")
    return 0


def phase_status(rc: int, limit: int) -> str:
    if rc == -1:
        return "skipped: no time left in the budget"
    if rc == -2:
        return "skipped: not asked for (DISTFUSE_LAB_PHASES)"
    if rc in (124, 137):
        return f"timed out after {limit} s"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def cmd_phase(args) -> int:
    path = Path(args.out) / "lab.json"
    data = _load(path) or dict(env={}, phases=[])
    rec = dict(name=args.name, cap_s=args.cap, limit_s=args.limit, seconds=args.seconds, rc=args.rc,
               status=phase_status(args.rc, args.limit), file=os.path.basename(args.file) if args.file else None)
    if args.file:
        body = _load(Path(args.file))
        rec["file_ok"] = bool(body)
        if isinstance(body, dict) and isinstance(body.get("rows"), list):
            rec["rows"] = len(body["rows"])
    data.setdefault("phases", []).append(rec)
    _save(path, data)
    print(f"lab: phase {args.name}: {rec['status']} in {args.seconds} s (limit {args.limit} s)")
    return 0


# ---------------------------------------------------------------- tests: the plugin's JSON lines -> JSON


def tests_summary(jsonl: Path, finished: bool = True) -> dict:
    """Counts and failures from ``scripts/lab_pytest.py``'s lines (each test as it ended; a cut-off run keeps them)."""
    recs = []
    try:
        recs = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        pass
    out = dict(tests=0, passed=0, failed=0, skipped=0, seconds=0.0, failures=[], skipped_reasons={},
               finished=finished)
    for r in recs:
        out["seconds"] += r.get("seconds", 0.0)
        if r["outcome"] == "failed":
            out["failed"] += 1
            out["failures"].append(dict(test=r["test"], when=r["when"], message=r.get("message", "")))
        elif r["outcome"] == "skipped":
            out["skipped"] += 1
            reason = r.get("reason", "")
            out["skipped_reasons"][reason] = out["skipped_reasons"].get(reason, 0) + 1
        elif r["when"] == "call":
            out["passed"] += 1
        if r["when"] == "call" or r["outcome"] != "passed":
            out["tests"] += 1
    out["seconds"] = round(out["seconds"], 2)
    out["ok"] = out["failed"] == 0 and finished and out["tests"] > 0
    return out


def cmd_tests(args) -> int:
    body = tests_summary(Path(args.jsonl), finished=args.rc in (0, 5))  # 5: pytest collected nothing
    body["pytest_exit"] = args.rc
    _save(Path(args.json), body)
    print(f"lab: tests: {body['passed']} passed, {body['failed']} failed, {body['skipped']} skipped"
          + ("" if body["finished"] else f" (pytest exit {args.rc}: cut off or crashed)"))
    return 0


# ---------------------------------------------------------------- ratios


def result_files(out: Path) -> list[Path]:
    return sorted(p for p in map(Path, glob.glob(str(out / "*.json")))
                  if p.name.startswith(("gemm_fused-", "halo_conv-", "attention-")))


def ratio_to(row: dict, anchor: dict) -> float | None:
    """A row's ratio to its anchor as the targets read it (higher is better): its rate over the anchor's where both
    have one, else the anchor's time over its own; None without either."""
    if row.get("rate") and anchor.get("rate"):
        return row["rate"] / anchor["rate"]
    if row.get("ms") and anchor.get("ms"):
        return anchor["ms"] / row["ms"]
    return None


def ratios(files: list[Path]) -> list[dict]:
    """Per target: the worst over large shapes of the best fused provider's ratio to the anchor (higher is better)."""
    by: dict = {}
    for f in files:
        for r in _load(f).get("rows", []):
            key = (str(f), r.get("op"), json.dumps(r.get("shape"), sort_keys=True), r.get("dtype"), r.get("mode"))
            by.setdefault(key, {})[r.get("provider")] = r
    out = []
    for name, ops, anchor, large, target, mode in TARGETS:
        worst, best_of = None, {}
        for (_f, op, shape, dtype, row_mode), provs in by.items():
            s = json.loads(shape) if shape else {}
            if op not in ops or not isinstance(s, dict) or not large(s) or (mode and row_mode != mode):
                continue
            a = provs.get(anchor)
            best = None
            for p, r in provs.items():
                q = ratio_to(r, a) if p in FUSED and a is not None else None
                if q is None:
                    continue
                if best is None or q > best[0]:
                    best = (q, p, r.get("kernel"))
            if best is not None:
                best_of[f"{shape} {dtype}"] = dict(ratio=round(best[0], 3), provider=best[1], kernel=best[2])
                worst = best[0] if worst is None else min(worst, best[0])
        out.append(dict(target=name, threshold=target, worst=None if worst is None else round(worst, 3),
                        holds=None if worst is None else worst >= target, shapes=best_of))
    return out


def cmd_ratios(args) -> int:
    out = Path(args.out)
    table = ratios(result_files(out))
    path = out / "lab.json"
    data = _load(path)
    if data:
        data["ratios"] = table
        _save(path, data)
    print("lab: decisive ratios (anchor measured in the same run; higher is better)")
    for t in table:
        worst = "no row" if t["worst"] is None else f"worst {t['worst']:.2f}"
        verdict = "" if t["holds"] is None else ("holds" if t["holds"] else "SHORT")
        print(f"  {t['target']:44s} {worst:12s} target {t['threshold']:.2f} {verdict}")
    return 0


# ---------------------------------------------------------------- the dry-run check


def check(out: Path, ratios_tool: str | None = None, budget: int = BUDGET_S) -> list[str]:
    """Problems with a lab run's output folder (see the module doc); empty when it is well formed."""
    problems = []
    files = sorted(p for p in out.iterdir() if p.is_file())
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files under $OUT; the device tool brings back {MAX_FILES}: "
                        f"{[p.name for p in files]}")
    problems += [f"file name {p.name!r} has characters the device tool refuses" for p in files
                 if not NAME_OK.match(p.name)]
    lab = _load(out / "lab.json")
    if not lab:
        return problems + ["no readable lab.json"]
    env = lab.get("env", {})
    problems += [f"lab.json env lacks {k}" for k in ("device", "torch", "triton", "commit", "date") if not env.get(k)]
    names = [p["name"] for p in lab.get("phases", [])]
    if names != [n for n, _ in PHASES]:
        problems.append(f"phases ran as {names}, expected {[n for n, _ in PHASES]}")
    caps = sum(c for _, c in PHASES)
    if caps > budget or budget > BUDGET_S:
        problems.append(f"phase caps sum to {caps} s against a budget of {budget} s (at most {BUDGET_S} s)")
    for p in lab.get("phases", []):
        if p["limit_s"] > p["cap_s"] or p["seconds"] > p["limit_s"] + 10:
            problems.append(f"phase {p['name']} ran {p['seconds']} s against its limit {p['limit_s']} s "
                            f"(cap {p['cap_s']} s)")
        if p.get("file") and not p.get("file_ok"):
            problems.append(f"phase {p['name']} left no readable {p['file']}")
    for f in result_files(out):
        rows = _load(f).get("rows", [])
        if not rows:
            problems.append(f"{f.name}: no rows")
        keys = {}
        for r in rows:
            missing = [k for k in ROW_KEYS if r.get(k) is None]
            if missing:
                problems.append(f"{f.name}: row {r.get('op')}/{r.get('provider')} lacks {missing}")
                break
            keys.setdefault((r["op"], json.dumps(r["shape"], sort_keys=True), r["dtype"], r.get("mode")),
                            set()).add(r["provider"])
        found = []
        for r in rows:
            k = (r.get("op"), json.dumps(r.get("shape"), sort_keys=True), r.get("dtype"), r.get("mode"))
            if r.get("anchor") and r["anchor"] not in keys.get(k, set()):
                found.append(f"{f.name}: the anchor {r['anchor']} of {r['op']}/{r['provider']} {r['shape']} "
                             "is not in the file")
            if r.get("provider") in FUSED and not r.get("kernel"):
                found.append(f"{f.name}: {r['op']}/{r['provider']} does not name the kernel that ran")
        problems += found[:5] + ([f"{f.name}: and {len(found) - 5} more"] if len(found) > 5 else [])
    if ratios_tool:
        problems += _check_with_tool(out, ratios_tool)
    return problems


def _check_with_tool(out: Path, tool: str) -> list[str]:
    """Run the project's gpu_ratios tool on copies of the result files.

    A dry run's files come from the CPU at tiny shapes, so the copies are relabelled (an NVIDIA
    device name; ``m`` 8192, a volume past 16M elements) for the tool to count them: this
    checks that the tool reads the format, not the numbers.
    """
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "bench" / "results"
        results.mkdir(parents=True)
        for f in result_files(out):
            data = _load(f)
            env = data.get("env", {})
            if "NVIDIA" not in str(env.get("device")):
                data["env"] = dict(env, device=f"NVIDIA (dry run on {env.get('device')})")
                for r in data.get("rows", []):
                    shape = r.get("shape")
                    if isinstance(shape, dict) and "m" in shape:
                        shape["m"] = 8192
                    if isinstance(shape, dict) and "C" in shape:
                        shape["C"] = 1 << 24
            (results / f.name).write_text(json.dumps(data))
        proc = subprocess.run([sys.executable, tool, "--since", "2026-11-26"], cwd=tmp, capture_output=True,
                              text=True, timeout=120)
    text = proc.stdout + proc.stderr
    print("lab: gpu_ratios on the dry-run files:\n" + text.strip())
    if proc.returncode != 0:
        return [f"gpu_ratios failed (exit {proc.returncode}): {text[-800:]}"]
    return [f"gpu_ratios found no row: {line}" for line in text.splitlines() if "no GPU row" in line]


def cmd_check(args) -> int:
    problems = check(Path(args.out), args.ratios_tool, args.budget)
    for p in problems:
        print(f"lab check: {p}")
    print(f"lab check: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


# ---------------------------------------------------------------- copying results for a commit


def cmd_collect(args) -> int:
    """Copy a lab's result files (``$OUT`` as fetched, or ``lab.tgz`` of ``scripts/gpu_first_call.sh`` unpacked)
    into ``bench/results`` for a commit; ``diagnose.json`` (the first call's diagnosis) becomes
    ``diagnose-<device>-<date>.json`` and ``host_cost.json`` (its host's Python, ``scripts/host_cost.py
    --kernels``) ``host_cost-<device>-<date>.json``.  ``--tag T`` ends every name with ``-T`` (a second call of
    one day, e.g. a rerun after a fix, beside the first call's files)."""
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    src = Path(args.out)
    lab = _load(src / "lab.json")
    stamp = str(lab.get("env", {}).get("date", ""))[:10] or "undated"
    device = re.sub(r"[^A-Za-z0-9._-]", "_", str(lab.get("env", {}).get("device", "unknown")))
    tag = f"-{args.tag}" if args.tag else ""
    copied = []
    for f in result_files(src):
        target = f"{f.stem}{tag}{f.suffix}"
        shutil.copy(f, dest / target)
        copied.append(target)
    for name in ("lab.json", "tests.json", "two_process.json", "probe.json", "diagnose.json", "host_cost.json"):
        if (src / name).exists():
            kind = {"lab.json": "gpu_lab", "diagnose.json": "diagnose",
                    "host_cost.json": "host_cost"}.get(name, f"gpu_lab_{name[:-5]}")
            target = f"{kind}-{device}-{stamp}{tag}.json"
            shutil.copy(src / name, dest / target)
            copied.append(target)
    print("lab: copied " + ", ".join(copied) + f" into {dest}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("init")
    q.add_argument("--out", required=True)
    q.add_argument("--budget", type=int, default=BUDGET_S)
    q = sub.add_parser("phase")
    q.add_argument("--out", required=True)
    q.add_argument("--name", required=True)
    q.add_argument("--cap", type=int, required=True)
    q.add_argument("--limit", type=int, required=True)
    q.add_argument("--rc", type=int, required=True)
    q.add_argument("--seconds", type=int, required=True)
    q.add_argument("--file", default=None)
    q = sub.add_parser("tests")
    q.add_argument("jsonl")
    q.add_argument("json")
    q.add_argument("--rc", type=int, default=0)
    q = sub.add_parser("ratios")
    q.add_argument("--out", required=True)
    q = sub.add_parser("check")
    q.add_argument("--out", required=True)
    q.add_argument("--ratios-tool", default=None)
    q.add_argument("--budget", type=int, default=BUDGET_S)
    q = sub.add_parser("collect")
    q.add_argument("--out", required=True)
    q.add_argument("--dest", default=str(ROOT / "bench" / "results"))
    q.add_argument("--tag", default="", help="appended to every file name: a second call of the same day")
    args = p.parse_args(argv)
    return {"init": cmd_init, "phase": cmd_phase, "tests": cmd_tests, "ratios": cmd_ratios, "check": cmd_check,
            "collect": cmd_collect}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
