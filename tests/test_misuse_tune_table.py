"""The crossover table file: atomic, umask-respecting writes; unreadable tables kept aside; malformed entries named."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from distfuse.errors import ConfigError
from distfuse.layers.dispatch import DeviceCaps, select_path
from distfuse.tune import cli
from distfuse.tune.table import load_table, table_key, write_table

KEY = table_key("NVIDIA H200", 8, torch.bfloat16, "matmul_reduce_scatter")
ENTRY = {"min_size": 1e9, "fused": "interval", "size_key": "macs"}
H200 = DeviceCaps("cuda", "NVIDIA H200", True, True)


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_table_has_the_mode_a_new_file_gets(tmp_path, umask, mask):
    umask(mask)
    path = write_table(tmp_path / "sub" / "crossover.json", {KEY: ENTRY})
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert json.loads(path.read_text())[KEY] == ENTRY
    assert sorted(p.name for p in path.parent.iterdir()) == ["crossover.json"]  # no temporary file left


def test_rewrite_is_atomic_and_merges(tmp_path, monkeypatch):
    path = write_table(tmp_path / "t.json", {KEY: ENTRY})
    inode = path.stat().st_ino
    other = table_key("NVIDIA H200", 4, torch.bfloat16, "matmul_reduce_scatter")
    seen = []
    real_replace = os.replace

    def spy(src, dst):  # the new content lands in a temporary file of the same directory, then one rename
        seen.append((os.path.dirname(src), json.loads(open(src).read())))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_table(path, {other: ENTRY})
    assert seen and seen[0][0] == str(tmp_path) and set(seen[0][1]) >= {KEY, other}
    assert path.stat().st_ino != inode  # replaced, not rewritten in place
    assert set(load_table(path)) == {KEY, other}


@pytest.mark.parametrize("content", ["{not json", "[1, 2, 3]", json.dumps({KEY: {"min_size": "big"}})],
                         ids=["not-json", "not-an-object", "malformed-entry"])
def test_an_unreadable_table_is_moved_aside_with_a_warning(tmp_path, content):
    path = tmp_path / "crossover.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="could not be read") as warned:
        write_table(path, {KEY: ENTRY})
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("crossover.json.unreadable-")]
    assert len(aside) == 1 and aside[0].read_text() == content  # kept, byte for byte
    assert str(aside[0]) in str(warned[0].message)
    assert json.loads(path.read_text())[KEY] == ENTRY


@pytest.mark.parametrize("entry, what", [
    ({"min_size": "big"}, "min_size must be a number"),
    ({"max_size": [1]}, "max_size must be a number"),
    ({"min_size": True}, "min_size must be a number"),
    ({"fused": "sometimes"}, "fused must be one of"),
    ([1e9], "must be a JSON object"),
])
def test_a_malformed_entry_is_reported_with_the_file_and_the_entry(tmp_path, monkeypatch, entry, what):
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({KEY: entry}))
    with pytest.raises(ConfigError) as info:
        load_table(path)
    assert str(path) in str(info.value) and repr(KEY) in str(info.value) and what in str(info.value)
    monkeypatch.setenv("DISTFUSE_TUNE_TABLE", str(path))
    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    with pytest.raises(ConfigError, match=what):  # dispatch reads through load_table
        select_path("matmul_reduce_scatter", dict(m=4096, n=4096, k=4096), torch.bfloat16, 8, H200)
    with pytest.raises(ConfigError, match=what):  # and the tuner refuses to write one
        write_table(tmp_path / "other.json", {KEY: entry})


def test_the_tuner_refuses_a_bad_timeout_by_name(monkeypatch):
    monkeypatch.setenv("DISTFUSE_TIMEOUT", "-1")
    monkeypatch.setattr(cli.dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="DISTFUSE_TIMEOUT"):
        cli.init_dist()
