"""Measured tiles: the launch configs a GPU run timed fastest, read by the pinned rules of the hot kernels.

A fused op on a real process group never autotunes (:func:`~distfuse.kernels._utils.pinned_gemm_config` says
why), so what it runs is a pinned rule: a function of the shape, the dtype and the SM count, reasoned from the
hardware.  A rule is a guess until a GPU times it against the alternatives.  This table carries what such a
timing showed, per device and shape, so that a real group runs the measured best without anyone editing a rule:

* ``scripts/gpu_diagnose.py`` times the alternatives on one GPU (sections ``forms``, ``persistent``,
  ``gathered``, ``reduce``) and records each kernel's :func:`kernel_fingerprint` in its ``env``;
* ``python -m distfuse.tune.tiles diagnose-*.json`` (:mod:`distfuse.tune.tiles`) keeps, per shape, the fastest
  config where it beats the rule's own config, measured in the same run, by at least ``--min-gain``, and writes
  the entries here;
* the pinned rules (:func:`measured_tile`, called once per shape: the rules are cached) take an entry whose
  device, kernel, dtype, world size, ``N`` and ``K`` match exactly, whose ``M`` is within a factor of
  :data:`ROWS_FACTOR` of the call's (the nearest), and whose fingerprint is the kernel's current one.

**Fingerprints keep stale entries out.**  A config measured on an earlier form of a kernel says nothing about
the current one (a change to the loop structure moves the best tile), so each entry carries the fingerprint of
the kernel's source at the time it was timed: a hash of the source of every ``@triton.jit`` function in the
kernel's module and in the ``distfuse`` modules those reach (:func:`kernel_fingerprint`; over-inclusive, so an
unrelated helper's change also retires the entry, never the reverse).  It is computed from the source text, so
it is the same under the interpreter (where the table is generated and tested) and compiled, and under any
Triton version.

**Precedence.**  ``$DISTFUSE_TILE_TABLE`` (a path; ``off`` ignores every table, the rules alone decide), else
``~/.cache/distfuse/tiles.json`` where it exists, is searched first; then the shipped table
(``distfuse/kernels/measured_tiles.json``, :data:`SHIPPED_TILES`).  A malformed file makes :func:`load_tiles`
raise :class:`~distfuse.errors.ConfigError` naming it and the entry; the rules' lookup (:func:`measured_tile`,
which runs inside a fused op's claim, where an exception would leave the peers to time out) warns once with that
message instead and ignores the file.

**Ranks may differ without harm.**  Each rank's tiling is local to its own launch: the producer raises a chunk's
flag when its own tiles of that chunk are stored, whatever their shape, and the consumers read whole slots.  So
two nodes with different tables stay correct (only their speeds differ).

Entry layout (``"tiles"``: a list)::

    {"format": 1, "tiles": [{"kernel": "matmul_scatter_persistent", "device": "NVIDIA H200", "dtype": "bfloat16",
      "W": 8, "M": 8192, "N": 4096, "K": 1792, "config": {"BLOCK_M": 128, ...}, "fingerprint": "3f2a9c...",
      "us": 150.1, "rule_us": 162.0, "metric": "graph_us", "anchor_us": 151.4, "commit": "...", "date": "...",
      "source": "measured"}]}

``M`` is the GEMM's rows (``chunk_reduce``: its output rows times ``W``), ``K`` is 0 for ``chunk_reduce``.
For ``halo_stage`` (one worker's staging, ``W`` 1) the key is the staging kernel's own view of the staged tensor:
``M`` its leading vectors (batch times channels in NCHW, the batch in channels last), ``N`` a staged row in
elements (the last staged extent, times the channels in channels last), ``K`` the staged rows per leading vector
(the product of the other staged extents); its config is the tile (``BLOCK_R``, ``BLOCK_X``, ``SLAB_X``,
``STRIP_X``, ``num_warps``) and the forms (``SPLIT``: the window's programs and the slabs' in two launches;
``WORDS``: the window's rows as flat words), read by :func:`~distfuse.kernels.halo_programs.stage_launch`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from distfuse.errors import ConfigError

__all__ = ["TILE_TABLE_ENV", "SHIPPED_TILES", "FORMAT", "TILE_KERNELS", "ROWS_FACTOR", "kernel_fingerprint",
           "CONFIG_KEYS", "user_tiles_path", "load_tiles", "check_tile", "measured_tile", "dtype_name", "device_name",
           "portable_config"]

TILE_TABLE_ENV = "DISTFUSE_TILE_TABLE"
SHIPPED_TILES = Path(__file__).with_name("measured_tiles.json")
FORMAT = 1
#: The kernels whose pinned rules read the table (their launch configs: the GEMM blocks and forms, the reduction's
#: ``BLOCK``, ``PER_SM`` and ``num_warps``, and its flag poll ``POLL_LOADS`` where a measurement chose it, or the
#: halo staging's tile and forms).
TILE_KERNELS = ("matmul_scatter_persistent", "gathered_matmul_persistent", "chunk_reduce", "halo_stage")
#: An entry serves calls whose rows are within this factor of its own (the nearest entry wins).
ROWS_FACTOR = 2.0
_REQUIRED = {"kernel": str, "device": str, "dtype": str, "W": int, "M": int, "N": int, "K": int, "config": dict,
             "fingerprint": str}
_GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
#: Per kernel: the config keys an entry must give (positive ints; the BLOCK_* and num_warps powers of two) and the
#: boolean keys it may give.  Anything else is refused: a misspelt key would reach the launch as a constexpr.
CONFIG_KEYS = {"matmul_scatter_persistent": (_GEMM_KEYS, ("FLATTEN", "SPAN")),
               "gathered_matmul_persistent": (_GEMM_KEYS, ("EPILOGUE_SUBTILE",)),
               "chunk_reduce": (("BLOCK", "PER_SM", "num_warps"), ("POLL_LOADS",)),
               "halo_stage": (("BLOCK_R", "BLOCK_X", "SLAB_X", "STRIP_X", "num_warps"), ("SPLIT", "WORDS"))}
#: Config keys that are block extents besides the ``BLOCK_*`` ones (``tl.arange`` sizes): powers of two too.
_POW2_KEYS = ("SLAB_X", "STRIP_X", "num_warps")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the table's spelling."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device) -> str | None:
    """``torch.cuda.get_device_name`` of a CUDA device (the table's key), else None (no entry applies)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())


#: Launch keys that follow from the shape or the device (recomputed at every launch): never stored in the table.
_DERIVED = ("W_BLOCK", "PROGRAMS", "FLAT", "BLOCK_C", "kernel")


def portable_config(meta: dict) -> dict:
    """A launch meta without the keys the launcher derives (``W_BLOCK``, ``PROGRAMS``, ...): what a table entry
    stores and what two launches are compared by."""
    return {k: v for k, v in meta.items() if k not in _DERIVED}


def _jit_source(obj) -> str | None:
    """The Python source of a ``@triton.jit`` function (compiled or interpreted), else None."""
    fn = getattr(obj, "fn", None)
    if not inspect.isfunction(fn) or not hasattr(obj, "arg_names"):
        return None
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=64)
def _fingerprint_of_module(module_name: str) -> str:
    seen, queue, parts = set(), [module_name], []
    while queue:
        name = queue.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for attr, value in sorted(vars(sys.modules[name]).items()):
            if inspect.ismodule(value) and value.__name__.startswith("distfuse."):
                queue.append(value.__name__)
                continue
            src = _jit_source(value)
            if src is None:
                continue
            home = value.fn.__module__
            if home != name:  # an imported helper: hashed (with its module's) where it is defined
                if home.startswith("distfuse."):
                    queue.append(home)
                continue
            parts.append(f"{name}.{attr}\n{src}")
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:16]


def kernel_fingerprint(kernel) -> str:
    """A hash of ``kernel``'s source and of every ``@triton.jit`` function its module reaches (see the module doc):
    16 hex digits, the same interpreted or compiled and under any Triton version."""
    fn = getattr(kernel, "fn", kernel)
    return _fingerprint_of_module(fn.__module__)


def user_tiles_path() -> Path | None:
    """The user's table: ``$DISTFUSE_TILE_TABLE``, else ``~/.cache/distfuse/tiles.json`` (None if ``off``)."""
    env = os.environ.get(TILE_TABLE_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distfuse" / "tiles.json"


def check_tile(entry, path, i: int) -> dict:
    """``entry`` if well formed, else :class:`~distfuse.errors.ConfigError` naming the file and the entry."""
    if not isinstance(entry, dict):
        raise ConfigError(f"tile table {path}: entry {i} is a {type(entry).__name__}, not an object")
    for key, kind in _REQUIRED.items():
        if not isinstance(entry.get(key), kind) or (kind is int and isinstance(entry.get(key), bool)):
            raise ConfigError(f"tile table {path}: entry {i} ({entry.get('kernel')!r}) needs {key!r} as "
                              f"{kind.__name__}, has {entry.get(key)!r}")
    if entry["kernel"] not in TILE_KERNELS:
        raise ConfigError(f"tile table {path}: entry {i} names kernel {entry['kernel']!r}; the table serves "
                          f"{', '.join(TILE_KERNELS)}")
    if min(entry["W"], entry["M"], entry["N"]) < 1 or entry["K"] < 0:
        raise ConfigError(f"tile table {path}: entry {i} ({entry['kernel']}) has a non-positive extent: "
                          f"W={entry['W']} M={entry['M']} N={entry['N']} K={entry['K']}")
    ints, flags = CONFIG_KEYS[entry["kernel"]]
    config = entry["config"]
    unknown = sorted(set(config) - set(ints) - set(flags))
    missing = [k for k in ints if k not in config]
    bad = [k for k in ints if k in config and (type(config[k]) is not int or config[k] < 1
                                               or (k.startswith("BLOCK") or k in _POW2_KEYS)
                                               and config[k] & (config[k] - 1))]
    bad += [k for k in flags if k in config and type(config[k]) is not bool]
    if unknown or missing or bad:
        raise ConfigError(f"tile table {path}: entry {i} ({entry['kernel']}) has a config the launch cannot take: "
                          + "; ".join(f"{what} {', '.join(keys)}" for what, keys in
                                      (("unknown keys", unknown), ("missing", missing), ("bad values of", bad))
                                      if keys)
                          + f" (it needs {', '.join(ints)} as positive ints, powers of two for the blocks and "
                          f"num_warps{', and may set ' + ', '.join(flags) + ' as booleans' if flags else ''})")
    return entry


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> tuple:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tile table {path}: not readable as JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tiles"), list):
        raise ConfigError(f"tile table {path}: expected {{\"format\": {FORMAT}, \"tiles\": [...]}}")
    return tuple(check_tile(e, path, i) for i, e in enumerate(data["tiles"]))


def load_tiles(path: Path | str) -> tuple:
    """The checked entries of one table file (cached per path and modification time); ``()`` if it is absent."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return ()
    return _read(str(path), mtime)


_WARNED: set = set()


def _usable(path: Path) -> tuple:
    """:func:`load_tiles`, or ``()`` and one warning per file version where it is malformed: a launch already
    inside its claim must not fail on a tuning file (its peers would only see a timeout), and the rules stand in."""
    try:
        return load_tiles(path)
    except ConfigError as exc:
        key = (str(path), path.stat().st_mtime_ns if path.exists() else 0)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"distfuse: {exc}; the pinned rules decide instead (distfuse-tune tiles --write rewrites a "
                          "table, python -c 'from distfuse.kernels.tile_table import load_tiles; load_tiles(PATH)' "
                          "checks one)", RuntimeWarning, stacklevel=3)
        return ()


def _tables() -> list[tuple]:
    user = user_tiles_path()
    if user is None:
        return []
    return [_usable(user), _usable(SHIPPED_TILES)]


def measured_tile(kernel_name: str, kernel, device_name: str | None, dtype: torch.dtype, M: int, N: int, K: int,
                  W: int) -> dict | None:
    """The measured config for this launch (a copy), or None: the rule decides.

    ``device_name``: ``torch.cuda.get_device_name`` of the launch's device (None: no GPU, no entry).  ``K``: 0
    matches any entry's ``K`` (``chunk_reduce`` does not know it).  The user's table is searched before the
    shipped one; in each, entries of the same device, kernel, dtype, ``W``, ``N`` and ``K`` and of the kernel's
    current fingerprint, whose ``M`` is within :data:`ROWS_FACTOR` of this one; the nearest ``M`` wins (the
    first of ties).  Called by cached pinned rules, so its cost is once per shape.
    """
    if device_name is None or M < 1:
        return None
    want = dtype_name(dtype)
    fingerprint = None
    for table in _tables():
        best, best_d = None, math.log2(ROWS_FACTOR) + 1e-9
        for e in table:
            if (e["kernel"] != kernel_name or e["device"] != device_name or e["dtype"] != want or e["W"] != W
                    or e["N"] != N or (K and e["K"] != K)):
                continue
            fingerprint = fingerprint or kernel_fingerprint(kernel)
            if e["fingerprint"] != fingerprint:
                continue
            d = abs(math.log2(M / e["M"]))
            if d < best_d:
                best, best_d = e, d
        if best is not None:
            return dict(best["config"])
    return None
