"""Partition <-> DeviceMesh: same shape, same ranks, the partition's own groups, and back.

DTensor is the independent check that a mesh is usable: a ``full_tensor()`` over the
mesh of ``device_mesh_of(P)`` must assemble the shards in coordinate order.
"""

import pytest
import torch
import torch.distributed as dist

from distfuse import PartitionError, UnsupportedError
from distfuse.interop.device_mesh import canonical_partition, device_mesh_of, partition_from_device_mesh
from distfuse.testing import run_ranks
from tests.test_conv_support import grid


def _mesh_facts():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    me = dist.get_rank()
    out = {}
    # A 2-D partition over every rank: shape, ranks, coordinates, per-dimension groups, and DTensor on it.
    P = grid(range(4), (2, 2))
    mesh = device_mesh_of(P, ("rows", "cols"))
    out["shape"] = tuple(mesh.shape)
    out["mesh"] = mesh.mesh.tolist()
    out["coord"] = (tuple(mesh.get_coordinate()), P.index)
    out["dim_groups"] = [sorted(dist.get_process_group_ranks(mesh.get_group(d))) for d in ("rows", "cols")]
    out["cached"] = device_mesh_of(P, ("rows", "cols")) is mesh
    local = torch.full((1, 2), float(me), dtype=torch.float64)
    full = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False).full_tensor()
    out["full"] = full.tolist()
    # A 1-D partition over some ranks reuses its own group; ranks outside it get a mesh without groups.
    P1 = grid((1, 3), (2,))
    m1 = device_mesh_of(P1)
    out["reuses_group"] = (m1.get_group() is P1.group) if P1.active else m1.get_coordinate() is None
    # Back to a partition: equal ranks and shape, on every rank.
    out["back2d"] = (partition_from_device_mesh(mesh).ranks, partition_from_device_mesh(mesh).shape)
    back1 = partition_from_device_mesh(m1)
    out["back1d"] = (back1.ranks, back1.shape, back1.active == P1.active)
    # A mesh torch made, and a slice of it: every rank gets the partition of its own slice.
    tm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = partition_from_device_mesh(tm["tp"])
    out["slice"] = (tp.ranks, tp.shape, tp.index)
    # Out-of-order ranks: refused on every rank (DTensor would mis-order shards), canonical form accepted.
    Pr = grid((3, 1), (2,))
    try:
        device_mesh_of(Pr)
        out["permuted"] = "no error"
    except UnsupportedError as exc:
        out["permuted"] = "increasing" in str(exc)
    Pc = canonical_partition(Pr)
    out["canonical"] = (Pc.ranks, Pc.shape, device_mesh_of(Pc).mesh.tolist())
    try:
        device_mesh_of(P, ("a",))
        out["bad_names"] = "no error"
    except PartitionError:
        out["bad_names"] = True
    return out


def test_device_mesh_round_trip_groups_and_dtensor():
    out = run_ranks(4, _mesh_facts)
    want_full = [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]]
    for r, o in enumerate(out):
        assert o["shape"] == (2, 2) and o["mesh"] == [[0, 1], [2, 3]], o
        assert o["coord"][0] == o["coord"][1] == (r // 2, r % 2)
        assert o["dim_groups"] == [[r % 2, r % 2 + 2], [2 * (r // 2), 2 * (r // 2) + 1]]
        assert o["cached"] and o["full"] == want_full
        assert o["reuses_group"] is True
        assert o["back2d"] == ((0, 1, 2, 3), (2, 2))
        assert o["back1d"] == ((1, 3), (2,), True)
        assert o["slice"] == ((2 * (r // 2), 2 * (r // 2) + 1), (2,), (r % 2,))
        assert o["permuted"] is True and o["bad_names"] is True
        assert o["canonical"] == ((1, 3), (2,), [1, 3])


def _mesh_on_one_rank():
    P = grid((0,), (1, 1))
    mesh = device_mesh_of(P)
    back = partition_from_device_mesh(mesh)
    return tuple(mesh.shape), back.ranks, back.shape


def test_world_of_one():
    assert run_ranks(1, _mesh_on_one_rank) == [((1, 1), (0,), (1, 1))]


@pytest.mark.parametrize("bad", ["not a partition"])
def test_non_partition_is_refused_without_communication(bad):
    with pytest.raises(PartitionError):
        device_mesh_of(bad)
