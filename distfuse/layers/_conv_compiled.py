"""The feature conv's forward inside ``torch.compile``: custom ops, no metadata gather, no host read.

Eager calls agree on the call's metadata (the agreement protocol,
:mod:`distfuse.primitives._agreement`); a compiled call reuses the agreed record while its
signature repeats and moves data only through the custom ops of :mod:`distfuse.ops`
(``flagged_root_broadcast`` for the parameters, ``halo_exchange`` for the halo), so
``torch.compile(layer, fullgraph=True)`` traces one graph on every rank.  A call whose
signature differs still joins the parameter round with its flag set, and every worker
raises the op's error.  The fused halo conv is not a custom op yet: a compiled call runs
the unfused composition.

:class:`CompiledFeatureConvMixin` is a base of
:class:`~distfuse.layers.conv_feature.DistributedFeatureConvBase` and reads its state
(``opts``, ``agreement``, ``halo``, ``_root_bcast``, ``_placeholders``, ``_is_root``).
"""

from __future__ import annotations

import math

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.layers._conv_block import conv_block
from distfuse.layers._conv_call_info import cast_for_compute
from distfuse.layers._conv_common import check_geometry
from distfuse.ops import flagged_root_broadcast, halo_exchange
from distfuse.primitives._layout import memory_format_of

__all__ = ["CompiledFeatureConvMixin"]


class CompiledFeatureConvMixin:
    """The compiled forward of the feature conv (see the module docstring)."""

    def _placeholder(self, dtype, requires_grad: bool) -> torch.Tensor:
        """The ``anchor`` of ``flagged_root_broadcast``: an empty leaf that requires grad when the parameters'
        gradients are wanted, made in eager code (a leaf that requires grad created in a graph breaks it)."""
        key = (dtype, requires_grad)
        if key not in self._placeholders:
            self._placeholders[key] = torch.empty(0, dtype=dtype, device=self.P_x.device).requires_grad_(requires_grad)
        return self._placeholders[key]

    def _compiled_params(self, op: str, x: torch.Tensor, params, param_dtype=None):
        """Inside a compiled region: the agreed record and the parameters, through ``flagged_root_broadcast``.

        The metadata gather cannot run in a graph; the agreement it produced in the last
        eager call is reused while this call's signature repeats (the compiler guards on
        the shapes, dtypes and grad flags, so a change retraces and lands here with
        ``changed``).  A changed call still joins the round with its flag set, so every
        worker raises the op's error instead of waiting.  ``param_dtype`` overrides the
        agreed parameter dtype (the transposed conv moves its parameters in the input's).
        """
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
        dtype = param_dtype or info.param_dtype or info.dtype
        if self._is_root:
            parts = [self.weight.reshape(-1)] + ([self.bias.reshape(-1)] if o.bias else [])
            flat = torch.cat([p if p.dtype == dtype else p.to(dtype) for p in parts])
        else:  # an empty view of the input, never a graph constant (see distfuse/ops/root_broadcast.py)
            flat = x.detach().reshape(-1)[:0].to(dtype)
        packed = flagged_root_broadcast(flat, self._placeholder(dtype, info.param_grad), self._root_bcast.handle,
                                        changed, n)
        return info, packed, n_w, n, changed

    def _compiled_forward(self, op: str, x: torch.Tensor, params) -> torch.Tensor:
        """The unfused forward as custom ops and traceable torch code (no metadata gather, no host read)."""
        o = self.opts
        info, packed, n_w, n, changed = self._compiled_params(op, x, params)
        if changed:  # the round above raises on every worker at run time; nothing after it runs
            return packed[:0]
        w, b = packed[:n_w].view(o.weight_shape), (packed[n_w:n] if o.bias else None)
        G = info.global_shape
        check_geometry(op, o, G)
        compute = info.compute_dtype or info.dtype
        x, w, b = cast_for_compute(x, compute), cast_for_compute(w, compute), cast_for_compute(b, compute)
        plan = self.halo.plan(G)
        index = self.P_x.index[2:]
        self.last_path = "unfused"
        staged = halo_exchange(x, self.halo.handle, list(G))
        return conv_block(o, staged, w, b, (x.shape[0], o.out_channels) + plan.output_shape(index),
                          memory_format_of(x))
