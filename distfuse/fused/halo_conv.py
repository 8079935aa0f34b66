"""Fused halo convolution: pack, one-round exchange, one-pass staging, then the local convolution.

Shapes on worker ``index`` of the spatial grid (``nd`` = 1, 2 or 3 spatial axes)::

    x       [B, C, *n]            this worker's block (balanced decomposition)
    send    flat                  the boxes other workers read from x   (plan.sends(index) order)
    recv    flat                  the boxes this worker reads from them (plan.recvs(index) order)
    staged  [B, C, *L]            exactly the input this worker's output block reads
    weight  [Co, C/groups, *k]    replicated on every worker
    y       [B, Co, *m]           this worker's block of ConvNd(padding, padding_mode) on the global x

    forward  y  = conv(stage(x, exchange(pack(x))), weight, bias, padding=0, stride, dilation, groups)
    dgrad    gs = conv_input_grad(dy, weight)
             dx = accumulate(unstage(gs), exchange(send-back boxes of unstage(gs)))
    wgrad    dw = conv_weight_grad(dy, staged),   db = sum(dy)      (this worker's partial sums)

``dw`` and ``db`` are this worker's contributions; the layer that owns the replicated
weight sums them over the workers (as DistDL's weight broadcast adjoint does).

Why fused: DistDL stages with ``F.pad`` + clone + slice and PhysicsNeMo/DTensor with
``torch.cat``, two or three full copies of the block; here the staged input is written
once, straight from the block, the receive buffer and the padding rule
(``kernels/halo.py``), and the halo boxes travel as one flat buffer each way
(``bench/bench_halo_conv.py`` measures the staging's share of the time).

Overlap (CUDA; ``overlap=True`` also runs on gloo, where the tests exercise it)::

    forward   compute: pack | stage(local) ............. | wait | stage(remote) | conv
              comm:           |--- isend/irecv halos ---|
    backward  compute: dgrad | unstage(remote) | unstage(local) + wgrad ... | wait | accumulate
              comm:                            |--- send back halo grads ---|

``stage(local)`` writes every piece read from the own block and the zero fill;
``stage(remote)`` then writes only the received pieces, so every staged element is
still written once.  Without overlap (the CPU default) each step follows the previous one.

Workers with no output (staged extent 0) return an empty ``y`` of the right shape and
still take part in both exchanges, because other workers read their blocks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distfuse.errors import ShapeError, UnsupportedError, expect, where
from distfuse.fused.halo_staging import backward_messages, forward_messages
from distfuse.geometry.halo_plan import HaloPlan
from distfuse.groups import world_group
from distfuse.kernels.halo import (
    CHANNELS_LAST,
    halo_accumulate,
    halo_pack,
    halo_stage,
    halo_unstage,
    is_channels_last,
    layout_format,
)
from distfuse.kernels.halo_tables import recv_numel, send_numel
from distfuse.primitives._common import collective_guard, exchange, first_order_only
from distfuse.primitives._handles import lookup
from distfuse.primitives._layout import empty_in
from distfuse.primitives._op_pair import ordered

__all__ = ["HaloConvFunction", "halo_conv", "fused_halo_conv", "implicit_requested", "check_implicit"]

_OP = "halo_conv"
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv(nd: int, x, weight, bias, stride, dilation, groups):
    """The staged conv; on CPU, 16-bit convs run in fp32 and round once (as ``layers._conv_common.conv_block``):
    torch 2.13's oneDNN computes bf16 conv3d with a stride on the last axis wrongly on one thread."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return _CONV[nd](x.float(), weight.float(), None if bias is None else bias.float(), stride, 0, dilation,
                         groups).to(x.dtype)
    return _CONV[nd](x, weight, bias, stride, 0, dilation, groups)


def _stride_dilation(plan: HaloPlan) -> tuple[list[int], list[int]]:
    return [ax.stride for ax in plan.axes], [ax.dilation for ax in plan.axes]


def _post(sends, recvs) -> list:
    """Post one batch of point-to-point messages and return the works, without waiting."""
    me = dist.get_rank()
    if any(peer == me for peer, _ in sends) or any(peer == me for peer, _ in recvs):
        exchange(sends, recvs, op=_OP)  # self-messages never come from a plan; the blocking helper copies them
        return []
    group = world_group()  # distfuse's world group: its timeout is DISTFUSE_TIMEOUT, not the default group's
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for peer, t in sends if t.numel() > 0]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group) for peer, t in recvs if t.numel() > 0]
    if not ops:
        return []
    with collective_guard(_OP, "posting the halo exchange", (o.peer for o in ops)):
        return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    with collective_guard(_OP, "halo exchange"):
        for w in works:
            w.wait()


def _stage_conv(x, weight, bias, plan: HaloPlan, index: tuple[int, ...], world_of: Callable, groups: int,
                overlap: bool, implicit: bool, keep: bool,
                channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward: ``(y, kept)``; ``kept`` is what the weight gradient reads (only with ``keep``): the staged
    input, or the receive buffer on the implicit path (whose backward re-stages from it and ``x``).
    ``channels_last``: ``x``, the staged input and ``y`` are channels last, and so are the messages' boxes."""
    nd = len(plan.axes)
    lead = math.prod(x.shape[:-nd])
    staged_shape = plan.staged_shape(index)
    stride, dilation = _stride_dilation(plan)
    cl = channels_last
    send = halo_pack(x, plan, index, channels_last=cl)
    recv = x.new_empty(recv_numel(plan, index, lead))
    sends, recvs = forward_messages(plan, index, world_of, lead, send, recv)
    if implicit:
        # No staged copy: the implicit-GEMM loader reads x, the receive buffer and the padding directly.
        from distfuse.kernels.conv_implicit import conv_implicit

        exchange(sends, recvs, op=_OP)
        return conv_implicit(x, recv, weight, bias, plan, index, stride, dilation), (recv if keep else None)
    if overlap:
        works = _post(sends, recvs)
        staged = halo_stage(x, recv, plan, index, region="local", channels_last=cl)
        _wait(works)
        halo_stage(x, recv, plan, index, out=staged, region="remote", channels_last=cl)
    else:
        exchange(sends, recvs, op=_OP)
        staged = halo_stage(x, recv, plan, index, channels_last=cl)
    if 0 in staged_shape:
        y = x.new_zeros((x.shape[0], weight.shape[0]) + plan.output_shape(index))
    else:
        y = _conv(nd, staged, weight, bias, stride, dilation, groups)
    # channels last in, channels last out, whatever the backend's choice (CPU conv3d returns NCDHW): what the
    # custom op's fake promises; the layers then give the format torch.nn's convolution gives
    y = y.contiguous(memory_format=layout_format(nd, cl))
    # Kept only for the weight gradient: the conv's own activation, the memory the unfused HaloExchange + conv keeps.
    return y, (staged if keep else None)


def _stage_conv_adjoint(grad_y, x, kept, weight, plan: HaloPlan, index: tuple[int, ...], world_of: Callable,
                        groups: int, overlap: bool, implicit: bool, has_bias: bool, x_shape,
                        needs: Sequence[bool], channels_last: bool = False) -> tuple:
    """The backward: ``(dx, dw, db)`` where ``needs`` asks for them (None elsewhere).  ``x`` (implicit path
    only) and ``kept`` are what :func:`_stage_conv` kept; ``channels_last`` as there (``dx`` is channels last)."""
    nd = len(plan.axes)
    cl = channels_last
    fmt = layout_format(nd, cl)
    staged_full_shape = tuple(x_shape[:2]) + plan.staged_shape(index)
    staged = kept
    if implicit:
        staged = halo_stage(x, kept, plan, index) if kept is not None and 0 not in staged_full_shape else None
    stride, dilation = _stride_dilation(plan)
    need_x, need_w, need_b = needs[0], needs[1], needs[2] and has_bias
    grad_y = grad_y.contiguous(memory_format=fmt)
    empty = 0 in staged_full_shape
    bias_sizes = [weight.shape[0]] if has_bias else None

    def conv_backward(want_x: bool, want_w: bool, want_b: bool):
        if empty:
            gs = grad_y.new_zeros(staged_full_shape).contiguous(memory_format=fmt) if want_x else None
            gw = torch.zeros_like(weight) if want_w else None
            gb = grad_y.new_zeros(weight.shape[0]) if want_b else None
            return gs, gw, gb
        # dgrad reads only the input's shape (and its layout): a zero-stride expand allocates nothing (as
        # torch.nn.grad does); in channels last an unread stand-in in that layout, so that dgrad writes it directly
        # (the expand would give an NCHW gradient and a copy of the same size)
        if staged is not None:
            inp = staged
        elif cl:
            inp = empty_in(staged_full_shape, fmt, dtype=grad_y.dtype, device=grad_y.device)
        else:
            inp = grad_y.new_empty(1).expand(staged_full_shape)
        gs, gw, gb = torch.ops.aten.convolution_backward(grad_y, inp, weight, bias_sizes, stride, [0] * nd, dilation,
                                                         False, [0] * nd, groups, [want_x, want_w, want_b])
        if gw is not None and gw.stride() != weight.stride():
            # channels-last operands give a channels-last dw; the op's fake (and the flat views of the packed
            # parameter gradients) expect the weight's strides
            gw = torch.empty_like(weight).copy_(gw)
        return gs, gw, gb

    if not need_x:
        # No input gradient, no backward exchange: every worker of the grid sees the same requires_grad on x
        # (the layers agree on it; their anchor stands in for a block that does not require grad).
        _, gw, gb = conv_backward(False, need_w, need_b)
        return None, gw, gb
    lead = math.prod(staged_full_shape[:-nd])
    incoming = grad_y.new_empty(send_numel(plan, index, lead))
    if overlap:
        gs, _, _ = conv_backward(True, False, False)
        gs = gs.contiguous(memory_format=fmt)
        send_back = halo_unstage(gs, plan, index, region="remote", channels_last=cl).send
        works = _post(*backward_messages(plan, index, world_of, lead, send_back, incoming))
        part = halo_unstage(gs, plan, index, region="local", channels_last=cl)
        _, gw, gb = conv_backward(False, need_w, need_b) if (need_w or need_b) else (None, None, None)
        _wait(works)
    else:
        gs, gw, gb = conv_backward(True, need_w, need_b)
        part = halo_unstage(gs.contiguous(memory_format=fmt), plan, index, channels_last=cl)
        exchange(*backward_messages(plan, index, world_of, lead, part.send, incoming), op=_OP + " (adjoint)")
    return halo_accumulate(part.grad_x, part.self_boxes, incoming, plan, index, channels_last=cl), gw, gb


class HaloConvFunction(torch.autograd.Function):
    """The eager path of the fused halo convolution (arguments checked by the callers): :func:`_stage_conv` and
    :func:`_stage_conv_adjoint`, the implementations ``distfuse::halo_conv`` runs too.  ``anchor`` (optional):
    an empty tensor whose ``requires_grad`` makes the input gradient's exchange run (a block that does not
    require grad while its peers' do)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: HaloPlan, index: tuple[int, ...], world_of: Callable, groups: int,
                overlap: bool, implicit: bool, anchor=None, channels_last: bool = False):
        y, kept = _stage_conv(x, weight, bias, plan, index, world_of, groups, overlap, implicit,
                              keep=ctx.needs_input_grad[1], channels_last=channels_last)
        ctx.args = (plan, index, world_of, groups, overlap, implicit, bias is not None, tuple(x.shape))
        ctx.channels_last = channels_last
        ctx.save_for_backward(x if implicit and kept is not None else None, kept, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, kept, weight = ctx.saved_tensors
        n = ctx.needs_input_grad
        grads = _stage_conv_adjoint(grad_y, x, kept, weight, *ctx.args, needs=(n[0] or n[9], n[1], n[2]),
                                    channels_last=ctx.channels_last)  # n[9]: the anchor
        return grads + (None,) * 8


# ---------------------------------------------------------------- the fused path as a custom op
#
#     distfuse::halo_conv(x, weight, bias, handle, G, groups, overlap, implicit, keep, anchor, channels_last)
#                                                                                              -> (y, kept)
#     distfuse::halo_conv_backward(dy, x, kept, weight, handle, G, groups, overlap, implicit, has_bias, x_shape,
#                                  needs, channels_last)                                       -> (dx, dw, db)
#
# ``handle`` names the layer's HaloExchange; the backward op has no gradient of its own (first order only, as the
# eager path).  ``keep`` (see _stage_conv) is decided when the graph is traced.  With ``channels_last`` the
# outputs' strides are channels last (y, the kept staged input, dx), in the fakes as in the real ops.


def _context(handle: int, global_shape):
    halo = lookup(handle)
    return halo.plan(tuple(global_shape)), tuple(halo.P_x.index[halo.P_x.dim - halo.nd:]), halo.world_of_fn()


@torch.library.custom_op("distfuse::halo_conv", mutates_args=())
def _halo_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
                  global_shape: list[int], groups: int, overlap: bool, implicit: bool, keep: bool,
                  anchor: torch.Tensor | None = None,
                  channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y, kept = _stage_conv(x, weight, bias, *_context(handle, global_shape), groups, overlap, implicit, keep,
                          channels_last)
    return y, (kept if kept is not None else x.new_empty(0))


@_halo_conv_op.register_fake
def _(x, weight, bias, handle, global_shape, groups, overlap, implicit, keep, anchor=None, channels_last=False):
    plan, index, _ = _context(handle, global_shape)
    nd = len(plan.axes)
    fmt = layout_format(nd, channels_last)
    y = empty_in((x.shape[0], weight.shape[0]) + plan.output_shape(index), fmt, dtype=x.dtype, device=x.device)
    if not keep:
        return y, x.new_empty(0)
    if implicit:
        return y, x.new_empty(recv_numel(plan, index, math.prod(x.shape[:-len(plan.axes)])))
    return y, empty_in(tuple(x.shape[:2]) + plan.staged_shape(index), fmt, dtype=x.dtype, device=x.device)


@torch.library.custom_op("distfuse::halo_conv_backward", mutates_args=())
def _halo_conv_backward_op(grad_y: torch.Tensor, x: torch.Tensor, kept: torch.Tensor, weight: torch.Tensor,
                           handle: int, global_shape: list[int], groups: int, overlap: bool, implicit: bool,
                           has_bias: bool, x_shape: list[int], needs: list[bool],
                           channels_last: bool = False) -> list[torch.Tensor]:
    plan, index, world_of = _context(handle, global_shape)
    grads = _stage_conv_adjoint(grad_y, x if x.numel() else None, kept if kept.numel() else None, weight, plan, index,
                                world_of, groups, overlap, implicit, has_bias, x_shape, needs, channels_last)
    return [g if g is not None else grad_y.new_empty(0) for g in grads]


@_halo_conv_backward_op.register_fake
def _(grad_y, x, kept, weight, handle, global_shape, groups, overlap, implicit, has_bias, x_shape, needs,
      channels_last=False):
    nd = len(x_shape) - 2
    fmt = layout_format(nd, channels_last)
    return [empty_in(tuple(x_shape), fmt, dtype=grad_y.dtype, device=grad_y.device) if needs[0]
            else grad_y.new_empty(0),
            torch.empty_like(weight) if needs[1] else grad_y.new_empty(0),
            weight.new_empty(weight.shape[0]) if needs[2] and has_bias else grad_y.new_empty(0)]


def _setup(ctx, inputs, output):
    x, weight, bias, handle, global_shape, groups, overlap, implicit, keep = inputs[:9]
    ctx.args = (handle, list(global_shape), groups, overlap, implicit, bias is not None, list(x.shape))
    ctx.channels_last = bool(inputs[10]) if len(inputs) > 10 else False
    ctx.save_for_backward(x if implicit and keep else x.new_empty(0), output[1], weight)


def _backward(ctx, grad_y, _grad_kept):
    x, kept, weight = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [bool(n[0] or (len(n) > 9 and n[9])), bool(n[1]), bool(n[2])]  # n[9]: the anchor
    dx, dw, db = _halo_conv_backward_op(grad_y, x, kept, weight, *ctx.args, needs, ctx.channels_last)
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + (None,) * (len(n) - 3)


_halo_conv_op.register_autograd(_backward, setup_context=_setup)
ordered(_halo_conv_op, _halo_conv_backward_op)


def fused_halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo, global_shape,
                    groups: int, op: str, implicit: bool, anchor: torch.Tensor | None = None,
                    channels_last: bool = False) -> torch.Tensor:
    """The fused halo convolution of a layer's block in every mode: ``distfuse::halo_conv`` while compiling, else
    :class:`HaloConvFunction` (the same implementations; no custom-op dispatch cost).

    ``halo`` is the layer's :class:`~distfuse.primitives.halo_exchange.HaloExchange` (its plan
    for ``global_shape`` is the convolution's), ``op`` the layer named in the refusal of a
    second-order backward, ``implicit`` the implicit-GEMM forward (the layer reads
    ``DISTFUSE_HALO_CONV`` in eager calls), ``anchor`` as in the op pairs.  ``channels_last``: the
    format every worker of the grid agreed on (the messages' boxes follow it); the block is made
    contiguous in it (a no-op for a block already dense in it), and ``y`` is channels last.
    """
    x = x.contiguous(memory_format=layout_format(x.dim() - 2, channels_last))
    overlap = x.is_cuda
    if torch.compiler.is_compiling():
        keep = weight.requires_grad and torch.is_grad_enabled()
        return _halo_conv_op(x, weight, bias, halo.handle, [int(n) for n in global_shape], groups, overlap, implicit,
                             keep, anchor, channels_last)[0]
    plan, index, world_of = _context(halo.handle, global_shape)
    y = HaloConvFunction.apply(x, weight, bias, plan, index, world_of, groups, overlap, implicit, anchor,
                               channels_last)
    return first_order_only(y, op, "the fused halo convolution (the unfused path, DISTFUSE_PATH=unfused, computes "
                                   "them exactly)")


def implicit_requested() -> bool:
    """Whether ``DISTFUSE_HALO_CONV=implicit`` asks the fused path for the implicit-GEMM forward."""
    return os.environ.get("DISTFUSE_HALO_CONV", "staged").strip().lower() == "implicit"


def _as_tuple(op: str, v, nd: int, name: str) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * nd
    v = tuple(int(e) for e in v)
    if len(v) != nd:
        raise expect(op, f"{name} entries (one per spatial axis)", nd, len(v), cls=UnsupportedError)
    return v


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: HaloPlan,
              index: Sequence[int], world_of: Callable[[tuple[int, ...]], int], stride=None, dilation=None,
              groups: int = 1, overlap: bool | None = None, implicit: bool | None = None,
              channels_last: bool | None = None) -> torch.Tensor:
    """This worker's block of ``ConvNd(padding, padding_mode)`` over a spatially partitioned ``x``.

    Args:
        x: ``[B, C, *n]`` this worker's block of the global input, ``n = plan.input_shape(index)``.
        weight, bias: ``[Co, C/groups, *k]`` and ``[Co]`` (or None), the same on every worker.
        plan: the :class:`HaloPlan` of the global input (its kernel, stride, dilation,
            padding and padding mode define the convolution).
        index: this worker's spatial block index.
        world_of: maps a spatial block index to a world rank (``HaloExchange.world_of_fn()``).
        stride, dilation: optional; must equal the plan's (they are read from it).
        groups: as torch.
        overlap: stage the local pieces while the halos are in flight; default: on CUDA.
        implicit: convolve with the implicit-GEMM kernel (``kernels/conv_implicit.py``),
            which reads the block, the received halos and the padding directly (no staged
            copy in forward; backward re-stages once for the weight gradient).  groups=1
            and fp32/fp16/bf16 only.  Default: :func:`implicit_requested`.  Opt-in because
            it has not been timed against cuDNN on a GPU yet.
        channels_last: ``x`` (2 or 3 spatial axes) is channels last, and so are the staged input,
            ``y``, the input gradient and the halo messages' boxes (``[B, *box, C]``), so every
            worker of the grid must pass the same value.  Each staged row is then ``L_last * C``
            contiguous elements from a multiple of C: the staging moves 16-byte vectors at any
            halo width, and cuDNN convolves in its native NHWC layout.  None: from ``x``'s
            strides (:func:`~distfuse.kernels.halo.is_channels_last`); the layers pass the
            format their workers agreed on.

    Returns ``[B, Co, *plan.output_shape(index)]`` (empty on a worker with no outputs).
    Must be called by every worker of the spatial grid, outputs or not: it exchanges
    halos forward and halo gradients backward in one round each.  fp32, fp16, bf16 and
    fp64; 1, 2 or 3 spatial axes.
    """
    index = tuple(int(i) for i in index)
    nd = len(plan.axes)
    if nd not in (1, 2, 3):
        raise UnsupportedError(f"{where(_OP)}: 1, 2 or 3 spatial axes are supported, the plan has {nd}")
    if x.dim() != nd + 2:
        raise expect(_OP, "input dimensions [B, C, *spatial]", nd + 2, x.dim())
    if len(index) != nd or any(not 0 <= i < p for i, p in zip(index, plan.grid, strict=True)):
        raise expect(_OP, f"spatial block index in the grid {plan.grid}", f"{nd} indices in range", index)
    if tuple(x.shape[2:]) != plan.input_shape(index):
        raise expect(_OP, f"local spatial shape of block {index}", plan.input_shape(index), tuple(x.shape[2:]))
    kernel = tuple(ax.kernel for ax in plan.axes)
    if weight.dim() != nd + 2 or tuple(weight.shape[2:]) != kernel:
        raise expect(_OP, "weight shape [Co, C/groups, *kernel]", f"[*, *, {', '.join(map(str, kernel))}]",
                     tuple(weight.shape))
    if groups < 1 or x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        raise expect(_OP, "channels (C == weight.shape[1] * groups, Co % groups == 0)",
                     f"C={weight.shape[1] * groups}, groups={groups}", f"C={x.shape[1]}, Co={weight.shape[0]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise expect(_OP, "bias shape", (weight.shape[0],), tuple(bias.shape))
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise expect(_OP, f"{name} dtype/device (x's)", (x.dtype, x.device), (t.dtype, t.device), cls=ShapeError)
    plan_stride, plan_dilation = map(tuple, _stride_dilation(plan))
    for name, given, want in (("stride", stride, plan_stride), ("dilation", dilation, plan_dilation)):
        if given is not None and _as_tuple(_OP, given, nd, name) != want:
            raise expect(_OP, f"{name} (the plan's)", want, _as_tuple(_OP, given, nd, name))
    if overlap is None:
        overlap = x.is_cuda
    if implicit is None:
        implicit = implicit_requested()
    if channels_last is None:
        channels_last = is_channels_last(x, nd)
    elif channels_last and nd not in CHANNELS_LAST:
        raise UnsupportedError(f"{where(_OP)}: channels last needs 2 or 3 spatial axes, the plan has {nd}")
    check_implicit(implicit, groups, x.dtype, bool(channels_last))
    return HaloConvFunction.apply(x.contiguous(memory_format=layout_format(nd, bool(channels_last))), weight, bias,
                                  plan, index, world_of, groups, bool(overlap), bool(implicit), None,
                                  bool(channels_last))


def check_implicit(implicit: bool, groups: int, dtype: torch.dtype, channels_last: bool = False) -> None:
    """Refuse what the implicit-GEMM convolution does not support (:class:`UnsupportedError`)."""
    if implicit and (groups != 1 or dtype not in (torch.float32, torch.float16, torch.bfloat16) or channels_last):
        raise UnsupportedError(f"{where(_OP)}: the implicit-GEMM convolution supports groups=1, fp32/fp16/bf16 and "
                               f"NCHW blocks, got groups={groups}, dtype={dtype}, "
                               f"{'channels last' if channels_last else 'NCHW'}; use the staged path "
                               "(DISTFUSE_HALO_CONV=staged)")
