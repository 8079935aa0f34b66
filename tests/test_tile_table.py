"""Measured tiles (distfuse.kernels.tile_table, distfuse.tune.tiles) on CPU, with synthetic GPU measurements.

What is checked: a kernel's fingerprint follows its source (and only the source: the same compiled and
interpreted); the reader refuses malformed tables by name and matches an entry only for its device, kernel,
dtype, world size, N, K, current fingerprint and rows within a factor of 2; the pinned rules of the three kernels
take a matching entry; the generator keeps the fastest config only where it beats the default of the same run by
the margin, says why it writes nothing otherwise, and what it writes the reader reads back.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from distfuse.errors import ConfigError
from distfuse.kernels import chunk_reduce as cr
from distfuse.kernels import gathered_matmul_persistent as gp
from distfuse.kernels import matmul_scatter_persistent as mp
from distfuse.kernels import tile_table as tt
from distfuse.tune import tiles

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "NVIDIA H200"
PRODUCER = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, FLATTEN=False, SPAN=False)


def _fp(kernel_name):
    return tiles.current_fingerprints()[kernel_name]


def _entry(**kw):
    e = dict(kernel="matmul_scatter_persistent", device=DEVICE, dtype="bfloat16", W=8, M=8192, N=4096, K=1792,
             config=dict(PRODUCER), fingerprint=_fp("matmul_scatter_persistent"), source="measured")
    e.update(kw)
    return e


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the user's table at a temporary file and the shipped one at an empty table; returns a writer."""
    user, shipped = tmp_path / "tiles.json", tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"format": 1, "tiles": []}))
    monkeypatch.setenv(tt.TILE_TABLE_ENV, str(user))
    monkeypatch.setattr(tt, "SHIPPED_TILES", shipped)

    def write(entries, path=user):
        path.write_text(json.dumps({"format": 1, "tiles": entries}))
        os.utime(path, ns=(os.stat(path).st_mtime_ns + 1_000_000,) * 2)  # a new mtime: the reader's cache key
        return path

    return write


# ---------------------------------------------------------------- fingerprints


def _load(tmp_path, body):
    """Module ``fpmod`` from ``body`` in its own folder (a kernel module's stand-in)."""
    folder = tmp_path / str(abs(hash(body)))
    folder.mkdir()
    path = folder / "fpmod.py"
    path.write_text(textwrap.dedent(body))
    spec = importlib.util.spec_from_file_location("fpmod", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fpmod"] = mod
    spec.loader.exec_module(mod)
    tt._fingerprint_of_module.cache_clear()
    try:
        return tt.kernel_fingerprint(mod.kernel)
    finally:
        del sys.modules["fpmod"]
        tt._fingerprint_of_module.cache_clear()


KERNEL_SRC = """
    import triton
    import triton.language as tl

    @triton.jit
    def helper(x):
        return x + {step}

    @triton.jit
    def kernel(ptr):
        tl.store(ptr, helper(tl.load(ptr)))

    NOT_A_KERNEL = {constant}
"""


def test_a_fingerprint_follows_the_kernels_source_and_nothing_else(tmp_path):
    base = _load(tmp_path, KERNEL_SRC.format(step=1, constant=0))
    assert len(base) == 16 and int(base, 16) >= 0
    assert _load(tmp_path, KERNEL_SRC.format(step=1, constant=0) + "\n") == base  # same source, another file
    assert _load(tmp_path, KERNEL_SRC.format(step=1, constant=7)) == base  # host code is not the kernel
    assert _load(tmp_path, KERNEL_SRC.format(step=2, constant=0)) != base  # a helper's change retires the entries


def test_the_shipped_kernels_fingerprints_are_distinct_and_the_same_compiled():
    prints = tiles.current_fingerprints()
    assert len(set(prints.values())) == len(tt.TILE_KERNELS) == len(prints)
    code = ("import json; from distfuse.tune.tiles import current_fingerprints; "
            "print(json.dumps(current_fingerprints()))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels defined for a GPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == prints


# ---------------------------------------------------------------- the reader


@pytest.mark.parametrize("bad, what", [
    ("not json", "not readable as JSON"),
    (json.dumps({"format": 2, "tiles": []}), "expected"),
    (json.dumps({"format": 1, "tiles": [{"kernel": "matmul_scatter_persistent"}]}), "entry 0 .* needs 'device'"),
])
def test_a_malformed_table_is_refused_by_name(table, tmp_path, bad, what):
    """``load_tiles`` raises; the rules' lookup (inside a claim) warns once, by the same words, and ignores it."""
    path = tmp_path / "tiles.json"
    path.write_text(bad)
    with pytest.raises(ConfigError, match=what) as err:
        tt.load_tiles(path)
    assert str(path) in str(err.value)
    table([_entry()], path=tt.SHIPPED_TILES)  # the shipped table still serves
    with pytest.warns(RuntimeWarning, match=what) as seen:
        assert _lookup() == PRODUCER
        assert _lookup() == PRODUCER
    assert len([w for w in seen if str(path) in str(w.message)]) == 1, "once per file version"


def test_an_entry_for_another_kernel_or_a_zero_extent_is_refused(table):
    with pytest.raises(ConfigError, match="names kernel 'matmul_scatter'"):
        table([_entry(kernel="matmul_scatter")])
        tt.load_tiles(os.environ[tt.TILE_TABLE_ENV])
    with pytest.raises(ConfigError, match="non-positive extent"):
        table([_entry(M=0)])
        tt.load_tiles(os.environ[tt.TILE_TABLE_ENV])
    with pytest.raises(ConfigError, match="needs 'W' as int"):
        table([_entry(W=True)])
        tt.load_tiles(os.environ[tt.TILE_TABLE_ENV])


@pytest.mark.parametrize("config, what", [
    (dict(PRODUCER, num_warp=4), "unknown keys num_warp"),
    ({k: v for k, v in PRODUCER.items() if k != "num_stages"}, "missing num_stages"),
    (dict(PRODUCER, BLOCK_N=96), "bad values of BLOCK_N"),
    (dict(PRODUCER, num_stages=0), "bad values of num_stages"),
    (dict(PRODUCER, SPAN=1), "bad values of SPAN"),
    (dict(PRODUCER, EPILOGUE_SUBTILE=True), "unknown keys EPILOGUE_SUBTILE"),  # the consumer's key
])
def test_a_config_the_launch_cannot_take_is_refused_by_name(table, config, what):
    path = table([_entry(config=config)])
    with pytest.raises(ConfigError, match=what) as err:
        tt.load_tiles(path)
    assert str(path) in str(err.value) and "entry 0 (matmul_scatter_persistent)" in str(err.value)
    with pytest.warns(RuntimeWarning, match=what):
        assert _lookup() is None  # never launched: the rule decides


def _lookup(M=8192, N=4096, K=1792, W=8, device=DEVICE, dtype=torch.bfloat16):
    return tt.measured_tile("matmul_scatter_persistent", mp._matmul_scatter_persistent_kernel, device, dtype, M, N,
                            K, W)


def test_an_entry_serves_its_device_kernel_dtype_world_and_shape_only(table):
    table([_entry()])
    assert _lookup() == PRODUCER
    got = _lookup()
    got["BLOCK_M"] = 1  # a copy: the caller may complete it
    assert _lookup() == PRODUCER
    assert _lookup(M=4096) == PRODUCER and _lookup(M=16384) == PRODUCER  # rows within a factor of 2
    for miss in (dict(M=4095), dict(M=16385), dict(N=2048), dict(K=4096), dict(W=4), dict(device="NVIDIA H100"),
                 dict(device=None), dict(dtype=torch.float16)):
        assert _lookup(**miss) is None, miss


def test_the_nearest_rows_win_and_a_stale_fingerprint_never_applies(table):
    small = dict(PRODUCER, BLOCK_M=128, SPAN=True)
    table([_entry(), _entry(M=512, config=small), _entry(M=2048, config=dict(PRODUCER, num_stages=3),
                                                         fingerprint="0" * 16)])
    assert _lookup(M=700) == small  # 512 is nearer than 8192; the stale 2048 entry is not considered
    assert _lookup(M=2048) is None  # only the stale entry is within a factor of 2
    assert _lookup(M=6000) == PRODUCER


def test_the_users_table_comes_before_the_shipped_one_and_off_ignores_both(table, tmp_path, monkeypatch):
    shipped = dict(PRODUCER, num_warps=8)
    table([_entry(config=shipped)], path=tt.SHIPPED_TILES)
    assert _lookup() == shipped  # no user file: the shipped entry
    table([_entry()])
    assert _lookup() == PRODUCER
    monkeypatch.setenv(tt.TILE_TABLE_ENV, "off")
    assert _lookup() is None


def test_the_shipped_table_is_well_formed():
    for e in tt.load_tiles(tt.SHIPPED_TILES):
        assert e["source"] == "measured" and e["device"].startswith("NVIDIA")


# ---------------------------------------------------------------- the pinned rules take an entry


def test_the_three_pinned_rules_take_a_matching_entry(table, monkeypatch):
    cpu = torch.device("cpu")
    for mod in (mp, gp, cr):
        monkeypatch.setattr(mod, "INTERPRET", False)
        monkeypatch.setattr(mod, "device_name", lambda device: DEVICE)
    monkeypatch.setattr(mp, "HAS_CUDA", True)
    consumer = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    reduce = dict(BLOCK=2048, PER_SM=4, num_warps=8)
    table([_entry(),
           _entry(kernel="gathered_matmul_persistent", N=1792, K=4096, config=consumer,
                  fingerprint=_fp("gathered_matmul_persistent")),
           _entry(kernel="chunk_reduce", K=0, config=reduce, fingerprint=_fp("chunk_reduce"))])
    # the producer: the entry's blocks and forms, completed by the launcher
    assert mp._default_blocks(torch.bfloat16, 1, 8192, 8, 4096, 1792, cpu, 132) == PRODUCER
    meta, programs = mp._complete(mp._default_blocks(torch.bfloat16, 1, 8192, 8, 4096, 1792, cpu, 132), 1, 8192, 8,
                                  4096, 132)
    assert meta["FLATTEN"] is False and meta["SPAN"] is False and meta["W_BLOCK"] == 8 and programs == 132
    rule = mp._default_blocks(torch.bfloat16, 1, 8192, 8, 4096, 3584, cpu, 132)  # another K: the rule
    assert rule == mp._pinned_config(torch.bfloat16, 1, 8192, 8, 4096, 132)
    # the consumer: the entry, with the split epilogue the rule gives every pinned config
    got = gp.gathered_persistent_config(torch.bfloat16, 1, 1024, 8, 1792, 132, K=4096, device_name=DEVICE)
    assert got == dict(consumer, EPILOGUE_SUBTILE=True)
    assert gp.gathered_persistent_config(torch.bfloat16, 1, 1024, 8, 1792, 132, K=4096, device_name=None) == \
        gp._pinned_config(torch.bfloat16, 1, 1024, 8, 1792, 132)
    # the reduction: rows of one chunk times W are the table's M
    cr.reduce_plan.cache_clear()
    try:
        meta, _, programs = cr.reduce_plan(1024, 4096, 4096, torch.bfloat16, 8, cpu)
        assert {k: meta[k] for k in reduce} == reduce
        assert cr.reduce_plan(1024, 2048, 2048, torch.bfloat16, 8, cpu)[0]["BLOCK"] == \
            cr.reduce_meta(1024, 2048, 2048, torch.bfloat16, 8)["BLOCK"]  # another N: the pinned rule
    finally:
        cr.reduce_plan.cache_clear()


# ---------------------------------------------------------------- the generator


def _diagnose(rows, **env):
    base = dict(device=DEVICE, W=8, dtype="bfloat16", sms=132, commit="abc1234", date="2026-11-28",
                fingerprints=tiles.current_fingerprints())
    base.update(env)
    return dict(env=base, rows=rows)


def _form(form, config, graph_us, default=False, m=8192):
    return dict(section="forms", op="matmul_scatter_persistent", form=form, meta=config, default=default,
                model="llama3-8b", side="rs", m=m, n=4096, k=1792, loop_us=graph_us * 1.1, graph_us=graph_us)


RULE = dict(PRODUCER, BLOCK_M=128, FLATTEN=True)


def test_the_generator_keeps_the_fastest_config_that_beats_the_default_by_the_margin():
    cublas = dict(section="forms", op="cublas", m=8192, n=4096, k=1792, loop_us=150.0, graph_us=151.0)
    rows = [cublas, _form("pinned", RULE, 200.0, default=True), _form("nested", PRODUCER, 170.0),
            _form("span_flipped", dict(RULE, SPAN=True), 180.0),
            # M = 512: the best other config wins by 2% only
            _form("pinned", RULE, 100.0, default=True, m=512), _form("nested", PRODUCER, 98.0, m=512),
            dict(section="forms", op="matmul_scatter_persistent", error="CompilationError: out of resources")]
    got, notes = tiles.tile_rows(_diagnose(rows), "d.json", tiles.current_fingerprints())
    assert len(got) == 5 and {r["M"] for r in got} == {512, 8192}
    entries, decided = tiles.pick_tiles(got)
    assert len(entries) == 1
    e = entries[0]
    assert (e["M"], e["config"], e["us"], e["rule_us"], e["anchor_us"]) == (8192, PRODUCER, 170.0, 200.0, 151.0)
    assert e["metric"] == "graph_us" and e["gain"] == pytest.approx(200 / 170 - 1, abs=1e-4)
    assert e["fingerprint"] == _fp("matmul_scatter_persistent") and e["source"] == "measured"
    assert any("M=512" in n and "the default holds" in n for n in decided)
    assert tiles.pick_tiles(got, min_gain=0.5)[0] == []  # a larger margin: nothing beats the default


def test_the_generator_says_why_it_writes_nothing():
    rows = [_form("pinned", RULE, 200.0, default=True), _form("nested", PRODUCER, 100.0)]
    prints = tiles.current_fingerprints()
    stale = dict(prints, matmul_scatter_persistent="0" * 16)
    for doc, why in ((_diagnose(rows, fingerprints=stale), "has changed since this run"),
                     (_diagnose(rows, device="cpu", dry_run=True), "not a GPU run"),
                     (_diagnose(rows, fingerprints={}), "lacks W, dtype or kernel fingerprints")):
        got, notes = tiles.tile_rows(doc, "d.json", prints)
        assert got == [] and any(why in n for n in notes), notes
    got, _ = tiles.tile_rows(_diagnose([_form("nested", PRODUCER, 100.0)]), "d.json", prints)
    entries, decided = tiles.pick_tiles(got)
    assert entries == [] and "the default config was not timed" in decided[0]
    # rows without the default's graph replay fall back to the loop times of every row
    mixed = [_form("pinned", RULE, 200.0, default=True), dict(_form("nested", PRODUCER, 100.0), graph_us=None)]
    entries, _ = tiles.pick_tiles(tiles.tile_rows(_diagnose(mixed), "d.json", prints)[0])
    assert entries[0]["metric"] == "loop_us" and entries[0]["us"] == pytest.approx(110.0)


def test_what_the_generator_writes_the_pinned_rule_reads_back(table, tmp_path, monkeypatch):
    reduce_rows = [dict(section="reduce", op="copy", m=8192, n=4096, k=1792, graph_us=50.0),
                   dict(section="reduce", op="chunk_reduce", meta=dict(BLOCK=4096, PER_SM=3, num_warps=4),
                        default=True, m=8192, n=4096, k=1792, graph_us=70.0),
                   dict(section="reduce", op="chunk_reduce", meta=dict(BLOCK=1024, PER_SM=8, num_warps=4),
                        default=False, m=8192, n=4096, k=1792, graph_us=60.0)]
    doc = _diagnose([_form("pinned", RULE, 200.0, default=True), _form("nested", PRODUCER, 170.0)] + reduce_rows)
    src = tmp_path / "diagnose.json"
    src.write_text(json.dumps(doc))
    out = Path(os.environ[tt.TILE_TABLE_ENV])
    out.write_text(json.dumps({"format": 1, "tiles": [_entry(M=512, config=RULE)]}))  # another key: kept
    assert tiles.main([str(src), "--write", "--out", str(out)]) == 0
    written = tt.load_tiles(out)
    assert sorted((e["kernel"], e["M"]) for e in written) == [("chunk_reduce", 8192),
                                                              ("matmul_scatter_persistent", 512),
                                                              ("matmul_scatter_persistent", 8192)]
    assert _lookup() == PRODUCER and _lookup(M=512) == RULE
    red = next(e for e in written if e["kernel"] == "chunk_reduce")
    assert red["K"] == 0 and red["anchor_us"] == 50.0 and red["config"] == dict(BLOCK=1024, PER_SM=8, num_warps=4)
    # a second run of the same shape replaces its entry
    doc["rows"][1]["graph_us"] = 150.0
    doc["rows"][1]["meta"] = dict(PRODUCER, num_stages=3)
    src.write_text(json.dumps(doc))
    assert tiles.main([str(src), "--write", "--out", str(out)]) == 0
    assert _lookup() == dict(PRODUCER, num_stages=3) and len(tt.load_tiles(out)) == 3


def _poll_row(loads, graph_us, default, m=8192):
    return dict(section="reduce:poll", op="chunk_reduce (poll)", poll="load" if loads else "atomic", model="llama3-8b",
                m=m, n=4096, k=1792, meta=dict(BLOCK=4096, PER_SM=8, num_warps=8, POLL_LOADS=loads),
                default=default, matches_atomic=True, graph_us=graph_us)


def test_a_flag_poll_that_wins_becomes_a_measured_tile_the_reduction_takes(table, tmp_path, monkeypatch):
    """The diagnosis times ``chunk_reduce``'s default launch with its flags polled by atomics (the default) and by
    loads (section ``reduce:poll``): where loads win by the margin the generator writes the tile with
    ``POLL_LOADS`` true, and the reduction's plan takes it, unless ``DISTFUSE_FLAG_POLL`` was set (the user's
    setting decides); where they do not, the default holds and nothing is written."""
    src = tmp_path / "diagnose.json"
    src.write_text(json.dumps(_diagnose([_poll_row(False, 27.0, True), _poll_row(True, 23.0, False),
                                         _poll_row(False, 40.0, True, m=512), _poll_row(True, 39.8, False, m=512)])))
    out = Path(os.environ[tt.TILE_TABLE_ENV])
    assert tiles.main([str(src), "--write", "--out", str(out)]) == 0
    written = tt.load_tiles(out)
    assert [(e["kernel"], e["M"], e["config"]) for e in written] == [
        ("chunk_reduce", 8192, dict(BLOCK=4096, PER_SM=8, num_warps=8, POLL_LOADS=True))], "M = 512: a 0.5% gain"
    monkeypatch.setattr(cr, "INTERPRET", False)
    monkeypatch.setattr(cr, "device_name", lambda device: DEVICE)
    cpu = torch.device("cpu")
    for explicit, want in ((False, True), (True, cr.POLL_LOADS)):
        monkeypatch.setattr(cr, "POLL_LOADS_EXPLICIT", explicit)
        cr.reduce_plan.cache_clear()
        try:
            meta = cr.reduce_plan(1024, 4096, 4096, torch.bfloat16, 8, cpu)[0]
        finally:
            cr.reduce_plan.cache_clear()
        assert (meta["BLOCK"], meta["PER_SM"], meta["num_warps"], meta["POLL_LOADS"]) == (4096, 8, 8, want), explicit
    table([dict(written[0], config=dict(written[0]["config"], POLL_LOADS="yes"))])
    with pytest.raises(ConfigError, match="bad values of POLL_LOADS"):
        tt.load_tiles(out)


def test_a_dry_diagnose_records_what_the_generator_needs(tmp_path):
    diag = importlib.util.spec_from_file_location("gpu_diagnose", ROOT / "scripts" / "gpu_diagnose.py")
    mod = importlib.util.module_from_spec(diag)
    diag.loader.exec_module(mod)
    out = tmp_path / "d.json"
    assert mod.main(["--dry-run", "--json", str(out), "--sections", "reduce", "--budget", "60"]) == 0
    doc = json.loads(out.read_text())
    assert doc["env"]["fingerprints"] == tiles.current_fingerprints()
    assert doc["env"]["W"] == 2 and doc["env"]["dtype"] == "float32"
    timed = [r for r in doc["rows"] if r.get("op") == "chunk_reduce"]
    assert timed and all(set(r["meta"]) == {"BLOCK", "PER_SM", "num_warps", "POLL_LOADS"} and "default" in r
                         for r in timed)
    got, notes = tiles.tile_rows(doc, str(out), tiles.current_fingerprints())
    assert got == [] and "not a GPU run" in notes[0]
