"""Partitions: sets of workers, optionally arranged in a Cartesian grid.

A :class:`Partition` is an ordered set of world ranks with a cached
``torch.distributed`` process group.  A :class:`CartesianPartition` arranges those
ranks in a row-major grid (partition rank ``r`` of a ``[2, 2]`` grid has index
``(r // 2, r % 2)``, as in MPI's Cartesian topologies); partition dimension ``d``
splits tensor dimension ``d``.

Creating a partition is **collective over the whole world**, because
``torch.distributed.new_group`` is: every world rank, active in the new partition or
not, must make the same creation calls in the same order.  distfuse checks this: each
creation first gathers a ``(sequence number, call, ranks)`` record from every world
rank, and if the records differ every rank raises :class:`PartitionError` naming the
ranks that disagree, instead of hanging inside ``new_group``.  A rank that never
makes the call leaves the others waiting only until the process-group timeout.

Process groups are created with distfuse's timeout (``DISTFUSE_TIMEOUT`` seconds,
default 600) and cached by their tuple of world ranks, so equal partitions share one
group.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from distfuse.errors import CollectiveTimeoutError, PartitionError, where

__all__ = [
    "Partition",
    "CartesianPartition",
    "zero_volume_tensor",
    "default_timeout",
    "metadata_group",
    "union_partition",
    "cuda_backend_of",
]

_GROUPS: dict[tuple[int, ...], tuple] = {}
_CREATION_SEQ = [0]
_META_GROUP: list = []


def default_timeout() -> timedelta:
    """Timeout of every process group distfuse creates (``DISTFUSE_TIMEOUT`` seconds, default 600)."""
    return timedelta(seconds=float(os.environ.get("DISTFUSE_TIMEOUT", "600")))


def zero_volume_tensor(b: int | None = None, dtype: torch.dtype | None = None, device=None,
                       requires_grad: bool = False) -> torch.Tensor:
    """The placeholder an inactive worker passes and receives: shape ``[0]``, or ``[b, 0]`` to keep a batch size.

    Pass ``requires_grad=True`` on ranks that hold no input but take part in a
    backward pass, so that autograd runs the adjoint there too.
    """
    shape = (0,) if b is None else (int(b), 0)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def _world_size() -> int:
    return dist.get_world_size()


def _world_rank() -> int:
    return dist.get_rank()


def metadata_group():
    """A CPU (gloo) group over the whole world for small host-side metadata collectives.

    With gloo the world group serves; with NCCL a gloo group is created once (a
    collective call, made the first time any rank needs it).
    """
    if not _META_GROUP:
        if dist.get_backend() == "gloo":
            _META_GROUP.append(dist.group.WORLD)
        else:
            _META_GROUP.append(dist.new_group(backend="gloo", timeout=default_timeout()))
    return _META_GROUP[0]


def _check_creation_consistent(call: str, groups: Sequence[tuple[int, ...]]) -> None:
    """All world ranks must be creating the same groups now; raise on every rank if not."""
    _CREATION_SEQ[0] += 1
    record = (_CREATION_SEQ[0], call, tuple(groups))
    records: list = [None] * _world_size()
    try:
        dist.all_gather_object(records, record, group=metadata_group())
    except RuntimeError as exc:  # a rank that never arrives surfaces as a timeout or a closed connection
        raise CollectiveTimeoutError(
            f"{where('Partition')}: partition creation is collective over the world, but not every rank made "
            f"call #{record[0]} ({call}) within the timeout: {exc}"
        ) from exc
    if any(r != record for r in records):
        lines = "\n".join(f"  rank {i}: call #{r[0]} {r[1]} groups={list(r[2])}" for i, r in enumerate(records))
        raise PartitionError(
            f"{where('Partition')}: partition creation is collective over the world and every rank must make the "
            f"same call; the ranks disagree:\n{lines}"
        )


def _groups_for(call: str, rank_sets: Sequence[tuple[int, ...]]) -> list:
    """Create (or reuse) one process group per rank set; collective over the world.

    Returns ``(group, meta_group)`` per rank set, or None where this rank is not a
    member.  ``meta_group`` is a gloo group over the same ranks for host-side
    metadata (shapes); under gloo it is the data group itself.
    """
    _check_creation_consistent(call, rank_sets)
    gloo = dist.get_backend() == "gloo"
    out = []
    for ranks in rank_sets:
        if ranks not in _GROUPS:
            if ranks == tuple(range(_world_size())):
                data = dist.group.WORLD
                meta = data if gloo else metadata_group()
            else:
                data = dist.new_group(list(ranks), timeout=default_timeout())
                meta = data if gloo else dist.new_group(list(ranks), timeout=default_timeout(), backend="gloo")
            _GROUPS[ranks] = (data, meta)
        out.append(_GROUPS[ranks] if _world_rank() in ranks else None)
    return out


def _cuda_backend_in_spec(spec: str) -> str | None | bool:
    """The CUDA backend named by a backend string, None if it names none, False if it cannot tell.

    Strings come in two forms: a bare name (``"nccl"``, ``"gloo"``: that backend serves
    every device type it supports) or ``"device:backend"`` pairs (``"cpu:gloo,cuda:nccl"``).
    ``"undefined"`` is what ``torch.distributed.get_backend`` reports after
    ``init_process_group()`` without a backend (torchrun's usual form): it says nothing
    about the device backends, so the caller must ask elsewhere.
    """
    spec = str(spec).strip().lower()
    if not spec or spec == "undefined":
        return False
    if ":" not in spec:
        return spec
    pairs = dict(item.split(":", 1) for item in spec.split(",") if ":" in item)
    return pairs.get("cuda", "").strip() or None


def cuda_backend_of(group=None) -> str | None:
    """Name of the backend that runs ``group``'s collectives on CUDA tensors (``"nccl"``, ``"gloo"``), or None.

    ``group`` defaults to the world.  Why not compare ``dist.get_backend(group)`` with
    ``"nccl"``: after ``init_process_group()`` with no backend that string reads
    ``"undefined"`` although CUDA tensors go to NCCL, and after
    ``init_process_group("cpu:gloo,cuda:nccl")`` it is stored as written; a string test
    then takes an NCCL world for a CPU one, skips the communicator warm-up, and a later
    partial ``batch_isend_irecv`` can hang.  So ask, in order, what torch 2.5 to 2.13
    offer: the group's backend config (``dist.get_backend_config``, ``"cpu:gloo,cuda:nccl"``
    even when the backend string is ``"undefined"``), the backend the group holds for the
    CUDA device type (``ProcessGroup._get_backend``, private), and last the backend
    string.  None when the group has no CUDA backend or none of these can tell.
    """
    pg = group if group is not None else dist.group.WORLD
    get_config = getattr(dist, "get_backend_config", None)
    if get_config is not None:
        try:
            found = _cuda_backend_in_spec(get_config(group))
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError):  # not a member, not initialised
            found = False
        if found is not False:
            return found
    get_device_backend = getattr(pg, "_get_backend", None)
    if get_device_backend is not None:
        try:
            backend = get_device_backend(torch.device("cuda"))
        except (RuntimeError, ValueError, TypeError, AttributeError):  # "No backend type associated with ... cuda"
            backend = None
        name = getattr(backend, "name", None) if backend is not None else None
        try:
            name = name() if callable(name) else name
        except (RuntimeError, TypeError):
            name = None
        if name:
            return str(name).lower()
    try:
        found = _cuda_backend_in_spec(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError, AttributeError):
        found = False
    return found or None


def _uses_nccl(group=None) -> bool:
    """Whether ``group`` sends CUDA tensors through NCCL: then partitions live on the GPU and need the warm-up."""
    return cuda_backend_of(group) == "nccl"


def _default_device() -> torch.device:
    """``cuda:<current>`` when the world's CUDA backend is NCCL (however the backend was spelt), else CPU."""
    if _uses_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _warm_up_nccl(group) -> None:
    """Run one collective on every rank of ``group`` so that NCCL creates its communicator now.

    NCCL creates communicators lazily, and a ``batch_isend_irecv`` that is the first call
    on a communicator must include every rank of it; the primitives' P2P rounds involve
    only some ranks.
    """
    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=group)


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
        device: where this partition's tensors live: ``cuda:<current>`` when the world's
            CUDA backend is NCCL (:func:`cuda_backend_of`; ``init_process_group()`` with no
            backend counts), else CPU.
    """

    def __init__(self, ranks: Sequence[int], groups: tuple | None, device: torch.device | None = None):
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.size = len(self.ranks)
        me = _world_rank()
        self.active = me in self.ranks
        self.rank = self.ranks.index(me) if self.active else -1
        self.group, self.meta_group = groups if (self.active and groups is not None) else (None, None)
        self.device = device if device is not None else _default_device()

    @classmethod
    def world(cls, device: torch.device | None = None) -> Partition:
        """Every rank of the initialised default process group.

        The first call is collective when the world's CUDA backend is NCCL (it creates the
        gloo metadata group and warms up the world communicator); later calls and gloo
        need no communication.
        """
        if not dist.is_initialized():
            raise PartitionError("Partition.world: torch.distributed is not initialised; call "
                                 "torch.distributed.init_process_group first")
        ranks = tuple(range(_world_size()))
        if ranks not in _GROUPS:
            _GROUPS[ranks] = (dist.group.WORLD, metadata_group())
            if _uses_nccl(dist.group.WORLD):
                # Decided from the world's CUDA backend, not its backend string, which reads
                # "undefined" under torchrun's init_process_group() (see cuda_backend_of).
                _warm_up_nccl(dist.group.WORLD)
        return cls(ranks, _GROUPS[ranks], device)

    def create_partition_inclusive(self, ranks: Iterable[int]) -> Partition:
        """The sub-partition of the workers at positions ``ranks`` of this partition.

        Collective over the world: every world rank must call it with the same ranks.
        """
        idx = [int(r) for r in (ranks.tolist() if isinstance(ranks, np.ndarray) else ranks)]
        if len(set(idx)) != len(idx):
            raise PartitionError(f"{where('Partition')}: create_partition_inclusive got repeated ranks {idx}")
        bad = [r for r in idx if not 0 <= r < self.size]
        if bad:
            raise PartitionError(f"{where('Partition')}: create_partition_inclusive: ranks {bad} are outside this "
                                 f"partition of size {self.size}")
        world = tuple(self.ranks[r] for r in idx)
        (groups,) = _groups_for("create_partition_inclusive", [world])
        return Partition(world, groups, self.device)

    def create_cartesian_topology_partition(self, shape: Sequence[int]) -> CartesianPartition:
        """Arrange this partition's workers in a row-major grid of ``shape``; its volume must equal the size.

        Collective over the world (it reuses this partition's cached group).
        """
        shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in shape):
            raise PartitionError(f"{where('Partition')}: cartesian shape {shape} has a dimension < 1")
        if int(np.prod(shape)) != self.size:
            raise PartitionError(f"{where('Partition')}: cartesian shape {shape} has volume {int(np.prod(shape))}, "
                                 f"expected the partition size {self.size}")
        (groups,) = _groups_for("create_cartesian_topology_partition", [self.ranks])
        return CartesianPartition(self.ranks, groups, shape, self.device)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Partition) and self.ranks == other.ranks
                and getattr(self, "shape", None) == getattr(other, "shape", None))

    def __hash__(self) -> int:
        return hash((self.ranks, getattr(self, "shape", None)))

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
            if not 0 <= idx[dim] < self.shape[dim]:
                if not periodic:
                    out.append(None)
                    continue
                idx[dim] %= self.shape[dim]
            out.append(self.rank_of(idx))
        return out[0], out[1]

    def create_cartesian_subtopology_partition(self, remain_dims: Sequence[bool]) -> CartesianPartition:
        """The sub-grid through this worker that keeps the dimensions flagged in ``remain_dims``.

        Like ``MPI_Cart_sub``: the grid splits into one sub-grid per combination of the
        dropped coordinates, and each worker gets the one it belongs to.  The result
        keeps every dimension, with extent 1 in the dropped ones, so that partition and
        tensor dimensions still correspond.  Collective over the world: every world
        rank creates every sub-grid's group.
        """
        remain = [bool(r) for r in remain_dims]
        if len(remain) != self.dim:
            raise PartitionError(f"{where('Partition')}: remain_dims has {len(remain)} entries, expected {self.dim}")
        sub_shape = tuple(s if k else 1 for s, k in zip(self.shape, remain, strict=True))
        dropped = [range(s) if not k else range(1) for s, k in zip(self.shape, remain, strict=True)]
        kept = [range(s) if k else range(1) for s, k in zip(self.shape, remain, strict=True)]
        rank_sets = []
        for base in itertools.product(*dropped):
            members = []
            for off in itertools.product(*kept):
                idx = [b + o for b, o in zip(base, off, strict=True)]
                members.append(self.ranks[self.rank_of(idx)])
            rank_sets.append(tuple(members))
        groups = _groups_for("create_cartesian_subtopology_partition", rank_sets)
        me = _world_rank()
        for ranks, pair in zip(rank_sets, groups, strict=True):
            if me in ranks:
                return CartesianPartition(ranks, pair, sub_shape, self.device)
        # Inactive in the parent: inactive in every sub-grid too.
        return _inactive(sub_shape, self)

    def __repr__(self) -> str:
        return (f"CartesianPartition(shape={list(self.shape)}, ranks={list(self.ranks)}, active={self.active}, "
                f"index={self.index})")


def _inactive(shape: Sequence[int], parent: Partition) -> CartesianPartition:
    """A placeholder sub-grid for a worker outside the parent partition (it holds no ranks)."""
    part = CartesianPartition.__new__(CartesianPartition)
    part.ranks = ()
    part.size = int(np.prod(shape))
    part.active = False
    part.rank = -1
    part.group = None
    part.meta_group = None
    part.device = parent.device
    part.shape = tuple(shape)
    part.dim = len(part.shape)
    part.index = (-1,) * part.dim
    return part


def union_partition(*partitions: Partition) -> Partition:
    """A partition of every world rank in any of ``partitions``, in world-rank order.

    Collective over the world.  Cross-partition primitives use it to agree on metadata.
    """
    ranks = tuple(sorted(set().union(*(p.ranks for p in partitions))))
    (groups,) = _groups_for("union_partition", [ranks])
    return Partition(ranks, groups, partitions[0].device)
