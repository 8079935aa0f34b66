"""Distributed interpolation against torch.nn.Upsample / F.interpolate on the gathered tensor.

* Without ranks (cheap, many examples): every worker's window and taps, applied to its
  slice of the global input, tile ``F.interpolate``'s output; nearest modes bit for bit,
  linear modes to the fp32/fp64 tolerance; awkward sizes (7 -> 17, scale 1.7, 0.3,
  1.1 -> the same extent) with ``align_corners`` both ways.
* On ranks: forward and input gradient of ``DistributedUpsample`` and ``interpolate``
  in float64 and fp16/bf16, over uneven splits, extents smaller than the grid, workers
  whose output block is empty, windows away from a worker's own block (downsampling),
  ranks out of order, inactive ranks, batch and channel splits, world sizes 1 to 8 and
  1-D to 3-D; the local, unfused and fused staging paths; the dot-product adjoint test;
  arguments and shapes torch refuses, refused on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from distfuse import zero_volume_tensor
from distfuse.errors import DistfuseError, PartitionError, ShapeError, UnsupportedError
from distfuse.geometry.decomposition import block_range, local_slices
from distfuse.geometry.interp_geometry import LINEAR_MODES
from distfuse.layers.upsample import DistributedUpsample, InterpSpec, interp_geometry, interpolate, interpolate_window
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import grid, with_path
from tests.test_pool_layers import close, same

MODE_OF_ND = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- windows and taps, without ranks


def _blockwise(x: torch.Tensor, grid_s: tuple, kw: dict) -> torch.Tensor:
    """Every worker's block computed from its window of the global input, assembled (what the ranks do)."""
    nd = x.dim() - 2
    spec = InterpSpec.make("test", nd, kw.get("size"), kw.get("scale_factor"), kw["mode"], kw.get("align_corners"),
                           kw.get("recompute_scale_factor"))
    geo = interp_geometry(spec, tuple(x.shape[2:]), grid_s, x.shape[1] == 1, x.dtype == torch.float64, "cpu")
    out = x.new_full(tuple(x.shape[:2]) + geo.plan.global_output_shape(), math.nan)
    for index in geo.plan.blocks():
        win = [ax.needed_range(i) for ax, i in zip(geo.plan.axes, index)]
        outs = [ax.output_range(i) for ax, i in zip(geo.plan.axes, index)]
        if any(b == a for a, b in outs):
            continue
        staged = x[(Ellipsis, *(slice(a, b) for a, b in win))]
        out[(Ellipsis, *(slice(a, b) for a, b in outs))] = interpolate_window(staged, geo, index, spec)
    return out


@st.composite
def interp_examples(draw):
    nd = draw(st.integers(1, 3))
    n = tuple(draw(st.integers(1, 12 if nd < 3 else 5)) for _ in range(nd))
    grid_s = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    mode = draw(st.sampled_from(["nearest", "nearest-exact", MODE_OF_ND[nd]]))
    kw = dict(mode=mode)
    if mode in LINEAR_MODES:
        kw["align_corners"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["size"] = tuple(draw(st.integers(1, 3 * e + 2)) for e in n)
    else:
        scales = tuple(draw(st.sampled_from([0.3, 0.5, 0.9, 1.0, 1.1, 1.7, 2.0, 2.5, 3.0, 7 / 3])) for _ in n)
        if any(int(e * s) < 1 for e, s in zip(n, scales)):
            scales = tuple(max(s, 1.0) for s in scales)
        kw["scale_factor"] = scales
        kw["recompute_scale_factor"] = draw(st.sampled_from([None, True]))
    channels = draw(st.sampled_from([1, 2]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    return (1, channels) + n, grid_s, kw, dtype, draw(st.integers(0, 1000))


@_settings(250)
@given(interp_examples())
@example(((1, 2, 7), (4,), dict(mode="linear", size=(17,), align_corners=False), torch.float32, 0))
@example(((1, 2, 7), (4,), dict(mode="linear", size=(17,), align_corners=True), torch.float64, 1))
@example(((1, 2, 7), (3,), dict(mode="nearest", scale_factor=(1.7,)), torch.float32, 2))
@example(((1, 2, 7), (3,), dict(mode="nearest-exact", scale_factor=(1.7,)), torch.float64, 3))
@example(((1, 2, 7, 9), (2, 2), dict(mode="nearest", scale_factor=(1.1, 1.7)), torch.float32, 4))  # 7 -> 7: torch's
@example(((1, 1, 10, 3), (3, 2), dict(mode="bilinear", scale_factor=(0.3, 1.7), align_corners=False),  # 2-D shortcut
          torch.float32, 5))
def test_windows_and_taps_tile_torchs_output(ex):
    shape, grid_s, kw, dtype, seed = ex
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    got = _blockwise(x, grid_s, kw)
    if kw["mode"] in LINEAR_MODES:  # against float64 on the same (rounded) input
        close("blockwise interpolation", got, F.interpolate(x.double(), **kw), dtype)
    else:  # selection: bit for bit against torch in the same dtype (its index rules depend on it)
        same("blockwise nearest", got, F.interpolate(x, **kw))


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "linear"])
def test_power_of_two_shortcut_is_torch_bit_for_bit(mode):
    """Scale 2 and 4 (the U-Net case): torch's kernel on each window, cropped, equals torch on the whole, bitwise."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for nd, n, grid_s, scale in ((1, (7,), (3,), 2.0), (1, (13,), (4,), 4.0), (2, (5, 9), (2, 3), 2.0),
                                     (3, (3, 4, 5), (1, 2, 2), 2.0)):
            kw = dict(mode=mode if mode != "linear" else MODE_OF_ND[nd], scale_factor=scale)
            x = torch.randn((2, 3) + n, dtype=torch.float64).to(dtype)
            spec = InterpSpec.make("test", nd, None, scale, kw["mode"], None, None)
            geo = interp_geometry(spec, n, grid_s, False, dtype == torch.float64, "cpu")
            assert geo.factors == (int(scale),) * nd, (n, grid_s, geo.factors)
            same(f"{kw} {dtype} {n} over {grid_s}", _blockwise(x, grid_s, kw), F.interpolate(x, **kw))


def test_nearest_probe_follows_torchs_rules_per_rank():
    """torch's CPU nearest kernels differ by rank (2-D maps n -> n onto itself, 1-D and 3-D do not); so do we."""
    for nd in (1, 2, 3):
        x = torch.randn((1, 2) + (7,) * nd, dtype=torch.float64)
        kw = dict(mode="nearest", scale_factor=(1.1,) * nd)
        same(f"{nd}-D", _blockwise(x, (2,) * nd, kw), F.interpolate(x, **kw))


# ---------------------------------------------------------------- on ranks


@dataclass(frozen=True)
class UpCase:
    name: str
    shape: tuple
    grid_x: tuple
    x_ranks: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    path: str = "auto"
    functional: bool = False
    seed: int = 0


def run_up_case(c: UpCase) -> dict:
    P_x = grid(c.x_ranks, c.grid_x)
    gen = torch.Generator().manual_seed(10 + c.seed)
    xg = torch.randn(c.shape, generator=gen, dtype=torch.float64).to(c.dtype).double().requires_grad_(True)
    yg = F.interpolate(xg, **c.kwargs)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    yg.backward(dyg)
    x = (xg.detach()[local_slices(c.shape, P_x.shape, P_x.index)].to(c.dtype).requires_grad_(True) if P_x.active
         else zero_volume_tensor(dtype=c.dtype))
    layer = None
    if c.functional:
        y = with_path(c.path, lambda: interpolate(P_x, x, **c.kwargs))
    else:
        layer = DistributedUpsample(P_x, **c.kwargs)
        y = with_path(c.path, lambda: layer(x))
    if P_x.active:
        want = tuple(s.stop - s.start for s in local_slices(tuple(yg.shape), P_x.shape, P_x.index))
        assert tuple(y.shape) == want and y.dtype == c.dtype, f"{c.name}: output block {tuple(y.shape)} != {want}"
        dy = dyg[local_slices(tuple(yg.shape), P_x.shape, P_x.index)].to(c.dtype)
    else:
        assert y.numel() == 0, f"{c.name}: an inactive rank got {tuple(y.shape)}"
        dy = torch.zeros_like(y)
    if y.requires_grad:
        y.backward(dy)
    y_full = collect_tensor(y.detach() if P_x.active else None, P_x)
    dx_full = collect_tensor(x.grad if P_x.active else None, P_x)
    if dist.get_rank() == 0:
        if c.kwargs["mode"].startswith("nearest"):
            same(f"{c.name}: output", y_full, yg.detach())
        else:
            close(f"{c.name}: output", y_full, yg.detach(), c.dtype)
        close(f"{c.name}: input gradient", dx_full, xg.grad, c.dtype)
    return dict(path=layer.last_path if layer is not None else None, active=P_x.active)


def run_up_cases(cases) -> list[dict]:
    out = []
    for c in cases:
        try:
            out.append(run_up_case(c))
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.dtype}, path={c.path}] {exc}") from exc
    return out


def _case(name, world, shape, grid_x, ranks=None, **kwargs):
    ranks = tuple(range(math.prod(grid_x))) if ranks is None else tuple(ranks)
    return pytest.param(world, UpCase(name, shape, grid_x, ranks, kwargs), id=name)


GEOMETRIES = [
    _case("1d-linear-7to17-4w", 4, (2, 3, 7), (1, 1, 4), size=17, mode="linear"),
    _case("1d-linear-align-7to17-3w-permuted", 3, (1, 2, 7), (1, 1, 3), (2, 0, 1), size=17, mode="linear",
          align_corners=True),
    _case("1d-nearest-scale1.7-4w", 4, (1, 2, 7), (1, 1, 4), scale_factor=1.7, mode="nearest"),
    _case("1d-nearest-exact-down0.3-4w-empty-blocks", 4, (1, 2, 11), (1, 1, 4), scale_factor=0.3,
          mode="nearest-exact"),
    _case("1d-linear-extent3-over-4w", 4, (1, 1, 3), (1, 1, 4), scale_factor=2.5, mode="linear"),
    _case("1d-linear-1w", 1, (2, 2, 5), (1, 1, 1), scale_factor=2.0, mode="linear", recompute_scale_factor=True),
    _case("2d-bilinear-2x2-4w", 4, (1, 2, 9, 7), (1, 1, 2, 2), scale_factor=(1.7, 0.6), mode="bilinear"),
    _case("2d-bilinear-align-2x3-permuted-inactive-8w", 8, (1, 2, 5, 7), (1, 1, 2, 3), (7, 5, 3, 1, 6, 4),
          size=(11, 4), mode="bilinear", align_corners=True),
    _case("2d-nearest-2x2-same-extent-4w", 4, (1, 2, 7, 9), (1, 1, 2, 2), (3, 2, 1, 0), scale_factor=(1.1, 2.0),
          mode="nearest"),
    _case("2d-nearest-exact-batch-channel-split-8w", 8, (3, 3, 6, 5), (2, 2, 1, 2), size=(4, 13),
          mode="nearest-exact"),
    _case("3d-trilinear-2x2x2-8w", 8, (1, 1, 5, 4, 3), (1, 1, 2, 2, 2), size=(3, 9, 5), mode="trilinear"),
    _case("2d-bilinear-x2-shortcut-uneven-3x1-3w", 3, (2, 2, 7, 5), (1, 1, 3, 1), (1, 2, 0), scale_factor=2,
          mode="bilinear"),
    _case("3d-nearest-1x1x3-3w", 3, (2, 2, 3, 2, 7), (1, 1, 1, 1, 3), (1, 2, 0), scale_factor=(2.0, 1.5, 0.5),
          mode="nearest"),
]


@pytest.mark.parametrize("world,case", GEOMETRIES)
def test_upsample_matches_sequential(world, case):
    low = (torch.float16, torch.bfloat16)[len(case.name) % 2]
    cases = [dataclasses.replace(case, dtype=dt, seed=s) for s, dt in enumerate((torch.float64, low))]
    results = run_ranks(world, run_up_cases, cases)
    active = [r for per_rank in results for r in per_rank if r["active"]]
    assert active and all(r["path"] in ("local", "unfused") for r in active)


def test_functional_interpolate_and_staging_paths():
    """``interpolate`` matches F.interpolate; 2x nearest over even blocks is local; DISTFUSE_PATH=fused runs Triton."""
    cases = [
        UpCase("functional-bilinear", (1, 2, 6, 5), (1, 1, 2, 2), (0, 1, 2, 3),
               dict(scale_factor=2.5, mode="bilinear", align_corners=False), functional=True),
        UpCase("local-nearest-2x", (1, 2, 8, 4), (1, 1, 2, 2), (0, 1, 2, 3), dict(scale_factor=2.0, mode="nearest")),
        UpCase("fused-linear", (1, 2, 4, 9), (1, 1, 1, 4), (3, 1, 2, 0), dict(size=(4, 20), mode="bilinear"),
               path="fused"),
        UpCase("fused-nearest-bf16", (1, 2, 4, 9), (1, 1, 1, 4), (0, 1, 2, 3), dict(size=(5, 7), mode="nearest"),
               torch.bfloat16, path="fused"),
        UpCase("empty-batch-block", (1, 2, 3, 4), (2, 1, 1, 2), (1, 3, 0, 2), dict(size=(5, 3), mode="bilinear",
                                                                                    align_corners=True)),
    ]
    for per_rank in run_ranks(4, run_up_cases, cases):
        assert [r["path"] for r in per_rank] == [None, "local", "fused", "fused", "unfused"], per_rank


@st.composite
def rank_examples(draw):
    """A random geometry (``interp_examples``) on a random ordered subset of 4 ranks splitting the spatial axes."""
    shape, _, kw, _, seed = draw(interp_examples())
    nd = len(shape) - 2
    size = draw(st.integers(1, 4))
    ranks = tuple(draw(st.permutations(range(4)))[:size])
    spatial = [1] * nd
    for f in (2, 2) if size == 4 else (size,) if size > 1 else ():
        spatial[draw(st.integers(0, nd - 1))] *= f
    return UpCase("hypothesis", shape, (1, 1) + tuple(spatial), ranks, kw, seed=seed)


@_settings(15)
@given(rank_examples())
def test_random_geometries_on_random_partitions(case):
    run_ranks(4, run_up_cases, [case])


def _adjoints():
    """<F x, y> = <x, F* y> for the linear layers here: linear / nearest upsampling and average pooling."""
    from distfuse.layers.pool import DistributedAvgPool2d
    from distfuse.testing import adjoint_check

    P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
    shape = (2, 2, 7, 9)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = g[local_slices(shape, P_x.shape, P_x.index)]
    layers = [DistributedUpsample(P_x, size=(17, 4), mode="bilinear"),
              DistributedUpsample(P_x, scale_factor=(1.7, 2.0), mode="nearest-exact"),
              DistributedUpsample(P_x, scale_factor=2, mode="bilinear"),  # torch's kernel on each window
              DistributedAvgPool2d(P_x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)]
    return [adjoint_check(layer, x) for layer in layers]


def test_dot_product_adjoint():
    from tests.tolerances import ADJOINT_RTOL

    for lhs, rhs in run_ranks(4, _adjoints)[0]:
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (lhs, rhs)


# ---------------------------------------------------------------- errors on every rank


def _error_of(fn):
    try:
        fn()
    except DistfuseError as exc:
        return type(exc).__name__, str(exc)
    return None


def _bad_call(scenario: str):
    P_x = grid((0, 1, 2, 3), (1, 1, 2, 2))
    rank = dist.get_rank()
    x = torch.randn(1, 2, 1, 1 if rank in (0, 2) else 0)  # global [1, 2, 2, 1]
    if scenario == "mode_for_dims":
        return _error_of(lambda: DistributedUpsample(P_x, scale_factor=2, mode="linear"))
    if scenario == "bicubic":
        return _error_of(lambda: DistributedUpsample(P_x, scale_factor=2, mode="bicubic"))
    if scenario == "align_corners_nearest":
        return _error_of(lambda: DistributedUpsample(P_x, scale_factor=2, mode="nearest", align_corners=True))
    if scenario == "size_and_scale":
        return _error_of(lambda: DistributedUpsample(P_x, size=4, scale_factor=2))
    if scenario == "size_length":
        return _error_of(lambda: DistributedUpsample(P_x, size=(4, 4, 4)))
    if scenario == "antialias":
        return _error_of(lambda: interpolate(P_x, x, scale_factor=2, mode="bilinear", antialias=True))
    if scenario == "output_extent_zero":  # the global width 1 times 0.5 is 0: torch refuses
        return _error_of(lambda: DistributedUpsample(P_x, scale_factor=0.5)(x))
    if scenario == "partition_dims":
        return _error_of(lambda: DistributedUpsample(grid((0, 1, 2, 3), (4,)), scale_factor=2))
    raise ValueError(scenario)


@pytest.mark.parametrize("scenario,cls", [
    ("mode_for_dims", UnsupportedError), ("bicubic", UnsupportedError), ("align_corners_nearest", UnsupportedError),
    ("size_and_scale", UnsupportedError), ("size_length", UnsupportedError), ("antialias", UnsupportedError),
    ("output_extent_zero", ShapeError), ("partition_dims", PartitionError)])
def test_refused_on_every_rank(scenario, cls):
    errors = run_ranks(4, _bad_call, scenario)
    assert all(e is not None and e[0] == cls.__name__ for e in errors), errors
    assert all("[rank " in e[1] for e in errors), errors


def test_torch_refuses_the_same_arguments():
    x = torch.randn(1, 2, 2, 1)
    with pytest.raises(RuntimeError, match="greater than 0"):
        F.interpolate(x, scale_factor=0.5)
    with pytest.raises(ValueError):
        F.interpolate(x, scale_factor=2, mode="nearest", align_corners=True)
    with pytest.raises(NotImplementedError):
        F.interpolate(x, scale_factor=2, mode="linear")


def test_block_ranges_cover_the_output():
    """The windows the plan stages are the taps' ranges: every output block reads inside its window."""
    spec = InterpSpec.make("test", 1, 17, None, "linear", False, None)
    geo = interp_geometry(spec, (7,), (4,), False, True, "cpu")
    t = geo.taps[0]
    for i in range(4):
        o0, o1 = block_range(17, 4, i)
        a, b = geo.plan.axes[0].needed_range(i)
        assert a == t.i0[o0:o1].min() and b == t.i1[o0:o1].max() + 1
