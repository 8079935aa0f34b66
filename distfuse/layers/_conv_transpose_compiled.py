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

import torch

from distfuse.layers._conv_compiled import CompiledFeatureConvMixin
from distfuse.ops import halo_exchange

__all__ = ["CompiledConvTransposeMixin"]


class CompiledConvTransposeMixin:
    """The compiled forward of the transposed convolution (see the module docstring)."""

    _placeholder = CompiledFeatureConvMixin._placeholder
    _compiled_params = CompiledFeatureConvMixin._compiled_params

    def _compiled_forward(self, op: str, x: torch.Tensor, params) -> torch.Tensor:
        """Parameters through ``flagged_root_broadcast``, the halo through ``halo_exchange``, then the local block."""
        o = self.opts
        # parameters travel in the input dtype, as in eager (_agreed_info)
        state = self.agreement.state
        info, packed, n_w, n, changed = self._compiled_params(op, x, params,
                                                              param_dtype=None if state is None else state.dtype)
        if changed:  # the round above raises on every worker at run time; nothing after it runs
            return packed[:0]
        w, b = packed[:n_w].view(o.weight_shape), (packed[n_w:n] if o.bias else None)
        G = info.global_shape
        pads, out_spatial = self._windows[G]
        staged = halo_exchange(x, self._window_halo.handle, list(G))
        return self._local_block(staged, w, b, pads, (x.shape[0], o.out_channels) + out_spatial)
