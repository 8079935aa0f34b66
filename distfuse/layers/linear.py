"""The general distributed linear layer: broadcast the input over a weight grid, local GEMMs, sum-reduce the output.

``W [out, in]`` is split in both dimensions over ``P_w [P_fo, P_fi]``: worker ``(i, j)``
owns ``W_ij [out_i, in_j]``, and the column-0 workers ``(i, 0)`` own ``b_i [out_i]``.
The input's features are split over ``P_x [1, ..., 1, P_fi]`` and the output's over
``P_y [1, ..., 1, P_fo]``; ``*`` is any number of leading dimensions, never split::

    x          [*, in_j]     on P_x worker j
    broadcast  x_j from P_x worker j to every P_w worker (i, j)  (down the columns of P_w)
    local      p_ij = x_j @ W_ij.T (+ b_i where j = 0)          [*, out_i]  on P_w worker (i, j)
    sum-reduce y_i  = sum over j of p_ij onto P_y worker i        [*, out_i]  (along the rows of P_w)
    adjoint    dp_ij = dy_i (broadcast); dx_j = sum over i of dp_ij @ W_ij (sum-reduce);
               dW_ij = dp_ij.T @ x_j; db_i = sum over rows of dp_i0

The sum-reduce maps P_w's rows onto P_y's workers, P_y transposed; with leading
dimensions the transpose would move P_y's ones to the end, so the layer moves
``[rows, features]`` matrices on two-dimensional views of the three partitions (blocks
travel whole, so a view changes no data) and restores the leading dimensions afterwards.

P_x, P_y and P_w may sit on any world ranks.  A P_w or P_y worker outside P_x cannot know
the leading extents or the dtype, and no collective reaches every worker, so the layer
agrees over the union of the three partitions with its flag in a round of its own: on the
host, or on CUDA, where every worker holds an input block, a device all-reduce read at the
next call (:mod:`~distfuse.primitives._flag_deferred`; a worker whose call changed alone runs
it on a NaN stand-in of its agreed block; records: :mod:`~distfuse.layers._linear_agreement`).
A P_w- or P_y-only worker's empty input repeats when the rows change, so there every new
batch size would look like a change on some workers only: those layers keep the host round.  Workers outside P_y get a
zero-volume ``[0]`` output that still carries their part of the adjoint, so every worker
must call backward on what it got.

Fused path (``matmul_all_reduce``): each row of P_w all-reduces its partial products over
symmetric buffers, and one worker of row ``i``, its keeper, keeps the result: P_y worker
``i`` where it lies in row ``i``, else the row's column-0 worker, which then copies ``y_i``
to P_y worker ``i`` (one message per such row instead of ``P_fi`` partial sums).  The other
workers of the row return a zero-volume view, so the backward's all-reduce
(``grad_output="sum"``) hands every worker of the row ``dy_i``, the sum-reduce's adjoint.
The input broadcast stays unfused.  The decision is taken on the global block-0 extents, so
all rows decide alike (where keepers deliver across rows availability is asked of all of
P_w); a P_y worker outside P_w keeps the layer unfused, since it could not tell which
message to wait for.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from distfuse import debug
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.fused import registry
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._conv_common import grid_of, subgrid, union_of
from distfuse.layers._linear_agreement import (
    check_general_records,
    check_input_dtype,
    compute_dtype,
    compute_dtype_of,
    general_record,
    local_error,
    record_shape,
)
from distfuse.layers._linear_common import (
    INACTIVE,
    LinearBase,
    check_block_features,
    check_cartesian,
    decide,
    not_servable,
)
from distfuse.layers.dispatch import Decision
from distfuse.ops.fused_linear import make_call
from distfuse.primitives._common import check_inactive_input, dtype_of_code, gather_records
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.agreement_session import REPLAY, AgreementSession
from distfuse.primitives.broadcast import broadcast_plan, move_of, placeholder
from distfuse.primitives.sum_reduce import sum_reduce_plan

__all__ = ["DistributedLinear"]


def _check_partitions(op: str, P_x, P_y, P_w) -> None:
    check_cartesian(op, "P_x", P_x)
    check_cartesian(op, "P_y", P_y)
    check_cartesian(op, "P_w", P_w, min_dim=2)
    if P_y.dim != P_x.dim:
        raise expect(op, "number of dimensions of P_y (that of P_x: the output has the input's dimensions)",
                     P_x.dim, P_y.dim, cls=PartitionError)
    for name, P, k in (("P_x", P_x, 1), ("P_y", P_y, 1), ("P_w", P_w, 2)):
        if any(s != 1 for s in P.shape[:-k]):
            want = [1] * (P.dim - k) + list(P.shape[-k:])
            raise expect(op, f"shape of {name} (only the last {k} dimension{'s' if k > 1 else ''} may split)", want,
                         list(P.shape), cls=PartitionError)
    if tuple(P_w.shape[-2:]) != (P_y.shape[-1], P_x.shape[-1]):
        raise expect(op, f"last two extents of P_w ([P_fo, P_fi] from P_y {list(P_y.shape)} and P_x "
                         f"{list(P_x.shape)})", [P_y.shape[-1], P_x.shape[-1]], list(P_w.shape[-2:]),
                     cls=PartitionError)


def _as_2d(P, shape, device):
    """``P`` itself if it has ``shape``, else the same ranks arranged as ``shape`` (collective)."""
    return P if tuple(P.shape) == tuple(shape) else grid_of(P.ranks, shape, device)


class DistributedLinear(LinearBase):
    """``y = x W^T + b`` with ``W`` split over ``P_w``, ``x`` over ``P_x`` and ``y`` over ``P_y`` (see the module doc).

    Args:
        P_x: input partition ``[1, ..., 1, P_fi]``, one dimension per input dimension.
        P_y: output partition ``[1, ..., 1, P_fo]``, as many dimensions as ``P_x``.
        P_w: weight partition ``[P_fo, P_fi]`` (leading ones allowed).
        in_features, out_features: as in ``torch.nn.Linear``.
        bias: add a learnable bias (owned by ``P_w``'s column 0).
        device, dtype: of the parameters (default: ``P_w``'s device, the default dtype).
    """

    def __init__(self, P_x, P_y, P_w, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None):
        op = type(self).__name__
        _check_partitions(op, P_x, P_y, P_w)
        super().__init__(in_features, out_features, device if device is not None else P_w.device, dtype)
        self.P_x, self.P_y, self.P_w, self.use_bias = P_x, P_y, P_w, bool(bias)
        P_fo, P_fi = P_w.shape[-2:]
        self.P_fo, self.P_fi = P_fo, P_fi
        dev = P_w.device
        P_x2, P_y2 = _as_2d(P_x, (1, P_fi), dev), _as_2d(P_y, (1, P_fo), dev)
        self.P_weight = _as_2d(P_w, (P_fo, P_fi), dev)
        self.P_bias = grid_of([P_w.ranks[i * P_fi] for i in range(P_fo)], [P_fo], dev)
        self.P_all = union_of(P_x, P_y, P_w)
        self._plan_x = broadcast_plan(P_x2, self.P_weight)
        self._plan_y = sum_reduce_plan(self.P_weight, P_y2, transpose_dest=True)
        # Workers that hold no input block cannot know the leading extents: they learn them from the agreed record.
        self._needs_meta = not (set(P_w.ranks) | set(P_y.ranks)) <= set(P_x.ranks)
        # The fused path: row i's keeper (module doc) is P_y worker i where it lies in row i, else column 0's.
        self.P_row = subgrid(self.P_weight, [1])
        rows_of_w = [self.P_weight.ranks[i * P_fi:(i + 1) * P_fi] for i in range(P_fo)]
        self._keepers = [P_y.ranks[i] if P_y.ranks[i] in rows_of_w[i] else rows_of_w[i][0] for i in range(P_fo)]
        self._y_in_w = set(P_y.ranks) <= set(P_w.ranks)
        self._keeps = self.P_weight.active and self.P_weight.ranks[self.P_weight.rank] in self._keepers
        self._plan_deliver = None  # keeper i -> P_y worker i, where some keeper is not the P_y worker
        if self._y_in_w and self._keepers != list(P_y.ranks):
            self._plan_deliver = broadcast_plan(grid_of(self._keepers, (1, P_fo), dev), P_y2)
        self._last_rows = 0
        self.session = AgreementSession(self._op, self.P_all)
        self.agreement = self.session.site
        self._fused = make_call("matmul_all_reduce", self.P_row, owner=self._op)  # the fused path's call site
        self._register_params()

    def _in_block(self, j: int) -> int:
        return block_extent(self.in_features, self.P_fi, j)

    def _gathered(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        """The input's leading extents and dtype from every worker's :func:`general_record` (collective over
        ``P_all``), checked alike on every worker."""
        op, P_x = self._op, self.P_x
        rows = gather_records(op, self.P_all, general_record(x))
        by_rank = dict(zip(self.P_all.ranks, rows, strict=True))  # P_all lists its ranks sorted: group order
        check_general_records(op, by_rank, self.P_all.device.type)
        for w, r in by_rank.items():
            shape = record_shape(r)
            if w not in P_x.ranks and math.prod(shape) != 0:
                raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor; "
                                 f"it passed shape {shape}")
        first = by_rank[P_x.ranks[0]]
        lead, dtype = record_shape(first)[:-1], dtype_of_code(first[1])
        for r, w in enumerate(P_x.ranks):
            shape, dt = record_shape(by_rank[w]), dtype_of_code(by_rank[w][1])
            want = self._in_block(P_x.index_of(r)[-1])
            if len(shape) != P_x.dim or shape[-1] != want:
                raise ShapeError(f"{where(op)}: world rank {w} (P_x worker {r}) passed shape {shape}; "
                                 f"expected {P_x.dim} dimensions ending in its block of in_features: {want}")
            if shape[:-1] != lead or dt != dtype:
                raise ShapeError(f"{where(op)}: the P_x workers must agree on the leading extents and dtype; world "
                                 f"rank {P_x.ranks[0]} has {lead} {dtype}, world rank {w} has {tuple(shape[:-1])} {dt}")
        check_input_dtype(op, dtype, self._param_dtype(), by_rank[P_x.ranks[0]][3])
        return lead, dtype

    def _locally_ok(self, x: torch.Tensor) -> bool:
        """Whether this worker's input passes its own checks; a failure flags, so that every worker raises."""
        j = self.P_x.index[-1]
        what = f"block {j} of in_features={self.in_features} over P_fi={self.P_fi}"
        return local_error(lambda: check_block_features(self._op, x, self.P_x, self._in_block(j), what)
                           if self.P_x.active else check_inactive_input(self._op, x)) is None

    def _signature(self, x) -> tuple:
        if not isinstance(x, torch.Tensor):
            return "not a tensor", type(x).__name__
        return tuple(x.shape), x.dtype, x.device.type, compute_dtype(x), torch.is_grad_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This worker's output block on P_y (``[*, out_i]``), or a zero-volume ``[0]`` tensor elsewhere."""
        op = self._op
        if not self.P_all.active:
            check_inactive_input(op, x)
            self._record(INACTIVE)
            return x.clone()
        # The agreed record (module doc), so that a bad block raises on every rank, not only here.
        ok = isinstance(x, torch.Tensor) and self._locally_ok(x)
        # Deferred only where every worker holds an input block: a P_w- or P_y-only worker's (empty) input repeats
        # when the rows change, so under the deferred transport every new batch size would be refused.
        state = self.session.agree(x, self._signature(x), ok, lambda: self._gathered(x),
                                   deferrable=set(self.P_all.ranks) <= set(self.P_x.ranks))
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed block
            x = self.session.stand_in(x)
        if debug.enabled() and self.session.may_read_host:
            state = self._gathered(x)
        if not isinstance(x, torch.Tensor):  # it flagged, and its record made every worker raise above
            raise expect(op, "input type", "torch.Tensor", type(x).__name__)
        if state is None:  # a replayed call that flagged: flag_check raises on every worker
            return x.clone()
        lead, dtype = state
        rows = math.prod(lead)
        device = self._param_device()
        in_w, in_y = self.P_weight.active, self.P_y.active
        i, j = self.P_weight.index if in_w else (-1, -1)
        x2 = x.reshape(rows, x.shape[-1]) if self.P_x.active else placeholder(x, dtype, device)
        # the anchor: every worker runs the adjoints (see _linear_common), also a receive-only one
        xb = x2 if self._plan_x.identity else move_of(self._plan_x).copy(x2, [rows, self._in_block(j)] if in_w else [0],
                                                                        anchor=anchor(True))
        self._last_rows = rows
        decision = self.session.remember(("path", rows, dtype), lambda: self._decision(rows, dtype))
        if self.session.last_mode == REPLAY:  # say so in last_decision: the path is the last eager call's
            decision = dataclasses.replace(decision, reason=f"inside torch.compile, the path of the last eager call "
                                                            f"with these rows and dtype: {decision.reason}")
        self._record(decision)
        out_i = block_extent(self.out_features, self.P_fo, self.P_y.index[-1]) if in_y else 0
        if in_w and decision.path == "fused":
            y_row = self._fused(xb, self.weight, self.bias if j == 0 else None)
            # Row i's keeper keeps the sum; the others hand back a zero-volume view (their part of the adjoint).
            y = y_row if self._keeps else y_row.reshape(-1)[:0]
            if self._plan_deliver is not None:  # the adjoint hands each keeper dy_i back for the row's all-reduce
                y = move_of(self._plan_deliver).copy(y, [rows, out_i] if in_y else [0], anchor=anchor(True))
            return y.reshape(*lead, out_i) if in_y else y.reshape(-1)[:0]
        # torch.autocast: the partial sums (and y) are in its dtype; off P_w, p is zero-volume and carries this
        # worker's part of the broadcast's adjoint
        p = F.linear(xb, self.weight, self.bias if j == 0 else None) if in_w else xb.to(compute_dtype_of(dtype, device))
        y = p if self._plan_y.identity else move_of(self._plan_y).sum(p, [rows, out_i] if in_y else [0],
                                                                      anchor=anchor(True))
        return y.reshape(*lead, out_i) if in_y else y

    # ------------------------------------------------------------------ dispatch

    def _decision(self, rows: int, dtype: torch.dtype) -> Decision:
        if not self.P_weight.active:
            return Decision("unfused", f"{self._op}: this rank is not in P_w: it only sends its input block or "
                                       "receives its output block (the unfused primitives)")
        if self.P_fi == 1:
            return not_servable(self._op, "one input-feature block per row of P_w: no partial sums to reduce")
        if not self._y_in_w:
            return not_servable(self._op, "a P_y worker outside P_w (it could not tell which path the rows of P_w "
                                          "took, so which message to wait for)")
        # Global block-0 extents, so that every row (and group) takes the same decision.
        shapes = dict(m=rows, n=block_extent(self.out_features, self.P_fo, 0), k=self._in_block(0))
        return decide(registry.MATMUL_ALL_REDUCE.name, self._op, shapes, dtype, self.P_fi, self._param_device(),
                      available=self._fused_available)

    def _fused_available(self) -> tuple[bool, str]:
        from distfuse.fused.matmul_common import fused_linear_available

        # Where keepers deliver across rows, sender and receiver must take the same path: ask the whole grid.
        P = self.P_row if self._plan_deliver is None else self.P_weight
        return fused_linear_available(P, self._param_device(), self._param_dtype())

    def explain(self, x: torch.Tensor) -> Decision:
        """The path :meth:`forward` takes for ``x`` and why (rows from ``x`` on P_x, else the latest forward's)."""
        if not self.P_all.active:
            return INACTIVE
        rows = math.prod(x.shape[:-1]) if self.P_x.active and x.dim() > 1 else self._last_rows
        dtype = x.dtype if self.P_x.active else self._param_dtype()
        return self._decision(rows, dtype)
