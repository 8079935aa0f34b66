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

Robustness.  :func:`write_table` writes a temporary file in the table's directory and
renames it over the table (``os.replace``), so a reader never sees half a file; the file
gets the mode a new file would (``0o666 & ~umask``), not ``mkstemp``'s 0600.  An existing
table it cannot read, or whose entries are malformed, is moved aside to
``<name>.unreadable-<timestamp>`` with a warning (never overwritten silently), and a fresh
table is written.  :func:`load_table` (dispatch) raises
:class:`~distfuse.errors.ConfigError` naming the file and the entry when an entry is
malformed (say ``"min_size": "big"``), and warns once and ignores a file that is not
JSON at all.

Renamed ops.  A table written before an op was renamed keys it by the former name
(``...|linear_rs`` for ``matmul_reduce_scatter``, ``...|linear_ag`` for
``all_gather_matmul``; :data:`distfuse.fused.registry.RENAMED`).  :func:`load_table` reads
such keys under the current name, and :func:`write_table` rewrites them so; where a file
holds both, the entry under the current name wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from distfuse.errors import ConfigError
from distfuse.fused.registry import current_name

__all__ = ["FORMAT", "SECTIONS", "NEVER", "table_path", "table_key", "current_key", "load_table", "read_json",
           "write_table", "check_entry"]

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


_FUSED_VALUES = ("interval", "always", "threshold", "never")  # "always": crossover_fit wins at every size


def check_entry(path, key: str, entry) -> None:
    """Raise :class:`ConfigError` naming the file and the entry unless ``entry`` is a well-formed crossover entry.

    What dispatch reads: a JSON object whose ``min_size`` and ``max_size`` are numbers (or
    absent/null) and whose ``fused`` is one of ``"interval"``, ``"always"``, ``"threshold"``, ``"never"`` (or absent);
    optionally ``provider`` (a name) and ``provider_sizes`` (``[[size, name], ...]``), which
    :func:`distfuse.fused.providers.select_provider` reads (tables without them pick the
    op's default provider).
    """
    where_ = f"crossover table {path}: entry {key!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where_} must be a JSON object, got {type(entry).__name__} {entry!r:.80}")
    for bound in ("min_size", "max_size"):
        v = entry.get(bound)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)):
            raise ConfigError(f"{where_}: {bound} must be a number or null, got {v!r:.80}")
    fused = entry.get("fused")
    if fused is not None and fused not in _FUSED_VALUES:
        raise ConfigError(f"{where_}: fused must be one of {_FUSED_VALUES}, got {fused!r:.80}")
    provider = entry.get("provider")
    if provider is not None and not isinstance(provider, str):
        raise ConfigError(f"{where_}: provider must be a string, got {provider!r:.80}")
    sizes = entry.get("provider_sizes")
    if sizes is not None and not (isinstance(sizes, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, float)) and not isinstance(p[0], bool)
            and isinstance(p[1], str) for p in sizes)):
        raise ConfigError(f"{where_}: provider_sizes must be a list of [size, provider name], got {sizes!r:.80}")


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
    if not isinstance(table, dict):
        key = f"table:{path}"
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning(f"distfuse: ignoring crossover table {path}: its top level is not a JSON object")
        table = {}
    table = _current_keys({k: v for k, v in table.items() if "|" in k})
    for k, v in table.items():
        check_entry(path, k, v)
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


def _unreadable(path: Path) -> str | None:
    """Why the existing table at ``path`` cannot be merged into (None when it can, or when there is none)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(data, dict):
        return f"its top level is a JSON {type(data).__name__}, not an object"
    try:
        for k, v in _current_keys({k: v for k, v in data.items() if "|" in k}).items():
            check_entry(path, k, v)
    except ConfigError as exc:
        return str(exc)
    return None


def _move_aside(path: Path, why: str) -> Path:
    """Rename an unreadable table to ``<name>.unreadable-<timestamp>`` (never clobbering) and warn."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.unreadable-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.unreadable-{stamp}-{n}")
    os.replace(path, aside)
    msg = (f"distfuse-tune: the crossover table {path} could not be read ({why}); moved it to {aside} and wrote a "
           "new one")
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return aside


def _new_file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open()`` would give a new file (``mkstemp`` gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_table(path: Path | str | None, entries: dict | None = None, *, triton_configs: dict | None = None,
                sweeps: dict | None = None, run_meta: dict | None = None) -> Path:
    """Merge into the crossover table at ``path`` (default: :func:`table_path`) and write it atomically.

    ``entries``: ``table_key -> entry``; ``triton_configs`` and ``sweeps``: keyed the same;
    ``run_meta``: ``"device|world" -> info`` for ``_meta.runs``.  Keys already in the file
    and not given are kept (other devices, world sizes, dtypes, ops), under the current op
    names (see the module doc on renamed ops).  An existing file that cannot be read, or
    holds a malformed entry, is moved aside with a warning (see the module doc); a
    malformed entry given here raises :class:`ConfigError`.
    """
    path = Path(path) if path is not None else table_path()
    for k, v in (entries or {}).items():
        if "|" not in k:
            raise ValueError(f"write_table: {k!r} is not a table key (device|world|dtype|op)")
        check_entry(path, k, v)
    why = _unreadable(path)
    if why is not None:
        _move_aside(path, why)
    old = read_json(path)
    table = {k: v for k, v in old.items() if "|" not in k}
    table.update(_current_keys({k: v for k, v in old.items() if "|" in k}))
    for section in ("triton_configs", "sweeps"):
        if isinstance(table.get(section), dict):
            table[section] = _current_keys(table[section])
    table.update(entries or {})
    for section, new in (("triton_configs", triton_configs), ("sweeps", sweeps)):
        if new:
            if not isinstance(table.get(section), dict):
                table[section] = {}
            table[section].update(new)
    meta = table.get("_meta") if isinstance(table.get("_meta"), dict) else {}
    table["_meta"] = meta
    meta.update(format=FORMAT, written_by="distfuse-tune")
    if run_meta:
        if not isinstance(meta.get("runs"), dict):
            meta["runs"] = {}
        meta["runs"].update(run_meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)  # readers (dispatch re-reads on mtime change) never see a half-written file
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
