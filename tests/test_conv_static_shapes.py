"""Feature conv: no per-call metadata gather while shapes repeat (with or without the legacy ``static_shapes``),
same results, and a partial shape change (some blocks change, some repeat) is learnt by every rank from the
agreement flag and computed right (it used to end in a collective timeout under ``static_shapes``)."""

import pytest
import torch

import distfuse.layers.conv_feature as conv_feature
from distfuse import Partition
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import DistributedConv2d
from distfuse.testing import RankFailure, run_ranks
from tests.tolerances import tol


def _calls(static):
    P_x = Partition.world().create_cartesian_topology_partition((1, 1, 2, 2))
    torch.manual_seed(0)
    conv = DistributedConv2d(P_x, 3, 4, 3, padding=1, padding_mode="circular", static_shapes=static)
    gathers = []
    real = conv_feature.gather_call_info
    conv_feature.gather_call_info = lambda *a, **k: gathers.append(1) or real(*a, **k)
    outs = []
    try:
        for step, batch in enumerate((2, 2, 2, 3, 3)):  # the batch changes on every worker together
            gen = torch.Generator().manual_seed(100 + step)
            xg = torch.randn(batch, 3, 9, 10, generator=gen)
            x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].requires_grad_(True)
            y = conv(x)
            y.square().sum().backward()
            grads = [p.grad.clone() for p in conv.parameters()]
            conv.zero_grad()
            outs.append((y.detach(), x.grad, grads))
    finally:
        conv_feature.gather_call_info = real
    return len(gathers), outs


def test_static_shapes_skips_repeat_gathers_and_matches():
    static = run_ranks(4, _calls, True)
    dynamic = run_ranks(4, _calls, False)
    for (n_static, a), (n_dynamic, b) in zip(static, dynamic):
        assert n_dynamic == n_static == 2  # one gather per change of local shape, none while shapes repeat
        for (ya, gxa, gpa), (yb, gxb, gpb) in zip(a, b):
            torch.testing.assert_close(ya, yb, rtol=0, atol=0)
            torch.testing.assert_close(gxa, gxb, rtol=0, atol=0)
            for u, v in zip(gpa, gpb):
                torch.testing.assert_close(u, v, rtol=0, atol=0)


def _partial_change():
    P_x = Partition.world().create_cartesian_topology_partition((1, 1, 1, 2))
    torch.manual_seed(0)
    conv = DistributedConv2d(P_x, 2, 2, 3, padding=1, static_shapes=True)
    torch.manual_seed(0)
    seq = torch.nn.Conv2d(2, 2, 3, padding=1).double()  # the same draws as the layer's, in float64
    results = []
    for width in (8, 9):  # 8 -> blocks (4, 4); 9 -> blocks (5, 4): rank 1's block repeats, rank 0's does not
        xg = torch.randn(1, 2, 5, width, generator=torch.Generator().manual_seed(width))
        y = conv(xg[local_slices(xg.shape, P_x.shape, P_x.index)])
        with torch.no_grad():
            ref = seq(xg.double())
        results.append((y.detach(), ref[local_slices(ref.shape, P_x.shape, P_x.index)]))
    return results


def test_partial_shape_change_is_learnt_by_every_rank():
    for results in run_ranks(2, _partial_change, timeout=60):
        for width, (y, ref) in zip((8, 9), results, strict=True):
            assert y.shape == ref.shape and not torch.isnan(y).any(), (width, tuple(y.shape), tuple(ref.shape))
            # float32 sums of 2 channels x 3 x 3 terms against float64, on the scale of the outputs
            scale = float(ref.pow(2).mean().sqrt())
            torch.testing.assert_close(y.double(), ref, **tol(torch.float32, terms=2 * 3 * 3, scale=scale),
                                       msg=lambda m, w=width: f"width {w}: {m}")


def _channel_conv_static():
    P_x = Partition.world().create_cartesian_topology_partition((1, 2, 1))
    DistributedConv2d(P_x, 2, 2, 1, P_y=P_x, P_w=P_x, static_shapes=True)


def test_static_shapes_only_for_the_feature_conv():
    with pytest.raises(RankFailure, match="static_shapes is implemented for the feature-distributed"):
        run_ranks(2, _channel_conv_static)
