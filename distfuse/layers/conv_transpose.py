"""Feature-distributed transposed convolution: the input is split along batch and spatial axes only.

Partitions and shapes (``nd`` spatial axes, worker at index ``(b, 0, *s)`` of ``P_x``)::

    P_x     [P_b, 1, P_1, ..., P_nd]        P_y = P_x (implicit)
    x       [B_b, C_in, *n_s]               balanced block of the global input
    weight  [C_in, C_out/groups, *k]        on the first worker of P_x only, with the bias [C_out]
    y       [B_b, C_out, *m_s]              balanced block of the global output, m = (n-1)s - 2p + d(k-1) + q + 1

    forward   w, b   = Broadcast(root -> P_x)(weight, bias)          one packed message per worker
              staged = HaloExchange[transpose plan](x)               the inputs [a, b) that reach y_s
              y      = crop_or_zero_extend(conv_transposeNd(staged, w, stride, padding=0, dilation, groups)) + b
    adjoint   dstaged, dw_s, db_s = the local adjoints (a strided convolution, a crop)
              dx     = HaloExchange*(dstaged)                         halo gradients go home
              dweight, dbias = SumReduce(P_x -> root)(dw_s, db_s)     the Broadcast's adjoint

The geometry is :mod:`distfuse.geometry.transpose_plan`: output ``o`` reads the inputs
``i`` with ``o = i*s - p + t*d`` for a kernel tap ``t``, so each worker fetches the
smallest input range that reaches its output block and computes exactly that block.

Why inputs travel, not partial outputs (the textbook form, the adjoint of a halo exchange
that sums each worker's overlapping output windows into their owners): every output is
summed once, locally, in torch's order, so 16-bit outputs are rounded once; upsampling
sends less (per side about ``d(k-1)/s`` input rows of ``C_in`` channels, against ``d(k-1) +
1 - s`` output rows of ``C_out`` channels ``s`` times longer; U-Net's ``k = s, p = 0`` on
extents the grid divides sends nothing); and the balanced decomposition of the *output*
falls out of the plan (a block no input reaches gets zeros plus the bias).

The exchange is ``distfuse::halo_exchange`` driven by the transposed plan (a
:class:`~distfuse.primitives.halo_exchange.PlanHalo`); parameters and agreement as in
:class:`~distfuse.layers.conv_feature.RootParamConvBase` (the parameters travel in the
input's dtype).  No fused path.  Refused as torch refuses them, on every rank:
``padding_mode`` other than ``'zeros'``, an output padding not smaller than the stride or
the dilation, string or ``(lo, hi)`` padding (at construction), and an empty spatial input
or a global output extent below 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distfuse.errors import DistfuseError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.geometry.transpose_plan import block_pads, check_output_padding, transpose_plan
from distfuse.layers._conv_common import CallInfo, ConvOptions, ZeroBlock, spatial_classes
from distfuse.layers.conv_feature import RootParamConvBase
from distfuse.partition import CartesianPartition
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.halo_exchange import PlanHalo, halo_exchange

__all__ = ["ConvTransposeOptions", "DistributedConvTransposeBase", "DistributedConvTranspose1d",
           "DistributedConvTranspose2d", "DistributedConvTranspose3d", "conv_transpose_block"]

CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _int_tuple(op: str, v, nd: int, name: str) -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list)) else None
    if t is None or len(t) != nd or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in t):
        raise UnsupportedError(f"{where(op)}: {name} must be a non-negative int or {nd} non-negative ints (as "
                               f"torch's ConvTranspose{nd}d), got {v!r}")
    return t


@dataclass(frozen=True)
class ConvTransposeOptions(ConvOptions):
    """torch ``ConvTransposeNd`` arguments, normalised per spatial axis: those of :class:`ConvOptions` (checked
    alike), with one ``padding`` per axis, ``padding_mode`` ``'zeros'``, and ``output_padding``."""

    padding: tuple[int, ...]
    output_padding: tuple[int, ...] = ()

    @classmethod
    def make(cls, op: str, nd: int, in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
             bias, dilation, padding_mode) -> ConvTransposeOptions:
        if padding_mode != "zeros":  # torch: ValueError('Only "zeros" padding mode is supported for ConvTranspose')
            raise expect(op, "padding_mode (a transposed convolution supports only 'zeros', as in torch)", "'zeros'",
                         repr(padding_mode), UnsupportedError)
        pad = _int_tuple(op, padding, nd, "padding")
        out_pad = _int_tuple(op, output_padding, nd, "output_padding")
        conv = super().make(op, nd, in_channels, out_channels, kernel_size, stride, pad, dilation, groups, bias,
                            "zeros")  # the checks shared with ConvNd: channels, groups, positive tuples
        try:
            check_output_padding(out_pad, conv.stride, conv.dilation)
        except UnsupportedError as exc:
            raise UnsupportedError(f"{where(op)}: {exc}") from None
        return dataclasses.replace(conv, padding=pad, output_padding=out_pad)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.out_channels // self.groups, *self.kernel_size)


def conv_transpose_block(opts: ConvTransposeOptions, staged: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                         pads: Sequence[tuple[int, int]], out_shape: Sequence[int]) -> torch.Tensor:
    """This worker's output block: ``conv_transposeNd(staged, w, stride, padding=0, dilation, groups)``, cropped
    or zero-extended by ``pads`` (per axis ``(lo, hi)``, negative crops), the bias added to every output.  An
    empty or unreached block gives zeros plus the bias, still differentiable in ``staged`` and ``w``."""
    if 0 in out_shape or 0 in staged.shape[2:]:
        y = ZeroBlock.apply(staged, w, tuple(out_shape))
        return y if b is None else y + b.view(1, -1, *([1] * opts.nd))
    dtype = staged.dtype
    if staged.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        # Compute in fp32 and round once, as conv_block does: the bias added after a zero-extending crop would
        # otherwise round a second time in 16 bits.
        staged, w, b = staged.float(), w.float(), None if b is None else b.float()
    extends = any(v > 0 for lo_hi in pads for v in lo_hi)
    y = CONV_TRANSPOSE[opts.nd](staged, w, None if extends else b, opts.stride, 0, 0, opts.groups, opts.dilation)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    if any(flat):
        y = F.pad(y, flat)
    if extends and b is not None:  # zero-extended outputs get the bias too
        y = y + b.view(1, -1, *([1] * opts.nd))
    return y.to(dtype)


class DistributedConvTransposeBase(RootParamConvBase):
    """Transposed convolution over an input split along batch and spatial axes (see the module docstring).

    ``P_x``: CartesianPartition ``[P_b, 1, P_1, ..., P_nd]``; the other arguments as
    ``torch.nn.ConvTransposeNd`` (same order).  ``weight`` and ``bias`` are None except on
    the root (``P_x``'s first worker).
    """

    kind = "feature-distributed transposed convolution"
    _exposed = (*RootParamConvBase._exposed, "output_padding")

    def __init__(self, P_x: CartesianPartition, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 output_padding=0, groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros",
                 device=None, dtype=None, static_shapes: bool = False):
        super().__init__()
        op = type(self).__name__
        self._check_partition(P_x)
        o = ConvTransposeOptions.make(op, self.nd, in_channels, out_channels, kernel_size, stride, padding,
                                      output_padding, groups, bias, dilation, padding_mode)
        self._windows: dict[tuple[int, ...], tuple] = {}
        self._halo = PlanHalo(P_x, self.nd, self.plan, op)  # names the transposed plan in the halo ops
        self._setup(P_x, o, device, dtype, static_shapes)

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        """The staging exchange for a global input shape (cached); ShapeError where torch refuses the geometry."""
        return self._window(global_shape)[0]

    def _check(self, info: CallInfo) -> None:
        self._window(info.global_shape)

    def _travel_dtype(self, info: CallInfo) -> torch.dtype:
        return info.dtype  # the parameters travel in the input dtype, as the local transposed convolution needs

    def _window(self, G: Sequence[int]) -> tuple:
        """``(plan, pads, output extents)`` of this worker for a global shape: made by the first (eager) call with
        its spatial extents, then read (a compiled call only reads it: a walk over the plan would break the graph)."""
        spatial = tuple(int(n) for n in G[2:])
        if spatial not in self._windows:
            o, index = self.opts, self.P_x.index[2:]
            try:
                plan = transpose_plan(spatial, self.P_x.shape[2:], o.kernel_size, o.stride, o.dilation, o.padding,
                                      o.output_padding)
            except DistfuseError as exc:
                raise type(exc)(f"{where(type(self).__name__)}: global input shape {tuple(G)}: {exc}") from None
            self._windows[spatial] = (plan, block_pads(plan, index), plan.output_shape(index))
        return self._windows[spatial]

    def _local(self, x: torch.Tensor, info: CallInfo, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The transposed plan's inputs staged (in x's layout, channels_last included), then the local block."""
        G = info.global_shape
        _, pads, out_spatial = self._window(G)
        staged = halo_exchange(x, self._halo.handle, list(G), anchor(info.input_grad))
        return conv_transpose_block(self.opts, staged, w, b, pads, (x.shape[0], self.opts.out_channels) + out_spatial)


DistributedConvTranspose1d, DistributedConvTranspose2d, DistributedConvTranspose3d = spatial_classes(
    DistributedConvTransposeBase, "DistributedConvTranspose",
    "Feature-distributed ``ConvTranspose{nd}d``: P_x ``[P_b, 1, {s}]``.")
