"""The halo plan against a brute-force oracle that never calls the code under test (no ranks needed).

The oracle enumerates the convolution itself: the output extent is the number of
output positions ``o`` whose last tap ``o*s + d*(k-1)`` still lies in the padded input,
the outputs are split by the balanced rule written out here (first ``m % p`` blocks one
longer), and a worker's needed input range is the hull of the global indices its
outputs' kernel taps read, ``o*s + t*d - lo`` for every output ``o`` and tap ``t``.
Which value sits at a padded index comes from numpy's pad of an index array (``wrap``
wraps as often as needed: global circular padding).

Nothing here uses ``needed_range``, ``read_box`` or the decomposition helpers to build
an expectation: the plan's segments and pieces are expanded by the rules their
docstrings state (step +1 copy, -1 reversed, 0 one element repeated), and compared
position by position.  A window shifted by one, or an upper bound off by one, moves or
resizes the staged box and fails here even where the convolution result would not change
(an unread extra element with stride > 1).
"""

import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distfuse.geometry.halo_plan import AxisGeometry, HaloPlan, resolve_padding
from tests.tolerances import tol

MODES = ["zeros", "reflect", "replicate", "circular"]
NP_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


# ------------------------------------------------------------------ the oracle


def split(n, p):
    """Balanced blocks ``[(start, stop)]`` of ``n`` over ``p``: every block ``n // p``, the first ``n % p`` one more."""
    q, r = divmod(n, p)
    out, start = [], 0
    for i in range(p):
        e = q + (1 if i < r else 0)
        out.append((start, start + e))
        start += e
    return out


def owner(blocks, g):
    hits = [i for i, (a, b) in enumerate(blocks) if a <= g < b]
    assert len(hits) == 1, (blocks, g)
    return hits[0]


def brute_axis(n, p, k, s, d, lo, hi):
    """(m, output blocks, per worker the hull [a, b) of the global input indices read, or None)."""
    m = 0
    while m * s + d * (k - 1) <= n + lo + hi - 1:  # output m's last tap is inside the padded input
        m += 1
    out_blocks = split(m, p)
    windows = []
    for o0, o1 in out_blocks:
        reads = {o * s + t * d - lo for o in range(o0, o1) for t in range(k)}
        windows.append((min(reads), max(reads) + 1) if reads else None)
    return m, out_blocks, windows


def padded_source(n, lo, hi, mode):
    """``src[g + lo]`` = the global index whose value padded position ``g`` holds (-1: a zero)."""
    extra = {"constant_values": -1} if mode == "zeros" else {}
    return np.pad(np.arange(n), (lo, hi), mode=NP_MODE[mode], **extra)


def expand_segments(segs, in_blocks):
    """Global source index of every staged position, from the segments' documented rules (-1: zero fill)."""
    out = {}
    for seg in segs:
        for t in range(seg.length):
            if seg.src is None:
                v = -1
            else:
                local = {1: seg.lo + t, -1: seg.lo + seg.extent - 1 - t, 0: seg.lo}[seg.step]
                assert 0 <= local < in_blocks[seg.src][1] - in_blocks[seg.src][0], (seg, local)
                assert seg.extent == (1 if seg.step == 0 else seg.length), seg
                v = in_blocks[seg.src][0] + local
            assert seg.dst + t not in out, f"staged position {seg.dst + t} written twice"
            out[seg.dst + t] = v
    return [out[i] for i in range(len(out))] if out else []


def check_axis(n, p, k, s, d, lo, hi, mode):
    ax = AxisGeometry(n, p, k, s, d, lo, hi, mode)
    m, out_blocks, windows = brute_axis(n, p, k, s, d, lo, hi)
    in_blocks = split(n, p)
    src = padded_source(n, lo, hi, mode)
    what = f"n={n} p={p} k={k} s={s} d={d} pad=({lo},{hi}) {mode}"
    assert ax.m == m, what
    for i in range(p):
        assert ax.output_range(i) == out_blocks[i], (what, i)
        assert ax.input_range(i) == in_blocks[i], (what, i)
        staged = expand_segments(ax.segments(i), in_blocks)
        if windows[i] is None:
            assert staged == [], (what, i, staged)
            continue
        a, b = windows[i]
        want = [int(src[g + lo]) for g in range(a, b)]
        assert staged == want, f"{what}, worker {i}: staged sources {staged}, brute force {want} (window [{a}, {b}))"


# ------------------------------------------------------------------ 1-D: every geometry class, exhaustively sampled


def _axis_geometries():
    rng = random.Random(20261122)
    seen = set()
    out = []
    # hand-picked: wide dilated halos over tiny blocks, stride that trims, even kernels, empty tails
    out += [(9, 4, 5, 1, 2, 4, 4), (20, 4, 3, 1, 3, 3, 3), (19, 4, 3, 2, 2, 2, 2), (10, 2, 1, 3, 1, 0, 0),
            (12, 3, 2, 2, 2, 3, 1), (3, 5, 3, 1, 1, 1, 1), (7, 3, 7, 1, 2, 6, 6), (8, 3, 4, 3, 3, 2, 5),
            (11, 4, 2, 1, 4, 2, 2), (5, 2, 3, 2, 3, 0, 4), (13, 4, 4, 2, 3, 1, 0)]
    while len(out) < 2000:
        n = rng.randint(1, 13)
        p = rng.randint(1, 5)
        k = rng.randint(1, 5)
        s = rng.randint(1, 3)
        d = rng.randint(1, 4)
        lo, hi = rng.randint(0, 6), rng.randint(0, 6)
        g = (n, p, k, s, d, lo, hi)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def test_axis_plans_match_brute_force_over_many_geometries():
    """Every worker's staged sources, for ~2000 geometries x 4 padding modes (stride, dilation, even kernels,
    asymmetric padding, uneven and empty blocks, halos several blocks wide)."""
    checked = 0
    for n, p, k, s, d, lo, hi in _axis_geometries():
        for mode in MODES:
            if mode == "reflect" and max(lo, hi) >= n:
                continue  # torch's rule (the plan refuses it; tests/test_halo_plan.py checks the refusal)
            check_axis(n, p, k, s, d, lo, hi, mode)
            checked += 1
    assert checked > 6000


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_dilated_window_edges_are_taps(s, d):
    """Both ends of every worker's window are read by a kernel tap, and nothing outside it is."""
    for n, p, k in itertools.product((6, 11, 17), (2, 3, 4), (2, 3, 4)):
        lo = hi = d * (k - 1) // 2
        ax = AxisGeometry(n, p, k, s, d, lo, hi, "zeros")
        _, out_blocks, windows = brute_axis(n, p, k, s, d, lo, hi)
        for i, (o0, o1) in enumerate(out_blocks):
            length = sum(seg.length for seg in ax.segments(i))
            if o1 == o0:
                assert length == 0
                continue
            a, b = windows[i]
            first_tap, last_tap = o0 * s - lo, (o1 - 1) * s + d * (k - 1) - lo
            assert (a, b - 1) == (first_tap, last_tap)
            assert length == b - a, (n, p, k, s, d, i, length, (a, b))
            # the first staged position holds the first tap's value (a shift by one would hold its neighbour)
            segs = ax.segments(i)
            src = padded_source(n, lo, hi, "zeros")
            assert expand_segments(segs, split(n, p))[0] == int(src[a + lo])


# ------------------------------------------------------------------ N-D: pieces and the convolution itself

ND_CASES = [
    # global spatial, grid, kernel, stride, dilation, padding (lo, hi) per axis
    pytest.param((9, 11), (2, 3), (3, 3), (1, 1), (2, 1), ((2, 2), (1, 1)), id="2d-dilated-rows"),
    pytest.param((8, 7), (3, 2), (4, 2), (2, 1), (2, 3), ((3, 2), (1, 2)), id="2d-even-stride-dilation-asym"),
    pytest.param((10, 6), (4, 3), (5, 3), (3, 2), (2, 1), ((4, 4), (0, 2)), id="2d-stride3-trims"),
    pytest.param((5, 6, 7), (2, 2, 2), (3, 3, 3), (1, 2, 1), (1, 1, 2), ((1, 1), (1, 1), (2, 2)), id="3d-mixed"),
    pytest.param((7, 6, 8), (3, 2, 3), (7, 3, 5), (1, 1, 2), (2, 2, 1), ((6, 6), (2, 2), (2, 2)),
                 id="3d-k7-dil2-wide-halo"),
    pytest.param((4, 3, 6), (1, 3, 2), (2, 3, 3), (1, 1, 1), (1, 1, 1), ((0, 1), (1, 1), (1, 1)), id="3d-even-thin"),
    pytest.param((13,), (4,), (4,), (2,), (3,), ((4, 5),), id="1d-even-stride-dilation"),
]


def _expand_pieces(plan, idx, in_blocks, shape):
    """Global flat source index of every staged element (-1: zero), from the pieces' documented rules.

    ``shape`` is the brute-force window's: a piece outside it raises (IndexError)."""
    out = np.full(shape, -2, dtype=np.int64)
    gshape = tuple(ax.n for ax in plan.axes)
    for pc in plan.pieces(idx):
        for pos in itertools.product(*(range(e) for e in pc.shape)):
            dst = tuple(lo + t for lo, t in zip(pc.dst_lo, pos))
            assert out[dst] == -2, f"staged element {dst} of worker {idx} written twice"
            if pc.src is None:
                out[dst] = -1
                continue
            g = []
            for a, t in enumerate(pos):
                step, lo, ext = pc.steps[a], pc.src_lo[a], pc.src_shape[a]
                local = {1: lo + t, -1: lo + ext - 1 - t, 0: lo}[step]
                start, stop = in_blocks[a][pc.src[a]]
                assert 0 <= local < stop - start
                g.append(start + local)
            out[dst] = np.ravel_multi_index(tuple(g), gshape)
    assert (out != -2).all(), f"worker {idx}: staged elements never written"
    return out


def _brute_nd(gshape, grid, kernel, stride, dilation, pads, mode):
    plan = HaloPlan.for_conv(gshape, grid, kernel, stride, dilation, pads, mode)
    per_axis = [brute_axis(n, p, k, s, d, lo, hi)
                for n, p, k, s, d, (lo, hi) in zip(gshape, grid, kernel, stride, dilation, pads)]
    in_blocks = [split(n, p) for n, p in zip(gshape, grid)]
    idx_pad = np.pad(np.arange(math.prod(gshape)).reshape(gshape), pads, mode=NP_MODE[mode],
                     **({"constant_values": -1} if mode == "zeros" else {}))
    windows = {}
    for idx in itertools.product(*(range(p) for p in grid)):
        wins = [per_axis[a][2][i] for a, i in enumerate(idx)]
        if any(w is None for w in wins):
            windows[idx] = None
        else:
            windows[idx] = idx_pad[tuple(slice(w[0] + lo, w[1] + lo) for w, (lo, _) in zip(wins, pads))]
    return plan, per_axis, in_blocks, windows


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,pads", ND_CASES)
def test_nd_pieces_match_brute_force(gshape, grid, kernel, stride, dilation, pads, mode):
    if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, gshape)):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    plan, per_axis, in_blocks, windows = _brute_nd(gshape, grid, kernel, stride, dilation, pads, mode)
    assert plan.global_output_shape() == tuple(pa[0] for pa in per_axis)
    for idx, want in windows.items():
        assert plan.output_shape(idx) == tuple(pa[1][i][1] - pa[1][i][0] for pa, i in zip(per_axis, idx))
        if want is None:
            assert 0 in plan.staged_shape(idx), (idx, plan.staged_shape(idx))
            continue
        assert plan.staged_shape(idx) == want.shape, (idx, plan.staged_shape(idx), want.shape)
        got = _expand_pieces(plan, idx, in_blocks, want.shape)
        mism = np.argwhere(got != want)
        assert mism.size == 0, f"worker {idx}: {len(mism)} staged elements read the wrong source, first at " \
                               f"{tuple(mism[0])}: plan {got[tuple(mism[0])]}, brute force {want[tuple(mism[0])]}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,pads", ND_CASES)
def test_nd_staged_conv_equals_sequential_conv(gshape, grid, kernel, stride, dilation, pads, mode):
    """float64: each worker's conv over its staged input (assembled from the pieces alone) is exactly its block of
    the sequential convolution of the globally padded input, over output blocks split independently."""
    if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, gshape)):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    nd = len(gshape)
    plan, _, in_blocks, windows = _brute_nd(gshape, grid, kernel, stride, dilation, pads, mode)
    gen = torch.Generator().manual_seed(len(gshape) * 100 + MODES.index(mode))
    x = torch.randn((2, 3) + gshape, generator=gen, dtype=torch.float64)
    w = torch.randn((2, 3) + kernel, generator=gen, dtype=torch.float64)
    xp = torch.from_numpy(np.pad(x.numpy(), ((0, 0), (0, 0)) + tuple(pads), mode=NP_MODE[mode]))
    y = CONV[nd](xp, w, stride=stride, dilation=dilation)
    out_blocks = [split(m, p) for m, p in zip(y.shape[2:], grid)]
    flat = torch.cat([x.reshape(2, 3, -1), torch.zeros(2, 3, 1, dtype=torch.float64)], dim=2)  # index -1: zero
    for idx in plan.blocks():
        want = y[(..., *(slice(*out_blocks[a][i]) for a, i in enumerate(idx)))]
        if windows[idx] is None:
            assert want.numel() == 0 and 0 in plan.staged_shape(idx)
            continue
        src = torch.from_numpy(_expand_pieces(plan, idx, in_blocks, plan.staged_shape(idx)))
        staged = flat[:, :, src.reshape(-1)].reshape((2, 3) + tuple(src.shape))
        got = CONV[nd](staged, w, stride=stride, dilation=dilation)
        assert got.shape == want.shape, (idx, got.shape, want.shape)
        # the same float64 sums of 3 * prod(kernel) unit-variance products in another order
        terms = 3 * math.prod(kernel)
        torch.testing.assert_close(got, want, **tol(torch.float64, terms=terms, scale=math.sqrt(terms)))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("kernel,dilation", [((4,), (1,)), ((3,), (2,)), ((4,), (3,)), ((2, 3), (3, 2))])
def test_same_padding_matches_torch_same(kernel, dilation):
    """'same' resolves as torch's padding='same' does (even kernels pad more on the high side)."""
    nd = len(kernel)
    gshape = (9, 8)[:nd]
    pads = resolve_padding("same", kernel, dilation, (1,) * nd)
    x = torch.randn((1, 2) + gshape, dtype=torch.float64)
    w = torch.randn((3, 2) + kernel, dtype=torch.float64)
    ref = CONV[nd](x, w, padding="same", dilation=dilation)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    terms = 2 * math.prod(kernel)
    torch.testing.assert_close(CONV[nd](F.pad(x, flat), w, dilation=dilation), ref,
                               **tol(torch.float64, terms=terms, scale=math.sqrt(terms)))
    plan = HaloPlan.for_conv(gshape, (2,) * nd, kernel, (1,) * nd, dilation, pads, "zeros")
    assert plan.global_output_shape() == gshape
