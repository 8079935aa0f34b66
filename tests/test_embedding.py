"""Vocabulary-parallel embedding against ``torch.nn.Embedding`` on the gathered tensors.

Method: every rank builds the same float64 ``torch.nn.Embedding`` (fresh random table,
``padding_idx`` where the case has one) and the same global ids, loads the table into the
distributed layer with ``load_sequential`` (checked against a direct slice of the table),
runs its ids block (the ids split over the leading axes of ``P_x``, the same on every
worker of the vocabulary axis) and backward with the same random output gradient on every
worker.  The output must equal torch's bit for bit (each id lies in exactly one block: the
sum adds one row to zeros); each worker's weight-gradient block must match the block of
torch's gradient (summed over the batch workers, so a tolerance), with an exact zero row at
``padding_idx``.  Workers outside ``P_x`` must get a zero-volume tensor.  Misuse (out-of-range
ids, ids that differ over the vocabulary axis, a frozen weight on one worker) must raise
the same error on every worker of ``P_x``, promptly.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfuse import PartitionError, ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import block_range, local_slices
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.embedding import DistributedEmbedding
from distfuse.testing import run_ranks
from tests.misuse_support import catch, run_misuse
from tests.test_conv_support import grid
from tests.tolerances import tol

F64, BF16 = torch.float64, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ids_shape: tuple  # global ids [*S]
    V: int
    D: int
    grid: tuple  # [*P_S, P_v]
    ranks: tuple
    padding_idx: int | None = None
    dtype: torch.dtype = F64
    ids_dtype: torch.dtype = torch.int64
    sp: bool = False  # sequence_parallel: each vocabulary worker gets its block of the rows


CASES = {
    1: [Case("1x1-padding", (6,), 7, 3, (1, 1), (0,), padding_idx=2)],
    2: [Case("1x2-uneven-perm-negative-padding", (9,), 11, 4, (1, 2), (1, 0), padding_idx=-1),
        Case("2x1-batch-only-int32-ids", (5,), 6, 2, (2, 1), (0, 1), ids_dtype=torch.int32)],
    3: [Case("1x1x3-11-over-3-padding-last-block", (2, 5), 11, 3, (1, 1, 3), (2, 0, 1), padding_idx=9),
        Case("1x3-empty-block-2-rows", (4,), 2, 3, (1, 3), (0, 1, 2))],
    4: [Case("2x2-uneven-perm-padding-0", (5,), 9, 3, (2, 2), (3, 1, 2, 0), padding_idx=0),
        Case("1x3-inactive-perm", (6,), 10, 2, (1, 3), (3, 0, 2), padding_idx=4),
        Case("2x1x2-3d-bf16", (3, 4), 7, 5, (2, 1, 2), (0, 1, 2, 3), padding_idx=6, dtype=BF16),
        # sequence-parallel: the rows reduce-scattered over the vocabulary axis (5 rows over 2 and 3 over 3: uneven)
        Case("1x2x2-sp-perm-padding", (2, 10), 9, 3, (1, 2, 2), (2, 0, 3, 1), padding_idx=1, sp=True),
        Case("1x3-sp-of-4-inactive", (3,), 8, 4, (1, 3), (3, 1, 0), sp=True)],
}


def run_case(c: Case) -> int:
    P_x = grid(c.ranks, c.grid)
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    seq = nn.Embedding(c.V, c.D, padding_idx=c.padding_idx, dtype=F64)
    with torch.no_grad():
        seq.weight.copy_(torch.randn(c.V, c.D, generator=gen, dtype=F64).to(c.dtype))
        if c.padding_idx is not None:
            seq.weight[c.padding_idx].fill_(0)
    ids_g = torch.randint(0, c.V, c.ids_shape, generator=gen)
    if c.padding_idx is not None:
        ids_g.view(-1)[::3] = c.padding_idx % c.V
    ref = seq(ids_g)
    dy = torch.randn(ref.shape, generator=gen, dtype=F64).to(c.dtype).double()
    ref.backward(dy)

    layer = DistributedEmbedding(P_x, c.V, c.D, padding_idx=c.padding_idx, sequence_parallel=c.sp, dtype=c.dtype)
    if P_x.active:
        layer.weight.data.fill_(float("nan"))  # poisoned: load_sequential must overwrite every element
    load_sequential(layer, seq if dist.get_rank() == 0 else None)
    if not P_x.active:
        assert layer.weight is None
        y = layer(zero_volume_tensor(dtype=torch.int64))
        assert y.numel() == 0, f"{c.name}: a worker outside P_x got {tuple(y.shape)}"
        return 0
    v = P_x.index[-1]
    rows = local_slices((c.V,), (P_x.shape[-1],), (v,))[0]
    assert torch.equal(layer.weight.double(), seq.weight.detach()[rows]), f"{c.name}: loaded block"
    sl = local_slices(c.ids_shape, P_x.shape[:-1], P_x.index[:-1])
    y = layer(ids_g[sl].to(c.ids_dtype))
    want_y, want_dy = ref.detach()[sl], dy[sl]
    if c.sp:  # this vocabulary worker's balanced block of the rows (the last ids dimension)
        mine = slice(*block_range(want_y.shape[-2], P_x.shape[-1], v))
        want_y, want_dy = want_y[..., mine, :], want_dy[..., mine, :]
    assert y.dtype == c.dtype and tuple(y.shape) == tuple(want_y.shape), (c.name, y.dtype, tuple(y.shape))
    assert torch.equal(y.double(), want_y), f"{c.name}: output differs from torch's bits"
    y.backward(want_dy.to(c.dtype))
    got, want = layer.weight.grad.double(), seq.weight.grad[rows]
    # a row's gradient sums its ids' output gradients: at most prod(S) terms, rounded once to the dtype
    torch.testing.assert_close(got, want, **tol(c.dtype, terms=ids_g.numel()),
                               msg=lambda m: f"{c.name}: weight gradient: {m}")
    if c.padding_idx is not None and rows.start <= c.padding_idx % c.V < rows.stop:
        assert not got[c.padding_idx % c.V - rows.start].any(), f"{c.name}: the padding row got a gradient"
    assert seq.weight.grad.abs().sum() > 0, f"{c.name}: the test's gradient is trivially zero"
    return 1


def run_cases(cases) -> int:
    return sum(run_case(c) for c in cases)


@pytest.mark.parametrize("world", list(CASES))
def test_embedding_matches_torch(world):
    counts = run_ranks(world, run_cases, CASES[world])
    assert sum(counts) > 0


def _init_and_collect() -> bool:
    """With one seed on every rank the blocks are one torch.nn.Embedding's (padding row zero), and collect_sequential
    gives its state dict back."""
    P_x = grid((1, 3, 0, 2), (2, 2))
    torch.manual_seed(11)
    seq = nn.Embedding(9, 4, padding_idx=5)
    torch.manual_seed(11)
    layer = DistributedEmbedding(P_x, 9, 4, padding_idx=5)
    rows = local_slices((9,), (2,), (P_x.index[-1],))[0]
    assert torch.equal(layer.weight, seq.weight.detach()[rows])
    state = collect_sequential(layer)
    if dist.get_rank() == 0:
        assert sorted(state) == ["weight"] and torch.equal(state["weight"], seq.weight.detach())
    return True


def test_initialisation_and_collect_match_torch():
    assert all(run_ranks(4, _init_and_collect))


# ------------------------------------------------------------------ misuse: the same error on every rank of P_x


def _misuse() -> dict:
    rank = dist.get_rank()
    P_x = grid(range(4), (2, 2))
    gen = torch.Generator().manual_seed(2)
    ids_g = torch.randint(0, 9, (5,), generator=gen)
    sl = local_slices((5,), (2,), P_x.index[:1])
    layer = DistributedEmbedding(P_x, 9, 3)

    def ids(on=(), value=None):
        b = ids_g[sl].clone()
        if rank in on:
            b[0] = value
        return b

    def frozen_on_rank_0():
        layer.weight.requires_grad_(rank != 0)
        try:
            return layer(ids())
        finally:
            layer.weight.requires_grad_(True)

    checks = {
        "too-large": lambda: layer(ids((2, 3), 9)),  # rows of ranks 2 and 3: ranks 0 and 1 raise too
        "negative": lambda: layer(ids((0, 1), -1)),
        "differ": lambda: layer(ids((3,), (int(ids_g[sl][0]) + 1) % 9)),
        "float-ids": lambda: layer(ids().double()),
        "ids-dims": lambda: layer(ids().unsqueeze(0) if rank == 1 else ids()),
        "frozen-on-one": frozen_on_rank_0,
        "recovers": lambda: layer(ids()).sum().item(),
        "max-norm": lambda: DistributedEmbedding(P_x, 9, 3, max_norm=1.0),
        "sparse": lambda: DistributedEmbedding(P_x, 9, 3, sparse=True),
        "padding-range": lambda: DistributedEmbedding(P_x, 9, 3, padding_idx=9),
        "one-dim-partition": lambda: DistributedEmbedding(grid(range(4), (4,)), 9, 3),
    }
    out = {}
    for name, call in checks.items():
        got = catch(call)
        if got[0] != "ok":
            assert got[2] < 10, (name, got)  # promptly: the check reached the rank, not a timeout
        out[name] = got[:2]
    return out


MISUSE = {
    "too-large": (ShapeError, "ids must lie in [0, num_embeddings=9); out-of-range ids per world rank: {2: 1, 3: 1}"),
    "negative": (ShapeError, "out-of-range ids per world rank: {0: 1, 1: 1}"),
    "differ": (ShapeError, "must hold the same ids; the world ranks of each row that disagrees: [[2, 3]]"),
    "float-ids": (ShapeError, "ids dtype"),
    "ids-dims": (ShapeError, "number of ids[..., None] dimensions"),
    "frozen-on-one": (ShapeError, "every worker's weight must take a gradient or none"),
    "max-norm": (UnsupportedError, "max_norm"),
    "sparse": (UnsupportedError, "sparse"),
    "padding-range": (UnsupportedError, "padding_idx"),
    "one-dim-partition": (PartitionError, "dimensions of P_x"),
}


def test_misuse_raises_on_every_rank():
    for rank, out in enumerate(run_misuse(4, _misuse)):
        for name, (cls, fragment) in MISUSE.items():
            got = out[name]
            assert got[0] == cls.__name__ and fragment in got[1], (rank, name, got)
            assert f"[rank {rank}]" in got[1], (rank, name, got)
        assert out["recovers"][0] == "ok", (rank, out["recovers"])
