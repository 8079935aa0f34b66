"""Pooling and upsampling inside ``torch.compile``: the agreed record, a flag op, the halo op; no host read.

Eager calls of these layers agree on the call's metadata
(:class:`~distfuse.layers._pool_common.ShapeRecord`: a metadata gather on the first call
and after a change, a one-element host all-reduce of the workers' flags while the
signatures repeat).  A compiled call cannot run a host collective, so it:

1. reuses the record agreed in the last eager call, and refuses (on every worker: all of
   them are fresh alike) a compiled call before any eager call;
2. computes its own flag at trace time: set when its signature (local shape, dtype,
   device, grad mode, ``requires_grad``, autocast) differs from the agreed one, or when a
   peer's input requires grad and its own does not (eager promotes it; a graph cannot,
   and the worker would skip the adjoint its peers wait for).  The compiler guards on
   the signature, so a changed call retraces and bakes in the new flag;
3. runs the flag round as ``distfuse::flag_check`` (an ordered custom op, the same
   all-reduce as eager): when any flag is set every worker raises the same
   :class:`~distfuse.errors.ShapeError` after the round, and forgets the record;
4. stages its window with ``distfuse::halo_exchange`` over the layer's plan (a
   :class:`WindowHalo` names the plan in the graph), or locally where the plan has no
   message, exactly as eager does.  The fused staging is not a custom op: a compiled
   call stages unfused (``last_path`` says so).

So every worker's graph holds the same communication ops in the same order:
``flag_check`` then, where the plan exchanges anything, ``halo_exchange`` (its adjoint in
backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.layers._conv_call_info import _DTYPES, CallInfo
from distfuse.layers.pool_staging import StagingRecord, fill_padding_, stage_local, world_of_fn
from distfuse.ops import FlagRound, flag_check, halo_exchange
from distfuse.primitives._handles import new_handle

__all__ = ["WindowHalo", "compiled_record", "compiled_stage"]


class WindowHalo:
    """The object behind ``distfuse::halo_exchange``'s handle for a layer whose plan is not a convolution's.

    It answers what the op asks of :class:`~distfuse.primitives.halo_exchange.HaloExchange`:
    ``P_x``, ``nd``, ``plan(global_shape)``, ``world_of_fn()`` and ``_op``.  ``plan_of``
    maps a global shape to the layer's plan (its window geometry).
    """

    def __init__(self, P_x, nd: int, plan_of: Callable[[tuple[int, ...]], HaloPlan], op: str):
        self.P_x, self.nd, self._plan_of, self._op = P_x, nd, plan_of, op
        self.handle = new_handle(self)

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        return self._plan_of(tuple(int(n) for n in global_shape))

    def world_of_fn(self):
        return world_of_fn(self.P_x, self.nd)


def compiled_record(op: str, layer, x: torch.Tensor, flag: FlagRound) -> CallInfo | None:
    """Inside a compiled region: the agreed record after the flag round (None when this worker flagged).

    ``layer._shapes`` is the layer's :class:`~distfuse.layers._pool_common.ShapeRecord`.
    When some worker flagged, ``distfuse::flag_check`` raises on every worker at run time,
    so nothing after it runs; a worker that flagged itself gets None at trace time and
    traces no further.
    """
    site = layer._shapes.site
    info = site.state
    if info is None:
        raise UnsupportedError(f"{where(op)}: a compiled call needs the metadata the layer agrees on in eager mode: "
                               "call the layer once eagerly (every worker, same shapes and grad settings) before the "
                               "compiled region")
    P_x = layer.P_x
    locally_ok = x.device.type == P_x.device.type and x.dtype in _DTYPES and x.dim() == P_x.dim
    changed = (not locally_ok or layer._shapes._signature(x) != site.signature
               or (info.input_grad and not x.requires_grad))
    flag_check(x, flag.handle, changed)
    return None if changed else info


def compiled_stage(x: torch.Tensor, rec: StagingRecord, halo: WindowHalo, global_shape,
                   fill: float) -> tuple[torch.Tensor, str]:
    """``(staged, path)``: the window as :func:`~distfuse.layers.pool_staging.stage_window` stages it, through
    ``distfuse::halo_exchange`` where the plan has messages (``"unfused"``), else locally (``"local"``)."""
    if rec.local:
        return stage_local(x, rec, fill), "local"
    staged = halo_exchange(x, halo.handle, [int(n) for n in global_shape])
    return (fill_padding_(staged, rec, fill) if fill != 0 else staged), "unfused"
