"""The persistent GEMM + scatter producer (tensor descriptors, one flag per chunk) under the interpreter.

It must write exactly what the pointer producer writes: the same slots, the same flags,
the counters reset, so that ``chunk_reduce`` cannot tell them apart.  References are
float64 GEMMs of the inputs, built with torch alone.  Interpreted programs cost ~0.1 s
each, so shapes are tiny and the persistent grid is 2-3 programs walking several tiles.
"""

import math

import pytest
import torch

import distfuse.kernels.matmul_scatter_persistent as mscp
from distfuse.errors import UnsupportedError
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter, matmul_scatter_workspace_bytes
from distfuse.kernels.matmul_scatter_persistent import matmul_scatter_persistent, persistent_supported
from distfuse.kernels.matmul_scatter_select import launch_scatter_kernel, select_scatter_kernel
from distfuse.testing.tolerance import STORE_ROUNDINGS
from tests.tolerances import rounding_bound

# Several row and column tiles per chunk; 3 programs walk all W chunks' tiles.
PERSISTENT = dict(kernel="persistent", BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, PROGRAMS=3)
# Both loop forms of the producer: the tile and K loops fused (arrivals counted once per program at its end) and
# the tile loop around its K loop (each tile's arrival deferred past the next tile's K loop).
FLATTEN = pytest.mark.parametrize("flatten", [pytest.param(True, id="flattened"), pytest.param(False, id="nested")])
# Row tiles within each chunk, or over a batch entry's rows whatever the chunks (a tile holds rows of several owners).
SPAN = pytest.mark.parametrize("span", [pytest.param(True, id="span"), pytest.param(False, id="per-chunk")])


def _produce(a, w, ws, r, W, partial_dtype, config):
    """The producer a config names: ``kernel="persistent"`` goes through the selector (which may fall back)."""
    config = dict(config or {})
    if config.pop("kernel", "pointer") == "persistent":
        choice = select_scatter_kernel(a, w, "triton_persistent")
        return launch_scatter_kernel(choice, a, w, ws, r, W, partial_dtype=partial_dtype, config=config)
    matmul_scatter(a, w, ws, r, W, partial_dtype=partial_dtype, config=config or None)
    return None


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
            _produce(a[r], w[r], ws, r, W, partial_dtype, config)
        outs = []
        for r in range(W):
            out = torch.full((B, block_extent(n, W, r), N), float("nan"), dtype=out_dtype)  # poisoned
            outs.append(chunk_reduce(ws, r, W, B, n, N, partial_dtype=partial_dtype, bias=bias, out_dtype=out_dtype,
                                     out=out))
    return ws, outs


def _assert_close(got, ref, dtype, terms, roundings=STORE_ROUNDINGS):
    """Within the rounding bound of sums of ``terms`` terms against float64, on the scale of unit-variance data
    (the outputs are of size about 1); ``roundings``: the roundings to a storage dtype on the way."""
    assert not torch.isnan(got).any(), "an output element was never written"
    rtol = rounding_bound(dtype, terms, roundings=roundings)
    torch.testing.assert_close(got.double(), ref.double(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("kmajor", [pytest.param(False, id="w[N,K]"), pytest.param(True, id="w[K,N]")])
@SPAN
def test_persistent_matches_float64(dtype, kmajor, span, flatten=True):
    """Uneven chunks (n = 10 over 3: rows 0-3, 4-6, 7-9), a batch of 2, 4-row tiles that straddle the chunk end
    (per chunk) or two chunks (span: rows 4-7), both weight layouts."""
    lead, n, W, K, N = (2,), 10, 3, 32, 24
    a, w, bias = _inputs(lead, n, W, K, N, dtype, weight_kmajor=kmajor)
    assert persistent_supported(a[0].reshape(2, n, K), w[0])[0]
    config = dict(PERSISTENT, FLATTEN=flatten, SPAN=span)
    terms = W * K + 1  # the chunk's W partials of K products, and the bias
    _, outs = _run(a, w, bias, W, n, N, config, torch.float32, dtype)
    for r in range(W):
        _assert_close(outs[r], _ref64(a, w, r, bias), dtype, terms)
    if dtype != torch.float32:  # default partials: the output dtype, so each of the W partials is rounded once more
        _, outs = _run(a, w, bias, W, n, N, config, dtype, dtype)
        for r in range(W):
            _assert_close(outs[r], _ref64(a, w, r, bias), dtype, terms, roundings=STORE_ROUNDINGS + W)


@SPAN
def test_persistent_nested_loops_match_float64(span):
    """The nested loop form (a K loop per tile), in bf16 with bf16 partials; the fp32 forms are checked bit for bit
    against the pointer kernel below."""
    test_persistent_matches_float64(torch.bfloat16, False, span, flatten=False)


@FLATTEN
@SPAN
def test_persistent_writes_what_the_pointer_kernel_writes(flatten, span):
    """Same block sizes, same K order: the slots are bitwise equal, and the flags and counters end alike."""
    lead, n, W, K, N = (1,), 9, 3, 32, 20
    a, w, _ = _inputs(lead, n, W, K, N, torch.float32, seed=3)
    blocks = {k: v for k, v in PERSISTENT.items() if k.startswith(("BLOCK", "GROUP"))}
    ws_p, outs_p = _run(a, w, None, W, n, N, dict(PERSISTENT, FLATTEN=flatten, SPAN=span), torch.float32,
                        torch.float32)
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
@FLATTEN
@SPAN
def test_persistent_small_and_empty_chunks_and_two_epochs(case, flatten, span):
    """An empty chunk still gets its flag; W = 8; a second op on the same workspace (epoch 2) reuses the counters."""
    lead, n, W, K, N = case["lead"], case["n"], case["W"], 16, 16
    B = math.prod(lead)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    for epoch, seed in ((1, 5), (2, 6)):
        a, w, bias = _inputs(lead, n, W, K, N, torch.float32, seed=seed)
        with ws.in_flight("test"):
            for r in range(W):
                _produce(a[r], w[r], ws, r, W, torch.float32, dict(PERSISTENT, BLOCK_M=16, PROGRAMS=2, FLATTEN=flatten,
                                                                        SPAN=span))
            for r in range(W):
                out = torch.full((B, block_extent(n, W, r), N), float("nan"))  # poisoned
                assert chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, bias=bias, out=out) is out
                _assert_close(out, _ref64(a, w, r, bias), torch.float32, W * K + 1)
                assert ws.rank_view(r).flags[r].tolist() == [epoch] * W
                assert int(ws.rank_view(r).counters.abs().sum()) == 0


@pytest.mark.parametrize("model", [pytest.param((4096, 1792), id="llama3-8b"),
                                   pytest.param((8192, 3584), id="llama3-70b")])
def test_pinned_tiles_come_from_the_whole_gemm_and_span_short_chunks(model):
    """The pinned rule at TP 8 on 132 SMs (an H100 SXM's count): at M = 8192 chunk-aligned 128-row tiles waste no row;
    at M = 512 the 64-row chunks would half-fill them, so the tiles span chunks and the grid stays busy."""
    N, _K = model
    W, sms = 8, 132
    big = mscp._pinned_config(torch.bfloat16, 1, 8192, W, N, sms)
    assert big["BLOCK_M"] == 128 and not big["SPAN"]
    small = mscp._pinned_config(torch.bfloat16, 1, 512, W, N, sms)
    assert small["BLOCK_M"] == 128 and small["SPAN"]
    for cfg, m in ((big, 8192), (small, 512)):
        tiles = mscp.scatter_tiles(cfg, 1, m, W, N)
        waves = -(-tiles // sms)
        assert tiles / (waves * sms) >= 0.9, (cfg, tiles)  # the last wave keeps 90% of the SMs busy


def test_a_config_without_blocks_keeps_its_forms(monkeypatch):
    """``config={"FLATTEN": False}`` takes the default tile and keeps the form it names (the launch sees both)."""
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.update(meta)

    monkeypatch.setattr(mscp, "cached_launch", lambda kernel: Recorder())
    lead, n, W, K, N = (1,), 9, 3, 32, 20
    a, w, _ = _inputs(lead, n, W, K, N, torch.float32, seed=3)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    with ws.in_flight("test"):
        matmul_scatter_persistent(a[0], w[0], ws, 0, W, partial_dtype=torch.float32,
                                  config=dict(FLATTEN=False, SPAN=False))
    assert seen["FLATTEN"] is False and seen["SPAN"] is False and seen["BLOCK_M"] == mscp.CPU_GEMM_CONFIG["BLOCK_M"]
    assert seen["W_BLOCK"] == 4


def test_span_decision_counts_the_rows_chunk_aligned_tiles_would_compute():
    assert not mscp.span_wins(128, 8192, 8)  # 1024-row chunks: 8 tiles each, none padded
    assert mscp.span_wins(128, 512, 8)  # 64-row chunks in 128-row tiles: twice the rows
    assert not mscp.span_wins(64, 512, 8)  # 64-row tiles fit them
    assert mscp.span_wins(4, 9, 3) and not mscp.span_wins(4, 12, 3)  # 12 rows for 9 (33%); 12 for 12
    assert not mscp.span_wins(128, 1000, 8)  # 125-row chunks: 1024 rows for 1000, 2.4% extra


def test_unsupported_layouts_fall_back_to_the_pointer_kernel():
    """K = 6 in fp32 is a 24-byte row stride (TMA needs multiples of 16 bytes): same results, pointer kernel.

    The selector names the kernel that ran and why; the persistent launcher itself refuses such operands.
    """
    lead, n, W, K, N = (1,), 7, 2, 6, 10
    a, w, bias = _inputs(lead, n, W, K, N, torch.float32, seed=9)
    ok, why = persistent_supported(a[0].reshape(1, n, K), w[0])
    assert not ok and "16-byte" in why
    choice = select_scatter_kernel(a[0], w[0], "triton_persistent")
    assert choice.kernel == "matmul_scatter" and choice.fell_back and "16-byte" in choice.reason
    _, outs = _run(a, w, bias, W, n, N, PERSISTENT, torch.float32, torch.float32)
    for r in range(W):
        _assert_close(outs[r], _ref64(a, w, r, bias), torch.float32, W * K + 1)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    with pytest.raises(UnsupportedError, match="matmul_scatter_persistent.*16-byte"), ws.in_flight("test"):
        matmul_scatter_persistent(a[0], w[0], ws, 0, W)


@pytest.mark.parametrize("kmajor", [False, True])
def test_checked_descriptors_are_what_the_constructor_builds(kmajor):
    """The launchers' descriptors skip TensorDescriptor's checks (the operands were checked): same fields, and the
    constructor accepts the same arguments."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from distfuse.kernels.persistent import rows_descriptor, weight_descriptor

    x3 = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, 24, dtype=torch.bfloat16).t() if kmajor else torch.randn(24, 32, dtype=torch.bfloat16)
    (w_desc, got_kmajor), x_desc = weight_descriptor(weight, 16, 16), rows_descriptor(x3, 16, 16)
    assert got_kmajor == kmajor
    for desc in (w_desc, x_desc):
        ref = TensorDescriptor(desc.base, desc.shape, desc.strides, desc.block_shape)  # its checks pass
        assert type(desc) is TensorDescriptor and repr(desc) == repr(ref)
        assert desc.base.data_ptr() == ref.base.data_ptr() and desc.padding == "zero"
    assert x_desc.shape == [10, 32] and x_desc.strides == [32, 1] and x_desc.block_shape == [16, 16]
    assert w_desc.shape == ([32, 24] if kmajor else [24, 32])


def test_unknown_kernel_is_refused():
    W, n, K, N = 2, 4, 16, 16
    a, w, _ = _inputs((1,), n, W, K, N, torch.float32)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    with pytest.raises(UnsupportedError, match="config\\['kernel'\\]"), ws.in_flight("test"):
        matmul_scatter(a[0], w[0], ws, 0, W, config=dict(kernel="persistent"))  # the selector chooses kernels
    with pytest.raises(UnsupportedError, match="provider"):
        select_scatter_kernel(a[0], w[0], "warp_specialized")


# The compiled forms: the pinned rule (here 128x128 tiles spanning chunks, loops fused) in bf16 and fp32, then each
# loop form and row tiling at one 16-bit tile, so a GPU run checks every form the kernel can take, not only the one
# the rule picks today.
_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
CUDA_FORMS = [pytest.param(torch.bfloat16, None, id="bf16-pinned"), pytest.param(torch.float32, None, id="fp32-pinned")]
CUDA_FORMS += [pytest.param(torch.bfloat16, dict(_TILE, FLATTEN=flatten, SPAN=span),
                            id=f"bf16-{'flattened' if flatten else 'nested'}-{'span' if span else 'per-chunk'}")
               for flatten, span in ((True, False), (False, False), (False, True))]


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "form"), CUDA_FORMS)
def test_persistent_loopback_cuda(dtype, form):
    """Compiled (sm_90: TMA loads): realistic sizes, uneven chunks (1030 rows over 4: 258, 258, 257, 257), one
    program per SM, in every loop form and row tiling."""
    from tests.tolerances import assert_rel_close

    W, lead, n, K, N = 4, (2,), 1030, 1024, 768
    dev = torch.device("cuda")
    a, w, bias = _inputs(lead, n, W, K, N, dtype)
    a, w, bias = [x.to(dev) for x in a], [x.to(dev) for x in w], bias.to(dev)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32), dev)
    ws.strict = True
    with ws.in_flight("test"):
        for r in range(W):
            matmul_scatter_persistent(a[r], w[r], ws, r, W, partial_dtype=torch.float32, config=form)
        for r in range(W):
            out = chunk_reduce(ws, r, W, 2, n, N, partial_dtype=torch.float32, bias=bias, out_dtype=dtype)
            assert_rel_close(out, _ref64([x.cpu() for x in a], [v.cpu() for v in w], r, bias.cpu()), dtype)


# ---------------------------------------------------------------- all-gather + GEMM consumer, persistent form

# Several row and column tiles per chunk; 3 programs walk every chunk's tiles (local first).
AG_TILES = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, PROGRAMS=3)


def _ag_inputs(lead, n, W, K, N, dtype, seed=0, weight_kmajor=False):
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(*lead, block_extent(n, W, r), K, generator=g).to(dtype) for r in range(W)]
    if weight_kmajor:
        w = (torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype).t()
    else:
        w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    return shards, w, bias


def _ag_run(shards, w, bias, W, n, config, kernel=None, push=True, ranks=None):
    """Every virtual rank's push (all of them unless ``push`` is False for some), then the consumer of ``ranks``;
    returns the outputs (poisoned first) and the kernel choices."""
    from distfuse.kernels.all_gather_matmul import ag_push, gathered_matmul, gathered_matmul_workspace_bytes
    from distfuse.kernels.gathered_matmul_select import last_gather_choice

    lead, K, N = shards[0].shape[:-2], shards[0].shape[-1], w.shape[0]
    B = math.prod(lead)
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(B, n, K, shards[0].dtype), shards[0].device)
    outs, choices = [], []
    with ws.in_flight("test"):
        for r in range(W):
            if push is True or r in push:
                ag_push(shards[r], ws, r, W, n)
        for r in (range(W) if ranks is None else ranks):
            out = torch.full((*lead, n, N), float("nan"), dtype=shards[0].dtype, device=shards[0].device)
            outs.append(gathered_matmul(shards[r], w, ws, r, W, n, bias=bias, out=out, config=config, kernel=kernel))
            choices.append(last_gather_choice())
    return outs, choices


def _ag_ref64(shards, w, bias):
    y = torch.cat(shards, dim=-2).double() @ w.double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("case", [pytest.param(dict(lead=(2,), n=10, W=3, kmajor=False), id="B2-n10-W3"),
                                  pytest.param(dict(lead=(1,), n=7, W=4, kmajor=True), id="n7-W4-w[K,N]"),
                                  pytest.param(dict(lead=(1,), n=2, W=3, kmajor=False), id="n2-W3-empty-chunk"),
                                  pytest.param(dict(lead=(2,), n=5, W=1, kmajor=False), id="W1")])
def test_gathered_persistent_matches_float64(case, dtype):
    """Uneven chunks, an empty one, W = 1..4, a batch of 2 (row tiles that straddle a chunk's end inside a batch
    entry), both weight layouts, every dtype: against float64 with poisoned outputs, and the persistent kernel ran."""
    lead, n, W = case["lead"], case["n"], case["W"]
    K, N = 32, 24
    shards, w, bias = _ag_inputs(lead, n, W, K, N, dtype, seed=W, weight_kmajor=case["kmajor"])
    outs, choices = _ag_run(shards, w, bias, W, n, AG_TILES)
    ref = _ag_ref64(shards, w, bias)
    for r in range(W):
        assert choices[r].kernel == "gathered_matmul_persistent" and not choices[r].fell_back, choices[r]
        assert outs[r].shape == ref.shape and outs[r].dtype == dtype
        _assert_close(outs[r], ref, dtype, K + 1)


def test_gathered_persistent_is_bitwise_the_pointer_kernel():
    """Same block sizes, same K order, fp32: the two consumers write the same bits (a fallback changes nothing)."""
    lead, n, W, K, N = (2,), 9, 3, 32, 20
    shards, w, bias = _ag_inputs(lead, n, W, K, N, torch.float32, seed=3)
    blocks = {k: v for k, v in AG_TILES.items() if k != "PROGRAMS"}
    got, c_p = _ag_run(shards, w, bias, W, n, AG_TILES)
    want, c_t = _ag_run(shards, w, bias, W, n, blocks, kernel="gathered_matmul")
    assert {c.kernel for c in c_p} == {"gathered_matmul_persistent"} and {c.kernel for c in c_t} == {"gathered_matmul"}
    assert not c_t[0].fell_back and "asked for" in c_t[0].reason
    for r in range(W):
        assert torch.equal(got[r], want[r]), r


def _count_flag_reads(monkeypatch):
    """Count the consumers' flag reads by kind: ``poll`` (the persistent kernel's one load of every chunk's flag),
    ``wait`` (its wait for one chunk still missing) and ``pointer`` (the pointer kernel's wait per peer tile)."""
    import distfuse.kernels.all_gather_matmul as pointer_kernels
    import distfuse.kernels.gathered_matmul_persistent as persistent_kernels

    calls = []

    def counting(module, name, kind):
        inner = getattr(module, name)

        def read(*args, **kwargs):
            calls.append(kind)
            return inner(*args, **kwargs)
        monkeypatch.setattr(module, name, read)

    counting(persistent_kernels, "_poll_chunks", "poll")
    counting(persistent_kernels, "wait_flag", "wait")
    counting(pointer_kernels, "wait_flag", "pointer")
    return calls


def test_gathered_persistent_polls_every_chunk_once_per_program(monkeypatch):
    """The flag reads are hoisted out of the tile loop: each program loads every chunk's flag once, at its first
    tile of a peer chunk, and waits for none that has arrived; never for the local chunk.  The pointer kernel
    waits once per peer tile."""
    calls = _count_flag_reads(monkeypatch)
    lead, n, W, K, N = (2,), 12, 3, 16, 32  # 4 rows per chunk, BLOCK_M 2: 2 row tiles x 2 batch x 2 column tiles
    shards, w, bias = _ag_inputs(lead, n, W, K, N, torch.float32, seed=4)
    config = dict(AG_TILES, BLOCK_M=2)
    tiles_per_chunk = 2 * 2 * 2
    _ag_run(shards, w, bias, W, n, config, ranks=(0,))
    assert calls.count("poll") == config["PROGRAMS"] and calls.count("wait") == 0, calls  # one poll a program
    calls.clear()
    _ag_run(shards, w, bias, W, n, {k: v for k, v in config.items() if k != "PROGRAMS"}, kernel="gathered_matmul",
            ranks=(0,))
    assert calls.count("pointer") == tiles_per_chunk * (W - 1)


@pytest.mark.parametrize("missing, programs, reads", [
    # one tile a chunk, one program a tile: program 0 the local chunk (no flag read), program 1 chunk 2 (arrival
    # order: local, then rank - 1, ...): it polls, finds chunk 2 missing and waits for it alone; program 2 chunk 1:
    # it polls and finds it arrived
    (2, 3, ["poll", "wait", "poll"]),
    # one program for every tile: its poll at chunk 2 finds chunk 2 arrived and chunk 1 missing; at chunk 1 it polls
    # again (the mask may be stale) and waits for chunk 1 alone
    (1, 1, ["poll", "poll", "wait"]),
], ids=["first-peer-chunk-missing", "later-chunk-missing"])
def test_gathered_persistent_missing_push_poisons_its_chunk_and_raises(monkeypatch, missing, programs, reads):
    """A peer never pushed: rank 0's rows of its chunk are NaN, the other chunks are right, and the host raises
    naming that peer before the result can be used; the flag reads are the fewest that find it."""
    calls = _count_flag_reads(monkeypatch)
    from distfuse.errors import CollectiveTimeoutError
    from distfuse.kernels.all_gather_matmul import ag_push, gathered_matmul, gathered_matmul_workspace_bytes
    from distfuse.kernels.gathered_matmul_select import last_gather_choice

    lead, n, W, K, N = (1,), 9, 3, 16, 16
    shards, w, bias = _ag_inputs(lead, n, W, K, N, torch.float32, seed=6)
    ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(1, n, K, torch.float32))
    out = torch.full((1, n, N), float("nan"))
    with pytest.raises(CollectiveTimeoutError, match=rf"flag of peer\(s\) \[{missing}\] was not raised"), \
            ws.in_flight("missing push"):
        for r in range(W):
            if r != missing:
                ag_push(shards[r], ws, r, W, n)
        gathered_matmul(shards[0], w, ws, 0, W, n, bias=bias, out=out, config=dict(AG_TILES, PROGRAMS=programs))
    assert last_gather_choice().kernel == "gathered_matmul_persistent"
    assert calls == reads, calls
    start, stop = block_range(n, W, missing)
    assert torch.isnan(out[:, start:stop]).all()
    ref = _ag_ref64(shards, w, bias)
    keep = [i for i in range(n) if not start <= i < stop]
    _assert_close(out[:, keep], ref[:, keep], torch.float32, K + 1)


def test_gathered_fallbacks_name_the_pointer_kernel_and_why():
    """Descriptors need 16-byte row strides, one matrix of shard rows and an aligned weight; compiled fp32 without
    TF32 spills; each of those runs the pointer kernel, with the reason in the choice, and the same results."""
    from distfuse.kernels.gathered_matmul_persistent import gathered_persistent_supported, launch_gathered_persistent
    from distfuse.kernels.gathered_matmul_select import select_gather_kernel

    lead, n, W, K, N = (1,), 7, 2, 6, 12
    # K = 6 in fp32: the gathered rows are 24 bytes apart.
    shards, w, bias = _ag_inputs(lead, n, W, K, N, torch.float32, seed=7)
    outs, choices = _ag_run(shards, w, bias, W, n, AG_TILES)
    assert all(c.kernel == "gathered_matmul" and c.fell_back and "multiple of 16" in c.reason for c in choices)
    for r in range(W):
        _assert_close(outs[r], _ag_ref64(shards, w, bias), torch.float32, K + 1)
    with pytest.raises(UnsupportedError, match="gathered_matmul_persistent.*multiple of 16"):
        launch_gathered_persistent(shards[0], None, w, None, None, None, 0, W, n)
    # A shard whose rows are not one matrix (batch stride K, row stride B * K), and a weight with no aligned dim.
    x = torch.randn(4, 2, 16).transpose(0, 1)
    assert "one [B_ * len, K] matrix" in gathered_persistent_supported(x, torch.randn(8, 16))[1]
    odd = torch.randn(8, 17)[:, :16]  # rows 68 bytes apart
    assert "no contiguous dim" in select_gather_kernel(torch.randn(1, 4, 16), odd).reason
    # Compiled fp32 with IEEE products (torch's default).
    x, w32 = torch.randn(1, 4, 16), torch.randn(8, 16)
    assert select_gather_kernel(x, w32, compiled=False).kernel == "gathered_matmul_persistent"
    choice = select_gather_kernel(x, w32, compiled=True)
    assert choice.kernel == "gathered_matmul" and "IEEE" in choice.reason
    assert select_gather_kernel(x.half(), w32.half(), compiled=True).kernel == "gathered_matmul_persistent"
    with pytest.raises(UnsupportedError, match="kernel"):
        select_gather_kernel(x, w32, "warp_specialized")


def test_selectors_memoise_only_what_decides(monkeypatch):
    """Both selectors keep their descriptor choice per operands (dtypes, shapes, strides, base alignment), compile
    mode and TF32 setting: asked again, the same choice object; any of those changed, the choice that change makes."""
    from distfuse.kernels import gathered_matmul_select, matmul_scatter_select
    from distfuse.kernels.gathered_matmul_select import select_gather_kernel

    x, w = torch.randn(1, 4, 16), torch.randn(8, 16)
    for select in (select_gather_kernel, lambda a, b, **kw: select_scatter_kernel(a, b, "triton_persistent", **kw)):
        first = select(x, w, compiled=False)
        assert select(x.clone(), w.clone(), compiled=False) is first, "alike operands: the memo"
        assert first.kernel.endswith("_persistent")
        assert not select(x, w, compiled=True).kernel.endswith("_persistent"), "compiled fp32, IEEE products"
        assert not select(torch.randn(1, 4, 17)[..., :16], w, compiled=False).kernel.endswith("_persistent"), \
            "another row stride (68 bytes)"
        assert not select(x.view(-1)[2:50].view(1, 3, 16), w, compiled=False).kernel.endswith("_persistent"), \
            "a base 8 bytes off 16"
        assert select(x.half(), w.half(), compiled=True).kernel.endswith("_persistent"), "another dtype"
    for module in (gathered_matmul_select, matmul_scatter_select):
        monkeypatch.setattr(module, "tf32_allowed", lambda: True)
    assert select_gather_kernel(x, w, compiled=True).kernel == "gathered_matmul_persistent", "TF32 allowed"
    assert select_scatter_kernel(x, w, "triton_persistent", compiled=True).kernel == "matmul_scatter_persistent"


def test_bound_launches_follow_a_change_of_the_tf32_setting(monkeypatch):
    """The persistent producer's and consumer's bound launches are keyed by the fp32 input precision of each call
    (torch's TF32 setting, which a user may change between calls of one shape): a change binds anew, with the
    precision of that call, instead of launching the earlier call's."""
    from distfuse.kernels import gathered_matmul_persistent as gmp
    from distfuse.kernels._utils import BoundedMemo
    from distfuse.kernels.all_gather_matmul import all_gather_matmul_loopback, gathered_matmul_workspace_bytes

    precision = ["ieee"]
    for module in (mscp, gmp):
        monkeypatch.setattr(module, "input_precision", lambda dtype: precision[0])
        monkeypatch.setattr(module, "_BOUND", BoundedMemo())
    lead, n, W, K, N = (1,), 8, 2, 16, 16
    a, w, _ = _inputs(lead, n, W, K, N, torch.float32, seed=3)
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.float32))
    shards = [torch.randn(1, block_extent(n, W, r), K) for r in range(W)]
    ag_ws = LoopbackWorkspace(W, gathered_matmul_workspace_bytes(1, n, K, torch.float32))
    for setting in ("ieee", "tf32"):
        precision[0] = setting
        with ws.in_flight("tf32 change"):
            for r in range(W):
                matmul_scatter_persistent(a[r], w[r], ws, r, W)
        all_gather_matmul_loopback(shards, [w[0]] * W, ag_ws)
    for module in (mscp, gmp):
        seen = sorted({b.kwargs["INPUT_PRECISION"] for b in module._BOUND.values()})
        assert seen == ["ieee", "tf32"] and len(module._BOUND) == 2 * W, (module.__name__, seen)
    precision[0] = "ieee"  # back: the first binding again
    with ws.in_flight("tf32 back"):
        for r in range(W):
            matmul_scatter_persistent(a[r], w[r], ws, r, W)
    assert len(mscp._BOUND) == 2 * W


def test_gathered_persistent_runs_off_the_main_thread():
    """Host-side descriptors: no Triton allocator, so a launch from a fresh thread (CUDA autograd's backward
    thread, a checkpoint recompute) works and gives the float64 result."""
    import threading

    lead, n, W, K, N = (1,), 6, 2, 16, 16
    shards, w, bias = _ag_inputs(lead, n, W, K, N, torch.bfloat16, seed=8)
    result = {}

    def run():
        try:
            result["outs"], result["choices"] = _ag_run(shards, w, bias, W, n, AG_TILES)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    assert {c.kernel for c in result["choices"]} == {"gathered_matmul_persistent"}
    for out in result["outs"]:
        _assert_close(out, _ag_ref64(shards, w, bias), torch.bfloat16, K + 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_gathered_persistent_loopback_cuda(dtype):
    """Compiled (sm_90: TMA loads, pinned tiles, one program per SM): uneven chunks against float64, the choice
    named, and a launch from a second thread."""
    import threading

    from tests.tolerances import assert_rel_close

    lead, n, W, K, N = (2,), 1030, 4, 768, 1024
    shards, w, bias = _ag_inputs(lead, n, W, K, N, dtype, seed=12)
    dev = torch.device("cuda")
    shards, w, bias = [s.to(dev) for s in shards], w.to(dev), bias.to(dev)
    ref = _ag_ref64([s.cpu() for s in shards], w.cpu(), bias.cpu())
    result = {}

    def run():
        result["outs"], result["choices"] = _ag_run(shards, w, bias, W, n, None)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert {c.kernel for c in result["choices"]} == {"gathered_matmul_persistent"}, result["choices"]
    for out in result["outs"]:
        assert_rel_close(out, ref, dtype)


def test_bench_rows_name_the_consumer_kernel_that_ran():
    """bench/bench_gemm_fused.py at tiny shapes (CPU, interpreted: the times mean nothing): the all-gather GEMM row
    names the persistent kernel and carries the pointer fallback's time; a K the descriptors cannot read names the
    pointer kernel and why; chunk_reduce's row names chunk_reduce."""
    import bench.bench_gemm_fused as bench

    rows = bench.sweep({"tiny": (16, 48)}, (6,), 2, "float32", 1, torch.device("cpu"), None, sides=["ag", "rs"])
    fused = {r.op: r for r in rows if r.provider == "fused"}
    ag = fused["gathered_matmul"]
    assert ag.kernel == "gathered_matmul_persistent" and not ag.extra["fell_back"], ag
    assert ag.extra["fallback_kernel"] == "gathered_matmul" and ag.extra["fallback_ms"] > 0
    assert fused["chunk_reduce"].kernel == "chunk_reduce"
    rows = bench.sweep({"odd": (6, 48)}, (6,), 2, "float32", 1, torch.device("cpu"), None, sides=["ag"])
    ag = next(r for r in rows if r.op == "gathered_matmul" and r.provider == "fused")
    assert ag.kernel == "gathered_matmul" and ag.extra["fell_back"] and "multiple of 16" in ag.extra["kernel_reason"]


def test_gathered_persistent_pinned_tiles_avoid_a_short_last_wave(monkeypatch):
    """The GPU rule (pure: shape, dtype, SM count): the bucket's tile unless its last wave leaves the grid under 90%
    busy, then the next smaller tile of the family that does not (or the busiest); always the split epilogue."""
    import distfuse.kernels.gathered_matmul_persistent as gp

    monkeypatch.setattr(gp, "INTERPRET", False)
    cfg = gp.gathered_persistent_config(torch.bfloat16, 1, 1024, 8, 2048, 132)  # 512 tiles: 3.9 waves of 128x256
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["EPILOGUE_SUBTILE"]) == (128, 256, True)
    cfg = gp.gathered_persistent_config(torch.bfloat16, 1, 1024, 8, 1792, 132)  # LLaMA-3 8B up proj, TP 8, M 8192
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 128)  # 448 tiles of 128x256 were 85% busy; 896: 97%
    from distfuse.kernels.persistent import WAVE_TARGET, wave_efficiency

    assert wave_efficiency(448, 132) < WAVE_TARGET <= wave_efficiency(896, 132)
    cfg = gp.gathered_persistent_config(torch.bfloat16, 1, 64, 8, 1792, 132)  # M = 512: no tile fills one wave
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (64, 128)
    assert gp.gathered_persistent_config(torch.float32, 1, 64, 8, 1792, 132, dict(BLOCK_M=16, BLOCK_N=32,
                                         BLOCK_K=16, GROUP_M=1, PROGRAMS=5)) == dict(
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, EPILOGUE_SUBTILE=False)
