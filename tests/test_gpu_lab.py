"""The GPU lab's scripts, without a GPU: shell syntax, the bookkeeping and the checks of what a run leaves in $OUT.

The whole dry run (``DISTFUSE_LAB_DRY_RUN=1 bash scripts/gpu_lab.sh``, about a minute on 2
cores) is not repeated here; these tests cover its parts: the phase records, the tests'
JSON lines, the ratios of issue 21's table, and ``check`` catching what a device call
would lose (too many files, a row without its anchor, a fused row that does not name the
kernel that ran).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lab = _module("lab_record")


@pytest.mark.parametrize("script", ["gpu_lab.sh", "gpu_lab_extra.sh", "gpu_first_call.sh", "audit_triton36.sh"])
def test_shell_syntax(script):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_caps_fit_one_call():
    assert sum(cap for _, cap in lab.PHASES) <= lab.BUDGET_S <= 9 * 60
    assert [name for name, _ in lab.PHASES] == ["probe", "canary", "tests", "gemm", "halo", "two_process", "attention"]
    text = (SCRIPTS / "gpu_lab.sh").read_text()
    for name, cap in lab.PHASES:  # the script runs the phases with the caps the check expects
        assert f"phase {name} {cap} " in text, name
    assert "DISTFUSE_TIMEOUT=30" in text and "DISTFUSE_AUTOTUNE=0" in text


def _row(op, provider, anchor, ms, shape, mode="fwd", kernel=None, **kw):
    return dict(op=op, provider=provider, anchor=anchor, mode=mode, shape=shape, dtype="bfloat16", world_size=8,
                ms=ms, kernel=kernel or provider, **kw)


def _gemm_rows(m):
    s = dict(model="llama3-8b", m=m, n=4096, k=1792)
    return [_row("matmul_scatter", "cublas", "cublas", 1.0, s), _row("matmul_scatter", "fused", "cublas", 1.25, s),
            _row("matmul_scatter", "triton_persistent", "cublas", 1.05, s, kernel="matmul_scatter"),
            _row("chunk_reduce", "copy", "copy", 1.0, dict(s, bytes=10)),
            _row("chunk_reduce", "fused", "copy", 4.0, dict(s, bytes=10)),
            _row("gathered_matmul", "cublas", "cublas", 1.0, s), _row("gathered_matmul", "fused", "cublas", 2.0, s)]


def _halo_rows():
    s = dict(nd=2, C=64, n=512, halo=1, batch=1)
    return [_row("halo_conv", "copy", "copy", 1.0, s, "stage"), _row("halo_conv", "fused", "copy", 2.0, s, "stage"),
            _row("halo_conv", "cat", "cat", 1.0, s, "full"), _row("halo_conv", "fused", "cat", 0.9, s, "full")]


def _lab_out(tmp_path, rows=None):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(device="NVIDIA H100 80GB HBM3", torch="2.11.0", triton="3.6.0", commit="abc1234",
               date="2026-11-27T10:00:00+00:00")
    gemm = out / "gemm_fused-NVIDIA_H100_80GB_HBM3-2026-11-27.json"
    gemm.write_text(json.dumps(dict(env=env, rows=rows if rows is not None else _gemm_rows(8192) + _gemm_rows(512))))
    halo = out / "halo_conv-NVIDIA_H100_80GB_HBM3-2026-11-27.json"
    halo.write_text(json.dumps(dict(env=env, rows=_halo_rows())))
    attention = out / "attention-NVIDIA_H100_80GB_HBM3-2026-11-27.json"
    block = dict(batch=1, heads=32, seq=4096, head_dim=128, causal=True)
    attention.write_text(json.dumps(dict(env=env, rows=[_row("attention_block", "sdpa", "sdpa", 1.0, block, "full"),
                                                        _row("attention_block", "ring_local", "sdpa", 1.2, block,
                                                             "full")])))
    (out / "lab.json").write_text(json.dumps(dict(env=env, phases=[])))
    files = {"probe": "probe.json", "canary": "probe.json", "tests": "tests.json", "gemm": gemm.name, "halo": halo.name,
             "two_process": "two_process.json", "attention": attention.name}
    for name in ("probe.json", "tests.json", "two_process.json"):
        (out / name).write_text("{\"ok\": true}")
    for name, cap in lab.PHASES:
        assert lab.main(["phase", "--out", str(out), "--name", name, "--cap", str(cap), "--limit", str(cap),
                         "--rc", "0", "--seconds", "3", "--file", str(out / files[name])]) == 0
    return out


def test_a_well_formed_run_passes_the_check_and_gives_the_ratios(tmp_path):
    out = _lab_out(tmp_path)
    assert lab.check(out) == []
    table = {t["target"]: t for t in lab.ratios(lab.result_files(out))}
    # the best fused provider per shape: the persistent producer at 1 / 1.05
    assert table["gemm+scatter vs cuBLAS (M>=4096)"]["worst"] == pytest.approx(0.952, abs=1e-3)
    best = next(iter(table["gemm+scatter vs cuBLAS (M>=4096)"]["shapes"].values()))
    assert best["provider"] == "triton_persistent" and best["kernel"] == "matmul_scatter"  # the kernel that ran
    assert table["gemm+scatter vs cuBLAS (M=512)"]["worst"] == pytest.approx(0.952, abs=1e-3)
    assert table["chunk_reduce vs copy (M>=4096)"]["worst"] == 0.25 and not table["chunk_reduce vs copy (M>=4096)"][
        "holds"]
    assert table["halo staging vs copy (>= 16M elements)"]["worst"] == 0.5
    assert table["fused halo conv vs cat+cuDNN (every shape)"]["holds"] is True
    assert lab.main(["ratios", "--out", str(out)]) == 0
    assert len(json.loads((out / "lab.json").read_text())["ratios"]) == len(lab.TARGETS)


def test_the_check_catches_what_a_device_call_would_lose(tmp_path):
    rows = _gemm_rows(8192)
    rows = [r for r in rows if not (r["op"] == "gathered_matmul" and r["provider"] == "cublas")]  # anchor missing
    rows[1] = dict(rows[1], kernel=None)  # a fused row that does not name its kernel
    out = _lab_out(tmp_path, rows)
    (out / "lab.log").write_text("")
    (out / "extra.json").write_text("{}")  # 9 files: the device tool brings back 8
    problems = "\n".join(lab.check(out))
    assert "9 files under $OUT" in problems
    assert "does not name the kernel that ran" in problems
    assert "the anchor cublas of gathered_matmul/fused" in problems


def test_phase_records_and_skips(tmp_path):
    out = tmp_path
    (out / "lab.json").write_text(json.dumps(dict(env={}, phases=[])))
    lab.main(["phase", "--out", str(out), "--name", "gemm", "--cap", "180", "--limit", "12", "--rc", "-1",
              "--seconds", "0"])
    lab.main(["phase", "--out", str(out), "--name", "halo", "--cap", "75", "--limit", "75", "--rc", "124",
              "--seconds", "80"])
    lab.main(["phase", "--out", str(out), "--name", "two_process", "--cap", "70", "--limit", "0", "--rc", "-2",
              "--seconds", "0"])
    phases = json.loads((out / "lab.json").read_text())["phases"]
    assert phases[0]["status"] == "skipped: no time left in the budget"
    assert phases[1]["status"] == "timed out after 75 s"
    assert phases[2]["status"] == "skipped: not asked for (DISTFUSE_LAB_PHASES)"


def test_tests_summary_keeps_what_finished(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    lines = [dict(test="a::x", when="call", outcome="passed", seconds=1.0),
             dict(test="a::y", when="call", outcome="failed", seconds=2.0, message="boom"),
             dict(test="a::z", when="setup", outcome="skipped", seconds=0.0, reason="needs a CUDA GPU")]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = lab.tests_summary(jsonl, finished=False)  # a phase cut off: the finished tests still count
    assert (got["tests"], got["passed"], got["failed"], got["skipped"]) == (3, 1, 1, 1)
    assert got["failures"][0]["message"] == "boom" and not got["ok"]


def test_two_process_summary_per_provider():
    two = _module("gpu_two_process")
    case = dict(op="rs", provider="triton_persistent", kernel="matmul_scatter", dtype="torch.bfloat16",
                rel_err=dict(y=1e-3, dx=2e-3))
    reports = [dict(rank=r, cases=[case] * 2, failures=[]) for r in range(2)]
    got = two.summarize(reports, 2, ["rs:triton_persistent", "ag:copy_engine"], 1.0)
    assert got["by_provider"]["rs:triton_persistent"]["ok"]
    assert got["by_provider"]["rs:triton_persistent"]["kernels"] == ["matmul_scatter"]
    assert not got["by_provider"]["ag:copy_engine"]["ok"] and not got["ok"]  # no case ran: not a pass


def test_bench_rows_name_their_kernel_and_anchor(tmp_path):
    """The GEMM bench's row helper: fused rows carry the kernel; writing is atomic and repeatable (incremental)."""
    sys.path.insert(0, str(ROOT))
    from bench.harness import Row, results_path, write_json

    env = dict(device="NVIDIA H200 (x)", date="2026-11-27T00:00:00+00:00")
    path = results_path("gemm_fused", env, tmp_path)
    assert path.name == "gemm_fused-NVIDIA_H200__x_-2026-11-27.json"  # names the device tool brings back
    rows = [Row("matmul_scatter", "fused", "fwd", dict(m=8), "bfloat16", 8, 1.0, 0.9, 1.1, kernel="matmul_scatter")]
    write_json(path, env, rows, partial=True)
    write_json(path, env, rows * 2, partial=False)
    data = json.loads(path.read_text())
    assert data["partial"] is False and len(data["rows"]) == 2 and data["rows"][0]["kernel"] == "matmul_scatter"
    assert not list(tmp_path.glob("*.tmp"))


def test_collect_names_every_file_by_device_and_date(tmp_path):
    """``collect`` copies what a first call brings back (lab.tgz unpacked) under names that say device and date."""
    src, dest = tmp_path / "lab", tmp_path / "results"
    src.mkdir()
    env = dict(device="NVIDIA H100 80GB HBM3", date="2026-11-27T09:09:00+00:00", commit="abc1234")
    (src / "lab.json").write_text(json.dumps(dict(env=env, phases=[])))
    for name in ("tests.json", "two_process.json", "probe.json", "diagnose.json"):
        (src / name).write_text("{}")
    assert lab.main(["collect", "--out", str(src), "--dest", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        f"{kind}-NVIDIA_H100_80GB_HBM3-2026-11-27.json"
        for kind in ("gpu_lab", "gpu_lab_tests", "gpu_lab_two_process", "gpu_lab_probe", "diagnose"))
    # a rerun of the same day keeps the first call's files: --tag ends every name, the benchmarks' included
    (src / "gemm_fused-NVIDIA_H100_80GB_HBM3-2026-11-27.json").write_text(json.dumps(dict(env=env, rows=[])))
    assert lab.main(["collect", "--out", str(src), "--dest", str(dest), "--tag", "rerun"]) == 0
    tagged = {p.name for p in dest.iterdir() if p.name.endswith("-rerun.json")}
    assert tagged == {f"{kind}-NVIDIA_H100_80GB_HBM3-2026-11-27-rerun.json" for kind in
                      ("gpu_lab", "gpu_lab_tests", "gpu_lab_two_process", "gpu_lab_probe", "diagnose", "gemm_fused")}
    assert len(list(dest.iterdir())) == 5 + 6, "the first call's five files are still there"


def test_the_diagnosis_sections_new_since_the_last_gpu_call_run_on_cpu(tmp_path):
    """``scripts/gpu_diagnose.py --dry-run`` (interpreted, tiny shapes) through the sections whose rows a GPU call
    has not yet produced: torch's W-way sum beside ``chunk_reduce`` and ``chunk_reduce`` with its flags polled both
    ways (``latency``), the plain Triton GEMM beside cuBLAS (``forms``), checked against cuBLAS within its bound,
    and the staging's diagnosis region ``window`` with the small tiles, torch's copies of the window's bytes,
    contiguous and into the staged layout, and the row probe's whole rows and window (``halo``).  A section that
    raises on the device machine costs a call, so none may raise here."""
    out = tmp_path / "diag.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(SCRIPTS / "gpu_diagnose.py"), "--dry-run", "--json", str(out),
                          "--sections", "latency", "forms", "halo"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    anchors = [r for r in rows if r.get("op") == "triton_gemm"]
    assert {r["side"] for r in anchors} == {"rs", "ag"} and all(r["ok"] and r["bound"] > 0 for r in anchors)
    assert any(r.get("op") == "halo_stage region=window" for r in rows)
    windows = [r for r in rows if r.get("op", "").startswith("copy window")]
    assert {r["op"] for r in windows} == {"copy window (contiguous)", "copy window (strided, torch)"}
    assert all(r["exact"] for r in windows if "strided" in r["op"]), "the strided copy filled the staged window"
    probes = [r for r in rows if r.get("op", "").startswith("rows probe")]
    assert sorted(r["op"] for r in probes) == ["rows probe (flat words)", "rows probe (flat words, gathered)",
                                               "rows probe (whole rows)",
                                               "rows probe (whole rows, paired)", "rows probe (window)"], \
        "the row probe runs on the NCHW shapes"
    assert all(r["format"] == "nchw" and r["bytes"] > 0 for r in probes)
    inexact = [(r["op"], r.get("format")) for r in rows if r.get("exact") is False]
    assert not inexact, f"every staging variant writes what its reference writes: {inexact}"
    # the first call's digest reads these rows: every block that has rows here prints them
    text = _module("lab_digest").digest({"diagnose": out})
    for block in ("latency", "W streams", "flag polls", "Triton's mainloop", "the NCHW layout"):
        body = text.split(f"== {block}")[1].split("\n== ")[0]
        assert not body.splitlines()[1].startswith("no "), (block, body)
    assert "rows probe: whole rows" in text and "flat words" in text and "exact: True" in text
    words = {r["op"]: r for r in rows if "words=True" in r.get("op", "") or "two passes" in r.get("op", "")}
    assert set(words) == {"halo_stage words=True", "halo_stage two passes", "halo_stage two passes words=True"}
    assert all(r["exact"] for r in words.values()) and words["halo_stage two passes words=True"]["words_form"]
    assert "words form: one pass" in text
    assert any(r.get("op") == "torch_sum" and r["section"] == "latency" for r in rows)
    polls = [r for r in rows if r.get("op") == "chunk_reduce (poll)"]
    assert sorted(r["poll"] for r in polls) == ["atomic", "load"] and all(r["matches_atomic"] for r in polls)
    assert not any(r["poll_loads"] for r in polls), "the interpreter polls with atomics whatever the config asks"
    # the whole stagings' rows carry what distfuse-tune tiles needs (the staging's config, its key, whether it is the
    # staging's own choice), so the same rows from a GPU become halo_stage entries: read here as if from one
    staged = [r for r in rows if r.get("section") == "halo_tiles" and "meta" in r]
    assert staged and all(r["exact"] and set(r["key"]) == {"M", "N", "K"} for r in staged)
    assert {r["format"] for r in staged if r["default"]} == {"nchw", "channels_last"}
    doc = json.loads(out.read_text())
    doc["env"].update(device="NVIDIA H200", dry_run=False)
    for r in doc["rows"]:  # a CPU run times the host only: the GPU's loop time stands in
        r.setdefault("loop_us", r.get("host_us"))
    from distfuse.tune import tiles
    got, _ = tiles.tile_rows(doc, "diag.json", tiles.current_fingerprints())
    assert {(r["kernel"], r["W"]) for r in got} >= {("halo_stage", 1)}
    assert all(r["anchor_us"] is not None for r in got if r["kernel"] == "halo_stage"), "the staged bytes' copy"
    # a second part appended to the same file (scripts/gpu_first_call.sh runs the diagnosis in two)
    res = subprocess.run([sys.executable, str(SCRIPTS / "gpu_diagnose.py"), "--dry-run", "--json", str(out),
                          "--sections", "attrib", "--append"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    both = json.loads(out.read_text())
    assert both["rows"][:len(rows)] == rows and any(r["section"] == "attrib" for r in both["rows"][len(rows):])


def test_cprofile_rows_give_microseconds_per_call():
    """The host profile ``diagnose`` records for the fused and ``cat`` halo steps on a GPU (``halo_full``, rows
    ``(cprofile)``): per function its own and cumulative time and calls per call of the profiled step."""
    diag = _module("gpu_diagnose")

    def inner():
        return sum(range(50))

    def step():
        return inner() + inner()

    rows = diag.cprofile_rows(step, 10)
    by = {r["function"].split("(")[-1].rstrip(")"): r for r in rows}
    assert by["inner"]["calls"] == 2.0 and by["step"]["calls"] == 1.0
    assert by["step"]["cum_us"] >= by["inner"]["cum_us"] > 0
    assert diag.cprofile_text(rows).splitlines()[0].split() == ["own", "us", "cum", "us", "calls/call", "function"]
    recorded = []
    diag.cprofile_record(lambda **row: recorded.append(row), "halo_full", "fused", step, 10, nd=2, C=64)
    assert [(r["section"], r["op"], r["nd"], r["C"]) for r in recorded] == [("halo_full", "fused (cprofile)", 2, 64)]
    assert {r["function"].split("(")[-1].rstrip(")") for r in recorded[0]["cprofile"]} >= {"inner", "step"}


def test_the_digest_reads_a_collected_call():
    """``scripts/lab_digest.py --results bench/results --tag`` on the committed files of the H200's fourth call of
    2026-11-28: its latency rows say the consumer's eager row was bound by the host (160 us after a sync against a
    79 us flush), and blocks without rows in that call say so instead of failing."""
    dig = _module("lab_digest")
    files = dig.find_files(results=ROOT / "bench" / "results", tag="NVIDIA_H200-2026-11-28-fourth")
    assert files["diagnose"] is not None and files["probe"] is not None
    text = dig.digest(files)
    consumer = next(line for line in text.splitlines() if line.strip().startswith("gathered_matmul"))
    assert consumer.endswith("host-bound") and "160.0" in consumer
    assert "no launch_canary in probe.json" in text and "no reduce:poll rows" in text
    assert "no pinned halo rerun" in text and "no pinned gemm rerun" in text


def test_the_digest_sets_a_pinned_rerun_beside_its_phase(tmp_path):
    """The first call's pinned reruns (``halo_conv-*-pinned.json``, ``gemm_fused-*-pinned.json``): per op, shape,
    mode and fused provider, the ratio to the anchor as the targets read it (rate over the anchor's rate, else the
    anchor's time over the row's) in the phase and in the rerun, with the config the rerun took and its source."""
    s = dict(nd=3, C=256, n=64, halo=1, batch=1, format="nchw")
    config = dict(BLOCK_R=64, BLOCK_X=64, SLAB_X=16, STRIP_X=2, num_warps=4, SPLIT=True, WORDS=True)

    def halo_file(name, fused_ms, source):
        rows = [_row("halo_conv", "copy", "copy", 0.07, s, "stage", rate=2000.0),
                _row("halo_conv", "fused", "copy", fused_ms, s, "stage", rate=2000.0 * 0.07 / fused_ms,
                     extra=dict(stage_config=config, stage_config_source=source)),
                _row("halo_conv", "cat", "cat", 1.0, s, "full"), _row("halo_conv", "distdl", "cat", 1.2, s, "full")]
        (tmp_path / name).write_text(json.dumps(dict(env={}, rows=rows)))
    halo_file("halo_conv-NVIDIA_H200-2026-11-29.json", 0.125, "rules")
    halo_file("halo_conv-NVIDIA_H200-2026-11-29-pinned.json", 0.0778, "measured")
    dig = _module("lab_digest")
    files = dig.find_files(tmp_path)
    assert files["halo"].name.endswith("29.json") and files["halo_pinned"].name.endswith("pinned.json")
    assert files["gemm"] is None and files["gemm_pinned"] is None
    text = dig.digest(files)
    block = text.split("== pinned staging")[1].split("\n== ")[0].splitlines()
    assert len(block) == 3, block  # the header, then the one fused row that names its config
    assert "stage fused" in block[2] and "0.56" in block[2] and "0.90" in block[2] and "WORDS=True" in block[2]
    assert block[2].endswith("(measured)")
    assert "no pinned gemm rerun" in text


def test_the_digest_sets_each_eager_row_beside_its_cold_calls_and_its_graph(tmp_path):
    """The GEMM bench's eager rows time their runs back to back and keep their cold calls' median
    (``extra.ms_synced``): the digest prints the ratio to the anchor both ways and the graph replay's; rows without
    a cold time (CPU runs, files before 2026-11-29) are left out, and a file with none says so."""
    s = dict(model="llama3-8b", m=8192, n=4096, k=1792)
    rows = [_row("gathered_matmul", "cublas", "cublas", 0.165, s, extra=dict(ms_synced=0.170)),
            _row("gathered_matmul", "fused", "cublas", 0.190, s, extra=dict(ms_synced=0.285)),
            _row("gathered_matmul", "cublas", "cublas", 0.160, s, "graph"),
            _row("gathered_matmul", "fused", "cublas", 0.186, s, "graph"),
            _row("matmul_scatter", "cublas", "cublas", 0.15, s), _row("matmul_scatter", "fused", "cublas", 0.2, s)]
    (tmp_path / "gemm_fused-NVIDIA_H200-2026-11-30.json").write_text(json.dumps(dict(env={}, rows=rows)))
    dig = _module("lab_digest")
    text = dig.digest(dig.find_files(tmp_path))
    block = text.split("== eager timing")[1].split("\n== ")[0].splitlines()
    assert len(block) == 3, block  # the title's line, the header, the one row with both cold times
    assert "gathered_matmul m=8192 model=llama3-8b fused" in block[2]
    assert block[2].split()[-3:] == ["0.87", "0.60", "0.86"]  # 0.165/0.190, 0.170/0.285, 0.160/0.186
    (tmp_path / "gemm_fused-NVIDIA_H200-2026-11-30.json").write_text(json.dumps(dict(env={}, rows=rows[4:])))
    assert "no eager rows with their cold calls' time" in dig.digest(dig.find_files(tmp_path))
