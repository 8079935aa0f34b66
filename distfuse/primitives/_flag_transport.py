"""Where the agreement flags travel: in the data message on CPU, on the host meta group on CUDA.

The agreement protocol (:mod:`distfuse.primitives._agreement`) needs, at every checked
call, one bit from every worker: "my input changed".  Two ways to move it:

* **In band** (CPU partitions).  The flag is one more element of the data collective's
  message and is read on the host once the collective returns.  For CPU tensors that
  read is free (gloo has finished when the call returns), and no extra round runs.
* **On the host** (CUDA and any other device partition).  Reading an element of a CUDA
  tensor waits for the collective, and with it for every kernel queued before it: one
  device synchronisation per checked call, which ends asynchronous execution (the host
  can no longer run ahead and queue the step).  So the flags take a one-integer
  all-reduce on the partition's host-side gloo ``meta_group`` *before* the data
  collective is queued: no device tensor is read, the device keeps running the work
  already queued while the host waits for the round, and the data collective then runs
  unstaged (no flag slot, no staging copy).  When a flag is set, no worker queues the data
  collective at all: every worker goes straight to the slow path.

The choice depends only on the partition's device type, which every worker of a
partition shares (the backend decides it), so every worker runs the same rounds.

Cost of the host round: one gloo all-reduce of one int64 per checked call, host latency
only (0.47 to 0.6 ms with 4 gloo ranks on the loaded 2-core CI machine, medians of 200;
not measured on a GPU node).  Inside :func:`~distfuse.primitives._agreement.capture_safe`
and CUDA-graph capture nothing runs at all (agreed sites are trusted).

:func:`flag_transport` forces one way, so the CPU tests can run the host way (the CUDA
default) and a CUDA user can ask for the in-band way (one round fewer, one sync more).
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
