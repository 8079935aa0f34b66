"""Fused GEMM + reduce-scatter and all-gather + GEMM kernels: loopback, across processes, faults, flags.

Interpreted kernels cost ~0.1 s per program instance, so shapes are tiny and most cases
use one tile per chunk; one case per kernel forces several tiles (and strided operands)
with small explicit block sizes.
"""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, ShapeError
from distfuse.fused.symmetric import close_all, get_workspace
from distfuse.fused.workspace import LoopbackWorkspace, WorkspaceBrokenError, WorkspaceBusyError
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels._utils import round_bf16
from distfuse.kernels.all_gather_matmul import (
    ag_push,
    all_gather_matmul,
    all_gather_matmul_loopback,
    all_gather_matmul_reference,
    gathered_matmul,
    gathered_matmul_workspace_bytes,
)
from distfuse.kernels.jit_helpers import cast_out, wait_flag
from distfuse.kernels.matmul_reduce_scatter import (
    chunk_reduce,
    matmul_reduce_scatter,
    matmul_reduce_scatter_loopback,
    matmul_reduce_scatter_reference,
    matmul_scatter,
    matmul_scatter_workspace_bytes,
)
from distfuse.testing import run_ranks, shutdown_pools
from tests.tolerances import tol

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
CASES = [
    pytest.param(dict(lead=(2,), n=10, W=3, K=24, N=20), id="B2-n10-W3"),
    pytest.param(dict(lead=(2, 1), n=2, W=3, K=8, N=12), id="n2-W3-empty-chunk"),
]
# Several row/column/K tiles per chunk, the row remap crossing batch boundaries inside a tile.
SMALL_TILES = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=8, GROUP_M=2)


def _inputs(lead, n, W, K, N, dtype, seed=0):
    """Per-rank rs inputs a_r [*lead, n, K], weights [N, K] scaled to O(1) outputs, and a bias."""
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(*lead, n, K, generator=g).to(dtype) for _ in range(W)]
    w = [(torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype) for _ in range(W)]
    bias = torch.randn(N, generator=g).to(dtype)
    return a, w, bias


def _rs_ref64(a, w, rank, bias):
    n, K = a[0].shape[-2:]
    start, stop = block_range(n, len(a), rank)
    y = sum(x.reshape(-1, n, K)[:, start:stop].double() @ v.double().t() for x, v in zip(a, w, strict=True))
    return y + bias.double() if bias is not None else y


def _poisoned(shape, dtype, W):
    return [torch.full(s, float("nan"), dtype=dtype) for s in (shape(r) for r in range(W))]


def _assert_close(got, ref, dtype):
    assert not torch.isnan(got).any(), "an output element was never written"
    torch.testing.assert_close(got.double(), ref.double(), **tol(dtype))


# ---------------------------------------------------------------- device helpers


@triton.jit
def _cast_kernel(x_ptr, y_ptr, numel, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, cast_out(x, y_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_out_rounds_to_nearest_even(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, generator=g) * 100
    # Exact ties of bf16 (1 + 2^-8 lies halfway between 1 and 1 + 2^-7) and specials.
    big = 3.4e38 if dtype == torch.bfloat16 else 1000.5  # bf16 rounds 3.4e38 up to inf; fp16 cannot hold it
    x[:6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-9), float("inf"), float("-inf"), big])
    y = torch.full((200,), float("nan"), dtype=dtype)
    _cast_kernel[(1,)](x, y, 200, ROUND_BF16=round_bf16(dtype), BLOCK=256)
    assert torch.equal(y, x.to(dtype))  # bitwise, infinities included


@triton.jit
def _wait_kernel(flag_ptr, status_ptr, ok_ptr, epoch, timeout, TIMED: tl.constexpr):
    ok = wait_flag(flag_ptr, epoch, status_ptr, timeout, TIMED)
    tl.store(ok_ptr, ok.to(tl.int32))


@pytest.mark.parametrize("flag,max_spin,status", [(5, 0, 0), (5, 3, 0), (4, 3, 5), (0, 0, 5)],
                         ids=["raised-one-check", "raised-spin", "stale-epoch-spin", "fresh-one-check"])
def test_wait_flag_reports_a_flag_that_never_comes(flag, max_spin, status):
    flags = torch.tensor([flag], dtype=torch.int32)
    st = torch.zeros(1, dtype=torch.int32)
    ok = torch.full((1,), -1, dtype=torch.int32)
    _wait_kernel[(1,)](flags, st, ok, 5, max_spin, TIMED=False)
    assert int(st[0]) == status
    assert int(ok[0]) == (status == 0)


@pytest.mark.cuda
@pytest.mark.parametrize("timeout_ms", [0, 50, 400])
def test_wait_flag_gives_up_after_wall_time_on_cuda(timeout_ms):
    """The compiled wait is bounded by %globaltimer: a flag that never comes costs the timeout, no more."""
    import time

    flags = torch.zeros(1, dtype=torch.int32, device="cuda")
    st = torch.zeros(1, dtype=torch.int32, device="cuda")
    ok = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    _wait_kernel[(1,)](flags, st, ok, 7, 0, TIMED=True)  # compile and warm up
    torch.cuda.synchronize()
    st.zero_()
    t0 = time.perf_counter()
    _wait_kernel[(1,)](flags, st, ok, 7, timeout_ms * 1_000_000, TIMED=True)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert int(st[0]) == 7 and int(ok[0]) == 0
    assert timeout_ms / 1e3 <= took + 1e-3 < timeout_ms / 1e3 + 0.25, took
    flags.fill_(7)
    _wait_kernel[(1,)](flags, st, ok, 7, timeout_ms * 1_000_000, TIMED=True)
    assert int(ok[0]) == 1


# ---------------------------------------------------------------- loopback: GEMM + reduce-scatter


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_reduce_scatter_loopback_matches_references(case, dtype):
    lead, n, W, K, N = case["lead"], case["n"], case["W"], case["K"], case["N"]
    B = math.prod(lead)
    a, w, bias = _inputs(lead, n, W, K, N, dtype)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))

    def shape(r):
        return (B, block_extent(n, W, r), N)

    # fp32 partials: a single rounding overall, so the float64 reference holds at the dtype's tolerance.
    outs = matmul_reduce_scatter_loopback(a, w, ws, bias=bias, partial_dtype=torch.float32,
                                        outs=_poisoned(shape, dtype, W))
    for r in range(W):
        assert outs[r].shape == shape(r) and outs[r].dtype == dtype
        _assert_close(outs[r], _rs_ref64(a, w, r, bias).reshape(shape(r)), dtype)
    if dtype == torch.float32:
        return
    # Default partials (the output dtype, NCCL's wire format) round each partial once more; the
    # torch reference models that rounding.
    outs = matmul_reduce_scatter_loopback(a, w, ws, bias=bias, outs=_poisoned(shape, dtype, W))
    for r in range(W):
        _assert_close(outs[r], matmul_reduce_scatter_reference(a, w, r, bias=bias), dtype)


def test_matmul_reduce_scatter_loopback_several_tiles_strided_operands_no_bias():
    dtype, W, B, n, K, N = torch.bfloat16, 2, 3, 7, 20, 12
    g = torch.Generator().manual_seed(1)
    # a [B, n, K] with batch stride K and row stride B*K; weight [N, K] as the transpose of [K, N].
    a = [torch.randn(n, B, K, generator=g).to(dtype).transpose(0, 1) for _ in range(W)]
    w = [(torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype).t() for _ in range(W)]
    assert not a[0].is_contiguous() and not w[0].is_contiguous()
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    with ws.in_flight("test"):
        for r in range(W):
            matmul_scatter(a[r], w[r], ws, r, W, partial_dtype=torch.float32, config=SMALL_TILES)
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=dtype)
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, out_dtype=dtype, out=out,
                         config=dict(BLOCK=16))
            _assert_close(out, _rs_ref64(a, w, r, None), dtype)


def test_matmul_reduce_scatter_flags_carry_the_epoch():
    W, B, n, K, N = 3, 1, 5, 8, 6
    a, w, bias = _inputs((B,), n, W, K, N, torch.float32)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    for epoch in (1, 2):
        matmul_reduce_scatter_loopback(a, w, ws, bias=bias)
        for r in range(W):
            flags = ws.rank_view(r).flags
            assert flags[r].tolist() == [epoch] * W  # every source raised owner r's chunk
            assert int(flags.abs().sum()) == epoch * W  # and nothing else
            assert int(ws.rank_view(r).counters.abs().sum()) == 0  # the last program reset its counter


def test_chunk_reduce_raises_when_a_source_never_produced():
    W, B, n, K, N = 3, 1, 6, 8, 6
    a, w, _ = _inputs((B,), n, W, K, N, torch.float32)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[1\] was not raised"), \
            ws.in_flight("missing source"):
        for r in (0, 2):  # virtual rank 1 never runs its GEMM
            matmul_scatter(a[r], w[r], ws, r, W)
        chunk_reduce(ws, 0, W, B, n, N, partial_dtype=torch.float32)
    assert ws.broken
    with pytest.raises(WorkspaceBrokenError):
        matmul_reduce_scatter_loopback(a, w, ws)


def _fill_slots(ws, W, B, n, N, dtype, seed, skip=()):
    """Write random partials into every owner's W slots by hand and raise their flags (but those of ``skip``
    sources); return the partials ``parts[r][s]`` ``[B, len_r, N]``."""
    g = torch.Generator().manual_seed(seed)
    ld = -(-N // 16) * 16
    slot_elems = B * (-(-n // W)) * ld
    parts = []
    for r in range(W):
        view = ws.rank_view(r)
        slots = view.data(dtype, W * slot_elems)
        L = block_extent(n, W, r)
        parts.append([])
        for s in range(W):
            p = (torch.randn(B, L, N, generator=g) * 4).to(dtype)
            slots[s * slot_elems: s * slot_elems + B * L * ld].view(B, L, ld)[:, :, :N] = p
            parts[r].append(p)
            if s not in skip:
                view.flags[r, s] = ws.epoch
    return parts


@pytest.mark.parametrize("programs", [1, 3])
def test_chunk_reduce_sums_in_source_order_on_a_persistent_grid(programs):
    """Bitwise: fp32 partials summed src 0, 1, ..., W-1 whatever the grid (1 program walking every block, or 3),
    the bias added last; blocks of 2 rows x 16 columns, so each program walks several."""
    W, B, n, N = 4, 2, 9, 20
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5))
    with ws.in_flight("test"):
        parts = _fill_slots(ws, W, B, n, N, torch.float32, seed=4)
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"))
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, bias=bias, out=out,
                         config=dict(BLOCK=32, PROGRAMS=programs))
            want = parts[r][0].clone()
            for s in range(1, W):
                want = want + parts[r][s]
            assert torch.equal(out, want + bias), r


def test_chunk_reduce_missing_flag_poisons_the_whole_chunk():
    """The vector flag wait: one source of four never raised its flag -> status names it, every element is NaN."""
    W, B, n, N = 4, 1, 8, 16
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    out = torch.zeros(B, block_extent(n, W, 2), N)
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[3\] was not raised"), \
            ws.in_flight("missing flag"):
        _fill_slots(ws, W, B, n, N, torch.float32, seed=6, skip=(3,))
        chunk_reduce(ws, 2, W, B, n, N, partial_dtype=torch.float32, out=out, config=dict(BLOCK=32, PROGRAMS=2))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [pytest.param(16, id="flat-N16"), pytest.param(13, id="rows-N13")])
def test_chunk_reduce_layouts_world_sizes_and_dtypes(N, dtype, W):
    """Both layouts of the bandwidth kernel (FLAT: slot rows as wide as the output, one 1-D walk; rows: slot rows
    padded past N), uneven chunks (n = 7), W = 1..4, 16-bit partials and output: the sum is fp32 in source order
    plus the bias, rounded once, so it is bitwise torch's fp32 sum in that order; and it is within the dtype's
    rounding of a float64 reference.  Poisoned outputs, several blocks per program (BLOCK 32, 2 programs)."""
    from distfuse.kernels.chunk_reduce import reduce_meta, slot_row_stride

    B, n = 2, 7
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, dtype))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype)
    assert reduce_meta(B * 4, N, slot_row_stride(N), dtype, W, dict(BLOCK=32))["FLAT"] == (N % 16 == 0)
    with ws.in_flight("test"):
        parts = _fill_slots(ws, W, B, n, N, dtype, seed=11 + W)
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=dtype)
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=dtype, bias=bias, out=out,
                         config=dict(BLOCK=32, PROGRAMS=2))
            want = parts[r][0].float()
            for s in range(1, W):
                want = want + parts[r][s].float()
            assert torch.equal(out, (want + bias.float()).to(dtype)), r
            ref64 = sum(p.double() for p in parts[r]) + bias.double()
            _assert_close(out, ref64, dtype)


@pytest.fixture(params=["atomic", "load"])
def flag_poll(request, monkeypatch):
    """``chunk_reduce``'s flag poll for the test (``DISTFUSE_FLAG_POLL``'s two values), its launch caches cleared
    around it so the pinned launch is rebuilt with it."""
    from distfuse.kernels import chunk_reduce as chunk_reduce_kernels

    def clear():
        chunk_reduce_kernels.reduce_plan.cache_clear()
        chunk_reduce_kernels._BOUND.clear()

    clear()
    monkeypatch.setattr(chunk_reduce_kernels, "POLL_LOADS", request.param == "load")
    yield request.param
    clear()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("W,N", [pytest.param(8, 1024, id="W8-flat"), pytest.param(2, 1000, id="W2-rows"),
                                 pytest.param(3, 512, id="W3-flat")])
def test_chunk_reduce_pinned_launch_cuda(W, N, dtype, flag_poll):
    """Compiled, the pinned launch (several programs per SM, 512-4096-element blocks), its flags polled both ways:
    bitwise the fp32 sum in source order plus the bias, rounded once, on poisoned outputs; uneven chunks
    (n = 1030)."""
    from distfuse.kernels.chunk_reduce import reduce_plan, slot_row_stride

    plan = reduce_plan(2 * block_extent(1030, W, 0), N, slot_row_stride(N), dtype, W, torch.device("cuda"))
    assert plan[0]["POLL_LOADS"] == (flag_poll == "load")
    B, n = 2, 1030
    dev = torch.device("cuda")
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, dtype), dev)
    ws.strict = True
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(dtype)
    with ws.in_flight("test"):
        parts = _fill_slots(ws, W, B, n, N, dtype, seed=W)
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=dtype, device=dev)
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=dtype, bias=bias.to(dev), out=out)
            want = parts[r][0].float()
            for s in range(1, W):
                want = want + parts[r][s].float()
            assert torch.equal(out.cpu(), (want + bias.float()).to(dtype)), r


def test_chunk_reduce_pinned_configs():
    """The GPU launch rule: 16 KB of partials in flight per program (BLOCK = 16 KB / (W x itemsize), 512-4096
    elements), 4 programs per SM (3 at 4096); never autotuned (the same on every rank); FLAT exactly when the
    slot rows are as wide as the output rows.  The configs listed for the audit are the rule's."""
    from distfuse.kernels._utils import REDUCE_AUDIT_W, get_chunk_reduce_configs, pinned_reduce_config
    from distfuse.kernels.chunk_reduce import reduce_meta

    blocks = {(dt, w): pinned_reduce_config(1 << 22, dt, w)["BLOCK"] for dt in (torch.bfloat16, torch.float32)
              for w in (1, 2, 4, 8, 16)}
    assert blocks == {(torch.bfloat16, 1): 4096, (torch.bfloat16, 2): 4096, (torch.bfloat16, 4): 2048,
                      (torch.bfloat16, 8): 1024, (torch.bfloat16, 16): 512, (torch.float32, 1): 4096,
                      (torch.float32, 2): 2048, (torch.float32, 4): 1024, (torch.float32, 8): 512,
                      (torch.float32, 16): 512}
    assert pinned_reduce_config(1 << 22, torch.bfloat16, 2) == dict(BLOCK=4096, PER_SM=3, num_warps=4)
    assert pinned_reduce_config(1 << 10, torch.float16, 8) == dict(BLOCK=1024, PER_SM=8, num_warps=4)
    for dt in (torch.float32, torch.float16):
        got = [(c.kwargs["W"], c.kwargs["BLOCK"], c.kwargs["PER_SM"], c.num_warps)
               for c in get_chunk_reduce_configs(dt)]
        want = [(w, *(pinned_reduce_config(1 << 22, dt, w)[k] for k in ("BLOCK", "PER_SM", "num_warps")))
                for w in REDUCE_AUDIT_W]
        assert got == want
    meta = reduce_meta(512, 4096, 4096, torch.bfloat16, 8, dict(BLOCK=1024, PER_SM=4))
    assert meta["FLAT"] and meta["BLOCK_C"] == 256
    assert not reduce_meta(512, 4100, 4112, torch.bfloat16, 8, dict(BLOCK=4096))["FLAT"]
    from distfuse.kernels._utils import INTERPRET

    asked = reduce_meta(512, 4096, 4096, torch.bfloat16, 8, dict(BLOCK=1024, POLL_LOADS=True))["POLL_LOADS"]
    assert asked is (not INTERPRET), "acquire loads are inline PTX: the interpreter keeps the atomics"
    assert reduce_meta(512, 4096, 4096, torch.bfloat16, 8, dict(BLOCK=1024, POLL_LOADS=False))["POLL_LOADS"] is False


@pytest.mark.parametrize("value,loads", [("atomic", False), ("load", True), (" LOAD ", True), ("", False),
                                         ("fence", None)])
def test_the_flag_poll_setting(monkeypatch, value, loads):
    """``DISTFUSE_FLAG_POLL``: ``atomic`` (the default) or ``load`` (compiled kernels only); anything else raises,
    naming the variable."""
    from distfuse.kernels import _utils

    monkeypatch.setenv(_utils.FLAG_POLL_ENV, value)
    if loads is None:
        with pytest.raises(ValueError, match="DISTFUSE_FLAG_POLL='fence'"):
            _utils._flag_poll_loads()
        return
    monkeypatch.setattr(_utils, "INTERPRET", False)
    assert _utils._flag_poll_loads() is loads
    monkeypatch.setattr(_utils, "INTERPRET", True)
    assert _utils._flag_poll_loads() is False


def _flag_poll_ptx() -> None:
    """Run in a subprocess without the interpreter: compile the audit's two flat W = 8 bf16 ``chunk_reduce`` cases
    for sm_90 and print, per ``POLL_LOADS``, whether the PTX polls by acquire loads, by acquire atomics, and whether
    the audit's flag-protocol check accepts it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from distfuse.kernels import compile_audit, compile_audit_cases

    for c in compile_audit_cases.audit_cases((torch.bfloat16,)):
        if c.name == "chunk_reduce" and c.constexprs["W_UNROLL"] == 8 and c.constexprs["FLAT"]:
            sig, attrs = c.signature()
            ptx = triton.compile(ASTSource(fn=c.fn, signature=sig, constexprs=c.constexprs, attrs=attrs),
                                 target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c.num_warps)).asm["ptx"]
            print("poll", c.constexprs["POLL_LOADS"], "ld.acquire.sys.global.b32" in ptx,
                  "atom.global.sys.acquire.add" in ptx, bool(compile_audit._PTX_CHECKS["acquire_sys"][0].search(ptx)))


def test_flag_polls_by_load_compile_to_acquire_loads_for_sm90():
    """Compiled for sm_90 without a GPU: ``POLL_LOADS`` replaces the flag atomics by ``ld.acquire.sys.global`` loads
    (and the compile audit's flag-protocol check accepts them); the default keeps the acquire atomics."""
    from tests.compiled_subprocess import run_compiled

    stdout = run_compiled("import tests.test_gemm_kernels as t; t._flag_poll_ptx()")
    got = sorted(tuple(ln.split()[1:]) for ln in stdout.splitlines() if ln.startswith("poll "))
    assert got == [("False", "False", "True", "True"), ("True", "True", "False", "True")], stdout


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["sync", "deferred"])
def test_missing_source_on_cuda_poisons_and_raises(mode, flag_poll):
    """Compiled, the flags polled both ways: a chunk whose source never produced comes out NaN, and the host raises
    (now, or at the next op)."""
    W, B, n, K, N = 3, 2, 40, 64, 48
    dev = torch.device("cuda")
    a, w, _ = _inputs((B,), n, W, K, N, torch.float32)
    a, w = [x.to(dev) for x in a], [x.to(dev) for x in w]
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32), dev)
    ws.status_mode = mode
    out = torch.zeros(B, block_extent(n, W, 0), N, device=dev)
    if mode == "sync":
        with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[1\] was not raised"), \
                ws.in_flight("missing source"):
            for r in (0, 2):
                matmul_scatter(a[r], w[r], ws, r, W)
            chunk_reduce(ws, 0, W, B, n, N, partial_dtype=torch.float32, out=out)
    else:
        with ws.in_flight("missing source"):
            for r in (0, 2):
                matmul_scatter(a[r], w[r], ws, r, W)
            chunk_reduce(ws, 0, W, B, n, N, partial_dtype=torch.float32, out=out)
        assert ws.deferred and not ws.broken  # no host sync inside the op
        torch.cuda.synchronize()  # a claim raises what the GPU has finished (it never waits for the op itself)
        with pytest.raises(CollectiveTimeoutError, match="was not raised"), ws.in_flight("next op"):
            pass
    assert ws.broken
    assert torch.isnan(out).all(), "a chunk missing a source must be NaN, not a plausible partial sum"


def test_strided_bias_and_unaligned_widths():
    """A bias view with stride 2 is read through its stride; N = 13 pads the slot rows to 16 elements."""
    W, B, n, K, N = 3, 2, 10, 8, 13
    a, w, _ = _inputs((B,), n, W, K, N, torch.float32)
    bias = torch.randn(2 * N, dtype=torch.float64).float()[::2]
    assert bias.stride(0) == 2
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    outs = matmul_reduce_scatter_loopback(a, w, ws, bias=bias)
    for r in range(W):
        _assert_close(outs[r], _rs_ref64(a, w, r, bias).reshape(outs[r].shape), torch.float32)
    x = [torch.randn(B, block_extent(n, W, r), K) for r in range(W)]
    wt = torch.randn(N, K)
    ws2 = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(B, n, K, torch.float32))
    outs = all_gather_matmul_loopback(x, [wt] * W, ws2, bias=bias)
    ref = torch.cat(x, dim=1).double() @ wt.double().t() + bias.double()
    for r in range(W):
        _assert_close(outs[r], ref, torch.float32)


def test_per_call_integers_are_never_specialised():
    """Ranks, offsets and timeouts change every call: a Triton specialisation on them (== 1, % 16 == 0) would
    recompile a kernel on one rank mid-collective while its peers spin.  The epoch is no integer argument at all:
    every kernel loads it from the workspace's device word (``epoch_ptr``), so a CUDA graph replay advances it."""
    import distfuse.kernels.all_gather_matmul as all_gather_kernels
    import distfuse.kernels.chunk_reduce as chunk_reduce_kernels
    import distfuse.kernels.gathered_matmul_persistent as gathered_persistent_kernels
    import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels

    want = {reduce_scatter_kernels._matmul_scatter_kernel: {"rank", "src_offset", "slot_elems"},
            chunk_reduce_kernels._chunk_reduce_kernel: {"rank", "timeout", "slot_elems"},
            all_gather_kernels._ag_push_kernel: {"rank", "start_p"},
            all_gather_kernels._gathered_matmul_kernel: {"rank", "timeout"},
            gathered_persistent_kernels._gathered_matmul_persistent_kernel: {"rank", "timeout"}}
    for fn, names in want.items():
        # a JITFunction holds the list; the interpreter's InterpretedFunction keeps the decorator's kwargs
        dont = set(fn.do_not_specialize if hasattr(fn, "do_not_specialize") else fn.kwargs["do_not_specialize"])
        dont = {fn.arg_names[i] if isinstance(i, int) else i for i in dont}
        assert names <= dont, (fn.__name__, names - dont)
        assert "epoch_ptr" in fn.arg_names and "epoch" not in fn.arg_names, fn.arg_names


def test_matmul_scatter_checks_its_arguments():
    W, B, n, K, N = 2, 1, 4, 8, 6
    a, w, _ = _inputs((B,), n, W, K, N, torch.float32)
    ws = LoopbackWorkspace(W, 64)
    with pytest.raises(WorkspaceBusyError, match="outside an op"):
        matmul_scatter(a[0], w[0], ws, 0, W)
    with ws.in_flight("checks"):
        with pytest.raises(ShapeError, match="workspace data region: expected at least"):
            matmul_scatter(a[0], torch.randn(2048, K), ws, 0, W)  # 2 slots x 2 rows x 2048 x 4 B > 4096 B
        with pytest.raises(ShapeError, match="weight inner dim"):
            matmul_scatter(a[0], w[0][:, :4], ws, 0, W)
        with pytest.raises(ShapeError, match="world size"):
            matmul_scatter(a[0], w[0], ws, 0, 3)


# ---------------------------------------------------------------- loopback: all-gather + GEMM


def _shards(lead, n, W, K, dtype, seed=0, transpose=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(W):
        rows = block_extent(n, W, r)
        if transpose:  # [B, rows, K] with batch stride K and row stride B*K
            out.append(torch.randn(rows, *lead, K, generator=g).to(dtype).transpose(0, 1))
        else:
            out.append(torch.randn(*lead, rows, K, generator=g).to(dtype))
    return out


def _ag_ref64(shards, w, bias):
    y = torch.cat(shards, dim=-2).double() @ w.double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_matmul_loopback_matches_references(case, dtype):
    lead, n, W, K, N = case["lead"], case["n"], case["W"], case["K"], case["N"]
    B = math.prod(lead)
    shards = _shards(lead, n, W, K, dtype)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(B, n, K, dtype))
    outs = all_gather_matmul_loopback(shards, [w] * W, ws, bias=bias,
                                    outs=_poisoned(lambda r: (*lead, n, N), dtype, W))
    ref64 = _ag_ref64(shards, w, bias)
    ref = all_gather_matmul_reference(shards, w, bias=bias)
    for r in range(W):
        assert outs[r].shape == (*lead, n, N) and outs[r].dtype == dtype
        _assert_close(outs[r], ref64, dtype)
        _assert_close(outs[r], ref, dtype)


def test_all_gather_matmul_loopback_several_tiles_strided_operands_and_gathered_copy():
    dtype, W, lead, n, K, N = torch.float16, 2, (3,), 7, 20, 12
    shards = _shards(lead, n, W, K, dtype, seed=2, transpose=True)
    assert not shards[0].is_contiguous()
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype).t()
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(3, n, K, dtype))
    ref64 = _ag_ref64(shards, w, None)
    with ws.in_flight("test"):
        for r in range(W):
            ag_push(shards[r], ws, r, W, n, config=dict(BLOCK_M=4, BLOCK_K=8))
        for r in range(W):
            out = torch.full((*lead, n, N), float("nan"), dtype=dtype)
            y, gathered = gathered_matmul(shards[r], w, ws, r, W, n, out=out, config=SMALL_TILES,
                                          return_gathered=True)
            assert y.data_ptr() == out.data_ptr()
            _assert_close(y, ref64, dtype)
            assert torch.equal(gathered, torch.cat(shards, dim=-2))


def test_all_gather_matmul_flags_and_missing_push():
    W, lead, n, K, N = 3, (1,), 6, 8, 6
    shards = _shards(lead, n, W, K, torch.float32)
    w = torch.randn(N, K)
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(1, n, K, torch.float32))
    all_gather_matmul_loopback(shards, [w] * W, ws)
    for r in range(W):
        flags = ws.rank_view(r).flags
        expect = torch.zeros(W, W, dtype=torch.int32)
        for c in range(W):
            expect[c, c] = 1 if c != r else 0  # every peer's chunk, never the rank's own
        assert torch.equal(flags, expect)
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[1, 2\] was not raised"), \
            ws.in_flight("missing push"):
        ag_push(shards[0], ws, 0, W, n)  # epoch 2: only virtual rank 0 pushes
        gathered_matmul(shards[0], w, ws, 0, W, n)


def test_all_gather_matmul_checks_the_shard_rows():
    ws = LoopbackWorkspace(2, 4096)
    with ws.in_flight("checks"), pytest.raises(ShapeError, match="shard rows"):
        ag_push(torch.randn(1, 3, 4), ws, 0, 2, n=7)  # block 0 of 7 over 2 has 4 rows


# ---------------------------------------------------------------- across processes (/dev/shm)


def _rank_fused_ops(dtype_name: str):
    """matmul_reduce_scatter, all_gather_matmul, then matmul_reduce_scatter again on fresh data: one workspace,
    three epochs."""
    P = Partition.world()
    W, r = P.size, P.rank
    dtype = getattr(torch, dtype_name)
    lead, n, K, N = (2,), 7, 12, 10
    B = math.prod(lead)
    nbytes = max(matmul_scatter_workspace_bytes(B, n, N, W, torch.float32),
                 gathered_matmul_workspace_bytes(B, n, K, dtype))
    ws = get_workspace(P, nbytes)
    results = []
    for seed in (10, 11):
        a, w, bias = _inputs(lead, n, W, K, N, dtype, seed=seed)
        out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=dtype)
        y = matmul_reduce_scatter(a[r], w[r], ws, r, W, bias=bias, partial_dtype=torch.float32, out=out)
        results.append(("matmul_reduce_scatter", y, _rs_ref64(a, w, r, bias).reshape(*lead, -1, N)))
        if seed == 10:
            shards = _shards(lead, n, W, K, dtype, seed=seed)
            out = torch.full((*lead, n, N), float("nan"), dtype=dtype)
            y = all_gather_matmul(shards[r], w[r], ws, r, W, n, bias=bias, out=out)
            results.append(("all_gather_matmul", y, _ag_ref64(shards, w[r], bias)))
    epoch, names = ws.epoch, ws.segment_names
    close_all()
    return dict(results=results, epoch=epoch, names=names)


@pytest.mark.parametrize("W,dtype", [pytest.param(2, "float32", id="W2-fp32"), pytest.param(4, "bfloat16",
                                                                                            id="W4-bf16")])
def test_fused_ops_across_processes(W, dtype):
    out = run_ranks(W, _rank_fused_ops, dtype)
    for r, o in enumerate(out):
        assert o["epoch"] == 3
        for op, got, ref in o["results"]:
            assert got.shape == ref.shape, (op, r)
            _assert_close(got, ref, getattr(torch, dtype))
    assert not [n for o in out for n in o["names"] if os.path.exists(os.path.join("/dev/shm", n))]


def _rank_fault_mid_op(op: str, faulty: int):
    """Rank `faulty` raises between its producer and its consumer; the others must time out, not hang."""
    P = Partition.world()
    W, r = P.size, P.rank
    lead, n, K, N = (1,), 5, 8, 6
    a, w, _ = _inputs(lead, n, W, K, N, torch.float32)
    shards = _shards(lead, n, W, K, torch.float32)
    ws = get_workspace(P, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32) + 4096, timeout=1.5)
    try:
        with ws.in_flight(op):
            if op == "matmul_reduce_scatter":
                matmul_scatter(a[r], w[r], ws, r, W)
            else:
                ag_push(shards[r], ws, r, W, n)
            if r == faulty:
                raise RuntimeError("injected fault between push and consume")
            if op == "matmul_reduce_scatter":
                chunk_reduce(ws, r, W, 1, n, N, partial_dtype=torch.float32)
            else:
                gathered_matmul(shards[r], w[r], ws, r, W, n)
        result = ("ok", "")
    except CollectiveTimeoutError as exc:
        result = ("timeout", str(exc))
    except RuntimeError as exc:
        result = ("raised", str(exc))
    try:
        with ws.in_flight("after the fault"):
            pass
        reuse = "reused"
    except WorkspaceBrokenError:
        reuse = "broken"
    names = ws.segment_names
    close_all()
    return dict(result=result, reuse=reuse, names=names)


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_fault_between_push_and_consume_raises_everywhere(op):
    W, faulty = 3, 1
    try:
        out = run_ranks(W, _rank_fault_mid_op, op, faulty)
    finally:
        shutdown_pools()  # the timed-out monitored barrier leaves the gloo world inconsistent
    for r, o in enumerate(out):
        kind, msg = o["result"]
        if r == faulty:
            assert kind == "raised" and "injected fault" in msg
        else:
            assert kind == "timeout" and "did not complete within 1.5 s" in msg, msg
        assert o["reuse"] == "broken"
    assert not [n for o in out for n in o["names"] if os.path.exists(os.path.join("/dev/shm", n))]


# The compiled-mode check of these kernels (sm_90, every config, three dtypes) is tests/test_compile_audit.py.


# ---------------------------------------------------------------- CUDA (loopback at realistic sizes)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_matmul_reduce_scatter_loopback_cuda(dtype):
    W, lead, n, K, N = 4, (2,), 1030, 1024, 768
    dev = torch.device("cuda")
    a, w, bias = _inputs(lead, n, W, K, N, dtype)
    a, w, bias = [x.to(dev) for x in a], [x.to(dev) for x in w], bias.to(dev)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32), dev)
    ws.strict = True  # read the status words (a device sync) so that a missed flag raises
    # fp32 partials: with K = 1024, cuBLAS and Triton sum in different orders, and 16-bit partials
    # would turn some of those last-bit differences into whole-ulp flips of a partial.
    outs = matmul_reduce_scatter_loopback(a, w, ws, bias=bias, partial_dtype=torch.float32)
    for r in range(W):
        ref = matmul_reduce_scatter_reference(a, w, r, bias=bias, partial_dtype=torch.float32)
        _assert_close(outs[r], ref, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_all_gather_matmul_loopback_cuda(dtype):
    W, lead, n, K, N = 4, (2,), 1030, 768, 1024
    dev = torch.device("cuda")
    shards = [s.to(dev) for s in _shards(lead, n, W, K, dtype)]
    w = (torch.randn(N, K) / math.sqrt(K)).to(dtype).to(dev)
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(2, n, K, dtype), dev)
    ws.strict = True
    outs = all_gather_matmul_loopback(shards, [w] * W, ws)
    ref = all_gather_matmul_reference(shards, w)
    for r in range(W):
        _assert_close(outs[r], ref, dtype)


def test_fp32_ieee_products_take_their_own_gemm_lists(monkeypatch):
    """fp32 with IEEE products (torch's default: no TF32) runs on the FMA units with more registers a thread than
    TF32, so the pointer and gathered-K families keep lists of their own for it (the audit compiles each list at its
    precision, with no spill under Triton 3.6 or 3.9); which list a call takes follows torch's fp32 setting at the
    call, as the dot's precision does.  16-bit operands and the persistent families have one list."""
    from distfuse.kernels import _utils

    def configs(dt, family, precision=None):
        return [_utils.config_of(c) for c in _utils.get_gemm_configs(dt, family, precision)]

    for family in ("pointer", "gathered_k"):
        assert _utils.gemm_list_key(torch.float32, family, "ieee") == "ieee"
        assert _utils.gemm_list_key(torch.float32, family, "tf32") == 4
        assert configs(torch.float32, family, "ieee") != configs(torch.float32, family, "tf32")
        for rows, cols in ((4096, 4096), (4096, 128), (64, 4096), (16, 16)):  # each bucket's pin is in its list
            for prec in ("ieee", "tf32"):
                assert _utils.pinned_gemm_config(torch.float32, rows, cols, family, prec) in configs(
                    torch.float32, family, prec)
    assert _utils.gemm_list_key(torch.bfloat16, "gathered_k", "ieee") == 2  # 16-bit products ignore the setting
    assert _utils.gemm_list_key(torch.float32, "persistent", "ieee") == 4  # refused compiled: one list
    # the default follows the setting at the call (input_precision: tf32 only where torch allows it, compiled)
    monkeypatch.setattr(_utils, "input_precision", lambda dtype: "ieee")
    assert _utils.gemm_list_key(torch.float32, "gathered_k") == "ieee"
    assert _utils.pinned_gemm_config(torch.float32, 4096, 4096, "gathered_k") == configs(
        torch.float32, "gathered_k", "ieee")[0]
    monkeypatch.setattr(_utils, "input_precision", lambda dtype: "tf32")
    assert _utils.gemm_list_key(torch.float32, "gathered_k") == 4


@pytest.mark.parametrize("key", [2, 4, "ieee"], ids=["16bit", "fp32-tf32", "fp32-ieee"])
def test_every_gathered_k_gpu_tile_computes_the_product(key):
    """Each GPU tile of the gathered-K lists (16-bit, fp32 with TF32, fp32 with IEEE products: tiles chosen to fit
    the registers, with 16-deep K steps in fp32) runs here, interpreted, against float64: K = 70 over 3 ranks is no
    multiple of any K step, and 37 x 45 outputs fill no tile."""
    from distfuse.kernels import _utils
    from distfuse.kernels.all_gather_features_matmul import (
        all_gather_features_matmul_loopback,
        gathered_k_workspace_bytes,
    )

    dtype = torch.bfloat16 if key == 2 else torch.float32
    W, M, K, N = 3, 37, 70, 45
    g = torch.Generator().manual_seed(11)
    x = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    shards = [x[:, slice(*block_range(K, W, r))].contiguous() for r in range(W)]
    weights = [w[slice(*block_range(N, W, r))].contiguous() for r in range(W)]
    full = x.double() @ w.double().t()
    for m, n, k, _, _ in _utils._GEMM_SHAPES["gathered_k"][key]:
        ws = LoopbackWorkspace(W, gathered_k_workspace_bytes(M, K, dtype))
        ys = all_gather_features_matmul_loopback(shards, weights, ws, config=dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k,
                                                                                  GROUP_M=8))
        for r, y in enumerate(ys):
            torch.testing.assert_close(y.double(), full[:, slice(*block_range(N, W, r))], **tol(dtype, terms=K),
                                       msg=lambda s, r=r, t=(m, n, k): f"tile {t}, rank {r}: {s}")
