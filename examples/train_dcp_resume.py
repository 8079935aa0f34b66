"""Train a distfuse model with distributed checkpoints (DCP), then resume it on a different partition.

Under torchrun (NCCL on GPUs, gloo on CPUs)::

    torchrun --nproc-per-node 4 examples/train_dcp_resume.py --ckpt /tmp/dcp --steps 6 --save-every 3
    torchrun --nproc-per-node 2 examples/train_dcp_resume.py --ckpt /tmp/dcp --steps 10 --resume

or without torchrun, on CPU, with gloo ranks this script starts itself::

    python examples/train_dcp_resume.py --spawn 4 --ckpt /tmp/dcp --steps 6 --save-every 3
    python examples/train_dcp_resume.py --spawn 2 --ckpt /tmp/dcp --steps 10 --resume --reverse-ranks

The model is a sequence-parallel MLP block over every rank of the world (``W`` ranks)::

    x       [B, S, 8]   tokens split over P_seq [1, W, 1]
    norm    LayerNorm(8)                       a plain module: replicated, per token
    fc1     DistributedLinearAllGather(8 -> 32)      all-gather tokens, weight split over P_feat [1, 1, W]
    act     GELU
    fc2     DistributedLinearReduceScatter(32 -> 8)  reduce-scatter tokens back onto P_seq

Each step: forward on the token blocks, backward, sum the replicated LayerNorm gradients
over the ranks, clip by the whole model's gradient norm (``distfuse.model.clip_grad_norm_``),
an SGD-with-momentum step (``make_optimizer`` also serves ranks without parameters).
Every ``--save-every`` steps ``save_checkpoint`` writes the model, the optimizer state and
the step.  ``--resume`` loads the newest checkpoint into a model built for the current
world size (and rank order, ``--reverse-ranks``): the blocks and momentum buffers are
resharded on load.

Check: rank 0 trains the equivalent ``torch.nn`` model on the whole batch in lockstep and
the losses must agree step by step.  On resume that twin loads the same distributed
checkpoint in one process (``load_checkpoint(..., single_process=True)``), so the run also
shows that a plain ``torch.nn`` model reads distfuse checkpoints.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import sys
import tempfile
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IN, HID, BATCH, SEQ = 8, 32, 4, 12
LR, MOMENTUM, MAX_NORM = 0.05, 0.9, 0.5


def build_model(P_seq, P_feat, dtype) -> nn.Module:
    from distfuse.layers import DistributedLinearAllGather, DistributedLinearReduceScatter

    return nn.Sequential(OrderedDict(
        norm=nn.LayerNorm(IN, device=P_seq.device, dtype=dtype),
        fc1=DistributedLinearAllGather(P_feat, IN, HID, P_x=P_seq, dtype=dtype),
        act=nn.GELU(),
        fc2=DistributedLinearReduceScatter(P_feat, HID, IN, P_y=P_seq, dtype=dtype),
    ))


def build_twin(device, dtype) -> nn.Module:
    """The same network from torch.nn layers: its state_dict keys are the distributed model's sequential keys."""
    return nn.Sequential(OrderedDict(
        norm=nn.LayerNorm(IN), fc1=nn.Linear(IN, HID), act=nn.GELU(), fc2=nn.Linear(HID, IN))).to(device, dtype)


def batch(step: int, device, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, SEQ, IN, generator=gen, dtype=torch.float64)
    target = torch.sin(3 * x) + 0.1 * torch.randn(BATCH, SEQ, IN, generator=gen, dtype=torch.float64)
    return x.to(device, dtype), target.to(device, dtype)


def latest_checkpoint(root: str) -> str | None:
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) \
        else []
    return os.path.join(root, f"step_{steps[-1]}") if steps else None


def run(ckpt: str, steps: int, save_every: int, resume: bool, reverse_ranks: bool = False,
        dtype: torch.dtype = torch.float64, rtol: float | None = None,
        quiet: bool = False) -> list[tuple[int, float, float]]:
    """Train (or resume) on an initialised process group; returns ``(step, loss, twin loss)`` on rank 0.

    Each step's loss must match the torch.nn twin's within ``rtol``; by default the rounding bound of ``dtype``
    (:func:`distfuse.testing.tolerance.rounding_bound`) for the longest sum behind a loss (the squared errors of a
    batch, or the gradient norm's squares of the parameters) over ``steps`` steps, twice over (both sides round).
    """
    from distfuse import Partition
    from distfuse.geometry.decomposition import local_slices
    from distfuse.interop.checkpoint import load_checkpoint, save_checkpoint
    from distfuse.model import clip_grad_norm_, collect_sequential, make_optimizer, replicated_parameters

    rank, world = dist.get_rank(), dist.get_world_size()
    order = list(reversed(range(world))) if reverse_ranks else list(range(world))
    P_all = Partition.world().create_partition_inclusive(order)
    P_seq = P_all.create_cartesian_topology_partition([1, world, 1])
    P_feat = P_all.create_cartesian_topology_partition([1, 1, world])
    device = P_seq.device
    torch.manual_seed(0)
    model = build_model(P_seq, P_feat, dtype)
    opt = make_optimizer(torch.optim.SGD, model, lr=LR, momentum=MOMENTUM)
    twin = twin_opt = None
    start = 0
    if resume:
        path = latest_checkpoint(ckpt)
        if path is None:
            raise SystemExit(f"--resume: no checkpoint under {ckpt}")
        start = load_checkpoint(path, model, opt)["step"]
        if rank == 0:
            twin = build_twin(device, dtype)
            twin_opt = torch.optim.SGD(twin.parameters(), lr=LR, momentum=MOMENTUM)
            load_checkpoint(path, twin, twin_opt, single_process=True)
    else:
        state = collect_sequential(model)  # the twin starts from the distributed model's initial weights
        if rank == 0:
            twin = build_twin(device, dtype)
            twin.load_state_dict(state)
            twin_opt = torch.optim.SGD(twin.parameters(), lr=LR, momentum=MOMENTUM)
    if rank == 0 and not quiet:
        how = f"resumed at step {start}" if resume else "fresh start"
        print(f"train_dcp_resume: {world} ranks, ranks {'reversed' if reverse_ranks else 'in order'}, {how}, "
              f"backend {dist.get_backend()}")

    history = []
    for step in range(start, steps):
        xg, tg = batch(step, device, dtype)
        x = xg[local_slices(xg.shape, P_seq.shape, P_seq.index)].contiguous()
        t = tg[local_slices(tg.shape, P_seq.shape, P_seq.index)]
        y = model(x)
        loss = ((y - t) ** 2).sum() / tg.numel()  # this rank's share of the global mean
        loss.backward()
        for p in replicated_parameters(model):  # each rank holds the LayerNorm's gradient over its own tokens
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            if rtol is None:
                from distfuse.testing.tolerance import rounding_bound

                terms = max(tg.numel(), sum(p.numel() for p in twin.parameters()))
                rtol = 2 * rounding_bound(dtype, terms, steps)
            twin_loss = F.mse_loss(twin(xg), tg)
            twin_loss.backward()
            nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
            twin_opt.step()
            twin_opt.zero_grad()
            got, want = float(total), float(twin_loss.detach())
            history.append((step, got, want))
            if not quiet:
                print(f"step {step:3d}  loss {got:.15g}  torch.nn twin {want:.15g}")
            if abs(got - want) > rtol * abs(want):
                raise RuntimeError(f"step {step}: distributed loss {got!r} differs from the torch.nn twin's {want!r}")
        if save_every and (step + 1) % save_every == 0:
            save_checkpoint(os.path.join(ckpt, f"step_{step + 1}"), model, opt, extra={"step": step + 1})
    if rank == 0 and not quiet:
        print(f"done: steps {start}..{steps - 1} on {world} ranks; every loss matches the torch.nn twin "
              f"(rtol {rtol:g})")
    return history


def _init_from_env() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))


def _spawned(rank: int, world: int, init_file: str, args: dict, errors) -> None:
    torch.set_num_threads(1)  # one thread per rank: forked children of an OpenMP parent hang otherwise
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        run(**args)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent with the rank
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, args: dict) -> int:
    """Run ``run(**args)`` on ``world`` local gloo ranks (forked); returns the exit code."""
    import distfuse.interop.checkpoint  # noqa: F401 - imported once here, inherited by every forked rank
    import distfuse.layers  # noqa: F401
    import distfuse.model  # noqa: F401

    ctx = mp.get_context("fork")
    fd, init_file = tempfile.mkstemp(prefix="train-dcp-resume-")
    os.close(fd)
    os.unlink(init_file)
    errors = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, world, init_file, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = sorted({r for r, _ in iter_queue(errors)} | {r for r, p in enumerate(procs) if p.exitcode != 0})
    if os.path.exists(init_file):
        os.unlink(init_file)
    if failed:
        print(f"train_dcp_resume: ranks {failed} failed", file=sys.stderr)
        return 1
    return 0


def iter_queue(q):
    out = []
    while not q.empty():
        out.append(q.get())
    for rank, msg in out:
        print(f"rank {rank}: {msg}", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="directory of the checkpoints (step_<n> inside)")
    ap.add_argument("--steps", type=int, default=6, help="train until this step")
    ap.add_argument("--save-every", type=int, default=3, help="save a checkpoint every this many steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="load the newest checkpoint and continue from its step")
    ap.add_argument("--reverse-ranks", action="store_true", help="lay the partitions out over the ranks backwards")
    ap.add_argument("--spawn", type=int, default=0, help="start this many CPU gloo ranks here instead of torchrun")
    ap.add_argument("--fp32", action="store_true", help="train in float32 (default float64; either checked to its "
                    "rounding bound)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    dtype = torch.float32 if a.fp32 else torch.float64
    args = dict(ckpt=a.ckpt, steps=a.steps, save_every=a.save_every, resume=a.resume, reverse_ranks=a.reverse_ranks,
                dtype=dtype, quiet=a.quiet)
    if a.spawn:
        return spawn(a.spawn, args)
    _init_from_env()
    try:
        run(**args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
