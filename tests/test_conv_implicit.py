"""Implicit-GEMM halo convolution against its torch reference and a float64 global convolution, in one process.

One process plays every worker of the plan, as ``tests/test_halo_kernels.py`` does: each
worker's block is cut from a global tensor and its receive buffer is assembled from the
owners' packed send buffers.  The global oracle pads the global tensor with numpy (flat
indices padded with the mode, ``wrap`` repeating as often as needed) and convolves it in
float64; each worker's output block is a slice of that.  Outputs are poisoned with NaN.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distfuse.decomposition import local_slices
from distfuse.errors import UnsupportedError
from distfuse.kernels import halo as hk
from distfuse.kernels.conv_implicit import conv_implicit, conv_implicit_reference
from distfuse.primitives.halo_plan import HaloPlan, resolve_padding
from tests.tolerances import tol

NP_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
MODES = ["zeros", "reflect", "replicate", "circular"]
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _global_padded(xg64, pads, mode):
    """``[B, C, *padded]`` float64: the global tensor padded like ConvNd(padding_mode=mode)."""
    gshape = xg64.shape[2:]
    idx = np.arange(math.prod(gshape)).reshape(gshape)
    extra = {"constant_values": -1} if mode == "zeros" else {}
    win = torch.from_numpy(np.ascontiguousarray(np.pad(idx, pads, mode=NP_MODE[mode], **extra))).long()
    flat = xg64.reshape(xg64.shape[0], xg64.shape[1], -1)
    vals = flat[:, :, win.clamp(min=0).reshape(-1)].reshape(xg64.shape[:2] + tuple(win.shape))
    return torch.where(win >= 0, vals, torch.zeros((), dtype=vals.dtype))


def _simulate(gshape, grid, kernel, stride, dilation, padding, mode, dtype, B=2, C=3, Co=4, bias=True, tile=None):
    nd = len(gshape)
    pads = resolve_padding(padding, kernel, dilation, stride)
    plan = HaloPlan.for_conv(gshape, grid, kernel, stride, dilation, pads, mode)
    gen = torch.Generator().manual_seed(4321)
    xg = torch.randn((B, C) + tuple(gshape), generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn((Co, C) + tuple(kernel), generator=gen, dtype=torch.float64).to(dtype)
    bv = torch.randn(Co, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    blocks = {i: xg[(..., *local_slices(gshape, grid, i))].contiguous() for i in plan.blocks()}
    # the global float64 oracle from the dtype-rounded inputs
    yg = CONV[nd](_global_padded(xg.double(), pads, mode), w.double(), None if bv is None else bv.double(),
                  stride, 0, dilation)
    # route the packed boxes: (sender, receiver) -> queue of boxes, in plan.sends order
    q = {}
    for i, x in blocks.items():
        sends = plan.sends(i)
        views = hk._split(hk.halo_pack_reference(x, plan, i), [pc.src_shape for _, pc in sends], (B, C))
        for (peer, _), v in zip(sends, views):
            q.setdefault((i, peer), []).append(v)
    t = tol(dtype)
    for i, x in blocks.items():
        boxes = [q[(pc.src, i)].pop(0).reshape(-1) for pc in plan.recvs(i)]
        recv = torch.cat(boxes) if boxes else x.new_empty(0)
        out = torch.full((B, Co) + plan.output_shape(i), float("nan"), dtype=dtype)
        y = conv_implicit(x, recv, w, bv, plan, i, stride, dilation, out=out, tile=tile)
        assert y is out
        assert y.shape == (B, Co) + plan.output_shape(i), ("shape", i)
        assert not y.isnan().any(), ("NaN in output", i)
        ref = conv_implicit_reference(x, recv, w, bv, plan, i, stride, dilation)
        torch.testing.assert_close(y, ref, **t, msg=f"kernel vs reference, worker {i}")
        sl = tuple(slice(*ax.output_range(j)) for ax, j in zip(plan.axes, i))
        want = yg[(..., *sl)]
        torch.testing.assert_close(y.double(), want, **t, msg=f"kernel vs float64 global conv, worker {i}")
    assert all(not v for v in q.values())  # every message was consumed
    return plan


# global shape, grid, kernel, stride, dilation, padding
CASES_2D = [
    pytest.param((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, id="2d-k3-uneven-2x3"),
    pytest.param((9, 8), (2, 2), (3, 3), (2, 2), (1, 1), 1, id="2d-stride2"),
    pytest.param((9, 8), (2, 2), (3, 3), (1, 1), (2, 2), 2, id="2d-dilation2"),
    pytest.param((8, 7), (2, 2), (2, 4), (2, 1), (1, 2), ((1, 0), (2, 3)), id="2d-even-kernel-asym-stride-dilation"),
    pytest.param((6, 9), (1, 4), (3, 5), (1, 1), (1, 2), (1, 4), id="2d-halo-wider-than-neighbour"),
]


def _reflect_ok(gshape, kernel, stride, dilation, padding):
    pads = resolve_padding(padding, kernel, dilation, stride)
    return all(max(p) < n for p, n in zip(pads, gshape))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,padding", CASES_2D)
def test_conv_implicit_2d_fp32(gshape, grid, kernel, stride, dilation, padding, mode):
    if mode == "reflect" and not _reflect_ok(gshape, kernel, stride, dilation, padding):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    _simulate(gshape, grid, kernel, stride, dilation, padding, mode, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_conv_implicit_2d_low_precision(mode, dtype):
    _simulate((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, mode, dtype)


@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,padding,mode", [
    pytest.param((17,), (3,), (3,), (1,), (1,), 1, "replicate", id="1d-uneven-replicate"),
    pytest.param((19,), (4,), (3,), (2,), (2,), 2, "circular", id="1d-stride2-dilation2-circular"),
    pytest.param((5, 6, 7), (2, 1, 2), (3, 2, 3), (1, 2, 1), (1, 1, 2), 2, "reflect", id="3d-2x1x2-reflect"),
    pytest.param((4, 5, 6), (2, 2, 2), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "zeros", id="3d-2x2x2-corners-zeros"),
])
def test_conv_implicit_1d_3d(gshape, grid, kernel, stride, dilation, padding, mode):
    _simulate(gshape, grid, kernel, stride, dilation, padding, mode, torch.float32)


def test_conv_implicit_small_tiles_no_bias():
    """Tiles smaller than M, N and K: masks at every tile edge, several K iterations, more channels than a tile."""
    _simulate((7, 6), (2, 2), (3, 3), (1, 1), (1, 1), 2, "replicate", torch.float32, C=5, Co=20, bias=False,
              tile=(16, 16, 16))


def test_conv_implicit_worker_without_outputs():
    """A grid wider than the output: some workers own no output and return an empty block."""
    plan = _simulate((3,), (5,), (3,), (1,), (1,), 1, "zeros", torch.float32)
    assert any(0 in plan.output_shape(i) for i in plan.blocks())


def test_conv_implicit_rejects_groups_and_dtype():
    plan = HaloPlan.for_conv((8, 8), (1, 1), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)), "zeros")
    x = torch.randn(1, 4, 8, 8)
    recv = x.new_empty(0)
    with pytest.raises(UnsupportedError, match="groups=1"):
        conv_implicit(x, recv, torch.randn(4, 2, 3, 3), None, plan, (0, 0), 1, 1)
    with pytest.raises(UnsupportedError, match="dtype"):
        conv_implicit(x.double(), recv.double(), torch.randn(4, 4, 3, 3).double(), None, plan, (0, 0), 1, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_implicit_cuda_realistic(dtype):
    """A realistic per-worker block on a GPU (64 channels, 130x130 staged), every worker of a 2x2 grid."""
    gshape, grid, k = (256, 256), (2, 2), (3, 3)
    plan = HaloPlan.for_conv(gshape, grid, k, (1, 1), (1, 1), ((1, 1), (1, 1)), "reflect")
    gen = torch.Generator().manual_seed(7)
    xg = torch.randn((2, 64) + gshape, generator=gen).to(dtype)
    w = (torch.randn((64, 64) + k, generator=gen) / 24).to(dtype)
    bv = torch.randn(64, generator=gen).to(dtype)
    blocks = {i: xg[(..., *local_slices(gshape, grid, i))].contiguous().cuda() for i in plan.blocks()}
    packed = {i: hk.halo_pack(x, plan, i) for i, x in blocks.items()}
    q = {}
    for i in plan.blocks():
        sends = plan.sends(i)
        for (peer, _), v in zip(sends, hk._split(packed[i], [pc.src_shape for _, pc in sends], (2, 64))):
            q.setdefault((i, peer), []).append(v)
    # K = 576 fp32 products: neither side uses tf32 (the kernel's input_precision="ieee", cuDNN's flag off
    # below), so the fp32 entry holds; bf16 inputs are exact in fp32 and the output is rounded once
    t = tol(dtype)
    wc, bc = w.cuda(), bv.cuda()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for i, x in blocks.items():
            recv = torch.cat([q[(pc.src, i)].pop(0).reshape(-1) for pc in plan.recvs(i)])
            out = torch.full((2, 64) + plan.output_shape(i), float("nan"), dtype=dtype, device="cuda")
            y = conv_implicit(x, recv, wc, bc, plan, i, 1, 1, out=out)
            ref = conv_implicit_reference(x, recv, wc, bc, plan, i, 1, 1)
            torch.testing.assert_close(y, ref, **t)
