"""HaloExchange on ranks: staged input + local conv equals the sequential padded conv; adjoint test."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import ShapeError
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import resolve_padding
from distfuse.primitives._layout import memory_format_of
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.testing import RankFailure, adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL, tol

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TORCH_MODE = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _global_padded(x, pads, mode):
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    if mode == "zeros":
        return F.pad(x, flat)
    return F.pad(x, flat, mode=TORCH_MODE[mode])


def _case(world, grid, shape, kernel, stride, dilation, padding, mode, dtype):
    nd = len(kernel)
    P = Partition.world().create_partition_inclusive(range(_volume(grid)))
    P_x = P.create_cartesian_topology_partition(grid)
    gen = torch.Generator().manual_seed(11)
    xg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()  # what the workers hold
    w = torch.randn((4, shape[1]) + tuple(kernel), generator=gen, dtype=torch.float64)
    pads = resolve_padding(padding, kernel, dilation, stride)
    yg = CONV[nd](_global_padded(xg, pads, mode), w, stride=stride, dilation=dilation)
    halo = HaloExchange(P_x, kernel, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    if not P_x.active:
        out = halo(zero_volume_tensor())
        return out.numel() == 0
    x = xg[local_slices(shape, grid, P_x.index)].to(dtype)
    staged = halo(x)
    y_ref_shape = tuple(sl.stop - sl.start for sl in local_slices(yg.shape, grid, P_x.index))
    if 0 in staged.shape[-nd:]:  # a worker with no outputs stages nothing
        assert 0 in y_ref_shape
        return True
    y = CONV[nd](staged.double(), w, stride=stride, dilation=dilation)
    y_ref = yg[local_slices(yg.shape, grid, P_x.index)]
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    # The exchange only moves values, so both sides are float64 convolutions of the same values, summed in
    # another order: sums of C * prod(kernel) unit-variance products, of typical size sqrt(terms).
    terms = shape[1] * math.prod(kernel)
    torch.testing.assert_close(y, y_ref, **tol(torch.float64, terms=terms, scale=math.sqrt(terms)))
    return True


def _volume(grid):
    v = 1
    for g in grid:
        v *= g
    return v


def _adjoint(grid, shape, kernel, stride, dilation, padding, mode):
    P_x = Partition.world().create_partition_inclusive(range(_volume(grid))).create_cartesian_topology_partition(grid)
    halo = HaloExchange(P_x, kernel, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    if P_x.active:
        x = torch.randn(tuple(e.stop - e.start for e in local_slices(shape, grid, P_x.index)), generator=gen)
    else:
        x = zero_volume_tensor()
    return adjoint_check(halo, x)


CASES = [
    # world, grid, global shape, kernel, stride, dilation, padding
    pytest.param(4, (1, 1, 4), (2, 3, 17), (3,), (1,), (1,), 1, id="1d-k3-p4"),
    pytest.param(3, (1, 1, 3), (2, 3, 16), (4,), (1,), (1,), "same", id="1d-even-same"),
    pytest.param(4, (1, 1, 4), (1, 2, 19), (3,), (2,), (2,), 2, id="1d-stride-dilation"),
    pytest.param(5, (1, 1, 4), (1, 2, 9), (5,), (1,), (2,), 4, id="1d-wide-halo-inactive-rank"),
    pytest.param(6, (1, 1, 2, 3), (2, 2, 9, 10), (3, 3), (1, 1), (1, 1), 1, id="2d-2x3"),
    pytest.param(4, (1, 1, 2, 2), (1, 3, 8, 7), (2, 4), (1, 1), (1, 1), "same", id="2d-even-same"),
    pytest.param(4, (2, 1, 1, 2), (2, 2, 7, 9), (3, 3), (2, 1), (1, 2), (1, 2), id="2d-batch-split-stride"),
    pytest.param(8, (1, 1, 2, 2, 2), (1, 2, 5, 6, 7), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, id="3d-2x2x2"),
    pytest.param(4, (1, 1, 4), (1, 1, 3), (3,), (1,), (1,), 1, id="1d-extent-smaller-than-partition"),
]


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("world,grid,shape,kernel,stride,dilation,padding", CASES)
def test_halo_conv_matches_sequential(world, grid, shape, kernel, stride, dilation, padding, mode):
    pads = resolve_padding(padding, kernel, dilation, stride)
    if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, shape[-len(kernel):])):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    for dtype in (torch.float32, torch.bfloat16):
        assert all(run_ranks(world, _case, world, grid, shape, kernel, stride, dilation, padding, mode, dtype))


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("world,grid,shape,kernel,stride,dilation,padding", CASES)
def test_halo_adjoint(world, grid, shape, kernel, stride, dilation, padding, mode):
    pads = resolve_padding(padding, kernel, dilation, stride)
    if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, shape[-len(kernel):])):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    lhs, rhs = run_ranks(world, _adjoint, grid, shape, kernel, stride, dilation, padding, mode)[0]
    assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)
    assert abs(lhs) > 1e-3  # a non-trivial operator


def _bad_block():
    P_x = Partition.world().create_cartesian_topology_partition((1, 1, 2))
    halo = HaloExchange(P_x, (3,), padding=1)
    # rank 0 holds 5 elements, rank 1 holds 2: not a balanced decomposition of 7
    x = torch.randn(1, 1, 5 if dist.get_rank() == 0 else 2)
    halo(x)


def test_unbalanced_blocks_are_rejected_on_every_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _bad_block)
    assert set(info.value.errors) == {0, 1}
    assert all("balanced decomposition" in tb and ShapeError.__name__ in tb for tb in info.value.errors.values())


def _both_forms(form, grid, shape, kernel, padding, mode, dtype, channels_last):
    """Forward and adjoint of the halo op pair on this rank in both forms of one choice, the staged input and the
    block's gradient the same bits, the gradient in the block's format:

    * ``packing``: every message made box by box, then packed by one gather (and on CPU the boxes that come back
      added by one indexed add); random values (the same terms in the same order);
    * ``gathering``: staged by views and concatenations, then by one gather (``distfuse.primitives._halo_gathering``);
      integer values (the adjoint's sums are in another order, exact on integers)."""
    from distfuse.primitives import _halo_gathering as gathering
    from distfuse.primitives import _halo_packing as packing

    table = {"packing": packing.PACKED_HALO_BYTES, "gathering": gathering.GATHERED_STAGING_BYTES}[form]
    nd = len(kernel)
    P_x = Partition.world().create_partition_inclusive(range(_volume(grid))).create_cartesian_topology_partition(grid)
    halo = HaloExchange(P_x, kernel, padding=padding, padding_mode=mode)
    if not P_x.active:
        return True
    gen = torch.Generator().manual_seed(17 + dist.get_rank())
    block = tuple(e.stop - e.start for e in local_slices(shape, grid, P_x.index))

    def values(shape, gen):
        return (torch.randn(shape, generator=gen) if form == "packing" else
                torch.randint(-4, 5, shape, generator=gen)).to(dtype)

    x = values(block, gen)
    if channels_last:
        x = x.contiguous(memory_format={2: torch.channels_last, 3: torch.channels_last_3d}[nd])
    results, saved = [], dict(table)
    try:
        for bound in (-1, 1 << 62):
            table["cpu"] = bound
            leaf = x.detach().requires_grad_(True)
            staged = halo(leaf)
            g = values(staged.shape, torch.Generator().manual_seed(3 + dist.get_rank()))
            (dx,) = torch.autograd.grad(staged, leaf, g)
            results.append((staged.detach(), dx))
    finally:
        table.clear()
        table.update(saved)
    (s0, d0), (s1, d1) = results
    assert torch.equal(s0, s1) and torch.equal(d0, d1), dist.get_rank()
    assert (x.numel() == 0 or d0.abs().sum() > 0) and d1.is_contiguous(memory_format=memory_format_of(x))
    return True


@pytest.mark.parametrize("form", ["packing", "gathering"])
@pytest.mark.parametrize("world,grid,shape,kernel,padding,mode,dtype,cl", [
    pytest.param(8, (1, 1, 2, 2, 2), (1, 2, 5, 6, 7), (3, 3, 3), 1, "circular", torch.float32, False, id="3d-circular"),
    pytest.param(6, (1, 1, 2, 3), (2, 2, 9, 10), (3, 5), 2, "reflect", torch.bfloat16, True,
                 id="2d-reflect-bf16-channels-last"),
    pytest.param(4, (1, 1, 2, 2), (1, 3, 5, 4), (5, 3), 2, "replicate", torch.float32, False,
                 id="2d-replicate-wide-halo"),
    pytest.param(4, (1, 1, 4), (1, 2, 3), (3,), 1, "zeros", torch.float32, False, id="1d-extent-smaller-than-grid"),
])
def test_both_forms_of_the_exchange_are_the_same_bits(form, world, grid, shape, kernel, padding, mode, dtype, cl):
    """Messages packed or box by box; small blocks staged by one gather or by views (see :func:`_both_forms`)."""
    assert all(run_ranks(world, _both_forms, form, grid, shape, kernel, padding, mode, dtype, cl))
