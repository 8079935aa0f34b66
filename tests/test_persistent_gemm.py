"""The persistent GEMM + scatter producer (tensor descriptors, one flag per chunk) under the interpreter.

It must write exactly what the pointer producer writes: the same slots, the same flags,
the counters reset, so that ``chunk_reduce`` cannot tell them apart.  References are
float64 GEMMs of the inputs, built with torch alone.  Interpreted programs cost ~0.1 s
each, so shapes are tiny and the persistent grid is 2-3 programs walking several tiles.
"""

import math

import pytest
import torch

from distfuse.errors import UnsupportedError
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.matmul_reduce_scatter import (
    chunk_reduce,
    matmul_reduce_scatter_reference,
    matmul_scatter,
    matmul_scatter_workspace_bytes,
)
from distfuse.kernels.matmul_scatter_persistent import persistent_supported
from tests.tolerances import tol

# Several row and column tiles per chunk; 3 programs walk all W chunks' tiles.
PERSISTENT = dict(kernel="persistent", BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, PROGRAMS=3)


def _inputs(lead, n, W, K, N, dtype, seed=0, weight_kmajor=False):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(*lead, n, K, generator=g).to(dtype) for _ in range(W)]
    if weight_kmajor:  # [N, K] views of contiguous [K, N] weights (x @ w with w stored [K, N])
        w = [(torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype).t() for _ in range(W)]
    else:
        w = [(torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype) for _ in range(W)]
    bias = torch.randn(N, generator=g).to(dtype)
    return a, w, bias


def _ref64(a, w, rank, bias):
    n, K = a[0].shape[-2:]
    start, stop = block_range(n, len(a), rank)
    y = sum(x.reshape(-1, n, K)[:, start:stop].double() @ v.double().t() for x, v in zip(a, w, strict=True))
    return y + bias.double() if bias is not None else y


def _run(a, w, bias, W, n, N, config, partial_dtype, out_dtype):
    B = math.prod(a[0].shape[:-2])
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    with ws.in_flight("test"):
        for r in range(W):
            matmul_scatter(a[r], w[r], ws, r, W, partial_dtype=partial_dtype, config=config)
        outs = []
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=out_dtype)  # poisoned
            outs.append(chunk_reduce(ws, r, W, B, n, N, partial_dtype=partial_dtype, bias=bias, out_dtype=out_dtype,
                                     out=out))
    return ws, outs


def _assert_close(got, ref, dtype):
    assert not torch.isnan(got).any(), "an output element was never written"
    torch.testing.assert_close(got.double(), ref.double(), **tol(dtype))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("kmajor", [pytest.param(False, id="w[N,K]"), pytest.param(True, id="w[K,N]")])
def test_persistent_matches_float64(dtype, kmajor):
    """Uneven chunks (n = 10 over 3), a batch of 2, tiles that straddle the chunk end, both weight layouts."""
    lead, n, W, K, N = (2,), 10, 3, 32, 24
    a, w, bias = _inputs(lead, n, W, K, N, dtype, weight_kmajor=kmajor)
    assert persistent_supported(a[0].reshape(2, n, K), w[0])[0]
    _, outs = _run(a, w, bias, W, n, N, PERSISTENT, torch.float32, dtype)
    for r in range(W):
        _assert_close(outs[r], _ref64(a, w, r, bias), dtype)
    if dtype != torch.float32:  # default partials: the output dtype, rounded once more (the reference models it)
        _, outs = _run(a, w, bias, W, n, N, PERSISTENT, dtype, dtype)
        for r in range(W):
            _assert_close(outs[r], matmul_reduce_scatter_reference(a, w, r, bias=bias), dtype)


def test_persistent_writes_what_the_pointer_kernel_writes():
    """Same block sizes, same K order: the slots are bitwise equal, and the flags and counters end alike."""
    lead, n, W, K, N = (1,), 9, 3, 32, 20
    a, w, _ = _inputs(lead, n, W, K, N, torch.float32, seed=3)
    blocks = {k: v for k, v in PERSISTENT.items() if k.startswith(("BLOCK", "GROUP"))}
    ws_p, outs_p = _run(a, w, None, W, n, N, PERSISTENT, torch.float32, torch.float32)
    ws_t, outs_t = _run(a, w, None, W, n, N, blocks, torch.float32, torch.float32)
    for r in range(W):
        assert torch.equal(outs_p[r], outs_t[r])
        vp, vt = ws_p.rank_view(r), ws_t.rank_view(r)
        assert torch.equal(vp.flags, vt.flags) and vp.flags[r].tolist() == [1] * W
        assert int(vp.counters.abs().sum()) == 0  # the completing tile of each chunk reset its counter
        nbytes = matmul_scatter_workspace_bytes(1, n, N, W, torch.float32)
        assert torch.equal(vp.data(torch.uint8, nbytes), vt.data(torch.uint8, nbytes))


@pytest.mark.parametrize("case", [pytest.param(dict(lead=(1,), n=2, W=3), id="n2-W3-empty-chunk"),
                                  pytest.param(dict(lead=(1,), n=11, W=8), id="W8")])
def test_persistent_small_and_empty_chunks_and_two_epochs(case):
    """An empty chunk still gets its flag; W = 8; a second op on the same workspace (epoch 2) reuses the counters."""
    lead, n, W, K, N = case["lead"], case["n"], case["W"], 16, 16
    B = math.prod(lead)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    for epoch, seed in ((1, 5), (2, 6)):
        a, w, bias = _inputs(lead, n, W, K, N, torch.float32, seed=seed)
        with ws.in_flight("test"):
            for r in range(W):
                matmul_scatter(a[r], w[r], ws, r, W, partial_dtype=torch.float32,
                               config=dict(PERSISTENT, BLOCK_M=16, PROGRAMS=2))
            for r in range(W):
                out = chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, bias=bias)
                _assert_close(out, _ref64(a, w, r, bias), torch.float32)
                assert ws.rank_view(r).flags[r].tolist() == [epoch] * W
                assert int(ws.rank_view(r).counters.abs().sum()) == 0


def test_unsupported_layouts_fall_back_to_the_pointer_kernel():
    """K = 6 in fp32 is a 24-byte row stride (TMA needs multiples of 16 bytes): same results, pointer kernel."""
    lead, n, W, K, N = (1,), 7, 2, 6, 10
    a, w, bias = _inputs(lead, n, W, K, N, torch.float32, seed=9)
    ok, why = persistent_supported(a[0].reshape(1, n, K), w[0])
    assert not ok and "16-byte" in why
    _, outs = _run(a, w, bias, W, n, N, PERSISTENT, torch.float32, torch.float32)
    for r in range(W):
        _assert_close(outs[r], _ref64(a, w, r, bias), torch.float32)


def test_unknown_kernel_is_refused():
    W, n, K, N = 2, 4, 16, 16
    a, w, _ = _inputs((1,), n, W, K, N, torch.float32)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    with pytest.raises(UnsupportedError, match="config\\['kernel'\\]"), ws.in_flight("test"):
        matmul_scatter(a[0], w[0], ws, 0, W, config=dict(kernel="warp_specialized"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_persistent_loopback_cuda(dtype):
    """Compiled (sm_90: TMA loads): realistic sizes, uneven chunks, the pinned tiles, one program per SM."""
    from tests.tolerances import assert_rel_close

    W, lead, n, K, N = 4, (2,), 1030, 1024, 768
    dev = torch.device("cuda")
    a, w, bias = _inputs(lead, n, W, K, N, dtype)
    a, w, bias = [x.to(dev) for x in a], [x.to(dev) for x in w], bias.to(dev)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32), dev)
    ws.strict = True
    with ws.in_flight("test"):
        for r in range(W):
            matmul_scatter(a[r], w[r], ws, r, W, partial_dtype=torch.float32, config=dict(kernel="persistent"))
        for r in range(W):
            out = chunk_reduce(ws, r, W, 2, n, N, partial_dtype=torch.float32, bias=bias, out_dtype=dtype)
            assert_rel_close(out, _ref64([x.cpu() for x in a], [v.cpu() for v in w], r, bias.cpu()), dtype)
