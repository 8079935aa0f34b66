"""Halo exchange and staging on ranks, bit for bit, against torch references that only move values.

Both staging paths run on gloo rank pools whose partitions list their ranks out of order
(and leave some world ranks idle): the unfused ``HaloExchange`` module, and the fused
kernels called directly (``halo_pack`` into a NaN-poisoned send buffer, the library's
own message order, ``halo_stage`` into a NaN-poisoned output, once in one pass and once
as the overlap's local + remote passes).

* Forward: the staged input must equal, bit for bit, the slice of ``F.pad`` of the
  global tensor (computed in float64 from the same 16-bit values and converted back,
  which is exact) over the window the brute-force oracle of
  ``tests/test_teeth_halo_plan.py`` finds (the hull of the kernel taps' reads).  Staging
  is pure data movement, so fp16 and bf16 get no tolerance.
* Backward: the input gradient must equal, bit for bit, the float64 ``index_add`` of
  every worker's staged gradient at the global index it was read from.  The gradients
  are small integers, so every partial sum is exact in the dtype and any summation
  order must give exactly that value.

The 3-D cases have halos several blocks wide (kernel 7 with dilation 2 over blocks of
3-4 elements), so every worker's staged input is assembled from dozens of boxes.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl

from distfuse import Partition, zero_volume_tensor
from distfuse.fused.halo_staging import backward_messages, forward_messages
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels import halo as hk
from distfuse.kernels._utils import round_bf16
from distfuse.kernels.conv_implicit import conv_implicit
from distfuse.kernels.jit_helpers import cast_out
from distfuse.primitives._common import exchange
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.testing import run_ranks
from tests.test_teeth_halo_plan import brute_axis, split

MODES = ["zeros", "reflect", "replicate", "circular"]
NP_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}
LEAD = (2, 3)


def _nan(shape, dtype):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.full(shape, float("nan"), dtype=dtype)


def _bits_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    g, w = got.contiguous().view(BITS[got.dtype]), want.contiguous().view(BITS[want.dtype])
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {g.numel()} elements differ bitwise, first at "
                              f"{tuple(bad[0].tolist())}: got {got[tuple(bad[0])].item()!r}, "
                              f"want {want[tuple(bad[0])].item()!r}")


def _windows(gshape, grid, kernel, stride, dilation, pads):
    """Per spatial axis, the brute-force ``(m, output blocks, needed window [a, b) or None per worker)``."""
    return [brute_axis(n, p, k, s, d, lo, hi)
            for n, p, k, s, d, (lo, hi) in zip(gshape, grid, kernel, stride, dilation, pads)]


def _global_pad(xg, pads, mode):
    """F.pad of the global tensor with torch's own modes, in float64 (exact for 16-bit values), back in x's dtype."""
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    x64 = xg.double()
    out = F.pad(x64, flat) if mode == "zeros" else F.pad(x64, flat, mode=mode)
    return out.to(xg.dtype)


def _source_index(gshape, pads, mode):
    """The globally padded array of flat source indices (-1: a zero), from numpy's pad (independent of F.pad)."""
    idx = np.arange(math.prod(gshape)).reshape(gshape)
    extra = {"constant_values": -1} if mode == "zeros" else {}
    return np.pad(idx, pads, mode=NP_MODE[mode], **extra)


def _wide_range(shape, dtype, seed):
    """Non-zero random values over most of ``dtype``'s exponent range: a path that moved them through a narrower
    format (fp16 for bf16, or a subnormal flush) changes some of them."""
    gen = torch.Generator().manual_seed(seed)
    span = {torch.bfloat16: 60, torch.float16: 12, torch.float32: 60}[dtype]
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    v = v * torch.exp2(torch.randint(-span, span + 1, shape, generator=gen).double())
    return torch.where(v == 0, torch.ones_like(v), v).to(dtype)


def _grad_of(block_index, shape, dtype):
    """The staged gradient worker ``block_index`` gets: integers in [-3, 3] without 0 (every rank can rebuild it)."""
    seed = 1 + sum(i * 31 ** a for a, i in enumerate(block_index))
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(1, 4, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    return v.to(dtype)


def _fused_stage(x, plan, index, world_of, two_pass):
    lead = x.shape[0] * x.shape[1]
    send = hk.halo_pack(x, plan, index, out=_nan(hk.send_numel(plan, index, lead), x.dtype))
    recv = _nan(hk.recv_numel(plan, index, lead), x.dtype)
    exchange(*forward_messages(plan, index, world_of, lead, send, recv), op="test fused stage")
    out = _nan(tuple(x.shape[:2]) + plan.staged_shape(index), x.dtype)
    if two_pass:
        hk.halo_stage(x, recv, plan, index, out=out, region="local")
        hk.halo_stage(x, recv, plan, index, out=out, region="remote")
    else:
        assert hk.halo_stage(x, recv, plan, index, out=out) is out
    return out


def _fused_unstage(g, x_shape, plan, index, world_of):
    lead = g.shape[0] * g.shape[1]
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    u = hk.halo_unstage(g, plan, index, grad_x=_nan(x_shape, g.dtype), send=_nan(hk.recv_numel(plan, index, lead),
                                                                                  g.dtype),
                        self_boxes=_nan(hk.self_numel(plan, index, lead), acc))
    incoming = _nan(hk.send_numel(plan, index, lead), g.dtype)
    exchange(*backward_messages(plan, index, world_of, lead, u.send, incoming), op="test fused unstage")
    return hk.halo_accumulate(u.grad_x, u.self_boxes, incoming, plan, index)


def _stage_on_ranks(order, grid, gshape, kernel, stride, dilation, pads, modes, dtypes, min_pieces=0,
                    two_pass=(torch.bfloat16,)):
    """Every mode and dtype on this rank; returns (index or None, [(mode, dtype, pieces), ...]).

    The fused staging also runs as the overlap's two passes for the dtypes in ``two_pass``."""
    P = Partition.world().create_partition_inclusive(order)
    P_x = P.create_cartesian_topology_partition((1, 1) + tuple(grid))
    per_axis = _windows(gshape, grid, kernel, stride, dilation, pads)
    done = []
    for mode in modes:
        halo = HaloExchange(P_x, kernel, stride=stride, padding=pads, dilation=dilation, padding_mode=mode)
        for dtype in dtypes:
            if not P_x.active:
                assert halo(zero_volume_tensor(dtype=dtype)).numel() == 0
                continue
            xg = _wide_range(LEAD + tuple(gshape), dtype, 7 + MODES.index(mode))
            index = tuple(P_x.index[2:])
            x = xg[(..., *(slice(*split(n, p)[i]) for n, p, i in zip(gshape, grid, index)))].contiguous()
            plan = halo.plan(LEAD + tuple(gshape))
            wins = [per_axis[a][2][i] for a, i in enumerate(index)]
            what = f"rank {dist.get_rank()} block {index} {mode} {dtype}"
            # ---- forward: both paths against the global F.pad, over the brute-force window
            xr = x.clone().requires_grad_(True)
            staged = halo(xr)
            if any(w is None for w in wins):  # no outputs: nothing to stage (still takes part in the exchange)
                want = None
                assert 0 in staged.shape[2:], (what, staged.shape)
            else:
                xp = _global_pad(xg, pads, mode)
                want = xp[(..., *(slice(a + lo, b + lo) for (a, b), (lo, _) in zip(wins, pads)))]
                _bits_equal(staged.detach(), want, f"{what}: HaloExchange staging")
            for passes in ((False, True) if dtype in two_pass else (False,)):
                fused = _fused_stage(x, plan, index, halo.world_of_fn(), passes)
                if want is not None:
                    _bits_equal(fused, want, f"{what}: fused staging (two passes: {passes})")
            # ---- backward: both paths against the float64 index_add of every worker's staged gradient
            src = _source_index(gshape, pads, mode)
            ref = torch.zeros(LEAD + (math.prod(gshape),), dtype=torch.float64)
            for other in plan.blocks():
                ows = [per_axis[a][2][i] for a, i in enumerate(other)]
                if any(w is None for w in ows):
                    continue
                win = src[tuple(slice(a + lo, b + lo) for (a, b), (lo, _) in zip(ows, pads))].reshape(-1)
                g = _grad_of(other, LEAD + tuple(b - a for a, b in ows), dtype).double().reshape(LEAD + (-1,))
                keep = torch.from_numpy(win >= 0)
                ref.index_add_(2, torch.from_numpy(win)[keep], g[..., keep])
            ref = ref.reshape(LEAD + tuple(gshape))[(..., *(slice(*split(n, p)[i])
                                                         for n, p, i in zip(gshape, grid, index)))]
            assert torch.equal(ref.to(dtype).double(), ref), "test data: the reference sums must be exact"
            g = _grad_of(index, tuple(staged.shape), dtype)
            staged.backward(g)
            _bits_equal(xr.grad, ref.to(dtype), f"{what}: HaloExchange adjoint")
            _bits_equal(_fused_unstage(g, x.shape, plan, index, halo.world_of_fn()), ref.to(dtype),
                        f"{what}: fused unstage + accumulate")
            pieces = len(plan.pieces(index))
            assert pieces >= min_pieces, (what, pieces)
            done.append((mode, str(dtype), pieces))
    return (tuple(P_x.index[2:]) if P_x.active else None), done


CASES_16BIT = [
    # world, partition order (world ranks, row-major over the grid), grid, global spatial, kernel, stride,
    # dilation, padding (lo, hi) per axis
    pytest.param(4, [3, 1, 0, 2], (2, 2), (7, 9), (3, 4), (1, 2), (2, 1), ((2, 2), (1, 2)),
                 id="2d-2x2-unsorted-dilated-even-strided"),
    pytest.param(4, [2, 0, 3], (3,), (11,), (4,), (2,), (3,), ((4, 5),), id="1d-3-of-4-unsorted-idle-rank"),
    pytest.param(3, [1, 2, 0], (1, 3), (4, 8), (3, 5), (1, 1), (1, 2), ((1, 1), (4, 4)),
                 id="2d-1x3-unsorted-halo-wider-than-block"),
]


@pytest.mark.parametrize("world,order,grid,gshape,kernel,stride,dilation,pads", CASES_16BIT)
def test_16bit_halo_staging_and_adjoint_are_bit_exact(world, order, grid, gshape, kernel, stride, dilation, pads):
    modes = [m for m in MODES if m != "reflect" or all(max(p) < n for p, n in zip(pads, gshape))]
    out = run_ranks(world, _stage_on_ranks, order, grid, gshape, kernel, stride, dilation, pads, modes,
                    (torch.float16, torch.bfloat16))
    active = [done for idx, done in out if idx is not None]
    assert len(active) == math.prod(grid)
    assert all(len(done) == 2 * len(modes) for done in active)


CASES_3D = [
    # kernel 7 with dilation 2 (reach 12) over blocks of 3-4, kernel 5 with dilation 2 over blocks of 2-3
    pytest.param(8, [5, 2, 7, 0, 3, 6, 1, 4], (2, 2, 2), (7, 5, 5), (7, 5, 3), (1, 1, 1), (2, 2, 2),
                 ((6, 6), (4, 4), (2, 2)), 48, id="3d-2x2x2-k7d2-same-wide-halos"),
    pytest.param(6, [4, 1, 5, 0, 3, 2], (3, 2, 1), (8, 5, 4), (7, 5, 3), (2, 1, 1), (2, 2, 1),
                 ((6, 5), (4, 3), (1, 1)), 48, id="3d-3x2x1-k7d2-stride2-asym"),
]


@pytest.mark.parametrize("world,order,grid,gshape,kernel,stride,dilation,pads,min_pieces", CASES_3D)
def test_3d_wide_halos_many_boxes_match_global_pad(world, order, grid, gshape, kernel, stride, dilation, pads,
                                                   min_pieces):
    modes = [m for m in MODES if m != "reflect" or all(max(p) < n for p, n in zip(pads, gshape))]
    assert len(modes) == 4
    out = run_ranks(world, _stage_on_ranks, order, grid, gshape, kernel, stride, dilation, pads, modes,
                    (torch.float32,), min_pieces=min_pieces)
    active = [done for idx, done in out if idx is not None]
    assert len(active) == math.prod(grid)
    assert max(p for done in active for _, _, p in done) >= 2 * min_pieces  # dozens of boxes somewhere


# ------------------------------------------------------------------ bf16 rounding of the kernels (one process)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, numel, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(y_ptr + offs, cast_out(tl.load(x_ptr + offs, mask=mask), y_ptr.dtype.element_ty, ROUND_BF16),
             mask=mask)


def test_cast_out_equals_torch_rounding_on_random_bit_patterns():
    """``cast_out`` on 8192 fp32 values built bit by bit: exact ties with even and odd kept bits, one below and one
    above a tie, random low halves, every sign and exponent (subnormals, values that round up to infinity)."""
    g = torch.Generator().manual_seed(20261122)
    n = 8192
    hi = torch.randint(0, 0xFF80, (n,), generator=g, dtype=torch.int64)  # sign | exponent | kept mantissa, no NaN/inf
    hi = hi[((hi >> 7) & 0xFF) != 0xFF]
    lo = torch.randint(0, 0x10000, hi.shape, generator=g, dtype=torch.int64)
    k = hi.shape[0]
    lo[: k // 4] = 0x8000  # exact ties
    lo[k // 4: k // 3] = 0x7FFF
    lo[k // 3: k // 2] = 0x8001
    bits = ((hi << 16) | lo).to(torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    x = bits.view(torch.float32).contiguous()
    x = torch.cat([x, torch.tensor([3.4e38, -3.4e38, 1 + 2**-8 + 2**-9, 2**-130, -(2**-133)])])
    y = _nan(x.shape, torch.bfloat16)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), ROUND_BF16=round_bf16(torch.bfloat16),
                                                   BLOCK=1024)
    want = x.to(torch.bfloat16)
    assert (want.view(torch.int16) != (x.view(torch.int32) >> 16).to(torch.int16)).float().mean() > 0.3, \
        "test data: truncation must differ from rounding on many elements"
    _bits_equal(y, want, "cast_out(fp32 -> bf16) vs torch")


@pytest.mark.parametrize("mode", ["circular", "reflect"])
def test_conv_implicit_bf16_is_the_exact_conv_rounded_to_nearest_even(mode):
    """The implicit-GEMM kernel, called directly for both workers of a 1 x 2 grid (receive buffers cut from the
    neighbour's block): integer data make the fp32 accumulation exact, so the bf16 output must be the float64
    conv of the padded global input rounded by torch, bit for bit.  Output buffers start as NaN."""
    gshape, grid, kernel, pads = (5, 8), (1, 2), (3, 3), ((1, 1), (2, 2))
    plan = HaloPlan.for_conv(gshape, grid, kernel, (1, 1), (1, 2), pads, mode)
    gen = torch.Generator().manual_seed(3)

    def ints(shape, hi):
        return (torch.randint(1, hi + 1, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1))

    xg = ints((2, 3) + gshape, 30).to(torch.bfloat16)
    w = ints((4, 3) + kernel, 30).to(torch.bfloat16)
    b = ints((4,), 30).to(torch.bfloat16)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    exact = F.conv2d(F.pad(xg.double(), flat, mode=mode), w.double(), b.double(), dilation=(1, 2))
    ref = exact.to(torch.bfloat16)
    trunc = (exact.float().view(torch.int32) >> 16).to(torch.int16)
    assert (ref.view(torch.int16) != trunc).float().mean() > 0.2, "test data: truncation must differ from rounding"
    blocks = {(0, j): xg[..., :, slice(*split(8, 2)[j])].contiguous() for j in range(2)}
    outs = []
    windows = [brute_axis(n, p, k, 1, d, lo, hi)[2] for n, p, k, d, (lo, hi) in zip(gshape, grid, kernel, (1, 2), pads)]
    for idx, x in blocks.items():
        # the kernel trusts the plan's staged extent (its lookup tables are that long): check it first, so that a
        # wrong plan fails here instead of crashing the interpreter with an out-of-bounds table load
        assert plan.staged_shape(idx) == tuple(win[i][1] - win[i][0] for win, i in zip(windows, idx)), idx
        recv = [blocks[pc.src][(..., *pc.src_slices())].reshape(-1) for pc in plan.recvs(idx)]
        recv = torch.cat(recv) if recv else x.new_empty(0)
        y = _nan((2, 4) + plan.output_shape(idx), torch.bfloat16)
        assert conv_implicit(x, recv, w, b, plan, idx, (1, 1), (1, 2), out=y) is y
        outs.append(y)
    _bits_equal(torch.cat(outs, dim=-1), ref, f"conv_implicit (bf16, {mode})")


def test_fused_halo_accumulate_bf16_rounds_like_its_reference():
    """Replicate padding sums three staged gradients into each edge element in fp32; rounding that sum to bf16 must
    be round-to-nearest-even, as ``halo_accumulate_reference`` (torch) and the compiled kernel on a GPU do."""
    plan = HaloPlan.for_conv((6,), (1,), (3,), (1,), (1,), ((2, 2),), "replicate")
    g = torch.Generator().manual_seed(0)
    grad = torch.randn((4, 8, 10), generator=g).to(torch.bfloat16)
    u = hk.halo_unstage(grad, plan, (0,))
    got = hk.halo_accumulate(u.grad_x.clone(), u.self_boxes, grad.new_empty(0), plan, (0,))
    want = hk.halo_accumulate_reference(u.grad_x.clone(), u.self_boxes, grad.new_empty(0), plan, (0,))
    src = torch.tensor([0, 0, 0, 1, 2, 3, 4, 5, 5, 5])
    exact = torch.zeros(4, 8, 6, dtype=torch.float64).index_add_(2, src, grad.double())
    assert torch.equal(want, exact.to(torch.bfloat16))  # the reference: one rounding of the exact sum
    _bits_equal(got, want, "halo_accumulate (bf16) vs halo_accumulate_reference")
