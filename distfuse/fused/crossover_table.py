"""The crossover table's reader: its file format, where it lives, reading and checking it.

Dispatch (:func:`distfuse.layers.dispatch.select_path`) and the provider choice
(:func:`distfuse.fused.providers.select_provider`) read the table; ``distfuse-tune`` writes
it (:func:`distfuse.tune.table.write_table`, which imports the format from here).  The
reader sits in ``fused/``, beside the registry whose op names key it, so that importing
the layers never loads the tuner (the arrows point down: tune imports dispatch, never the
other way round).

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
both paths on the node; entries without a ``source`` that carry ``points`` are the tuner's
too) or ``"projected"`` (modelled from one-GPU kernel times).  What dispatch reads
(:func:`load_table` without a path) is, key by key, the user's table over the shipped one;
within one file a measured entry is never replaced by a projected one
(:func:`distfuse.tune.table.write_table`).  Measured and projected entries may carry
``gain`` and ``margin`` (the decisive point) and ``gains`` (``[[size, gain, margin], ...]``);
``gain = unfused_ms / fused_ms - 1`` and ``margin`` how much of it the pessimistic end of
the inputs takes away, so that :meth:`distfuse.layers.dispatch.Decision.describe` can quote
them.  Each entry of the merged view carries ``_table`` (its file) and ``_shipped``.

Robustness.  The writer replaces the file atomically, so a reader never sees half a file.
:func:`load_table` raises :class:`~distfuse.errors.ConfigError` naming the file and the
entry when an entry is malformed (say ``"min_size": "big"``), and warns once and ignores a
file that is not JSON at all.

Renamed ops.  A table written before an op was renamed keys it by the former name
(``...|linear_rs`` for ``matmul_reduce_scatter``, ``...|linear_ag`` for
``all_gather_matmul``; :data:`distfuse.fused.registry.RENAMED`).  :func:`load_table` reads
such keys under the current name, and the writer rewrites them so; where a file holds
both, the entry under the current name wins.
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
           "current_keys", "load_table", "read_json", "check_entry", "entry_source", "gain_at"]

log = logging.getLogger("distfuse.dispatch")

FORMAT = 1
NEVER = -1.0  # max_size of a "fused never" entry: every size is >= 0
SOURCES = ("measured", "projected")
#: The table shipped in the package (package data; regenerate with ``distfuse-tune project``).
SHIPPED = Path(__file__).with_name("crossover_shipped.json")

_TABLE_CACHE: dict[str, tuple[float, dict]] = {}
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
    source = entry.get("source")
    if source is not None and source not in SOURCES:
        raise ConfigError(f"{where_}: source must be one of {SOURCES}, got {source!r:.80}")
    for name in ("gain", "margin"):
        v = entry.get(name)
        if v is not None and not _is_number(v):
            raise ConfigError(f"{where_}: {name} must be a number or null, got {v!r:.80}")
    gains = entry.get("gains")
    if gains is not None and not (isinstance(gains, list) and all(
            isinstance(g, list) and len(g) == 3 and all(_is_number(v) for v in g) for g in gains)):
        raise ConfigError(f"{where_}: gains must be a list of [size, gain, margin] numbers, got {gains!r:.80}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def entry_source(entry: dict) -> str | None:
    """``"measured"`` or ``"projected"``: the entry's ``source``; a tuner entry from before sources (it has
    ``points``) is ``"measured"``; a hand-written entry None."""
    source = entry.get("source")
    if source is None and entry.get("points") is not None:
        return "measured"
    return source


def gain_at(entry: dict, size: float) -> tuple[float, float, float] | None:
    """``(size, gain, margin)`` of the entry's evaluated size nearest ``size`` (in log scale), else its decisive
    ``gain``/``margin`` (size None), else None."""
    gains = entry.get("gains")
    if isinstance(gains, list) and gains:
        def distance(g):
            s = float(g[0])
            return abs(math.log(s) - math.log(size)) if s > 0 and size > 0 else abs(s - size)
        s, g, m = min(gains, key=distance)
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
    table = current_keys({k: v for k, v in table.items() if "|" in k})
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
