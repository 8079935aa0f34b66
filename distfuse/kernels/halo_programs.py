"""The Triton programs of the fused halo convolution and their launch geometry.

Four programs serve the four ops of :mod:`distfuse.kernels.halo`: the one-pass staging
(stage), a lookup-table gather (stage without an interior window), a box gather (pack, and
the send-back and self boxes of unstage) and a masked gather-add (accumulate); buffers and
tables are described there and in :mod:`distfuse.kernels.halo_tables`.  Design decisions:

* **Stage is one launch: a copy of the interior window, the table walk only outside it.**
  The staged box ``[LEAD, L0, L1, L2]`` is the Cartesian product of per-axis segments
  (``AxisGeometry.segments``): one int32 table per axis gives each staged coordinate its
  segment and its coordinate in the segment's source box (reversed for reflect, 0 for
  replicate), and a small piece table indexed by the segment combination gives the source
  (five table loads and a 64-bit offset per element).  The interior window (the block
  itself: 91% of the staged tensor for a 64^3 block at halo 1) needs none of that, so
  ``stage_kernel`` splits the staged tensor into boxes, each row-tiled ``[BLOCK_R rows,
  BLOCK_X]`` over ``[LEAD*E0*E1, width]``, one program per tile, in one grid:

  ===================================  ==================================================
  box                                  per element
  ===================================  ==================================================
  window ``[LEAD, I0, I1, I2]``        one load from ``x``, one store: no table load
  columns left/right of the window     one piece per column: five table loads per column,
  (in the window's rows)               done by the window's edge tiles
  slabs of whole rows (axes 0, 1), at  one piece per row: five table loads per row, then
  the window's columns (``SLAB_ROWS``) one load and one store, tiled like the window
  slabs beside the window's columns    the table walk, done by the slabs' edge tiles
  ===================================  ==================================================

  The slabs are 6.5% of the staged elements of a 64^3 block at halo 1 (0.4% of a 512^2
  one), and their walk per element (five dependent table loads each, in tiles a quarter
  as wide) is the likely reason 3-D staging took twice the copy's time on an H200 where
  2-D took 1.15 times.  ``SLAB_ROWS`` (chosen by :func:`stage_launch` on GPUs where the
  window's columns are one linear segment, offsets are int32 and the block's rows are vector
  aligned; else, and under the interpreter, the walk as before) has not run on a GPU yet;
  ``scripts/gpu_diagnose.py`` times the staging both ways and by region.

  No tile straddles the window's edge, so the copy never pays for the walk: with whole
  staged rows in a tile (L2 = 66 in one 128-wide tile) every tile holds halo columns, and a
  per-element "inside the window?" test would issue the walk's instructions everywhere.
  Rows are decomposed by multiply-shift (``magic_div``: a runtime int division is about
  twenty instructions, and Triton's layouts give each thread one element per row of a
  64-wide tile, so per-row work is per-element work) and offsets are linear in ``(r, r //
  E1, lead)``, int32 unless a buffer holds 2^31 elements: compiled for sm_90, the copy is
  26 SASS instructions per element at BLOCK_X 64 (44 with runtime divisions, 59 with 64-bit
  row offsets too).  It replaced a strided ``Tensor.copy_`` of the window plus one
  table-walk launch per shell box (up to six): on an H100, [1, 64, 64^3] bf16 at halo 1,
  52 us + 52 us of GPU time against 29 us for a contiguous copy of the staged bytes, and
  300-1000 us of host time for the seven launches (each slicing six tables) against 15-20
  us for the copy.  Everything but the launch is cached per ``(plan, index, LEAD, device,
  region, tile)`` (:func:`stage_launch`).  ``region="local"`` (pieces that need no message)
  masks the received pieces out of the same launch; ``"remote"`` (the received ones) skips
  the window's copy, so it touches only the border (0.8% of a 512^2 block's staged tensor
  at halo 1), for the overlap.  A worker without an interior window walks the tables
  everywhere (``lut_gather_kernel``).  (The unstage's ``grad_x`` is still a strided
  ``copy_`` of the window.)
* **A window program loads nothing before its copy, and the window's programs launch apart on GPUs.**  The
  one-pass NCHW staging of a 3-D block took 1.75 times the copy's time on an H200 (123-126 against 70 us at
  [1, 256, 64^3] bf16, halo 1) where 2-D took 1.16 times ([1, 256, 512^2]); in 3-D every window tile writes the
  columns beside the window, in 2-D two tiles in nine.  Read off the SASS (sm_90, Triton 3.6, no GPU needed), a
  3-D window program waited on seven rounds of dependent loads: the box starts, the box's row, the block, then
  for its strips the box's row again (after the window's stores, which the compiler may not reorder past), the
  segment table, the piece table and the values.  Now the window's row is in the kernel's ``W_*`` arguments (a
  window program knows it is one from its id: the window's programs come first), and each column beside the
  window has its piece and offset coefficients in one row of the strip table (:func:`strip_table`): the block
  and the strip table, then the strips' values.  And a kernel's registers are its hungriest path's: the window's
  copy with its strips compiles to 48 registers a thread (32 at 512-wide tiles), the slabs' rows to 80 (90),
  one kernel of both to 96, five programs of 4 warps an SM where the window alone allows ten.  So on GPUs the
  window's programs and the slabs' are two launches of one kernel (``PART`` 1 and 2, :data:`STAGE_SPLIT`) where
  the staging copies the window and stages 2^24 elements or more (below, the second launch's host time would
  outweigh it); the slabs' launch keeps the window's branch compiled in, never taken, because unaligned slab rows
  take 255 registers without the window's load layout to share (see the next point).  Unmeasured on a GPU:
  ``scripts/gpu_diagnose.py`` times the staging split and not (``halo_tiles``, rows ``split=``).
* **Or the window's rows as flat words, then the strips and the slabs** (:mod:`~distfuse.kernels.halo_stage_words`,
  ``PART`` 3; NCHW, off by default until a GPU measures it): one 16-byte store a thread per four words of the
  staged tensor, where the odd rows of odd halos leave this kernel one-element stores whose layout recomputes the
  row at every store.
* **The overlap's two passes launch only what they write, with the registers of the one pass.**
  The layers stage in two passes on GPUs (local, then remote once the halos came). On an
  H200 (2026-11-28, bf16) they cost more than the one pass together and each on its own:
  [1, 256, 512^2] NCHW local 99 us + remote 29 against 78 for all, [1, 256, 64^3] 142 + 112
  against 126.  Two causes, read off the compile audit (Triton 3.6, sm_90) and the launch
  geometry.  With the slabs one piece per row and unaligned slab rows (NCHW rows of odd
  halos), a pass without the window's copy or with its region mask held 113-255 registers a
  thread (spilling at 64 columns) against 64-80 for the walk per element: the slab loads,
  without the window's vector layout to share, hold one 64-bit pointer per element.  So
  :func:`choose_slab_rows` keeps that form for aligned slab rows and the one pass only.  And
  the remote pass ran every window tile for its two strip columns (16 384 programs of 128
  strip elements at [1, 256, 64^3], as many of 16 at [1, 256, 512^2], each behind two
  dependent table loads).  It now tiles the strips by ``STRIP_R`` rows (:data:`STAGE_STRIP_ELEMENTS`
  elements a program: 4 096 programs there, 512 at 512^2), and neither pass launches a slab
  none of whose pieces it writes, nor walks strips it does not write (the box table's
  ``STRIPS``): a middle worker's local pass is then the window's copy alone.  Unmeasured
  on a GPU; ``scripts/gpu_diagnose.py`` (``halo_tiles``) times both passes and the window's
  copy alone (``region=window``).
* **The window moves in 16-byte vectors where its rows are aligned.**  Its row starts and
  width come from the box table, so the compiler could prove no alignment: on an H200 the
  first one-launch staging moved every element with its own load and store (PTX
  ``ld/st.global.b16``), held 80-159 registers a thread, and took 173 us against 70 us for
  a copy of the same bytes ([1, 256, 64^3] bf16, halo 1).  :func:`stage_launch` now computes
  the largest power of two dividing every row start and the width (:func:`pow2_divisor`),
  in the block (``X_ALIGN``) and in the staged tensor (``OUT_ALIGN``), and the kernel
  promises them by rounding (``(v // A) * A``, exact for the multiples it computed: a
  ``tl.multiple_of`` on the table's width marked the shared SSA value, so the slabs' masks
  were taken as constant over 16 columns and read past their tables, an illegal address
  on the H200).  The block's rows load as ``ld.global.v4`` and the registers halve (80 to
  44 at 4096-element tiles, 8 warps), so more bytes are in flight per SM.  Measured on the
  H200 at 4096-element tiles, 4 warps, kernel time: [1, 256, 512^2] bf16 96 -> 78 us (copy
  67 us), [1, 64, 512^2] 28 -> 23 us (copy 20 us), [1, 256, 64^3] 201 -> 147 us (copy 70
  us).  Staged rows of odd halos (``L2 = n + 2h``) start at odd offsets, so their stores
  stay one element per instruction (coalesced, 64 bytes a warp); with 64-wide rows the 3-D
  staging stays at twice the copy's time (every tile also writes the columns beside the
  window through the tables).  Channels last removes the cause: the same kernel over rows of
  ``L2 * C`` elements (the last axis merged with the channels, its tables too) starts every
  row at a multiple of C, so the window is ``ld/st.global.v4`` on both sides at any halo
  width (``trail`` in :func:`stage_launch`), and so are the slabs' rows (``SLAB_ALIGN``) and
  the columns beside the window, taken a spatial column's channels at a time
  (``STRIP_ALIGN``: one piece lookup a chunk, not a column).
* **Pack and the unstage boxes are one box gather; on GPUs each box has programs of its own**
  (``PER_BOX``).  A program table names each program's box, so a program reads the box's row
  with loads every thread shares, and an element's box coordinates come by multiply-shift
  divisions (the box's divisors are in its row).  The interpreter keeps the first form, the
  boxes laid end to end under shared programs, where each element searches the box starts (a
  chain of dependent loads), loads fourteen table entries and divides six times at run time:
  it pays per program and per operation, not per element, and one program for the whole
  launch is its cheapest (programs per box took it 4-20 times as long).  Compiled for sm_90
  (bf16, Triton 3.6) the first form was 1096 SASS instructions and 64 registers a thread, the
  GPUs' 360 and 40, and on an H200 the unstage's gather of a [1, 256, 64^3] block's halo took
  72 us (2026-11-28, ``halo_full``).  A box's last program idles past its end: a few hundred
  lanes per box, against millions of elements.  The accumulate's cells go the same two ways.
* **Replicate sums are a gather, not atomics.**  A send-back box element is the sum of
  the staged gradient over the replicated run (a loop of ``R`` loads in fp32), so every
  output element is written by exactly one program: deterministic, no fp32 atomics
  (unsupported for bf16 in the interpreter, and order-dependent on GPUs).
* **Accumulate visits the covered cells only.**  Boxes that add into ``grad_x`` (self
  pieces and received halo gradients) may overlap (replicate, circular on one worker,
  halos wider than a block).  Every box edge cuts its axis; each cell of the product of
  the cuts lies inside or outside each box, so it has a fixed list of boxes
  (:func:`~distfuse.kernels.halo_tables.accumulate_cells`).  One launch runs over the
  covered cells, on GPUs each with programs of its own (a table names each program's cell, so
  the cell's extents, its multiply-shift divisors and its boxes are loads every thread of a
  program shares; an element searched the cells and divided at run time before, as it still
  does under the interpreter: 155 us on an H200 for a 64^3 block's 6.1M covered elements,
  C = 256), and adds each cell's boxes in table order, in fp32, rounding once.  The
  interior, which no box covers, is neither read nor written: a [1, 256, 64^3] block at
  halo 1 has 6.1M covered elements of 67M.  The earlier form tiled the whole block with
  per-axis int64 cover bitmasks; every 64-wide tile of a 3-D block touches the two
  x-faces, so it read, tested and wrote every element (and took one more launch and one
  more rounding per 62 boxes).
* **Offsets are int32** in the box gather and the accumulate unless a buffer holds
  2^31 elements or more (``WIDE``): their div/mod run per element, and the int64 form of
  the box gather held 186 registers a thread at sm_90 (62-64 in int32).
* **Arithmetic in fp32** (fp64 for fp64 tensors): the interpreter computes bf16
  arithmetic wrongly.  Copies are exact in every dtype.  Unstage writes ``grad_x`` in the
  gradient's own dtype (the interior is a copy) and accumulate rounds once per border
  element, so no fp32 copy of the whole block is ever made.
* **No runtime ``range`` bounds.**  Loops over a runtime count (replicate runs, boxes of
  a tile) are ``while`` loops: Triton 3.6's interpreter converts a runtime ``range``
  bound with ``int()`` of a shape-(1,) array, which numpy 2 rejects.  Neither loop is a
  pipelined GEMM loop, so compiled code loses nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels import halo_stage_words as _words
from distfuse.kernels.halo_tables import (
    contiguous_strides,
    interior_piece,
    merged_shape,
    pad3,
    recv_numel,
    stage_table_lists,
    table_tensors,
)
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import cast_out, magic_div
from distfuse.kernels.launch_cache import cached_launch
from distfuse.kernels.tile_table import device_name, measured_tile

__all__ = ["piece_value", "lut_gather_kernel", "stage_kernel", "box_gather_kernel", "accumulate_kernel",
           "StageLaunch", "stage_launch", "launch_stage", "stage_tile", "strip_table", "magic_divisor", "shell",
           "compute_dtype", "pick_tile", "row_tiled_grid", "linear_grid", "box_block", "REGION_CODE", "STAGE_BOXES",
           "STAGE_WIDTHS", "STAGE_TILE_ELEMENTS", "STAGE_NUM_WARPS", "STAGE_SPLIT", "STAGE_SPLIT_ELEMENTS",
           "STAGE_SLAB_SPLIT", "WIDE_ELEMENTS", "STAGE_TILE_KEYS", "measured_stage", "stage_config",
           "stage_key"]

#: The staging kernels' REGION codes.  ``"window"`` (3) is a diagnosis, not a region of
#: :func:`~distfuse.kernels.halo.halo_stage`: the interior window's copy alone (no column beside it, no slab), which
#: ``scripts/gpu_diagnose.py`` times against ``"local"`` and ``"remote"`` to tell the copy's cost from the border's.
REGION_CODE = {"all": 0, "local": 1, "remote": 2, "window": 3}


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _row_tile(n_rows, E0, E1, E2, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """This program's ``[BLOCK_R, BLOCK_X]`` tile of a row-tiled launch over ``[n_rows, E2]`` (grid from
    :func:`row_tiled_grid`): ``(rows, cols, rmask, cmask, e0, e1, lead)``, each row decomposed once into
    ``(lead, e0, e1)`` of ``[LEAD, E0, E1]``.

    Programs are numbered linearly over grid axis 0 (up to 2^31 - 1) and, past that,
    axis 1; column tiles vary fastest, so neighbouring programs sweep one band of rows
    left to right.  Ids past the last tile (the rounding of a spilled grid) give a row
    tile past ``n_rows``, which every mask rejects.  Row and column tile indices fit
    int32 (n_rows and the inner extent do), so the per-row arithmetic stays int32.
    """
    n_x_tiles = tl.cdiv(E2, BLOCK_X)
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    pid_r, pid_x = (pid // n_x_tiles).to(tl.int32), (pid % n_x_tiles).to(tl.int32)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    rmask = rows < n_rows
    cmask = cols < E2
    e1 = rows % E1
    q = rows // E1
    return rows, cols, rmask, cmask, q % E0, e1, (q // E0).to(tl.int64)


@triton.jit
def piece_value(a_ptr, b_ptr, ptab_ptr, prow, lead, c0, c1, c2, mask, COMPUTE: tl.constexpr):
    """``(kind, value in COMPUTE)`` of staged elements through the piece table (rows at ``prow``, see
    :mod:`~distfuse.kernels.halo_tables`): ``source[lead, c0, c1, c2]`` of piece kind 0 (zero fill), 1 (``a_ptr``)
    or 2 (``b_ptr``).  Every argument but the pointers broadcasts to ``mask``'s shape."""
    kind = tl.load(ptab_ptr + prow, mask=mask, other=0)
    base = tl.load(ptab_ptr + prow + 1, mask=mask, other=0)
    lstr = tl.load(ptab_ptr + prow + 2, mask=mask, other=0)
    st0 = tl.load(ptab_ptr + prow + 3, mask=mask, other=0)
    st1 = tl.load(ptab_ptr + prow + 4, mask=mask, other=0)
    off = base + lead * lstr + c0 * st0 + c1 * st1 + c2
    va = tl.load(a_ptr + off, mask=mask & (kind == 1), other=0.0).to(COMPUTE)
    vb = tl.load(b_ptr + off, mask=mask & (kind == 2), other=0.0).to(COMPUTE)
    return kind, tl.where(kind == 2, vb, va)  # kind 0: va is the masked-load fill 0


@triton.jit
def _lut_tile(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr, NS1, NS2,
              e0, e1, lead, rmask, e2, cmask, out_row, REGION: tl.constexpr, COMPUTE: tl.constexpr):
    """The table walk of one ``[rows, cols]`` tile: ``out[out_row + e2]`` = the staged element ``(lead, e0, e1, e2)``.

    ``e0, e1, lead, rmask, out_row`` are per row, ``e2, cmask`` per column (indices into the LUTs).  Piece kinds:
    0 zero, 1 ``a_ptr``, 2 ``b_ptr``; REGION 1 writes kinds 0 and 1 only, REGION 2 kind 2 only, 0 everything.
    """
    s0 = tl.load(seg0_ptr + e0, mask=rmask, other=0)
    c0 = tl.load(crd0_ptr + e0, mask=rmask, other=0).to(tl.int64)
    s1 = tl.load(seg1_ptr + e1, mask=rmask, other=0)
    c1 = tl.load(crd1_ptr + e1, mask=rmask, other=0).to(tl.int64)
    s2 = tl.load(seg2_ptr + e2, mask=cmask, other=0)
    c2 = tl.load(crd2_ptr + e2, mask=cmask, other=0).to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    prow = ((s0 * NS1 + s1)[:, None] * NS2 + s2[None, :]) * 5
    kind, val = piece_value(a_ptr, b_ptr, ptab_ptr, prow, lead[:, None], c0[:, None], c1[:, None], c2[None, :], mask,
                            COMPUTE)
    if REGION == 1:
        mask = mask & (kind != 2)
    if REGION == 2:
        mask = mask & (kind == 2)
    tl.store(out_ptr + (out_row[:, None] + e2[None, :]), val.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lut_gather_kernel(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                       n_rows, E0, E1, E2, NS1, NS2, out_ls, out_s0, out_s1,
                       REGION: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """out[l, e0, e1, e2] = source(piece(seg0[e0], seg1[e1], seg2[e2]))[l, crd0[e0], crd1[e1], crd2[e2]].

    The whole staged tensor ``[LEAD, E0, E1, E2]`` (strides ``out_ls``, ``out_s0``, ``out_s1``, 1) by the table
    walk: the staging of a worker without an interior window (see :func:`stage_launch`).  Tiles
    ``[BLOCK_R, BLOCK_X]`` over ``[n_rows, E2]``, one per program; REGION as in :func:`_lut_tile`.
    """
    rows, cols, rmask, cmask, e0, e1, lead = _row_tile(n_rows, E0, E1, E2, BLOCK_R, BLOCK_X)
    out_row = lead * out_ls + e0.to(tl.int64) * out_s0 + e1.to(tl.int64) * out_s1
    _lut_tile(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr, NS1, NS2,
              e0, e1, lead, rmask, cols, cmask, out_row, REGION, COMPUTE)


@triton.jit
def _rows(pid_r, n_rows, m1, k1, m0, k0, obase, ob, oc, out_s1, BLOCK_R: tl.constexpr, IDX: tl.constexpr):
    """Row tile ``pid_r`` (``BLOCK_R`` rows) of a box of ``n_rows`` rows ``[LEAD, E0, E1]``: ``(rmask, r, q, lead,
    out_row)``, with ``(m1, k1)``, ``(m0, k0)`` the :func:`magic_divisor` of E1 and E0.

    Row ``r`` of ``[LEAD, E0, E1]`` is ``(lead, b0, b1)`` with ``q = r // E1 = lead * E0 + b0``; the divisions are
    multiply-shifts and the staged row offset is linear in ``(r, q, lead)``:
    ``OBASE + r * out_s1 + q * OB + lead * OC`` (``OB``, ``OC`` the rows and planes the box skips), so no row needs
    ``b0``, ``b1`` or a 64-bit multiply unless IDX is int64.  Row indices fit int32, as in :func:`_row_tile`.
    """
    r32 = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r32 < n_rows.to(tl.int32)
    q32 = magic_div(r32, m1, k1)
    lead32 = magic_div(q32, m0, k0)
    r, q, lead = r32.to(IDX), q32.to(IDX), lead32.to(IDX)
    out_row = obase.to(IDX) + r * out_s1 + q * ob.to(IDX) + lead * oc.to(IDX)
    return rmask, r, q, lead, out_row


@triton.jit
def _box_rows(box, pid_r, out_s1, BLOCK_R: tl.constexpr, IDX: tl.constexpr):
    """:func:`_rows` of the box at table row ``box`` (a slab: see :func:`stage_launch` for the columns)."""
    return _rows(pid_r, tl.load(box + 2), tl.load(box + 5), tl.load(box + 6), tl.load(box + 8), tl.load(box + 9),
                 tl.load(box + 10), tl.load(box + 11), tl.load(box + 12), out_s1, BLOCK_R, IDX)


@triton.jit
def _stage_beside_chunks(out_ptr, a_ptr, b_ptr, stab_ptr, n_left, n, lo2, rhi, rmask, r, q, lead, out_row,
                         REGION: tl.constexpr, IDX: tl.constexpr, STRIP_X: tl.constexpr, STRIP_ALIGN: tl.constexpr):
    """:func:`_stage_beside` in channels last: chunks of STRIP_X channels of one spatial column (see there)."""
    t = tl.arange(0, STRIP_X)
    c = tl.full([], 0, tl.int32)  # typed: a loop-carried counter must keep one type when compiled
    while c < n:
        col0 = tl.where(c < n_left, c, rhi + c - n_left)
        srow = stab_ptr + tl.where(c < n_left, c, lo2 + c - n_left) * 5  # the chunk's first column's strip row
        kind0 = tl.load(srow)
        src_row = (tl.load(srow + 1).to(IDX) + r * tl.load(srow + 2).to(IDX) + q * tl.load(srow + 3).to(IDX)
                   + lead * tl.load(srow + 4).to(IDX))
        src_row = (src_row // STRIP_ALIGN) * STRIP_ALIGN
        o_row = ((out_row + col0) // STRIP_ALIGN) * STRIP_ALIGN
        kind = tl.where(rmask, kind0, 0)  # per row: the interpreter masks with tensors only
        keep = rmask
        if REGION == 1:
            keep = keep & (kind != 2)
        if REGION == 2:
            keep = keep & (kind == 2)
        mask0 = keep[:, None] & (t[None, :] < STRIP_X)  # always true: the row mask broadcast over the chunk
        src = tl.where(kind == 2, b_ptr + src_row, a_ptr + src_row)  # kind 0 (zero fill) reads nothing
        v = tl.load(src[:, None] + t[None, :], mask=mask0 & (kind != 0)[:, None], other=0.0)
        tl.store(out_ptr + (o_row[:, None] + t[None, :]), v, mask=mask0)
        c += STRIP_X


@triton.jit
def _stage_beside(out_ptr, a_ptr, b_ptr, stab_ptr, lo2, rhi, n_left, n_right, rmask, r, q, lead, out_row,
                  REGION: tl.constexpr, IDX: tl.constexpr, STRIP_X: tl.constexpr, STRIP_ALIGN: tl.constexpr):
    """The window's rows (``out_row`` their staged offsets) at the ``n_left`` staged columns left of the window and
    the ``n_right`` ones from ``rhi`` (the window's columns are ``[lo2, rhi)``), ``[rows, STRIP_X]`` at a time.
    Each column is one piece, read at ``(b0, b1, crd2[col])`` of its source box: an offset linear in ``(r, q,
    lead)`` like the row's.  The strip table (:func:`strip_table`, one row of five per column beside the window:
    ``lo2`` left ones, then the right ones) holds each column's piece kind and the coefficients of that offset, so
    a column costs five independent loads of one row, where the tables took two dependent rounds (the segment,
    then the piece row): in a 3-D block every window tile writes its strips, and its program's chain of dependent
    loads is what the SM waits on.

    ``STRIP_ALIGN`` > 0 (channels last, STRIP_X dividing the channels): a chunk is STRIP_X channels of one spatial
    column, so one piece and a source offset linear in the chunk's columns: the table loads are per chunk, and
    each row moves like the window's (its source and staged offsets multiples of STRIP_ALIGN, computed by
    :func:`stage_launch`)."""
    lo2 = lo2.to(tl.int32)
    rhi = rhi.to(tl.int32)
    n = n_left + n_right
    if STRIP_ALIGN > 0:
        _stage_beside_chunks(out_ptr, a_ptr, b_ptr, stab_ptr, n_left, n, lo2, rhi, rmask, r, q, lead, out_row,
                             REGION, IDX, STRIP_X, STRIP_ALIGN)
    else:
        c = tl.full([], 0, tl.int32)  # typed: a loop-carried counter must keep one type when compiled
        while c < n:
            j = c + tl.arange(0, STRIP_X)
            cmask = j < n
            col = tl.where(j < n_left, j, rhi + j - n_left)
            srow = stab_ptr + tl.where(j < n_left, j, lo2 + j - n_left) * 5
            kind = tl.load(srow, mask=cmask, other=0)
            off = (tl.load(srow + 1, mask=cmask, other=0).to(IDX)[None, :]
                   + r[:, None] * tl.load(srow + 2, mask=cmask, other=0).to(IDX)[None, :]
                   + q[:, None] * tl.load(srow + 3, mask=cmask, other=0).to(IDX)[None, :]
                   + lead[:, None] * tl.load(srow + 4, mask=cmask, other=0).to(IDX)[None, :])
            if REGION == 1:
                cmask = cmask & (kind != 2)
            if REGION == 2:
                cmask = cmask & (kind == 2)
            mask = rmask[:, None] & cmask[None, :]
            va = tl.load(a_ptr + off, mask=mask & (kind == 1)[None, :], other=0.0)
            vb = tl.load(b_ptr + off, mask=mask & (kind == 2)[None, :], other=0.0)  # kind 0: va is the fill 0
            tl.store(out_ptr + (out_row[:, None] + col[None, :]), tl.where((kind == 2)[None, :], vb, va),
                     mask=mask)
            c += STRIP_X


@triton.jit
def _slab_row_pieces(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, ptab_ptr, NS1, NS2, box, e0, e1,
                     lead, rmask, w_lo, t, tmask, out_row, REGION: tl.constexpr, IDX: tl.constexpr,
                     ALIGN: tl.constexpr):
    """A slab's rows at the window's columns ``w_lo + t``: one piece per row, ``(seg0[e0], seg1[e1], S2W)``, whose
    source offset is linear in the column (``crd2 = col + C2BASE`` there: :func:`stage_launch` checked it), so
    the five piece-table loads are per row, not per element, and the columns move like the window's copy: one
    load per element from the row's source (the block or the receive buffer, picked per row), offsets in IDX.
    ``ALIGN``: every row's source and staged offset at ``w_lo`` is a multiple of it (:func:`stage_launch`
    computed it, 16 in channels last with 16 channels or more), promised by rounding as the window's are, so
    the rows move in vectors."""
    s0 = tl.load(seg0_ptr + e0, mask=rmask, other=0)
    c0 = tl.load(crd0_ptr + e0, mask=rmask, other=0).to(tl.int64)
    s1 = tl.load(seg1_ptr + e1, mask=rmask, other=0)
    c1 = tl.load(crd1_ptr + e1, mask=rmask, other=0).to(tl.int64)
    prow = ((s0 * NS1 + s1) * NS2 + tl.load(box + 19).to(tl.int32)) * 5
    kind = tl.load(ptab_ptr + prow, mask=rmask, other=0)
    off0 = (tl.load(ptab_ptr + prow + 1, mask=rmask, other=0) + lead * tl.load(ptab_ptr + prow + 2, mask=rmask,
                                                                              other=0)
            + c0 * tl.load(ptab_ptr + prow + 3, mask=rmask, other=0) + c1 * tl.load(ptab_ptr + prow + 4, mask=rmask,
                                                                                  other=0)
            + tl.load(box + 21))
    if REGION == 1:
        rmask = rmask & (kind != 2)
    if REGION == 2:
        rmask = rmask & (kind == 2)
    off0 = ((off0.to(IDX) + w_lo) // ALIGN) * ALIGN
    o_row = ((out_row + w_lo) // ALIGN) * ALIGN
    src = tl.where(kind == 2, b_ptr + off0, a_ptr + off0)  # per row; kind 0 (zero fill) reads nothing
    mask = rmask[:, None] & tmask[None, :]
    v = tl.load(src[:, None] + t[None, :], mask=mask & (kind != 0)[:, None], other=0.0)
    tl.store(out_ptr + (o_row[:, None] + t[None, :]), v, mask=mask)


@triton.jit
def _stage_slab(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr, NS1, NS2,
                box, pid_r, pid_x, nx, width, out_s1, REGION: tl.constexpr, IDX: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr, SLAB_X: tl.constexpr, STRIP_X: tl.constexpr,
                SLAB_ROWS: tl.constexpr, SLAB_ALIGN: tl.constexpr):
    """Tile ``(pid_r, pid_x)`` of the slab at table row ``box`` (:func:`stage_kernel`'s boxes 1..): whole staged rows
    outside the window, by :func:`_slab_row_pieces` and the table walk (``SLAB_ROWS``) or by the walk alone."""
    s_rmask, s_r, s_q, s_lead, s_out_row = _box_rows(box, pid_r, out_s1, BLOCK_R, IDX)
    s_e1 = (s_r - s_q * tl.load(box + 4).to(IDX)).to(tl.int32) + tl.load(box + 14).to(tl.int32)
    s_e0 = (s_q - s_lead * tl.load(box + 7).to(IDX)).to(tl.int32) + tl.load(box + 13).to(tl.int32)
    if SLAB_ROWS:  # tiled like the window (LO2 and RHI: the window's columns)
        w_lo = tl.load(box + 15).to(tl.int32)
        w_hi = tl.load(box + 20).to(tl.int32)
        s_t = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
        _slab_row_pieces(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, ptab_ptr, NS1, NS2, box,
                         s_e0, s_e1, s_lead.to(tl.int64), s_rmask, w_lo.to(IDX),
                         s_t, s_t < ((w_hi - w_lo) // SLAB_ALIGN) * SLAB_ALIGN, s_out_row, REGION, IDX,
                         SLAB_ALIGN)
        s_left = tl.where(pid_x == 0, w_lo, 0)
        s_n = s_left + tl.where(pid_x == nx - 1, out_s1 - w_hi, 0)
        c = tl.full([], 0, tl.int32)  # typed: a loop-carried counter must keep one type when compiled
        while c < s_n:  # the columns beside the window, by the table walk
            s_j = c + tl.arange(0, STRIP_X)
            _lut_tile(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr,
                      ptab_ptr, NS1, NS2, s_e0, s_e1, s_lead.to(tl.int64), s_rmask,
                      tl.where(s_j < s_left, s_j, w_hi + s_j - s_left), s_j < s_n, s_out_row, REGION,
                      out_ptr.dtype.element_ty)
            c += STRIP_X
    else:
        s_cols = pid_x * SLAB_X + tl.arange(0, SLAB_X)
        # values stay in the tensor's dtype: no conversion, so even the interpreter keeps bf16 subnormals
        _lut_tile(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                  NS1, NS2, s_e0, s_e1, s_lead.to(tl.int64), s_rmask, s_cols, s_cols < width, s_out_row, REGION,
                  out_ptr.dtype.element_ty)


@triton.jit
def _stage_strips(out_ptr, a_ptr, b_ptr, stab_ptr, pid_r, out_s1, W_ROWS, W_M1, W_K1, W_M0, W_K0, W_OBASE, W_OB,
                  W_OC, W_LO2, W_RHI, REGION: tl.constexpr, IDX: tl.constexpr, STRIP_X: tl.constexpr,
                  STRIP_ALIGN: tl.constexpr, STRIP_R: tl.constexpr):
    """The window's strips alone (the region's pieces of the columns beside it), rows ``[pid_r * STRIP_R, (pid_r + 1)
    * STRIP_R)`` of the window box: the remote pass's window programs, and ``PART`` 3's first ones."""
    rmask, r, q, lead, out_row = _rows(pid_r, W_ROWS, W_M1, W_K1, W_M0, W_K0, W_OBASE, W_OB, W_OC, out_s1, STRIP_R,
                                       IDX)
    _stage_beside(out_ptr, a_ptr, b_ptr, stab_ptr, W_LO2, W_RHI, W_LO2.to(tl.int32), out_s1 - W_RHI.to(tl.int32),
                  rmask, r, q, lead, out_row, REGION, IDX, STRIP_X, STRIP_ALIGN)


@triton.jit
def _stage_window(out_ptr, a_ptr, b_ptr, stab_ptr, pid, out_s1, x_s1, W_NX, W_ROWS, W_WIDTH, W_M1, W_K1, W_M0, W_K0,
                  W_OBASE, W_OB, W_OC, W_LO2, W_RHI, W_XBASE, W_XB, W_XC, W_STRIPS, REGION: tl.constexpr,
                  IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr, STRIP_X: tl.constexpr,
                  X_ALIGN: tl.constexpr, OUT_ALIGN: tl.constexpr, STRIP_ALIGN: tl.constexpr, STRIP_R: tl.constexpr):
    """Window program ``pid`` of :func:`stage_kernel` (box 0, its geometry in the ``W_*`` arguments: see there)."""
    pid_r = (pid // W_NX).to(tl.int32)
    pid_x = (pid - pid_r * W_NX).to(tl.int32)
    if REGION == 2:  # the remote pass: the window's strips alone, STRIP_R rows a tile (NX 1)
        _stage_strips(out_ptr, a_ptr, b_ptr, stab_ptr, pid_r, out_s1, W_ROWS, W_M1, W_K1, W_M0, W_K0, W_OBASE, W_OB,
                      W_OC, W_LO2, W_RHI, REGION, IDX, STRIP_X, STRIP_ALIGN, STRIP_R)
    else:
        cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
        # (v // A) * A == v for the multiples of A that stage_launch promises; the product's divisibility is
        # what the compiler sees (tl.multiple_of would mark the shared SSA value, the slabs' width included)
        cmask = cols < (W_WIDTH.to(tl.int32) // X_ALIGN) * X_ALIGN  # constant over a vector of the window's row
        rmask, r, q, lead, out_row = _rows(pid_r, W_ROWS, W_M1, W_K1, W_M0, W_K0, W_OBASE, W_OB, W_OC, out_s1,
                                           BLOCK_R, IDX)
        x_row = W_XBASE.to(IDX) + r * x_s1 + q * W_XB.to(IDX) + lead * W_XC.to(IDX)
        x_row = (x_row // X_ALIGN) * X_ALIGN
        o_row = ((out_row + W_LO2.to(IDX)) // OUT_ALIGN) * OUT_ALIGN
        mask = rmask[:, None] & cmask[None, :]
        v = tl.load(a_ptr + (x_row[:, None] + cols[None, :]), mask=mask)
        tl.store(out_ptr + (o_row[:, None] + cols[None, :]), v, mask=mask)
        # W_STRIPS: the region writes some strip (a middle worker's local pass has none); REGION 3 (a
        # diagnosis): the window's copy alone, compiled without the strips' code (its registers are the copy's)
        if REGION != 3:
            n_left = tl.where(pid_x == 0, W_LO2.to(tl.int32), 0)
            n_right = tl.where(pid_x == W_NX - 1, out_s1 - W_RHI.to(tl.int32), 0)
            if (n_left + n_right > 0) & (W_STRIPS != 0):
                _stage_beside(out_ptr, a_ptr, b_ptr, stab_ptr, W_LO2, W_RHI, n_left, n_right, rmask, r, q, lead,
                              out_row, REGION, IDX, STRIP_X, STRIP_ALIGN)


@triton.jit
def _stage_slab_program(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                        btab_ptr, NS1, NS2, pid, out_s1, REGION: tl.constexpr, IDX: tl.constexpr,
                        NUM_BOX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr, SLAB_X: tl.constexpr,
                        STRIP_X: tl.constexpr, SLAB_ROWS: tl.constexpr, SLAB_ALIGN: tl.constexpr):
    """Slab program ``pid`` of :func:`stage_kernel` (``pid`` at or past box 1's START): the box is the last one
    starting at or before it (unused rows start at 2^62), a slab spanning every column."""
    k = tl.full([], 1, tl.int32)
    for j in tl.static_range(2, NUM_BOX):
        k += (tl.load(btab_ptr + j * 24) <= pid).to(tl.int32)
    box = btab_ptr + k * 24
    t = pid - tl.load(box)
    nx = tl.load(box + 1)
    pid_r = (t // nx).to(tl.int32)
    pid_x = (t - pid_r * nx).to(tl.int32)
    _stage_slab(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr, NS1,
                NS2, box, pid_r, pid_x, nx, tl.load(box + 3).to(tl.int32), out_s1, REGION, IDX, BLOCK_R, BLOCK_X,
                SLAB_X, STRIP_X, SLAB_ROWS, SLAB_ALIGN)


# The window's geometry (stage_kernel's W_* arguments) is never specialised: Triton makes an integer argument equal to
# 1 a plain constant, which has no .to, and divisibility hints buy nothing there (the kernel promises its alignments)
_WINDOW_ARGS = ["W_TILES", "W_NX", "W_ROWS", "W_WIDTH", "W_M1", "W_K1", "W_M0", "W_K0", "W_OBASE", "W_OB", "W_OC",
                "W_LO2", "W_RHI", "W_XBASE", "W_XB", "W_XC", "W_STRIPS"]


@triton.jit(do_not_specialize=_WINDOW_ARGS)
def stage_kernel(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                 btab_ptr, stab_ptr, NS1, NS2, out_s1, x_s1,
                 W_TILES, W_NX, W_ROWS, W_WIDTH, W_M1, W_K1, W_M0, W_K0, W_OBASE, W_OB, W_OC, W_LO2, W_RHI, W_XBASE,
                 W_XB, W_XC, W_STRIPS,
                 REGION: tl.constexpr, WIDE: tl.constexpr, NUM_BOX: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr, SLAB_X: tl.constexpr, STRIP_X: tl.constexpr,
                 X_ALIGN: tl.constexpr, OUT_ALIGN: tl.constexpr, SLAB_ROWS: tl.constexpr,
                 SLAB_ALIGN: tl.constexpr = 1, STRIP_ALIGN: tl.constexpr = 0, STRIP_R: tl.constexpr = 0,
                 PART: tl.constexpr = 0):
    """The whole staged tensor ``out [LEAD, E0, E1, E2]`` (row length ``out_s1`` = E2) in one launch (``PART`` 0),
    or its window's programs (1) and its slabs' (2, numbered from ``W_TILES``) in two, or, after the words form
    (:mod:`~distfuse.kernels.halo_stage_words`) wrote the window's rows, the window's strips in ``STRIP_R``-row
    programs and then the slabs (3).

    Box 0 of the box table is the interior window ``[LEAD, I0, I1, I2]`` at staged ``(LO0, LO1, LO2)``, its row also
    in the ``W_*`` arguments (``W_TILES`` its programs, the first ones; then the table row's NX, NROWS, WIDTH, M1,
    K1, M0, K0, OBASE, OB, OC, LO2, RHI, XBASE, XB, XC, STRIPS), so its programs load no table: a plain copy
    from ``a_ptr`` (the block, row length ``x_s1``), no table load, in ``[BLOCK_R, BLOCK_X]`` tiles; its first and
    last column tiles also write the columns left and right of the window in their rows (:func:`_stage_beside`,
    ``[BLOCK_R, STRIP_X]`` at a time, each column's piece from the strip table ``stab_ptr``, :func:`strip_table`)
    where the box table's column 22 says the region has some, before the window's store.  REGION 2 (the
    remote pass) tiles box 0 by ``STRIP_R`` rows and writes those columns alone.  Boxes 1.. are the slabs of whole
    rows outside the window (axes 0 and 1), walked through the tables (:func:`_lut_tile`) in ``[BLOCK_R, SLAB_X]``
    tiles.  Each box is row-tiled like :func:`_row_tile` over ``[LEAD*E0*E1, width]``, its tiles numbered from its
    START (table rows: see :func:`stage_launch`).  Offsets are int32 unless WIDE (a buffer of 2^31 elements or
    more): int64.  ``X_ALIGN`` / ``OUT_ALIGN`` (powers of two, elements): every window row starts at a multiple of
    them in the block / the staged tensor (computed by :func:`stage_launch`); they let the compiler move the
    window's rows in 16-byte vectors instead of one element per instruction.  ``SLAB_ROWS``: the slabs are tiled
    like the window (``[BLOCK_R, BLOCK_X]`` over the window's columns, one piece per row: :func:`_slab_row_pieces`),
    their edge tiles walking the tables for the columns beside the window, instead of the table walk per element
    over whole rows; ``SLAB_ALIGN`` (a power of two) divides those rows' source and staged offsets at the window's
    first column (:func:`_slab_align`), so they too move in vectors.
    """
    IDX: tl.constexpr = tl.int64 if WIDE else tl.int32
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)  # linear, as _row_tile
    if PART == 1:  # the window's programs alone (a launch of its own: stage_launch's split)
        _stage_window(out_ptr, a_ptr, b_ptr, stab_ptr, pid, out_s1, x_s1, W_NX, W_ROWS, W_WIDTH, W_M1, W_K1, W_M0,
                      W_K0, W_OBASE, W_OB, W_OC, W_LO2, W_RHI, W_XBASE, W_XB, W_XC, W_STRIPS, REGION, IDX, BLOCK_R,
                      BLOCK_X, STRIP_X, X_ALIGN, OUT_ALIGN, STRIP_ALIGN, STRIP_R)
    elif PART == 3:  # after the words form wrote the window's rows: the window's strips, then the slabs
        s_tiles = tl.where(W_STRIPS != 0, (W_ROWS + STRIP_R - 1) // STRIP_R, 0)
        if pid < s_tiles:
            _stage_strips(out_ptr, a_ptr, b_ptr, stab_ptr, pid.to(tl.int32), out_s1, W_ROWS, W_M1, W_K1, W_M0, W_K0,
                          W_OBASE, W_OB, W_OC, W_LO2, W_RHI, REGION, IDX, STRIP_X, STRIP_ALIGN, STRIP_R)
        else:
            pid = pid - s_tiles + W_TILES  # the slabs' programs, numbered as in the one launch
            if pid < W_TILES:  # never taken, compiled in for the slabs' registers, as in PART 2 (see below)
                _stage_window(out_ptr, a_ptr, b_ptr, stab_ptr, pid, out_s1, x_s1, W_NX, W_ROWS, W_WIDTH, W_M1, W_K1,
                              W_M0, W_K0, W_OBASE, W_OB, W_OC, W_LO2, W_RHI, W_XBASE, W_XB, W_XC, W_STRIPS, REGION,
                              IDX, BLOCK_R, BLOCK_X, STRIP_X, X_ALIGN, OUT_ALIGN, STRIP_ALIGN, STRIP_R)
            else:
                _stage_slab_program(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr,
                                    crd2_ptr, ptab_ptr, btab_ptr, NS1, NS2, pid, out_s1, REGION, IDX, NUM_BOX,
                                    BLOCK_R, BLOCK_X, SLAB_X, STRIP_X, SLAB_ROWS, SLAB_ALIGN)
    else:
        if PART == 2:  # the slabs' programs alone, numbered from box 1's START
            pid += W_TILES
        # In PART 2 no program takes the window's branch, but it is compiled in: unaligned slab rows (SLAB_ROWS)
        # keep the layout of the window's loads then; on their own they took 255 registers a thread (sm_90)
        if pid < W_TILES:  # the window's programs (box 0), its geometry in the arguments: no load before the copy
            _stage_window(out_ptr, a_ptr, b_ptr, stab_ptr, pid, out_s1, x_s1, W_NX, W_ROWS, W_WIDTH, W_M1, W_K1,
                          W_M0, W_K0, W_OBASE, W_OB, W_OC, W_LO2, W_RHI, W_XBASE, W_XB, W_XC, W_STRIPS, REGION, IDX,
                          BLOCK_R, BLOCK_X, STRIP_X, X_ALIGN, OUT_ALIGN, STRIP_ALIGN, STRIP_R)
        else:
            _stage_slab_program(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr,
                                ptab_ptr, btab_ptr, NS1, NS2, pid, out_s1, REGION, IDX, NUM_BOX, BLOCK_R, BLOCK_X,
                                SLAB_X, STRIP_X, SLAB_ROWS, SLAB_ALIGN)


@triton.jit
def _searched_elements(pid, starts_ptr, STRIDE: tl.constexpr, n, total, LOG2_N: tl.constexpr, TRAIL: tl.constexpr,
                       BLOCK: tl.constexpr, IDX: tl.constexpr):
    """Program ``pid``'s BLOCK elements of ``total`` (boxes or cells laid end to end, the interpreter's form):
    ``(mask, channel, vector index e, segment k)``, ``k`` the last of the ``n`` segments whose start
    ``starts_ptr[k * STRIDE]`` is at most ``e`` (segment 0 starts at 0), by a branchless binary search over ``LOG2_N``
    steps: how the box gather and the accumulate find an element's box or cell under the interpreter."""
    et = (pid * BLOCK).to(IDX) + tl.arange(0, BLOCK).to(IDX)
    m = et < total
    e = et // TRAIL
    k = tl.zeros([BLOCK], dtype=tl.int32)
    for b in tl.static_range(LOG2_N):
        cand = k + (1 << (LOG2_N - 1 - b))
        ok = m & (cand < n)
        k = tl.where(ok & (tl.load(starts_ptr + cand * STRIDE, mask=ok, other=0) <= e), cand, k)
    return m, et % TRAIL, e, k


@triton.jit
def _program_elements(row, pid, NUMEL: tl.constexpr, PSTART: tl.constexpr, EXTENTS: tl.constexpr,
                      DIVISORS: tl.constexpr, TRAIL: tl.constexpr, BLOCK: tl.constexpr, IDX: tl.constexpr,
                      WIDE: tl.constexpr):
    """Program ``pid``'s BLOCK elements of the box (or cell) at table row ``row`` (``PER_BOX``), flat ``[LEAD, E0,
    E1, E2]`` of vectors of TRAIL channels: ``(mask, channel, index in the box, c0, c1, c2, lead)``.  The row holds
    the box's elements (channels included) at column NUMEL, its first program at PSTART, ``E0 E1 E2`` from EXTENTS
    and the :func:`magic_divisor` ``(m, k)`` of E2, E1, E0 from DIVISORS (used unless WIDE: runtime divisions)."""
    et = ((pid - tl.load(row + PSTART)) * BLOCK).to(IDX) + tl.arange(0, BLOCK).to(IDX)
    m = et < tl.load(row + NUMEL).to(IDX)
    e = et // TRAIL
    E0 = tl.load(row + EXTENTS).to(IDX)
    E1 = tl.load(row + EXTENTS + 1).to(IDX)
    E2 = tl.load(row + EXTENTS + 2).to(IDX)
    if WIDE:
        q = e // E2
        q1 = q // E1
        lead = q1 // E0
    else:
        q = magic_div(e, tl.load(row + DIVISORS), tl.load(row + DIVISORS + 1))
        q1 = magic_div(q, tl.load(row + DIVISORS + 2), tl.load(row + DIVISORS + 3))
        lead = magic_div(q1, tl.load(row + DIVISORS + 4), tl.load(row + DIVISORS + 5))
    return m, et % TRAIL, e, q1 - lead * E0, q - q1 * E1, e - q * E2, lead


@triton.jit
def box_gather_kernel(out0_ptr, out1_ptr, out2_ptr, src_ptr, pbox_ptr, btab_ptr, n_programs, nbox, total, RTMAX,
                      src_ls, src_s0, src_s1, src_s2, TRAIL: tl.constexpr, LOG2_NBOX: tl.constexpr,
                      COMPUTE: tl.constexpr, ROUND_BF16: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
                      PER_BOX: tl.constexpr):
    """Box k (row k of the box table) is flat ``[LEAD, E0, E1, E2]`` at ``out{SEL}[DST:]``:

    element ``(l, c)`` = ``sum_{r < R} src[l, T + D*c + r]`` per axis (D = +1 copy, -1
    reversed, 0 with R > 1: the replicate adjoint's sum).  ``RTMAX`` is the largest ``R0 * R1 * R2`` (``RT``) of any
    box: 1 unless a replicate box is summed.  SEL 0 and 2 are in the source's dtype (the unstage's send-back
    buffer and its ``grad_x``, whose interior window is one more box: ``halo_launches.unstage_launch``), SEL 1 in
    fp32 (fp64), the self boxes.

    ``PER_BOX`` (GPUs): each box has programs of its own (``pbox[pid]``: program ``pid``'s box; a program past
    ``n_programs``, the rounding of a spilled grid, finds its elements past the last box's end), so a program reads
    its box's row with loads every thread shares, and an element's coordinates come by the row's multiply-shift
    divisions (:func:`_program_elements`).  Else (the interpreter, which pays per program, per operation and per
    nested call, not per element) programs tile the boxes laid end to end, ``total`` elements, and every element
    finds its box by a binary search of the ``nbox`` starts (:func:`_searched_elements`) and divides at run time:
    one program for the whole launch there, where programs per box took 4-20 times the time.  Both forms share
    the body below, written out rather than in helpers, for the same reason.

    The run loop is a ``while`` (see the module doc).  With RTMAX = 1 (every pack) there is
    no loop: Triton specialises an integer argument equal to 1 to a constant, the guard
    folds away, and Triton 3.6's coalesce pass, which crashes on a ``while`` whose condition
    is constant-false, never sees one.

    ``TRAIL`` > 1 (channels last): every element of the boxes and of the source is a contiguous vector of TRAIL
    channels; the tables count vectors, ``NUMEL`` and ``total`` elements, and element ``e`` is channel ``e % TRAIL``
    of vector ``e // TRAIL`` (a constexpr: one compile per channel count, and its divisions are by a constant; they
    fold away for NCHW, TRAIL = 1).
    """
    IDX = tl.int64 if WIDE else tl.int32  # int32 offsets and div/mod unless a buffer has 2^31 elements or more
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)  # linear, as _row_tile
    if PER_BOX:  # the box's row: loads every thread shares
        # a program past n_programs (the rounding of a spilled grid) reads the last program's box, past whose end
        # its elements lie: all masked
        row = btab_ptr + tl.load(pbox_ptr + tl.minimum(pid, n_programs - 1)).to(tl.int64) * 24
        m, ch, e, c0, c1, c2, lead = _program_elements(row, pid, 15, 16, 2, 17, TRAIL, BLOCK, IDX, WIDE)
        t0, t1, t2 = tl.load(row + 5).to(IDX), tl.load(row + 6).to(IDX), tl.load(row + 7).to(IDX)
        d0, d1, d2 = tl.load(row + 8).to(IDX), tl.load(row + 9).to(IDX), tl.load(row + 10).to(IDX)
        sel, dst = tl.load(row), tl.load(row + 1)
    else:  # each element's box, searched
        m, ch, e, k = _searched_elements(pid, btab_ptr + 23, 24, nbox, total, LOG2_NBOX, TRAIL, BLOCK, IDX)
        row = btab_ptr + k * 24
        e -= tl.load(row + 23, mask=m, other=0).to(IDX)  # the element's index in its box
        E1 = tl.load(row + 3, mask=m, other=1).to(IDX)
        E2 = tl.load(row + 4, mask=m, other=1).to(IDX)
        q = e // E2
        c2 = e - q * E2
        c1 = q % E1
        q = q // E1
        E0 = tl.load(row + 2, mask=m, other=1).to(IDX)
        c0 = q % E0
        lead = q // E0
        t0, t1 = tl.load(row + 5, mask=m, other=0).to(IDX), tl.load(row + 6, mask=m, other=0).to(IDX)
        t2, d0 = tl.load(row + 7, mask=m, other=0).to(IDX), tl.load(row + 8, mask=m, other=0).to(IDX)
        d1, d2 = tl.load(row + 9, mask=m, other=0).to(IDX), tl.load(row + 10, mask=m, other=0).to(IDX)
        sel, dst = tl.load(row, mask=m, other=0), tl.load(row + 1, mask=m, other=0)
    off = lead * src_ls + (t0 + d0 * c0) * src_s0 + (t1 + d1 * c1) * src_s1 + (t2 + d2 * c2) * src_s2
    acc = tl.load(src_ptr + (off * TRAIL + ch), mask=m, other=0.0).to(COMPUTE)  # r = 0 peeled: a copy stays exact
    if RTMAX > 1:  # RTMAX == 1 (specialised to a constant by Triton): no loop is emitted at all
        if PER_BOX:
            R1, R2, RT = tl.load(row + 12).to(IDX), tl.load(row + 13).to(IDX), tl.load(row + 14).to(IDX)
        else:
            R1 = tl.load(row + 12, mask=m, other=1).to(IDX)
            R2 = tl.load(row + 13, mask=m, other=1).to(IDX)
            RT = tl.load(row + 14, mask=m, other=1).to(IDX)
        r = tl.full([], 1, tl.int32)  # typed: a loop-carried counter must keep one type when compiled
        while r < RTMAX:
            r2 = r % R2
            rq = r // R2
            r1 = rq % R1
            r0 = rq // R1
            acc += tl.load(src_ptr + ((off + r0 * src_s0 + r1 * src_s1 + r2 * src_s2) * TRAIL + ch),
                           mask=m & (tl.zeros([BLOCK], dtype=tl.int32) + r < RT), other=0.0).to(COMPUTE)
            r += 1
    # out0 and out2 have the source's dtype: a bf16 sum is rounded to nearest even (cast_out; the interpreter's own
    # conversion truncates), a copy stays exact; out1 is the fp32/fp64 self-box buffer.
    at = (dst.to(IDX) + e) * TRAIL + ch
    sel = sel + tl.zeros([BLOCK], dtype=tl.int64)  # a tensor: the interpreter masks with tensors only
    tl.store(out0_ptr + at, cast_out(acc, out0_ptr.dtype.element_ty, ROUND_BF16), mask=m & (sel == 0))
    tl.store(out1_ptr + at, acc.to(out1_ptr.dtype.element_ty), mask=m & (sel == 1))
    tl.store(out2_ptr + at, cast_out(acc, out2_ptr.dtype.element_ty, ROUND_BF16), mask=m & (sel == 2))


@triton.jit
def accumulate_kernel(gx_ptr, self_ptr, recv_ptr, pcell_ptr, ctab_ptr, blist_ptr, btab_ptr, n_programs, ncell, total,
                      E0, E1, E2, TRAIL: tl.constexpr, LOG2_NCELL: tl.constexpr, COMPUTE: tl.constexpr,
                      ROUND_BF16: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr, PER_BOX: tl.constexpr):
    """gx[l, p] += sum over the boxes k covering p of box_k[l, p - LO_k], in place, over the covered cells only.

    The covered part of the block is cut into cells, each covered by a fixed list of boxes
    (:func:`~distfuse.kernels.halo_tables.accumulate_cells`); cell c is flat ``[LEAD, W0, W1, W2]`` from ``(O0,
    O1, O2)`` (its row of the cell table: see :func:`~distfuse.kernels.halo_launches.accumulate_launch`).
    ``PER_BOX`` (GPUs): each cell has programs of its own (``pcell[pid]`` names program ``pid``'s cell), so a program
    reads its cell, its extents and its boxes with loads every thread shares, and an element's block coordinates
    come by the cell's multiply-shift divisions; else (the interpreter) programs tile the cells laid end to end and
    every element searches its cell and divides at run time, as in :func:`box_gather_kernel`.  An element reads
    ``gx`` there, adds its cell's boxes in table order and rounds once.  Box k (table row): SEL 0 reads
    ``self_ptr``, 1 ``recv_ptr``; element ``(l, p)`` of the block is at ``ORIGIN + l * VOLUME + p0 * STRIDE0 + p1 *
    STRIDE1 + p2`` there.  The block's interior, which no box covers, is never read.  Offsets are int32 unless
    ``WIDE`` (a buffer of 2^31 elements or more).  The box loop is a ``while`` (see the module doc).  ``TRAIL``:
    channels last, as in :func:`box_gather_kernel` (the tables count vectors of TRAIL channels).
    """
    IDX = tl.int64 if WIDE else tl.int32
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)  # linear, as _row_tile
    if PER_BOX:  # the cell's row: loads every thread shares
        # past n_programs (a spilled grid's rounding): the last program's cell, past whose end its elements lie
        row = ctab_ptr + tl.load(pcell_ptr + tl.minimum(pid, n_programs - 1)).to(tl.int64) * 17
        m, ch, _, p0, p1, p2, lead = _program_elements(row, pid, 0, 15, 4, 9, TRAIL, BLOCK, IDX, WIDE)
        p0 += tl.load(row + 1).to(IDX)  # the cell's origin in the block
        p1 += tl.load(row + 2).to(IDX)
        p2 += tl.load(row + 3).to(IDX)
        first, count = tl.load(row + 7), tl.load(row + 8)
    else:  # each element's cell, searched
        m, ch, e, k = _searched_elements(pid, ctab_ptr + 16, 17, ncell, total, LOG2_NCELL, TRAIL, BLOCK, IDX)
        row = ctab_ptr + k * 17
        local = e - tl.load(row + 16, mask=m, other=0).to(IDX)
        W1 = tl.load(row + 5, mask=m, other=1).to(IDX)
        W2 = tl.load(row + 6, mask=m, other=1).to(IDX)
        p2 = local % W2 + tl.load(row + 3, mask=m, other=0).to(IDX)
        q = local // W2
        p1 = q % W1 + tl.load(row + 2, mask=m, other=0).to(IDX)
        q = q // W1
        W0 = tl.load(row + 4, mask=m, other=1).to(IDX)
        p0 = q % W0 + tl.load(row + 1, mask=m, other=0).to(IDX)
        lead = q // W0
        first, count = tl.load(row + 7, mask=m, other=0), tl.load(row + 8, mask=m, other=0)
    out_off = (((lead * E0 + p0) * E1 + p1) * E2 + p2) * TRAIL + ch
    acc = tl.load(gx_ptr + out_off, mask=m, other=0.0).to(COMPUTE)
    if PER_BOX:  # the cell's boxes: loads every thread shares
        j = count * 0
        while j < count:
            box = btab_ptr + tl.load(blist_ptr + first + j) * 5
            sel = tl.load(box) + tl.zeros([BLOCK], dtype=tl.int64)  # a tensor: the interpreter masks with tensors only
            off = (tl.load(box + 1).to(IDX) + lead * tl.load(box + 2).to(IDX) + p0 * tl.load(box + 3).to(IDX)
                   + p1 * tl.load(box + 4).to(IDX) + p2) * TRAIL + ch
            acc += tl.load(self_ptr + off, mask=m & (sel == 0), other=0.0).to(COMPUTE)
            acc += tl.load(recv_ptr + off, mask=m & (sel == 1), other=0.0).to(COMPUTE)
            j += 1
    else:  # each element's cell: the loop runs to the program's longest list, shorter ones masked
        j = tl.max(count, axis=0) * 0
        end = tl.max(count, axis=0)
        while j < end:
            hit = m & (j < count)
            box = btab_ptr + tl.load(blist_ptr + first + j, mask=hit, other=0) * 5
            sel = tl.load(box, mask=hit, other=0)
            off = (tl.load(box + 1, mask=hit, other=0).to(IDX) + lead * tl.load(box + 2, mask=hit, other=0).to(IDX)
                   + p0 * tl.load(box + 3, mask=hit, other=0).to(IDX)
                   + p1 * tl.load(box + 4, mask=hit, other=0).to(IDX) + p2) * TRAIL + ch
            acc += tl.load(self_ptr + off, mask=hit & (sel == 0), other=0.0).to(COMPUTE)
            acc += tl.load(recv_ptr + off, mask=hit & (sel == 1), other=0.0).to(COMPUTE)
            j += 1
    tl.store(gx_ptr + out_off, cast_out(acc, gx_ptr.dtype.element_ty, ROUND_BF16), mask=m)


# ---------------------------------------------------------------- launch helpers


def compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def pick_tile(inner: int, rows: int, device: torch.device, tile: tuple[int, int] | None) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_X)`` of a row-tiled launch.

    GPU: 2048-element tiles; BLOCK_X is the widest of 128/64/32/16 whose padding of the
    inner extent wastes at most 1/8 of the lanes (514 -> 64: 9 tiles, 11% idle; 128 would
    idle 20%), else the least wasteful.  Untuned: no GPU was available when this was
    written.  Interpreter: big tiles, because each program costs Python time.
    """
    if tile is not None:
        return tile
    inner = max(inner, 1)
    if device.type != "cuda":
        bx = min(next_power_of_2(inner), 1024)
        return min(max(1, 8192 // bx), next_power_of_2(max(rows, 1))), bx
    cands = (128, 64, 32, 16)
    padded = {b: cdiv(inner, b) * b for b in cands}
    bx = next((b for b in cands if (padded[b] - inner) * 8 <= padded[b]),
              min(cands, key=lambda b: (padded[b], -b)))
    return 2048 // bx, bx


# CUDA's grid limits: 2^31 - 1 blocks along x (Triton's axis 0), 65535 along y and z.
_GRID0_MAX = 2**31 - 1
_GRID1_MAX = 65535


def linear_grid(programs: int) -> tuple[int, int]:
    """A launch grid of at least ``programs`` linearly numbered programs, within CUDA's limits.

    The kernels number their programs ``program_id(1) * num_programs(0) + program_id(0)``,
    so every extent lands on axis 0; axis 1 is used only past 2^31 - 1 programs (e.g.
    2^36 elements in 16-element tiles), splitting the count as evenly as possible (fewer
    than ``grid[1]`` surplus programs, which find nothing to do).  An innermost extent is
    never put on axis 1 on its own: a 1-D block of more than 65535 tiles would not launch.
    """
    g1 = max(1, cdiv(programs, _GRID0_MAX))
    if g1 > _GRID1_MAX:
        raise UnsupportedError(f"{where('halo kernels')}: {programs} programs exceed a CUDA grid "
                               f"({_GRID0_MAX} x {_GRID1_MAX}); use larger tiles")
    return cdiv(programs, g1), g1


def row_tiled_grid(n_rows: int, inner: int, block_r: int, block_x: int) -> tuple[int, int]:
    """Grid of a ``[BLOCK_R, BLOCK_X]``-tiled launch over ``[n_rows, inner]`` (decoded by ``_row_tile``)."""
    return linear_grid(cdiv(n_rows, block_r) * cdiv(inner, block_x))


#: Warps of the box gather: each element decodes a 15-entry int64 box row, which spilled registers at 4 warps.
BOX_NUM_WARPS = 8


def box_block(device: torch.device, block: int | None, total: int) -> int:
    if block is not None:
        return block
    if device.type == "cuda":
        return 1024
    return min(4096, next_power_of_2(max(total, 1)))


#: GPU tiles of the staging (:func:`stage_tile`): 4096 elements, 32 a thread at 4 warps; slab tiles a quarter of
#: the width (their table walk holds five int64 table entries per element: full-size slab tiles took 182-238
#: registers a thread at sm_90, quarter-size ones about 100; and narrow ones idle fewer lanes on rows just wider
#: than the window: 66 columns in 5 tiles of 16, not 2 of 64).  Measured on an H200 (bf16, halo 1; sweep of
#: 4096/8192/16384-element tiles at 4 and 8 warps, ``scripts/gpu_diagnose.py --sections halo``, results in
#: ``bench/results/diagnose-NVIDIA_H200-2026-11-27.json``): 4096 elements at 4 warps was the fastest or within 2%
#: of it on all four shapes, e.g. [1, 256, 512^2] 77.7 us against 93.9 us at 8 warps (copy: 67.4 us).
STAGE_WIDTHS = (512, 256, 128, 64, 32, 16)
STAGE_TILE_ELEMENTS = 4096
STAGE_NUM_WARPS = 4
STAGE_SLAB_SPLIT = 4
#: Elements of a strip tile of the remote pass (``STRIP_R`` rows of ``STRIP_X`` columns beside the window), four a
#: thread: in NCHW each holds its own 64-bit offset, and 2048-element tiles took 146-188 registers a thread at sm_90
#: (Triton 3.6), 512-element ones 72.
STAGE_STRIP_ELEMENTS = 512
#: Launch a staging's window programs and its slabs' programs apart on GPUs (``stage_kernel``'s ``PART`` 1 and 2,
#: two launches of one kernel) where the region copies the window (``"all"``, ``"local"``) and has slabs.  A
#: kernel's registers are those of its hungriest path: compiled for sm_90 (Triton 3.6, bf16, 4096-element tiles, the
#: one-pass NCHW staging of a 3-D block at halo 1), the window's copy with its strips takes 48 registers a thread on
#: its own (32 at 512-wide tiles) and the slabs' rows 80 (90), but one kernel with both 96, which leaves an SM five
#: programs of the window's copy (4 warps each) where it could hold ten.  The window is 94% of the rows of a [64^3]
#: block and all but 0.4% of a [512^2] one.  The price is one launch more (host time, and a kernel boundary on the
#: GPU).  Unmeasured on a GPU: ``scripts/gpu_diagnose.py`` (``halo_tiles``) times both ways.
STAGE_SPLIT = True
#: Staged elements (channels included) from which the staging splits by default: the second launch costs the host
#: 10-17 us on the H200's host (``diagnose``'s ``attrib`` rows, the launcher alone), which small stagings, bound by
#: the host, would pay in full; 2^24 bf16 elements take the copy about 16 us.
STAGE_SPLIT_ELEMENTS = 1 << 24
#: Box-table rows of a staging launch: the interior window and at most four slabs (two per axis of axes 0 and 1).
STAGE_BOXES = 5
_STAGE_COLS = 24  # the box table's row width (stage_kernel hard-codes it)
_NEVER = 1 << 62  # START of an unused row: no program id reaches it
#: Buffers (staged, block, receive buffer) of this many elements or more take int64 offsets in the staging.
WIDE_ELEMENTS = 2**31


def pow2_divisor(*terms: int, cap: int = 16) -> int:
    """The largest power of two, at most ``cap``, that divides every term (``cap`` if all are 0).

    An offset that is a sum of multiples of the terms is then a multiple of it: what
    the staging may promise the compiler about its row starts (by rounding to it: :func:`stage_kernel`).
    """
    g = 0
    for t in terms:
        g = math.gcd(g, int(t))
    return cap if g == 0 else min(cap, g & -g)


def magic_divisor(d: int) -> tuple[int, int]:
    """``(m, k)`` with ``n // d == (n * m) >> (31 + k)`` for every ``0 <= n < 2**31`` (``1 <= d < 2**31``).

    Granlund-Montgomery with a 31-bit dividend: ``k = ceil(log2 d)``, ``m = ceil(2**(31 + k) / d)``, so
    ``m * d - 2**(31 + k) < d <= 2**k`` (exact quotients) and ``m < 2**32``.  The kernels compute it in 32-bit
    halves: ``umulhi(2n, m) >> k`` (``2n < 2**32``; flooring by ``2**32`` then by ``2**k`` is flooring by both).
    """
    if not 1 <= d < 2**31:
        raise ValueError(f"magic_divisor: divisor {d} outside [1, 2^31)")
    k = (d - 1).bit_length()
    return -(-(1 << (31 + k)) // d), k


def region_writes(kind: int, code: int) -> bool:
    """Whether a staging of region ``code`` (:data:`REGION_CODE`) writes a piece of ``kind`` (0 zero fill, 1 the
    block, 2 the receive buffer): what the kernels' REGION masks keep.  The window's copy alone (3) writes none."""
    return code == 0 or (code == 1 and kind != 2) or (code == 2 and kind == 2)


def choose_slab_rows(possible: bool, slab_align: int, code: int, block_x: int) -> bool:
    """Whether the staging tiles its slabs one piece per row (``SLAB_ROWS``) where ``possible`` (a GPU, the window's
    columns one linear segment, int32 offsets, vector-aligned block rows), given the slab rows' alignment.

    Aligned slab rows (``slab_align`` > 1: channels last, even halos) always.  Unaligned ones (NCHW rows of odd
    halos, which move one element per instruction) only in the one-pass staging (``code`` 0) of window tiles 64
    columns wide or more: compiled for sm_90 by Triton 3.6 (bf16, 4096-element tiles), their slab loads then take
    the window's layout, but in the overlap's passes (local 1, remote 2, which lack the window's copy or its mask)
    or at 32 columns and fewer they hold one 64-bit pointer per element, 113-255 registers a thread (spilling at
    64 columns in the remote pass) against 64-80 for the walk per element: two or three programs an SM.  Measured
    in the one-pass staging on an H200 (2026-11-28): 126 against 147 us at [1, 256, 64^3] bf16, 78 against 77 at
    [1, 256, 512^2]."""
    return possible and (slab_align > 1 or (code == 0 and block_x >= 64))


def stage_tile(width: int, full_width: int, rows: int, device: torch.device,
               tile: tuple[int, ...] | None) -> tuple[int, int, int, int, int]:
    """``(BLOCK_R, BLOCK_X, SLAB_X, STRIP_X, num_warps)`` of the staging launch; ``width`` is the interior
    window's, ``full_width`` the staged tensor's last extent, ``rows`` the most rows of any box.

    GPU: BLOCK_X is the widest of :data:`STAGE_WIDTHS` whose padding of the window's width idles at most a
    quarter of the lanes (64 -> 64, 512 -> 512, 100 -> 128, 514 -> 128: five tiles, 20% idle), else the least
    padded; BLOCK_R = 4096 / BLOCK_X; SLAB_X = BLOCK_X / 4 for the slabs' full rows of ``full_width``; STRIP_X
    columns beside the window at a time, one element a thread (128 / BLOCK_R); 4 warps.  The window's rows are
    the copy (the bulk of the bytes).  Tile size and warps: the H200 sweep (:data:`STAGE_TILE_ELEMENTS`).
    Interpreter: one tile per
    box where it fits (each program costs Python time).  ``tile`` overrides ``(BLOCK_R, BLOCK_X)`` (tests), with
    SLAB_X = BLOCK_X, STRIP_X = 2 and 4 warps; a 5-tuple gives all five (the GPU tile sweep of
    ``scripts/gpu_diagnose.py``).
    """
    if tile is not None and len(tile) == 5:
        return tuple(tile)
    if tile is not None:
        return tile[0], tile[1], tile[1], 2, 4
    if device.type != "cuda":
        bx = min(next_power_of_2(max(full_width, 1)), 1024)
        br = min(max(1, 8192 // bx), next_power_of_2(max(rows, 1)))
        return br, bx, bx, max(1, 128 // br), 4
    padded = {b: cdiv(width, b) * b for b in STAGE_WIDTHS}
    bx = next((b for b in STAGE_WIDTHS if (padded[b] - width) * 4 <= padded[b]),
              min(STAGE_WIDTHS, key=lambda b: (padded[b], -b)))
    br = STAGE_TILE_ELEMENTS // bx
    return br, bx, max(1, bx // STAGE_SLAB_SPLIT), max(1, 32 * STAGE_NUM_WARPS // br), STAGE_NUM_WARPS


def strip_chunk(block_r: int, warps: int) -> int:
    """Channels last: the most channels of one spatial column a staging program moves at a time beside the window
    (``STRIP_X``, before the channels' own power-of-two divisor caps it): 8 elements a thread, 4 at tiles of 256 rows
    or more (the 16-column tile: 8 a thread spilled 16 bytes a thread in bf16 under Triton 3.6, sm_90)."""
    return max(1, (4 if block_r >= 256 else 8) * 32 * warps // block_r)


class StageLaunch(NamedTuple):
    """Everything :func:`~distfuse.kernels.halo.halo_stage` launches with besides ``out``, ``x``, ``recv`` and the
    dtype: the staged shape, the block's spatial shape and the receive-buffer size it checks, the kernel
    (``stage_kernel``; ``lut_gather_kernel`` without an interior window; None: nothing to write), its grid,
    arguments and constexprs."""

    staged_shape: tuple[int, ...]
    recv_numel: int
    kernel: object
    grid: tuple[int, int]
    args: tuple
    meta: dict
    input_shape: tuple[int, ...]
    bound: dict  # (out's dtype, words form taken) -> its BoundLaunches (launch_cache), made at the first such launch
    parts: tuple = ()  # ((grid, PART), ...): the launches of a split staging (see STAGE_SPLIT); () one launch of grid
    # the words form (halo_stage_words), where it applies: (WordsLaunch, grid of PART 3, PART 3's constexprs), or ()
    words: tuple = ()


def _segment_at(ax, i: int, pos: int) -> int:
    return next(s for s, sg in enumerate(ax.segments(i)) if sg.dst <= pos < sg.dst + sg.length)


def _window_columns_linear(luts2: tuple[list[int], list[int]], lo2: int, width: int, seg2: int) -> int | None:
    """``C2BASE`` with ``crd2[col] == col + C2BASE`` and ``seg2[col] == seg2`` at every window column ``[lo2, lo2 +
    width)`` of the (merged) last axis, whose LUTs are ``luts2`` (what lets :func:`stage_kernel` read a slab's rows
    there one piece per row), or None."""
    seg_id, crd = luts2
    cols = range(lo2, lo2 + width)
    if all(seg_id[c] == seg2 and crd[c] - c == crd[lo2] - lo2 for c in cols):
        return crd[lo2] - lo2
    return None


#: A measured staging config's tile keys (:mod:`~distfuse.kernels.tile_table`), in :func:`stage_tile`'s order.
STAGE_TILE_KEYS = ("BLOCK_R", "BLOCK_X", "SLAB_X", "STRIP_X", "num_warps")


def measured_stage(device: torch.device, dtype: torch.dtype, lead: int, full: tuple[int, int, int]) -> dict | None:
    """The measured config of a staging (tile and forms: :mod:`~distfuse.kernels.tile_table`, kernel
    ``"halo_stage"``) of ``lead`` leading vectors of the merged staged shape ``full``, or None: the rules decide.
    Only on a GPU with a table entry of its name, the dtype, this row length and rows per vector, and a lead
    within a factor of 2."""
    return measured_tile("halo_stage", stage_kernel, device_name(device), dtype, lead, full[2], full[0] * full[1],
                         1)


def stage_key(launch: StageLaunch, lead: int, trail: int = 1) -> dict:
    """The tile table's key of a staging (``M``, ``N``, ``K``: :func:`measured_stage`'s), for the diagnosis' rows."""
    full = merged_shape(launch.staged_shape, trail)
    return dict(M=lead, N=full[2], K=full[0] * full[1])


def stage_config(launch: StageLaunch, element_size: int) -> dict:
    """What a tile-table entry stores so that :func:`stage_launch` launches ``launch`` again (a ``stage_kernel``
    launch): its tile (:data:`STAGE_TILE_KEYS`), ``SPLIT`` (two launches) and ``WORDS`` (the words form, for
    elements of ``element_size`` bytes)."""
    return {**{k: launch.meta[k] for k in STAGE_TILE_KEYS}, "SPLIT": bool(launch.parts),
            "WORDS": bool(launch.words) and element_size in launch.words[0].sizes}


@functools.lru_cache(maxsize=512)
def stage_launch(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device, region: str,
                 tile: tuple[int, ...] | None, slab_rows: bool | None = None, trail: int = 1,
                 split: bool | None = None, words: bool | None = None,
                 dtype: torch.dtype | None = None) -> StageLaunch:
    """The staging launch of worker ``index`` for ``lead`` leading elements, cached: no per-call host work but the
    cache lookup (plans hash by identity, as for :func:`~distfuse.kernels.halo_tables.stage_tables`).

    Box table of ``stage_kernel`` (int64, :data:`STAGE_BOXES` rows of 24), row 0 the interior window, then the
    slabs of :func:`shell` over axes 0 and 1 (every column), unused rows last (START 2^62)::

        0 START  1 NX  2 NROWS  3 WIDTH  4 E1  5 M1  6 K1  7 E0  8 M0  9 K0  10 OBASE  11 OB  12 OC
        13 LO0  14 LO1  15 LO2  16 XBASE  17 XB  18 XC  19 PBASE  20 RHI  21 (0)  22 STRIPS  (23 unused)

    ``START`` first program, ``NX`` column tiles, ``NROWS = LEAD*E0*E1`` rows of ``WIDTH`` columns, ``(M, K)`` the
    :func:`magic_divisor` of E1 and E0, ``LO`` the box's staged origin; row ``r`` (``q = r // E1``) starts at staged
    ``OBASE + r*E2 + q*OB + lead*OC``.  Window only: its source row starts at ``XBASE + r*n2 + q*XB + lead*XC`` in
    the block, ``PBASE`` is the piece-table row of its axis-0/1 segments (``(s0 * NS1 + s1) * NS2``), ``RHI`` the
    first column right of it, ``STRIPS`` 1 where the region writes some of the columns beside it (each column's piece
    and source offset: the strip table, :func:`strip_table`, the launch's argument after the box table).  A slab none of
    whose pieces the region writes gets no program (:func:`region_writes`).  Region ``"remote"`` tiles the window
    box by ``STRIP_R`` rows (``NX`` 1), its programs writing those columns alone, and none where there are none;
    ``"window"`` (a diagnosis, :data:`REGION_CODE`) the window programs only, without their strips.
    With ``SLAB_ROWS`` the slabs are tiled over the window's columns (``NX`` of ``BLOCK_X``) and their row holds
    ``15 LO2`` and ``20 RHI`` of the window, ``19 S2W`` the window's segment on the last axis and ``21 C2BASE``
    (``crd2 = col + C2BASE`` there).  ``slab_rows``: None chooses (see below); True or False forces it (tests).
    The kernel reads the window's row from its ``W_*`` arguments instead (``W_TILES`` box 1's START), so a window
    program loads nothing before its copy.  ``split``: launch the window's programs and the slabs' apart
    (:data:`STAGE_SPLIT`, the GPU default from :data:`STAGE_SPLIT_ELEMENTS` staged elements; None chooses, True or
    False forces it), where the region copies the window (``"all"``, ``"local"``) and has slabs.  ``words``: the
    window's rows as flat words (:mod:`~distfuse.kernels.halo_stage_words`), then ``PART`` 3 (the strips, then the
    slabs), where the region copies the window in NCHW with int32 offsets (:data:`~distfuse.kernels.halo_stage_words.
    STAGE_WORDS` from :data:`STAGE_SPLIT_ELEMENTS` staged elements on GPUs; None chooses, True or False forces it);
    :func:`launch_stage` takes it for the element sizes and outputs it fits, the other launches otherwise.

    ``dtype`` (the staged dtype; None: the rules alone): on a GPU, where no ``tile`` is given, a measured config of
    this staging (:func:`measured_stage`) gives the tile, as a whole tile given would, and the forms it names
    where they are not forced; only the NCHW remote pass keeps the rules' strip width (its strips are
    tiled by ``STRIP_R`` rows, which no whole staging the diagnosis times runs).

    ``trail`` > 1: channels last (``lead`` the batch, ``trail`` the channels, innermost in memory).  The kernels
    are the same: every staged row is the last axis merged with the channels (``L2 * trail`` elements), the
    window's columns and row offsets are in merged elements, and the last axis's LUTs are merged too
    (:func:`~distfuse.kernels.halo_tables.trail_luts`).  Rows then start at multiples of ``trail``, so with 8 or
    more channels (a multiple of 8) the window and the slabs move in 16-byte vectors at any halo width, where NCHW
    rows of odd halos store one element per instruction.
    """
    staged = tuple(plan.staged_shape(index))
    x_shape = tuple(plan.input_shape(index))
    recv = recv_numel(plan, index, lead * trail)
    full = merged_shape(staged, trail)
    interior = interior_piece(plan, index)
    total = lead * math.prod(full)
    code = REGION_CODE[region]
    if total == 0:
        return StageLaunch(staged, recv, None, (0, 0), (), {}, x_shape, {})
    lists, ptab_rows, ns = stage_table_lists(plan, index, lead, trail)
    luts, ptab = table_tensors(lists, ptab_rows, device)
    out_str = (math.prod(full), *contiguous_strides(full)[:2])
    if interior is None or math.prod(interior.shape) == 0:  # the whole staged tensor by the table walk
        if code == 3:  # the diagnosis' window copy: there is none
            return StageLaunch(staged, recv, None, (0, 0), (), {}, x_shape, {})
        n_rows = lead * full[0] * full[1]
        _check_int32_rows(n_rows)  # _row_tile's
        block_r, block_x = pick_tile(full[2], n_rows, device, tile)
        return StageLaunch(staged, recv, lut_gather_kernel, row_tiled_grid(n_rows, full[2], block_r, block_x),
                           (*luts, ptab, n_rows, *full, ns[1], ns[2], *out_str),
                           dict(REGION=code, BLOCK_R=block_r, BLOCK_X=block_x), x_shape, {})
    given = tile is not None and len(tile) == 5  # a whole tile given (the diagnosis' sweep): STRIP_X as given
    measured = measured_stage(device, dtype, lead, full) if tile is None and dtype is not None else None
    if measured is not None:
        tile = tuple(measured[k] for k in STAGE_TILE_KEYS)
        split = measured.get("SPLIT") if split is None else split
        words = measured.get("WORDS") if words is None else words
    forced = given or measured is not None  # a whole tile: as given, but for the NCHW remote pass's strips
    x_str = contiguous_strides(merged_shape(x_shape, trail))
    x_ls = math.prod(x_shape) * trail
    lo, ext, src = (_merged(pad3(interior.dst_lo, 0), trail), merged_shape(interior.shape, trail),
                    _merged(pad3(interior.src_lo, 0), trail))
    inner = tuple((a, a + e) for a, e in zip(lo, ext, strict=True))
    slabs = shell((inner[0], inner[1], (0, full[2])), full)
    boxes = [(inner[0], inner[1], (lo[2], lo[2] + ext[2]))] + slabs
    extents = [tuple(hi - a for a, hi in box) for box in boxes]
    most = max(lead * e[0] * e[1] for e in extents)
    block_r, block_x, slab_x, strip_x, warps = stage_tile(ext[2], full[2], most, device, tile)
    strips = lo[2] > 0 or lo[2] + ext[2] < full[2]
    segs = [0] * (3 - len(plan.axes)) + [_segment_at(ax, i, p)
                                         for ax, i, p in zip(plan.axes, index, interior.dst_lo, strict=True)]
    wide = max(total, lead * x_ls, recv) >= WIDE_ELEMENTS
    # The window's rows start at XBASE + r*n2 + q*XB + lead*XC in the block (box table columns 16-18 below).
    xbase, (w_e0, w_e1, _) = sum(a * b for a, b in zip(src, x_str, strict=True)), extents[0]
    x_align = pow2_divisor(xbase, x_str[1], x_str[0] - w_e1 * x_str[1], x_ls - w_e0 * x_str[0], ext[2])
    # Slabs one piece per row on GPUs where the window's columns allow it, with int32 offsets and vector-aligned
    # block rows: compiled for sm_90 (bf16, 4096-element tiles) that costs 72-80 registers a thread, as the
    # per-element walk does; with int64 offsets it spills, and with unaligned rows it takes 255 (the walk: 159).
    # Not under the interpreter, where it costs more Python per program than the walk (20-60% a staging);
    # the tests force both ways.
    c2base = _window_columns_linear(lists[2], lo[2], ext[2], segs[2])  # the last axis's LUTs, merged
    slab_terms = [(lo0 * out_str[1] + lo1 * out_str[2], out_str[1] - E1 * out_str[2], out_str[0] - E0 * out_str[1])
                  for ((lo0, _), (lo1, _), _), (E0, E1, _) in zip(boxes[1:], extents[1:], strict=True)]
    if slab_rows is None:
        possible = device.type == "cuda" and c2base is not None and not wide and x_align > 1
        align = _slab_align(slab_terms, ptab_rows, ns[2], segs[2], c2base, lo[2], ext[2], full[2]) if possible else 1
        slab_rows = choose_slab_rows(possible, align, code, block_x)
    elif slab_rows and c2base is None:
        raise ValueError("stage_launch: slab_rows=True, but the window's columns are not one linear segment")
    pbase = (segs[0] * ns[1] + segs[1]) * ns[2]
    if trail > 1 and strips and not forced:  # a chunk: one spatial column's channels,
        strip_x = min(pow2_divisor(trail, cap=1 << 30), strip_chunk(block_r, warps))
    # What this region writes: the window's strips (the columns beside it in its rows) and each slab, skipped where
    # none of their pieces is the region's (a middle worker's local pass has no border to write, for one); in
    # "remote" the strips alone, STRIP_R rows a tile (far more rows than a window tile's: that pass moves the
    # border only, and a window tile's few strip elements behind two dependent table loads left every SM waiting)
    strip_kinds = {ptab_rows[5 * (pbase + lists[2][0][c])] for c in (*range(lo[2]), *range(lo[2] + ext[2], full[2]))}
    strips_here = code != 3 and any(region_writes(kind, code) for kind in strip_kinds)
    strip_r = block_r
    if code == 2:
        if trail == 1 and not given:  # as many columns a step as there are, 16 at most
            strip_x = min(16, next_power_of_2(max(1, full[2] - ext[2])))
        strip_r = max(block_r, next_power_of_2(max(1, STAGE_STRIP_ELEMENTS // strip_x)))
    rows, start = [], 0
    for k, ((lo0, hi0), (lo1, hi1), (lo2, _)), (E0, E1, width) in zip(range(len(boxes)), boxes, extents,
                                                                      strict=True):
        n_rows = lead * E0 * E1
        nx = cdiv(ext[2], block_x) if k and slab_rows else cdiv(width, slab_x if k else block_x)
        if k == 0 and code == 2:
            nx, tiles = 1, cdiv(n_rows, strip_r) if strips_here else 0
        elif k == 0:
            tiles = cdiv(n_rows, block_r) * nx
        else:
            kinds = {ptab_rows[5 * ((s0 * ns[1] + s1) * ns[2] + s2)] for s0 in set(lists[0][0][lo0:hi0])
                     for s1 in set(lists[1][0][lo1:hi1]) for s2 in set(lists[2][0])}
            here = code != 3 and any(region_writes(kind, code) for kind in kinds)
            tiles = cdiv(n_rows, block_r) * nx if here else 0
        rows += [start, nx, n_rows, width, E1, *magic_divisor(E1), E0, *magic_divisor(E0),
                 lo0 * out_str[1] + lo1 * out_str[2], out_str[1] - E1 * out_str[2], out_str[0] - E0 * out_str[1],
                 lo0, lo1, lo[2] if k and slab_rows else lo2]
        if k == 0:  # XBASE XB XC: the window's source in the block, linear in (r, q, lead) like OBASE OB OC; PBASE,
            # RHI; 22: whether the window's programs write its strips in this region
            rows += [xbase, x_str[0] - E1 * x_str[1], x_ls - E0 * x_str[0], pbase, lo[2] + ext[2], 0,
                     int(strips_here)]
        elif slab_rows:  # the slab's rows at the window's columns: S2W (col 19), RHI (20), C2BASE (21)
            rows += [0, 0, 0, segs[2], lo[2] + ext[2], c2base, 0]
        else:
            rows += [0] * 7
        rows += [0] * (_STAGE_COLS - 23)
        start += tiles
    for _ in range(STAGE_BOXES - len(boxes)):
        rows += [_NEVER, 1] + [0] * (_STAGE_COLS - 2)
    if start == 0:
        return StageLaunch(staged, recv, None, (0, 0), (), {}, x_shape, {})
    _check_int32_rows(most)  # magic_div's
    btab = torch.tensor(rows, dtype=torch.int64, device=device)
    stab = torch.tensor(strip_table(ptab_rows, pbase, lists[2], lo[2], lo[2] + ext[2], full[2], w_e0, w_e1),
                        dtype=torch.int64, device=device)
    w = rows[:_STAGE_COLS]  # the window's row: its staged rows start at OBASE + LO2 + r*E2 + q*OB + lead*OC
    out_align = pow2_divisor(w[10] + lo[2], full[2], w[11], w[12])
    slab_align = _slab_align(slab_terms, ptab_rows, ns[2], segs[2], c2base, lo[2], ext[2],
                             full[2]) if slab_rows else 1
    strip_align = 0
    if trail > 1 and strips and (not forced or trail % strip_x == 0):
        strip_align = _strip_align(w, ptab_rows, pbase, lists[2], lo[2], lo[2] + ext[2], full[2], strip_x)
    w_tiles = min(rows[_STAGE_COLS], start)  # the window's programs come first (box 1's START; all without slabs)
    window = (rows[_STAGE_COLS], *(w[c] for c in (1, 2, 3, 5, 6, 8, 9, 10, 11, 12, 15, 20, 16, 17, 18, 22)))
    if split is None:
        split = device.type == "cuda" and STAGE_SPLIT and total >= STAGE_SPLIT_ELEMENTS
    # where the window's copy runs (regions all and local): the remote pass's window programs write strips only, and
    # take the slabs' registers anyway (72 a thread at sm_90, Triton 3.6), so a second launch would buy nothing
    parts = (((linear_grid(w_tiles), 1), (linear_grid(start - w_tiles), 2))
             if split and code in (0, 1) and 0 < w_tiles < start else ())
    meta = dict(REGION=code, WIDE=wide, NUM_BOX=STAGE_BOXES, BLOCK_R=block_r, BLOCK_X=block_x, SLAB_X=slab_x,
                STRIP_X=strip_x, X_ALIGN=x_align, OUT_ALIGN=out_align, SLAB_ROWS=slab_rows, SLAB_ALIGN=slab_align,
                STRIP_ALIGN=strip_align, STRIP_R=strip_r, PART=0,
                num_warps=warps)  # every constexpr given: a launch leaving one to its default is no launch-cache hit
    if words is None:
        words = device.type == "cuda" and _words.STAGE_WORDS and total >= STAGE_SPLIT_ELEMENTS
    words_form = ()
    groups = (_words.WORDS_GROUPS if device.type == "cuda"
              else min(_words.WORDS_GROUPS_INTERPRETED, next_power_of_2(cdiv(total, 4))))
    # int32 word indices: the last program's groups run past the end by up to 4 * groups words, which must not wrap
    if words and code in (0, 1) and trail == 1 and not wide and total + 4 * groups < 2**31 and w_tiles > 0:
        # PART 3: the strips as the remote pass tiles them (STRIP_R rows), with this region's pieces, then the slabs
        strip_x3 = min(16, next_power_of_2(max(1, full[2] - ext[2])))
        strip_r3 = max(block_r, next_power_of_2(max(1, STAGE_STRIP_ELEMENTS // strip_x3)))
        s_tiles = cdiv(w[2], strip_r3) if strips_here else 0
        words_form = (words_launch(full, lead, lo, ext, xbase, x_str[1], w[17], w[18], groups),
                      linear_grid(s_tiles + start - w_tiles) if s_tiles + start - w_tiles else None,
                      dict(meta, PART=3, STRIP_X=strip_x3, STRIP_R=strip_r3))
    return StageLaunch(staged, recv, stage_kernel, linear_grid(start), (*luts, ptab, btab, stab, ns[1], ns[2],
                                                                        full[2], x_str[1], *window),
                       meta, x_shape, {}, parts, words_form)


class WordsLaunch(NamedTuple):
    """The words launch of a staging (:mod:`~distfuse.kernels.halo_stage_words`; made by :func:`words_launch`; its
    grid and arguments depend on the element size only through ``PER_WORD``): the grids and arguments for 16-bit
    and 32-bit elements."""

    grids: dict  # element size (2, 4) -> grid
    args: dict  # element size -> the scalar arguments after (out, a, b)
    sizes: frozenset  # the element sizes whose rows are whole words, at least four a row
    groups: int  # GROUPS


def words_launch(full: tuple[int, int, int], lead: int, lo: tuple[int, int, int], ext: tuple[int, int, int],
                 xbase: int, x_s1: int, xb: int, xc: int, groups: int) -> WordsLaunch:
    """The geometry of the words form (:mod:`~distfuse.kernels.halo_stage_words`) for a staged tensor ``[lead,
    *full]`` whose interior window is ``ext`` at ``lo``, its rows starting at ``xbase + r * x_s1 + q * xb + lead *
    xc`` in the block (``stage_launch``'s box table); ``groups`` a program (``WORDS_GROUPS`` on GPUs)."""
    grids, args = {}, {}
    for size, per_word in ((2, 2), (4, 1)):
        w2 = full[2] // per_word
        n_words = lead * full[0] * full[1] * w2
        grids[size] = linear_grid(cdiv(cdiv(n_words, 4), groups))
        args[size] = (n_words, w2, *magic_divisor(max(w2, 1)), full[1], *magic_divisor(full[1]), full[0],
                      *magic_divisor(full[0]), lo[0], lo[1], ext[0], ext[1], lo[2], lo[2] + ext[2], xbase, x_s1, xb,
                      xc)
    sizes = frozenset(size for size, fits in ((2, full[2] % 2 == 0 and full[2] >= 8), (4, full[2] >= 4)) if fits)
    return WordsLaunch(grids, args, sizes, groups)


def strip_table(ptab: list[int], pbase: int, luts2: tuple[list[int], list[int]], lo2: int, hi2: int, row_len: int,
                E0: int, E1: int) -> list[int]:
    """The strip table of a staging launch: one row of five int64 per column beside the window (the ``lo2`` columns
    left of it, then the ``row_len - hi2`` right of it, merged in channels last), ``KIND, BASE + crd2[col], STRIDE1,
    STRIDE0 - E1*STRIDE1, LEAD_STRIDE - E0*STRIDE0`` of the column's piece (piece-table row ``pbase + seg2[col]``;
    ``E0``, ``E1`` the window's extents), so that window row ``r`` (``q = r // E1``) reads the column at ``BASE +
    crd2 + r*STRIDE1 + q*(...) + lead*(...)`` of its source (:func:`_stage_beside`).  One zero row where the window
    has no column beside it (a pointer the kernel never reads through)."""
    seg2, crd2 = luts2
    out = []
    for col in (*range(lo2), *range(hi2, row_len)):
        kind, base, lstr, st0, st1 = ptab[5 * (pbase + seg2[col]): 5 * (pbase + seg2[col]) + 5]
        out += [kind, base + crd2[col], st1, st0 - E1 * st1, lstr - E0 * st0]
    return out or [0] * 5


def _slab_align(slabs: list[tuple[int, int, int]], ptab: list[int], ns2: int, s2w: int, c2base: int, lo2: int,
                width: int, row_len: int) -> int:
    """``SLAB_ALIGN``: the largest power of two (at most 16) dividing, for every slab row at the window's first
    column ``lo2``, its staged offset (``OBASE + lo2 + r*E2 + q*OB + lead*OC``, ``slabs`` the ``(OBASE, OB, OC)`` of
    each slab box) and its source offset (``BASE + lead*LEAD_STRIDE + c0*STRIDE0 + c1*STRIDE1 + C2BASE + lo2`` of
    every piece with the window's last-axis segment ``s2w``), and the window's width.  NCHW rows of odd halos give
    1; channels last with C a multiple of 16 gives 16 (every term is a multiple of C)."""
    terms = [width, row_len]
    for obase, ob, oc in slabs:
        terms += [obase + lo2, ob, oc]
    for p in range(len(ptab) // 5):
        kind, base, lstr, st0, st1 = ptab[5 * p: 5 * p + 5]
        if p % ns2 == s2w and kind != 0:
            terms += [base + c2base + lo2, lstr, st0, st1]
    return pow2_divisor(*terms)


def _strip_align(w: list[int], ptab: list[int], pbase: int, luts2: tuple[list[int], list[int]], lo2: int, hi2: int,
                 row_len: int, strip_x: int) -> int:
    """``STRIP_ALIGN`` (at least 1): the largest power of two (at most 16) dividing, for every window row and every
    chunk of ``strip_x`` columns beside the window (from 0 to ``lo2`` and from ``hi2`` to ``row_len``), its staged
    offset (``OBASE + r*E2 + q*OB + lead*OC`` of the window's table row ``w``, plus the chunk's column) and its
    source offset (the chunk's piece: ``BASE + crd2[col] + r*STRIDE1 + ...``)."""
    seg2, crd2 = luts2
    terms = [strip_x, row_len, w[10], w[11], w[12]]
    for col in [*range(0, lo2, strip_x), *range(hi2, row_len, strip_x)]:
        kind, base, lstr, st0, st1 = ptab[5 * (pbase + seg2[col]): 5 * (pbase + seg2[col]) + 5]
        terms.append(col)
        if kind != 0:
            terms += [base + crd2[col], lstr, st0, st1]
    return pow2_divisor(*terms)


def _merged(v: tuple[int, int, int], trail: int) -> tuple[int, int, int]:
    return v[0], v[1], v[2] * trail


def _check_int32_rows(rows: int) -> None:
    """Refuse a staging of ``rows`` rows (LEAD times every staged extent but the last) past int32: both staging
    kernels index rows in int32, which would wrap and pass their masks."""
    if rows >= 2**31:
        raise UnsupportedError(f"{where('halo_stage')}: {rows} rows (LEAD times every staged extent but the last) "
                               "exceed 2^31 - 1")


def launch_stage(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, launch: StageLaunch) -> None:
    """One launch of ``launch`` (from :func:`stage_launch`) into ``out`` from ``a`` (the block) and ``b`` (the
    receive buffer)."""
    if launch.kernel is None:
        return
    # the words form where it fits this output: its element size, and a word-aligned address
    words = bool(launch.words) and out.element_size() in launch.words[0].sizes and not out.data_ptr() & 3
    bound = launch.bound.get((out.dtype, words))
    if bound is None:  # the first launch of this dtype: bind the grid, the tables and the constexprs once
        meta = launch.meta if launch.kernel is stage_kernel else dict(launch.meta, COMPUTE=compute_dtype(out.dtype))
        kernel = cached_launch(launch.kernel)
        if words:
            form, grid3, meta3 = launch.words
            size = out.element_size()
            bound = (cached_launch(_words.stage_words_kernel).bind(form.grids[size], form.args[size],
                                                            dict(PER_WORD=4 // size, GROUPS=form.groups,
                                                                 num_warps=STAGE_NUM_WARPS)),
                     *((kernel.bind(grid3, launch.args, meta3),) if grid3 is not None else ()))
        else:
            bound = (tuple(kernel.bind(grid, launch.args, dict(meta, PART=part)) for grid, part in launch.parts)
                     or (kernel.bind(launch.grid, launch.args, meta),))
        launch.bound[(out.dtype, words)] = bound
    for each in bound:
        each(out, a, b)


def shell(inner: Sequence[tuple[int, int]], full: Sequence[int]) -> list[tuple[tuple[int, int], ...]]:
    """Disjoint boxes covering ``full`` minus the box ``inner`` (at most two per axis).

    Axis a's two slabs span axis a outside ``inner``, the axes before a inside it and the
    axes after a in full, so the remote pass touches only the border: for a 512^2 block
    with 1-wide halos, 0.8% of the staged tensor instead of all of it.
    """
    out = []
    for a, n in enumerate(full):
        lo, hi = inner[a]
        pre = [inner[b] for b in range(a)]
        post = [(0, full[b]) for b in range(a + 1, len(full))]
        for span in ((0, lo), (hi, n)):
            if span[1] > span[0]:
                out.append(tuple(pre + [span] + post))
    return out

