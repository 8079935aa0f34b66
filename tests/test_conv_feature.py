"""Feature-distributed convolution against the sequential torch.nn.ConvNd (forward, dx, dw, db).

Every geometry runs with the four padding modes, in fp32 and bf16, on the unfused path;
a selection runs on the fused Triton path (interpreted on CPU), and the tests check
``last_path`` so that a silent fallback cannot pass.
"""

import dataclasses

import pytest
import torch

from distfuse.geometry.halo_plan import resolve_padding
from distfuse.testing import run_ranks
from tests.test_conv_support import Case, run_cases

MODES = ["zeros", "reflect", "replicate", "circular"]


def _feature(name, world, grid, shape, cout, kernel, **kw):
    """A feature case on the first volume(grid) of ``world`` ranks."""
    n = 1
    for g in grid:
        n *= g
    return pytest.param(world, Case(name, "feature", shape, cout, kernel, grid, tuple(range(n)), **kw), id=name)


GEOMETRIES = [
    _feature("1d-k3-p1-4w", 4, (1, 1, 4), (2, 3, 17), 4, 3, padding=1),
    _feature("1d-even-k4-same-groups2-3w", 3, (1, 1, 3), (2, 4, 16), 6, 4, padding="same", groups=2),
    _feature("1d-stride2-dil2-4w", 4, (1, 1, 4), (1, 2, 19), 3, 3, stride=2, dilation=2, padding=2),
    _feature("1d-wide-halo-inactive-5w", 5, (1, 1, 4), (1, 2, 9), 3, 5, dilation=2, padding=4),
    _feature("1d-extent3-over-4w", 4, (1, 1, 4), (1, 2, 3), 2, 3, padding=1),
    _feature("1d-batch3-over-2-valid-stride2-6w", 6, (2, 1, 3), (3, 2, 11), 3, 3, stride=2, padding="valid"),
    _feature("1d-1w-nobias", 1, (1, 1, 1), (2, 3, 8), 2, 3, padding=2, bias=False),
    _feature("1d-batch1-over-2-empty-batch-block-2w", 2, (2, 1, 1), (1, 2, 7), 2, 3, padding=1),
    _feature("2d-2x3-k3-6w", 6, (1, 1, 2, 3), (2, 2, 9, 10), 3, 3, padding=1),
    _feature("2d-even-same-depthwise-4w", 4, (1, 1, 2, 2), (1, 4, 8, 7), 8, (2, 4), padding="same", groups=4),
    _feature("2d-batch-stride-dil-4w", 4, (2, 1, 1, 2), (2, 2, 7, 9), 3, 3, stride=(2, 1), dilation=(1, 2),
      padding=(1, 2)),
    _feature("2d-2x4-extent3-stride2-8w", 8, (1, 1, 2, 4), (1, 2, 6, 3), 2, 3, stride=2, padding=1),
    _feature("3d-2x2x2-8w", 8, (1, 1, 2, 2, 2), (1, 2, 5, 6, 7), 2, 3, padding=1),
    _feature("3d-even-stride-1x2x3-inactive-8w", 8, (1, 1, 1, 2, 3), (1, 2, 4, 5, 8), 2, (2, 3, 2), stride=(1, 2, 2),
      padding=(1, 1, 0), bias=False),
    _feature("3d-1x1x6-stride3-inactive-7w", 7, (1, 1, 1, 1, 6), (1, 1, 3, 3, 14), 2, 3, stride=(1, 1, 3),
      padding=1),
]


def _reflect_ok(case: Case) -> bool:
    pads = resolve_padding(case.padding, _tup(case.kernel, case.nd), _tup(case.dilation, case.nd),
                           _tup(case.stride, case.nd))
    return all(max(p) < n for p, n in zip(pads, case.shape[2:]))


def _tup(v, nd):
    return (v,) * nd if isinstance(v, int) else tuple(v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world,case", GEOMETRIES)
def test_feature_conv_matches_sequential(world, case, mode):
    if mode == "reflect" and not _reflect_ok(case):
        pytest.skip("reflect padding must be smaller than the input extent (torch's rule)")
    cases = [dataclasses.replace(case, mode=mode, dtype=dt, path="unfused", seed=s)
             for s, dt in enumerate((torch.float32, torch.bfloat16))]
    results = run_ranks(world, run_cases, cases)
    for r in results:
        for seen in r:
            assert seen["kind"] == f"DistributedFeatureConv{case.nd}d"
            assert seen["path"] == ("unfused" if seen["active"] else None)


FUSED = [
    ("1d-k3-p1-4w", "circular", torch.float32),
    ("1d-even-k4-same-groups2-3w", "reflect", torch.float32),
    ("1d-batch3-over-2-valid-stride2-6w", "zeros", torch.bfloat16),
    ("1d-extent3-over-4w", "replicate", torch.float32),
    ("1d-batch1-over-2-empty-batch-block-2w", "reflect", torch.float32),
    ("2d-2x3-k3-6w", "reflect", torch.bfloat16),
    ("2d-batch-stride-dil-4w", "circular", torch.float32),
    ("3d-2x2x2-8w", "replicate", torch.float32),
]
_BY_NAME = {p.id: p.values for p in GEOMETRIES}


@pytest.mark.parametrize("name,mode,dtype", FUSED, ids=[f"{n}-{m}-{str(d)[6:]}" for n, m, d in FUSED])
def test_feature_conv_fused_path(name, mode, dtype):
    """DISTFUSE_PATH=fused runs the Triton halo conv (interpreted on CPU) and matches the sequential layer."""
    world, case = _BY_NAME[name]
    case = dataclasses.replace(case, mode=mode, dtype=dtype, path="fused", seed=5)
    results = run_ranks(world, run_cases, [case])
    paths = [r[0]["path"] for r in results if r[0]["active"]]
    assert paths and all(p == "fused" for p in paths), paths


def _explain_default(world):
    from tests.test_conv_support import build, with_path

    case = Case("explain", "feature", (1, 2, 8), 2, 3, (1, 1, world), tuple(range(world)), padding=1)
    P_x, _, _, layer = build(case)
    from distfuse.geometry.decomposition import local_shape

    x = torch.randn(local_shape(case.shape, P_x.shape, P_x.index))
    # Inside the rank the children's environment decides, so clear any override there.
    d, y = with_path("auto", lambda: (layer.explain(x), layer(x)))
    return d.path, d.reason, layer.last_path, layer.last_decision.path, tuple(y.shape)


def test_cpu_default_is_unfused_and_explained():
    for path, reason, last, last_decision, _ in run_ranks(2, _explain_default, 2):
        assert path == last == last_decision == "unfused"
        assert "interpreted" in reason
