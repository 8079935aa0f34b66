"""HaloExchange: stage a spatially partitioned convolution's input, halos and boundary padding included.

Shapes (feature-distributed convolution, ``nd`` spatial axes last)::

    x       [*lead, n_1, ..., n_nd]      this worker's block (balanced decomposition)
    staged  [*lead, L_1, ..., L_nd]      exactly the input its output block reads, with
                                         the neighbours' halos and the boundary padding

so ``conv(staged, w, padding=0, stride, dilation)`` is this worker's block of the
sequential ``ConvNd(padding, padding_mode)`` output.  The geometry is
:class:`~distfuse.geometry.halo_plan.HaloPlan`'s; all neighbours, corners included, are
exchanged in one round of point-to-point messages.  Unlike DistDL (``F.pad`` + clone +
overwrite the halo slabs), the output is concatenated from the block's views and the
receive buffers: the boxes tile it as a grid, so a few ``torch.cat`` calls build it
(:func:`stage_from_pieces`; ``distfuse/fused/halo_conv.py`` does it in one Triton launch).
A small block (:data:`~distfuse.primitives._halo_gathering.GATHERED_STAGING_BYTES`) receives
its boxes end to end in one buffer and is staged by one indexed gather, its adjoint by one
indexed add (:mod:`~distfuse.primitives._halo_gathering`): 2 aten calls each way where the
views take 20 to 60, the host time of a small step.
Workers with different leading (batch, channel) partition indices never exchange.

Adjoint: every staged box's gradient goes back to where the box was read from (a
reversed box flipped back, a replicated one summed); other workers' arrive in one round
and are added into the block.  Small messages are packed by one indexed gather and added
back by one indexed add, in box order (:mod:`~distfuse.primitives._halo_packing`): the same
terms in the same order as a copy and an add per box, a few aten calls where those take two
per box.

Memory format: the block is read through views, whatever its strides; ``staged`` (and the
adjoint's block gradient) is allocated in the block's format (``channels_last`` in,
``channels_last`` out); the halo boxes travel as plain contiguous messages.

One op pair (:mod:`distfuse.primitives._op_pair`), each op the other's backward::

    distfuse::halo_exchange(x [*lead, *n_s], handle, global_shape)                 -> staged [*lead, *L_s]
    distfuse::halo_exchange_adjoint(g [*lead, *L_s], handle, G, x_shape, x_format) -> dx [x_shape]

``handle`` names a :class:`HaloExchange` or a :class:`PlanHalo` (a layer's own plan);
``global_shape`` picks the plan; ``x_format`` is the block's memory format (0 contiguous,
1 channels_last, 2 channels_last_3d).  The module, the pooling, upsampling and convolution
layers call it in every mode; a worker outside the context's partition too (a general
convolution's weight- and output-only workers, so that every worker's graph holds the
same ops): it gets a copy of its placeholder and sends nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from distfuse import debug
from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.geometry.halo_plan import PADDING_MODES, HaloPlan, adjoint_box, read_box, resolve_padding
from distfuse.partition import CartesianPartition
from distfuse.primitives import _halo_gathering as gathering
from distfuse.primitives import _halo_packing as packing
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._common import check_inactive_input, exchange, infer_global_shape
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._layout import copy_in, empty_in, format_code, format_of_code, memory_format_of, zeros_in
from distfuse.primitives._op_pair import op_pair

__all__ = ["HaloExchange", "stage_from_pieces", "unstage_to_pieces", "receive_buffers", "stage_received",
           "unstage_for_exchange", "halo_exchange", "halo_exchange_adjoint",
           "world_of_fn", "halo_geometry", "PlanHalo", "NESTED_STAGING_BYTES"]


def _as_tuple(v, nd: int, name: str, op: str = "HaloExchange") -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) else tuple(int(e) for e in v)
    if len(t) != nd or any(e < 1 for e in t):
        raise expect(op, f"{name} (a positive int or {nd} positive ints, one per spatial axis)", f"{nd} entries >= 1",
                     repr(v), cls=UnsupportedError)
    return t


#: Staged tensors of at most this many bytes (per device type; others as ``"cpu"``) are built by nested
#: concatenations: one ``torch.cat`` per run of pieces on each axis (4 calls for a 2-D interior worker's 9 pieces,
#: 13 for 3-D's 27) at the price of ``nd - 1`` extra passes over the bytes (each level of the nest writes them once,
#: and a channels-last block's result one more, into its format).  Larger ones are written box by box into the
#: staged tensor: one pass, ``nd + 1`` calls a box.  On a GPU an extra pass over 8 MiB (read and write at ~3 TB/s)
#: costs ~5 us, about the host time of the calls it saves, and only host-bound steps see those; on a CPU the same
#: thread pays both, so the bound is ~64 KiB.
NESTED_STAGING_BYTES = {"cuda": 8 << 20, "cpu": 64 << 10}


def _nested(shape: tuple[int, ...], x: torch.Tensor) -> bool:
    """Whether a staged tensor of ``shape`` and ``x``'s dtype and device takes the nested concatenations."""
    bound = NESTED_STAGING_BYTES.get(x.device.type, NESTED_STAGING_BYTES["cpu"])
    return math.prod(shape) * x.element_size() <= bound


def stage_from_pieces(x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...],
                      received: Sequence[torch.Tensor]) -> torch.Tensor:
    """The staged input ``[*lead, *plan.staged_shape(index)]``, a new tensor in ``x``'s memory format, put together
    from the pieces (torch reference of the fused stage kernel): the block's own boxes are read through views of
    ``x``, ``received[k]`` is the source box of ``plan.recvs(index)[k]``, zero fill is zeros.

    The pieces tile the staged tensor as a grid (:class:`~distfuse.geometry.halo_plan.Assembly`), so a small one is
    a nest of ``torch.cat``: a few calls per staging where a copy per box takes ``nd + 1`` (the path's host time at
    small volumes).  Zero fill stays a shape until a concatenation needs it, so a run of it (a boundary worker's
    outer band) is one ``zeros``.  Large tensors are written box by box, in one pass (:data:`NESTED_STAGING_BYTES`).
    No concatenation writes into a given output: ``torch.cat(out=)`` into a strided tensor is not a contract every
    backend keeps."""
    nd = len(plan.axes)
    lead = tuple(x.shape[: x.dim() - nd])
    shape, fmt = lead + plan.staged_shape(index), memory_format_of(x)
    pieces = plan.pieces(index)
    if not pieces or not math.prod(shape):
        return empty_in(shape, fmt, dtype=x.dtype, device=x.device)
    it = iter(received)
    # a piece's tensor, or its spatial shape where it is zero fill
    boxes = [pc.shape if pc.src is None else read_box(x[pc.src_index] if pc.src == index else next(it), pc)
             for pc in pieces]
    if len(pieces) == 1 or not _nested(shape, x):  # one piece: the staging's one copy, into the block's format
        staged = empty_in(shape, fmt, dtype=x.dtype, device=x.device)
        for pc, box in zip(pieces, boxes, strict=True):
            staged[pc.dst_index] = 0 if pc.src is None else box
        return staged
    layout = plan.assembly(index)
    cat = _concatenated if layout.zero_fill else _cat
    for a in range(nd - 1, -1, -1):  # innermost first: each run of the axis's segments becomes one part
        run = len(layout.lengths[a])
        if run > 1:
            boxes = [cat(boxes[i:i + run], a, nd, x) for i in range(0, len(boxes), run)]
    (staged,) = boxes
    if type(staged) is tuple:  # all zero fill
        return zeros_in(shape, fmt, dtype=x.dtype, device=x.device)
    # a concatenation's output, new; channels last where every input was, else copied into the block's format
    return staged if staged.is_contiguous(memory_format=fmt) else staged.clone(memory_format=fmt)


def _cat(parts: list, axis: int, nd: int, x: torch.Tensor) -> torch.Tensor:
    """``torch.cat`` of ``parts`` (tensors) along spatial ``axis``: no zero fill."""
    return torch.cat(parts, axis - nd)


def _concatenated(parts: list, axis: int, nd: int, x: torch.Tensor):
    """``parts`` (tensors, or spatial shapes standing for zero fill) concatenated along spatial ``axis``: a shape
    again where all are zero fill, else a tensor."""
    if all(type(p) is tuple for p in parts):
        return tuple(sum(p[a] for p in parts) if a == axis else parts[0][a] for a in range(nd))
    lead = tuple(x.shape[: x.dim() - nd])
    return torch.cat([x.new_zeros(lead + p) if type(p) is tuple else p for p in parts], axis - nd)


def unstage_to_pieces(grad: torch.Tensor, x_shape: Sequence[int], plan: HaloPlan,
                      index: tuple[int, ...], x_format=torch.contiguous_format, flat_messages: bool = False
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Split a staged gradient (the adjoint of :func:`stage_from_pieces` on this worker): the block's own
    contributions, summed in ``x_format`` (in fp32 for 16-bit data), and the boxes to send back, contiguous
    messages in ``plan.recvs(index)`` order, ``[*lead, *src_shape]`` each.  ``flat_messages`` (the exchange's
    adjoint, which moves elements, not shapes): small messages may come as flat views of one buffer, packed by
    one gather in the same element order (:mod:`~distfuse.primitives._halo_packing`).

    The gradient is split into one view per piece along the assembly's runs (``nd`` levels of ``split``); the
    block's gradient starts as a copy of the interior piece's where it covers the block, else as zeros."""
    accum = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    pieces, layout = plan.pieces(index), plan.assembly(index)
    if not pieces:  # the worker reads nothing: no gradient comes back, none goes out
        return zeros_in(tuple(x_shape), x_format, dtype=accum, device=grad.device), []
    lead = tuple(grad.shape[: grad.dim() - len(plan.axes)])
    sizes = packing.message_numels(plan, index, math.prod(lead))[1]
    packed = None
    if flat_messages and packing.packs(sum(sizes), grad):  # the messages by one gather
        at = packing.outgoing_index(plan, index, tuple(grad.shape), grad.device)
        packed = None if at is None else torch.take(grad, at).split(sizes)
    nd, views = len(plan.axes), [grad]
    for a, lengths in enumerate(layout.lengths):
        if len(lengths) > 1:
            views = [v for t in views for v in t.split(lengths, a - nd)]
    cover = layout.cover
    grad_x = (copy_in(views[cover], x_format, dtype=accum) if cover is not None
              else zeros_in(tuple(x_shape), x_format, dtype=accum, device=grad.device))
    outgoing = []
    for k, (pc, g) in enumerate(zip(pieces, views, strict=True)):
        if pc.src is None or k == cover or (packed is not None and pc.src != index):
            continue
        g = adjoint_box(g, pc)
        if pc.src == index:
            grad_x[pc.src_index].add_(g)
        else:
            outgoing.append(g.contiguous())
    return grad_x, outgoing if packed is None else list(packed)


def world_of_fn(P_x: CartesianPartition, nd: int):
    """Map a spatial block index (the last ``nd`` axes of ``P_x``) to the world rank holding it (same leading index)."""
    lead = tuple(P_x.index[: P_x.dim - nd])
    ranks, rank_of = P_x.ranks, P_x.rank_of
    return lambda spatial: ranks[rank_of(lead + tuple(spatial))]


class PlanHalo(HandleOwner):
    """The context behind the halo op pair's handle for a layer with a plan of its own (pooling, upsampling,
    the transposed convolution): it answers what the ops ask of a :class:`HaloExchange` (``P_x``, ``nd``,
    ``plan(global_shape)``, ``world_of_fn()``, ``_op``), so both stage through the same ops."""

    def __init__(self, P_x: CartesianPartition, nd: int, plan_of, op: str):
        self.P_x, self.nd, self._plan_of, self._op = P_x, nd, plan_of, op
        self.handle = new_handle(self)

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        return self._plan_of(tuple(int(n) for n in global_shape))

    def world_of_fn(self):
        return world_of_fn(self.P_x, self.nd)


def halo_geometry(handle: int, global_shape) -> tuple:
    """``(context, plan, spatial index)`` of a halo op call: the object behind ``handle``, its plan for
    ``global_shape`` and this worker's block index on the plan's axes (plan and index None off its partition)."""
    halo = lookup(handle)
    if not halo.P_x.active:
        return halo, None, None
    return halo, halo.plan(tuple(global_shape)), halo.P_x.index[halo.P_x.dim - halo.nd:]


def _exchange(x: torch.Tensor, handle: int, global_shape: list[int],
              anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Stage ``x`` (this worker's block) with its halos and the boundary padding; one exchange round."""
    halo, plan, index = halo_geometry(handle, global_shape)
    if plan is None:
        return x.clone()
    world_of, lead = halo.world_of_fn(), tuple(x.shape[: x.dim() - len(plan.axes)])
    sizes = packing.message_numels(plan, index, math.prod(lead))[0]
    if packing.packs(sum(sizes), x):  # one gather, split (distfuse.primitives._halo_packing)
        messages = torch.take(x, packing.send_index(plan, index, tuple(x.shape), x.device)).split(sizes)
    else:
        messages = [x[pc.src_index].contiguous() for _, pc in plan.sends(index)]
    flat, recv = receive_buffers(x, plan, index)
    exchange([(world_of(r), m) for (r, _), m in zip(plan.sends(index), messages, strict=True)],
             [(world_of(pc.src), buf) for pc, buf in zip(plan.recvs(index), recv, strict=True)], op=halo._op)
    return stage_received(x, plan, index, flat, recv)


def receive_buffers(x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...]
                    ) -> tuple[torch.Tensor | None, Sequence[torch.Tensor]]:
    """``(flat, boxes)``: where the staging is one gather (a small block, dense in its format:
    :mod:`~distfuse.primitives._halo_gathering`), one buffer for every received box (``flat``) and the boxes as
    its flat views; else None and one buffer a box, ``[*lead, *src_shape]`` (views of one buffer would cost more
    host time than the allocations, a view a box).  ``plan.recvs(index)`` order."""
    lead = tuple(x.shape[: x.dim() - len(plan.axes)])
    if (gathering.gathers(math.prod(lead + plan.staged_shape(index)), x)
            and x.is_contiguous(memory_format=memory_format_of(x))):
        sizes = packing.message_numels(plan, index, math.prod(lead))[1]
        flat = x.new_empty(sum(sizes))
        return flat, flat.split_with_sizes(sizes)
    return None, [x.new_empty(lead + pc.src_shape) for pc in plan.recvs(index)]


def stage_received(x: torch.Tensor, plan: HaloPlan, index: tuple[int, ...], flat: torch.Tensor | None,
                   boxes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The staged input from the block and what :func:`receive_buffers` gave, once the boxes came: one gather from
    ``flat`` where it is given, else :func:`stage_from_pieces` of ``boxes``."""
    if flat is not None:
        return gathering.stage_gathered(x, plan, index, memory_format_of(x), flat)
    return stage_from_pieces(x, plan, index, boxes)


def unstage_for_exchange(grad: torch.Tensor, x_shape: tuple[int, ...], plan: HaloPlan, index: tuple[int, ...],
                         fmt: torch.memory_format) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """The adjoint's local half before its exchange: ``(grad_x, outgoing)``, the block's own gradient (fp32 for
    16-bit data, dense in ``fmt``) and the messages to send back (``plan.recvs(index)`` order, each the flat or
    shaped box its owner expects): one indexed add where the staging was one gather, else
    :func:`unstage_to_pieces` (small messages packed by one gather)."""
    if gathering.gathers(grad.numel(), grad):
        grad_x, flat = gathering.unstage_gathered(grad, x_shape, plan, index, fmt)
        return grad_x, flat.split_with_sizes(gathering.gather_plan(plan, index, x_shape, fmt, grad.device).recv_sizes)
    return unstage_to_pieces(grad, x_shape, plan, index, fmt, flat_messages=True)


def _exchange_fake(x, handle, global_shape, anchor=None):
    _, plan, index = halo_geometry(handle, global_shape)
    if plan is None:
        return torch.empty_like(x)
    lead = tuple(x.shape[: x.dim() - len(plan.axes)])
    return empty_in(lead + plan.staged_shape(index), memory_format_of(x), dtype=x.dtype, device=x.device)


def _exchange_adjoint(grad: torch.Tensor, handle: int, global_shape: list[int], x_shape: list[int],
                      x_format: int) -> torch.Tensor:
    """Send every staged box's gradient home and accumulate: ``[x_shape]`` in ``x_format``."""
    halo, plan, index = halo_geometry(handle, global_shape)
    if plan is None:
        return grad.new_zeros(tuple(x_shape))
    x_shape = tuple(x_shape)
    grad_x, outgoing = unstage_for_exchange(grad, x_shape, plan, index, format_of_code(x_format))
    world_of, lead = halo.world_of_fn(), x_shape[: len(x_shape) - len(plan.axes)]
    sizes = packing.message_numels(plan, index, math.prod(lead))[0]
    # small messages: the boxes that come back in one buffer, added by one indexed add in box order (the same
    # terms in the same order as an add per box: distfuse.primitives._halo_packing)
    add_at_once = packing.packs(sum(sizes), grad)
    flat = grad.new_empty(sum(sizes)) if add_at_once else None
    incoming = (flat.split(sizes) if add_at_once else
                [grad.new_empty(lead + pc.src_shape) for _, pc in plan.sends(index)])
    exchange([(world_of(pc.src), g) for pc, g in zip(plan.recvs(index), outgoing, strict=True)],
             [(world_of(r), buf) for (r, _), buf in zip(plan.sends(index), incoming, strict=True)],
             op=f"{halo._op} (adjoint)")
    if add_at_once:
        packing.add_incoming(grad_x, plan, index, flat)
    else:
        for (_, pc), buf in zip(plan.sends(index), incoming, strict=True):
            grad_x[pc.src_index].add_(buf)
    dx = grad_x.to(grad.dtype)
    # the gathered adjoint's sum is a view of its buffer: an op returns a tensor of its own (autograd refuses in-place
    # ops on a view made inside a custom function, and the layers poison a disagreeing call's gradient in place)
    return dx.clone(memory_format=format_of_code(x_format)) if dx._is_view() else dx


def _exchange_adjoint_fake(grad, handle, global_shape, x_shape, x_format):
    fmt = format_of_code(x_format) if lookup(handle).P_x.active else torch.contiguous_format
    return empty_in(tuple(x_shape), fmt, dtype=grad.dtype, device=grad.device)


halo_exchange, halo_exchange_adjoint = op_pair(
    "halo_exchange", _exchange, _exchange_fake, _exchange_adjoint, _exchange_adjoint_fake,
    adjoint_args=lambda x, handle, G, anchor=None: (handle, list(G), list(x.shape), format_code(memory_format_of(x))),
    forward_args=lambda g, handle, G, x_shape, x_format: (handle, list(G)))


class HaloExchange(HandleOwner, nn.Module):
    """Stage the input of a convolution over a spatially partitioned tensor.

    Args:
        P_x: the CartesianPartition of the input; its last ``len(kernel_size)``
            dimensions are the spatial ones.
        kernel_size, stride, dilation: per spatial axis (int or tuple), as torch.
        padding: int, tuple (of ints or ``(lo, hi)`` pairs), ``'same'`` or ``'valid'``.
        padding_mode: ``'zeros'``, ``'reflect'``, ``'replicate'`` or ``'circular'``, with
            global semantics (only at the global boundary; circular wraps the whole domain).

    ``forward(x, global_shape=None)`` returns the staged input.  Without ``global_shape``
    it is found, and the blocks checked to be its balanced decomposition, under the
    agreement protocol (:func:`~distfuse.primitives._agreement.agreed_by_flag_round`: the
    halo messages run between neighbours only, so none reaches every worker; ``agreement``
    counts the calls and the gathers); with it the checks are local.  Plans are cached per
    global shape.  Construction is not collective.  Errors name ``_op``: the layer that
    owns this exchange, if any.
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
        return world_of_fn(self.P_x, self.nd)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None, agree: bool = False) -> torch.Tensor:
        """The staged input; ``global_shape`` skips the agreement (local checks; see the class docstring).

        ``agree=True`` (with ``global_shape``) makes a failure of the local checks an error
        on every worker of P_x (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).
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
        debug.check_agreement(op, self.P_x.ranks, self.P_x.meta_group,
                              same=dict(dtype=str(x.dtype), ndim=x.dim(), spatial=tuple(global_shape[-self.nd:])),
                              info=dict(shape=tuple(x.shape)))
        # No x.contiguous(): the block is read through views, so a channels_last block is not copied to NCHW.
        return halo_exchange(x, self.handle, [int(n) for n in global_shape])
