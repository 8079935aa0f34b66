"""The all-gather + GEMM with the push on the copy engines (provider ``copy_engine``) beside the Triton push.

On CPU the side stream degenerates to in-order host copies into the peers' mappings,
each peer's flag written right after its rows; these tests run that path against float64
references built with torch alone (forward and every gradient), in loopback and across
processes on ``/dev/shm`` workspaces (uneven blocks, permuted rank orders, inactive
ranks, fp32 / fp16 / bf16), check that both pushes leave bitwise the same gathered rows
and flags in a NaN-poisoned workspace, and that a push that never comes turns into a
named error with the missing chunk poisoned.  The CUDA test checks the stream semantics
(side stream, event join) on one GPU in loopback.
"""

import math

import pytest
import torch

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, PartitionError
from distfuse.fused import registry
from distfuse.fused.all_gather_copy_engine import ag_push_copy_engine
from distfuse.fused.all_gather_matmul import (
    all_gather_matmul,
    all_gather_matmul_loopback,
    all_gather_matmul_workspace_bytes,
)
from distfuse.fused.providers import providers_of, select_provider
from distfuse.fused.symmetric import close_all, get_workspace
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.all_gather_matmul import ag_push, gathered_matmul
from distfuse.testing import run_ranks
from tests.test_fused_linear import _poison
from tests.tolerances import TERMS, tol

F64 = torch.float64
AG = registry.ALL_GATHER_MATMUL.name
PUSHES = ("triton", "copy_engine")


def _data(seed, W, lead, n, K, N):
    """x_p [*lead, n_p, K] (n split unevenly), w_p [N_p, K] (N split unevenly), b_p [N_p], dy_p [*lead, n, N_p]."""
    g = torch.Generator().manual_seed(seed)
    ns, Ns = [block_extent(n, W, p) for p in range(W)], [block_extent(N, W, p) for p in range(W)]
    return dict(xs=[torch.randn(*lead, m, K, generator=g, dtype=F64) for m in ns],
                ws=[torch.randn(c, K, generator=g, dtype=F64) / math.sqrt(K) for c in Ns],
                bs=[torch.randn(c, generator=g, dtype=F64) for c in Ns],
                dys=[torch.randn(*lead, n, c, generator=g, dtype=F64) for c in Ns])


def _ref(d, r, W, dtype):
    """Rank r's output and gradients of the column-parallel linear, from the global tensors in float64."""
    xs = [x.to(dtype).double() for x in d["xs"]]
    ws = [w.to(dtype).double() for w in d["ws"]]
    bs = [b.to(dtype).double() for b in d["bs"]]
    dys = [dy.to(dtype).double() for dy in d["dys"]]
    x_full = torch.cat(xs, dim=-2)
    n = x_full.shape[-2]
    y = torch.nn.functional.linear(x_full, ws[r], bs[r])
    dx_full = sum(dy @ w for dy, w in zip(dys, ws, strict=True))
    flat = dys[r].reshape(-1, dys[r].shape[-1])
    return dict(y=y, dx=dx_full[..., slice(*block_range(n, W, r)), :],
                dw=flat.t() @ x_full.reshape(-1, x_full.shape[-1]), db=flat.sum(0))


def _close(got, ref, dtype, what, terms=TERMS):
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert not torch.isnan(got).any(), f"{what}: NaN (never written, or a wait gave up)"
    torch.testing.assert_close(got.double(), ref, **tol(dtype, terms=terms), msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- registry and choice


def test_all_gather_matmul_lists_both_pushes_and_the_table_picks_one():
    assert providers_of(AG) == PUSHES
    shapes = dict(m=4096, n=1024, k=4096)
    from distfuse.fused.crossover_table import table_key

    key = table_key("GPU X", 8, torch.bfloat16, AG)
    assert select_provider(AG, shapes, torch.bfloat16, 8, "GPU X", table={}) == "triton"
    entry = {"min_size": 1.0, "provider_sizes": [[1e6, "triton"], [1e10, "copy_engine"]]}
    assert select_provider(AG, shapes, torch.bfloat16, 8, "GPU X", table={key: entry}) == "copy_engine"
    assert select_provider(AG, dict(m=8, n=8, k=8), torch.bfloat16, 8, "GPU X", table={key: entry}) == "triton"


# ---------------------------------------------------------------- loopback: forward and every gradient


@pytest.mark.parametrize("provider", PUSHES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_push_trains_like_float64(provider, dtype):
    W, lead, n, K, N = 3, (2,), 7, 12, 10  # n and N uneven over W
    d = _data(1, W, lead, n, K, N)
    xs = [x.to(dtype).requires_grad_() for x in d["xs"]]
    wts = [w.to(dtype).requires_grad_() for w in d["ws"]]
    bs = [b.to(dtype).requires_grad_() for b in d["bs"]]
    ws = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(2, n, K, W, dtype))
    ys = all_gather_matmul_loopback(xs, wts, bs, ws, provider=provider)
    torch.autograd.backward(ys, [dy.to(dtype) for dy in d["dys"]])
    for r in range(W):
        ref = _ref(d, r, W, dtype)
        _close(ys[r].detach(), ref["y"], dtype, f"{provider} y[{r}]")
        _close(xs[r].grad, ref["dx"], dtype, f"{provider} dx[{r}]")
        _close(wts[r].grad, ref["dw"], dtype, f"{provider} dw[{r}]")
        _close(bs[r].grad, ref["db"], dtype, f"{provider} db[{r}]")


@pytest.mark.parametrize("case", [pytest.param(dict(lead=(2,), n=5, W=3), id="n5-W3"),
                                  pytest.param(dict(lead=(), n=2, W=4), id="n2-W4-empty-blocks")])
def test_copy_engine_writes_what_the_triton_push_writes(case):
    """Data only moves: bitwise the same gathered rows (in a NaN-poisoned workspace) and the same flags."""
    lead, n, W, K = case["lead"], case["n"], case["W"], 9
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(*lead, block_extent(n, W, r), K, generator=g).to(torch.float16) for r in range(W)]
    B = math.prod(lead)
    nbytes = all_gather_matmul_workspace_bytes(B, n, K, W, torch.float16)
    gathered = {}
    for push in PUSHES:
        ws = LoopbackWorkspace(W, nbytes)
        for r in range(W):
            ws.rank_view(r).data(torch.float16, B * n * K).fill_(float("nan"))
        with ws.in_flight(push):
            for r in range(W):
                (ag_push if push == "triton" else ag_push_copy_engine)(xs[r], ws, r, W, n)
            for r in range(W):
                flags = ws.rank_view(r).flags
                assert [int(flags[p, p]) for p in range(W) if p != r] == [ws.epoch] * (W - 1), (push, r)
        gathered[push] = [ws.rank_view(r).data(torch.float16, B * n * K).view(B, n, K).clone() for r in range(W)]
    full = torch.cat(xs, dim=-2).reshape(B, n, K)
    for r in range(W):
        own = slice(*block_range(n, W, r))
        others = torch.ones(n, dtype=torch.bool)
        others[own] = False
        for push in PUSHES:  # every peer row written exactly; the own rows stay untouched (the GEMM reads x)
            assert torch.equal(gathered[push][r][:, others], full[:, others]), (push, r)
            assert torch.isnan(gathered[push][r][:, own]).all(), (push, r)


def test_copy_engine_missing_push_raises_and_poisons():
    W, n, K, N = 3, 6, 8, 5
    d = _data(3, W, (1,), n, K, N)
    ws = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(1, n, K, W, torch.float32))
    sentinel = 1234.5  # finite: NaN is the signal of the chunk that never came
    out = torch.full((1, n, block_extent(N, W, 0)), sentinel)
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[2\] was not raised"), \
            ws.in_flight("missing push"):
        for r in (0, 1):  # virtual rank 2 never pushes
            ag_push_copy_engine(d["xs"][r].float(), ws, r, W, n)
        gathered_matmul(d["xs"][0].float(), d["ws"][0].float(), ws, 0, W, n, out=out)
    rows = slice(*block_range(n, W, 2))
    assert torch.isnan(out[:, rows]).all(), "the chunk that never came must be NaN"
    # the chunks that came (rank 0's own rows, rank 1's pushed rows) are computed: sums of K terms of unit scale
    x_came = torch.cat([d["xs"][r].float().double() for r in (0, 1)], dim=-2)
    ref = x_came @ d["ws"][0].float().double().t()
    assert rows.start == x_came.shape[-2] and rows.stop == n
    _close(out[:, :rows.start], ref, torch.float32, "the chunks that came", terms=K)


# ---------------------------------------------------------------- across processes (/dev/shm)


def _rank_pushes(dtype_name, order, n, keep_gathered):
    """Both pushes on the [1, W, 1] partition of ``order`` (world ranks, permuted; the others inactive)."""
    dtype = getattr(torch, dtype_name)
    world = Partition.world()
    P = world.create_partition_inclusive(order).create_cartesian_topology_partition([1, len(order), 1])
    if not P.active:
        try:
            all_gather_matmul(torch.zeros(1, 2, 4, dtype=dtype), torch.zeros(3, 4, dtype=dtype), None, P,
                              provider="copy_engine")
            return dict(active=False, refused=False)
        except PartitionError:
            return dict(active=False, refused=True)
    W, r = P.size, P.rank
    lead, K, N = (2,), 6, 2 * W + 1
    d = _data(7, W, lead, n, K, N)
    # Both pushes share this partition's cached workspace: NaN over it before each call (forward and backward), so
    # a push that skips rows reads poison, never the rows an earlier push left there.  (Each claim starts with a
    # barrier over the group, so no peer writes into this rank's buffer before its poison.)
    get_workspace(P, all_gather_matmul_workspace_bytes(math.prod(lead), n, K, W, dtype))
    results = {}
    for provider in PUSHES:
        x = d["xs"][r].to(dtype).requires_grad_()
        w = d["ws"][r].to(dtype).requires_grad_()
        b = d["bs"][r].to(dtype).requires_grad_()
        _poison(P)
        y = all_gather_matmul(x, w, b, P, keep_gathered=keep_gathered, n=n, provider=provider)
        _poison(P)
        y.backward(d["dys"][r].to(dtype))
        results[provider] = dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)
    close_all()
    return dict(active=True, rank=r, results=results, ref=_ref(d, r, W, dtype))


@pytest.mark.parametrize("world,dtype,order,n,keep", [
    pytest.param(3, "float32", [2, 0, 1], 7, True, id="W3-fp32-permuted"),
    pytest.param(4, "bfloat16", [3, 1, 0], 8, False, id="world4-W3-bf16-one-inactive-regather"),
    pytest.param(6, "float16", [5, 2, 4, 0, 1], 9, True, id="world6-W5-fp16-one-inactive"),
])
def test_pushes_across_processes(world, dtype, order, n, keep):
    out = run_ranks(world, _rank_pushes, dtype, order, n, keep)
    dt = getattr(torch, dtype)
    for o in out:
        if not o["active"]:
            assert o["refused"], "a rank outside the partition must get PartitionError"
            continue
        for provider, res in o["results"].items():
            for key in ("y", "dx", "dw", "db"):
                _close(res[key], o["ref"][key], dt, f"{provider} {key} partition rank {o['rank']}")
    assert sum(o["active"] for o in out) == len(order)


# ---------------------------------------------------------------- CUDA: the side stream


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_copy_engine_loopback_cuda(dtype):
    """Compiled: DMA copies and flag copies on the side stream, the GEMM on the current stream, forward and every
    gradient at a realistic size, the shard freed right after the call (record_stream keeps it alive)."""
    from tests.tolerances import assert_rel_close

    W, lead, n, K, N = 4, (2,), 1030, 512, 768
    dev = torch.device("cuda")
    d = _data(8, W, lead, n, K, N)
    xs = [x.to(dev, dtype).requires_grad_() for x in d["xs"]]
    wts = [w.to(dev, dtype).requires_grad_() for w in d["ws"]]
    bs = [b.to(dev, dtype).requires_grad_() for b in d["bs"]]
    ws = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(2, n, K, W, dtype), dev)
    ws.strict = True
    ys = all_gather_matmul_loopback(xs, wts, bs, ws, provider="copy_engine")
    torch.autograd.backward(ys, [dy.to(dev, dtype) for dy in d["dys"]])
    for r in range(W):
        ref = _ref(d, r, W, dtype)
        assert_rel_close(ys[r], ref["y"], dtype, f"y[{r}]")
        assert_rel_close(xs[r].grad, ref["dx"], dtype, f"dx[{r}]")
        assert_rel_close(wts[r].grad, ref["dw"], dtype, f"dw[{r}]")
        assert_rel_close(bs[r].grad, ref["db"], dtype, f"db[{r}]")


# ---------------------------------------------------------------- through the layer (DISTFUSE_PROVIDER)


def _rank_layer(dtype_name):
    import os

    import torch.nn.functional as F

    from distfuse.geometry.decomposition import local_slices
    from distfuse.layers import DistributedLinearAllGather, collect_sequential

    dtype = getattr(torch, dtype_name)
    P = Partition.world().create_partition_inclusive(range(3))
    P_feat, P_seq = P.create_cartesian_topology_partition([1, 1, 3]), P.create_cartesian_topology_partition([1, 3, 1])
    torch.manual_seed(3)
    layer = DistributedLinearAllGather(P_feat, 8, 10, P_x=P_seq, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    xg, dyg = torch.randn(2, 7, 8, generator=gen, dtype=F64), torch.randn(2, 7, 10, generator=gen, dtype=F64)
    x = xg[local_slices(xg.shape, P_seq.shape, P_seq.index)].to(dtype).requires_grad_(True)
    os.environ.update(DISTFUSE_PATH="fused", DISTFUSE_PROVIDER="copy_engine")
    try:
        y = layer(x)
    finally:
        os.environ.pop("DISTFUSE_PATH")
        os.environ.pop("DISTFUSE_PROVIDER")
    y.backward(dyg[local_slices(dyg.shape, P_feat.shape, P_feat.index)].to(dtype))
    seq = {k: v.double().requires_grad_(True) for k, v in (collect_sequential(layer) or {}).items()}
    x64 = xg.clone().requires_grad_(True)
    ref = None
    if seq:
        y64 = F.linear(x64, seq["weight"], seq["bias"])
        y64.backward(dyg)
        ref = dict(y=y64.detach(), dx=x64.grad, dw=seq["weight"].grad, db=seq["bias"].grad)
    grads = dict(dw=layer.weight.grad, db=None if layer.bias is None else layer.bias.grad)
    close_all()
    return dict(decision=(layer.last_decision.path, layer.last_decision.provider), y=y.detach(), dx=x.grad,
                grads=grads, ref=ref, y_slice=local_slices(dyg.shape, P_feat.shape, P_feat.index),
                x_slice=local_slices(xg.shape, P_seq.shape, P_seq.index))


def test_layer_runs_the_copy_engine_push_when_asked():
    out = run_ranks(3, _rank_layer, "float32")
    ref = next(o["ref"] for o in out if o["ref"] is not None)
    for r, o in enumerate(out):
        assert o["decision"] == ("fused", "copy_engine"), (r, o["decision"])
        _close(o["y"], ref["y"][o["y_slice"]], torch.float32, f"rank {r} y")
        _close(o["dx"], ref["dx"][o["x_slice"]], torch.float32, f"rank {r} dx")
    # The weight is split along the output features: the shards' gradients tile the sequential one.
    dw = torch.cat([o["grads"]["dw"] for o in out], dim=0)
    _close(dw, ref["dw"], torch.float32, "dw")
