"""The projected crossover table: the generator on synthetic lab rows, the 10% rule, margins, and the shipped file.

The model is restated here from ``distfuse/tune/project.py``'s docstring (NVLink 4: NCCL
bus bandwidth 360 GB/s nominal / 450 pessimistic, 12 / 6 us; fused stores 360 / 270 GB/s,
signalling 6 / 12 us; kernel noise 3%), so that a change of the model or its figures shows
up as a failing expected number, not only as a different shipped file.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from distfuse.fused import registry
from distfuse.fused.crossover_table import SHIPPED, check_entry, load_table, table_key
from distfuse.tune import project
from distfuse.tune.project import OP_MODELS, Point, project_table, qualifying_interval

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
RS, AG = registry.MATMUL_REDUCE_SCATTER.name, registry.ALL_GATHER_MATMUL.name
M, N, K = 8192, 4096, 1792  # LLaMA-3 8B down projection at TP 8 (per rank)
S = M * N * 2  # bf16 partial [m, n]


def _row(op, provider, ms, shape, *, q=None, dtype="bfloat16", world=8, mode="fwd", anchor=None):
    lo, hi = q if q is not None else (ms, ms)
    return dict(op=op, provider=provider, mode=mode, shape=dict(shape), dtype=dtype, world_size=world, ms=ms,
                ms_q20=lo, ms_q80=hi, anchor=anchor)


def _rs_rows(cublas, gemm, reduce, *, m=M, n=N, k=K, persistent=None, dtype="bfloat16"):
    shape = dict(model="t", m=m, n=n, k=k)
    rows = [_row("matmul_scatter", "cublas", cublas, shape, dtype=dtype, anchor="cublas"),
            _row("matmul_scatter", "fused", gemm, shape, dtype=dtype, anchor="cublas"),
            _row("chunk_reduce", "copy", reduce / 4, dict(shape, bytes=1), dtype=dtype, anchor="copy"),
            _row("chunk_reduce", "fused", reduce, dict(shape, bytes=1), dtype=dtype, anchor="copy")]
    if persistent is not None:
        rows.append(_row("matmul_scatter", "triton_persistent", persistent, shape, dtype=dtype, anchor="cublas"))
    return rows


def _write(tmp_path, rows, device=H100, name="gemm_fused-test.json", date="2026-12-01T00:00:00+00:00"):
    (tmp_path / name).write_text(json.dumps(dict(env=dict(device=device, date=date, commit="abc"), rows=rows)))
    return tmp_path


# ---------------------------------------------------------------- the model, restated


def _rs_expected(cublas, gemm, reduce, w=8, nbytes=S, scale=1.0):
    frac = (w - 1) / w
    unfused = cublas + (12e-6 + frac * nbytes / 360e9) * 1e3
    fused = max(gemm, frac * nbytes / 360e9 * 1e3) + reduce * scale + 6e-3
    p_unfused = cublas * 0.97 + (6e-6 + frac * nbytes / 450e9) * 1e3
    p_fused = max(gemm * 1.03, frac * nbytes / 270e9 * 1e3) + reduce * scale * 1.03 + 12e-3
    gain, pess = unfused / fused - 1, p_unfused / p_fused - 1
    return gain, gain - pess, fused, unfused


def test_reduce_scatter_gain_and_margin_follow_the_stated_model(tmp_path):
    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02))
    table = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])
    e = table[table_key(H100, 8, torch.bfloat16, RS)]
    gain, margin, fused, unfused = _rs_expected(0.2, 0.21, 0.02)
    size = float(M * N * K)
    assert e["source"] == "projected" and e["size_key"] == "macs" and e["mode"] == "fwd" and e["min_gain"] == 0.1
    assert e["gains"] == [[size, pytest.approx(gain, abs=1e-4), pytest.approx(margin, abs=1e-4)]]
    assert e["points"] == [[size, pytest.approx(fused, rel=1e-4), pytest.approx(unfused, rel=1e-4)]]
    assert gain > 0.5 and 0 < margin < gain  # qualifies: one size, so fused everywhere
    assert e["fused"] == "always" and "min_size" not in e and "max_size" not in e
    assert (e["gain"], e["margin"]) == (pytest.approx(gain, abs=1e-4), pytest.approx(margin, abs=1e-4))
    assert e["kernels"] == dict(file="gemm_fused-test.json", device=H100, date="2026-12-01T00:00:00+00:00",
                                dtype="bfloat16", world_size=8, commit="abc", anchor="cublas")
    check_entry("t", "k", e)


def test_the_cublas_whole_gemm_schedule_is_projected_serial(tmp_path):
    """At M = 512 and W = 8 (64-row chunks) the cuBLAS provider's row timed its GEMM then its scatter: only the
    scatter (the row less cuBLAS's GEMM) meets the wire; at M = 8192 (per-chunk GEMMs into the peers' slots) the
    row overlaps it, as the Triton producers' do."""
    for m, whole in ((512, True), (8192, False)):
        rows = _rs_rows(0.2, 0.5, 0.02, m=m) + [
            _row("matmul_scatter", "cublas_chunks", 0.203, dict(model="t", m=m, n=N, k=K), anchor="cublas")]
        _write(tmp_path, rows, name=f"m{m}.json", date=f"2026-12-0{1 + whole}T00:00:00+00:00")
        e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[
            table_key(H100, 8, torch.bfloat16, RS)]
        (tmp_path / f"m{m}.json").unlink()
        wire = 7 / 8 * m * N * 2 / 360e9 * 1e3
        want = (0.2 + max(0.003, wire) if whole else max(0.203, wire)) + 0.02 + 6e-3
        assert wire > 0.003, "the wire outlasts the scatter: serial and overlapped differ"
        got = e.get("provider_sizes", [[None, "cublas_chunks"]])
        assert e["points"][0][1] == pytest.approx(want, rel=1e-4), (m, got)


def test_chunk_reduce_is_scaled_by_the_bytes_at_each_world_size(tmp_path):
    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02))
    table = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[2, 4], dtypes=["bfloat16"])
    for w in (2, 4):
        scale = ((w + 1) / w) / (9 / 8)  # (W+1)/W of S read and written, measured at W = 8
        gain, margin, _, _ = _rs_expected(0.2, 0.21, 0.02, w=w, scale=scale)
        got = table[table_key(H100, w, torch.bfloat16, RS)]["gains"][0]
        assert got[1:] == [pytest.approx(gain, abs=1e-4), pytest.approx(margin, abs=1e-4)], w


@pytest.mark.parametrize("gemm, reduce, q, want", [
    (0.21, 0.02, None, "always"),            # +59%, the pessimistic end still wins
    (0.36, 0.005, None, "never"),             # +1.4%: under 10%
    (0.30, 0.02, (0.2, 0.9), "never"),        # +15%, but the fused GEMM's q80 makes the pessimistic end lose
], ids=["wins", "under-10-percent", "margin-eats-the-gain"])
def test_the_ten_percent_rule_and_the_margin(tmp_path, gemm, reduce, q, want):
    rows = _rs_rows(0.2, gemm, reduce)
    if q is not None:
        rows[1] = _row("matmul_scatter", "fused", gemm, dict(model="t", m=M, n=N, k=K), q=q, anchor="cublas")
    _write(tmp_path, rows)
    e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[
        table_key(H100, 8, torch.bfloat16, RS)]
    assert e["fused"] == want, e["gains"]
    if want == "never":
        assert e["max_size"] == -1.0 and "min_size" not in e
        g, m = e["gains"][0][1:]
        assert g < 0.10 or g - m <= 0


def _pt(size, gain, margin=0.0):
    return Point(size, gain, margin, 1.0, 1.0 + gain, "triton", {"triton": 1.0})


def test_qualifying_interval_takes_the_best_run_and_bounds_it_on_evaluated_sizes():
    pts = [_pt(1, -0.2), _pt(10, 0.15), _pt(100, 0.3), _pt(1000, 0.05), _pt(10000, 0.2)]
    assert qualifying_interval(pts) == ("interval", 10, 100)  # 10000 qualifies too, alone: a smaller run
    assert qualifying_interval([_pt(1, 0.2), _pt(10, 0.3)]) == ("always", None, None)
    assert qualifying_interval([_pt(1, 0.2), _pt(10, 0.05)]) == ("interval", None, 1)
    assert qualifying_interval([_pt(1, 0.05), _pt(10, 0.2)]) == ("interval", 10, None)
    assert qualifying_interval([_pt(1, 0.5, margin=0.6)]) == ("never", None, None)  # gain - margin <= 0
    assert qualifying_interval([_pt(1, 0.10)]) == ("always", None, None)  # "at least 10%": inclusive
    assert qualifying_interval([_pt(1, 0.0999)]) == ("never", None, None)
    assert qualifying_interval([_pt(1, 0.2)], min_gain=0.25) == ("never", None, None)


def test_interval_entry_quotes_its_weakest_point_and_the_fastest_provider(tmp_path):
    rows = _rs_rows(0.2, 0.21, 0.02, persistent=0.19)  # a big GEMM: persistent wins, fused
    rows += _rs_rows(0.004, 0.02, 0.01, m=128)  # a decode GEMM: loses (launch-bound fused kernels)
    _write(tmp_path, rows)
    e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[
        table_key(H100, 8, torch.bfloat16, RS)]
    small, big = float(128 * N * K), float(M * N * K)
    assert e["fused"] == "interval" and e["min_size"] == big and "max_size" not in e
    assert [g[0] for g in e["gains"]] == [small, big] and e["gains"][0][1] < 0
    assert e["gain"] == e["gains"][1][1]  # the smallest gain inside the interval
    assert e["provider_sizes"] == [[small, "triton"], [big, "triton_persistent"]]


def test_all_gather_model_and_the_copy_engine_overlap(tmp_path):
    shape = dict(model="t", m=M, n=K, k=N)
    rows = [_row("gathered_matmul", "cublas", 0.2, shape), _row("gathered_matmul", "fused", 0.21, shape),
            _row("ag_push", "copy", 0.01, dict(shape, bytes=1)), _row("ag_push", "fused", 0.03, dict(shape, bytes=1)),
            _row("ag_push", "copy_engine", 0.05, dict(shape, bytes=1))]
    _write(tmp_path, rows)
    e = project_table(tmp_path, devices=[H100], ops=[AG], world_sizes=[8], dtypes=["bfloat16"])[
        table_key(H100, 8, torch.bfloat16, AG)]
    wire = 7 / 8 * M * N * 2 / 360e9 * 1e3
    unfused = 12e-3 + wire + 0.2
    triton = max(0.03, wire) + 0.21 + 6e-3
    copy_engine = max(0.21, max(0.05, wire) + 0.21 / 8) + 6e-3
    assert e["points"][0][1:] == [pytest.approx(min(triton, copy_engine), rel=1e-4), pytest.approx(unfused, rel=1e-4)]
    assert e["provider_sizes"][0][1] == "copy_engine"


def test_zero_rows_are_kept_apart_from_the_activation_gathers(tmp_path):
    shape = dict(model="t", m=N, n=M, k=K, zero="rows")
    rows = [_row("gathered_matmul", "cublas", 0.2, shape), _row("gathered_matmul", "fused", 0.21, shape),
            _row("ag_push", "copy", 0.01, dict(shape, bytes=1)), _row("ag_push", "fused", 0.03, dict(shape, bytes=1))]
    _write(tmp_path, rows)
    table = project_table(tmp_path, devices=[H100], ops=[AG, registry.ZERO_LINEAR_ROWS.name], world_sizes=[8],
                          dtypes=["bfloat16"])
    assert table_key(H100, 8, torch.bfloat16, registry.ZERO_LINEAR_ROWS.name) in table
    assert table_key(H100, 8, torch.bfloat16, AG) not in table
    assert any("all_gather_matmul: no kernel rows" in n for n in table["_meta"]["notes"])


def test_halo_conv_compares_the_full_rows_by_block_elements_and_keeps_each_sizes_worst_shape(tmp_path):
    """The halo conv's points are sized as the layers size a call: a block's elements (batch x C x n^nd); shapes of
    one size (2-D 64 x 64^2 and 3-D 64 x 16^3) keep the worse."""
    rows = []
    for s, fused, cat in ((dict(nd=2, C=64, n=64), 0.5, 0.6),  # 2^18 elements: +20%
                          (dict(nd=3, C=64, n=16), 0.5, 0.55),  # 2^18 too: +10%, the worse
                          (dict(nd=2, C=64, n=512), 0.9, 0.8),  # 2^24: -11%
                          (dict(nd=2, C=16, n=64), 0.5, 0.75)):  # 2^16: +50%
        s = dict(s, halo=1)
        rows += [_row("halo_conv", "fused", fused, s, world=1, mode="full"),
                 _row("halo_conv", "cat", cat, s, world=1, mode="full"),
                 _row("halo_conv", "fused", 0.001, s, world=1, mode="stage")]  # other modes do not count
    _write(tmp_path, rows, name="halo_conv-test.json")
    e = project_table(tmp_path, devices=[H100], ops=["halo_conv"], world_sizes=[4], dtypes=["bfloat16"])[
        table_key(H100, 4, torch.bfloat16, "halo_conv")]
    assert e["size_key"] == "elements" and e["mode"] == "full"
    assert [g[0] for g in e["gains"]] == [2.0**16, 2.0**18, 2.0**24]
    assert [g[1] for g in e["gains"]] == [pytest.approx(0.5), pytest.approx(0.1),
                                          pytest.approx(0.8 / 0.9 - 1, abs=1e-4)]
    assert e["fused"] == "interval" and "min_size" not in e and 2**18 <= e["max_size"] < 2**24


def test_halo_conv_weighs_the_fused_step_against_the_layers_unfused_step_where_the_file_has_it(tmp_path):
    """The layers' alternative to the fused halo conv is their own unfused step (``pieces``: stage_from_pieces,
    unstage_to_pieces), not torch.cat's: where a file times it, the gain is against it; a file without those rows
    falls back to ``cat``.  The entry names the anchor it was weighed against."""
    s = dict(nd=2, C=64, n=64, halo=1)  # 2^18 elements
    base = [_row("halo_conv", "fused", 0.5, s, world=1, mode="full"),
            _row("halo_conv", "cat", 0.45, s, world=1, mode="full"),
            _row("halo_conv", "distdl", 0.9, s, world=1, mode="full")]
    key = table_key(H100, 4, torch.bfloat16, "halo_conv")

    def entry(rows, name):
        _write(tmp_path, rows, name=name)
        e = project_table(tmp_path, devices=[H100], ops=["halo_conv"], world_sizes=[4], dtypes=["bfloat16"])[key]
        (tmp_path / name).unlink()
        return e

    e = entry(base, "halo_conv-cat.json")
    assert e["kernels"]["anchor"] == "cat" and e["gains"][0][1] == pytest.approx(0.45 / 0.5 - 1)
    assert e["fused"] == "never"
    e = entry(base + [_row("halo_conv", "pieces", 0.6, s, world=1, mode="full")], "halo_conv-pieces.json")
    assert e["kernels"]["anchor"] == "pieces" and e["gains"][0][1] == pytest.approx(0.6 / 0.5 - 1)
    assert e["fused"] == "always"  # +20%, past the 10% rule and its margin
    # [size, fused, unfused]: the fused step is the fused row's, never an anchor's (cat's 0.45 would win)
    assert e["points"][0][1:] == [pytest.approx(0.5), pytest.approx(0.6)]


def test_other_devices_and_dtypes_borrow_kernels_with_a_wider_margin(tmp_path):
    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02))
    table = project_table(tmp_path, devices=[H100, H200], ops=[RS], world_sizes=[8])
    own = table[table_key(H100, 8, torch.bfloat16, RS)]
    fp16 = table[table_key(H100, 8, torch.float16, RS)]
    h200 = table[table_key(H200, 8, torch.bfloat16, RS)]
    assert own["kernels"]["dtype"] == fp16["kernels"]["dtype"] == "bfloat16" and h200["kernels"]["device"] == H100
    assert fp16["gains"][0][1] == own["gains"][0][1] and fp16["gains"][0][2] > own["gains"][0][2]
    # On the H200 the bandwidth kernels speed up by the copy bandwidths' ratio (3.0 / 4.3 TB/s) and the GEMMs by
    # the GEMM rates' (800 / 785): the nominal point is the H100's with those times.
    g, _, _, _ = _rs_expected(0.2 * 800 / 785, 0.21 * 800 / 785, 0.02 * 3000 / 4300)
    assert h200["gains"][0][1] == pytest.approx(g, abs=1e-4) and h200["gains"][0][2] > own["gains"][0][2]


def test_the_newest_result_file_of_a_device_decides(tmp_path):
    _write(tmp_path, _rs_rows(0.2, 0.5, 0.02), name="old.json", date="2026-11-22T00:00:00+00:00")
    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02), name="new.json", date="2026-12-02T00:00:00+00:00")
    (tmp_path / "dry.json").write_text(json.dumps(dict(env=dict(device=H100, date="2027", dry_run=True),
                                                       rows=_rs_rows(9, 9, 9))))
    e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[
        table_key(H100, 8, torch.bfloat16, RS)]
    assert e["kernels"]["file"] == "new.json" and e["fused"] == "always"


def test_two_runs_of_one_day_take_each_size_at_its_worse_run(tmp_path):
    """A same-day rerun (collect --tag) does not replace the first run: each size's point is the worse of the two
    for the fused path, whichever file is newer; another day's file does not join."""
    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02), name="a.json", date="2026-12-02T01:00:00+00:00")
    _write(tmp_path, _rs_rows(0.2, 0.5, 0.02), name="b.json", date="2026-12-02T03:00:00+00:00")
    _write(tmp_path, _rs_rows(0.2, 0.9, 0.02), name="c.json", date="2026-12-01T03:00:00+00:00")
    key = table_key(H100, 8, torch.bfloat16, RS)
    e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[key]
    assert e["kernels"]["file"] == "b.json" and e["kernels"]["also"] == ["a.json"]
    worse, _, _, _ = _rs_expected(0.2, 0.5, 0.02)
    assert e["gain"] == pytest.approx(worse, rel=1e-3)
    (tmp_path / "b.json").unlink()  # the better run alone
    e = project_table(tmp_path, devices=[H100], ops=[RS], world_sizes=[8], dtypes=["bfloat16"])[key]
    assert "also" not in e["kernels"] and e["gain"] == pytest.approx(_rs_expected(0.2, 0.21, 0.02)[0], rel=1e-3)


def test_cli_writes_the_shipped_form_checks_it_and_merges_elsewhere(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _write(results, _rs_rows(0.2, 0.21, 0.02))
    merged = tmp_path / "crossover.json"  # --out elsewhere merges into that table (write_table)
    assert project.main(["--results", str(results), "--out", str(merged), "--quiet", "--devices", H100]) == 0
    assert load_table(merged)[table_key(H100, 8, torch.bfloat16, RS)]["fused"] == "always"
    whole = tmp_path / "whole.json"  # the shipped form (written whole); --check compares with it
    whole.write_text(project.dumps(project_table(results, devices=[H100])))
    args = ["--results", str(results), "--out", str(whole), "--check", "--quiet", "--devices", H100]
    assert project.main(args) == 0
    whole.write_text("{}")
    assert project.main(args) == 1
    assert "differs" in capsys.readouterr().err


def test_no_result_files_writes_nothing(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert project.main(["--results", str(tmp_path), "--out", str(out)]) == 1
    assert not out.exists() and "no GPU result files" in capsys.readouterr().err


def test_distfuse_tune_project_is_the_same_command(tmp_path):
    from distfuse.tune import cli

    _write(tmp_path, _rs_rows(0.2, 0.21, 0.02))
    out = tmp_path / "t.json"
    assert cli.main(["project", "--results", str(tmp_path), "--out", str(out), "--quiet", "--devices", H100]) == 0
    assert table_key(H100, 2, torch.float16, RS) in load_table(out)


# ---------------------------------------------------------------- the shipped table


def test_every_registered_op_has_a_projection_model_and_the_bench_agrees():
    import bench.bench_gemm_fused as bench

    assert set(OP_MODELS) == {op for op in registry.names() if registry.get(op).projected}
    for side in bench.SIDES.values():
        model = OP_MODELS[getattr(registry, side["op"]).name]
        assert (model.gemm, model.bw, model.zero) == (side["gemm"], side["bw"], side.get("zero")), side


def test_the_shipped_table_parses_and_is_what_the_committed_results_give():
    """Regenerate with ``python -m distfuse.tune.project`` after committing GPU results (docs/gpu.md)."""
    text = SHIPPED.read_text()
    assert text == project.dumps(project_table()), "run python -m distfuse.tune.project and commit the table"
    entries = load_table(SHIPPED)
    assert entries and all(e["source"] == "projected" for e in entries.values())
    devices = {k.split("|")[0] for k in entries}
    assert devices == {H100, H200}
    assert {int(k.split("|")[1]) for k in entries} == {2, 4, 8}
    assert {k.split("|")[2] for k in entries} == {"bfloat16", "float16"}
    for e in entries.values():  # the 10% rule holds at every size the entry fuses at
        for size, gain, margin in e["gains"]:
            if e["fused"] != "never" and registry.in_interval(size, e.get("min_size"), e.get("max_size")):
                assert gain >= 0.10 and gain - margin > 0
        assert math.isfinite(e["gain"]) and e["margin"] >= 0


def test_the_package_data_names_the_shipped_table():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert SHIPPED.name in pyproject["tool"]["setuptools"]["package-data"]["distfuse.fused"]


@pytest.mark.slow
def test_the_generator_reads_what_the_lab_writes(tmp_path, capsys):
    """The benchmarks' dry runs (the GPU pipeline at tiny interpreted shapes on CPU, fp32) give result files whose
    rows project to an entry for every registered op, once their device says GPU: the row format cannot drift."""
    import bench.bench_gemm_fused as gemm
    import bench.bench_halo_conv as halo

    assert gemm.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    assert halo.main(["--dry-run", "--out-dir", str(tmp_path), "--dims", "2"]) == 0
    capsys.readouterr()
    for f in tmp_path.glob("*.json"):  # what a GPU run writes, but for the device and the dry-run flag
        data = json.loads(f.read_text())
        data["env"].update(device=H100, dry_run=False)
        f.write_text(json.dumps(data))
    table = project_table(tmp_path, devices=[H100], world_sizes=[2], dtypes=["float32"])
    projected = {op for op in registry.names() if registry.get(op).projected}
    assert {k.split("|")[3] for k in table if "|" in k} == projected, table["_meta"]["notes"]
    rs = table[table_key(H100, 2, torch.float32, RS)]
    assert {name for _, name in rs["provider_sizes"]} <= set(registry.get(RS).providers)
