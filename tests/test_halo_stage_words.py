"""The staging's words form (:mod:`distfuse.kernels.halo_stage_words`, then ``stage_kernel``'s ``PART`` 3): the
window's rows as flat 32-bit words, then the strips and the slabs, against the torch reference, interpreted on CPU.

Region ``all`` must write the reference bit for bit into a NaN-poisoned output.  Region ``local`` may leave a
received element 0 where it shares a group of four words with a window row (the module doc), so it is checked with
its remote pass after it, bit for bit, and on its own: its pieces exact, every other element poison, or 0 in such
a group only.  The
form falls back, with the same bits, where it does not fit: 64-bit elements, 16-bit rows of an odd length, an
output off a word boundary, channels last.
"""

import pytest
import torch

from distfuse.kernels import halo as hk
from distfuse.kernels import halo_programs as hp
from distfuse.kernels import halo_stage_words as hw
from distfuse.kernels import halo_tables as ht
from tests.test_halo_kernels import _nan, _plan, _staged_pieces_mask
from tests.test_halo_overlap_passes import _inputs, cuda_cases

# (global shape, grid, kernel, padding, mode, workers): middle workers (every face received) and corner ones (faces
# from the padding rule), uneven splits, even and odd halos, and a plan with a halo on the last axis only (no slab)
CASES = [
    pytest.param((9, 9, 24), (3, 3, 3), (3, 3, 3), 1, "zeros", [(1, 1, 1), (0, 0, 0)], id="3d-middle-and-corner"),
    pytest.param((7, 11, 12), (2, 3, 2), (3, 3, 5), ((1, 1), (1, 1), (2, 2)), "reflect", [(1, 1, 0), (0, 2, 1)],
                 id="3d-uneven-reflect"),
    pytest.param((9, 16), (2, 2), (3, 5), ((1, 1), (2, 2)), "circular", [(0, 1), (1, 0)], id="2d-circular"),
    pytest.param((10, 16), (2, 2), (5, 3), ((2, 2), (1, 1)), "replicate", [(0, 0), (1, 1)], id="2d-replicate"),
    pytest.param((6, 18), (1, 3), (1, 3), ((0, 0), (1, 1)), "zeros", [(0, 1), (0, 0)], id="2d-last-axis-only"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _staged(plan, i, x, recv, region, out=None, words=True):
    launch = hp.stage_launch(plan, i, x.shape[0] * x.shape[1], x.device, region, None, None, 1, None, words)
    if out is None:
        out = _nan((*x.shape[:2], *plan.staged_shape(i)), x.dtype, x.device)
    hp.launch_stage(out, x, recv, launch)
    return out, launch


def _check_regions(plan, i, x, recv):
    """Region ``all`` exact; ``local`` exact on its pieces, poison or 0 elsewhere; ``local`` then ``remote`` exact."""
    want = hk.halo_stage_reference(x, recv, plan, i)
    out, launch = _staged(plan, i, x, recv, "all")
    row = plan.staged_shape(i)[-1]
    assert (x.dtype, True) in launch.bound, "rows of 8 or more elements, an even number: the words form"
    assert row >= 8 and row % 2 == 0
    assert torch.equal(out, want), (i, x.dtype, "all")
    received = _staged_pieces_mask(plan, i, True).to(x.device).expand(want.shape)
    local, _ = _staged(plan, i, x, recv, "local")
    assert torch.equal(local[~received], want[~received]), (i, x.dtype, "local")
    rest = local[received]
    near = _groups_holding_window_rows(plan, i, want)[received]
    assert (rest.isnan() | ((rest == 0) & near)).all(), \
        "a local pass writes its pieces, and 0 only in a group of four words that holds a window row's word"
    both, _ = _staged(plan, i, x, recv, "remote", out=local)
    assert torch.equal(both, want), (i, x.dtype, "local, then remote")


def _groups_holding_window_rows(plan, i, out):
    """Per element of the staged tensor ``out`` (NCHW, contiguous): whether its group of four 32-bit words (the
    words kernel's 16-byte store) holds an element of a window row (a staged row crossing the interior window, all
    of its columns), the groups the words form writes (the module doc)."""
    window = torch.zeros(plan.staged_shape(i), dtype=torch.bool)
    rows = ht.interior_piece(plan, i).dst_slices()
    window[(*rows[:-1], slice(None))] = True
    per_group = 4 * (4 // out.element_size())  # elements in four words
    flat = window.expand(out.shape).reshape(-1)
    groups = torch.nn.functional.pad(flat, (0, -flat.numel() % per_group)).view(-1, per_group).any(1)
    return groups.repeat_interleave(per_group)[: flat.numel()].view(out.shape)


@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,workers", CASES)
def test_words_staging_writes_the_reference(gshape, grid, kernel, padding, mode, workers):
    """One program for the words (the interpreter's form), every dtype it takes."""
    nd = len(gshape)
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    gen = torch.Generator().manual_seed(11)
    for i in workers:
        for dtype in DTYPES:
            _check_regions(plan, i, *_inputs(plan, i, 2, 3, torch.contiguous_format, "cpu", dtype, gen))


@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,workers", [CASES[0], CASES[2]])
def test_words_staging_in_programs_of_two_groups(gshape, grid, kernel, padding, mode, workers, monkeypatch):
    """Programs of two groups (eight words), as the GPUs' programs of 256: they end mid-row, and their groups
    straddle rows (staged rows of 5 and 6 words) and programs."""
    monkeypatch.setattr(hw, "WORDS_GROUPS_INTERPRETED", 2)
    hp.stage_launch.cache_clear()  # launches are cached: none made with another group count may answer
    try:
        nd = len(gshape)
        plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
        gen = torch.Generator().manual_seed(5)
        for i in workers:
            _check_regions(plan, i, *_inputs(plan, i, 1, 2, torch.contiguous_format, "cpu", torch.bfloat16, gen))
    finally:
        hp.stage_launch.cache_clear()


@pytest.mark.parametrize("groups", [None, 2], ids=["one-program", "two-groups-a-program"])
def test_words_staging_where_the_end_cuts_a_group(groups, monkeypatch):
    """A halo on the last axis only, so the staged tensor ends in a window row, in rows of 5 words and 3 leading
    entries: 90 words, the last group cut after two.  Its two words are written one by one (no slab rewrites
    them), and nothing past the end."""
    if groups is not None:
        monkeypatch.setattr(hw, "WORDS_GROUPS_INTERPRETED", groups)
    hp.stage_launch.cache_clear()
    try:
        plan, _ = _plan((6, 24), (1, 3), (1, 3), (1, 1), (1, 1), ((0, 0), (1, 1)), "zeros")
        gen = torch.Generator().manual_seed(9)
        for i in ((0, 1), (0, 2)):
            x, recv = _inputs(plan, i, 1, 3, torch.contiguous_format, "cpu", torch.bfloat16, gen)
            assert x.shape[0] * x.shape[1] * 6 * 10 // 2 % 4 == 2
            want = hk.halo_stage_reference(x, recv, plan, i)
            room = _nan(want.numel() + 8, want.dtype, "cpu")
            out = room[:want.numel()].view(want.shape)
            _, launch = _staged(plan, i, x, recv, "all", out=out)
            assert (torch.bfloat16, True) in launch.bound
            assert torch.equal(out, want) and room[want.numel():].isnan().all(), i
    finally:
        hp.stage_launch.cache_clear()


def test_words_form_falls_back_where_it_does_not_fit():
    """64-bit elements, 16-bit elements in rows of an odd length (staged 13 columns), and an output one element off
    a word boundary take the other launches, with the reference's bits; so do channels last and the remote pass,
    which never take the form."""
    plan, _ = _plan((9, 11), (2, 1), (3, 3), (1, 1), (1, 1), 1, "zeros")  # rows of 11 + 2 staged columns
    i = (1, 0)
    gen = torch.Generator().manual_seed(3)
    for dtype, fits in ((torch.float64, False), (torch.bfloat16, False), (torch.float32, True)):
        x, recv = _inputs(plan, i, 1, 2, torch.contiguous_format, "cpu", dtype, gen)
        out, launch = _staged(plan, i, x, recv, "all")
        assert launch.words and ((dtype, fits) in launch.bound) and ((dtype, not fits) not in launch.bound)
        assert torch.equal(out, hk.halo_stage_reference(x, recv, plan, i)), dtype
    plan, _ = _plan((9, 12), (2, 1), (3, 3), (1, 1), (1, 1), 1, "zeros")
    x, recv = _inputs(plan, i, 1, 2, torch.contiguous_format, "cpu", torch.bfloat16, gen)
    want = hk.halo_stage_reference(x, recv, plan, i)
    base = _nan(want.numel() + 1, want.dtype, "cpu")
    shifted = base[1:].view(want.shape)  # two bytes past the allocation: off a word boundary
    _, launch = _staged(plan, i, x, recv, "all", out=shifted)
    assert (torch.bfloat16, False) in launch.bound and torch.equal(shifted, want)
    assert hp.stage_launch(plan, i, 2, x.device, "remote", None, None, 1, None, True).words == ()
    cl = hp.stage_launch(plan, i, 1, x.device, "all", None, None, 2, None, True)
    assert cl.words == (), "channels last rows are 16-byte vectors already"


def test_the_gpus_take_the_words_form_only_when_asked(monkeypatch):
    """``words=None`` follows :data:`~distfuse.kernels.halo_stage_words.STAGE_WORDS` on CUDA devices (off until a GPU
    measures it, ``DISTFUSE_STAGE_WORDS=1`` turns it on), and never off them; ``True`` forces it."""
    plan, _ = _plan((9, 9, 12), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "zeros")
    assert hw.STAGE_WORDS is False
    for value, want in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv(hw.STAGE_WORDS_ENV, value)
        assert hw.stage_words_enabled() is want
    monkeypatch.setenv(hw.STAGE_WORDS_ENV, "yes")
    with pytest.raises(ValueError, match="DISTFUSE_STAGE_WORDS='yes'"):
        hw.stage_words_enabled()
    assert hp.stage_launch(plan, (0, 0, 0), 2, torch.device("cpu"), "all", None).words == ()
    assert hp.stage_launch(plan, (0, 0, 0), 2, torch.device("cpu"), "all", None, None, 1, None, True).words


@pytest.mark.cuda
@pytest.mark.parametrize("nd", [2, 3])
def test_words_staging_cuda(nd):
    """Compiled at the GPU's own groups (``WORDS_GROUPS``): bf16, halo 1 (odd: the window's elements straddle
    words) and 2, a middle and a corner worker, every region against the reference, bit for bit."""
    for plan, i, x, recv, _, _ in cuda_cases(nd, False, 13):
        _check_regions(plan, i, x, recv)


def test_words_form_keeps_its_word_indices_in_int32():
    """The words form indexes words in int32, and its last program runs up to ``4 * GROUPS`` words past the end: a
    staging within that margin of 2^31 elements keeps the split launch (geometry only: nothing is allocated)."""
    plan, _ = _plan((9, 9, 24), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, "zeros")
    i = (1, 1, 1)
    staged = 5 * 5 * 10  # per leading entry
    cpu = torch.device("cpu")
    near = (2**31 - 1) // staged  # 2^31 - 148 elements: inside the margin
    assert not hp.stage_launch(plan, i, near, cpu, "all", None, None, 1, None, True).words
    far = (2**31 - 8 * hw.WORDS_GROUPS_INTERPRETED) // staged
    assert hp.stage_launch(plan, i, far, cpu, "all", None, None, 1, None, True).words
