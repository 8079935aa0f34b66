"""Column-parallel linear: all-gather the input over the model-parallel workers, then a local GEMM.

The weight ``W [out, in]`` is split along the output features over the ``P_m``
model-parallel workers; worker ``(d, m)`` computes output block ``m`` for its batch
block ``d``.  Two input layouts (``b`` batch, ``n`` sequence, leading dimensions ``*``
may be any number, including none)::

    P_y only:  P_y [P_d, 1, ..., P_m]      x [b_d, *, n, in_m] --all-gather last dim--> [b_d, *, n, in]
    with P_x:  P_x [P_d, 1, ..., P_m, 1]   x [b_d, *, n_m, in] --all-gather dim -2---> [b_d, *, n, in]
                                           (sequence parallel: the fused AG+GEMM form)
    weight     W_m [out_m, in]   bias b_m [out_m]
    forward    y  = x_gathered @ W_m.T + b_m             y [b_d, *, n, out_m] on P_y
    adjoint    dx = reduce_scatter(dy @ W_m)             back to x's block (the all-gather's adjoint)
               dW_m = sum over d of dy.T @ x_gathered    db_m = sum over d and rows of dy

``in_m``/``out_m``/``n_m``/``b_d`` are blocks of the balanced decomposition (uneven
and possibly empty).  Each output element gets its bias once: the output blocks are
disjoint.

Parameters.  :class:`DistributedLinearAllGather` keeps ``W_m`` and ``b_m`` on worker
``(0, m)`` and broadcasts them along ``d`` in forward, one packed message (the adjoint
sum-reduces the gradients onto ``(0, m)``; DistDL's data parallelism).
:class:`DistributedLinearAllGatherZero` (ZeRO-3) also splits ``W`` along the input
features over the data-parallel workers: worker ``(d, m)`` owns block ``(m, d)`` of
``W`` on a ``[P_m, P_d]`` grid, all-gathers ``W_m`` along ``d`` in forward, and the
adjoint reduce-scatters ``dW_m`` so every worker keeps its own shard's gradient.  The
bias (``out`` elements, against ``out * in`` for ``W``) stays on ``(0, m)`` and is
broadcast as in the plain layer: sharding it too would need a second decomposition
of ``out`` for little memory.

Agreement of the inputs: the gathered length ``n`` is not known from one block (3 rows
of a 2-way split come from 5 or 6), and workers whose rows or dtypes disagree would
abort the all-gather or gather garbage.  The unfused path learns the blocks and checks
them on the first call and whenever some worker's input signature changed, and carries
only a flag element while they repeat (``_linear_agreement.py``); a disagreement raises
the same ShapeError on every worker of the row.  ``seq_len=n`` states the length.

Dispatch: both forms have a fused all-gather + GEMM, ``all_gather_features_matmul``
without P_x (the input's features gathered; the GEMM reads the K chunks as they land, in
a fixed order) and ``all_gather_matmul`` with P_x (the sequence dim gathered); the layer
asks :func:`~distfuse.layers.dispatch.select_path` with the per-rank GEMM
``m = rows of x_gathered, n = out block, k = in`` and records the decision in
``last_path`` / ``last_decision``.  ``out_features < P_m`` (an empty weight shard) runs
unfused.  The ZeRO layer with ``P_d > 1`` first asks for its own fused path
(:mod:`distfuse.fused.zero_linear`, registry entry ``zero_linear_columns`` over the
``P_d`` workers on their largest row count): the input is all-gathered over the
model-parallel workers as a plain collective, the shards stream into the GEMM along K,
and the backward fuses the dgrad GEMM with its reduce-scatter over ``m`` and the ``dW_m``
GEMM with its reduce-scatter over ``d``; the bias is added after (empty weight shards
included).  Where that path is not chosen, the form's own decision follows.
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
    agreed_input_gather,
    agreed_seq_len,
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
from distfuse.layers._linear_compiled import all_gather_signature, compiled_all_gather_forward, remember
from distfuse.layers._linear_records import local_error
from distfuse.layers._params import ParamLayout
from distfuse.layers.dispatch import Decision
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives.all_gather import all_gather

__all__ = ["DistributedLinearAllGather", "DistributedLinearAllGatherZero"]


def _looks_swapped(P_y, P_x) -> bool:
    """P_y shaped like a sequence split and P_x like a feature split (the other way round from what is needed)."""
    sy, sx = list(getattr(P_y, "shape", ())), list(getattr(P_x, "shape", ()))
    return (len(sy) == len(sx) >= 3 and sy[-1] == 1 and all(s == 1 for s in sy[1:-2] + sx[1:-1])
            and sy[0] == sx[0] and sy[-2] == sx[-1])


def _check_partitions(op: str, P_y, P_x) -> None:
    check_cartesian(op, "P_y", P_y, min_dim=2)
    if any(s != 1 for s in P_y.shape[1:-1]):
        want = [P_y.shape[0]] + [1] * (P_y.dim - 2) + [P_y.shape[-1]]
        err = expect(op, "shape of P_y ([P_d, 1, ..., 1, P_m]: only the first and last dimensions split)", want,
                     list(P_y.shape), cls=PartitionError)
        if P_x is not None and _looks_swapped(P_y, P_x):
            err = PartitionError(f"{err}; P_y and P_x look swapped: the first argument is the output partition "
                                 "[P_d, 1, ..., P_m] and P_x the sequence-split input partition [P_d, 1, ..., P_m, 1]")
        raise err
    if P_x is None:
        return
    check_cartesian(op, "P_x", P_x, min_dim=3)
    want = [P_y.shape[0]] + [1] * (P_y.dim - 3) + [P_y.shape[-1], 1]
    if list(P_x.shape) != want:
        raise expect(op, f"shape of P_x ([P_d, 1, ..., P_m, 1] for P_y {list(P_y.shape)}: P_x splits the sequence "
                         "dim where P_y splits the features)", want, list(P_x.shape), cls=PartitionError)
    check_same_ranks(op, P_x, "P_x", P_y, "P_y")


class _LinearAllGather(LinearBase):
    """The all-gather linear; ``_zero`` selects how the weight reaches the workers (see the module doc)."""

    _zero = False

    def __init__(self, P_y, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 P_x=None, keep_gathered: bool = True):
        op = type(self).__name__
        _check_partitions(op, P_y, P_x)
        super().__init__(in_features, out_features, device if device is not None else P_y.device, dtype)
        self.P_y, self.P_x, self.use_bias = P_y, P_x, bool(bias)
        # Fused path: keep the gathered input from forward for the weight gradient (memory), or gather it again
        # in backward (time); see distfuse/fused/all_gather_matmul.py.
        self.keep_gathered = bool(keep_gathered)
        P_d, P_m = P_y.shape[0], P_y.shape[-1]
        self.P_d, self.P_m = P_d, P_m
        rank_of = lambda d, m: P_y.ranks[d * P_m + m]  # worker (d, m); middle extents are 1
        self.dm = divmod(P_y.rank, P_m) if P_y.active else (-1, -1)
        m = self.dm[1]
        out_m = block_extent(self.out_features, P_m, m) if P_y.active else 0

        # Partition creation is collective over the world: every rank runs these calls in this order.
        P_in = P_x if P_x is not None else P_y
        self.P_gather = subgrid(P_in, [P_in.dim - (2 if P_x is not None else 1)])
        owners = [rank_of(0, j) for j in range(P_m)]
        self.P_bias = grid_partition(owners, [P_m], P_y.device)  # (0, m) owns b_m
        P_users = P_y if P_y.dim == 2 else grid_partition(P_y.ranks, [P_d, P_m], P_y.device)
        if self._zero:
            # Worker (d, m) owns block (m, d) of W: rows split over P_m, columns over P_d.
            self.P_weight = grid_partition([rank_of(i, j) for j in range(P_m) for i in range(P_d)], [P_m, P_d],
                                           P_y.device)
            self.P_wgather = subgrid(self.P_weight, [1])
            self._bcast = ParamBroadcast(self.P_bias, P_users, [(out_m,)] if self.use_bias else [])
        else:
            self.P_weight = grid_partition(owners, [P_m, 1], P_y.device)
            shapes = [(out_m, self.in_features)] + ([(out_m,)] if self.use_bias else [])
            self._bcast = ParamBroadcast(self.P_bias, P_users, shapes)
        self._block("weight", self.P_weight, (self.out_features, self.in_features))
        if self.use_bias:
            self._block("bias", self.P_bias, (self.out_features,))
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
        """``W_m`` (and ``b_m``) on this worker: broadcast from (0, m), or all-gathered shards for ZeRO.

        ``gather_weight=False`` (ZeRO with the weight all-gather fused into the GEMM): W is None.
        """
        dtype, device = self._param_dtype(), self._param_device()
        if self._zero:
            out_m = block_extent(self.out_features, self.P_m, self.dm[1])
            if not gather_weight:
                W = None
            elif self.P_d == 1:  # one data-parallel worker: its shard is all of W_m (all_gather would copy it)
                W = self.weight
            else:
                W = all_gather(self.weight, self.P_wgather, (out_m, self.in_features))
            bias = self._bcast([self.bias] if self._bcast.is_src else [], dtype, device) if self.use_bias else []
            return W, (bias[0] if self.use_bias else None)
        mine = ([self.weight] + ([self.bias] if self.use_bias else [])) if self._bcast.is_src else []
        got = self._bcast(mine, dtype, device)
        return got[0], (got[1] if self.use_bias else None)

    def _check_input(self, x: torch.Tensor, seq_len: int | None) -> None:
        op, m = self._op, self.dm[1]
        if self.P_x is None and seq_len is not None:
            raise expect(op, "seq_len (it gives the gathered sequence length of the P_x form)", "None without P_x",
                         seq_len)
        if self.P_x is None:
            check_block_features(op, x, self.P_y, block_extent(self.in_features, self.P_m, m),
                                 f"block {m} of in_features={self.in_features} over {self.P_m} model-parallel "
                                 "workers")
            return
        check_block_features(op, x, self.P_x, self.in_features, "all of in_features: P_x splits the sequence dim")
        if seq_len is not None and x.shape[-2] != block_extent(int(seq_len), self.P_m, m):
            raise expect(op, f"sequence extent (block {m} of seq_len={seq_len} over {self.P_m} workers; input "
                             f"shape {tuple(x.shape)})", block_extent(int(seq_len), self.P_m, m), x.shape[-2])

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``y = all_gather(x) @ W_m.T + b_m`` on this worker; ``seq_len`` (P_x form only) skips the shape exchange."""
        P_in = self.P_x if self.P_x is not None else self.P_y
        if not P_in.active:
            check_inactive_input(self._op, x)
            self._record_inactive()
            return x.clone()
        if torch.compiler.is_compiling():  # custom ops, no metadata gather (distfuse/layers/_linear_compiled.py)
            return compiled_all_gather_forward(self, x, seq_len)
        y, fused_op = self._eager_forward(x, seq_len)
        remember(self, all_gather_signature(x, seq_len), fused_op, y)  # the path a compiled call then takes
        return y

    def _eager_forward(self, x: torch.Tensor, seq_len: int | None) -> tuple[torch.Tensor, str | None]:
        """``(y, the fused op that ran or None)``.

        A local check that fails here (a non-tensor input included) does not raise on this
        worker alone: on the row's unfused, agreement-checked gather it flags, on a fused
        path the fused op refuses it at its first claim; either way every worker of the row
        raises (``_linear_agreement.py``).  With one model-parallel worker it raises after
        the parameter broadcast or weight gather, which its data-parallel peers run too.
        """
        error = local_error(lambda: self._check_input(x, seq_len))
        if error is not None:  # run what the peers run, with a tensor of the peers' sizes as far as known
            P_in = self.P_x if self.P_x is not None else self.P_y
            x = stand_in(self, x, (1,) * (P_in.dim - 1) + (
                block_extent(self.in_features, self.P_m, self.dm[1]) if self.P_x is None else self.in_features,))
        zero = None
        if self._zero and self.P_d > 1:  # ZeRO: fused, the weight streams into the GEMM (fused/zero_linear.py)
            from distfuse.fused.zero_linear_dispatch import agreed_rows

            # One decision for the whole grid: the data-parallel workers hold different row counts.
            rows = math.prod(x.shape[:-1])
            if self.P_x is not None:
                n = seq_len if seq_len is not None else agreed_seq_len(self, x, error) if self.P_m > 1 else x.shape[-2]
                rows = math.prod(x.shape[:-2]) * int(n)
            # Where the count is exchanged (CUDA, no forced path) the round spans the grid and carries this
            # worker's local check failure: every worker raises there.
            rows = agreed_rows(self.P_wgather, rows, x.device, P_all=self.P_y, error=error, op=self._op)
            zero = self._zero_decision((rows, self.in_features), x.dtype, x.device)
            if zero.path == "fused":
                if error is not None and self.P_m > 1:  # the plain model-parallel collective carries no refusal
                    raise error
                self._record(zero)
                # P_m = 1: the data-parallel workers' fused claim carries this worker's refusal.
                return fused_or_refuse(error, lambda: self._zero_fused(x, seq_len)), "zero_linear"
        W, b = self._params()
        if self.P_x is None:
            out_shape = (*x.shape[:-1], self.in_features)
        else:
            n = seq_len if seq_len is not None else agreed_seq_len(self, x, error) if self.P_m > 1 else x.shape[-2]
            out_shape = (*x.shape[:-2], int(n), self.in_features)
        decision = self._decision(out_shape, x.dtype, x.device, zero)
        self._record(decision)
        if self.P_m == 1:  # one model-parallel worker: nothing to gather (all_gather would return a copy of x)
            if error is not None:  # after the parameters' collective, which the data-parallel peers run too
                raise error
            return F.linear(x, W, b), None
        if decision.path == "fused" and self.P_x is None:
            from distfuse.fused.all_gather_features_matmul import all_gather_features_matmul

            y = fused_or_refuse(error, lambda: all_gather_features_matmul(x, W, b, self.P_gather,
                                                                          keep_gathered=self.keep_gathered))
            return first_order_only(y, self._op, FUSED_FIRST_ORDER), "all_gather_features_matmul"
        if decision.path == "fused":
            from distfuse.fused.all_gather_matmul import all_gather_matmul

            # n=None (seq_len not given): the fused op sums the blocks' lengths itself, exactly, every call.
            y = fused_or_refuse(error, lambda: all_gather_matmul(x, W, b, self.P_gather,
                                                                 keep_gathered=self.keep_gathered, n=seq_len))
            return first_order_only(y, self._op, FUSED_FIRST_ORDER), "all_gather_matmul"
        return F.linear(agreed_input_gather(self, x, seq_len, error), W, b), None  # blocks checked, no metadata
        # while they repeat

    def _zero_fused(self, x: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        """ZeRO, fused: the shards stream into the GEMM, dW is reduce-scattered by its GEMM; the bias added after."""
        from distfuse.fused.zero_linear import zero_linear
        from distfuse.fused.zero_linear_dispatch import sequence_extent

        n = None
        if self.P_x is not None:  # the exact gathered length: an agreed one may be a step old
            n = seq_len if seq_len is not None else sequence_extent(self.P_gather, x.shape[-2])
        b = self._params(gather_weight=False)[1]
        y = zero_linear(x, self.weight, self.P_wgather, self.P_gather, split="columns",
                        axis="features" if self.P_x is None else "sequence", out_features=self.out_features,
                        in_features=self.in_features, n=n, keep_gathered=self.keep_gathered)
        y = first_order_only(y, self._op, FUSED_FIRST_ORDER)
        return y + b.to(y.dtype) if b is not None else y

    # ------------------------------------------------------------------ dispatch

    def _decision(self, gathered_shape, dtype, device, zero: Decision | None = None) -> Decision:
        """ZeRO: the weight-streaming path where it is chosen; otherwise (and always without ZeRO) the form's.

        ``zero``: the ZeRO decision already taken (forward takes it on the rows agreed over the
        data-parallel workers, and must not take it again on its own rows).
        """
        if self._zero and self.P_d > 1:
            zero = zero if zero is not None else self._zero_decision(gathered_shape, dtype, device)
            if zero.path == "fused" or self.P_m == 1:  # P_m = 1: the form has no fused op; say why ZeRO's did not run
                return zero
        return self._form_decision(gathered_shape, dtype, device)

    def _zero_decision(self, gathered_shape, dtype, device) -> Decision:
        """ZeRO's weight all-gather inside the GEMM (fused/zero_linear.py); the GEMM of the weight-streaming op."""
        shapes = dict(m=math.prod(gathered_shape[:-1]), n=block_extent(self.out_features, self.P_m, 0),
                      k=self.in_features)
        return decide(registry.ZERO_LINEAR_COLUMNS.name, self._op, shapes, dtype, self.P_d, device,
                      available=self._weight_gather_available)

    def _form_decision(self, gathered_shape, dtype, device) -> Decision:
        """The model-parallel form's fused op (the weight, if ZeRO, gathered unfused first)."""
        if self.P_m == 1:
            return not_servable(self._op, "one model-parallel worker: a plain local GEMM")
        if self.out_features < self.P_m:
            return not_servable(self._op, f"out_features={self.out_features} < {self.P_m} model-parallel workers "
                                          "leaves a worker an empty weight shard")
        shapes = dict(m=math.prod(gathered_shape[:-1]), n=block_extent(self.out_features, self.P_m, 0),
                      k=self.in_features)
        # Without P_x the input's features are gathered (DistDL's form), with P_x its sequence dim.
        op = registry.ALL_GATHER_MATMUL if self.P_x is not None else registry.ALL_GATHER_FEATURES_MATMUL
        return decide(op.name, self._op, shapes, dtype, self.P_m, device, available=self._fused_available)

    def _fused_available(self) -> tuple[bool, str]:
        from distfuse.fused.matmul_common import fused_linear_available

        return fused_linear_available(self.P_gather, self._param_device(), self._param_dtype())

    def _weight_gather_available(self) -> tuple[bool, str]:
        from distfuse.fused.zero_linear_dispatch import zero_linear_available

        return zero_linear_available(self.P_wgather, self.P_gather if self.P_m > 1 else None, self._param_device(),
                                     self._param_dtype())

    def explain(self, x: torch.Tensor, seq_len: int | None = None) -> Decision:
        """The path :meth:`forward` takes for ``x`` and why; local (no communication).

        In the P_x form without ``seq_len`` the gathered length is estimated as
        ``n_m * P_m`` (exact for even splits); ``forward`` uses the exact length.
        """
        P_in = self.P_x if self.P_x is not None else self.P_y
        if not P_in.active:
            return INACTIVE
        if self.P_x is None:
            return self._decision(x.shape, x.dtype, x.device)
        n = int(seq_len) if seq_len is not None else x.shape[-2] * self.P_m
        return self._decision((*x.shape[:-2], n, self.in_features), x.dtype, x.device)

    def extra_repr(self) -> str:
        form = f"P_x={list(self.P_x.shape)}, " if self.P_x is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"{form}P_y={list(self.P_y.shape)}")


class DistributedLinearAllGather(_LinearAllGather):
    """Linear layer with the weight split along the output features and the input all-gathered.

    Args:
        P_y: output partition ``[P_d, 1, ..., 1, P_m]`` (also the input's without ``P_x``).
        in_features, out_features: as in ``torch.nn.Linear``.
        bias: add a learnable bias.
        device, dtype: of the parameters (default: ``P_y``'s device, the default dtype).
        P_x: optional input partition ``[P_d, 1, ..., P_m, 1]`` on the same ranks as ``P_y``:
            the input is split along the sequence dim and gathered along it.
        keep_gathered: on the fused path, keep the gathered input for the weight gradient
            (default) instead of gathering it again in backward.

    Construction is collective over the world (it creates partitions): every world rank
    constructs the layer, active or not.  Weights ``W_m``/``b_m`` live on workers
    ``(0, m)`` (``None`` elsewhere) and are broadcast along ``d`` in forward.  With the
    same seed, :meth:`reset_parameters` gives the blocks of ``torch.nn.Linear``'s tensors.
    See the module docstring for shapes, the adjoint and the costs.
    """


class DistributedLinearAllGatherZero(_LinearAllGather):
    """:class:`DistributedLinearAllGather` with the weight also sharded over the data-parallel workers (ZeRO-3).

    Worker ``(d, m)`` owns block ``(m, d)`` of ``W`` (rows over ``P_m``, columns over
    ``P_d``); forward all-gathers ``W_m`` along ``d``, backward reduce-scatters its
    gradient so each worker keeps its own shard's (summed over ``d``).  The bias is
    kept and broadcast as in the plain layer.  Arguments as for
    :class:`DistributedLinearAllGather`.
    """

    _zero = True
