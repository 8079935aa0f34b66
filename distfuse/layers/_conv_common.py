"""Pieces shared by the distributed convolutions: options, per-call metadata, parameter init, empty blocks.

* :class:`ConvOptions` normalises torch's ``ConvNd`` arguments once (per-axis tuples,
  ``(lo, hi)`` padding from ints, pairs, ``'same'`` or ``'valid'``) and raises
  torch's own complaints (groups, padding mode) as distfuse errors naming the layer.
* :func:`gather_call_info` is the host-side collective that tells every worker of the
  layer's partitions every other's ``(shape, dtype, requires_grad flags, autocast)``, so
  that workers holding no input learn the global shape and the dtype, and so that every
  worker agrees on whether the adjoints run.  Every convolution runs it only on its
  first call and when some worker's inputs changed (the agreement protocol,
  :mod:`~distfuse.primitives._agreement`; the general and channel convolutions through
  :func:`agreed_call_info`, whose flag is a one-element host all-reduce).  That
  agreement matters: a worker
  whose received block does not require grad never runs its Broadcast adjoint, and
  its source then waits for that gradient until the process-group timeout.  With
  ``DISTFUSE_DEBUG=1`` it first checks that every worker is calling the same layer
  (its options and partitions), so that ranks that call layers in different orders
  fail with :class:`~distfuse.errors.CollectiveMismatchError` instead of exchanging
  blocks of different layers.
* :func:`draw_parameters` draws the *global* weight and bias exactly as
  ``torch.nn.ConvNd.reset_parameters`` does, so that with the same seed a distributed
  layer holds the blocks of the sequential layer's parameters.
* :func:`conv_block` is the local convolution, also where a worker's block is empty
  (torch refuses those, or answers with the wrong shape for zero input channels).
* **Autocast.**  Under ``torch.autocast`` a convolution runs in the autocast dtype, as
  ``torch.nn.ConvNd`` does: :func:`autocast_dtype` gives it, the layers cast the input
  (before its halo exchange, which then moves the smaller dtype) and the replicated
  parameters to it, and :func:`conv_block` runs with autocast off (so that its fp32
  computation of 16-bit CPU convolutions is not cast back).  The output has the autocast
  dtype and the parameters' gradients their own dtype, as torch's.
* **Memory format.**  A ``channels_last`` input gives a ``channels_last`` output wherever
  ``torch.nn.ConvNd`` does (CPU Conv2d and CUDA convolutions do; torch 2.13's CPU Conv3d
  returns NCDHW): the halo exchange stages in the input's format, :func:`conv_block`
  then computes in it, and :func:`conv_output_format` asks torch which format its
  convolution returns.  :func:`gather_call_info` exchanges the input's format, because
  workers that hold only weights or outputs never see the input, and the channel and
  general convolutions move their blocks in the agreed format.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import init

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import CollectiveMismatchError, PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.geometry.halo_plan import PADDING_MODES, resolve_padding
from distfuse.partition import CartesianPartition, Partition
from distfuse.primitives._agreement import AgreementSite, agreed_by_flag_round
from distfuse.primitives._common import collective_guard
from distfuse.primitives._layout import memory_format_of, zeros_in

__all__ = ["ConvOptions", "CallInfo", "gather_call_info", "draw_parameters", "conv_block", "pad_locally",
           "grid_of", "check_partition", "promote", "autocast_dtype", "cast_for_compute", "local_call_checks",
           "check_geometry", "conv_output_format", "call_signature", "agreed_call_info", "passes_local_checks"]

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


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


# ---------------------------------------------------------------- per-call metadata

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
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

    ``input_grad`` / ``param_grad``: some worker's input / parameter requires grad
    (with grad mode on), so every worker must take part in that adjoint.
    ``param_dtype``: the parameters' dtype (``dtype`` for layers without parameters);
    ``compute_dtype``: what the convolution computes in, the autocast dtype when every
    worker is under ``torch.autocast`` (and the input is not float64), else ``dtype``.
    ``memory_format``: ``channels_last`` (``_3d``) when every P_x block is dense in it and
    some is not plainly contiguous (blocks dense in both, such as one channel, agree with
    either), else contiguous.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    input_grad: bool
    param_grad: bool
    param_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    memory_format: torch.memory_format = torch.contiguous_format  # the input's, agreed (see gather_call_info)


def local_call_checks(P_x: CartesianPartition, x: torch.Tensor) -> int:
    """This worker's problem code for :func:`gather_call_info` (``_OK`` when its input passes the local checks)."""
    if P_x.active:
        if x.device.type != P_x.device.type:
            return _BAD_DEVICE
        if x.dtype not in _DTYPES:
            return _BAD_DTYPE
        if x.dim() > _MAX_DIM:
            return _TOO_MANY_DIMS
        return _OK
    return _NOT_EMPTY if x.numel() != 0 else _OK


def passes_local_checks(P_x: CartesianPartition, x: torch.Tensor) -> bool:
    """Whether this worker's input passes :func:`local_call_checks` and has one dimension per dimension of P_x."""
    return local_call_checks(P_x, x) == _OK and (not P_x.active or x.dim() == P_x.dim)


def gather_call_info(op: str, P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                     params: Sequence[torch.Tensor], signature=None) -> CallInfo:
    """All-gather ``(shape, dtype, grad flags, autocast)`` over ``P_union`` (host gloo, 12 int64 per worker).

    Every worker validates every record, so a bad block raises the same error on every
    worker instead of a hang: the input must be the balanced decomposition of one
    global shape over ``P_x``, in one floating dtype, equal to the parameters' dtype
    unless the workers run under ``torch.autocast`` (then every worker must, with one
    autocast dtype: the halo and broadcast messages travel in it); workers outside
    ``P_x`` pass zero-volume tensors.  ``signature`` (the layer's options and partitions)
    is compared across workers, as a digest (:class:`~distfuse.errors.CollectiveMismatchError`
    when workers call different layers here), and in full in debug mode.
    """
    if signature is not None and debug.enabled():
        debug.check_agreement(op, P_union.ranks, P_union.meta_group, same={"layer": signature},
                              info={"local shape": tuple(x.shape)})
    grad_on = torch.is_grad_enabled()
    rec = torch.full((_HEAD + _MAX_DIM,), -1, dtype=torch.int64)
    problem = local_call_checks(P_x, x)
    ac = autocast_dtype(P_x.device.type)
    rec[0] = x.dim()
    rec[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    rec[2] = int(grad_on and x.requires_grad)
    rec[3] = int(grad_on and any(p.requires_grad for p in params))
    rec[4] = _DTYPES.index(params[0].dtype) if params and params[0].dtype in _DTYPES else -1
    rec[5] = problem
    rec[6] = _DTYPES.index(ac) if ac in _DTYPES else (-1 if ac is None else -2)
    # A stable digest of the layer (options, partitions): ranks that call different layers here (a program-order
    # bug) raise instead of moving one layer's parameters into another's buffers.
    rec[7] = zlib.crc32(repr(signature).encode()) if signature is not None else -1
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    rec[8] = (_DENSE if x.is_contiguous() else 0) | (_DENSE_CL if cl is not None and x.is_contiguous(
        memory_format=cl) else 0)
    if problem == _OK and P_x.active:
        rec[_HEAD:_HEAD + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    out = torch.empty(P_union.size * rec.numel(), dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P_union.ranks):
        all_gather_flat(out, rec, group=P_union.meta_group)
    # Slot g of the gather belongs to the g-th smallest world rank (new_group sorts its ranks), which is not
    # partition rank g when P_union lists its ranks out of order (a feature conv's P_x may).
    rows = dict(zip(sorted(P_union.ranks), out.view(P_union.size, -1).tolist(), strict=True))
    for w, r in rows.items():
        if r[5] == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_x.device.type, "another device")
        if r[5] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed a non-floating input; expected one of "
                             f"{[str(d) for d in _DTYPES]}")
        if r[5] == _TOO_MANY_DIMS or (w in P_x.ranks and r[0] != P_x.dim):
            raise expect(op, f"number of input dimensions on world rank {w} ([batch, channel, spatial...], one per "
                         "dimension of P_x)", P_x.dim, r[0])
        if r[5] == _NOT_EMPTY:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor")
    if len({r[7] for r in rows.values()}) != 1:
        digests = dict(sorted((w, r[7]) for w, r in rows.items()))
        raise CollectiveMismatchError(f"{where(op)}: the workers are not calling the same layer (their options or "
                                      "partitions differ; call the layers in the same order on every worker): layer "
                                      f"digests {digests} (world rank: digest)")
    x_rows = [rows[w] for w in P_x.ranks]
    dtypes = {r[1] for r in x_rows}
    if len(dtypes) != 1:
        got = {w: str(_DTYPES[rows[w][1]]) for w in P_x.ranks}
        raise ShapeError(f"{where(op)}: the workers of P_x must pass one dtype; got {got} (world rank: dtype)")
    dtype = _DTYPES[dtypes.pop()]
    autocasts = {r[6] for r in rows.values()}
    if len(autocasts) != 1 or -2 in autocasts:
        got = {w: ("off" if r[6] == -1 else str(_DTYPES[r[6]]) if r[6] >= 0 else "unsupported") for w, r in
               rows.items()}
        raise ShapeError(f"{where(op)}: every worker must run this layer under the same torch.autocast state (its "
                         f"dtype is what the exchanges carry); got {got} (world rank: autocast dtype)")
    ac_code = autocasts.pop()
    param_dtypes = {r[4] for r in rows.values() if r[4] >= 0}
    if len(param_dtypes) > 1:
        raise ShapeError(f"{where(op)}: the workers' parameters must share one dtype; got "
                         f"{ {w: str(_DTYPES[r[4]]) for w, r in rows.items() if r[4] >= 0} } (world rank: dtype)")
    if ac_code < 0 and param_dtypes and param_dtypes != {_DTYPES.index(dtype)}:
        raise expect(op, "input dtype (the parameters' dtype, as torch's ConvNd requires outside torch.autocast)",
                     [str(_DTYPES[c]) for c in sorted(param_dtypes)], str(dtype))
    param_dtype = _DTYPES[param_dtypes.pop()] if param_dtypes else dtype
    compute = _DTYPES[ac_code] if ac_code >= 0 and dtype != torch.float64 else dtype
    layouts = [r[8] for r in x_rows]
    channels_last = all(b & _DENSE_CL for b in layouts) and not all(b & _DENSE for b in layouts)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(P_x.dim) if channels_last else None
    shapes = [tuple(r[_HEAD:_HEAD + P_x.dim]) for r in x_rows]
    G = tuple(sum(shapes[P_x.rank_of([k if e == d else 0 for e in range(P_x.dim)])][d] for k in range(P_x.shape[d]))
              for d in range(P_x.dim))
    for r, shape in enumerate(shapes):
        want = local_shape(G, P_x.shape, P_x.index_of(r))
        if shape != want:
            raise expect(op, f"local input shape on world rank {P_x.ranks[r]} (P_x index {P_x.index_of(r)}; the blocks "
                         f"must be the balanced decomposition of the global shape {G} inferred from them)", want, shape)
    return CallInfo(G, dtype, any(r[2] for r in rows.values()), any(r[3] for r in rows.values()), param_dtype,
                    compute, fmt or torch.contiguous_format)


def call_signature(x: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple:
    """This worker's signature of a call: everything of its own that :func:`gather_call_info` records.

    Local shape, dtype, device type, grad mode, the input's and the parameters'
    ``requires_grad`` and dtype, autocast, and the layout bits (dense in NCHW, dense in
    ``channels_last``): while it repeats on every worker the agreed :class:`CallInfo` holds.
    """
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    layout = (x.is_contiguous(), cl is not None and x.is_contiguous(memory_format=cl))
    return (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
            tuple((p.requires_grad, p.dtype) for p in params), autocast_dtype(x.device.type), layout)


def agreed_call_info(site: AgreementSite, op: str, P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                     params: Sequence[torch.Tensor], signature=None, check=None) -> CallInfo:
    """:func:`gather_call_info` under the agreement protocol: a one-element flag round while signatures repeat.

    For layers whose data messages do not reach every worker of ``P_union`` (the general
    and channel convolutions: their broadcasts and sum-reduce run along P_w's rows and
    columns, point to point), so the flag travels in
    :func:`~distfuse.primitives._agreement.flag_round` on ``P_union``'s host meta group
    (one int64, no device read) before any data moves.  Any worker whose
    :func:`call_signature` changed, or whose input fails the local checks
    (:func:`local_call_checks`: device, dtype, number of dimensions, data outside P_x),
    sets its flag instead of raising, so every worker takes the slow path together: the
    metadata gather, its checks and ``check(info)`` (the layer's own rules on the global
    shape), which raise the same error on every worker.  The first call gathers directly.
    """
    mine = call_signature(x, params)
    locally_ok = passes_local_checks(P_x, x)

    def slow() -> CallInfo:
        info = gather_call_info(op, P_union, P_x, x, params, signature=signature)
        if check is not None:
            check(info)
        return info

    return agreed_by_flag_round(site, P_union, op, mine, locally_ok, slow)


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


# ---------------------------------------------------------------- local convolution


class _ZeroBlock(torch.autograd.Function):
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
        y = _ZeroBlock.apply(x, w, tuple(out_shape), fmt)
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
