"""The channel and general convolutions' forward inside ``torch.compile``: custom ops, no metadata, no host read.

Eager calls agree on the call's metadata over the union of P_x, P_w and P_y
(:func:`~distfuse.layers._conv_call_info.agreed_call_info`: the global shape, the dtypes,
the grad flags, the memory format).  A compiled call reuses that record while this
worker's signature repeats, and moves data only through custom ops, in the eager
layer's order::

    distfuse::flag_check(x, h_flag, changed)          every worker's flag over P_x + P_w + P_y (one host
                                                      all-reduce) before any data moves; raises everywhere
                                                      if any worker's call changed
    staged = distfuse::conv_halo(x, h_halo, G)        general conv only (the channel conv sends x unpadded):
                                                      the halo round on P_x, a no-op elsewhere
    xb = distfuse::block_broadcast(staged, ...)       P_x -> P_w, along the output-channel dimension
    w  = distfuse::block_broadcast(W_ij0, ...)        spatial block 0 -> every s (general conv only)
    b  = distfuse::block_broadcast(b_i00, ...)        (i, 0, 0) -> (i, 0, s) (general conv only)
    yp = convNd(xb, w, b where j == 0)                the channel conv pads xb locally first
    y  = distfuse::block_sum_reduce(yp, ...)          P_w -> P_y, summed over the input-channel blocks

The workers that hold no input (P_w- and P_y-only) take the extents from the record, so
the graph holds no metadata exchange and no host read.  A changed call (the compiler
guards on the shapes, dtypes, grad flags and the record, so it retraces) joins the flag
round with its flag set, and every worker raises the same
:class:`~distfuse.errors.ShapeError`; one eager call then agrees afresh.  A compiled call
before any eager call is refused on every worker with
:class:`~distfuse.errors.UnsupportedError` (the record is missing on all of them alike).

Every worker traces the same distfuse ops in the same order: identity moves (unsplit
spatial axes leave the parameters where they are; ``P_co = 1`` with P_x on P_w's ranks
leaves the input) are identities on every worker alike, and a worker that takes no part
in a move still calls its op, which then sends nothing.

Gradients: an ``anchor`` that requires grad where the eager layer promotes its
placeholders (the input's halo round and broadcast when some worker's input requires
grad, the sum-reduce when anything does, the parameter moves when some parameter does),
so every worker runs the adjoints its peers wait for, also a worker whose own input or
parameters do not require grad.  The parameter moves' outputs that a worker does not use
(it takes no part in them) are tied to the sum-reduce (``ties``), so their adjoints run
there too, sending nothing, and every worker's backward graph holds the same ops.

:class:`CompiledGeneralConvMixin` is a base of
:class:`~distfuse.layers.conv_general.DistributedGeneralConvBase` and reads its state
(``opts``, ``agreement``, ``halo``, the plans and sub-grids of ``_build_grids``).
"""

from __future__ import annotations

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.decomposition import block_extent, local_shape
from distfuse.layers._conv_block import conv_block, conv_output_format
from distfuse.layers._conv_call_info import call_signature, cast_for_compute, passes_local_checks
from distfuse.ops.collectives import GRAD_ANCHOR, NO_ANCHOR, PackedBroadcast
from distfuse.ops.conv_blocks import block_broadcast, block_sum_reduce, conv_halo
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.primitives._layout import format_code

__all__ = ["CompiledGeneralConvMixin"]


class CompiledGeneralConvMixin:
    """The compiled forward of the channel and general convolutions (see the module docstring)."""

    #: Whether P_x stages its block with a halo exchange before the broadcast (the channel conv pads after it).
    _stages_with_halo = True

    def _build_compiled_contexts(self) -> None:
        """The objects the custom ops name by handle, made at construction (collective, so every rank's handles
        are the same numbers)."""
        op = type(self).__name__
        self._flag_ctx = FlagRound(op, self.P_union, self.forget_agreement)
        self._x_ctx = PackedBroadcast(self._x_plan, op)
        self._w_ctx = PackedBroadcast(self._w_plan, op)
        self._b_ctx = PackedBroadcast(self._b_plan, op)
        self._y_ctx = PackedBroadcast(self._y_plan, op)

    def _compiled_changed(self, x: torch.Tensor, params) -> bool:
        """This worker's flag: its call differs from the agreed one (a constant of the traced graph)."""
        return call_signature(x, params) != self.agreement.signature or not passes_local_checks(self.P_x, x)

    def _compiled_forward(self, x: torch.Tensor, params) -> torch.Tensor:
        """The eager forward as custom ops and traceable torch code, on a worker of the union."""
        op = type(self).__name__
        info = self.agreement.state
        if info is None:
            raise UnsupportedError(f"{where(op)}: a compiled call needs the metadata the layer agrees on in eager "
                                   "mode: call the layer once eagerly (every worker, same shapes and grad settings) "
                                   "before the compiled region")
        changed = self._compiled_changed(x, params)
        flag_check(x, self._flag_ctx.handle, changed)
        empty = x.detach().reshape(-1)[:0]  # a placeholder that is no graph constant
        if changed:  # the round above raises on every worker at run time; nothing after it runs
            return empty
        o, P_x, P_w = self.opts, self.P_x, self.P_w
        G = info.global_shape
        dtype = info.compute_dtype or info.dtype
        param_dtype = info.param_dtype or dtype
        grad_on = torch.is_grad_enabled()
        needs_any = info.input_grad or info.param_grad
        x_anchor = GRAD_ANCHOR if grad_on and info.input_grad else NO_ANCHOR
        y_anchor = GRAD_ANCHOR if grad_on and needs_any else NO_ANCHOR
        p_anchor = GRAD_ANCHOR if grad_on and info.param_grad else NO_ANCHOR
        plan = self.halo.plan(G)
        fmt_in = info.memory_format
        fmt_out = conv_output_format(P_x.device, dtype, fmt_in, o.nd)
        self.last_path = "unfused"

        # the input: staged on P_x, broadcast to the weight workers
        xs = cast_for_compute(x, dtype) if P_x.active else empty.to(dtype)
        if self._stages_with_halo:  # every worker calls it (same ops everywhere); it sends nothing off P_x
            xs = conv_halo(xs, x_anchor, self.halo.handle, list(G))
        xb_shape = [0]
        if P_w.active:
            i, j, s = P_w.index[0], P_w.index[1], P_w.index[2:]
            xb_shape = [G[0], block_extent(o.in_channels, P_w.shape[1], j), *self._broadcast_spatial(plan, s)]
        if self._x_plan.identity:
            xb = xs
        else:
            xb = block_broadcast(xs, x_anchor, self._x_ctx.handle, xb_shape, format_code(fmt_in))

        # the parameters where the eager layer moves them, in their own dtype, cast where they are used
        ties = []  # moves this worker takes no part in: their (zero-volume) outputs, tied to the sum-reduce
        w = self._compiled_weight(empty, param_dtype, p_anchor, ties)
        b = self._compiled_bias(empty, param_dtype, p_anchor, ties)
        w, b = cast_for_compute(w, dtype), cast_for_compute(b, dtype)

        if P_w.active:
            co_i = block_extent(o.out_channels, P_w.shape[0], i)
            yp = conv_block(o, self._local_input(xb), w, b, (G[0], co_i) + plan.output_shape(s), fmt_in)
        else:
            yp = xb  # zero-volume; on a P_x worker it carries the adjoint of the broadcast
        out_shape = [0]
        if self._P_yv.active:
            i_y, s_y = self._P_yv.index[0], self._P_yv.index[2:]
            out_shape = [G[0], block_extent(o.out_channels, P_w.shape[0], i_y), *plan.output_shape(s_y)]
        y = block_sum_reduce(yp, y_anchor, self._y_ctx.handle, out_shape, format_code(fmt_out), ties)
        return y if self._P_yv.active else y.view(G[0], 0)  # eager's zero-volume [batch, 0] off P_y

    def _compiled_weight(self, empty: torch.Tensor, dtype, anchor, ties: list) -> torch.Tensor | None:
        """This P_w worker's weight block (None off P_w), moved from spatial block 0 as the eager layer does."""
        if self._w_plan.identity:
            return self.weight
        t = self.weight if self.weight is not None else empty.to(dtype)
        shape = [0]
        if self.P_w.active:
            i, j = self.P_w.index[:2]
            shape = list(local_shape(self.opts.weight_shape, self._P_wr.shape, (i, j) + (0,) * self.nd))
        w = block_broadcast(t, anchor, self._w_ctx.handle, shape, 0)
        if self.P_w.active:
            return w
        ties.append(w)
        return None

    def _compiled_bias(self, empty: torch.Tensor, dtype, anchor, ties: list) -> torch.Tensor | None:
        """The bias block on P_w workers (i, 0, s), None elsewhere and without bias."""
        if not self.opts.bias:
            return None
        if self._b_plan.identity:
            return self.bias
        lead = (1,) * (self.P_w.dim - 1)
        t = self.bias.view(-1, *lead) if self.bias is not None else empty.to(dtype)
        shape = [0]
        if self._P_bd.active:
            shape = [block_extent(self.opts.out_channels, self.P_w.shape[0], self._P_bd.index[0]), *lead]
        b = block_broadcast(t, anchor, self._b_ctx.handle, shape, 0)
        if self._P_bd.active:
            return b.view(-1)
        ties.append(b)
        return None
