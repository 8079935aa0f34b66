"""What the GEMM fusions' agreement check needs before a payload moves: a workspace too small on some ranks only,
and a rank whose own checks refused its input.

The signature words (:mod:`distfuse.kernels.signature`) catch ranks that enter an op with
different shapes, but only once every rank is inside the op's claim.  Two disagreements
stop one rank short of it, and its peers would wait in the claim until the timeout:

* **The cached workspace is too small for this rank's call.**  Growing it is collective,
  so the rank first claims the cached workspace and publishes
  :data:`~distfuse.kernels.signature.GROW` (:func:`agreed_workspace`): one extra claim per growth.
* **A local check refused this rank's input** (rows that do not fit its block of ``n``, a
  dtype the others do not share).  :func:`refusal` makes the rank take part in the op's
  first claim with :data:`~distfuse.kernels.signature.REFUSED` and no payload
  (:func:`refuse`), then raise its own error; every peer raises a ShapeError pointing at it.
  A caller whose own checks failed before the op calls it anyway under :func:`refusing`.

Both replay exactly the host steps a peer takes before that claim (the availability
verdict, the ``DISTFUSE_DEBUG=1`` metadata check, the workspace set-up), so the two sides
never sit in different collectives; the steady state pays nothing.  With
``DISTFUSE_DEBUG=1`` the metadata check already makes every rank raise, and no claim runs.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from distfuse import debug
from distfuse.errors import CollectiveMismatchError, ShapeError, UnsupportedError
from distfuse.fused.symmetric import cached_workspace, get_workspace
from distfuse.fused.symmetric_availability import symmetric_memory_available
from distfuse.kernels.signature import GROW, REFUSED, abstain
from distfuse.partition import Partition

__all__ = ["agreed_workspace", "refuse", "refusal", "refusing"]

# The error a caller's own checks raised, to be refused by the next fused op's refusal() (see refusing()).
_PENDING: ContextVar[Exception | None] = ContextVar("distfuse_pending_refusal", default=None)


def agreed_workspace(P: Partition, device, op: str, nbytes: int, layout: str):
    """The workspace of ``P`` for a phase that needs ``nbytes``; grown (collectively) only where every rank asks.

    In a correct program every rank asks for the same bytes: where every rank published GROW,
    they grow together and run the op; where a peer's call fit the cached workspace, that peer
    saw GROW and raises, and so does this rank (:class:`~distfuse.errors.ShapeError`).
    ``layout`` is the phase consumer's flag layout (``SCATTER_FLAGS`` / ``GATHER_FLAGS``
    of :mod:`distfuse.kernels.signature`), on which this rank waits for the peers' flags.
    """
    cached = cached_workspace(P, device)
    if P.size > 1 and cached is not None and cached.nbytes < nbytes and not debug.enabled():
        # (DISTFUSE_DEBUG=1: get_workspace's own metadata check makes every rank raise instead.)
        what = (f"this rank's call needs {nbytes} workspace bytes, the cached workspace holds {cached.nbytes}; "
                "the peers' calls fit it")
        with cached.in_flight(f"{op}.grow"):
            abstain(cached, P.rank, P.size, GROW, layout, op=op, what=what, raise_on_mismatch=True)
    return get_workspace(P, nbytes, device)


def refuse(error: Exception, P: Partition, device, op: str, layout: str, nbytes: int = 0):
    """Raise ``error`` (a local check's) after taking part in the op's first claim with no payload.

    ``nbytes``: the workspace the op would have asked for, used only where none is cached
    (the set-up is collective; the ranks take the largest request).  Where the fused path
    is unavailable on ``P`` every rank raises on its own anyway, so ``error`` is raised at once.
    """
    # The availability verdict only where the peers ask require_available (collective once).
    if not P.active or P.size == 1 or not symmetric_memory_available(P, device)[0]:
        raise error
    if debug.enabled():
        # The peers' metadata check differs from this record: every rank raises there (its own error here).
        with contextlib.suppress(CollectiveMismatchError):
            debug.check_agreement(op, P.ranks, P.meta_group, same=dict(refused=f"{type(error).__name__}: {error}"))
        raise error
    ws = cached_workspace(P, device) or get_workspace(P, nbytes, device)
    with ws.in_flight(op):
        abstain(ws, P.rank, P.size, REFUSED, layout, op=op, what="this rank refused its input",
                raise_on_mismatch=False)
        raise error  # inside the claim: the workspace is marked broken on this rank too, as on its peers


@contextlib.contextmanager
def refusal(op: str, P: Partition, x, layout: str, nbytes=lambda: 0):
    """Run an op's local checks; a ShapeError or UnsupportedError they raise reaches every rank (:func:`refuse`).

    Wrap the checks that precede the op's ``require_available`` (no other host collective
    may follow them before the first claim; one before them is fine).  ``x`` is the op's
    input (its device, where it is a tensor on ``P``'s device type); ``nbytes()`` estimates
    the op's workspace request from the possibly bad arguments (0 where it cannot).
    """
    pending = _PENDING.get()
    try:
        if pending is not None:
            _PENDING.set(None)  # one refusal per refusing() block
            raise pending
        yield
    except (ShapeError, UnsupportedError) as exc:
        try:
            guess = int(nbytes())
        except Exception:  # noqa: BLE001 - bad arguments may not even give a size; 0 asks for nothing more
            guess = 0
        ok = isinstance(x, torch.Tensor) and x.device.type == P.device.type
        refuse(exc, P, x.device if ok else P.device, op, layout, guess)


@contextlib.contextmanager
def refusing(error: Exception | None):
    """Let the fused op called inside refuse with ``error``, a check that failed before the op (None: no effect).

    The op is entered with the caller's (possibly bad) arguments; its :func:`refusal`
    raises ``error`` in place of its own checks, so the peers learn it at the op's first
    claim.  Use it where the peers take the same fused op (the same dispatch verdict); the
    error must be a ShapeError or UnsupportedError.  A block that calls no fused op raises
    ``error`` on leaving (it must not pass silently).
    """
    if error is None:
        yield
        return
    token = _PENDING.set(error)
    try:
        yield
        if _PENDING.get() is error:  # no fused op refused it: raise it here, on this rank at least
            raise error
    finally:
        _PENDING.reset(token)
