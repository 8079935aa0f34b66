"""Broadcast: values against a sequential reference, the adjoint test, the broadcast rules and the errors.

The reference map (which P_x worker each P_y worker copies) is computed independently
of distfuse's planner with numpy broadcasting: a grid of P_x partition ranks,
transposed when ``transpose_src``, ``np.broadcast_to`` P_y's effective shape, and
transposed back when ``transpose_dest``.  Block data come from a seeded generator per
P_x worker, so every rank can rebuild any block.

The pool has at most 8 ranks, so the reference's examples that need more workers are
scaled down; each case id says which example it mirrors.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist

import distfuse.primitives.broadcast as bmod
from distfuse import CollectiveMismatchError, Partition, PartitionError, ShapeError, union_partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape
from distfuse.primitives.broadcast import Broadcast, broadcast, broadcast_plan
from distfuse.testing import adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL, tol

# ---------------------------------------------------------------- helpers shared with test_sum_reduce


class Case(NamedTuple):
    """One Broadcast (or SumReduce) configuration.

    ``x``/``y`` are ``(world ranks, grid shape)``; a shape of None makes a plain
    partition without a topology.  ``gshape`` is the global shape the blocks are cut
    from (uneven and possibly empty blocks), with one dimension per P_y dimension.
    """

    world: int
    x: tuple
    y: tuple
    gshape: tuple
    ts: bool = False
    td: bool = False
    pb: bool = True


def make_partition(P_world, ranks, shape):
    P = P_world.create_partition_inclusive(list(ranks))
    return P if shape is None else P.create_cartesian_topology_partition(shape)


def grid(spec) -> tuple[int, ...]:
    ranks, shape = spec
    return (len(ranks),) if shape is None else tuple(shape)


def reference_sources(src_grid, dst_grid, ts, td) -> np.ndarray:
    """For each destination partition rank (row-major), the source partition rank it copies; numpy rules."""
    g = np.arange(int(np.prod(src_grid))).reshape(src_grid)
    if ts:
        g = g.T
    b = np.broadcast_to(g, tuple(dst_grid)[::-1] if td else tuple(dst_grid))
    if td:
        b = b.T
    return np.ascontiguousarray(b).reshape(-1)


def block_shape(gshape, part_grid, partition_rank) -> tuple[int, ...]:
    """Balanced block of ``gshape`` on a grid left-extended with ones to ``len(gshape)`` dimensions."""
    pad = len(gshape) - len(part_grid)
    ext = (1,) * pad + tuple(part_grid)
    idx = (0,) * pad + tuple(int(i) for i in np.unravel_index(partition_rank, part_grid))
    return local_shape(gshape, ext, idx)


def block(seed: int, k: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Fresh random data for block ``k``, reproducible on any rank; rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(1000 * seed + k)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


def placeholder(dtype, requires_grad=False) -> torch.Tensor:
    return zero_volume_tensor(dtype=dtype, requires_grad=requires_grad)


def assert_adjoint(pair):
    fwd, adj = pair
    assert fwd != 0.0, "the dot-product test is vacuous: <F x, y> is 0"
    assert abs(fwd - adj) <= ADJOINT_RTOL * max(abs(fwd), abs(adj)), f"<Fx,y>={fwd!r} but <x,F*y>={adj!r}"


def catch(fn, *args, **kwargs):
    """Run ``fn`` and return ``(exception class name, message)`` or None; for errors raised on every rank."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the parent asserts the type
        return type(exc).__name__, str(exc)
    return None


# ---------------------------------------------------------------- values and adjoint

CASES = [
    pytest.param(Case(4, ([0], [1]), (range(4), [4]), (7,)), id="ex1-1to4"),
    pytest.param(Case(6, ([3], [1]), (range(6), [2, 3]), (5, 3)), id="ex2-1to2x3"),
    pytest.param(Case(8, ([5, 2], [2, 1]), (range(8), [2, 4]), (5, 6)), id="ex3-scaled-2x1to2x4-overlap-uneven"),
    pytest.param(Case(8, ([1, 6], [1, 1, 2]), (range(8), [2, 2, 2]), (2, 3, 5)), id="ex4-scaled-1x1x2to2x2x2"),
    pytest.param(Case(8, ([6, 7], [1, 2]), (range(6), [2, 3]), (5, 4), ts=True),
                 id="ex7-scaled-1x2to2x3-transpose_src-disjoint"),
    pytest.param(Case(6, ([0, 4], [2, 1]), (range(6), [3, 2]), (5, 4), td=True),
                 id="ex8-scaled-2x1to3x2-transpose_dest"),
    pytest.param(Case(3, ([0, 1, 2], [1, 3]), ([2, 0, 1], [3, 1]), (4, 7), ts=True),
                 id="ex6-1x3to3x1-transpose_src-same-ranks"),
    pytest.param(Case(6, ([0, 1, 2], [1, 3]), ([3, 4, 5], [3, 1]), (4, 7), td=True, pb=False),
                 id="ex6-1x3to3x1-transpose_dest-disjoint-nobatch"),
    pytest.param(Case(8, ([7, 2], [1, 2]), (range(6), [3, 2]), (4, 3), ts=True, td=True),
                 id="both-transposes-1x2to3x2"),
    pytest.param(Case(5, ([3], [1]), ([1, 2], [2]), (6,)), id="1to2-extra-inactive-ranks"),
    pytest.param(Case(5, ([3], [1]), ([1, 2], [2]), (6,), pb=False), id="1to2-extra-inactive-ranks-nobatch"),
    pytest.param(Case(6, ([1, 0], [2]), (range(6), [3, 2]), (3, 5)), id="2to3x2-left-extension"),
    pytest.param(Case(6, ([0, 2, 4], [3, 1]), (range(6), [3, 2]), (2, 4)), id="3x1to3x2-empty-block"),
    pytest.param(Case(4, (range(4), [2, 2]), (range(4), [2, 2]), (5, 3)), id="identity-2x2"),
    pytest.param(Case(1, ([0], [1, 1]), ([0], [1, 1]), (3, 2)), id="world1-1x1to1x1"),
    pytest.param(Case(4, ([2], None), ([0, 1, 3], None), (5,)), id="plain-partitions-1to3"),
]


def _broadcast_values(c: Case):
    """fp32 and bf16 forward and backward against the reference, then the fp64 adjoint test."""
    P_world = Partition.world()
    P_x, P_y = make_partition(P_world, *c.x), make_partition(P_world, *c.y)
    layer = Broadcast(P_x, P_y, transpose_src=c.ts, transpose_dest=c.td, preserve_batch=c.pb)
    gx, gy = grid(c.x), grid(c.y)
    src_of = reference_sources(gx, gy, c.ts, c.td)
    x_shapes = [block_shape(c.gshape, gx, i) for i in range(P_x.size)]
    role = ("x" if P_x.active else "") + ("y" if P_y.active else "")
    for dtype in (torch.float32, torch.bfloat16):
        if P_x.active:
            x = block(1, P_x.rank, x_shapes[P_x.rank], dtype).requires_grad_(True)
        else:
            x = placeholder(dtype, requires_grad=P_y.active)
        y = layer(x)
        if P_y.active:
            src = int(src_of[P_y.rank])
            assert torch.equal(y, block(1, src, x_shapes[src], dtype)), f"{dtype}: wrong block copied"
            if src == P_x.rank and y.numel():
                assert y.data_ptr() != x.data_ptr(), "the output must be a clone even when locally identity"
            dy = block(2, P_y.rank, y.shape, dtype)
        else:
            want = (x.shape[0], 0) if (P_x.active and c.pb) else (0,)
            assert tuple(y.shape) == want, f"zero-volume output {tuple(y.shape)}, expected {want}"
            assert y.dtype == dtype
            dy = torch.zeros_like(y)
        assert y.requires_grad == (P_x.active or P_y.active)
        if y.requires_grad:
            y.backward(dy)
        if P_x.active:
            want = torch.zeros(x_shapes[P_x.rank], dtype=torch.float64)
            for j in np.flatnonzero(src_of == P_x.rank):
                want += block(2, int(j), x_shapes[P_x.rank], dtype).double()
            torch.testing.assert_close(x.grad.double(), want, **tol(dtype))
            if dtype == torch.bfloat16:  # a few bf16 randn values sum exactly in fp32: one rounding at the end
                assert torch.equal(x.grad, want.to(dtype)), "bf16 sums must accumulate in fp32 and round once"
        elif x.requires_grad:
            assert x.grad is not None and tuple(x.grad.shape) == tuple(x.shape)
    if P_x.active:
        x64 = block(3, P_x.rank, x_shapes[P_x.rank])
    else:
        x64 = placeholder(torch.float64)
    return role, adjoint_check(layer, x64)


@pytest.mark.parametrize("case", CASES)
def test_broadcast_values_and_adjoint(case):
    out = run_ranks(case.world, _broadcast_values, case)
    x_ranks, y_ranks = set(case.x[0]), set(case.y[0])
    for w, (role, pair) in enumerate(out):
        assert role == ("x" if w in x_ranks else "") + ("y" if w in y_ranks else "")
        assert_adjoint(pair)


def test_reference_map_matches_the_documented_examples():
    # Example 7: P_x 1x3 with transpose_src acts as 3x1 and copies along the 4 columns of P_y 3x4.
    src = reference_sources((1, 3), (3, 4), ts=True, td=False).reshape(3, 4)
    assert (src == np.array([[0] * 4, [1] * 4, [2] * 4])).all()
    # Example 8: P_y 3x4 with transpose_dest acts as 4x3; P_x 4x1 worker i feeds P_y column i.
    src = reference_sources((4, 1), (3, 4), ts=False, td=True).reshape(3, 4)
    assert (src == np.array([[0, 1, 2, 3]] * 3)).all()
    with pytest.raises(ValueError):
        reference_sources((1, 1, 3), (3, 3, 2), False, False)  # example 5 fails in numpy too


def _fake_partition(shape, first_rank):
    size = int(np.prod(shape))
    return SimpleNamespace(ranks=tuple(range(first_rank, first_rank + size)), size=size, shape=tuple(shape))


def _grids():
    for nd in (1, 2, 3):
        yield from itertools.product((1, 2, 3), repeat=nd)


def test_planner_agrees_with_numpy_broadcasting_on_every_small_grid_pair():
    """Every pair of grids with extents 1..3 and up to 3 dimensions, both transposes: same map, same refusals."""
    checked = refused = 0
    for sx, sy in itertools.product(_grids(), _grids()):
        for ts, td in itertools.product((False, True), repeat=2):
            P_x, P_y = _fake_partition(sx, 100), _fake_partition(sy, 0)  # disjoint world ranks
            try:
                want = reference_sources(sx, sy, ts, td)
            except ValueError:
                with pytest.raises(PartitionError, match=r"Broadcast \[rank 0\]: (dim\(P_x\)|P_x does not broadcast)"):
                    broadcast_plan(P_x, P_y, ts, td)
                refused += 1
                continue
            plan = broadcast_plan(P_x, P_y, ts, td)
            assert [plan.source_of(w) - 100 for w in P_y.ranks] == want.tolist(), (sx, sy, ts, td)
            assert sorted(w for d in plan.dests.values() for w in d) == list(P_y.ranks)
            checked += 1
    assert checked > 500 and refused > 500


# ---------------------------------------------------------------- construction errors


def _construct_error(world, x, y, ts, td):
    P_world = Partition.world()
    P_x, P_y = make_partition(P_world, *x), make_partition(P_world, *y)
    return catch(Broadcast, P_x, P_y, transpose_src=ts, transpose_dest=td)


ERRORS = [
    # Example 5 (1x1x3 to 3x3x2) scaled to 4 workers: the last extents 3 and 2 differ.
    pytest.param((4, ([0, 1, 2], [1, 1, 3]), (range(4), [2, 1, 2]), False, False),
                 ["dimension 2", "[1, 1, 3]", "[2, 1, 2]", "must be 1 or equal 2"], id="ex5-scaled-1x1x3to2x1x2"),
    pytest.param((3, ([0, 1, 2], [1, 3]), (range(3), [3, 1]), False, False),
                 ["dimension 1", "[1, 3]", "[3, 1]", "transpose_src=True or transpose_dest=True"],
                 id="ex6-1x3to3x1-no-transpose"),
    pytest.param((2, ([0, 1], [1, 2]), ([0, 1], [2]), False, False), ["dim(P_x) = 2 exceeds dim(P_y) = 1"],
                 id="dim-P_x-exceeds-dim-P_y"),
    pytest.param((2, ([0, 1], [2, 1]), ([0, 1], [2, 1]), True, False), ["dimension 1", "(transpose_src)"],
                 id="2x1to2x1-transpose_src-breaks-it"),
]


@pytest.mark.parametrize("args, fragments", ERRORS)
def test_partitions_that_do_not_broadcast_raise_on_every_rank(args, fragments):
    out = run_ranks(args[0], _construct_error, *args)
    for w, err in enumerate(out):
        assert err is not None, f"rank {w} raised nothing"
        kind, msg = err
        assert kind == "PartitionError" and f"Broadcast [rank {w}]" in msg
        for f in fragments:
            assert f in msg, f"{f!r} not in {msg!r}"
    assert issubclass(PartitionError, ValueError)


# ---------------------------------------------------------------- input errors, raised on every rank


def _bad_inputs():
    P_world = Partition.world()
    me = dist.get_rank()
    P_x = make_partition(P_world, [0], [1])
    P_y = make_partition(P_world, [1, 2], [2])
    layer = Broadcast(P_x, P_y)
    # Rank 2 is only in P_y but passes data.
    x = torch.randn(3) if me in (0, 2) else placeholder(torch.float32)
    inactive_data = catch(layer, x)
    # Rank 0 (P_x) passes a 2-d block to a 1-d partition pair.
    x = torch.randn(3, 2) if me == 0 else placeholder(torch.float32)
    wrong_ndim = catch(layer, x)
    # The functional form checks locally: a P_y worker must say what it receives.
    no_shape = catch(broadcast, placeholder(torch.float32), layer.plan) if me != 0 else None
    return inactive_data, wrong_ndim, no_shape


def test_bad_inputs_raise_the_same_error_on_every_rank():
    out = run_ranks(3, _bad_inputs)
    for w, (inactive_data, wrong_ndim, no_shape) in enumerate(out):
        assert inactive_data[0] == "ShapeError" and "world rank 2 is not active in P_x" in inactive_data[1]
        assert f"[rank {w}]" in inactive_data[1]
        assert wrong_ndim[0] == "ShapeError" and "world rank 0" in wrong_ndim[1]
        assert "expected 1, got 2" in wrong_ndim[1]
        if w:
            assert no_shape[0] == "ShapeError" and "y_shape" in no_shape[1]
    assert issubclass(ShapeError, ValueError)


def _debug_dtype_mismatch():
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        P_world = Partition.world()
        me = dist.get_rank()
        P_x = make_partition(P_world, [0, 1], [2, 1])
        P_y = make_partition(P_world, range(4), [2, 2])
        layer = Broadcast(P_x, P_y)
        dtype = torch.float64 if me == 1 else torch.float32
        x = torch.randn(3, 2, dtype=dtype) if P_x.active else placeholder(dtype)
        module_err = catch(layer, x)
        # The functional form has no metadata; the debug agreement check catches it before any data moves.
        functional_err = catch(broadcast, x, layer.plan, (3, 2), dtype, P_union=layer.P_union)
        return module_err, functional_err
    finally:
        del os.environ["DISTFUSE_DEBUG"]


def test_debug_mode_mismatched_dtypes_raise_collective_mismatch_on_every_rank():
    out = run_ranks(4, _debug_dtype_mismatch)
    for w, (module_err, functional_err) in enumerate(out):
        assert module_err[0] == "CollectiveMismatchError", module_err
        assert "rank 0: torch.float32" in module_err[1] and "rank 1: torch.float64" in module_err[1]
        assert functional_err[0] == "CollectiveMismatchError", functional_err
        assert f"Broadcast [rank {w}]" in functional_err[1] and "float64" in functional_err[1]
    assert issubclass(CollectiveMismatchError, Exception)


# ---------------------------------------------------------------- paths: identity, functional, debug poison


def _boom(*args, **kwargs):
    raise AssertionError("this path must not communicate")


def _paths():
    P_world = Partition.world()
    me = dist.get_rank()
    P = make_partition(P_world, range(4), [2, 2])
    ident = Broadcast(P, P)
    P_x = make_partition(P_world, [3], [1])
    P_y = make_partition(P_world, [0, 1, 2], [3])
    plan = broadcast_plan(P_x, P_y)
    P_union = union_partition(P_x, P_y)
    saved = bmod.exchange, bmod.gather_metadata
    try:
        # Identity: a clone, no metadata, no messages; the backward is a clone too.
        bmod.exchange = bmod.gather_metadata = _boom
        x = block(4, me, (3, 2)).requires_grad_(True)
        y = ident(x)
        y.backward(torch.ones_like(y))
        ident_ok = torch.equal(y, x) and y.data_ptr() != x.data_ptr() and torch.equal(x.grad, torch.ones(3, 2))
        # The functional form with known shapes skips the metadata exchange but moves data.
        bmod.exchange = saved[0]
        os.environ["DISTFUSE_DEBUG"] = "1"  # NaN-poisoned receive buffers and the agreement check
        x = block(5, 0, (4,)) if P_x.active else placeholder(torch.float64)
        y = broadcast(x, plan, (4,) if P_y.active else None, torch.float64, P_union=P_union)
        func_ok = torch.equal(y, block(5, 0, (4,))) if P_y.active else tuple(y.shape) == (4, 0)
    finally:
        bmod.exchange, bmod.gather_metadata = saved
        os.environ.pop("DISTFUSE_DEBUG", None)
    return ident_ok, func_ok


def test_identity_is_a_clone_without_communication_and_functional_skips_metadata():
    assert run_ranks(4, _paths) == [(True, True)] * 4
