"""Cached launches of the halo pack, unstage and accumulate: everything their launchers derive from the plan.

A launch depends on the plan, the worker's index, LEAD (the leading dims flattened), the device and the launcher's
options (region, tile, block), never on the data: the shapes the launcher checks, the flat buffers' sizes, the
lookup tables (already cached in :mod:`~distfuse.kernels.halo_tables`), the grid, the arguments and the
constexprs.  Recomputing them took most of an eager call's host time (with every launch stubbed on a CPU, 46 us of
an unstage and 15 us of an accumulate: ``staged_shape``, ``input_shape``, the buffer sizes, the box offsets,
``interior_piece(...).src_index``, ``pick_tile``, the grid), against a staging kernel of 23 us on an H200.  So
each is built once per key by an ``lru_cache(maxsize=512)`` function, as the staging's
:func:`~distfuse.kernels.halo_programs.stage_launch` is, and a call is one cache lookup, the shape checks, the
output allocation and the launches.  Plans hash by identity (one plan per geometry, held by the op that owns it).
Only the dtype-dependent constexprs (``COMPUTE``, ``ROUND_BF16``) are picked at launch.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels._utils import round_bf16
from distfuse.kernels.halo_programs import (
    BOX_NUM_WARPS,
    WIDE_ELEMENTS,
    accumulate_kernel,
    box_block,
    box_gather_kernel,
    compute_dtype,
    linear_grid,
    magic_divisor,
)
from distfuse.kernels.halo_tables import (
    accumulate_tables,
    contiguous_strides,
    interior_piece,
    pack_tables,
    pad3,
    recv_numel,
    self_numel,
    send_numel,
    unstage_box_tables,
)
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.launch_cache import cached_launch

__all__ = ["BoxLaunch", "PackLaunch", "UnstageLaunch", "AccumulateLaunch", "box_launch", "pack_launch",
           "unstage_launch", "accumulate_launch", "launch_box_gather", "launch_accumulate", "per_box_programs",
           "BOX_PROGRAMS", "UNSTAGE_WINDOW_ELEMENTS"]


class BoxLaunch(NamedTuple):
    """One ``box_gather_kernel`` launch over a box table (``pack_tables``, ``unstage_box_tables``): its grid,
    the arguments after the three pointers (``out0``, ``out1``, ``src``) and the dtype-free constexprs."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    bound: dict  # (source dtype, out0's dtype) -> its BoundLaunch (launch_cache), made at its first launch


def box_launch(tables, lead: int, src_shape: tuple[int, ...], device: torch.device,
               block: int | None, trail: int = 1) -> BoxLaunch | None:
    """The box gather of ``tables`` from a contiguous source ``[LEAD, *src_shape]`` (``[LEAD, *src_shape, trail]``
    channels last: the tables count vectors of ``trail`` channels); None when the boxes hold no element (nothing to
    launch).

    On GPUs (:func:`per_box_programs`) each box gets ``cdiv(NUMEL, BLOCK)`` programs of its own, laid end to end:
    an int32 program table names each program's box, whose row (int64, 24 wide) is the tables' 15 columns (``SEL
    DST E0 E1 E2 T0 T1 T2 D0 D1 D2 R0 R1 R2 RT``), then ``NUMEL`` (its elements, ``trail`` included), its first
    program, the :func:`~distfuse.kernels.halo_programs.magic_divisor` of E2, E1 and E0, and its first vector in the
    boxes laid end to end (``START``, what the interpreter's programs search instead)."""
    rows, numels, rtmax = tables
    src3 = pad3(src_shape, 1)
    total = sum(numels) * trail
    if total == 0:
        return None
    block = box_block(device, block, total)
    wide = max(total, lead * math.prod(src3) * trail) + block >= WIDE_ELEMENTS  # int64 offsets and div/mod then
    per_box = per_box_programs(device)
    table, pbox, start = [], [], 0
    for k, numel in enumerate(numels):
        row = list(rows[k * 15: k * 15 + 15])
        e0, e1, e2 = (max(1, e) for e in row[2:5])  # an empty box has no program: any divisor will do
        table += row + [numel * trail, len(pbox), *magic_divisor(e2), *magic_divisor(e1), *magic_divisor(e0), start]
        pbox += [k] * (cdiv(numel * trail, block) if per_box else 0)
        start += numel
    btab = torch.tensor(table, dtype=torch.int64, device=device)
    programs = len(pbox) if per_box else cdiv(total, block)
    return BoxLaunch(linear_grid(programs),
                     (torch.tensor(pbox or [0], dtype=torch.int32, device=device), btab, programs, len(numels), total,
                      rtmax, math.prod(src3), *contiguous_strides(src3)),
                     dict(TRAIL=trail, LOG2_NBOX=(len(numels) - 1).bit_length(), WIDE=wide, BLOCK=block,
                          PER_BOX=per_box, num_warps=BOX_NUM_WARPS), {})


def launch_box_gather(out0: torch.Tensor, out1: torch.Tensor, src: torch.Tensor, launch: BoxLaunch,
                      out2: torch.Tensor | None = None) -> None:
    """One launch of ``launch`` (from :func:`box_launch`): SEL 0 boxes into ``out0`` (rounded to its dtype), SEL 1
    boxes into ``out1``, SEL 2 boxes into ``out2`` (``out0``'s dtype; None: no SEL 2 box), read from ``src``;
    arithmetic in fp32 (fp64 for an fp64 source)."""
    key = (src.dtype, out0.dtype)
    bound = launch.bound.get(key)
    if bound is None:  # the first launch of these dtypes: bind the grid, the tables and the constexprs once
        meta = dict(launch.meta, COMPUTE=compute_dtype(src.dtype), ROUND_BF16=round_bf16(out0.dtype))
        bound = launch.bound[key] = cached_launch(box_gather_kernel).bind(launch.grid, launch.args, meta)
    bound(out0, out1, out0 if out2 is None else out2, src)


class PackLaunch(NamedTuple):
    """What :func:`~distfuse.kernels.halo.halo_pack` checks and launches for one ``(plan, index, LEAD, device,
    block)``: the block's spatial shape ``n``, the send buffer's size ``LEAD * sum_k |src_k|`` over
    ``plan.sends(index)``, and the box gather into it (None: nothing to send)."""

    input_shape: tuple[int, ...]
    send_numel: int
    boxes: BoxLaunch | None


@functools.lru_cache(maxsize=512)
def pack_launch(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device,
                block: int | None, trail: int = 1) -> PackLaunch:
    """The pack of worker ``index`` for ``lead`` leading elements (``trail`` channels last, else 1), cached: a call
    is a cache lookup, not the plan geometry and box offsets again (see the module docstring)."""
    x_shape = tuple(plan.input_shape(index))
    numel = send_numel(plan, index, lead * trail)
    boxes = (box_launch(pack_tables(plan, index, lead), lead, x_shape, device, block, trail) if numel
             else None)
    return PackLaunch(x_shape, numel, boxes)


class UnstageLaunch(NamedTuple):
    """What :func:`~distfuse.kernels.halo.halo_unstage` checks and launches for one ``(plan, index, LEAD, device,
    region, block)``.

    ``staged_shape`` ``L`` and ``input_shape`` ``n`` are the spatial shapes of the staged gradient and of
    ``grad_x``; ``send_numel`` and ``self_numel`` the sizes of the flat send-back buffer (``plan.recvs`` boxes) and
    of the self boxes (``self_pieces``), each ``LEAD * sum_k |src_k|``.  ``boxes`` gathers the region's send-back
    and self boxes in one launch (None: no box has an element), and, where ``window_in_boxes``, ``grad_x`` whole:
    the interior window's gradient is then one more box of that launch (:data:`UNSTAGE_WINDOW_ELEMENTS`).  Else
    ``zero_grad_x`` says whether ``grad_x`` has positions the interior piece does not cover (zeroed first);
    ``interior_dst`` indexes the staged gradient (``(..., *slices)``) for the interior's strided copy (None: no
    copy) and ``interior_src`` indexes ``grad_x`` (None: all of it, which saves the indexing of a view).
    """

    staged_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    send_numel: int
    self_numel: int
    boxes: BoxLaunch | None
    interior_src: tuple | None
    interior_dst: tuple | None
    zero_grad_x: bool
    window_in_boxes: bool


#: The unstage's interior window (``grad_x``, elements) up to which the box gather copies it, as one more box of its
#: launch, where it covers the block; larger windows are one strided ``copy_``.  The copy's own launch and views
#: cost host time that small steps show: with every launch stubbed (``scripts/host_cost.py --kernels``, one core of
#: a 2-core AMD EPYC) the window's copy and indexing took 4.5 of an unstage's 10.4 us, and the bench's fused halo
#: conv step lost to ``torch.cat``'s by its host time wherever the GPU's work was shorter (``halo_full``, H200,
#: 2026-11-28).  Beyond, the GPU's copy of the window dominates, and torch's strided copy is the measured one.
UNSTAGE_WINDOW_ELEMENTS = 2**22


@functools.lru_cache(maxsize=512)
def unstage_launch(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device, region: str,
                   block: int | None, trail: int = 1) -> UnstageLaunch:
    """The unstage of worker ``index`` for ``lead`` leading elements (``trail`` channels last, else 1), cached: a
    call is a cache lookup, not the plan geometry, box offsets and interior slices again (see the module
    docstring)."""
    staged = tuple(plan.staged_shape(index))
    x_shape = tuple(plan.input_shape(index))
    interior = interior_piece(plan, index)
    copy = interior is not None and math.prod(interior.shape) > 0
    partial = interior is None or tuple(interior.src_shape) != x_shape
    window = (region in ("all", "local") and copy and not partial
              and lead * math.prod(x_shape) * trail <= UNSTAGE_WINDOW_ELEMENTS)
    tables = unstage_box_tables(plan, index, lead, region, window)
    return UnstageLaunch(
        staged, x_shape, recv_numel(plan, index, lead * trail), self_numel(plan, index, lead * trail),
        box_launch(tables, lead, staged, device, block, trail),
        interior.src_index if copy and partial else None,
        interior.dst_index if copy and not window else None, partial, window)


class AccumulateLaunch(NamedTuple):
    """What :func:`~distfuse.kernels.halo.halo_accumulate` checks and launches for one ``(plan, index, LEAD,
    device, block)``.

    ``input_shape`` ``n`` is ``grad_x``'s spatial shape; ``self_numel`` and ``send_numel`` the sizes of the flat
    self boxes and of the incoming halo gradients (``plan.sends`` boxes).  ``args`` are the launch's arguments
    after the three buffers (program table, cell table, box list, box table, programs, cells, elements, E0, E1, E2),
    ``grid`` its grid (None: no box has an element, nothing to launch) and ``meta`` its dtype-free constexprs.

    On GPUs (:func:`per_box_programs`) each covered cell gets ``cdiv(NUMEL, BLOCK)`` programs of its own, laid end to
    end; the program table (int32, one entry a program) names each program's cell, and a cell row (int64, 17 wide)
    holds ``NUMEL`` (its elements: ``LEAD * W0 * W1 * W2 * trail``), ``O0 O1 O2 W0 W1 W2 LSTART LCOUNT``
    (:func:`~distfuse.kernels.halo_tables.accumulate_tables`), the :func:`~distfuse.kernels.halo_programs.
    magic_divisor` of W2, W1 and W0, its first program and its first vector in the cells laid end to end (``START``,
    what the interpreter's programs search instead).  A program then reads its cell with loads every thread shares,
    where the elements searched the cell table each (five dependent loads for a 3-D shell's 26 cells) and divided
    at run time (six integer divisions an element): on an H200 that took 155 us at [1, 256, 64^3] bf16, halo 1, for
    6.1M covered elements (2026-11-28, ``halo_full``).
    """

    input_shape: tuple[int, ...]
    self_numel: int
    send_numel: int
    grid: tuple[int, int] | None
    args: tuple
    meta: dict
    bound: dict  # grad_x's dtype -> its BoundLaunch (launch_cache), made at the first launch of that dtype


@functools.lru_cache(maxsize=512)
def accumulate_launch(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device,
                      block: int | None, trail: int = 1) -> AccumulateLaunch:
    """The accumulate of worker ``index`` for ``lead`` leading elements (``trail`` channels last, else 1), cached:
    a call is a cache lookup, not the plan geometry, the cells, buffer sizes and grid again (see the module
    docstring).  ``block``: elements a program (:func:`~distfuse.kernels.halo_programs.box_block` chooses by
    default)."""
    x_shape = tuple(plan.input_shape(index))
    n_self, n_send = self_numel(plan, index, lead * trail), send_numel(plan, index, lead * trail)
    cells, blist, btab = accumulate_tables(plan, index, lead, device)
    sizes = [lead * math.prod(cell[3:6]) * trail for cell in cells]
    total = sum(sizes)
    if total == 0:
        return AccumulateLaunch(x_shape, n_self, n_send, None, (), {}, {})
    block = box_block(device, block, total)
    wide = max(lead * math.prod(x_shape) * trail, n_self, n_send, total) + block >= WIDE_ELEMENTS
    per_box = per_box_programs(device)
    rows, pcell, start = [], [], 0
    for k, (cell, numel) in enumerate(zip(cells, sizes, strict=True)):  # each cell's programs, one after another
        w0, w1, w2 = cell[3:6]
        rows += [numel, *cell, *magic_divisor(w2), *magic_divisor(w1), *magic_divisor(w0), len(pcell), start]
        pcell += [k] * (cdiv(numel, block) if per_box else 0)
        start += numel // trail
    programs = len(pcell) if per_box else cdiv(total, block)
    return AccumulateLaunch(x_shape, n_self, n_send, linear_grid(programs),
                            (torch.tensor(pcell or [0], dtype=torch.int32, device=device),
                             torch.tensor(rows, dtype=torch.int64, device=device), blist, btab, programs, len(cells),
                             total, *pad3(x_shape, 1)),
                            dict(TRAIL=trail, LOG2_NCELL=(len(cells) - 1).bit_length(), WIDE=wide, BLOCK=block,
                                 PER_BOX=per_box, num_warps=BOX_NUM_WARPS), {})


def per_box_programs(device: torch.device) -> bool:
    """Whether the box gather and the accumulate give each box (cell) programs of their own: on GPUs, unless
    :data:`BOX_PROGRAMS` says otherwise (tests).  The interpreter pays per program and per operation, not per
    element: there one program searches every element's box, and programs per box took 4-20 times the time."""
    return (device.type == "cuda") if BOX_PROGRAMS is None else BOX_PROGRAMS


#: Programs per box in the box gather and the accumulate: None (on GPUs only), True or False (forced: tests).
BOX_PROGRAMS: bool | None = None


def launch_accumulate(grad_x: torch.Tensor, self_boxes: torch.Tensor, incoming: torch.Tensor,
                      launch: AccumulateLaunch) -> None:
    """The launch of ``launch`` (from :func:`accumulate_launch`), in place into ``grad_x``; an empty buffer is
    passed as ``grad_x`` (never dereferenced: no box reads it)."""
    if launch.grid is None:
        return
    bound = launch.bound.get(grad_x.dtype)
    if bound is None:  # the first launch of this dtype: bind the grid, the tables and the constexprs once
        bound = launch.bound[grad_x.dtype] = cached_launch(accumulate_kernel).bind(
            launch.grid, launch.args,
            dict(launch.meta, COMPUTE=compute_dtype(grad_x.dtype), ROUND_BF16=round_bf16(grad_x.dtype)))
    bound(grad_x, self_boxes if self_boxes.numel() else grad_x, incoming if incoming.numel() else grad_x)
