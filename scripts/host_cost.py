"""Per-call host time of small layer forwards in one gloo process (world 1): the Python path of each layer.

Prints one JSON object, microseconds per call (the best of 5 runs of 300 calls, under no_grad).
Run it from two checkouts to compare their per-call cost::

    git worktree add /tmp/base <commit>
    (cd /tmp/base && python /path/to/scripts/host_cost.py)   # imports /tmp/base's distfuse
    python scripts/host_cost.py

At world size 1 no message moves, so the time is the layer's own Python and the local
compute of tiny tensors: what a refactoring can make worse.  CPU host time, not a GPU result.

``--kernels``: the fused kernels' launchers instead (the persistent producer, ``chunk_reduce``, the push,
the persistent consumer, the halo staging, and the benchmark's fused halo conv step against its ``cat``
step and the layers' own unfused ``pieces`` step), as on a GPU after the first call: the launch cache on,
every launch a hit whose binary launcher does nothing (no kernel runs), and the status checks deferred as on
GPUs.  So the time is distfuse's Python and the launch cache's, the host work an eager fused call adds before
its kernel starts; the GPU lab's ``latency`` section (``scripts/gpu_diagnose.py``) shows when it outlasts the
benchmarks' L2 flush and becomes GPU time.
The GPU machines' hosts ran the same Python 5 to 15 times slower than a recent x86 desktop core.
"""

from __future__ import annotations

import json
import tempfile
import time

import torch
import torch.distributed as dist


def _layers() -> dict:
    from distfuse import Partition
    from distfuse.layers import (
        DistributedConv2d,
        DistributedLayerNorm,
        DistributedLinear,
        DistributedLinearAllGather,
        DistributedLinearReduceScatter,
        DistributedMaxPool2d,
    )

    P = Partition.world()
    P4 = P.create_cartesian_topology_partition([1, 1, 1, 1])
    P3 = P.create_cartesian_topology_partition([1, 1, 1])
    P2 = P.create_cartesian_topology_partition([1, 1])
    return {
        "conv2d": (DistributedConv2d(P4, 4, 4, 3, padding=1), torch.randn(1, 4, 8, 8)),
        "maxpool2d": (DistributedMaxPool2d(P4, 2), torch.randn(1, 4, 8, 8)),
        "linear_all_gather": (DistributedLinearAllGather(P3, 16, 16, P_x=P3), torch.randn(2, 8, 16)),
        "linear_reduce_scatter": (DistributedLinearReduceScatter(P3, 16, 16, P_y=P3), torch.randn(2, 8, 16)),
        "layernorm": (DistributedLayerNorm(P3, 16), torch.randn(2, 8, 16)),
        "linear_general": (DistributedLinear(P2, P2, P2, 16, 16), torch.randn(8, 16)),
    }


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        out = {}
        with torch.no_grad():
            for name, (layer, x) in _layers().items():
                for _ in range(50):
                    layer(x)
                runs = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(300):
                        layer(x)
                    runs.append((time.perf_counter() - t0) / 300 * 1e6)
                out[name] = round(min(runs), 2)
        dist.destroy_process_group()
    print(json.dumps(out))


def kernels() -> None:
    """``--kernels``: microseconds per call of each fused launcher, every launch a launch-cache hit that runs
    nothing (best of 7 runs of 3000 calls)."""
    import os
    import sys

    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors; the launches below never reach the interpreter
    # the GPUs' default status check (no read in the op: a record per launch, drained later), not the CPU's sync read
    os.environ.setdefault("DISTFUSE_STATUS_CHECK", "deferred")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from distfuse.kernels import launch_cache

    class _NoKernel:  # a compiled binary whose launcher launches nothing
        function, packed_metadata = 1, ()

        def run(self, *args):
            pass

        def __getitem__(self, grid):
            return lambda *args: None

    binary = _NoKernel()
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):  # the "JIT" hands back that binary
        cls.__getitem__ = lambda self, grid: (lambda *args, **kwargs: binary)
    launch_cache.launch_cache_enabled = lambda: True
    launch_cache._current_device = lambda: 0
    launch_cache._current_stream = lambda device: 0
    launch_cache._hooked = lambda: False
    launch_cache._BY_ADDRESS = "is_cpu"  # the CPU tensors stand for device memory: hits pass them by address
    from bench.bench_gemm_fused import Side
    from bench.bench_halo_conv import Case, full_step, stage_fused, step_leaves

    def best(fn, calls=3000) -> float:
        for _ in range(300):
            fn()
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        return round(min(runs), 2)

    torch.set_num_threads(1)
    dt, out = torch.bfloat16, {}
    side = Side("rs", 64, 128, 64, 8, dt, "cpu", provider="triton_persistent")
    side.prepare()
    out["producer:triton_persistent"], out["chunk_reduce"] = best(side.fused_gemm), best(side.chunk_reduce)
    side.release()
    side = Side("ag", 64, 64, 128, 8, dt, "cpu")
    side.prepare()
    out["ag_push"], out["gathered_matmul"] = best(side.push), best(side.fused_gemm)
    side.release()
    for cl in (False, True):
        case = Case(2, 1, 8, 8, 1, dt, "cpu", channels_last=cl)
        out["halo_stage" + (" channels_last" if cl else "")] = best(lambda case=case: stage_fused(case, case.x,
                                                                                              case.recv))
    for nd in (2, 3):
        case = Case(nd, 1, 2, 3, 1, torch.float32, "cpu")
        for provider in ("fused", "cat", "pieces"):  # pieces: the layers' own unfused step
            inputs = step_leaves(case, provider)
            out[f"halo conv step{' 3-D' if nd == 3 else ''} {provider}"] = best(
                lambda case=case, p=provider, inputs=inputs: full_step(case, p, *inputs), 1000)
    print(json.dumps(dict(env=_host_env(), us_per_call=out)))


def _host_env() -> dict:
    """The host the ``--kernels`` numbers were taken on (its CPU model, Python, torch, Triton, date)."""
    import platform

    import triton

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(host_cpu=cpu, python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), note="CPU host time per call, every launch a cache hit "
                                                                "that launches nothing: no GPU timing")


if __name__ == "__main__":
    import sys

    kernels() if "--kernels" in sys.argv[1:] else main()
