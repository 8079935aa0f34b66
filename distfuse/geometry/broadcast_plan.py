"""Who sends to whom in a Broadcast or a SumReduce, computed once from the partition shapes.

Both primitives move whole blocks along one map: every worker of the *destination*
partition gets its data from exactly one worker of the *source* partition, the one
the broadcast rules select.  Broadcast(P_x, P_y) walks the map forwards (source P_x
copies to destinations P_y); SumReduce(P_x, P_y) is the adjoint of
Broadcast(P_y, P_x), so it builds the plan with P_y as the source and walks it
backwards (each P_x worker sends to its P_y source, which sums what it receives).

The rules (DistDL's): with ``transpose_*`` the partition *shape* is reversed (the
tensor is untouched), then the source shape is extended on the left with ones to the
destination's number of dimensions; in every dimension the source extent must be 1
or equal the destination extent.  Destination worker with effective index ``e`` gets
the block of the source worker whose effective index is ``e`` with the broadcast
(extent-1) dimensions set to 0.  Transposing a partition reverses its workers'
indices along with its shape.

A plain :class:`~distfuse.partition.Partition` (no Cartesian topology) counts as a
one-dimensional grid of its size.  Everything here is pure Python: no communication.
"""

from __future__ import annotations

import numpy as np

from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError, where

__all__ = ["BroadcastPlan", "grid_shape", "check_gathered_inputs"]


def grid_shape(P) -> tuple[int, ...]:
    """The Cartesian shape of ``P``; ``(size,)`` for a partition without a topology."""
    shape = getattr(P, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else (int(P.size),)


class BroadcastPlan:
    """The source of every destination worker, as world ranks.

    Attributes:
        op: the primitive the plan is for (named in errors).
        src_ranks, dst_ranks: world ranks of the source and destination partitions.
        ndim: number of dimensions of the destination partition; the tensors moved
            must have this many dimensions (one per partition dimension after the
            source is extended with ones).
        source: destination world rank -> the source world rank it receives from.
        dests: source world rank -> its destination world ranks, in destination order.
        identity: every worker is its own source, so no data moves.
        signature: a hashable summary that every rank of the op must agree on.
    """

    def __init__(self, op: str, P_src, P_dst, transpose_src: bool = False, transpose_dest: bool = False,
                 src_name: str = "P_x", dst_name: str = "P_y"):
        self.op = op
        self.src_partition, self.dst_partition = P_src, P_dst
        for P, name in ((P_src, src_name), (P_dst, dst_name)):
            if len(P.ranks) != P.size:
                raise PartitionError(
                    f"{where(op)}: {name} must be the same partition on every world rank, but this rank holds a "
                    f"placeholder without ranks (a sub-grid this rank is not in); build {name} with "
                    "create_partition_inclusive + create_cartesian_topology_partition on every rank")
        sx, sy = grid_shape(P_src), grid_shape(P_dst)
        ex = sx[::-1] if transpose_src else sx
        ey = sy[::-1] if transpose_dest else sy
        desc = (f"{src_name} of shape {list(sx)}{' (transpose_src)' if transpose_src else ''} and {dst_name} of "
                f"shape {list(sy)}{' (transpose_dest)' if transpose_dest else ''}")
        if len(ex) > len(ey):
            raise PartitionError(f"{where(op)}: dim({src_name}) = {len(sx)} exceeds dim({dst_name}) = {len(sy)}; "
                                 f"{src_name} must broadcast to {dst_name} ({desc})")
        pad = len(ey) - len(ex)
        ex = (1,) * pad + ex
        for d, (a, b) in enumerate(zip(ex, ey, strict=True)):
            if a != 1 and a != b:
                hint = ""
                if not (transpose_src or transpose_dest) and _broadcasts(sx[::-1], sy):
                    hint = "; transpose_src=True or transpose_dest=True would make it broadcast"
                raise PartitionError(
                    f"{where(op)}: {src_name} does not broadcast to {dst_name} ({desc}): in dimension {d} of the "
                    f"effective shapes {list(ex)} and {list(ey)} (after transposing and extending {src_name} "
                    f"with ones on the left) the extent {a} must be 1 or equal {b}{hint}")
        self.src_ranks: tuple[int, ...] = tuple(P_src.ranks)
        self.dst_ranks: tuple[int, ...] = tuple(P_dst.ranks)
        self.ndim = len(sy)
        self.source: dict[int, int] = {}
        dests: dict[int, list[int]] = {w: [] for w in self.src_ranks}
        for j, w_dst in enumerate(self.dst_ranks):
            iy = tuple(int(i) for i in np.unravel_index(j, sy))
            e = iy[::-1] if transpose_dest else iy
            e_src = tuple(0 if a == 1 else i for a, i in zip(ex, e, strict=True))[pad:]
            i_src = e_src[::-1] if transpose_src else e_src
            w_src = self.src_ranks[int(np.ravel_multi_index(i_src, sx))]
            self.source[w_dst] = w_src
            dests[w_src].append(w_dst)
        self.dests: dict[int, tuple[int, ...]] = {w: tuple(v) for w, v in dests.items()}
        self.identity = all(s == d for d, s in self.source.items())
        self.signature = (op, self.src_ranks, sx, bool(transpose_src), self.dst_ranks, sy, bool(transpose_dest))

    def is_src(self, world_rank: int) -> bool:
        return world_rank in self.dests

    def is_dst(self, world_rank: int) -> bool:
        return world_rank in self.source

    def dests_of(self, world_rank: int) -> tuple[int, ...]:
        return self.dests.get(world_rank, ())

    def source_of(self, world_rank: int) -> int | None:
        return self.source.get(world_rank)

    def __repr__(self) -> str:
        return f"BroadcastPlan({self.op}, source={self.source})"


def _broadcasts(sx, sy) -> bool:
    if len(sx) > len(sy):
        return False
    ex = (1,) * (len(sy) - len(sx)) + tuple(sx)
    return all(a == 1 or a == b for a, b in zip(ex, sy, strict=True))


def check_gathered_inputs(plan: BroadcastPlan, union_ranks, meta, data_on: str, data_name: str = "P_x") -> None:
    """Check every worker's input from gathered ``(shape, dtype)`` metadata; raise the same error on every rank.

    ``data_on`` says which side of the plan holds the input data: ``"src"`` for a
    Broadcast, ``"dst"`` for a SumReduce.  Workers there must pass ``plan.ndim``-dimensional
    tensors of one dtype; everyone else must pass a zero-volume tensor.  For a
    SumReduce (``data_on="dst"``) the blocks summed into one worker must also share a shape.
    """
    holders = plan.dests if data_on == "src" else plan.source
    by_rank = dict(zip(union_ranks, meta, strict=True))
    for w, (shape, _) in by_rank.items():
        if w not in holders and int(np.prod(shape)) != 0:
            raise ShapeError(f"{where(plan.op)}: world rank {w} is not active in {data_name}, so it must pass a "
                             f"zero-volume tensor; it passed shape {tuple(shape)}")
    for w in holders:
        shape = by_rank[w][0]
        if len(shape) != plan.ndim:
            raise ShapeError(f"{where(plan.op)}: world rank {w}: number of tensor dimensions (one per partition "
                             f"dimension, after extension with ones): expected {plan.ndim}, got {len(shape)} "
                             f"(shape {tuple(shape)})")
    dtypes = {w: by_rank[w][1] for w in holders}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"rank {w}: {d}" for w, d in sorted(dtypes.items()))
        raise CollectiveMismatchError(f"{where(plan.op)}: the workers of {data_name} must pass one dtype; got "
                                      f"{listing}")
    if data_on == "dst":
        for w_src, ws in plan.dests.items():
            shapes = {w: tuple(by_rank[w][0]) for w in ws}
            if len(set(shapes.values())) > 1:
                raise ShapeError(f"{where(plan.op)}: the blocks summed into world rank {w_src} must have one shape; "
                                 f"got {shapes} (world rank: local shape)")
