"""Benchmark: distfuse's distributed pooling and upsampling layers against F.pad / torch.cat halo staging.

What it measures, on ``W`` ranks splitting the spatial axes (2-D: ``P_x = [1, 1, a, b]`` with
``a * b = W``; 3-D: ``[1, 1, 1, a, b]``), random data, extents divisible by twice the grid:

=====================  ==================================================================
op                     layer
=====================  ==================================================================
``max_pool2d``         ``MaxPool2d(3, stride=2, padding=1)`` (a ResNet stem's pooling)
``avg_pool2d``         ``AvgPool2d(3, stride=2, padding=1)``
``max_pool3d``         ``MaxPool3d(3, stride=2, padding=1)``
``upsample_bilinear``  ``Upsample(scale_factor=2, mode="bilinear")`` (a U-Net decoder's)
=====================  ==================================================================

Providers:

* ``distfuse``        the layer on the unfused path (``DISTFUSE_PATH=unfused``): per call a
                      one-element agreement flag all-reduce (the shape gather only on the
                      first call and on a change), one round of point-to-point halo messages that
                      writes the window once (``HaloExchange``), then the local op; backward
                      sends the halo gradients home.
* ``distfuse_static`` the same layer built with ``static_shapes=True``, which now changes
                      nothing (kept as a row: it checks that the option stays free).
* ``distfuse_fused``  the same layer staging with the Triton halo kernels
                      (``DISTFUSE_PATH=fused``).  CUDA only (under ``torchrun``); on CPU these
                      rows are not produced and every CPU row says so (``extra["cuda"]``).
* ``cat``             (anchor) the DistDL / PhysicsNeMo-style layer, written here: for each
                      split axis in turn, the edge slabs of width 1 go to the neighbours
                      (``batch_isend_irecv``) and are joined with ``torch.cat``; at the global
                      boundary the slab is ``F.pad``'s fill (``-inf`` for max, 0 for average;
                      none for upsampling, whose local call clamps there like the global one).
                      Then the torch op with ``padding=0`` (pooling), or ``F.interpolate`` and
                      a crop of the two outputs per received slab (upsampling).  Backward
                      sends the slabs' gradients back, axis by axis in reverse.

Before timing, each provider's output block and input gradient are checked against the
anchor's, so the providers do the same work.  Modes: ``full`` = forward + backward
(input gradient), ``fwd`` = forward under ``torch.no_grad()``.  ``ratio`` = provider /
``cat`` (target <= 1.0); ``rate`` = effective GB/s: the bytes of the global input plus
output, once for ``fwd`` and twice for ``full`` (the gradients), over the time.

Timing: ``bench.harness.time_interleaved`` (providers alternate in rounds; each run's time is
the slowest rank's); quantiles [0.5, 0.2, 0.8].

    python bench/bench_spatial_layers.py --world-size 4
    python bench/bench_spatial_layers.py --smoke --world-size 2
    torchrun --nproc-per-node 4 bench/bench_spatial_layers.py --dtype bfloat16
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spatial_common import check_agree, exchange, grid_for, partition_for, with_path  # noqa: E402

NAME = "spatial_layers"
ANCHOR = "cat"
OPS = ("max_pool2d", "avg_pool2d", "max_pool3d", "upsample_bilinear")
# (op, global input shape [B, C, *n]).  CPU: a few ms to tens of ms per run per rank.
CASES = [("max_pool2d", (2, 16, 256, 256)), ("avg_pool2d", (2, 16, 256, 256)), ("max_pool3d", (1, 8, 32, 64, 64)),
         ("upsample_bilinear", (2, 16, 128, 128))]
GPU_CASES = [("max_pool2d", (8, 64, 1024, 1024)), ("avg_pool2d", (8, 64, 1024, 1024)),
             ("max_pool3d", (1, 32, 128, 256, 256)), ("upsample_bilinear", (8, 64, 512, 512))]
SMOKE_CASES = [("max_pool2d", (1, 2, 8, 8)), ("avg_pool2d", (1, 2, 8, 8)), ("max_pool3d", (1, 2, 4, 8, 8)),
               ("upsample_bilinear", (1, 2, 4, 8))]
MODES = ["full", "fwd"]
NO_CUDA = "unmeasured: no CUDA in this run (GPU shapes and the fused staging run under torchrun with NCCL)"


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(cases=SMOKE_CASES, warmup=1, rounds=1, reps=2, dtype=dtype)
    if cuda:
        return dict(cases=GPU_CASES, warmup=10, rounds=6, reps=10, dtype=dtype)
    return dict(cases=CASES, warmup=3, rounds=6, reps=5, dtype=dtype)


# ----------------------------------------------------------------------------------------
# The F.pad / torch.cat reference provider
# ----------------------------------------------------------------------------------------


class CatSlabs(torch.autograd.Function):
    """Join one-element slabs to both sides of ``dim``: a neighbour's edge (P2P), else ``fill`` (None: nothing).

    ``peers`` = (world rank of the lower neighbour or None, of the upper one or None).
    """

    @staticmethod
    def forward(ctx, x, dim: int, peers, fill):
        lo_peer, hi_peer = peers
        shape = list(x.shape)
        shape[dim] = 1
        sends, recvs, got = [], [], []
        for peer, edge in ((lo_peer, 0), (hi_peer, x.shape[dim] - 1)):
            if peer is not None:
                buf = x.new_empty(shape)
                sends.append((x.narrow(dim, edge, 1).contiguous(), peer))
                recvs.append((buf, peer))
                got.append(buf)
            elif fill is not None:  # the global boundary: the slab F.pad(value=fill) would add
                got.append(x.new_full(shape, fill))
            else:
                got.append(None)
        exchange(sends, recvs)
        parts = [t for t in (got[0], x, got[1]) if t is not None]
        ctx.dim, ctx.peers, ctx.n = dim, peers, x.shape[dim]
        ctx.lo = 1 if got[0] is not None else 0
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, g):
        dim, (lo_peer, hi_peer), n, lo = ctx.dim, ctx.peers, ctx.n, ctx.lo
        dx = g.narrow(dim, lo, n).contiguous()
        sends, recvs, adds = [], [], []
        if lo_peer is not None:
            buf = torch.empty_like(dx.narrow(dim, 0, 1))
            sends.append((g.narrow(dim, 0, 1).contiguous(), lo_peer))
            recvs.append((buf, lo_peer))
            adds.append((0, buf))
        if hi_peer is not None:
            buf = torch.empty_like(dx.narrow(dim, 0, 1))
            sends.append((g.narrow(dim, lo + n, 1).contiguous(), hi_peer))
            recvs.append((buf, hi_peer))
            adds.append((n - 1, buf))
        exchange(sends, recvs)
        for at, buf in adds:
            dx.narrow(dim, at, 1).add_(buf)
        return dx, None, None, None


class CatStaged:
    """The anchor: torch.cat / F.pad staging, then the torch op on the staged block (module docstring)."""

    def __init__(self, P_x, op: str):
        self.op, self.nd = op, P_x.dim - 2
        self.peers = []
        for a in range(2, P_x.dim):
            lo, hi = P_x.neighbors(a)
            self.peers.append((None if lo is None else P_x.ranks[lo], None if hi is None else P_x.ranks[hi]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "upsample_bilinear":
            staged = x
            for a in range(self.nd):
                staged = CatSlabs.apply(staged, 2 + a, self.peers[a], None)
            y = F.interpolate(staged, scale_factor=2.0, mode="bilinear", align_corners=False)
            for a, (lo, _) in enumerate(self.peers):  # outputs of the received slabs belong to the neighbours
                y = y.narrow(2 + a, 2 if lo is not None else 0, 2 * x.shape[2 + a])
            return y
        fill = -math.inf if self.op.startswith("max") else 0.0
        staged = x
        for a in range(self.nd):
            staged = CatSlabs.apply(staged, 2 + a, self.peers[a], fill)
        pool = {"max_pool2d": F.max_pool2d, "avg_pool2d": F.avg_pool2d, "max_pool3d": F.max_pool3d}[self.op]
        return pool(staged, 3, 2, 0)


# ----------------------------------------------------------------------------------------
# Per-rank work
# ----------------------------------------------------------------------------------------

def _layer(op: str, P_x, static: bool = False):
    from distfuse.layers.pool import DistributedAvgPool2d, DistributedMaxPool2d, DistributedMaxPool3d
    from distfuse.layers.upsample import DistributedUpsample

    if op == "upsample_bilinear":
        return DistributedUpsample(P_x, scale_factor=2.0, mode="bilinear", align_corners=False, static_shapes=static)
    return {"max_pool2d": DistributedMaxPool2d, "avg_pool2d": DistributedAvgPool2d,
            "max_pool3d": DistributedMaxPool3d}[op](P_x, 3, stride=2, padding=1, static_shapes=static)


class _Case:
    def __init__(self, op: str, shape: tuple, dtype: torch.dtype, device: torch.device, fused: bool):
        from distfuse.geometry.decomposition import local_shape

        W, r = dist.get_world_size(), dist.get_rank()
        nd = len(shape) - 2
        grid = grid_for(nd, W)
        if any(n % (2 * g) for n, g in zip(shape[2:], grid, strict=True)):
            raise ValueError(f"{op}: extents {shape[2:]} must be divisible by twice the grid {grid} (the anchor's "
                             "one-slab staging assumes even blocks)")
        P_x = partition_for(grid)
        self.op, self.dtype, self.nd = op, dtype, nd
        self.shape = dict(batch=shape[0], channels=shape[1], extent=list(shape[2:]), grid=list(grid))
        out_numel = math.prod(shape) * (2**nd if op == "upsample_bilinear" else 2**-nd)
        self.bytes = (math.prod(shape) + out_numel) * torch.finfo(dtype).bits // 8
        gen = torch.Generator().manual_seed(4321 + r)  # each rank's own block and output gradient
        block = local_shape(shape, P_x.shape, P_x.index)
        x = torch.randn(block, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
        layer, static, cat = _layer(op, P_x), _layer(op, P_x, static=True), CatStaged(P_x, op)
        with torch.no_grad():
            dy = torch.randn(cat(x).shape, generator=gen).to(device=device, dtype=dtype)
        self.providers = {ANCHOR: dict(fn=cat, x=x, dy=dy, path=None),
                          "distfuse": dict(fn=layer, x=x, dy=dy, path="unfused"),
                          "distfuse_static": dict(fn=static, x=x, dy=dy, path="unfused")}
        if fused:
            self.providers["distfuse_fused"] = dict(fn=layer, x=x, dy=dy, path="fused")

    @staticmethod
    def _call(p: dict, x: torch.Tensor):
        return p["fn"](x) if p["path"] is None else with_path(p["path"], lambda: p["fn"](x))

    def verify(self) -> dict:
        """Forward + backward once per provider; outputs and input gradients must match the anchor's."""
        got, paths = {}, {}
        for name, p in self.providers.items():
            p["x"].grad = None
            y = self._call(p, p["x"])
            y.backward(p["dy"])
            if p["path"] is not None:
                paths[name] = p["fn"].last_path
                if p["fn"].last_path != p["path"]:
                    raise RuntimeError(f"{name}: asked for the {p['path']} path, the layer ran {p['fn'].last_path}"
                                       f" ({p['fn'].last_decision})")
            got[name] = (y.detach().clone(), p["x"].grad.clone())
        want_y, want_g = got[ANCHOR]
        for name, (y, g) in got.items():
            check_agree(f"{self.op} {name}: output", y, want_y, self.dtype)
            check_agree(f"{self.op} {name}: input gradient", g, want_g, self.dtype)
        return paths

    def step(self, name: str, mode: str):
        p = self.providers[name]
        x, dy, call = p["x"], p["dy"], self._call
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return call(p, x)
            return run

        def run():
            x.grad = None
            call(p, x).backward(dy)
        return run


def bench_rank(cfg: dict) -> list:
    """Every case and mode on this rank; returns plain dicts (the same on every rank)."""
    from bench.harness import summarize, time_interleaved
    from distfuse.groups import metadata_group

    W = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = metadata_group()
    dtype = cfg["dtype"]
    rows = []
    for op, shape in cfg["cases"]:
        case = _Case(op, shape, dtype, device, fused=cuda)
        paths = case.verify()
        for mode in MODES:
            names = list(case.providers)
            times = time_interleaved({n: case.step(n, mode) for n in names}, warmup=cfg["warmup"],
                                     rounds=cfg["rounds"], reps=cfg["reps"], device=device, sync_group=sync)
            moved = case.bytes * (2 if mode == "full" else 1)
            for n in names:
                ms, q20, q80 = summarize(times[n])
                extra = dict(device=device.type, backend=dist.get_backend(), samples=len(times[n]))
                if n in paths:
                    extra["path"] = paths[n]
                if device.type == "cpu":
                    extra["timing"] = "CPU/gloo wall clock, 1 thread per rank; not a GPU result"
                    extra["cuda"] = NO_CUDA
                rows.append(dict(op=op, provider=n, mode=mode, shape=case.shape, dtype=str(dtype).split(".")[-1],
                                 world_size=W, ms=ms, ms_q20=q20, ms_q80=q80, rate=moved / (ms * 1e-3) / 1e9,
                                 rate_unit="GB/s", extra=extra))
        del case
    return rows


# ----------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------


def run(smoke: bool = False, world_size: int = 4, dtype: torch.dtype = torch.float32) -> list:
    """Rows of every case/provider/mode (ratios to ``cat`` set); see ``bench.harness.run_multirank``."""
    from bench.harness import run_multirank

    return run_multirank(bench_rank, _config, ANCHOR, smoke, world_size, dtype)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import multirank_main

    return multirank_main(NAME, __doc__.split("\n\n")[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
