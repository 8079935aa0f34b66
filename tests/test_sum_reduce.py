"""SumReduce: values against a sequential float64 reference, the adjoint test, and the exact adjointness
with Broadcast(P_y, P_x) (transpose flags swapped), plus the errors.

``SumReduce(P_x, P_y, ts, td)`` sums P_x blocks into P_y along the map of
``Broadcast(P_y, P_x, transpose_src=td, transpose_dest=ts)``; the reference map comes
from numpy broadcasting (``reference_sources`` in test_broadcast), independent of the
planner.  Case ids name the Broadcast example whose adjoint they are; examples that
need more than 8 workers are scaled down.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distfuse import Partition
from distfuse.primitives.broadcast import Broadcast
from distfuse.primitives.sum_reduce import SumReduce, sum_reduce, sum_reduce_plan
from distfuse.testing import adjoint_check, run_ranks
from tests.test_broadcast import (
    Case,
    assert_adjoint,
    block,
    block_shape,
    catch,
    grid,
    make_partition,
    placeholder,
    reference_sources,
)
from tests.tolerances import tol

# Case.x is SumReduce's P_x (the blocks summed), Case.y its P_y (the sums); gshape has dim(P_x) dimensions.
CASES = [
    pytest.param(Case(4, (range(4), [4]), ([0], [1]), (7,)), id="ex1-adjoint-4to1"),
    pytest.param(Case(6, (range(6), [2, 3]), ([3], [1]), (5, 3)), id="ex2-adjoint-2x3to1"),
    pytest.param(Case(8, (range(8), [2, 4]), ([5, 2], [2, 1]), (5, 6)), id="ex3-adjoint-scaled-2x4to2x1-overlap"),
    pytest.param(Case(8, (range(8), [2, 2, 2]), ([1, 6], [1, 1, 2]), (2, 3, 5)),
                 id="ex4-adjoint-scaled-2x2x2to1x1x2"),
    # DistDL's general linear layer reduces P_W (3x4) into P_y (1x3) with transpose_src; scaled to 2x3 -> 1x2.
    pytest.param(Case(8, (range(6), [2, 3]), ([6, 7], [1, 2]), (4, 5), ts=True),
                 id="linear-scaled-2x3to1x2-transpose_src-disjoint"),
    pytest.param(Case(6, (range(6), [2, 3]), ([0, 4], [1, 2]), (4, 5), td=True),
                 id="ex8-adjoint-2x3to1x2-transpose_dest-overlap"),
    pytest.param(Case(3, ([2, 0, 1], [3, 1]), ([0, 1, 2], [1, 3]), (4, 7), ts=True),
                 id="ex6-adjoint-3x1to1x3-transpose_src-same-ranks"),
    pytest.param(Case(5, ([1, 2], [2]), ([3], [1]), (6,)), id="2to1-extra-inactive-ranks"),
    pytest.param(Case(5, ([1, 2], [2]), ([3], [1]), (6,), pb=False), id="2to1-extra-inactive-ranks-nobatch"),
    pytest.param(Case(6, (range(6), [3, 2]), ([1, 0], [2]), (3, 5)), id="3x2to2-left-extension"),
    pytest.param(Case(6, (range(6), [3, 2]), ([0, 2, 4], [3, 1]), (2, 4)), id="3x2to3x1-empty-block"),
    pytest.param(Case(4, (range(4), [2, 2]), (range(4), [2, 2]), (5, 3)), id="identity-2x2"),
    pytest.param(Case(4, ([0, 1, 3], None), ([2], None), (5,)), id="plain-partitions-3to1"),
]


def _sum_reduce_values(c: Case):
    """fp32 and bf16 forward (sums) and backward (copies), the fp64 adjoint test, and <B u, v> = <u, S v>."""
    P_world = Partition.world()
    P_x, P_y = make_partition(P_world, *c.x), make_partition(P_world, *c.y)
    layer = SumReduce(P_x, P_y, transpose_src=c.ts, transpose_dest=c.td, preserve_batch=c.pb)
    gx, gy = grid(c.x), grid(c.y)
    target = reference_sources(gy, gx, ts=c.td, td=c.ts)  # P_x partition rank -> P_y partition rank
    y_shapes = [block_shape(c.gshape, gy, j) for j in range(P_y.size)]
    x_shape = y_shapes[int(target[P_x.rank])] if P_x.active else None
    role = ("x" if P_x.active else "") + ("y" if P_y.active else "")
    for dtype in (torch.float32, torch.bfloat16):
        x = block(1, P_x.rank, x_shape, dtype).requires_grad_(True) if P_x.active else placeholder(dtype, P_y.active)
        y = layer(x)
        if P_y.active:
            want = torch.zeros(y_shapes[P_y.rank], dtype=torch.float64)
            for i in np.flatnonzero(target == P_y.rank):
                want += block(1, int(i), y_shapes[P_y.rank], dtype).double()
            assert y.dtype == dtype
            torch.testing.assert_close(y.double(), want, **tol(dtype))
            if dtype == torch.bfloat16:  # a few bf16 randn values sum exactly in fp32: one rounding at the end
                assert torch.equal(y, want.to(dtype)), "bf16 sums must accumulate in fp32 and round once"
            if np.count_nonzero(target == P_y.rank) == 1 and P_x.active and y.numel():
                assert y.data_ptr() != x.data_ptr(), "the output must be a clone even when locally identity"
            dy = block(2, P_y.rank, y.shape, dtype)
        else:
            want_shape = (x.shape[0], 0) if (P_x.active and c.pb) else (0,)
            assert tuple(y.shape) == want_shape, f"zero-volume output {tuple(y.shape)}, expected {want_shape}"
            dy = torch.zeros_like(y)
        assert y.requires_grad == (P_x.active or P_y.active)
        if y.requires_grad:
            y.backward(dy)
        if P_x.active:
            assert torch.equal(x.grad, block(2, int(target[P_x.rank]), x_shape, dtype)), f"{dtype}: wrong dy copied"
        elif x.requires_grad:
            assert tuple(x.grad.shape) == tuple(x.shape)
    x64 = block(3, P_x.rank, x_shape) if P_x.active else placeholder(torch.float64)
    adjoint = adjoint_check(layer, x64)
    # SumReduce(P_x, P_y, ts, td) is the adjoint of Broadcast(P_y, P_x, td, ts): <B u, v> = <u, S v>.
    bcast = Broadcast(P_y, P_x, transpose_src=c.td, transpose_dest=c.ts)
    u = block(4, P_y.rank, y_shapes[P_y.rank]) if P_y.active else placeholder(torch.float64)
    v = block(5, P_x.rank, x_shape) if P_x.active else placeholder(torch.float64)
    with torch.no_grad():
        b_u, s_v = bcast(u), layer(v)
    sums = torch.stack([(b_u * v).sum() if P_x.active else torch.zeros((), dtype=torch.float64),
                        (u * s_v).sum() if P_y.active else torch.zeros((), dtype=torch.float64)])
    dist.all_reduce(sums)
    return role, adjoint, (float(sums[0]), float(sums[1]))


@pytest.mark.parametrize("case", CASES)
def test_sum_reduce_values_adjoint_and_broadcast_duality(case):
    out = run_ranks(case.world, _sum_reduce_values, case)
    x_ranks, y_ranks = set(case.x[0]), set(case.y[0])
    for w, (role, adjoint, duality) in enumerate(out):
        assert role == ("x" if w in x_ranks else "") + ("y" if w in y_ranks else "")
        assert_adjoint(adjoint)
        assert_adjoint(duality)


# ---------------------------------------------------------------- errors


def _construct_error(world, x, y, ts, td):
    P_world = Partition.world()
    P_x, P_y = make_partition(P_world, *x), make_partition(P_world, *y)
    return catch(SumReduce, P_x, P_y, transpose_src=ts, transpose_dest=td)


ERRORS = [
    # Adjoint of example 5 (1x1x3 to 3x3x2), scaled: P_y 1x1x3 does not broadcast to P_x 2x1x2.
    pytest.param((4, (range(4), [2, 1, 2]), ([0, 1, 2], [1, 1, 3]), False, False),
                 ["P_y does not broadcast to P_x", "dimension 2", "[1, 1, 3]", "[2, 1, 2]"],
                 id="ex5-adjoint-scaled-2x1x2to1x1x3"),
    pytest.param((3, (range(3), [3, 1]), ([0, 1, 2], [1, 3]), False, False),
                 ["dimension 1", "transpose_src=True or transpose_dest=True"], id="ex6-adjoint-3x1to1x3-no-transpose"),
    pytest.param((2, ([0, 1], [2]), ([0, 1], [1, 2]), False, False), ["dim(P_y) = 2 exceeds dim(P_x) = 1"],
                 id="dim-P_y-exceeds-dim-P_x"),
]


@pytest.mark.parametrize("args, fragments", ERRORS)
def test_partitions_that_do_not_reduce_raise_on_every_rank(args, fragments):
    out = run_ranks(args[0], _construct_error, *args)
    for w, err in enumerate(out):
        assert err is not None, f"rank {w} raised nothing"
        kind, msg = err
        assert kind == "PartitionError" and f"SumReduce [rank {w}]" in msg
        for f in fragments:
            assert f in msg, f"{f!r} not in {msg!r}"


def _bad_inputs():
    P_world = Partition.world()
    me = dist.get_rank()
    P_x = make_partition(P_world, [0, 1, 2], [3])
    P_y = make_partition(P_world, [0], [1])
    layer = SumReduce(P_x, P_y)
    mixed_shapes = catch(layer, torch.randn(2 + (me == 1)))
    P_x2 = make_partition(P_world, [1, 2], [2])
    inactive = catch(SumReduce(P_x2, P_y), torch.randn(3))  # rank 0 is only in P_y but passes data
    return mixed_shapes, inactive


def test_bad_inputs_raise_the_same_error_on_every_rank():
    out = run_ranks(3, _bad_inputs)
    for w, (mixed_shapes, inactive) in enumerate(out):
        assert mixed_shapes[0] == "ShapeError" and f"SumReduce [rank {w}]" in mixed_shapes[1]
        assert "summed into world rank 0 must have one shape" in mixed_shapes[1] and "1: (3,)" in mixed_shapes[1]
        assert inactive[0] == "ShapeError" and "world rank 0 is not active in P_x" in inactive[1]


def _debug_dtype_mismatch():
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        P_world = Partition.world()
        me = dist.get_rank()
        P_x = make_partition(P_world, range(4), [2, 2])
        P_y = make_partition(P_world, [2, 3], [2, 1])
        layer = SumReduce(P_x, P_y)
        dtype = torch.bfloat16 if me == 3 else torch.float32
        x = torch.randn(3, 2, dtype=dtype)
        module_err = catch(layer, x)
        functional_err = catch(sum_reduce, x, layer.plan, (3, 2) if P_y.active else None, dtype,
                               P_union=layer.P_union)
        return module_err, functional_err
    finally:
        del os.environ["DISTFUSE_DEBUG"]


def test_debug_mode_mismatched_dtypes_raise_collective_mismatch_on_every_rank():
    out = run_ranks(4, _debug_dtype_mismatch)
    for w, (module_err, functional_err) in enumerate(out):
        assert module_err[0] == "CollectiveMismatchError" and "rank 3: torch.bfloat16" in module_err[1]
        assert functional_err[0] == "CollectiveMismatchError", functional_err
        assert f"SumReduce [rank {w}]" in functional_err[1] and "bfloat16" in functional_err[1]


def _functional_matches_module():
    P_world = Partition.world()
    me = dist.get_rank()
    P_x = make_partition(P_world, range(4), [2, 2])
    P_y = make_partition(P_world, [3, 1], [2, 1])
    plan = sum_reduce_plan(P_x, P_y)
    x = block(6, me, (2, 3))
    y = sum_reduce(x, plan, (2, 3) if P_y.active else None)
    if not P_y.active:
        return tuple(y.shape) == (2, 0)
    row = P_y.rank  # P_y worker r sums row r of P_x (ranks 2r and 2r + 1)
    want = block(6, 2 * row, (2, 3)) + block(6, 2 * row + 1, (2, 3))
    return torch.allclose(y, want, **tol(torch.float64, terms=2))


def test_functional_form_with_known_shapes():
    assert run_ranks(4, _functional_matches_module) == [True] * 4
