"""Distributed interpolation: ``DistributedUpsample`` and ``interpolate`` (torch's ``Upsample``) on a partitioned input.

Partitions and shapes (``nd`` = 1, 2 or 3 spatial axes; worker at index ``(b, c, *s)``)::

    P_x     [P_b, P_c, P_1, ..., P_nd]     P_y = P_x (implicit)
    x       [B_b, C_c, *n_s]               balanced block of the global input
    y       [B_b, C_c, *m_s]               balanced block of ``F.interpolate`` on the gathered input

    forward   staged = stage(x)                        the input window [a_d, b_d) y_s reads
              per axis d, last to first:
                nearest   y = index_select(y, d, src - a_d)
                linear    y = index_select(y, d, i0 - a_d) * l0 + index_select(y, d, i1 - a_d) * l1
    adjoint   autograd: index_add for each index_select, then the staging's adjoint
              (halo gradients go home)

Why not ``F.interpolate`` on the window: torch maps output ``o`` to input coordinates
from the *global* sizes (``scale*(o + 0.5) - 0.5`` and its variants), and a call on a
window would use the window's sizes and its own origin.  So the layer computes every
output's global source indices and weights once per geometry, cuts out this worker's
rows, and applies them in torch's order (:func:`interpolate_block`).  Linear modes follow
torch's formula in its opmath precision (``geometry/interp_geometry.py``).  Nearest modes
are discontinuous and torch computes them differently by dimension, dtype and device (2-D
nearest on CPU has an identity shortcut that 1-D and 3-D lack, for example), so the layer
asks torch, with a probe (:func:`nearest_sources`).

Power-of-two upsampling (``scale_factor`` 2, 4, ... or the matching ``size``; not
``align_corners=True``), the U-Net case, takes a shortcut: there the source coordinates
are exact in binary and shift with the window, so torch's own kernel on the window
computes the same indices and weights as on the gathered tensor, and the worker cuts
its block out of the result (:attr:`InterpGeometry.factors`): one kernel pass instead of
a gather and a lerp per axis.

The exchange, the agreement and the one forward are the pooling layers'
(:class:`~distfuse.layers._pool_common.WindowLayer`), with each worker's window given
explicitly (:class:`~distfuse.geometry.interp_geometry.WindowAxis`).  A ``channels_last``
(``_3d``) input gives a ``channels_last`` output in every mode, as torch's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from distfuse.errors import DistfuseError, PartitionError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.interp_geometry import (
    INTERP_MODES,
    LINEAR_MODES,
    interp_output_extent,
    linear_sources,
    shift_invariant_factor,
    window_axis,
)
from distfuse.groups import WorldTable
from distfuse.layers._conv_common import CallInfo, compute_dtype
from distfuse.layers._pool_common import WindowLayer, WindowRecord, per_axis
from distfuse.partition import CartesianPartition

__all__ = ["DistributedUpsample", "interpolate", "InterpSpec", "InterpGeometry", "nearest_sources", "interp_geometry",
           "upsample_block", "interpolate_window", "interpolate_block"]


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
            sizes = per_axis(op, size, nd, "size", 1)
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
    """torch's source index of every output along ``axis``, asked of torch itself: one ``F.interpolate`` call on a
    probe of the gathered input's rank, ``C = 1`` exactly when the input's does (a one-channel input is also
    channels-last contiguous, and torch may pick its kernel by memory format), extent ``min(n, 2)`` on the other
    axes (mapped to themselves), and ``0..n-1`` along ``axis`` in float64 (fp64 inputs) or float32 (torch
    computes the others' indices in float32), so the values it returns are the indices.  Cached per geometry.
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
    """The plan and the per-axis taps of one interpolation over one grid.

    ``factors`` is set when every axis is a power-of-two upsampling that commutes with shifts
    (:func:`~distfuse.geometry.interp_geometry.shift_invariant_factor`) and every worker's block
    fits in the interpolation of its window (then it keeps its :meth:`crop` of torch's kernel's).
    """

    plan: HaloPlan
    taps: list[_AxisTaps]
    factors: tuple[int, ...] | None = None

    def block_taps(self, d: int, i: int, device, dtype) -> tuple:
        """This worker's rows of axis ``d``: local indices into its window (and weights) as tensors."""
        ax, t = self.plan.axes[d], self.taps[d]
        o0, o1 = ax.output_range(i)
        a = ax.needed_range(i)[0]
        idx = [torch.as_tensor(v[o0:o1] - a, dtype=torch.int64, device=device) for v in (t.i0, t.i1) if v is not None]
        wts = [torch.as_tensor(w[o0:o1], device=device).to(dtype) for w in (t.l0, t.l1) if w is not None]
        return idx, wts

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


# ---------------------------------------------------------------- one worker's block


def upsample_block(geo: InterpGeometry, index: tuple[int, ...], dtype: torch.dtype, device) -> tuple:
    """Worker ``index``'s window record ``block`` for inputs of ``dtype`` on ``device``: ``(factors, crops, taps)``,
    the crops of the power-of-two shortcut (``factors`` set), or else per axis the local indices and weights, on
    the device, in the compute dtype."""
    if geo.factors is not None:
        return geo.factors, tuple(geo.crop(d, i) for d, i in enumerate(index)), None
    return None, None, tuple(geo.block_taps(d, i, device, compute_dtype(dtype)) for d, i in enumerate(index))


def interpolate_window(staged: torch.Tensor, geo: InterpGeometry, index: tuple[int, ...],
                       spec: InterpSpec) -> torch.Tensor:
    """This worker's output block from its staged window ``[B, C, *L]`` (:func:`interpolate_block`)."""
    return interpolate_block(staged, spec, *upsample_block(geo, tuple(index), staged.dtype, staged.device))


def interpolate_block(staged: torch.Tensor, spec: InterpSpec, factors, crops, taps) -> torch.Tensor:
    """The output block from the staged window and an :func:`upsample_block`: the power-of-two shortcut's crop
    (a view where it is the whole result), or else the taps axis by axis, innermost first (torch's order),
    ``x0*l0 + x1*l1`` with both terms always (so that ``inf`` and ``NaN`` propagate as torch's do); 16-bit in
    fp32, rounded once."""
    if factors is not None:
        kw = dict(align_corners=spec.align_corners) if spec.mode in LINEAR_MODES else {}
        y = F.interpolate(staged, scale_factor=[float(f) for f in factors], mode=spec.mode, **kw)
        for d, (start, length) in enumerate(crops):
            if (start, length) != (0, y.shape[2 + d]):
                y = y.narrow(2 + d, start, length)
        return y
    y = staged.to(compute_dtype(staged.dtype))
    for d in reversed(range(len(taps))):
        idx, wts = taps[d]
        if not wts:  # nearest
            y = _take(y, 2 + d, idx[0])
        else:
            shape = [-1] + [1] * (len(taps) - 1 - d)
            y = _take(y, 2 + d, idx[0]) * wts[0].view(shape) + _take(y, 2 + d, idx[1]) * wts[1].view(shape)
    return y.to(staged.dtype)


def _take(y: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``y.index_select(dim, idx)``; along the last axis as a gather with a broadcast index, which torch's CPU
    kernels run about 10x faster."""
    if dim != y.dim() - 1:
        return y.index_select(dim, idx)
    return torch.gather(y, dim, idx.expand(*y.shape[:-1], idx.numel()))


# ---------------------------------------------------------------- the layer


class DistributedUpsample(WindowLayer):
    """``torch.nn.Upsample`` over an input split along any axes (see the module docstring).

    ``P_x``: CartesianPartition ``[P_b, P_c, P_1, ..., P_nd]``, ``nd`` = 1, 2 or 3; the
    other arguments as ``torch.nn.Upsample``, with the modes ``nearest``, ``nearest-exact``,
    ``linear`` (1-D), ``bilinear`` (2-D) and ``trilinear`` (3-D).  Construction is not
    collective; it checks the arguments as torch does.  Output extents below 1 raise
    :class:`~distfuse.errors.ShapeError` on every worker.
    """

    def __init__(self, P_x, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None, static_shapes: bool = False):
        op = type(self).__name__
        if not isinstance(P_x, CartesianPartition) or not 3 <= P_x.dim <= 5:
            raise PartitionError(f"{where(op)}: P_x must be a CartesianPartition [batch, channel, 1 to 3 spatial], "
                                 f"got {P_x!r}")
        super().__init__(P_x, P_x.dim - 2, static_shapes)
        self.spec = InterpSpec.make(op, P_x.dim - 2, size, scale_factor, mode, align_corners, recompute_scale_factor)
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def _layer_key(self):
        return self.spec, self.P_x.ranks, self.P_x.shape

    def geometry(self, global_shape: Sequence[int], dtype: torch.dtype, device) -> InterpGeometry:
        """The taps and plan for a global input shape (raises the same error on every worker)."""
        op = type(self).__name__
        G = tuple(int(e) for e in global_shape)
        if G[1] == 0:
            raise expect(op, "global input channels (torch refuses empty channels)", ">= 1", G[1])
        try:
            return interp_geometry(self.spec, G[2:], tuple(self.P_x.shape[2:]), G[1] == 1, dtype == torch.float64,
                                   str(torch.device(device)))
        except DistfuseError as exc:
            raise type(exc)(f"{where(op)}: global input shape {G}: {exc}") from None

    def plan(self, global_shape: Sequence[int], dtype: torch.dtype, device) -> HaloPlan:
        """The halo plan for a global input shape (:meth:`geometry`'s)."""
        return self.geometry(global_shape, dtype, device).plan

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape: tuple[int, ...], dtype, device):
        return upsample_block(self.geometry(global_shape, dtype, device), index, dtype, device)

    def _block(self, x: torch.Tensor, staged: torch.Tensor, win: WindowRecord, info: CallInfo,
               out_shape: tuple[int, ...]) -> torch.Tensor:
        """The output block from the staged window, laid out once in the input's agreed memory format (see the
        module docstring)."""
        fmt = info.memory_format
        y = interpolate_block(staged, self.spec, *win.block)
        return y if fmt == torch.contiguous_format else y.contiguous(memory_format=fmt)  # no copy where it is

    def extra_repr(self) -> str:
        s = self.spec
        what = f"size={s.sizes}" if s.sizes is not None else f"scale_factor={s.scales}"
        return f"P_x={list(self.P_x.shape)}, {what}, mode={s.mode!r}, align_corners={s.align_corners}"


#: ``interpolate``'s layers, one per partition (ranks, shape) and argument set: repeated calls reuse one
#: agreement record (a flag round instead of a metadata gather), and a compiled ``interpolate`` finds the record its
#: last eager call agreed.
_INTERPOLATE_LAYERS: WorldTable = WorldTable()  # per world: a layer holds its partition's groups


def _key_part(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def interpolate(P_x, x: torch.Tensor, size=None, scale_factor=None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> torch.Tensor:
    """``F.interpolate`` on a partitioned input: this worker's block of the output (see :class:`DistributedUpsample`).

    Collective over ``P_x``.  The layer behind each argument set is kept, so repeated calls
    agree at a flag's cost and ``torch.compile`` traces a call without a graph break once an
    eager call with the same arguments and shapes has agreed.  ``antialias`` is not supported.
    """
    if antialias:
        raise UnsupportedError(f"{where('interpolate')}: antialias=True is not supported by distfuse")
    key = (tuple(P_x.ranks), tuple(P_x.shape), _key_part(size), _key_part(scale_factor), mode, align_corners,
           recompute_scale_factor) if isinstance(P_x, CartesianPartition) else None
    layer = _INTERPOLATE_LAYERS.current().get(key)
    if layer is None:  # the constructor checks the arguments (every worker raises alike)
        layer = DistributedUpsample(P_x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                                    recompute_scale_factor=recompute_scale_factor)
        _INTERPOLATE_LAYERS[key] = layer
    return layer(x)
