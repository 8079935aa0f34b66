"""The layer benchmarks still run: smoke mode (tiny shapes, two runs per provider) on 2 gloo CPU ranks.

Only that they run and produce well-formed rows: every provider of every op and mode is
present, times are positive and ordered (q20 <= median <= q80), every row carries its
ratio to the anchor, and the rows survive the JSON round trip.  No timing here is a
performance claim.  Each bench also checks, before timing, that its providers agree.
"""

import json
import math

import pytest
import torch

from bench import bench_conv_layers, bench_linear_layers
from bench.harness import Row, write_results

LINEAR_OPS = {"mlp_seqpar", "linear_ag_seqpar", "linear_rs_seqpar", "mlp_feat", "linear_ag_feat", "linear_rs_feat"}
CASES = [
    pytest.param(bench_linear_layers, "dtensor", LINEAR_OPS, {"dtensor", "distfuse"}, {"mlp_feat": {"dtensor_repl"}},
                 id="linear_layers"),
    # CPU: no fused rows (interpreted Triton is never timed)
    pytest.param(bench_conv_layers, "cat", {"feature_conv2d", "feature_conv3d"},
                 {"cat", "distfuse", "distfuse_static"}, {}, id="conv_layers"),
]


@pytest.fixture(autouse=True)
def _auto_path(monkeypatch):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)


@pytest.mark.parametrize("mod,anchor,ops,providers,extra_providers", CASES)
def test_bench_smoke(mod, anchor, ops, providers, extra_providers, tmp_path):
    rows = mod.run(smoke=True, world_size=2, dtype=torch.float32)
    assert rows and all(isinstance(r, Row) for r in rows)
    seen: dict = {}
    for r in rows:
        assert r.world_size == 2 and r.dtype == "float32" and r.mode in ("full", "fwd"), r
        assert all(math.isfinite(t) and t > 0 for t in (r.ms, r.ms_q20, r.ms_q80)), r
        assert r.ms_q20 <= r.ms <= r.ms_q80, r
        assert r.anchor == anchor and r.ratio is not None and r.ratio > 0, r
        assert r.rate is not None and r.rate > 0 and r.rate_unit == "TFLOP/s", r
        assert r.extra["device"] == "cpu" and "not a GPU result" in r.extra["timing"], r
        assert r.extra["samples"] >= 2, r
        if r.provider == anchor:
            assert r.ratio == 1.0, r
        if r.provider.startswith("distfuse"):
            assert r.extra["path"].split(",")[0] == "unfused", r  # CPU: never the interpreted fused path
        seen.setdefault((r.op, r.mode), set()).add(r.provider)
    assert {op for op, _ in seen} == ops
    for (op, mode), got in seen.items():
        assert got == providers | extra_providers.get(op, set()), (op, mode, got)
    assert {mode for _, mode in seen} == {"full", "fwd"}

    path = write_results(mod.NAME, rows, out_dir=tmp_path, smoke=True)
    data = json.loads(path.read_text())
    assert data["smoke"] is True and data["env"]["device"] == "cpu"
    assert [Row(**d) for d in data["rows"]] == rows


def test_bench_agreement_smoke(tmp_path):
    """The agreement bench: every layer with its four providers (five with a deferred transport); only ``gather``
    gathers, once per call."""
    from bench import bench_agreement

    rows = bench_agreement.run(smoke=True, world_size=2, dtype=torch.float32)
    seen: dict = {}
    for r in rows:
        assert r.mode == "fwd" and r.anchor == "trusted" and r.ratio is not None and r.ratio > 0, r
        assert all(math.isfinite(t) and t > 0 for t in (r.ms, r.ms_q20, r.ms_q80)), r
        assert "not a GPU result" in r.extra["timing"], r
        if r.provider == "gather":
            assert r.extra["metadata_gathers"] == r.extra["calls"] >= 2, r
        seen.setdefault(r.op, set()).add(r.provider)
    assert set(seen) == {"feature_conv2d", "general_conv2d", "max_pool2d", "halo_exchange", "broadcast",
                         "linear_all_gather", "linear_reduce_scatter", "general_linear"}
    for op, providers in seen.items():  # the layers with a deferred transport also time it forced
        extra = {"deferred"} if op in bench_agreement.DEFERRED else set()
        assert providers == {"trusted", "agreed", "host", "gather"} | extra, (op, providers)
    path = write_results(bench_agreement.NAME, rows, out_dir=tmp_path, smoke=True)
    assert [Row(**d) for d in json.loads(path.read_text())["rows"]] == rows
