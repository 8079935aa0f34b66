"""Distributed max pooling: ``DistributedMaxPool1d/2d/3d``, torch's ``MaxPoolNd`` over a partitioned input.

Shapes and the exchange are those of :mod:`distfuse.layers._pool_common`; per worker::

    staged      [B, C, *L]    the window, positions outside the input = -inf
    y, local    = max_poolNd(staged, kernel, stride, padding=0, dilation, return_indices=True)
    indices     = global flat spatial index of each maximum (torch's ``return_indices`` on the
                  gathered tensor: ``sum_d g_d * prod(n_{d+1:})``), on this worker's output block
    adjoint     dstaged = scatter-add of dy at the maxima;  dx = stage*(dstaged)

Why -inf and not torch's own padding: the window is already staged (halos and padding
in one tensor), and a pooling call on a block cannot know where the global boundary is.
``-inf`` is what torch's kernels start from, so a window's maximum, NaN propagation and
the first-maximum tie rule all come out as torch's.

One case differs: when every input element of a window is ``-inf``, the local kernel
points at the window's first staged position, which may be padding, where torch
points at the window's first tap inside the input
(:func:`~distfuse.geometry.pool_geometry.first_taps`).  Workers whose window touches the
padding replace those outputs (exactly the ones equal to ``-inf``) by a gather at
torch's tap, so the index and the gradient go where torch sends them.  Windows with a
larger element or a NaN are untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.pool_geometry import first_taps
from distfuse.layers._pool_common import DistributedPoolBase, PoolWindow
from distfuse.layers.pool_staging import EmptyBlock, window_ranges
from distfuse.partition import zero_volume_tensor

__all__ = ["DistributedMaxPoolBase", "DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d"]

MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-axis coordinates of flat row-major indices into ``shape``."""
    coords = []
    rem = flat
    for e in reversed(shape):
        coords.append(rem % e)
        rem = rem // e
    return coords[::-1]


def _ravel(coords: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    flat = coords[0]
    for c, e in zip(coords[1:], shape[1:], strict=True):
        flat = flat * e + c
    return flat


class DistributedMaxPoolBase(DistributedPoolBase):
    """Max pooling over an input split along any axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, P_c, P_1, ..., P_nd]``.
        kernel_size, stride, padding, dilation, return_indices, ceil_mode: as
            ``torch.nn.MaxPoolNd`` (``stride`` defaults to ``kernel_size``; ``padding`` at
            most ``kernel_size // 2``).
        static_shapes: accepted for compatibility; changes nothing (every call skips the
            metadata gather while the workers' signatures repeat).

    ``forward(x)`` returns this worker's output block, and with ``return_indices`` also
    the global indices of the maxima (int64, the same block); workers outside P_x get
    zero-volume tensors.
    """

    fill = -math.inf

    def __init__(self, P_x, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, static_shapes: bool = False):
        super().__init__(P_x, kernel_size, stride, padding, dilation, ceil_mode, static_shapes)
        self.return_indices = bool(return_indices)

    def _inactive_output(self, x: torch.Tensor):
        y = x.clone()
        return (y, zero_volume_tensor(dtype=torch.int64, device=x.device)) if self.return_indices else y

    def _empty_output(self, staged: torch.Tensor, out_shape: tuple[int, ...]):
        y = EmptyBlock.apply(staged, out_shape)
        return (y, torch.empty(out_shape, dtype=torch.int64, device=staged.device)) if self.return_indices else y

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape, device: torch.device):
        """``(window origin per axis, window extents, first taps or None)``: where the staged window sits in the
        global input, and, where it reaches into the padding, :meth:`_first_taps`."""
        ranges = window_ranges(plan, index)
        window = plan.staged_shape(index)
        touches = any(a < 0 or b > ax.n for (a, b), ax in zip(ranges, plan.axes, strict=True))
        first = self._first_taps(plan, index, window, device) if touches else None
        return tuple(a for a, _ in ranges), window, first

    def _pool_block(self, staged: torch.Tensor, win: PoolWindow, out_shape: tuple[int, ...], global_shape):
        o = self.opts
        pool = MAX_POOL[o.nd]
        kw = dict(kernel_size=o.kernel_size, stride=o.stride, padding=0, dilation=o.dilation)
        origin, window, first = win.block
        if self.return_indices:
            y, local = pool(staged, return_indices=True, **kw)
        else:
            y, local = pool(staged, **kw), None
        if first is not None:
            # Windows whose inputs are all -inf: torch answers its first in-input tap, the local kernel the
            # window's first staged position (maybe padding).  In eager CPU calls the check is free and the fix is
            # skipped when no such window exists; on CUDA, in captures and in compiled graphs it always runs
            # (three output-sized ops, no host read).
            minus_inf = y == -math.inf
            if staged.device.type != "cpu" or not self.session.may_read_host or bool(minus_inf.any()):
                flat_first = first.expand(out_shape).reshape(out_shape[0], out_shape[1], -1)
                at_first = staged.flatten(2).gather(2, flat_first).view(out_shape)
                y = torch.where(minus_inf, at_first, y)  # the gradient goes to the first tap, as torch's does
                if local is not None:
                    local = torch.where(minus_inf, first, local)
        if local is None:
            return y
        coords = [c + a for c, a in zip(_unravel(local, window), origin, strict=True)]
        return y, _ravel(coords, tuple(global_shape[2:]))

    def _first_taps(self, plan: HaloPlan, index: tuple[int, ...], window: tuple[int, ...],
                    device: torch.device) -> torch.Tensor:
        """``[1, 1, *m]`` int64: the window-local flat index of torch's first in-input tap of each output."""
        o = self.opts
        coords = []
        for d, (ax, i) in enumerate(zip(plan.axes, index, strict=True)):
            o0, o1 = ax.output_range(i)
            taps = first_taps(ax.n, o.kernel_size[d], o.stride[d], o.dilation[d], o.padding[d], o0, o1)
            shape = [1] * (2 + o.nd)
            shape[2 + d] = o1 - o0
            a = ax.needed_range(i)[0]
            coords.append(torch.tensor([t - a for t in taps], dtype=torch.int64, device=device).view(shape))
        return _ravel(coords, window)


class DistributedMaxPool1d(DistributedMaxPoolBase):
    """Distributed ``MaxPool1d``: P_x ``[P_b, P_c, P_w]``."""

    nd = 1


class DistributedMaxPool2d(DistributedMaxPoolBase):
    """Distributed ``MaxPool2d``: P_x ``[P_b, P_c, P_h, P_w]``."""

    nd = 2


class DistributedMaxPool3d(DistributedMaxPoolBase):
    """Distributed ``MaxPool3d``: P_x ``[P_b, P_c, P_d, P_h, P_w]``."""

    nd = 3
