"""Distributed layer normalisation over trailing (feature) dimensions that may be split.

Partitions and shapes (``k = len(normalized_shape)`` trailing dimensions are normalised;
any axis of ``P_x`` may be split)::

    P_x            [P_1, ..., P_lead, P_f1, ..., P_fk]
    x, y           [*lead_b, *feat_b]         balanced blocks of the global [*lead, *normalized_shape]
    weight, bias   [*feat_b]                  this worker's block of normalized_shape, split like the
                                              features and replicated over the leading axes
    P_stats        the workers that split the normalised dims (the last k axes): they share rows
    P_rep          the leading axes: the workers holding a copy of the same weight block

    forward   per row (n_i, mean_i, M2_i)  ->  all-gather over P_stats  ->  Chan combine (exact)
              y = xhat * w + b
    adjoint   [sum_f g, sum_f g * xhat] per row  ->  all-reduce over P_stats   (g = dy * w)
              dw, db: sums over the local rows  ->  all-reduce over P_rep

Why this layout: a tensor-parallel model splits the hidden dimension, and the weight must
follow the features it scales; splitting it the same way keeps every multiply local.
The leading axes (tokens, batch) hold copies, and their gradient all-reduce is the one
message a data-parallel split would need anyway.

Numerics follow ``torch.nn.LayerNorm``: biased variance, ``elementwise_affine`` and
``bias=False``, 16-bit inputs normalised in fp32 and rounded once (parameters in the
input's dtype or in fp32).  Statistics are exact under uneven splits and empty blocks.

The workers agree on each call under the agreement protocol
(``_norm_compiled.agree_call``): while every worker's call repeats, one flag round over
``P_x`` (a one-element host all-reduce) and no metadata gather; when some worker's call
changed, the metadata gather over ``P_x`` and its checks, so a bad input raises the same
error on every worker (inside ``torch.compile``: the last eager call's record and the same
flag round, ``_norm_compiled.py``).  Every worker of ``P_x`` must call backward when one
does.  Workers outside ``P_x`` pass and get back a zero-volume tensor.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from distfuse.errors import PartitionError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._norm_common import (
    check_param_dtype,
    gather_call,
    global_shape_of,
    numel,
    one_dtype,
    promote,
    subgrid,
)
from distfuse.layers._norm_compiled import NormCall, NormSites, agree_call, compiled_call, moments, normalize, replica
from distfuse.layers._params import ParamLayout
from distfuse.partition import CartesianPartition
from distfuse.primitives._common import check_inactive_input

__all__ = ["DistributedLayerNorm"]


class DistributedLayerNorm(BlockIdentityMixin, nn.Module):
    """``torch.nn.LayerNorm`` over an input whose normalised dimensions may be split (see the module docstring).

    Args:
        P_x: CartesianPartition with one dimension per input dimension.
        normalized_shape, eps, elementwise_affine, bias, device, dtype: as ``torch.nn.LayerNorm``.

    Construction is collective over the world (it creates the sub-grids).  Workers outside
    ``P_x`` hold no parameters (None there).
    """

    def __init__(self, P_x, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        op = type(self).__name__
        if not isinstance(P_x, CartesianPartition):
            raise PartitionError(f"{where(op)}: P_x must be a CartesianPartition, got {type(P_x).__name__}")
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        k = len(self.normalized_shape)
        if k < 1 or min(self.normalized_shape) < 1:
            raise expect(op, "normalized_shape", "one or more positive extents", self.normalized_shape)
        if P_x.dim < k:
            raise expect(op, f"dimensions of P_x (at least the {k} normalised ones)", f">= {k}", P_x.dim,
                         PartitionError)
        self.P_x = P_x
        self.eps, self.elementwise_affine = float(eps), bool(elementwise_affine)
        self._has_bias = self.elementwise_affine and bool(bias)
        self._feat_axes = tuple(range(P_x.dim - k, P_x.dim))
        self.P_stats = subgrid(P_x, self._feat_axes)
        self.P_rep = subgrid(P_x, range(P_x.dim - k))
        self._sites = NormSites(op, P_x, self.P_stats, self.P_rep)  # the agreement and the compiled op contexts
        kw = dict(device=torch.device(device) if device is not None else P_x.device, dtype=dtype)
        block = None
        if P_x.active:
            block = local_shape(self.normalized_shape, P_x.shape[-k:], P_x.index[-k:])
        make = P_x.active and self.elementwise_affine
        self.register_parameter("weight", nn.Parameter(torch.ones(block, **kw)) if make else None)
        make = P_x.active and self._has_bias
        self.register_parameter("bias", nn.Parameter(torch.zeros(block, **kw)) if make else None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def param_layouts(self) -> list[ParamLayout]:
        lays = []
        if self.elementwise_affine:
            lays.append(ParamLayout("weight", "weight", self.P_x, self.normalized_shape, split_dims=self._feat_axes))
        if self._has_bias:
            lays.append(ParamLayout("bias", "bias", self.P_x, self.normalized_shape, split_dims=self._feat_axes))
        return lays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op = type(self).__name__
        P_x = self.P_x
        if not P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]
        k = len(self.normalized_shape)
        if torch.compiler.is_compiling():  # the agreed record, a flag round (distfuse/layers/_norm_compiled.py)
            record, changed = compiled_call(self, x, params, self.training, x_needed=lambda c: c.any_input_grad,
                                            params_needed=lambda c: c.any_param_grad)
            if changed:  # the flag round raises on every worker when the graph runs
                return x.new_empty((0,))
            dtype, call = record.dtype, record.call
        else:
            dtype, call = self._agree(op, x, params)
        x = promote(x, call.any_input_grad)  # the adjoint all-reduces over P_stats: every worker must run it
        rows = numel(x.shape[:-k])
        x3 = x.reshape(1, rows, numel(x.shape[-k:]))
        stats = moments(self._sites.stats, x3, numel(self.normalized_shape))
        y = normalize(self._sites.stats, x3, stats, self.eps).view(x.shape)
        w = replica(self._sites.rep, self.weight, call.any_param_grad)
        b = replica(self._sites.rep, self.bias, call.any_param_grad)
        if w is not None:
            y = y * w.to(y.dtype)
        if b is not None:
            y = y + b.to(y.dtype)
        return y.to(dtype)

    def _agree(self, op: str, x: torch.Tensor, params):
        """The eager call's agreed ``(dtype, call record)``: a flag round while every worker's call repeats, else
        the metadata gather and its checks (raising alike on every worker)."""
        P_x = self.P_x

        def gather_and_check() -> NormCall:
            call = gather_call(op, P_x, [x, *params], ["input"] + ["parameter"] * len(params), params,
                               signature=self._signature())
            dtype = one_dtype(op, P_x, call.dtypes[0])
            G = global_shape_of(op, P_x, call.shapes[0])
            k = len(self.normalized_shape)
            if G[-k:] != self.normalized_shape:
                raise expect(op, f"trailing global input dimensions (normalized_shape; global input {list(G)})",
                             list(self.normalized_shape), list(G[-k:]))
            for dtypes in call.dtypes[1:]:  # every worker's parameters: every worker raises alike
                for p_dtype in dtypes:
                    check_param_dtype(op, dtype, p_dtype)
            return NormCall(G, dtype, call)

        record = agree_call(self._sites, P_x, x, params, self.training, gather_and_check)
        return record.dtype, record.call

    def _signature(self):
        return (type(self).__name__, self.normalized_shape, self.eps, self.elementwise_affine, self._has_bias,
                self.P_x.ranks, self.P_x.shape)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, {self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self._has_bias}")
