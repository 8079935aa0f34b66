"""Halo kernels against their torch references and against a global index oracle, in one process.

A plan describes every worker of its grid, so one process plays all of them: each
worker's block is cut from a global tensor, its receive buffer is assembled from the
owners' *packed* send buffers (so pack order and receive order must agree), and the
send-back gradients of unstage are routed to their owners for accumulate.

The oracle does not use the plan: numpy pads a global array of flat *indices* with the
padding mode (``wrap`` repeats as often as needed, as global circular padding does), so
a worker's staged input is ``x.flat[window]`` (0 where the index is -1) and the input
gradient is an ``index_add`` of every worker's staged gradient.  Outputs are poisoned
with NaN before every launch.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from distfuse.errors import ShapeError, UnsupportedError
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import HaloPlan, resolve_padding
from distfuse.kernels import halo as hk
from distfuse.kernels import halo_launches as hl
from distfuse.kernels import halo_programs as hp
from distfuse.kernels import halo_tables as ht
from tests.tolerances import tol

NP_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
MODES = ["zeros", "reflect", "replicate", "circular"]


def _nan(shape, dtype, device):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _plan(gshape, grid, kernel, stride, dilation, padding, mode):
    pads = resolve_padding(padding, kernel, dilation, stride)
    return HaloPlan.for_conv(gshape, grid, kernel, stride, dilation, pads, mode), pads


def _oracle_windows(plan, pads, gshape, mode):
    """Per worker, the global flat index each staged element reads (-1: zero fill)."""
    idx = np.arange(math.prod(gshape)).reshape(gshape)
    extra = {"constant_values": -1} if mode == "zeros" else {}
    padded = np.pad(idx, pads, mode=NP_MODE[mode], **extra)
    out = {}
    for i in plan.blocks():
        sl = []
        for ax, j, (lo, _) in zip(plan.axes, i, pads):
            a, b = ax.needed_range(j)
            sl.append(slice(a + lo, b + lo))
        win = padded[tuple(sl)] if all(s.stop > s.start for s in sl) else np.zeros(plan.staged_shape(i), dtype=int)
        out[i] = torch.from_numpy(np.ascontiguousarray(win)).long()
    return out


def _gather(xg_flat, window):
    """``[LEAD, *window.shape]``: the global tensor read through the window (0 at -1)."""
    vals = xg_flat[:, window.clamp(min=0).reshape(-1)].reshape(xg_flat.shape[:1] + tuple(window.shape))
    return torch.where(window >= 0, vals, torch.zeros((), dtype=vals.dtype))


def _queues(plan, flat_of, order_of):
    """Split each worker's flat buffer into its boxes, queued per (sender, receiver) pair."""
    q = {}
    for i in plan.blocks():
        entries = order_of(i)
        views = hk._split(flat_of[i], [pc.src_shape for _, pc in entries], flat_of["lead_shape"])
        for (peer, _), v in zip(entries, views):
            q.setdefault((i, peer), []).append(v)
    return q


def _nchw_order(buf, shapes, lead_shape):
    """A flat buffer of channels-last boxes ``[B, *box, C]`` rewritten box by box in NCHW order ``[B, C, *box]``
    (the references' order), by torch's own permutes: independent of the kernels' channel arithmetic."""
    B, C = lead_shape
    offs, _ = ht.box_offsets(shapes, B * C)
    parts = [buf[o: o + B * C * math.prod(s)].view(B, *s, C).movedim(-1, 1).reshape(-1)
             for o, s in zip(offs, shapes)]
    return torch.cat(parts) if parts else buf[:0]


def _simulate(gshape, grid, kernel, stride, dilation, padding, mode, dtype, lead_shape=(2, 3), device="cpu",
              tile=None, block=None, channels_last=False):
    """Run pack, stage, unstage and accumulate for every worker; check each against its reference and the oracle.

    ``channels_last``: blocks, staged tensors and gradients dense in channels-last order (``lead_shape`` is
    ``(B, C)``), every flat buffer in ``[B, *box, C]`` order; the references see the same values in NCHW order."""
    plan, pads = _plan(gshape, grid, kernel, stride, dilation, padding, mode)
    windows = _oracle_windows(plan, pads, gshape, mode)
    gen = torch.Generator().manual_seed(1234)
    lead = math.prod(lead_shape)
    xg = torch.randn(lead_shape + tuple(gshape), generator=gen, dtype=torch.float64).to(dtype)
    fmt = hk.CHANNELS_LAST[len(gshape)] if channels_last else torch.contiguous_format
    blocks = {i: xg[(..., *local_slices(gshape, grid, i))].contiguous(memory_format=fmt).to(device)
              for i in plan.blocks()}
    t = tol(dtype)
    dev = torch.device(device)

    def nchw(buf, pieces):
        return _nchw_order(buf, [pc.src_shape for pc in pieces], lead_shape) if channels_last else buf

    def poisoned(shape):
        return _nan(shape, dtype, dev).contiguous(memory_format=fmt)

    # forward: pack every worker, route the boxes, stage
    packed = {"lead_shape": lead_shape}
    for i, x in blocks.items():
        out = _nan(ht.send_numel(plan, i, lead), dtype, dev)
        packed[i] = hk.halo_pack(x, plan, i, out=out, block=block, channels_last=channels_last)
        assert packed[i] is out
        assert torch.equal(nchw(packed[i], [pc for _, pc in plan.sends(i)]), hk.halo_pack_reference(x, plan, i)), \
            ("pack", i)
    q = _queues(plan, packed, lambda i: plan.sends(i))
    xg_flat = xg.reshape(lead, -1).to(torch.float64)
    grads, unstaged = {}, {}
    for i, x in blocks.items():
        boxes = [q[(pc.src, i)].pop(0).reshape(-1) for pc in plan.recvs(i)]
        recv = torch.cat(boxes) if boxes else x.new_empty(0)
        out = poisoned(lead_shape + plan.staged_shape(i))
        staged = hk.halo_stage(x, recv, plan, i, out=out, tile=tile, channels_last=channels_last)
        assert torch.equal(staged, hk.halo_stage_reference(x, nchw(recv, plan.recvs(i)), plan, i)), ("stage", i)
        want = _gather(xg_flat, windows[i]).reshape(staged.shape)
        assert torch.equal(staged.cpu().to(torch.float64), want), ("stage vs oracle", i)

        # backward, part 1: unstage into poisoned buffers
        g = torch.randn(staged.shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
        g = g.contiguous(memory_format=fmt)
        grads[i] = g
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        u = hk.halo_unstage(g, plan, i, grad_x=poisoned(x.shape),
                            send=_nan(ht.recv_numel(plan, i, lead), dtype, dev),
                            self_boxes=_nan(ht.self_numel(plan, i, lead), acc, dev), tile=tile, block=block,
                            channels_last=channels_last)
        ref = hk.halo_unstage_reference(g, plan, i)
        in_nchw = (u.grad_x, nchw(u.send, plan.recvs(i)), nchw(u.self_boxes, ht.self_pieces(plan, i)))
        for name, got, exp in zip(u._fields, in_nchw, ref):
            torch.testing.assert_close(got, exp, **t, msg=f"unstage {name} of worker {i}")
        unstaged[i] = u

    # backward, part 2: route the send-back boxes to their owners, accumulate
    sent_back = {"lead_shape": lead_shape, **{i: u.send for i, u in unstaged.items()}}
    q = _queues(plan, sent_back, lambda i: [(pc.src, pc) for pc in plan.recvs(i)])
    grad_global = torch.zeros(lead, math.prod(gshape), dtype=torch.float64)
    for i, u in unstaged.items():
        boxes = [q[(r, i)].pop(0).reshape(-1) for r, _ in plan.sends(i)]
        incoming = torch.cat(boxes) if boxes else u.grad_x.new_empty(0)
        before = u.grad_x.clone()
        got = hk.halo_accumulate(u.grad_x, u.self_boxes, incoming, plan, i, block=block, channels_last=channels_last)
        assert got is u.grad_x  # in place
        exp = hk.halo_accumulate_reference(before, nchw(u.self_boxes, ht.self_pieces(plan, i)),
                                           nchw(incoming, [pc for _, pc in plan.sends(i)]), plan, i)
        torch.testing.assert_close(got, exp, **t, msg=f"accumulate of worker {i}")
        view = grad_global.view(lead_shape + tuple(gshape))
        view[(..., *local_slices(gshape, grid, i))] = got.cpu().to(torch.float64)
    assert all(not v for v in q.values())  # every message was consumed

    # the oracle: index_add of every staged gradient at the global index it was read from
    want = torch.zeros(lead, math.prod(gshape), dtype=torch.float64)
    abs_sum = torch.zeros_like(want)
    for i, g in grads.items():
        w = windows[i].reshape(-1)
        keep = w >= 0
        g64 = g.cpu().to(torch.float64).reshape(lead, -1)[:, keep]
        want.index_add_(1, w[keep], g64)
        abs_sum.index_add_(1, w[keep], g64.abs())
    # Each term is rounded at most once on the way (the send-back buffer is in the
    # gradient's dtype) and the sum once more, so |error| <= rtol * sum |terms|.
    err = (grad_global - want).abs()
    bound = t["rtol"] * abs_sum + t["atol"]
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    return plan


# global shape, grid, kernel, stride, dilation, padding
CASES = [
    pytest.param((17,), (3,), (3,), (1,), (1,), 1, id="1d-k3-uneven"),
    pytest.param((19,), (4,), (3,), (2,), (2,), 2, id="1d-stride2-dilation2"),
    pytest.param((9,), (4,), (5,), (1,), (2,), 4, id="1d-halo-wider-than-neighbour"),
    pytest.param((16,), (3,), (4,), (1,), (1,), "same", id="1d-even-kernel-same"),
    pytest.param((12,), (3,), (2,), (2,), (2,), ((3, 1),), id="1d-asymmetric"),
    pytest.param((6,), (1,), (3,), (1,), (1,), 2, id="1d-one-worker-self-wrap"),
    pytest.param((12,), (3,), (1,), (1,), (1,), 0, id="1d-zero-width-halo"),
    pytest.param((3,), (5,), (3,), (1,), (1,), 1, id="1d-extent-smaller-than-grid"),
    pytest.param((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, id="2d-2x3"),
    pytest.param((8, 7), (2, 2), (2, 4), (2, 1), (1, 2), ((1, 0), (2, 3)), id="2d-even-asym-stride-dilation"),
    pytest.param((5, 6, 7), (2, 1, 2), (3, 2, 3), (1, 2, 1), (1, 1, 2), 2, id="3d-2x1x2"),
    pytest.param((4, 5, 6), (2, 2, 2), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, id="3d-2x2x2-corners"),
]


def _reflect_ok(gshape, kernel, stride, dilation, padding):
    pads = resolve_padding(padding, kernel, dilation, stride)
    return all(max(p) < n for p, n in zip(pads, gshape))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,padding", CASES)
def test_kernels_fp32(gshape, grid, kernel, stride, dilation, padding, mode):
    if mode == "reflect" and not _reflect_ok(gshape, kernel, stride, dilation, padding):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    _simulate(gshape, grid, kernel, stride, dilation, padding, mode, torch.float32)


DTYPE_CASES = [
    pytest.param((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 2, "replicate", id="2d-replicate"),
    pytest.param((5, 6, 7), (2, 1, 2), (3, 2, 3), (1, 2, 1), (1, 1, 2), 2, "reflect", id="3d-reflect"),
    pytest.param((7,), (2,), (3,), (1,), (1,), 3, "circular", id="1d-circular-wraps-more-than-a-block"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=["fp16", "bf16", "fp64"])
@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,padding,mode", DTYPE_CASES)
def test_kernels_dtypes(gshape, grid, kernel, stride, dilation, padding, mode, dtype):
    _simulate(gshape, grid, kernel, stride, dilation, padding, mode, dtype)


def test_kernels_many_small_tiles():
    """Tiles far smaller than the tensors: masks at every tile edge, boxes spanning programs."""
    _simulate((7, 6), (2, 2), (3, 3), (1, 1), (1, 1), 2, "replicate", torch.float32, lead_shape=(1,),
              tile=(2, 4), block=8)
    _simulate((4, 5, 5), (2, 1, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "circular", torch.float32,
              lead_shape=(1,), tile=(4, 2), block=16)


@pytest.fixture
def per_box(monkeypatch):
    """The GPUs' form of the box gather and the accumulate (programs per box and per cell) under the interpreter,
    whose own default is one program searching every element's box: the launches are cached, so the caches are
    cleared on both sides."""
    monkeypatch.setattr(hl, "BOX_PROGRAMS", True)
    caches = (hl.pack_launch, hl.unstage_launch, hl.accumulate_launch)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_kernels_with_programs_per_box(per_box, monkeypatch):
    """Pack, unstage and accumulate in the GPUs' form, against their references: 2-D replicate at halo 2 (runs that
    sum several staged elements, overlapping boxes), 3-D circular (self boxes), bf16 channels last; small program
    blocks, so boxes span several programs beside boxes smaller than one; spilled grids."""
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 2, "replicate")
    launches = (hl.unstage_launch(plan, (1, 1), 16, torch.device("cpu"), "all", 16).boxes,
                hl.accumulate_launch(plan, (1, 1), 16, torch.device("cpu"), 16))
    assert all(launch.meta["PER_BOX"] for launch in launches)  # the form asked for, not a silent fallback
    assert math.prod(launches[1].grid) > len(ht.accumulate_tables(plan, (1, 1), 16, torch.device("cpu"))[0])
    _simulate((5, 6, 7), (2, 1, 2), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "circular", torch.float32,
              lead_shape=(1, 2), block=64)
    _simulate((6, 8), (2, 2), (3, 3), (1, 1), (1, 1), 1, "reflect", torch.bfloat16, lead_shape=(2, 4), block=16,
              channels_last=True)
    monkeypatch.setattr(hp, "_GRID0_MAX", 3)  # spilled grids: the surplus programs past the table write nothing
    _simulate((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 2, "replicate", torch.float32, lead_shape=(1, 4), block=8)


def test_unstage_window_both_ways(monkeypatch):
    """The unstage's interior window is copied by the box gather launch (one more box: small windows, what every
    other test here runs) or by torch's strided copy (large ones, run here with the limit at 0): against the
    references and the oracle, into poisoned buffers, in both box forms; a worker whose interior does not cover its
    block (stride 4: the conv skips some of it) or who has none always takes the copy and the zero fill; and the two
    ways agree bit for bit."""
    window_elements, other_way = 0, hl.UNSTAGE_WINDOW_ELEMENTS
    monkeypatch.setattr(hl, "UNSTAGE_WINDOW_ELEMENTS", window_elements)
    monkeypatch.setattr(hl, "unstage_box_tables", ht.unstage_box_tables.__wrapped__)
    hl.unstage_launch.cache_clear()  # a cached launch reads the setting when it is built
    try:
        _unstage_window_both_ways(window_elements, other_way, monkeypatch)
    finally:
        for cache in (hl.pack_launch, hl.unstage_launch, hl.accumulate_launch):
            cache.cache_clear()


def _unstage_window_both_ways(window_elements, other_way, monkeypatch):
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "reflect")
    cpu = torch.device("cpu")
    launch = hl.unstage_launch(plan, (1, 1), 2, cpu, "all", None)
    assert launch.window_in_boxes == (window_elements > 0) and (launch.interior_dst is None) == launch.window_in_boxes
    assert not hl.unstage_launch(plan, (1, 1), 2, cpu, "remote", None).window_in_boxes
    strided, _ = _plan((16,), (4,), (3,), (4,), (1,), 1, "zeros")
    for i in strided.blocks():  # the interior covers part of the block: a copy into the zero-filled grad_x
        launch = hl.unstage_launch(strided, i, 2, cpu, "all", None)
        assert launch.zero_grad_x and launch.interior_dst is not None and not launch.window_in_boxes
    _simulate((16,), (4,), (3,), (4,), (1,), 1, "zeros", torch.float32)
    _simulate((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 2, "circular", torch.float32, lead_shape=(1, 2), block=64)
    monkeypatch.setattr(hl, "BOX_PROGRAMS", True)
    _simulate((6, 8), (2, 2), (3, 3), (1, 1), (1, 1), 1, "reflect", torch.bfloat16, lead_shape=(2, 4), block=16,
              channels_last=True)
    g = torch.randn((2, 3) + tuple(plan.staged_shape((1, 1))), dtype=torch.bfloat16)
    got = hk.halo_unstage(g, plan, (1, 1), grad_x=_nan((2, 3) + tuple(plan.input_shape((1, 1))), g.dtype, g.device))
    monkeypatch.setattr(hl, "UNSTAGE_WINDOW_ELEMENTS", other_way)
    hl.unstage_launch.cache_clear()
    other = hk.halo_unstage(g, plan, (1, 1))
    assert hl.unstage_launch(plan, (1, 1), 6, cpu, "all", None).window_in_boxes == (other_way > 0)
    assert all(torch.equal(a, b) for a, b in zip(got, other))


def test_kernels_with_a_spilled_grid(monkeypatch):
    """Grid axis 0 capped at 3 programs: the rest go to axis 1, every tile is still written once (outputs start
    as NaN) and the surplus programs of a rounded-up grid write nothing; row-tiled and linear launches both."""
    monkeypatch.setattr(hp, "_GRID0_MAX", 3)
    calls = []  # (launch kind, programs, grid)
    linear, row_tiled = hp.linear_grid, hp.row_tiled_grid

    def record_linear(programs):
        calls.append(("box", programs, linear(programs)))
        return calls[-1][2]

    def record_rows(*args):
        grid = row_tiled(*args)  # goes through record_linear
        calls[-1] = ("rows",) + calls[-1][1:]
        return grid

    monkeypatch.setattr(hp, "linear_grid", record_linear)
    monkeypatch.setattr(hp, "row_tiled_grid", record_rows)
    monkeypatch.setattr(hl, "linear_grid", record_linear)  # the box and accumulate launches import it by name
    # 1x2 tiles keep the grids past the cap (the staging's one launch numbers its programs like the box gather)
    _simulate((7, 6), (2, 2), (3, 3), (1, 1), (1, 1), 2, "replicate", torch.float32, lead_shape=(1,),
              tile=(1, 2), block=2)
    # stride 4: worker 1 has no interior window, so its staging is the row-tiled table walk
    _simulate((7,), (4,), (3,), (4,), (1,), 0, "zeros", torch.float32, lead_shape=(5,), tile=(1, 2), block=2)
    for kind in ("rows", "box"):
        assert any(g1 > 1 and g0 * g1 > n for k, n, (g0, g1) in calls if k == kind), (kind, calls)
    assert all(g0 <= 3 and g0 * g1 >= n for _, n, (g0, g1) in calls)


@pytest.mark.parametrize("n_rows,inner,tile", [
    pytest.param(6, 3 * 2**24, None, id="1d-50M-long-6-rows"),
    pytest.param(1, 2**31 - 1, None, id="1d-int32-max-long"),
    pytest.param(64 * 512 * 512, 512, None, id="3d-16M-rows"),
    pytest.param(2**20, 2**20, (1, 16), id="2^36-programs-spill-to-axis-1"),
])
def test_launch_grids_stay_within_cuda_limits(n_rows, inner, tile):
    """Grids for huge extents (computed, not launched): at most 2^31 - 1 programs on axis 0 and 65535 on axis 1,
    and every tile gets a program.  The 1-D cases used to put their column tiles on axis 1 alone."""
    cuda = torch.device("cuda")  # only selects _tile's GPU tile sizes; no GPU is touched
    block_r, block_x = hp.pick_tile(inner, n_rows, cuda, tile)
    tiles = -(-n_rows // block_r) * -(-inner // block_x)
    g0, g1 = hp.row_tiled_grid(n_rows, inner, block_r, block_x)
    assert 1 <= g0 <= 2**31 - 1 and 1 <= g1 <= 65535
    assert tiles <= g0 * g1 < tiles + g1  # every tile has a program; fewer surplus programs than rows of axis 1
    assert (g1 > 1) == (tiles > 2**31 - 1)
    # the box gather (pack, unstage) numbers its programs the same way
    total = n_rows * inner
    programs = -(-total // hp.box_block(cuda, tile and tile[1], total))
    g0, g1 = hp.linear_grid(programs)
    assert 1 <= g0 <= 2**31 - 1 and 1 <= g1 <= 65535
    assert programs <= g0 * g1 < programs + g1  # every block of elements has a program


def test_launch_grid_beyond_cuda_raises():
    assert hp.linear_grid((2**31 - 1) * 65535) == (2**31 - 1, 65535)
    with pytest.raises(UnsupportedError, match="exceed a CUDA grid"):
        hp.linear_grid((2**31 - 1) * 65535 + 1)


def test_kernels_leading_dims_flatten():
    """Three leading dims are one LEAD axis; a lone worker stages every border from itself."""
    _simulate((8, 5), (1, 2), (3, 3), (1, 1), (1, 1), 1, "circular", torch.float32, lead_shape=(2, 1, 3))


@pytest.mark.parametrize("seed", range(4))
def test_accumulate_cells_match_a_brute_force_cover(seed):
    """The cells tile exactly the covered elements, each with the boxes that cover it in ascending order, against
    a per-element cover computed box by box (random overlapping boxes, 1-3 axes)."""
    gen = np.random.default_rng(seed)
    nd = 1 + seed % 3
    shape = tuple(int(v) for v in gen.integers(1, 7, nd))
    boxes = []
    for _ in range(int(gen.integers(1, 9))):
        lo = [int(gen.integers(0, n)) for n in shape]
        boxes.append((lo, [int(gen.integers(1, n - a + 1)) for a, n in zip(lo, shape)]))
    want = np.empty(shape, dtype=object)
    for p in np.ndindex(*shape):
        want[p] = tuple(k for k, (lo, sh) in enumerate(boxes) if all(b <= c < b + s for c, b, s in zip(p, lo, sh)))
    seen = np.zeros(shape, dtype=int)
    for origin, extent, ks in ht.accumulate_cells(shape, boxes):
        assert ks and list(ks) == sorted(ks)
        for p in itertools.product(*(range(o, o + e) for o, e in zip(origin, extent))):
            p = p[3 - nd:]
            assert want[p] == ks, (p, want[p], ks)
            seen[p] += 1
    covered = np.vectorize(bool)(want)
    assert (seen[covered] == 1).all() and (seen[~covered] == 0).all()


@pytest.mark.parametrize("case", ["2d-replicate", "3d-circular-124-boxes"])
def test_accumulate_sums_every_box_in_one_launch(case, monkeypatch):
    """Overlapping boxes summed in one launch and one rounding, whatever their number: replicate at halo 2 over
    small blocks (several boxes per element), and circular at halo 2 over one-element blocks (124 boxes on one
    element; the earlier bitmask design took one launch and one rounding per 62).  Elements no box covers keep
    their bits: NaN stays NaN there, and no covered element turns NaN."""
    if case == "2d-replicate":
        plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 2, "replicate")
    else:
        plan, _ = _plan((3, 3, 3), (3, 3, 3), (5, 5, 5), (1, 1, 1), (1, 1, 1), 2, "circular")
    i = max(plan.blocks(), key=lambda i: len(ht.accumulate_boxes(plan, i, 1)))
    boxes = ht.accumulate_boxes(plan, i, 1)
    cells = ht.accumulate_cells(plan.input_shape(i), [(pc.src_lo, pc.src_shape) for _, _, pc in boxes])
    most = max(len(ks) for _, _, ks in cells)  # boxes summed into one element, beside its own value
    assert most >= (3 if case == "2d-replicate" else 124)
    n = plan.input_shape(i)
    gen = torch.Generator().manual_seed(3)
    grad_x = torch.randn((2,) + n, generator=gen, dtype=torch.float64)
    self_boxes = torch.randn(ht.self_numel(plan, i, 2), generator=gen, dtype=torch.float64)
    incoming = torch.randn(ht.send_numel(plan, i, 2), generator=gen, dtype=torch.float64)
    want = hk.halo_accumulate_reference(grad_x, self_boxes, incoming, plan, i)
    launches = []
    real = hl.launch_accumulate
    monkeypatch.setattr(hk, "launch_accumulate", lambda *args: launches.append(1) or real(*args))
    got = hk.halo_accumulate(grad_x.clone(), self_boxes, incoming, plan, i)
    assert len(launches) == 1
    torch.testing.assert_close(got, want, **tol(torch.float64, terms=most + 1))
    covered = torch.zeros(n, dtype=torch.bool)
    for origin, extent, _ in cells:
        covered[tuple(slice(o, o + e) for o, e in zip(origin[3 - len(n):], extent[3 - len(n):]))] = True
    poisoned = grad_x.clone()
    poisoned[:, ~covered] = float("nan")
    out = hk.halo_accumulate(poisoned, self_boxes, incoming, plan, i)
    assert out[:, ~covered].isnan().all() and not out[:, covered].isnan().any()


REGION_CASES = [
    pytest.param((9, 10), (2, 3), (3, 3), 2, "replicate", (1, 1), id="2d-replicate"),
    pytest.param((9, 10), (2, 3), (3, 3), 2, "circular", (0, 2), id="2d-circular-corner-worker"),
    pytest.param((4, 5, 6), (2, 2, 2), (3, 3, 3), 1, "zeros", (1, 0, 1), id="3d-shell"),
    pytest.param((11,), (3,), (5,), 2, "reflect", (1,), id="1d"),
]


@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,i", REGION_CASES)
def test_stage_regions_write_disjoint_parts(gshape, grid, kernel, padding, mode, i):
    """``local`` writes exactly the pieces that need no message, ``remote`` exactly the received ones
    (visiting only the shell around the interior window)."""
    nd = len(gshape)
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((2, 3) + plan.input_shape(i), generator=gen)
    recv = torch.randn(ht.recv_numel(plan, i, 6), generator=gen)
    full = hk.halo_stage(x, recv, plan, i)
    remote = torch.zeros(plan.staged_shape(i), dtype=torch.bool)
    for pc in plan.recvs(i):
        remote[pc.dst_slices()] = True
    assert 0 < int(remote.sum()) < remote.numel()
    for first, second, unwritten in (("local", "remote", remote), ("remote", "local", ~remote)):
        out = _nan(full.shape, full.dtype, full.device)
        hk.halo_stage(x, recv, plan, i, out=out, region=first)
        assert torch.equal(out.isnan(), unwritten.expand_as(out))
        assert torch.equal(out[..., ~unwritten], full[..., ~unwritten])
        hk.halo_stage(x, recv, plan, i, out=out, region=second)
        assert torch.equal(out, full)
    g = torch.randn(full.shape, generator=gen)
    every = hk.halo_unstage(g, plan, i)
    rem = hk.halo_unstage(g, plan, i, region="remote")
    loc = hk.halo_unstage(g, plan, i, region="local")
    assert rem.grad_x is None and rem.self_boxes is None and loc.send is None
    assert torch.equal(rem.send, every.send)
    assert torch.equal(loc.grad_x, every.grad_x) and torch.equal(loc.self_boxes, every.self_boxes)


# One-launch staging (hp.stage_kernel): global shape, grid, kernel, padding, workers, tile.  Tiles are small enough
# that the window has first, middle and last column tiles (the middle ones only copy, the edge ones also write the
# columns beside the window) and that row tiles cross plane and LEAD boundaries (rows are decomposed by
# multiply-shift); the slabs' table walk gets quarter-width tiles on GPUs, here the same width.
STAGE_CASES = [
    pytest.param((19,), (3,), (5,), ((3, 1),), [(1,), (2,)], (2, 2), id="1d-uneven"),
    pytest.param((9, 16), (2, 2), (3, 5), ((1, 1), (2, 0)), [(1, 1)], (2, 2), id="2d-uneven"),
    pytest.param((9, 16), (2, 2), (3, 1), ((1, 1), (0, 0)), [(0, 1)], (2, 2), id="2d-no-halo-on-the-last-axis"),
    pytest.param((5, 6, 14), (2, 2, 2), (3, 3, 3), 1, [(1, 0, 1)], (4, 2), id="3d-corners"),
    pytest.param((2, 5, 12), (1, 2, 2), (1, 3, 3), ((0, 0), (2, 1), (1, 2)), [(0, 1, 0)], (4, 2),
                 id="3d-no-halo-on-axis-0-uneven"),
]


def _staged_pieces_mask(plan, i, received):
    mask = torch.zeros(plan.staged_shape(i), dtype=torch.bool)
    for pc in plan.pieces(i):
        if (pc.src is not None and pc.src != i) == received:
            mask[pc.dst_slices()] = True
    return mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gshape,grid,kernel,padding,workers,tile", STAGE_CASES)
def test_stage_one_launch_against_the_reference(gshape, grid, kernel, padding, workers, tile, mode):
    """Every region of the one-launch staging, bit for bit against the torch reference, into NaN-poisoned outputs:
    ``local`` leaves exactly the received pieces NaN and ``remote`` then fills exactly those; ``remote`` alone leaves
    exactly the others NaN.  The launch is the staging kernel, with window tiles both beside and away from the
    halo."""
    nd = len(gshape)
    if mode == "reflect" and not _reflect_ok(gshape, kernel, (1,) * nd, (1,) * nd, padding):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    gen = torch.Generator().manual_seed(11)
    for i in workers:
        x = torch.randn((2,) + plan.input_shape(i), generator=gen)
        recv = torch.randn(ht.recv_numel(plan, i, 2), generator=gen)
        launch = hp.stage_launch(plan, i, 2, x.device, "all", tile)
        assert launch.kernel is hp.stage_kernel  # not the table walk everywhere: a silent fallback would match too
        assert int(launch.args[7].view(hp.STAGE_BOXES, -1)[0, 1]) >= 3  # the window's NX: middle column tiles
        want = hk.halo_stage_reference(x, recv, plan, i)
        nan = _nan(want.shape, want.dtype, want.device)
        assert torch.equal(hk.halo_stage(x, recv, plan, i, out=nan.clone(), tile=tile), want), ("all", i)
        received = _staged_pieces_mask(plan, i, True).expand_as(want)
        assert received.any() and not received.all()
        local = hk.halo_stage(x, recv, plan, i, out=nan.clone(), region="local", tile=tile)
        assert torch.equal(local.isnan(), received) and torch.equal(local[~received], want[~received]), i
        assert torch.equal(hk.halo_stage(x, recv, plan, i, out=local, region="remote", tile=tile), want), i
        remote = hk.halo_stage(x, recv, plan, i, out=nan.clone(), region="remote", tile=tile)
        assert torch.equal(remote.isnan(), ~received) and torch.equal(remote[received], want[received]), i
        # the diagnosis' window copy (scripts/gpu_diagnose.py): exactly the interior window, nothing beside it
        out = nan.clone()
        hp.launch_stage(out, x, recv, hp.stage_launch(plan, i, 2, x.device, "window", tile))
        piece = ht.interior_piece(plan, i)
        inside = torch.zeros_like(received)
        inside[(...,) + tuple(slice(a, a + e) for a, e in zip(piece.dst_lo, piece.shape, strict=True))] = True
        assert 0 < int(inside.sum()) < inside.numel()
        assert torch.equal(out.isnan(), ~inside) and torch.equal(out[inside], want[inside]), ("window", i)
        # the slabs both ways: one piece per row over the window's columns (SLAB_ROWS), and the walk per element
        chosen = launch.meta["SLAB_ROWS"]
        for region in ("all", "remote"):
            other = hp.stage_launch(plan, i, 2, x.device, region, tile, slab_rows=not chosen)
            out = nan.clone()
            hp.launch_stage(out, x, recv, other)
            part = received if region == "remote" else torch.ones_like(received)
            assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), (region, i, not chosen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
def test_stage_one_launch_copies_every_dtype_bit_for_bit(dtype):
    """Staging moves values: the window's copy, the edge columns and the table walk keep every bit, subnormals and
    signed zeros included (the tile override splits the window into three column tiles)."""
    plan, _ = _plan((7, 8, 9), (2, 1, 2), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "circular")
    i = (1, 0, 0)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn((2,) + plan.input_shape(i), generator=gen, dtype=torch.float64)
         * torch.exp2(torch.randint(-30, 30, (2,) + plan.input_shape(i), generator=gen).double())).to(dtype)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, torch.finfo(dtype).tiny / 2, -torch.finfo(dtype).tiny / 4], dtype=dtype)
    recv = torch.randn(ht.recv_numel(plan, i, 2), generator=gen, dtype=torch.float64).to(dtype)
    want = hk.halo_stage_reference(x, recv, plan, i)
    got = hk.halo_stage(x, recv, plan, i, out=_nan(want.shape, dtype, want.device), tile=(4, 2))
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}[dtype]
    assert torch.equal(got.view(bits), want.view(bits))


def _stage_inputs(plan, i, seed):
    """A random block ``[2, *n]`` of worker ``i`` and its random receive buffer (two leading elements)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((2,) + plan.input_shape(i), generator=gen)
    return x, torch.randn(ht.recv_numel(plan, i, 2), generator=gen)


def test_stage_int64_offsets(monkeypatch):
    """Buffers of 2^31 elements take int64 offsets (``WIDE``); the threshold lowered to 0 runs that path here."""
    monkeypatch.setattr(hp, "WIDE_ELEMENTS", 0)
    plan, _ = _plan((6, 7, 8), (2, 2, 2), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "reflect")
    i = (1, 0, 1)
    x, recv = _stage_inputs(plan, i, 5)
    for region in hk.REGIONS:
        assert hp.stage_launch(plan, i, 2, x.device, region, (4, 2)).meta["WIDE"]
        want = hk.halo_stage_reference(x, recv, plan, i, out=_nan((2,) + plan.staged_shape(i), x.dtype, x.device),
                                       region=region)
        got = hk.halo_stage(x, recv, plan, i, out=_nan(want.shape, x.dtype, x.device), region=region, tile=(4, 2))
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), region


def test_stage_with_a_spilled_grid(monkeypatch):
    """Grid axis 0 capped at 3 programs: the staging's programs spill to axis 1, and the surplus programs of the
    rounded-up grid (past every box's last tile) write nothing."""
    monkeypatch.setattr(hp, "_GRID0_MAX", 3)
    plan, _ = _plan((5, 6, 7), (2, 1, 2), (3, 2, 3), (1, 2, 1), (1, 1, 2), 2, "replicate")
    i = (1, 0, 0)
    x, recv = _stage_inputs(plan, i, 9)
    launch = hp.stage_launch(plan, i, 2, x.device, "all", (2, 4))
    g0, g1 = launch.grid
    assert g0 == 3 and g1 > 1 and g0 * g1 > int(launch.args[7].view(hp.STAGE_BOXES, -1)[1:, 0].clamp(max=2**40).max())
    want = hk.halo_stage_reference(x, recv, plan, i)
    assert torch.equal(hk.halo_stage(x, recv, plan, i, out=_nan(want.shape, x.dtype, x.device), tile=(2, 4)), want)


def test_stage_without_an_interior_walks_the_tables_everywhere():
    """A worker whose block is not part of its staged input (stride 4: worker 1's outputs read only other blocks)
    has no window: the one table-walk launch stages it."""
    plan, _ = _plan((7,), (4,), (3,), (4,), (1,), 0, "zeros")
    i = (1,)
    assert ht.interior_piece(plan, i) is None and plan.recvs(i)
    x = torch.randn((2,) + plan.input_shape(i))
    recv = torch.randn(ht.recv_numel(plan, i, 2))
    assert hp.stage_launch(plan, i, 2, x.device, "all", None).kernel is hp.lut_gather_kernel
    want = hk.halo_stage_reference(x, recv, plan, i)
    assert torch.equal(hk.halo_stage(x, recv, plan, i, out=_nan(want.shape, x.dtype, x.device)), want)


def test_stage_refuses_row_counts_past_int32_on_both_paths():
    """Row indices are int32 in both staging kernels: 2^31 rows or more (LEAD times every staged extent but the last)
    are refused by name, on the table walk (no window) as on the window's path, never launched to wrap (the launch
    is computed, not run: no tensor of that size is made)."""
    cpu = torch.device("cpu")
    walk, _ = _plan((7,), (4,), (3,), (4,), (1,), 0, "zeros")  # worker 1 has no window: the table walk
    window, _ = _plan((9,), (2,), (3,), (1,), (1,), 1, "zeros")
    for plan, i, kernel in ((walk, (1,), hp.lut_gather_kernel), (window, (0,), hp.stage_kernel)):
        assert hp.stage_launch(plan, i, 2**31 - 1, cpu, "all", None).kernel is kernel
        with pytest.raises(UnsupportedError, match=r"halo_stage.*2147483648 rows .* exceed 2\^31 - 1"):
            hp.stage_launch(plan, i, 2**31, cpu, "all", None)


def test_stage_launch_is_built_once(monkeypatch):
    """Everything but the launch is cached per (plan, index, LEAD, device, region, tile, dtype): a second call
    builds no table (the table builders would raise)."""
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "zeros")
    i = (1, 1)
    x = torch.randn((2, 3) + plan.input_shape(i))
    recv = torch.randn(ht.recv_numel(plan, i, 6))
    first = hk.halo_stage(x, recv, plan, i)

    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt on a cached call")

    monkeypatch.setattr(hp, "stage_table_lists", refuse)
    monkeypatch.setattr(hp, "recv_numel", refuse)
    monkeypatch.setattr(hp, "interior_piece", refuse)
    assert torch.equal(hk.halo_stage(x, recv, plan, i), first)
    key = (plan, i, 6, x.device, "all", None, None, 1, None, None, x.dtype)  # halo_stage's: the entry its calls hit
    assert hp.stage_launch(*key) is hp.stage_launch(*key)


def test_unstage_and_accumulate_launches_are_cached_per_lead(monkeypatch):
    """The unstage and accumulate launches are cached per (plan, index, LEAD, device, ...): a second call with a
    same-shaped gradient builds nothing (the builders would raise, the caches miss no more) and gives the same bits;
    another batch is another LEAD, so another launch, and its result matches the reference too."""
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "replicate")
    i = (1, 1)  # replicate edge below, neighbours on three sides: send-back and self boxes both non-empty
    assert plan.recvs(i) and ht.self_pieces(plan, i)
    gen = torch.Generator().manual_seed(7)

    def step(batch, g=None):
        g = torch.randn((batch, 2) + plan.staged_shape(i), generator=gen) if g is None else g
        incoming = torch.randn(ht.send_numel(plan, i, 2 * batch), generator=gen)
        u = hk.halo_unstage(g, plan, i)
        for name, got, exp in zip(u._fields, u, hk.halo_unstage_reference(g, plan, i)):
            torch.testing.assert_close(got, exp, **tol(torch.float32), msg=f"unstage {name}, batch {batch}")
        before = u.grad_x.clone()
        got = hk.halo_accumulate(u.grad_x, u.self_boxes, incoming, plan, i)
        want = hk.halo_accumulate_reference(before, u.self_boxes, incoming, plan, i)
        torch.testing.assert_close(got, want, **tol(torch.float32), msg=f"accumulate, batch {batch}")
        return g, u

    g, first = step(1)
    misses = hl.unstage_launch.cache_info().misses, hl.accumulate_launch.cache_info().misses

    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt on a cached call")

    with monkeypatch.context() as m:
        for name in ("unstage_box_tables", "accumulate_tables", "interior_piece", "recv_numel", "self_numel",
                     "send_numel"):
            m.setattr(hl, name, refuse)
        _, again = step(1, g.clone())
    # served by the launchers' checked calls (halo._CHECKED) or the launch caches: nothing built again
    assert (hl.unstage_launch.cache_info().misses, hl.accumulate_launch.cache_info().misses) == misses
    assert all(torch.equal(a, b) for a, b in zip(first[1:], again[1:]))  # send-back and self boxes
    step(3)
    cpu = torch.device("cpu")
    assert hl.unstage_launch(plan, i, 6, cpu, "all", None) is not hl.unstage_launch(plan, i, 2, cpu, "all", None)
    assert hl.unstage_launch(plan, i, 6, cpu, "all", None).send_numel == 3 * ht.recv_numel(plan, i, 2)


def test_stage_tiles_on_gpus():
    """The GPU tile rule (computed, not launched): BLOCK_X the widest power of two whose padding of the window's
    width idles at most a quarter of the lanes, 4096-element tiles, quarter-width slab tiles, the columns beside
    the window one element a thread, 4 warps."""
    cuda = torch.device("cuda")  # only selects the GPU rule; no GPU is touched
    for width, want in ((64, (64, 64, 16, 2, 4)), (512, (8, 512, 128, 16, 4)), (1000, (8, 512, 128, 16, 4)),
                        (514, (32, 128, 32, 4, 4)), (100, (32, 128, 32, 4, 4)), (200, (16, 256, 64, 8, 4)),
                        (3, (256, 16, 4, 1, 4))):
        assert hp.stage_tile(width, width + 2, 10**6, cuda, None) == want, width
        assert want[0] * want[1] == hp.STAGE_TILE_ELEMENTS and want[1] in hp.STAGE_WIDTHS
    assert hp.stage_tile(64, 66, 10**6, cuda, (2, 4)) == (2, 4, 4, 2, 4)
    assert hp.stage_tile(64, 66, 10**6, cuda, (32, 64, 16, 8, 4)) == (32, 64, 16, 8, 4)


def test_pow2_divisor():
    assert hp.pow2_divisor(64, 4096, 0) == 16 and hp.pow2_divisor(0, 0) == 16
    assert hp.pow2_divisor(66, 4356) == 2 and hp.pow2_divisor(4423, 66) == 1 and hp.pow2_divisor(24, 8, cap=4) == 4


@pytest.mark.parametrize("extent,halo,nd", [(8, 1, 2), (16, 2, 2), (16, 8, 2), (8, 1, 3), (16, 4, 3), (12, 2, 1)])
def test_stage_alignment_hints_hold(extent, halo, nd):
    """The alignment the GPU launch promises the compiler (``X_ALIGN`` / ``OUT_ALIGN``: every window row starts at a
    multiple of it in the block / the staged tensor, and the window's width is one of X_ALIGN) holds for every row:
    the row starts come from the plan's own geometry (the interior piece), not from the launch's table."""
    plan = HaloPlan.for_conv((3 * extent,) * nd, (3,) * nd, (2 * halo + 1,) * nd, (1,) * nd, (1,) * nd,
                             ((halo, halo),) * nd, "zeros")
    index, lead = (1,) * nd, 6
    meta = hp.stage_launch(plan, index, lead, torch.device("cpu"), "all", None).meta  # the hints: any device
    interior = ht.interior_piece(plan, index)
    staged, x_shape = plan.staged_shape(index), plan.input_shape(index)
    starts_x, starts_out = [], []
    for pos in itertools.product(range(lead), *(range(e) for e in interior.shape[:-1])):
        src = (pos[0], *(a + b for a, b in zip(pos[1:], interior.src_lo[:-1], strict=True)), interior.src_lo[-1])
        dst = (pos[0], *(a + b for a, b in zip(pos[1:], interior.dst_lo[:-1], strict=True)), interior.dst_lo[-1])
        starts_x.append(int(np.ravel_multi_index(src, (lead, *x_shape))))
        starts_out.append(int(np.ravel_multi_index(dst, (lead, *staged))))
    assert all(v % meta["X_ALIGN"] == 0 for v in starts_x) and interior.shape[-1] % meta["X_ALIGN"] == 0
    assert all(v % meta["OUT_ALIGN"] == 0 for v in starts_out)
    if extent % 16 == 0 and halo % 8 == 0:  # rows 16-element aligned on both sides: the hints say so
        assert meta["X_ALIGN"] == 16 and meta["OUT_ALIGN"] >= 8


def test_magic_divisor_is_exact():
    """``n // d == umulhi(2n, m) >> k`` (the kernels' row decomposition) for every int32 ``n``: edges and random."""
    import random

    rng = random.Random(0)
    divisors = list(range(1, 600)) + [2**k + e for k in range(1, 31) for e in (-1, 0, 1)] + [2**31 - 1]
    divisors += [rng.randrange(1, 2**31) for _ in range(300)]
    for d in divisors:
        m, k = hp.magic_divisor(d)
        assert 0 < m < 2**32
        for n in {0, 1, d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1,
                  rng.randrange(2**31), rng.randrange(2**31)}:
            if 0 <= n < 2**31:
                assert (((2 * n) * m) >> 32) >> k == n // d, (d, n)
    with pytest.raises(ValueError):
        hp.magic_divisor(0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,i", [
    pytest.param((128, 128, 128), (2, 2, 2), (3, 3, 3), 1, "zeros", (1, 0, 1), id="3d-64-wide-window"),
    pytest.param((40, 1030), (1, 2), (3, 5), ((1, 1), (2, 2)), "reflect", (0, 1), id="2d-514-wide-rows"),
    pytest.param((8, 9, 300), (1, 3, 2), (3, 3, 7), 3, "circular", (0, 1, 0), id="3d-150-wide-window"),
    # halo 8 on 64-wide rows: the staged rows start 8-element aligned, so the window's stores are vectors too
    pytest.param((96, 128), (1, 2), (17, 17), 8, "zeros", (0, 1), id="2d-aligned-rows"),
    pytest.param((24, 64, 64), (1, 2, 2), (3, 17, 17), ((1, 1), (8, 8), (8, 8)), "zeros", (0, 1, 0),
                 id="3d-aligned-rows"),
])
def test_stage_one_launch_cuda_regions(gshape, grid, kernel, padding, mode, i, dtype):
    """The GPU tile rule on realistic blocks: every region bit for bit against the reference, NaN-poisoned.
    The cases cover the alignment promises: none in the staged tensor (odd halos), and vector loads and
    stores (the aligned-rows cases)."""
    nd = len(gshape)
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn((2, 8) + plan.input_shape(i), generator=gen).to(dtype).cuda()
    recv = torch.randn(ht.recv_numel(plan, i, 16), generator=gen).to(dtype).cuda()
    launch = hp.stage_launch(plan, i, 16, x.device, "all", None)
    assert launch.kernel is hp.stage_kernel
    if plan.staged_shape(i)[-1] - plan.input_shape(i)[-1] == 16:  # the aligned-rows cases (halo 8 a side)
        assert launch.meta["X_ALIGN"] == 16 and launch.meta["OUT_ALIGN"] == 8
    for region in hk.REGIONS:
        want = hk.halo_stage_reference(x, recv, plan, i, out=_nan((2, 8) + plan.staged_shape(i), dtype, x.device),
                                       region=region)
        got = hk.halo_stage(x, recv, plan, i, out=_nan(want.shape, dtype, x.device), region=region)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), region


def test_interior_and_self_pieces_partition_the_local_pieces():
    plan, _ = _plan((6,), (1,), (3,), (1,), (1,), 2, "circular")
    interior = ht.interior_piece(plan, (0,))
    assert interior is not None and interior.src_lo == (0,) and interior.shape == (6,)
    assert len(ht.self_pieces(plan, (0,))) == 2  # both circular self-wraps
    plan, _ = _plan((3,), (5,), (3,), (1,), (1,), 1, "zeros")
    assert ht.interior_piece(plan, (4,)) is None and ht.self_pieces(plan, (4,)) == ()


def test_bad_arguments_name_the_op_and_the_values():
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "zeros")
    i = (0, 0)
    x = torch.randn(2, 3, *plan.input_shape(i))
    recv = torch.randn(ht.recv_numel(plan, i, 6))
    with pytest.raises(ShapeError, match=r"halo_stage \[rank 0\]: spatial shape of x: expected \(5, 4\), got"):
        hk.halo_stage(x[..., :3], recv, plan, i)
    with pytest.raises(ShapeError, match=r"halo_stage \[rank 0\]: receive buffer .* expected 1-D of"):
        hk.halo_stage(x, recv[1:], plan, i)
    with pytest.raises(UnsupportedError, match="region must be one of"):
        hk.halo_stage(x, recv, plan, i, region="border")
    with pytest.raises(UnsupportedError, match="dtype must be one of"):
        hk.halo_pack(x.to(torch.int32), plan, i)
    with pytest.raises(ShapeError, match="must be contiguous"):
        hk.halo_pack(x.transpose(0, 1), plan, i)


def test_checked_calls_skip_the_checks_but_never_an_error(monkeypatch):
    """After a checked call, a call with tensors of the same shapes, strides, dtypes and devices skips the launcher's
    checks (the checks would raise); any other call is checked, so every bad argument raises at every call, before
    and after good calls with the same plan."""
    plan, _ = _plan((9, 10), (2, 3), (3, 3), (1, 1), (1, 1), 1, "replicate")
    i = (1, 1)
    x = torch.randn(2, 3, *plan.input_shape(i))
    recv = torch.randn(ht.recv_numel(plan, i, 6))
    g = torch.randn(2, 3, *plan.staged_shape(i))
    incoming = torch.randn(ht.send_numel(plan, i, 6))
    bad = [(ShapeError, "receive buffer", lambda: hk.halo_stage(x, recv[1:], plan, i)),
           (ShapeError, "spatial shape of x", lambda: hk.halo_stage(x[..., :2], recv, plan, i)),
           (ShapeError, "spatial shape of x", lambda: hk.halo_pack(x[..., :2], plan, i)),
           (ShapeError, "send buffer", lambda: hk.halo_pack(x, plan, i, out=torch.empty(1))),
           (ShapeError, "must be contiguous", lambda: hk.halo_stage(torch.cat([x, x], -1)[..., ::2], recv, plan, i)),
           (UnsupportedError, "region must be one of", lambda: hk.halo_unstage(g, plan, i, region="border")),
           (ShapeError, "spatial shape of staged gradient", lambda: hk.halo_unstage(g[..., 1:], plan, i)),
           (ShapeError, "incoming halo gradients", lambda: hk.halo_accumulate(
               torch.randn(2, 3, *plan.input_shape(i)), hk.halo_unstage(g, plan, i).self_boxes, incoming[1:], plan,
               i))]
    for _ in range(2):  # before the good calls, then after them
        for error, what, call in bad:
            with pytest.raises(error, match=what):
                call()
        sent = hk.halo_pack(x, plan, i)
        staged = hk.halo_stage(x, recv, plan, i)
        u = hk.halo_unstage(g, plan, i)
        hk.halo_accumulate(u.grad_x, u.self_boxes, incoming, plan, i)
    for name in ("check_plan_layout", "check_flat", "_check_region"):
        monkeypatch.setattr(hk, name, lambda *args, **kwargs: pytest.fail("checked again"))
    assert torch.equal(hk.halo_pack(x.clone(), plan, i), sent)
    assert torch.equal(hk.halo_stage(x.clone(), recv.clone(), plan, i), staged)
    u2 = hk.halo_unstage(g.clone(), plan, i)
    assert all(torch.equal(a, b) for a, b in zip(u2[1:], u[1:]))  # send-back and self boxes (u's grad_x: summed)
    hk.halo_accumulate(u2.grad_x, u2.self_boxes, incoming, plan, i)
    assert torch.equal(u2.grad_x, u.grad_x)
    with pytest.raises(pytest.fail.Exception, match="checked again"):  # another dtype: another call, checked
        hk.halo_stage(x.double(), recv.double(), plan, i)


_COMPILE_SCRIPT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from distfuse.kernels import halo as hk
from distfuse.kernels import halo_programs as hp

I64_PTRS = {"ptab_ptr", "btab_ptr", "stab_ptr", "bstart_ptr", "ctab_ptr", "blist_ptr"}
ACC_PTRS = {"out1_ptr", "self_ptr"}  # fp32 (fp64) self boxes

def comp(fn, dt, acc, consts, ones):
    # Triton turns an integer argument equal to 1 into a constant: compile that specialisation of every
    # integer argument too (e.g. RTMAX = 1 in every pack: Triton 3.6 crashed on a constant-false while loop), but
    # for the arguments the kernel asks Triton never to specialise (do_not_specialize)
    fixed = {p.name for p in fn.params if p.do_not_specialize}
    consts = {**consts, **({n: 1 for n in fn.arg_names if not n.endswith("_ptr") and n not in consts
                            and n not in fixed} if ones else {})}
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in I64_PTRS:
            sig[n] = "*i64"
        elif n.startswith(("seg", "crd")) or n in ("pcell_ptr", "pbox_ptr"):
            sig[n] = "*i32"
        elif n.endswith("_ptr"):
            sig[n] = f"*{acc}" if n in ACC_PTRS else f"*{dt}"
        else:
            sig[n] = "i32"
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

# 16-bit data computed in fp32, and fp64 data computed in fp64 (the two COMPUTE types); the specialisation of the
# integer arguments equal to 1 only: the compile audit (distfuse.kernels.compile_audit, CI) compiles the general one
for dt, acc, compute in (("bf16", "fp32", tl.float32), ("fp64", "fp64", tl.float64)):
    for ones in (True,):
        comp(hp.lut_gather_kernel, dt, acc, {"REGION": 2, "COMPUTE": compute, "BLOCK_R": 32, "BLOCK_X": 64}, ones)
        for wide, align in ((False, 1), (True, 1), (False, 8)):
            comp(hp.stage_kernel, dt, acc, {"REGION": 1, "WIDE": wide, "NUM_BOX": hp.STAGE_BOXES, "BLOCK_R": 64,
                                            "BLOCK_X": 64, "SLAB_X": 16, "STRIP_X": 4, "X_ALIGN": align,
                                            "OUT_ALIGN": align, "SLAB_ROWS": not wide}, ones)
        for wide in (False, True):
            comp(hp.box_gather_kernel, dt, acc, {"LOG2_NBOX": 3, "PER_BOX": True, "COMPUTE": compute,
                                                 "ROUND_BF16": False,
                                                 "WIDE": wide, "BLOCK": 1024}, ones)
        for wide in (False, True):
            comp(hp.accumulate_kernel, dt, acc, {"LOG2_NCELL": 5, "PER_BOX": True, "COMPUTE": compute,
                                                 "ROUND_BF16": False,
                                                 "WIDE": wide, "BLOCK": 1024}, ones)
print("compiled")
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter accepts code the compiler rejects: compile every kernel to sm_90 (bf16 in, fp32 inside;
    fp64 throughout) in a clean process (``@triton.jit`` picks the interpreter at import), with the toolchain
    triton ships.  The implicit-GEMM conv kernel has its own: tests/test_conv_implicit.py."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=240)
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr.lower()):
        pytest.skip("triton's CUDA toolchain (ptxas) is not installed")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_cuda_realistic(mode, dtype):
    _simulate((96, 80), (2, 2), (3, 3), (1, 1), (1, 1), 1, mode, dtype, lead_shape=(2, 16), device="cuda")
    _simulate((24, 20, 18), (2, 2, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1), 2, mode, dtype, lead_shape=(1, 8),
              device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("window_elements", [0, hl.UNSTAGE_WINDOW_ELEMENTS], ids=["strided-copy", "in-the-box-launch"])
def test_unstage_window_both_ways_cuda(window_elements, monkeypatch):
    """Compiled: the unstage's window copied by its box gather launch and by torch's strided copy (the two sides of
    :data:`~distfuse.kernels.halo_launches.UNSTAGE_WINDOW_ELEMENTS`), NCHW and channels last, against the
    references and the oracle."""
    monkeypatch.setattr(hl, "UNSTAGE_WINDOW_ELEMENTS", window_elements)
    hl.unstage_launch.cache_clear()
    try:
        _simulate((96, 80), (2, 2), (3, 3), (1, 1), (1, 1), 1, "reflect", torch.bfloat16, lead_shape=(2, 16),
                  device="cuda")
        _simulate((24, 20, 18), (2, 2, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "circular", torch.bfloat16,
                  lead_shape=(1, 8), device="cuda", channels_last=True)
        launch = hl.unstage_launch(_plan((96, 80), (2, 2), (3, 3), (1, 1), (1, 1), 1, "zeros")[0], (1, 1), 32,
                                   torch.device("cuda"), "all", None)
        assert launch.window_in_boxes == (window_elements > 0) and launch.boxes.meta["PER_BOX"]
    finally:
        hl.unstage_launch.cache_clear()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_kernels_cuda_channels_last(mode):
    """Compiled channels last at 16 bf16 channels: 16-byte rows, so the window and the slabs take the vector
    forms (SLAB_ROWS) that the interpreter never chooses."""
    _simulate((96, 80), (2, 2), (3, 3), (1, 1), (1, 1), 1, mode, torch.bfloat16, lead_shape=(2, 16), device="cuda",
              channels_last=True)
    _simulate((24, 20, 18), (2, 2, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, mode, torch.bfloat16, lead_shape=(1, 8),
              device="cuda", channels_last=True)


# ------------------------------------------------------------------ channels last

# every mode at the 3-D corners (26 neighbours); reflect (reversed positions) and circular elsewhere
CL_CASES = [pytest.param(*c.values, mode, id=f"{c.id}-{mode}") for c in CASES if len(c.values[0]) >= 2
            for mode in (MODES if c.id == "3d-2x2x2-corners" else ["reflect", "circular"])]


@pytest.mark.parametrize("gshape,grid,kernel,stride,dilation,padding,mode", CL_CASES)
def test_kernels_channels_last(gshape, grid, kernel, stride, dilation, padding, mode):
    """Channels-last blocks and buffers: every kernel against the NCHW references and the index oracle, in every
    padding mode (reflect and replicate move whole channel vectors)."""
    if mode == "reflect" and not _reflect_ok(gshape, kernel, stride, dilation, padding):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    _simulate(gshape, grid, kernel, stride, dilation, padding, mode, torch.float32, lead_shape=(2, 3),
              channels_last=True)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])  # the modes whose pieces reverse or repeat positions
@pytest.mark.parametrize("gshape,grid,kernel,padding,workers,tile",
                         [c for c in STAGE_CASES if c.id in ("2d-uneven", "3d-corners", "3d-no-halo-on-axis-0-uneven")])
def test_stage_channels_last_regions_and_slab_forms(gshape, grid, kernel, padding, workers, tile, mode):
    """The channels-last staging bit for bit against the NCHW reference in the regions, into poisoned
    channels-last outputs, with the slabs both ways (one piece per row over the window's merged columns, and the
    walk per element), window tiles beside and away from the halo (the tile four times the NCHW case's width in
    merged columns)."""
    nd = len(gshape)
    if mode == "reflect" and not _reflect_ok(gshape, kernel, (1,) * nd, (1,) * nd, padding):
        pytest.skip("reflect padding must be smaller than the extent (torch rule)")
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    fmt = hk.CHANNELS_LAST[nd]
    gen = torch.Generator().manual_seed(12)
    B, C = 2, 3
    tile = (tile[0], tile[1] * 4)  # a power of two near C times the NCHW width
    for i in workers:
        x = torch.randn((B, C) + plan.input_shape(i), generator=gen).contiguous(memory_format=fmt)
        recv = torch.randn(ht.recv_numel(plan, i, B * C), generator=gen)
        want = hk.halo_stage_reference(x, _nchw_order(recv, [pc.src_shape for pc in plan.recvs(i)], (B, C)), plan, i)
        nan = _nan(want.shape, want.dtype, want.device).contiguous(memory_format=fmt)
        received = _staged_pieces_mask(plan, i, True).expand_as(want)
        for slab_rows in (False, True):
            for region in ("all", "remote"):
                launch = hp.stage_launch(plan, i, B, x.device, region, tile, slab_rows=slab_rows, trail=C)
                assert launch.kernel is hp.stage_kernel
                # the columns beside the window (where there are any) in chunks of channels
                beside = plan.staged_shape(i)[-1] != ht.interior_piece(plan, i).shape[-1]
                assert (launch.meta["STRIP_ALIGN"] >= 1) == beside
                out = nan.clone(memory_format=fmt)
                hp.launch_stage(out, x, recv, launch)
                part = {"all": torch.ones_like(received), "local": ~received, "remote": received}[region]
                assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), (region, i, slab_rows)
        got = hk.halo_stage(x, recv, plan, i, tile=tile)  # the format from x's strides; the output keeps it
        assert got.is_contiguous(memory_format=fmt) and torch.equal(got, want)


@pytest.mark.parametrize("nd", [2, 3])
def test_channels_last_rows_are_vector_aligned(nd):
    """What channels last is for: with C a multiple of 8, every window row starts at a multiple of 16 elements in
    the block and in the staged tensor at halo 1 (odd), and the launch promises it; NCHW rows of the same staging
    start at odd offsets.  The row starts come from the plan's geometry and numpy's raveling, not from the launch."""
    extent, B, C = 16, 2, 16
    plan = HaloPlan.for_conv((3 * extent,) * nd, (3,) * nd, (3,) * nd, (1,) * nd, (1,) * nd, ((1, 1),) * nd, "zeros")
    index = (1,) * nd
    cl = hp.stage_launch(plan, index, B, torch.device("cpu"), "all", None, trail=C).meta
    nchw = hp.stage_launch(plan, index, B * C, torch.device("cpu"), "all", None).meta
    interior = ht.interior_piece(plan, index)
    staged, x_shape = plan.staged_shape(index), plan.input_shape(index)
    for pos in itertools.product(range(B), *(range(e) for e in interior.shape[:-1])):
        src = (pos[0], *(a + b for a, b in zip(pos[1:], interior.src_lo[:-1])), interior.src_lo[-1], 0)
        dst = (pos[0], *(a + b for a, b in zip(pos[1:], interior.dst_lo[:-1])), interior.dst_lo[-1], 0)
        assert np.ravel_multi_index(src, (B, *x_shape, C)) % 16 == 0
        assert np.ravel_multi_index(dst, (B, *staged, C)) % 16 == 0
    assert (cl["X_ALIGN"], cl["OUT_ALIGN"]) == (16, 16)
    assert nchw["OUT_ALIGN"] == 1


def test_channels_last_refuses_what_it_cannot_index():
    plan, _ = _plan((8, 8), (2, 2), (3, 3), (1, 1), (1, 1), 1, "zeros")
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ShapeError, match="contiguous in torch.channels_last"):
        hk.halo_pack(x, plan, (0, 0), channels_last=True)  # NCHW strides, channels last asked
    with pytest.raises(UnsupportedError, match=r"channels last needs x \[B, C, \*spatial\]"):
        hk.halo_pack(torch.randn(2, 3, 5, 4, 4), plan, (0, 0), channels_last=True)


@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_channels_last_slabs_move_in_vectors(mode):
    """With 16 channels the slabs' rows (one piece per row) and the chunks beside the window (one piece per
    spatial column) are promised 16-element aligned like the window's (``SLAB_ALIGN``, ``STRIP_ALIGN``), and the
    staging stays bit for bit: a promise that did not hold would round a row onto the wrong elements of random
    data."""
    plan, _ = _plan((9, 8, 10), (3, 2, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, mode)
    i, B, C = (1, 0, 1), 1, 16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((B, C) + plan.input_shape(i), generator=gen).contiguous(memory_format=torch.channels_last_3d)
    recv = torch.randn(ht.recv_numel(plan, i, B * C), generator=gen)
    want = hk.halo_stage_reference(x, _nchw_order(recv, [pc.src_shape for pc in plan.recvs(i)], (B, C)), plan, i)
    received = _staged_pieces_mask(plan, i, True).expand_as(want)
    for region in ("all", "remote"):
        launch = hp.stage_launch(plan, i, B, x.device, region, (4, 64), slab_rows=True, trail=C)
        meta = launch.meta
        assert (meta["SLAB_ALIGN"], meta["STRIP_ALIGN"], meta["X_ALIGN"], meta["OUT_ALIGN"]) == (16, 16, 16, 16)
        assert meta["STRIP_X"] == C  # one chunk a spatial column
        out = _nan(want.shape, want.dtype, want.device).contiguous(memory_format=torch.channels_last_3d)
        hp.launch_stage(out, x, recv, launch)
        part = received if region == "remote" else torch.ones_like(received)
        assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), region
    nchw = hp.stage_launch(plan, i, B * C, x.device, "all", (4, 16), slab_rows=True)
    assert nchw.meta["SLAB_ALIGN"] == 1  # odd halos: NCHW rows start at odd offsets
    assert nchw.meta["STRIP_ALIGN"] == 0  # and the columns beside the window are walked one by one
