"""Distributed group and instance normalisation: per-sample statistics summed over the spatial workers.

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

The workers agree on each call under the agreement protocol
(``_norm_compiled.agree_call``): while every worker's call repeats, one flag round over
``P_x`` (a one-element host all-reduce) and no metadata gather; when some worker's call
changed, the metadata gather over ``P_x`` and its checks, so bad input (or, for an
instance norm with running statistics, workers in different modes) raises the same error
on every worker (inside ``torch.compile``: the last eager call's record and the same
flag round, ``_norm_compiled.py``).  Every worker of ``P_x`` must call backward when one
does.  Workers outside ``P_x`` pass and get back a zero-volume tensor.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from distfuse.errors import PartitionError, ShapeError, expect, where
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
from distfuse.layers._norm_compiled import (
    NormCall,
    NormSites,
    agree_call,
    all_sum,
    compiled_call,
    moments,
    normalize,
    replica,
)
from distfuse.layers._params import ParamLayout
from distfuse.ops.collectives import FlaggedSite
from distfuse.primitives._common import check_inactive_input
from distfuse.primitives._layout import memory_format_of

__all__ = ["DistributedGroupNorm", "DistributedInstanceNormBase", "DistributedInstanceNorm1d",
           "DistributedInstanceNorm2d", "DistributedInstanceNorm3d"]


def _affine(y: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``y * w[c] + b[c]`` for ``y [N, C, *s]`` in the compute dtype."""
    shape = (1, -1) + (1,) * (y.dim() - 2)
    if w is not None:
        y = y * w.to(y.dtype).view(shape)
    if b is not None:
        y = y + b.to(y.dtype).view(shape)
    return y


class _ChannelNormBase(BlockIdentityMixin, nn.Module):
    """Shared set-up: replicated per-channel weight and bias, the P_stats / P_rep sub-grids, the call check."""

    def _setup(self, P_x, num_channels: int, affine: bool, bias: bool, device, dtype) -> None:
        self.P_x = P_x
        self.affine = bool(affine)
        self._has_bias = self.affine and bool(bias)
        self._channels = int(num_channels)
        self.P_stats = subgrid(P_x, range(2, P_x.dim))
        self.P_rep = subgrid(P_x, [d for d in range(P_x.dim) if d != 1])
        self._sites = NormSites(type(self).__name__, P_x, self.P_stats, self.P_rep)
        self._kw = dict(device=torch.device(device) if device is not None else P_x.device, dtype=dtype)
        self._block = local_shape((self._channels,), (P_x.shape[1],), (P_x.index[1],)) if P_x.active else None
        make = P_x.active and self.affine
        self.register_parameter("weight", nn.Parameter(torch.ones(self._block, **self._kw)) if make else None)
        make = P_x.active and self._has_bias
        self.register_parameter("bias", nn.Parameter(torch.zeros(self._block, **self._kw)) if make else None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _affine_layouts(self) -> list[ParamLayout]:
        C = (self._channels,)
        lays = [ParamLayout("weight", "weight", self.P_x, C, split_dims=(1,))] if self.affine else []
        if self._has_bias:
            lays.append(ParamLayout("bias", "bias", self.P_x, C, split_dims=(1,)))
        return lays

    def _check_call(self, op: str, x: torch.Tensor, extra_dtypes=(), check=None, x_needed=None, params_needed=None):
        """The agreed call: ``(global shape, dtype, call record)``, or None for a compiled call that flagged.

        Eager (:func:`~distfuse.layers._norm_compiled.agree_call`): a flag round while every
        worker's call repeats; else gather and validate the call (``check(G, call)`` runs the
        layer's own checks) and remember the record.  Compiled
        (``distfuse/layers/_norm_compiled.py``): the record of the last eager call, after the
        flag round; ``x_needed`` / ``params_needed`` say which promotions the call needs.
        """
        params = [p for p in (self.weight, self.bias) if p is not None]
        if torch.compiler.is_compiling():
            record, changed = compiled_call(self, x, params, self.training, x_needed, params_needed)
            return None if changed else (record.global_shape, record.dtype, record.call)
        P_x = self.P_x

        def gather_and_check() -> NormCall:
            held = params + [t for t in extra_dtypes if t is not None]
            call = gather_call(op, P_x, [x, *held], ["input"] + ["parameter or running statistic"] * len(held),
                               params, signature=self._signature(), mode=int(self.training))
            if self._mode_matters():
                one_mode(op, P_x, call)
            dtype = one_dtype(op, P_x, call.dtypes[0])
            G = global_shape_of(op, P_x, call.shapes[0])
            for dtypes in call.dtypes[1:]:  # every worker's parameters and buffers: every worker raises alike
                for t_dtype in dtypes:
                    check_param_dtype(op, dtype, t_dtype)
            if check is not None:
                check(G, call)
            return NormCall(G, dtype, call)

        record = agree_call(self._sites, P_x, x, params, self.training, gather_and_check)
        return record.global_shape, record.dtype, record.call

    def _mode_matters(self) -> bool:
        """Whether training and eval calls run different collectives (then every worker must be in one mode)."""
        return False

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
        self._setup(P_x, num_channels, affine, bias, device, dtype)

    def param_layouts(self) -> list[ParamLayout]:
        return self._affine_layouts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        agreed = self._check_call(op, x, check=self._check_channels, x_needed=lambda c: c.any_input_grad,
                                  params_needed=lambda c: c.any_param_grad)
        if agreed is None:  # a compiled call that flagged: the flag round raises on every worker
            return x.new_empty((0,))
        G, dtype, call = agreed
        x = promote(x, call.any_input_grad)  # the adjoint all-reduces over P_stats: every worker must run it
        groups, per_group = self.num_groups, G[1] // self.num_groups
        # torch's GroupNorm returns channels_last (_3d) for such an input; its [N, *s, C] memory viewed as
        # [N, s, groups, per_group] has one statistic per (sample, group): no copy, in or out.
        channels_last = memory_format_of(x) != torch.contiguous_format
        if channels_last:
            xl = x.movedim(1, -1)
            x3 = xl.view(x.shape[0], numel(x.shape[2:]), groups, per_group)
        else:
            x3 = x.reshape(1, x.shape[0] * groups, per_group * numel(x.shape[2:]))
        stats = moments(self._sites.stats, x3, per_group * numel(G[2:]))
        y = normalize(self._sites.stats, x3, stats, self.eps)
        y = y.view(xl.shape).movedim(-1, 1) if channels_last else y.view(x.shape)
        w = replica(self._sites.rep, self.weight, call.any_param_grad)
        b = replica(self._sites.rep, self.bias, call.any_param_grad)
        return _affine(y, w, b).to(dtype)

    def _check_channels(self, G, call) -> None:
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
        self._has_buffers = self.track_running_stats
        self._setup(P_x, num_features, affine, bias, device, dtype)
        self.P_batch = subgrid(P_x, (0,)) if self._has_buffers else None  # sums the per-sample running statistics
        self._sites.batch = FlaggedSite(op, self.P_batch, None) if self._has_buffers else None
        if P_x.active and self._has_buffers:
            self.register_buffer("running_mean", torch.zeros(self._block, **self._kw))
            self.register_buffer("running_var", torch.ones(self._block, **self._kw))
            # torch's InstanceNorm registers it (and never advances it); kept for state-dict parity.
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=self._kw["device"]))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.running_mean is not None:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "running_mean"):
            self.reset_running_stats()

    def param_layouts(self) -> list[ParamLayout]:
        lays = self._affine_layouts()
        if self._has_buffers:
            C, P = (self.num_features,), self.P_x
            lays += [ParamLayout("running_mean", "running_mean", P, C, split_dims=(1,)),
                     ParamLayout("running_var", "running_var", P, C, split_dims=(1,)),
                     ParamLayout("num_batches_tracked", "num_batches_tracked", P, (), split_dims=())]
        return lays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` this worker's input block (zero-volume outside P_x); returns its output block."""
        op = type(self).__name__
        if not self.P_x.active:
            check_inactive_input(op, x)
            return x.clone()
        use_input_stats = self.training or not self.track_running_stats
        agreed = self._check_call(op, x, (self.running_mean, self.running_var), check=self._check_features,
                                  x_needed=lambda c: use_input_stats and c.any_input_grad,
                                  params_needed=lambda c: c.any_param_grad)
        if agreed is None:  # a compiled call that flagged: the flag round raises on every worker
            return x.new_empty((0,))
        G, dtype, call = agreed
        w = replica(self._sites.rep, self.weight, call.any_param_grad)
        b = replica(self._sites.rep, self.bias, call.any_param_grad)
        if not use_input_stats:  # running statistics per channel: the same local op as an eval batch norm
            return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
        count = numel(G[2:])
        x = promote(x, call.any_input_grad)  # the adjoint all-reduces over P_stats: every worker must run it
        x3 = x.reshape(1, x.shape[0] * x.shape[1], numel(x.shape[2:]))
        stats = moments(self._sites.stats, x3, count)
        if self.running_mean is not None:
            momentum = 0.0 if self.momentum is None else float(self.momentum)
            self._update_running_stats(stats, x.shape[:2], G[0], momentum)
        y = normalize(self._sites.stats, x3, stats, self.eps).view(x.shape)
        return _affine(y, w, b).to(dtype)

    def _mode_matters(self) -> bool:
        return self.track_running_stats  # training: statistics of the input and their all-reduce; eval: local

    def _check_features(self, G, call) -> None:
        op = type(self).__name__
        if G[1] != self.num_features:
            if self.affine or self.running_mean is not None:
                raise expect(op, "input channels (the global input's dimension 1, num_features)", self.num_features,
                             G[1])
            warnings.warn(f"{op}: the input's {G[1]} channels do not match num_features ({self.num_features}), "
                          "which is unused because affine=False (as torch warns)", stacklevel=4)
        if (self.training or not self.track_running_stats) and numel(G[2:]) <= 1:
            raise ShapeError(f"{where(op)}: expected more than 1 spatial element when training, got the global input "
                             f"size {list(G)} (torch's rule)")

    @torch.no_grad()
    def _update_running_stats(self, stats, local_nc, batch: int, momentum: float) -> None:
        """torch's update with the batch average of the per-sample statistics (summed over the batch workers)."""
        per_sample = torch.stack([stats.mean, stats.unbiased_var()]).view(2, *local_nc)
        sums = per_sample.sum(1)
        if self.P_batch.size > 1:
            sums = all_sum(self._sites.batch, sums)
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
