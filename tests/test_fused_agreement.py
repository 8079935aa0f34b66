"""The GEMM fusions' agreement check: ranks that enter a fused op with different shapes or dtypes all raise ShapeError.

No host collective is added to the steady state: each rank publishes a signature word of
its call into its peers' headers before its flags, and each consumer compares the words
after its flag waits (:mod:`distfuse.kernels.signature`).  Across processes (``/dev/shm``
workspaces, three of four ranks, permuted): one rank passing another row count, and
fp16 on one rank against bf16 on the others, in both ops and with every producer; every
active rank raises a ShapeError that names the disagreement, and the next agreeing call
(on a fresh workspace) is right again.  In loopback: the kernels' part, a mismatching
word poisons the output and turns into ShapeError, a matching one changes nothing; a rank
that abstains (``REFUSED``, ``GROW``) raises every flag it owes and its peers' errors say
which word they saw.  The other fused ops, refusals and growth across processes:
``tests/test_fused_agreement_forms.py``.
"""

import math

import pytest
import torch

from distfuse import Partition
from distfuse.errors import ShapeError
from distfuse.fused.all_gather_matmul import all_gather_matmul
from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.signature import (
    GATHER_FLAGS,
    GROW,
    MISMATCH,
    REFUSED,
    SCATTER_FLAGS,
    abstain,
    check_signatures,
    consumer_flags,
    publish_signature,
    shape_signature,
)
from distfuse.testing import run_ranks
from tests.tolerances import tol

ORDER = [2, 0, 3]  # world ranks of the partition, permuted; world rank 1 stays outside


def _call(op, P, dtype, n, provider, seed):
    """One forward + backward of ``op`` on this rank's blocks; returns (y, dx) or raises."""
    W, r = P.size, P.rank
    K, N = 6, 5
    g = torch.Generator().manual_seed(seed + r)
    if op == "reduce_scatter":
        x = torch.randn(2, n, block_extent(K, W, r), generator=g).to(dtype).requires_grad_()
        w = torch.randn(N, x.shape[-1], generator=g).to(dtype)
        y = matmul_reduce_scatter(x, w, None, P, provider=provider)
    else:
        x = torch.randn(2, block_extent(n, W, r), K, generator=g).to(dtype).requires_grad_()
        w = torch.randn(block_extent(N, W, r), K, generator=g).to(dtype)
        y = all_gather_matmul(x, w, None, P, n=n, provider=provider)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def _rank_disagree(op, provider, kind):
    P = Partition.world().create_partition_inclusive(ORDER).create_cartesian_topology_partition([1, len(ORDER), 1])
    if not P.active:
        return None
    r, n = P.rank, 7
    _call(op, P, torch.bfloat16, 9, provider, 0)  # warm: the workspace holds the larger shapes below
    dtype = torch.float16 if (kind == "dtype" and r == 1) else torch.bfloat16
    rows = n + 1 if (kind == "rows" and r == 1) else n  # the reduce-scatter's x rows: nothing local can see it
    try:
        _call(op, P, dtype, rows, provider, 1)
        error = None
    except ShapeError as exc:
        error = str(exc)
    # Every rank raised: the next agreeing call gets a fresh workspace and is right again.
    y, dx = _call(op, P, torch.float32, n, provider, 2)
    close_all()
    return dict(rank=r, error=error, y=y, dx=dx)


def _reference(op, n, W, r, seed=2):
    """float64 y and dx of rank r for the agreeing fp32 call of :func:`_call` (the global tensors, torch alone)."""
    K, N = 6, 5
    xs, ws = [], []
    for p in range(W):
        g = torch.Generator().manual_seed(seed + p)
        if op == "reduce_scatter":
            xs.append(torch.randn(2, n, block_extent(K, W, p), generator=g).double())
            ws.append(torch.randn(N, xs[-1].shape[-1], generator=g).double())
        else:
            xs.append(torch.randn(2, block_extent(n, W, p), K, generator=g).double())
            ws.append(torch.randn(block_extent(N, W, p), K, generator=g).double())
    if op == "reduce_scatter":
        y_full = torch.nn.functional.linear(torch.cat(xs, -1), torch.cat(ws, -1))
        rows = slice(*block_range(n, W, r))
        dy_full = torch.zeros_like(y_full)
        dy_full[:, rows] = 1.0  # each rank's dy is ones on its own block; the gathered dy is ones everywhere
        return y_full[:, rows], torch.ones(2, n, N, dtype=torch.float64) @ ws[r]
    x_full = torch.cat(xs, -2)
    dx_full = sum(torch.ones(2, n, w.shape[0], dtype=torch.float64) @ w for w in ws)
    return x_full @ ws[r].t(), dx_full[:, slice(*block_range(n, W, r))]


@pytest.mark.parametrize("op,provider,kind", [
    pytest.param("reduce_scatter", "triton", "rows", id="rs-triton-rows"),
    pytest.param("reduce_scatter", "cublas_chunks", "dtype", id="rs-cublas-fp16-vs-bf16"),
    pytest.param("all_gather", "copy_engine", "dtype", id="ag-copy-engine-fp16-vs-bf16"),
    pytest.param("all_gather", "triton", "dtype", id="ag-triton-fp16-vs-bf16"),
])
def test_disagreeing_ranks_all_raise_shape_error(op, provider, kind):
    out = [o for o in run_ranks(4, _rank_disagree, op, provider, kind) if o is not None]
    assert len(out) == len(ORDER)
    for o in out:
        assert o["error"] is not None, f"partition rank {o['rank']}: no error for a disagreeing call"
        assert "disagree on the op's shapes or dtypes" in o["error"], o["error"]
        y_ref, dx_ref = _reference(op, 7, len(ORDER), o["rank"])
        torch.testing.assert_close(o["y"].double(), y_ref, **tol(torch.float32))
        torch.testing.assert_close(o["dx"].double(), dx_ref, **tol(torch.float32))


def test_signature_words_in_loopback():
    """The kernels: a matching word changes nothing; a mismatch sets the status word, poisons, raises ShapeError."""
    W, n = 3, 6
    sig = shape_signature("op", (2,), n, torch.float16)
    assert sig == shape_signature("op", (2,), n, torch.float16) != shape_signature("op", (2,), n, torch.bfloat16)
    ws = LoopbackWorkspace(W, 4096)
    with ws.in_flight("agree"):
        for r in range(W):
            publish_signature(ws, r, W, sig)
            for c in range(W):  # stand in for each producer's flags: chunk c's [c, r] on owner c
                ws.rank_view(c).flags[c, r] = int(ws.epoch_dev)
        for r in range(W):
            out = torch.randn(4, 5)
            before = out.clone()
            check_signatures(ws, r, W, sig, out, flag_base=r * W, flag_stride=1, op="agree", what="test")
            assert torch.equal(out, before)
            assert ws.rank_view(r).sigs.tolist() == [sig if s != r else 0 for s in range(W)]
    out = torch.randn(math.prod((4, 5)))
    with pytest.raises(ShapeError, match=r"peer\(s\) \[2\] entered it with a signature different"), \
            ws.in_flight("disagree"):
        for r in range(W):
            publish_signature(ws, r, W, sig + (r == 2))
            for c in range(W):
                ws.rank_view(c).flags[c, r] = int(ws.epoch_dev)
        try:
            check_signatures(ws, 0, W, sig, out, flag_base=0, flag_stride=1, op="disagree", what="test")
        finally:
            assert ws.rank_view(0).last_status.tolist() == [0, 0, MISMATCH]
            assert torch.isnan(out).all()


def _stand_in_producer(ws, r, W, sig, layout):
    """Virtual rank r's word and the flags its producer raises: ``[c, r]`` on owner c (a reduce-scatter), or
    ``[r, r]`` on every rank (an all-gather push)."""
    publish_signature(ws, r, W, sig)
    for c in range(W):
        ws.rank_view(c).flags[c if layout == SCATTER_FLAGS else r, r] = int(ws.epoch_dev)


@pytest.mark.parametrize("layout", [SCATTER_FLAGS, GATHER_FLAGS])
def test_an_abstaining_rank_raises_every_flag_and_its_word_names_it(layout):
    """REFUSED: the abstainer's flags satisfy a consumer of either layout, whose error names the refusal; GROW
    against ranks whose calls fit raises on both sides (GROW on every rank: across processes, in
    ``tests/test_fused_agreement_forms.py``)."""
    W, sig = 4, shape_signature("op", 1)
    ws = LoopbackWorkspace(W, 4096)
    out = torch.randn(3, 5)
    with pytest.raises(ShapeError, match=r"peer\(s\) \[1\] refused their input"), ws.in_flight("refuse"):
        for r in (0, 2, 3):
            _stand_in_producer(ws, r, W, sig, layout)
        abstain(ws, 1, W, REFUSED, layout, op="refuse", what="test", raise_on_mismatch=False)
        for c in range(W):  # every flag of source 1, on every rank, carries this epoch
            assert ws.rank_view(c).flags[:, 1].tolist() == [int(ws.epoch_dev)] * W
        assert ws.rank_view(1).last_status.tolist() == [MISMATCH, 0, MISMATCH, MISMATCH]  # it saw the others' words
        try:
            check_signatures(ws, 0, W, sig, out, **consumer_flags(layout, 0, W), op="refuse", what="test")
        finally:
            assert ws.rank_view(0).last_status.tolist() == [0, REFUSED, 0, 0]
            assert torch.isnan(out).all()

    ws = LoopbackWorkspace(W, 4096)
    alone = r"peer\(s\) \[0, 2, 3\] entered it with a signature different.*needs more"
    with pytest.raises(ShapeError, match=alone), ws.in_flight("grow alone"):
        for r in (0, 2, 3):
            _stand_in_producer(ws, r, W, sig, layout)
        abstain(ws, 1, W, GROW, layout, op="grow alone", what="this rank needs more", raise_on_mismatch=True)
    assert ws.broken
    check = LoopbackWorkspace(W, 4096)
    with pytest.raises(ShapeError, match=r"peer\(s\) \[1\] needed a larger workspace"), check.in_flight("fits"):
        for r in (0, 2, 3):
            _stand_in_producer(check, r, W, sig, layout)
        abstain(check, 1, W, GROW, layout, op="fits", what="test", raise_on_mismatch=False)
        check_signatures(check, 0, W, sig, out, **consumer_flags(layout, 0, W), op="fits", what="test")


# ---------------------------------------------------------------- the check inside the reduction kernel


def _scatter_claim(ws, W, n, N, sigs, consumers, *, skip_source=None, seed=3):
    """Producers (each rank r publishing ``sigs[r]``), then ``chunk_reduce`` with the in-kernel agreement on the ranks
    of ``consumers``; returns ``{rank: output or the exception}``.  ``skip_source``: a rank that never produces."""
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter

    g = torch.Generator().manual_seed(seed)
    K = 16
    a = [torch.randn(1, n, K, generator=g) for _ in range(W)]
    w = [torch.randn(N, K, generator=g) / 4 for _ in range(W)]
    outs = {}
    try:
        with ws.in_flight("in-kernel agreement"):
            for r in range(W):
                if r != skip_source:
                    publish_signature(ws, r, W, sigs[r])
                    matmul_scatter(a[r], w[r], ws, r, W, config=dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2))
            for r in consumers:
                outs[r] = torch.full((1, block_extent(n, W, r), N), 7.0)
                chunk_reduce(ws, r, W, 1, n, N, partial_dtype=torch.float32, out=outs[r],
                             agreement=(sigs[0], f"rank {r}'s call"))
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        outs["error"] = exc
    return outs, a, w


@pytest.mark.parametrize("n, N", [(6, 16), (48, 16), (48, 20)], ids=["one-block", "flat-blocks", "row-blocks"])
def test_the_reduction_kernel_checks_the_signatures_itself(monkeypatch, n, N):
    """``chunk_reduce(agreement=...)``: no check_signatures launch; matching words give bitwise the plain reduction;
    a peer's different word poisons the chunk and raises ShapeError naming this rank's call and the peer.

    The words are compared once the first block's loads are issued (that block is peeled off the loop), and the
    verdict must reach every later block: chunks of several blocks a program, in both layouts (``N = 20``: slot
    rows padded to 32, the row-block walk), must come out NaN everywhere (the output starts at 7, so a block the
    poison missed would show)."""
    import distfuse.kernels.signature as signature_kernels

    launches = []
    real = signature_kernels._launch_check
    monkeypatch.setattr(signature_kernels, "_launch_check", lambda *a, **k: launches.append(1) or real(*a, **k))
    W = 3
    sig = shape_signature("op", 1)
    ws = LoopbackWorkspace(W, 1 << 16)
    outs, a, w = _scatter_claim(ws, W, n, N, [sig] * W, range(W))
    assert "error" not in outs and not launches, "the agreement is checked inside the reduction kernel"
    for r in range(W):
        rows = slice(*block_range(n, W, r))
        ref = sum(x[:, rows].double() @ v.double().t() for x, v in zip(a, w, strict=True))
        torch.testing.assert_close(outs[r].double(), ref, **tol(torch.float32, terms=16 * W))
        assert ws.rank_view(r).last_status.tolist() == [0] * W
    if n > 6:  # several blocks a program: the verdict must outlive the first (CPU: BLOCK 64, 2 programs)
        from distfuse.kernels.chunk_reduce import reduce_meta, slot_row_stride

        meta = reduce_meta(n // W, N, slot_row_stride(N), torch.float32, W)
        rows_a_block = meta["BLOCK"] if meta["FLAT"] else meta["BLOCK"] // meta["BLOCK_C"]
        blocks = -(-(n // W) * (N if meta["FLAT"] else 1) // rows_a_block)
        assert meta["FLAT"] == (N % 16 == 0) and blocks >= 4, (meta, blocks)
    ws = LoopbackWorkspace(W, 1 << 16)
    outs, _, _ = _scatter_claim(ws, W, n, N, [sig, sig, sig + 1], (0,))
    error = outs["error"]
    assert isinstance(error, ShapeError) and not launches, error
    assert "peer(s) [2] entered it with a signature different" in str(error) and "(rank 0's call)" in str(error)
    assert ws.rank_view(0).last_status.tolist() == [0, 0, MISMATCH]
    assert torch.isnan(outs[0]).all(), "a disagreeing call's output is NaN, never a plausible sum"


def test_a_missing_peer_is_a_timeout_not_a_disagreement():
    """Source 1 never produced (nor published): its stale word is not compared; the error is the flag wait's."""
    from distfuse.errors import CollectiveTimeoutError

    W, n, N = 3, 6, 16
    ws = LoopbackWorkspace(W, 1 << 16)
    outs, _, _ = _scatter_claim(ws, W, n, N, [shape_signature("op", 2)] * W, (0,), skip_source=1)
    assert isinstance(outs["error"], CollectiveTimeoutError), outs["error"]
    assert ws.rank_view(0).last_status.tolist() == [0, int(ws.epoch_dev), 0]
    assert torch.isnan(outs[0]).all()


def test_an_empty_chunk_still_checks_the_signatures():
    """n = 2 over W = 3: rank 2's chunk is empty, no reduction runs, and the separate check still raises there."""
    W, n, N = 3, 2, 16
    sig = shape_signature("op", 3)
    ws = LoopbackWorkspace(W, 1 << 16)
    outs, _, _ = _scatter_claim(ws, W, n, N, [sig, sig + 1, sig], (2,))
    assert block_extent(n, W, 2) == 0
    assert isinstance(outs["error"], ShapeError) and "peer(s) [1]" in str(outs["error"]), outs["error"]
