"""The ZeRO linears with model- and data-parallel workers (P_m > 1, P_d > 1) on their fused path, and the fused
backward of matmul_all_reduce.

ZeRO: with ``DISTFUSE_PATH=fused``, ``DistributedLinearReduceScatterZero`` and
``DistributedLinearAllGatherZero`` stream the weight shards into the GEMM over the
data-parallel workers and fuse both backward GEMMs with their collectives
(:mod:`distfuse.fused.zero_linear`).  Each case checks, on every active rank:
``last_path == explain(x).path == "fused"``; the symmetric workspaces' claim counts (two on
the data-parallel group: the weight-streaming GEMM and the weight-gradient reduce-scatter;
one on the model-parallel group: the backward's dgrad), so no silent unfused collective
stands in; and the output, the input gradient and every parameter block's gradient
against a float64 ``torch.nn.Linear`` on the gathered tensors.  Workspaces are filled with
NaN bytes before every forward.  Cases: DistDL's forms (features split) and the sequence
forms (``P_y`` / ``P_x`` given), uneven in/out features, batch and sequence, ranks out of
order, inactive ranks, worlds of 4, 5 and 8, fp32/fp16/bf16, ``keep_gathered=False``, and
empty blocks (a batch block, a weight shard, an output block).  Also: the unfused and
float64 fallbacks; the model-parallel form's own fused op where the data-parallel workers
cannot share memory; :func:`~distfuse.fused.zero_linear.zero_linear` itself against
float64 and the dot-product adjoint test in both of its arguments; the tuner's timing
cases of ``zero_linear_rows`` / ``zero_linear_columns``; bad arguments.

matmul_all_reduce: its ``grad_output="sum"`` backward is a reduce-scatter plus the fused
all-gather + dgrad GEMM; here ``dist.all_reduce`` is forbidden during the backward and the
rank that adds the bias holds no input features (its gathered gradient comes from the
waiting copy kernel).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import ShapeError, UnsupportedError
from distfuse.fused import symmetric
from distfuse.layers.linear_all_gather import DistributedLinearAllGatherZero
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatterZero
from distfuse.testing import run_ranks
from distfuse.testing.tolerance import STORE_ROUNDINGS
from tests.test_conv_support import with_path
from tests.test_fused_linear import _debug_mode, _poison
from tests.test_linear_layers import _assert_close, _block, _data, _reference
from tests.tolerances import rounding_bound, tol


class Case(NamedTuple):
    world: int
    ranks: tuple  # the partition's world ranks, in partition order
    grid: tuple  # (P_d, P_m)
    form: str  # "features": P_x / P_y alone (DistDL's); "sequence": P_y / P_x given as well
    gshape: tuple  # global input [B, n, in]
    out: int
    dtypes: tuple
    keep_gathered: bool = True
    debug: bool = False  # DISTFUSE_DEBUG=1: NaN-filled kernel outputs and the agreement checks


CASES = {
    # Uneven in (5 over 2 and 2), out (7) and batch (3 over 2); ranks out of order; the three dtypes.
    "w4-2x2-features-permuted-3dtypes": Case(4, (3, 1, 0, 2), (2, 2), "features", (3, 2, 5), 7,
                                             ("float32", "float16", "bfloat16"), debug=True),
    # World 8, two ranks inactive, three data-parallel workers (batch 5 over 3), in 7 over 2 and 3; the gathered
    # copies not kept (gathered again in the backward).
    "w8-3x2-features-inactive-not-kept": Case(8, (6, 1, 4, 0, 7, 2), (3, 2), "features", (5, 2, 7), 5, ("float16",),
                                              keep_gathered=False),
    # The sequence forms: n = 5 over 2, in 6, out 7; the gathered copies not kept.
    "w4-2x2-sequence-not-kept": Case(4, (2, 0, 3, 1), (2, 2), "sequence", (3, 5, 6), 7, ("float32", "bfloat16"),
                                     keep_gathered=False),
    # The sequence forms on 6 of 8 ranks: batch 4 over 3, n 5 over 2, in 7 over 2 and 3, out 8 over 2 and 3.
    "w8-3x2-sequence-inactive-fp16": Case(8, (7, 2, 5, 0, 3, 6), (3, 2), "sequence", (4, 5, 7), 8, ("float16",)),
    # Empty blocks: batch 1 over 2 (one data-parallel row has no rows), out 1 over 2 (a shard and an output
    # block of 0 features), in 3 over 2 and 2; a world of 5 with one inactive rank.
    "w5-2x2-empty-blocks": Case(5, (4, 2, 0, 1), (2, 2), "features", (1, 2, 3), 1, ("float32",)),
}


def _grids(c: Case):
    P_d, P_m = c.grid
    base = Partition.world().create_partition_inclusive(list(c.ranks))
    P_f = base.create_cartesian_topology_partition([P_d, 1, P_m])  # the features split over the model workers
    P_s = base.create_cartesian_topology_partition([P_d, P_m, 1]) if c.form == "sequence" else None
    return P_f, P_s


def _epochs(*Ps) -> list[int]:
    """The claim counter of each partition's cached workspace (0 before it exists)."""
    out = []
    for P in Ps:
        found = [ws.epoch for (ranks, _), ws in symmetric._CACHE.items() if ranks == P.ranks and not ws.closed]
        out.append(found[0] if found else 0)
    return out


def _run(c: Case, path: str = "fused", weight_streaming: bool = True, seed: int = 500):
    P_f, P_s = _grids(c)
    in_f = c.gshape[-1]
    forms = {  # layer, input partition, output partition
        "rs": (lambda dt: DistributedLinearReduceScatterZero(P_f, in_f, c.out, dtype=dt, P_y=P_s), P_f, P_s or P_f),
        "ag": (lambda dt: DistributedLinearAllGatherZero(P_f, in_f, c.out, dtype=dt, P_x=P_s,
                                                         keep_gathered=c.keep_gathered), P_s or P_f, P_f),
    }
    checks, seen = 0, []
    for name, (make, P_in, P_out) in forms.items():
        for k, dt_name in enumerate(c.dtypes):
            dtype = getattr(torch, dt_name)
            torch.manual_seed(seed + k)
            layer = make(dtype)
            if not weight_streaming:  # as without symmetric memory between the data-parallel workers
                layer._weight_gather_available = lambda: (False, "no peer access between the data-parallel workers")
            torch.manual_seed(seed + k)
            seq = torch.nn.Linear(in_f, c.out, dtype=dtype)  # the same draws: the layer's blocks of it
            X, dY = _data(c.gshape, seed + 7 + k, dtype), _data((*c.gshape[:-1], c.out), seed + 8 + k, dtype)
            if not P_f.active:
                x = zero_volume_tensor(dtype=dtype, requires_grad=True)
                y = with_path(path, lambda layer=layer, x=x: layer(x))
                assert y.shape == (0,) and layer.last_path == "unfused"
                y.backward(torch.ones_like(y))
                continue
            P_m_group = layer.P_scatter if name == "rs" else layer.P_gather
            x = _block(X, P_in).to(dtype).requires_grad_(True)
            explained = with_path(path, lambda layer=layer, x=x: layer.explain(x))
            before = _epochs(layer.P_wgather, P_m_group)
            for P in (layer.P_wgather, P_m_group):
                _poison(P)
            dy = _block(dY, P_out).to(dtype)

            def step(layer=layer, x=x, dy=dy):
                y = layer(x)
                y.backward(dy)
                return y

            if c.debug:
                with _debug_mode():
                    y = with_path(path, step)
            else:
                y = with_path(path, step)
            after = _epochs(layer.P_wgather, P_m_group)
            seen.append((name, dt_name, layer.last_path, explained.path, layer.last_decision.reason,
                         after[0] - before[0], after[1] - before[1]))
            Y, dX, grads = _reference(seq, X, dY)
            sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)
            assert y.dtype == dtype
            _assert_close(y, _block(Y, P_out), _block(sY, P_out), dtype, f"{name} {dt_name} output")
            _assert_close(x.grad, _block(dX, P_in), _block(sdX, P_in), dtype, f"{name} {dt_name} input gradient")
            checks += 2
            for lay in layer.param_layouts():  # every worker's ZeRO shard, summed over the batch blocks
                if lay.P.active:
                    _assert_close(getattr(layer, lay.name).grad, _block(grads[lay.seq_name], lay.P),
                                  _block(sgrads[lay.seq_name], lay.P), dtype, f"{name} {dt_name} {lay.name} gradient")
                    checks += 1
    symmetric.close_all()
    return P_f.active, checks, seen


def _check_ranks(c: Case, results, want_path: str, want_claims: tuple, reason_has: str = ""):
    for w, (active, checks, seen) in enumerate(results):
        assert active == (w in c.ranks)
        assert (checks > 0) == active, f"rank {w}: {checks} comparisons"
        assert len(seen) == (2 * len(c.dtypes) if active else 0)
        for name, dtype, path, explained, reason, claims_d, claims_m in seen:
            assert path == explained == want_path and reason_has in reason, (w, name, dtype, path, explained, reason)
            assert (claims_d, claims_m) == want_claims, (w, name, dtype, claims_d, claims_m)


@pytest.mark.parametrize("case_id", list(CASES))
def test_zero_layers_fuse_the_weight_gather_with_model_parallel_workers(case_id):
    c = CASES[case_id]
    # d: the weight-streaming GEMM and the dW reduce-scatter; m: the backward's dgrad (the forward's activation
    # collective is a plain one, see fused/zero_linear.py).
    _check_ranks(c, run_ranks(c.world, _run, c), "fused", (2, 1))


def test_without_weight_streaming_the_form_still_fuses():
    """The data-parallel workers cannot share memory: the weight is all-gathered unfused and the model-parallel
    form runs its own fused op (both of its claims on the model-parallel group), with the same answers."""
    c = CASES["w4-2x2-features-permuted-3dtypes"]._replace(dtypes=("float32",), debug=False)
    _check_ranks(c, run_ranks(c.world, _run, c, "fused", False), "fused", (0, 2))


def test_unfused_and_float64_take_the_unfused_composition():
    """DISTFUSE_PATH=unfused, and float64 with the fused path forced (logged, recorded): the same answers, no
    workspace claimed."""
    c = CASES["w4-2x2-sequence-not-kept"]
    _check_ranks(c, run_ranks(c.world, _run, c, "unfused"), "unfused", (0, 0), "DISTFUSE_PATH=unfused")
    c = c._replace(dtypes=("float64",), form="features")
    _check_ranks(c, run_ranks(c.world, _run, c, "fused"), "unfused", (0, 0), "float64")


# ---------------------------------------------------------------- zero_linear called directly


def _direct(split: str, keep_gathered: bool):
    """zero_linear on a [2, 2] grid (ranks out of order) against F.linear on the global tensors; float64 blocks."""
    from distfuse.fused.zero_linear import zero_linear
    from distfuse.geometry.decomposition import block_range

    P = Partition.world().create_partition_inclusive([1, 3, 0, 2]).create_cartesian_topology_partition([2, 2])
    P_d = P.create_cartesian_subtopology_partition([True, False])
    P_m = P.create_cartesian_subtopology_partition([False, True])
    d, m = P.index
    rows, out, in_ = 5, 7, 6
    g = torch.Generator().manual_seed(71)
    # float64 values the fp32 blocks hold exactly
    X, Wt, dY = (torch.randn(*s, generator=g, dtype=torch.float64).float().double()
                 for s in ((rows, in_), (out, in_), (rows, out)))
    r_d = slice(*block_range(rows, 2, d))
    o_m, i_m = slice(*block_range(out, 2, m)), slice(*block_range(in_, 2, m))
    o_d, i_d = slice(*block_range(out, 2, d)), slice(*block_range(in_, 2, d))
    shard_of = {"rows": (o_d, i_m), "columns": (o_m, i_d)}[split]
    x = X[r_d, i_m].float().requires_grad_()
    shard = Wt[shard_of].float().requires_grad_()
    _poison(P_d)
    _poison(P_m)
    dy = dY[r_d, o_m].float()
    with _debug_mode():
        y = zero_linear(x, shard, P_d, P_m, split=split, out_features=out, in_features=in_, keep_gathered=keep_gathered)
        y.backward(dy)
    symmetric.close_all()
    # y = B(x, shard) is linear in each argument: <y, dy> = <x, dx> = <shard, dshard>, each summed over the ranks.
    pairs = ((y, dy), (x, x.grad), (shard, shard.grad))
    dots = torch.stack([(a.detach().double() * b.double()).sum() for a, b in pairs])
    dist.all_reduce(dots)
    # In exact arithmetic each side is the sum of the products x[i, k] W[j, k] dY[i, j] of the fp32 operands; the
    # kernels' roundings are bounded relative to the sum of their magnitudes.
    magnitude = float(((X.abs() @ Wt.abs().t()) * dY.abs()).sum())
    return dots.tolist(), magnitude, [(got.detach().double(), want) for got, want in
                           ((y, (X @ Wt.t())[r_d, o_m]), (x.grad, (dY @ Wt)[r_d, i_m]),
                            (shard.grad, (dY.t() @ X)[shard_of]))]


@pytest.mark.parametrize("keep_gathered", [True, False], ids=["kept", "gathered-again"])
@pytest.mark.parametrize("split", ["rows", "columns"])
def test_zero_linear_matches_float64_and_is_its_own_adjoint(split, keep_gathered):
    """Against F.linear on the global tensors, and the dot-product test in both arguments (fp32: the kernels take
    no float64, so the sides agree to fp32 rounding, where a wrong adjoint is off by O(1))."""
    rows, out, in_ = 5, 7, 6
    # y sums in_ products, dx out products, dshard rows; each over the 2 workers of one grid axis, whose fp32
    # partials are rounded and added once more (2 roundings).  Two sides differ by at most both their errors.
    bound = {terms: rounding_bound(torch.float32, terms, roundings=STORE_ROUNDINGS + 2) for terms in (rows, out, in_)}
    allowed = 2 * max(bound.values())
    for (fx_y, x_fty, s_fty), magnitude, pairs in run_ranks(4, _direct, split, keep_gathered):
        # the data resolve the adjoint: one off by a relative 1e-3 or more fails
        assert abs(fx_y) > 1e3 * allowed * magnitude, (fx_y, magnitude)
        assert abs(fx_y - x_fty) <= allowed * magnitude and abs(fx_y - s_fty) <= allowed * magnitude, \
            (fx_y, x_fty, s_fty, allowed * magnitude)
        for what, (got, want), terms in zip(("y", "dx", "dshard"), pairs, (in_, out, rows), strict=True):
            torch.testing.assert_close(got, want, rtol=bound[terms], atol=bound[terms],  # unit-variance data
                                       msg=lambda m, w=what: f"{split} {w}: {m}")


def _tuner_case(op: str):
    """The tuner's case for a ZeRO entry, both paths on the quick grid's first shape (CPU: interpreted)."""
    from distfuse.fused import registry
    from distfuse.tune.cases import CaseContext

    W = dist.get_world_size()
    spec = registry.get(op)
    ctx = CaseContext(torch.float32, torch.device("cpu"), W, range(W), None, full=True, fused_ok=True)
    shape = registry.resolve(spec.grid)(op, W, quick=True)[0]
    case = registry.resolve(spec.case)(op, dict(shape, n=shape["n"] + 1), ctx)  # uneven shards
    fused, unfused = case.fused(0).detach().double(), case.unfused(0).detach().double()
    symmetric.close_all()
    # Two fp32 GEMMs of the same operands summed in other orders: each is within the rounding bound of sums of
    # k terms of the exact result, so they are within twice that of each other.  The terms, x of unit variance
    # times a weight scaled by 1 / sqrt(k), have outputs of size about 1 (scale: their typical magnitude).
    scale = max(float(unfused.square().mean().sqrt()), 1.0 / math.sqrt(shape["k"]))
    t = tol(torch.float32, terms=shape["k"], scale=scale)
    allowed = 2 * (t["rtol"] * unfused.abs() + t["atol"])
    assert fused.shape == unfused.shape and not torch.isnan(fused).any()
    return float(((fused - unfused).abs() / allowed).max())


@pytest.mark.parametrize("op", ["zero_linear_rows", "zero_linear_columns"])
def test_tuner_case_times_equal_work(op):
    ratios = run_ranks(3, _tuner_case, op)
    assert all(r <= 1.0 for r in ratios), ratios  # the error over its allowance, per rank


# ---------------------------------------------------------------- zero_linear's argument checks


def _bad_arguments():
    from distfuse.fused.zero_linear import zero_linear
    from distfuse.geometry.decomposition import block_extent

    P_f, _ = _grids(Case(4, (0, 1, 2, 3), (2, 2), "features", (2, 2, 5), 7, ()))
    P_d = P_f.create_cartesian_subtopology_partition([True, False, False])
    P_m = P_f.create_cartesian_subtopology_partition([False, False, True])
    in_m, out_d = block_extent(5, 2, P_m.rank), block_extent(7, 2, P_d.rank)
    x, shard = torch.randn(2, in_m), torch.randn(out_d, in_m)  # right on every rank; each call breaks one thing
    args = dict(split="rows", out_features=7, in_features=5)
    errors = {}
    for key, call in {
        "shard": lambda: zero_linear(x, torch.randn(out_d + 1, in_m), P_d, P_m, **args),
        "x": lambda: zero_linear(torch.randn(2, in_m + 1), shard, P_d, P_m, **args),
        "n": lambda: zero_linear(x.view(2, 1, in_m), shard.t().contiguous(), P_d, P_m, split="columns",
                                 axis="sequence", out_features=5, in_features=7),
        "split": lambda: zero_linear(x, shard, P_d, P_m, **dict(args, split="diagonal")),
        "axis": lambda: zero_linear(x, shard, P_d, P_m, axis="batch", **args),
        "dtype": lambda: zero_linear(x.double(), shard.double(), P_d, P_m, **args),
    }.items():
        try:
            call()
            errors[key] = None
        except (ShapeError, UnsupportedError) as exc:
            errors[key] = type(exc).__name__
    return errors


def test_bad_arguments_raise_on_every_rank():
    for errors in run_ranks(4, _bad_arguments):
        assert errors == {"shard": "ShapeError", "x": "ShapeError", "n": "ShapeError", "split": "UnsupportedError",
                          "axis": "UnsupportedError", "dtype": "UnsupportedError"}, errors


# ---------------------------------------------------------------- matmul_all_reduce: the fused backward


def _all_reduce_backward(dtype_name: str):
    from distfuse.fused.matmul_all_reduce import matmul_all_reduce
    from distfuse.geometry.decomposition import block_range

    dtype = getattr(torch, dtype_name)
    P = Partition.world().create_partition_inclusive([2, 0, 1]).create_cartesian_topology_partition([1, 1, 3])
    W, r = P.size, P.rank
    K, N, lead = 2, 5, (2, 3)  # K = 2 over 3 workers: partition rank 2 has no input features
    g = torch.Generator().manual_seed(61)
    X, Wt, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).double()
                for s in ((*lead, K), (N, K), (N,)))
    dys = [torch.randn(*lead, N, generator=g, dtype=torch.float64).to(dtype).double() for _ in range(W)]
    bias_rank = 2
    kr = slice(*block_range(K, W, r))
    x = X[..., kr].to(dtype).requires_grad_()
    w = Wt[:, kr].to(dtype).requires_grad_()
    bias = b.to(dtype).requires_grad_() if r == bias_rank else None
    _poison(P)
    forbidden = dist.all_reduce

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("the fused backward ran an all-reduce")

    with _debug_mode():
        y = matmul_all_reduce(x, w, bias, P, algorithm="one_shot")
        dist.all_reduce = no_all_reduce
        try:
            y.backward(dys[r].to(dtype))
        finally:
            dist.all_reduce = forbidden
    ref = [t.clone().requires_grad_() for t in (X, Wt, b)]
    F.linear(*ref).backward(sum(dys))  # the loss is the sum over ranks of <y, dy_r>
    symmetric.close_all()
    got = dict(y=y, dx=x.grad, dw=w.grad, db=bias.grad if bias is not None else None)
    want = dict(y=F.linear(X, Wt, b), dx=ref[0].grad[..., kr], dw=ref[1].grad[:, kr],
                db=ref[2].grad if r == bias_rank else None)
    return r, {k: (got[k].detach().double() if got[k] is not None else None, want[k]) for k in got}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_all_reduce_backward_is_fused(dtype):
    t = tol(getattr(torch, dtype))
    for r, pairs in run_ranks(3, _all_reduce_backward, dtype):
        for key, (got, want) in pairs.items():
            if want is None:
                assert got is None, (r, key)
                continue
            assert got.shape == want.shape and not torch.isnan(got).any(), (r, key)
            scale = max([1.0, *want.abs().flatten().tolist()])
            torch.testing.assert_close(got, want, rtol=t["rtol"], atol=t["atol"] * scale,
                                       msg=lambda m, k=key, r=r: f"rank {r} {k}: {m}")
        assert pairs["dx"][0].shape[-1] == (0 if r == 2 else 1)


def test_workspace_request_covers_the_backward():
    from distfuse.fused.matmul_all_reduce import matmul_all_reduce_workspace_bytes
    from distfuse.kernels.all_gather_features_matmul import gathered_k_workspace_bytes

    for algorithm in ("one_shot", "two_shot"):
        for dtype, pd in ((torch.float32, torch.bfloat16), (torch.bfloat16, None)):
            got = matmul_all_reduce_workspace_bytes(6, 10, 3, dtype, algorithm, pd)
            assert got >= gathered_k_workspace_bytes(6, 10, dtype) > 0
    assert matmul_all_reduce_workspace_bytes(6, 10, 1, torch.float32, "one_shot") == 0
    assert math.prod((6, 10)) * 4 == gathered_k_workspace_bytes(6, 10, torch.float32)
