"""select_path: the override, the table, the defaults and the fallbacks (pure, no ranks)."""

import json

import pytest
import torch

from distfuse.layers.dispatch import DEFAULT_THRESHOLDS, DeviceCaps, load_table, select_path, table_key

H200 = DeviceCaps("cuda", "NVIDIA H200", symmetric_memory=True, triton=True)
H200_NO_P2P = DeviceCaps("cuda", "NVIDIA H200", symmetric_memory=False, triton=True)
CPU = DeviceCaps("cpu", "cpu", symmetric_memory=True, triton=False)
BIG = dict(m=8192, n=4096, k=1792)
DECODE = dict(m=64, n=4096, k=1792)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(tmp_path / "absent.json"))


def test_defaults_on_cuda_follow_the_h100_measurements():
    """No fused op beat its unfused composition on the H100 (bench/results): every default is unfused, says why."""
    for op, shapes in (("linear_rs", BIG), ("linear_ag", DECODE), ("halo_conv", dict(channels=16))):
        d = select_path(op, shapes, torch.bfloat16, 8, H200, table={})
        assert d.path == "unfused" and "H100" in d.reason and DEFAULT_THRESHOLDS[op]["fused"] == "never", (op, d)


def test_threshold_defaults_still_work(monkeypatch):
    """The threshold form of a default (for ops whose fused path wins) picks by size."""
    monkeypatch.setitem(DEFAULT_THRESHOLDS, "linear_rs", dict(min_macs=2**30))
    monkeypatch.setitem(DEFAULT_THRESHOLDS, "halo_conv", dict(max_channels=64))
    assert select_path("linear_rs", BIG, torch.bfloat16, 8, H200, table={}).path == "fused"
    assert select_path("linear_rs", DECODE, torch.bfloat16, 8, H200, table={}).path == "unfused"
    assert select_path("halo_conv", dict(channels=64), torch.float32, 4, H200, table={}).path == "fused"
    assert select_path("halo_conv", dict(channels=65), torch.float32, 4, H200, table={}).path == "unfused"


def test_cpu_production_path_is_unfused_unless_forced(monkeypatch):
    d = select_path("halo_conv", dict(channels=8), torch.float32, 4, CPU, table={})
    assert d.path == "unfused" and "interpreted" in d.reason
    monkeypatch.setenv("DISTFUSE_PATH", "fused")
    assert select_path("halo_conv", dict(channels=8), torch.float32, 4, CPU, table={}).path == "fused"


def test_override_unfused_wins(monkeypatch):
    monkeypatch.setenv("DISTFUSE_PATH", "unfused")
    d = select_path("linear_rs", BIG, torch.bfloat16, 8, H200, table={})
    assert d == d.__class__("unfused", "DISTFUSE_PATH=unfused")


def test_bad_override_is_an_error(monkeypatch):
    monkeypatch.setenv("DISTFUSE_PATH", "fast")
    with pytest.raises(ValueError, match="fused, unfused or auto"):
        select_path("linear_rs", BIG, torch.bfloat16, 8, H200, table={})


def test_no_symmetric_memory_falls_back_even_when_forced(monkeypatch, caplog):
    monkeypatch.setenv("DISTFUSE_PATH", "fused")
    d = select_path("linear_rs", BIG, torch.bfloat16, 8, H200_NO_P2P, table={})
    assert d.path == "unfused" and "symmetric memory" in d.reason
    # world size 1 needs no peers
    assert select_path("linear_rs", BIG, torch.bfloat16, 1, H200_NO_P2P, table={}).path == "fused"


def test_table_overrides_defaults(tmp_path, monkeypatch):
    table = {table_key("NVIDIA H200", 8, torch.bfloat16, "linear_rs"): {"min_size": 2**30}}
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    d = select_path("linear_rs", BIG, torch.bfloat16, 8, H200)
    assert d.path == "fused" and "crossover table" in d.reason
    d = select_path("linear_rs", DECODE, torch.bfloat16, 8, H200)
    assert d.path == "unfused" and "crossover table" in d.reason
    # other keys (dtype, world size) still use the defaults
    for other in (dict(dtype=torch.float16, w=8), dict(dtype=torch.bfloat16, w=4)):
        d = select_path("linear_rs", BIG, other["dtype"], other["w"], H200)
        assert d.path == "unfused" and d.reason.startswith("default")


def test_unreadable_table_is_ignored(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert load_table(bad) == {}


def test_unknown_op():
    with pytest.raises(KeyError, match="unknown op"):
        select_path("matmul", BIG, torch.float32, 2, H200, table={})
