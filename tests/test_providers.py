"""Providers of the fused GEMM + reduce-scatter: cuBLAS per chunk beside the Triton producers, and choosing one.

Every provider writes the same slots and flags for the one consumer (``chunk_reduce``);
here each is checked against float64 references built with torch alone (forward and
every gradient), in loopback and across processes on ``/dev/shm`` workspaces (permuted
rank orders, a rank outside the partition).  The choice between providers
(``DISTFUSE_PROVIDER``, the crossover table's ``provider`` / ``provider_sizes``, the
op's default) and what the sweep records are checked as pure functions.
"""

import math
import os

import pytest
import torch

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, ConfigError, PartitionError, UnsupportedError
from distfuse.fused import registry, symmetric
from distfuse.fused.matmul_reduce_scatter import (
    matmul_reduce_scatter,
    matmul_reduce_scatter_loopback,
    matmul_reduce_scatter_workspace_bytes,
)
from distfuse.fused.matmul_reduce_scatter_cublas import matmul_scatter_cublas
from distfuse.fused.providers import providers_of, select_provider
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter_workspace_bytes
from distfuse.layers.dispatch import DeviceCaps, select_path
from distfuse.testing import run_ranks
from distfuse.tune.crossover_fit import entry_for, provider_fields
from distfuse.tune.table import check_entry, load_table, table_key, write_table
from tests.tolerances import tol

F64 = torch.float64
RS = registry.MATMUL_REDUCE_SCATTER.name
PROVIDERS = ("triton", "triton_persistent", "cublas_chunks")


def _data(seed, W, lead, n, K, N):
    """x_p [*lead, n, K_p] (K split unevenly over W), w_p [N, K_p], one bias [N], the global dy [*lead, n, N]."""
    g = torch.Generator().manual_seed(seed)
    Ks = [block_extent(K, W, p) for p in range(W)]
    return dict(xs=[torch.randn(*lead, n, k, generator=g, dtype=F64) for k in Ks],
                ws=[torch.randn(N, k, generator=g, dtype=F64) / math.sqrt(K) for k in Ks],
                b=torch.randn(N, generator=g, dtype=F64), dy=torch.randn(*lead, n, N, generator=g, dtype=F64))


def _ref(d, r, W, dtype):
    """Rank r's output and gradients from the gathered global tensors (float64 of the dtype-rounded data)."""
    xs = [x.to(dtype).double() for x in d["xs"]]
    ws = [w.to(dtype).double() for w in d["ws"]]
    b, dy = d["b"].to(dtype).double(), d["dy"].to(dtype).double()
    x_full, w_full = torch.cat(xs, dim=-1), torch.cat(ws, dim=-1)  # the unsplit linear
    n = dy.shape[-2]
    rows = slice(*block_range(n, W, r))
    y = torch.nn.functional.linear(x_full, w_full, b)
    flat_dy = dy.reshape(-1, dy.shape[-1])
    return dict(y=y[..., rows, :], dx=dy @ ws[r], dw=flat_dy.t() @ xs[r].reshape(-1, xs[r].shape[-1]),
                db=dy[..., rows, :].reshape(-1, dy.shape[-1]).sum(0))


def _close(got, ref, dtype, what):
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert not torch.isnan(got).any(), f"{what}: NaN (never written, or a wait gave up)"
    torch.testing.assert_close(got.double(), ref, **tol(dtype), msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- loopback: forward and every gradient


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_provider_trains_like_float64(provider, dtype):
    W, lead, n, K, N = 3, (2,), 7, 40, 16  # n and K uneven over W
    d = _data(1, W, lead, n, K, N)
    xs = [x.to(dtype).requires_grad_() for x in d["xs"]]
    ws_ = [w.to(dtype).requires_grad_() for w in d["ws"]]
    b = d["b"].to(dtype).requires_grad_()
    ws = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(2, n, N, W, dtype, torch.float32))
    ys = matmul_reduce_scatter_loopback(xs, ws_, b, ws, partial_dtype=torch.float32, provider=provider)
    dys = [d["dy"][..., slice(*block_range(n, W, r)), :].to(dtype) for r in range(W)]
    torch.autograd.backward(ys, dys)
    db_ref = sum(_ref(d, r, W, dtype)["db"] for r in range(W))  # the shared bias collects every rank's partial
    for r in range(W):
        ref = _ref(d, r, W, dtype)
        _close(ys[r].detach(), ref["y"], dtype, f"{provider} y[{r}]")
        _close(xs[r].grad, ref["dx"], dtype, f"{provider} dx[{r}]")
        _close(ws_[r].grad, ref["dw"], dtype, f"{provider} dw[{r}]")
    _close(b.grad, db_ref, dtype, f"{provider} db")


# Both schedules of the cuBLAS provider, with small and empty chunks: tests/test_scatter_partial.py.


@pytest.mark.parametrize("whole", [False, True], ids=["per-chunk", "whole"])
def test_cublas_chunks_missing_source_raises_and_poisons(whole):
    W, n, K, N = 3, 6, 8, 8
    d = _data(3, W, (1,), n, K, N)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    out = torch.zeros(1, block_extent(n, W, 0), N)
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[1\] was not raised"), \
            ws.in_flight("missing source"):
        for r in (0, 2):  # virtual rank 1 never produces
            matmul_scatter_cublas(d["xs"][r].float(), d["ws"][r].float(), ws, r, W, whole=whole)
        chunk_reduce(ws, 0, W, 1, n, N, partial_dtype=torch.float32, out=out)
    assert torch.isnan(out).all(), "a chunk missing a source must be NaN, not a plausible partial sum"


def test_bad_provider_is_refused():
    W, n, K, N = 2, 4, 8, 8
    d = _data(4, W, (1,), n, K, N)
    ws = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(1, n, N, W, torch.float32))
    with pytest.raises(UnsupportedError, match="provider: expected triton or triton_persistent or cublas_chunks"):
        matmul_reduce_scatter_loopback([x.float() for x in d["xs"]], [w.float() for w in d["ws"]], None, ws,
                                       provider="nccl")


# ---------------------------------------------------------------- across processes (/dev/shm)


def _rank_providers(dtype_name, order):
    """Each provider on the [1, W, 1] partition of ``order`` (world ranks, permuted; others inactive)."""
    dtype = getattr(torch, dtype_name)
    world = Partition.world()
    P = world.create_partition_inclusive(order).create_cartesian_topology_partition([1, len(order), 1])
    if not P.active:
        x = torch.zeros(1, 5, 4, dtype=dtype)
        try:
            matmul_reduce_scatter(x, torch.zeros(3, 4, dtype=dtype), None, P, provider="cublas_chunks")
            refused = False
        except PartitionError:
            refused = True
        return dict(active=False, refused=refused)
    W, r = P.size, P.rank
    lead, n, K, N = (2,), 7, 10, 12
    d = _data(7, W, lead, n, K, N)
    results = {}
    for provider in PROVIDERS:
        x = d["xs"][r].to(dtype).requires_grad_()
        w = d["ws"][r].to(dtype).requires_grad_()
        b = d["b"].to(dtype).requires_grad_()
        y = matmul_reduce_scatter(x, w, b, P, provider=provider, partial_dtype=torch.float32)
        y.backward(d["dy"][..., slice(*block_range(n, W, r)), :].to(dtype))
        results[provider] = dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)
    names = symmetric._CACHE[(P.ranks, "cpu")].segment_names
    close_all()
    return dict(active=True, rank=r, W=W, results=results, ref=_ref(d, r, W, dtype), names=names)


@pytest.mark.parametrize("world,dtype,order", [
    pytest.param(3, "float32", [2, 0, 1], id="W3-fp32-permuted"),
    pytest.param(4, "bfloat16", [3, 1, 0], id="world4-W3-bf16-one-inactive"),
])
def test_providers_across_processes(world, dtype, order):
    out = run_ranks(world, _rank_providers, dtype, order)
    dt = getattr(torch, dtype)
    for o in out:
        if not o["active"]:
            assert o["refused"], "a rank outside the partition must get PartitionError"
            continue
        for provider, res in o["results"].items():
            for key in ("y", "dx", "dw", "db"):
                _close(res[key], o["ref"][key], dt, f"{provider} {key} partition rank {o['rank']}")
    assert sum(o["active"] for o in out) == len(order)
    assert not [n for o in out if o["active"] for n in o["names"] if os.path.exists(os.path.join(symmetric.SHM_DIR, n))]


# ---------------------------------------------------------------- choosing a provider


def test_registry_lists_the_providers_default_first():
    assert providers_of(RS) == PROVIDERS
    assert providers_of(registry.ALL_GATHER_MATMUL.name) == ("triton", "copy_engine")


def test_select_provider_env_then_table_then_default(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTFUSE_PROVIDER", raising=False)
    shapes = dict(m=4096, n=4096, k=1792)  # macs ~3e10
    key = table_key("GPU X", 8, torch.bfloat16, RS)
    assert select_provider(RS, shapes, torch.bfloat16, 8, "GPU X", table={}) == "triton"
    old = {key: {"min_size": 1e9}}  # a table written before providers: the default
    assert select_provider(RS, shapes, torch.bfloat16, 8, "GPU X", table=old) == "triton"
    entry = {"min_size": 1e9, "provider": "cublas_chunks",
             "provider_sizes": [[1e8, "cublas_chunks"], [1e10, "triton_persistent"], [1e12, "cublas_chunks"]]}
    assert select_provider(RS, shapes, torch.bfloat16, 8, "GPU X", table={key: entry}) == "triton_persistent"
    assert select_provider(RS, dict(m=64, n=64, k=64), torch.bfloat16, 8, "GPU X", table={key: entry}) == \
        "cublas_chunks"
    assert select_provider(RS, shapes, torch.bfloat16, 8, "GPU X", table={key: {"provider": "gone"}}) == "triton"
    monkeypatch.setenv("DISTFUSE_PROVIDER", "cublas_chunks")
    assert select_provider(RS, shapes, torch.bfloat16, 8, "GPU X", table={key: entry}) == "cublas_chunks"
    # An op without that provider keeps its own.
    assert select_provider(registry.ALL_GATHER_MATMUL.name, dict(m=8, n=8, k=8), torch.bfloat16, 8, "GPU X",
                           table={}) == "triton"
    # Dispatch reports the provider of a fused decision.
    monkeypatch.delenv("DISTFUSE_PROVIDER")
    caps = DeviceCaps("cuda", "GPU X", True, True)
    d = select_path(RS, shapes, torch.bfloat16, 8, caps, table={key: entry})
    assert d.path == "fused" and d.provider == "triton_persistent"
    assert select_path(RS, dict(m=1, n=1, k=1), torch.bfloat16, 8, caps, table={key: entry}).provider is None


def test_sweep_points_become_provider_fields_and_round_trip(tmp_path):
    points = [dict(size=1e6, unfused_ms=1.0, fused_ms=0.5, provider_ms={"triton": 0.9, "cublas_chunks": 0.5}),
              dict(size=1e9, unfused_ms=10.0, fused_ms=4.0, provider_ms={"triton": 4.0, "cublas_chunks": 6.0}),
              dict(size=1e12, unfused_ms=900.0, fused_ms=800.0, provider_ms={"triton": 850.0, "cublas_chunks": 800.0})]
    fields = provider_fields(points)
    assert fields == dict(provider="cublas_chunks",
                          provider_sizes=[[1e6, "cublas_chunks"], [1e9, "triton"], [1e12, "cublas_chunks"]])
    assert provider_fields([dict(size=1.0, unfused_ms=1.0, fused_ms=1.0)]) == {}
    entry = entry_for(RS, points)
    assert entry["provider_sizes"] == fields["provider_sizes"]
    path = tmp_path / "crossover.json"
    key = table_key("GPU X", 8, torch.bfloat16, RS)
    write_table(path, {key: entry})
    assert load_table(path)[key]["provider_sizes"] == fields["provider_sizes"]
    with pytest.raises(ConfigError, match="provider_sizes must be a list"):
        check_entry(path, key, dict(entry, provider_sizes=[[1e6]]))
    with pytest.raises(ConfigError, match="provider must be a string"):
        check_entry(path, key, dict(entry, provider=3))


@pytest.mark.cuda
@pytest.mark.parametrize("W,n", [(4, 1030), (8, 512)], ids=["W4-n1030", "W8-n512"])
@pytest.mark.parametrize("provider", ["triton_persistent", "cublas_chunks"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_providers_loopback_cuda(provider, dtype, W, n):
    """Compiled: peer slot views over device addresses, the stream-ordered flag kernel, fp32 partials of 16-bit
    inputs (cuBLAS's fp32 output), forward and every gradient at a realistic size; at n = 512 over W = 8 (64-row
    chunks) the cuBLAS provider's whole-GEMM schedule and the persistent producer's spanning row tiles."""
    from tests.tolerances import assert_rel_close

    lead, K, N = (2,), 1024, 768
    dev = torch.device("cuda")
    d = _data(8, W, lead, n, K, N)
    xs = [x.to(dev, dtype).requires_grad_() for x in d["xs"]]
    wts = [w.to(dev, dtype).requires_grad_() for w in d["ws"]]
    b = d["b"].to(dev, dtype).requires_grad_()
    ws = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(2, n, N, W, dtype, torch.float32), dev)
    ws.strict = True
    ys = matmul_reduce_scatter_loopback(xs, wts, b, ws, partial_dtype=torch.float32, provider=provider)
    torch.autograd.backward(ys, [d["dy"][..., slice(*block_range(n, W, r)), :].to(dev, dtype) for r in range(W)])
    for r in range(W):
        ref = _ref(d, r, W, dtype)
        assert_rel_close(ys[r], ref["y"], dtype, f"{provider} y[{r}]")
        assert_rel_close(xs[r].grad, ref["dx"], dtype, f"{provider} dx[{r}]")
        assert_rel_close(wts[r].grad, ref["dw"], dtype, f"{provider} dw[{r}]")
