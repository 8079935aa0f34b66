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
            assert ws.rank_view(0).status.tolist() == [0, 0, MISMATCH]
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
        assert ws.rank_view(1).status.tolist() == [MISMATCH, 0, MISMATCH, MISMATCH]  # it saw the others' words
        try:
            check_signatures(ws, 0, W, sig, out, **consumer_flags(layout, 0, W), op="refuse", what="test")
        finally:
            assert ws.rank_view(0).status.tolist() == [0, REFUSED, 0, 0]
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
