"""GEMM + all-reduce over symmetric buffers, one-shot and two-shot, with autograd.

Across processes (CPU, ``/dev/shm`` workspaces, Triton interpreter): the fused forward and
every gradient against a float64 reference built with plain torch on the global tensors,
and against the unfused composition (``F.linear`` + the AllSumReduce primitive).  The
ranks run with ``DISTFUSE_DEBUG=1`` (kernel outputs start as NaN) and the workspace is
filled with NaN bytes before the op.  Every rank's copy of the output must be
bit-identical.  Input features and outputs are uneven over the ranks (some blocks and
column chunks empty), ranks are listed out of order, and the bias is added by one rank.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from distfuse import Partition
from distfuse.errors import ShapeError, UnsupportedError
from distfuse.fused import symmetric
from distfuse.fused.matmul_all_reduce import (
    matmul_all_reduce,
    matmul_all_reduce_loopback,
    matmul_all_reduce_workspace_bytes,
    pick_algorithm,
)
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_range
from distfuse.primitives.all_sum_reduce import all_sum_reduce
from distfuse.testing import run_ranks
from tests.test_fused_linear import _debug_mode, _poison
from tests.tolerances import tol

F64 = torch.float64
GRADS = ("y", "dx", "dw", "db")


def _data(seed, W, lead, K, N):
    """Global x [*lead, K], W [N, K], b [N] and one dy [*lead, N] per rank (fresh random)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*lead, K, generator=g, dtype=F64), w=torch.randn(N, K, generator=g, dtype=F64) / 3,
                b=torch.randn(N, generator=g, dtype=F64),
                dys=[torch.randn(*lead, N, generator=g, dtype=F64) for _ in range(W)])


def _reference(d, r, W, grad_output):
    """Rank r's output and gradients from torch on the global tensors.  ``sum``: the loss is the sum over ranks of
    <y, dy_r> (the gradient of y is the sum of the dy's); ``replicated``: every rank's dy is the full gradient."""
    x, w, b = (d[k].clone().requires_grad_() for k in ("x", "w", "b"))
    g = sum(d["dys"]) if grad_output == "sum" else d["dys"][r]
    y = F.linear(x, w, b)
    y.backward(g)
    kr = slice(*block_range(w.shape[1], W, r))
    return dict(y=y.detach(), dx=x.grad[..., kr], dw=w.grad[:, kr], db=b.grad if r == 0 else None)


def _case(P, dtype, lead, K, N, seed, algorithm, grad_output="sum"):
    W, r = P.size, P.rank
    d = {k: ([t.to(dtype).double() for t in v] if isinstance(v, list) else v.to(dtype).double())
         for k, v in _data(seed, W, lead, K, N).items()}
    if grad_output == "replicated":
        d["dys"] = [d["dys"][0]] * W
    kr = slice(*block_range(K, W, r))
    out = {"ref": _reference(d, r, W, grad_output)}
    rows = math.prod(lead)
    ws = symmetric.get_workspace(P, matmul_all_reduce_workspace_bytes(rows, N, W, dtype, algorithm)) if W > 1 else None
    epoch0 = ws.epoch if ws is not None else 0
    for provider in ("fused", "unfused"):
        x = d["x"][..., kr].to(dtype).requires_grad_()
        w = d["w"][:, kr].to(dtype).requires_grad_()
        b = d["b"].to(dtype).requires_grad_() if r == 0 else None
        dy = d["dys"][r].to(dtype)
        if provider == "fused":
            _poison(P)
            with _debug_mode():
                y = matmul_all_reduce(x, w, b, P, algorithm=algorithm, grad_output=grad_output)
                dy_before = dy.clone()
                y.backward(dy)
                out["dy_untouched"] = torch.equal(dy, dy_before)  # the backward's all-reduce works on a copy
        else:
            y = all_sum_reduce(F.linear(x, w, b), P)
            y.backward(dy if grad_output == "sum" else dy / W)  # the primitive's adjoint sums the W replicas
        out[provider] = dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad if b is not None else None)
    out["epochs"] = (ws.epoch - epoch0) if ws is not None else 0
    return out


def _check(out, dtype, what):
    t = tol(dtype)
    for key in GRADS:
        got, ref, unf = out["fused"][key], out["ref"][key], out["unfused"][key]
        if ref is None:
            assert got is None and unf is None, (what, key)
            continue
        assert got.shape == ref.shape and not torch.isnan(got).any(), (what, key, tuple(got.shape))
        scale = dict(rtol=t["rtol"], atol=t["atol"] * max([1.0, *ref.abs().flatten().tolist()]))
        torch.testing.assert_close(got.double(), ref, **scale, msg=lambda m, k=key: f"{what}: {k} vs fp64: {m}")
        # 16-bit: the unfused AllSumReduce adds in the dtype, the fused op in fp32: compare at twice the tolerance
        torch.testing.assert_close(got.double(), unf.double(), rtol=2 * scale["rtol"], atol=2 * scale["atol"],
                                   msg=lambda m, k=key: f"{what}: {k} vs unfused: {m}")


def _grid(order):
    P = Partition.world()
    if order is not None:
        P = P.create_partition_inclusive(order)
    return P.create_cartesian_topology_partition([1, 1, P.size])


def _rank_parity(dtype_name, order):
    dtype = getattr(torch, dtype_name)
    P = _grid(order)
    res = {"one-shot": _case(P, dtype, (2, 3), 7, 10, 71, "one_shot"),
           "two-shot": _case(P, dtype, (2, 3), 7, 10, 72, "two_shot"),
           "two-shot-N-lt-W": _case(P, dtype, (1, 3), 5, 2, 73, "two_shot"),
           "one-shot-replicated": _case(P, dtype, (1, 4), 6, 5, 74, "one_shot", grad_output="replicated")}
    close_all()
    return dict(res=res, rank=P.rank, ys={k: v["fused"]["y"] for k, v in res.items()})


@pytest.mark.parametrize("W,dtype,order", [
    pytest.param(2, "bfloat16", None, id="W2-bf16"),
    pytest.param(3, "float16", [1, 2, 0], id="W3-fp16-permuted"),
    pytest.param(4, "float32", [2, 0, 3, 1], id="W4-fp32-permuted"),
])
def test_one_and_two_shot_match_float64_and_unfused(W, dtype, order):
    out = run_ranks(W, _rank_parity, dtype, order)
    for o in out:
        for name, res in o["res"].items():
            _check(res, getattr(torch, dtype), f"{name} partition rank {o['rank']}")
            # Forward: one claim (one-shot) or two (two-shot); the "sum" backward's all-gather + dgrad, one more.
            want = (2 if name.startswith("two-shot") else 1) + (0 if name.endswith("replicated") else 1)
            assert res["epochs"] == want, (name, res["epochs"])
            assert res["dy_untouched"], f"{name}: the backward changed the caller's gradient"
    for name in out[0]["ys"]:  # every rank's copy of the output is the same, bit for bit
        assert all(torch.equal(o["ys"][name], out[0]["ys"][name]) for o in out), name


def _rank_errors():
    P = _grid(None)
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    errors = {}
    for name, call in {
        "fp64": lambda: matmul_all_reduce(x.double(), w.double(), None, P),
        "grad-output": lambda: matmul_all_reduce(x, w, None, P, grad_output="mean"),
        "algorithm": lambda: matmul_all_reduce(x, w, None, P, algorithm="three_shot"),
        "bias-shape": lambda: matmul_all_reduce(x, w, torch.randn(4), P),
    }.items():
        try:
            call()
            errors[name] = None
        except (ShapeError, UnsupportedError) as exc:
            errors[name] = type(exc).__name__ + ": " + str(exc)
    close_all()
    return errors


def test_bad_arguments_raise_the_same_error_on_every_rank():
    for e in run_ranks(2, _rank_errors):
        assert e["fp64"].startswith("UnsupportedError")
        assert e["grad-output"].startswith("UnsupportedError") and "'mean'" in e["grad-output"]
        assert e["algorithm"].startswith("UnsupportedError") and "'three_shot'" in e["algorithm"]
        assert e["bias-shape"].startswith("ShapeError")


def test_auto_picks_one_shot_for_small_outputs():
    assert pick_algorithm(4, 64, torch.bfloat16) == "one_shot"
    assert pick_algorithm(4096, 4096, torch.bfloat16) == "two_shot"
    assert pick_algorithm(4096, 4096, torch.bfloat16, "one_shot") == "one_shot"


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_loopback_autograd(algorithm):
    W, lead, K, N, dtype = 3, (2, 2), 8, 7, torch.float32
    d = _data(80, W, lead, K, N)
    xs = [d["x"][..., slice(*block_range(K, W, r))].float().requires_grad_() for r in range(W)]
    wts = [d["w"][:, slice(*block_range(K, W, r))].float().requires_grad_() for r in range(W)]
    b = d["b"].float().requires_grad_()
    ws = LoopbackWorkspace(W, matmul_all_reduce_workspace_bytes(math.prod(lead), N, W, dtype, algorithm))
    ys = matmul_all_reduce_loopback(xs, wts, b, ws, algorithm=algorithm)
    torch.autograd.backward(ys, [dy.float() for dy in d["dys"]])
    for r in range(W):
        ref = _reference(d, r, W, "sum")
        got = dict(y=ys[r], dx=xs[r].grad, dw=wts[r].grad, db=b.grad if r == 0 else None)
        for key in GRADS:
            if ref[key] is not None:
                torch.testing.assert_close(got[key].double(), ref[key], **tol(dtype), msg=lambda m, k=key: f"{k}: {m}")


def _rank_tune_case():
    from distfuse.fused import registry
    from distfuse.tune.cases import CaseContext

    W = torch.distributed.get_world_size()
    P_sub = Partition.world().create_cartesian_topology_partition([1, W, 1])
    ctx = CaseContext(torch.float32, torch.device("cpu"), W, range(W), P_sub, full=True, fused_ok=True)
    spec = registry.MATMUL_ALL_REDUCE
    shape = registry.resolve(spec.grid)(spec.name, W, quick=True)[0]
    k = shape["k"] + 1  # uneven over the workers
    case = registry.resolve(spec.case)(spec.name, dict(shape, k=k), ctx)
    with _debug_mode():  # the kernels' outputs start as NaN: an element never written fails the comparison
        fused = case.fused(0).detach()
    unfused = case.unfused(0).detach()
    close_all()
    return fused, unfused, k


def test_tuner_case_times_equal_work():
    """The tuner's fused and unfused cases compute the same fp32 output from the same data.  Each output sums k
    products; the case scales worker r's weight block by 1/sqrt(k_r), so its k_r unit-variance x times weight
    products have variance 1/k_r and the sum over the W workers variance W: the partial sums, and the absolute
    floor, are about sqrt(W).  Both sides are rounded: twice the bound."""
    W = 2
    for rank, (fused, unfused, k) in enumerate(run_ranks(W, _rank_tune_case)):
        assert fused.shape == unfused.shape and fused.numel() > 0, (rank, fused.shape, unfused.shape)
        t = tol(torch.float32, terms=k, scale=math.sqrt(W))
        torch.testing.assert_close(fused, unfused, rtol=2 * t["rtol"], atol=2 * t["atol"],
                                   msg=lambda m, r=rank: f"rank {r}, fused against unfused: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_loopback_autograd_cuda(algorithm, dtype):
    """Realistic sizes on one GPU (loopback): forward and every gradient in norm against float64."""
    from tests.tolerances import assert_rel_close

    W, lead, K, N = 4, (2, 515), 1030, 771
    d = _data(90, W, lead, K, N)
    xs = [d["x"][..., slice(*block_range(K, W, r))].to(dtype).cuda().requires_grad_() for r in range(W)]
    wts = [d["w"][:, slice(*block_range(K, W, r))].to(dtype).cuda().requires_grad_() for r in range(W)]
    b = d["b"].to(dtype).cuda().requires_grad_()
    ws = LoopbackWorkspace(W, matmul_all_reduce_workspace_bytes(math.prod(lead), N, W, dtype, algorithm), "cuda")
    ws.strict = True
    ys = matmul_all_reduce_loopback(xs, wts, b, ws, algorithm=algorithm)
    torch.autograd.backward(ys, [dy.to(dtype).cuda() for dy in d["dys"]])
    for r in range(W):
        ref = _reference(d, r, W, "sum")
        got = dict(y=ys[r], dx=xs[r].grad, dw=wts[r].grad, db=b.grad if r == 0 else None)
        for key in GRADS:
            if ref[key] is not None:
                assert_rel_close(got[key], ref[key], dtype, f"{algorithm} rank {r} {key}")
