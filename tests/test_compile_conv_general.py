"""torch.compile(fullgraph=True) of the channel- and general-distributed convolutions: no graph break, eager's results.

A compiled call reuses the metadata its last eager call agreed on (over the union of
P_x, P_w and P_y) and moves data through custom ops only: ``distfuse::flag_check``, the
halo round (``distfuse::halo_exchange``, general conv), ``distfuse::broadcast`` (the input to the weight
workers, the parameters across spatial blocks) and ``distfuse::broadcast_adjoint`` (the
partial outputs summed onto P_y), with their adjoints in the backward graph.

Checked on gloo ranks with ``aot_eager`` (its own no-op compilers, wrapped to record the
forward and backward graphs): zero graph breaks (``torch._dynamo.explain``) and one graph
per rank, the same sequence of distfuse ops on every rank of the union (forward and
backward), forward and every gradient (input, weight, bias) bitwise equal to the eager
layer and close to the float64 ``torch.nn.ConvNd`` on the gathered tensors, and the
output in eager's memory format.  Cases: 2-D channel and general convs and a 3-D channel
conv; uneven channel and spatial splits, permuted ranks, workers that hold no input,
inactive ranks, worlds of 2 to 8, channels_last(_3d), bf16, fp16 and fp32, a worker whose
input does not require grad while its peers' do (its halo adjoint must still run), and
receive buffers poisoned with NaN (debug mode).  Misuse: a compiled call before any eager
call is refused on every worker, and a new batch size under the compiled layer raises
the same error on every worker (the P_w-only workers, whose input did not change,
included), then works after one eager call.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

from distfuse.errors import ShapeError, UnsupportedError
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import load_sequential
from distfuse.layers.conv import DistributedConv2d
from distfuse.partition import zero_volume_tensor
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import SELECTOR, SEQUENTIAL, close, grid


def _distfuse_ops(gm) -> list[str]:
    """The distfuse ops of a graph in order (ORDERED effects appear wrapped in ``with_effects`` in AOT graphs)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.args[1] if "with_effects" in str(node.target) and len(node.args) > 1 else node.target
        if "distfuse" in str(target):
            out.append(str(target).replace(".default", ""))
    return out


def _recording_aot_eager(record: dict):
    """``aot_eager`` whose no-op compilers keep the Dynamo, forward and backward graphs."""
    def keep(kind):
        def compiler(gm, example_inputs):
            record[kind].append(gm)
            return boxed_nop(gm, example_inputs)
        return compiler

    def backend(gm, example_inputs):
        record["dynamo"].append(gm)
        return aot_eager(gm, example_inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    return backend


def _compile_case(shape, cout, x, y, w, dtype=torch.float32, channels_last=False, frozen=None, debug=False, **conv):
    """One eager call, ``explain``, then two compiled calls; rank 0 compares the gathered results with float64.

    ``frozen``: the P_x worker (partition rank) whose input does not require grad (its peers' do), so only the
    anchors make it run the adjoints its peers wait for; ``debug``: ``DISTFUSE_DEBUG=1``, receive buffers NaN.
    """
    if debug:
        os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        return _compile_case_body(shape, cout, x, y, w, dtype, channels_last, frozen, **conv)
    finally:
        os.environ.pop("DISTFUSE_DEBUG", None)


def _compile_case_body(shape, cout, x, y, w, dtype, channels_last, frozen, **conv):
    torch._dynamo.reset()
    rank = dist.get_rank()
    P_x, P_y, P_w = grid(x[1], x[0]), grid(y[1], y[0]), grid(w[1], w[0])
    nd = len(shape) - 2
    layer = SELECTOR[nd](P_x, shape[1], cout, 3, P_y=P_y, P_w=P_w, dtype=dtype, **conv)
    torch.manual_seed(5)
    seq = SEQUENTIAL[nd](shape[1], cout, 3, dtype=torch.float64, **conv)
    with torch.no_grad():  # the reference holds exactly the parameters the distributed layer can hold
        for p in seq.parameters():
            p.copy_(p.to(dtype).double())
    load_sequential(layer, seq if rank == 0 else None)
    gen = torch.Generator().manual_seed(11)
    xg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    yg.backward(dyg)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}[len(shape)] if channels_last else torch.contiguous_format
    in_union = P_x.active or P_y.active or P_w.active

    def block():
        if not P_x.active:  # no requires_grad: the layer runs the adjoints its peers wait for by itself
            return zero_volume_tensor(dtype=dtype)
        return xg.detach()[local_slices(shape, P_x.shape, P_x.index)].to(dtype).contiguous(
            memory_format=fmt).requires_grad_(P_x.rank != frozen)

    def step(fn):
        xb = block()
        out = fn(xb)
        if P_y.active:
            dy = dyg[local_slices(tuple(yg.shape), P_y.shape, P_y.index)].to(dtype).contiguous(memory_format=fmt)
        else:
            assert out.numel() == 0, tuple(out.shape)
            dy = torch.zeros_like(out)
        if out.requires_grad:  # every worker of the union runs backward, on its zero-volume output too
            out.backward(dy)
        grads = [xb.grad] + [None if p is None else p.grad for p in (layer.weight, layer.bias)]
        layer.zero_grad(set_to_none=True)
        return out.detach(), [None if g is None else g.clone() for g in grads]

    y_eager, g_eager = step(layer)  # the eager call agrees the metadata the compiled calls reuse
    explained = torch._dynamo.explain(layer)(block())
    torch._dynamo.reset()
    record = {"dynamo": [], "fw": [], "bw": []}
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend=_recording_aot_eager(record))
    t0 = time.perf_counter()
    y_comp, g_comp = step(compiled)
    first_call = time.perf_counter() - t0
    y_again, g_again = step(compiled)  # no recompile, same result
    same = lambda a, b: all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                            for u, v in zip(a, b, strict=True))
    if P_y.active:
        assert tuple(y_comp.shape) == local_shape(tuple(yg.shape), P_y.shape, P_y.index)
        assert y_comp.dtype == dtype
    else:
        assert y_comp.shape == y_eager.shape, (tuple(y_comp.shape), tuple(y_eager.shape))
    y_full = collect_tensor(y_comp if P_y.active else None, P_y)
    dx_local = g_comp[0] if P_x.rank != frozen else torch.zeros(local_shape(shape, P_x.shape, P_x.index), dtype=dtype)
    dx_full = collect_tensor(dx_local if P_x.active else None, P_x)
    dx_ref = xg.grad.clone()
    if frozen is not None:  # that block has no gradient; its peers' blocks are still checked
        dx_ref[local_slices(shape, P_x.shape, P_x.index_of(frozen))] = 0
    grads = {lay.seq_name: collect_tensor(g_comp[1 + k] if lay.P.active else None, lay.P)
             for k, lay in enumerate(layer.param_layouts())}
    if rank == 0:
        close("compiled output", y_full, yg.detach(), dtype)
        close("compiled input gradient", dx_full, dx_ref, dtype)
        for name, g in grads.items():
            close(f"compiled {name} gradient", g, getattr(seq, name).grad, dtype)
    ops = [f"{kind}:{op}" for kind in ("fw", "bw") for gm in record[kind] for op in _distfuse_ops(gm)]
    return dict(union=in_union, breaks=explained.graph_break_count, graphs=explained.graph_count,
                reasons=[str(r.reason)[:300] for r in explained.break_reasons], compiles=len(record["dynamo"]),
                ops=ops, bitwise=torch.equal(y_comp, y_eager) and same(g_comp, g_eager),
                again=torch.equal(y_again, y_comp) and same(g_again, g_comp), first_call=first_call,
                kind=type(layer).__name__, fmt_ok=(not P_y.active) or y_comp.stride() == y_eager.stride())


def _check(results, kind: str, halo: bool):
    union = [r for r in results if r["union"]]
    for rank, r in enumerate(results):
        if not r["union"]:
            continue
        assert r["kind"] == kind, r["kind"]
        assert r["breaks"] == 0, f"rank {rank}: {r['breaks']} graph breaks: {r['reasons']}"
        assert r["graphs"] == 1 and r["compiles"] == 1, f"rank {rank}: {r['graphs']} graphs, {r['compiles']} compiles"
        assert r["bitwise"], f"rank {rank}: compiled results differ from eager"
        assert r["again"], f"rank {rank}: the second compiled call differs from the first"
        assert r["fmt_ok"], f"rank {rank}: the output's memory format (strides) differs from eager's"
    sequences = {tuple(r["ops"]) for r in union}
    assert len(sequences) == 1, "\n".join(str(r["ops"]) for r in union)
    ops = union[0]["ops"]
    # forward: the flag round, the moves (broadcast) and the sum-reduce (its adjoint op); backward: their adjoints
    for name in ("fw:flag_check", "fw:broadcast", "fw:broadcast_adjoint", "bw:broadcast", "bw:broadcast_adjoint"):
        kind, op = name.split(":")
        assert f"{kind}:distfuse.{op}" in ops, (name, ops)
    assert ("fw:distfuse.halo_exchange" in ops) == halo and ("bw:distfuse.halo_exchange_adjoint" in ops) == halo, ops
    print(f"{kind}: first compiled call (aot_eager, forward + backward) "
          f"{max(r['first_call'] for r in union):.1f} s, distfuse ops {ops}")


@pytest.mark.parametrize("kwargs,world,kind,halo", [
    pytest.param(dict(shape=(2, 5, 5, 4), cout=3, x=((1, 2, 1, 1), (1, 4)), y=((1, 2, 1, 1), (2, 0)),
                      w=((2, 2, 1, 1), (3, 0, 1, 4)), dtype=torch.bfloat16, channels_last=True, padding=1,
                      padding_mode="reflect"), 6, "DistributedChannelConv2d", False,
                 id="channel-2x2-uneven-permuted-inactive-channels_last-bf16"),
    pytest.param(dict(shape=(2, 3, 7, 5), cout=5, x=((1, 2, 1, 2), (4, 1, 3, 0)), y=((1, 1, 1, 2), (4, 2)),
                      w=((1, 2, 1, 2), (3, 0, 2, 1)), padding=1, stride=(1, 2)), 6, "DistributedGeneralConv2d", True,
                 id="general-1x2x1x2-uneven-permuted-inactive-fp32"),
    # every role on 8 ranks: P_x and P_y on disjoint halves, P_w over all of them; a P_x worker whose input does not
    # require grad; receive buffers poisoned with NaN (debug mode)
    pytest.param(dict(shape=(2, 5, 6, 7), cout=3, x=((1, 2, 1, 2), (6, 1, 4, 3)), y=((1, 2, 1, 2), (0, 7, 2, 5)),
                      w=((2, 2, 1, 2), (5, 2, 7, 0, 3, 6, 1, 4)), dtype=torch.float16, padding=(1, 2),
                      dilation=(1, 2), padding_mode="replicate", frozen=2, debug=True), 8, "DistributedGeneralConv2d",
                 True, id="general-2x2x1x2-world8-uneven-permuted-frozen-input-fp16-debug"),
    # 3-D: a channels_last_3d input gives torch's NCDHW CPU output, so the sum-reduce moves another format
    pytest.param(dict(shape=(1, 3, 4, 3, 5), cout=2, x=((1, 2, 1, 1, 1), (0, 1)), y=((1, 1, 1, 1, 1), (0,)),
                      w=((1, 2, 1, 1, 1), (1, 0)), padding=1, channels_last=True), 2, "DistributedChannelConv3d",
                 False, id="channel-3d-channels_last_3d-swapped"),
])
def test_compiled_channel_and_general_conv_match_eager_without_graph_breaks(kwargs, world, kind, halo):
    _check(run_ranks(world, _compile_case, **kwargs, timeout=240), kind, halo)


# ---------------------------------------------------------------- refusals that reach every worker


def _misuse():
    """A compiled call before any eager call, then a new batch size under the compiled layer (general conv)."""
    torch._dynamo.reset()
    P_x, P_y, P_w = grid((1, 3), (1, 1, 1, 2)), grid((0, 2, 3, 1), (1, 2, 1, 2)), grid((2, 3, 0, 1), (2, 1, 1, 2))
    layer = DistributedConv2d(P_x, 2, 3, 3, padding=1, P_y=P_y, P_w=P_w)
    compiled = torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)

    def block(batch):
        return torch.randn(local_shape((batch, 2, 5, 4), P_x.shape, P_x.index)) if P_x.active else \
            zero_volume_tensor()

    try:
        compiled(block(2))
        refused = None
    except UnsupportedError as exc:
        refused = str(exc)
    except Exception as exc:  # dynamo may wrap the error raised while tracing
        cause = exc.__cause__ or exc
        refused = f"{type(cause).__name__}: {cause}"
    torch._dynamo.reset()
    x = block(2)
    layer(x)
    compiled(x)
    x_new = block(3)  # every P_x worker: a new batch size; the P_w- and P_y-only workers' inputs are unchanged
    t0 = time.perf_counter()
    try:
        compiled(x_new)
        error = None
    except ShapeError as exc:
        error = str(exc)
    waited = time.perf_counter() - t0
    y_eager = layer(x_new)  # agree again eagerly, then the compiled layer runs the new shape
    y_comp = compiled(x_new)
    return refused, error, waited, torch.equal(y_eager, y_comp) and y_comp.shape == y_eager.shape


def test_compiled_misuse_raises_on_every_worker_then_recovers():
    for rank, (refused, error, waited, same) in enumerate(run_ranks(4, _misuse, timeout=240)):
        assert refused is not None and "eagerly" in refused, (rank, refused)
        assert error is not None and "eagerly" in error, (rank, error)
        assert waited < 25, f"rank {rank}: the error took {waited:.1f} s (a wait for a peer, not a flag)"
        assert same, f"rank {rank}: after one eager call the compiled layer differs from eager"
