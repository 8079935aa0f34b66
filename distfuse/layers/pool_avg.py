"""Distributed average pooling: ``DistributedAvgPool1d/2d/3d``, torch's ``AvgPoolNd`` over a partitioned input.

Shapes and the exchange are those of :mod:`distfuse.layers._pool_common`; per worker::

    staged   [B, C, *L]      the window, positions outside the input = 0
    sums     = avg_poolNd(staged, kernel, stride, padding=0, divisor_override=1)
    y        = sums / divisor             divisor: torch's, per output (below)
    adjoint  dsums = dy / divisor;  dstaged = avg_pool adjoint (spread);  dx = stage*(dstaged)

torch divides each window's sum by ``divisor_override``, or by the window's size
counted with padding (``count_include_pad``; a ceil-mode window is clipped at the padded
edge) or without it.  A block of a pooled tensor cannot tell which of its windows touch
the global boundary, so the divisor is computed from the global geometry
(:func:`~distfuse.geometry.pool_geometry.avg_divisors`, one factor per axis, the N-D
divisor their product).  Where every window of the block has the full ``prod(kernel)``
divisor, or the divisor is overridden, the local ``avg_pool`` divides by it itself: the
same arithmetic as torch on the gathered tensor.

16-bit inputs on CPU are pooled in fp32 and rounded once (torch's CPU ``avg_pool3d``
has no fp16/bf16 kernel, and its 2-D one sums in fp32 anyway).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.pool_geometry import avg_divisors
from distfuse.layers._pool_common import DistributedPoolBase, PoolWindow, check_16bit_cpu

__all__ = ["DistributedAvgPoolBase", "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d"]


@functools.lru_cache(maxsize=1024)
def _divisor_factors(n: int, kernel: int, stride: int, pad: int, count_include_pad: bool, o0: int,
                     o1: int) -> tuple[int, ...]:
    return tuple(avg_divisors(n, kernel, stride, pad, count_include_pad, o0, o1))


def _avg_pool(x: torch.Tensor, nd: int, kernel, stride, divisor_override):
    """``avg_poolNd(x, kernel, stride, padding=0)``; 1-D through the 2-D kernel (``avg_pool1d`` has no override)."""
    if nd == 1:
        y = F.avg_pool2d(x.unsqueeze(-2), (1, kernel[0]), (1, stride[0]), 0, divisor_override=divisor_override)
        return y.squeeze(-2)
    pool = F.avg_pool2d if nd == 2 else F.avg_pool3d
    return pool(x, kernel, stride, 0, divisor_override=divisor_override)


class DistributedAvgPoolBase(DistributedPoolBase):
    """Average pooling over an input split along any axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, P_c, P_1, ..., P_nd]``.
        kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override:
            as ``torch.nn.AvgPoolNd`` (``AvgPool1d`` has no ``divisor_override``).
        static_shapes: accepted for compatibility; changes nothing (every call skips the
            metadata gather while the workers' signatures repeat).
    """

    fill = 0.0

    def __init__(self, P_x, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, static_shapes: bool = False):
        super().__init__(P_x, kernel_size, stride, padding, 1, ceil_mode, static_shapes)
        if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
            raise UnsupportedError(f"{where(type(self).__name__)}: divisor_override must be a non-zero int or None "
                                   f"(as torch requires), got {divisor_override!r}")
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = divisor_override

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape, device: torch.device):
        """The float64 divisor of every output of this block, or None where ``avg_pool`` divides rightly itself
        (an overridden divisor, or every window's divisor the full ``prod(kernel)``)."""
        o = self.opts
        if self.divisor_override is not None:
            return None
        factors = [_divisor_factors(ax.n, k, s, p, self.count_include_pad, *ax.output_range(i))
                   for ax, i, k, s, p in zip(plan.axes, index, o.kernel_size, o.stride, o.padding, strict=True)]
        if all(all(f == k for f in fs) for fs, k in zip(factors, o.kernel_size, strict=True)):
            return None
        divisor = torch.ones((), dtype=torch.float64)
        for d, fs in enumerate(factors):
            shape = [1] * o.nd
            shape[d] = len(fs)
            divisor = divisor * torch.tensor(fs, dtype=torch.float64).view(shape)
        return divisor.to(device)

    def _pool_block(self, staged: torch.Tensor, win: PoolWindow, out_shape: tuple[int, ...], global_shape):
        o = self.opts
        x = staged.float() if check_16bit_cpu(staged) else staged
        if self.divisor_override is not None:
            return _avg_pool(x, o.nd, o.kernel_size, o.stride, self.divisor_override).to(staged.dtype)
        if win.block is None:
            return _avg_pool(x, o.nd, o.kernel_size, o.stride, None).to(staged.dtype)
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


class DistributedAvgPool2d(DistributedAvgPoolBase):
    """Distributed ``AvgPool2d``: P_x ``[P_b, P_c, P_h, P_w]``."""

    nd = 2


class DistributedAvgPool3d(DistributedAvgPoolBase):
    """Distributed ``AvgPool3d``: P_x ``[P_b, P_c, P_d, P_h, P_w]``."""

    nd = 3
