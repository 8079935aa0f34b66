"""Moving a tensor between two layouts of boxes: the data movement under the DTensor bridge.

distfuse splits an extent by the balanced decomposition (10 over 4: 3, 3, 2, 2); DTensor's
``Shard`` follows ``torch.chunk`` (3, 3, 3, 1; 5 over 4: 2, 2, 1, 0), nests when several mesh
dimensions shard one tensor dimension, and ``Replicate`` puts one box on several ranks.  A
:class:`BoxLayout` lists, for one global shape, which world rank holds which box and which
holder of a replicated box is the *primary* (the one that sends it).  :func:`move` takes this
rank's box of one layout to its box of another in one batched point-to-point round
(:func:`~distfuse.primitives._common.exchange`): every primary source holder sends its
intersection with every destination box; a message to oneself is a local copy.  A rank holds
at most one box per layout, so there is at most one message per ordered pair of ranks, and
no tags are needed: both ends enumerate the messages in holder order.

Shapes (``G`` the global shape; ``A(r)``, ``B(r)`` the boxes of rank ``r``)::

    x   the A(r) box of a global tensor     on holders of A; anything zero-volume elsewhere
    y   the B(r) box of the same tensor     on holders of B; ``[0]`` elsewhere

Adjoint: the move back from B to A (:class:`MoveFunction`), where B's primaries send and
*every* holder of A receives: each replica of a replicated A box gets the whole gradient of
its box, which is DTensor's meaning of a gradient with a ``Replicate`` placement.  Every
holder of either layout must call backward when one does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, where
from distfuse.geometry.decomposition import block_range
from distfuse.layers._params import is_primary, layout_box
from distfuse.partition import CartesianPartition
from distfuse.primitives._common import exchange, exchange_into

__all__ = ["BoxLayout", "balanced_layout", "param_layout", "move", "MoveFunction"]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BoxLayout:
    """Who holds which box of a tensor of ``global_shape``.

    ``holders``: ``(world rank, box, primary)`` with half-open ``(lo, hi)`` per dimension.
    The primaries' boxes tile the global tensor exactly; other holders are replicas.
    """

    global_shape: tuple[int, ...]
    holders: tuple[tuple[int, Box, bool], ...]

    def box_of(self, rank: int) -> Box | None:
        return next((box for r, box, _ in self.holders if r == rank), None)

    def primary(self, rank: int) -> bool:
        return any(r == rank and p for r, _, p in self.holders)


def balanced_layout(P: CartesianPartition, global_shape: Sequence[int]) -> BoxLayout:
    """distfuse's layout: worker ``i`` of ``P`` holds block ``i`` of the balanced decomposition."""
    G = tuple(int(n) for n in global_shape)
    holders = ((world, tuple(block_range(n, p, i) for n, p, i in zip(G, P.shape, P.index_of(r), strict=True)), True)
               for r, world in enumerate(P.ranks))
    return BoxLayout(G, tuple(holders))


def param_layout(lay) -> BoxLayout:
    """The boxes of a :class:`~distfuse.layers._params.ParamLayout`: balanced blocks, or copies with ``split_dims``.

    With ``split_dims`` every worker of ``lay.P`` holds a box and the copy at index 0
    along the replicating dimensions is the primary.
    """
    holders = tuple((world, layout_box(lay, lay.P.index_of(r)), is_primary(lay, lay.P.index_of(r)))
                    for r, world in enumerate(lay.P.ranks))
    return BoxLayout(tuple(int(n) for n in lay.global_shape), holders)


def _extent(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(al, bl), min(ah, bh)) for (al, ah), (bl, bh) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _relative(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _run(x: torch.Tensor, src: BoxLayout, dst: BoxLayout, dtype: torch.dtype, device: torch.device,
         op: str) -> torch.Tensor:
    me = dist.get_rank()
    mine_src, mine_dst = src.box_of(me), dst.box_of(me)
    sends = []
    if mine_src is not None and src.primary(me):
        for rank, box, _ in dst.holders:
            inter = _intersect(mine_src, box)
            if inter is not None:
                sends.append((rank, x[_relative(inter, mine_src)].contiguous()))
    if mine_dst is None:
        exchange(sends, [], op=op)
        return torch.empty((0,), dtype=dtype, device=device)
    out = torch.empty(_extent(mine_dst), dtype=dtype, device=device)  # the primaries' boxes tile it exactly
    inters = [(rank, _intersect(box, mine_dst) if primary else None) for rank, box, primary in src.holders]
    exchange_into(sends, [(rank, out[_relative(inter, mine_dst)]) for rank, inter in inters if inter is not None],
                  op=op)
    return out


class MoveFunction(torch.autograd.Function):
    """Autograd Function of :func:`move`; its backward is the move back (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, src: BoxLayout, dst: BoxLayout, dtype: torch.dtype, device: torch.device, op: str):
        ctx.meta = (src, dst, tuple(x.shape), x.dtype, x.device, op)
        return _run(x, src, dst, dtype, device, op)

    @staticmethod
    def backward(ctx, grad):
        src, dst, x_shape, x_dtype, x_device, op = ctx.meta
        me = dist.get_rank()
        every = BoxLayout(src.global_shape, tuple((r, b, True) for r, b, _ in src.holders))  # all holders receive
        back = MoveFunction.apply(grad.contiguous(), dst, every, x_dtype, x_device, f"{op} (adjoint)")
        if src.box_of(me) is None:  # this rank held no source box: its input's gradient is zero
            back = torch.zeros(x_shape, dtype=x_dtype, device=x_device)
        return back, None, None, None, None, None


def move(x: torch.Tensor, src: BoxLayout, dst: BoxLayout, dtype: torch.dtype | None = None,
         device: torch.device | None = None, op: str = "move") -> torch.Tensor:
    """This rank's box of ``dst`` filled from the holders of ``src`` (one point-to-point round).

    ``x`` is this rank's ``src`` box (any tensor where it holds none).  ``dtype`` and
    ``device`` of the output default to ``x``'s; they must be the data's, since gloo
    receives into a buffer of another dtype without complaint.  Both layouts must
    describe the same global shape.  Collective over the holders of both layouts.
    """
    if src.global_shape != dst.global_shape:
        raise ShapeError(f"{where(op)}: layouts of different global shapes {src.global_shape} and {dst.global_shape}")
    me = dist.get_rank()
    box = src.box_of(me)
    if box is not None and tuple(x.shape) != _extent(box):
        raise ShapeError(f"{where(op)}: this rank's block has shape {tuple(x.shape)}; its box {box} of the global "
                         f"shape {src.global_shape} needs {_extent(box)}")
    dtype = dtype if dtype is not None else x.dtype
    device = device if device is not None else x.device
    if math.prod(src.global_shape) == 0:  # nothing to move; the shapes alone are the answer
        mine = dst.box_of(me)
        out = torch.empty(_extent(mine) if mine is not None else (0,), dtype=dtype, device=device)
        return out.requires_grad_(x.requires_grad and torch.is_grad_enabled())
    return MoveFunction.apply(x, src, dst, dtype, device, op)
