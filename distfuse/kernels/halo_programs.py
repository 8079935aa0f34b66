"""The Triton programs of the fused halo convolution and their launch geometry.

Three programs serve the four ops of :mod:`distfuse.kernels.halo`: a lookup-table gather
(stage), a box gather (pack, and the send-back and self boxes of unstage) and a masked
gather-add (accumulate); buffers and tables are described there and in
:mod:`distfuse.kernels.halo_tables`.  Design decisions:

* **Stage copies the interior window and gathers the shell through lookup tables.**  The
  interior window (the block itself: 91% of the staged tensor for a 64^3 block at halo 1)
  is one strided ``copy_`` in :func:`~distfuse.kernels.halo.halo_stage`, several times
  faster than the table walk (five table loads and a 64-bit offset per element), which
  serves only the shell boxes around it (and the unstage's ``grad_x`` likewise).  The
  staged box is the Cartesian product of per-axis segments (``AxisGeometry.segments``), so
  one int32 table per axis gives each staged coordinate its segment and its coordinate in
  the segment's source box (reversed for reflect, 0 for replicate), and a small piece
  table indexed by the segment combination gives the source.  Tiles are ``[BLOCK_R rows,
  BLOCK_X]`` over ``[LEAD*L0*L1, L2]``: the row is decomposed once per row, not per
  element (three runtime int divisions per element would make the kernel ALU-bound), and a
  tile crosses the halo / interior boundary freely.
  ``region="local"`` (the pieces that need no message) and ``"remote"`` (the received ones)
  visit only the shell of sub-boxes around the interior window (0.8% of a 512^2 block's
  staged tensor at halo 1), for the overlap.
* **Pack and the unstage boxes are one box gather** over the boxes laid end to end: an
  element finds its box by a branchless binary search of the box starts, then its
  coordinates by div/mod (affordable: these move halo volume only).  Any mix of box sizes
  shares programs, none idles, and the interpreter runs one program instead of one per box.
* **Replicate sums are a gather, not atomics.**  A send-back box element is the sum of
  the staged gradient over the replicated run (a loop of ``R`` loads in fp32), so every
  output element is written by exactly one program: deterministic, no fp32 atomics
  (unsupported for bf16 in the interpreter, and order-dependent on GPUs).
* **Accumulate is a gather with per-axis bitmasks.**  Boxes that add into ``grad_x``
  (self pieces and received halo gradients) may overlap (replicate, circular on one
  worker, halos wider than a block).  One int64 table per axis marks which of up to 62
  boxes cover each coordinate; an element's boxes are the AND of its three masks, and a
  tile covered by none stops after its mask loads.  More than 62 boxes (rare: 3-D halos
  wider than several blocks) take one more in-place launch per 62, with one extra
  rounding for fp16/bf16.
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

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from distfuse.errors import UnsupportedError, where
from distfuse.kernels._utils import round_bf16
from distfuse.kernels.halo_tables import contiguous_strides
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import cast_out

__all__ = ["piece_value", "lut_gather_kernel", "box_gather_kernel", "accumulate_kernel", "launch_lut", "launch_boxes",
           "shell", "compute_dtype", "pick_tile", "row_tiled_grid", "linear_grid", "box_block", "REGION_CODE"]

REGION_CODE = {"all": 0, "local": 1, "remote": 2}


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _or(a, b):
    return a | b


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
def lut_gather_kernel(out_ptr, a_ptr, b_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                       n_rows, E0, E1, E2, NS1, NS2, out_ls, out_s0, out_s1,
                       REGION: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """out[l, e0, e1, e2] = source(piece(seg0[e0], seg1[e1], seg2[e2]))[l, crd0[e0], crd1[e1], crd2[e2]].

    ``[LEAD, E0, E1, E2]`` is the whole output or a sub-box of it (strides ``out_ls``,
    ``out_s0``, ``out_s1``, 1; the LUT pointers start at the sub-box).  Piece kinds:
    0 zero, 1 ``a_ptr``, 2 ``b_ptr``.  REGION 1 writes kinds 0 and 1 only, REGION 2
    kind 2 only, 0 everything.  Tiles ``[BLOCK_R, BLOCK_X]`` over ``[n_rows, E2]``, one per program.
    """
    rows, cols, rmask, cmask, e0, e1, lead = _row_tile(n_rows, E0, E1, E2, BLOCK_R, BLOCK_X)
    s0 = tl.load(seg0_ptr + e0, mask=rmask, other=0)
    c0 = tl.load(crd0_ptr + e0, mask=rmask, other=0).to(tl.int64)
    s1 = tl.load(seg1_ptr + e1, mask=rmask, other=0)
    c1 = tl.load(crd1_ptr + e1, mask=rmask, other=0).to(tl.int64)
    s2 = tl.load(seg2_ptr + cols, mask=cmask, other=0)
    c2 = tl.load(crd2_ptr + cols, mask=cmask, other=0).to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    prow = ((s0 * NS1 + s1)[:, None] * NS2 + s2[None, :]) * 5
    kind, val = piece_value(a_ptr, b_ptr, ptab_ptr, prow, lead[:, None], c0[:, None], c1[:, None], c2[None, :], mask,
                            COMPUTE)
    if REGION == 1:
        mask = mask & (kind != 2)
    if REGION == 2:
        mask = mask & (kind == 2)
    out_off = (lead * out_ls + e0.to(tl.int64) * out_s0 + e1.to(tl.int64) * out_s1)[:, None] + cols[None, :]
    tl.store(out_ptr + out_off, val.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def box_gather_kernel(out0_ptr, out1_ptr, src_ptr, btab_ptr, bstart_ptr, nbox, total, RTMAX,
                       LEAD, src_ls, src_s0, src_s1, src_s2,
                       LOG2_NBOX: tl.constexpr, COMPUTE: tl.constexpr, ROUND_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Boxes laid end to end (box k from ``bstart[k]``); box k is flat ``[LEAD, E0, E1, E2]`` at ``out{SEL}[DST:]``:

    element ``(l, c)`` = ``sum_{r < R} src[l, T + D*c + r]`` per axis (D = +1 copy, -1
    reversed, 0 with R > 1: the replicate adjoint's sum).  Programs tile the
    concatenation, so boxes of any size share programs and none idles.  ``RTMAX`` is
    the largest ``R0 * R1 * R2`` (``RT``) of any box: 1 unless a replicate box is summed.

    The run loop is a ``while`` (see the module doc).  With RTMAX = 1 (every pack) there is
    no loop: Triton specialises an integer argument equal to 1 to a constant, the guard
    folds away, and Triton 3.6's coalesce pass, which crashes on a ``while`` whose condition
    is constant-false, never sees one.
    """
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)  # linear, as _row_tile
    e = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = e < total
    # box of each element: the last k with bstart[k] <= e (branchless binary search, bstart[0] == 0)
    box = tl.zeros([BLOCK], dtype=tl.int32)
    for b in tl.static_range(LOG2_NBOX):
        cand = box + (1 << (LOG2_NBOX - 1 - b))
        ok = cand < nbox
        start = tl.load(bstart_ptr + cand, mask=m & ok, other=total)
        box = tl.where(ok & (start <= e), cand, box)
    row = btab_ptr + box * 15
    sel = tl.load(row, mask=m, other=0)
    dst = tl.load(row + 1, mask=m, other=0)
    E0 = tl.load(row + 2, mask=m, other=1)
    E1 = tl.load(row + 3, mask=m, other=1)
    E2 = tl.load(row + 4, mask=m, other=1)
    T0 = tl.load(row + 5, mask=m, other=0)
    T1 = tl.load(row + 6, mask=m, other=0)
    T2 = tl.load(row + 7, mask=m, other=0)
    D0 = tl.load(row + 8, mask=m, other=0)
    D1 = tl.load(row + 9, mask=m, other=0)
    D2 = tl.load(row + 10, mask=m, other=0)
    R1 = tl.load(row + 12, mask=m, other=1)
    R2 = tl.load(row + 13, mask=m, other=1)
    RT = tl.load(row + 14, mask=m, other=1)
    local = e - tl.load(bstart_ptr + box, mask=m, other=0)
    c2 = local % E2
    q = local // E2
    c1 = q % E1
    q = q // E1
    c0 = q % E0
    lead = q // E0
    off = lead * src_ls + (T0 + D0 * c0) * src_s0 + (T1 + D1 * c1) * src_s1 + (T2 + D2 * c2) * src_s2
    acc = tl.load(src_ptr + off, mask=m, other=0.0).to(COMPUTE)  # r = 0 peeled: a plain copy stays bit-exact
    if RTMAX > 1:  # RTMAX == 1 (specialised to a constant by Triton): no loop is emitted at all
        r = tl.full([], 1, tl.int32)  # typed: a loop-carried counter must keep one type when compiled
        while r < RTMAX:
            r2 = r % R2
            rq = r // R2
            r1 = rq % R1
            r0 = rq // R1
            acc += tl.load(src_ptr + off + r0 * src_s0 + r1 * src_s1 + r2 * src_s2, mask=m & (r < RT),
                           other=0.0).to(COMPUTE)
            r += 1
    # out0 has the source's dtype: a bf16 sum is rounded to nearest even (cast_out; the interpreter's own
    # conversion truncates); out1 is the fp32/fp64 self-box buffer.
    tl.store(out0_ptr + dst + local, cast_out(acc, out0_ptr.dtype.element_ty, ROUND_BF16), mask=m & (sel == 0))
    tl.store(out1_ptr + dst + local, acc.to(out1_ptr.dtype.element_ty), mask=m & (sel == 1))


@triton.jit
def accumulate_kernel(gx_ptr, self_ptr, recv_ptr, m0_ptr, m1_ptr, m2_ptr, atab_ptr, nbox,
                       n_rows, E0, E1, E2,
                       COMPUTE: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_X: tl.constexpr):
    """gx[l, p] += sum over boxes k covering p of box_k[l, p - lo_k], in place; untouched tiles are skipped.

    Box k (table row k): SEL 0 reads ``self_ptr``, 1 ``recv_ptr``; ``[LEAD, S0, S1, S2]``
    contiguous at BASE, covering ``[LO, LO + S)`` of the block.  Bit k of ``m_a[p]`` says
    whether box k covers coordinate p of axis a.  Tiles as in :func:`lut_gather_kernel`; the box
    loop is a ``while`` (see the module doc).
    """
    rows, cols, rmask, cmask, e0, e1, lead = _row_tile(n_rows, E0, E1, E2, BLOCK_R, BLOCK_X)
    mrow = tl.load(m0_ptr + e0, mask=rmask, other=0) & tl.load(m1_ptr + e1, mask=rmask, other=0)
    mcol = tl.load(m2_ptr + cols, mask=cmask, other=0)
    cover = mrow[:, None] & mcol[None, :]
    if tl.max(tl.max(cover, axis=1), axis=0) > 0:
        tile_boxes = tl.reduce(mrow, 0, _or) & tl.reduce(mcol, 0, _or)
        mask = rmask[:, None] & cmask[None, :]
        out_off = rows.to(tl.int64)[:, None] * E2 + cols[None, :]
        acc = tl.load(gx_ptr + out_off, mask=mask, other=0.0).to(COMPUTE)
        k = tl.full([], 0, tl.int32)
        while k < nbox:
            if ((tile_boxes >> k) & 1) != 0:
                hit = mask & (((cover >> k) & 1) != 0)
                row = atab_ptr + k * 8
                sel = tl.load(row)
                base = tl.load(row + 1)
                lo0 = tl.load(row + 2)
                lo1 = tl.load(row + 3)
                lo2 = tl.load(row + 4)
                S0 = tl.load(row + 5)
                S1 = tl.load(row + 6)
                S2 = tl.load(row + 7)
                roff = base + lead * (S0 * S1 * S2) + (e0 - lo0) * (S1 * S2) + (e1 - lo1) * S2
                off = roff[:, None] + (cols - lo2)[None, :]
                if sel == 0:
                    acc += tl.load(self_ptr + off, mask=hit, other=0.0).to(COMPUTE)
                else:
                    acc += tl.load(recv_ptr + off, mask=hit, other=0.0).to(COMPUTE)
            k += 1
        tl.store(gx_ptr + out_off, cast_out(acc, gx_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


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


def launch_lut(out, a, b, luts, ptab, ns, region_code: int, extents3, tile, box=None):
    """Launch the LUT gather over ``out`` (``[LEAD, *extents3]``, contiguous) or over its sub-box ``box``
    (per axis ``(start, stop)``)."""
    if out.numel() == 0:
        return
    full = tuple(extents3)
    lead = out.numel() // math.prod(full)
    st = contiguous_strides(full)
    if box is None:
        box = tuple((0, e) for e in full)
    E0, E1, E2 = (hi - lo for lo, hi in box)
    if min(E0, E1, E2) <= 0:
        return
    n_rows = lead * E0 * E1
    base = sum(lo * s for (lo, _), s in zip(box, st, strict=True))
    luts = [t[lo:] for (lo, _), pair in zip(box, zip(luts[::2], luts[1::2], strict=True), strict=True) for t in pair]
    block_r, block_x = pick_tile(E2, n_rows, out.device, tile)
    grid = row_tiled_grid(n_rows, E2, block_r, block_x)
    lut_gather_kernel[grid](out.view(-1)[base:], a, b, *luts, ptab, n_rows, E0, E1, E2, ns[1], ns[2],
                             math.prod(full), st[0], st[1],
                             REGION=region_code, COMPUTE=compute_dtype(out.dtype), BLOCK_R=block_r, BLOCK_X=block_x)


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


def launch_boxes(out0, out1, src, tables, lead, src_shape3, block):
    btab, bstart, nbox, total, rtmax = tables
    if total == 0:
        return
    block = box_block(src.device, block, total)
    st = contiguous_strides(src_shape3)
    box_gather_kernel[linear_grid(cdiv(total, block))](
        out0, out1, src, btab, bstart, nbox, total, rtmax, lead, math.prod(src_shape3), *st,
        LOG2_NBOX=max(1, (nbox - 1).bit_length()), COMPUTE=compute_dtype(src.dtype),
        ROUND_BF16=round_bf16(out0.dtype), BLOCK=block, num_warps=BOX_NUM_WARPS)


