"""The agreement check of the remaining GEMM fusions, and the disagreements one rank sees before the op's claim.

Across processes (``/dev/shm`` workspaces, the partition's ranks permuted, a world rank
outside it passing nothing), with ``DISTFUSE_TIMEOUT=60`` on the partition's groups and
their workspaces (the world group keeps the pool's own), so an error that waited for a
timeout would take a minute:

* **Signature words** in the feature-split pair, ``matmul_all_reduce`` (one-shot and
  two-shot) and ``zero_linear`` (both splits, fused forward and backward over the
  data-parallel workers): one rank with another row count (the ZeRO forms: another
  ``out_features``, the gathered weight's rows), then fp16 on one rank against bf16 on
  the others.  The workspace was sized by a larger agreeing call first, so both reach the
  words (no local check can see them).  Every rank raises a ShapeError naming the
  disagreement, within :data:`PROMPT` seconds.
* **Refusals**: a local check that fails on one rank only (a shard whose rows do not fit
  its block of ``n``, a feature block, a bias block, a weight dtype, a ``bias_grad``): that
  rank raises its own error and every peer a ShapeError saying a peer refused its input.
* **Growth**: one rank whose call needs more than the cached workspace makes every rank
  raise; every rank needing more grows it together (the workspace's generation goes up
  by one) and computes the right result.

After each error the next agreeing call (fp32, on a fresh workspace) is compared, output
and every gradient, with ``torch.nn.functional`` in float64 on the global tensors.
"""

from __future__ import annotations

import contextlib
import os
import time
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from distfuse import Partition
from distfuse.fused.all_gather_features_matmul import all_gather_features_matmul
from distfuse.fused.all_gather_matmul import all_gather_matmul
from distfuse.fused.matmul_all_reduce import matmul_all_reduce
from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter
from distfuse.fused.matmul_reduce_scatter_features import matmul_reduce_scatter_features
from distfuse.fused.symmetric import cached_workspace, close_all
from distfuse.fused.zero_linear import zero_linear
from distfuse.geometry.decomposition import block_range
from distfuse.testing import run_ranks
from tests.tolerances import tol

ORDER = [2, 0, 3]  # the partition's world ranks, permuted; world rank 1 stays outside
PROMPT = 10.0  # seconds: far below DISTFUSE_TIMEOUT=60 (measured: about a second on 2 loaded cores)
LEAD, N_ROWS, K, N = 2, 5, 7, 5  # global x [LEAD, N_ROWS, K], weight [N, K]: uneven over 3 workers
_PARTITIONS: dict = {}


@contextlib.contextmanager
def _waits_of_a_minute():
    """``DISTFUSE_TIMEOUT=60`` for the groups and workspaces made inside (the pool's value again afterwards)."""
    with mock.patch.dict(os.environ, {"DISTFUSE_TIMEOUT": "60"}):
        try:
            yield
        finally:
            close_all()  # no workspace with these waits outlives the test


def _partition(ranks, world: int):
    """A 1 x W x 1 Cartesian partition of ``ranks`` (call inside :func:`_waits_of_a_minute`)."""
    key = (tuple(ranks), world)
    if key not in _PARTITIONS:
        _PARTITIONS[key] = Partition.world().create_partition_inclusive(list(ranks)) \
            .create_cartesian_topology_partition([1, len(ranks), 1])
    return _PARTITIONS[key]


def _blk(extent: int, W: int, r: int) -> slice:
    return slice(*block_range(extent, W, r))


def _globals(seed: int, n: int = N_ROWS, k: int = K, nout: int = N, W: int = 3):
    """The global float64 tensors of one call: x, weight, bias and one output gradient per worker."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LEAD, n, k, generator=g, dtype=torch.float64)
    w = torch.randn(nout, k, generator=g, dtype=torch.float64)
    b = torch.randn(nout, generator=g, dtype=torch.float64)
    gys = [torch.randn(LEAD, n, nout, generator=g, dtype=torch.float64) for _ in range(W)]
    return x, w, b, gys


# ---------------------------------------------------------------- one call per op, on this rank's blocks


def _call(op: str, P, dtype, seed: int, n: int = N_ROWS, nout: int = N):
    """Forward + backward of ``op`` on this rank's blocks of the global tensors; returns outputs and gradients."""
    W, r = P.size, P.rank
    x, w, b, gys = _globals(seed, n=n, nout=nout, W=W)
    ks, ns = _blk(K, W, r), _blk(nout, W, r)
    if op == "rs_features":  # x [*, K_r], weight [N, K_r], bias [N_r] -> [*, N_r]
        xr, wr, br, gy = x[..., ks], w[:, ks], b[ns], gys[0][..., ns]
        fn = lambda xr, wr, br: matmul_reduce_scatter_features(xr, wr, br, P)  # noqa: E731
    elif op == "ag_features":  # x [*, K_r], weight [N_r, K], bias [N_r] -> [*, N_r]
        xr, wr, br, gy = x[..., ks], w[ns], b[ns], gys[0][..., ns]
        fn = lambda xr, wr, br: all_gather_features_matmul(xr, wr, br, P)  # noqa: E731
    elif op.startswith("all_reduce"):  # x [*, K_r], weight [N, K_r], bias on rank 0 -> [*, N] everywhere
        xr, wr, br, gy = x[..., ks], w[:, ks], (b if r == 0 else None), gys[r]
        algorithm = "one_shot" if op.endswith("one") else "two_shot"
        fn = lambda xr, wr, br: matmul_all_reduce(xr, wr, br, P, algorithm=algorithm)  # noqa: E731
    else:  # zero_rows / zero_columns over P_d = P (P_m = 1): x [rows_d, K] is this worker's batch block
        rows_d = _blk(LEAD * n, W, r)
        xr, br, gy = x.reshape(-1, K)[rows_d], None, gys[0].reshape(-1, nout)[rows_d]
        split = op.split("_")[1]
        wr = w[ns] if split == "rows" else w[:, ks]
        fn = lambda xr, wr, br: zero_linear(xr, wr, P, None, split=split, out_features=nout,  # noqa: E731
                                            in_features=K)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (xr, wr, br)]
    y = fn(*leaves)
    y.backward(gy.to(dtype))
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _reference(op: str, W: int, r: int, seed: int):
    """float64 output and gradients of rank r for :func:`_call`, from the global tensors and torch alone."""
    x, w, b, gys = _globals(seed, W=W)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    ks, ns = _blk(K, W, r), _blk(N, W, r)
    zero = op.startswith("zero")
    y = F.linear(x, w, None if zero else b)
    if op.startswith("all_reduce"):
        y.backward(sum(gys))  # every rank's gradient of the replicated output, summed (grad_output="sum")
        return [y.detach(), x.grad[..., ks], w.grad[:, ks], b.grad if r == 0 else None]
    y.backward(gys[0])  # the other forms: each rank's gradient is its own block of gys[0]
    if op == "rs_features":
        return [y.detach()[..., ns], x.grad[..., ks], w.grad[:, ks], b.grad[ns]]
    if op == "ag_features":
        return [y.detach()[..., ns], x.grad[..., ks], w.grad[ns], b.grad[ns]]
    rows_d = _blk(LEAD * N_ROWS, W, r)
    shard_grad = w.grad[ns] if op == "zero_rows" else w.grad[:, ks]
    return [y.detach().reshape(-1, N)[rows_d], x.grad.reshape(-1, K)[rows_d], shard_grad, None]


def _catch(fn) -> tuple:
    """``(error type, message, seconds)``; ``("ok", None, seconds)`` when ``fn`` did not raise."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects every kind
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", None, time.monotonic() - t0


def _check_results(out: list, op: str, W: int, seed: int):
    for o in out:
        for got, ref in zip(o["after"], _reference(op, W, o["rank"], seed), strict=True):
            assert (got is None) == (ref is None), op
            if ref is not None:
                torch.testing.assert_close(got.double(), ref, **tol(torch.float32))


# ---------------------------------------------------------------- signature words


def _rank_disagree(op: str):
    with _waits_of_a_minute():
        return _disagree(op, _partition(ORDER, 4))


def _disagree(op: str, P):
    if not P.active:
        return None
    r, bad = P.rank, P.rank == 1
    outcomes = {}
    for kind in ("rows", "dtype"):
        _call(op, P, torch.bfloat16, 0, n=N_ROWS + 2, nout=N + 2)  # warm: the workspace holds the larger call
        dtype = torch.float16 if (kind == "dtype" and bad) else torch.bfloat16
        n, nout = N_ROWS, N
        if kind == "rows" and bad:
            n, nout = (N_ROWS, N + 1) if op.startswith("zero") else (N_ROWS + 1, N)
        outcomes[kind] = _catch(lambda n=n, nout=nout, dtype=dtype: _call(op, P, dtype, 1, n=n, nout=nout))
    return dict(rank=r, outcomes=outcomes, after=_call(op, P, torch.float32, 2))


@pytest.mark.parametrize("op", ["rs_features", "ag_features", "all_reduce_one", "all_reduce_two", "zero_rows",
                                "zero_columns"])
def test_disagreeing_ranks_all_raise_shape_error_promptly(op):
    out = [o for o in run_ranks(4, _rank_disagree, op) if o is not None]
    assert len(out) == len(ORDER)
    for o in out:
        for kind, (kind_name, msg, seconds) in o["outcomes"].items():
            assert kind_name == "ShapeError", (op, kind, o["rank"], kind_name, msg)
            assert "disagree on the op's shapes or dtypes" in msg, msg
            assert seconds < PROMPT, (op, kind, o["rank"], seconds)
    _check_results(out, op, len(ORDER), 2)


# ---------------------------------------------------------------- refusals and growth


def _refusing_call(case: str, P, bad: bool):
    """One call in which rank 1 of ``P`` passes an argument its own checks refuse (the others agree)."""
    W, r = P.size, P.rank
    x, w, b, _ = _globals(3, W=W)
    ks, ns, rows = _blk(K, W, r), _blk(N, W, r), _blk(N_ROWS, W, r)
    if case == "ag_rows":  # a shard whose rows do not fit its block of n
        xr = x[:, rows.start: rows.stop + (1 if bad else 0)]
        return all_gather_matmul(xr.float(), w[ns].float(), None, P, n=N_ROWS)
    if case == "ag_features_block":  # a feature block that is not the balanced one
        xr = x[..., ks.start: ks.stop + (1 if bad else 0)]
        return all_gather_features_matmul(xr.float(), w[ns].float(), None, P)
    if case == "rs_features_bias":  # the bias of another block
        br = b[: ns.stop - ns.start + 1] if bad else b[ns]
        return matmul_reduce_scatter_features(x[..., ks].float(), w[:, ks].float(), br.float(), P)
    if case == "all_reduce_dtype":  # a weight of another dtype than x
        return matmul_all_reduce(x[..., ks].float(), w[:, ks].to(torch.float16 if bad else torch.float32), None, P)
    if case == "zero_shard":  # a ZeRO shard of another block
        rows_d = _blk(LEAD * N_ROWS, W, r)
        shard = w[_blk(N, W, (r + 1) % W)] if bad else w[ns]
        return zero_linear(x.reshape(-1, K)[rows_d].float(), shard.float(), P, None, split="rows", out_features=N,
                           in_features=K)
    assert case == "rs_bias_grad"  # a bias_grad nobody knows
    return matmul_reduce_scatter(x[..., ks].float(), w[:, ks].float(), b.float(), P,
                                 bias_grad="everyone" if bad else "partial")


def _rank_refuse(case: str, ranks, world: int):
    with _waits_of_a_minute():
        P = _partition(ranks, world)
        if not P.active:
            return None
        op = dict(ag_features_block="ag_features", zero_shard="zero_rows").get(case, "rs_features")
        _call(op, P, torch.float32, 0)  # a cached workspace exists (the refusing rank meets its peers in it)
        outcome = _catch(lambda: _refusing_call(case, P, P.rank == 1))
        return dict(rank=P.rank, outcome=outcome, after=_call(op, P, torch.float32, 2), op=op)


@pytest.mark.parametrize("case,ranks,world", [
    pytest.param("ag_rows", ORDER, 4, id="ag-shard-rows"),
    pytest.param("ag_features_block", ORDER, 4, id="ag-features-block"),
    pytest.param("rs_features_bias", ORDER, 4, id="rs-features-bias-block"),
    pytest.param("all_reduce_dtype", ORDER, 4, id="all-reduce-weight-dtype"),
    pytest.param("zero_shard", ORDER, 4, id="zero-shard-block"),
    pytest.param("rs_bias_grad", [4, 1, 5, 0, 2], 6, id="rs-bias-grad-W5-of-6"),
])
def test_a_rank_that_refuses_its_input_makes_every_rank_raise(case, ranks, world):
    out = [o for o in run_ranks(world, _rank_refuse, case, ranks, world) if o is not None]
    assert len(out) == len(ranks)
    for o in out:
        name, msg, seconds = o["outcome"]
        assert seconds < PROMPT, (case, o["rank"], seconds)
        if o["rank"] == 1:  # its own error, as it was before the protocol
            assert name == ("UnsupportedError" if case in ("all_reduce_dtype", "rs_bias_grad") else "ShapeError"), \
                (name, msg)
            assert "refused their input" not in msg, msg
        else:
            assert name == "ShapeError", (case, o["rank"], name, msg)
            assert "peer(s) [1] refused their input" in msg, msg
    _check_results(out, out[0]["op"], len(ranks), 2)


def _rank_grow(everyone: bool):
    with _waits_of_a_minute():
        P = _partition(ORDER, 4)
        if not P.active:
            return None
        _call("all_reduce_one", P, torch.float32, 0, n=1)  # the cached workspace: one row's worth
        gen = cached_workspace(P).generation
        rows = 3 * N_ROWS if (everyone or P.rank == 1) else 1
        outcome = _catch(lambda: _call("all_reduce_one", P, torch.float32, 1, n=rows))
        grown = cached_workspace(P)
        return dict(rank=P.rank, outcome=outcome, after=_call("all_reduce_one", P, torch.float32, 2), gen=gen,
                    grown_gen=None if grown is None else grown.generation)


@pytest.mark.parametrize("everyone", [False, True], ids=["one-rank-grows", "every-rank-grows"])
def test_a_workspace_too_small_on_one_rank_raises_everywhere_and_grows_when_all_agree(everyone):
    out = [o for o in run_ranks(4, _rank_grow, everyone) if o is not None]
    assert len(out) == len(ORDER)
    for o in out:
        name, msg, seconds = o["outcome"]
        assert seconds < PROMPT, (o["rank"], seconds)
        if everyone:
            assert name == "ok", msg
            assert o["grown_gen"] == o["gen"] + 1  # grown once, together
        else:
            assert name == "ShapeError", (o["rank"], name, msg)
            assert o["grown_gen"] is None  # broken on every rank: the next call sets up a fresh one
            if o["rank"] == 1:
                assert "needs" in msg and "the peers' calls fit it" in msg, msg
            else:
                assert "peer(s) [1] needed a larger workspace" in msg, msg
    _check_results(out, "all_reduce_one", len(ORDER), 2)

