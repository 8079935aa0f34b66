"""Whole-model helpers against the equivalent torch.nn model: state transfer, optimizers, global clipping.

The model is ``Sequential(DistributedLinearAllGather, DistributedLayerNorm, PReLU,
DistributedLinearReduceScatter)`` on 5 ranks: the layers sit on a partition listed out of
order, every split is uneven, rank 4 holds no parameter block, the LayerNorm's blocks
have two copies each (each holding the whole gradient of its block), and the PReLU
weight is a replicated plain parameter.  Each
rank's PReLU gradient is the part of the sum its own blocks contribute; the test sums it
over the ranks first, as a data-parallel all-reduce would, and then every replica holds
the whole gradient.  The
reference is ``torch.nn`` in float64 on the gathered tensors, including
``torch.nn.utils.clip_grad_norm_``'s norm.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfuse import ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers.linear_all_gather import DistributedLinearAllGather
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatter
from distfuse.layers.norm_group import DistributedLayerNorm
from distfuse.model import clip_grad_norm_, collect_sequential, load_sequential, make_optimizer
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import grid
from tests.tolerances import rounding_bound, tol

IN, HID, OUT, BATCH, SEQ = 5, 7, 4, 3, 2


def _model(dtype):
    """Column- then row-parallel MLP on P [2, 1, 2] over permuted ranks; rank 4 is outside.

    The LayerNorm's weight and bias are split over P's feature axis and copied along its
    batch axis (``split_dims``): two copies of each block, each with the whole gradient.
    """
    P = grid((3, 1, 0, 2), (2, 1, 2))
    model = nn.Sequential(DistributedLinearAllGather(P, IN, HID, dtype=dtype),
                          DistributedLayerNorm(P, HID, dtype=dtype), nn.PReLU(dtype=dtype),
                          DistributedLinearReduceScatter(P, HID, OUT, dtype=dtype))
    return model, P, P


def _sequential(dtype):
    torch.manual_seed(21)
    seq = nn.Sequential(nn.Linear(IN, HID), nn.LayerNorm(HID), nn.PReLU(), nn.Linear(HID, OUT)).to(torch.float64)
    with torch.no_grad():
        seq[1].weight.uniform_(0.5, 1.5)
        seq[1].bias.uniform_(-0.5, 0.5)
        seq[2].weight.fill_(-0.7)  # a slope far from zero: its gradient matters
        for p in seq.parameters():
            p.copy_(p.to(dtype).double())  # what the distributed model can hold
    return seq


def _grads_of(model, seq_keys):
    """The distributed gradients assembled on rank 0 under the sequential keys (plain ones as held).

    Every holder sends ``(global slices, gradient)``; rank 0 writes them into the global
    tensor and checks that copies of one block agree bit for bit.
    """
    from distfuse.interop.model_map import map_model

    mm = map_model(model)
    out = {}
    for e in mm.blocks:
        lay = e.layout
        piece = None
        if e.tensor is not None:
            where = lay.replica_slices() if lay.split_dims is not None else \
                local_slices(lay.global_shape, lay.P.shape, lay.P.index)
            piece = (where, e.tensor.grad.detach().double())
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, piece)
        full = torch.full(lay.global_shape, float("nan"), dtype=torch.float64)
        for where, g in (p for p in pieces if p is not None):
            if not torch.isnan(full[where]).all():
                assert torch.equal(full[where], g), f"copies of {e.key} disagree"
            full[where] = g
        out[e.key] = full
    for k, t in mm.plain.items():
        out[k] = t.grad
    return out


def _conditioning(norm: nn.LayerNorm, h: torch.Tensor, dz: torch.Tensor) -> float:
    """How much the LayerNorm magnifies a rounding of relative size u (as ``tests/test_norm_layers.py``):
    ``(h - mean) / sigma`` turns ``u |h|`` into ``u |h| / sigma``, and its input gradient's terms are
    ``gamma dz / sigma``; ``h`` is its input, ``dz`` the gradient of its output."""
    h = h.detach()
    sigma = float((h.var(-1, unbiased=False) + norm.eps).sqrt().min())
    gamma = float(norm.weight.detach().abs().max())
    return (max(float(h.abs().max()), sigma) / sigma) * max(gamma, 1.0) * max(float(dz.abs().max()), 1.0) / min(
        sigma, 1.0)


def _forward_backward(dtype):
    bad = []
    me = dist.get_rank()
    model, P_x, P_y = _model(dtype)
    seq = _sequential(dtype)
    load_sequential(model, seq if me == 0 else None)
    state = collect_sequential(model)
    if me == 0:
        for k, v in seq.state_dict().items():
            if state[k].dtype != dtype or not torch.equal(state[k].double(), v):
                bad.append(f"load/collect {k}")
    gen = torch.Generator().manual_seed(3)
    xg = torch.randn(BATCH, SEQ, IN, generator=gen, dtype=torch.float64).to(dtype).double()
    dyg = torch.randn(BATCH, SEQ, OUT, generator=gen, dtype=torch.float64).to(dtype).double()
    hg = seq[0](xg)  # the LayerNorm's input
    zg = seq[1](hg)
    zg.retain_grad()
    yg = seq[3](seq[2](zg))
    yg.backward(dyg)
    # the longest sum: the PReLU slope's gradient, over every hidden value
    t = tol(dtype, terms=BATCH * SEQ * HID, cond=_conditioning(seq[1], hg, zg.grad))
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].to(dtype) if P_x.active else zero_volume_tensor(dtype=dtype)
    y = model(x)
    if P_y.active:
        y.backward(dyg[local_slices(dyg.shape, P_y.shape, P_y.index)].to(dtype))
    elif y.requires_grad:
        y.backward(torch.zeros_like(y))
    y_full = collect_tensor(y.detach() if P_y.active else None, P_y)
    if me == 0 and not torch.allclose(y_full.double(), yg, **t):
        bad.append(f"forward: {float((y_full.double() - yg).abs().max())}")
    # The user's data-parallel sync of the replicated parameter: sum the partial gradients.
    slope = model[2].weight
    if slope.grad is None:  # a rank whose PReLU saw only an empty block
        slope.grad = torch.zeros_like(slope)
    dist.all_reduce(slope.grad)
    grads = _grads_of(model, seq.state_dict())
    if me == 0:
        for k, p in seq.named_parameters():
            if not torch.allclose(grads[k].double(), p.grad, **t):
                bad.append(f"gradient {k}: {float((grads[k].double() - p.grad).abs().max())}")
    return bad, model, seq


def _clip_case(dtype, norm_type, only_rank0_plain):
    bad, model, seq = _forward_backward(dtype)
    me = dist.get_rank()
    if only_rank0_plain and me != 0:
        model[2].weight.grad = None  # the replicated module ran on one rank only
    # Reference: torch's clip on the sequential model with the gradients the distributed model holds.
    ref_grads = _grads_of(model, seq.state_dict())
    if me == 0:
        for k, p in seq.named_parameters():
            p.grad = ref_grads[k].double().clone()
    ref_norm = nn.utils.clip_grad_norm_(seq.parameters(), max_norm=0.05, norm_type=norm_type) if me == 0 else None
    norm = clip_grad_norm_(model, max_norm=0.05, norm_type=norm_type)
    norms = [None] * dist.get_world_size()
    dist.all_gather_object(norms, float(norm))
    if len(set(norms)) != 1:
        bad.append(f"ranks got different norms {norms}")
    clipped = _grads_of(model, seq.state_dict())
    if me == 0:
        # float64 sums of the same |g|**p over every gradient element, in another order (all terms positive: the
        # bound is relative to the sum itself)
        elements = sum(p.numel() for p in seq.parameters())
        if not math.isclose(float(norm), float(ref_norm), rel_tol=rounding_bound(torch.float64, elements)):
            bad.append(f"norm {float(norm)} vs torch {float(ref_norm)}")
        for k, p in seq.named_parameters():
            if not torch.allclose(clipped[k].double(), p.grad, **tol(dtype)):
                bad.append(f"clipped {k}")
    return bad


def _clip_cases():
    out = {}
    for dtype, norm_type, only0 in ((torch.float64, 2.0, False), (torch.float64, float("inf"), True),
                                    (torch.bfloat16, 1.0, True)):
        out[f"{dtype}-{norm_type}-{'rank0' if only0 else 'synced'}"] = _clip_case(dtype, norm_type, only0)
    return out


def test_forward_gradients_and_global_clip_match_torch():
    for r, out in enumerate(run_ranks(5, _clip_cases)):
        failures = {k: v for k, v in out.items() if v}
        assert not failures, (r, failures)


def _optimizer_step():
    bad, model, seq = _forward_backward(torch.float64)
    me = dist.get_rank()
    opt = make_optimizer(torch.optim.SGD, model, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    owns = any(True for _ in model.parameters()) and me != 4
    opt.step()
    sched.step()
    opt.zero_grad()
    seq_opt = torch.optim.SGD(seq.parameters(), lr=0.1, momentum=0.9)
    seq_opt.step()
    state = collect_sequential(model)
    if me == 0:
        for k, v in seq.state_dict().items():
            if not torch.allclose(state[k], v, **tol(torch.float64)):
                bad.append(f"after a step: {k}")
    sd = opt.state_dict()
    return bad, owns, len(sd["param_groups"]), opt.param_groups[0]["lr"]


def test_optimizer_on_every_rank_including_one_without_parameters():
    for r, (bad, _, groups, lr) in enumerate(run_ranks(5, _optimizer_step)):
        assert not bad, (r, bad)
        assert groups == 1 and lr == pytest.approx(0.05), (r, groups, lr)


def test_make_optimizer_accepts_no_parameters_locally():
    opt = make_optimizer(torch.optim.Adam, [], lr=0.1)
    opt.step()
    opt.zero_grad()
    assert opt.state_dict()["param_groups"][0]["params"] == []
    with pytest.raises(ValueError):
        torch.optim.Adam([], lr=0.1)  # what make_optimizer spares the caller


def _errors():
    me = dist.get_rank()
    model, _, _ = _model(torch.float64)
    out = {}
    wrong = nn.Sequential(nn.Linear(IN, HID + 1), nn.LayerNorm(HID + 1), nn.PReLU(), nn.Linear(HID + 1, OUT)).double()
    try:
        load_sequential(model, wrong if me == 0 else None)
    except ShapeError as exc:
        out["shape"] = "expected shape" in str(exc)
    extra = dict(_sequential(torch.float64).state_dict(), unused=torch.zeros(1))
    try:
        load_sequential(model, extra if me == 0 else None)
    except ShapeError as exc:
        out["strict"] = "unused" in str(exc)
    load_sequential(model, extra if me == 0 else None, strict=False)
    out["not strict"] = True
    odd = model if me != 2 else nn.Sequential(*model, nn.Linear(1, 1).double())
    try:
        collect_sequential(odd)
    except ShapeError as exc:
        out["models differ"] = "different models" in str(exc)
    try:
        clip_grad_norm_(model, 1.0, norm_type=0)
    except UnsupportedError:
        out["norm type"] = True
    return out


def test_bad_input_raises_on_every_rank():
    for out in run_ranks(5, _errors):
        assert out == {"shape": True, "strict": True, "not strict": True, "models differ": True, "norm type": True}
