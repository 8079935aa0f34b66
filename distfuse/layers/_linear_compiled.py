"""The sequence- and feature-parallel linears' forward inside ``torch.compile``: custom ops, no metadata.

Eager calls run the agreement protocol (``_linear_agreement.py``); a compiled call reuses
the agreed record while its signature repeats and moves data only through the custom
ops of :mod:`distfuse.ops` (``agreed_gather`` / ``agreed_scatter_sum`` carry the flag,
``broadcast_packed`` the parameters), so ``torch.compile(layer, fullgraph=True)`` traces
one graph with no host read and no host-side collective.  A call whose signature
differs from the agreed one still joins the collective with its flag set, and every
worker raises the same error (the compiler retraces on a shape change, so that call is
a new graph).

Served: the non-ZeRO layers on their unfused composition.  The fused GEMM + collective
paths are not custom ops yet, so a compiled call takes the unfused composition (the
reason is in ``last_decision``); every worker compiles the same, so the messages match.
The context objects the ops need are made at trace time through
``torch._dynamo.assume_constant_result`` (a graph constant), in the same order on every
rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, where
from distfuse.layers._linear_agreement import compute_dtype
from distfuse.layers.dispatch import Decision
from distfuse.ops import (
    GRAD_ANCHOR,
    NO_ANCHOR,
    FlaggedSite,
    PackedBroadcast,
    agreed_gather,
    agreed_scatter_sum,
    broadcast_packed,
)

__all__ = ["compiled_all_gather_forward", "compiled_reduce_scatter_forward", "COMPILED"]

COMPILED = Decision("unfused", "inside torch.compile: the unfused composition through distfuse's custom ops (the "
                               "fused GEMM + collective ops are not custom ops yet)")


@torch._dynamo.assume_constant_result
def _site_handle(layer, kind: str) -> int:
    """The handle of the layer's ``FlaggedSite`` for ``kind`` ("gather" / "scatter"), made on first use."""
    key = f"_distfuse_compiled_{kind}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        P_sub = layer.P_gather if kind == "gather" else layer.P_scatter
        ctx = layer.__dict__[key] = FlaggedSite(layer._op, P_sub, layer.agreement)
    return ctx.handle


@torch._dynamo.assume_constant_result
def _bcast_handle(layer, attr: str) -> int:
    """The handle of a ``PackedBroadcast`` over the plan of ``layer.<attr>`` (a ``ParamBroadcast``)."""
    key = f"_distfuse_compiled{attr}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        ctx = layer.__dict__[key] = PackedBroadcast(getattr(layer, attr).plan, layer._op)
    return ctx.handle


def _agreed_state(layer, signature):
    site = getattr(layer, "agreement", None)
    if site is None or site.state is None:
        raise UnsupportedError(f"{where(layer._op)}: a compiled call needs the metadata the layer agrees on in eager "
                               "mode: call the layer once eagerly (every worker, same shapes) before the compiled "
                               "region")
    return site.state, signature != site.signature


def _broadcast(layer, attr: str, mine, x: torch.Tensor) -> list[torch.Tensor]:
    """``layer.<attr>(mine, ...)`` (a ``ParamBroadcast``) through ``distfuse::broadcast_packed``.

    A receiver's placeholder is an empty view of the input ``x``, never a graph constant:
    inductor folds ops whose inputs are all constants at compile time, which would run the
    broadcast on the receivers alone (see ``distfuse/ops/root_broadcast.py``).
    """
    bc = getattr(layer, attr)
    if bc.plan.identity or not bc.shapes:
        return list(mine)
    if bc.is_src:
        flat = torch.cat([t.reshape(-1) for t in mine]).view(1, -1)
    else:
        flat = x.detach().reshape(-1)[:0].to(layer._param_dtype())
    anchor = GRAD_ANCHOR if torch.is_grad_enabled() else NO_ANCHOR
    out = broadcast_packed(flat, anchor, _bcast_handle(layer, attr), sum(bc.sizes))
    return [p.view(s) for p, s in zip(out.view(-1).split(bc.sizes), bc.shapes, strict=True)]


def _refuse_zero(layer) -> None:
    if layer._zero:
        raise UnsupportedError(f"{where(layer._op)}: the ZeRO form does not run inside torch.compile yet (its weight "
                               "all-gather is not a custom op); compile the plain layer or call this one eagerly")


def compiled_all_gather_forward(layer, x: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """``F.linear(agreed_gather(x), W_m, b_m)``: :class:`DistributedLinearAllGather`'s unfused forward, traceable."""
    _refuse_zero(layer)
    layer._check_input(x, seq_len)
    got = _broadcast(layer, "_bcast", ([layer.weight] + ([layer.bias] if layer.use_bias else []))
                     if layer._bcast.is_src else [], x)
    W, b = got[0], (got[1] if layer.use_bias else None)
    layer._record(COMPILED)
    if layer.P_m == 1:
        return F.linear(x, W, b)
    (layout, _), changed = _agreed_state(layer, (tuple(x.shape), x.dtype, x.device.type, compute_dtype(x), seq_len))
    gathered = agreed_gather(x, _site_handle(layer, "gather"), changed, list(layout.shape))
    return F.linear(gathered, W, b)


def compiled_reduce_scatter_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """``agreed_scatter_sum(x @ W_m.T) + b``: :class:`DistributedLinearReduceScatter`'s unfused forward."""
    _refuse_zero(layer)
    with_bias = layer.use_bias and layer.P_y is None  # the feature form sends b_m with W_m
    got = _broadcast(layer, "_bcast", ([layer.weight] + ([layer.bias] if with_bias else []))
                     if layer._bcast.is_src else [], x)
    W, b = got[0], (got[1] if with_bias else None)
    if layer.use_bias and layer.P_y is not None:  # the sequence form: all of b from (0, 0) to every worker
        b = _broadcast(layer, "_bcast_bias", [layer.bias] if layer._bcast_bias.is_src else [], x)[0]
    layer._record(COMPILED)
    if layer.P_m == 1:
        return F.linear(x, W, b)
    (shape, _), changed = _agreed_state(layer, (tuple(x.shape), x.dtype, compute_dtype(x), x.device.type))
    y = agreed_scatter_sum(F.linear(x, W), _site_handle(layer, "scatter"), changed, list(shape))
    return y + b.to(y.dtype) if b is not None else y
