"""Numerics: NaN and Inf propagate unmasked, results are bitwise reproducible, and where bitwise parity holds.

* **NaN/Inf.**  NaN, +Inf and -Inf placed in some ranks' blocks come out exactly where
  the sequential computation on the global tensor has them: bit for bit through the
  data-movement primitives (Repartition, AllGather, Broadcast, HaloExchange staging in
  three padding modes), and with the same NaN / +Inf / -Inf masks through the
  reductions (ReduceScatter, AllSumReduce, SumReduce) and the layers (feature
  convolution on both paths, the linear family), forward and backward.
* **Determinism.**  The same inputs give bitwise the same outputs and gradients twice in
  one process and once more in freshly started processes.
* **Parity with the sequential layer.**  Bitwise for pure data movement (asserted above,
  NaN payloads included) and for a sum over two workers (IEEE addition commutes);
  elsewhere within ``tests/tolerances.py``.  docs/reliability.md records the measured
  fraction of bitwise-equal elements where parity is not bitwise (reductions in another
  order: weight gradients summed over workers, reduce-scatter sums over 3+ ranks, halo
  gradient accumulation, GEMM blocking).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.kernels._utils import INTERPRET
from distfuse.layers import (
    DistributedLinear,
    DistributedLinearAllGather,
    DistributedLinearReduceScatter,
    load_sequential,
)
from distfuse.primitives import (
    AllGather,
    AllSumReduce,
    Broadcast,
    HaloExchange,
    ReduceScatter,
    Repartition,
    SumReduce,
    collect_tensor,
)
from distfuse.testing import run_ranks
from distfuse.testing.pool import discard_pool
from distfuse.testing.tolerance import STORE_ROUNDINGS
from tests.test_conv_support import Case, build, sequential, sum_terms
from tests.tolerances import rounding_bound

WORLD = 4
# The ranks' fused kernels run on CPU tensors, which needs the Triton interpreter (conftest sets it without CUDA).
interpreted = pytest.mark.skipif(not INTERPRET, reason="fused kernels on CPU tensors need TRITON_INTERPRET=1")
_GRIDS: dict = {}


def _grid(ranks, shape):
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


def _block(g, P):
    return g[local_slices(g.shape, P.shape, P.index)].clone() if P.active else zero_volume_tensor(dtype=g.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bits everywhere (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def same_specials(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN, +Inf and -Inf in exactly the same places."""
    return a.shape == b.shape and all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


def _specials(t: torch.Tensor, where: dict) -> torch.Tensor:
    """Write NaN / +Inf / -Inf at the given global positions."""
    t = t.clone()
    for pos, v in where.items():
        t[pos] = v
    return t


NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- NaN / Inf through the primitives


def _primitives_nan_inf():
    me = dist.get_rank()
    P = _grid(range(4), (2, 2))
    P_y = _grid((3, 1, 0, 2), (1, 4))  # another grid on reordered ranks
    gen = torch.Generator().manual_seed(11)
    G = (6, 7)
    # One special value in each rank's block of P: NaN (rank 0), NaN (rank 1), -Inf (rank 2), +Inf (rank 3).
    g = _specials(torch.randn(G, generator=gen, dtype=torch.float64),
                  {(1, 1): NAN, (0, 6): NAN, (5, 0): -INF, (4, 5): INF})
    x = _block(g, P)
    out = {}
    # Data movement: bit for bit.
    out["Repartition"] = bitwise_equal(Repartition(P, P_y)(x), _block(g, P_y))
    sl = local_slices(G, P.shape, P.index)
    out["AllGather"] = bitwise_equal(AllGather(P, axes_all_gather=(1,))(x), g[sl[0], :])
    root = _grid((2,), (1, 1))
    y = Broadcast(root, P)(g if me == 2 else zero_volume_tensor(dtype=g.dtype))
    out["Broadcast"] = bitwise_equal(y, g)
    P_s = _grid(range(4), (1, 1, 2, 2))
    g4 = g.view(1, 1, *G)
    for mode in ("zeros", "reflect", "circular"):
        halo = HaloExchange(P_s, kernel_size=(3, 3), padding=1, padding_mode=mode)
        staged = halo(_block(g4, P_s))
        gp = F.pad(g4, (1, 1, 1, 1)) if mode == "zeros" else F.pad(g4, (1, 1, 1, 1), mode=mode)
        plan = halo.plan(g4.shape)
        need = [ax.needed_range(i) for ax, i in zip(plan.axes, P_s.index[2:])]
        out[f"HaloExchange-{mode}"] = bitwise_equal(staged, gp[(..., *(slice(a + 1, b + 1) for a, b in need))])
    # Reductions: every rank holds its own tensor; specials on some ranks, +Inf meeting -Inf on two (NaN).
    full = [torch.randn(G, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64) for r in range(4)]
    full[1] = _specials(full[1], {(2, 3): NAN})
    full[2] = _specials(full[2], {(0, 0): INF, (3, 3): -INF})
    full[3] = _specials(full[3], {(0, 0): -INF, (5, 6): INF})
    total = torch.stack(full).sum(0)
    z = ReduceScatter(P, axes_reduce_scatter=(0, 1))(full[me])
    out["ReduceScatter"] = same_specials(z, total[sl])
    out["AllSumReduce"] = same_specials(AllSumReduce(P, axes_reduce=(0, 1))(full[me]), total)
    # SumReduce from P (2 x 2) onto ranks (0, 1) as a 1 x 2 grid: each P_y worker sums its column's two blocks.
    P_c = _grid((0, 1), (1, 2))
    mine = full[me][:3, :4]  # one [3, 4] block per worker
    s = SumReduce(P, P_c)(mine)
    if P_c.active:
        col = [r for r in range(4) if P.index_of(r)[1] == P_c.index[1]]
        out["SumReduce"] = same_specials(s, sum(full[r][:3, :4] for r in col))
    for name, ok in out.items():
        assert ok, f"rank {me}: {name}: NaN/Inf not where the sequential computation has them"
    return sorted(out)


def test_nan_and_inf_propagate_through_every_primitive():
    out = run_ranks(WORLD, _primitives_nan_inf)
    assert "SumReduce" in out[0] and "SumReduce" in out[1]  # the P_y workers checked the sum
    assert all({"Repartition", "AllGather", "Broadcast", "HaloExchange-reflect", "ReduceScatter",
                "AllSumReduce"} <= set(o) for o in out)


# ---------------------------------------------------------------- NaN / Inf through the layers


def _conv_specials(case: Case, where: str):
    """A feature conv with NaN/Inf in the input (``where="x"``) or in the output gradient (``"dy"``)."""
    P_x, P_out, _, layer = build(case)
    torch.manual_seed(0)
    seq = sequential(case, dtype=case.dtype)
    load_sequential(layer, seq if dist.get_rank() == 0 else None)
    seq = seq.double()  # the reference: float64, on the parameters the layer holds
    gen = torch.Generator().manual_seed(5)
    xg = torch.randn(case.shape, generator=gen, dtype=case.dtype).double()
    n = xg.numel()
    if where == "x":  # specials in different workers' blocks
        flat = xg.view(-1)
        flat[7], flat[n // 2], flat[-5] = NAN, -INF, INF
    xg.requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen, dtype=case.dtype).double()
    if where == "dy":
        dyg.view(-1)[3] = NAN
        dyg.view(-1)[-2] = INF
    yg.backward(dyg)
    x = xg.detach()[local_slices(case.shape, P_x.shape, P_x.index)].to(case.dtype).requires_grad_(True)
    os.environ["DISTFUSE_PATH"] = case.path
    try:
        y = layer(x)
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
    y.backward(dyg[local_slices(tuple(yg.shape), P_out.shape, P_out.index)].to(case.dtype))
    got = {"y": collect_tensor(y.detach(), P_out), "dx": collect_tensor(x.grad, P_x)}
    ref = {"y": yg.detach(), "dx": xg.grad}
    for lay in layer.param_layouts():
        got["d" + lay.seq_name] = collect_tensor(getattr(layer, lay.name).grad if lay.P.active else None, lay.P)
        ref["d" + lay.seq_name] = getattr(seq, lay.seq_name).grad
    terms = sum_terms(seq, yg, case.groups)
    return _compare(got, ref, case.dtype, layer.last_path, terms) if dist.get_rank() == 0 else None


def _compare(got: dict, ref: dict, dtype, path, terms: int) -> dict:
    """Per tensor: same specials, and the finite values within the rounding bound of sums of ``terms`` terms in
    ``dtype`` of the float64 reference.  A value may be the sum of up to WORLD workers' partial results (a
    reduce-scattered output, a halo's gradient added to its owner's, a weight gradient), each rounded to
    ``dtype`` before a reduction that rounds once per addition: 2 (WORLD - 1) more roundings."""
    rtol = rounding_bound(dtype, terms, roundings=STORE_ROUNDINGS + 2 * (WORLD - 1))
    out = {}
    for k in ref:
        g, r = got[k], ref[k]
        finite = r.isfinite() & g.isfinite()
        scale = max(1.0, float(r[finite].abs().max()) if finite.any() else 1.0)  # unit-variance data, or larger
        close = torch.allclose(g[finite].double(), r[finite], rtol=rtol, atol=rtol * scale)
        out[k] = dict(specials=same_specials(g, r), close=close, nonfinite=int((~r.isfinite()).sum()))
    out["path"] = path
    return out


CONV_SPECIALS = [
    pytest.param(Case("1d-zeros", "feature", (2, 3, 17), 4, 3, (1, 1, 4), (0, 1, 2, 3), padding=1,
                      path="unfused"), "x",
                 id="conv1d-zeros-x"),
    pytest.param(Case("1d-circular", "feature", (2, 3, 17), 4, 3, (1, 1, 4), (0, 1, 2, 3), padding=1,
                      mode="circular", path="unfused"), "dy", id="conv1d-circular-dy"),
    pytest.param(Case("2d-reflect", "feature", (2, 3, 9, 10), 4, 3, (1, 1, 2, 2), (0, 1, 2, 3), padding=1,
                      mode="reflect", path="unfused"), "x", id="conv2d-reflect-x"),
    pytest.param(Case("1d-fused-replicate", "feature", (1, 2, 11), 3, 3, (1, 1, 4), (0, 1, 2, 3), padding=2,
                      mode="replicate", path="fused"), "x", id="conv1d-fused-replicate-x", marks=interpreted),
]


@pytest.mark.parametrize("case,where", CONV_SPECIALS)
def test_nan_and_inf_propagate_through_the_conv_layer(case, where):
    out = run_ranks(WORLD, _conv_specials, case, where)[0]
    assert out.pop("path") == case.path
    assert any(v["nonfinite"] for v in out.values()), "the case must produce specials"
    for name, v in out.items():
        assert v["specials"] and v["close"], (name, v)


def _linear_specials(kind: str):
    P = _grid(range(4), (1, 1, 4))
    torch.manual_seed(3)
    if kind == "ag":
        layer = DistributedLinearAllGather(P, 16, 12)
    elif kind == "rs":
        layer = DistributedLinearReduceScatter(P, 16, 12)
    else:
        layer = DistributedLinear(_grid((0, 1), (1, 1, 2)), _grid((2, 3), (1, 1, 2)), _grid(range(4), (2, 2)), 16, 12)
    torch.manual_seed(3)
    seq = torch.nn.Linear(16, 12).double()  # the reference: float64, on the parameters the layer was given
    gen = torch.Generator().manual_seed(9)
    xg = torch.randn(2, 5, 16, generator=gen).double()
    xg[0, 1, 2], xg[1, 3, 15], xg[1, 4, 9] = NAN, INF, -INF  # different feature blocks: different workers
    xg.requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen).double()
    dyg[1, 0, 11] = NAN
    yg.backward(dyg)
    P_in = layer.P_x if kind == "general" else P
    P_out = layer.P_y if kind == "general" else P
    x = _block(xg.detach(), P_in).float().requires_grad_(True)
    y = layer(x)
    y.backward(_block(dyg, P_out).float() if P_out.active else torch.zeros_like(y))
    got = {"y": collect_tensor(y.detach() if P_out.active else None, P_out),
           "dx": collect_tensor(x.grad if P_in.active else None, P_in)}
    ref = {"y": yg.detach(), "dx": xg.grad}
    for lay in layer.param_layouts():
        got["d" + lay.seq_name] = collect_tensor(getattr(layer, lay.name).grad if lay.P.active else None, lay.P)
        ref["d" + lay.seq_name] = getattr(seq, lay.seq_name).grad
    # the longest sums: an output's 16 input features, an input gradient's 12 outputs, a weight gradient's 10 rows
    return _compare(got, ref, torch.float32, layer.last_path, 16) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("kind", ["ag", "rs", "general"])
def test_nan_and_inf_propagate_through_the_linear_layers(kind):
    out = run_ranks(WORLD, _linear_specials, kind)[0]
    out.pop("path")
    assert out["y"]["nonfinite"] and out["dweight"]["nonfinite"]
    for name, v in out.items():
        assert v["specials"] and v["close"], (name, v)


# ---------------------------------------------------------------- determinism


def _step_results(seed: int, fused: bool) -> dict:
    """Forward and backward of a conv (both paths) and the linears, plus two reductions; this rank's tensors."""
    me = dist.get_rank()
    res = {}
    convs = [("unfused", Case("det2d", "feature", (2, 3, 9, 10), 4, 3, (1, 1, 2, 2), (0, 1, 2, 3), padding=1,
                              mode="reflect"))]
    if fused:
        convs.append(("fused", Case("det1d", "feature", (1, 2, 11), 3, 3, (1, 1, 4), (0, 1, 2, 3), padding=1)))
    for path, case in convs:
        P_x, _, _, layer = build(case)
        torch.manual_seed(seed)
        layer.reset_parameters()
        gen = torch.Generator().manual_seed(seed + me)
        x = torch.randn(tuple(local_shape_of(case.shape, P_x)), generator=gen).requires_grad_(True)
        os.environ["DISTFUSE_PATH"] = path
        try:
            y = layer(x)
        finally:
            os.environ.pop("DISTFUSE_PATH", None)
        y.backward(torch.randn(y.shape, generator=gen))
        res[f"conv-{path}"] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
        assert layer.last_path == path
    P = _grid(range(4), (1, 1, 4))
    for kind, cls in (("ag", DistributedLinearAllGather), ("rs", DistributedLinearReduceScatter)):
        torch.manual_seed(seed)
        layer = cls(P, 16, 12)
        gen = torch.Generator().manual_seed(seed + 10 + me)
        x = torch.randn(2, 5, 4, generator=gen).requires_grad_(True)  # a block of 16 features over 4 workers
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=gen))
        res[f"linear-{kind}"] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    full = torch.randn(64, 8, generator=torch.Generator().manual_seed(seed + 20 + me))
    P1 = _grid(range(4), (4, 1))
    res["reduce"] = [ReduceScatter(P1, axes_reduce_scatter=(0,))(full), AllSumReduce(P1, axes_reduce=(0,))(full)]
    return res


def local_shape_of(shape, P):
    return local_shape(shape, P.shape, P.index)


def test_results_are_bitwise_reproducible_in_the_same_and_in_fresh_processes():
    first = run_ranks(WORLD, _step_results, 7, INTERPRET)
    again = run_ranks(WORLD, _step_results, 7, INTERPRET)  # same processes: cached plans, partitions, grids
    discard_pool(WORLD)
    fresh = run_ranks(WORLD, _step_results, 7, INTERPRET)  # new processes
    for other, label in ((again, "same process"), (fresh, "fresh processes")):
        for r in range(WORLD):
            for key, tensors in first[r].items():
                for i, (a, b) in enumerate(zip(tensors, other[r][key], strict=True)):
                    assert bitwise_equal(a, b), f"{label}: rank {r} {key}[{i}] differs"


# ---------------------------------------------------------------- bitwise parity with the sequential computation


def _two_worker_sums():
    """A sum over two workers is bitwise the sequential ``a + b`` (IEEE addition commutes)."""
    P = _grid((1, 3), (2,))  # ranks 0 and 2 are outside
    full = [torch.randn(1000, generator=torch.Generator().manual_seed(50 + r)) * 10.0 ** (3 * r) for r in range(2)]
    rs, ar = ReduceScatter(P, axes_reduce_scatter=(0,)), AllSumReduce(P, axes_reduce=(0,))
    if not P.active:
        return rs(zero_volume_tensor()).numel() == 0 and ar(zero_volume_tensor()).numel() == 0
    ref = full[0] + full[1]
    z, a = rs(full[P.rank]), ar(full[P.rank])
    return bitwise_equal(z, ref[local_slices(ref.shape, P.shape, P.index)]) and bitwise_equal(a, ref)


def test_sums_over_two_workers_are_bitwise_sequential():
    assert run_ranks(WORLD, _two_worker_sums) == [True] * WORLD
