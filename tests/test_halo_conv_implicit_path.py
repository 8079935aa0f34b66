"""The fused halo conv with the implicit-GEMM forward (no staged copy) equals the staged fused path.

Forward output and every gradient (input, weight, bias) on gloo ranks, against the
staged fused path on the same inputs and against a float64 sequential conv.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition
from distfuse.errors import UnsupportedError
from distfuse.fused.halo_conv import halo_conv
from distfuse.geometry.decomposition import local_slices
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.testing import RankFailure, run_ranks
from tests.tolerances import tol

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TORCH_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _run(grid, gshape, cout, kernel, stride, dilation, padding, mode, dtype, implicit):
    nd = len(kernel)
    P_x = Partition.world().create_cartesian_topology_partition((1, 1) + tuple(grid))
    halo = HaloExchange(P_x, kernel, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    gen = torch.Generator().manual_seed(21)
    xg = torch.randn(gshape, generator=gen, dtype=torch.float64)
    w = torch.randn((cout, gshape[1]) + tuple(kernel), generator=gen, dtype=torch.float64)
    b = torch.randn(cout, generator=gen, dtype=torch.float64)
    plan = halo.plan(gshape)
    index = P_x.index[2:]
    x = xg[local_slices(gshape, P_x.shape, P_x.index)].to(dtype).requires_grad_(True)
    wl, bl = w.to(dtype).requires_grad_(True), b.to(dtype).requires_grad_(True)
    y = halo_conv(x, wl, bl, plan, index, halo.world_of_fn(), groups=1, implicit=implicit)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5 + dist.get_rank()), dtype=torch.float64)
    y.backward(dy.to(dtype))
    # float64 sequential reference for this block's output
    flat = [v for lo_hi in reversed(halo.padding) for v in lo_hi]
    yg = CONV[nd](F.pad(xg, flat, mode=TORCH_MODE[mode]), w, b, stride=stride, dilation=dilation)
    y_ref = yg[local_slices(yg.shape, P_x.shape, P_x.index)]
    return dict(y=y.detach().double(), dx=x.grad.double(), dw=wl.grad.double(), db=bl.grad.double(), y_ref=y_ref)


CASES = [
    pytest.param((2, 2), (2, 3, 7, 9), 4, (3, 3), (1, 1), (1, 1), 1, "reflect", id="2d-2x2-reflect"),
    pytest.param((1, 4), (1, 2, 5, 10), 3, (3, 2), (2, 1), (1, 2), (1, 2), "circular", id="2d-1x4-stride-dil-even"),
    pytest.param((3,), (2, 2, 11), 2, (5,), (1,), (2,), 4, "replicate", id="1d-3-wide-halo"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grid,gshape,cout,kernel,stride,dilation,padding,mode", CASES)
def test_implicit_forward_matches_staged_and_sequential(grid, gshape, cout, kernel, stride, dilation, padding, mode,
                                                         dtype):
    world = 1
    for g in grid:
        world *= g
    implicit = run_ranks(world, _run, grid, gshape, cout, kernel, stride, dilation, padding, mode, dtype, True)
    staged = run_ranks(world, _run, grid, gshape, cout, kernel, stride, dilation, padding, mode, dtype, False)
    t = tol(dtype)
    for a, s in zip(implicit, staged):
        scale = dict(rtol=t["rtol"], atol=t["atol"] * max(1.0, float(s["y_ref"].abs().max())))
        torch.testing.assert_close(a["y"], a["y_ref"], **scale)
        torch.testing.assert_close(a["y"], s["y"], **scale)
        for k in ("dx", "dw", "db"):  # the backward is shared; the re-staged input gives the same weight gradient
            torch.testing.assert_close(a[k], s[k], rtol=t["rtol"], atol=t["atol"] * max(1.0, float(s[k].abs().max())))


def _grouped():
    P_x = Partition.world().create_cartesian_topology_partition((1, 1, 2))
    halo = HaloExchange(P_x, (3,), padding=1)
    plan = halo.plan((1, 4, 8))
    halo_conv(torch.randn(1, 4, 4), torch.randn(4, 2, 3), None, plan, P_x.index[2:], halo.world_of_fn(), groups=2,
              implicit=True)


def test_implicit_refuses_groups():
    with pytest.raises(RankFailure, match="implicit-GEMM convolution supports groups=1") as info:
        run_ranks(2, _grouped)
    assert all(UnsupportedError.__name__ in tb for tb in info.value.errors.values())
