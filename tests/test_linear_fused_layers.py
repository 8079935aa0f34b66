"""The sequence-parallel linear layers on their fused path equal the unfused composition and torch.nn.

``DISTFUSE_PATH=fused`` forces the fused GEMM+reduce-scatter / all-gather+GEMM ops (the
Triton kernels run interpreted over ``/dev/shm`` symmetric workspaces on CPU); the same
model then runs unfused on the same inputs, and both are compared with a float64
sequential MLP on the gathered tensors: output, input gradient and every parameter
gradient.  ``last_path`` proves which path ran.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from distfuse import Partition
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import DistributedLinearAllGather, DistributedLinearReduceScatter, collect_sequential
from distfuse.testing import run_ranks
from tests.tolerances import tol

H, HIDDEN = 8, 12


def _mlp(P_d, P_m, n, dtype, path, keep):
    world = P_d * P_m
    P = Partition.world().create_partition_inclusive(range(world))
    P_feat = P.create_cartesian_topology_partition([P_d, 1, P_m])
    P_seq = P.create_cartesian_topology_partition([P_d, P_m, 1])
    torch.manual_seed(3)
    ag = DistributedLinearAllGather(P_feat, H, HIDDEN, P_x=P_seq, dtype=dtype, keep_gathered=keep)
    rs = DistributedLinearReduceScatter(P_feat, HIDDEN, H, P_y=P_seq, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    xg = torch.randn(2 * P_d, n, H, generator=gen, dtype=torch.float64)
    dyg = torch.randn(2 * P_d, n, H, generator=gen, dtype=torch.float64)
    sl = local_slices(xg.shape, P_seq.shape, P_seq.index)
    x = xg[sl].to(dtype).requires_grad_(True)
    os.environ["DISTFUSE_PATH"] = path
    try:
        y = rs(F.gelu(ag(x)))
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
    y.backward(dyg[sl].to(dtype))
    grads = {f"{name}.{k}": getattr(layer, k).grad for name, layer in (("ag", ag), ("rs", rs))
             for k in ("weight", "bias") if getattr(layer, k) is not None}
    # the sequential reference, from the distributed layers' own weights
    seq = {f"ag.{k}": v for k, v in (collect_sequential(ag) or {}).items()}
    seq.update({f"rs.{k}": v for k, v in (collect_sequential(rs) or {}).items()})
    return dict(paths=(ag.last_path, rs.last_path), y=y.detach(), dx=x.grad, grads=grads, seq=seq,
                xg=xg, dyg=dyg, sl=sl)


def _reference(seq, xg, dyg):
    params = {k: v.double().requires_grad_(True) for k, v in seq.items()}
    x = xg.clone().requires_grad_(True)
    y = F.linear(F.gelu(F.linear(x, params["ag.weight"], params["ag.bias"])), params["rs.weight"], params["rs.bias"])
    y.backward(dyg)
    return y.detach(), x.grad, {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("keep", [True, False], ids=["keep-gathered", "regather"])
@pytest.mark.parametrize(
    "P_d,P_m,n,dtype",
    [(1, 2, 7, torch.float32), (2, 2, 5, torch.float32), (1, 3, 4, torch.bfloat16)],
    ids=["1x2-n7-uneven-fp32", "2x2-n5-dp-fp32", "1x3-n4-bf16"],
)
def test_fused_layers_match_unfused_and_sequential(P_d, P_m, n, dtype, keep):
    world = P_d * P_m
    fused = run_ranks(world, _mlp, P_d, P_m, n, dtype, "fused", keep)
    unfused = run_ranks(world, _mlp, P_d, P_m, n, dtype, "unfused", keep)
    assert all(r["paths"] == ("fused", "fused") for r in fused)
    assert all(r["paths"] == ("unfused", "unfused") for r in unfused)
    y_ref, dx_ref, g_ref = _reference(fused[0]["seq"], fused[0]["xg"], fused[0]["dyg"])
    t = tol(dtype)
    scale = lambda ref: dict(rtol=t["rtol"], atol=t["atol"] * max(1.0, float(ref.abs().max())))
    for f, u in zip(fused, unfused):
        sl = f["sl"]
        for got in (f, u):
            torch.testing.assert_close(got["y"].double(), y_ref[sl], **scale(y_ref))
            torch.testing.assert_close(got["dx"].double(), dx_ref[sl], **scale(dx_ref))
        assert f["grads"].keys() == u["grads"].keys()
        for k in f["grads"]:  # owners' parameter gradients agree between the paths
            torch.testing.assert_close(f["grads"][k].double(), u["grads"][k].double(), **scale(u["grads"][k]))
    # With P_d = 1 worker m owns block m of every weight (rows of the column-parallel one, columns of the
    # row-parallel one) and worker 0 all of the row-parallel bias: each equals the sequential gradient's block.
    if P_d == 1:
        from distfuse.geometry.decomposition import block_range

        for m, r in enumerate(fused):
            lo, hi = block_range(HIDDEN, P_m, m)
            checks = [("ag.weight", g_ref["ag.weight"][lo:hi]), ("ag.bias", g_ref["ag.bias"][lo:hi]),
                      ("rs.weight", g_ref["rs.weight"][:, lo:hi])] + ([("rs.bias", g_ref["rs.bias"])] if m == 0 else [])
            for k, want in checks:
                torch.testing.assert_close(r["grads"][k].double(), want, **scale(want))
