"""torch.compile(fullgraph=True) of the ring attention and the multi-head layer: no graph break, eager's results.

The whole ring runs as one custom op in each graph: ``distfuse::ring_attention`` (the K/V
blocks round the ring, returning the output and the log-sum-exp) in the forward graph and
``distfuse::ring_attention_backward`` (the backward ring with the dK/dV accumulators) in the
backward graph, each behind the layer's ``distfuse::flag_check`` (the replay of the
agreement settled by one eager call).  ``DistributedMultiheadAttention`` adds its
``distfuse::replicate`` / ``distfuse::replicate_adjoint`` pairs over the context and tensor
axes around the ring.

Checked on 4 gloo ranks, ``[2, 2]`` grids (``aot_eager``'s compilers, recording the forward
and backward graphs): zero graph breaks and one graph on every rank
(``torch._dynamo.explain``), the same distfuse ops in the same order on every rank, the
compiled output and every gradient bitwise equal to eager (and, for the attention, close to
float64 ``scaled_dot_product_attention`` on the global tensors; fp32, and bf16 with a key-padding
mask), the eager call going through the ring's ``autograd.Function`` (no custom op), a compiled
call before any
eager call refused on every rank, and a changed sequence length raising the same error on
every rank, after which one eager call agrees again and the compiled call runs the new
length, equal to eager.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition
from distfuse.errors import ShapeError
from distfuse.geometry.decomposition import block_range
from distfuse.layers import DistributedAttention, DistributedMultiheadAttention, attention_ring, distributed_attention
from distfuse.layers.attention_ring import local_positions
from distfuse.testing import run_ranks
from tests.misuse_support import tracing_refusal
from tests.test_attention_ring import _reference
from tests.test_compile_linear_fused import _recording
from tests.test_conv_support import with_path
from tests.tolerances import tol

RANKS = (3, 1, 0, 2)  # a permuted [2, 2] grid


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _explain(fn, *args) -> tuple[int, int, list[str]]:
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_break_count, explained.graph_count, [str(r.reason)[:300] for r in explained.break_reasons]


def _nodes(y) -> list[str]:
    """The autograd nodes behind ``y`` (an eager call's graph)."""
    out, todo = [], [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            out.append(type(node).__name__)
            todo += [n for n, _ in node.next_functions]
    return out


def _changed(compiled, call):
    """The error of a compiled call whose inputs changed (None when it ran)."""
    try:
        call(compiled)
    except ShapeError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------- DistributedAttention (one ring per grid row)


def _attention_case(causal, layout, Hq, Hkv, S, S2, dtype, with_mask):
    torch._dynamo.reset()
    P_grid = Partition.world().create_partition_inclusive(list(RANKS)).create_cartesian_topology_partition([2, 2])
    P_cp = P_grid.create_cartesian_subtopology_partition([False, True])  # each row of the grid is a ring of 2
    layer = DistributedAttention(P_cp, causal=causal, layout=layout)
    gen = torch.Generator().manual_seed(100 + P_grid.index[0])  # each ring its own data
    B, D, W = 2, 4, P_cp.size
    data, masks = {}, {}
    for n in (S, S2):
        data[n] = [torch.randn(B, h, n, D, generator=gen, dtype=torch.float64).to(dtype) for h in (Hq, Hkv, Hkv, Hq)]
        masks[n] = None
        if with_mask:  # a key-padding mask: it travels with its keys
            masks[n] = torch.rand(B, n, generator=gen) < 0.7
            masks[n][:, 0] = True  # every query row keeps a key (SDPA returns NaN for a row with none)

    def local(n=S):  # requiring grad, as in step: the signature agreed eagerly
        pos = local_positions(n, W, P_cp.rank, layout)
        mask = None if masks[n] is None else masks[n][:, pos].clone()
        return (*(t[:, :, pos].clone().requires_grad_() for t in data[n][:3]), mask)

    def step(fn, n=S):
        ql, kl, vl, mask = local(n)
        out = fn(ql, kl, vl, mask)
        out.backward(data[n][3][:, :, local_positions(n, W, P_cp.rank, layout)])
        return out.detach(), ql.grad, kl.grad, vl.grad

    refused = tracing_refusal(lambda: torch.compile(layer, fullgraph=True, dynamic=False, backend="eager")(*local()))
    torch._dynamo.reset()
    eager = step(layer)
    eager_nodes = _nodes(layer(*local()))  # the eager path: the autograd.Function, not the custom op
    breaks, graphs, reasons = _explain(layer, *local())
    torch._dynamo.reset()
    ops = []
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend=_recording(ops))
    comp = step(compiled)
    bitwise = all(_same(a, b) for a, b in zip(comp, eager, strict=True))
    first_ops = list(ops)
    # against float64 SDPA on this ring's global tensors
    q, k, v, dout = data[S]
    ref = _reference(q, k, v, dout, causal, masks[S])
    pos = local_positions(S, W, P_cp.rank, layout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), comp, ref, strict=True):
        assert got.dtype == dtype, (name, got.dtype)
        torch.testing.assert_close(got.double(), want[:, :, pos], **tol(dtype, terms=S * D),
                                   msg=lambda m, n=name: f"compiled {n}: {m}")
    # a new sequence length: every rank raises; one eager call agrees again and the compiled call follows
    error = _changed(compiled, lambda fn: fn(*local(S2)))
    again = step(layer, S2)
    same = all(_same(a, b) for a, b in zip(step(compiled, S2), again, strict=True))
    return dict(refused=refused, breaks=breaks, graphs=graphs, reasons=reasons, bitwise=bitwise, ops=first_ops,
                error=error, same=same, mode=layer.session.last_mode, eager_nodes=eager_nodes)


@pytest.mark.parametrize("causal,layout,Hq,Hkv,S,S2,dtype,with_mask", [
    pytest.param(True, "contiguous", 4, 2, 7, 6, torch.float32, False, id="causal-gqa-uneven-S7"),
    pytest.param(True, "zigzag", 4, 1, 8, 12, torch.bfloat16, True, id="causal-zigzag-gqa-bf16-mask"),
])
def test_compiled_ring_attention(causal, layout, Hq, Hkv, S, S2, dtype, with_mask):
    results = run_ranks(4, _attention_case, causal, layout, Hq, Hkv, S, S2, dtype, with_mask, timeout=240)
    for rank, r in enumerate(results):
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r["breaks"], r["graphs"], r["reasons"])
        assert r["bitwise"], f"rank {rank}: compiled results differ from eager"
        assert r["refused"] is not None and "UnsupportedError" in r["refused"] and "once eagerly" in r["refused"], \
            (rank, r["refused"])
        assert r["error"] is not None and "eagerly" in r["error"], (rank, r["error"])
        assert r["same"], rank
        assert r["mode"] == "replay", (rank, r["mode"])
        assert "_RingAttentionBackward" in r["eager_nodes"] and "_FirstOrderOnlyBackward" in r["eager_nodes"], \
            (rank, r["eager_nodes"])
        assert not any("ring_attention" in n for n in r["eager_nodes"]), (rank, r["eager_nodes"])
    assert len({tuple(r["ops"]) for r in results}) == 1, [r["ops"] for r in results]
    assert results[0]["ops"] == ["fw:distfuse.flag_check.default", "fw:distfuse.ring_attention.default",
                                 "bw:distfuse.ring_attention_backward.default"], results[0]["ops"]


def _functional_case():
    """``distributed_attention`` compiled: its per-partition session replays what the eager call settled."""
    torch._dynamo.reset()
    P_cp = Partition.world().create_partition_inclusive([2, 0, 3, 1])
    attention_ring._RINGS.pop((P_cp.ranks, getattr(P_cp, "shape", None)), None)  # fresh, whatever ran before
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 2, 4, generator=gen) for _ in range(3))

    def fn(q, k, v):
        return distributed_attention(q, k, v, P_cp, causal=True, layout="zigzag")

    refused = tracing_refusal(lambda: torch.compile(fn, fullgraph=True, dynamic=False, backend="eager")(q, k, v))
    torch._dynamo.reset()
    eager = fn(q, k, v)
    ops = []
    comp = torch.compile(fn, fullgraph=True, dynamic=False, backend=_recording(ops))(q, k, v)
    return refused, torch.equal(comp, eager), ops


def test_compiled_functional_form():
    results = run_ranks(4, _functional_case, timeout=120)
    for rank, (refused, equal, ops) in enumerate(results):
        assert refused is not None and "once eagerly" in refused, (rank, refused)
        assert equal, rank
        assert ops == ["fw:distfuse.flag_check.default", "fw:distfuse.ring_attention.default"], (rank, ops)


# ---------------------------------------------------------------- DistributedMultiheadAttention on [context, tensor]


def _mha_case(layout, S, S2, sp=False, pad=False):
    torch._dynamo.reset()
    P = Partition.world().create_partition_inclusive(list(RANKS)).create_cartesian_topology_partition([2, 2])
    E, H, Hkv, B = 8, 4, 2, 2
    torch.manual_seed(11)
    layer = DistributedMultiheadAttention(P, E, H, Hkv, causal=True, layout=layout, sequence_parallel=sp)
    gen = torch.Generator().manual_seed(12)
    data = {n: [torch.randn(B, n, E, generator=gen) for _ in range(2)] for n in (S, S2)}

    def rows(n):
        pos = local_positions(n, P.shape[0], P.index[0], layout)
        return pos[slice(*block_range(len(pos), P.shape[1], P.index[1]))] if sp else pos

    def x_of(n=S):
        return data[n][0][:, rows(n)].clone()

    def call(fn, x, n=S):  # pad: batch b's last b + 1 keys are padding (every query keeps key 0)
        if not pad:
            return fn(x)
        return fn(x, key_padding_mask=(torch.arange(n)[None, :] >= n - 1 - torch.arange(B)[:, None])[:, rows(n)])

    def step(fn, n=S):
        x = x_of(n).requires_grad_()
        y = call(fn, x, n)
        y.backward(data[n][1][:, rows(n)])
        grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return y.detach(), x.grad, grads

    refused = tracing_refusal(
        lambda: call(torch.compile(layer, fullgraph=True, dynamic=False, backend="eager"), x_of()))
    torch._dynamo.reset()
    eager = step(layer)
    breaks, graphs, reasons = _explain(lambda x: call(layer, x), x_of().requires_grad_())
    torch._dynamo.reset()
    ops = []
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend=_recording(ops))
    comp = step(compiled)
    bitwise = _same(comp[0], eager[0]) and _same(comp[1], eager[1]) and comp[2].keys() == eager[2].keys() and \
        all(torch.equal(comp[2][k], eager[2][k]) for k in eager[2])
    first_ops = list(ops)
    error = _changed(compiled, lambda fn: call(fn, x_of(S2), S2))
    again = step(layer, S2)
    later = step(compiled, S2)
    same = _same(later[0], again[0]) and _same(later[1], again[1]) and \
        all(torch.equal(later[2][k], again[2][k]) for k in again[2])
    return dict(rank=dist.get_rank(), refused=refused, breaks=breaks, graphs=graphs, reasons=reasons,
                bitwise=bitwise, ops=first_ops, error=error, same=same, n_grads=len(eager[2]))


@pytest.mark.parametrize("layout,S,S2", [
    pytest.param("contiguous", 5, 6, id="gqa-causal-uneven-S5"),
    pytest.param("zigzag", 8, 4, id="gqa-causal-zigzag"),
])
def test_compiled_multihead_attention(layout, S, S2):
    results = run_ranks(4, _mha_case, layout, S, S2, timeout=240)
    for rank, r in enumerate(results):
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r["breaks"], r["graphs"], r["reasons"])
        assert r["bitwise"] and r["n_grads"] == 8, f"rank {rank}: compiled results differ from eager"
        assert r["refused"] is not None and "UnsupportedError" in r["refused"] and "once eagerly" in r["refused"], \
            (rank, r["refused"])
        assert r["error"] is not None and "eagerly" in r["error"], (rank, r["error"])
        assert r["same"], rank
    assert len({tuple(r["ops"]) for r in results}) == 1, [r["ops"] for r in results]
    # the layer's flag (over P: it covers the ring's call, which has no flag of its own), the parameters and x
    # replicated (over the context, then the tensor axis), the ring, the sum over the tensor axis; backward, the
    # adjoints in reverse
    assert results[0]["ops"] == [f"{kind}:distfuse.{op}.default" for kind, op in (
        ("fw", "flag_check"), ("fw", "replicate"), ("fw", "replicate"),
        ("fw", "ring_attention"), ("fw", "replicate_adjoint"), ("bw", "replicate"),
        ("bw", "ring_attention_backward"), ("bw", "replicate_adjoint"), ("bw", "replicate_adjoint"))], \
        results[0]["ops"]
    assert all("DistributedMultiheadAttention" in r["error"] for r in results), [r["error"] for r in results]


def _sp_case(layout, S, S2):
    return with_path("fused", lambda: _mha_case(layout, S, S2, sp=True, pad=True))


def test_compiled_sequence_parallel_attention():
    """The sequence-parallel layer with a key-padding mask: its projections are the fused all-gather + GEMM and
    GEMM + reduce-scatter ops (Triton interpreted) in both graphs, the mask's rows gathered over the tensor axis
    into the ring, and the compiled call equals eager bitwise."""
    results = run_ranks(4, _sp_case, "zigzag", 8, 4, timeout=240)
    for rank, r in enumerate(results):
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r["breaks"], r["graphs"], r["reasons"])
        assert r["bitwise"] and r["n_grads"] == 8 and r["same"], f"rank {rank}: compiled results differ from eager"
        assert r["error"] is not None and "eagerly" in r["error"], (rank, r["error"])
    assert len({tuple(r["ops"]) for r in results}) == 1, [r["ops"] for r in results]
    ops = results[0]["ops"]
    for op in ("fw:distfuse.all_gather_matmul.default", "fw:distfuse.ring_attention.default",
               "fw:distfuse.matmul_reduce_scatter.default", "bw:distfuse.matmul_reduce_scatter_backward.default",
               "bw:distfuse.all_gather_matmul_backward.default", "fw:distfuse.all_gather.default"):
        assert op in ops, (op, ops)


def _mha_inductor_case(sp: bool):
    """The layer compiled by inductor (its generated code around distfuse's ops) against eager: outputs and every
    gradient close (inductor may reorder the projections' arithmetic, so not bitwise)."""
    torch._dynamo.reset()
    P = Partition.world().create_partition_inclusive(list(RANKS)).create_cartesian_topology_partition([2, 2])
    E, H, Hkv, B, S = 8, 4, 2, 2, 8
    torch.manual_seed(11)
    layer = DistributedMultiheadAttention(P, E, H, Hkv, causal=True, layout="zigzag", sequence_parallel=sp)
    gen = torch.Generator().manual_seed(12)
    x_g, dy_g = torch.randn(B, S, E, generator=gen), torch.randn(B, S, E, generator=gen)
    pos = local_positions(S, P.shape[0], P.index[0], "zigzag")
    if sp:
        pos = pos[slice(*block_range(len(pos), P.shape[1], P.index[1]))]

    def step(fn):
        x = x_g[:, pos].clone().requires_grad_()
        y = fn(x)
        y.backward(dy_g[:, pos])
        grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return [y.detach(), x.grad, *grads.values()]

    eager = step(layer)
    compiled = step(torch.compile(layer, fullgraph=True, dynamic=False, backend="inductor"))
    t = tol(torch.float32, terms=B * S * E)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, **t)
    paths = sorted({d.path for d in layer.last_decisions.values()} | {layer.attention.last_decision.path})
    return len(eager), paths


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DISTFUSE_TEST_INDUCTOR") != "1",
                    reason="inductor's first compile takes tens of seconds on the loaded 2-core CI machine; "
                           "DISTFUSE_TEST_INDUCTOR=1 runs it")
@pytest.mark.parametrize("sp,path", [(False, "auto"), (True, "auto"), (True, "fused")],
                         ids=["replicated", "sequence-parallel", "sequence-parallel-fused"])
def test_compiled_multihead_attention_inductor(sp, path):
    """``fused``: the projections' fused ops and the ring's symmetric push inside inductor's graphs."""
    got = run_ranks(4, _with_path_case, path, sp, timeout=600)
    # y, dx and the 8 parameter gradients; the paths the projections (sequence-parallel) and the ring took
    assert got == [(10, ["fused"] if path == "fused" else ["unfused"])] * 4, got


def _with_path_case(path: str, sp: bool):
    return with_path(path, lambda: _mha_inductor_case(sp))
