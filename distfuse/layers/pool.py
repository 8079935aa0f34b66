"""Distributed pooling: torch's ``MaxPoolNd`` and ``AvgPoolNd`` over spatially partitioned inputs.

Shapes, the window staging and the one forward are those of :mod:`distfuse.layers._pool_common`.

Max pooling, per worker::

    staged      [B, C, *L]    the window, positions outside the input = -inf
    y, local    = max_poolNd(staged, kernel, stride, padding=0, dilation, return_indices=True)
    indices     = global flat spatial index of each maximum (torch's ``return_indices`` on the
                  gathered tensor: ``sum_d g_d * prod(n_{d+1:})``), on this worker's output block
    adjoint     dstaged = scatter-add of dy at the maxima;  dx = stage*(dstaged)

Why -inf and not torch's own padding: a pooling call on a staged block cannot know where
the global boundary is, and ``-inf`` is what torch's kernels start from, so a window's
maximum, NaN propagation and the first-maximum tie rule all come out as torch's.  One case
differs: in a window whose every input is ``-inf`` the local kernel points at the first
staged position (maybe padding), torch at the first tap inside the input
(:func:`~distfuse.geometry.pool_geometry.first_taps`).  Workers whose window touches the
padding replace exactly the outputs equal to ``-inf`` by a gather at torch's tap, so the
index and the gradient go where torch sends them.

Average pooling, per worker::

    staged   [B, C, *L]      the window, positions outside the input = 0
    sums     = avg_poolNd(staged, kernel, stride, padding=0, divisor_override=1)
    y        = sums / divisor             divisor: torch's, per output (below)
    adjoint  dsums = dy / divisor;  dstaged = avg_pool adjoint (spread);  dx = stage*(dstaged)

torch divides each window's sum by ``divisor_override``, or by the window's size counted
with padding (``count_include_pad``; a ceil-mode window is clipped at the padded edge) or
without it.  A block cannot tell which of its windows touch the global boundary, so the
divisor comes from the global geometry (:func:`~distfuse.geometry.pool_geometry.avg_divisors`).
Where every window of the block has the full ``prod(kernel)`` divisor, or the divisor is
overridden, the local ``avg_pool`` divides by it itself: torch's arithmetic on the gathered tensor.

16-bit inputs on CPU are pooled in fp32 and rounded once (torch's CPU ``avg_pool3d``
has no fp16/bf16 kernel, and its 2-D one sums in fp32 anyway).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.pool_geometry import avg_divisors, first_taps
from distfuse.layers._conv_common import ZeroBlock, compute_dtype, spatial_classes
from distfuse.layers._pool_common import DistributedPoolBase, WindowRecord, window_ranges
from distfuse.partition import zero_volume_tensor

__all__ = ["DistributedMaxPoolBase", "DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d",
           "DistributedAvgPoolBase", "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d"]

MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _ravel(coords: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    flat = coords[0]
    for c, e in zip(coords[1:], shape[1:], strict=True):
        flat = flat * e + c
    return flat


class DistributedMaxPoolBase(DistributedPoolBase):
    """Max pooling over an input split along any axes of ``P_x [P_b, P_c, P_1, ..., P_nd]`` (see the module
    docstring); the other arguments as ``torch.nn.MaxPoolNd``.  ``forward(x)`` returns this worker's output block,
    and with ``return_indices`` also the global indices of the maxima (int64, the same block).
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
        y = ZeroBlock.apply(staged, None, out_shape)
        return (y, torch.empty(out_shape, dtype=torch.int64, device=staged.device)) if self.return_indices else y

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape, dtype, device):
        """``(window origin per axis, window extents, first taps or None)``: where the staged window sits in the
        global input, and, where it reaches into the padding, :meth:`_first_taps`."""
        ranges = window_ranges(plan, index)
        window = plan.staged_shape(index)
        touches = any(a < 0 or b > ax.n for (a, b), ax in zip(ranges, plan.axes, strict=True))
        first = self._first_taps(plan, index, window, device) if touches else None
        return tuple(a for a, _ in ranges), window, first

    def _block(self, x, staged: torch.Tensor, win: WindowRecord, info, out_shape: tuple[int, ...]):
        o = self.opts
        pool = MAX_POOL[o.nd]
        kw = dict(kernel_size=o.kernel_size, stride=o.stride, padding=0, dilation=o.dilation)
        origin, window, first = win.block
        if self.return_indices:
            y, local = pool(staged, return_indices=True, **kw)
        else:
            y, local = pool(staged, **kw), None
        if first is not None:
            # Windows of -inf only (module docstring): skipped in eager CPU calls when there are none (a free check);
            # on CUDA, in captures and in compiled graphs it always runs (three output-sized ops, no host read).
            minus_inf = y == -math.inf
            if staged.device.type != "cpu" or not self.session.may_read_host or bool(minus_inf.any()):
                flat_first = first.expand(out_shape).reshape(out_shape[0], out_shape[1], -1)
                at_first = staged.flatten(2).gather(2, flat_first).view(out_shape)
                y = torch.where(minus_inf, at_first, y)  # the gradient goes to the first tap, as torch's does
                if local is not None:
                    local = torch.where(minus_inf, first, local)
        if local is None:
            return y
        coords = [c + a for c, a in zip(torch.unravel_index(local, window), origin, strict=True)]
        return y, _ravel(coords, tuple(info.global_shape[2:]))

    def _first_taps(self, plan: HaloPlan, index: tuple[int, ...], window: tuple[int, ...],
                    device: torch.device) -> torch.Tensor:
        """``[*m]`` int64: the window-local flat index of torch's first in-input tap of each output."""
        o = self.opts
        coords = []
        for d, (ax, i) in enumerate(zip(plan.axes, index, strict=True)):
            o0, o1 = ax.output_range(i)
            taps = first_taps(ax.n, o.kernel_size[d], o.stride[d], o.dilation[d], o.padding[d], o0, o1)
            a = ax.needed_range(i)[0]
            coords.append(torch.tensor([t - a for t in taps], dtype=torch.int64, device=device)
                          .view([-1] + [1] * (o.nd - 1 - d)))  # broadcasts along axis d
        return _ravel(coords, window)


DistributedMaxPool1d, DistributedMaxPool2d, DistributedMaxPool3d = spatial_classes(
    DistributedMaxPoolBase, "DistributedMaxPool", "Distributed ``MaxPool{nd}d``: P_x ``[P_b, P_c, {s}]``.")


# ---------------------------------------------------------------- average pooling


def _avg_pool(x: torch.Tensor, nd: int, kernel, stride, divisor_override):
    """``avg_poolNd(x, kernel, stride, padding=0)``; 1-D through the 2-D kernel (``avg_pool1d`` has no override)."""
    if nd == 1:
        y = F.avg_pool2d(x.unsqueeze(-2), (1, kernel[0]), (1, stride[0]), 0, divisor_override=divisor_override)
        return y.squeeze(-2)
    pool = F.avg_pool2d if nd == 2 else F.avg_pool3d
    return pool(x, kernel, stride, 0, divisor_override=divisor_override)


class DistributedAvgPoolBase(DistributedPoolBase):
    """Average pooling over an input split along any axes of ``P_x [P_b, P_c, P_1, ..., P_nd]`` (see the module
    docstring); the other arguments as ``torch.nn.AvgPoolNd`` (``AvgPool1d`` has no ``divisor_override``)."""

    fill = 0.0

    def __init__(self, P_x, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, static_shapes: bool = False):
        super().__init__(P_x, kernel_size, stride, padding, 1, ceil_mode, static_shapes)
        if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
            raise UnsupportedError(f"{where(type(self).__name__)}: divisor_override must be a non-zero int or None "
                                   f"(as torch requires), got {divisor_override!r}")
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = divisor_override

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape, dtype, device):
        """The float64 divisor of every output of this block, or None where ``avg_pool`` divides rightly itself
        (an overridden divisor, or every window's divisor the full ``prod(kernel)``)."""
        o = self.opts
        if self.divisor_override is not None:
            return None
        factors = [avg_divisors(ax.n, k, s, p, self.count_include_pad, *ax.output_range(i))
                   for ax, i, k, s, p in zip(plan.axes, index, o.kernel_size, o.stride, o.padding, strict=True)]
        if all(all(f == k for f in fs) for fs, k in zip(factors, o.kernel_size, strict=True)):
            return None
        divisor = torch.ones((), dtype=torch.float64)
        for d, fs in enumerate(factors):
            divisor = divisor * torch.tensor(fs, dtype=torch.float64).view([-1] + [1] * (o.nd - 1 - d))
        return divisor.to(device)

    def _block(self, x, staged: torch.Tensor, win: WindowRecord, info, out_shape: tuple[int, ...]):
        o = self.opts
        x = staged.to(compute_dtype(staged.dtype)) if staged.device.type == "cpu" else staged  # no 16-bit CPU kernel
        if win.block is None:  # avg_pool divides rightly itself (see _block_constants)
            return _avg_pool(x, o.nd, o.kernel_size, o.stride, self.divisor_override).to(staged.dtype)
        sums = _avg_pool(x, o.nd, o.kernel_size, o.stride, 1)
        return (sums / win.block.to(dtype=x.dtype)).to(staged.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, count_include_pad={self.count_include_pad}, "
                f"divisor_override={self.divisor_override}")


class DistributedAvgPool1d(DistributedAvgPoolBase):
    """Distributed ``AvgPool1d``: P_x ``[P_b, P_c, P_w]`` (no ``divisor_override``, as torch)."""

    nd = 1

    def __init__(self, P_x, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, static_shapes: bool = False):
        super().__init__(P_x, kernel_size, stride, padding, ceil_mode, count_include_pad, None, static_shapes)


DistributedAvgPool2d, DistributedAvgPool3d = spatial_classes(
    DistributedAvgPoolBase, "DistributedAvgPool", "Distributed ``AvgPool{nd}d``: P_x ``[P_b, P_c, {s}]``.", nds=(2, 3))
