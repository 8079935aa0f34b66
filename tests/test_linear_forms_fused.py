"""DistDL's own linear forms on their fused paths: the output's or the input's features split over the workers.

With ``DISTFUSE_PATH=fused``, ``DistributedLinearReduceScatter(P_x)`` (GEMM + reduce-scatter
along the features) and ``DistributedLinearAllGather(P_y)`` (all-gather along the features
+ GEMM), plain and ZeRO, run the fused ops (``last_path == "fused"``; the Triton kernels
run interpreted over ``/dev/shm`` workspaces) and match a float64 ``torch.nn.Linear`` on
the gathered tensors: output, input gradient, and the gradient of every parameter block
each rank owns.  Cases cover uneven in/out features, batch and sequence extents, ranks
listed out of order, a data-parallel dimension, inactive ranks (the world larger than the
partition), fp32, fp16 and bf16, and a world of 8.  float64 falls back to the unfused
path with a logged reason.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import pytest
import torch

from distfuse import Partition, zero_volume_tensor
from distfuse.fused import symmetric
from distfuse.layers.linear_all_gather import DistributedLinearAllGather, DistributedLinearAllGatherZero
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatter, DistributedLinearReduceScatterZero
from distfuse.testing import run_ranks
from tests.test_conv_support import with_path
from tests.test_linear_layers import _assert_close, _block, _data, _reference

LAYERS = {"rs": (DistributedLinearReduceScatter, DistributedLinearReduceScatterZero),
          "ag": (DistributedLinearAllGather, DistributedLinearAllGatherZero)}
ALL_CLASSES = tuple(cls for pair in LAYERS.values() for cls in pair)


class Case(NamedTuple):
    world: int
    ranks: tuple  # the partition's world ranks, in partition order
    pshape: tuple  # [P_d, 1, ..., P_m]: the only partition of these forms
    gshape: tuple  # global input shape; its last extent is in_features
    out: int
    dtypes: tuple


CASES = {
    "w2-1x1x2-uneven-3dtypes": Case(2, (0, 1), (1, 1, 2), (2, 3, 5), 7, ("float32", "float16", "bfloat16")),
    "w4-2x1x2-permuted-dp": Case(4, (3, 1, 2, 0), (2, 1, 2), (3, 4, 5), 7, ("float32", "bfloat16")),
    "w3-1x1x2-inactive-unsorted": Case(3, (2, 0), (1, 1, 2), (2, 3, 5), 3, ("float32",)),
    "w4-1x1x4-features-lt-workers": Case(4, (0, 1, 2, 3), (1, 1, 4), (2, 2, 3), 2, ("float32",)),
    "w8-2x1x3-inactive-permuted": Case(8, (7, 5, 3, 1, 0, 2), (2, 1, 3), (3, 2, 7), 8, ("float16",)),
}


def _expected_path(family: str, c: Case) -> str:
    # An all-gather linear with fewer output features than model-parallel workers leaves a worker an empty
    # weight shard; that form stays unfused (and says so).
    return "unfused" if family == "ag" and c.out < c.pshape[-1] else "fused"


def _run(c: Case, classes=ALL_CLASSES, seed=200):
    """Every layer class and dtype of the case on this rank; returns (active, comparisons, paths, reasons).

    ``paths`` holds ``(class, dtype, last_path, explain(x).path)`` per forward on an active rank.
    """
    P = Partition.world().create_partition_inclusive(list(c.ranks)).create_cartesian_topology_partition(
        list(c.pshape))
    in_f, out_gshape = c.gshape[-1], (*c.gshape[:-1], c.out)
    checks, paths, reasons = 0, [], []
    for cls in classes:
        for k, name in enumerate(c.dtypes):
            dtype = getattr(torch, name)
            torch.manual_seed(seed + k)
            layer = cls(P, in_f, c.out, dtype=dtype)
            torch.manual_seed(seed + k)
            seq = torch.nn.Linear(in_f, c.out, dtype=dtype)  # the same draws: the layer's blocks of it
            X, dY = _data(c.gshape, seed + 17 + k, dtype), _data(out_gshape, seed + 18 + k, dtype)
            if not P.active:
                x = zero_volume_tensor(dtype=dtype, requires_grad=True)
                y = with_path("fused", lambda layer=layer, x=x: layer(x))
                assert y.shape == (0,) and layer.last_path == "unfused"
                y.backward(torch.ones_like(y))
                continue
            x = _block(X, P).to(dtype).requires_grad_(True)
            explained = with_path("fused", lambda layer=layer, x=x: layer.explain(x))
            y = with_path("fused", lambda layer=layer, x=x: layer(x))
            paths.append((cls.__name__, name, layer.last_path, explained.path))
            reasons.append(layer.last_decision.reason)
            Y, dX, grads = _reference(seq, X, dY)
            sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)
            _assert_close(y, _block(Y, P), _block(sY, P), dtype, f"{cls.__name__} {name} output")
            y.backward(_block(dY, P).to(dtype))
            _assert_close(x.grad, _block(dX, P), _block(sdX, P), dtype, f"{cls.__name__} {name} input gradient")
            checks += 2
            for lay in layer.param_layouts():  # ZeRO: every worker's shard, summed over the batch blocks
                if lay.P.active:
                    _assert_close(getattr(layer, lay.name).grad, _block(grads[lay.seq_name], lay.P),
                                  _block(sgrads[lay.seq_name], lay.P), dtype,
                                  f"{cls.__name__} {name} {lay.name} gradient")
                    checks += 1
    symmetric.close_all()
    return P.active, checks, paths, reasons


@pytest.mark.parametrize("case_id", list(CASES))
def test_fused_forms_match_torch_nn(case_id):
    c = CASES[case_id]
    for w, (active, checks, paths, reasons) in enumerate(run_ranks(c.world, _run, c)):
        assert active == (w in c.ranks)
        assert (checks > 0) == active, f"rank {w}: {checks} comparisons"
        for (cls, dtype, path, explained), reason in zip(paths, reasons, strict=True):
            family = "ag" if "AllGather" in cls else "rs"
            want = _expected_path(family, c)
            assert path == want == explained, (w, cls, dtype, path, explained, reason)
            if want == "unfused":
                assert "empty weight shard" in reason, reason


def _fp64_falls_back():
    P = Partition.world().create_cartesian_topology_partition([1, 1, 2])
    got = []
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("distfuse.fused").addHandler(handler)
    try:
        for cls in (DistributedLinearReduceScatter, DistributedLinearAllGather):
            layer = cls(P, 5, 4, dtype=torch.float64)
            x = torch.randn(2, 3, 3 if P.rank == 0 else 2, dtype=torch.float64)
            y = with_path("fused", lambda layer=layer, x=x: layer(x))
            y.sum().backward()
            got.append((layer.last_path, layer.last_decision.reason))
    finally:
        logging.getLogger("distfuse.fused").removeHandler(handler)
    return got, [r.getMessage() for r in records]


def test_float64_falls_back_with_a_logged_reason():
    for got, logged in run_ranks(2, _fp64_falls_back):
        for path, reason in got:
            assert path == "unfused" and "float64" in reason, reason
        # Logged once per reason (the reduce-scatter's probe runs first; the all-gather's gives the same words).
        assert any("float64" in m for m in logged), logged


def _explain_without_forcing():
    """Without DISTFUSE_PATH, on CPU the production path is unfused, and explain says why, per op."""
    P = Partition.world().create_cartesian_topology_partition([1, 1, 2])
    out = []
    for cls in (DistributedLinearReduceScatter, DistributedLinearAllGather):
        layer = cls(P, 5, 4)
        x = torch.randn(2, 3, 3 if P.rank == 0 else 2)
        out.append(layer.explain(x))
        layer(x)
        out.append(layer.last_decision)
    return out


def test_explain_gives_each_forms_decision():
    for decisions in run_ranks(2, _explain_without_forcing):
        assert all(d.path == "unfused" and "production path is unfused" in d.reason for d in decisions), decisions


# ---------------------------------------------------------------- the general DistributedLinear (matmul_all_reduce)


class GeneralCase(NamedTuple):
    world: int
    x: tuple  # (world ranks, shape) of P_x
    y: tuple  # of P_y
    w: tuple  # of P_w
    gshape: tuple
    out: int
    dtypes: tuple
    path: str  # what the P_w workers record with DISTFUSE_PATH=fused


GENERAL = {
    # DistDL's layout: P_y on P_w's column 0; 6 ranks listed out of order, uneven features.
    "w6-3x2-y-on-column-0-permuted": GeneralCase(6, ((4, 1, 5), (1, 3)), ((4, 0), (1, 2)),
                                                 ((4, 1, 5, 0, 3, 2), (2, 3)), (3, 7), 8, ("float32", "bfloat16"),
                                                 "fused"),
    # Row-parallel, the output on one worker of the row (P_fo = 1); a 3-D input.
    "w4-1x4-row-parallel-3d": GeneralCase(4, ((0, 1, 2, 3), (1, 1, 4)), ((2,), (1, 1, 1)),
                                          ((0, 1, 2, 3), (1, 4)), (2, 3, 9), 5, ("float16",), "fused"),
    # World 8, two ranks inactive; P_w workers without an input block (the shape exchange), P_y across the rows.
    "w8-3x2-exchange-inactive": GeneralCase(8, ((5, 1), (1, 2)), ((5, 2, 7), (1, 3)),
                                            ((1, 5, 2, 6, 0, 7), (3, 2)), (4, 5), 7, ("float32",), "fused"),
    # P_x on other ranks than P_w (those only send their blocks), the output on one row worker.
    "w4-x-outside-w": GeneralCase(4, ((3, 2), (1, 2)), ((1,), (1, 1)), ((0, 1), (1, 2)), (2, 5), 3, ("float32",),
                                  "fused"),
    # P_y worker 0 outside its row: row 0's keeper (its column-0 worker) delivers the row's sum to it.
    "w4-y-outside-rows": GeneralCase(4, ((0, 1), (1, 2)), ((2, 3), (1, 2)), ((0, 1, 2, 3), (2, 2)), (3, 7), 5,
                                     ("float32",), "fused"),
    # Mixed and permuted: P_y workers 0 and 2 sit in other rows (delivered), worker 1 in its own row (kept);
    # a bf16 3-D input, P_x on part of P_w, two inactive ranks.
    "w8-3x2-deliver-mixed-permuted": GeneralCase(8, ((6, 2), (1, 1, 2)), ((3, 0, 6), (1, 1, 3)),
                                                 ((6, 2, 0, 5, 3, 1), (3, 2)), (2, 3, 7), 8, ("bfloat16",), "fused"),
    # A P_y worker outside P_w: not servable, the unfused composition runs (and says why).
    "w4-y-outside-w": GeneralCase(4, ((0, 1), (1, 2)), ((3,), (1, 1)), ((1, 0), (1, 2)), (3, 7), 5,
                                  ("float32",), "unfused"),
}


def _run_general(c: GeneralCase):
    from distfuse.layers.linear import DistributedLinear
    from tests.test_linear_general import _check, _grid

    P_x, P_y, P_w = _grid(c.x), _grid(c.y), _grid(c.w)
    checks, reasons = 0, []
    for k, name in enumerate(c.dtypes):
        dtype = getattr(torch, name)
        torch.manual_seed(300 + k)
        layer = DistributedLinear(P_x, P_y, P_w, c.gshape[-1], c.out, dtype=dtype)
        torch.manual_seed(300 + k)
        seq = torch.nn.Linear(c.gshape[-1], c.out, dtype=dtype)
        X, dY = _data(c.gshape, 31 + k, dtype), _data((*c.gshape[:-1], c.out), 32 + k, dtype)
        checks += with_path("fused", lambda layer=layer, seq=seq, X=X, dY=dY, dtype=dtype:
                            _check(layer, seq, P_x, P_y, X, dY, dtype, path=c.path))
        reasons.append(layer.last_decision.reason)
    symmetric.close_all()
    return P_w.active, checks, reasons


@pytest.mark.parametrize("case_id", list(GENERAL))
def test_general_linear_fuses_its_rows(case_id):
    c = GENERAL[case_id]
    for w, (in_w, checks, reasons) in enumerate(run_ranks(c.world, _run_general, c)):
        in_union = w in set(c.x[0]) | set(c.y[0]) | set(c.w[0])
        assert (checks > 0) == in_union, (w, checks)
        if in_w and c.path == "unfused":
            assert all("a P_y worker outside P_w" in r for r in reasons), reasons


# ---------------------------------------------------------------- ZeRO over the data-parallel workers alone


ZERO = {
    # P_m = 1: only the weight moves; its all-gather runs inside the GEMM.  Uneven batch blocks (5 over 3),
    # ranks out of order, one inactive rank.
    "w4-3x1x1-zero-weight-streaming": Case(4, (2, 0, 3), (3, 1, 1), (5, 2, 7), 6, ("float32", "bfloat16")),
    "w2-2x1x1-zero-fp16": Case(2, (1, 0), (2, 1, 1), (3, 4, 5), 9, ("float16",)),
}


@pytest.mark.parametrize("case_id", list(ZERO))
def test_zero_weight_all_gather_fused_into_the_gemm(case_id):
    c = ZERO[case_id]
    zero = (DistributedLinearReduceScatterZero, DistributedLinearAllGatherZero)
    for w, (active, checks, paths, reasons) in enumerate(run_ranks(c.world, _run, c, zero, 400)):
        assert active == (w in c.ranks) and (checks > 0) == active
        for (cls, dtype, path, explained), reason in zip(paths, reasons, strict=True):
            assert path == explained == "fused", (w, cls, dtype, reason)


def _general_explain():
    from distfuse.layers.linear import DistributedLinear

    P = Partition.world()
    P_x = P.create_cartesian_topology_partition([1, 2])
    P_y = P.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    layer = DistributedLinear(P_x, P_y, P_x, 5, 3)
    x = torch.randn(4, 3 if P_x.rank == 0 else 2)
    forced = with_path("fused", lambda: layer.explain(x))
    auto = layer.explain(x)
    y = with_path("fused", lambda: layer(x))
    y.backward(torch.ones_like(y))
    symmetric.close_all()  # the next test on this pool gets a fresh workspace
    return forced, auto, layer.last_decision


def test_general_linear_explains_its_decision():
    for forced, auto, recorded in run_ranks(2, _general_explain):
        assert forced.path == "fused" == recorded.path and forced.reason == "DISTFUSE_PATH=fused"
        assert auto.path == "unfused" and "production path is unfused" in auto.reason


def _sequence_mlp(*args):
    from tests.test_teeth_layers import _mlp_on_ranks

    out = _mlp_on_ranks(*args)
    symmetric.close_all()
    return out


def test_sequence_forms_fuse_in_fp16_too():
    """The sequence-parallel forms (P_y / P_x given), plain and ZeRO, in fp16 with a data-parallel dimension."""
    from tests.test_teeth_layers import _close

    for kind in ("plain", "zero"):
        out = run_ranks(4, _sequence_mlp, kind, [2, 0, 3, 1], 2, 2, 5, torch.float16, False)
        assert all(r["paths"] == ("fused", "fused") for r in out), [r["paths"] for r in out]
        got, want = out[0]["got"], out[0]["want"]
        for k in ("y", "dx", "ag.weight", "ag.bias", "rs.weight", "rs.bias"):
            _close(f"{kind}: {k}", got[k].double(), want[k if k in ("y", "dx") else f"{k}.grad"], torch.float16)
