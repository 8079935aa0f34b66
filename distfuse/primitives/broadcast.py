"""Broadcast: copy each block of ``P_x`` to every ``P_y`` worker the broadcast rules map it to.

Per worker (``x`` this worker's block, ``i(j)`` the P_x worker that P_y worker ``j`` maps to)::

    forward   y_j  = clone(x_{i(j)})                       on every P_y worker j
    adjoint   dx_i = sum over {j : i(j) = i} of dy_j       on every P_x worker i   (a SumReduce)

The map follows DistDL's broadcast rules (:mod:`~distfuse.geometry.broadcast_plan`).
Blocks move whole, so every destination gets its source's shape; a block has ``dim(P_y)``
dimensions (pad the partition with ones, not the tensor).  Worker roles (the reference's
four cases):

============  ==========================  =====================================================
active in     forward takes -> returns    adjoint takes -> returns
============  ==========================  =====================================================
P_x and P_y   block -> (other) block      dy block -> dx block
P_x only      block -> zero-volume [1]_   zero-volume -> dx block
P_y only      zero-volume -> block        dy block -> zero-volume (the placeholder's shape)
neither       zero-volume -> its clone    zero-volume -> zero-volume
============  ==========================  =====================================================

.. [1] ``[batch, 0]`` with ``preserve_batch=True`` (the default), else ``[0]``.

The output is always a new tensor (a clone where every worker is its own source).  A
P_y-only worker's output requires grad only if its placeholder does: pass
``zero_volume_tensor(requires_grad=True)`` there when training (layers pass the op's
:func:`~distfuse.primitives._op_pair.anchor`) and run the backward on every worker, or the
source waits for the gradient until the timeout.

One op pair serves every caller, eager and compiled (:mod:`~distfuse.primitives._op_pair`)::

    broadcast_blocks(t, h, out_shape, fmt, flag, anchor)    distfuse::broadcast: sources send t, a destination
                                                           returns its source's block [out_shape] in fmt
    sum_reduce_blocks(t, h, out_shape, fmt, flag, anchor)   distfuse::broadcast_adjoint: destinations send t,
                                                           a source returns the sum of its destinations' blocks

``h`` names a :class:`PlanMove`; ``fmt`` is the layout the blocks travel and arrive in (0
contiguous, 1 channels_last, 2 channels_last_3d); a worker that receives nothing returns
an empty ``[out_shape]``.  The flagged round (``flag >= 0``, one source) carries an
agreement flag (:mod:`~distfuse.primitives._agreement`): the destinations send the source
their flags, whose sum it appends to its block, so one message carries every flag to every
worker (on CUDA the host round of :mod:`~distfuse.primitives._flag_transport`); when any is
set every worker runs the context's ``on_flag`` and raises
:func:`~distfuse.primitives.agreement_session.flagged_error`.

A receive-only worker cannot know its block's shape: the :class:`Broadcast` module agrees
on every worker's ``(shape, dtype)`` over ``union_partition(P_x, P_y)`` (:class:`PlanModule`),
:func:`broadcast` takes ``y_shape``.  Debug mode (``DISTFUSE_DEBUG=1``) checks the plan,
dtype and dimensions and NaN-fills receive buffers.  Each source sends its block once per
destination in one batch of point-to-point messages (:func:`exchange`; a tree would cut a
fan-out of ``k`` to log k rounds, not done); the adjoint sums the received gradients once,
in fp32 for bf16/fp16.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from distfuse import debug
from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.broadcast_plan import BroadcastPlan, check_gathered_inputs
from distfuse.partition import union_partition
from distfuse.primitives._agreement import AgreementSite, agree_on_local_checks, agreed_by_flag_round
from distfuse.primitives._common import cached, check_inactive_input, exchange, gather_metadata, poison
from distfuse.primitives._flag_transport import any_flag_on_host, flags_on_host
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._layout import as_message, empty_in, format_code, format_of_code, stacked_in
from distfuse.primitives._op_pair import op_pair
from distfuse.primitives.agreement_session import flagged_error

__all__ = ["Broadcast", "broadcast", "broadcast_plan", "copy_blocks", "PlanMove", "move_of", "broadcast_blocks",
           "sum_reduce_blocks", "move_blocks", "NO_FLAG", "PlanModule", "placeholder"]

_HALF = (torch.float16, torch.bfloat16)
NO_FLAG = -1  #: the ``flag`` of a plain (unflagged) call of the op pair


def copy_blocks(plan: BroadcastPlan, t: torch.Tensor | None, out_shape, dtype: torch.dtype,
                device, memory_format=None) -> torch.Tensor | None:
    """Walk ``plan`` forwards: sources send ``t`` to each destination, which returns it (None elsewhere).

    Messages are dense in ``memory_format`` (the same on both ends; None: contiguous): a
    source already in it sends its block without a copy, and the block arrives in it.
    """
    me = dist.get_rank()
    sends = []
    if plan.is_src(me):
        t = as_message(t, memory_format)
        sends = [(w, t) for w in plan.dests_of(me)]
    out, recvs = None, []
    if plan.is_dst(me):
        out = poison(empty_in(out_shape, memory_format, dtype=dtype, device=device))
        recvs = [(plan.source_of(me), out)]
    exchange(sends, recvs, op=plan.op)
    return out


# ---------------------------------------------------------------- the op pair


class PlanMove(HandleOwner):
    """The context behind the op pair's handle: a plan, the op named in errors and, for a flagged round,
    the partition whose meta group carries the flags on CUDA and ``on_flag`` (run on every worker when some
    worker flagged: the layer forgets its agreement)."""

    def __init__(self, plan: BroadcastPlan, op: str | None = None, P=None, on_flag: Callable[[], None] | None = None):
        self.plan, self.op, self.P, self.on_flag = plan, op or plan.op, P, on_flag
        self.handle = new_handle(self)

    def copy(self, t: torch.Tensor, out_shape: list[int], fmt: int = 0, anchor: torch.Tensor | None = None,
             flag: int = NO_FLAG) -> torch.Tensor:
        """:data:`broadcast_blocks` along this plan: sources to destinations (``flag``: the flagged round)."""
        return broadcast_blocks(t, self.handle, out_shape, fmt, flag, anchor)

    def sum(self, t: torch.Tensor, out_shape: list[int], fmt: int = 0, anchor: torch.Tensor | None = None
            ) -> torch.Tensor:
        """:data:`sum_reduce_blocks` along this plan: destinations summed onto their sources."""
        return sum_reduce_blocks(t, self.handle, out_shape, fmt, NO_FLAG, anchor)


def move_of(plan: BroadcastPlan) -> PlanMove:
    """The plain :class:`PlanMove` of ``plan`` (made once, on first use; :func:`broadcast_plan` makes it at once)."""
    return cached(plan.__dict__, "_move", lambda: PlanMove(plan))


def placeholder(like: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-volume input for a worker that only receives: an empty slice of ``like`` (any tensor of the call).

    Never a graph constant: a compiler folds ops whose inputs are all constants at compile
    time, which ran a round on some workers while their peers were still compiling (gloo
    "Received data size doesn't match" under inductor).
    """
    t = like.detach()
    t = t[:0].reshape(-1) if t.dim() else t.reshape(1)[:0]  # a view: a flatten first would copy a channels_last x
    return t.to(device=device, dtype=dtype)


def _flagged_copy(ctx: PlanMove, t: torch.Tensor, out_shape: list[int], flag: int) -> torch.Tensor:
    """The flagged round of the module docstring: ``[out_shape]`` on every destination."""
    plan, me, n = ctx.plan, dist.get_rank(), out_shape[-1]
    msg_shape = tuple(out_shape[:-1]) + (n + 1,)
    on_host = flags_on_host(ctx.P.device)
    if on_host and any_flag_on_host(ctx.P, bool(flag), ctx.op):  # CUDA: the flags' host round, no device read
        out, flagged = None, True
    else:
        total = torch.full((1,), 1.0 if flag and not on_host else 0.0, dtype=t.dtype, device=t.device)
        if not on_host:  # in band: every destination's flag to its source, which sums them into its message
            src = plan.source_of(me) if plan.is_dst(me) else None
            peers = [w for w in plan.dests_of(me) if w != me]
            got = [torch.empty_like(total) for _ in peers]
            exchange([(src, total)] if src not in (None, me) else [], list(zip(peers, got, strict=True)), op=ctx.op)
            total = sum(got, total)
        msg = torch.cat([t.reshape(-1), total]).view(msg_shape) if plan.is_src(me) else None
        out = copy_blocks(plan, msg, msg_shape, t.dtype, t.device)
        # a host read of the received flag, inside the op (in band only: free for CPU tensors)
        flagged = not on_host and out is not None and bool(out.view(-1)[n] != 0)
    if flagged:  # every worker raises, after the round
        ctx.on_flag()
        raise flagged_error(ctx.op)
    return out.view(-1)[:n].clone().view(out_shape) if out is not None else t.new_empty(out_shape)


def _own(t: torch.Tensor, out_shape: list[int], fmt: int) -> torch.Tensor:
    """An identity plan's move: a copy of ``t`` in ``fmt`` (a new tensor, as a message would be)."""
    out = empty_in(out_shape, format_of_code(fmt), dtype=t.dtype, device=t.device)
    return out.copy_(t) if out.numel() else out


def _copy(t: torch.Tensor, handle: int, out_shape: list[int], fmt: int, flag: int,
          anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Sources send ``t``; a destination returns its source's block (``[out_shape]`` in ``fmt``)."""
    ctx: PlanMove = lookup(handle)
    if flag >= 0:
        return _flagged_copy(ctx, t, out_shape, flag)
    plan = ctx.plan
    if plan.identity:  # every worker is its own source
        return _own(t, out_shape, fmt)
    out = copy_blocks(plan, t, out_shape, t.dtype, t.device, format_of_code(fmt))  # sent where this worker is a source
    return out if out is not None else t.new_empty(out_shape)


def _sum(t: torch.Tensor, handle: int, out_shape: list[int], fmt: int, flag: int,
         anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Destinations send ``t``; a source returns their sum (``[out_shape]`` in ``fmt``), zeros elsewhere.

    The contributions land in one stacked ``[k, *out_shape]`` buffer, summed in destination
    order (deterministic), in fp32 for bf16/fp16 (one rounding at the end).
    """
    plan = lookup(handle).plan
    if plan.identity:  # every worker sums its own block alone
        return _own(t, out_shape, fmt)
    me, memory_format = dist.get_rank(), format_of_code(fmt)
    sends = [(plan.source_of(me), as_message(t, memory_format))] if plan.is_dst(me) else []
    if not plan.is_src(me):
        exchange(sends, [], op=plan.op)
        return t.new_zeros(out_shape)
    dests = plan.dests_of(me)
    buf = poison(stacked_in(len(dests), out_shape, memory_format, dtype=t.dtype, device=t.device))
    exchange(sends, [(w, buf[k]) for k, w in enumerate(dests)], op=plan.op)
    if len(dests) == 1:
        return buf[0]
    out = empty_in(out_shape, memory_format, dtype=t.dtype, device=t.device)
    if t.dtype in _HALF:
        return out.copy_(buf.sum(0, dtype=torch.float32))
    return torch.sum(buf, 0, out=out)


def _fake(receives: Callable[[BroadcastPlan, int], bool]):
    def fake(t, handle, out_shape, fmt, flag, anchor=None):
        if receives(lookup(handle).plan, dist.get_rank()):
            return empty_in(out_shape, format_of_code(fmt) if flag < 0 else None, dtype=t.dtype, device=t.device)
        return t.new_empty(out_shape)
    return fake


def _other_args(t, handle, out_shape, fmt, flag, anchor=None):
    """The other walk's arguments for a call on ``t``: its output is ``t``'s shape, the flag is not carried back."""
    return handle, list(t.shape), fmt, NO_FLAG


broadcast_blocks, sum_reduce_blocks = op_pair(
    "broadcast", _copy, _fake(BroadcastPlan.is_dst), _sum, _fake(BroadcastPlan.is_src),
    adjoint_args=_other_args, forward_args=_other_args)


def move_blocks(x: torch.Tensor, plan: BroadcastPlan, forward: bool, y_shape: Sequence[int] | None,
                y_dtype: torch.dtype | None, preserve_batch: bool, P_union, memory_format, agree: bool) -> torch.Tensor:
    """:func:`broadcast` (``forward``: walk the plan forwards) or :func:`~distfuse.primitives.sum_reduce.sum_reduce`
    (backwards), with their checks; see :func:`broadcast` for the arguments."""
    op = plan.op
    me = dist.get_rank()
    holds, gets = (plan.is_src(me), plan.is_dst(me)) if forward else (plan.is_dst(me), plan.is_src(me))
    y_dtype = x.dtype if y_dtype is None else y_dtype
    if agree and P_union is None:
        raise ShapeError(f"{where(op)}: agree=True needs P_union (the workers that agree on the checks)")
    if agree and P_union.active and not plan.identity:
        agree_on_local_checks(P_union, op, lambda: _check_args(plan, forward, holds, gets, x, y_shape, y_dtype))
    else:
        _check_args(plan, forward, holds, gets, x, y_shape, y_dtype)
    if not (holds or gets) or plan.identity:
        return x.clone()
    if P_union is not None and debug.enabled():
        debug.check_agreement(
            op, P_union.ranks, P_union.meta_group,
            same={"plan": plan.signature, "dtype": str(x.dtype if holds else y_dtype),
                  "ndim": x.dim() if holds else len(y_shape)},
            info={"x": tuple(x.shape) if holds else None, "y": tuple(y_shape) if gets else None},
        )
    if not holds:  # a placeholder: the received block's dtype and device
        x = x.to(dtype=y_dtype, device=(plan.dst_partition if forward else plan.src_partition).device)
    if gets:
        out_shape = list(y_shape)
    else:
        out_shape = [x.shape[0], 0] if preserve_batch and x.dim() > 0 else [0]
    move = move_of(plan)
    fmt = format_code(memory_format) if memory_format is not None else 0
    return move.copy(x, out_shape, fmt) if forward else move.sum(x, out_shape, fmt)


def _check_args(plan: BroadcastPlan, forward: bool, holds: bool, gets: bool, x: torch.Tensor, y_shape,
                y_dtype) -> None:
    """The functional forms' local checks of this worker's arguments (no communication); ``holds``: this worker
    passes data, ``gets``: it receives a block."""
    op = plan.op
    dims = "one per dimension of P_y; P_x is extended with ones" if forward else "one per dimension of P_x"
    if holds:
        if x.dim() != plan.ndim:
            raise expect(op, f"number of tensor dimensions ({dims})", plan.ndim, x.dim())
        P_in = plan.src_partition if forward else plan.dst_partition
        if x.device.type != P_in.device.type:
            raise expect(op, "device", P_in.device, x.device)
    else:
        check_inactive_input(op, x)
    if gets:
        if y_shape is None:
            raise ShapeError(f"{where(op)}: this rank is active in P_y, so the functional {op} needs y_shape (the "
                             f"shape of the block it receives); the {op} module infers it")
        if len(y_shape) != plan.ndim:
            raise expect(op, f"number of dimensions of y_shape ({dims})", plan.ndim, len(y_shape))
        if holds and y_dtype != x.dtype:
            raise expect(op, "y_dtype (the blocks keep their dtype)", x.dtype, y_dtype)
    if plan.identity and (holds or gets) and tuple(y_shape) != tuple(x.shape):
        raise expect(op, "y_shape (this worker is its own source)", tuple(x.shape), tuple(y_shape))


def broadcast_plan(P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False) -> BroadcastPlan:
    """The plan of ``Broadcast(P_x, P_y, ...)``, its handle made at once (in the same order on every rank); pure
    Python, raises :class:`PartitionError` on a rule violation."""
    return move_of(BroadcastPlan("Broadcast", P_x, P_y, transpose_src, transpose_dest, "P_x", "P_y")).plan


def broadcast(x: torch.Tensor, plan: BroadcastPlan, y_shape: Sequence[int] | None = None,
              y_dtype: torch.dtype | None = None, preserve_batch: bool = True, P_union=None,
              memory_format: torch.memory_format | None = None, agree: bool = False) -> torch.Tensor:
    """Functional Broadcast along ``plan`` (from :func:`broadcast_plan`), without the metadata exchange.

    Args:
        x: this worker's block on P_x workers, a zero-volume tensor elsewhere.
        plan: the map (pure Python, no collective).
        y_shape: on P_y workers, the shape of the block it receives (its source's); ignored elsewhere.
        y_dtype: the dtype of the received block (default ``x.dtype``).
        preserve_batch: P_x-only workers return ``[x.shape[0], 0]`` instead of ``[0]``.
        P_union: a partition over every worker of P_x and P_y; used for ``agree`` and the
            debug-mode agreement check.
        memory_format: the layout the blocks travel and arrive in (``channels_last`` for
            a 4-D block), the same on every worker of the plan.  Default: contiguous.
        agree: make a failure of the local checks an error on every worker of ``P_union``
            (required then) instead of on the failing worker alone, its peers waiting in
            the exchange until the timeout: one host round per call
            (:func:`~distfuse.primitives._agreement.agree_on_local_checks`).
    """
    return move_blocks(x, plan, True, y_shape, y_dtype, preserve_batch, P_union, memory_format, agree)


class PlanModule(nn.Module):
    """What :class:`Broadcast` and :class:`~distfuse.primitives.sum_reduce.SumReduce` share: the plan, the union
    partition, the block shapes agreed over it (``agreement``:
    :func:`~distfuse.primitives._agreement.agreed_by_flag_round`) and the forward.

    Construction is collective over the world (it creates ``union_partition(P_x, P_y)``)
    and raises :class:`PartitionError` on every rank when the partitions do not broadcast.
    Subclasses set ``plan_of`` (the plan of ``(P_x, P_y, transpose_src, transpose_dest)``)
    and ``forward_walk``.
    """

    forward_walk = True  # Broadcast walks its plan forwards, SumReduce backwards
    plan_of: Callable[..., BroadcastPlan]

    def __init__(self, P_x, P_y, transpose_src: bool = False, transpose_dest: bool = False,
                 preserve_batch: bool = True):
        super().__init__()
        self.P_x, self.P_y, self.plan = P_x, P_y, self.plan_of(P_x, P_y, transpose_src, transpose_dest)
        self.transpose_src, self.transpose_dest = bool(transpose_src), bool(transpose_dest)
        self.preserve_batch = bool(preserve_batch)
        self.P_union = union_partition(P_x, P_y)
        self.agreement = AgreementSite(self.plan.op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan, fwd = self.plan, self.forward_walk
        me = dist.get_rank()
        if not self.P_union.active:
            check_inactive_input(plan.op, x)
            return x.clone()
        if plan.identity:
            return move_blocks(x, plan, fwd, tuple(x.shape), x.dtype, self.preserve_batch, None, None, False)

        def gather():  # every union worker's (shape, dtype), checked alike on every worker
            meta = gather_metadata(self.P_union, x, op=plan.op)
            check_gathered_inputs(plan, self.P_union.ranks, meta, data_on="src" if fwd else "dst", data_name="P_x")
            return meta

        signature = (tuple(x.shape), x.dtype, x.device.type if x.numel() else None)  # what gather_metadata reads
        meta = agreed_by_flag_round(self.agreement, self.P_union, plan.op, signature, True, gather)
        y_shape = y_dtype = None
        if (plan.is_dst if fwd else plan.is_src)(me):
            y_shape, y_dtype = meta[self.P_union.ranks.index(plan.source_of(me) if fwd else plan.dests_of(me)[0])]
        return move_blocks(x, plan, fwd, y_shape, y_dtype, self.preserve_batch, self.P_union, None, False)

    def extra_repr(self) -> str:
        src, dst = (self.plan.src_ranks, self.plan.dst_ranks) if self.forward_walk else \
            (self.plan.dst_ranks, self.plan.src_ranks)
        return (f"P_x={list(src)}, P_y={list(dst)}, transpose_src={self.transpose_src}, "
                f"transpose_dest={self.transpose_dest}, preserve_batch={self.preserve_batch}")


class Broadcast(PlanModule):
    """``Broadcast(P_x, P_y, transpose_src=False, transpose_dest=False, preserve_batch=True)``: copy blocks of ``x``
    from ``P_x`` to ``P_y`` by the broadcast rules; the adjoint sum-reduces.  See :class:`PlanModule` and the module
    docstring; use :func:`broadcast` with ``self.plan`` when the shapes are known."""

    plan_of = staticmethod(broadcast_plan)
