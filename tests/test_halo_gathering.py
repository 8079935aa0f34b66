"""The unfused halo staging of small blocks by one indexed gather (``distfuse.primitives._halo_gathering``) against
the staging by views and concatenations, for random 1-D to 3-D geometries, every worker and padding mode.

* Staging moves data: the gather's staged tensor is the views' bit for bit (which ``test_halo_pieces_assembly``
  checks against torch's global padding), new, in the block's format.
* The adjoint sums the same terms in another order (and a replicated run in fp32 where the views' path sums it in
  the data's dtype first): on integer values (exact in any order) the block's gradient and the messages are the
  views' bit for bit; on random values they agree within the data's rounding bound of the longest sum behind an
  element (its terms counted, and their magnitudes summed, by the views' adjoint itself
  on ones and on ``|g|``).
* It is one gather each way: a 3-D interior worker's staging is one ``cat`` and one ``index_select``, its
  adjoint one ``index_add`` (the views' path: 13 concatenations, then 13 splits and 27 copies and adds back).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import HaloPlan, resolve_padding
from distfuse.primitives import _halo_gathering as gathering
from distfuse.primitives import halo_exchange
from distfuse.primitives._layout import memory_format_of
from distfuse.primitives.halo_exchange import stage_from_pieces, unstage_to_pieces
from tests.test_halo_pieces_assembly import CHANNELS_LAST, LEAD, _cpu_bound, _middle, _Ops, packed
from tests.test_reliability_properties import _received, _settings, geometries
from tests.tolerances import rounding_bound


@st.composite
def cases(draw):
    nd = draw(st.integers(1, 3))
    geo = draw(geometries(nd=nd, min_n=1, max_n=7 if nd == 3 else 10, max_p=3))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    channels_last = nd > 1 and draw(st.booleans())
    return geo, dtype, channels_last


def _flat(received: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The received boxes end to end, each row-major (what the exchange's one receive buffer holds)."""
    return torch.cat([b.reshape(-1) for b in received]) if received else like.new_empty(0)


@_settings(60)
@given(cases(), st.integers(0, 2**31 - 1))
def test_the_gathered_staging_and_its_adjoint_are_the_views(case, seed):
    (n, grid, kernel, stride, dilation, padding, mode), dtype, channels_last = case
    nd = len(n)
    plan = HaloPlan.for_conv(n, grid, kernel, stride, dilation, resolve_padding(padding, kernel, dilation, stride),
                             mode)
    gen = torch.Generator().manual_seed(seed)
    fmt = CHANNELS_LAST[nd] if channels_last else torch.contiguous_format
    x = torch.randn(LEAD + n, generator=gen, dtype=torch.float64).to(dtype)
    blocks = {idx: x[(..., *local_slices(n, grid, idx))].contiguous(memory_format=fmt) for idx in plan.blocks()}
    for idx in plan.blocks():
        block = blocks[idx]
        fmt_b = memory_format_of(block)
        received = [b.contiguous() for b in _received(plan, idx, blocks)]
        want = stage_from_pieces(block, plan, idx, received)
        staged = gathering.stage_gathered(block, plan, idx, fmt_b, _flat(received, block))
        assert torch.equal(staged, want) and staged.is_contiguous(memory_format=fmt_b), (idx, mode)
        assert not staged._is_view()  # a tensor of its own: the layers write into their staged windows
        assert all(staged.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                   for t in [block, *received] if t.numel() and staged.numel()), idx
        if not staged.numel():
            continue
        shape = tuple(block.shape)
        # integer values: every sum exact in any order, so the two adjoints are the same bits
        g_int = torch.randint(-8, 9, want.shape, generator=gen).to(dtype)
        with packed(False):
            own, outgoing = unstage_to_pieces(g_int, shape, plan, idx, fmt_b)
        own_g, out_g = gathering.unstage_gathered(g_int, shape, plan, idx, fmt_b)
        assert torch.equal(own_g, own) and own_g.dtype == own.dtype, (idx, mode)
        assert own_g.is_contiguous(memory_format=fmt_b) and out_g.dtype == dtype
        assert torch.equal(out_g, _flat(outgoing, g_int)), (idx, mode)
        # random values: within the rounding bound of each element's sum
        g = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)
        with packed(False):
            own, outgoing = unstage_to_pieces(g, shape, plan, idx, fmt_b)
            magnitude, out_magnitude = unstage_to_pieces(g.abs(), shape, plan, idx, fmt_b)
            count, out_count = unstage_to_pieces(torch.ones_like(g), shape, plan, idx, fmt_b)
        own_g, out_g = gathering.unstage_gathered(g, shape, plan, idx, fmt_b)
        terms = max(1, int(count.max())) if count.numel() else 1
        # the views' path sums a replicated run in the data's dtype before its fp32 add, the gather all in fp32
        bound = 2 * rounding_bound(dtype, terms) * magnitude.double()
        assert bool(((own_g.double() - own.double()).abs() <= bound).all()), (idx, mode)
        if outgoing:
            terms = max(1, int(_flat(out_count, g).max()))  # outgoing: some box has elements
            bound = 2 * rounding_bound(dtype, terms) * _flat(out_magnitude, g).double()
            assert bool(((out_g.double() - _flat(outgoing, g).double()).abs() <= bound).all()), (idx, mode)


@pytest.mark.parametrize("nd", [2, 3])
def test_an_interior_worker_is_one_gather_each_way(nd):
    index = (1,) * nd
    plan, block, received = _middle(nd, index)
    block = block.contiguous()
    flat = _flat([b.contiguous() for b in received], block)
    fmt = torch.contiguous_format
    gathering.stage_gathered(block, plan, index, fmt, flat)  # the index is built at a shape's first call
    with _Ops() as ops:
        staged = gathering.stage_gathered(block, plan, index, fmt, flat)
    assert ops.calls["cat"] == 1 and ops.calls["index_select"] == 1, ops.calls
    assert sum(ops.calls.values()) <= 6, ops.calls  # and the flat views, the zero and the output
    grad = torch.randn_like(staged)
    with _Ops() as ops:
        gathering.unstage_gathered(grad, tuple(block.shape), plan, index, fmt)
    assert ops.calls["index_add_"] == 1 and "cat" not in ops.calls, ops.calls
    assert sum(ops.calls.values()) <= 6, ops.calls  # and the zeros, the views and the messages' slice


def gathered(on: bool):
    """Force the gathered staging (any size) or the views (every size) on CPU tensors."""
    return _cpu_bound(gathering.GATHERED_STAGING_BYTES, on)


def test_the_exchange_takes_the_gather_for_small_dense_blocks_only():
    index = (1, 1)
    plan, block, _ = _middle(2, index)
    assert gathering.gathers(100, block) and not gathering.gathers(0, block)
    big = gathering.GATHERED_STAGING_BYTES["cpu"] // block.element_size() + 1
    assert not gathering.gathers(big, block)
    with gathered(False):
        assert not gathering.gathers(1, block)
    assert halo_exchange.gathering is gathering  # the op pair's own module (tests patch its bound)


def _gather_both_ways(device: str) -> None:
    """A 3-D interior worker under circular padding (26 received boxes, and the block read again at the wrap on a
    3-worker axis) and a 2-D replicate worker (a replicated run summed back): the gather against the views on
    ``device``, both memory formats, bfloat16 and fp32; the staged input bit for bit, the adjoint bit for bit on
    integer values, and on random ones the same bits on a second run (a fixed order of the sums)."""
    cases = [(HaloPlan.for_conv((6, 6, 6), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), ((1, 1),) * 3, "circular"),
              (1, 1, 1), torch.channels_last_3d),
             (HaloPlan.for_conv((5, 7), (2, 3), (5, 3), (1, 1), (1, 1), ((2, 2), (1, 1)), "replicate"),
              (0, 2), torch.channels_last)]
    gen = torch.Generator().manual_seed(31)
    for plan, index, cl in cases:
        nd = len(index)
        for dtype in (torch.bfloat16, torch.float32):
            for fmt in (torch.contiguous_format, cl):
                x = torch.randint(-4, 5, LEAD + plan.input_shape(index), generator=gen).to(device, dtype)
                x = x.contiguous(memory_format=fmt)
                received = [torch.randint(-4, 5, LEAD + pc.src_shape, generator=gen).to(device, dtype)
                            for pc in plan.recvs(index)]
                fmt_b = memory_format_of(x)
                want = stage_from_pieces(x, plan, index, received)
                staged = gathering.stage_gathered(x, plan, index, fmt_b, _flat(received, x))
                assert torch.equal(staged, want) and staged.is_contiguous(memory_format=fmt_b), (nd, dtype, fmt)
                g_int = torch.randint(-4, 5, want.shape, generator=gen).to(device, dtype)
                with packed(False):
                    own, outgoing = unstage_to_pieces(g_int, tuple(x.shape), plan, index, fmt_b)
                own_g, out_g = gathering.unstage_gathered(g_int, tuple(x.shape), plan, index, fmt_b)
                assert torch.equal(own_g, own) and torch.equal(out_g, _flat(outgoing, g_int)), (nd, dtype, fmt)
                g = torch.randn(want.shape, generator=gen).to(device, dtype)
                first = gathering.unstage_gathered(g, tuple(x.shape), plan, index, fmt_b)
                again = gathering.unstage_gathered(g, tuple(x.shape), plan, index, fmt_b)
                assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), (nd, dtype, fmt)


def test_the_gather_on_fixed_workers():
    _gather_both_ways("cpu")


@pytest.mark.cuda
def test_the_gather_on_fixed_workers_cuda():
    """On a GPU the adjoint's add is ``index_put_(accumulate=True)``: the views' bits on integer values, and the
    same bits run after run on random ones."""
    _gather_both_ways("cuda")
