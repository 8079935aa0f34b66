"""The fused halo staging on its own, and the message lists every fused halo exchange posts.

:func:`forward_messages` / :func:`backward_messages` pair the flat send and receive
buffers of the halo kernels (``kernels/halo.py``) with their peers, box by box in the
plan's order, so a fused worker sends the same bytes, in the same order, as the
unfused ``HaloExchange`` and the two can talk.  :class:`HaloStagingFunction` is the
fused halo convolution's staging without the convolution, for layers that stage a
window and then run something else on it (pooling, upsampling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels.halo import halo_accumulate, halo_pack, halo_stage, halo_unstage
from distfuse.kernels.halo_tables import box_offsets
from distfuse.primitives._common import exchange

__all__ = ["message_views", "forward_messages", "backward_messages", "HaloStagingFunction"]


def message_views(buf: torch.Tensor, shapes: Sequence[Sequence[int]], lead: int) -> list[torch.Tensor]:
    """Flat, contiguous per-message views of one buffer (box k = ``[lead, *shapes[k]]``)."""
    offs, _ = box_offsets(shapes, lead)
    return [buf[o: o + lead * math.prod(s)] for o, s in zip(offs, shapes, strict=True)]


def forward_messages(plan: HaloPlan, index, world_of, lead, send: torch.Tensor, recv: torch.Tensor):
    """Sends in ``plan.sends`` order and receives in ``plan.recvs`` order: both ends of each pair agree."""
    sends = plan.sends(index)
    recvs = plan.recvs(index)
    send_views = message_views(send, [pc.src_shape for _, pc in sends], lead)
    recv_views = message_views(recv, [pc.src_shape for pc in recvs], lead)
    out_s = [(world_of(r), v) for (r, _), v in zip(sends, send_views, strict=True)]
    out_r = [(world_of(pc.src), v) for pc, v in zip(recvs, recv_views, strict=True)]
    return out_s, out_r


def backward_messages(plan: HaloPlan, index, world_of, lead, send_back: torch.Tensor, incoming: torch.Tensor):
    """The forward messages reversed: what was received goes back to its owner, in the same order."""
    fwd_r, fwd_s = forward_messages(plan, index, world_of, lead, incoming, send_back)
    return fwd_s, fwd_r


class HaloStagingFunction(torch.autograd.Function):
    """The fused halo staging (Triton pack / stage / unstage / accumulate), without a convolution.

    ``x [B, C, *n] -> staged [B, C, *plan.staged_shape(index)]``, positions outside the
    domain zero (the pooling layers fill them afterwards, outside this Function).  The
    messages are those of the unfused exchange, in the plan's order, so a fused worker
    could talk to an unfused one.  Adjoint: unstage, the reversed messages, accumulate.
    """

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, index, world_of, op: str):
        nd = len(plan.axes)
        lead = math.prod(x.shape[:-nd])
        send = halo_pack(x, plan, index)
        recv = x.new_empty(sum(lead * math.prod(pc.src_shape) for pc in plan.recvs(index)))
        exchange(*forward_messages(plan, index, world_of, lead, send, recv), op=op)
        staged = halo_stage(x, recv, plan, index)
        ctx.plan, ctx.index, ctx.world_of, ctx.lead, ctx.op = plan, index, world_of, lead, op
        return staged

    @staticmethod
    def backward(ctx, grad):
        plan, index, lead = ctx.plan, ctx.index, ctx.lead
        part = halo_unstage(grad.contiguous(), plan, index)
        incoming = grad.new_empty(sum(lead * math.prod(pc.src_shape) for _, pc in plan.sends(index)))
        exchange(*backward_messages(plan, index, ctx.world_of, lead, part.send, incoming), op=ctx.op + " (adjoint)")
        grad_x = halo_accumulate(part.grad_x, part.self_boxes, incoming, plan, index)
        return grad_x, None, None, None, None
