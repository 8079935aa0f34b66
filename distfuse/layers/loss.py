"""Distributed losses: the base class (the reduction over ``P_x``, its identity adjoint, the agreement) and the
elementwise losses (MSE, L1, BCE, BCE with logits, KL divergence).

Every loss here and in :mod:`distfuse.layers.loss_class` derives from
:class:`DistributedLossBase` and gives only its local unreduced loss (and, where it
differs, its ``mean`` divisor).  Partitions and shapes (any axis of ``P_x`` may be split)::

    P_x                     one dimension per input dimension
    input, target           [*shape_b]   balanced blocks of the global [*shape], the same blocks
    reduction='none'        [*shape_b]   this worker's block of torch's unreduced loss
    reduction='sum'/'mean'  []           the global scalar, identical on every worker of P_x

    forward   l = elementwise loss of the local block (torch's own op, reduction='none')
              [sum l, denominator, change flag, failure flag per worker]  ->  one all-reduce over P_x
              loss = sum / (global count, or the global denominator)
    adjoint   the identity (``distfuse::replicate_adjoint``): dl = dloss / count flows into
              torch's elementwise backward, with no message

The adjoint is the identity because every worker holds the same scalar and seeds its gradient
(``replicated_sum``, :mod:`distfuse.primitives.all_sum_reduce`): call ``loss.backward()`` on
every worker of ``P_x`` with the same gradient.  ``mean`` divides by the global count, never
by a mean of local means; sums are taken in fp32 for 16-bit inputs.  Weights (``weight``,
``pos_weight``) are the global tensors torch takes, sliced per call to the local block.  A
target whose blocks differ from the input's is refused.

The agreement flag rides in the reduction with ``sum`` / ``mean`` on CPU
(``distfuse::loss_flags`` reads the sum's flags, a free host read); with ``none`` (no
collective) it takes a host round, and on a device (a flag read would synchronise it) the
deferred round (:mod:`~distfuse.primitives._flag_deferred`: a device all-reduce read at the
next call; a worker whose call changed alone computes on NaN stand-ins of its agreed inputs).

Values torch refuses (a class index out of range, a BCE input or target outside [0, 1]):
an eager call catches torch's error around the local loss; with ``sum``/``mean`` the failure
flags in the reduction make every worker raise (the bad worker torch's message, its peers
the world ranks of the bad blocks); with ``none`` only the bad worker raises, with nobody
waiting for it.  A compiled call cannot catch what happens when the graph runs, so with a
reduction it counts the bad entries with tensor ops (:meth:`_safe_values`), replaces them
with values torch accepts and puts the count in its failure slot.  On CUDA the slots are
not read: the loss is NaN on every worker instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import _reduction

from distfuse.errors import DistfuseError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_start
from distfuse.layers._conv_common import AgreedLayer, check_cartesian
from distfuse.layers._norm_common import DTYPES, FLOATS, compute_dtype, gather_call, global_shape_of, numel, one_dtype
from distfuse.layers._params import ParamLayout
from distfuse.partition import zero_volume_tensor
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._flag_transport import flags_on_host
from distfuse.primitives._handles import lookup
from distfuse.primitives._op_pair import op_entry
from distfuse.primitives.agreement_session import FlagRound, flagged_error
from distfuse.primitives.all_sum_reduce import SubGridSum, replicated_sum

__all__ = ["DistributedLossBase", "LossCall", "reduction_of", "check_smoothing", "DistributedMSELoss",
           "DistributedL1Loss", "DistributedBCELoss", "DistributedBCEWithLogitsLoss", "DistributedKLDivLoss"]


def reduction_of(op: str, allowed: tuple[str, ...], size_average, reduce, reduction: str) -> str:
    """torch's ``reduction`` (mapped from the deprecated ``size_average`` / ``reduce`` as torch maps them), checked."""
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in allowed:
        raise UnsupportedError(f"{where(op)}: reduction={reduction!r} is not one of {list(allowed)}")
    return reduction


def check_smoothing(op: str, label_smoothing) -> float:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise UnsupportedError(f"{where(op)}: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    return float(label_smoothing)


def _refused(op: str, failed: list[int] | None = None, exc: Exception | None = None) -> ShapeError:
    """torch's local op refused this worker's block (``exc``), or the blocks of the world ranks ``failed``."""
    whose = f"this worker's block: {exc}" if exc is not None else (
        f"the blocks of world ranks {failed} (bad values, such as a class index out of range or a BCE input or "
        "target outside [0, 1]); raised on every worker")
    return ShapeError(f"{where(op)}: torch's {op.removeprefix('Distributed')} refused {whose}")


def _loss_flags(flags: torch.Tensor, handle: int) -> None:
    """Read the summed ``[change flag, failure per worker]`` of the reduction (CPU: a free host read) and raise the
    same error on every worker: the flagged-call error (after forgetting the agreement) when some worker's call
    changed, else the refusal.  The handle names the session's
    :class:`~distfuse.primitives.agreement_session.FlagRound`."""
    ctx: FlagRound = lookup(handle)
    if flags.device.type != "cpu":  # no device read: the loss is NaN on every worker instead
        return
    values = flags.tolist()
    if values[0]:
        ctx.on_flag()
        raise flagged_error(ctx.op)
    failed = [w for w, n in zip(ctx.P.ranks, values[1:], strict=False) if n]  # empty where a worker raises its own
    if failed:
        raise _refused(ctx.op, failed)


_check_flags = op_entry("loss_flags", _loss_flags, lambda flags, handle: None)


@dataclass(frozen=True)
class LossCall:
    """What a loss call's metadata gather established (``start``: this worker's block start), vocab loss included."""

    global_shape: tuple[int, ...]
    in_dtype: torch.dtype
    t_dtype: torch.dtype
    start: tuple[int, ...]


class DistributedLossBase(AgreedLayer, nn.Module):
    """A loss over inputs split by ``P_x`` (one dimension per input dimension); subclasses give the local
    unreduced loss and the ``mean`` divisor.  ``reduction``, ``size_average`` and ``reduce`` as torch's."""

    reductions: tuple[str, ...] = ("none", "mean", "sum")

    def __init__(self, P_x, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__()
        op = type(self).__name__
        check_cartesian(op, P_x)
        self.P_x = P_x
        self.reduction = reduction_of(op, self.reductions, size_average, reduce, reduction)
        self._agree_over(P_x)
        self._total = SubGridSum(op, P_x)  # names P_x in the reduction

    # -------------------------------------------------------- what subclasses provide

    def _check_target(self, op: str, G, call) -> None:
        """Every worker's target block must have its input block's shape (torch would broadcast; distfuse refuses)."""
        for j, (xs, ts) in enumerate(zip(call.shapes[0], call.shapes[1], strict=True)):
            if xs != ts:
                raise expect(op, f"target block shape on world rank {self.P_x.ranks[j]} (its input block's shape)", xs,
                             ts)

    def _local_loss(self, input: torch.Tensor, target: torch.Tensor, G, start) -> torch.Tensor:
        """This worker's block of torch's unreduced loss; every concrete loss defines it (an abstract hook)."""
        raise NotImplementedError(f"{type(self).__name__} must define _local_loss")

    def _mean_divisor(self, G, t_dtype: torch.dtype) -> int | None:
        """The ``mean`` divisor from the global shape, or None when it is a global sum: then the loss defines
        ``_local_denominator(input, target, dtype)``, this worker's part (the class weights of its targets)."""
        return numel(G)

    def _safe_values(self, input: torch.Tensor, target: torch.Tensor):
        """``(input, target, bad)`` for a call that cannot catch torch's refusal (compiled, or in a capture): blocks
        torch's local op accepts, and how many entries it would refuse (a 0-d tensor), or None where torch checks
        no values.  Traced tensor ops, no host read; a good block is unchanged (bitwise)."""
        return input, target, None

    def _signature(self):
        return (type(self).__name__, self.reduction, self.P_x.ranks, self.P_x.shape)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """The global weight tensors the local loss reads (their shapes enter the call's signature)."""
        return ()

    # -------------------------------------------------------- the call

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This worker's input and target blocks (zero-volume outside P_x); see the module docstring."""
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, input)
            check_inactive_input(op, target)
            return zero_volume_tensor(dtype=input.dtype, device=input.device)
        signature = (tuple(input.shape), input.dtype, tuple(target.shape), target.dtype, input.device.type,
                     tuple((tuple(w.shape), w.dtype) for w in self._weights()))
        if self.reduction != "none" and not flags_on_host(self.P_x.device):  # the flag rides in the reduction
            def settle():
                record = self._gather(input, target)
                return self._loss(op, record, input, target, 0), record

            return self.session.agree_in(signature, True, lambda record, flag: self._loss(
                op, record, input, target, flag, attempt=True), settle)
        record = self.session.agree(input, signature, True, lambda: self._gather(input, target), deferrable=True)
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return input.new_empty((0,))
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN input, agreed sizes
            input, target = self.session.stand_in(input), self.session.stand_in(target, 2)
        return self._loss(op, record, input, target, 0)

    def _gather(self, input: torch.Tensor, target: torch.Tensor) -> LossCall:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        op, P_x = type(self).__name__, self.P_x
        call = gather_call(op, P_x, [input, target], ["input", "target"], signature=self._signature())
        in_dtype = one_dtype(op, P_x, call.dtypes[0], "input")
        t_dtype = one_dtype(op, P_x, call.dtypes[1], "target", allowed=DTYPES)
        G = global_shape_of(op, P_x, call.shapes[0])
        self._check_target(op, G, call)
        return LossCall(G, in_dtype, t_dtype, local_start(G, P_x.shape, P_x.index))

    def _loss(self, op: str, record: LossCall, input: torch.Tensor, target: torch.Tensor, flag: int,
              attempt: bool = False) -> torch.Tensor:
        """The local loss and, with a reduction, its sum over ``P_x`` with the sizes of ``record``.

        ``flag`` 1: this worker's call differs from the agreed one; it sends zeros and the
        change flag instead of its loss (0: it does not; -1: trusted, no flag moves).
        ``attempt``: the flag rides in this reduction, so a distfuse check that the local loss
        meets (only a changed call can) flags a change instead of raising on this worker alone.
        """
        session = self.session
        G, start = record.global_shape, record.start
        changed = flag == 1
        local = failure = bad = None
        if not changed:
            if self.reduction != "none" and not session.may_read_host:
                input, target, bad = self._safe_values(input, target)  # counted before torch's op
            try:
                local = self._local_loss(input, target, G, start)
            except DistfuseError:
                if not attempt:
                    raise
                changed = True
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # torch's value and dtype checks
                failure = exc
        if self.reduction == "none":
            if failure is not None:
                raise _refused(op, exc=failure) from failure
            return local
        divisor = None if self.reduction == "sum" else self._mean_divisor(G, record.t_dtype)
        summed_divisor = self.reduction != "sum" and divisor is None
        result_dtype = record.in_dtype if record.t_dtype not in FLOATS else torch.promote_types(record.in_dtype,
                                                                                                record.t_dtype)
        partial = self._partial(local, input, target, failure, summed_divisor, compute_dtype(result_dtype), changed,
                                bad)
        total = replicated_sum(partial, self._total.handle)
        # Every worker but one whose own block was refused reads every flag; that one reads the change flag, then
        # raises torch's message (after the agreement held on every worker: the metadata agreed, only values failed).
        _check_flags(total[2:] if failure is None else total[2:3], session.flag.handle)
        if failure is not None:
            raise _refused(op, exc=failure) from failure
        loss = total[0] / total[1] if summed_divisor else total[0]
        if bad is not None and total.device.type != "cpu":  # no host read on a device: a NaN on every worker
            loss = torch.where(total[3:].sum() > 0, torch.full_like(loss, float("nan")), loss)
        return (loss if divisor is None else loss / divisor).to(result_dtype)

    def _partial(self, local, input, target, failure, summed_divisor: bool, cdt: torch.dtype, changed: bool,
                 bad: torch.Tensor | None) -> torch.Tensor:
        """This worker's ``[sum of local, denominator, change flag, failure flag per worker]`` in ``cdt``; ``bad``
        (the entries torch would refuse, counted in the graph by :meth:`_safe_values`) fills its failure slot."""
        P_x = self.P_x
        device = input.device if input.device.type == P_x.device.type else P_x.device
        extra = torch.zeros(2 + P_x.size, dtype=cdt, device=device)  # [denominator, change, failure per worker]
        if changed:
            num = torch.zeros((), dtype=cdt, device=device)
            extra[1] = 1
        elif failure is None:
            num = local.sum(dtype=cdt)
            if summed_divisor:
                extra[0] = self._local_denominator(input, target, cdt)
            if bad is not None:
                extra[2 + P_x.rank] = bad.to(cdt)
        else:
            num = torch.full((), float("nan"), dtype=cdt, device=device)
            extra[2 + P_x.rank] = 1
        return torch.cat([num.reshape(1), extra])

    def extra_repr(self) -> str:
        return f"P_x={list(self.P_x.shape)}, reduction={self.reduction!r}"


# ---------------------------------------------------------------- the elementwise losses


def broadcast_block(op: str, name: str, w: torch.Tensor | None, G, start, extent) -> torch.Tensor | None:
    """The part of ``w`` (broadcastable to the global shape ``G``, right-aligned) that meets the local block."""
    if w is None:
        return None
    if w.dim() > len(G):
        raise UnsupportedError(f"{where(op)}: {name} has {w.dim()} dimensions, more than the input's {len(G)}; "
                               "the result would not be decomposed like the input")
    index = []
    for d, n in enumerate(w.shape, len(G) - w.dim()):
        if n == 1:
            index.append(slice(None))
        elif n == G[d]:
            index.append(slice(start[d], start[d] + extent[d]))
        else:
            raise ShapeError(f"{where(op)}: {name} of shape {tuple(w.shape)} does not broadcast to the global input "
                             f"shape {tuple(G)} (dimension {d}: {n} against {G[d]})")
    return w[tuple(index)]


class _WeightedLossBase(DistributedLossBase):
    """A loss with optional global weight buffers (torch registers them as buffers, so the state dict has them)."""

    def __init__(self, P_x, size_average, reduce, reduction: str, **weights):
        super().__init__(P_x, size_average, reduce, reduction)
        self._weight_names = tuple(weights)
        for name, w in weights.items():
            self.register_buffer(name, None if w is None else torch.as_tensor(w).to(self.P_x.device))

    def _weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(w for w in (getattr(self, n) for n in self._weight_names) if w is not None)

    def param_layouts(self) -> list[ParamLayout]:
        return [ParamLayout(n, n, self.P_x, tuple(getattr(self, n).shape), split_dims=())
                for n in self._weight_names if getattr(self, n) is not None]


class DistributedMSELoss(DistributedLossBase):
    """``torch.nn.MSELoss`` over input and target blocks split by ``P_x`` (see the module docstring)."""

    def _local_loss(self, input, target, G, start):
        return F.mse_loss(input, target, reduction="none")


class DistributedL1Loss(DistributedLossBase):
    """``torch.nn.L1Loss`` over input and target blocks split by ``P_x`` (see the module docstring)."""

    def _local_loss(self, input, target, G, start):
        return F.l1_loss(input, target, reduction="none")


class DistributedBCELoss(_WeightedLossBase):
    """``torch.nn.BCELoss``; ``weight`` is the global rescaling tensor, broadcastable to the global input."""

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, reduce=None,
                 reduction: str = "mean"):
        super().__init__(P_x, size_average, reduce, reduction, weight=weight)

    def _local_loss(self, input, target, G, start):
        w = broadcast_block(type(self).__name__, "weight", self.weight, G, start, input.shape)
        return F.binary_cross_entropy(input, target, w, reduction="none")

    def _safe_values(self, input, target):
        """torch refuses an input or a target outside [0, 1] (NaN included); both become 0.5 there, counted."""
        bad = ~((input >= 0) & (input <= 1) & (target >= 0) & (target <= 1))
        return torch.where(bad, 0.5, input), torch.where(bad, 0.5, target), bad.sum()


class DistributedBCEWithLogitsLoss(_WeightedLossBase):
    """``torch.nn.BCEWithLogitsLoss``; ``weight`` and ``pos_weight`` are global, broadcastable to the global input."""

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, reduce=None,
                 reduction: str = "mean", pos_weight: torch.Tensor | None = None):
        super().__init__(P_x, size_average, reduce, reduction, weight=weight, pos_weight=pos_weight)

    def _local_loss(self, input, target, G, start):
        op = type(self).__name__
        w = broadcast_block(op, "weight", self.weight, G, start, input.shape)
        pw = broadcast_block(op, "pos_weight", self.pos_weight, G, start, input.shape)
        return F.binary_cross_entropy_with_logits(input, target, w, reduction="none", pos_weight=pw)


class DistributedKLDivLoss(DistributedLossBase):
    """``torch.nn.KLDivLoss``; ``reduction='batchmean'`` divides by the global batch size (the input's dimension 0)."""

    reductions = ("none", "mean", "sum", "batchmean")

    def __init__(self, P_x, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False):
        super().__init__(P_x, size_average, reduce, reduction)
        self.log_target = bool(log_target)

    def _check_target(self, op, G, call) -> None:
        super()._check_target(op, G, call)
        if self.reduction == "mean":  # when the call is agreed (a warning cannot sit in a compiled graph)
            warnings.warn("reduction: 'mean' divides the total loss by both the batch size and the support size; "
                          "'batchmean' divides only by the batch size, and aligns with the KL div math definition "
                          "(as torch warns)", stacklevel=2)

    def _local_loss(self, input, target, G, start):
        return F.kl_div(input, target, reduction="none", log_target=self.log_target)

    def _mean_divisor(self, G, t_dtype) -> int:
        return G[0] if self.reduction == "batchmean" else numel(G)

    def _signature(self):
        return super()._signature() + (self.log_target,)
