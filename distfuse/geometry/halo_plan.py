"""Exact halo geometry of a spatially partitioned convolution (pure Python, no communication).

For one spatial axis with global input extent ``n`` split over ``p`` workers, a
convolution with kernel ``k``, stride ``s``, dilation ``d`` and padding ``(lo, hi)``
has the global output extent ``m = (n + lo + hi - d*(k-1) - 1) // s + 1``.  The output
is decomposed by the balanced decomposition, so worker ``i`` owns outputs
``[o0, o1)`` and needs exactly the input range

    a = o0*s - lo,   b = (o1-1)*s + d*(k-1) + 1 - lo      (global, unpadded coordinates)

which may start before or end after the worker's own block (a halo from one or more
neighbours, when the halo is wider than a neighbour's block), fall short of it (the
block is trimmed: with stride, some local inputs are never read), or leave the
domain ``[0, n)`` (boundary padding).  DistDL's ranges ignore stride and dilation and
assume the halo comes from the adjacent neighbour only; these do not.

Every needed global index ``g`` is mapped to its source by the padding mode:

=========  ==========================================  ==========================
mode       ``g < 0``                                   ``g >= n``
=========  ==========================================  ==========================
zeros      0                                           0
reflect    ``-g`` (edge not repeated; needs pad < n)   ``2(n-1) - g``
replicate  ``0``                                       ``n-1``
circular   ``g mod n`` (wraps across the whole domain, from the last worker)
=========  ==========================================  ==========================

and the sources are run-length encoded into :class:`Segment` s: a run of staged
positions that reads one source block with a constant step (+1 copy, -1 reversed by
reflect, 0 one element repeated by replicate) or is zero-filled.  The N-D plan is the
Cartesian product of the per-axis segments: one :class:`Piece` per combination, which
is one message when its source is another worker.  All axes, corners included, are
exchanged in a single round.

The same plan drives the unfused torch staging (``primitives/halo_exchange.py``) and
the fused Triton kernels (``kernels/halo.py``), so both agree by construction.
:func:`read_box` and :func:`adjoint_box` apply a piece's per-axis steps to a tensor box
(flip, expand, sum); they only call tensor methods, so this module imports no torch.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distfuse.errors import UnsupportedError
from distfuse.geometry.decomposition import block_range, owner_of

if TYPE_CHECKING:
    import torch

__all__ = ["PADDING_MODES", "AxisGeometry", "Segment", "Piece", "Assembly", "HaloPlan", "resolve_padding",
           "conv_output_extent", "read_box", "adjoint_box"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def conv_output_extent(n: int, kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int) -> int:
    """Output extent of a convolution along one axis (0 when the padded input is shorter than the kernel)."""
    span = n + pad_lo + pad_hi - dilation * (kernel - 1) - 1
    return span // stride + 1 if span >= 0 else 0


def resolve_padding(padding, kernel_size: Sequence[int], dilation: Sequence[int],
                    stride: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per-axis ``(lo, hi)`` padding from an int, a tuple of ints or pairs, ``'same'`` or ``'valid'``.

    ``'same'`` follows torch: total ``d*(k-1)``, ``lo = total // 2`` (so an even kernel
    pads more on the high side), and only for stride 1.
    """
    nd = len(kernel_size)
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * nd
        if padding == "same":
            if any(s != 1 for s in stride):
                raise UnsupportedError(f"padding='same' needs stride 1 (as in torch), got stride {tuple(stride)}")
            totals = [d * (k - 1) for k, d in zip(kernel_size, dilation, strict=True)]
            return tuple((total // 2, total - total // 2) for total in totals)
        raise UnsupportedError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
    if isinstance(padding, int):
        if padding < 0:
            raise UnsupportedError(f"negative padding {padding} is not supported")
        return ((padding, padding),) * nd
    padding = tuple(padding)
    if len(padding) != nd:
        raise UnsupportedError(f"padding {padding} has {len(padding)} entries, expected {nd} (one per spatial axis)")
    out = []
    for p in padding:
        pair = (p, p) if isinstance(p, int) else tuple(p)
        if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
            raise UnsupportedError(f"padding {padding}: each entry must be an int or an (lo, hi) pair of ints, "
                                   f"got {p!r}")
        lo, hi = pair
        if lo < 0 or hi < 0:
            raise UnsupportedError(f"negative padding {padding} is not supported")
        out.append((int(lo), int(hi)))
    return tuple(out)


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` staged positions starting at ``dst`` along one axis.

    ``src`` is the source block index along the axis (None: zero fill).  The source
    box is ``[lo, lo + extent)`` in the source block's local coordinates; staged
    position ``dst + t`` reads ``lo + t`` (step +1), ``lo + extent - 1 - t`` (step -1,
    reflect) or ``lo`` (step 0, replicate; extent 1).
    """

    dst: int
    length: int
    src: int | None
    lo: int
    extent: int
    step: int


@dataclass(frozen=True)
class AxisGeometry:
    """Convolution geometry along one spatial axis, split over ``p`` workers."""

    n: int
    p: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    mode: str = "zeros"

    def __post_init__(self):
        if self.mode not in PADDING_MODES:
            raise UnsupportedError(f"padding_mode must be one of {PADDING_MODES}, got {self.mode!r}")
        if min(self.kernel, self.stride, self.dilation, self.p) < 1 or self.n < 0:
            raise UnsupportedError(f"invalid convolution geometry {self}")
        if self.mode == "reflect" and max(self.pad_lo, self.pad_hi) >= max(self.n, 1):
            raise UnsupportedError(f"reflect padding {max(self.pad_lo, self.pad_hi)} must be smaller than the global "
                                   f"input extent {self.n} (as in torch)")
        if self.mode in ("replicate", "circular") and self.n == 0 and (self.pad_lo or self.pad_hi):
            raise UnsupportedError(f"{self.mode} padding of an empty input is undefined")

    @property
    def m(self) -> int:
        return conv_output_extent(self.n, self.kernel, self.stride, self.dilation, self.pad_lo, self.pad_hi)

    def input_range(self, i: int) -> tuple[int, int]:
        return block_range(self.n, self.p, i)

    def output_range(self, i: int) -> tuple[int, int]:
        return block_range(self.m, self.p, i)

    def needed_range(self, i: int) -> tuple[int, int]:
        """Global input range ``[a, b)`` that worker ``i``'s outputs read (empty when it has no outputs)."""
        o0, o1 = self.output_range(i)
        if o1 == o0:
            return 0, 0
        a = o0 * self.stride - self.pad_lo
        b = (o1 - 1) * self.stride + self.dilation * (self.kernel - 1) + 1 - self.pad_lo
        return a, b

    def _source(self, g: int) -> int | None:
        n = self.n
        if 0 <= g < n:
            return g
        if self.mode == "zeros":
            return None
        if self.mode == "circular":
            return g % n
        if self.mode == "replicate":
            return 0 if g < 0 else n - 1
        return -g if g < 0 else 2 * (n - 1) - g  # reflect (pad < n checked above)

    @functools.cache  # noqa: B019 - geometries are few and immutable; the cache lives as long as they do
    def segments(self, i: int) -> tuple[Segment, ...]:
        """Run-length encoded sources of worker ``i``'s staged positions, in staged order."""
        a, b = self.needed_range(i)
        runs: list[list] = []  # [dst, length, src_block, first_global, step]
        for t, g in enumerate(range(a, b)):
            s = self._source(g)
            blk = None if s is None else owner_of(self.n, self.p, s)
            if runs and runs[-1][2] == blk:  # the same source block (or zero fill): extend the run if it steps on
                r = runs[-1]
                if blk is None:
                    r[1] += 1
                    continue
                step = s - (r[3] + (r[1] - 1) * r[4])
                if r[1] == 1 and step in (-1, 0, 1):
                    r[4] = step
                if step == r[4]:
                    r[1] += 1
                    continue
            runs.append([t, 1, blk, s, 1])
        out = []
        for dst, length, blk, first, step in runs:
            if blk is None:
                out.append(Segment(dst, length, None, 0, 0, 0))
                continue
            # the source box starts at the run's first element, a reversed run's box ends there; a repeat is 1 wide
            lo = first - block_range(self.n, self.p, blk)[0] - (length - 1 if step == -1 else 0)
            out.append(Segment(dst, length, blk, lo, length if step else 1, step))
        return tuple(out)


@dataclass(frozen=True)
class Piece:
    """One box of a worker's staged input and where it comes from.

    ``src`` is the source worker's spatial block index (None: zero fill);
    ``dst_lo``/``shape`` give the box in the staged tensor; ``src_lo``/``src_shape``
    the box read from the source block (local coordinates); ``steps`` the per-axis
    transform (+1 copy, -1 reversed, 0 one element repeated).
    """

    src: tuple[int, ...] | None
    dst_lo: tuple[int, ...]
    shape: tuple[int, ...]
    src_lo: tuple[int, ...]
    src_shape: tuple[int, ...]
    steps: tuple[int, ...]

    def dst_slices(self) -> tuple[slice, ...]:
        return self.dst_index[1:]

    def src_slices(self) -> tuple[slice, ...]:
        return self.src_index[1:]

    # The indexings and transforms a staging or its adjoint applies to every call's tensors, built once per piece
    # (the plan and its pieces live as long as the layer): the unfused path's host time is Python per piece.
    @functools.cached_property
    def dst_index(self) -> tuple:
        """``(..., *dst_slices)``: the box in a staged tensor with any leading (batch, channel) dims."""
        return (Ellipsis, *(slice(lo, lo + e) for lo, e in zip(self.dst_lo, self.shape, strict=True)))

    @functools.cached_property
    def src_index(self) -> tuple:
        """``(..., *src_slices)``: the box in its source block."""
        return (Ellipsis, *(slice(lo, lo + e) for lo, e in zip(self.src_lo, self.src_shape, strict=True)))

    @functools.cached_property
    def flipped(self) -> tuple[int, ...]:
        """The spatial axes (from the last: -1 the innermost) a reflect run reverses."""
        return tuple(a - len(self.steps) for a, s in enumerate(self.steps) if s == -1)

    @functools.cached_property
    def repeated(self) -> tuple[int, ...]:
        """The spatial axes (from the last) on which one element is repeated (replicate)."""
        return tuple(a - len(self.steps) for a, s in enumerate(self.steps) if s == 0)


@dataclass(frozen=True)
class Assembly:
    """How the unfused staging builds a worker's staged input from its pieces, and takes its gradient apart.

    The pieces are the Cartesian product of the axes' segments, row-major (:meth:`HaloPlan.pieces`), so the staged
    tensor is a nest of concatenations: the pieces of each run along the innermost axis, then those results along
    the next axis out, and so on; its gradient splits back along the same runs, into views.

    ``lengths``: per spatial axis, its segments' lengths (the run sizes of the concatenations and splits).
    ``cover``: the position in the pieces of the one that is the whole block unchanged (the interior copy), whose
    gradient is the first term of the block's; None where the block is trimmed (stride) or only read through
    wraps.
    ``zero_fill``: whether any piece is zero fill (a boundary worker's, padding with zeros).
    """

    lengths: tuple[tuple[int, ...], ...]
    cover: int | None
    zero_fill: bool


def read_box(src: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The staged box of ``piece`` built from its source box ``src`` ([*lead, *src_shape]): flip and expand."""
    out = src.flip(piece.flipped) if piece.flipped else src
    if piece.repeated:
        out = out.expand(*src.shape[:src.dim() - len(piece.steps)], *piece.shape)
    return out


def adjoint_box(grad: torch.Tensor, piece: Piece) -> torch.Tensor:
    """Adjoint of :func:`read_box`: the gradient of the source box from the staged box's gradient."""
    out = grad.sum(dim=piece.repeated, keepdim=True) if piece.repeated else grad
    return out.flip(piece.flipped) if piece.flipped else out


class HaloPlan:
    """The halo exchange of every worker of a spatial grid, for one global input shape.

    Args:
        axes: one :class:`AxisGeometry` per spatial axis (same order as the tensor).

    The plan is a pure function of the geometry, so every worker computes the same
    plan and both ends of each message agree on its size and order without talking.
    """

    def __init__(self, axes: Sequence[AxisGeometry]):
        self.axes = tuple(axes)
        self.grid = tuple(ax.p for ax in self.axes)

    @classmethod
    def for_conv(cls, global_spatial: Sequence[int], grid: Sequence[int], kernel_size: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int], padding: Sequence[tuple[int, int]],
                 mode: str) -> HaloPlan:
        return cls([AxisGeometry(n, p, k, s, d, lo, hi, mode)
                    for n, p, k, s, d, (lo, hi) in zip(global_spatial, grid, kernel_size, stride, dilation, padding,
                                                        strict=True)])

    def blocks(self):
        return itertools.product(*(range(p) for p in self.grid))

    def input_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        return tuple(ax.input_range(i)[1] - ax.input_range(i)[0] for ax, i in zip(self.axes, index, strict=True))

    def output_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        return tuple(ax.output_range(i)[1] - ax.output_range(i)[0] for ax, i in zip(self.axes, index, strict=True))

    def global_output_shape(self) -> tuple[int, ...]:
        return tuple(ax.m for ax in self.axes)

    def staged_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        return self._staged_shape(tuple(index))

    @functools.cache  # noqa: B019 - asked at every staging; the ranges are Python arithmetic per axis
    def _staged_shape(self, index: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(ax.needed_range(i)[1] - ax.needed_range(i)[0] for ax, i in zip(self.axes, index, strict=True))

    @functools.cache  # noqa: B019
    def assembly(self, index: tuple[int, ...]) -> Assembly:
        """How the unfused staging concatenates worker ``index``'s pieces (see :class:`Assembly`)."""
        per_axis = [ax.segments(i) for ax, i in zip(self.axes, index, strict=True)]
        lengths = tuple(tuple(s.length for s in segs) for segs in per_axis)
        block = self.input_shape(index)
        cover = next((k for k, pc in enumerate(self.pieces(index))
                      if pc.src == index and all(s == 1 for s in pc.steps) and not any(pc.src_lo)
                      and pc.src_shape == block), None)
        return Assembly(lengths, cover, any(pc.src is None for pc in self.pieces(index)))

    @functools.cache  # noqa: B019 - one plan per geometry, cached by the primitive that owns it
    def pieces(self, index: tuple[int, ...]) -> tuple[Piece, ...]:
        """Every box of worker ``index``'s staged input, in canonical order (row-major over segments)."""
        per_axis = [ax.segments(i) for ax, i in zip(self.axes, index, strict=True)]
        out = []
        for combo in itertools.product(*per_axis):  # each Segment field's values over the axes
            # the fields by name: ``dataclasses.astuple`` deep-copies each one (a 3-D 2x2x2 plan took 5x longer)
            dst, length, src, lo, extent, step = zip(*((s.dst, s.length, s.src, s.lo, s.extent, s.step)
                                                       for s in combo), strict=True)
            out.append(Piece(None if None in src else src, dst, length, lo, extent, step))
        return tuple(out)

    def recvs(self, index: tuple[int, ...]) -> tuple[Piece, ...]:
        """Pieces worker ``index`` receives from other workers, in message order."""
        return tuple(pc for pc in self.pieces(index) if pc.src is not None and pc.src != index)

    @functools.cache  # noqa: B019
    def sends(self, index: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], Piece], ...]:
        """``(receiver, piece)`` for every piece other workers read from worker ``index``, in message order.

        Ordered by receiver (row-major), then by the receiver's piece order, which is
        the order the receiver posts its receives from this worker in.
        """
        return tuple((recv, pc) for recv in self.blocks() if recv != index
                     for pc in self.pieces(recv) if pc.src == index)

    def local_pieces(self, index: tuple[int, ...]) -> tuple[Piece, ...]:
        """Pieces worker ``index`` reads from its own block (interior, and reflect/replicate/circular self-wraps)."""
        return tuple(pc for pc in self.pieces(index) if pc.src == index)
