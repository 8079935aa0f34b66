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

__all__ = [
    "pick_launch",
    "pick_gemm_launch",
    "output_buffer",
    "check_bias",
    "check_producer_args",
    "claimed_rank_view",
    "INTERPRET",
    "HAS_CUDA",
    "AUTOTUNE",
    "FLOAT_DTYPES",
    "TIMED_WAITS",
    "timeout_arg",
    "config_of",
    "ws_may_tune",
    "pinned_gemm_config",
    "round_bf16",
    "spin_limit",
    "input_precision",
    "tf32_allowed",
    "get_gemm_configs",
    "GEMM_FAMILIES",
    "get_chunk_reduce_configs",
    "pinned_reduce_config",
    "REDUCE_AUDIT_W",
    "get_push_configs",
    "CPU_GEMM_CONFIG",
    "CPU_CHUNK_REDUCE_CONFIG",
    "CPU_PUSH_CONFIG",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA: bool = torch.cuda.is_available() and not INTERPRET
AUTOTUNE: bool = HAS_CUDA and os.environ.get("DISTFUSE_AUTOTUNE", "1") != "0"
#: Compiled consumer kernels bound their flag waits by ``%globaltimer``; interpreted ones count loads.
TIMED_WAITS: bool = not INTERPRET

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
    if dtype != torch.float32:
        return "tf32"
    return "tf32" if (not INTERPRET and tf32_allowed()) else "ieee"


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
# GEMM tiles for H100/H200-class GPUs: 128x128 tiles with 64-deep K steps for 16-bit
# operands and 32-deep K steps for fp32, whose operands take twice the shared memory per
# element (128x256x64 with 3 stages would need ~288 KB of fp32 shared memory against
# sm_90's 227 KB).  Each config of each dtype is compiled for sm_90 in CI
# (tests/test_compile_audit.py: shared memory against the target's limit, spills) and
# with the GPU machines' Triton 3.6 by ``scripts/audit_triton36.sh``.
#
# Register spills decided the 16-bit lists (sm_90, ptxas of Triton 3.6.0 and 3.9.0, bytes of
# local memory per thread, 2026-11-26): the pointer kernels (matmul_scatter,
# matmul_scatter_columns, matmul_push, gathered_matmul) spill at 128x256x64 w8 (320-560 B),
# 128x128x64 w4 (328-624 B) and 64x128x64 w4 (32-176 B), and none at 128x128x64 w8,
# 64x128x64 w8, 128x64x64 w4 and 64x64 tiles.  gathered_k_matmul (the K-chunk walk keeps
# more live state) spills at every 128x128 tile (752 B at w8, 16 B at K step 32), at
# 64x128x64 (48 B at w8) and at 128x64x64 w4 (248 B): its list is its own.  The persistent
# kernel (TMA loads: no address registers for the operands) spills at none of them and
# keeps the 128x256x64 tile.  fp32 under 3.6: the 128x128x32 tile spills in gathered_matmul
# (IEEE, 56 B) and gathered_k_matmul (TF32 280 B, IEEE 648 B), 4-warp 128x64 / 64x128 tiles in
# several kernels (IEEE 8-128 B), so the fp32 lists keep 8-warp 128x64 and 64x128 tiles (no
# spill with TF32 anywhere; IEEE products, which dispatch keeps unfused on CUDA, still spill
# 40-56 B in gathered_k_matmul and 8 B in matmul_push's 64x64 tile).
#
# CPU (interpreter) configs: an interpreted program instance costs ~0.05-0.2 s here almost
# regardless of its tile size (Python overhead per op, measured on the 2-core dev machine),
# so one 32x32 tile per test chunk is far faster than many small ones.

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
                4: [(128, 64, 32, 8, 4), (64, 128, 32, 8, 4), (128, 64, 32, 8, 3), (64, 64, 32, 4, 3)]},
    "gathered_k": {2: [(128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (64, 128, 32, 8, 4), (64, 64, 64, 4, 4),
                       (64, 64, 32, 4, 3)],
                   4: [(128, 64, 32, 8, 4), (64, 128, 32, 8, 4), (128, 64, 32, 8, 3), (64, 128, 32, 8, 3)]},
    "persistent": {2: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 4, 4), (64, 128, 64, 8, 4),
                       (64, 64, 32, 4, 3)],
                   4: [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 3)]},
    "gathered_persistent": {2: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 8, 4), (64, 64, 32, 4, 3)],
                            4: [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 3)]},
}
# Shape buckets of the pinned rule: ``large`` (rows >= 128, cols >= 256), ``tall`` (rows >= 128, cols >= 128),
# ``wide`` (cols >= 128) and ``small``; each names one entry of the family's list.
_PINNED = {
    "pointer": {2: dict(large=0, tall=0, wide=2, small=5), 4: dict(large=0, tall=0, wide=1, small=3)},
    "gathered_k": {2: dict(large=0, tall=0, wide=2, small=4), 4: dict(large=0, tall=0, wide=1, small=3)},
    "persistent": {2: dict(large=0, tall=1, wide=2, small=4), 4: dict(large=0, tall=0, wide=2, small=3)},
    "gathered_persistent": {2: dict(large=0, tall=1, wide=2, small=3), 4: dict(large=0, tall=0, wide=2, small=3)},
}


def _family_shapes(family: str, dtype: torch.dtype) -> list[tuple]:
    if family not in _GEMM_SHAPES:
        raise ValueError(f"GEMM config family {family!r}: expected one of {GEMM_FAMILIES}")
    return _GEMM_SHAPES[family][4 if dtype.itemsize >= 4 else 2]


def get_gemm_configs(dtype: torch.dtype = torch.bfloat16, family: str = "pointer") -> list[triton.Config]:
    """Autotuning configs of a GEMM ``family`` (:data:`GEMM_FAMILIES`) for ``dtype`` operands (CUDA only)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=w, num_stages=s)
            for m, n, k, w, s in _family_shapes(family, dtype)]


def pinned_gemm_config(dtype: torch.dtype, rows: int, cols: int, family: str = "pointer") -> dict:
    """One GEMM config per (family, dtype, shape bucket): the same on every rank, chosen without timing.

    A fused op on a real group never autotunes: the autotuner reruns kernels that store
    into peers' buffers and raise their flags, and it times consumers that spin on
    peers, so ranks would stall on one another while each tunes (and could pick
    different tiles).  ``rows`` is the largest chunk's row count, ``cols`` the output
    features.  Loopback ops (one process) may autotune; see :func:`pick_launch`.
    """
    shapes = _family_shapes(family, dtype)
    buckets = _PINNED[family][4 if dtype.itemsize >= 4 else 2]
    if rows >= 128 and cols >= 256:
        bucket = "large"
    elif rows >= 128 and cols >= 128:
        bucket = "tall"
    elif cols >= 128:
        bucket = "wide"
    else:
        bucket = "small"
    m, n, k, w, s = shapes[buckets[bucket]]
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s)


# chunk_reduce (a pure bandwidth kernel: W slot reads + 1 write per element): the launch is pinned,
# never timed.  Not measured on a GPU yet; chosen from the byte count and the compile audit.  HBM
# needs about 3 TB/s * ~1 us = ~3 MB of loads in flight across the GPU, ~23 KB per SM (Little's law).
# The W loads of a block are unrolled and ptxas hoists them all, so a program holds W * BLOCK *
# itemsize bytes in registers: BLOCK is sized for 16 KB (W = 2 bf16: 4096 elements; W = 8 bf16 or
# W = 4 fp32: 1024), and 4 programs of 4 warps per SM keep 64 KB per SM in flight (3 programs at
# 4096-element blocks, whose fp32 accumulator alone takes 32 registers per thread: 130 in all at
# W = 2 in 16 bits under Triton 3.9; 48 KB per SM in flight).  Fixed 4096-element blocks did not fit
# at W = 8: 241-244 registers per thread in 16 bits, and 255 plus 312 bytes of spills in fp32, under
# Triton 3.6 (sm_90; the GPU machines' Triton), so at most 2 programs per SM.  PER_SM is bounded so
# that every program is resident at once (a persistent grid that does not fit runs in waves, and a
# second wave would repeat the flag wait): registers x 128 threads x PER_SM <= sm_90's 64K registers
# per SM (tests/test_compile_audit.py checks it for every audited W, dtype and layout).
# The persistent producer's ``wide`` tile (chunks under 128 rows: decode-size M) is 64x256x64 with 4 warps: at
# M = 512 (64 rows per chunk) it ran at 0.65/0.55 of cuBLAS (LLaMA-3 8B/70B, H200, graph replays), where the
# 64x128x64 8-warp tile pinned before gave 0.49/0.38 (bench/results/diagnose-NVIDIA_H200-2026-11-26.json and
# gemm_fused-NVIDIA_H200-2026-11-26-c.json).
#
# Measured (H200, Triton 3.6, bf16, W = 8, LLaMA-3 8B/70B MLP chunks of 75/151 MB, each call replayed
# from a CUDA graph after an L2 flush, against the device copy of the same bytes; bench/results/
# diagnose-NVIDIA_H200-2026-11-26.json): 4 programs of 1024-element blocks per SM reach 0.73/0.79 of the
# copy, 8 per SM 0.83/0.88 (64 KB -> 128 KB in flight per SM); fewer than 2 per SM stay under 0.65.  So
# PER_SM is as many programs as the register file holds: 8 at 1024-element blocks and below (60 registers
# per thread at W = 8 in 16 bits, 46 in fp32), 5 at 2048 (82-92), 3 at 4096 (130).
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
    out = []
    for w in REDUCE_AUDIT_W:
        c = pinned_reduce_config(1 << 22, dtype, w)
        out.append(triton.Config(dict(BLOCK=c["BLOCK"], PER_SM=c["PER_SM"], W=w), num_warps=c["num_warps"]))
    return out


def get_push_configs(dtype: torch.dtype | None = None) -> list[triton.Config]:
    """Configs of the all-gather push copy (one tile load, W - 1 peer stores)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_K=k), num_warps=w) for m, k, w in ((32, 256, 4), (64, 256, 8),
                                                                                   (16, 512, 4))]


# ---------------------------------------------------------------- host-side launch helpers


def pick_launch(tuned, kernel, cpu_config: dict, pinned: dict, config: dict | None, *, may_tune: bool):
    """(kernel, launch kwargs): an explicit config, the autotuner, the pinned CUDA config, or the CPU config.

    ``may_tune`` is False for ops on a real group (see :func:`pinned_gemm_config`); the
    autotuner then never runs, whatever ``DISTFUSE_AUTOTUNE`` says.
    """
    if config is not None:
        return kernel, dict(config)
    if INTERPRET or not HAS_CUDA:
        return kernel, dict(cpu_config)
    if tuned is not None and may_tune:
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
    """:func:`pick_launch` for a GEMM kernel: its autotuner for ``dtype``'s operand size, the pinned config of
    ``rows`` (the largest chunk's) by ``cols`` (the output features) in its ``family``, the CPU config."""
    return pick_launch(tuned_by_size.get(min(dtype.itemsize, 4)), kernel, CPU_GEMM_CONFIG,
                       pinned_gemm_config(dtype, rows, cols, family), config, may_tune=ws_may_tune(ws))


def output_buffer(op: str, out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device, what: str):
    """A consumer's output: new (``out`` None), or the caller's ``out`` viewed as ``shape`` after checking it.

    ``out`` may have any leading dims, but must hold ``shape``'s elements with the same last
    two dims, contiguous, of ``dtype`` and on ``device``; ``what`` names its shape in the
    error (``"[..., n, N]"``).
    """
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (out.numel() != math.prod(shape) or tuple(out.shape[-2:]) != tuple(shape[-2:]) or not out.is_contiguous()
            or out.dtype != dtype or out.device != device):
        raise expect(op, f"out (shape {what} with B_ rows, contiguous, dtype, device)", (shape, True, dtype, device),
                     (tuple(out.shape), out.is_contiguous(), out.dtype, out.device))
    return out.view(shape)


def check_producer_args(op: str, a: torch.Tensor, weight: torch.Tensor, partial_dtype: torch.dtype | None):
    """A GEMM + scatter producer's operands: ``a [..., n, K]``, ``weight [N, K]`` of one float dtype on one device.

    Returns the partials' dtype (``partial_dtype``, default ``a``'s).  Shared by every
    producer of the reduce-scatter slots (the pointer and persistent Triton kernels and
    the cuBLAS-per-chunk one), so they refuse the same inputs the same way.
    """
    if a.dim() < 2 or weight.dim() != 2:
        raise ShapeError(f"{where(op)}: expected a [..., n, K] and weight [N, K], got {tuple(a.shape)} and "
                         f"{tuple(weight.shape)}")
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


def ws_may_tune(ws) -> bool:
    """Whether ops on ``ws`` may autotune: only a loopback workspace (every virtual rank in this process).

    Rerunning a loopback kernel rewrites the same slots with the same values and raises
    the same flags, so tuning it is harmless; on a real group it is not (see
    :func:`pinned_gemm_config`).
    """
    return getattr(ws, "backend", None) == "loopback"


def config_of(configs: list[triton.Config], index: int = 0) -> dict:
    """Launch kwargs of one ``triton.Config`` (block sizes plus ``num_warps``/``num_stages``)."""
    c = configs[index]
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
