"""The main job: a small model-parallel training run, checked step by step against torch.nn.

``python -m distfuse.demo`` (or ``distfuse-demo``) starts 4 CPU ranks with gloo by
itself; under ``torchrun`` with GPUs it uses NCCL, one GPU per rank.
``python -m distfuse.demo unet`` trains a 3-D U-Net instead (:mod:`distfuse.demo_unet`), and
``python -m distfuse.demo gpt`` a small GPT over a context x tensor grid (:mod:`distfuse.demo_gpt`).

The model is a spatially partitioned conv net followed by a tensor-parallel MLP in the
sequence-parallel layout::

    x  [B, 3, 16, 16]   split 2 x 2 over space          P_conv = [1, 1, 2, 2]
    DistributedConv2d(3 -> 8, k3, circular padding)     halo exchange, global wrap
    DistributedConv2d(8 -> 16, k3, stride 2)            -> [B, 16, 8, 8]
    tokens [B, 64, 16]  each rank's 4 x 4 block = its 16 tokens (P_seq = [1, 4, 1])
    DistributedLinearAllGather(16 -> 64, P_x=P_seq)     all-gather tokens, column-parallel
    DistributedLinearReduceScatter(64 -> 16, P_y=P_seq) row-parallel, reduce-scatter tokens

Rank 0 checks every step's loss and the final weights against ``torch.nn`` twins
(:mod:`distfuse.demo_check`), for sums of :data:`TERMS` terms.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD = 4
BATCH, C_IN, H, W = 4, 3, 16, 16
# The longest sum of a training step: the loss's mean over every output of the MLP (the
# convolutions' weight gradients sum over BATCH * H * W = 1024 positions, the linears' 256).
TERMS = BATCH * (H // 2) * (W // 2) * 16


def _model(conv, fc1, fc2) -> nn.ModuleDict:
    """The model from its layer classes: ``torch.nn``'s, or the distributed ones bound to their partitions."""
    return nn.ModuleDict(dict(
        conv1=conv(C_IN, 8, 3, padding=1, padding_mode="circular"),
        conv2=conv(8, 16, 3, stride=2, padding=1),
        fc1=fc1(16, 64),
        fc2=fc2(64, 16),
    ))


def _forward(m, x):
    # SiLU, not ReLU: the final-state check needs training continuous in the rounding (distfuse.testing.tolerance)
    h = F.silu(m["conv1"](x))
    h = F.silu(m["conv2"](h))
    tokens = h.flatten(2).transpose(1, 2)  # [B, tokens, 16]
    return m["fc2"](F.gelu(m["fc1"](tokens)))


def _batch(step: int, device):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, C_IN, H, W, generator=gen)
    target = torch.randn(BATCH, 16, H // 2, W // 2, generator=gen)  # token targets in spatial layout
    return x.to(device), target.to(device)


def train(steps: int = 8, lr: float = 0.05, quiet: bool = False) -> list[tuple[float, float]]:
    """Run the demo on an initialised process group of 4 ranks; returns (distributed, sequential) losses on rank 0."""
    from distfuse import Partition
    from distfuse.demo_check import make_twins, optimizer_step, print_paths, report, train_checked
    from distfuse.geometry.decomposition import local_slices
    from distfuse.groups import world_group
    from distfuse.layers import DistributedConv2d, DistributedLinearAllGather, DistributedLinearReduceScatter
    from distfuse.model import collect_sequential, make_optimizer

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"distfuse.demo needs {WORLD} ranks, got {dist.get_world_size()}")
    P4 = Partition.world().create_partition_inclusive(range(WORLD))
    P_conv = P4.create_cartesian_topology_partition([1, 1, 2, 2])
    P_seq = P4.create_cartesian_topology_partition([1, WORLD, 1])
    P_feat = P4.create_cartesian_topology_partition([1, 1, WORLD])
    device = P_conv.device

    torch.manual_seed(0)
    model = _model(partial(DistributedConv2d, P_conv), partial(DistributedLinearAllGather, P_feat, P_x=P_seq),
                   partial(DistributedLinearReduceScatter, P_feat, P_y=P_seq)).to(device)
    start, twins = make_twins(lambda dtype: _model(nn.Conv2d, nn.Linear, nn.Linear).to(device=device, dtype=dtype),
                              collect_sequential(model, dst=0),  # collective: every rank takes part
                              lambda twin: torch.optim.SGD(twin.parameters(), lr=lr))
    opt = make_optimizer(torch.optim.SGD, model, lr=lr)

    if dist.get_rank() == 0 and not quiet:
        print(f"distfuse demo: {WORLD} ranks, backend {dist.get_backend()}, device {device}")
        print(f"{'rank':>6}  {'P_conv ' + str(list(P_conv.shape)):<22}{'P_seq ' + str(list(P_seq.shape)):<20}"
              f"{'P_feat ' + str(list(P_feat.shape)):<20}")
        for r in range(WORLD):
            print(f"{r:>6}  {str(P_conv.index_of(r)):<22}{str(P_seq.index_of(r)):<20}{str(P_feat.index_of(r)):<20}")

    def distributed_step(step: int) -> torch.Tensor:
        x_global, t_global = _batch(step, device)
        x = x_global[local_slices(x_global.shape, P_conv.shape, P_conv.index)].contiguous()
        t = t_global[local_slices(t_global.shape, P_conv.shape, P_conv.index)].flatten(2).transpose(1, 2)
        loss = ((_forward(model, x) - t) ** 2).sum() / TERMS  # this rank's share of the mean over every output
        optimizer_step(opt, loss)
        total = loss.detach().clone()
        dist.all_reduce(total, group=world_group())  # distfuse's world group: DISTFUSE_TIMEOUT bounds it
        return total

    def twin_step(dtype: torch.dtype, step: int) -> float:
        x, target = (t.to(dtype) for t in _batch(step, device))
        twin, twin_opt = twins[dtype]
        return float(optimizer_step(twin_opt, F.mse_loss(_forward(twin, x), target.flatten(2).transpose(1, 2))))

    losses, times = train_checked(steps, TERMS, quiet, distributed_step, twin_step, device)
    final = collect_sequential(model, dst=0)
    if dist.get_rank() == 0 and not quiet:
        print_paths(model)
    report(final, twins, TERMS, steps, start, losses, times, "weights", "model", quiet)
    return losses


def _worker(rank: int, init_file: str, steps: int | None, model: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    _run(model, steps)


def _run(model: str, steps: int | None) -> None:
    """Train a demo model on the initialised process group (each checks itself against torch.nn on rank 0), then
    destroy the group; ``steps`` None: the model's default."""
    fn = train if model == "convnet" else importlib.import_module(f"distfuse.demo_{model}").train
    try:
        fn() if steps is None else fn(steps)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", choices=("convnet", "unet", "gpt"), default="convnet",
                        help="convnet: conv + tensor-parallel MLP (default); unet: a 3-D U-Net on a split volume; "
                        "gpt: a small GPT, context x tensor parallel")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 8)")
    parser.add_argument("--path", choices=("auto", "fused", "unfused"), default="auto",
                        help="force the layers' path (fused on CPU runs the Triton kernels interpreted: slow)")
    args = parser.parse_args(argv)
    os.environ["DISTFUSE_PATH"] = args.path
    if args.path == "fused" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=300))
        _run(args.model, args.steps)
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="distfuse-demo-") as tmp:
        # fork starts in ~0.1 s per rank (spawn: seconds); children set one thread each.
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), args.steps, args.model), nprocs=WORLD,
                           start_method="fork")


if __name__ == "__main__":
    main()
