"""The ``distfuse-tune`` command line (the commands: :mod:`distfuse.tune`): parse, initialise torch.distributed,
sweep, write the table on rank 0; ``distfuse-tune project`` runs :mod:`distfuse.tune.project` instead, and
``distfuse-tune tiles`` :mod:`distfuse.tune.tiles`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from distfuse.fused import registry
from distfuse.groups import cuda_backend_of, default_timeout
from distfuse.tune.sweeper import SweepResult, default_grid, run_meta, summary, sweep
from distfuse.tune.table import write_table

__all__ = ["DTYPES", "parse_args", "init_dist", "run", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DESCRIPTION = "measure fused against unfused over shapes, write the crossover table that dispatch reads"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="distfuse-tune", description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run under torchrun for more than one rank; the table is written by rank 0.")
    p.add_argument("--ops", nargs="+", default=list(registry.names()), choices=list(registry.names()))
    p.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="measure groups of the first N ranks (default: the whole world)")
    p.add_argument("--mode", choices=("full", "fwd"), default="full", help="time forward+backward (default) or forward")
    p.add_argument("--m", type=int, nargs="+", default=None, help="linears: sequence rows (per-rank GEMM m)")
    p.add_argument("--hidden", type=int, default=None, help="linears: model width (default 4096)")
    p.add_argument("--ffn", type=int, default=None, help="linears: MLP width, split over the ranks (default 14336)")
    p.add_argument("--channels", type=int, nargs="+", default=None, help="halo_conv: channel counts")
    p.add_argument("--extent", type=int, default=None, help="halo_conv: per-rank spatial extent (default 128)")
    p.add_argument("--nd", type=int, default=None, choices=(1, 2, 3), help="halo_conv: spatial dims (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny grid and few repetitions (CI; seconds)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--margin", type=float, default=0.0,
                   help="fused must win by this fraction to count (e.g. 0.03 keeps noise on the unfused side)")
    p.add_argument("--out", type=Path, default=None,
                   help="table path (default $DISTFUSE_TUNE_TABLE, else ~/.cache/distfuse/crossover.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--time-interpreted", action="store_true", help=argparse.SUPPRESS)  # CPU plumbing tests only
    return p.parse_args(argv)


def init_dist() -> bool:
    """Initialise torch.distributed from torchrun's environment, or a one-rank world; True if we did it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = default_timeout()  # validated: a bad DISTFUSE_TIMEOUT is refused by name before any collective
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # by torchrun; else a world of one
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if launched else 0)
    alone = {} if launched else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timeout, **alone)
    return True


def run(args, timer=None) -> SweepResult:
    """The sweep for parsed arguments on the initialised world; rank 0 writes the table unless ``dry_run``.

    ``timer``: :data:`distfuse.tune.sweeper.Timer` (tests; default the real one)."""
    cuda = torch.cuda.is_available() and cuda_backend_of() == "nccl"  # "undefined" under init_process_group()
    dtypes = [DTYPES[d] for d in (args.dtype or (["bfloat16"] if cuda else ["float32"]))]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    grid = functools.partial(default_grid, quick=args.quick, m=args.m, hidden=args.hidden, ffn=args.ffn,
                             channels=args.channels, extent=args.extent, nd=args.nd)
    res = sweep(args.ops, dtypes, args.world_sizes, grid=grid, full=args.mode == "full", warmup=warmup, reps=reps,
                margin=args.margin, progress=not args.no_progress, timer=timer,
                interpreted=getattr(args, "time_interpreted", False))
    if dist.get_rank() == 0:
        print(summary(res))
        if not args.dry_run:
            args_summary = dict(mode=args.mode, reps=reps, warmup=warmup, margin=args.margin, quick=args.quick,
                                world=dist.get_world_size())
            path = write_table(args.out, res.entries, triton_configs=res.triton_configs, sweeps=res.sweeps,
                               run_meta=run_meta(res, args_summary))
            print(f"wrote {len(res.entries)} crossover entries to {path}")
            if not res.entries:
                print("no fused path was timed here, so no crossover entries were written (see the notes)")
    return res


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["project"]:  # distfuse-tune project: no process group, no GPU
        from distfuse.tune.project import main as project_main

        return project_main(argv[1:])
    if argv[:1] == ["tiles"]:  # distfuse-tune tiles: measured tiles from gpu_diagnose runs, no GPU
        from distfuse.tune.tiles import main as tiles_main

        return tiles_main(argv[1:])
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # The kernels are imported (not timed) on CPU; without a GPU Triton needs its interpreter to import them.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    owned = init_dist()
    try:
        run(args)
    finally:
        if owned:
            dist.destroy_process_group()
    return 0
