"""Misuse: ranks that disagree on an input get the same named error, never an abort or garbage; no steady-state cost.

Each layer (and primitive module) runs a few calls with repeating shapes first: after
them its agreement site must have taken the slow path (the host metadata gather) once
only.  Then one rank disagrees (another dtype of the same element size, fp64, int64,
another row count, a block that is not the balanced one): every rank of the affected
collective must raise :class:`~distfuse.errors.ShapeError` naming the op and its rank,
within a fraction of ``DISTFUSE_TIMEOUT`` (the flag riding on the data, not a timeout),
and the ranks of unaffected collectives must be unaffected.  A legitimate change of
global shape on every rank, including one that leaves some ranks' blocks unchanged, must
just work and match ``torch.nn`` on the gathered tensors.

Pools keep the world group at torch's default timeout; ``DISTFUSE_TIMEOUT=3`` in the ranks.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

import distfuse.layers.conv_feature as conv_feature
from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import (
    DistributedConv1d,
    DistributedConv2d,
    DistributedLinearAllGather,
    DistributedLinearReduceScatter,
    load_sequential,
)
from distfuse.primitives import AllGather, AllSumReduce, ReduceScatter
from distfuse.testing import run_ranks
from tests.misuse_support import catch as _catch
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
T = 3.0
_GRIDS: dict = {}


def _grid(ranks, shape):
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


def _run(fn, world: int = 4):
    return run_ranks(world, fn, pg_timeout=PG_DEFAULT, timeout=90)



def _close(got, want, dtype) -> bool:
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype))
    return True


def _assert_fast_shape_errors(results, ranks, op):
    """Every rank in ``ranks`` raised ShapeError naming ``op`` and itself, well within the timeout."""
    for r in ranks:
        kind, msg, secs = results[r]
        assert kind == "ShapeError", (r, results[r])
        assert f"{op} [rank {r}]" in msg, msg
        assert secs < T / 2, (r, secs)


# ---------------------------------------------------------------- the all-gather linear (features gathered)


def _all_gather_linear():
    me = dist.get_rank()
    P = _grid((3, 1, 0, 2), (2, 2))  # worker (d, m): rows {3, 1} (d = 0) and {0, 2} (d = 1), ranks permuted
    dt = torch.bfloat16
    torch.manual_seed(11)
    layer = DistributedLinearAllGather(P, 6, 5, dtype=dt)
    torch.manual_seed(11)
    seq = nn.Linear(6, 5, dtype=dt)  # the layer's weights (same seed, same dtype)
    oracle = copy.deepcopy(seq).double()  # the same weights, exactly, in float64

    def call(rows, bad_rows=None, bad_dtype=None, who=None):
        xg = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows)).to(dt)
        x = xg[local_slices(xg.shape, P.shape, P.index)]
        if me == who:
            x = x.to(bad_dtype) if bad_dtype is not None else torch.randn(bad_rows, x.shape[1]).to(dt)
        y = layer(x)
        ref = oracle(xg.double())
        return _close(y, ref[local_slices(ref.shape, P.shape, P.index)], dt) and y.dtype

    out = {"steady": [_catch(lambda: call(6)) for _ in range(3)]}
    out["steady_slow"] = layer.agreement.slow_calls
    out["legit"] = _catch(lambda: call(7))  # blocks of 7 rows over 2: (4, 3); row d = 1 keeps its 3 rows
    out["fp16"] = _catch(lambda: call(7, bad_dtype=torch.float16, who=2))  # same element size as bf16
    out["rows"] = _catch(lambda: call(7, bad_rows=5, who=0))
    out["fp64"] = _catch(lambda: call(7, bad_dtype=torch.float64, who=3))
    out["int64"] = _catch(lambda: call(7, bad_dtype=torch.int64, who=1))
    out["again"] = _catch(lambda: call(7))
    fresh = DistributedLinearAllGather(P, 6, 5, dtype=dt)  # disagreement on the very first call
    xb = torch.randn(3, 3, dtype=torch.float16 if me == 2 else dt)
    out["first"] = _catch(lambda: fresh(xb))
    return out


def test_all_gather_linear_agrees_or_raises_on_the_row():
    res = _run(_all_gather_linear)
    for r in range(4):
        assert [s[0] for s in res[r]["steady"]] == ["ok"] * 3, res[r]["steady"]
        assert res[r]["legit"] == ("ok", torch.bfloat16) and res[r]["again"] == ("ok", torch.bfloat16)
    assert res[3]["steady_slow"] == res[0]["steady_slow"] == 1  # one metadata gather in three calls
    row0, row1 = [3, 1], [0, 2]
    _assert_fast_shape_errors({r: res[r]["fp16"] for r in row1}, row1, "DistributedLinearAllGather")
    assert "torch.float16" in res[0]["fp16"][1] and "torch.bfloat16" in res[0]["fp16"][1]
    _assert_fast_shape_errors({r: res[r]["rows"] for r in row1}, row1, "DistributedLinearAllGather")
    for case in ("fp64", "int64"):
        _assert_fast_shape_errors({r: res[r][case] for r in row0}, row0, "DistributedLinearAllGather")
    for r in row0:
        assert res[r]["fp16"][0] == res[r]["rows"][0] == "ok"  # the other row's collective never saw it
    for r in row1:
        assert res[r]["fp64"][0] == res[r]["int64"][0] == "ok"
    _assert_fast_shape_errors({r: res[r]["first"] for r in row1}, row1, "DistributedLinearAllGather")


# ---------------------------------------------------------------- the reduce-scatter linear


def _reduce_scatter_linear():
    me = dist.get_rank()
    P = _grid((0, 1, 2, 3), (2, 2))
    torch.manual_seed(5)
    layer = DistributedLinearReduceScatter(P, 7, 6, dtype=torch.float64)
    torch.manual_seed(5)
    seq = nn.Linear(7, 6, dtype=torch.float64)

    def call(rows, who=None, bad_rows=None, bad_dtype=None):
        xg = torch.randn(rows, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
        x = xg[local_slices(xg.shape, P.shape, P.index)]
        if me == who:
            x = x.to(bad_dtype) if bad_dtype is not None else torch.randn(bad_rows, x.shape[1], dtype=x.dtype)
        y = layer(x)
        ref = seq(xg)
        return _close(y, ref[local_slices(ref.shape, P.shape, P.index)], torch.float64)

    out = {"steady": [_catch(lambda: call(4)) for _ in range(3)]}
    out["steady_slow"] = layer.agreement.slow_calls
    out["legit"] = _catch(lambda: call(5))
    out["rows"] = _catch(lambda: call(5, who=1, bad_rows=2))
    out["fp32"] = _catch(lambda: call(5, who=2, bad_dtype=torch.float32))
    out["int64"] = _catch(lambda: call(5, who=3, bad_dtype=torch.int64))
    out["again"] = _catch(lambda: call(5))
    return out


def test_reduce_scatter_linear_agrees_or_raises_on_the_row():
    res = _run(_reduce_scatter_linear)
    for r in range(4):
        assert [s[0] for s in res[r]["steady"]] == ["ok"] * 3 and res[r]["steady_slow"] == 1
        assert res[r]["legit"][0] == res[r]["again"][0] == "ok", res[r]
    op = "DistributedLinearReduceScatter"
    _assert_fast_shape_errors({r: res[r]["rows"] for r in (0, 1)}, (0, 1), op)
    _assert_fast_shape_errors({r: res[r]["fp32"] for r in (2, 3)}, (2, 3), op)
    _assert_fast_shape_errors({r: res[r]["int64"] for r in (2, 3)}, (2, 3), op)
    assert "torch.int64" in res[2]["int64"][1] and "world rank 3" in res[2]["int64"][1]
    assert res[2]["rows"][0] == res[0]["fp32"][0] == "ok"


# ---------------------------------------------------------------- sequence-parallel gather: uneven length changes


def _sequence_parallel():
    me = dist.get_rank()
    P_y = _grid((1, 0), (1, 1, 2))  # two model-parallel workers in permuted order; world ranks 2 and 3 inactive
    P_x = _grid((1, 0), (1, 2, 1))
    torch.manual_seed(3)
    layer = DistributedLinearAllGather(P_y, 4, 6, P_x=P_x, dtype=torch.float64)
    torch.manual_seed(3)
    seq = nn.Linear(4, 6, dtype=torch.float64)
    out = {}
    for n in (7, 7, 8, 5):  # 7 -> blocks (4, 3), 8 -> (4, 4): the first worker's block repeats
        xg = torch.randn(2, n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        x = xg[local_slices(xg.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor()
        y = layer(x)
        if P_y.active:
            ref = seq(xg)
            _close(y, ref[local_slices(ref.shape, P_y.shape, P_y.index)], torch.float64)
    out["slow"] = layer.agreement.slow_calls
    bad = torch.randn(2, 2 if me == 1 else 3, 4, dtype=torch.float64)  # (2, 3) in P_x order: not balanced (3, 2)
    out["unbalanced"] = _catch(lambda: layer(bad if P_x.active else zero_volume_tensor()))
    return out


def test_sequence_parallel_gather_learns_uneven_changes_and_refuses_unbalanced_blocks():
    res = _run(_sequence_parallel)
    assert [res[r]["slow"] for r in (0, 1)] == [3, 3]  # first call, 7 -> 8, 8 -> 5; the repeat of 7 is free
    _assert_fast_shape_errors({r: res[r]["unbalanced"] for r in (0, 1)}, (0, 1), "DistributedLinearAllGather")
    assert "balanced block" in res[0]["unbalanced"][1]
    assert res[2]["unbalanced"][0] == res[3]["unbalanced"][0] == "ok"  # inactive: zero-volume in, out


# ---------------------------------------------------------------- the feature convolution


def _feature_conv():
    me = dist.get_rank()
    P = _grid((2, 0, 3, 1), (1, 1, 2, 2))
    torch.manual_seed(1)
    conv = DistributedConv2d(P, 2, 3, 3, padding=1, padding_mode="reflect")
    gathers = []
    real = conv_feature.gather_call_info
    conv_feature.gather_call_info = lambda *a, **k: gathers.append(1) or real(*a, **k)
    try:
        out = {}
        xg = torch.randn(2, 2, 7, 5)
        x = xg[local_slices(xg.shape, P.shape, P.index)].requires_grad_(True)
        for _ in range(3):
            conv(x).square().sum().backward()
        out["gathers"] = len(gathers)
        out["fp64"] = _catch(lambda: conv(x.double() if me == 3 else x))
        out["unbalanced"] = _catch(lambda: conv(x[..., :1, :] if me == 0 else x))
        out["again"] = _catch(lambda: tuple(conv(x).shape))
        out["gathers_after"] = len(gathers)
    finally:
        conv_feature.gather_call_info = real
    k3, k5 = DistributedConv2d(P, 2, 3, 3, padding=1), DistributedConv2d(P, 2, 3, 5, padding=2)
    out["other_layer"] = _catch(lambda: (k3 if me == 0 else k5)(x))  # a program-order bug, first calls
    return out


def test_feature_conv_gathers_only_on_change_and_raises_everywhere_on_disagreement():
    res = _run(_feature_conv)
    for r in range(4):
        assert res[r]["gathers"] == 1, res[r]
        assert res[r]["again"][0] == "ok" and res[r]["gathers_after"] == 4  # first, fp64, unbalanced, again
    op = "DistributedFeatureConv2d"
    _assert_fast_shape_errors({r: res[r]["fp64"] for r in range(4)}, range(4), op)
    assert "one dtype" in res[0]["fp64"][1] and "torch.float64" in res[0]["fp64"][1]
    _assert_fast_shape_errors({r: res[r]["unbalanced"] for r in range(4)}, range(4), op)
    assert "balanced decomposition" in res[1]["unbalanced"][1]
    for r in range(4):  # different layers on the first call: refused on every rank, not a gloo abort
        kind, msg, _ = res[r]["other_layer"]
        assert kind == "CollectiveMismatchError" and "not calling the same layer" in msg, res[r]["other_layer"]


# ---------------------------------------------------------------- the primitive modules


def _primitive_modules():
    me = dist.get_rank()
    P = _grid((0, 1, 2, 3), (2, 2))
    rs, asr, ag = ReduceScatter(P, axes_reduce_scatter=(1,)), AllSumReduce(P, axes_reduce=(0,)), AllGather(P, (1,))
    out = {}
    for _ in range(2):  # steady state first: the disagreement is then found by the flag, not by a first gather
        rs(torch.randn(4, 4))
        asr(torch.randn(4))
        ag(torch.randn(2, 3, dtype=torch.bfloat16))
    out["slow"] = (rs.agreement.slow_calls, asr.agreement.slow_calls, ag.agreement.slow_calls)
    out["rs"] = _catch(lambda: rs(torch.randn(4, 5 if me == 1 else 4)))  # sub-grids {0, 1} and {2, 3}
    out["asr"] = _catch(lambda: asr(torch.randn(3 if me == 2 else 4)))  # sub-grids {0, 2} and {1, 3}
    out["ag"] = _catch(lambda: ag(torch.randn(2, 3, dtype=torch.float16 if me == 3 else torch.bfloat16)))
    return out


def test_primitive_modules_raise_on_every_worker_of_the_sub_grid():
    res = _run(_primitive_modules)
    assert all(res[r]["slow"] == (1, 1, 1) for r in range(4))
    _assert_fast_shape_errors({r: res[r]["rs"] for r in (0, 1)}, (0, 1), "ReduceScatter")
    _assert_fast_shape_errors({r: res[r]["asr"] for r in (0, 2)}, (0, 2), "AllSumReduce")
    _assert_fast_shape_errors({r: res[r]["ag"] for r in (2, 3)}, (2, 3), "AllGather")
    assert res[2]["rs"][0] == res[1]["asr"][0] == res[0]["ag"][0] == "ok"


# ------------------------------------------------------------- DistributedLinear: see test_misuse_agreement_linear.py


def test_load_sequential_still_round_trips_after_agreement():
    """The agreement record is not state: a layer's state_dict is unchanged by it."""
    res = _run(_state_keys)
    assert all(keys <= {"weight", "bias", "_extra_state"} for keys in res)


def _state_keys():
    P = _grid((0, 1, 2, 3), (2, 2))
    layer = DistributedLinearReduceScatter(P, 4, 4)
    layer(torch.randn(3, 2))
    seq = nn.Linear(4, 4) if dist.get_rank() == 0 else None
    load_sequential(layer, seq)
    return set(layer.state_dict())


# ---------------------------------------------------------------- geometry torch refuses


GEOMETRIES = [  # (kernel, global extent, padding, padding_mode): each one torch.nn.Conv1d refuses
    (5, 3, 0, "zeros"),  # kernel larger than the padded input
    (3, 4, 5, "circular"),  # wraps around more than once
    (3, 4, 5, "reflect"),  # reflect padding as wide as the input
]


def _refused_geometry():
    P = _grid((1, 0), (1, 1, 2))
    out = []
    for k, n, pad, mode in GEOMETRIES:
        seq = nn.Conv1d(2, 2, k, padding=pad, padding_mode=mode)
        try:
            seq(torch.randn(1, 2, n))
            torch_refuses = False
        except RuntimeError:
            torch_refuses = True
        layer = DistributedConv1d(P, 2, 2, k, padding=pad, padding_mode=mode) if P.active else None
        xg = torch.randn(1, 2, n)
        got = _catch(lambda layer=layer, xg=xg: layer(xg[local_slices(xg.shape, P.shape, P.index)]))
        out.append((torch_refuses, got[0], got[1] if len(got) > 2 else ""))
    return out


def test_geometry_torch_refuses_is_refused_on_every_rank():
    for r, cases in enumerate(run_ranks(2, _refused_geometry, pg_timeout=PG_DEFAULT, timeout=60)):
        for (torch_refuses, kind, msg), geometry in zip(cases, GEOMETRIES):
            assert torch_refuses, geometry
            assert kind in ("ShapeError", "UnsupportedError") and f"DistributedFeatureConv1d [rank {r}]" in msg, (
                geometry, kind, msg)
