"""The dot-product (adjoint) test for distributed linear operators.

For a linear operator ``F`` and its adjoint ``F*`` (what autograd's backward computes),
``<F x, y> = <x, F* y>`` must hold for random ``x`` and ``y``, each inner product summed over
every worker's local blocks.  In float64 the two sides agree to rounding; a wrong adjoint (a
missing halo sum, a double-counted bias block, a sum-reduce that drops a contributor) breaks
the equality by O(1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["adjoint_check"]


def adjoint_check(apply, x: torch.Tensor, seed: int = 1234) -> tuple[float, float]:
    """Return ``(<F x, y>, <x, F* y>)`` summed over the world, for random float64 ``y``; call it on every rank
    (the two inner products are all-reduced over the world group).

    Args:
        apply: the operator, called as ``apply(x)`` on this rank's local block.
        x: this rank's local input block (zero-volume on inactive ranks); it is
            converted to float64 and made to require grad.
        seed: seeds the random ``y`` (offset by the rank so that blocks differ).
    """
    x = x.detach().to(torch.float64).requires_grad_(True)
    y = apply(x)
    gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * dist.get_rank())
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)
    if y.requires_grad:
        torch.autograd.backward(y, dy)
    x_adj = x.grad if x.grad is not None else torch.zeros_like(x)
    sums = torch.stack([(y.detach() * dy).sum(), (x.detach() * x_adj).sum()]).cpu()
    dist.all_reduce(sums)
    return float(sums[0]), float(sums[1])
