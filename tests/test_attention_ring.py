"""Ring attention on ranks: forward and every gradient against float64 scaled_dot_product_attention on the global
tensors; the layouts; the skipped blocks; misuse raising on every rank."""

import pytest
import torch
import torch.nn.functional as F

from distfuse import Partition, zero_volume_tensor
from distfuse.errors import ShapeError
from distfuse.layers import DistributedAttention, distributed_attention
from distfuse.layers.attention_ring import _Geo, _pairs, load_balanced_order, load_balanced_split, local_positions
from distfuse.testing import run_ranks
from tests.misuse_support import run_misuse
from tests.tolerances import tol


def _reference(q, k, v, dout, causal, mask):
    """float64 SDPA on the global tensors (GQA by repeating K/V heads) and its gradients w.r.t. q, k, v."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    S = q.shape[2]
    allowed = torch.ones(q.shape[0], 1, S, S, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=allowed)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _ring_partition(ranks, grid=None):
    """The ring of ``ranks`` (collective over the world) and its data seed; with ``grid``, ``ranks`` form a
    ``[rings, W]`` Cartesian grid and each row is its own ring (seeded by its row)."""
    P = Partition.world().create_partition_inclusive(ranks)
    if grid is None:
        return P, 0
    P_grid = P.create_cartesian_topology_partition(grid)
    return P_grid.create_cartesian_subtopology_partition([False, True]), P_grid.index[0]


def _case(ranks, S, B, Hq, Hkv, D, causal, layout, dtype, with_mask, grid=None):
    """Every rank builds the same global data; the ranks of ``ranks`` (in ring order) each take their rows.

    With ``grid``, ``ranks`` form a ``[rings, W]`` Cartesian grid and each row is its own ring (the sub-grid that
    keeps the last axis), with its own data.
    """
    P, seed = _ring_partition(ranks, grid)
    gen = torch.Generator().manual_seed(1000 + seed)
    # What the workers hold: rounded to dtype, so the reference sees the same inputs.
    q = torch.randn(B, Hq, S, D, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, Hq, S, D, generator=gen, dtype=torch.float64).to(dtype)
    mask = None
    if with_mask:
        mask = torch.rand(B, S, generator=gen) < 0.7
        mask[:, 0] = True  # every query row keeps a key (SDPA returns NaN for a row with none)
    if not P.active:
        z = zero_volume_tensor(dtype=dtype)
        out = distributed_attention(z, z, z, P, causal=causal, layout=layout)
        assert out.numel() == 0
        return "inactive"
    pos = local_positions(S, P.size, P.rank, layout)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, P, causal=causal, layout=layout,
                                attn_mask=None if mask is None else mask[:, pos].clone())
    out.backward(dout[:, :, pos])
    ref, dq, dk, dv = _reference(q, k, v, dout, causal, mask)
    # Each value is a sum over S keys of products whose factors are sums over D (scores, dO V^T): bounded by the
    # rounding of one sum of S * D terms.  16-bit inputs are computed in fp32 and rounded once on the way out.
    t = tol(dtype, terms=S * D)
    for name, got, want in (("out", out, ref), ("dq", ql.grad, dq), ("dk", kl.grad, dk), ("dv", vl.grad, dv)):
        assert got.dtype == dtype, (name, got.dtype)
        torch.testing.assert_close(got.double(), want[:, :, pos], **t, msg=lambda m, n=name: f"{n}: {m}")
    return P.rank


CASES = [
    # world, ranks (ring order), S, B, Hq, Hkv, D, layout
    pytest.param(1, [0], 5, 2, 2, 2, 4, "contiguous", id="W1"),
    pytest.param(2, [0, 1], 6, 1, 2, 1, 4, "contiguous", id="W2-gqa"),
    pytest.param(3, [0, 1, 2], 7, 1, 4, 2, 4, "contiguous", id="W3-uneven-S7-gqa"),
    pytest.param(3, [0, 1, 2], 2, 1, 2, 2, 4, "contiguous", id="W3-S2-empty-block"),
    pytest.param(4, [2, 0, 3, 1], 16, 1, 4, 2, 4, "zigzag", id="W4-zigzag-S16-permuted-gqa"),
    pytest.param(4, [2, 0, 1], 7, 2, 2, 1, 4, "contiguous", id="W3-of-4-inactive-permuted"),
    pytest.param(4, [3, 1, 0, 2], 10, 1, 4, 4, 4, "contiguous", id="W4-uneven-S10-permuted"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world,ranks,S,B,Hq,Hkv,D,layout", CASES)
def test_matches_sdpa(world, ranks, S, B, Hq, Hkv, D, layout, causal):
    for dtype, with_mask in ((torch.float32, False), (torch.bfloat16, True)):
        got = run_ranks(world, _case, ranks, S, B, Hq, Hkv, D, causal, layout, dtype, with_mask)
        assert sorted(r for r in got if r != "inactive") == list(range(len(ranks)))
        assert got.count("inactive") == world - len(ranks)


def test_eight_workers_zigzag_and_contiguous():
    got = run_ranks(8, _case, [5, 2, 7, 0, 1, 6, 3, 4], 16, 1, 2, 1, 4, True, "zigzag", torch.float32, True)
    assert sorted(got) == list(range(8))
    got = run_ranks(8, _case, list(range(8)), 11, 1, 2, 2, 4, True, "contiguous", torch.float32, False)
    assert sorted(got) == list(range(8))


def test_rings_of_a_larger_grid():
    """A [2, 2] grid whose rows are two independent rings (create_cartesian_subtopology_partition)."""
    got = run_ranks(4, _case, [3, 1, 0, 2], 6, 1, 2, 1, 4, True, "contiguous", torch.float32, True, grid=(2, 2))
    assert got == [0, 1, 1, 0]  # world ranks 3, 1 are ring 0; 0, 2 ring 1 (ring positions by world rank)


def _no_key_rows():
    """A batch whose keys are all masked: its rows are zeros with zero gradients (SDPA would give NaN)."""
    P = Partition.world().create_partition_inclusive([1, 0])
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1] = False
    out = distributed_attention(q, k, v, P, attn_mask=mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert out[1].abs().max() == 0 and q.grad[1].abs().max() == 0 and v.grad[1].abs().max() == 0
    assert out[0].abs().max() > 0 and v.grad[0].abs().max() > 0
    return True


def test_rows_without_keys_are_zero():
    assert all(run_ranks(2, _no_key_rows))


# ---------------------------------------------------------------- layouts and skipped blocks (no ranks)

def test_load_balanced_split_and_order():
    assert load_balanced_split(8, 2) == [((0, 2), (6, 8)), ((2, 4), (4, 6))]
    order = load_balanced_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    for r in range(4):
        assert local_positions(16, 4, r, "zigzag").tolist() == order[4 * r:4 * r + 4].tolist()
    assert local_positions(7, 3, 0).tolist() == [0, 1, 2] and local_positions(7, 3, 2).tolist() == [5, 6]
    with pytest.raises(ShapeError, match="multiple of 8"):
        load_balanced_split(12, 4)


def _score_work(S, W, r, layout, causal):
    """Score elements worker r computes over the whole ring (the GEMMs that are not skipped)."""
    geo = _Geo(ranks=tuple(range(W)), r=r, W=W, S=S, B=1, Hkv=1, G=1, D=1, layout=layout, causal=causal,
               scale=1.0, has_mask=False)
    return sum(n * m for src in range(W) for _, _, _, n, _, _, m, _ in _pairs(geo, src))


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_causal_skips_masked_blocks_and_zigzag_balances(W):
    S = 4 * W
    visible = S * (S + 1) // 2  # the causal triangle, diagonal included
    zig = [_score_work(S, W, r, "zigzag", True) for r in range(W)]
    contiguous = [_score_work(S, W, r, "contiguous", True) for r in range(W)]
    full = [_score_work(S, W, r, "contiguous", False) for r in range(W)]
    assert full == [S * S // W] * W
    assert len(set(zig)) == 1, zig  # balanced
    # Skipping fully masked blocks: the work is the triangle plus the masked halves of the diagonal blocks only.
    c = S // (2 * W)
    assert sum(zig) == visible + 2 * W * (c * (c - 1) // 2), zig  # 2W diagonal chunk blocks
    b = S // W
    assert contiguous == [(r + 1) * b * b for r in range(W)]  # worker r: r blocks below the diagonal and its own


# ---------------------------------------------------------------- agreement and misuse

def _steady_state_then_change():
    P = Partition.world().create_partition_inclusive([1, 0, 2])
    layer = DistributedAttention(P, causal=True)
    x = torch.randn(1, 2, 3, 4)
    for _ in range(3):
        layer(x, x, x)
    gathers = layer.agreement.slow_calls
    y = torch.randn(1, 2, 2 if P.rank == 0 else 1, 4)  # a new global S (4 = 2 + 1 + 1): every worker re-agrees
    out = layer(y, y, y)
    return gathers, layer.agreement.slow_calls, layer.agreement.calls, tuple(out.shape)


def test_agreement_settles_once_and_follows_a_change():
    for r, (gathers, after, calls, shape) in enumerate(run_ranks(3, _steady_state_then_change)):
        assert (gathers, after, calls) == (1, 2, 4)
        assert shape == (1, 2, 2 if r == 1 else 1, 4)  # rank 1 is ring position 0


def _misuse(kind):
    P = Partition.world().create_partition_inclusive([0, 1, 2])
    me = P.rank
    q = k = v = torch.randn(1, 2, 3, 4)
    kw = {}
    if kind == "head_dim":
        q = k = v = torch.randn(1, 2, 3, 4 if me else 8)
    elif kind == "gqa":
        k = v = torch.randn(1, 3 if me == 2 else 2, 3, 4)
    elif kind == "zigzag":
        kw = dict(layout="zigzag", causal=True)  # S = 9 is not a multiple of 2W = 6
    elif kind == "unbalanced":
        q = k = v = torch.randn(1, 2, 2 if me == 0 else 3, 4)  # 8 over 3 is 3, 3, 2
    elif kind == "causal":
        kw = dict(causal=me == 1)
    try:
        distributed_attention(q, k, v, P, **kw)
    except ShapeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind,needle", [
    ("head_dim", "workers of P_cp must agree on head dim D"),
    ("gqa", "world rank 2: Hq (q's heads) must be a positive multiple of Hkv"),
    ("zigzag", "multiple of 6"),
    ("unbalanced", "not the contiguous layout's blocks of S = 8"),
    ("causal", "must agree on causal"),
])
def test_misuse_raises_on_every_rank(kind, needle):
    msgs = run_misuse(3, _misuse, kind, timeout=60)
    assert all(m is not None and needle in m for m in msgs), msgs


# ------------------------------------------------------------------ the fused transport (symmetric-memory push)


def _fused_matches_unfused(ranks, S, B, Hq, Hkv, D, causal, layout, with_mask, grid=None):
    """The same call on both transports: the push into the next worker's symmetric slot (``DISTFUSE_PATH=fused``,
    /dev/shm on CPU) and isend / irecv.  Only the transport differs, so output and gradients are bitwise equal."""
    from distfuse.fused import symmetric
    from distfuse.layers import DistributedAttention
    from tests.test_conv_support import with_path

    P, seed = _ring_partition(ranks, grid)
    layers = {path: DistributedAttention(P, causal=causal, layout=layout) for path in ("unfused", "fused")}
    if not P.active:
        return "inactive"
    gen = torch.Generator().manual_seed(2000 + seed)
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen) for h in (Hq, Hkv, Hkv, Hq))
    mask = (torch.rand(B, S, generator=gen) < 0.7) if with_mask else None
    pos = local_positions(S, P.size, P.rank, layout)
    got = {}
    for path, layer in layers.items():
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        out = with_path(path, lambda layer=layer, ql=ql, kl=kl, vl=vl: layer(
            ql, kl, vl, None if mask is None else mask[:, pos].clone()))
        out.backward(dout[:, :, pos])
        want = "fused" if path == "fused" and P.size > 1 else "unfused"
        assert layer.last_decision.path == want, (path, layer.last_decision)
        got[path] = (out.detach(), ql.grad, kl.grad, vl.grad)
    symmetric.close_all()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got["unfused"], got["fused"], strict=True):
        assert torch.equal(a, b), f"{name}: the fused transport changed the result"
    return P.rank


@pytest.mark.parametrize("world,ranks,S,B,Hq,Hkv,D,layout,causal,with_mask,grid", [
    pytest.param(2, [1, 0], 6, 1, 2, 1, 4, "contiguous", False, False, None, id="W2-permuted-gqa"),
    pytest.param(3, [2, 0, 1], 7, 2, 4, 2, 4, "contiguous", True, True, None, id="W3-uneven-S7-causal-mask"),
    pytest.param(4, [3, 1, 0, 2], 16, 1, 4, 2, 4, "zigzag", True, False, None, id="W4-zigzag-permuted-gqa"),
    pytest.param(4, [2, 0, 1], 5, 1, 2, 2, 4, "contiguous", True, False, None, id="W3-of-4-inactive"),
    pytest.param(4, [3, 1, 0, 2], 6, 1, 2, 1, 4, "contiguous", True, True, (2, 2), id="two-rings-of-a-grid"),
])
def test_fused_transport_matches_point_to_point(world, ranks, S, B, Hq, Hkv, D, layout, causal, with_mask, grid):
    got = run_ranks(world, _fused_matches_unfused, ranks, S, B, Hq, Hkv, D, causal, layout, with_mask, grid)
    active = [r for r in got if r != "inactive"]
    assert len(active) == len(ranks) and got.count("inactive") == world - len(ranks), got
