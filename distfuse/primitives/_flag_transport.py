"""Where the agreement flags travel: in the data message on CPU; on CUDA read one call later, or on the host.

The agreement protocol (:mod:`distfuse.primitives._agreement`) needs one bit from every
worker at every checked call.  On a CPU partition it is one more element of the data
collective's message, read on the host once the collective returns: free, no extra
round.  On CUDA (any device partition) that read would wait for the collective and every
kernel queued before it, one device sync per call; so the flags take
:func:`~distfuse.primitives._agreement.flag_round` *before* the data collective is queued,
which then runs unflagged, or not at all when a flag is set.  The sites whose data
collective reaches every worker (the all-gather, reduce-scatter and all-reduce modules and
the linears built on them), and every other layer (each runs a disagreeing call on a
stand-in), instead take the **deferred** transport on CUDA
(:mod:`~distfuse.primitives._flag_deferred`): the flags are all-reduced on the device and
read one call later, so the steady state has no host round and no host read; a call
whose workers disagree returns NaN and every worker raises at the next call.

The choice depends only on the partition's device type and the mode, so every worker
runs the same rounds.  ``DISTFUSE_FLAG_TRANSPORT`` (``auto``, ``inband``, ``host``,
``deferred``; set alike on every worker) or :func:`flag_transport` forces one way (the
CPU tests run the host and deferred ways; ``host`` serves local shapes that change on
some workers only, which the deferred transport refuses, at one host round per call).
"""

from __future__ import annotations

import contextlib
import os

import torch

from distfuse.errors import ConfigError
from distfuse.primitives._agreement import flag_round

__all__ = ["flags_on_host", "flags_deferred", "flag_transport", "any_flag_on_host", "TRANSPORT_VARIABLE"]

TRANSPORT_VARIABLE = "DISTFUSE_FLAG_TRANSPORT"
_MODES = ("auto", "inband", "host", "deferred")
_MODE: list = [None]  # the forced mode (flag_transport), or None: the environment's


@contextlib.contextmanager
def flag_transport(mode: str):
    """Within it, agreement flags travel ``"inband"``, on the ``"host"``, ``"deferred"``, or by device type
    (``"auto"``).

    Every worker must use the same mode at the same calls (a worker that sends its flag
    in band while a peer waits for it on the host meets the ``DISTFUSE_TIMEOUT`` error).
    """
    if mode not in _MODES:
        raise ValueError(f"flag_transport: mode must be one of {_MODES}, got {mode!r}")
    old = _MODE[0]
    _MODE[0] = mode
    try:
        yield
    finally:
        _MODE[0] = old


def _transport(device: torch.device | str) -> str:
    """``"inband"``, ``"host"`` or ``"deferred"``: the way of a partition on ``device`` (the module docstring)."""
    mode = _MODE[0]
    if mode is None:
        mode = os.environ.get(TRANSPORT_VARIABLE, "auto").strip().lower() or "auto"
        if mode not in _MODES:
            raise ConfigError(f"{TRANSPORT_VARIABLE}={mode!r}: expected one of {_MODES}")
    if mode == "auto":
        return "inband" if torch.device(device).type == "cpu" else "deferred"
    return mode


def flags_on_host(device: torch.device | str) -> bool:
    """Whether the flags of a site without a deferred form, on ``device``, take the host round (not in band)."""
    return _transport(device) != "inband"


def flags_deferred(device: torch.device | str) -> bool:
    """Whether the flags of a site whose collective reaches every worker, on ``device``, are read one call later."""
    return _transport(device) == "deferred"


def any_flag_on_host(P, flag: bool, op: str) -> bool:
    """Whether any worker of ``P`` set its flag: :func:`~distfuse.primitives._agreement.flag_round`."""
    return flag_round(P, flag, op)
