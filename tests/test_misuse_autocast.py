"""Autocast parity with torch.nn: what ``torch.autocast("cpu", dtype=torch.bfloat16)`` accepts and returns.

* Two feature convolutions in a row: the second one's input is bf16 and its weight fp32,
  which ``torch.nn.Conv2d`` accepts under autocast (it used to raise).  Outputs are bf16
  as torch's, the values and the (fp32) parameter and input gradients match torch's
  autocast run on the gathered tensors within the bf16 norm tolerance.
* The channel convolution and the three linears return torch's dtype (the reduce-scatter
  linear used to return fp32 where ``torch.nn.Linear`` returns bf16).
* Ranks that disagree on autocast raise the same ShapeError on every rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import (
    DistributedConv1d,
    DistributedConv2d,
    DistributedLinear,
    DistributedLinearAllGather,
    DistributedLinearReduceScatter,
    load_sequential,
)
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.tolerances import assert_rel_close

PG_DEFAULT = default_pg_timeout.total_seconds()
BF16 = torch.bfloat16
_GRIDS: dict = {}


def _grid(ranks, shape):
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


def _autocast():
    return torch.autocast("cpu", dtype=BF16)


def _block(t, P):
    return t[local_slices(t.shape, P.shape, P.index)] if P.active else zero_volume_tensor()


def _two_convs():
    me = dist.get_rank()
    P = _grid((2, 0, 3, 1), (1, 1, 2, 2))
    c1, c2 = (DistributedConv2d(P, 3, 4, 3, padding=1), DistributedConv2d(P, 4, 2, 3, padding=1,
                                                                          padding_mode="circular"))
    torch.manual_seed(0)  # every rank checks its block against its own copy of the same sequential model
    s1, s2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1, padding_mode="circular")
    for layer, seq in ((c1, s1), (c2, s2)):
        load_sequential(layer, seq if me == 0 else None)
    X = torch.randn(2, 3, 7, 6, generator=torch.Generator().manual_seed(1))
    x = _block(X, P).requires_grad_(True)
    with _autocast():
        y1 = c1(x)
        y2 = c2(y1)  # bf16 input, fp32 weight: torch accepts this under autocast
    y2.float().square().sum().backward()
    Xr = X.clone().requires_grad_(True)
    with _autocast():
        ref = s2(s1(Xr))
    ref.float().square().sum().backward()
    out = {"dtypes": (y1.dtype, y2.dtype, ref.dtype)}
    assert_rel_close(y2, ref[local_slices(ref.shape, P.shape, P.index)], BF16, "output")
    assert_rel_close(x.grad, Xr.grad[local_slices(X.shape, P.shape, P.index)], BF16, "input gradient")
    for layer, seq in ((c1, s1), (c2, s2)):
        for lay in layer.param_layouts():
            g = collect_tensor(getattr(layer, lay.name).grad if lay.P.active else None, lay.P)
            if me == 0:
                assert g.dtype == torch.float32
                assert_rel_close(g, getattr(seq, lay.seq_name).grad, BF16, lay.seq_name)
    # every rank must agree on autocast: one rank outside it is refused on every rank
    try:
        if me == 1:
            c1(x)
        else:
            with _autocast():
                c1(x)
        out["mixed"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out["mixed"] = (type(exc).__name__, str(exc))
    return out


def test_stacked_feature_convs_under_autocast_match_torch():
    for r, out in enumerate(run_ranks(4, _two_convs, pg_timeout=PG_DEFAULT, timeout=90)):
        assert out["dtypes"] == (BF16, BF16, BF16)
        kind, msg = out["mixed"]
        assert kind == "ShapeError" and f"DistributedFeatureConv2d [rank {r}]" in msg and "autocast" in msg, msg


def _output_dtypes():
    me = dist.get_rank()
    P = _grid((0, 1, 2, 3), (2, 2))
    Pc = _grid((1, 3), (1, 2, 1))
    # The sequential layers are built from a seed of their own: every rank checks its block against its own copy
    # of the model rank 0 loads, whatever random numbers earlier work in this process drew.
    layers = {
        "reduce_scatter": (DistributedLinearReduceScatter(P, 6, 4), lambda: nn.Linear(6, 4), (5, 6), P, P),
        "all_gather": (DistributedLinearAllGather(P, 6, 4), lambda: nn.Linear(6, 4), (5, 6), P, P),
        "general": (DistributedLinear(_grid((0, 1), (1, 2)), _grid((2, 3), (1, 2)), P, 6, 4),
                    lambda: nn.Linear(6, 4), (5, 6), _grid((0, 1), (1, 2)), _grid((2, 3), (1, 2))),
        "channel_conv": (DistributedConv1d(Pc, 4, 2, 3, padding=1, P_y=_grid((3,), (1, 1, 1)),
                                           P_w=_grid((1, 3), (1, 2, 1))), lambda: nn.Conv1d(4, 2, 3, padding=1),
                         (2, 4, 5), Pc, _grid((3,), (1, 1, 1))),
    }
    out = {}
    for seed, (name, (layer, make_seq, shape, P_in, P_out)) in enumerate(layers.items()):
        torch.manual_seed(20 + seed)
        seq = make_seq()
        load_sequential(layer, seq if me == 0 else None)
        X = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))
        with _autocast():
            y = layer(_block(X, P_in))
            ref = seq(X)
        if P_out.active:
            assert_rel_close(y, ref[local_slices(ref.shape, P_out.shape, P_out.index)], BF16, name)
            out[name] = (y.dtype, ref.dtype)
    return out


def test_linears_and_channel_conv_return_torch_dtypes_under_autocast():
    res = run_ranks(4, _output_dtypes, pg_timeout=PG_DEFAULT, timeout=90)
    seen = set()
    for out in res:
        for name, (got, want) in out.items():
            assert got == want == BF16, (name, got, want)
            seen.add(name)
    assert seen == {"reduce_scatter", "all_gather", "general", "channel_conv"}
