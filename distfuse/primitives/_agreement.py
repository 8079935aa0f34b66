"""Agreement checks that cost nothing while every rank's inputs repeat.

The problem.  A collective is only right when every rank enters it with the same sizes
and dtype.  A rank whose block has another row count makes gloo abort the process
("Received data size doesn't match"); one whose dtype differs but has the same element
size (fp16 against bf16) makes the others compute with garbage.  Checking that by
gathering every rank's shape before every call costs a host-side collective per call
(about 4 ms on the loaded 2-core CI machine; on CUDA a host sync in every layer).

The protocol (one :class:`AgreementSite` per call site: a layer's data collective):

* Every rank keeps its **signature** of the last call at the site (local shape, dtype,
  device type, grad flags: whatever decides the collective's sizes and which adjoints
  run) and the **state** all ranks agreed on then (the block layout, the dtype).  The
  states are equal on every rank: they come from the same gathered metadata.
* **Steady state.**  A rank whose signature repeats runs the data collective with the
  agreed sizes and one extra element, a **flag** 0, appended to its message.  No
  metadata moves.
* **A change.**  A rank whose signature changed (or whose input fails a local check)
  cannot use the agreed sizes for its new data; it runs the same collective with the
  agreed sizes all the same, sending zeros and the flag 1.  Sizes match, so nothing
  aborts.
* **Everyone notices.**  Every rank reads the flags that arrived with the data (the
  all-gather returns each rank's, the reduce-scatter and the all-reduce their sum, in
  every rank's chunk).  If any is set, every rank drops the result and takes the **slow
  path** together: a host-side metadata gather, checks that every rank evaluates on the
  same records (so a disagreement raises the same named error on every rank), then the
  real collective with the new sizes, and the new state is remembered.  A legitimate
  change (every rank called with a new global shape, even one that leaves some ranks'
  blocks unchanged, such as an extent of 7 becoming 8 over two ranks) therefore works
  without any timeout, and a disagreement ends in an error on every rank.
* **First call.**  No state anywhere: every rank takes the slow path directly.

Cost.  Steady state: one flag element per message, which needs a staging copy of the
block (``gather_blocks`` / ``scatter_sum_blocks`` in :mod:`~distfuse.primitives._axes`),
and reading the flags: free for CPU tensors; for CUDA tensors a read of a few elements
that waits for the collective (see ``docs/reliability.md``).  A change costs the wasted
collective, the metadata gather and the real collective.

Assumption.  Sites are in lockstep: every rank makes the same calls at the same sites in
the same order (which every collective needs anyway), so every rank's site holds a state
or none at the same time.  An error raised by the slow path is raised on every rank, and
every rank forgets the site's state, so the next call starts afresh everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch

from distfuse.errors import DistfuseError, UnsupportedError, where
from distfuse.primitives._call_agreement import agree_on_call
from distfuse.primitives._common import collective_guard

__all__ = ["AgreementSite", "run_agreed", "capture_safe", "trusting", "trusted_state", "flag_round",
           "agreed_by_flag_round", "agree_on_local_checks"]

_TRUST = [0]


@contextlib.contextmanager
def capture_safe():
    """Within it, layers whose agreement is settled trust it: no flag is moved or read (no host read at all).

    For CUDA-graph capture (a host read of a device tensor is illegal while capturing; the
    layers also enter this mode by themselves while the current stream captures) and for
    any region whose shapes are known not to change.  A call whose signature differs from
    the agreed one raises :class:`~distfuse.errors.UnsupportedError` on the worker that
    made it (its peers are not told: inside a capture there is no way to tell them), so
    warm up with the shapes you capture, on every worker.
    """
    _TRUST[0] += 1
    try:
        yield
    finally:
        _TRUST[0] -= 1


def trusting() -> bool:
    """Whether agreed sites are trusted now: inside :func:`capture_safe` or while a CUDA stream captures."""
    if _TRUST[0]:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def trusted_state(site: AgreementSite, signature: Hashable, op: str) -> Any:
    """A settled ``site``'s state, trusted (no flag, no host read) while this worker's ``signature`` repeats.

    A different signature raises :class:`~distfuse.errors.UnsupportedError` on this worker
    only: inside a capture there is no way to tell its peers (see :func:`capture_safe`).
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

    __slots__ = ("op", "signature", "state", "calls", "slow_calls")

    def __init__(self, op: str):
        self.op = op
        self.signature: Hashable | None = None
        self.state: Any = None
        self.calls = 0
        self.slow_calls = 0

    @property
    def fresh(self) -> bool:
        """No agreed state: the next call takes the slow path on every rank."""
        return self.state is None

    def settle(self, signature: Hashable, state: Any) -> None:
        self.signature, self.state = signature, state

    def forget(self) -> None:
        """Drop the state; call it on every rank (the next call takes the slow path everywhere)."""
        self.signature = self.state = None

    def __deepcopy__(self, memo) -> AgreementSite:
        """A fresh site: a copied layer (``copy.deepcopy(model)``) agrees afresh on its first call, as a new one does.

        An agreed state is a promise between this site and its peers' sites; a copy's
        peers are the copies on the other ranks, which have agreed on nothing yet.
        """
        return AgreementSite(self.op)


def run_agreed(site: AgreementSite, signature: Hashable, locally_ok: bool,
               attempt: Callable[[bool], tuple[Any, bool]], slow: Callable[[], tuple[Any, Any]]) -> Any:
    """Run one call at ``site`` under the protocol of the module docstring.

    Args:
        signature: this rank's signature of the call (hashable).
        locally_ok: whether this rank's input passed its local checks; a rank whose input
            fails them flags a change, so that the slow path's checks raise on every rank.
        attempt: ``attempt(changed) -> (result, any_flag)`` runs the data collective with
            ``site.state``'s sizes: this rank's data and flag 0 when ``changed`` is False,
            zeros and flag 1 otherwise; ``any_flag`` says whether any rank's flag was set.
        slow: ``slow() -> (result, state)``: the metadata gather, the checks (raising on
            every rank alike) and the real collective.

    Returns the result of the attempt when no rank flagged, else the slow path's.
    """
    site.calls += 1
    if site.state is not None:
        changed = not (locally_ok and signature == site.signature)
        result, any_flag = attempt(changed)
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

    For sites with no data collective that reaches every worker (a pooling or upsampling
    layer's halo exchange is between neighbours only, and a plan that needs no halo sends
    nothing).  The meta group is distfuse's host-side (gloo) group, so the flag is a host
    integer: no device tensor is read, no CUDA sync.  It is a host collective, but a far
    cheaper one than the metadata all-gather it replaces: with 4 gloo ranks on the loaded
    2-core CI machine (medians of 200 calls) 0.47-0.6 ms, against 3.0-3.8 ms for the
    all-gather of 12 int64 records and 0.54-0.9 ms for two point-to-point rounds through
    a root (each worker's flag to it, their sum back).  A single worker returns its own flag.
    """
    if P.size == 1:
        return bool(flag)
    total = torch.full((1,), 1 if flag else 0, dtype=torch.int64)
    with collective_guard(op, "agreement flag all-reduce", P.ranks):
        torch.distributed.all_reduce(total, group=P.meta_group)
    return bool(total[0] != 0)


def agreed_by_flag_round(site: AgreementSite, P, op: str, signature: Hashable, locally_ok: bool,
                         slow: Callable[[], Any]) -> Any:
    """The agreed state of ``site`` for this call, learnt under the protocol with its flag in :func:`flag_round`.

    For sites whose state *is* the metadata (a global shape, the blocks' shapes and
    dtype) and whose data messages do not reach every worker of ``P``: the point-to-point
    primitives (``Broadcast``, ``SumReduce``, ``Repartition``, ``HaloExchange``) and the
    layers built on them.  Steady state: one flag all-reduce on ``P``'s host meta group
    before any data moves, so no message of stale size is ever sent.  A flag (a changed
    signature, or ``locally_ok`` False on some worker) sends every worker to ``slow()``:
    the metadata gather and the checks, which return the new state or raise the same
    error everywhere.  Inside :func:`capture_safe` a settled site is trusted while this
    worker's signature repeats (no flag round, no host read); a different signature there
    raises :class:`~distfuse.errors.UnsupportedError` on this worker.
    """
    if site.state is not None and trusting():
        return trusted_state(site, signature, op)

    def attempt(changed: bool):
        return site.state, flag_round(P, changed, op)

    def slow_path():
        state = slow()
        return state, state

    return run_agreed(site, signature, locally_ok, attempt, slow_path)


def agree_on_local_checks(P, op: str, checks: Callable[[], None]) -> None:
    """Run this worker's local ``checks``; if they fail on any worker of ``P``, raise one error on every worker.

    For the stateless functional forms (``broadcast(..., y_shape)``, ``repartition(...,
    global_shape)``, ...), whose checks are local: on their own, a check that fails on one
    worker raises there alone and leaves its peers in the exchange until the timeout.
    Here every worker runs its checks, catching a distfuse error instead of raising it,
    then all of them compare in one host round (:func:`~distfuse.primitives._call_agreement.agree_on_call`
    with nothing else to share).  No failure: return (the cost of the call, one host
    all-reduce of two integers).  A flag: the failing workers'
    messages are all-gathered (host objects, off the fast path) and every worker raises
    the same error, of the first failing worker's class, naming every failing worker and
    what it found.
    """
    agree_on_call(P, op, {}, checks)
