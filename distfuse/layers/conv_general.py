"""General distributed convolution: input and output split along channels and spatial axes.

Partitions and shapes (``nd`` spatial axes; ``i`` output-channel block, ``j`` input-channel
block, ``s`` spatial block; the batch is not split)::

    P_x     [1, P_ci, *P_s]       x        [B, Ci_j, *n_s]           on P_x worker (0, j, s)
    P_y     [1, P_co, *P_s]       y        [B, Co_i, *m_s]           on P_y worker (0, i, s)
    P_w     [P_co, P_ci, *P_s]    weight   [Co_i, Ci_j, *k]          stored on P_w workers (i, j, 0)
                                  bias     [Co_i]                    stored on P_w workers (i, 0, 0)

    forward   staged_js = HaloExchange(P_x)(x_js)                     exactly the input y_s reads
              xb_ijs    = Broadcast(P_x -> P_w)(staged_js)            along the P_co dimension
              w_ijs     = Broadcast(spatial 0 -> all s)(w_ij0);  b_i0s likewise from (i, 0, 0)
              y_ijs     = convNd(xb_ijs, w_ijs, b_i if j == 0, padding=0, stride, dilation)
              y_is      = SumReduce(P_w -> P_y)(y_ijs)                over j
    adjoint   dy_ijs = Broadcast(dy_is); conv adjoints; dstaged_js = sum over i;
              dx_js = HaloExchange*(dstaged_js); dw_ij0 = sum over s; db_i00 = sum over s

``m_s`` is the balanced decomposition of the global output extent, so every output block
is exactly its slice of the sequential ``ConvNd`` output, with stride, dilation, even
kernels, uneven splits and the four padding modes applied with global semantics (the
halo geometry is :class:`~distfuse.geometry.halo_plan.HaloPlan`'s).  The SumReduce
lands on P_y through a view of P_y's workers as a ``[P_co, 1, *P_s]`` grid, which is
what lets P_w's row ``i`` reduce into P_y's channel block ``i``.

``groups > 1`` is supported only when channels are unsplit (``P_co = P_ci = 1``): with
split channels a weight block would mix groups, and distfuse refuses rather than answer
wrongly (use the feature-distributed convolution for grouped convolutions).

Workers: P_x-only, P_w-only and P_y-only workers (and any overlap) all work; workers
outside the three partitions pass and get back a zero-volume tensor.

Agreement at a small steady-state cost.  Workers without input must learn the global
shape and dtype, and every worker must agree on which adjoints run: that takes a
host-side metadata gather over the union of the partitions
(:func:`~distfuse.layers._conv_call_info.gather_call_info`).  It runs on the first call and
when some worker's signature (local shape, dtype, grad flags, the parameters', autocast,
layout) changed or its input fails a local check
(:func:`~distfuse.layers._conv_call_info.agreed_call_info`).  No data collective of this
layer reaches every worker of the union in forward (the broadcasts and the sum-reduce
run point to point along P_w's rows and columns), so the agreement flag travels in its
own one-element all-reduce on the union's host meta group, before any data moves
(:func:`~distfuse.primitives._agreement.flag_round`; about a sixth of the gather's cost,
see ``docs/reliability.md``).  A disagreement raises the same error on every worker;
a change of global shape on every worker just works.

``torch.compile(layer, fullgraph=True)`` traces it without a graph break: a compiled call
reuses the record of the last eager call and moves data only through custom ops
(``distfuse::flag_check``, ``conv_halo``, ``block_broadcast``, ``block_sum_reduce``; see
:mod:`~distfuse.layers._conv_general_compiled`), so the graph holds no metadata exchange
and every worker of the union traces the same ops.

Under ``torch.autocast`` the input, the staged blocks, the partial outputs and the output
travel and compute in the autocast dtype, the weight blocks travel in their own dtype and
are cast where they are used, as ``torch.nn.ConvNd`` casts them.  Gradients of any order
are exact (every primitive's backward is itself differentiable).  Every worker of
the union must call backward when one does (on its zero-volume output where it holds
no output block).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from distfuse.errors import PartitionError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import block_extent, local_shape, local_slices
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._conv_block import conv_block, conv_output_format
from distfuse.layers._conv_call_info import agreed_call_info, cast_for_compute
from distfuse.layers._conv_common import ConvOptions, check_geometry, check_partition, draw_parameters, grid_of, promote
from distfuse.layers._conv_general_compiled import CompiledGeneralConvMixin
from distfuse.layers._params import ParamLayout
from distfuse.partition import union_partition, zero_volume_tensor
from distfuse.primitives._agreement import AgreementSite
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives.broadcast import broadcast, broadcast_plan
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.primitives.sum_reduce import sum_reduce, sum_reduce_plan

__all__ = ["DistributedGeneralConvBase", "DistributedGeneralConv1d", "DistributedGeneralConv2d",
           "DistributedGeneralConv3d"]


class DistributedGeneralConvBase(BlockIdentityMixin, CompiledGeneralConvMixin, nn.Module):
    """Convolution with channels and spatial axes split (see the module docstring).

    Args:
        P_x, P_y, P_w: CartesianPartitions ``[1, P_ci, *P_s]``, ``[1, P_co, *P_s]`` and
            ``[P_co, P_ci, *P_s]`` (P_y and P_w are required, by keyword).
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
        bias, padding_mode, device, dtype: as ``torch.nn.ConvNd``; ``padding`` may also
        hold ``(lo, hi)`` pairs.  ``device`` defaults to ``P_x.device``.

    Construction is collective over the world (it creates sub-grids of P_w and the
    union partition) and draws the parameters like the sequential layer on every rank.
    """

    nd: int = 0
    last_path = "unfused"  # no fused path for channel-split convolutions

    def __init__(self, P_x, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", P_y=None, P_w=None, device=None,
                 dtype=None):
        super().__init__()
        op = type(self).__name__
        for name, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
            if P is None:
                raise PartitionError(f"{where(op)}: {name} is required (the weight partition P_w drives this layer)")
            check_partition(op, name, P, self.nd)
        self._check_partitions(op, P_x, P_y, P_w)
        self.P_x, self.P_y, self.P_w = P_x, P_y, P_w
        self.opts = o = ConvOptions.make(op, self.nd, in_channels, out_channels, kernel_size, stride, padding,
                                         dilation, groups, bias, padding_mode)
        P_co, P_ci = P_w.shape[:2]
        if o.groups > 1 and (P_co > 1 or P_ci > 1):
            raise UnsupportedError(f"{where(op)}: groups={o.groups} with split channels (P_w {list(P_w.shape)}) is "
                                   "not supported: a weight block would mix groups; split only spatial axes (the "
                                   "feature-distributed convolution) for grouped convolutions")
        self.in_channels, self.out_channels, self.groups = o.in_channels, o.out_channels, o.groups
        self.kernel_size, self.stride, self.dilation = o.kernel_size, o.stride, o.dilation
        self.padding, self.padding_mode = o.padding, o.padding_mode
        self.halo = HaloExchange(P_x, o.kernel_size, o.stride, o.padding, o.dilation, o.padding_mode, _op=op)
        self._device = torch.device(device) if device is not None else P_x.device
        self._dtype = dtype if dtype is not None else torch.get_default_dtype()
        self._build_grids()
        self.agreement = AgreementSite(op)
        if self._P_wr.active:
            shape = local_shape(o.weight_shape, self._P_wr.shape, self._P_wr.index)
            self.weight = nn.Parameter(torch.empty(shape, device=self._device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        if o.bias and self._P_b1.active:
            shape = local_shape((o.out_channels,), self._P_b1.shape, self._P_b1.index)
            self.bias = nn.Parameter(torch.empty(shape, device=self._device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _check_partitions(self, op, P_x, P_y, P_w) -> None:
        bad = []
        if P_x.shape[0] != 1 or P_y.shape[0] != 1:
            bad.append(f"P_x and P_y unsplit along the batch (P_x {list(P_x.shape)}, P_y {list(P_y.shape)})")
        if P_w.shape[1] != P_x.shape[1]:
            bad.append(f"P_w.shape[1] == P_x.shape[1] (input channels): {P_w.shape[1]} vs {P_x.shape[1]}")
        if P_w.shape[0] != P_y.shape[1]:
            bad.append(f"P_w.shape[0] == P_y.shape[1] (output channels): {P_w.shape[0]} vs {P_y.shape[1]}")
        if not P_x.shape[2:] == P_y.shape[2:] == P_w.shape[2:]:
            bad.append(f"one spatial split: P_x {list(P_x.shape[2:])}, P_y {list(P_y.shape[2:])}, "
                       f"P_w {list(P_w.shape[2:])}")
        if bad:
            raise PartitionError(f"{where(op)}: incompatible partitions; needed " + "; ".join(bad))

    def _build_grids(self) -> None:
        """Sub-grids of P_w that own or receive parameters, and P_y seen as a [P_co, 1, *P_s] grid."""
        P_w, nd, dev = self.P_w, self.nd, self.P_x.device
        P_co, P_ci, P_s = P_w.shape[0], P_w.shape[1], P_w.shape[2:]
        at = lambda i, j, s: P_w.ranks[P_w.rank_of((i, j, *s))]
        s0 = (0,) * nd
        spatial = list(itertools.product(*(range(p) for p in P_s)))
        self._P_wr = grid_of([at(i, j, s0) for i in range(P_co) for j in range(P_ci)], [P_co, P_ci] + [1] * nd, dev)
        bias_owners = [at(i, 0, s0) for i in range(P_co)]
        self._P_b = grid_of(bias_owners, [P_co, 1] + [1] * nd, dev)
        self._P_b1 = grid_of(bias_owners, [P_co], dev)
        self._P_bd = grid_of([at(i, 0, s) for i in range(P_co) for s in spatial], [P_co, 1, *P_s], dev)
        self._P_yv = grid_of(self.P_y.ranks, [P_co, 1, *P_s], dev)
        self.P_union = union_partition(self.P_x, self.P_w, self.P_y)
        self._x_plan = broadcast_plan(self.P_x, P_w)
        self._w_plan = broadcast_plan(self._P_wr, P_w)
        self._b_plan = broadcast_plan(self._P_b, self._P_bd)
        self._y_plan = sum_reduce_plan(P_w, self._P_yv)
        self._build_compiled_contexts()  # the handles a compiled forward names its moves by

    # ------------------------------------------------------------ parameters

    def reset_parameters(self) -> None:
        """Draw the global parameters as ``torch.nn.ConvNd`` does, on every rank; owners keep their blocks.

        Every rank draws the same numbers (so the ranks' generators stay in step, at the
        cost of one global weight in memory for a moment); with the same seed the blocks
        are those of the sequential layer.
        """
        dtype = next((p.dtype for p in (self.weight, self.bias) if p is not None), self._dtype)
        w, b = draw_parameters(self.opts, dtype, self._device)
        with torch.no_grad():
            if self.weight is not None:
                self.weight.copy_(w[local_slices(w.shape, self._P_wr.shape, self._P_wr.index)])
            if self.bias is not None:
                self.bias.copy_(b[local_slices(b.shape, self._P_b1.shape, self._P_b1.index)])

    def param_layouts(self) -> list[ParamLayout]:
        out = [ParamLayout("weight", "weight", self._P_wr, self.opts.weight_shape)]
        if self.opts.bias:
            out.append(ParamLayout("bias", "bias", self._P_b1, (self.opts.out_channels,)))
        return out

    def _weight_on_w(self, dtype, device, needs_grad: bool) -> torch.Tensor | None:
        """This P_w worker's weight block, broadcast from spatial block 0 (None or a placeholder elsewhere)."""
        if self._w_plan.identity:  # unsplit spatial axes: every P_w worker owns its block, nothing moves
            return promote(self.weight, needs_grad) if self.weight is not None else None
        t = promote(self.weight, needs_grad) if self.weight is not None else \
            zero_volume_tensor(dtype=dtype, device=device, requires_grad=needs_grad)
        shape = None
        if self.P_w.active:
            i, j = self.P_w.index[:2]
            shape = local_shape(self.opts.weight_shape, self._P_wr.shape, (i, j) + (0,) * self.nd)
        return broadcast(t, self._w_plan, shape, dtype)

    def _bias_on_w(self, dtype, device, needs_grad: bool) -> torch.Tensor | None:
        """The bias block on P_w workers (i, 0, s); None elsewhere and without bias."""
        if not self.opts.bias:
            return None
        lead = (1,) * (self.P_w.dim - 1)
        if self._b_plan.identity:
            return promote(self.bias, needs_grad) if self.bias is not None else None
        if self.bias is not None:
            t = promote(self.bias, needs_grad).view(-1, *lead)
        else:
            t = zero_volume_tensor(dtype=dtype, device=device, requires_grad=needs_grad)
        shape = None
        if self._P_bd.active:
            shape = (block_extent(self.opts.out_channels, self.P_w.shape[0], self._P_bd.index[0]), *lead)
        out = broadcast(t, self._b_plan, shape, dtype)
        return out.view(-1) if self._P_bd.active else None

    # ------------------------------------------------------------ forward

    def _stage(self, x: torch.Tensor, G) -> torch.Tensor:
        """What P_x broadcasts: the halo-staged block (the channel conv overrides: the raw block)."""
        return self.halo(x, global_shape=G)

    def _broadcast_spatial(self, plan, s) -> tuple[int, ...]:
        return plan.staged_shape(s)

    def _local_input(self, xb: torch.Tensor) -> torch.Tensor:
        return xb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this worker's block on P_x (zero-volume elsewhere); returns its block on P_y (or zero-volume)."""
        op = type(self).__name__
        o, P_x, P_w = self.opts, self.P_x, self.P_w
        if not self.P_union.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]
        if torch.compiler.is_compiling():  # custom ops and the eager-agreed record (_conv_general_compiled.py)
            return self._compiled_forward(x, params)

        def check(info) -> None:  # every worker holds G: these raise on every worker alike
            if info.global_shape[1] != o.in_channels:
                raise expect(op, "input channels (the global input's dimension 1)", o.in_channels,
                             info.global_shape[1])
            check_geometry(op, o, info.global_shape)  # geometry torch refuses

        info = agreed_call_info(self.agreement, op, self.P_union, P_x, x, params,
                                signature=(o, *((P.ranks, P.shape) for P in (P_x, self.P_y, P_w))), check=check)
        G = info.global_shape
        dtype = info.compute_dtype or info.dtype  # what x, the staged blocks and the outputs travel in (autocast)
        needs_any = info.input_grad or info.param_grad
        plan = self.halo.plan(G)
        device = P_x.device
        if P_x.active:
            xs = self._stage(cast_for_compute(promote(x, info.input_grad), dtype), G)
        else:
            xs = zero_volume_tensor(dtype=dtype, device=device, requires_grad=info.input_grad)
        xb_shape = out_shape = None
        if P_w.active:
            i, j, s = P_w.index[0], P_w.index[1], P_w.index[2:]
            ci_j = block_extent(o.in_channels, P_w.shape[1], j)
            xb_shape = (G[0], ci_j) + tuple(self._broadcast_spatial(plan, s))
        # The staged blocks travel, and the partial outputs are summed, in the input's agreed memory format: a
        # channels_last input stays channels_last end to end (P_w- and P_y-only workers learn it from the gather).
        fmt_in = info.memory_format
        fmt_out = conv_output_format(device, dtype, fmt_in, o.nd)
        xb = broadcast(xs, self._x_plan, xb_shape, dtype, memory_format=fmt_in)
        w = cast_for_compute(self._weight_on_w(info.param_dtype or dtype, device, info.param_grad), dtype)
        b = cast_for_compute(self._bias_on_w(info.param_dtype or dtype, device, info.param_grad), dtype)
        if P_w.active:
            co_i = block_extent(o.out_channels, P_w.shape[0], i)
            yp = conv_block(o, self._local_input(xb), w, b, (G[0], co_i) + plan.output_shape(s), fmt_in)
        else:
            yp = xb  # zero-volume; on a P_x worker it carries the adjoint of the broadcast
        if self._P_yv.active:
            i, s = self._P_yv.index[0], self._P_yv.index[2:]
            out_shape = (G[0], block_extent(o.out_channels, P_w.shape[0], i)) + plan.output_shape(s)
        return sum_reduce(promote(yp, needs_any), self._y_plan, out_shape, dtype, memory_format=fmt_out)

    def forget_agreement(self) -> None:
        """Drop the agreed call record, so the next call gathers metadata again (call it on every worker)."""
        self.agreement.forget()

    def extra_repr(self) -> str:
        o = self.opts
        return (f"P_x={list(self.P_x.shape)}, P_y={list(self.P_y.shape)}, P_w={list(self.P_w.shape)}, "
                f"{o.in_channels}, {o.out_channels}, kernel_size={o.kernel_size}, stride={o.stride}, "
                f"padding={o.padding}, dilation={o.dilation}, groups={o.groups}, bias={o.bias}, "
                f"padding_mode={o.padding_mode!r}")


class DistributedGeneralConv1d(DistributedGeneralConvBase):
    """General distributed ``Conv1d``: P_x ``[1, P_ci, P_w]``, P_y ``[1, P_co, P_w]``, P_w ``[P_co, P_ci, P_w]``."""

    nd = 1


class DistributedGeneralConv2d(DistributedGeneralConvBase):
    """General distributed ``Conv2d`` (P_s = ``[P_h, P_w]``)."""

    nd = 2


class DistributedGeneralConv3d(DistributedGeneralConvBase):
    """General distributed ``Conv3d`` (P_s = ``[P_d, P_h, P_w]``)."""

    nd = 3
