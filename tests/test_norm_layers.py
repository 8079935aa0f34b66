"""Distributed norms against torch.nn on the gathered tensor: forward, every gradient, running statistics, eval.

Method: every rank builds the sequential float64 ``torch.nn`` layer with fresh random
parameters and running statistics (rounded to the case's dtype), loads them into the
distributed layer with ``load_sequential``, and runs a few training steps followed by one
eval step on fresh random global tensors (offset from zero, so a wrong mean shows).
Each active worker checks the blocks it holds: its output and input-gradient blocks,
its copy of the weight and bias gradients, and its running statistics after every step.
Then ``collect_sequential`` must give back the sequential state dict, and the running
statistics must be bitwise equal on every worker that holds the same channel block.

Case ids read ``<layer>-w<world>-<what is special>``: ``uneven`` extents not divisible by
the grid, ``empty`` extents smaller than the grid (workers with empty blocks), ``perm``
partitions listing world ranks out of order, ``inactive`` worlds larger than P_x.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse import PartitionError, ShapeError, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.norm_batch import (
    DistributedBatchNorm,
    DistributedBatchNorm1d,
    DistributedBatchNorm2d,
    DistributedBatchNorm3d,
)
from distfuse.layers.norm_group import (
    DistributedGroupNorm,
    DistributedInstanceNorm1d,
    DistributedInstanceNorm2d,
    DistributedInstanceNorm3d,
    DistributedLayerNorm,
)
from distfuse.testing import run_ranks
from tests.test_conv_support import grid
from tests.tolerances import tol

KINDS = {
    "bn1d": (DistributedBatchNorm1d, nn.BatchNorm1d),
    "bn2d": (DistributedBatchNorm2d, nn.BatchNorm2d),
    "bn3d": (DistributedBatchNorm3d, nn.BatchNorm3d),
    "bn": (DistributedBatchNorm, nn.BatchNorm2d),  # DistDL's dimension-agnostic name
    "gn": (DistributedGroupNorm, nn.GroupNorm),
    "in1d": (DistributedInstanceNorm1d, nn.InstanceNorm1d),
    "in2d": (DistributedInstanceNorm2d, nn.InstanceNorm2d),
    "in3d": (DistributedInstanceNorm3d, nn.InstanceNorm3d),
    "ln": (DistributedLayerNorm, nn.LayerNorm),
}
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str
    shape: tuple  # global input
    grid: tuple  # P_x shape
    ranks: tuple  # P_x's world ranks, row-major
    args: tuple  # the torch.nn layer's positional arguments
    kwargs: tuple = ()  # its keyword arguments, as pairs
    dtype: torch.dtype = torch.float64
    param_dtype: torch.dtype | None = None  # default: dtype
    train_steps: int = 2
    offset: float = 3.0
    x_grad: str = "all"  # "first": only P_x's first worker's input requires grad

    @property
    def pdtype(self):
        return self.param_dtype or self.dtype


def _c(name, kind, shape, grid_shape, ranks, args, dtype=torch.float64, **kw):
    opts = {k: kw.pop(k) for k in ("param_dtype", "train_steps", "offset", "x_grad") if k in kw}
    return Case(name, kind, tuple(shape), tuple(grid_shape), tuple(ranks), tuple(args), tuple(kw.items()), dtype,
                **opts)


def _fill_reference(seq: nn.Module, c: Case, gen: torch.Generator) -> None:
    """Random parameters and running statistics (never the ones/zeros defaults), exactly representable in dtype."""
    with torch.no_grad():
        for name, t in list(seq.named_parameters()) + list(seq.named_buffers()):
            if name == "num_batches_tracked":
                t.fill_(3)
                continue
            v = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            if name == "running_var":
                v = v.abs() + 0.5
            t.copy_(v.to(c.pdtype).double())


def _close(what: str, got: torch.Tensor, ref: torch.Tensor, dtype, terms: int, steps: int = 1,
           cond: float = 1.0) -> None:
    """The rounding bound of sums of ``terms`` terms over ``steps`` steps, on the scale of the unit-variance data
    (or the reference's, if larger), with the normalisation's conditioning (:func:`_conditioning`) on the part
    that comes from sums."""
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN"
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), ref.double(),
                               **tol(dtype, terms=terms, scale=scale, steps=steps, cond=cond),
                               msg=lambda m: f"{what}: {m}")


def _terms(c: Case, seq) -> int:
    """The longest sums of a case: a channel's statistics and its weight and bias gradients (batch norm: every
    value of the channel; instance norm: its values over the batch), a group's statistics (group norm:
    ``C / groups`` channels' values, its weight gradient every value of one channel), a row of a layer norm
    (its weight gradient: every row)."""
    numel = math.prod(c.shape)
    if c.kind == "ln":
        row = math.prod(seq.normalized_shape)
        return max(row, numel // row)
    per_channel = numel // c.shape[1]
    if c.kind == "gn":
        return max(per_channel, numel // (c.shape[0] * seq.num_groups))
    return per_channel


def _conditioning(c: Case, seq, x: torch.Tensor, dy: torch.Tensor) -> float:
    """How much the normalisation magnifies a rounding of relative size u: ``x_hat = (x - mean) / sigma`` turns
    ``u |x|`` into ``u |x| / sigma``, and the input gradient's terms are ``gamma dy / sigma``.  A group of two
    values close together (``gn-w1-nospatial``) has a tiny sigma: its input gradient is zero in exact
    arithmetic and rounding noise of size ``u |x| |gamma dy| / sigma**2`` in both results."""
    x = x.detach()
    if c.kind.startswith("bn"):
        var = x.transpose(0, 1).reshape(x.shape[1], -1).var(1, unbiased=False)
    elif c.kind.startswith("in"):
        var = x.reshape(x.shape[0] * x.shape[1], -1).var(1, unbiased=False)
    elif c.kind == "gn":
        var = x.reshape(x.shape[0], seq.num_groups, -1).var(2, unbiased=False)
    else:
        var = x.reshape(-1, math.prod(seq.normalized_shape)).var(1, unbiased=False)
    if getattr(seq, "running_var", None) is not None:
        var = torch.cat([var.flatten(), seq.running_var.flatten()])
    sigma = float((var + seq.eps).sqrt().min())
    weight = getattr(seq, "weight", None)
    gamma = float(weight.detach().abs().max()) if weight is not None else 1.0
    return (max(float(x.abs().max()), sigma) / sigma) * max(gamma, 1.0) * max(float(dy.abs().max()), 1.0) / min(
        sigma, 1.0)


def _replica_block(layer, name: str, full: torch.Tensor) -> torch.Tensor:
    lay = next(lay for lay in layer.param_layouts() if lay.name == name)
    return full[lay.replica_slices()]


def _step(c: Case, layer, seq, P_x, gen, step: str, terms: int, steps: int, buffer_steps: int) -> None:
    """One forward and backward against the sequential layer: outputs and gradients within ``steps`` steps of
    rounding, the running statistics within ``buffer_steps``."""
    x_g = (torch.randn(c.shape, generator=gen, dtype=torch.float64) * 2 + c.offset).to(c.dtype).double()
    x_g.requires_grad_(True)
    y_g = seq(x_g)
    dy_g = torch.randn(y_g.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    y_g.backward(dy_g)
    cond = _conditioning(c, seq, x_g, dy_g)
    if not P_x.active:
        y = layer(zero_volume_tensor(dtype=c.dtype))
        assert y.numel() == 0
        return
    sl = local_slices(c.shape, P_x.shape, P_x.index)
    x = x_g.detach()[sl].to(c.dtype)
    mine = c.x_grad == "all" or P_x.rank == 0
    x.requires_grad_(mine)
    y = layer(x)
    assert y.dtype == c.dtype and tuple(y.shape) == tuple(x.shape), (y.dtype, tuple(y.shape))
    _close(f"{step}: output", y, y_g.detach()[sl], c.dtype, terms, steps, cond)
    if y.requires_grad:
        y.backward(dy_g[sl].to(c.dtype))
    if mine:
        _close(f"{step}: input gradient", x.grad, x_g.grad[sl], c.dtype, terms, steps, cond)
    for name, p in layer.named_parameters():
        _close(f"{step}: {name} gradient", p.grad, _replica_block(layer, name, getattr(seq, name).grad), c.pdtype,
               terms, steps, cond)
    for name in BUFFERS:
        mine_buf = getattr(layer, name, None)
        if mine_buf is not None:
            ref = _replica_block(layer, name, getattr(seq, name))
            if name == "num_batches_tracked":
                assert int(mine_buf) == int(ref), (step, name, int(mine_buf), int(ref))
            else:
                _close(f"{step}: {name}", mine_buf, ref, c.pdtype, terms, buffer_steps, cond)
    layer.zero_grad(set_to_none=True)
    seq.zero_grad(set_to_none=True)


def run_norm_case(c: Case) -> bool:
    rank = dist.get_rank()
    P_x = grid(c.ranks, c.grid)
    dist_cls, seq_cls = KINDS[c.kind]
    kwargs = dict(c.kwargs)
    layer = dist_cls(P_x, *c.args, dtype=c.pdtype, **kwargs)
    seq = seq_cls(*c.args, dtype=torch.float64, **kwargs)
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    _fill_reference(seq, c, gen)
    load_sequential(layer, seq if rank == 0 else None)
    terms = _terms(c, seq)
    for s in range(c.train_steps):  # the running statistics of step s have been updated s + 1 times
        _step(c, layer, seq, P_x, gen, f"{c.name} train step {s}", terms, 1, s + 1)
    layer.eval()
    seq.eval()
    # in eval, the outputs and gradients are computed from the running statistics of every training step
    tracked = c.train_steps if getattr(seq, "running_mean", None) is not None else 1
    _step(c, layer, seq, P_x, gen, f"{c.name} eval step", terms, tracked, c.train_steps)
    state = collect_sequential(layer)
    if rank == 0:
        want = seq.state_dict()
        assert sorted(state) == sorted(want), (sorted(state), sorted(want))
        for k, v in want.items():
            _close(f"{c.name}: collected {k}", state[k], v, c.pdtype, terms, c.train_steps)
    # Running statistics are bitwise equal on every worker that holds the same block.
    mine = None
    if P_x.active and getattr(layer, "running_mean", None) is not None:
        stats = tuple(tuple(getattr(layer, n).tolist()) for n in BUFFERS[:2])
        mine = (P_x.index[1], stats, int(layer.num_batches_tracked))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    by_block: dict = {}
    for rec in (r for r in seen if r is not None):
        by_block.setdefault(rec[0], set()).add(rec[1:])
    assert all(len(v) == 1 for v in by_block.values()), f"{c.name}: running statistics differ between workers"
    return True


def run_norm_cases(cases) -> bool:
    for c in cases:
        try:
            run_norm_case(c)
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.dtype}] {exc}") from exc
    return True


F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
# One world size per group: each group is one call on a reused rank pool.
GROUPS = {
    "w1": (1, [
        _c("bn2d-w1", "bn2d", (3, 2, 3, 4), (1, 1, 1, 1), (0,), (2,)),
        _c("ln-w1-bf16", "ln", (3, 5), (1, 1), (0,), ((5,),), BF16),
        _c("gn-w1-nospatial", "gn", (4, 6), (1, 1), (0,), (3, 6)),
    ]),
    "w2": (2, [
        _c("bn1d-2d-input-w2-uneven-momentum-none", "bn1d", (5, 3), (2, 1), (1, 0), (3,), momentum=None,
           train_steps=3),
        _c("bn1d-w2-channel-split-affine-false", "bn1d", (3, 3, 4), (1, 2, 1), (0, 1), (3,), affine=False),
        _c("in1d-w2-space-uneven-track", "in1d", (2, 3, 7), (1, 1, 2), (1, 0), (3,), affine=True,
           track_running_stats=True),
        _c("ln-w2-feature-split-uneven", "ln", (3, 4, 7), (1, 1, 2), (0, 1), ((7,),)),
        _c("bn-w2-distdl-name-4d", "bn", (2, 2, 3, 3), (1, 1, 1, 2), (1, 0), (2,)),
    ]),
    "w3": (3, [
        _c("bn3d-w3-uneven-no-bias-f16", "bn3d", (2, 2, 5, 2, 3), (1, 1, 3, 1, 1), (2, 0, 1), (2,), F16, bias=False),
        _c("gn-w3-space-uneven-bf16", "gn", (2, 4, 7), (1, 1, 3), (0, 1, 2), (2, 4), BF16),
        _c("in3d-w3-batch-space", "in3d", (3, 2, 2, 4, 3), (3, 1, 1, 1, 1), (0, 1, 2), (2,), affine=True),
        _c("in2d-w3-space-f16-track", "in2d", (2, 2, 5, 3), (1, 1, 3, 1), (1, 2, 0), (2,), F16, affine=True,
           track_running_stats=True),
    ]),
    "w4": (4, [
        _c("bn2d-w4-batch-space-uneven-perm", "bn2d", (3, 3, 5, 4), (2, 1, 2, 1), (3, 1, 2, 0), (3,)),
        _c("bn2d-w4-channel-space-split", "bn2d", (2, 5, 3, 3), (1, 2, 2, 1), (0, 1, 2, 3), (5,), momentum=0.3),
        _c("bn1d-w4-empty-blocks-bf16", "bn1d", (2, 3, 3), (1, 1, 4), (0, 1, 2, 3), (3,), BF16),
        _c("bn2d-w4-mixed-bf16-input-fp32-params", "bn2d", (2, 2, 3, 5), (1, 1, 2, 2), (0, 1, 2, 3), (2,), BF16,
           param_dtype=F32),
        _c("bn2d-w4-no-running-stats", "bn2d", (3, 2, 3, 3), (2, 1, 1, 2), (0, 1, 2, 3), (2,),
           track_running_stats=False),
        _c("gn-w4-2x2-space-empty", "gn", (2, 6, 3, 1), (1, 1, 2, 2), (2, 3, 0, 1), (3, 6)),
        _c("gn-w4-batch-space-no-bias-f16", "gn", (3, 4, 5), (2, 1, 2), (0, 1, 2, 3), (2, 4), F16, bias=False),
        _c("in2d-w4-channel-space-track-momentum-none", "in2d", (2, 3, 4, 3), (1, 2, 2, 1), (0, 1, 2, 3), (3,),
           affine=True, track_running_stats=True, momentum=None),
        _c("in2d-w4-batch-space-bf16", "in2d", (3, 2, 5, 2), (2, 1, 2, 1), (1, 0, 3, 2), (2,), BF16),
        _c("ln-w4-rows-and-features-uneven-perm", "ln", (5, 7), (2, 2), (2, 0, 3, 1), ((7,),)),
        _c("ln-w4-two-normalised-dims-split", "ln", (2, 3, 5), (1, 2, 2), (0, 1, 2, 3), ((3, 5),), bias=False),
        _c("ln-w4-features-empty-no-affine-f16", "ln", (3, 3), (1, 4), (0, 1, 2, 3), ((3,),), F16,
           elementwise_affine=False),
        _c("bn2d-w4-grad-on-first-worker-only", "bn2d", (2, 2, 4, 3), (1, 1, 2, 2), (0, 1, 2, 3), (2,),
           affine=False, x_grad="first"),
        _c("ln-w4-input-grad-on-first-worker-only", "ln", (3, 6), (2, 2), (0, 1, 2, 3), ((6,),), x_grad="first"),
        _c("ln-w4-mixed-bf16-input-fp32-params", "ln", (4, 5), (2, 2), (0, 1, 2, 3), ((5,),), BF16, param_dtype=F32),
    ]),
    "w6": (6, [
        _c("bn2d-w6-inactive-perm", "bn2d", (2, 3, 5, 3), (1, 1, 2, 2), (5, 2, 0, 3), (3,)),
        _c("gn-w6-2x3-space", "gn", (1, 4, 5, 7), (1, 1, 2, 3), tuple(range(6)), (2, 4)),
        _c("ln-w6-inactive", "ln", (4, 2, 5), (1, 1, 5), (1, 2, 3, 4, 5), ((2, 5),)),
    ]),
    "w8": (8, [
        _c("bn3d-w8-batch-space", "bn3d", (3, 2, 3, 4, 5), (2, 1, 1, 2, 2), tuple(range(8)), (2,)),
        _c("in1d-w8-space-inactive-empty", "in1d", (2, 2, 5), (1, 1, 7), (7, 6, 5, 4, 3, 2, 1), (2,), affine=True),
    ]),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_norms_match_sequential(group):
    world, cases = GROUPS[group]
    assert all(run_ranks(world, run_norm_cases, cases))


# ------------------------------------------------------------------ uneven splits: a mean of local means is wrong


def _uneven_statistics() -> dict:
    """Blocks of 3, 2 and 2 rows with very different means: the exact statistics differ from averaged local ones."""
    out = {}
    P_x = grid((0, 1, 2), (3, 1))
    gen = torch.Generator().manual_seed(11)
    offsets = torch.tensor([30.0] * 3 + [0.0] * 2 + [-5.0] * 2, dtype=torch.float64).view(7, 1)
    x_g = torch.randn(7, 2, generator=gen, dtype=torch.float64) + offsets
    sl = local_slices(x_g.shape, P_x.shape, P_x.index)
    naive = torch.stack([x_g[local_slices(x_g.shape, P_x.shape, (i, 0))].mean(0) for i in range(3)]).mean(0)
    out["naive_error"] = float((naive - x_g.mean(0)).abs().max())
    bn = DistributedBatchNorm1d(P_x, 2, momentum=1.0, dtype=torch.float64)
    y = bn(x_g[sl])
    ref = nn.BatchNorm1d(2, momentum=1.0, dtype=torch.float64)
    # sums of 7 rows whose offsets (up to 30) are large next to their spread: the mean's terms are of size
    # max|x|, the variance's of size max|x|**2, and (x - mean) / sigma magnifies the rounding by max|x| / sigma
    big = float(x_g.abs().max())
    cond = big / float(x_g.std(0, unbiased=False).min())
    torch.testing.assert_close(y, ref(x_g)[sl], **tol(torch.float64, terms=7, cond=cond))
    torch.testing.assert_close(bn.running_mean, x_g.mean(0), **tol(torch.float64, terms=7, scale=big))
    torch.testing.assert_close(bn.running_var, x_g.var(0), **tol(torch.float64, terms=7, scale=big**2))  # unbiased
    # Layer norm over 7 features split 3 / 2 / 2, the same offsets along the features.
    P_f = grid((0, 1, 2), (1, 3))
    f_g = torch.randn(2, 7, generator=gen, dtype=torch.float64) + offsets.view(1, 7)
    ln = DistributedLayerNorm(P_f, 7, elementwise_affine=False, dtype=torch.float64)
    fl = local_slices(f_g.shape, P_f.shape, P_f.index)
    cond = float(f_g.abs().max() / f_g.std(1, unbiased=False).min())
    torch.testing.assert_close(ln(f_g[fl]), F.layer_norm(f_g, (7,))[fl], **tol(torch.float64, terms=7, cond=cond))
    return out


def test_uneven_split_statistics_are_exact():
    for r in run_ranks(3, _uneven_statistics):
        assert r["naive_error"] > 1.0, r  # the data would catch a mean of local means


# ------------------------------------------------------------------ bad input: the same error on every rank


def _norm_errors() -> dict:
    rank = dist.get_rank()
    P_x = grid(range(4), (1, 1, 2, 2))
    bn = DistributedBatchNorm2d(P_x, 3)
    gn = DistributedGroupNorm(P_x, 2, 4)
    P_in = grid(range(4), (1, 1, 4))
    inorm = DistributedInstanceNorm1d(P_in, 2)
    P_ln = grid(range(4), (2, 2))
    ln = DistributedLayerNorm(P_ln, 6)
    P_3 = grid((0, 1, 2), (1, 1, 3, 1))
    bn3 = DistributedBatchNorm2d(P_3, 2)

    def block(shape, dtype=torch.float32):
        return torch.randn(local_shape(shape, P_x.shape, P_x.index), dtype=dtype)

    checks = {
        "channels": lambda: bn(block((2, 4, 4, 4))),
        "unbalanced": lambda: bn(torch.randn(1, 3, 3 if rank == 0 else 2, 2)),
        "ndim": lambda: bn(torch.randn(1, 3, 2, 2, 1) if rank == 1 else block((1, 3, 4, 4))),
        "param-dtype": lambda: bn(block((2, 3, 4, 4), torch.float64)),
        "mixed-dtypes": lambda: bn(block((2, 3, 4, 4), torch.float64 if rank == 2 else torch.float32)),
        "one-value": lambda: bn(block((1, 3, 1, 1))),
        "gn-channels": lambda: gn(block((2, 6, 4, 4))),
        "gn-channel-split": lambda: DistributedGroupNorm(grid(range(4), (1, 2, 2, 1)), 2, 4),
        "gn-groups": lambda: DistributedGroupNorm(P_x, 3, 4),
        "in-one-spatial": lambda: inorm(torch.randn(local_shape((2, 2, 1), P_in.shape, P_in.index))),
        "ln-shape": lambda: ln(torch.randn(local_shape((3, 5), P_ln.shape, P_ln.index))),
        "bn-partition-dims": lambda: DistributedBatchNorm2d(P_in, 2),
        "inactive-with-data": lambda: bn3(torch.randn(1, 2, 1, 3)),  # the blocks of a [1, 2, 3, 3] input
    }
    msgs = {}
    for name, call in checks.items():
        try:
            call()
        except (ShapeError, PartitionError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[name] = "no error"
    return msgs


NORM_ERRORS = {
    "channels": ("ShapeError", "input channels"),
    "unbalanced": ("ShapeError", "balanced decomposition"),
    "ndim": ("ShapeError", "number of input dimensions"),
    "param-dtype": ("ShapeError", "parameters' dtype"),
    "mixed-dtypes": ("ShapeError", "one input dtype"),
    "one-value": ("ShapeError", "more than 1 value per channel"),
    "gn-channels": ("ShapeError", "num_channels"),
    "gn-channel-split": ("PartitionError", "must not split the channels"),
    "gn-groups": ("ShapeError", "divisible by num_groups"),
    "in-one-spatial": ("ShapeError", "more than 1 spatial element"),
    "ln-shape": ("ShapeError", "normalized_shape"),
    "bn-partition-dims": ("PartitionError", "dimensions of P_x"),
}


def test_bad_inputs_raise_on_every_rank():
    results = run_ranks(4, _norm_errors)
    for rank, msgs in enumerate(results):
        for name, (cls, fragment) in NORM_ERRORS.items():
            assert msgs[name].startswith(cls) and fragment in msgs[name], (rank, name, msgs[name])
            assert f"[rank {rank}]" in msgs[name] and "Distributed" in msgs[name], (rank, name, msgs[name])
        # Rank 3 is outside bn3's P_x: it alone refuses its data; the three workers of P_x are not kept waiting.
        want = "zero-volume" if rank == 3 else "no error"
        assert want in msgs["inactive-with-data"], (rank, msgs["inactive-with-data"])


# ------------------------------------------------------------------ outputs may be modified in place


def _in_place_after_norm() -> bool:
    """``ReLU(inplace=True)`` after a norm without affine (its output is the normalised tensor itself)."""
    P_x = grid((0, 1), (1, 1, 2))
    gen = torch.Generator().manual_seed(4)
    x_g = torch.randn(2, 4, 7, generator=gen, dtype=torch.float64)
    sl = local_slices(x_g.shape, P_x.shape, P_x.index)
    # Groups of 7 (instance and layer norm) and 14 values (group norm, whose sigma is at least its 7-groups'
    # smallest); the output's rounding grows by max|x| / sigma, the gradient's terms are dy / sigma with dy = x.
    sigma, big = float(x_g.std(-1, unbiased=False).min()), float(x_g.abs().max())
    t = tol(torch.float64, terms=14, cond=big / sigma * max(big, 1.0) / min(sigma, 1.0))
    layers = [(DistributedInstanceNorm1d(P_x, 4, dtype=torch.float64), nn.InstanceNorm1d(4, dtype=torch.float64)),
              (DistributedGroupNorm(P_x, 2, 4, affine=False, dtype=torch.float64),
               nn.GroupNorm(2, 4, affine=False, dtype=torch.float64)),
              (DistributedLayerNorm(P_x, 7, elementwise_affine=False, dtype=torch.float64),
               nn.LayerNorm(7, elementwise_affine=False, dtype=torch.float64))]
    for layer, seq in layers:
        xg = x_g.clone().requires_grad_(True)
        yg = torch.relu_(seq(xg))
        (yg * x_g).sum().backward()
        x = x_g[sl].clone().requires_grad_(True)
        y = torch.relu_(layer(x))
        (y * x_g[sl]).sum().backward()
        torch.testing.assert_close(y, yg.detach()[sl], **t)
        torch.testing.assert_close(x.grad, xg.grad[sl], **t)
    return True


def test_outputs_can_be_modified_in_place():
    assert all(run_ranks(2, _in_place_after_norm))
