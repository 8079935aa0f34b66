"""Misuse and steady state of the general and channel convolutions under the agreement protocol.

No data message of these layers reaches every worker of ``P_x ∪ P_w ∪ P_y`` (the
broadcasts and the sum-reduce run point to point along P_w's rows and columns), so the
agreement flag is a one-element host all-reduce on the union (the layer's
:class:`~distfuse.primitives.agreement_session.AgreementSession`).  Asserted here, on 5 ranks with
permuted partitions and every worker role (P_x + P_w, P_w + P_y, P_w only, P_y only, and a
rank outside the layer):

* while every worker's signature repeats, the metadata gather does not run
  (``agreement.slow_calls`` and a count of ``gather_call_info`` stay put);
* a legitimate change of global shape on every worker (an extent of 8 becoming 7 over two
  spatial blocks leaves one block as it was) agrees again and matches ``torch.nn`` in
  float64, forward and the input, weight and bias gradients;
* a worker that disagrees (fp32 against fp64, int64, a wrong number of dimensions, a block
  that is not the balanced one, data on a P_y-only worker) makes every worker of the union
  raise the same :class:`~distfuse.errors.ShapeError`, promptly: the world group keeps
  torch's default timeout and the layer's groups ``DISTFUSE_TIMEOUT=60``, so an error that
  waited for a timeout would take a minute.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

import distfuse.layers.conv_general as conv_general
from distfuse import zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import load_sequential
from distfuse.layers.conv import DistributedConv1d
from distfuse.testing import run_ranks
from tests.misuse_support import catch as _catch
from tests.misuse_support import patient_grid
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
PROMPT = 5.0  # seconds: far below DISTFUSE_TIMEOUT=60 (measured: tens of milliseconds, see docs/reliability.md)
_GRIDS: dict = {}


def _grid(ranks, shape):
    """A partition whose groups wait ``DISTFUSE_TIMEOUT=60`` (see ``tests.misuse_support.patient_grid``)."""
    return patient_grid(_GRIDS, ranks, shape)



def _check_call(layer, seq, P_x, P_y, xg: torch.Tensor, seed: int) -> bool:
    """One forward and backward on the blocks of ``xg``, against ``seq`` in float64 (output and every gradient)."""
    dt = xg.dtype
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].clone().requires_grad_(True) if P_x.active else \
        zero_volume_tensor(dtype=dt)
    y = layer(x)
    xr = xg.double().clone().requires_grad_(True)
    seq.zero_grad()
    ref = seq(xr)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref.backward(gy)
    if P_y.active:
        own = local_slices(ref.shape, P_y.shape, P_y.index)
        torch.testing.assert_close(y.double(), ref.detach()[own], **tol(dt))
        y.backward(gy[own].to(y.dtype))
    else:
        assert y.numel() == 0
        if y.requires_grad:  # every worker of the union runs backward (a zero-volume output here)
            y.backward(torch.zeros_like(y))
    if P_x.active:
        torch.testing.assert_close(x.grad.double(), xr.grad[local_slices(xg.shape, P_x.shape, P_x.index)], **tol(dt))
    for lay in layer.param_layouts():
        p = getattr(layer, lay.name)
        if p is not None:
            want = getattr(seq, lay.seq_name).grad[local_slices(lay.global_shape, lay.P.shape, lay.P.index)]
            torch.testing.assert_close(p.grad.double(), want, **tol(dt))
            p.grad = None
    return True


def _scenario(kind: str):
    me = dist.get_rank()
    if kind == "general":  # channels and the spatial axis split; world rank 4 holds no part of the layer
        P_x, P_w, P_y = _grid((2, 0, 3, 1), (1, 2, 2)), _grid((1, 3, 0, 2), (1, 2, 2)), _grid((3, 0), (1, 1, 2))
        c_in, c_out, mode = 3, 2, "reflect"
    else:  # channel conv: roles P_x + P_w (2, 0), P_w + P_y (1), P_w only (3), P_y only (4)
        P_x, P_w, P_y = _grid((2, 0), (1, 2, 1)), _grid((1, 3, 0, 2), (2, 2, 1)), _grid((4, 1), (1, 2, 1))
        c_in, c_out, mode = 3, 5, "circular"
    torch.manual_seed(4)
    seq = nn.Conv1d(c_in, c_out, 3, padding=1, padding_mode=mode, dtype=torch.float64)
    layer = DistributedConv1d(P_x, c_in, c_out, 3, padding=1, padding_mode=mode, P_y=P_y, P_w=P_w,
                              dtype=torch.float64)
    load_sequential(layer, seq if me == 0 else None)
    in_layer = me in layer.P_union.ranks
    site = layer.agreement if in_layer else None
    gathers = []
    real = conv_general.gather_call_info  # the general and channel convolutions' metadata gather
    conv_general.gather_call_info = lambda *a, **k: gathers.append(1) or real(*a, **k)
    g = torch.Generator().manual_seed(9)
    x8 = torch.randn(2, c_in, 8, generator=g, dtype=torch.float64)
    x7 = torch.randn(2, c_in, 7, generator=g, dtype=torch.float64)
    out = {"kind": type(layer).__name__}
    try:
        out["steady"] = all(_check_call(layer, seq, P_x, P_y, x8, s) for s in range(3))
        out["slow_steady"] = (site.calls, site.slow_calls, len(gathers)) if site else None
        out["change"] = all(_check_call(layer, seq, P_x, P_y, x7, 10 + s) for s in range(2))  # 8 -> 7
        out["slow_change"] = (site.calls, site.slow_calls, len(gathers)) if site else None
        xb = x7[local_slices(x7.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor(
            dtype=torch.float64)
        bad_x = P_x.ranks[-1]  # the last P_x worker disagrees
        empty = zero_volume_tensor(dtype=torch.float64)
        disagreements = {
            "fp32": lambda: xb.float() if me == bad_x else xb,
            "int64": lambda: xb.long() if me == bad_x else xb,  # a local check: flagged, not raised alone
            "ndim": lambda: xb[None] if me == bad_x else xb,
            "unbalanced": lambda: xb[..., :1] if me == P_x.ranks[0] else xb,
            "outside": lambda: torch.ones(2, 1, 1, dtype=torch.float64) if me == P_y.ranks[0] and not P_x.active
            else (xb if P_x.active else empty),
        }
        for name, make in disagreements.items():
            if name == "outside" and kind == "general":
                continue  # every P_y worker of the general case holds input too
            out[name] = _catch(lambda make=make: layer(make()))
            out[f"{name}_after"] = _catch(lambda: _check_call(layer, seq, P_x, P_y, x7, 20))  # agree again
        out["slow_end"] = site.slow_calls if site else None
    finally:
        conv_general.gather_call_info = real
        os.environ["DISTFUSE_TIMEOUT"] = "3"
    return out


def _check(res, kind, op, cases):
    union = [r for r in range(5) if res[r]["slow_steady"] is not None]
    for r in range(5):
        assert res[r]["kind"] == op and res[r]["steady"] and res[r]["change"], res[r]
    for r in union:
        assert res[r]["slow_steady"] == (3, 1, 1), res[r]  # three calls, one metadata gather
        assert res[r]["slow_change"] == (5, 2, 2), res[r]  # the change, also where the block repeats
        for case in cases:
            kind_, msg, secs = res[r][case]
            assert kind_ == "ShapeError", (r, case, res[r][case])
            assert f"{op} [rank {r}]" in msg, (case, msg)
            assert secs < PROMPT, (r, case, secs)
            assert res[r][f"{case}_after"] == ("ok", True), (r, case, res[r][f"{case}_after"])
        assert "non-floating" in res[r]["int64"][1] and "balanced decomposition" in res[r]["unbalanced"][1]
        assert res[r]["slow_end"] == 2 + 2 * len(cases), res[r]  # each error and the call after it gather
    for r in set(range(5)) - set(union):
        assert all(res[r][case][0] == "ok" for case in cases), res[r]  # outside the layer: nothing to agree on


def test_general_conv_gathers_only_on_change_and_raises_everywhere():
    res = run_ranks(5, _scenario, "general", pg_timeout=PG_DEFAULT, timeout=120)
    _check(res, "general", "DistributedGeneralConv1d", ("fp32", "int64", "ndim", "unbalanced"))
    assert res[4]["slow_steady"] is None  # rank 4 holds no part of the general conv


def test_channel_conv_gathers_only_on_change_and_raises_everywhere():
    res = run_ranks(5, _scenario, "channel", pg_timeout=PG_DEFAULT, timeout=120)
    _check(res, "channel", "DistributedChannelConv1d", ("fp32", "int64", "ndim", "unbalanced", "outside"))
    assert "must pass a zero-volume tensor" in res[0]["outside"][1]
