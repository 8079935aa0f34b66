"""Repartition and the distribute/collect helpers against a float64 sequential reference.

Every rank builds the same global tensor from a seed and slices its blocks with
``local_slices``; a repartition only moves elements, so values must match exactly
(``torch.equal``, in fp32 and bf16 alike), which is stricter than any tolerance.  The
adjoint test uses ``ADJOINT_RTOL`` from the one tolerance table.

The cases of one world size run in one ``run_ranks`` call (a module-scoped cache), and
each case is then reported under its own readable id.
"""

import itertools
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from distfuse import CollectiveMismatchError, Partition, PartitionError, ShapeError, zero_volume_tensor
from distfuse.geometry.decomposition import block_range, local_shape, local_slices
from distfuse.primitives.distribute import collect_tensor, distribute_tensor
from distfuse.primitives.repartition import Repartition, overlaps, repartition
from distfuse.testing import adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL

# ---------------------------------------------------------------- geometry (no ranks)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 12])
@pytest.mark.parametrize("p_src,p_dst", [(1, 4), (4, 1), (2, 3), (3, 2), (5, 3), (4, 4)])
def test_overlaps_tile_every_destination_block_exactly_once(n, p_src, p_dst):
    for j in range(p_dst):
        covered = []
        for i in range(p_src):
            for dst, ((lo, hi),) in overlaps((n,), (p_src,), (i,), (p_dst,)):
                if dst == (j,):
                    covered += list(range(lo, hi))
        assert sorted(covered) == list(range(*block_range(n, p_dst, j)))


def test_overlaps_are_row_major_and_non_empty():
    hits = overlaps((7, 5), (1, 1), (0, 0), (2, 3))
    assert [j for j, _ in hits] == list(itertools.product(range(2), range(3)))
    assert hits[4] == ((1, 1), ((4, 7), (2, 4)))
    assert overlaps((1, 5), (2, 1), (1, 0), (1, 1)) == []  # an empty source block sends nothing


# ---------------------------------------------------------------- value cases on ranks


@dataclass(frozen=True)
class Case:
    id: str
    world: int
    x: tuple  # (world ranks, partition shape) of P_x
    y: tuple  # ... of P_y
    shape: tuple  # global tensor shape


R4 = (0, 1, 2, 3)
CASES = [
    Case("1to4-7x5", 4, ((0,), (1, 1)), (R4, (2, 2)), (7, 5)),
    Case("4to1-7x5", 4, (R4, (2, 2)), ((3,), (1, 1)), (7, 5)),
    Case("2x2to4x1-7x5", 4, (R4, (2, 2)), (R4, (4, 1)), (7, 5)),
    Case("2x2to4x1-3x1-empty-blocks", 4, (R4, (2, 2)), (R4, (4, 1)), (3, 1)),
    Case("3d-2x1x2to1x2x2-5x3x6", 4, (R4, (2, 1, 2)), (R4, (1, 2, 2)), (5, 3, 6)),
    Case("1d-reversed-ranks-9", 4, (R4, (4,)), ((3, 2, 1, 0), (4,)), (9,)),
    Case("identity-2x2-6x5", 4, (R4, (2, 2)), (R4, (2, 2)), (6, 5)),
    Case("world1-identity-3x2", 1, ((0,), (1, 1)), ((0,), (1, 1)), (3, 2)),
    Case("2to2-swapped-ranks-5x3", 2, ((0, 1), (2, 1)), ((1, 0), (2, 1)), (5, 3)),
    Case("1to2-same-rank-src-4x3", 2, ((1,), (1, 1)), ((1, 0), (1, 2)), (4, 3)),
    Case("2x3to3x2-7x5", 6, (tuple(range(6)), (2, 3)), (tuple(range(6)), (3, 2)), (7, 5)),
    Case("2x3to3x2-2x1-empty-blocks", 6, (tuple(range(6)), (2, 3)), (tuple(range(6)), (3, 2)), (2, 1)),
    Case("overlap-3x1to2x2-inactive-7x5", 6, ((0, 1, 2), (3, 1)), ((1, 2, 3, 4), (2, 2)), (7, 5)),
    Case("disjoint-1x4to2x2-7x5", 8, (R4, (1, 4)), ((4, 5, 6, 7), (2, 2)), (7, 5)),
    Case("disjoint-2x2to1x4-1x3-empty-blocks", 8, ((4, 5, 6, 7), (2, 2)), (R4, (1, 4)), (1, 3)),
]


def _partition(spec):
    ranks, shape = spec
    return Partition.world().create_partition_inclusive(ranks).create_cartesian_topology_partition(shape)


def _global(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _block(g, P):
    return g[local_slices(g.shape, P.shape, P.index)]


def _same(what, got, want, bad):
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        bad.append(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}; "
                   f"values equal: {got.shape == want.shape and torch.equal(got.to(want.dtype), want)}")


def _expected(g, P_x, P_y, x, preserve_batch, identity=False):
    """The reference output of this rank: its P_y block, or the zero-volume rule of the module docstring."""
    if P_y.active:
        return _block(g, P_y)
    if P_x.active and not identity:
        return torch.empty((x.shape[0], 0) if preserve_batch else (0,), dtype=g.dtype)
    # In neither partition (or an identity): a clone of the own input, no communication, so its dtype.
    return torch.empty(tuple(x.shape) if preserve_batch else (0,), dtype=x.dtype)


def _run_case(case, seed):
    P_x, P_y = _partition(case.x), _partition(case.y)
    identity = P_x == P_y
    R = Repartition(P_x, P_y)
    R_nobatch = Repartition(P_x, P_y, preserve_batch=False)
    g = _global(case.shape, seed)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        ref = g.to(dtype)
        # Workers without data pass an fp32 [3, 0] placeholder: the output dtype must come from P_x,
        # and workers in neither partition must keep the batch of 3.
        x = _block(ref, P_x).clone() if P_x.active else zero_volume_tensor(3, dtype=torch.float32)
        idle = x if (P_x.active or not P_y.active) else x.to(dtype)  # P_y-only workers take P_x's dtype
        y = R(x)
        _same(f"{dtype} module", y, _expected(ref, P_x, P_y, idle, True, identity), bad)
        if identity and P_x.active and x.numel() and y.data_ptr() == x.data_ptr():
            bad.append("identity did not clone")
        _same(f"{dtype} module global_shape=", R(x, global_shape=case.shape, dtype=dtype),
              _expected(ref, P_x, P_y, idle, True, identity), bad)
        _same(f"{dtype} preserve_batch=False", R_nobatch(x), _expected(ref, P_x, P_y, idle, False, identity), bad)
        # The functional form: the placeholder's dtype sets the output dtype on workers outside P_x.
        y2 = repartition(x.to(dtype), P_x, P_y, case.shape)
        _same(f"{dtype} functional", y2, _expected(ref, P_x, P_y, x.to(dtype), True, identity), bad)
    # Gradient values in fp64.  Workers outside P_x pass a placeholder that does not require grad:
    # the gathered flags must make their outputs require grad anyway, or their adjoint never runs.
    dg = _global(case.shape, seed + 1)
    x = _block(g, P_x).clone().requires_grad_(True) if P_x.active else zero_volume_tensor(dtype=torch.float64)
    y = R(x)
    if not (P_x.active or P_y.active):
        pass  # outside the union: no communication, nothing to differentiate
    elif not y.requires_grad:
        bad.append("output does not require grad")
    else:
        y.backward(_block(dg, P_y) if P_y.active else torch.zeros_like(y))
        if P_x.active:
            _same("fp64 gradient", x.grad, _block(dg, P_x), bad)
    x = _block(g, P_x) if P_x.active else zero_volume_tensor(dtype=torch.float64)
    fwd, adj = adjoint_check(R, x, seed=seed + 2)
    if abs(fwd - adj) > ADJOINT_RTOL * max(abs(fwd), abs(adj), 1e-300) or fwd == 0.0:
        bad.append(f"adjoint: <Fx,y> = {fwd!r}, <x,F*y> = {adj!r}")
    return bad


def _run_cases(cases):
    return {c.id: _run_case(c, seed=1000 + k) for k, c in enumerate(cases)}


@pytest.fixture(scope="module")
def world_results():
    cache = {}

    def get(world):
        if world not in cache:
            try:
                cache[world] = run_ranks(world, _run_cases, [c for c in CASES if c.world == world])
            except Exception as exc:  # every case of this world size reports the same failure
                cache[world] = exc
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_repartition_values_gradients_adjoint(case, world_results):
    per_rank = world_results(case.world)
    failures = {r: out[case.id] for r, out in enumerate(per_rank) if out[case.id]}
    assert not failures, failures


def test_debug_mode_runs_and_catches_mismatched_calls():
    out = run_ranks(4, _debug_mode)
    assert all(r["ok"] for r in out), out
    for r in (0, 1):
        assert "different metadata" in out[r]["mismatch"] and "Repartition" in out[r]["mismatch"]
    for r in (0, 1, 2):
        assert "torch.float32" in out[r]["dtype_mismatch"] and "torch.float64" in out[r]["dtype_mismatch"]
    assert out[3]["dtype_mismatch"] is None  # outside the union


def _debug_mode():
    before = os.environ.get("DISTFUSE_DEBUG")
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        g = _global((7, 5), 7)
        P_a, P_b = _partition(((0, 1), (2, 1))), _partition(((0, 1), (1, 2)))
        ab, ba = Repartition(P_a, P_b), Repartition(P_b, P_a)
        # A full run in debug mode: outputs start as NaN, so a box that is never written would show.
        x = _block(g, P_a) if P_a.active else zero_volume_tensor(dtype=torch.float64)
        y = ab(x)
        ok = torch.equal(y, _block(g, P_b)) if P_b.active else y.shape == (0,)
        y_fn = repartition(x, P_a, P_b, (7, 5))
        ok = ok and (torch.equal(y_fn, _block(g, P_b)) if P_b.active else True)
        # Ranks 0 and 1 enter different repartitions over the same union: caught before any data moves.
        mismatch = None
        if dist.get_rank() < 2:
            wrong = ab if dist.get_rank() == 0 else ba
            xa = _block(g, P_a) if dist.get_rank() == 0 else _block(g, P_b)
            try:
                wrong(xa)
            except CollectiveMismatchError as exc:
                mismatch = str(exc)
        # Functional form: rank 2 (only in P_y) passes an fp32 placeholder for fp64 data.  In debug mode
        # its first call for a pair of partitions is collective over the world, so rank 3 calls it too.
        P_two = _partition(((2,), (1, 1)))
        dtype_mismatch = None
        try:
            repartition(x if P_a.active else zero_volume_tensor(), P_a, P_two, (7, 5))
        except CollectiveMismatchError as exc:
            dtype_mismatch = str(exc)
        return dict(ok=bool(ok), mismatch=mismatch, dtype_mismatch=dtype_mismatch)
    finally:  # the rank processes are reused by later tests
        if before is None:
            del os.environ["DISTFUSE_DEBUG"]
        else:
            os.environ["DISTFUSE_DEBUG"] = before


# ---------------------------------------------------------------- errors


def _catch(fn, *args):
    try:
        fn(*args)
    except (ShapeError, PartitionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _errors():
    me = dist.get_rank()
    P2 = _partition(((0, 1), (2, 1)))  # P_x on ranks 0, 1
    P_one = _partition(((2,), (1, 1)))  # P_y on rank 2; rank 3 is in neither
    P1d = _partition(((0, 1), (2,)))
    R = Repartition(P2, P_one)
    out = {"dims": _catch(Repartition, P2, P1d)}

    def call(x_rank0, x_rank1, x_rank2=None):
        x = {0: x_rank0, 1: x_rank1, 2: x_rank2 if x_rank2 is not None else zero_volume_tensor()}.get(
            me, zero_volume_tensor())
        return _catch(R, x)

    out["unbalanced"] = call(torch.randn(1, 3), torch.randn(3, 3))
    out["ndim"] = call(torch.randn(2, 3), torch.randn(6))
    out["inactive-data"] = call(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    out["dtype"] = call(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    # Rank 3 is in neither partition: its error is local, and the others complete the call.
    x = torch.randn(2, 3) if me < 2 else (torch.randn(1) if me == 3 else zero_volume_tensor())
    out["neither-data"] = _catch(R, x)
    # Functional form: a global shape that no worker's block fits (10 rows over 2 -> 5 each), and
    # P_y inside P_x so that every worker that communicates raises.
    R_sub = _partition(((0,), (1, 1)))
    x = torch.randn(4, 3) if me < 2 else zero_volume_tensor()
    out["functional-shape"] = _catch(repartition, x, P2, R_sub, (10, 3))
    out["bad-src"] = _catch(distribute_tensor, None, P2, 99)
    return out


def test_errors_name_op_rank_expected_and_actual():
    out = run_ranks(4, _errors)
    for r in range(4):
        assert "P_y.dim" in out[r]["dims"] and "expected 2, got 1" in out[r]["dims"]
        assert "distribute_tensor [rank" in out[r]["bad-src"] and "expected 0 <= rank < 4, got 99" in out[r]["bad-src"]
    for r in range(3):  # every worker of the union raises the same error, naming the offending rank
        assert f"Repartition [rank {r}]" in out[r]["unbalanced"]
        assert "world rank 0" in out[r]["unbalanced"] and "expected (2, 3), got (1, 3)" in out[r]["unbalanced"]
        assert "world rank 1" in out[r]["ndim"] and "expected 2, got 1" in out[r]["ndim"]
        assert "world rank 2 is not in P_x" in out[r]["inactive-data"]
        assert "agree" in out[r]["dtype"] and "torch.float64" in out[r]["dtype"]
        assert out[r]["neither-data"] is None
    assert out[3]["unbalanced"] is None  # rank 3 is outside the union and unaffected
    assert "neither P_x nor P_y" in out[3]["neither-data"] and "Repartition [rank 3]" in out[3]["neither-data"]
    for r in (0, 1):
        assert "repartition [rank" in out[r]["functional-shape"]
        assert "expected (5, 3), got (4, 3)" in out[r]["functional-shape"]


# ---------------------------------------------------------------- distribute / collect


def _helpers():
    me = dist.get_rank()
    bad = []
    # P on ranks 1-3, src 0 outside P, dst 2 inside; 7x5 is uneven over 3 rows.
    P = _partition(((1, 2, 3), (3, 1)))
    for dtype in (torch.float32, torch.bfloat16):
        g = _global((7, 5), 11).to(dtype)
        blk = distribute_tensor(g if me == 0 else None, P, src=0)
        _same(f"{dtype} distribute", blk, _block(g, P) if P.active else torch.empty(0, dtype=dtype), bad)
        back = collect_tensor(blk if P.active else None, P, dst=2)
        _same(f"{dtype} collect", back, g if me == 2 else torch.empty(0, dtype=dtype), bad)
    # 3-D over the whole world, src and dst the same non-zero rank.
    P3 = _partition((R4, (2, 1, 2)))
    g3 = _global((3, 4, 5), 12)
    blk = distribute_tensor(g3 if me == 3 else zero_volume_tensor(dtype=torch.float64), P3, src=3)
    _same("3d distribute", blk, _block(g3, P3), bad)
    _same("3d collect", collect_tensor(blk, P3, dst=3), g3 if me == 3 else torch.empty(0, dtype=torch.float64), bad)
    # Gradients through both helpers; every rank calls backward, on a zero-volume output where it holds nothing.
    g, w = _global((7, 5), 13), _global((7, 5), 14)
    x_global = g.clone().requires_grad_(True) if me == 0 else None
    blk = distribute_tensor(x_global, P, src=0)
    (blk * (_block(w, P) if P.active else 1.0)).sum().backward()
    if me == 0:
        _same("distribute gradient", x_global.grad, w, bad)
    x_local = _block(g, P).clone().requires_grad_(True) if P.active else None
    full = collect_tensor(x_local, P, dst=2)
    # Rank 0 is neither in P nor dst, but the helpers' gather spans the world: its output takes part too.
    (full * (w if me == 2 else 1.0)).sum().backward()
    if P.active:
        _same("collect gradient", x_local.grad, _block(w, P), bad)
    fwd, adj = adjoint_check(lambda t: distribute_tensor(t, P, src=0), g if me == 0 else zero_volume_tensor())
    if abs(fwd - adj) > ADJOINT_RTOL * max(abs(fwd), abs(adj)):
        bad.append(f"distribute adjoint: {fwd!r} vs {adj!r}")
    from distfuse.primitives import distribute as mod

    cached = len(mod._HELPERS)
    distribute_tensor(g if me == 0 else None, P, src=0)
    if len(mod._HELPERS) != cached:
        bad.append("helper modules are not cached")
    return bad


def test_distribute_collect_round_trip_and_gradients():
    out = run_ranks(4, _helpers)
    assert not any(out), out


def _helpers_one_rank():
    P = _partition(((0,), (1, 1)))
    g = _global((3, 2), 15).requires_grad_(True)
    blk = distribute_tensor(g, P)
    full = collect_tensor(blk * 2, P)
    full.sum().backward()
    return torch.equal(full, 2 * g) and full.data_ptr() != g.data_ptr() and torch.equal(g.grad, torch.full_like(g, 2))


def test_helpers_on_one_rank_copy_and_differentiate():
    assert run_ranks(1, _helpers_one_rank) == [True]


def test_local_shape_reference_is_balanced():
    # Guards the reference itself: 7 rows over 3 workers are 3, 2, 2.
    assert [local_shape((7, 5), (3, 1), (i, 0))[0] for i in range(3)] == [3, 2, 2]
    assert math.prod(local_shape((1, 3), (2, 2), (1, 1))) == 0
