"""The crossover table's writer: the tuner merges its entries into the file atomically.

The format, the location and the reader are :mod:`distfuse.fused.crossover_table`'s (so the
layers never import the tuner), re-exported here for the tuner's callers.

:func:`write_table` writes a temporary file beside the table and renames it over it, so a
reader never sees half a file; the file gets the mode a new file would (``0o666 & ~umask``),
not ``mkstemp``'s 0600.  An existing table that cannot be read, or holds a malformed entry,
is moved aside to ``<name>.unreadable-<timestamp>`` with a warning (never overwritten
silently).  Keys under a renamed op's former name are rewritten under the current one.  A
``"source": "projected"`` entry never replaces a measured one already in the file
(:func:`~distfuse.fused.crossover_table.entry_source`; the writer keeps it and warns); a
measured entry replaces anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

from distfuse.errors import ConfigError
from distfuse.fused.crossover_table import (
    FORMAT,
    check_entry,
    current_keys,
    entry_source,
    load_table,
    read_json,
    table_key,
    table_path,
)

__all__ = ["FORMAT", "table_path", "table_key", "load_table", "read_json", "write_table", "write_text_atomic",
           "check_entry"]

log = logging.getLogger("distfuse.dispatch")


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
        for k, v in current_keys({k: v for k, v in data.items() if "|" in k}).items():
            check_entry(path, k, v)
    except ConfigError as exc:
        return str(exc)
    return None


def _move_aside(path: Path, why: str) -> None:
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


def write_table(path: Path | str | None, entries: dict | None = None, *, triton_configs: dict | None = None,
                sweeps: dict | None = None, run_meta: dict | None = None, extra_meta: dict | None = None) -> Path:
    """Merge into the crossover table at ``path`` (default: :func:`table_path`) and write it atomically.

    ``entries``: ``table_key -> entry``; ``triton_configs`` and ``sweeps``: keyed the same;
    ``run_meta``: ``"device|world" -> info`` for ``_meta.runs``; ``extra_meta``: more keys for
    ``_meta``.  Keys already in the file and not given are kept (see the module doc for
    unreadable files, renamed ops and projected entries); a malformed entry given here raises
    :class:`ConfigError`.
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
    table.update(current_keys({k: v for k, v in old.items() if "|" in k}))
    for section, new in (("triton_configs", triton_configs), ("sweeps", sweeps)):
        if isinstance(table.get(section), dict):
            table[section] = current_keys(table[section])
        if new:
            _section(table, section).update(new)
    kept = [k for k, v in (entries or {}).items() if entry_source(v) == "projected" and isinstance(table.get(k), dict)
            and entry_source(table[k]) == "measured"]
    if kept:
        log.warning(f"distfuse-tune: kept the measured entries of {path} for {kept}: a projected entry never "
                    "replaces a measured one")
    table.update({k: v for k, v in (entries or {}).items() if k not in kept})
    meta = _section(table, "_meta")
    meta.update(format=FORMAT, written_by="distfuse-tune")
    meta.update(extra_meta or {})
    if run_meta:
        _section(meta, "runs").update(run_meta)
    return write_text_atomic(path, json.dumps(table, indent=1, sort_keys=True) + "\n")


def _section(parent: dict, name: str) -> dict:
    """``parent[name]``, replaced by an empty dict where it is not a dict."""
    if not isinstance(parent.get(name), dict):
        parent[name] = {}
    return parent[name]


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path`` (mode ``0o666 & ~umask``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)  # read it (os.umask sets it): the mode open() gives a new file, not mkstemp's 0600
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # readers (dispatch re-reads on mtime change) never see a half-written file
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
