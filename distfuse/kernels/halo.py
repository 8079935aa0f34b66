"""Triton kernels of the fused halo convolution: pack, stage, unstage, accumulate.

Every tensor is viewed as ``[LEAD, *spatial]`` (LEAD = all leading dims flattened,
batch * channels) with 1, 2 or 3 spatial axes; inside the kernels a 1-D or 2-D problem
is a 3-D one with leading axes of extent 1.  The geometry is a :class:`HaloPlan`
(``geometry/halo_plan.py``); every buffer below is flat, box after box, each box
``[LEAD, *box_shape]`` contiguous, so a message is the same bytes as the unfused path's
``x[..., box].contiguous()`` and a fused rank can talk to an unfused one.

Channels last (``channels_last=True``, or a ``[B, C, *n]`` tensor dense only in
``channels_last`` / ``channels_last_3d`` order): the kernels view every tensor as ``[B,
*spatial, C]`` (:class:`Layout`: LEAD = B, TRAIL = C), and each box of a flat buffer is
``[B, *box_shape, C]`` at the same offset as NCHW's box, so the workers of one exchange
must agree on the format (the layers pass the agreed one).  The staging then writes rows
of ``L_last * C`` contiguous elements from multiples of C: 16-byte vectors at any halo
width (:func:`~distfuse.kernels.halo_programs.stage_launch`).  The host-side
layouts and lookup/box tables the kernels read are built in ``kernels/halo_tables.py``.

=============  =========================================================  ====================
kernel         writes                                                     reads
=============  =========================================================  ====================
pack           send  [sum_k LEAD*|src_k|]  boxes of ``plan.sends`` order  x  [LEAD, *n]
stage          staged [LEAD, *L]  every element once, one launch: the     x, recv (``recvs``)
               interior window by a plain copy, the rest by the tables
unstage        grad_x [LEAD, *n] (interior, 0 elsewhere), send-back        grad_staged [LEAD, *L]
               boxes (``recvs`` order), self boxes (fp32)
accumulate     grad_x += self boxes + received boxes, in place            self, incoming (``sends``)
=============  =========================================================  ====================

Forward of worker ``i``:  ``staged = stage(x, exchange(pack(x)))``.  The adjoint of
stage is unstage, then the send-back boxes travel to their owners and accumulate adds
them: ``grad_x = accumulate(unstage(g), exchange(send_back))``.

The Triton programs and their launch geometry are in :mod:`distfuse.kernels.halo_programs`
(its docstring gives the design decisions), the cached launches of pack, unstage and
accumulate in :mod:`distfuse.kernels.halo_launches`; this module holds the four launchers,
their checks, and the torch references they are tested and benchmarked against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from distfuse.errors import UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan, adjoint_box, read_box
from distfuse.kernels._utils import BoundedMemo
from distfuse.kernels.halo_launches import (
    UnstageLaunch,
    accumulate_launch,
    launch_accumulate,
    launch_box_gather,
    pack_launch,
    unstage_launch,
)
from distfuse.kernels.halo_programs import launch_stage, stage_launch
from distfuse.kernels.halo_tables import (
    box_offsets,
    check_flat,
    check_plan_layout,
    interior_piece,
    plan_tensor_lead,
    recv_numel,
    self_numel,
    self_pieces,
    send_numel,
)

__all__ = ["REGIONS", "CHANNELS_LAST", "Layout", "is_channels_last", "layout_format",
           "Unstaged", "halo_pack", "halo_stage", "halo_unstage", "halo_accumulate", "halo_pack_reference",
           "halo_stage_reference", "halo_unstage_reference", "halo_accumulate_reference", "send_numel", "recv_numel",
           "self_numel"]

REGIONS = ("all", "local", "remote")


def _check_region(op: str, region: str) -> None:
    if region not in REGIONS:
        raise UnsupportedError(f"{where(op)}: region must be one of {REGIONS}, got {region!r}")


def _lead_shape(t: torch.Tensor, nd: int) -> tuple[int, ...]:
    """The leading dims of ``t``, before its ``nd`` spatial ones."""
    return tuple(t.shape[: t.dim() - nd])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the self boxes: fp64 for fp64 gradients, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: The channels-last format of a tensor of 2 or 3 spatial axes (``[B, C, *spatial]``).
CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}


def layout_format(nd: int, channels_last: bool) -> torch.memory_format:
    """The memory format of a ``[B, C, *spatial]`` tensor (``nd`` spatial axes) in the layout ``channels_last``
    says: what the fused halo ops allocate and make their blocks contiguous in."""
    return CHANNELS_LAST[nd] if channels_last else torch.contiguous_format


def is_channels_last(t: torch.Tensor, nd: int) -> bool:
    """Whether ``t`` ``[B, C, *spatial]`` (``nd`` spatial axes) is dense in channels-last order and not in NCHW
    order (a tensor dense in both has one memory order for both, and is taken as NCHW): the rule of
    :func:`distfuse.primitives._layout.memory_format_of`, which the kernels' floor may not import."""
    fmt = CHANNELS_LAST.get(nd)
    return (fmt is not None and t.dim() == nd + 2 and not t.is_contiguous()
            and t.is_contiguous(memory_format=fmt))


class Layout(NamedTuple):
    """How the halo kernels view a tensor ``[*lead, *spatial]``: ``lead`` vectors of ``trail`` elements per
    spatial position.  NCHW: ``lead`` = prod(lead dims), ``trail`` = 1.  Channels last: ``lead`` = B,
    ``trail`` = C (``[B, *spatial, C]`` in memory), and every flat buffer holds its boxes as ``[B, *box, C]``."""

    lead: int
    trail: int
    memory_format: torch.memory_format


def _layout(op: str, t: torch.Tensor, plan: HaloPlan, what: str, channels_last: bool | None) -> Layout:
    """The kernels' view of ``t`` (its rank checked against the plan); ``channels_last`` None: from ``t``'s
    strides (:func:`is_channels_last`).  The flat buffers' order follows it, so a caller whose peers must read
    them passes the agreed format explicitly."""
    lead = plan_tensor_lead(op, t, plan, what)
    nd = len(plan.axes)
    if channels_last is None:
        channels_last = is_channels_last(t, nd)
    if not channels_last:
        return Layout(lead, 1, torch.contiguous_format)
    if nd not in CHANNELS_LAST or t.dim() != nd + 2:
        raise UnsupportedError(f"{where(op)}: channels last needs {what} [B, C, *spatial] with 2 or 3 spatial axes, "
                               f"got {t.dim()} dimensions for {nd} spatial axes")
    return Layout(t.shape[0], t.shape[1], CHANNELS_LAST[nd])


def _empty(t: torch.Tensor, shape: tuple[int, ...], layout: Layout) -> torch.Tensor:
    if layout.trail == 1:  # NCHW: torch's default format (naming it costs a small step's host time)
        return torch.empty(shape, dtype=t.dtype, device=t.device)
    return torch.empty(shape, dtype=t.dtype, device=t.device, memory_format=layout.memory_format)


def _meta(t: torch.Tensor) -> tuple:
    """What the launchers check of a tensor (shape, strides, dtype, device): the key of their checked calls."""
    return t.shape, t.stride(), t.dtype, t.device


#: The checked calls of the pack, stage, unstage and accumulate launchers: per plan, worker, options and the metadata of
#: the tensors they check (:func:`_meta`), the kernels' view of them (:class:`Layout`, and the staging's output
#: shape).  A call whose tensors look like a checked call's skips the checks, which are a pure function of that
#: key: with every launch stubbed (``scripts/host_cost.py --kernels``) they were 2.2 of a staging's 5.7 us, and the
#: fused halo conv's small steps lose to ``torch.cat``'s by host time alone.  An argument that fails a check is
#: never stored, so it raises at every call.  The launches themselves still come from their caches
#: (``pack_launch``, ``stage_launch``, ``unstage_launch``, ``accumulate_launch``), so clearing those takes effect at
#: the next call.
_CHECKED = BoundedMemo(1024)


# ---------------------------------------------------------------- launchers


def halo_pack(x: torch.Tensor, plan: HaloPlan, index: Sequence[int], *, out: torch.Tensor | None = None,
              block: int | None = None, channels_last: bool | None = None) -> torch.Tensor:
    """Gather every box other workers read from ``x`` into one flat send buffer, in one launch.

    Args:
        x: ``[*lead, *n]`` this worker's block, contiguous.
        out: optional flat buffer of ``send_numel(plan, index, LEAD)`` elements.
        channels_last: ``x`` is ``[B, C, *n]`` dense in channels-last order, and the boxes are laid out
            ``[B, *box, C]``; None: from ``x``'s strides.

    Returns the flat buffer: box k (``plan.sends(index)[k]``) is ``x[..., src box]``,
    contiguous (in NCHW or channels-last order), at ``box_offsets``.  Everything but the launch
    is cached per ``(plan, index, LEAD, device, block)``
    (:func:`~distfuse.kernels.halo_launches.pack_launch`).  Adjoint: accumulate of the received
    boxes.
    """
    index = tuple(index)
    key = ("pack", plan, index, block, channels_last, *_meta(x))
    lay = _CHECKED.get(key)
    checked = lay is not None
    if not checked:
        lay = _layout("halo_pack", x, plan, "x", channels_last)
    launch = pack_launch(plan, index, lay.lead, x.device, block, lay.trail)
    if not checked:
        check_plan_layout("halo_pack", x, launch.input_shape, "x", lay.memory_format)
        _CHECKED.keep(key, lay)
    if out is None:  # a buffer this call allocates is not checked
        out = x.new_empty(launch.send_numel)
    else:
        check_flat("halo_pack", out, launch.send_numel, x.dtype, x.device, "send buffer")
    if launch.boxes is not None:
        launch_box_gather(out, out, x, launch.boxes)
    return out


def halo_stage(x: torch.Tensor, recv: torch.Tensor, plan: HaloPlan, index: Sequence[int], *,
               out: torch.Tensor | None = None, region: str = "all",
               tile: tuple[int, ...] | None = None, channels_last: bool | None = None,
               words: bool | None = None) -> torch.Tensor:
    """Write the staged convolution input ``[*lead, *plan.staged_shape(index)]`` in one pass, one kernel.

    Args:
        x: ``[*lead, *n]`` this worker's block, contiguous.
        recv: flat receive buffer, box k = ``plan.recvs(index)[k]``'s source box
            ``[LEAD, *src_shape]`` (what the owner's :func:`halo_pack` sent).
        out: optional staged tensor to write into (for the two-pass overlap).
        region: ``"all"``; ``"local"`` writes only the pieces read from ``x`` and the zero
            fill (they need no message, so they can run while the exchange is in flight);
            ``"remote"`` only the pieces read from ``recv``.
        tile: ``(BLOCK_R, BLOCK_X)`` override (tests), or all of ``(BLOCK_R, BLOCK_X, SLAB_X, STRIP_X,
            num_warps)`` (the GPU tile sweep).
        channels_last: ``x`` ``[B, C, *n]`` and the staged output are dense in channels-last order and the
            received boxes are ``[B, *box, C]``; None: from ``x``'s strides.  Every staged row is then a
            contiguous run of ``L_last * C`` elements starting at a multiple of C, so the copy moves 16-byte
            vectors at any halo width (NCHW rows of odd halos start at odd offsets).
        words: the window's rows as flat 32-bit words, then the strips and the slabs
            (:mod:`~distfuse.kernels.halo_stage_words`: NCHW, regions ``"all"`` and ``"local"``, whose local pass
            then leaves the received elements of its words 0 for the remote pass); None: on GPUs where
            ``DISTFUSE_STAGE_WORDS=1``, from 2^24 staged elements; True or False forces it where it applies.

    Each staged element is written once (the pieces tile the staged box), by one launch of
    :func:`~distfuse.kernels.halo_programs.stage_kernel` (two on GPUs where there are slabs: the window's
    programs, then the slabs', :data:`~distfuse.kernels.halo_programs.STAGE_SPLIT`)::

        staged[..., window]              = x[..., src window]     plain copy, no table load
        staged[..., window rows, beside] = piece per column       the window tiles' edge columns
        staged[..., other rows, :]       = table walk             x, recv or 0, per element

    The window is the interior piece (the block itself: 91% of the staged tensor for a 64^3
    block at halo 1).  One launch instead of a strided ``copy_`` plus one table-walk launch per
    shell box: the host cost of seven launches was 15-50x a device copy's, and the window's copy
    runs without the walk's per-element table loads (numbers: :mod:`~distfuse.kernels.halo_programs`).
    A worker without an interior window walks the tables everywhere (``lut_gather_kernel``).
    Everything but the launch is cached per ``(plan, index, LEAD, device, region, tile, dtype)``
    (:func:`~distfuse.kernels.halo_programs.stage_launch`; on GPUs a measured config of the staging, from the tile
    table, takes the rules' place).  Adjoint: :func:`halo_unstage`.
    """
    index = tuple(index)
    tile = None if tile is None else tuple(tile)
    key = ("stage", plan, index, region, tile, channels_last, *_meta(x), *_meta(recv))
    checked = _CHECKED.get(key)
    if checked is None:
        _check_region("halo_stage", region)
    lay = _layout("halo_stage", x, plan, "x", channels_last) if checked is None else checked[0]
    # positional (lru_cache keys keywords apart); the dtype picks a measured config on GPUs (tile_table)
    launch = stage_launch(plan, index, lay.lead, x.device, region, tile, None, lay.trail, None, words, x.dtype)
    if checked is None:
        check_plan_layout("halo_stage", x, launch.input_shape, "x", lay.memory_format)
        check_flat("halo_stage", recv, launch.recv_numel, x.dtype, x.device, "receive buffer")
        checked = _CHECKED.keep(key, (lay, _lead_shape(x, len(launch.staged_shape)) + launch.staged_shape))
    want = checked[1]
    if out is None:
        out = _empty(x, want, lay)
    elif (tuple(out.shape) != want or out.dtype != x.dtype
          or not out.is_contiguous(memory_format=lay.memory_format)):
        raise expect("halo_stage", f"out (contiguous in {lay.memory_format}, x's dtype)", (want, x.dtype),
                     (tuple(out.shape), out.dtype))
    # Empty buffers are never dereferenced (no piece of that kind); pass a live pointer anyway.
    launch_stage(out, x if x.numel() > 0 else out, recv if recv.numel() > 0 else out, launch)
    return out


class Unstaged(NamedTuple):
    """Output of :func:`halo_unstage`; parts outside the requested region are None."""

    grad_x: torch.Tensor | None  # [*lead, *n], grad's dtype: the interior's gradient, 0 elsewhere
    send: torch.Tensor | None  # flat, grad's dtype: box k = gradient of plan.recvs(index)[k]'s source box
    self_boxes: torch.Tensor | None  # flat, fp32 (fp64 for fp64): gradient of self_pieces(plan, index)[k]


def halo_unstage(grad: torch.Tensor, plan: HaloPlan, index: Sequence[int], *, region: str = "all",
                 grad_x: torch.Tensor | None = None, send: torch.Tensor | None = None,
                 self_boxes: torch.Tensor | None = None, tile: tuple[int, int] | None = None,
                 block: int | None = None, channels_last: bool | None = None) -> Unstaged:
    """Split the staged gradient ``[*lead, *L]`` by where each staged box was read from (adjoint of stage).

    * ``grad_x`` ``[*lead, *n]``: the interior piece's gradient (a copy), 0 at every
      other position of the block (they get theirs in :func:`halo_accumulate`).
    * ``send``: per received piece, the gradient of its source box, reversed back for
      reflect and summed over the run for replicate, in ``plan.recvs`` order: what goes
      back to the owner.
    * ``self_boxes``: the same for the worker's own non-interior pieces, kept in fp32.

    ``region="remote"`` computes only ``send`` (post it first), ``"local"`` the other two.
    ``grad_x``/``send``/``self_boxes`` may be given preallocated (workspaces, poisoned
    buffers in tests); outputs of other regions are ignored.  Zero-fill pieces have no
    gradient.  One read of every staged element that has a source; replicate sums are
    gathers (no atomics).  One launch: where the interior window covers the block and holds at most
    :data:`~distfuse.kernels.halo_launches.UNSTAGE_WINDOW_ELEMENTS` elements, its copy into ``grad_x`` is one more
    box of the gather (no strided ``copy_``, no views: the host time small steps show); else a strided copy
    follows.  Everything but the launches is cached per ``(plan, index, LEAD,
    device, region, block)`` (:func:`~distfuse.kernels.halo_launches.unstage_launch`);
    ``tile`` is unused (no row-tiled launch).  ``channels_last``: the staged gradient and ``grad_x`` are dense in
    channels-last order and the flat buffers' boxes are ``[B, *box, C]`` (what the forward's peers expect: pass
    the agreed format); None: from ``grad``'s strides.
    """
    index = tuple(index)
    key = ("unstage", plan, index, region, block, channels_last, *_meta(grad))
    lay = _CHECKED.get(key)
    checked = lay is not None
    if not checked:
        _check_region("halo_unstage", region)
        lay = _layout("halo_unstage", grad, plan, "staged gradient", channels_last)
    launch = unstage_launch(plan, index, lay.lead, grad.device, region, block, lay.trail)
    if not checked:
        check_plan_layout("halo_unstage", grad, launch.staged_shape, "staged gradient", lay.memory_format)
        _CHECKED.keep(key, lay)
    send = _unstage_send(grad, send, launch) if region in ("all", "remote") else None
    if region in ("all", "local"):
        self_boxes, grad_x = _unstage_local_outputs(grad, self_boxes, grad_x, launch, lay)
    else:
        self_boxes = grad_x = None
    if launch.boxes is not None:  # some box has elements, so grad has: an empty output is never dereferenced
        launch_box_gather(send if send is not None and send.numel() else grad,
                          self_boxes if self_boxes is not None and self_boxes.numel() else grad, grad, launch.boxes,
                          grad_x if launch.window_in_boxes else None)
    if grad_x is not None and not launch.window_in_boxes:  # the interior's gradient: a strided copy, 0 elsewhere
        if launch.zero_grad_x:
            grad_x.zero_()
        if launch.interior_dst is not None:
            window = grad_x if launch.interior_src is None else grad_x[launch.interior_src]
            window.copy_(grad[launch.interior_dst])
    return Unstaged(grad_x, send, self_boxes)


@functools.lru_cache(maxsize=64)
def _no_elements(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One shared flat tensor of no elements per dtype and device: the unstage's output of a kind of box the worker
    has none of (self boxes under zero padding, send-back boxes without neighbours), which nothing writes or reads;
    an allocation costs a small step's host time (several us each on a GPU's host)."""
    return torch.empty(0, dtype=dtype, device=device)


def _unstage_send(grad: torch.Tensor, send: torch.Tensor | None, launch: UnstageLaunch) -> torch.Tensor:
    """The send-back buffer, flat ``[launch.send_numel]`` in grad's dtype: ``send`` checked, or a new one (a buffer
    this call allocates is not checked again: the host time of a small step counts)."""
    if send is None:
        return grad.new_empty(launch.send_numel) if launch.send_numel else _no_elements(grad.dtype, grad.device)
    check_flat("halo_unstage", send, launch.send_numel, grad.dtype, grad.device, "send-back buffer")
    return send


def _unstage_local_outputs(grad: torch.Tensor, self_boxes: torch.Tensor | None, grad_x: torch.Tensor | None,
                           launch: UnstageLaunch, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(self_boxes, grad_x)``: flat ``[launch.self_numel]`` in fp32 (fp64) and ``[*lead, *n]`` in grad's dtype,
    contiguous in ``lay``'s format; the given ones checked, or new ones."""
    acc_dtype = _acc_dtype(grad.dtype)
    if self_boxes is None:
        self_boxes = (torch.empty(launch.self_numel, dtype=acc_dtype, device=grad.device) if launch.self_numel
                      else _no_elements(acc_dtype, grad.device))
    else:
        check_flat("halo_unstage", self_boxes, launch.self_numel, acc_dtype, grad.device, "self boxes")
    want = _lead_shape(grad, len(launch.staged_shape)) + launch.input_shape
    if grad_x is None:
        return self_boxes, _empty(grad, want, lay)
    if (tuple(grad_x.shape) != want or grad_x.dtype != grad.dtype
            or not grad_x.is_contiguous(memory_format=lay.memory_format)):
        raise expect("halo_unstage", f"grad_x (contiguous in {lay.memory_format}, grad's dtype)", (want, grad.dtype),
                     (tuple(grad_x.shape), grad_x.dtype))
    return self_boxes, grad_x


def halo_accumulate(grad_x: torch.Tensor, self_boxes: torch.Tensor, incoming: torch.Tensor, plan: HaloPlan,
                    index: Sequence[int], *, block: int | None = None,
                    channels_last: bool | None = None) -> torch.Tensor:
    """Add the self boxes and the received halo gradients into ``grad_x`` in place; return it.

    Args:
        grad_x: ``[*lead, *n]`` from :func:`halo_unstage` (interior gradient).
        self_boxes: flat fp32 (fp64) buffer from :func:`halo_unstage`.
        incoming: flat buffer in ``grad_x``'s dtype, box k = gradient of the box
            ``plan.sends(index)[k]`` sent in the forward (what its reader sent back).

    Overlapping boxes are summed in fp32 with the interior value and rounded once, in box order
    (self boxes, then the incoming ones).  One launch over the cells of the block that some box
    covers (its shell): the interior, which no box covers, is neither read nor written.
    ``block``: elements a program (tests).  Everything but the launch is cached per ``(plan,
    index, LEAD, device, block)`` (:func:`~distfuse.kernels.halo_launches.accumulate_launch`).  ``channels_last``:
    ``grad_x`` is dense in channels-last order and both buffers hold ``[B, *box, C]`` boxes; None: from
    ``grad_x``'s strides.
    """
    index = tuple(index)
    key = ("accumulate", plan, index, block, channels_last, *_meta(grad_x), *_meta(self_boxes), *_meta(incoming))
    lay = _CHECKED.get(key)
    checked = lay is not None
    if not checked:
        lay = _layout("halo_accumulate", grad_x, plan, "grad_x", channels_last)
    launch = accumulate_launch(plan, index, lay.lead, grad_x.device, block, lay.trail)
    if not checked:
        check_plan_layout("halo_accumulate", grad_x, launch.input_shape, "grad_x", lay.memory_format)
        check_flat("halo_accumulate", self_boxes, launch.self_numel, _acc_dtype(grad_x.dtype), grad_x.device,
                   "self boxes")
        check_flat("halo_accumulate", incoming, launch.send_numel, grad_x.dtype, grad_x.device,
                   "incoming halo gradients")
        _CHECKED.keep(key, lay)
    if grad_x.numel() == 0:
        return grad_x
    launch_accumulate(grad_x, self_boxes, incoming, launch)
    return grad_x


# ------------------------------------------------ pure-torch references (the test oracle, the unfused baseline)


def _split(buf: torch.Tensor, shapes, lead_shape) -> list[torch.Tensor]:
    offs, _ = box_offsets(shapes, math.prod(lead_shape))
    return [buf[o: o + math.prod(lead_shape) * math.prod(s)].view(tuple(lead_shape) + tuple(s)) for o, s in
            zip(offs, shapes, strict=True)]


def halo_pack_reference(x: torch.Tensor, plan: HaloPlan, index: Sequence[int]) -> torch.Tensor:
    index = tuple(index)
    parts = [x[pc.src_index].reshape(-1) for _, pc in plan.sends(index)]
    return torch.cat(parts) if parts else x.new_empty(0)


def halo_stage_reference(x: torch.Tensor, recv: torch.Tensor, plan: HaloPlan, index: Sequence[int], *,
                         out: torch.Tensor | None = None, region: str = "all") -> torch.Tensor:
    index = tuple(index)
    lead_shape = _lead_shape(x, len(plan.axes))
    received = _split(recv, [pc.src_shape for pc in plan.recvs(index)], lead_shape)
    if out is None:
        out = x.new_empty(lead_shape + plan.staged_shape(index))
    it = iter(received)
    for pc in plan.pieces(index):
        dst = pc.dst_index
        if pc.src is None or pc.src == index:  # zero fill or a piece of x: no message
            if region != "remote":
                out[dst] = 0 if pc.src is None else read_box(x[pc.src_index], pc)
        else:
            box = next(it)
            if region != "local":
                out[dst] = read_box(box, pc)
    return out


def halo_unstage_reference(grad: torch.Tensor, plan: HaloPlan, index: Sequence[int]) -> Unstaged:
    """Float64 sums, then cast like the kernel: grad_x and send to grad's dtype, self boxes to fp32."""
    index = tuple(index)
    lead_shape = _lead_shape(grad, len(plan.axes))
    g = grad.double()
    grad_x = torch.zeros(lead_shape + plan.input_shape(index), dtype=grad.dtype, device=grad.device)
    interior = interior_piece(plan, index)
    if interior is not None:
        grad_x[interior.src_index] = grad[interior.dst_index]
    send = [adjoint_box(g[pc.dst_index], pc).reshape(-1) for pc in plan.recvs(index)]
    selfb = [adjoint_box(g[pc.dst_index], pc).reshape(-1) for pc in self_pieces(plan, index)]
    acc = _acc_dtype(grad.dtype)
    send = torch.cat(send).to(grad.dtype) if send else grad.new_empty(0)
    selfb = torch.cat(selfb).to(acc) if selfb else torch.empty(0, dtype=acc, device=grad.device)
    return Unstaged(grad_x, send, selfb)


def halo_accumulate_reference(grad_x: torch.Tensor, self_boxes: torch.Tensor, incoming: torch.Tensor,
                              plan: HaloPlan, index: Sequence[int]) -> torch.Tensor:
    """Float64 sum of the interior gradient, the self boxes and the incoming boxes, cast to grad_x's dtype."""
    index = tuple(index)
    lead_shape = _lead_shape(grad_x, len(plan.axes))
    out = grad_x.double().clone()
    for pieces, buf in ((self_pieces(plan, index), self_boxes), ([pc for _, pc in plan.sends(index)], incoming)):
        for pc, box in zip(pieces, _split(buf, [p.src_shape for p in pieces], lead_shape), strict=True):
            out[pc.src_index] += box.double()
    return out.to(grad_x.dtype)
