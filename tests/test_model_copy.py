"""``copy.deepcopy`` of distributed models, and torch's ``AveragedModel`` (SWA, EMA) built on it.

What a copy must be (``docs/interop.md``, "Copies"):

* **shares its partitions**: the very same :class:`~distfuse.Partition` objects, so the
  same process groups;
* **owns the rest**: parameters, buffers, agreement sites, call records and the contexts
  behind ``torch.library`` handles.  Checked on the object graph: nothing mutable is
  reachable from both the original and the copy except through a partition, no tensor
  storage is shared, every agreement site of the copy is fresh, and every handle of the
  copy names the copy's own object;
* **computes the same**: same outputs and gradients as the original (float64: the
  tolerance table's fp64 entry: the copy's first call re-agrees through the slow path, so
  its collectives may run with other message sizes and sum in another order);
* **trains independently**: a forward, backward and SGD step on the copy leaves the
  original's parameters, buffers and agreement records bitwise as they were, and the
  other way round.

Every layer family of ``distfuse.layers`` and every primitive module runs through that
protocol on 4 ranks, over partitions with uneven splits, one with a rank outside every
partition of the layer (``inactive``) and layers whose partitions cover different ranks.
Then ``AveragedModel`` (SWA, and EMA with buffers) over a small distributed conv net is
trained against the same over its ``torch.nn`` twin.
"""

from __future__ import annotations

import copy
import enum
import functools
import io
import pickle
import threading
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from distfuse import NotPicklableError, Partition, zero_volume_tensor
from distfuse import layers as L
from distfuse.geometry.decomposition import local_slices
from distfuse.model import collect_sequential, load_sequential, make_optimizer
from distfuse.primitives import (
    AllGather,
    AllSumReduce,
    Broadcast,
    HaloExchange,
    ReduceScatter,
    Repartition,
    SumReduce,
)
from distfuse.primitives._agreement import AgreementSite
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from distfuse.testing.tolerance import compare_state
from tests.test_conv_support import grid
from tests.tolerances import TERMS, tol

F64 = torch.float64
WORLD = 4

# ---------------------------------------------------------------- the object graph


_ATOMIC = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format, type, types.ModuleType, range, enum.Enum, types.BuiltinFunctionType)


def _reachable(root) -> dict[int, tuple[object, str]]:
    """``id -> (object, path)`` of everything reachable from ``root``: attributes, slots, containers, bound
    methods, partials and closures; partitions are reached but not entered (a copy shares them)."""
    seen: dict[int, tuple[object, str]] = {}
    stack = [(root, "copy")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, _ATOMIC) or id(obj) in seen:
            continue
        seen[id(obj)] = (obj, path)
        if isinstance(obj, (Partition, torch.Tensor)):
            continue
        if isinstance(obj, dict):
            kids = [(v, f"{path}[{k!r}]") for k, v in obj.items()] + [(k, f"{path}<key>") for k in obj]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            kids = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            kids = [(obj.__self__, f"{path}.__self__")]
        elif isinstance(obj, functools.partial):
            kids = [(obj.args, f"{path}.args"), (obj.keywords, f"{path}.keywords")]
        elif isinstance(obj, types.FunctionType):
            kids = [(c.cell_contents, f"{path}.<closure {i}>") for i, c in enumerate(obj.__closure__ or ())]
        else:
            kids = [(v, f"{path}.{k}") for k, v in getattr(obj, "__dict__", {}).items()]
            kids += [(getattr(obj, s), f"{path}.{s}") for cls in type(obj).__mro__
                     for s in getattr(cls, "__slots__", ()) if hasattr(obj, s)]
        stack.extend(kids)
    return seen


def _shared(original, copied) -> list[str]:
    """What the copy shares with the original beyond partitions and immutable values: objects and storages."""
    ro, rc = _reachable(original), _reachable(copied)
    out = []
    for key in set(ro) & set(rc):
        obj, path = rc[key]
        if isinstance(obj, (Partition, tuple, frozenset)) or (isinstance(obj, types.FunctionType)
                                                              and not obj.__closure__):
            continue  # partitions are shared on purpose; tuples and plain functions are values
        out.append(f"{type(obj).__name__} at {path}")
    storages = {t.untyped_storage().data_ptr() for t, _ in ro.values() if isinstance(t, torch.Tensor) and t.numel()}
    out += [f"tensor storage at {path}" for t, path in rc.values()
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() in storages]
    return sorted(out)


def _of_type(root, cls) -> list:
    return [obj for obj, _ in _reachable(root).values() if isinstance(obj, cls)]


def _site_records(root) -> list[tuple]:
    """Every agreement site's record, its state by identity: a call that touched it changes the record."""
    return sorted((id(s), s.op, id(s.state), s.signature, s.calls, s.slow_calls) for s in _of_type(root, AgreementSite))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_state_equal(what: str, m: nn.Module, snapshot: dict) -> None:
    now = _state(m)
    assert now.keys() == snapshot.keys(), (what, sorted(now), sorted(snapshot))
    for k, v in now.items():
        assert torch.equal(v, snapshot[k]), f"{what}: {k} changed"


def _close(what: str, got: torch.Tensor, ref: torch.Tensor, terms: int = TERMS, steps: int = 1) -> None:
    assert tuple(got.shape) == tuple(ref.shape), (what, tuple(got.shape), tuple(ref.shape))
    t = tol(F64, terms=terms, steps=steps)
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    torch.testing.assert_close(got, ref, rtol=t["rtol"], atol=t["atol"] * scale, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- every family


def _block(shape, P, seed: int, grad: bool = True, placeholder_grad: bool = False) -> torch.Tensor:
    """This worker's block of a global random tensor (the same on every rank), or a placeholder outside ``P``
    (``placeholder_grad``: one that requires grad, as a primitive's receivers pass)."""
    if not P.active:
        return zero_volume_tensor(dtype=F64, requires_grad=placeholder_grad)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return full[local_slices(shape, P.shape, P.index)].clone().requires_grad_(grad)


def _own(shape, P, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` of this worker's own (different on every rank), or a placeholder outside ``P``."""
    if not P.active:
        return zero_volume_tensor(dtype=F64)
    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return torch.randn(shape, generator=gen, dtype=F64).requires_grad_(True)


def _p4():
    return grid(range(4), (1, 1, 2, 2))


def _spatial(layer, shape=(2, 3, 7, 9), P=None):
    P = P or _p4()
    return layer, lambda s: (_block(shape, P, s),)


def _feature_conv():
    return _spatial(L.DistributedConv2d(_p4(), 3, 4, 3, padding=1, dtype=F64))


def _feature_conv_inactive():
    P = grid((0, 1, 2), (1, 1, 3, 1))  # world rank 3 is outside every partition of the model
    net = nn.Sequential(L.DistributedConv2d(P, 3, 4, 3, padding=1, dtype=F64),
                        L.DistributedBatchNorm2d(P, 4, dtype=F64), nn.ReLU(), L.DistributedMaxPool2d(P, 2))
    return _spatial(net, (2, 3, 8, 5), P)


def _channel_conv():
    P_x = grid((0, 1), (1, 2, 1))
    layer = L.DistributedConv1d(P_x, 4, 5, 3, padding=1, P_y=grid((2, 3), (1, 2, 1)), P_w=grid(range(4), (2, 2, 1)),
                                dtype=F64)
    return layer, lambda s: (_block((2, 4, 9), P_x, s),)


def _general_conv():
    P_x = grid(range(4), (1, 2, 2))
    layer = L.DistributedConv1d(P_x, 5, 3, 3, padding=2, dilation=2, P_y=grid((1, 0), (1, 1, 2)), P_w=P_x, dtype=F64)
    return layer, lambda s: (_block((2, 5, 13), P_x, s),)


def _linear_general():
    P_x = grid((0, 1), (1, 2))
    layer = L.DistributedLinear(P_x, grid((2, 3), (1, 2)), grid(range(4), (2, 2)), 7, 5, dtype=F64)
    return layer, lambda s: (_block((3, 7), P_x, s),)


def _linear_all_gather():
    P_seq = grid(range(4), (1, 4, 1))
    layer = L.DistributedLinearAllGather(grid(range(4), (1, 1, 4)), 8, 6, P_x=P_seq, dtype=F64)
    return layer, lambda s: (_block((2, 5, 8), P_seq, s),)


def _linear_reduce_scatter():
    P = grid(range(4), (1, 1, 4))
    layer = L.DistributedLinearReduceScatter(P, 9, 6, P_y=grid(range(4), (1, 4, 1)), dtype=F64)
    return layer, lambda s: (_block((2, 5, 9), P, s),)


def _zero(cls):
    P = grid(range(4), (2, 1, 2))  # ZeRO: the weight sharded over the 2 data-parallel workers too
    return cls(P, 9, 6, dtype=F64), lambda s: (_block((3, 4, 9), P, s),)


def _loss(layer, classes: bool):
    P = _p4()

    def inputs(s):
        x = _block((2, 5, 6, 7), P, s)
        if classes:
            labels = torch.randint(0, 5, (2, 6, 7), generator=torch.Generator().manual_seed(s + 1))
            sl = local_slices((2, 5, 6, 7), P.shape, P.index) if P.active else None
            return x, (labels[(sl[0],) + sl[2:]] if P.active else torch.empty(0, dtype=torch.long))
        return x, _block((2, 5, 6, 7), P, s + 1, grad=False)
    return layer, inputs


def _broadcast():
    P_x = grid((0,), (1, 1))
    return Broadcast(P_x, grid(range(4), (2, 2))), lambda s: (_block((3, 4), P_x, s, placeholder_grad=True),)


def _sum_reduce():
    P_x = grid(range(4), (2, 2))
    return SumReduce(P_x, grid((3,), (1, 1))), lambda s: (_own((3, 4), P_x, s),)


def _repartition():
    P_x = _p4()
    return Repartition(P_x, grid((1, 2, 3), (1, 1, 3, 1))), lambda s: (_block((2, 3, 7, 5), P_x, s),)


def _all_gather():
    P = grid(range(4), (2, 2))
    return AllGather(P, axes_all_gather=(1,)), lambda s: (_block((5, 7), P, s),)


def _reduce_scatter():
    P = grid(range(4), (2, 2))
    return ReduceScatter(P, axes_reduce_scatter=(1,)), lambda s: (_own((3, 7), P, s),)


def _all_sum_reduce():
    P = grid(range(4), (2, 2))
    return AllSumReduce(P, axes_reduce=(0,)), lambda s: (_own((3, 4), P, s),)


FAMILIES = {
    "feature-conv2d-uneven": _feature_conv,
    "conv-bn-pool-inactive": _feature_conv_inactive,
    "channel-conv1d-disjoint-xy": _channel_conv,
    "general-conv1d": _general_conv,
    "conv-transpose2d": lambda: _spatial(L.DistributedConvTranspose2d(_p4(), 3, 4, 2, stride=2, dtype=F64)),
    "maxpool2d": lambda: _spatial(L.DistributedMaxPool2d(_p4(), 2)),
    "avgpool2d": lambda: _spatial(L.DistributedAvgPool2d(_p4(), 3, stride=2, padding=1)),
    "upsample-bilinear": lambda: _spatial(L.DistributedUpsample(_p4(), scale_factor=2, mode="bilinear")),
    "batchnorm2d": lambda: _spatial(L.DistributedBatchNorm2d(_p4(), 3, dtype=F64)),
    "groupnorm": lambda: _spatial(L.DistributedGroupNorm(_p4(), 1, 3, dtype=F64)),
    "instancenorm2d-stats": lambda: _spatial(L.DistributedInstanceNorm2d(_p4(), 3, affine=True,
                                                                         track_running_stats=True, dtype=F64)),
    "layernorm": lambda: _spatial(L.DistributedLayerNorm(_p4(), [7, 9], dtype=F64)),
    "linear-general-disjoint-xy": _linear_general,
    "linear-all-gather-seq": _linear_all_gather,
    "linear-reduce-scatter-seq": _linear_reduce_scatter,
    "linear-all-gather-zero": lambda: _zero(L.DistributedLinearAllGatherZero),
    "linear-reduce-scatter-zero": lambda: _zero(L.DistributedLinearReduceScatterZero),
    "mse-loss": lambda: _loss(L.DistributedMSELoss(_p4()), classes=False),
    "cross-entropy-loss": lambda: _loss(L.DistributedCrossEntropyLoss(_p4(), weight=torch.rand(5, dtype=F64) + 0.5),
                                        classes=True),
    "broadcast": _broadcast,
    "sum-reduce": _sum_reduce,
    "repartition-inactive": _repartition,
    "all-gather": _all_gather,
    "reduce-scatter": _reduce_scatter,
    "all-sum-reduce": _all_sum_reduce,
    "halo-exchange": lambda: _spatial(HaloExchange(_p4(), 3, padding=1)),
}


def _run(m: nn.Module, inputs, step: int) -> tuple[torch.Tensor, list, dict]:
    """Forward and backward on step ``step``'s inputs: ``(output, input gradients, parameter gradients)``."""
    xs = inputs(step)
    y = m(*xs)
    if y.requires_grad:
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(500 + step + 10 * dist.get_rank()),
                               dtype=y.dtype))
    return (y.detach(), [x.grad for x in xs if x.requires_grad],
            {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})


def _sgd(m: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
    m.zero_grad(set_to_none=True)


def copy_protocol(name: str) -> dict:
    """The protocol of the module docstring on one family; returns what this rank saw."""
    torch.manual_seed(11)
    original, inputs = FAMILIES[name]()
    _run(original, inputs, 0)  # the original has agreed on its calls before it is copied
    _sgd(original, 0.1)
    sites_before = _site_records(original)
    twin = copy.deepcopy(original)

    # Shares its partitions and nothing else.
    parts = {id(p) for p in _of_type(original, Partition)}
    assert parts and {id(p) for p in _of_type(twin, Partition)} == parts
    assert _shared(original, twin) == []
    # Its own agreement sites, all fresh, and its own handles.
    sites = _of_type(twin, AgreementSite)
    assert all(s.fresh and s.calls == s.slow_calls == 0 for s in sites), [(s.op, s.calls) for s in sites]
    owners = _of_type(twin, HandleOwner)
    assert all(lookup(o.handle) is o for o in owners)
    assert not {o.handle for o in owners} & {o.handle for o in _of_type(original, HandleOwner)}
    assert _site_records(original) == sites_before
    before = _state(original)
    _assert_state_equal("copy after deepcopy", twin, before)

    # The copy's first call re-agrees through the slow path; the original's records stay as they were.
    y_c, dx_c, g_c = _run(twin, inputs, 1)
    used = [s for s in sites if s.calls]
    assert all(s.slow_calls >= 1 for s in used), [(s.op, s.calls, s.slow_calls) for s in used]
    assert _site_records(original) == sites_before
    _assert_state_equal("original after the copy's call", original, before)
    _sgd(twin, 0.1)
    _assert_state_equal("original after the copy's step", original, before)

    # The original computes what the copy did, and leaves the copy alone.
    twin_sites, twin_state = _site_records(twin), _state(twin)
    y_o, dx_o, g_o = _run(original, inputs, 1)
    _close(f"{name}: output", y_c, y_o)
    assert len(dx_c) == len(dx_o) and g_c.keys() == g_o.keys()
    for i, (a, b) in enumerate(zip(dx_c, dx_o, strict=True)):
        assert (a is None) == (b is None), (name, i)
        if a is not None:
            _close(f"{name}: input gradient {i}", a, b)
    for k in g_o:
        _close(f"{name}: {k} gradient", g_c[k], g_o[k])
    _sgd(original, 0.3)
    assert _site_records(twin) == twin_sites
    _assert_state_equal("copy after the original's step", twin, twin_state)
    return dict(sites=len(sites), used=len(used), handles=len(owners), params=len(g_o))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_copy_shares_partitions_owns_state_and_trains_alone(name):
    seen = run_ranks(WORLD, copy_protocol, name)
    assert any(s["sites"] for s in seen), "the copy holds no agreement site: the check proved nothing"
    assert any(s["used"] for s in seen)


def _teeth() -> list[str]:
    """A shallow copy shares everything: the graph check must say so."""
    layer = L.DistributedConv2d(_p4(), 3, 4, 3, padding=1, dtype=F64)
    return _shared(layer, copy.copy(layer))


def test_the_sharing_check_catches_a_shallow_copy():
    seen = run_ranks(WORLD, _teeth)
    assert all(any("AgreementSite" in f for f in found) for found in seen), seen
    assert any(any("tensor storage" in f for f in found) for found in seen), seen  # the weights live on rank 0


# ---------------------------------------------------------------- what a copy starts without


def _linear_contexts() -> dict:
    """A linear's agreement (its session's record of the eager call) does not follow it into a copy; the contexts
    its ops name by handle get fresh handles and point at the copy's session; a fused call's plans stay behind."""
    layer, inputs = _linear_all_gather()
    _run(layer, inputs, 0)
    owners = [layer._rows_ctx, layer.session.flag, layer._grid_flag, layer._form_call,
              *(bc._move for bc, _ in layer.params.sends)]
    handles = {o.handle for o in owners}
    call = layer._form_call
    call.plans[("a signature",)] = (threading.Lock(),)  # what a compiled fused call keeps: not copyable
    assert layer.session._remembered and layer.agreement.state is not None
    twin = copy.deepcopy(layer)
    assert twin.agreement.fresh and not twin.session._remembered, vars(twin.session)
    copies = [twin._rows_ctx, twin.session.flag, twin._grid_flag, twin._form_call,
              *(bc._move for bc, _ in twin.params.sends)]
    assert all(lookup(c.handle) is c and c.handle not in handles for c in copies)
    assert twin._rows_ctx.on_flag.__self__ is twin.session and twin.session.site is twin.agreement
    twin.session.flag.on_flag()  # forgets the copy's agreement, not the original's
    twin._rows_ctx.on_flag()
    assert layer.agreement.state is not None and layer.session._remembered
    assert twin._form_call.plans == {} and call.plans
    call_copy = copy.deepcopy(call)
    assert call_copy.plans == {} and call.plans and lookup(call_copy.handle) is call_copy
    return {"ok": True}


def test_a_copy_starts_without_records_or_compiled_contexts():
    run_ranks(WORLD, _linear_contexts)


def test_new_handle_refuses_objects_that_copies_would_alias():
    class Plain:
        pass

    with pytest.raises(TypeError, match="HandleOwner"):
        new_handle(Plain())


# ---------------------------------------------------------------- pickling refuses, by name


def _pickling() -> dict:
    model, _ = _feature_conv_inactive()
    out = {}
    for how, save in (("pickle", lambda: pickle.dumps(model)), ("torch.save", lambda: torch.save(model, io.BytesIO()))):
        try:
            save()
            out[how] = None
        except NotPicklableError as exc:
            out[how] = (isinstance(exc, TypeError), str(exc))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # the state is what travels
    buf.seek(0)
    model.load_state_dict(torch.load(buf, weights_only=True))
    return out


def test_pickling_a_model_refuses_naming_the_partition():
    for rank, out in enumerate(run_ranks(WORLD, _pickling)):
        for how in ("pickle", "torch.save"):
            assert out[how] is not None, f"rank {rank}: {how} pickled a model with process groups"
            is_type_error, msg = out[how]
            assert is_type_error and "cannot pickle CartesianPartition(" in msg and "process groups" in msg, msg
            assert "state_dict" in msg and "deepcopy" in msg, msg


# ---------------------------------------------------------------- AveragedModel against torch's


def _net(make) -> nn.Sequential:
    """U-Net pieces: conv, batch norm, pooling across the blocks' edges, transposed conv back up.  SiLU, not ReLU:
    the trained state must be a continuous function of the rounding to be within a rounding bound of the twin's."""
    return nn.Sequential(make.Conv2d(3, 4, 3, padding=1), make.BatchNorm2d(4), nn.SiLU(), make.MaxPool2d(2),
                         make.ConvTranspose2d(4, 2, 2, stride=2))


SHAPE, OUT_SHAPE = (2, 3, 10, 9), (2, 2, 10, 8)  # 9 columns over 2 workers: blocks of 5 and 4
STEPS = 3
# The longest sums behind the trained state: the loss's mean over the 2 * 2 * 10 * 8 = 320 outputs (the conv's
# weight gradient and the batch norm's statistics sum 2 * 10 * 9 = 180 terms).
NET_TERMS = 320


def _data(step: int):
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(SHAPE, generator=gen, dtype=F64), torch.randn(OUT_SHAPE, generator=gen, dtype=F64)


def averaged(kind: str) -> dict | None:
    from distfuse.demo_unet import Distributed

    kw = {"swa": {}, "ema-buffers": {"multi_avg_fn": get_ema_multi_avg_fn(0.75), "use_buffers": True}}[kind]
    P = _p4()
    rank = dist.get_rank()
    torch.manual_seed(3)
    ref = _net(nn).to(F64)
    model = _net(Distributed(P)).to(F64)
    load_sequential(model, ref if rank == 0 else None)
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    avg_ref, avg = AveragedModel(ref, **kw), AveragedModel(model, **kw)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = make_optimizer(torch.optim.SGD, model, lr=0.2)
    loss_ref, loss = nn.MSELoss(), L.DistributedMSELoss(P)
    sl_in, sl_out = local_slices(SHAPE, P.shape, P.index), local_slices(OUT_SHAPE, P.shape, P.index)
    for step in range(STEPS):
        x, t = _data(step)
        opt_ref.zero_grad()
        want = loss_ref(ref(x), t)
        want.backward()
        opt_ref.step()
        avg_ref.update_parameters(ref)
        opt.zero_grad()
        got = loss(model(x[sl_in]), t[sl_out])
        got.backward()
        opt.step()
        avg.update_parameters(model)
        # the loss of step s is computed on the state after s steps: s + 1 steps of rounding
        _close(f"{kind}: step {step} loss", got.detach(), want.detach(), NET_TERMS, step + 1)
    assert int(avg.n_averaged) == int(avg_ref.n_averaged) == STEPS
    avg.eval()
    avg_ref.eval()
    x, _ = _data(9)
    with torch.no_grad():
        y = collect_tensor(avg(x[sl_in]), P)
        y_ref = avg_ref(x)
    state, trained = collect_sequential(avg.module), collect_sequential(model)
    if rank != 0:
        return None
    _close(f"{kind}: averaged model's output", y, y_ref, NET_TERMS, STEPS + 1)
    want_state = avg_ref.module.state_dict()
    assert state.keys() == want_state.keys(), (sorted(state), sorted(want_state))
    # the average never wrote into the model it averages: both states against their twins, on each layer's scales
    for what, got_state, ref_state in (("averaged", state, want_state), ("trained", trained, ref.state_dict())):
        worst = compare_state(got_state, ref_state, F64, NET_TERMS, STEPS, start=start)
        assert worst.ok, f"{kind}: {what} {worst.key} off by {worst.error:.2e}, over {worst.allowed:.2e}"
    moved = max(float((want_state[k] - ref.state_dict()[k]).abs().max()) for k in want_state
                if want_state[k].is_floating_point())
    return {"moved": moved}


@pytest.mark.parametrize("kind", ["swa", "ema-buffers"])
def test_averaged_model_matches_torch_over_the_sequential_twin(kind):
    out = run_ranks(WORLD, averaged, kind)[0]
    assert out["moved"] > 1e-3, "the average equals the trained model: the test would not see a wrong average"
