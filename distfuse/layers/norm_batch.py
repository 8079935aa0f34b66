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

The workers agree on each call (shapes, dtypes, grad flags, training mode) through the
layer's agreement session (:class:`~distfuse.layers._norm_common.NormLayer`): while every
worker's call repeats, one flag round over ``P_x`` (a one-element host all-reduce, before
any data moves) and no metadata gather; when some worker's call changed, every worker
gathers the metadata over ``P_x`` and checks it, so a bad input (or workers in different
modes) raises the same error on every worker and a new global shape agrees afresh.
Training adds one all-gather of ``3 x C_b`` float64 per worker.  Every worker of ``P_x``
must call backward when one does.  The same forward runs eagerly, inside
``capture_safe()`` and under ``torch.compile(fullgraph=True)`` (the running statistics
update in the graph, bitwise as in eager mode).  Workers outside ``P_x`` pass and get back
a zero-volume tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.layers._norm_common import NormLayer, check_norm_partition, numel, subgrid

__all__ = ["DistributedBatchNormBase", "DistributedBatchNorm", "DistributedBatchNorm1d", "DistributedBatchNorm2d",
           "DistributedBatchNorm3d"]


class DistributedBatchNormBase(NormLayer):
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
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.track_running_stats = bool(track_running_stats)
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
            w = self._replica(self.weight, call.any_param_grad)
            b = self._replica(self.bias, call.any_param_grad)
            return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
        count = G[0] * numel(G[2:])
        x3 = x.reshape(x.shape[0], x.shape[1], numel(x.shape[2:]))
        stats = self._moments(x3, count)
        if self.training and self.track_running_stats and self.running_mean is not None and count > 0:
            self._update_running_stats(stats.mean, stats.unbiased_var(), factor)
        return self._normalize(x3, stats, self.weight, self.bias).view(x.shape).to(record.dtype)

    def _bn_training(self) -> bool:
        """torch's rule: batch statistics when training, or when there are no running statistics to use."""
        return self.training or (self.running_mean is None and self.running_var is None)

    def _promotions(self, call) -> tuple[bool, bool]:
        """Training: the adjoint all-reduces over P_stats (it gives the weight and bias gradients too), so every
        worker's output must require grad if any worker's input or parameter does; eval: the parameters' sums."""
        if self._bn_training():
            return call.any_grad and not call.param_grad[self.P_x.rank], False
        return False, call.any_param_grad

    def _mode_matters(self) -> bool:
        return True

    def _check_global(self, G) -> None:
        op = type(self).__name__
        if G[1] != self.num_features:
            raise expect(op, "input channels (the global input's dimension 1, num_features)", self.num_features, G[1])
        if self._bn_training() and G[0] * numel(G[2:]) == 1:
            raise ShapeError(f"{where(op)}: expected more than 1 value per channel when training, got the global "
                             f"input size {list(G)} (torch's rule)")

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor, factor) -> None:
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
