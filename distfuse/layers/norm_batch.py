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
(a root-held weight would add a broadcast and a sum-reduce to every layer).

Numerics follow ``torch.nn.BatchNormNd`` (also ``SyncBatchNorm``'s): the biased variance
normalises, the unbiased one enters ``running_var``, ``momentum=None`` is the cumulative
average, and 16-bit inputs are normalised in fp32 and rounded once.  The workers must all
be in training or all in eval mode (the agreement checks it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._conv_common import spatial_classes
from distfuse.layers._norm_common import NormLayer, numel, subgrid

__all__ = ["DistributedBatchNormBase", "DistributedBatchNorm", "DistributedBatchNorm1d", "DistributedBatchNorm2d",
           "DistributedBatchNorm3d"]


class DistributedBatchNormBase(NormLayer):
    """Batch normalisation of an input split over ``P_x`` (a CartesianPartition, one dimension per input
    dimension; see the module docstring); the other arguments as ``torch.nn.BatchNormNd``."""

    nd: int = 0
    dims: tuple[int, ...] = ()  # the numbers of P_x dimensions accepted, where not nd + 2

    def __init__(self, P_x, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, bias: bool = True):
        super().__init__()
        self._features(P_x, self.dims or (self.nd + 2,), num_features, eps, momentum, track_running_stats)
        block = local_shape((self.num_features,), (P_x.shape[1],), (P_x.index[1],)) if P_x.active else None
        P_stats = subgrid(P_x, [d for d in range(P_x.dim) if d != 1])  # also the parameters' replicas
        self._norm_setup(P_x, (self.num_features,), (1,), block, affine=affine, bias=bias,
                         running=self.track_running_stats, P_stats=P_stats, P_rep=P_stats, device=device, dtype=dtype)

    def _forward(self, x: torch.Tensor, record) -> torch.Tensor:
        G, call = record.global_shape, record.call
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average; a tensor (no host read), the same bits as a float
                factor = 1.0 / self.num_batches_tracked.double()
        if not self._bn_training():  # eval with running statistics: local, only the parameter gradients are summed
            return F.batch_norm(x, self.running_mean, self.running_var, *self._replicas(call), False, 0.0, self.eps)
        count = G[0] * numel(G[2:])
        x3 = x.reshape(x.shape[0], x.shape[1], numel(x.shape[2:]))
        stats = self._moments(x3, count)
        if self.training and self.track_running_stats and self.running_mean is not None and count > 0:
            self._blend_running(stats.mean, stats.unbiased_var(), factor)
        return self._normalize(x3, stats, self.weight, self.bias).view(x.shape).to(record.dtype)

    def _bn_training(self) -> bool:
        """torch's rule: batch statistics when training, or when there are no running statistics to use."""
        return self.training or (self.running_mean is None and self.running_var is None)

    def _promotions(self, call) -> tuple[bool, bool]:
        """Training: the adjoint all-reduces over P_stats (it gives the weight and bias gradients too), so every
        worker's output must require grad if any worker's input or parameter does; eval: the parameters' sums."""
        if self._bn_training():
            return any(call.input_grad + call.param_grad) and not call.param_grad[self.P_x.rank], False
        return False, any(call.param_grad)

    def _mode_matters(self) -> bool:
        return True

    def _check_global(self, G) -> None:
        op = type(self).__name__
        if G[1] != self.num_features:
            raise expect(op, "input channels (the global input's dimension 1, num_features)", self.num_features, G[1])
        if self._bn_training() and G[0] * numel(G[2:]) == 1:
            raise ShapeError(f"{where(op)}: expected more than 1 value per channel when training, got the global "
                             f"input size {list(G)} (torch's rule)")

    def _signature(self):
        return (type(self).__name__, self.num_features, self.eps, self.momentum, self.affine,
                self.track_running_stats, self.training, self.P_x.ranks, self.P_x.shape)


class DistributedBatchNorm1d(DistributedBatchNormBase):
    """Distributed ``BatchNorm1d``: input ``[N, C]`` or ``[N, C, L]``, P_x of 2 or 3 dimensions."""

    dims = (2, 3)


DistributedBatchNorm2d, DistributedBatchNorm3d = spatial_classes(
    DistributedBatchNormBase, "DistributedBatchNorm",
    "Distributed ``BatchNorm{nd}d``: input ``[N, C, *spatial]`` ({nd} axes), P_x ``[P_b, P_c, {s}]``.", nds=(2, 3))


class DistributedBatchNorm(DistributedBatchNormBase):
    """DistDL's dimension-agnostic name: input ``[N, C, *spatial]`` with 0 to 6 spatial axes, one P_x axis each."""

    dims = tuple(range(2, 9))
