"""torch.compile(fullgraph=True) of the spatial layers: pooling, upsampling, transposed convolution.

Their eager calls agree on metadata with a one-element host flag round (pooling,
upsampling) or a flag carried in the parameter broadcast (transposed convolution).  In
a compiled region the flag round runs as ``distfuse::flag_check``, the parameter round
as ``distfuse::broadcast`` (its flagged round) and the window's halo as
``distfuse::halo_exchange`` (the pools' and upsampling's one forward,
``distfuse/layers/_pool_common.py``; the transposed convolution's,
``distfuse/layers/conv_feature.py``'s ``RootParamConvBase``).
A pool or upsampling layer whose eager call staged fused (``DISTFUSE_PATH=fused``) stages
through ``distfuse::halo_staging`` in its compiled calls too, with no DISTFUSE_PATH set
there: a compiled call takes the path of the last eager call.

Checked on gloo ranks with ``backend="aot_eager"`` (autograd traced too): zero graph
breaks and one graph on every rank (``torch._dynamo.explain``), the same sequence of
communication ops in every active rank's graph, forward (and max pooling's indices) and
every gradient (input, weight, bias) against the float64 ``torch.nn`` layer on the
gathered tensors and bitwise against the eager layer; uneven splits, permuted ranks,
inactive ranks in a world of 6, channels_last, fp16 and bf16.  A compiled call before
any eager call is refused on every rank, and a shape change under the compiled layer
raises the same error on every rank (no wait for a peer) and works again after one
eager call.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import ShapeError
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import load_sequential
from distfuse.layers.conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
)
from distfuse.layers.pool import (
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
)
from distfuse.layers.upsample import DistributedUpsample, interpolate
from distfuse.partition import zero_volume_tensor
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.misuse_support import tracing_refusal
from tests.test_conv_support import close, grid, with_path

FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


DISTRIBUTED = {"maxpool": (DistributedMaxPool1d, DistributedMaxPool2d, DistributedMaxPool3d),
               "avgpool": (DistributedAvgPool1d, DistributedAvgPool2d, DistributedAvgPool3d),
               "convT": (DistributedConvTranspose1d, DistributedConvTranspose2d, DistributedConvTranspose3d)}
SEQUENTIAL = {"maxpool": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), "avgpool": (nn.AvgPool1d, nn.AvgPool2d,
                                                                                 nn.AvgPool3d),
              "convT": (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)}


def _layers(kind: str, P_x, channels: int, dtype, kw: dict):
    """``(distributed layer, float64 torch.nn layer)`` of one kind."""
    nd = P_x.dim - 2
    if kind == "upsample":
        return DistributedUpsample(P_x, **kw), nn.Upsample(**kw)
    cls, ref = DISTRIBUTED[kind][nd - 1], SEQUENTIAL[kind][nd - 1]
    if kind == "convT":
        return cls(P_x, channels, dtype=dtype, **kw), ref(channels, dtype=torch.float64, **kw)
    return cls(P_x, **kw), ref(**kw)


def _comm_ops(graphs) -> list[str]:
    """The distfuse ops of the captured graphs, in order (what every active rank must agree on)."""
    return [str(n.target) for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and "distfuse" in str(n.target)]


def _compile_case(kind, shape, grid_shape, ranks, kw, dtype=torch.float32, channels_last=False, path=None):
    """Eager call, explain, compiled calls on the same block; rank 0 compares with float64 torch.nn.

    ``path`` forces the eager call's staging path (``DISTFUSE_PATH``); the compiled calls run without it.
    """
    torch._dynamo.reset()
    rank = dist.get_rank()
    P_x = grid(ranks, grid_shape)
    torch.manual_seed(5)
    layer, seq = _layers(kind, P_x, shape[1], dtype, kw)
    params = [p for p in seq.parameters()]
    if params:
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(dtype).double())
        load_sequential(layer, seq if rank == 0 else None)
    gen = torch.Generator().manual_seed(11)
    fmt = FORMATS.get(len(shape)) if channels_last else torch.contiguous_format
    xg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    xg = xg.contiguous(memory_format=fmt).requires_grad_(True)
    out = seq(xg)
    yg, ig = out if isinstance(out, tuple) else (out, None)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    yg.backward(dyg)
    weights = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None))]

    def block():
        if not P_x.active:
            return zero_volume_tensor(dtype=dtype)
        x = xg.detach()[local_slices(shape, P_x.shape, P_x.index)].to(dtype)
        return x.contiguous(memory_format=fmt).requires_grad_(True)

    def step(fn):
        x = block()
        got = fn(x)
        y, idx = got if isinstance(got, tuple) else (got, None)
        dy = dyg[local_slices(tuple(yg.shape), P_x.shape, P_x.index)].to(dtype) if P_x.active else \
            torch.zeros_like(y)
        if y.requires_grad:
            y.backward(dy)
        grads = [x.grad] + [None if p is None else p.grad for p in weights]
        res = (y.detach(), idx, [None if g is None else g.clone() for g in grads])
        layer.zero_grad(set_to_none=True)
        return res

    # the eager call also agrees the metadata (and chooses the staging path) the compiled call reuses
    y_eager, i_eager, g_eager = with_path(path, lambda: step(layer)) if path else step(layer)
    explained = torch._dynamo.explain(layer)(block())
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    t0 = time.perf_counter()
    y_comp, i_comp, g_comp = step(compiled)
    first_call = time.perf_counter() - t0
    y_again, _, _ = step(compiled)  # a second call: no recompile, the same result
    bitwise = torch.equal(y_comp, y_eager) and (i_eager is None or torch.equal(i_comp, i_eager)) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(g_comp, g_eager, strict=True))
    same_format = True
    if P_x.active:
        assert tuple(y_comp.shape) == local_shape(tuple(yg.shape), P_x.shape, P_x.index)
        if channels_last and y_comp.numel():
            same_format = y_comp.is_contiguous(memory_format=fmt) == yg.is_contiguous(memory_format=fmt)
    y_full = collect_tensor(y_comp if P_x.active else None, P_x)
    i_full = collect_tensor(i_comp if P_x.active else None, P_x) if ig is not None else None
    dx_full = collect_tensor(g_comp[0] if P_x.active else None, P_x)
    param_grads = [collect_tensor(g, lay.P) for g, lay in zip(g_comp[1:], layer.param_layouts(), strict=False)]
    if rank == 0:
        close(f"{kind}: compiled output", y_full, yg.detach(), dtype)
        close(f"{kind}: compiled input gradient", dx_full, xg.grad, dtype)
        if ig is not None:
            assert torch.equal(i_full, ig), f"{kind}: compiled indices differ from torch's"
        for g, p in zip(param_grads, params, strict=True):
            close(f"{kind}: compiled parameter gradient", g, p.grad, dtype)
    return dict(breaks=explained.graph_break_count, reasons=[str(r.reason)[:300] for r in explained.break_reasons],
                graphs=explained.graph_count, ops=_comm_ops(explained.graphs), bitwise=bitwise,
                again=torch.equal(y_again, y_comp), same_format=same_format, path=layer.last_path if hasattr(
                    layer, "last_path") else None, first_call=first_call, active=P_x.active)


def _cases(specs):
    return [_compile_case(**spec) for spec in specs]


def _check(results, spec_ids, expect_ops, paths=None):
    """Every active rank: no graph break, one graph, bitwise eager, the same op sequence (and the expected ops);
    with ``paths``, the staging path of the compiled calls."""
    for k, name in enumerate(spec_ids):
        active = [(rank, per[k]) for rank, per in enumerate(results) if per[k]["active"]]
        for rank, r in active:
            if paths is not None and paths[k] is not None:
                assert r["path"] == paths[k], f"{name} rank {rank}: the compiled call staged {r['path']}"
            assert r["breaks"] == 0, f"{name} rank {rank}: {r['breaks']} graph breaks: {r['reasons']}"
            assert r["graphs"] == 1, f"{name} rank {rank}: {r['graphs']} graphs"
            assert r["again"], f"{name} rank {rank}: the second compiled call differs from the first"
            assert r["bitwise"], f"{name} rank {rank}: compiled results differ from eager"
            assert r["same_format"], f"{name} rank {rank}: memory format differs from torch.nn's"
        sequences = {tuple(r["ops"]) for _, r in active}
        assert len(sequences) == 1, f"{name}: ranks traced different op sequences: {sequences}"
        assert list(sequences.pop()) == expect_ops[k], f"{name}: ops {active[0][1]['ops']}"


FLAG, HALO, PARAMS = "distfuse.flag_check.default", "distfuse.halo_exchange.default", \
    "distfuse.broadcast.default"

WORLD4 = [
    ("maxpool-2x2-uneven-permuted-indices",
     dict(kind="maxpool", shape=(2, 3, 7, 5), grid_shape=(1, 1, 2, 2), ranks=(3, 1, 0, 2),
          kw=dict(kernel_size=3, stride=2, padding=1, return_indices=True)), [FLAG, HALO]),
    ("avgpool3d-channels_last-fp16-ceil",
     dict(kind="avgpool", shape=(1, 2, 5, 4, 3), grid_shape=(1, 1, 2, 1, 2), ranks=(0, 2, 1, 3), dtype=torch.float16,
          channels_last=True, kw=dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
     [FLAG, HALO]),
    ("upsample-bilinear-channels_last-bf16",
     dict(kind="upsample", shape=(1, 2, 5, 6), grid_shape=(1, 1, 2, 2), ranks=(1, 3, 2, 0), dtype=torch.bfloat16,
          channels_last=True, kw=dict(scale_factor=1.5, mode="bilinear")), [FLAG, HALO]),
    ("convT-2x2-uneven-permuted",
     dict(kind="convT", shape=(1, 3, 5, 4), grid_shape=(1, 1, 2, 2), ranks=(2, 0, 3, 1),
          kw=dict(out_channels=2, kernel_size=4, stride=2, padding=1)), [PARAMS, HALO]),
]

WORLD6 = [
    ("maxpool1d-local-inactive",  # kernel 2 stride 2 over even blocks: no halo, the flag round alone
     dict(kind="maxpool", shape=(2, 3, 12), grid_shape=(1, 1, 3), ranks=(4, 0, 2),
          kw=dict(kernel_size=2, stride=2)), [FLAG]),
    ("avgpool1d-empty-block",  # 2 outputs over 3 workers: one worker's block is empty (it still serves its halo)
     dict(kind="avgpool", shape=(2, 3, 4), grid_shape=(1, 1, 3), ranks=(2, 4, 1), kw=dict(kernel_size=2, stride=2)),
     [FLAG, HALO]),
    ("convT3d-inactive-channels_last",
     dict(kind="convT", shape=(1, 2, 4, 3, 3), grid_shape=(1, 1, 1, 3, 1), ranks=(1, 5, 3), channels_last=True,
          kw=dict(out_channels=2, kernel_size=2, stride=2)), [PARAMS, HALO]),
    ("convT1d-inactive-uneven",
     dict(kind="convT", shape=(2, 2, 7), grid_shape=(1, 1, 3), ranks=(3, 5, 0),
          kw=dict(out_channels=3, kernel_size=3, stride=2, output_padding=1)), [PARAMS, HALO]),
]


STAGE = "distfuse.halo_staging.default"
WORLD3_FUSED = [  # the eager call stages with the Triton halo kernels (interpreted here); so does the compiled one
    ("maxpool1d-fused-ceil-indices",
     dict(kind="maxpool", shape=(1, 2, 13), grid_shape=(1, 1, 3), ranks=(2, 1, 0), path="fused",
          kw=dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True)), [FLAG, STAGE]),
    ("upsample-fused-bf16",
     dict(kind="upsample", shape=(1, 2, 5, 6), grid_shape=(1, 1, 1, 3), ranks=(0, 2, 1), dtype=torch.bfloat16,
          path="fused", kw=dict(scale_factor=1.5, mode="bilinear")), [FLAG, STAGE]),
]


@pytest.mark.parametrize("world,cases", [pytest.param(4, WORLD4, id="world4"), pytest.param(6, WORLD6, id="world6"),
                                         pytest.param(3, WORLD3_FUSED, id="world3-fused")])
def test_compiled_spatial_layers_match_eager_without_graph_breaks(world, cases):
    results = run_ranks(world, _cases, [spec for _, spec, _ in cases], timeout=300)
    _check(results, [name for name, _, _ in cases], [ops for _, _, ops in cases],
           [spec.get("path") for _, spec, _ in cases])


# ---------------------------------------------------------------- refusals that reach every rank


def _refusals():
    """A compiled call before any eager call (transposed conv, max pool), a batch change under a compiled max pool
    (every worker), a dtype change under a compiled transposed conv (one worker); each layer works after an eager
    call."""
    torch._dynamo.reset()
    P_x = grid((1, 3, 0, 2), (1, 1, 2, 2))
    out = {}
    conv = DistributedConvTranspose2d(P_x, 2, 3, 3, stride=2)
    x = torch.randn(local_shape((1, 2, 5, 4), P_x.shape, P_x.index))
    out["before_eager"] = tracing_refusal(lambda: torch.compile(conv, fullgraph=True, backend="eager",
                                                                dynamic=False)(x))
    pool = DistributedMaxPool2d(P_x, 3, stride=2, padding=1)
    compiled = torch.compile(pool, fullgraph=True, backend="eager", dynamic=False)
    x = torch.randn(local_shape((2, 2, 7, 5), P_x.shape, P_x.index))
    out["pool_before_eager"] = tracing_refusal(lambda: compiled(x))  # its session has settled nothing yet
    torch._dynamo.reset()
    pool(x)
    compiled(x)
    x_new = torch.randn(local_shape((3, 2, 7, 5), P_x.shape, P_x.index))  # every worker: a new batch size
    t0 = time.perf_counter()
    try:
        compiled(x_new)
        out["changed"] = None
    except ShapeError as exc:
        out["changed"] = str(exc)
    out["waited"] = time.perf_counter() - t0
    y_eager = pool(x_new)  # agree again eagerly, then the compiled layer runs the new shape
    out["recovered"] = torch.equal(compiled(x_new), y_eager)
    # one worker alone changes its dtype under a compiled transposed conv: its flag rides the parameter round
    conv = DistributedConvTranspose2d(P_x, 2, 3, 3, stride=2)
    compiled = torch.compile(conv, fullgraph=True, backend="eager", dynamic=False)
    x = torch.randn(local_shape((1, 2, 5, 4), P_x.shape, P_x.index))
    conv(x)
    compiled(x)
    try:
        compiled(x.double() if dist.get_rank() == 0 else x)
        out["one_changed"] = None
    except ShapeError as exc:
        out["one_changed"] = str(exc)
    y_eager = conv(x)
    out["recovered_conv"] = torch.equal(compiled(x), y_eager)
    return out


def test_refusals_reach_every_rank_and_the_layer_recovers():
    for r in run_ranks(4, _refusals, timeout=240):
        assert r["before_eager"] is not None and "eagerly" in r["before_eager"], r["before_eager"]
        assert r["pool_before_eager"] is not None and "DistributedMaxPool2d" in r["pool_before_eager"] and \
            "eagerly" in r["pool_before_eager"], r["pool_before_eager"]
        assert r["changed"] is not None and "eagerly" in r["changed"], r["changed"]
        assert r["waited"] < 25, f"the error took {r['waited']:.1f} s (a wait for a peer, not a flag round)"
        assert r["recovered"]
        assert r["one_changed"] is not None and "eagerly" in r["one_changed"], r["one_changed"]
        assert r["recovered_conv"]


def _compiled_interpolate():
    """``interpolate`` (the functional form) inside a compiled function, after one eager call with its arguments."""
    torch._dynamo.reset()
    P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
    gen = torch.Generator().manual_seed(4)
    xg = torch.randn(1, 2, 5, 6, generator=gen)
    dyg = torch.randn(1, 2, 7, 9, generator=gen)

    def fn(t):
        return interpolate(P_x, t, scale_factor=1.5, mode="bilinear")

    def step(f):
        x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].clone().requires_grad_(True)
        y = f(x)
        y.backward(dyg[local_slices(dyg.shape, P_x.shape, P_x.index)])
        return y.detach(), x.grad

    y_eager, dx_eager = step(fn)
    explained = torch._dynamo.explain(fn)(xg[local_slices(xg.shape, P_x.shape, P_x.index)].clone().requires_grad_())
    torch._dynamo.reset()
    y_comp, dx_comp = step(torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager"))
    return explained.graph_break_count, _comm_ops(explained.graphs), torch.equal(y_comp, y_eager) and \
        torch.equal(dx_comp, dx_eager)


def test_compiled_interpolate_reuses_its_eager_agreement():
    for breaks, ops, same in run_ranks(4, _compiled_interpolate):
        assert breaks == 0 and ops == [FLAG, HALO], (breaks, ops)
        assert same
