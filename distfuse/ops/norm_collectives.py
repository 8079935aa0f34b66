"""The normalisation layers' statistics and exact adjoint: the math, and the same as custom ops.

``x3 [L, M, R]`` is a worker's input viewed with one statistic per ``M``, or ``[B, L, M, R]``
with one per ``(B, M)`` (flattened ``b * M + m``); ``P_stats`` the workers that share those
statistics (the handle's :class:`~distfuse.ops.collectives.FlaggedSite`).  The 4-D form is how a
``channels_last`` group norm reads its ``[N, *s, C]`` memory without a copy: ``[N, S, G, C/G]``
is a view, while no 3-D view puts ``(N, G)`` together.  ``w`` and ``b`` are per ``M``::

    distfuse::moments(x3, h, count)      -> mean [B*M], var [B*M] (float64, biased)
        local (n_i, mean_i, M2_i) -> all-gather over P_stats -> Chan combine in partition order
    distfuse::normalize(x3, w?, b?, mean, invstd, h, count) -> y = xhat [* w + b]   (compute dtype)
        adjoint: distfuse::normalize_backward
    distfuse::normalize_backward(dy, x3, mean, invstd, w?, b?, h, count, needs) -> dx, dw, db
        [sum dy, sum dy * xhat] -> all-reduce over P_stats
        dx = w * invstd * (dy - sum dy / n - xhat * sum(dy * xhat) / n),  dw = sum dy * xhat,  db = sum dy

Why the statistics are gathered rather than all-reduced as sums, and why the combine runs
in float64 in one fixed order, is in :mod:`distfuse.layers._norm_common`.  The plain
functions here (:func:`moments_of`, :func:`normalize_forward`, :func:`normalize_grads`) are
what the eager layers run; the ops call the same functions, so a compiled call sends the
same messages and computes the same bits.  ``moments`` has no autograd: its caller passes a
detached input and ``normalize``'s adjoint accounts for the statistics' dependence on it.
"""

from __future__ import annotations

import torch

from distfuse._compat import all_gather_flat
from distfuse.ops.collectives import FlaggedSite
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import all_reduce_sum, group_slots
from distfuse.primitives._common import collective_guard
from distfuse.primitives._handles import lookup

__all__ = ["moments_of", "normalize_forward", "normalize_grads", "stat_dtype", "moments", "normalize",
           "normalize_backward"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit tensors (as torch's norms accumulate them), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------- the math (eager and compiled)


def _stat_shape(x3: torch.Tensor) -> tuple[int, ...]:
    """The shape that broadcasts one value per statistic against ``x3``: ``[1, M, 1]`` or ``[B, 1, M, 1]``."""
    return tuple(x3.shape[:-3]) + (1, x3.shape[-2], 1)


def _reduced_dims(x3: torch.Tensor) -> tuple[int, int]:
    """The dimensions each statistic runs over: ``L`` and ``R``."""
    return (x3.dim() - 3, x3.dim() - 1)


def _stat_count(x3: torch.Tensor) -> int:
    """The number of statistics of ``x3``: ``M`` or ``B * M``."""
    return (x3.shape[0] if x3.dim() == 4 else 1) * x3.shape[-2]


def _gather_rows(op: str, P_sub: CartesianPartition, rec: torch.Tensor) -> torch.Tensor:
    """``[P, *rec.shape]``: every worker's record, in sub-grid rank order (one all-gather)."""
    buf = rec.new_empty(P_sub.size * rec.numel())
    with collective_guard(op, "statistics all-gather", P_sub.ranks):
        all_gather_flat(buf, rec.contiguous(), group=P_sub.group)
    return buf.view(P_sub.size, *rec.shape)[list(group_slots(P_sub))]


def moments_of(op: str, P_stats: CartesianPartition, x3: torch.Tensor, count: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact global ``(mean, biased var)`` per statistic of ``x3 [(B,) L, M, R]`` over ``P_stats`` (float64, flat).

    ``count`` is the global number of elements per statistic.  Local moments in
    :func:`stat_dtype`, combined in float64 with Chan's formula in sub-grid rank order.
    """
    with torch.no_grad():
        L, R = x3.shape[-3], x3.shape[-1]
        M = _stat_count(x3)
        n_loc = L * R
        rec = torch.zeros(3, M, dtype=torch.float64, device=x3.device)
        if n_loc > 0 and M > 0:
            var, mean = torch.var_mean(x3.to(stat_dtype(x3.dtype)), dim=_reduced_dims(x3), correction=0)
            rec[0] = n_loc
            rec[1] = mean.reshape(M)
            rec[2] = var.double().reshape(M) * n_loc
        if P_stats.size == 1 or M == 0:  # M is the same on every worker of P_stats: all skip together
            return rec[1], rec[2] / max(n_loc, 1)
        rows = _gather_rows(op, P_stats, rec)
        n_i, mean_i, m2_i = rows[:, 0], rows[:, 1], rows[:, 2]
        n = max(count, 1)
        mean = (n_i * mean_i).sum(0) / n
        m2 = m2_i.sum(0) + (n_i * (mean_i - mean) ** 2).sum(0)
        return mean, m2 / n


def _xhat(x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    shape = _stat_shape(x3)
    return (x3.to(stat_dtype(x3.dtype)) - mean.view(shape)) * invstd.view(shape)


def normalize_forward(x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """``(x3 - mean) * invstd [* w + b]`` per statistic (``w``, ``b`` per ``M``), in the compute dtype."""
    y = _xhat(x3, mean, invstd)
    if weight is not None:
        y = y * weight.to(y.dtype).view(1, -1, 1)
    if bias is not None:
        y = y + bias.to(y.dtype).view(1, -1, 1)
    return y


def normalize_grads(dy: torch.Tensor, x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                    weight: torch.Tensor | None, count: int, P_stats: CartesianPartition, op: str,
                    needs: tuple[bool, bool, bool], bias_dtype: torch.dtype | None):
    """The adjoint of :func:`normalize_forward` with the statistics' dependence on ``x3``: ``(dx, dw, db)``.

    One all-reduce of ``[sum dy, sum dy * xhat]`` (``2 x M``) over ``P_stats``; every worker of
    ``P_stats`` must reach it.  Entries not in ``needs`` (dx, dw, db) are None.  With the 4-D
    form the statistics' sums are per ``(B, M)`` and ``dw``, ``db`` (per ``M``) add the ``B`` rows.
    """
    xhat = _xhat(x3, mean, invstd)
    dy = dy.to(xhat.dtype)
    dims, M, shape = _reduced_dims(x3), _stat_count(x3), _stat_shape(x3)
    sums = torch.stack([dy.sum(dims).reshape(M), (dy * xhat).sum(dims).reshape(M)])
    if P_stats.size > 1:
        sums = all_reduce_sum(op, P_stats, sums)
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    n = max(count, 1)
    scale = invstd.view(shape)
    if weight is not None:
        scale = scale * weight.to(xhat.dtype).view(1, -1, 1)
    dx = None
    if needs[0]:
        dx = scale * (dy - (sum_dy / n).view(shape) - xhat * (sum_dy_xhat / n).view(shape))
        dx = dx.to(x3.dtype)
    if x3.dim() == 4:  # the parameters are per M: add the B rows of the per-(B, M) sums
        sum_dy, sum_dy_xhat = sum_dy.view(-1, x3.shape[-2]).sum(0), sum_dy_xhat.view(-1, x3.shape[-2]).sum(0)
    dw = sum_dy_xhat.to(weight.dtype) if weight is not None and needs[1] else None
    db = sum_dy.to(bias_dtype) if bias_dtype is not None and needs[2] else None
    return dx, dw, db


# ---------------------------------------------------------------- the custom ops


@torch.library.custom_op("distfuse::moments", mutates_args=())
def moments(x3: torch.Tensor, handle: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moments_of` over the handle's sub-grid: ``(mean, var)``, float64 ``[M]`` each."""
    ctx: FlaggedSite = lookup(handle)
    mean, var = moments_of(ctx.op, ctx.P_sub, x3, count)
    return mean.clone(), var.clone()  # fresh storage each: the outputs of a custom op may not alias


@moments.register_fake
def _(x3, handle, count):
    M = _stat_count(x3)
    return x3.new_empty((M,), dtype=torch.float64), x3.new_empty((M,), dtype=torch.float64)


@torch.library.custom_op("distfuse::normalize", mutates_args=())
def normalize(x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
              invstd: torch.Tensor, handle: int, count: int) -> torch.Tensor:
    """:func:`normalize_forward` (no communication; the adjoint all-reduces over the handle's sub-grid)."""
    # contiguous, as the fake says (an output's strides must match its fake's under inductor)
    return normalize_forward(x3, weight, bias, mean, invstd).clone(memory_format=torch.contiguous_format)


@normalize.register_fake
def _(x3, weight, bias, mean, invstd, handle, count):
    return x3.new_empty(x3.shape, dtype=stat_dtype(x3.dtype))


@torch.library.custom_op("distfuse::normalize_backward", mutates_args=())
def normalize_backward(dy: torch.Tensor, x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                       weight: torch.Tensor | None, bias: torch.Tensor | None, handle: int, count: int,
                       needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`normalize_grads`: ``(dx, dw, db)``, each ``[0]`` where not needed."""
    ctx: FlaggedSite = lookup(handle)
    grads = normalize_grads(dy, x3, mean, invstd, weight, count, ctx.P_sub, ctx.op, tuple(needs),
                            None if bias is None else bias.dtype)
    return tuple(dy.new_empty((0,)) if g is None else g.clone(memory_format=torch.contiguous_format) for g in grads)


@normalize_backward.register_fake
def _(dy, x3, mean, invstd, weight, bias, handle, count, needs):
    dx = x3.new_empty(x3.shape) if needs[0] else dy.new_empty((0,))
    dw = weight.new_empty(weight.shape) if weight is not None and needs[1] else dy.new_empty((0,))
    db = bias.new_empty(bias.shape) if bias is not None and needs[2] else dy.new_empty((0,))
    return dx, dw, db


def _setup_normalize(ctx, inputs, output):
    x3, weight, bias, mean, invstd, handle, count = inputs
    ctx.save_for_backward(x3, mean, invstd, weight, bias)
    ctx.handle, ctx.count = handle, count


def _normalize_backward(ctx, dy):
    x3, mean, invstd, weight, bias = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2])]
    dx, dw, db = normalize_backward(dy, x3, mean, invstd, weight, bias, ctx.handle, ctx.count, needs)
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, None, None, None, None)


normalize.register_autograd(_normalize_backward, setup_context=_setup_normalize)

# Program order on every rank (see distfuse/ops/halo.py); ``normalize`` sends nothing (its adjoint does).
for _op in (moments, normalize_backward):
    torch.library._register_effectful_op(_op._qualname, torch.library.EffectType.ORDERED)
