"""Where the agreement flags travel: in the data message on CPU, on the host meta group on CUDA.

The agreement protocol (:mod:`distfuse.primitives._agreement`) needs one bit from every
worker at every checked call.  On a CPU partition it is one more element of the data
collective's message, read on the host once the collective returns: free, no extra
round.  On CUDA (any device partition) that read would wait for the collective and every
kernel queued before it, one device sync per call; so the flags take
:func:`~distfuse.primitives._agreement.flag_round` *before* the data collective is queued,
which then runs unflagged, or not at all when a flag is set.  The choice depends only on
the partition's device type, so every worker runs the same rounds.  :func:`flag_transport`
forces one way (the CPU tests run the host way; a CUDA user may trade one round for one sync).
"""

from __future__ import annotations

import contextlib

import torch

from distfuse.primitives._agreement import flag_round

__all__ = ["flags_on_host", "flag_transport", "any_flag_on_host"]

_MODES = ("auto", "inband", "host")
_MODE = ["auto"]


@contextlib.contextmanager
def flag_transport(mode: str):
    """Within it, agreement flags travel ``"inband"``, on the ``"host"``, or by device type (``"auto"``).

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


def flags_on_host(device: torch.device | str) -> bool:
    """Whether the flags of a partition on ``device`` take the host round (see the module docstring)."""
    mode = _MODE[0]
    if mode == "auto":
        return torch.device(device).type != "cpu"
    return mode == "host"


def any_flag_on_host(P, flag: bool, op: str) -> bool:
    """Whether any worker of ``P`` set its flag: :func:`~distfuse.primitives._agreement.flag_round`."""
    return flag_round(P, flag, op)
