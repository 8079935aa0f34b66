"""Distributed max and average pooling against torch.nn.MaxPoolNd / AvgPoolNd on the gathered tensor.

Every case runs in float64 (outputs and indices bit for bit where the op only selects,
gradients to the fp64 tolerance) and in fp16 or bf16 against the fp64 reference, on
forked gloo ranks: uneven splits, extents smaller than the grid, workers whose output
block is empty, halos wider than a neighbour's block, ranks listed out of order, ranks
outside the partition, batch and channel splits, world sizes 1 to 8, 1-D to 3-D.  The
edges torch treats specially are checked on purpose: ceil-mode windows that run past
the padded input (max and both divisors), windows whose inputs are all ``-inf``
(torch's index rule), NaN, ``divisor_override``.  Geometry torch refuses raises a
distfuse error on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distfuse import zero_volume_tensor
from distfuse.errors import DistfuseError, ShapeError, UnsupportedError
from distfuse.geometry.decomposition import local_slices
from distfuse.geometry.pool_geometry import avg_divisors, check_pool_axis, pool_output_extent
from distfuse.layers.pool import (
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
)
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import grid, with_path
from tests.tolerances import tol

LAYERS = {("max", 1): DistributedMaxPool1d, ("max", 2): DistributedMaxPool2d, ("max", 3): DistributedMaxPool3d,
          ("avg", 1): DistributedAvgPool1d, ("avg", 2): DistributedAvgPool2d, ("avg", 3): DistributedAvgPool3d}
SEQUENTIAL = {("max", 1): nn.MaxPool1d, ("max", 2): nn.MaxPool2d, ("max", 3): nn.MaxPool3d,
              ("avg", 1): nn.AvgPool1d, ("avg", 2): nn.AvgPool2d, ("avg", 3): nn.AvgPool3d}


@dataclass(frozen=True)
class PoolCase:
    """One layer configuration on ``x_ranks`` (world ranks, row-major over ``grid_x``) of a ``world``."""

    name: str
    kind: str  # "max" or "avg"
    shape: tuple  # global input [B, C, *n]
    grid_x: tuple
    x_ranks: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    path: str = "auto"
    seed: int = 0
    data: str = "randn"  # "randn", or "specials": -inf runs and a NaN placed at the boundaries

    @property
    def nd(self) -> int:
        return len(self.shape) - 2


def close(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The suite's tolerance, its absolute part scaled by the reference's largest finite magnitude; NaN == NaN."""
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    finite = ref[torch.isfinite(ref)]
    scale = max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-3)
    t = tol(dtype)
    torch.testing.assert_close(got.double(), ref, rtol=t["rtol"], atol=t["atol"] * scale, equal_nan=True,
                               msg=lambda m: f"{name}: {m}")


def same(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-for-bit equal values (NaN where the reference has NaN)."""
    got, ref = got.double(), ref.double()
    nan = torch.isnan(ref)
    assert got.shape == ref.shape and torch.equal(torch.isnan(got), nan), f"{name}: shape or NaN positions differ"
    assert torch.equal(got[~nan], ref[~nan]), f"{name}: values differ\n{got}\n{ref}"


def _global_input(c: PoolCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + c.seed)
    x = torch.randn(c.shape, generator=gen, dtype=torch.float64)
    if c.data == "specials":  # whole windows of -inf at both ends of every axis, and one NaN inside
        for d in range(c.nd):
            n = c.shape[2 + d]
            idx = [slice(None)] * len(c.shape)
            idx[2 + d] = slice(0, min(3, n))
            x[tuple(idx)] = -math.inf
            idx[2 + d] = slice(max(n - 3, 0), n)
            x[tuple(idx)] = -math.inf
        x.view(-1)[x.numel() // 2] = math.nan
    return x.to(c.dtype).double()


def run_pool_case(c: PoolCase) -> dict:
    """Forward, indices and input gradient of one case against the sequential layer (compared on rank 0)."""
    P_x = grid(c.x_ranks, c.grid_x)
    layer = LAYERS[(c.kind, c.nd)](P_x, **c.kwargs)
    seq = SEQUENTIAL[(c.kind, c.nd)](**c.kwargs)
    xg = _global_input(c).requires_grad_(True)
    out = seq(xg)
    yg, ig = out if isinstance(out, tuple) else (out, None)
    gen = torch.Generator().manual_seed(200 + c.seed)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    yg.backward(dyg)

    x = (xg.detach()[local_slices(c.shape, P_x.shape, P_x.index)].to(c.dtype).requires_grad_(True) if P_x.active
         else zero_volume_tensor(dtype=c.dtype))
    out = with_path(c.path, lambda: layer(x))
    y, idx = out if isinstance(out, tuple) else (out, None)
    assert (idx is None) == (ig is None), f"{c.name}: return_indices mismatch"
    if P_x.active:
        want = tuple(e.stop - e.start for e in local_slices(tuple(yg.shape), P_x.shape, P_x.index))
        assert tuple(y.shape) == want and y.dtype == c.dtype, f"{c.name}: output block {tuple(y.shape)} != {want}"
        if idx is not None:
            assert tuple(idx.shape) == want and idx.dtype == torch.int64
        dy = dyg[local_slices(tuple(yg.shape), P_x.shape, P_x.index)].to(c.dtype)
    else:
        assert y.numel() == 0 and (idx is None or idx.numel() == 0), f"{c.name}: inactive rank got data"
        dy = torch.zeros_like(y)
    if y.requires_grad:
        y.backward(dy)
    y_full = collect_tensor(y.detach() if P_x.active else None, P_x)
    dx_full = collect_tensor(x.grad if P_x.active else None, P_x)
    i_full = collect_tensor(idx if P_x.active else None, P_x) if idx is not None else None
    if dist.get_rank() == 0:
        if c.kind == "max":  # a maximum is one of the (rounded) inputs: exact in every dtype, NaN included
            same(f"{c.name}: output", y_full, yg.detach())
        else:
            close(f"{c.name}: output", y_full, yg.detach(), c.dtype)
        if ig is not None:
            assert torch.equal(i_full, ig), f"{c.name}: indices\n{i_full}\n{ig}"
        close(f"{c.name}: input gradient", dx_full, xg.grad, c.dtype)
    return dict(path=layer.last_path, active=P_x.active, out=tuple(y.shape))


def run_pool_cases(cases) -> list[dict]:
    out = []
    for c in cases:
        try:
            out.append(run_pool_case(c))
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.kind}, {c.dtype}, path={c.path}] {exc}") from exc
    return out


def _case(name, world, kind, shape, grid_x, ranks=None, **kwargs):
    n = math.prod(grid_x)
    ranks = tuple(range(n)) if ranks is None else tuple(ranks)
    return pytest.param(world, PoolCase(name, kind, shape, grid_x, ranks, kwargs), id=name)


GEOMETRIES = [
    _case("1d-max-k3s2p1-4w", 4, "max", (2, 3, 17), (1, 1, 4), kernel_size=3, stride=2, padding=1),
    _case("1d-avg-k3s2p1-ceil-past-padded-edge-3w", 3, "avg", (1, 2, 16), (1, 1, 3), (2, 0, 1), kernel_size=3,
          stride=2, padding=1, ceil_mode=True),
    _case("1d-avg-exclude-pad-ceil-3w-permuted", 3, "avg", (2, 2, 16), (1, 1, 3), (1, 2, 0), kernel_size=3, stride=2,
          padding=1, ceil_mode=True, count_include_pad=False),
    _case("1d-max-dil2-ceil-indices-3w-permuted", 3, "max", (1, 2, 16), (1, 1, 3), (2, 0, 1), kernel_size=3,
          stride=2, padding=1, dilation=2, ceil_mode=True, return_indices=True),
    _case("1d-max-extent3-over-4w-empty-blocks", 4, "max", (1, 2, 3), (1, 1, 4), kernel_size=2, stride=2,
          return_indices=True),
    _case("1d-avg-stride-over-kernel-4w", 4, "avg", (1, 2, 13), (1, 1, 4), kernel_size=2, stride=3),
    _case("1d-max-wide-halo-dil3-4w", 4, "max", (1, 1, 11), (1, 1, 4), kernel_size=5, padding=2, dilation=3,
          return_indices=True),
    _case("1d-avg-1w", 1, "avg", (2, 2, 9), (1, 1, 1), kernel_size=4, stride=3, padding=2, ceil_mode=True),
    _case("2d-max-k3s2p1-ceil-2x2-4w", 4, "max", (2, 2, 9, 11), (1, 1, 2, 2), kernel_size=3, stride=2, padding=1,
          ceil_mode=True, return_indices=True),
    _case("2d-avg-divisor-override-2x2-4w", 4, "avg", (1, 2, 9, 10), (1, 1, 2, 2), kernel_size=(3, 2),
          stride=(2, 1), padding=(1, 1), divisor_override=5),
    _case("2d-avg-exclude-pad-ceil-2x2-4w", 4, "avg", (1, 2, 8, 7), (1, 1, 2, 2), kernel_size=3, stride=2,
          padding=1, ceil_mode=True, count_include_pad=False),
    _case("2d-max-2x3-permuted-inactive-8w", 8, "max", (1, 2, 9, 12), (1, 1, 2, 3), (5, 3, 1, 0, 2, 4),
          kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), return_indices=True),
    _case("2d-avg-2x3-permuted-inactive-8w", 8, "avg", (1, 2, 9, 12), (1, 1, 2, 3), (7, 5, 3, 1, 6, 4),
          kernel_size=(3, 4), stride=(2, 3), padding=(1, 2), ceil_mode=True),
    _case("2d-max-batch-channel-split-8w", 8, "max", (3, 3, 8, 7), (2, 2, 1, 2), kernel_size=2, stride=2,
          padding=1, ceil_mode=True, return_indices=True),
    _case("2d-max-batch-split-only-local-padding-empty-batch-2w", 2, "max", (1, 2, 7, 6), (2, 1, 1, 1),
          kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True),
    _case("2d-avg-extent-under-grid-4w", 4, "avg", (1, 2, 3, 2), (1, 1, 2, 2), kernel_size=2, stride=1,
          padding=1),
    _case("3d-max-2x2x2-ceil-8w", 8, "max", (1, 2, 5, 6, 7), (1, 1, 2, 2, 2), kernel_size=3, stride=2, padding=1,
          ceil_mode=True, return_indices=True),
    _case("3d-avg-1x2x2-inactive-8w", 8, "avg", (1, 1, 4, 5, 7), (1, 1, 1, 2, 2), (6, 1, 3, 4), kernel_size=(2, 3, 2),
          stride=(1, 2, 3), padding=1, ceil_mode=True, count_include_pad=False),
    _case("3d-max-1x1x3-dil-3w", 3, "max", (2, 1, 3, 4, 8), (1, 1, 1, 1, 3), kernel_size=2, stride=(1, 2, 1),
          padding=(0, 1, 1), dilation=(1, 1, 3)),
]


@pytest.mark.parametrize("world,case", GEOMETRIES)
def test_pool_matches_sequential(world, case):
    low = (torch.float16, torch.bfloat16)[len(case.name) % 2]
    cases = [dataclasses.replace(case, dtype=dt, seed=s) for s, dt in enumerate((torch.float64, low))]
    results = run_ranks(world, run_pool_cases, cases)
    active = [r for per_rank in results for r in per_rank if r["active"]]
    assert active and all(r["path"] in ("local", "unfused") for r in active)
    assert all(r["path"] is None for per_rank in results for r in per_rank if not r["active"])


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_specials_and_all_minus_inf_windows(kind):
    """-inf runs fill whole boundary windows (torch then points at the first in-input tap) and a NaN sits inside."""
    kw = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)
    if kind == "max":
        kw["return_indices"] = True
    cases = [PoolCase("specials-1d-3w", kind, (1, 2, 12), (1, 1, 3), (0, 1, 2), kw, data="specials"),
             PoolCase("specials-2d-2x2-dil", kind, (1, 1, 9, 8), (1, 1, 2, 2), (3, 2, 1, 0),
                      dict(kw, dilation=(2, 1)) if kind == "max" else kw, data="specials"),
             PoolCase("specials-2d-bf16", kind, (1, 1, 9, 8), (1, 1, 2, 2), (0, 1, 2, 3), kw, torch.bfloat16,
                      data="specials")]
    run_ranks(4, run_pool_cases, cases)


def test_local_path_when_no_worker_needs_a_halo():
    """Kernel 2, stride 2 over even blocks: every window stays at home, nobody exchanges."""
    c = PoolCase("local-2x2", "max", (1, 2, 8, 12), (1, 1, 2, 2), (0, 1, 2, 3), dict(kernel_size=2))
    for per_rank in run_ranks(4, run_pool_cases, [c, dataclasses.replace(c, kind="avg", dtype=torch.float16)]):
        assert [r["path"] for r in per_rank] == ["local", "local"]


def _static_shapes_and_params():
    """``static_shapes`` gathers once while shapes repeat and still matches; no parameters to load or collect."""
    from distfuse.layers._params import collect_sequential, load_sequential
    from distfuse.layers.upsample import DistributedUpsample

    P_x = grid((1, 0), (1, 1, 2))
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    block = x[local_slices(x.shape, P_x.shape, P_x.index)]
    out = []
    for layer, seq in ((DistributedMaxPool1d(P_x, 3, 2, 1, static_shapes=True), nn.MaxPool1d(3, 2, 1)),
                       (DistributedUpsample(P_x, scale_factor=1.5, mode="linear", static_shapes=True),
                        nn.Upsample(scale_factor=1.5, mode="linear"))):
        load_sequential(layer, seq if dist.get_rank() == 0 else None)
        got = [collect_tensor(layer(block), P_x) for _ in range(3)]
        if dist.get_rank() == 0:
            assert all(torch.equal(g, got[0]) for g in got)
            close("static_shapes", got[0], seq(x), torch.float64)
        kept = (layer.agreement.calls, layer.agreement.slow_calls) == (3, 1)  # one gather, then trusted
        out.append((kept, collect_sequential(layer)))
    return out


def test_static_shapes_and_no_parameters():
    for per_rank, rank in zip(run_ranks(2, _static_shapes_and_params), range(2)):
        assert all(kept for kept, _ in per_rank)
        assert all(state == ({} if rank == 0 else None) for _, state in per_rank), per_rank


FUSED = [
    PoolCase("fused-1d-max-ceil-indices", "max", (1, 2, 13), (1, 1, 3), (2, 1, 0),
             dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True), path="fused"),
    PoolCase("fused-2d-avg-bf16", "avg", (1, 2, 7, 6), (1, 1, 1, 3), (0, 1, 2),
             dict(kernel_size=3, stride=1, padding=1, count_include_pad=False), torch.bfloat16, path="fused"),
]


def test_fused_staging_path():
    """DISTFUSE_PATH=fused stages with the Triton halo kernels (interpreted here) and matches torch."""
    for per_rank in run_ranks(3, run_pool_cases, FUSED):
        assert [r["path"] for r in per_rank] == ["fused", "fused"]


# ---------------------------------------------------------------- errors on every rank


def _error_of(fn):
    try:
        fn()
    except DistfuseError as exc:
        return type(exc).__name__, str(exc)
    return None


def _bad_call(scenario: str):
    P_x = grid((0, 1, 2, 3), (1, 1, 4))
    rank = dist.get_rank()
    if scenario == "padding_over_half_kernel":
        return _error_of(lambda: DistributedMaxPool1d(P_x, 3, padding=2))
    if scenario == "zero_stride":
        return _error_of(lambda: DistributedAvgPool1d(P_x, 3, stride=0))
    if scenario == "divisor_zero":
        return _error_of(lambda: DistributedAvgPool2d(grid((0, 1, 2, 3), (1, 1, 2, 2)), 2, divisor_override=0))
    if scenario == "output_too_small":  # global extent 2 < kernel 3: torch's "output size is too small"
        layer = DistributedMaxPool1d(P_x, 3)
        x = torch.randn(1, 2, 1 if rank < 2 else 0)
        return _error_of(lambda: layer(x))
    if scenario == "window_without_input":  # taps -1 and 2 of an extent-2 input: torch answers -inf, index 2
        layer = DistributedMaxPool1d(P_x, 2, padding=1, dilation=3)
        x = torch.randn(1, 2, 1 if rank < 2 else 0)
        return _error_of(lambda: layer(x))
    if scenario == "not_balanced":
        layer = DistributedAvgPool1d(P_x, 2)
        return _error_of(lambda: layer(torch.randn(1, 2, 3 if rank == 3 else 2)))  # 9 over 4 is 3,2,2,2
    if scenario == "integer_input":
        layer = DistributedMaxPool1d(P_x, 2)
        return _error_of(lambda: layer(torch.ones(1, 2, 2, dtype=torch.int64)))
    raise ValueError(scenario)


@pytest.mark.parametrize("scenario,cls", [
    ("padding_over_half_kernel", UnsupportedError), ("zero_stride", UnsupportedError),
    ("divisor_zero", UnsupportedError), ("output_too_small", ShapeError), ("window_without_input", ShapeError),
    ("not_balanced", ShapeError), ("integer_input", ShapeError)])
def test_refused_on_every_rank(scenario, cls):
    errors = run_ranks(4, _bad_call, scenario)
    assert all(e is not None and e[0] == cls.__name__ for e in errors), errors
    assert all("[rank " in e[1] for e in errors), errors


def test_torch_refuses_the_same_geometry():
    """The refusals above are torch's own (the layer refuses at construction or on the gathered shape)."""
    with pytest.raises(RuntimeError, match="half"):
        F.max_pool1d(torch.randn(1, 1, 9), 3, padding=2)
    with pytest.raises(RuntimeError):
        F.max_pool1d(torch.randn(1, 1, 2), 3)
    with pytest.raises(RuntimeError, match="divisor"):
        F.avg_pool2d(torch.randn(1, 1, 4, 4), 2, divisor_override=0)


# ---------------------------------------------------------------- geometry sweeps (hypothesis)


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def pool_axes(draw):
    n = draw(st.integers(1, 14))
    k = draw(st.integers(1, 5))
    return n, k, draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(0, k // 2)), draw(st.booleans())


@_settings(400)
@given(pool_axes())
def test_output_extent_and_divisors_are_torchs(axis):
    """Extent (or refusal) and the average divisor of every window against torch on one axis, no ranks."""
    n, k, s, d, p, ceil = axis
    x = torch.ones(1, 1, n, dtype=torch.float64)
    try:
        want = F.max_pool1d(x, k, s, p, d, ceil_mode=ceil).shape[-1]
    except RuntimeError:
        want = None
    try:
        m = check_pool_axis(n, k, s, d, p, ceil)
    except ShapeError:
        m = None
    if want is not None and m is None:  # distfuse's one extra refusal: a window with no input tap
        starts = [o * s - p for o in range(want)]
        assert any(all(not 0 <= t0 + j * d < n for j in range(k)) for t0 in starts)
        return
    assert m == want, (m, want)
    if m is None:
        assert pool_output_extent(n, k, s, d, p, ceil) < 1
        return
    if d == 1:  # avg pooling has no dilation: its divisors, from the mean of ones (in-input count / divisor)
        for include in (True, False):
            got = F.avg_pool1d(x, k, s, p, ceil_mode=ceil, count_include_pad=include)[0, 0]
            div = torch.tensor(avg_divisors(n, k, s, p, include, 0, m), dtype=torch.float64)
            inside = torch.tensor([min(o * s - p + k, n) - max(o * s - p, 0) for o in range(m)], dtype=torch.float64)
            torch.testing.assert_close(got, inside / div, **tol(torch.float64, terms=k))  # a mean of k ones


@st.composite
def rank_examples(draw):
    nd = draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["max", "avg"]))
    size = draw(st.integers(1, 4))
    ranks = tuple(draw(st.permutations(range(4)))[:size])
    spatial_grid = [1] * nd
    for f in (2, 2) if size == 4 else (size,) if size > 1 else ():
        spatial_grid[draw(st.integers(0, nd - 1))] *= f
    n = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    k = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    s = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    p = tuple(draw(st.integers(0, e // 2)) for e in k)
    d = tuple(draw(st.integers(1, 2)) for _ in range(nd)) if kind == "max" else (1,) * nd
    ceil = draw(st.booleans())
    try:
        for e, ke, se, de, pe in zip(n, k, s, d, p):
            check_pool_axis(e, ke, se, de, pe, ceil)
    except ShapeError:
        ok = False
    else:
        ok = True
    kwargs = dict(kernel_size=k, stride=s, padding=p, ceil_mode=ceil)
    if kind == "max":
        kwargs.update(dilation=d, return_indices=draw(st.booleans()))
    else:
        kwargs.update(count_include_pad=draw(st.booleans()))
    shape = (draw(st.integers(1, 2)), 2) + n
    return ok, PoolCase("hypothesis", kind, shape, (1, 1) + tuple(spatial_grid), ranks, kwargs, seed=draw(
        st.integers(0, 1000)))


@_settings(25)
@given(rank_examples())
def test_random_geometries_on_random_partitions(example):
    ok, case = example
    assume(ok)  # geometry torch refuses: test_refused_on_every_rank
    run_ranks(4, run_pool_cases, [case])


# ---------------------------------------------------------------- the benchmark still runs


def test_bench_spatial_layers_smoke(monkeypatch, tmp_path):
    """``bench_spatial_layers --smoke`` on 2 CPU ranks: every op, provider and mode, sane rows, JSON round trip.

    No timing here is a performance claim; the bench itself checks that its providers agree before timing.
    """
    import json

    from bench import bench_spatial_layers
    from bench.harness import Row, write_results

    monkeypatch.delenv("DISTFUSE_PATH", raising=False)
    rows = bench_spatial_layers.run(smoke=True, world_size=2, dtype=torch.float32)
    seen: dict = {}
    for r in rows:
        assert isinstance(r, Row) and r.world_size == 2 and r.dtype == "float32" and r.mode in ("full", "fwd"), r
        assert all(math.isfinite(t) and t > 0 for t in (r.ms, r.ms_q20, r.ms_q80)) and r.ms_q20 <= r.ms <= r.ms_q80
        assert r.anchor == "cat" and r.ratio is not None and r.ratio > 0 and r.rate > 0 and r.rate_unit == "GB/s", r
        assert r.extra["device"] == "cpu" and r.extra["cuda"].startswith("unmeasured"), r
        if r.provider.startswith("distfuse"):
            assert r.extra["path"] == "unfused", r  # CPU: never the interpreted fused staging
        seen.setdefault((r.op, r.mode), set()).add(r.provider)
    assert {op for op, _ in seen} == set(bench_spatial_layers.OPS)
    assert all(got == {"cat", "distfuse", "distfuse_static"} for got in seen.values()), seen
    path = write_results(bench_spatial_layers.NAME, rows, out_dir=tmp_path, smoke=True)
    assert [Row(**d) for d in json.loads(path.read_text())["rows"]] == rows
