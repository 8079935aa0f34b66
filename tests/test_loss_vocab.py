"""Vocabulary-parallel cross-entropy against ``torch.nn.functional.cross_entropy`` on the gathered tensors.

Method: every rank draws the same fresh global logits ``[*S, V]`` and targets ``[*S]`` (some
set to ``ignore_index``), evaluates the float64 torch loss on ``[prod(S), V]`` (logits
rounded to the case's dtype first), and the distributed loss on its blocks (rows split by
the leading axes of ``P_x``, classes by the last), for ``reduction`` in ``none``, ``sum`` and
``mean``.  Each active worker checks its rows (``none``) or the global scalar, which every
worker of ``P_x`` must hold bitwise, and its logits-gradient block; backward is seeded with
the same random gradient on every worker, as a replicated training loop does.  Workers
outside ``P_x`` must get a zero-volume tensor.  Misuse (targets that differ over the
vocabulary axis, out-of-range targets, widths that are not the partition's blocks of
``V``) must raise the same error on every worker that is involved, promptly.

Case ids read ``<grid>-<what is special>``.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse import PartitionError, ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers.embedding import DistributedEmbedding
from distfuse.layers.loss_vocab import DistributedVocabCrossEntropyLoss
from distfuse.primitives import _flag_board
from distfuse.testing import run_ranks
from tests.misuse_support import catch, run_misuse
from tests.test_conv_support import grid
from tests.tolerances import tol

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple  # global logits [*S, V]
    grid: tuple
    ranks: tuple
    kwargs: tuple = ()
    dtype: torch.dtype = F64


def _c(name, shape, grid_shape, ranks, dtype=F64, **kw):
    return Case(name, tuple(shape), tuple(grid_shape), tuple(ranks), tuple(kw.items()), dtype)


def _data(c: Case, gen: torch.Generator):
    """Global logits (float64, exactly representable in the case's dtype; scaled so the softmax is not flat) and
    targets with about a fifth ignored."""
    V = c.shape[-1]
    x = (3 * torch.randn(c.shape, generator=gen, dtype=F64)).to(c.dtype).double()
    t = torch.randint(0, V, c.shape[:-1], generator=gen)
    ignore = dict(c.kwargs).get("ignore_index", -100)
    t[torch.rand(t.shape, generator=gen) < 0.2] = ignore
    if (t == ignore).all():  # torch's mean of no targets is NaN; keep one
        t.view(-1)[0] = (ignore + 1) % V
    return x, t


def _close(what, got, ref, dtype, terms):
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any() and not torch.isnan(ref).any(), f"{what}: NaN"
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    t = tol(dtype, terms=terms)
    torch.testing.assert_close(got.double(), ref.double(), rtol=t["rtol"], atol=t["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")


def _same_everywhere(what: str, value) -> None:
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    assert len({v for v in seen if v is not None}) <= 1, f"{what}: the workers hold different losses {seen}"


def run_case(c: Case) -> int:
    P_x = grid(c.ranks, c.grid)
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    x_g, t_g = _data(c, gen)
    V, rows = c.shape[-1], t_g.numel()
    terms = V + rows  # a log-sum-exp over V classes, then a sum over the rows
    checks = 0
    for reduction in ("none", "sum", "mean"):
        what = f"{c.name} reduction={reduction}"
        kw = dict(c.kwargs, reduction=reduction)
        layer = DistributedVocabCrossEntropyLoss(P_x, **kw)
        xg = x_g.clone().requires_grad_(True)
        ref = F.cross_entropy(xg.reshape(-1, V), t_g.reshape(-1), **kw)
        ref = ref.reshape(t_g.shape) if reduction == "none" else ref
        seed = torch.randn(ref.shape, generator=gen, dtype=F64).to(c.dtype).double()
        ref.backward(seed)
        if not P_x.active:
            y = layer(zero_volume_tensor(dtype=c.dtype), zero_volume_tensor(dtype=torch.int64))
            assert y.numel() == 0, f"{what}: a worker outside P_x got {tuple(y.shape)}"
            _same_everywhere(what, None)
            continue
        sl = local_slices(c.shape, P_x.shape, P_x.index)
        x = x_g[sl].to(c.dtype).requires_grad_(True)
        y = layer(x, t_g[sl[:-1]])
        assert y.dtype == c.dtype, (what, y.dtype)
        if reduction == "none":
            _close(f"{what}: rows", y, ref.detach()[sl[:-1]], c.dtype, terms)
            _same_everywhere(what, None)
            y.backward(seed[sl[:-1]].to(c.dtype))
        else:
            assert y.dim() == 0, (what, tuple(y.shape))
            _close(f"{what}: loss", y, ref.detach(), c.dtype, terms)
            _same_everywhere(what, float(y))
            y.backward(seed.to(c.dtype))
        _close(f"{what}: logits gradient", x.grad, xg.grad[sl], c.dtype, terms)
        checks += 2
    return checks


def run_cases(cases) -> int:
    n = 0
    for c in cases:
        try:
            n += run_case(c)
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.dtype}] {exc}") from exc
    return n


GROUPS = {
    "w1": (1, [
        _c("1x1-smoothing", (5, 7), (1, 1), (0,), label_smoothing=0.1),
    ]),
    "w2": (2, [
        _c("1x2-uneven-perm", (6, 7), (1, 2), (1, 0)),
        _c("1x1x2-3d-smoothing-ignore-a-class", (2, 3, 9), (1, 1, 2), (0, 1), ignore_index=4, label_smoothing=0.3),
    ]),
    "w3": (3, [
        _c("1x3-uneven-11-over-3-smoothing", (4, 11), (1, 3), (2, 0, 1), label_smoothing=0.2),
        _c("1x3-empty-block-2-classes", (4, 2), (1, 3), (0, 1, 2)),
        _c("3x1-rows-only-f32", (7, 5), (3, 1), (0, 2, 1), F32),
    ]),
    "w4": (4, [
        _c("2x2-uneven-perm-smoothing", (5, 9), (2, 2), (3, 1, 2, 0), label_smoothing=0.1),
        _c("1x3-inactive-perm", (4, 10), (1, 3), (3, 0, 2)),
        _c("1x2x2-3d-seq-split-bf16", (2, 5, 11), (1, 2, 2), (0, 1, 2, 3), BF16, label_smoothing=0.05),
        _c("2x2-empty-row-block", (1, 13), (2, 2), (2, 3, 0, 1), ignore_index=3),
    ]),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_vocab_cross_entropy_matches_torch(group):
    world, cases = GROUPS[group]
    counts = run_ranks(world, run_cases, cases)
    assert sum(counts) >= 2 * 3 * len(cases) - 2 * 3 * world  # inactive workers check nothing, active ones 6 each
    assert all(n > 0 for n in counts[:1])


_SPIED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor", "send",
          "isend", "batch_isend_irecv")



def _no_gather_of_logits() -> list[int]:
    """The full logits never travel: every message of a steady-state forward + backward, as element counts."""
    P_x = grid((0, 1), (1, 2))
    sizes = []

    def spy(real):
        def call(t, *a, **k):
            sizes.append(t.numel() if isinstance(t, torch.Tensor) else -1)
            return real(t, *a, **k)
        return call

    rows, V = 3, 1000
    x = torch.randn(local_shape((rows, V), P_x.shape, P_x.index), dtype=F64, requires_grad=True)
    target = torch.tensor([1, 600, 999])
    layer = DistributedVocabCrossEntropyLoss(P_x, label_smoothing=0.1)
    layer(x, target)  # the first call settles the agreement (its metadata gather is not data)
    layer(x, target)  # the first flag round sets up the one-host flag board (a gloo round, once per group)
    real = {name: getattr(dist, name) for name in _SPIED}
    rounds = _flag_board.rounds_taken()
    for name, fn in real.items():
        setattr(dist, name, spy(fn))
    try:
        layer(x, target).backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    sizes += [1] * (_flag_board.rounds_taken() - rounds)  # board rounds: no message, counted as one element
    return sorted(sizes)


def test_logits_are_never_gathered():
    # the flag round (1: a gloo all-reduce, or a round on the one-host flag board), [max, t, -t] per row (9),
    # [sum exp, x_t, sum x] per row (9); the rows axis has one worker (no final sum) and the backward moves nothing
    assert run_ranks(2, _no_gather_of_logits) == [[1, 9, 9]] * 2


# ------------------------------------------------------------------ misuse: the same error on every involved rank


def _misuse() -> dict:
    rank = dist.get_rank()
    P_x = grid(range(4), (2, 2))
    shape = (5, 9)
    gen = torch.Generator().manual_seed(5)
    x_g = torch.randn(shape, generator=gen)
    t_g = torch.randint(0, 9, (5,), generator=gen)
    sl = local_slices(shape, P_x.shape, P_x.index)

    def x(width=None):
        b = x_g[sl]
        return b if width is None else torch.randn(b.shape[0], width)

    def t(change=(), value=None):
        b = t_g[sl[0]].clone()
        if rank in change:
            b[0] = value
        return b

    layer = {r: DistributedVocabCrossEntropyLoss(P_x, reduction=r) for r in ("none", "sum", "mean")}
    sized = DistributedVocabCrossEntropyLoss(P_x, num_classes=9)
    checks = {
        "differ-mean": lambda: layer["mean"](x(), t((1,), (int(t_g[0]) + 1) % 9)),
        "differ-none": lambda: layer["none"](x(), t((1,), (int(t_g[0]) + 1) % 9)),
        "out-of-range-none": lambda: layer["none"](x(), t((0, 1, 2, 3), 9)),
        "out-of-range-sum": lambda: layer["sum"](x(), t((2, 3), 9)),
        "negative-mean": lambda: layer["mean"](x(), t((0, 1), -5)),
        "width-vs-num-classes": lambda: sized(x(width=4 if rank == 2 else None), t()),
        "width-not-balanced": lambda: layer["mean"](x(width=2 if rank == 3 else None), t()),
        "target-shape": lambda: layer["mean"](x(), t()[:-1] if rank == 3 else t()),
        "float-target": lambda: layer["mean"](x(), t().double()),
        "recovers": lambda: float(layer["mean"](x(), t())),
        "bad-reduction": lambda: DistributedVocabCrossEntropyLoss(P_x, reduction="avg"),
        "smoothing": lambda: DistributedVocabCrossEntropyLoss(P_x, label_smoothing=1.5),
        "one-dim-partition": lambda: DistributedVocabCrossEntropyLoss(grid(range(4), (4,))),
    }
    out = {}
    for name, call in checks.items():
        got = catch(call)
        out[name] = got if got[0] == "ok" else got[:2]
        if got[0] != "ok":
            assert got[2] < 10, (name, got)  # promptly: a flag or a sum reached the rank, not a timeout
    out["expected"] = float(F.cross_entropy(x_g.double(), t_g))  # the float64 loss of the same float32 logits
    return out


MISUSE = {
    "differ-mean": (ShapeError, "vocabulary axis (the last axis of P_x); 1 target entries differ"),
    "differ-none": (ShapeError, "vocabulary axis (the last axis of P_x); 1 target entries differ"),
    "out-of-range-none": (ShapeError, "2 target class indices lie outside [0, 9)"),
    "out-of-range-sum": (ShapeError, "1 target class indices lie outside [0, 9)"),
    "negative-mean": (ShapeError, "outside [0, 9)"),
    "width-vs-num-classes": (ShapeError, "local vocabulary width of the logits on world rank 2"),
    "width-not-balanced": (ShapeError, "local logits shape on world rank"),
    "target-shape": (ShapeError, "target block shape on world rank 3"),
    "float-target": (ShapeError, "target (class indices) dtype"),
    "bad-reduction": (UnsupportedError, "reduction='avg'"),
    "smoothing": (UnsupportedError, "label_smoothing"),
    "one-dim-partition": (PartitionError, "dimensions of P_x"),
}


def test_misuse_raises_on_every_rank():
    results = run_misuse(4, _misuse)
    for rank, out in enumerate(results):
        for name, (cls, fragment) in MISUSE.items():
            got = out[name]
            assert got[0] == cls.__name__ and fragment in got[1], (rank, name, got)
            assert f"[rank {rank}]" in got[1], (rank, name, got)
        assert out["recovers"][0] == "ok", (rank, out["recovers"])
        torch.testing.assert_close(out["recovers"][1], out["expected"], **tol(F32, terms=9 + 5))


# ------------------------------------------------------------------ torch.compile(fullgraph=True)


class _Head(nn.Module):
    """A vocabulary-parallel embedding and the loss's three reductions, in one graph."""

    def __init__(self, P_x, V, D):
        super().__init__()
        self.emb = DistributedEmbedding(P_x, V, D, padding_idx=1)
        self.mean = DistributedVocabCrossEntropyLoss(P_x, num_classes=V)
        self.none = DistributedVocabCrossEntropyLoss(P_x, reduction="none")
        self.sum = DistributedVocabCrossEntropyLoss(P_x, reduction="sum", label_smoothing=0.1)

    def forward(self, ids, logits, target):
        return self.emb(ids), self.mean(logits, target), self.none(logits, target), self.sum(logits, target)


def _compiled_head() -> dict:
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    torch._dynamo.reset()
    P_x = grid((2, 0, 3, 1), (2, 2))
    rows, V, D = 5, 9, 3
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = _Head(P_x, V, D).double()
    x_g, t_g = torch.randn(rows, V, generator=gen, dtype=F64), torch.randint(0, V, (rows,), generator=gen)
    t_g[1] = -100
    ids_g = torch.randint(0, V, (rows,), generator=gen)
    seeds = [torch.randn(rows, D, generator=gen, dtype=F64), torch.randn(rows, generator=gen, dtype=F64)]
    sl = local_slices((rows, V), P_x.shape, P_x.index)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def step(fn):
        model.zero_grad(set_to_none=True)
        x = x_g[sl].clone().requires_grad_(True)
        outs = fn(ids_g[sl[0]], x, t_g[sl[0]])
        torch.autograd.backward(outs, [seeds[0][sl[0]], torch.ones(()), seeds[1][sl[0]], torch.ones(())])
        return [o.detach() for o in outs] + [x.grad, model.emb.weight.grad.clone()]

    eager = step(model)
    explained = torch._dynamo.explain(model)(ids_g[sl[0]], x_g[sl], t_g[sl[0]])
    compiled = step(torch.compile(model, fullgraph=True, dynamic=False, backend=backend))
    for j, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert torch.equal(c, e), f"output/gradient {j}: compiled differs from eager"
    torch.testing.assert_close(eager[1], F.cross_entropy(x_g, t_g), **tol(F64, terms=V + rows))
    ops = []
    for gm in graphs:  # the forward graph, then the backward graph
        ops.append([])
        for node in gm.graph.nodes:
            name = str(node.args[1] if "with_effects" in str(node.target) else node.target)
            if node.op == "call_function" and "distfuse" in name:
                ops[-1].append(name.split(".")[1])
    return dict(breaks=explained.graph_break_count, graphs=explained.graph_count,
                ops=[{name: g.count(name) for name in set(g)} for g in ops])


def test_compiled_embedding_and_losses_match_eager():
    results = run_ranks(4, _compiled_head, timeout=300)
    for r in results:
        assert r["breaks"] == 0 and r["graphs"] == 1, r
    assert all(r["ops"] == results[0]["ops"] for r in results), [r["ops"] for r in results]
    forward, backward = results[0]["ops"]
    # forward: 4 flag rounds, the ids check, the weight's replicate, 3 MAX rounds, 3 checks ('none''s with a sum
    # over P_x inside), and 6 sums (the
    # embedding's and 3 losses' over the vocabulary axis, 2 over the rows)
    assert forward == {"flag_check": 4, "embedding_check": 1, "replicate": 1, "vocab_max": 3, "vocab_loss_check": 3,
                       "replicate_adjoint": 6}, forward
    # backward: the sums' adjoints are copies (no message); one sum, the weight gradient's over the rows axis
    assert backward == {"replicate": 6, "replicate_adjoint": 1}, backward
