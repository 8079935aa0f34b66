"""Distributed cross-entropy and negative log-likelihood for per-voxel classification (segmentation).

Partitions and shapes (the class axis is never split; batch and space may be)::

    P_x                     [P_b, 1, P_1, ..., P_nd]
    input                   [N_b, C, *n_b]     logits (cross-entropy) or log-probabilities (NLL)
    target, class indices   [N_b, *n_b]        int64: the input block without its class axis
    target, probabilities   [N_b, C, *n_b]     floating, cross-entropy only: the input's block
    weight                  [C]                the global class weights, on every worker
    reduction='none'        [N_b, *n_b]        this worker's block of torch's unreduced loss

    forward   l = torch's loss of the local block (reduction='none': log-softmax over the whole
              class axis is local because classes are not split)
              [sum l, sum of weight[target] over non-ignored voxels, flags]  ->  one all-reduce
              mean = sum l / sum weight[target]        (class-index targets, torch's divisor)
              mean = sum l / (N * prod(n))              (probability targets)
    adjoint   identity through the all-reduce (the loss is replicated, see :mod:`distfuse.layers.loss`), then
              torch's own backward of the local block: no message.

With ``label_smoothing`` torch's mean divides both its terms by the same weighted count,
so the sum of the unreduced loss over that global count is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import PartitionError, expect, where
from distfuse.layers._norm_common import FLOATS, numel
from distfuse.layers.loss import _WeightedLossBase, check_smoothing

__all__ = ["DistributedCrossEntropyLoss", "DistributedNLLLoss"]


class _ClassLossBase(_WeightedLossBase):
    """Shared by cross-entropy and NLL: the unsplit class axis, class-index targets, the weighted mean divisor."""

    prob_targets = False

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean"):
        super().__init__(P_x, size_average, reduce, reduction, weight=weight)
        op = type(self).__name__
        if P_x.dim < 2:
            raise expect(op, "dimensions of P_x ([batch, class, spatial...]; unbatched input is not supported)",
                         ">= 2", P_x.dim, PartitionError)
        if P_x.shape[1] != 1:
            raise PartitionError(f"{where(op)}: the class dimension (1) must not be split, because the softmax and "
                                 f"the target lookup need every class of a voxel on one worker; got P_x "
                                 f"{list(P_x.shape)}")
        self.ignore_index = int(ignore_index)

    def _check_target(self, op, G, call) -> None:
        floating = call.dtypes[1][0] in FLOATS
        if floating and not self.prob_targets:
            raise expect(op, "target dtype (class indices)", "torch.int64", str(call.dtypes[1][0]))
        if self.weight is not None and (self.weight.dim() != 1 or self.weight.numel() != G[1]):
            raise expect(op, "weight shape (one weight per class of the global input)", (G[1],),
                         tuple(self.weight.shape))
        for j, (xs, ts) in enumerate(zip(call.shapes[0], call.shapes[1], strict=True)):
            want = xs if floating else xs[:1] + xs[2:]
            if ts != want:
                what = "class probabilities: the input block's shape" if floating else (
                    "class indices: the input block's shape without the class dimension")
                raise expect(op, f"target block shape on world rank {self.P_x.ranks[j]} ({what})", want, ts)

    def _mean_divisor(self, G, t_dtype):
        if t_dtype in FLOATS:  # probability targets: torch divides by the number of voxels
            return numel(G) // G[1] if G[1] else 0
        return None  # class indices: the global sum of the targets' weights

    def _local_denominator(self, input, target, dtype) -> torch.Tensor:
        valid = target != self.ignore_index
        if self.weight is None:
            return valid.sum().to(dtype)
        picked = self.weight.to(dtype)[torch.where(valid, target, torch.zeros_like(target))]
        return (picked * valid).sum()

    def _safe_values(self, input, target):
        """torch refuses a class index outside ``[0, C)`` that is not ``ignore_index``; those become
        ``ignore_index`` (no loss, no weight) and are counted.  Probability targets: torch checks no values."""
        if target.is_floating_point():
            return input, target, None
        bad = (target != self.ignore_index) & ((target < 0) | (target >= input.shape[1]))
        return input, torch.where(bad, self.ignore_index, target), bad.sum()

    def _signature(self):
        return super()._signature() + (self.ignore_index,)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ignore_index={self.ignore_index}"


class DistributedCrossEntropyLoss(_ClassLossBase):
    """``torch.nn.CrossEntropyLoss`` per voxel over blocks split along batch and space by ``P_x [P_b, 1, P_1, ...,
    P_nd]`` (see the module docstring); the other arguments as torch's, ``weight`` the global ``[C]`` tensor."""

    prob_targets = True

    def __init__(self, P_x, weight: torch.Tensor | None = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(P_x, weight, size_average, ignore_index, reduce, reduction)
        self.label_smoothing = check_smoothing(type(self).__name__, label_smoothing)

    def _local_loss(self, input, target, G, start):
        return F.cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction="none",
                               label_smoothing=self.label_smoothing)

    def _signature(self):
        return super()._signature() + (self.label_smoothing,)


class DistributedNLLLoss(_ClassLossBase):
    """``torch.nn.NLLLoss`` per voxel over blocks split along batch and space by ``P_x [P_b, 1, P_1, ..., P_nd]``
    (see the module docstring); the other arguments as torch's."""

    def _local_loss(self, input, target, G, start):
        return F.nll_loss(input, target, self.weight, ignore_index=self.ignore_index, reduction="none")
