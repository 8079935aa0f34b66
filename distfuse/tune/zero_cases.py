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

import functools
import math
from collections.abc import Sequence

from distfuse.fused import registry
from distfuse.tune.cases import Case, CaseContext, mlp_sizes, weight_case

__all__ = ["zero_grid", "zero_case"]


def _split(op: str) -> str:
    return "rows" if op == registry.ZERO_LINEAR_ROWS.name else "columns"


def zero_grid(op: str, world: int, *, quick: bool = False, m: Sequence[int] | None = None, hidden: int | None = None,
              ffn: int | None = None, **_options) -> list[dict]:
    """A ZeRO MLP of ``hidden`` and ``ffn`` sizes, ``m`` rows per worker: the down projection ``m x hidden x ffn``
    (``zero_linear_rows``) and the up projection ``m x ffn x hidden`` (``zero_linear_columns``)."""
    ms, h, f = mlp_sizes(quick, m, hidden, ffn)
    if _split(op) == "rows":
        return [dict(m=mm, n=h, k=f) for mm in ms]
    return [dict(m=mm, n=f, k=h) for mm in ms]


def zero_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """Both paths of one shape on the measured group (collective over the world: the partition)."""
    import torch.nn.functional as F

    from distfuse.fused.zero_linear import zero_linear
    from distfuse.geometry.decomposition import block_extent
    from distfuse.primitives.all_gather import all_gather

    split = _split(op)
    P_d = ctx.partition([ctx.world, 1] if split == "rows" else [1, ctx.world])
    if not P_d.active:
        return None
    W, d = P_d.size, P_d.rank
    m, n, k = shape["m"], shape["n"], shape["k"]
    shard_shape = (block_extent(n, W, d), k) if split == "rows" else (n, block_extent(k, W, d))

    def unfused_op(x, shard):
        return F.linear(x, all_gather(shard, P_d, (n, k)))

    fused_op = functools.partial(zero_linear, P_d=P_d, split=split, out_features=n, in_features=k)
    set_bytes = ctx.dtype.itemsize * (2 * m * k + m * n + math.prod(shard_shape))
    return weight_case(ctx, 1357 + 7 * d, set_bytes, (m, k), shard_shape, (m, n), 1.0 / math.sqrt(k), unfused_op,
                       fused_op)
