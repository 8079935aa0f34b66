"""Feature-distributed convolution: the input is split along batch and spatial axes only.

Partitions and shapes (``nd`` spatial axes, worker at index ``(b, 0, *s)`` of ``P_x``)::

    P_x     [P_b, 1, P_1, ..., P_nd]        P_y = P_x (implicit)
    x       [B_b, C_in, *n_s]               balanced block of the global input
    weight  [C_out, C_in/groups, *k]        on the first worker of P_x only, with the bias [C_out]
    y       [B_b, C_out, *m_s]              balanced block of the sequential output (m = global output extent)

    forward   w, b   = Broadcast(root -> P_x)(weight, bias)          one packed message per worker
              staged = HaloExchange(x)                                exactly the input y_s reads
              y      = convNd(staged, w, b, padding=0, stride, dilation, groups)
    adjoint   dstaged, dw_s, db_s = convNd adjoints                    on every worker
              dx     = HaloExchange*(dstaged)                         halo gradients go home
              dweight, dbias = SumReduce(P_x -> root)(dw_s, db_s)     the Broadcast's adjoint

Why this shape: the output is decomposed by the balanced decomposition of the *output*
shape (what :class:`HaloExchange`'s plan stages for), so with stride, dilation, even
kernels and uneven splits every worker's block is exactly its slice of the sequential
output, and the boundary padding (all four modes) is applied with global semantics.
DistDL instead pads by halo widths that ignore stride and dilation, and its circular
padding wraps each worker's block onto itself.

The parameters travel packed from the root with every worker's agreement flag riding along
(:class:`RootParamConvBase`, shared with the transposed convolution); on CUDA the flag takes
the deferred transport instead (:mod:`~distfuse.primitives._flag_deferred`: a device
all-reduce over ``P_x`` read at the next call, no host round), and a worker whose call
changed while its peers' did not runs the call on a NaN stand-in of its agreed block.
A worker whose output block is empty returns an empty ``[B_b, C_out, *m_s]`` tensor and still takes part in both
exchanges: other workers read its input.

Dispatch: ``select_path("halo_conv", {elements: global input elements / workers}, ...)`` (the
same size on every worker: :func:`~distfuse.fused.registry.halo_elements`), remembered per global
shape, dtype, device and memory format.  On "fused" one Triton pass (``distfuse::halo_conv``)
replaces ``distfuse::halo_exchange`` + ``convNd``.  A ``channels_last`` (``_3d``) input stays
channels last on both paths: the fused kernels then index ``[B, *n, C]`` blocks and stage
rows of ``L_last * C`` contiguous elements (16-byte vectors at any halo width), and the
halo boxes travel as ``[B, *box, C]``, in the format every worker agreed on
(``CallInfo.memory_format``).
The unfused path is differentiable to any order; the fused path refuses a backward with
``create_graph=True`` with :class:`~distfuse.errors.UnsupportedError` on every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distfuse.errors import PartitionError, where
from distfuse.fused.halo_conv import check_implicit, fused_halo_conv, implicit_requested
from distfuse.fused.registry import halo_elements
from distfuse.layers._conv_common import (
    CallInfo,
    ConvLayer,
    ConvOptions,
    RootParams,
    autocast_dtype,
    cast_for_compute,
    check_partition,
    conv_block,
    conv_output_format,
    gather_call_info,
    passes_local_checks,
    spatial_classes,
)
from distfuse.layers.dispatch import Decision, device_caps, select_path
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._layout import format_code, memory_format_of
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.broadcast import NO_FLAG
from distfuse.primitives.halo_exchange import HaloExchange, halo_exchange

__all__ = ["RootParamConvBase", "DistributedFeatureConvBase", "DistributedFeatureConv1d", "DistributedFeatureConv2d",
           "DistributedFeatureConv3d", "FEATURE_CONVS"]


class RootParamConvBase(ConvLayer):
    """The one forward of the convolutions over ``P_x [P_b, 1, *P_s]`` whose parameters live on the root
    (:class:`~distfuse.layers._conv_common.RootParams`): the feature and the transposed convolutions.

    Subclasses set ``opts`` and call :meth:`_setup`, and define ``_travel_dtype(info)`` (what the
    parameters travel in) and ``_local(x, info, w, b)`` (this worker's output block).
    """

    kind = "feature-distributed convolution"  # and what the refusal of a channel-split P_x adds
    _split_hint = ""

    def _check_partition(self, P_x) -> None:
        op = type(self).__name__
        check_partition(op, "P_x", P_x, self.nd)
        if P_x.shape[1] != 1:
            raise PartitionError(f"{where(op)}: the {self.kind} needs P_x unsplit along channels (shape [P_b, 1, "
                                 f"...]), got {list(P_x.shape)}{self._split_hint}")

    def _setup(self, P_x, opts, device, dtype, static_shapes: bool) -> None:
        """The parameters, the agreement session and the records (after the subclass made ``opts``)."""
        self.P_x, self.opts, self.static_shapes = P_x, opts, bool(static_shapes)
        self._agree_over(P_x)
        self.params = RootParams(P_x, opts, type(self).__name__, self.session.forget)
        self.root, self.P_weight, self.P_bias = self.params.root, self.params.P_root, self.params.P_root_1d
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._init_params(device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op, P_x = type(self).__name__, self.P_x
        if not P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]

        def run(info: CallInfo, flag: int):
            w, b = self.params.replicate(x, self.weight, self.bias, self._travel_dtype(info), info.param_grad, flag)
            return None if flag == 1 else (info, w, b)  # flag 1: the round raises on every worker

        def gather():
            info = self._checked(gather_call_info(op, P_x, P_x, x, params, signature=self._identity()))
            return run(info, NO_FLAG), info

        signature = (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
                     tuple((p.requires_grad, p.dtype) for p in params), autocast_dtype(P_x.device.type))
        got = self.session.agree_in(signature, passes_local_checks(P_x, x), run, gather, deferrable=True)
        if got is None:  # a replayed call that flagged: the parameter round raises on every worker
            return x.clone()
        info, w, b = got
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed block
            x = self.session.stand_in(x).contiguous(memory_format=info.memory_format)
        return self._local(x, info, w, b)


class DistributedFeatureConvBase(RootParamConvBase):
    """Convolution over an input split along batch and spatial axes (see the module docstring).

    ``P_x``: CartesianPartition ``[P_b, 1, P_1, ..., P_nd]``; the other arguments as
    ``torch.nn.ConvNd`` (``padding`` may also hold ``(lo, hi)`` pairs).  ``weight`` and
    ``bias`` are None except on the root (``P_x``'s first worker).
    """

    _split_hint = ("; pass P_y and P_w to DistributedConv{1,2,3}d for a channel or general distributed "
                   "convolution")

    def __init__(self, P_x, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None,
                 static_shapes: bool = False):
        super().__init__()
        op = type(self).__name__
        self._check_partition(P_x)
        o = ConvOptions.make(op, self.nd, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                             bias, padding_mode)
        self.halo = HaloExchange(P_x, o.kernel_size, o.stride, o.padding, o.dilation, o.padding_mode, _op=op)
        self._caps_cache: dict = {}
        self._setup(P_x, o, device, dtype, static_shapes)

    def _travel_dtype(self, info: CallInfo) -> torch.dtype:
        return info.param_dtype or info.dtype

    # ------------------------------------------------------------ dispatch

    def explain(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> Decision:
        """Which path a call with ``x`` takes, and why (no communication).  The halo_conv rule sizes a call by the
        global input's elements over the workers (:func:`~distfuse.fused.registry.halo_elements`, alike on every
        rank); without ``global_shape``, by ``x``'s own block (the same where the split is even)."""
        if x.device not in self._caps_cache:  # device_caps asks CUDA for the device name: once per device
            self._caps_cache[x.device] = device_caps(x.device)
        elements = halo_elements(global_shape, self.P_x.size) if global_shape is not None else float(x.numel())
        return select_path("halo_conv", dict(elements=elements), x.dtype, self.P_x.size, self._caps_cache[x.device])

    # ------------------------------------------------------------ the local block

    def _local(self, x: torch.Tensor, info: CallInfo, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The path (remembered per key, see the module docstring), the staging and this worker's convolution."""
        o, G = self.opts, info.global_shape
        compute = info.compute_dtype or info.dtype
        x, w, b = cast_for_compute(x, compute), cast_for_compute(w, compute), cast_for_compute(b, compute)
        fmt = memory_format_of(x)
        self.last_decision, implicit = self.session.remember(
            ("path", G, x.dtype, x.device.type, format_code(fmt)), lambda: (self.explain(x, G), implicit_requested()))
        self.last_path = self.last_decision.path
        x_anchor = anchor(info.input_grad)  # a block that does not require grad still runs the halo adjoint
        if self.last_path == "fused":
            channels_last = info.memory_format != torch.contiguous_format  # agreed: the messages' box order
            check_implicit(implicit, o.groups, x.dtype, channels_last)
            with torch.autocast(x.device.type, enabled=False):  # x, w, b are in the compute dtype already
                y = fused_halo_conv(x, w, b, self.halo, G, o.groups, type(self).__name__, implicit, x_anchor,
                                    channels_last)
            # the format torch.nn's convolution returns for this input's (CPU conv3d: NCDHW for channels_last_3d)
            return y.contiguous(memory_format=conv_output_format(x.device, x.dtype, info.memory_format, self.nd))
        staged = halo_exchange(x, self.halo.handle, list(G), x_anchor)
        out_shape = (x.shape[0], o.out_channels) + self.halo.plan(G).output_shape(self.P_x.index[2:])
        return conv_block(o, staged, w, b, out_shape, fmt)


FEATURE_CONVS = spatial_classes(DistributedFeatureConvBase, "DistributedFeatureConv",
                                "Feature-distributed ``Conv{nd}d``: P_x ``[P_b, 1, {s}]``.")
DistributedFeatureConv1d, DistributedFeatureConv2d, DistributedFeatureConv3d = FEATURE_CONVS
