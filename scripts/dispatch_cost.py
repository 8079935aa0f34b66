"""Per-call cost of distfuse's ways to enter a communication core, on latency-bound calls.

Part 1 (one process, no communication, so that only the dispatch is timed): a tiny core
(``x.clone()`` forward, ``g.clone()`` as its "adjoint") entered

* ``direct``        the core called as a function (no autograd node);
* ``function``      through a ``torch.autograd.Function`` whose backward calls the adjoint core
                    (the eager primitives' way before their op pairs);
* ``custom_op``     through a ``torch.library.custom_op`` with ``register_autograd`` (the backward
                    calls the adjoint op) and the ``ORDERED`` effect registration (``distfuse/ops``);
* ``custom_op_noeffect``  the same op without the effect registration (what the effect costs);
* ``opoverload``    the same op entered through its ``OpOverload`` (``torch.ops.ns.op.default``),
                    skipping the ``CustomOpDef`` wrapper;
* ``entry``         the same core defined once with ``distfuse.primitives._op_pair.op_pair`` and
                    called through its entry (what the layers call): the custom op while
                    compiling, the generated ``autograd.Function`` or the core itself in eager.

with the argument list of ``distfuse::halo_exchange`` (a tensor, an int handle, a list of
ints), for ``fwd`` (grad mode off), ``fwd_grad`` (an input that requires grad; the graph is
built) and ``full`` (forward + backward).  Median of ``--reps`` runs of ``--calls`` calls.

Part 2 (``--layer``, forked gloo ranks): a real max pool (3/2/1) and bilinear upsampling,
forward (no grad) and forward + backward, per call: ``--reps`` blocks of ``--calls``
back-to-back calls, each block's mean on the slowest rank; median and best block.  With
``--world-size 1`` nothing is sent (the flag round and the halo plan are local), so the
layer's own Python and dispatch overhead is what is timed; with 2 or 4 ranks, communication
too.  ``--through-op`` alternates each block with the staging entries forced onto their
custom ops (the design this script argued against), in the same processes.

    .venv/bin/python scripts/dispatch_cost.py
    .venv/bin/python scripts/dispatch_cost.py --layer --world-size 4 --reps 15 --calls 40
    .venv/bin/python scripts/dispatch_cost.py --layer --world-size 1 --reps 15 --calls 200
    .venv/bin/python scripts/dispatch_cost.py --layer --world-size 2 --reps 15 --calls 100 --through-op
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LIB = "distfuse_bench"


def _core(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class _CoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, shape):
        ctx.handle, ctx.shape = handle, shape
        return _core(x)

    @staticmethod
    def backward(ctx, g):
        return _core(g), None, None


def _core_op(name: str):
    """A custom op running the core, with a fake implementation (no autograd yet)."""

    def core(x: torch.Tensor, handle: int, shape: list[int]) -> torch.Tensor:
        return _core(x)

    op = torch.library.custom_op(f"{LIB}::{name}", core, mutates_args=())
    op.register_fake(lambda x, handle, shape: torch.empty_like(x))
    return op


def _make_ops(effect: bool, name: str):
    """The forward op with ``register_autograd`` (backward: the adjoint op), and the ORDERED effect if asked."""
    op, adjoint = _core_op(name), _core_op(f"{name}_adjoint")

    def setup(ctx, inputs, output):
        ctx.handle, ctx.shape = inputs[1], inputs[2]

    def backward(ctx, g):
        return adjoint(g, ctx.handle, ctx.shape), None, None

    op.register_autograd(backward, setup_context=setup)
    if effect:
        for o in (op, adjoint):
            torch.library._register_effectful_op(o._qualname, torch.library.EffectType.ORDERED)
    return op


def _time_interleaved(cases: dict, calls: int, reps: int) -> dict:
    """Median microseconds per call of each case; the cases alternate within each rep (a loaded machine
    slows all of them alike)."""
    for fn in cases.values():
        for _ in range(200):
            fn()
    per = {k: [] for k in cases}
    for _ in range(reps):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in per.items()}


def dispatch_table(calls: int, reps: int, numel: int) -> list[tuple[str, str, float]]:
    op = _make_ops(True, "core")
    op_noeffect = _make_ops(False, "core_noeffect")
    overload = torch.ops.distfuse_bench.core.default
    from distfuse.primitives._op_pair import op_pair

    def core(x: torch.Tensor, handle: int, shape: list[int]) -> torch.Tensor:
        return _core(x)

    def fake(x, handle, shape):
        return torch.empty_like(x)

    entry, _ = op_pair("dispatch_cost_core", core, fake, core, fake, adjoint_args=lambda x, h, s: (h, s),
                       forward_args=lambda g, h, s: (h, s))
    ways = {"direct": lambda x: _core(x), "function": lambda x: _CoreFunction.apply(x, 7, [1, 2, 3, 4]),
            "custom_op": lambda x: op(x, 7, [1, 2, 3, 4]),
            "custom_op_noeffect": lambda x: op_noeffect(x, 7, [1, 2, 3, 4]),
            "opoverload": lambda x: overload(x, 7, [1, 2, 3, 4]), "entry": lambda x: entry(x, 7, [1, 2, 3, 4])}
    x0 = torch.randn(numel)
    xg = torch.randn(numel, requires_grad=True)
    g = torch.ones(numel)

    def nograd(w):
        def f():
            with torch.no_grad():
                w(x0)
        return f

    rows = []
    for mode, make in (("fwd", nograd), ("fwd_grad", lambda w: (lambda: w(xg))),
                       ("full", lambda w: (lambda: w(xg).backward(g)))):
        res = _time_interleaved({name: make(way) for name, way in ways.items()}, calls, reps)
        rows += [(name, mode, us) for name, us in res.items()]
    return rows


# ---------------------------------------------------------------- part 2: a real layer on gloo ranks


def _layer_latency(shape, grid, blocks: int, per_block: int, kind: str, through_op: bool) -> dict:
    """Per-call microseconds of one layer: ``blocks`` blocks of ``per_block`` back-to-back calls (a barrier
    between blocks only), each block's mean per call taken on the slowest rank; median and best block.

    ``through_op``: every block is also run with the staging entries forced onto their custom ops (what
    eager calls would pay if they dispatched through ``torch.library``), alternating with the entry."""
    import torch.distributed as dist

    from distfuse import Partition
    from distfuse.geometry.decomposition import local_slices
    from distfuse.layers.pool import DistributedMaxPool2d
    from distfuse.layers.upsample import DistributedUpsample

    P = Partition.world().create_partition_inclusive(range(dist.get_world_size())) \
        .create_cartesian_topology_partition(list(grid))
    layer = DistributedMaxPool2d(P, 3, stride=2, padding=1) if kind == "maxpool" else \
        DistributedUpsample(P, scale_factor=2, mode="bilinear")
    xg = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = xg[local_slices(shape, P.shape, P.index)].contiguous()
    xr = x.clone().requires_grad_(True)
    variants = {"entry": None}
    if through_op:
        from distfuse.primitives._op_pair import OpEntry

        variants["custom_op"] = lambda self, t, *args: self.op(t, *args)

    def fwd():
        with torch.no_grad():
            layer(x)

    def full():
        layer(xr).sum().backward()

    out = {}
    for mode, fn in (("fwd", fwd), ("full", full)):
        per = {v: [] for v in variants}
        for _ in range(blocks):
            for v, call in variants.items():
                saved = OpEntry.__call__ if call is not None else None
                if call is not None:
                    OpEntry.__call__ = call
                try:
                    for _ in range(3):
                        fn()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(per_block):
                        fn()
                    t = torch.tensor([(time.perf_counter() - t0) / per_block])
                finally:
                    if saved is not None:
                        OpEntry.__call__ = saved
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                per[v].append(float(t) * 1e6)
        for v, times in per.items():
            out[(mode, v)] = (statistics.median(times), min(times))
    out["path"] = layer.last_path
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--layer", action="store_true", help="part 2: a pooling layer on forked gloo ranks")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--through-op", action="store_true",
                    help="part 2: also time the layers with the staging forced through the custom ops")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.numel} elements, median of {args.reps} x {args.calls} calls")
    if not args.layer:
        print(f"{'way':<20}{'mode':<10}{'us/call':>9}")
        for name, mode, us in dispatch_table(args.calls, args.reps, args.numel):
            print(f"{name:<20}{mode:<10}{us:9.2f}")
        return 0
    from distfuse.testing import run_ranks, shutdown_pools

    W = args.world_size
    grid = (1, 1, 2, W // 2) if W > 2 else (1, 1, 1, W)
    try:
        for kind in ("maxpool", "upsample"):
            for shape in ((1, 2, 8, 8), (2, 8, 64, 64)):
                r = run_ranks(W, _layer_latency, shape, grid, args.reps, args.calls, kind, args.through_op,
                              timeout=900)[0]
                for v in ("entry", "custom_op") if args.through_op else ("entry",):
                    print(f"{kind:<9}{str(shape):<16} {v:<10} fwd {r[('fwd', v)][0]:8.1f} (best "
                          f"{r[('fwd', v)][1]:8.1f}) us   fwd+bwd {r[('full', v)][0]:8.1f} (best "
                          f"{r[('full', v)][1]:8.1f}) us   W={W} path {r['path']}")
    finally:
        shutdown_pools()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
