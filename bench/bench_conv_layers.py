"""Benchmark: distfuse's feature-distributed convolution against a torch.cat halo implementation of the same layer.

What it measures, on ``W`` ranks splitting the spatial axes (2-D: ``P_x = [1, 1, a, b]``
with ``a * b = W``; 3-D: ``[1, 1, 1, a, b]``), for a ``k x k (x k)`` convolution with
``padding = k // 2`` (zeros), stride 1, bias, ``C -> C`` channels, random data:

* ``distfuse``        ``DistributedFeatureConv2d/3d`` on the unfused path (``DISTFUSE_PATH=unfused``):
                      per call a host-side shape gather, one packed broadcast of weight and bias
                      from the root, ``HaloExchange`` (every neighbour, corners included, in one
                      round of P2P messages; the staged input written once) and the conv with
                      ``padding=0``; backward sends the halo gradients home and sum-reduces the
                      parameter gradients onto the root.
* ``distfuse_static`` the same layer built with ``static_shapes=True``: the shape gather runs only
                      when a worker's local shape changes (here: once).
* ``distfuse_fused``  the same layer on the fused path (``DISTFUSE_PATH=fused``: Triton staging and
                      exchange).  CUDA only: on CPU Triton runs interpreted and is not timed.
* ``cat``             (anchor) the PhysicsNeMo / DTensor-style layer, written here: weight and bias
                      replicated on every rank; for each spatial axis in turn, the edge slabs
                      of the (already partly padded) block go to the two neighbours with P2P
                      (``batch_isend_irecv``), the received halos (zeros at the global boundary)
                      are joined with ``torch.cat`` along that axis (so corners travel in the
                      later axes' slabs), then the conv with ``padding=0``.  Its backward splits
                      the gradient, sends the halo gradients back and adds the received ones into
                      the edges, axis by axis in reverse; the parameter gradients are then
                      all-reduced in one packed message (what DDP does for replicated weights).

Before timing, each provider's output block, input gradient and (on the root) weight and
bias gradients are checked against the anchor's (allclose), so the providers do the same
work.  Modes: ``full`` = forward + backward (parameter and input grads, reset to None before
each run), ``fwd`` = forward under ``torch.no_grad()``.  ``ratio`` = provider / ``cat``
(target <= 1.0); ``rate`` = the convolution's global FLOP rate (all ranks).

Timing: ``bench.harness.time_interleaved`` (providers alternate in rounds; each run's time is
the slowest rank's); quantiles [0.5, 0.2, 0.8].

Where it runs:

* Plain ``python``: ``--world-size`` forked CPU ranks joined with gloo, one thread each.
  These are CPU/gloo numbers: ratios between CPU providers only, never GPU claims.
* ``torchrun --nproc-per-node W``: NCCL, one GPU per rank, CUDA-event timing; adds the fused rows.

    python bench/bench_conv_layers.py --world-size 4
    python bench/bench_conv_layers.py --smoke --world-size 2
    torchrun --nproc-per-node 4 bench/bench_conv_layers.py --dtype bfloat16
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

NAME = "conv_layers"
ANCHOR = "cat"
# (global input shape [B, C, *n], kernel).  CPU: tens of ms per run per rank.
CASES = [((2, 16, 256, 256), 3), ((1, 64, 128, 128), 3), ((2, 8, 128, 128), 5), ((1, 8, 32, 32, 32), 3)]
GPU_CASES = [((4, 16, 1024, 1024), 3), ((4, 64, 1024, 1024), 3), ((4, 128, 512, 512), 3), ((1, 32, 256, 256, 256), 3)]
SMOKE_CASES = [((1, 4, 8, 8), 3), ((1, 2, 4, 6, 6), 3)]
MODES = ["full", "fwd"]
CONV = {2: F.conv2d, 3: F.conv3d}


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(cases=SMOKE_CASES, warmup=1, rounds=1, reps=2, dtype=dtype)
    if cuda:
        return dict(cases=GPU_CASES, warmup=10, rounds=6, reps=10, dtype=dtype)
    return dict(cases=CASES, warmup=3, rounds=6, reps=5, dtype=dtype)


# ----------------------------------------------------------------------------------------
# The torch.cat reference provider
# ----------------------------------------------------------------------------------------


class CatHalo(torch.autograd.Function):
    """Pad one spatial axis with the neighbours' edge slabs (zeros at the global boundary) by ``torch.cat``.

    ``peers`` = (world rank of the lower neighbour or None, of the upper one or None).
    """

    @staticmethod
    def forward(ctx, x, dim: int, h: int, peers):
        lo_peer, hi_peer = peers
        n = x.shape[dim]
        shape = list(x.shape)
        shape[dim] = h
        lo = torch.empty(shape, dtype=x.dtype, device=x.device) if lo_peer is not None else x.new_zeros(shape)
        hi = torch.empty(shape, dtype=x.dtype, device=x.device) if hi_peer is not None else x.new_zeros(shape)
        sends, recvs = [], []
        if lo_peer is not None:
            sends.append((x.narrow(dim, 0, h).contiguous(), lo_peer))
            recvs.append((lo, lo_peer))
        if hi_peer is not None:
            sends.append((x.narrow(dim, n - h, h).contiguous(), hi_peer))
            recvs.append((hi, hi_peer))
        exchange(sends, recvs)
        ctx.dim, ctx.h, ctx.peers, ctx.n = dim, h, peers, n
        return torch.cat([lo, x, hi], dim=dim)

    @staticmethod
    def backward(ctx, g):
        dim, h, (lo_peer, hi_peer), n = ctx.dim, ctx.h, ctx.peers, ctx.n
        dx = g.narrow(dim, h, n).contiguous()
        sends, recvs = [], []
        got_lo = got_hi = None
        if lo_peer is not None:
            got_lo = torch.empty_like(dx.narrow(dim, 0, h))
            sends.append((g.narrow(dim, 0, h).contiguous(), lo_peer))
            recvs.append((got_lo, lo_peer))
        if hi_peer is not None:
            got_hi = torch.empty_like(dx.narrow(dim, 0, h))
            sends.append((g.narrow(dim, h + n, h).contiguous(), hi_peer))
            recvs.append((got_hi, hi_peer))
        exchange(sends, recvs)
        if got_lo is not None:
            dx.narrow(dim, 0, h).add_(got_lo)
        if got_hi is not None:
            dx.narrow(dim, n - h, h).add_(got_hi)
        return dx, None, None, None


class CatHaloConv:
    """The feature-distributed conv (zeros padding ``k // 2``, stride 1, odd ``k``) in the torch.cat style."""

    def __init__(self, P_x, weight: torch.Tensor, bias: torch.Tensor, halo: int):
        self.nd = P_x.dim - 2
        self.h = halo
        self.weight = weight.detach().clone().requires_grad_(True)
        self.bias = bias.detach().clone().requires_grad_(True)
        self.peers = []
        for a in range(2, P_x.dim):
            lo, hi = P_x.neighbors(a)
            self.peers.append((None if lo is None else P_x.ranks[lo], None if hi is None else P_x.ranks[hi]))
        for a in range(self.nd):
            if P_x.shape[2 + a] > 1 and halo > 0:
                continue
            self.peers[a] = (None, None)

    def parameters(self) -> list[torch.Tensor]:
        return [self.weight, self.bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = x
        for a in range(self.nd):
            staged = CatHalo.apply(staged, 2 + a, self.h, self.peers[a])
        return CONV[self.nd](staged, self.weight, self.bias)

    def reduce_grads(self) -> None:
        """All-reduce the replicated parameters' gradients in one packed message (DDP-style)."""
        flat = torch.cat([self.weight.grad.reshape(-1), self.bias.grad])
        dist.all_reduce(flat)
        nw = self.weight.numel()
        self.weight.grad.copy_(flat[:nw].view_as(self.weight))
        self.bias.grad.copy_(flat[nw:])


# ----------------------------------------------------------------------------------------
# Per-rank work
# ----------------------------------------------------------------------------------------

class _Case:
    def __init__(self, shape: tuple, k: int, dtype: torch.dtype, device: torch.device, fused: bool):
        from distfuse.geometry.decomposition import local_shape
        from distfuse.layers import DistributedFeatureConv2d, DistributedFeatureConv3d, load_sequential

        W, r = dist.get_world_size(), dist.get_rank()
        nd = len(shape) - 2
        self.nd, self.dtype, self.root = nd, dtype, 0
        grid = grid_for(nd, W)
        P_x = partition_for(grid)
        B, C = shape[:2]
        self.shape = dict(batch=B, channels=C, extent=list(shape[2:]), kernel=k, grid=list(grid))
        self.flops = 2 * B * C * C * k**nd * math.prod(shape[2:])
        gen = torch.Generator().manual_seed(4321)

        def rnd(*s, scale=1.0):
            return (torch.randn(s, generator=gen) * scale).to(device=device, dtype=dtype)

        weight = rnd(C, C, *(k,) * nd, scale=(C * k**nd) ** -0.5)  # the same on every rank
        bias = rnd(C, scale=0.1)
        gen.manual_seed(4321 + 1 + r)  # each rank's own input block and output gradient (no global tensors)
        block = local_shape(shape, P_x.shape, P_x.index)
        x = rnd(*block).requires_grad_(True)
        dy = rnd(*block)

        layer = {2: DistributedFeatureConv2d, 3: DistributedFeatureConv3d}[nd](
            P_x, C, C, k, padding=k // 2, dtype=dtype, device=device)
        load_sequential(layer, {"weight": weight, "bias": bias} if r == 0 else None)
        self.layer = layer
        # The same layer with static_shapes=True: no per-call shape gather while local shapes repeat.
        static = {2: DistributedFeatureConv2d, 3: DistributedFeatureConv3d}[nd](
            P_x, C, C, k, padding=k // 2, dtype=dtype, device=device, static_shapes=True)
        load_sequential(static, {"weight": weight, "bias": bias} if r == 0 else None)
        cat = CatHaloConv(P_x, weight, bias, k // 2)
        self.cat = cat
        dparams = [p for p in (layer.weight, layer.bias) if p is not None]
        sparams = [p for p in (static.weight, static.bias) if p is not None]
        self.providers = {
            ANCHOR: dict(fn=cat, x=x, dy=dy, params=cat.parameters(), post=cat.reduce_grads, path=None),
            "distfuse": dict(fn=layer, x=x, dy=dy, params=dparams, post=None, path="unfused"),
            "distfuse_static": dict(fn=static, x=x, dy=dy, params=sparams, post=None, path="unfused"),
        }
        if fused:
            self.providers["distfuse_fused"] = dict(fn=layer, x=x, dy=dy, params=dparams, post=None, path="fused")

    def _call(self, p: dict, x: torch.Tensor):
        if p["path"] is None:
            return p["fn"](x)
        return with_path(p["path"], lambda: p["fn"](x))

    def verify(self) -> dict:
        """Forward + backward once per provider; outputs and gradients must match the anchor's."""
        got, paths = {}, {}
        for name, p in self.providers.items():
            for t in p["params"] + [p["x"]]:
                t.grad = None
            y = self._call(p, p["x"])
            y.backward(p["dy"])
            if p["post"] is not None:
                p["post"]()
            if p["path"] is not None:
                paths[name] = p["fn"].last_path
                if p["fn"].last_path != p["path"]:
                    raise RuntimeError(f"{name}: asked for the {p['path']} path, the layer ran {p['fn'].last_path}"
                                       f" ({p['fn'].last_decision})")
            grads = [p["x"].grad.clone()]
            if dist.get_rank() == self.root:
                grads += [t.grad.clone() for t in p["params"]]
            got[name] = (y.detach().clone(), grads)
        want_y, want_g = got[ANCHOR]
        for name, (y, g) in got.items():
            check_agree(f"{name}: output", y, want_y, self.dtype)
            for what, a, b in zip(("input", "weight", "bias")[:len(g)], g, want_g, strict=True):
                check_agree(f"{name}: {what} gradient", a, b, self.dtype)
        return paths

    def step(self, name: str, mode: str):
        p = self.providers[name]
        x, dy, params, post = p["x"], p["dy"], p["params"], p["post"]
        call = self._call
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return call(p, x)
            return run

        def run():
            for t in params:
                t.grad = None
            x.grad = None
            call(p, x).backward(dy)
            if post is not None:
                post()
        return run


def _peak_mb(step, device: torch.device) -> float | None:
    """Peak CUDA memory of one more run (MiB); None on CPU (no allocator statistics there)."""
    if device.type != "cuda":
        return None
    from bench.harness import track_peak_memory

    with track_peak_memory(device) as peak:
        step()
    return peak["mb"]


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
    for shape, k in cfg["cases"]:
        case = _Case(shape, k, dtype, device, fused=cuda)
        paths = case.verify()
        op = f"feature_conv{case.nd}d"
        for mode in MODES:
            names = list(case.providers)
            times = time_interleaved({n: case.step(n, mode) for n in names}, warmup=cfg["warmup"],
                                     rounds=cfg["rounds"], reps=cfg["reps"], device=device, sync_group=sync)
            flops = case.flops * (3 if mode == "full" else 1)
            for n in names:
                ms, q20, q80 = summarize(times[n])
                extra = dict(device=device.type, backend=dist.get_backend(), samples=len(times[n]),
                             padding_mode="zeros")
                if n in paths:
                    extra["path"] = paths[n]
                if device.type == "cpu":
                    extra["timing"] = "CPU/gloo wall clock, 1 thread per rank; not a GPU result"
                peak = _peak_mb(case.step(n, mode), device)
                rows.append(dict(op=op, provider=n, mode=mode, shape=case.shape, dtype=str(dtype).split(".")[-1],
                                 world_size=W, ms=ms, ms_q20=q20, ms_q80=q80, rate=flops / (ms * 1e-3) / 1e12,
                                 rate_unit="TFLOP/s", peak_mem_mb=peak, extra=extra))
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
