"""Distributed group, instance and layer normalisation: per-sample (per-row) statistics, replicated affine.

Group and instance norms: statistics per sample, summed over the spatial workers.

Partitions and shapes (``nd`` spatial axes)::

    P_x            [P_b, P_c, P_1, ..., P_nd]     GroupNorm needs P_c = 1
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

Weight and bias are replicated (see ``norm_batch``); here their gradients need their own
all-reduce, because the statistics are per sample while the weight is shared by every
sample.  ``InstanceNormNd(track_running_stats=True)`` keeps per-channel running statistics
as torch does: the batch average of the per-sample mean and unbiased variance (one more
all-reduce over the batch workers when the batch is split), ``momentum=None`` meaning no
update, as torch's ``instance_norm`` does.  Channels may be split for instance norm; a
group norm's groups would straddle channel blocks, so it refuses a channel split.

Numerics follow ``torch.nn.GroupNorm`` / ``InstanceNormNd``: biased variance, 16-bit inputs
normalised in fp32 and rounded once, torch's refusals (channels not divisible by groups,
an instance norm over one spatial element when training).  Only batched input: P_x has
one dimension per input dimension, batch first.

Layer norm: statistics per row over trailing (feature) dimensions that may be split
(``k = len(normalized_shape)`` trailing dimensions are normalised; any axis of ``P_x`` may be
split)::

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

The workers agree on each call through the layer's agreement session
(:class:`~distfuse.layers._norm_common.NormLayer`): while every worker's call repeats, one
flag round over ``P_x`` (a one-element host all-reduce) and no metadata gather; when some
worker's call changed, the metadata gather over ``P_x`` and its checks, so bad input (or,
for an instance norm with running statistics, workers in different modes) raises the same
error on every worker.  The same forward runs eagerly, inside ``capture_safe()`` and under
``torch.compile(fullgraph=True)``.  Every worker of ``P_x`` must call backward when one
does.  Workers outside ``P_x`` pass and get back a zero-volume tensor.
"""

from __future__ import annotations

import numbers
import warnings

import torch
import torch.nn.functional as F

from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._norm_common import NormLayer, check_norm_partition, numel, subgrid
from distfuse.partition import CartesianPartition
from distfuse.primitives._layout import memory_format_of

__all__ = ["DistributedGroupNorm", "DistributedInstanceNormBase", "DistributedInstanceNorm1d",
           "DistributedInstanceNorm2d", "DistributedInstanceNorm3d", "DistributedLayerNorm"]


def _affine(y: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``y * w[c] + b[c]`` for ``y [N, C, *s]`` in the compute dtype."""
    shape = (1, -1) + (1,) * (y.dim() - 2)
    if w is not None:
        y = y * w.to(y.dtype).view(shape)
    if b is not None:
        y = y + b.to(y.dtype).view(shape)
    return y


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
    """``torch.nn.GroupNorm`` over an input split along batch and spatial axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, 1, P_1, ..., P_nd]`` (any number of spatial axes, none included).
        num_groups, num_channels, eps, affine, device, dtype, bias: as ``torch.nn.GroupNorm``.

    Construction is collective over the world (it creates the sub-grids).
    """

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
        w = self._replica(self.weight, call.any_param_grad)
        b = self._replica(self.bias, call.any_param_grad)
        return _affine(y, w, b).to(record.dtype)

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
    """``torch.nn.InstanceNormNd`` over an input split along any axes (see the module docstring).

    Args:
        P_x: CartesianPartition ``[P_b, P_c, P_1, ..., P_nd]``.
        num_features, eps, momentum, affine, track_running_stats, device, dtype, bias: as
            ``torch.nn.InstanceNormNd`` (affine and track_running_stats default to False).

    Construction is collective over the world (it creates the sub-grids).
    """

    nd: int = 0

    def __init__(self, P_x, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device=None, dtype=None, *, bias: bool = True):
        super().__init__()
        op = type(self).__name__
        check_norm_partition(op, P_x, (self.nd + 2,))
        if int(num_features) < 1:
            raise expect(op, "num_features", ">= 1", num_features)
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.track_running_stats = bool(track_running_stats)
        self._setup(P_x, num_features, affine, bias, self.track_running_stats, device, dtype)

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        G, call = record.global_shape, record.call
        w = self._replica(self.weight, call.any_param_grad)
        b = self._replica(self.bias, call.any_param_grad)
        if not self._input_stats():  # running statistics per channel: the same local op as an eval batch norm
            return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
        x3 = x.reshape(1, x.shape[0] * x.shape[1], numel(x.shape[2:]))
        stats = self._moments(x3, numel(G[2:]))
        if self.running_mean is not None:
            momentum = 0.0 if self.momentum is None else float(self.momentum)
            self._update_running_stats(stats, x.shape[:2], G[0], momentum)
        y = self._normalize(x3, stats).view(x.shape)
        return _affine(y, w, b).to(record.dtype)

    def _input_stats(self) -> bool:
        return self.training or not self.track_running_stats

    def _promotions(self, call) -> tuple[bool, bool]:
        return self._input_stats() and call.any_input_grad, call.any_param_grad  # eval: no statistics' adjoint

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

    @torch.no_grad()
    def _update_running_stats(self, stats, local_nc, batch: int, momentum: float) -> None:
        """torch's update with the batch average of the per-sample statistics (summed over the batch workers)."""
        per_sample = torch.stack([stats.mean, stats.unbiased_var()]).view(2, *local_nc)
        sums = self._batch_sum(per_sample.sum(1))
        if batch == 0:
            return
        mean, var = sums / batch
        self.running_mean.copy_(momentum * mean + (1 - momentum) * self.running_mean.double())
        self.running_var.copy_(momentum * var + (1 - momentum) * self.running_var.double())

    def _signature(self):
        return super()._signature() + (self.momentum, self.track_running_stats, self.training)

    def extra_repr(self) -> str:
        return (f"P_x={list(self.P_x.shape)}, {self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self._has_bias}, track_running_stats={self.track_running_stats}")


class DistributedInstanceNorm1d(DistributedInstanceNormBase):
    """Distributed ``InstanceNorm1d``: input ``[N, C, L]``."""

    nd = 1


class DistributedInstanceNorm2d(DistributedInstanceNormBase):
    """Distributed ``InstanceNorm2d``: input ``[N, C, H, W]``."""

    nd = 2


class DistributedInstanceNorm3d(DistributedInstanceNormBase):
    """Distributed ``InstanceNorm3d``: input ``[N, C, D, H, W]``."""

    nd = 3


class DistributedLayerNorm(NormLayer):
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
        self.eps = float(eps)
        feat_axes = tuple(range(P_x.dim - k, P_x.dim))
        block = local_shape(self.normalized_shape, P_x.shape[-k:], P_x.index[-k:]) if P_x.active else None
        self._norm_setup(P_x, self.normalized_shape, feat_axes, block, affine=elementwise_affine, bias=bias,
                         running=False, P_stats=subgrid(P_x, feat_axes), P_rep=subgrid(P_x, range(P_x.dim - k)),
                         device=device, dtype=dtype)
        self.elementwise_affine = self.affine
        self.P_rep = self._rep.P

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        call, k = record.call, len(self.normalized_shape)
        x3 = x.reshape(1, numel(x.shape[:-k]), numel(x.shape[-k:]))
        y = self._normalize(x3, self._moments(x3, numel(self.normalized_shape))).view(x.shape)
        w = self._replica(self.weight, call.any_param_grad)
        b = self._replica(self.bias, call.any_param_grad)
        if w is not None:
            y = y * w.to(y.dtype)
        if b is not None:
            y = y + b.to(y.dtype)
        return y.to(record.dtype)

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
