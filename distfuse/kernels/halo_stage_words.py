"""The staging's window rows as flat 32-bit words: every store a 16-byte vector, for NCHW blocks.

    out     [LEAD, L0, L1, L2]    the staged tensor (NCHW, contiguous, 16- or 32-bit elements), as int32 words
    x       [LEAD, n0, n1, n2]    the block (its window rows start where ``stage_launch``'s box table says)
    writes  every group of four consecutive words that holds a word of a window row (a staged row crossing the
            interior window): the window's elements from x, every other element of the group 0

Why.  An NCHW staged row of an odd halo starts at an odd element (rows of 66 bf16 elements at n = 64), so the
window's stores in ``stage_kernel`` are one element each, and the layout Triton gives one-element stores holds 16
rows of 2 elements a thread: every store recomputes its row.  Compiled for sm_90 (Triton 3.6) that is about 33
instructions an element, near the issue limit at the copy's rate on an H200 (about 34 an element: 128
thread-instructions a clock per SM against 3.8 elements a clock per SM at 4.0 TB/s), and the 3-D NCHW staging ran
at 0.57-0.65 of a copy of its bytes where channels last (16-byte rows) ran at 0.91-0.99.  Here a program writes
``GROUPS`` groups of four words of the staged tensor taken as one flat array, so each thread stores one aligned
16-byte vector a group (``st.global.v4.b32``), and a group's row is decoded once, with the next row for a group
that straddles two (rows hold at least four words); the elements are loaded one by one (16-bit loads, which the L1
serves) and packed in pairs.  Compiled for sm_90 under Triton 3.6 (bf16): 400 SASS instructions for 16 elements
a thread, the group the tensor's end cuts included (its word-by-word stores run in the last program only), and
32 registers (the compile audit; 30 in fp32).  The diagnosis's row probe (``bench/halo_rows_probe.py``, rows
``flat words, gathered``) times this form against the copy with no tables at all.

What else writes the groups.  The border's elements (the columns beside the window in its rows, and the elements
of slab rows in a group that straddles a window row and a slab row) are written as 0 here and rewritten by
``stage_kernel``'s ``PART`` 3 launch, which runs after this one on the same stream: the window's strips (the
region's pieces of the columns beside it, ``STRIP_R`` rows a program) and then the slabs.  In the overlap's
local pass, a remote element of such a group is left 0 until the remote pass writes it, which the layers run
next, on the same stream (``distfuse.fused.halo_conv``).  So a local pass on this path writes zeros into border
elements that are not its own; the pair of passes writes every element once with its value.

Its launch geometry is :func:`~distfuse.kernels.halo_programs.words_launch`'s.  Used where
:func:`~distfuse.kernels.halo_programs.stage_launch` takes the ``words`` form (:data:`STAGE_WORDS` on
GPUs, or forced): NCHW, a region that copies the window (``"all"``, ``"local"``), int32 offsets; and per launch
(:func:`~distfuse.kernels.halo_programs.launch_stage`) 16-bit elements in staged rows of an even length of 8 or
more, or 32-bit ones in rows of 4 or more, and an output at a 4-byte aligned address.  Elsewhere the
split launch's ``PART`` 1 writes the window.  No adjoint of its own: the staging's is the unstage
(:func:`~distfuse.kernels.halo.halo_unstage`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from distfuse.kernels._utils import env_choice
from distfuse.kernels.jit_helpers import magic_div

__all__ = ["stage_words_kernel", "stage_words_enabled", "STAGE_WORDS", "STAGE_WORDS_ENV", "WORDS_GROUPS",
           "WORDS_GROUPS_INTERPRETED"]

STAGE_WORDS_ENV = "DISTFUSE_STAGE_WORDS"


def stage_words_enabled() -> bool:
    """``DISTFUSE_STAGE_WORDS`` (``0``, the default, or ``1``): whether GPUs take the words form where it applies.
    Any other value raises, naming the variable."""
    return env_choice(STAGE_WORDS_ENV, ("0", "1")) == "1"


#: Take the words form on GPUs where it applies (see the module doc), read once at import from
#: :func:`stage_words_enabled`.  Off until a GPU measures it: the diagnosis (``scripts/gpu_diagnose.py``, section
#: ``halo_tiles``, rows ``halo_stage words=True`` and ``two passes words=True``) times it beside the split launch and
#: the default two passes at the NCHW shapes, bit-exact first.
STAGE_WORDS: bool = stage_words_enabled()
#: Groups of four words a program writes on GPUs: 256 (1024 words, 4 KB, two groups a thread at 4 warps).
WORDS_GROUPS = 256
#: Under the interpreter, at most this many (one program for a small staging: the interpreter pays per program).
WORDS_GROUPS_INTERPRETED = 1 << 14

# Its geometry never specialises: Triton makes an integer argument equal to 1 a plain constant, which has no .to
_GEOMETRY = ["W2", "W2_M", "W2_K", "L1", "L1_M", "L1_K", "L0", "L0_M", "L0_K", "LO0", "LO1", "I0", "I1", "LO2", "RHI",
             "XBASE", "X_S1", "XB", "XC"]


@triton.jit
def _window_row(r, L1, L1_M, L1_K, L0, L0_M, L0_K, LO0, LO1, I0, I1, XBASE, X_S1, XB, XC):
    """Staged row ``r`` of ``[LEAD, L0, L1]``: ``(the element its window row starts at in the block, whether it
    crosses the window)``.  The window's row ``(lead, b0, b1)`` is row ``rw = q * I1 + b1`` of the window box
    (``q = lead * I0 + b0``), which starts at ``XBASE + rw * X_S1 + q * XB + lead * XC`` in the block
    (``stage_launch``'s box table, columns 16-18)."""
    q = magic_div(r, L1_M, L1_K)
    i1 = r - q * L1
    lead = magic_div(q, L0_M, L0_K)
    i0 = q - lead * L0
    b0 = i0 - LO0
    b1 = i1 - LO1
    inside = (b0 >= 0) & (b0 < I0) & (b1 >= 0) & (b1 < I1)
    qw = lead * I0 + b0
    return XBASE + (qw * I1 + b1) * X_S1 + qw * XB + lead * XC, inside


@triton.jit(do_not_specialize=_GEOMETRY)
def stage_words_kernel(out_ptr, a_ptr, b_ptr, n_words, W2, W2_M, W2_K, L1, L1_M, L1_K, L0, L0_M, L0_K, LO0, LO1, I0,
                       I1, LO2, RHI, XBASE, X_S1, XB, XC, PER_WORD: tl.constexpr, GROUPS: tl.constexpr):
    """Groups ``[pid * GROUPS, (pid + 1) * GROUPS)`` of four words of ``out`` (``W2`` words a staged row, ``n_words``
    in all), those holding a word of a window row: the window's elements (staged columns ``[LO2, RHI)``) from
    ``a_ptr`` (the block), every other element 0.  ``PER_WORD`` elements a word (2: 16-bit, packed low column
    first, little-endian; 1: 32-bit).  ``b_ptr`` (the receive buffer) is not read: the border is ``PART`` 3's.
    int32 offsets; ``(M, K)`` pairs are the :func:`~distfuse.kernels.halo_programs.magic_divisor` of W2, L1, L0."""
    ow = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)  # linear, as halo_programs.linear_grid
    g = pid * GROUPS + tl.arange(0, GROUPS)
    f0 = g * 4
    r0 = magic_div(f0, W2_M, W2_K)
    k0 = f0 - r0 * W2
    x0, in0 = _window_row(r0, L1, L1_M, L1_K, L0, L0_M, L0_K, LO0, LO1, I0, I1, XBASE, X_S1, XB, XC)
    x1, in1 = _window_row(r0 + 1, L1, L1_M, L1_K, L0, L0_M, L0_K, LO0, LO1, I0, I1, XBASE, X_S1, XB, XC)
    f = f0[:, None] + tl.arange(0, 4)[None, :]
    k = k0[:, None] + tl.arange(0, 4)[None, :]
    carry = k >= W2  # the word is in the group's second row (W2 >= 4: a group spans two rows at most)
    k = tl.where(carry, k - W2, k)
    x_row = tl.where(carry, x1[:, None], x0[:, None])
    inside = tl.where(carry, in1[:, None], in0[:, None])
    # one mask for a whole group's four words (a 16-byte store); the group the tensor's end cuts, apart below
    keep = in0 | (in1 & (k0 + 4 > W2))  # a window row's word: in the group's row, or in the next one it reaches
    whole = keep & (f0 + 4 <= n_words)
    c = k * PER_WORD  # the word's first element's staged column
    read = keep[:, None] & inside & (f < n_words)
    v0 = tl.load(a_ptr + (x_row + (c - LO2)), mask=read & (c >= LO2) & (c < RHI), other=0.0)
    if PER_WORD == 2:
        v1 = tl.load(a_ptr + (x_row + (c + 1 - LO2)), mask=read & (c + 1 >= LO2) & (c + 1 < RHI), other=0.0)
        word = (v0.to(tl.uint16, bitcast=True).to(tl.uint32)
                | (v1.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)).to(tl.int32, bitcast=True)
    else:
        word = v0.to(tl.int32, bitcast=True)
    tl.store(ow + f, word, mask=whole[:, None])
    if (pid + 1) * GROUPS * 4 > n_words:  # the program that holds the end: its cut group word by word
        tl.store(ow + f, word, mask=(keep & (f0 + 4 > n_words))[:, None] & (f < n_words))
