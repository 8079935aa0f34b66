"""``python -m bench plot RESULTS.json [--out PNG]``: fused, unfused and anchor curves over shape, crossover marked.

One panel per (op, mode, dtype, world size, and any shape entry that varies
independently of the x axis).  The x axis is the op's dispatch size where it has one
(a fused op of :mod:`distfuse.fused.registry`: the product of its ``size_inputs``, labelled
with its ``size_key``; else ``m*n*k`` when the shape has ``m``, ``n``, ``k``), else the
product of the shape entries that vary (named on the axis); ``--x KEY`` picks one.
Lines: fused (solid), unfused (dashed), the anchor (dotted, black), other providers thin.
The roles come from the file (``env.roles``, written by ``python -m bench run``), else
from the provider names (``*fused*``, ``*unfused*``) and each row's ``anchor``.  Where
fused and unfused share at least two x values, the interval where fused wins
(:func:`distfuse.tune.crossover`, the rule the tuner writes into the dispatch table) is
shaded and its bounds are drawn as vertical lines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from distfuse.fused import registry

MAX_PANELS = 30


def _num(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, list) and v and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v):
        return float(math.prod(v))
    return None


def _x_keys(op: str, rows: list[dict], forced: str | None) -> list[str]:
    keys = set(rows[0]["shape"])
    if forced:
        return [forced]
    spec = registry.OPS.get(registry.current_name(op))  # result files may name a renamed op by its former name
    if spec is not None and set(spec.size_inputs) <= keys:
        return list(spec.size_inputs)
    if {"m", "n", "k"} <= keys:
        return ["m", "n", "k"]
    if "channels" in keys and op.startswith("halo"):
        return ["channels"]
    varying = [k for k in rows[0]["shape"] if len({json.dumps(r["shape"].get(k)) for r in rows}) > 1
               and all(_num(r["shape"].get(k)) is not None for r in rows)]
    if varying:
        return varying
    # One shape (or nothing numeric varies): x is the product of the numeric entries, a size proxy.
    return [k for k in rows[0]["shape"] if _num(rows[0]["shape"][k]) is not None][:8]


def _xlabel(op: str, keys: list[str]) -> str:
    spec = registry.OPS.get(registry.current_name(op))
    if spec is not None and keys == list(spec.size_inputs):
        inputs = "·".join(keys)
        return spec.size_key if spec.size_key == inputs else f"{spec.size_key} = {inputs}"
    return "m·n·k (per-rank GEMM)" if keys == ["m", "n", "k"] else "·".join(keys)


def _x_of(shape: dict, keys: list[str]) -> float | None:
    vals = [_num(shape.get(k)) for k in keys]
    return None if any(v is None for v in vals) else float(math.prod(vals))


def roles_for(op: str, providers: set[str], env_roles: dict, anchors: set[str]) -> dict:
    """{"fused", "unfused", "anchor"} -> provider (or None) for one op."""
    roles = dict(env_roles.get(op, {}))
    if "fused" not in roles:
        cand = sorted(p for p in providers if "fused" in p and "unfused" not in p)
        roles["fused"] = cand[0] if len(cand) == 1 else ("fused" if "fused" in providers else None)
    if "unfused" not in roles:
        cand = sorted(p for p in providers if "unfused" in p)
        roles["unfused"] = cand[0] if len(cand) == 1 else None
    if "anchor" not in roles:
        roles["anchor"] = next(iter(sorted(anchors)), None)
    return {k: (v if v in providers else None) for k, v in roles.items()}


def panels(rows: list[dict], metric: str = "ms", x_key: str | None = None) -> list[dict]:
    """Plot panels: ``{title, xlabel, op, series: {provider: [(x, y)]}}`` (pure; used by the tests)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["mode"], r["dtype"], r["world_size"])].append(r)
    out = []
    for (op, mode, dtype, w), grp in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        xk = _x_keys(op, grp, x_key)
        xs = {id(r): _x_of(r["shape"], xk) for r in grp}
        grp = [r for r in grp if xs[id(r)] is not None]
        if not grp:
            continue
        # Panel keys: shape entries that vary and are not a function of x (those only relabel the x axis).
        panel_keys = []
        for k in grp[0]["shape"]:
            if k in xk:
                continue
            seen: dict = {}
            for r in grp:
                seen.setdefault(xs[id(r)], set()).add(json.dumps(r["shape"].get(k)))
            if len({v for s in seen.values() for v in s}) > 1 and any(len(s) > 1 for s in seen.values()):
                panel_keys.append(k)
        sub = defaultdict(list)
        for r in grp:
            sub[tuple(json.dumps(r["shape"].get(k)) for k in panel_keys)].append(r)
        for pk, prow in sorted(sub.items()):
            series = defaultdict(list)
            for r in prow:
                y = r.get(metric)
                if y is not None:
                    series[r["provider"]].append((xs[id(r)], float(y)))
            for v in series.values():
                v.sort()
            fixed = ", ".join(f"{k}={json.loads(v)}" for k, v in zip(panel_keys, pk, strict=True))
            title = f"{op} {mode} {dtype} W={w}" + (f"\n{fixed}" if fixed else "")
            xlabel = _xlabel(op, xk)
            out.append(dict(title=title, xlabel=xlabel, op=op, series=dict(series),
                            anchors={r["anchor"] for r in prow if r.get("anchor")}))
    return out


def crossover_of(series: dict, roles: dict):
    """The tuner's crossover between the fused and unfused series (None without both at >= 2 common x)."""
    from distfuse.tune import crossover

    f, u = roles.get("fused"), roles.get("unfused")
    if not f or not u or f not in series or u not in series:
        return None
    fu, un = dict(series[f]), dict(series[u])
    common = sorted(set(fu) & set(un))
    if len(common) < 2:
        return None
    return crossover([(x, fu[x], un[x]) for x in common])


def plot(results: Path, out: Path | None = None, metric: str = "ms", x_key: str | None = None,
         op: str | None = None, mode: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.compare import load

    res = load(results)
    rows = [r for r in res.rows if (op is None or r["op"] == op) and (mode is None or r["mode"] == mode)]
    if not rows:
        raise SystemExit(f"bench plot: no rows in {results}" + (f" for op={op} mode={mode}" if op or mode else ""))
    ps = panels(rows, metric, x_key)
    if len(ps) > MAX_PANELS:
        print(f"bench plot: {len(ps)} panels; drawing the first {MAX_PANELS} (filter with --op / --mode)",
              file=sys.stderr)
        ps = ps[:MAX_PANELS]
    env_roles = res.env.get("roles", {})
    ncols = min(3, len(ps))
    nrows = math.ceil(len(ps) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    for ax, pnl in zip(axes.flat, ps, strict=False):
        roles = roles_for(pnl["op"], set(pnl["series"]), env_roles, pnl["anchors"])
        style = {roles.get("fused"): dict(ls="-", lw=2.2, marker="o", label_suffix=" (fused)"),
                 roles.get("unfused"): dict(ls="--", lw=2.0, marker="s", label_suffix=" (unfused)"),
                 roles.get("anchor"): dict(ls=":", lw=2.0, marker="^", color="k", label_suffix=" (anchor)")}
        allx, ally = [], []
        for prov, pts in sorted(pnl["series"].items()):
            st = dict(style.get(prov) or dict(ls="-", lw=0.9, marker=".", label_suffix=""))
            suffix = st.pop("label_suffix")
            if suffix and suffix.strip(" ()") in prov:  # "projection-fused-8gpu (fused)" says it twice
                suffix = ""
            x, y = zip(*pts, strict=True)
            allx += x
            ally += y
            ax.plot(x, y, label=prov + suffix, **st)
        if allx and min(allx) > 0 and max(allx) / min(allx) > 20:
            ax.set_xscale("log")
        if ally and min(ally) > 0 and max(ally) / min(ally) > 20:
            ax.set_yscale("log")
        xo = crossover_of(pnl["series"], roles)
        if xo is not None:
            lo = xo.min_size if xo.min_size is not None else min(allx)
            hi = xo.max_size if xo.max_size is not None else max(allx)
            if xo.fused == "never":
                ax.text(0.02, 0.02, "fused never wins here", transform=ax.transAxes, fontsize=8)
            else:
                ax.axvspan(lo, hi, color="tab:green", alpha=0.08, label="fused wins")
                for b in (xo.min_size, xo.max_size):
                    if b is not None:
                        ax.axvline(b, color="tab:green", lw=1.2)
                        ax.annotate(f"crossover {b:.3g}", (b, 0.97), xycoords=("data", "axes fraction"),
                                    fontsize=7, rotation=90, va="top", ha="right")
        ax.set_title(pnl["title"], fontsize=9)
        ax.set_xlabel(pnl["xlabel"], fontsize=8)
        ax.set_ylabel({"ms": "ms (median)", "ratio": "ratio to anchor", "rate": "rate"}.get(metric, metric),
                      fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ps):]:
        ax.axis("off")
    env = res.env
    fig.suptitle(f"{results.name}: {env.get('nvml_name') or env.get('device', '?')}, torch {env.get('torch', '?')}, "
                 f"commit {str(env.get('commit') or '?')[:10]}" + (" [smoke]" if res.smoke else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985 if nrows > 2 else 0.95))
    out = out or results.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench plot", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: the results path with .png)")
    p.add_argument("--metric", choices=("ms", "ratio", "rate"), default="ms")
    p.add_argument("--x", dest="x_key", default=None, help="shape entry for the x axis (default: see the doc)")
    p.add_argument("--op", default=None, help="only this op")
    p.add_argument("--mode", default=None, help="only this mode")
    args = p.parse_args(argv)
    path = plot(args.results, args.out, args.metric, args.x_key, args.op, args.mode)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
