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

A host-side metadata gather over ``P_x``
(:func:`~distfuse.layers._conv_call_info.gather_call_info`, a few int64 per worker) finds
the global shape, so that every worker validates the geometry the same way and raises
the same error, and makes every worker agree on whether the adjoint runs.  It runs on
the first call and when some worker's signature changed; while signatures repeat a
one-element flag round replaces it (:class:`ShapeRecord`, which says why the flag
cannot ride in the halo exchange).  ``static_shapes`` is accepted for compatibility and
changes nothing: every call already skips the gather while the workers' signatures repeat.

``torch.compile(layer, fullgraph=True)`` traces the layer without a graph break: a
compiled call reuses the record of the last eager call, runs the flag round as the
custom op ``distfuse::flag_check`` and the halo round as ``distfuse::halo_exchange``
(:mod:`distfuse.layers._pool_compiled`), and reads its geometry from the
:class:`PoolWindow` the eager call made.
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
from distfuse.layers._conv_call_info import _DTYPES, CallInfo, autocast_dtype, gather_call_info
from distfuse.layers._conv_common import check_partition, promote
from distfuse.layers._pool_compiled import WindowHalo, compiled_record, compiled_stage
from distfuse.layers.dispatch import Decision
from distfuse.layers.pool_staging import (
    EmptyBlock,
    StagingRecord,
    choose_staging,
    stage_window,
    staging_record,
    world_of_fn,
)
from distfuse.ops import FlagRound
from distfuse.primitives._agreement import AgreementSite, flag_round, run_agreed, trusting
from distfuse.primitives._common import check_inactive_input

__all__ = ["PoolOptions", "pool_plan", "ShapeRecord", "PoolWindow", "DistributedPoolBase", "check_16bit_cpu"]


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


class ShapeRecord:
    """The agreed call record of a layer without parameters (pooling, upsampling).

    The layer's :class:`~distfuse.primitives._agreement.AgreementSite` (``site``) holds the
    :class:`~distfuse.layers._conv_call_info.CallInfo` every worker agreed on.  A call whose
    signature (local shape, dtype, device type, grad mode, ``requires_grad``, autocast)
    repeats on every worker reuses it after one flag round
    (:func:`~distfuse.primitives._agreement.flag_round`: a one-element all-reduce of the
    workers' flags on ``P_x``'s host-side meta group).  The flag cannot ride in the layer's
    data messages: the halo exchange is point-to-point between neighbours only, and a plan
    with no halo (``last_path == "local"``) sends nothing, so no message of the call
    reaches every worker.  The flag all-reduce is a host collective, but it moves one
    integer and reads no device tensor: about 0.5 ms with 4 gloo ranks on the loaded 2-core
    CI machine, against about 3.5 ms for the metadata all-gather it replaces (see
    ``docs/reliability.md``).  When any worker's
    signature changed (or its input fails a local check), every worker sees the flag and
    all take the slow path together: the metadata gather and its checks, which raise the
    same error on every worker.  The first call gathers directly.

    Inside :func:`~distfuse.primitives._agreement.capture_safe` (or a CUDA-graph capture)
    the record is trusted while this worker's signature repeats: no flag round, no host
    read.
    """

    def __init__(self, op: str):
        self.site = AgreementSite(op)

    @staticmethod
    def _signature(x: torch.Tensor) -> tuple:
        return (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
                autocast_dtype(x.device.type))

    def info(self, op: str, P_x, x: torch.Tensor, signature) -> CallInfo:
        site = self.site
        mine = self._signature(x)
        if site.state is not None and trusting():  # capture-safe: no flag, no host read
            if mine != site.signature:
                raise UnsupportedError(f"{where(op)}: inside capture_safe() (or a CUDA-graph capture) a call must "
                                       "repeat the inputs of the last eager call (shape, dtype, grad flags); warm "
                                       "up with the captured shapes on every worker")
            site.calls += 1
            return site.state
        locally_ok = x.device.type == P_x.device.type and x.dtype in _DTYPES and x.dim() == P_x.dim

        def attempt(changed: bool):
            return site.state, flag_round(P_x, changed, op)

        def slow():
            info = gather_call_info(op, P_x, P_x, x, [], signature=signature)
            return info, info

        return run_agreed(site, mine, locally_ok, attempt, slow)

    def forget(self) -> None:
        """Drop the agreed record, so the next call gathers again (call it on every worker)."""
        self.site.forget()


class DistributedPoolBase(nn.Module):
    """A pooling layer over an input split along any of its axes (see the module docstring).

    Subclasses set ``nd`` and ``fill`` and define ``_pool_block(staged, window,
    out_shape, global_shape)``, the pooling of a staged window (``window`` a
    :class:`PoolWindow`), and may define ``_block_constants``, what it reads from the
    geometry (made once per global shape, so that compiled calls only read it).  Construction is not
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
        self._shapes = ShapeRecord(op)
        self.agreement = self._shapes.site
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._caps_cache: dict = {}
        # compiled forwards: the flag round and the window's halo round as custom ops (_pool_compiled.py)
        self._flag_round = FlagRound(op, P_x, self.forget_shapes)
        self._window_halo = WindowHalo(P_x, self.nd, self.plan, op)
        self._windows: dict[tuple, PoolWindow] = {}

    def forget_shapes(self) -> None:
        """Drop the agreed call record, so the next call gathers again (call it on every worker)."""
        self._shapes.forget()

    forget_agreement = forget_shapes

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

    def _block_constants(self, plan: HaloPlan, index: tuple[int, ...], global_shape: tuple[int, ...],
                         device: torch.device):
        """What :meth:`_pool_block` needs beyond the staged window, from the geometry alone (subclasses)."""
        return None

    def _window(self, x: torch.Tensor):
        """Gather the call's metadata and stage this worker's window.

        Returns ``(staged, window record, out_shape, global_shape)``, or None on workers outside P_x
        (and, inside a compiled region, on a worker whose call differs from the agreed one).
        """
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, x)
            return None
        if torch.compiler.is_compiling():
            return self._compiled_window(op, x)
        info = self._shapes.info(op, self.P_x, x, (self.opts, self.P_x.ranks, self.P_x.shape))
        G = info.global_shape
        win = self.window_record(G, x.device)
        x = promote(x, info.input_grad)
        decision = self.explain(x, G)
        self.last_decision, self.last_path = decision, decision.path
        staged = stage_window(x, win.plan, win.index, world_of_fn(self.P_x, self.nd), path=decision.path,
                              fill=self.fill, op=op)
        return staged, win, tuple(x.shape[:2]) + win.out_spatial, G

    def _compiled_window(self, op: str, x: torch.Tensor):
        """:meth:`_window` inside ``torch.compile``: the agreed record, ``distfuse::flag_check`` and
        ``distfuse::halo_exchange`` (see :mod:`distfuse.layers._pool_compiled`); None past a flagged call.

        Reads only the window record the eager call made (a traced walk over the plan would break the graph).
        """
        info = compiled_record(op, self, x, self._flag_round)
        if info is None:  # this worker flagged: the flag round raises on every worker, nothing below runs
            return None
        G = info.global_shape
        win = self.window_record(G, x.device)
        staged, self.last_path = compiled_stage(x, win.staging, self._window_halo, G, self.fill)
        return staged, win, tuple(x.shape[:2]) + win.out_spatial, G

    def forward(self, x: torch.Tensor):
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        window = self._window(x)
        if window is None:
            return self._inactive_output(x)
        staged, win, out_shape, G = window
        if 0 in out_shape:
            return self._empty_output(staged, out_shape)
        return self._pool_block(staged, win, out_shape, G)

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

