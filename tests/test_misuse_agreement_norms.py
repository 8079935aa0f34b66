"""Misuse and steady state of the distributed norms and losses under the agreement protocol.

The norms (batch, group, instance, layer) and the losses agree on every call's metadata
(:mod:`distfuse.primitives._agreement`).  Asserted here, on 5 ranks: ``P_x`` over the
permuted world ranks ``(2, 0, 3, 1)``, world rank 4 outside it (zero-volume in and out);
the world group keeps torch's default timeout and the partitions ``DISTFUSE_TIMEOUT=60``:

* while every worker's call repeats, no metadata gather runs (``gather_call`` counted,
  ``agreement.slow_calls`` stays put).  The norms pay one flag round per call (a
  one-element host all-reduce over ``P_x``); the losses with ``sum``/``mean`` on CPU pay
  nothing extra (the flag rides in their reduction); ``reduction='none'`` and the host
  transport (the CUDA default, forced here) pay the flag round;
* a legitimate change of global shape on every worker (an extent of 7 becoming 8 over two
  workers, so half the workers' blocks repeat) agrees again, and forward, input gradient,
  weight and bias gradients and running statistics match float64 ``torch.nn`` on the
  gathered tensors, in fp32 and in bf16;
* a worker that disagrees (fp16 against bf16, int64, another batch count, a block that is
  not the balanced one, eval mode against training mode, a target of another shape) makes
  every worker of ``P_x`` raise the same named ``ShapeError`` within 5 s (the flag, not a
  timeout), and the layer agrees again on the next good call;
* the losses' value errors found by torch's local op (a class index out of range, a BCE
  probability outside [0, 1]) raise on every worker with ``mean``/``sum`` without any
  metadata gather (the failure flags ride in the reduction) and leave the agreement
  settled; with ``reduction='none'`` only the worker with the bad block raises, and the next
  call works everywhere (the sites stay in lockstep).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import _norm_common, loss
from distfuse.layers._params import load_sequential
from distfuse.layers.loss import DistributedBCELoss, DistributedMSELoss
from distfuse.layers.loss_class import DistributedCrossEntropyLoss
from distfuse.layers.norm_batch import DistributedBatchNorm2d
from distfuse.layers.norm_group import DistributedGroupNorm, DistributedInstanceNorm2d, DistributedLayerNorm
from distfuse.primitives import _agreement, agreement_session
from distfuse.primitives._agreement import capture_safe
from distfuse.primitives._flag_transport import flag_transport
from distfuse.testing import run_ranks
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
PROMPT = 5.0  # seconds: far below DISTFUSE_TIMEOUT=60
RANKS = (2, 0, 3, 1)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
_GRIDS: dict = {}


def _grid(shape):
    """``P_x`` over ``RANKS`` whose groups wait ``DISTFUSE_TIMEOUT=60`` (cached: creation is collective)."""
    key = tuple(shape)
    if key not in _GRIDS:
        os.environ["DISTFUSE_TIMEOUT"] = "60"
        if "world" not in _GRIDS:
            _GRIDS["world"] = Partition.world()
        _GRIDS[key] = _GRIDS["world"].create_partition_inclusive(list(RANKS)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


class _Counts:
    """Counts the metadata gathers of the norms and losses and the host flag rounds, while active."""

    MODULES = (_norm_common, loss)  # the modules whose code calls gather_call
    ROUNDS = (_agreement, agreement_session)  # the modules whose code calls flag_round

    def __enter__(self):
        self.gathers = self.rounds = 0
        self._saved = [(m, m.gather_call) for m in self.MODULES] + [(m, m.flag_round) for m in self.ROUNDS]

        def gather(*args, _orig=_norm_common.gather_call, **kwargs):
            self.gathers += 1
            return _orig(*args, **kwargs)

        def flag_round(*args, _orig=_agreement.flag_round, **kwargs):
            self.rounds += 1
            return _orig(*args, **kwargs)

        for m in self.MODULES:
            m.gather_call = gather
        for m in self.ROUNDS:
            m.flag_round = flag_round
        return self

    def __exit__(self, *exc):
        for m, fn in self._saved:
            if m in self.ROUNDS:
                m.flag_round = fn
            else:
                m.gather_call = fn

    def take(self) -> tuple[int, int]:
        out = (self.gathers, self.rounds)
        self.gathers = self.rounds = 0
        return out


def _catch(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok",)
    except Exception as exc:  # noqa: BLE001 - the test inspects every kind
        return type(exc).__name__, str(exc), time.monotonic() - t0


def _rand(shape, seed, offset=0.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64) + offset


# ---------------------------------------------------------------- norms


NORMS = {  # name: (global shape with the 7, P_x shape, distributed layer, torch layer, keyword arguments)
    "bn": ((3, 3, 7, 5), (2, 1, 2, 1), DistributedBatchNorm2d, nn.BatchNorm2d, (3,), {}),
    "gn": ((3, 4, 7, 5), (2, 1, 2, 1), DistributedGroupNorm, nn.GroupNorm, (2, 4), {}),
    "in": ((3, 3, 7, 5), (2, 1, 2, 1), DistributedInstanceNorm2d, nn.InstanceNorm2d, (3,),
           {"affine": True, "track_running_stats": True}),
    "ln": ((3, 7, 6), (1, 2, 2), DistributedLayerNorm, nn.LayerNorm, (6,), {}),
}
OPS = {"bn": "DistributedBatchNorm2d", "gn": "DistributedGroupNorm", "in": "DistributedInstanceNorm2d",
       "ln": "DistributedLayerNorm", "mse": "DistributedMSELoss", "ce": "DistributedCrossEntropyLoss",
       "bce-sum-host": "DistributedBCELoss", "bce-none": "DistributedBCELoss"}


def _with(shape, extent):
    """``shape`` with its 7 (the extent split over two workers) replaced."""
    return tuple(extent if n == 7 else n for n in shape)


def _norm_layers(name):
    shape, grid_shape, dist_cls, torch_cls, args, kwargs = NORMS[name]
    P = _grid(grid_shape)
    torch.manual_seed(11)  # every rank builds the same reference
    ref32 = torch_cls(*args, **kwargs)
    with torch.no_grad():
        for t in (getattr(ref32, n, None) for n in ("weight", "bias", "running_mean")):
            if t is not None:
                t.copy_(torch.randn_like(t))
        if getattr(ref32, "running_var", None) is not None:
            ref32.running_var.copy_(torch.rand_like(ref32.running_var) + 0.5)
    layer = dist_cls(P, *args, **kwargs)  # parameters in fp32: bf16 inputs are then legitimate, as in torch
    load_sequential(layer, ref32 if dist.get_rank() == 0 else None)
    return P, layer, copy.deepcopy(ref32).double()


def _norm_call(P, layer, ref, shape, seed, dtype=F32) -> bool:
    """One training call on fresh blocks of a global ``shape``: forward, every gradient, running statistics."""
    if not P.active:
        return layer(zero_volume_tensor(dtype=dtype)).numel() == 0
    xg = _rand(shape, seed, offset=2.0).to(dtype)
    sl = local_slices(xg.shape, P.shape, P.index)
    x = xg[sl].clone().requires_grad_(True)
    y = layer(x)
    xr = xg.double().requires_grad_(True)
    ref.zero_grad()
    yr = ref(xr)
    gy = _rand(yr.shape, seed + 1).to(dtype).double()
    yr.backward(gy)
    y.backward(gy[sl].to(y.dtype))
    t = tol(dtype)
    torch.testing.assert_close(y.double(), yr.detach()[sl], **t)
    torch.testing.assert_close(x.grad.double(), xr.grad[sl], **t)
    feat = local_slices(ref.weight.shape, P.shape[-ref.weight.dim():], P.index[-ref.weight.dim():]) \
        if isinstance(layer, DistributedLayerNorm) else (slice(None),)
    for n in ("weight", "bias"):
        torch.testing.assert_close(getattr(layer, n).grad.double(), getattr(ref, n).grad[feat], **t)
    for n in ("running_mean", "running_var"):
        if getattr(layer, n, None) is not None:
            torch.testing.assert_close(getattr(layer, n).double(), getattr(ref, n), **tol(F32))
    layer.zero_grad()
    return True


def _norm_bad(P, shape, how):
    """This worker's block of a call that is bad on world rank 3 only: the other workers repeat the signature of
    the call before (fp32, or bf16 for ``fp16``; requiring grad), so only the flag can tell them."""
    if not P.active:
        return zero_volume_tensor(dtype=BF16 if how == "fp16" else F32)
    x = _rand(shape, 40)[local_slices(shape, P.shape, P.index)].to(BF16 if how == "fp16" else F32).clone()
    if dist.get_rank() != 3 or how == "same":
        return x.requires_grad_(True)
    if how == "fp16":
        return x.half().requires_grad_(True)
    if how == "int64":
        return x.long()
    if how == "rows":  # another batch count
        return torch.cat([x, x[:1]]).requires_grad_(True)
    return x[..., :-1].clone().requires_grad_(True)  # "unbalanced": one element fewer along the last axis


def _norm_scenario(name):
    me = dist.get_rank()
    P, layer, ref = _norm_layers(name)
    shape = NORMS[name][0]
    s7, s8 = shape, _with(shape, 8)
    out = {}
    with _Counts() as counts:
        out["steady"] = all(_norm_call(P, layer, ref, s7, seed) for seed in (1, 2, 3))
        out["steady_counts"] = counts.take()
        site = layer.agreement if P.active else None
        out["slow_steady"] = site.slow_calls if site else None
        out["change"] = all(_norm_call(P, layer, ref, s8, seed) for seed in (4, 5))  # 7 -> 8: half the blocks repeat
        out["change_counts"] = counts.take()
        out["bf16"] = _norm_call(P, layer, ref, s8, 6, BF16)
        counts.take()
        for how in ("fp16", "int64", "rows", "unbalanced"):
            out[how] = _catch(lambda h=how: layer(_norm_bad(P, s8, h)))
            out[how + "_again"] = _norm_call(P, layer, ref, s8, 7)
        if name in ("bn", "in"):  # training on three workers, eval on one
            layer.train(me != 3)
            out["mode"] = _catch(lambda: layer(_norm_bad(P, s8, "same")))
            layer.train(True)
            out["mode_again"] = _norm_call(P, layer, ref, s8, 8)
        counts.take()
        out["end"] = all(_norm_call(P, layer, ref, s8, seed) for seed in (9, 10))
        out["end_counts"] = counts.take()
    return out


@pytest.mark.parametrize("name", list(NORMS))
def test_norm_gathers_only_on_change_and_raises_everywhere(name):
    res = run_ranks(5, _norm_scenario, name, pg_timeout=PG_DEFAULT, timeout=120)
    assert res[4]["steady"] and res[4]["change"] and res[4]["end"]  # outside P_x: zero-volume in and out
    assert res[4]["steady_counts"] == (0, 0)
    for r in RANKS:
        out = res[r]
        assert out["steady"] and out["change"] and out["bf16"] and out["end"], out
        assert out["slow_steady"] == 1, out  # three calls, one metadata gather
        assert out["steady_counts"] == (1, 2), out  # (gathers, flag rounds): the first call gathers
        assert out["change_counts"] == (1, 2), out  # the change (seen by the workers whose block repeats) gathers
        assert out["end_counts"] == (0, 2), out  # steady again after the errors and the calls that re-agreed
        cases = {"fp16": "one input dtype", "int64": "one input dtype", "rows": "balanced decomposition",
                 "unbalanced": "balanced decomposition"}
        if name in ("bn", "in"):
            cases["mode"] = "all be in training mode or all in eval mode"
        for key, fragment in cases.items():
            kind, msg, secs = out[key]
            assert kind == "ShapeError" and fragment in msg, (r, key, out[key])
            assert f"{OPS[name]} [rank {r}]" in msg, (r, key, msg)
            assert secs < PROMPT, (r, key, secs)
            assert out[key + "_again"], (r, key)


# ---------------------------------------------------------------- losses


LOSS_SHAPE = (3, 4, 7, 5)
LOSS_GRID = (2, 1, 2, 1)


def _loss_layers(name):
    P = _grid(LOSS_GRID)
    if name == "mse":
        return P, DistributedMSELoss(P), nn.MSELoss()
    if name == "ce":  # the mean's divisor is a global sum: the targets not ignored (a weight would refuse bf16)
        return P, DistributedCrossEntropyLoss(P, ignore_index=1), nn.CrossEntropyLoss(ignore_index=1)
    reduction = "none" if name == "bce-none" else "sum"
    return P, DistributedBCELoss(P, reduction=reduction), nn.BCELoss(reduction=reduction)


def _loss_data(name, shape, seed, dtype=F32):
    x = _rand(shape, seed)
    if name == "ce":
        t = torch.randint(0, shape[1], shape[:1] + shape[2:], generator=torch.Generator().manual_seed(seed + 1))
        return x.to(dtype), t
    if name.startswith("bce"):
        return x.sigmoid().to(dtype), _rand(shape, seed + 1).sigmoid().to(dtype)
    return x.to(dtype), _rand(shape, seed + 1).to(dtype)


def _target_slices(name, P, shape):
    sl = local_slices(shape, P.shape, P.index)
    return sl[:1] + sl[2:] if name == "ce" else sl


def _loss_call(name, P, layer, ref, shape, seed, dtype=F32) -> bool:
    """One call on fresh blocks of a global ``shape``: the loss and the input gradient against float64 torch."""
    if not P.active:
        z = zero_volume_tensor(dtype=dtype)
        return layer(z, z).numel() == 0
    xg, tg = _loss_data(name, shape, seed, dtype)
    sl, tsl = local_slices(shape, P.shape, P.index), _target_slices(name, P, shape)
    x = xg[sl].clone().requires_grad_(True)
    y = layer(x, tg[tsl])
    xr = xg.double().requires_grad_(True)
    yr = ref(xr, tg.double() if tg.is_floating_point() else tg)
    t = tol(dtype)
    if name == "bce-none":
        gy = _rand(yr.shape, seed + 2).to(dtype).double()
        yr.backward(gy)
        y.backward(gy[sl].to(y.dtype))
        torch.testing.assert_close(y.double(), yr.detach()[sl], **t)
    else:
        yr.backward()
        y.backward()
        torch.testing.assert_close(y.double(), yr.detach(), **t)
    torch.testing.assert_close(x.grad.double(), xr.grad[sl], **t)
    return True


def _loss_bad(name, P, shape, how):
    """This worker's (input, target) of a call that is bad on world rank 3."""
    if not P.active:
        z = zero_volume_tensor(dtype=F32)
        return z, z
    xg, tg = _loss_data(name, shape, 50)
    x, t = xg[local_slices(shape, P.shape, P.index)].clone(), tg[_target_slices(name, P, shape)]
    if how == "fp16":  # the other workers repeat the bf16 call before
        x, t = x.bfloat16(), t if name == "ce" else t.bfloat16()
    x = x.requires_grad_(True)
    if dist.get_rank() != 3:
        return x, t
    if how == "fp16":
        return x.detach().half(), t if name == "ce" else t.half()
    if how == "int64":
        return x.long(), t
    if how == "rows":
        return torch.cat([x, x[:1]]), torch.cat([t, t[:1]])
    if how == "target":  # a target block of another shape
        return x, t[..., :-1]
    if how == "value":  # torch's own op refuses it: a class index out of range, a probability above 1
        t = t.clone()
        if name == "ce":
            t.view(-1)[0] = 9
            return x, t
        return x * 3 + 1, t
    return x[..., :-1], t[..., :-1]  # "unbalanced"


def _loss_scenario(name):
    P, layer, ref = _loss_layers(name)
    s7, s8 = LOSS_SHAPE, _with(LOSS_SHAPE, 8)
    out = {}
    with flag_transport("host" if name == "bce-sum-host" else "auto"), _Counts() as counts:
        out["steady"] = all(_loss_call(name, P, layer, ref, s7, seed) for seed in (1, 2, 3))
        out["steady_counts"] = counts.take()
        site = layer.agreement if P.active else None
        out["slow_steady"] = site.slow_calls if site else None
        out["change"] = all(_loss_call(name, P, layer, ref, s8, seed) for seed in (4, 5))
        out["change_counts"] = counts.take()
        out["settled"] = _loss_call(name, P, layer, ref, s8, 7)
        counts.take()
        if name != "mse":  # torch's MSE refuses no value
            slow_before = site.slow_calls if site else None
            out["value"] = _catch(lambda: layer(*_loss_bad(name, P, s8, "value")))
            out["value_counts"] = counts.take()
            out["value_slow"] = (site.slow_calls - slow_before) if site else None
            out["value_again"] = _loss_call(name, P, layer, ref, s8, 8)
            out["value_again_counts"] = counts.take()
        for how in ("fp16", "int64", "rows", "target", "unbalanced"):
            if how == "fp16":
                out["bf16"] = _loss_call(name, P, layer, ref, s8, 6, BF16)
            out[how] = _catch(lambda h=how: layer(*_loss_bad(name, P, s8, h)))
            out[how + "_again"] = _loss_call(name, P, layer, ref, s8, 9)
        counts.take()
        out["end"] = all(_loss_call(name, P, layer, ref, s8, seed) for seed in (10, 11))
        out["end_counts"] = counts.take()
    return out


LOSS_CASES = {  # name: (flag rounds per steady call, errors' fragments)
    "mse": (0, {}),  # mean, the flag in the reduction
    "ce": (0, {"target": "without the class dimension"}),  # mean over a summed divisor, the flag in the reduction
    "bce-sum-host": (1, {}),  # the host transport (the CUDA default) forced on CPU: a flag round first
    "bce-none": (1, {}),  # no collective: a flag round
}


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_loss_gathers_only_on_change_and_raises_everywhere(name):
    res = run_ranks(5, _loss_scenario, name, pg_timeout=PG_DEFAULT, timeout=120)
    rounds, special = LOSS_CASES[name]
    assert res[4]["steady"] and res[4]["change"] and res[4]["end"] and res[4]["steady_counts"] == (0, 0)
    for r in RANKS:
        out = res[r]
        assert out["steady"] and out["change"] and out["bf16"] and out["settled"] and out["end"], out
        assert out["slow_steady"] == 1, out
        assert out["steady_counts"] == (1, 2 * rounds), out  # the first call gathers; then flags only
        assert out["change_counts"] == (1, 2 * rounds), out
        assert out["end_counts"] == (0, 2 * rounds), out
        cases = {"fp16": "one input dtype", "int64": "one input dtype", "rows": "balanced decomposition",
                 "target": "target block shape", "unbalanced": "balanced decomposition", **special}
        for key, fragment in cases.items():
            kind, msg, secs = out[key]
            assert kind == "ShapeError" and fragment in msg, (r, key, out[key])
            assert f"{OPS[name]} [rank {r}]" in msg, (r, key, msg)
            assert secs < PROMPT, (r, key, secs)
            assert out[key + "_again"], (r, key)
        if name == "mse":
            continue
        # torch's refusal of a bad value: no metadata gather, the agreement stays settled
        assert out["value_slow"] == 0 and out["value_counts"] == (0, rounds), out
        assert out["value_again"] and out["value_again_counts"] == (0, rounds), out
        if name == "bce-none":  # no collective follows: world rank 3 alone raises, nobody waits for it
            assert (out["value"][0] == "ShapeError") == (r == 3), (r, out["value"])
        else:
            kind, msg, secs = out["value"]
            assert kind == "ShapeError" and "refused" in msg and secs < PROMPT, (r, out["value"])
            assert ("this worker's block" if r == 3 else "world ranks [3]") in msg, (r, msg)


# ---------------------------------------------------------------- one worker


def _single_worker():
    """A partition of one worker: the flag round is its own flag (no message), the change still agrees."""
    P = Partition.world().create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1, 1, 1])
    bn, loss = DistributedBatchNorm2d(P, 3), DistributedMSELoss(P)
    ref_bn, ref_loss = nn.BatchNorm2d(3, dtype=F64), nn.MSELoss()
    outs = []
    for seed, n in ((1, 7), (2, 7), (3, 8)):
        x = _rand((2, 3, n, 4), seed).float().requires_grad_(True)
        tgt = _rand((2, 3, n, 4), seed + 1).float()
        lo = loss(bn(x), tgt)
        xr = x.detach().double().requires_grad_(True)
        lr = ref_loss(ref_bn(xr), tgt.double())
        lo.backward()
        lr.backward()
        torch.testing.assert_close(lo.double(), lr.detach(), **tol(F32))
        torch.testing.assert_close(x.grad.double(), xr.grad, **tol(F32))
        torch.testing.assert_close(bn.running_var.double(), ref_bn.running_var, **tol(F32))
        outs.append((bn.agreement.slow_calls, loss.agreement.slow_calls))
    return outs


def test_single_worker_partition_agrees_without_messages():
    res = run_ranks(1, _single_worker)
    assert res[0] == [(1, 1), (1, 1), (2, 2)], res  # the 7 -> 8 change gathers once more


# ---------------------------------------------------------------- capture_safe


def _capture_safe():
    """Inside ``capture_safe()`` a settled record is trusted: no flag round, no gather; a changed call is refused."""
    P, bn, ref = _norm_layers("bn")
    loss, ref_loss = DistributedMSELoss(P), nn.MSELoss()
    shape = NORMS["bn"][0]
    out = {"eager": _norm_call(P, bn, ref, shape, 1) and _loss_call("mse", P, loss, ref_loss, shape, 2)}
    with _Counts() as counts, capture_safe():
        out["trusted"] = _norm_call(P, bn, ref, shape, 3) and _loss_call("mse", P, loss, ref_loss, shape, 4)
        out["trusted_counts"] = counts.take()
        other = shape[:-1] + (shape[-1] + 1,)  # every worker's block changes: each refuses locally, nobody waits
        xb = _rand(other, 5).float()[local_slices(other, P.shape, P.index)] if P.active else zero_volume_tensor()
        out["bn_changed"] = _catch(lambda: bn(xb.requires_grad_(True)))
        out["loss_changed"] = _catch(lambda: loss(xb, xb))
    return out


def test_capture_safe_trusts_the_settled_record():
    res = run_ranks(5, _capture_safe, pg_timeout=PG_DEFAULT, timeout=120)
    for r in RANKS:
        out = res[r]
        assert out["eager"] and out["trusted"] and out["trusted_counts"] == (0, 0), out
        for key in ("bn_changed", "loss_changed"):
            assert out[key][0] == "UnsupportedError" and "capture_safe()" in out[key][1], (r, out[key])
    assert res[4]["trusted_counts"] == (0, 0) and res[4]["bn_changed"] == ("ok",)
