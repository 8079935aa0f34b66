"""Which crossover entry decides: the user's table over the shipped one, measured over projected, errors by name.

Also what a decision says about its entry (``Decision.entry``, ``describe``), and that
``layer.explain(x)`` is dry: it names the entry and runs no communication.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from distfuse.errors import ConfigError
from distfuse.fused import registry
from distfuse.fused.crossover_table import SHIPPED, gain_at, load_table, shipped_path, table_key
from distfuse.layers.dispatch import DeviceCaps, dry_run, is_dry, select_path
from distfuse.tune.table import write_table

H100 = DeviceCaps("cuda", "NVIDIA H100 80GB HBM3", symmetric_memory=True, triton=True)
RS = registry.MATMUL_REDUCE_SCATTER.name
KEY = table_key(H100.name, 8, torch.bfloat16, RS)
BIG = dict(m=8192, n=4096, k=1792)  # 6.0e10 MACs
SIZE = 8192 * 4096 * 1792


def _projected(fused="always", gain=0.25, margin=0.05, **kw):
    e = dict(fused=fused, size_key="macs", source="projected", gain=gain, margin=margin,
             gains=[[1e9, -0.3, 0.1], [float(SIZE), gain, margin]], **kw)
    if fused == "never":
        e["max_size"] = -1.0
    return e


def _measured(fused="never", gain=-0.05, margin=0.02):
    e = dict(fused=fused, size_key="macs", source="measured", gain=gain, margin=margin,
             gains=[[float(SIZE), gain, margin]], points=[[float(SIZE), 1.05, 1.0]])
    if fused == "never":
        e["max_size"] = -1.0
    return e


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A user table and a shipped table in tmp_path, both empty until a test writes them."""
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    monkeypatch.delenv("DISTFUSE_PROVIDER", raising=False)
    user, shipped = tmp_path / "user.json", tmp_path / "shipped.json"
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(user))
    monkeypatch.setenv("DISTFUSE_SHIPPED_TABLE", str(shipped))
    return user, shipped


def _decide():
    return select_path(RS, BIG, torch.bfloat16, 8, H100)


def test_the_shipped_table_decides_where_the_user_has_no_entry(tables):
    user, shipped = tables
    shipped.write_text(json.dumps({KEY: _projected()}))
    d = _decide()
    assert d.path == "fused" and d.entry.kind == "table" and d.entry.shipped and d.entry.table == str(shipped)
    assert (d.entry.key, d.entry.source, d.entry.gain, d.entry.margin, d.entry.at_size) == \
        (KEY, "projected", 0.25, 0.05, float(SIZE))
    assert "(projected: gain +25.0% ± 5.0% at macs=6.01295e+10)" in d.reason
    text = d.describe()
    assert f"projected entry {KEY!r} of the shipped table {shipped}" in text and "+25.0% ± 5.0%" in text


def test_the_user_table_beats_the_shipped_one_key_by_key(tables):
    user, shipped = tables
    other = table_key(H100.name, 4, torch.bfloat16, RS)
    shipped.write_text(json.dumps({KEY: _projected(), other: _projected()}))
    user.write_text(json.dumps({KEY: _measured()}))
    d = _decide()
    assert d.path == "unfused" and not d.entry.shipped and d.entry.table == str(user)
    assert d.entry.source == "measured" and d.entry.gain == -0.05 and "measured: gain -5.0%" in d.reason
    w4 = select_path(RS, BIG, torch.bfloat16, 4, H100)  # the user's table has no TP 4 entry: the shipped decides
    assert w4.path == "fused" and w4.entry.shipped
    # even a user's projected entry beats a shipped one (the user's table is the user's choice)
    user.write_text(json.dumps({KEY: _projected("never", gain=0.02)}))
    assert _decide().path == "unfused" and _decide().entry.table == str(user)


def test_shipped_off_falls_back_to_the_default_rule(tables, monkeypatch):
    user, shipped = tables
    shipped.write_text(json.dumps({KEY: _projected()}))
    monkeypatch.setenv("DISTFUSE_SHIPPED_TABLE", "off")
    assert shipped_path() is None
    d = _decide()
    assert d.path == "unfused" and d.entry.kind == "default" and d.reason.startswith("default")
    assert "the registry's default rule for matmul_reduce_scatter (never fused)" in d.describe()
    monkeypatch.delenv("DISTFUSE_SHIPPED_TABLE")
    assert shipped_path() == SHIPPED


def test_legacy_and_hand_written_entries_still_read():
    """Tuner entries from before sources are measured; a hand-written one has no source and quotes no gain."""
    legacy = dict(fused="interval", min_size=1e9, points=[[1e9, 1.0, 1.1]])
    d = select_path(RS, BIG, torch.bfloat16, 8, H100, table={KEY: legacy})
    assert d.path == "fused" and d.entry.source == "measured" and d.entry.gain is None
    assert d.reason == f"crossover table: macs={SIZE:g}, fused for [1e+09, inf]"
    hand = select_path(RS, BIG, torch.bfloat16, 8, H100, table={KEY: dict(min_size=1e9)})
    assert hand.entry.source is None and hand.entry.table is None and "entry" in hand.describe()


def test_gain_is_quoted_at_the_nearest_evaluated_size():
    e = dict(gains=[[1e8, -0.5, 0.1], [1e10, 0.2, 0.05], [1e12, 0.4, 0.1]])
    assert gain_at(e, 3e9) == (1e10, 0.2, 0.05) and gain_at(e, 2e11) == (1e12, 0.4, 0.1)
    assert gain_at(dict(gain=0.1, margin=0.02), 5.0) == (None, 0.1, 0.02) and gain_at({}, 5.0) is None


def test_a_projected_entry_never_replaces_a_measured_one(tmp_path, caplog):
    path = tmp_path / "crossover.json"
    write_table(path, {KEY: _measured()})
    with caplog.at_level(logging.WARNING, logger="distfuse.dispatch"):
        write_table(path, {KEY: _projected()})
    assert load_table(path)[KEY]["source"] == "measured" and "kept the measured entries" in caplog.text
    # a tuner entry from before sources counts as measured; a measured entry replaces a projected one
    write_table(path, {KEY: dict(fused="never", max_size=-1.0, points=[[1.0, 2.0, 1.0]])})
    write_table(path, {KEY: _projected()})
    assert "source" not in load_table(path)[KEY]
    other = table_key(H100.name, 2, torch.bfloat16, RS)
    write_table(path, {other: _projected()})
    write_table(path, {other: _measured()})
    assert load_table(path)[other]["source"] == "measured"


@pytest.mark.parametrize("entry, what", [
    (dict(source="guessed"), "source must be one of"),
    (dict(source="projected", gain="big"), "gain must be a number"),
    (dict(source="projected", margin=float("nan")), "margin must be a number"),
    (dict(source="projected", gains=[[1.0, 0.1]]), "gains must be a list of [size, gain, margin]"),
], ids=["source", "gain", "margin", "gains"])
def test_malformed_sourced_entries_are_named_in_either_table(tables, entry, what):
    user, shipped = tables
    shipped.write_text(json.dumps({KEY: entry}))
    with pytest.raises(ConfigError) as info:
        _decide()
    assert str(shipped) in str(info.value) and repr(KEY) in str(info.value) and what in str(info.value)
    shipped.write_text("{}")
    user.write_text(json.dumps({KEY: entry}))
    with pytest.raises(ConfigError, match=str(user)):
        _decide()


def test_the_merged_view_follows_file_changes(tables):
    user, shipped = tables
    shipped.write_text(json.dumps({KEY: _projected()}))
    assert load_table()[KEY]["_shipped"] is True
    user.write_text(json.dumps({KEY: _measured()}))
    merged = load_table()
    assert merged[KEY]["_shipped"] is False and merged[KEY]["_table"] == str(user)
    assert load_table(user)[KEY] == _measured()  # a file read by path carries no annotations


def test_dry_run_nests_and_is_per_thread():
    import threading

    seen = []
    with dry_run():
        with dry_run():
            assert is_dry()
        assert is_dry()
        t = threading.Thread(target=lambda: seen.append(is_dry()))
        t.start()
        t.join()
    assert not is_dry() and seen == [False]


# ---------------------------------------------------------------- layer.explain: which entry, no communication


def _explain_rank(table_path: str):
    """Rank 0 alone explains a reduce-scatter linear on a pretend H100 (the table fuses it): no peer takes part, so
    a collective would hang; the layer's forward on both ranks is not run."""
    import os

    import torch.distributed as dist

    import distfuse.layers._linear_common as common
    from distfuse import Partition
    from distfuse.fused import symmetric_availability
    from distfuse.layers import DistributedLinearReduceScatter

    symmetric_availability._AVAILABLE.clear()  # an earlier test on this pool may have probed these ranks
    old = os.environ.get("DISTFUSE_TUNE_TABLE")
    os.environ["DISTFUSE_TUNE_TABLE"] = table_path  # the pool's ranks outlive the test: restored below
    P_x = Partition.world().create_partition_inclusive(range(2)).create_cartesian_topology_partition([1, 1, 2])
    layer = DistributedLinearReduceScatter(P_x, 64, 32, dtype=torch.bfloat16)
    real = common.device_caps
    common.device_caps = lambda device, symmetric_memory=None: H100
    try:
        out = None
        if dist.get_rank() == 0:
            d = layer.explain(torch.zeros(1, 16, 32, dtype=torch.bfloat16))
            out = (d.path, d.entry.key if d.entry else None, d.entry.source if d.entry else None, d.caveat,
                   d.describe())
    finally:
        common.device_caps = real
        if old is None:
            os.environ.pop("DISTFUSE_TUNE_TABLE", None)
        else:
            os.environ["DISTFUSE_TUNE_TABLE"] = old
    dist.barrier()
    return out


def test_explain_names_the_entry_and_runs_no_collective(tmp_path):
    from distfuse.testing import run_ranks

    op = registry.MATMUL_REDUCE_SCATTER_FEATURES.name  # DistDL's form: no P_y, the output's features scattered
    key = table_key(H100.name, 2, torch.bfloat16, op)
    path = tmp_path / "user.json"
    path.write_text(json.dumps({key: _projected()}))
    res = run_ranks(2, _explain_rank, str(path), timeout=120)
    path_, got_key, source, caveat, text = res[0]
    assert path_ == "fused" and got_key == key and source == "projected"
    assert "fused if symmetric memory is available" in caveat and "not probed" in caveat and caveat in text
    assert f"projected entry {key!r} of the table {path}" in text
    assert res[1] is None


def test_halo_staging_carries_the_entry(tables):
    from distfuse.layers._pool_common import choose_staging

    user, shipped = tables
    key = table_key(H100.name, 4, torch.bfloat16, "halo_conv")
    entry = dict(_projected("never", gain=-0.64, margin=0.02), size_key="elements", gains=[[2.0**26, -0.64, 0.02]])
    shipped.write_text(json.dumps({key: entry}))
    d = choose_staging(None, torch.bfloat16, torch.device("cpu"), 4, 2.0**26, {torch.device("cpu"): H100})
    assert d.path == "unfused" and d.reason.startswith("halo staging (the halo_conv rule): crossover table")
    assert d.entry.key == key and d.entry.shipped and d.entry.gain == -0.64


def _conv_explain_rank(table_path: str, length: int = 8):
    import os

    from distfuse.geometry.decomposition import block_extent
    from tests.test_conv_support import Case, build

    old = os.environ.get("DISTFUSE_TUNE_TABLE")
    os.environ["DISTFUSE_TUNE_TABLE"] = table_path
    try:
        P_x, _, _, layer = build(Case("explain", "feature", (1, 8, length), 8, 3, (1, 1, 2), (0, 1), padding=1,
                                      dtype=torch.bfloat16))
        layer._caps_cache[torch.device("cpu")] = H100  # a pretend H100: the table decides, not the CPU rule
        x = torch.zeros(1, 8, block_extent(length, 2, P_x.index[2]), dtype=torch.bfloat16)
        d, g = layer.explain(x), layer.explain(x, (1, 8, length))
        return d.path, d.entry.key, d.entry.source, d.describe(), d.entry.size, g.path, g.entry.size
    finally:
        if old is None:
            os.environ.pop("DISTFUSE_TUNE_TABLE", None)
        else:
            os.environ["DISTFUSE_TUNE_TABLE"] = old


def test_feature_conv_explain_names_the_entry(tmp_path):
    """The halo_conv rule sizes a call by a worker's block: the global input's elements over the workers, alike on
    every rank even where the split is uneven (``explain(x)`` alone sizes by ``x``'s own block)."""
    from distfuse.testing import run_ranks

    key = table_key(H100.name, 2, torch.bfloat16, "halo_conv")
    path = tmp_path / "user.json"
    path.write_text(json.dumps({key: dict(fused="interval", max_size=40, size_key="elements", source="measured",
                                          gains=[[28.0, 0.3, 0.05], [64.0, -0.2, 0.05]], gain=0.3, margin=0.05)}))
    for path_, got_key, source, text, size, g_path, g_size in run_ranks(2, _conv_explain_rank, str(path),
                                                                      timeout=120):
        assert path_ == "fused" and got_key == key and source == "measured" and size == 32 == g_size
        assert "measured: gain +30.0% ± 5.0% at elements=28" in text and g_path == "fused"
    # 7 positions over 2 workers (4 and 3): each block alone would size 32 and 24; the global shape sizes 28 on both
    got = run_ranks(2, _conv_explain_rank, str(path), 7, timeout=120)
    assert sorted(r[4] for r in got) == [24, 32] and [r[6] for r in got] == [28, 28]
    assert all(r[5] == "fused" for r in got)


def test_an_entry_sized_by_another_key_is_ignored(tables, caplog):
    """A table written when halo_conv was sized by channels: its bounds compare another quantity, so the default rule
    decides (here: unfused, where the entry would have fused), with a warning that names the entry."""
    import logging

    user, _ = tables
    key = table_key(H100.name, 4, torch.bfloat16, "halo_conv")
    user.write_text(json.dumps({key: dict(fused="interval", max_size=64, size_key="channels", source="measured")}))
    with caplog.at_level(logging.WARNING, logger="distfuse.dispatch"):
        d = select_path("halo_conv", dict(elements=32.0), torch.bfloat16, 4, H100)
    assert d.path == "unfused" and d.reason.startswith("default:") and d.entry.kind == "default"
    assert any(key in r.getMessage() and "sized by elements" in r.getMessage() for r in caplog.records)
    user.write_text(json.dumps({key: dict(fused="interval", max_size=64, size_key="elements", source="measured")}))
    assert select_path("halo_conv", dict(elements=32.0), torch.bfloat16, 4, H100).path == "fused", "same key: used"


def test_every_shipped_entry_compares_its_ops_size():
    """The package's table is projected with each op's current size (halo_conv: a block's elements), so dispatch
    never ignores a shipped entry for comparing another quantity."""
    from distfuse.fused import registry

    table = json.loads(SHIPPED.read_text())
    entries = {k: v for k, v in table.items() if "|" in k}
    assert entries
    for key, entry in entries.items():
        op = registry.current_name(key.rsplit("|", 1)[1])
        assert entry.get("size_key") == registry.get(op).size_key, key
