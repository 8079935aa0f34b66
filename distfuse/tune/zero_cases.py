"""The tuner's factories for the ZeRO weight streaming (:mod:`distfuse.fused.zero_linear`).

Registry entries ``zero_linear_rows`` (the reduce-scatter linear's shards, split along the
output features) and ``zero_linear_columns`` (the all-gather linear's, along the input
features).  They are timed on their own because the gathered operand is the weight, not
the activations: the crossover of the sequence or feature all-gather GEMMs at the same
``m x n x k`` says nothing about them.  Both paths run the whole op over the ``W``
data-parallel workers of the measured group, one model-parallel worker each (``P_m = 1``):

    fused    zero_linear(x, shard, P_d, split=...)       the shards stream into the GEMM
    unfused  F.linear(x, all_gather(shard, P_d, W.shape))  the AllGather primitive, then the GEMM

with ``x [m, k]`` (this worker's rows), ``W [n, k]``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from distfuse.fused import registry
from distfuse.timing import rotations
from distfuse.tune.cases import Case, CaseContext, randn

__all__ = ["zero_grid", "zero_case"]


def _split(op: str) -> str:
    return "rows" if op == registry.ZERO_LINEAR_ROWS.name else "columns"


def zero_grid(op: str, world: int, *, quick: bool = False, m: Sequence[int] | None = None, hidden: int | None = None,
              ffn: int | None = None, **_options) -> list[dict]:
    """A ZeRO MLP of ``hidden`` and ``ffn`` sizes, ``m`` rows per worker: the down projection ``m x hidden x ffn``
    (``zero_linear_rows``) and the up projection ``m x ffn x hidden`` (``zero_linear_columns``)."""
    ms = list(m or ((8, 32) if quick else (64, 256, 1024, 4096, 16384)))
    h = hidden or (32 if quick else 4096)
    f = ffn or (64 if quick else 14336)
    if _split(op) == "rows":
        return [dict(m=mm, n=h, k=f) for mm in ms]
    return [dict(m=mm, n=f, k=h) for mm in ms]


def zero_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """Both paths of one shape on the measured group (collective over the world: the partition)."""
    import torch.nn.functional as F

    from distfuse.fused.zero_linear import zero_linear
    from distfuse.geometry.decomposition import block_extent
    from distfuse.partition import Partition
    from distfuse.primitives.all_gather import all_gather

    split = _split(op)
    base = Partition.world(device=ctx.device).create_partition_inclusive(list(ctx.world_ranks))
    P_d = base.create_cartesian_topology_partition([ctx.world, 1] if split == "rows" else [1, ctx.world])
    if not P_d.active:
        return None
    W, d = P_d.size, P_d.rank
    m, n, k = shape["m"], shape["n"], shape["k"]
    dtype, device, full = ctx.dtype, ctx.device, ctx.full
    shard_shape = (block_extent(n, W, d), k) if split == "rows" else (n, block_extent(k, W, d))
    gen = torch.Generator().manual_seed(1357 + 7 * d)
    R = rotations(dtype.itemsize * (2 * m * k + m * n + math.prod(shard_shape)), device)
    xs = [randn((m, k), gen, dtype, device).requires_grad_(full) for _ in range(R)]
    shard = randn(shard_shape, gen, dtype, device, 1.0 / math.sqrt(k)).requires_grad_(full)
    dys = [randn((m, n), gen, dtype, device) for _ in range(R)] if full else None
    grad = contextlib.nullcontext if full else torch.no_grad

    def unfused_op(x):
        return F.linear(x, all_gather(shard, P_d, (n, k)))

    def fused_op(x):
        return zero_linear(x, shard, P_d, split=split, out_features=n, in_features=k)

    def run(path):
        def fn(i):
            with grad():
                y = path(xs[i])
                if full:
                    xs[i].grad, shard.grad = None, None
                    y.backward(dys[i])
                return y
        return fn

    return Case(run(unfused_op), run(fused_op) if ctx.fused_ok else None, R)
