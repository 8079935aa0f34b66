"""The unfused halo staging's two forms (nested concatenations for small tensors, a copy per box for large ones)
and its adjoint, against torch's global padding, for random 1-D to 3-D geometries.

* Staging is data movement: both forms equal ``F.pad`` of the global tensor (each of the four padding modes),
  cut at the worker's needed range, bit for bit, in float64 and bfloat16, and keep a ``channels_last`` block's
  format.
* The adjoint (``unstage_to_pieces`` on every worker, each send-back box added into its owner's block) equals the
  gradient of that global padding computed by autograd in float64, within the rounding bound of the longest sum
  behind an element (``rounding_bound(dtype, terms)`` times the sum of its terms' magnitudes, which autograd also
  gives, from ``|g|``).
* The point of the nested form is the host's share of a small step: a 2-D interior worker's staging is 4
  concatenations, not 9 indexed copies; a boundary worker's zero fill is one ``zeros`` per band, not per box.
* The adjoint's messages, box by box or packed by one gather (``distfuse.primitives._halo_packing``), are the same
  bits; packed, a worker's 8 or 26 messages are one ``take`` and one ``split``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.halo_plan import HaloPlan, resolve_padding
from distfuse.primitives import _halo_packing as packing
from distfuse.primitives import halo_exchange
from distfuse.primitives._layout import memory_format_of
from distfuse.primitives.halo_exchange import stage_from_pieces, unstage_to_pieces
from tests.test_reliability_properties import _received, _settings, geometries
from tests.tolerances import rounding_bound

TORCH_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}
CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
LEAD = (2, 3)  # [batch, channels]


@contextlib.contextmanager
def _cpu_bound(table: dict, on: bool):
    """A per-device byte bound (``NESTED_STAGING_BYTES``, ``PACKED_HALO_BYTES``) set for CPU tensors so that its
    small form is taken at any size (``on``) or at none."""
    saved = dict(table)
    table["cpu"] = 1 << 62 if on else -1
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def assembly(nested: bool):
    """Force the nested concatenations (any size) or the copy per box (every size) on CPU tensors."""
    return _cpu_bound(halo_exchange.NESTED_STAGING_BYTES, nested)


def packed(flag: bool):
    """Force the messages packed by one gather (any size) or made box by box (every size) on CPU tensors."""
    return _cpu_bound(packing.PACKED_HALO_BYTES, flag)




def _global_pad(x: torch.Tensor, pads, mode: str) -> torch.Tensor:
    """torch's own padding of the global tensor (F.pad takes the last axis first)."""
    flat = [p for lo_hi in reversed(pads) for p in lo_hi]
    return F.pad(x, flat, mode=TORCH_MODE[mode]) if any(flat) else x


def _needed(plan: HaloPlan, idx, pads) -> tuple:
    """The worker's staged box in the padded global tensor."""
    return (Ellipsis, *(slice(a + lo, b + lo) for (a, b), (lo, _) in
                        zip((ax.needed_range(i) for ax, i in zip(plan.axes, idx)), pads)))


@st.composite
def cases(draw):
    nd = draw(st.integers(1, 3))
    geo = draw(geometries(nd=nd, min_n=1, max_n=7 if nd == 3 else 10, max_p=3))
    dtype = draw(st.sampled_from([torch.float64, torch.bfloat16]))
    channels_last = nd > 1 and draw(st.booleans())
    return geo, dtype, channels_last


@_settings(60)
@given(cases(), st.integers(0, 2**31 - 1))
def test_both_assemblies_equal_global_padding_and_the_adjoint_is_its_gradient(case, seed):
    (n, grid, kernel, stride, dilation, padding, mode), dtype, channels_last = case
    nd = len(n)
    pads = resolve_padding(padding, kernel, dilation, stride)
    plan = HaloPlan.for_conv(n, grid, kernel, stride, dilation, pads, mode)
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(LEAD + n, generator=gen, dtype=torch.float64).to(dtype).double()  # values dtype holds
    fmt = CHANNELS_LAST[nd] if channels_last else torch.contiguous_format
    blocks = {idx: x64[(..., *local_slices(n, grid, idx))].to(dtype).contiguous(memory_format=fmt)
              for idx in plan.blocks()}
    padded = _global_pad(x64, pads, mode)

    # staging: bit for bit, both forms, in the block's format
    grads = {}
    for idx in plan.blocks():
        want = padded[_needed(plan, idx, pads)].to(dtype)
        # the messages as the exchange delivers them: contiguous NCHW boxes, whatever the block's format
        received = [box.contiguous() for box in _received(plan, idx, blocks)]
        for nested in (True, False):
            with assembly(nested):
                staged = stage_from_pieces(blocks[idx], plan, idx, received)
            assert staged.shape == want.shape, (idx, nested)
            assert torch.equal(staged, want), (idx, nested, mode)
            block_fmt = memory_format_of(blocks[idx])
            assert staged.is_contiguous(memory_format=block_fmt), (idx, nested, staged.stride())
            # a new tensor: never the block's memory or a receive buffer's
            assert all(staged.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                       for t in [blocks[idx], *received] if t.numel() and staged.numel()), (idx, nested)
        grads[idx] = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)

    # adjoint: every worker's own gradient plus the boxes the others send back, against autograd's
    got = {idx: torch.zeros(b.shape, dtype=torch.float64) for idx, b in blocks.items()}
    for idx in plan.blocks():
        with packed(False):  # the messages box by box, then packed by one gather: the same bits
            own, outgoing = unstage_to_pieces(grads[idx], blocks[idx].shape, plan, idx, memory_format_of(blocks[idx]))
        with packed(True):
            own_p, outgoing_p = unstage_to_pieces(grads[idx], blocks[idx].shape, plan, idx,
                                                  memory_format_of(blocks[idx]), flat_messages=True)
        assert torch.equal(own, own_p) and len(outgoing) == len(outgoing_p), idx
        assert all(b.is_contiguous() and torch.equal(a, b.view(a.shape))
                   for a, b in zip(outgoing, outgoing_p, strict=True)), idx
        assert own.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
        assert own.is_contiguous(memory_format=memory_format_of(blocks[idx]))
        got[idx] += own.double()
        for pc, box in zip(plan.recvs(idx), outgoing, strict=True):
            assert box.is_contiguous() and box.shape == LEAD + pc.src_shape
            got[pc.src][(..., *pc.src_slices())] += box.double()
    leaf = x64.clone().requires_grad_(True)
    out = _global_pad(leaf, pads, mode)
    parts = [(out[_needed(plan, idx, pads)], grads[idx].double()) for idx in plan.blocks()]
    (want,) = torch.autograd.grad(sum((p * g).sum() for p, g in parts), leaf, allow_unused=True)
    # the sum of the magnitudes of an element's terms, and their count: the same gradient of |g|, and of ones
    ones = x64.clone().requires_grad_(True)
    out1 = _global_pad(ones, pads, mode)
    cuts = [out1[_needed(plan, idx, pads)] for idx in plan.blocks()]
    (magnitude,) = torch.autograd.grad(sum((c * grads[idx].double().abs()).sum()
                                           for c, idx in zip(cuts, plan.blocks())), ones, retain_graph=True,
                                       allow_unused=True)
    (count,) = torch.autograd.grad(sum(c.sum() for c in cuts), ones, allow_unused=True)
    want = torch.zeros_like(x64) if want is None else want
    magnitude = torch.zeros_like(x64) if magnitude is None else magnitude
    terms = max(1, int(count.max())) if count is not None else 1
    assembled = torch.zeros_like(x64)
    for idx in plan.blocks():
        assembled[(..., *local_slices(n, grid, idx))] = got[idx]
    bound = rounding_bound(dtype, terms) * magnitude
    assert bool(((assembled - want).abs() <= bound).all()), (mode, float((assembled - want).abs().max()))


class _Ops(TorchDispatchMode):
    """The aten calls made under it, by name."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _middle(nd: int, index) -> tuple:
    """A 3^nd grid of 3^nd blocks, halo 1, zero padding; the block, the plan and what ``index`` receives."""
    plan = HaloPlan.for_conv((9,) * nd, (3,) * nd, (3,) * nd, (1,) * nd, (1,) * nd, ((1, 1),) * nd, "zeros")
    x = torch.randn((1, 2) + (9,) * nd, dtype=torch.float64)
    blocks = {idx: x[(..., *local_slices(x.shape[2:], plan.grid, idx))] for idx in plan.blocks()}
    return plan, blocks[index], _received(plan, index, blocks)


def test_an_interior_worker_is_one_concatenation_per_run_and_no_copy_per_box():
    for nd, runs in ((2, 4), (3, 13)):
        index = (1,) * nd
        plan, block, received = _middle(nd, index)
        with assembly(True), _Ops() as ops:
            stage_from_pieces(block, plan, index, received)
        # the concatenations and the view of the block; no allocation, no copy of its own
        assert ops.calls["cat"] == runs and set(ops.calls) <= {"cat", "alias", "slice"}, (nd, ops.calls)
        with assembly(False), _Ops() as ops:  # large tensors: one pass, a copy per box
            stage_from_pieces(block, plan, index, received)
        assert ops.calls["cat"] == 0 and ops.calls["copy_"] == 3**nd, (nd, ops.calls)
        # the adjoint: views by one split per run, one copy of the interior piece, one contiguous copy per message
        grad = torch.randn((1, 2) + plan.staged_shape(index), dtype=torch.float64)
        with packed(False), _Ops() as ops:
            _, outgoing = unstage_to_pieces(grad, block.shape, plan, index)
        assert ops.calls["split_with_sizes"] == runs and ops.calls["clone"] == len(outgoing) == 3**nd - 1, ops.calls
        assert sum(ops.calls.values()) == runs + 1 + len(outgoing), ops.calls
        # small messages: one gather of them all (distfuse.primitives._halo_packing), split, each a view; its
        # index is built at the first call of a shape
        with packed(True):
            assert all(m.shape == (1, 2) + pc.src_shape for m, pc in
                       zip(unstage_to_pieces(grad, block.shape, plan, index)[1], plan.recvs(index), strict=True))
            unstage_to_pieces(grad, block.shape, plan, index, flat_messages=True)
            with _Ops() as ops:
                _, outgoing = unstage_to_pieces(grad, block.shape, plan, index, flat_messages=True)
        assert ops.calls["take"] == 1 and ops.calls["split_with_sizes"] == runs + 1 and "clone" not in ops.calls
        assert len(outgoing) == 3**nd - 1 and sum(ops.calls.values()) == runs + 1 + 2, ops.calls


def test_a_boundary_worker_makes_its_zero_fill_once_per_band():
    plan, block, received = _middle(2, (0, 0))  # zero padding above and to the left: 5 of its 9 pieces
    assert sum(pc.src is None for pc in plan.pieces((0, 0))) == 5
    with assembly(True), _Ops() as ops:
        staged = stage_from_pieces(block, plan, (0, 0), received)
    zeros = sum(c for name, c in ops.calls.items() if "zero" in name or name in ("fill_", "full"))
    assert zeros <= 3, ops.calls  # the top band once, then one box in each of the other two bands
    assert bool((staged[..., 0, :] == 0).all()) and bool((staged[..., :, 0] == 0).all())
    assert torch.equal(staged[..., 1:, 1:], torch.cat(
        [torch.cat([block, received[0]], -1), torch.cat([received[1], received[2]], -1)], -2))


def _adds_both_ways(device: str) -> None:
    """The boxes that come back to a 3-D interior worker (26, overlapping at its edges and corners: an element
    gets up to seven terms), added per box and by ``add_incoming`` into a dense block gradient of either memory
    format, fp32 and fp64: the same bits, and the same bits again on a second run."""
    plan = HaloPlan.for_conv((6, 6, 6), (3, 3, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), ((1, 1),) * 3, "circular")
    index = (1, 1, 1)
    lead = (2, 3)
    gen = torch.Generator().manual_seed(23)
    sizes = packing.message_numels(plan, index, 6)[0]
    assert len(sizes) == 26 and all(sizes)
    for dtype in (torch.float32, torch.float64):
        flat = torch.randn(sum(sizes), generator=gen, dtype=dtype).to(device)
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            start = torch.randn(lead + plan.input_shape(index), generator=gen, dtype=dtype).to(device)
            start = start.contiguous(memory_format=fmt)
            want = start.clone(memory_format=fmt)
            for (_, pc), box in zip(plan.sends(index), flat.split(sizes), strict=True):
                want[pc.src_index].add_(box.view(lead + pc.src_shape))
            runs = []
            for _ in range(2):
                got = start.clone(memory_format=fmt)
                packing.add_incoming(got, plan, index, flat)
                runs.append(got)
            assert torch.equal(runs[0], want) and torch.equal(runs[1], want), (dtype, fmt)


def test_the_boxes_that_come_back_are_added_at_once_in_box_order():
    _adds_both_ways("cpu")


@pytest.mark.cuda
def test_the_boxes_that_come_back_are_added_at_once_in_box_order_cuda():
    """On a GPU the add is ``index_put_(accumulate=True)`` (deterministic by torch's list; ``index_add_`` there uses
    atomics): the same bits as the adds per box, run after run."""
    _adds_both_ways("cuda")
