"""One rank's global tensor to its blocks on a partition and back: :func:`distribute_tensor`, :func:`collect_tensor`.

Both are repartitions (:class:`~distfuse.primitives.repartition.Repartition`) from and to
a one-worker partition, so they are differentiable, and each is the other's adjoint.
The one-worker partitions and the repartitions are cached per ``(P, rank)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distfuse.errors import PartitionError, expect
from distfuse.groups import WorldTable
from distfuse.partition import CartesianPartition, Partition, zero_volume_tensor
from distfuse.primitives._axes import check_cartesian
from distfuse.primitives.repartition import Repartition

__all__ = ["distribute_tensor", "collect_tensor"]

_HELPERS: WorldTable = WorldTable()  # per world: a helper holds its partitions' groups


def _single(P: CartesianPartition, rank: int, op: str) -> CartesianPartition:
    check_cartesian(op, P)
    if not 0 <= rank < dist.get_world_size():
        raise expect(op, "world rank of the single worker", f"0 <= rank < {dist.get_world_size()}", rank,
                     PartitionError)
    world = Partition.world(device=P.device)
    return world.create_partition_inclusive([rank]).create_cartesian_topology_partition([1] * P.dim)


def _helper(kind: str, P: CartesianPartition, rank: int) -> Repartition:
    key = (kind, rank, P.ranks, P.shape, P.device.type)
    helpers = _HELPERS.current()
    if key not in helpers:
        one = _single(P, rank, kind)
        P_x, P_y = (one, P) if kind == "distribute_tensor" else (P, one)
        helpers[key] = Repartition(P_x, P_y, preserve_batch=False, _op=kind, _extra=Partition.world(P.device))
    return helpers[key]


def _as_input(x: torch.Tensor | None, P: CartesianPartition) -> torch.Tensor:
    if x is None:
        return zero_volume_tensor(device=P.device)
    return x.to(P.device) if x.device.type != P.device.type else x


def distribute_tensor(x_global: torch.Tensor | None, P: CartesianPartition, src: int = 0) -> torch.Tensor:
    """Split world rank ``src``'s global tensor into its balanced blocks on ``P``.

    Collective over the world: every rank calls it with the same ``P`` and ``src`` (the
    first call for a pair also creates partitions).  Rank ``src`` passes the global tensor
    (``P.dim`` dimensions; moved to ``P``'s device), the others None or a zero-volume
    tensor.  Returns this worker's block on ``P``, or a ``[0]`` zero-volume tensor of the
    same dtype outside ``P``.  When ``x_global`` requires grad every rank's output does,
    and every rank must call backward (the gradient is collected on ``src``).
    """
    return _helper("distribute_tensor", P, src)(_as_input(x_global, P))


def collect_tensor(x_local: torch.Tensor | None, P: CartesianPartition, dst: int = 0) -> torch.Tensor:
    """Assemble the blocks on ``P`` into the global tensor on world rank ``dst``.

    Collective over the world, like :func:`distribute_tensor` (its adjoint).  Workers of
    ``P`` pass their block; the others pass None or a zero-volume tensor.  Rank ``dst``
    gets the global tensor, every other rank a ``[0]`` zero-volume tensor.
    """
    return _helper("collect_tensor", P, dst)(_as_input(x_local, P))
