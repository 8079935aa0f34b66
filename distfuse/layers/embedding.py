"""Vocabulary-parallel embedding: the rows of the table split over the last axis of ``P_x``, one sum to combine.

Partitions and shapes (``P_x = [P_1, ..., P_k, P_v]``; the ids may be split over the leading
axes like any layer's input, and every worker of one vocabulary row holds the same ids)::

    weight   [V_v, D]       rows [start_v, start_v + V_v) of the global [V, D] table (the balanced block of V over
                            P_v), replicated over the leading axes
    ids      [*S_b]         int64 or int32 global token ids: the balanced block of the global [*S] over
                            [P_1, ..., P_k], the same on every worker of the vocabulary axis
    output   [*S_b, D]      torch.nn.Embedding's rows for the ids, replicated over the vocabulary axis

    forward  p = where(start_v <= ids < start_v + V_v, weight[ids - start_v], 0)     local, [*S_b, D]
             y = sum of p over the vocabulary axis        (``distfuse::replicate_adjoint``: one all-reduce)
    sequence_parallel=True:
             y = reduce_scatter of p over the vocabulary axis along the last ids dimension: [..., S_bv, D],
                 worker v's balanced block of its rows (Megatron's sequence-parallel layout, what a
                 ``sequence_parallel`` attention or the sequence-parallel linears take); adjoint: the all-gather
                 of dy's rows, so every vocabulary worker sees the whole dy of its ids
    adjoint  dp = dy          (y is replicated: every worker seeds the gradient of the one global output)
             dweight[r] = sum of dp over the ids equal to start_v + r     (torch's embedding backward, local)
             dweight summed over the leading axes        (``distfuse::replicate``'s adjoint: the copies of a
                                                           block each get the global gradient)

Each id lies in exactly one block, so the sum adds one row to zeros: the output is torch's
bits in every dtype.  ``padding_idx`` behaves as torch's; only its owner passes it to the
local lookup.  Where the leading axes have more than one worker and the weight takes a
gradient, ``distfuse::replicate`` copies the ``[V_v, D]`` block once per forward.

Checks.  Every worker's weight must take a gradient or none.  The ids are checked in every
call by ``distfuse::embedding_check``: one all-reduce over ``P_x`` of ``2 x |P_x|`` int64, a
linear hash of each worker's ids (odd multipliers: one differing position always changes
it) and its count of ids outside ``[0, V)``; every worker raises the same
:class:`~distfuse.errors.ShapeError` naming the offending world ranks.  It spans ``P_x``, not
only the vocabulary axis, because the backward's sum over the leading axes would otherwise
wait for a worker that raised.  On a device the counts are not read: the output is NaN.

Not supported (``UnsupportedError``): ``max_norm`` (torch renormalises the looked-up rows in
place, and the local lookup touches placeholder rows), ``scale_grad_by_freq`` (needs global
counts), ``sparse`` gradients.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import block_extent, block_start
from distfuse.layers._conv_common import AgreedLayer, check_cartesian, grid_of
from distfuse.layers._norm_common import FLOATS, CallRecord, gather_call, global_shape_of, one_dtype, subgrid
from distfuse.layers._params import BlockIdentityMixin, ParamLayout
from distfuse.partition import zero_volume_tensor
from distfuse.primitives._axes import all_reduce_sum
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._handles import lookup
from distfuse.primitives._op_pair import op_entry
from distfuse.primitives.all_sum_reduce import SubGridSum, replicate, replicated_sum
from distfuse.primitives.reduce_scatter import reduce_scatter

__all__ = ["DistributedEmbedding", "check_vocab_partition"]

_IDS = (torch.int64, torch.int32)
#: The golden-ratio multiplier 0x9E3779B97F4A7C15 as a signed int64 (products wrap modulo 2^64).
_GOLDEN = -7046029254386353131


def _ids_hash(ids: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 linear hash of ``ids`` with odd per-position multipliers (wrapping int64 arithmetic)."""
    flat = ids.reshape(-1).to(torch.int64)
    coeff = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * _GOLDEN + 0x2545F491
    return (flat * (coeff * 2 + 1)).sum()


def _embedding_check(ids: torch.Tensor, handle: int, num_embeddings: int) -> torch.Tensor:
    """The ids checks of the module docstring over the handle's ``P_x``: raises on every worker (CPU), and returns a
    0-d bool, True when a check failed (read on a device, where nothing is raised)."""
    ctx: SubGridSum = lookup(handle)
    P = ctx.P
    slots = torch.zeros(2, P.size, dtype=torch.int64, device=ids.device)
    slots[0, P.rank] = _ids_hash(ids)
    slots[1, P.rank] = ((ids < 0) | (ids >= num_embeddings)).sum()
    if P.size > 1:
        slots = all_reduce_sum(ctx.op, P, slots)
    rows = slots[0].view(P.shape)  # partition rank j sits at P.index_of(j): row-major, the vocabulary axis last
    differ = (rows != rows[..., :1]).reshape(-1)
    out_of_range = slots[1] > 0
    bad = differ.any() | out_of_range.any()
    if slots.device.type != "cpu":
        return bad
    if bool(differ.any()):
        groups = sorted({tuple(P.ranks[P.rank_of(P.index_of(j)[:-1] + (k,))] for k in range(P.shape[-1]))
                         for j in range(P.size) if bool(differ[j])})
        raise ShapeError(f"{where(ctx.op)}: the workers of a vocabulary row (the last axis of P_x) must hold the "
                         f"same ids; the world ranks of each row that disagrees: {[list(g) for g in groups]}")
    if bool(out_of_range.any()):
        counts = {P.ranks[j]: int(n) for j, n in enumerate(slots[1].tolist()) if n}
        raise ShapeError(f"{where(ctx.op)}: ids must lie in [0, num_embeddings={num_embeddings}); out-of-range ids "
                         f"per world rank: {counts}")
    return bad


_check_op = op_entry("embedding_check", _embedding_check,
                     lambda ids, handle, num_embeddings: ids.new_empty((), dtype=torch.bool))


def _row_scatter_grid(P_x):
    """This worker's vocabulary row as ``[1, ..., 1, P_v, 1]``, one dimension per output dimension: the sub-grid
    that reduce-scatters the rows (the last ids dimension).  Collective over the world: every rank makes every row's
    partition, in order."""
    lead, p_v = P_x.shape[:-1], P_x.shape[-1]
    shape = [1] * (len(lead) - 1) + [p_v, 1]
    mine = None
    for index in itertools.product(*(range(n) for n in lead)):
        ranks = [P_x.ranks[P_x.rank_of((*index, v))] for v in range(p_v)]
        row = grid_of(ranks, shape, P_x.device)
        if row.active:
            mine = row
    return mine if mine is not None else row


def check_vocab_partition(op: str, P_x) -> None:
    """``P_x`` must be a CartesianPartition of at least two dimensions: the leading axes, then the vocabulary."""
    check_cartesian(op, P_x)
    if P_x.dim < 2:
        raise expect(op, "dimensions of P_x (one per dimension of the ids or targets, then the vocabulary axis)",
                     ">= 2", P_x.dim, PartitionError)


class DistributedEmbedding(BlockIdentityMixin, AgreedLayer, nn.Module):
    """``torch.nn.Embedding`` with its rows split over the last axis of ``P_x`` (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_1, ..., P_k, P_v]``, ``k >= 1``: the ids' axes, then the vocabulary axis.
        num_embeddings, embedding_dim, padding_idx: as ``torch.nn.Embedding`` (a negative
            ``padding_idx`` counts from the end).
        max_norm, norm_type, scale_grad_by_freq, sparse: torch's; only the defaults are supported.
        sequence_parallel: return this vocabulary worker's balanced block of the rows (the last ids dimension)
            instead of every row (see the module docstring).
        device, dtype: of the weight block, this worker's ``[V_v, D]`` (default: ``P_x``'s device, torch's
            default dtype).
    """

    def __init__(self, P_x, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        op = type(self).__name__
        check_vocab_partition(op, P_x)
        for name, value in (("max_norm", max_norm), ("scale_grad_by_freq", scale_grad_by_freq or None),
                            ("sparse", sparse or None)):
            if value is not None:
                raise UnsupportedError(f"{where(op)}: {name}={value!r} is not supported (see the module docstring)")
        if num_embeddings < 1 or embedding_dim < 0:
            raise UnsupportedError(f"{where(op)}: num_embeddings must be >= 1 and embedding_dim >= 0, got "
                                   f"{num_embeddings} and {embedding_dim}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise UnsupportedError(f"{where(op)}: padding_idx={padding_idx} must be within num_embeddings "
                                       f"({num_embeddings})")
            padding_idx = padding_idx % num_embeddings
        self.P_x = P_x
        self.num_embeddings, self.embedding_dim, self.padding_idx = int(num_embeddings), int(embedding_dim), padding_idx
        self.norm_type, self.max_norm, self.scale_grad_by_freq, self.sparse = norm_type, None, False, False
        vocab = P_x.dim - 1
        # Collective over the world, in the same order on every rank (the handles name them in graphs).
        self._vocab = SubGridSum(op, subgrid(P_x, [vocab]))
        self._rep = SubGridSum(op, subgrid(P_x, range(vocab)))
        self._check = SubGridSum(op, P_x)
        self.sequence_parallel = bool(sequence_parallel)
        if self.sequence_parallel:
            self._P_rows = _row_scatter_grid(P_x)
        self._agree_over(P_x)
        p_v, i_v = P_x.shape[vocab], (P_x.index[vocab] if P_x.active else 0)
        self.vocab_start = block_start(self.num_embeddings, p_v, i_v)
        self.vocab_rows = block_extent(self.num_embeddings, p_v, i_v)
        device = torch.device(device) if device is not None else P_x.device
        weight = torch.empty((self.vocab_rows, self.embedding_dim), device=device, dtype=dtype)
        self._dtype = weight.dtype
        self.register_parameter("weight", nn.Parameter(weight) if P_x.active else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torch's initialisation on the global table (normal(0, 1), the padding row zero), drawn on every rank; each
        worker keeps its block.  A table too large to draw on each rank is loaded instead (:func:`load_sequential`)."""
        if self.weight is None:
            return
        full = torch.empty((self.num_embeddings, self.embedding_dim), dtype=self.weight.dtype,
                           device=self.weight.device)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].fill_(0)
        self.weight.copy_(full[self.vocab_start:self.vocab_start + self.vocab_rows])

    def param_layouts(self) -> list[ParamLayout]:
        return [ParamLayout("weight", "weight", self.P_x, (self.num_embeddings, self.embedding_dim),
                            split_dims=(self.P_x.dim - 1,))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This worker's ids block ``[*S_b]`` (zero-volume outside P_x); returns ``[*S_b, D]``, replicated over the
        vocabulary axis (``sequence_parallel``: this vocabulary worker's balanced block of the last ids dimension)."""
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, ids)
            return zero_volume_tensor(dtype=self._dtype, device=ids.device)
        weight = self.weight
        grad = torch.is_grad_enabled() and weight.requires_grad
        signature = (tuple(ids.shape), ids.dtype, ids.device.type, tuple(weight.shape), weight.dtype, grad)
        record = self.session.agree(ids, signature, True, lambda: self._gather(ids, weight), deferrable=True)
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return weight.new_empty((0,))
        poisoned = self.session.poisoned  # this worker's call changed and its peers went on: NaN rows, agreed sizes
        if poisoned:
            ids = self.session.stand_in(ids)
        bad = _check_op(ids, self._check.handle, self.num_embeddings)
        if any(record.param_grad) and self._rep.P.size > 1:
            weight = replicate(weight, self._rep.handle)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        if self.vocab_rows == 0:  # more workers than rows: zeros, tied to the empty block so that backward runs
            part = weight.sum().expand(tuple(ids.shape) + (self.embedding_dim,)).contiguous()
        else:
            pad = self.padding_idx
            pad = pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < self.vocab_rows else None
            rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight, padding_idx=pad)
            part = torch.where(mine.unsqueeze(-1), rows, torch.zeros_like(rows))
        if poisoned:
            part = part * float("nan")  # NaN into every worker's sum, and into the weight's gradient
        if self._vocab.P.size == 1:
            y = part
        elif self.sequence_parallel:
            y = reduce_scatter(part, self._P_rows)
        else:
            y = replicated_sum(part, self._vocab.handle)
        if y.device.type != "cpu":  # nothing was raised: a failed check makes the output NaN on every worker
            y = torch.where(bad, torch.full_like(y, float("nan")), y)
        return y

    def _gather(self, ids: torch.Tensor, weight: torch.Tensor) -> CallRecord:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        op, P_x = type(self).__name__, self.P_x
        # The ids carry a unit vocabulary dimension, so that their blocks tile a global shape like an input's.
        call = gather_call(op, P_x, [ids.unsqueeze(-1), weight], ["ids[..., None]", "weight"], [weight],
                           signature=(op, self.num_embeddings, self.embedding_dim, self.padding_idx, P_x.ranks,
                                      P_x.shape))
        one_dtype(op, P_x, call.dtypes[0], "ids", allowed=_IDS)
        one_dtype(op, P_x, call.dtypes[1], "weight", allowed=FLOATS)
        global_shape_of(op, P_x, call.shapes[0], "ids[..., None]")
        p_v = P_x.shape[-1]
        for j, shape in enumerate(call.shapes[1]):
            want = (block_extent(self.num_embeddings, p_v, P_x.index_of(j)[-1]), self.embedding_dim)
            if tuple(shape) != want:
                raise expect(op, f"weight block shape on world rank {P_x.ranks[j]} (its rows of the "
                             f"{self.num_embeddings}-row table)", want, tuple(shape))
        if len(set(call.param_grad)) > 1:
            got = {w: g for w, g in zip(P_x.ranks, call.param_grad, strict=True)}
            raise ShapeError(f"{where(op)}: every worker's weight must take a gradient or none (the gradient is "
                             f"summed over the workers that share a block); got {got} (world rank: grad mode and "
                             "weight.requires_grad)")
        return call

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"P_x={list(self.P_x.shape)}, {self.num_embeddings}, {self.embedding_dim}{pad}"
