"""The staging's split launch (``stage_launch(..., split=True)``, the GPU default :data:`~distfuse.kernels.
halo_programs.STAGE_SPLIT`): the window's programs (``PART`` 1) and the slabs' (``PART`` 2) as two launches of one
kernel where the region copies the window, whose programs together are exactly the one launch's, and whose outputs
are the one launch's bit for bit.

Each region is staged into a NaN-poisoned output and compared with the torch reference
(:func:`distfuse.kernels.halo.halo_stage_reference`); the region's pieces must be written and nothing else.
"""

import inspect
import math

import pytest
import torch
import triton.language as tl

from distfuse.kernels import halo as hk
from distfuse.kernels import halo_programs as hp
from distfuse.kernels import halo_tables as ht
from tests.test_halo_kernels import _nan, _nchw_order, _plan, _staged_pieces_mask
from tests.test_halo_overlap_passes import _inputs, cuda_cases

# (global shape, grid, kernel, padding, mode, workers, channels last): a middle worker (every face remote) and a corner
# one (faces from the padding rule), in 2-D and 3-D, uneven splits included
CASES = [
    pytest.param((9, 9, 12), (3, 3, 3), (3, 3, 3), 1, "zeros", [(1, 1, 1), (0, 0, 0)], False,
                 id="3d-middle-and-corner-nchw"),
    pytest.param((9, 9, 12), (3, 3, 3), (3, 3, 3), 1, "zeros", [(0, 0, 0)], True, id="3d-corner-channels-last"),
    pytest.param((7, 11, 10), (2, 3, 2), (3, 3, 5), ((1, 1), (1, 1), (2, 2)), "reflect", [(1, 1, 0)], True,
                 id="3d-uneven-reflect-channels-last"),
    pytest.param((9, 16), (2, 2), (3, 5), ((1, 1), (2, 2)), "circular", [(0, 1), (1, 0)], False,
                 id="2d-circular-nchw"),
]


def _written(plan, i, region, shape):
    """The staged positions a region writes: the received pieces (remote), the others (local), all, or the
    interior window alone (the diagnosis region ``window``)."""
    received = _staged_pieces_mask(plan, i, True).expand(shape)
    if region == "window":
        piece = ht.interior_piece(plan, i)
        inside = torch.zeros(shape, dtype=torch.bool)
        inside[(...,) + tuple(slice(a, a + e) for a, e in zip(piece.dst_lo, piece.shape, strict=True))] = True
        return inside
    return {"all": torch.ones_like(received), "local": ~received, "remote": received}[region]


@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,workers,cl", CASES)
def test_split_staging_writes_what_the_one_launch_writes(gshape, grid, kernel, padding, mode, workers, cl):
    """Split (window programs, then slab programs) and not, every region, bit for bit into poisoned outputs.  The
    split's two grids hold the one launch's programs: the window's first (box 1's START of them), then the slabs'."""
    nd = len(gshape)
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    B, C = 2, 3
    fmt = hk.CHANNELS_LAST[nd] if cl else torch.contiguous_format
    lead, trail = (B, C) if cl else (B * C, 1)
    tile = (16, 4)  # window tiles of 4 columns: the 2-D blocks' windows take two, one writing each side's strips
    gen = torch.Generator().manual_seed(7)
    split_seen = 0
    for i in workers:
        x, recv = _inputs(plan, i, B, C, fmt, "cpu", torch.float32, gen)
        want = hk.halo_stage_reference(x, _nchw_order(recv, [pc.src_shape for pc in plan.recvs(i)], (B, C))
                                       if cl else recv, plan, i)
        for region in ("all", "local", "remote", "window"):
            one = hp.stage_launch(plan, i, lead, x.device, region, tile, None, trail, False)
            two = hp.stage_launch(plan, i, lead, x.device, region, tile, None, trail, True)
            assert one.parts == ()
            part = _written(plan, i, region, want.shape)
            for launch in (one, two):
                out = _nan(want.shape, want.dtype, want.device).contiguous(memory_format=fmt)
                hp.launch_stage(out, x, recv, launch)
                assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), (i, region)
            if one.kernel is None:
                continue
            starts = one.args[7].view(hp.STAGE_BOXES, -1)[:, 0]
            window_programs = min(int(starts[1]), math.prod(one.grid))
            if two.parts:
                split_seen += 1
                (g1, p1), (g2, p2) = two.parts
                assert (p1, p2) == (1, 2) and region in ("all", "local")
                assert math.prod(g1) == window_programs > 0
                assert math.prod(g1) + math.prod(g2) == math.prod(one.grid)
            else:  # nothing to split: no window copy (remote: strips only), or the window's programs or slabs alone
                assert region in ("remote", "window") or window_programs in (0, math.prod(one.grid)), (i, region)
    assert split_seen > 0


def test_split_staging_with_spilled_grids(monkeypatch):
    """Grid axis 0 capped at 3 programs: both launches of the split spill to axis 1, and the surplus programs of
    their rounded-up grids (past the window's rows, past the last slab's tiles) write nothing."""
    monkeypatch.setattr(hp, "_GRID0_MAX", 3)
    hp.stage_launch.cache_clear()  # launches are cached: none made with the default cap may answer
    try:
        plan, _ = _plan((5, 6, 7), (2, 1, 2), (3, 2, 3), (1, 2, 1), (1, 1, 2), 2, "replicate")
        i = (1, 0, 0)
        gen = torch.Generator().manual_seed(4)
        x = torch.randn((2, 2) + plan.input_shape(i), generator=gen)
        recv = torch.randn(ht.recv_numel(plan, i, 4), generator=gen)
        want = hk.halo_stage_reference(x, recv, plan, i)
        launch = hp.stage_launch(plan, i, 4, x.device, "all", (2, 4), None, 1, True)
        grids = [grid for grid, _ in launch.parts]
        window = int(launch.args[7].view(hp.STAGE_BOXES, -1)[1, 0])  # box 1's START: the window's programs
        assert launch.grid[0] == 3 and len(grids) == 2 and all(g0 == 3 and g1 > 1 for g0, g1 in grids)
        assert math.prod(grids[0]) > window > 0 and window % 3  # the window's launch runs surplus programs
        out = _nan(want.shape, want.dtype, want.device)
        hp.launch_stage(out, x, recv, launch)
        assert torch.equal(out, want)
    finally:
        hp.stage_launch.cache_clear()


def _constexprs(kernel) -> set[str]:
    """The ``tl.constexpr`` parameters of a ``@triton.jit`` kernel (compiled or interpreted)."""
    fn = getattr(kernel, "fn", kernel)
    return {name for name, p in inspect.signature(fn).parameters.items()
            if p.annotation is tl.constexpr or p.annotation == "tl.constexpr"}


@pytest.mark.parametrize("split", [False, True])
def test_every_staging_launch_names_every_constexpr(split):
    """A launch that leaves a constexpr to its default is never a launch-cache hit (every call goes through the
    JIT's per-call work: 17 against 6 us of host a staging here, with the kernels stubbed): each launch of the
    staging, split or not, the table walk's, the box gather's and the accumulate's gives them all."""
    plan, _ = _plan((9, 9, 12), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "zeros")
    seen = 0
    for region in ("all", "local", "remote", "window"):
        launch = hp.stage_launch(plan, (0, 0, 0), 2, torch.device("cpu"), region, (4, 8), None, 1, split)
        for part in [p for _, p in launch.parts] or [launch.meta.get("PART")]:
            given = set(launch.meta) | ({"PART"} if launch.parts else set())
            assert _constexprs(hp.stage_kernel) <= given, (region, part)
            seen += 1
    assert seen >= 4
    # the box gather (pack, unstage) and the accumulate: COMPUTE and ROUND_BF16 by dtype, at their first launch
    from distfuse.kernels import halo_launches as hl

    cpu = torch.device("cpu")
    box = hl.unstage_launch(plan, (0, 0, 0), 2, cpu, "all", None).boxes
    assert _constexprs(hp.box_gather_kernel) <= set(box.meta) | {"COMPUTE", "ROUND_BF16"}
    acc = hl.accumulate_launch(plan, (0, 0, 0), 2, cpu, None)
    assert acc.grid is not None and _constexprs(hp.accumulate_kernel) <= set(acc.meta) | {"COMPUTE", "ROUND_BF16"}
    walk = _plan((7,), (4,), (3,), (4,), (1,), 0, "zeros")[0]  # stride 4: worker 1 reads no element of its block
    launch = hp.stage_launch(walk, (1,), 2, torch.device("cpu"), "all", None)
    assert launch.kernel is hp.lut_gather_kernel
    assert _constexprs(hp.lut_gather_kernel) <= set(launch.meta) | {"COMPUTE"}  # COMPUTE: by dtype, at the launch


def test_the_gpu_stages_split_by_default_and_the_interpreter_in_one_launch():
    """``split=None`` chooses :data:`~distfuse.kernels.halo_programs.STAGE_SPLIT` on CUDA devices, one launch
    elsewhere (the interpreter pays per program, not per launch)."""
    plan, _ = _plan((9, 9, 12), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "zeros")
    assert hp.stage_launch(plan, (0, 0, 0), 2, torch.device("cpu"), "all", (4, 8)).parts == ()
    assert hp.STAGE_SPLIT is True


@pytest.mark.cuda
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("nd", [2, 3])
def test_split_staging_cuda(nd, cl):
    """Compiled at the GPU's own tiles: split and not, every region, bf16, halo 1 (odd: NCHW rows unaligned) and 2,
    a middle and a corner worker, bit for bit."""
    fmt = hk.CHANNELS_LAST[nd] if cl else torch.contiguous_format
    for plan, i, x, recv, lead, trail in cuda_cases(nd, cl, 9):
        want = hk.halo_stage_reference(x, _nchw_order(recv, [pc.src_shape for pc in plan.recvs(i)], (1, 16))
                                       if cl else recv, plan, i)
        for region in ("all", "local", "remote"):
            part = _written(plan, i, region, want.shape).to("cuda")
            for split in (True, False):
                launch = hp.stage_launch(plan, i, lead, x.device, region, None, None, trail, split)
                out = _nan(want.shape, want.dtype, want.device).contiguous(memory_format=fmt)
                hp.launch_stage(out, x, recv, launch)
                assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), (i, region, split)
