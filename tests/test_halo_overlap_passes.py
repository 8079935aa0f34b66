"""The halo staging's overlap passes (``region="local"``, then ``"remote"`` once the halos came: what the fused
halo convolution runs on GPUs) launch only what they write, and write exactly their pieces.

The staged output is poisoned with NaN before each pass; each pass must leave exactly the other pass's pieces NaN
and match the torch reference (:func:`distfuse.kernels.halo.halo_stage_reference`) bit for bit elsewhere.  The
launch geometry (programs per box, the strips flag) is read from the launch's box table.
"""

import math

import pytest
import torch

from distfuse.kernels import halo as hk
from distfuse.kernels import halo_programs as hp
from distfuse.kernels import halo_tables as ht
from tests.test_halo_kernels import _nan, _nchw_order, _plan, _staged_pieces_mask


def _inputs(plan, i, B, C, fmt, device, dtype, gen):
    x = torch.randn((B, C) + plan.input_shape(i), generator=gen).to(device=device, dtype=dtype)
    x = x.contiguous(memory_format=fmt)
    recv = torch.randn(ht.recv_numel(plan, i, B * C), generator=gen).to(device=device, dtype=dtype)
    return x, recv


def _check_passes(plan, i, x, recv, local, remote, cl, fmt):
    """Each pass into a poisoned output: exactly its pieces written, bit for bit."""
    B, C = x.shape[:2]
    shapes = [pc.src_shape for pc in plan.recvs(i)]
    want = hk.halo_stage_reference(x, _nchw_order(recv, shapes, (B, C)) if cl else recv, plan, i)
    received = _staged_pieces_mask(plan, i, True).to(x.device).expand_as(want)
    assert received.any()
    for launch, part in ((local, ~received), (remote, received)):
        out = _nan(want.shape, want.dtype, want.device).contiguous(memory_format=fmt)
        hp.launch_stage(out, x, recv, launch)
        assert torch.equal(out.isnan(), ~part) and torch.equal(out[part], want[part]), (i, launch.meta)


def test_slab_rows_where_their_registers_stay_low():
    """The slabs one piece per row (``SLAB_ROWS``): aligned slab rows always; unaligned ones (NCHW, odd halos) only
    in the one-pass staging of window tiles 64 columns wide or more, where the compile audit's registers allow it."""
    assert hp.choose_slab_rows(True, 16, 2, 16) and hp.choose_slab_rows(True, 8, 1, 512)
    assert hp.choose_slab_rows(True, 1, 0, 64) and hp.choose_slab_rows(True, 1, 0, 512)
    assert not hp.choose_slab_rows(True, 1, 0, 32)
    assert not hp.choose_slab_rows(True, 1, 1, 512) and not hp.choose_slab_rows(True, 1, 2, 64)
    assert not hp.choose_slab_rows(False, 16, 0, 512)


@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_overlap_passes_launch_only_what_they_write(monkeypatch, mode, cl):
    """The overlap's two passes launch programs only where they write.  The middle worker of a 3^3 grid (every
    neighbour remote): its local pass has no slab program and no strip, its remote pass tiles the window's strips
    by STRIP_R rows (one column tile), and with strip tiles of a few rows (``STAGE_STRIP_ELEMENTS`` lowered, small
    window tiles) there are many of them.  Each pass bit for bit against the reference into a poisoned output; a
    corner worker (its outer faces local: zero fill or reflected) too, in both passes."""
    plan, _ = _plan((9, 9, 12), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, mode)
    B, C = 2, 3
    fmt = hk.CHANNELS_LAST[3] if cl else torch.contiguous_format
    lead, trail = (B, C) if cl else (B * C, 1)
    monkeypatch.setattr(hp, "STAGE_STRIP_ELEMENTS", 4)
    hp.stage_launch.cache_clear()  # launches are cached: none made with the default may answer
    tile = (4, 8)  # window tiles of 4 rows, so that strip tiles are a few rows too
    try:
        gen = torch.Generator().manual_seed(21)
        for i in ((1, 1, 1), (0, 0, 0)):
            x, recv = _inputs(plan, i, B, C, fmt, "cpu", torch.float32, gen)
            local = hp.stage_launch(plan, i, lead, x.device, "local", tile, None, trail)
            remote = hp.stage_launch(plan, i, lead, x.device, "remote", tile, None, trail)
            lbox, rbox = (launch.args[7].view(hp.STAGE_BOXES, -1) for launch in (local, remote))
            window_rows = int(rbox[0, 2])
            assert int(rbox[0, 1]) == 1 and int(rbox[0, 22]) == 1  # NX 1, and strips to write
            assert int(rbox[1, 0]) - int(rbox[0, 0]) == -(-window_rows // remote.meta["STRIP_R"]) > 1
            if i == (1, 1, 1):
                assert int(lbox[0, 22]) == 0  # no strip of the local pass: every column beside the window is remote
                assert math.prod(local.grid) == int(lbox[1, 0]) == int(lbox[0, 1]) * -(-window_rows // local.meta[
                    "BLOCK_R"])  # the window's programs only: no slab program
            _check_passes(plan, i, x, recv, local, remote, cl, fmt)
    finally:
        hp.stage_launch.cache_clear()


@pytest.mark.cuda
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("nd", [2, 3])
def test_overlap_passes_cuda(nd, cl):
    """Compiled, at the GPU's own launch geometry (strip tiles of ``STAGE_STRIP_ELEMENTS``, the slabs' form that
    :func:`~distfuse.kernels.halo_programs.choose_slab_rows` picks): both passes of the middle worker of a 3^nd grid
    and of a corner worker, bf16, halo 1 (odd: NCHW rows unaligned) and 2."""
    fmt = hk.CHANNELS_LAST[nd] if cl else torch.contiguous_format
    for plan, i, x, recv, lead, trail in cuda_cases(nd, cl, 5):
        local = hp.stage_launch(plan, i, lead, x.device, "local", None, None, trail)
        remote = hp.stage_launch(plan, i, lead, x.device, "remote", None, None, trail)
        assert remote.meta["STRIP_R"] >= remote.meta["BLOCK_R"]
        _check_passes(plan, i, x, recv, local, remote, cl, fmt)


def cuda_cases(nd, cl, seed):
    """The GPU tests' stagings: ``(plan, index, x, recv, LEAD, TRAIL)`` for the middle and a corner worker of a
    3^nd grid, bf16, halo 1 (odd: NCHW rows unaligned) and 2, 16 channels, NCHW or channels last."""
    gen = torch.Generator().manual_seed(seed)
    B, C = 1, 16
    fmt = hk.CHANNELS_LAST[nd] if cl else torch.contiguous_format
    lead, trail = (B, C) if cl else (B * C, 1)
    extent = {2: 96, 3: 24}[nd]
    for halo in (1, 2):
        k = 2 * halo + 1
        plan, _ = _plan((3 * extent,) * nd, (3,) * nd, (k,) * nd, (1,) * nd, (1,) * nd, halo, "zeros")
        for i in ((1,) * nd, (0,) * nd):
            yield (plan, i, *_inputs(plan, i, B, C, fmt, "cuda", torch.bfloat16, gen), lead, trail)
