"""The U-Net demo: a small 3-D U-Net trained on a volume split 2 x 2 over 4 ranks, checked against torch.nn.

``python -m distfuse.demo unet`` starts 4 CPU ranks with gloo by itself (under
``torchrun`` it uses the ranks it is given).  The volume is split over depth and height::

    x       [B, 2, 12, 12, 12]   P_x = [1, 1, 2, 2, 1]: each rank holds a 6 x 6 x 12 block
    enc1    Conv3d(2 -> 8, k3, p1) + BatchNorm3d + SiLU        halo exchange, global batch stats
    down    MaxPool3d(2)                                       -> [B, 8, 6, 6, 6]
    enc2    Conv3d(8 -> 16, k3, p1) + BatchNorm3d + SiLU
    up      ConvTranspose3d(16 -> 8, k2, s2)                   -> [B, 8, 12, 12, 12]
    skip    cat(enc1, up) along channels                       blocks line up: same partition, same extents
    dec     Conv3d(16 -> 8, k3, p1) + BatchNorm3d + SiLU
    head    Conv3d(8 -> 3, k1)                                 per-voxel logits of 3 classes
    loss    CrossEntropyLoss over every voxel of the volume    global mean: one all-reduce

Rank 0 builds the same model from ``torch.nn`` layers, starting from the distributed
model's weights (collected with :func:`distfuse.model.collect_sequential`), and trains
it on the same data with the same optimiser, once in float32 (the twin whose loss is
printed beside the distributed one) and once in float64 (the oracle).  Every step's
loss, and at the end the whole state (weights and the batch norms' running statistics),
must agree with the oracle within the float32 rounding bound of
:func:`distfuse.testing.tolerance.rounding_bound` for sums of :data:`TERMS` terms over the
steps taken, each tensor measured on its layer's scales; otherwise the demo exits with an
error.  The activations are SiLU, not ReLU: the check needs training to be a continuous
function of the rounding, and a ReLU's kink is not (:mod:`distfuse.testing.tolerance`).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

WORLD = 4
BATCH, C_IN, CLASSES, EXTENT = 2, 2, 3, 12
GRID = (1, 1, 2, 2, 1)
# The longest sum of a training step: the batch norms' statistics, the loss's mean and every
# weight gradient sum over the batch and the volume (the convolutions sum 16 * 27 = 432 terms).
TERMS = BATCH * EXTENT**3


class UNet(nn.Module):
    """Encoder, one pooling level, decoder with a skip connection; ``make`` supplies the layers.

    With ``make = torch.nn`` it is the sequential model; with the distributed factory it
    is the same model over ``P_x``: the module paths match, so state moves between them
    by name.
    """

    def __init__(self, make):
        super().__init__()
        self.enc1 = nn.Sequential(make.Conv3d(C_IN, 8, 3, padding=1), make.BatchNorm3d(8), nn.SiLU())
        self.down = make.MaxPool3d(2)
        self.enc2 = nn.Sequential(make.Conv3d(8, 16, 3, padding=1), make.BatchNorm3d(16), nn.SiLU())
        self.up = make.ConvTranspose3d(16, 8, 2, stride=2)
        self.dec = nn.Sequential(make.Conv3d(16, 8, 3, padding=1), make.BatchNorm3d(8), nn.SiLU())
        self.head = make.Conv3d(8, CLASSES, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.down(e1))
        return self.head(self.dec(torch.cat([e1, self.up(e2)], dim=1)))


class Distributed:
    """The distributed layers over one partition, under torch.nn's names (the ``make`` of :class:`UNet`)."""

    def __init__(self, P_x):
        from distfuse import layers

        self.P_x = P_x
        self._layers = layers

    def __getattr__(self, name):
        cls = getattr(self._layers, f"Distributed{name}")
        return lambda *args, **kwargs: cls(self.P_x, *args, **kwargs)


def _batch(step: int, device):
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH, C_IN, EXTENT, EXTENT, EXTENT, generator=gen)
    # a learnable target: the class of each voxel follows the sign pattern of its two input channels
    target = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x.to(device), target.to(device)


def _sequential_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor) -> float:
    """One training step of a ``torch.nn`` twin; returns its loss."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    return float(loss.detach())


def train(steps: int = 8, lr: float = 0.1, quiet: bool = False) -> list[tuple[float, float]]:
    """Train on an initialised process group of 4 ranks; returns (distributed, sequential) losses on rank 0."""
    from tqdm import tqdm

    from distfuse import Partition
    from distfuse.geometry.decomposition import local_slices
    from distfuse.model import collect_sequential, make_optimizer
    from distfuse.testing.tolerance import check_trained_state, rounding_bound

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"distfuse.demo unet needs {WORLD} ranks, got {dist.get_world_size()}")
    rank = dist.get_rank()
    P_x = Partition.world().create_partition_inclusive(range(WORLD)).create_cartesian_topology_partition(GRID)
    device = P_x.device
    target_grid = GRID[:1] + GRID[2:]  # the class axis is not in the target

    torch.manual_seed(0)
    model = UNet(Distributed(P_x)).to(device)
    state = collect_sequential(model, dst=0)  # collective: every rank takes part
    start = {k: v.clone() for k, v in state.items()} if rank == 0 else None  # no view of a live parameter
    twins = {}  # rank 0: the torch.nn model in float32 (printed) and in float64 (the oracle), with optimisers
    if rank == 0:
        for dtype in (torch.float32, torch.float64):
            twin = UNet(nn).to(device=device, dtype=dtype)
            twin.load_state_dict(state)
            twins[dtype] = (twin, torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9))
    opt = make_optimizer(torch.optim.SGD, model.parameters(), lr=lr, momentum=0.9)
    loss_fn = Distributed(P_x).CrossEntropyLoss()

    if rank == 0 and not quiet:
        print(f"distfuse U-Net demo: {WORLD} ranks, backend {dist.get_backend()}, device {device}, "
              f"volume {[BATCH, C_IN] + [EXTENT] * 3} split {list(GRID)}")
    losses, times = [], []
    bar = tqdm(range(steps), desc="train", disable=rank != 0 or quiet, file=sys.stdout)
    for step in bar:
        x_global, t_global = _batch(step, device)
        x = x_global[local_slices(x_global.shape, GRID, P_x.index)].contiguous()
        target_index = P_x.index[:1] + P_x.index[2:]
        t = t_global[local_slices(t_global.shape, target_grid, target_index)].contiguous()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), t)  # the global mean, the same on every rank
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            got = float(loss.detach())
            want = _sequential_step(*twins[torch.float32], x_global, t_global)
            exact = _sequential_step(*twins[torch.float64], x_global.double(), t_global)
            losses.append((got, want))
            bar.set_postfix(loss=f"{got:.5f}", sequential=f"{want:.5f}")
            # a mean of positive terms: no cancellation, so relative to the loss itself
            bound = rounding_bound(torch.float32, TERMS, step + 1)
            if abs(got - exact) > bound * abs(exact):
                raise RuntimeError(f"step {step}: distributed loss {got:.7f} differs from the float64 model's "
                                   f"{exact:.9f} by {abs(got - exact) / abs(exact):.1e} relative, over the float32 "
                                   f"rounding bound {bound:.1e} (sums of {TERMS} terms, {step + 1} steps)")
    final = collect_sequential(model, dst=0)
    if rank == 0:
        worst, torch_nn = check_trained_state(final, twins, TERMS, steps, start,
                                              "state (weights and running statistics)")
        if not quiet:
            steady = times[1:] or times
            print(f"time per step: {1e3 * sum(steady) / len(steady):.1f} ms (mean of steps 2..{steps})")
            print(f"every step's loss matched the sequential torch.nn U-Net in float64 (within the float32 rounding "
                  f"bound {rounding_bound(torch.float32, TERMS, steps):.1e} at step {steps}); final loss "
                  f"{losses[-1][0]:.6f}")
            print(f"weights and running statistics agree with the float64 twin: worst {worst.key}, "
                  f"{worst.error:.1e} of {worst.allowed:.1e} allowed ({worst.ratio:.1e} of its allowance; "
                  f"torch.nn in float32: {torch_nn.ratio:.1e})")
    return losses
