"""One host round that proves every worker made the same call: for the stateless functional forms.

The modules (``AllGather``, ``ReduceScatter``, ...) keep an agreement site and check for
free while their inputs repeat (:mod:`distfuse.primitives._agreement`).  A functional form
(``all_gather(x, P, out_shape)``, ...) keeps no state, so with ``agree=True`` it runs this
check on every call: every worker hashes what all must share (the full shape, the dtype,
...) and the outcome of its local checks into a 63-bit digest, and the workers all-reduce
``[digest, -digest]`` with MAX on the partition's host-side gloo meta group (the maximum
and minus the minimum in one round of two int64, no device read).  Equal: every worker
made the same call (up to a hash collision, 2^-63).  Different: the records are
all-gathered (host objects, off the fast path) and every worker raises the same error
before any worker enters the data collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from distfuse import errors
from distfuse.errors import DistfuseError, ShapeError, where
from distfuse.primitives._common import collective_guard, local_error

__all__ = ["agree_on_call", "agree_on_tensor"]


def _digest(record: dict) -> int:
    text = repr(sorted(record.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1  # 63 bits, non-negative


def agree_on_call(P, op: str, same: dict, checks: Callable[[], None] | None = None) -> None:
    """Raise one error on every worker of ``P`` unless every worker passes the same ``same`` and its ``checks``.

    Args:
        same: what every worker must share (values with a stable ``repr``: tuples, dtypes);
            ``{}`` checks only that the local checks pass everywhere.  A difference raises
            :class:`~distfuse.errors.ShapeError` naming each worker's values.
        checks: this worker's local checks (raise a distfuse error); run before the round.
            A failure on any worker raises, on every worker, an error of the first failing
            worker's class naming every failing worker and what it found.
    """
    if not P.active:
        if checks is not None:
            checks()
        return
    error = local_error(checks) if checks is not None else None
    failure = None if error is None else (type(error).__name__, str(error))
    record = dict(same, failure=failure)
    records = [(dist.get_rank(), record)]
    if P.size > 1:
        h = _digest(record)
        pair = torch.tensor([h, -h], dtype=torch.int64)
        with collective_guard(op, "call agreement all-reduce", P.ranks):
            dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=P.meta_group)
        if int(pair[0]) == -int(pair[1]) and failure is None:
            return
        records = [None] * P.size
        with collective_guard(op, "call agreement records", P.ranks):
            dist.all_gather_object(records, (dist.get_rank(), record), group=P.meta_group)
    elif failure is None:
        return
    failed = [(rank, rec["failure"]) for rank, rec in records if rec["failure"] is not None]
    if failed:
        kind = getattr(errors, failed[0][1][0], DistfuseError)
        lines = "; ".join(f"world rank {rank}: {msg}" for rank, (_, msg) in failed)
        raise kind(f"{where(op)}: the local checks failed on world rank(s) {[rank for rank, _ in failed]}, so no "
                   f"worker moves data: {lines}")
    keys = [k for k in same if len({repr(rec[k]) for _, rec in records}) > 1]
    detail = "; ".join(f"{k}: " + ", ".join(f"world rank {rank} {rec[k]}" for rank, rec in records) for k in keys)
    raise ShapeError(f"{where(op)}: the workers' calls disagree ({detail}); every worker must pass the same")


def agree_on_tensor(P, op: str, x, checks: Callable[[], None], **same) -> None:
    """:func:`agree_on_call` on ``same`` plus ``x``'s dtype and grad flag (``x``: whatever the caller passed)."""
    agree_on_call(P, op, dict(same, dtype=getattr(x, "dtype", None),
                              grad=torch.is_grad_enabled() and getattr(x, "requires_grad", False)), checks)
