"""Implicit-GEMM halo convolution: the A-operand loader reads the block, the receive buffer and the padding directly.

No staged tensor exists.  Shapes on worker ``index`` (``nd`` = 1, 2 or 3 spatial axes,
padded to 3 inside the kernel with leading extent-1 axes, as in ``kernels/halo.py``)::

    x       [B, C, *n]          this worker's block, contiguous
    recv    flat                plan.recvs(index) boxes, each [B*C, *src_shape] (what halo_pack sent)
    weight  [Co, C, *k]         groups = 1 only
    y       [B, Co, *m]         m = plan.output_shape(index)

    GEMM view   M = B * prod(m)     N = Co     K = C * prod(k)
    A[mm, kk]   = staged[b, c, o * stride + kpos * dilation]     (never materialised)
    B[kk, n]    = weight.reshape(Co, K)[n, kk]
    y[b, n, o]  = sum_kk A[mm, kk] B[kk, n] + bias[n]            (fp32 accumulate, one rounding)

The staged position -> source map is the stage kernel's lookup tables
(:func:`~distfuse.kernels.halo_tables.stage_tables`, shared and cached).  Every A element
costs 6 LUT loads + 5 piece-table loads (all tiny, cache resident) on top of its data
load; a staged copy costs one store and one load per staged element instead.  Which one
wins on a GPU is unmeasured: **no timing has been taken, so no claim against cuDNN (or
against stage + cuDNN) is made** (``docs/benchmarks.md``, "Kernel choices").

Design decisions:

* **16-bit operands feed the tensor cores** (see :func:`_constexprs`): the products of
  16-bit values are exact in fp32, so the interpreter's upcast changes only the summation
  order.
* **The K loop.**  ``for k in range(0, K, BLOCK_K)`` (a loop Triton software-pipelines)
  over ``_conv_k_step``, whose k-indexed temporaries are local, so the tile shapes are
  free (BLOCK_M != BLOCK_K compiles).
* **Plain pointer arithmetic, exact masks.**  No ``tl.make_block_ptr`` (unsupported by
  the interpreter); every load is masked on ``m < M``, ``k < K``, ``n < N`` and the
  piece kind, because an out-of-bounds access silently corrupts memory there.
* **One config, no autotune.**  Multi-config autotune fails without a GPU; the tile is
  a launcher argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels._utils import INTERPRET, input_precision
from distfuse.kernels.halo import halo_stage_reference
from distfuse.kernels.halo_programs import piece_value
from distfuse.kernels.halo_tables import check_flat, pad3, recv_numel, stage_tables
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import cast_out

__all__ = ["conv_implicit", "conv_implicit_reference"]

_OP = "conv_implicit"
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# (BLOCK_M, BLOCK_N, BLOCK_K) on GPUs: untuned (no GPU was measured); BLOCK_M != BLOCK_K on purpose, the
# compile-for-sm_90 test covers it.  64 x 32 x 32 spilled (sm_90: 152 bytes a thread in 16 bits under Triton 3.9,
# 272-536 in fp32 IEEE under 3.6 and 3.9); 64 x 32 x 16 spills under neither, but for fp32 IEEE products (FMA
# units, not tensor cores: 24 bytes under 3.9), which take 32 x 32 x 16 (tests/test_compile_audit.py).
_GPU_TILE = (64, 32, 16)
_GPU_TILE_IEEE = (32, 32, 16)


def gpu_tile(precision: str) -> tuple[int, int, int]:
    """The GPU tile for products in ``precision`` (:func:`~distfuse.kernels._utils.input_precision`)."""
    return _GPU_TILE_IEEE if precision == "ieee" else _GPU_TILE


@triton.jit
def _conv_k_step(acc, k_start, b, o0, o1, o2, mmask, offs_n, nmask,
                 x_ptr, r_ptr, w_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                 K, C, K0, K1, K2, NS1, NS2, SD0, SD1, SD2, DL0, DL1, DL2,
                 UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + A[m, k_start:k_start+BLOCK_K] @ B[k_start:k_start+BLOCK_K, n]``: one K step of the GEMM view.

    ``acc`` ``[BLOCK_M, BLOCK_N]`` fp32; ``b, o0, o1, o2, mmask`` ``[BLOCK_M]`` (the tile's
    rows decomposed once by the caller); ``offs_n, nmask`` ``[BLOCK_N]``.  Everything
    indexed by k is ``[BLOCK_K]`` and local to this step, so no loop-carried value of the
    caller changes shape.
    """
    offs_k = k_start + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    # k -> (c, k0, k1, k2): weight.reshape(Co, K) order
    k2 = offs_k % K2
    kq = offs_k // K2
    k1 = kq % K1
    kq = kq // K1
    k0 = kq % K0
    c = kq // K0
    amask = mmask[:, None] & kmask[None, :]
    p0 = o0[:, None] * SD0 + k0[None, :] * DL0  # staged coordinates, [BLOCK_M, BLOCK_K]
    p1 = o1[:, None] * SD1 + k1[None, :] * DL1
    p2 = o2[:, None] * SD2 + k2[None, :] * DL2
    s0 = tl.load(seg0_ptr + p0, mask=amask, other=0)
    c0 = tl.load(crd0_ptr + p0, mask=amask, other=0).to(tl.int64)
    s1 = tl.load(seg1_ptr + p1, mask=amask, other=0)
    c1 = tl.load(crd1_ptr + p1, mask=amask, other=0).to(tl.int64)
    s2 = tl.load(seg2_ptr + p2, mask=amask, other=0)
    c2 = tl.load(crd2_ptr + p2, mask=amask, other=0).to(tl.int64)
    prow = ((s0 * NS1 + s1) * NS2 + s2) * 5
    lead = (b[:, None] * C + c[None, :]).to(tl.int64)  # x and recv boxes are [B*C, ...]
    _, a = piece_value(x_ptr, r_ptr, ptab_ptr, prow, lead, c0, c1, c2, amask, x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                mask=kmask[:, None] & nmask[None, :], other=0.0)
    if UPCAST:  # interpreter: its 16-bit tl.dot is wrong; fp32 products of 16-bit values are exact
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _conv_implicit_kernel(y_ptr, x_ptr, r_ptr, w_ptr, bias_ptr,
                          seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr, ptab_ptr,
                          M, N, K, C, O0, O1, O2, K0, K1, K2, NS1, NS2,
                          SD0, SD1, SD2, DL0, DL1, DL2,
                          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[b, n, o] = bias[n] + sum_{c, kp} w[n, c, kp] * staged[b, c, o * SD + kp * DL], staged read via the LUTs.

    Program ``(pid_m, pid_n)`` computes the ``[BLOCK_M, BLOCK_N]`` tile of the GEMM view
    (rows ``m`` = (b, o), columns ``n`` = output channels), one ``_conv_k_step`` per
    ``BLOCK_K`` slice of K.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    # m -> (b, o0, o1, o2), once per tile row
    o2 = offs_m % O2
    mq = offs_m // O2
    o1 = mq % O1
    mq = mq // O1
    o0 = mq % O0
    b = mq // O0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # A for loop over a runtime bound, which Triton software-pipelines (Triton 3.6's interpreter runs it through
    # distfuse.kernels._interpreter_compat).
    for k_start in range(0, K, BLOCK_K):
        acc = _conv_k_step(acc, k_start, b, o0, o1, o2, mmask, offs_n, nmask,
                           x_ptr, r_ptr, w_ptr, seg0_ptr, crd0_ptr, seg1_ptr, crd1_ptr, seg2_ptr, crd2_ptr,
                           ptab_ptr, K, C, K0, K1, K2, NS1, NS2, SD0, SD1, SD2, DL0, DL1, DL2,
                           UPCAST, INPUT_PRECISION, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    ovol = O0 * O1 * O2
    o_flat = (o0 * O1 + o1) * O2 + o2
    y_off = (b.to(tl.int64) * N * ovol + o_flat)[:, None] + offs_n.to(tl.int64)[None, :] * ovol
    tl.store(y_ptr + y_off, cast_out(acc, y_ptr.dtype.element_ty, ROUND_BF16), mask=mmask[:, None] & nmask[None, :])


def _constexprs(dtype: torch.dtype, has_bias: bool, tile: tuple[int, int, int], interpret: bool = INTERPRET) -> dict:
    """The kernel's constexpr arguments for ``dtype`` operands (the compile-for-sm_90 test passes interpret=False).

    Compiled, 16-bit operands go to ``tl.dot`` as they are (tensor cores, fp32
    accumulation) and fp32 ones with :func:`input_precision`.  Interpreted, ``UPCAST`` and
    ``ROUND_BF16`` work around its pitfalls (:mod:`distfuse.kernels._utils`).
    """
    bm, bn, bk = tile
    return dict(HAS_BIAS=has_bias, UPCAST=interpret, INPUT_PRECISION=input_precision(dtype),
                ROUND_BF16=interpret and dtype == torch.bfloat16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)


def _tuple(v, nd: int, name: str) -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) else tuple(v)
    if len(t) != nd:
        raise UnsupportedError(f"{where(_OP)}: {name} {v} has {len(t)} entries, expected {nd}")
    return t


def _check(x, recv, weight, bias, plan: HaloPlan, index, stride, dilation):
    nd = len(plan.axes)
    if nd not in (1, 2, 3):
        raise UnsupportedError(f"{where(_OP)}: 1, 2 or 3 spatial axes are supported, the plan has {nd}")
    index = tuple(index)
    stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
    plan_geom = tuple((ax.stride, ax.dilation, ax.kernel) for ax in plan.axes)
    if x.dtype not in _SUPPORTED:
        raise UnsupportedError(f"{where(_OP)}: dtype must be one of {_SUPPORTED}, got {x.dtype}")
    if x.dim() != nd + 2 or tuple(x.shape[2:]) != plan.input_shape(index):
        raise expect(_OP, "x shape [B, C, *plan.input_shape(index)]", ("B", "C", *plan.input_shape(index)),
                     tuple(x.shape))
    if not x.is_contiguous():
        raise ShapeError(f"{where(_OP)}: x must be contiguous")
    if weight.dim() != nd + 2 or weight.dtype != x.dtype or weight.device != x.device:
        raise expect(_OP, "weight [Co, C, *k] (x's dtype and device)", (nd + 2, x.dtype, x.device),
                     (weight.dim(), weight.dtype, weight.device))
    if weight.shape[1] != x.shape[1]:
        raise UnsupportedError(f"{where(_OP)}: only groups=1 is supported (weight has {weight.shape[1]} input "
                               f"channels, x has {x.shape[1]})")
    geom = tuple(zip(stride, dilation, weight.shape[2:], strict=True))
    if geom != plan_geom:
        raise expect(_OP, "(stride, dilation, kernel) per axis, as in the plan", plan_geom, geom)
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise expect(_OP, "bias [Co] in x's dtype", ((weight.shape[0],), x.dtype), (tuple(bias.shape), bias.dtype))
    check_flat(_OP, recv, recv_numel(plan, index, x.shape[0] * x.shape[1]), x.dtype, x.device, "receive buffer")
    return nd, index, stride, dilation


def conv_implicit(x: torch.Tensor, recv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  plan: HaloPlan, index: Sequence[int], stride, dilation, *,
                  out: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """This worker's block of the halo convolution, reading ``x``, ``recv`` and the padding without staging.

    Args:
        x: ``[B, C, *plan.input_shape(index)]`` contiguous, fp32/fp16/bf16.
        recv: flat receive buffer (``plan.recvs(index)`` boxes, as :func:`halo_stage` takes it).
        weight: ``[Co, C, *k]`` (groups = 1); ``bias``: ``[Co]`` or None.
        stride, dilation: int or per-axis; must match the plan.
        out: optional preallocated output (contiguous, x's dtype; e.g. a NaN-poisoned buffer in tests).
        tile: ``(BLOCK_M, BLOCK_N, BLOCK_K)``, each a power of two >= 16.

    Returns ``[B, Co, *plan.output_shape(index)]`` in x's dtype (fp32 accumulation, one rounding).
    Same value as :func:`conv_implicit_reference`.
    """
    nd, index, stride, dilation = _check(x, recv, weight, bias, plan, index, stride, dilation)
    B, C = x.shape[0], x.shape[1]
    Co = weight.shape[0]
    out_shape = plan.output_shape(index)
    want = (B, Co) + out_shape
    if out is not None and (tuple(out.shape) != want or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise expect(_OP, "out (contiguous, x's dtype and device)", (want, x.dtype), (tuple(out.shape), out.dtype))
    y = x.new_empty(want) if out is None else out
    if y.numel() == 0:
        return y
    K = C * math.prod(weight.shape[2:])
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.view((1, Co) + (1,) * nd).expand_as(y))
    luts, ptab, ns = stage_tables(plan, index, B * C, x.device)
    w = weight.contiguous()
    M = B * math.prod(out_shape)
    if tile is None:
        # interpreter: each program costs Python time, so take big tiles; GPU values untuned (no GPU measured)
        tile = gpu_tile(input_precision(x.dtype)) if x.device.type == "cuda" else (
            min(128, max(16, next_power_of_2(M))), min(64, max(16, next_power_of_2(Co))),
            min(128, max(16, next_power_of_2(K))))
    r = recv if recv.numel() else x  # never dereferenced without a kind-2 piece
    grid = (cdiv(M, tile[0]), cdiv(Co, tile[1]))
    _conv_implicit_kernel[grid](y, x, r, w, bias if bias is not None else w, *luts, ptab,
                                M, Co, K, C, *pad3(out_shape, 1), *pad3(tuple(weight.shape[2:]), 1), ns[1], ns[2],
                                *pad3(stride, 1), *pad3(dilation, 1), **_constexprs(x.dtype, bias is not None, tile))
    return y


def conv_implicit_reference(x: torch.Tensor, recv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            plan: HaloPlan, index: Sequence[int], stride, dilation) -> torch.Tensor:
    """Stage with torch, then ``F.convNd`` in fp32 (fp32 accumulation like the kernel), rounded once to x's dtype."""
    nd, index, stride, dilation = _check(x, recv, weight, bias, plan, index, stride, dilation)
    out_shape = plan.output_shape(index)
    if 0 in out_shape or 0 in plan.staged_shape(index):
        return x.new_zeros((x.shape[0], weight.shape[0]) + out_shape)
    staged = halo_stage_reference(x, recv, plan, index)
    y = _CONV[nd](staged.float(), weight.float(), None if bias is None else bias.float(), stride, 0, dilation)
    return y.to(x.dtype)
