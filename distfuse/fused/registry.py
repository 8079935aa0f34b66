"""The fused ops, one entry each: what dispatch, ``distfuse-tune`` and ``bench/`` know about an op.

Every piece of code that lists the fused ops or needs one of their facts reads it here:

* :func:`distfuse.layers.dispatch.select_path`: the op's size (:meth:`FusedOp.size_of`),
  whether it needs symmetric memory, and its default rule where no crossover-table entry
  applies;
* ``distfuse-tune`` (:mod:`distfuse.tune`): the op names (``--ops``), the size key the
  table records, the default shape grid, the availability probe and the timing case;
* ``bench/``: op names and size keys (row names, plot axes).

Adding a fused op is its own module (kernel wrapper, timing case factory and shape grid;
see ``docs/extending.md``) plus one :class:`FusedOp` in :data:`OPS` below.

Defaults.  Every default is "never": on the one GPU measured (an H100), no fused op
beat its unfused composition at any shape, the GEMM fusions reaching at most 76% of
cuBLAS's rate (the run: ``docs/benchmarks.md``, "The fused ops' default rules").  They
stay so until the kernels improve or a table written by ``distfuse-tune`` on the target
cluster says otherwise.
A :meth:`DefaultRule.threshold` default (fused for ``min_size <= size <= max_size``)
is there for ops whose fused path wins.

Factories (``case``, ``grid``, ``available``) are ``"module:function"`` strings,
imported on first use (:func:`resolve`), so that importing the registry (dispatch
does, on every layer import) stays cheap and free of import cycles; a callable works too.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["in_interval",
           "DefaultRule", "FusedOp", "OPS", "RENAMED", "RENAMED_KERNELS", "register", "get", "names", "size_of",
           "resolve", "current_name", "MATMUL_REDUCE_SCATTER", "ALL_GATHER_MATMUL", "HALO_CONV",
           "MATMUL_REDUCE_SCATTER_FEATURES", "ALL_GATHER_FEATURES_MATMUL", "MATMUL_ALL_REDUCE", "ZERO_LINEAR_ROWS",
           "ZERO_LINEAR_COLUMNS"]


def in_interval(size: float, min_size: float | None, max_size: float | None) -> bool:
    """``min_size <= size <= max_size``, both bounds inclusive, a None bound open: the one rule that default
    rules, crossover fits and crossover-table entries share."""
    lo = -math.inf if min_size is None else min_size
    hi = math.inf if max_size is None else max_size
    return lo <= size <= hi


@dataclass(frozen=True)
class DefaultRule:
    """Where ``select_path`` fuses an op on CUDA when no crossover-table entry applies.

    ``fused="never"``: never (``why`` says what that rests on).  ``fused="threshold"``:
    fused for ``min_size <= size <= max_size``; a bound left at None is open.
    """

    fused: str  # "never" or "threshold"
    why: str
    min_size: float | None = None
    max_size: float | None = None

    def __post_init__(self):
        if self.fused not in ("never", "threshold"):
            raise ValueError(f"DefaultRule.fused must be 'never' or 'threshold', got {self.fused!r}")
        if self.fused == "threshold" and self.min_size is None and self.max_size is None:
            raise ValueError("a threshold DefaultRule needs min_size, max_size or both")

    @classmethod
    def never(cls, why: str) -> DefaultRule:
        return cls("never", why)

    @classmethod
    def threshold(cls, *, min_size: float | None = None, max_size: float | None = None, why: str = "") -> DefaultRule:
        return cls("threshold", why, min_size, max_size)

    def fused_at(self, size: float) -> bool:
        return self.fused != "never" and in_interval(size, self.min_size, self.max_size)

    def describe(self, size_key: str) -> str:
        if self.fused == "never":
            return "never fused"
        lo = "-inf" if self.min_size is None else f"{self.min_size:g}"
        hi = "inf" if self.max_size is None else f"{self.max_size:g}"
        return f"fused for {size_key} in [{lo}, {hi}]"


@dataclass(frozen=True)
class FusedOp:
    """One fused op: its name, its size, its default, what it needs, and how the tuner times it.

    Attributes:
        name: the op name layers pass to ``select_path`` and the crossover table keys on.
        size_key: the name of the scalar the thresholds compare (``"macs"``, ``"channels"``).
        size_inputs: the entries of a call's ``shapes`` the size is computed from (``select_path``
            checks they are there; plots use them as the x axis).
        size: ``shapes -> size``; None: the product of ``size_inputs``.
        default: the rule where no table entry applies.
        needs_symmetric_memory: the fused path addresses peers' buffers (no fusion at world size
            > 1 without symmetric memory between the ranks).
        case: ``"module:function"``, the tuner's timing case, called on every rank of the world as
            ``case(op, shape, ctx)`` with a :class:`distfuse.tune.cases.CaseContext`; returns a
            :class:`distfuse.tune.cases.Case`, or None on ranks that take no part.
        grid: ``"module:function"``, the tuner's default shapes: ``grid(op, world, quick=..., **options)``
            -> list of ``shapes`` dicts (options are the tuner's command-line shape options; ignore
            the ones that do not apply).
        available: ``"module:function"`` or None, ``available(P, device, dtype) -> (ok, why)``: whether
            the sweep may time the fused path on CUDA (collective over ``P`` where it probes peers).
        providers: the implementations of the fused path, default first (``distfuse.fused.providers``);
            the sweep times each and the table entry names the winner per shape.
        triton_gemm: the fused path multiplies in Triton GEMM kernels, whose fp32 products are IEEE
            (CUDA cores, far below cuBLAS) unless torch allows TF32: ``select_path`` keeps fp32 calls
            unfused then.
    """

    name: str
    size_key: str
    size_inputs: tuple[str, ...]
    default: DefaultRule
    case: str | Callable
    grid: str | Callable
    needs_symmetric_memory: bool = False
    size: Callable[[Mapping], float] | None = None
    available: str | Callable | None = None
    providers: tuple[str, ...] = ("triton",)
    triton_gemm: bool = False

    def size_of(self, shapes: Mapping) -> float:
        missing = [k for k in self.size_inputs if k not in shapes]
        if missing:
            raise KeyError(f"{self.name}: shapes lack {missing} (need {list(self.size_inputs)})")
        if self.size is not None:
            return float(self.size(shapes))
        return float(math.prod(shapes[k] for k in self.size_inputs))


def resolve(ref: str | Callable) -> Callable:
    """A factory reference (``"package.module:function"`` or a callable) as the callable."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


OPS: dict[str, FusedOp] = {}

#: Former op names -> current ones.  Crossover tables written before a rename key their
#: entries by the old name; :func:`distfuse.fused.crossover_table.load_table` reads them through this
#: map (and ``bench compare`` matches old result rows through it), so renaming an op never
#: silently drops a tuned entry.  Registered names may never appear here.
RENAMED: dict[str, str] = {
    "linear_rs": "matmul_reduce_scatter",
    "linear_ag": "all_gather_matmul",
}
#: Former names of the GEMM fusions' launchers -> current ones, where they name autotuners in a
#: table's ``triton_configs`` (:mod:`distfuse.tune.autotune_cache`) and kernel rows of
#: ``bench_gemm_fused`` results (``bench compare``).
RENAMED_KERNELS: dict[str, str] = {
    "gemm_rs": "matmul_scatter",
    "ag_gemm": "gathered_matmul",
}


def current_name(name: str) -> str:
    """``name`` if it is current, else the name the op was renamed to (:data:`RENAMED`)."""
    return RENAMED.get(name, name)


def register(op: FusedOp) -> FusedOp:
    if op.name in OPS:
        raise ValueError(f"fused op {op.name!r} is already registered")
    if op.name in RENAMED:
        raise ValueError(f"fused op name {op.name!r} is a former name of {RENAMED[op.name]!r}; pick another")
    OPS[op.name] = op
    return op


def get(name: str) -> FusedOp:
    try:
        return OPS[name]
    except KeyError:
        hint = f" (renamed to {RENAMED[name]!r})" if name in RENAMED else ""
        raise KeyError(f"unknown op {name!r}{hint}; known: {sorted(OPS)}") from None


def names() -> tuple[str, ...]:
    """The registered ops, in registration order (the tuner's default ``--ops``)."""
    return tuple(OPS)


def size_of(op: str, shapes: Mapping) -> float:
    """The scalar an op's thresholds compare (``m*n*k`` for the GEMMs, channels for the halo conv)."""
    return get(op).size_of(shapes)


# ---------------------------------------------------------------- the ops
# Each entry is also a module constant, so that code naming one op (bench rows, roles) spells it once, here.

_CASES = "distfuse.tune.cases"

# GEMM + reduce-scatter / all-gather + GEMM (bf16, TP 8, LLaMA-3 8B/70B MLP shapes): the Triton GEMMs reach
# 27-76% (RS) and 15-66% (AG) of cuBLAS's rate, and the modelled 8-GPU op is 1.1-5x the unfused time.
# (The 2026-11-22 result files name these ops by their former names, linear_rs and linear_ag: see RENAMED.)
MATMUL_REDUCE_SCATTER = register(FusedOp(
    "matmul_reduce_scatter", "macs", ("m", "n", "k"),
    DefaultRule.never("the fused GEMM measured 27-76% of cuBLAS's rate (H100, bf16, TP 8)"),
    case=f"{_CASES}:linear_case", grid=f"{_CASES}:linear_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", providers=("triton", "triton_persistent", "cublas_chunks"),
    triton_gemm=True))
ALL_GATHER_MATMUL = register(FusedOp(
    "all_gather_matmul", "macs", ("m", "n", "k"),
    DefaultRule.never("the fused GEMM measured 15-66% of cuBLAS's rate (H100, bf16, TP 8)"),
    case=f"{_CASES}:linear_case", grid=f"{_CASES}:linear_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", providers=("triton", "copy_engine"), triton_gemm=True))
# DistDL's own linear forms: the same GEMM fusions along the features (the output's last dim scattered, the input's
# last dim gathered).  Written after the H100 session, so never timed on a GPU: fused only when forced or tabled.
MATMUL_REDUCE_SCATTER_FEATURES = register(FusedOp(
    "matmul_reduce_scatter_features", "macs", ("m", "n", "k"),
    DefaultRule.never("not measured on a GPU yet"),
    case=f"{_CASES}:feature_linear_case", grid=f"{_CASES}:linear_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", triton_gemm=True))
ALL_GATHER_FEATURES_MATMUL = register(FusedOp(
    "all_gather_features_matmul", "macs", ("m", "n", "k"),
    DefaultRule.never("not measured on a GPU yet"),
    case=f"{_CASES}:feature_linear_case", grid=f"{_CASES}:linear_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", triton_gemm=True))
# GEMM + all-reduce over symmetric buffers (one-shot / two-shot): the general DistributedLinear (per row of its
# weight grid) and the row-parallel linear with a replicated output; its backward is a reduce-scatter of dy and the
# all_gather_features_matmul phase as dgrad.  Not timed on a GPU either.
MATMUL_ALL_REDUCE = register(FusedOp(
    "matmul_all_reduce", "macs", ("m", "n", "k"),
    DefaultRule.never("not measured on a GPU yet"),
    case=f"{_CASES}:feature_linear_case", grid=f"{_CASES}:linear_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", triton_gemm=True))
# The ZeRO layers' weight streaming (fused/zero_linear.py): the all-gather phases on the transposed product y.T =
# W_m @ x.T over the data-parallel workers, the weight shards the gathered operand, and the weight gradient's GEMM +
# reduce-scatter.  Entries of their own, because the gathered operand is the weight: the activation all-gathers'
# crossovers at the same m x n x k do not carry over.  _rows: the reduce-scatter linear's shards (along out);
# _columns: the all-gather linear's (along in).  Not timed on a GPU yet.
_ZERO_CASES = "distfuse.tune.zero_cases"
ZERO_LINEAR_ROWS = register(FusedOp(
    "zero_linear_rows", "macs", ("m", "n", "k"),
    DefaultRule.never("not measured on a GPU yet"),
    case=f"{_ZERO_CASES}:zero_case", grid=f"{_ZERO_CASES}:zero_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", triton_gemm=True))
ZERO_LINEAR_COLUMNS = register(FusedOp(
    "zero_linear_columns", "macs", ("m", "n", "k"),
    DefaultRule.never("not measured on a GPU yet"),
    case=f"{_ZERO_CASES}:zero_case", grid=f"{_ZERO_CASES}:zero_grid", needs_symmetric_memory=True,
    available=f"{_CASES}:linear_available", triton_gemm=True))
# Halo conv, staging + conv: 1.0-3.3x the time of torch.cat staging + cuDNN (2-D, C=64/256, bf16/fp32,
# median 2.1x), and 1.0-1.4x in 3-D.
HALO_CONV = register(FusedOp(
    "halo_conv", "channels", ("channels",),
    DefaultRule.never("staging + conv measured 1.0-3.3x the time of torch.cat staging + cuDNN (H100)"),
    case=f"{_CASES}:halo_case", grid=f"{_CASES}:halo_grid"))
