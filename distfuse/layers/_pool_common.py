"""What the pooling layers share, and their one forward (:class:`WindowLayer`, the upsampling layer's too).

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

One forward serves eager calls, ``capture_safe()`` and ``torch.compile(fullgraph=True)``
(:class:`WindowLayer`, shared with :class:`~distfuse.layers.upsample.DistributedUpsample`)::

    info   = session.agree(x)            the call's global shape and grad flags, every worker alike
    window = window_record(G)            this worker's plan, staging record, output extents (once per shape)
    staged = stage_window(x, path)       local, or the halo / fused staging op pair
    y      = _block(staged, window)      the local op

The agreement is an :class:`~distfuse.primitives.agreement_session.AgreementSession` over
``P_x``: eager calls gather the metadata (a few int64 per worker, host-side:
:func:`~distfuse.layers._conv_call_info.gather_call_info`, so every worker validates the
geometry alike and raises the same error, and every worker agrees on whether the
adjoint runs) on the first call and when some worker's signature changed, and otherwise
run a one-element flag round; the flag cannot ride in the halo exchange, which runs
between neighbours only and sends nothing at all where the plan has no halo
(``last_path == "local"``).  The flag round costs about 0.5 ms with 4 gloo ranks on the
loaded 2-core CI machine, against about 3.5 ms for the gather (``docs/reliability.md``).
Inside ``capture_safe()`` the settled record is trusted; inside ``torch.compile`` the
record of the last eager call is replayed, with the flag round as
``distfuse::flag_check`` and the staging path of the last eager call.  ``static_shapes``
is accepted for compatibility and changes nothing.
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
from distfuse.layers._conv_call_info import CallInfo, autocast_dtype, gather_call_info, passes_local_checks
from distfuse.layers._conv_common import check_partition, promote
from distfuse.layers.dispatch import Decision
from distfuse.layers.pool_staging import EmptyBlock, StagingRecord, choose_staging, stage_window, staging_record
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives.agreement_session import AgreementSession
from distfuse.primitives.halo_exchange import PlanHalo

__all__ = ["PoolOptions", "pool_plan", "PoolWindow", "WindowLayer", "DistributedPoolBase", "check_16bit_cpu"]


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


@dataclass(frozen=True)
class PoolWindow:
    """One worker's geometry for one global shape: the plan, its block index, how it stages its window, its
    output block's spatial extents and the subclass's ``block`` constants (divisors, first taps)."""

    plan: HaloPlan
    index: tuple[int, ...]
    staging: StagingRecord
    out_spatial: tuple[int, ...]
    block: object = None


class WindowLayer(nn.Module):
    """The one forward of the layers that compute each output block from one staged window (pooling, upsampling).

    Subclasses define ``_layer_key()`` (their options and partition, compared across
    workers in the gather), ``_plan_for(G, x)`` (the plan for a global shape and input),
    ``_halo_plan(G)`` (the plan the staging ops stage with), ``_window_of(G, x)`` (this
    worker's window record: ``staging`` and ``out_spatial``, made once per global shape so
    that a compiled call only reads it) and ``_block(x, staged, window, info, out_shape)``
    (the local op).  ``fill`` is the value of staged positions outside the input.

    Attributes:
        session: the :class:`~distfuse.primitives.agreement_session.AgreementSession` over
            ``P_x``; ``agreement`` is its site (``calls`` / ``slow_calls`` count the calls
            and the metadata gathers).
        last_path: ``"local"`` (no worker exchanges anything for this geometry),
            ``"unfused"`` or ``"fused"``: how the last call staged its window (None before
            the first call and on workers outside P_x).  A compiled call takes the path of
            the last eager call with the same global shape, dtype and device.
        last_decision: the :class:`~distfuse.layers.dispatch.Decision` behind it.
    """

    fill: float = 0.0

    def __init__(self, P_x, nd: int, static_shapes: bool):
        super().__init__()
        op = type(self).__name__
        self.P_x = P_x
        self.static_shapes = bool(static_shapes)
        self.session = AgreementSession(op, P_x)
        self.agreement = self.session.site
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._caps_cache: dict = {}
        self._halo = PlanHalo(P_x, nd, self._halo_plan, op)  # names the plan in the staging ops
        self._windows: dict[tuple, object] = {}

    def forget_shapes(self) -> None:
        """Drop the agreed call record, so the next call gathers again (call it on every worker)."""
        self.session.forget()

    forget_agreement = forget_shapes

    def param_layouts(self) -> list:
        """No parameters (so ``load_sequential`` / ``collect_sequential`` move nothing)."""
        return []

    def explain(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> Decision:
        """How a call with ``x`` stages its window, and why (no communication; pass the global shape to
        include the local-path check)."""
        plan = self._plan_for(tuple(global_shape), x) if global_shape is not None else None
        channels = global_shape[1] if global_shape is not None else x.shape[1] if x.dim() > 1 else 1
        return choose_staging(plan, x.dtype, x.device, self.P_x.size, channels, self._caps_cache)

    def _agree(self, x: torch.Tensor) -> CallInfo | None:
        """The call's agreed :class:`~distfuse.layers._conv_call_info.CallInfo` (None: a replayed call that
        flagged; ``flag_check`` raises on every worker when the graph runs).  The signature holds what the
        gather records of this worker; a replayed call whose peers' input needs a gradient and its own does
        not flags too (an eager call promotes the input; a graph cannot)."""
        op, P_x = type(self).__name__, self.P_x
        signature = (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
                     autocast_dtype(x.device.type))
        return self.session.agree(x, signature, passes_local_checks(P_x, x),
                                  lambda: gather_call_info(op, P_x, P_x, x, [], signature=self._layer_key()),
                                  needs_eager=lambda info: info.input_grad and not x.requires_grad)

    def forward(self, x: torch.Tensor):
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        if not self.P_x.active:
            check_inactive_input(type(self).__name__, x)
            return self._inactive_output(x)
        info = self._agree(x)
        if info is None:
            return self._inactive_output(x)
        G = info.global_shape
        win = self._window_of(G, x)
        x = promote(x, info.input_grad)
        self.last_decision = self.session.remember(("staging", G, x.dtype, x.device.type),
                                                   lambda: self.explain(x, G))
        self.last_path = self.last_decision.path
        staged = stage_window(x, self._halo, win.staging, G, path=self.last_path, fill=self.fill)
        out_shape = tuple(x.shape[:2]) + win.out_spatial
        if 0 in out_shape:
            return self._empty_output(staged, out_shape)
        return self._block(x, staged, win, info, out_shape)

    def _inactive_output(self, x: torch.Tensor):
        return x.clone()

    def _empty_output(self, staged: torch.Tensor, out_shape: tuple[int, ...]):
        return EmptyBlock.apply(staged, out_shape)


class DistributedPoolBase(WindowLayer):
    """A pooling layer over an input split along any of its axes (see the module docstring).

    Subclasses set ``nd`` and ``fill`` and define ``_pool_block(staged, window,
    out_shape, global_shape)``, the pooling of a staged window (``window`` a
    :class:`PoolWindow`), and may define ``_block_constants``, what it reads from the
    geometry (made once per global shape, so that compiled calls only read it).  Construction is not
    collective and checks the window arguments (every rank raises alike); the output
    extent is checked per call, on the gathered global shape, on every worker.  The
    attributes are :class:`WindowLayer`'s.
    """

    nd: int = 0

    def __init__(self, P_x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                 static_shapes: bool = False):
        op = type(self).__name__
        check_partition(op, "P_x", P_x, self.nd)
        super().__init__(P_x, self.nd, static_shapes)
        self.opts = PoolOptions.make(op, self.nd, kernel_size, stride, padding, dilation, ceil_mode)
        o = self.opts
        self.kernel_size, self.stride, self.padding = o.kernel_size, o.stride, o.padding
        self.dilation, self.ceil_mode = o.dilation, o.ceil_mode

    def _layer_key(self):
        return self.opts, self.P_x.ranks, self.P_x.shape

    # ------------------------------------------------------------ geometry

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

    def _halo_plan(self, global_shape: tuple[int, ...]) -> HaloPlan:
        return self.plan(global_shape)

    def _plan_for(self, global_shape: tuple[int, ...], x: torch.Tensor) -> HaloPlan:
        return self.plan(global_shape)

    def window_record(self, global_shape: Sequence[int], device: torch.device) -> PoolWindow:
        """This worker's :class:`PoolWindow` for a global shape (made once per shape and device type, then read)."""
        key = (tuple(int(e) for e in global_shape), device.type)
        rec = self._windows.get(key)
        if rec is None:
            plan = self.plan(key[0])
            index = tuple(self.P_x.index[2:])
            rec = self._windows[key] = PoolWindow(plan, index, staging_record(plan, index), plan.output_shape(index),
                                                  self._block_constants(plan, index, key[0], device))
        return rec

    def _window_of(self, global_shape: tuple[int, ...], x: torch.Tensor) -> PoolWindow:
        return self.window_record(global_shape, x.device)

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape: tuple[int, ...],
                         device: torch.device):
        """What :meth:`_pool_block` needs beyond the staged window, from the geometry alone (subclasses)."""
        return None

    def _block(self, x, staged: torch.Tensor, win: PoolWindow, info: CallInfo, out_shape: tuple[int, ...]):
        return self._pool_block(staged, win, out_shape, info.global_shape)

    def extra_repr(self) -> str:
        o = self.opts
        return (f"P_x={list(self.P_x.shape)}, kernel_size={o.kernel_size}, stride={o.stride}, padding={o.padding}, "
                f"dilation={o.dilation}, ceil_mode={o.ceil_mode}")


def check_16bit_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is a 16-bit CPU tensor (the layers compute those in fp32 and round once)."""
    return t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16)

