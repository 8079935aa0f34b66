"""What the distributed convolutions share: options, checks, the per-call metadata, parameters, the local convolution.

* :class:`ConvOptions` normalises torch's ``ConvNd`` arguments once (per-axis tuples,
  ``(lo, hi)`` padding from ints, pairs, ``'same'`` or ``'valid'``) and raises torch's own
  complaints as distfuse errors naming the layer; :func:`check_geometry` refuses, on every
  worker alike, the global inputs torch refuses.
* :func:`gather_call_info` is the metadata gather of the convolutions, the pooling and the
  upsampling (when it runs: :mod:`distfuse.layers`).
* Autocast: a convolution runs in the autocast dtype, as ``torch.nn.ConvNd`` does.  The
  layers cast the input (before its halo exchange, which then moves the smaller dtype) and
  the replicated parameters to it (:func:`cast_for_compute`), and :func:`conv_block` runs
  with autocast off, so that its fp32 computation of 16-bit CPU convolutions is not cast back.
* Memory format: a ``channels_last`` input gives a ``channels_last`` output wherever
  ``torch.nn.ConvNd`` does (:func:`conv_output_format` asks torch): the halo exchange stages
  in the input's format and :func:`conv_block` computes in it.  :func:`gather_call_info`
  agrees on the format, because workers holding only weights or outputs never see the input.
* :class:`ConvLayer` is the base of the convolutions; :class:`RootParams` keeps the parameters
  of the feature and transposed convolutions on one root worker.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse import debug
from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.geometry.halo_plan import PADDING_MODES, resolve_padding
from distfuse.groups import WorldTable
from distfuse.layers._params import WeightAndBias
from distfuse.partition import CartesianPartition, Partition, union_partition
from distfuse.primitives._axes import axes_subgrid
from distfuse.primitives._common import gather_records
from distfuse.primitives._layout import memory_format_of, zeros_in
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.agreement_session import AgreementSession
from distfuse.primitives.broadcast import NO_FLAG, PlanMove, broadcast_plan, placeholder

__all__ = ["AgreedLayer", "ConvLayer", "ConvOptions", "grid_of", "cached_partition", "subgrid",
           "union_of", "check_cartesian", "check_partition", "compute_dtype", "promote", "check_geometry", "RootParams",
           "conv_block", "conv_output_format", "pad_locally", "ZeroBlock", "spatial_classes", "FLOATS", "CallInfo",
           "gather_call_info", "global_shape_of", "autocast_dtype", "cast_for_compute", "call_signature",
           "passes_local_checks"]

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit tensors (the layers compute those in fp32 and round once), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


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


_PARTITIONS: WorldTable = WorldTable()


def cached_partition(key: tuple, make: Callable[[], CartesianPartition]) -> CartesianPartition:
    """``make()``, cached under ``key`` for the current world: creating a partition costs a collective object
    all-gather, and a model's layers ask for the same few grids again and again (every rank in the same order, so
    all hit or miss together; a re-initialised world builds fresh ones: :class:`~distfuse.groups.WorldTable`)."""
    partitions = _PARTITIONS.current()
    if key not in partitions:
        partitions[key] = make()
    return partitions[key]


def grid_of(ranks: Sequence[int], shape: Sequence[int], device) -> CartesianPartition:
    """A Cartesian partition over the given world ranks (row-major), cached (:func:`cached_partition`)."""
    ranks, shape = [int(r) for r in ranks], tuple(int(s) for s in shape)
    # keyed by the device type: "cuda" and "cuda:1" on one rank must hit together with its peers (a miss creates)
    return cached_partition(("grid", tuple(ranks), shape, torch.device(device).type), lambda: Partition.world(device)
                            .create_partition_inclusive(ranks).create_cartesian_topology_partition(shape))


def subgrid(P: CartesianPartition, axes: Sequence[int]) -> CartesianPartition:
    """The sub-grid of ``P`` through this worker along ``axes`` (``axes_subgrid``), cached."""
    axes = tuple(sorted(int(a) for a in axes))
    return cached_partition(("subgrid", tuple(P.ranks), tuple(P.shape), axes, P.device.type),
                            lambda: axes_subgrid(P, axes))


def union_of(*Ps) -> Partition:
    """``union_partition`` of the partitions, cached."""
    return cached_partition(("union", *(tuple(P.ranks) for P in Ps), Ps[0].device.type), lambda: union_partition(*Ps))


class AgreedLayer:
    """A layer's agreement (:mod:`distfuse.layers`): ``session`` over its partition and ``agreement``, its site."""

    def _agree_over(self, P) -> None:
        self.session = AgreementSession(type(self).__name__, P)
        self.agreement = self.session.site

    def forget_agreement(self) -> None:
        """Drop the agreed call record, so the next call gathers metadata again (call it on every worker)."""
        self.session.forget()


def check_cartesian(op: str, P, name: str = "P_x") -> None:
    if not isinstance(P, CartesianPartition):
        raise PartitionError(f"{where(op)}: {name} must be a CartesianPartition, got {type(P).__name__}")


def check_partition(op: str, name: str, P, nd: int) -> None:
    check_cartesian(op, P, name)
    if P.dim != nd + 2:
        raise expect(op, f"dimensions of {name} ([batch, channel, {nd} spatial])", nd + 2, P.dim, PartitionError)


def check_geometry(op: str, opts: ConvOptions, global_shape: Sequence[int]) -> None:
    """Refuse, as ``torch.nn.ConvNd`` does, a global input the convolution cannot run on (an empty spatial extent,
    a padded extent smaller than the dilated kernel, circular padding wider than the input): the same
    :class:`~distfuse.errors.ShapeError` on every worker, where the output would otherwise silently be empty."""
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
    """Make ``t`` require grad when some peer's adjoint depends on this worker running its own (``t`` has no
    history then, so detaching it loses nothing; its gradient is computed and dropped)."""
    if needed and not t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


_SPATIAL = {1: "P_w", 2: "P_h, P_w", 3: "P_d, P_h, P_w"}


def spatial_classes(base: type, name: str, doc: str, nds=(1, 2, 3)) -> tuple[type, ...]:
    """``<name>1d``, ``<name>2d``, ``<name>3d`` (those of ``nds``): ``base`` with ``nd`` = 1, 2, 3, defined in
    ``base``'s module; ``doc`` is formatted with ``nd``, ``s`` (the spatial partition extents, ``"P_h, P_w"`` for
    2-D) and ``ones``."""
    return tuple(type(f"{name}{nd}d", (base,), {
        "nd": nd, "__module__": base.__module__, "__qualname__": f"{name}{nd}d",
        "__doc__": doc.format(nd=nd, s=_SPATIAL[nd], ones=", ".join("1" * nd))}) for nd in nds)


# ---------------------------------------------------------------- the per-call metadata


_MAX_DIM = 5  # [B, C, D, H, W]
# ndim, x dtype, x requires grad, params require grad, param dtype, problem, autocast dtype, layer hash, layout bits
_HEAD = 9
_DENSE, _DENSE_CL = 1, 2  # layout bits: the block is dense in NCHW order / in channels_last(_3d) order
_OK, _BAD_DEVICE, _BAD_DTYPE, _TOO_MANY_DIMS, _NOT_EMPTY = range(5)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes convolutions in on ``device_type`` now, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_for_compute(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in the compute dtype, as autocast casts a convolution's arguments (float64 is never cast)."""
    if t is None or t.dtype == dtype or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


@dataclass(frozen=True)
class CallInfo:
    """What every worker of a layer learns from one call's metadata gather.

    ``input_grad`` / ``param_grad``: some worker's input / parameter requires grad (grad mode
    on), so every worker takes part in that adjoint.  ``compute_dtype``: the autocast dtype
    when the workers run under ``torch.autocast`` (and the input is not float64), else
    ``dtype``.  ``memory_format``: ``channels_last`` (``_3d``) when every P_x block is dense in
    it and some is not plainly contiguous (blocks dense in both agree with either).
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    input_grad: bool
    param_grad: bool
    param_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    memory_format: torch.memory_format = torch.contiguous_format


def _local_problem(P_x: CartesianPartition, x: torch.Tensor) -> int:
    """This worker's problem code for :func:`gather_call_info` (``_OK`` when its input passes the local checks)."""
    if not P_x.active:
        return _NOT_EMPTY if x.numel() != 0 else _OK
    if x.device.type != P_x.device.type:
        return _BAD_DEVICE
    if x.dtype not in FLOATS:
        return _BAD_DTYPE
    return _TOO_MANY_DIMS if x.dim() > _MAX_DIM else _OK


def passes_local_checks(P_x: CartesianPartition, x: torch.Tensor) -> bool:
    """Whether this worker's input passes the gather's local checks and has one dimension per dimension of P_x."""
    return _local_problem(P_x, x) == _OK and (not P_x.active or x.dim() == P_x.dim)


def _layout_bits(x: torch.Tensor) -> tuple[bool, bool]:
    """Whether ``x`` is dense in NCHW order, and in ``channels_last`` (``_3d``) order."""
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return x.is_contiguous(), cl is not None and x.is_contiguous(memory_format=cl)


def call_signature(x: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple:
    """This worker's signature of a call: everything of its own that :func:`gather_call_info` records (while it
    repeats on every worker the agreed :class:`CallInfo` holds)."""
    return (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
            tuple((p.requires_grad, p.dtype) for p in params), autocast_dtype(x.device.type), _layout_bits(x))


def global_shape_of(op: str, P_x: CartesianPartition, shapes: Sequence[tuple[int, ...]],
                    what: str = "input") -> tuple[int, ...]:
    """The global shape whose balanced blocks the workers hold; the same ShapeError on every worker otherwise."""
    G = tuple(sum(shapes[P_x.rank_of([k if e == d else 0 for e in range(P_x.dim)])][d] for k in range(P_x.shape[d]))
              for d in range(P_x.dim))
    for j, shape in enumerate(shapes):
        want = local_shape(G, P_x.shape, P_x.index_of(j))
        if tuple(shape) != want:
            raise expect(op, f"local {what} shape on world rank {P_x.ranks[j]} (P_x index {P_x.index_of(j)}; the "
                         f"blocks must be the balanced decomposition of the global shape {G} inferred from them)",
                         want, tuple(shape))
    return G


def _code(dtype) -> int:
    return FLOATS.index(dtype) if dtype in FLOATS else -1


def gather_call_info(op: str, P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                     params: Sequence[torch.Tensor], signature=None) -> CallInfo:
    """All-gather ``(shape, dtype, grad flags, autocast, layout)`` over ``P_union`` (host gloo, 14 int64 per worker).

    The input must be the balanced decomposition of one global shape over ``P_x``, in one
    floating dtype, equal to the parameters' dtype unless the workers run under
    ``torch.autocast`` (then every worker must, with one autocast dtype: the messages travel
    in it).  ``signature`` (the layer's options and partitions) is compared as a digest, so
    that ranks calling different layers here (a program-order bug) raise
    :class:`~distfuse.errors.CollectiveMismatchError` instead of moving one layer's blocks into
    another's buffers; in full in debug mode.
    """
    if signature is not None and debug.enabled():
        debug.check_agreement(op, P_union.ranks, P_union.meta_group, same={"layer": signature},
                              info={"local shape": tuple(x.shape)})
    grad_on = torch.is_grad_enabled()
    problem = _local_problem(P_x, x)
    ac = autocast_dtype(P_x.device.type)
    dense, dense_cl = _layout_bits(x)
    shape = list(x.shape) if problem == _OK and P_x.active else []
    rec = [x.dim(), _code(x.dtype), int(grad_on and x.requires_grad),
           int(grad_on and any(p.requires_grad for p in params)), _code(params[0].dtype) if params else -1, problem,
           -1 if ac is None else _code(ac) if ac in FLOATS else -2,
           zlib.crc32(repr(signature).encode()) if signature is not None else -1,
           (_DENSE if dense else 0) | (_DENSE_CL if dense_cl else 0)] + shape + [-1] * (_MAX_DIM - len(shape))
    rows = dict(sorted(zip(P_union.ranks, gather_records(op, P_union, rec), strict=True)))  # by world rank
    for w, r in rows.items():
        if r[5] == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_x.device.type, "another device")
        if r[5] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed a non-floating input; expected one of "
                             f"{[str(d) for d in FLOATS]}")
        if r[5] == _TOO_MANY_DIMS or (w in P_x.ranks and r[0] != P_x.dim):
            raise expect(op, f"number of input dimensions on world rank {w} ([batch, channel, spatial...], one per "
                         "dimension of P_x)", P_x.dim, r[0])
        if r[5] == _NOT_EMPTY:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor")
    if len({r[7] for r in rows.values()}) != 1:
        digests = {w: r[7] for w, r in rows.items()}
        raise CollectiveMismatchError(f"{where(op)}: the workers are not calling the same layer (their options or "
                                      "partitions differ; call the layers in the same order on every worker): layer "
                                      f"digests {digests} (world rank: digest)")
    x_rows = [rows[w] for w in P_x.ranks]
    dtypes = {r[1] for r in x_rows}
    if len(dtypes) != 1:
        got = {w: str(FLOATS[rows[w][1]]) for w in P_x.ranks}
        raise ShapeError(f"{where(op)}: the workers of P_x must pass one dtype; got {got} (world rank: dtype)")
    dtype = FLOATS[dtypes.pop()]
    autocasts = {r[6] for r in rows.values()}
    if len(autocasts) != 1 or -2 in autocasts:
        got = {w: ("off" if r[6] == -1 else str(FLOATS[r[6]]) if r[6] >= 0 else "unsupported") for w, r in
               rows.items()}
        raise ShapeError(f"{where(op)}: every worker must run this layer under the same torch.autocast state (its "
                         f"dtype is what the exchanges carry); got {got} (world rank: autocast dtype)")
    ac_code = autocasts.pop()
    param_dtypes = {r[4] for r in rows.values() if r[4] >= 0}
    if len(param_dtypes) > 1:
        raise ShapeError(f"{where(op)}: the workers' parameters must share one dtype; got "
                         f"{ {w: str(FLOATS[r[4]]) for w, r in rows.items() if r[4] >= 0} } (world rank: dtype)")
    if ac_code < 0 and param_dtypes and param_dtypes != {FLOATS.index(dtype)}:
        raise expect(op, "input dtype (the parameters' dtype, as torch's ConvNd requires outside torch.autocast)",
                     [str(FLOATS[c]) for c in sorted(param_dtypes)], str(dtype))
    param_dtype = FLOATS[param_dtypes.pop()] if param_dtypes else dtype
    compute = FLOATS[ac_code] if ac_code >= 0 and dtype != torch.float64 else dtype
    layouts = [r[8] for r in x_rows]
    channels_last = all(b & _DENSE_CL for b in layouts) and not all(b & _DENSE for b in layouts)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(P_x.dim) if channels_last else None
    G = global_shape_of(op, P_x, [tuple(r[_HEAD:_HEAD + P_x.dim]) for r in x_rows])
    return CallInfo(G, dtype, any(r[2] for r in rows.values()), any(r[3] for r in rows.values()), param_dtype,
                    compute, fmt or torch.contiguous_format)


# ---------------------------------------------------------------- the local convolution


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class ZeroBlock(torch.autograd.Function):
    """Zeros of a given shape that keep ``x`` and ``w`` (or None) in the graph (their gradients are zero).

    A worker whose output block is empty, or whose input channel block is empty, still
    has to run the adjoints of the exchanges that produced ``x`` and ``w``: its peers
    wait for its (empty or zero) contribution.
    """

    @staticmethod
    def forward(ctx, x, w, shape, memory_format=torch.contiguous_format):
        ctx.x_meta = (x.shape, x.dtype, x.device, memory_format_of(x))
        ctx.w_meta = None if w is None else (w.shape, w.dtype, w.device)
        return zeros_in(shape, memory_format, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        xs, xd, xdev, xfmt = ctx.x_meta
        dw = None if ctx.w_meta is None else torch.zeros(ctx.w_meta[0], dtype=ctx.w_meta[1], device=ctx.w_meta[2])
        return zeros_in(xs, xfmt, dtype=xd, device=xdev), dw, None, None


def conv_output_format(device: torch.device, dtype: torch.dtype, input_format: torch.memory_format,
                       nd: int) -> torch.memory_format:
    """The memory format torch's ``convNd`` returns for an input in ``input_format`` (contiguous weight).

    Asked of torch once per (device, dtype, format, nd) with a tiny convolution, because it
    differs by backend and version.  Workers that hold no input (the receivers of a
    sum-reduce) use it to agree with the ones that do.
    """
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # conv_block computes 16-bit CPU convolutions in fp32
    return input_format if input_format == torch.contiguous_format else _asked_format(device, dtype, input_format, nd)


@functools.cache
def _asked_format(device: torch.device, dtype: torch.dtype, input_format: torch.memory_format, nd: int):
    x = torch.zeros((1, 2) + (3,) * nd, dtype=dtype, device=device).contiguous(memory_format=input_format)
    w = torch.zeros((2, 2) + (1,) * nd, dtype=dtype, device=device)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        return memory_format_of(CONV[nd](x, w))


def conv_block(opts: ConvOptions, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               out_shape: Sequence[int], input_format: torch.memory_format | None = None) -> torch.Tensor:
    """``convNd(x, w, b, stride, padding=0, dilation, groups)`` with the expected ``out_shape``.

    ``x`` is already padded (staged).  Where the output or the reduction is empty the
    result is zeros (plus the bias), still differentiable in ``x``, ``w`` and ``b``, in
    the format torch's convolution returns for ``input_format`` (default: ``x``'s; an
    empty block is dense in every format, so the layers pass the agreed one).
    """
    if torch.is_autocast_enabled(x.device.type):  # x, w and b are cast already (the module docstring)
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
        # w [2,1,3,3,3], stride (1,1,3); right with 2 threads).  Rank pools run one thread per rank, so compute
        # in fp32 and round once: the accurate result of the 16-bit op.
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


# ---------------------------------------------------------------- the layers


class ConvLayer(WeightAndBias, AgreedLayer, nn.Module):
    """What the distributed convolutions share: ``opts`` (a :class:`ConvOptions` or its transposed form), the
    partitions named in ``_grids``, the parameters (:class:`~distfuse.layers._params.WeightAndBias` on ``P_weight``
    and ``P_bias``), the checks of the gathered call and the repr.  ``_check(info)``: the layer's rules on the
    agreed global shape (default: :func:`check_geometry`)."""

    nd: int = 0
    _grids = ("P_x",)
    _exposed = ("in_channels", "out_channels", "groups", "kernel_size", "stride", "dilation", "padding", "padding_mode")

    def _init_params(self, device, dtype) -> None:
        """Set torch's attributes (``_exposed``) from ``opts``, then register and draw the parameters, on ``device``
        (default: ``P_x``'s) in ``dtype`` (default: torch's)."""
        for name in self._exposed:
            setattr(self, name, getattr(self.opts, name))
        self._set_param_home(device if device is not None else self.P_x.device, dtype)
        self._register_params()

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        o = self.opts
        return (o.weight_shape, (o.out_channels,)) if o.bias else (o.weight_shape,)

    def _identity(self) -> tuple:
        """The layer as :func:`gather_call_info` compares it (a digest): its options and partitions."""
        return (self.opts, *((P.ranks, P.shape) for P in (getattr(self, name) for name in self._grids)))

    def _checked(self, info: CallInfo) -> CallInfo:
        """``info`` (the gathered call) after the layer's checks of the global shape: every worker holds it, so a
        refused geometry raises on all of them."""
        op, o = type(self).__name__, self.opts
        if info.global_shape[1] != o.in_channels:
            raise expect(op, "input channels (the global input's dimension 1)", o.in_channels, info.global_shape[1])
        self._check(info)
        return info

    def _check(self, info: CallInfo) -> None:
        check_geometry(type(self).__name__, self.opts, info.global_shape)

    def extra_repr(self) -> str:
        o = self.opts
        grids = "".join(f"{name}={list(getattr(self, name).shape)}, " for name in self._grids)
        extra = f", output_padding={o.output_padding}" if hasattr(o, "output_padding") else ""
        mode = "" if extra else f", padding_mode={o.padding_mode!r}"  # transposed: always 'zeros', not shown
        return (f"{grids}{o.in_channels}, {o.out_channels}, kernel_size={o.kernel_size}, stride={o.stride}, "
                f"padding={o.padding}{extra}, dilation={o.dilation}, groups={o.groups}, bias={o.bias}{mode}")


class RootParams:
    """Weight and bias held by one root worker (``P_x``'s first) and broadcast to every worker of ``P_x`` per call::

        flat    [1, ..., 1, n]   the root's weight and bias, packed (n = weight numel + bias numel)
        forward every worker of P_x gets flat (one message per worker); with a flag, each first
                sends the root its agreement flag and the root appends their sum (the flagged round
                of distfuse::broadcast, primitives/broadcast.py)
        adjoint dflat = sum over the workers of their gradients, onto the root (a sum-reduce)

    Weight and bias travel in one message because a broadcast is latency bound at
    convolution weight sizes.  The flag rides along instead of taking a round of its own:
    the two point-to-point rounds cost less than gloo's all-reduce of the flags.  ``move``
    names the broadcast in graphs (made at construction, in the same order on every rank).
    """

    def __init__(self, P_x: CartesianPartition, opts, op: str, on_flag):
        self.P_x, self.weight_shape, self.bias = P_x, tuple(opts.weight_shape), bool(opts.bias)
        self.root = P_x.ranks[0]
        self.is_root = dist.get_rank() == self.root
        # The root's single-worker grids: one per parameter rank (ParamLayout splits dimension d by dimension d).
        self.P_root = grid_of([self.root], [1] * P_x.dim, P_x.device)
        self.P_root_1d = grid_of([self.root], [1], P_x.device)
        self.move = PlanMove(broadcast_plan(self.P_root, P_x), op, P_x, on_flag)
        self.n_weight = math.prod(self.weight_shape)
        self.n = self.n_weight + (opts.out_channels if self.bias else 0)

    def replicate(self, like: torch.Tensor, weight, bias, dtype: torch.dtype, needs_grad: bool,
                  flag: int = NO_FLAG) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(w, b)`` on every worker of P_x, in ``dtype``: one broadcast of the packed parameters from the root.

        ``flag``: this worker's agreement flag (0 or 1; the flagged round raises on every worker
        when any is set), or ``NO_FLAG``.  ``needs_grad``: every worker runs the sum-reduce its
        root waits for.  ``like``: any tensor of the call (the placeholder is made from it).
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
