"""One agreement session per layer: every call agrees once, in one of three modes (settle, trust, replay).

A layer keeps one :class:`AgreementSession` and calls :meth:`~AgreementSession.agree` once,
at the top of its one forward, whatever runs it, so that every worker knows its peers made
the same call (local shapes that tile one global shape, one dtype, the same grad flags) or
raises the same error, with no metadata collective in the steady state (the protocol of
:mod:`distfuse.primitives._agreement`).  The session picks the mode from the context::

    mode    when                         what runs                                       host work per call
    ------  ---------------------------  ----------------------------------------------  -------------------
    settle  eager                        the flag round (``flag_round``: one int64       one host all-reduce;
                                         all-reduced on P's meta group); on any flag,    the metadata gather
                                         or on the first call, ``gather()``: the         only on a change
                                         metadata gather and its checks, raising the
                                         same error on every worker
    trust   eager inside capture_safe()  nothing: the settled state while this worker's  none
            or a CUDA-graph capture      signature repeats; another signature raises
                                         UnsupportedError on this worker
    replay  inside torch.compile         the state settled by the last eager call, and   the flag round, as the
                                         the flag round as the graph op                  graph op
                                         ``distfuse::flag_check`` (raises the same
                                         ShapeError on every worker when any flagged)

On CUDA a layer that can run a disagreeing call on a stand-in of its agreed inputs
(``agree(..., deferrable=True)``: every layer) takes the deferred transport in settle mode
instead of the host round
(:mod:`~distfuse.primitives._flag_deferred`: a device all-reduce read at the next call).

Replay keeps a compiled graph free of metadata: the compiler guards on what the signature
reads (shapes, dtype, grad flags, autocast), so a changed call retraces, traces its flag
set, and every worker raises after the round; one eager call then settles afresh.  A
replay before any eager call is refused on every worker.  What else a forward derives per
call and cannot derive in a graph (a path choice, a plan walk) goes through
:meth:`~AgreementSession.remember`.  :meth:`~AgreementSession.agree_in` is the session of
a layer whose flag rides in a data op of its own (the all-gather and reduce-scatter
linears, the losses' reduction, the transposed convolution's parameter round).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.partition import check_current_world
from distfuse.primitives._agreement import AgreementSite, flag_round, run_agreed, trusted_state, trusting
from distfuse.primitives._flag_deferred import poisoned_stand_in
from distfuse.primitives._flag_transport import flags_deferred
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import ordered

__all__ = ["SETTLE", "TRUST", "REPLAY", "AgreementSession", "FlagRound", "FlaggedCallError", "flag_check",
           "needs_eager_error", "flagged_error"]

SETTLE, TRUST, REPLAY = "settle", "trust", "replay"


def needs_eager_error(op: str) -> UnsupportedError:
    """The refusal of a compiled call made before any eager call settled the layer's agreement."""
    return UnsupportedError(f"{where(op)}: a compiled call needs the metadata the layer agrees on in eager mode: "
                            "call the layer once eagerly (every worker, same shapes and grad settings) before the "
                            "compiled region")


class FlaggedCallError(ShapeError):
    """:func:`flagged_error`'s class: a data op whose flag was set on some worker raises it on every worker
    (:meth:`AgreementSession.agree_in`; a settled call catches it and gathers the metadata instead)."""


def flagged_error(op: str) -> ShapeError:
    """What every worker raises when some worker's compiled call differs from the one agreed eagerly."""
    return FlaggedCallError(f"{where(op)}: a worker called this compiled layer with inputs (shape, dtype, grad flags, "
                      "autocast) other than those agreed in its last eager call; every worker raises here. Call it "
                      "once eagerly with the new inputs (every worker), then the compiled region again")


class FlagRound(HandleOwner):
    """The context of ``distfuse::flag_check``: the layer's name, its partition, and ``on_flag``, run on every
    worker when some worker flagged (the layer forgets its agreement, so that the next eager call settles afresh).
    ``handle`` names it in graphs."""

    def __init__(self, op: str, P, on_flag: Callable[[], None]):
        self.op, self.P, self.on_flag = op, P, on_flag
        self.handle = new_handle(self)


@torch.library.custom_op("distfuse::flag_check", mutates_args=())
def flag_check(x: torch.Tensor, handle: int, changed: bool) -> None:
    """Replay's flag round: every worker's flag summed by a host all-reduce; raises on every worker when any is set.

    ``x`` is any tensor of the call (it carries the device for dispatch); ``changed`` is a
    constant of the graph (the compiler guards on the signature, so a changed call
    retraces with it set).  No device read, no gradient.  An ``ORDERED`` effect like the
    data ops, so it keeps its place and stays in the graph although nothing uses its result.
    """
    ctx: FlagRound = lookup(handle)
    if flag_round(ctx.P, changed, ctx.op):
        ctx.on_flag()
        raise flagged_error(ctx.op)


@flag_check.register_fake
def _(x, handle, changed):
    return None


ordered(flag_check)


class AgreementSession:
    """A layer's agreement over partition ``P`` in the three modes of the module docstring.

    ``site``: its :class:`~distfuse.primitives._agreement.AgreementSite`; ``last_mode``: the
    mode of the last call.  Made at construction, in the same order on every worker (its
    flag op's handle must be the same everywhere).
    """

    def __init__(self, op: str, P):
        self.op, self.P = op, P
        self.site = AgreementSite(op)
        self.flag = FlagRound(op, P, self.forget)
        self.last_mode: str | None = None
        self.poisoned = False  # the last call ran on a NaN stand-in (``agree(..., deferrable=True)``)
        self._remembered: dict = {}

    def forget(self) -> None:
        """Drop the settled state, so that the next call gathers again (call it on every worker)."""
        self.site.forget()

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy of its layer) agrees afresh, as its site does: nothing an eager call settled or
        # derived follows it.
        return {**self.__dict__, "last_mode": None, "_remembered": {}}

    @property
    def may_read_host(self) -> bool:
        """Whether the call in progress may read a device value on the host (settle only; ask after :meth:`agree`)."""
        return self.last_mode == SETTLE

    def agree(self, x: torch.Tensor, signature: Hashable, locally_ok: bool, gather: Callable[[], Any], *,
              needs_eager: Callable[[Any], bool] | None = None, deferrable: bool = False) -> Any:
        """The state every worker agreed on for this call; None in replay when this worker's call flagged.

        Args:
            x: the call's input (replay hands it to ``flag_check``).
            signature: this worker's signature of the call (hashable): what decides the state.
            locally_ok: whether the input passed this worker's local checks; a failure
                sets the flag, so that ``gather()``'s checks raise on every worker.
            gather: the metadata gather and its checks; returns the new state.
            needs_eager: ``needs_eager(state)``, replay only: the call needs what only an
                eager call can do (promote an input that some peer's adjoint needs), so it flags.
            deferrable: the layer can run a call on a stand-in of the agreed shape: under the
                deferred transport (:mod:`~distfuse.primitives._flag_deferred`) the flag round
                is a device all-reduce read at the next call, and where this worker's call
                changed while some peers' did not, :attr:`poisoned` is set after the call
                returns the settled state: the layer must then run the call on
                :meth:`stand_in` inputs, as its peers expect.

        A None return means the graph ends here on this worker: ``flag_check`` raises on
        every worker when it runs, so nothing after it would.
        """
        mode, site = self.begin(), self.site
        if mode == REPLAY:
            state, changed = self.replayed(signature, locally_ok, needs_eager)
            flag_check(x, self.flag.handle, changed)
            return None if changed else state
        if mode == TRUST:
            return trusted_state(site, signature, self.op)

        def attempt(changed: bool) -> tuple[None, bool]:
            if not (deferrable and flags_deferred(self.P.device)):
                return None, flag_round(self.P, changed, self.op)
            any_flag = site.deferred.round(self.P, changed, self.op, self.forget)
            self.poisoned = changed and not any_flag
            return None, any_flag

        run_agreed(site, signature, locally_ok, attempt, lambda: (None, gather()))
        return site.state  # the kept objects (AgreementSite.settle), not merely equal ones

    def stand_in(self, t, at: int = 0, dtype_at: int | None = None) -> torch.Tensor:
        """NaN (zeros for integers) of the shape at ``signature[at]`` and the dtype at ``signature[dtype_at]``
        (default ``at + 1``) of this worker's last settled call, standing in for ``t`` (any object; a tensor gets
        NaN gradients): a :attr:`poisoned` call's input
        (:func:`~distfuse.primitives._flag_deferred.poisoned_stand_in`)."""
        signature = self.site.signature
        dtype = signature[at + 1 if dtype_at is None else dtype_at]
        return poisoned_stand_in(signature[at], dtype, self.P.device, t)

    def replayed(self, signature: Hashable, locally_ok: bool,
                 needs_eager: Callable[[Any], bool] | None = None) -> tuple[Any, bool]:
        """Replay without the flag round: ``(settled state, changed)`` (for layers whose flag rides a data op)."""
        state = self.site.state
        if state is None:
            raise needs_eager_error(self.op)
        changed = not locally_ok or signature != self.site.signature or (
            needs_eager is not None and needs_eager(state))
        return state, changed

    def remember(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()`` in settled and trusted calls (remembered under ``key``); in replay what the last eager call
        with ``key`` computed."""
        if self.last_mode == REPLAY:
            if key not in self._remembered:
                raise needs_eager_error(self.op)
            return self._remembered[key]
        value = self._remembered[key] = compute()
        return value

    def begin(self) -> str:
        """The mode of the call starting now (kept as :attr:`last_mode`, which :meth:`remember` reads): for a
        layer that derives what it runs (its path) before the op that agrees."""
        self.poisoned = False  # (every mode: a trusted or replayed call after a poisoned one is not poisoned)
        if torch.compiler.is_compiling():
            self.last_mode = REPLAY
            return self.last_mode
        check_current_world(self.P, self.op)  # a layer of a destroyed world raises here, on each rank calling it
        if self.site.state is not None and trusting():
            self.last_mode = TRUST
        else:
            self.last_mode = SETTLE
        return self.last_mode

    def agree_in(self, signature: Hashable, locally_ok: bool, run: Callable[[Any, int], Any],
                 gather: Callable[[], tuple[Any, Any]], *, checked_by_op: bool = False,
                 deferrable: bool = False) -> Any:
        """The result of a call whose flag rides in its own data op, which reaches every worker of the session.

        Args:
            signature, locally_ok: as for :meth:`agree`.
            run: ``run(state, flag)`` runs the op with the settled ``state``; ``flag`` is -1
                (trust: no flag moves), or this worker's flag 0 / 1 (a worker whose call
                changed sends zeros of the state's sizes and 1).  The op raises
                :class:`FlaggedCallError` on every worker when any flag is set, and calls
                :meth:`forget` first (a replayed call: the next eager call agrees afresh).
            gather: ``gather() -> (result, state)``: the metadata gathered and checked (the
                same error on every worker), then the op with the new state.
            checked_by_op: the op checks the workers' agreement itself (a fused op's claim
                compares their sizes and refuses a failed local check): a settled call runs
                ``gather()`` (no metadata to move) every time, and a replayed call's
                ``run`` places its flag.
            deferrable: as for :meth:`agree`: under the deferred transport a settled call's flag
                takes the device round instead, ``run`` gets -1, and :attr:`poisoned` tells the
                layer to put :meth:`stand_in` inputs where its own data enters.

        Settle: :func:`~distfuse.primitives._agreement.run_agreed` over ``run`` and ``gather``;
        replay: ``flag`` is a constant of the graph.
        """
        mode, site = self.begin(), self.site
        if mode == REPLAY:
            state, changed = self.replayed(signature, locally_ok)
            return run(state, int(changed))
        if mode == TRUST:
            return run(trusted_state(site, signature, self.op), -1)

        def attempt(changed: bool) -> tuple[Any, bool]:
            if deferrable and flags_deferred(self.P.device):
                if site.deferred.round(self.P, changed, self.op, self.forget):
                    return None, True  # every worker flagged: the slow path together
                self.poisoned = changed
                return run(site.state, -1), False
            try:
                return run(site.state, int(changed)), False
            except FlaggedCallError:
                return None, True

        return run_agreed(site, signature, locally_ok, None if checked_by_op else attempt, gather)
