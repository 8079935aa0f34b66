"""HaloExchange: stage a spatially partitioned convolution's input, halos and boundary padding included.

Shapes (feature-distributed convolution, ``nd`` spatial axes last)::

    x       [*lead, n_1, ..., n_nd]      this worker's block (balanced decomposition)
    staged  [*lead, L_1, ..., L_nd]      exactly the input its output block reads, with
                                         the neighbours' halos and the boundary padding

so ``conv(staged, w, padding=0, stride, dilation)`` is this worker's block of the
sequential ``ConvNd(padding, padding_mode)`` output.  The geometry (``geometry/halo_plan.py``)
accounts for stride, dilation, even kernels, uneven splits, halos wider than a
neighbour's block and all four padding modes with global semantics; all neighbours,
corners included, are exchanged in one round of point-to-point messages.

Unlike DistDL, which pads the local tensor and then overwrites the halo slabs in
place (``F.pad`` + clone + slice), the output is written once, box by box, straight
from the local block and the receive buffers.  The fused path in
``distfuse/fused/halo_conv.py`` does the same in one Triton launch.

Adjoint: every staged box's gradient goes back to where the box was read from; a
reversed box is flipped back and a replicated one is summed, then gradients from
other workers arrive in one round and are added into the block.

Leading (batch, channel) partition dimensions may be larger than 1: workers with
different leading indices are independent and never exchange.

Memory format: the block is read through views, whatever its strides, so it is never
copied before staging; ``staged`` (and the adjoint's block gradient) is allocated in the
block's format (``channels_last`` in, ``channels_last`` out, as torch's convolutions keep
it).  The halo boxes travel as plain contiguous messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from distfuse import debug
from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import PADDING_MODES, HaloPlan, adjoint_box, read_box, resolve_padding
from distfuse.partition import CartesianPartition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._common import check_inactive_input, exchange, infer_global_shape
from distfuse.primitives._handles import new_handle
from distfuse.primitives._layout import empty_in, memory_format_of, zeros_in

__all__ = ["HaloExchange", "HaloExchangeFunction", "HaloExchangeAdjointFunction", "stage_from_pieces",
           "unstage_to_pieces", "halo_forward", "halo_adjoint"]


def _as_tuple(v, nd: int, name: str, op: str = "HaloExchange") -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) else tuple(int(e) for e in v)
    if len(t) != nd or any(e < 1 for e in t):
        raise expect(op, f"{name} (a positive int or {nd} positive ints, one per spatial axis)", f"{nd} entries >= 1",
                     repr(v), cls=UnsupportedError)
    return t


def stage_from_pieces(x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...],
                      received: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write the staged input once, box by box (torch reference of the fused stage kernel).

    ``received[k]`` is the source box of ``plan.recvs(index)[k]``.
    """
    nd = len(plan.axes)
    lead = tuple(x.shape[: x.dim() - nd])
    staged = empty_in(lead + plan.staged_shape(index), memory_format_of(x), dtype=x.dtype, device=x.device)
    it = iter(received)
    for pc in plan.pieces(index):
        dst = (..., *pc.dst_slices())
        if pc.src is None:
            staged[dst] = 0
        elif pc.src == index:
            staged[dst] = read_box(x[(..., *pc.src_slices())], pc)
        else:
            staged[dst] = read_box(next(it), pc)
    return staged


def unstage_to_pieces(grad: torch.Tensor, x_shape: Sequence[int], plan: HaloPlan,
                      index: tuple[int, ...], x_format=torch.contiguous_format
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Split a staged gradient: the block's own contributions (accumulated, in ``x_format``) and the boxes to
    send back (contiguous messages)."""
    accum = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    grad_x = zeros_in(tuple(x_shape), x_format, dtype=accum, device=grad.device)
    outgoing = []
    for pc in plan.pieces(index):
        if pc.src is None:
            continue
        g = adjoint_box(grad[(..., *pc.dst_slices())], pc)
        if pc.src == index:
            grad_x[(..., *pc.src_slices())] += g
        else:
            outgoing.append(g.contiguous())
    return grad_x, outgoing


def halo_forward(x: torch.Tensor, plan: HaloPlan, index, world_of, op: str = "HaloExchange") -> torch.Tensor:
    """The exchange without autograd: send the boxes peers read, receive ours, stage (in ``x``'s format).

    Shared by :class:`HaloExchangeFunction` and the ``distfuse::halo_exchange`` custom op
    (``distfuse/ops``), so eager and compiled code send the same messages.
    """
    nd = len(plan.axes)
    lead = tuple(x.shape[: x.dim() - nd])
    recv = [x.new_empty(lead + pc.src_shape) for pc in plan.recvs(index)]
    sends = [(world_of(r), x[(..., *pc.src_slices())].contiguous()) for r, pc in plan.sends(index)]
    exchange(sends, [(world_of(pc.src), buf) for pc, buf in zip(plan.recvs(index), recv, strict=True)], op=op)
    return stage_from_pieces(x, plan, index, recv)


def halo_adjoint(grad: torch.Tensor, plan: HaloPlan, index, world_of, x_shape, op: str = "HaloExchange",
                 x_format=torch.contiguous_format) -> torch.Tensor:
    """The adjoint without autograd: staged gradient -> block gradient ``[x_shape]`` in ``x_format``."""
    grad_x, outgoing = unstage_to_pieces(grad, x_shape, plan, index, x_format)
    nd = len(plan.axes)
    lead = tuple(x_shape[: len(x_shape) - nd])
    incoming = [grad.new_empty(lead + pc.src_shape) for _, pc in plan.sends(index)]
    exchange([(world_of(pc.src), g) for pc, g in zip(plan.recvs(index), outgoing, strict=True)],
             [(world_of(r), buf) for (r, _), buf in zip(plan.sends(index), incoming, strict=True)],
             op=f"{op} (adjoint)")
    for (_, pc), buf in zip(plan.sends(index), incoming, strict=True):
        grad_x[(..., *pc.src_slices())] += buf
    return grad_x.to(grad.dtype)


class HaloExchangeFunction(torch.autograd.Function):
    """Autograd Function of the exchange; ``world_of`` maps a spatial block index to a world rank.

    The backward is :class:`HaloExchangeAdjointFunction`, whose backward is this Function
    again, so gradients of any order (a gradient penalty through a convolution) are exact.
    """

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, index, world_of, op: str = "HaloExchange"):
        ctx.plan, ctx.index, ctx.world_of, ctx.x_shape, ctx.op = plan, index, world_of, tuple(x.shape), op
        ctx.x_format = memory_format_of(x)
        return halo_forward(x, plan, index, world_of, op)

    @staticmethod
    def backward(ctx, grad):
        return HaloExchangeAdjointFunction.apply(grad, ctx.plan, ctx.index, ctx.world_of, ctx.x_shape, ctx.op,
                                                 ctx.x_format), None, None, None, None


class HaloExchangeAdjointFunction(torch.autograd.Function):
    """The adjoint of the exchange: staged gradients go back to the blocks they were read from.

    ``grad`` has the staged shape, the result the block's (``x_shape``); the block's own
    boxes are accumulated (fp32 for 16-bit), then the boxes of other workers arrive in one
    round and are added.  The result is in ``x_format`` (the forward block's).  Its backward
    is :class:`HaloExchangeFunction`.
    """

    @staticmethod
    def forward(ctx, grad, plan: HaloPlan, index, world_of, x_shape, op: str = "HaloExchange",
                x_format=torch.contiguous_format):
        ctx.plan, ctx.index, ctx.world_of, ctx.op = plan, index, world_of, op
        return halo_adjoint(grad, plan, index, world_of, x_shape, op, x_format)

    @staticmethod
    def backward(ctx, ggrad_x):
        return HaloExchangeFunction.apply(ggrad_x, ctx.plan, ctx.index, ctx.world_of, ctx.op), \
            None, None, None, None, None, None


class HaloExchange(nn.Module):
    """Stage the input of a convolution over a spatially partitioned tensor.

    Args:
        P_x: the CartesianPartition of the input; its last ``len(kernel_size)``
            dimensions are the spatial ones.
        kernel_size, stride, dilation: per spatial axis (int or tuple), as torch.
        padding: int, tuple (of ints or ``(lo, hi)`` pairs), ``'same'`` or ``'valid'``.
        padding_mode: ``'zeros'``, ``'reflect'``, ``'replicate'`` or ``'circular'``,
            applied with global semantics (only at the global boundary; circular wraps
            across the whole domain).

    ``forward(x, global_shape=None)`` returns the staged input.  Without
    ``global_shape`` the workers' local shapes are gathered on the host (one small
    gloo all-gather, no device sync) to find it and to check that the blocks are the
    balanced decomposition, on the first call and when some worker's block shape, dtype
    or device changed; while they repeat, a one-element flag all-reduce on P_x's host
    group replaces the gather (the agreement protocol,
    :func:`~distfuse.primitives._agreement.agreed_by_flag_round`: the halo messages run
    between neighbours only, and a plan without halos sends none, so no data message
    reaches every worker; ``agreement`` counts the calls and the gathers).  With
    ``global_shape`` given nothing is agreed and the checks are local.  Plans are cached
    per global shape.
    Construction is not collective.  Errors name the op and the rank (``_op``: the
    layer that owns this exchange, when there is one).
    """

    def __init__(self, P_x: CartesianPartition, kernel_size, stride=1, padding=0, dilation=1,
                 padding_mode: str = "zeros", _op: str = "HaloExchange"):
        super().__init__()
        self._op = op = _op
        nd = len(kernel_size) if not isinstance(kernel_size, int) else 1
        if nd > P_x.dim:
            raise expect(op, "number of spatial axes (len(kernel_size); at most the partition's dimensions)",
                         f"<= {P_x.dim}", nd, cls=UnsupportedError)
        if padding_mode not in PADDING_MODES:
            raise UnsupportedError(f"{where(op)}: padding_mode must be one of {PADDING_MODES}, "
                                   f"got {padding_mode!r}")
        self.P_x = P_x
        self.nd = nd
        self.kernel_size = _as_tuple(kernel_size, nd, "kernel_size", op)
        self.stride = _as_tuple(stride, nd, "stride", op)
        self.dilation = _as_tuple(dilation, nd, "dilation", op)
        try:
            self.padding = resolve_padding(padding, self.kernel_size, self.dilation, self.stride)
        except UnsupportedError as exc:
            raise UnsupportedError(f"{where(op)}: {exc}") from None
        self.padding_mode = padding_mode
        self._plans: dict[tuple[int, ...], HaloPlan] = {}
        self.handle = new_handle(self)  # names this exchange in compiled graphs (distfuse::halo_exchange)
        self.agreement = AgreementSite(op)

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        spatial = tuple(int(n) for n in global_shape[-self.nd:])
        if spatial not in self._plans:
            try:
                self._plans[spatial] = HaloPlan.for_conv(spatial, self.P_x.shape[-self.nd:], self.kernel_size,
                                                         self.stride, self.dilation, self.padding, self.padding_mode)
            except UnsupportedError as exc:  # e.g. reflect padding wider than the global extent
                raise UnsupportedError(f"{where(self._op)}: global spatial shape {spatial}: {exc}") from None
        return self._plans[spatial]

    def _check_block(self, x: torch.Tensor, global_shape: Sequence[int]) -> None:
        """The local checks of a call with ``global_shape`` given: dimensions, device, this worker's block."""
        op = self._op
        if x.dim() != self.P_x.dim:
            raise expect(op, "number of tensor dimensions", self.P_x.dim, x.dim())
        if x.device.type != self.P_x.device.type:
            raise expect(op, "device type", self.P_x.device.type, x.device.type)
        want = self.plan(global_shape).input_shape(self.P_x.index[self.P_x.dim - self.nd:])
        if tuple(x.shape[-self.nd:]) != want:
            raise ShapeError(f"{where(op)}: local spatial shape {tuple(x.shape[-self.nd:])} is not this "
                             f"worker's block {want} of the global shape {tuple(global_shape)}")

    def world_of_fn(self):
        lead_index = self.P_x.index[: self.P_x.dim - self.nd]
        ranks, rank_of = self.P_x.ranks, self.P_x.rank_of
        return lambda spatial_index: ranks[rank_of(lead_index + tuple(spatial_index))]

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None, agree: bool = False) -> torch.Tensor:
        """The staged input; ``global_shape`` skips the agreement (local checks; see the class docstring).

        ``agree=True`` (with ``global_shape``) makes a failure of the local checks an error
        on every worker of P_x rather than on the failing one alone (its neighbours would
        wait in the exchange until the timeout): one one-element host all-reduce per call.
        """
        op = self._op
        if not self.P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        if global_shape is None:
            ok = x.dim() == self.P_x.dim and x.device.type == self.P_x.device.type

            def slow():  # every worker holds G: a plan the geometry refuses is refused on every worker
                G = infer_global_shape(op, self.P_x, x)
                self.plan(G)
                return G

            global_shape = agreed_by_flag_round(self.agreement, self.P_x, op, (tuple(x.shape), x.dtype, x.device.type),
                                                ok, slow)
        elif agree:
            agree_on_local_checks(self.P_x, op, lambda: self._check_block(x, global_shape))
        else:
            self._check_block(x, global_shape)
        plan = self.plan(global_shape)
        index = self.P_x.index[self.P_x.dim - self.nd:]
        debug.check_agreement(op, self.P_x.ranks, self.P_x.meta_group,
                              same=dict(dtype=str(x.dtype), ndim=x.dim(), spatial=tuple(global_shape[-self.nd:])),
                              info=dict(shape=tuple(x.shape)))
        # No x.contiguous(): the block is read through views, so a channels_last block is not copied to NCHW.
        return HaloExchangeFunction.apply(x, plan, index, self.world_of_fn())
