"""A plain persistent Triton GEMM, ``c = a @ b.T``: the ceiling of a Triton GEMM with this compiler, for the diagnosis.

    a   [M, K]      row-major (K contiguous)
    b   [N, K]      row-major: the weight as ``torch.nn.Linear`` holds it
    c   [M, N]      row-major, in a's dtype (fp32 accumulation, one rounding)

The structure of Triton's persistent-matmul tutorial: one program per SM, the tile loop and the K loop
flattened for the compiler's pipeliner (``tl.range(..., flatten=True)``), host tensor descriptors (TMA loads and
a TMA store of each tile), grouped tile order.  No scatter, no flag, no chunking: what is left of distfuse's
persistent producer (:mod:`distfuse.kernels.matmul_scatter_persistent`, the same loop and tiles) when its
epilogue stores locally.  ``scripts/gpu_diagnose.py`` (section ``forms``) times it beside cuBLAS and the producer
at the same tile: if this GEMM alone stays under 0.90 of cuBLAS at a shape, no epilogue built on it reaches the
GEMM + scatter target there, and the gap is the compiler's mainloop, not the scatter.

Not part of the package: a measuring stick (no adjoint; forward only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["gemm_anchor"]


@triton.jit
def _tile_of(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile ``t``'s ``(pid_m, pid_n)`` in grouped order (GROUP_M row tiles share their B tiles in L2)."""
    in_group = GROUP_M * num_pid_n
    first_m = (t // in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (t % in_group) % group_m, (t % in_group) // group_m


@triton.jit
def _gemm_anchor_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_out = pid - num_progs  # the epilogue's tile, on its own counter (what lets the two loops be flattened)
    for t in tl.range(pid, num_pid_m * num_pid_n, num_progs, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        t_out += num_progs
        pid_m, pid_n = _tile_of(t_out, num_pid_m, num_pid_n, GROUP_M)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def gemm_anchor(a: torch.Tensor, b: torch.Tensor, config: dict, out: torch.Tensor | None = None,
                programs: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b[N, K].T`` by :func:`_gemm_anchor_kernel` with ``config`` (``BLOCK_M``, ``BLOCK_N``,
    ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``; ``FLATTEN`` default True) on ``programs`` programs
    (default one per SM, or 4 on a CPU).  Dense row-major operands only: a measuring stick, not an op."""
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"gemm_anchor: a [M, K] and b [N, K], contiguous; got {tuple(a.shape)}, {tuple(b.shape)}")
    cfg = dict(config)
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _gemm_anchor_kernel[(max(1, min(programs, tiles)),)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg.get("GROUP_M", 8), FLATTEN=cfg.get("FLATTEN", True), num_warps=warps, num_stages=stages)
    return out
