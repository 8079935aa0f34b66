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
* one short run per provider (``--providers``, default every one: ``rs:triton``,
  ``rs:triton_persistent``, ``rs:cublas_chunks``, ``ag:triton``, ``ag:copy_engine``), each
  recording the kernel that actually ran (``distfuse.fused.providers.last_kernel``);
* enough claims that epochs pass 1, 2, 16, 32 (Triton's integer specialisations) without
  a recompile stalling one rank mid-collective;
* a workspace growth: a last, larger case that needs a bigger symmetric buffer;
* ``ring:fused``: causal ring attention (GQA, uneven blocks) on its fused transport, each K/V
  block and dK/dV accumulator pushed into the peer's symmetric slot on a side stream
  (:mod:`distfuse.fused.ring_push`), forward and backward against float64 SDPA.

It also times the agreement flag round a CUDA layer call takes before its data collective, on
this host: the shared-memory flag board (:mod:`distfuse.primitives._flag_board`) against the
gloo all-reduce it replaces (``flag_round_us``: median microseconds per round, best of 5 x 500);
the microseconds of a steady forward call of each fused op against ``F.linear`` on the same
operands (``op_cost_us``: host issue time and wall time, a few-microsecond kernel, so the wall
time of a fused op is its host path);
and runs the deferred agreement transport (:mod:`distfuse.primitives._flag_deferred`, the CUDA
default of every layer) through its CUDA code (pinned copy, event) on an
``AllSumReduce``: steady calls against float64, a disagreement that must give NaN and then
``DisagreedCallError`` on both ranks, and the host microseconds of a steady call under the
deferred and the host transports (``deferred_agreement``; the flag all-reduce runs on gloo here,
so the time is not NCCL's).

Status checks are deferred on CUDA (no host sync per op): each case ends with
``distfuse.fused.workspace.check_pending()``, so a failure is charged to its own case.

Usage: ``python scripts/gpu_two_process.py [--iters 8] [--providers rs:triton ...] [--json FILE]``;
exit status 0 when every check passed.  Phase 5 of ``scripts/gpu_lab.sh``.
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


def _rs_case(P, seed, B, n, K, N, dtype, dev, provider=None):
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
    y = matmul_reduce_scatter(xr, wr, br, P, bias_grad="sum", provider=provider)
    y.backward(dy[:, s0:s1].to(dtype).to(dev))
    ref_y = (x @ w.t() + b)[:, s0:s1]
    ref = dict(y=ref_y, dx=dy @ w[:, k0:k1], dw=dy.reshape(-1, N).t() @ x[..., k0:k1].reshape(-1, k1 - k0),
               db=dy.reshape(-1, N).sum(0))
    got = dict(y=y.detach(), dx=xr.grad, dw=wr.grad, db=br.grad)
    return {k: _rel(got[k].cpu(), ref[k]) for k in ref}


def _ag_case(P, seed, B, n, K, N, dtype, dev, provider=None):
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
    y = all_gather_matmul(xr, wr, br, P, keep_gathered=True, n=n, provider=provider)
    y.backward(dy[..., n0:n1].to(dtype).to(dev))
    dyr = dy[..., n0:n1].reshape(-1, n1 - n0)
    ref = dict(y=x @ w[n0:n1].t() + b[n0:n1], dx=(dy @ w)[:, s0:s1], dw=dyr.t() @ x.reshape(-1, K), db=dyr.sum(0))
    got = dict(y=y.detach(), dx=xr.grad, dw=wr.grad, db=br.grad)
    return {k: _rel(got[k].cpu(), ref[k]) for k in ref}


def _ring_case(P, seed, B, S, K, N, dtype, dev, provider=None):
    """Causal ring attention on its fused transport (each K/V block and dK/dV accumulator pushed into the peer's
    symmetric slot, distfuse.fused.ring_push), forward and backward, against float64 SDPA (GQA, uneven blocks)."""
    import torch.nn.functional as F

    from distfuse.layers import DistributedAttention
    from distfuse.layers.attention_ring import local_positions
    from distfuse.tune.cases import forced_path

    H, Hkv, D = 4, 2, 64
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (_rounded(torch.randn(B, h, S, D, generator=g), dtype) for h in (H, Hkv, Hkv, H))
    layer = DistributedAttention(P, causal=True)
    pos = local_positions(S, P.size, P.rank, "contiguous")
    ql, kl, vl = (t[:, :, pos].to(dtype).to(dev).requires_grad_() for t in (q, k, v))
    with forced_path("fused"):
        out = layer(ql, kl, vl)
        out.backward(dout[:, :, pos].to(dtype).to(dev))
    if layer.last_decision.path != "fused":
        raise RuntimeError(f"the ring ran {layer.last_decision.path}: {layer.last_decision.reason}")
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    y.backward(dout)
    want = dict(y=y.detach(), dq=ref[0].grad, dk=ref[1].grad, dv=ref[2].grad)
    got = dict(y=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad)
    return {name: _rel(got[name].cpu(), want[name][:, :, pos]) for name in want}


PROVIDERS = ("rs:triton", "rs:triton_persistent", "rs:cublas_chunks", "ag:triton", "ag:copy_engine", "ring:fused")
CASES = {"rs": _rs_case, "ag": _ag_case, "ring": _ring_case}


def flag_round_cost(P, rounds: int = 500, repeats: int = 5) -> dict:
    """Median microseconds per agreement flag round on ``P`` (collective): the board, and the gloo all-reduce."""
    import torch.distributed as dist

    from distfuse.primitives._agreement import flag_round
    from distfuse.primitives._flag_board import flag_board

    flag = torch.zeros(1, dtype=torch.int64)
    ways = {"board": lambda: flag_round(P, False, "flag_round_cost"),
            "gloo": lambda: dist.all_reduce(flag, group=P.meta_group)}
    out = {"board_used": flag_board(P) is not None}
    for name, fn in ways.items():
        for _ in range(50):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(rounds):
                fn()
            times.append((time.perf_counter() - t0) / rounds * 1e6)
        out[name] = sorted(times)[len(times) // 2]
    return out


def fused_op_cost(P, dev, calls: int = 200, shape: tuple = (1, 512, 1024, 1024)) -> dict:
    """Microseconds per steady forward call on ``P`` (collective), bf16, no autograd: each fused op with its Triton
    producer and consumer, and ``F.linear`` on this rank's operands (the local GEMM, no communication).

    ``host_us``: the host issue time per call, ``calls`` calls back to back without a sync;
    ``wall_us``: per call once the GPU has finished them.  With kernels of a few microseconds,
    a fused op's ``wall_us`` is its host path: claim, publish, producer, consumer, checks.
    """
    import torch.nn.functional as F

    from distfuse.fused.all_gather_matmul import all_gather_matmul
    from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter

    W, r = P.size, P.rank
    B, n, K, N = shape
    g = torch.Generator().manual_seed(7)
    k0, k1 = _blocks(K, W)[r]
    n0, n1 = _blocks(N, W)[r]
    s0, s1 = _blocks(n, W)[r]
    x = torch.randn(B, n, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / 32).to(torch.bfloat16)
    x_rs, w_rs = x[..., k0:k1].contiguous().to(dev), w[:, k0:k1].contiguous().to(dev)
    x_ag, w_ag = x[:, s0:s1].contiguous().to(dev), w[n0:n1].contiguous().to(dev)
    ops = {"matmul_reduce_scatter": lambda: matmul_reduce_scatter(x_rs, w_rs, None, P, provider="triton"),
           "all_gather_matmul": lambda: all_gather_matmul(x_ag, w_ag, None, P, n=n, provider="triton"),
           "F.linear (rs operands)": lambda: F.linear(x_rs, w_rs)}
    out = {"shape": [B, n, K, N]}
    with torch.no_grad():
        for name, fn in ops.items():
            for _ in range(20):
                fn()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            _sync(dev)
            out[name] = dict(host_us=host / calls * 1e6, wall_us=(time.perf_counter() - t0) / calls * 1e6)
    return out


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def deferred_agreement_check(P, dev, calls: int = 200) -> dict:
    """The deferred transport on CUDA tensors (collective over ``P``): correctness, then host us per steady call."""
    import torch.distributed as dist

    from distfuse.primitives import AllSumReduce
    from distfuse.primitives._flag_transport import flag_transport

    me, out = dist.get_rank(), {"failures": []}
    module = AllSumReduce(P, axes_reduce=(1,))  # P is [1, W, 1]: the W workers

    def data(seed, n, rank):
        return torch.randn(n, generator=torch.Generator().manual_seed(seed * 10 + rank), dtype=torch.float64)

    for seed in range(3):
        got = module(data(seed, 4099, me).float().to(dev))
        ref = sum(data(seed, 4099, r) for r in range(P.size))
        if _rel(got.cpu(), ref) > TOL[torch.float32]:
            out["failures"].append(f"steady call {seed}: relative error {_rel(got.cpu(), ref):.2e}")
    out["pending_after_steady"] = module.agreement.deferred._pending is not None
    bad = module(data(9, 4097 if me == 1 else 4099, me).float().to(dev))
    out["nan_after_disagreement"] = bool(torch.isnan(bad).all())
    try:
        module(data(10, 4099, me).float().to(dev))
        out["failures"].append("the call after a disagreement did not raise")
    except Exception as exc:  # noqa: BLE001 - recorded
        out["raised"] = type(exc).__name__
    if not out["nan_after_disagreement"] or out.get("raised") != "DisagreedCallError":
        out["failures"].append(f"disagreement: NaN {out['nan_after_disagreement']}, raised {out.get('raised')}")
    x = data(11, 4096, me).float().to(dev)
    for mode in ("deferred", "host"):
        with flag_transport(mode):
            for _ in range(20):
                module(x)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                module(x)
            out[f"{mode}_us_per_call"] = (time.perf_counter() - t0) / calls * 1e6
            _sync(dev)
    out["ok"] = not out["failures"]
    return out


def _rank_main(rank: int, W: int, init: str, iters: int, providers: list[str], out_dir: str) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from distfuse import Partition
    from distfuse.fused import symmetric
    from distfuse.fused.providers import last_kernel
    from distfuse.fused.workspace import check_pending

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=W)
    dev = torch.device("cuda", 0)
    report = dict(rank=rank, cases=[], failures=[])
    path = os.path.join(out_dir, f"rank{rank}.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f)

    try:
        grids, rings = {}, {}
        for name, order in (("world-order", list(range(W))), ("reversed", list(reversed(range(W))))):
            P = Partition.world(device=dev).create_partition_inclusive(order)
            grids[name] = P.create_cartesian_topology_partition([1, W, 1])
            rings[name] = P.create_cartesian_topology_partition([W])
        try:  # a measurement: its failure must not cost the correctness cases below
            report["flag_round_us"] = flag_round_cost(rings["world-order"])
        except Exception as exc:  # noqa: BLE001 - recorded
            report["flag_round_us"] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
        try:
            report["op_cost_us"] = fused_op_cost(grids["world-order"], dev)
        except Exception as exc:  # noqa: BLE001 - recorded
            report["op_cost_us"] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
        try:
            report["deferred_agreement"] = deferred_agreement_check(grids["reversed"], dev)
        except Exception:  # noqa: BLE001 - recorded
            report["deferred_agreement"] = dict(ok=False, failures=[traceback.format_exc()[-2000:]])
        save()
        shapes = [(2, 67, 96, 80), (1, 130, 256, 192)]  # (B, n, K, N): n, K, N uneven over 2 and not x16
        plan = [(spec, it) for spec in providers for it in range(iters)]
        plan.append((providers[0], -1))  # the growth case: a larger op, on the first provider
        for step, (spec, it) in enumerate(plan):
            op, provider = spec.split(":")
            grow = it < 0
            dtype = (torch.bfloat16, torch.float32)[it % 2] if not grow else torch.bfloat16
            order = ("world-order", "reversed")[(it // 2) % 2] if not grow else "world-order"
            B, n, K, N = (8, 1030, 1024, 768) if grow else shapes[(it // 4) % len(shapes)]  # ~13 MB of slots: grows
            P = (rings if op == "ring" else grids)[order]
            before = {k: ws.nbytes for k, ws in symmetric._CACHE.items()}
            t0 = time.perf_counter()
            errs = CASES[op](P, 1000 + step, B, n, K, N, dtype, dev, provider)
            torch.cuda.synchronize()
            check_pending()  # deferred status checks: a failed flag wait raises here, charged to this case
            choice = last_kernel("matmul_reduce_scatter") if op == "rs" else None
            case = dict(step=step, op=op, provider=provider, kernel=choice.kernel if choice else provider,
                        kernel_reason=choice.reason if choice else None, dtype=str(dtype), order=order,
                        shape=[B, n, K, N], rel_err=errs, seconds=time.perf_counter() - t0, grow=grow)
            if grow:
                after = {k: ws.nbytes for k, ws in symmetric._CACHE.items()}
                case["workspace_bytes"] = dict(before=sorted(before.values()), after=sorted(after.values()))
                if not any(after.get(k, 0) > v for k, v in before.items()) and len(after) <= len(before):
                    report["failures"].append(f"step {step}: the workspace did not grow: {before} -> {after}")
            bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
            if bad:
                report["failures"].append(f"step {step} {spec} {dtype} {order} {case['shape']}: rel. error over "
                                          f"{TOL[dtype]}: {bad}")
            report["cases"].append(case)
            save()  # after every case: a run cut off keeps what it checked
        symmetric.close_all()
    except Exception:  # noqa: BLE001 - reported in the JSON and the exit status
        report["failures"].append(traceback.format_exc()[-4000:])
    finally:
        save()
        dist.destroy_process_group()


def summarize(reports: list[dict], iters: int, providers: list[str], seconds: float) -> dict:
    """Per provider: cases run, worst relative error per op and dtype, the kernels that ran, failures."""
    failures = [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]
    by_provider = {}
    for spec in providers:
        cases = [c for r in reports for c in r["cases"] if f"{c['op']}:{c['provider']}" == spec]
        worst = {}
        for c in cases:
            key = c["dtype"].replace("torch.", "")
            worst[key] = max(worst.get(key, 0.0), max(c["rel_err"].values()))
        by_provider[spec] = dict(cases=len(cases), expected=2 * iters, worst_rel_err=worst,
                                 kernels=sorted({c["kernel"] for c in cases}),
                                 ok=bool(cases) and len(cases) >= 2 * iters and
                                 not any(spec in f for f in failures))
    flag_cost = next((r["flag_round_us"] for r in reports if r.get("rank") == 0 and "flag_round_us" in r), None)
    deferred = {r["rank"]: r["deferred_agreement"] for r in reports if "deferred_agreement" in r}
    op_cost = next((r["op_cost_us"] for r in reports if r.get("rank") == 0 and "op_cost_us" in r), None)
    return dict(ok=not failures and all(v["ok"] for v in by_provider.values())
                and all(d.get("ok") for d in deferred.values()), world_size=2, iterations=iters,
                seconds=seconds, by_provider=by_provider, failures=failures, flag_round_us=flag_cost,
                deferred_agreement=deferred, op_cost_us=op_cost, reports=reports)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=8, help="cases per provider (dtype, rank order and shape vary)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="no GPU: write the summary of no cases (checks the JSON)")
    args = p.parse_args(argv)
    if args.dry_run:
        summary = dict(summarize([], args.iters, args.providers, 0.0), dry_run=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        print(f"gpu_two_process: dry run: would run {args.providers}, {args.iters} cases each, on 2 processes")
        return 0
    if not torch.cuda.is_available():
        print("gpu_two_process: no CUDA device")
        return 2
    W = 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "pg")
        try:
            mp.start_processes(_rank_main, args=(W, init, args.iters, args.providers, tmp), nprocs=W, join=True,
                               start_method="spawn")
        finally:  # even when a rank died: what each rank saved so far
            reports = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(W)
                       if os.path.exists(os.path.join(tmp, f"rank{r}.json"))]
            summary = summarize(reports, args.iters, args.providers, time.perf_counter() - t0)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=1)
    for line in summary["failures"]:
        print("FAIL", line)
    for spec, v in summary["by_provider"].items():
        worst = {k: float(f"{e:.2e}") for k, e in v["worst_rel_err"].items()}
        print(f"gpu_two_process: {spec:22s} {'ok' if v['ok'] else 'FAILED'}: {v['cases']} cases over both ranks, "
              f"kernels {v['kernels']}, worst relative errors {worst}")
    cost = summary["flag_round_us"]
    if cost and "error" in cost:
        print(f"gpu_two_process: agreement flag round not measured: {cost['error']}")
    elif cost:
        print(f"gpu_two_process: agreement flag round, us per call: board {cost['board']:.1f} (used: "
              f"{cost['board_used']}), gloo {cost['gloo']:.1f}")
    op_cost = summary.get("op_cost_us")
    if op_cost and "error" in op_cost:
        print(f"gpu_two_process: fused op cost not measured: {op_cost['error']}")
    elif op_cost:
        print(f"gpu_two_process: steady forward call, us (host / wall), shape {op_cost['shape']}: " + ", ".join(
            f"{k} {v['host_us']:.1f} / {v['wall_us']:.1f}" for k, v in op_cost.items() if k != "shape"))
    for rank, d in summary["deferred_agreement"].items():
        if d.get("ok"):
            print(f"gpu_two_process: deferred agreement (rank {rank}) ok; host us per steady call: deferred "
                  f"{d['deferred_us_per_call']:.1f}, host round {d['host_us_per_call']:.1f}")
        else:
            print(f"gpu_two_process: deferred agreement (rank {rank}) FAILED: {d.get('failures')}")
    print(f"gpu_two_process: {'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']:.1f} s")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
