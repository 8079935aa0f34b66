"""The diagnosis's row probe (bench/halo_rows_probe.py) writes what it claims, interpreted on CPU.

``rows`` (one element a store, or paired): the zero-padded staged tensor, bit for bit torch's ``F.pad``;
``window``: the window's values and not one element beside them (the output is poisoned first, and the border
must still hold the poison); ``flat words`` (:func:`words_probe`): the same tensor as 32-bit words, each
16-bit pair put together from two of the block's words where the halo is odd, or (gathered) from two
16-bit loads."""

import pytest
import torch

from bench.halo_rows_probe import probe_reference, rows_probe, words_probe

CASES = [((1, 2, 5, 6), 1), ((2, 3, 4, 3), 2), ((1, 2, 3, 4, 5), 1), ((2, 1, 3, 2, 4), 2)]


@pytest.mark.parametrize("shape,halo", CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"h{v}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_window_against_torch(shape, halo, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape) + halo)).to(dtype)
    want = probe_reference(x, halo)
    nd = x.dim() - 2
    window = (slice(None), slice(None)) + (slice(halo, -halo),) * nd
    out = torch.full_like(want, float("nan"))
    assert torch.equal(rows_probe(x, out, halo, faces=True), want)
    out.fill_(float("nan"))
    assert torch.equal(rows_probe(x, out, halo, faces=True, paired=True, elems=64), want)
    out.fill_(float("nan"))
    rows_probe(x, out, halo, faces=False, elems=64)  # several programs, so the rows' tiles meet
    assert torch.equal(out[window], x)
    border = torch.ones_like(want, dtype=torch.bool)
    border[window] = False
    assert border.any() and out[border].isnan().all()


WORD_CASES = [((1, 2, 3, 8), 1), ((2, 3, 4, 4), 2), ((1, 2, 2, 3, 10), 1), ((1, 1, 3, 4, 4), 3), ((2, 1, 3, 2, 4), 2)]


@pytest.mark.parametrize("shape,halo", WORD_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"h{v}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flat_words_against_torch(shape, halo, dtype):
    """Odd halos (1, 3) put each staged word together from two of the block's words, even ones (2) copy words
    whole, and the gathered form packs two 16-bit loads at any halo; programs of 8 to 256 words end mid-row and
    mid-plane, and staged rows of 5, 6 and 10 words put a window row's first word inside a group of four whose
    first word is in the row before, so the group's second decoded row is taken (a group decoding one row only
    would write that word as border)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7 * sum(shape) + halo)).to(dtype)
    want = probe_reference(x, halo)
    for elems, gather in ((32, False), (256, False), (32, True)):
        out = torch.full_like(want, float("nan"))
        assert torch.equal(words_probe(x, out, halo, gather=gather, elems=elems), want), (elems, gather, dtype)


def test_bad_shapes_are_refused_by_name():
    x = torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match="rows_probe: out must be"):
        rows_probe(x, torch.empty(1, 2, 6, 5), 1, faces=True)
    with pytest.raises(ValueError, match="2 or 3 spatial axes"):
        rows_probe(torch.randn(2, 4, 4), torch.empty(2, 6, 6), 1, faces=True)
    with pytest.raises(ValueError, match="words_probe: 16-bit elements in rows of an even length"):
        words_probe(torch.randn(1, 2, 4, 5).bfloat16(), torch.empty(1, 2, 6, 7, dtype=torch.bfloat16), 1)
    with pytest.raises(ValueError, match="words_probe: out must be"):
        words_probe(x, torch.empty(1, 2, 6, 5), 1)
