"""Feature-distributed transposed convolution against torch.nn.ConvTransposeNd on the gathered tensors.

Each case builds ``DistributedConvTransposeNd`` on a (possibly permuted, possibly
partial) set of world ranks, loads a float64 ``torch.nn.ConvTransposeNd``'s parameters
(rounded to the case's dtype), runs forward and backward on fresh random data, gathers
the output, the input gradient and the weight and bias gradients on rank 0 and compares
them with the sequential layer's.  The geometry of the transposed plan is checked
against a brute-force enumeration of which input reaches which output; the layer
against the distributed forward convolution through the adjoint relation; the errors on
every rank; the parameters through load/collect round trips and torch's init.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfuse import PartitionError, ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.geometry.transpose_plan import TransposeAxisGeometry, transpose_plan
from distfuse.layers._params import collect_sequential, load_sequential
from distfuse.layers.conv_feature import DistributedFeatureConv2d
from distfuse.layers.conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
)
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import adjoint_check, run_ranks
from tests.test_conv_support import close, grid
from tests.tolerances import ADJOINT_RTOL

LAYER = {1: DistributedConvTranspose1d, 2: DistributedConvTranspose2d, 3: DistributedConvTranspose3d}
SEQUENTIAL = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@dataclass(frozen=True)
class Case:
    """One configuration: the global input shape, P_x's shape and its world ranks (row-major)."""

    name: str
    shape: tuple
    out_channels: int
    kernel: object
    grid: tuple
    ranks: tuple
    stride: object = 1
    padding: object = 0
    output_padding: object = 0
    dilation: object = 1
    groups: int = 1
    bias: bool = True
    dtype: torch.dtype = torch.float64
    seed: int = 0

    @property
    def nd(self) -> int:
        return len(self.shape) - 2

    def torch_args(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding,
                    groups=self.groups, bias=self.bias, dilation=self.dilation)


def run_case(c: Case) -> dict:
    """Forward + all gradients of one case on this rank; rank 0 compares the gathered results."""
    rank = dist.get_rank()
    P_x = grid(c.ranks, c.grid)
    layer = LAYER[c.nd](P_x, c.shape[1], c.out_channels, c.kernel, dtype=c.dtype, **c.torch_args())
    torch.manual_seed(1000 + c.seed)
    seq = SEQUENTIAL[c.nd](c.shape[1], c.out_channels, c.kernel, dtype=torch.float64, **c.torch_args())
    with torch.no_grad():  # the reference holds exactly the parameters the distributed layer can hold
        for p in seq.parameters():
            p.copy_(p.to(c.dtype).double())
    load_sequential(layer, seq if rank == 0 else None)
    gen = torch.Generator().manual_seed(77 + c.seed)
    xg = torch.randn(c.shape, generator=gen, dtype=torch.float64).to(c.dtype).double().requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    yg.backward(dyg)

    if P_x.active:
        x = xg.detach()[local_slices(c.shape, P_x.shape, P_x.index)].to(c.dtype).requires_grad_(True)
    else:
        x = zero_volume_tensor(dtype=c.dtype)
    y = layer(x)
    if P_x.active:
        want = local_shape(tuple(yg.shape), P_x.shape, P_x.index)
        assert tuple(y.shape) == want, f"output block {tuple(y.shape)}, expected {want}"
        assert y.dtype == c.dtype
        y.backward(dyg[local_slices(tuple(yg.shape), P_x.shape, P_x.index)].to(c.dtype))
    else:
        assert y.numel() == 0, f"a worker outside P_x returned {tuple(y.shape)}"
    y_full = collect_tensor(y.detach() if P_x.active else None, P_x)
    dx_full = collect_tensor(x.grad if P_x.active else None, P_x)
    grads = {}
    for lay in layer.param_layouts():
        local = getattr(layer, lay.name).grad if lay.P.active else None
        if lay.P.active:
            assert local is not None, f"no gradient for {lay.name} on its owner"
        grads[lay.seq_name] = collect_tensor(local, lay.P)
    if rank == 0:
        close("output", y_full, yg.detach(), c.dtype)
        close("input gradient", dx_full, xg.grad, c.dtype)
        for name, g in grads.items():
            close(f"{name} gradient", g, getattr(seq, name).grad, c.dtype)
    return dict(active=P_x.active, out=tuple(y.shape), nan=bool(torch.isnan(y).any()))


def run_cases(cases) -> list[dict]:
    out = []
    for c in cases:
        try:
            out.append(run_case(c))
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.dtype}] {exc}") from exc
    return out


def _case(world, name, shape, cout, kernel, grid_shape, ranks=None, **kw):
    ranks = tuple(range(math.prod(grid_shape))) if ranks is None else tuple(ranks)
    return pytest.param(world, Case(name, shape, cout, kernel, grid_shape, ranks, **kw), id=name)


GEOMETRIES = [
    _case(1, "1d-1w-k3-s2-p1-op1", (2, 3, 5), 4, 3, (1, 1, 1), stride=2, padding=1, output_padding=1),
    _case(1, "3d-1w-mixed-nobias", (1, 2, 3, 2, 3), 2, (2, 3, 1), (1, 1, 1, 1, 1), stride=(2, 1, 3),
          padding=(0, 1, 0), output_padding=(1, 0, 2), bias=False),
    _case(2, "1d-2w-permuted-k4-s2-p1", (1, 2, 7), 3, 4, (1, 1, 2), (1, 0), stride=2, padding=1),
    _case(2, "2d-batch3-over-2", (3, 2, 3, 4), 2, 3, (2, 1, 1, 1), (1, 0), stride=2),
    _case(2, "1d-batch1-over-2-empty-batch-block", (1, 2, 5), 2, 3, (2, 1, 1), stride=2, padding=1),
    _case(3, "1d-3w-groups2-dil2-op1-uneven", (2, 4, 8), 6, 3, (1, 1, 3), (2, 0, 1), stride=2, dilation=2,
          padding=2, output_padding=1, groups=2),
    _case(3, "1d-3w-op-lt-dilation-stride1", (1, 2, 5), 3, 2, (1, 1, 3), dilation=3, output_padding=2, padding=1),
    _case(4, "2d-2x2-permuted-uneven-mixed", (2, 2, 5, 7), 3, (3, 4), (1, 1, 2, 2), (3, 1, 0, 2), stride=(2, 3),
          padding=(1, 2), output_padding=(1, 0)),
    _case(4, "1d-4w-extent2-below-partition", (1, 2, 2), 3, 2, (1, 1, 4), stride=2),
    _case(4, "1d-4w-output-below-partition-empty-blocks", (1, 3, 4), 2, 1, (1, 1, 4), (2, 3, 0, 1), padding=1),
    _case(4, "1d-4w-depthwise-stride-gt-kernel", (2, 4, 6), 8, 2, (1, 1, 4), stride=3, groups=4, output_padding=2),
    _case(5, "1d-4of5-inactive-gap-blocks", (1, 2, 3), 2, 1, (1, 1, 4), (4, 2, 0, 1), stride=4),
    _case(6, "2d-2x3-permuted-k4-s2-p1", (1, 2, 5, 7), 2, 4, (1, 1, 2, 3), (5, 3, 1, 0, 2, 4), stride=2,
          padding=1),
    _case(6, "2d-3w-halo-wider-than-blocks-inactive", (1, 2, 4, 9), 2, (1, 5), (1, 1, 1, 3), (4, 1, 3), dilation=3),
    _case(8, "3d-2x2x2-k3-s2-p1-op1", (1, 2, 3, 4, 5), 2, 3, (1, 1, 2, 2, 2), (7, 6, 5, 4, 3, 2, 1, 0), stride=2,
          padding=1, output_padding=1),
    _case(8, "1d-7of8-k3-s3-op2", (1, 1, 10), 2, 3, (1, 1, 7), (1, 2, 3, 4, 5, 6, 7), stride=3, output_padding=2),
]
_BY_NAME = {p.id: p.values for p in GEOMETRIES}
LOW_PRECISION = ["2d-2x2-permuted-uneven-mixed", "1d-3w-groups2-dil2-op1-uneven", "3d-2x2x2-k3-s2-p1-op1",
                 "1d-4of5-inactive-gap-blocks"]


def _grouped_by_world(names, dtypes):
    """One rank-pool call per world size (a call costs far more than a tiny case)."""
    by_world: dict[int, list[Case]] = {}
    for name in names:
        world, case = _BY_NAME[name]
        by_world.setdefault(world, []).extend(replace(case, dtype=dt, seed=i) for i, dt in enumerate(dtypes))
    return [pytest.param(w, cases, id=f"{w}w-" + "+".join(dict.fromkeys(c.name for c in cases)))
            for w, cases in sorted(by_world.items())]


@pytest.mark.parametrize("world,cases", _grouped_by_world([p.id for p in GEOMETRIES], [torch.float64]))
def test_matches_sequential_fp64(world, cases):
    results = run_ranks(world, run_cases, cases)
    for k, c in enumerate(cases):
        active = [r[k]["active"] for r in results]
        assert sum(active) == len(c.ranks), (c.name, active)
        assert not any(r[k]["nan"] for r in results), c.name


@pytest.mark.parametrize("world,cases", _grouped_by_world(LOW_PRECISION, [torch.float16, torch.bfloat16]))
def test_matches_sequential_16bit(world, cases):
    run_ranks(world, run_cases, cases)


def test_empty_and_unreached_blocks_are_exercised():
    """The named edge cases really have workers with empty output blocks, no inputs, or no reaching input."""
    def axis(name, a=-1):
        _, c = _BY_NAME[name]
        t = (lambda v: (v,) * c.nd if isinstance(v, int) else tuple(v))
        return TransposeAxisGeometry(c.shape[a], c.grid[a], t(c.kernel)[a], t(c.stride)[a], t(c.dilation)[a],
                                     t(c.padding)[a], t(c.padding)[a], "zeros", t(c.output_padding)[a])

    empty_out = axis("1d-4w-output-below-partition-empty-blocks")
    assert empty_out.m == 2 and [empty_out.output_range(i) for i in (2, 3)] == [(2, 2), (2, 2)]
    no_input = axis("1d-4w-extent2-below-partition")
    assert [no_input.input_range(i) for i in (2, 3)] == [(2, 2), (2, 2)]
    assert [no_input.needed_range(i) for i in (2, 3)] == [(1, 2), (1, 2)]  # outputs served from a neighbour
    gaps = axis("1d-4of5-inactive-gap-blocks")
    assert gaps.m == 9 and gaps.output_range(2) == (5, 7) and gaps.needed_range(2) == (0, 0)
    wide = axis("2d-3w-halo-wider-than-blocks-inactive")
    assert wide.needed_range(0)[1] > wide.input_range(1)[1]  # worker 0 reads past its neighbour's whole block


# ------------------------------------------------------------------ geometry


def test_plan_is_the_exact_hull_of_reaching_inputs():
    """Brute force: the staged range is the hull of the inputs that reach each output block, and the window
    of the local transposed convolution holds every output they write."""
    seen = 0
    for n, p, k, s, d, pad in itertools.product(range(1, 7), (1, 2, 3, 5), (1, 2, 3), (1, 2, 4), (1, 3), (0, 1, 3)):
        for q in range(max(s, d)):
            m = (n - 1) * s - 2 * pad + d * (k - 1) + q + 1
            if m < 1:
                with pytest.raises(ShapeError, match="output extent"):
                    TransposeAxisGeometry(n, p, k, s, d, pad, pad, "zeros", q)
                continue
            ax = TransposeAxisGeometry(n, p, k, s, d, pad, pad, "zeros", q)
            assert ax.m == m
            for w in range(p):
                o0, o1 = ax.output_range(w)
                reach = [i for i in range(n) for t in range(k) if o0 <= i * s - pad + t * d < o1]
                a, b = ax.needed_range(w)
                assert (a, b) == ((min(reach), max(reach) + 1) if reach else (0, 0)), (n, p, k, s, d, pad, q, w)
                start, stop = ax.window(w)
                assert all(start <= i * s - pad + t * d < stop for i in range(a, b) for t in range(k))
                lo, hi = ax.block_pads(w)
                assert stop - start + lo + hi == o1 - o0
                seen += 1
    assert seen > 2000


def test_plan_pieces_copy_only_and_tile_the_staged_block():
    plan = transpose_plan((5, 7), (2, 3), (3, 4), (2, 3), (1, 2), (1, 2), (1, 0))
    for index in plan.blocks():
        covered = 0
        for pc in plan.pieces(index):
            assert pc.src is not None and set(pc.steps) <= {1}, pc  # no zero fill, no reflect/replicate
            covered += math.prod(pc.shape)
        assert covered == math.prod(plan.staged_shape(index))


# ------------------------------------------------------------------ adjoint relation


def _adjoints():
    """<ConvT v, u> = <v, Conv u> with the same weight, and the autograd dot-product test of ConvT itself."""
    rank = dist.get_rank()
    P_x = grid((3, 1, 0, 2), (1, 1, 2, 2))
    torch.manual_seed(3)
    # ConvT: [B, 3, 5, 6] -> [B, 2, 9, 12] (k 3, s 2, p 1, op (0, 1)), the conv maps [B, 2, 9, 12] back to [B, 3, 5, 6]
    convt = DistributedConvTranspose2d(P_x, 3, 2, 3, stride=2, padding=1, output_padding=(0, 1), bias=False,
                                       dtype=torch.float64)
    conv = DistributedFeatureConv2d(P_x, 2, 3, 3, stride=2, padding=1, bias=False, dtype=torch.float64)
    seq_w = collect_sequential(convt)
    load_sequential(conv, seq_w)  # the same [3, 2, 3, 3] tensor: conv's [C_out, C_in, k] is ConvT's [C_in, C_out, k]
    gen = torch.Generator().manual_seed(11 + rank)
    v = torch.randn(local_shape((2, 3, 5, 6), P_x.shape, P_x.index), generator=gen, dtype=torch.float64)
    u = torch.randn(local_shape((2, 2, 9, 12), P_x.shape, P_x.index), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        sums = torch.stack([(convt(v) * u).sum(), (v * conv(u)).sum()])
    dist.all_reduce(sums)
    out = {"convT-vs-conv": (float(sums[0]), float(sums[1]))}
    P_1d = grid((2, 0, 1), (1, 1, 3))
    layer = DistributedConvTranspose1d(P_1d, 2, 3, 4, stride=3, padding=2, dilation=2, output_padding=1, bias=False,
                                       dtype=torch.float64)
    x = torch.randn(local_shape((2, 2, 7), P_1d.shape, P_1d.index), generator=gen, dtype=torch.float64) \
        if P_1d.active else zero_volume_tensor(dtype=torch.float64)
    out["autograd"] = adjoint_check(layer, x)
    return out


def test_dot_product_adjoints():
    for name, (lhs, rhs) in run_ranks(4, _adjoints)[0].items():
        assert abs(lhs) > 1e-3, name
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), abs(rhs)), (name, lhs, rhs)


# ------------------------------------------------------------------ errors


def _errors():
    """Construction errors before any collective; call errors after the metadata gather, on every P_x worker."""
    rank = dist.get_rank()
    P_x = grid((2, 0), (1, 1, 2))
    out = {}
    checks = {
        "padding-mode": lambda: DistributedConvTranspose1d(P_x, 2, 2, 3, padding_mode="reflect"),
        "output-padding": lambda: DistributedConvTranspose1d(P_x, 2, 2, 3, stride=2, output_padding=2),
        "string-padding": lambda: DistributedConvTranspose1d(P_x, 2, 2, 3, padding="same"),
        "pair-padding": lambda: DistributedConvTranspose1d(P_x, 2, 2, 3, padding=((1, 2),)),
        "groups": lambda: DistributedConvTranspose1d(P_x, 4, 2, 3, groups=4),
        "channel-split": lambda: DistributedConvTranspose1d(grid((0, 1), (1, 2, 1)), 2, 2, 3),
        "partition-dims": lambda: DistributedConvTranspose2d(P_x, 2, 2, 3),
    }
    layer = DistributedConvTranspose1d(P_x, 2, 3, 1, padding=1)
    calls = {
        "output-too-small": lambda: layer(torch.randn(1, 2, 1) if P_x.active else zero_volume_tensor()),
        "channels": lambda: layer(torch.randn(1, 3, 3) if P_x.active else zero_volume_tensor()),
        "unbalanced": lambda: layer(torch.randn(1, 2, 4 if rank == 2 else 1) if P_x.active else zero_volume_tensor()),
        "inactive-data": lambda: layer(torch.randn(1, 2, 3)),
    }
    for name, fn in {**checks, **calls}.items():
        try:
            fn()
        except (PartitionError, ShapeError, UnsupportedError) as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("no error", "")
    return out


def test_bad_geometry_raises_on_every_rank():
    expected = {
        "padding-mode": ("UnsupportedError", "'zeros'"),
        "output-padding": ("UnsupportedError", "smaller than either stride or dilation"),
        "string-padding": ("UnsupportedError", "padding must be"),
        "pair-padding": ("UnsupportedError", "padding must be"),
        "groups": ("ShapeError", "groups"),
        "channel-split": ("PartitionError", "unsplit along channels"),
        "partition-dims": ("PartitionError", "dimensions of P_x"),
        "output-too-small": ("ShapeError", "global output extent"),
        "channels": ("ShapeError", "input channels"),
        "unbalanced": ("ShapeError", "balanced decomposition"),
    }
    results = run_ranks(3, _errors)
    for rank, got in enumerate(results):
        for name, (cls, fragment) in expected.items():
            if name in ("output-too-small", "channels", "unbalanced") and rank == 1:
                assert got[name] == ("no error", ""), (name, got[name])  # outside P_x: takes no part in the call
                continue
            assert got[name][0] == cls and fragment in got[name][1], (rank, name, got[name])
            assert f"[rank {rank}]" in got[name][1] and "DistributedConvTranspose" in got[name][1], got[name]
    # A rank outside P_x that passes data is refused there; P_x's workers (whose blocks are fine) are not held up.
    assert results[1]["inactive-data"][0] == "ShapeError" and "zero-volume" in results[1]["inactive-data"][1]
    assert results[0]["inactive-data"] == results[2]["inactive-data"] == ("no error", "")


def test_torch_refuses_the_same_geometry():
    """What the layer refuses, torch refuses (so the refusals are not distfuse's own restrictions)."""
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose1d(2, 2, 3, padding_mode="reflect")
    with pytest.raises(RuntimeError, match="output padding must be smaller"):
        nn.ConvTranspose1d(2, 2, 3, stride=2, output_padding=2)(torch.randn(1, 2, 3))
    with pytest.raises(RuntimeError, match="too small"):
        nn.ConvTranspose1d(2, 3, 1, padding=1)(torch.randn(1, 2, 2))
    with pytest.raises(ValueError, match="groups"):
        nn.ConvTranspose1d(4, 2, 3, groups=4)
    for padding in ("same", ((1, 2),)):  # torch builds these and fails at the first call
        with pytest.raises(TypeError, match="padding"):
            nn.ConvTranspose1d(2, 2, 3, padding=padding)(torch.randn(1, 2, 5))


# ------------------------------------------------------------------ parameters


def _parameters():
    """torch's init with the same seed, the generators in step, and sequential round trips (root = rank 2)."""
    rank = dist.get_rank()
    P_x = grid((2, 0, 1), (1, 1, 1, 3))
    torch.manual_seed(123)
    layer = DistributedConvTranspose2d(P_x, 4, 6, (3, 2), stride=2, groups=2)
    after_dist = torch.rand(3)
    torch.manual_seed(123)
    seq = nn.ConvTranspose2d(4, 6, (3, 2), stride=2, groups=2)
    after_seq = torch.rand(3)
    ok = torch.equal(after_dist, after_seq)
    state = collect_sequential(layer)
    if rank == 0:
        ok = ok and state.keys() == seq.state_dict().keys()
        ok = ok and all(torch.equal(state[k], v) for k, v in seq.state_dict().items())
    other = nn.ConvTranspose2d(4, 6, (3, 2), stride=2, groups=2)
    load_sequential(layer, other if rank == 0 else None)
    back = collect_sequential(layer)
    if rank == 0:
        ok = ok and all(torch.equal(back[k], v) for k, v in other.state_dict().items())
    ok = ok and (layer.weight is not None) == (rank == 2)
    return ok


def test_parameters_match_torch_and_round_trip():
    assert all(run_ranks(3, _parameters))


# ------------------------------------------------------------------ static shapes


def _static_shapes(static: bool):
    """The metadata gather runs only when a local shape changes (with or without static_shapes); results stay right."""
    rank = dist.get_rank()
    P_x = grid((1, 0), (1, 1, 2))
    layer = DistributedConvTranspose1d(P_x, 2, 3, 4, stride=2, padding=1, dtype=torch.float64, static_shapes=static)
    torch.manual_seed(8)
    seq = nn.ConvTranspose1d(2, 3, 4, stride=2, padding=1, dtype=torch.float64)
    load_sequential(layer, seq if rank == 0 else None)
    for n in (7, 7, 9):
        xg = torch.randn(2, 2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].requires_grad_(True)
        y = layer(x)
        y.backward(torch.ones_like(y))
        yg = collect_tensor(y.detach(), P_x)
        dx = collect_tensor(x.grad, P_x)
        if rank == 0:
            xr = xg.clone().requires_grad_(True)
            ref = seq(xr)
            ref.backward(torch.ones_like(ref))
            close(f"static output n={n}", yg, ref.detach(), torch.float64)
            close(f"static input gradient n={n}", dx, xr.grad, torch.float64)
    return layer.agreement.calls, layer.agreement.slow_calls


@pytest.mark.parametrize("static", [True, False])
def test_static_shapes_skip_the_gather_and_stay_right(static):
    assert run_ranks(2, _static_shapes, static) == [(3, 2)] * 2  # n = 7 (gathered), 7 (agreed), 9 (gathered)


# ------------------------------------------------------------------ benchmark smoke


def test_bench_smoke():
    from bench import bench_conv_transpose

    rows = bench_conv_transpose.run(smoke=True, world_size=2, dtype=torch.float32)
    seen = {(r.op, r.mode, r.provider) for r in rows}
    ops = {r.op for r in rows}
    assert ops and all((op, mode, prov) in seen for op in ops for mode in ("full", "fwd")
                       for prov in ("distfuse", "distfuse_static", bench_conv_transpose.ANCHOR))
    for r in rows:
        assert r.ms_q20 <= r.ms <= r.ms_q80 and r.ms > 0, r
        assert r.anchor == bench_conv_transpose.ANCHOR and r.ratio > 0, r
        assert "not a GPU result" in r.extra["timing"], r
