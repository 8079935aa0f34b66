"""The fused ops, one entry each: what dispatch, ``distfuse-tune`` and ``bench/`` know about an op.

Every piece of code that lists the fused ops or needs one of their facts reads it here
(:func:`distfuse.layers.dispatch.select_path`, ``distfuse-tune``, ``bench/``).  Adding a
fused op is its own module (see ``docs/extending.md``) plus one :class:`FusedOp` below.

Defaults.  Every default is "never" (each entry's ``why`` says what that rests on; the
runs: ``docs/benchmarks.md``, "The fused ops' default rules") until the kernels improve or
a table written by ``distfuse-tune`` on the target cluster says otherwise.  A
:meth:`DefaultRule.threshold` default is there for ops whose fused path wins.

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
           "resolve", "current_name", "halo_elements", "MATMUL_REDUCE_SCATTER", "ALL_GATHER_MATMUL", "HALO_CONV",
           "MATMUL_REDUCE_SCATTER_FEATURES", "ALL_GATHER_FEATURES_MATMUL", "MATMUL_ALL_REDUCE", "ZERO_LINEAR_ROWS",
           "ZERO_LINEAR_COLUMNS", "RING_ATTENTION"]


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
        size_inputs: the entries of a call's ``shapes`` the size is computed from (plots' x axis).
        size: ``shapes -> size``; None: the product of ``size_inputs``.
        default: the rule where no table entry applies.
        needs_symmetric_memory: the fused path addresses peers' buffers.
        case: the tuner's timing case, ``case(op, shape, ctx)`` on every rank of the world with a
            :class:`distfuse.tune.cases.CaseContext`; a :class:`distfuse.tune.cases.Case` or None.
        grid: the tuner's default shapes, ``grid(op, world, quick=..., **options)`` -> list of
            ``shapes`` dicts (options: the tuner's shape options; ignore those that do not apply).
        available: None or ``available(P, device, dtype) -> (ok, why)``: whether the sweep may
            time the fused path on CUDA (collective over ``P`` where it probes peers).
        providers: the implementations of the fused path, default first (:mod:`distfuse.fused.providers`).
        triton_gemm: the fused path multiplies in Triton GEMMs, whose fp32 products are IEEE (far
            below cuBLAS) unless torch allows TF32: ``select_path`` keeps fp32 calls unfused then.
        projected: the shipped crossover table projects the op to multi-GPU nodes from one GPU's
            kernel rows (:mod:`distfuse.tune.project`).  False where one GPU cannot show what the
            fused path buys (the ring's overlap on real links): only a sweep on the cluster decides.
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
    projected: bool = True

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
_ZERO_CASES = "distfuse.tune.zero_cases"
_UNMEASURED = "not measured on a GPU yet"


def _gemm_op(name: str, why: str, case: str, grid: str = f"{_CASES}:linear_grid", **kwargs) -> FusedOp:
    """A GEMM + collective op: sized in ``m*n*k`` MACs, on symmetric memory, multiplying in Triton GEMMs."""
    return register(FusedOp(name, "macs", ("m", "n", "k"), DefaultRule.never(why), case=case, grid=grid,
                            needs_symmetric_memory=True, available=f"{_CASES}:linear_available", triton_gemm=True,
                            **kwargs))


MATMUL_REDUCE_SCATTER = _gemm_op(
    "matmul_reduce_scatter", "the fused GEMM measured 27-76% of cuBLAS's rate (H100, bf16, TP 8)",
    f"{_CASES}:linear_case", providers=("triton", "triton_persistent", "cublas_chunks"))
ALL_GATHER_MATMUL = _gemm_op(
    "all_gather_matmul", "the fused GEMM measured 15-66% of cuBLAS's rate (H100, bf16, TP 8)",
    f"{_CASES}:linear_case", providers=("triton", "copy_engine"))
# DistDL's own linear forms: the same GEMM fusions along the features (the output's last dim scattered, the input's
# last dim gathered); fused only when forced or tabled.
MATMUL_REDUCE_SCATTER_FEATURES = _gemm_op("matmul_reduce_scatter_features", _UNMEASURED,
                                          f"{_CASES}:feature_linear_case")
ALL_GATHER_FEATURES_MATMUL = _gemm_op("all_gather_features_matmul", _UNMEASURED, f"{_CASES}:feature_linear_case")
# GEMM + all-reduce over symmetric buffers (fused/matmul_all_reduce.py).
MATMUL_ALL_REDUCE = _gemm_op("matmul_all_reduce", _UNMEASURED, f"{_CASES}:feature_linear_case")
# The ZeRO layers' weight streaming (fused/zero_linear.py), entries of their own because the gathered operand is the
# weight: the activation all-gathers' crossovers at the same m x n x k do not carry over.  _rows: the reduce-scatter
# linear's shards (along out); _columns: the all-gather linear's (along in).
ZERO_LINEAR_ROWS = _gemm_op("zero_linear_rows", _UNMEASURED, f"{_ZERO_CASES}:zero_case", f"{_ZERO_CASES}:zero_grid")
ZERO_LINEAR_COLUMNS = _gemm_op("zero_linear_columns", _UNMEASURED, f"{_ZERO_CASES}:zero_case",
                               f"{_ZERO_CASES}:zero_grid")
# The halo conv (and the pools' staging, which takes its rule) is sized by a worker's block: the elements of the
# global input over the workers (halo_elements), the same number on every rank.  Channels alone could not tell the
# measured wins from the losses: on an H200 (2026-11-28) the staging + conv step beat torch.cat + cuDNN at 2^26
# elements a block (C = 256 at 512^2, and at 64^3) and lost at C = 256 on 64^2, where the host binds the step.
HALO_CONV = register(FusedOp(
    "halo_conv", "elements", ("elements",),
    DefaultRule.never("staging + conv took 1.0-3.3x the time of torch.cat staging + cuDNN (H100, 2026-11-22); on "
                      "an H200 (2026-11-28) it won by 6-16% at 2^26 elements a block and lost below 2^24, under "
                      "the 10% a default needs"),
    case=f"{_CASES}:halo_case", grid=f"{_CASES}:halo_grid"))


def halo_elements(global_shape, workers: int) -> float:
    """The ``elements`` size of the halo_conv rule: the global input's elements ``[B, C, *spatial]`` over the
    ``workers`` of its partition (a worker's block, on average), which every rank computes alike."""
    return math.prod(int(e) for e in global_shape) / max(int(workers), 1)
# The ring attention's transport (fused/ring_push.py): each K/V block pushed into the next worker's symmetric buffer
# while the current block computes, against isend / irecv; sized by the largest K/V block's elements.
RING_ATTENTION = register(FusedOp(
    "ring_attention", "elements", ("elements",), DefaultRule.never(_UNMEASURED), case=f"{_CASES}:ring_case",
    grid=f"{_CASES}:ring_grid", needs_symmetric_memory=True, projected=False))
