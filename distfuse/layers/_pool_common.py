"""What the distributed pooling layers share: options, the per-call plan, path choice and the staged window.

Partitions and shapes (``nd`` spatial axes; worker at index ``(b, c, *s)`` of ``P_x``)::

    P_x     [P_b, P_c, P_1, ..., P_nd]     P_y = P_x (implicit)
    x       [B_b, C_c, *n_s]               balanced block of the global input
    y       [B_b, C_c, *m_s]               balanced block of torch's pooled output
                                           (m from torch's pooling rule, ceil_mode included)

    forward   staged = stage(x)            the window y_s reads (halos, padding = fill)
              y      = pool(staged, padding=0, ceil_mode=False)   + the exact torch divisor
    adjoint   dstaged = pool adjoint;  dx = stage*(dstaged)       halo gradients go home

Pooling is independent per batch and channel, so ``P_x`` may split those too (no
messages along them).  The plan is the convolution halo plan
(``geometry/pool_geometry.py`` explains how ceil mode and torch's padding rules map onto
it), so stride, dilation, uneven splits, halos wider than a neighbour's block and
workers with no outputs all work as they do for the feature convolution.

Every call makes one host-side metadata gather over ``P_x``
(:func:`~distfuse.layers._conv_common.gather_call_info`, a few int64 per worker): it
finds the global shape, so that every worker validates the geometry the same way and
raises the same error, and makes every worker agree on whether the adjoint runs.
``static_shapes=True`` skips it while local shapes repeat (:class:`ShapeRecord`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distfuse.errors import DistfuseError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.pool_geometry import check_pool_axis, pool_axis
from distfuse.layers._conv_common import CallInfo, check_partition, gather_call_info, promote
from distfuse.layers.dispatch import Decision
from distfuse.layers.pool_staging import EmptyBlock, choose_staging, stage_window, world_of_fn
from distfuse.primitives._common import check_inactive_input

__all__ = ["PoolOptions", "pool_plan", "ShapeRecord", "DistributedPoolBase", "check_16bit_cpu"]


def _per_axis(op: str, v, nd: int, name: str, minimum: int) -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list)) else None
    if t is None or len(t) != nd or not all(isinstance(e, int) and not isinstance(e, bool) for e in t) \
            or min(t) < minimum:
        raise UnsupportedError(f"{where(op)}: {name} must be an int >= {minimum} or {nd} such ints (one per spatial "
                               f"axis), got {v!r}")
    return tuple(int(e) for e in t)


@dataclass(frozen=True)
class PoolOptions:
    """torch ``MaxPoolNd`` / ``AvgPoolNd`` window arguments, per spatial axis (``dilation`` 1 for average)."""

    nd: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool

    @classmethod
    def make(cls, op: str, nd: int, kernel_size, stride, padding, dilation, ceil_mode) -> PoolOptions:
        """Normalise and check the arguments as torch does (stride defaults to the kernel size)."""
        kernel = _per_axis(op, kernel_size, nd, "kernel_size", 1)
        stride = kernel if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else \
            _per_axis(op, stride, nd, "stride", 1)
        pad = _per_axis(op, padding, nd, "padding", 0)
        dil = _per_axis(op, dilation, nd, "dilation", 1)
        for k, p in zip(kernel, pad, strict=True):
            if p > k // 2:
                raise UnsupportedError(f"{where(op)}: padding {pad} must be at most half the kernel size "
                                       f"{kernel} (kernel_size // 2 per axis, as torch requires)")
        return cls(nd, kernel, stride, pad, dil, bool(ceil_mode))


@functools.lru_cache(maxsize=256)
def pool_plan(spatial: tuple[int, ...], grid: tuple[int, ...], opts: PoolOptions) -> HaloPlan:
    """The halo plan of a pooling layer over ``grid`` for a global spatial shape (validated as torch would)."""
    for n, k, s, d, p in zip(spatial, opts.kernel_size, opts.stride, opts.dilation, opts.padding, strict=True):
        check_pool_axis(n, k, s, d, p, opts.ceil_mode)
    return HaloPlan([pool_axis(n, g, k, s, d, p, opts.ceil_mode)
                     for n, g, k, s, d, p in zip(spatial, grid, opts.kernel_size, opts.stride, opts.dilation,
                                                 opts.padding, strict=True)])


class ShapeRecord:
    """The per-call metadata gather of a layer without parameters, or its reuse under ``static_shapes``.

    With ``static=True`` a worker reuses the last gathered record while its own input
    shape, dtype, grad mode and ``requires_grad`` repeat, exactly as the feature
    convolution's ``static_shapes`` does (see
    :meth:`~distfuse.layers.conv_feature.DistributedFeatureConvBase._call_info` for why
    that is safe: if every block repeats, so does the global shape; if only some change,
    every worker fails with a CollectiveTimeoutError instead of computing with a stale
    plan).  Measured cost of the gather it skips: about 4 ms per call with 4 gloo ranks
    on the loaded 2-core CI machine.
    """

    def __init__(self, static: bool):
        self.static = bool(static)
        self._last: tuple | None = None  # (this worker's call key, the CallInfo gathered for it)

    def info(self, op: str, P_x, x: torch.Tensor, signature) -> CallInfo:
        key = (tuple(x.shape), x.dtype, torch.is_grad_enabled(), x.requires_grad)
        if self.static and self._last is not None and self._last[0] == key:
            return self._last[1]
        info = gather_call_info(op, P_x, P_x, x, [], signature=signature)
        if self.static:
            self._last = (key, info)
        return info

    def forget(self) -> None:
        self._last = None


class DistributedPoolBase(nn.Module):
    """A pooling layer over an input split along any of its axes (see the module docstring).

    Subclasses set ``nd`` and ``fill`` and define ``_pool_block(staged, plan, index,
    out_shape, global_shape)``, the pooling of a staged window.  Construction is not
    collective and checks the window arguments (every rank raises alike); the output
    extent is checked per call, on the gathered global shape, on every worker.

    Attributes:
        last_path: ``"local"`` (no worker exchanges anything for this geometry),
            ``"unfused"`` or ``"fused"``: how the last call staged its window (None before
            the first call and on workers outside P_x).
        last_decision: the :class:`~distfuse.layers.dispatch.Decision` behind it.
    """

    nd: int = 0
    fill: float = 0.0  # the value of staged positions outside the input

    def __init__(self, P_x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                 static_shapes: bool = False):
        super().__init__()
        op = type(self).__name__
        check_partition(op, "P_x", P_x, self.nd)
        self.P_x = P_x
        self.opts = PoolOptions.make(op, self.nd, kernel_size, stride, padding, dilation, ceil_mode)
        o = self.opts
        self.kernel_size, self.stride, self.padding = o.kernel_size, o.stride, o.padding
        self.dilation, self.ceil_mode = o.dilation, o.ceil_mode
        self.static_shapes = bool(static_shapes)
        self._shapes = ShapeRecord(static_shapes)
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._caps_cache: dict = {}

    def forget_shapes(self) -> None:
        """Drop the ``static_shapes`` record, so the next call gathers again (call it on every worker)."""
        self._shapes.forget()

    def param_layouts(self) -> list:
        """No parameters (so ``load_sequential`` / ``collect_sequential`` move nothing)."""
        return []

    # ------------------------------------------------------------ geometry and path

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        """The plan for a global input shape; raises the same error on every worker for geometry torch refuses."""
        op = type(self).__name__
        G = tuple(int(e) for e in global_shape)
        if G[1] == 0 or 0 in G[2:]:
            raise expect(op, "global input shape (channels and spatial extents must be non-zero, as torch requires)",
                         "[B, C >= 1, n >= 1 ...]", G)
        try:
            return pool_plan(G[2:], tuple(self.P_x.shape[2:]), self.opts)
        except DistfuseError as exc:
            raise type(exc)(f"{where(op)}: global input shape {G}: {exc}") from None

    def explain(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> Decision:
        """How a call with ``x`` stages its window, and why (no communication; pass the global shape to
        include the local-path check)."""
        plan = self.plan(global_shape) if global_shape is not None else None
        channels = global_shape[1] if global_shape is not None else x.shape[1] if x.dim() > 1 else 1
        return choose_staging(plan, x.dtype, x.device, self.P_x.size, channels, self._caps_cache)

    # ------------------------------------------------------------ forward

    def _window(self, x: torch.Tensor):
        """Gather the call's metadata and stage this worker's window.

        Returns ``(staged, plan, index, out_shape, global_shape)``, or None on workers outside P_x.
        """
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, x)
            return None
        info = self._shapes.info(op, self.P_x, x, (self.opts, self.P_x.ranks, self.P_x.shape))
        G = info.global_shape
        plan = self.plan(G)
        x = promote(x, info.input_grad)
        index = tuple(self.P_x.index[2:])
        decision = self.explain(x, G)
        self.last_decision, self.last_path = decision, decision.path
        staged = stage_window(x, plan, index, world_of_fn(self.P_x, self.nd), path=decision.path, fill=self.fill,
                              op=op)
        out_shape = tuple(x.shape[:2]) + plan.output_shape(index)
        return staged, plan, index, out_shape, G

    def forward(self, x: torch.Tensor):
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        window = self._window(x)
        if window is None:
            return self._inactive_output(x)
        staged, plan, index, out_shape, G = window
        if 0 in out_shape:
            return self._empty_output(staged, out_shape)
        return self._pool_block(staged, plan, index, out_shape, G)

    def _inactive_output(self, x: torch.Tensor):
        return x.clone()

    def _empty_output(self, staged: torch.Tensor, out_shape: tuple[int, ...]):
        return EmptyBlock.apply(staged, out_shape)

    def extra_repr(self) -> str:
        o = self.opts
        return (f"P_x={list(self.P_x.shape)}, kernel_size={o.kernel_size}, stride={o.stride}, padding={o.padding}, "
                f"dilation={o.dilation}, ceil_mode={o.ceil_mode}")


def check_16bit_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is a 16-bit CPU tensor (the layers compute those in fp32 and round once)."""
    return t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16)

