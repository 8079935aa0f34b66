"""The GEMM fusions' one pipeline, produce-and-scatter and gather-and-consume, and the linears built on it.

Every kernel launch of the fused linears happens here.  Two phases, parametrised by the
axis they split (``"rows"``: the sequence dim ``n``; ``"features"``), the workers of the
collective (a :class:`~distfuse.fused.matmul_common.Comm`: this rank of a group, or every
virtual rank of a loopback workspace) and the operands (``*`` any leading dims, ``_r`` the
balanced block ``r`` of the ``W`` workers)::

    produce_and_scatter  rows      x [*, n, K]     -> reduce_scatter_n(x @ w.T) + b     [*, n_r, N]
                                   matmul_scatter (or a provider's producer) + chunk_reduce
                         features  x [*, K]        -> reduce_scatter_N(x @ w.T) + b_r   [*, N_r]
                                   matmul_scatter_columns + column_reduce
    gather_and_consume   rows      x [*, n_r, K]   -> all_gather_n(x) @ w.T + b         [*, n, N]
                                   ag_push (or the copy engine's push) + gathered_matmul
                         features  x [*, K_r]      -> all_gather_K(x) @ w.T + b         [*, N]
                                   ag_push_columns + gathered_k_matmul

The two are each other's adjoint, so a fused linear is one of them forward and the other
backward, on ``W.t()`` (:class:`PipelineLinear`; each op module declares its ``SPEC``)::

    op                               axis      forward              dgrad (the mirror)
    matmul_reduce_scatter            rows      produce_and_scatter  gather_and_consume(dy), hands back g for dW
    matmul_reduce_scatter_features   features  produce_and_scatter  gather_and_consume(dy), hands back g for dW
    all_gather_matmul                rows      gather_and_consume   produce_and_scatter(dy); g kept or regathered
    all_gather_features_matmul       features  gather_and_consume   produce_and_scatter(dy); g kept or regathered

The same phases serve on transposed operands: :mod:`distfuse.fused.zero_linear` streams ZeRO
weight shards with gather-and-consume and reduce-scatters the weight gradient with
produce-and-scatter; :mod:`distfuse.fused.matmul_all_reduce` is a PipelineLinear with a
forward phase of its own (:func:`run_matmul_all_reduce`) that gathers-and-consumes its gradient.

Each phase runs inside one claim of the workspace: it publishes the call's signature and
launches every rank's producer (or push) before any consumer (in loopback the consumers
read every virtual rank's partials; a grid of spinning GEMM programs must never keep a push
from running), then checks the signatures after each consumer.  At world size 1 a phase is
a plain ``F.linear``.  The kernel modules are imported qualified
(``reduce_scatter_kernels.matmul_scatter``): their one-shot ops share the names of the
autograd ops, one floor down.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
import distfuse.kernels.all_gather_matmul as all_gather_kernels
import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
from distfuse import debug
from distfuse.errors import PartitionError, UnsupportedError, expect, where
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    Done,
    Phases,
    check_loopback_counts,
    check_partial_dtype,
    flat_rows,
    require_available,
    run_phases,
)
from distfuse.fused.providers import pick_provider, record_kernel, run_producer, run_push
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels.gathered_matmul_select import last_gather_choice
from distfuse.kernels.matmul_scatter_select import KernelChoice
from distfuse.kernels.signature import (
    GATHER_FLAGS,
    SCATTER_FLAGS,
    check_signatures,
    consumer_flags,
    publish_signature,
    shape_signature,
)

__all__ = ["produce_and_scatter", "gather_and_consume", "run_matmul_all_reduce", "PipelineLinear", "LinearPlan",
           "AXES", "BIAS_GRADS"]

AXES = ("rows", "features")
#: How a produce-and-scatter op's bias gradient is taken (see :mod:`distfuse.fused.matmul_reduce_scatter`).
BIAS_GRADS = ("partial", "sum")


def alloc_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer for a kernel; NaN-filled in debug mode so that an element no kernel wrote shows up."""
    if debug.enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


class _Rows:
    """The kernel pairs of the sequence dim.  The signatures say what every rank agrees on (its own split
    features excepted), hashed, and in words for the error."""

    def scatter_signature(self, x: torch.Tensor, N: int, partial_dtype) -> tuple[int, str]:
        lead, n, pd = tuple(x.shape[:-2]), x.shape[-2], partial_dtype or x.dtype
        what = f"x [*{list(lead)}, n={n}, K_r] of {x.dtype}, N={N}, partials {pd}"
        return shape_signature("matmul_reduce_scatter", lead, n, N, x.dtype, pd), what

    def produce(self, x, w, ws, r: int, W: int, pd, provider: str | None) -> None:
        if provider in (None, "triton"):
            reduce_scatter_kernels.matmul_scatter(x, w, ws, r, W, partial_dtype=pd)
        else:
            run_producer(provider, x, w, ws, r, W, pd)

    def reduce(self, ws, r: int, W: int, x, N: int, pd, bias, agreement) -> torch.Tensor:
        lead, n = x.shape[:-2], x.shape[-2]
        B, len_r = math.prod(lead), block_extent(n, W, r)
        out = alloc_output((B, len_r, N), x.dtype, x.device)
        reduce_scatter_kernels.chunk_reduce(ws, r, W, B, n, N, partial_dtype=pd, bias=bias, out_dtype=x.dtype,
                                            out=out, agreement=agreement)
        return out.view(*lead, len_r, N)

    def gather_signature(self, shard: torch.Tensor, n: int) -> tuple[int, str]:
        lead, K = tuple(shard.shape[:-2]), shard.shape[-1]
        what = f"x [*{list(lead)}, n_r of n={n}, K={K}] of {shard.dtype}"
        return shape_signature("all_gather_matmul", lead, n, K, shard.dtype), what

    def push(self, x, ws, r: int, W: int, n: int, push: str | None) -> None:
        run_push(push or "triton", x, ws, r, W, n)

    def consume(self, op: str, ws, r: int, W: int, x, w, b, n: int, return_gathered: bool):
        """``(y, gathered or None, the tensor the signature check poisons)``."""
        lead = x.shape[:-2]
        out = alloc_output((*lead, n, w.shape[0]), x.dtype, x.device)
        # A zero-width weight launches no GEMM (hence no flag wait): its gathered copy would race, and the caller's
        # product with it is empty anyway.
        want = return_gathered and w.shape[0] > 0
        res = all_gather_kernels.gathered_matmul(x, w, ws, r, W, n, bias=b, out=out, return_gathered=want)
        if w.shape[0] > 0 and not op.endswith(".backward"):
            # The consumer kernel that ran, under the op's name ("<op>.forward" -> "<op>"), for the layers'
            # last_decision and the benchmarks; a backward's gather never overwrites its forward's producer.
            record_kernel(op.split(".")[0], last_gather_choice())
        y, g = res if want else (res, x.new_zeros(*lead, n, x.shape[-1]) if return_gathered else None)
        return y, g, out


class _Features:
    """The kernel pairs of the features (all rows on every rank; the ZeRO forms' data-parallel workers differ
    in their split features, which the signatures leave out)."""

    def scatter_signature(self, x: torch.Tensor, N: int, partial_dtype) -> tuple[int, str]:
        rows, pd = math.prod(x.shape[:-1]), partial_dtype or x.dtype
        what = f"x [rows={rows}, K_r] of {x.dtype}, N={N}, partials {pd}"
        return shape_signature("matmul_reduce_scatter_features", rows, N, x.dtype, pd), what

    def produce(self, x, w, ws, r: int, W: int, pd, provider: str | None) -> None:
        rs_features_kernels.matmul_scatter_columns(x, w, ws, r, W, partial_dtype=pd)

    def reduce(self, ws, r: int, W: int, x, N: int, pd, bias, agreement) -> torch.Tensor:
        rows, len_r = math.prod(x.shape[:-1]), block_extent(N, W, r)
        out = alloc_output((rows, len_r), x.dtype, x.device)
        rs_features_kernels.column_reduce(ws, r, W, rows, N, partial_dtype=pd, bias=bias, out_dtype=x.dtype, out=out,
                                          agreement=agreement)
        return out.view(*x.shape[:-1], len_r)

    def gather_signature(self, shard: torch.Tensor, K: int) -> tuple[int, str]:
        rows = math.prod(shard.shape[:-1])
        what = f"x [rows={rows}, K_r of K={K}] of {shard.dtype}"
        return shape_signature("all_gather_features_matmul", rows, K, shard.dtype), what

    def push(self, x, ws, r: int, W: int, K: int, push: str | None) -> None:
        ag_features_kernels.ag_push_columns(x, ws, r, W, K)

    def consume(self, op: str, ws, r: int, W: int, x, w, b, K: int, return_gathered: bool):
        rows, lead = math.prod(x.shape[:-1]), x.shape[:-1]
        out = alloc_output((rows, w.shape[0]), x.dtype, x.device)
        if return_gathered and w.shape[0] == 0:
            # A zero-width weight launches no GEMM, hence no flag wait; the gathered copy comes from the copy kernel
            # that waits for each chunk (a rank with no input features of matmul_all_reduce still needs it for its
            # bias gradient).
            g = all_reduce_kernels.gather_columns(x.reshape(rows, x.shape[-1]), ws, r, W, K)
            return out.view(*lead, 0), g.view(*lead, K), g
        res = ag_features_kernels.gathered_k_matmul(x, w, ws, r, W, bias=b, out=out, return_gathered=return_gathered)
        y, g = res if return_gathered else (res, None)
        return y, g, out


_KERNELS = {"rows": _Rows(), "features": _Features()}


def produce_and_scatter(comm: Comm, op: str, xs, weights, biases, *, axis: str, partial_dtype, nbytes: int,
                        provider: str | None = None) -> list[torch.Tensor]:
    """GEMM + reduce-scatter along ``axis`` for every rank of ``comm``, in one claim (shapes: the module doc).

    ``weights[i]`` is ``[N, K]`` (any strides); ``biases[i]`` ``[N]`` (rows) or this rank's
    ``[N_r]`` block (features), or None.  ``provider``: the producer of the rows
    (:func:`~distfuse.fused.providers.run_producer`), recorded as the kernel that ran
    (:func:`~distfuse.fused.providers.last_kernel`); None: the Triton ``matmul_scatter``, unrecorded.
    """
    W = comm.world_size
    if provider is not None and (W == 1 or provider == "triton"):
        # Recorded like run_producer's choices: one world has no producer at all.
        record_kernel(op.split(".")[0], KernelChoice(provider, "matmul_scatter", "one program per tile, pointer loads")
                      if W > 1 else KernelChoice(provider, "F.linear", "world size 1: a local GEMM"))
    if W == 1:
        return [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases, strict=True)]
    kernels = _KERNELS[axis]
    ws = comm.workspace(op, nbytes, SCATTER_FLAGS)
    N, pd = weights[0].shape[0], partial_dtype or xs[0].dtype
    sig, what = kernels.scatter_signature(xs[0], N, partial_dtype)
    outs = []
    with ws.in_flight(op):
        for r, x, w in zip(comm.ranks, xs, weights, strict=True):
            publish_signature(ws, r, W, sig, op)
            kernels.produce(x, w, ws, r, W, pd, provider)
        for r, x, b in zip(comm.ranks, xs, biases, strict=True):
            outs.append(kernels.reduce(ws, r, W, x, N, pd, b, (sig, what)))  # the signatures checked in the kernel
    return outs


def gather_and_consume(comm: Comm, op: str, shards, weights, biases, *, axis: str, extent: int,
                       return_gathered: bool, nbytes: int, push: str | None = None):
    """All-gather along ``axis`` + GEMM for every rank of ``comm``, in one claim (shapes: the module doc).

    ``extent``: the gathered extent (``n``, or ``K``); ``weights[i]`` is ``[N, K]`` (all K
    input features, any strides).  Returns ``(ys, gathered)``: ``gathered[i]`` the gathered
    input when ``return_gathered`` (else None).  ``push``: the push of the rows
    (:func:`distfuse.fused.providers.run_push`; None: the Triton one).
    """
    W = comm.world_size
    if W == 1:
        ys = [F.linear(x, w, b) for x, w, b in zip(shards, weights, biases, strict=True)]
        return ys, [x if return_gathered else None for x in shards]
    kernels = _KERNELS[axis]
    ws = comm.workspace(op, nbytes, GATHER_FLAGS)
    sig, what = kernels.gather_signature(shards[0], extent)
    ys, gathered = [], []
    with ws.in_flight(op):
        for r, x in zip(comm.ranks, shards, strict=True):
            publish_signature(ws, r, W, sig, op)
            kernels.push(x, ws, r, W, extent, push)
        for r, x, w, b in zip(comm.ranks, shards, weights, biases, strict=True):
            y, g, out = kernels.consume(op, ws, r, W, x, w, b, extent, return_gathered)
            check_signatures(ws, r, W, sig, out, **consumer_flags(GATHER_FLAGS, r, W), op=op, what=what)
            ys.append(y)
            gathered.append(g)
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
    # What every rank agrees on: the algorithm, the rows, N and the dtypes.
    what = f"{algorithm} over x [rows={rows}, K_r] of {xs[0].dtype}, N={N}, partials {pd}"
    sig = shape_signature("matmul_all_reduce", algorithm, rows, N, xs[0].dtype, pd)
    if algorithm == "one_shot":
        with ws.in_flight(op):
            for r, x, w, b in zip(comm.ranks, xs, weights, biases, strict=True):
                publish_signature(ws, r, W, sig, op)
                all_reduce_kernels.matmul_push(x, w, ws, r, W, partial_dtype=pd, bias=b)
            for r, x, out in zip(comm.ranks, xs, outs, strict=True):
                all_reduce_kernels.all_reduce_slots(ws, r, W, rows, N, partial_dtype=pd, out_dtype=x.dtype, out=out,
                                                    agreement=(sig, what))
    else:
        # Claim 1 checks the signature; claim 2's extents follow from what claim 1 agreed on.
        with ws.in_flight(f"{op}.reduce_scatter"):
            for r, x, w, b in zip(comm.ranks, xs, weights, biases, strict=True):
                publish_signature(ws, r, W, sig, op)
                rs_features_kernels.matmul_scatter_columns(x, w, ws, r, W, partial_dtype=pd, bias=b)
            owns = []
            for r, x in zip(comm.ranks, xs, strict=True):
                owns.append(rs_features_kernels.column_reduce(ws, r, W, rows, N, partial_dtype=pd, out_dtype=x.dtype,
                                                              agreement=(sig, what)))
        with ws.in_flight(f"{op}.all_gather"):
            for r, own in zip(comm.ranks, owns, strict=True):
                ag_features_kernels.ag_push_columns(own, ws, r, W, N)
            for r, own, out in zip(comm.ranks, owns, outs, strict=True):
                all_reduce_kernels.gather_columns(own, ws, r, W, N, out=out)
    return [out.view(*x.shape[:-1], N) for x, out in zip(xs, outs, strict=True)]


class LinearPlan(NamedTuple):
    """What a :class:`PipelineLinear`'s phases run on, for one call."""

    comm: Comm
    k: int  # tensors per kind: the ranks this process launches
    extent: int  # along the axis: n, or the features the op scatters (N) or gathers (K)
    keep_gathered: bool  # a gathering op keeps its gathered input for dW (else it gathers it again)
    partial_dtype: torch.dtype | None
    nbytes: int  # the op's workspace request, both phases
    provider: str | None  # the forward's kernel choice: producer or push (None: the Triton one), or algorithm
    grad: str  # how the gradient is taken: the op's grad_option (a scattering op's bias_grad, BIAS_GRADS)


class PipelineLinear:
    """One fused linear on the pipeline, declared by its ``name``, its ``axis`` and whether its forward
    ``scatters`` (produce-and-scatter; else it gathers and consumes).

    A subclass gives its own checks (:meth:`check`) and workspace rule (:meth:`nbytes`); its
    plan, loopback form, shapes and autograd are the ones here (matmul_all_reduce also gives its
    phases, its kernel choice and its gradient option).  The backward is the mirror
    phase on ``W.t()``: a scattering op's dgrad gathers ``dy`` and hands the gathered copy back
    for ``dW = g.T @ x``; a gathering op's scatters ``dy @ W`` while the input is gathered again
    (a pending ``.wait()``, overlapping the dgrad on CUDA) unless the forward kept it
    (``keep_gathered``), for ``dW = dy.T @ g``.  ``db`` is the sum of ``dy`` over this rank's rows,
    all-reduced over the group (in fp32) where ``bias_grad == "sum"``.
    """

    name = ""
    axis = "rows"
    scatters = True
    #: The keywords (in messages) of how the gradient is taken and of the forward's kernel choice; the former's values.
    grad_option, choice_option, grad_values = "bias_grad", "provider", BIAS_GRADS
    #: Every rank passes a bias, or none (matmul_all_reduce: any rank may).
    bias_alike = True

    def check(self, op: str, x, weight, bias, W: int, r: int, extent: int | None, device) -> int:
        """Rank ``r``'s local checks (``device``: the group's, None in loopback); returns the extent along the axis.

        ``extent``: the gathered extent where the caller knows it (the sum of the blocks in
        loopback, ``n`` for all_gather_matmul), else None.
        """
        raise NotImplementedError

    def nbytes(self, x, weight, extent: int | None, W: int, partial_dtype) -> int:
        """The op's ``*_workspace_bytes`` for this call (also estimated from bad arguments, see ``refusal``)."""
        raise NotImplementedError

    def request(self, x, weight, extent: int | None, W: int, partial_dtype, choice: str | None) -> int:
        """The workspace bytes for the forward's kernel ``choice`` (the caller's, or picked): :meth:`nbytes`."""
        return self.nbytes(x, weight, extent, W, partial_dtype)

    def choose(self, x, weight, extent: int, W: int, choice: str | None) -> str | None:
        """The forward's kernel choice from the caller's: the rows' producer or push, none along the features."""
        if self.axis == "rows":
            return pick_provider(self.name, choice, x, math.prod(x.shape[:-2]) * extent, weight.shape[0], W)
        return None

    def settle(self, op: str, x, weight, extent: int, W: int, partial_dtype, grad: str, choice: str | None):
        """The call's options checked (after :meth:`check`); returns the forward's kernel choice."""
        if grad not in self.grad_values:
            raise expect(op, self.grad_option, " or ".join(self.grad_values), repr(grad), cls=UnsupportedError)
        check_partial_dtype(op, partial_dtype)
        return self.choose(x, weight, extent, W, choice)

    def agreed_extent(self, P_sub, x, n: int | None) -> int | None:
        """The extent the ranks agree on before any check: None (the checks take it from the shapes), or for
        all_gather_matmul the gathered sequence extent ``n``."""
        return None

    @functools.cached_property
    def phases(self) -> Phases:
        """The op's autograd (:class:`~distfuse.fused.matmul_common.Phases`)."""
        return Phases(self.forward, self.backward)

    def signature(self, x, weight, extent: int, partial_dtype) -> tuple[int, str]:
        kernels = _KERNELS[self.axis]
        if self.scatters:
            return kernels.scatter_signature(x, weight.shape[0], partial_dtype)
        return kernels.gather_signature(x, extent)

    def plan(self, x, weight, bias, P_sub, *, n: int | None = None, keep_gathered: bool = True,
             partial_dtype=None, bias_grad: str = "partial", provider: str | None = None) -> LinearPlan:
        """The op's checks and plan for one call on ``P_sub`` (collective where the checks refuse, see
        :mod:`distfuse.fused.agreement`)."""
        op = self.name
        if not P_sub.active:
            raise PartitionError(f"{where(op)}: this rank is not in P_sub {list(P_sub.ranks)}")
        W, r = P_sub.size, P_sub.rank
        extent = self.agreed_extent(P_sub, x, n)  # before any check: a rank whose checks fail takes part too
        with refusal(op, P_sub, x, SCATTER_FLAGS if self.scatters else GATHER_FLAGS,
                     nbytes=lambda: self.request(x, weight, extent, W, partial_dtype, provider)):
            extent = self.check(op, x, weight, bias, W, r, extent, P_sub.device)
            provider = self.settle(op, x, weight, extent, W, partial_dtype, bias_grad, provider)
        require_available(op, P_sub, x.device)
        same = {"dtype": str(x.dtype), "partial_dtype": str(partial_dtype), self.choice_option: provider}
        info = dict(x=tuple(x.shape), weight=tuple(weight.shape))
        (same if self.bias_alike else info)["bias"] = bias is not None
        if self.axis == "rows":
            same.update(n=extent, lead=tuple(x.shape[:-2]))
        else:
            same.update(rows=math.prod(x.shape[:-1]))
        if self.scatters:
            same.update({"N": weight.shape[0], self.grad_option: bias_grad})
        else:
            same.update(K=weight.shape[1], keep_gathered=bool(keep_gathered))
        debug.check_agreement(op, P_sub.ranks, P_sub.meta_group, same=same, info=info)
        return LinearPlan(Comm(P=P_sub, device=x.device), 1, extent, bool(keep_gathered), partial_dtype,
                          self.request(x, weight, extent, W, partial_dtype, provider), provider, bias_grad)

    def __call__(self, x, weight, bias, P_sub, **options) -> torch.Tensor:
        """The op on this rank, autograd-aware (``options``: :meth:`plan`'s)."""
        return run_phases(self.phases, self.plan(x, weight, bias, P_sub, **options), [x], [weight], [bias])[0]

    def loopback(self, xs, weights, biases, ws, *, keep_gathered: bool = True, partial_dtype=None,
                 bias_grad: str = "partial", provider: str | None = None) -> list[torch.Tensor]:
        """The op for all W virtual ranks of a loopback workspace ``ws``, in one process, autograd-aware.

        ``xs[r]``, ``weights[r]`` and ``biases[r]`` (or ``biases=None``) are virtual rank ``r``'s,
        checked as rank ``r`` of a group would check them, and alike as the signatures the ranks
        of a group agree on.
        """
        op, W = f"{self.name}_loopback", ws.world_size
        check_loopback_counts(op, W, xs, weights, biases)
        dim = -2 if self.axis == "rows" else -1
        extent = None if self.scatters else sum(x.shape[dim] for x in xs)
        whats = []
        for r, (x, w) in enumerate(zip(xs, weights, strict=True)):
            extent_r = self.check(op, x, w, None if biases is None else biases[r], W, r, extent, None)
            whats.append((self.signature(x, w, extent_r, partial_dtype)[1], x.device))
            if whats[r] != (whats[0][0], ws.device):
                raise expect(op, f"x[{r}] and weights[{r}] like virtual rank 0's (the signature a group agrees on) "
                             "and on the workspace's device", (whats[0][0], ws.device), whats[r])
        x0, w0 = xs[0], weights[0]
        provider = self.settle(op, x0, w0, extent_r, W, partial_dtype, bias_grad, provider)
        plan = LinearPlan(Comm(loopback=ws), W, extent_r, bool(keep_gathered), partial_dtype,
                          self.request(x0, w0, extent_r, W, partial_dtype, provider), provider, bias_grad)
        return run_phases(self.phases, plan, xs, weights, biases)

    def out_shape(self, x, weight, W: int, r: int, n: int) -> tuple[int, ...]:
        """``y``'s shape from the inputs' (``n``: the gathered sequence extent of a gathering op on the rows)."""
        if self.axis == "rows":
            return (*x.shape[:-2], block_extent(x.shape[-2], W, r) if self.scatters else n, weight.shape[0])
        return (*x.shape[:-1], block_extent(weight.shape[0], W, r) if self.scatters else weight.shape[0])

    def kept_shapes(self, x, weight, keep_gathered: bool, need_dw: bool, n: int) -> list[tuple[int, ...]]:
        """The shapes of the forward's extras: a gathering op's gathered input, when kept for ``dW``."""
        if self.scatters or not (keep_gathered and need_dw):
            return []
        return [(*x.shape[:-2], n, x.shape[-1]) if self.axis == "rows" else (*x.shape[:-1], weight.shape[1])]

    def forward(self, plan: LinearPlan, needs, xs, weights, biases):
        op = f"{self.name}.forward"
        if self.scatters:
            return produce_and_scatter(plan.comm, op, xs, weights, biases, axis=self.axis,
                                       partial_dtype=plan.partial_dtype, nbytes=plan.nbytes,
                                       provider=plan.provider), []
        keep = plan.keep_gathered and needs[1]
        ys, gathered = gather_and_consume(plan.comm, op, xs, weights, biases, axis=self.axis, extent=plan.extent,
                                          return_gathered=keep, nbytes=plan.nbytes, push=plan.provider)
        return ys, list(gathered) if keep else []

    def backward(self, plan: LinearPlan, needs, xs, weights, biases, extras, dys):
        need_dx, need_dw, need_db = needs
        op, comm, k = f"{self.name}.backward", plan.comm, len(dys)
        dxs, dws, dbs = [None] * k, [None] * k, [None] * k
        if self.scatters and (need_dx or need_dw):
            gxs, gathered = gather_and_consume(comm, op, dys, [w.t() for w in weights], [None] * k, axis=self.axis,
                                               extent=plan.extent, return_gathered=need_dw, nbytes=plan.nbytes)
            dxs = gxs if need_dx else dxs
            if need_dw:
                dws = [flat_rows(g).t() @ flat_rows(x) for g, x in zip(gathered, xs, strict=True)]
        elif not self.scatters:
            gather = None
            if need_dw:
                gather = Done(extras) if extras else comm.start_gather(op, xs, plan.extent, self.axis == "features")
            if need_dx:
                dxs = produce_and_scatter(comm, op, dys, [w.t() for w in weights], [None] * k, axis=self.axis,
                                          partial_dtype=plan.partial_dtype, nbytes=plan.nbytes)
            if need_dw:
                dws = [flat_rows(dy).t() @ flat_rows(g) for dy, g in zip(dys, gather.wait(), strict=True)]
        if need_db and plan.grad == "sum":
            dbs = [comm.all_reduce_(flat_rows(dy).sum(0, dtype=torch.float32)).to(dy.dtype) for dy in dys]
        elif need_db:
            dbs = [flat_rows(dy).sum(0) for dy in dys]
        return dxs, dws, dbs
