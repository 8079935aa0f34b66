"""The tuner's timing cases and default shape grids for the built-in fused ops.

The registry points each op at its factories here (``grid``, ``case``, ``available``: their
contracts are :class:`distfuse.fused.registry.FusedOp`'s).  A new op's factories live in its
own module (``docs/extending.md``), not here.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distfuse.fused import registry
from distfuse.timing import rotations

__all__ = ["Case", "CaseContext", "forced_path", "randn", "split", "timed_path", "weight_case", "mlp_sizes",
           "linear_grid", "halo_grid", "linear_case", "feature_linear_case", "halo_case", "linear_available",
           "ring_grid", "ring_case"]


@dataclass
class Case:
    """Both paths of one shape: ``fn(i)`` runs on input copy ``i`` (``0 <= i < rotations``)."""

    unfused: Callable[[int], object]
    fused: Callable[[int], object] | None  # None: the fused path is not timed
    rotations: int
    check: Callable[[str], str | None] = lambda path: None  # after a call on ``path``: an error, or None
    cleanup: Callable[[], None] = lambda: None
    # The fused path per provider (distfuse.fused.providers), where the op has several: the sweep times
    # each and records the fastest as the fused time.  None: ``fused`` is the only one.
    providers: dict[str, Callable[[int], object]] | None = None


@dataclass(frozen=True)
class CaseContext:
    """What a case factory gets besides the op and the shape."""

    dtype: torch.dtype
    device: torch.device
    world: int  # the measured group: the first ``world`` ranks
    world_ranks: Sequence[int]
    P_sub: object  # the group as a [1, world, 1] Cartesian partition (inactive outside it)
    full: bool  # time forward + backward (else forward only)
    fused_ok: bool  # the fused path may be timed (else build ``fused=None``)

    def partition(self, shape: Sequence[int]):
        """The measured group as a Cartesian partition of ``shape`` (collective over the world)."""
        from distfuse.partition import Partition

        group = Partition.world(device=self.device).create_partition_inclusive(list(self.world_ranks))
        return group.create_cartesian_topology_partition(shape)


@contextlib.contextmanager
def forced_path(path: str):
    """``DISTFUSE_PATH=path`` inside the block (the layers' own dispatch then takes that path)."""
    old = os.environ.get("DISTFUSE_PATH")
    os.environ["DISTFUSE_PATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISTFUSE_PATH", None)
        else:
            os.environ["DISTFUSE_PATH"] = old


def randn(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def timed_path(fwd: Callable, xs: Sequence[torch.Tensor], dys: Sequence[torch.Tensor] | None, full: bool,
               params: Sequence[torch.Tensor] = (), context: Callable = contextlib.nullcontext) -> Callable[[int], Any]:
    """``fn(i)``: ``fwd(xs[i])`` inside ``context()``; with ``full`` also its backward of ``dys[i]`` (the grads of
    ``xs[i]`` and ``params`` cleared first), else under ``torch.no_grad``."""
    grad = contextlib.nullcontext if full else torch.no_grad

    def fn(i):
        with context(), grad():
            y = fwd(xs[i])
            if full:
                xs[i].grad = None
                for p in params:
                    p.grad = None
                y.backward(dys[i])
            return y
    return fn


def weight_case(ctx: CaseContext, seed: int, set_bytes: int, x_shape: Sequence[int], w_shape: Sequence[int],
                dy_shape: Sequence[int], w_scale: float, unfused: Callable, fused: Callable,
                providers: Sequence[str] = ()) -> Case:
    """Both paths of a linear op, ``unfused(x, w)`` and ``fused(x, w[, provider=p])``, on random inputs: one ``x``
    and ``dy`` per rotation over ``set_bytes`` bytes, one weight ``w`` (times ``w_scale``), seeded ``seed``."""
    dtype, device, full = ctx.dtype, ctx.device, ctx.full
    gen = torch.Generator().manual_seed(seed)
    R = rotations(set_bytes, device)
    xs = [randn(x_shape, gen, dtype, device).requires_grad_(full) for _ in range(R)]
    w = randn(w_shape, gen, dtype, device, w_scale).requires_grad_(full)
    dys = [randn(dy_shape, gen, dtype, device) for _ in range(R)] if full else None

    def path(op, **kw):
        return timed_path(lambda x: op(x, w, **kw), xs, dys, full, (w,))

    by_provider = {p: path(fused, provider=p) for p in providers}
    return Case(path(unfused), path(fused) if ctx.fused_ok else None, R,
                providers=by_provider if ctx.fused_ok and len(by_provider) > 1 else None)


def split(world: int, nd: int) -> tuple[int, ...]:
    """A near-square grid of ``world`` workers over ``nd`` axes (prime factors, largest first, to the smallest axis)."""
    factors, n, p = [], world, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    grid = [1] * nd
    for f in sorted(factors, reverse=True):
        grid[grid.index(min(grid))] *= f
    return tuple(sorted(grid))


# ---------------------------------------------------------------- grids

# The ops that reduce partial products (a GEMM over a block of the input features, then a sum).
_DOWN_PROJECTION = {registry.MATMUL_REDUCE_SCATTER.name, registry.MATMUL_REDUCE_SCATTER_FEATURES.name,
                    registry.MATMUL_ALL_REDUCE.name}


def mlp_sizes(quick: bool, m: Sequence[int] | None, hidden: int | None, ffn: int | None) -> tuple[list[int], int, int]:
    """``(sequence lengths, hidden, ffn)`` of the linears' grids: those given, else LLaMA-3 8B's MLP (4096 and
    14336) over 64 to 16384 rows; ``quick``: tiny shapes for CI (CPU, seconds)."""
    ms = list(m or ((8, 32) if quick else (64, 256, 1024, 4096, 16384)))
    return ms, hidden or (32 if quick else 4096), ffn or (64 if quick else 14336)


def linear_grid(op: str, world: int, *, quick: bool = False, m: Sequence[int] | None = None, hidden: int | None = None,
                ffn: int | None = None, **_options) -> list[dict]:
    """An MLP of ``hidden`` and ``ffn`` sizes over sequence lengths ``m`` (:func:`mlp_sizes`).

    The reducing ops (the down projection: ``matmul_reduce_scatter``, its features form and
    ``matmul_all_reduce``) run the per-rank GEMM ``m x hidden x ffn/W``; the gathering ones
    (the up projection) ``m x ffn/W x hidden``.
    """
    ms, h, f = mlp_sizes(quick, m, hidden, ffn)
    part = max(1, f // world)
    if op in _DOWN_PROJECTION:
        return [dict(m=mm, n=h, k=part) for mm in ms]
    return [dict(m=mm, n=part, k=h) for mm in ms]


def halo_grid(op: str, world: int, *, quick: bool = False, channels: Sequence[int] | None = None,
              extent: int | None = None, nd: int | None = None, **_options) -> list[dict]:
    """``channels`` in and out, an ``extent^nd`` block per rank, kernel 3; ``elements`` (the halo_conv rule's size) is
    the block's: batch x channels x extent^nd."""
    cs = list(channels or ((2, 4) if quick else (8, 16, 32, 64, 128, 256)))
    e, d = extent or (8 if quick else 128), nd or 2
    return [dict(channels=c, extent=e, nd=d, kernel=3, batch=1, elements=c * e**d) for c in cs]


# ---------------------------------------------------------------- availability


def linear_available(P, device: torch.device, dtype) -> tuple[bool, str]:
    """The GEMM fusions: nothing to fuse at world size 1; else the symmetric-memory probe (collective over ``P``)."""
    if P.size == 1:
        return False, "world size 1: both paths are one GEMM, nothing to fuse"
    from distfuse.fused.matmul_common import fused_linear_available

    return fused_linear_available(P, device, dtype)


# ---------------------------------------------------------------- cases


def linear_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """``matmul_reduce_scatter`` (GEMM + reduce-scatter) or ``all_gather_matmul`` (all-gather + GEMM) on ``P_sub``."""
    import torch.nn.functional as F

    from distfuse.fused.all_gather_matmul import all_gather_matmul
    from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter
    from distfuse.fused.providers import providers_of
    from distfuse.geometry.decomposition import block_extent
    from distfuse.primitives.all_gather import all_gather
    from distfuse.primitives.reduce_scatter import reduce_scatter

    P_sub = ctx.P_sub
    if not P_sub.active:
        return None
    W, r = P_sub.size, P_sub.rank
    m, n, k = shape["m"], shape["n"], shape["k"]
    scatter = op == registry.MATMUL_REDUCE_SCATTER.name
    rows = m if scatter else block_extent(m, W, r)
    out_rows = block_extent(m, W, r) if scatter else m
    if scatter:
        def unfused(x, w):
            return reduce_scatter(F.linear(x, w), P_sub)

        fused = functools.partial(matmul_reduce_scatter, bias=None, P_sub=P_sub)  # fused(x, w[, provider=p])
    else:
        def unfused(x, w):
            return F.linear(all_gather(x, P_sub, (1, m, k)), w)

        fused = functools.partial(all_gather_matmul, bias=None, P_sub=P_sub, n=m)
    set_bytes = ctx.dtype.itemsize * (rows * k + out_rows * n + (m * n if scatter else m * k))
    return weight_case(ctx, 1234 + 7 * r, set_bytes, (1, rows, k), (n, k), (1, out_rows, n), 1.0 / math.sqrt(k),
                       unfused, fused, providers_of(op))


def feature_linear_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """DistDL's linear forms on a ``[1, 1, W]`` group (the features split), per-rank GEMM ``m x n x k``:

    * ``matmul_reduce_scatter_features``: ``[1, m, k_r] @ [n, k_r].T``, the output's features scattered;
    * ``all_gather_features_matmul``: the input's features ``k`` gathered, ``@ [n, k].T``;
    * ``matmul_all_reduce``: ``[1, m, k_r] @ [n, k_r].T`` summed onto every worker.

    The unfused paths are ``F.linear`` and the ReduceScatter / AllGather / AllSumReduce
    primitives.  Construction is collective over the world (the partition).
    """
    import torch.nn.functional as F

    from distfuse.fused.all_gather_features_matmul import all_gather_features_matmul
    from distfuse.fused.matmul_all_reduce import matmul_all_reduce
    from distfuse.fused.matmul_reduce_scatter_features import matmul_reduce_scatter_features
    from distfuse.geometry.decomposition import block_extent
    from distfuse.primitives.all_gather import all_gather
    from distfuse.primitives.all_sum_reduce import all_sum_reduce
    from distfuse.primitives.reduce_scatter import reduce_scatter

    P = ctx.partition([1, 1, ctx.world])
    if not P.active:
        return None
    W, r = P.size, P.rank
    m, n, k = shape["m"], shape["n"], shape["k"]
    k_r, n_r = block_extent(k, W, r), block_extent(n, W, r)
    if op == registry.ALL_GATHER_FEATURES_MATMUL.name:
        x_shape, w_shape, dy_shape = (1, m, k_r), (n, k), (1, m, n)
        unfused_op = lambda x, w: F.linear(all_gather(x, P, (1, m, k)), w)  # noqa: E731
        fused_op = lambda x, w: all_gather_features_matmul(x, w, None, P)  # noqa: E731
    elif op == registry.MATMUL_ALL_REDUCE.name:
        x_shape, w_shape, dy_shape = (1, m, k_r), (n, k_r), (1, m, n)
        unfused_op = lambda x, w: all_sum_reduce(F.linear(x, w), P)  # noqa: E731
        fused_op = lambda x, w: matmul_all_reduce(x, w, None, P)  # noqa: E731
    else:
        x_shape, w_shape, dy_shape = (1, m, k_r), (n, k_r), (1, m, n_r)
        unfused_op = lambda x, w: reduce_scatter(F.linear(x, w), P)  # noqa: E731
        fused_op = lambda x, w: matmul_reduce_scatter_features(x, w, None, P)  # noqa: E731
    set_bytes = ctx.dtype.itemsize * (math.prod(x_shape) + math.prod(w_shape) + math.prod(dy_shape))
    return weight_case(ctx, 2468 + 7 * r, set_bytes, x_shape, w_shape, dy_shape, 1.0 / math.sqrt(w_shape[1]),
                       unfused_op, fused_op)


def halo_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """A feature-distributed ConvNd on a near-square grid; the path is forced with ``DISTFUSE_PATH``.

    Construction is collective over the whole world (partitions); only active ranks time.
    """
    from distfuse.layers import DistributedConv1d, DistributedConv2d, DistributedConv3d

    dtype, device, full = ctx.dtype, ctx.device, ctx.full
    nd, c, e = shape["nd"], shape["channels"], shape["extent"]
    P_x = ctx.partition([1, 1, *split(ctx.world, nd)])
    cls = {1: DistributedConv1d, 2: DistributedConv2d, 3: DistributedConv3d}[nd]
    k = shape.get("kernel", 3)
    layer = cls(P_x, c, c, k, padding=k // 2, device=device, dtype=dtype)
    if not P_x.active:
        return None
    layer.requires_grad_(full)
    gen = torch.Generator().manual_seed(99 + P_x.rank)
    b = shape.get("batch", 1)
    R = rotations(3 * dtype.itemsize * b * c * (e + 2) ** nd, device)
    xs = [randn((b, c, *(e,) * nd), gen, dtype, device).requires_grad_(full) for _ in range(R)]
    dys = [randn((b, c, *(e,) * nd), gen, dtype, device) for _ in range(R)] if full else None
    return _forced_case(ctx, layer, xs, dys, list(layer.parameters()), "layer", lambda: layer.last_path,
                        lambda: layer.last_decision.reason)


def ring_grid(op: str, world: int, *, quick: bool = False, m: Sequence[int] | None = None, **_options) -> list[dict]:
    """Causal attention of LLaMA-3 8B's heads (32 query, 8 key/value heads of 128) over global sequence lengths
    ``m``, batch 1; ``quick``: tiny shapes for CI.  ``elements``: the largest K/V block's, the size dispatch
    compares."""
    heads, kv_heads, D = (4, 2, 8) if quick else (32, 8, 128)
    seqs = list(m or ((16, 32) if quick else (4096, 16384, 65536)))
    return [dict(S=S, B=1, heads=heads, kv_heads=kv_heads, D=D,
                 elements=2 * kv_heads * -(-S // max(world, 1)) * D) for S in seqs]


def ring_case(op: str, shape: dict, ctx: CaseContext) -> Case | None:
    """``DistributedAttention`` (causal, zigzag where ``S`` allows) on a ring of the measured ranks; the path (the
    ring's transport) is forced with ``DISTFUSE_PATH``."""
    from distfuse.layers import DistributedAttention
    from distfuse.layers.attention_ring import local_positions

    dtype, device, full = ctx.dtype, ctx.device, ctx.full
    P = ctx.partition([ctx.world])
    S, B, D = shape["S"], shape["B"], shape["D"]
    layout = "zigzag" if S % (2 * ctx.world) == 0 else "contiguous"
    layer = DistributedAttention(P, causal=True, layout=layout)
    if not P.active:
        return None
    n = len(local_positions(S, P.size, P.rank, layout))
    gen = torch.Generator().manual_seed(123 + P.rank)
    R = rotations(dtype.itemsize * B * n * D * 2 * (shape["heads"] + shape["kv_heads"]), device)
    k, v = (randn((B, shape["kv_heads"], n, D), gen, dtype, device) for _ in range(2))
    qs = [randn((B, shape["heads"], n, D), gen, dtype, device).requires_grad_(full) for _ in range(R)]
    dys = [randn((B, shape["heads"], n, D), gen, dtype, device) for _ in range(R)] if full else None
    return _forced_case(ctx, lambda q: layer(q, k, v), qs, dys, (), "ring", lambda: layer.last_decision.path,
                        lambda: layer.last_decision.reason)


def _forced_case(ctx: CaseContext, fwd: Callable, xs, dys, params, what: str, ran: Callable[[], str],
                 reason: Callable[[], str]) -> Case:
    """Both paths of a layer whose path is forced with ``DISTFUSE_PATH``; the check compares the path asked for
    with ``ran()`` (the path the ``what`` took, because of ``reason()``)."""
    def call(path):
        return timed_path(fwd, xs, dys, ctx.full, params, functools.partial(forced_path, path))

    def check(path):
        got = ran()
        return None if got == path else f"asked for the {path} path, the {what} ran {got} ({reason()})"

    return Case(call("unfused"), call("fused") if ctx.fused_ok else None, len(xs), check)
