"""Partitions, decomposition, and the rank-pool harness itself."""

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import block_extent, block_range, block_start, local_shape, owner_of
from distfuse.testing import RankFailure, RankTimeout, run_ranks

# ---------------------------------------------------------------- decomposition (no ranks)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 13, 64])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_balanced_blocks_tile_the_extent(n, p):
    extents = [block_extent(n, p, i) for i in range(p)]
    assert sum(extents) == n
    assert max(extents) - min(extents) <= 1
    assert extents == sorted(extents, reverse=True)  # the first n % p blocks are the larger ones
    pos = 0
    for i in range(p):
        start, stop = block_range(n, p, i)
        assert start == pos and stop - start == extents[i]
        pos = stop
        for g in range(start, stop):
            assert owner_of(n, p, g) == i


def test_extent_smaller_than_partition_leaves_empty_tail_blocks():
    assert [block_extent(2, 5, i) for i in range(5)] == [1, 1, 0, 0, 0]
    assert block_start(2, 5, 4) == 2
    assert local_shape((2, 7), (5, 2), (3, 1)) == (0, 3)


def test_decomposition_rejects_bad_arguments():
    with pytest.raises(IndexError):
        block_extent(4, 2, 2)
    with pytest.raises(ValueError, match="same number of dimensions"):
        local_shape((4, 4), (2,), (0,))


def test_zero_volume_tensor():
    assert zero_volume_tensor().shape == (0,)
    z = zero_volume_tensor(3, dtype=torch.float64, requires_grad=True)
    assert z.shape == (3, 0) and z.dtype == torch.float64 and z.requires_grad


# ---------------------------------------------------------------- partitions on ranks


def _partition_properties():
    P_world = Partition.world()
    P = P_world.create_partition_inclusive(range(1, 5))
    P_x = P.create_cartesian_topology_partition([2, 2])
    rows = P_x.create_cartesian_subtopology_partition([False, True])
    return dict(
        world=dist.get_rank(),
        active=P_x.active,
        rank=P_x.rank,
        index=P_x.index,
        nbr0=P_x.neighbors(0),
        nbr1p=P_x.neighbors(1, periodic=True),
        rows_ranks=rows.ranks if rows.active else None,
        rows_shape=rows.shape,
        rows_index=rows.index,
        group_cached=P_x.group is P.group,
    )


def test_cartesian_partition_properties():
    out = run_ranks(5, _partition_properties)
    assert out[0]["active"] is False and out[0]["rank"] == -1 and out[0]["rows_ranks"] is None
    for w in range(1, 5):
        r = out[w]
        assert r["active"] and r["rank"] == w - 1
        assert r["index"] == ((w - 1) // 2, (w - 1) % 2)  # row-major, as MPI
        assert r["group_cached"]
        assert r["rows_shape"] == (1, 2)
        assert r["rows_ranks"] == ((1, 2) if w in (1, 2) else (3, 4))
        assert r["rows_index"] == (0, (w - 1) % 2)
    assert out[1]["nbr0"] == (None, 2) and out[3]["nbr0"] == (0, None)
    assert out[1]["nbr1p"] == (1, 1)  # a periodic dimension of extent 2 wraps to the same neighbour


def _inconsistent_creation():
    P_world = Partition.world()
    ranks = [0, 1] if dist.get_rank() == 0 else [0, 2]
    P_world.create_partition_inclusive(ranks)


def test_inconsistent_partition_creation_raises_on_every_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(3, _inconsistent_creation)
    assert set(info.value.errors) == {0, 1, 2}
    assert all("collective over the world" in tb and "disagree" in tb for tb in info.value.errors.values())


def _bad_cartesian_shape():
    Partition.world().create_cartesian_topology_partition([3, 2])


def test_cartesian_shape_must_match_size():
    with pytest.raises(RankFailure, match=r"volume 6, expected the partition size 4"):
        run_ranks(4, _bad_cartesian_shape)


# ---------------------------------------------------------------- the harness


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return dist.get_rank()


def _sleep_forever_on_rank_zero(seconds):
    import time

    if dist.get_rank() == 0:
        time.sleep(seconds)
    return os.getpid()


def _ranks_and_pids():
    return dist.get_rank(), os.getpid()


def test_pool_reports_rank_id_and_rebuilds():
    first = run_ranks(2, _ranks_and_pids)
    with pytest.raises(RankFailure, match="rank 1 of 2") as info:
        run_ranks(2, _raise_on_rank_one)
    assert "boom on one" in info.value.errors[1]
    again = run_ranks(2, _ranks_and_pids)  # a new pool, working
    assert [r for r, _ in again] == [0, 1]
    assert {p for _, p in again}.isdisjoint({p for _, p in first})


def test_pool_deadline_kills_a_hung_rank():
    with pytest.raises(RankTimeout, match=r"ranks \[0\]"):
        run_ranks(2, _sleep_forever_on_rank_zero, 3600, timeout=3)
    assert [r for r, _ in run_ranks(2, _ranks_and_pids)] == [0, 1]


def _profiled_work(n):
    return sum(_profiled_leaf(i) for i in range(n))


def _profiled_leaf(i):
    return i * i


def test_pool_profiles_its_tasks_where_asked(tmp_path, monkeypatch):
    """``DISTFUSE_POOL_PROFILE``: each rank of a pool forked under it runs its tasks under cProfile and writes its
    stats after each one, so the tasks' own functions show there with their call counts (a pool of its own: the
    shared pools were forked without the variable)."""
    import pstats

    from distfuse.testing.pool import RankPool

    monkeypatch.setenv("DISTFUSE_POOL_PROFILE", str(tmp_path))
    pool = RankPool(2)
    try:
        assert pool.run(_profiled_work, 50) == [sum(i * i for i in range(50))] * 2
        assert pool.run(_profiled_work, 30) == [sum(i * i for i in range(30))] * 2
    finally:
        pool.close()
    files = sorted(tmp_path.glob("w2r*.prof"))
    assert [f.name.split("-")[0] for f in files] == ["w2r0", "w2r1"]
    for f in files:
        calls = {fn[2]: stat[1] for fn, stat in pstats.Stats(str(f)).stats.items()}
        assert calls.get("_profiled_work") == 2 and calls.get("_profiled_leaf") == 80, calls
    monkeypatch.delenv("DISTFUSE_POOL_PROFILE")
    assert _rank_profiler_of_unset() is None


def _rank_profiler_of_unset():
    from distfuse.testing.pool import _rank_profiler

    return _rank_profiler(0, 1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_pools_for_every_world_size(world_size):
    assert [r for r, _ in run_ranks(world_size, _ranks_and_pids)] == list(range(world_size))


def _cartesian_index_roundtrip(shape):
    P = Partition.world().create_cartesian_topology_partition(shape)
    return all(P.rank_of(P.index_of(r)) == r for r in range(P.size)) and P.index == P.index_of(dist.get_rank())


@pytest.mark.parametrize("shape", [[4], [2, 2], [1, 2, 2], [2, 1, 2, 1]])
def test_index_rank_roundtrip(shape):
    assert all(run_ranks(4, _cartesian_index_roundtrip, shape))


def test_index_matches_itertools_order():
    # row-major: the last dimension varies fastest
    assert list(itertools.product(range(2), range(3)))[4] == (1, 1)
