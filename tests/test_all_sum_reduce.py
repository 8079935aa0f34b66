"""AllSumReduce: values and gradients against float64 references, the adjoint test, and the errors.

Each worker holds its own random tensor (the shape of its sub-grid's region of a global
tensor, so different sub-grids pass different shapes); the reference sums the sub-grid's
tensors in float64.  The dtype variants (``VARIANTS``) are those of the ReduceScatter
tests: fp32, bf16 added in bf16 on integer data, and bf16 added in fp32 on multiples of
1/16 (the last two exact).
The operator is self-adjoint, so the gradient is checked against the same reference.
"""

import os

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError
from distfuse.primitives.all_sum_reduce import AllSumReduce, all_sum_reduce
from distfuse.testing import adjoint_check, run_ranks
from tests.test_all_gather import CASES, VARIANTS, _catch, _data, _debug_mode, _geometry
from tests.tolerances import ADJOINT_RTOL, tol

# The gather cases, plus ones that reduce over nothing (an identity) and over a size-1 axis.
SUM_CASES = CASES + [
    ("w4-2x2-keep-all-identity", 4, [0, 1, 2, 3], [2, 2], (6, 5), None, (0, 1)),
    ("w4-4x1-size-one-axis", 4, [0, 1, 2, 3], [4, 1], (9, 3), (1,), None),
]


def _run_case(ranks, pshape, global_shape, axes, keep):
    P_x = Partition.world().create_partition_inclusive(ranks).create_cartesian_topology_partition(pshape)
    layer = AllSumReduce(P_x, axes_reduce=axes, axes_keep=keep)
    axes = layer.axes_reduce
    checks = 0
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        for debug_on in (True, False):
            _debug_mode(debug_on)
            for dtype, reduce_dtype, kind in VARIANTS:
                if not P_x.active:
                    x = zero_volume_tensor(dtype=dtype, requires_grad=True)
                    y = all_sum_reduce(x, layer.P_sub, reduce_dtype)
                    y.backward(torch.ones_like(y))
                    assert y.shape == (0,) and x.grad.shape == (0,)
                    continue
                g = _geometry(P_x, global_shape, axes)
                me = P_x.rank
                xs = {r: _data(g.shape, 100 + r, kind).to(dtype) for r in g.members}
                x = xs[me].clone().requires_grad_(True)
                y = all_sum_reduce(x, layer.P_sub, reduce_dtype) if reduce_dtype else layer(x)
                assert y.data_ptr() != x.data_ptr() or x.numel() == 0  # never in place, not even an identity
                opts = tol(dtype) if kind == "normal" else dict(rtol=0, atol=0)
                torch.testing.assert_close(y, sum(xs[r].double() for r in g.members).to(dtype), **opts)
                dys = {r: _data(g.shape, 200 + r, kind).to(dtype) for r in g.members}
                y.backward(dys[me])
                torch.testing.assert_close(x.grad, sum(dys[r].double() for r in g.members).to(dtype), **opts)
                checks += 2
        x = _data(_geometry(P_x, global_shape, axes).shape, 12) if P_x.active else zero_volume_tensor()
        lhs, rhs = adjoint_check(layer, x)
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return P_x.active, checks


@pytest.mark.parametrize("case", SUM_CASES, ids=[c[0] for c in SUM_CASES])
def test_all_sum_reduce(case):
    _, world, ranks, pshape, global_shape, axes, keep = case
    out = run_ranks(world, _run_case, ranks, pshape, global_shape, axes, keep)
    assert sorted(w for w, (a, _) in enumerate(out) if a) == sorted(ranks)
    assert all(n == 12 for a, n in out if a)


def _any_tensor_shape():
    # DistDL's AllSumReduce does not require the tensor to be partitioned by P_x: a 1-D tensor
    # of per-channel statistics on a 2-D partition is summed over the chosen axes.
    P_x = Partition.world().create_cartesian_topology_partition([2, 2])
    layer = AllSumReduce(P_x, axes_reduce=(0,))
    y = layer(torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64))
    return y.tolist()


def test_tensor_need_not_be_partitioned_by_P_x():
    # Columns {0, 2} and {1, 3}: 1 + 3 and 2 + 4.
    assert run_ranks(4, _any_tensor_shape) == [[4.0] * 3, [6.0] * 3, [4.0] * 3, [6.0] * 3]


def _strided_input_and_expanded_gradient():
    P_x = Partition.world().create_cartesian_topology_partition([2, 2])
    layer = AllSumReduce(P_x, axes_reduce=(1,))
    g = _geometry(P_x, (7, 5), (1,))
    xs = {r: _data(g.shape, 300 + r) for r in g.members}
    x = xs[P_x.rank].t().contiguous().t().requires_grad_(True)  # column-major strides
    assert not x.is_contiguous()
    y = layer(x)
    torch.testing.assert_close(y, sum(xs.values()), **tol(torch.float64))
    y.sum().backward()  # the gradient arrives expanded (stride 0)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), rtol=0, atol=0)
    return True


def test_strided_input_and_expanded_gradient():
    assert run_ranks(4, _strided_input_and_expanded_gradient) == [True] * 4


def _errors():
    me = dist.get_rank()
    P_x = Partition.world().create_partition_inclusive(range(4)).create_cartesian_topology_partition([2, 2])
    out = {
        "neither": _catch(lambda: AllSumReduce(P_x)),
        "both": _catch(lambda: AllSumReduce(P_x, (0,), (1,))),
        "range": _catch(lambda: AllSumReduce(P_x, axes_reduce=(-3,))),
        "repeat": _catch(lambda: AllSumReduce(P_x, axes_reduce=(0, 0))),
        "not-cartesian": _catch(lambda: AllSumReduce(Partition.world(), axes_reduce=(0,))),
    }
    layer = AllSumReduce(P_x, axes_reduce=(0, 1))
    out["inactive-data"] = _catch(lambda: layer(torch.randn(4)))
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        _debug_mode(True)
        shape = (3,) if me == 0 else (4,)
        out["debug-shape"] = _catch(lambda: layer(torch.randn(shape) if P_x.active else zero_volume_tensor()))
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return out


def test_errors_name_op_rank_and_values():
    out = run_ranks(5, _errors)
    for r in range(5):
        assert out[r]["neither"][0] == PartitionError.__name__
        assert f"AllSumReduce [rank {r}]: exactly one of axes_reduce and axes_keep" in out[r]["neither"][1]
        assert "got both" in out[r]["both"][1]
        assert "expected in [-2, 2), got -3" in out[r]["range"][1]
        assert "without repeats" in out[r]["repeat"][1]
        assert "expected CartesianPartition, got Partition" in out[r]["not-cartesian"][1]
    assert all(out[r]["inactive-data"] is None for r in range(4))
    assert out[4]["inactive-data"][0] == ShapeError.__name__ and "AllSumReduce [rank 4]" in out[4]["inactive-data"][1]
    for r in range(4):
        kind, msg = out[r]["debug-shape"]
        assert kind == CollectiveMismatchError.__name__ and "(3,)" in msg and "(4,)" in msg
