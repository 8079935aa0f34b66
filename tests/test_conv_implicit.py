"""Implicit-GEMM halo convolution against its torch reference and a float64 global convolution, in one process.

One process plays every worker of the plan, as ``tests/test_halo_kernels.py`` does: each
worker's block is cut from a global tensor and its receive buffer is assembled from the
owners' packed send buffers.  The global oracle pads the global tensor with numpy (flat
indices padded with the mode, ``wrap`` repeating as often as needed) and convolves it in
float64; each worker's output block is a slice of that.  Outputs are poisoned with NaN.
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distfuse.errors import UnsupportedError
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import HaloPlan, resolve_padding
from distfuse.kernels import conv_implicit as ci
from distfuse.kernels import halo as hk
from distfuse.kernels.conv_implicit import conv_implicit, conv_implicit_reference
from tests.compiled_subprocess import run_compiled
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


def _typical(t: torch.Tensor) -> float:
    """The root mean square of a float64 reference: the size of its partial sums (random-sign terms)."""
    return float(t.double().pow(2).mean().sqrt())


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
    # The longest sums run over C input channels x the kernel's taps, of unit-variance inputs and weights: partial sums
    # of the output's size (about sqrt(C * taps)), which the float64 oracle gives.  The torch reference of the same
    # staged block is rounded too: the two differ by up to both sides' bounds.
    t = tol(dtype, terms=C * math.prod(kernel), scale=_typical(yg))
    t_both = {k: 2 * v for k, v in t.items()}
    for i, x in blocks.items():
        boxes = [q[(pc.src, i)].pop(0).reshape(-1) for pc in plan.recvs(i)]
        recv = torch.cat(boxes) if boxes else x.new_empty(0)
        out = torch.full((B, Co) + plan.output_shape(i), float("nan"), dtype=dtype)
        y = conv_implicit(x, recv, w, bv, plan, i, stride, dilation, out=out, tile=tile)
        assert y is out
        assert y.shape == (B, Co) + plan.output_shape(i), ("shape", i)
        assert not y.isnan().any(), ("NaN in output", i)
        ref = conv_implicit_reference(x, recv, w, bv, plan, i, stride, dilation)
        torch.testing.assert_close(y.double(), ref.double(), **t_both, msg=f"kernel vs reference, worker {i}")
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile", [(32, 16, 16), (16, 16, 64)], ids=["bm32-bk16", "bm16-bk64"])
def test_conv_implicit_tiles_with_block_m_not_block_k(tile, dtype):
    """BLOCK_M != BLOCK_K (the GPU default is 64x32x32): K = 5 * 3 * 3 = 45 takes 3 steps of 16 or one of 64."""
    _simulate((7, 6), (2, 2), (3, 3), (1, 1), (1, 1), 1, "circular", dtype, C=5, Co=6, tile=tile)


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


# ---------------------------------------------------------------- compiled mode without a GPU

# (dtype, tile, bias, integer arguments Triton specialises to the constant 1): the GPU default tile
# (BLOCK_M != BLOCK_K), a tile with BLOCK_M < BLOCK_K, and a 2-D conv's extent-1 leading axis.
_SPECIALISE_2D = dict(O0=1, K0=1, SD0=1, DL0=1)
_COMPILE_CASES = [(dt, tile, bias, ones) for dt in ("fp32", "fp16", "bf16")
                  for tile, bias, ones in ((ci._GPU_TILE, True, {}), ((32, 64, 64), False, {}))]
_COMPILE_CASES.append(("bf16", ci._GPU_TILE, True, _SPECIALISE_2D))


def _mma_operand_types(ptx: str) -> list[str]:
    """Operand types of the tensor-core instructions in ``ptx`` (``wgmma.mma_async...m64n32k16.f32.bf16.bf16``
    or ``mma.sync...m16n8k16.row.col.f32.bf16.bf16.f32``): a subset of bf16, f16, tf32."""
    found = set()
    for line in ptx.splitlines():
        parts = line.strip().split()
        comps = parts[0].split(".") if parts else []
        if any(c.startswith("mma") or c.endswith("mma") for c in comps[:2]) and any(
                re.fullmatch(r"m\d+n\d+k\d+", c) for c in comps):
            found |= set(comps) & {"bf16", "f16", "tf32"}
    return sorted(found)


def _compile_for_sm90():
    """Compile the kernel for sm_90 down to a cubin, once per case (run in a process without TRITON_INTERPRET).

    The interpreter accepts code the compiler rejects (a loop-carried value that changes
    shape, mismatched branch types, a 16-bit ``tl.dot`` the GPU path takes but the
    interpreter upcasts), so the constexprs are the compiled launch's
    (``_constexprs(..., interpret=False)``).  Prints one line per case; raises after
    trying all of them.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    fn = ci._conv_implicit_kernel
    failed = []
    for dt, tile, bias, ones in _COMPILE_CASES:
        consts = {**ci._constexprs(dtypes[dt], bias, tile, interpret=False), **ones}
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.startswith(("seg", "crd")):
                sig[name] = "*i32"
            elif name == "ptab_ptr":
                sig[name] = "*i64"
            else:
                sig[name] = f"*{dt}" if name.endswith("_ptr") else "i32"
        case = f"{dt} tile={tile} bias={bias} ones={sorted(ones)}"
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
            assert k.asm.get("cubin"), "no cubin"
            print(f"compiled {dt} mma-operands={','.join(_mma_operand_types(k.asm['ptx'])) or 'none'} {case}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - report every case, then fail
            failed.append(f"{case}: {type(exc).__name__}: {str(exc)[-1500:]}")
    if failed:
        raise SystemExit("\n\n".join(failed))


def test_conv_implicit_compiles_for_sm90_without_a_gpu():
    """Default tile and BLOCK_M != BLOCK_K, fp32/fp16/bf16, compiled for sm_90 with the ptxas Triton ships;
    the 16-bit kernels must use tensor-core instructions (``mma``), i.e. take their operands un-upcast."""
    stdout = run_compiled("import tests.test_conv_implicit as t; t._compile_for_sm90()", timeout=400)
    lines = [ln.split() for ln in stdout.splitlines() if ln.startswith("compiled")]
    assert len(lines) == len(_COMPILE_CASES), stdout
    want = {"fp16": "mma-operands=f16", "bf16": "mma-operands=bf16"}
    for ln in lines:
        if ln[1] in want:  # 16-bit tiles go to the tensor cores as they are, not upcast to fp32 first
            assert ln[2] == want[ln[1]], " ".join(ln)
        else:  # fp32: IEEE fp32 (FMA) or, where torch allows it, TF32 tensor cores; never a 16-bit operand
            assert ln[2] in ("mma-operands=none", "mma-operands=tf32"), " ".join(ln)


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
    wc, bc = w.cuda(), bv.cuda()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        # the global float64 oracle from the dtype-rounded inputs (reflect padding of 1 on both sides of both axes)
        yg = F.conv2d(F.pad(xg.cuda().double(), (1, 1, 1, 1), mode="reflect"), wc.double(), bc.double())
        # K = 64 channels x 3 x 3 = 576 fp32 products (w scaled by 1 / sqrt(576): outputs of unit size, plus the
        # bias): neither side uses tf32 (the kernel's input_precision="ieee", cuDNN's flag off), so the fp32 entry
        # holds; bf16 inputs are exact in fp32 and the output is rounded once.  The cuDNN reference of the same staged
        # block is rounded too: the two differ by up to both sides' bounds.
        t = tol(dtype, terms=64 * math.prod(k), scale=_typical(yg))
        t_both = {key: 2 * v for key, v in t.items()}
        for i, x in blocks.items():
            recv = torch.cat([q[(pc.src, i)].pop(0).reshape(-1) for pc in plan.recvs(i)])
            out = torch.full((2, 64) + plan.output_shape(i), float("nan"), dtype=dtype, device="cuda")
            y = conv_implicit(x, recv, wc, bc, plan, i, 1, 1, out=out)
            assert not y.isnan().any(), ("NaN in output", i)
            sl = tuple(slice(*ax.output_range(j)) for ax, j in zip(plan.axes, i, strict=True))
            torch.testing.assert_close(y.double(), yg[(..., *sl)], **t, msg=f"kernel vs float64 conv, worker {i}")
            ref = conv_implicit_reference(x, recv, wc, bc, plan, i, 1, 1)
            torch.testing.assert_close(y.double(), ref.double(), **t_both, msg=f"kernel vs cuDNN, worker {i}")


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_the_gpu_tiles_compute_the_conv(precision):
    """The GPU tile of each precision of the products (``gpu_tile``: 64x32x16, and 32x32x16 for fp32 IEEE, chosen
    so that neither spills under Triton 3.6 or 3.9) run here, interpreted, against the float64 oracle: K = C x taps
    = 27 is no multiple of their 16-deep K steps, and the 9-row output blocks fill no 32- or 64-row tile."""
    tile = ci.gpu_tile(precision)
    assert tile == ((32, 32, 16) if precision == "ieee" else (64, 32, 16))
    _simulate((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "reflect", torch.float32, tile=tile)
