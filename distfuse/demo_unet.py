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

Rank 0 checks every step's loss and the final state, the batch norms' running statistics
included, against ``torch.nn`` twins (:mod:`distfuse.demo_check`).  The activations are SiLU,
not ReLU (:mod:`distfuse.testing.tolerance` says why).
"""

from __future__ import annotations

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


def train(steps: int = 8, lr: float = 0.1, quiet: bool = False) -> list[tuple[float, float]]:
    """Train on an initialised process group of 4 ranks; returns (distributed, sequential) losses on rank 0."""
    from distfuse import Partition
    from distfuse.demo_check import make_twins, optimizer_step, report, train_checked
    from distfuse.geometry.decomposition import local_slices
    from distfuse.model import collect_sequential, make_optimizer

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"distfuse.demo unet needs {WORLD} ranks, got {dist.get_world_size()}")
    P_x = Partition.world().create_partition_inclusive(range(WORLD)).create_cartesian_topology_partition(GRID)
    device = P_x.device
    target_grid = GRID[:1] + GRID[2:]  # the class axis is not in the target

    torch.manual_seed(0)
    model = UNet(Distributed(P_x)).to(device)
    start, twins = make_twins(lambda dtype: UNet(nn).to(device=device, dtype=dtype),
                              collect_sequential(model, dst=0),  # collective: every rank takes part
                              lambda twin: torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9))
    opt = make_optimizer(torch.optim.SGD, model.parameters(), lr=lr, momentum=0.9)
    loss_fn = Distributed(P_x).CrossEntropyLoss()

    if dist.get_rank() == 0 and not quiet:
        print(f"distfuse U-Net demo: {WORLD} ranks, backend {dist.get_backend()}, device {device}, "
              f"volume {[BATCH, C_IN] + [EXTENT] * 3} split {list(GRID)}")

    def distributed_step(step: int) -> torch.Tensor:
        x_global, t_global = _batch(step, device)
        x = x_global[local_slices(x_global.shape, GRID, P_x.index)].contiguous()
        target_index = P_x.index[:1] + P_x.index[2:]
        t = t_global[local_slices(t_global.shape, target_grid, target_index)].contiguous()
        loss = loss_fn(model(x), t)  # the global mean, the same on every rank
        optimizer_step(opt, loss)
        return loss

    def twin_step(dtype: torch.dtype, step: int) -> float:
        x, target = _batch(step, device)
        twin, twin_opt = twins[dtype]
        return float(optimizer_step(twin_opt, nn.functional.cross_entropy(twin(x.to(dtype)), target)))

    losses, times = train_checked(steps, TERMS, quiet, distributed_step, twin_step, device)
    report(collect_sequential(model, dst=0), twins, TERMS, steps, start, losses, times,
           "weights and running statistics", "U-Net", quiet)
    return losses
