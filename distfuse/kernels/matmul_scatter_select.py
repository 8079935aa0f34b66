"""The one selector of the GEMM + scatter producer: which kernel runs a call, and why.

``matmul_reduce_scatter`` has three producers in front of the one consumer
(``chunk_reduce``); :mod:`distfuse.fused.providers` picks the *provider* a call asks for
(``DISTFUSE_PROVIDER``, the crossover table, the registry's default).  This module picks
the *kernel* that runs it for the call's operands, and says why::

    provider            kernel that runs                         when
    triton              matmul_scatter (pointer loads)           always
    triton_persistent   matmul_scatter_persistent (TMA loads)    persistent_supported(a, weight), and not
                                                                 compiled fp32 with IEEE products
                        matmul_scatter (pointer loads)           otherwise: the reason is recorded
    cublas_chunks       matmul_scatter_cublas: one GEMM a chunk  chunks of at least CUBLAS_WHOLE_ROWS rows
                        (the same kernel name): one GEMM of      chunks shorter than that (cublas_whole)
                        every row, then scatter_partial

Nothing else chooses (the two launcher modules import neither each other nor this one):
:func:`distfuse.fused.providers.run_producer` runs and records what :func:`select_scatter_kernel`
returns, and the benchmarks and the layers' ``last_decision`` name ``choice.kernel``, the
kernel that actually ran, so a fallback never passes for the kernel that was asked for.
The fp32 rule is :func:`~distfuse.kernels.persistent.compiled_refusal`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from distfuse.errors import UnsupportedError, expect
from distfuse.kernels import matmul_reduce_scatter as pointer_kernels
from distfuse.kernels import matmul_scatter_persistent as persistent_kernels
from distfuse.kernels._utils import INTERPRET, BoundedMemo, tf32_allowed
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.persistent import compiled_refusal, operands_key

__all__ = ["KernelChoice", "PROVIDER_KERNELS", "CUBLAS_WHOLE_ROWS", "cublas_whole", "select_scatter_kernel",
           "launch_scatter_kernel"]

#: The cuBLAS provider's schedule changes below this many rows a chunk (:func:`cublas_whole`).
CUBLAS_WHOLE_ROWS = 128

#: The kernel each provider asks for (``select_scatter_kernel`` may run another, and says why).
PROVIDER_KERNELS = {
    "triton": "matmul_scatter",
    "triton_persistent": "matmul_scatter_persistent",
    "cublas_chunks": "matmul_scatter_cublas",
}


class KernelChoice(NamedTuple):
    """The provider a call asked for, the kernel that runs it, and why that kernel."""

    provider: str
    kernel: str
    reason: str

    @property
    def fell_back(self) -> bool:
        """Whether the kernel that runs is not the one the provider asks for."""
        return self.kernel != PROVIDER_KERNELS[self.provider]


def cublas_whole(n: int, world_size: int) -> bool:
    """Whether the cuBLAS provider computes all ``n`` rows in one library GEMM and then scatters them
    (:mod:`~distfuse.kernels.scatter_partial`), rather than one GEMM per chunk: where the longest chunk has fewer
    than :data:`CUBLAS_WHOLE_ROWS` rows.  A chunk GEMM that short fills less than one of the library's 128-row
    tiles, and W of them cost W launches: on the H200 at ``a6bfa8c`` (TP 8, M = 512, 64-row chunks, kernel time)
    the eight chunk GEMMs took 43.3 us for LLaMA-3 8B and 141.4 us for 70B against 11.8 and 40.0 us for cuBLAS's
    whole GEMM.  At 1024-row chunks (M = 8192) they took 175.5 against 151.4 us, less than the 35 us or so a copy
    of the whole GEMM's 64 MB output would add.  A pure rule of the shape, so every rank takes the same schedule."""
    return 0 < cdiv(n, world_size) < CUBLAS_WHOLE_ROWS


def select_scatter_kernel(a: torch.Tensor, weight: torch.Tensor, provider: str = "triton", *,
                          compiled: bool | None = None, world_size: int | None = None) -> KernelChoice:
    """The kernel that produces ``a [..., n, K] @ weight.T`` (``weight [N, K]``) for ``provider``; pure.

    Depends only on the provider, the dtype, shapes, strides and alignment of the operands and
    torch's TF32 setting (so every rank of a group, given alike operands, picks alike).
    ``compiled``: whether the kernels compile for a GPU (default: not under the interpreter).  ``world_size``: the
    op's W, which names the cuBLAS provider's schedule in the reason (:func:`cublas_whole`).
    """
    if provider not in PROVIDER_KERNELS:
        raise expect("select_scatter_kernel", "provider", " or ".join(PROVIDER_KERNELS), repr(provider),
                     cls=UnsupportedError)
    if provider == "triton":
        return KernelChoice(provider, "matmul_scatter", "one program per tile, pointer loads")
    if provider == "cublas_chunks":
        if world_size is not None and cublas_whole(a.shape[-2], world_size):
            return KernelChoice(provider, "matmul_scatter_cublas",
                                f"one library GEMM of every row, then one scatter launch (chunks of at most "
                                f"{cdiv(a.shape[-2], world_size)} rows: fewer than {CUBLAS_WHOLE_ROWS})")
        return KernelChoice(provider, "matmul_scatter_cublas", "one library GEMM per chunk")
    compiled = not INTERPRET if compiled is None else compiled
    key = (provider, compiled, a.dtype == torch.float32 and tf32_allowed(), persistent_kernels.FLATTEN,
           *operands_key(a, weight))
    choice = _CHOICES.get(key)
    return choice if choice is not None else _CHOICES.keep(key, _descriptor_choice(a, weight, provider, compiled))


#: The persistent provider's choices, per operands (:func:`~distfuse.kernels.persistent.operands_key`), compile
#: mode, TF32 setting and ``FLATTEN``.
_CHOICES = BoundedMemo()


def _descriptor_choice(a: torch.Tensor, weight: torch.Tensor, provider: str, compiled: bool) -> KernelChoice:
    """:func:`select_scatter_kernel`'s choice for the persistent provider."""
    n, K = a.shape[-2], a.shape[-1]
    a3 = a.reshape(math.prod(a.shape[:-2]), n, K)
    _, why = persistent_kernels.persistent_supported(a3, weight)
    why = why or compiled_refusal(a.dtype, compiled, a.dtype == torch.float32 and tf32_allowed())  # fp32 only
    if not why:
        loops = "tile and K loops fused" if persistent_kernels.FLATTEN else "a K loop per tile"
        return KernelChoice(provider, "matmul_scatter_persistent",
                            f"tensor-descriptor (TMA) loads, {loops} (default; a config's FLATTEN overrides it)")
    return KernelChoice(provider, "matmul_scatter", f"fell back to the pointer kernel: {why}")


def launch_scatter_kernel(choice: KernelChoice, a: torch.Tensor, weight: torch.Tensor, ws, rank: int,
                          world_size: int, *, partial_dtype: torch.dtype | None = None,
                          config: dict | None = None) -> KernelChoice:
    """Launch the Triton kernel of ``choice`` (``matmul_scatter`` or ``matmul_scatter_persistent``); returns it.

    ``matmul_scatter_cublas`` lives above the kernels (:mod:`distfuse.fused.matmul_reduce_scatter_cublas`) and
    is run by :func:`distfuse.fused.providers.run_producer`.  ``config``: block sizes (and ``PROGRAMS`` for the
    persistent grid), as the launchers take them.
    """
    if choice.kernel == "matmul_scatter_persistent":
        persistent_kernels.matmul_scatter_persistent(a, weight, ws, rank, world_size, partial_dtype=partial_dtype,
                                                     config=config, checked=True)
    elif choice.kernel == "matmul_scatter":
        blocks = {k: v for k, v in (config or {}).items() if k != "PROGRAMS"} or None
        pointer_kernels.matmul_scatter(a, weight, ws, rank, world_size, partial_dtype=partial_dtype,
                                       config=blocks if blocks is None or "BLOCK_M" in blocks else None)
    else:
        raise expect("launch_scatter_kernel", "a Triton kernel", "matmul_scatter or matmul_scatter_persistent",
                     choice.kernel, cls=UnsupportedError)
    return choice
