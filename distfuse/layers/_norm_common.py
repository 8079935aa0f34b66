"""Pieces shared by the distributed normalisation layers and losses.

* :func:`gather_call` is the host-side metadata collective of a norm or loss: every
  worker of ``P_x`` contributes the shapes, dtypes and grad flags of its tensors (11 int64
  per tensor) and its mode (training or not), and every worker validates every record,
  so a bad block (wrong channel count, a target that does not match its input, a
  non-balanced split, workers in different modes) raises the same error on every worker
  before any data moves.  It runs on a layer's first call and when some worker's call
  changed, never while every worker's call repeats (the agreement protocol,
  :mod:`distfuse.primitives._agreement`; the norms' flag round is in ``_norm_compiled``,
  the losses' flag rides in their reduction, see ``loss``).
* :func:`gather_moments` computes exact global statistics.  Each worker reduces its block
  to ``(count, mean, M2)`` per statistic (M2: the sum of squared deviations from the
  local mean), the workers all-gather these records and every worker combines them in
  partition order with Chan's parallel formula::

      n = sum n_i    mean = sum n_i mean_i / n    M2 = sum M2_i + sum n_i (mean_i - mean)^2

  Why not one all-reduce of [sum, sum of squares, count]: ``E[x^2] - mean^2`` cancels
  when ``|mean| >> std``; in fp32 a channel with mean 1000 and std 1 loses every digit of
  its variance (1e6 * 6e-8 = 0.06 absolute error per term, summed).  Every term of Chan's
  formula is non-negative, so nothing cancels.  The record is ``3 x M`` float64 per worker
  (float64 so that counts stay exact past 2^24), the same single collective, and combining
  in one fixed order makes the statistics bitwise identical on every worker.  A mean of
  local means is wrong under uneven splits; the weights ``n_i`` are what makes it exact.
* :class:`NormalizeFunction` normalises ``x`` viewed as ``[L, M, R]`` with one statistic per
  ``M`` (or ``[B, L, M, R]`` with one per ``(B, M)``: a channels_last group norm's memory,
  see :mod:`distfuse.ops.norm_collectives`), optionally with a per-``M`` affine.  Its backward is exact: with
  ``xhat = (x - mean) * invstd`` and ``g`` the gradient reaching ``xhat``,
  ``dx = invstd * (g - sum(g)/n - xhat * sum(g * xhat)/n)``, where the sums run over every
  element that shares the statistic, on every worker: one all-reduce of ``2 x M`` values.
* :func:`sum_replica_grads` is how a parameter replicated on several workers enters a
  computation: identity forward, all-reduce of the gradient backward, so every replica
  receives the global gradient and an optimizer keeps the replicas equal without any
  further communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._conv_common import promote
from distfuse.ops.norm_collectives import moments_of, normalize_forward, normalize_grads, stat_dtype
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import all_reduce_sum, axes_subgrid
from distfuse.primitives._common import collective_guard

__all__ = ["CallRecord", "gather_call", "one_mode", "global_shape_of", "subgrid", "check_norm_partition",
           "compute_dtype", "check_param_dtype", "gather_moments", "Moments", "NormalizeFunction", "normalize",
           "sum_replica_grads", "promote", "FLOATS"]

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CODES = FLOATS + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIM = 8
_HEAD = 3  # grad flags, status, mode
_PER_TENSOR = 3 + _MAX_DIM  # ndim, dtype code, device ok, shape
_OK, _BAD_DEVICE, _TOO_MANY_DIMS = range(3)


# ---------------------------------------------------------------- sub-grids


_SUBGRIDS: dict[tuple, CartesianPartition] = {}


def subgrid(P_x: CartesianPartition, axes: Sequence[int]) -> CartesianPartition:
    """The sub-grid of ``P_x`` through this worker along ``axes``, cached.

    Creating one is collective over the world and costs an object all-gather (35 ms with 8
    gloo ranks on the 2-core CI machine); a U-Net asks for the same few sub-grids in every
    norm layer.  Construction is collective, so every rank hits or misses together.  The
    key holds the default group, so a re-initialised world builds fresh ones.
    """
    key = (id(dist.group.WORLD), P_x.ranks, P_x.shape, tuple(sorted(int(a) for a in axes)))
    if key not in _SUBGRIDS:
        _SUBGRIDS[key] = axes_subgrid(P_x, key[3])
    return _SUBGRIDS[key]


def check_norm_partition(op: str, P_x, dims: Sequence[int]) -> None:
    if not isinstance(P_x, CartesianPartition):
        raise PartitionError(f"{where(op)}: P_x must be a CartesianPartition, got {type(P_x).__name__}")
    if P_x.dim not in dims:
        raise expect(op, "dimensions of P_x (one per input dimension)", " or ".join(map(str, dims)), P_x.dim,
                     PartitionError)


# ---------------------------------------------------------------- per-call metadata


@dataclass(frozen=True)
class CallRecord:
    """What one call's metadata gather tells every worker, in ``P_x``'s rank order.

    ``shapes[k][j]`` / ``dtypes[k][j]``: tensor ``k`` of partition rank ``j``.  ``input_grad[j]`` /
    ``param_grad[j]``: worker ``j`` has grad mode on and a tensor / a parameter that requires
    grad.  ``modes[j]``: the ``mode`` worker ``j`` passed (the norms: 1 in training mode).
    Where some workers' outputs require grad and others' do not, the others must be
    promoted (:func:`promote`), or their peers would wait in an adjoint collective they never join.
    """

    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    dtypes: tuple[tuple[torch.dtype | None, ...], ...]
    input_grad: tuple[bool, ...]
    param_grad: tuple[bool, ...]
    modes: tuple[int, ...] = ()

    @property
    def any_input_grad(self) -> bool:
        return any(self.input_grad)

    @property
    def any_param_grad(self) -> bool:
        return any(self.param_grad)

    @property
    def any_grad(self) -> bool:
        return self.any_input_grad or self.any_param_grad


def gather_call(op: str, P_x: CartesianPartition, tensors: Sequence[torch.Tensor], names: Sequence[str],
                params: Sequence[torch.Tensor] = (), signature=None, mode: int = 0) -> CallRecord:
    """All-gather every worker's tensor shapes, dtypes, grad flags and ``mode`` over ``P_x`` (host gloo).

    Raises on every worker alike when any worker passed a tensor on the wrong device, of
    more than 8 dimensions, or of a number of dimensions other than ``P_x.dim`` for the
    first tensor.  ``params`` count for the grad flags only (pass them among ``tensors``
    too for their dtypes).  ``signature`` (the layer's options) is compared across workers
    in debug mode, so workers calling different layers fail with a CollectiveMismatchError.
    """
    if signature is not None and debug.enabled():
        debug.check_agreement(op, P_x.ranks, P_x.meta_group, same={"layer": signature},
                              info={"local shapes": [tuple(t.shape) for t in tensors]})
    grad_on = torch.is_grad_enabled()
    rec = torch.full((_HEAD + _PER_TENSOR * len(tensors),), -1, dtype=torch.int64)
    input_grad = grad_on and any(t.requires_grad for t in tensors if not any(t is p for p in params))
    param_grad = grad_on and any(p.requires_grad for p in params)
    rec[0] = int(input_grad) + 2 * int(param_grad)
    rec[1] = _OK
    rec[2] = int(mode)
    for k, t in enumerate(tensors):
        base = _HEAD + _PER_TENSOR * k
        rec[base] = t.dim()
        rec[base + 1] = _CODES.index(t.dtype) if t.dtype in _CODES else -1
        rec[base + 2] = int(t.device.type == P_x.device.type or t.numel() == 0)
        if t.dim() > _MAX_DIM:
            rec[1] = _TOO_MANY_DIMS
        else:
            rec[base + 3:base + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    out = torch.empty(P_x.size * rec.numel(), dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P_x.ranks):
        all_gather_flat(out, rec, group=P_x.meta_group)
    # Slot g belongs to the g-th smallest world rank (new_group sorts), not to partition rank g.
    by_world = dict(zip(sorted(P_x.ranks), out.view(P_x.size, -1).tolist(), strict=True))
    rows = [by_world[w] for w in P_x.ranks]
    shapes, dtypes = [], []
    for k, name in enumerate(names):
        base = _HEAD + _PER_TENSOR * k
        for w, r in zip(P_x.ranks, rows, strict=True):
            if r[1] == _TOO_MANY_DIMS:
                raise ShapeError(f"{where(op)}: world rank {w} passed a tensor of more than {_MAX_DIM} dimensions")
            if r[base + 2] == 0:
                raise expect(op, f"device type of the {name} on world rank {w}", P_x.device.type, "another device")
        if k == 0:
            bad = {w: r[base] for w, r in zip(P_x.ranks, rows, strict=True) if r[base] != P_x.dim}
            if bad:
                raise expect(op, f"number of {name} dimensions (one per dimension of P_x) on world ranks "
                             f"{sorted(bad)}", P_x.dim, sorted(set(bad.values())))
        shapes.append(tuple(tuple(r[base + 3:base + 3 + r[base]]) for r in rows))
        dtypes.append(tuple(_CODES[r[base + 1]] if r[base + 1] >= 0 else None for r in rows))
    return CallRecord(tuple(shapes), tuple(dtypes), tuple(bool(r[0] & 1) for r in rows),
                      tuple(bool(r[0] & 2) for r in rows), tuple(int(r[2]) for r in rows))


def one_mode(op: str, P_x: CartesianPartition, call: CallRecord) -> None:
    """Every worker in the same mode (training or eval); the same ShapeError on every worker otherwise.

    A batch norm in training mode gathers statistics over its peers while one in eval mode
    normalises locally: mixed modes would leave the training workers waiting.
    """
    if len(set(call.modes)) > 1:
        got = {w: "train" if m else "eval" for w, m in zip(P_x.ranks, call.modes, strict=True)}
        raise ShapeError(f"{where(op)}: the workers of P_x must all be in training mode or all in eval mode; got "
                         f"{got} (world rank: mode)")


def global_shape_of(op: str, P_x: CartesianPartition, shapes: Sequence[tuple[int, ...]],
                    what: str = "input") -> tuple[int, ...]:
    """The global shape whose balanced blocks the workers hold; the same ShapeError on every worker otherwise."""
    G = tuple(sum(shapes[P_x.rank_of([k if e == d else 0 for e in range(P_x.dim)])][d] for k in range(P_x.shape[d]))
              for d in range(P_x.dim))
    for j, shape in enumerate(shapes):
        want = local_shape(G, P_x.shape, P_x.index_of(j))
        if tuple(shape) != want:
            raise expect(op, f"local {what} shape on world rank {P_x.ranks[j]} (P_x index {P_x.index_of(j)}; the "
                         f"blocks must be the balanced decomposition of the global shape {G} inferred from them)",
                         want, tuple(shape))
    return G


def one_dtype(op: str, P_x: CartesianPartition, dtypes: Sequence[torch.dtype | None], what: str = "input",
              allowed: Sequence[torch.dtype] = FLOATS) -> torch.dtype:
    """The one dtype every worker passed, from ``allowed``; the same ShapeError on every worker otherwise."""
    if len(set(dtypes)) != 1:
        got = {w: str(d) for w, d in zip(P_x.ranks, dtypes, strict=True)}
        raise ShapeError(f"{where(op)}: the workers of P_x must pass one {what} dtype; got {got} (world rank: dtype)")
    if dtypes[0] not in allowed:
        raise expect(op, f"{what} dtype", [str(d) for d in allowed], str(dtypes[0]))
    return dtypes[0]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit tensors (as torch's norms accumulate them), else the dtype itself."""
    return stat_dtype(dtype)


def check_param_dtype(op: str, x_dtype: torch.dtype, param_dtype: torch.dtype | None) -> None:
    """torch's rule: parameters in the input's dtype, or in fp32 under a 16-bit input (mixed type)."""
    if param_dtype is None or param_dtype == x_dtype:
        return
    if x_dtype in (torch.float16, torch.bfloat16) and param_dtype == torch.float32:
        return
    raise expect(op, "input dtype (the parameters' dtype, or fp16/bf16 with fp32 parameters, as torch requires)",
                 str(param_dtype), str(x_dtype))


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Moments:
    """Global statistics per ``M``: ``mean`` and biased ``var`` in float64, ``count`` elements each."""

    mean: torch.Tensor
    var: torch.Tensor
    count: int

    def invstd(self, eps: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.rsqrt(self.var + eps).to(dtype)

    def unbiased_var(self) -> torch.Tensor:
        return self.var * (self.count / (self.count - 1))


def gather_moments(op: str, P_stats: CartesianPartition, x3: torch.Tensor, count: int) -> Moments:
    """Exact global mean and biased variance per ``M`` of ``x3 [L, M, R]`` over the workers of ``P_stats``.

    ``count`` is the global number of elements per statistic (every worker knows it from
    the call's metadata).  Local moments are taken in :func:`compute_dtype`, combined in
    float64 (see the module docstring; the code is :func:`distfuse.ops.norm_collectives.moments_of`,
    which the compiled forward runs as ``distfuse::moments``).  No autograd:
    :class:`NormalizeFunction`'s backward differentiates through the statistics.
    """
    mean, var = moments_of(op, P_stats, x3, count)
    return Moments(mean, var, count)


class NormalizeFunction(torch.autograd.Function):
    """``y = (x - mean) * invstd [* w + b]`` for ``x [(B,) L, M, R]``, one statistic per ``(B,) M``; see the module doc.

    ``mean`` and ``invstd`` are the global statistics of ``x`` (constants here: the backward
    accounts for their dependence on ``x``).  ``count`` is the global number of elements
    per statistic.  Output in the compute dtype (fp32 for 16-bit inputs; the caller casts once).

    Adjoint (one all-reduce of ``[sum dy, sum dy * xhat]``, ``2 x M`` values, over ``P_stats``)::

        db = sum dy        dw = sum dy * xhat        (global: every replica gets the full gradient)
        dx = w * invstd * (dy - db / n - xhat * dw / n)

    Every worker of ``P_stats`` must run the backward when one does (the layers promote the
    input so that they agree).  The input is saved, not ``xhat``: a 16-bit input costs half
    the memory of its fp32 ``xhat``, and the output stays free for in-place ops (``ReLU(inplace=True)``).
    The forward and the adjoint are :func:`~distfuse.ops.norm_collectives.normalize_forward` and
    :func:`~distfuse.ops.norm_collectives.normalize_grads`, shared with the compiled op ``distfuse::normalize``.
    """

    @staticmethod
    def forward(ctx, x3, weight, bias, mean, invstd, count: int, P_stats, op: str):
        ctx.save_for_backward(x3, mean, invstd, weight)
        ctx.meta = (count, P_stats, op, None if bias is None else bias.dtype)
        return normalize_forward(x3, weight, bias, mean, invstd)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x3, mean, invstd, weight = ctx.saved_tensors
        count, P_stats, op, bias_dtype = ctx.meta
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        dx, dw, db = normalize_grads(dy, x3, mean, invstd, weight, count, P_stats, op, needs, bias_dtype)
        return dx, dw, db, None, None, None, None, None


def normalize(x3: torch.Tensor, moments: Moments, eps: float, P_stats: CartesianPartition, op: str,
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`NormalizeFunction` with the statistics of ``moments`` (output in the compute dtype)."""
    cdt = compute_dtype(x3.dtype)
    return NormalizeFunction.apply(x3, weight, bias, moments.mean.to(cdt), moments.invstd(eps, cdt), moments.count,
                                   P_stats, op)


# ---------------------------------------------------------------- replicated parameters


class _SumReplicaGrads(torch.autograd.Function):
    """Identity forward; backward: the sum of the gradient over the workers of ``P_rep`` (all-reduce)."""

    @staticmethod
    def forward(ctx, w, P_rep, op: str):
        ctx.P_rep, ctx.op = P_rep, op
        return w.view_as(w)

    @staticmethod
    @once_differentiable
    def backward(ctx, dw):
        return all_reduce_sum(ctx.op, ctx.P_rep, dw.contiguous()), None, None


def sum_replica_grads(w: torch.Tensor | None, P_rep: CartesianPartition, op: str,
                      any_grad: bool) -> torch.Tensor | None:
    """Use a parameter that every worker of ``P_rep`` holds a copy of, so that each copy gets the global gradient.

    Adjoint: the all-reduce over ``P_rep`` of the local gradients (the copies' forward uses
    are independent terms of one sum).  ``any_grad`` says whether any worker's copy
    requires grad (:attr:`CallRecord.any_param_grad`); a copy that does not is promoted, so
    that its all-reduce still runs and its peers do not wait.
    """
    if w is None or P_rep.size == 1 or not any_grad:
        return w
    return _SumReplicaGrads.apply(promote(w, True), P_rep, op)


def numel(shape: Sequence[int]) -> int:
    return math.prod([int(s) for s in shape])  # a list, not a generator: torch.compile traces it
