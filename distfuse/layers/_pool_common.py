"""The window layers (pooling, upsampling): their one forward, the pooling options, and the window staging.

Partitions and shapes (``nd`` spatial axes; worker at index ``(b, c, *s)`` of ``P_x``)::

    P_x     [P_b, P_c, P_1, ..., P_nd]     P_y = P_x (implicit)
    x       [B_b, C_c, *n_s]               balanced block of the global input
    staged  [B_b, C_c, *L_s]               the window [a_d, b_d) y_s reads (L_d = b_d - a_d): the own
                                           block, neighbours' halos, positions outside the domain = fill
    y       [B_b, C_c, *m_s]               balanced block of torch's output (pooling: m from torch's
                                           rule, ceil_mode included)

    forward   info   = session.agree(x)           the call's global shape and grad flags
              window = window_record(G)           plan, staging slices, output extents (once per shape)
              staged = stage_window(x, path)       local, unfused or fused (below)
              y      = _block(staged, window)      the local op, with no padding
    adjoint   the local op's; then every staging path sends each halo box's gradient home and adds
              it into the block (padding positions get none)

``P_x`` may split batch and channels too (no messages along them).  The plan is the
convolution halo plan (``geometry/pool_geometry.py`` maps ceil mode and torch's padding
rules onto it).  The agreement's flag takes a one-element round of its own: the halo
exchange runs between neighbours only, and sends nothing where the plan has no halo.

Staging paths (``last_path``)::

    local    no worker of the plan reads another's block (kernel 2, stride 2 over even blocks; an
             interpolation whose windows stay at home): a view of x, padded with ``fill`` by
             ``F.pad`` where the window leaves the domain.  No messages.
    unfused  the ``distfuse::halo_exchange`` pair (``primitives/halo_exchange.py``): one round of
             point-to-point messages, the window concatenated from its boxes.
    fused    the ``distfuse::halo_staging`` pair (``fused/halo_staging.py``): the halo conv's Triton
             kernels without the convolution: pack, one round, one staging pass; backward
             unstage, one round, accumulate.

``fill`` is 0 for average pooling and interpolation and ``-inf`` for max pooling (the
exchanges stage zeros, and a max-pooling worker then overwrites only its out-of-domain
slabs).  Where the plan has a message the layers ask ``select_path("halo_conv", ...)``: this
staging *is* the halo convolution's, whose default rule keeps the unfused exchange.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distfuse.errors import DistfuseError, UnsupportedError, expect, where
from distfuse.fused.halo_staging import halo_staging
from distfuse.fused.registry import halo_elements
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.pool_geometry import check_pool_axis, pool_axis
from distfuse.layers._conv_common import (
    AgreedLayer,
    CallInfo,
    ZeroBlock,
    call_signature,
    check_partition,
    gather_call_info,
    passes_local_checks,
    promote,
)
from distfuse.layers.dispatch import Decision, device_caps, select_path
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives.halo_exchange import PlanHalo, halo_exchange

__all__ = ["per_axis", "PoolOptions", "pool_plan", "WindowRecord", "window_record", "WindowLayer",
           "DistributedPoolBase", "plan_is_local", "window_ranges", "choose_staging", "stage_window"]


def per_axis(op: str, v, nd: int, name: str, minimum: int) -> tuple[int, ...]:
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
        kernel = per_axis(op, kernel_size, nd, "kernel_size", 1)
        stride = kernel if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else \
            per_axis(op, stride, nd, "stride", 1)
        pad = per_axis(op, padding, nd, "padding", 0)
        dil = per_axis(op, dilation, nd, "dilation", 1)
        for k, p in zip(kernel, pad, strict=True):
            if p > k // 2:
                raise UnsupportedError(f"{where(op)}: padding {pad} must be at most half the kernel size "
                                       f"{kernel} (kernel_size // 2 per axis, as torch requires)")
        return cls(nd, kernel, stride, pad, dil, bool(ceil_mode))


@functools.lru_cache(maxsize=256)
def pool_plan(spatial: tuple[int, ...], grid: tuple[int, ...], opts: PoolOptions) -> HaloPlan:
    """The halo plan of a pooling layer over ``grid`` for a global spatial shape (validated as torch would)."""
    axes = list(zip(spatial, grid, opts.kernel_size, opts.stride, opts.dilation, opts.padding, strict=True))
    for n, _, k, s, d, p in axes:
        check_pool_axis(n, k, s, d, p, opts.ceil_mode)
    return HaloPlan([pool_axis(n, g, k, s, d, p, opts.ceil_mode) for n, g, k, s, d, p in axes])


# ---------------------------------------------------------------- staging


@functools.lru_cache(maxsize=512)
def plan_is_local(plan: HaloPlan) -> bool:
    """True when no worker of ``plan`` reads another worker's block (then nobody sends anything)."""
    return all(pc.src is None or pc.src == idx for idx in plan.blocks() for pc in plan.pieces(idx))


def window_ranges(plan: HaloPlan, index: Sequence[int]) -> list[tuple[int, int]]:
    """This worker's window ``[a, b)`` per spatial axis, in global input coordinates."""
    return [ax.needed_range(i) for ax, i in zip(plan.axes, index, strict=True)]


def choose_staging(plan: HaloPlan | None, dtype: torch.dtype, device: torch.device, world_size: int,
                   elements: float, caps_cache: dict) -> Decision:
    """How a layer stages its window for one call (see the module docstring); the same on every worker.

    ``plan=None`` skips the local check (``explain`` before the global shape is known);
    ``caps_cache`` is the layer's per-device cache of :func:`~distfuse.layers.dispatch.device_caps`.
    """
    if plan is not None and plan_is_local(plan):
        return Decision("local", "no worker reads another worker's block for this geometry: no exchange")
    caps = caps_cache.get(device)
    if caps is None:
        caps = caps_cache[device] = device_caps(device)
    d = select_path("halo_conv", dict(elements=elements), dtype, world_size, caps)
    return Decision(d.path, f"halo staging (the halo_conv rule): {d.reason}", entry=d.entry)


def stage_window(x: torch.Tensor, halo: PlanHalo, rec: WindowRecord, global_shape: Sequence[int], *, path: str,
                 fill: float = 0.0, channels_last: bool = False) -> torch.Tensor:
    """This worker's window ``[B, C, *L]`` from its block ``x [B, C, *n]`` by ``path`` (see the module docstring),
    with the layer's halo context ``halo`` and this worker's ``rec``; every worker calls it with the same path.
    ``channels_last``: the format the workers agreed on (the fused staging's boxes travel in its order)."""
    if path == "local":
        view = x[(Ellipsis, *rec.slices)]
        return F.pad(view, list(rec.flat_pad), value=fill) if any(rec.flat_pad) else view
    if path == "fused":
        staged = halo_staging(x, halo.handle, list(global_shape), channels_last)
    else:
        staged = halo_exchange(x, halo.handle, list(global_shape))
    if fill != 0:  # overwrite the out-of-domain slabs in place (slabs only)
        nd = len(rec.pad_widths)
        for d, (lo, hi) in enumerate(rec.pad_widths):
            dim = staged.dim() - nd + d
            if lo:
                staged.narrow(dim, 0, lo).fill_(fill)
            if hi:
                staged.narrow(dim, staged.shape[dim] - hi, hi).fill_(fill)
    return staged


# ---------------------------------------------------------------- the window layers


@dataclass(frozen=True)
class WindowRecord:
    """One worker's geometry for one global shape: the plan, how it stages its window (``slices`` cut the local
    window from the own block; ``pad_widths``, per axis the staged positions before 0 and at or after n, which
    the window fills with ``fill``), its output block's spatial extents and the layer's ``block`` constants
    (divisors, first taps, interpolation taps).  Made once per global shape by an eager call; a compiled call
    only reads it (a plan walk would break the graph).
    """

    plan: HaloPlan
    slices: tuple[slice, ...]
    pad_widths: tuple[tuple[int, int], ...]
    out_spatial: tuple[int, ...]
    flat_pad: tuple[int, ...]  # pad_widths in F.pad's order (the last axis first), for the local path
    block: object = None


def window_record(plan: HaloPlan, index: tuple[int, ...], block=None) -> WindowRecord:
    """The :class:`WindowRecord` of worker ``index`` under ``plan``."""
    slices, widths = [], []
    for ax, i, (a, b) in zip(plan.axes, index, window_ranges(plan, index), strict=True):
        length = b - a
        lo = min(max(0 - a, 0), length)  # staged positions before 0 and at or after n (global)
        hi = min(max(b - max(a, ax.n), 0), length - lo)
        inner = length - lo - hi
        first = max(a, 0) - ax.input_range(i)[0] if inner > 0 else 0
        slices.append(slice(first, first + inner))
        widths.append((lo, hi))
    flat_pad = tuple(w for lo_hi in reversed(widths) for w in lo_hi)
    return WindowRecord(plan, tuple(slices), tuple(widths), plan.output_shape(index), flat_pad, block)


class WindowLayer(AgreedLayer, nn.Module):
    """The one forward of the layers that compute each output block from one staged window (pooling, upsampling).

    Subclasses define ``_layer_key()`` (their options and partition, compared in the
    gather), ``plan(G, dtype, device)`` (the plan for a global shape), ``_block(x, staged,
    window, info, out_shape)`` (the local op) and ``_block_constants(plan, index, G, dtype,
    device)``, what the local op reads from the geometry (the window's ``block``).
    ``last_path`` (``"local"``, ``"unfused"`` or ``"fused"``; None before the first call) and
    ``last_decision`` say how the last call staged its window, and why.
    """

    fill: float = 0.0

    def __init__(self, P_x, nd: int, static_shapes: bool):
        super().__init__()
        op = type(self).__name__
        self.P_x = P_x
        self.static_shapes = bool(static_shapes)
        self._agree_over(P_x)
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._caps_cache: dict = {}
        self._windows: dict[tuple, WindowRecord] = {}
        self._plans: dict[tuple[int, ...], HaloPlan] = {}  # the plan of the last call with each global shape
        self._halo = PlanHalo(P_x, nd, self._plans.__getitem__, op)  # names the plan in the staging ops

    def param_layouts(self) -> list:
        """No parameters (so ``load_sequential`` / ``collect_sequential`` move nothing)."""
        return []

    def explain(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> Decision:
        """How a call with ``x`` stages its window, and why (no communication; pass the global shape to
        include the local-path check)."""
        plan = self.plan(tuple(global_shape), x.dtype, x.device) if global_shape is not None else None
        # the halo_conv rule's size: the global input's elements over the workers, alike on every rank (x's own
        # block without the global shape: the same where the split is even)
        elements = halo_elements(global_shape, self.P_x.size) if global_shape is not None else float(x.numel())
        return choose_staging(plan, x.dtype, x.device, self.P_x.size, elements, self._caps_cache)

    def _agree(self, x: torch.Tensor) -> CallInfo | None:
        """The call's agreed :class:`~distfuse.layers._conv_common.CallInfo` (None: a replayed call that
        flagged).  A replayed call whose peers' input needs a gradient and its own does not flags too (an
        eager call promotes the input; a graph cannot)."""
        op, P_x = type(self).__name__, self.P_x
        return self.session.agree(x, call_signature(x, []), passes_local_checks(P_x, x),
                                  lambda: gather_call_info(op, P_x, P_x, x, [], signature=self._layer_key()),
                                  needs_eager=lambda info: info.input_grad and not x.requires_grad, deferrable=True)

    def forward(self, x: torch.Tensor):
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        if not self.P_x.active:
            check_inactive_input(type(self).__name__, x)
            return self._inactive_output(x)
        info = self._agree(x)
        if info is None:
            return self._inactive_output(x)
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed block
            x = self.session.stand_in(x).contiguous(memory_format=info.memory_format)
        G = info.global_shape
        win = self.window_record(G, x.dtype, x.device)
        x = promote(x, info.input_grad)
        self.last_decision = self.session.remember(("staging", G, x.dtype, x.device.type),
                                                   lambda: self.explain(x, G))
        self.last_path = self.last_decision.path
        staged = stage_window(x, self._halo, win, G, path=self.last_path, fill=self.fill,
                              channels_last=info.memory_format != torch.contiguous_format)
        out_shape = tuple(x.shape[:2]) + win.out_spatial
        if 0 in out_shape:
            return self._empty_output(staged, out_shape)
        return self._block(x, staged, win, info, out_shape)

    def window_record(self, global_shape: Sequence[int], dtype: torch.dtype, device) -> WindowRecord:
        """This worker's :class:`WindowRecord` for a global shape (made once per shape, dtype and device type, then
        read); the staging ops stage with its plan."""
        G = tuple(int(e) for e in global_shape)
        key = (G, dtype, device.type)
        rec = self._windows.get(key)
        if rec is None:
            plan, index = self.plan(G, dtype, device), tuple(self.P_x.index[2:])
            rec = self._windows[key] = window_record(plan, index, self._block_constants(plan, index, G, dtype, device))
        self._plans[G] = rec.plan  # the upsampling plan depends on the dtype too: the staging ops take this call's
        return rec

    def _inactive_output(self, x: torch.Tensor):
        return x.clone()

    def _empty_output(self, staged: torch.Tensor, out_shape: tuple[int, ...]):
        """An empty block that keeps ``staged`` in the graph: a worker with no outputs still runs the exchange's
        adjoint, because its peers wait for the gradients of what it sent them."""
        return ZeroBlock.apply(staged, None, out_shape)


class DistributedPoolBase(WindowLayer):
    """A pooling layer over an input split along any of its axes (see the module docstring); subclasses set
    ``nd`` and ``fill`` and define ``_block``.  Construction is not collective."""

    nd: int = 0

    def __init__(self, P_x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                 static_shapes: bool = False):
        op = type(self).__name__
        check_partition(op, "P_x", P_x, self.nd)
        super().__init__(P_x, self.nd, static_shapes)
        self.opts = o = PoolOptions.make(op, self.nd, kernel_size, stride, padding, dilation, ceil_mode)
        self.kernel_size, self.stride, self.padding = o.kernel_size, o.stride, o.padding
        self.dilation, self.ceil_mode = o.dilation, o.ceil_mode

    def _layer_key(self):
        return self.opts, self.P_x.ranks, self.P_x.shape

    def plan(self, global_shape: Sequence[int], dtype=None, device=None) -> HaloPlan:
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

    def extra_repr(self) -> str:
        o = self.opts
        return (f"P_x={list(self.P_x.shape)}, kernel_size={o.kernel_size}, stride={o.stride}, padding={o.padding}, "
                f"dilation={o.dilation}, ceil_mode={o.ceil_mode}")
