"""ReduceScatter: values and gradients against float64 references, the adjoint test, and the errors.

Each worker of a sub-grid holds its own random full-extent partial tensor; the
reference sums them in float64 and cuts this worker's balanced block.  Three dtype
variants (``VARIANTS``): fp32 on normal data (tolerance table); bf16 added in bf16 on
integer-valued data, where every partial sum is exact, so any difference is a
data-movement bug; and bf16 with ``reduce_dtype=float32`` on multiples of 1/16, which
fp32 adds exactly and bf16 would not, so an exact match proves the fp32 adding.  The
backward is an all-gather: exact in every dtype.  Each case runs with and without
``DISTFUSE_DEBUG=1`` (NaN-filled scratch buffers, agreement checks).
"""

import os

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError
from distfuse.primitives.reduce_scatter import ReduceScatter, reduce_scatter
from distfuse.testing import adjoint_check, run_ranks
from tests.test_all_gather import CASES, VARIANTS, _catch, _data, _debug_mode, _geometry
from tests.tolerances import ADJOINT_RTOL, tol


def _run_case(ranks, pshape, global_shape, axes, keep):
    P_x = Partition.world().create_partition_inclusive(ranks).create_cartesian_topology_partition(pshape)
    layer = ReduceScatter(P_x, axes_reduce_scatter=axes, axes_keep=keep)
    axes = layer.axes_reduce_scatter
    checks = 0
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        for debug_on in (True, False):
            _debug_mode(debug_on)
            for dtype, reduce_dtype, kind in VARIANTS:
                if not P_x.active:
                    x = zero_volume_tensor(dtype=dtype, requires_grad=True)
                    y = reduce_scatter(x, layer.P_sub, reduce_dtype)
                    y.backward(torch.ones_like(y))
                    assert y.shape == (0,) and x.grad.shape == (0,)
                    continue
                g = _geometry(P_x, global_shape, axes)
                me = P_x.rank
                xs = {r: _data(g.shape, 100 + r, kind).to(dtype) for r in g.members}
                x = xs[me].clone().requires_grad_(True)
                y = reduce_scatter(x, layer.P_sub, reduce_dtype) if reduce_dtype else layer(x)
                want = sum(xs[r].double() for r in g.members)[g.rel(me)]
                opts = tol(dtype) if kind == "normal" else dict(rtol=0, atol=0)
                assert y.dtype == dtype and y.is_contiguous()
                torch.testing.assert_close(y, want.to(dtype), **opts)
                # Adjoint: an all-gather of every member's output gradient, exact.
                dys = {r: _data(tuple(s.stop - s.start for s in g.rel(r)), 200 + r).to(dtype) for r in g.members}
                y.backward(dys[me])
                grad = torch.full(g.shape, float("nan"), dtype=dtype)
                for r in g.members:
                    grad[g.rel(r)] = dys[r]
                torch.testing.assert_close(x.grad, grad, rtol=0, atol=0)
                checks += 2
        x = _data(_geometry(P_x, global_shape, axes).shape, 12) if P_x.active else zero_volume_tensor()
        lhs, rhs = adjoint_check(layer, x)
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return P_x.active, checks


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reduce_scatter(case):
    _, world, ranks, pshape, global_shape, axes, keep = case
    out = run_ranks(world, _run_case, ranks, pshape, global_shape, axes, keep)
    assert sorted(w for w, (a, _) in enumerate(out) if a) == sorted(ranks)
    assert all(n == 12 for a, n in out if a)


def _strided_input_and_expanded_gradient():
    P_x = Partition.world().create_cartesian_topology_partition([2, 2])
    for axes, shape in (((0,), (6, 4)), ((1,), (7, 5)), ((0, 1), (6, 4))):  # fast, padded, fast with a copy
        layer = ReduceScatter(P_x, axes_reduce_scatter=axes)
        g = _geometry(P_x, shape, axes)
        xs = {r: _data(g.shape, 300 + r) for r in g.members}
        x = xs[P_x.rank].t().contiguous().t().requires_grad_(True)  # column-major strides
        assert not x.is_contiguous()
        y = layer(x)
        torch.testing.assert_close(y, sum(xs.values())[g.rel(P_x.rank)], **tol(torch.float64))
        y.sum().backward()  # the gradient arrives expanded (stride 0)
        torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)
    return True


def test_strided_input_and_expanded_gradient():
    assert run_ranks(4, _strided_input_and_expanded_gradient) == [True] * 4


def _errors():
    me = dist.get_rank()
    P_x = Partition.world().create_partition_inclusive(range(4)).create_cartesian_topology_partition([2, 2])
    out = {
        "neither": _catch(lambda: ReduceScatter(P_x)),
        "both": _catch(lambda: ReduceScatter(P_x, axes_reduce_scatter=0, axes_keep=1)),
        "range": _catch(lambda: ReduceScatter(P_x, axes_keep=(0, 5))),
    }
    layer = ReduceScatter(P_x, axes_reduce_scatter=(0,))
    active = P_x.active
    out["ndim"] = _catch(lambda: layer(torch.randn(2, 3, 4) if active else zero_volume_tensor()))
    out["inactive-data"] = _catch(lambda: layer(torch.randn(6, 2)))
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        _debug_mode(True)
        # Column sub-grids are world ranks {0, 2} and {1, 3}; rank 2's reduced extent differs.
        shape = (5, 2) if me == 2 else (6, 2)
        out["debug-extent"] = _catch(lambda: layer(torch.randn(shape) if active else zero_volume_tensor()))
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return out


def test_errors_name_op_rank_and_values():
    out = run_ranks(5, _errors)
    for r in range(5):
        assert out[r]["neither"][0] == PartitionError.__name__
        assert f"ReduceScatter [rank {r}]: exactly one of axes_reduce_scatter and axes_keep" in out[r]["neither"][1]
        assert "got both" in out[r]["both"][1]
        assert "axes_keep entry 5" in out[r]["range"][1] and "expected in [-2, 2), got 5" in out[r]["range"][1]
    for r in range(4):
        assert out[r]["ndim"][0] == ShapeError.__name__ and "expected 2, got 3" in out[r]["ndim"][1]
        assert out[r]["inactive-data"] is None
    assert out[4]["inactive-data"][0] == ShapeError.__name__ and "zero-volume" in out[4]["inactive-data"][1]
    for r in (0, 2):
        kind, msg = out[r]["debug-extent"]
        assert kind == CollectiveMismatchError.__name__ and "(5, 2)" in msg and "(6, 2)" in msg
    assert out[1]["debug-extent"] is None and out[3]["debug-extent"] is None
