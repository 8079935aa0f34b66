"""torch.compile(fullgraph=True) of the distributed norms and losses: no graph break, eager's results.

The norms' communication runs as custom ops (``distfuse::flag_check``, ``distfuse::moments``,
``distfuse::normalize`` and its backward, ``distfuse::replicate`` and its adjoint
``distfuse::replicate_adjoint``, the sum over a sub-grid), the losses' as
``distfuse::replicate_adjoint`` with ``distfuse::loss_flags`` (the agreement flag in the
reduction) or, with ``reduction='none'``, ``distfuse::flag_check``; the metadata agreement
comes from one eager call.

Checked on gloo ranks with AOT autograd (``aot_eager``'s compilers, recording the forward
and backward graphs): zero graph breaks on every rank (``torch._dynamo.explain``), the same
sequence of distfuse ops in every rank's forward and backward graphs, the output, the input
gradients, the weight and bias gradients and the running statistics bitwise equal to the
eager layers and close to the float64 ``torch.nn`` layers on the gathered tensors (uneven
splits, permuted ranks, inactive ranks in a world of 6, bf16, train and eval modes), a
compiled call before any eager call refused on every rank, and a changed call under the
compiled layer raising the same error on every rank (no hang), working again after an
eager call.  The first compiled call's time is returned per case (``-s`` does not print it;
the report of the numbers is in ``docs/design.md``).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

from distfuse import zero_volume_tensor
from distfuse.errors import ShapeError
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import load_sequential
from distfuse.layers.loss import (
    DistributedBCELoss,
    DistributedBCEWithLogitsLoss,
    DistributedKLDivLoss,
    DistributedL1Loss,
    DistributedMSELoss,
)
from distfuse.layers.loss_class import DistributedCrossEntropyLoss, DistributedNLLLoss
from distfuse.layers.norm_batch import DistributedBatchNorm2d
from distfuse.layers.norm_group import DistributedGroupNorm, DistributedInstanceNorm2d, DistributedLayerNorm
from distfuse.testing import run_ranks
from tests.misuse_support import catch, patient_grid, tracing_refusal
from tests.test_conv_support import grid
from tests.tolerances import tol


def _distfuse_ops(graphs) -> list[str]:
    """The distfuse ops of the recorded graphs in order (effectful ops sit inside ``with_effects``)."""
    out = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            if "with_effects" in name:
                name = str(node.args[1])
            if "distfuse" in name:
                out.append(name)
    return out


def _recording_aot(graphs):
    """``aot_eager`` whose forward and backward compilers record their graphs."""
    def record(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=record, bw_compiler=record)
    return backend


def _close(what, got, ref, dtype):
    torch.testing.assert_close(got.double(), ref.detach().double(), **tol(dtype), msg=lambda m: f"{what}: {m}")


def _same(what, a, b):
    assert (a is None and b is None) or torch.equal(a, b), f"{what}: compiled differs from eager"


# ---------------------------------------------------------------- norms


def _norm_pairs(P_x, C, H, W, dtype, with_group):
    """The distributed layers (parameters and buffers in ``dtype``) and their float64 torch.nn references."""
    pairs = [(DistributedBatchNorm2d(P_x, C, momentum=None, dtype=dtype), nn.BatchNorm2d(C, momentum=None))]
    if with_group:
        pairs.append((DistributedGroupNorm(P_x, 1, C, dtype=dtype), nn.GroupNorm(1, C)))
    pairs += [(DistributedInstanceNorm2d(P_x, C, affine=True, track_running_stats=True, dtype=dtype),
               nn.InstanceNorm2d(C, affine=True, track_running_stats=True)),
              (DistributedLayerNorm(P_x, (H, W) if with_group else (W,), dtype=dtype),
               nn.LayerNorm((H, W) if with_group else (W,)))]
    return pairs


def _param_block(layer, name, t):
    """This worker's block of the sequential tensor ``t`` (parameter, gradient or buffer) of ``layer``."""
    P = layer.P_x
    if t.dim() == 0:
        return t
    if isinstance(layer, DistributedLayerNorm):
        k = t.dim()
        return t[local_slices(tuple(t.shape), P.shape[-k:], P.index[-k:])]
    return t[local_slices(tuple(t.shape), (P.shape[1],), (P.index[1],))]


def _norm_case(ranks, grid_shape, shape, dtype, param_dtype, modes=("train", "eval")):
    """Eager and compiled train and eval steps of a norm stack; asserts on each rank, returns what it measured.

    ``param_dtype`` is the parameters' and buffers' (fp32 under a 16-bit input: torch's mixed-type rule).
    """
    torch._dynamo.reset()
    P_x = grid(ranks, grid_shape)
    N, C, H, W = shape
    pairs = _norm_pairs(P_x, C, H, W, param_dtype, with_group=grid_shape[1] == 1)
    model = nn.Sequential(*[d for d, _ in pairs])
    ref = nn.Sequential(*[r for _, r in pairs]).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # fresh parameters and running statistics, rounded to the case's dtype
        for t in list(ref.parameters()) + list(ref.buffers()):
            if t.is_floating_point():
                t.copy_((torch.rand(t.shape, generator=gen, dtype=torch.float64) + 0.5).to(param_dtype))
    for d, r in pairs:
        load_sequential(d, r if dist.get_rank() == 0 else None)
    xs = [(torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3).to(dtype).double() for _ in range(3)]
    dys = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(3)]

    def ref_step(i):
        x = xs[i].clone().requires_grad_(True)
        y = x
        for r in ref:
            y = r(y).to(dtype).double()  # the distributed layers round every output to the case's dtype
        y.backward(dys[i])
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref.zero_grad(set_to_none=True)
        return y.detach(), x.grad, grads, {n: b.clone() for n, b in ref.named_buffers()}

    def block(t):
        return t[local_slices(shape, P_x.shape, P_x.index)].to(dtype) if P_x.active else zero_volume_tensor(dtype=dtype)

    def step(fn, i):
        x = block(xs[i]).requires_grad_(P_x.active)
        y = fn(x)
        if P_x.active:
            y.backward(block(dys[i]))
        out = dict(y=y.detach(), dx=x.grad, grads={n: None if p.grad is None else p.grad.clone()
                                                   for n, p in model.named_parameters()},
                   buffers={n: b.clone() for n, b in model.named_buffers()})
        model.zero_grad(set_to_none=True)
        return out

    def check_bitwise(what, c, e):
        for k in ("y", "dx"):
            _same(f"{what} {k}", c[k], e[k])
        for kind in ("grads", "buffers"):
            for n in e[kind]:
                _same(f"{what} {n}", c[kind][n], e[kind][n])

    def check_reference(what, c, r):
        if not P_x.active:
            return
        y_ref, dx_ref, g_ref, b_ref = r
        sl = local_slices(shape, P_x.shape, P_x.index)
        _close(f"{what} output", c["y"], y_ref[sl], dtype)
        _close(f"{what} input gradient", c["dx"], dx_ref[sl], dtype)
        for j, (d, _) in enumerate(pairs):
            for n, g in g_ref.items():
                if n.startswith(f"{j}."):
                    _close(f"{what} {n} gradient", c["grads"][n], _param_block(d, n, g), dtype)
            for n, b in b_ref.items():
                if n.startswith(f"{j}.") and b.is_floating_point():
                    _close(f"{what} {n}", c["buffers"][n], _param_block(d, n, b), dtype)
                elif n.startswith(f"{j}."):
                    assert torch.equal(c["buffers"][n], b), (what, n)

    result = {}
    for mode, i in (("train", 1), ("eval", 2)):
        if mode not in modes:
            continue
        model.train(mode == "train")
        ref.train(mode == "train")
        if mode == "train":
            step(model, 0)  # the eager call agrees the metadata that the compiled call reuses
            ref_step(0)
        saved = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        eager = step(model, i)  # in eval mode also the eager call that agrees the new mode
        model.load_state_dict(saved, strict=False)
        explained = torch._dynamo.explain(model)(block(xs[i]).requires_grad_(P_x.active))
        model.load_state_dict(saved, strict=False)
        graphs = []
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=_recording_aot(graphs))
        t0 = time.perf_counter()
        comp = step(compiled, i)
        first_call = time.perf_counter() - t0
        model.load_state_dict(saved, strict=False)
        again = step(compiled, i)  # no recompile, the same bits
        check_bitwise(f"{mode} (compiled vs eager)", comp, eager)
        check_bitwise(f"{mode} (second compiled call)", again, comp)
        check_reference(f"{mode} (compiled vs torch.nn)", comp, ref_step(i))
        assert explained.graph_break_count == 0, (mode, [str(r.reason)[:300] for r in explained.break_reasons])
        result[mode] = dict(ops=_distfuse_ops(graphs), first_call=first_call, graphs=explained.graph_count)
    result["active"] = P_x.active
    return result


def _check_same_ops(results, expect):
    active = [r for r in results if r["active"]]
    for mode in expect:
        assert len({tuple(r[mode]["ops"]) for r in active}) == 1, [r[mode]["ops"] for r in active]
        for op in expect[mode]:
            assert any(op in name for name in active[0][mode]["ops"]), (mode, op, active[0][mode]["ops"])
        assert all(r[mode]["graphs"] == 1 for r in active)


_TRAIN_OPS = ("distfuse.flag_check", "distfuse.moments", "distfuse.normalize.", "distfuse.normalize_backward",
              "distfuse.replicate.", "distfuse.replicate_adjoint")
_EVAL_OPS = ("distfuse.flag_check", "distfuse.moments", "distfuse.replicate.", "distfuse.replicate_adjoint")


def test_compiled_norms_match_eager_and_torch_4_ranks_uneven_permuted():
    """BN (momentum=None), GN, IN (running stats), LN over (H, W); batch and H split unevenly, ranks permuted."""
    results = run_ranks(4, _norm_case, (3, 1, 0, 2), (2, 1, 2, 1), (3, 4, 5, 3), torch.float32, torch.float32,
                         timeout=300)
    _check_same_ops(results, {"train": _TRAIN_OPS, "eval": _EVAL_OPS})


def test_compiled_norms_world6_inactive_channel_split_bf16():
    """BN, IN, LN over W with the channels and W split, two inactive ranks, bf16 input (fp32 parameters and
    running statistics, as mixed precision keeps them) against float64; training mode (eval: the case above)."""
    results = run_ranks(6, _norm_case, (5, 0, 3, 1), (1, 2, 1, 2), (2, 3, 4, 5), torch.bfloat16, torch.float32,
                        modes=("train",), timeout=300)
    assert [r["active"] for r in results] == [True, True, False, True, False, True]
    _check_same_ops(results, {"train": _TRAIN_OPS})


def _group_norm_channels_last_case(shape, grid_shape, ranks, groups, dtype) -> None:
    """Eager and compiled (aot_eager) GroupNorm on channels_last blocks of several samples: bitwise equal, the
    layout kept, close to float64 torch.nn (the statistics are read from the [N, *s, C] memory, no copy)."""
    torch._dynamo.reset()
    P_x = grid(ranks, grid_shape)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    gen = torch.Generator().manual_seed(len(shape))
    ref = nn.GroupNorm(groups, shape[1], dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    layer = DistributedGroupNorm(P_x, groups, shape[1], dtype=dtype)
    load_sequential(layer, ref if dist.get_rank() == 0 else None)
    xg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    dyg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    yg = ref(xg.contiguous(memory_format=fmt))
    yg.backward(dyg)
    sl = local_slices(shape, P_x.shape, P_x.index)
    assert sl[0].stop - sl[0].start >= 2, f"{shape}: the case must hold several samples per worker"

    def step(fn):
        x = xg.detach()[sl].to(dtype).contiguous(memory_format=fmt).requires_grad_(True)
        y = fn(x)
        y.backward(dyg[sl].to(dtype).contiguous(memory_format=fmt))
        got = dict(y=y.detach(), dx=x.grad, weight=layer.weight.grad.clone(), bias=layer.bias.grad.clone())
        layer.zero_grad(set_to_none=True)
        return got

    eager = step(layer)
    comp = step(torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager"))
    for k in eager:
        _same(f"{shape} {k}", comp[k], eager[k])
    assert comp["y"].is_contiguous(memory_format=fmt) and comp["dx"].is_contiguous(memory_format=fmt), shape
    _close(f"{shape} output", comp["y"], yg[sl], dtype)
    _close(f"{shape} input gradient", comp["dx"], xg.grad[sl], dtype)
    _close(f"{shape} weight gradient", comp["weight"], ref.weight.grad, dtype)
    _close(f"{shape} bias gradient", comp["bias"], ref.bias.grad, dtype)


def _group_norm_channels_last(cases) -> None:
    for case in cases:
        _group_norm_channels_last_case(*case)


def test_compiled_group_norm_channels_last_several_samples():
    """2-D fp32 (batch split unevenly, 3 and 2 samples) and 3-D bf16 (2 samples), ranks permuted."""
    cases = [((5, 4, 5, 3), (2, 1, 1, 1), (1, 0), 2, torch.float32),
             ((2, 6, 3, 2, 3), (1, 1, 2, 1, 1), (1, 0), 3, torch.bfloat16)]
    run_ranks(2, _group_norm_channels_last, cases, timeout=300)


# ---------------------------------------------------------------- losses


class _Losses(nn.Module):
    """Every loss and reduction on one pair of inputs: logits ``z`` and values ``u``, ``[N, C, L]`` each."""

    def __init__(self, mk, class_weight, bce_weight, pos_weight):
        super().__init__()
        self.ce = mk(DistributedCrossEntropyLoss, nn.CrossEntropyLoss, weight=class_weight, label_smoothing=0.1)
        self.ce_none = mk(DistributedCrossEntropyLoss, nn.CrossEntropyLoss, reduction="none")
        self.nll = mk(DistributedNLLLoss, nn.NLLLoss, weight=class_weight, reduction="sum")
        self.kl = mk(DistributedKLDivLoss, nn.KLDivLoss, reduction="batchmean")
        self.mse = mk(DistributedMSELoss, nn.MSELoss)
        self.mse_none = mk(DistributedMSELoss, nn.MSELoss, reduction="none")
        self.l1 = mk(DistributedL1Loss, nn.L1Loss, reduction="sum")
        self.bce = mk(DistributedBCELoss, nn.BCELoss, weight=bce_weight)
        self.bcel = mk(DistributedBCEWithLogitsLoss, nn.BCEWithLogitsLoss, reduction="sum", pos_weight=pos_weight)

    def forward(self, z, u, labels, probs, values, bits):
        logp = F.log_softmax(z, dim=1) if z.dim() > 1 else z  # an inactive worker's zero-volume tensor passes on
        return (self.ce(z, labels), self.ce_none(z, labels), self.nll(logp, labels), self.kl(logp, probs),
                self.mse(u, values), self.mse_none(u, values), self.l1(u, values), self.bce(torch.sigmoid(u), bits),
                self.bcel(u, bits))


def _loss_case(ranks, grid_shape, shape):
    torch._dynamo.reset()
    P_x = grid(ranks, grid_shape)
    N, C, L = shape
    dtype = torch.float32
    gen = torch.Generator().manual_seed(9)
    class_weight = torch.rand(C, generator=gen, dtype=torch.float64) + 0.5
    bce_weight = torch.rand(C, 1, generator=gen, dtype=torch.float64) + 0.5
    pos_weight = torch.rand(C, 1, generator=gen, dtype=torch.float64) + 0.5

    def mk(dist_cls, torch_cls, **kw):
        dist_kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return dist_cls(P_x, **dist_kw), torch_cls(**kw)

    pairs = {}

    def mk_pair(dist_cls, torch_cls, **kw):
        d, r = mk(dist_cls, torch_cls, **kw)
        pairs[len(pairs)] = r
        return d

    model = _Losses(mk_pair, class_weight, bce_weight, pos_weight)
    ref = [pairs[k] for k in sorted(pairs)]

    def ref_forward(z, u, labels, probs, values, bits):
        logp = F.log_softmax(z, dim=1)
        ce, ce_none, nll, kl, mse, mse_none, l1, bce, bcel = ref
        return (ce(z, labels), ce_none(z, labels), nll(logp, labels), kl(logp, probs), mse(u, values),
                mse_none(u, values), l1(u, values), bce(torch.sigmoid(u), bits), bcel(u, bits))

    z = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    u = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    labels = torch.randint(0, C, (N, L), generator=gen)
    labels[0, 1] = -100  # ignore_index
    probs = torch.softmax(torch.randn(shape, generator=gen, dtype=torch.float64), 1).to(dtype).double()
    values = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    bits = torch.randint(0, 2, shape, generator=gen).double()
    dy = [torch.randn((N, L), generator=gen, dtype=torch.float64).to(dtype).double(),
          torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()]

    zg, ug = z.clone().requires_grad_(True), u.clone().requires_grad_(True)
    outs_ref = ref_forward(zg, ug, labels, probs, values, bits)
    seeds_ref = [dy[0] if o.dim() == 2 else dy[1] if o.dim() == 3 else torch.ones((), dtype=torch.float64)
                 for o in outs_ref]
    torch.autograd.backward(outs_ref, seeds_ref)

    def block(t, drop_class=False):
        if not P_x.active:
            return zero_volume_tensor(dtype=t.dtype if not t.is_floating_point() else dtype)
        if drop_class:
            full = local_slices(shape, P_x.shape, P_x.index)
            return t[(full[0],) + tuple(full[2:])]
        b = t[local_slices(shape, P_x.shape, P_x.index)]
        return b.to(dtype) if b.is_floating_point() else b

    def step(fn):
        zb, ub = block(z).requires_grad_(P_x.active), block(u).requires_grad_(P_x.active)
        outs = fn(zb, ub, block(labels, True), block(probs), block(values), block(bits).to(dtype))
        if P_x.active:
            seeds = [block(dy[0], True) if o.dim() == 2 else block(dy[1]) if o.dim() == 3 else torch.ones(())
                     for o in outs]
            torch.autograd.backward(outs, seeds)
        return [o.detach() for o in outs], zb.grad, ub.grad

    eager = step(model)
    explained = torch._dynamo.explain(model)(block(z), block(u), block(labels, True), block(probs), block(values),
                                             block(bits).to(dtype))
    graphs = []
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=_recording_aot(graphs))
    t0 = time.perf_counter()
    comp = step(compiled)
    first_call = time.perf_counter() - t0
    for j, (c, e) in enumerate(zip(comp[0], eager[0], strict=True)):
        _same(f"loss {j}", c, e)
    _same("dz", comp[1], eager[1])
    _same("du", comp[2], eager[2])
    if P_x.active:
        for j, (c, r) in enumerate(zip(comp[0], outs_ref, strict=True)):
            want = r if r.dim() == 0 else r[local_slices(shape, P_x.shape, P_x.index)] if r.dim() == 3 else \
                block(r.detach(), True)
            _close(f"loss {j}", c, want, dtype)
        _close("dz", comp[1], block(zg.grad), dtype)
        _close("du", comp[2], block(ug.grad), dtype)
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    return dict(ops=_distfuse_ops(graphs), first_call=first_call, active=P_x.active, graphs=explained.graph_count)


def test_compiled_losses_match_eager_and_torch_inactive_uneven_permuted():
    """Every loss and reduction ('mean', 'sum', 'none', 'batchmean'; class weights, ignore_index, label
    smoothing, pos_weight) in one graph; L = 7 over 3 workers listed out of order, rank 1 inactive."""
    results = run_ranks(4, _loss_case, (3, 0, 2), (1, 1, 3), (2, 4, 7), timeout=300)
    active = [r for r in results if r["active"]]
    assert [r["active"] for r in results] == [True, False, True, True]
    assert len({tuple(r["ops"]) for r in active}) == 1, [r["ops"] for r in active]
    ops = active[0]["ops"]
    assert sum("distfuse.flag_check" in op for op in ops) == 2, ops  # a flag round for each 'none' loss
    assert sum("distfuse.loss_flags" in op for op in ops) == 7, ops  # the 7 reduced losses: the flag in the sum
    assert sum("distfuse.replicate_adjoint" in op for op in ops) == 7, ops  # their reductions (forward graph)
    assert all(r["graphs"] == 1 for r in active)


# ---------------------------------------------------------------- refusals that reach every rank


def _compiled_before_eager(kind):
    torch._dynamo.reset()
    P_x = grid(range(4), (2, 1, 2))
    x = torch.randn(local_shape((3, 2, 5), P_x.shape, P_x.index))
    if kind == "norm":
        layer, args = DistributedLayerNorm(P_x, (5,)), (x,)
    else:
        layer, args = DistributedMSELoss(P_x), (x, torch.randn_like(x))
    return tracing_refusal(lambda: torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)(*args))


@pytest.mark.parametrize("kind", ["norm", "loss"])
def test_compiled_call_before_any_eager_call_is_refused_on_every_rank(kind):
    for msg in run_ranks(4, _compiled_before_eager, kind):
        assert msg is not None and "eagerly" in msg, msg


def _changed_call_under_compile():
    """Every worker: a new batch (a legitimate change); then rank 0 alone: fp64 (a disagreement)."""
    torch._dynamo.reset()
    P_x = grid((1, 3, 0, 2), (2, 1, 2, 1))
    bn, loss = DistributedBatchNorm2d(P_x, 2), DistributedMSELoss(P_x)

    def model(x):
        y = bn(x)
        return loss(y, torch.ones_like(y))

    def attempt(x):
        t0 = time.perf_counter()
        try:
            compiled(x)
            return None, time.perf_counter() - t0
        except ShapeError as exc:
            return str(exc), time.perf_counter() - t0

    traces = []

    def counting(gm, example_inputs):
        traces.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=counting, dynamic=False)
    x = torch.randn(local_shape((3, 2, 5, 4), P_x.shape, P_x.index))
    model(x)
    compiled(x)
    for _ in range(3):  # eager calls that repeat the agreed record do not make the compiled call retrace
        model(x)
        compiled(x)
    assert len(traces) == 1, f"{len(traces)} traces for one signature"
    x_new = torch.randn(local_shape((4, 2, 5, 4), P_x.shape, P_x.index))
    outcomes = [attempt(x_new)]
    saved = {k: v.clone() for k, v in bn.state_dict().items() if isinstance(v, torch.Tensor)}
    eager_loss = model(x_new)  # every worker agrees again eagerly; then the compiled call runs the new shape
    bn.load_state_dict(saved, strict=False)
    same = torch.equal(compiled(x_new), eager_loss)
    outcomes.append(attempt(x_new.double() if dist.get_rank() == 0 else x_new))
    return outcomes, same


def test_changed_call_under_compile_raises_on_every_rank_then_recovers():
    for outcomes, same in run_ranks(4, _changed_call_under_compile, timeout=240):
        for error, waited in outcomes:
            assert error is not None and "eagerly" in error, error
            assert waited < 25, f"the error took {waited:.1f} s (a wait for a peer, not a flag round)"
        assert same


_PATIENT: dict = {}
PROMPT = 5.0  # seconds: far below the partition's DISTFUSE_TIMEOUT=60 (a wait for a peer would take that long)


def _bad_values_under_compile(bad_rank: int):
    """A class index out of range (CE, 'mean'), a probability above 1 and a NaN target (BCE, 'sum') on one
    worker's block under the compiled losses: every worker's call raises promptly; good data stays eager's bits."""
    torch._dynamo.reset()
    P_x = patient_grid(_PATIENT, (3, 0, 2), (1, 1, 3))  # world rank 1 inactive; L = 7 split 3, 2, 2
    shape = (2, 4, 7)
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(shape, generator=gen)
    labels = torch.randint(0, shape[1], (shape[0], shape[2]), generator=gen)
    probs = torch.rand(shape, generator=gen)
    bits = torch.randint(0, 2, shape, generator=gen).float()
    ce = DistributedCrossEntropyLoss(P_x, weight=torch.rand(shape[1], generator=gen) + 0.5)
    bce = DistributedBCELoss(P_x, reduction="sum")
    if P_x.active:
        sl = local_slices(shape, P_x.shape, P_x.index)
        z, probs, bits, labels = z[sl], probs[sl], bits[sl], labels[sl[0], sl[2]]
    else:
        z = probs = bits = zero_volume_tensor()
        labels = zero_volume_tensor(dtype=torch.int64)
    mine = dist.get_rank() == bad_rank
    bad_labels, bad_probs, bad_bits = labels.clone(), probs.clone(), bits.clone()
    if mine:  # torch's BCE checks its input (the probabilities) and its target
        bad_labels[1, 0] = shape[1]  # one past the last class
        bad_probs[0, 1, 1] = 1.5
        bad_bits[1, 0, 0] = float("nan")
    outcomes = {}
    for name, layer, good, bad in (("ce", ce, (z, labels), (z, bad_labels)),
                                   ("bce", bce, (probs, bits), (bad_probs, bits)),
                                   ("bce-target", bce, (probs, bits), (probs, bad_bits))):
        eager = layer(*good)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
        first = torch.equal(compiled(*good), eager)
        refused = catch(lambda layer=compiled, bad=bad: layer(*bad))
        outcomes[name] = (first, refused, torch.equal(compiled(*good), eager))
    return P_x.active, outcomes


def test_compiled_loss_value_errors_reach_every_rank():
    """A bad block on world rank 2 only: CrossEntropyLoss ('mean', class weights) and BCELoss ('sum'; input, then
    target) raise the same ShapeError on every worker of P_x, promptly (no wait for the partition's timeout),
    naming rank 2; inactive world rank 1 is untouched."""
    results = run_ranks(4, _bad_values_under_compile, 2, timeout=300)
    assert [active for active, _ in results] == [True, False, True, True]
    for rank, (active, outcomes) in enumerate(results):
        for name, (first, outcome, after) in outcomes.items():
            assert first and after, f"rank {rank} {name}: compiled differs from eager on good data"
            if not active:
                assert outcome[0] == "ok", outcome
                continue
            assert outcome[0] == "ShapeError", (rank, name, outcome)
            assert "refused the blocks of world ranks [2]" in outcome[1], outcome[1]
            assert outcome[2] < PROMPT, f"rank {rank} {name}: the error took {outcome[2]:.1f} s"
