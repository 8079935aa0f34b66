"""The transposed convolution's forward inside ``torch.compile``: custom ops, no metadata gather, no host read.

As for the feature convolution (:mod:`distfuse.layers._conv_compiled`): eager calls agree
on the call's metadata; a compiled call reuses the agreed record while its signature
repeats and moves data only through custom ops, in this order on every worker::

    packed = distfuse::flagged_root_broadcast(flat, anchor, handle, changed, n)   weight, bias and the flags
    staged = distfuse::halo_exchange(x, window handle, G)                         the transposed plan's inputs
    y      = conv_transpose_block(staged, w, b, pads)                            local, traceable torch code

The parameters travel in the input's dtype (what the local transposed convolution
needs, as in eager).  A call whose signature differs still joins the parameter round
with its flag set, and every worker raises the same
:class:`~distfuse.errors.ShapeError`; a compiled call before any eager call is refused
on every worker.  The halo op stages with the layer's own plan
(:class:`~distfuse.layers._pool_compiled.WindowHalo`), and the per-worker geometry
(crop/extend pads, output extents) is read from a record the eager call made, because a
traced walk over the plan would break the graph.

:class:`CompiledConvTransposeMixin` is a base of
:class:`~distfuse.layers.conv_transpose.DistributedConvTransposeBase` and reads its
state (``opts``, ``agreement``, ``_root_bcast``, ``_window_halo``, ``_windows``,
``_placeholders``, ``_is_root``) and calls its ``_local_block``.
"""

from __future__ import annotations

import math

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.layers._conv_compiled import CompiledFeatureConvMixin
from distfuse.ops import flagged_root_broadcast, halo_exchange

__all__ = ["CompiledConvTransposeMixin"]


class CompiledConvTransposeMixin:
    """The compiled forward of the transposed convolution (see the module docstring)."""

    _placeholder = CompiledFeatureConvMixin._placeholder

    def _compiled_forward(self, op: str, x: torch.Tensor, params) -> torch.Tensor:
        """Parameters through ``flagged_root_broadcast``, the halo through ``halo_exchange``, then the local block."""
        info = self.agreement.state
        if info is None:
            raise UnsupportedError(f"{where(op)}: a compiled call needs the metadata the layer agrees on in eager "
                                   "mode: call the layer once eagerly (every worker, same shapes and grad settings) "
                                   "before the compiled region")
        # A worker whose input does not require grad while a peer's does would skip the halo adjoint its peers
        # wait for (eager promotes its input; a compiled graph cannot): it flags, and every worker raises.
        changed = self._signature(x, params) != self.agreement.signature or (info.input_grad and not x.requires_grad)
        o = self.opts
        n_w = math.prod(o.weight_shape)
        n = n_w + (o.out_channels if o.bias else 0)
        dtype = info.dtype  # parameters travel in the input dtype, as in eager (_agreed_info)
        if self._is_root:
            parts = [self.weight.reshape(-1)] + ([self.bias.reshape(-1)] if o.bias else [])
            flat = torch.cat([p if p.dtype == dtype else p.to(dtype) for p in parts])
        else:  # an empty view of the input, never a graph constant (see distfuse/ops/root_broadcast.py)
            flat = x.detach().reshape(-1)[:0].to(dtype)
        packed = flagged_root_broadcast(flat, self._placeholder(dtype, info.param_grad), self._root_bcast.handle,
                                        changed, n)
        if changed:  # the round above raises on every worker at run time; nothing after it runs
            return packed[:0]
        w, b = packed[:n_w].view(o.weight_shape), (packed[n_w:n] if o.bias else None)
        G = info.global_shape
        pads, out_spatial = self._windows[G]
        staged = halo_exchange(x, self._window_halo.handle, list(G))
        return self._local_block(staged, w, b, pads, (x.shape[0], o.out_channels) + out_spatial)
