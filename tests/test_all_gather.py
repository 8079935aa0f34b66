"""AllGather: values and gradients against float64 references, the adjoint test, and the errors.

Every rank builds the same global tensor from a seed and slices its block with the
balanced decomposition.  The gather is pure data movement, so forward values must match
exactly in every dtype.  The backward sums: fp32 gradients use the tolerance table,
bf16 ones integer-valued data (every partial sum is exact in bf16) or, with
``reduce_dtype=float32``, multiples of 1/16 (exact in fp32, rounded once).  Each case runs once with
``DISTFUSE_DEBUG=1``, whose NaN-filled scratch buffers make any read of padding or any
unwritten output element visible, and once without.
"""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError
from distfuse.geometry.decomposition import local_slices
from distfuse.primitives.all_gather import AllGather, all_gather
from distfuse.testing import adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL, tol

# id, world size, P_x's world ranks (order matters: torch sorts group ranks), P_x shape, global shape, axes, keep
CASES = [
    ("w1-identity", 1, [0], [1], (5,), (0,), None),
    ("w2-1d-even", 2, [0, 1], [2], (6,), (0,), None),
    ("w2-zero-extent", 2, [0, 1], [2], (0,), (0,), None),
    ("w3-unsorted-inactive", 3, [2, 0], [2], (5,), (0,), None),
    ("w4-1d-uneven", 4, [0, 1, 2, 3], [4], (10,), (0,), None),
    ("w4-1d-3-over-4", 4, [0, 1, 2, 3], [4], (3,), (0,), None),
    ("w4-2x2-ax0", 4, [0, 1, 2, 3], [2, 2], (6, 5), (0,), None),
    ("w4-2x2-ax1-uneven", 4, [0, 1, 2, 3], [2, 2], (6, 5), (1,), None),
    ("w4-2x2-both-even", 4, [0, 1, 2, 3], [2, 2], (6, 4), (0, 1), None),
    ("w4-2x2-unsorted-keep0", 4, [3, 1, 2, 0], [2, 2], (7, 5), None, (0,)),
    ("w4-2x1x2-3d-even", 4, [0, 1, 2, 3], [2, 1, 2], (4, 3, 6), None, (1,)),
    ("w4-2x1x2-3d-uneven", 4, [0, 1, 2, 3], [2, 1, 2], (5, 3, 7), (0, 2), None),
    ("w5-2x2-both-inactive", 5, [1, 2, 3, 4], [2, 2], (7, 5), (0, 1), None),
    ("w6-2x3-ax1-uneven", 6, list(range(6)), [2, 3], (7, 5), (1,), None),
    ("w6-2x3-both-uneven", 6, list(range(6)), [2, 3], (7, 5), (0, 1), None),
    ("w7-1d-uneven", 7, list(range(7)), [7], (10,), (0,), None),
    ("w8-2x2x2-tiny", 8, list(range(8)), [2, 2, 2], (3, 1, 5), (0, 1, 2), None),
    ("w8-3x2-unsorted-inactive", 8, [7, 5, 3, 1, 0, 2], [3, 2], (4, 3), (0,), None),
]


def _geometry(P_x, global_shape, axes):
    """This worker's block, its sub-grid's region of the global tensor, and the sub-grid's members."""
    coarse = [1 if d in axes else p for d, p in enumerate(P_x.shape)]

    def cidx(idx):
        return [0 if d in axes else i for d, i in enumerate(idx)]

    region = local_slices(global_shape, coarse, cidx(P_x.index))

    def rel(r):  # block of P_x rank r relative to the region
        block = local_slices(global_shape, P_x.shape, P_x.index_of(r))
        return tuple(slice(b.start - c.start, b.stop - c.start) for b, c in zip(block, region, strict=True))

    members = [r for r in range(P_x.size) if cidx(P_x.index_of(r)) == cidx(P_x.index)]
    block = local_slices(global_shape, P_x.shape, P_x.index)
    shape = tuple(s.stop - s.start for s in region)
    return SimpleNamespace(block=block, region=region, shape=shape, members=members, rel=rel)


def _debug_mode(on: bool):
    if on:
        os.environ["DISTFUSE_DEBUG"] = "1"
    else:
        os.environ.pop("DISTFUSE_DEBUG", None)


def _data(shape, seed, kind="normal"):
    gen = torch.Generator().manual_seed(seed)
    if kind == "integer":  # every sum of <= 8 of these is exact in bf16
        return torch.randint(-8, 9, shape, generator=gen).to(torch.float64)
    if kind == "sixteenths":  # sums of <= 8 of these (after rounding to bf16) are exact in fp32 but not in bf16
        return torch.randint(-512, 513, shape, generator=gen).to(torch.float64) / 16
    return torch.randn(shape, generator=gen, dtype=torch.float64)


# (dtype, reduce_dtype, data kind).  Sums of "integer" data are exact in bf16 and of "sixteenths" in fp32, so those
# variants compare exactly; "normal" data use the tolerance table.
VARIANTS = [(torch.float32, None, "normal"), (torch.bfloat16, None, "integer"),
            (torch.bfloat16, torch.float32, "sixteenths")]


def _run_case(ranks, pshape, global_shape, axes, keep):
    P_x = Partition.world().create_partition_inclusive(ranks).create_cartesian_topology_partition(pshape)
    layer = AllGather(P_x, axes_all_gather=axes, axes_keep=keep)
    axes = layer.axes_all_gather
    checks = 0
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        for debug_on in (True, False):
            _debug_mode(debug_on)
            for dtype, reduce_dtype, kind in VARIANTS:
                if not P_x.active:
                    x = zero_volume_tensor(dtype=dtype, requires_grad=True)
                    y = all_gather(x, layer.P_sub, reduce_dtype=reduce_dtype)
                    y.backward(torch.ones_like(y))
                    assert y.shape == (0,) and x.grad.shape == (0,)
                    continue
                g = _geometry(P_x, global_shape, axes)
                G = _data(global_shape, 11, kind)
                x = G[g.block].to(dtype).requires_grad_(True)
                y = all_gather(x, layer.P_sub, reduce_dtype=reduce_dtype) if reduce_dtype else layer(x)
                # Pure data movement: bit-exact in every dtype.
                torch.testing.assert_close(y, G[g.region].to(dtype), rtol=0, atol=0)
                y_known = all_gather(x.detach(), layer.P_sub, out_shape=g.shape)
                torch.testing.assert_close(y_known, y.detach(), rtol=0, atol=0)
                # Adjoint: the sum of every member's output gradient over this worker's block.
                dys = {r: _data(g.shape, 100 + r, kind).to(dtype) for r in g.members}
                y.backward(dys[P_x.rank])
                want = sum(dys[r][g.rel(P_x.rank)].double() for r in g.members)
                opts = tol(dtype) if kind == "normal" else dict(rtol=0, atol=0)
                torch.testing.assert_close(x.grad, want.to(dtype), **opts)
                checks += 3
        x = _data(global_shape, 12)[_geometry(P_x, global_shape, axes).block] if P_x.active else zero_volume_tensor()
        lhs, rhs = adjoint_check(layer, x)
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return P_x.active, checks


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_all_gather(case):
    _, world, ranks, pshape, global_shape, axes, keep = case
    out = run_ranks(world, _run_case, ranks, pshape, global_shape, axes, keep)
    active = [w for w, (a, _) in enumerate(out) if a]
    assert sorted(active) == sorted(ranks)
    assert all(n == 18 for a, n in out if a)


def _identity_returns_a_clone():
    P_x = Partition.world().create_cartesian_topology_partition([1])
    x = torch.randn(4)
    y = AllGather(P_x, axes_all_gather=0)(x)
    return y.data_ptr() != x.data_ptr() and torch.equal(x, y)


def test_identity_returns_a_clone():
    assert run_ranks(1, _identity_returns_a_clone) == [True]


def _fast_path_is_a_view():
    # Gathering only the first dimension of even blocks needs no copy after the collective.
    P_x = Partition.world().create_cartesian_topology_partition([2, 1])
    layer = AllGather(P_x, axes_all_gather=0)
    y = layer(torch.randn(3, 4))
    return y._base is not None and y.shape == (6, 4)


def test_even_first_dimension_gather_returns_a_view():
    assert run_ranks(2, _fast_path_is_a_view) == [True, True]


def _strided_input_and_expanded_gradient():
    P_x = Partition.world().create_cartesian_topology_partition([2, 2])
    for axes, shape in (((0,), (6, 4)), ((1,), (7, 5)), ((0, 1), (6, 4))):  # fast, padded, fast with a copy
        layer = AllGather(P_x, axes_all_gather=axes)
        G, g = _data(shape, 5), _geometry(P_x, shape, axes)
        x = G[g.block].t().contiguous().t().requires_grad_(True)  # column-major strides
        assert not x.is_contiguous()
        y = layer(x)
        torch.testing.assert_close(y, G[g.region], rtol=0, atol=0)
        y.sum().backward()  # the gradient arrives expanded (stride 0)
        torch.testing.assert_close(x.grad, torch.full_like(x, len(g.members)), rtol=0, atol=0)
    return True


def test_strided_input_and_expanded_gradient():
    assert run_ranks(4, _strided_input_and_expanded_gradient) == [True] * 4


# ---------------------------------------------------------------- errors


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return type(exc).__name__, str(exc)
    return None


def _errors():
    """Every scenario leaves no rank inside a collective, so one pool call covers them all."""
    me = dist.get_rank()
    P_x = Partition.world().create_partition_inclusive(range(4)).create_cartesian_topology_partition([2, 2])
    out = {
        "neither": _catch(lambda: AllGather(P_x)),
        "both": _catch(lambda: AllGather(P_x, axes_all_gather=(0,), axes_keep=(1,))),
        "range": _catch(lambda: AllGather(P_x, axes_all_gather=(2,))),
        "repeat": _catch(lambda: AllGather(P_x, axes_all_gather=(1, -1))),
        "not-cartesian": _catch(lambda: AllGather(Partition.world(), axes_all_gather=(0,))),
    }
    layer = AllGather(P_x, axes_all_gather=(0,))
    active = P_x.active
    out["ndim"] = _catch(lambda: layer(torch.randn(3) if active else zero_volume_tensor()))
    out["inactive-data"] = _catch(lambda: layer(torch.randn(3, 2)))  # fine on active ranks
    # Column sub-grids are world ranks {0, 2} and {1, 3}; rank 2's not-gathered extent differs from rank 0's.
    bad = {2: (3, 3)}.get(me, (3, 2))
    out["no-tile"] = _catch(lambda: layer(torch.randn(bad) if active else zero_volume_tensor()))
    dt = torch.float64 if me == 2 else torch.float32
    out["dtype"] = _catch(lambda: layer(torch.randn(3, 2, dtype=dt) if active else zero_volume_tensor()))
    out["out-shape"] = _catch(lambda: all_gather(torch.randn(3, 2), layer.P_sub, out_shape=(9, 2))
                              if active else None)
    saved = os.environ.get("DISTFUSE_DEBUG")
    try:
        _debug_mode(True)
        # Workers of one sub-grid disagree on out_shape: caught before the gather on every one of them.
        shape = (6, 2) if me != 2 else (5, 2)
        x = torch.randn(3, 2)
        out["debug-out-shape"] = _catch(lambda: all_gather(x, layer.P_sub, out_shape=shape) if active else None)
    finally:
        _debug_mode(saved is not None and saved not in ("", "0"))
    return out


def test_errors_name_op_rank_and_values():
    out = run_ranks(5, _errors)
    for r in range(5):
        e = out[r]
        assert e["neither"][0] == PartitionError.__name__ and "exactly one of axes_all_gather and axes_keep" in \
            e["neither"][1] and "got neither" in e["neither"][1] and f"[rank {r}]" in e["neither"][1]
        assert "got both" in e["both"][1]
        assert "expected in [-2, 2), got 2" in e["range"][1]
        assert "without repeats" in e["repeat"][1]
        assert "expected CartesianPartition, got Partition" in e["not-cartesian"][1]
    for r in range(4):
        assert out[r]["ndim"][0] == ShapeError.__name__ and "expected 2, got 1" in out[r]["ndim"][1]
        assert out[r]["inactive-data"] is None
        want = "(5, 2)" if r < 2 else "(4, 2)"  # 9 rows over 2: blocks of 5 and 4, never the 3 passed
        assert f"AllGather [rank {r}]" in out[r]["out-shape"][1] and f"expected {want}, got (3, 2)" in \
            out[r]["out-shape"][1]
    assert out[4]["inactive-data"][0] == ShapeError.__name__ and "zero-volume" in out[4]["inactive-data"][1]
    for r in (0, 2):
        assert "do not tile" in out[r]["no-tile"][1] and "(3, 3)" in out[r]["no-tile"][1]
        assert "same dtype" in out[r]["dtype"][1] and "torch.float64" in out[r]["dtype"][1]
        assert out[r]["debug-out-shape"][0] == CollectiveMismatchError.__name__
    for r in (1, 3):
        assert out[r]["no-tile"] is None and out[r]["dtype"] is None and out[r]["debug-out-shape"] is None


def test_all_cases_cover_every_world_size():
    assert {c[1] for c in CASES} == set(range(1, 9))
    assert any(math.prod(c[3]) < c[1] for c in CASES)  # inactive workers
