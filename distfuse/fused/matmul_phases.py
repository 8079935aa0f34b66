"""The fused phases of the GEMM fusions: every kernel launch of every op happens here.

The ops live one per module (shared rules: :mod:`distfuse.fused.matmul_common`).
:mod:`~distfuse.fused.matmul_reduce_scatter` and :mod:`~distfuse.fused.all_gather_matmul`
scatter and gather the sequence dim; their ``_features`` forms are the same pair along the
features (DistDL's own reduce-scatter and all-gather linears).  Each op's backward is its
mirror's forward phase, so both directions of the ops are the functions here:

* :func:`run_matmul_reduce_scatter`: ``x [*, n, K] -> reduce_scatter_n(x @ weight.T) + bias``, ``[*, n_r, N]``
* :func:`run_all_gather_matmul`: ``x [*, n_r, K] -> all_gather_n(x) @ weight.T + bias``, ``[*, n, N]``
* :func:`run_matmul_reduce_scatter_features`: ``x [*, K] -> reduce_scatter_N(x @ weight.T) + bias_r``, ``[*, N_r]``
* :func:`run_all_gather_features_matmul`: ``x [*, K_r] -> all_gather_K(x) @ weight.T + bias``, ``[*, N]``
* :func:`run_matmul_all_reduce`: ``x [*, K_r] -> sum_r (x_r @ weight_r.T + bias_r)``, ``[*, N]`` on every rank

The kernels each launches are in its op module's docstring.  The same phases serve on
transposed operands: :mod:`distfuse.fused.zero_linear` streams ZeRO weight shards with the
all-gather phases and reduce-scatters the weight gradient with the GEMM + reduce-scatter
phases; :mod:`distfuse.fused.matmul_all_reduce`'s backward is :meth:`Comm.reduce_scatter`
(a plain collective), then :func:`run_all_gather_features_matmul`.

Each phase runs inside one claim of the workspace and loops over the ranks of a
:class:`Comm` (this rank, or every virtual rank of a loopback workspace); at world size 1
it is a plain ``F.linear``.  The kernel modules are imported qualified
(``reduce_scatter_kernels.matmul_scatter``): their one-shot ops share the names of the
autograd ops, one floor down.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
import distfuse.kernels.all_gather_matmul as all_gather_kernels
import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
from distfuse import debug
from distfuse.fused.matmul_common import Comm
from distfuse.fused.providers import record_kernel, run_producer, run_push
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels.gathered_matmul_select import last_gather_choice
from distfuse.kernels.signature import (
    GATHER_FLAGS,
    SCATTER_FLAGS,
    check_signatures,
    consumer_flags,
    publish_signature,
    shape_signature,
)

__all__ = ["run_matmul_reduce_scatter", "run_all_gather_matmul", "run_matmul_reduce_scatter_features",
           "run_all_gather_features_matmul", "run_matmul_all_reduce"]


def alloc_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer for a kernel; NaN-filled in debug mode so that an element no kernel wrote shows up."""
    if debug.enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def scatter_signature(x: torch.Tensor, N_out: int, partial_dtype) -> tuple[int, str]:
    """What every rank of a GEMM + reduce-scatter agrees on (its own input features ``K_r`` excepted), hashed,
    and said in words for the error."""
    lead, n = tuple(x.shape[:-2]), x.shape[-2]
    pd = partial_dtype or x.dtype
    what = f"x [*{list(lead)}, n={n}, K_r] of {x.dtype}, N={N_out}, partials {pd}"
    return shape_signature("matmul_reduce_scatter", lead, n, N_out, x.dtype, pd), what


def gather_signature(shard: torch.Tensor, n: int) -> tuple[int, str]:
    """What every rank of an all-gather + GEMM agrees on (its own output features ``N_r`` excepted)."""
    lead, K = tuple(shard.shape[:-2]), shard.shape[-1]
    what = f"x [*{list(lead)}, n_r of n={n}, K={K}] of {shard.dtype}"
    return shape_signature("all_gather_matmul", lead, n, K, shard.dtype), what


def features_scatter_signature(rows: int, N: int, dtype: torch.dtype, partial_dtype) -> tuple[int, str]:
    """What every rank of a GEMM + reduce-scatter along the features agrees on: the rows, ``N``, the dtypes (its own
    input features ``K_r`` excepted: the ZeRO forms' data-parallel workers differ there)."""
    pd = partial_dtype or dtype
    what = f"x [rows={rows}, K_r] of {dtype}, N={N}, partials {pd}"
    return shape_signature("matmul_reduce_scatter_features", rows, N, dtype, pd), what


def features_gather_signature(shard: torch.Tensor, K: int) -> tuple[int, str]:
    """What every rank of an all-gather along the features + GEMM agrees on (its own output features excepted)."""
    rows = math.prod(shard.shape[:-1])
    what = f"x [rows={rows}, K_r of K={K}] of {shard.dtype}"
    return shape_signature("all_gather_features_matmul", rows, K, shard.dtype), what


def all_reduce_signature(algorithm: str, rows: int, N: int, dtype: torch.dtype, partial_dtype) -> tuple[int, str]:
    """What every rank of a GEMM + all-reduce agrees on: the algorithm, the rows, ``N`` and the dtypes."""
    pd = partial_dtype or dtype
    what = f"{algorithm} over x [rows={rows}, K_r] of {dtype}, N={N}, partials {pd}"
    return shape_signature("matmul_all_reduce", algorithm, rows, N, dtype, pd), what


def run_matmul_reduce_scatter(comm: Comm, op: str, xs, weights, biases, n: int, partial_dtype,
                              nbytes: int, provider: str | None = None) -> list[torch.Tensor]:
    """GEMM + reduce-scatter for every rank of ``comm``, in one claim: ``x [*, n, K] -> [*, n_r, N_out]``.

    ``weights[i]`` is ``[N_out, K]`` (any strides); ``biases[i]`` ``[N_out]`` or None.
    Every producer runs before any reducer: in loopback the reducers read every virtual
    rank's partials.  ``provider``: the producer, through :func:`~distfuse.fused.providers.run_producer`
    (None: the Triton ``matmul_scatter`` launched directly).
    """
    W = comm.world_size
    if W == 1:
        return [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases, strict=True)]
    ws = comm.workspace(op, nbytes, SCATTER_FLAGS)
    lead = xs[0].shape[:-2]
    B = math.prod(lead)
    N_out = weights[0].shape[0]
    outs = []
    sig, what = scatter_signature(xs[0], N_out, partial_dtype)
    with ws.in_flight(op):
        for r, x, w in zip(comm.ranks, xs, weights, strict=True):
            publish_signature(ws, r, W, sig, op)
            if provider is None:
                reduce_scatter_kernels.matmul_scatter(x, w, ws, r, W, partial_dtype=partial_dtype or x.dtype)
            else:
                run_producer(provider, x, w, ws, r, W, partial_dtype or x.dtype)
        for r, x, b in zip(comm.ranks, xs, biases, strict=True):
            len_r = block_extent(n, W, r)
            out = alloc_output((B, len_r, N_out), x.dtype, x.device)
            reduce_scatter_kernels.chunk_reduce(ws, r, W, B, n, N_out, partial_dtype=partial_dtype or x.dtype, bias=b,
                                                out_dtype=x.dtype, out=out)
            check_signatures(ws, r, W, sig, out, **consumer_flags(SCATTER_FLAGS, r, W), op=op, what=what)
            outs.append(out.view(*lead, len_r, N_out))
    return outs


def run_all_gather_matmul(comm: Comm, op: str, shards, weights, biases, n: int, return_gathered: bool, nbytes: int,
                          push: str = "triton"):
    """All-gather + GEMM for every rank of ``comm``, in one claim: ``shard [*, n_r, K] -> [*, n, N_out]``.

    Returns ``(ys, gathered)``; ``gathered[i]`` is the gathered ``[*, n, K]`` when
    ``return_gathered`` (else None).  Every push is issued before any GEMM (see the kernels'
    module doc: a grid of spinning GEMM programs must never keep a push from running).
    ``push``: the provider of the push (:data:`distfuse.fused.providers.PUSHES`).
    """
    W = comm.world_size
    if W == 1:
        ys = [F.linear(x, w, b) for x, w, b in zip(shards, weights, biases, strict=True)]
        return ys, [x if return_gathered else None for x in shards]
    ws = comm.workspace(op, nbytes, GATHER_FLAGS)
    ys, gathered = [], []
    sig, what = gather_signature(shards[0], n)
    with ws.in_flight(op):
        for r, x in zip(comm.ranks, shards, strict=True):
            publish_signature(ws, r, W, sig, op)
            if push == "triton":
                all_gather_kernels.ag_push(x, ws, r, W, n)
            else:
                run_push(push, x, ws, r, W, n)
        for r, x, w, b in zip(comm.ranks, shards, weights, biases, strict=True):
            lead = x.shape[:-2]
            out = alloc_output((*lead, n, w.shape[0]), x.dtype, x.device)
            # A zero-width weight launches no GEMM (hence no flag wait): its gathered copy would race, and
            # the caller's product with it is empty anyway.
            want = return_gathered and w.shape[0] > 0
            res = all_gather_kernels.gathered_matmul(x, w, ws, r, W, n, bias=b, out=out, return_gathered=want)
            if w.shape[0] > 0 and not op.endswith(".backward"):
                # The consumer kernel that ran, under the op's name ("<op>.forward" -> "<op>"), for the layers'
                # last_decision and the benchmarks; a backward's gather never overwrites its forward's producer.
                record_kernel(op.split(".")[0], last_gather_choice())
            check_signatures(ws, r, W, sig, out, **consumer_flags(GATHER_FLAGS, r, W), op=op, what=what)
            y, g = res if want else (res, x.new_zeros(*lead, n, x.shape[-1]) if return_gathered else None)
            ys.append(y)
            gathered.append(g)
    return ys, gathered


def run_matmul_reduce_scatter_features(comm: Comm, op: str, xs, weights, biases, partial_dtype,
                                       nbytes: int) -> list[torch.Tensor]:
    """GEMM + reduce-scatter along the features for every rank of ``comm``, in one claim: ``x [*, K] -> [*, N_r]``.

    ``weights[i]`` is ``[N, K]`` (any strides); ``biases[i]`` this rank's ``[N_r]`` block or
    None.  Every producer runs before any reducer (loopback reads every virtual rank's partials).
    """
    W = comm.world_size
    if W == 1:
        return [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases, strict=True)]
    ws = comm.workspace(op, nbytes, SCATTER_FLAGS)
    N = weights[0].shape[0]
    outs = []
    sig, what = features_scatter_signature(math.prod(xs[0].shape[:-1]), N, xs[0].dtype, partial_dtype)
    with ws.in_flight(op):
        for r, x, w in zip(comm.ranks, xs, weights, strict=True):
            publish_signature(ws, r, W, sig, op)
            rs_features_kernels.matmul_scatter_columns(x, w, ws, r, W, partial_dtype=partial_dtype or x.dtype)
        for r, x, b in zip(comm.ranks, xs, biases, strict=True):
            rows, len_r = math.prod(x.shape[:-1]), block_extent(N, W, r)
            out = alloc_output((rows, len_r), x.dtype, x.device)
            rs_features_kernels.column_reduce(ws, r, W, rows, N, partial_dtype=partial_dtype or x.dtype, bias=b,
                                              out_dtype=x.dtype, out=out)
            check_signatures(ws, r, W, sig, out, **consumer_flags(SCATTER_FLAGS, r, W), op=op, what=what)
            outs.append(out.view(*x.shape[:-1], len_r))
    return outs


def run_all_gather_features_matmul(comm: Comm, op: str, shards, weights, biases, return_gathered: bool, nbytes: int):
    """All-gather along the features + GEMM for every rank of ``comm``, in one claim: ``[*, K_r] -> [*, N_out]``.

    ``weights[i]`` is ``[N_out, K]`` (all K input features).  Returns ``(ys, gathered)``;
    ``gathered[i]`` is the gathered ``[*, K]`` when ``return_gathered`` (else None).
    Every push runs before any GEMM.
    """
    W = comm.world_size
    if W == 1:
        ys = [F.linear(x, w, b) for x, w, b in zip(shards, weights, biases, strict=True)]
        return ys, [x if return_gathered else None for x in shards]
    ws = comm.workspace(op, nbytes, GATHER_FLAGS)
    K = weights[0].shape[1]
    ys, gathered = [], []
    sig, what = features_gather_signature(shards[0], K)
    with ws.in_flight(op):
        for r, x in zip(comm.ranks, shards, strict=True):
            publish_signature(ws, r, W, sig, op)
            ag_features_kernels.ag_push_columns(x, ws, r, W, K)
        for r, x, w, b in zip(comm.ranks, shards, weights, biases, strict=True):
            rows = math.prod(x.shape[:-1])
            out = alloc_output((rows, w.shape[0]), x.dtype, x.device)
            if return_gathered and w.shape[0] == 0:
                # A zero-width weight launches no GEMM, hence no flag wait; the gathered copy comes from the
                # copy kernel that waits for each chunk (a rank with no input features of matmul_all_reduce
                # still needs it for its bias gradient).
                ys.append(out.view(*x.shape[:-1], 0))
                g = all_reduce_kernels.gather_columns(x.reshape(rows, x.shape[-1]), ws, r, W, K)
                check_signatures(ws, r, W, sig, g, **consumer_flags(GATHER_FLAGS, r, W), op=op, what=what)
                gathered.append(g.view(*x.shape[:-1], K))
                continue
            res = ag_features_kernels.gathered_k_matmul(x, w, ws, r, W, bias=b, out=out,
                                                        return_gathered=return_gathered)
            check_signatures(ws, r, W, sig, out, **consumer_flags(GATHER_FLAGS, r, W), op=op, what=what)
            ys.append(res[0] if return_gathered else res)
            gathered.append(res[1] if return_gathered else None)
    return ys, gathered


def run_matmul_all_reduce(comm: Comm, op: str, xs, weights, biases, algorithm: str, partial_dtype,
                          nbytes: int) -> list[torch.Tensor]:
    """GEMM + all-reduce for every rank of ``comm``: ``x [*, K_r] -> [*, N]``, the same on every rank.

    ``biases[i]`` is added to rank i's partial (None where a rank adds none).  ``"one_shot"``:
    one claim; ``"two_shot"``: a reduce-scatter claim, then an all-gather claim.
    """
    W = comm.world_size
    if W == 1:
        return [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases, strict=True)]
    # Both algorithms' first claim is a reduce-scatter layout (one-shot: flags[r, s] of slot s on rank r).
    ws = comm.workspace(op, nbytes, SCATTER_FLAGS)
    N = weights[0].shape[0]
    rows = math.prod(xs[0].shape[:-1])
    pd = partial_dtype or xs[0].dtype
    outs = [alloc_output((rows, N), x.dtype, x.device) for x in xs]
    sig, what = all_reduce_signature(algorithm, rows, N, xs[0].dtype, partial_dtype)
    if algorithm == "one_shot":
        with ws.in_flight(op):
            for r, x, w, b in zip(comm.ranks, xs, weights, biases, strict=True):
                publish_signature(ws, r, W, sig, op)
                all_reduce_kernels.matmul_push(x, w, ws, r, W, partial_dtype=pd, bias=b)
            for r, x, out in zip(comm.ranks, xs, outs, strict=True):
                all_reduce_kernels.all_reduce_slots(ws, r, W, rows, N, partial_dtype=pd, out_dtype=x.dtype, out=out)
                check_signatures(ws, r, W, sig, out, **consumer_flags(SCATTER_FLAGS, r, W), op=op, what=what)
    else:
        # Claim 1 checks the signature; claim 2's extents follow from what claim 1 agreed on.
        with ws.in_flight(f"{op}.reduce_scatter"):
            for r, x, w, b in zip(comm.ranks, xs, weights, biases, strict=True):
                publish_signature(ws, r, W, sig, op)
                rs_features_kernels.matmul_scatter_columns(x, w, ws, r, W, partial_dtype=pd, bias=b)
            owns = []
            for r, x in zip(comm.ranks, xs, strict=True):
                own = rs_features_kernels.column_reduce(ws, r, W, rows, N, partial_dtype=pd, out_dtype=x.dtype)
                check_signatures(ws, r, W, sig, own, **consumer_flags(SCATTER_FLAGS, r, W), op=op, what=what)
                owns.append(own)
        with ws.in_flight(f"{op}.all_gather"):
            for r, own in zip(comm.ranks, owns, strict=True):
                ag_features_kernels.ag_push_columns(own, ws, r, W, N)
            for r, own, out in zip(comm.ranks, owns, outs, strict=True):
                all_reduce_kernels.gather_columns(own, ws, r, W, N, out=out)
    return [out.view(*x.shape[:-1], N) for x, out in zip(xs, outs, strict=True)]

