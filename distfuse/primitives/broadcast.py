"""Broadcast: copy each block of ``P_x`` to every ``P_y`` worker the broadcast rules map it to.

Per worker (``x`` this worker's block, ``i(j)`` the P_x worker that P_y worker ``j`` maps to)::

    forward   y_j  = clone(x_{i(j)})                       on every P_y worker j
    adjoint   dx_i = sum over {j : i(j) = i} of dy_j       on every P_x worker i   (a SumReduce)

The map follows DistDL's broadcast rules (see ``geometry/broadcast_plan.py``): ``transpose_src`` /
``transpose_dest`` reverse the *partition* shape of P_x / P_y (never the tensor), P_x is
extended with ones on the left, and in each dimension P_x's extent must be 1 or equal
P_y's.  ``dim(P_x) <= dim(P_y)``.  Blocks move whole, so different P_x workers may hold
blocks of different shapes; every destination gets its source's shape.

Worker roles (the reference's four cases):

============  ==========================  =====================================================
active in     forward takes -> returns    adjoint takes -> returns
============  ==========================  =====================================================
P_x and P_y   block -> (other) block      dy block -> dx block
P_x only      block -> zero-volume [1]_   zero-volume -> dx block
P_y only      zero-volume -> block        dy block -> zero-volume (the placeholder's shape)
neither       zero-volume -> its clone    zero-volume -> zero-volume
============  ==========================  =====================================================

.. [1] ``[batch, 0]`` with ``preserve_batch=True`` (the default), else ``[0]``.

The output is always a new tensor, also where the worker is its own source.

Decisions:

* **Tensor dimensions.** A block must have ``dim(P_y)`` dimensions: one per partition
  dimension after P_x is extended with ones (DistDL's rule; distfuse's decomposition
  maps partition dimension d to tensor dimension d).  Pad the partition with ones, not
  the tensor, to broadcast a lower-dimensional tensor.
* **Autograd on receive-only workers.** A P_y-only worker's input is a placeholder; its
  output requires grad only if that placeholder does.  Pass
  ``zero_volume_tensor(requires_grad=True)`` there when training, or the adjoint never
  runs on that worker and its P_x source waits for the gradient until the process
  group times out.  Likewise every worker of P_x and P_y must run the backward (a
  P_x-only worker backpropagates through its zero-volume output).
* **Metadata cost.** The :class:`Broadcast` module cannot know the block shape on a
  receive-only worker, so it all-gathers each worker's ``(shape, dtype)`` over
  ``union_partition(P_x, P_y)`` (ten int64 per worker on the host gloo group, no device
  sync) and checks them on every worker: data passed on a worker inactive in P_x, wrong
  numbers of dimensions, and P_x workers that disagree on dtype
  (:class:`CollectiveMismatchError`) raise the same error on every rank.  It gathers
  only on the first call and when some worker's block shape, dtype or device changed
  (the agreement protocol, :func:`agreed_metadata`); while they repeat, a one-element
  flag all-reduce on the same host group replaces the gather (measured with 4 gloo ranks
  on the loaded 2-core CI machine: see ``docs/reliability.md``).  Layers that know shapes
  analytically call :func:`broadcast` with ``y_shape`` and skip both.
* **Identity.** When every worker is its own source (``P_x == P_y`` without transposes,
  among others) the op is a clone with no communication and no metadata exchange.
* **Debug mode** (``DISTFUSE_DEBUG=1``): ranks check that they agree on the plan, the
  dtype and the number of dimensions before any data moves (shapes are shown), and
  receive buffers start as NaN so that an element no message wrote cannot pass a test.

Communication is one batch of point-to-point messages (:func:`exchange`): each P_x
worker sends its block once per destination; self-messages are local copies.  A source
therefore sends ``k`` copies for a fan-out of ``k``: fine for model-parallel grids (k up
to a few dozen); a tree over per-source groups would cut that to log k rounds (not done).  The
adjoint receives the gradients into one stacked buffer and sums it once, in fp32 for
bf16/fp16 (one rounding at the end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.broadcast_plan import BroadcastPlan, check_gathered_inputs
from distfuse.partition import union_partition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._common import check_inactive_input, empty_like_batch, exchange, gather_metadata
from distfuse.primitives._layout import as_message, empty_in, stacked_in

__all__ = ["Broadcast", "BroadcastFunction", "BroadcastAdjointFunction", "broadcast", "broadcast_plan", "copy_blocks",
           "sum_blocks", "agreed_metadata", "metadata_signature"]

_HALF = (torch.float16, torch.bfloat16)


def _recv_buffer(shape: Sequence[int], dtype: torch.dtype, device, fmt=None) -> torch.Tensor:
    """A buffer (in ``fmt``) that messages overwrite entirely; NaN in debug mode so that a gap cannot pass unseen."""
    buf = empty_in(shape, fmt, dtype=dtype, device=device)
    if debug.enabled() and dtype.is_floating_point:
        buf.fill_(float("nan"))
    return buf


def copy_blocks(plan: BroadcastPlan, t: torch.Tensor | None, out_shape, dtype: torch.dtype,
                device, memory_format=None) -> torch.Tensor | None:
    """Walk ``plan`` forwards: sources send ``t`` to each destination; destinations return what they receive.

    Messages are dense in ``memory_format`` (both ends pass the same one; None: contiguous),
    so a source already in it sends its block without a copy and the destination's block
    comes back in it.  Returns None on a worker that is not a destination.
    """
    me = dist.get_rank()
    sends = []
    if plan.is_src(me):
        t = as_message(t, memory_format)
        sends = [(w, t) for w in plan.dests_of(me)]
    out, recvs = None, []
    if plan.is_dst(me):
        out = _recv_buffer(out_shape, dtype, device, memory_format)
        recvs = [(plan.source_of(me), out)]
    exchange(sends, recvs, op=plan.op)
    return out


def sum_blocks(plan: BroadcastPlan, t: torch.Tensor | None, out_shape, dtype: torch.dtype,
               device, memory_format=None) -> torch.Tensor | None:
    """Walk ``plan`` backwards: destinations send ``t`` to their source; sources return the sum they receive.

    Returns None on a worker that is not a source.  The contributions land in one
    stacked ``[k, *out_shape]`` buffer and are summed in a fixed order (destination
    order), so the result is deterministic.  Messages and the result are dense in
    ``memory_format`` (see :func:`copy_blocks`).
    """
    me = dist.get_rank()
    sends = [(plan.source_of(me), as_message(t, memory_format))] if plan.is_dst(me) else []
    out, recvs = None, []
    if plan.is_src(me):
        dests = plan.dests_of(me)
        buf = stacked_in(len(dests), out_shape, memory_format, dtype=dtype, device=device)
        if debug.enabled() and dtype.is_floating_point:
            buf.fill_(float("nan"))
        recvs = [(w, buf[k]) for k, w in enumerate(dests)]
    exchange(sends, recvs, op=plan.op)
    if plan.is_src(me):
        if len(recvs) == 1:
            out = buf[0]
        else:
            out = empty_in(out_shape, memory_format, dtype=dtype, device=device)
            if dtype in _HALF:
                out.copy_(buf.sum(0, dtype=torch.float32))
            else:
                torch.sum(buf, 0, out=out)
    return out


def metadata_signature(x: torch.Tensor) -> tuple:
    """What :func:`~distfuse.primitives._common.gather_metadata` records of ``x``: its shape, dtype and device type."""
    return tuple(x.shape), x.dtype, (x.device.type if x.numel() else None)


def agreed_metadata(site: AgreementSite, P_union, op: str, x: torch.Tensor, check) -> list:
    """Every union worker's ``(shape, dtype)``, gathered on the first call and on a change only.

    The agreement protocol of :mod:`~distfuse.primitives._agreement` with the flag in a
    one-element host all-reduce over ``P_union`` (the data moves point to point, so no
    message reaches every worker): while every worker's :func:`metadata_signature`
    repeats, the agreed records are reused after that flag round; otherwise every worker
    gathers them and ``check(meta)`` raises the same error everywhere or accepts them.
    """
    def slow():
        meta = gather_metadata(P_union, x, op=op)
        check(meta)
        return meta

    return agreed_by_flag_round(site, P_union, op, metadata_signature(x), True, slow)


def broadcast_plan(P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False) -> BroadcastPlan:
    """The plan of ``Broadcast(P_x, P_y, ...)``; pure Python, raises :class:`PartitionError` on a rule violation."""
    return BroadcastPlan("Broadcast", P_x, P_y, transpose_src, transpose_dest, "P_x", "P_y")


class BroadcastFunction(torch.autograd.Function):
    """Autograd form of :func:`broadcast`; its backward is :class:`BroadcastAdjointFunction` (the SumReduce).

    Both are differentiable (each one's backward is the other), so gradients of any
    order through a broadcast are exact.
    """

    @staticmethod
    def forward(ctx, x, plan: BroadcastPlan, y_shape, y_dtype, preserve_batch: bool, memory_format=None):
        me = dist.get_rank()
        ctx.plan, ctx.preserve_batch, ctx.memory_format = plan, preserve_batch, memory_format
        ctx.x_shape, ctx.x_dtype, ctx.x_device = x.shape, x.dtype, x.device
        device = x.device if plan.is_src(me) else plan.dst_partition.device
        y = copy_blocks(plan, x if plan.is_src(me) else None, y_shape, y_dtype, device, memory_format)
        if y is None:
            y = empty_like_batch(x, preserve_batch) if plan.is_src(me) else x.clone()
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = BroadcastAdjointFunction.apply(dy, ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.x_device, ctx.preserve_batch,
                                            ctx.memory_format)
        return dx, None, None, None, None, None


class BroadcastAdjointFunction(torch.autograd.Function):
    """The adjoint of :class:`BroadcastFunction`: sources get the sum of their destinations' ``dy``.

    ``dx`` has the forward input's shape, dtype and device (zeros on a worker that is no
    source: the gradient of its placeholder).  Its backward is the broadcast again.
    """

    @staticmethod
    def forward(ctx, dy, plan: BroadcastPlan, x_shape, x_dtype, x_device, preserve_batch: bool, memory_format=None):
        me = dist.get_rank()
        ctx.plan, ctx.preserve_batch, ctx.memory_format = plan, preserve_batch, memory_format
        ctx.dy_shape, ctx.dy_dtype = tuple(dy.shape), dy.dtype
        dx = sum_blocks(plan, dy if plan.is_dst(me) else None, x_shape, x_dtype, x_device, memory_format)
        if dx is None:  # not a source: the gradient of the zero-volume placeholder
            dx = torch.zeros(x_shape, dtype=x_dtype, device=x_device)
        return dx

    @staticmethod
    def backward(ctx, ddx):
        ddy = BroadcastFunction.apply(ddx, ctx.plan, ctx.dy_shape if ctx.plan.is_dst(dist.get_rank())
                                      else None, ctx.dy_dtype, ctx.preserve_batch, ctx.memory_format)
        return ddy, None, None, None, None, None, None


def _check_args(plan: BroadcastPlan, x: torch.Tensor, y_shape, y_dtype) -> None:
    """:func:`broadcast`'s local checks of this worker's arguments (no communication)."""
    op = plan.op
    me = dist.get_rank()
    is_src, is_dst = plan.is_src(me), plan.is_dst(me)
    if is_src:
        if x.dim() != plan.ndim:
            raise expect(op, "number of tensor dimensions (one per dimension of P_y; P_x is extended with ones)",
                         plan.ndim, x.dim())
        if x.device.type != plan.src_partition.device.type:
            raise expect(op, "device", plan.src_partition.device, x.device)
    else:
        check_inactive_input(op, x)
    if is_dst:
        if y_shape is None:
            raise ShapeError(f"{where(op)}: this rank is active in P_y, so the functional broadcast needs y_shape "
                             "(the shape of the block it receives); the Broadcast module infers it")
        if len(y_shape) != plan.ndim:
            raise expect(op, "number of dimensions of y_shape (one per dimension of P_y)", plan.ndim, len(y_shape))
        if is_src and y_dtype != x.dtype:
            raise expect(op, "y_dtype (every P_x worker sends its own dtype)", x.dtype, y_dtype)
    if plan.identity and (is_src or is_dst) and tuple(y_shape) != tuple(x.shape):
        raise expect(op, "y_shape (this worker is its own source)", tuple(x.shape), tuple(y_shape))


def broadcast(x: torch.Tensor, plan: BroadcastPlan, y_shape: Sequence[int] | None = None,
              y_dtype: torch.dtype | None = None, preserve_batch: bool = True, P_union=None,
              memory_format: torch.memory_format | None = None, agree: bool = False) -> torch.Tensor:
    """Functional Broadcast along ``plan`` (from :func:`broadcast_plan`), without the metadata exchange.

    Args:
        x: this worker's block on P_x workers, a zero-volume tensor elsewhere.
        plan: the map; building it is pure Python (no collective).
        y_shape: on P_y workers, the shape of the block this worker receives (its
            source's block shape); ignored elsewhere.
        y_dtype: the dtype of the received block (default ``x.dtype``).
        preserve_batch: P_x-only workers return ``[x.shape[0], 0]`` instead of ``[0]``.
        P_union: a partition over every worker of P_x and P_y; used for ``agree`` and the
            debug-mode agreement check.
        memory_format: the layout the blocks travel and arrive in (``channels_last`` for
            a 4-D block); every worker of the plan must pass the same one.  Default:
            contiguous.
        agree: make a failure of the local checks an error on every worker of ``P_union``
            (required then), instead of on the failing worker alone while its peers wait
            in the exchange until the timeout: one one-element host all-reduce per call
            (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).
    """
    op = plan.op
    me = dist.get_rank()
    is_src, is_dst = plan.is_src(me), plan.is_dst(me)
    y_dtype = x.dtype if y_dtype is None else y_dtype
    if agree and P_union is None:
        raise ShapeError(f"{where(op)}: agree=True needs P_union (the workers that agree on the checks)")
    if agree and P_union.active and not plan.identity:
        agree_on_local_checks(P_union, op, lambda: _check_args(plan, x, y_shape, y_dtype))
    else:
        _check_args(plan, x, y_shape, y_dtype)
    if not (is_src or is_dst) or plan.identity:
        return x.clone()
    if P_union is not None and debug.enabled():
        debug.check_agreement(
            op, P_union.ranks, P_union.meta_group,
            same={"plan": plan.signature, "dtype": str(x.dtype if is_src else y_dtype),
                  "ndim": x.dim() if is_src else len(y_shape)},
            info={"x": tuple(x.shape) if is_src else None, "y": tuple(y_shape) if is_dst else None},
        )
    return BroadcastFunction.apply(x, plan, tuple(y_shape) if is_dst else None, y_dtype, preserve_batch,
                                   memory_format)


class Broadcast(nn.Module):
    """Copy blocks of ``x`` from ``P_x`` to ``P_y`` by the broadcast rules; the adjoint sum-reduces.

    Construction is collective over the world (it creates ``union_partition(P_x, P_y)``)
    and raises :class:`PartitionError` on every rank when P_x does not broadcast to P_y.
    Block shapes are agreed over the union (gathered on the first call and on a change,
    a flag round otherwise; ``agreement`` counts them; see the module docstring); use
    :func:`broadcast` with ``self.plan`` when the shapes are known.
    """

    def __init__(self, P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False,
                 preserve_batch: bool = True):
        super().__init__()
        self.P_x, self.P_y = P_x, P_y
        self.transpose_src, self.transpose_dest = bool(transpose_src), bool(transpose_dest)
        self.preserve_batch = bool(preserve_batch)
        self.plan = broadcast_plan(P_x, P_y, transpose_src, transpose_dest)
        self.P_union = union_partition(P_x, P_y)
        self.agreement = AgreementSite(self.plan.op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        me = dist.get_rank()
        if not self.P_union.active:
            check_inactive_input(plan.op, x)
            return x.clone()
        if plan.identity:
            return broadcast(x, plan, tuple(x.shape), x.dtype, self.preserve_batch)
        meta = agreed_metadata(self.agreement, self.P_union, plan.op, x, lambda m: check_gathered_inputs(
            plan, self.P_union.ranks, m, data_on="src", data_name="P_x"))
        y_shape = y_dtype = None
        if plan.is_dst(me):
            y_shape, y_dtype = meta[self.P_union.ranks.index(plan.source_of(me))]
        return broadcast(x, plan, y_shape, y_dtype, self.preserve_batch, self.P_union)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.plan.src_ranks)}, P_y={list(self.plan.dst_ranks)}, "
                f"transpose_src={self.transpose_src}, transpose_dest={self.transpose_dest}, "
                f"preserve_batch={self.preserve_batch}")
