"""``python -m bench``: run suites, compare results against a baseline, plot them.

    python -m bench list
    python -m bench run SUITE|all [--smoke] [--out DIR|FILE.json] [--world-size N] [--dtype D]
    python -m bench compare BASELINE.json CURRENT.json [--tolerance 0.05] [--metric ratio|ms] [--force]
    python -m bench plot RESULTS.json [--out PNG]

``run`` writes ``{env, smoke, rows}`` (see ``bench/harness.py``) to
``bench/results/<suite>-<device>-<date>[-smoke].json``, or to ``--out``.  Under ``torchrun``
the multi-rank suites run on the torchrun world and rank 0 writes; the one-GPU suites
then run on rank 0 alone.  Exit status: 0, or 1 when a suite failed.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # Before anything imports distfuse.kernels: without a GPU, Triton kernels run only interpreted (smoke passes).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run_parser(sub):
    from bench.suites import SUITES

    p = sub.add_parser("run", help="run a registered suite (or all) and write its rows as JSON")
    p.add_argument("suite", choices=sorted(SUITES) + ["all"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: checks that the suite works")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default bench/results), or a path ending in .json")
    p.add_argument("--world-size", type=int, default=4,
                   help="ranks for the multi-rank suites (forked gloo CPU ranks; ignored under torchrun); "
                        "virtual ranks for gemm_fused")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars (default: bars on a terminal)")
    return p


def run_command(args) -> int:
    import torch.distributed as dist

    from bench.harness import environment, init_torchrun, print_table, under_torchrun, write_results
    from bench.suites import SUITES, RunOptions, SuiteResult, has_cuda, progress

    opts = RunOptions(smoke=args.smoke, world_size=args.world_size, dtype=DTYPES[args.dtype],
                      progress=False if args.no_progress else None)
    names = sorted(SUITES) if args.suite == "all" else [args.suite]
    # Multi-rank suites first: under torchrun the other ranks leave after them, rank 0 goes on alone.
    names.sort(key=lambda n: SUITES[n].single_process)
    if under_torchrun():
        init_torchrun()
    rank = dist.get_rank() if dist.is_initialized() else 0
    results: dict[str, SuiteResult] = {}
    for name in progress(names, "suites", opts) if len(names) > 1 else names:
        suite = SUITES[name]
        if suite.single_process and rank != 0:
            continue
        if suite.gpu_only and not has_cuda() and not opts.smoke:
            res = SuiteResult([], "skipped", "needs a CUDA GPU: its fused kernels would run in the Triton "
                                             "interpreter on CPU, whose times mean nothing (--smoke runs its CPU "
                                             "correctness pass)")
        else:
            try:
                res = suite.runner(opts)
            except Exception:  # noqa: BLE001 - report the suite's failure, go on with the others, exit 1
                res = SuiteResult([], "failed", traceback.format_exc())
        results[name] = res
        if rank == 0:
            print(f"[{name}] {res.status}: {len(res.rows)} rows" + (f"; {res.message}" if res.message else ""),
                  flush=True)
    if rank != 0:
        dist.destroy_process_group()
        return 0
    rows = [r for res in results.values() for r in res.rows]
    failed = [n for n, res in results.items() if res.status == "failed"]
    if rows:
        env = environment()
        if env["device"] == "cpu":
            env["note"] = "CPU timings: ratios between CPU providers only, never GPU results"
        env["command"] = "python -m bench " + " ".join(args.argv)
        env["world"] = dist.get_world_size() if dist.is_initialized() else None
        env["suites"] = {n: dict(status=res.status, message=res.message[:2000], rows=len(res.rows))
                         for n, res in results.items()}
        env["roles"] = {op: roles for res in results.values() for op, roles in res.roles.items()}
        print_table(rows)
        out = args.out
        name = args.suite
        if out is not None and out.suffix == ".json":
            tmp = write_results(name, rows, env=env, out_dir=out.parent, smoke=opts.smoke)
            shutil.move(tmp, out)
            path = out
        else:
            path = write_results(name, rows, env=env, out_dir=out, smoke=opts.smoke)
        print(f"wrote {len(rows)} rows to {path}")
    else:
        print("no rows to write" + (" (CPU: GPU-only suites skipped or checked only)" if not has_cuda() else ""))
    if dist.is_initialized() and under_torchrun():
        dist.destroy_process_group()
    if failed:
        for n in failed:
            print(f"[{n}] FAILED:\n{results[n].message}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        from bench.compare import main as compare_main

        return compare_main(argv[1:])
    if argv and argv[0] == "plot":
        from bench.plot import main as plot_main

        return plot_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                epilog="compare and plot: python -m bench compare --help, python -m bench plot --help")
    sub = p.add_subparsers(dest="cmd", required=True)
    _run_parser(sub)
    sub.add_parser("list", help="the registered suites")
    sub.add_parser("compare", help="compare two result files; exits 1 on a regression")
    sub.add_parser("plot", help="plot a result file")
    args = p.parse_args(argv)
    args.argv = argv
    if args.cmd == "list":
        from bench.suites import SUITES

        for s in SUITES.values():
            where = "one GPU (CPU: --smoke correctness pass)" if s.gpu_only else "CPU ranks or torchrun world"
            print(f"{s.name:<15} {s.summary}  [{where}]")
        return 0
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
