"""Distributed group, instance and layer normalisation: per-sample (per-row) statistics, replicated affine.

Group and instance norms (``nd`` spatial axes)::

    P_x            [P_b, P_c, P_1, ..., P_nd]     GroupNorm needs P_c = 1 (groups would straddle channel blocks)
    x, y           [N_b, C_b, *n_s]               balanced blocks of the global [N, C, *n]
    weight, bias   [C_b]                          replicated on every worker with channel block C_b
    P_stats        the spatial workers of this sample block (axes 2..): they hold the same samples
    P_rep          every axis but the channel axis: the workers holding a copy of weight and bias

    GroupNorm      statistic per (sample, group) over C/G channels x every spatial element
    InstanceNorm   statistic per (sample, channel) over every spatial element
    forward        (n_i, mean_i, M2_i)  ->  all-gather over P_stats  ->  Chan combine (exact)
                   y = xhat * w[c] + b[c]
    adjoint        [sum g, sum g * xhat] per statistic  ->  all-reduce over P_stats   (g = dy * w)
                   dw, db: local sums  ->  all-reduce over P_rep

Weight and bias are replicated (see ``norm_batch``); their gradients need an all-reduce of
their own, because the statistics are per sample while the weight is shared by every sample.
``InstanceNormNd(track_running_stats=True)`` keeps torch's per-channel running statistics,
the batch average of the per-sample mean and unbiased variance (one more all-reduce over
the batch workers); ``momentum=None`` means no update.  Only batched input.

Layer norm: statistics per row over the ``k = len(normalized_shape)`` trailing dimensions,
which may be split like any other axis::

    P_x            [P_1, ..., P_lead, P_f1, ..., P_fk]
    x, y           [*lead_b, *feat_b]         balanced blocks of the global [*lead, *normalized_shape]
    weight, bias   [*feat_b]                  this worker's block of normalized_shape, split like the
                                              features and replicated over the leading axes
    P_stats        the workers that split the normalised dims (the last k axes): they share rows
    P_rep          the leading axes: the workers holding a copy of the same weight block

    forward, adjoint   as above, one statistic per row; dw, db: sums over the local rows -> all-reduce over P_rep

Why this layout: a tensor-parallel model splits the hidden dimension, and the weight must
follow the features it scales; splitting it the same way keeps every multiply local, and
the copies' gradient all-reduce is the one message a data-parallel split needs anyway.
Numerics are torch's (see ``norm_batch``; parameters in the input's dtype or in fp32).
"""

from __future__ import annotations

import numbers
import warnings

import torch
import torch.nn.functional as F

from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._conv_common import check_cartesian, spatial_classes
from distfuse.layers._norm_common import NormLayer, affine, check_norm_partition, numel, subgrid
from distfuse.primitives._layout import memory_format_of
from distfuse.primitives.all_sum_reduce import replicated_sum

__all__ = ["DistributedGroupNorm", "DistributedInstanceNormBase", "DistributedInstanceNorm1d",
           "DistributedInstanceNorm2d", "DistributedInstanceNorm3d", "DistributedLayerNorm"]


class _ChannelNormBase(NormLayer):
    """Shared set-up: per-channel weight and bias replicated over P_rep, the P_stats / P_rep sub-grids."""

    def _setup(self, P_x, num_channels: int, affine: bool, bias: bool, running: bool, device, dtype) -> None:
        self._channels = int(num_channels)
        block = local_shape((self._channels,), (P_x.shape[1],), (P_x.index[1],)) if P_x.active else None
        self._norm_setup(P_x, (self._channels,), (1,), block, affine=affine, bias=bias, running=running,
                         P_stats=subgrid(P_x, range(2, P_x.dim)),
                         P_rep=subgrid(P_x, [d for d in range(P_x.dim) if d != 1]),
                         P_batch=subgrid(P_x, (0,)) if running else None, device=device, dtype=dtype)

    def _signature(self):
        return (type(self).__name__, self._channels, self.eps, self.affine, self.P_x.ranks, self.P_x.shape)


class DistributedGroupNorm(_ChannelNormBase):
    """``torch.nn.GroupNorm`` over an input split along batch and spatial axes (see the module docstring): ``P_x``
    is a CartesianPartition ``[P_b, 1, P_1, ..., P_nd]`` (any number of spatial axes, none included)."""

    def __init__(self, P_x, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
                 dtype=None, *, bias: bool = True):
        super().__init__()
        op = type(self).__name__
        check_norm_partition(op, P_x, range(2, 9))
        if P_x.shape[1] != 1:
            raise PartitionError(f"{where(op)}: groups span channel blocks, so P_x must not split the channels "
                                 f"(shape [P_b, 1, ...]); got {list(P_x.shape)}")
        if num_groups < 1 or num_channels % num_groups != 0:
            raise ShapeError(f"{where(op)}: num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups}) (torch's rule)")
        self.num_groups, self.num_channels, self.eps = int(num_groups), int(num_channels), float(eps)
        self._setup(P_x, num_channels, affine, bias, False, device, dtype)

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        G, call = record.global_shape, record.call
        groups, per_group = self.num_groups, G[1] // self.num_groups
        # torch's GroupNorm returns channels_last (_3d) for such an input; its [N, *s, C] memory viewed as
        # [N, s, groups, per_group] has one statistic per (sample, group): no copy, in or out.
        channels_last = memory_format_of(x) != torch.contiguous_format
        if channels_last:
            xl = x.movedim(1, -1)
            x3 = xl.view(x.shape[0], numel(x.shape[2:]), groups, per_group)
        else:
            x3 = x.reshape(1, x.shape[0] * groups, per_group * numel(x.shape[2:]))
        y = self._normalize(x3, self._moments(x3, per_group * numel(G[2:])))
        y = y.view(xl.shape).movedim(-1, 1) if channels_last else y.view(x.shape)
        return affine(y, *self._replicas(call), (1, -1) + (1,) * (y.dim() - 2)).to(record.dtype)

    def _check_global(self, G) -> None:
        op = type(self).__name__
        if self.affine and G[1] != self.num_channels:
            raise expect(op, "input channels (the global input's dimension 1, num_channels)", self.num_channels, G[1])
        if G[1] % self.num_groups:
            raise ShapeError(f"{where(op)}: the input's {G[1]} channels are not divisible by num_groups "
                             f"({self.num_groups}) (torch's rule)")

    def _signature(self):
        return super()._signature() + (self.num_groups,)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, {self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, bias={self._has_bias}")


class DistributedInstanceNormBase(_ChannelNormBase):
    """``torch.nn.InstanceNormNd`` over an input split along any axes of ``P_x [P_b, P_c, P_1, ..., P_nd]`` (see
    the module docstring); the other arguments as torch's (``affine`` and ``track_running_stats`` default to False).
    """

    nd: int = 0

    def __init__(self, P_x, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device=None, dtype=None, *, bias: bool = True):
        super().__init__()
        self._features(P_x, (self.nd + 2,), num_features, eps, momentum, track_running_stats)
        self._setup(P_x, num_features, affine, bias, self.track_running_stats, device, dtype)

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        G, call = record.global_shape, record.call
        w, b = self._replicas(call)
        if not self._input_stats():  # running statistics per channel: the same local op as an eval batch norm
            return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
        x3 = x.reshape(1, x.shape[0] * x.shape[1], numel(x.shape[2:]))
        stats = self._moments(x3, numel(G[2:]))
        if self.running_mean is not None and G[0] > 0:  # torch's: the batch average of the per-sample statistics
            sums = torch.stack([stats.mean, stats.unbiased_var()]).view(2, *x.shape[:2]).sum(1)
            if self._batch.P.size > 1:  # over the batch workers (no autograd: the statistics have no gradient)
                sums = replicated_sum(sums, self._batch.handle)
            self._blend_running(*(sums / G[0]), 0.0 if self.momentum is None else float(self.momentum))
        y = self._normalize(x3, stats).view(x.shape)
        return affine(y, w, b, (1, -1) + (1,) * (y.dim() - 2)).to(record.dtype)

    def _input_stats(self) -> bool:
        return self.training or not self.track_running_stats

    def _promotions(self, call) -> tuple[bool, bool]:
        return self._input_stats() and any(call.input_grad), any(call.param_grad)  # eval: no statistics' adjoint

    def _mode_matters(self) -> bool:
        return self.track_running_stats  # training: statistics of the input and their all-reduce; eval: local

    def _check_global(self, G) -> None:
        op = type(self).__name__
        if G[1] != self.num_features:
            if self.affine or self.running_mean is not None:
                raise expect(op, "input channels (the global input's dimension 1, num_features)", self.num_features,
                             G[1])
            warnings.warn(f"{op}: the input's {G[1]} channels do not match num_features ({self.num_features}), "
                          "which is unused because affine=False (as torch warns)", stacklevel=6)
        if self._input_stats() and numel(G[2:]) <= 1:
            raise ShapeError(f"{where(op)}: expected more than 1 spatial element when training, got the global input "
                             f"size {list(G)} (torch's rule)")

    def _signature(self):
        return super()._signature() + (self.momentum, self.track_running_stats, self.training)


DistributedInstanceNorm1d, DistributedInstanceNorm2d, DistributedInstanceNorm3d = spatial_classes(
    DistributedInstanceNormBase, "DistributedInstanceNorm",
    "Distributed ``InstanceNorm{nd}d``: P_x ``[P_b, P_c, {s}]``, one dimension per input dimension.")


class DistributedLayerNorm(NormLayer):
    """``torch.nn.LayerNorm`` over an input whose normalised dimensions may be split (see the module docstring):
    ``P_x`` has one dimension per input dimension; the other arguments as torch's."""

    def __init__(self, P_x, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        op = type(self).__name__
        check_cartesian(op, P_x)
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        k = len(self.normalized_shape)
        if k < 1 or min(self.normalized_shape) < 1:
            raise expect(op, "normalized_shape", "one or more positive extents", self.normalized_shape)
        if P_x.dim < k:
            raise expect(op, f"dimensions of P_x (at least the {k} normalised ones)", f">= {k}", P_x.dim,
                         PartitionError)
        self.eps = float(eps)
        feat_axes = tuple(range(P_x.dim - k, P_x.dim))
        block = local_shape(self.normalized_shape, P_x.shape[-k:], P_x.index[-k:]) if P_x.active else None
        self._norm_setup(P_x, self.normalized_shape, feat_axes, block, affine=elementwise_affine, bias=bias,
                         running=False, P_stats=subgrid(P_x, feat_axes), P_rep=subgrid(P_x, range(P_x.dim - k)),
                         device=device, dtype=dtype)
        self.elementwise_affine = self.affine
        self.P_rep = self._rep.P

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        k = len(self.normalized_shape)
        x3 = x.reshape(1, numel(x.shape[:-k]), numel(x.shape[-k:]))
        y = self._normalize(x3, self._moments(x3, numel(self.normalized_shape))).view(x.shape)
        return affine(y, *self._replicas(record.call), y.shape[-k:]).to(record.dtype)

    def _check_global(self, G) -> None:
        k = len(self.normalized_shape)
        if G[-k:] != self.normalized_shape:
            raise expect(type(self).__name__, f"trailing global input dimensions (normalized_shape; global input "
                         f"{list(G)})", list(self.normalized_shape), list(G[-k:]))

    def _signature(self):
        return (type(self).__name__, self.normalized_shape, self.eps, self.elementwise_affine, self._has_bias,
                self.P_x.ranks, self.P_x.shape)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, {self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self._has_bias}")
