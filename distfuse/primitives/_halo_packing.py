"""The unfused halo exchange's messages packed by one indexed gather, and the boxes that come back added by one.

A worker's messages are boxes of its block (forward) or of its staged gradient (adjoint): 2 to 26 of them in
1-3 spatial axes.  Made box by box, each is an indexing and a copy (``x[box].contiguous()``), and each box that
comes back is an indexing and an add: 3-4 us of host time apiece on a CPU core, about 90 us each way for the 26
of a 3-D worker.  Packed, the messages are one ``torch.take`` of a cached index (the boxes' elements, box after
box, each in its own row-major order: what the copies would have made), split into flat views of one buffer,
and the boxes that come back are received into one buffer and added by one indexed add::

    send      = take(x, send_index)             [total]   split into the plan's send messages
    outgoing  = take(grad, outgoing_index)      [total]   the adjoint's messages (reversed boxes flipped back)
    grad_x   += add_incoming(recv)              [total]   the received boxes added, box after box

(one core of a 2-core AMD EPYC, a 3-D interior worker, us: sends 92 -> 12, the adjoint's messages 85 -> 60 with
the rest of its unstaging, the adds 81 -> 3; ``tests/test_halo_pieces_assembly.py``,
``tests/test_halo_exchange.py`` check both forms give the same bits).  The receive buffers stay one allocation a
box: views of one buffer would cost a view a box, more than the allocation.

``incoming_index`` holds memory offsets into the block's gradient (any dense format); the others are logical
indices (``take`` reads any strides).  The boxes that come back overlap where they meet (a corner element comes
back from up to seven neighbours), so the add must keep one order: on CPUs ``index_add_`` runs its index in
order, one element after another, so each element's terms are added in the plan's box order, as the add per box
does (the same bits); on GPUs ``index_add_`` uses atomics, whose order varies between runs, so the add is
``index_put_(accumulate=True)``, which sorts the index (stably) and adds each element's terms one after another
(:func:`add_incoming`; deterministic by torch's own list, unmeasured on a GPU here).  A box the adjoint sums (a
replicated row) is not a gather: a worker that sends one back keeps the copies per box.

The index costs 8 bytes an element and the gather reads it, so the packed form is for small messages
(:data:`PACKED_HALO_BYTES`), where the host time it saves is the step's: past it, the copies per box move fewer
bytes.  Indices are built once per plan, worker, shape and device (plans hash by identity and live as long as
their layer).
"""

from __future__ import annotations

import functools
import math

import torch

from distfuse.geometry.halo_plan import HaloPlan

__all__ = ["PACKED_HALO_BYTES", "packs", "message_numels", "send_index", "outgoing_index", "incoming_index",
           "add_incoming", "ordered_index_add"]

#: Messages of one direction totalling at most this many bytes (per device type; others as ``"cpu"``) are packed
#: by one indexed gather.  CPU: a box copy costs ~4 us of host time against ~1 ns an element for the gather's
#: index, so the gather wins up to some 10^5 elements; 256 KiB keeps it well inside.  GPU: one launch instead of
#: up to 26 (5-15 us of host each on the H200's host), with an index of at most 4 MiB per direction and shape.
PACKED_HALO_BYTES = {"cuda": 1 << 20, "cpu": 256 << 10}


def packs(numel: int, t: torch.Tensor) -> bool:
    """Whether ``numel`` message elements of ``t``'s dtype and device take the packed form."""
    bound = PACKED_HALO_BYTES.get(t.device.type, PACKED_HALO_BYTES["cpu"])
    return 0 < numel * t.element_size() <= bound


@functools.lru_cache(maxsize=1024)
def message_numels(plan: HaloPlan, index: tuple[int, ...], lead: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The element counts of worker ``index``'s sent and received messages (``lead`` leading elements a
    position), in ``plan.sends(index)`` and ``plan.recvs(index)`` order."""
    return (tuple(lead * math.prod(pc.src_shape) for _, pc in plan.sends(index)),
            tuple(lead * math.prod(pc.src_shape) for pc in plan.recvs(index)))


def _positions(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.arange(math.prod(shape), device=device).view(shape)


@functools.lru_cache(maxsize=256)
def send_index(plan: HaloPlan, index: tuple[int, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Logical indices into a block of ``shape`` of every element of worker ``index``'s sent boxes, box after box
    (``plan.sends(index)`` order), each box row-major."""
    pos = _positions(shape, device)
    return torch.cat([pos[pc.src_index].reshape(-1) for _, pc in plan.sends(index)])


@functools.lru_cache(maxsize=256)
def outgoing_index(plan: HaloPlan, index: tuple[int, ...], shape: tuple[int, ...],
                   device: torch.device) -> torch.Tensor | None:
    """Logical indices into a staged gradient of ``shape`` of the adjoint's messages (the received pieces'
    boxes, ``plan.recvs(index)`` order, a reversed box flipped back), or None where one of them is summed (a
    replicated row: no gather)."""
    pos, parts = _positions(shape, device), []
    for pc in plan.pieces(index):
        if pc.src is None or pc.src == index:
            continue
        if pc.repeated:
            return None
        box = pos[pc.dst_index]
        parts.append((box.flip(pc.flipped) if pc.flipped else box).reshape(-1))
    return torch.cat(parts)


@functools.lru_cache(maxsize=256)
def incoming_index(plan: HaloPlan, index: tuple[int, ...], shape: tuple[int, ...], strides: tuple[int, ...],
                   device: torch.device) -> torch.Tensor:
    """Memory offsets, in a dense block gradient of ``shape`` and ``strides``, of every element of the boxes that
    come back to worker ``index`` (``plan.sends(index)`` order, each box row-major)."""
    pos = torch.arange(math.prod(shape), device=device).as_strided(shape, strides)
    return torch.cat([pos[pc.src_index].reshape(-1) for _, pc in plan.sends(index)])


def add_incoming(grad_x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...], flat: torch.Tensor) -> None:
    """Add the boxes that came back to worker ``index`` (``flat``: end to end, ``plan.sends(index)`` order, each
    row-major) into ``grad_x`` (a dense block gradient, any memory format) in one call, in a fixed order: every
    element gets its terms in box order.  CPU: ``index_add_``, which runs its index in order.  CUDA:
    ``index_put_(accumulate=True)``, whose sorting kernel adds each element's terms one after another in a stable
    order (deterministic; torch lists it so, unlike ``index_add_`` there, which uses atomics)."""
    into = incoming_index(plan, index, tuple(grad_x.shape), tuple(grad_x.stride()), grad_x.device)
    ordered_index_add(grad_x.as_strided((grad_x.numel(),), (1,)), into, flat.to(grad_x.dtype))


def ordered_index_add(target: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> None:
    """``target[at[i]] += values[i]`` for a flat ``target``, every element's terms added one after another in one
    fixed order, run after run: CPU ``index_add_`` (in index order), GPUs ``index_put_(accumulate=True)`` (sorted
    stably; ``index_add_`` there uses atomics, whose order varies)."""
    if target.device.type == "cpu":
        target.index_add_(0, at, values)
    else:
        target.index_put_((at,), values, accumulate=True)
