"""Column-parallel linear: all-gather the input over the model-parallel workers, then a local GEMM.

The weight ``W [out, in]`` is split along the output features over the ``P_m``
model-parallel workers; worker ``(d, m)`` of the grid (:mod:`~distfuse.layers._linear_common`)
computes output block ``m`` for its batch block ``d``.  Two input layouts (``b`` batch,
``n`` sequence, leading dimensions ``*`` may be any number, including none)::

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

Parameters (arrangements: :mod:`~distfuse.layers._linear_common`): ``W_m`` and ``b_m`` live on
worker ``(0, m)``.  :class:`DistributedLinearAllGatherZero` shards ``W`` along the input
features too: worker ``(d, m)`` owns block ``(m, d)`` of ``W`` on a ``[P_m, P_d]`` grid; its
bias (``out`` elements against ``out * in``) stays on ``(0, m)``.

The gathered length ``n`` is not known from one block (3 rows of a 2-way split come from 5
or 6), so the unfused path learns the blocks under the row's agreement; ``seq_len=n``
states it.

Dispatch: ``all_gather_features_matmul`` without P_x (the GEMM reads the K chunks as they
land) and ``all_gather_matmul`` with P_x, asked for with the per-rank GEMM ``m = rows of
x_gathered, n = out block, k = in``; ``out_features < P_m`` (an empty weight shard) runs
unfused.  The ZeRO layer with ``P_d > 1`` first asks for its own fused path
(:mod:`distfuse.fused.zero_linear`, ``zero_linear_columns`` over the ``P_d`` workers on their
largest row count; the bias added after); where it is not chosen, the form's decision follows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distfuse.errors import expect
from distfuse.fused import registry
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._conv_common import grid_of, subgrid
from distfuse.layers._linear_agreement import RowLinear, agreed_input_gather, compute_dtype
from distfuse.layers._linear_common import LinearParams, check_block_features
from distfuse.layers.dispatch import Decision
from distfuse.primitives._axes import balanced_layout

__all__ = ["DistributedLinearAllGather", "DistributedLinearAllGatherZero"]


class DistributedLinearAllGather(RowLinear):
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
    """

    _zero_entry = registry.ZERO_LINEAR_COLUMNS

    def __init__(self, P_y, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 P_x=None, keep_gathered: bool = True):
        super().__init__(P_y, P_x, ("P_y", "P_x"), in_features, out_features, bias, device, dtype)
        op = self._op
        self.P_y, self.P_x = P_y, P_x
        self.keep_gathered = bool(keep_gathered)  # memory against time: distfuse/fused/all_gather_matmul.py
        P_d, P_m, m = self.P_d, self.P_m, self.dm[1]
        out_m = block_extent(self.out_features, P_m, m) if P_y.active else 0
        self._in_extent = self.in_features if P_x is not None else block_extent(self.in_features, P_m, max(m, 0))

        self.P_in = P_in = P_x if P_x is not None else P_y
        self.P_gather = subgrid(P_in, [P_in.dim - (2 if P_x is not None else 1)])
        owners = [self._rank_of(0, j) for j in range(P_m)]
        self.P_bias = grid_of(owners, [P_m], P_y.device)  # (0, m) owns b_m
        if self._zero:
            # Worker (d, m) owns block (m, d) of W: rows split over P_m, columns over P_d.
            self.P_weight = grid_of([self._rank_of(i, j) for j in range(P_m) for i in range(P_d)],
                                           [P_m, P_d], P_y.device)
            self.P_wgather = subgrid(self.P_weight, [1])
        else:
            self.P_weight = grid_of(owners, [P_m, 1], P_y.device)
        # The bias (and the weight, without ZeRO) travel from (0, m) in one message.
        w_m = (out_m, self.in_features)
        blocks = ({} if self._zero else {"weight": w_m}) | ({"bias": (out_m,)} if self.use_bias else {})
        self.params = LinearParams(op, self.P_users, [(self.P_bias, blocks)],
                                   (self.P_wgather, w_m) if self._zero else None)
        self._register_params()
        # Without P_x the input's features are gathered (DistDL's form), with P_x its sequence dim.
        form = registry.ALL_GATHER_MATMUL if P_x is not None else registry.ALL_GATHER_FEATURES_MATMUL
        self._setup_row(self.P_gather, form, "columns", P_x is not None)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``y = all_gather(x) @ W_m.T + b_m`` on this worker; ``seq_len`` (P_x form only) skips the shape exchange."""
        return self._forward(x, seq_len)

    def _check_input(self, x: torch.Tensor, seq_len: int | None) -> None:
        op, m = self._op, self.dm[1]
        if self.P_x is None and seq_len is not None:
            raise expect(op, "seq_len (it gives the gathered sequence length of the P_x form)", "None without P_x",
                         seq_len)
        if self.P_x is None:
            check_block_features(op, x, self.P_y, self._in_extent,
                                 f"block {m} of in_features={self.in_features} over {self.P_m} model-parallel "
                                 "workers")
            return
        check_block_features(op, x, self.P_x, self.in_features, "all of in_features: P_x splits the sequence dim")
        if seq_len is not None and x.shape[-2] != block_extent(int(seq_len), self.P_m, m):
            raise expect(op, f"sequence extent (block {m} of seq_len={seq_len} over {self.P_m} workers; input "
                             f"shape {tuple(x.shape)})", block_extent(int(seq_len), self.P_m, m), x.shape[-2])

    def _signature(self, x: torch.Tensor, seq_len: int | None) -> tuple:
        return (tuple(x.shape), x.dtype, x.device.type, compute_dtype(x), seq_len)

    def _seq_len(self, x: torch.Tensor, seq_len: int | None, error) -> int:
        """The gathered sequence length: ``seq_len``, else the agreed one (learnt by a gather on a first call; a
        step old after a change on some worker, which only the dispatch reads: every worker reads the same)."""
        if seq_len is not None:
            return int(seq_len)
        if self.P_m == 1:
            return x.shape[-2]
        if self.agreement.fresh:
            agreed_input_gather(self, x, None, error)
        return self.agreement.state[0].shape[-2]

    def _rows(self, x: torch.Tensor, seq_len: int | None, error) -> int:
        if self.P_x is None:
            return math.prod(x.shape[:-1])
        return math.prod(x.shape[:-2]) * self._seq_len(x, seq_len, error)

    def _gemm(self, rows: int) -> dict:
        return dict(m=rows, n=block_extent(self.out_features, self.P_m, 0), k=self.in_features)

    def _unservable(self) -> str | None:
        if self.out_features < self.P_m:
            return (f"out_features={self.out_features} < {self.P_m} model-parallel workers leaves a worker an "
                    "empty weight shard")
        return None

    def _exact_n(self, x: torch.Tensor, seq_len: int | None) -> int:
        if self.P_x is None:
            return -1
        from distfuse.fused.zero_linear_dispatch import sequence_extent

        return int(seq_len) if seq_len is not None else sequence_extent(self.P_gather, x.shape[-2])

    def _fused_state(self, x: torch.Tensor, n: int) -> tuple:
        gathered = (*x.shape[:-1], self.in_features) if self.P_x is None else (*x.shape[:-2], n, self.in_features)
        return balanced_layout(self.P_gather, gathered), x.dtype

    def _state_n(self, state) -> int:
        return state[0].shape[-2] if self.P_x is not None else -1

    def _unfused(self, x, W, b, signature, seq_len, error) -> torch.Tensor:
        return F.linear(agreed_input_gather(self, x, seq_len, error), W, b)

    def explain(self, x: torch.Tensor, seq_len: int | None = None) -> Decision:
        """The path :meth:`forward` takes for ``x`` and why; local (no communication).

        In the P_x form without ``seq_len`` the gathered length is estimated as
        ``n_m * P_m`` (exact for even splits); ``forward`` uses the exact length.
        """
        if self.P_x is None:
            return self._explain(math.prod(x.shape[:-1]), x)
        n = int(seq_len) if seq_len is not None else x.shape[-2] * self.P_m
        return self._explain(math.prod(x.shape[:-2]) * n, x)


class DistributedLinearAllGatherZero(DistributedLinearAllGather):
    """:class:`DistributedLinearAllGather` with the weight also sharded over the data-parallel workers (ZeRO-3).

    Worker ``(d, m)`` owns block ``(m, d)`` of ``W`` (see the module doc).  Arguments as for
    :class:`DistributedLinearAllGather`.
    """

    _zero = True
