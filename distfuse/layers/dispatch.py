"""Shape-based choice between the fused and the unfused path of a layer.

:func:`select_path` is a pure function of the op, the shapes, the dtype, the world size
and the device's capabilities.  In order of precedence:

1. ``DISTFUSE_PATH=fused|unfused|auto`` in the environment (``auto`` = no override).
   Forcing ``fused`` where it cannot run at all (no symmetric memory for a GEMM
   fusion) still falls back, and says so.
2. A crossover table written by ``distfuse-tune`` (JSON; ``DISTFUSE_TUNE_TABLE`` or
   ``~/.cache/distfuse/crossover.json``; format and reading in :mod:`distfuse.tune.table`),
   keyed by device name, world size, dtype and op.  Each entry is a threshold on the op's
   size (``size_key`` in the registry): fused at or above ``min_size`` (and at or below
   ``max_size`` when given).  An entry may also name the fastest provider per size;
   a fused :class:`Decision` carries the provider the op will run
   (:func:`distfuse.fused.providers.select_provider`).
   fp32 calls of the Triton GEMM fusions (``triton_gemm`` in the registry) stay unfused
   on CUDA unless torch allows TF32 (:func:`distfuse.kernels._utils.tf32_allowed`), before
   the table is read: the fused kernels then multiply in IEEE fp32 on the CUDA cores, and
   a table entry does not record the TF32 setting it was measured under.  Where TF32 is
   allowed, the fused fp32 kernels use it too (``input_precision="tf32"``), like
   ``torch.matmul``.
3. The op's default rule in :mod:`distfuse.fused.registry`.  Defaults are starting points
   until a sweep on the user's machine replaces them; each says what it rests on.

The ops themselves (names, sizes, defaults, whether they need symmetric memory) are the
registry's; this module holds no per-op knowledge.

On CPU the production path is always unfused: the Triton interpreter exists for tests,
which force the fused path explicitly.

Layers call :func:`select_path`, record the decision in ``last_path``, and keep the
:class:`Decision` (with its reason) so that ``layer.explain(x)`` can say why.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from distfuse.fused import registry
from distfuse.tune.table import load_table, table_key

__all__ = [
    "DeviceCaps",
    "Decision",
    "select_path",
    "device_caps",
    "load_table",
    "table_key",
]

log = logging.getLogger("distfuse.dispatch")

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
    provider: str | None = None  # the fused path's implementation (distfuse.fused.providers); None when unfused


def device_caps(device: torch.device, symmetric_memory: bool | None = None) -> DeviceCaps:
    """Capabilities of ``device``; ``symmetric_memory`` is decided by the workspace module when known."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return DeviceCaps("cuda", name, bool(symmetric_memory), True)
    return DeviceCaps(device.type, device.type, bool(symmetric_memory), False)


def _log_once(key: str, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)


def select_path(op: str, shapes: dict, dtype: torch.dtype, world_size: int, caps: DeviceCaps,
                table: dict | None = None) -> Decision:
    """Choose ``"fused"`` or ``"unfused"`` for one call of ``op``; pure apart from reading the environment.

    Args:
        op: a registered fused op (:func:`distfuse.fused.registry.names`: ``"halo_conv"``,
            ``"matmul_reduce_scatter"``, ``"all_gather_matmul"``, their feature-split forms
            ``"matmul_reduce_scatter_features"`` and ``"all_gather_features_matmul"``, and
            ``"matmul_all_reduce"``).
        shapes: the op's sizes (its ``size_inputs``): ``channels`` for halo_conv; ``m``, ``n``, ``k``
            (per-rank GEMM) for the linears.
        dtype, world_size: as the call sees them.
        caps: :func:`device_caps` of the call's device.
        table: a crossover table (defaults to :func:`load_table`).
    """
    spec = registry.get(op)
    size = spec.size_of(shapes)
    override = os.environ.get("DISTFUSE_PATH", "auto").strip().lower()
    if override not in ("auto", "fused", "unfused"):
        raise ValueError(f"DISTFUSE_PATH must be fused, unfused or auto, got {override!r}")
    if override == "unfused":
        return Decision("unfused", "DISTFUSE_PATH=unfused")
    if spec.needs_symmetric_memory and world_size > 1 and not caps.symmetric_memory:
        reason = f"{op}: no symmetric memory between the ranks on {caps.name}; using the unfused path"
        _log_once(f"nosymm:{op}:{caps.name}", "distfuse: " + reason)
        return Decision("unfused", reason)
    if override == "fused":
        return _fused(op, shapes, dtype, world_size, caps, table, "DISTFUSE_PATH=fused")
    if caps.device_type != "cuda":
        return Decision("unfused", f"{caps.device_type}: the production path is unfused (Triton runs interpreted)")
    if dtype == torch.float32 and spec.triton_gemm:
        from distfuse.kernels._utils import tf32_allowed

        if not tf32_allowed():
            # Before the table: an entry does not record whether TF32 was on when it was measured.
            return Decision("unfused", f"{op}: fp32 without TF32 (torch.backends.cuda.matmul.allow_tf32 is off and "
                                       "the float32 matmul precision is 'highest'): the fused Triton GEMM would "
                                       "multiply in IEEE fp32 on the CUDA cores, far below cuBLAS; allow TF32 "
                                       "(the fused kernels then use it too) or set DISTFUSE_PATH=fused")
    table = load_table() if table is None else table
    entry = table.get(table_key(caps.name, world_size, dtype, op))
    if entry is not None:
        if entry.get("fused") == "never":
            return Decision("unfused", f"crossover table: fused never wins for {op} here")
        lo, hi = entry.get("min_size"), entry.get("max_size")
        path = "fused" if registry.in_interval(size, lo, hi) else "unfused"
        reason = (f"crossover table: {spec.size_key}={size:g}, fused for "
                  f"[{-math.inf if lo is None else lo:g}, {math.inf if hi is None else hi:g}]")
        return _fused(op, shapes, dtype, world_size, caps, table, reason) if path == "fused" \
            else Decision(path, reason)
    default = spec.default
    if default.fused == "never":
        return Decision("unfused", f"default: {default.why}; a distfuse-tune table entry can enable it")
    path = "fused" if default.fused_at(size) else "unfused"
    why = f" ({default.why})" if default.why else ""
    reason = f"default: {default.describe(spec.size_key)}, got {size:g}{why}"
    return _fused(op, shapes, dtype, world_size, caps, table, reason) if path == "fused" else Decision(path, reason)


def _fused(op: str, shapes: dict, dtype: torch.dtype, world_size: int, caps: DeviceCaps, table: dict | None,
           reason: str) -> Decision:
    """A fused decision with its provider (:func:`distfuse.fused.providers.select_provider`, the same rule the
    fused op applies when the layer passes no provider)."""
    from distfuse.fused.providers import select_provider

    return Decision("fused", reason, select_provider(op, shapes, dtype, world_size, caps.name, table))
