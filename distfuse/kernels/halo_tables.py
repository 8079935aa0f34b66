"""Host side of the halo kernels: buffer layouts, lookup and box tables, buffer checks.

The kernels of :mod:`distfuse.kernels.halo` (and :mod:`distfuse.kernels.conv_implicit`,
which reads the stage tables) take their geometry from small int32/int64 tables that this
module builds from a :class:`~distfuse.geometry.halo_plan.HaloPlan` on the host, once per
``(plan, index, lead, device)`` (cached: a few KB per worker, one synchronous
host-to-device copy the first time only).  Why lookup tables, box gathers and covered
cells: :mod:`distfuse.kernels.halo_programs`; the flat buffers' layout (:func:`box_offsets`):
:mod:`distfuse.kernels.halo`.

Table layouts (the kernels hard-code the row widths 15, 10 and 5):

=====================  ======  ==============================================================
table                  width   row
=====================  ======  ==============================================================
piece (stage)          5       KIND (0 zero, 1 x, 2 receive buffer), BASE, LEAD_STRIDE, STRIDE0,
                               STRIDE1 (the innermost stride is 1)
box (pack, unstage)    15      SEL, DST, E0, E1, E2, T0, T1, T2, D0, D1, D2, R0, R1, R2, RT
accumulate cell        10      START, O0, O1, O2, W0, W1, W2, LSTART, LCOUNT, 0
accumulate box         5       SEL, ORIGIN, VOLUME, STRIDE0, STRIDE1
=====================  ======  ==============================================================
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan, Piece

__all__ = ["SUPPORTED_DTYPES", "pad3", "contiguous_strides", "box_offsets", "interior_piece",
           "self_pieces", "send_numel", "recv_numel", "self_numel", "stage_tables", "pack_tables", "unstage_box_tables",
           "accumulate_boxes", "accumulate_cells", "accumulate_tables", "plan_tensor_lead", "check_plan_layout",
           "check_flat", "axis_luts", "trail_luts", "merged_shape", "piece_rows", "stage_table_lists",
           "table_tensors"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_BOX_COLS = 15  # the box table's row width (see the module docstring; the kernels hard-code it)


# ------------------------------------ layouts (pure Python, shared by the launchers, the references and the fused op)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Contiguous strides of ``shape``."""
    return tuple(math.prod(shape[a + 1:]) for a in range(len(shape)))


def pad3(values: Sequence[int], fill: int) -> tuple[int, ...]:
    """``values`` padded on the left with ``fill`` to 3 entries (the kernels see every problem as 3-D)."""
    return (fill,) * (3 - len(values)) + tuple(values)


def box_offsets(shapes: Sequence[Sequence[int]], lead: int) -> tuple[list[int], int]:
    """Flat offsets of boxes ``[lead, *shape]`` laid out one after another, and the total size."""
    ends = list(itertools.accumulate((lead * math.prod(s) for s in shapes), initial=0))
    return ends[:-1], ends[-1]


def _is_identity(plan: HaloPlan, index: tuple[int, ...], pc: Piece) -> bool:
    """The piece reads this worker's own block at the staged position's own global coordinates."""
    if pc.src != index:
        return False
    for ax, i, dst, src, step in zip(plan.axes, index, pc.dst_lo, pc.src_lo, pc.steps, strict=True):
        if step != 1 or ax.needed_range(i)[0] + dst != ax.input_range(i)[0] + src:
            return False
    return True


@functools.cache
def _local_split(plan: HaloPlan, index: tuple[int, ...]) -> tuple[Piece | None, tuple[Piece, ...]]:
    interior, rest = None, []
    for pc in plan.local_pieces(index):
        if interior is None and _is_identity(plan, index, pc):
            interior = pc
        else:
            rest.append(pc)
    return interior, tuple(rest)


def interior_piece(plan: HaloPlan, index: tuple[int, ...]) -> Piece | None:
    """The local piece that is a plain window of the own block (its gradient is a copy), or None."""
    return _local_split(plan, tuple(index))[0]


def self_pieces(plan: HaloPlan, index: tuple[int, ...]) -> tuple[Piece, ...]:
    """Local pieces other than the interior (reflect/replicate edges, circular self-wraps), in piece order."""
    return _local_split(plan, tuple(index))[1]


def send_numel(plan: HaloPlan, index: tuple[int, ...], lead: int) -> int:
    return box_offsets([pc.src_shape for _, pc in plan.sends(tuple(index))], lead)[1]


def recv_numel(plan: HaloPlan, index: tuple[int, ...], lead: int) -> int:
    return box_offsets([pc.src_shape for pc in plan.recvs(tuple(index))], lead)[1]


def self_numel(plan: HaloPlan, index: tuple[int, ...], lead: int) -> int:
    return box_offsets([pc.src_shape for pc in self_pieces(plan, tuple(index))], lead)[1]


# ---------------------------------------------------------------- tables (cached per (plan, index, lead, device))


def _i64(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=512)
def axis_luts(ax, i: int) -> tuple[list[int], list[int]]:
    """``(segment, coordinate)`` of every staged position of axis ``ax`` at worker coordinate ``i``: the segment's
    index and the coordinate in its source box (0 for zero fill and replicate, reversed for reflect)."""
    seg_id, crd = [], []
    for s, sg in enumerate(ax.segments(i)):
        seg_id += [s] * sg.length
        crd += [0 if sg.src is None or sg.step == 0 else t if sg.step == 1 else sg.extent - 1 - t
                for t in range(sg.length)]
    return seg_id, crd


def trail_luts(seg_id: Sequence[int], crd: Sequence[int], trail: int) -> tuple[list[int], list[int]]:
    """The last axis's LUTs over its staged positions merged with a trailing axis of ``trail`` (channels last):
    merged position ``e * trail + c`` has ``e``'s segment and the merged coordinate ``crd[e] * trail + c``, so a
    reversed (reflect) or repeated (replicate) position moves its whole channel vector."""
    if trail == 1:
        return list(seg_id), list(crd)
    return ([s for s in seg_id for _ in range(trail)],
            [k * trail + c for k in crd for c in range(trail)])


def merged_shape(shape: Sequence[int], trail: int) -> tuple[int, ...]:
    """``shape`` (1-3 spatial extents) padded to 3, its last extent times ``trail``: the rows the staging kernels
    see when every spatial position holds a contiguous vector of ``trail`` channels (channels last)."""
    s = pad3(shape, 1)
    return s[0], s[1], s[2] * trail


def piece_rows(plan: HaloPlan, index: tuple[int, ...], lead: int, trail: int = 1) -> list[int]:
    """The piece table of :func:`stage_tables` as a host list: five entries per piece of ``plan.pieces(index)``,
    KIND, BASE, LEAD_STRIDE, STRIDE0, STRIDE1 (elements of the merged layout ``[lead, s0, s1, s2 * trail]``)."""
    x_shape = merged_shape(plan.input_shape(index), trail)
    x_str = contiguous_strides(x_shape)
    recv_offs, _ = box_offsets([pc.src_shape for pc in plan.recvs(index)], lead * trail)
    rows, k = [], 0  # one piece-table row (5 entries) per piece
    for pc in plan.pieces(index):
        if pc.src is None:
            rows += [0, 0, 0, 0, 0]
        elif pc.src == index:
            src_lo = pad3(pc.src_lo, 0)
            base = sum(lo * st for lo, st in zip(src_lo[:2], x_str[:2], strict=True)) + src_lo[2] * trail
            rows += [1, base, math.prod(x_shape), x_str[0], x_str[1]]
        else:
            src = merged_shape(pc.src_shape, trail)
            st = contiguous_strides(src)
            rows += [2, recv_offs[k], math.prod(src), st[0], st[1]]
            k += 1
    return rows


def stage_table_lists(plan: HaloPlan, index: tuple[int, ...], lead: int, trail: int = 1):
    """The host lists behind :func:`stage_tables`: the per-axis (segment, coordinate) LUTs padded to three axes
    (the last merged with ``trail`` channels, :func:`trail_luts`), the piece rows (:func:`piece_rows`) and the
    segment count of each axis."""
    luts = [axis_luts(ax, i) for ax, i in zip(plan.axes, index, strict=True)]
    luts[-1] = trail_luts(*luts[-1], trail)
    luts = [([0], [0])] * (3 - len(luts)) + luts
    ns = [max(seg_id) + 1 if seg_id else 1 for seg_id, _ in luts]
    return luts, piece_rows(plan, index, lead, trail), ns


def table_tensors(luts, rows: list[int], device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`stage_table_lists`' LUTs (int32, segment then coordinate per axis) and piece rows (int64) on
    ``device``."""
    return [torch.tensor(t, dtype=torch.int32, device=device) for pair in luts for t in pair], _i64(rows, device)


def stage_tables(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device, trail: int = 1):
    """Per-axis (segment, coordinate) LUTs over the staged extents, the piece table (:func:`piece_rows`) and the
    segment counts, on ``device``.

    ``trail`` > 1 (channels last: ``lead`` is the batch, ``trail`` the channels, innermost in memory): the last
    axis and its LUTs are merged with the channels (:func:`trail_luts`), and the piece table's bases and strides
    count elements of the merged layout ``[lead, s0, s1, s2 * trail]``.
    """
    luts, rows, ns = stage_table_lists(plan, index, lead, trail)
    return (*table_tensors(luts, rows, device), ns)


def _box_launch_tables(rows: list[int], numels: list[int]):
    """``(box rows, elements of each box, largest R)``: the launch lays out each box's programs and makes the tables
    on its device (:func:`~distfuse.kernels.halo_launches.box_launch`)."""
    rt = max((rows[k * _BOX_COLS + 14] for k in range(len(numels))), default=1)
    return tuple(rows), tuple(numels), rt


def _box_row(sel: int, dst: int, extents, starts, dirs, reps) -> list[int]:
    """One box-table row (``_BOX_COLS`` entries): every axis padded to 3 as the kernels see it."""
    r = pad3(reps, 1)
    return [sel, dst, *pad3(extents, 1), *pad3(starts, 0), *pad3(dirs, 0), *r, math.prod(r)]


@functools.lru_cache(maxsize=512)
def pack_tables(plan: HaloPlan, index: tuple[int, ...], lead: int):
    boxes = [pc for _, pc in plan.sends(index)]
    offs, _ = box_offsets([pc.src_shape for pc in boxes], lead)
    rows = []
    for pc, off in zip(boxes, offs, strict=True):
        rows += _box_row(0, off, pc.src_shape, pc.src_lo, (1,) * len(pc.src_lo), (1,) * len(pc.src_lo))
    return _box_launch_tables(rows, [lead * math.prod(pc.src_shape) for pc in boxes])


def _adjoint_axes(pc: Piece) -> tuple[list[int], list[int], list[int]]:
    """Per axis, where box coordinate c of the source box reads the staged gradient: ``T + D*c + r, r < R``."""
    starts, dirs, reps = [], [], []
    for dst, length, extent, step in zip(pc.dst_lo, pc.shape, pc.src_shape, pc.steps, strict=True):
        if step == 1:
            starts.append(dst), dirs.append(1), reps.append(1)
        elif step == -1:
            starts.append(dst + extent - 1), dirs.append(-1), reps.append(1)
        else:  # replicate: one source element read `length` times; its gradient is their sum
            starts.append(dst), dirs.append(0), reps.append(length)
    return starts, dirs, reps


@functools.lru_cache(maxsize=512)
def unstage_box_tables(plan: HaloPlan, index: tuple[int, ...], lead: int, region: str, window: bool = False):
    """Send-back boxes (SEL 0, ``recvs`` order) and/or self boxes (SEL 1, ``self_pieces`` order); with ``window``
    (region ``"all"`` or ``"local"``), then the interior piece's gradient as one more box (SEL 2, at 0 of
    ``grad_x``, which the window must cover whole)."""
    rows, numels = [], []
    for sel, part in ((0, "remote"), (1, "local")):
        if region not in ("all", part):
            continue
        pieces = plan.recvs(index) if sel == 0 else self_pieces(plan, index)
        offs, _ = box_offsets([pc.src_shape for pc in pieces], lead)
        for pc, off in zip(pieces, offs, strict=True):
            rows += _box_row(sel, off, pc.src_shape, *_adjoint_axes(pc))
            numels.append(lead * math.prod(pc.src_shape))
    if window and region in ("all", "local"):
        pc = interior_piece(plan, index)
        if pc is None or tuple(pc.src_shape) != tuple(plan.input_shape(index)):
            raise ValueError(f"unstage_box_tables: worker {index} has no interior window covering its block")
        rows += _box_row(2, 0, pc.src_shape, *_adjoint_axes(pc))
        numels.append(lead * math.prod(pc.src_shape))
    return _box_launch_tables(rows, numels)


def accumulate_boxes(plan: HaloPlan, index: tuple[int, ...], lead: int) -> list[tuple[int, int, Piece]]:
    """``(SEL, BASE, piece)`` of every non-empty box that adds into ``grad_x``, in summation order: the self boxes
    (SEL 0, :func:`self_pieces` order, at BASE in the self-box buffer), then the received halo gradients (SEL 1,
    ``plan.sends`` order, at BASE in the incoming buffer)."""
    boxes = []
    for sel, pieces in enumerate((self_pieces(plan, index), [pc for _, pc in plan.sends(index)])):
        offs, _ = box_offsets([pc.src_shape for pc in pieces], lead)
        boxes += [(sel, off, pc) for pc, off in zip(pieces, offs, strict=True) if math.prod(pc.src_shape) > 0]
    return boxes


def accumulate_cells(x_shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]):
    """Split the block into cells covered by a fixed set of boxes; return the covered ones.

    ``boxes``: ``(lo, shape)`` per box, in the block's coordinates.  Every box edge cuts its axis, so
    each cell of the product of the cut intervals lies inside or outside each box.  Returns
    ``(origin, extent, boxes)`` per cell that some box covers (3-D, padded on the left), the
    box indices in ascending order (the summation order).  The uncovered cells (the block's
    interior) are not returned: accumulate never touches them.
    """
    x3 = pad3(x_shape, 1)
    boxes3 = [(pad3(lo, 0), pad3(shape, 1)) for lo, shape in boxes]
    axes = []
    for a, n in enumerate(x3):
        cuts = sorted({0, n, *(c for lo, shape in boxes3 for c in (lo[a], lo[a] + shape[a]) if 0 < c < n)})
        axes.append([(lo, hi, sum(1 << k for k, (blo, bsh) in enumerate(boxes3)
                                  if blo[a] <= lo and hi <= blo[a] + bsh[a]))  # the boxes covering [lo, hi)
                     for lo, hi in zip(cuts, cuts[1:], strict=False)])
    cells = []
    for (l0, h0, m0), (l1, h1, m1), (l2, h2, m2) in itertools.product(*axes):
        cover = m0 & m1 & m2
        if cover:
            cells.append(((l0, l1, l2), (h0 - l0, h1 - l1, h2 - l2),
                          tuple(k for k in range(cover.bit_length()) if cover >> k & 1)))
    return cells


@functools.lru_cache(maxsize=512)
def accumulate_tables(plan: HaloPlan, index: tuple[int, ...], lead: int, device: torch.device):
    """``(cells, box list, box table)`` of one accumulate launch.

    ``cells``: per covered cell (:func:`accumulate_cells`), ``(O0, O1, O2, W0, W1, W2, LSTART, LCOUNT)``: its
    origin and extent in the block and its boxes, ``box list[LSTART:LSTART + LCOUNT]`` (the launch lays out the
    cells' programs: :func:`~distfuse.kernels.halo_launches.accumulate_launch`).  Box rows (width 5): SEL, ORIGIN,
    VOLUME, STRIDE0, STRIDE1: element ``(l, p)`` of the block (``l`` of LEAD, ``p`` a 3-D block coordinate) is at
    ``ORIGIN + l * VOLUME + p0 * STRIDE0 + p1 * STRIDE1 + p2`` of the SEL's buffer (ORIGIN = BASE minus the offset
    of the box's low corner, so it may be negative).
    """
    boxes = accumulate_boxes(plan, index, lead)
    cells, blist = [], []
    for origin, extent, ks in accumulate_cells(plan.input_shape(index), [(pc.src_lo, pc.src_shape)
                                                                         for _, _, pc in boxes]):
        cells.append((*origin, *extent, len(blist), len(ks)))
        blist += ks
    btab = []
    for sel, off, pc in boxes:  # box element (l, p) at ORIGIN + l * VOLUME + p . STRIDES (p: block coordinates)
        lo, shape = pad3(pc.src_lo, 0), pad3(pc.src_shape, 1)
        strides = contiguous_strides(shape)
        btab += [sel, off - sum(c * s for c, s in zip(lo, strides, strict=True)), math.prod(shape), *strides[:2]]
    return tuple(cells), _i64(blist or [0], device), _i64(btab or [0] * 5, device)


# ------------------------------------ buffer checks (shared by the halo launchers and kernels/conv_implicit.py)


def plan_tensor_lead(op: str, t: torch.Tensor, plan: HaloPlan, what: str) -> int:
    """LEAD (``prod(lead)``) of ``t`` ``[*lead, *spatial]``, after checking the plan's axis count and ``t``'s rank.

    The first half of a launcher's tensor check: its cached launch is keyed by LEAD and holds the spatial shape
    that :func:`check_plan_layout`, the second half, then checks, so a call pays one cache lookup.
    """
    nd = len(plan.axes)
    if nd not in (1, 2, 3):
        raise UnsupportedError(f"{where(op)}: 1, 2 or 3 spatial axes are supported, the plan has {nd}")
    if t.dim() < nd:
        raise expect(op, f"number of dimensions of {what} (at least the {nd} spatial ones)", f">= {nd}", t.dim())
    return math.prod(t.shape[: t.dim() - nd])


def check_plan_layout(op: str, t: torch.Tensor, want: tuple[int, ...], what: str,
                      memory_format: torch.memory_format = torch.contiguous_format) -> None:
    """The second half (after :func:`plan_tensor_lead`): ``t``'s trailing ``len(want)`` dims are ``want``, ``t`` is
    contiguous (in ``memory_format``) and of a supported dtype (``t`` has at least ``len(want)`` dims:
    :func:`plan_tensor_lead`)."""
    nd = len(want)
    if tuple(t.shape[t.dim() - nd:]) != tuple(want):
        raise expect(op, f"spatial shape of {what}", tuple(want), tuple(t.shape[t.dim() - nd:]))
    if not t.is_contiguous(memory_format=memory_format):
        raise ShapeError(f"{where(op)}: {what} must be contiguous"
                         + ("" if memory_format == torch.contiguous_format else f" in {memory_format}"))
    if t.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedError(f"{where(op)}: dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")


def check_flat(op: str, t: torch.Tensor, numel: int, dtype: torch.dtype, device, what: str) -> None:
    """Check that ``t`` is a flat, contiguous buffer of ``numel`` elements of ``dtype`` on ``device``."""
    if t.dim() != 1 or t.numel() != numel:
        raise expect(op, f"{what} (flat, boxes one after another)", f"1-D of {numel} elements",
                     f"shape {tuple(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise expect(op, f"{what} dtype/device", (dtype, device), (t.dtype, t.device))
    if not t.is_contiguous():
        raise ShapeError(f"{where(op)}: {what} must be contiguous")
