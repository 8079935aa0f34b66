"""Balanced decomposition of tensor extents over a Cartesian grid of workers.

One rule everywhere in distfuse: a global extent ``n`` split over ``p`` workers gives
every block ``n // p`` elements and the first ``n % p`` blocks one more.  Extents
smaller than ``p`` leave the trailing blocks empty (extent 0), which is legal: such a
worker is active in its partition but holds no data along that dimension.

Partition dimension ``d`` splits tensor dimension ``d``; a tensor with more dimensions
than the partition is not allowed (pad the partition shape with ones instead).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["block_extent", "block_start", "block_range", "local_shape", "local_start", "local_slices", "owner_of"]


def block_extent(n: int, p: int, i: int) -> int:
    """Extent of block ``i`` when ``n`` elements are split over ``p`` workers."""
    _check_split(n, p, i)
    return n // p + (1 if i < n % p else 0)


def block_start(n: int, p: int, i: int) -> int:
    """Global index of the first element of block ``i`` (equal to ``n`` for empty tail blocks)."""
    _check_split(n, p, i)
    q, r = divmod(n, p)
    return i * q + min(i, r)


def block_range(n: int, p: int, i: int) -> tuple[int, int]:
    """Half-open global range ``[start, stop)`` of block ``i``."""
    start = block_start(n, p, i)
    return start, start + block_extent(n, p, i)


def owner_of(n: int, p: int, g: int) -> int:
    """Index of the block that owns global element ``g`` (``0 <= g < n``)."""
    if not 0 <= g < n:
        raise IndexError(f"owner_of: element {g} is outside the extent [0, {n})")
    q, r = divmod(n, p)
    big = r * (q + 1)
    if g < big:
        return g // (q + 1)
    return r + (g - big) // q


def local_shape(global_shape: Sequence[int], partition_shape: Sequence[int], index: Sequence[int]) -> tuple[int, ...]:
    """Shape of the block at Cartesian ``index``."""
    _check_dims(global_shape, partition_shape, index)
    return tuple(block_extent(n, p, i) for n, p, i in zip(global_shape, partition_shape, index, strict=True))


def local_start(global_shape: Sequence[int], partition_shape: Sequence[int], index: Sequence[int]) -> tuple[int, ...]:
    """Global coordinates of the first element of the block at Cartesian ``index``."""
    _check_dims(global_shape, partition_shape, index)
    return tuple(block_start(n, p, i) for n, p, i in zip(global_shape, partition_shape, index, strict=True))


def local_slices(global_shape: Sequence[int], partition_shape: Sequence[int],
                 index: Sequence[int]) -> tuple[slice, ...]:
    """Slices that cut the block at ``index`` out of the global tensor."""
    _check_dims(global_shape, partition_shape, index)
    return tuple(slice(*block_range(n, p, i)) for n, p, i in zip(global_shape, partition_shape, index, strict=True))


def _check_split(n: int, p: int, i: int) -> None:
    if n < 0:
        raise ValueError(f"balanced decomposition: extent must be >= 0, got {n}")
    if p < 1:
        raise ValueError(f"balanced decomposition: number of workers must be >= 1, got {p}")
    if not 0 <= i < p:
        raise IndexError(f"balanced decomposition: block index {i} is outside [0, {p})")


def _check_dims(global_shape, partition_shape, index) -> None:
    if not len(global_shape) == len(partition_shape) == len(index):
        raise ValueError(
            "balanced decomposition: tensor, partition and index must have the same number of dimensions, "
            f"got tensor {tuple(global_shape)}, partition {tuple(partition_shape)}, index {tuple(index)}"
        )
