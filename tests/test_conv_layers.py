"""Distributed convolutions: the selector, parameters (init, state_dict round trips), errors, adjoints.

Parity with the sequential layers is in test_conv_feature.py and test_conv_channel_general.py.
"""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse import PartitionError, ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.conv import DistributedConv1d, DistributedConv2d, select_conv
from distfuse.layers.conv_feature import DistributedFeatureConv1d, DistributedFeatureConv2d
from distfuse.layers.conv_general import DistributedChannelConv1d, DistributedGeneralConv1d, DistributedGeneralConv2d
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import adjoint_check, run_ranks
from tests.test_conv_support import grid
from tests.tolerances import ADJOINT_RTOL, tol

# Three 2-D layouts on 4 ranks, one per implementation: (P_x, P_y, P_w) as (grid, ranks) or None.
LAYOUTS = {
    "feature": (((1, 1, 2, 2), range(4)), None, None),
    "channel": (((1, 2, 1, 1), (2, 3)), ((1, 2, 1, 1), (0, 1)), ((2, 2, 1, 1), range(4))),
    "general": (((1, 2, 1, 2), range(4)), ((1, 1, 1, 2), (1, 0)), ((1, 2, 1, 2), range(4))),
}


def _typical(t: torch.Tensor) -> float:
    """The root mean square of a reference: the size of its partial sums (random-sign terms)."""
    return float(t.double().pow(2).mean().sqrt())


def _partitions(kind):
    return [grid(spec[1], spec[0]) if spec is not None else None for spec in LAYOUTS[kind]]


def _layer2d(kind, **kw):
    P_x, P_y, P_w = _partitions(kind)
    args = dict(stride=1, padding=1, bias=True)
    args.update(kw)
    return DistributedConv2d(P_x, 4, 6, 3, P_y=P_y, P_w=P_w, **args)


# ------------------------------------------------------------------ selector


def _selected_types():
    out = {}
    for kind in LAYOUTS:
        layer = _layer2d(kind)
        out[kind] = (type(layer).__name__, isinstance(layer, DistributedConv2d), isinstance(layer, DistributedConv1d))
    return out


def test_selector_picks_the_implementation():
    for seen in run_ranks(4, _selected_types):
        assert seen == {"feature": ("DistributedFeatureConv2d", True, False),
                        "channel": ("DistributedChannelConv2d", True, False),
                        "general": ("DistributedGeneralConv2d", True, False)}


def _bad_partitions():
    """Every rank raises the same error before any collective, so the world stays usable."""
    msgs = {}
    P4 = grid(range(4), (1, 2, 2))
    P_w = grid(range(4), (1, 2, 2))
    P_y = grid((0, 1), (1, 1, 2))
    checks = {
        "feature-channel-split": lambda: DistributedConv1d(P4, 2, 2, 3),
        "w-without-y": lambda: DistributedConv1d(P4, 2, 2, 3, P_w=P_w),
        "y-without-w": lambda: DistributedConv1d(grid(range(2), (1, 1, 2)), 2, 2, 3, P_y=grid((2, 3), (1, 1, 2))),
        "general-pw-mismatch": lambda: DistributedGeneralConv1d(P4, 2, 2, 3, P_y=P_y, P_w=grid(range(4), (2, 1, 2))),
        "general-batch-split": lambda: DistributedGeneralConv1d(grid(range(4), (2, 1, 2)), 2, 2, 3, P_y=P_y,
                                                                P_w=grid(range(2), (1, 1, 2))),
        "channel-spatial-split": lambda: DistributedChannelConv1d(P4, 2, 2, 3, P_y=P_y, P_w=P_w),
        "groups-split-channels": lambda: DistributedGeneralConv1d(P4, 4, 4, 3, groups=2, P_y=P_y, P_w=P_w),
        "groups-not-dividing": lambda: DistributedFeatureConv1d(grid(range(4), (1, 1, 4)), 3, 4, 3, groups=2),
        "same-with-stride": lambda: DistributedFeatureConv1d(grid(range(4), (1, 1, 4)), 2, 2, 3, stride=2,
                                                             padding="same"),
        "bad-padding-mode": lambda: DistributedFeatureConv1d(grid(range(4), (1, 1, 4)), 2, 2, 3, padding_mode="mirror"),
        "partition-dims": lambda: DistributedFeatureConv2d(grid(range(4), (1, 1, 4)), 2, 2, 3),
        "not-a-partition": lambda: DistributedFeatureConv1d(None, 2, 2, 3),
    }
    for name, make in checks.items():
        try:
            make()
        except (PartitionError, ShapeError, UnsupportedError) as exc:
            msgs[name] = (type(exc).__name__, str(exc))
        else:
            msgs[name] = ("no error", "")
    return msgs


def test_bad_partitions_and_options_raise_named_errors():
    results = run_ranks(4, _bad_partitions)
    expected = {
        "feature-channel-split": ("PartitionError", "unsplit along channels"),
        "w-without-y": ("PartitionError", "P_y is not"),
        "y-without-w": ("PartitionError", "P_w is None"),
        "general-pw-mismatch": ("PartitionError", "input channels"),
        "general-batch-split": ("PartitionError", "unsplit along the batch"),
        "channel-spatial-split": ("PartitionError", "unsplit spatial axes"),
        "groups-split-channels": ("UnsupportedError", "groups=2 with split channels"),
        "groups-not-dividing": ("ShapeError", "groups"),
        "same-with-stride": ("UnsupportedError", "stride 1"),
        "bad-padding-mode": ("UnsupportedError", "padding_mode"),
        "partition-dims": ("PartitionError", "dimensions of P_x"),
        "not-a-partition": ("PartitionError", "CartesianPartition"),
    }
    for rank, msgs in enumerate(results):
        for name, (cls, fragment) in expected.items():
            got_cls, msg = msgs[name]
            assert got_cls == cls, (name, got_cls, msg)
            assert fragment in msg and f"[rank {rank}]" in msg, (name, msg)


def test_select_conv_is_pure():
    class FakeP:  # select_conv reads only shapes
        def __init__(self, shape):
            self.shape = shape

    px, py, pw = FakeP((1, 2, 1)), FakeP((1, 3, 1)), FakeP((3, 2, 1))
    assert select_conv(1, px, py, pw) is DistributedChannelConv1d
    assert select_conv(1, FakeP((1, 2, 2)), FakeP((1, 3, 2)), FakeP((3, 2, 2))) is DistributedGeneralConv1d
    assert select_conv(1, FakeP((1, 1, 4))) is DistributedFeatureConv1d


# ------------------------------------------------------------------ parameters


def _init_matches_sequential(kind):
    """Same seed: the distributed blocks are the sequential layer's parameters, and the generators stay in step."""
    torch.manual_seed(123)
    layer = _layer2d(kind)
    after_dist = torch.rand(3)
    torch.manual_seed(123)
    seq = nn.Conv2d(4, 6, 3, padding=1)
    after_seq = torch.rand(3)
    state = collect_sequential(layer)
    ok = torch.equal(after_dist, after_seq)
    if dist.get_rank() == 0:
        ok = ok and state.keys() == seq.state_dict().keys()
        ok = ok and all(torch.equal(state[k], v) for k, v in seq.state_dict().items())
    return ok


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_reset_parameters_equals_sequential_with_the_same_seed(kind):
    assert all(run_ranks(4, _init_matches_sequential, kind))


def _round_trips(kind):
    """sequential -> distributed -> sequential, and per-rank state_dict checkpoints."""
    rank = dist.get_rank()
    torch.manual_seed(5)
    seq = nn.Conv2d(4, 6, 3, padding=1)
    layer = _layer2d(kind)
    load_sequential(layer, seq if rank == 0 else None)
    back = collect_sequential(layer)
    if rank == 0:
        assert all(torch.equal(back[k], v) for k, v in seq.state_dict().items())
        restored = nn.Conv2d(4, 6, 3, padding=1)
        restored.load_state_dict(back)
    # Per-rank checkpoint: each rank saves its own blocks, a fresh layer loads them.
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    owners = {lay.name for lay in layer.param_layouts() if lay.P.active}
    # Besides its blocks, a layer with BlockIdentityMixin saves which blocks they are (_extra_state).
    assert set(layer.state_dict()) - {"_extra_state"} == owners, (set(layer.state_dict()), owners)
    torch.manual_seed(99)
    fresh = _layer2d(kind)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    again = collect_sequential(fresh)
    if rank == 0:
        assert all(torch.equal(again[k], v) for k, v in seq.state_dict().items())
    # The restored layer computes what the sequential one does.
    P_x = fresh.P_x
    gen = torch.Generator().manual_seed(3)
    xg = torch.randn(2, 4, 5, 6, generator=gen)
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor()
    with torch.no_grad():
        y = fresh(x)
    P_out = getattr(fresh, "P_y", P_x)
    y_full = collect_tensor(y if P_out.active else None, P_out)
    if rank == 0:
        # float32 sums of 4 * 3 * 3 unit-variance inputs times weights below 1 / 6, against float64 on the scale of
        # the outputs
        with torch.no_grad():
            ref = F.conv2d(xg.double(), seq.weight.double(), seq.bias.double(), padding=1)
        torch.testing.assert_close(y_full.double(), ref, **tol(torch.float32, terms=4 * 3 * 3, scale=_typical(ref)))
    return True


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_state_dict_round_trips(kind):
    assert all(run_ranks(4, _round_trips, kind))


# ------------------------------------------------------------------ call-time errors


def _call_errors():
    """Bad inputs raise the same error on every rank (after the one metadata gather), naming layer and rank."""
    rank = dist.get_rank()
    msgs = {}
    P_x = grid(range(4), (1, 1, 4))
    layer = DistributedFeatureConv1d(P_x, 2, 3, 3, padding=1)
    gen_layer = _layer2d("general")
    checks = {
        # rank 0 holds 5 elements, the others 2: not the balanced decomposition of 11
        "unbalanced": lambda: layer(torch.randn(1, 2, 5 if rank == 0 else 2)),
        "channels": lambda: layer(torch.randn(1, 3, 4)),
        "dtype": lambda: layer(torch.randn(1, 2, 4, dtype=torch.float64)),
        "ndim": lambda: layer(torch.randn(1, 2, 4, 1) if rank == 1 else torch.randn(1, 2, 4)),
        # general layout: ranks 0..3 are all in P_x; a block with the wrong channel count on rank 3
        "general-block": lambda: gen_layer(torch.randn(1, 3 if rank == 3 else 2, 3, 3)),
    }
    for name, call in checks.items():
        try:
            call()
        except ShapeError as exc:
            msgs[name] = str(exc)
        else:
            msgs[name] = "no error"
    return msgs


def test_bad_inputs_raise_on_every_rank():
    results = run_ranks(4, _call_errors)
    fragments = {"unbalanced": "balanced decomposition", "channels": "input channels", "dtype": "parameters' dtype",
                 "ndim": "number of input dimensions on world rank 1", "general-block": "world rank 3"}
    for rank, msgs in enumerate(results):
        for name, fragment in fragments.items():
            assert fragment in msgs[name], (name, msgs[name])
            assert f"[rank {rank}]" in msgs[name] and "Distributed" in msgs[name], msgs[name]


# ------------------------------------------------------------------ adjoint and (lo, hi) padding


def _adjoints():
    out = {}
    P_x = grid(range(4), (1, 1, 4))
    feat = DistributedFeatureConv1d(P_x, 2, 3, 4, stride=2, padding=3, dilation=2, padding_mode="circular",
                                    bias=False, dtype=torch.float64)
    x = torch.randn(local_shape((2, 2, 13), P_x.shape, P_x.index), dtype=torch.float64)
    out["feature"] = adjoint_check(feat, x)
    torch.manual_seed(0)
    P_x, P_y, P_w = _partitions("general")
    gen = DistributedGeneralConv2d(P_x, 4, 6, 3, padding=1, padding_mode="reflect", bias=False, P_y=P_y, P_w=P_w,
                                   dtype=torch.float64)
    x = torch.randn(local_shape((1, 4, 5, 6), P_x.shape, P_x.index), dtype=torch.float64)
    out["general"] = adjoint_check(gen, x)
    return out


def test_dot_product_adjoint():
    for name, (lhs, rhs) in run_ranks(4, _adjoints)[0].items():
        assert abs(lhs) > 1e-3, name
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (name, lhs, rhs)


def _pair_padding():
    """(lo, hi) padding, which torch's ConvNd cannot express: compare with F.pad + conv on the global tensor."""
    P_x = grid(range(3), (1, 1, 3))
    torch.manual_seed(1)
    layer = DistributedFeatureConv1d(P_x, 2, 3, 3, padding=((2, 0),), padding_mode="replicate", dtype=torch.float64)
    w = collect_sequential(layer)
    xg = torch.randn(2, 2, 10, dtype=torch.float64)
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor(dtype=torch.float64)
    y = layer(x)
    y_full = collect_tensor(y.detach() if P_x.active else None, P_x)
    if dist.get_rank() == 0:
        ref = F.conv1d(F.pad(xg, (2, 0), mode="replicate"), w["weight"], w["bias"])
        # float64 sums of 2 channels x 3 taps, in another order
        torch.testing.assert_close(y_full, ref, **tol(torch.float64, terms=2 * 3, scale=_typical(ref)))
    return P_x.active or y.numel() == 0


def test_lo_hi_padding_pairs():
    assert all(run_ranks(4, _pair_padding))
