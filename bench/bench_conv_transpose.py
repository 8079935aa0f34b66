"""Benchmark: distfuse's feature-distributed transposed convolution against torch.cat halo staging.

What it measures, on ``W`` ranks splitting the spatial axes (2-D: ``P_x = [1, 1, a, b]``
with ``a * b = W``; 3-D: ``[1, 1, 1, a, b]``), for the decoder upsamplings of a U-Net
(``C_in -> C_out``, bias, random data, extents the grid divides):

* ``k=2, s=2, p=0``            the 2x2 "up-conv": output blocks are the images of the input
                               blocks, no halo;
* ``k=4, s=2, p=1``            the DCGAN/pix2pix upsampling: one input row of halo per side;
* ``k=3, s=2, p=1, op=1``      the odd-kernel upsampling that doubles the extent.

Providers:

* ``distfuse``  ``DistributedConvTranspose2d/3d``: per call a host-side shape gather, one packed
                broadcast of weight and bias from the root, ``HaloExchange`` driven by the
                transposed plan (exactly the inputs that reach the worker's output block, every
                neighbour in one round), the local transposed convolution and a crop; backward
                sends the halo gradients home and sum-reduces the parameter gradients.
* ``distfuse_static``  the same layer built with ``static_shapes=True``, which now changes
                nothing (kept as a row: it checks that the option stays free).
* ``cat``       (anchor) the PhysicsNeMo / DTensor-style composition, written here: weight and bias
                replicated on every rank; per spatial axis the ``h``-row edge slabs go to the two
                neighbours with P2P and are joined with ``torch.cat`` (zeros at the global
                boundary; :class:`bench.bench_conv_layers.CatHalo`), then
                ``conv_transposeNd(padding = s*h + p, output_padding)``, whose padding crops the
                halo's outputs away; the parameter gradients are all-reduced in one packed message
                (DDP-style).  It is right only where each output block is ``s`` times its input block
                (checked), which is why the cases are those.

Before timing, every provider's output block, input gradient and (on the root) parameter
gradients are checked against the anchor's.  Modes: ``full`` = forward + backward,
``fwd`` = forward under ``torch.no_grad()``.  ``ratio`` = provider / ``cat`` (target <= 1.0);
``rate`` = the transposed convolution's global FLOP rate.

Timing: ``bench.harness.time_interleaved`` (providers alternate in rounds; each run's time is
the slowest rank's); quantiles [0.5, 0.2, 0.8].

Where it runs: plain ``python`` forks ``--world-size`` gloo CPU ranks (one thread each; CPU
ratios only, never GPU claims); ``torchrun --nproc-per-node W`` runs NCCL with one GPU per rank
and CUDA-event timing.

    python bench/bench_conv_transpose.py --world-size 4
    python bench/bench_conv_transpose.py --smoke --world-size 2
    torchrun --nproc-per-node 4 bench/bench_conv_transpose.py --dtype bfloat16
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_conv_layers import CatHalo, CatHaloConv, _Case, _peak_mb  # noqa: E402
from bench.spatial_common import grid_for, partition_for  # noqa: E402

NAME = "conv_transpose"
ANCHOR = "cat"
# (global input shape [B, C_in, *n], C_out, kernel, stride, padding, output_padding).  CPU: tens of ms per run.
CASES = [((2, 32, 64, 64), 16, 2, 2, 0, 0), ((2, 16, 64, 64), 8, 4, 2, 1, 0), ((2, 16, 64, 64), 8, 3, 2, 1, 1),
         ((1, 8, 16, 16, 16), 4, 4, 2, 1, 0)]
GPU_CASES = [((4, 128, 512, 512), 64, 2, 2, 0, 0), ((4, 64, 512, 512), 32, 4, 2, 1, 0),
             ((4, 64, 512, 512), 32, 3, 2, 1, 1), ((1, 32, 128, 128, 128), 16, 4, 2, 1, 0)]
SMOKE_CASES = [((1, 4, 8, 8), 2, 4, 2, 1, 0), ((1, 2, 4, 4, 4), 2, 2, 2, 0, 0)]
MODES = ["full", "fwd"]
CONV_TRANSPOSE = {2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(cases=SMOKE_CASES, warmup=1, rounds=1, reps=2, dtype=dtype)
    if cuda:
        return dict(cases=GPU_CASES, warmup=10, rounds=6, reps=10, dtype=dtype)
    return dict(cases=CASES, warmup=3, rounds=6, reps=5, dtype=dtype)


def _halo(k: int, s: int, p: int) -> int:
    """Input rows per side that reach an output block ``s`` times the input block (low side, high side)."""
    return max((k - 1 - p) // s, (p + s - 1) // s, 0)


class CatHaloConvTranspose(CatHaloConv):
    """The transposed convolution in the torch.cat style: halo slabs joined by ``cat``, then a cropping conv."""

    def __init__(self, P_x, weight, bias, k: int, s: int, p: int, op: int):
        super().__init__(P_x, weight, bias, _halo(k, s, p))
        self.stride, self.padding, self.output_padding = s, s * self.h + p, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = x
        for a in range(self.nd):
            staged = CatHalo.apply(staged, 2 + a, self.h, self.peers[a])
        y = CONV_TRANSPOSE[self.nd](staged, self.weight, self.bias, self.stride, self.padding, self.output_padding)
        want = tuple(self.stride * n for n in x.shape[2:])
        if tuple(y.shape[2:]) != want:
            raise RuntimeError(f"cat anchor: output block {tuple(y.shape[2:])} is not s * the input block {want}; "
                               "this geometry does not suit the anchor")
        return y


class _TransposeCase(_Case):
    """One shape: the distfuse layer and the anchor on the same weights, inputs and output gradients.

    ``verify`` and ``step`` are the conv-layer bench's (providers without a dispatch path).
    """

    def __init__(self, shape: tuple, c_out: int, k: int, s: int, p: int, op: int, dtype: torch.dtype,
                 device: torch.device):
        from distfuse.geometry.decomposition import local_shape
        from distfuse.layers import load_sequential
        from distfuse.layers.conv_transpose import DistributedConvTranspose2d, DistributedConvTranspose3d

        r = dist.get_rank()
        nd = len(shape) - 2
        self.nd, self.dtype, self.root = nd, dtype, 0
        grid = grid_for(nd, dist.get_world_size())
        P_x = partition_for(grid)
        B, C = shape[:2]
        self.shape = dict(batch=B, channels=C, out_channels=c_out, extent=list(shape[2:]), kernel=k, stride=s,
                          padding=p, output_padding=op, grid=list(grid))
        self.flops = 2 * B * C * c_out * k**nd * math.prod(shape[2:])
        gen = torch.Generator().manual_seed(4321)

        def rnd(*size, scale=1.0):
            return (torch.randn(size, generator=gen) * scale).to(device=device, dtype=dtype)

        weight = rnd(C, c_out, *(k,) * nd, scale=(C * k**nd / s**nd) ** -0.5)  # the same on every rank
        bias = rnd(c_out, scale=0.1)
        layers = {}
        for name, static in (("distfuse", False), ("distfuse_static", True)):
            layers[name] = {2: DistributedConvTranspose2d, 3: DistributedConvTranspose3d}[nd](
                P_x, C, c_out, k, stride=s, padding=p, output_padding=op, dtype=dtype, device=device,
                static_shapes=static)
            load_sequential(layers[name], {"weight": weight, "bias": bias} if r == 0 else None)
        cat = CatHaloConvTranspose(P_x, weight, bias, k, s, p, op)
        gen.manual_seed(4321 + 1 + r)  # each rank's own input block and output gradient
        x = rnd(*local_shape(shape, P_x.shape, P_x.index)).requires_grad_(True)
        out_shape = (B, c_out) + tuple((n - 1) * s - 2 * p + k + op for n in shape[2:])
        dy = rnd(*local_shape(out_shape, P_x.shape, P_x.index))
        self.providers = {ANCHOR: dict(fn=cat, x=x, dy=dy, params=cat.parameters(), post=cat.reduce_grads, path=None)}
        for name, layer in layers.items():
            params = [t for t in (layer.weight, layer.bias) if t is not None]
            self.providers[name] = dict(fn=layer, x=x, dy=dy, params=params, post=None, path=None)


def bench_rank(cfg: dict) -> list:
    """Every case and mode on this rank; returns plain dicts (the same on every rank)."""
    from bench.harness import summarize, time_interleaved
    from distfuse.groups import metadata_group

    W = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = cfg["dtype"]
    rows = []
    for shape, c_out, k, s, p, op in cfg["cases"]:
        case = _TransposeCase(shape, c_out, k, s, p, op, dtype, device)
        case.verify()
        for mode in MODES:
            times = time_interleaved({n: case.step(n, mode) for n in case.providers}, warmup=cfg["warmup"],
                                     rounds=cfg["rounds"], reps=cfg["reps"], device=device,
                                     sync_group=metadata_group())
            flops = case.flops * (3 if mode == "full" else 1)
            for n in case.providers:
                ms, q20, q80 = summarize(times[n])
                extra = dict(device=device.type, backend=dist.get_backend(), samples=len(times[n]))
                if n != ANCHOR:
                    extra["path"] = "unfused"  # the transposed convolution has no fused path
                if device.type == "cpu":
                    extra["timing"] = "CPU/gloo wall clock, 1 thread per rank; not a GPU result"
                rows.append(dict(op=f"conv_transpose{case.nd}d", provider=n, mode=mode, shape=case.shape,
                                 dtype=str(dtype).split(".")[-1], world_size=W, ms=ms, ms_q20=q20, ms_q80=q80,
                                 rate=flops / (ms * 1e-3) / 1e12, rate_unit="TFLOP/s",
                                 peak_mem_mb=_peak_mb(case.step(n, mode), device), extra=extra))
        del case
    return rows


def run(smoke: bool = False, world_size: int = 4, dtype: torch.dtype = torch.float32) -> list:
    """Rows of every case/provider/mode (ratios to ``cat`` set); see ``bench.harness.run_multirank``."""
    from bench.harness import run_multirank

    return run_multirank(bench_rank, _config, ANCHOR, smoke, world_size, dtype)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import multirank_main

    return multirank_main(NAME, __doc__.split("\n\n")[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
