"""Distributed batch normalisation: exact global statistics over a batch- and space-split input.

Partitions and shapes (``nd`` spatial axes; any axis of ``P_x`` may be split, the
channel axis too)::

    P_x              [P_b, P_c, P_1, ..., P_nd]
    x, y             [N_b, C_b, *n_s]          balanced blocks of the global [N, C, *n]
    weight, bias     [C_b]                     replicated on every worker with channel block C_b
    running_mean/var [C_b], num_batches_tracked []   replicated the same way
    P_stats          the workers that share this worker's channel block (every axis but 1)

    train     (n_i, mean_i, M2_i) per channel  ->  all-gather over P_stats  ->  Chan combine
              y = (x - mean) / sqrt(var + eps) * w + b           var biased, as torch
              running_mean = m * mean + (1 - m) * running_mean    running_var with the unbiased var
    adjoint   [sum dy, sum dy * xhat] per channel  ->  all-reduce over P_stats
              db = sum dy,  dw = sum dy * xhat,  dx = w * invstd * (dy - db/n - xhat * dw/n)
    eval      y = batch_norm(x, running stats) locally; dw, db all-reduced over P_stats

Why the parameters are replicated rather than kept on one root and broadcast: the exact
adjoint already all-reduces ``sum dy`` and ``sum dy * xhat``, which *are* the global bias
and weight gradients, so every replica gets the global gradient with no further message
and an optimizer keeps the replicas equal.  A root-held weight would add a broadcast
forward and a sum-reduce backward to every layer.  The running statistics are computed
from the same combined statistics on every worker, so they are bitwise identical.

Numerics follow ``torch.nn.BatchNormNd`` (which is also ``SyncBatchNorm``'s): the
biased variance normalises, the unbiased one (``n / (n - 1)``) enters ``running_var``,
``momentum=None`` is the cumulative average ``1 / num_batches_tracked``, ``affine`` /
``bias`` / ``track_running_stats`` and eval mode behave as torch's, and 16-bit inputs are
normalised in fp32 and rounded once (parameters in the input's dtype or in fp32).
Statistics are exact under uneven splits and empty blocks (see ``_norm_common``).

The workers agree on each call (shapes, dtypes, grad flags, training mode) under the
agreement protocol (``_norm_compiled.agree_call``): while every worker's call repeats, one
flag round over ``P_x`` (a one-element host all-reduce, before any data moves) and no
metadata gather; when some worker's call changed, every worker gathers the metadata over
``P_x`` and checks it, so a bad input (or workers in different modes) raises the same
error on every worker and a new global shape agrees afresh.  Training adds one all-gather
of ``3 x C_b`` float64 per worker.  Every worker of ``P_x`` must call backward when one does.
Inside ``torch.compile`` a call reuses the record of the last eager call and runs its
communication as custom ops, with the same flag round (``_norm_compiled.py``); running
statistics update in the graph, bitwise as in eager mode.
Workers outside ``P_x`` pass and get back a zero-volume tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._norm_common import (
    check_norm_partition,
    check_param_dtype,
    gather_call,
    global_shape_of,
    numel,
    one_dtype,
    one_mode,
    promote,
    subgrid,
)
from distfuse.layers._norm_compiled import NormCall, NormSites, agree_call, compiled_call, moments, normalize, replica
from distfuse.layers._params import ParamLayout
from distfuse.primitives._common import check_inactive_input

__all__ = ["DistributedBatchNormBase", "DistributedBatchNorm", "DistributedBatchNorm1d", "DistributedBatchNorm2d",
           "DistributedBatchNorm3d"]


class DistributedBatchNormBase(BlockIdentityMixin, nn.Module):
    """Batch normalisation of an input split over ``P_x`` (see the module docstring).

    Args:
        P_x: CartesianPartition with one dimension per input dimension.
        num_features, eps, momentum, affine, track_running_stats, device, dtype, bias: as
            ``torch.nn.BatchNormNd``.  ``device`` defaults to ``P_x.device``.

    Construction is collective over the world (it creates the statistics sub-grid).
    Workers outside ``P_x`` hold no parameters or buffers (they are None there).
    """

    dims: tuple[int, ...] = ()

    def __init__(self, P_x, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, bias: bool = True):
        super().__init__()
        op = type(self).__name__
        check_norm_partition(op, P_x, self.dims)
        if int(num_features) < 1:
            raise expect(op, "num_features", ">= 1", num_features)
        self.P_x = P_x
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self._has_bias = self.affine and bool(bias)
        self._has_buffers = self.track_running_stats
        self.P_stats = subgrid(P_x, [d for d in range(P_x.dim) if d != 1])
        self._sites = NormSites(op, P_x, self.P_stats)  # the agreement and the compiled forward's op contexts
        device = torch.device(device) if device is not None else P_x.device
        kw = dict(device=device, dtype=dtype)
        block = local_shape((self.num_features,), (P_x.shape[1],), (P_x.index[1],)) if P_x.active else None
        active = P_x.active
        self.register_parameter("weight", nn.Parameter(torch.empty(block, **kw)) if active and self.affine else None)
        self.register_parameter("bias", nn.Parameter(torch.empty(block, **kw)) if active and self._has_bias else None)
        if active and self._has_buffers:
            self.register_buffer("running_mean", torch.zeros(block, **kw))
            self.register_buffer("running_var", torch.ones(block, **kw))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.running_mean is not None:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """torch's initialisation: weight 1, bias 0, running statistics reset."""
        self.reset_running_stats()
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def param_layouts(self) -> list[ParamLayout]:
        C, P = (self.num_features,), self.P_x
        lays = []
        if self.affine:
            lays.append(ParamLayout("weight", "weight", P, C, split_dims=(1,)))
        if self._has_bias:
            lays.append(ParamLayout("bias", "bias", P, C, split_dims=(1,)))
        if self._has_buffers:
            lays += [ParamLayout("running_mean", "running_mean", P, C, split_dims=(1,)),
                     ParamLayout("running_var", "running_var", P, C, split_dims=(1,)),
                     ParamLayout("num_batches_tracked", "num_batches_tracked", P, (), split_dims=())]
        return lays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op = type(self).__name__
        P_x = self.P_x
        if not P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        params = [p for p in (self.weight, self.bias) if p is not None]
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if torch.compiler.is_compiling():  # the agreed record, a flag round (distfuse/layers/_norm_compiled.py)
            record, changed = compiled_call(
                self, x, params, self.training,
                x_needed=lambda c: bn_training and c.any_grad and not c.param_grad[P_x.rank],
                params_needed=lambda c: not bn_training and c.any_param_grad)
            if changed:  # the flag round raises on every worker when the graph runs
                return x.new_empty((0,))
            G, dtype, call = record.global_shape, record.dtype, record.call
        else:
            G, dtype, call = self._agree(op, x, params)
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average; a tensor in a graph (no host read), same bits
                nbt = self.num_batches_tracked
                factor = 1.0 / nbt.double() if torch.compiler.is_compiling() else 1.0 / float(nbt)
        if not bn_training:  # eval with running statistics: local, only the parameter gradients are summed
            w = replica(self._sites.stats, self.weight, call.any_param_grad)
            b = replica(self._sites.stats, self.bias, call.any_param_grad)
            return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)

        count = G[0] * numel(G[2:])
        # The adjoint all-reduces over P_stats, so every worker's output must require grad if any does.
        x = promote(x, call.any_grad and not call.param_grad[P_x.rank])
        x3 = x.reshape(x.shape[0], x.shape[1], numel(x.shape[2:]))
        stats = moments(self._sites.stats, x3, count)
        if self.training and self.track_running_stats and self.running_mean is not None and count > 0:
            self._update_running_stats(stats.mean, stats.unbiased_var(), factor)
        y = normalize(self._sites.stats, x3, stats, self.eps, self.weight, self.bias)
        return y.view(x.shape).to(dtype)

    def _agree(self, op: str, x: torch.Tensor, params):
        """The eager call's agreed ``(global shape, dtype, call record)``: a flag round while every worker's call
        repeats, else the metadata gather and its checks (raising alike on every worker)."""
        P_x = self.P_x

        def gather_and_check() -> NormCall:
            held = params + [b for b in (self.running_mean, self.running_var) if b is not None]
            call = gather_call(op, P_x, [x, *held], ["input"] + ["parameter or running statistic"] * len(held),
                               params, signature=self._signature(), mode=int(self.training))
            one_mode(op, P_x, call)
            dtype = one_dtype(op, P_x, call.dtypes[0])
            G = global_shape_of(op, P_x, call.shapes[0])
            if G[1] != self.num_features:
                raise expect(op, "input channels (the global input's dimension 1, num_features)", self.num_features,
                             G[1])
            for dtypes in call.dtypes[1:]:  # every worker's parameters and buffers: every worker raises alike
                for t_dtype in dtypes:
                    check_param_dtype(op, dtype, t_dtype)
            bn_training = self.training or (self.running_mean is None and self.running_var is None)
            if bn_training and G[0] * numel(G[2:]) == 1:
                raise ShapeError(f"{where(op)}: expected more than 1 value per channel when training, got the global "
                                 f"input size {list(G)} (torch's rule)")
            return NormCall(G, dtype, call)

        record = agree_call(self._sites, P_x, x, params, self.training, gather_and_check)
        return record.global_shape, record.dtype, record.call

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor, factor: float) -> None:
        """torch's update, in float64 and rounded once into the buffers (identical on every worker)."""
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean.double())
        self.running_var.copy_(factor * unbiased_var + (1 - factor) * self.running_var.double())

    def _signature(self):
        return (type(self).__name__, self.num_features, self.eps, self.momentum, self.affine,
                self.track_running_stats, self.training, self.P_x.ranks, self.P_x.shape)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, {self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self._has_bias}, track_running_stats={self.track_running_stats}")


class DistributedBatchNorm1d(DistributedBatchNormBase):
    """Distributed ``BatchNorm1d``: input ``[N, C]`` or ``[N, C, L]``, P_x of 2 or 3 dimensions."""

    dims = (2, 3)


class DistributedBatchNorm2d(DistributedBatchNormBase):
    """Distributed ``BatchNorm2d``: input ``[N, C, H, W]``, P_x ``[P_b, P_c, P_h, P_w]``."""

    dims = (4,)


class DistributedBatchNorm3d(DistributedBatchNormBase):
    """Distributed ``BatchNorm3d``: input ``[N, C, D, H, W]``, P_x ``[P_b, P_c, P_d, P_h, P_w]``."""

    dims = (5,)


class DistributedBatchNorm(DistributedBatchNormBase):
    """DistDL's dimension-agnostic name: input ``[N, C, *spatial]`` with 0 to 6 spatial axes, one P_x axis each."""

    dims = tuple(range(2, 9))
