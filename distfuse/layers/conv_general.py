"""General distributed convolution: input and output split along channels and spatial axes.

Partitions and shapes (``nd`` spatial axes; ``i`` output-channel block, ``j`` input-channel
block, ``s`` spatial block; the batch is not split).  Every move is an op pair, called in
this order on every worker of the union of the partitions::

    P_x     [1, P_ci, *P_s]       x        [B, Ci_j, *n_s]           on P_x worker (0, j, s)
    P_y     [1, P_co, *P_s]       y        [B, Co_i, *m_s]           on P_y worker (0, i, s)
    P_w     [P_co, P_ci, *P_s]    weight   [Co_i, Ci_j, *k]          stored on P_w workers (i, j, 0)
                                  bias     [Co_i]                    stored on P_w workers (i, 0, 0)

    forward   staged_js = distfuse::halo_exchange(x_js)               exactly the input y_s reads
              xb_ijs    = distfuse::broadcast(staged_js)              P_x -> P_w, along the P_co dimension
              w_ijs     = distfuse::broadcast(w_ij0);  b_i0s likewise from (i, 0, 0)   (spatial 0 -> all s)
              y_ijs     = convNd(xb_ijs, w_ijs, b_i if j == 0, padding=0, stride, dilation)
              y_is      = distfuse::broadcast_adjoint(y_ijs)          P_w -> P_y, summed over j
    adjoint   dy_ijs = Broadcast(dy_is); conv adjoints; dstaged_js = sum over i;
              dx_js = HaloExchange*(dstaged_js); dw_ij0 = sum over s; db_i00 = sum over s

``m_s`` is the balanced decomposition of the global output extent, so every output block
is exactly its slice of the sequential ``ConvNd`` output (the halo geometry is
:class:`~distfuse.geometry.halo_plan.HaloPlan`'s, as for the feature convolution).  The
sum-reduce lands on P_y through a view of P_y's workers as a ``[P_co, 1, *P_s]`` grid, which
lets P_w's row ``i`` reduce into P_y's channel block ``i``.  ``groups > 1`` needs unsplit
channels (``P_co = P_ci = 1``): with split channels a weight block would mix groups.

P_x-only, P_w-only and P_y-only workers (and any overlap) all work: a worker that takes no
part in a move still calls its op (which sends nothing), and the outputs it does not use
are tied to the sum-reduce's anchor (:func:`~distfuse.primitives._op_pair.anchor`), so
their adjoints run too.  No data collective reaches every worker of the union, so the
agreement flag takes a round of its own.  Under ``torch.autocast`` the weight blocks
travel in their own dtype and are cast where they are used.

The channel-distributed convolution, :class:`DistributedChannelConvBase`, is this layer
with ``P_s = 1``: the spatial axes are whole on every worker, so torch's own padding
(``F.pad`` with the layer's mode) is already global; the input travels unpadded (a smaller
broadcast, no halo round) and every P_w worker pads its copy; every worker owns its weight
block, so no weight moves.  Its adjoint's ``dx_j`` is the sum over ``i`` of ``dxb_ij``.
"""

from __future__ import annotations

import itertools

import torch

from distfuse.errors import PartitionError, UnsupportedError, where
from distfuse.geometry.decomposition import block_extent, local_shape
from distfuse.layers._conv_common import (
    ConvLayer,
    ConvOptions,
    call_signature,
    cast_for_compute,
    check_partition,
    conv_block,
    conv_output_format,
    gather_call_info,
    grid_of,
    pad_locally,
    passes_local_checks,
    spatial_classes,
)
from distfuse.partition import union_partition
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._layout import format_code, memory_format_of
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.broadcast import broadcast_plan, move_of, placeholder
from distfuse.primitives.halo_exchange import HaloExchange, halo_exchange
from distfuse.primitives.sum_reduce import sum_reduce_plan

__all__ = ["DistributedGeneralConvBase", "DistributedGeneralConv1d", "DistributedGeneralConv2d",
           "DistributedGeneralConv3d", "DistributedChannelConvBase", "DistributedChannelConv1d",
           "DistributedChannelConv2d", "DistributedChannelConv3d", "GENERAL_CONVS", "CHANNEL_CONVS"]


class DistributedGeneralConvBase(ConvLayer):
    """Convolution with channels and spatial axes split (see the module docstring).

    ``P_x``, ``P_y``, ``P_w``: CartesianPartitions ``[1, P_ci, *P_s]``, ``[1, P_co, *P_s]`` and
    ``[P_co, P_ci, *P_s]`` (P_y and P_w are required, by keyword); the other arguments as
    ``torch.nn.ConvNd`` (``padding`` may also hold ``(lo, hi)`` pairs).
    """

    _grids = ("P_x", "P_y", "P_w")
    last_path = "unfused"  # no fused path for channel-split convolutions
    #: Whether P_x stages its block with a halo exchange before the broadcast (else the channel conv's
    #: ``_pad_locally`` pads each broadcast copy).
    _stages_with_halo = True

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
        self.halo = HaloExchange(P_x, o.kernel_size, o.stride, o.padding, o.dilation, o.padding_mode, _op=op)
        self._build_grids()
        self._agree_over(self.P_union)
        self._init_params(device, dtype)

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
        """Sub-grids of P_w that own (``P_weight``, ``P_bias``) or receive parameters, and P_y seen as a
        [P_co, 1, *P_s] grid."""
        P_w, nd, dev = self.P_w, self.nd, self.P_x.device
        P_co, P_ci, P_s = P_w.shape[0], P_w.shape[1], P_w.shape[2:]
        at = lambda i, j, s: P_w.ranks[P_w.rank_of((i, j, *s))]
        s0 = self._s0 = (0,) * nd
        spatial = list(itertools.product(*(range(p) for p in P_s)))
        weight_owners = [at(i, j, s0) for i in range(P_co) for j in range(P_ci)]
        self.P_weight = grid_of(weight_owners, [P_co, P_ci] + [1] * nd, dev)
        bias_owners = [at(i, 0, s0) for i in range(P_co)]
        self._P_b = grid_of(bias_owners, [P_co, 1] + [1] * nd, dev)
        self.P_bias = grid_of(bias_owners, [P_co], dev)
        self._P_bd = grid_of([at(i, 0, s) for i in range(P_co) for s in spatial], [P_co, 1, *P_s], dev)
        self._P_yv = grid_of(self.P_y.ranks, [P_co, 1, *P_s], dev)
        self.P_union = union_partition(self.P_x, self.P_w, self.P_y)
        self._x_plan = broadcast_plan(self.P_x, P_w)
        self._w_plan = broadcast_plan(self.P_weight, P_w)
        self._b_plan = broadcast_plan(self._P_b, self._P_bd)
        self._y_plan = sum_reduce_plan(P_w, self._P_yv)

    # ------------------------------------------------------------ parameters

    def _move_param(self, plan, t: torch.Tensor | None, shape: list[int] | None, like: torch.Tensor, dtype,
                    needs_grad: bool, ties: list) -> torch.Tensor | None:
        """``t`` (None: a placeholder) moved by ``plan`` (``t`` itself where the plan moves nothing: unsplit spatial
        axes); ``shape`` is the block this worker receives (None: none, the move's output is tied to the sum-reduce
        and None returned)."""
        if plan.identity:
            return t
        t = t if t is not None else placeholder(like, dtype, self.P_x.device)
        out = move_of(plan).copy(t, shape or [0], anchor=anchor(needs_grad))
        if shape is None:
            ties.append(out)
            return None
        return out

    def _weight_on_w(self, like: torch.Tensor, dtype, needs_grad: bool, ties: list) -> torch.Tensor | None:
        """This P_w worker's weight block, broadcast from spatial block 0 (None off P_w)."""
        shape = None
        if self.P_w.active:
            shape = list(local_shape(self.opts.weight_shape, self.P_weight.shape, (*self.P_w.index[:2], *self._s0)))
        return self._move_param(self._w_plan, self.weight, shape, like, dtype, needs_grad, ties)

    def _bias_on_w(self, like: torch.Tensor, dtype, needs_grad: bool, ties: list) -> torch.Tensor | None:
        """The bias block on P_w workers (i, 0, s); None elsewhere and without bias."""
        if not self.opts.bias:
            return None
        lead = (1,) * (self.P_w.dim - 1)
        shape = None
        if self._P_bd.active:
            shape = [block_extent(self.opts.out_channels, self.P_w.shape[0], self._P_bd.index[0]), *lead]
        t = self.bias.view(-1, *lead) if self.bias is not None else None
        b = self._move_param(self._b_plan, t, shape, like, dtype, needs_grad, ties)
        return None if b is None else b.view(-1)

    # ------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this worker's block on P_x (zero-volume elsewhere); returns its block on P_y (or zero-volume)."""
        op = type(self).__name__
        o, P_x, P_w = self.opts, self.P_x, self.P_w
        if not self.P_union.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]
        info = self.session.agree(x, call_signature(x, params), passes_local_checks(P_x, x), lambda: self._checked(
            gather_call_info(op, self.P_union, P_x, x, params, signature=self._identity())),
            deferrable=set(self.P_union.ranks) <= set(P_x.ranks))  # (a P_w/P_y-only worker's empty input repeats)
        if info is None:  # a replayed call that flagged: flag_check raises on every worker
            return x.clone()
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed block
            x = self.session.stand_in(x).contiguous(memory_format=info.memory_format)
        G = info.global_shape
        dtype = info.compute_dtype or info.dtype  # what x, the staged blocks and the outputs travel in (autocast)
        plan = self.halo.plan(G)
        device = P_x.device
        # blocks travel and partial outputs are summed in the input's agreed format (the gather's: _conv_common)
        fmt_in = info.memory_format
        fmt_out = conv_output_format(device, dtype, fmt_in, o.nd)

        # the input: staged on P_x, broadcast to the weight workers (every worker calls the ops)
        x_anchor = anchor(info.input_grad)
        xs = cast_for_compute(x, dtype) if P_x.active else placeholder(x, dtype, device)
        if self._stages_with_halo:
            xs = halo_exchange(xs, self.halo.handle, list(G), x_anchor)
        xb_shape = [0]
        if P_w.active:
            i, j, s = P_w.index[0], P_w.index[1], P_w.index[2:]
            spatial = plan.staged_shape(s) if self._stages_with_halo else plan.input_shape(s)
            xb_shape = [G[0], block_extent(o.in_channels, P_w.shape[1], j), *spatial]
        xb = xs if self._x_plan.identity else move_of(self._x_plan).copy(xs, xb_shape, format_code(fmt_in), x_anchor)

        # the parameters where the layer moves them, in their own dtype, cast where they are used
        ties: list = []  # moves this worker takes no part in: their outputs, tied to the sum-reduce
        param_dtype = info.param_dtype or dtype
        w = cast_for_compute(self._weight_on_w(x, param_dtype, info.param_grad, ties), dtype)
        b = cast_for_compute(self._bias_on_w(x, param_dtype, info.param_grad, ties), dtype)
        if P_w.active:
            co_i = block_extent(o.out_channels, P_w.shape[0], i)
            xp = xb if self._stages_with_halo else self._pad_locally(xb)
            yp = conv_block(o, xp, w, b, (G[0], co_i) + plan.output_shape(s), fmt_in)
        else:
            yp = xb  # zero-volume; on a P_x worker it carries the adjoint of the broadcast
        out_shape = [G[0], 0]  # eager's zero-volume [batch, 0] off P_y
        if self._P_yv.active:
            i_y, s_y = self._P_yv.index[0], self._P_yv.index[2:]
            out_shape = [G[0], block_extent(o.out_channels, P_w.shape[0], i_y), *plan.output_shape(s_y)]
        return move_of(self._y_plan).sum(yp, out_shape, format_code(fmt_out), anchor(info.input_grad or info.param_grad,
                                                                                       ties))


GENERAL_CONVS = spatial_classes(DistributedGeneralConvBase, "DistributedGeneralConv",
                                "General distributed ``Conv{nd}d``: P_x ``[1, P_ci, {s}]``, P_y ``[1, P_co, {s}]``, "
                                "P_w ``[P_co, P_ci, {s}]``.")
DistributedGeneralConv1d, DistributedGeneralConv2d, DistributedGeneralConv3d = GENERAL_CONVS


class DistributedChannelConvBase(DistributedGeneralConvBase):
    """Convolution with channels split and spatial axes whole (see the module docstring): the arguments of
    :class:`DistributedGeneralConvBase`, with P_x ``[1, P_ci, 1, ...]``, P_y ``[1, P_co, 1, ...]``, P_w
    ``[P_co, P_ci, 1, ...]``."""

    _stages_with_halo = False  # the input travels unpadded; every P_w worker pads its copy

    def _check_partitions(self, op, P_x, P_y, P_w) -> None:
        for name, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
            if any(p != 1 for p in P.shape[2:]):
                raise PartitionError(f"{where(op)}: the channel-distributed convolution needs unsplit spatial axes, "
                                     f"but {name} is {list(P.shape)}; use the general distributed convolution")
        super()._check_partitions(op, P_x, P_y, P_w)

    def _pad_locally(self, xb: torch.Tensor) -> torch.Tensor:
        padded = pad_locally(self.opts, xb)
        fmt = memory_format_of(xb)
        if fmt != torch.contiguous_format:
            # F.pad keeps channels_last except in circular mode (torch 2.13), which already copies: restore it.
            padded = padded.contiguous(memory_format=fmt)
        return padded


CHANNEL_CONVS = spatial_classes(DistributedChannelConvBase, "DistributedChannelConv",
                                "Channel-distributed ``Conv{nd}d``: P_x ``[1, P_ci, {ones}]``, "
                                "P_y ``[1, P_co, {ones}]``, P_w ``[P_co, P_ci, {ones}]``.")
DistributedChannelConv1d, DistributedChannelConv2d, DistributedChannelConv3d = CHANNEL_CONVS
