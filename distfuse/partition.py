"""Partitions: sets of workers, optionally arranged in a Cartesian grid.

A :class:`Partition` is an ordered set of world ranks with a cached
``torch.distributed`` process group.  A :class:`CartesianPartition` arranges those
ranks in a row-major grid (partition rank ``r`` of a ``[2, 2]`` grid has index
``(r // 2, r % 2)``, as in MPI's Cartesian topologies); partition dimension ``d``
splits tensor dimension ``d``.

Creating a partition is **collective over the whole world**, because
``torch.distributed.new_group`` is: every world rank, active in the new partition or
not, must make the same creation calls in the same order, with the same arguments.
Each creation first gathers a ``(sequence number, call, arguments, ranks, timeout)``
record from every world rank, and if the records differ every rank raises
:class:`PartitionError` naming the ranks that disagree, instead of hanging inside
``new_group`` or building different grids (the process groups themselves, their
timeouts and caching: :mod:`distfuse.groups`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from distfuse.errors import NotPicklableError, PartitionError, where
from distfuse.groups import default_device, groups_for, world_generation, world_partition_groups

__all__ = ["Partition", "CartesianPartition", "zero_volume_tensor", "union_partition", "check_current_world"]


def zero_volume_tensor(b: int | None = None, dtype: torch.dtype | None = None, device=None,
                       requires_grad: bool = False) -> torch.Tensor:
    """The placeholder an inactive worker passes and receives: shape ``[0]``, or ``[b, 0]`` to keep a batch size.

    Pass ``requires_grad=True`` on ranks that hold no input but take part in a
    backward pass, so that autograd runs the adjoint there too.
    """
    shape = (0,) if b is None else (int(b), 0)
    return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)  # dtype None: the default


class Partition:
    """An ordered set of world ranks with its process group.

    Attributes:
        ranks: the world ranks in partition order.
        active: whether this process is one of them.
        rank: this process's rank within the partition (-1 when inactive).
        size: number of workers.
        group: the cached ``ProcessGroup`` (None on inactive workers).
        meta_group: a gloo group over the same ranks for host-side metadata such as
            shapes (the data group itself under gloo); None on inactive workers.
        device: where this partition's tensors live (default :func:`~distfuse.groups.default_device`).
    """

    def __init__(self, ranks: Sequence[int], groups: tuple | None, device: torch.device | None = None):
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.size = len(self.ranks)
        me = dist.get_rank()
        self.active = me in self.ranks
        self.rank = self.ranks.index(me) if self.active else -1
        self.group, self.meta_group = groups if (self.active and groups is not None) else (None, None)
        self.device = device if device is not None else default_device()
        self.world_generation = world_generation()  # the world its groups belong to (check_current_world)

    @classmethod
    def world(cls, device: torch.device | None = None) -> Partition:
        """Every rank of the initialised default process group, on distfuse's own world groups.

        The first call, which creates those groups (:func:`~distfuse.groups.world_partition_groups`), is
        collective over the world: every rank must make it.  Later calls need no communication.
        """
        if not dist.is_initialized():
            raise PartitionError("Partition.world: torch.distributed is not initialised; call "
                                 "torch.distributed.init_process_group first")
        return cls(*world_partition_groups(), device)

    def create_partition_inclusive(self, ranks: Iterable[int]) -> Partition:
        """The sub-partition of the workers at positions ``ranks`` of this partition (collective over the world)."""
        idx = [int(r) for r in (ranks.tolist() if isinstance(ranks, np.ndarray) else ranks)]
        if len(set(idx)) != len(idx):
            raise PartitionError(f"{where('Partition')}: create_partition_inclusive got repeated ranks {idx}")
        bad = [r for r in idx if not 0 <= r < self.size]
        if bad:
            raise PartitionError(f"{where('Partition')}: create_partition_inclusive: ranks {bad} are outside this "
                                 f"partition of size {self.size}")
        world = tuple(self.ranks[r] for r in idx)
        (groups,) = groups_for("create_partition_inclusive", [world])
        return Partition(world, groups, self.device)

    def create_cartesian_topology_partition(self, shape: Sequence[int]) -> CartesianPartition:
        """This partition's workers in a row-major grid of ``shape``, of volume its size (collective over the world)."""
        shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in shape):
            raise PartitionError(f"{where('Partition')}: cartesian shape {shape} has a dimension < 1")
        if int(np.prod(shape)) != self.size:
            raise PartitionError(f"{where('Partition')}: cartesian shape {shape} has volume {int(np.prod(shape))}, "
                                 f"expected the partition size {self.size}")
        (groups,) = groups_for("create_cartesian_topology_partition", [self.ranks], {"shape": shape})
        return CartesianPartition(self.ranks, groups, shape, self.device)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Partition) and self.ranks == other.ranks
                and getattr(self, "shape", None) == getattr(other, "shape", None))

    def __hash__(self) -> int:
        return hash((self.ranks, getattr(self, "shape", None)))

    # A copy of a model shares its partitions, as a copied DeviceMesh shares its process groups: a partition is
    # immutable and a group's timeout is looked up by the group's identity, so a second object over the same groups
    # would only be an alias (docs/interop.md, "Copies").  Pickling refuses: a process group lives in one process.
    def __copy__(self) -> Partition:
        return self

    def __deepcopy__(self, memo) -> Partition:
        return self

    def __reduce_ex__(self, protocol):
        raise NotPicklableError(
            f"{where('Partition')}: cannot pickle {self!r}: it holds torch.distributed process groups, which exist "
            "only in the process that created them (torch.save(model) and multiprocessing pickle the model's "
            "layers, and with them their partitions). Save model.state_dict(), or a checkpoint with "
            "distfuse.interop.save_checkpoint, and build the model again where it is loaded; copy.deepcopy(model) "
            "works in-process and shares the partitions")

    def __repr__(self) -> str:
        return f"Partition(ranks={list(self.ranks)}, active={self.active}, rank={self.rank})"


class CartesianPartition(Partition):
    """A partition whose workers form a row-major Cartesian grid.

    Attributes (beyond :class:`Partition`):
        shape: the grid shape.
        dim: number of grid dimensions.
        index: this worker's grid coordinates (all -1 when inactive).
    """

    def __init__(self, ranks: Sequence[int], groups: tuple | None, shape: Sequence[int],
                 device: torch.device | None = None):
        super().__init__(ranks, groups, device)
        self.shape: tuple[int, ...] = tuple(int(s) for s in shape)
        self.dim = len(self.shape)
        self.index: tuple[int, ...] = self.index_of(self.rank) if self.active else (-1,) * self.dim

    def index_of(self, partition_rank: int) -> tuple[int, ...]:
        """Grid coordinates of a partition rank."""
        return tuple(int(i) for i in np.unravel_index(partition_rank, self.shape))

    def rank_of(self, index: Sequence[int]) -> int:
        """Partition rank at grid coordinates ``index``."""
        return int(np.ravel_multi_index(tuple(index), self.shape))

    def neighbors(self, dim: int, periodic: bool = False) -> tuple[int | None, int | None]:
        """Partition ranks of the lower and upper neighbours along ``dim`` (None at a non-periodic edge)."""
        if not self.active:
            return None, None
        out = []
        for step in (-1, 1):
            idx = list(self.index)
            idx[dim] += step
            inside = 0 <= idx[dim] < self.shape[dim]
            idx[dim] %= self.shape[dim]
            out.append(self.rank_of(idx) if inside or periodic else None)
        return out[0], out[1]

    def create_cartesian_subtopology_partition(self, remain_dims: Sequence[bool]) -> CartesianPartition:
        """The sub-grid through this worker that keeps the dimensions flagged in ``remain_dims``.

        Like ``MPI_Cart_sub``: the grid splits into one sub-grid per combination of the
        dropped coordinates, and each worker gets the one it belongs to.  The result
        keeps every dimension, with extent 1 in the dropped ones, so that partition and
        tensor dimensions still correspond.  Collective over the world.
        """
        remain = [bool(r) for r in remain_dims]
        if len(remain) != self.dim:
            raise PartitionError(f"{where('Partition')}: remain_dims has {len(remain)} entries, expected {self.dim}")
        sub_shape = tuple(s if k else 1 for s, k in zip(self.shape, remain, strict=True))
        # One row per sub-grid: the dropped dimensions first, each row its kept coordinates in row-major order.
        order = [d for d in range(self.dim) if not remain[d]] + [d for d in range(self.dim) if remain[d]]
        grid = np.asarray(self.ranks).reshape(self.shape).transpose(order).reshape(-1, int(np.prod(sub_shape)))
        rank_sets = [tuple(int(r) for r in row) for row in grid]
        groups = groups_for("create_cartesian_subtopology_partition", rank_sets,
                             {"parent shape": self.shape, "remain_dims": tuple(remain)})
        me = dist.get_rank()
        for ranks, pair in zip(rank_sets, groups, strict=True):
            if me in ranks:
                return CartesianPartition(ranks, pair, sub_shape, self.device)
        # Inactive in the parent: inactive in every sub-grid too, a placeholder that holds no ranks.
        part = CartesianPartition((), None, sub_shape, self.device)
        part.size = int(np.prod(sub_shape))
        return part

    def __repr__(self) -> str:
        return (f"CartesianPartition(shape={list(self.shape)}, ranks={list(self.ranks)}, active={self.active}, "
                f"index={self.index})")


def check_current_world(P, op: str) -> None:
    """Raise :class:`PartitionError` where ``P`` was made over a world since destroyed; local, no message.

    After ``destroy_process_group()`` and a new ``init_process_group()`` in one process, a layer
    built before would still find its old gloo pairs connected, and run on them with the old
    world's rank numbers, which now name other processes: wrong blocks, no error, or a hang.  Every
    layer and primitive module checks at each eager call instead (one comparison of
    :func:`~distfuse.groups.world_generation`), so each rank that calls a stale one raises at once.
    """
    made = getattr(P, "world_generation", None)
    if made is not None and made != world_generation():
        raise PartitionError(
            f"{where(op)}: partition over world ranks {list(P.ranks)} was made over a process-group world that has "
            "since been destroyed (destroy_process_group, then init_process_group again); build the layer, module "
            "or partition again in the new world")


def union_partition(*partitions: Partition) -> Partition:
    """A partition of every world rank in any of ``partitions``, in world-rank order (collective over the world).

    Cross-partition primitives use it to agree on metadata.
    """
    ranks = tuple(sorted(set().union(*(p.ranks for p in partitions))))
    (groups,) = groups_for("union_partition", [ranks])
    return Partition(ranks, groups, partitions[0].device)
