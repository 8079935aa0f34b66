"""Interpolation geometry of the distributed upsampling: torch's arguments, every output's sources, the plan.

:class:`InterpSpec` normalises and checks ``torch.nn.Upsample``'s arguments per spatial
axis (every rank raises alike).  :func:`interp_geometry` turns a spec, a global spatial
shape and a grid into an :class:`InterpGeometry`: per axis the global source indices
(and weights) of every output, the halo plan whose windows cover them, and, for the
power-of-two upsampling that commutes with shifts, the factors that let a worker run
torch's own kernel on its window.  Everything here is a function of shapes that every
worker evaluates alike (the nearest modes' probe aside, a local torch call); how one
worker applies the result is :mod:`distfuse.layers._upsample_window`.

Source indices (``geometry/interp_geometry.py``): linear modes follow torch's formula in
its opmath precision.  Nearest modes are discontinuous and torch computes them
differently by dimension, dtype and device (2-D nearest on CPU has an identity
shortcut that 1-D and 3-D lack, for example), so the layer asks torch: one call of
``F.interpolate`` per axis on a probe of the same rank, dtype class, device and memory
format as the gathered input, holding ``0..n-1`` along that axis and extent 1 or 2
elsewhere (:func:`nearest_sources`).  Cached per geometry.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.interp_geometry import (
    INTERP_MODES,
    LINEAR_MODES,
    interp_output_extent,
    linear_sources,
    shift_invariant_factor,
    window_axis,
)

__all__ = ["InterpSpec", "InterpGeometry", "nearest_sources", "interp_geometry"]


@dataclass(frozen=True)
class InterpSpec:
    """torch's interpolation arguments, normalised per spatial axis and checked as torch checks them."""

    nd: int
    mode: str
    align_corners: bool
    sizes: tuple[int, ...] | None
    scales: tuple[float, ...] | None
    recompute_scale_factor: bool

    @classmethod
    def make(cls, op: str, nd: int, size, scale_factor, mode: str, align_corners, recompute_scale_factor):
        if mode not in INTERP_MODES:
            raise UnsupportedError(f"{where(op)}: mode must be one of {list(INTERP_MODES)}, got {mode!r} "
                                   "(bicubic and area are not distributed by distfuse)")
        want_nd = INTERP_MODES[mode]
        if want_nd is not None and want_nd != nd:
            raise expect(op, f"spatial axes for mode {mode!r} (P_x has {nd})", want_nd, nd, UnsupportedError)
        if mode not in LINEAR_MODES and align_corners is not None:
            raise UnsupportedError(f"{where(op)}: align_corners can only be set with the linear modes "
                                   f"{list(LINEAR_MODES)} (as in torch), got mode {mode!r}")
        if (size is None) == (scale_factor is None):
            raise UnsupportedError(f"{where(op)}: give exactly one of size and scale_factor, got size={size!r}, "
                                   f"scale_factor={scale_factor!r}")
        if size is not None and recompute_scale_factor:
            raise UnsupportedError(f"{where(op)}: recompute_scale_factor is not meaningful with an explicit size")
        sizes = scales = None
        if size is not None:
            sizes = (size,) * nd if isinstance(size, int) else tuple(size)
            if len(sizes) != nd or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in sizes):
                raise UnsupportedError(f"{where(op)}: size must be an int >= 1 or {nd} such ints, got {size!r}")
        else:
            scales = (scale_factor,) * nd if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
            if len(scales) != nd or not all(isinstance(e, (int, float)) and not isinstance(e, bool) and
                                            math.isfinite(e) for e in scales):
                raise UnsupportedError(f"{where(op)}: scale_factor must be a number or {nd} numbers, got "
                                       f"{scale_factor!r}")
            scales = tuple(float(e) for e in scales)
        return cls(nd, mode, bool(align_corners), sizes, scales, bool(recompute_scale_factor))

    def output_extent(self, d: int, n: int) -> int:
        return interp_output_extent(n, self.sizes[d] if self.sizes else None, None if self.sizes else self.scales[d])

    def kernel_scale(self, d: int) -> float | None:
        """The factor torch's kernel receives for axis ``d`` (None: it works from the sizes)."""
        return None if self.scales is None or self.recompute_scale_factor else self.scales[d]


@functools.lru_cache(maxsize=1024)
def nearest_sources(spec: InterpSpec, spatial: tuple[int, ...], axis: int, channels_one: bool, float64: bool,
                    device: str) -> np.ndarray:
    """torch's source index of every output along ``axis``, asked of torch itself (see the module docstring).

    The probe has the gathered input's rank, ``C = 1`` exactly when the input's does (a
    one-channel input is also channels-last contiguous, and torch may pick its kernel by
    memory format), extent ``min(n, 2)`` on the other axes (mapped to themselves), and
    ``0..n-1`` along ``axis`` in float64 (fp64 inputs) or float32 (the others; torch
    computes their indices in float32), so the values it returns are the indices.
    """
    nd = spec.nd
    n = spatial[axis]
    extents = [n if d == axis else min(spatial[d], 2) for d in range(nd)]
    dtype = torch.float64 if float64 else torch.float32
    ramp = torch.arange(n, dtype=dtype, device=device).view([n if d == axis else 1 for d in range(nd)])
    probe = ramp.expand(1, 1 if channels_one else 2, *extents).contiguous()
    if spec.sizes is not None or spec.recompute_scale_factor:
        size = [spec.output_extent(d, spatial[d]) if d == axis else extents[d] for d in range(nd)]
        out = F.interpolate(probe, size=size, mode=spec.mode)
    else:
        scale = [spec.scales[d] if d == axis else 1.0 for d in range(nd)]
        out = F.interpolate(probe, scale_factor=scale, mode=spec.mode)
    line = out[(0, 0) + tuple(slice(None) if d == axis else 0 for d in range(nd))]
    return line.to(torch.float64).round().to(torch.int64).cpu().numpy()


@dataclass
class _AxisTaps:
    """Global source indices (and weights, linear modes) of every output along one axis."""

    i0: np.ndarray
    i1: np.ndarray | None = None
    l0: np.ndarray | None = None
    l1: np.ndarray | None = None


@dataclass
class InterpGeometry:
    """The plan and the per-axis taps of one interpolation over one grid; block tensors cached per worker.

    ``factors`` is set when every axis is a power-of-two upsampling that commutes with
    shifts (:func:`~distfuse.geometry.interp_geometry.shift_invariant_factor`) and every
    worker's output block fits in the interpolation of its window: then each worker
    calls torch's own kernel on its window and keeps its block
    (:meth:`crop`), instead of applying the taps.
    """

    plan: HaloPlan
    taps: list[_AxisTaps]
    factors: tuple[int, ...] | None = None
    _blocks: dict = field(default_factory=dict)

    def block_taps(self, d: int, i: int, device, dtype) -> tuple:
        """This worker's rows of axis ``d``: local indices into its window (and weights) as tensors."""
        key = (d, i, str(device), dtype)
        if key not in self._blocks:
            ax, t = self.plan.axes[d], self.taps[d]
            o0, o1 = ax.output_range(i)
            a = ax.needed_range(i)[0]
            idx = [torch.as_tensor(v[o0:o1] - a, dtype=torch.int64, device=device) for v in (t.i0, t.i1)
                   if v is not None]
            wts = [torch.as_tensor(w[o0:o1], device=device).to(dtype) for w in (t.l0, t.l1) if w is not None]
            self._blocks[key] = (idx, wts)
        return self._blocks[key]

    def crop(self, d: int, i: int) -> tuple[int, int]:
        """Where worker ``i``'s block of axis ``d`` starts in the interpolation of its window, and its extent."""
        ax = self.plan.axes[d]
        o0, o1 = ax.output_range(i)
        return o0 - self.factors[d] * ax.needed_range(i)[0], o1 - o0


def _fits(plan: HaloPlan, factors: Sequence[int]) -> bool:
    """Every worker's output block lies inside the interpolation of its window (then a crop gives it)."""
    for ax, s in zip(plan.axes, factors, strict=True):
        for i in range(ax.p):
            (o0, o1), (a, b) = ax.output_range(i), ax.needed_range(i)
            if o1 > o0 and not 0 <= o0 - s * a <= s * (b - a) - (o1 - o0):
                return False
    return True


@functools.lru_cache(maxsize=256)
def interp_geometry(spec: InterpSpec, spatial: tuple[int, ...], grid: tuple[int, ...], channels_one: bool,
                    float64: bool, device: str) -> InterpGeometry:
    """Taps and halo plan of ``spec`` for a global spatial shape over a spatial grid (pure but for the probe)."""
    taps, axes, factors = [], [], []
    for d, (n, p) in enumerate(zip(spatial, grid, strict=True)):
        m = spec.output_extent(d, n)
        if spec.mode in LINEAR_MODES:
            i0, i1, l0, l1 = linear_sources(n, m, spec.align_corners, spec.kernel_scale(d), float64)
            t = _AxisTaps(i0, i1, l0, l1)
        else:
            t = _AxisTaps(nearest_sources(spec, spatial, d, channels_one, float64, device))
            if len(t.i0) != m:
                raise AssertionError(f"torch's probe gave {len(t.i0)} outputs on axis {d}, expected {m}")
        taps.append(t)
        axes.append(window_axis(n, p, t.i0, t.i1 if t.i1 is not None else t.i0))
        factors.append(shift_invariant_factor(n, m, spec.mode, spec.align_corners, spec.kernel_scale(d)))
    plan = HaloPlan(axes)
    fast = None not in factors and _fits(plan, factors)
    return InterpGeometry(plan, taps, tuple(factors) if fast else None)
