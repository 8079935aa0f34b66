"""The one selector of the all-gather + GEMM consumer: which kernel multiplies a call's gathered rows, and why.

``all_gather_matmul`` has pushes in front of one consumer; the push is the provider's
business (:mod:`distfuse.fused.providers`), the consumer kernel is chosen here, for the
call's operands::

    kernel                        when
    gathered_matmul_persistent    the default: gathered_persistent_supported(x, weight), and not
    (TMA loads, persistent grid,  compiled fp32 with IEEE products, and a GPU with TMA (sm_90+)
    one wait per chunk)
    gathered_matmul               asked for, or otherwise (the reason is recorded): any strides,
    (pointer loads, one program   any K, any dtype; one flag poll per tile
    per tile)

:func:`~distfuse.kernels.all_gather_matmul.gathered_matmul` calls :func:`select_gather_kernel`
and nothing else decides; the :class:`GatherChoice` of its latest call in this thread is
:func:`last_gather_choice` (the benchmarks name ``choice.kernel`` in every row, and a layer's
``last_decision`` can take it like the scatter producer's
:class:`~distfuse.kernels.matmul_scatter_select.KernelChoice`: both have ``kernel`` and
``reason``), so a fallback never passes for the kernel that was asked for.  The fp32 rule
is :func:`~distfuse.kernels.persistent.compiled_refusal`.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from distfuse.errors import UnsupportedError, expect
from distfuse.kernels._utils import INTERPRET, BoundedMemo, tf32_allowed
from distfuse.kernels.gathered_matmul_persistent import gathered_persistent_supported
from distfuse.kernels.persistent import compiled_refusal, operands_key

__all__ = ["GatherChoice", "GATHER_KERNELS", "DEFAULT_GATHER_KERNEL", "select_gather_kernel", "last_gather_choice",
           "record_gather_choice"]

#: The consumer kernels, the default first.
GATHER_KERNELS = ("gathered_matmul_persistent", "gathered_matmul")
DEFAULT_GATHER_KERNEL = GATHER_KERNELS[0]


class GatherChoice(NamedTuple):
    """The consumer kernel a call asked for, the one that runs it, and why that one."""

    requested: str
    kernel: str
    reason: str

    @property
    def fell_back(self) -> bool:
        """Whether the kernel that runs is not the one that was asked for."""
        return self.kernel != self.requested


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _has_tma(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the interpreter runs tensor descriptors on CPU tensors
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def select_gather_kernel(x3: torch.Tensor, weight: torch.Tensor, requested: str | None = None, *,
                         compiled: bool | None = None) -> GatherChoice:
    """The kernel that computes ``gather(x3) @ weight.T`` (``x3 [B_, len_p, K]``, ``weight [N, K]``); pure.

    ``requested``: a name of :data:`GATHER_KERNELS` (default :data:`DEFAULT_GATHER_KERNEL`).
    Depends only on the request, the dtype, shapes, strides and alignment of the operands,
    torch's TF32 setting and the GPU's compute capability, so every rank of a group, given
    alike operands, picks alike.  ``compiled``: whether the kernels compile for a GPU
    (default: not under the interpreter).
    """
    requested = requested or DEFAULT_GATHER_KERNEL
    if requested not in GATHER_KERNELS:
        raise expect("select_gather_kernel", "kernel", " or ".join(GATHER_KERNELS), repr(requested),
                      cls=UnsupportedError)
    if requested == "gathered_matmul":
        return GatherChoice(requested, "gathered_matmul", "asked for: one program per tile, pointer loads")
    compiled = not INTERPRET if compiled is None else compiled
    key = (requested, compiled, x3.dtype == torch.float32 and tf32_allowed(), *operands_key(x3, weight))
    choice = _CHOICES.get(key)
    return choice if choice is not None else _CHOICES.keep(key, _descriptor_choice(x3, weight, requested, compiled))


#: The persistent consumer's choices, per request and operands (:func:`~distfuse.kernels.persistent.operands_key`).
_CHOICES = BoundedMemo()


def _descriptor_choice(x3: torch.Tensor, weight: torch.Tensor, requested: str, compiled: bool) -> GatherChoice:
    """:func:`select_gather_kernel`'s choice where the persistent consumer is asked for."""
    _, why = gathered_persistent_supported(x3, weight)
    why = why or compiled_refusal(x3.dtype, compiled, x3.dtype == torch.float32 and tf32_allowed())  # fp32 only
    if not why and compiled and not _has_tma(x3.device):
        why = "tensor-memory-accelerator loads need sm_90 or later"
    if not why:
        return GatherChoice(requested, "gathered_matmul_persistent",
                            "tensor-descriptor (TMA) loads, persistent grid, one wait per chunk")
    return GatherChoice(requested, "gathered_matmul", f"fell back to the pointer kernel: {why}")


_LAST = threading.local()


def record_gather_choice(choice: GatherChoice) -> GatherChoice:
    """Remember ``choice`` as this thread's latest consumer kernel (see :func:`last_gather_choice`); returns it."""
    _LAST.choice = choice
    return choice


def last_gather_choice() -> GatherChoice | None:
    """The :class:`GatherChoice` of this thread's latest ``gathered_matmul`` launch (None before the first)."""
    return getattr(_LAST, "choice", None)
