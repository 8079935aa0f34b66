"""``python -m bench compare BASELINE.json CURRENT.json``: what moved, and a non-zero exit on a regression.

Rows are matched by (op, provider, mode, shape, dtype, world size), an op under a former
name (:data:`RENAMED_OPS`: ``linear_rs`` / ``gemm_rs`` in files before the GEMM fusions were
renamed) counting as its current one, so old baselines still gate.  Each matched row's
metric is compared as ``change = current / baseline - 1`` (both metrics are times:
lower is better); past ``--tolerance`` it is ``worse`` (a regression) or ``better``.
Rows only in the current file are ``new``, rows only in the baseline ``missing``.

Metrics:

* ``ratio`` (default): the row's time over its anchor's time measured in the same run
  (cuBLAS, the copy ceiling, DTensor TP, torch.cat staging ...).  Machine speed, clocks
  and load cancel to first order, so a baseline committed from one machine gates runs on
  another; rows without a ratio (and the anchors themselves, 1 by definition) are not
  judged.  A regression of the anchor itself does not show here; use ``ms`` for that on a
  fixed machine.
* ``ms``: the absolute median time.  Only meaningful on the same device: refused (exit
  2) when the two files name different devices, unless ``--force``.

Exit status: 0 no regression; 1 a row regressed past the tolerance (or, with
``--fail-on-missing``, a baseline row is missing); 2 refused or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from distfuse.fused.registry import RENAMED, RENAMED_KERNELS

KEY = ("op", "provider", "mode", "shape", "dtype", "world_size")
#: Row ``op`` names in older result files -> the current ones: the registry's renamed ops
#: (the projection rows) and the renamed launchers (``bench_gemm_fused``'s kernel rows).
RENAMED_OPS = {**RENAMED, **RENAMED_KERNELS}
ORDER = {"worse": 0, "missing": 1, "better": 2, "new": 3, "n/a": 4, "anchor": 5, "same": 6}


ANCHOR_ITSELF = "the anchor itself (ratio 1 by definition; not judged)"


class CompareError(Exception):
    """Refused or unreadable input (exit status 2)."""


@dataclass
class Result:
    path: Path
    env: dict
    smoke: bool
    rows: list[dict]


def load(path: Path | str) -> Result:
    """A results file: the harness format ``{env, smoke, rows}``, or ``bench_halo_conv``'s own ``{meta, rows}``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise CompareError(f"{path}: not a bench results file (expected an object with 'rows')")
    if "env" not in data and "meta" in data:  # bench_halo_conv.py's native file
        from dataclasses import asdict

        from bench.suites import halo_rows

        meta = data["meta"]
        env = dict(meta, device=meta.get("device", "unknown"))
        return Result(path, env, False, [asdict(r) for r in halo_rows(data)])
    rows = data["rows"]
    for r in rows:
        missing = [k for k in KEY + ("ms",) if k not in r]
        if missing:
            raise CompareError(f"{path}: a row lacks {missing}: {r}")
    return Result(path, data.get("env", {}), bool(data.get("smoke", False)), rows)


def row_key(r: dict) -> tuple:
    """The identity of a row across runs; a renamed op is keyed by its current name."""
    return (RENAMED_OPS.get(r["op"], r["op"]), r["provider"], r["mode"], json.dumps(r["shape"], sort_keys=True),
            r["dtype"], int(r["world_size"]))


def device_of(env: dict) -> str:
    return str(env.get("nvml_name") or env.get("device") or "unknown")


@dataclass
class Change:
    status: str  # worse, better, same, new, missing, anchor (not judged), n/a (no metric)
    key: tuple
    base: float | None
    cur: float | None
    change: float | None  # current / baseline - 1
    note: str = ""


def _metric(r: dict, metric: str) -> tuple[float | None, str]:
    if metric == "ms":
        v = r.get("ms")
        return (float(v), "") if v is not None and v > 0 else (None, "no time")
    if r.get("ratio") is None:
        return None, "no ratio (no anchor in its run)"
    if r.get("anchor") == r["provider"]:
        return None, ANCHOR_ITSELF
    return float(r["ratio"]), ""


def compare(base: Result, cur: Result, *, metric: str = "ratio", tolerance: float = 0.05) -> list[Change]:
    """Per-row changes, worst first.  ``tolerance`` is relative (0.05 = 5%)."""
    if metric not in ("ratio", "ms"):
        raise CompareError(f"unknown metric {metric!r} (ratio or ms)")
    if tolerance < 0:
        raise CompareError("tolerance must be >= 0")

    def index(res: Result) -> dict:
        out = {}
        for r in res.rows:
            k = row_key(r)
            if k in out:
                print(f"warning: {res.path}: duplicate row {k}; the last one counts", file=sys.stderr)
            out[k] = r
        return out

    b, c = index(base), index(cur)
    changes = []
    for k in b.keys() | c.keys():
        if k not in c:
            changes.append(Change("missing", k, _metric(b[k], metric)[0], None, None))
            continue
        if k not in b:
            changes.append(Change("new", k, None, _metric(c[k], metric)[0], None))
            continue
        (vb, why_b), (vc, why_c) = _metric(b[k], metric), _metric(c[k], metric)
        if metric == "ratio" and vb is not None and vc is not None and b[k].get("anchor") != c[k].get("anchor"):
            changes.append(Change("n/a", k, vb, vc, None, f"anchor changed: {b[k].get('anchor')} -> "
                                                          f"{c[k].get('anchor')}"))
            continue
        if vb is None or vc is None:
            anchor = metric == "ratio" and why_b == why_c == ANCHOR_ITSELF
            changes.append(Change("anchor" if anchor else "n/a", k, vb, vc, None, "" if anchor else why_b or why_c))
            continue
        ch = vc / vb - 1.0
        status = "worse" if ch > tolerance else "better" if ch < -tolerance else "same"
        changes.append(Change(status, k, vb, vc, ch))
    changes.sort(key=lambda x: (ORDER[x.status], -(x.change or 0.0) if x.status == "worse" else (x.change or 0.0),
                                x.key))
    return changes


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if metric == "ratio" else f"{v:.4g}"


def print_changes(changes: list[Change], metric: str, show_all: bool = False, out=None) -> None:
    out = out or sys.stdout
    shown = [c for c in changes if show_all or c.status not in ("same", "n/a", "anchor")]
    counts = {s: sum(c.status == s for c in changes) for s in ORDER}
    unit = "ratio to anchor" if metric == "ratio" else "ms"
    if shown:
        head = (f"{'status':<8}{'op':<20}{'provider':<24}{'mode':<6}{'dtype':<9}{'W':>3} {'shape':<40}"
                f"{'baseline':>10}{'current':>10}{'change':>9}")
        print(f"{head}   ({unit}; lower is better)", file=out)
        print("-" * len(head), file=out)
        for c in shown:
            op, prov, mode, shape, dtype, w = c.key
            shape = ",".join(f"{k}={v}" for k, v in json.loads(shape).items())
            if len(shape) > 39:
                shape = shape[:36] + "..."
            ch = f"{100 * c.change:+.1f}%" if c.change is not None else ""
            note = f"  ({c.note})" if c.note else ""
            print(f"{c.status:<8}{op:<20}{prov:<24}{mode:<6}{dtype:<9}{w:>3} {shape:<40}"
                  f"{_fmt(c.base, metric):>10}{_fmt(c.cur, metric):>10}{ch:>9}{note}", file=out)
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no rows", file=out)


def check_devices(base: Result, cur: Result, metric: str, force: bool) -> None:
    """Refuse absolute times across devices (unless forced); warn where the comparison is weaker."""
    db, dc = device_of(base.env), device_of(cur.env)
    if db != dc:
        if metric == "ms" and not force:
            raise CompareError(f"refusing to compare absolute times across devices: baseline on {db!r}, current on "
                               f"{dc!r}.  Use --metric ratio (each row against its anchor from the same run), or "
                               "--force if you know the machines are equivalent")
        print(f"note: baseline on {db!r}, current on {dc!r}"
              + ("; ratios compare each provider's standing against its anchor" if metric == "ratio" else
                 "; absolute times compared anyway (--force)"), file=sys.stderr)
    if base.smoke != cur.smoke:
        print("warning: one file is a smoke run (tiny shapes, few repeats) and the other is not", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", type=Path)
    p.add_argument("current", type=Path)
    p.add_argument("--tolerance", type=float, default=0.05, help="relative change that counts (default 0.05 = 5%%)")
    p.add_argument("--metric", choices=("ratio", "ms"), default="ratio",
                   help="ratio to the same run's anchor (default; portable) or absolute ms (same device only)")
    p.add_argument("--force", action="store_true", help="compare absolute ms across different devices anyway")
    p.add_argument("--fail-on-missing", action="store_true", help="exit 1 when a baseline row is missing")
    p.add_argument("--all", action="store_true", help="also list the rows that did not move")
    args = p.parse_args(argv)
    try:
        base, cur = load(args.baseline), load(args.current)
        check_devices(base, cur, args.metric, args.force)
        changes = compare(base, cur, metric=args.metric, tolerance=args.tolerance)
    except CompareError as exc:
        print(f"bench compare: error: {exc}", file=sys.stderr)
        return 2
    print(f"baseline {args.baseline} ({device_of(base.env)}, {base.env.get('commit') or '?'})\n"
          f"current  {args.current} ({device_of(cur.env)}, {cur.env.get('commit') or '?'})\n"
          f"metric {args.metric}, tolerance {100 * args.tolerance:g}%")
    print_changes(changes, args.metric, args.all)
    worse = [c for c in changes if c.status == "worse"]
    missing = [c for c in changes if c.status == "missing"]
    if worse:
        worst = max(c.change for c in worse)
        print(f"REGRESSION: {len(worse)} row(s) slower than the baseline by more than {100 * args.tolerance:g}% "
              f"(worst {100 * worst:+.1f}%)")
        return 1
    if missing and args.fail_on_missing:
        print(f"FAIL: {len(missing)} baseline row(s) missing from the current run")
        return 1
    if not any(c.status in ("worse", "better", "same") for c in changes):
        print("warning: no row could be compared (no common rows with the metric)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
