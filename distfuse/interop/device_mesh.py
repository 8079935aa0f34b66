"""DeviceMesh <-> Partition: hand a distfuse partition to DTensor code, and build one from a mesh.

A :class:`~distfuse.partition.CartesianPartition` of shape ``[p_0, ..., p_{n-1}]`` over world
ranks ``r`` (row-major) and a ``DeviceMesh`` whose ``mesh`` tensor is ``r`` viewed as that
shape describe the same grid: partition index ``i`` is mesh coordinate ``i``.
:func:`device_mesh_of` builds the mesh from the partition's own process groups (an n-D
partition's mesh dimension ``d`` uses the groups of its sub-grids along ``d``, cached by
distfuse like every group: none is duplicated); :func:`partition_from_device_mesh` builds the
partition back (any mesh, sliced or not).

Why some partitions have no mesh.  ``torch.distributed.new_group`` sorts its ranks, and
DTensor's collectives on a mesh dimension put group rank ``g``'s shard at mesh coordinate
``g``, so a mesh whose ranks decrease along a dimension (a partition listed out of order,
such as ranks ``(3, 1)``) assembles shards in the wrong order (torch 2.13:
``DeviceMesh("cpu", [1, 0])`` gives a ``full_tensor()`` with its halves swapped).
:func:`device_mesh_of` refuses such partitions on every rank (the check reads only the rank
list); :func:`canonical_partition` gives the same ranks in increasing order, which always has
a mesh, and :mod:`distfuse.interop.dtensor` uses it for out-of-order partitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from distfuse.errors import PartitionError, UnsupportedError, where
from distfuse.groups import WorldTable, metadata_group
from distfuse.partition import CartesianPartition, Partition

__all__ = ["device_mesh_of", "partition_from_device_mesh", "canonical_partition", "is_mesh_ordered"]

_MESHES: WorldTable = WorldTable()
_CANONICAL: WorldTable = WorldTable()


def _as_grid(op: str, P: Partition) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(ranks, shape)`` of a partition; a plain Partition is a 1-D grid of its ranks."""
    if not isinstance(P, Partition):
        raise PartitionError(f"{where(op)}: expected a distfuse Partition, got {type(P).__name__}")
    if not P.ranks:
        raise PartitionError(f"{where(op)}: this partition is a placeholder on a worker outside its parent grid "
                             "and lists no ranks; build the mesh from the parent partition and slice it "
                             "(mesh['dim1'])")
    shape = tuple(P.shape) if isinstance(P, CartesianPartition) else (P.size,)
    return P.ranks, shape


def is_mesh_ordered(P: Partition) -> bool:
    """Whether world ranks increase along every dimension of ``P``'s grid (then ``P`` has a DeviceMesh)."""
    ranks, shape = _as_grid("is_mesh_ordered", P)
    grid = np.asarray(ranks).reshape(shape)
    return all(bool((np.diff(grid, axis=d) > 0).all()) for d in range(len(shape)))


def _mesh_dim_names(op: str, ndim: int, names: Sequence[str] | None) -> tuple[str, ...]:
    if names is None:
        return tuple(f"dim{d}" for d in range(ndim))
    names = tuple(str(n) for n in names)
    if len(names) != ndim or len(set(names)) != ndim:
        raise PartitionError(f"{where(op)}: mesh_dim_names must be {ndim} distinct names (one per partition "
                             f"dimension), got {list(names)}")
    return names


def device_mesh_of(P: Partition, mesh_dim_names: Sequence[str] | None = None):
    """The ``torch.distributed.device_mesh.DeviceMesh`` of partition ``P`` (same shape, same ranks).

    Args:
        P: a CartesianPartition (a plain Partition is a 1-D grid of its ranks).
        mesh_dim_names: one name per dimension; default ``("dim0", "dim1", ...)``.

    Returns the mesh on every world rank; on ranks outside ``P`` it holds no process
    groups (``get_coordinate()`` is None), which is how DTensor marks non-members.
    The device type is ``P.device``'s.  Raises :class:`UnsupportedError` when ranks do
    not increase along every dimension (see the module docstring; use
    :func:`canonical_partition`).  Collective over the world on the first call for an
    n-D partition (n > 1); cached afterwards.
    """
    from torch.distributed.device_mesh import DeviceMesh

    op = "device_mesh_of"
    ranks, shape = _as_grid(op, P)
    names = _mesh_dim_names(op, len(shape), mesh_dim_names)
    if not is_mesh_ordered(P):
        raise UnsupportedError(
            f"{where(op)}: partition {list(shape)} over world ranks {list(ranks)} lists ranks out of increasing "
            "order along a dimension; DTensor would assemble its shards in the wrong order there (process groups "
            "order their ranks by world rank). Use canonical_partition(P), the same ranks in increasing order")
    device_type = P.device.type
    key, meshes = (ranks, shape, names, device_type), _MESHES.current()
    if key in meshes:
        return meshes[key]
    if len(shape) == 1:
        groups = [P.group]
    else:  # collective over the world: every rank creates every sub-grid's group (cached by rank set)
        subs = [P.create_cartesian_subtopology_partition([k == d for k in range(len(shape))])
                for d in range(len(shape))]
        groups = [s.group for s in subs]
    mesh_tensor = torch.tensor(ranks, dtype=torch.int).view(shape)
    if P.active:
        mesh = DeviceMesh.from_group(groups, device_type, mesh=mesh_tensor, mesh_dim_names=names)
    else:
        # Outside the mesh: no groups, as torch's own DeviceMesh leaves its non-members.
        mesh = DeviceMesh(device_type, mesh_tensor, mesh_dim_names=names, _init_backend=False)
        mesh._dim_group_names = []
    meshes[key] = mesh
    return mesh


def canonical_partition(P: Partition) -> CartesianPartition:
    """``P``'s grid shape over ``P``'s ranks sorted increasingly: a partition that has a DeviceMesh.

    Returns ``P`` itself when it is already ordered.  Collective over the world
    otherwise (it creates the partition; cached per partition).
    """
    ranks, shape = _as_grid("canonical_partition", P)
    if isinstance(P, CartesianPartition) and is_mesh_ordered(P):
        return P
    key, canonical = (ranks, shape, P.device.type), _CANONICAL.current()
    if key not in canonical:
        world = Partition.world(device=P.device)
        canonical[key] = world.create_partition_inclusive(sorted(ranks)).create_cartesian_topology_partition(shape)
    return canonical[key]


def _my_view(mesh) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """This rank's ``(ranks, shape)`` of ``mesh``, or None where torch cannot show it (outside a sliced mesh)."""
    try:
        t = mesh.mesh
    except RuntimeError:
        return None
    return tuple(int(r) for r in t.flatten().tolist()), tuple(int(s) for s in t.shape)


def partition_from_device_mesh(mesh, device: torch.device | None = None) -> CartesianPartition:
    """The CartesianPartition of a ``DeviceMesh``: same grid shape, same world ranks, row-major.

    Works for a root mesh and for a sliced one (``mesh2d["tp"]``), which holds a
    different slice on each rank: every rank's view is gathered, the partition of every
    slice is created (in the order of the lowest world rank that reports it), and each
    rank gets the one it belongs to (a rank in no slice gets the first, inactive).
    ``device`` defaults to CPU for a ``"cpu"`` mesh and to distfuse's default otherwise.
    The partition has its own process groups (distfuse caches them by rank set).

    Collective over the world: one object all-gather plus the partition creations.
    """
    op = "partition_from_device_mesh"
    mine = _my_view(mesh)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine, group=metadata_group())
    slices = list(dict.fromkeys(v for v in views if v is not None))
    if not slices:
        raise PartitionError(f"{where(op)}: no rank can read this mesh's ranks (mesh.mesh raised everywhere)")
    shapes = {s for _, s in slices}
    if len(shapes) != 1:
        raise PartitionError(f"{where(op)}: ranks see mesh slices of different shapes {sorted(shapes)}; every rank "
                             "must pass the same mesh (or slices of one mesh)")
    for ranks, _ in slices:
        if len(set(ranks)) != len(ranks) or not all(0 <= r < dist.get_world_size() for r in ranks):
            raise PartitionError(f"{where(op)}: mesh ranks {list(ranks)} are not distinct world ranks")
    if device is None and mesh.device_type == "cpu":
        device = torch.device("cpu")
    world = Partition.world(device=device)
    found = None
    for ranks, shape in slices:
        P = world.create_partition_inclusive(ranks).create_cartesian_topology_partition(shape)
        if found is None or (P.active and not found.active):
            found = P
    return found
