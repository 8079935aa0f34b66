"""The rounding bound of :mod:`distfuse.testing.tolerance` and the suite's table built on it.

The bound must hold for rounding noise, summed in any order, and must fail a real error just
above it: long float32 sums in four orders stay under ``rounding_bound(float32, n)`` times the
sum of their magnitudes, a weight moved by a few times the bound is caught, and
:func:`compare_state` accepts a batch norm's near-zero bias off by rounding on its layer's
scale (a tensor's own largest value would have turned that into a failure) but rejects a
training step whose one gradient is 1% off.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from distfuse.testing.tolerance import SAFETY, check_trained_state, compare_state, rounding_bound, unit_roundoff
from tests.tolerances import ADJOINT_RTOL, REL_NORM, TOL, tol

F32, F64 = torch.float32, torch.float64


def test_bound_grows_with_terms_steps_and_coarser_dtypes():
    assert unit_roundoff(F32) == 2.0**-24 and unit_roundoff(F64) == 2.0**-53
    assert rounding_bound(F32, 64) < rounding_bound(F32, 4096) < rounding_bound(F32, 4096, steps=8)
    assert rounding_bound(F64) < rounding_bound(F32) < rounding_bound(torch.float16) < rounding_bound(torch.bfloat16)
    # k steps compound to about k times one step (first order)
    one, eight = rounding_bound(F32, 3456), rounding_bound(F32, 3456, steps=8)
    assert 8 * one <= eight <= 8 * one * (1 + 1e-3)
    # the documented table, at the default sum length and at the norm checks' length
    assert [f"{TOL[d]['rtol']:.1e}" for d in (F64, F32, torch.float16, torch.bfloat16)] == [
        "1.1e-14", "6.0e-06", "2.0e-03", "1.6e-02"]
    assert [f"{REL_NORM[d]:.1e}" for d in (F64, F32, torch.float16, torch.bfloat16)] == [
        "2.9e-14", "1.5e-05", "2.0e-03", "1.6e-02"]
    assert 1e-13 < ADJOINT_RTOL < 1e-11
    with pytest.raises(ValueError):
        rounding_bound(F32, 0)


@pytest.mark.parametrize("n", [64, 4096, 65536])
def test_long_float32_sums_stay_inside_the_bound_in_any_order(n):
    """Sequential, reversed, pairwise and torch's vectorised sums of mean-zero data (heavy cancellation)."""
    gen = np.random.default_rng(n)
    x = gen.standard_normal(n).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    scale = float(np.sum(np.abs(x.astype(np.float64))))
    pairwise = x.copy()
    while pairwise.size > 1:
        if pairwise.size % 2:
            pairwise = np.append(pairwise, np.float32(0))
        pairwise = (pairwise[0::2] + pairwise[1::2]).astype(np.float32)
    sums = {
        "sequential": float(np.add.accumulate(x, dtype=np.float32)[-1]),
        "reversed": float(np.add.accumulate(x[::-1], dtype=np.float32)[-1]),
        "pairwise": float(pairwise[0]),
        "torch": float(torch.from_numpy(x).sum()),
    }
    # one sum is half the bound (its safety factor covers two sums in sequence)
    bound = rounding_bound(F32, n) / SAFETY * scale
    for order, got in sums.items():
        assert abs(got - exact) <= bound, (order, abs(got - exact), bound)
    # the sequential sum is not exact: the check compares rounding, not identical bits
    assert sums["sequential"] != exact


def test_tol_accepts_a_float32_matmul_and_rejects_a_weight_moved_by_a_few_bounds():
    K = 1024
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, K, generator=gen, dtype=F64).float()
    w = torch.randn(32, K, generator=gen, dtype=F64).float()
    ref = x.double() @ w.double().T
    t = tol(F32, terms=K, scale=float(ref.abs().mean()))
    torch.testing.assert_close((x @ w.T).double(), ref, **t)
    # move one weight by 4 bounds of its own magnitude (about 1e3 ulps at K = 1024)
    bad = w.clone()
    bad[3, 5] *= 1 + 4 * t["rtol"] * math.sqrt(K)  # its products are 1/sqrt(K) of the outputs' size
    ulps = float((bad[3, 5] - w[3, 5]).abs() / (w[3, 5].abs() * 2 * unit_roundoff(F32)))
    assert 100 < ulps < 1e5, ulps
    with pytest.raises(AssertionError):
        torch.testing.assert_close((x @ bad.T).double(), ref, **t)


def test_compare_state_measures_a_near_zero_tensor_on_its_layers_scale():
    """The U-Net demo's case: a batch norm's bias near 1e-4, off by 5e-8 of rounding."""
    gen = torch.Generator().manual_seed(1)
    want = {"bn.weight": 1 + 0.01 * torch.randn(8, generator=gen, dtype=F64),
            "bn.bias": 1e-4 * torch.randn(8, generator=gen, dtype=F64),
            "bn.running_var": 1 + 0.1 * torch.rand(8, generator=gen, dtype=F64),
            "bn.num_batches_tracked": torch.tensor(3),
            "conv.weight": 0.2 * torch.randn(8, 2, 3, generator=gen, dtype=F64)}
    got = {k: v.clone() for k, v in want.items()}
    got["bn.bias"][2] += 5e-8
    got["conv.weight"][1, 1, 1] += 4 * unit_roundoff(F32) * 0.2
    bias = want["bn.bias"]
    assert 5e-8 / float(bias.abs().max()) > 1e-4  # on its own largest value, this was a failure
    ok = compare_state(got, want, F32, terms=3456, steps=3)
    assert ok.ok and ok.ratio < 0.05, ok

    for key in ("bn.bias", "conv.weight"):  # moved by twice the bound on the layer's largest value
        layer = key.split(".")[0]
        size = max(float(v.abs().max()) for k, v in want.items() if k.startswith(layer) and v.is_floating_point())
        bad = {k: v.clone() for k, v in got.items()}
        bad[key].view(-1)[0] += 2 * ok.bound * size
        worst = compare_state(bad, want, F32, terms=3456, steps=3)
        assert not worst.ok and worst.key == key, (key, worst)

    for key, value in [("bn.num_batches_tracked", torch.tensor(4)), ("bn.weight", torch.full((8,), math.nan))]:
        worst = compare_state({**got, key: value}, want, F32, terms=3456, steps=3)
        assert not worst.ok and worst.key == key, (key, worst)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm3d(4)
        self.head = nn.Conv3d(4, 3, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def _train(net, dtype, steps, bug=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2, 2, 6, 6, 6, generator=gen).to(dtype)
        target = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), target).backward()
        if bug is not None:
            bug(net)
        opt.step()
    return net.state_dict()


def test_compare_state_passes_float32_training_and_catches_a_gradient_one_percent_off():
    steps, terms = 4, 2 * 6**3  # batch norm statistics and weight gradients sum over the batch and volume
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _Net().state_dict().items()}
    nets = {}
    for dtype in (F32, F64):
        nets[dtype] = _Net().to(dtype)
        nets[dtype].load_state_dict(init)
    exact = _train(nets[F64], F64, steps)
    rounded = _train(nets[F32], F32, steps)
    fine = compare_state(rounded, exact, F32, terms, steps, start=init)
    assert fine.ok and fine.ratio < 0.2, fine

    def one(net):  # one weight's gradient 1% too large: a contribution counted 1.01 times
        net.conv.weight.grad[1, 0, 1, 1, 1] *= 1.01

    def whole(net):  # the head's bias gradient 1% too large: a scale that is off
        net.head.bias.grad *= 1.01

    for bug, key in ((one, "conv.weight"), (whole, "head.bias")):
        buggy = _Net()
        buggy.load_state_dict(init)
        worst = compare_state(_train(buggy, F32, steps, bug), exact, F32, terms, steps, start=init)
        assert not worst.ok and worst.key == key, worst


def test_the_demos_final_check_passes_float32_training_and_names_a_tensor_moved_off():
    """``check_trained_state``: a float32 run of the float64 model passes; one moved weight raises, named."""
    torch.manual_seed(0)
    exact = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    start = {k: v.clone() for k, v in exact.state_dict().items()}
    single = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    single.load_state_dict({k: v.float() for k, v in start.items()})
    twins = {torch.float64: (exact, None), torch.float32: (single, None)}
    steps, terms = 3, 32
    for _ in range(steps):
        x = torch.randn(64, 32, dtype=torch.float64)
        for model in (exact, single):
            model.zero_grad()
            model(x.to(next(model.parameters()).dtype)).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    final = {k: v.clone() for k, v in single.state_dict().items()}
    worst, torch_nn = check_trained_state(final, twins, terms, steps, start)
    assert worst.ok and worst.ratio < 1 and torch_nn.ratio == worst.ratio  # the float32 twin is the distributed one
    moved = dict(final)
    moved["2.weight"] = final["2.weight"] + 1e-3 * final["2.weight"].abs().max()
    with pytest.raises(RuntimeError, match=r"2\.weight is off by"):
        check_trained_state(moved, twins, terms, steps, start)
