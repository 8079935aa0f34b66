"""Benchmark: distfuse's tensor-parallel linear layers against PyTorch DTensor tensor parallelism.

What it measures, on ``W`` ranks, with the same global weights, inputs and dtype in every
provider (random data), for each shape ``x [B, S, H]``, intermediate size ``I``:

* ``mlp_seqpar``: the tensor-parallel MLP in the sequence-parallel layout,
  ``x [B, S/W, H] -> fc1 -> GELU -> fc2 -> y [B, S/W, H]``.
  - ``distfuse``  ``DistributedLinearAllGather(P_y=[1,1,W], H, I, P_x=[1,W,1])`` (all-gather the
                  sequence, column-parallel GEMM) then ``DistributedLinearReduceScatter(P_x=[1,1,W],
                  I, H, P_y=[1,W,1])`` (row-parallel GEMM, reduce-scatter the sequence); fc1 gets
                  ``seq_len=S``, which skips its per-call shape exchange (DTensor assumes even
                  shards and exchanges nothing either).
  - ``dtensor``   (anchor) ``nn.Linear`` x2 through ``parallelize_module`` with
                  ``ColwiseParallel(input_layouts=Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))``
                  on a 1-D ``DeviceMesh``.
* ``linear_ag_seqpar`` / ``linear_rs_seqpar``: each layer of that pair alone.
* ``mlp_feat``, ``linear_ag_feat``, ``linear_rs_feat``: the plain (non-sequence-parallel) form,
  activations split along the features: ``DistributedLinearAllGather(P_y=[1,1,W], H, I)`` (gathers
  ``x [B, S, H/W]`` along the features) and ``DistributedLinearReduceScatter(P_x=[1,1,W], I, H)``
  (reduce-scatters the output features), against ``ColwiseParallel(input_layouts=Shard(-1))`` /
  ``RowwiseParallel(output_layouts=Shard(-1))``: the same layouts, so the same communication.
  ``mlp_feat`` also has a ``dtensor_repl`` row: ``ColwiseParallel()`` / ``RowwiseParallel()``
  with their default layouts (replicated input, all-reduced replicated output).  It is not
  the same work (no input all-gather; an all-reduce instead of a reduce-scatter), so it is
  context, not the anchor; its ratio is against ``dtensor`` too.

Modes: ``full`` = forward + backward (input, weight and bias gradients; grads are reset to
None before each run) and ``fwd`` = forward under ``torch.no_grad()``.  Before timing, every
provider's output block, input gradient and weight-gradient blocks are checked against the
anchor's (allclose), so the providers do the same work.  ``ratio`` = provider / ``dtensor``
(lower is better for distfuse; target <= 1.0).  ``rate`` is the global GEMM rate (all ranks).

Timing: ``bench.harness.time_interleaved`` (providers alternate in rounds so a change of
load falls on all of them; each run's time is the slowest rank's); quantiles [0.5, 0.2, 0.8].

Where it runs:

* Plain ``python``: ``--world-size`` forked CPU ranks joined with gloo (``distfuse.testing.run_ranks``),
  one thread each.  These are CPU/gloo numbers: ratios between CPU providers only, never GPU claims.
* ``torchrun --nproc-per-node W``: NCCL on one GPU per rank (CUDA-event timing, L2 flushed), or
  gloo on CPU without GPUs.

    python bench/bench_linear_layers.py --world-size 4 2          # CPU/gloo, 4 then 2 self-spawned ranks
    python bench/bench_linear_layers.py --smoke --world-size 2    # tiny shapes, a few runs
    torchrun --nproc-per-node 8 bench/bench_linear_layers.py --dtype bfloat16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NAME = "linear_layers"
ANCHOR = "dtensor"
# (B, S, H); I = 4 H.  CPU: each run of the pair takes tens to a few hundred ms per rank.
SHAPES = [(4, 128, 256), (4, 512, 256), (4, 256, 512)]
GPU_SHAPES = [(4, 2048, 4096), (8, 4096, 4096), (4, 4096, 8192)]
SMOKE_SHAPES = [(2, 8, 8)]
OPS = ["mlp_seqpar", "linear_ag_seqpar", "linear_rs_seqpar", "mlp_feat", "linear_ag_feat", "linear_rs_feat"]
MODES = ["full", "fwd"]


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(shapes=SMOKE_SHAPES, warmup=1, rounds=1, reps=2, smoke=True, dtype=dtype)
    if cuda:
        return dict(shapes=GPU_SHAPES, warmup=10, rounds=6, reps=10, smoke=False, dtype=dtype)
    return dict(shapes=SHAPES, warmup=3, rounds=6, reps=5, smoke=False, dtype=dtype)


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 3e-2)


def _check(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise RuntimeError(f"{what}: shape {tuple(got.shape)} != anchor's {tuple(want.shape)}")
    rtol, atol = _tol(dtype)
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-3)
    if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol * scale):
        err = float((got.float() - want.float()).abs().max())
        raise RuntimeError(f"{what}: providers disagree (max abs diff {err:.3g}, anchor max {scale:.3g}); "
                           "the comparison would not be of equal work")


# ----------------------------------------------------------------------------------------
# Per-rank work (runs in every rank: forked gloo ranks, or torchrun processes)
# ----------------------------------------------------------------------------------------

_CACHE: dict = {}


def _partitions(W: int):
    if W not in _CACHE:
        from distfuse import Partition

        P = Partition.world().create_partition_inclusive(range(W))
        _CACHE[W] = (P.create_cartesian_topology_partition([1, 1, W]), P.create_cartesian_topology_partition([1, W, 1]))
    return _CACHE[W]


def _mesh(device: torch.device):
    key = ("mesh", device.type)
    if key not in _CACHE:
        from torch.distributed.device_mesh import init_device_mesh

        _CACHE[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _CACHE[key]


def _settle(t) -> None:
    """Wait for a DTensor collective still in flight behind ``t`` (a no-op for plain tensors).

    DTensor returns the results of its collectives as ``AsyncCollectiveTensor`` s, which
    are waited for only when an op reads them.  A benchmark that drops its output (or an
    input gradient) unread would stop the clock before the collective finished and leave
    the work registered for ever (on gloo: its buffers leak, ~10 MB per MLP call here).
    A real model reads them, so every run waits for them here.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t.wait()


def _block_shape(shape: tuple, dim: int, W: int) -> tuple:
    n = shape[dim]
    assert n % W == 0, f"extent {n} of dim {dim} must divide over {W} ranks (DTensor shards evenly)"
    return tuple(n // W if d == dim else e for d, e in enumerate(shape))


def _block(t: torch.Tensor, dim: int, r: int, W: int) -> torch.Tensor:
    n = _block_shape(tuple(t.shape), dim, W)[dim]
    return t.narrow(dim, r * n, n).contiguous()


class _Case:
    """One op on one shape: global tensors, the providers' callables, inputs and parameter lists."""

    def __init__(self, op: str, B: int, S: int, H: int, dtype: torch.dtype, device: torch.device):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from distfuse.layers import DistributedLinearAllGather, DistributedLinearReduceScatter, load_sequential

        self.op, self.dtype = op, dtype
        W, r = dist.get_world_size(), dist.get_rank()
        I = 4 * H  # noqa: E741 - the MLP papers' name for the intermediate size
        P_feat, P_seq = _partitions(W)
        seqpar = op.endswith("_seqpar")
        kind = op.split("_")[0] if op.startswith("mlp") else op.split("_")[1]  # mlp, ag, rs
        gen = torch.Generator().manual_seed(1234)

        def rnd(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

        W1, b1 = rnd(I, H, scale=H**-0.5), rnd(I, scale=0.1)
        W2, b2 = rnd(H, I, scale=I**-0.5), rnd(H, scale=0.1)
        n_in = I if kind == "rs" else H
        n_out = I if kind == "ag" else H
        # the input and output blocks: sequence-split (dim 1) or feature-split (dim -1) activations
        in_dim = 1 if (seqpar and kind != "rs") else 2
        out_dim = 1 if (seqpar and kind != "ag") else 2
        self.flops = 2 * B * S * H * I * (2 if kind == "mlp" else 1)
        self.shape = dict(batch=B, seq=S, hidden=H, inter=I)

        def lin(fin, fout, w, b):
            m = nn.Linear(fin, fout, device=device, dtype=dtype)
            with torch.no_grad():
                m.weight.copy_(w)
                m.bias.copy_(b)
            return m

        # ---------------- distfuse
        fc1 = fc2 = None
        if kind in ("mlp", "ag"):
            fc1 = DistributedLinearAllGather(P_feat, H, I, P_x=P_seq if seqpar else None, device=device, dtype=dtype)
            load_sequential(fc1, {"weight": W1, "bias": b1} if r == 0 else None)
        if kind in ("mlp", "rs"):
            fc2 = DistributedLinearReduceScatter(P_feat, I, H, P_y=P_seq if seqpar else None, device=device,
                                                 dtype=dtype)
            load_sequential(fc2, {"weight": W2, "bias": b2} if r == 0 else None)
        kw = dict(seq_len=S) if seqpar else {}
        if kind == "mlp":
            df = lambda x: fc2(F.gelu(fc1(x, **kw)))
        elif kind == "ag":
            df = lambda x: fc1(x, **kw)
        else:
            df = fc2
        self.df_layers = [m for m in (fc1, fc2) if m is not None]

        # ---------------- DTensor
        mesh = _mesh(device)
        sh = Shard(1) if seqpar else Shard(-1)
        if kind == "mlp":
            dt = nn.Sequential(lin(H, I, W1, b1), nn.GELU(), lin(I, H, W2, b2))
            parallelize_module(dt, mesh, {"0": ColwiseParallel(input_layouts=sh),
                                          "2": RowwiseParallel(output_layouts=sh)})
            dt_layers = [dt[0], dt[2]]
        elif kind == "ag":
            dt = parallelize_module(lin(H, I, W1, b1), mesh, ColwiseParallel(input_layouts=sh))
            dt_layers = [dt]
        else:
            dt = parallelize_module(lin(I, H, W2, b2), mesh, RowwiseParallel(output_layouts=sh))
            dt_layers = [dt]

        if op == "mlp_feat":  # the replicated-input provider needs the global tensors; the others their blocks
            xg, dyg = rnd(B, S, n_in), rnd(B, S, n_out)
            x, dy = _block(xg, in_dim, r, W), _block(dyg, out_dim, r, W)
        else:  # each rank draws only its own blocks (no global activations: GPU shapes are large)
            gen.manual_seed(1234 + 1 + r)
            x, dy = rnd(*_block_shape((B, S, n_in), in_dim, W)), rnd(*_block_shape((B, S, n_out), out_dim, W))
        x.requires_grad_(True)
        self.providers = {
            ANCHOR: dict(fn=dt, x=x, dy=dy, params=list(dt.parameters()), layers=dt_layers),
            "distfuse": dict(fn=df, x=x, dy=dy, params=[p for m in self.df_layers for p in m.parameters()],
                             layers=self.df_layers),
        }
        if op == "mlp_feat":  # DTensor's default layouts: replicated input, all-reduced replicated output
            dd = nn.Sequential(lin(H, I, W1, b1), nn.GELU(), lin(I, H, W2, b2))
            parallelize_module(dd, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            self.providers["dtensor_repl"] = dict(fn=dd, x=xg.clone().requires_grad_(True), dy=dyg,
                                                     params=list(dd.parameters()), layers=None, out_block=(2, r, W))

    # --------------------------------------------------------------------------------

    def _grads(self, p: dict) -> list[torch.Tensor]:
        """Input gradient and each layer's local weight-gradient block."""
        out = [p["x"].grad]
        for m in p["layers"]:
            g = m.weight.grad
            out.append(g.to_local() if hasattr(g, "to_local") else g)
        return out

    def verify(self) -> None:
        """Forward + backward once per provider; outputs and gradients must match the anchor's."""
        results = {}
        for name, p in self.providers.items():
            for t in p["params"] + [p["x"]]:
                t.grad = None
            y = p["fn"](p["x"])
            y.backward(p["dy"])
            for t in [y, p["x"].grad] + [t.grad for t in p["params"]]:
                _settle(t)
            if "out_block" in p:
                results[name] = (_block(y.detach(), *p["out_block"]), None)
            else:
                results[name] = (y.detach(), self._grads(p))
        want_y, want_g = results[ANCHOR]
        for name, (y, g) in results.items():
            _check(f"{self.op} {name}: output", y, want_y, self.dtype)
            if g is not None:
                for i, (a, b) in enumerate(zip(g, want_g, strict=True)):
                    _check(f"{self.op} {name}: {'input' if i == 0 else f'layer {i} weight'} gradient", a, b,
                           self.dtype)

    def step(self, name: str, mode: str):
        p = self.providers[name]
        fn, x, dy, params = p["fn"], p["x"], p["dy"], p["params"]
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    _settle(fn(x))
            return run

        def run():
            for t in params:
                t.grad = None
            x.grad = None
            y = fn(x)
            y.backward(dy)
            for t in [y, x.grad] + [t.grad for t in params]:
                _settle(t)
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
    """Every op, shape and mode on this rank; returns plain dicts (the same on every rank)."""
    from bench.harness import summarize, time_interleaved
    from distfuse.groups import metadata_group

    W = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = metadata_group()
    dtype = cfg["dtype"]
    rows = []
    for B, S, H in cfg["shapes"]:
        for op in OPS:
            case = _Case(op, B, S, H, dtype, device)
            case.verify()
            paths = [m.last_path for m in case.df_layers]
            for mode in MODES:
                names = list(case.providers)
                times = time_interleaved({n: case.step(n, mode) for n in names}, warmup=cfg["warmup"],
                                         rounds=cfg["rounds"], reps=cfg["reps"], device=device, sync_group=sync)
                flops = case.flops * (3 if mode == "full" else 1)
                for n in names:
                    ms, q20, q80 = summarize(times[n])
                    extra = dict(device=device.type, backend=dist.get_backend(), samples=len(times[n]),
                                 layout="sequence-split" if op.endswith("seqpar") else "feature-split")
                    if n == "distfuse":
                        extra.update(path=",".join(str(p) for p in paths), seq_len_given=op.endswith("seqpar"))
                    if n == "dtensor_repl":
                        extra["note"] = ("DTensor default layouts: replicated input, all-reduced output; "
                                         "different communication from distfuse's, context only")
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
    """Rows of every case/provider/mode (ratios to ``dtensor`` set); see ``bench.harness.run_multirank``."""
    from bench.harness import run_multirank

    return run_multirank(bench_rank, _config, ANCHOR, smoke, world_size, dtype)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import multirank_main

    return multirank_main(NAME, __doc__.split("\n\n")[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
