"""Capability flags, config lists and host-side launch helpers shared by the kernel files.

The device-side helpers (``@triton.jit``: tile order, chunk geometry, the flag protocol,
rounding) are in :mod:`distfuse.kernels.jit_helpers`.  Here are the launchers' checks
(:func:`claimed_rank_view`, :func:`output_buffer`, :func:`check_bias`) and launch configs
(:func:`pick_gemm_launch`, :func:`pinned_gemm_config`) of the GEMM fusions.

Flags are computed once, at import, because Triton reads ``TRITON_INTERPRET`` when the
``@triton.jit`` decorators execute: a flag computed later could disagree with how the
kernels were built.

* ``INTERPRET``: kernels run in the Triton interpreter (CPU tensors).  Two pitfalls of
  the interpreter shape the kernels: ``tl.dot`` on bf16 is wrong (so 16-bit tiles are
  upcast to fp32 before the dot, ``UPCAST``), and fp32 -> bf16 conversion truncates
  instead of rounding to nearest even (so :func:`cast_out` rounds by hand, ``ROUND_BF16``).
* ``HAS_CUDA``: a CUDA device is present (launchers may autotune).
* ``AUTOTUNE``: autotune on CUDA unless ``DISTFUSE_AUTOTUNE=0``.  A multi-config
  ``@triton.autotune`` fails without a GPU, so CPU launches use one fixed small config.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.host_ints import cdiv

__all__ = ["pick_launch", "pick_gemm_launch", "pick_push_launch", "tile_grid", "shard_rows", "output_buffer",
           "check_bias", "check_producer_args", "claimed_rank_view", "INTERPRET", "HAS_CUDA", "AUTOTUNE",
           "FLOAT_DTYPES", "TIMED_WAITS", "timeout_arg", "config_of", "pinned_gemm_config", "round_bf16",
           "spin_limit", "input_precision", "tf32_allowed", "get_gemm_configs", "gemm_list_key",
           "gemm_autotuners", "flatten_rows",
           "refuse_zero_width_gather", "summed_partials", "GEMM_FAMILIES", "get_chunk_reduce_configs",
           "pinned_reduce_config", "REDUCE_AUDIT_W", "get_push_configs", "CPU_GEMM_CONFIG", "CPU_CHUNK_REDUCE_CONFIG",
           "CPU_PUSH_CONFIG", "gathered_copy"]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA: bool = torch.cuda.is_available() and not INTERPRET
AUTOTUNE: bool = HAS_CUDA and os.environ.get("DISTFUSE_AUTOTUNE", "1") != "0"
#: Compiled consumer kernels bound their flag waits by ``%globaltimer``; interpreted ones count loads.
TIMED_WAITS: bool = not INTERPRET
FLAG_POLL_ENV = "DISTFUSE_FLAG_POLL"


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of the environment variable ``name``, one of ``choices`` (the first is the default, taken when the
    variable is unset or blank; surrounding space and case ignored).  Any other value raises, naming the variable
    and the values it takes."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {' or '.join(map(repr, choices))} (default {choices[0]!r})")
    return value


def _flag_poll_loads() -> bool:
    """``DISTFUSE_FLAG_POLL``: how ``chunk_reduce`` polls its W flags, ``atomic`` (default: acquire atomics) or
    ``load`` (acquire loads, :func:`~distfuse.kernels.jit_helpers.poll_flags`; compiled kernels only, the interpreter
    keeps the atomics).  Any other value raises, naming the variable."""
    return env_choice(FLAG_POLL_ENV, ("atomic", "load")) == "load" and not INTERPRET


#: ``chunk_reduce``'s default flag poll (:func:`_flag_poll_loads`), read once at import.
POLL_LOADS: bool = _flag_poll_loads()
#: Whether ``DISTFUSE_FLAG_POLL`` was set: then it decides every launch, over a measured tile's ``POLL_LOADS``.
POLL_LOADS_EXPLICIT: bool = bool(os.environ.get(FLAG_POLL_ENV, "").strip())

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tf32_allowed() -> bool:
    """Whether torch lets fp32 matmuls on CUDA use the TF32 tensor cores (read at each call: users toggle it).

    Any of torch's three spellings allows it: ``torch.backends.cuda.matmul.fp32_precision
    == "tf32"`` (torch 2.9+), ``torch.backends.cuda.matmul.allow_tf32 = True``, or
    ``torch.set_float32_matmul_precision("high" | "medium")``.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # "ieee", "tf32", or "none" (follow the legacy switches)
    if precision in ("ieee", "tf32"):
        return precision == "tf32"
    try:
        if matmul.allow_tf32:
            return True
        # Raises where the legacy and the new API were mixed; then the switches above have spoken.
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return False


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for ``dtype`` operands: fp32 follows torch's matmul setting.

    fp32 operands use full IEEE fp32, as ``torch.matmul`` does by default, and the TF32
    tensor cores only where torch allows them for its own matmuls too
    (:func:`tf32_allowed`; Triton's own default, tf32, would miss the fp32 tolerance by two
    orders of magnitude behind the user's back).  The interpreter always computes IEEE
    fp32.  16-bit operands ignore the setting.
    """
    return "tf32" if dtype != torch.float32 or (not INTERPRET and tf32_allowed()) else "ieee"


def round_bf16(dtype: torch.dtype) -> bool:
    """Whether :func:`cast_out` must round to bf16 by hand (interpreter only)."""
    return INTERPRET and dtype == torch.bfloat16


def spin_limit(timeout_s: float) -> int:
    """Iterations of a device-side flag wait meant to last about ``timeout_s`` seconds.

    Assumes one system-scope acquire load of a flag in local HBM plus the CTA broadcast
    costs >= 0.5 us (an estimate, not measured on these machines: bench/ should measure
    it).  If it is faster the wait gives up early, at ``timeout_s * t_iter / 0.5 us``.
    The count is clamped to int32 (~1000 s at 0.5 us).
    """
    return int(min(max(timeout_s, 0.0) * 2e6, 2**31 - 1))


# ---------------------------------------------------------------- configs
#
# GEMM tiles for H100/H200-class GPUs: 128x128 tiles with 64-deep K steps for 16-bit operands and 32-deep ones for
# fp32, whose operands take twice the shared memory per element (128x256x64 at 3 stages would pass sm_90's 227 KB).
# Every config of every dtype is compiled for sm_90 in CI (tests/test_compile_audit.py: shared memory, spills) and
# with the GPU machines' Triton 3.6 by ``scripts/audit_triton36.sh``.  The lists leave out the tiles that spill
# registers there: gathered_k_matmul (the K-chunk walk keeps more live state) spills at more tiles than the other
# pointer kernels and has its own list; the persistent kernels (TMA loads: no address registers) keep 128x256x64; the
# fp32 lists keep 8-warp 128x64 and 64x128 tiles.  fp32 with IEEE products (torch's default for fp32 matmuls: no
# TF32) has lists of its own (key ``"ieee"``): its dot runs on the FMA units with a far larger register footprint, so
# tiles that fit with TF32 spill there (gathered_k_matmul: every fp32 TF32 tile, 16-56 bytes under Triton 3.6 and
# 3.9; the push's 64x64x32 at 3 stages: 8 bytes under 3.6).  The persistent families have none: compiled fp32 IEEE
# never runs them (:func:`~distfuse.kernels.persistent.compiled_refusal`).  No listed config spills under either
# Triton (tests/test_compile_audit.py).  The spill counts are in docs/benchmarks.md and docs/gpu.md.
#
# CPU (interpreter) configs: an interpreted program costs about the same whatever its tile (Python overhead per
# op), so one 32x32 tile per test chunk is far faster than many small ones.

CPU_GEMM_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
CPU_CHUNK_REDUCE_CONFIG = dict(BLOCK=64)
CPU_PUSH_CONFIG = dict(BLOCK_M=16, BLOCK_K=32)

#: The GEMM kernel families whose configs differ (see the spill notes above): ``pointer`` (one
#: program per tile, pointer loads), ``gathered_k`` (gathered_k_matmul), ``persistent`` (the GEMM +
#: scatter producer) and ``gathered_persistent`` (the all-gather GEMM consumer with TMA loads).
GEMM_FAMILIES = ("pointer", "gathered_k", "persistent", "gathered_persistent")

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by family and operand size: the autotuners'
# lists (loopback) and, by shape bucket, the pinned configs (real groups; see pinned_gemm_config).
_GEMM_SHAPES = {
    "pointer": {2: [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (64, 128, 64, 8, 4), (128, 64, 64, 4, 4),
                    (64, 64, 64, 4, 4), (64, 64, 32, 4, 3)],
                4: [(128, 64, 32, 8, 4), (64, 128, 32, 8, 4), (128, 64, 32, 8, 3), (64, 64, 32, 4, 3)],
                "ieee": [(128, 64, 32, 8, 4), (64, 128, 32, 8, 4), (128, 64, 32, 8, 3), (64, 64, 32, 4, 2)]},
    "gathered_k": {2: [(128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (64, 128, 32, 8, 4), (64, 64, 64, 4, 4),
                       (64, 64, 32, 4, 3)],
                   4: [(128, 64, 16, 8, 3), (64, 128, 16, 8, 3), (64, 64, 16, 4, 3)],
                   "ieee": [(64, 64, 16, 8, 3), (64, 32, 16, 4, 3), (32, 32, 16, 4, 3)]},
    "persistent": {2: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 4, 4), (64, 128, 64, 8, 4),
                       (64, 64, 32, 4, 3)],
                   4: [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 3)]},
    "gathered_persistent": {2: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 8, 4), (64, 64, 32, 4, 3)],
                            4: [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 3)]},
}
# Shape buckets of the pinned rule: ``large`` (rows >= 128, cols >= 256), ``tall`` (rows >= 128, cols >= 128),
# ``wide`` (cols >= 128) and ``small``; each names one entry of the family's list.  The persistent producer's
# ``wide`` tile (decode-size chunks) is 64x256x64 with 4 warps, the faster one measured (docs/benchmarks.md).
_PINNED = {
    "pointer": {2: dict(large=0, tall=0, wide=2, small=5), 4: dict(large=0, tall=0, wide=1, small=3),
                "ieee": dict(large=0, tall=0, wide=1, small=3)},
    "gathered_k": {2: dict(large=0, tall=0, wide=2, small=4), 4: dict(large=0, tall=0, wide=1, small=2),
                   "ieee": dict(large=0, tall=0, wide=0, small=1)},
    "persistent": {2: dict(large=0, tall=1, wide=2, small=4), 4: dict(large=0, tall=0, wide=2, small=3)},
    "gathered_persistent": {2: dict(large=0, tall=1, wide=2, small=3), 4: dict(large=0, tall=0, wide=2, small=3)},
}


def gemm_list_key(dtype: torch.dtype, family: str = "pointer", precision: str | None = None) -> int | str:
    """The key of ``family``'s config lists for ``dtype`` operands: 2 (16-bit), 4 (fp32 with TF32 products) or
    ``"ieee"`` (fp32 with IEEE products, where the family has a list of its own).  ``precision``: the dot's input
    precision (default: :func:`input_precision`, which follows torch's fp32 matmul setting at each call)."""
    size = min(dtype.itemsize, 4)
    if size == 4 and "ieee" in _GEMM_SHAPES[family] and (precision or input_precision(dtype)) == "ieee":
        return "ieee"
    return size


def get_gemm_configs(dtype: torch.dtype = torch.bfloat16, family: str = "pointer",
                     precision: str | None = None) -> list[triton.Config]:
    """Autotuning configs of a GEMM ``family`` (:data:`GEMM_FAMILIES`) for ``dtype`` operands whose products run
    in ``precision`` (default :func:`input_precision`; CUDA only)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=w, num_stages=s)
            for m, n, k, w, s in _GEMM_SHAPES[family][gemm_list_key(dtype, family, precision)]]


def gemm_autotuners(kernel, key: list[str], family: str = "pointer") -> dict:
    """``kernel``'s autotuners by list key (:func:`gemm_list_key`: 2, 4 and ``"ieee"`` where the family has it),
    as :func:`pick_gemm_launch` takes them.

    Empty unless :data:`AUTOTUNE`; only loopback ops run them (see :func:`pinned_gemm_config`).
    """
    if not AUTOTUNE:
        return {}
    return {k: triton.autotune(get_gemm_configs(torch.bfloat16 if k == 2 else torch.float32, family,
                                                 "ieee" if k == "ieee" else "tf32"), key=key)(kernel)
            for k in _GEMM_SHAPES[family]}


def pinned_gemm_config(dtype: torch.dtype, rows: int, cols: int, family: str = "pointer",
                       precision: str | None = None) -> dict:
    """One GEMM config per (family, dtype, shape bucket): the same on every rank, chosen without timing.

    A fused op on a real group never autotunes: the autotuner reruns kernels that store
    into peers' buffers and raise their flags, and it times consumers that spin on
    peers, so ranks would stall on one another while each tunes (and could pick
    different tiles).  ``rows`` is the largest chunk's row count, ``cols`` the output
    features.  Loopback ops (one process) may autotune; see :func:`pick_launch`.
    """
    size = gemm_list_key(dtype, family, precision)
    many = rows >= 128
    bucket = "large" if many and cols >= 256 else "tall" if many and cols >= 128 else "wide" if cols >= 128 else "small"
    m, n, k, w, s = _GEMM_SHAPES[family][size][_PINNED[family][size][bucket]]
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s)


# chunk_reduce (a pure bandwidth kernel: W slot reads + 1 write per element): the launch is pinned, never timed.
# HBM needs ~3 MB of loads in flight across the GPU (Little's law at ~3 TB/s and ~1 us), ~23 KB per SM.  The W loads
# of a block are unrolled and hoisted, so a program holds W * BLOCK * itemsize bytes in registers: BLOCK is sized for
# 16 KB.  PER_SM is as many programs as the register file holds (more programs, more bytes in flight), bounded so
# that every program is resident at once (a grid that runs in waves would repeat the flag wait): registers x 128
# threads x PER_SM <= sm_90's 64K registers per SM (tests/test_compile_audit.py checks it for every audited W, dtype
# and layout).  The measurements behind PER_SM are in docs/benchmarks.md.
_REDUCE_INFLIGHT = 16 * 1024  # bytes of partials one program holds in flight
_REDUCE_BLOCKS = (512, 4096)  # BLOCK's range
_REDUCE_WARPS = 4
_REDUCE_PER_SM = {4096: 3, 2048: 5}  # programs per SM by BLOCK (default 8): as many as the register file holds
#: The world sizes the compile audit covers (every BLOCK the rule gives for W = 1..8, at its largest W).
REDUCE_AUDIT_W = (2, 3, 4, 6, 8)


def pinned_reduce_config(numel: int, dtype: torch.dtype, world_size: int) -> dict:
    """The chunk reduction's launch config (``BLOCK``, ``PER_SM``, ``num_warps``): the same on every rank.

    A function of the partials' dtype and the world size only (``numel``, the chunk's
    output elements, is kept for a rule that needs it); never autotuned, not even in
    loopback: the grid depends on the SM count, and one rule on every rank keeps the
    ranks alike (a real group never autotunes; see :func:`pinned_gemm_config`).
    """
    per_block = _REDUCE_INFLIGHT // (max(int(world_size), 1) * dtype.itemsize)
    block = 1 << max(per_block.bit_length() - 1, 0)  # the largest power of two <= per_block
    block = min(max(block, _REDUCE_BLOCKS[0]), _REDUCE_BLOCKS[1])
    return dict(BLOCK=block, PER_SM=_REDUCE_PER_SM.get(block, 8), num_warps=_REDUCE_WARPS)


def get_chunk_reduce_configs(dtype: torch.dtype = torch.bfloat16) -> list[triton.Config]:
    """The chunk reduction's pinned configs for ``dtype`` partials, one per audited world size (kwargs ``BLOCK``,
    ``PER_SM`` and ``W``: the world size it is pinned for; CUDA only)."""
    return [triton.Config(dict(BLOCK=c["BLOCK"], PER_SM=c["PER_SM"], W=w), num_warps=c["num_warps"])
            for w in REDUCE_AUDIT_W for c in [pinned_reduce_config(1 << 22, dtype, w)]]


def get_push_configs(dtype: torch.dtype | None = None) -> list[triton.Config]:
    """Configs of the all-gather push copy (one tile load, W - 1 peer stores); the first is the pinned one.

    Tiles of 2048-4096 elements at 4 warps: compiled for sm_90 by Triton 3.6 (bf16), the push holds every
    element's store offset across its loop over the peers, so its registers grow faster than its tile: 8 x 512
    and 8 x 256 take 64 and 51 a thread (80 and 56 for the feature-chunk push), 16 x 256 takes 96, where the
    earlier 32 x 256 (4 warps), 64 x 256 (8 warps) and 16 x 512 took 230, 255 with spills and 148: three
    programs of 128 threads an SM at most, for a copy whose speed is bytes in flight.  Unmeasured on a GPU
    (the earlier configs: 27.3 us against 20.6 for the copy anchor at 8B M = 8192, H200, graph-timed)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_K=k), num_warps=w) for m, k, w in ((8, 512, 4), (8, 256, 4),
                                                                                   (16, 256, 4))]


# ---------------------------------------------------------------- host-side launch helpers


def pick_launch(tuned, kernel, config: dict | None, ws, pinned: dict, cpu_config: dict = CPU_GEMM_CONFIG):
    """(kernel, launch kwargs): an explicit ``config``, the CPU config, the autotuner, or the pinned CUDA config.

    Only ops on a loopback ``ws`` (every virtual rank in this process) run the autotuner:
    rerunning a loopback kernel rewrites the same slots with the same values and raises the
    same flags, so tuning it is harmless.  On a real group it is not (see
    :func:`pinned_gemm_config`), whatever ``DISTFUSE_AUTOTUNE`` says.
    """
    if config is not None:
        return kernel, dict(config)
    if INTERPRET or not HAS_CUDA:
        return kernel, dict(cpu_config)
    if tuned is not None and getattr(ws, "backend", None) == "loopback":
        return tuned, {}
    return kernel, dict(pinned)


def claimed_rank_view(op: str, ws, rank: int, world_size: int, device: torch.device):
    """``ws.rank_view(rank)`` after checking the launch against the workspace: group size, device, and the claim.

    Every launcher of the GEMM fusions starts here: a producer or consumer launched outside
    ``ws.in_flight`` could overwrite slots another fused op is still reading.
    """
    if world_size != ws.world_size:
        raise expect(op, "world size (the workspace's group size)", ws.world_size, world_size)
    if device != ws.device:
        raise expect(op, "device (the workspace's device)", ws.device, device)
    ws.require_in_flight(op)
    return ws.rank_view(rank)


def pick_gemm_launch(tuned_by_size: dict, kernel, dtype: torch.dtype, rows: int, cols: int, config: dict | None,
                     ws, family: str = "pointer"):
    """:func:`pick_launch` for a GEMM kernel: its autotuner for ``dtype``'s list (:func:`gemm_list_key`), the pinned
    config of ``rows`` (the largest chunk's) by ``cols`` (the output features) in its ``family``, the CPU config."""
    return pick_launch(tuned_by_size.get(gemm_list_key(dtype, family)), kernel, config, ws,
                       pinned_gemm_config(dtype, rows, cols, family))


def pick_push_launch(tuned, kernel, config: dict | None, ws):
    """:func:`pick_launch` for an all-gather push copy: its autotuner, the first push config, the CPU config."""
    return pick_launch(tuned, kernel, config, ws, config_of(get_push_configs()[0]), CPU_PUSH_CONFIG)


def tile_grid(rows: int, cols: int, steps: int | None = None, *, inner: str = "BLOCK_N", at_least: int = 0):
    """The launch grid ``grid(META)`` of one program per ``BLOCK_M x inner`` tile of ``rows x cols`` (axis 0), for
    each of ``steps`` chunks (axis 1).  A producer asks for ``at_least=1``: its last program raises the flags,
    which its consumers wait for even when it has nothing to compute."""
    def grid(META):
        tiles = max(at_least, cdiv(rows, META["BLOCK_M"]) * cdiv(cols, META[inner]))
        return (tiles,) if steps is None else (tiles, steps)
    return grid


def shard_rows(op: str, a_shard: torch.Tensor, total: int, rank: int, world_size: int, *,
               columns: bool = False) -> torch.Tensor:
    """An all-gather shard, checked and flattened by :func:`flatten_rows`.

    ``a_shard [..., len, K]`` holds block ``rank`` of the ``total`` rows ``n`` over the
    group (``columns``: ``[..., K_block]``, block ``rank`` of the ``total`` columns ``K``),
    in a float dtype.
    """
    dim, what, name, shape = (-1, "columns", "K", "[..., K_block]") if columns else (-2, "rows", "n", "[..., len, K]")
    if a_shard.dim() < -dim:
        raise ShapeError(f"{where(op)}: expected a shard {shape}, got {tuple(a_shard.shape)}")
    if a_shard.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"{where(op)}: dtype: expected one of {FLOAT_DTYPES}, got {a_shard.dtype}")
    length = block_extent(total, world_size, rank)
    if a_shard.shape[dim] != length:
        raise expect(op, f"shard {what} (balanced block {rank} of {name}={total} over {world_size})", length,
                     a_shard.shape[dim])
    return flatten_rows(a_shard, -dim)


def output_buffer(op: str, out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device, what: str):
    """A consumer's output: new (``out`` None), or the caller's ``out`` viewed as ``shape`` after checking it.

    ``out`` may have any leading dims, but must hold ``shape``'s elements with the same last
    two dims, contiguous, of ``dtype`` and on ``device``; ``what`` names its shape in the
    error (``"[..., n, N]"``).
    """
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape == shape and out.dtype == dtype and out.device == device and out.is_contiguous():
        return out  # the layers' case, checked in a third of the general checks' host time
    if (out.numel() != math.prod(shape) or tuple(out.shape[-2:]) != tuple(shape[-2:]) or not out.is_contiguous()
            or out.dtype != dtype or out.device != device):
        raise expect(op, f"out (shape {what} with B_ rows, contiguous, dtype, device)", (shape, True, dtype, device),
                     (tuple(out.shape), out.is_contiguous(), out.dtype, out.device))
    return out if out.shape == shape else out.view(shape)  # a view costs several us of a GPU host's time


class BoundedMemo(dict):
    """A hot path's memo (a selector's choices, the bound launches per shape): ``keep(key, value)`` stores and returns
    ``value``, emptying the memo first when it holds ``limit`` entries (shapes that keep changing start it again
    rather than grow it)."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit

    def keep(self, key, value):
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def flatten_rows(t: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """``t`` with its leading dims flattened into one before its last ``keep`` dims, with a unit last stride.

    A copy only where the last stride is not 1 (and the last dim not empty).
    """
    if t.dim() == keep + 1:  # already [rows, *kept]: no reshape (a view of itself, 1-2 us of host a call)
        return t.contiguous() if t.shape[-1] > 0 and t.stride(-1) != 1 else t
    rows = t.reshape(math.prod(t.shape[:-keep]), *t.shape[-keep:])  # not -1: ambiguous for an empty tensor
    return rows.contiguous() if rows.shape[-1] > 0 and rows.stride(-1) != 1 else rows


def refuse_zero_width_gather(op: str, return_gathered: bool, N: int, rows: int) -> None:
    """Refuse to return the gathered input of a zero-width weight shard on CUDA.

    The consumer's flag waits live in its GEMM, which is skipped with nothing to multiply,
    so the copy of the gathered input would race the peers' pushes.  Layers route such
    shards unfused.
    """
    if return_gathered and N == 0 and rows > 0 and not INTERPRET:
        raise UnsupportedError(f"{where(op)}: a zero-width weight shard cannot return the gathered input on CUDA "
                               "(no kernel runs to wait for the peers' chunks); use the unfused path")


def gathered_copy(gathered: torch.Tensor, shape, x: torch.Tensor, extent: int, rank: int,
                  world_size: int) -> torch.Tensor:
    """A copy of a consumer's gathered input ``shape`` (dim 1 gathered over ``extent``) with its own block ``x``."""
    full = gathered.view(shape).clone()
    start, stop = block_range(extent, world_size, rank)
    full[:, start:stop] = x
    return full


def summed_partials(parts, partial_dtype: torch.dtype | None, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The torch references' sum, with the kernels' roundings: the fp32 ``parts``, each rounded to ``partial_dtype``
    first (unless None), added in order in fp32, plus ``bias``, rounded once to ``out_dtype``."""
    acc = None
    for part in parts:
        part = part if partial_dtype is None else part.to(partial_dtype).float()
        acc = part if acc is None else acc + part
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def check_producer_args(op: str, a: torch.Tensor, weight: torch.Tensor, partial_dtype: torch.dtype | None, *,
                        column_chunks: bool = False):
    """A GEMM + scatter producer's operands: ``a [..., n, K]``, ``weight [N, K]`` of one float dtype on one device.

    Returns the partials' dtype (``partial_dtype``, default ``a``'s).  Shared by every
    producer of the reduce-scatter slots (the pointer and persistent Triton kernels, the
    cuBLAS-per-chunk one and, with ``column_chunks`` (``a [..., K]``), the column-chunk
    producer), so they refuse the same inputs the same way.
    """
    if a.dim() < (1 if column_chunks else 2) or weight.dim() != 2:
        raise ShapeError(f"{where(op)}: expected a {'[..., K]' if column_chunks else '[..., n, K]'} and weight "
                         f"[N, K], got {tuple(a.shape)} and {tuple(weight.shape)}")
    if a.shape[-1] != weight.shape[1]:
        raise expect(op, "weight inner dim (a.shape[-1])", a.shape[-1], weight.shape[1])
    partial_dtype = partial_dtype or a.dtype
    if a.dtype not in FLOAT_DTYPES or weight.dtype != a.dtype or partial_dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"{where(op)}: dtypes: expected a, weight and partials of one of {FLOAT_DTYPES} "
                               f"(a and weight alike), got {a.dtype}, {weight.dtype} and {partial_dtype}")
    if weight.device != a.device:
        raise expect(op, "weight device (a's)", a.device, weight.device)
    return partial_dtype


def check_bias(op: str, bias: torch.Tensor | None, N: int, device) -> None:
    """``bias`` is None or ``[N]`` on ``device`` (any stride: the kernels read it through its stride)."""
    if bias is not None and (tuple(bias.shape) != (N,) or bias.device != device):
        raise expect(op, "bias shape and device", ((N,), device), (tuple(bias.shape), bias.device))


def config_of(c: triton.Config) -> dict:
    """Launch kwargs of one ``triton.Config`` (block sizes plus ``num_warps``/``num_stages``)."""
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def timeout_arg(ws_view) -> int:
    """The flag-wait bound a consumer kernel gets for :func:`wait_flag`.

    Compiled: the workspace timeout in nanoseconds, or 0 (one check) where the
    workspace does not spin (loopback: every producer ran earlier on the same stream).
    Interpreted: the workspace's extra-load count (0 on the CPU backend, whose host
    barrier orders the producers first).
    """
    if ws_view.max_spin == 0:
        return 0
    return int(ws_view.timeout * 1e9) if TIMED_WAITS else ws_view.max_spin
