"""The halo geometry against a brute-force global reference (no ranks needed).

For every worker, the staged input assembled from the plan's pieces (read from the
owners' blocks) must equal the slice of the globally padded input that the worker's
output block reads.  numpy's pad modes give the global padding: ``constant`` (zeros),
``reflect`` (edge not repeated, as torch), ``edge`` (replicate) and ``wrap`` (circular,
any number of wraps).
"""

import itertools

import numpy as np
import pytest
import torch

from distfuse.errors import UnsupportedError
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import AxisGeometry, HaloPlan, conv_output_extent, read_box, resolve_padding

NP_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _check_plan(global_shape, grid, kernel, stride, dilation, padding, mode):
    pads = resolve_padding(padding, kernel, dilation, stride)
    plan = HaloPlan.for_conv(global_shape, grid, kernel, stride, dilation, pads, mode)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(global_shape)
    xp = np.pad(x, pads, mode=NP_MODE[mode])
    blocks = {idx: torch.from_numpy(x[local_slices(global_shape, grid, idx)]) for idx in plan.blocks()}
    # the output blocks tile the sequential output
    m = plan.global_output_shape()
    assert m == tuple(conv_output_extent(n, k, s, d, lo, hi)
                      for n, k, s, d, (lo, hi) in zip(global_shape, kernel, stride, dilation, pads))
    for idx in plan.blocks():
        staged = torch.full(plan.staged_shape(idx), float("nan"), dtype=torch.float64)
        for pc in plan.pieces(idx):
            if pc.src is None:
                staged[pc.dst_slices()] = 0.0
            else:
                staged[pc.dst_slices()] = read_box(blocks[pc.src][pc.src_slices()], pc)
        expect_slices = []
        for ax, i, (lo, _) in zip(plan.axes, idx, pads):
            a, b = ax.needed_range(i)
            expect_slices.append(slice(a + lo, b + lo))
        want = torch.from_numpy(xp[tuple(expect_slices)]) if all(
            s.stop > s.start for s in expect_slices) else torch.empty(plan.staged_shape(idx), dtype=torch.float64)
        assert staged.shape == want.shape, (idx, staged.shape, want.shape)
        torch.testing.assert_close(staged, want, rtol=0, atol=0)
        # every staged element written exactly once: pieces tile the staged box
        count = np.zeros(plan.staged_shape(idx), dtype=int)
        for pc in plan.pieces(idx):
            count[pc.dst_slices()] += 1
        assert (count == 1).all()
    # sends and receives pair up: what j sends to i is what i receives from j, in the same order
    for i, j in itertools.product(plan.blocks(), plan.blocks()):
        if i == j:
            continue
        got = [pc for pc in plan.recvs(i) if pc.src == j]
        sent = [pc for r, pc in plan.sends(j) if r == i]
        assert got == sent


CASES_1D = [
    # (n, p, k, stride, dilation, padding, id)
    (16, 4, 3, 1, 1, 1, "k3"),
    (17, 4, 4, 1, 1, "same", "even-kernel-same"),
    (17, 3, 3, 2, 1, 1, "stride2-uneven"),
    (20, 4, 3, 1, 3, 3, "dilation3"),
    (9, 4, 5, 1, 2, 4, "halo-wider-than-neighbour"),
    (10, 4, 3, 3, 1, 0, "stride-trims"),
    (3, 5, 3, 1, 1, 1, "extent-smaller-than-partition"),
    (7, 2, 1, 1, 1, 2, "k1-padding-only"),
    (12, 3, 2, 2, 2, (3, 1), "asymmetric-padding"),
]


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("n,p,k,s,d,pad", [c[:6] for c in CASES_1D], ids=[c[6] for c in CASES_1D])
def test_plan_1d(n, p, k, s, d, pad, mode):
    pads = resolve_padding(pad if not isinstance(pad, tuple) else (pad,), (k,), (d,), (s,))
    if mode == "reflect" and max(pads[0]) >= n:
        pytest.skip("reflect needs padding < extent (torch rule; covered by test_reflect_rejects_wide_padding)")
    _check_plan((n,), (p,), (k,), (s,), (d,), pads, mode)


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize(
    "shape,grid,kernel,stride,dilation,padding",
    [
        ((9, 11), (2, 3), (3, 3), (1, 1), (1, 1), 1),
        ((8, 7), (3, 2), (4, 2), (1, 1), (1, 1), "same"),
        ((13, 10), (2, 2), (3, 5), (2, 1), (1, 2), (1, 2)),
        ((5, 6, 7), (2, 2, 2), (3, 3, 3), (1, 2, 1), (1, 1, 2), 1),
        ((4, 3, 6), (1, 3, 2), (2, 3, 3), (1, 1, 1), (1, 1, 1), "same"),
    ],
    ids=["2d-3x3", "2d-even-same", "2d-stride-dilation", "3d-mixed", "3d-even-same-thin"],
)
def test_plan_nd(shape, grid, kernel, stride, dilation, padding, mode):
    _check_plan(shape, grid, kernel, stride, dilation, padding, mode)


def test_circular_wraps_from_the_last_worker():
    ax = AxisGeometry(n=12, p=3, kernel=3, pad_lo=1, pad_hi=1, mode="circular")
    first = ax.segments(0)
    assert first[0].src == 2 and first[0].length == 1  # element 11 lives on worker 2
    assert ax.segments(2)[-1].src == 0


def test_wide_halo_reaches_the_next_neighbour():
    # blocks of 2-3 elements, a halo of 4: worker 2 reads from workers 0 and 1
    ax = AxisGeometry(n=9, p=4, kernel=9, pad_lo=4, pad_hi=4)
    assert {seg.src for seg in ax.segments(2)} >= {0, 1, 2, 3}


def test_stride_trims_the_block():
    # stride 3, kernel 1: worker 0 owns inputs 0..4 but reads only 0 and 3
    ax = AxisGeometry(n=10, p=2, kernel=1, stride=3)
    a, b = ax.needed_range(0)
    assert ax.input_range(0) == (0, 5) and (a, b) == (0, 4)


def test_reflect_rejects_wide_padding():
    with pytest.raises(UnsupportedError, match="smaller than the global input extent"):
        AxisGeometry(n=3, p=2, kernel=3, pad_lo=3, pad_hi=3, mode="reflect")


def test_same_padding_needs_stride_one():
    with pytest.raises(UnsupportedError, match="stride 1"):
        resolve_padding("same", (3,), (1,), (2,))


def test_bad_padding_mode():
    with pytest.raises(UnsupportedError, match="padding_mode"):
        AxisGeometry(n=3, p=1, kernel=1, mode="symmetric")
