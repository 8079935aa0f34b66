"""torch.compile(fullgraph=True) of the sequence-parallel linears: no graph break, eager's results.

A sequence-parallel MLP block, ``DistributedLinearAllGather(P_feat, P_x=P_seq)`` (all-gather
the sequence, column-parallel GEMM), GELU, ``DistributedLinearReduceScatter(P_feat,
P_y=P_seq)`` (row-parallel GEMM, reduce-scatter the sequence), is compiled whole.  The
collectives run as ``distfuse::all_gather`` / ``distfuse::all_gather_adjoint`` (the
reduce-scatter), each with the agreement flag, and the parameter broadcasts along the
data-parallel dimension as ``distfuse::broadcast``; the metadata agreement comes from one
eager call.

Checked on gloo ranks (``backend="aot_eager"``): zero graph breaks and one graph on every
rank, the same communication ops in the same order on every rank, the compiled forward
and every gradient bitwise equal to eager and close to the float64 reference on the
gathered tensors (uneven sequence split, permuted ranks, data-parallel broadcast, inactive
ranks in a world of 6, bf16), and a changed sequence length raising the same error on
every rank.

``DistributedLinear`` (input broadcast down the columns of ``P_w``, local GEMM, sum-reduce
along its rows; ``distfuse::broadcast`` / ``distfuse::broadcast_adjoint`` behind one
``distfuse::flag_check``) is compiled alone on a ``[2, 2]`` weight grid with ``P_x`` and
``P_y`` on other, permuted ranks (workers that hold no input, an inactive rank), unfused
in fp32 and fused (``matmul_all_reduce``) in bf16: the same checks, and a new row count
on every input worker raising the same error on every worker.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition
from distfuse.errors import ShapeError
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter
from distfuse.layers._params import collect_sequential
from distfuse.partition import zero_volume_tensor
from distfuse.primitives.distribute import collect_tensor
from tests.test_compile_conv import _comm_ops, _recording_backend
from tests.test_conv_support import close

H, HIDDEN = 6, 10


class _Block(torch.nn.Module):
    def __init__(self, P_feat, P_seq, dtype):
        super().__init__()
        self.ag = DistributedLinearAllGather(P_feat, H, HIDDEN, P_x=P_seq, dtype=dtype)
        self.rs = DistributedLinearReduceScatter(P_feat, HIDDEN, H, P_y=P_seq, dtype=dtype)

    def forward(self, x):
        return self.rs(F.gelu(self.ag(x)))


def _mlp_case(ranks, P_d, P_m, n, dtype):
    torch._dynamo.reset()
    base = Partition.world().create_partition_inclusive(list(ranks))
    P_feat = base.create_cartesian_topology_partition([P_d, 1, P_m])
    P_seq = base.create_cartesian_topology_partition([P_d, P_m, 1])
    torch.manual_seed(3)
    block = _Block(P_feat, P_seq, dtype)
    gen = torch.Generator().manual_seed(7)
    xg = torch.randn(2 * P_d, n, H, generator=gen, dtype=torch.float64).to(dtype).double()
    dyg = torch.randn(2 * P_d, n, H, generator=gen, dtype=torch.float64).to(dtype).double()
    active = P_seq.active
    sl = local_slices(xg.shape, P_seq.shape, P_seq.index) if active else None

    def step(fn, xs=xg, dys=dyg):
        x = xs[local_slices(xs.shape, P_seq.shape, P_seq.index)].to(dtype).requires_grad_(True) if active else \
            zero_volume_tensor(dtype=dtype)
        y = fn(x)
        if active:
            y.backward(dys[local_slices(dys.shape, P_seq.shape, P_seq.index)].to(dtype))
        grads = {k: (None if p.grad is None else p.grad.clone()) for k, p in block.named_parameters()}
        block.zero_grad(set_to_none=True)
        return y.detach(), (x.grad if active else None), grads

    eager = step(block)
    explained = torch._dynamo.explain(block)(xg[sl].to(dtype) if active else zero_volume_tensor(dtype=dtype))
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend=_recording_backend(graphs))
    t0 = time.perf_counter()
    comp = step(compiled)
    first_call = time.perf_counter() - t0
    bitwise = active and torch.equal(comp[0], eager[0]) and torch.equal(comp[1], eager[1]) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(comp[2].values(), eager[2].values(),
                                                                       strict=True))
    # the float64 reference from the distributed layers' own weights, on the gathered tensors
    y_full = collect_tensor(comp[0] if active else None, P_seq)
    dx_full = collect_tensor(comp[1] if active else None, P_seq)
    seq = {f"ag.{k}": v for k, v in (collect_sequential(block.ag) or {}).items()}
    seq.update({f"rs.{k}": v for k, v in (collect_sequential(block.rs) or {}).items()})
    grads = {}
    for name, layer in (("ag", block.ag), ("rs", block.rs)):
        for lay in layer.param_layouts():
            local = comp[2].get(f"{name}.{lay.name}") if lay.P.active else None
            grads[f"{name}.{lay.seq_name}"] = collect_tensor(local, lay.P)
    if dist.get_rank() == 0:
        params = {k: v.double().requires_grad_(True) for k, v in seq.items()}
        x = xg.clone().requires_grad_(True)
        y = F.linear(F.gelu(F.linear(x, params["ag.weight"], params["ag.bias"])), params["rs.weight"],
                     params["rs.bias"])
        y.backward(dyg)
        close("compiled output", y_full, y.detach(), dtype)
        close("compiled input gradient", dx_full, x.grad, dtype)
        for k, p in params.items():
            close(f"compiled {k} gradient", grads[k], p.grad, dtype)
    return dict(breaks=explained.graph_break_count, reasons=[str(r.reason)[:300] for r in explained.break_reasons],
                graphs=explained.graph_count, bitwise=bitwise, ops=_comm_ops(graphs), active=active,
                first_call=first_call, path=block.ag.last_path, reason=block.ag.last_decision.reason)


@pytest.mark.parametrize("world,ranks,P_d,P_m,n,dtype", [
    pytest.param(4, (2, 0, 3, 1), 2, 2, 5, torch.float32, id="2x2-uneven-permuted"),
    pytest.param(6, (4, 1, 5), 1, 3, 7, torch.bfloat16, id="1x3-inactive-bf16-world6"),
])
def test_compiled_sequence_parallel_mlp(world, ranks, P_d, P_m, n, dtype):
    from distfuse.testing import run_ranks

    results = run_ranks(world, _mlp_case, ranks, P_d, P_m, n, dtype)
    active = [r for r in results if r["active"]]
    for rank, r in enumerate(results):
        if r["active"]:
            assert r["breaks"] == 0, f"rank {rank}: {r['breaks']} graph breaks: {r['reasons']}"
            assert r["graphs"] == 1, f"rank {rank}: {r['graphs']} graphs"
            assert r["bitwise"], f"rank {rank}: compiled results differ from eager"
            assert r["path"] == "unfused" and "torch.compile" in r["reason"]
    assert len({tuple(r["ops"]) for r in active}) == 1, [r["ops"] for r in active]
    for op in ("distfuse.all_gather.default", "distfuse.all_gather_adjoint.default"):  # each carrying its flag
        assert any(o == op for o in active[0]["ops"]), active[0]["ops"]
    if P_d > 1:
        assert any(o == "distfuse.broadcast.default" for o in active[0]["ops"]), active[0]["ops"]


def _length_change():
    torch._dynamo.reset()
    base = Partition.world().create_partition_inclusive([1, 3, 0, 2])
    P_feat = base.create_cartesian_topology_partition([1, 1, 4])
    P_seq = base.create_cartesian_topology_partition([1, 4, 1])
    block = _Block(P_feat, P_seq, torch.float32)
    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend="eager")

    def x_of(n):
        g = torch.randn(2, n, H, generator=torch.Generator().manual_seed(n))
        return g[local_slices(g.shape, P_seq.shape, P_seq.index)]

    block(x_of(6))
    compiled(x_of(6))
    try:  # 6 -> 7 rows over 4 workers: blocks 2,2,1,1 -> 2,2,2,1, so only one worker's input changes
        compiled(x_of(7))
        error = None
    except ShapeError as exc:
        error = str(exc)
    same = torch.equal(block(x_of(7)), compiled(x_of(7)))  # agreed again eagerly: compiled runs the new length
    return error, same


def test_sequence_length_change_under_compile_raises_on_every_rank():
    from distfuse.testing import run_ranks

    for error, same in run_ranks(4, _length_change, timeout=240):
        assert error is not None and "eagerly" in error, error
        assert same


# ---------------------------------------------------------------- DistributedLinear (input broadcast, GEMM, sum-reduce)

IN, OUT = 7, 5


def _general_case(world_ranks, x_ranks, y_ranks, dtype, path):
    """P_w [2, 2] over ``world_ranks``, P_x / P_y [1, 1, 2]; eager under ``path``, then compiled (aot_eager)."""
    from tests.test_compile_linear_fused import _recording, _with_path

    torch._dynamo.reset()
    world = Partition.world()
    P_w = world.create_partition_inclusive(list(world_ranks)).create_cartesian_topology_partition([2, 2])
    P_x = world.create_partition_inclusive(list(x_ranks)).create_cartesian_topology_partition([1, 1, 2])
    P_y = world.create_partition_inclusive(list(y_ranks)).create_cartesian_topology_partition([1, 1, 2])
    torch.manual_seed(4)
    layer = DistributedLinear(P_x, P_y, P_w, IN, OUT, dtype=dtype)
    gen = torch.Generator().manual_seed(9)
    xg = torch.randn(2, 3, IN, generator=gen, dtype=torch.float64).to(dtype).double()
    dyg = torch.randn(2, 3, OUT, generator=gen, dtype=torch.float64).to(dtype).double()

    def block(g, P, requires_grad=False):
        if not P.active:
            return zero_volume_tensor(dtype=dtype, requires_grad=requires_grad)
        return g[local_slices(g.shape, P.shape, P.index)].to(dtype).requires_grad_(requires_grad)

    def step(fn, xs=xg):
        x = block(xs, P_x, requires_grad=True)
        y = fn(x)
        y.backward(block(dyg, P_y) if P_y.active else torch.zeros_like(y))
        grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
        layer.zero_grad(set_to_none=True)
        return y.detach(), x.grad, grads

    try:  # no eager call yet: refused on every worker, before anything is sent
        torch.compile(layer, fullgraph=True, dynamic=False, backend="eager")(block(xg, P_x))
        refused = None
    except Exception as exc:  # dynamo may wrap the error raised while tracing
        refused = f"{type(exc.__cause__ or exc).__name__}: {exc.__cause__ or exc}"
    torch._dynamo.reset()
    eager = _with_path(path, lambda: step(layer))
    eager_path = layer.last_path
    ops = []
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend=_recording(ops))
    t0 = time.perf_counter()
    comp = step(compiled)
    first_call = time.perf_counter() - t0
    first_ops = list(ops)  # the graphs of the first compiled call (the changed calls below recompile)
    same_tensor = lambda a, b: (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    bitwise = all(same_tensor(a, b) for a, b in zip(comp[:2], eager[:2], strict=True)) and \
        comp[2].keys() == eager[2].keys() and all(torch.equal(comp[2][k], eager[2][k]) for k in eager[2])
    y_full = collect_tensor(comp[0] if P_y.active else None, P_y)
    dx_full = collect_tensor(comp[1] if P_x.active else None, P_x)
    seq = collect_sequential(layer)
    grads = {lay.seq_name: collect_tensor(comp[2].get(lay.name) if lay.P.active else None, lay.P)
             for lay in layer.param_layouts()}
    if dist.get_rank() == 0:
        params = {k: v.double().requires_grad_(True) for k, v in seq.items()}
        x = xg.clone().requires_grad_(True)
        y = F.linear(x, params["weight"], params["bias"])
        y.backward(dyg)
        close("compiled output", y_full, y.detach(), dtype)
        close("compiled input gradient", dx_full, x.grad, dtype)
        for k, p in params.items():
            close(f"compiled {k} gradient", grads[k], p.grad, dtype)
    # Every worker of P_x changes its rows: the compiled call raises on every worker, one eager call agrees again.
    x5 = torch.randn(5, 3, IN, generator=gen, dtype=torch.float64)
    try:
        compiled(block(x5, P_x))
        error = None
    except ShapeError as exc:
        error = str(exc)
    again = _with_path(path, lambda: layer(block(x5, P_x)))
    same = torch.equal(again, compiled(block(x5, P_x)))
    return dict(active=layer.P_all.active, in_w=P_w.active, refused=refused, eager_path=eager_path,
                path=layer.last_path, reason=layer.last_decision.reason, bitwise=bitwise, ops=first_ops,
                first_call=first_call, error=error, same=same)


@pytest.mark.parametrize("world,world_ranks,x_ranks,y_ranks,dtype,path", [
    pytest.param(5, (3, 1, 0, 2), (2, 3), (1, 0), torch.float32, "unfused", id="2x2-permuted-inactive-unfused"),
    pytest.param(4, (1, 3, 2, 0), (1, 2), (3, 0), torch.bfloat16, "fused", id="2x2-permuted-bf16-fused"),
    # P_y's workers in each other's rows: each row's keeper copies its sum across (the deliver broadcast)
    pytest.param(4, (1, 3, 2, 0), (1, 2), (2, 3), torch.float32, "fused", id="2x2-deliver-across-rows-fused"),
])
def test_compiled_general_linear(world, world_ranks, x_ranks, y_ranks, dtype, path):
    from distfuse.testing import run_ranks

    results = run_ranks(world, _general_case, world_ranks, x_ranks, y_ranks, dtype, path, timeout=400)
    active = [r for r in results if r["active"]]
    assert len(active) == len(set(world_ranks) | set(x_ranks) | set(y_ranks))
    for rank, r in enumerate(results):
        assert r["bitwise"], f"rank {rank}: compiled results differ from eager"
        assert r["error"] is None if not r["active"] else "eagerly" in r["error"], (rank, r["error"])
        assert r["same"], rank
        assert r["refused"] is None if not r["active"] else "UnsupportedError" in r["refused"] and \
            "once eagerly" in r["refused"], (rank, r["refused"])
        if r["in_w"]:
            assert r["eager_path"] == path and r["path"] == path and "torch.compile" in r["reason"], r
    comm = [[o for o in r["ops"] if "distfuse.broadcast" in o or "flag_check" in o] for r in active]
    assert len({tuple(c) for c in comm}) == 1, comm
    # the input broadcast (distfuse::broadcast) and, backward, its adjoint (the sum onto the sources)
    wanted = ["fw:distfuse.flag_check", "fw:distfuse.broadcast.default", "bw:distfuse.broadcast_adjoint.default"]
    if path == "unfused":  # the fused path keeps each row's sum on the row: P_y worker i is one of its workers
        # the sum-reduce along the rows (distfuse::broadcast_adjoint) and, backward, its adjoint (the broadcast)
        wanted += ["fw:distfuse.broadcast_adjoint.default", "bw:distfuse.broadcast.default"]
    for want in wanted:
        assert any(want in o for o in comm[0]), (want, comm[0])
    fused_ops = [tuple(o for o in r["ops"] if "matmul_all_reduce" in o) for r in active if r["in_w"]]
    assert all(f == (("fw:distfuse.matmul_all_reduce.default", "bw:distfuse.matmul_all_reduce_backward.default")
                     if path == "fused" else ()) for f in fused_ops), fused_ops
    print(f"DistributedLinear {path}: first compiled call {max(r['first_call'] for r in active):.1f} s")
