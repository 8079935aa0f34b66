"""Two processes on one GPU through real torch symmetric memory: the fused linears against float64.

A one-GPU machine cannot run NCCL between two ranks, but torch's symmetric memory accepts
two processes on one device when ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` is set.
With a gloo world for the host-side metadata, this runs distfuse's fused ops through the
same CUDA path (peer address tables, system-scope flags, device barriers) that they take
on an NVLink node; only the link is local memory.

What it checks, on each rank:

* ``matmul_reduce_scatter`` and ``all_gather_matmul``, forward and backward (input,
  weight and bias gradients), in bf16 and fp32, against float64 references computed
  here from the global tensors (not from distfuse), on fresh random data each iteration;
* the ranks listed in both orders (partition rank != world rank);
* 40 iterations, so epochs pass 1, 2, 16, 32 (Triton's integer specialisations) without
  a recompile stalling one rank mid-collective;
* a workspace growth: a last, larger case that needs a bigger symmetric buffer.

Usage: ``python scripts/gpu_two_process.py [--iters 40] [--json FILE]``; exit status 0 when
every check passed.  Part of ``scripts/gpu_session.sh``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(got).any():
        return float("inf")
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype).double()


def _global_data(seed: int, B: int, n: int, K: int, N: int, dtype):
    g = torch.Generator().manual_seed(seed)
    x = _rounded(torch.randn(B, n, K, generator=g), dtype)
    w = _rounded(torch.randn(N, K, generator=g) / math.sqrt(K), dtype)
    b = _rounded(torch.randn(N, generator=g), dtype)
    return x, w, b


def _blocks(n: int, W: int):
    q, r = divmod(n, W)
    starts = [i * q + min(i, r) for i in range(W + 1)]
    return [(starts[i], starts[i + 1]) for i in range(W)]


def _rs_case(P, seed, B, n, K, N, dtype, dev):
    """Row-parallel linear, sequence-parallel output: K split over ranks, rows of y scattered."""
    from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter

    W, r = P.size, P.rank
    x, w, b = _global_data(seed, B, n, K, N, dtype)
    dy = _rounded(torch.randn(B, n, N, generator=torch.Generator().manual_seed(seed + 1)), dtype)
    k0, k1 = _blocks(K, W)[r]
    s0, s1 = _blocks(n, W)[r]
    xr = x[..., k0:k1].to(dtype).to(dev).requires_grad_()
    wr = w[:, k0:k1].to(dtype).to(dev).requires_grad_()
    br = b.to(dtype).to(dev).requires_grad_()
    y = matmul_reduce_scatter(xr, wr, br, P, bias_grad="sum")
    y.backward(dy[:, s0:s1].to(dtype).to(dev))
    ref_y = (x @ w.t() + b)[:, s0:s1]
    ref = dict(y=ref_y, dx=dy @ w[:, k0:k1], dw=dy.reshape(-1, N).t() @ x[..., k0:k1].reshape(-1, k1 - k0),
               db=dy.reshape(-1, N).sum(0))
    got = dict(y=y.detach(), dx=xr.grad, dw=wr.grad, db=br.grad)
    return {k: _rel(got[k].cpu(), ref[k]) for k in ref}


def _ag_case(P, seed, B, n, K, N, dtype, dev):
    """Column-parallel linear, sequence-parallel input: rows of x gathered, N split over ranks."""
    from distfuse.fused.all_gather_matmul import all_gather_matmul

    W, r = P.size, P.rank
    x, w, b = _global_data(seed, B, n, K, N, dtype)
    dy = _rounded(torch.randn(B, n, N, generator=torch.Generator().manual_seed(seed + 1)), dtype)
    n0, n1 = _blocks(N, W)[r]
    s0, s1 = _blocks(n, W)[r]
    xr = x[:, s0:s1].to(dtype).to(dev).requires_grad_()
    wr = w[n0:n1].to(dtype).to(dev).requires_grad_()
    br = b[n0:n1].to(dtype).to(dev).requires_grad_()
    y = all_gather_matmul(xr, wr, br, P, keep_gathered=True, n=n)
    y.backward(dy[..., n0:n1].to(dtype).to(dev))
    dyr = dy[..., n0:n1].reshape(-1, n1 - n0)
    ref = dict(y=x @ w[n0:n1].t() + b[n0:n1], dx=(dy @ w)[:, s0:s1], dw=dyr.t() @ x.reshape(-1, K), db=dyr.sum(0))
    got = dict(y=y.detach(), dx=xr.grad, dw=wr.grad, db=br.grad)
    return {k: _rel(got[k].cpu(), ref[k]) for k in ref}


def _rank_main(rank: int, W: int, init: str, iters: int, out_dir: str) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from distfuse import Partition
    from distfuse.fused import symmetric

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=W)
    dev = torch.device("cuda", 0)
    report = dict(rank=rank, cases=[], failures=[])
    try:
        grids = {}
        for name, order in (("world-order", list(range(W))), ("reversed", list(reversed(range(W))))):
            P = Partition.world(device=dev).create_partition_inclusive(order)
            grids[name] = P.create_cartesian_topology_partition([1, W, 1])
        shapes = [(2, 67, 96, 80), (1, 130, 256, 192)]  # (B, n, K, N): n, K, N uneven over 2 and not x16
        for it in range(iters + 1):
            grow = it == iters
            op = ("rs", "ag")[it % 2]
            dtype = (torch.bfloat16, torch.float32)[(it // 2) % 2]
            order = ("world-order", "reversed")[(it // 4) % 2]
            B, n, K, N = (8, 1030, 1024, 768) if grow else shapes[it % len(shapes)]  # ~13 MB of slots: grows
            P = grids[order]
            before = {k: ws.nbytes for k, ws in symmetric._CACHE.items()}
            t0 = time.perf_counter()
            errs = (_rs_case if op == "rs" else _ag_case)(P, 1000 + it, B, n, K, N, dtype, dev)
            torch.cuda.synchronize()
            case = dict(it=it, op=op, dtype=str(dtype), order=order, shape=[B, n, K, N], rel_err=errs,
                        seconds=time.perf_counter() - t0, grow=grow)
            if grow:
                after = {k: ws.nbytes for k, ws in symmetric._CACHE.items()}
                case["workspace_bytes"] = dict(before=sorted(before.values()), after=sorted(after.values()))
                if not any(after.get(k, 0) > v for k, v in before.items()) and len(after) <= len(before):
                    report["failures"].append(f"it {it}: the workspace did not grow: {before} -> {after}")
            bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
            if bad:
                report["failures"].append(f"it {it} {op} {dtype} {order} {case['shape']}: rel. error over "
                                          f"{TOL[dtype]}: {bad}")
            report["cases"].append(case)
        symmetric.close_all()
    except Exception:  # noqa: BLE001 - reported in the JSON and the exit status
        report["failures"].append(traceback.format_exc()[-4000:])
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_two_process: no CUDA device")
        return 2
    W = 2
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "pg")
        t0 = time.perf_counter()
        mp.start_processes(_rank_main, args=(W, init, args.iters, tmp), nprocs=W, join=True, start_method="spawn")
        reports = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(W)]
    failures = [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]
    worst = {}
    for r in reports:
        for c in r["cases"]:
            key = f"{c['op']}-{c['dtype'].replace('torch.', '')}"
            worst[key] = max(worst.get(key, 0.0), max(c["rel_err"].values()))
    summary = dict(ok=not failures, world_size=W, iterations=args.iters, seconds=time.perf_counter() - t0,
                   worst_rel_err=worst, failures=failures, reports=reports)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for line in failures:
        print("FAIL", line)
    print(f"gpu_two_process: {'ok' if not failures else 'FAILED'}: {args.iters + 1} cases per rank, worst relative "
          f"errors {json.dumps({k: float(f'{v:.2e}') for k, v in worst.items()})}, {summary['seconds']:.1f} s")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
