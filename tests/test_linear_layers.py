"""All-gather and reduce-scatter linears (plain and ZeRO): values, gradients, init, adjoint, dispatch records.

Every rank draws the layer and a sequential ``torch.nn.Linear`` from the same seed, so
the test also proves that ``reset_parameters`` gives the blocks of torch's tensors.  The
reference runs in float64 on the gathered global tensors (the inputs rounded to the
tested dtype first); each rank compares its own output block, input-gradient block and
the gradients of the parameter blocks it owns.  Partitions are built from the case's
world ranks; ranks outside them are inactive and must get zero-volume outputs.

Case ids read ``w<world>-<partition>-<what is special>``; the partition is P_y for the
all-gather linear and P_x for the reduce-scatter one (``[P_d, 1, ..., P_m]``), and
``seq`` cases add the sequence-split partition ``[P_d, 1, ..., P_m, 1]``.
"""

from __future__ import annotations

import copy
import os
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition, PartitionError, ShapeError, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.linear_all_gather import DistributedLinearAllGather, DistributedLinearAllGatherZero
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatter, DistributedLinearReduceScatterZero
from distfuse.testing import adjoint_check, run_ranks
from tests.tolerances import ADJOINT_RTOL, tol

DTYPES = (torch.float32, torch.bfloat16)
FAMILIES = {
    "ag": (DistributedLinearAllGather, DistributedLinearAllGatherZero),
    "rs": (DistributedLinearReduceScatter, DistributedLinearReduceScatterZero),
}


def _warm_imports():
    """Pools fork from this process: pay the first backward's and assert_close's imports once, here."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


_warm_imports()


class Case(NamedTuple):
    world: int
    ranks: tuple
    pshape: tuple  # [P_d, 1, ..., P_m]
    gshape: tuple  # global input shape; the last extent is in_features
    out: int
    seq: bool = False  # add the sequence-split partition (AG: P_x, RS: P_y)


# Shared by both families: uneven splits, extents smaller than the partition, inactive and unsorted ranks,
# 2-D to 4-D inputs, world sizes 1 to 8.
CASES = {
    "w1-1x1x1": Case(1, (0,), (1, 1, 1), (3, 4, 5), 7),
    "w2-1x1x2-uneven": Case(2, (0, 1), (1, 1, 2), (2, 3, 5), 7),
    "w2-2x1x1-data-parallel": Case(2, (0, 1), (2, 1, 1), (3, 2, 4), 5),
    "w2-1x1x2-seq-uneven": Case(2, (0, 1), (1, 1, 2), (2, 5, 4), 6, seq=True),
    "w3-1x1x3-uneven": Case(3, (0, 1, 2), (1, 1, 3), (2, 2, 7), 5),
    "w3-1x1x2-unsorted-inactive": Case(3, (2, 0), (1, 1, 2), (2, 3, 5), 3),
    "w3-1x1x3-seq-lt-workers": Case(3, (0, 1, 2), (1, 1, 3), (2, 2, 4), 5, seq=True),
    "w4-2x1x2-uneven-batch": Case(4, (0, 1, 2, 3), (2, 1, 2), (3, 4, 5), 7),
    "w4-1x1x4-features-lt-workers": Case(4, (0, 1, 2, 3), (1, 1, 4), (2, 2, 3), 2),
    "w4-2x2-2d-input": Case(4, (0, 1, 2, 3), (2, 2), (5, 6), 3),
    "w4-2x1x2-seq-uneven": Case(4, (0, 1, 2, 3), (2, 1, 2), (2, 5, 6), 5, seq=True),
    "w5-2x1x2-inactive-rank0": Case(5, (1, 2, 3, 4), (2, 1, 2), (3, 3, 5), 6),
    "w6-2x1x3-uneven": Case(6, tuple(range(6)), (2, 1, 3), (2, 3, 7), 8),
    "w6-3x1x2-batch-lt-P_d": Case(6, tuple(range(6)), (3, 1, 2), (2, 2, 5), 5),
    "w6-2x1x3-seq-uneven": Case(6, tuple(range(6)), (2, 1, 3), (3, 7, 4), 5, seq=True),
    "w7-1x1x1x6-4d-inactive": Case(7, (6, 0, 1, 2, 3, 4), (1, 1, 1, 6), (2, 2, 3, 8), 9),
    "w8-2x1x4-reference": Case(8, tuple(range(8)), (2, 1, 4), (4, 8, 16), 12),
    "w8-2x1x4-seq-reference": Case(8, tuple(range(8)), (2, 1, 4), (4, 8, 16), 12, seq=True),
    "w8-2x1x1x3-seq-4d-inactive": Case(8, (7, 5, 3, 1, 0, 2), (2, 1, 1, 3), (3, 2, 4, 5), 4, seq=True),
}


def _grid(ranks, shape):
    return Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(list(shape))


def _partitions(family: str, c: Case):
    """(the layer's main partition, the input's, the output's, the extra keyword for the sequence form)."""
    P_main = _grid(c.ranks, c.pshape)
    P_seq = None
    if c.seq:
        seq_shape = [c.pshape[0]] + [1] * (len(c.pshape) - 3) + [c.pshape[-1], 1]
        P_seq = _grid(c.ranks, seq_shape)
    if family == "ag":
        return P_main, (P_seq or P_main), P_main, dict(P_x=P_seq)
    return P_main, P_main, (P_seq or P_main), dict(P_y=P_seq)


def _data(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype).double()


def _reference(seq: torch.nn.Linear, X: torch.Tensor, dY: torch.Tensor, magnitude: bool = False):
    """Float64 forward and backward of the sequential layer: (Y, dX, {param name: grad}).

    With ``magnitude`` the same runs on the absolute values of every operand: each result is
    then the sum of the absolute values of the terms that make it up, the scale of the
    rounding error of a sum (see :func:`_assert_close`).
    """
    ref = copy.deepcopy(seq).double()
    if magnitude:
        with torch.no_grad():
            for p in ref.parameters():
                p.abs_()
        X, dY = X.abs(), dY.abs()
    X = X.clone().requires_grad_(True)
    Y = ref(X)
    Y.backward(dY)
    return Y.detach(), X.grad, {n: p.grad for n, p in ref.named_parameters()}


def _assert_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, dtype, what: str) -> None:
    """``|got - want| <= atol + rtol * scale`` elementwise, with the tolerance table's entry for ``dtype``.

    ``scale`` is the sum of the absolute terms (the textbook bound of a rounded sum):
    the distributed layers round partial sums (per model-parallel worker, per
    data-parallel worker) to the dtype before adding them, so under cancellation the
    error follows the terms, not the result.  Measured: a bf16 weight gradient of 0.89
    made of two partials near 6 is off by 0.046, 1.5 ulp of the partials.
    """
    t = tol(dtype)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got.double() - want).abs()
    bound = t["atol"] + t["rtol"] * scale
    if not bool((err <= bound).all()):
        ratio = (err / bound).flatten()
        i = int(ratio.argmax())
        raise AssertionError(f"{what} ({dtype}): element {i} is {got.flatten()[i].item()!r}, expected "
                             f"{want.flatten()[i].item()!r}; error {err.flatten()[i].item():.3g} exceeds the bound "
                             f"{bound.flatten()[i].item():.3g} ({int((ratio > 1).sum())} of {ratio.numel()} elements)")


def _block(t: torch.Tensor, P) -> torch.Tensor:
    return t[local_slices(t.shape, P.shape, P.index)]


def _check_layer(layer, seq, P_in, P_out, X, dY, dtype, seq_len=None):
    """One forward and backward on this rank against the float64 reference; returns the number of comparisons."""
    if not P_in.active:
        x = zero_volume_tensor(dtype=dtype, requires_grad=True)
        y = layer(x)
        assert y.shape == (0,) and layer.weight is None and layer.bias is None
        y.backward(torch.ones_like(y))
        return 0
    Y, dX, grads = _reference(seq, X, dY)
    sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)
    x = _block(X, P_in).to(dtype).requires_grad_(True)
    y = layer(x) if seq_len is None else layer(x, seq_len=seq_len)
    assert y.dtype == dtype
    _assert_close(y, _block(Y, P_out), _block(sY, P_out), dtype, "output")
    y.backward(_block(dY, P_out).to(dtype))
    _assert_close(x.grad, _block(dX, P_in), _block(sdX, P_in), dtype, "input gradient")
    checks = 2
    for lay in layer.param_layouts():
        param = getattr(layer, lay.name)
        if not lay.P.active:
            assert param is None, f"{lay.name}: a rank that owns no block must hold None"
            continue
        _assert_close(param.grad, _block(grads[lay.seq_name], lay.P), _block(sgrads[lay.seq_name], lay.P), dtype,
                      f"{lay.name} gradient")
        checks += 1
    assert layer.last_path == "unfused" and layer.last_decision.reason
    return checks


def _run_case(family: str, c: Case):
    P_main, P_in, P_out, extra = _partitions(family, c)
    in_f = c.gshape[-1]
    out_gshape = (*c.gshape[:-1], c.out)
    checks = 0
    for cls in FAMILIES[family]:
        for k, dtype in enumerate(DTYPES):
            seed = 100 + 10 * k + (cls.__name__.endswith("Zero"))
            torch.manual_seed(seed)
            layer = cls(P_main, in_f, c.out, dtype=dtype, **extra)
            torch.manual_seed(seed)
            seq = torch.nn.Linear(in_f, c.out, dtype=dtype)
            # reset_parameters made the same draws as torch: the owned blocks are bit-equal.
            for lay in layer.param_layouts():
                if lay.P.active:
                    assert torch.equal(getattr(layer, lay.name), _block(seq.state_dict()[lay.seq_name], lay.P))
            X, dY = _data(c.gshape, 7 + k, dtype), _data(out_gshape, 8 + k, dtype)
            # The all-gather's sequence form runs once with the shape exchange, once with seq_len given.
            seq_len = c.gshape[-2] if (family == "ag" and c.seq and dtype == torch.bfloat16) else None
            checks += _check_layer(layer, seq, P_in, P_out, X, dY, dtype, seq_len)
        # Dot-product test in float64 without bias (the layer is then linear in x).
        # Built in fp32 and converted: ranks without parameters must follow .to() too (they receive in that dtype).
        layer = cls(P_main, in_f, c.out, bias=False, **extra).to(torch.float64)
        x = _block(_data(c.gshape, 9, torch.float64), P_in) if P_in.active else zero_volume_tensor(dtype=torch.float64)
        fwd, adj = adjoint_check(layer, x)
        assert fwd != 0.0 and abs(fwd - adj) <= ADJOINT_RTOL * max(abs(fwd), abs(adj)), (cls.__name__, fwd, adj)
    return P_in.active, checks


@pytest.mark.parametrize("family", ["ag", "rs"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_values_gradients_init_adjoint(family, case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, _run_case, family, c)
    for w, (active, checks) in enumerate(out):
        assert active == (w in c.ranks)
        assert (checks > 0) == active, f"rank {w}: {checks} comparisons"


def debug_run(fn, *args):
    """Run ``fn`` with ``DISTFUSE_DEBUG=1``: ranks check agreement before every collective, and receive and scratch
    buffers start as NaN, so an output element no message wrote, or a read of padding, cannot pass."""
    saved = os.environ.get("DISTFUSE_DEBUG")
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        return fn(*args)
    finally:
        if saved is None:
            os.environ.pop("DISTFUSE_DEBUG")
        else:
            os.environ["DISTFUSE_DEBUG"] = saved


@pytest.mark.parametrize("family", ["ag", "rs"])
@pytest.mark.parametrize("case_id", ["w6-2x1x3-seq-uneven", "w7-1x1x1x6-4d-inactive"])
def test_debug_mode(family, case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, debug_run, _run_case, family, c)
    assert all((checks > 0) == (w in c.ranks) for w, (_, checks) in enumerate(out))


# ---------------------------------------------------------------- parameters: sequential <-> distributed, checkpoints


def _round_trip(family: str, c: Case):
    P_main, _, _, extra = _partitions(family, c)
    in_f = c.gshape[-1]
    out = []
    for cls in FAMILIES[family]:
        layer = cls(P_main, in_f, c.out, **extra)
        seq = None
        if dist.get_rank() == 0:
            seq = torch.nn.Linear(in_f, c.out)
            with torch.no_grad():
                for p in seq.parameters():
                    p.copy_(torch.randn_like(p))  # not the init: proves the load copies
        load_sequential(layer, seq)
        back = collect_sequential(layer)
        if dist.get_rank() == 0:
            want = seq.state_dict()
            assert back.keys() == want.keys()
            for k in want:
                assert torch.equal(back[k], want[k]), k
        # Each rank checkpoints and restores its own blocks.
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
        assert "_extra_state" in state  # which blocks this rank's file holds
        owned = sorted(k for k in state if k != "_extra_state")
        with torch.no_grad():
            for p in layer.parameters():
                p.fill_(float("nan"))
        layer.load_state_dict(state)
        for k, v in layer.state_dict().items():
            assert torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k], k
        out.append(owned)
    return out


@pytest.mark.parametrize("family", ["ag", "rs"])
@pytest.mark.parametrize("case_id", ["w4-2x1x2-uneven-batch", "w6-2x1x3-seq-uneven", "w3-1x1x2-unsorted-inactive"])
def test_state_dict_round_trips(family, case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, _round_trip, family, c)
    P_m, P_d = c.pshape[-1], c.pshape[0]
    for w, (plain, zero) in enumerate(out):
        if w not in c.ranks:
            assert plain == [] and zero == []
            continue
        d, m = divmod(c.ranks.index(w), P_m)
        assert zero[-1:] == ["weight"] or P_d == 1, "every ZeRO worker owns a weight shard"
        assert ("weight" in plain) == (d == 0), "plain layers keep the weight on the d = 0 workers"


# ---------------------------------------------------------------- errors


def _catch(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the parent checks type and message
        return type(exc).__name__, str(exc)
    return None


def _errors():
    r = dist.get_rank()
    P = _grid(range(4), [2, 1, 2])
    P_mid = _grid(range(4), [1, 2, 2])
    P_seq = _grid(range(4), [2, 2, 1])
    P_seq_other = _grid([1, 0, 3, 2], [2, 2, 1])
    out = {
        "ag-middle-dim": _catch(DistributedLinearAllGather, P_mid, 4, 4),
        "rs-middle-dim": _catch(DistributedLinearReduceScatter, P_mid, 4, 4),
        "ag-P_x-shape": _catch(DistributedLinearAllGather, P, 4, 4, P_x=P),
        "rs-P_y-shape": _catch(DistributedLinearReduceScatterZero, P, 4, 4, P_y=P),
        "ag-P_x-other-ranks": _catch(DistributedLinearAllGatherZero, P, 4, 4, P_x=P_seq_other),
        "rs-zero-features": _catch(DistributedLinearReduceScatter, P, 0, 4),
        "ag-float-features": _catch(DistributedLinearAllGather, P, 4.0, 4),
        "ag-swapped": _catch(DistributedLinearAllGather, P_seq, 4, 4, P_x=P),
    }
    ag = DistributedLinearAllGather(P, 5, 3)
    rs = DistributedLinearReduceScatter(P, 5, 3, P_y=P_seq)
    m = P.index[-1]
    # Every rank passes a bad block, so every rank raises before any collective.
    out["ag-wrong-feature-block"] = _catch(ag, torch.randn(1, 2, 3 - m + 1))
    out["rs-wrong-ndim"] = _catch(rs, torch.randn(2, 3 - m))
    ag_seq = DistributedLinearAllGather(P, 5, 3, P_x=P_seq)
    out["ag-seq-wrong-seq-len"] = _catch(ag_seq, torch.randn(1, 2, 5), seq_len=7)
    return r, m, out


def test_errors_name_layer_rank_expected_and_actual():
    for r, m, out in run_ranks(4, _errors):
        for key in ("ag-middle-dim", "rs-middle-dim", "ag-P_x-shape", "rs-P_y-shape", "ag-P_x-other-ranks",
                    "rs-zero-features", "ag-float-features", "ag-swapped"):
            kind, msg = out[key]
            assert kind == PartitionError.__name__, (key, kind, msg)
            assert f"[rank {r}]" in msg and "DistributedLinear" in msg, (key, msg)
        assert "expected [1, 1, 2], got [1, 2, 2]" in out["ag-middle-dim"][1]
        assert "expected [2, 2, 1], got [2, 1, 2]" in out["ag-P_x-shape"][1]
        assert "same world ranks" in out["ag-P_x-other-ranks"][1]
        assert "got [2, 2, 1]" in out["ag-swapped"][1] and "look swapped" in out["ag-swapped"][1]
        assert "in_features: expected an integer >= 1, got 0" in out["rs-zero-features"][1]
        kind, msg = out["ag-wrong-feature-block"]
        assert kind == ShapeError.__name__ and f"DistributedLinearAllGather [rank {r}]" in msg
        assert f"expected {3 - m}, got {4 - m}" in msg, msg
        kind, msg = out["rs-wrong-ndim"]
        assert kind == ShapeError.__name__ and "expected 3, got 2" in msg, msg
        kind, msg = out["ag-seq-wrong-seq-len"]
        assert kind == ShapeError.__name__ and "seq_len=7" in msg and f"expected {4 - m}, got 2" in msg, msg


# ---------------------------------------------------------------- dispatch records


def _dispatch(mode):
    import os

    if mode is None:
        os.environ.pop("DISTFUSE_PATH", None)
    else:
        os.environ["DISTFUSE_PATH"] = mode
    try:
        P = _grid(range(2), [1, 1, 2])
        P_seq = _grid(range(2), [1, 2, 1])
        ag = DistributedLinearAllGather(P, 4, 6, P_x=P_seq)
        rs = DistributedLinearReduceScatter(P, 6, 4, P_y=P_seq)
        ag_feat = DistributedLinearAllGatherZero(P, 4, 6)
        rs_feat = DistributedLinearReduceScatterZero(P, 6, 4)
        x = torch.randn(2, 3, 4)
        h = torch.randn(2, 3, 3)
        out = {}
        for name, layer, inp in (("ag", ag, x), ("rs", rs, h), ("ag_feat", ag_feat, x[..., 2 * P.rank:2 * P.rank + 2]),
                                 ("rs_feat", rs_feat, h)):
            assert layer.last_path is None
            explained = layer.explain(inp)
            layer(inp)
            assert layer.last_decision == explained, (name, layer.last_decision, explained)
            out[name] = (layer.last_path, layer.last_decision.reason)
        return out
    finally:
        os.environ.pop("DISTFUSE_PATH", None)


@pytest.mark.parametrize("mode", [None, "fused", "unfused"], ids=["auto", "forced-fused", "forced-unfused"])
def test_dispatch_records_the_path_and_why(mode):
    for out in run_ranks(2, _dispatch, mode):
        if mode == "fused":  # the sequence-parallel forms run the fused GEMM ops (interpreted Triton on CPU)
            assert out["ag"] == ("fused", "DISTFUSE_PATH=fused") and out["rs"] == ("fused", "DISTFUSE_PATH=fused")
        else:
            assert out["ag"][0] == out["rs"][0] == "unfused"
            if mode == "unfused":
                assert out["ag"][1] == "DISTFUSE_PATH=unfused"
            else:
                assert "cpu" in out["ag"][1] and "cpu" in out["rs"][1]
        for name in ("ag_feat", "rs_feat"):  # DistDL's own forms (features split) decide like the sequence forms
            assert out[name] == out["ag"], (name, out[name], out["ag"])


# ---------------------------------------------------------------- frozen parameters, inputs without grad, no_grad


def _frozen(family: str, c: Case):
    """Frozen weights or an input without grad must neither hang nor change the gradients that are asked for.

    A receive-only worker cannot know whether its source's tensor requires grad; the layers make every worker run
    the adjoint under grad mode (see ``_linear_common``).  A broken rule shows up here as a process-group timeout.
    """
    P_main, P_in, P_out, extra = _partitions(family, c)
    in_f, out_gshape = c.gshape[-1], (*c.gshape[:-1], c.out)
    X, dY = _data(c.gshape, 21, torch.float32), _data(out_gshape, 22, torch.float32)
    checks = 0
    for cls in FAMILIES[family]:
        torch.manual_seed(3)
        layer = cls(P_main, in_f, c.out, **extra)
        torch.manual_seed(3)
        seq = torch.nn.Linear(in_f, c.out)
        Y, dX, grads = _reference(seq, X, dY)
        sY, sdX, sgrads = _reference(seq, X, dY, magnitude=True)
        with torch.no_grad():  # no adjoint anywhere: nothing may wait for one
            x = _block(X, P_in).float() if P_in.active else zero_volume_tensor()
            y = layer(x)
            if P_out.active:
                _assert_close(y, _block(Y, P_out), _block(sY, P_out), torch.float32, "no_grad output")
                checks += 1
        layer.requires_grad_(False)  # frozen everywhere: only the input gradient is asked for
        x = _block(X, P_in).float().requires_grad_(True) if P_in.active else zero_volume_tensor(requires_grad=True)
        y = layer(x)
        y.backward(_block(dY, P_out).float() if P_out.active else torch.ones_like(y))
        if P_in.active:
            _assert_close(x.grad, _block(dX, P_in), _block(sdX, P_in), torch.float32, "frozen: input gradient")
            assert all(p.grad is None for p in layer.parameters())
            checks += 1
        layer.requires_grad_(True)  # an input without grad (a first layer): only parameter gradients
        x = _block(X, P_in).float() if P_in.active else zero_volume_tensor()
        y = layer(x)
        if y.requires_grad:
            y.backward(_block(dY, P_out).float() if P_out.active else torch.zeros_like(y))
        for lay in layer.param_layouts():
            if lay.P.active:
                _assert_close(getattr(layer, lay.name).grad, _block(grads[lay.seq_name], lay.P),
                              _block(sgrads[lay.seq_name], lay.P), torch.float32, f"first layer: {lay.name} gradient")
                checks += 1
    return checks


@pytest.mark.parametrize("family", ["ag", "rs"])
@pytest.mark.parametrize("case_id", ["w4-2x1x2-seq-uneven", "w5-2x1x2-inactive-rank0"])
def test_frozen_weights_inputs_without_grad_and_no_grad(family, case_id):
    c = CASES[case_id]
    out = run_ranks(c.world, _frozen, family, c)
    assert all((n > 0) == (w in c.ranks) for w, n in enumerate(out)), out
