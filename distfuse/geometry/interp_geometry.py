"""Exact geometry of a spatially partitioned interpolation (upsampling) layer (pure Python + numpy).

Along one axis an interpolation maps a global input extent ``n`` to an output extent
``m`` (``size``, or ``int(n * scale_factor)`` as torch computes it, in double precision).
Output ``o`` reads input ``src(o)`` (nearest modes) or the two inputs ``i0(o)``, ``i1(o)``
with weights ``l0(o)``, ``l1(o)`` (linear modes).  The source indices never decrease
with ``o``, so a worker's output block ``[o0, o1)`` (balanced decomposition of ``m``)
reads one contiguous input window ``[min src, max src + 1)``: a halo that may lie
anywhere, may be much wider or narrower than the worker's own block, and may miss it
entirely (:class:`WindowAxis`, the halo exchange's "needed range", given explicitly).

Linear modes (:func:`linear_sources`) follow torch's CPU kernels term by term in the
opmath precision (float32 for fp32/fp16/bf16, float64 for fp64): the scale
``(n-1)/(m-1)`` (``align_corners``) or ``1/scale_factor`` (when a scale factor is used
as given) or ``n/m``; the source ``scale*o`` or ``scale*(o + 0.5) - 0.5`` clamped at 0
(in float32 as one fused multiply-add, as torch's compiled kernels evaluate it);
``i0 = min(floor(float32(src)), n-1)`` (torch floors through ``floorf``, so a float64
source is rounded to float32 first); ``l1 = clamp(src - i0, 0, 1)``; ``i1 = i0 + 1`` below
the last input; and the identity when ``m == n``.  A last-bit difference from a device's
own rounding moves a source index only where the two candidate weights are 0 and 1, so
the interpolated value is continuous across it.

Nearest modes are discontinuous: an index one off is a wrong value.  torch computes them
differently by dtype, memory format and device (float32 or float64 products, ``floorf``
of a double), so the layer asks torch itself for the indices of a 1-D probe instead of
re-deriving them (``distfuse/layers/upsample.py``); this module only turns indices into
windows (:func:`window_axis`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distfuse.errors import ShapeError, UnsupportedError
from distfuse.geometry.decomposition import block_range
from distfuse.geometry.halo_plan import AxisGeometry

__all__ = ["INTERP_MODES", "LINEAR_MODES", "interp_output_extent", "linear_sources", "shift_invariant_factor",
           "WindowAxis", "window_axis"]

#: Modes and the number of spatial axes each one takes (None: any).
INTERP_MODES = {"nearest": None, "nearest-exact": None, "linear": 1, "bilinear": 2, "trilinear": 3}
LINEAR_MODES = ("linear", "bilinear", "trilinear")


def interp_output_extent(n: int, size: int | None, scale_factor: float | None) -> int:
    """torch's output extent: ``size``, else ``int(n * scale_factor)`` (a double product, truncated).

    Raises :class:`ShapeError` where torch refuses: an input or output extent below 1.
    """
    m = int(size) if size is not None else int(n * float(scale_factor))
    if n < 1 or m < 1:
        raise ShapeError(f"input and output extents must be at least 1 (as torch requires), got input {n} and "
                         f"output {m} (size={size}, scale_factor={scale_factor})")
    return m


def linear_sources(n: int, m: int, align_corners: bool, scale_factor: float | None, float64: bool):
    """Per output ``o < m``: ``(i0, i1, l0, l1)`` of torch's linear interpolation along one axis.

    ``scale_factor`` is the factor torch passes to its kernel (None when it works from
    the sizes: ``size`` given, or ``recompute_scale_factor=True``).  Indices are int64
    numpy arrays, weights float64 or float32 arrays (the opmath precision).
    """
    ft = np.float64 if float64 else np.float32
    o = np.arange(m, dtype=np.int64)
    if m == n:  # torch's identity shortcut (exact copy)
        return o, o.copy(), np.ones(m, dtype=ft), np.zeros(m, dtype=ft)
    if align_corners:
        scale = ft(n - 1) / ft(m - 1) if m > 1 else ft(0)
        src = scale * o.astype(ft)
    else:
        scale = ft(1.0 / scale_factor) if scale_factor is not None and scale_factor > 0 else ft(n) / ft(m)
        centre = o.astype(ft) + ft(0.5)
        if float64:
            src = scale * centre - ft(0.5)
        else:
            # torch's compiled kernels contract scale*centre - 0.5 into one fused multiply-add (x86 CPU builds
            # and nvcc both do).  In float64 the float32 product is exact (24 + 25 bits) and so is the
            # subtraction, so rounding once to float32 is exactly the fused result.
            src = (scale.astype(np.float64) * centre.astype(np.float64) - 0.5).astype(np.float32)
        src = np.where(src < ft(0), ft(0), src).astype(ft)
    i0 = np.minimum(np.floor(src.astype(np.float32)).astype(np.int64), n - 1)
    l1 = np.minimum(np.maximum(src - i0.astype(ft), ft(0)), ft(1)).astype(ft)
    i1 = i0 + (i0 < n - 1).astype(np.int64)
    return i0, i1, (ft(1) - l1).astype(ft), l1


def shift_invariant_factor(n: int, m: int, mode: str, align_corners: bool, scale_factor: float | None) -> int | None:
    """``s`` when this axis is an exact power-of-two upsampling that commutes with shifts by whole inputs, else None.

    Then output ``o`` of the global interpolation equals output ``o - s*a`` of the same
    interpolation (same mode, factor ``s``) of any input window starting at ``a`` that
    holds ``o``'s sources away from the window's clamped edges: ``m == s*n``, torch's kernel
    scale is exactly ``1/s`` (a user factor other than ``s`` is not), and the source
    coordinates ``o/s``, ``(o + 0.5)/s`` and ``(o + 0.5)/s - 0.5`` are exact in binary, so
    torch computes the same indices and weights for both.  ``align_corners=True`` scales
    by ``(n-1)/(m-1)``, which depends on the extent, so it qualifies only for ``s == 1``.
    """
    if m % n:
        return None
    s = m // n
    if s & (s - 1) or (scale_factor is not None and scale_factor != s):
        return None
    if mode in LINEAR_MODES and align_corners and s != 1:
        return None
    return s


@dataclass(frozen=True)
class WindowAxis(AxisGeometry):
    """An axis whose workers read explicit input windows: ``windows[i] = (a, b)`` for output block ``i``.

    Plugs into :class:`~distfuse.geometry.halo_plan.HaloPlan` like a convolution axis
    (kernel 1, no padding): the plan's pieces, messages and fused-kernel tables all come
    from :meth:`needed_range`.  Windows lie inside ``[0, n)``; a worker with no outputs
    has the empty window ``(0, 0)``.
    """

    out: int = 0
    windows: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if len(self.windows) != self.p:
            raise UnsupportedError(f"WindowAxis: {len(self.windows)} windows for {self.p} workers")
        for i, (a, b) in enumerate(self.windows):
            o0, o1 = block_range(self.out, self.p, i)
            if (o1 == o0) != (a == b) or not 0 <= a <= b <= self.n:
                raise UnsupportedError(f"WindowAxis: window {(a, b)} of worker {i} (outputs [{o0}, {o1})) is not a "
                                       f"non-empty range inside [0, {self.n})")

    @property
    def m(self) -> int:
        return self.out

    def needed_range(self, i: int) -> tuple[int, int]:
        return self.windows[i]


def window_axis(n: int, p: int, lo: Sequence[int], hi: Sequence[int]) -> WindowAxis:
    """The :class:`WindowAxis` of outputs that read inputs ``lo[o] .. hi[o]`` (inclusive), ``m = len(lo)``."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    m = len(lo)
    windows = []
    for i in range(p):
        o0, o1 = block_range(m, p, i)
        windows.append((int(lo[o0:o1].min()), int(hi[o0:o1].max()) + 1) if o1 > o0 else (0, 0))
    return WindowAxis(n, p, 1, out=m, windows=tuple(windows))
