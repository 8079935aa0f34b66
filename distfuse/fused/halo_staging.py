"""The fused halo staging on its own, and the message lists every fused halo exchange posts.

:func:`forward_messages` / :func:`backward_messages` pair the flat send and receive
buffers of the halo kernels (``kernels/halo.py``) with their peers, box by box in the
plan's order, so a fused worker sends the same bytes, in the same order, as the
unfused ``HaloExchange`` and the two can talk.

:data:`halo_staging` / :data:`halo_staging_adjoint` (an op pair)::

    distfuse::halo_staging(x [B, C, *n], handle, global_shape, channels_last)       -> staged [B, C, *L]
    distfuse::halo_staging_adjoint(g [B, C, *L], handle, global_shape, x_shape,
                                   channels_last)                                  -> dx [B, C, *n]

is the fused halo convolution's staging without the convolution (Triton pack / stage /
unstage / accumulate), for layers that stage a window and then run something else on it
(pooling, upsampling): positions outside the domain are zero (the layers fill them
afterwards).  ``handle`` names the same context as the unfused pair
(``primitives.halo_exchange.PlanHalo``), so the paths are interchangeable, compiled calls
included.  Each op's backward is the other (staging is linear), so gradients of any order are exact.
``channels_last`` (the format the layer's workers agreed on): the block, ``staged`` and ``dx``
are channels last and the boxes travel as ``[B, *box, C]`` (no copy of a channels-last block);
else they are contiguous (NCHW).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distfuse.geometry.halo_plan import HaloPlan
from distfuse.kernels.halo import halo_accumulate, halo_pack, halo_stage, halo_unstage, layout_format
from distfuse.kernels.halo_tables import box_offsets, recv_numel, send_numel
from distfuse.primitives._common import exchange
from distfuse.primitives._layout import empty_in
from distfuse.primitives._op_pair import op_pair
from distfuse.primitives.halo_exchange import halo_geometry

__all__ = ["message_views", "forward_messages", "backward_messages", "halo_staging", "halo_staging_adjoint"]


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


def _staging(x: torch.Tensor, handle: int, global_shape: list[int], channels_last: bool = False) -> torch.Tensor:
    """Pack, one round, one staging pass; ``x`` made contiguous in the agreed format (a no-op when it is)."""
    halo, plan, index = halo_geometry(handle, global_shape)
    nd = len(plan.axes)
    x = x.contiguous(memory_format=layout_format(nd, channels_last))
    lead = math.prod(x.shape[:-nd])
    send = halo_pack(x, plan, index, channels_last=channels_last)
    recv = x.new_empty(recv_numel(plan, index, lead))
    exchange(*forward_messages(plan, index, halo.world_of_fn(), lead, send, recv), op=halo._op)
    return halo_stage(x, recv, plan, index, channels_last=channels_last)


def _staging_fake(x, handle, global_shape, channels_last=False):
    _, plan, index = halo_geometry(handle, global_shape)
    nd = len(plan.axes)
    return empty_in(tuple(x.shape[:-nd]) + plan.staged_shape(index), layout_format(nd, channels_last),
                    dtype=x.dtype, device=x.device)


def _staging_adjoint(grad: torch.Tensor, handle: int, global_shape: list[int], x_shape: list[int],
                     channels_last: bool = False) -> torch.Tensor:
    """Unstage, the reversed messages, accumulate: ``[x_shape]`` (channels last with ``channels_last``)."""
    halo, plan, index = halo_geometry(handle, global_shape)
    nd = len(plan.axes)
    lead = math.prod(x_shape[:-nd])
    part = halo_unstage(grad.contiguous(memory_format=layout_format(nd, channels_last)), plan, index,
                        channels_last=channels_last)
    incoming = grad.new_empty(send_numel(plan, index, lead))
    exchange(*backward_messages(plan, index, halo.world_of_fn(), lead, part.send, incoming), op=f"{halo._op} (adjoint)")
    return halo_accumulate(part.grad_x, part.self_boxes, incoming, plan, index, channels_last=channels_last)


def _staging_adjoint_fake(grad, handle, global_shape, x_shape, channels_last=False):
    return empty_in(tuple(x_shape), layout_format(len(x_shape) - 2, channels_last), dtype=grad.dtype,
                    device=grad.device)


halo_staging, halo_staging_adjoint = op_pair(
    "halo_staging", _staging, _staging_fake, _staging_adjoint, _staging_adjoint_fake,
    adjoint_args=lambda x, handle, G, channels_last=False: (handle, list(G), list(x.shape), channels_last),
    forward_args=lambda g, handle, G, x_shape, channels_last=False: (handle, list(G), channels_last))
