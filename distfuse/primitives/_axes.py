"""Shared machinery of AllSumReduce, AllGather and ReduceScatter: axes, sub-grids and padded block collectives.

All three act within one :class:`~distfuse.partition.CartesianPartition` ``P_x`` along a
set of partition axes; the collective runs on the group of the sub-grid of workers that
share every *other* coordinate.  The sub-grid keeps every dimension (extent 1 in the
dropped ones), so partition dimension ``d`` still splits tensor dimension ``d``.

Uneven blocks.  gloo rejects an uneven ``reduce_scatter_tensor`` and an uneven list
``all_gather``, so every block is padded to the largest block shape ``pad`` and moved
with one flat collective of ``P * prod(pad)`` elements (:mod:`distfuse._compat`), on NCCL
too.  Padding is never read (NaN in debug mode: :func:`~distfuse.primitives._common.poison`).
``torch.distributed.new_group`` sorts its ranks, so slot ``g`` of a flat collective
belongs to the member with the ``g``-th smallest world rank, not to sub-grid rank ``g``
when the partition lists its ranks out of order: :attr:`BlockLayout.slots` maps one to
the other.  When every block has the pad shape and the slots are in order, the
block-major buffer is a permutation of the full tensor: gathering (and packing for the
reduce-scatter) is a ``permute``-``reshape``, a view when only the first gathered
dimension is split; otherwise blocks are copied one by one.

Reduction precision.  gloo and NCCL round every partial sum to the tensor's dtype, in an
order that depends on the algorithm and the rank, so a sum over ``p`` workers carries up
to ``p - 1`` roundings in bf16/fp16, and workers may disagree.  ``reduce_dtype=torch.float32``
adds in fp32 instead, at twice the bytes on the wire (FSDP's knob of the same name), and
rounds once, back to the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distfuse import debug
from distfuse._compat import all_gather_flat, reduce_scatter_flat
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.partition import CartesianPartition
from distfuse.primitives._common import cached, check_inactive_input, collective_guard, gather_metadata, poison

__all__ = ["resolve_axes", "axes_subgrid", "group_slots", "BlockLayout", "balanced_layout", "layout_from_shapes",
           "gather_blocks", "scatter_sum_blocks", "all_reduce_sum", "check_partition", "check_cartesian", "check_input"]


def check_partition(op: str, P_x) -> None:
    if not isinstance(P_x, CartesianPartition):
        raise expect(op, "partition type", "CartesianPartition", type(P_x).__name__, cls=PartitionError)


def check_cartesian(op: str, P, name: str = "P") -> None:
    if not isinstance(P, CartesianPartition):
        raise PartitionError(f"{where(op)}: {name} must be a CartesianPartition (one partition dimension per tensor "
                             f"dimension), got {type(P).__name__}")


def resolve_axes(op: str, P_x: CartesianPartition, axes, axes_keep, axes_name: str) -> tuple[int, ...]:
    """The sorted partition axes an op acts along, from exactly one of ``axes`` and ``axes_keep`` (the complement);
    negative axes count from the end, as in torch.  Raised before any collective, so every rank raises."""
    if (axes is None) == (axes_keep is None):
        given = "both" if axes is not None else "neither"
        raise expect(op, f"exactly one of {axes_name} and axes_keep", "one", given, cls=PartitionError)
    name, given = (axes_name, axes) if axes is not None else ("axes_keep", axes_keep)
    if hasattr(given, "__index__"):  # one axis: int, numpy integer
        given = (given,)
    ndim, chosen = P_x.dim, []
    for a in given:
        a = int(a)
        if not -ndim <= a < ndim:
            raise expect(op, f"{name} entry {a} for a partition of {ndim} dimensions", f"in [{-ndim}, {ndim})", a,
                         cls=PartitionError)
        chosen.append(a % ndim)
    if len(set(chosen)) != len(chosen):
        raise expect(op, f"{name} without repeats", "distinct axes", tuple(given), cls=PartitionError)
    if axes_keep is not None:
        return tuple(d for d in range(ndim) if d not in chosen)
    return tuple(sorted(chosen))


def axes_subgrid(P_x: CartesianPartition, axes: Iterable[int]) -> CartesianPartition:
    """The sub-grid through this worker along ``axes`` (collective over the world, like every partition creation)."""
    axes = set(axes)
    return P_x.create_cartesian_subtopology_partition([d in axes for d in range(P_x.dim)])


_SLOTS: dict[tuple[int, ...], tuple[int, ...]] = {}


def group_slots(P_sub: CartesianPartition) -> tuple[int, ...]:
    """``slots[j]``: the position of sub-grid rank ``j`` in a flat collective on ``P_sub.group`` (its group rank);
    cached by rank tuple, as the groups are (``partition.py``)."""
    return cached(_SLOTS, P_sub.ranks, lambda: tuple(dist.get_group_rank(P_sub.group, r) for r in P_sub.ranks))


def check_input(op: str, P_sub: CartesianPartition, x: torch.Tensor, ndim: int | None) -> bool:
    """Check ``x`` and say whether this worker takes part (False: inactive, ``x`` is zero-volume)."""
    if not isinstance(x, torch.Tensor):
        raise expect(op, "input type", "torch.Tensor", type(x).__name__)
    if not P_sub.active:
        check_inactive_input(op, x)
        return False
    if ndim is not None and x.dim() != ndim:
        raise expect(op, "number of tensor dimensions (one per partition dimension)", ndim, x.dim())
    if x.device.type != P_sub.device.type:
        raise expect(op, "device", P_sub.device, x.device)
    return True


@dataclass(frozen=True)
class BlockLayout:
    """Where every sub-grid worker's block sits in the full (gathered) tensor.

    Attributes:
        grid: the sub-grid shape (1 in the dimensions that are not gathered).
        shape: the full tensor: the sum of the block extents along gathered dimensions,
            the common extent elsewhere.
        starts, extents: per sub-grid rank, the block's offset into and shape within ``shape``.
        pad: the largest block shape; every block travels padded to it.
        slots: per sub-grid rank, its position in the flat buffers (see the module docstring).
        me: this worker's sub-grid rank.
        blocks: ``extents`` flattened, the layout as the AllGather / ReduceScatter op pair takes it
            (:mod:`~distfuse.primitives._gather_scatter`).
    """

    grid: tuple[int, ...]
    shape: tuple[int, ...]
    starts: tuple[tuple[int, ...], ...]
    extents: tuple[tuple[int, ...], ...]
    pad: tuple[int, ...]
    slots: tuple[int, ...]
    me: int
    blocks: tuple[int, ...] = ()

    @property
    def fast(self) -> bool:
        """Every block has the pad shape and the buffer is in sub-grid order: a permute replaces the copies."""
        return all(e == self.pad for e in self.extents) and self.slots == tuple(range(len(self.slots)))

    @property
    def block_numel(self) -> int:
        return math.prod(self.pad)

    def slices(self, j: int) -> tuple[slice, ...]:
        return tuple(slice(s, s + e) for s, e in zip(self.starts[j], self.extents[j], strict=True))


_BALANCED: dict[tuple, BlockLayout] = {}


def balanced_layout(P_sub: CartesianPartition, shape: Sequence[int]) -> BlockLayout:
    """The layout of the balanced decomposition of ``shape`` over ``P_sub`` (no communication).

    Cached per (sub-grid, shape), up to 1024 shapes: a layer calls this every step with the
    same shapes, and rebuilding costs ``P * ndim`` Python calls.
    """
    shape = tuple(int(n) for n in shape)

    def make() -> BlockLayout:  # balanced blocks tile, so this raises nothing
        shapes = [local_shape(shape, P_sub.shape, P_sub.index_of(j)) for j in range(P_sub.size)]
        return layout_from_shapes("balanced_layout", P_sub, shapes)

    return cached(_BALANCED, (P_sub.ranks, P_sub.shape, P_sub.rank, shape), make, limit=1024)


def check_block_dims(op: str, P_sub: CartesianPartition, shapes: Sequence[tuple[int, ...]]) -> None:
    """Every worker's block (``shapes`` in sub-grid rank order) has one dimension per partition
    dimension; else the same :class:`ShapeError` on every worker."""
    for r, s in zip(P_sub.ranks, shapes, strict=True):
        if len(s) != P_sub.dim:
            raise expect(op, f"number of tensor dimensions on world rank {r} (one per partition dimension)",
                         P_sub.dim, len(s))


def layout_from_shapes(op: str, P_sub: CartesianPartition, shapes: Sequence[tuple[int, ...]]) -> BlockLayout:
    """The layout of blocks with the given per-sub-grid-rank shapes, concatenated in index order.

    Blocks need not be balanced, but they must tile: workers that share a coordinate along
    a gathered dimension have equal extents there, and every worker has the same extent
    along the other dimensions.  Every worker holds the same ``shapes``, so every worker
    raises the same :class:`ShapeError`.
    """
    check_block_dims(op, P_sub, shapes)
    idx = [P_sub.index_of(j) for j in range(P_sub.size)]
    along: list[list[int | None]] = [[None] * p for p in P_sub.shape]
    for j, shape in enumerate(shapes):
        for d, n in enumerate(shape):
            seen = along[d][idx[j][d]]
            if seen is None:
                along[d][idx[j][d]] = n
            elif seen != n:
                rows = ", ".join(f"rank {P_sub.ranks[k]} index {idx[k]}: {tuple(s)}" for k, s in enumerate(shapes))
                what = (f"extent along dimension {d} of the blocks at index {idx[j][d]}" if P_sub.shape[d] > 1
                        else f"extent along the not-gathered dimension {d}")
                raise ShapeError(f"{where(op)}: the blocks do not tile: {what} must agree; got {rows}")
    offsets = [[sum(ext[:i]) for i in range(len(ext))] for ext in along]
    starts = tuple(tuple(offsets[d][i[d]] for d in range(P_sub.dim)) for i in idx)
    extents = tuple(tuple(s) for s in shapes)
    pad = tuple(max(col) for col in zip(*extents, strict=True))
    return BlockLayout(tuple(P_sub.shape), tuple(sum(ext) for ext in along), starts, extents, pad, group_slots(P_sub),
                       P_sub.rank, tuple(n for e in extents for n in e))


def gathered_layout(op: str, P_sub: CartesianPartition, x: torch.Tensor) -> tuple[BlockLayout, torch.dtype]:
    """Layout and dtype from every worker's actual block: one host-side metadata all-gather (see AllGather); the
    blocks must tile and share one dtype distfuse moves, or every worker raises the same :class:`ShapeError`."""
    meta = gather_metadata(P_sub, x, op=op)  # rows in P_sub's rank order
    dtypes = {dt for _, dt in meta}
    if len(dtypes) != 1 or None in dtypes:
        rows = ", ".join(f"rank {r}: {dt}" for r, (_, dt) in zip(P_sub.ranks, meta, strict=True))
        raise ShapeError(f"{where(op)}: every worker must pass the same dtype; got {rows} (world rank: dtype)")
    return layout_from_shapes(op, P_sub, [s for s, _ in meta]), dtypes.pop()


def interleave(k: int) -> list[int]:
    """Permutation of ``[g_0..g_{k-1}, m_0..m_{k-1}]`` into ``[g_0, m_0, ..., g_{k-1}, m_{k-1}]``."""
    return [a for d in range(k) for a in (d, k + d)]


def box(shape) -> tuple[slice, ...]:
    """The slices of the leading corner ``shape`` of a (padded) block."""
    return tuple(slice(0, e) for e in shape)


def debug_agree(op: str, P_sub, x: torch.Tensor, same: dict) -> None:
    if debug.enabled():
        debug.check_agreement(op, P_sub.ranks, P_sub.meta_group, dict(same, dtype=str(x.dtype)),
                              {"local shape": tuple(x.shape)})


def unpack_blocks(rows: torch.Tensor, layout: BlockLayout, like: torch.Tensor) -> torch.Tensor:
    """The full tensor from a received ``[P, slot]`` buffer whose row ``layout.slots[j]`` starts with rank ``j``'s
    padded block (a view where the fast path allows)."""
    n = layout.block_numel
    if n == 0:
        return like.new_zeros(layout.shape)
    blocks = rows[:, :n].unflatten(1, layout.pad)
    if layout.fast:
        return blocks.unflatten(0, layout.grid).permute(interleave(len(layout.grid))).reshape(layout.shape)
    out = poison(like.new_empty(layout.shape))
    for j, slot in enumerate(layout.slots):
        out[layout.slices(j)] = blocks[slot][box(layout.extents[j])]
    return out


def block_major(full: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``full`` as ``[*grid, *pad]`` blocks (fast layouts only): a permuted view, no copy."""
    k = len(layout.grid)
    inter = [a for g, m in zip(layout.grid, layout.pad, strict=True) for a in (g, m)]
    return full.reshape(inter).permute(list(range(0, 2 * k, 2)) + list(range(1, 2 * k, 2)))


def pack_blocks(full: torch.Tensor, layout: BlockLayout, send: torch.Tensor) -> None:
    """Write rank ``j``'s block of ``full``, padded, at the start of row ``layout.slots[j]`` of ``send``."""
    blocks = send[:, :layout.block_numel].unflatten(1, layout.pad)
    if layout.fast:
        blocks.unflatten(0, layout.grid).copy_(block_major(full, layout))
        return
    for j, slot in enumerate(layout.slots):
        blocks[slot][box(layout.extents[j])] = full[layout.slices(j)]


def my_block(recv: torch.Tensor, layout: BlockLayout, dtype: torch.dtype) -> torch.Tensor:
    """This worker's block of a received padded block ``recv`` (flat), contiguous, in ``dtype``."""
    block = recv[:layout.block_numel].view(layout.pad)[box(layout.extents[layout.me])]
    return block.to(dtype).contiguous()


def gather_blocks(op: str, P_sub: CartesianPartition, layout: BlockLayout, x: torch.Tensor) -> torch.Tensor:
    """Every worker's block concatenated in index order (no autograd; ``x`` has ``layout.extents[layout.me]``):
    one flat all-gather of ``P * prod(pad)`` elements on ``P_sub.group``."""
    fits = tuple(x.shape) == layout.extents[layout.me]
    # In debug mode a misfit block fails on every worker, not only here (peers would wait for the timeout).
    debug_agree(op, P_sub, x, {"gathered shape": layout.shape, "pad": layout.pad, "block fits": fits})
    if not fits:
        raise expect(op, "local block shape", layout.extents[layout.me], tuple(x.shape))
    n = layout.block_numel
    if n == 0:  # every block is empty: every worker knows it from the layout, and none communicates
        return x.new_zeros(layout.shape)
    if tuple(x.shape) == layout.pad:
        send = x.contiguous()
    else:
        send = poison(x.new_empty(layout.pad))
        send[box(x.shape)] = x
    buf = poison(x.new_empty((P_sub.size * n,)))
    with collective_guard(op, "all-gather", P_sub.ranks):
        all_gather_flat(buf, send, group=P_sub.group)
    return unpack_blocks(buf.view(P_sub.size, n), layout, x)


def scatter_sum_blocks(op: str, P_sub: CartesianPartition, layout: BlockLayout, full: torch.Tensor,
                       reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """This worker's block (contiguous, ``full``'s dtype) of the sum over ``P_sub`` of the full-shape ``full``
    tensors (no autograd): one flat reduce-scatter of ``P * prod(pad)`` elements on ``P_sub.group``, added in
    ``reduce_dtype`` (default: ``full``'s dtype)."""
    wire = reduce_dtype if reduce_dtype is not None else full.dtype
    fits = tuple(full.shape) == layout.shape
    debug_agree(op, P_sub, full, {"full shape": layout.shape, "reduce dtype": str(wire), "input fits": fits})
    if not fits:
        raise expect(op, "full (partial-sum) tensor shape", layout.shape, tuple(full.shape))
    n = layout.block_numel
    if n == 0:
        return full.new_zeros(layout.extents[layout.me])
    if layout.fast:  # no copy where the permutation is one already (only the first dimension split)
        send = block_major(full, layout).to(wire).contiguous()
    else:
        send = poison(full.new_empty((P_sub.size, n), dtype=wire))
        pack_blocks(full, layout, send)
    recv = poison(full.new_empty((n,), dtype=wire))
    with collective_guard(op, "reduce-scatter", P_sub.ranks):
        reduce_scatter_flat(recv, send.reshape(-1), group=P_sub.group)
    return my_block(recv, layout, full.dtype)


def all_reduce_sum(op: str, P_sub: CartesianPartition, x: torch.Tensor,
                   reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor: the sum of ``x`` over ``P_sub``, added in ``reduce_dtype`` (no autograd)."""
    wire = reduce_dtype if reduce_dtype is not None else x.dtype
    debug_agree(op, P_sub, x, {"shape": tuple(x.shape), "reduce dtype": str(wire)})
    y = torch.empty(x.shape, dtype=wire, device=x.device)  # a new contiguous tensor, in one copy
    y.copy_(x)
    if y.numel() > 0:  # shapes agree over the sub-grid, so every worker skips together
        with collective_guard(op, "all-reduce", P_sub.ranks):
            dist.all_reduce(y, group=P_sub.group)
    return y.to(dtype=x.dtype)

