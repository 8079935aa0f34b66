"""Feature-distributed convolution: the input is split along batch and spatial axes only.

Partitions and shapes (``nd`` spatial axes, worker at index ``(b, 0, *s)`` of ``P_x``)::

    P_x     [P_b, 1, P_1, ..., P_nd]        P_y = P_x (implicit)
    x       [B_b, C_in, *n_s]               balanced block of the global input
    weight  [C_out, C_in/groups, *k]        on the first worker of P_x only, with the bias [C_out]
    y       [B_b, C_out, *m_s]              balanced block of the sequential output (m = global output extent)

    forward   w, b   = Broadcast(root -> P_x)(weight, bias)          one packed message per worker
              staged = HaloExchange(x)                                exactly the input y_s reads
              y      = convNd(staged, w, b, padding=0, stride, dilation, groups)
    adjoint   dstaged, dw_s, db_s = convNd adjoints                    on every worker
              dx     = HaloExchange*(dstaged)                         halo gradients go home
              dweight, dbias = SumReduce(P_x -> root)(dw_s, db_s)     the Broadcast's adjoint

Why this shape: the output is decomposed by the balanced decomposition of the *output*
shape (what :class:`HaloExchange`'s plan stages for), so with stride, dilation, even
kernels and uneven splits every worker's block is exactly its slice of the sequential
output, and the boundary padding (all four modes) is applied with global semantics.
DistDL instead pads by halo widths that ignore stride and dilation, and its circular
padding wraps each worker's block onto itself.

Weight and bias travel in one message (packed) because a broadcast is latency bound at
convolution weight sizes.  Before it, every worker sends the root one element, its
agreement flag (below), and the root appends the flags' sum to the packed parameters:
two point-to-point rounds that carry a flag from every worker to every worker.

Dispatch: each call asks ``select_path("halo_conv", {channels: in_channels}, ...)``; on
"fused" the staging and the exchanges run in :func:`distfuse.fused.halo_conv.halo_conv`
(Triton, one pass over the block) instead of :class:`HaloExchange` + ``convNd``.  The two
paths send the same messages, so the choice changes no result beyond rounding.
``last_path`` records the path of the last call and :meth:`explain` says why.

Workers whose output block is empty (an extent smaller than the partition, or a
stride that leaves them no outputs) return an empty ``[B_b, C_out, *m_s]`` tensor and
still take part in both exchanges, because other workers read their input.  Workers
outside ``P_x`` pass and get back a zero-volume tensor.

Agreement at no steady-state cost.  Workers holding no input of the global shape, and
workers whose neighbours' blocks changed, must learn the global shape and the grad
flags: that takes a host-side metadata gather over ``P_x``
(:func:`~distfuse.layers._conv_call_info.gather_call_info`).  It runs only on the first
call and when some worker's signature (local shape, dtype, device, grad mode, the
input's and the parameters' requires_grad and dtype, autocast) changed: every worker
sends the root a flag, 1 when its own signature changed, the root forwards their sum with
the parameters, and every worker reads it (:mod:`~distfuse.primitives._agreement`).  A change on every
worker, or on some (an extent of 7 becoming 8 over two workers leaves one block as it
was), costs the gather, and a disagreement raises the same error on every worker; while
signatures repeat nothing but the flag moves.  Measured on the 2-core CI machine (4
ranks, ``bench/bench_conv_layers.py``): see ``docs/reliability.md``.  ``static_shapes``
is accepted for compatibility and changes nothing.

Memory format: a ``channels_last`` block is staged and convolved in ``channels_last``
without a copy, so the output is ``channels_last`` wherever torch's convolution keeps it.
The fused kernels index NCHW blocks, so such an input takes the unfused path (the
reason is in ``last_decision``).

Higher-order gradients: the unfused path is differentiable to any order (the halo
exchange's and the broadcast's backwards are autograd Functions themselves), so a
gradient penalty matches ``torch.nn.ConvNd``.  The fused path refuses a backward with
``create_graph=True`` with :class:`~distfuse.errors.UnsupportedError` on every worker,
before any of its messages.

Every worker of ``P_x`` must call backward when one does.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import PartitionError, UnsupportedError, expect, where
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._conv_block import conv_block
from distfuse.layers._conv_call_info import _DTYPES, CallInfo, autocast_dtype, cast_for_compute, gather_call_info
from distfuse.layers._conv_common import ConvOptions, check_geometry, check_partition, draw_parameters, grid_of, promote
from distfuse.layers._conv_compiled import CompiledFeatureConvMixin
from distfuse.layers._params import ParamLayout
from distfuse.layers.dispatch import Decision, device_caps, select_path
from distfuse.ops import RootBroadcast
from distfuse.partition import zero_volume_tensor
from distfuse.primitives._agreement import AgreementSite, run_agreed, trusting
from distfuse.primitives._common import check_inactive_input, exchange, first_order_only
from distfuse.primitives._flag_transport import any_flag_on_host, flags_on_host
from distfuse.primitives._layout import memory_format_of
from distfuse.primitives.broadcast import broadcast, broadcast_plan
from distfuse.primitives.halo_exchange import HaloExchange

__all__ = ["DistributedFeatureConvBase", "DistributedFeatureConv1d", "DistributedFeatureConv2d",
           "DistributedFeatureConv3d"]


@functools.cache
def _fused_op():
    """The fused halo convolution, or None when it cannot be imported (imported lazily: it loads Triton)."""
    try:
        from distfuse.fused.halo_conv import halo_conv
    except ImportError:
        return None
    return halo_conv


class DistributedFeatureConvBase(BlockIdentityMixin, CompiledFeatureConvMixin, nn.Module):
    """Convolution over an input split along batch and spatial axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, 1, P_1, ..., P_nd]``.
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
        bias, padding_mode, device, dtype: as ``torch.nn.ConvNd``; ``padding`` may
        also hold ``(lo, hi)`` pairs.  ``device`` defaults to ``P_x.device``.
        static_shapes: accepted for compatibility; changes nothing (every call skips the
            metadata gather while the workers' signatures repeat, see the module docstring).

    Construction is collective over the world (it creates the root's partitions) and
    draws the parameters like the sequential layer on every rank (see
    :meth:`reset_parameters`).  ``weight`` and ``bias`` are None except on the root
    (``P_x``'s first worker).

    Attributes:
        last_path: ``"fused"`` or ``"unfused"``, the path of the last call (None before
            the first call and on workers outside P_x, which do nothing).
        last_decision: the :class:`~distfuse.layers.dispatch.Decision` behind it.
    """

    nd: int = 0

    def __init__(self, P_x, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None,
                 static_shapes: bool = False):
        super().__init__()
        self.static_shapes = bool(static_shapes)
        self._static_info: tuple | None = None  # (this worker's call key, the CallInfo gathered for it)
        op = type(self).__name__
        check_partition(op, "P_x", P_x, self.nd)
        if P_x.shape[1] != 1:
            raise PartitionError(f"{where(op)}: the feature-distributed convolution needs P_x unsplit along channels "
                                 f"(shape [P_b, 1, ...]), got {list(P_x.shape)}; pass P_y and P_w to "
                                 "DistributedConv{1,2,3}d for a channel or general distributed convolution")
        self.P_x = P_x
        self.opts = ConvOptions.make(op, self.nd, in_channels, out_channels, kernel_size, stride, padding, dilation,
                                     groups, bias, padding_mode)
        o = self.opts
        self.in_channels, self.out_channels, self.groups = o.in_channels, o.out_channels, o.groups
        self.kernel_size, self.stride, self.dilation = o.kernel_size, o.stride, o.dilation
        self.padding, self.padding_mode = o.padding, o.padding_mode
        self.halo = HaloExchange(P_x, o.kernel_size, o.stride, o.padding, o.dilation, o.padding_mode, _op=op)
        self._device = torch.device(device) if device is not None else P_x.device
        self.root = P_x.ranks[0]
        # The root's single-worker grids: one per parameter rank (ParamLayout splits dimension d by dimension d).
        self._P_root = grid_of([self.root], [1] * P_x.dim, P_x.device)
        self._P_root_1d = grid_of([self.root], [1], P_x.device)
        self._param_plan = broadcast_plan(self._P_root, P_x)
        self._is_root = dist.get_rank() == self.root
        if self._is_root:
            self.weight = nn.Parameter(torch.empty(o.weight_shape, device=self._device, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(o.out_channels, device=self._device, dtype=dtype)) if o.bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self._dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._caps_cache: dict = {}
        self.agreement = AgreementSite(op)
        # the parameter round as a custom op, for compiled forwards (see _compiled_forward)
        self._root_bcast = RootBroadcast(op, self._param_plan, self.root, P_x.ranks, P_x.dim, self.forget_agreement,
                                         partition=P_x)
        self._placeholders: dict = {}
        self.reset_parameters()

    # ------------------------------------------------------------ parameters

    def reset_parameters(self) -> None:
        """Draw the global parameters as ``torch.nn.ConvNd`` does, on every rank; the root keeps them.

        Every rank draws (and discards) the same numbers so that the ranks' generators
        stay in step; with the same seed the root's parameters equal the sequential layer's.
        """
        dtype = self.weight.dtype if self.weight is not None else self._dtype
        w, b = draw_parameters(self.opts, dtype, self._device)
        if self._is_root:
            with torch.no_grad():
                self.weight.copy_(w)
                if self.bias is not None:
                    self.bias.copy_(b)

    def param_layouts(self) -> list[ParamLayout]:
        out = [ParamLayout("weight", "weight", self._P_root, self.opts.weight_shape)]
        if self.opts.bias:
            out.append(ParamLayout("bias", "bias", self._P_root_1d, (self.opts.out_channels,)))
        return out

    def _replicate_flagged(self, op: str, info: CallInfo, flag: bool):
        """``(w, b, any flag)``: the root's weight and bias on every worker, with every worker's agreement flag.

        Two point-to-point rounds: every other worker sends its flag (one element) to the
        root, then the root broadcasts its packed parameters with the flags' sum appended
        (cast to the agreed ``info.param_dtype``, which differs from theirs only in a call it
        flagged).  The adjoint is the broadcast's: the gradients summed onto the root (the
        flag element's gradient is dropped).  Receivers' placeholders require grad when
        ``info.param_grad``, so every worker runs that adjoint.  ``w`` and ``b`` are None
        when some worker flagged.

        Why not one all-reduce (which carries flags from everyone to everyone in one call):
        gloo's all-reduce took 3.7 ms against 0.34 ms for the two rounds on the loaded 2-core
        CI machine (4 ranks, 2.3k floats, medians of 200), and it would replace one round.

        On a CUDA partition the flags take the host round of
        :mod:`~distfuse.primitives._flag_transport` instead (a device read of the received
        flag would synchronise the device every call): the broadcast then carries a zero
        in the flag's slot, which nobody reads.
        """
        o = self.opts
        n_w = math.prod(o.weight_shape)
        n = n_w + (o.out_channels if o.bias else 0)
        dtype = info.param_dtype or info.dtype
        device = self.P_x.device
        on_host = flags_on_host(device)
        if on_host and any_flag_on_host(self.P_x, flag, op):  # CUDA: the flags' round, no device read
            return None, None, True
        others = [w for w in self.P_x.ranks if w != self.root]
        mine = torch.full((1,), 0.0 if on_host or not flag else 1.0, dtype=dtype, device=device)
        if self._is_root:
            got = []
            if not on_host:
                got = [torch.empty(1, dtype=dtype, device=device) for _ in others]
                exchange([], list(zip(others, got, strict=True)), op=op)
            total = sum(got, mine)
            parts = [self.weight.reshape(-1)] + ([self.bias.reshape(-1)] if o.bias else [])
            flat = torch.cat([p if p.dtype == dtype else p.to(dtype) for p in parts] + [total])
            flat = promote(flat, info.param_grad).view((1,) * (self.P_x.dim - 1) + (n + 1,))
        else:
            if not on_host:
                exchange([(self.root, mine)], [], op=op)
            flat = zero_volume_tensor(dtype=dtype, device=device, requires_grad=info.param_grad)
        flat = broadcast(flat, self._param_plan, (1,) * (self.P_x.dim - 1) + (n + 1,), dtype).view(-1)
        if not on_host and bool(flat[n] != 0):  # a host read of the received flag: free for CPU tensors
            return None, None, True
        return flat[:n_w].view(o.weight_shape), (flat[n_w:n] if o.bias else None), False

    def _signature(self, x: torch.Tensor, params) -> tuple:
        return (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
                tuple((p.requires_grad, p.dtype) for p in params), autocast_dtype(self.P_x.device.type))

    def _agreed_call(self, op: str, x: torch.Tensor, params) -> tuple[CallInfo, torch.Tensor, torch.Tensor | None]:
        """The call's agreed :class:`CallInfo` and the replicated parameters (see the module docstring)."""
        P_x = self.P_x
        signature = self._signature(x, params)
        if trusting() and self.agreement.state is not None:  # capture-safe: no flag, no host read
            if signature != self.agreement.signature:
                raise UnsupportedError(f"{where(op)}: inside capture_safe() (or a CUDA-graph capture) a call must "
                                       "repeat the inputs of the last eager call (shape, dtype, grad flags); warm up "
                                       "with the captured shapes on every worker")
            info = self.agreement.state
            self.agreement.calls += 1
            w, b = self._replicated_params(info.param_dtype or info.dtype, P_x.device, info.param_grad)
            return info, w, b
        locally_ok = x.device.type == P_x.device.type and x.dtype in _DTYPES and x.dim() == P_x.dim

        def attempt(changed: bool):
            info = self.agreement.state
            w, b, flagged = self._replicate_flagged(op, info, changed)
            return (info, w, b), flagged

        def slow():
            info = gather_call_info(op, P_x, P_x, x, params, signature=(self.opts, P_x.ranks, P_x.shape))
            w, b, _ = self._replicate_flagged(op, info, False)
            return (info, w, b), info

        return run_agreed(self.agreement, signature, locally_ok, attempt, slow)

    def forget_agreement(self) -> None:
        """Drop the agreed call record, so the next call gathers metadata again (call it on every worker)."""
        self.agreement.forget()

    def _replicated_params(self, dtype, device, needs_grad: bool):
        """Weight and bias on every worker of P_x: one broadcast of the packed parameters from the root."""
        o = self.opts
        n_w = math.prod(o.weight_shape)
        n = n_w + (o.out_channels if o.bias else 0)
        shape = (1,) * (self.P_x.dim - 1) + (n,)
        if self._is_root:
            parts = [self.weight.reshape(-1)] + ([self.bias.reshape(-1)] if o.bias else [])
            flat = promote(torch.cat(parts) if len(parts) > 1 else parts[0], needs_grad).view(shape)
        else:
            flat = zero_volume_tensor(dtype=dtype, device=device, requires_grad=needs_grad)
        flat = broadcast(flat, self._param_plan, shape, dtype).view(-1)
        w = flat[:n_w].view(o.weight_shape)
        b = flat[n_w:] if o.bias else None
        return w, b

    # ------------------------------------------------------------ dispatch

    def explain(self, x: torch.Tensor) -> Decision:
        """Which path a call with ``x`` takes, and why (no communication)."""
        if _fused_op() is None:
            return Decision("unfused", "distfuse.fused.halo_conv is not available")
        decision = select_path("halo_conv", dict(channels=self.in_channels), x.dtype, self.P_x.size,
                               self._caps(x.device))
        fmt = memory_format_of(x)
        if decision.path == "fused" and fmt != torch.contiguous_format:
            # The fused kernels index NCHW blocks; the unfused staging keeps the input's layout without a copy.
            return Decision("unfused", f"the fused halo convolution needs NCHW blocks and the input is {fmt} "
                                       f"(the unfused path keeps it; fused would have been: {decision.reason})")
        return decision

    def _caps(self, device: torch.device):
        if device not in self._caps_cache:  # device_caps asks CUDA for the device name: once per device
            self._caps_cache[device] = device_caps(device)
        return self._caps_cache[device]

    # ------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op = type(self).__name__
        P_x, o = self.P_x, self.opts
        if not P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]
        if torch.compiler.is_compiling():
            return self._compiled_forward(op, x, params)
        info, w, b = self._agreed_call(op, x, params)
        self._placeholder(info.param_dtype or info.dtype, info.param_grad)  # eager-made, for compiled forwards
        G = info.global_shape
        if G[1] != o.in_channels:
            raise expect(op, "input channels (the global input's dimension 1)", o.in_channels, G[1])
        check_geometry(op, o, G)  # every worker holds G: geometry torch refuses is refused on every worker
        x = promote(x, info.input_grad)
        compute = info.compute_dtype or info.dtype
        x, w, b = cast_for_compute(x, compute), cast_for_compute(w, compute), cast_for_compute(b, compute)
        plan = self.halo.plan(G)
        index = P_x.index[2:]
        decision = self.explain(x)
        self.last_decision = decision
        if decision.path == "fused":
            self.last_path = "fused"
            with torch.autocast(x.device.type, enabled=False):  # x, w, b are in the compute dtype already
                y = _fused_op()(x, w, b, plan, index, self.halo.world_of_fn(), groups=o.groups)
            return first_order_only(y, op, "the fused halo convolution (the unfused path, DISTFUSE_PATH=unfused, "
                                           "computes them exactly)")
        self.last_path = "unfused"
        staged = self.halo(x, global_shape=G)
        return conv_block(o, staged, w, b, (x.shape[0], o.out_channels) + plan.output_shape(index),
                          memory_format_of(x))

    def _call_info(self, op: str, x: torch.Tensor, params) -> CallInfo:
        """The call's global shape and grad flags: gathered, or reused under ``static_shapes``.

        The per-call protocol of the layers that share this class's parameter handling
        (the transposed convolution); the feature convolution itself runs
        :meth:`_agreed_call`.

        With ``static_shapes`` a worker reuses the last gathered record while its own
        input shape, dtype, grad mode and grad flags repeat.  That is safe against silent
        errors: the global shape is the sum of the blocks, so if every worker's block
        repeats the global shape does too; and if only some workers' blocks change (a
        global extent that moves the split on one side only), those workers gather while
        the others exchange halos, and every worker fails with a CollectiveTimeoutError
        after the process-group timeout instead of computing with a stale plan.  Use it
        when global shapes (and which tensors require grad) only change together on every
        worker, e.g. fixed resolution with a varying batch; call :meth:`forget_shapes` on
        every worker after changing parameters' ``requires_grad``.
        """
        P_x = self.P_x
        key = (tuple(x.shape), x.dtype, torch.is_grad_enabled(), x.requires_grad,
               tuple(p.requires_grad for p in params))
        if self.static_shapes and self._static_info is not None and self._static_info[0] == key:
            return self._static_info[1]
        info = gather_call_info(op, P_x, P_x, x, params, signature=(self.opts, P_x.ranks, P_x.shape))
        if self.static_shapes:
            self._static_info = (key, info)
        return info

    def forget_shapes(self) -> None:
        """Drop the ``static_shapes`` record, so the next call gathers again (call it on every worker)."""
        self._static_info = None

    def extra_repr(self) -> str:
        o = self.opts
        return (f"P_x={list(self.P_x.shape)}, {o.in_channels}, {o.out_channels}, kernel_size={o.kernel_size}, "
                f"stride={o.stride}, padding={o.padding}, dilation={o.dilation}, groups={o.groups}, bias={o.bias}, "
                f"padding_mode={o.padding_mode!r}")


class DistributedFeatureConv1d(DistributedFeatureConvBase):
    """Feature-distributed ``Conv1d``: P_x ``[P_b, 1, P_w]``."""

    nd = 1


class DistributedFeatureConv2d(DistributedFeatureConvBase):
    """Feature-distributed ``Conv2d``: P_x ``[P_b, 1, P_h, P_w]``."""

    nd = 2


class DistributedFeatureConv3d(DistributedFeatureConvBase):
    """Feature-distributed ``Conv3d``: P_x ``[P_b, 1, P_d, P_h, P_w]``."""

    nd = 3
