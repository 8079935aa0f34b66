"""Measured staging configs: the tile table's ``halo_stage`` entries, from the diagnosis' rows to the launch.

A GPU run times the fused staging's tiles and forms (``scripts/gpu_diagnose.py``, section ``halo_tiles``: the
split launch, the words form, the tile sweep), ``distfuse-tune tiles`` keeps the fastest config where it beats the
staging's own choice, and :func:`~distfuse.kernels.halo_programs.stage_launch` takes it on a GPU of that name.
Checked here on CPU, with the device's name stubbed and synthetic measurements:

* an entry made from a launch (``stage_config``, ``stage_key``) makes the staging launch exactly that launch again
  (tile, constexprs, split, words form, grid and tables) and stage the reference's bits into a poisoned output,
  for NCHW and channels last, middle and corner workers;
* the remote pass keeps its own strip tiling under an entry, as under the rules;
* an entry applies to its device, dtype, row length and rows per vector only, and to a lead within a factor of 2;
  without a dtype (a caller that names none) the rules decide;
* the generator reads the diagnosis' staging rows by their ``key``, leaves out a config that staged wrong bits, and
  what it writes the staging reads back;
* the table refuses a staging config whose strip or slab width is not a power of two, by name.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from distfuse.errors import ConfigError
from distfuse.kernels import halo as hk
from distfuse.kernels import halo_programs as hp
from distfuse.kernels import tile_table as tt
from distfuse.tune import tiles
from tests.test_halo_kernels import _nan, _nchw_order, _plan
from tests.test_halo_overlap_passes import _inputs
from tests.test_tile_table import DEVICE, _diagnose, table  # noqa: F401 - the fixture

# (global shape, grid, kernel, padding, mode, workers, channels last)
CASES = [
    pytest.param((9, 9, 12), (3, 3, 3), (3, 3, 3), 1, "zeros", [(1, 1, 1), (0, 0, 0)], False, id="3d-nchw"),
    pytest.param((9, 16), (2, 2), (3, 5), ((1, 1), (2, 2)), "circular", [(0, 1), (1, 0)], True,
                 id="2d-circular-channels-last"),
]
B, C = 2, 4


@pytest.fixture
def on_gpu_named(monkeypatch):
    """The staging's device-name lookup says DEVICE (a CPU run stands in for that GPU); every cached launch is
    dropped before and after, so no launch built under the stub outlives the test."""
    monkeypatch.setattr(hp, "device_name", lambda device: DEVICE)
    hp.stage_launch.cache_clear()
    yield
    hp.stage_launch.cache_clear()


def _entry(launch, lead, trail, dtype="float32", **kw):
    e = dict(kernel="halo_stage", device=DEVICE, dtype=dtype, W=1, **hp.stage_key(launch, lead, trail),
             config=hp.stage_config(launch, 4), fingerprint=tiles.current_fingerprints()["halo_stage"],
             source="measured")
    e.update(kw)
    return e


def _same_launch(a, b) -> bool:
    def same(u, v):
        if isinstance(u, torch.Tensor):
            return isinstance(v, torch.Tensor) and torch.equal(u, v)
        if isinstance(u, (tuple, list)):
            return isinstance(v, (tuple, list)) and len(u) == len(v) and all(map(same, u, v))
        return u == v
    return (a.kernel is b.kernel and a.grid == b.grid and a.meta == b.meta and same(a.args, b.args)
            and a.parts == b.parts and same(a.words, b.words))


@pytest.mark.parametrize("gshape,grid,kernel,padding,mode,workers,cl", CASES)
def test_a_measured_config_is_what_the_staging_launches(table, on_gpu_named, gshape, grid, kernel, padding, mode,  # noqa: F811
                                                        workers, cl):
    nd = len(gshape)
    plan, _ = _plan(gshape, grid, kernel, (1,) * nd, (1,) * nd, padding, mode)
    fmt = hk.CHANNELS_LAST[nd] if cl else torch.contiguous_format
    lead, trail = (B, C) if cl else (B * C, 1)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(11)
    # configs the rules would not pick on CPU: narrow tiles, 2 warps, the split, and (NCHW) the words form
    forced_configs = [((4, 8, 2, 2, 2), True, False), ((8, 4, 4, 4, 4), False, not cl)]
    for i in workers:
        x, recv = _inputs(plan, i, B, C, fmt, "cpu", torch.float32, gen)
        want = hk.halo_stage_reference(x, _nchw_order(recv, [pc.src_shape for pc in plan.recvs(i)], (B, C))
                                       if cl else recv, plan, i)
        rules = hp.stage_launch(plan, i, lead, cpu, "all", None, None, trail)
        for tile, split, words in forced_configs:
            forced = hp.stage_launch(plan, i, lead, cpu, "all", tile, None, trail, split, words)
            if forced.kernel is not hp.stage_kernel:
                continue
            assert hp.stage_config(forced, 4) != hp.stage_config(rules, 4)
            table([_entry(forced, lead, trail)])
            hp.stage_launch.cache_clear()  # launches are cached per shape: a table is read at a shape's first
            got = hp.stage_launch(plan, i, lead, cpu, "all", None, None, trail, None, None, torch.float32)
            assert _same_launch(got, forced), (i, tile)
            assert hp.stage_config(got, 4)["WORDS"] == (words and not cl)
            out = hk.halo_stage(x, recv, plan, i, channels_last=cl, out=_nan(want.shape, want.dtype, want.device)
                                .contiguous(memory_format=fmt))
            assert torch.equal(out, want), (i, tile)
            # the remote pass: the entry's tile, with (NCHW) the rules' own strip width, which no timed row ran
            remote = hp.stage_launch(plan, i, lead, cpu, "remote", None, None, trail, None, None, torch.float32)
            if remote.kernel is hp.stage_kernel:
                assert (remote.meta["BLOCK_X"], remote.meta["num_warps"]) == (tile[1], tile[4])
                rules_remote = hp.stage_launch(plan, i, lead, cpu, "remote", tile[:2], None, trail)
                assert remote.meta["STRIP_X"] == (rules_remote.meta["STRIP_X"] if trail == 1 else tile[3])
            # anything else: the rules
            for other in (dict(dtype=torch.bfloat16), dict(dtype=None), dict(lead=4 * lead)):
                args = dict(dtype=torch.float32, lead=lead) | other
                plain = hp.stage_launch(plan, i, args["lead"], cpu, "all", None, None, trail)
                assert _same_launch(hp.stage_launch(plan, i, args["lead"], cpu, "all", None, None, trail, None, None,
                                                    args["dtype"]), plain), other
            table([_entry(forced, lead, trail, device="NVIDIA H100 80GB HBM3")])
            hp.stage_launch.cache_clear()
            assert _same_launch(hp.stage_launch(plan, i, lead, cpu, "all", None, None, trail, None, None,
                                                torch.float32), rules)
            table([_entry(forced, lead, trail, fingerprint="0" * 16)])  # a staging changed since: never applies
            hp.stage_launch.cache_clear()
            assert _same_launch(hp.stage_launch(plan, i, lead, cpu, "all", None, None, trail, None, None,
                                                torch.float32), rules)
            hp.stage_launch.cache_clear()


def _staging_row(meta, graph_us, default=False, exact=True, key=None):
    return dict(section="halo_tiles", op="halo_stage", nd=3, C=256, n=64, format="nchw", meta=meta, default=default,
                exact=exact, key=key or dict(M=256, N=66, K=66 * 66), loop_us=graph_us * 1.2, graph_us=graph_us)


RULE_STAGE = dict(BLOCK_R=64, BLOCK_X=64, SLAB_X=16, STRIP_X=2, num_warps=4, SPLIT=True, WORDS=False)


def test_the_generator_reads_the_staging_rows_by_their_key(table, tmp_path):  # noqa: F811
    words = dict(RULE_STAGE, WORDS=True)
    narrow = dict(RULE_STAGE, BLOCK_R=16, STRIP_X=8)
    rows = [dict(section="halo_tiles", op="copy", nd=3, C=256, n=64, key=dict(M=256, N=66, K=66 * 66),
                 graph_us=80.0),
            _staging_row(RULE_STAGE, 125.0, default=True), _staging_row(words, 90.0),
            _staging_row(narrow, 60.0, exact=False),  # fastest, but wrong: never a candidate
            # 2-D: nothing beats the default by the margin
            _staging_row(RULE_STAGE, 80.0, default=True, key=dict(M=256, N=514, K=514)),
            _staging_row(words, 79.0, key=dict(M=256, N=514, K=514)),
            dict(section="halo_tiles", op="halo_stage region=local", loop_us=10.0)]  # no config: not a candidate
    got, notes = tiles.tile_rows(_diagnose(rows), "d.json", tiles.current_fingerprints())
    assert len(got) == 4 and {r["W"] for r in got} == {1} and any("gave wrong results" in n for n in notes)
    entries, decided = tiles.pick_tiles(got)
    assert len(entries) == 1, decided
    e = entries[0]
    assert (e["kernel"], e["M"], e["N"], e["K"], e["config"]) == ("halo_stage", 256, 66, 66 * 66, words)
    assert (e["us"], e["rule_us"], e["anchor_us"], e["metric"]) == (90.0, 125.0, 80.0, "graph_us")
    assert any("N=514" in n and "the default holds" in n for n in decided)
    src = tmp_path / "diagnose.json"
    src.write_text(json.dumps(_diagnose(rows)))
    out = Path(os.environ[tt.TILE_TABLE_ENV])
    assert tiles.main([str(src), "--write", "--out", str(out)]) == 0
    assert tt.measured_tile("halo_stage", hp.stage_kernel, DEVICE, torch.bfloat16, 256, 66, 66 * 66, 1) == words
    assert tt.measured_tile("halo_stage", hp.stage_kernel, DEVICE, torch.bfloat16, 64, 66, 66 * 66, 1) is None


@pytest.mark.parametrize("config,what", [(dict(RULE_STAGE, STRIP_X=3), "bad values of STRIP_X"),
                                         (dict(RULE_STAGE, SLAB_X=0), "bad values of SLAB_X"),
                                         (dict(RULE_STAGE, WORDS=1), "bad values of WORDS"),
                                         ({k: v for k, v in RULE_STAGE.items() if k != "BLOCK_R"}, "missing BLOCK_R"),
                                         (dict(RULE_STAGE, PART=1), "unknown keys PART")])
def test_a_staging_config_the_launch_cannot_take_is_refused_by_name(table, config, what):  # noqa: F811
    path = table([dict(kernel="halo_stage", device=DEVICE, dtype="bfloat16", W=1, M=256, N=66, K=4356,
                       config=config, fingerprint="0" * 16)])
    with pytest.raises(ConfigError, match=what):
        tt.load_tiles(path)
