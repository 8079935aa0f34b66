"""DistributedMultiheadAttention against its sequential twin MultiheadSelfAttention on the gathered tensors.

Method: every rank builds the same float64 twin with fresh random parameters (not torch's init: its
biases and weights would be small and similar) and the same global input ``x [B, S, E]`` and
output gradient; the twin's forward and backward on the whole sequence are the reference.  The
distributed layer gets the twin's parameters through ``load_sequential`` (its blocks poisoned with
NaN before, so every element must be written), runs its rows (the context axis's positions under
the layout, the same rows on every worker of the tensor axis) and backward with the same output
gradient rows on every worker.  Its output rows, ``dx`` rows and every parameter block's gradient
must match the twin's within the float64 rounding bound; workers outside ``P`` get a zero-volume
tensor.  Initialisation with one seed, ``collect_sequential`` and ``load_sequential`` must round
trip; misuse raises the same error on every rank, promptly.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch
import torch.distributed as dist

from distfuse import PartitionError, ShapeError, zero_volume_tensor
from distfuse.geometry.decomposition import block_range
from distfuse.layers import DistributedMultiheadAttention, MultiheadSelfAttention, collect_sequential, load_sequential
from distfuse.layers.attention_ring import local_positions
from distfuse.testing import run_ranks
from tests.misuse_support import catch, run_misuse
from tests.test_conv_support import grid, with_path
from tests.tolerances import tol

F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    grid: tuple  # [P_cp, P_tp]
    ranks: tuple
    S: int
    heads: int = 4
    kv_heads: int = 4
    E: int = 8
    B: int = 2
    bias: bool = True
    layout: str = "contiguous"
    sp: bool = False  # sequence-parallel: the rows split over the tensor axis too
    path: str = "auto"  # DISTFUSE_PATH for the call ("fused": the projections' fused ops, Triton interpreted)
    dtype: torch.dtype = F64
    pad: bool = False  # a key_padding_mask: batch b's last b % 3 positions are padding


CASES = {
    1: [Case("1x1", (1, 1), (0,), 5, kv_heads=2)],
    2: [Case("2x1-uneven-S5-gqa-padded", (2, 1), (0, 1), 5, kv_heads=2, B=3, pad=True),
        Case("1x2-permuted-gqa-no-bias", (1, 2), (1, 0), 4, kv_heads=2, bias=False)],
    4: [Case("2x2-uneven-S5-gqa-permuted", (2, 2), (3, 1, 2, 0), 5, kv_heads=2),
        Case("2x2-zigzag-S8-padded", (2, 2), (0, 1, 2, 3), 8, layout="zigzag", B=3, pad=True),
        Case("3x1-of-4-inactive-S7", (3, 1), (2, 0, 3), 7, kv_heads=1),
        Case("1x3-of-4-inactive-permuted", (1, 3), (3, 0, 1), 4, heads=6, kv_heads=3, E=12),
        # Sequence-parallel: the projections are the all-gather + GEMM and GEMM + reduce-scatter ops, fused (fp32,
        # the kernels interpreted) or unfused; uneven row blocks over both axes, permuted and inactive ranks.
        Case("2x2-sp-zigzag-S8-fused-permuted-padded", (2, 2), (3, 1, 2, 0), 8, layout="zigzag", sp=True,
             path="fused", dtype=torch.float32, B=3, pad=True),
        Case("2x2-sp-uneven-S7-gqa-padded", (2, 2), (0, 1, 2, 3), 7, kv_heads=2, sp=True, B=3, pad=True),
        Case("1x3-sp-of-4-inactive-S7-fused", (1, 3), (3, 0, 1), 7, heads=6, kv_heads=3, E=12, sp=True,
             path="fused", dtype=torch.float32)],
}
CASES[2].append(Case("1x2-sp-uneven-S5-gqa-fused-no-bias", (1, 2), (1, 0), 5, kv_heads=2, bias=False, sp=True,
                     path="fused", dtype=torch.float32))


def _twin(c: Case, causal: bool, gen: torch.Generator) -> MultiheadSelfAttention:
    twin = MultiheadSelfAttention(c.E, c.heads, c.kv_heads, bias=c.bias, causal=causal, dtype=F64)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) / c.E ** 0.5)
    return twin


def run_case(c: Case, causal: bool) -> str:
    P = grid(c.ranks, c.grid)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{c.name}-{causal}".encode()))
    twin = _twin(c, causal, gen)
    x_g = torch.randn(c.B, c.S, c.E, generator=gen, dtype=F64, requires_grad=True)
    dy = torch.randn(c.B, c.S, c.E, generator=gen, dtype=F64)
    # right padding: every query keeps key 0, so no row is fully masked (SDPA kernels differ on such rows)
    pad_g = torch.arange(c.S)[None, :] >= c.S - torch.arange(c.B)[:, None] % 3 if c.pad else None
    ref = twin(x_g, key_padding_mask=pad_g)
    ref.backward(dy)
    seq_grads = {k: p.grad for k, p in twin.named_parameters()}

    layer = DistributedMultiheadAttention(P, c.E, c.heads, c.kv_heads, bias=c.bias, causal=causal,
                                          layout=c.layout, sequence_parallel=c.sp, dtype=c.dtype)
    for p in layer.parameters():
        p.data.fill_(float("nan"))  # poisoned: load_sequential must overwrite every element
    load_sequential(layer, twin if dist.get_rank() == 0 else None)
    if not P.active:
        assert not list(layer.parameters())
        y = with_path(c.path, lambda: layer(zero_volume_tensor(dtype=c.dtype),
                                            key_padding_mask=zero_volume_tensor(dtype=torch.bool) if c.pad else None))
        assert y.numel() == 0, f"{c.name}: a worker outside P got {tuple(y.shape)}"
        return "inactive"
    pos = local_positions(c.S, c.grid[0], P.index[0], c.layout)
    if c.sp:  # this tensor worker's balanced block of the context index's rows
        pos = pos[slice(*block_range(len(pos), c.grid[1], P.index[1]))]
    x = x_g.detach()[:, pos].to(c.dtype).requires_grad_()
    y = with_path(c.path, lambda: layer(x, key_padding_mask=pad_g[:, pos] if c.pad else None))
    if c.sp:
        paths = {k: d.path for k, d in layer.last_decisions.items()}
        want_path = "fused" if c.path == "fused" and c.grid[1] > 1 else "unfused"
        assert paths == {"qkv": want_path, "out_proj": want_path}, (c.name, layer.last_decisions)
    # The longest sums: a projection's weight gradient over the B S tokens, of products whose factors are sums of
    # E terms (a projection) or of S D terms (the attention's scores, then its weighted sum of values).
    t = tol(c.dtype, terms=c.B * c.S * max(c.E, c.S * c.E // c.heads))
    assert y.dtype == c.dtype and tuple(y.shape) == (c.B, len(pos), c.E), (c.name, tuple(y.shape))
    torch.testing.assert_close(y.double(), ref.detach()[:, pos], **t, msg=lambda m: f"{c.name}: output: {m}")
    y.backward(dy[:, pos].to(c.dtype))
    torch.testing.assert_close(x.grad.double(), x_g.grad[:, pos], **t, msg=lambda m: f"{c.name}: dx: {m}")
    checked = 0
    for lay in layer.param_layouts():
        got, want = getattr(layer, lay.name).grad.double(), seq_grads[lay.seq_name][lay.replica_slices()]
        assert want.abs().max() > 0, f"{c.name}: {lay.seq_name}'s gradient is trivially zero"
        torch.testing.assert_close(got, want, **t, msg=lambda m, n=lay.seq_name: f"{c.name}: d{n}: {m}")
        checked += 1
    assert checked == (8 if c.bias else 4), (c.name, checked)
    return f"{P.index}"


def run_cases(cases) -> list:
    return [run_case(c, causal) for causal in (False, True) for c in cases]


@pytest.mark.parametrize("world", list(CASES))
def test_matches_sequential_twin(world):
    cases = CASES[world]
    got = run_ranks(world, run_cases, cases)
    for k in range(2 * len(cases)):
        c = cases[k % len(cases)]
        per_rank = [rows[k] for rows in got]
        active = sorted(r for r in per_rank if r != "inactive")
        assert len(set(active)) == len(c.ranks) and per_rank.count("inactive") == world - len(c.ranks), (c.name, got)


# ------------------------------------------------------------------ initialisation and the round trip


def _init_and_round_trip() -> bool:
    """With one seed on every rank the blocks are one MultiheadSelfAttention's; collect_sequential gives its state
    back; load_sequential of another twin then collects to that twin's state (also through distfuse.model, which
    maps the layer inside a model by its module path)."""
    from torch import nn

    from distfuse import model

    P = grid((3, 1, 2, 0), (2, 2))
    torch.manual_seed(5)
    twin = MultiheadSelfAttention(8, 4, 2)
    torch.manual_seed(5)
    layer = DistributedMultiheadAttention(P, 8, 4, 2)
    state = collect_sequential(layer)
    if dist.get_rank() == 0:
        want = twin.state_dict()
        assert sorted(state) == sorted(want), (sorted(state), sorted(want))
        assert all(torch.equal(state[k], want[k]) for k in want), "initial blocks differ from torch's draws"
    other = MultiheadSelfAttention(8, 4, 2)
    load_sequential(layer, other if dist.get_rank() == 0 else None)
    wrapped = nn.ModuleDict({"attn": layer})
    back = model.collect_sequential(wrapped)
    if dist.get_rank() == 0:
        assert all(torch.equal(back[f"attn.{k}"], v) for k, v in other.state_dict().items())
        assert len(back) == len(other.state_dict())
    # each rank's state_dict names its blocks (BlockIdentityMixin): W_o's columns follow the tensor index
    ident = layer.state_dict()["_extra_state"]["blocks"]
    t = P.index[1]
    assert ident["out_proj_weight"]["block"] == [[0, 8], [4 * t, 4 * t + 4]], ident["out_proj_weight"]
    assert ident["k_proj_weight"]["block"] == [[2 * t, 2 * t + 2], [0, 8]], ident["k_proj_weight"]
    return True


def test_initialisation_and_round_trip():
    assert all(run_ranks(4, _init_and_round_trip))


# ------------------------------------------------------------------ misuse: the same error on every rank of P


def _misuse() -> dict:
    rank = dist.get_rank()
    P = grid(range(4), (2, 2))
    layer = DistributedMultiheadAttention(P, 8, 4, 2, causal=True)
    sp = DistributedMultiheadAttention(P, 8, 4, 2, causal=True, sequence_parallel=True)
    gen = torch.Generator().manual_seed(3)
    x_g = torch.randn(2, 5, 8, generator=gen)
    pos = local_positions(5, 2, P.index[0])

    def rows(n=None):
        return x_g[:, pos][:, :n] if n is not None else x_g[:, pos]

    def frozen_on_rank_2():
        layer.v_proj_bias.requires_grad_(rank != 2)
        try:
            return layer(rows())
        finally:
            layer.v_proj_bias.requires_grad_(True)

    def debug_values_differ_on_rank_3():
        os.environ["DISTFUSE_DEBUG"] = "1"
        try:
            return layer(rows() + 1.0 if rank == 3 else rows())
        finally:
            os.environ.pop("DISTFUSE_DEBUG")

    checks = {
        "heads": lambda: DistributedMultiheadAttention(P, 12, 3, 3),
        "kv-heads": lambda: DistributedMultiheadAttention(P, 8, 4, 1),
        "one-dim-partition": lambda: DistributedMultiheadAttention(grid(range(4), (4,)), 8, 4),
        "rows-differ-over-tensor-axis": lambda: layer(rows(1) if rank == 3 else rows()),
        "not-the-layout": lambda: layer(rows(1) if P.index[0] == 0 else rows()),
        "embed-dim": lambda: layer(rows()[..., :4] if rank == 1 else rows()),
        "frozen-on-one": frozen_on_rank_2,
        "debug-x-differs-over-tensor-axis": debug_values_differ_on_rank_3,
        # sequence-parallel: context 0's 3 rows must split 2 / 1 over the tensor axis; rank 0 and 1 pass 1 / 2
        "sp-not-balanced": lambda: sp(rows()[:, :1] if rank == 0 else rows()[:, 1:] if rank == 1 else
                                      rows()[:, slice(*block_range(2, 2, P.index[1]))]),
        "mask-on-one": lambda: layer(rows(), key_padding_mask=torch.zeros(2, len(pos), dtype=torch.bool)
                                     if rank == 1 else None),
        "mask-shape": lambda: layer(rows(), key_padding_mask=torch.zeros(2, len(pos) + (rank == 2), dtype=torch.bool)),
        "recovers": lambda: float(layer(rows()).sum()),
        "sp-recovers": lambda: float(sp(rows()[:, slice(*block_range(len(pos), 2, P.index[1]))]).sum()),
    }
    out = {}
    for name, call in checks.items():
        got = catch(call)
        if got[0] != "ok":
            assert got[2] < 10, (name, got)  # promptly: the check reached every rank, not a timeout
        out[name] = got[:2]
    return out


MISUSE = {
    "heads": (PartitionError, "must divide num_heads=3 and num_kv_heads=3"),
    "kv-heads": (PartitionError, "must divide num_heads=4 and num_kv_heads=1"),
    "one-dim-partition": (PartitionError, "2-D CartesianPartition"),
    "rows-differ-over-tensor-axis": (ShapeError, "world rank 3 (P index (1, 1)) holds 1"),
    "not-the-layout": (ShapeError, "row counts [1, 2] are not the contiguous layout's blocks of S = 3"),
    "embed-dim": (ShapeError, "world rank 1: x's last dimension must be embed_dim"),
    "frozen-on-one": (ShapeError, "must agree on the grad settings of the parameters"),
    "debug-x-differs-over-tensor-axis": (ShapeError, "they differ at context indices [1] (world ranks {1: [2, 3]})"),
    "sp-not-balanced": (ShapeError, "world rank 0 (P index (0, 0)) holds 1 rows, block 0 of 3 over 2 workers is 2"),
    "mask-on-one": (ShapeError, "whether a key_padding_mask is passed"),
    "mask-shape": (ShapeError, "world rank 2: key_padding_mask must be a bool tensor [B, S_local] of x's rows"),
}


def test_misuse_raises_on_every_rank():
    for rank, out in enumerate(run_misuse(4, _misuse)):
        for name, (cls, fragment) in MISUSE.items():
            got = out[name]
            assert got[0] == cls.__name__ and fragment in got[1], (rank, name, got)
            assert f"[rank {rank}]" in got[1], (rank, name, got)
        assert out["recovers"][0] == "ok" and out["sp-recovers"][0] == "ok", (rank, out["recovers"], out["sp-recovers"])
