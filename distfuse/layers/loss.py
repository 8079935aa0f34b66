"""Distributed losses: the elementwise losses (MSE, L1, BCE, BCE with logits, KL divergence).

Each takes input and target blocks split by ``P_x`` and gives torch's loss of the global
tensors.  What every loss shares (partitions and shapes, the reduction over ``P_x`` and its
identity adjoint, the global ``mean`` divisor, the agreement on each call's metadata) is
:class:`~distfuse.layers.loss_base.DistributedLossBase`'s, documented in
:mod:`distfuse.layers.loss_base`; the losses here give their local unreduced loss.

Weights (``weight``, ``pos_weight``) are the global tensors torch takes, held whole by
every worker (they must be equal everywhere) and sliced per call to the local block by
torch's broadcasting rule.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.layers._norm_common import numel
from distfuse.layers._params import ParamLayout
from distfuse.layers.loss_base import DistributedLossBase, replicated_sum

__all__ = ["DistributedLossBase", "DistributedMSELoss", "DistributedL1Loss", "DistributedBCELoss",
           "DistributedBCEWithLogitsLoss", "DistributedKLDivLoss", "replicated_sum"]


def broadcast_block(op: str, name: str, w: torch.Tensor | None, G, start, extent) -> torch.Tensor | None:
    """The part of ``w`` (broadcastable to the global shape ``G``, right-aligned) that meets the local block."""
    if w is None:
        return None
    if w.dim() > len(G):
        raise UnsupportedError(f"{where(op)}: {name} has {w.dim()} dimensions, more than the input's {len(G)}; "
                               "the result would not be decomposed like the input")
    off = len(G) - w.dim()
    index = []
    for i, n in enumerate(w.shape):
        d = off + i
        if n == 1:
            index.append(slice(None))
        elif n == G[d]:
            index.append(slice(start[d], start[d] + extent[d]))
        else:
            raise ShapeError(f"{where(op)}: {name} of shape {tuple(w.shape)} does not broadcast to the global input "
                             f"shape {tuple(G)} (dimension {d}: {n} against {G[d]})")
    return w[tuple(index)]


class _WeightedLossBase(DistributedLossBase):
    """A loss with optional global weight buffers (torch registers them as buffers, so the state dict has them)."""

    _weight_names: tuple[str, ...] = ("weight",)

    def _set_weights(self, **weights) -> None:
        for name, w in weights.items():
            self.register_buffer(name, None if w is None else torch.as_tensor(w).to(self.P_x.device))

    def _weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(w for w in (getattr(self, n, None) for n in self._weight_names) if w is not None)

    def param_layouts(self) -> list[ParamLayout]:
        return [ParamLayout(n, n, self.P_x, tuple(getattr(self, n).shape), split_dims=())
                for n in self._weight_names if getattr(self, n, None) is not None]


class DistributedMSELoss(DistributedLossBase):
    """``torch.nn.MSELoss`` over input and target blocks split by ``P_x`` (see the module docstring)."""

    def _local_loss(self, input, target, G, start):
        return F.mse_loss(input, target, reduction="none")


class DistributedL1Loss(DistributedLossBase):
    """``torch.nn.L1Loss`` over input and target blocks split by ``P_x`` (see the module docstring)."""

    def _local_loss(self, input, target, G, start):
        return F.l1_loss(input, target, reduction="none")


class DistributedBCELoss(_WeightedLossBase):
    """``torch.nn.BCELoss``; ``weight`` is the global rescaling tensor, broadcastable to the global input."""

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, reduce=None,
                 reduction: str = "mean"):
        super().__init__(P_x, size_average, reduce, reduction)
        self._set_weights(weight=weight)

    def _local_loss(self, input, target, G, start):
        w = broadcast_block(type(self).__name__, "weight", self.weight, G, start, input.shape)
        return F.binary_cross_entropy(input, target, w, reduction="none")

    def _safe_values(self, input, target):
        """torch refuses an input or a target outside [0, 1] (NaN included); both become 0.5 there, counted."""
        bad = ~((input >= 0) & (input <= 1) & (target >= 0) & (target <= 1))
        return torch.where(bad, 0.5, input), torch.where(bad, 0.5, target), bad.sum()


class DistributedBCEWithLogitsLoss(_WeightedLossBase):
    """``torch.nn.BCEWithLogitsLoss``; ``weight`` and ``pos_weight`` are global, broadcastable to the global input."""

    _weight_names = ("weight", "pos_weight")

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, reduce=None,
                 reduction: str = "mean", pos_weight: torch.Tensor | None = None):
        super().__init__(P_x, size_average, reduce, reduction)
        self._set_weights(weight=weight, pos_weight=pos_weight)

    def _local_loss(self, input, target, G, start):
        op = type(self).__name__
        w = broadcast_block(op, "weight", self.weight, G, start, input.shape)
        pw = broadcast_block(op, "pos_weight", self.pos_weight, G, start, input.shape)
        return F.binary_cross_entropy_with_logits(input, target, w, reduction="none", pos_weight=pw)


class DistributedKLDivLoss(DistributedLossBase):
    """``torch.nn.KLDivLoss``; ``reduction='batchmean'`` divides by the global batch size (the input's dimension 0)."""

    reductions = ("none", "mean", "sum", "batchmean")

    def __init__(self, P_x, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False):
        super().__init__(P_x, size_average, reduce, reduction)
        self.log_target = bool(log_target)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.reduction == "mean" and self.P_x.active and not torch.compiler.is_compiling():
            warnings.warn("reduction: 'mean' divides the total loss by both the batch size and the support size; "
                          "'batchmean' divides only by the batch size, and aligns with the KL div math definition "
                          "(as torch warns)", stacklevel=2)
        return super().forward(input, target)

    def _local_loss(self, input, target, G, start):
        return F.kl_div(input, target, reduction="none", log_target=self.log_target)

    def _mean_divisor(self, G, t_dtype) -> int:
        return G[0] if self.reduction == "batchmean" else numel(G)

    def _signature(self):
        return super()._signature() + (self.log_target,)
