"""Row-parallel linear: a local GEMM on the input-feature block, then a reduce-scatter over the model-parallel workers.

The weight ``W [out, in]`` is split along the input features over the ``P_m``
model-parallel workers of the grid (:mod:`~distfuse.layers._linear_common`); each
worker's GEMM yields a full-size partial sum, which the reduce-scatter adds up and splits
(``b`` batch, ``n`` sequence, ``*`` any number of leading dimensions, including none)::

    x          P_x [P_d, 1, ..., P_m]     x [b_d, *, n, in_m]
    weight     W_m [out, in_m]
    partial    p  = x @ W_m.T                                         p [b_d, *, n, out]
    P_x only:  y  = reduce_scatter(p) along the last dim + b_m        y [b_d, *, n, out_m]  on P_x
    with P_y:  y  = reduce_scatter(p) along dim -2 + b                y [b_d, *, n_m, out]  on P_y [P_d, 1, ..., P_m, 1]
                                                                      (the fused GEMM+RS form)
    adjoint    dp = all_gather(dy) (the reduce-scatter's adjoint); dx = dp @ W_m; dW_m = sum over d of dp.T @ x

``in_m``/``out_m``/``n_m``/``b_d`` are blocks of the balanced decomposition (uneven and
possibly empty).

Bias, added exactly once per output element:

* P_x only: ``b`` is split like the output features; worker ``(0, m)`` owns ``b_m``, and
  every ``(d, m)`` adds it after the reduce-scatter, to its own output block (the
  reference's placement; the add is spread over all workers).
* With P_y: every worker's output block has all ``out`` features, so a block of ``b``
  would not do.  Worker ``(0, 0)`` owns the whole ``b`` and every worker gets a copy, which
  it adds to its own output rows after the reduce-scatter (unfused) or in the chunk reduce
  (fused); the Broadcast's adjoint sums the partial gradients back on ``(0, 0)``.

Parameters (arrangements: :mod:`~distfuse.layers._linear_common`): ``W_m`` lives on worker
``(0, m)``.  :class:`DistributedLinearReduceScatterZero` shards ``W`` along the output
features too: worker ``(d, m)`` owns block ``(d, m)`` on a ``[P_d, P_m]`` grid.

Dispatch: ``matmul_reduce_scatter_features`` without P_y (the fused op adds ``b_m`` in its
reduction) and ``matmul_reduce_scatter`` with P_y, asked for with the per-rank GEMM ``m =
rows of x, n = out, k = in block``.  The ZeRO layer with ``P_d > 1`` first asks for its own
fused path (``zero_linear_rows``, as for the all-gather linear); where it is not chosen, the
form's decision follows (the weight all-gathered first).  Under ``torch.autocast`` the
output is in the autocast dtype, as ``torch.nn.Linear``'s.
"""

from __future__ import annotations

import math

import torch

from distfuse.fused import registry
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._conv_common import grid_of, subgrid
from distfuse.layers._linear_agreement import RowLinear, agreed_matmul_reduce_scatter, compute_dtype
from distfuse.layers._linear_common import LinearParams, check_block_features
from distfuse.layers.dispatch import Decision

__all__ = ["DistributedLinearReduceScatter", "DistributedLinearReduceScatterZero"]


class DistributedLinearReduceScatter(RowLinear):
    """Linear layer with the weight split along the input features and the output reduce-scattered.

    Args:
        P_x: input partition ``[P_d, 1, ..., 1, P_m]`` (also the output's without ``P_y``).
        in_features, out_features: as in ``torch.nn.Linear``.
        bias: add a learnable bias (added exactly once; see the module docstring for where it lives).
        device, dtype: of the parameters (default: ``P_x``'s device, the default dtype).
        P_y: optional output partition ``[P_d, 1, ..., P_m, 1]`` on the same ranks as ``P_x``:
            the output is split along the sequence dim instead of the features.
    """

    _zero_entry = registry.ZERO_LINEAR_ROWS

    def __init__(self, P_x, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 P_y=None):
        super().__init__(P_x, P_y, ("P_x", "P_y"), in_features, out_features, bias, device, dtype)
        op = self._op
        self.P_x, self.P_y = P_x, P_y
        P_m, m = self.P_m, self.dm[1]
        out, dev = self.out_features, P_x.device
        in_m = block_extent(self.in_features, P_m, m) if P_x.active else 0
        out_m = block_extent(out, P_m, m) if P_x.active else 0
        self.P_in, self._in_extent = P_x, in_m

        self.P_scatter = subgrid(P_x, [P_x.dim - 1]) if P_y is None else subgrid(P_y, [P_y.dim - 2])
        owners = [self._rank_of(0, j) for j in range(P_m)]
        P_owners = grid_of(owners, [P_m], dev)
        weight = {} if self._zero else {"weight": (out, in_m)}
        bias = {"bias": (out_m,) if P_y is None else (out,)} if self.use_bias else {}
        if P_y is None:  # (0, m) owns b_m and sends it with W_m (one message)
            self.P_bias = P_owners
            blocks = [(P_owners, weight | bias)]
        else:  # (0, 0) owns all of b and every worker gets a copy (module doc)
            self.P_bias = grid_of([self._rank_of(0, 0)], [1], dev)
            blocks = [(P_owners, weight), (self.P_bias, bias)]
        if self._zero:
            # Worker (d, m) owns block (d, m) of W: rows split over P_d, columns over P_m.
            self.P_weight = self.P_users
            self.P_wgather = subgrid(self.P_weight, [0])
        else:
            self.P_weight = grid_of(owners, [1, P_m], dev)
        self.params = LinearParams(op, self.P_users, blocks, (self.P_wgather, (out, in_m)) if self._zero else None)
        self._register_params()
        # Without P_y the output's features are scattered (DistDL's form), with P_y its sequence dim.
        form = registry.MATMUL_REDUCE_SCATTER if P_y is not None else registry.MATMUL_REDUCE_SCATTER_FEATURES
        self._setup_row(self.P_scatter, form, "rows", P_y is not None)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y = reduce_scatter(x @ W_m.T) + bias`` on this worker (see the module docstring for the split)."""
        return self._forward(x, None)

    def _check_input(self, x: torch.Tensor, seq_len: None) -> None:
        m = self.dm[1]
        check_block_features(self._op, x, self.P_x, self._in_extent,
                             f"block {m} of in_features={self.in_features} over {self.P_m} model-parallel workers")

    def _signature(self, x: torch.Tensor, seq_len: None) -> tuple:
        return (tuple(x.shape), x.dtype, compute_dtype(x), x.device.type)

    def _rows(self, x: torch.Tensor, seq_len: None, error) -> int:
        return math.prod(x.shape[:-1])

    def _gemm(self, rows: int) -> dict:
        return dict(m=rows, n=self.out_features, k=block_extent(self.in_features, self.P_m, 0))

    def _fused_state(self, x: torch.Tensor, n: int) -> tuple:
        return (*x.shape[:-1], self.out_features), compute_dtype(x)

    def _unfused(self, x, W, b, signature, seq_len, error) -> torch.Tensor:
        y = agreed_matmul_reduce_scatter(self, x, W, signature, error)
        return y + b.to(y.dtype) if b is not None else y  # under torch.autocast y (as torch's) is in its dtype

    def explain(self, x: torch.Tensor) -> Decision:
        """The path :meth:`forward` takes for ``x`` and why; local (no communication)."""
        return self._explain(math.prod(x.shape[:-1]), x)


class DistributedLinearReduceScatterZero(DistributedLinearReduceScatter):
    """:class:`DistributedLinearReduceScatter` with the weight also sharded over the data-parallel workers (ZeRO-3).

    Worker ``(d, m)`` owns block ``(d, m)`` of ``W`` (see the module doc).  Arguments as for
    :class:`DistributedLinearReduceScatter`.
    """

    _zero = True
