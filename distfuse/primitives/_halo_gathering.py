"""The unfused halo staging of a small block as one indexed gather, and its adjoint as one indexed add.

The staged input of a worker is a grid of pieces read from its block, from the boxes its
neighbours sent and from zero fill (:func:`~distfuse.primitives.halo_exchange.stage_from_pieces`
builds it by views and a nest of ``torch.cat``: 4 concatenations and 9 views for a 2-D interior
worker, 13 and 27 for 3-D, and as many splits, copies and adds back in its adjoint).  Every staged
element is a copy of one source element, so with the sources laid end to end in one flat buffer,
the staging is one gather through a cached index::

    src     = cat(block's memory, received boxes end to end, 0)     [numel(x) + numel(recv) + 1]
    staged  = src[index]                                            one element of src per staged element,
                                                                    in the staged tensor's memory order

and its adjoint one indexed add of the staged gradient into a gradient of ``src`` (fp32 for 16-bit
data), whose head is the block's own gradient and whose tail is the messages to send back, in the
order the neighbours expect them (``plan.recvs(index)``, each box row-major)::

    grad_src[index] += grad                      (CPU: index_add_, in index order; GPU: index_put_(accumulate=True),
                                                  which sorts the index stably: both a fixed order, run to run)
    grad_x   = grad_src[: numel(x)]              (a view, in the block's format, at the buffer's start: aligned)
    outgoing = grad_src[numel(x) : -1]           (rounded to the data's dtype once: replicated rows summed in fp32)

Zero fill reads the last element (its gradient is dropped).  The bench's unfused step (staging,
conv, backward and the adds of the boxes that come back, without the exchange: ``pieces`` rows of
``bench/bench_halo_conv.py``; ``scripts/host_cost.py --kernels``, one core of a 2-core AMD EPYC,
us per call) went from 796 to 554 (2-D interior worker) and from 1325 to 756 (3-D), against 322
and 437 for the ``cat`` step and 415 and 492 for the fused one.  The gather reads an 8-byte index
per staged element and the block once more (the ``cat``), so it is for small blocks
(:data:`GATHERED_STAGING_BYTES`), where the host time it saves is the step's.

The sums differ from the views' path only in their order: an element of the block read by several
pieces (reflect, replicate or circular padding on one worker) gets its terms in the staged tensor's
memory order here, in piece order there (both in fp32 for 16-bit data, rounded once).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from distfuse.geometry.halo_plan import HaloPlan, read_box
from distfuse.primitives._halo_packing import ordered_index_add
from distfuse.primitives._layout import empty_in

__all__ = ["GATHERED_STAGING_BYTES", "Gather", "gathers", "gather_plan", "stage_gathered", "unstage_gathered"]

#: Staged tensors of at most this many bytes (per device type; others as ``"cpu"``) are staged by one gather when
#: the block is dense in its format.  The gather moves the block twice (the ``cat``, then the gather) and reads an
#: 8-byte index per staged element.  CPU: the views' path is then a nest of ``cat`` (``NESTED_STAGING_BYTES``, 64 KiB)
#: or a copy a box, and the gather's index costs ~1 ns an element against 3-5 us a call saved (20-60 calls a step).
#: GPU: at 2 MiB the extra bytes (about 12 MB for bf16 at ~3 TB/s, under 5 us) stay under the host time the
#: views' path takes there (a view, a ``cat`` or an add is 5-15 us of host on the H200's host, 20-60 of them per
#: step); unmeasured on a GPU.  The cached index is 4 times the staged bytes of 16-bit data (8 MiB at the bound),
#: kept per layer shape (:func:`gather_plan`, at most 64 of them).
GATHERED_STAGING_BYTES = {"cuda": 2 << 20, "cpu": 256 << 10}


def gathers(staged_numel: int, t: torch.Tensor) -> bool:
    """Whether a staged tensor of ``staged_numel`` elements of ``t``'s dtype and device is small enough to be
    staged by one gather (:data:`GATHERED_STAGING_BYTES`); the forward also needs its block dense in its format
    (the block's memory is the gather's source)."""
    bound = GATHERED_STAGING_BYTES.get(t.device.type, GATHERED_STAGING_BYTES["cpu"])
    return 0 < staged_numel * t.element_size() <= bound


class Gather(NamedTuple):
    """What a worker's gathered staging of one block shape and format needs, built once (:func:`gather_plan`)."""

    # [staged numel] int64, in the staged tensor's memory order: the offset of each staged element's source in
    # cat(memory of x, received boxes end to end, 0); the last offset for zero fill
    index: torch.Tensor
    staged_shape: tuple[int, ...]
    staged_strides: tuple[int, ...]  # dense in the block's format
    x_strides: tuple[int, ...]  # the block (and its gradient) dense in its format
    numel_x: int
    recv_sizes: tuple[int, ...]  # the received boxes' element counts, plan.recvs order
    length: int  # the source's: numel_x + sum(recv_sizes) + 1 (the zero)


@functools.lru_cache(maxsize=64)
def gather_plan(plan: HaloPlan, index: tuple[int, ...], x_shape: tuple[int, ...], fmt: torch.memory_format,
                device: torch.device) -> Gather:
    """The :class:`Gather` of worker ``index`` for a block of ``x_shape`` dense in ``fmt`` on ``device``."""
    nd = len(plan.axes)
    lead = x_shape[: len(x_shape) - nd]
    block = empty_in(x_shape, fmt, dtype=torch.int64, device="cpu")
    nx = block.numel()
    block.as_strided((nx,), (1,)).copy_(torch.arange(nx))  # each element's memory offset
    staged = empty_in(lead + plan.staged_shape(index), fmt, dtype=torch.int64, device="cpu")
    recv_sizes = tuple(math.prod(lead) * math.prod(pc.src_shape) for pc in plan.recvs(index))
    zero = nx + sum(recv_sizes)
    at, received = nx, iter(plan.recvs(index))
    for pc in plan.pieces(index):
        if pc.src is None:
            staged[pc.dst_index] = zero
            continue
        if pc.src == index:
            box = block[pc.src_index]
        else:
            shape = lead + tuple(next(received).src_shape)
            box = torch.arange(at, at + math.prod(shape)).view(shape)  # a received box: row-major, end to end
            at += box.numel()
        staged[pc.dst_index] = read_box(box, pc)
    return Gather(staged.as_strided((staged.numel(),), (1,)).to(device), tuple(staged.shape), staged.stride(),
                  block.stride(), nx, recv_sizes, zero + 1)


@functools.lru_cache(maxsize=64)
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero per dtype and device, the source of zero fill (``cat`` copies it; nothing writes it)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a flat view."""
    return t.as_strided((t.numel(),), (1,))


def stage_gathered(x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...], fmt: torch.memory_format,
                   received: torch.Tensor) -> torch.Tensor:
    """The staged input ``[*lead, *plan.staged_shape(index)]``, new and dense in ``fmt``, from ``x`` (dense in
    ``fmt``) and ``received`` (the received boxes end to end, ``plan.recvs(index)`` order, each row-major): one
    ``cat`` and one gather.  Bit for bit :func:`~distfuse.primitives.halo_exchange.stage_from_pieces`."""
    g = gather_plan(plan, index, tuple(x.shape), fmt, x.device)
    src = torch.cat((_memory(x), received, _zero(x.dtype, x.device)))
    # gathered into a tensor of its own, not returned as a view: an op's output that is a view of an intermediate
    # may not be modified in place (the layers fill their staged windows; autograd refuses in-place ops on it)
    staged = torch.empty_strided(g.staged_shape, g.staged_strides, dtype=x.dtype, device=x.device)
    torch.index_select(src, 0, g.index, out=_memory(staged))
    return staged


def unstage_gathered(grad: torch.Tensor, x_shape: tuple[int, ...], plan: HaloPlan, index: tuple[int, ...],
                     fmt: torch.memory_format) -> tuple[torch.Tensor, torch.Tensor]:
    """The adjoint of :func:`stage_gathered`: ``(grad_x, outgoing)``, the block's own gradient ``[x_shape]`` dense
    in ``fmt`` (fp32 for 16-bit data, to which the boxes that come back are added) and the messages to send back,
    end to end in ``plan.recvs(index)`` order, in ``grad``'s dtype (a flat view of the sum, rounded once).
    ``grad_x`` is a view of the sum's buffer: a caller that returns it in the data's dtype copies it (an op's
    output may not be a view of an intermediate)."""
    g = gather_plan(plan, index, x_shape, fmt, grad.device)
    accum = _ACCUM.get(grad.dtype, grad.dtype)
    values = _memory(grad if grad.is_contiguous(memory_format=fmt) else grad.contiguous(memory_format=fmt))
    if accum is not grad.dtype:
        values = values.to(accum)
    src_grad = torch.zeros(g.length, dtype=accum, device=grad.device)
    ordered_index_add(src_grad, g.index, values)  # each element's terms in the staged memory order
    outgoing = src_grad[g.numel_x: g.length - 1]
    return src_grad.as_strided(x_shape, g.x_strides, 0), outgoing if accum is grad.dtype else outgoing.to(grad.dtype)


_ACCUM = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
