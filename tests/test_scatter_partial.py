"""scatter_partial: a computed partial's rows into their owners' slots, and the cuBLAS provider's two schedules.

The copy is checked byte for byte against an oracle that writes the same rows through plain torch views
(block_range and the slot layout: ``[B_, len_c]`` rows, ``slot_row_stride(N)`` apart), on random data (a
missed row keeps the other workspace's bytes and fails), with uneven and empty chunks, a batch, W = 8 and
an empty launch; the flags and the arrival counters end as the other producers leave them.  The cuBLAS
provider's schedules are checked end to end against float64 with the consumer.
"""

import math

import pytest
import torch

from distfuse.fused.matmul_reduce_scatter_cublas import matmul_scatter_cublas
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.chunk_reduce import slot_row_stride
from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter_workspace_bytes
from distfuse.kernels.matmul_scatter_select import CUBLAS_WHOLE_ROWS, cublas_whole, select_scatter_kernel
from distfuse.kernels.scatter_partial import scatter_partial, sweep_configs
from tests.tolerances import tol

CASES = [
    pytest.param(dict(lead=(2,), n=7, W=3, N=13, dtype=torch.float32), id="uneven-batch2-N13"),
    pytest.param(dict(lead=(1,), n=2, W=3, N=16, dtype=torch.bfloat16), id="empty-chunk-bf16"),
    pytest.param(dict(lead=(), n=11, W=8, N=20, dtype=torch.float16), id="W8-fp16"),
    pytest.param(dict(lead=(3,), n=5, W=2, N=0, dtype=torch.float32), id="no-columns"),
]


def _oracle(partials, ws, W, n, N, dtype):
    """Every rank's rows copied into their owners' slots with torch views alone, and every flag raised."""
    B = math.prod(partials[0].shape[:-2])
    ld, q1 = slot_row_stride(N), -(-n // W)
    slot_elems = B * q1 * ld
    for owner in range(W):
        data = ws.rank_view(owner).data(dtype, W * slot_elems)
        start, stop = block_range(n, W, owner)
        L = stop - start
        for src in range(W):
            slot = data[src * slot_elems: src * slot_elems + B * L * ld].view(B, L, ld)
            slot[:, :, :N] = partials[src].reshape(B, n, N)[:, start:stop]
        ws.rank_view(owner).flags[owner].fill_(1)


@pytest.mark.parametrize("case", CASES)
def test_scatter_partial_writes_every_row_where_the_oracle_does(case):
    _check_scatter(case, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + [pytest.param(dict(lead=(1,), n=512, W=8, N=4096, dtype=torch.bfloat16),
                                                       id="llama3-8b-M512-TP8")])
def test_scatter_partial_writes_every_row_where_the_oracle_does_cuda(case):
    """Compiled: 16-byte loads and stores of 64 x 256-byte tiles over device slots, the flags released by the
    completing arrival of each chunk."""
    _check_scatter(case, torch.device("cuda"))


#: The tile configs the GPU sweep times (``scripts/gpu_diagnose.py --sections scatter``), each checked here first.
SWEEP_CONFIGS = sweep_configs(torch.bfloat16.itemsize)


@pytest.mark.parametrize("config", [dict(BLOCK_M=2, BLOCK_N=4, num_warps=1, PER_SM=1),
                                    dict(BLOCK_M=4, BLOCK_N=32, num_warps=1, PER_SM=3)], ids=["2x4", "4x32"])
def test_a_config_tiles_and_strides_the_same_rows(config):
    """Tiles smaller than a chunk and a grid smaller than the tiles (each program walks several, uneven chunks
    spanning tiles): the same bytes and flags as the oracle."""
    _check_scatter(dict(lead=(2,), n=9, W=4, N=13, dtype=torch.float32), torch.device("cpu"), config)


@pytest.mark.cuda
@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=lambda c: "{BLOCK_M}x{num_warps}w{PER_SM}".format(**c))
def test_every_swept_config_writes_what_the_oracle_does_cuda(config):
    _check_scatter(dict(lead=(1,), n=520, W=8, N=4096, dtype=torch.bfloat16), torch.device("cuda"), config)


def _check_scatter(case, device, config=None):
    lead, n, W, N, dtype = case["lead"], case["n"], case["W"], case["N"], case["dtype"]
    B = math.prod(lead)
    g = torch.Generator().manual_seed(11)
    partials = [torch.randn(*lead, n, N, generator=g).to(device, dtype) for _ in range(W)]
    nbytes = matmul_scatter_workspace_bytes(B, n, N, W, dtype)
    ws_k, ws_o = LoopbackWorkspace(W, nbytes, device), LoopbackWorkspace(W, nbytes, device)
    for ws in (ws_k, ws_o):  # the same random bytes under both: a row the kernel misses keeps them and differs
        for r in range(W):
            noise = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(r), dtype=torch.uint8)
            ws.rank_view(r).data(torch.uint8, nbytes).copy_(noise)
    with ws_k.in_flight("test"):
        for r in range(W):
            scatter_partial(partials[r], ws_k, r, W, config=config)
    _oracle(partials, ws_o, W, n, N, dtype)
    for r in range(W):
        vk, vo = ws_k.rank_view(r), ws_o.rank_view(r)
        assert torch.equal(vk.data(torch.uint8, nbytes), vo.data(torch.uint8, nbytes)), f"owner {r}'s slots"
        assert vk.flags[r].tolist() == [1] * W, f"owner {r}: every source raised its flag"
        assert int(vk.counters.abs().sum()) == 0, "the completing arrival of each chunk resets its counter"


@pytest.mark.parametrize("whole", [False, True], ids=["per-chunk", "whole"])
@pytest.mark.parametrize("case", [pytest.param(dict(lead=(1,), n=2, W=3), id="n2-W3-empty-chunk"),
                                  pytest.param(dict(lead=(2,), n=11, W=4), id="batch2-W4"),
                                  pytest.param(dict(lead=(), n=11, W=8), id="W8-no-lead")])
def test_cublas_schedules_reduce_like_float64(case, whole):
    """Both schedules of the cuBLAS provider, then the consumer, against the float64 product (K split over W)."""
    lead, n, W, N = case["lead"], case["n"], case["W"], 13  # N = 13: slot rows padded to 16
    B = math.prod(lead)
    g = torch.Generator().manual_seed(2)
    Ks = [block_extent(W * 4, W, p) for p in range(W)]
    xs = [torch.randn(*lead, n, k, generator=g, dtype=torch.float64) for k in Ks]
    wts = [torch.randn(N, k, generator=g, dtype=torch.float64) / math.sqrt(W * 4) for k in Ks]
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    full = torch.cat([x.float().double() for x in xs], -1) @ torch.cat([w.float().double() for w in wts], -1).t()
    with ws.in_flight("test"):
        for r in range(W):
            matmul_scatter_cublas(xs[r].float(), wts[r].float(), ws, r, W, whole=whole)
        for r in range(W):
            assert ws.rank_view(r).flags[r].tolist() == [1] * W
            out = torch.full((B, block_extent(n, W, r), N), float("nan"))  # poisoned
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, out=out)
            want = full.reshape(B, n, N)[:, slice(*block_range(n, W, r))]
            torch.testing.assert_close(out.double(), want, **tol(torch.float32, terms=W * 4 + W))


def test_cublas_schedule_rule_and_its_reason():
    assert cublas_whole(512, 8) and cublas_whole(1016, 8)  # 64 and 127 rows a chunk
    assert not cublas_whole(1024, 8) and not cublas_whole(8192, 8)  # 128 and 1024 rows a chunk
    assert not cublas_whole(0, 8)  # no row: no GEMM at all, per chunk or not
    a, w = torch.zeros(1, 512, 16), torch.zeros(32, 16)
    whole = select_scatter_kernel(a, w, "cublas_chunks", world_size=8)
    assert whole.kernel == "matmul_scatter_cublas" and not whole.fell_back
    assert f"chunks of at most 64 rows: fewer than {CUBLAS_WHOLE_ROWS}" in whole.reason
    assert select_scatter_kernel(a, w, "cublas_chunks", world_size=2).reason == "one library GEMM per chunk"
