"""select_path: the override, the table, the defaults and the fallbacks (pure, no ranks)."""

import dataclasses
import json

import pytest
import torch

from distfuse.fused import registry
from distfuse.fused.registry import DefaultRule
from distfuse.layers.dispatch import DeviceCaps, load_table, select_path, table_key

H200 = DeviceCaps("cuda", "NVIDIA H200", symmetric_memory=True, triton=True)
H200_NO_P2P = DeviceCaps("cuda", "NVIDIA H200", symmetric_memory=False, triton=True)
CPU = DeviceCaps("cpu", "cpu", symmetric_memory=True, triton=False)
BIG = dict(m=8192, n=4096, k=1792)
RS, AG = registry.MATMUL_REDUCE_SCATTER.name, registry.ALL_GATHER_MATMUL.name
DECODE = dict(m=64, n=4096, k=1792)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(tmp_path / "absent.json"))


def test_defaults_on_cuda_follow_the_h100_measurements():
    """No fused op beat its unfused composition on the H100 (bench/results): every default is unfused, says why."""
    for op, shapes in ((RS, BIG), (AG, DECODE), ("halo_conv", dict(elements=2.0**26))):
        d = select_path(op, shapes, torch.bfloat16, 8, H200, table={})
        assert d.path == "unfused" and "H100" in d.reason and registry.get(op).default.fused == "never", (op, d)
        assert d.reason == f"default: {registry.get(op).default.why}; a distfuse-tune table entry can enable it"


def _set_default(monkeypatch, op, **bounds):
    """Give ``op`` a threshold default rule for the test (the registry entry is restored afterwards)."""
    spec = registry.get(op)
    monkeypatch.setitem(registry.OPS, op, dataclasses.replace(spec, default=DefaultRule.threshold(**bounds)))


def test_threshold_defaults_still_work(monkeypatch):
    """The threshold form of a default (for ops whose fused path wins) picks by size."""
    _set_default(monkeypatch, RS, min_size=2**30)
    _set_default(monkeypatch, "halo_conv", min_size=2**26)
    assert select_path(RS, BIG, torch.bfloat16, 8, H200, table={}).path == "fused"
    assert select_path(RS, DECODE, torch.bfloat16, 8, H200, table={}).path == "unfused"
    assert select_path("halo_conv", dict(elements=2**26), torch.float32, 4, H200, table={}).path == "fused"
    assert select_path("halo_conv", dict(elements=2**26 - 1), torch.float32, 4, H200, table={}).path == "unfused"


def test_cpu_production_path_is_unfused_unless_forced(monkeypatch):
    d = select_path("halo_conv", dict(elements=8), torch.float32, 4, CPU, table={})
    assert d.path == "unfused" and "interpreted" in d.reason
    monkeypatch.setenv("DISTFUSE_PATH", "fused")
    assert select_path("halo_conv", dict(elements=8), torch.float32, 4, CPU, table={}).path == "fused"


def test_override_unfused_wins(monkeypatch):
    monkeypatch.setenv("DISTFUSE_PATH", "unfused")
    d = select_path(RS, BIG, torch.bfloat16, 8, H200, table={})
    assert d == d.__class__("unfused", "DISTFUSE_PATH=unfused")


def test_bad_override_is_an_error(monkeypatch):
    monkeypatch.setenv("DISTFUSE_PATH", "fast")
    with pytest.raises(ValueError, match="fused, unfused or auto"):
        select_path(RS, BIG, torch.bfloat16, 8, H200, table={})


def test_no_symmetric_memory_falls_back_even_when_forced(monkeypatch, caplog):
    monkeypatch.setenv("DISTFUSE_PATH", "fused")
    d = select_path(RS, BIG, torch.bfloat16, 8, H200_NO_P2P, table={})
    assert d.path == "unfused" and "symmetric memory" in d.reason
    # world size 1 needs no peers
    assert select_path(RS, BIG, torch.bfloat16, 1, H200_NO_P2P, table={}).path == "fused"


def test_table_overrides_defaults(tmp_path, monkeypatch):
    table = {table_key("NVIDIA H200", 8, torch.bfloat16, RS): {"min_size": 2**30}}
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    d = select_path(RS, BIG, torch.bfloat16, 8, H200)
    assert d.path == "fused" and "crossover table" in d.reason
    d = select_path(RS, DECODE, torch.bfloat16, 8, H200)
    assert d.path == "unfused" and "crossover table" in d.reason
    # other keys (dtype, world size) still use the defaults
    for other in (dict(dtype=torch.float16, w=8), dict(dtype=torch.bfloat16, w=4)):
        d = select_path(RS, BIG, other["dtype"], other["w"], H200)
        assert d.path == "unfused" and d.reason.startswith("default")


def test_unreadable_table_is_ignored(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert load_table(bad) == {}


def test_unknown_op():
    with pytest.raises(KeyError, match="unknown op"):
        select_path("matmul", BIG, torch.float32, 2, H200, table={})


# ---------------------------------------------------------------- boundaries (exactly at, one below, one above)
# The thresholds are inclusive on both sides: fused for lo <= size <= hi.  Each op's size is built to land exactly
# on the bound (m*n*k for the linears with n = k = 1, channels for the halo conv).

T = 64 * 4096 * 1792  # a decode-sized GEMM's MACs: 469762048, exact in a float


def _shapes(op, size):
    return dict(m=size, n=1, k=1) if registry.get(op).size_key == "macs" else {registry.get(op).size_key: size}


def _path(op, size, table=None, world=8, caps=H200):
    return select_path(op, _shapes(op, size), torch.bfloat16, world, caps, table={} if table is None else table).path


BOUND_OPS = pytest.mark.parametrize("op,t", [(RS, T), (AG, T), ("halo_conv", 2**26)])


@BOUND_OPS
def test_default_min_size_is_inclusive(monkeypatch, op, t):
    _set_default(monkeypatch, op, min_size=t)
    assert [_path(op, s) for s in (t - 1, t, t + 1)] == ["unfused", "fused", "fused"]


@BOUND_OPS
def test_default_max_size_is_inclusive(monkeypatch, op, t):
    _set_default(monkeypatch, op, max_size=t)
    assert [_path(op, s) for s in (t - 1, t, t + 1)] == ["fused", "fused", "unfused"]


def test_default_interval_both_bounds_inclusive(monkeypatch):
    _set_default(monkeypatch, RS, min_size=T, max_size=4 * T)
    got = [_path(RS, s) for s in (T - 1, T, T + 1, 4 * T - 1, 4 * T, 4 * T + 1)]
    assert got == ["unfused", "fused", "fused", "fused", "fused", "unfused"]
    d = select_path(RS, _shapes(RS, T), torch.bfloat16, 8, H200, table={})
    assert d.reason.startswith(f"default: fused for macs in [{T:g}, {4 * T:g}], got {T:g}")


def test_default_threshold_still_needs_cuda_and_yields_to_the_table(monkeypatch):
    _set_default(monkeypatch, RS, min_size=T)
    assert _path(RS, T, caps=CPU) == "unfused"
    table = {table_key("NVIDIA H200", 8, torch.bfloat16, RS): {"min_size": T + 1}}
    assert _path(RS, T, table) == "unfused"  # the table entry, not the default, decides


def _table(op, **entry):
    return {table_key("NVIDIA H200", 8, torch.bfloat16, op): entry}


@BOUND_OPS
def test_table_min_size_is_inclusive(op, t):
    assert [_path(op, s, _table(op, min_size=t)) for s in (t - 1, t, t + 1)] == ["unfused", "fused", "fused"]


@BOUND_OPS
def test_table_max_size_is_inclusive(op, t):
    assert [_path(op, s, _table(op, max_size=t)) for s in (t - 1, t, t + 1)] == ["fused", "fused", "unfused"]


def test_table_interval_both_bounds_inclusive(tmp_path, monkeypatch):
    """The same interval through the file dispatch reads (``DISTFUSE_TUNE_TABLE``) and as a dict."""
    entry = dict(min_size=T, max_size=4 * T, fused="interval")
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps(_table(RS, **entry)))
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    sizes = (T - 1, T, T + 1, 4 * T - 1, 4 * T, 4 * T + 1)
    want = ["unfused", "fused", "fused", "fused", "fused", "unfused"]
    from_file = [select_path(RS, _shapes(RS, s), torch.bfloat16, 8, H200).path for s in sizes]
    assert from_file == want
    assert [_path(RS, s, _table(RS, **entry)) for s in sizes] == want
    d = select_path(RS, _shapes(RS, T), torch.bfloat16, 8, H200)
    assert d.reason == f"crossover table: macs={T:g}, fused for [{T:g}, {4 * T:g}]"


def test_table_never_entry_wins_over_its_bounds():
    # "never" is written as max_size -1; a size of 0 is still unfused, and "fused": "never" alone says so too
    assert _path("halo_conv", 0, _table("halo_conv", max_size=-1.0, fused="never")) == "unfused"
    assert _path("halo_conv", 0, _table("halo_conv", max_size=-1.0)) == "unfused"
    assert _path(RS, T, _table(RS, min_size=T, fused="never")) == "unfused"


# ---------------------------------------------------------------- tables written before the GEMM fusions were renamed


def test_table_reads_entries_under_former_op_names(tmp_path, monkeypatch):
    """Keys ``...|linear_rs`` / ``...|linear_ag`` (tables tuned before the rename) decide for the current ops."""
    assert registry.RENAMED == {"linear_rs": RS, "linear_ag": AG}
    old = {table_key("NVIDIA H200", 8, torch.bfloat16, "linear_rs"): dict(min_size=T, fused="interval"),
           table_key("NVIDIA H200", 8, torch.bfloat16, "linear_ag"): dict(max_size=-1.0, fused="never")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    assert sorted(load_table(path)) == sorted(table_key("NVIDIA H200", 8, torch.bfloat16, op) for op in (RS, AG))
    d = select_path(RS, _shapes(RS, T), torch.bfloat16, 8, H200)
    assert d.path == "fused" and d.reason == f"crossover table: macs={T:g}, fused for [{T:g}, inf]"
    assert select_path(RS, _shapes(RS, T - 1), torch.bfloat16, 8, H200).path == "unfused"
    assert select_path(AG, _shapes(AG, 4 * T), torch.bfloat16, 8, H200).reason == \
        f"crossover table: fused never wins for {AG} here"
    # where a table holds both, the entry under the current name decides
    both = tmp_path / "both.json"
    both.write_text(json.dumps(dict(old, **_table(RS, min_size=4 * T))))
    assert load_table(both)[table_key("NVIDIA H200", 8, torch.bfloat16, RS)] == dict(min_size=4 * T)
    # the former name itself is no op any more, and the error says what it became
    with pytest.raises(KeyError, match=f"renamed to '{RS}'"):
        select_path("linear_rs", BIG, torch.bfloat16, 8, H200, table={})
    with pytest.raises(ValueError, match="former name"):
        registry.register(dataclasses.replace(registry.get(RS), name="linear_ag"))


# ---------------------------------------------------------------- the registry is the one list of ops


def test_select_path_reads_ops_from_the_registry(monkeypatch):
    """A new registry entry is all select_path needs: size, default rule and symmetric-memory need."""
    new = registry.FusedOp("toy_fused", "elements", ("rows", "cols"), DefaultRule.threshold(min_size=100),
                           case="distfuse.tune.cases:linear_case", grid="distfuse.tune.cases:linear_grid",
                           needs_symmetric_memory=True)
    monkeypatch.setitem(registry.OPS, "toy_fused", new)
    assert select_path("toy_fused", dict(rows=10, cols=10), torch.float32, 8, H200, table={}).path == "fused"
    assert select_path("toy_fused", dict(rows=9, cols=11), torch.float32, 8, H200, table={}).path == "unfused"
    assert select_path("toy_fused", dict(rows=10, cols=10), torch.float32, 8, H200_NO_P2P, table={}).path == "unfused"
    with pytest.raises(KeyError, match="cols"):
        select_path("toy_fused", dict(rows=10), torch.float32, 8, H200, table={})


def test_default_rule_validation():
    with pytest.raises(ValueError, match="never"):
        DefaultRule("sometimes", "why")
    with pytest.raises(ValueError, match="min_size, max_size"):
        DefaultRule.threshold(why="no bounds")
