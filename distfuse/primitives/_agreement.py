"""Agreement checks that cost nothing while every rank's inputs repeat.

The problem.  A collective is only right when every rank enters it with the same sizes
and dtype: another row count makes gloo abort the process ("Received data size doesn't
match"), and a dtype of the same element size (fp16 against bf16) makes the others
compute with garbage.  Gathering every rank's shape before every call would cost a host
collective per call (on CUDA a host sync in every layer).

The protocol, one :class:`AgreementSite` per call site (a layer's data collective).
Every rank keeps its **signature** of the last call at the site (local shape, dtype,
device type, grad flags: whatever decides the collective's sizes and which adjoints run)
and the **state** all ranks agreed on then (the block layout, the dtype; equal on every
rank, as it comes from the same gathered metadata).

* **Steady state.**  A rank whose signature repeats runs the data collective with the
  agreed sizes and one extra element, a **flag** 0.  No metadata moves.
* **A change.**  A rank whose signature changed (or whose input fails a local check)
  runs the same collective at the agreed sizes, sending zeros and the flag 1, so
  nothing aborts.  Every rank reads the flags that arrived with the data; if any is set,
  every rank drops the result and takes the **slow path** together: a host-side metadata
  gather, checks every rank evaluates on the same records (a disagreement raises the
  same named error everywhere), the real collective with the new sizes, and the new
  state is remembered.  A legitimate change (a new global shape) therefore just works.
* **First call.**  No state anywhere: every rank takes the slow path directly.

Steady-state cost: a flag element per message, which needs a staging copy of the block
(:mod:`~distfuse.primitives._axes_flagged`); on CUDA the flags take a host round instead
of a device read (:mod:`~distfuse.primitives._flag_transport`).  Sites must be in
lockstep (every rank makes the same calls in the same order, as any collective needs), so
every rank's site holds a state or none at the same time; a slow-path error is raised,
and the state forgotten, on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch

from distfuse.errors import DistfuseError, UnsupportedError, where
from distfuse.partition import check_current_world
from distfuse.primitives._call_agreement import agree_on_call
from distfuse.primitives._common import collective_guard
from distfuse.primitives._flag_board import flag_board
from distfuse.primitives._flag_deferred import DeferredFlags

__all__ = ["AgreementSite", "run_agreed", "capture_safe", "trusting", "trusted_state", "flag_round",
           "agreed_by_flag_round", "agree_on_local_checks"]

_TRUST = [0]


@contextlib.contextmanager
def capture_safe():
    """Within it, layers whose agreement is settled trust it: no flag is moved or read (no host read at all).

    For CUDA-graph capture (a host read of a device tensor is illegal there; the layers
    also trust by themselves while the current stream captures) and any region whose shapes
    do not change.  Warm up with the captured shapes on every worker: see :func:`trusted_state`.
    """
    _TRUST[0] += 1
    try:
        yield
    finally:
        _TRUST[0] -= 1


def trusting() -> bool:
    """Whether agreed sites are trusted now: inside :func:`capture_safe` or while a CUDA stream captures."""
    return _TRUST[0] > 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def trusted_state(site: AgreementSite, signature: Hashable, op: str) -> Any:
    """A settled ``site``'s state, trusted (no flag, no host read) while this worker's ``signature`` repeats.

    A different signature raises :class:`~distfuse.errors.UnsupportedError` on this worker
    only: inside a capture there is no way to tell its peers.
    """
    if signature != site.signature:
        raise UnsupportedError(f"{where(op)}: inside capture_safe() (or a CUDA-graph capture) a call must "
                               "repeat the inputs of the last eager call (shape, dtype, grad flags); warm up "
                               "with the captured shapes on every worker")
    site.calls += 1
    return site.state


class AgreementSite:
    """One call site's last signature (this rank's) and agreed state (the same on every rank).

    ``calls`` and ``slow_calls`` count the calls and those that took the slow path (the
    tests and the benchmarks read them to prove that steady state gathers nothing).
    """

    __slots__ = ("op", "signature", "state", "calls", "slow_calls", "kept", "deferred")

    def __init__(self, op: str):
        self.op = op
        self.deferred = DeferredFlags()  # its flags under the deferred transport (a site whose op has no context)
        self.signature: Hashable | None = None
        self.state: Any = None
        self.calls = 0
        self.slow_calls = 0
        self.kept: tuple | None = None  # the last settled (signature, state); forget() keeps it

    @property
    def fresh(self) -> bool:
        """No agreed state: the next call takes the slow path on every rank."""
        return self.state is None

    def settle(self, signature: Hashable, state: Any) -> None:
        """Agree on ``state``; one equal to the last settled is kept as the same objects (a compiled graph guards
        on them, and new objects after every gather would retrace it)."""
        if self.kept != (signature, state):
            self.kept = (signature, state)
        self.signature, self.state = self.kept

    def forget(self) -> None:
        """Drop the state; call it on every rank (the next call takes the slow path everywhere)."""
        self.signature = self.state = None

    def __deepcopy__(self, memo) -> AgreementSite:
        """A fresh site: a copied layer (``copy.deepcopy(model)``) agrees afresh, as the copies on the other ranks
        have agreed on nothing yet."""
        return AgreementSite(self.op)


def run_agreed(site: AgreementSite, signature: Hashable, locally_ok: bool,
               attempt: Callable[[bool], tuple[Any, bool]] | None, slow: Callable[[], tuple[Any, Any]]) -> Any:
    """Run one call at ``site`` under the protocol of the module docstring.

    Args:
        signature: this rank's signature of the call (hashable).
        locally_ok: whether this rank's input passed its local checks; a rank whose input
            fails them flags a change, so that the slow path's checks raise on every rank.
        attempt: ``attempt(changed) -> (result, any_flag)`` runs the data collective with
            ``site.state``'s sizes: this rank's data and flag 0 when ``changed`` is False,
            zeros and flag 1 otherwise; ``any_flag`` says whether any rank's flag was set.
            None where the op checks the ranks' agreement itself (a fused op's claim):
            ``slow()`` then runs every call and, moving no metadata, is not counted in ``slow_calls``.
        slow: ``slow() -> (result, state)``: the metadata gather, the checks (raising on
            every rank alike) and the real collective.

    Returns the result of the attempt when no rank flagged, else the slow path's.
    """
    site.calls += 1
    if attempt is not None:
        if site.state is not None:
            result, any_flag = attempt(not (locally_ok and signature == site.signature))
            if not any_flag:
                return result
        site.slow_calls += 1
    try:
        result, state = slow()
    except DistfuseError:
        site.forget()
        raise
    site.settle(signature, state)
    return result


def flag_round(P, flag: bool, op: str) -> bool:
    """Whether any worker of partition ``P`` set its agreement flag: a one-element all-reduce on ``P``'s meta group.

    For sites with no data collective that reaches every worker (a pooling layer's halo
    exchange runs between neighbours only, and a plan without halos sends nothing).  The
    meta group is host-side (gloo): no device tensor is read, and the round is far cheaper
    than the metadata all-gather it replaces (``docs/benchmarks.md``).  On one host it is a
    shared-memory board with no message (:mod:`distfuse.primitives._flag_board`).
    """
    if P.size == 1:
        return bool(flag)
    board = flag_board(P, op)
    if board is not None:
        return board.round(flag, op)
    total = torch.full((1,), 1 if flag else 0, dtype=torch.int64)
    with collective_guard(op, "agreement flag all-reduce", P.ranks):
        torch.distributed.all_reduce(total, group=P.meta_group)
    return bool(total[0] != 0)


def agreed_by_flag_round(site: AgreementSite, P, op: str, signature: Hashable, locally_ok: bool,
                         slow: Callable[[], Any]) -> Any:
    """The agreed state of ``site`` for this call, learnt under the protocol with its flag in :func:`flag_round`.

    For sites whose state *is* the metadata (a global shape, the blocks' shapes and dtype)
    and whose data messages do not reach every worker of ``P`` (the point-to-point
    primitives and the layers built on them).  One flag round before any data moves, so no
    message of stale size is ever sent; a flag sends every worker to ``slow()`` (the metadata
    gather and the checks: the new state, or the same error everywhere).  Inside
    :func:`capture_safe`: :func:`trusted_state`.
    """
    check_current_world(P, op)
    if site.state is not None and trusting():
        return trusted_state(site, signature, op)
    run_agreed(site, signature, locally_ok, lambda changed: (None, flag_round(P, changed, op)), lambda: (None, slow()))
    return site.state


def agree_on_local_checks(P, op: str, checks: Callable[[], None]) -> None:
    """Run this worker's local ``checks``; if they fail on any worker of ``P``, raise one error on every worker.

    For the stateless functional forms (``broadcast(..., y_shape)``, ...), whose failing check would otherwise
    leave the peers in the exchange until the timeout: :func:`~distfuse.primitives._call_agreement.agree_on_call`
    with nothing else to share.
    """
    agree_on_call(P, op, {}, checks)
