"""``DistributedLinear``'s forward inside ``torch.compile``: custom ops, no metadata exchange.

Eager calls learn the input's leading extents and dtype (the agreement record over the
union of the partitions: a flag round while inputs repeat, a record gather on a change)
and record them with the path they took (:func:`remember_general`).  A compiled call reuses that record::

    distfuse::flag_check(x, h_all, changed)           every worker's flag over P_x + P_y + P_w (one host
                                                      all-reduce); raises everywhere if any call changed
    xb = distfuse::plan_copy(x2, anchor, h_x, ...)    x_j down the columns of P_w     [rows, in_j]
    p  = F.linear(xb, W_ij, b_i where j = 0)          or, on the fused path, distfuse::matmul_all_reduce
    y  = distfuse::plan_sum(p, anchor, h_y, ...)      along the rows of P_w onto P_y  [rows, out_i]

The flag round is the only way a worker that holds no input can learn that the
others' inputs changed (no collective of this layer reaches every worker), so it runs
before any data moves: a changed call (the compiler retraces it) raises the same
:class:`~distfuse.errors.ShapeError` on every worker, and one eager call then agrees
afresh.  A call before any eager call is refused with
:class:`~distfuse.errors.UnsupportedError` on every worker (the record is missing on all
of them alike).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._linear_records import compute_dtype, compute_dtype_of
from distfuse.layers.dispatch import Decision
from distfuse.ops import GRAD_ANCHOR, NO_ANCHOR, PackedBroadcast
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.ops.fused_linear import make_call, run_fused
from distfuse.ops.plan_blocks import plan_copy, plan_sum

__all__ = ["compiled_general_forward", "remember_general", "general_signature"]

_RECORD = "_distfuse_eager_call"
_UNFUSED = Decision("unfused", "inside torch.compile: the input broadcast, local GEMM and sum-reduce through "
                               "distfuse's custom ops (the last eager call ran unfused)")
_FUSED = Decision("fused", "inside torch.compile: the fused op matmul_all_reduce as the custom op "
                           "distfuse::matmul_all_reduce (the last eager call ran it)")


def general_signature(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, x.device.type, compute_dtype(x))


def remember_general(layer, signature: tuple, lead: tuple, dtype: torch.dtype, fused: bool) -> None:
    """Record an eager call: this worker's signature, the agreed leading extents and dtype, the path."""
    layer.__dict__[_RECORD] = (signature, tuple(int(n) for n in lead), dtype, bool(fused))


def _forget(layer) -> None:
    layer.__dict__.pop(_RECORD, None)
    layer.agreement.forget()


@torch._dynamo.assume_constant_result
def _handle(layer, kind: str) -> int:
    """The handle of the context ``kind`` names: "flag", "plan_x", "plan_y" or "fused"; made on first use."""
    key = f"_distfuse_compiled_{kind}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        if kind == "flag":
            ctx = FlagRound(layer._op, layer.P_all, lambda: _forget(layer))
        elif kind == "fused":
            ctx = make_call("matmul_all_reduce", layer.P_row)
        else:
            ctx = PackedBroadcast(getattr(layer, f"_{kind}"), layer._op)
        layer.__dict__[key] = ctx
    return ctx.handle


def compiled_general_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """:class:`~distfuse.layers.DistributedLinear`'s forward on an active worker, traceable (see the module doc)."""
    rec = layer.__dict__.get(_RECORD)
    if rec is None:
        raise UnsupportedError(f"{where(layer._op)}: a compiled call needs the shapes the layer learns in eager "
                               "mode: call the layer once eagerly (every worker, same shapes) before the compiled "
                               "region")
    signature, lead, dtype, fused = rec
    flag_check(x, _handle(layer, "flag"), general_signature(x) != signature)
    rows = math.prod(lead)
    in_w, in_y = layer.P_weight.active, layer.P_y.active
    i, j = layer.P_weight.index if in_w else (-1, -1)
    anchor = GRAD_ANCHOR if torch.is_grad_enabled() else NO_ANCHOR
    empty = x.detach().reshape(-1)[:0]  # a placeholder that is no graph constant (see _linear_compiled._broadcast)
    if layer.P_x.active and general_signature(x) == signature:
        x2 = x.reshape(rows, x.shape[-1])
    elif layer.P_x.active:  # a changed call: the flag round above raises before this is sent
        x2 = empty.new_zeros((rows, layer._in_block(layer.P_x.index[-1])), dtype=dtype)
    else:
        x2 = empty.to(dtype)
    xb = plan_copy(x2, anchor, _handle(layer, "plan_x"), [rows, layer._in_block(j)] if in_w else [0])
    layer._record(_FUSED if in_w and fused else _UNFUSED)
    if in_w and fused:
        y_row = run_fused("matmul_all_reduce", _handle(layer, "fused"), xb, layer.weight,
                          layer.bias if j == 0 else None)
        return y_row.reshape(*lead, y_row.shape[-1]) if in_y else y_row.reshape(-1)[:0]
    p = F.linear(xb, layer.weight, layer.bias if j == 0 else None) if in_w else xb
    out_i = block_extent(layer.out_features, layer.P_fo, layer.P_y.index[-1]) if in_y else 0
    y_dtype = compute_dtype_of(dtype, layer._param_device())
    if not in_w:
        p = p.to(y_dtype)
    y = plan_sum(p, anchor, _handle(layer, "plan_y"), [rows, out_i] if in_y else [0])
    return y.reshape(*lead, out_i) if in_y else y
