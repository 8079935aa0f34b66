"""What the distributed norms share (and the losses' metadata gather): the agreed call, exact statistics, the ops.

* :func:`gather_call` is the host-side metadata collective of a norm or loss: every
  worker of ``P_x`` contributes the shapes, dtypes and grad flags of its tensors (11 int64
  per tensor) and its mode (training or not), and every worker validates every record,
  so a bad block (wrong channel count, a target that does not match its input, a
  non-balanced split, workers in different modes) raises the same error on every worker
  before any data moves.  It runs on a layer's first call and when some worker's call
  changed, never while every worker's call repeats: each layer agrees through an
  :class:`~distfuse.primitives.agreement_session.AgreementSession` (:class:`NormLayer`;
  the losses in :mod:`distfuse.layers.loss`).
* ``distfuse::moments`` computes exact global statistics.  Each worker reduces its block
  to ``(count, mean, M2)`` per statistic (M2: the sum of squared deviations from the local
  mean), the workers all-gather these records and every worker combines them in
  partition order with Chan's parallel formula::

      n = sum n_i    mean = sum n_i mean_i / n    M2 = sum M2_i + sum n_i (mean_i - mean)^2

  Why not one all-reduce of [sum, sum of squares, count]: ``E[x^2] - mean^2`` cancels
  when ``|mean| >> std``; in fp32 a channel with mean 1000 and std 1 loses every digit of
  its variance (1e6 * 6e-8 = 0.06 absolute error per term, summed).  Every term of Chan's
  formula is non-negative, so nothing cancels.  The record is ``3 x M`` float64 per worker
  (float64 so that counts stay exact past 2^24), the same single collective, and combining
  in one fixed order makes the statistics bitwise identical on every worker (so are the
  running statistics computed from them).  A mean of local means is wrong under uneven
  splits; the weights ``n_i`` are what makes it exact.
* ``distfuse::normalize`` (backward ``distfuse::normalize_backward``: the exact adjoint,
  one all-reduce of ``2 x M`` values) normalises ``x3 [L, M, R]`` with one statistic per
  ``M``, or ``[B, L, M, R]`` with one per ``(B, M)`` (flattened ``b * M + m``), optionally with
  a per-``M`` affine.  The 4-D form is how a ``channels_last`` group norm reads its
  ``[N, *s, C]`` memory without a copy: ``[N, S, G, C/G]`` is a view, while no 3-D view
  puts ``(N, G)`` together.  The input is saved, not ``xhat``: a 16-bit input costs half
  the memory of its fp32 ``xhat``, and the output stays free for in-place ops.
* ``distfuse::replicate`` (:mod:`distfuse.primitives.all_sum_reduce`) is how a parameter
  replicated on several workers enters a computation: its adjoint sums the gradient, so
  every replica receives the global gradient.

The ops are defined once (:func:`~distfuse.primitives._op_pair.op_entry`): a compiled
call runs the custom ops, an eager call the same implementations, so both send the same
messages and compute the same bits.  One training call of :class:`NormLayer`::

    flag round                    every worker's flag over P_x (host; distfuse::flag_check compiled)
    distfuse::moments             the (count, mean, M2) all-gather over P_stats, Chan combine
    distfuse::normalize           xhat [* w + b]; backward: the all-reduce over P_stats
    distfuse::replicate           a replicated weight or bias; adjoint: the sum over P_rep
    distfuse::replicate_adjoint   instance norm's running statistics summed over the batch workers

Why the norms' flag takes a round of its own: their data collectives run over sub-grids
(``P_stats``, ``P_rep``), which reach every worker of ``P_x`` only in special layouts, and
an eval-mode batch norm or instance norm with running statistics has none at all; a flag
must reach every worker or those outside the changed worker's sub-grid would run on and
wait in the next layer.  The round replaces the metadata all-gather (no device read, so no
CUDA sync).  A worker whose input (or parameter) does not require grad while a peer's does
would skip the adjoint collective its peers wait in: an eager call promotes it to a leaf
that requires grad, which a graph cannot create, so a replayed call flags instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._conv_common import promote
from distfuse.layers._params import ParamLayout
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import all_reduce_sum, axes_subgrid, group_slots
from distfuse.primitives._common import check_inactive_input, collective_guard
from distfuse.primitives._handles import lookup
from distfuse.primitives._op_pair import op_entry
from distfuse.primitives.agreement_session import AgreementSession
from distfuse.primitives.all_sum_reduce import SubGridSum, replicate, replicated_sum

__all__ = ["CallRecord", "gather_call", "one_mode", "global_shape_of", "one_dtype", "subgrid", "check_norm_partition",
           "compute_dtype", "check_param_dtype", "Moments", "NormCall", "NormLayer", "numel", "FLOATS"]

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CODES = FLOATS + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIM = 8
_HEAD = 3  # grad flags, status, mode
_PER_TENSOR = 3 + _MAX_DIM  # ndim, dtype code, device ok, shape
_OK, _BAD_DEVICE, _TOO_MANY_DIMS = range(3)


def numel(shape: Sequence[int]) -> int:
    return math.prod([int(s) for s in shape])  # a list, not a generator: torch.compile traces it


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit tensors (as torch's norms accumulate them), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


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


def check_param_dtype(op: str, x_dtype: torch.dtype, param_dtype: torch.dtype | None) -> None:
    """torch's rule: parameters in the input's dtype, or in fp32 under a 16-bit input (mixed type)."""
    if param_dtype is None or param_dtype == x_dtype:
        return
    if x_dtype in (torch.float16, torch.bfloat16) and param_dtype == torch.float32:
        return
    raise expect(op, "input dtype (the parameters' dtype, or fp16/bf16 with fp32 parameters, as torch requires)",
                 str(param_dtype), str(x_dtype))


# ---------------------------------------------------------------- statistics and normalisation (the ops)


def _stat_shape(x3: torch.Tensor) -> tuple[int, ...]:
    """The shape that broadcasts one value per statistic against ``x3``: ``[1, M, 1]`` or ``[B, 1, M, 1]``."""
    return tuple(x3.shape[:-3]) + (1, x3.shape[-2], 1)


def _reduced_dims(x3: torch.Tensor) -> tuple[int, int]:
    """The dimensions each statistic runs over: ``L`` and ``R``."""
    return (x3.dim() - 3, x3.dim() - 1)


def _stat_count(x3: torch.Tensor) -> int:
    """The number of statistics of ``x3``: ``M`` or ``B * M``."""
    return (x3.shape[0] if x3.dim() == 4 else 1) * x3.shape[-2]


def _moments(x3: torch.Tensor, handle: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact global ``(mean, biased var)`` per statistic of ``x3`` over the handle's ``P_stats`` (float64, flat).

    ``count`` is the global number of elements per statistic.  Local moments in
    :func:`compute_dtype`, combined in float64 with Chan's formula in sub-grid rank order.
    No gradient: :func:`normalize`'s adjoint accounts for the statistics' dependence on ``x3``.
    """
    ctx: SubGridSum = lookup(handle)
    P = ctx.P
    with torch.no_grad():
        L, R = x3.shape[-3], x3.shape[-1]
        M = _stat_count(x3)
        n_loc = L * R
        rec = torch.zeros(3, M, dtype=torch.float64, device=x3.device)
        if n_loc > 0 and M > 0:
            var, mean = torch.var_mean(x3.to(compute_dtype(x3.dtype)), dim=_reduced_dims(x3), correction=0)
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
    M = _stat_count(x3)
    return x3.new_empty((M,), dtype=torch.float64), x3.new_empty((M,), dtype=torch.float64)


def _xhat(x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    shape = _stat_shape(x3)
    return (x3.to(compute_dtype(x3.dtype)) - mean.view(shape)) * invstd.view(shape)


def _like_x3(t: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``t`` in ``torch.empty_like(x3)``'s layout, as the fakes say (a copy only where the strides differ)."""
    return t if t.stride() == x3.stride() else torch.empty_like(x3, dtype=t.dtype).copy_(t)


def _normalize(x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
               invstd: torch.Tensor, handle: int, count: int) -> torch.Tensor:
    """``(x3 - mean) * invstd [* w + b]`` per statistic (``w``, ``b`` per ``M``), in the compute dtype; local."""
    y = _xhat(x3, mean, invstd)
    if weight is not None:
        y = y * weight.to(y.dtype).view(1, -1, 1)
    if bias is not None:
        y = y + bias.to(y.dtype).view(1, -1, 1)
    return _like_x3(y, x3)


def _normalize_fake(x3, weight, bias, mean, invstd, handle, count):
    return torch.empty_like(x3, dtype=compute_dtype(x3.dtype))


def _normalize_backward(dy: torch.Tensor, x3: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, handle: int, count: int,
                        needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The adjoint of :func:`_normalize` with the statistics' dependence on ``x3``: ``(dx, dw, db)``::

        db = sum dy        dw = sum dy * xhat        (global: every replica gets the full gradient)
        dx = w * invstd * (dy - db / n - xhat * dw / n)

    The sums run over every element that shares a statistic, on every worker: one
    all-reduce of ``[sum dy, sum dy * xhat]`` (``2 x M``) over ``P_stats``, which every worker
    of ``P_stats`` must reach.  Entries not in ``needs`` are empty.  With the 4-D form the
    sums are per ``(B, M)`` and ``dw``, ``db`` (per ``M``) add the ``B`` rows.
    """
    ctx: SubGridSum = lookup(handle)
    xhat = _xhat(x3, mean, invstd)
    dy = dy.to(xhat.dtype)
    dims, M, shape = _reduced_dims(x3), _stat_count(x3), _stat_shape(x3)
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


class NormLayer(BlockIdentityMixin, nn.Module):
    """What every distributed norm shares: its replicated parameters and running statistics, the agreement session
    over ``P_x``, the sub-grid contexts its ops name by handle, and the steps of its one forward.

    Subclasses call :meth:`_norm_setup` and define ``_forward(x, record)`` (the normalisation
    of the agreed call), ``_check_global(G)`` (their checks of the agreed global shape) and,
    where they differ from the defaults, ``_promotions`` and ``_mode_matters``.

    Attributes:
        session: the :class:`~distfuse.primitives.agreement_session.AgreementSession` over
            ``P_x``; ``agreement`` is its site (``calls`` / ``slow_calls`` count the calls
            and the metadata gathers).
    """

    def _norm_setup(self, P_x, param_shape, split_dims, block, *, affine: bool, bias: bool, running: bool,
                    P_stats, P_rep=None, P_batch=None, device=None, dtype=None) -> None:
        """Parameters ``[block]`` of the global ``param_shape`` (split by ``split_dims`` of ``P_x``, replicated on
        the other axes), running statistics if ``running``, the session and the contexts (in the same order on
        every worker: their handles name them in compiled graphs)."""
        op = type(self).__name__
        self.P_x, self.P_stats = P_x, P_stats
        self._param_shape, self._split = tuple(param_shape), tuple(split_dims)
        self.affine = bool(affine)
        self._has_bias = self.affine and bool(bias)
        self._has_buffers = bool(running)
        self.session = AgreementSession(op, P_x)
        self.agreement = self.session.site
        self._stats = SubGridSum(op, P_stats)
        self._rep = SubGridSum(op, P_rep) if P_rep is not None else None
        self._batch = SubGridSum(op, P_batch) if P_batch is not None else None
        device = torch.device(device) if device is not None else P_x.device
        kw = dict(device=device, dtype=dtype)
        make = P_x.active and self.affine
        self.register_parameter("weight", nn.Parameter(torch.ones(block, **kw)) if make else None)
        make = P_x.active and self._has_bias
        self.register_parameter("bias", nn.Parameter(torch.zeros(block, **kw)) if make else None)
        make = P_x.active and self._has_buffers
        self.register_buffer("running_mean", torch.zeros(block, **kw) if make else None)
        self.register_buffer("running_var", torch.ones(block, **kw) if make else None)
        # torch's InstanceNorm registers it too (and never advances it); kept for state-dict parity.
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device) if make else None)

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
        # The adjoint's collectives: every worker must run them when any does (see _promotions).
        return self._forward(promote(x, self._promotions(record.call)[0]), record)

    def _forward(self, x: torch.Tensor, record: NormCall) -> torch.Tensor:
        """The layer's normalisation of its block under the agreed ``record`` (an abstract hook)."""
        raise NotImplementedError(f"{type(self).__name__} must define _forward")

    def _promotions(self, call: CallRecord) -> tuple[bool, bool]:
        """Whether this worker's input / parameters must take part in the adjoint although they need no gradient
        here: some worker's input or parameter does, and the adjoint's collectives reach this worker."""
        return call.any_input_grad, call.any_param_grad

    def _agree(self, x: torch.Tensor) -> NormCall | None:
        """The call's agreed record (None: a replayed call that flagged; ``flag_check`` raises on every worker when
        the graph runs).

        The signature holds everything the checks read, so no local check is needed before
        the flag round.  An eager call promotes what :meth:`_promotions` asks for; a replayed
        call that would have to flags instead (a graph cannot make a leaf require grad).
        """
        params = [p for p in (self.weight, self.bias) if p is not None]
        grad_on = torch.is_grad_enabled()
        signature = (tuple(x.shape), x.dtype, x.device.type, grad_on, x.requires_grad,
                     tuple((p.dtype, p.requires_grad) for p in params), bool(self.training))

        def lacks_grad(record: NormCall) -> bool:
            x_needed, params_needed = self._promotions(record.call)
            lacks_x = x_needed and not (grad_on and x.requires_grad)
            return lacks_x or (params_needed and not all(grad_on and p.requires_grad for p in params))

        return self.session.agree(x, signature, True, lambda: self._gather(x, params), needs_eager=lacks_grad)

    def _gather(self, x: torch.Tensor, params: list[torch.Tensor]) -> NormCall:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        op, P_x = type(self).__name__, self.P_x
        held = [b for b in (self.running_mean, self.running_var) if b is not None]
        call = gather_call(op, P_x, [x, *params, *held],
                           ["input"] + ["parameter"] * len(params) + ["running statistic"] * len(held), params,
                           signature=self._signature(), mode=int(self.training))
        if self._mode_matters():
            one_mode(op, P_x, call)
        dtype = one_dtype(op, P_x, call.dtypes[0])
        G = global_shape_of(op, P_x, call.shapes[0])
        for dtypes in call.dtypes[1:]:  # every worker's parameters and buffers: every worker raises alike
            for t_dtype in dtypes:
                check_param_dtype(op, dtype, t_dtype)
        self._check_global(G)
        return NormCall(G, dtype, call)

    def _moments(self, x3: torch.Tensor, count: int) -> Moments:
        """The exact global statistics of ``x3`` over ``P_stats`` (``count`` elements each)."""
        mean, var = _moments_op(x3.detach(), self._stats.handle, count)
        return Moments(mean, var, count)

    def _normalize(self, x3: torch.Tensor, stats: Moments, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x3`` normalised with ``stats`` [* w + b] (compute dtype out); the adjoint all-reduces over ``P_stats``."""
        cdt = compute_dtype(x3.dtype)
        return _normalize_op(x3, weight, bias, stats.mean.to(cdt), stats.invstd(self.eps, cdt), self._stats.handle,
                             stats.count)

    def _replica(self, w: torch.Tensor | None, any_grad: bool) -> torch.Tensor | None:
        """A parameter every worker of ``P_rep`` holds a copy of, used so that each copy gets the global gradient.

        ``any_grad`` says whether any worker's copy requires grad (:attr:`CallRecord.any_param_grad`);
        a copy that does not is promoted, so that its adjoint's all-reduce still runs and its
        peers do not wait.
        """
        if w is None or self._rep.P.size == 1 or not any_grad:
            return w
        return replicate(promote(w, True), self._rep.handle)

    def _batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the batch workers (no autograd: the running statistics)."""
        return replicated_sum(t, self._batch.handle) if self._batch.P.size > 1 else t

    def _mode_matters(self) -> bool:
        """Whether training and eval calls run different collectives (then every worker must be in one mode)."""
        return False

    def _check_global(self, G: tuple[int, ...]) -> None:
        """The layer's checks of the agreed global input shape (raised on every worker alike)."""
