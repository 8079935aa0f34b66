"""Window staging shared by the pooling and upsampling layers: local, unfused (halo exchange) or fused (Triton).

A pooling or interpolation worker computes its output block from one window of the
global input, ``[a_d, b_d)`` per spatial axis (``plan.axes[d].needed_range(i)``), which
may reach into its neighbours' blocks (a halo) and past the domain (padding).  Staging
writes that window into one tensor; the local op then runs on it with no padding::

    x       [B, C, *n]     this worker's block (balanced decomposition)
    staged  [B, C, *L]     L_d = b_d - a_d: the window, neighbours' halos included;
                           positions outside the domain hold ``fill``

    local    no worker of the plan reads another's block (kernel 2, stride 2 over even
             blocks; an interpolation whose windows stay at home): a view of x, padded
             with ``fill`` by ``F.pad`` where the window leaves the domain.  No messages.
    unfused  the ``distfuse::halo_exchange`` pair (``primitives/halo_exchange.py``): one
             round of point-to-point messages, the window written once box by box.
    fused    the ``distfuse::halo_staging`` pair (``fused/halo_staging.py``): the halo
             conv's Triton kernels without the convolution: pack, one round, one staging
             pass; backward unstage, one round, accumulate.

    adjoint  every path's backward sends each halo box's gradient home and adds it into
             the block; padding positions get none.

Both exchanges are op pairs, called the same way in every mode (the custom op inside
``torch.compile``, the same implementations through an ``autograd.Function`` in eager
calls), so a compiled call stages exactly as an eager one, fused included.

``fill`` is 0 for average pooling and interpolation and ``-inf`` for max pooling.  The
fused and unfused exchanges stage zeros, so a max-pooling worker then overwrites its
out-of-domain slabs in place (only the padding, never a full pass).

Path choice.  The local path is taken whenever the plan has no message, on every
worker alike (the plan is the same everywhere).  Otherwise the layers ask
``select_path("halo_conv", ...)``: this staging *is* the halo convolution's staging, and
its default rule says the fused staging has not beaten the unfused one on a GPU yet
(``distfuse/fused/registry.py``), so the unfused exchange runs unless a crossover
table or ``DISTFUSE_PATH=fused`` says otherwise.  On CPU the production path is unfused.
An eager call chooses; a compiled call takes the choice of the last eager call with the
same global shape, dtype and device (the crossover is not re-read inside a graph).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distfuse.fused.halo_staging import halo_staging
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.layers.dispatch import Decision, device_caps, select_path
from distfuse.primitives.halo_exchange import PlanHalo, halo_exchange

__all__ = ["STAGING_PATHS", "plan_is_local", "stage_window", "fused_staging_available",
           "choose_staging", "EmptyBlock", "window_ranges", "StagingRecord", "staging_record", "stage_local",
           "fill_padding_"]

STAGING_PATHS = ("local", "unfused", "fused")


@functools.lru_cache(maxsize=512)
def plan_is_local(plan: HaloPlan) -> bool:
    """True when no worker of ``plan`` reads another worker's block (then nobody sends anything)."""
    return all(pc.src is None or pc.src == idx for idx in plan.blocks() for pc in plan.pieces(idx))


def window_ranges(plan: HaloPlan, index: Sequence[int]) -> list[tuple[int, int]]:
    """This worker's window ``[a, b)`` per spatial axis, in global input coordinates."""
    return [ax.needed_range(i) for ax, i in zip(plan.axes, index, strict=True)]


@functools.cache
def fused_staging_available() -> bool:
    """Whether the Triton halo kernels import (they load Triton)."""
    try:
        import distfuse.fused.halo_conv  # noqa: F401
    except ImportError:
        return False
    return True


def choose_staging(plan: HaloPlan | None, dtype: torch.dtype, device: torch.device, world_size: int, channels: int,
                   caps_cache: dict) -> Decision:
    """How a layer stages its window for one call (see the module docstring); pure given the environment.

    ``plan=None`` skips the local check (a layer's ``explain`` before it knows the global
    shape).  ``caps_cache`` is the layer's per-device cache of
    :func:`~distfuse.layers.dispatch.device_caps` (it asks CUDA for the device name).
    Every input is the same on every worker, so every worker takes the same path.
    """
    if plan is not None and plan_is_local(plan):
        return Decision("local", "no worker reads another worker's block for this geometry: no exchange")
    if not fused_staging_available():
        return Decision("unfused", "the Triton halo kernels are not available")
    caps = caps_cache.get(device)
    if caps is None:
        caps = caps_cache[device] = device_caps(device)
    d = select_path("halo_conv", dict(channels=max(int(channels), 1)), dtype, world_size, caps)
    return Decision(d.path, f"halo staging (the halo_conv rule): {d.reason}", entry=d.entry)


class EmptyBlock(torch.autograd.Function):
    """An empty output block that keeps ``staged`` in the graph (its gradient is zero).

    A worker with no outputs still runs the exchange's adjoint, because its peers send
    it nothing but wait for the gradients of what it sent them.
    """

    @staticmethod
    def forward(ctx, staged, shape):
        ctx.meta = (staged.shape, staged.dtype, staged.device)
        return staged.new_empty(shape)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return torch.zeros(shape, dtype=dtype, device=device), None


def _padding_widths(plan: HaloPlan, index: Sequence[int]) -> list[tuple[int, int]]:
    """Per axis, how many staged positions lie before 0 and at or after n (global)."""
    out = []
    for ax, (a, b) in zip(plan.axes, window_ranges(plan, index), strict=True):
        length = b - a
        lo = min(max(0 - a, 0), length)
        hi = min(max(b - max(a, ax.n), 0), length - lo)
        out.append((lo, hi))
    return out


@dataclass(frozen=True)
class StagingRecord:
    """How one worker stages its window under one plan, as plain numbers (no plan walk at call time).

    ``local``: the plan has no message (:func:`plan_is_local`).  ``slices`` and
    ``flat_pad`` (``F.pad`` order, last axis first) give the local window from the own
    block; ``pad_widths`` per axis the staged positions before 0 and at or after n, which
    the exchanged window fills with ``fill``.  Made once per plan and worker; a call reads
    only this record (a walk over the plan inside ``torch.compile`` would break the graph).
    """

    local: bool
    slices: tuple[slice, ...]
    flat_pad: tuple[int, ...]
    pad_widths: tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=1024)
def staging_record(plan: HaloPlan, index: tuple[int, ...]) -> StagingRecord:
    """The :class:`StagingRecord` of worker ``index`` under ``plan``."""
    widths = _padding_widths(plan, index)
    slices, flat_pad = [], []
    for ax, i, (a, b), (lo, hi) in zip(plan.axes, index, window_ranges(plan, index), widths, strict=True):
        start = ax.input_range(i)[0]
        inner = (b - a) - lo - hi
        first = max(a, 0) - start if inner > 0 else 0
        slices.append(slice(first, first + inner))
        flat_pad = [lo, hi] + flat_pad  # F.pad lists the last axis first
    return StagingRecord(plan_is_local(plan), tuple(slices), tuple(flat_pad), tuple(widths))


def stage_local(x: torch.Tensor, rec: StagingRecord, fill: float) -> torch.Tensor:
    """The window from this worker's own block: a view, padded with ``fill`` where it leaves the domain."""
    view = x[(Ellipsis, *rec.slices)]
    return F.pad(view, list(rec.flat_pad), value=fill) if any(rec.flat_pad) else view


def fill_padding_(staged: torch.Tensor, rec: StagingRecord, fill: float) -> torch.Tensor:
    """Overwrite the out-of-domain slabs of an exchanged window with ``fill`` (in place, slabs only)."""
    nd = len(rec.pad_widths)
    for d, (lo, hi) in enumerate(rec.pad_widths):
        dim = staged.dim() - nd + d
        if lo:
            staged.narrow(dim, 0, lo).fill_(fill)
        if hi:
            staged.narrow(dim, staged.shape[dim] - hi, hi).fill_(fill)
    return staged


def stage_window(x: torch.Tensor, halo: PlanHalo, rec: StagingRecord, global_shape: Sequence[int], *, path: str,
                 fill: float = 0.0) -> torch.Tensor:
    """This worker's window ``[B, C, *L]`` by ``path`` (see the module docstring); the same call in every mode.

    Args:
        x: ``[B, C, *n]``, this worker's block.
        halo: the layer's halo context (its plan per global shape), named in the ops by handle.
        rec: this worker's :class:`StagingRecord` under the plan.
        path: ``"local"`` (only valid when :func:`plan_is_local`), ``"unfused"`` or ``"fused"``.
        fill: the value of out-of-domain positions (0 or ``-inf``).

    Every worker of the spatial grid must call it with the same path, outputs or not.
    """
    if path == "local":
        return stage_local(x, rec, fill)
    stage = halo_staging if path == "fused" else halo_exchange
    staged = stage(x, halo.handle, list(global_shape))
    return fill_padding_(staged, rec, fill) if fill != 0 else staged
