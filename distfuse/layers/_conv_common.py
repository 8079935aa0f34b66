"""Pieces shared by the distributed convolutions: options, grids, the global-shape checks, parameter init.

* :class:`ConvOptions` normalises torch's ``ConvNd`` arguments once (per-axis tuples,
  ``(lo, hi)`` padding from ints, pairs, ``'same'`` or ``'valid'``) and raises
  torch's own complaints (groups, padding mode) as distfuse errors naming the layer.
* :func:`check_geometry` refuses, on every worker alike, the global inputs torch's
  ``ConvNd`` refuses (it raises a RuntimeError; distfuse a
  :class:`~distfuse.errors.ShapeError`).
* :func:`draw_parameters` draws the *global* weight and bias exactly as
  ``torch.nn.ConvNd.reset_parameters`` does, so that with the same seed a distributed
  layer holds the blocks of the sequential layer's parameters.

The per-call metadata every worker agrees on (shapes, dtypes, grad flags, autocast,
memory format) is :mod:`distfuse.layers._conv_call_info`'s; the local convolution of a
staged block, :mod:`distfuse.layers._conv_block`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import init

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import PADDING_MODES, resolve_padding
from distfuse.partition import CartesianPartition, Partition

__all__ = ["ConvOptions", "draw_parameters", "grid_of", "check_partition", "promote", "check_geometry"]


def _tuple(op: str, v, nd: int, name: str) -> tuple[int, ...]:
    t = (int(v),) * nd if isinstance(v, int) else tuple(int(e) for e in v)
    if len(t) != nd or min(t) < 1:
        raise UnsupportedError(f"{where(op)}: {name} must be a positive int or {nd} positive ints, got {v!r}")
    return t


@dataclass(frozen=True)
class ConvOptions:
    """torch ``ConvNd`` arguments, normalised per spatial axis."""

    nd: int
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]  # (lo, hi) per axis
    dilation: tuple[int, ...]
    groups: int
    bias: bool
    padding_mode: str

    @classmethod
    def make(cls, op: str, nd: int, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
             padding_mode) -> ConvOptions:
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise expect(op, "groups dividing in_channels and out_channels", "a divisor of both",
                         f"groups={groups}, in_channels={in_channels}, out_channels={out_channels}", ShapeError)
        if min(in_channels, out_channels) < 1:
            raise expect(op, "channel counts >= 1", ">= 1", (in_channels, out_channels), ShapeError)
        if padding_mode not in PADDING_MODES:
            raise expect(op, "padding_mode", PADDING_MODES, repr(padding_mode), UnsupportedError)
        kernel = _tuple(op, kernel_size, nd, "kernel_size")
        stride = _tuple(op, stride, nd, "stride")
        dilation = _tuple(op, dilation, nd, "dilation")
        try:
            pads = resolve_padding(padding, kernel, dilation, stride)
        except UnsupportedError as exc:
            raise UnsupportedError(f"{where(op)}: {exc}") from None
        return cls(nd, int(in_channels), int(out_channels), kernel, stride, pads, dilation, int(groups), bool(bias),
                   padding_mode)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)


_GRIDS: dict[tuple, CartesianPartition] = {}


def grid_of(ranks: Sequence[int], shape: Sequence[int], device) -> CartesianPartition:
    """A Cartesian partition over the given world ranks (row-major), cached.

    Creating a partition is collective over the world and costs an object all-gather
    (35 ms with 8 gloo ranks on the 2-core CI machine); a model's layers ask for the
    same few grids again and again.  Layer construction is itself collective, so every
    rank asks for the same grids in the same order and hits or misses the cache
    together.  The key includes the default process group, so a re-initialised world
    builds fresh grids.
    """
    key = (id(dist.group.WORLD), tuple(int(r) for r in ranks), tuple(int(s) for s in shape), str(device))
    if key not in _GRIDS:
        base = Partition.world(device).create_partition_inclusive(list(key[1]))
        _GRIDS[key] = base.create_cartesian_topology_partition(key[2])
    return _GRIDS[key]


def check_partition(op: str, name: str, P, nd: int) -> None:
    if not isinstance(P, CartesianPartition):
        raise PartitionError(f"{where(op)}: {name} must be a CartesianPartition, got {type(P).__name__}")
    if P.dim != nd + 2:
        raise expect(op, f"dimensions of {name} ([batch, channel, {nd} spatial])", nd + 2, P.dim, PartitionError)


def check_geometry(op: str, opts: ConvOptions, global_shape: Sequence[int]) -> None:
    """Refuse, as ``torch.nn.ConvNd`` does, a global input the convolution cannot run on.

    Every worker holds the same agreed global shape, so every worker raises the same
    :class:`~distfuse.errors.ShapeError` (torch raises a RuntimeError): an empty spatial
    extent (torch: "Only zero batch or zero channel inputs are supported"), a padded
    extent smaller than the dilated kernel ("Kernel size can't be greater than actual
    input size"), and circular padding wider than the input ("Padding value causes
    wrapping around more than once").  Without this the output would silently be empty.
    """
    spatial = tuple(int(n) for n in global_shape[2:])
    if global_shape[0] == 0 or global_shape[1] == 0:
        return  # torch accepts empty batches and channels
    for axis, (n, (lo, hi), k, d) in enumerate(zip(spatial, opts.padding, opts.kernel_size, opts.dilation,
                                                   strict=True)):
        if n == 0:
            raise ShapeError(f"{where(op)}: global input {tuple(global_shape)} has an empty spatial axis {axis}; torch "
                             "refuses it too (only zero batch or zero channel inputs are supported)")
        if opts.padding_mode == "circular" and max(lo, hi) > n:
            raise ShapeError(f"{where(op)}: circular padding {(lo, hi)} on spatial axis {axis} wraps around the "
                             f"global extent {n} more than once; torch refuses it too")
        if n + lo + hi < d * (k - 1) + 1:
            raise ShapeError(f"{where(op)}: padded global input extent {n + lo + hi} on spatial axis {axis} is "
                             f"smaller than the dilated kernel ({d * (k - 1) + 1}); torch refuses it too (kernel "
                             "size can't be greater than actual input size)")


def promote(t: torch.Tensor, needed: bool) -> torch.Tensor:
    """Make ``t`` require grad when some peer's adjoint depends on this worker running its own.

    A tensor that does not require grad has no history, so detaching it loses nothing;
    its gradient is computed and dropped.
    """
    if needed and not t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


# ---------------------------------------------------------------- parameters


@torch.no_grad()
def draw_parameters(opts: ConvOptions, dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global weight and bias drawn as ``torch.nn.ConvNd.reset_parameters`` draws them.

    Same calls, same order, same dtype and device, so the same generator state gives
    the same values as the sequential layer.
    """
    w = torch.empty(opts.weight_shape, dtype=dtype, device=device)
    init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if opts.bias:
        b = torch.empty(opts.out_channels, dtype=dtype, device=device)
        fan_in, _ = init._calculate_fan_in_and_fan_out(w)
        if fan_in != 0:
            bound = 1 / math.sqrt(fan_in)
            init.uniform_(b, -bound, bound)
    return w, b

