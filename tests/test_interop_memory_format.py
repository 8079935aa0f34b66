"""Memory format: a channels_last input gives a channels_last output wherever torch.nn's convolution does.

``torch.nn.Conv2d`` on a ``channels_last`` input returns a ``channels_last`` output (and a
``channels_last`` input gradient); torch 2.13's CPU ``Conv3d`` returns NCDHW for
``channels_last_3d``, so the reference is asked each time rather than assumed.  The
distributed convolutions stage the halo in the input's format, move the channel and
general forms' blocks in the format their workers agreed on, and sum the partial outputs
into a buffer in the format torch's convolution returns.  One deliberate difference:
torch.nn's ``padding_mode="circular"`` returns NCHW for a channels_last input (its
``F.pad`` drops the layout); the distributed layers keep channels_last there.

Checked here, on fresh data against the float64 ``torch.nn`` layer on the gathered
tensors: the output's and the input gradient's formats, the values of the output and of
every gradient (uneven splits, permuted rank orders, inactive ranks, a world of 6, fp16
and bf16), the same on the fused halo convolution (which indexes channels_last blocks
natively), and that a channels_last block is never copied to NCHW on the way, on either
path of the feature convolution (a dispatch mode counts the copies made of the input's
memory).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import load_sequential
from distfuse.layers.conv import DistributedConv2d, DistributedConv3d
from distfuse.partition import zero_volume_tensor
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing import run_ranks
from tests.test_conv_support import Case, build, close, grid, sequential, sum_terms, with_path

FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _formats(kind, nd):
    layer_cls = {2: DistributedConv2d, 3: DistributedConv3d}[nd]
    shape = (2, 4, 6, 5) if nd == 2 else (1, 4, 5, 4, 3)
    fmt = FORMATS[len(shape)]
    g = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    ones = (1,) * (nd - 1)
    if kind == "feature":
        P_x = P_y = grid(range(4), (1, 1, 2, 2) + ones[1:])
        layer = layer_cls(P_x, 4, 6, 3, padding=1)
    elif kind == "channel":
        P_x, P_y = grid((0, 1), (1, 2, 1) + ones), grid((2, 3), (1, 2, 1) + ones)
        layer = layer_cls(P_x, 4, 6, 3, padding=1, P_y=P_y, P_w=grid(range(4), (2, 2, 1) + ones))
    else:
        P_x = P_y = grid((0, 1), (1, 1, 2) + ones)
        layer = layer_cls(P_x, 4, 6, 3, padding=1, P_y=P_y, P_w=grid((0, 1), (1, 1, 2) + ones))
    seq = {2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[nd](4, 6, 3, padding=1)
    want = seq(g.contiguous(memory_format=fmt)).is_contiguous(memory_format=fmt)
    x = g[local_slices(g.shape, P_x.shape, P_x.index)].contiguous(memory_format=fmt) if P_x.active else \
        torch.empty(0)
    y = layer(x)
    got = y.is_contiguous(memory_format=fmt) if P_y.active and y.numel() else want
    return want, got


# torch 2.13's CPU Conv3d returns NCDHW for a channels_last_3d input, so there the layers must return NCDHW too.
CASES = [pytest.param(kind, nd, id=f"{kind}-{nd}d") for nd in (2, 3) for kind in ("feature", "channel", "general")]


@pytest.mark.parametrize("kind,nd", CASES)
def test_output_memory_format_follows_torch(kind, nd):
    results = run_ranks(4, _formats, kind, nd)
    assert len({want for want, _ in results}) == 1
    for want, got in results:
        assert got == want


# ------------------------------------------------------------------ values and gradients in channels_last


def _is_fmt(t: torch.Tensor, fmt) -> bool:
    return t.is_contiguous(memory_format=fmt)


def _run_channels_last(c: Case, nchw_ranks: tuple = ()) -> dict:
    """Parity of one case with a channels_last input: values, every gradient, output and input-gradient formats.
    ``nchw_ranks``: world ranks whose block is NCHW instead (the workers then agree on NCHW)."""
    rank = dist.get_rank()
    fmt = FORMATS[len(c.shape)]
    P_x, P_out, _, layer = build(c)
    torch.manual_seed(1000 + c.seed)
    seq = sequential(c)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(p.to(c.dtype).double())
    load_sequential(layer, seq if rank == 0 else None)
    gen = torch.Generator().manual_seed(77 + c.seed)
    xg = torch.randn(c.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    xg = xg.contiguous(memory_format=fmt).requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    yg.backward(dyg.contiguous(memory_format=fmt))
    # what torch.nn does with this layout (asked in the case's dtype class: fp64 CPU conv keeps the format too)
    want_y, want_dx = _is_fmt(yg, fmt), _is_fmt(xg.grad, fmt)
    if P_x.active:
        x = xg.detach()[local_slices(c.shape, P_x.shape, P_x.index)].to(c.dtype)
        x = x.contiguous(memory_format=torch.contiguous_format if rank in nchw_ranks else fmt).requires_grad_(True)
    else:
        x = zero_volume_tensor(dtype=c.dtype)
    y = with_path(c.path, lambda: layer(x))
    got_y = got_dx = None
    if P_out.active:
        assert tuple(y.shape) == local_shape(tuple(yg.shape), P_out.shape, P_out.index)
        got_y = _is_fmt(y, fmt) if y.numel() else None
        dy = dyg[local_slices(tuple(yg.shape), P_out.shape, P_out.index)].to(c.dtype).contiguous(memory_format=fmt)
    else:
        dy = torch.zeros_like(y)
    if y.requires_grad:
        y.backward(dy)
    if P_x.active and x.numel():
        got_dx = _is_fmt(x.grad, fmt)
    y_full = collect_tensor(y.detach() if P_out.active else None, P_out)
    dx_full = collect_tensor(x.grad if P_x.active else None, P_x)
    grads = {}
    for lay in layer.param_layouts():
        grads[lay.seq_name] = collect_tensor(getattr(layer, lay.name).grad if lay.P.active else None, lay.P)
    if rank == 0:
        terms = sum_terms(seq, yg, c.groups)
        close(f"{c.name}: output", y_full, yg.detach(), c.dtype, terms)
        close(f"{c.name}: input gradient", dx_full, xg.grad, c.dtype, terms)
        for name, g in grads.items():
            close(f"{c.name}: {name} gradient", g, getattr(seq, name).grad, c.dtype, terms, partials=P_x.size)
    return dict(want_y=want_y, want_dx=want_dx, got_y=got_y, got_dx=got_dx,
                path=getattr(layer, "last_path", None), reason=getattr(layer, "last_decision", None))


def _run_cases(cases):
    return [_run_channels_last(c) for c in cases]


_FEATURE = Case("feature-2x2-uneven-permuted", "feature", (2, 3, 7, 5), 4, 3, (1, 1, 2, 2), (3, 1, 0, 2), padding=1)
_PARITY = {
    4: [
        _FEATURE,
        dataclasses.replace(_FEATURE, name="feature-stride2-reflect-fp16", stride=2, mode="reflect",
                            dtype=torch.float16, seed=1),
        dataclasses.replace(_FEATURE, name="feature-bf16-nobias", bias=False, dtype=torch.bfloat16, seed=2),
        Case("channel-circular-permuted", "channel", (2, 5, 5, 4), 3, 3, (1, 2, 1, 1), (1, 0), grid_y=(1, 2, 1, 1),
             y_ranks=(2, 3), grid_w=(2, 2, 1, 1), w_ranks=(3, 0, 2, 1), padding=1, mode="circular", seed=3),
        Case("general-2x1-uneven", "general", (1, 3, 7, 4), 5, 3, (1, 1, 2, 1), (2, 0), grid_y=(1, 2, 2, 1),
             y_ranks=(0, 1, 3, 2), grid_w=(2, 1, 2, 1), w_ranks=(1, 0, 2, 3), padding=(1, 0), seed=4),
        Case("feature-3d", "feature", (1, 2, 5, 4, 3), 3, 3, (1, 1, 2, 1, 2), (0, 2, 1, 3), padding=1, seed=5),
    ],
    6: [
        Case("feature-3x1-inactive", "feature", (1, 3, 8, 5), 2, 3, (1, 1, 3, 1), (5, 2, 0), padding=1, seed=6),
        Case("general-inactive-fp16", "general", (1, 4, 6, 5), 3, 3, (1, 2, 1, 1), (4, 1), grid_y=(1, 1, 1, 1),
             y_ranks=(3,), grid_w=(1, 2, 1, 1), w_ranks=(0, 5), padding=1, dtype=torch.float16, seed=7),
    ],
}


@pytest.mark.parametrize("world", sorted(_PARITY), ids=lambda w: f"world{w}")
def test_channels_last_parity_and_formats(world):
    results = run_ranks(world, _run_cases, _PARITY[world])
    for k, c in enumerate(_PARITY[world]):
        for rank, per_rank in enumerate(results):
            r = per_rank[k]
            # torch.nn's circular padding drops channels_last (its F.pad returns NCHW in torch 2.13, the
            # convolution follows); distfuse pads the halo in the block's layout and keeps it.
            circular_2d = c.mode == "circular" and c.nd == 2
            if r["got_y"] is not None:
                assert r["got_y"] == (r["want_y"] or circular_2d), f"{c.name} rank {rank}: output format"
            if r["got_dx"] is not None and not circular_2d:
                assert r["got_dx"] == r["want_dx"], f"{c.name} rank {rank}: input-gradient format differs"
        if c.nd == 2 and c.mode != "circular":  # torch keeps the layout here: the check above had teeth
            assert results[0][k]["want_y"], f"{c.name}: torch.nn returned NCHW; the case tests nothing"


_FUSED = [
    dataclasses.replace(_FEATURE, name="fused-2d-uneven-permuted", path="fused"),
    dataclasses.replace(_FEATURE, name="fused-2d-stride2-reflect-fp16", path="fused", stride=2, mode="reflect",
                        dtype=torch.float16, seed=1),
    dataclasses.replace(_FEATURE, name="fused-2d-replicate-bf16-nobias", path="fused", mode="replicate", bias=False,
                        dtype=torch.bfloat16, seed=2),
    Case("fused-3d-circular", "feature", (1, 2, 5, 4, 3), 3, 3, (1, 1, 2, 1, 2), (0, 2, 1, 3), padding=1,
         mode="circular", path="fused", seed=5),
]


_FUSED_WORLDS = {
    4: _FUSED,
    1: [Case("fused-1-circular-self-wrap", "feature", (2, 3, 5, 4), 2, 3, (1, 1, 1, 1), (0,), padding=1,
             mode="circular", path="fused", seed=8)],
    6: [Case("fused-3x1-inactive-reflect", "feature", (1, 3, 8, 5), 2, 3, (1, 1, 3, 1), (5, 2, 0), padding=1,
             mode="reflect", path="fused", seed=9)],
    8: [Case("fused-3d-2x2x2-replicate-bf16", "feature", (1, 2, 4, 5, 4), 3, 3, (1, 1, 2, 2, 2),
             (7, 1, 4, 2, 0, 6, 3, 5), padding=1, mode="replicate", dtype=torch.bfloat16, path="fused", seed=10)],
}


def _fused_channels_last(world):
    return [_run_channels_last(c) for c in _FUSED_WORLDS[world]]


def _fused_mixed_formats():
    c = dataclasses.replace(_FEATURE, name="fused-mixed-formats", path="fused", mode="reflect", seed=11)
    r = _run_channels_last(c, nchw_ranks=(1, 2))
    return r["path"]


def test_fused_path_with_mixed_formats_agrees_on_one():
    """Workers whose blocks differ in format (two channels_last, two NCHW) agree on NCHW for the halo boxes'
    order, so the fused path computes the same values and gradients as torch.nn (checked on rank 0), never one
    worker's boxes read in another's order."""
    pytest.importorskip("triton")
    assert run_ranks(4, _fused_mixed_formats) == ["fused"] * 4


@pytest.mark.parametrize("world", sorted(_FUSED_WORLDS), ids=lambda w: f"world{w}")
def test_fused_path_runs_channels_last(world):
    """The fused halo convolution takes channels_last blocks on the fused path: values and every gradient against
    torch.nn (checked on rank 0 inside the run), the output in torch.nn's format, the input gradient channels
    last, over uneven splits, permuted ranks, inactive ranks, worlds of 1 to 8 and every padding mode."""
    pytest.importorskip("triton")
    results = run_ranks(world, _fused_channels_last, world)
    for k, c in enumerate(_FUSED_WORLDS[world]):
        for rank, per_rank in enumerate(results):
            r = per_rank[k]
            assert r["path"] in ("fused", None), f"{c.name} rank {rank}: {r['reason']}"  # None: inactive
            if r["got_y"] is not None and not (c.mode == "circular" and c.nd == 2):
                assert r["got_y"] == r["want_y"], f"{c.name} rank {rank}: output format"
            if r["got_dx"] is not None:
                assert r["got_dx"], f"{c.name} rank {rank}: the input gradient is not channels last"
        assert any(per_rank[k]["path"] == "fused" for per_rank in results), c.name


# ------------------------------------------------------------------ no copy of a channels_last block


class _CopiesOf(TorchDispatchMode):
    """Counts the ops that copy a whole tensor living in ``storage`` into a new one (clone, contiguous, to).

    The staging itself (``copy_`` of the block into the staged buffer) is the one copy the
    halo exchange must make, and is not counted; nor is a ``to`` another dtype (16-bit blocks
    computed in fp32 are converted whatever their layout).
    """

    COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.contiguous.default}

    def __init__(self, storage_ptr: int, numel: int):
        super().__init__()
        self.ptr, self.numel, self.copies = storage_ptr, numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if func in self.COPIES else None
        if isinstance(src, torch.Tensor) and kwargs.get("dtype", src.dtype) != src.dtype:
            src = None
        if isinstance(src, torch.Tensor) and src.numel() == self.numel and src.numel() and \
                src.untyped_storage().data_ptr() == self.ptr:
            self.copies.append(str(func))
        return func(*args, **kwargs)


def _copies_of_input(kind: str):
    fmt = torch.channels_last
    shape = (2, 4, 6, 5)
    if kind in ("feature", "feature-fused"):
        P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
        layer = DistributedConv2d(P_x, 4, 3, 3, padding=1)
    else:
        P_x = grid((0, 1), (1, 2, 1, 1))
        layer = DistributedConv2d(P_x, 4, 3, 3, padding=1, P_y=grid((2, 3), (1, 2, 1, 1)),
                                  P_w=grid((3, 2, 1, 0), (2, 2, 1, 1)))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    if P_x.active:
        x = g[local_slices(shape, P_x.shape, P_x.index)].contiguous(memory_format=fmt)
    else:
        x = zero_volume_tensor()
    def call():
        return with_path("fused", lambda: layer(x)) if kind == "feature-fused" else layer(x)

    call()  # first call: the metadata gather; the counted call below is the steady state
    mode = _CopiesOf(x.untyped_storage().data_ptr(), x.numel())
    with mode:
        call()
    assert kind != "feature-fused" or not P_x.active or layer.last_path == "fused", layer.last_decision
    with_nchw = _CopiesOf(0, -1)
    if P_x.active:  # the control: an NCHW-forcing staging would show up as a clone of the block
        with _CopiesOf(x.untyped_storage().data_ptr(), x.numel()) as with_nchw:
            x.contiguous()
    return mode.copies, with_nchw.copies, P_x.active


@pytest.mark.parametrize("kind", ["feature", "feature-fused", "channel"])
def test_channels_last_input_is_not_copied(kind):
    if kind == "feature-fused":
        pytest.importorskip("triton")
    for copies, control, active in run_ranks(4, _copies_of_input, kind):
        assert copies == [], f"the layer copied the whole channels_last block: {copies}"
        if active:
            assert control, "the copy counter did not see x.contiguous() (the check has no teeth)"


# ------------------------------------------------------------------ upsampling and group norm


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    """A layer without a convolution fed a channels_last block: ``kind`` "upsample" (``kw``: nn.Upsample's) or
    "groupnorm" (``kw``: num_groups)."""

    name: str
    kind: str
    shape: tuple
    grid_x: tuple
    x_ranks: tuple
    kw: dict
    dtype: torch.dtype = torch.float32
    path: str | None = None  # DISTFUSE_PATH during the calls ("fused": the Triton staging in the agreed format)


def _layout_layers(c: LayoutCase, P_x):
    from distfuse.layers.norm_group import DistributedGroupNorm
    from distfuse.layers.upsample import DistributedUpsample

    if c.kind == "upsample":
        return DistributedUpsample(P_x, **c.kw), torch.nn.Upsample(**c.kw)
    seq = torch.nn.GroupNorm(c.kw["num_groups"], c.shape[1], dtype=torch.float64)
    with torch.no_grad():  # random affine parameters, so that their gradients are checked too
        gen = torch.Generator().manual_seed(3)
        for p in seq.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(c.dtype).double())
    layer = DistributedGroupNorm(P_x, c.kw["num_groups"], c.shape[1], dtype=c.dtype)
    load_sequential(layer, seq if dist.get_rank() == 0 else None)
    return layer, seq


def _run_layout(c: LayoutCase) -> dict:
    """Values, every gradient, the formats of the output and the input gradient, copies of the input block."""
    from tests.test_norm_layers import _replica_block

    fmt = FORMATS[len(c.shape)]
    P_x = grid(c.x_ranks, c.grid_x)
    layer, seq = _layout_layers(c, P_x)
    gen = torch.Generator().manual_seed(21)
    xg = torch.randn(c.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    xg = xg.contiguous(memory_format=fmt).requires_grad_(True)
    yg = seq(xg)
    dyg = torch.randn(yg.shape, generator=gen, dtype=torch.float64).to(c.dtype).double()
    yg.backward(dyg)
    want_y, want_dx = _is_fmt(yg, fmt), _is_fmt(xg.grad, fmt)
    def call(t):
        return with_path(c.path, lambda: layer(t)) if c.path else layer(t)

    if not P_x.active:
        y = call(zero_volume_tensor(dtype=c.dtype))
        assert y.numel() == 0
        return dict(active=False)
    x = xg.detach()[local_slices(c.shape, P_x.shape, P_x.index)].to(c.dtype).contiguous(memory_format=fmt)
    x.requires_grad_(True)
    y = call(x)
    if c.path:
        assert layer.last_path == c.path, layer.last_decision
    y_sl = local_slices(tuple(yg.shape), P_x.shape, P_x.index)
    y.backward(dyg[y_sl].to(c.dtype).contiguous(memory_format=fmt))
    close(f"{c.name}: output", y.detach(), yg.detach()[y_sl], c.dtype)
    close(f"{c.name}: input gradient", x.grad, xg.grad[local_slices(c.shape, P_x.shape, P_x.index)], c.dtype)
    for name, p in layer.named_parameters():
        close(f"{c.name}: {name} gradient", p.grad, _replica_block(layer, name, getattr(seq, name).grad), c.dtype)
    mode = _CopiesOf(x.untyped_storage().data_ptr(), x.numel())
    with mode:  # the steady-state call (the first one agreed the metadata)
        call(x)
    with _CopiesOf(x.untyped_storage().data_ptr(), x.numel()) as control:  # the counter sees an NCHW copy
        x.contiguous()
    return dict(active=True, want_y=want_y, want_dx=want_dx, got_y=_is_fmt(y, fmt) if y.numel() else None,
                got_dx=_is_fmt(x.grad, fmt) if x.numel() else None, copies=mode.copies,
                control=bool(control.copies) or x.numel() == 0)


def _run_layouts(cases):
    return [_run_layout(c) for c in cases]


_LAYOUTS = {
    4: [
        LayoutCase("upsample-bilinear-permuted", "upsample", (2, 3, 7, 5), (1, 1, 2, 2), (3, 1, 0, 2),
                   dict(scale_factor=1.5, mode="bilinear")),
        LayoutCase("upsample-bilinear-align-fp16", "upsample", (1, 2, 6, 5), (1, 1, 2, 2), (0, 2, 1, 3),
                   dict(size=(9, 8), mode="bilinear", align_corners=True), dtype=torch.float16),
        LayoutCase("upsample-bilinear-x2-bf16", "upsample", (1, 3, 6, 4), (1, 1, 2, 2), (2, 3, 0, 1),
                   dict(scale_factor=2, mode="bilinear"), dtype=torch.bfloat16),  # the power-of-two shortcut
        LayoutCase("upsample-nearest-exact", "upsample", (2, 2, 5, 7), (1, 1, 2, 2), (1, 0, 3, 2),
                   dict(size=(7, 9), mode="nearest-exact")),
        LayoutCase("upsample-trilinear-x2", "upsample", (1, 2, 4, 5, 3), (1, 1, 2, 1, 2), (3, 2, 1, 0),
                   dict(scale_factor=2, mode="trilinear")),
        LayoutCase("upsample-trilinear-1.5", "upsample", (1, 2, 3, 4, 5), (1, 1, 1, 2, 2), (0, 1, 2, 3),
                   dict(scale_factor=1.5, mode="trilinear")),
        # the fused staging (Triton pack / stage, boxes in [B, *box, C] order) keeps the layout without a copy
        LayoutCase("upsample-bilinear-fused", "upsample", (2, 3, 7, 5), (1, 1, 2, 2), (3, 1, 0, 2),
                   dict(scale_factor=1.5, mode="bilinear"), path="fused"),
        LayoutCase("upsample-trilinear-fused-bf16", "upsample", (1, 2, 4, 5, 3), (1, 1, 2, 1, 2), (3, 2, 1, 0),
                   dict(scale_factor=2, mode="trilinear"), dtype=torch.bfloat16, path="fused"),
        LayoutCase("groupnorm-one-sample-permuted", "groupnorm", (1, 4, 7, 5), (1, 1, 2, 2), (3, 1, 0, 2),
                   dict(num_groups=2)),
        # several samples per worker: the statistics per (sample, group) are read from the [N, *s, C] memory
        LayoutCase("groupnorm-two-samples-bf16", "groupnorm", (2, 6, 5, 5), (1, 1, 2, 2), (0, 1, 2, 3),
                   dict(num_groups=3), dtype=torch.bfloat16),
        LayoutCase("groupnorm-batch-split-uneven", "groupnorm", (5, 4, 5, 3), (2, 1, 2, 1), (1, 3, 0, 2),
                   dict(num_groups=2)),  # 3 and 2 samples per worker
        LayoutCase("groupnorm-3d-fp16", "groupnorm", (1, 4, 5, 4, 3), (1, 1, 2, 1, 2), (2, 0, 3, 1),
                   dict(num_groups=4), dtype=torch.float16),
        LayoutCase("groupnorm-3d-two-samples", "groupnorm", (2, 4, 3, 4, 3), (1, 1, 2, 1, 2), (3, 2, 1, 0),
                   dict(num_groups=2)),
        LayoutCase("groupnorm-3d-three-samples-bf16", "groupnorm", (3, 6, 3, 3, 4), (1, 1, 1, 2, 2), (1, 0, 3, 2),
                   dict(num_groups=3), dtype=torch.bfloat16),
    ],
    6: [
        LayoutCase("upsample-bilinear-inactive", "upsample", (1, 2, 8, 5), (1, 1, 3, 1), (5, 2, 0),
                   dict(scale_factor=1.5, mode="bilinear")),
        LayoutCase("groupnorm-inactive", "groupnorm", (1, 4, 8, 5), (1, 1, 3, 1), (4, 0, 2), dict(num_groups=2)),
        LayoutCase("groupnorm-two-samples-inactive", "groupnorm", (2, 4, 7, 5), (1, 1, 2, 2), (5, 1, 3, 0),
                   dict(num_groups=4)),
    ],
}


@pytest.mark.parametrize("world", sorted(_LAYOUTS), ids=lambda w: f"world{w}")
def test_upsample_and_group_norm_keep_channels_last(world):
    results = run_ranks(world, _run_layouts, _LAYOUTS[world])
    for k, c in enumerate(_LAYOUTS[world]):
        assert results[0][k].get("want_y", True), f"{c.name}: torch.nn returned NCHW; the case tests nothing"
        for rank, per_rank in enumerate(results):
            r = per_rank[k]
            if not r["active"]:
                continue
            if r["got_y"] is not None:
                assert r["got_y"] == r["want_y"], f"{c.name} rank {rank}: output format differs from torch.nn's"
            if r["got_dx"] is not None:
                assert r["got_dx"] == r["want_dx"], f"{c.name} rank {rank}: input-gradient format differs"
            assert r["copies"] == [], f"{c.name} rank {rank}: the layer copied the channels_last block"
            assert r["control"], f"{c.name} rank {rank}: the copy counter missed x.contiguous() (no teeth)"
