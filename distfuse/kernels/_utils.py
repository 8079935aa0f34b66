"""Capability flags, config lists and small @triton.jit helpers shared by the kernel files.

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

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "pick_launch",
    "INTERPRET",
    "HAS_CUDA",
    "AUTOTUNE",
    "FLOAT_DTYPES",
    "cast_out",
    "wait_flag",
    "arrive",
    "raise_flag",
    "round_bf16",
    "spin_limit",
    "input_precision",
    "get_gemm_configs",
    "get_chunk_reduce_configs",
    "get_push_configs",
    "CPU_GEMM_CONFIG",
    "CPU_CHUNK_REDUCE_CONFIG",
    "CPU_PUSH_CONFIG",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA: bool = torch.cuda.is_available() and not INTERPRET
AUTOTUNE: bool = HAS_CUDA and os.environ.get("DISTFUSE_AUTOTUNE", "1") != "0"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 operands use full IEEE fp32, as ``torch.matmul`` does by default.

    Triton's default for fp32 is tf32 (10-bit mantissa), which would miss the fp32
    tolerance by two orders of magnitude; 16-bit operands ignore the setting.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


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
# GEMM configs for H100/H200-class GPUs, not yet tuned on one (the dev machines have no
# GPU): 128x128 and 128x256 tiles with 64-deep K steps, the usual starting points of
# Triton's matmul tutorials for bf16, plus 64x* tiles for the small per-chunk M of a
# wide tensor-parallel group (B_ * n / W rows per chunk).
#
# CPU (interpreter) configs: an interpreted program instance costs ~0.05-0.2 s here almost
# regardless of its tile size (Python overhead per op, measured on the 2-core dev machine),
# so one 32x32 tile per test chunk is far faster than many small ones.

CPU_GEMM_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
CPU_CHUNK_REDUCE_CONFIG = dict(BLOCK=64)
CPU_PUSH_CONFIG = dict(BLOCK_M=16, BLOCK_K=32)


def get_gemm_configs() -> list[triton.Config]:
    """Autotuning configs of the GEMMs in ``gemm_rs`` and ``ag_gemm`` (CUDA only)."""
    shapes = [
        # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 64, 32, 4, 3),
    ]
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


def get_chunk_reduce_configs() -> list[triton.Config]:
    """Configs of the memory-bound chunk reduction: 1-4k elements per program saturate HBM."""
    return [triton.Config(dict(BLOCK=b), num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8))]


def get_push_configs() -> list[triton.Config]:
    """Configs of the all-gather push copy (one tile load, W - 1 peer stores)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_K=k), num_warps=w) for m, k, w in ((32, 256, 4), (64, 256, 8),
                                                                                   (16, 512, 4))]


# ---------------------------------------------------------------- device helpers


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Convert fp32 ``x`` to ``DTYPE`` with round-to-nearest-even.

    The interpreter truncates fp32 -> bf16 (``1 + 2^-8 + 2^-9`` becomes 1.0, torch gives
    1.0078), so with ``ROUND_BF16`` (interpreter and a bf16 target, see
    :func:`round_bf16`) the rounding is done on the bits: add ``0x7FFF`` plus the lowest
    kept bit, then drop the low half.  NaNs keep the plain conversion (the bit trick can
    carry a NaN payload into infinity).  On GPUs the hardware ``cvt.rn`` already rounds
    to nearest even.
    """
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def wait_flag(flag_ptr, epoch, status_ptr, max_spin):
    """Spin until ``*flag_ptr == epoch`` (acquire, system scope), at most ``max_spin`` extra loads.

    On failure ``*status_ptr`` is set to ``epoch`` and the caller goes on: a device
    kernel cannot raise, so the launcher reads the status word and raises on the host.
    With ``max_spin == 0`` this is one check (the CPU path, where a host barrier has
    already ordered the producers before the consumer).
    """
    spins = tl.full([], 0, tl.int32)  # a typed int32 loop-carried counter
    val = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while (val != epoch) & (spins < max_spin):
        val = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    if val != epoch:
        tl.atomic_xchg(status_ptr, epoch)
    # Every thread of the program reads the data after the flag, not only the one that spun.
    tl.debug_barrier()


@triton.jit
def arrive(counter_ptr):
    """Count this program as done; return True in the last program of the grid's axis 0.

    Tile counts depend on the block sizes (which autotuning may choose differently on
    every rank), so a consumer cannot know how many tiles to expect.  Instead the
    producer counts its own programs in a local counter and only the last one raises
    the flag, whose value (the op's epoch) does not depend on tiling.  The CTA barrier
    orders all threads' stores before the acq_rel increment; release is cumulative, so
    the last program's flag release (:func:`raise_flag`) also publishes the other
    programs' stores, which its increment observed.  The last program resets the
    counter for the next op: nothing else touches it until this kernel has finished.
    """
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = old == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def raise_flag(flag_ptr, epoch):
    """Publish ``*flag_ptr = epoch`` with release semantics at system scope (peers read it over NVLink)."""
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


def pick_launch(tuned, kernel, cpu_config: dict, cuda_configs, config: dict | None):
    """(kernel, launch kwargs): an explicit config, the autotuner, the first CUDA config, or the CPU config."""
    if config is not None:
        return kernel, dict(config)
    if tuned is not None:
        return tuned, {}
    if HAS_CUDA:
        c = cuda_configs()[0]
        return kernel, dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return kernel, dict(cpu_config)
