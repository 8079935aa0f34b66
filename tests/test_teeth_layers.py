"""Fused layer paths against torch.nn on the gathered tensors, with data parallelism, unsorted ranks, and exact bf16.

* The sequence-parallel linear layers (plain and ZeRO) on their fused path with a
  data-parallel partition dimension of 2 and partitions whose ranks are listed out of
  order: output, input gradient and *every parameter gradient*, gathered from the owners'
  blocks, against a float64 ``torch.nn`` MLP.
* The feature-distributed conv with ``DISTFUSE_HALO_CONV=implicit`` (the implicit-GEMM
  forward; the variable is set inside the ranks, and a counter proves the kernel ran):
  forward and every gradient against ``torch.nn.Conv2d``.
* bf16 rounding, end to end: with small integers as data every fp32 accumulation is
  exact, so the fused ops' bf16 outputs must equal, bit for bit, the float64 result
  rounded by torch's ``.to(torch.bfloat16)`` (round to nearest even).  A kernel that
  truncated fp32 to bf16 (the Triton interpreter's own conversion) fails here.
"""

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distfuse.kernels.conv_implicit as conv_implicit_module
from distfuse import Partition
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import (
    DistributedConv2d,
    DistributedLinearAllGather,
    DistributedLinearAllGatherZero,
    DistributedLinearReduceScatter,
    DistributedLinearReduceScatterZero,
    load_sequential,
)
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import Case, run_cases, with_path
from tests.tolerances import tol

H, HIDDEN = 8, 12
LINEAR = {"plain": (DistributedLinearAllGather, DistributedLinearReduceScatter),
          "zero": (DistributedLinearAllGatherZero, DistributedLinearReduceScatterZero)}


def _grads_on_rank0(layer):
    """Every parameter's gradient, gathered from its owners' blocks onto world rank 0 (None elsewhere)."""
    out = {}
    for lay in layer.param_layouts():
        local = None
        if lay.P.active:
            local = getattr(layer, lay.name).grad
            assert local is not None, f"{type(layer).__name__}: no {lay.name} gradient on its owner"
        out[lay.seq_name] = collect_tensor(local, lay.P)
    return out


def _int_like(shape, gen, hi=6):
    """Random non-zero integers in [-hi, hi] (as float64; exact in bf16 for hi <= 256)."""
    v = torch.randint(1, hi + 1, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    return v.to(torch.float64)


def _mlp_on_ranks(kind, order, P_d, P_m, n, dtype, integers):
    """rs(act(ag(x))) on the fused path; rank 0 returns what it gathered and the float64 torch.nn reference."""
    P = Partition.world().create_partition_inclusive(list(order))
    P_feat = P.create_cartesian_topology_partition([P_d, 1, P_m])
    P_seq = P.create_cartesian_topology_partition([P_d, P_m, 1])
    ag_cls, rs_cls = LINEAR[kind]
    ag = ag_cls(P_feat, H, HIDDEN, P_x=P_seq, dtype=dtype)
    rs = rs_cls(P_feat, HIDDEN, H, P_y=P_seq, dtype=dtype)
    # the float64 reference holds exactly the parameters the layers can hold
    gen = torch.Generator().manual_seed(11)
    seq = nn.ModuleDict(dict(ag=nn.Linear(H, HIDDEN, dtype=torch.float64),
                             rs=nn.Linear(HIDDEN, H, dtype=torch.float64)))
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(_int_like(p.shape, gen, 40) if integers else
                    torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype).double())
    rank = dist.get_rank()
    load_sequential(ag, seq["ag"] if rank == 0 else None)
    load_sequential(rs, seq["rs"] if rank == 0 else None)
    shape = (2 * P_d + 1, n, H)  # uneven batch blocks over the data-parallel workers
    xg = (_int_like(shape, gen, 40) if integers else torch.randn(shape, generator=gen, dtype=torch.float64))
    xg = xg.to(dtype).double()
    dyg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double()
    sl = local_slices(shape, P_seq.shape, P_seq.index)
    x = xg[sl].to(dtype).requires_grad_(True)
    h = with_path("fused", lambda: ag(x))
    y = with_path("fused", lambda: rs(F.gelu(h)))
    paths = (ag.last_path, rs.last_path)
    y.backward(dyg[sl].to(dtype))
    got = dict(h=collect_tensor(h.detach(), P_feat), y=collect_tensor(y.detach(), P_seq),
               dx=collect_tensor(x.grad, P_seq))
    got.update({f"ag.{k}": v for k, v in _grads_on_rank0(ag).items()})
    got.update({f"rs.{k}": v for k, v in _grads_on_rank0(rs).items()})
    if rank != 0:
        return dict(paths=paths)
    x64 = xg.clone().requires_grad_(True)
    h64 = seq["ag"](x64)
    y64 = seq["rs"](F.gelu(h64))
    y64.backward(dyg)
    want = dict(h=h64.detach(), y=y64.detach(), dx=x64.grad)
    want.update({f"{name}.grad": p.grad for name, p in seq.named_parameters()})
    return dict(paths=paths, got=got, want=want)


def _close(name, got, ref, dtype):
    t = tol(dtype)
    scale = max(float(ref.abs().max()), 1e-3)
    torch.testing.assert_close(got.double(), ref, rtol=t["rtol"], atol=t["atol"] * scale,
                               msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["plain", "zero"])
def test_fused_linear_layers_with_data_parallel_match_torch_nn(kind):
    """P_d = 2, P_m = 2 on ranks listed as [2, 0, 3, 1], fp32: every parameter gradient against torch.nn."""
    out = run_ranks(4, _mlp_on_ranks, kind, [2, 0, 3, 1], 2, 2, 5, torch.float32, False)
    assert all(r["paths"] == ("fused", "fused") for r in out), [r["paths"] for r in out]
    got, want = out[0]["got"], out[0]["want"]
    names = {"ag.weight", "ag.bias", "rs.weight", "rs.bias"}
    assert {k for k in got if "." in k} == names
    for k in ("y", "dx"):
        _close(f"{kind}: {k}", got[k].double(), want[k], torch.float32)
    for k in sorted(names):
        _close(f"{kind}: {k} gradient", got[k].double(), want[f"{k}.grad"], torch.float32)


def test_fused_linear_all_gather_bf16_output_rounds_to_nearest_even():
    """Integer data, bf16: the fused all-gather+GEMM output is exactly the float64 result rounded once by torch."""
    out = run_ranks(4, _mlp_on_ranks, "plain", [1, 3, 0, 2], 1, 4, 6, torch.bfloat16, True)
    assert all(r["paths"] == ("fused", "fused") for r in out), [r["paths"] for r in out]
    h, exact = out[0]["got"]["h"], out[0]["want"]["h"]
    ref = exact.to(torch.bfloat16)
    assert not torch.equal(ref.double(), exact), "test data: the outputs must need rounding"
    assert h.dtype == torch.bfloat16 and torch.equal(h, ref), \
        f"{int((h != ref).sum())} of {h.numel()} outputs differ from the exact GEMM rounded to nearest even"


def _rs_exact_on_ranks(order):
    P = Partition.world().create_partition_inclusive(list(order))
    P_feat = P.create_cartesian_topology_partition([1, 1, 4])
    P_seq = P.create_cartesian_topology_partition([1, 4, 1])
    rs = DistributedLinearReduceScatter(P_feat, HIDDEN, H, P_y=P_seq, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    seq = nn.Linear(HIDDEN, H, dtype=torch.float64)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(_int_like(p.shape, gen, 40))
    load_sequential(rs, seq if dist.get_rank() == 0 else None)
    xg = _int_like((3, 6, HIDDEN), gen, 40)
    x = xg[local_slices(xg.shape, P_feat.shape, P_feat.index)].to(torch.bfloat16)
    y = with_path("fused", lambda: rs(x))
    y_full = collect_tensor(y.detach(), P_seq)
    if dist.get_rank() != 0:
        return rs.last_path
    # the exact reference with the op's documented roundings: each worker's partial rounded to bf16 by torch,
    # the partials summed exactly (small integers), plus the bias, rounded once by torch
    q = HIDDEN // 4  # the input-feature blocks of the 4 model-parallel workers (HIDDEN = 12: even split)
    partials = [(xg[..., m * q:(m + 1) * q] @ seq.weight.detach()[:, m * q:(m + 1) * q].t()).to(torch.bfloat16)
                .double() for m in range(4)]
    ref = (sum(partials) + seq.bias.detach()).to(torch.bfloat16)
    exact = sum(partials) + seq.bias.detach()
    return rs.last_path, y_full, ref, exact


def test_fused_linear_bf16_reduce_scatter_rounds_to_nearest_even():
    out = run_ranks(4, _rs_exact_on_ranks, [3, 0, 2, 1])
    assert out[0][0] == "fused" and all(p == "fused" for p in out[1:])
    _, y, ref, exact = out[0]
    assert not torch.equal(ref.double(), exact), "test data: the output must need rounding"
    assert torch.equal(y, ref), f"{int((y != ref).sum())} of {y.numel()} outputs are not rounded to nearest even"


# ------------------------------------------------------------------ the implicit-GEMM halo conv, layer level


@contextlib.contextmanager
def _implicit_conv():
    """``DISTFUSE_HALO_CONV=implicit`` in this rank, and the list of the implicit-GEMM kernel's launches."""
    calls = []
    orig = conv_implicit_module.conv_implicit

    def counting(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    old = os.environ.get("DISTFUSE_HALO_CONV")
    conv_implicit_module.conv_implicit = counting  # halo_conv imports it from the module at call time
    os.environ["DISTFUSE_HALO_CONV"] = "implicit"
    try:
        yield calls
    finally:
        conv_implicit_module.conv_implicit = orig
        if old is None:
            os.environ.pop("DISTFUSE_HALO_CONV", None)
        else:
            os.environ["DISTFUSE_HALO_CONV"] = old


def _implicit_cases(cases):
    with _implicit_conv() as calls:
        seen = run_cases(cases)
    return seen, len(calls)


IMPLICIT_CASES = [
    Case("2d-2x2-unsorted-reflect-stride-dil", "feature", (2, 3, 7, 9), 4, 3, (1, 1, 2, 2), (3, 1, 0, 2),
         stride=(2, 1), dilation=(1, 2), padding=(1, 2), mode="reflect", path="fused", seed=3),
    Case("2d-2x1x1x2-batch-split-unsorted-circular-even", "feature", (3, 2, 6, 8), 3, (3, 2), (2, 1, 1, 2),
         (1, 3, 2, 0), padding=1, mode="circular", path="fused", seed=4),
]


@pytest.mark.parametrize("case", IMPLICIT_CASES, ids=[c.name for c in IMPLICIT_CASES])
def test_implicit_halo_conv_layer_matches_torch_nn(case):
    """DISTFUSE_HALO_CONV=implicit + DISTFUSE_PATH=fused: forward, input, weight and bias gradients against
    torch.nn.Conv2d on the gathered tensors (run_case compares on rank 0, fp32)."""
    out = run_ranks(4, _implicit_cases, [case])
    for seen, calls in out:
        assert seen[0]["path"] == "fused", seen
        assert calls == 1, f"the implicit-GEMM kernel ran {calls} times on this rank (DISTFUSE_HALO_CONV ignored?)"


def _implicit_bf16_exact(order):
    """Integer data through the implicit conv layer in bf16: the output is the exact conv rounded once."""
    P = Partition.world().create_partition_inclusive(list(order))
    P_x = P.create_cartesian_topology_partition((1, 1, 2, 2))
    conv = DistributedConv2d(P_x, 3, 5, 3, padding=1, padding_mode="replicate", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    seq = nn.Conv2d(3, 5, 3, padding=1, padding_mode="replicate", dtype=torch.float64)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(_int_like(p.shape, gen, 30))
    load_sequential(conv, seq if dist.get_rank() == 0 else None)
    xg = _int_like((2, 3, 6, 7), gen, 30)
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].to(torch.bfloat16)
    with _implicit_conv() as calls:
        y = with_path("fused", lambda: conv(x))
    y_full = collect_tensor(y.detach(), P_x)
    if dist.get_rank() != 0:
        return conv.last_path, len(calls)
    exact = seq(xg).detach()
    return conv.last_path, len(calls), y_full, exact


def test_implicit_halo_conv_bf16_output_rounds_to_nearest_even():
    out = run_ranks(4, _implicit_bf16_exact, [2, 3, 1, 0])
    assert all(r[0] == "fused" and r[1] == 1 for r in out)
    _, _, y, exact = out[0]
    ref = exact.to(torch.bfloat16)
    assert not torch.equal(ref.double(), exact), "test data: outputs must need rounding"
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref), \
        f"{int((y != ref).sum())} of {y.numel()} outputs differ from the exact conv rounded to nearest even"


# ------------------------------------------------------------------ torch 2.13 CPU bf16 strided conv3d (worked around)

ONEDNN_CASE = Case("3d-1x1x3-stride-last-axis-bf16-fused", "feature", (1, 1, 3, 3, 6), 2, 3, (1, 1, 1, 1, 3),
                   (2, 0, 1), stride=(1, 1, 2), padding=1, dtype=torch.bfloat16, path="fused", seed=2)


def test_fused_conv3d_bf16_strided_matches_torch_nn():
    """The fused path on the case above: it must match torch.nn even where this torch's own one-thread bf16 conv3d
    is wrong (fused/halo_conv.py convolves 16-bit CPU tensors in fp32 and rounds once, like conv_block)."""
    run_ranks(3, run_cases, [ONEDNN_CASE])


def test_unfused_conv3d_bf16_strided_matches_torch_nn():
    """The same case on the unfused path passes: conv_block's fp32 workaround (the control for the test above)."""
    run_ranks(3, run_cases, [dataclasses.replace(ONEDNN_CASE, path="unfused")])
