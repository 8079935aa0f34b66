"""Host side of the persistent GEMM kernels: grid sizes, tensor descriptors, and when not to run them.

A persistent kernel launches at most one program per SM (or a fixed multiple) and
each program loops over work items ``pid, pid + num_programs, ...``; what a program
does once per launch (polling flags, building tensor descriptors) is then paid once per
SM instead of once per tile.  Under the Triton interpreter programs run one after the
other, so a small count (:data:`INTERPRETED_PROGRAMS`) still makes every program walk
several items, which is what the tests must exercise.

The descriptor kernels (:mod:`~distfuse.kernels.matmul_scatter_persistent`,
:mod:`~distfuse.kernels.gathered_matmul_persistent`) read their operands through
``TensorDescriptor`` arguments built here, on the host (TMA on sm_90; the interpreter
supports them too).  Device-side descriptors (``tl.make_tensor_descriptor``) need global
scratch from an allocator that Triton keeps per thread (a ``ContextVar``): a launch from
any thread but the one that called ``triton.set_allocator`` (CUDA autograd runs backward
on its own thread; checkpoint recomputes; data-loader threads) raised "no allocator was
set".  Host descriptors need no allocator and no per-launch scratch, so the launches are
safe from any thread.  A descriptor needs a 16-byte aligned base, a unit last stride and
other strides that are multiples of 16 bytes (:func:`descriptor_problem`).
"""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from distfuse.kernels._utils import INTERPRET, config_of, get_gemm_configs, pinned_gemm_config
from distfuse.kernels.host_ints import cdiv

__all__ = ["persistent_programs", "sm_count", "INTERPRETED_PROGRAMS", "weight_kmajor", "descriptor_problem",
           "checked_descriptor", "rows_descriptor", "weight_descriptor", "chunk_tiles", "compiled_refusal",
           "wave_efficiency", "WAVE_TARGET", "fill_waves"]

#: Programs of a persistent grid under the interpreter (CPU tests): small, so that each walks several items.
INTERPRETED_PROGRAMS = 2


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached: the query is a driver call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, override: int | None = None, per_sm: int = 1) -> int:
    """Programs of a persistent grid on ``device``: ``override`` if given, else ``per_sm`` per SM.

    CPU (interpreter): :data:`INTERPRETED_PROGRAMS`.  Callers take the minimum with the
    number of work items, so a small problem never launches idle programs.
    """
    if override is not None:
        if int(override) < 1:
            raise ValueError(f"persistent_programs: expected at least 1 program, got {override}")
        return int(override)
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return INTERPRETED_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * sm_count(index)


def chunk_tiles(meta: dict, batch: int, q1: int, W: int, N: int) -> int:
    """Tiles of a persistent GEMM over W chunks of ``batch`` entries of ``q1`` rows (the largest chunk's) by ``N``.

    The host twin of :func:`~distfuse.kernels.jit_helpers.chunk_tiling`'s ``total``.
    """
    return W * batch * cdiv(q1, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])


def wave_efficiency(tiles: int, programs: int) -> float:
    """Busy fraction of a persistent grid of ``programs`` over ``tiles`` equal tiles: ``tiles / (waves * programs)``."""
    return tiles / (cdiv(tiles, programs) * programs) if tiles > 0 else 1.0


#: A pinned tile whose grid keeps the SMs busy less than this goes down the family's list (:func:`fill_waves`).
WAVE_TARGET = 0.9


def fill_waves(dtype: torch.dtype, rows: int, cols: int, family: str, tiles, programs: int) -> dict:
    """The pinned rule of a persistent GEMM family: the shape bucket's tile
    (:func:`~distfuse.kernels._utils.pinned_gemm_config` of ``rows`` by ``cols``), walked down the family's list
    to the first config whose ``tiles(config)`` keep a grid of ``programs`` at least :data:`WAVE_TARGET` busy in
    its last wave, else the busiest (the first of ties).  A compute-bound persistent GEMM loses a whole tile time
    per idle program to a short last wave (448 tiles of 128x256 on 132 SMs: 85% busy; 896 of 128x128: 97%)."""
    pinned = pinned_gemm_config(dtype, rows, cols, family)
    configs = [config_of(c) for c in get_gemm_configs(dtype, family)]
    candidates = configs[configs.index(pinned):] if pinned in configs else [pinned]
    busy = {i: wave_efficiency(tiles(c), programs) for i, c in enumerate(candidates)}
    best = max(busy, key=busy.get)  # the first of ties
    return dict(candidates[next((i for i in busy if busy[i] >= WAVE_TARGET), best)])


def weight_kmajor(weight: torch.Tensor) -> bool | None:
    """How a descriptor reads ``weight [N, K]``: False as [N, K] rows, True as its [K, N] transpose; None: neither."""
    esize = weight.element_size()
    if weight.stride(1) == 1 and (weight.stride(0) * esize) % 16 == 0:
        return False
    if weight.stride(0) == 1 and (weight.stride(1) * esize) % 16 == 0:
        return True
    return None


def operands_key(a: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Everything of ``a`` and ``weight`` that :func:`descriptor_problem` and the selectors read: dtypes, device,
    shapes, strides and whether each base is 16-byte aligned.  The selectors memoise their choice under it (with
    the request and torch's TF32 setting): a choice is a pure function of these, and asking again cost a GEMM call
    2 us of host on a fast CPU (the dimension, stride and alignment checks of both operands)."""
    return (a.dtype, a.device, a.shape, a.stride(), a.data_ptr() % 16 == 0, weight.dtype, weight.shape,
            weight.stride(), weight.data_ptr() % 16 == 0)


def descriptor_problem(x3: torch.Tensor, weight: torch.Tensor, who: str, rows: str) -> str:
    """Why descriptors cannot read ``x3 [B_, rows, K]`` as one ``[B_ * rows, K]`` matrix, or ``weight``; "" if they can.

    ``who`` and ``rows`` name ``x3`` and its row extent in the reason.  An ``x3`` without
    rows is never read, so only the weight counts then.  Pure: shapes, strides, alignment.
    """
    B, n, _ = x3.shape
    esize = x3.element_size()
    if n > 0:
        if x3.stride(2) != 1 or (B > 1 and x3.stride(0) != n * x3.stride(1)):
            return f"{who}'s rows are not one [B_ * {rows}, K] matrix with contiguous K"
        if (x3.stride(1) * esize) % 16 or x3.data_ptr() % 16:
            return f"{who}'s row stride or base is not 16-byte aligned"
    if weight_kmajor(weight) is None:
        return "the weight has no contiguous dim with a 16-byte aligned row stride"
    if weight.data_ptr() % 16:
        return "the weight's base is not 16-byte aligned"
    return ""


def checked_descriptor(base: torch.Tensor, shape: list[int], strides: list[int],
                       block_shape: list[int]) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block_shape)`` without the dataclass's own checks.

    For launchers whose operands :func:`descriptor_problem` (or its twin) has already
    accepted, with block shapes from the pinned or test configs (powers of two): those checks
    (alignment, ranks, the block shape) are Python run on every launch, about 1.2 us per
    descriptor on a fast host and three descriptors per launch.  The object is the one the
    constructor would build (``padding`` and any newer field keep their class defaults), so
    the launcher encodes it as usual.
    """
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape = base, shape, strides, block_shape
    return desc


def rows_descriptor(x3: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """The descriptor of ``x3 [B_, rows, K]`` as one ``[B_ * rows, K]`` matrix (:func:`descriptor_problem` said yes).

    Its base is ``x3`` itself: a launch reads only the base's address and dtype (the descriptor's shape and strides
    say the rest), and a ``[B_ * rows, K]`` view of it cost 5 us of an H200 host's time a call (2026-11-28)."""
    B, n, K = x3.shape
    return checked_descriptor(x3, [B * n, K], [x3.stride(1), 1], [block_m, block_k])


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> tuple[TensorDescriptor, bool]:
    """``(descriptor, B_KMAJOR)`` of ``weight [N, K]``: read as its rows, or (True) as the rows of its ``[K, N]``
    transpose where N is the contiguous dim (the base is ``weight`` either way: see :func:`rows_descriptor`)."""
    N, K = weight.shape
    if weight_kmajor(weight):
        return checked_descriptor(weight, [K, N], [weight.stride(1), 1], [block_k, block_n]), True
    return checked_descriptor(weight, [N, K], [weight.stride(0), 1], [block_n, block_k]), False


def compiled_refusal(dtype: torch.dtype, compiled: bool, tf32: bool) -> str:
    """Why the selectors run the pointer kernel instead of a compiled persistent one; "" if nothing does.

    ``tf32``: whether torch lets fp32 matmuls use TF32 (:func:`~distfuse.kernels._utils.tf32_allowed`).

    fp32 operands with IEEE products (torch's default, no TF32): the persistent kernels'
    fp32 IEEE dot spills kilobytes of registers per thread at every tile (the compile audit;
    docs/benchmarks.md, "Kernel choices"), the pointer kernels' little or nothing.
    """
    if compiled and dtype == torch.float32 and not tf32:
        return "fp32 with IEEE products (no TF32) spills registers in the persistent kernel"
    return ""
