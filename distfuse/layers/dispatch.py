"""Shape-based choice between the fused and the unfused path of a layer.

:func:`select_path` is a pure function of the op, the shapes, the dtype, the world size
and the device's capabilities.  In order of precedence:

1. ``DISTFUSE_PATH=fused|unfused|auto`` in the environment (``auto`` = no override).
   Forcing ``fused`` where it cannot run at all (no symmetric memory for a GEMM fusion)
   still falls back, and says so.
2. A crossover table entry, keyed by device name, world size, dtype and op: the user's table
   over the shipped one (:mod:`distfuse.fused.crossover_table` says where each lives).  It fuses
   for ``min_size <= size <= max_size`` and may name the fastest provider per size, which a fused
   :class:`Decision` carries.  Before the table, fp32 calls of the Triton GEMM fusions stay
   unfused on CUDA unless torch allows TF32 (:func:`distfuse.kernels._utils.tf32_allowed`): the fused
   kernels would multiply in IEEE fp32 on the CUDA cores, and an entry does not record the TF32
   setting it was measured under (where TF32 is allowed, the fused kernels use it too, like ``torch.matmul``).
3. The op's default rule in :mod:`distfuse.fused.registry` (which holds every per-op fact),
   a starting point until a sweep on the user's machine replaces it.

On CPU the production path is always unfused: the Triton interpreter exists for tests.
Layers keep the :class:`Decision` (its reason and the :class:`EntryRef` that decided) in
``last_decision``; ``layer.explain(x)`` runs under :func:`dry_run`, where nothing
communicates (the linears' symmetric-memory probe answers from its cache or is assumed,
and the decision's ``caveat`` says so).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import torch

from distfuse.fused import registry
from distfuse.fused.crossover_table import entry_source, gain_at, load_table, table_key, warn_once
from distfuse.fused.providers import select_provider
from distfuse.fused.symmetric_availability import no_probe, probing_blocked

__all__ = ["DeviceCaps", "Decision", "EntryRef", "select_path", "dry_run", "is_dry", "DryExplain",
           "device_caps", "load_table", "table_key"]


@dataclass(frozen=True)
class DeviceCaps:
    """What the fused paths need from the device."""

    device_type: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H200"; "cpu" on CPU
    symmetric_memory: bool  # peers' buffers addressable from kernels (GEMM fusions)
    triton: bool  # Triton kernels can run natively (not interpreted)


@dataclass(frozen=True)
class EntryRef:
    """Which entry decided a call: a crossover-table entry (``kind="table"``) or the op's default rule (``"default"``).

    ``table``: the file (None for a dict); ``shipped``: the package's table; ``source``: ``"measured"`` or
    ``"projected"`` (None for a hand-written entry); ``gain = unfused_ms / fused_ms - 1`` and its ``margin`` (what the
    pessimistic end of the inputs takes off it) at ``at_size``, the evaluated size nearest the call's; ``rule``: the
    interval the entry or the default fuses in.
    """

    kind: str
    op: str
    size_key: str
    size: float
    rule: str
    key: str | None = None
    table: str | None = None
    shipped: bool = False
    source: str | None = None
    gain: float | None = None
    margin: float | None = None
    at_size: float | None = None

    def describe(self) -> str:
        if self.kind == "default":
            return f"the registry's default rule for {self.op} ({self.rule}); no crossover-table entry for this key"
        where_ = ("the shipped table " if self.shipped else "the table ") + self.table if self.table else "a table"
        what = f"{self.source} entry" if self.source else "entry"
        out = f"{what} {self.key!r} of {where_} ({self.rule})"
        return out + (f", {self.source or 'its'} {self.gain_text()}" if self.gain is not None else "")

    def gain_text(self) -> str:
        at = f" at {self.size_key}={self.at_size:g}" if self.at_size is not None else ""
        return f"gain {self.gain:+.1%} ± {self.margin or 0.0:.1%}{at}"


@dataclass(frozen=True)
class Decision:
    """``path`` ("fused" or "unfused"), ``reason``, the fused ``provider`` (:mod:`distfuse.fused.providers`) and the
    ``entry`` that decided (None where none was consulted: an override, CPU, fp32 without TF32, no symmetric memory,
    a form with no fused op).  Not part of equality, so that ``explain``'s decision equals the forward's: the
    ``kernel`` that ran the fused call and why (``kernel_reason``: a provider's fallback, ``KernelChoice``), and
    the ``caveat`` of a dry decision (what it could not check without communicating)."""

    path: str
    reason: str
    provider: str | None = None
    kernel: str | None = field(default=None, compare=False)
    kernel_reason: str | None = field(default=None, compare=False)
    entry: EntryRef | None = None
    caveat: str | None = field(default=None, compare=False)

    def describe(self) -> str:
        """One line: the path (and provider, kernel), why, and which entry decided."""
        out = self.path + (f" ({self.provider})" if self.provider else "") + f": {self.reason}"
        if self.kernel:
            out += f"; kernel {self.kernel}" + (f" ({self.kernel_reason})" if self.kernel_reason else "")
        if self.entry is not None:
            out += f"; decided by {self.entry.describe()}"
        if self.caveat:
            out += f"; {self.caveat}"
        return out


def dry_run():
    """Inside: decisions ask nothing that communicates (:func:`is_dry`; ``layer.explain`` runs under it): the
    symmetric-memory probe answers from its cache or raises ``NotProbedError`` (recorded as a ``caveat``)."""
    return no_probe()


def is_dry() -> bool:
    """Whether the current thread is inside :func:`dry_run` (a layer's ``explain``)."""
    return probing_blocked()


class DryExplain:
    """Mixin of the layers that dispatch: every ``explain`` a subclass defines runs under :func:`dry_run`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("explain")
        if callable(method) and not getattr(method, "_distfuse_dry", False):
            @functools.wraps(method)
            def dry(*args, **kwargs):
                with dry_run():
                    return method(*args, **kwargs)
            dry._distfuse_dry = True
            cls.explain = dry


def device_caps(device: torch.device, symmetric_memory: bool | None = None) -> DeviceCaps:
    """Capabilities of ``device``; ``symmetric_memory`` is decided by the workspace module when known."""
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else device.type
    return DeviceCaps(device.type, name, bool(symmetric_memory), cuda)


def select_path(op: str, shapes: dict, dtype: torch.dtype, world_size: int, caps: DeviceCaps,
                table: dict | None = None) -> Decision:
    """Choose ``"fused"`` or ``"unfused"`` for one call of ``op``; pure apart from reading the environment.

    Args:
        op: a registered fused op (:func:`distfuse.fused.registry.names`).
        shapes: the op's sizes (its ``size_inputs``): ``elements`` for halo_conv; ``m``, ``n``, ``k``
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
        warn_once(f"nosymm:{op}:{caps.name}", "distfuse: " + reason)
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
    key = table_key(caps.name, world_size, dtype, op)
    entry = table.get(key)
    if entry is not None and entry.get("size_key", spec.size_key) != spec.size_key:
        # Written when the op was sized otherwise (halo_conv by channels, before it was sized by elements): its
        # bounds compare another quantity, so the default rule decides instead.
        warn_once(f"sizekey:{key}:{entry.get('_table')}",
                  f"distfuse: crossover entry {key} in {entry.get('_table')} compares {entry['size_key']}, but "
                  f"{op} is sized by {spec.size_key} now: entry ignored (rerun distfuse-tune to replace it)")
        entry = None
    if entry is not None:
        ref = _table_ref(op, spec, size, key, entry)
        if entry.get("fused") == "never":
            return Decision("unfused", f"crossover table: fused never wins for {op} here{_gain_note(ref)}", entry=ref)
        fused = registry.in_interval(size, entry.get("min_size"), entry.get("max_size"))
        reason = f"crossover table: {spec.size_key}={size:g}, {ref.rule}{_gain_note(ref)}"
    else:
        default = spec.default
        ref = EntryRef("default", op, spec.size_key, size, default.describe(spec.size_key))
        if default.fused == "never":
            return Decision("unfused", f"default: {default.why}; a distfuse-tune table entry can enable it", entry=ref)
        fused = default.fused_at(size)
        why = f" ({default.why})" if default.why else ""
        reason = f"default: {default.describe(spec.size_key)}, got {size:g}{why}"
    return _fused(op, shapes, dtype, world_size, caps, table, reason, ref) if fused \
        else Decision("unfused", reason, entry=ref)


def _table_ref(op: str, spec, size: float, key: str, entry: dict) -> EntryRef:
    """The :class:`EntryRef` of a table entry for a call of ``size``."""
    if entry.get("fused") == "never":
        rule = "fused never"
    else:
        lo, hi = entry.get("min_size"), entry.get("max_size")
        rule = f"fused for [{-math.inf if lo is None else lo:g}, {math.inf if hi is None else hi:g}]"
    g = gain_at(entry, size)
    return EntryRef("table", op, spec.size_key, size, rule, key=key, table=entry.get("_table"),
                    shipped=bool(entry.get("_shipped")), source=entry_source(entry),
                    gain=None if g is None else g[1], margin=None if g is None else g[2],
                    at_size=None if g is None else g[0])


def _gain_note(ref: EntryRef) -> str:
    """`` (projected: gain -12.0% ± 4.0% at macs=6e+10)`` for entries that carry gains (sourced ones); else ``""``."""
    return "" if ref.gain is None or ref.source is None else f" ({ref.source}: {ref.gain_text()})"


def _fused(op: str, shapes: dict, dtype: torch.dtype, world_size: int, caps: DeviceCaps, table: dict | None,
           reason: str, entry: EntryRef | None = None) -> Decision:
    """A fused decision with its provider (:func:`distfuse.fused.providers.select_provider`, the same rule the
    fused op applies when the layer passes no provider)."""
    return Decision("fused", reason, select_provider(op, shapes, dtype, world_size, caps.name, table), entry=entry)
