"""The ZeRO layers' dispatch row agreement: one host all-reduce eagerly, none inside ``capture_safe()``.

On CUDA the ZeRO linears pick fused or unfused from the largest data-parallel row count,
which every worker must agree on (``fused/zero_linear_dispatch.agreed_rows``: a host int64 MAX
all-reduce on the meta group).  Inside ``capture_safe()`` (and a CUDA-graph capture) the
value agreed eagerly for this worker's rows is reused without a collective; a row count
never agreed raises ``UnsupportedError``.  The CUDA branch only needs the device type, so
it runs here on gloo ranks with ``device="cuda"`` named and no GPU.
"""

from __future__ import annotations

import torch.distributed as dist

import distfuse.fused.zero_linear_dispatch as zero_linear_dispatch
from distfuse import Partition
from distfuse.primitives._agreement import capture_safe
from distfuse.testing import run_ranks


def _rows():
    me = dist.get_rank()
    P_d = Partition.world().create_partition_inclusive([1, 0])
    calls = []
    real = dist.all_reduce
    zero_linear_dispatch.dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        eager = zero_linear_dispatch.agreed_rows(P_d, 5 + 2 * me, "cuda")
        eager_calls = len(calls)
        with capture_safe():
            trusted = zero_linear_dispatch.agreed_rows(P_d, 5 + 2 * me, "cuda")
            trusted_calls = len(calls) - eager_calls
            try:
                zero_linear_dispatch.agreed_rows(P_d, 3, "cuda")
                unseen = "ok"
            except Exception as exc:  # noqa: BLE001 - the test inspects the kind
                unseen = type(exc).__name__
    finally:
        zero_linear_dispatch.dist.all_reduce = real
    return eager, eager_calls, trusted, trusted_calls, unseen


def test_agreed_rows_is_reused_inside_capture_safe():
    for eager, eager_calls, trusted, trusted_calls, unseen in run_ranks(2, _rows):
        assert eager == trusted == 7 and eager_calls == 1 and trusted_calls == 0
        assert unseen == "UnsupportedError"
