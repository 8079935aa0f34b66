"""The distributed losses' base class: the reduction over ``P_x``, its identity adjoint and the agreement.

Every loss of :mod:`distfuse.layers.loss` and :mod:`distfuse.layers.loss_class` derives
from :class:`DistributedLossBase` and gives only its local unreduced loss (and, where it
differs, its ``mean`` divisor); what they share is here.

Partitions and shapes (any axis of ``P_x`` may be split)::

    P_x                     one dimension per input dimension
    input, target           [*shape_b]   balanced blocks of the global [*shape], the same blocks
    reduction='none'        [*shape_b]   this worker's block of torch's unreduced loss
    reduction='sum'/'mean'  []           the global scalar, identical on every worker of P_x

    forward   l = elementwise loss of the local block (torch's own op, reduction='none')
              [sum l, denominator, failure flags]  ->  one all-reduce over P_x
              loss = sum / (global count, or the global denominator)
    adjoint   the scalar is replicated: each worker's incoming gradient is the gradient of
              the one global loss, so the adjoint of the all-reduce is the identity and
              dl = dloss / count flows into torch's elementwise backward, with no message.

Why the identity adjoint: every worker holds the same scalar and calls ``backward`` on it,
as a replicated training loop does.  Summing those gradients (AllSumReduce's own adjoint)
would count the loss once per worker.  So call ``loss.backward()`` on every worker of
``P_x`` with the same gradient (the default 1).  Workers outside ``P_x`` pass zero-volume
tensors and get a zero-volume tensor back: they hold no part of the loss.

``mean`` divides by the global count (the global element count, the global batch for
``KLDivLoss(reduction='batchmean')``), never by a mean of local means, which is wrong
under uneven splits.  Sums are taken in fp32 for 16-bit inputs and rounded once.

Agreement (:mod:`distfuse.primitives._agreement`).  The workers agree on each call's
metadata (shapes, dtypes, the weights' shapes), so a target whose blocks do not match the
input's (torch would broadcast them with a warning; distfuse refuses), a non-balanced split
or mixed dtypes raise the same error on every worker.  The metadata gather over ``P_x``
runs on the first call and when some worker's call changed, never while every worker's
call repeats.  How a worker whose call repeats learns that a peer's changed:

* ``sum`` / ``mean`` on CPU: in the reduction itself, which reaches every worker of
  ``P_x``.  Its message ``[sum l, denominator, change flag, failure flag per worker]`` has
  a size fixed by ``P_x`` and the dtype agreed on; a worker whose call changed sends zeros
  and the change flag, every worker reads the flags of the sum (a CPU tensor: free) and,
  if one is set, all drop the sum, gather the metadata, check it and reduce again.  No
  extra round in steady state.
* ``none`` (no collective at all) and partitions on a device (CUDA: reading a flag of a
  device tensor would synchronise the device every call): one flag round before anything
  else (a one-element all-reduce on ``P_x``'s host meta group, no device read).

An error inside torch's local op (a class index out of range, a probability outside
[0, 1], dtypes torch refuses) is carried in the same reduction (the failure flags), so
with ``sum``/``mean`` every worker raises; with ``none`` no collective follows and the
worker whose block is bad raises alone, with nobody waiting for it.  The agreed record
stays settled on every worker either way (the metadata agreed; the values did not).  On
CUDA the failure flags are not read (that read would synchronise the device), so such a
failure surfaces as a NaN loss on the other workers; torch's CUDA kernels check class
indices and BCE probabilities with device-side asserts anyway, which abort the process
asynchronously instead of raising here.  Inside ``torch.compile`` a call reuses the last
eager call's record with a flag round instead of the gather, and checks the values torch
would refuse with tensor ops before torch's op, so a bad block still raises on every worker
(``_loss_compiled.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import _reduction

from distfuse.errors import DistfuseError, PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_start
from distfuse.layers._loss_compiled import LossCall, LossSites, call_signature, compiled_loss, keep
from distfuse.layers._norm_common import FLOATS, compute_dtype, gather_call, global_shape_of, numel, one_dtype
from distfuse.partition import CartesianPartition, zero_volume_tensor
from distfuse.primitives._agreement import agreed_by_flag_round, run_agreed, trusting
from distfuse.primitives._axes import all_reduce_sum
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._flag_transport import flags_on_host

__all__ = ["DistributedLossBase", "replicated_sum"]

_ANY = FLOATS + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class _ReplicatedSum(torch.autograd.Function):
    """Forward: the sum over ``P_x`` (all-reduce).  Adjoint: the identity (the result is one replicated value)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, P_x: CartesianPartition, op: str):
        return all_reduce_sum(op, P_x, partial)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def replicated_sum(partial: torch.Tensor, P_x: CartesianPartition, op: str) -> torch.Tensor:
    """The sum of ``partial`` over every worker of ``P_x``, on every one of them, as one replicated value.

    Its adjoint is the identity: each worker's incoming gradient is taken as the gradient
    of the one global value, so every worker must seed the same gradient (see the module doc).
    """
    if P_x.size == 1:
        return partial.clone()
    return _ReplicatedSum.apply(partial, P_x, op)


class _Outcome(NamedTuple):
    """One evaluation of a loss: the value, this worker's torch error, the world ranks whose torch op failed (read
    from the reduction's flags, CPU only) and whether some worker flagged a changed call (in-band attempts)."""

    value: torch.Tensor | None
    failure: Exception | None
    failed: tuple[int, ...]
    flagged: bool

class DistributedLossBase(nn.Module):
    """A loss over inputs split by ``P_x``; subclasses give the local unreduced loss and the ``mean`` divisor.

    Args:
        P_x: CartesianPartition with one dimension per input dimension.
        size_average, reduce: torch's deprecated reduction arguments (mapped as torch maps them).
        reduction: ``'none'``, ``'mean'`` or ``'sum'`` (``'batchmean'`` too for KL divergence).
    """

    reductions: tuple[str, ...] = ("none", "mean", "sum")

    def __init__(self, P_x, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__()
        op = type(self).__name__
        if not isinstance(P_x, CartesianPartition):
            raise PartitionError(f"{where(op)}: P_x must be a CartesianPartition, got {type(P_x).__name__}")
        if size_average is not None or reduce is not None:
            reduction = _reduction.legacy_get_string(size_average, reduce)
        if reduction not in self.reductions:
            raise UnsupportedError(f"{where(op)}: reduction={reduction!r} is not one of {list(self.reductions)}")
        self.P_x = P_x
        self.reduction = reduction
        self._sites = LossSites(op, P_x)  # the agreement and the compiled forward's op contexts

    # -------------------------------------------------------- what subclasses provide

    def _check_target(self, op: str, G, call) -> None:
        """Every worker's target block must have its input block's shape (torch would broadcast; distfuse refuses)."""
        for j, (xs, ts) in enumerate(zip(call.shapes[0], call.shapes[1], strict=True)):
            if xs != ts:
                raise expect(op, f"target block shape on world rank {self.P_x.ranks[j]} (its input block's shape)",
                             xs, ts)

    def _local_loss(self, input: torch.Tensor, target: torch.Tensor, G, start) -> torch.Tensor:
        """This worker's block of torch's unreduced loss; every concrete loss defines it (an abstract hook)."""
        raise NotImplementedError(f"{type(self).__name__} must define _local_loss")

    def _mean_divisor(self, G, t_dtype: torch.dtype) -> int | None:
        """The ``mean`` divisor from the global shape, or None when it is a global sum (:meth:`_local_denominator`)."""
        return numel(G)

    def _local_denominator(self, input: torch.Tensor, target: torch.Tensor, dtype) -> torch.Tensor:
        """This worker's part of a summed ``mean`` divisor (class weights of the targets, for instance).

        Only losses whose :meth:`_mean_divisor` returns None define it (an abstract hook).
        """
        raise NotImplementedError(f"{type(self).__name__} must define _local_denominator when _mean_divisor "
                                  "returns None")

    def _safe_values(self, input: torch.Tensor, target: torch.Tensor):
        """``(input, target, bad)`` for a compiled call: blocks torch's local op accepts, and how many entries it
        would refuse (a 0-d tensor), or None where torch checks no values.

        Traced tensor ops, no host read: the count travels in the reduction's failure slot
        (see ``_loss_compiled``).  The entries replaced are ones torch would refuse, so the
        values and gradients of a good block are unchanged (bitwise).
        """
        return input, target, None

    def _result_dtype(self, in_dtype: torch.dtype, t_dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(in_dtype, t_dtype) if t_dtype in FLOATS else in_dtype

    def _signature(self):
        return (type(self).__name__, self.reduction, self.P_x.ranks, self.P_x.shape)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """The global weight tensors the local loss reads (their shapes enter the call's signature)."""
        return ()

    # -------------------------------------------------------- the call

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This worker's input and target blocks (zero-volume outside P_x); see the module docstring."""
        op = type(self).__name__
        P_x = self.P_x
        if not P_x.active:
            check_inactive_input(op, input)
            check_inactive_input(op, target)
            return zero_volume_tensor(dtype=input.dtype, device=input.device)
        if torch.compiler.is_compiling():  # custom ops, no metadata gather (distfuse/layers/_loss_compiled.py)
            return compiled_loss(self, input, target)
        site = self._sites.agreement
        signature = call_signature(input, target, self._weights())
        before = site.slow_calls
        if self.reduction == "none" or flags_on_host(P_x.device) or (site.state is not None and trusting()):
            # A flag round first (no collective to carry it, or no device read on CUDA), or a trusted record.
            record = agreed_by_flag_round(site, P_x, op, signature, True, lambda: self._gather_and_check(op, input,
                                                                                                          target))
            if site.slow_calls != before:
                keep(self._sites, signature, record)
            outcome = self._evaluate(op, site.state, input, target, changed=False, attempt=False)
        else:  # the flag rides in the reduction (see the module docstring)
            def attempt(changed: bool):
                outcome = self._evaluate(op, site.state, input, target, changed, attempt=True)
                return outcome, outcome.flagged

            def slow():
                record = self._gather_and_check(op, input, target)
                return self._evaluate(op, record, input, target, changed=False, attempt=False), record

            outcome = run_agreed(site, signature, True, attempt, slow)
            if site.slow_calls != before:
                keep(self._sites, signature, site.state)
        # Raised after the agreement settled on every worker: the metadata agreed, only values failed.
        if outcome.failure is not None:
            raise ShapeError(f"{where(op)}: torch's {op[11:]} refused this worker's block: "
                             f"{outcome.failure}") from outcome.failure
        if outcome.failed:
            raise ShapeError(f"{where(op)}: torch's {op[11:]} refused the blocks of world ranks {list(outcome.failed)} "
                             "(bad values, such as a class index out of range); see their errors")
        return outcome.value

    def _gather_and_check(self, op: str, input: torch.Tensor, target: torch.Tensor) -> LossCall:
        """The metadata gather over ``P_x`` and its checks (the same error on every worker): the agreed record."""
        P_x = self.P_x
        call = gather_call(op, P_x, [input, target], ["input", "target"], signature=self._signature())
        in_dtype = one_dtype(op, P_x, call.dtypes[0], "input")
        t_dtype = one_dtype(op, P_x, call.dtypes[1], "target", allowed=_ANY)
        G = global_shape_of(op, P_x, call.shapes[0])
        self._check_target(op, G, call)
        return LossCall(G, in_dtype, t_dtype, local_start(G, P_x.shape, P_x.index))

    def _evaluate(self, op: str, record: LossCall, input: torch.Tensor, target: torch.Tensor, changed: bool,
                  attempt: bool) -> _Outcome:
        """The local loss and, with a reduction, the all-reduce over ``P_x`` with the sizes of ``record``.

        ``changed``: this worker's call differs from the agreed one; it sends zeros and the
        change flag instead of its loss.  ``attempt``: a steady-state call whose flags are read
        from the sum (then a distfuse error of the local loss, which only a changed call can
        meet, flags a change instead of raising on this worker alone).  torch's own errors
        become the outcome's ``failure`` (and a failure flag in the sum).
        """
        G, start = record.global_shape, record.start
        local = failure = None
        if not changed:
            try:
                local = self._local_loss(input, target, G, start)
            except DistfuseError:
                if not attempt:
                    raise  # distfuse's own checks depend only on agreed metadata: raised on every worker
                changed = True
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # torch's value and dtype checks
                failure = exc
        if self.reduction == "none":
            return _Outcome(local, failure, (), False)
        divisor = None if self.reduction == "sum" else self._mean_divisor(G, record.t_dtype)
        summed_divisor = self.reduction != "sum" and divisor is None
        result_dtype = self._result_dtype(record.in_dtype, record.t_dtype)
        partial = self._partial(local, input, target, failure, summed_divisor, compute_dtype(result_dtype), changed)
        total = replicated_sum(partial, self.P_x, op)
        flagged, failed = False, ()
        if attempt or total.device.type == "cpu":  # a host read: free on CPU (see the module docstring)
            flags = total[2:].tolist()
            flagged = flags[0] != 0
            failed = tuple(self.P_x.ranks[j] for j, f in enumerate(flags[1:]) if f)
        if flagged:
            return _Outcome(None, None, (), True)
        loss = total[0] / total[1] if summed_divisor else total[0]
        return _Outcome((loss if divisor is None else loss / divisor).to(result_dtype), failure, failed, False)

    def _partial(self, local, input, target, failure, summed_divisor: bool, cdt: torch.dtype,
                 changed: bool = False, bad: torch.Tensor | None = None) -> torch.Tensor:
        """This worker's ``[sum of local, denominator, change flag, failure flag per worker]`` in ``cdt``.

        ``bad`` (compiled calls): the number of entries torch would refuse, counted in the graph
        (:meth:`_safe_values`); it fills this worker's failure slot.
        """
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

