"""What the three demos share: rank 0's ``torch.nn`` twins, the training loop that checks every step, the summary.

Each demo (:mod:`distfuse.demo`, :mod:`distfuse.demo_unet`, :mod:`distfuse.demo_gpt`) builds its
distributed model and, on rank 0, the same model from ``torch.nn`` layers twice, started from the
distributed model's collected state: in float32 (the yardstick, its loss printed beside the
distributed one) and in float64 (the oracle).  Every step's loss must agree with the oracle's
within the float32 rounding bound of :func:`~distfuse.testing.tolerance.rounding_bound` for sums
of ``terms`` terms over the steps taken, and the final state within
:func:`~distfuse.testing.tolerance.check_trained_state`; otherwise the demo raises.  The losses
are means of positive terms (no cancellation), so the bound is relative to the loss itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["make_twins", "optimizer_step", "train_checked", "report", "print_paths"]


def make_twins(build: Callable[[torch.dtype], nn.Module], state: dict | None,
               optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> tuple[dict | None, dict]:
    """Rank 0's ``(start, twins)``: a copy of the starting state, and ``{dtype: (model, optimizer)}`` for float32
    and float64, each loaded with ``state``.  Elsewhere ``(None, {})``."""
    if dist.get_rank() != 0:
        return None, {}
    start = {k: v.clone() for k, v in state.items()}  # no view of a live parameter
    twins = {}
    for dtype in (torch.float32, torch.float64):
        twin = build(dtype)
        twin.load_state_dict(state)
        twins[dtype] = (twin, optimizer(twin))
    return start, twins


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    """``opt``'s step on the gradient of ``loss`` (the grads cleared first); returns the loss, detached (no host
    read: the distributed step's time stays the device's)."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def train_checked(steps: int, terms: int, quiet: bool, distributed_step: Callable[[int], torch.Tensor],
                  twin_step: Callable[[torch.dtype, int], float], device) -> tuple[list, list]:
    """Run ``steps`` steps; returns rank 0's ``[(distributed loss, float32 twin loss)]`` and every rank's step times.

    ``distributed_step(step)`` runs one step of the distributed model (forward, backward, optimiser) and returns
    the global loss (the same on every rank); ``twin_step(dtype, step)`` runs the twin of that dtype on rank 0
    and returns its loss.  Raises on rank 0 when a step's loss leaves the float64 oracle's rounding bound.
    """
    from tqdm import tqdm

    from distfuse.testing.tolerance import rounding_bound

    rank = dist.get_rank()
    losses, times = [], []
    bar = tqdm(range(steps), desc="train", disable=rank != 0 or quiet, file=sys.stdout)
    for step in bar:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = distributed_step(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rank != 0:
            continue
        got, want, exact = float(loss.detach()), twin_step(torch.float32, step), twin_step(torch.float64, step)
        losses.append((got, want))
        bar.set_postfix(loss=f"{got:.5f}", sequential=f"{want:.5f}")
        bound = rounding_bound(torch.float32, terms, step + 1)
        if abs(got - exact) > bound * abs(exact):
            raise RuntimeError(f"step {step}: distributed loss {got:.7f} differs from the float64 model's "
                               f"{exact:.9f} by {abs(got - exact) / abs(exact):.1e} relative, over the float32 "
                               f"rounding bound {bound:.1e} (sums of {terms} terms, {step + 1} steps)")
    return losses, times


def report(final: dict | None, twins: dict, terms: int, steps: int, start: dict | None, losses: list, times: list,
           what: str, model: str, quiet: bool) -> None:
    """Rank 0: check the final ``what`` (e.g. ``"weights"``) against the float64 twin, then print the summary."""
    from distfuse.testing.tolerance import check_trained_state, rounding_bound

    if dist.get_rank() != 0:
        return
    worst, torch_nn = check_trained_state(final, twins, terms, steps, start, what)
    if quiet:
        return
    if len(times) > 1:
        print(f"time per step: {1e3 * sum(times[1:]) / (len(times) - 1):.1f} ms (mean of steps 2..{steps}; step 1 "
              f"{1e3 * times[0]:.1f} ms includes set-up)")
    print(f"every step's loss matched the sequential torch.nn {model} in float64 (within the float32 rounding "
          f"bound {rounding_bound(torch.float32, terms, steps):.1e} at step {steps}); final loss "
          f"{losses[-1][0]:.6f}")
    print(f"{what} agree with the float64 twin: worst {worst.key}, {worst.error:.1e} of {worst.allowed:.1e} "
          f"allowed ({worst.ratio:.1e} of its allowance; torch.nn in float32: {torch_nn.ratio:.1e})")


def print_paths(model: nn.Module) -> None:
    """Print the path (fused or unfused, and why) each layer of ``model`` took in its latest forward."""
    print("layer paths (fused or unfused, and why):")
    for name, layer in model.named_modules():
        decisions = dict(getattr(layer, "last_decisions", None) or {})
        if getattr(layer, "last_decision", None) is not None:
            decisions[""] = layer.last_decision
        for part, decision in decisions.items():
            where = f"{name}.{part}" if part else name
            print(f"  {where:<24} {type(layer).__name__:<32} {decision.path} ({decision.reason})")
