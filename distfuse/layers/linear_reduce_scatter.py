"""Row-parallel linear: a local GEMM on the input-feature block, then a reduce-scatter over the model-parallel workers.

The weight ``W [out, in]`` is split along the input features over the ``P_m``
model-parallel workers; each worker's GEMM yields a full-size partial sum, which the
reduce-scatter adds up and splits (``b`` batch, ``n`` sequence, ``*`` any number of
leading dimensions, including none)::

    x          P_x [P_d, 1, ..., P_m]     x [b_d, *, n, in_m]
    weight     W_m [out, in_m]
    partial    p  = x @ W_m.T  (+ b on m = 0, P_y form)               p [b_d, *, n, out]
    P_x only:  y  = reduce_scatter(p) along the last dim + b_m        y [b_d, *, n, out_m]  on P_x
    with P_y:  y  = reduce_scatter(p) along dim -2                    y [b_d, *, n_m, out]  on P_y [P_d, 1, ..., P_m, 1]
                                                                      (the fused GEMM+RS form)
    adjoint    dp = all_gather(dy) (the reduce-scatter's adjoint); dx = dp @ W_m; dW_m = sum over d of dp.T @ x

``in_m``/``out_m``/``n_m``/``b_d`` are blocks of the balanced decomposition (uneven and
possibly empty).

Bias, added exactly once per output element:

* P_x only: ``b`` is split like the output features; worker ``(0, m)`` owns ``b_m``, and
  every ``(d, m)`` adds it after the reduce-scatter, to its own output block (the
  reference's placement; the add is spread over all workers).
* With P_y: every worker's output block has all ``out`` features, so a block of ``b``
  would not do.  Worker ``(0, 0)`` owns the whole ``b``; the ``m = 0`` workers add it to
  their partial sum before the reduce-scatter.  That is one ``out``-element message per
  data-parallel worker, against ``P_m`` times that to give ``b`` to every worker, for
  one extra ``rows * out`` add on one worker per row of the grid (under 1/in_m of its GEMM).

Parameters.  :class:`DistributedLinearReduceScatter` keeps ``W_m`` (and its bias) on the
``d = 0`` workers and broadcasts them along ``d`` in forward (the adjoint sum-reduces
the gradients back).  :class:`DistributedLinearReduceScatterZero` (ZeRO-3) also splits
``W`` along the output features over the data-parallel workers: worker ``(d, m)`` owns
block ``(d, m)`` of ``W`` on a ``[P_d, P_m]`` grid, all-gathers ``W_m`` along ``d`` in
forward, and the adjoint reduce-scatters ``dW_m`` so each worker keeps its own shard's
gradient.  The bias (``out`` elements) is kept and broadcast as in the plain layer.

Dispatch: both forms have a fused GEMM + reduce-scatter, ``matmul_reduce_scatter_features``
without P_y (the output's features scattered) and ``matmul_reduce_scatter`` with P_y (its
sequence dim scattered); the layer asks :func:`~distfuse.layers.dispatch.select_path`
with the per-rank GEMM ``m = rows of x, n = out, k = in block`` and records the decision
in ``last_path`` / ``last_decision``.  In the P_x form the fused op adds ``b_m`` in its
reduction, the same placement as the unfused path.  The ZeRO layer with ``P_d > 1`` first
asks for its own fused path (:mod:`distfuse.fused.zero_linear`, registry entry
``zero_linear_rows`` over the ``P_d`` workers on their largest row count): the shards
stream into the GEMM, the partial is reduce-scattered over the model-parallel workers as
a plain collective, and the backward fuses the dgrad GEMM with the all-gather of ``dy``
and the ``dW_m`` GEMM with its reduce-scatter over ``d``; the bias is added after.  Where
that path is not chosen, the form's own decision follows (the weight all-gathered first).
Agreement: the model-parallel workers' inputs must agree on rows and dtype (else gloo
aborts, or fp16 meets bf16 in the sum).  The unfused path checks them on the first call
and whenever some worker's input changed, with a flag riding on the reduce-scatter in
between (no metadata while inputs repeat; ``_linear_agreement.py``), and raises the same
ShapeError on every worker of the row.  Under ``torch.autocast`` the output is in the
autocast dtype, as ``torch.nn.Linear``'s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distfuse.errors import PartitionError, expect
from distfuse.fused import registry
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._linear_agreement import (
    FUSED_FIRST_ORDER,
    agreed_matmul_reduce_scatter,
    first_order_only,
    fused_or_refuse,
    stand_in,
)
from distfuse.layers._linear_common import (
    INACTIVE,
    LinearBase,
    ParamBroadcast,
    check_block_features,
    check_cartesian,
    check_same_ranks,
    decide,
    grid_partition,
    not_servable,
    subgrid,
)
from distfuse.layers._linear_compiled import compiled_reduce_scatter_forward, reduce_scatter_signature, remember
from distfuse.layers._linear_records import local_error
from distfuse.layers._params import ParamLayout
from distfuse.layers.dispatch import Decision
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives.all_gather import all_gather

__all__ = ["DistributedLinearReduceScatter", "DistributedLinearReduceScatterZero"]


def _check_partitions(op: str, P_x, P_y) -> None:
    check_cartesian(op, "P_x", P_x, min_dim=2)
    if any(s != 1 for s in P_x.shape[1:-1]):
        want = [P_x.shape[0]] + [1] * (P_x.dim - 2) + [P_x.shape[-1]]
        raise expect(op, "shape of P_x ([P_d, 1, ..., 1, P_m]: only the first and last dimensions split)", want,
                     list(P_x.shape), cls=PartitionError)
    if P_y is None:
        return
    check_cartesian(op, "P_y", P_y, min_dim=3)
    want = [P_x.shape[0]] + [1] * (P_x.dim - 3) + [P_x.shape[-1], 1]
    if list(P_y.shape) != want:
        raise expect(op, f"shape of P_y ([P_d, 1, ..., P_m, 1] for P_x {list(P_x.shape)}: P_y splits the sequence "
                         "dim where P_x splits the features)", want, list(P_y.shape), cls=PartitionError)
    check_same_ranks(op, P_x, "P_x", P_y, "P_y")


class _LinearReduceScatter(LinearBase):
    """The reduce-scatter linear; ``_zero`` selects how the weight reaches the workers (see the module doc)."""

    _zero = False

    def __init__(self, P_x, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 P_y=None):
        op = type(self).__name__
        _check_partitions(op, P_x, P_y)
        super().__init__(in_features, out_features, device if device is not None else P_x.device, dtype)
        self.P_x, self.P_y, self.use_bias = P_x, P_y, bool(bias)
        P_d, P_m = P_x.shape[0], P_x.shape[-1]
        self.P_d, self.P_m = P_d, P_m
        rank_of = lambda d, m: P_x.ranks[d * P_m + m]  # worker (d, m); middle extents are 1
        self.dm = divmod(P_x.rank, P_m) if P_x.active else (-1, -1)
        m = self.dm[1]
        out, dev = self.out_features, P_x.device
        in_m = block_extent(self.in_features, P_m, m) if P_x.active else 0
        out_m = block_extent(out, P_m, m) if P_x.active else 0

        # Partition creation is collective over the world: every rank runs these calls in this order.
        if P_y is None:
            self.P_scatter = subgrid(P_x, [P_x.dim - 1])
        else:
            self.P_scatter = subgrid(P_y, [P_y.dim - 2])
        owners = [rank_of(0, j) for j in range(P_m)]
        P_owners = grid_partition(owners, [P_m], dev)
        P_users = P_x if P_x.dim == 2 else grid_partition(P_x.ranks, [P_d, P_m], dev)
        w_shapes = [] if self._zero else [(out, in_m)]
        if P_y is None:
            # (0, m) owns b_m and sends it with W_m (one message).
            self.P_bias = P_owners
            b_shapes = [(out_m,)] if self.use_bias else []
            self._bcast = ParamBroadcast(P_owners, P_users, w_shapes + b_shapes)
            self._bcast_bias = None
        else:
            # (0, 0) owns all of b and every worker gets a copy: each adds it to its own output rows after the
            # reduce-scatter (unfused) or in the chunk reduce (fused), so every element gets it exactly once and
            # the Broadcast's adjoint sums the per-worker partial gradients back on (0, 0).
            self.P_bias = grid_partition([rank_of(0, 0)], [1], dev)
            self._bcast = ParamBroadcast(P_owners, P_users, w_shapes)
            self._bcast_bias = None
            if self.use_bias:
                self._bcast_bias = ParamBroadcast(self.P_bias, P_users, [(out,)])
        if self._zero:
            # Worker (d, m) owns block (d, m) of W: rows split over P_d, columns over P_m.
            self.P_weight = P_users
            self.P_wgather = subgrid(self.P_weight, [0])
        else:
            self.P_weight = grid_partition(owners, [1, P_m], dev)
        self._block("weight", self.P_weight, (out, self.in_features))
        if self.use_bias:
            self._block("bias", self.P_bias, (out,))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def param_layouts(self) -> list[ParamLayout]:
        lays = [ParamLayout("weight", "weight", self.P_weight, (self.out_features, self.in_features))]
        if self.use_bias:
            lays.append(ParamLayout("bias", "bias", self.P_bias, (self.out_features,)))
        return lays

    # ------------------------------------------------------------------ forward

    def _params(self, gather_weight: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``W_m`` on this worker, and the bias it adds (``b_m``; all of ``b`` with P_y; else None).

        ``gather_weight=False`` (ZeRO with the weight all-gather fused into the GEMM): W is None.
        """
        dtype, device = self._param_dtype(), self._param_device()
        src = self._bcast.is_src
        mine = ([] if self._zero else [self.weight]) + ([self.bias] if self.use_bias and self.P_y is None else [])
        got = self._bcast(mine if src else [], dtype, device)
        if self._zero:
            in_m = block_extent(self.in_features, self.P_m, self.dm[1])
            # One data-parallel worker: its shard is all of W_m (all_gather would return a copy).
            if not gather_weight:
                W = None
            elif self.P_d == 1:  # one data-parallel worker: its shard is all of W_m (all_gather would copy it)
                W = self.weight
            else:
                W = all_gather(self.weight, self.P_wgather, (self.out_features, in_m))
        else:
            W, got = got[0], got[1:]
        if not self.use_bias:
            return W, None
        if self.P_y is None:
            return W, got[0]
        return W, self._bcast_bias([self.bias] if self._bcast_bias.is_src else [], dtype, device)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y = reduce_scatter(x @ W_m.T) + bias`` on this worker (see the module docstring for the split)."""
        if not self.P_x.active:
            check_inactive_input(self._op, x)
            self._record_inactive()
            return x.clone()
        if torch.compiler.is_compiling():  # custom ops, no metadata gather (distfuse/layers/_linear_compiled.py)
            return compiled_reduce_scatter_forward(self, x)
        y, fused_op = self._eager_forward(x)
        remember(self, reduce_scatter_signature(x), fused_op, y)  # the path a compiled call then takes
        return y

    def _eager_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """``(y, the fused op that ran or None)``.

        A local check that fails here (a non-tensor input included) does not raise on this
        worker alone: on the row's unfused, agreement-checked reduce-scatter it flags, on a
        fused path the fused op refuses it at its first claim; either way every worker of
        the row raises (``_linear_agreement.py``).  With one model-parallel worker it raises
        after the parameter broadcast or weight gather, which its data-parallel peers run too.
        """
        m = self.dm[1]

        def check():
            check_block_features(self._op, x, self.P_x, block_extent(self.in_features, self.P_m, m),
                                 f"block {m} of in_features={self.in_features} over {self.P_m} model-parallel workers")

        error = local_error(check)
        if error is not None:  # run what the peers run, with a tensor of the peers' sizes as far as known
            x = stand_in(self, x, (1,) * (self.P_x.dim - 1) + (block_extent(self.in_features, self.P_m, m),))
        zero = None
        if self._zero and self.P_d > 1:  # ZeRO: fused, the weight streams into the GEMM (fused/zero_linear.py)
            from distfuse.fused.zero_linear_dispatch import agreed_rows

            # One decision for the whole grid: the data-parallel workers hold different row counts.
            # Where the count is exchanged (CUDA, no forced path) the round spans the grid and carries this
            # worker's local check failure: every worker raises there.
            rows = agreed_rows(self.P_wgather, math.prod(x.shape[:-1]), x.device, P_all=self.P_x, error=error,
                               op=self._op)
            zero = self._zero_decision((rows, x.shape[-1]), x.dtype, x.device)
            if zero.path == "fused":
                if error is not None and self.P_m > 1:  # the plain model-parallel collective carries no refusal
                    raise error
                self._record(zero)
                # P_m = 1: the data-parallel workers' fused claim carries this worker's refusal.
                return fused_or_refuse(error, lambda: self._zero_fused(x)), "zero_linear"
        W, b = self._params()
        decision = self._decision(x.shape, x.dtype, x.device, zero)
        self._record(decision)
        if self.P_m == 1:  # one model-parallel worker: the partial sum is the output (reduce_scatter would copy it)
            if error is not None:  # after the parameters' collective, which the data-parallel peers run too
                raise error
            return F.linear(x, W, b), None
        if decision.path == "fused" and self.P_y is None:
            from distfuse.fused.matmul_reduce_scatter_features import matmul_reduce_scatter_features

            y = fused_or_refuse(error, lambda: matmul_reduce_scatter_features(x, W, b, self.P_scatter))
            return first_order_only(y, self._op, FUSED_FIRST_ORDER), "matmul_reduce_scatter_features"
        if decision.path == "fused":
            from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter

            y = fused_or_refuse(error, lambda: matmul_reduce_scatter(x, W, b, self.P_scatter, bias_grad="partial"))
            return first_order_only(y, self._op, FUSED_FIRST_ORDER), "matmul_reduce_scatter"
        y = agreed_matmul_reduce_scatter(self, x, W, error)  # inputs checked; no metadata while they repeat
        return (y + b.to(y.dtype) if b is not None else y), None  # under torch.autocast y (as torch's) is in its
        # dtype

    def _zero_fused(self, x: torch.Tensor) -> torch.Tensor:
        """ZeRO, fused: the shards stream into the GEMM, dW is reduce-scattered by its GEMM; the bias added after."""
        from distfuse.fused.zero_linear import zero_linear

        b = self._params(gather_weight=False)[1]
        y = zero_linear(x, self.weight, self.P_wgather, self.P_scatter, split="rows",
                        axis="features" if self.P_y is None else "sequence", out_features=self.out_features,
                        in_features=self.in_features)
        y = first_order_only(y, self._op, FUSED_FIRST_ORDER)
        return y + b.to(y.dtype) if b is not None else y

    # ------------------------------------------------------------------ dispatch

    def _decision(self, x_shape, dtype, device, zero: Decision | None = None) -> Decision:
        """ZeRO: the weight-streaming path where it is chosen; otherwise (and always without ZeRO) the form's.

        ``zero``: the ZeRO decision already taken (forward takes it on the rows agreed over the
        data-parallel workers, and must not take it again on its own rows).
        """
        if self._zero and self.P_d > 1:
            zero = zero if zero is not None else self._zero_decision(x_shape, dtype, device)
            if zero.path == "fused" or self.P_m == 1:  # P_m = 1: the form has no fused op; say why ZeRO's did not run
                return zero
        return self._form_decision(x_shape, dtype, device)

    def _zero_decision(self, x_shape, dtype, device) -> Decision:
        """ZeRO's weight all-gather inside the GEMM (fused/zero_linear.py); the GEMM of the weight-streaming op."""
        shapes = dict(m=math.prod(x_shape[:-1]), n=self.out_features, k=block_extent(self.in_features, self.P_m, 0))
        return decide(registry.ZERO_LINEAR_ROWS.name, self._op, shapes, dtype, self.P_d, device,
                      available=self._weight_gather_available)

    def _form_decision(self, x_shape, dtype, device) -> Decision:
        """The model-parallel form's fused op (the weight, if ZeRO, gathered unfused first)."""
        if self.P_m == 1:
            return not_servable(self._op, "one model-parallel worker: a plain local GEMM")
        # Without P_y the output's features are scattered (DistDL's form), with P_y its sequence dim.
        op = registry.MATMUL_REDUCE_SCATTER if self.P_y is not None else registry.MATMUL_REDUCE_SCATTER_FEATURES
        shapes = dict(m=math.prod(x_shape[:-1]), n=self.out_features, k=block_extent(self.in_features, self.P_m, 0))
        return decide(op.name, self._op, shapes, dtype, self.P_m, device, available=self._fused_available)

    def _fused_available(self) -> tuple[bool, str]:
        from distfuse.fused.matmul_common import fused_linear_available

        return fused_linear_available(self.P_scatter, self._param_device(), self._param_dtype())

    def _weight_gather_available(self) -> tuple[bool, str]:
        from distfuse.fused.zero_linear_dispatch import zero_linear_available

        return zero_linear_available(self.P_wgather, self.P_scatter if self.P_m > 1 else None, self._param_device(),
                                     self._param_dtype())

    def explain(self, x: torch.Tensor) -> Decision:
        """The path :meth:`forward` takes for ``x`` and why; local (no communication)."""
        if not self.P_x.active:
            return INACTIVE
        return self._decision(x.shape, x.dtype, x.device)

    def extra_repr(self) -> str:
        form = f", P_y={list(self.P_y.shape)}" if self.P_y is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"P_x={list(self.P_x.shape)}{form}")


class DistributedLinearReduceScatter(_LinearReduceScatter):
    """Linear layer with the weight split along the input features and the output reduce-scattered.

    Args:
        P_x: input partition ``[P_d, 1, ..., 1, P_m]`` (also the output's without ``P_y``).
        in_features, out_features: as in ``torch.nn.Linear``.
        bias: add a learnable bias (added exactly once; see the module docstring for where it lives).
        device, dtype: of the parameters (default: ``P_x``'s device, the default dtype).
        P_y: optional output partition ``[P_d, 1, ..., P_m, 1]`` on the same ranks as ``P_x``:
            the output is split along the sequence dim instead of the features.

    Construction is collective over the world (it creates partitions): every world rank
    constructs the layer, active or not.  ``W_m`` lives on workers ``(0, m)`` (``None``
    elsewhere) and is broadcast along ``d`` in forward.  With the same seed,
    :meth:`reset_parameters` gives the blocks of ``torch.nn.Linear``'s tensors.
    """


class DistributedLinearReduceScatterZero(_LinearReduceScatter):
    """:class:`DistributedLinearReduceScatter` with the weight also sharded over the data-parallel workers (ZeRO-3).

    Worker ``(d, m)`` owns block ``(d, m)`` of ``W`` (rows over ``P_d``, columns over
    ``P_m``); forward all-gathers ``W_m`` along ``d``, backward reduce-scatters its
    gradient so each worker keeps its own shard's (summed over ``d``).  The bias is
    kept and broadcast as in the plain layer.  Arguments as for
    :class:`DistributedLinearReduceScatter`.
    """

    _zero = True
