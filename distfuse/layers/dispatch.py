"""Shape-based choice between the fused and the unfused path of a layer.

:func:`select_path` is a pure function of the op, the shapes, the dtype, the world size
and the device's capabilities.  In order of precedence:

1. ``DISTFUSE_PATH=fused|unfused|auto`` in the environment (``auto`` = no override).
   Forcing ``fused`` where it cannot run at all (no symmetric memory for a GEMM
   fusion) still falls back, and says so.
2. A crossover table written by ``distfuse-tune`` (JSON; ``DISTFUSE_TUNE_TABLE`` or
   ``~/.cache/distfuse/crossover.json``), keyed by device name, world size, dtype and
   op.  Each entry is a threshold on the op's size key (see :data:`SIZE_KEYS`): fused
   at or above ``min_size`` (and at or below ``max_size`` when given).
3. The named default thresholds below.  They are starting points until a sweep on the
   user's machine replaces them; each says what it rests on.

On CPU the production path is always unfused: the Triton interpreter exists for tests,
which force the fused path explicitly.

Layers call :func:`select_path`, record the decision in ``last_path``, and keep the
:class:`Decision` (with its reason) so that ``layer.explain(x)`` can say why.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DeviceCaps",
    "Decision",
    "select_path",
    "device_caps",
    "load_table",
    "DEFAULT_THRESHOLDS",
    "SIZE_KEYS",
]

log = logging.getLogger("distfuse.dispatch")

# Defaults, one per fused op, used where no `distfuse-tune` table entry applies.  Measured on
# one NVIDIA H100 (torch 2.11, Triton 3.6; bench/results/*-NVIDIA*H100*-2026-11-22*.json):
# no fused op beat its unfused composition at any measured shape, so every default is
# "never" until the kernels improve or a table written on the target cluster says otherwise.
DEFAULT_THRESHOLDS = {
    # Halo conv, staging + conv: 1.0-3.3x the time of torch.cat staging + cuDNN (2-D, C=64/256,
    # bf16/fp32, median 2.1x), and 1.0-1.4x in 3-D.
    "halo_conv": dict(fused="never", why="staging + conv measured 1.0-3.3x the time of torch.cat staging + cuDNN "
                                         "(H100)"),
    # GEMM + reduce-scatter / all-gather + GEMM (bf16, TP 8, LLaMA-3 8B/70B MLP shapes): the Triton GEMMs reach
    # 27-76% (RS) and 15-66% (AG) of cuBLAS's rate, and the modelled 8-GPU op is 1.1-5x the unfused time.
    "linear_rs": dict(fused="never", why="the fused GEMM measured 27-76% of cuBLAS's rate (H100, bf16, TP 8)"),
    "linear_ag": dict(fused="never", why="the fused GEMM measured 15-66% of cuBLAS's rate (H100, bf16, TP 8)"),
}

# The scalar each op's table entries threshold on.
SIZE_KEYS = {"halo_conv": "channels", "linear_rs": "macs", "linear_ag": "macs"}

_LOGGED: set[str] = set()


@dataclass(frozen=True)
class DeviceCaps:
    """What the fused paths need from the device."""

    device_type: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H200"; "cpu" on CPU
    symmetric_memory: bool  # peers' buffers addressable from kernels (GEMM fusions)
    triton: bool  # Triton kernels can run natively (not interpreted)


@dataclass(frozen=True)
class Decision:
    path: str  # "fused" or "unfused"
    reason: str


def device_caps(device: torch.device, symmetric_memory: bool | None = None) -> DeviceCaps:
    """Capabilities of ``device``; ``symmetric_memory`` is decided by the workspace module when known."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return DeviceCaps("cuda", name, bool(symmetric_memory), True)
    return DeviceCaps(device.type, device.type, bool(symmetric_memory), False)


def _table_path() -> Path:
    env = os.environ.get("DISTFUSE_TUNE_TABLE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distfuse" / "crossover.json"


_TABLE_CACHE: dict[str, tuple[float, dict]] = {}


def load_table(path: Path | None = None) -> dict:
    """The crossover table (empty if absent); re-read when the file changes."""
    path = Path(path) if path is not None else _table_path()
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
        _log_once(f"table:{path}", f"distfuse: ignoring unreadable crossover table {path}: {exc}")
        table = {}
    # Entries are keyed "device|world|dtype|op"; other top-level keys (triton_configs, sweeps, _meta) are sections.
    table = {k: v for k, v in table.items() if "|" in k} if isinstance(table, dict) else {}
    _TABLE_CACHE[str(path)] = (mtime, table)
    return table


def table_key(device_name: str, world_size: int, dtype: torch.dtype, op: str) -> str:
    return f"{device_name}|{world_size}|{str(dtype).removeprefix('torch.')}|{op}"


def _log_once(key: str, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)


def size_of(op: str, shapes: dict) -> float:
    """The scalar an op's thresholds compare: channels for halo_conv, m*n*k for the GEMMs."""
    if op == "halo_conv":
        return float(shapes["channels"])
    if op in ("linear_rs", "linear_ag"):
        return float(math.prod((shapes["m"], shapes["n"], shapes["k"])))
    raise KeyError(f"select_path: unknown op {op!r}; known: {sorted(SIZE_KEYS)}")


def select_path(op: str, shapes: dict, dtype: torch.dtype, world_size: int, caps: DeviceCaps,
                table: dict | None = None) -> Decision:
    """Choose ``"fused"`` or ``"unfused"`` for one call of ``op``; pure apart from reading the environment.

    Args:
        op: ``"halo_conv"``, ``"linear_rs"`` or ``"linear_ag"``.
        shapes: the op's sizes: ``channels`` for halo_conv; ``m``, ``n``, ``k`` (per-rank GEMM) for the linears.
        dtype, world_size: as the call sees them.
        caps: :func:`device_caps` of the call's device.
        table: a crossover table (defaults to :func:`load_table`).
    """
    size = size_of(op, shapes)
    needs_symm = op in ("linear_rs", "linear_ag")
    override = os.environ.get("DISTFUSE_PATH", "auto").strip().lower()
    if override not in ("auto", "fused", "unfused"):
        raise ValueError(f"DISTFUSE_PATH must be fused, unfused or auto, got {override!r}")
    if override == "unfused":
        return Decision("unfused", "DISTFUSE_PATH=unfused")
    if needs_symm and world_size > 1 and not caps.symmetric_memory:
        reason = f"{op}: no symmetric memory between the ranks on {caps.name}; using the unfused path"
        _log_once(f"nosymm:{op}:{caps.name}", "distfuse: " + reason)
        return Decision("unfused", reason)
    if override == "fused":
        return Decision("fused", "DISTFUSE_PATH=fused")
    if caps.device_type != "cuda":
        return Decision("unfused", f"{caps.device_type}: the production path is unfused (Triton runs interpreted)")
    table = load_table() if table is None else table
    entry = table.get(table_key(caps.name, world_size, dtype, op))
    if entry is not None:
        if entry.get("fused") == "never":
            return Decision("unfused", f"crossover table: fused never wins for {op} here")
        lo = entry.get("min_size", -math.inf)
        hi = entry.get("max_size", math.inf)
        path = "fused" if lo <= size <= hi else "unfused"
        return Decision(path, f"crossover table: {SIZE_KEYS[op]}={size:g}, fused for [{lo:g}, {hi:g}]")
    default = DEFAULT_THRESHOLDS[op]
    if default.get("fused") == "never":
        return Decision("unfused", f"default: {default['why']}; a distfuse-tune table entry can enable it")
    if op == "halo_conv":
        path = "fused" if size <= default["max_channels"] else "unfused"
        return Decision(path, f"default: fused for channels <= {default['max_channels']}, got {size:g}")
    path = "fused" if size >= default["min_macs"] else "unfused"
    return Decision(path, f"default: fused for m*n*k >= {default['min_macs']:g}, got {size:g}")
