"""The GPU lab's launch canary: do this GPU's launch-cache hits compute what Triton's JIT computes?

A launch-cache hit skips Triton's Python wrappers: it calls Triton 3.6's C launcher itself, passes device tensors
by address and expands tensor descriptors from a memo (``distfuse/kernels/launch_cache.py``,
``distfuse/kernels/raw_launch.py``).  Those paths are checked on CPU against Triton 3.6's own wrappers, but a wrong
argument on a GPU would fault the CUDA context of every process that launches, and so every phase of a lab run.
So the lab runs this first, after the probe:

1. a child process runs every bound op (:func:`bound_ops`: the halo staging, unstage and accumulate, the persistent
   producer, ``chunk_reduce``, the all-gather push and the persistent consumer) twice through the JIT
   (``DISTFUSE_LAUNCH_CACHE=0``), then twice through the cache, and checks every output against the JIT's, bit for
   bit (:func:`compare`), and that the second call hit;
2. if that child fails (a mismatch, a fault, or a timeout twice), another runs the same with
   ``DISTFUSE_FAST_LAUNCH=0`` (hits through ``CompiledKernel.run`` with tensors, the 2026-11-28 path), and if that
   fails too, the lab runs with ``DISTFUSE_LAUNCH_CACHE=0`` (:func:`decide`: a child whose JIT path fails switches
   nothing, and a budget spent before the second child ran keeps ``DISTFUSE_FAST_LAUNCH=0``);
3. the decision goes into ``probe.json`` (key ``launch_canary``: each child's result and the ``env`` that the rest
   of the lab exports), and ``--env-of probe.json`` prints that assignment for ``scripts/gpu_lab.sh`` and
   ``scripts/gpu_first_call.sh``.

The compiled binaries land in Triton's cache on disk, so the tests phase that follows does not compile them again.
``tests/test_launch_cache.py::test_bound_launches_match_the_jit_cuda`` runs :func:`compare` as a CUDA test.

    python scripts/launch_canary.py --probe-json OUT/probe.json [--timeout 45]
    python scripts/launch_canary.py --env-of OUT/probe.json     # prints e.g. DISTFUSE_FAST_LAUNCH=0, or nothing
    python scripts/launch_canary.py --dry-run --probe-json F    # no GPU: the children report a dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: The settings tried in order (the first whose child passes is kept), then the one used when none passes.
TRIES = ({}, {"DISTFUSE_FAST_LAUNCH": "0"})
FALLBACK = {"DISTFUSE_LAUNCH_CACHE": "0"}
#: The share of the budget the first child may take: it compiles every kernel (a cold Triton cache), and a rerun
#: or the next setting needs the rest.
FIRST_SHARE = 0.65


def bound_ops(device):
    """``op() -> list of tensors``: one call of every op that launches through a bound launch, on fresh random bf16
    data (a 2-D halo block in the middle of a 3 x 3 grid, so it has every kind of box; a LLaMA-like GEMM of 4
    virtual ranks through a loopback workspace), synchronised before it returns."""
    import torch

    from distfuse.fused.providers import run_producer
    from distfuse.fused.workspace import LoopbackWorkspace
    from distfuse.geometry.halo_plan import HaloPlan
    from distfuse.kernels import halo as hk
    from distfuse.kernels.all_gather_matmul import all_gather_matmul_loopback, gathered_matmul_workspace_bytes
    from distfuse.kernels.halo_tables import recv_numel, send_numel
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter_workspace_bytes

    g = torch.Generator().manual_seed(5)

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(device, torch.bfloat16)

    plan = HaloPlan.for_conv((30, 30), (3, 3), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)), "zeros")
    index = (1, 1)
    x, recv = rnd(2, 4, 10, 10), rnd(recv_numel(plan, index, 8))
    grad, incoming = rnd(2, 4, 12, 12), rnd(send_numel(plan, index, 8))
    W, n, K, N = 4, 256, 128, 256
    a = [rnd(1, n, K) for _ in range(W)]
    w = (rnd(N, K) / 16).contiguous()
    shards = [rnd(1, n // W, K) for _ in range(W)]
    rs_ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.bfloat16), device)
    ag_ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(1, n, K, torch.bfloat16), device)

    def op():
        staged = hk.halo_stage(x, recv, plan, index)
        u = hk.halo_unstage(grad, plan, index)
        gx = hk.halo_accumulate(u.grad_x.clone(), u.self_boxes, incoming, plan, index)
        with rs_ws.in_flight("bound launches"):
            for r in range(W):
                run_producer("triton_persistent", a[r], w, rs_ws, r, W, torch.bfloat16)
            reduced = [chunk_reduce(rs_ws, r, W, 1, n, N, partial_dtype=torch.bfloat16) for r in range(W)]
        gathered = all_gather_matmul_loopback(shards, [w] * W, ag_ws)
        if x.is_cuda:
            torch.cuda.synchronize()
        return [staged, u.grad_x, u.send, gx, *reduced, *gathered]  # the middle worker has no self boxes

    op.stage_key = (plan, index, x.device)
    return op


def hit_counts(stage_key) -> dict:
    """How many hits each family of bound launches recorded: the staging's (of ``stage_key``'s plan), chunk_reduce's,
    the persistent producer's and consumer's."""
    from distfuse.kernels import chunk_reduce as chunk_reduce_kernels
    from distfuse.kernels import gathered_matmul_persistent as gmp
    from distfuse.kernels import halo_programs as hp
    from distfuse.kernels import matmul_scatter_persistent as msp

    plan, index, device = stage_key
    stage = hp.stage_launch(plan, index, 8, device, "all", None, None, 1)
    return dict(stage=sum(len(b._hits) for bound in stage.bound.values() for b in bound),
                chunk_reduce=sum(len(b._hits) for _, b in chunk_reduce_kernels._BOUND.values()),
                producer=sum(len(b._hits) for b in msp._BOUND.values()),
                consumer=sum(len(b._hits) for b in gmp._BOUND.values()))


def compare(device="cuda") -> dict:
    """Every bound op twice through the JIT, then twice through the launch cache:
    ``{ok, problems, warnings, hits, launcher, descriptor_maps, nondeterministic}``.

    ``ok`` when every output of both cached calls matches the JIT's and is finite and non-empty: bit for bit where
    the JIT's two calls agree bit for bit, else (an op whose summation order varies from call to call, listed in
    ``nondeterministic``) within 4 bf16 ulps of the output's largest element.  A family whose second call did not
    hit is a warning, not a failure: the outputs say nothing about its hits then, but nothing is wrong with them.
    ``launcher``: the kinds of launcher the hits called (Triton 3.6's C function, ``DescriptorLaunch`` or
    ``CudaLauncher``); ``descriptor_maps``: the TMA maps the ``DescriptorLaunch`` hits expanded into their memos."""
    import torch

    from distfuse.kernels import chunk_reduce as chunk_reduce_kernels
    from distfuse.kernels import gathered_matmul_persistent as gmp
    from distfuse.kernels import matmul_scatter_persistent as msp
    from distfuse.kernels.launch_cache import FAST_LAUNCH, LAUNCH_CACHE_ENV

    try:  # the JIT's own path first: if it fails, the launch cache is not what is wrong (nothing to switch)
        op = bound_ops(torch.device(device))
        saved = os.environ.get(LAUNCH_CACHE_ENV)
        os.environ[LAUNCH_CACHE_ENV] = "0"
        try:
            jit, again = op(), op()
        finally:
            os.environ.pop(LAUNCH_CACHE_ENV) if saved is None else os.environ.__setitem__(LAUNCH_CACHE_ENV, saved)
    except Exception as exc:  # noqa: BLE001 - reported: the canary cannot judge the cache then
        return dict(ok=False, inconclusive=True, why=f"the JIT's path failed: {type(exc).__name__}: {str(exc)[:300]}",
                    fast_launch=FAST_LAUNCH)
    first, second = op(), op()  # the cache's path: an exception here fails the setting
    problems, unstable = [], []
    for i, (j, j2, f, s) in enumerate(zip(jit, again, first, second, strict=True)):
        if torch.equal(j, j2):
            same = torch.equal(f, j) and torch.equal(s, j)
        else:
            unstable.append(i)
            tol = 2**-6 * j.float().abs().max().item()
            same = all((t.float() - j.float()).abs().max().item() <= tol for t in (f, s))
        if not same:
            problems.append(f"output {i} differs from the JIT's")
        if not torch.isfinite(s.float()).all() or math.prod(s.shape) == 0:
            problems.append(f"output {i} is empty or not finite")
    res = dict(ok=not problems, problems=problems, warnings=[], nondeterministic=unstable, fast_launch=FAST_LAUNCH)
    try:  # what the hits were: a record, never a reason to switch the launch path
        hits = hit_counts(op.stage_key)
        launches = [h[0] for family in ([b for _, b in chunk_reduce_kernels._BOUND.values()], msp._BOUND.values(),
                                        gmp._BOUND.values()) for bound in family for h in bound._hits.values()]
        res.update(hits=hits, launcher=sorted({type(h).__name__ for h in launches}),
                   descriptor_maps=sum(len(h.maps) for h in launches if hasattr(h, "maps")))
        res["warnings"] += [f"no {name} hit" for name, n in hits.items() if not n]
    except Exception as exc:  # noqa: BLE001
        res["warnings"].append(f"could not count the hits: {type(exc).__name__}: {str(exc)[:200]}")
    return res


def _child(dry_run: bool) -> int:
    res = dict(ok=True, dry_run=True) if dry_run else compare()
    print("canary: " + json.dumps(res), flush=True)
    return 0 if res["ok"] or res.get("inconclusive") else 1


def run_child(env: dict, timeout: float, dry_run: bool = False) -> dict:
    """One child under ``env`` (added to this process's): its result, or how it failed (exit code, timeout, the
    tail of its output)."""
    cmd = [sys.executable, __file__, "--child"] + (["--dry-run"] if dry_run else [])
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-400:]
        return dict(env=env, ok=False, why=f"timed out after {timeout:.0f} s",
                    tail=tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
    seconds = round(time.monotonic() - t0, 1)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("canary: ")]
    res = json.loads(lines[-1][len("canary: "):]) if lines else {}
    ok = out.returncode == 0 and res.get("ok") is True
    rec = dict(env=env, ok=ok, rc=out.returncode, seconds=seconds, **{k: v for k, v in res.items() if k != "ok"})
    if not ok:
        rec["tail"] = (out.stdout + out.stderr)[-1500:]
    return rec


def decide(run, budget: float, tries=TRIES) -> dict:
    """``{runs, env}``: ``run(env, timeout)`` for each of ``tries`` until one passes, within ``budget`` seconds in
    all; ``env`` is the settings the rest of the lab runs with.

    * a try that passes: its settings;
    * a first try that timed out runs again before the next setting: a cold Triton cache (every kernel compiled) is
      slow, not wrong, and its rerun finds the binaries on disk;
    * an inconclusive try (the JIT's own path failed: the launch cache is not what is wrong): the defaults, since
      nothing a setting switches would help;
    * none passed: :data:`FALLBACK` (no launch cache), unless the budget ran out before the last of ``tries`` ran
      (the hits through ``CompiledKernel.run``, the path the GPU lab ran on 2026-11-28): then that one.
    """
    t0, runs = time.monotonic(), []
    queue = list(tries)
    retried = False
    while queue:
        left = budget - (time.monotonic() - t0)
        if left < 5:
            runs.append(dict(env=queue[0], ok=False, why=f"not run: {left:.0f} s left"))
            return dict(runs=runs, env=tries[-1] if tries[-1] in queue else FALLBACK)
        env = queue[0]
        # the first child (the one that compiles) leaves a third of the budget for a rerun or the next setting
        rec = run(env, min(left, FIRST_SHARE * budget) if not runs else left)
        runs.append(rec)
        if rec["ok"]:
            return dict(runs=runs, env=env)
        if rec.get("inconclusive"):
            return dict(runs=runs, env={})
        if str(rec.get("why", "")).startswith("timed out") and not retried:
            retried = True
            continue
        queue.pop(0)
    return dict(runs=runs, env=FALLBACK)


def env_assignment(env: dict) -> str:
    """``env`` as ``NAME=value ...`` for the shell's ``export`` (empty for none)."""
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe-json", help="merge the decision into this probe.json (key launch_canary)")
    p.add_argument("--env-of", help="print the env a probe.json's launch_canary decided, and exit")
    p.add_argument("--timeout", type=float, default=50.0, help="seconds for all the children together")
    p.add_argument("--dry-run", action="store_true", help="no GPU: children that report a dry run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.dry_run)
    if args.env_of:
        try:
            canary = json.loads(Path(args.env_of).read_text()).get("launch_canary") or {}
        except (OSError, ValueError):
            canary = {}
        print(env_assignment(canary.get("env") or {}))
        return 0
    res = decide(lambda env, left: run_child(env, left, args.dry_run), args.timeout)
    res["export"] = env_assignment(res["env"])
    if args.probe_json:
        path = Path(args.probe_json)
        try:
            probe = json.loads(path.read_text())
        except (OSError, ValueError):
            probe = {}
        probe["launch_canary"] = res
        path.write_text(json.dumps(probe, indent=1, default=str))
    for r in res["runs"]:
        print(f"launch canary: {env_assignment(r['env']) or 'defaults'}: {'ok' if r['ok'] else 'FAILED'} "
              f"{json.dumps({k: v for k, v in r.items() if k not in ('env', 'ok', 'tail')})}")
        if not r["ok"] and r.get("tail"):
            print(r["tail"][-600:])
    print(f"launch canary: the lab runs with {res['export'] or 'the defaults'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
