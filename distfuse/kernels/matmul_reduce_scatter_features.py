"""matmul_reduce_scatter_features, kernel floor: each GEMM tile's columns are stored straight into their owner's slot.

DistDL's reduce-scatter linear (the output split along its last dim), and the input
gradient of the all-gather-along-the-features linear::

    a       [M, K]     this rank's input rows (leading dims flattened; K is this rank's input-feature block)
    weight  [N, K]     nn.Linear layout; any strides (pass ``w.t()`` for a [K, N] operand)
    forward out_r = sum_p (a_p @ weight_p.T)[:, start_r:stop_r] + bias_r       -> [M, len_r]
    adjoint da_p  = all_gather_N(d out) @ weight_p
                    (:func:`distfuse.kernels.all_gather_features_matmul.gathered_k_matmul` with ``weight_p.t()``)

:mod:`distfuse.kernels.matmul_reduce_scatter` with column chunks instead of row chunks:
chunk ``r`` is the output columns ``[start_r, stop_r)`` (balanced decomposition of ``N``
over ``W``); every row of the GEMM goes to every owner, each owner gets its own columns.
The launches, the rank-rotated schedule, the flag protocol and the precision are that
module's: :func:`matmul_scatter_columns` (the producer) and :func:`column_reduce` (the
consumer: :mod:`distfuse.kernels.chunk_reduce`'s kernel over a column chunk, ``n_rows = M``
and ``N = len_r``), inside one claim of the workspace.

Owner ``r``'s data region holds W slots, one per source, each ``[M, len_r]`` in
``partial_dtype`` with rows ``ld = pad16(ceil(N / W))`` elements apart (the same ``ld`` on
every owner, so one slot stride ``M * ld`` serves all of them; the padding keeps remote
stores 16 bytes wide).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import distfuse.kernels.chunk_reduce as chunk_reduce_kernels
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels._utils import (
    INTERPRET,
    check_bias,
    check_producer_args,
    claimed_rank_view,
    flatten_rows,
    gemm_autotuners,
    input_precision,
    pick_gemm_launch,
    round_bf16,
    summed_partials,
    tile_grid,
)
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.jit_helpers import arrive, balanced_chunk, cast_out, matmul_tile, raise_flag, tile_offsets

__all__ = ["matmul_scatter_columns", "column_reduce", "matmul_reduce_scatter_features_loopback",
           "matmul_reduce_scatter_features_reference", "matmul_scatter_columns_workspace_bytes", "column_slot_stride",
           "launch_slot_producer"]


# Per-call integers must not be specialised (see matmul_reduce_scatter.py); the epoch is a device word.
@triton.jit(do_not_specialize=["rank", "src_offset"])
def _matmul_scatter_columns_kernel(
    a_ptr, b_ptr, bias_ptr, slots_ptr, data_ptrs, flag_ptrs, counter_ptr,
    M, N, ld, K, rank, W, epoch_ptr, src_offset,
    stride_am, stride_bn, stride_bk, stride_bias,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grid (tiles of the widest column chunk, W): axis 1 is the step of the rotation, chunk = (rank + 1 + step) % W.

    ``HAS_BIAS``: this rank's partial includes ``bias[N]`` (the producer-side bias of
    :mod:`distfuse.kernels.matmul_all_reduce`, where one rank adds it for all).
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    step = tl.program_id(1)
    chunk = (rank + 1 + step) % W
    start_c, len_c = balanced_chunk(chunk, N, W)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(len_c, BLOCK_N)
    if pid < num_pid_m * num_pid_n:
        # offs_n: columns of the chunk, 0-based
        offs_m, offs_n, mask_m, mask_n = tile_offsets(pid, num_pid_m, num_pid_n, M, len_c, GROUP_M, BLOCK_M, BLOCK_N)
        a_rows = a_ptr + offs_m.to(tl.int64) * stride_am
        b_cols = b_ptr + start_c.to(tl.int64) * stride_bn
        acc = matmul_tile(a_rows, mask_m, b_cols, offs_n, mask_n, K, stride_bk, stride_bn,
                          UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (start_c + offs_n) * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        # Owner `chunk`'s slot for source `rank`, laid out [M, len_c] with rows ld apart.  The peer region is
        # addressed from this rank's own aligned `slots_ptr` plus a distance that is a multiple of 16 elements
        # (see matmul_reduce_scatter.py), so the stores are 16 bytes wide.
        esize = slots_ptr.dtype.element_ty.primitive_bitwidth // 8
        delta = (tl.load(data_ptrs + chunk) - tl.load(data_ptrs + rank)) // esize
        dst = slots_ptr + tl.multiple_of(delta + src_offset, 16)
        out = cast_out(acc, slots_ptr.dtype.element_ty, ROUND_BF16)
        # Masked by the padded row (``ld``, a multiple of 16), not the chunk width: the columns past ``len_c`` hold
        # zeros (their weight loads were masked) and land in the row's padding, which no reader touches.  A mask
        # whose bound is a multiple of 16 lets the compiler keep the stores 16 bytes wide.
        tl.store(dst + offs_m.to(tl.int64)[:, None] * tl.multiple_of(ld, 16) + offs_n[None, :], out,
                 mask=mask_m[:, None] & (offs_n < tl.multiple_of(ld, 16))[None, :])
    if arrive(counter_ptr + chunk):
        flag = tl.load(flag_ptrs + chunk).to(tl.pointer_type(tl.int32)) + chunk * W + rank
        raise_flag(flag, epoch)


_matmul_scatter_columns_tuned = gemm_autotuners(_matmul_scatter_columns_kernel, ["M", "N", "K"])


def column_slot_stride(N: int, world_size: int) -> int:
    """Row stride of a slot: the widest column chunk, ``ceil(N / W)``, padded to 16 elements."""
    return chunk_reduce_kernels.slot_row_stride(cdiv(N, world_size))


def matmul_scatter_columns_workspace_bytes(rows: int, N: int, world_size: int,
                                           partial_dtype: torch.dtype = torch.bfloat16) -> int:
    """Data bytes one :func:`matmul_scatter_columns` needs in every rank's workspace: W slots of ``[M, ld]``."""
    return world_size * rows * column_slot_stride(N, world_size) * partial_dtype.itemsize


def matmul_scatter_columns(a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                           partial_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
                           config: dict | None = None) -> None:
    """Produce: ``a @ weight.T`` column chunk by column chunk, chunk r stored into rank r's slot for this rank.

    The arguments of :func:`~distfuse.kernels.matmul_reduce_scatter.matmul_scatter`, except
    ``a [..., K]`` (the leading dims are the rows M; data region:
    :func:`matmul_scatter_columns_workspace_bytes`) and ``bias``: optional ``[N]`` added to
    this rank's partial (any stride; the reduce-scatter linear adds its bias in
    :func:`column_reduce` instead).  Finish with :func:`column_reduce` on every rank, inside
    the same claim.
    """
    op = "matmul_scatter_columns"
    partial_dtype = check_producer_args(op, a, weight, partial_dtype, column_chunks=True)
    N, W = weight.shape[0], world_size
    launch_slot_producer(op, (_matmul_scatter_columns_tuned, _matmul_scatter_columns_kernel), a, weight, ws, rank, W,
                         partial_dtype=partial_dtype, bias=bias, ld=column_slot_stride(N, W), cols=cdiv(N, W),
                         steps=W, config=config)


def launch_slot_producer(op: str, kernels, a: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                         partial_dtype: torch.dtype, bias, ld: int, cols: int, steps: int | None, config) -> None:
    """Launch a producer of this kernel's signature (``kernels``: its autotuned and plain forms; also
    :func:`~distfuse.kernels.matmul_all_reduce.matmul_push`'s) on checked operands: ``a [..., K] @ weight.T (+ bias)``
    into W slots ``[M, ld]`` of ``partial_dtype``, this rank's source slot at ``rank * M * ld``; grid: the tiles of
    ``[M, cols]``, for each of ``steps``."""
    st = claimed_rank_view(op, ws, rank, world_size, a.device)
    a2 = flatten_rows(a)
    M, K = a2.shape
    N = weight.shape[0]
    check_bias(op, bias, N, a.device)
    slots = st.data(partial_dtype, world_size * M * ld, op=op)
    kernel, meta = pick_gemm_launch(*kernels, a.dtype, M, cols, config, ws)
    kernel[tile_grid(M, cols, steps, at_least=1)](
        a2, weight, bias if bias is not None else a2, slots, st.data_ptrs, st.flag_ptrs, st.counters,
        M, N, ld, K, rank, world_size, st.epoch_dev, rank * M * ld,
        a2.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(a.dtype),
        ROUND_BF16=round_bf16(partial_dtype), **meta,
    )


def column_reduce(ws, rank: int, world_size: int, rows: int, N: int, *, partial_dtype: torch.dtype,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None, config: dict | None = None,
                  agreement: tuple[int, str] | None = None) -> torch.Tensor:
    """Consume: sum the W partial slots of this rank's columns (fp32), add ``bias`` once, round once.

    The arguments of :func:`~distfuse.kernels.chunk_reduce.chunk_reduce`, for the producer
    :func:`matmul_scatter_columns`, except ``rows`` and ``N`` (the GEMM's M and its full
    output features) and ``bias``: optional ``[len_rank]``, this rank's block of the bias.
    Returns ``[rows, len_rank]`` with ``len_rank = block_extent(N, W, rank)``.  ``agreement``: ``(sig, what)``,
    checked in the same kernel (:func:`~distfuse.kernels.chunk_reduce.reduce_slots`).
    """
    return chunk_reduce_kernels.reduce_slots(
        "column_reduce", ws, rank, world_size, (rows, block_extent(N, world_size, rank)),
        column_slot_stride(N, world_size), partial_dtype=partial_dtype, bias=bias, out_dtype=out_dtype or partial_dtype,
        out=out, config=config, what=f"partials of column chunk {rank}", shape_name="[..., cols]",
        agreement=agreement)


def matmul_reduce_scatter_features_loopback(a_list, weight_list, ws, *, biases=None,
                                            out_dtype: torch.dtype | None = None,
                                            partial_dtype: torch.dtype | None = None,
                                            config: dict | None = None) -> list[torch.Tensor]:
    """Every virtual rank of a loopback workspace: all producers, then all reducers; no autograd.

    ``biases[r]`` is virtual rank r's ``[len_r]`` block (or ``biases=None``).  Returns the
    W outputs ``[M, len_r]`` in rank order.
    """
    W = ws.world_size
    a0 = a_list[0]
    rows, N = math.prod(a0.shape[:-1]), weight_list[0].shape[0]
    partial_dtype = partial_dtype or a0.dtype
    with ws.in_flight("matmul_reduce_scatter_features_loopback"):
        for r in range(W):
            matmul_scatter_columns(a_list[r], weight_list[r], ws, r, W, partial_dtype=partial_dtype, config=config)
        return [column_reduce(ws, r, W, rows, N, partial_dtype=partial_dtype,
                              bias=None if biases is None else biases[r], out_dtype=out_dtype or a0.dtype)
                for r in range(W)]


def matmul_reduce_scatter_features_reference(a_list, weight_list, rank: int, *, bias: torch.Tensor | None = None,
                                             out_dtype: torch.dtype | None = None,
                                             partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference of rank ``rank``'s output ``[M, len_rank]``, with the kernels' roundings.

    Each partial ``(a_p @ weight_p.T)[:, columns of rank]`` is computed in fp32 and rounded to
    ``partial_dtype``; the W partials and the bias block are summed in fp32 and rounded once.
    """
    a0 = a_list[0]
    start, stop = block_range(weight_list[0].shape[0], len(a_list), rank)
    parts = (flatten_rows(a).float() @ w[start:stop].float().t() for a, w in zip(a_list, weight_list, strict=True))
    return summed_partials(parts, partial_dtype or a0.dtype, bias, out_dtype or a0.dtype)
