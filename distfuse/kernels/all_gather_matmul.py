"""all_gather_matmul, kernel floor: shards are pushed into every peer's buffer; the GEMM takes them as they land.

Column-parallel linear forward, and the row-parallel linear's input gradient::

    a_shard [B_, len_p, K]   this rank's rows [start_p, stop_p) of the sequence dim n
    weight  [N, K]           nn.Linear layout; any strides (pass ``w.t()`` for a [K, N] operand)
    forward y  = all_gather(a_shard) @ weight.T + bias                  -> [B_, n, N]
    adjoint da = reduce_scatter(dy @ weight)
                 (:func:`distfuse.kernels.matmul_reduce_scatter.matmul_scatter` with ``weight.t()``, then
                 ``chunk_reduce``)

Two launches per rank, inside one claim of the workspace: :func:`ag_push` (the producer:
copy this rank's shard into every peer's gathered buffer) and :func:`gathered_matmul`
(the consumer: the GEMM over the gathered rows, chunk by chunk as their flags come up).
The consumer has two kernels, chosen per call by
:mod:`~distfuse.kernels.gathered_matmul_select`: the persistent one by default, and this
module's one-program-per-tile pointer kernel where tensor descriptors cannot read the
operands (any strides, any K).  :func:`all_gather_matmul` is both, as one op on a real
group; the autograd op of the same name (:mod:`distfuse.fused.all_gather_matmul`) builds
on the two launches.

Every rank's data region holds the gathered input ``[B_, n, K]`` (in ``a.dtype``); rank p
writes its rows into every peer's copy and raises ``flags[p, p]`` there.  Its own rows
are never copied: the GEMM reads them from ``a_shard``.

Schedule (W = 4, rank 1).  The push goes to rank + 1 first, so peers' rows land in the
order rank - 1, rank - 2, ...; the GEMM starts with the local chunk (no wait) and then
takes the chunks in that arrival order::

    rank 1  ag_push          | one tile load, stores to ranks 2, 3, 0 | last program raises flags[1, 1] on 2, 3, 0
    rank 1  gathered_matmul  | chunk 1 (local) | wait flags[0,0]: chunk 0 | wait [3,3]: chunk 3 | wait [2,2]: chunk 2

The push runs on the same stream before the GEMM: a GEMM grid full of spinning programs
could otherwise keep a later push from ever being scheduled, and each rank waits only for
peers' pushes, which wait for nothing, so the protocol cannot deadlock.  The flag waits
are :mod:`~distfuse.kernels.matmul_reduce_scatter`'s, with the CPU host barrier between
push and GEMM; a chunk whose flag never came makes its tiles NaN and the launcher raises.
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
from distfuse.kernels.gathered_matmul_persistent import launch_gathered_persistent
from distfuse.kernels.gathered_matmul_select import record_gather_choice, select_gather_kernel
from distfuse.kernels.host_ints import cdiv
from distfuse.kernels.jit_helpers import (
    arrive,
    balanced_chunk,
    cast_out,
    chunk_rows,
    matmul_tile,
    raise_flag,
    tile_offsets,
    wait_flag,
)
from distfuse.kernels.launch_cache import cached_launch

__all__ = ["ag_push", "gathered_matmul", "all_gather_matmul", "all_gather_matmul_loopback",
           "all_gather_matmul_reference", "gathered_matmul_workspace_bytes"]


# Per-call integers must not be specialised (see matmul_reduce_scatter.py); the epoch is a device word.
@triton.jit(do_not_specialize=["rank", "start_p"])
def _ag_push_kernel(
    x_ptr, gathered_ptr, data_ptrs, flag_ptrs, counter_ptr,
    n_batch, n, K, len_p, start_p, rank, W, epoch_ptr,
    stride_xb, stride_xn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Copy one [BLOCK_M, BLOCK_K] tile of the shard into every peer's gathered rows (load once, W - 1 stores)."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    M_p = n_batch * len_p
    num_pid_k = tl.cdiv(K, BLOCK_K)
    if pid < tl.cdiv(M_p, BLOCK_M) * num_pid_k:
        pid_m = pid // num_pid_k
        pid_k = pid % num_pid_k
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_m < M_p)[:, None] & (offs_k < K)[None, :]
        b_idx, i_idx = chunk_rows(offs_m, len_p, 0)
        tile = tl.load(x_ptr + (b_idx * stride_xb + i_idx * stride_xn)[:, None] + offs_k[None, :], mask=mask)
        dst_rows = (b_idx * n + start_p + i_idx) * K
        for j in range(1, W):
            peer = (rank + j) % W
            dst = tl.load(data_ptrs + peer).to(tl.pointer_type(gathered_ptr.dtype.element_ty))
            tl.store(dst + dst_rows[:, None] + offs_k[None, :], tile, mask=mask)
    if arrive(counter_ptr + rank):
        for j in range(1, W):
            peer = (rank + j) % W
            flag = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + rank * W + rank
            raise_flag(flag, epoch)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _gathered_matmul_kernel(
    x_ptr, gathered_ptr, b_ptr, bias_ptr, y_ptr, flags_ptr, status_ptr,
    n_batch, n, N, K, rank, W, epoch_ptr, timeout,
    stride_xb, stride_xn, stride_bn, stride_bk, stride_bias,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    TIMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grid (tiles of the largest chunk, W): axis 1 is the step, chunk = (rank - step) % W, local first.

    A tile whose peer chunk never arrived (``wait_flag`` timed out) is stored as NaN; the
    launcher raises on the status word.
    """
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    pid = tl.program_id(0)
    step = tl.program_id(1)
    chunk = (rank - step + W) % W
    start_c, len_c = balanced_chunk(chunk, n, W)
    M_c = n_batch * len_c
    num_pid_m = tl.cdiv(M_c, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if pid < num_pid_m * num_pid_n:
        ok = True
        if chunk != rank:
            ok = wait_flag(flags_ptr + chunk * W + chunk, epoch, status_ptr + chunk, timeout, TIMED)
        offs_m, offs_n, mask_m, mask_n = tile_offsets(pid, num_pid_m, num_pid_n, M_c, N, GROUP_M, BLOCK_M, BLOCK_N)
        b_idx, i_idx = chunk_rows(offs_m, len_c, 0)
        g_rows = b_idx * n + start_c + i_idx  # row of the gathered [B_, n, *] tensors
        # The local chunk comes from the shard itself, the others from this rank's workspace.
        a_rows = tl.where(chunk == rank, x_ptr + b_idx * stride_xb + i_idx * stride_xn, gathered_ptr + g_rows * K)
        acc = matmul_tile(a_rows, mask_m, b_ptr, offs_n, mask_n, K, stride_bk, stride_bn,
                          UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = tl.where(ok, acc, float("nan"))
        out = cast_out(acc, y_ptr.dtype.element_ty, ROUND_BF16)
        tl.store(y_ptr + g_rows[:, None] * N + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


_push_tuned = triton.autotune(get_push_configs(), key=["n_batch", "len_p", "K", "W"])(_ag_push_kernel) \
    if AUTOTUNE else None
_gathered_matmul_tuned = gemm_autotuners(_gathered_matmul_kernel, ["n_batch", "n", "N", "K"])


def gathered_matmul_workspace_bytes(batch: int, n: int, K: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Data bytes :func:`ag_push` + :func:`gathered_matmul` need in every rank's workspace: the gathered
    ``[B_, n, K]``."""
    return batch * n * K * dtype.itemsize


def _shard3(op: str, a_shard: torch.Tensor, n: int, rank: int, W: int) -> torch.Tensor:
    """``a_shard [..., len_rank, K]`` as ``[B_, len_rank, K]`` (:func:`~distfuse.kernels._utils.shard_rows`)."""
    return shard_rows(op, a_shard, n, rank, W)


def ag_push(a_shard: torch.Tensor, ws, rank: int, world_size: int, n: int, *, config: dict | None = None) -> None:
    """Produce: copy this rank's shard ``[..., len_rank, K]`` into its rows of every peer's gathered buffer.

    ``n`` is the full extent of the gathered dim.  Raises ``flags[rank, rank]`` on every
    peer when its copy is complete.  Call inside ``ws.in_flight`` on every rank, then
    :func:`gathered_matmul`.
    """
    op = "ag_push"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    x = _shard3(op, a_shard, n, rank, W)
    n_batch, len_p, K = x.shape
    gathered = st.data(x.dtype, n_batch * n * K, op=op, cached=True)
    if W == 1:
        return
    kernel, meta = pick_push_launch(_push_tuned, _ag_push_kernel, config, ws)
    cached_launch(kernel)[tile_grid(n_batch * len_p, K, inner="BLOCK_K", at_least=1)](
        x, gathered, st.data_ptrs, st.flag_ptrs, st.counters,
        n_batch, n, K, len_p, block_range(n, W, rank)[0], rank, W, st.epoch_dev,
        x.stride(0), x.stride(1), **meta,
    )


def gathered_matmul(a_shard: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, n: int, *,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None, config: dict | None = None,
                    return_gathered: bool = False, kernel: str | None = None):
    """Consume: ``y = gather(a) @ weight.T + bias``, local chunk first, waiting on each peer chunk's flag.

    The kernel is :func:`~distfuse.kernels.gathered_matmul_select.select_gather_kernel`'s
    choice, kept as :func:`~distfuse.kernels.gathered_matmul_select.last_gather_choice`.

    Args:
        a_shard: ``[..., len_rank, K]``, the same tensor given to :func:`ag_push`.
        weight: ``[N, K]``, same dtype, any strides.
        n: the full extent of the gathered dim.
        bias: optional ``[N]``; out_dtype: default ``a_shard.dtype``.
        out: optional preallocated contiguous ``[..., n, N]`` (B_ rows of n).
        config: explicit GEMM block sizes (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``; ``PROGRAMS`` for
            the persistent grid).
        return_gathered: also return a copy of the gathered input ``[..., n, K]`` (for a
            weight gradient), taken before the workspace can be reused.
        kernel: the consumer asked for (:data:`~distfuse.kernels.gathered_matmul_select.GATHER_KERNELS`;
            default the persistent one); the selector may run the other and says why.

    Returns:
        ``y`` of shape ``[..., n, N]``, or ``(y, gathered)``.
    """
    op = "gathered_matmul"
    st = claimed_rank_view(op, ws, rank, world_size, a_shard.device)
    W = world_size
    x = _shard3(op, a_shard, n, rank, W)
    n_batch, _, K = x.shape
    if weight.dim() != 2 or weight.shape[1] != K:
        raise expect(op, "weight shape [N, K]", ("N", K), tuple(weight.shape))
    if weight.dtype != x.dtype or weight.device != x.device:
        raise expect(op, "weight dtype and device (the shard's)", (x.dtype, x.device), (weight.dtype, weight.device))
    N = weight.shape[0]
    check_bias(op, bias, N, x.device)
    out_dtype = out_dtype or x.dtype
    out = output_buffer(op, out, (n_batch, n, N), out_dtype, x.device, "[..., n, N]")
    gathered = st.data(x.dtype, n_batch * n * K, op=op, cached=True)
    st.wait_producers()  # collective on CPU
    m_max = n_batch * cdiv(n, W)
    refuse_zero_width_gather(op, return_gathered, N, m_max)
    choice = record_gather_choice(select_gather_kernel(x, weight, kernel))
    if m_max > 0 and N > 0:
        if choice.kernel == "gathered_matmul_persistent":
            launch_gathered_persistent(x, gathered, weight, bias, out, st, rank, W, n, config=config, checked=True)
        else:  # the pointer kernel: grid of the largest chunk's tiles x W steps
            blocks = {k: v for k, v in (config or {}).items() if k != "PROGRAMS"} or None
            pointer, meta = pick_gemm_launch(_gathered_matmul_tuned, _gathered_matmul_kernel, x.dtype, m_max, N,
                                             blocks, ws)
            cached_launch(pointer)[tile_grid(m_max, N, W)](
                x, gathered, weight, bias if bias is not None else out, out, st.flags, st.status,
                n_batch, n, N, K, rank, W, st.epoch_dev, timeout_arg(st), x.stride(0), x.stride(1),
                weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
                HAS_BIAS=bias is not None, UPCAST=INTERPRET, INPUT_PRECISION=input_precision(x.dtype),
                ROUND_BF16=round_bf16(out_dtype), TIMED=TIMED_WAITS, **meta,
            )
        st.check_status(op, "gathered chunks")
    lead = a_shard.shape[:-2]
    y = out if lead == out.shape[:-2] else out.view(*lead, n, N)  # [B_, n, N]: a view only for other leading dims
    return (y, gathered_copy(gathered, (n_batch, n, K), x, n, rank, W).view(*lead, n, K)) if return_gathered else y


def all_gather_matmul(a_shard: torch.Tensor, weight: torch.Tensor, ws, rank: int, world_size: int, n: int, *,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      out: torch.Tensor | None = None, return_gathered: bool = False):
    """One fused op on a real group: claim ``ws``, :func:`ag_push`, :func:`gathered_matmul`.

    ``a_shard [..., len_rank, K] -> [..., n, N]`` (or ``(y, gathered)``); no autograd (see
    :func:`distfuse.fused.all_gather_matmul.all_gather_matmul` for the trainable op).
    """
    with ws.in_flight("all_gather_matmul"):
        ag_push(a_shard, ws, rank, world_size, n)
        return gathered_matmul(a_shard, weight, ws, rank, world_size, n, bias=bias, out_dtype=out_dtype, out=out,
                               return_gathered=return_gathered)


def all_gather_matmul_loopback(shards, weight_list, ws, *, bias: torch.Tensor | None = None,
                               out_dtype: torch.dtype | None = None, outs=None, config: dict | None = None,
                               push_config: dict | None = None) -> list[torch.Tensor]:
    """Every virtual rank of a :class:`~distfuse.fused.workspace.LoopbackWorkspace`: all pushes, then all GEMMs.

    ``weight_list[r]`` is virtual rank r's weight (the same tensor for a plain all-gather
    GEMM).  Returns the W outputs ``[..., n, N]`` in rank order.
    """
    W = ws.world_size
    n = sum(s.shape[-2] for s in shards)
    with ws.in_flight("all_gather_matmul_loopback"):
        for r in range(W):
            ag_push(shards[r], ws, r, W, n, config=push_config)
        return [gathered_matmul(shards[r], weight_list[r], ws, r, W, n, bias=bias, out_dtype=out_dtype,
                                out=None if outs is None else outs[r], config=config) for r in range(W)]


def all_gather_matmul_reference(shards, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference: ``cat(shards, dim=-2) @ weight.T + bias`` in fp32, rounded once to ``out_dtype``."""
    x = torch.cat(list(shards), dim=-2)
    return summed_partials([x.float() @ weight.float().t()], None, bias, out_dtype or x.dtype)

