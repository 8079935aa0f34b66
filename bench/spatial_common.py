"""What the spatial layer benchmarks share: grids, the agreement check, the anchors' P2P round, partitions.

Used by ``bench_conv_layers.py``, ``bench_spatial_layers.py`` and ``bench_conv_transpose.py``.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

__all__ = ["grid_for", "check_agree", "exchange", "partition_for", "with_path"]


def grid_for(nd: int, W: int) -> tuple[int, ...]:
    """``W`` split over the last two spatial axes, as square as it goes (larger factor first)."""
    a = max(f for f in range(1, int(math.isqrt(W)) + 1) if W % f == 0)
    return (1,) * (nd - 2) + (W // a, a)


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 3e-2)


def check_agree(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise RuntimeError(f"{what}: shape {tuple(got.shape)} != anchor's {tuple(want.shape)}")
    rtol, atol = _tol(dtype)
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-3)
    if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol * scale):
        err = float((got.float() - want.float()).abs().max())
        raise RuntimeError(f"{what}: providers disagree (max abs diff {err:.3g}, anchor max {scale:.3g}); "
                           "the comparison would not be of equal work")


def exchange(sends: list, recvs: list) -> None:
    """Post every (tensor, peer) send and receive at once and wait for them."""
    ops = [dist.P2POp(dist.isend, t, p) for t, p in sends] + [dist.P2POp(dist.irecv, t, p) for t, p in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


_PARTS: dict = {}


def partition_for(grid: tuple[int, ...]):
    if grid not in _PARTS:
        from distfuse import Partition

        W = math.prod(grid)
        _PARTS[grid] = Partition.world().create_partition_inclusive(range(W)).create_cartesian_topology_partition(
            [1, 1, *grid])
    return _PARTS[grid]


def with_path(path: str, fn):
    old = os.environ.get("DISTFUSE_PATH")
    os.environ["DISTFUSE_PATH"] = path
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("DISTFUSE_PATH", None)
        else:
            os.environ["DISTFUSE_PATH"] = old
