"""Debug-mode agreement checks before collectives (``DISTFUSE_DEBUG=1``).

A collective that ranks enter with different shapes, dtypes or in a different order
usually hangs until the timeout, or worse, completes with wrong data.  In debug mode
every distfuse collective first gathers a small record from every rank of the group
(:func:`check_agreement`); any disagreement raises :class:`CollectiveMismatchError` on
every rank, with a line per rank.

Cost: one extra object all-gather per collective; leave it off in production.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from distfuse.errors import CollectiveMismatchError, where
from distfuse.groups import WorldTable

__all__ = ["enabled", "check_agreement"]

_SEQ: WorldTable = WorldTable()  # ranks -> calls so far, per world (every rank of a new world starts at 0)


def enabled() -> bool:
    return os.environ.get("DISTFUSE_DEBUG", "0") not in ("", "0", "false", "False")


def check_agreement(op: str, ranks: tuple[int, ...], group, same: dict, info: dict | None = None) -> None:
    """Gather ``(seq, op, same)`` from every rank in ``ranks`` and raise if any differs.

    Args:
        op: the primitive or layer name.
        ranks: the world ranks of ``group`` (the sequence counter is kept per rank set).
        group: the process group all of ``ranks`` are in; this rank must be one of them.
        same: fields every rank must agree on.
        info: per-rank fields shown in the message but not compared (local shapes).
    """
    if not enabled() or group is None:
        return
    seq = _SEQ.current()
    seq[ranks] = seq.get(ranks, 0) + 1
    mine = (seq[ranks], op, sorted(same.items(), key=lambda kv: kv[0]), info or {})
    records: list = [None] * len(ranks)
    dist.all_gather_object(records, mine, group=group)
    if any(r[:3] != mine[:3] for r in records):
        # all_gather_object fills slots in group-rank order, and torch sorts a group's ranks.
        lines = "\n".join(
            f"  rank {w}: call #{r[0]} {r[1]} {dict(r[2])} {r[3]}" for w, r in zip(sorted(ranks), records, strict=True)
        )
        raise CollectiveMismatchError(f"{where(op)}: ranks entered a collective with different metadata:\n{lines}")
