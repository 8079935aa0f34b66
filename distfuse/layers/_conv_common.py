"""Pieces shared by the distributed convolutions: options, grids, checks, parameters, the local convolution.

* :class:`ConvOptions` normalises torch's ``ConvNd`` arguments once (per-axis tuples,
  ``(lo, hi)`` padding from ints, pairs, ``'same'`` or ``'valid'``) and raises
  torch's own complaints (groups, padding mode) as distfuse errors naming the layer.
* :func:`check_geometry` refuses, on every worker alike, the global inputs torch's
  ``ConvNd`` refuses (it raises a RuntimeError; distfuse a
  :class:`~distfuse.errors.ShapeError`).
* :func:`draw_parameters` draws the *global* weight and bias exactly as
  ``torch.nn.ConvNd.reset_parameters`` does, so that with the same seed a distributed
  layer holds the blocks of the sequential layer's parameters.
* :func:`spatial_classes` makes a layer's ``1d`` / ``2d`` / ``3d`` classes from its base.
* :class:`RootParams` is the parameter handling of the feature and transposed
  convolutions: weight and bias on one root worker, broadcast packed on every call with
  the agreement flags riding along.
* :func:`conv_block` is the local convolution of a staged block, also where a worker's
  block is empty (torch refuses those, or answers with the wrong shape for zero input
  channels).  Under ``torch.autocast`` the layers cast the input and the parameters first
  (:func:`~distfuse.layers._conv_call_info.cast_for_compute`) and :func:`conv_block` runs
  with autocast off, so that its fp32 computation of 16-bit CPU convolutions is not cast
  back.  :func:`conv_output_format` asks torch which memory format its convolution
  returns, so that workers holding no input agree with the ones that do;
  :func:`pad_locally` pads a block that spans the whole spatial domain.

The per-call metadata every worker agrees on (shapes, dtypes, grad flags, autocast,
memory format) is :mod:`distfuse.layers._conv_call_info`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import init

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import PADDING_MODES, resolve_padding
from distfuse.layers._params import ParamLayout
from distfuse.partition import CartesianPartition, Partition
from distfuse.primitives._layout import memory_format_of, zeros_in
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.broadcast import NO_FLAG, PlanMove, broadcast_plan, placeholder

__all__ = ["ConvOptions", "draw_parameters", "grid_of", "check_partition", "promote", "check_geometry", "RootParams",
           "conv_block", "conv_output_format", "pad_locally", "ZeroBlock", "spatial_classes"]


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


_SPATIAL = {1: "P_w", 2: "P_h, P_w", 3: "P_d, P_h, P_w"}


def spatial_classes(base: type, name: str, doc: str) -> tuple[type, type, type]:
    """``<name>1d``, ``<name>2d``, ``<name>3d``: ``base`` with ``nd`` = 1, 2, 3, defined in ``base``'s module.

    ``doc`` is each class's docstring, formatted with ``nd`` and ``s`` (the spatial
    partition extents, ``"P_h, P_w"`` for 2-D) and ``ones`` (as many ``1``).
    """
    return tuple(type(f"{name}{nd}d", (base,), {
        "nd": nd, "__module__": base.__module__, "__qualname__": f"{name}{nd}d",
        "__doc__": doc.format(nd=nd, s=_SPATIAL[nd], ones=", ".join("1" * nd))}) for nd in (1, 2, 3))


# ---------------------------------------------------------------- the local convolution


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class ZeroBlock(torch.autograd.Function):
    """Zeros of a given shape that keep ``x`` and ``w`` in the graph (their gradients are zero).

    A worker whose output block is empty, or whose input channel block is empty, still
    has to run the adjoints of the exchanges that produced ``x`` and ``w``: its peers
    wait for its (empty or zero) contribution.
    """

    @staticmethod
    def forward(ctx, x, w, shape, memory_format=torch.contiguous_format):
        ctx.x_meta = (x.shape, x.dtype, x.device, memory_format_of(x))
        ctx.w_meta = (w.shape, w.dtype, w.device)
        return zeros_in(shape, memory_format, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        xs, xd, xdev, xfmt = ctx.x_meta
        ws, wd, wdev = ctx.w_meta
        return zeros_in(xs, xfmt, dtype=xd, device=xdev), torch.zeros(ws, dtype=wd, device=wdev), None, None


_OUTPUT_FORMATS: dict[tuple, torch.memory_format] = {}


def conv_output_format(device: torch.device, dtype: torch.dtype, input_format: torch.memory_format,
                       nd: int) -> torch.memory_format:
    """The memory format torch's ``convNd`` returns for an input in ``input_format`` (contiguous weight).

    Asked of torch once per (device type, dtype, format, nd) with a tiny convolution,
    because it differs by backend and version (torch 2.13: CPU Conv2d keeps
    ``channels_last``, CPU Conv3d returns NCDHW for ``channels_last_3d``).  Workers that
    hold no input (the receivers of a sum-reduce) use it to agree with the ones that do.
    """
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # conv_block computes 16-bit CPU convolutions in fp32
    key = (device.type, dtype, input_format, nd)
    if key not in _OUTPUT_FORMATS:
        if input_format == torch.contiguous_format:
            _OUTPUT_FORMATS[key] = input_format
        else:
            x = torch.zeros((1, 2) + (3,) * nd, dtype=dtype, device=device).contiguous(memory_format=input_format)
            w = torch.zeros((2, 2) + (1,) * nd, dtype=dtype, device=device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                y = CONV[nd](x, w)
            _OUTPUT_FORMATS[key] = memory_format_of(y)
    return _OUTPUT_FORMATS[key]


def conv_block(opts: ConvOptions, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               out_shape: Sequence[int], input_format: torch.memory_format | None = None) -> torch.Tensor:
    """``convNd(x, w, b, stride, padding=0, dilation, groups)`` with the expected ``out_shape``.

    ``x`` is already padded (staged).  Where the output or the reduction is empty the
    result is zeros (plus the bias), still differentiable in ``x``, ``w`` and ``b``, in
    the format torch's convolution returns for ``input_format`` (default: ``x``'s; an
    empty block is dense in every format, so the layers pass the agreed one).
    """
    if torch.is_autocast_enabled(x.device.type):
        # The caller cast x, w and b to the autocast dtype already (cast_for_compute); autocast would otherwise
        # cast this function's fp32 computation of 16-bit CPU convolutions back to 16 bits.
        with torch.autocast(x.device.type, enabled=False):
            return conv_block(opts, x, w, b, out_shape, input_format)
    nd = opts.nd
    if 0 in out_shape or 0 in x.shape[1:] or 0 in w.shape[:2]:
        fmt = conv_output_format(x.device, x.dtype, input_format or memory_format_of(x), nd)
        y = ZeroBlock.apply(x, w, tuple(out_shape), fmt)
        if b is not None:
            y = y + b.view(1, -1, *([1] * nd))
        return y
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        # torch 2.13's CPU oneDNN path computes 16-bit strided conv3d wrongly on one thread (x [1,1,5,5,3],
        # w [2,1,3,3,3], stride (1,1,3): errors of ~10 on outputs of ~5; right with 2 threads).  Rank pools
        # run one thread per rank, so compute in fp32 and round once: the accurate result of the 16-bit op.
        y = CONV[nd](x.float(), w.float(), None if b is None else b.float(), opts.stride, 0, opts.dilation,
                     opts.groups)
        return y.to(x.dtype)
    return CONV[nd](x, w, b, opts.stride, 0, opts.dilation, opts.groups)


def pad_locally(opts: ConvOptions, x: torch.Tensor) -> torch.Tensor:
    """Pad a block that spans the whole spatial domain (torch's own ``F.pad`` modes are then global)."""
    flat = [v for lo_hi in reversed(opts.padding) for v in lo_hi]
    if not any(flat):
        return x
    if opts.padding_mode == "zeros" or x.numel() == 0:  # torch's other modes refuse empty channel blocks
        return F.pad(x, flat)
    return F.pad(x, flat, mode=opts.padding_mode)


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



class RootParams:
    """Weight and bias held by one root worker (``P_x``'s first) and broadcast to every worker of ``P_x`` per call.

    The feature and the transposed convolutions' parameter handling, one component::

        flat    [1, ..., 1, n]   the root's weight and bias, packed (n = weight numel + bias numel)
        forward every worker of P_x gets flat (one message per worker); with a flag, each first
                sends the root its agreement flag and the root appends their sum (the flagged round
                of distfuse::broadcast, primitives/broadcast.py)
        adjoint dflat = sum over the workers of their gradients, onto the root (a sum-reduce)

    Weight and bias travel in one message because a broadcast is latency bound at
    convolution weight sizes.  The flag rides along instead of taking a round of its own:
    two point-to-point rounds, where one all-reduce would carry the flags from everyone to
    everyone in one call, but gloo's all-reduce took 3.7 ms against 0.34 ms for the two
    rounds on the loaded 2-core CI machine (4 ranks, 2.3k floats, medians of 200).

    ``create(module)`` registers ``weight`` and ``bias`` on the layer (None off the root);
    ``move`` names the broadcast in graphs, made at construction (collective: every rank
    makes it in the same order).
    """

    def __init__(self, P_x: CartesianPartition, weight_shape: tuple[int, ...], out_channels: int, bias: bool, op: str,
                 on_flag):
        self.P_x, self.weight_shape, self.out_channels, self.bias = P_x, tuple(weight_shape), out_channels, bool(bias)
        self.root = P_x.ranks[0]
        self.is_root = dist.get_rank() == self.root
        # The root's single-worker grids: one per parameter rank (ParamLayout splits dimension d by dimension d).
        self.P_root = grid_of([self.root], [1] * P_x.dim, P_x.device)
        self.P_root_1d = grid_of([self.root], [1], P_x.device)
        self.move = PlanMove(broadcast_plan(self.P_root, P_x), op, P_x, on_flag)
        self.n_weight = math.prod(self.weight_shape)
        self.n = self.n_weight + (out_channels if self.bias else 0)

    def create(self, module, device, dtype) -> None:
        """Register ``module.weight`` and ``module.bias`` (uninitialised on the root, None elsewhere)."""
        if self.is_root:
            module.weight = torch.nn.Parameter(torch.empty(self.weight_shape, device=device, dtype=dtype))
            bias = torch.nn.Parameter(torch.empty(self.out_channels, device=device, dtype=dtype)) if self.bias else None
            module.register_parameter("bias", bias)
        else:
            module.register_parameter("weight", None)
            module.register_parameter("bias", None)

    def reset(self, weight, bias, w: torch.Tensor, b: torch.Tensor | None) -> None:
        """Copy the drawn global ``w`` and ``b`` into the root's parameters (every rank drew them)."""
        if self.is_root:
            with torch.no_grad():
                weight.copy_(w)
                if bias is not None:
                    bias.copy_(b)

    def layouts(self) -> list[ParamLayout]:
        out = [ParamLayout("weight", "weight", self.P_root, self.weight_shape)]
        if self.bias:
            out.append(ParamLayout("bias", "bias", self.P_root_1d, (self.out_channels,)))
        return out

    def replicate(self, like: torch.Tensor, weight, bias, dtype: torch.dtype, needs_grad: bool,
                  flag: int = NO_FLAG) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(w, b)`` on every worker of P_x, in ``dtype``: one broadcast of the packed parameters from the root.

        ``flag``: this worker's agreement flag (0 or 1), or ``NO_FLAG`` (the flagged round
        raises :class:`~distfuse.primitives.agreement_session.FlaggedCallError` on every worker
        when any is set).  ``needs_grad``: some worker's parameters require grad, so every
        worker runs the sum-reduce its root waits for.  ``like`` is any tensor of the call
        (the non-root workers' placeholder is made from it, never a graph constant).
        """
        shape = [1] * (self.P_x.dim - 1) + [self.n]
        if self.is_root:
            parts = [weight.reshape(-1)] + ([bias.reshape(-1)] if bias is not None else [])
            flat = (torch.cat([p.to(dtype) for p in parts]) if len(parts) > 1 else parts[0].to(dtype)).view(shape)
        else:
            flat = placeholder(like, dtype, self.P_x.device)
        packed = self.move.copy(flat, shape, 0, anchor(needs_grad), flag).view(-1)
        n_w = self.n_weight
        return packed[:n_w].view(self.weight_shape), (packed[n_w:] if self.bias else None)
