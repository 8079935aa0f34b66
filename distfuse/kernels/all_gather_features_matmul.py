"""all_gather_features_matmul, kernel floor: K-chunks are pushed into every peer; the GEMM reads them as they land.

DistDL's all-gather linear (the input split along its last dim, the input features), and
the input gradient of the reduce-scatter-along-the-features linear::

    a_shard [M, K_p]    this rank's input-feature block, columns [start_p, stop_p) of K
    weight  [N, K]      nn.Linear layout, all K input features; any strides (``w.t()`` for a [K, N] operand)
    forward y  = all_gather_K(a_shard) @ weight.T + bias                       -> [M, N]
               = sum over chunks c, own chunk first: a_c @ weight[:, start_c:stop_c].T
    adjoint da = reduce_scatter_K(dy @ weight)
                 (:func:`distfuse.kernels.matmul_reduce_scatter_features.matmul_scatter_columns` with
                 ``weight.t()``, then ``column_reduce``)

:mod:`distfuse.kernels.all_gather_matmul` with K chunks instead of row chunks (its
schedule, arrival order and synchronisation): :func:`ag_push_columns` (the producer: this
rank's columns into every peer's gathered ``[M, K]``, then ``flags[p, p]`` raised there) and
:func:`gathered_k_matmul` (the consumer: every output tile walks the K chunks, its own
first, read from the shard itself, then the peers' in arrival order ``rank - 1, rank - 2,
...``, each after its flag), inside one claim of the workspace.  Each tile accumulates the
chunks in one fp32 accumulator in that fixed order, so a rank's result is identical from
run to run, whatever order the chunks actually arrived in.

The ``K`` chunks follow the balanced decomposition (``K`` need not divide by ``W``; a
chunk may be empty, and its owner still raises its flags).  The gathered buffer is
row-major ``[M, K]`` in ``a.dtype``, so it is the gathered input itself (``return_gathered``
copies it for a weight gradient, with the own columns filled from the shard).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distfuse.errors import expect
from distfuse.geometry.decomposition import block_range
from distfuse.kernels._utils import (
    AUTOTUNE,
    INTERPRET,
    TIMED_WAITS,
    check_bias,
    claimed_rank_view,
    gathered_copy,
    gemm_autotuners,
    get_push_configs,
    input_precision,
    output_buffer,
    pick_gemm_launch,
    pick_push_launch,
    refuse_zero_width_gather,
    round_bf16,
    shard_rows,
    summed_partials,
    tile_grid,
    timeout_arg,
)
from distfuse.kernels.jit_helpers import (
    arrive,
    balanced_chunk,
    cast_out,
    matmul_tile,
    raise_flag,
    tile_offsets,
    wait_flag,
)

__all__ = ["ag_push_columns", "gathered_k_matmul", "all_gather_features_matmul_loopback",
           "all_gather_features_matmul_reference", "gathered_k_workspace_bytes"]


@triton.jit(do_not_specialize=["rank", "start_p"])
def _ag_push_columns_kernel(
    x_ptr, gathered_ptr, data_ptrs, flag_ptrs, counter_ptr,
    M, K, len_p, start_p, rank, W, epoch_ptr, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Copy one [BLOCK_M, BLOCK_K] tile of the shard into columns ``start_p + k`` of every peer's ``[M, K]``."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    num_pid_k = tl.cdiv(len_p, BLOCK_K)
    if pid < tl.cdiv(M, BLOCK_M) * num_pid_k:
        offs_m = (pid // num_pid_k) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = (pid % num_pid_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_m < M)[:, None] & (offs_k < len_p)[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        tile = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask)
        for j in range(1, W):
            peer = (rank + j) % W
            dst = tl.load(data_ptrs + peer).to(tl.pointer_type(gathered_ptr.dtype.element_ty))
            tl.store(dst + rows * K + start_p + offs_k[None, :], tile, mask=mask)
    if arrive(counter_ptr + rank):
        for j in range(1, W):
            peer = (rank + j) % W
            raise_flag(tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + rank * W + rank, epoch)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _gathered_k_matmul_kernel(
    x_ptr, gathered_ptr, b_ptr, bias_ptr, y_ptr, flags_ptr, status_ptr,
    M, N, K, rank, W, epoch_ptr, timeout,
    stride_xm, stride_bn, stride_bk, stride_bias,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    TIMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One output tile over every K chunk: own chunk first (from the shard), then peers' in arrival order.

    A chunk whose flag never came (``wait_flag`` timed out) makes the tile NaN; the
    launcher raises on the status word.
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    offs_m, offs_n, mask_m, mask_n = tile_offsets(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), M, N, GROUP_M, BLOCK_M,
                                                  BLOCK_N)
    rows = offs_m.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ok = rank == rank  # an int1 scalar, the type wait_flag returns
    for j in range(0, W):
        chunk = (rank - j + W) % W  # own chunk first, then arrival order: rank - 1 pushes to this rank first
        if j > 0:
            ok = ok & wait_flag(flags_ptr + chunk * W + chunk, epoch, status_ptr + chunk, timeout, TIMED)
        start_c, len_c = balanced_chunk(chunk, K, W)
        # The own chunk comes from the shard itself, the others from this rank's gathered buffer.
        a_rows = tl.where(j == 0, x_ptr + rows * stride_xm, gathered_ptr + rows * K + start_c)
        acc += matmul_tile(a_rows, mask_m, b_ptr + start_c.to(tl.int64) * stride_bk, offs_n, mask_n, len_c,
                           stride_bk, stride_bn, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(ok, acc, float("nan"))
    tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], cast_out(acc, y_ptr.dtype.element_ty, ROUND_BF16),
             mask=mask_m[:, None] & mask_n[None, :])


_push_columns_tuned = triton.autotune(get_push_configs(), key=["M", "len_p", "K", "W"])(_ag_push_columns_kernel) \
    if AUTOTUNE else None
_gathered_k_matmul_tuned = gemm_autotuners(_gathered_k_matmul_kernel, ["M", "N", "K"], "gathered_k")


def gathered_k_workspace_bytes(rows: int, K: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Data bytes :func:`ag_push_columns` + :func:`gathered_k_matmul` need in every rank's workspace: ``[M, K]``."""
    return rows * K * dtype.itemsize


def ag_push_columns(a_shard: torch.Tensor, ws, rank: int, world_size: int, K: int, *,
                    config: dict | None = None) -> None:
    """Produce: copy this rank's ``[..., K_rank]`` into its columns of every peer's gathered ``[M, K]``.

    Raises ``flags[rank, rank]`` on every peer when its copy is complete (also for an empty
    shard).  Call inside ``ws.in_flight`` on every rank, then :func:`gathered_k_matmul`.
    """
    op = "ag_push_columns"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    x = shard_rows(op, a_shard, K, rank, W, columns=True)
    M, len_p = x.shape
    gathered = st.data(x.dtype, M * K, op=op)
    if W == 1:
        return
    kernel, meta = pick_push_launch(_push_columns_tuned, _ag_push_columns_kernel, config, ws)
    kernel[tile_grid(M, len_p, inner="BLOCK_K", at_least=1)](x, gathered, st.data_ptrs, st.flag_ptrs, st.counters,
                 M, K, len_p, block_range(K, W, rank)[0], rank, W, st.epoch_dev, x.stride(0), **meta)


def gathered_k_matmul(a_shard: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, *,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      out: torch.Tensor | None = None, config: dict | None = None, return_gathered: bool = False):
    """Consume: ``y = all_gather_K(a) @ weight.T + bias``, own K chunk first, each peer chunk after its flag.

    The arguments of :func:`~distfuse.kernels.all_gather_matmul.gathered_matmul` but ``n``
    and ``kernel``, except ``a_shard [..., K_rank]`` (the tensor given to :func:`ag_push_columns`), ``weight [N, K]``
    of all input features (``K`` is its width), ``out`` (``M * N`` elements ending in ``N``)
    and ``config`` (GEMM block sizes only).  Returns ``y [..., N]``, or ``(y, gathered)``
    with the gathered input ``[..., K]``.
    """
    op = "gathered_k_matmul"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    if weight.dim() != 2:
        raise expect(op, "weight dimensions ([N, K])", 2, weight.dim())
    N, K = weight.shape
    x = shard_rows(op, a_shard, K, rank, W, columns=True)
    if weight.dtype != x.dtype or weight.device != x.device:
        raise expect(op, "weight dtype and device (the shard's)", (x.dtype, x.device), (weight.dtype, weight.device))
    check_bias(op, bias, N, x.device)
    M = x.shape[0]
    out_dtype = out_dtype or x.dtype
    out = output_buffer(op, out, (M, N), out_dtype, x.device, "[..., N]")
    gathered = st.data(x.dtype, M * K, op=op)
    st.wait_producers()  # collective on CPU
    refuse_zero_width_gather(op, return_gathered and W > 1, N, M)
    if M > 0 and N > 0:
        kernel, meta = pick_gemm_launch(_gathered_k_matmul_tuned, _gathered_k_matmul_kernel, x.dtype, M, N, config,
                                        ws, family="gathered_k")
        kernel[tile_grid(M, N)](
            x, gathered, weight, bias if bias is not None else out, out, st.flags, st.status,
            M, N, K, rank, W, st.epoch_dev, timeout_arg(st),
            x.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
            HAS_BIAS=bias is not None, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(x.dtype),
            ROUND_BF16=round_bf16(out_dtype), TIMED=TIMED_WAITS, **meta,
        )
        st.check_status(op, "gathered K chunks")
    lead = a_shard.shape[:-1]
    y = out.view(*lead, N)
    return (y, gathered_copy(gathered, (M, K), x, K, rank, W).view(*lead, K)) if return_gathered else y


def all_gather_features_matmul_loopback(shards, weight_list, ws, *, biases=None, out_dtype: torch.dtype | None = None,
                                        config: dict | None = None) -> list[torch.Tensor]:
    """Every virtual rank of a loopback workspace: all pushes, then all GEMMs; no autograd.

    ``shards[r]`` ``[..., K_r]`` (the balanced blocks of K, in order), ``weight_list[r]``
    ``[N_r, K]``, ``biases[r]`` ``[N_r]`` or ``biases=None``.  Returns the W outputs ``[..., N_r]``.
    """
    W = ws.world_size
    K = sum(s.shape[-1] for s in shards)
    with ws.in_flight("all_gather_features_matmul_loopback"):
        for r in range(W):
            ag_push_columns(shards[r], ws, r, W, K)
        return [gathered_k_matmul(shards[r], weight_list[r], ws, r, W, bias=None if biases is None else biases[r],
                                  out_dtype=out_dtype, config=config) for r in range(W)]


def all_gather_features_matmul_reference(shards, weight: torch.Tensor, rank: int, *, bias: torch.Tensor | None = None,
                                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference with the kernel's summation order: per-chunk fp32 products, own chunk first, then
    ``rank - 1, rank - 2, ...``; plus the bias; rounded once to ``out_dtype``."""
    W, K = len(shards), weight.shape[1]
    order = [(rank - j) % W for j in range(W)]  # own chunk first, then the arrival order
    parts = (shards[c].float() @ weight[:, slice(*block_range(K, W, c))].float().t() for c in order)
    return summed_partials(parts, None, bias, out_dtype or shards[0].dtype)
