"""Measured tiles from a GPU run: keep, per shape, the config that beat the default, and write the tile table.

    distfuse-tune tiles bench/results/diagnose-<device>-<date>.json                      # print what it would write
    python -m distfuse.tune.tiles bench/results/diagnose-*.json --write                  # into the shipped table
    python -m distfuse.tune.tiles diagnose.json --write --out ~/.cache/distfuse/tiles.json  # a user's table

Reads the rows of ``scripts/gpu_diagnose.py`` that time one kernel of :data:`~distfuse.kernels.tile_table.
TILE_KERNELS` in several configs (sections ``forms``, ``matmul_scatter_persistent``,
``gathered_matmul_persistent:subtile=*``, ``reduce`` and ``halo_tiles``: the halo staging's tiles and forms, one
worker's, so ``W`` 1). Each such row names the launch config that ran (``meta``) and whether it was the default
launch of that shape at the time (``default``); the file's ``env`` names the device, the dtype, the world size and
each kernel's fingerprint. A row whose output was checked and found wrong (``exact`` false) is left out, and said.
Per ``(kernel, M, N, K)`` the rows are compared on one metric, ``graph_us`` (a CUDA-graph replay after an L2 flush:
the kernel without the host) where every row of the group has it, else ``loop_us``; an entry is written where the
fastest config beats the default's time by at least ``--min-gain`` (default 3%, above the run-to-run noise of the
lab's kernel rows). A group whose default config was not timed, a dry run, a CPU file, or a kernel whose fingerprint
has changed since the run (the entry would never apply: :mod:`distfuse.kernels.tile_table`) writes nothing, and says
why.

Writing merges by key: an entry of the same device, kernel, dtype, ``W``, ``M``, ``N`` and ``K`` is replaced,
the others are kept.  The table's reader and the pinned rules that consult it are in
:mod:`distfuse.kernels.tile_table`; the CPU tests feed this module synthetic diagnose files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distfuse.kernels.tile_table import FORMAT, SHIPPED_TILES, check_tile, kernel_fingerprint
from distfuse.tune.table import write_text_atomic

__all__ = ["SECTION_KERNELS", "MIN_GAIN", "current_fingerprints", "tile_rows", "pick_tiles", "merge_tiles",
           "write_tiles", "main"]

#: Diagnose sections (or their prefix, before ``:``) -> the kernel whose configs they time.
SECTION_KERNELS = {"forms": "matmul_scatter_persistent", "matmul_scatter_persistent": "matmul_scatter_persistent",
                   "gathered_matmul_persistent": "gathered_matmul_persistent", "reduce": "chunk_reduce",
                   "halo_tiles": "halo_stage"}
MIN_GAIN = 0.03
_KEY = ("device", "kernel", "dtype", "W", "M", "N", "K")


def current_fingerprints() -> dict[str, str]:
    """Each table kernel's fingerprint in this tree (defining a kernel needs no GPU: none is launched)."""
    from distfuse.kernels import chunk_reduce as cr
    from distfuse.kernels import gathered_matmul_persistent as gp
    from distfuse.kernels import halo_programs as hp
    from distfuse.kernels import matmul_scatter_persistent as mp

    return {"matmul_scatter_persistent": kernel_fingerprint(mp._matmul_scatter_persistent_kernel),
            "gathered_matmul_persistent": kernel_fingerprint(gp._gathered_matmul_persistent_kernel),
            "chunk_reduce": kernel_fingerprint(cr._chunk_reduce_kernel),
            "halo_stage": kernel_fingerprint(hp.stage_kernel)}


def _kernel_of(row: dict) -> str | None:
    kernel = SECTION_KERNELS.get(str(row.get("section", "")).split(":")[0])
    if kernel is None or row.get("op") == "cublas" or row.get("op") == "copy" or "error" in row:
        return None
    return kernel


def _mnk(row: dict) -> tuple:
    """A row's ``(M, N, K)``: its ``m``, ``n`` and ``k``, or its ``key`` where it names the table's own (the halo
    staging's rows, whose ``n`` is the block's extent)."""
    key = row.get("key")
    if isinstance(key, dict):
        return key.get("M"), key.get("N"), key.get("K")
    return row.get("m"), row.get("n"), row.get("k")


def tile_rows(doc: dict, source: str, fingerprints: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The usable rows of one diagnose file, normalised (``kernel``, the key, ``config``, ``default``, the times),
    and notes on what was left out and why."""
    env = doc.get("env", {}) if isinstance(doc, dict) else {}
    device = str(env.get("device", ""))
    if env.get("dry_run") or "NVIDIA" not in device:
        return [], [f"{source}: not a GPU run ({device or 'no device'}{', dry run' if env.get('dry_run') else ''})"]
    W, dtype, prints = env.get("W"), env.get("dtype"), env.get("fingerprints") or {}
    if not isinstance(W, int) or not isinstance(dtype, str) or not prints:
        return [], [f"{source}: env lacks W, dtype or kernel fingerprints (a diagnose run before the tile table)"]
    out, notes, stale = [], [], set()
    for row in doc.get("rows", []):
        kernel = _kernel_of(row) if isinstance(row, dict) else None
        if kernel is None or not isinstance(row.get("meta"), dict):
            continue
        if row.get("exact") is False:  # a config that staged wrong bits is never a candidate
            notes.append(f"{source}: {kernel} {json.dumps(row['meta'], sort_keys=True)} at M, N, K = {_mnk(row)} "
                         "gave wrong results: left out")
            continue
        if prints.get(kernel) != fingerprints.get(kernel):
            stale.add(kernel)
            continue
        m, n, k = _mnk(row)
        if not all(isinstance(v, int) for v in (m, n, k)):
            continue
        out.append(dict(device=device, kernel=kernel, dtype=dtype, W=1 if kernel == "halo_stage" else W, M=m, N=n,
                        K=0 if kernel == "chunk_reduce" else k, config=dict(row["meta"]),
                        default=bool(row.get("default")),
                        times={t: row[t] for t in ("graph_us", "loop_us") if isinstance(row.get(t), (int, float))},
                        anchor_us=None, fingerprint=prints[kernel], commit=env.get("commit"), date=env.get("date"),
                        file=source))
    for kernel in sorted(stale):
        notes.append(f"{source}: {kernel} has changed since this run (fingerprint {prints.get(kernel)} there, "
                     f"{fingerprints.get(kernel)} here): its rows are left out")
    # the same run's anchors, for the record: cuBLAS for the GEMMs, the copy for the reduction and the staging (the
    # staged bytes' copy, keyed by its staging's M, N and K)
    cublas, copies, staged = {}, {}, {}
    for row in doc.get("rows", []):
        if isinstance(row, dict) and row.get("op") == "cublas" and "error" not in row:
            cublas.setdefault((row.get("m"), row.get("n"), row.get("k")), row)
        elif isinstance(row, dict) and row.get("op") == "copy" and "error" not in row:
            if str(row.get("section", "")).startswith("halo_tiles"):
                staged.setdefault(_mnk(row), row)
            else:
                copies.setdefault((row.get("m"), row.get("n")), row)
    for r in out:
        a = (copies.get((r["M"], r["N"])) if r["kernel"] == "chunk_reduce" else
             staged.get((r["M"], r["N"], r["K"])) if r["kernel"] == "halo_stage" else
             cublas.get((r["M"], r["N"], r["K"])))
        if a is not None:
            r["anchor_us"] = a.get("graph_us", a.get("loop_us"))
    return out, notes


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def pick_tiles(rows: list[dict], min_gain: float = MIN_GAIN) -> tuple[list[dict], list[str]]:
    """Per key, the fastest config where it beats the default's time by ``min_gain`` or more: table entries
    (checked like the reader checks them), and one note per key saying what was decided."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in _KEY), []).append(r)
    entries, notes = [], []
    for key, group in sorted(groups.items(), key=lambda kv: json.dumps(kv[0])):
        name = "{kernel} {dtype} W={W} M={M} N={N} K={K} on {device}".format(**dict(zip(_KEY, key, strict=True)))
        metric = "graph_us" if all("graph_us" in r["times"] for r in group) else "loop_us"
        timed = [r for r in group if metric in r["times"]]
        defaults = [r for r in timed if r["default"]]
        if not defaults:
            notes.append(f"{name}: the default config was not timed: nothing to compare with, no entry")
            continue
        base = min(r["times"][metric] for r in defaults)
        best = min(timed, key=lambda r: r["times"][metric])
        us = best["times"][metric]
        gain = base / us - 1.0
        if any(_same(best["config"], d["config"]) for d in defaults) or gain < min_gain:
            notes.append(f"{name}: the default holds ({base:.1f} us; best other {us:.1f} us, gain {gain:+.1%} "
                         f"< {min_gain:.0%} by {metric})")
            continue
        entry = {k: best[k] for k in _KEY}
        entry.update(config=best["config"], fingerprint=best["fingerprint"], us=round(us, 2), rule_us=round(base, 2),
                     gain=round(gain, 4), metric=metric, anchor_us=best["anchor_us"], commit=best["commit"],
                     date=best["date"], file=best["file"], source="measured")
        entries.append(entry)
        notes.append(f"{name}: {json.dumps(best['config'], sort_keys=True)} {us:.1f} us against the default's "
                     f"{base:.1f} us ({gain:+.1%} by {metric})")
    return entries, notes


def merge_tiles(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` with the entries of ``new`` in place of those of the same key (device, kernel, dtype, W, M, N,
    K); new keys appended.  Order: by key, so the file diffs cleanly."""
    by_key = {tuple(e[k] for k in _KEY): e for e in existing}
    by_key.update({tuple(e[k] for k in _KEY): e for e in new})
    return [by_key[k] for k in sorted(by_key, key=json.dumps)]


def write_tiles(path: Path, entries: list[dict]) -> Path:
    """Merge ``entries`` into the table at ``path`` (created if absent), atomically; returns the path."""
    path = Path(path)
    existing = json.loads(path.read_text()).get("tiles", []) if path.exists() else []
    tiles = merge_tiles(existing, entries)
    for i, e in enumerate(tiles):
        check_tile(e, path, i)
    return write_text_atomic(path, json.dumps({"format": FORMAT, "tiles": tiles}, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="distfuse-tune tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="scripts/gpu_diagnose.py JSON files")
    p.add_argument("--min-gain", type=float, default=MIN_GAIN, help="fraction the best must beat the default by")
    p.add_argument("--write", action="store_true", help="merge the entries into --out (else print only)")
    p.add_argument("--out", type=Path, default=SHIPPED_TILES, help="table to write (default: the shipped one)")
    args = p.parse_args(argv)
    prints = current_fingerprints()
    rows, notes = [], []
    for f in args.files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            notes.append(f"{f}: not readable as JSON ({exc})")
            continue
        r, n = tile_rows(doc, str(f), prints)
        rows += r
        notes += n
    entries, picked = pick_tiles(rows, args.min_gain)
    print("\n".join(notes + picked) or "no rows")
    if args.write and entries:
        print(f"wrote {len(entries)} tile entries to {write_tiles(args.out, entries)}")
    elif entries:
        print(f"{len(entries)} tile entries (not written: --write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
