"""The fused halo convolution on gloo ranks against the sequential torch convolution and the unfused path.

Each rank cuts its block from one global tensor (same seed everywhere), runs
:func:`halo_conv` forward and backward, and returns its output block and gradients.
The test process compares them with ``torch.nn.ConvNd(padding, padding_mode)`` (or
``F.pad`` + conv for asymmetric padding) on the global tensor in float64: the output
block, the input-gradient block, and the weight and bias gradients summed over the
workers (each worker returns its partial sums, as the layer would all-reduce them).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import ShapeError
from distfuse.fused.halo_conv import halo_conv
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import resolve_padding
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.testing import RankFailure, adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL, tol

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
MODULE = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


def _global_data(gshape, cout, kernel, groups):
    gen = torch.Generator().manual_seed(17)
    xg = torch.randn(gshape, generator=gen, dtype=torch.float64)
    w = torch.randn((cout, gshape[1] // groups) + tuple(kernel), generator=gen, dtype=torch.float64)
    b = torch.randn(cout, generator=gen, dtype=torch.float64)
    return xg, w, b, gen


def _sequential(xg, w, b, kernel, stride, dilation, padding, mode, groups):
    """The global reference: torch's ConvNd with padding_mode, or F.pad + conv for (lo, hi) pairs."""
    nd = len(kernel)
    if isinstance(padding, (int, str)):
        conv = MODULE[nd](xg.shape[1], w.shape[0], kernel, stride=stride, padding=padding, dilation=dilation,
                          groups=groups, padding_mode=mode, dtype=torch.float64)
        with torch.no_grad():
            conv.weight.copy_(w)
            conv.bias.copy_(b)
        return conv(xg), conv
    pads = resolve_padding(padding, kernel, dilation, stride)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    xp = F.pad(xg, flat) if mode == "zeros" else F.pad(xg, flat, mode=mode)
    return CONV[nd](xp, w, b, stride=stride, dilation=dilation, groups=groups), None


def _rank_case(grid, gshape, cout, kernel, stride, dilation, padding, mode, groups, dtype, overlap, unfused,
               channels_last=False):
    """One rank: the fused op's output block and gradients (and the unfused composition's, if asked).
    ``channels_last``: the block is channels last (the op reads the format from its strides)."""
    nd = len(kernel)
    P_x = Partition.world().create_partition_inclusive(range(math.prod(grid))).create_cartesian_topology_partition(
        grid)
    if not P_x.active:
        return None
    xg, w, b, gen = _global_data(gshape, cout, kernel, groups)
    halo = HaloExchange(P_x, kernel, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    plan = halo.plan(gshape)
    index = P_x.index[-nd:]
    # clone: .to() of the same dtype returns the very tensor, and two leaves would share one .grad
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}[nd] if channels_last else torch.contiguous_format
    x = xg[local_slices(gshape, grid, P_x.index)].to(dtype).clone(memory_format=fmt).requires_grad_(True)
    wl = w.to(dtype).clone().requires_grad_(True)
    bl = b.to(dtype).clone().requires_grad_(True)
    y = halo_conv(x, wl, bl, plan, index, halo.world_of_fn(), stride=stride, dilation=dilation, groups=groups,
                  overlap=overlap)
    assert y.shape[2:] == plan.output_shape(index), (y.shape, plan.output_shape(index))
    # The output gradient: a fixed random global tensor, this worker's block of it.
    dyg = torch.randn((gshape[0], cout) + plan.global_output_shape(), generator=gen, dtype=torch.float64)
    dy = dyg[local_slices(dyg.shape, grid, P_x.index)].to(dtype)
    y.backward(dy)
    if channels_last:  # the op keeps the layout both ways
        assert y.is_contiguous(memory_format=fmt) and x.grad.is_contiguous(memory_format=fmt)
    out = dict(y=y.detach(), gx=x.grad, gw=wl.grad, gb=bl.grad)
    if unfused:
        xu = x.detach().clone().requires_grad_(True)
        wu, bu = w.to(dtype).clone().requires_grad_(True), b.to(dtype).clone().requires_grad_(True)
        staged = halo(xu)
        # the fused op stages in the block's format too: the bit-for-bit check below compares one conv call with itself
        assert staged.is_contiguous(memory_format=fmt), (staged.shape, staged.stride())
        if 0 in staged.shape[2:]:
            # No output on this worker: the unfused layer's output is an empty block of the plan's output shape and
            # its weight and bias gradients have no terms.  The exchange still runs backward (the other workers
            # read this block), and the input gradient is the halo gradients they send back.
            assert 0 in plan.output_shape(index), (staged.shape, plan.output_shape(index))
            yu = torch.zeros((x.shape[0], cout) + plan.output_shape(index), dtype=dtype)
            staged.backward(torch.zeros_like(staged))
            out.update(yu=yu, gxu=xu.grad, gwu=torch.zeros_like(wu), gbu=torch.zeros_like(bu))
        else:
            yu = _unfused_conv(staged, wu, bu, stride, dilation, groups)
            yu.backward(dy)
            out.update(yu=yu.detach(), gxu=xu.grad, gwu=wu.grad, gbu=bu.grad)
    return out


def _unfused_conv(staged, w, b, stride, dilation, groups):
    """The unfused layer's convolution of the staged input (``layers._conv_common.conv_block``): torch's ConvNd,
    except that on CPU a 16-bit convolution is computed in fp32 and rounded once, as the fused op computes it.  The
    same staged bits through the same conv call give the same output bits on any CPU; torch's native 16-bit CPU
    kernels sum in an order that depends on the CPU (AVX-512 BF16, AMX or an AVX2 fallback)."""
    conv = CONV[staged.dim() - 2]
    if staged.device.type == "cpu" and staged.dtype in (torch.bfloat16, torch.float16):
        return conv(staged.float(), w.float(), b.float(), stride=stride, dilation=dilation,
                    groups=groups).to(staged.dtype)
    return conv(staged, w, b, stride=stride, dilation=dilation, groups=groups)


def _check(world, grid, gshape, cout, kernel, stride, dilation, padding, mode, groups=1, dtype=torch.float64,
           overlap=False, unfused=False, channels_last=False):
    results = run_ranks(world, _rank_case, grid, gshape, cout, kernel, stride, dilation, padding, mode, groups,
                        dtype, overlap, unfused, channels_last)
    xg, w, b, _ = _global_data(gshape, cout, kernel, groups)
    xg.requires_grad_(True)
    yg, _ = _sequential(xg, w, b, kernel, stride, dilation, padding, mode, groups)
    # The longest sums: an output sums C / groups * prod(kernel) products, a weight or bias gradient sums
    # B * prod(output extent) of them (per-worker partial sums added over the workers are the same terms in
    # another order).  The products are of unit-variance values (inputs rounded to dtype: two roundings of
    # each term), so the partial sums, and the absolute floor, are about sqrt(terms).
    terms = max(gshape[1] // groups * math.prod(kernel), gshape[0] * math.prod(yg.shape[2:]))
    t = tol(dtype, terms=terms, scale=math.sqrt(terms))
    rtol, atol = t["rtol"], t["atol"]
    both = dict(rtol=2 * rtol, atol=2 * atol)  # fused against unfused: two rounded results
    active = [r for r in results if r is not None]
    assert len(active) == math.prod(grid)
    gw = torch.zeros_like(w)
    gb = torch.zeros_like(b)
    for rank, r in enumerate(results):
        if r is None:
            continue
        idx = _index_of(grid, rank)
        ysl = local_slices(yg.shape, grid, idx)
        torch.testing.assert_close(r["y"].double(), yg.detach()[ysl], rtol=rtol, atol=atol, msg=f"y of rank {rank}")
        gw += r["gw"].double()
        gb += r["gb"].double()
        if unfused:
            # the same staged bits through the same convolution: the same output bits
            assert torch.equal(r["y"], r["yu"]), f"rank {rank}: fused and unfused outputs differ"
            torch.testing.assert_close(r["gx"], r["gxu"], **both, msg=f"rank {rank}: input gradients differ")
            torch.testing.assert_close(r["gw"], r["gwu"], **both)
    dyg = _dy(gshape, cout, kernel, groups, yg.shape)  # the output gradient the ranks drew
    yg.backward(dyg)
    for rank, r in enumerate(results):
        if r is None:
            continue
        xsl = local_slices(gshape, grid, _index_of(grid, rank))
        torch.testing.assert_close(r["gx"].double(), xg.grad[xsl], rtol=rtol, atol=atol, msg=f"grad x of rank {rank}")
    wref, bref = _weight_grads(xg.detach(), w, b, kernel, stride, dilation, padding, mode, groups, dyg)
    torch.testing.assert_close(gw, wref, rtol=rtol, atol=atol, msg="weight gradient (sum over workers)")
    torch.testing.assert_close(gb, bref, rtol=rtol, atol=atol, msg="bias gradient (sum over workers)")
    return results


def _dy(gshape, cout, kernel, groups, yshape):
    _, _, _, gen = _global_data(gshape, cout, kernel, groups)
    return torch.randn(yshape, generator=gen, dtype=torch.float64)


def _weight_grads(xg, w, b, kernel, stride, dilation, padding, mode, groups, dyg):
    w = w.clone().requires_grad_(True)
    b = b.clone().requires_grad_(True)
    pads = resolve_padding(padding, kernel, dilation, stride)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    xp = F.pad(xg, flat) if mode == "zeros" else F.pad(xg, flat, mode=mode)
    CONV[len(kernel)](xp, w, b, stride=stride, dilation=dilation, groups=groups).backward(dyg)
    return w.grad, b.grad


def _index_of(grid, rank):
    idx = []
    for p in reversed(grid):
        idx.append(rank % p)
        rank //= p
    return tuple(reversed(idx))


# world, grid (batch, channel, *spatial), global shape, cout, kernel, stride, dilation, padding
CASES = [
    pytest.param(4, (1, 1, 4), (2, 3, 17), 4, (3,), (1,), (1,), 1, id="1d-4w-uneven"),
    pytest.param(4, (1, 1, 2, 2), (1, 3, 9, 10), 2, (3, 3), (2, 1), (1, 2), 2, id="2d-2x2-stride-dilation"),
    pytest.param(4, (1, 1, 2, 1, 2), (1, 2, 5, 6, 7), 2, (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, id="3d-2x1x2"),
    pytest.param(5, (1, 1, 4), (1, 2, 9), 3, (5,), (1,), (2,), 4, id="1d-halo-wider-than-neighbour-inactive-rank"),
    pytest.param(4, (1, 1, 2, 2), (1, 3, 8, 7), 2, (2, 4), (1, 1), (1, 1), "same", id="2d-even-kernel-same"),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # the reference's own copy
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("world,grid,gshape,cout,kernel,stride,dilation,padding", CASES)
def test_fused_matches_sequential(world, grid, gshape, cout, kernel, stride, dilation, padding, mode):
    _check(world, grid, gshape, cout, kernel, stride, dilation, padding, mode)


def test_inactive_extra_rank_and_empty_worker():
    """World 5, grid of 4: rank 4 is inactive; extent 3 over 4 workers leaves worker 3 without output (the unfused
    composition too)."""
    res = _check(5, (1, 1, 4), (1, 2, 3), 2, (3,), (1,), (1,), 1, "replicate", unfused=True)
    assert res[4] is None
    assert res[3]["y"].shape == (1, 2, 0) and res[3]["gx"].shape == (1, 2, 0)


def test_even_kernel_asymmetric_padding_batch_split_groups():
    _check(4, (2, 1, 1, 2), (2, 4, 7, 9), 2, (2, 4), (1, 1), (1, 1), ((1, 0), (2, 1)), "reflect", groups=2)


@pytest.mark.parametrize("mode", ["replicate", "circular"])
def test_overlap_schedule_matches(mode):
    """The two-pass staging and the posted (async) exchanges of the CUDA schedule, run on gloo."""
    _check(4, (1, 1, 2, 2), (2, 3, 7, 8), 3, (3, 3), (1, 1), (1, 1), 2, mode, overlap=True, unfused=True)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_channels_last_matches_sequential_and_unfused(mode):
    """Channels-last blocks: the fused op (both schedules) against torch and the unfused composition, the layout
    kept by the output and the input gradient, 2-D and 3-D."""
    _check(4, (1, 1, 2, 2), (2, 3, 7, 8), 3, (3, 3), (1, 1), (1, 1), 2, mode, overlap=True, unfused=True,
           channels_last=True)
    _check(4, (1, 1, 2, 1, 2), (1, 2, 5, 6, 7), 2, (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, mode, channels_last=True)


def _frozen_weight_rank(grid, gshape, kernel, mode):
    """A channels-last block, a weight that needs no gradient (the staged input is not kept): the input gradient."""
    nd = len(kernel)
    P_x = Partition.world().create_partition_inclusive(range(math.prod(grid))).create_cartesian_topology_partition(
        grid)
    xg, w, _, gen = _global_data(gshape, 2, kernel, 1)
    halo = HaloExchange(P_x, kernel, padding=1, padding_mode=mode)
    plan, index = halo.plan(gshape), P_x.index[-nd:]
    x = xg[local_slices(gshape, grid, P_x.index)].clone(memory_format=torch.channels_last).requires_grad_(True)
    y = halo_conv(x, w, None, plan, index, halo.world_of_fn())
    dyg = torch.randn((gshape[0], 2) + plan.global_output_shape(), generator=gen, dtype=torch.float64)
    y.backward(dyg[local_slices(dyg.shape, grid, P_x.index)])
    return x.grad.is_contiguous(memory_format=torch.channels_last), x.grad


def test_channels_last_with_a_frozen_weight():
    """No weight gradient, so no staged input kept: the input gradient (dgrad from a stand-in of the staged
    input's layout) against float64 torch, channels last."""
    grid, gshape, kernel = (1, 1, 2, 2), (1, 3, 7, 6), (3, 3)
    results = run_ranks(4, _frozen_weight_rank, grid, gshape, kernel, "reflect")
    xg, w, b, gen = _global_data(gshape, 2, kernel, 1)
    xg.requires_grad_(True)
    yg, _ = _sequential(xg, w, b, kernel, (1, 1), (1, 1), 1, "reflect", 1)
    yg.backward(torch.randn(yg.shape, generator=gen, dtype=torch.float64))
    for rank, (kept_layout, gx) in enumerate(results):
        assert kept_layout, f"rank {rank}: the input gradient is not channels last"
        torch.testing.assert_close(gx, xg.grad[local_slices(gshape, grid, _index_of(grid, rank))], **tol(
            torch.float64, terms=2 * 9), msg=f"grad x of rank {rank}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_low_precision_against_sequential_and_unfused(dtype):
    _check(4, (1, 1, 2, 2), (1, 3, 8, 9), 2, (3, 3), (1, 1), (1, 1), 1, "replicate", dtype=dtype, unfused=True)


def _adjoint_rank(grid, gshape, kernel, padding, mode, channels_last=False):
    nd = len(kernel)
    P_x = Partition.world().create_partition_inclusive(range(math.prod(grid))).create_cartesian_topology_partition(
        grid)
    halo = HaloExchange(P_x, kernel, padding=padding, padding_mode=mode)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((2, gshape[1]) + tuple(kernel), generator=gen, dtype=torch.float64)
    if not P_x.active:
        return adjoint_check(lambda x: x, zero_volume_tensor(dtype=torch.float64))
    plan, index, world_of = halo.plan(gshape), P_x.index[-nd:], halo.world_of_fn()
    x = torch.randn(tuple(s.stop - s.start for s in local_slices(gshape, grid, P_x.index)),
                    generator=torch.Generator().manual_seed(5 + dist.get_rank()), dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return adjoint_check(lambda v: halo_conv(v, w, None, plan, index, world_of, channels_last=channels_last), x)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_dot_product_adjoint(mode, channels_last):
    """<F x, y> = <x, F* y> for the fused op as a linear map of x (bias None), inactive rank included, in both
    layouts."""
    lhs, rhs = run_ranks(5, _adjoint_rank, (1, 1, 2, 2), (1, 2, 6, 7), (3, 3), 2, mode, channels_last)[0]
    assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)
    assert abs(lhs) > 1e-3


def _bad_weight_rank():
    P_x = Partition.world().create_cartesian_topology_partition((1, 1, 2))
    halo = HaloExchange(P_x, (3,), padding=1)
    plan = halo.plan((1, 2, 8))
    x = torch.randn(1, 2, 4)
    halo_conv(x, torch.randn(2, 2, 5), None, plan, P_x.index[-1:], halo.world_of_fn())


def test_wrong_kernel_size_is_named():
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _bad_weight_rank)
    assert all("halo_conv [rank" in tb and "weight shape" in tb and ShapeError.__name__ in tb
               for tb in info.value.errors.values())


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["circular", "reflect"])
def test_fused_cuda_single_worker_realistic(mode, tmp_path):
    """One worker on the GPU, in this process (forked ranks cannot use CUDA once the parent has): borders wrap
    onto the worker itself, so every kernel and the overlap schedule run; no message is sent."""
    from distfuse.geometry.halo_plan import HaloPlan

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        gshape, cout, kernel = (2, 32, 96, 80), 32, (3, 3)
        xg, w, b, gen = _global_data(gshape, cout, kernel, 1)
        plan = HaloPlan.for_conv(gshape[2:], (1, 1), kernel, (1, 1), (1, 1), resolve_padding(1, kernel, (1, 1),
                                                                                             (1, 1)), mode)
        x = xg.float().cuda().requires_grad_(True)
        wl, bl = w.float().cuda().requires_grad_(True), b.float().cuda().requires_grad_(True)
        # cuDNN convolutions default to TF32 (torch.backends.cudnn.allow_tf32 is True): measured on an H100,
        # that alone puts 77% of the outputs 1e-4 off the float64 reference. Compare exact fp32 here.
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        try:
            y = halo_conv(x, wl, bl, plan, (0, 0), lambda idx: 0)
            dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
            y.backward(dy.float().cuda())
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
        xr = xg.clone().requires_grad_(True)
        yr, conv = _sequential(xr, w, b, kernel, (1, 1), (1, 1), 1, mode, 1)
        yr.backward(dy)
        # fp32 sums of unit-variance products (inputs rounded to fp32): an output sums C * prod(kernel) of them; an
        # input-gradient element at most Co * prod(kernel + 1) (padding 1, reflect: the element next to a border is
        # also the padding beyond it, read once more per axis), 512 here; a weight or bias gradient sums B * H * W
        # (stride 1, padding 1: the output's extent), 15360.  The partial sums, and the absolute floor, are about
        # sqrt(terms).
        short = max(gshape[1] * math.prod(kernel), cout * math.prod(k + 1 for k in kernel))
        long = gshape[0] * math.prod(gshape[2:])
        t = tol(torch.float32, terms=short, scale=math.sqrt(short))
        tw = tol(torch.float32, terms=long, scale=math.sqrt(long))
        torch.testing.assert_close(y.double().cpu(), yr.detach(), **t)
        torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **t)
        torch.testing.assert_close(wl.grad.double().cpu(), conv.weight.grad, **tw)
        torch.testing.assert_close(bl.grad.double().cpu(), conv.bias.grad, **tw)
    finally:
        if own_group:
            dist.destroy_process_group()
