"""fp32 and the Triton GEMM fusions: unfused on CUDA unless torch allows TF32, and TF32 in the kernels when it does.

``select_path`` is pure, so the CUDA decisions are checked here with a CUDA ``DeviceCaps``
on a CPU machine; the kernels' precision choice is checked under the interpreter (always
IEEE); the TF32 numerics run where a GPU is (``cuda`` marker).
"""

import contextlib
import math

import pytest
import torch

from distfuse.fused import registry
from distfuse.fused.crossover_table import table_key
from distfuse.kernels._utils import INTERPRET, input_precision, tf32_allowed
from distfuse.layers.dispatch import DeviceCaps, select_path
from tests.tolerances import rel_norm_tf32

H100 = DeviceCaps("cuda", "NVIDIA H100", True, True)
GEMM_OPS = [op for op in registry.names() if registry.get(op).triton_gemm]
BIG = dict(m=4096, n=4096, k=4096)


@contextlib.contextmanager
def _tf32(allow_tf32: bool | None = None, precision: str | None = None):
    """Set one of torch's TF32 switches (``allow_tf32`` or the float32 matmul precision), restoring it after."""
    if precision is not None:
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
    else:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = bool(allow_tf32)
    try:
        yield
    finally:
        if precision is not None:
            torch.set_float32_matmul_precision(old)
        else:
            torch.backends.cuda.matmul.allow_tf32 = old


def _fused_everywhere(op: str) -> dict:
    return {table_key(H100.name, 8, dt, op): {"min_size": 1.0} for dt in (torch.float32, torch.bfloat16)}


def test_every_gemm_fusion_is_marked():
    assert set(GEMM_OPS) == {"matmul_reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter_features",
                             "all_gather_features_matmul", "matmul_all_reduce", "zero_linear_rows",
                             "zero_linear_columns"}
    assert not registry.get("halo_conv").triton_gemm


@pytest.mark.parametrize("op", GEMM_OPS)
def test_fp32_without_tf32_stays_unfused_even_where_the_table_fuses(op, monkeypatch):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    table = _fused_everywhere(op)
    with _tf32(False):
        assert not tf32_allowed()
        d = select_path(op, BIG, torch.float32, 8, H100, table=table)
        assert d.path == "unfused" and "fp32 without TF32" in d.reason and "allow_tf32" in d.reason
        assert select_path(op, BIG, torch.bfloat16, 8, H100, table=table).path == "fused"  # 16-bit: unaffected
        monkeypatch.setenv("DISTFUSE_PATH", "fused")
        assert select_path(op, BIG, torch.float32, 8, H100, table=table).path == "fused"  # forcing still forces


@pytest.mark.parametrize("switch", [pytest.param(dict(allow_tf32=True), id="allow_tf32"),
                                    pytest.param(dict(precision="high"), id="precision-high")])
def test_fp32_with_tf32_follows_the_table(switch, monkeypatch):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    op = "all_gather_matmul"
    with _tf32(**switch):
        assert tf32_allowed()
        d = select_path(op, BIG, torch.float32, 8, H100, table=_fused_everywhere(op))
        assert d.path == "fused" and d.reason.startswith("crossover table")
        assert select_path(op, BIG, torch.float32, 8, H100, table={}).path == "unfused"  # the default: never
        # The kernels follow torch's setting on a GPU, and stay IEEE in the interpreter.
        assert input_precision(torch.float32) == ("ieee" if INTERPRET else "tf32")
    with _tf32(False):
        assert input_precision(torch.float32) == "ieee"
    assert input_precision(torch.bfloat16) == "tf32"


def test_cpu_reason_is_unchanged_and_halo_conv_ignores_tf32(monkeypatch):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    cpu = DeviceCaps("cpu", "cpu", True, False)
    with _tf32(False):
        assert "production path is unfused" in select_path("matmul_reduce_scatter", BIG, torch.float32, 2, cpu,
                                                           table={}).reason
        key = table_key(H100.name, 8, torch.float32, "halo_conv")
        assert select_path("halo_conv", dict(elements=2.0**20), torch.float32, 8, H100,
                           table={key: {"min_size": 1.0}}).path == "fused"


@pytest.mark.cuda
def test_tf32_fused_fp32_matches_float64_at_tf32_tolerance():
    """Compiled, TF32 allowed: the fp32 all-gather + GEMM uses TF32 tensor cores (10-bit mantissa products) and
    meets a TF32 tolerance against float64, not the IEEE one."""
    from distfuse.fused.all_gather_matmul import all_gather_matmul_loopback, all_gather_matmul_workspace_bytes
    from distfuse.fused.workspace import LoopbackWorkspace
    from distfuse.geometry.decomposition import block_extent

    W, n, K, N = 4, 1030, 1024, 512
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, block_extent(n, W, r), K, generator=g, dtype=torch.float64) for r in range(W)]
    wts = [torch.randn(block_extent(N, W, r), K, generator=g, dtype=torch.float64) / math.sqrt(K) for r in range(W)]
    ws = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(1, n, K, W, torch.float32), dev)
    with _tf32(True):
        assert input_precision(torch.float32) == "tf32"
        ys = all_gather_matmul_loopback([x.to(dev, torch.float32) for x in xs], [w.to(dev, torch.float32)
                                                                                  for w in wts], None, ws)
    x_full = torch.cat(xs, dim=-2)
    for r in range(W):
        ref = x_full @ wts[r].t()
        got = ys[r].double().cpu()
        assert not torch.isnan(got).any(), f"rank {r}: NaN (an element was never written)"
        err = float((got - ref).norm() / ref.norm())
        bound = rel_norm_tf32(K)  # sums of K products of TF32 operands
        assert err <= bound, f"rank {r}: relative error {err:.2e} above TF32's {bound:.1e} (sums of {K} terms)"
