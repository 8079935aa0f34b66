"""Fused linear ops with autograd: GEMM + reduce-scatter and all-gather + GEMM on symmetric workspaces.

Across processes (CPU, ``/dev/shm`` workspaces, Triton interpreter): the fused forward
and every gradient (x, weight, bias) against the unfused composition (``F.linear`` + the
ReduceScatter / AllGather primitives) and a float64 reference, on fresh random data.
The ranks run with ``DISTFUSE_DEBUG=1``, so every kernel output starts as NaN, and the
workspace is filled with NaN bytes before the forward and before the backward: an
element no kernel wrote, or a slot read before its producer wrote it, shows up.  Shapes
are tiny (an interpreted program costs ~0.1 s): batch 2, n = 7 (not divisible by W),
K = 8 split over W, N = 12.
"""

import glob
import math
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import distfuse.kernels.all_gather_matmul as all_gather_kernels
import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, PartitionError, ShapeError, UnsupportedError
from distfuse.fused import symmetric, symmetric_availability
from distfuse.fused.all_gather_matmul import (
    all_gather_matmul,
    all_gather_matmul_loopback,
    all_gather_matmul_workspace_bytes,
)
from distfuse.fused.matmul_reduce_scatter import (
    fused_linear_available,
    matmul_reduce_scatter,
    matmul_reduce_scatter_loopback,
    matmul_reduce_scatter_workspace_bytes,
)
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace, WorkspaceBrokenError, WorkspaceBusyError
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.primitives.all_gather import all_gather
from distfuse.primitives.reduce_scatter import reduce_scatter
from distfuse.testing import run_ranks, shutdown_pools
from tests.tolerances import assert_rel_close, tol

F64 = torch.float64
GRADS = ("y", "dx", "dw", "db")


# ---------------------------------------------------------------- data and references (float64)


def _rs_data(seed, W, lead, n, K, N):
    """Row-parallel: x_p [*lead, n, K_p], w_p [N, K_p], one replicated bias [N], the global dy [*lead, n, N]."""
    g = torch.Generator().manual_seed(seed)
    Ks = [block_extent(K, W, p) for p in range(W)]
    return dict(xs=[torch.randn(*lead, n, k, generator=g, dtype=F64) for k in Ks],
                ws=[torch.randn(N, k, generator=g, dtype=F64) / math.sqrt(K) for k in Ks],
                b=torch.randn(N, generator=g, dtype=F64),
                dy=torch.randn(*lead, n, N, generator=g, dtype=F64))


def _ag_data(seed, W, lead, n, K, N):
    """Column-parallel: x_p [*lead, n_p, K], w_p [N_p, K], b_p [N_p], dy_p [*lead, n, N_p]."""
    g = torch.Generator().manual_seed(seed)
    Ns = [block_extent(N, W, p) for p in range(W)]
    return dict(xs=[torch.randn(*lead, block_extent(n, W, p), K, generator=g, dtype=F64) for p in range(W)],
                ws=[torch.randn(m, K, generator=g, dtype=F64) / math.sqrt(K) for m in Ns],
                bs=[torch.randn(m, generator=g, dtype=F64) for m in Ns],
                dys=[torch.randn(*lead, n, m, generator=g, dtype=F64) for m in Ns])


def _rounded(d, dtype):
    """The data as the op sees it (rounded to ``dtype``), back in float64: references use exactly these values."""
    return {k: ([t.to(dtype).double() for t in v] if isinstance(v, list) else v.to(dtype).double())
            for k, v in d.items()}


def _rs_ref(d, r, W):
    """Rank r's output and gradients (bias: the partial over its own rows) for loss = <y, dy> summed over ranks."""
    n = d["dy"].shape[-2]
    rows = slice(*block_range(n, W, r))
    full = sum(x @ w.t() for x, w in zip(d["xs"], d["ws"])) + d["b"]
    dy = d["dy"]
    return dict(y=full[..., rows, :], dx=dy @ d["ws"][r],
                dw=dy.reshape(-1, dy.shape[-1]).t() @ d["xs"][r].reshape(-1, d["xs"][r].shape[-1]),
                db=dy[..., rows, :].reshape(-1, dy.shape[-1]).sum(0))


def _ag_ref(d, r, W):
    X = torch.cat(d["xs"], dim=-2)
    n = X.shape[-2]
    rows = slice(*block_range(n, W, r))
    dx_full = sum(dy @ w for dy, w in zip(d["dys"], d["ws"]))
    dy = d["dys"][r]
    return dict(y=X @ d["ws"][r].t() + d["bs"][r], dx=dx_full[..., rows, :],
                dw=dy.reshape(-1, dy.shape[-1]).t() @ X.reshape(-1, X.shape[-1]),
                db=dy.reshape(-1, dy.shape[-1]).sum(0))


def _dy_of(op, d, r, W):
    if op == "rs":
        return d["dy"][..., slice(*block_range(d["dy"].shape[-2], W, r)), :]
    return d["dys"][r]


# ---------------------------------------------------------------- one case on one rank


@contextmanager
def _debug_mode():
    old = os.environ.get("DISTFUSE_DEBUG")
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DISTFUSE_DEBUG"]
        else:
            os.environ["DISTFUSE_DEBUG"] = old


def _poison(P):
    """NaN bytes over this rank's workspaces of ``P`` (0xFF.. is a NaN in fp32, fp16 and bf16)."""
    for (ranks, _), ws in symmetric._CACHE.items():
        if ranks == P.ranks and not ws.closed:
            ws.buffer.fill_(255)


def _unfused(op, P3, x, w, b, n, keep):
    """The unfused composition: F.linear and the primitives' functional forms, on [B_, rows, F] views."""
    lead = x.shape[:-2]
    B = math.prod(lead)
    if op == "rs":
        p = F.linear(x, w).reshape(B, n, w.shape[0])
        y = reduce_scatter(p, P3)
        y = y + b if b is not None else y
        return y.reshape(*lead, y.shape[-2], w.shape[0])
    g = all_gather(x.reshape(B, x.shape[-2], x.shape[-1]), P3, out_shape=(B, n, x.shape[-1]))
    return F.linear(g, w, b).reshape(*lead, n, w.shape[0])


def _case(P3, op, dtype, lead, n, K, N, seed, *, keep=True, device="cpu", bias_grad="partial", with_bias=True,
          x_grad=True):
    """Run one op fused and unfused on this rank; return {provider: {y, dx, dw, db}} (CPU tensors) and the epochs."""
    W, r = P3.size, P3.rank
    d = _rounded((_rs_data if op == "rs" else _ag_data)(seed, W, lead, n, K, N), dtype)
    if not with_bias:
        if op == "rs":
            d["b"] = torch.zeros_like(d["b"])
        else:
            d["bs"] = [torch.zeros_like(v) for v in d["bs"]]
    ref = (_rs_ref if op == "rs" else _ag_ref)(d, r, W)
    if not with_bias:
        ref["db"] = None
    if not x_grad:
        ref["dx"] = None
    if bias_grad == "sum":
        ref["db"] = d["dy"].reshape(-1, N).sum(0)
    out = {"ref": ref}
    B = math.prod(lead)
    nbytes = (matmul_reduce_scatter_workspace_bytes(B, n, N, W, dtype) if op == "rs" else
              all_gather_matmul_workspace_bytes(B, n, K, W, dtype))
    ws = symmetric.get_workspace(P3, nbytes, device) if W > 1 else None
    epoch0 = ws.epoch if ws is not None else 0
    for provider in ("fused", "unfused"):
        x = d["xs"][r].to(dtype).to(device).requires_grad_(x_grad)
        w = d["ws"][r].to(dtype).to(device).requires_grad_()
        b = (d["b"] if op == "rs" else d["bs"][r]).to(dtype).to(device).requires_grad_() if with_bias else None
        if provider == "fused":
            _poison(P3)
            with _debug_mode():
                if op == "rs":
                    y = matmul_reduce_scatter(x, w, b, P3, bias_grad=bias_grad)
                else:
                    y = all_gather_matmul(x, w, b, P3, keep_gathered=keep, n=n if keep else None)
                _poison(P3)
                y.backward(_dy_of(op, d, r, W).to(dtype).to(device))
        else:
            y = _unfused(op, P3, x, w, b, n, keep)
            y.backward(_dy_of(op, d, r, W).to(dtype).to(device))
        out[provider] = dict(y=y.detach().cpu(), dx=x.grad.cpu() if x_grad else None, dw=w.grad.cpu(),
                             db=b.grad.cpu() if with_bias else None)
    out["epochs"] = (ws.epoch - epoch0) if ws is not None else 0
    return out


def _check(out, dtype, what):
    """Fused against float64 and against the unfused composition, every output and gradient."""
    for key in GRADS:
        got, ref, unf = out["fused"][key], out["ref"][key], out["unfused"][key]
        if ref is None:
            assert got is None and unf is None, (what, key)
            continue
        assert got.shape == ref.shape, (what, key, tuple(got.shape), tuple(ref.shape))
        assert not torch.isnan(got).any(), f"{what}: {key}: an element was never written (NaN)"
        torch.testing.assert_close(got.double(), ref, **tol(dtype), msg=lambda m, k=key: f"{what}: {k} vs fp64: {m}")
        torch.testing.assert_close(got.double(), unf.double(), **tol(dtype),
                                   msg=lambda m, k=key: f"{what}: {k} vs unfused: {m}")


# ---------------------------------------------------------------- across processes (/dev/shm)


def _grid(W, order=None):
    """[1, W, 1] over the world (partition dim 1 splits tensor dim 1: the sequence); ``order`` permutes the ranks."""
    P = Partition.world()
    if order is not None:
        P = P.create_partition_inclusive(order)
    return P.create_cartesian_topology_partition([1, W, 1])


CASES = dict(lead=(2,), n=7, K=8, N=12)


def _rank_parity(dtype_name, order):
    dtype = getattr(torch, dtype_name)
    P3 = _grid(Partition.world().size, order)
    results = {}
    for i, (op, keep) in enumerate((("rs", True), ("ag", True), ("ag", False))):
        results[f"{op}-keep{keep}"] = _case(P3, op, dtype, seed=100 + i, keep=keep, **CASES)
    names = symmetric._CACHE[(P3.ranks, "cpu")].segment_names
    close_all()
    return dict(results=results, rank=P3.rank, names=names)


@pytest.mark.parametrize("W,dtype,order", [
    pytest.param(2, "float32", None, id="W2-fp32"),
    pytest.param(2, "bfloat16", None, id="W2-bf16"),
    pytest.param(4, "float32", [3, 1, 2, 0], id="W4-fp32-permuted-ranks"),
    pytest.param(4, "bfloat16", None, id="W4-bf16"),
])
def test_fused_matches_unfused_and_float64(W, dtype, order):
    out = run_ranks(W, _rank_parity, dtype, order)
    for o in out:
        for name, res in o["results"].items():
            _check(res, getattr(torch, dtype), f"{name} partition rank {o['rank']}")
            assert res["epochs"] == 2, f"{name}: forward and backward each claim the workspace once (fused ran)"
    assert not [n for o in out for n in o["names"] if os.path.exists(os.path.join(symmetric.SHM_DIR, n))]


def _rank_variants():
    """Empty sequence blocks, no leading dims / two leading dims, no bias, frozen input, summed bias grads."""
    P3 = _grid(Partition.world().size)
    cases = {
        "rs-n3-empty-block-no-lead": _case(P3, "rs", torch.float32, (), 3, 8, 12, 200),
        "ag-n3-empty-block-lead2x1-regather": _case(P3, "ag", torch.float32, (2, 1), 3, 8, 12, 201, keep=False),
        "rs-no-bias-frozen-input": _case(P3, "rs", torch.float32, (2,), 7, 8, 12, 202, with_bias=False,
                                         x_grad=False),
        "ag-no-bias-frozen-input": _case(P3, "ag", torch.float32, (2,), 7, 8, 12, 203, with_bias=False,
                                         x_grad=False),
        "rs-bias-grad-sum": _case(P3, "rs", torch.float32, (2,), 7, 8, 12, 204, bias_grad="sum"),
    }
    close_all()
    return cases


def test_variants_on_four_ranks():
    out = run_ranks(4, _rank_variants)
    for r, cases in enumerate(out):
        for name, res in cases.items():
            if "bias-grad-sum" in name:
                # The unfused composition keeps the per-rank partial; the summed gradient is the reference's.
                res["unfused"]["db"] = res["ref"]["db"]
            _check(res, torch.float32, f"{name} rank {r}")


def _rank_world_one():
    P = Partition.world()
    close_all()
    P3 = P.create_cartesian_topology_partition([1, 1, 1])
    ok = fused_linear_available(P3, P.device, torch.bfloat16)
    res = {op: _case(P3, op, torch.float32, (2,), 5, 8, 12, 300 + i, keep=False) for i, op in enumerate(("rs", "ag"))}
    return dict(res=res, ok=ok, cached=len(symmetric._CACHE))


def test_world_size_one_is_a_local_linear_without_workspace():
    (o,) = run_ranks(1, _rank_world_one)
    assert o["ok"] == (True, "world size 1: a local GEMM, no communication")
    assert o["cached"] == 0, "world size 1 must not create a workspace"
    for op, res in o["res"].items():
        _check(res, torch.float32, f"W1-{op}")


def _rank_available_and_checks():
    P3 = _grid(Partition.world().size)
    symmetric_availability._AVAILABLE.clear()
    avail = [fused_linear_available(P3, torch.device("cpu"), dt) for dt in (torch.float32, torch.float64)]
    x, w = torch.randn(2, 7, 4), torch.randn(12, 4)
    errors = {}
    # Every rank makes the same bad call and raises its own local error: after at most one workspace claim that
    # carries its refusal (distfuse/fused/agreement.py), so no peer is left waiting.
    for name, call in {
        "rs-weight-mismatch": lambda: matmul_reduce_scatter(x, torch.randn(12, 5), None, P3),
        "rs-fp64": lambda: matmul_reduce_scatter(x.double(), w.double(), None, P3),
        "rs-bias-grad": lambda: matmul_reduce_scatter(x, w, None, P3, bias_grad="mean"),
        "rs-bias-shape": lambda: matmul_reduce_scatter(x, w, torch.randn(11), P3),
        "ag-wrong-block": lambda: all_gather_matmul(torch.randn(2, 2, 4), w, None, P3, n=7),
        "unavailable": lambda: matmul_reduce_scatter(x, w, None, P3),
    }.items():
        if name == "unavailable":  # as if the collective verdict had been "no" (e.g. no P2P between the GPUs)
            symmetric_availability._AVAILABLE[(P3.ranks, "cpu")] = (False, "pretend: no P2P access")
        try:
            call()
            errors[name] = None
        except (ShapeError, UnsupportedError, PartitionError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    symmetric_availability._AVAILABLE.clear()
    return dict(avail=avail, errors=errors, rank=P3.rank)


def test_availability_and_argument_checks():
    out = run_ranks(2, _rank_available_and_checks)
    for o in out:
        (ok32, why32), (ok64, why64) = o["avail"]
        assert ok32 and "/dev/shm" in why32
        assert not ok64 and "float64" in why64
        e = o["errors"]
        assert e["rs-weight-mismatch"].startswith("ShapeError") and "expected 4, got 5" in e["rs-weight-mismatch"]
        assert e["rs-fp64"].startswith("UnsupportedError")
        assert e["rs-bias-grad"].startswith("UnsupportedError") and "'mean'" in e["rs-bias-grad"]
        assert e["rs-bias-shape"].startswith("ShapeError")
        want_rows = block_extent(7, 2, o["rank"])
        assert e["ag-wrong-block"].startswith("ShapeError") and f"has {want_rows}" in e["ag-wrong-block"]
        assert e["unavailable"].startswith("UnsupportedError") and "pretend: no P2P access" in e["unavailable"]


# ---------------------------------------------------------------- a rank fails mid-op


def _raise(*args, **kwargs):
    raise RuntimeError("injected fault inside the fused op")


# Which kernel call fails on the faulty rank: always the consumer, after its producer ran.  The fused
# phases call the kernel modules qualified, so patching the module attribute reaches them.
_FAULT_AT = {("rs", "forward"): (reduce_scatter_kernels, "chunk_reduce"),
             ("rs", "backward"): (all_gather_kernels, "gathered_matmul"),
             ("ag", "forward"): (all_gather_kernels, "gathered_matmul"),
             ("ag", "backward"): (reduce_scatter_kernels, "chunk_reduce")}


def _rank_fault(op, phase, faulty):
    P3 = _grid(Partition.world().size)
    W, r = P3.size, P3.rank
    ws = symmetric.get_workspace(P3, 1 << 16, timeout=1.5)  # the ops reuse it (large enough): short waits
    d = (_rs_data if op == "rs" else _ag_data)(400, W, (1,), 5, 6, 6)
    x = d["xs"][r].float().requires_grad_()
    w = d["ws"][r].float().requires_grad_()
    module, target = _FAULT_AT[(op, phase)]
    real = getattr(module, target)
    try:
        if r == faulty and phase == "forward":
            setattr(module, target, _raise)
        y = matmul_reduce_scatter(x, w, None, P3) if op == "rs" else all_gather_matmul(x, w, None, P3, n=5)
        if r == faulty:
            setattr(module, target, _raise)
        y.backward(_dy_of(op, d, r, W).float())
        result = ("ok", "")
    except CollectiveTimeoutError as exc:
        result = ("timeout", str(exc))
    except RuntimeError as exc:
        result = ("raised", str(exc))
    finally:
        setattr(module, target, real)
    try:
        with ws.in_flight("after the fault"):
            pass
        reuse = "reused"
    except WorkspaceBrokenError:
        reuse = "broken"
    close_all()
    return dict(result=result, reuse=reuse, pid=os.getpid())


@pytest.mark.parametrize("op,phase", [pytest.param(o, p, id=f"{o}-{p}") for o, p in _FAULT_AT])
def test_rank_failing_mid_op_raises_everywhere_and_leaves_shm_clean(op, phase):
    W, faulty = 3, 1
    try:
        out = run_ranks(W, _rank_fault, op, phase, faulty)
    finally:
        shutdown_pools()  # a timed-out monitored barrier leaves the gloo world inconsistent
    for r, o in enumerate(out):
        kind, msg = o["result"]
        if r == faulty:
            assert kind == "raised" and "injected fault" in msg, msg
        else:
            assert kind == "timeout" and "did not complete within 1.5 s" in msg, msg
        assert o["reuse"] == "broken"
    # Segment names carry rank 0's pid; none may survive.
    assert glob.glob(os.path.join(symmetric.SHM_DIR, f"{symmetric.SHM_PREFIX}{out[0]['pid']}-*")) == []


# ---------------------------------------------------------------- loopback (one process)


def _loopback_case(op, W, lead, n, K, N, dtype, device, keep=True, seed=0):
    """Loopback fwd+bwd of all W virtual ranks against float64; the bias grad of RS is the full sum."""
    d = _rounded((_rs_data if op == "rs" else _ag_data)(seed, W, lead, n, K, N), dtype)
    B = math.prod(lead)
    xs = [x.to(dtype).to(device).requires_grad_() for x in d["xs"]]
    ws_ = [w.to(dtype).to(device).requires_grad_() for w in d["ws"]]
    nbytes = (matmul_reduce_scatter_workspace_bytes(B, n, N, W, dtype) if op == "rs" else
              all_gather_matmul_workspace_bytes(B, n, K, W, dtype))
    ws = LoopbackWorkspace(W, nbytes, device)
    ws.strict = True  # read the status words after every consumer (a device sync on CUDA)
    if op == "rs":
        b = d["b"].to(dtype).to(device).requires_grad_()
        ys = matmul_reduce_scatter_loopback(xs, ws_, b, ws)
    else:
        bs = [v.to(dtype).to(device).requires_grad_() for v in d["bs"]]
        ys = all_gather_matmul_loopback(xs, ws_, bs, ws, keep_gathered=keep)
    torch.autograd.backward(ys, [_dy_of(op, d, r, W).to(dtype).to(device) for r in range(W)])
    if op == "rs":
        bias_grads = [b.grad] * W
    else:
        bias_grads = [v.grad for v in bs]
    assert ws.epoch == 2
    for r in range(W):
        ref = (_rs_ref if op == "rs" else _ag_ref)(d, r, W)
        if op == "rs":
            ref["db"] = d["dy"].reshape(-1, N).sum(0)
        got = dict(y=ys[r], dx=xs[r].grad, dw=ws_[r].grad, db=bias_grads[r])
        for key in GRADS:
            assert not torch.isnan(got[key]).any(), (op, r, key)
            if device == "cpu":  # tiny shapes: element-wise
                torch.testing.assert_close(got[key].double().cpu(), ref[key], **tol(dtype),
                                           msg=lambda m, k=key, rr=r: f"{op} rank {rr} {k}: {m}")
            else:  # realistic sizes: in norm (see tolerances.REL_NORM)
                assert_rel_close(got[key], ref[key], dtype, f"{op} rank {r} {key}")


@pytest.mark.parametrize("op,keep", [pytest.param("rs", True, id="rs"), pytest.param("ag", True, id="ag-keep"),
                                     pytest.param("ag", False, id="ag-regather")])
def test_loopback_autograd_cpu(op, keep):
    _loopback_case(op, 3, (2,), 7, 8, 12, torch.float32, "cpu", keep=keep)


def test_loopback_respects_the_in_flight_rule_and_workspace_size():
    W = 2
    xs = [torch.randn(1, 4, 3) for _ in range(W)]
    wts = [torch.randn(5, 3) for _ in range(W)]
    ws = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(1, 4, 5, W, torch.float32))
    with ws.in_flight("another op"), pytest.raises(WorkspaceBusyError, match="in use by 'another op'"):
        matmul_reduce_scatter_loopback(xs, wts, None, ws)
    small = LoopbackWorkspace(W, 16)
    big = [torch.randn(4, 64, 3) for _ in range(W)]
    with pytest.raises(ShapeError, match="loopback workspace: expected at least"):
        matmul_reduce_scatter_loopback(big, [torch.randn(64, 3)] * W, None, small)
    with pytest.raises(ShapeError, match="balanced block 1"):
        all_gather_matmul_loopback([torch.randn(1, 2, 3), torch.randn(1, 1, 3), torch.randn(1, 2, 3)],
                                   [torch.randn(2, 3)] * 3, None, LoopbackWorkspace(3, 4096))


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("op,keep", [pytest.param("rs", True, id="rs"), pytest.param("ag", True, id="ag-keep"),
                                     pytest.param("ag", False, id="ag-regather")])
def test_loopback_autograd_cuda(op, keep, dtype):
    _loopback_case(op, 4, (2,), 1030, 1024, 768, dtype, "cuda", keep=keep)


def _world_one_cuda_main():
    """Run in a fresh process: a 1-rank gloo world on a CUDA device (a forked pool cannot use CUDA)."""
    import tempfile

    import torch.distributed as dist

    fd, path = tempfile.mkstemp(prefix="distfuse-w1-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        P3 = Partition.world(device=torch.device("cuda")).create_cartesian_topology_partition([1, 1, 1])
        assert fused_linear_available(P3, torch.device("cuda"))[0]
        for dtype in (torch.bfloat16, torch.float32):
            for i, op in enumerate(("rs", "ag")):
                res = _case(P3, op, dtype, (2,), 33, 64, 48, 500 + i, device="cuda")
                _check(res, dtype, f"W1-cuda-{op}-{dtype}")
        assert not symmetric._CACHE
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_world_size_one_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", "import tests.test_fused_linear as t; t._world_one_cuda_main()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _multigpu_rank(rank, W, init_file):
    from datetime import timedelta

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=W,
                            timeout=timedelta(seconds=120))
    try:
        P3 = _grid(W)
        ok, why = fused_linear_available(P3, P3.device)
        assert ok, why
        for dtype in (torch.bfloat16, torch.float32):
            for i, (op, keep) in enumerate((("rs", True), ("ag", True), ("ag", False))):
                res = _case(P3, op, dtype, (2,), 515, 256, 384, 600 + i, keep=keep, device=P3.device)
                _check(res, dtype, f"{W} GPUs {op} keep={keep} {dtype} rank {rank}")
                assert res["epochs"] == 2
        close_all()
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_fused_linear_multigpu(tmp_path):
    import torch.multiprocessing as mp

    W = min(torch.cuda.device_count(), 4)
    mp.start_processes(_multigpu_rank, args=(W, str(tmp_path / "pg-init")), nprocs=W, join=True,
                       start_method="spawn")
