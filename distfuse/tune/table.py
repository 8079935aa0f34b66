"""The crossover table: its file format, where it lives, reading it (dispatch) and writing it (the tuner).

File layout (keys with a ``|`` are crossover entries; the rest are sections dispatch ignores)::

    {
      "NVIDIA H200|8|bfloat16|matmul_reduce_scatter": {"min_size": 3.1e9, "fused": "interval", "size_key": "macs",
                                                       "points": [[size, fused_ms, unfused_ms], ...], ...},
      "triton_configs": {"NVIDIA H200|8|bfloat16|matmul_reduce_scatter": {
          "matmul_scatter": [{"key": [...], "kwargs": {...}, "num_warps": 8, "num_stages": 3}]}},
      "sweeps": {"<key>": {"size_key": ..., "points": [{"shape": ..., "size": ..., "fused_ms": ...,
                                                       "unfused_ms": ...}]}},
      "_meta": {"format": 1, "runs": {"NVIDIA H200|8": {"date": ..., "torch": ..., "notes": [...]}}}
    }

An entry means: fused when ``min_size <= size <= max_size`` (a missing bound is open),
``size`` being the op's size (:meth:`distfuse.fused.registry.FusedOp.size_of`: channels
for halo_conv, the per-rank ``m*n*k`` for the linears).  "Fused never" is written as
``max_size: -1`` (:data:`NEVER`).

Where: ``$DISTFUSE_TUNE_TABLE``, else ``$XDG_CACHE_HOME/distfuse/crossover.json``, else
``~/.cache/distfuse/crossover.json`` (:func:`table_path`).

Renamed ops.  A table written before an op was renamed keys it by the former name
(``...|linear_rs`` for ``matmul_reduce_scatter``, ``...|linear_ag`` for
``all_gather_matmul``; :data:`distfuse.fused.registry.RENAMED`).  :func:`load_table` reads
such keys under the current name, and :func:`write_table` rewrites them so; where a file
holds both, the entry under the current name wins.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from distfuse.fused.registry import current_name

__all__ = ["FORMAT", "SECTIONS", "NEVER", "table_path", "table_key", "current_key", "load_table", "read_json",
           "write_table"]

log = logging.getLogger("distfuse.dispatch")

FORMAT = 1
SECTIONS = ("triton_configs", "sweeps", "_meta")
NEVER = -1.0  # max_size of a "fused never" entry: every size is >= 0

_TABLE_CACHE: dict[str, tuple[float, dict]] = {}
_LOGGED: set[str] = set()


def table_path() -> Path:
    """Where dispatch reads and the tuner writes by default."""
    env = os.environ.get("DISTFUSE_TUNE_TABLE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distfuse" / "crossover.json"


def table_key(device_name: str, world_size: int, dtype: torch.dtype, op: str) -> str:
    """``"device|world|dtype|op"``, e.g. ``"NVIDIA H200|8|bfloat16|matmul_reduce_scatter"``."""
    return f"{device_name}|{world_size}|{str(dtype).removeprefix('torch.')}|{op}"


def current_key(key: str) -> str:
    """``key`` with a renamed op's former name replaced by its current one (``...|linear_rs`` -> ``...|matmul_...``)."""
    head, sep, op = key.rpartition("|")
    return f"{head}{sep}{current_name(op)}" if sep else key


def _current_keys(entries: dict) -> dict:
    """``entries`` keyed by :func:`current_key`; an entry already under the current key beats a former one."""
    out = {}
    for k, v in entries.items():
        new = current_key(k)
        if new == k or new not in entries:
            out[new] = v
    return out


def load_table(path: Path | str | None = None) -> dict:
    """The crossover entries of the table (empty if absent or unreadable); re-read when the file changes.

    Only the entries (keys with a ``|``) are returned; sections are read with :func:`read_json`.
    """
    path = Path(path) if path is not None else table_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    cached = _TABLE_CACHE.get(str(path))
    if cached and cached[0] == mtime:
        return cached[1]
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        key = f"table:{path}"
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning(f"distfuse: ignoring unreadable crossover table {path}: {exc}")
        table = {}
    table = _current_keys({k: v for k, v in table.items() if "|" in k}) if isinstance(table, dict) else {}
    _TABLE_CACHE[str(path)] = (mtime, table)
    return table


def read_json(path: Path | str | None = None) -> dict:
    """The whole table file, sections included (empty if absent or unreadable)."""
    path = Path(path) if path is not None else table_path()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_table(path: Path | str | None, entries: dict | None = None, *, triton_configs: dict | None = None,
                sweeps: dict | None = None, run_meta: dict | None = None) -> Path:
    """Merge into the crossover table at ``path`` (default: :func:`table_path`) and write it atomically.

    ``entries``: ``table_key -> entry``; ``triton_configs`` and ``sweeps``: keyed the same;
    ``run_meta``: ``"device|world" -> info`` for ``_meta.runs``.  Keys already in the file
    and not given are kept (other devices, world sizes, dtypes, ops), under the current op
    names (see the module doc on renamed ops).
    """
    path = Path(path) if path is not None else table_path()
    old = read_json(path)
    table = {k: v for k, v in old.items() if "|" not in k}
    table.update(_current_keys({k: v for k, v in old.items() if "|" in k}))
    for section in ("triton_configs", "sweeps"):
        if isinstance(table.get(section), dict):
            table[section] = _current_keys(table[section])
    for k, v in (entries or {}).items():
        if "|" not in k:
            raise ValueError(f"write_table: {k!r} is not a table key (device|world|dtype|op)")
        table[k] = v
    for section, new in (("triton_configs", triton_configs), ("sweeps", sweeps)):
        if new:
            table.setdefault(section, {}).update(new)
    meta = table.setdefault("_meta", {})
    meta.update(format=FORMAT, written_by="distfuse-tune")
    if run_meta:
        meta.setdefault("runs", {}).update(run_meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".crossover-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # readers (dispatch re-reads on mtime change) never see a half-written file
    return path
