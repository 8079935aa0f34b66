"""The linears' agreement: the records their workers compare, and the row linears' one forward and dispatch.

Records.  On a slow call each worker sends a fixed-size int64 record (:func:`general_record`
for ``DistributedLinear``, :func:`row_record` for the reduce-scatter linear), evaluated alike
on every worker, so that all raise the same :class:`~distfuse.errors.ShapeError`.  The
partial sums travel in :func:`compute_dtype`, so the workers must share it.

The all-gather and reduce-scatter linears' one forward (:class:`RowLinear`)::

    step   = session.remember("step", choose)   the path: the dispatch decision and the fused op
    W, b   = params.fetch(layer, x)             the parameter broadcast, or the ZeRO weight all-gather
    y      = the row's op                       unfused: the flagged all-gather (then the GEMM) or the GEMM then
                                                the flagged reduce-scatter; fused: the fused GEMM + collective;
                                                ZeRO: the weight all-gather fused into the GEMM

The model-parallel workers of a row run one all-gather or reduce-scatter per call, sized
by their rows, sequence blocks and dtype, so the row's op carries the agreement flag
(:meth:`~distfuse.primitives.agreement_session.AgreementSession.agree_in`); other rows hold
independent data.  The fused paths' flag is ``distfuse::flag_check`` on the op's group
just before the op (the grid for ZeRO, whose weight group spans the rows).

Local checks (feature extent, a ``seq_len`` that does not fit the block, the number of
dimensions, a non-tensor input) do not raise where they fail: they set the worker's flag,
and on the slow path every worker raises the failing workers' messages
(:func:`~distfuse.primitives._agreement.agree_on_local_checks`).  The failing worker
takes part with a :func:`stand_in` input; on the fused GEMM paths it enters the fused op
and refuses at its first claim (:func:`~distfuse.fused.agreement.refusing`), with no host round.

Not covered: with one model-parallel worker (``P_m = 1``) and no ZeRO weight gather, the
failing worker raises after the parameter broadcast, and under grad mode its peers'
backward sum-reduce waits for it until ``DISTFUSE_TIMEOUT`` (a flag would cost a host
round per call).  Nor the ZeRO layers' fused path with several model-parallel workers,
except where the dispatch's grid-wide row round
(:func:`~distfuse.fused.zero_linear_dispatch.agreed_rows`: CUDA, no forced path) carries
the failure (:mod:`distfuse.fused.zero_linear`, "Disagreements").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distfuse.errors import DistfuseError, ShapeError, expect, where
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._conv_common import grid_of
from distfuse.layers._linear_common import (
    INACTIVE,
    LinearBase,
    check_row_partitions,
    decide,
    not_servable,
)
from distfuse.layers.dispatch import Decision
from distfuse.ops.fused_linear import ZeroLinearCall, make_call
from distfuse.primitives._agreement import agree_on_local_checks
from distfuse.primitives._axes import balanced_layout
from distfuse.primitives._common import check_inactive_input, dtype_code, dtype_of_code, gather_records, local_error
from distfuse.primitives._flag_deferred import poisoned_stand_in
from distfuse.primitives._gather_scatter import BlockCollective, reduce_scatter_op
from distfuse.primitives.agreement_session import REPLAY, AgreementSession, FlagRound, flag_check
from distfuse.primitives.all_gather import agreed_all_gather

__all__ = ["RowLinear", "Step", "stand_in", "agreed_input_gather", "agreed_matmul_reduce_scatter",
           "compute_dtype", "compute_dtype_of", "local_error", "general_record", "record_shape",
           "check_general_records", "check_input_dtype", "row_record", "check_row_records"]


# ---------------------------------------------------------------- records: what the workers compare

#: The most dimensions a record holds (and so the most a linear layer's input may have).
_MAX_DIM = 8


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes ``x`` in: the autocast dtype under ``torch.autocast`` (not for float64)."""
    return compute_dtype_of(x.dtype, x.device)


def compute_dtype_of(dtype: torch.dtype, device) -> torch.dtype:
    """:func:`compute_dtype` for an input of ``dtype`` on ``device`` (workers that hold no input ask this)."""
    device_type = torch.device(device).type
    if dtype.is_floating_point and dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


# DistributedLinear's record: [ndim, dtype, device, autocast dtype, grad mode, shape (8 slots)].
_TOO_MANY, _NOT_A_TENSOR = -2, -3


def general_record(x: torch.Tensor) -> list[int]:
    """This worker's record of a ``DistributedLinear`` call (13 int64; see :func:`check_general_records`).

    Something other than a tensor gets the record ``[-3, ...]``: every worker raises on it.
    """
    if not isinstance(x, torch.Tensor):
        return [_NOT_A_TENSOR, -1, -1, -1, int(torch.is_grad_enabled())] + [-1] * _MAX_DIM
    too_many, device_type = x.dim() > _MAX_DIM, x.device.type
    autocast = dtype_code(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else -1
    rec = [_TOO_MANY if too_many else x.dim(), dtype_code(x.dtype), -1, autocast,
           int(torch.is_grad_enabled())] + [-1] * _MAX_DIM
    if x.numel() > 0:
        rec[2] = _DEVICE_TYPES.index(device_type) if device_type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    if not too_many:
        rec[5:5 + x.dim()] = list(x.shape)
    return rec


_DEVICE_TYPES = ("cpu", "cuda", "meta", "xpu", "mps", "hpu")


def record_shape(rec: list[int]) -> tuple[int, ...]:
    return tuple(rec[5:5 + rec[0]])


def check_general_records(op: str, by_rank: dict, device_type: str) -> None:
    """What every worker of ``DistributedLinear`` must share: at most 8 dimensions, the device type, autocast
    (the partial sums' dtype) and grad mode (every worker runs its part of the adjoint)."""
    odd = sorted(w for w, r in by_rank.items() if r[0] == _NOT_A_TENSOR)
    if odd:
        raise ShapeError(f"{where(op)}: input type: expected torch.Tensor on every worker (a zero-volume tensor where "
                         f"a worker holds no input); world rank(s) {odd} passed something else")
    over = sorted(w for w, r in by_rank.items() if r[0] == _TOO_MANY)
    if over:
        raise ShapeError(f"{where(op)}: tensors of more than {_MAX_DIM} dimensions are not supported; world rank(s) "
                         f"{over} passed one")
    names = list(_DEVICE_TYPES) + ["another device"]
    bad = {w: names[r[2]] for w, r in by_rank.items() if r[2] >= 0 and names[r[2]] != device_type}
    if bad:
        raise ShapeError(f"{where(op)}: input device type: expected {device_type} on every worker, got "
                         f"{', '.join(f'world rank {w}: {d}' for w, d in sorted(bad.items()))}")
    for slot, what in ((3, "the autocast dtype (torch.autocast, -1: off)"), (4, "grad mode (torch.is_grad_enabled)")):
        seen = {w: r[slot] for w, r in by_rank.items()}
        if len(set(seen.values())) > 1:
            got = ", ".join(f"world rank {w}: {dtype_of_code(v) if slot == 3 and v >= 0 else v}"
                            for w, v in sorted(seen.items()))
            raise ShapeError(f"{where(op)}: every worker must call the layer with the same {what}; got {got}")


def check_input_dtype(op: str, dtype: torch.dtype | None, weight_dtype: torch.dtype, autocast_code: int) -> None:
    """The agreed input dtype must be one the layer multiplies: floating, and its weight's outside autocast."""
    if dtype is None or not dtype.is_floating_point:
        raise ShapeError(f"{where(op)}: the input dtype {dtype} is not a floating dtype; the layer multiplies floating "
                         f"inputs of its weight's dtype {weight_dtype} (any floating dtype under torch.autocast)")
    computes_in = dtype_of_code(autocast_code) if autocast_code >= 0 and dtype != torch.float64 else dtype
    if computes_in == dtype and dtype != weight_dtype:
        raise ShapeError(f"{where(op)}: the input dtype {dtype} is not the weight's dtype {weight_dtype}; the layer "
                         "multiplies inputs of its weight's dtype (any floating dtype under torch.autocast)")


# The reduce-scatter linear's record: [ndim, input dtype, compute dtype, problem, shape (8 slots)].
_OK, _BAD_DTYPE, _TOO_MANY_DIMS = range(3)


def row_record(x: torch.Tensor, weight_dtype: torch.dtype) -> list[int]:
    """This worker's record of a reduce-scatter linear call (12 int64; ``rec[3]`` is 0 when the layer can
    multiply the input: a floating dtype, its weight's outside autocast, at most 8 dimensions; the device type and
    the feature extent are the local checks')."""
    cdt = compute_dtype(x)
    problem = _OK
    if not x.is_floating_point() or (cdt == x.dtype and x.dtype != weight_dtype):
        problem = _BAD_DTYPE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
    rec = [min(x.dim(), _MAX_DIM), dtype_code(x.dtype), dtype_code(cdt), problem] + [-1] * _MAX_DIM
    if problem == _OK:
        rec[4:4 + x.dim()] = list(x.shape)
    return rec


def check_row_records(op: str, P_row, rows: list[list[int]],
                      weight_dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """Every model-parallel worker's :func:`row_record`, checked alike on every worker (raises on all of them) once
    every worker passed its local checks; returns the agreed leading extents and compute dtype."""
    for r, w in zip(rows, P_row.ranks, strict=True):
        if r[3] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of dtype {dtype_of_code(r[1])}; the "
                             f"layer multiplies floating inputs of its weight's dtype {weight_dtype} (any floating "
                             "dtype under torch.autocast)")
        if r[3] == _TOO_MANY_DIMS:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of more than {_MAX_DIM} dimensions")
    first = rows[0]
    for r in rows:
        if r[0] != first[0] or r[4:4 + r[0] - 1] != first[4:4 + first[0] - 1] or r[1:3] != first[1:3]:
            got = ", ".join(f"world rank {v}: shape {tuple(q[4:4 + q[0]])} dtype {dtype_of_code(q[1])} computing in "
                            f"{dtype_of_code(q[2])}" for q, v in zip(rows, P_row.ranks, strict=True))
            raise ShapeError(f"{where(op)}: the model-parallel workers must pass inputs with the same leading "
                             f"extents (rows) and dtype, computed in the same dtype (torch.autocast); got {got}")
    return tuple(first[4:4 + first[0] - 1]), dtype_of_code(first[2])


# ---------------------------------------------------------------- the row linears' one forward


def stand_in(layer, x) -> torch.Tensor:
    """``x`` if it is a tensor of two dimensions or more; otherwise zeros shaped as this layer's last eager input
    (a first call guesses ``(1, ..., 1, features)``): a failing worker still runs what its peers run."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return x
    shape, dtype = layer._last_input or ((1,) * (layer.P_in.dim - 1) + (layer._in_extent,), layer._param_dtype())
    return torch.zeros(shape, dtype=dtype, device=layer._param_device())


@dataclass(frozen=True)
class Step:
    """What a call runs: the dispatch ``decision``, the fused ``op`` (None: the unfused composition), and
    ``compiled``, what a compiled call that replays it records."""

    decision: Decision
    op: str | None
    compiled: Decision


def _step(decision: Decision, op: str | None = None) -> Step:
    why = (f"the fused op {op} as the custom op distfuse::{op} (the last eager call ran it)" if op else
           "the unfused composition through distfuse's custom ops (the last eager call ran unfused)")
    return Step(decision, op, Decision(decision.path, f"inside torch.compile: {why}", decision.provider))


class RowLinear(LinearBase):
    """What the all-gather and reduce-scatter linears share: the grid, the one forward, the dispatch, the agreement.

    ``P_grid`` is the feature-split partition ``[P_d, 1, ..., 1, P_m]``, ``P_seq`` the optional
    sequence-split one, ``names`` their argument names (checked by
    :func:`~distfuse.layers._linear_common.check_row_partitions`).  Subclasses set,
    before :meth:`_setup_row`: ``P_in`` (the input partition), ``params`` (a
    :class:`~distfuse.layers._linear_common.LinearParams`), ``_in_extent`` (this worker's
    input feature extent) and, for ZeRO, ``P_wgather``; and define ``_check_input``,
    ``_signature``, ``_gemm`` (the per-rank GEMM sizes the dispatch reads), ``_rows``,
    ``_fused_state`` and ``_unfused``.  ``_zero_entry`` names the registry entry of the ZeRO op.

    ``session`` agrees over the row (:mod:`distfuse.layers`); ``P_d``, ``P_m``, ``dm``: the data- and
    model-parallel extents, this worker's ``(d, m)``.
    """

    _zero = False
    _zero_entry = None

    def __init__(self, P_grid, P_seq, names: tuple[str, str], in_features: int, out_features: int, bias: bool, device,
                 dtype):
        check_row_partitions(self._op, P_grid, names[0], P_seq, names[1], swapped_hint=names[0] == "P_y")
        super().__init__(in_features, out_features, device if device is not None else P_grid.device, dtype)
        self.use_bias = bool(bias)
        self.P_d, self.P_m = P_grid.shape[0], P_grid.shape[-1]
        self.dm = divmod(P_grid.rank, self.P_m) if P_grid.active else (-1, -1)
        # Partition creation is collective over the world: every rank makes the layer's partitions in one order.
        self.P_users = P_grid if P_grid.dim == 2 else grid_of(P_grid.ranks, [self.P_d, self.P_m],
                                                                     P_grid.device)

    def _rank_of(self, d: int, m: int) -> int:
        """The world rank of worker ``(d, m)`` (the grid's middle extents are 1)."""
        return self.P_users.ranks[d * self.P_m + m]

    def _setup_row(self, P_row, form_entry, split: str, sequence: bool) -> None:
        """The agreement over the row ``P_row`` and the ops' contexts (same order on every worker); ``form_entry``:
        the form's fused op; ``split`` (``"rows"`` / ``"columns"``) and ``sequence``: ZeRO's op's arrangement."""
        op, keep = self._op, getattr(self, "keep_gathered", True)
        self.P_row, self._form_entry = P_row, form_entry
        self.session = AgreementSession(op, P_row)
        self.agreement = self.session.site
        self._rows_ctx = BlockCollective(op, P_row, self.session.forget)
        self._grid_flag = FlagRound(op, self.P_in, self.session.forget)  # ZeRO: the weight group spans the rows
        self._form_call = make_call(form_entry.name, P_row, keep, owner=op) if self.P_m > 1 else None
        self._zero_call = None
        if self._zero and self.P_d > 1:
            self._zero_call = ZeroLinearCall(P_d=self.P_wgather, P_m=P_row, split=split,
                                             axis="sequence" if sequence else "features",
                                             out_features=self.out_features, in_features=self.in_features,
                                             keep_gathered=keep, owner=op)
        self._last_input: tuple | None = None
        # The path is remembered per call only where the dispatch has a choice; elsewhere it is fixed.
        self._dispatches = self.P_m > 1 or (self._zero and self.P_d > 1)
        self._fixed = _step(not_servable(op, "one model-parallel worker: a plain local GEMM"))

    def forget_agreement(self) -> None:
        """Drop the agreed call record, so the next call gathers again (call it on every worker)."""
        self.session.forget()

    def _forward(self, x: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        if not self.P_in.active:
            check_inactive_input(self._op, x)
            self._record(INACTIVE)
            return x.clone()
        mode = self.session.begin()
        error = local_error(lambda: self._check_input(x, seq_len))
        if error is not None:  # run what the peers run, with a tensor of the peers' sizes as far as known
            x = stand_in(self, x)
        self._last_input = (tuple(x.shape), x.dtype)
        signature = self._signature(x, seq_len)
        step = self.session.remember("step", lambda: self._choose(x, seq_len, error)) if self._dispatches \
            else self._fixed
        self._record(step.compiled if mode == REPLAY else step.decision)
        if step.op == "zero_linear":  # the weight's shards stream into the GEMM (fused/zero_linear.py)
            b = self.params.fetch(self, x, gather_weight=False)[1]
            y = self._fused(self._zero_call, self._grid_flag, x, self.weight, None, signature, seq_len, error)
            return y + b.to(y.dtype) if b is not None else y
        W, b = self.params.fetch(self, x)
        if self.P_m == 1:  # one model-parallel worker: nothing to gather or scatter
            if error is not None:  # after the parameters' collective, which the data-parallel peers run too
                raise error
            return F.linear(x, W, b)
        if step.op is not None:
            return self._fused(self._form_call, self.session.flag, x, W, b, signature, seq_len, error)
        return self._unfused(x, W, b, signature, seq_len, error)

    def _fused(self, call, flag: FlagRound, x, W, b, signature, seq_len, error) -> torch.Tensor:
        """A fused op, its agreement checked by its own claim eagerly; a replayed call's flag in ``flag``'s round."""

        def run(state, flagged: int) -> torch.Tensor:
            if flagged >= 0:
                flag_check(x, flag.handle, bool(flagged))
            elif error is not None:  # trusted: nothing can tell the peers (see capture_safe)
                raise error
            return call(x, W, b, self._state_n(state))

        def gather():
            if error is not None and call is self._zero_call and self.P_m > 1:
                raise error  # the plain model-parallel collective carries no refusal (module doc)
            from distfuse.fused.agreement import refusing

            n = self._exact_n(x, seq_len)
            with refusing(error):  # this worker's local check failure, refused at the op's first claim
                y = call(x, W, b, n)
            self._record_kernel(call.op)
            return y, self._fused_state(x, n)

        return self.session.agree_in(signature, error is None, run, gather, checked_by_op=True)

    def _exact_n(self, x, seq_len) -> int:
        """The gathered sequence extent a fused op needs (-1: none; the all-gather linear's sequence form has one)."""
        return -1

    def _state_n(self, state) -> int:
        return -1

    # ------------------------------------------------------------------ dispatch

    def _choose(self, x, seq_len, error) -> Step:
        """The call's path: ZeRO's weight-streaming op where it is chosen, else the form's fused op or unfused."""
        zero = None
        if self._zero and self.P_d > 1:
            from distfuse.fused.zero_linear_dispatch import agreed_rows

            # One decision for the whole grid: the data-parallel workers hold different row counts.  Where the
            # count is exchanged (CUDA, no forced path) the round spans the grid and carries this worker's local
            # check failure: every worker raises there.
            rows = agreed_rows(self.P_wgather, self._rows(x, seq_len, error), x.device, P_all=self.P_in,
                               error=error, op=self._op)
            zero = self._zero_decision(rows, x.dtype, x.device)
            if zero.path == "fused":
                return _step(zero, "zero_linear")
        decision = self._decision(self._rows(x, seq_len, error), x.dtype, x.device, zero)
        return _step(decision, self._form_call.op if decision.path == "fused" else None)

    def _decision(self, rows: int, dtype, device, zero: Decision | None = None) -> Decision:
        """ZeRO: the weight-streaming path where it is chosen; otherwise the form's.  ``zero``: the ZeRO decision
        already taken (forward takes it on the rows agreed over the data-parallel workers)."""
        if self._zero and self.P_d > 1:
            zero = zero if zero is not None else self._zero_decision(rows, dtype, device)
            if zero.path == "fused" or self.P_m == 1:  # P_m = 1: the form has no fused op; say why ZeRO's did not run
                return zero
        if self.P_m == 1:
            return self._fixed.decision
        why = self._unservable()
        if why:
            return not_servable(self._op, why)
        return decide(self._form_entry.name, self._op, self._gemm(rows), dtype, self.P_m, device,
                      available=self._fused_available)

    def _zero_decision(self, rows: int, dtype, device) -> Decision:
        """ZeRO's weight all-gather inside the GEMM (fused/zero_linear.py); the GEMM of the weight-streaming op."""
        return decide(self._zero_entry.name, self._op, self._gemm(rows), dtype, self.P_d, device,
                      available=self._weight_gather_available)

    def _unservable(self) -> str | None:
        """Why the form's fused op cannot serve this layer (None: it can)."""
        return None

    def _fused_available(self) -> tuple[bool, str]:
        from distfuse.fused.matmul_common import fused_linear_available

        return fused_linear_available(self.P_row, self._param_device(), self._param_dtype())

    def _weight_gather_available(self) -> tuple[bool, str]:
        from distfuse.fused.zero_linear_dispatch import zero_linear_available

        return zero_linear_available(self.P_wgather, self.P_row if self.P_m > 1 else None, self._param_device(),
                                     self._param_dtype())

    def _explain(self, rows: int, x: torch.Tensor) -> Decision:
        if not self.P_in.active:
            return INACTIVE
        return self._decision(rows, x.dtype, x.device)


# ---------------------------------------------------------------- the unfused paths' agreement


def _raise(error: DistfuseError | None) -> None:
    """Raise this worker's local check failure (None: none): a check to agree on over the row."""
    if error is not None:
        raise error


def agreed_input_gather(layer, x: torch.Tensor, seq_len: int | None, error: DistfuseError | None) -> torch.Tensor:
    """The all-gather linear's gathered input: the features (last dim) without ``P_x``, the sequence (dim -2)
    with it, worker ``j`` holding block ``j``; ``error``: this worker's local check failure (None: none)."""
    op, P_m, P_sub = layer._op, layer.P_m, layer.P_row

    def check(shapes, dtype):  # this worker's checks agreed on over the row, then the records' alike everywhere
        n = sum(s[-2] for s in shapes)

        def own():
            _raise(error)
            if layer.P_x is not None and seq_len is not None and n != int(seq_len):
                raise expect(op, "gathered sequence length (the sum of the workers' blocks) against seq_len",
                             seq_len, n)

        agree_on_local_checks(P_sub, op, own)
        for j, s in enumerate(shapes):
            who = f"model-parallel worker {j} (world rank {P_sub.ranks[j]}"
            if layer.P_x is None and s[-1] != block_extent(layer.in_features, P_m, j):
                raise expect(op, f"input feature extent of {who}; block {j} of in_features={layer.in_features})",
                             block_extent(layer.in_features, P_m, j), s[-1])
            if layer.P_x is not None and (s[-1] != layer.in_features or s[-2] != block_extent(n, P_m, j)):
                raise expect(op, f"input block of {who}): the balanced block of the gathered sequence length {n}",
                             (*s[:-2], block_extent(n, P_m, j), layer.in_features), tuple(s))

    return agreed_all_gather(x, layer._rows_ctx, layer.session, extra=layer._signature(x, seq_len)[3:],
                             locally_ok=error is None, check=check)


def agreed_matmul_reduce_scatter(layer, x: torch.Tensor, W: torch.Tensor, signature,
                                 error: DistfuseError | None) -> torch.Tensor:
    """``reduce_scatter(x @ W.T)`` over the row, the inputs (rows, dtype) agreed.

    A worker whose input changed or cannot be multiplied skips its GEMM and sends zeros of
    the agreed size with the flag; then every worker gathers the records and raises the
    same error, or agrees on the new size.  ``error``: as for :func:`agreed_input_gather`.
    """
    op, P_sub, ctx = layer._op, layer.P_row, layer._rows_ctx
    rec = row_record(x, W.dtype)
    partial: list = []

    def full() -> torch.Tensor:
        if not partial:
            partial.append(F.linear(x, W))
        return partial[0]

    def run(state, flag: int) -> torch.Tensor:
        shape, dtype = state
        mine = full() if flag != 1 else poisoned_stand_in(shape, dtype, P_sub.device, x, W)
        return reduce_scatter_op(mine, ctx.handle, balanced_layout(P_sub, shape).blocks, None, flag)

    def gather():
        agree_on_local_checks(P_sub, op, lambda: _raise(error))  # a local check that failed anywhere raises here
        lead, dtype = check_row_records(op, P_sub, gather_records(op, P_sub, rec), W.dtype)
        shape = (*lead, layer.out_features)
        return reduce_scatter_op(full(), ctx.handle, balanced_layout(P_sub, shape).blocks, None, -1), (shape, dtype)

    return layer.session.agree_in(signature, rec[3] == 0 and error is None, run, gather)
