"""The attention benchmark still runs: smoke mode (tiny shapes, two runs per provider) on 2 gloo CPU ranks.

Only that it runs and produces well-formed rows: every provider of every op is present, times
are positive and ordered, every row names the anchor it is against (``context_parallel`` where
torch's context parallelism runs, else ``sdpa_allgather``, with the reason recorded), and the
one-rank block rows (GPU) run: measured on CUDA, as a CPU dry run otherwise.  No timing here is
a performance claim.  The bench checks, before timing, that its providers agree with SDPA.
"""

import json
import math

import pytest
import torch

from bench import bench_attention, suites
from bench.harness import Row, write_results


@pytest.fixture(autouse=True)
def _auto_path(monkeypatch):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)


def _check_rows(rows):
    seen: dict = {}
    for r in rows:
        assert isinstance(r, Row) and r.mode == "full", r
        assert all(math.isfinite(t) and t > 0 for t in (r.ms, r.ms_q20, r.ms_q80)), r
        assert r.ms_q20 <= r.ms <= r.ms_q80, r
        assert r.ratio is not None and r.ratio > 0 and r.rate is not None and r.rate > 0, r
        if r.provider == r.anchor:
            assert r.ratio == 1.0, r
        seen.setdefault(r.op, {})[r.provider] = r
    return seen


def test_attention_smoke(tmp_path):
    rows = bench_attention.run(smoke=True, world_size=2, dtype=torch.float32)
    seen = _check_rows(rows)
    att = seen["attention"]
    anchor = att["ring_zigzag"].anchor
    assert anchor in ("context_parallel", "sdpa_allgather")
    assert {"ring_contiguous", "ring_zigzag", "sdpa_allgather"} <= set(att) <= {
        "ring_contiguous", "ring_zigzag", "ring_zigzag_fused", "sdpa_allgather", "context_parallel"}
    # the fused transport runs where symmetric memory does (/dev/shm here), else its reason is recorded
    fused_status = att["ring_zigzag"].extra["ring_fused"]
    assert (fused_status == "ran") == ("ring_zigzag_fused" in att), fused_status
    assert fused_status == "ran" or fused_status.startswith("not run: "), fused_status
    assert all(r.anchor == anchor and r.world_size == 2 for r in att.values())
    status = att["ring_zigzag"].extra["context_parallel"]
    assert (anchor == "context_parallel") == (status == "ran") == ("context_parallel" in att), status
    if not torch.cuda.is_available():  # torch's CP runs only the CUDA SDPA kernels: the reason is recorded
        assert status.startswith("not run: ") and anchor == "sdpa_allgather", status
        assert "not a GPU result" in att["ring_zigzag"].extra["timing"]
    # W = 2: [1, 2] (heads only, replicated and sequence-parallel) and [2, 1] (context only); [W/2, 2] would
    # repeat [1, 2]
    assert set(seen["mha"]) == {"tp_only", "cp_only", "tp_sp"}
    assert all(r.anchor == "tp_only" for r in seen["mha"].values())
    assert seen["mha"]["cp_only"].extra["grid"] == [2, 1]
    sp = seen["mha"]["tp_sp"].extra
    assert sp["sequence_parallel"] and sp["grid"] == [1, 2] and set(sp["paths"]) == {"qkv", "out_proj"}, sp
    assert not seen["mha"]["tp_only"].extra["sequence_parallel"]
    # the GPU rows' code: measured on CUDA, dry run on CPU
    assert set(seen["attention_block"]) == {"ring_local", "sdpa"}
    assert set(seen["ring_message"]) == {"ring_pack", "copy"}
    block = list(seen["attention_block"].values()) + list(seen["ring_message"].values())
    assert all(("dry_run" in r.extra) != torch.cuda.is_available() for r in block)
    assert all(r.dtype == "bfloat16" and r.world_size == 1 for r in block)
    assert seen["ring_message"]["copy"].rate_unit == "GB/s"

    msg = bench_attention.status_message(rows)
    assert f"attention anchor: {anchor}" in msg
    assert bench_attention.roles(rows)["attention"]["anchor"] == anchor
    path = write_results(bench_attention.NAME, rows, out_dir=tmp_path, smoke=True)
    assert [Row(**d) for d in json.loads(path.read_text())["rows"]] == rows


def test_attention_suite_is_registered():
    suite = suites.SUITES["attention"]
    assert not suite.gpu_only and not suite.single_process
