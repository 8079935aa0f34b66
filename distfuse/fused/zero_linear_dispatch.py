"""What the ZeRO layers ask before they choose a path: the agreed row count, the sequence extent, availability.

The op itself is :func:`distfuse.fused.zero_linear.zero_linear`; the layers call these
first, so that every worker of a layer takes the same path with the same sizes.  Dispatch
reads registry entries ``zero_linear_rows`` and ``zero_linear_columns`` (the tuner times
this op itself, :mod:`distfuse.tune.zero_cases`).  Data-parallel workers hold different
row counts (uneven batch blocks), so the decision uses the largest (:func:`agreed_rows`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.fused.matmul_common import fused_linear_available
from distfuse.groups import WorldTable
from distfuse.partition import Partition
from distfuse.primitives._agreement import trusting

__all__ = ["agreed_rows", "sequence_extent", "zero_linear_available"]


_AGREED_ROWS: WorldTable = WorldTable()  # (P_d ranks, this worker's rows) -> agreed max


def _exchanges_rows(P_d: Partition, device) -> bool:
    """Whether :func:`agreed_rows` exchanges the count: the decision depends on the size (CUDA, no forced path)."""
    forced = os.environ.get("DISTFUSE_PATH", "auto").strip().lower() in ("fused", "unfused")
    return P_d.size > 1 and torch.device(device).type == "cuda" and not forced


def agreed_rows(P_d: Partition, rows: int, device, *, P_all: Partition | None = None, error: Exception | None = None,
                op: str = "ZeroLinear") -> int:
    """The largest row count over the data-parallel workers ``P_d``: all workers must take the same path.

    Collective over ``P_d`` where the dispatch decision depends on the size (CUDA, no
    ``DISTFUSE_PATH`` forcing a path, see :func:`~distfuse.layers.dispatch.select_path`):
    one host int64 all-reduce on the metadata group, no device read; else the local count.  Inside
    :func:`~distfuse.primitives._agreement.capture_safe` (and while a CUDA stream captures)
    the value agreed for this worker's ``rows`` in an eager call is reused, so a captured
    step runs no host collective; a row count never seen eagerly raises
    :class:`~distfuse.errors.UnsupportedError` on that worker (warm up with the captured
    shapes on every worker).

    ``P_all``, the layer's whole grid (``P_d`` x the model-parallel workers), and ``error``,
    this worker's local check failure (None: its input passed): where the count is
    exchanged, the same round runs over ``P_all`` instead (every column's workers hold the
    same rows, so the maximum is the same) and carries a flag and the failing world rank,
    so a local check that failed on any worker raises on every worker of the grid before
    any data moves: this worker raises ``error``, the others a ShapeError naming it.  No
    extra round: the one the dispatch needs anyway.  Where nothing is exchanged (CPU, or
    ``DISTFUSE_PATH`` forcing a path) the caller handles ``error`` itself.
    """
    t = torch.tensor([int(rows), 0 if error is None else 1, -1 if error is None else dist.get_rank()],
                     dtype=torch.int64)
    if _exchanges_rows(P_d, device):
        key = (tuple(P_d.ranks), int(rows))
        if trusting():
            if error is not None:
                raise error
            if key not in _AGREED_ROWS.current():
                raise UnsupportedError(f"{where('ZeroLinear')}: inside capture_safe() (or a CUDA-graph capture) the "
                                       f"data-parallel row count {rows} was never agreed in an eager call; warm up "
                                       "with the captured shapes on every worker")
            return _AGREED_ROWS[key]
        if P_all is None:  # the count alone, over the data-parallel workers
            t = t[:1].clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=(P_all if P_all is not None else P_d).meta_group)
        if error is not None:
            raise error
        if P_all is not None and int(t[1]):
            raise ShapeError(f"{where(op)}: the input of world rank {int(t[2])} (at least) failed its local checks "
                             "(its own error says why); no worker moves data")
        _AGREED_ROWS.current()[key] = int(t[0])
    return int(t[0])


def sequence_extent(P_m: Partition, n_m: int) -> int:
    """The gathered sequence extent: the sum of the workers' blocks over ``P_m`` (one int64 all-reduce on its
    metadata group; exact every call, where an agreed value may be a step old)."""
    t = torch.tensor([int(n_m)], dtype=torch.int64)
    if P_m.size > 1:
        dist.all_reduce(t, group=P_m.meta_group)
    return int(t)


def zero_linear_available(P_d: Partition, P_m: Partition | None, device, dtype) -> tuple[bool, str]:
    """Whether the fused path can run: symmetric memory on ``P_m`` (when given), then on ``P_d``.

    Collective over each group the first time (every worker asks both, in this order).
    """
    if P_m is not None:
        ok, why = fused_linear_available(P_m, device, dtype)
        if not ok:
            return False, f"the model-parallel workers: {why}"
    ok, why = fused_linear_available(P_d, device, dtype)
    return (True, why) if ok else (False, f"the data-parallel workers: {why}")
