"""The NCHW staged layout written by the simplest kernel: what the layout itself costs, for the diagnosis.

    x       [lead, n0, n1, n2]           contiguous (NCHW: lead = B * C; 2-D as n0 = 1, h0 = 0)
    out     [lead, L0, L1, L2]           contiguous, L_i = n_i + 2 h_i
    rows    out[..., i0, i1, :] = x[..., i0 - h0, i1 - h1, i2 - h2] inside the window, 0 outside   (zero padding)
    window  out[..., i0, i1, h2:h2 + n2] only, the window's rows: the row's border columns left as they were

The staged tensor of an NCHW block holds rows of ``n2 + 2 h2`` elements (66 at n = 64, 132 bytes), so the
window's rows start at an odd element offset and end mid-sector.  On the H200 the 3-D NCHW staging stays at
0.57-0.65 of a copy of the staged bytes, where channels last, whose rows are whole multiples of 16 bytes,
reaches 0.91-0.99 (``docs/gpu.md``).  Its one-launch form already writes whole rows per window program at
n = 64 (one column tile per row, the columns beside the window included), so three causes remain:

* the layout: one-element stores from odd offsets cost any kernel this much;
* the store width alone: two elements per store would do;
* the staging kernel's own work (its tables, the dependent loads before a program's first store).

And for the forms that write the window and its border apart (the split launch, the overlap's two passes),
a fourth: a 32-byte sector written in two halves, far apart in time, reaches HBM3e twice, or costs it a
read-modify-write under ECC.

This kernel tells them apart with no tables at all, on one tile shape ``[BLOCK_R, BLOCK_X]`` (a program writes
``BLOCK_R`` consecutive staged rows):

* ``FACES=True`` (``rows``): every element of the rows, the window's values and the zero border, one 16-bit
  element per store, as the staging stores;
* ``PAIRED`` (``rows, paired``): the same whole rows, two elements per store instruction;
* ``FACES=False`` (``window``): the window alone (the block's bytes), so the window rows' end sectors are
  written partly, as a window pass leaves them.

And a second kernel, :func:`words_probe` (``flat words``), writes the same whole rows as the staged tensor's flat
32-bit words, ``BLOCK`` consecutive words a program, so every store is a 16-byte vector at an aligned address, as
a copy's are: a word whose two 16-bit elements straddle two words of the block (an odd halo) is put together from
both by shifts (or, ``gather``, from two 16-bit loads, packed: the form a staging that takes each element from
its own source would have).  The one-element stores move to the loads, which the L1 serves.  If it reaches the
copy where the row forms do not, the layout is not the floor: a staging whose window programs write flat words
is.

Each is read against a copy of the bytes it writes: ``rows`` against the staged tensor's, ``window`` against
the block's.  If ``rows`` reaches its copy, the layout is not the floor and the staging's own work is the gap
(its window programs should come down to this kernel's form); if only ``rows, paired`` does, the store width
is; if neither, the layout costs any kernel of this form.  ``window`` well under ``rows`` (per byte) puts a
price on the sectors written in halves.  ``scripts/gpu_diagnose.py`` (section ``halo_tiles``, rows ``rows
probe``) times the three beside the copies and the staging.

Not part of the package: a measuring stick (zero padding only, no exchange, no adjoint).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rows_probe", "words_probe", "probe_reference"]


@triton.jit
def _source_row(r, L0, L1, n0, n1, NW, h0, h1):
    """Staged row ``r`` (``(lead, i0, i1)`` of ``[LEAD, L0, L1]``): ``(the start of its block row, in units of
    which the block's rows hold NW, and whether it crosses the window)``."""
    i1 = r % L1
    q = r // L1
    i0 = q % L0
    lead = q // L0
    j0 = i0 - h0
    j1 = i1 - h1
    inside = (j0 >= 0) & (j0 < n0) & (j1 >= 0) & (j1 < n1)
    return ((lead * n0 + j0) * n1 + j1) * NW, inside


@triton.jit
def _rows_probe_kernel(x_ptr, out_ptr, n_rows, L0, L1, n0, n1, h0, h1, row_len, L2: tl.constexpr,
                       N2: tl.constexpr, H2: tl.constexpr, FACES: tl.constexpr, PAIRED: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """Program ``pid`` writes staged rows ``[pid * BLOCK_R, (pid + 1) * BLOCK_R)``, each ``L2`` elements long.

    int32 offsets (the probe's tensors hold fewer than 2^31 elements).  ``row_len`` (``L2`` as a run-time
    value) bounds the whole rows' mask, so both forms store one element per instruction, as the staging's
    window programs do; ``PAIRED`` bounds it by the constant ``L2`` instead, which lets the compiler store
    two 16-bit elements per instruction (``L2`` even: every row starts at an even element)."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # flat row of out: (lead, i0, i1)
    src_row, inside = _source_row(r, L0, L1, n0, n1, N2, h0, h1)
    row_in = (r < n_rows) & inside  # the row crosses the window
    c = tl.arange(0, BLOCK_X)
    j2 = c - H2
    in_x = (j2 >= 0) & (j2 < N2)
    if FACES:  # whole rows
        mask = (r < n_rows)[:, None] & ((c < L2) if PAIRED else (c < row_len))[None, :]
    else:  # the window alone: its rows' middle columns
        mask = row_in[:, None] & in_x[None, :]
    vals = tl.load(x_ptr + src_row[:, None] + j2[None, :], mask=row_in[:, None] & in_x[None, :], other=0.0)
    tl.store(out_ptr + r[:, None] * L2 + c[None, :], vals, mask=mask)


@triton.jit
def _words_probe_kernel(xw_ptr, x_ptr, ow_ptr, n_words, L0: tl.constexpr, L1: tl.constexpr, W2: tl.constexpr,
                        n0: tl.constexpr, n1: tl.constexpr, NW: tl.constexpr, h0: tl.constexpr, h1: tl.constexpr,
                        SHIFT: tl.constexpr, ODD: tl.constexpr, GATHER: tl.constexpr, H2: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program ``pid`` writes words ``[pid * BLOCK, (pid + 1) * BLOCK)`` of the staged tensor, ``W2`` words a row,
    read from the block's ``NW`` words a row (int32 views of both; every row starts at a whole word).

    Staged word ``k`` of a window row holds the row's source words from ``k - SHIFT``; with ``ODD`` (16-bit
    elements, odd halo) its two elements are the high half of source word ``m - 1`` and the low half of word
    ``m = k - SHIFT`` (little-endian), each zero past the block's row.  ``GATHER`` (16-bit elements): each of
    the word's two elements loaded on its own from ``x_ptr`` (the block, halo ``H2`` on the last axis) and the
    two packed, as a staging that takes each element from its own source (window, border column) would.

    Words go four at a time (one 16-byte store a thread), and a group's rows are decoded once: its first word's
    row and the next (``W2 >= 4``, so a group spans two rows at most), each word taking one of the two.  Per word
    that leaves the two loads, the shifts and the masks (compiled for sm_90: 12 instructions an element, where a
    decode per word took 22).  int32 offsets, and the staged geometry constant, so the decodes are
    multiply-shifts."""
    G: tl.constexpr = BLOCK // 4
    g = tl.program_id(0) * G + tl.arange(0, G)
    f0 = g * 4
    r0 = f0 // W2
    k0 = f0 - r0 * W2
    src0, in0 = _source_row(r0, L0, L1, n0, n1, NW, h0, h1)
    src1, in1 = _source_row(r0 + 1, L0, L1, n0, n1, NW, h0, h1)
    f = f0[:, None] + tl.arange(0, 4)[None, :]
    k = k0[:, None] + tl.arange(0, 4)[None, :]
    carry = k >= W2  # the word is in the group's second row
    k = tl.where(carry, k - W2, k)
    src = tl.where(carry, src1[:, None], src0[:, None])
    row_in = tl.where(carry, in1[:, None], in0[:, None]) & (f < n_words)
    if GATHER:
        c = 2 * k - H2  # the word's first element's column in the block's row
        e0 = tl.load(x_ptr + 2 * src + c, mask=row_in & (c >= 0) & (c < 2 * NW), other=0.0)
        e1 = tl.load(x_ptr + 2 * src + c + 1, mask=row_in & (c + 1 >= 0) & (c + 1 < 2 * NW), other=0.0)
        word = (e0.to(tl.uint16, bitcast=True).to(tl.uint32)
                | (e1.to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
    else:
        m = k - SHIFT
        hi = tl.load(xw_ptr + src + m, mask=row_in & (m >= 0) & (m < NW), other=0).to(tl.uint32, bitcast=True)
        if ODD:
            lo = tl.load(xw_ptr + src + m - 1, mask=row_in & (m >= 1) & (m <= NW), other=0).to(tl.uint32,
                                                                                                bitcast=True)
            word = (lo >> 16) | (hi << 16)
        else:
            word = hi
    tl.store(ow_ptr + f, word.to(tl.int32, bitcast=True), mask=f < n_words)


def _geometry(x: torch.Tensor, halo: int, nd: int):
    """``(lead, n0, n1, n2, h0, h1)`` of an NCHW block ``x [B, C, *n]`` with ``nd`` spatial axes (2 or 3)."""
    if nd not in (2, 3) or x.dim() != nd + 2:
        raise ValueError(f"rows_probe: x must be [B, C, *n] with 2 or 3 spatial axes, got {tuple(x.shape)}")
    lead = x.shape[0] * x.shape[1]
    if nd == 2:
        return lead, 1, x.shape[2], x.shape[3], 0, halo
    return lead, x.shape[2], x.shape[3], x.shape[4], halo, halo


def _staged_geometry(name: str, x: torch.Tensor, out: torch.Tensor, halo: int) -> tuple[int, ...]:
    """``(lead, n0, n1, n2, h0, h1, L0, L1, L2)`` of the block ``x`` and its staged tensor ``out``, checked: ``out``
    contiguous, of ``x``'s dtype and the staged shape, with int32 offsets."""
    nd = x.dim() - 2
    lead, n0, n1, n2, h0, h1 = _geometry(x, halo, nd)
    L0, L1, L2 = n0 + 2 * h0, n1 + 2 * h1, n2 + 2 * halo
    want = (x.shape[0], x.shape[1], *([L0] if nd == 3 else []), L1, L2)
    if tuple(out.shape) != want or not (x.is_contiguous() and out.is_contiguous()) or out.dtype != x.dtype:
        raise ValueError(f"{name}: out must be a contiguous {want} tensor of {x.dtype}, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    if out.numel() >= 2**31:
        raise ValueError(f"{name}: int32 offsets: out holds {out.numel()} elements, at most 2**31 - 1")
    return lead, n0, n1, n2, h0, h1, L0, L1, L2


def rows_probe(x: torch.Tensor, out: torch.Tensor, halo: int, *, faces: bool, paired: bool = False,
               elems: int = 4096) -> torch.Tensor:
    """Write ``x [B, C, *n]`` (NCHW, contiguous) into ``out [B, C, *(n + 2 halo)]`` by whole staged rows
    (``faces``: with the zero border) or by the window's columns alone (the border untouched); returns ``out``.
    ``paired``: whole rows stored two elements per instruction where the compiler can (see the kernel).

    ``elems``: lanes of a program's tile, ``BLOCK_R`` rows of ``BLOCK_X`` (the row's length rounded up to a
    power of two) columns: 32 rows of 128 at n = 64 (66 used), 4 of 1024 at n = 512 (514 used)."""
    lead, n0, n1, n2, h0, h1, L0, L1, L2 = _staged_geometry("rows_probe", x, out, halo)
    n_rows = lead * L0 * L1
    block_x = triton.next_power_of_2(L2)
    block_r = max(1, elems // block_x)
    grid = (triton.cdiv(n_rows, block_r),)
    _rows_probe_kernel[grid](x, out, n_rows, L0, L1, n0, n1, h0, h1, L2, L2=L2, N2=n2, H2=halo, FACES=faces,
                             PAIRED=paired and faces, BLOCK_R=block_r, BLOCK_X=block_x, num_warps=4)
    return out


def words_probe(x: torch.Tensor, out: torch.Tensor, halo: int, *, gather: bool = False,
                elems: int = 2048) -> torch.Tensor:
    """Write ``x [B, C, *n]`` (NCHW, contiguous, 16- or 32-bit elements, ``n`` last even for 16-bit ones) into
    ``out [B, C, *(n + 2 halo)]`` with the zero border, as flat 32-bit words (:func:`_words_probe_kernel`);
    returns ``out``.  ``gather``: 16-bit elements loaded one by one and packed in pairs, not loaded as words and
    shifted (32-bit elements are words either way).  ``elems``: elements a program writes (its words, ``elems *
    element_size / 4``, a power of two)."""
    lead, n0, n1, n2, h0, h1, L0, L1, L2 = _staged_geometry("words_probe", x, out, halo)
    per_word = 4 // x.element_size() if x.element_size() in (2, 4) else 0
    if not per_word or n2 % per_word or L2 < 4 * per_word:
        raise ValueError(f"words_probe: 16-bit elements in rows of an even length, or 32-bit ones, staged rows of "
                         f"4 words or more; got {x.dtype} rows of {n2}, staged {L2}")
    n_words = out.numel() // per_word
    block = max(4, triton.next_power_of_2(max(1, elems // per_word)))
    _words_probe_kernel[(triton.cdiv(n_words, block),)](
        x.view(torch.int32), x, out.view(torch.int32), n_words, L0=L0, L1=L1, W2=L2 // per_word, n0=n0, n1=n1,
        NW=n2 // per_word, h0=h0, h1=h1, SHIFT=halo // per_word, ODD=bool(halo % per_word),
        GATHER=gather and per_word == 2, H2=halo, BLOCK=block, num_warps=4)
    return out


def probe_reference(x: torch.Tensor, halo: int) -> torch.Tensor:
    """The zero-padded staged tensor, by torch (``F.pad`` of every spatial axis by ``halo``)."""
    return torch.nn.functional.pad(x, (halo,) * (2 * (x.dim() - 2)))
