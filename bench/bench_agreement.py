"""Benchmark: the steady-state cost of the agreement checks, per layer, against the same layer unchecked.

Every layer and primitive module checks, on every call, that its workers agree on the
inputs (``distfuse/primitives/_agreement.py``; ``docs/reliability.md``).  While the
inputs repeat no metadata moves; what is left is the flag: one element in the data
message (CPU, "in band"), or a one-integer all-reduce on the host meta group (CUDA, or
where no message reaches every worker).  This bench measures what that costs, forward
only (the check runs in forward), on ``W`` ranks:

* ``trusted``  (anchor) the same layer inside :func:`~distfuse.primitives._agreement.capture_safe`:
               its agreed record is trusted, no flag moves, nothing is read on the host: the
               layer with no check at all;
* ``agreed``   the default: the flag in band on CPU partitions (or on the host round where no
               message reaches every worker); on CUDA read one call later by every layer (the
               deferred transport), on the host round by the ``HaloExchange`` and ``Broadcast``
               modules;
* ``host``     the flag forced onto the host round (CPU runs, and the layers on CUDA);
* ``deferred`` the flag forced onto the deferred transport (the layers, CPU runs: on CUDA it
               is ``agreed``): a device all-reduce of the flag, read at the next call;
* ``inband``   the flag forced in band (CUDA runs only: a read of the received flag, which
               waits for the device: the synchronisation the host round avoids);
* ``gather``   the site forgotten before every call, so every call gathers the metadata on
               the host (the pre-agreement default of most layers).

Layers (2-D, ``P_x = [1, 1, a, b]`` with ``a * b = W``): the feature conv 3x3 (flag in the
parameter broadcast), the general conv 3x3 with ``P_w`` (flag round), max pooling 3/2
(flag round), the ``HaloExchange`` and ``Broadcast`` modules (flag round).  Linears
(``rows x in_features -> out_features``, ``[1, W]`` over every rank): the all-gather
linear (flag in the all-gather), the reduce-scatter linear (flag in the reduce-scatter)
and ``DistributedLinear`` with ``P_x = P_w = [1, W]`` and ``P_y`` on the first rank (flag
round: its broadcast and sum-reduce are point to point).  ``ratio`` = provider /
``trusted``; the check's cost is ``ratio - 1`` of the layer's time.

Timing: ``bench.harness.time_interleaved``, slowest rank per run, quantiles [0.5, 0.2, 0.8].

    python bench/bench_agreement.py --world-size 4
    python bench/bench_agreement.py --smoke --world-size 2
    torchrun --nproc-per-node 4 bench/bench_agreement.py --dtype bfloat16
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spatial_common import check_agree, grid_for, partition_for  # noqa: E402

NAME = "agreement"
ANCHOR = "trusted"
# (op, global input shape [B, C, H, W]; for the linears (rows, in_features, out_features)).  CPU: a few ms per run
# per rank.
LINEARS = ("linear_all_gather", "linear_reduce_scatter", "general_linear")
CASES = [("feature_conv2d", (2, 8, 64, 64)), ("general_conv2d", (2, 8, 64, 64)), ("max_pool2d", (2, 8, 128, 128)),
         ("halo_exchange", (2, 8, 128, 128)), ("broadcast", (2, 8, 64, 64)), ("linear_all_gather", (256, 256, 256)),
         ("linear_reduce_scatter", (256, 256, 256)), ("general_linear", (256, 256, 256))]
GPU_CASES = [("feature_conv2d", (8, 64, 256, 256)), ("general_conv2d", (8, 64, 256, 256)),
             ("max_pool2d", (8, 64, 512, 512)), ("halo_exchange", (8, 64, 512, 512)), ("broadcast", (8, 64, 256, 256)),
             ("linear_all_gather", (8192, 4096, 4096)), ("linear_reduce_scatter", (8192, 4096, 4096)),
             ("general_linear", (8192, 4096, 4096))]
SMOKE_CASES = [("feature_conv2d", (1, 2, 8, 8)), ("max_pool2d", (1, 2, 8, 8)), ("halo_exchange", (1, 2, 8, 8)),
               ("broadcast", (1, 2, 8, 8)), ("general_conv2d", (1, 2, 8, 8)), ("linear_all_gather", (5, 6, 4)),
               ("linear_reduce_scatter", (5, 6, 4)), ("general_linear", (5, 6, 4))]
#: The cases whose flag takes the deferred transport on CUDA (distfuse/primitives/_flag_deferred.py): the layers,
#: not the point-to-point modules called directly.
DEFERRED = ("feature_conv2d", "general_conv2d", "max_pool2d", "linear_all_gather", "linear_reduce_scatter",
            "general_linear")
NO_CUDA = "unmeasured: no CUDA in this run (the GPU shapes and the inband row run under torchrun with NCCL)"


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(cases=SMOKE_CASES, warmup=1, rounds=1, reps=2, dtype=dtype)
    if cuda:
        return dict(cases=GPU_CASES, warmup=10, rounds=6, reps=20, dtype=dtype)
    return dict(cases=CASES, warmup=3, rounds=6, reps=10, dtype=dtype)


def _layer(op: str, P_x, C: int, dtype: torch.dtype, device, shape=None):
    """``(callable, the agreement site)`` of the layer under test."""
    from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter
    from distfuse.layers.conv import DistributedConv2d
    from distfuse.layers.pool import DistributedMaxPool2d
    from distfuse.primitives import Broadcast, HaloExchange

    if op in LINEARS:
        _, n_in, n_out = shape
        if op == "linear_all_gather":
            m = DistributedLinearAllGather(P_x, n_in, n_out, dtype=dtype, device=device)
        elif op == "linear_reduce_scatter":
            m = DistributedLinearReduceScatter(P_x, n_in, n_out, dtype=dtype, device=device)
        else:  # every worker holds an input block; the output is sum-reduced onto the first rank
            m = DistributedLinear(P_x, _root_of(P_x), P_x, n_in, n_out, dtype=dtype, device=device)
        return m, m.agreement
    if op == "feature_conv2d":
        m = DistributedConv2d(P_x, C, C, 3, padding=1, dtype=dtype, device=device)
        return m, m.agreement
    if op == "general_conv2d":  # channels and width split: P_x = P_w = [1, 2, 1, W/2], P_y = [1, 1, 1, W/2]
        m = DistributedConv2d(P_x, C, C, 3, padding=1, P_y=_general_y(P_x), P_w=P_x, dtype=dtype, device=device)
        return m, m.agreement
    if op == "max_pool2d":
        m = DistributedMaxPool2d(P_x, 3, stride=2, padding=1)
        return m, m.agreement
    if op == "halo_exchange":
        m = HaloExchange(P_x, (3, 3), padding=1)
        return m, m.agreement
    m = Broadcast(_root_of(P_x), P_x)
    return m, m.agreement


def _general_partitions(W: int):
    """``P_x = P_w = [1, 2, 1, W/2]`` over every rank (the general conv's input and weight grids)."""
    from distfuse.partition import Partition

    return Partition.world().create_partition_inclusive(list(range(W))).create_cartesian_topology_partition(
        [1, 2, 1, W // 2])


def _general_y(P_x):
    """``P_y = [1, 1, 1, W/2]`` on the ranks of ``P_x``'s first channel row (collective over the world)."""
    from distfuse.partition import Partition

    W = P_x.size
    first_row = [P_x.ranks[j] for j in range(W // 2)]  # index [0, 0, 0, j]: row-major order
    return Partition.world().create_partition_inclusive(first_row).create_cartesian_topology_partition(
        [1, 1, 1, W // 2])


def _linear_partition(W: int):
    """``[1, W]`` over every rank: one data-parallel block, ``W`` model-parallel workers."""
    from distfuse.partition import Partition

    return Partition.world().create_partition_inclusive(list(range(W))).create_cartesian_topology_partition([1, W])


def _root_of(P_x):
    """A one-worker partition of ``P_x``'s dimensions (all ones) on its first rank (collective over the world)."""
    from distfuse.partition import Partition

    return Partition.world().create_partition_inclusive([P_x.ranks[0]]).create_cartesian_topology_partition(
        [1] * P_x.dim)


def _block(op: str, shape, P_x, dtype, device, gen):
    from distfuse.geometry.decomposition import local_shape
    from distfuse.partition import zero_volume_tensor

    if op in LINEARS:  # [rows, in_features], the features split
        shape = shape[:2]
    if op == "broadcast":  # the root's whole tensor, the others nothing
        if dist.get_rank() != P_x.ranks[0]:
            return zero_volume_tensor(dtype=dtype, device=device)
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return torch.randn(local_shape(shape, P_x.shape, P_x.index), generator=gen).to(device=device, dtype=dtype)


def bench_rank(cfg: dict) -> list:
    """Every case on this rank; returns plain dicts (the same on every rank)."""
    from bench.harness import summarize, time_interleaved
    from distfuse.groups import metadata_group
    from distfuse.primitives._agreement import capture_safe
    from distfuse.primitives._flag_transport import flag_transport

    W = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = metadata_group()
    dtype = cfg["dtype"]
    rows = []
    for op, shape in cfg["cases"]:
        if op == "general_conv2d" and W % 2:
            continue
        if op in LINEARS:
            P_x = _linear_partition(W)
        else:
            P_x = _general_partitions(W) if op == "general_conv2d" else partition_for(grid_for(2, W))
        layer, site = _layer(op, P_x, shape[1], dtype, device, shape)
        x = _block(op, shape, P_x, dtype, device, torch.Generator().manual_seed(99 + dist.get_rank()))

        forgets = [0]

        def call(ctx=contextlib.nullcontext, forget=False, layer=layer, site=site, x=x, forgets=forgets):
            def run():
                if forget:
                    site.forget()
                    forgets[0] += 1
                with torch.no_grad(), ctx():
                    return layer(x)
            return run

        with torch.no_grad():
            want = layer(x)  # the eager call that agrees (the trusted provider needs a settled site)
        providers = {ANCHOR: call(capture_safe), "agreed": call()}
        others = ["inband"] if cuda else ["host"]
        if op in DEFERRED:
            others.append("host" if cuda else "deferred")
        for other in others:
            providers[other] = call(lambda o=other: flag_transport(o))
        providers["gather"] = call(forget=True)
        for name, fn in providers.items():  # same work: every provider's output equals the first eager call's
            got = fn()
            check_agree(f"{op} {name}", got, want, dtype)
        slow_before, forgets[0] = site.slow_calls, 0
        times = time_interleaved(providers, warmup=cfg["warmup"], rounds=cfg["rounds"], reps=cfg["reps"],
                                 device=device, sync_group=sync)
        gathers = site.slow_calls - slow_before
        for n in providers:
            ms, q20, q80 = summarize(times[n])
            deferred = n == "deferred" or (n == "agreed" and cuda and op in DEFERRED)
            extra = dict(device=device.type, backend=dist.get_backend(), samples=len(times[n]),
                         flags="deferred (device all-reduce, read at the next call)" if deferred else
                         "host round" if (n == "host" or (n == "agreed" and cuda)) else
                         ("none" if n == ANCHOR else "in band" if n in ("agreed", "inband") else "metadata gather"))
            if op in ("general_conv2d", "max_pool2d", "halo_exchange", "broadcast", "general_linear") and n in (
                    "agreed", "inband") and not deferred:
                extra["flags"] = "host round (no message reaches every worker)"
            if n == "gather":  # equal counts: only this provider gathered, once per call
                extra["metadata_gathers"], extra["calls"] = gathers, forgets[0]
            if device.type == "cpu":
                extra["timing"] = "CPU/gloo wall clock, 1 thread per rank; not a GPU result"
                extra["cuda"] = NO_CUDA
            if op in LINEARS:
                geometry = dict(rows=shape[0], in_features=shape[1], out_features=shape[2], grid=list(P_x.shape))
            else:
                geometry = dict(batch=shape[0], channels=shape[1], extent=list(shape[2:]), grid=list(P_x.shape[2:]))
            rows.append(dict(op=op, provider=n, mode="fwd", shape=geometry,
                             dtype=str(dtype).split(".")[-1], world_size=W, ms=ms, ms_q20=q20, ms_q80=q80,
                             rate=None, rate_unit="", extra=extra))
    return rows


def run(smoke: bool = False, world_size: int = 4, dtype: torch.dtype = torch.float32) -> list:
    """Rows of every case/provider (ratios to ``trusted`` set); see ``bench.harness.run_multirank``."""
    from bench.harness import run_multirank

    return run_multirank(bench_rank, _config, ANCHOR, smoke, world_size, dtype)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import multirank_main

    return multirank_main(NAME, __doc__.split("\n\n")[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
