"""Agreement flags read one call later: the steady state of a CUDA collective takes no host round and no host read.

The agreement protocol (:mod:`distfuse.primitives._agreement`) needs every worker's flag at
every checked call.  Read at once, a device flag synchronises the host with the device;
taken on the host first (:func:`~distfuse.primitives._agreement.flag_round`), it is a
barrier between the workers' CPUs.  The **deferred** transport does neither, for the sites
whose data collective reaches every worker of its sub-grid (the all-gather, reduce-scatter
and all-reduce modules, and the all-gather and reduce-scatter linears built on them) and
for every other layer, whose round spans its partition and which runs a disagreeing call
on a stand-in (``AgreementSession.agree(..., deferrable=True)``, ``AgreementSession.stand_in``)::

    call k, every worker    read the flag sum of call k-1 at this context (its copy is
                            long done: no wait in practice); if it is set, every worker
                            raises DisagreedCallError here and forgets the agreement
    worker unchanged        device all-reduce of its flag 0 on the data group, copied to
                            pinned host memory behind an event; the data collective with the
                            agreed sizes; returns at once
    worker changed          flag 1, and it reads the sum now (a sync, on a change only):
        every worker flagged    every worker knows: the slow path together (a legitimate
                                change of global shape just works, as with the other transports)
        some did not            they have gone on, so this worker keeps in step: its
                                stand-in of the agreed sizes is NaN (and NaN flows back to its
                                inputs' gradients), and it warns; every worker's output of
                                call k holds NaN, and every worker raises at call k+1

Every worker reads the same sums at the same calls, so all raise together, and every
collective of call k (forward and backward) runs with the agreed sizes on every worker:
nothing hangs.  The price is a late error: outputs of a call that disagreed are NaN (at
least the disagreeing worker's block), and an optimizer step taken before the next call
of the layer applies NaN.  :func:`check_deferred_flags` (called by
:func:`distfuse.check_pending`) raises any pending disagreement at once:
call it before ``optimizer.step()`` to keep a step from applying one.  A change of local
shape on some workers only (a new global shape that leaves some blocks the same) is
therefore refused under this transport; ``DISTFUSE_FLAG_TRANSPORT=host`` serves it, at one
host round per call.

Cost per steady call: one int32 all-reduce on the data group, a 4-byte copy to pinned
memory and an event (no kernel to fill the flag while the last sum was 0).
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from distfuse.errors import DisagreedCallError, where
from distfuse.primitives._common import collective_guard

__all__ = ["DeferredFlags", "check_deferred_flags", "poisoned_stand_in"]

#: Records holding a sum not yet read (weak: a freed layer's record drops out).
_PENDING: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=_PENDING.clear)  # a forked child ran none of its parent's calls
#: Creation order of the records: layers are made in the same order on every worker, so this orders them alike.
_ORDER = itertools.count()


class DeferredFlags:
    """The flag sum of one context's last call, on its way to the host; :meth:`round` is one call's flag round.

    A copy (``copy.deepcopy`` of its layer, or a pickle) starts with nothing pending: the
    copies on the other workers have made no call yet either.
    """

    __slots__ = ("_device", "_host", "_event", "_pending", "_zero", "_order", "__weakref__")

    def __init__(self):
        self._order = next(_ORDER)
        self._device: torch.Tensor | None = None  # the all-reduced int32 flag, reused from call to call
        self._host: torch.Tensor | None = None  # its pinned host copy (the tensor itself on CPU)
        self._event = None  # recorded after the copy (CUDA)
        self._pending: tuple | None = None  # (op, on_flag, known sum or None) of the last call, not read yet
        self._zero = False  # the device flag holds 0 (the last sum read was 0): no fill needed

    def __reduce__(self):
        return DeferredFlags, ()

    def round(self, P, flag: bool, op: str, on_flag: Callable[[], None] | None) -> bool:
        """Raise for the previous call if it disagreed; post this call's ``flag``.

        Returns True when every worker of ``P`` flagged (every worker then takes the slow
        path); False otherwise: the caller runs the data collective with the agreed sizes,
        fed by a :func:`poisoned_stand_in` where ``flag`` is set.  Collective over ``P``.
        """
        self.settle_previous()
        if P.size == 1:  # one worker: nothing to agree with, nothing to move
            return bool(flag)
        device = torch.device(P.device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device; tensors say cuda:i
            device = torch.device("cuda", torch.cuda.current_device())
        if self._device is None or self._device.device != device:
            cuda = device.type == "cuda"
            self._device = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else self._device
            self._event = torch.cuda.Event() if cuda else None
            self._zero = True
        if flag or not self._zero:
            self._device.fill_(1 if flag else 0)
        with collective_guard(op, "agreement flag all-reduce (deferred)", P.ranks):
            dist.all_reduce(self._device, group=P.group)
        self._zero = False
        if flag:  # a changed call: read now (a sync, on a change only)
            total = int(self._device.item())
            if total == P.size:
                return True
            warnings.warn(f"{where(op)}: this worker's input differs from the agreed one while {P.size - total} "
                          f"of the {P.size} workers' inputs did not; under the deferred agreement transport this call "
                          "returns NaN on every worker, and every worker raises at its next call of the layer "
                          "(DISTFUSE_FLAG_TRANSPORT=host serves changes on some workers only)", stacklevel=2)
            self._pending = (op, on_flag, total)
        else:
            if self._event is not None:
                self._host.copy_(self._device, non_blocking=True)
                self._event.record()
            self._pending = (op, on_flag, None)
        _PENDING.add(self)
        return False

    def settle_previous(self) -> None:
        """Read the last call's sum (waiting for its copy if the device is behind); raise on every worker if set."""
        if self._pending is None:
            return
        op, on_flag, total = self._pending
        self._pending = None
        _PENDING.discard(self)
        if total is None:
            if self._event is not None:
                self._event.synchronize()
            total = int(self._host[0])
        if total == 0:
            self._zero = True
            return
        if on_flag is not None:
            on_flag()
        raise DisagreedCallError(
            f"{where(op)}: the previous call of this layer disagreed across its workers ({total} flagged a change "
            "of shape, dtype or grad flags, or failed a local check, while the others did not); under the "
            "deferred agreement transport its outputs were NaN on every worker, and any optimizer step taken "
            "since applied NaN. Every worker raises here; the next call agrees afresh (the same inputs raise "
            "their named error then). Call distfuse.check_pending() before optimizer.step() to stop such a "
            "step, or set DISTFUSE_FLAG_TRANSPORT=host where local shapes change on some workers only")


def check_deferred_flags() -> None:
    """Read every pending deferred flag now (waiting for the device); raise the first disagreement by name.

    A sync point: call it on every worker at the same place.  Every pending sum is read
    (and cleared) before anything is raised, and the first in creation order is raised, so
    the workers of a layer raise together here and none is left to raise later on some only.
    Cheap when nothing is pending.
    """
    first = None
    for record in sorted(_PENDING, key=lambda r: r._order):
        try:
            record.settle_previous()
        except DisagreedCallError as exc:
            first = first or exc
    if first is not None:
        raise first


class _PoisonedStandIn(torch.autograd.Function):
    """NaN of a given shape standing in for ``sources`` (any tensors); its backward gives each source NaN."""

    @staticmethod
    def forward(ctx, shape, dtype, device, *sources):
        ctx.specs = [(s.shape, s.dtype, s.device) if isinstance(s, torch.Tensor) else None for s in sources]
        return _nan(shape, dtype, device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *[_nan(*spec) if spec is not None and need else None
                                    for spec, need in zip(ctx.specs, ctx.needs_input_grad[3:], strict=True)])


def _nan(shape, dtype, device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.zeros(tuple(shape), dtype=dtype, device=device)


def poisoned_stand_in(shape, dtype: torch.dtype, device, *sources) -> torch.Tensor:
    """What a changed worker sends in place of its input: NaN (zeros for integers) of the agreed ``shape``.

    Shapes: the result is ``shape``; in the backward every source that needs a gradient
    gets NaN of its own shape.  Why: under the deferred transport the worker's call goes
    on with its peers' (:class:`DeferredFlags`), so its adjoint collectives run as theirs
    do, and the gradients it cannot compute are marked, not faked.  Under the other
    transports the call's result is dropped before anything reads it.
    """
    return _PoisonedStandIn.apply(tuple(shape), dtype, device, *sources)
