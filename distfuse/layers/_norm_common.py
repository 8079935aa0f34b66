"""What the distributed norms share (and the losses' metadata gather): the agreed call, exact statistics, the ops.

* :func:`gather_call` is the metadata gather of a norm, a loss, the embedding: the shapes,
  dtypes and grad flags of every worker's tensors (11 int64 per tensor) and its mode
  (training or not), validated alike on every worker before any data moves.
* ``distfuse::moments`` computes exact global statistics.  Each worker reduces its block
  to ``(count, mean, M2)`` per statistic (M2: the sum of squared deviations from the local
  mean), the workers all-gather these records and every worker combines them in
  partition order with Chan's parallel formula::

      n = sum n_i    mean = sum n_i mean_i / n    M2 = sum M2_i + sum n_i (mean_i - mean)^2

  Why not one all-reduce of [sum, sum of squares, count]: ``E[x^2] - mean^2`` cancels
  when ``|mean| >> std`` (in fp32 a channel with mean 1000 and std 1 loses every digit of
  its variance); every term of Chan's formula is non-negative.  The record is ``3 x M``
  float64 per worker (counts stay exact past 2^24), and combining in one fixed order makes
  the statistics, and the running statistics, bitwise identical on every worker.
* ``distfuse::normalize`` (backward ``distfuse::normalize_backward``: the exact adjoint,
  one all-reduce of ``2 x M`` values) normalises ``x3 [L, M, R]`` with one statistic per
  ``M``, or ``[B, L, M, R]`` with one per ``(B, M)`` (flattened ``b * M + m``), optionally with
  a per-``M`` affine.  The 4-D form is how a ``channels_last`` group norm reads its
  ``[N, *s, C]`` memory without a copy (no 3-D view puts ``(N, G)`` together).  The input is
  saved, not ``xhat``: half the memory for 16-bit inputs, and the output stays free for
  in-place ops.
* ``distfuse::replicate`` (:mod:`distfuse.primitives.all_sum_reduce`) brings the parameters, replicated
  over ``P_rep``, into the computation: every replica receives the global gradient.

The norms' agreement flag takes a round of its own over ``P_x``: their data collectives run
over sub-grids (``P_stats``, ``P_rep``), and an eval-mode batch norm or instance norm with
running statistics has none at all, but the flag must reach every worker, or those outside
the changed worker's sub-grid would run on and wait in the next layer.  On CUDA the round
takes the deferred transport (:mod:`~distfuse.primitives._flag_deferred`: a device
all-reduce read at the next call, no host round); a worker whose call changed while its
peers' did not normalises a NaN stand-in of its agreed block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.layers._conv_common import (
    FLOATS,
    AgreedLayer,
    check_cartesian,
    compute_dtype,
    global_shape_of,
    promote,
    subgrid,
)
from distfuse.layers._params import BlockIdentityMixin, ParamLayout
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import all_reduce_sum, group_slots
from distfuse.primitives._common import check_inactive_input, collective_guard, gather_records
from distfuse.primitives._handles import lookup
from distfuse.primitives._op_pair import op_entry
from distfuse.primitives.all_sum_reduce import SubGridSum, replicate

__all__ = ["CallRecord", "gather_call", "global_shape_of", "one_dtype", "subgrid", "check_norm_partition", "affine",
           "compute_dtype", "Moments", "NormCall", "NormLayer", "numel", "FLOATS", "DTYPES"]

DTYPES = FLOATS + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)  # gather_call's codes
_MAX_DIM = 8
_HEAD = 3  # grad flags, status, mode
_PER_TENSOR = 3 + _MAX_DIM  # ndim, dtype code, device ok, shape
_OK, _TOO_MANY_DIMS = 0, 1


def numel(shape: Sequence[int]) -> int:
    return math.prod([int(s) for s in shape])  # a list, not a generator: torch.compile traces it


def check_norm_partition(op: str, P_x, dims: Sequence[int]) -> None:
    check_cartesian(op, P_x)
    if P_x.dim not in dims:
        raise expect(op, "dimensions of P_x (one per input dimension)", " or ".join(map(str, dims)), P_x.dim,
                     PartitionError)


# ---------------------------------------------------------------- per-call metadata


@dataclass(frozen=True)
class CallRecord:
    """What one call's metadata gather tells every worker, in ``P_x``'s rank order: ``shapes[k][j]`` /
    ``dtypes[k][j]`` of tensor ``k`` of partition rank ``j``; ``input_grad[j]`` / ``param_grad[j]``: worker ``j``
    has grad mode on and a tensor / a parameter that requires grad; ``modes[j]``, the ``mode`` it passed."""

    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    dtypes: tuple[tuple[torch.dtype | None, ...], ...]
    input_grad: tuple[bool, ...]
    param_grad: tuple[bool, ...]
    modes: tuple[int, ...] = ()


def gather_call(op: str, P_x: CartesianPartition, tensors: Sequence[torch.Tensor], names: Sequence[str],
                params: Sequence[torch.Tensor] = (), signature=None, mode: int = 0) -> CallRecord:
    """All-gather every worker's tensor shapes, dtypes, grad flags and ``mode`` over ``P_x`` (host gloo).

    Raises on every worker alike when any worker passed a tensor on the wrong device, of
    more than 8 dimensions, or (the first tensor) of a number of dimensions other than
    ``P_x.dim``.  ``params`` count for the grad flags only (pass them among ``tensors`` too
    for their dtypes); ``signature`` (the layer's options) is compared in debug mode.
    """
    if signature is not None and debug.enabled():
        debug.check_agreement(op, P_x.ranks, P_x.meta_group, same={"layer": signature},
                              info={"local shapes": [tuple(t.shape) for t in tensors]})
    grad_on = torch.is_grad_enabled()
    input_grad = grad_on and any(t.requires_grad for t in tensors if not any(t is p for p in params))
    param_grad = grad_on and any(p.requires_grad for p in params)
    status = _TOO_MANY_DIMS if any(t.dim() > _MAX_DIM for t in tensors) else _OK
    rec = [int(input_grad) + 2 * int(param_grad), status, int(mode)]
    for t in tensors:
        shape = list(t.shape) if t.dim() <= _MAX_DIM else []
        rec += [t.dim(), DTYPES.index(t.dtype) if t.dtype in DTYPES else -1,
                int(t.device.type == P_x.device.type or t.numel() == 0)] + shape + [-1] * (_MAX_DIM - len(shape))
    rows = gather_records(op, P_x, rec)
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
        dtypes.append(tuple(DTYPES[r[base + 1]] if r[base + 1] >= 0 else None for r in rows))
    return CallRecord(tuple(shapes), tuple(dtypes), tuple(bool(r[0] & 1) for r in rows),
                      tuple(bool(r[0] & 2) for r in rows), tuple(int(r[2]) for r in rows))


def one_dtype(op: str, P_x: CartesianPartition, dtypes: Sequence[torch.dtype | None], what: str = "input",
              allowed: Sequence[torch.dtype] = FLOATS) -> torch.dtype:
    """The one dtype every worker passed, from ``allowed``; the same ShapeError on every worker otherwise."""
    if len(set(dtypes)) != 1:
        got = {w: str(d) for w, d in zip(P_x.ranks, dtypes, strict=True)}
        raise ShapeError(f"{where(op)}: the workers of P_x must pass one {what} dtype; got {got} (world rank: dtype)")
    if dtypes[0] not in allowed:
        raise expect(op, f"{what} dtype", [str(d) for d in allowed], str(dtypes[0]))
    return dtypes[0]


# ---------------------------------------------------------------- statistics and normalisation (the ops)


def _stat_layout(x3: torch.Tensor) -> tuple[tuple[int, int], int, tuple[int, ...]]:
    """The dimensions each statistic of ``x3`` runs over (``L`` and ``R``), the number of statistics (``M`` or
    ``B * M``) and the shape that broadcasts one value per statistic against ``x3`` (``[1, M, 1]`` or
    ``[B, 1, M, 1]``)."""
    lead = tuple(x3.shape[:-3])
    return (x3.dim() - 3, x3.dim() - 1), (lead[0] if lead else 1) * x3.shape[-2], lead + (1, x3.shape[-2], 1)


def _moments(x3: torch.Tensor, handle: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact global ``(mean, biased var)`` per statistic of ``x3`` over the handle's ``P_stats`` (float64, flat;
    ``count`` elements per statistic).  No gradient: :func:`_normalize`'s adjoint accounts for the statistics'
    dependence on ``x3``."""
    ctx: SubGridSum = lookup(handle)
    P = ctx.P
    with torch.no_grad():
        dims, M, _ = _stat_layout(x3)
        n_loc = x3.shape[-3] * x3.shape[-1]
        rec = torch.zeros(3, M, dtype=torch.float64, device=x3.device)
        if n_loc > 0 and M > 0:
            var, mean = torch.var_mean(x3.to(compute_dtype(x3.dtype)), dim=dims, correction=0)
            rec[0] = n_loc
            rec[1] = mean.reshape(M)
            rec[2] = var.double().reshape(M) * n_loc
        if P.size == 1 or M == 0:  # M is the same on every worker of P_stats: all skip together
            return rec[1].clone(), rec[2] / max(n_loc, 1)
        buf = rec.new_empty(P.size * rec.numel())
        with collective_guard(ctx.op, "statistics all-gather", P.ranks):
            all_gather_flat(buf, rec, group=P.group)
        rows = buf.view(P.size, *rec.shape)[list(group_slots(P))]  # sub-grid rank order
        n_i, mean_i, m2_i = rows[:, 0], rows[:, 1], rows[:, 2]
        n = max(count, 1)
        mean = (n_i * mean_i).sum(0) / n
        m2 = m2_i.sum(0) + (n_i * (mean_i - mean) ** 2).sum(0)
        return mean, m2 / n


def _moments_fake(x3, handle, count):
    M = _stat_layout(x3)[1]
    return x3.new_empty((M,), dtype=torch.float64), x3.new_empty((M,), dtype=torch.float64)


def _xhat(x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    shape = _stat_layout(x3)[2]
    return (x3.to(compute_dtype(x3.dtype)) - mean.view(shape)) * invstd.view(shape)


def affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape) -> torch.Tensor:
    """``y [* weight] [+ bias]``, the parameters in ``y``'s dtype and viewed as ``shape``."""
    if weight is not None:
        y = y * weight.to(y.dtype).view(shape)
    if bias is not None:
        y = y + bias.to(y.dtype).view(shape)
    return y


def _like_x3(t: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``t`` in ``torch.empty_like(x3)``'s layout, as the fakes say (a copy only where the strides differ)."""
    return t if t.stride() == x3.stride() else torch.empty_like(x3, dtype=t.dtype).copy_(t)


def _normalize(x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
               invstd: torch.Tensor, handle: int, count: int) -> torch.Tensor:
    """``(x3 - mean) * invstd [* w + b]`` per statistic (``w``, ``b`` per ``M``), in the compute dtype; local."""
    return _like_x3(affine(_xhat(x3, mean, invstd), weight, bias, (1, -1, 1)), x3)


def _normalize_fake(x3, weight, bias, mean, invstd, handle, count):
    return torch.empty_like(x3, dtype=compute_dtype(x3.dtype))


def _normalize_backward(dy: torch.Tensor, x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, handle: int, count: int,
                        needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The adjoint of :func:`_normalize` with the statistics' dependence on ``x3``: ``(dx, dw, db)``::

        db = sum dy        dw = sum dy * xhat        (global: every replica gets the full gradient)
        dx = w * invstd * (dy - db / n - xhat * dw / n)

    The sums run over every element that shares a statistic: one all-reduce of
    ``[sum dy, sum dy * xhat]`` (``2 x M``) over ``P_stats``.  Entries not in ``needs`` are
    empty.  With the 4-D form the sums are per ``(B, M)`` and ``dw``, ``db`` add the ``B`` rows.
    """
    ctx: SubGridSum = lookup(handle)
    xhat = _xhat(x3, mean, invstd)
    dy = dy.to(xhat.dtype)
    dims, M, shape = _stat_layout(x3)
    sums = torch.stack([dy.sum(dims).reshape(M), (dy * xhat).sum(dims).reshape(M)])
    if ctx.P.size > 1:
        sums = all_reduce_sum(ctx.op, ctx.P, sums)
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    n = max(count, 1)
    scale = invstd.view(shape)
    if weight is not None:
        scale = scale * weight.to(xhat.dtype).view(1, -1, 1)
    dx, dw, db = (dy.new_empty((0,)) for _ in range(3))  # one each: the outputs may not alias each other
    if needs[0]:
        dx = scale * (dy - (sum_dy / n).view(shape) - xhat * (sum_dy_xhat / n).view(shape))
        dx = _like_x3(dx.to(x3.dtype), x3)
    if x3.dim() == 4:  # the parameters are per M: add the B rows of the per-(B, M) sums
        sum_dy, sum_dy_xhat = sum_dy.view(-1, x3.shape[-2]).sum(0), sum_dy_xhat.view(-1, x3.shape[-2]).sum(0)
    if weight is not None and needs[1]:
        dw = sum_dy_xhat.to(weight.dtype, copy=True)  # copies: rows of one tensor would alias
    if bias is not None and needs[2]:
        db = sum_dy.to(bias.dtype, copy=True)
    return dx, dw, db


def _normalize_backward_fake(dy, x3, mean, invstd, weight, bias, handle, count, needs):
    return tuple(torch.empty_like(t) if need else dy.new_empty((0,))
                 for t, need in zip((x3, weight, bias), needs, strict=True))


_moments_op = op_entry("moments", _moments, _moments_fake)
_normalize_op = op_entry("normalize", _normalize, _normalize_fake, _normalize_backward, _normalize_backward_fake,
                         saved=lambda x3, w, b, mean, invstd, handle, count: (x3, mean, invstd, w, b, handle, count),
                         inputs=(0, 1, 2))


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


# ---------------------------------------------------------------- the layers' common part


@dataclass(frozen=True)
class NormCall:
    """What a call's metadata gather established, the same on every worker."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    call: CallRecord


class NormLayer(BlockIdentityMixin, AgreedLayer, nn.Module):
    """What every distributed norm shares: replicated parameters and running statistics, the agreement, the
    sub-grid contexts its ops name by handle, and the steps of its one forward.  Subclasses call
    :meth:`_norm_setup` and define ``_forward(x, record)`` (the normalisation of the block under the agreed
    :class:`NormCall`), ``_check_global(G)`` (their checks of the agreed global shape, raised on every worker
    alike) and, where they differ from the defaults, ``_promotions`` and ``_mode_matters``.
    """

    def _norm_setup(self, P_x, param_shape, split_dims, block, *, affine: bool, bias: bool, running: bool,
                    P_stats, P_rep, P_batch=None, device=None, dtype=None) -> None:
        """Parameters ``[block]`` of the global ``param_shape`` (split by ``split_dims`` of ``P_x``, replicated on
        the other axes), running statistics if ``running``, the session and the contexts (in the same order on
        every worker: their handles name them in compiled graphs)."""
        op = type(self).__name__
        self.P_x, self.P_stats = P_x, P_stats
        self._param_shape, self._split = tuple(param_shape), tuple(split_dims)
        self.affine = bool(affine)
        self._has_bias = self.affine and bool(bias)
        self._has_buffers = bool(running)
        self._agree_over(P_x)
        self._stats = SubGridSum(op, P_stats)
        self._rep = SubGridSum(op, P_rep)
        self._batch = SubGridSum(op, P_batch) if P_batch is not None else None
        device = torch.device(device) if device is not None else P_x.device
        kw = dict(device=device, dtype=dtype)
        on = P_x.active
        self.register_parameter("weight", nn.Parameter(torch.ones(block, **kw)) if on and self.affine else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(block, **kw)) if on and self._has_bias else None)
        on = on and self._has_buffers
        self.register_buffer("running_mean", torch.zeros(block, **kw) if on else None)
        self.register_buffer("running_var", torch.ones(block, **kw) if on else None)
        # torch's InstanceNorm registers it too (and never advances it); kept for state-dict parity.
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device) if on else None)

    def _features(self, P_x, dims, num_features: int, eps: float, momentum, track_running_stats: bool) -> None:
        """The batch and instance norms' arguments (and ``P_x``), checked as torch checks them."""
        op = type(self).__name__
        check_norm_partition(op, P_x, dims)
        if int(num_features) < 1:
            raise expect(op, "num_features", ">= 1", num_features)
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.track_running_stats = bool(track_running_stats)

    def extra_repr(self) -> str:  # the batch and instance norms' (the group and layer norms define their own)
        return (f"P_x={list(self.P_x.shape)}, {self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self._has_bias}, track_running_stats={self.track_running_stats}")

    def reset_running_stats(self) -> None:
        if self.running_mean is not None:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """torch's initialisation: weight 1, bias 0, running statistics reset."""
        self.reset_running_stats()
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def param_layouts(self) -> list[ParamLayout]:
        P, G, split = self.P_x, self._param_shape, self._split
        names = (["weight"] if self.affine else []) + (["bias"] if self._has_bias else [])
        names += ["running_mean", "running_var"] if self._has_buffers else []
        lays = [ParamLayout(n, n, P, G, split_dims=split) for n in names]
        if self._has_buffers:
            lays.append(ParamLayout("num_batches_tracked", "num_batches_tracked", P, (), split_dims=()))
        return lays

    # ------------------------------------------------------------ the one forward and its steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        if not self.P_x.active:
            check_inactive_input(type(self).__name__, x)
            return x.clone()
        record = self._agree(x)
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return x.new_empty((0,))
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed block
            x = self.session.stand_in(x)
        # The adjoint's collectives: every worker must run them when any does (see _promotions).
        return self._forward(promote(x, self._promotions(record.call)[0]), record)

    def _promotions(self, call: CallRecord) -> tuple[bool, bool]:
        """Whether this worker's input / parameters must take part in the adjoint although they need no gradient
        here: some worker's input or parameter does, and the adjoint's collectives reach this worker."""
        return any(call.input_grad), any(call.param_grad)

    def _agree(self, x: torch.Tensor) -> NormCall | None:
        """The call's agreed record (None: a replayed call that flagged).  The signature holds everything the
        checks read.  An eager call promotes what :meth:`_promotions` asks for; a replayed call that would have
        to flags instead (a graph cannot make a leaf require grad)."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        grad_on = torch.is_grad_enabled()
        signature = (tuple(x.shape), x.dtype, x.device.type, grad_on, x.requires_grad,
                     tuple((p.dtype, p.requires_grad) for p in params), bool(self.training))

        def lacks_grad(record: NormCall) -> bool:
            x_needed, params_needed = self._promotions(record.call)
            lacks_x = x_needed and not (grad_on and x.requires_grad)
            return lacks_x or (params_needed and not all(grad_on and p.requires_grad for p in params))

        return self.session.agree(x, signature, True, lambda: self._gather(x, params), needs_eager=lacks_grad,
                                  deferrable=True)

    def _gather(self, x: torch.Tensor, params: list[torch.Tensor]) -> NormCall:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        op, P_x = type(self).__name__, self.P_x
        held = [b for b in (self.running_mean, self.running_var) if b is not None]
        call = gather_call(op, P_x, [x, *params, *held],
                           ["input"] + ["parameter"] * len(params) + ["running statistic"] * len(held), params,
                           signature=self._signature(), mode=int(self.training))
        if self._mode_matters() and len(set(call.modes)) > 1:  # the training workers would wait for the others
            got = {w: "train" if m else "eval" for w, m in zip(P_x.ranks, call.modes, strict=True)}
            raise ShapeError(f"{where(op)}: the workers of P_x must all be in training mode or all in eval mode; got "
                             f"{got} (world rank: mode)")
        dtype = one_dtype(op, P_x, call.dtypes[0])
        G = global_shape_of(op, P_x, call.shapes[0])
        mixed = dtype in (torch.float16, torch.bfloat16)  # torch's rule: the input's dtype, or fp32 if 16-bit
        for t_dtype in (d for dtypes in call.dtypes[1:] for d in dtypes):  # every worker's parameters and buffers
            if t_dtype not in (None, dtype) and not (mixed and t_dtype == torch.float32):
                raise expect(op, "input dtype (the parameters' dtype, or fp16/bf16 with fp32 parameters, as torch "
                             "requires)", str(t_dtype), str(dtype))
        self._check_global(G)
        return NormCall(G, dtype, call)

    def _moments(self, x3: torch.Tensor, count: int) -> Moments:
        """The exact global statistics of ``x3`` over ``P_stats`` (``count`` elements each)."""
        return Moments(*_moments_op(x3.detach(), self._stats.handle, count), count)

    def _normalize(self, x3: torch.Tensor, stats: Moments, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x3`` normalised with ``stats`` [* w + b] (compute dtype out); the adjoint all-reduces over ``P_stats``."""
        cdt = compute_dtype(x3.dtype)
        return _normalize_op(x3, weight, bias, stats.mean.to(cdt), stats.invstd(self.eps, cdt), self._stats.handle,
                             stats.count)

    def _replicas(self, call: CallRecord) -> list[torch.Tensor | None]:
        """Weight and bias, copies on every worker of ``P_rep``, used so that each copy gets the global gradient
        (where any worker's copy requires grad, one that does not is promoted, so that its adjoint's all-reduce
        still runs)."""
        if self._rep.P.size == 1 or not any(call.param_grad):
            return [self.weight, self.bias]
        return [None if w is None else replicate(promote(w, True), self._rep.handle) for w in (self.weight, self.bias)]

    @torch.no_grad()
    def _blend_running(self, mean: torch.Tensor, var: torch.Tensor, factor) -> None:
        """torch's running-statistics update, in float64 and rounded once into the buffers (identical on every
        worker)."""
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean.double())
        self.running_var.copy_(factor * var + (1 - factor) * self.running_var.double())

    def _mode_matters(self) -> bool:
        """Whether training and eval calls run different collectives (then every worker must be in one mode)."""
        return False
