"""ZeRO-3 linears: the weight all-gather over the data-parallel workers fused into the GEMM, for any P_m.

Worker ``(d, m)`` of a ``[P_d, P_m]`` grid holds batch block ``d`` of the activations and
the ZeRO shard ``(d, m)`` of ``W [out, in]``; ``W_m``, the model-parallel block the GEMM
needs, is the all-gather of the shards over ``d``.  Unfused, the layers all-gather ``W_m``,
run the model-parallel linear, and reduce-scatter ``dW_m`` back to the shards.  Fused, the
GEMM reads ``W_m``'s chunks from the peers as their flags come up (as FSDP prefetches a
weight), by running the GEMM fusions of :mod:`distfuse.fused.matmul_phases` on the
transposed product ``y.T = W_m @ x.T`` (``x`` flattened to ``[rows, K]``): the shard is the
gathered operand.  The backward fuses the weight-gradient GEMM with its reduce-scatter over ``d``.

Reduce-scatter linear (``split="rows"``: shard ``[out_d, in_m]``, ``W_m [out, in_m]``);
``axis`` says what its model-parallel reduce-scatter splits (``"features"``: DistDL's form,
``y [*, out_m]``; ``"sequence"``: ``y [*, n_m, out]``, ``x [*, n, in_m]``)::

    forward  p.T = all_gather_rows_d(shard) @ x.T            [out, rows]   gather_and_consume(rows) over d
             y   = reduce_scatter_m(p)                        plain collective over m (see below)
    dgrad    dp  = all_gather_m(dy);  dx = dp @ W_m           gather_and_consume over m (features
                                                              or rows), dp returned
    wgrad    dshard = reduce_scatter_rows_d(dp.T @ x)  [out_d, in_m]   produce_and_scatter(rows) over d

All-gather linear (``split="columns"``: shard ``[out_m, in_d]``, ``W_m [out_m, in]``;
``x [*, in_m]``, or ``[*, n_m, in]`` for ``axis="sequence"``)::

    forward  x_g = all_gather_m(x)                            plain collective over m (see below)
             y.T = all_gather_K_d(shard) @ x_g.T              [out_m, rows]  gather_and_consume(features) over d
    dgrad    dx  = reduce_scatter_m(dy @ W_m)                 produce_and_scatter over m (features
                                                              or rows)
    wgrad    dshard = reduce_scatter_K_d(dy.T @ x_g)  [out_m, in_d]    produce_and_scatter(features) over d

The backward fuses both of its collectives, one per GEMM.  The forward has one GEMM and
two collectives (the weight's over ``d``, the activations' over ``m``); overlapping both
would take a kernel whose operand streams in from one group's buffers while its tiles
stream out to another's.  So the forward overlaps the weight's all-gather (the FSDP
schedule) and runs the activations' collective as a plain one
(:meth:`~distfuse.fused.matmul_common.Comm.reduce_scatter` of the finished partial, in
``partial_dtype``; the all-gather of the input before the GEMM).  With ``P_m = 1`` the
forward is fully fused.  Biases stay outside (the layers add them after, as unfused).

``keep_gathered``: keep ``W_m`` (and, for the all-gather linear, the gathered input) from
forward to backward (True), or gather them again in the backward (False: a plain
all-gather each, FSDP's ``reshard_after_forward``).

Dispatch: registry entries ``zero_linear_rows`` and ``zero_linear_columns``; what the
layers ask before they choose a path is in :mod:`distfuse.fused.zero_linear_dispatch`.

Disagreements.  A rank's own checks that fail inside the op reach its data-parallel peers
through the ``d`` group's first claim (:mod:`distfuse.fused.agreement`) where ``P_m = 1``.
With several model-parallel workers the forward's model-parallel collective has no flag,
so a rank that stops leaves the other columns waiting in it until ``DISTFUSE_TIMEOUT``;
only the layers' grid-wide row round (CUDA, size-based dispatch) catches their local
checks first.

Workspaces: the ``d`` group's (the gathered ``W_m`` or the ``dW_m`` partial slots: independent
of the rows, so every data-parallel worker asks the same) and the ``m`` group's (the sizes
of the activation-fused ops of the same layer, so one workspace serves both paths).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from distfuse import debug
from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.fused.agreement import refusal
from distfuse.fused.matmul_common import (
    Comm,
    Phases,
    check_partial_dtype,
    features_workspace_bytes,
    flat_rows,
    require_available,
    run_phases,
    workspace_bytes,
)
from distfuse.fused.matmul_phases import gather_and_consume, produce_and_scatter
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import FLOAT_DTYPES
from distfuse.kernels.signature import GATHER_FLAGS
from distfuse.partition import Partition

__all__ = ["PHASES", "zero_linear", "zero_linear_plan", "zero_linear_workspace_bytes", "SPLITS", "AXES"]

_OP = "zero_linear"
#: How the weight is split over the data-parallel workers: ``"rows"`` (the reduce-scatter linear's shards, along
#: out) or ``"columns"`` (the all-gather linear's, along in).
SPLITS = ("rows", "columns")
#: What the model-parallel collective splits: the features (DistDL's forms) or the sequence dim (``P_y`` / ``P_x``).
AXES = ("features", "sequence")
#: The pipeline axis (:mod:`distfuse.fused.matmul_phases`) of each model-parallel axis.
_AXIS = {"features": "features", "sequence": "rows"}


def zero_linear_workspace_bytes(split: str, axis: str, *, rows: int, n: int | None, out_features: int,
                                in_features: int, P_d_size: int, P_m_size: int, m: int, dtype: torch.dtype,
                                partial_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """``(d group bytes, m group bytes)`` on every rank of each (forward and backward); see the module doc.

    ``m`` is this worker's model-parallel index; ``rows`` its row count (all of the
    gathered sequence for ``axis="sequence"``), ``n`` the sequence extent.
    """
    out_m, in_m = block_extent(out_features, P_m_size, m), block_extent(in_features, P_m_size, m)
    if split == "rows":
        nb_d = workspace_bytes(1, out_features, in_m, P_d_size, dtype, partial_dtype)
        features = out_features  # the gradient gathered for dgrad
    else:
        nb_d = features_workspace_bytes(out_m, in_features, P_d_size, dtype, partial_dtype)
        features = in_features  # dgrad's partial sums
    if P_m_size == 1:
        return nb_d, 0
    if axis == "features":
        return nb_d, features_workspace_bytes(rows, features, P_m_size, dtype, partial_dtype)
    return nb_d, workspace_bytes(rows // n if n else 0, n, features, P_m_size, dtype, partial_dtype)


class _Plan(NamedTuple):
    d: Comm  # the data-parallel workers that share W_m
    m: Comm  # the model-parallel workers of this row (world size 1 when P_m = 1)
    split: str
    axis: str
    out_features: int
    in_features: int
    n: int | None  # the sequence extent (axis="sequence")
    keep_gathered: bool
    partial_dtype: torch.dtype | None
    nbytes_d: int
    nbytes_m: int


def _forward(plan: _Plan, needs, xs, shards, biases):
    """``y`` and what the backward keeps: ``W_m`` when kept for dgrad, then the gathered input when kept for the
    weight gradient (``"columns"``; ``"rows"`` reads the input block itself)."""
    (x,), (shard,) = xs, shards
    need_dx, need_dshard = needs[0], needs[1]
    keep_w = plan.keep_gathered and need_dx
    op = f"{_OP}.forward"
    if plan.split == "rows":
        (p_t,), (w_m,) = gather_and_consume(plan.d, op, [shard], [flat_rows(x)], [None], axis="rows",
                                            extent=plan.out_features, return_gathered=keep_w, nbytes=plan.nbytes_d)
        y = _reduce_scatter_partial(plan, p_t.t().reshape(*x.shape[:-1], plan.out_features))
        extras = []
    else:
        x_g = _gather_input(plan, op, x)
        (y_t,), (w_m,) = gather_and_consume(plan.d, op, [shard], [flat_rows(x_g)], [None], axis="features",
                                            extent=plan.in_features, return_gathered=keep_w, nbytes=plan.nbytes_d)
        y = y_t.t().reshape(*x_g.shape[:-1], shard.shape[0])
        extras = [x_g] if _keeps_gathered_input(plan, need_dshard) else []
    return [y], ([w_m] if keep_w else []) + extras


def _keeps_gathered_input(plan: _Plan, need_dshard: bool) -> bool:
    """The all-gather linear's gathered input kept for dshard (with one model-parallel worker it is the input)."""
    return plan.split == "columns" and plan.keep_gathered and need_dshard and plan.m.world_size > 1


def _backward(plan: _Plan, needs, xs, shards, biases, extras, dys):
    (x,), (shard,), (dy,) = xs, shards, dys
    need_dx, need_dshard = needs[0], needs[1]
    op = f"{_OP}.backward"
    w_m = None
    if need_dx:
        w_m = extras[0] if plan.keep_gathered else _gather_weight(plan, op, shard)
    if plan.split == "rows":
        dx, dshard = _rows_backward(plan, op, dy, w_m, x, need_dx, need_dshard)
    else:
        x_kept = extras[-1] if _keeps_gathered_input(plan, need_dshard) else x
        dx, dshard = _columns_backward(plan, op, dy, w_m, x_kept, need_dx, need_dshard)
    return [dx], [dshard], [None]


#: The op's autograd (see :class:`~distfuse.fused.matmul_common.Phases`): ``x`` the input, ``shard`` the weight.
PHASES = Phases(_forward, _backward)


def _reduce_scatter_partial(plan: _Plan, p: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter linear's model-parallel sum of ``p`` (``[*, out]`` or ``[*, n, out]``), plain."""
    if plan.m.world_size == 1:
        return p
    dim, n = (-1, plan.out_features) if plan.axis == "features" else (-2, plan.n)
    return plan.m.reduce_scatter([p], dim, n, plan.partial_dtype or p.dtype)[0]


def _gather_input(plan: _Plan, op: str, x: torch.Tensor) -> torch.Tensor:
    """The all-gather linear's input over the model-parallel workers (features or sequence), plain."""
    if plan.m.world_size == 1:
        return x
    features = plan.axis == "features"
    return plan.m.start_gather(op, [x], plan.in_features if features else plan.n, features).wait()[0]


def _gather_weight(plan: _Plan, op: str, shard: torch.Tensor) -> torch.Tensor:
    """``W_m`` gathered again in the backward (``keep_gathered=False``): a plain all-gather over d."""
    rows = plan.split == "rows"
    return plan.d.start_gather(op, [shard], plan.out_features if rows else plan.in_features, not rows).wait()[0]


def _rows_backward(plan: _Plan, op: str, dy, w_m, x, need_dx: bool, need_dshard: bool):
    """dx = all_gather_m(dy) @ W_m (fused, gives dp) and dshard = reduce_scatter_d(dp.T @ x) (fused)."""
    dx = dshard = None
    features = plan.axis == "features"
    if need_dx:
        (dx,), (dp,) = gather_and_consume(plan.m, op, [dy], [w_m.t()], [None], axis=_AXIS[plan.axis],  # [in_m, out]
                                          extent=plan.out_features if features else plan.n,
                                          return_gathered=need_dshard, nbytes=plan.nbytes_m)
    else:
        dp = plan.m.start_gather(op, [dy], plan.out_features if features else plan.n, features).wait()[0]
    if need_dshard:
        # dW_m = dp.T @ x [out, in_m], its rows reduce-scattered over d: the GEMM + reduce-scatter phase on the
        # transposed operands (n = out rows, K = this worker's rows, N = in_m).
        (dshard,) = produce_and_scatter(plan.d, op, [flat_rows(dp).t().contiguous()], [flat_rows(x).t()], [None],
                                        axis="rows", partial_dtype=plan.partial_dtype, nbytes=plan.nbytes_d)
    return dx, dshard


def _columns_backward(plan: _Plan, op: str, dy, w_m, x_kept, need_dx: bool, need_dshard: bool):
    """dx = reduce_scatter_m(dy @ W_m) (fused) and dshard = reduce_scatter_K_d(dy.T @ x_g) (fused)."""
    dx = dshard = None
    if need_dshard and not _keeps_gathered_input(plan, need_dshard):
        x_kept = _gather_input(plan, op, x_kept)
    if need_dx:
        (dx,) = produce_and_scatter(plan.m, op, [dy], [w_m.t()], [None], axis=_AXIS[plan.axis],  # [in, out_m]
                                    partial_dtype=plan.partial_dtype, nbytes=plan.nbytes_m)
    if need_dshard:
        # dW_m = dy.T @ x_g [out_m, in], its columns reduce-scattered over d: the features GEMM + reduce-scatter
        # phase with x_g.t() [in, rows] as the operand (K = this worker's rows).
        (dshard,) = produce_and_scatter(plan.d, op, [flat_rows(dy).t().contiguous()], [flat_rows(x_kept).t()],
                                        [None], axis="features", partial_dtype=plan.partial_dtype,
                                        nbytes=plan.nbytes_d)
    return dx, dshard


def _check(x, shard, P_d: Partition, P_m: Partition | None, split: str, axis: str, out_features: int,
           in_features: int, n: int | None) -> tuple[int, int | None]:
    """Argument checks; returns ``(rows, n)``: rows of the GEMM (all of the sequence) and the sequence extent."""
    if split not in SPLITS:
        raise expect(_OP, "split", " or ".join(SPLITS), repr(split), cls=UnsupportedError)
    if axis not in AXES:
        raise expect(_OP, "axis", " or ".join(AXES), repr(axis), cls=UnsupportedError)
    if not P_d.active or (P_m is not None and not P_m.active):
        raise PartitionError(f"{where(_OP)}: this rank is not in P_d {list(P_d.ranks)} and P_m "
                             f"{None if P_m is None else list(P_m.ranks)}")
    if not isinstance(x, torch.Tensor) or not isinstance(shard, torch.Tensor):
        raise expect(_OP, "x and shard types", "torch.Tensor", (type(x).__name__, type(shard).__name__))
    seq = axis == "sequence"
    if x.dim() < (3 if seq else 2) or shard.dim() != 2:
        raise ShapeError(f"{where(_OP)}: expected x [*, {'n, ' if seq else ''}K] and shard [rows, cols], got "
                         f"{tuple(x.shape)} and {tuple(shard.shape)}")
    if x.dtype not in FLOAT_DTYPES or shard.dtype != x.dtype or shard.device != x.device \
            or x.device.type != P_d.device.type:
        raise UnsupportedError(f"{where(_OP)}: expected x and shard of one dtype among "
                               f"{[str(t) for t in FLOAT_DTYPES]} on one {P_d.device.type} device, got "
                               f"{x.dtype} on {x.device} and {shard.dtype} on {shard.device}")
    Wm, m = (1, 0) if P_m is None else (P_m.size, P_m.rank)
    Wd, d = P_d.size, P_d.rank
    in_m = block_extent(in_features, Wm, m)
    want_x = f"[*, {'n, ' if seq and split == 'rows' else ''}{in_m}] (block {m} of in_features={in_features} over {Wm})"
    x_ok = x.shape[-1] == in_m
    if split == "rows":
        want_shard = (block_extent(out_features, Wd, d), in_m)
        n = x.shape[-2] if seq else None
    else:
        want_shard = (block_extent(out_features, Wm, m), block_extent(in_features, Wd, d))
        if seq:
            if n is None or n < 0:
                raise expect(_OP, "n (the gathered sequence extent)", "an integer >= 0", n)
            n_m = block_extent(int(n), Wm, m)
            want_x = f"[*, {n_m}, {in_features}] (block {m} of n={n} over {Wm}, all input features)"
            x_ok = x.shape[-1] == in_features and x.shape[-2] == n_m
    if not x_ok:
        raise expect(_OP, "x shape", want_x, tuple(x.shape), cls=ShapeError)
    if tuple(shard.shape) != want_shard:
        raise expect(_OP, f"shard shape (ZeRO shard of the {split} of W over {Wd} data-parallel workers)",
                     want_shard, tuple(shard.shape), cls=ShapeError)
    lead = math.prod(x.shape[:-1])
    if split == "columns" and seq:
        lead = math.prod(x.shape[:-2]) * int(n)
    return lead, (int(n) if n is not None else None)


def zero_linear(x: torch.Tensor, shard: torch.Tensor, P_d: Partition, P_m: Partition | None = None, *, split: str,
                axis: str = "features", out_features: int, in_features: int, n: int | None = None,
                keep_gathered: bool = True, partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ZeRO linear without its bias, the weight's all-gather over ``P_d`` fused into the GEMM; autograd-aware.

    Args:
        x: this worker's activations: ``split="rows"``: ``[*, in_m]`` (``[*, n, in_m]`` for
            ``axis="sequence"``); ``split="columns"``: ``[*, in_m]`` (``[*, n_m, in]``).
        shard: this worker's ZeRO shard, block ``(P_d.rank, P_m.rank)`` of ``W``: ``[out_d, in_m]``
            (``"rows"``) or ``[out_m, in_d]`` (``"columns"``), balanced blocks.
        P_d: the data-parallel workers sharing ``W_m``; P_m: the model-parallel workers of this
            row (None: one).  Both must satisfy :func:`zero_linear_available`.
        split, axis: the layer form (see the module doc).
        out_features, in_features: of ``W``; n: the sequence extent (``"columns"`` with ``"sequence"``).
        keep_gathered: keep ``W_m`` (and the gathered input) for the backward, or gather again.
        partial_dtype: dtype of the partial sums on the wire (default x's).

    Returns:
        ``y`` without bias: ``[*, out_m]`` (features), ``[*, n_m, out]`` (``"rows"``, sequence)
        or ``[*, n, out_m]`` (``"columns"``, sequence).

    Collective over ``P_d`` and ``P_m`` in forward and backward (``DISTFUSE_DEBUG=1`` checks agreement
    of the arguments); as for the other fused ops, the workers of a group must want the same
    gradients (x's and the shard's ``requires_grad`` alike), since which collectives the
    backward runs follows from them.
    """
    plan = zero_linear_plan(x, shard, P_d, P_m, split=split, axis=axis, out_features=out_features,
                            in_features=in_features, n=n, keep_gathered=keep_gathered, partial_dtype=partial_dtype)
    return run_phases(PHASES, plan, [x], [shard], None)[0]


def zero_linear_plan(x: torch.Tensor, shard: torch.Tensor, P_d: Partition, P_m: Partition | None = None, *,
                     split: str, axis: str = "features", out_features: int, in_features: int, n: int | None = None,
                     keep_gathered: bool = True, partial_dtype: torch.dtype | None = None) -> _Plan:
    """:func:`zero_linear`'s checks and plan: what its phases run on."""
    Wm, m = (1, 0) if P_m is None else (P_m.size, P_m.rank)
    # Where P_m = 1 a check that fails here reaches the data-parallel workers through their first claim; with
    # several model-parallel workers it raises alone (see "Disagreements" in the module doc).
    guard = refusal(_OP, P_d, x, GATHER_FLAGS, nbytes=lambda: zero_linear_workspace_bytes(
        split, axis, rows=0, n=None, out_features=out_features, in_features=in_features, P_d_size=P_d.size,
        P_m_size=1, m=0, dtype=x.dtype, partial_dtype=partial_dtype)[0]) if Wm == 1 and P_d.active \
        else contextlib.nullcontext()
    with guard:
        rows, n = _check(x, shard, P_d, P_m, split, axis, out_features, in_features, n)
        check_partial_dtype(_OP, partial_dtype)
    if P_m is not None and P_m.size > 1:
        require_available(_OP, P_m, x.device)
    require_available(_OP, P_d, x.device)
    common = dict(out=int(out_features), in_=int(in_features), split=split, axis=axis, dtype=str(x.dtype),
                  keep_gathered=bool(keep_gathered), partial_dtype=str(partial_dtype))
    debug.check_agreement(_OP, P_d.ranks, P_d.meta_group, same=dict(common, m=m),
                          info=dict(x=tuple(x.shape), shard=tuple(shard.shape)))
    if Wm > 1:
        debug.check_agreement(_OP, P_m.ranks, P_m.meta_group, same=dict(common, rows=rows, n=n),
                              info=dict(x=tuple(x.shape), shard=tuple(shard.shape)))
    nb_d, nb_m = zero_linear_workspace_bytes(split, axis, rows=rows, n=n, out_features=out_features,
                                             in_features=in_features, P_d_size=P_d.size, P_m_size=Wm, m=m,
                                             dtype=x.dtype, partial_dtype=partial_dtype)
    m_comm = Comm(P=P_m, device=x.device) if Wm > 1 else Comm(device=x.device)
    return _Plan(Comm(P=P_d, device=x.device), m_comm, split, axis, int(out_features), int(in_features), n,
                 bool(keep_gathered), partial_dtype, nb_d, nb_m)
