"""The crossover table's reader: its file format, where it lives, reading and checking it.

Dispatch (:func:`distfuse.layers.dispatch.select_path`) and the provider choice
(:func:`distfuse.fused.providers.select_provider`) read the table; ``distfuse-tune`` writes
it (:func:`distfuse.tune.table.write_table`).  The reader sits beside the registry whose op
names key it, so that importing the layers never loads the tuner.

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
``~/.cache/distfuse/crossover.json`` (:func:`table_path`): the user's table.  Beneath it
the package ships ``distfuse/fused/crossover_shipped.json`` (:func:`shipped_path`; built by
``distfuse-tune project`` from the GPU lab's kernel measurements and a stated NVLink model,
:mod:`distfuse.tune.project`; ``DISTFUSE_SHIPPED_TABLE=off`` ignores it, a path replaces it).

Sources and precedence.  An entry's ``source`` is ``"measured"`` (``distfuse-tune`` timed
both paths on the node; :func:`entry_source`) or ``"projected"`` (modelled from one-GPU
kernel times).  What dispatch reads (:func:`load_table` without a path) is, key by key,
the user's table over the shipped one; within one file a measured entry is never replaced
by a projected one.  Entries may carry ``gain`` and ``margin`` (the decisive point) and
``gains`` (``[[size, gain, margin], ...]``): ``gain = unfused_ms / fused_ms - 1``,
``margin`` how much of it the pessimistic end of the inputs takes away (:func:`gain_at`).

Robustness.  The writer replaces the file atomically.  :func:`load_table` raises
:class:`~distfuse.errors.ConfigError` naming the file and the entry when an entry is
malformed (:func:`check_entry`), and warns once and ignores a file that is not JSON at all.
Keys under a renamed op's former name (:data:`distfuse.fused.registry.RENAMED`) are read
under the current one; where a file holds both, the entry under the current name wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from distfuse.errors import ConfigError
from distfuse.fused.registry import current_name

__all__ = ["FORMAT", "NEVER", "SOURCES", "SHIPPED", "table_path", "shipped_path", "table_key", "current_key",
           "current_keys", "load_table", "read_json", "check_entry", "entry_source", "gain_at", "nearest", "warn_once"]

log = logging.getLogger("distfuse.dispatch")

FORMAT = 1
NEVER = -1.0  # max_size of a "fused never" entry: every size is >= 0
SOURCES = ("measured", "projected")
#: The table shipped in the package (package data; regenerate with ``distfuse-tune project``).
SHIPPED = Path(__file__).with_name("crossover_shipped.json")

_TABLE_CACHE: dict[str, tuple[int, dict]] = {}
_LOGGED: set[str] = set()


def table_path() -> Path:
    """Where dispatch reads and the tuner writes by default."""
    env = os.environ.get("DISTFUSE_TUNE_TABLE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distfuse" / "crossover.json"


def shipped_path() -> Path | None:
    """The shipped table: ``$DISTFUSE_SHIPPED_TABLE`` (a path), None where it is ``off``/``0``, else :data:`SHIPPED`."""
    env = os.environ.get("DISTFUSE_SHIPPED_TABLE", "").strip()
    if env.lower() in ("0", "off", "none", "no", "false"):
        return None
    return Path(env) if env else SHIPPED


def table_key(device_name: str, world_size: int, dtype: torch.dtype, op: str) -> str:
    """``"device|world|dtype|op"``, e.g. ``"NVIDIA H200|8|bfloat16|matmul_reduce_scatter"``."""
    return f"{device_name}|{world_size}|{str(dtype).removeprefix('torch.')}|{op}"


def current_key(key: str) -> str:
    """``key`` with a renamed op's former name replaced by its current one (``...|linear_rs`` -> ``...|matmul_...``)."""
    head, sep, op = key.rpartition("|")
    return f"{head}{sep}{current_name(op)}" if sep else key


def current_keys(entries: dict) -> dict:
    """``entries`` keyed by :func:`current_key`; an entry already under the current key beats a former one."""
    out = {}
    for k, v in entries.items():
        new = current_key(k)
        if new == k or new not in entries:
            out[new] = v
    return out


_FUSED_VALUES = ("interval", "always", "threshold", "never")  # "always": crossover_fit wins at every size


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return _is_real(v) and math.isfinite(v)


def _rows(v, width: int, row_ok) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == width and row_ok(p) for p in v)


#: What each optional key of an entry must be, ``key -> (check, what)``, checked in this order.
_ENTRY_RULES = {
    "min_size": (lambda v: _is_real(v) and not math.isnan(v), "a number or null"),
    "max_size": (lambda v: _is_real(v) and not math.isnan(v), "a number or null"),
    "fused": (lambda v: v in _FUSED_VALUES, f"one of {_FUSED_VALUES}"),
    "provider": (lambda v: isinstance(v, str), "a string"),
    "provider_sizes": (lambda v: _rows(v, 2, lambda p: _is_real(p[0]) and isinstance(p[1], str)),
                       "a list of [size, provider name]"),
    "source": (lambda v: v in SOURCES, f"one of {SOURCES}"),
    "gain": (_is_number, "a number or null"),
    "margin": (_is_number, "a number or null"),
    "gains": (lambda v: _rows(v, 3, lambda g: all(_is_number(x) for x in g)), "a list of [size, gain, margin] numbers"),
}


def check_entry(path, key: str, entry) -> None:
    """Raise :class:`ConfigError` naming the file and the entry unless ``entry`` is a well-formed crossover entry:
    a JSON object whose keys follow :data:`_ENTRY_RULES` (``provider`` and ``provider_sizes`` are read by
    :func:`distfuse.fused.providers.select_provider`)."""
    where_ = f"crossover table {path}: entry {key!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where_} must be a JSON object, got {type(entry).__name__} {entry!r:.80}")
    for name, (ok, what) in _ENTRY_RULES.items():
        v = entry.get(name)
        if v is not None and not ok(v):
            raise ConfigError(f"{where_}: {name} must be {what}, got {v!r:.80}")


def entry_source(entry: dict) -> str | None:
    """``"measured"`` or ``"projected"``: the entry's ``source``; a tuner entry from before sources (it has
    ``points``) is ``"measured"``; a hand-written entry None."""
    source = entry.get("source")
    if source is None and entry.get("points") is not None:
        return "measured"
    return source


def nearest(points: list, size: float):
    """The point of ``points`` (lists whose first entry is a size) whose size is nearest ``size``, in log scale."""
    def distance(point):
        s = float(point[0])
        return abs(math.log(s) - math.log(size)) if s > 0 and size > 0 else abs(s - size)
    return min(points, key=distance)


def gain_at(entry: dict, size: float) -> tuple[float, float, float] | None:
    """``(size, gain, margin)`` of the entry's evaluated size nearest ``size`` (in log scale), else its decisive
    ``gain``/``margin`` (size None), else None."""
    gains = entry.get("gains")
    if isinstance(gains, list) and gains:
        s, g, m = nearest(gains, size)
        return float(s), float(g), float(m)
    if entry.get("gain") is not None:
        return None, float(entry["gain"]), float(entry.get("margin") or 0.0)
    return None


_MERGED: dict[tuple, dict] = {}


def load_table(path: Path | str | None = None) -> dict:
    """The crossover entries dispatch reads (empty if absent or unreadable); re-read when a file changes.

    Without ``path``: the user's table (:func:`table_path`) over the shipped one
    (:func:`shipped_path`), key by key, each entry annotated with ``_table`` (its file) and
    ``_shipped``.  With ``path``: that file's entries alone, as written.  Only the entries
    (keys with a ``|``) are returned; sections are read with :func:`read_json`.
    """
    if path is None:
        return _merged(table_path(), shipped_path())
    return _load_file(Path(path))


def _merged(user: Path, shipped: Path | None) -> dict:
    if shipped == user:
        shipped = None
    stamp = (str(user), _mtime(user), str(shipped), _mtime(shipped) if shipped is not None else None)
    cached = _MERGED.get(stamp)
    if cached is not None:
        return cached
    base = _load_file(shipped) if shipped is not None else {}
    out = {k: dict(v, _table=str(shipped), _shipped=True) for k, v in base.items()}
    out.update({k: dict(v, _table=str(user), _shipped=False) for k, v in _load_file(user).items()})
    _MERGED.clear()  # one merged view at a time: the files changed, or the environment points elsewhere
    _MERGED[stamp] = out
    return out


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _load_file(path: Path) -> dict:
    mtime = _mtime(path)
    if mtime is None:
        return {}
    cached = _TABLE_CACHE.get(str(path))
    if cached and cached[0] == mtime:
        return cached[1]
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        table = _ignored(path, f"ignoring unreadable crossover table {path}: {exc}")
    if not isinstance(table, dict):
        table = _ignored(path, f"ignoring crossover table {path}: its top level is not a JSON object")
    table = current_keys({k: v for k, v in table.items() if "|" in k})
    for k, v in table.items():
        check_entry(path, k, v)
    _TABLE_CACHE[str(path)] = (mtime, table)
    return table


def warn_once(key: str, msg: str) -> None:
    """Log ``msg`` as a warning of logger ``distfuse.dispatch``, once per ``key``."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)


def _ignored(path: Path, why: str) -> dict:
    """An empty table in place of the file at ``path``, said once per file."""
    warn_once(f"table:{path}", f"distfuse: {why}")
    return {}


def read_json(path: Path | str | None = None) -> dict:
    """The whole table file, sections included (empty if absent or unreadable)."""
    path = Path(path) if path is not None else table_path()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
