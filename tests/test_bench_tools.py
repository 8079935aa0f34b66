"""Benchmark tooling and the tuner: compare, plot, the suite runner, crossover extraction, the table round trip.

No timing here is a performance claim: the suites run at smoke shapes on CPU to prove
they still work, and the tuner's CPU sweep proves the plumbing (fused is never timed on
CPU).  Crossover and compare logic run on synthetic measurements with known answers.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.__main__ as bench_cli
from bench import compare, plot, suites
from bench.harness import Row
from distfuse import timing, tune
from distfuse.fused import registry
from distfuse.layers.dispatch import DeviceCaps, load_table, select_path, table_key
from distfuse.testing import run_ranks
from distfuse.tune import autotune_cache, cases, sweeper
from tests.tolerances import tol

ROOT = Path(__file__).resolve().parents[1]
H200 = DeviceCaps("cuda", "NVIDIA H200", symmetric_memory=True, triton=True)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(tmp_path / "absent.json"))


# ---------------------------------------------------------------- compare


def _row(provider, ms, shape, op="matmul_scatter", anchor="cublas", mode="fwd", dtype="bfloat16", world_size=8):
    return dict(op=op, provider=provider, mode=mode, shape=shape, dtype=dtype, world_size=world_size, ms=ms,
                ms_q20=ms, ms_q80=ms, anchor=anchor, ratio=None, extra={})


def _results(path, rows, device="NVIDIA H200", smoke=False):
    """Rows with ratios set against each shape's anchor, as the harness writes them."""
    anchors = {(r["op"], r["mode"], json.dumps(r["shape"])): r["ms"] for r in rows if r["provider"] == r["anchor"]}
    for r in rows:
        a = anchors.get((r["op"], r["mode"], json.dumps(r["shape"])))
        r["ratio"] = r["ms"] / a if a else None
    path.write_text(json.dumps(dict(env=dict(device=device, commit="abc"), smoke=smoke, rows=rows)))
    return path


def _gemm_rows(fused_ms=(1.0, 2.0), cublas_ms=(0.9, 1.8)):
    rows = []
    for i, (f, c) in enumerate(zip(fused_ms, cublas_ms)):
        shape = dict(model="llama3-8b", m=64 * 8**i, n=4096, k=1792)
        rows += [_row("cublas", c, shape), _row("fused", f, shape)]
    return rows


def test_compare_regression_exits_1(tmp_path, capsys):
    base = _results(tmp_path / "base.json", _gemm_rows())
    cur = _results(tmp_path / "cur.json", _gemm_rows(fused_ms=(1.0, 2.3)))  # +15% against the same cuBLAS time
    assert compare.main([str(base), str(cur)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "worse" in out and "+15.0%" in out
    # past a looser tolerance it is not a regression
    assert compare.main([str(base), str(cur), "--tolerance", "0.2"]) == 0


def test_compare_improvement_and_noise_exit_0(tmp_path, capsys):
    base = _results(tmp_path / "base.json", _gemm_rows())
    better = _results(tmp_path / "better.json", _gemm_rows(fused_ms=(0.8, 2.02)))  # -20%, +1% (within 5%)
    assert compare.main([str(base), str(better)]) == 0
    out = capsys.readouterr().out
    assert "better" in out and "-20.0%" in out and "1 better" in out and "1 same" in out and "REGRESSION" not in out


def test_compare_ratio_cancels_a_slower_machine_but_ms_does_not(tmp_path, capsys):
    base = _results(tmp_path / "base.json", _gemm_rows())
    slow = _results(tmp_path / "slow.json", _gemm_rows(fused_ms=(2.0, 4.0), cublas_ms=(1.8, 3.6)))  # all 2x slower
    assert compare.main([str(base), str(slow)]) == 0
    assert compare.main([str(base), str(slow), "--metric", "ms"]) == 1  # same device name: ms is judged
    out = capsys.readouterr().out
    assert "+100.0%" in out


def test_compare_reports_missing_and_new_rows(tmp_path, capsys):
    base_rows = _gemm_rows()
    cur_rows = _gemm_rows()[:2] + [_row("fused", 5.0, dict(model="llama3-70b", m=64, n=8192, k=3584)),
                                   _row("cublas", 5.0, dict(model="llama3-70b", m=64, n=8192, k=3584))]
    base = _results(tmp_path / "base.json", base_rows)
    cur = _results(tmp_path / "cur.json", cur_rows)
    assert compare.main([str(base), str(cur)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("missing", "new"))]
    assert sum(ln.startswith("missing") for ln in lines) == 2 and "m=512" in out
    assert sum(ln.startswith("new") for ln in lines) == 2 and "llama3-70b" in out
    assert compare.main([str(base), str(cur), "--fail-on-missing"]) == 1


def test_compare_refuses_absolute_times_across_devices(tmp_path, capsys):
    base = _results(tmp_path / "base.json", _gemm_rows(), device="NVIDIA H100 80GB HBM3")
    cur = _results(tmp_path / "cur.json", _gemm_rows(), device="NVIDIA H200")
    assert compare.main([str(base), str(cur), "--metric", "ms"]) == 2
    err = capsys.readouterr().err
    assert "refusing to compare absolute times across devices" in err and "H100" in err and "H200" in err
    assert compare.main([str(base), str(cur), "--metric", "ms", "--force"]) == 0
    assert compare.main([str(base), str(cur)]) == 0  # ratios are allowed, with a note
    assert "ratios compare" in capsys.readouterr().err


def test_compare_does_not_judge_anchor_rows_or_rows_without_a_ratio(tmp_path):
    rows = _gemm_rows()
    base = compare.load(_results(tmp_path / "base.json", rows))
    rows2 = _gemm_rows(fused_ms=(1.0, 2.0), cublas_ms=(0.9, 1.8))
    rows2.append(_row("symm_mem", 9.0, rows2[0]["shape"], anchor=None))
    cur = compare.load(_results(tmp_path / "cur.json", rows2))
    base.rows.append(_row("symm_mem", 1.0, rows2[0]["shape"], anchor=None))
    by = {c.key[1]: c.status for c in compare.compare(base, cur, metric="ratio")}
    assert by == {"cublas": "anchor", "fused": "same", "symm_mem": "n/a"}
    ms = {(c.key[1], c.status) for c in compare.compare(base, cur, metric="ms")}
    assert ("symm_mem", "worse") in ms


def test_compare_matches_rows_under_former_op_names(tmp_path, capsys):
    """A baseline from before the GEMM fusions' rename (``gemm_rs`` / ``linear_rs`` rows) still gates current rows."""

    def rows(kernel_op, projection_op, fused_ms):
        out = [dict(r, op=kernel_op) for r in _gemm_rows(fused_ms=fused_ms)]
        shape = dict(model="llama3-8b", m=64, n=4096, k=1792)
        anchor = "projection-unfused-8gpu"
        return out + [_row(anchor, 2.0, shape, op=projection_op, anchor=anchor),
                      _row("projection-fused-8gpu", 1.0, shape, op=projection_op, anchor=anchor)]

    base = _results(tmp_path / "base.json", rows("gemm_rs", "linear_rs", (1.0, 2.0)))
    cur = _results(tmp_path / "cur.json", rows("matmul_scatter", "matmul_reduce_scatter", (1.0, 2.3)))
    changes = compare.compare(compare.load(base), compare.load(cur))
    assert sorted(c.status for c in changes) == ["anchor", "anchor", "anchor", "same", "same", "worse"]  # none missing
    assert {c.key[0] for c in changes} == {"matmul_scatter", "matmul_reduce_scatter"}  # reported by current names
    assert compare.main([str(base), str(cur)]) == 1 and "+15.0%" in capsys.readouterr().out
    assert compare.RENAMED_OPS == {"linear_rs": "matmul_reduce_scatter", "linear_ag": "all_gather_matmul",
                                   "gemm_rs": "matmul_scatter", "ag_gemm": "gathered_matmul"}


def test_compare_unreadable_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    good = _results(tmp_path / "good.json", _gemm_rows())
    assert compare.main([str(bad), str(good)]) == 2
    assert "not a bench results file" in capsys.readouterr().err


def test_halo_native_rows_convert_with_ratios():
    base = dict(nd=2, batch=1, channels=16, extent=64, halo=1, dtype="float32", world_size=1)
    data = dict(meta=dict(device="NVIDIA H200"), rows=[
        dict(base, op="halo_conv", provider="copy", mode="stage", ms=1.0, ms_p20=0.9, ms_p80=1.1, gbs=4000.0),
        dict(base, op="halo_conv", provider="fused", mode="stage", ms=1.25, ms_p20=1.2, ms_p80=1.3, gbs=3200.0),
        dict(base, op="halo_conv", provider="distdl", mode="full", ms=4.0, ms_p20=4.0, ms_p80=4.0),
        dict(base, op="halo_conv", provider="fused", mode="full", ms=3.0, ms_p20=3.0, ms_p80=3.0)])
    rows = {(r.provider, r.mode): r for r in suites.halo_rows(data)}
    assert rows["fused", "stage"].ratio == pytest.approx(1.25) and rows["fused", "stage"].anchor == "copy"
    assert rows["fused", "full"].ratio == pytest.approx(0.75) and rows["fused", "full"].anchor == "distdl"
    assert rows["fused", "stage"].shape == dict(nd=2, batch=1, channels=16, extent=64, halo=1)
    assert rows["fused", "stage"].rate_unit == "GB/s" and rows["fused", "full"].rate is None


# ---------------------------------------------------------------- crossover extraction


def _pts(sizes, fused, unfused):
    return list(zip(sizes, fused, unfused))


def test_crossover_fused_wins_above_a_size_interpolated_in_log_size():
    # fused/unfused = (s / 1e9) ** -0.5: equal exactly at 1e9; log-gain is linear in log-size.
    sizes = [10.0**e for e in range(6, 13)]
    pts = _pts(sizes, [(s / 1e9) ** -0.5 for s in sizes], [1.0] * len(sizes))
    xo = tune.crossover(pts)
    assert xo.fused == "interval" and xo.max_size is None and xo.min_size == pytest.approx(1e9, rel=1e-9)
    # between measured points: 3e9 between 1e9 and 1e10
    sizes = [1e8, 1e9, 1e10, 1e11]
    xo = tune.crossover(_pts(sizes, [(s / 3e9) ** -0.5 for s in sizes], [1.0] * 4))
    assert xo.min_size == pytest.approx(3e9, rel=1e-9)
    assert not xo.fused_at(2.9e9) and xo.fused_at(3.1e9) and xo.fused_at(1e15)
    assert xo.entry() == {"fused": "interval", "min_size": pytest.approx(3e9)}


def test_crossover_fused_wins_below_a_size():
    # fused wins below a size
    pts = _pts([8, 16, 32, 64, 128, 256], [1, 1, 1, 1.2, 1.5, 2.0], [1.3, 1.3, 1.2, 1.0, 1.0, 1.0])
    xo = tune.crossover(pts)
    assert xo.min_size is None and 32 < xo.max_size < 64
    assert xo.entry().keys() == {"fused", "max_size"}


def test_crossover_middle_interval_always_never():
    xo = tune.crossover(_pts([1, 2, 4, 8, 16], [2, 1, 1, 1, 2], [1, 2, 2, 2, 1]))
    assert xo.fused == "interval" and 1 < xo.min_size < 2 and 8 < xo.max_size < 16
    xo = tune.crossover(_pts([1, 2, 4], [1, 1, 1], [2, 2, 2]))
    assert xo.fused == "always" and xo.entry() == {"fused": "always"} and xo.fused_at(1e30)
    xo = tune.crossover(_pts([1, 2, 4], [2, 2, 2], [1, 1, 1]))
    assert xo.fused == "never" and not xo.fused_at(2) and xo.entry() == {"fused": "never", "max_size": -1.0}


def test_crossover_tolerates_noise():
    # one noisy loss inside the winning region does not split it ...
    xo = tune.crossover(_pts([1, 2, 4, 8, 16, 32], [2, 2, 1, 1.05, 1, 1], [1, 1, 2, 1, 2, 2]))
    assert xo.fused == "interval" and 2 < xo.min_size < 4 and xo.max_size is None and xo.fused_at(8)
    # ... and an isolated noisy win outside it is reported, not turned into a second interval
    xo = tune.crossover(_pts([1, 2, 4, 8, 16, 32], [0.95, 2, 2, 1, 1, 1], [1, 1, 1, 2, 2, 2]))
    assert 4 < xo.min_size < 8 and xo.excluded_wins == (1.0,) and not xo.fused_at(1)
    assert xo.entry()["excluded_wins"] == [1.0]


def test_crossover_margin_and_repeated_sizes():
    pts = _pts([1, 2, 4], [1, 1, 0.5], [1.02, 1.02, 1.0])
    assert tune.crossover(pts).fused == "always"  # 2% wins count without a margin
    xo = tune.crossover(pts, margin=0.05)
    assert xo.fused == "interval" and 2 < xo.min_size < 4
    # two shapes of one size: their log-gains are averaged (here: +log 2 and -log 1.5 -> a win)
    xo = tune.crossover([(1, 1.0, 2.0), (1, 1.5, 1.0), (2, 2.0, 1.0)])
    assert xo.wins == (1.0,) and xo.max_size is not None and 1 < xo.max_size < 2
    with pytest.raises(ValueError, match="no point"):
        tune.crossover([(1, None, 1.0)])


# ---------------------------------------------------------------- table: written by the tuner, read by dispatch


BIG = dict(m=8192, n=4096, k=1792)  # 6.0e10 MACs
SMALL = dict(m=64, n=4096, k=1792)  # 4.7e8 MACs


def _linear_points(threshold):
    sizes = [4.7e8, 3.8e9, 3.0e10, 1.2e11]
    return [dict(size=s, fused_ms=(s / threshold) ** -0.3, unfused_ms=1.0) for s in sizes]


def test_table_round_trip_through_select_path(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "crossover.json"
    key_rs = table_key("NVIDIA H200", 8, torch.bfloat16, "matmul_reduce_scatter")
    key_halo = table_key("NVIDIA H200", 4, torch.float32, "halo_conv")
    key_ag = table_key("NVIDIA H200", 8, torch.bfloat16, "all_gather_matmul")
    halo_pts = [dict(size=e, fused_ms=1.0, unfused_ms=1.4 if e <= 2**15 else 0.9)  # elements a block
                for e in (2**13, 2**14, 2**15, 2**16, 2**17)]
    ag_never = [dict(size=s, fused_ms=2.0, unfused_ms=1.0) for s in (1e8, 1e9)]
    entries = {key_rs: tune.entry_for("matmul_reduce_scatter", _linear_points(1e10), mode="full"),
               key_halo: tune.entry_for("halo_conv", halo_pts),
               key_ag: tune.entry_for("all_gather_matmul", ag_never)}
    configs = {key_rs: {"matmul_scatter": [dict(key=[8192, 4096, 1792, "torch.bfloat16"], kwargs=dict(BLOCK_M=128),
                                                num_warps=8, num_stages=3)]}}
    # another device's entry already in the file is kept
    path.parent.mkdir(parents=True)
    other = table_key("NVIDIA A100-SXM4-80GB", 8, torch.bfloat16, "matmul_reduce_scatter")
    path.write_text(json.dumps({other: {"min_size": 1.0}}))
    tune.write_table(path, entries, triton_configs=configs, run_meta={"NVIDIA H200|8": dict(triton="3.6.0")})
    table = json.loads(path.read_text())
    assert other in table and table["triton_configs"] == configs and table["_meta"]["written_by"] == "distfuse-tune"
    assert 1e10 * 0.999 < table[key_rs]["min_size"] < 1e10 * 1.001 and table[key_rs]["size_key"] == "macs"

    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    d = select_path("matmul_reduce_scatter", BIG, torch.bfloat16, 8, H200)
    assert d.path == "fused" and "crossover table" in d.reason
    assert select_path("matmul_reduce_scatter", SMALL, torch.bfloat16, 8, H200).path == "unfused"
    # the halo entry: fused at or below 2^15-2^16 elements a block
    assert select_path("halo_conv", dict(elements=2**15), torch.float32, 4, H200).path == "fused"
    assert select_path("halo_conv", dict(elements=2**16), torch.float32, 4, H200).path == "unfused"
    # "never" holds even for the largest GEMM (the default would say fused)
    assert select_path("all_gather_matmul", dict(m=2**20, n=2**12, k=2**12), torch.bfloat16, 8, H200).path == "unfused"
    # keys the sweep did not write fall back to the defaults
    assert "default" in select_path("matmul_reduce_scatter", BIG, torch.bfloat16, 4, H200).reason

    # DISTFUSE_PATH overrides the table both ways
    monkeypatch.setenv("DISTFUSE_PATH", "unfused")
    assert select_path("matmul_reduce_scatter", BIG, torch.bfloat16, 8, H200).path == "unfused"
    monkeypatch.setenv("DISTFUSE_PATH", "fused")
    d = select_path("matmul_reduce_scatter", SMALL, torch.bfloat16, 8, H200)
    assert d.path == "fused" and d.reason == "DISTFUSE_PATH=fused"
    monkeypatch.setenv("DISTFUSE_PATH", "auto")
    assert select_path("matmul_reduce_scatter", SMALL, torch.bfloat16, 8, H200).path == "unfused"
    assert load_table(path)[key_rs]["fused"] == "interval"


def test_write_table_moves_entries_under_former_op_names(tmp_path):
    """Rewriting a table tuned before the rename keys its entries and sections by the current op names; the
    autotuner configs saved under the launchers' former names still seed the current autotuners."""
    import triton

    def key(op):
        return table_key("NVIDIA H200", 8, torch.bfloat16, op)

    cfg = dict(key=[1, 64, 4096, 1792, "torch.bfloat16"], kwargs=dict(BLOCK_M=64), num_warps=4, num_stages=3)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({key("linear_rs"): {"min_size": 1.0}, key("linear_ag"): {"max_size": -1.0},
                                "triton_configs": {key("linear_rs"): {"gemm_rs": [cfg], "ag_gemm_fp32": [cfg]}},
                                "sweeps": {key("linear_ag"): {"size_key": "macs", "points": []}},
                                "_meta": {"runs": {"NVIDIA H200|8": {"triton": triton.__version__}}}}))
    tune.write_table(path, {key("matmul_reduce_scatter"): {"min_size": 2.0}})
    table = json.loads(path.read_text())
    assert "linear_rs" not in path.read_text() and "linear_ag" not in path.read_text()
    assert table[key("matmul_reduce_scatter")] == {"min_size": 2.0}  # the entry under the current name wins
    assert table[key("all_gather_matmul")] == {"max_size": -1.0}
    assert list(table["triton_configs"]) == [key("matmul_reduce_scatter")]
    assert list(table["sweeps"]) == [key("all_gather_matmul")]
    tuners = {"matmul_scatter": _FakeTuner(), "gathered_matmul_fp32": _FakeTuner()}
    assert tune.seed_autotune_caches(table, "NVIDIA H200", 8, torch.bfloat16, tuners=tuners) == 2
    assert all(len(t.cache) == 1 for t in tuners.values())


def test_write_table_rejects_a_section_as_entry(tmp_path):
    with pytest.raises(ValueError, match="not a table key"):
        tune.write_table(tmp_path / "t.json", {"triton_configs": {}})


class _FakeTuner:
    def __init__(self, cache=None):
        self.cache = dict(cache or {})


def test_triton_configs_harvest_and_seed(tmp_path, monkeypatch):
    import triton

    old = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8), num_warps=4, num_stages=3)
    new = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8), num_warps=8, num_stages=3)
    tuner = _FakeTuner({(1, 64, 4096, 1792, "torch.bfloat16"): old})
    before = autotune_cache.cache_keys({"matmul_scatter": tuner})
    tuner.cache[(1, 8192, 4096, 1792, "torch.bfloat16")] = new
    got = tune.harvest_autotune_caches({"matmul_scatter": tuner}, before)
    assert got == {"matmul_scatter": [dict(key=[1, 8192, 4096, 1792, "torch.bfloat16"], kwargs=new.kwargs, num_warps=8,
                                    num_stages=3)]}
    key = table_key("NVIDIA H200", 8, torch.bfloat16, "matmul_reduce_scatter")
    path = tune.write_table(tmp_path / "t.json", {}, triton_configs={key: got},
                            run_meta={"NVIDIA H200|8": dict(triton=triton.__version__)})
    table = json.loads(path.read_text())
    fresh = _FakeTuner()
    assert tune.seed_autotune_caches(table, "NVIDIA H200", 8, torch.bfloat16, tuners={"matmul_scatter": fresh}) == 1
    cfg = fresh.cache[(1, 8192, 4096, 1792, "torch.bfloat16")]
    assert (cfg.kwargs, cfg.num_warps, cfg.num_stages) == (new.kwargs, 8, 3)
    # without a table argument it reads the table where dispatch looks, sections included
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    assert tune.seed_autotune_caches(None, "NVIDIA H200", 8, torch.bfloat16,
                                     tuners={"matmul_scatter": _FakeTuner()}) == 1
    # another device, or a table from another Triton version: nothing is seeded
    assert tune.seed_autotune_caches(table, "NVIDIA A100", tuners={"matmul_scatter": _FakeTuner()}) == 0
    table["_meta"]["runs"]["NVIDIA H200|8"]["triton"] = "0.0.1"
    assert tune.seed_autotune_caches(table, tuners={"matmul_scatter": _FakeTuner()}) == 0


# ---------------------------------------------------------------- the tuner on gloo ranks (CPU: unfused only)


def _tune_rank(out: str):
    import torch.distributed as dist

    args = tune.parse_args(["--quick", "--out", out, "--no-progress", "--reps", "2"])
    res = tune.run(args)
    return dist.get_rank(), res.device_name, sorted(res.entries), sorted(res.sweeps)


def test_tune_on_gloo_ranks_times_unfused_only_and_writes_no_fused_entries(tmp_path):
    out = tmp_path / "crossover.json"
    results = run_ranks(2, _tune_rank, str(out))
    assert [r[0] for r in results] == [0, 1]
    rank0 = results[0]
    assert rank0[1] == "cpu" and rank0[2] == []
    assert rank0[3] == sorted(table_key("cpu", 2, torch.float32, op) for op in registry.names())
    table = json.loads(out.read_text())
    assert not [k for k in table if "|" in k]  # no crossover entries from a CPU sweep
    for key, sw in table["sweeps"].items():
        op = key.split("|")[-1]
        assert len(sw["points"]) == len(tune.default_grid(op, 2, quick=True))
        assert all(p["fused_ms"] is None and p["unfused_ms"] > 0 for p in sw["points"])
    notes = table["_meta"]["runs"]["cpu|2"]["notes"]
    assert len(notes) == len(registry.names()) and all("interpreter" in n for n in notes)


def test_default_grids_match_dispatch_sizes():
    for op in registry.names():
        for shape in tune.default_grid(op, 8):
            assert tune.size_of(op, shape) > 0
    rs = tune.default_grid("matmul_reduce_scatter", 8)
    assert rs[0] == dict(m=64, n=4096, k=14336 // 8)  # per-rank GEMM of the down projection
    assert cases.split(8, 2) == (2, 4) and cases.split(12, 2) == (3, 4) and cases.split(8, 3) == (2, 2, 2)
    # the command line's shape options reach the grids (each grid takes the ones that apply)
    assert [s["channels"] for s in tune.default_grid("halo_conv", 4, channels=[3, 5], m=[7])] == [3, 5]
    assert tune.default_grid("halo_conv", 4, quick=True, nd=3)[0]["nd"] == 3
    assert [s["m"] for s in tune.default_grid("all_gather_matmul", 4, m=[7], channels=[3])] == [7]


def test_registry_entries_are_complete_and_drive_the_tuner():
    """Every op: a size key, resolvable factories, a default with its reason; the tuner's --ops are the registry's."""
    assert registry.names() == ("matmul_reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter_features",
                                "all_gather_features_matmul", "matmul_all_reduce", "zero_linear_rows",
                                "zero_linear_columns", "halo_conv", "ring_attention")
    assert not set(registry.RENAMED) & set(registry.names())
    for op in registry.names():
        spec = registry.get(op)
        assert spec.size_key and spec.size_inputs and spec.default.why
        for ref in (spec.case, spec.grid) + ((spec.available,) if spec.available else ()):
            assert callable(registry.resolve(ref)), (op, ref)
        assert spec.size_of(dict.fromkeys(spec.size_inputs, 3)) == 3.0 ** len(spec.size_inputs)
    assert tune.parse_args([]).ops == list(registry.names())
    with pytest.raises(SystemExit):
        tune.parse_args(["--ops", "no_such_op"])
    with pytest.raises(KeyError, match="unknown op"):
        registry.get("no_such_op")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("halo_conv"))


def test_a_registry_entry_is_all_the_tuner_needs(monkeypatch):
    """A new op (here: the halo conv's factories under another name) is known to --ops, the grids and entries."""
    toy = registry.FusedOp("toy_conv", "chans", ("channels",), registry.DefaultRule.never("untested"),
                           case=cases.halo_case, grid=cases.halo_grid)
    monkeypatch.setitem(registry.OPS, "toy_conv", toy)
    assert "toy_conv" in tune.parse_args(["--ops", "toy_conv"]).ops
    assert tune.default_grid("toy_conv", 2, quick=True) == tune.default_grid("halo_conv", 2, quick=True)
    entry = tune.entry_for("toy_conv", [dict(size=s, fused_ms=1.0, unfused_ms=2.0) for s in (1, 2)])
    assert entry["size_key"] == "chans" and entry["fused"] == "always"


def test_one_timer_for_bench_and_tuner():
    """bench/harness.py re-exports distfuse.timing; the sweep times through it (no copy of the timer left)."""
    from bench import harness

    assert harness.time_fn is timing.time_fn and harness.time_samples is timing.time_samples
    assert harness.summarize is timing.summarize and harness.time_interleaved is timing.time_interleaved
    assert sweeper.time_samples is timing.time_samples
    calls = []
    times = timing.time_samples(timing.rotating(calls.append, 3), warmup=2, reps=5, device=torch.device("cpu"))
    assert len(times) == 5 and all(t >= 0 for t in times) and calls == [0, 1, 2, 0, 1, 2, 0]
    assert timing.summarize([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, pytest.approx(1.8), pytest.approx(4.2))
    assert timing.summarize([2.0]) == (2.0, 2.0, 2.0) and timing.median([1.0, 2.0, 4.0, 8.0]) == 3.0
    assert timing.rotations(10**9, torch.device("cpu")) == 1
    with pytest.raises(ValueError):
        timing.summarize([])


class _FakeEvent:
    """A CUDA event stand-in that logs what the timer does, in order, and whose clock is the log's length."""

    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = len(self.log)
        self.log.append("record")

    def synchronize(self):
        self.log.append("sync")

    def elapsed_time(self, end):
        return float(end.at - self.at)


def test_cuda_runs_are_issued_back_to_back_and_read_after_one_synchronise(monkeypatch):
    """The CUDA timer of one process: each run after its flush and between its own two events, no synchronise until
    the last run is issued, then one (a synchronise per run would time cold calls: ``synced=True``)."""
    log = []
    monkeypatch.setattr(_FakeEvent, "log", log)
    calls = []

    def fn():
        calls.append(len(calls))
        log.extend(["fn"] * (len(calls)))  # run i takes i ticks between its events

    times = timing.issued_back_to_back(fn, 3, lambda: log.append("flush"), _FakeEvent)
    assert log == ["flush", "record", "fn", "record", "flush", "record", "fn", "fn", "record",
                   "flush", "record", "fn", "fn", "fn", "record", "sync"]
    assert times == [2.0, 3.0, 4.0] and calls == [0, 1, 2]  # a run's own events: never a flush between them
    assert timing.issued_back_to_back(fn, 0, lambda: None, _FakeEvent) == []
    # CPU: both ways are perf_counter around each run
    assert len(timing.time_samples(lambda: None, warmup=0, reps=3, device=torch.device("cpu"), synced=True)) == 3


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["distfuse-tune"] == "distfuse.tune:main"
    assert callable(tune.main)


def test_python_dash_m_distfuse_tune():
    proc = subprocess.run([sys.executable, "-m", "distfuse.tune", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "distfuse-tune" in proc.stdout and "halo_conv" in proc.stdout, proc.stderr


# ---------------------------------------------------------------- the suite runner


def _fake_rows(opts):
    rows = []
    for m in (8, 16, 32):
        for prov, ms in (("fused", 1.0 + m / 32), ("unfused", 1.2 + m / 64), ("anchor", 1.0)):
            rows.append(Row(op="fake_op", provider=prov, mode="fwd", shape=dict(m=m, n=4, k=4),
                            dtype=suites.dtype_name(opts.dtype), world_size=opts.world_size, ms=ms, ms_q20=ms,
                            ms_q80=ms))
    from bench.harness import add_ratios

    add_ratios(rows, "anchor")
    return suites.SuiteResult(rows, "ok", "fake", {"fake_op": dict(fused="fused", unfused="unfused",
                                                                   anchor="anchor")})


@pytest.fixture
def fake_suites(monkeypatch):
    registry = dict(suites.SUITES)
    monkeypatch.setattr(suites, "SUITES", registry)
    registry["fake"] = suites.Suite("fake", "synthetic rows", _fake_rows)

    def must_not_run(opts):
        raise AssertionError("a GPU-only suite ran without CUDA and without --smoke")

    def broken(opts):
        raise RuntimeError("suite exploded")

    registry["fake_gpu"] = suites.Suite("fake_gpu", "GPU only", must_not_run, gpu_only=True, single_process=True)
    registry["fake_broken"] = suites.Suite("fake_broken", "raises", broken)
    monkeypatch.setattr(suites, "has_cuda", lambda: False)
    return registry


def test_run_writes_rows_env_and_roles_then_compare_and_plot(fake_suites, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert bench_cli.main(["run", "fake", "--out", str(out), "--world-size", "2", "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 9 and data["smoke"] is False
    env = data["env"]
    for k in ("device", "torch", "triton", "distfuse", "commit", "date"):
        assert k in env
    assert env["suites"]["fake"]["status"] == "ok" and env["roles"]["fake_op"]["unfused"] == "unfused"
    r = next(r for r in data["rows"] if r["provider"] == "fused" and r["shape"]["m"] == 32)
    assert r["ratio"] == pytest.approx(2.0) and r["world_size"] == 2 and r["dtype"] == "float32"
    assert compare.main([str(out), str(out)]) == 0
    png = plot.plot(out, tmp_path / "res.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_only_suite_is_skipped_on_cpu_and_failures_exit_1(fake_suites, tmp_path, capsys):
    assert bench_cli.main(["run", "fake_gpu", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[fake_gpu] skipped" in out and "needs a CUDA GPU" in out and "no rows to write" in out
    assert not list(tmp_path.glob("*.json"))
    assert bench_cli.main(["run", "fake_broken", "--out", str(tmp_path), "--no-progress"]) == 1
    assert "suite exploded" in capsys.readouterr().err


def test_plot_panels_and_crossover(tmp_path):
    rows = []
    for c in (8, 16, 32, 64, 128):
        for prov, ms in (("fused", 1.0), ("distdl", 1.5 if c <= 32 else 0.8), ("copy", 0.5)):
            for extent in (64, 128):
                rows.append(_row(prov, ms * extent / 64, dict(nd=2, channels=c, extent=extent, halo=1),
                                 op="halo_conv", anchor="copy", mode="full", dtype="float32", world_size=1))
    ps = plot.panels(rows)
    assert len(ps) == 2 and all(p["xlabel"] == "channels" for p in ps)  # one panel per extent
    roles = plot.roles_for("halo_conv", set(ps[0]["series"]), {"halo_conv": dict(unfused="distdl")}, {"copy"})
    assert roles == dict(fused="fused", unfused="distdl", anchor="copy")
    xo = plot.crossover_of(ps[0]["series"], roles)
    assert xo.min_size is None and 32 < xo.max_size < 64
    path = _results(tmp_path / "halo.json", rows)
    png = plot.plot(path)
    assert png == path.with_suffix(".png") and png.stat().st_size > 10_000


def test_smoke_run_of_a_cpu_suite_from_the_command_line(tmp_path):
    """``python -m bench run conv_layers --smoke`` end to end (forked gloo ranks, tiny shapes)."""
    out = tmp_path / "conv.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "conv_layers", "--smoke", "--world-size", "2",
                           "--out", str(out), "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["env"]["device"] == "cpu"
    provs = {r["provider"] for r in data["rows"]}
    assert {"distfuse", "cat"} <= provs
    assert all(r["ratio"] is not None and math.isfinite(r["ratio"]) for r in data["rows"])
    assert compare.main([str(out), str(out)]) == 0


def test_gemm_wrapper_rows_match_its_roles():
    """The one-GPU gemm wrapper's plumbing, run on CPU under the interpreter at a tiny shape (times mean nothing)."""
    opts = suites.RunOptions(world_size=2, progress=False)
    rows = suites.gemm_sweep(opts, torch.device("cpu"), {"tiny": (16, 48)}, (10,), reps=1)
    roles = suites._gemm_roles(2)
    by_op: dict = {}
    for r in rows:
        by_op.setdefault(r.op, set()).add(r.provider)
        assert "case_peak_mem_mb" in r.extra and r.world_size == 2
    assert set(by_op) == set(roles)
    for op, provs in by_op.items():
        assert {p for p in roles[op].values()} <= provs, (op, roles[op], provs)
    assert all(r.ratio is not None for r in rows if r.provider == "fused")


# ---------------------------------------------------------------- the tuner's fused cases, on CPU (plumbing only)


def _tune_cases_rank():
    """Both paths of every op agree (so the sweep times the same work), and the forced halo path is the one run."""
    import torch.distributed as dist

    from distfuse import Partition

    W = dist.get_world_size()
    P_sub = Partition.world().create_partition_inclusive(range(W)).create_cartesian_topology_partition([1, W, 1])
    dev, out = torch.device("cpu"), {}
    ctx = cases.CaseContext(torch.float32, dev, W, range(W), P_sub, full=True, fused_ok=True)
    for op in ("matmul_reduce_scatter", "all_gather_matmul"):
        shape = dict(m=6, n=8, k=8) if op == "matmul_reduce_scatter" else dict(m=7, n=8, k=8)  # m: an uneven split
        case = cases.linear_case(op, shape, ctx)
        out[op] = bool(torch.allclose(case.fused(0), case.unfused(0), **tol(torch.float32, terms=shape["k"])))
    case = cases.halo_case("halo_conv", dict(channels=2, extent=4, nd=2, kernel=3, batch=1), ctx)
    yf = case.fused(0).detach().clone()
    out["halo_fused_ran"] = case.check("fused")
    yu = case.unfused(0).detach()
    out["halo_unfused_ran"] = case.check("unfused")
    out["halo_agree"] = bool(torch.allclose(yf, yu, **tol(torch.float32, terms=2 * 3 * 3)))  # C * kernel taps
    # the whole sweep with the fused path allowed (interpreted on CPU: plumbing, not a measurement)
    real = sweeper.fused_available
    sweeper.fused_available = lambda *a: (True, "")
    try:
        res = tune.sweep(["matmul_reduce_scatter"], [torch.float32], full=False, warmup=0, reps=1, progress=False,
                         grid=lambda op, w: tune.default_grid(op, w, quick=True))
    finally:
        sweeper.fused_available = real
    out["entries"] = res.entries
    return out


def test_tuner_cases_time_equal_work_and_force_the_path():
    res = run_ranks(2, _tune_cases_rank)
    for r in res:
        assert r["matmul_reduce_scatter"] and r["all_gather_matmul"] and r["halo_agree"]
        assert r["halo_fused_ran"] is None and r["halo_unfused_ran"] is None
    entries = res[0]["entries"]
    key = table_key("cpu", 2, torch.float32, "matmul_reduce_scatter")
    assert list(entries) == [key] and res[1]["entries"] == {}
    e = entries[key]
    assert e["fused"] in ("interval", "always", "never") and e["size_key"] == "macs" and e["mode"] == "fwd"
    assert len(e["points"]) == 2 and all(f > 0 and u > 0 for _, f, u in e["points"])


def test_halo_conv_graph_rows_check_the_replay_against_the_eager_step():
    """The halo bench's whole-step graph rows (mode ``full_graph``) say whether the replay gave the eager step's
    results (``_same_step``): two steps on the same inputs agree, a step with one tensor off by more than a few
    roundings of its largest element does not, and neither does a step missing a gradient."""
    import os

    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the fused step runs the halo kernels: interpreted on CPU")
    from bench.bench_halo_conv import ANCHORS, Case, _halo_inputs, _same_step, full_step

    assert ANCHORS["full_graph"] == "cat"
    case = Case(2, 1, 3, 5, 1, torch.float32, "cpu")
    for provider in ("fused", "cat"):
        a, b = (full_step(case, provider, case.x, _halo_inputs(case, provider), case.weight, case.bias)
                for _ in range(2))
        assert _same_step(a, b), provider
        off = a[2].clone()
        off.view(-1)[0] += 1e-2 * a[2].abs().max()
        assert not _same_step(a[:2] + (off,) + a[3:], b), provider
        assert not _same_step(a[:3] + (None,) + a[4:], b), provider


def test_a_result_file_records_the_settings_it_ran_under(monkeypatch):
    """Every result file's ``env`` names the ``DISTFUSE_*`` settings of its run (the lab's timeout and autotuning, a
    launch path its canary switched off), the commit apart; nothing else from the environment."""
    from bench.harness import environment

    monkeypatch.setenv("DISTFUSE_FAST_LAUNCH", "0")
    monkeypatch.setenv("DISTFUSE_COMMIT", "abc1234")
    monkeypatch.setenv("NOT_DISTFUSE_X", "1")
    env = environment()
    assert env["settings"]["DISTFUSE_FAST_LAUNCH"] == "0" and env["commit"] == "abc1234"
    assert "DISTFUSE_COMMIT" not in env["settings"] and all(k.startswith("DISTFUSE_") for k in env["settings"])
