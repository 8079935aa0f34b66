"""Distributed losses against torch.nn on the gathered tensors: the loss, the input gradient, every reduction.

Method: every rank draws the same fresh global input and target, evaluates the float64
``torch.nn`` loss on them (inputs rounded to the case's dtype first) and the distributed
loss on its blocks, for ``reduction`` in ``none``, ``sum`` and ``mean`` (``batchmean``
too for KL).  Each active worker checks its unreduced block, or the global scalar (which
every worker of P_x must hold), and its input-gradient block; backward is seeded with
the same random gradient on every worker, as a replicated training loop does.  Workers
outside P_x must get a zero-volume tensor.

Case ids read ``<loss>-w<world>-<what is special>`` (``uneven``, ``empty``, ``perm``,
``inactive`` as in the norm tests).
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
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.loss import (
    DistributedBCELoss,
    DistributedBCEWithLogitsLoss,
    DistributedKLDivLoss,
    DistributedL1Loss,
    DistributedMSELoss,
)
from distfuse.layers.loss_class import DistributedCrossEntropyLoss, DistributedNLLLoss
from distfuse.testing import run_ranks
from distfuse.testing.tolerance import compare_state
from tests.test_conv_support import grid
from tests.tolerances import tol

KINDS = {
    "mse": (DistributedMSELoss, nn.MSELoss),
    "l1": (DistributedL1Loss, nn.L1Loss),
    "bce": (DistributedBCELoss, nn.BCELoss),
    "bcelogits": (DistributedBCEWithLogitsLoss, nn.BCEWithLogitsLoss),
    "kl": (DistributedKLDivLoss, nn.KLDivLoss),
    "ce": (DistributedCrossEntropyLoss, nn.CrossEntropyLoss),
    "ce-prob": (DistributedCrossEntropyLoss, nn.CrossEntropyLoss),
    "nll": (DistributedNLLLoss, nn.NLLLoss),
}
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str
    shape: tuple  # global input
    grid: tuple
    ranks: tuple
    kwargs: tuple = ()  # plain options, as pairs
    dtype: torch.dtype = F64
    weight: tuple | None = None  # shape of a random global `weight` (class weights, BCE rescaling)
    pos_weight: tuple | None = None


def _c(name, kind, shape, grid_shape, ranks, dtype=F64, weight=None, pos_weight=None, **kw):
    return Case(name, kind, tuple(shape), tuple(grid_shape), tuple(ranks), tuple(kw.items()), dtype, weight,
                pos_weight)


def _data(c: Case, gen: torch.Generator):
    """Global input (float64, exactly representable in the case's dtype) and target."""
    def rnd(shape):
        return torch.randn(shape, generator=gen, dtype=F64)

    def rounded(t):
        return t.to(c.dtype).double()

    kw = dict(c.kwargs)
    x = rnd(c.shape)
    if c.kind in ("mse", "l1"):
        return rounded(x), rounded(rnd(c.shape))
    if c.kind == "bce":
        return rounded(torch.sigmoid(x)).clamp(1e-3, 1 - 1e-3), rounded(torch.rand(c.shape, generator=gen, dtype=F64))
    if c.kind == "bcelogits":
        return rounded(x), rounded(torch.rand(c.shape, generator=gen, dtype=F64))
    if c.kind == "kl":
        t = F.log_softmax(rnd(c.shape), 1)
        return rounded(F.log_softmax(x, 1)), rounded(t if kw.get("log_target") else t.exp())
    if c.kind == "ce-prob":
        return rounded(x), rounded(F.softmax(rnd(c.shape), 1))
    inp = rounded(F.log_softmax(x, 1) if c.kind == "nll" else x)
    t = torch.randint(0, c.shape[1], c.shape[:1] + c.shape[2:], generator=gen)
    ignore = kw.get("ignore_index", -100)
    t[torch.rand(t.shape, generator=gen) < 0.2] = ignore  # some voxels ignored (torch's default index too)
    return inp, t


def _weights(c: Case, gen: torch.Generator) -> dict:
    out = {}
    for name in ("weight", "pos_weight"):
        shape = getattr(c, name)
        if shape is not None:
            out[name] = (torch.rand(shape, generator=gen, dtype=F64) + 0.5).to(c.dtype).double()
    return out


def _close(what: str, got: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(ref).any() and not torch.isnan(got).any(), f"{what}: NaN"
    t = tol(dtype)
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), ref.double(), rtol=t["rtol"], atol=t["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")


def _same_everywhere(what: str, value: float | None) -> None:
    """The scalar is bitwise identical on every worker of P_x (None: outside P_x, or an unreduced call)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    values = {v for v in seen if v is not None}
    assert len(values) <= 1, f"{what}: the workers hold different losses {seen}"


def run_loss_case(c: Case) -> int:
    """Every reduction of one case on this rank; returns the number of comparisons made."""
    P_x = grid(c.ranks, c.grid)
    dist_cls, seq_cls = KINDS[c.kind]
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    x_g, t_g = _data(c, gen)
    weights = _weights(c, gen)
    reductions = ["none", "sum", "mean"] + (["batchmean"] if c.kind == "kl" else [])
    checks = 0
    for reduction in reductions:
        kwargs = dict(c.kwargs, reduction=reduction)
        seq = seq_cls(**weights, **kwargs)
        layer = dist_cls(P_x, **{k: v.to(c.dtype) for k, v in weights.items()}, **kwargs)
        xg = x_g.clone().requires_grad_(True)
        ref = seq(xg, t_g)
        seed = torch.randn(ref.shape, generator=gen, dtype=F64).to(c.dtype).double()
        ref.backward(seed)
        what = f"{c.name} reduction={reduction}"
        if not P_x.active:
            y = layer(zero_volume_tensor(dtype=c.dtype), zero_volume_tensor(dtype=t_g.dtype))
            assert y.numel() == 0, f"{what}: a worker outside P_x got {tuple(y.shape)}"
            _same_everywhere(what, None)
            continue
        sl = local_slices(c.shape, P_x.shape, P_x.index)
        t_sl = sl if t_g.dim() == len(c.shape) else sl[:1] + sl[2:]
        x = x_g[sl].to(c.dtype).requires_grad_(True)
        t = t_g[t_sl].to(c.dtype) if t_g.is_floating_point() else t_g[t_sl]
        y = layer(x, t)
        if reduction == "none":
            _same_everywhere(what, None)
            o_sl = sl if ref.dim() == len(c.shape) else sl[:1] + sl[2:]  # class losses drop the class axis
            _close(f"{what}: unreduced block", y, ref.detach()[o_sl], c.dtype)
            y.backward(seed[o_sl].to(c.dtype))
        else:
            assert y.dim() == 0 and y.dtype == c.dtype, (what, tuple(y.shape), y.dtype)
            _close(f"{what}: loss", y, ref.detach(), c.dtype)
            _same_everywhere(what, float(y))
            y.backward(seed.to(c.dtype))
        _close(f"{what}: input gradient", x.grad, xg.grad[sl], c.dtype)
        checks += 2
    return checks


def run_loss_cases(cases) -> int:
    n = 0
    for c in cases:
        try:
            n += run_loss_case(c)
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.dtype}] {exc}") from exc
    return n


GROUPS = {
    "w1": (1, [
        _c("mse-w1", "mse", (2, 3, 4), (1, 1, 1), (0,)),
        _c("ce-w1-weight-smoothing", "ce", (3, 4, 2), (1, 1, 1), (0,), weight=(4,), label_smoothing=0.2),
    ]),
    "w2": (2, [
        _c("l1-w2-uneven-perm", "l1", (5, 3), (2, 1), (1, 0)),
        _c("kl-w2-uneven-batch", "kl", (5, 4), (2, 1), (0, 1)),
        _c("kl-w2-log-target-space", "kl", (2, 3, 5), (1, 1, 2), (1, 0), log_target=True),
        _c("nll-w2-space-weight-ignore", "nll", (2, 3, 7), (1, 1, 2), (0, 1), weight=(3,), ignore_index=1),
    ]),
    "w3": (3, [
        _c("bce-w3-weight-broadcast-bf16", "bce", (2, 3, 5), (1, 1, 3), (2, 0, 1), BF16, weight=(3, 1)),
        _c("bcelogits-w3-pos-weight-f16", "bcelogits", (3, 2, 4), (3, 1, 1), (0, 1, 2), F16, pos_weight=(2, 1)),
    ]),
    "w4": (4, [
        _c("mse-w4-any-axes-uneven-perm", "mse", (3, 5, 2), (2, 2, 1), (3, 1, 2, 0)),
        _c("mse-w4-empty-blocks-bf16", "mse", (1, 2, 3), (1, 1, 4), (0, 1, 2, 3), BF16),
        _c("bce-w4-per-element-weight-split", "bce", (2, 3, 5), (1, 1, 4), (0, 1, 2, 3), weight=(5,)),
        _c("bcelogits-w4-weight-and-pos-weight", "bcelogits", (3, 2, 3, 2), (2, 1, 2, 1), (0, 1, 2, 3),
           weight=(3, 1), pos_weight=(2, 1, 1)),
        _c("ce-w4-2d-segmentation-weight-ignore-uneven", "ce", (3, 4, 5, 3), (2, 1, 2, 1), (2, 3, 0, 1),
           weight=(4,), ignore_index=2),
        _c("ce-w4-smoothing-weight-default-ignore", "ce", (2, 3, 5, 2), (1, 1, 2, 2), (0, 1, 2, 3), weight=(3,),
           label_smoothing=0.1),
        _c("ce-w4-empty-blocks-bf16", "ce", (1, 3, 3), (1, 1, 4), (3, 2, 1, 0), BF16),
        _c("ce-prob-w4-smoothing-weight", "ce-prob", (3, 3, 4), (2, 1, 2), (0, 1, 2, 3), weight=(3,),
           label_smoothing=0.3),
        _c("nll-w4-batch-only", "nll", (7, 3), (4, 1), (0, 1, 2, 3)),
        _c("nll-w4-weight-f16", "nll", (3, 4, 5), (2, 1, 2), (1, 3, 0, 2), F16, weight=(4,)),
        _c("kl-w4-batchmean-bf16", "kl", (5, 3, 2), (2, 1, 2), (0, 1, 2, 3), BF16),
        _c("l1-w4-f16-uneven", "l1", (3, 3, 5), (1, 2, 2), (0, 1, 2, 3), F16),
    ]),
    "w6": (6, [
        _c("ce-w6-inactive-perm", "ce", (2, 3, 4, 5), (1, 1, 2, 2), (5, 3, 1, 0), ignore_index=0),
        _c("l1-w6-2x3", "l1", (2, 4, 5), (1, 2, 3), tuple(range(6))),
    ]),
    "w8": (8, [
        _c("ce-w8-3d-batch-space", "ce", (2, 3, 3, 4, 2), (2, 1, 2, 2, 1), tuple(range(8)), weight=(3,)),
        _c("kl-w8-batchmean-inactive", "kl", (6, 2, 3), (3, 1, 2), (7, 5, 3, 1, 0, 2)),
    ]),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_losses_match_sequential(group):
    world, cases = GROUPS[group]
    counts = run_ranks(world, run_loss_cases, cases)
    assert counts[0] > 0 or world > 1
    assert sum(counts) >= 2 * len(cases)


# ------------------------------------------------------------------ uneven splits: the global divisor


def _uneven_means() -> dict:
    """Blocks of 3, 2 and 2 samples with very different losses: mean of local means != the global mean."""
    P_x = grid((0, 1, 2), (3, 1))
    gen = torch.Generator().manual_seed(3)
    x_g = torch.randn(7, 4, generator=gen, dtype=F64)
    t_g = x_g + torch.tensor([5.0] * 3 + [0.0] * 4, dtype=F64).view(7, 1)
    sl = local_slices(x_g.shape, P_x.shape, P_x.index)
    local_means = [F.mse_loss(x_g[s], t_g[s]) for s in (slice(0, 3), slice(3, 5), slice(5, 7))]
    out = {"naive_error": float(abs(sum(local_means) / 3 - F.mse_loss(x_g, t_g)))}
    t = tol(F64, terms=x_g.numel())  # a mean of 28 positive terms: relative to the loss itself
    torch.testing.assert_close(DistributedMSELoss(P_x)(x_g[sl], t_g[sl]), F.mse_loss(x_g, t_g), **t)
    legacy = DistributedMSELoss(P_x, size_average=False)  # torch's deprecated arguments map to reduction='sum'
    assert legacy.reduction == "sum"
    torch.testing.assert_close(legacy(x_g[sl], t_g[sl]), F.mse_loss(x_g, t_g, reduction="sum"), **t)
    # Class weights: torch divides by the global sum of the targets' weights.
    logits = torch.randn(7, 3, generator=gen, dtype=F64)
    labels = torch.tensor([0, 0, 0, 2, 1, 1, 2])
    w = torch.tensor([4.0, 0.5, 1.0], dtype=F64)
    got = DistributedCrossEntropyLoss(P_x, weight=w)(logits[sl], labels[sl[0]])
    torch.testing.assert_close(got, F.cross_entropy(logits, labels, weight=w), **t)
    return out


def test_uneven_split_means_use_the_global_divisor():
    for r in run_ranks(3, _uneven_means):
        assert r["naive_error"] > 1.0, r


# ------------------------------------------------------------------ weights move with load/collect_sequential


def _weights_round_trip() -> bool:
    P_x = grid(range(4), (2, 1, 2))
    gen = torch.Generator().manual_seed(9)
    w, pw = (torch.rand(2, 3, 1, generator=gen, dtype=F64) + 0.5).unbind(0)
    ones = torch.ones(3, 1, dtype=F64)
    layer = DistributedBCEWithLogitsLoss(P_x, weight=ones, pos_weight=ones.clone())
    seq = nn.BCEWithLogitsLoss(weight=w, pos_weight=pw)
    load_sequential(layer, seq if dist.get_rank() == 0 else None)
    torch.testing.assert_close(layer.weight, w, rtol=0, atol=0)  # every worker holds the whole tensor
    state = collect_sequential(layer)
    if dist.get_rank() == 0:
        assert sorted(state) == sorted(seq.state_dict())
        torch.testing.assert_close(state["pos_weight"], pw, rtol=0, atol=0)
    return True


def test_loss_weights_load_and_collect():
    assert all(run_ranks(4, _weights_round_trip))


# ------------------------------------------------------------------ bad input: the same error on every rank


def _loss_errors() -> dict:
    rank = dist.get_rank()
    P_x = grid(range(4), (1, 1, 2, 2))
    shape = (2, 3, 4, 4)

    def block(s=shape, dtype=F32):
        return torch.randn(local_shape(s, P_x.shape, P_x.index), dtype=dtype)

    def labels(high=3):
        t = torch.randint(0, 3, local_shape(shape[:1] + shape[2:], (1, 2, 2), P_x.index[:1] + P_x.index[2:]))
        if rank == 1 and high > 3:
            t[0, 0, 0] = high
        return t

    checks = {
        "class-split": lambda: DistributedCrossEntropyLoss(grid(range(4), (1, 2, 2, 1))),
        "bad-reduction": lambda: DistributedMSELoss(P_x, reduction="avg"),
        "smoothing": lambda: DistributedCrossEntropyLoss(P_x, label_smoothing=1.5),
        "target-shape": lambda: DistributedMSELoss(P_x)(block(), block((2, 3, 4, 5)) if rank == 2 else block()),
        "ce-target-shape": lambda: DistributedCrossEntropyLoss(P_x)(block(), labels()[:, :1]),
        "nll-float-target": lambda: DistributedNLLLoss(P_x)(block(), block()),
        "ce-weight-size": lambda: DistributedCrossEntropyLoss(P_x, weight=torch.ones(4))(block(), labels()),
        "bce-weight-broadcast": lambda: DistributedBCELoss(P_x, weight=torch.ones(3, 3))(block().sigmoid(),
                                                                                           block().sigmoid()),
        "mixed-dtypes": lambda: DistributedL1Loss(P_x)(block(dtype=F64 if rank == 0 else F32), block()),
        "ce-index-out-of-range-mean": lambda: DistributedCrossEntropyLoss(P_x)(block(), labels(high=7)),
        "bce-out-of-range-sum": lambda: DistributedBCELoss(P_x, reduction="sum")(block() * 3, block().sigmoid()),
        "ce-index-out-of-range-none": lambda: DistributedCrossEntropyLoss(P_x, reduction="none")(block(),
                                                                                                  labels(high=7)),
    }
    msgs = {}
    for name, call in checks.items():
        try:
            call()
        except (ShapeError, PartitionError, UnsupportedError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[name] = "no error"
    return msgs


LOSS_ERRORS = {
    "class-split": ("PartitionError", "class dimension (1) must not be split"),
    "bad-reduction": ("UnsupportedError", "reduction='avg'"),
    "smoothing": ("UnsupportedError", "label_smoothing"),
    "target-shape": ("ShapeError", "target block shape on world rank 2"),
    "ce-target-shape": ("ShapeError", "without the class dimension"),
    "nll-float-target": ("ShapeError", "target dtype"),
    "ce-weight-size": ("ShapeError", "one weight per class"),
    "bce-weight-broadcast": ("ShapeError", "does not broadcast"),
    "mixed-dtypes": ("ShapeError", "one input dtype"),
    "ce-index-out-of-range-mean": ("ShapeError", "refused"),
    "bce-out-of-range-sum": ("ShapeError", "refused"),
}


def test_bad_inputs_raise_on_every_rank():
    results = run_ranks(4, _loss_errors)
    for rank, msgs in enumerate(results):
        for name, (cls, fragment) in LOSS_ERRORS.items():
            assert msgs[name].startswith(cls) and fragment in msgs[name], (rank, name, msgs[name])
            assert f"[rank {rank}]" in msgs[name] and "Distributed" in msgs[name], (rank, name, msgs[name])
        # The bad value sits in rank 1's block: with a reduction everyone learns it, with 'none' rank 1 alone raises.
        assert ("this worker's block" if rank == 1 else "world ranks [1]") in msgs["ce-index-out-of-range-mean"]
        alone = msgs["ce-index-out-of-range-none"]
        assert ("out of bounds" in alone) == (rank == 1) and (alone == "no error") == (rank != 1), (rank, alone)


# ------------------------------------------------------------------ a U-Net block trains like the sequential one


def _train_block() -> list[float]:
    """conv -> batch norm -> ReLU -> 1x1 conv -> weighted cross-entropy, three SGD steps, against torch.nn."""
    from distfuse.layers.conv import DistributedConv2d
    from distfuse.layers.norm_batch import DistributedBatchNorm2d

    rank = dist.get_rank()
    P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, dtype=F64), nn.BatchNorm2d(3, dtype=F64), nn.ReLU(),
                        nn.Conv2d(3, 4, 1, dtype=F64))
    layers = [DistributedConv2d(P_x, 2, 3, 3, padding=1, dtype=F64), DistributedBatchNorm2d(P_x, 3, dtype=F64),
              nn.ReLU(), DistributedConv2d(P_x, 3, 4, 1, dtype=F64)]
    for mine, ref in zip(layers, seq, strict=True):
        if hasattr(mine, "param_layouts"):
            load_sequential(mine, ref if rank == 0 else None)
    w = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=F64)
    loss_seq, loss_dist = nn.CrossEntropyLoss(weight=w, ignore_index=3), DistributedCrossEntropyLoss(P_x, w, None, 3)
    opt_seq = torch.optim.SGD(seq.parameters(), lr=0.1)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    terms = 2 * 6 * 5
    starts = [{k: v.clone() for k, v in ref.state_dict().items()} for ref in seq]
    for step in range(3):
        x_g = torch.randn(2, 2, 6, 5, generator=gen, dtype=F64)
        t_g = torch.randint(0, 4, (2, 6, 5), generator=gen)
        sl = local_slices(x_g.shape, P_x.shape, P_x.index)
        ref = loss_seq(seq(x_g), t_g)
        y = x_g[sl]
        for m in layers:
            y = m(y)
        loss = loss_dist(y, t_g[sl[:1] + sl[2:]])
        # the batch norm and the loss sum over the batch and the plane (60 terms); step s has seen s updates
        torch.testing.assert_close(loss, ref.detach(), **tol(F64, terms=terms, steps=step + 1),
                                   msg=lambda m, s=step: f"step {s}: {m}")
        for o, lo in ((opt_seq, ref), (opt, loss)):
            o.zero_grad()
            lo.backward()
            o.step()
        losses.append(float(loss))
    for mine, ref, start in zip(layers, seq, starts, strict=True):
        if hasattr(mine, "param_layouts"):
            state = collect_sequential(mine)
            if rank == 0:  # each tensor on its layer's scales: the batch norm's bias starts at 0
                worst = compare_state(state, ref.state_dict(), F64, terms, steps=3, start=start)
                assert worst.ok, worst
    return losses


def test_unet_block_trains_like_sequential():
    losses = run_ranks(4, _train_block)
    assert all(r == losses[0] for r in losses), losses  # the same scalar on every worker
