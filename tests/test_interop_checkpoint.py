"""DCP checkpoints of distfuse models: save on one layout, load on another grid, world size or a plain model.

The model mixes a channel-distributed convolution, a distributed batch norm (weight,
bias and running statistics split over channels and copied over the batch axis), a
plain module with a replicated parameter (PReLU) and a distributed linear layer.  The reference is the equivalent
``torch.nn.Sequential`` with the same parameters, gradients and Adam optimizer, run in
float64 on every rank; distributed and sequential Adam do the same elementwise
arithmetic, so they agree to the float64 tolerance, and a checkpoint round trip only
moves elements, so it is checked bit for bit.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from distfuse import ShapeError
from distfuse.geometry.decomposition import local_slices
from distfuse.interop.checkpoint import load_checkpoint, save_checkpoint
from distfuse.interop.model_map import map_model
from distfuse.layers.conv import DistributedConv2d
from distfuse.layers.linear import DistributedLinear
from distfuse.layers.norm_batch import DistributedBatchNorm2d
from distfuse.model import collect_sequential, load_sequential, make_optimizer
from distfuse.testing import run_ranks
from tests.test_conv_support import grid
from tests.tolerances import tol

DT = torch.float64
# Layouts: (conv P_x, P_y, P_w), (linear P_x, P_y, P_w), batch norm P_x; each (world ranks, grid shape).
# The batch norm's weight, bias and statistics are split over channels and copied over the batch axis.
LAYOUT_A = (((0, 1), (1, 2, 1, 1)), ((2, 3), (1, 2, 1, 1)), ((0, 1, 2, 3), (2, 2, 1, 1)),
            ((0, 1), (1, 2)), ((2, 3), (1, 2)), ((0, 1, 2, 3), (2, 2)), ((0, 1, 2, 3), (2, 2, 1, 1)))
# Another grid on the same world, ranks out of order, rank 0 owning no conv block.
LAYOUT_B = (((3,), (1, 1, 1, 1)), ((3, 1, 2), (1, 3, 1, 1)), ((3, 1, 2), (3, 1, 1, 1)),
            ((2, 0, 1), (1, 3)), ((1,), (1, 1)), ((2, 0, 1), (1, 3)), ((3, 1, 2), (1, 3, 1, 1)))
# A world of 2.
LAYOUT_C = (((1, 0), (1, 2, 1, 1)), ((0,), (1, 1, 1, 1)), ((1, 0), (1, 2, 1, 1)),
            ((0,), (1, 1)), ((0, 1), (1, 2)), ((0, 1), (2, 1)), ((1, 0), (2, 1, 1, 1)))


def _model(layout, out_channels=6):
    cx, cy, cw, lx, ly, lw, bn = (grid(*spec) for spec in layout)
    conv = DistributedConv2d(cx, 4, out_channels, 3, padding=1, P_y=cy, P_w=cw, dtype=DT)
    lin = DistributedLinear(lx, ly, lw, 5, 7, dtype=DT)
    return nn.Sequential(conv, DistributedBatchNorm2d(bn, 6, dtype=DT), nn.PReLU(dtype=DT), lin)


def _sequential(seed):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.PReLU(), nn.Linear(5, 7)).to(DT)
    with torch.no_grad():
        seq[1].weight.uniform_(0.5, 1.5)
        seq[1].bias.uniform_(-1, 1)
        seq[1].running_mean.uniform_(-1, 1)
        seq[1].running_var.uniform_(0.5, 2)
        seq[1].num_batches_tracked.fill_(3)
        seq[2].weight.fill_(0.3)
    return seq


def _grads(seq, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=gen, dtype=DT) for k, p in seq.named_parameters()}


def _slices(lay):
    """This holder's slices of the global tensor (balanced block, or the block a copy holds)."""
    return lay.replica_slices() if lay.split_dims is not None else \
        local_slices(lay.global_shape, lay.P.shape, lay.P.index)


def _set_grads(model, seq, grads):
    """The same global gradients on the sequential model and, as blocks, on the distributed one."""
    for k, p in seq.named_parameters():
        p.grad = grads[k].clone()
    mm = map_model(model)
    for e in mm.blocks:
        if e.tensor is not None and e.key in grads:
            e.tensor.grad = grads[e.key][_slices(e.layout)].clone()
    for k, t in mm.plain.items():
        if k in grads:
            t.grad = grads[k].clone()


def _collect_optimizer(model, opt, name):
    """The optimizer state ``name`` of every parameter, assembled on rank 0 (copies must agree bit for bit)."""
    mm = map_model(model)
    out = {}
    for e in mm.blocks:
        if e.layout.name not in e.module._parameters:
            continue  # a buffer: no optimizer state (decided alike on every rank)
        piece = (_slices(e.layout), opt.state[e.tensor][name]) if e.tensor is not None else None
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, piece)
        pieces = [p for p in pieces if p is not None]
        if not pieces:
            continue
        full = torch.full(e.layout.global_shape, float("nan"), dtype=pieces[0][1].dtype)
        for where, block in pieces:
            if not torch.isnan(full[where]).all() and not torch.equal(full[where], block):
                raise AssertionError(f"copies of {e.key}'s {name} disagree")
            full[where] = block
        out[e.key] = full
    for k, t in mm.plain.items():
        if isinstance(t, nn.Parameter):
            out[k] = opt.state[t][name]
    return out


def _close(what, got, want, bad, exact=False):
    ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(), **tol(DT))
    if not ok:
        bad.append(f"{what}: max diff {float((got.double() - want.double()).abs().max())}")


def _save_then_reshard(path):
    bad = []
    me = dist.get_rank()
    seq = _sequential(5)
    seq_opt = torch.optim.Adam(seq.parameters(), lr=0.01)
    A = _model(LAYOUT_A)
    load_sequential(A, seq if me == 0 else None)
    opt_a = make_optimizer(torch.optim.Adam, A.parameters(), lr=0.01)
    _set_grads(A, seq, _grads(seq, 1))
    opt_a.step()
    seq_opt.step()
    state_a = collect_sequential(A)
    avg_a = _collect_optimizer(A, opt_a, "exp_avg_sq")
    save_checkpoint(path, A, opt_a, extra={"step": 1})

    B = _model(LAYOUT_B)
    opt_b = make_optimizer(torch.optim.Adam, B.parameters(), lr=0.5)  # lr comes back from the checkpoint
    extra = load_checkpoint(path, B, opt_b)
    if extra != {"step": 1}:
        bad.append(f"extra {extra}")
    state_b = collect_sequential(B)
    avg_b = _collect_optimizer(B, opt_b, "exp_avg_sq")
    if me == 0:
        for k, want in seq.state_dict().items():
            _close(f"A after a step: {k}", state_a[k], want, bad)
            _close(f"resharded {k}", state_b[k], state_a[k], bad, exact=True)
            if k in avg_b:
                _close(f"resharded exp_avg_sq {k}", avg_b[k], avg_a[k], bad, exact=True)
                _close(f"exp_avg_sq {k} vs torch", avg_b[k], seq_opt.state[seq.get_parameter(k)]["exp_avg_sq"], bad)
    # The resumed optimizer keeps stepping like torch's (step count, moments, lr restored).
    _set_grads(B, seq, _grads(seq, 2))
    opt_b.step()
    seq_opt.step()
    state_b2 = collect_sequential(B)
    if me == 0:
        for k, want in seq.state_dict().items():
            _close(f"second step after resume: {k}", state_b2[k], want, bad)
    # A plain torch.nn model reads the same checkpoint without distfuse, and writes one back.
    if me == 0:
        plain = _sequential(99)
        sd = {"model": plain.state_dict()}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        plain.load_state_dict(sd["model"])
        for k, want in state_a.items():
            _close(f"plain load {k}", plain.state_dict()[k], want, bad, exact=True)
        with torch.no_grad():
            for p in plain.parameters():
                p.mul_(-2.0)
        dcp.save({"model": plain.state_dict()}, checkpoint_id=path + "-plain", no_dist=True)
        plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    dist.barrier()
    load_checkpoint(path + "-plain", B)
    state_b3 = collect_sequential(B)
    if me == 0:
        for k, want in plain_state.items():
            _close(f"distributed load of a plain checkpoint {k}", state_b3[k], want, bad, exact=True)
    return bad, state_a


def _load_on_two_ranks(path, state_a):
    bad = []
    C = _model(LAYOUT_C)
    opt_c = make_optimizer(torch.optim.Adam, C.parameters(), lr=0.5)
    load_checkpoint(path, C, opt_c)
    state_c = collect_sequential(C)
    if dist.get_rank() == 0:
        for k, want in state_a.items():
            _close(f"world 2: {k}", state_c[k], want, bad, exact=True)
    if opt_c.param_groups[0]["lr"] != 0.01:
        bad.append(f"lr {opt_c.param_groups[0]['lr']}")
    return bad


def _errors(path):
    out = {}
    wrong = _model(LAYOUT_A, out_channels=5)
    try:
        load_checkpoint(path, wrong)
    except ShapeError as exc:
        out["shape"] = "shapes differ" in str(exc)
    A = _model(LAYOUT_A)
    try:
        load_checkpoint(path + "-plain", A, make_optimizer(torch.optim.SGD, A.parameters(), lr=0.1))
    except ShapeError as exc:
        out["no optimizer"] = "holds no optimizer" in str(exc)
    odd = _model(LAYOUT_A) if dist.get_rank() != 1 else nn.Sequential(_model(LAYOUT_A), nn.Linear(2, 2).to(DT))
    try:
        save_checkpoint(path + "-odd", odd)
    except ShapeError as exc:
        out["models differ"] = "different models" in str(exc)
    return out


def test_save_reshard_resume_and_plain_torch(tmp_path):
    path = os.fspath(tmp_path / "ckpt")
    results = run_ranks(4, _save_then_reshard, path)
    for bad, _ in results:
        assert not bad, bad
    state_a = results[0][1]
    assert all(not bad for bad in run_ranks(2, _load_on_two_ranks, path, state_a))
    for out in run_ranks(4, _errors, path):
        assert out == {"shape": True, "no optimizer": True, "models differ": True}, out


def _thin_linear(w_grid, dtype):
    """Linear 3 -> 5 with its weight over a 4-worker grid: DTensor's chunks of 5 over 4 are 2, 2, 1, 0."""
    P_w = grid((0, 1, 2, 3), w_grid)
    P_x = grid([P_w.ranks[j] for j in range(w_grid[1])], (1, w_grid[1]))
    P_y = grid([P_w.ranks[i * w_grid[1]] for i in range(w_grid[0])], (1, w_grid[0]))
    return nn.Sequential(DistributedLinear(P_x, P_y, P_w, 3, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_and_empty_shards_round_trip_exactly(tmp_path, dtype):
    out = run_ranks(4, _low_precision, os.fspath(tmp_path / "ckpt"), dtype)
    assert all(o is True for o in out), out


def _low_precision(path, dtype):
    bad = []
    for name, before_model, after_model in (
            ("full model", nn.Sequential(_model(LAYOUT_A)).to(dtype), nn.Sequential(_model(LAYOUT_B)).to(dtype)),
            # Saved where rank 0 holds no batch-norm copy (its 0-d num_batches_tracked included).
            ("from B", nn.Sequential(_model(LAYOUT_B)).to(dtype), nn.Sequential(_model(LAYOUT_A)).to(dtype)),
            ("empty shards", _thin_linear((4, 1), dtype), _thin_linear((1, 4), dtype))):
        before = collect_sequential(before_model)
        save_checkpoint(f"{path}-{name}", before_model)
        load_checkpoint(f"{path}-{name}", after_model)
        after = collect_sequential(after_model)
        if dist.get_rank() != 0:
            continue
        floating = [k for k in before if before[k].is_floating_point()]
        if not floating or any(before[k].dtype != dtype for k in floating):
            bad.append(f"{name}: the model is not in the low-precision dtype")
        bad += [f"{name}: {k}" for k in before if after[k].dtype != before[k].dtype or
                not torch.equal(after[k], before[k])]
    return bad or True
