"""Cross-entropy over vocabulary-parallel logits: the class axis split over the last axis of ``P_x``, never gathered.

Partitions and shapes (``P_x = [P_1, ..., P_k, P_v]``, ``k >= 1``; the rows may be split over
the leading axes, the classes over the last; the class axis is the *last* one, as the
output of a vocabulary-parallel projection has it, where torch puts it at dimension 1)::

    input     [*S_b, V_v]   logits: rows S_b of the global [*S] (balanced over P_1..P_k), classes
                            [start_v, start_v + V_v) of the global V (balanced over P_v)
    target    [*S_b]        int64 global class indices, the same on every worker of the vocabulary axis
    reduction='none'        [*S_b]   torch's unreduced loss of the rows, replicated over the vocabulary axis
    reduction='sum'/'mean'  []       the global scalar, identical on every worker of P_x

The result equals ``F.cross_entropy`` of the gathered ``[prod(S), V]`` logits and ``[prod(S)]``
targets, with torch's ``ignore_index``, ``label_smoothing`` and ``reduction`` (class weights and
probability targets are not supported).

Forward, per row (``x`` the local logits in fp32 for 16-bit inputs, ``t`` the target, ``eps``
the smoothing)::

    MAX over the vocabulary axis of [max_c x, t, -t]         (float64, one all-reduce; no gradient)
        -> M the global max; t's max and min (a row whose targets differ is refused, see below)
    SUM over the vocabulary axis of [sum_c exp(x - M), x[t - start_v] if this worker owns t else 0,
                                     (sum_c x if eps > 0)]   (one all-reduce, ``distfuse::replicate_adjoint``)
        -> S, x_t, X
    row = (1 - eps) (log S + M - x_t) + eps (log S + M - X / V)        0 where t == ignore_index
    'sum'/'mean': SUM over the leading axes of [sum row, count, flags] (``distfuse::replicate_adjoint``)

Adjoint.  The row losses are replicated over the vocabulary axis, and the scalar over
``P_x``, so the adjoint of each sum is the identity (:mod:`distfuse.primitives.all_sum_reduce`);
for this worker's block, with no message::

    dx[c] = g * (exp(x[c] - M) / S - (1 - eps) [c == t - start_v] - eps / V)

the block of softmax minus the smoothed one-hot.  ``M`` enters detached: the log-sum-exp
does not depend on the shift, so the MAX round has no adjoint.

Why two rounds: the exponentials need the global max first, and a MAX and a SUM cannot
share one all-reduce (combining each worker's ``(max, sum exp(x - max))`` locally would need
a "keep your own slice" adjoint; the rounds are small, ``3 x rows`` values against ``rows x
V_v`` logits).  The targets ride in the MAX round as ``t`` and ``-t``, which checks every
row's agreement at no extra round.

Values: a target neither in ``[0, V)`` nor ``ignore_index``, or a row whose target differs
between the workers of the vocabulary axis, is refused by ``distfuse::vocab_loss_check``
with the same :class:`~distfuse.errors.ShapeError` on every worker of ``P_x``: with
``sum``/``mean`` the counts ride in the final sum; ``none`` adds a round over ``P_x`` (two
int64).  On a device the counts are not read: the refused rows, or the scalar, are NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import block_extent, local_start
from distfuse.layers._conv_common import AgreedLayer
from distfuse.layers._norm_common import compute_dtype, gather_call, global_shape_of, one_dtype, subgrid
from distfuse.layers.embedding import check_vocab_partition
from distfuse.layers.loss import LossCall, check_smoothing, reduction_of
from distfuse.partition import zero_volume_tensor
from distfuse.primitives._axes import all_reduce_sum
from distfuse.primitives._common import check_inactive_input, collective_guard
from distfuse.primitives._handles import lookup
from distfuse.primitives._op_pair import op_entry
from distfuse.primitives.all_sum_reduce import SubGridSum, replicated_sum

__all__ = ["DistributedVocabCrossEntropyLoss"]


def _vocab_max(x: torch.Tensor, handle: int) -> torch.Tensor:
    """A new tensor: the elementwise max of ``x`` over the handle's sub-grid (no gradient)."""
    ctx: SubGridSum = lookup(handle)
    y = x.contiguous().clone()
    if ctx.P.size > 1 and y.numel() > 0:  # the rows are the same on every worker of the sub-grid: all skip together
        with collective_guard(ctx.op, "all-reduce (max)", ctx.P.ranks):
            dist.all_reduce(y, op=dist.ReduceOp.MAX, group=ctx.P.group)
    return y


_max_op = op_entry("vocab_max", _vocab_max,
                   lambda x, handle: torch.empty_like(x, memory_format=torch.contiguous_format))


def _vocab_loss_check(flags: torch.Tensor, handle: int, num_classes: int, ignore_index: int, reduce: bool) -> None:
    """Raise on every worker of the handle's ``P_x`` when ``flags`` ``[target entries that differ over the vocabulary
    axis, targets out of range]`` count any (CPU only: on a device the loss is NaN instead).

    ``reduce``: the flags are this worker's (summed over ``P_x`` here, one small all-reduce), not yet totals.
    """
    ctx: SubGridSum = lookup(handle)
    if reduce and ctx.P.size > 1:
        flags = all_reduce_sum(ctx.op, ctx.P, flags)
    if flags.device.type != "cpu":
        return
    differ, out_of_range = (int(v) for v in flags.tolist())
    if differ:
        raise ShapeError(f"{where(ctx.op)}: the target must be the same on every worker of the vocabulary axis (the "
                         f"last axis of P_x); {differ} target entries differ between those workers")
    if out_of_range:
        raise ShapeError(f"{where(ctx.op)}: {out_of_range} target class indices lie outside [0, {num_classes}) and "
                         f"are not ignore_index={ignore_index}")


_check_op = op_entry("vocab_loss_check", _vocab_loss_check,
                     lambda flags, handle, num_classes, ignore_index, reduce: None)


class DistributedVocabCrossEntropyLoss(AgreedLayer, nn.Module):
    """``torch.nn.CrossEntropyLoss`` over logits whose class (vocabulary) axis, the last, is split over ``P_x``'s last
    axis (see the module docstring; :class:`~distfuse.layers.loss_class.DistributedCrossEntropyLoss` is the
    per-voxel loss, classes at dimension 1 and unsplit).

    Args:
        P_x: CartesianPartition ``[P_1, ..., P_k, P_v]``, one dimension per logits dimension, ``k >= 1``.
        ignore_index, reduction, label_smoothing, size_average, reduce: as ``torch.nn.CrossEntropyLoss``.
        num_classes: the global vocabulary size, if known: every worker's logits width is then
            checked against its block of it (otherwise the size is the sum of the blocks).
    """

    def __init__(self, P_x, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 num_classes: int | None = None, size_average=None, reduce=None):
        super().__init__()
        op = type(self).__name__
        check_vocab_partition(op, P_x)
        self.reduction = reduction_of(op, ("none", "mean", "sum"), size_average, reduce, reduction)
        self.label_smoothing = check_smoothing(op, label_smoothing)
        if num_classes is not None and int(num_classes) < 1:
            raise UnsupportedError(f"{where(op)}: num_classes must be >= 1, got {num_classes}")
        self.P_x = P_x
        self.ignore_index = int(ignore_index)
        self.num_classes = None if num_classes is None else int(num_classes)
        # Collective over the world, in the same order on every rank (the handles name them in graphs).
        self._vocab = SubGridSum(op, subgrid(P_x, [P_x.dim - 1]))
        self._rows = SubGridSum(op, subgrid(P_x, range(P_x.dim - 1)))
        self._all = SubGridSum(op, P_x)
        self._agree_over(P_x)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This worker's logits ``[*S_b, V_v]`` and target ``[*S_b]`` (zero-volume outside P_x)."""
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, input)
            check_inactive_input(op, target)
            return zero_volume_tensor(dtype=input.dtype, device=input.device)
        signature = (tuple(input.shape), input.dtype, input.device.type, tuple(target.shape), target.dtype,
                     target.device.type)
        record = self.session.agree(input, signature, True, lambda: self._gather(input, target), deferrable=True)
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return input.new_empty((0,))
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN logits, agreed sizes
            input, target = self.session.stand_in(input), self.session.stand_in(target, 3)
        return self._loss(record, input, target)

    def _loss(self, record: LossCall, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The two rounds over the vocabulary axis, the row losses and their reduction (module docstring)."""
        V, width, eps = record.global_shape[-1], input.shape[-1], self.label_smoothing
        cdt = compute_dtype(record.in_dtype)
        x = input.reshape(target.numel(), width).to(cdt)
        t = target.reshape(-1)
        ignored = t == self.ignore_index
        out_of_range = ~ignored & ((t < 0) | (t >= V))
        with torch.no_grad():  # the shift has no gradient (module docstring)
            local_max = x.amax(-1) if width > 0 else x.new_full(x.shape[:1], float("-inf"))
        t64 = t.to(torch.float64)
        peak = _max_op(torch.stack([local_max.to(torch.float64), t64, -t64]), self._vocab.handle)
        differ = peak[1] != -peak[2]
        M = peak[0].to(cdt)
        M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # a row of infinities: torch's NaN, not ours
        valid = ~ignored & ~out_of_range & ~differ
        local = t - record.start[-1]
        mine = valid & (local >= 0) & (local < width)
        parts = [torch.exp(x - M.unsqueeze(-1)).sum(-1)]
        if width > 0:
            picked = x.gather(-1, torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
            parts.append(torch.where(mine, picked, torch.zeros_like(picked)))
        else:  # no classes here: a zero contribution (with a gradient path to the empty block)
            parts.append(x.sum(-1))
        if eps > 0:
            parts.append(x.sum(-1))
        sums = torch.stack(parts)
        if self._vocab.P.size > 1:
            sums = replicated_sum(sums, self._vocab.handle)
        lse = torch.log(sums[0]) + M
        row = lse - sums[1]
        if eps > 0:
            row = (1 - eps) * row + eps * (lse - sums[2] / V)
        row = torch.where(valid, row, torch.zeros_like(row))
        if self.reduction == "none":  # each row's flags counted once: by its vocabulary worker 0
            flags = torch.stack([differ.sum(), out_of_range.sum()]) * int(self.P_x.index[-1] == 0)
            _check_op(flags, self._all.handle, V, self.ignore_index, True)
            if row.device.type != "cpu":
                row = torch.where(differ | out_of_range, torch.full_like(row, float("nan")), row)
            return row.reshape(target.shape).to(record.in_dtype)
        counts = torch.stack([valid.sum(), differ.sum(), out_of_range.sum()]).to(cdt)
        total = torch.cat([row.sum().reshape(1), counts])
        if self._rows.P.size > 1:
            total = replicated_sum(total, self._rows.handle)
        _check_op(total[2:], self._all.handle, V, self.ignore_index, False)  # already totals over P_x
        loss = total[0] / total[1] if self.reduction == "mean" else total[0]
        if loss.device.type != "cpu":
            loss = torch.where(total[2:].sum() > 0, torch.full_like(loss, float("nan")), loss)
        return loss.to(record.in_dtype)

    def _gather(self, input: torch.Tensor, target: torch.Tensor) -> LossCall:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        op, P_x = type(self).__name__, self.P_x
        call = gather_call(op, P_x, [input, target], ["logits", "target"],
                           signature=(op, self.reduction, self.ignore_index, self.label_smoothing, self.num_classes,
                                      P_x.ranks, P_x.shape))
        dtype = one_dtype(op, P_x, call.dtypes[0], "logits")
        t_dtype = one_dtype(op, P_x, call.dtypes[1], "target (class indices)", allowed=(torch.int64,))
        p_v = P_x.shape[-1]
        if self.num_classes is not None:
            for j, shape in enumerate(call.shapes[0]):
                want = block_extent(self.num_classes, p_v, P_x.index_of(j)[-1])
                if shape[-1] != want:
                    raise expect(op, f"local vocabulary width of the logits on world rank {P_x.ranks[j]} (its block "
                                 f"of num_classes={self.num_classes} over the {p_v} workers of the vocabulary axis)",
                                 want, shape[-1])
        G = global_shape_of(op, P_x, call.shapes[0], "logits")
        for j, (xs, ts) in enumerate(zip(call.shapes[0], call.shapes[1], strict=True)):
            if tuple(ts) != tuple(xs[:-1]):
                raise expect(op, f"target block shape on world rank {P_x.ranks[j]} (its logits block without the "
                             "vocabulary dimension)", tuple(xs[:-1]), tuple(ts))
        return LossCall(G, dtype, t_dtype, local_start(G, P_x.shape, P_x.index))

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}")
