"""The general DistributedLinear (broadcast, local GEMM, sum-reduce): values, gradients, init, adjoint, errors.

Same method as ``test_linear_layers``: layer and sequential ``torch.nn.Linear`` from one
seed, float64 reference on the global tensors, each rank checks the blocks it holds.
P_x, P_y and P_w sit on overlapping, disjoint or reordered world ranks; ranks outside
all three are inactive.  Case ids read ``w<world>-<what is special>``; ``exchange``
marks cases where some P_w or P_y worker holds no input block, so those workers learn the
input's leading extents from the layer's agreed record (gathered on the first call and on
a change).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, PartitionError, ShapeError, zero_volume_tensor
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.linear import DistributedLinear
from distfuse.testing import adjoint_check, run_ranks
from tests.test_linear_layers import DTYPES, _assert_close, _block, _data, _reference, debug_run
from tests.tolerances import ADJOINT_RTOL


class Case(NamedTuple):
    world: int
    x: tuple  # (world ranks, shape) of P_x
    y: tuple  # of P_y
    w: tuple  # of P_w
    gshape: tuple  # global input shape; the last extent is in_features
    out: int


CASES = {
    "w1-1x1": Case(1, ((0,), (1, 1)), ((0,), (1, 1)), ((0,), (1, 1)), (3, 5), 4),
    "w2-no-exchange-P_w-in-P_x": Case(2, ((0, 1), (1, 2)), ((1,), (1, 1)), ((1, 0), (1, 2)), (3, 5), 4),
    "w4-exchange-disjoint-x-y": Case(4, ((0, 1), (1, 2)), ((2, 3), (1, 2)), (tuple(range(4)), (2, 2)), (3, 7), 5),
    "w6-exchange-3d-input-2d-P_w": Case(6, ((4, 5), (1, 1, 2)), ((0, 2, 4), (1, 1, 3)), (tuple(range(6)), (3, 2)),
                                        (2, 3, 5), 7),
    "w6-features-lt-partition": Case(6, ((0, 1, 2), (1, 3)), ((3, 4), (1, 2)), (tuple(range(6)), (2, 3)), (4, 2), 1),
    "w7-1d-input-inactive": Case(7, ((0, 1), (2,)), ((2, 3, 4), (3,)), (tuple(range(6)), (3, 2)), (7,), 5),
    # The reference example (P_x 1x4 on ranks 0-3, P_y 1x3 on 4-6, P_W 3x4 on 0-11) with P_fi = 2 to fit 8 ranks.
    "w8-reference-scaled-inactive": Case(8, ((0, 1), (1, 2)), ((4, 5, 6), (1, 3)), (tuple(range(6)), (3, 2)),
                                         (1, 16), 12),
    "w8-4d-unsorted": Case(8, ((7, 3, 5), (1, 1, 1, 3)), ((1, 6), (1, 1, 1, 2)), ((6, 0, 2, 4, 1, 3), (1, 1, 2, 3)),
                           (2, 2, 3, 8), 6),
}


def _grid(spec):
    ranks, shape = spec
    return Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(list(shape))


def _check(layer, seq, P_x, P_y, X, dY, dtype, path="unfused"):
    """Forward and backward on this rank against the float64 reference; returns the number of comparisons.

    ``path``: the one the P_w workers must record (workers outside P_w always record ``"unfused"``).
    """
    in_union = P_x.active or P_y.active or layer.P_w.active
    x = _block(X, P_x).to(dtype).requires_grad_(True) if P_x.active else zero_volume_tensor(dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype and layer.last_path == (path if layer.P_w.active else "unfused"), layer.last_decision
    # Every worker of the three partitions takes part in the adjoint, whatever its placeholder says.
    assert y.requires_grad == in_union, f"requires_grad {y.requires_grad} on a rank in the union: {in_union}"
    Y, dX, grads = _reference(seq, X, dY)
    sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)
    checks = 0
    if P_y.active:
        _assert_close(y, _block(Y, P_y), _block(sY, P_y), dtype, "output")
        checks += 1
        dy = _block(dY, P_y).to(dtype)
    else:
        assert y.shape == (0,), f"a rank outside P_y gets a zero-volume output, got {tuple(y.shape)}"
        dy = torch.zeros_like(y)
    if y.requires_grad:
        y.backward(dy)
    if P_x.active:
        _assert_close(x.grad, _block(dX, P_x), _block(sdX, P_x), dtype, "input gradient")
        checks += 1
    for lay in layer.param_layouts():
        param = getattr(layer, lay.name)
        if not lay.P.active:
            assert param is None, f"{lay.name}: a rank that owns no block must hold None"
            continue
        _assert_close(param.grad, _block(grads[lay.seq_name], lay.P), _block(sgrads[lay.seq_name], lay.P), dtype,
                      f"{lay.name} gradient")
        checks += 1
    return checks


def _run_case(c: Case):
    P_x, P_y, P_w = _grid(c.x), _grid(c.y), _grid(c.w)
    in_f = c.gshape[-1]
    out_gshape = (*c.gshape[:-1], c.out)
    checks = 0
    for k, dtype in enumerate(DTYPES):
        torch.manual_seed(50 + k)
        layer = DistributedLinear(P_x, P_y, P_w, in_f, c.out, dtype=dtype)
        torch.manual_seed(50 + k)
        seq = torch.nn.Linear(in_f, c.out, dtype=dtype)
        for lay in layer.param_layouts():  # reset_parameters drew what torch draws
            if lay.P.active:
                assert torch.equal(getattr(layer, lay.name), _block(seq.state_dict()[lay.seq_name], lay.P))
        checks += _check(layer, seq, P_x, P_y, _data(c.gshape, 3 + k, dtype), _data(out_gshape, 4 + k, dtype), dtype)
    layer = DistributedLinear(P_x, P_y, P_w, in_f, c.out, bias=False).to(torch.float64)  # .to() on every rank
    x = _block(_data(c.gshape, 5, torch.float64), P_x) if P_x.active else zero_volume_tensor(dtype=torch.float64)
    fwd, adj = adjoint_check(layer, x)
    assert fwd != 0.0 and abs(fwd - adj) <= ADJOINT_RTOL * max(abs(fwd), abs(adj)), (fwd, adj)
    roles = "".join(n for n, P in (("x", P_x), ("y", P_y), ("w", P_w)) if P.active)
    return roles, checks, layer._needs_meta


@pytest.mark.parametrize("case_id", list(CASES))
def test_values_gradients_init_adjoint(case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, _run_case, c)
    for w, (roles, checks, needs_meta) in enumerate(out):
        assert roles == "".join(n for n, (ranks, _) in (("x", c.x), ("y", c.y), ("w", c.w)) if w in ranks)
        assert (checks > 0) == bool(roles), f"rank {w} ({roles}): {checks} comparisons"
        # The shape exchange runs exactly when some P_w or P_y worker holds no input block.
        assert needs_meta == (not set(c.w[0]) | set(c.y[0]) <= set(c.x[0]))


@pytest.mark.parametrize("case_id", ["w8-reference-scaled-inactive", "w2-no-exchange-P_w-in-P_x"])
def test_debug_mode(case_id):
    """Debug mode: agreement checks and NaN-filled receive buffers (see ``test_linear_layers.debug_run``)."""
    c = CASES[case_id]
    out = run_ranks(c.world, debug_run, _run_case, c)
    assert all((checks > 0) == bool(roles) for roles, checks, _ in out)


# ---------------------------------------------------------------- parameters


def _round_trip(c: Case):
    P_x, P_y, P_w = _grid(c.x), _grid(c.y), _grid(c.w)
    layer = DistributedLinear(P_x, P_y, P_w, c.gshape[-1], c.out)
    seq = torch.nn.Linear(c.gshape[-1], c.out) if dist.get_rank() == 0 else None
    if seq is not None:
        with torch.no_grad():
            for p in seq.parameters():
                p.copy_(torch.randn_like(p))
    load_sequential(layer, seq)
    back = collect_sequential(layer)
    if seq is not None:
        assert back.keys() == seq.state_dict().keys()
        assert all(torch.equal(back[k], v) for k, v in seq.state_dict().items())
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    assert "_extra_state" in state  # which blocks this rank's file holds
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    layer.load_state_dict(state)
    assert all(torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k]
               for k, v in layer.state_dict().items())
    return sorted(k for k in state if k != "_extra_state")


def test_state_dict_round_trip():
    c = CASES["w8-reference-scaled-inactive"]
    out = run_ranks(c.world, _round_trip, c)
    for w, keys in enumerate(out):
        # Weights on P_w (ranks 0-5); the bias on its column 0 (P_w workers (i, 0): ranks 0, 2, 4).
        assert keys == (["bias", "weight"] if w in (0, 2, 4) else ["weight"] if w < 6 else []), (w, keys)


# ---------------------------------------------------------------- errors


def _catch(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the parent checks type and message
        return type(exc).__name__, str(exc)
    return None


def _errors():
    P_x, P_y = _grid(((0, 1), (1, 2))), _grid(((2, 3), (1, 2)))
    P_w = _grid((range(4), (2, 2)))
    out = {
        "P_w-shape": _catch(DistributedLinear, P_x, P_y, _grid((range(4), (1, 4))), 4, 4),
        "P_x-split-batch": _catch(DistributedLinear, _grid((range(4), (2, 2))), _grid((range(2), (1, 2))), P_w, 4, 4),
        "P_y-dims": _catch(DistributedLinear, P_x, _grid(((2, 3), (1, 1, 2))), P_w, 4, 4),
        "features": _catch(DistributedLinear, P_x, P_y, P_w, 4, -1),
    }
    layer = DistributedLinear(P_x, P_y, P_w, 5, 3)
    # Rank 1 (P_x worker 1, block 2 of in_features=5) passes 3 features; the shape exchange makes every rank raise.
    r = dist.get_rank()
    x = torch.randn(2, 3) if P_x.active else zero_volume_tensor()
    out["bad-block"] = _catch(layer, x)
    return r, out


def test_errors_name_layer_rank_expected_and_actual():
    for r, out in run_ranks(4, _errors):
        for key in ("P_w-shape", "P_x-split-batch", "P_y-dims", "features"):
            kind, msg = out[key]
            assert kind == PartitionError.__name__ and f"DistributedLinear [rank {r}]" in msg, (key, msg)
        assert "expected [2, 2], got [1, 4]" in out["P_w-shape"][1]
        assert "expected [1, 2], got [2, 2]" in out["P_x-split-batch"][1]
        assert "expected 2, got 3" in out["P_y-dims"][1]
        kind, msg = out["bad-block"]
        assert kind == ShapeError.__name__ and f"DistributedLinear [rank {r}]" in msg, msg
        assert "world rank 1 (P_x worker 1) passed shape (2, 3)" in msg and "in_features: 2" in msg, msg


# ---------------------------------------------------------------- frozen parameters, inputs without grad, no_grad


def _frozen(c: Case):
    """A first layer (input without grad), frozen weights and no_grad must neither hang nor change gradients."""
    P_x, P_y, P_w = _grid(c.x), _grid(c.y), _grid(c.w)
    X, dY = _data(c.gshape, 31, torch.float32), _data((*c.gshape[:-1], c.out), 32, torch.float32)
    torch.manual_seed(4)
    layer = DistributedLinear(P_x, P_y, P_w, c.gshape[-1], c.out)
    torch.manual_seed(4)
    seq = torch.nn.Linear(c.gshape[-1], c.out)
    Y, dX, grads = _reference(seq, X, dY)
    sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)

    def run(x_grad: bool):
        x = _block(X, P_x).float().requires_grad_(x_grad) if P_x.active else zero_volume_tensor()
        y = layer(x)
        if y.requires_grad:
            y.backward(_block(dY, P_y).float() if P_y.active else torch.zeros_like(y))
        return x, y

    checks = 0
    with torch.no_grad():
        _, y = run(False)
    if P_y.active:
        _assert_close(y, _block(Y, P_y), _block(sY, P_y), torch.float32, "no_grad output")
        checks += 1
    run(False)  # a first layer: only parameter gradients
    for lay in layer.param_layouts():
        if lay.P.active:
            _assert_close(getattr(layer, lay.name).grad, _block(grads[lay.seq_name], lay.P),
                          _block(sgrads[lay.seq_name], lay.P), torch.float32, f"first layer: {lay.name} gradient")
            checks += 1
    layer.requires_grad_(False)  # frozen: only the input gradient
    x, _ = run(True)
    if P_x.active:
        _assert_close(x.grad, _block(dX, P_x), _block(sdX, P_x), torch.float32, "frozen: input gradient")
        checks += 1
    return checks


@pytest.mark.parametrize("case_id", ["w8-reference-scaled-inactive", "w2-no-exchange-P_w-in-P_x"])
def test_frozen_weights_inputs_without_grad_and_no_grad(case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, _frozen, c)
    in_any = set(c.x[0]) | set(c.y[0]) | set(c.w[0])
    assert all((n > 0) == (w in in_any) for w, n in enumerate(out)), out
