"""Providers of a fused op: which implementation runs the fused path, and how one is chosen per call.

A fused op may have several implementations with the same inputs, outputs and workspace
protocol, each fastest somewhere else, listed in
:attr:`distfuse.fused.registry.FusedOp.providers` (the first is the default):

* ``matmul_reduce_scatter``'s producers, in front of the one consumer (``chunk_reduce``):
  ``triton``, one program per tile with pointer loads
  (:func:`~distfuse.kernels.matmul_reduce_scatter.matmul_scatter`; the measured default);
  ``triton_persistent``, a persistent grid with tensor-descriptor (TMA) loads and one flag
  per chunk (:mod:`distfuse.kernels.matmul_scatter_persistent`); ``cublas_chunks``, one
  library GEMM per chunk (:mod:`distfuse.fused.matmul_reduce_scatter_cublas`).
* ``all_gather_matmul``'s pushes, in front of the one GEMM (``gathered_matmul``):
  ``triton``, a copy kernel on the op's stream finished before the GEMM
  (:func:`~distfuse.kernels.all_gather_matmul.ag_push`); ``copy_engine``, DMA copies on side
  streams overlapping the GEMM (:mod:`distfuse.fused.all_gather_copy_engine`).

:func:`select_provider` is, like ``select_path``, a pure function of the call's shapes,
dtype, world size and device name (so every rank of a group picks the same provider):

1. ``DISTFUSE_PROVIDER=<name>``: that provider for every op that has it;
2. the crossover table entry of the op (``provider``, the provider that won most shapes,
   and ``provider_sizes``, the winner per measured size; the nearest size in log scale decides);
3. the op's first provider (also for tables written before providers existed).

The provider is what a call asks for; the *kernel* that runs it is chosen in one place,
:func:`distfuse.kernels.matmul_scatter_select.select_scatter_kernel` (``triton_persistent``
runs the pointer kernel where tensor descriptors cannot read the operands, and says why);
:func:`last_kernel` names the kernel that ran, for benchmark rows and ``last_decision``.
"""

from __future__ import annotations

import os
import threading

import torch

from distfuse.errors import UnsupportedError, expect
from distfuse.fused import registry
from distfuse.fused.crossover_table import load_table, nearest, table_key
from distfuse.kernels.matmul_scatter_select import KernelChoice, launch_scatter_kernel, select_scatter_kernel

__all__ = ["providers_of", "select_provider", "check_provider", "pick_provider", "run_producer", "last_kernel",
           "record_kernel", "run_push"]


def providers_of(op: str) -> tuple[str, ...]:
    """The providers of a registered op, default first (:attr:`~distfuse.fused.registry.FusedOp.providers`)."""
    return registry.get(op).providers


def check_provider(op: str, provider: str) -> str:
    """``provider`` if ``op`` has it, else :class:`~distfuse.errors.UnsupportedError` naming the ones it has."""
    names = providers_of(op)
    if provider not in names:
        raise expect(op, "provider", " or ".join(names), repr(provider), cls=UnsupportedError)
    return provider


def select_provider(op: str, shapes: dict, dtype: torch.dtype, world_size: int, device_name: str,
                    table: dict | None = None) -> str:
    """The provider of ``op``'s fused path for one call (see the module doc for the order of the rules).

    ``device_name`` is what the crossover table keys on (``torch.cuda.get_device_name``;
    ``"cpu"`` on CPU).  A table naming a provider the op no longer has is ignored.
    """
    names = providers_of(op)
    forced = os.environ.get("DISTFUSE_PROVIDER", "").strip()
    if forced and forced in names:
        return forced
    if table is None:
        table = load_table()
    entry = table.get(table_key(device_name, world_size, dtype, op))
    if isinstance(entry, dict):
        sizes = entry.get("provider_sizes")
        chosen = str(nearest(sizes, registry.size_of(op, shapes))[1]) if isinstance(sizes, list) and sizes \
            else entry.get("provider")
        if chosen in names:
            return chosen
    return names[0]


def pick_provider(op: str, provider: str | None, x: torch.Tensor, m: int, N: int, W: int) -> str:
    """``provider`` checked, or :func:`select_provider`'s pick for an ``m x N x x.shape[-1]`` GEMM on x's device."""
    if provider is not None:
        return check_provider(op, provider)
    name = torch.cuda.get_device_name(x.device) if x.device.type == "cuda" else x.device.type
    return select_provider(op, dict(m=m, n=N, k=x.shape[-1]), x.dtype, W, name)


_LAST = threading.local()


def last_kernel(op: str) -> KernelChoice | None:
    """The kernel choice of ``op``'s latest producer (or all-gather consumer) in this thread (:func:`record_kernel`).

    Read by the layers for ``last_decision.kernel`` and by the benchmarks for each row's
    ``kernel``: the kernel that ran, which a fallback may make differ from the provider's.
    """
    return getattr(_LAST, "kernels", {}).get(op)


def record_kernel(op: str, choice: KernelChoice) -> KernelChoice:
    """Remember ``choice`` as ``op``'s latest kernel in this thread (see :func:`last_kernel`); returns it.

    ``choice``: a :class:`~distfuse.kernels.matmul_scatter_select.KernelChoice` (the producers) or a
    :class:`~distfuse.kernels.gathered_matmul_select.GatherChoice` (the all-gather consumer)."""
    if not hasattr(_LAST, "kernels"):
        _LAST.kernels = {}
    _LAST.kernels[op] = choice
    return choice


def run_producer(provider: str, a, weight, ws, rank: int, world_size: int, partial_dtype,
                 config: dict | None = None) -> KernelChoice:
    """Run ``provider``'s producer of matmul_reduce_scatter (slots and flags for ``chunk_reduce``).

    The kernel is the one :func:`~distfuse.kernels.matmul_scatter_select.select_scatter_kernel` picks
    for these operands; returns its :class:`KernelChoice`, also kept as :func:`last_kernel`.
    ``config``: block sizes for the Triton kernels (tests; None in production).
    """
    op = registry.MATMUL_REDUCE_SCATTER.name
    check_provider(op, provider)
    choice = select_scatter_kernel(a, weight, provider, world_size=world_size)
    if choice.kernel == "matmul_scatter_cublas":
        from distfuse.fused.matmul_reduce_scatter_cublas import matmul_scatter_cublas

        matmul_scatter_cublas(a, weight, ws, rank, world_size, partial_dtype=partial_dtype)
    else:
        launch_scatter_kernel(choice, a, weight, ws, rank, world_size, partial_dtype=partial_dtype, config=config)
    return record_kernel(op, choice)


def run_push(provider: str, a_shard, ws, rank: int, world_size: int, n: int) -> None:
    """Run ``provider``'s push of all_gather_matmul (gathered rows and flags for ``gathered_matmul``)."""
    check_provider(registry.ALL_GATHER_MATMUL.name, provider)
    if provider == "copy_engine":
        from distfuse.fused.all_gather_copy_engine import ag_push_copy_engine as push
    else:
        from distfuse.kernels.all_gather_matmul import ag_push as push
    push(a_shard, ws, rank, world_size, n)
