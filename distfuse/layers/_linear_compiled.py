"""The all-gather and reduce-scatter linears' forward inside ``torch.compile``: custom ops, no metadata.

Eager calls run the agreement protocol (``_linear_agreement.py``) and the dispatch, and
leave a record of the call (:func:`remember`: this worker's signature, the fused op that
ran or None, the sequence extent the op needs).  A compiled call takes the path of that record and
moves data only through the custom ops of :mod:`distfuse.ops`, so
``torch.compile(layer, fullgraph=True)`` traces one graph with no host read and no
host-side collective of its own:

* **Unfused** (the record's op is None, or no eager call yet): ``agreed_gather`` /
  ``agreed_scatter_sum`` carry the agreement flag, ``broadcast_packed`` the parameters
  along the data-parallel dimension, ``gather`` the ZeRO weight shards (its adjoint
  ``scatter_sum`` is the reduce-scatter of ``dW_m``).
* **Fused** (the eager call ran a fused op): ``distfuse::flag_check`` (the agreement
  flag, one host all-reduce on the op's group) and then the fused op itself as a custom
  op (:mod:`distfuse.ops.fused_linear`): ``all_gather_matmul``,
  ``all_gather_features_matmul``, ``matmul_reduce_scatter``,
  ``matmul_reduce_scatter_features`` or, for the ZeRO layers, ``zero_linear`` (its
  flag round spans the whole grid: the weight's group and the activations').

A call whose signature differs from the recorded one still joins the round with its
flag set, and every worker raises the same error before any data moves (the compiler
retraces on a shape change, so that call is a new graph); one eager call then agrees
afresh.  The context objects the ops need are made at trace time through
``torch._dynamo.assume_constant_result`` (a graph constant), in the same order on every
rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._linear_records import compute_dtype
from distfuse.layers.dispatch import Decision
from distfuse.ops import (
    GRAD_ANCHOR,
    NO_ANCHOR,
    FlaggedSite,
    PackedBroadcast,
    agreed_gather,
    agreed_scatter_sum,
    broadcast_packed,
    gather,
)
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.ops.fused_linear import ZeroLinearCall, make_call, run_fused

__all__ = ["compiled_all_gather_forward", "compiled_reduce_scatter_forward", "COMPILED", "remember",
           "all_gather_signature", "reduce_scatter_signature"]

COMPILED = Decision("unfused", "inside torch.compile: the unfused composition through distfuse's custom ops (the "
                               "last eager call ran unfused)")


def _compiled_fused(op: str) -> Decision:
    return Decision("fused", f"inside torch.compile: the fused op {op} as the custom op distfuse::{op} (the last "
                             "eager call ran it)")


_RECORD = "_distfuse_eager_call"


def all_gather_signature(x: torch.Tensor, seq_len: int | None) -> tuple:
    return (tuple(x.shape), x.dtype, x.device.type, compute_dtype(x), seq_len)


def reduce_scatter_signature(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, compute_dtype(x), x.device.type)


def remember(layer, signature: tuple, fused_op: str | None, y: torch.Tensor) -> None:
    """Record an eager call: its signature, the fused op that ran (None: unfused), the sequence extent it needs.

    The sequence extent ``n`` of the all-gather linear's sequence form is the output's
    (exact: the fused op sums the blocks' lengths when ``seq_len`` is not given).
    """
    n = -1
    if fused_op == "all_gather_matmul" or (fused_op == "zero_linear" and getattr(layer, "P_x", None) is not None
                                           and hasattr(layer, "keep_gathered")):
        n = int(y.shape[-2])
    layer.__dict__[_RECORD] = (signature, fused_op, n)


def _forget(layer) -> None:
    layer.__dict__.pop(_RECORD, None)
    layer.agreement.forget()


def _recorded(layer, signature) -> tuple[str | None, int, bool]:
    """``(fused op or None, the sequence extent it needs or -1, changed)`` of the last eager call; none yet:
    unfused."""
    rec = layer.__dict__.get(_RECORD)
    if rec is None:
        return None, -1, False
    return rec[1], rec[2], signature != rec[0]


@torch._dynamo.assume_constant_result
def _site_handle(layer, kind: str) -> int:
    """The handle of the layer's ``FlaggedSite`` for ``kind`` ("gather" / "scatter" / "wgather"), made on first use."""
    key = f"_distfuse_compiled_{kind}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        P_sub = {"gather": "P_gather", "scatter": "P_scatter", "wgather": "P_wgather"}[kind]
        ctx = layer.__dict__[key] = FlaggedSite(layer._op, getattr(layer, P_sub), layer.agreement)
    return ctx.handle


@torch._dynamo.assume_constant_result
def _bcast_handle(layer, attr: str) -> int:
    """The handle of a ``PackedBroadcast`` over the plan of ``layer.<attr>`` (a ``ParamBroadcast``)."""
    key = f"_distfuse_compiled{attr}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        ctx = layer.__dict__[key] = PackedBroadcast(getattr(layer, attr).plan, layer._op)
    return ctx.handle


@torch._dynamo.assume_constant_result
def _flag_handle(layer, group: str) -> int:
    """The handle of the ``FlagRound`` over ``layer.<group>`` (the fused op's group, or the layer's grid)."""
    key = f"_distfuse_compiled_flag_{group}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        ctx = layer.__dict__[key] = FlagRound(layer._op, getattr(layer, group), lambda: _forget(layer))
    return ctx.handle


@torch._dynamo.assume_constant_result
def _fused_handle(layer, op: str) -> int:
    """The handle of the layer's ``FusedCall`` of ``op``."""
    key = f"_distfuse_compiled_{op}"
    ctx = layer.__dict__.get(key)
    if ctx is None:
        if op == "zero_linear":
            columns = hasattr(layer, "keep_gathered")  # the all-gather linear
            P_m = layer.P_gather if columns else layer.P_scatter
            seq = (layer.P_x if columns else layer.P_y) is not None
            ctx = ZeroLinearCall(layer.P_wgather, P_m, "columns" if columns else "rows",
                                 "sequence" if seq else "features", layer.out_features, layer.in_features,
                                 getattr(layer, "keep_gathered", True))
        else:
            P_sub = layer.P_gather if hasattr(layer, "keep_gathered") else layer.P_scatter
            ctx = make_call(op, P_sub, getattr(layer, "keep_gathered", True))
        layer.__dict__[key] = ctx
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


def _zero_weight(layer, full_shape: list[int]) -> torch.Tensor:
    """ZeRO: ``W_m``, the shards all-gathered over the data-parallel workers (``distfuse::gather``)."""
    if layer.P_d == 1:
        return layer.weight
    return gather(layer.weight, _site_handle(layer, "wgather"), full_shape)


def _fused(layer, op: str, group: str, changed: bool, x, W, b, n) -> torch.Tensor:
    flag_check(x, _flag_handle(layer, group), changed)
    layer._record(_compiled_fused(op))
    return run_fused(op, _fused_handle(layer, op), x, W, b, n)


def compiled_all_gather_forward(layer, x: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """:class:`DistributedLinearAllGather`'s forward (and the ZeRO form's), traceable; the path of the last eager
    call."""
    layer._check_input(x, seq_len)
    signature = all_gather_signature(x, seq_len)
    op, n, changed = _recorded(layer, signature)
    if layer._zero:
        b = _broadcast(layer, "_bcast", [layer.bias] if layer._bcast.is_src else [], x)[0] if layer.use_bias \
            else None
        if op == "zero_linear":
            y = _fused(layer, op, "P_y", changed, x, layer.weight, None, n)
            return y + b.to(y.dtype) if b is not None else y
        W = _zero_weight(layer, [block_extent(layer.out_features, layer.P_m, layer.dm[1]), layer.in_features])
    else:
        got = _broadcast(layer, "_bcast", ([layer.weight] + ([layer.bias] if layer.use_bias else []))
                         if layer._bcast.is_src else [], x)
        W, b = got[0], (got[1] if layer.use_bias else None)
    if layer.P_m == 1:
        layer._record(COMPILED)
        return F.linear(x, W, b)
    if op in ("all_gather_matmul", "all_gather_features_matmul"):
        return _fused(layer, op, "P_gather", changed, x, W, b, n)
    layer._record(COMPILED)
    (layout, _), changed = _agreed_state(layer, signature)
    gathered = agreed_gather(x, _site_handle(layer, "gather"), changed, list(layout.shape))
    return F.linear(gathered, W, b)


def compiled_reduce_scatter_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """:class:`DistributedLinearReduceScatter`'s forward (and the ZeRO form's), traceable; the path of the last
    eager call."""
    signature = reduce_scatter_signature(x)
    op, n, changed = _recorded(layer, signature)
    with_bias = layer.use_bias and layer.P_y is None  # the feature form sends b_m with W_m (ZeRO: b_m alone)
    mine = ([] if layer._zero else [layer.weight]) + ([layer.bias] if with_bias else [])
    got = _broadcast(layer, "_bcast", mine if layer._bcast.is_src else [], x)
    W, rest = (None, got) if layer._zero else (got[0], got[1:])
    b = rest[0] if with_bias else None
    if layer.use_bias and layer.P_y is not None:  # the sequence form: all of b from (0, 0) to every worker
        b = _broadcast(layer, "_bcast_bias", [layer.bias] if layer._bcast_bias.is_src else [], x)[0]
    if op == "zero_linear":
        y = _fused(layer, op, "P_x", changed, x, layer.weight, None, n)
        return y + b.to(y.dtype) if b is not None else y
    if layer._zero:
        W = _zero_weight(layer, [layer.out_features, block_extent(layer.in_features, layer.P_m, layer.dm[1])])
    if layer.P_m == 1:
        layer._record(COMPILED)
        return F.linear(x, W, b)
    if op in ("matmul_reduce_scatter", "matmul_reduce_scatter_features"):
        return _fused(layer, op, "P_scatter", changed, x, W, b, n)
    layer._record(COMPILED)
    (shape, _), changed = _agreed_state(layer, signature)
    y = agreed_scatter_sum(F.linear(x, W), _site_handle(layer, "scatter"), changed, list(shape))
    return y + b.to(y.dtype) if b is not None else y
