"""The feature-direction GEMM fusions with autograd: GEMM + reduce-scatter and all-gather + GEMM along the features.

``matmul_reduce_scatter_features`` (DistDL's reduce-scatter linear: the output's last dim
scattered) and ``all_gather_features_matmul`` (DistDL's all-gather linear: the input's
last dim gathered) are each other's backward.  Across processes (CPU, ``/dev/shm``
workspaces, Triton interpreter) the fused forward and every gradient (x, weight, bias)
are checked against a float64 reference built with plain torch on the global tensors and
against the unfused composition (``F.linear`` + the ReduceScatter / AllGather
primitives).  The ranks run with ``DISTFUSE_DEBUG=1`` (kernel outputs start as NaN) and
the workspace is filled with NaN bytes before the forward and before the backward.
Features are uneven over the ranks (7 and 10 over 3 or 4), some blocks are empty, and
ranks are listed out of order.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from distfuse import Partition
from distfuse.errors import PartitionError, ShapeError, UnsupportedError
from distfuse.fused import symmetric
from distfuse.fused.all_gather_features_matmul import (
    all_gather_features_matmul,
    all_gather_features_matmul_loopback,
    all_gather_features_matmul_workspace_bytes,
)
from distfuse.fused.matmul_reduce_scatter_features import (
    matmul_reduce_scatter_features,
    matmul_reduce_scatter_features_loopback,
    matmul_reduce_scatter_features_workspace_bytes,
)
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.primitives.all_gather import all_gather
from distfuse.primitives.reduce_scatter import reduce_scatter
from distfuse.testing import run_ranks
from tests.test_fused_linear import _debug_mode, _poison
from tests.tolerances import tol

F64 = torch.float64
GRADS = ("y", "dx", "dw", "db")


def _data(seed, lead, K, N):
    """Global float64 operands: x [*lead, K], W [N, K], b [N], dy [*lead, N] (fresh random, never zeros)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*lead, K, generator=g, dtype=F64), w=torch.randn(N, K, generator=g, dtype=F64) / 3,
                b=torch.randn(N, generator=g, dtype=F64), dy=torch.randn(*lead, N, generator=g, dtype=F64))


def _reference(d, op, r, W):
    """Rank r's output and gradients, from torch on the global tensors: y = x @ W.T + b, loss = <y, dy>."""
    x, w, b, dy = (d[k].clone().requires_grad_() for k in ("x", "w", "b", "dy"))
    F.linear(x, w, b).backward(dy.detach())
    K, N = w.shape[1], w.shape[0]
    kr, nr = slice(*block_range(K, W, r)), slice(*block_range(N, W, r))
    if op == "rs":  # x split along K, output (and bias) along N; the weight's columns
        return dict(y=(d["x"] @ d["w"].t() + d["b"])[..., nr], dx=x.grad[..., kr], dw=w.grad[:, kr], db=b.grad[nr])
    # ag: x split along K, the weight's rows and the output along N
    return dict(y=(d["x"] @ d["w"].t() + d["b"])[..., nr], dx=x.grad[..., kr], dw=w.grad[nr], db=b.grad[nr])


def _operands(d, op, r, W, dtype, with_bias):
    K, N = d["w"].shape[1], d["w"].shape[0]
    kr, nr = slice(*block_range(K, W, r)), slice(*block_range(N, W, r))
    x = d["x"][..., kr].to(dtype).requires_grad_()
    w = (d["w"][:, kr] if op == "rs" else d["w"][nr]).to(dtype).requires_grad_()
    b = d["b"][nr].to(dtype).requires_grad_() if with_bias else None
    return x, w, b, d["dy"][..., nr].to(dtype)


def _unfused(op, P, x, w, b, K):
    """The unfused composition on a [1, 1, W] partition: F.linear and the primitives along the last dim."""
    if op == "rs":
        y = reduce_scatter(F.linear(x, w), P)
        return y + b if b is not None else y
    return F.linear(all_gather(x, P, (*x.shape[:-1], K)), w, b)


def _case(P, op, dtype, lead, K, N, seed, *, keep=True, with_bias=True):
    """One op fused and unfused on this rank: {provider: {y, dx, dw, db}}, the reference, and the epochs.

    ``lead`` has 2 dims: the unfused primitives take one tensor dim per partition dim."""
    W, r = P.size, P.rank
    d = {k: v.to(dtype).double() for k, v in _data(seed, lead, K, N).items()}  # what the op sees, in float64
    out = {"ref": _reference(d, op, r, W)}
    if not with_bias:
        out["ref"]["db"] = None
        out["ref"]["y"] = out["ref"]["y"] - d["b"][slice(*block_range(N, W, r))]
    rows = math.prod(lead)
    nbytes = (matmul_reduce_scatter_features_workspace_bytes(rows, N, W, dtype) if op == "rs" else
              all_gather_features_matmul_workspace_bytes(rows, K, W, dtype))
    ws = symmetric.get_workspace(P, nbytes) if W > 1 else None
    epoch0 = ws.epoch if ws is not None else 0
    for provider in ("fused", "unfused"):
        x, w, b, dy = _operands(d, op, r, W, dtype, with_bias)
        if provider == "fused":
            _poison(P)
            with _debug_mode():
                y = (matmul_reduce_scatter_features(x, w, b, P) if op == "rs" else
                     all_gather_features_matmul(x, w, b, P, keep_gathered=keep))
                _poison(P)
                y.backward(dy)
        else:
            y = _unfused(op, P, x, w, b, K)
            y.backward(dy)
        out[provider] = dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad if with_bias else None)
    out["epochs"] = (ws.epoch - epoch0) if ws is not None else 0
    return out


def _check(out, dtype, what):
    t = tol(dtype)
    for key in GRADS:
        got, ref, unf = out["fused"][key], out["ref"][key], out["unfused"][key]
        if ref is None:
            assert got is None and unf is None, (what, key)
            continue
        assert got.shape == ref.shape, (what, key, tuple(got.shape), tuple(ref.shape))
        assert not torch.isnan(got).any(), f"{what}: {key}: an element was never written (NaN)"
        # the absolute floor on the scale of the terms: 1 (unit-variance data), or the tensor's typical magnitude
        # where its sums make it larger (tests/tolerances.py), never its largest element
        typical = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
        scale = dict(rtol=t["rtol"], atol=t["atol"] * max(1.0, typical))
        torch.testing.assert_close(got.double(), ref, **scale, msg=lambda m, k=key: f"{what}: {k} vs fp64: {m}")
        torch.testing.assert_close(got.double(), unf.double(), **scale,
                                   msg=lambda m, k=key: f"{what}: {k} vs unfused: {m}")


def _features_grid(order):
    P = Partition.world()
    if order is not None:
        P = P.create_partition_inclusive(order)
    return P.create_cartesian_topology_partition([1, 1, P.size])


# ---------------------------------------------------------------- across processes (/dev/shm)


def _rank_parity(dtype_name, order):
    dtype = getattr(torch, dtype_name)
    P = _features_grid(order)
    res = {"rs": _case(P, "rs", dtype, (2, 3), 7, 10, 11),
           "ag-keep": _case(P, "ag", dtype, (2, 3), 7, 10, 12),
           "ag-regather": _case(P, "ag", dtype, (1, 5), 10, 7, 13, keep=False)}
    close_all()
    return dict(res=res, rank=P.rank)


@pytest.mark.parametrize("W,dtype,order", [
    pytest.param(2, "bfloat16", None, id="W2-bf16"),
    pytest.param(3, "float16", [2, 0, 1], id="W3-fp16-permuted"),
    pytest.param(4, "float32", [3, 1, 2, 0], id="W4-fp32-permuted"),
])
def test_fused_feature_ops_match_float64_and_unfused(W, dtype, order):
    for o in run_ranks(W, _rank_parity, dtype, order):
        for name, res in o["res"].items():
            _check(res, getattr(torch, dtype), f"{name} partition rank {o['rank']}")
            assert res["epochs"] == 2, f"{name}: forward and backward each claim the workspace once (fused ran)"


def _rank_edges():
    """Fewer features than ranks (empty blocks and chunks), no bias, no leading dims beyond the rows."""
    P = _features_grid(None)
    res = {"rs-N2-K3-empty-chunks": _case(P, "rs", torch.float32, (1, 3), 3, 2, 21),
           "ag-K2-empty-shard": _case(P, "ag", torch.float32, (3, 1), 2, 9, 22),
           "rs-no-bias": _case(P, "rs", torch.float32, (2, 2), 6, 5, 23, with_bias=False),
           "ag-no-bias-regather": _case(P, "ag", torch.float32, (1, 4), 5, 6, 24, keep=False, with_bias=False)}
    close_all()
    return res


def test_empty_blocks_and_no_bias_on_four_ranks():
    for r, res in enumerate(run_ranks(4, _rank_edges)):
        for name, out in res.items():
            _check(out, torch.float32, f"{name} rank {r}")


def _rank_deterministic():
    """The all-gather GEMM sums its K chunks in a fixed order: repeated forwards are bit-identical, and within fp32
    rounding of the float64 product of the gathered input."""
    P = _features_grid(None)
    W, r = P.size, P.rank
    K = 13
    d = _data(31, (6,), K, 5)
    kr = slice(*block_range(K, W, r))
    x = d["x"][..., kr].float()
    w = d["w"].float()
    ys = [all_gather_features_matmul(x, w, None, P) for _ in range(3)]
    ref = d["x"].float().double() @ w.double().t()  # what the op sees, in float64
    close_all()
    return dict(same=all(torch.equal(ys[0], y) for y in ys[1:]), y=ys[0], ref=ref, K=K)


def _typical(t: torch.Tensor) -> float:
    """The root mean square of a float64 reference: the size of its partial sums (random-sign terms)."""
    return float(t.double().pow(2).mean().sqrt())


def test_all_gather_accumulates_in_a_fixed_order():
    for o in run_ranks(3, _rank_deterministic):
        assert o["same"], "repeated forwards differ: the K chunks must be summed in a fixed order"
        assert not torch.isnan(o["y"]).any()
        torch.testing.assert_close(o["y"].double(), o["ref"], **tol(torch.float32, terms=o["K"],
                                                                    scale=_typical(o["ref"])))


def _rank_world_one():
    P = Partition.world().create_cartesian_topology_partition([1, 1, 1])
    close_all()
    res = {op: _case(P, op, torch.float32, (1, 2), 5, 4, 40 + i) for i, op in enumerate(("rs", "ag"))}
    return dict(res=res, cached=len(symmetric._CACHE))


def test_world_size_one_is_a_local_linear_without_workspace():
    (o,) = run_ranks(1, _rank_world_one)
    assert o["cached"] == 0
    for op, res in o["res"].items():
        _check(res, torch.float32, f"W1-{op}")


def _rank_errors():
    P = _features_grid(None)
    r = P.rank
    x, w = torch.randn(2, 3, block_extent(7, 2, r)), torch.randn(5, block_extent(7, 2, r))
    errors = {}
    for name, call in {
        "rs-fp64": lambda: matmul_reduce_scatter_features(x.double(), w.double(), None, P),
        "rs-bias-full-width": lambda: matmul_reduce_scatter_features(x, w, torch.randn(5), P),
        "rs-weight-mismatch": lambda: matmul_reduce_scatter_features(x, torch.randn(5, 9), None, P),
        "ag-wrong-block": lambda: all_gather_features_matmul(torch.randn(2, 3, 1), torch.randn(5, 7), None, P),
        "ag-1d-input": lambda: all_gather_features_matmul(torch.randn(4), torch.randn(5, 7), None, P),
    }.items():
        try:
            call()
            errors[name] = None
        except (ShapeError, UnsupportedError, PartitionError) as exc:
            errors[name] = type(exc).__name__ + ": " + str(exc)
    close_all()
    return errors


def test_bad_arguments_raise_the_same_error_on_every_rank():
    for e in run_ranks(2, _rank_errors):
        assert e["rs-fp64"].startswith("UnsupportedError")
        assert e["rs-bias-full-width"].startswith("ShapeError") and "block" in e["rs-bias-full-width"]
        assert e["rs-weight-mismatch"].startswith("ShapeError")
        assert e["ag-wrong-block"].startswith("ShapeError") and "balanced block" in e["ag-wrong-block"]
        assert e["ag-1d-input"].startswith("ShapeError")


# ---------------------------------------------------------------- loopback (one process)


@pytest.mark.parametrize("op", ["rs", "ag"])
def test_loopback_autograd(op):
    W, lead, K, N, dtype = 3, (2, 2), 8, 7, torch.float32
    d = _data(50, lead, K, N)
    xs, wts, bs, dys = zip(*(_operands(d, op, r, W, dtype, True) for r in range(W)), strict=True)
    rows = math.prod(lead)
    if op == "rs":
        ws = LoopbackWorkspace(W, matmul_reduce_scatter_features_workspace_bytes(rows, N, W, dtype))
        ys = matmul_reduce_scatter_features_loopback(list(xs), list(wts), list(bs), ws)
    else:
        ws = LoopbackWorkspace(W, all_gather_features_matmul_workspace_bytes(rows, K, W, dtype))
        ys = all_gather_features_matmul_loopback(list(xs), list(wts), list(bs), ws)
    torch.autograd.backward(ys, list(dys))
    assert ws.epoch == 2
    for r in range(W):
        ref = _reference(d, op, r, W)
        got = dict(y=ys[r], dx=xs[r].grad, dw=wts[r].grad, db=bs[r].grad)
        for key in GRADS:
            torch.testing.assert_close(got[key].double(), ref[key], **tol(dtype), msg=lambda m, k=key: f"{k}: {m}")


def test_loopback_checks_blocks():
    with pytest.raises(ShapeError, match="balanced block 1"):
        all_gather_features_matmul_loopback([torch.randn(2, 2), torch.randn(2, 1), torch.randn(2, 2)],
                                            [torch.randn(3, 5)] * 3, None, LoopbackWorkspace(3, 4096))
    with pytest.raises(ShapeError, match="block 0 of 5 features"):
        matmul_reduce_scatter_features_loopback([torch.randn(2, 2)] * 2, [torch.randn(5, 2)] * 2,
                                                [torch.randn(5)] * 2, LoopbackWorkspace(2, 4096))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("op", ["rs", "ag"])
def test_loopback_autograd_cuda(op, dtype):
    """Realistic sizes on one GPU (loopback): forward and every gradient in norm against float64."""
    from tests.tolerances import assert_rel_close

    W, lead, K, N = 4, (2, 515), 1030, 771
    d = _data(60, lead, K, N)
    xs, wts, bs, dys = zip(*(_operands(d, op, r, W, dtype, True) for r in range(W)), strict=True)
    cuda = [t.detach().cuda().requires_grad_() for t in xs + wts + bs]
    xs, wts, bs = cuda[:W], cuda[W:2 * W], cuda[2 * W:]
    rows = math.prod(lead)
    if op == "rs":
        ws = LoopbackWorkspace(W, matmul_reduce_scatter_features_workspace_bytes(rows, N, W, dtype), "cuda")
    else:
        ws = LoopbackWorkspace(W, all_gather_features_matmul_workspace_bytes(rows, K, W, dtype), "cuda")
    ws.strict = True  # read the status words after every consumer (a device sync)
    if op == "rs":
        ys = matmul_reduce_scatter_features_loopback(xs, wts, bs, ws)
    else:
        ys = all_gather_features_matmul_loopback(xs, wts, bs, ws)
    torch.autograd.backward(ys, [dy.cuda() for dy in dys])
    for r in range(W):
        ref = _reference(d, op, r, W)
        for key, got in dict(y=ys[r], dx=xs[r].grad, dw=wts[r].grad, db=bs[r].grad).items():
            assert_rel_close(got, ref[key], dtype, f"{op} rank {r} {key}")



# ---------------------------------------------------------------- the tuner's cases (plumbing, interpreted)


def _rank_tune_cases():
    """Both paths of each op's tuner case do the same work, through the registry's factories: each output against
    the float64 product of every rank's operands (the fused op's arguments, seen on their way in)."""
    import distfuse.fused.all_gather_features_matmul as ag_module
    import distfuse.fused.matmul_reduce_scatter_features as rs_module
    from distfuse.fused import registry
    from distfuse.tune.cases import CaseContext

    W = torch.distributed.get_world_size()
    r = torch.distributed.get_rank()  # the case's [1, 1, W] group lists the world in order: its rank is this one
    P_sub = Partition.world().create_cartesian_topology_partition([1, W, 1])
    ctx = CaseContext(torch.float32, torch.device("cpu"), W, range(W), P_sub, full=True, fused_ok=True)
    seen = {}

    def spying(module, name):
        real = getattr(module, name)

        def spy(x, w, *args, **kwargs):
            seen[name] = (x.detach().double(), w.detach().double())
            return real(x, w, *args, **kwargs)
        return real, spy

    out = {}
    for spec, module in ((registry.MATMUL_REDUCE_SCATTER_FEATURES, rs_module),
                         (registry.ALL_GATHER_FEATURES_MATMUL, ag_module)):
        shape = registry.resolve(spec.grid)(spec.name, W, quick=True)[0]
        k = shape["k"] + 1  # uneven blocks
        real, spy = spying(module, spec.name)
        setattr(module, spec.name, spy)
        try:
            case = registry.resolve(spec.case)(spec.name, dict(shape, k=k), ctx)
            fused, unfused = case.fused(0).detach(), case.unfused(0).detach()
        finally:
            setattr(module, spec.name, real)
        operands = [None] * W
        torch.distributed.all_gather_object(operands, seen.pop(spec.name))
        xs, ws = zip(*operands, strict=True)
        assert [x.shape[-1] for x in xs] == [block_extent(k, W, p) for p in range(W)], [x.shape for x in xs]
        if spec is registry.ALL_GATHER_FEATURES_MATMUL:  # this rank's whole weight times the gathered input
            ref = torch.cat(xs, dim=-1) @ ws[r].t()
        else:  # every rank's partial product summed, this rank's block of the output features
            ref = sum(x @ w.t() for x, w in zip(xs, ws, strict=True))
            ref = ref[..., slice(*block_range(ref.shape[-1], W, r))]
        out[spec.name] = dict(fused=fused, unfused=unfused, ref=ref, terms=k)
    close_all()
    return out


def test_tuner_cases_time_equal_work():
    for res in run_ranks(2, _rank_tune_cases):
        assert set(res) == {"matmul_reduce_scatter_features", "all_gather_features_matmul"}
        for name, o in res.items():  # sums of k terms (the gathered or the reduced features)
            bound = tol(torch.float32, terms=o["terms"], scale=_typical(o["ref"]))
            for path in ("fused", "unfused"):
                assert not torch.isnan(o[path]).any(), (name, path)
                torch.testing.assert_close(o[path].double(), o["ref"], **bound, msg=lambda m, n=name, p=path:
                                           f"{n} {p} vs float64: {m}")
