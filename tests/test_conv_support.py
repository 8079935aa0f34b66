"""Parity machinery for the distributed convolution tests (run inside rank pools; no tests here).

A :class:`Case` describes one layer configuration.  :func:`run_cases` runs a list of
cases on every rank: it builds the layer through the ``DistributedConvNd`` selector,
loads the parameters of a sequential ``torch.nn.ConvNd`` (the fp64 reference, its
parameters rounded to the case's dtype), runs forward and backward on fresh random
data, gathers the output, the input gradient and the parameter gradients on rank 0
with ``collect_tensor``, and compares them with the sequential layer's on the global
tensors.  A failure names the case.

Tolerances come from ``tests/tolerances.py`` for the case's longest sum (a weight
gradient sums B * prod(m) products); the absolute part is scaled by the reference
tensor's largest magnitude: a convolution's rounding error is proportional to the
size of its partial sums, and with random data and no normalisation nothing cancels
systematically, so a tensor's own magnitude is its terms' (an input gradient of
magnitude 0.05 is checked at 0.05 * atol, not at atol).  The floor only guards an
all-zero tensor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_shape, local_slices
from distfuse.layers._params import load_sequential
from distfuse.layers.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d
from distfuse.primitives.distribute import collect_tensor
from distfuse.testing.tolerance import STORE_ROUNDINGS
from tests.tolerances import TERMS, rounding_bound

SELECTOR = {1: DistributedConv1d, 2: DistributedConv2d, 3: DistributedConv3d}
SEQUENTIAL = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@dataclass(frozen=True)
class Case:
    """One configuration; ``x_ranks``/``y_ranks``/``w_ranks`` are world ranks (row-major over the grids)."""

    name: str
    kind: str  # "feature", "channel" or "general": the class the selector must pick
    shape: tuple  # global input [B, C_in, *n]
    out_channels: int
    kernel: object
    grid_x: tuple
    x_ranks: tuple
    grid_y: tuple | None = None
    y_ranks: tuple | None = None
    grid_w: tuple | None = None
    w_ranks: tuple | None = None
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    bias: bool = True
    mode: str = "zeros"
    dtype: torch.dtype = torch.float32
    path: str = "auto"  # DISTFUSE_PATH during the call
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def nd(self) -> int:
        return len(self.shape) - 2


_GRIDS: dict = {}


def grid(ranks, shape):
    """A partition over world ranks; cached per rank process (creation is a world-wide collective, ~35 ms)."""
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            shape)
    return _GRIDS[key]


def build(c: Case):
    """The partitions and the layer of a case (collective over the world)."""
    P_x = grid(c.x_ranks, c.grid_x)
    P_y = grid(c.y_ranks, c.grid_y) if c.grid_y is not None else None
    P_w = grid(c.w_ranks, c.grid_w) if c.grid_w is not None else None
    layer = SELECTOR[c.nd](P_x, c.shape[1], c.out_channels, c.kernel, stride=c.stride, padding=c.padding,
                           dilation=c.dilation, groups=c.groups, bias=c.bias, padding_mode=c.mode, P_y=P_y, P_w=P_w,
                           dtype=c.dtype)
    return P_x, P_y if P_y is not None else P_x, P_w, layer


def sequential(c: Case, dtype=torch.float64):
    return SEQUENTIAL[c.nd](c.shape[1], c.out_channels, c.kernel, stride=c.stride, padding=c.padding,
                            dilation=c.dilation, groups=c.groups, bias=c.bias, padding_mode=c.mode, dtype=dtype)


def close(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, terms: int = TERMS,
          partials: int = 1) -> None:
    """``got`` against the float64 ``ref`` within the rounding bound of sums of ``terms`` terms in ``dtype``.

    ``partials``: the result is the sum of that many workers' partial results (a replicated parameter's
    gradient), each rounded to ``dtype`` before a reduction that rounds once per addition: 2 (P - 1) more
    roundings than one worker's, each of a partial sum's size.
    """
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    rtol = rounding_bound(dtype, terms, roundings=STORE_ROUNDINGS + 2 * (partials - 1))
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-3)
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


def sum_terms(seq, yg: torch.Tensor, groups: int) -> int:
    """The longest sums behind a conv's checked values: an output's C_in / groups * taps, an input gradient's
    C_out / groups * taps, a weight gradient's B * output positions."""
    k = seq.weight.shape
    return max(math.prod(k[1:]), k[0] // groups * math.prod(k[2:]), yg.shape[0] * math.prod(yg.shape[2:]))


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


def run_case(c: Case) -> dict:
    """Forward + backward parity of one case; returns what this rank saw (class, path, output shape)."""
    rank = dist.get_rank()
    P_x, P_out, _, layer = build(c)
    assert type(layer).__name__.startswith(f"Distributed{c.kind.capitalize()}Conv"), type(layer).__name__
    torch.manual_seed(1000 + c.seed)
    seq = sequential(c)
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
    else:  # a placeholder that does not require grad: the layer must still run its adjoints
        x = zero_volume_tensor(dtype=c.dtype)
    y = with_path(c.path, lambda: layer(x))
    if P_out.active:
        want = local_shape(tuple(yg.shape), P_out.shape, P_out.index)
        assert tuple(y.shape) == want, f"{c.name}: output block {tuple(y.shape)}, expected {want}"
        assert y.dtype == c.dtype
        dy = dyg[local_slices(tuple(yg.shape), P_out.shape, P_out.index)].to(c.dtype)
    else:
        assert y.numel() == 0, f"{c.name}: a worker outside the output partition returned {tuple(y.shape)}"
        dy = torch.zeros_like(y)
    if y.requires_grad:
        y.backward(dy)

    y_full = collect_tensor(y.detach() if P_out.active else None, P_out)
    dx_full = collect_tensor(x.grad if P_x.active else None, P_x)
    grads = {}
    for lay in layer.param_layouts():
        local = getattr(layer, lay.name).grad if lay.P.active else None
        if lay.P.active:
            assert local is not None, f"{c.name}: no gradient for {lay.name} on its owner"
        grads[lay.seq_name] = collect_tensor(local, lay.P)
    if rank == 0:
        terms = sum_terms(seq, yg, c.groups)
        close(f"{c.name}: output", y_full, yg.detach(), c.dtype, terms)
        close(f"{c.name}: input gradient", dx_full, xg.grad, c.dtype, terms)
        for name, g in grads.items():
            close(f"{c.name}: {name} gradient", g, getattr(seq, name).grad, c.dtype, terms, partials=P_x.size)
    return dict(kind=type(layer).__name__, path=getattr(layer, "last_path", None), active=P_x.active,
                out=tuple(y.shape))


def run_cases(cases) -> list[dict]:
    out = []
    for c in cases:
        try:
            out.append(run_case(c))
        except AssertionError as exc:
            raise AssertionError(f"[case {c.name}, {c.mode}, {c.dtype}, path={c.path}] {exc}") from exc
    return out


def volume(shape) -> int:
    return math.prod(shape)
