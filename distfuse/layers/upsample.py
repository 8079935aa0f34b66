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
rows, and applies them: a gather and a lerp per axis, in the same order as torch's
kernels (innermost axis first, ``x0*l0 + x1*l1``, both terms always, so that ``inf`` and
``NaN`` propagate as torch's do).  16-bit inputs are computed in fp32 and rounded once.

Power-of-two upsampling (``scale_factor`` 2, 4, ... or the matching ``size``; not
``align_corners=True``), the U-Net case, takes a shortcut: there the source coordinates
are exact in binary and shift with the window, so torch's own kernel on the window
computes the same indices and weights as on the gathered tensor, and the worker cuts
its block out of the result (a view; see
:func:`~distfuse.geometry.interp_geometry.shift_invariant_factor`).  One kernel pass
instead of a gather and a lerp per axis.

The spec, the source indices and the plan are :mod:`distfuse.layers._upsample_plan`'s; one
worker's window record and the block computed from it, :mod:`distfuse.layers._upsample_window`'s.

Each worker's window is the halo exchange's needed range, given explicitly
(:class:`~distfuse.geometry.interp_geometry.WindowAxis`), so the exchange is the
convolution's: one round of messages, corners included, windows wider than a
neighbour's block or away from the own block included; no exchange at all where every
window stays at home (``last_path == "local"``).  The forward is the pooling layers' one
forward (:class:`~distfuse.layers._pool_common.WindowLayer`: agree, window, stage, local
op), so the agreement is theirs too: the workers' shapes are gathered (host-side, a few
int64 per worker) on the first call and when some worker's local shape, dtype or grad
flags changed; while they repeat, a one-element host all-reduce of the workers' flags
replaces the gather.  ``static_shapes`` is accepted for compatibility and changes nothing.

Memory format: torch's interpolation returns ``channels_last`` (``channels_last_3d``) for
such an input in every mode (nearest, nearest-exact, bilinear, trilinear; CPU, torch
2.13), and so does this layer.  The block is staged through views (never copied to
NCHW); the taps and the crop leave other strides, so the output block is laid out once.

``torch.compile`` traces the layer (and ``interpolate``, which keeps one layer per
argument set) without a graph break, through the same forward: the agreed record of the
last eager call, the flag round as ``distfuse::flag_check``, the staging op pair, and
the taps from the :class:`~distfuse.layers._upsample_window.UpsampleWindow` the eager
call made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse.errors import DistfuseError, PartitionError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.layers._conv_call_info import CallInfo
from distfuse.layers._pool_common import WindowLayer
from distfuse.layers._upsample_plan import InterpGeometry, InterpSpec, interp_geometry
from distfuse.layers._upsample_window import UpsampleWindow, _interpolate, upsample_window
from distfuse.partition import CartesianPartition

__all__ = ["DistributedUpsample", "interpolate"]


class DistributedUpsample(WindowLayer):
    """``torch.nn.Upsample`` over an input split along any axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, P_c, P_1, ..., P_nd]``, ``nd`` = 1, 2 or 3.
        size, scale_factor, mode, align_corners, recompute_scale_factor: as
            ``torch.nn.Upsample``; modes ``nearest``, ``nearest-exact``, ``linear`` (1-D),
            ``bilinear`` (2-D), ``trilinear`` (3-D).
        static_shapes: accepted for compatibility; changes nothing (every call skips the
            metadata gather while the workers' signatures repeat).

    Construction is not collective; it checks the arguments as torch does (every rank
    raises alike).  ``forward(x)`` takes this worker's block (zero-volume outside P_x)
    and returns its block of the output.  Output extents below 1 raise
    :class:`~distfuse.errors.ShapeError` on every worker.

    Attributes: :class:`~distfuse.layers._pool_common.WindowLayer`'s (``session``,
    ``agreement``, ``last_path``, ``last_decision``).
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
        self._plans: dict[tuple[int, ...], HaloPlan] = {}

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

    def _plan_for(self, global_shape: tuple[int, ...], x: torch.Tensor) -> HaloPlan:
        return self.geometry(global_shape, x.dtype, x.device).plan

    def window_record(self, global_shape: Sequence[int], dtype: torch.dtype, device) -> UpsampleWindow:
        """This worker's :class:`UpsampleWindow` (made once per global shape, dtype and device type, then read)."""
        G = tuple(int(e) for e in global_shape)
        key = (G, dtype, device.type)
        rec = self._windows.get(key)
        if rec is None:
            geo = self.geometry(G, dtype, device)
            rec = self._windows[key] = upsample_window(geo, tuple(self.P_x.index[2:]), dtype, device)
        return rec

    def _window_of(self, global_shape: tuple[int, ...], x: torch.Tensor) -> UpsampleWindow:
        win = self.window_record(global_shape, x.dtype, x.device)
        self._plans[global_shape] = win.geo.plan  # the plan depends on the dtype too: the staging ops take this call's
        return win

    def _halo_plan(self, global_shape: tuple[int, ...]) -> HaloPlan:
        """The plan of the call in progress (or of the last one) with this global shape."""
        return self._plans[global_shape]

    def _block(self, x: torch.Tensor, staged: torch.Tensor, win: UpsampleWindow, info: CallInfo,
               out_shape: tuple[int, ...]) -> torch.Tensor:
        """The output block from the staged window, in the input's agreed memory format: torch's
        interpolation returns ``channels_last`` (``_3d``) for such an input in every mode, dtype and
        dimension (checked on CPU, torch 2.13).  The taps and the crop give other strides, so the block is
        laid out once at the end; the input itself is never copied."""
        fmt = info.memory_format
        y = _interpolate(staged, self.spec, win.factors, win.crops, win.taps)
        return y if fmt == torch.contiguous_format or y.is_contiguous(memory_format=fmt) else \
            y.contiguous(memory_format=fmt)

    def extra_repr(self) -> str:
        s = self.spec
        what = f"size={s.sizes}" if s.sizes is not None else f"scale_factor={s.scales}"
        return f"P_x={list(self.P_x.shape)}, {what}, mode={s.mode!r}, align_corners={s.align_corners}"


#: ``interpolate``'s layers, one per partition (ranks, shape) and argument set: repeated calls reuse one
#: agreement record (a flag round instead of a metadata gather), and a compiled ``interpolate`` finds the record its
#: last eager call agreed.
_INTERPOLATE_LAYERS: dict[tuple, DistributedUpsample] = {}


def _key_part(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def interpolate(P_x, x: torch.Tensor, size=None, scale_factor=None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> torch.Tensor:
    """``F.interpolate`` on a partitioned input: this worker's block of the output (see :class:`DistributedUpsample`).

    Collective over ``P_x`` (one shape gather on the first call with these arguments and
    after a change of shape, a flag round otherwise, and, where windows cross blocks, one
    round of halo messages; the same in backward).  The layer behind each argument set is
    kept, so ``torch.compile`` traces a call without a graph break once an eager call with
    the same arguments and shapes has agreed on them.  ``antialias`` is not supported.
    """
    if antialias:
        raise UnsupportedError(f"{where('interpolate')}: antialias=True is not supported by distfuse")
    key = (tuple(P_x.ranks), tuple(P_x.shape), _key_part(size), _key_part(scale_factor), mode, align_corners,
           recompute_scale_factor) if isinstance(P_x, CartesianPartition) else None
    layer = _INTERPOLATE_LAYERS.get(key)
    if layer is None:  # the constructor checks the arguments (every worker raises alike)
        layer = DistributedUpsample(P_x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                                    recompute_scale_factor=recompute_scale_factor)
        _INTERPOLATE_LAYERS[key] = layer
    return layer(x)
