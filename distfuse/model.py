"""Whole-model helpers: move a model's state to and from ``torch.nn``, optimizers, global gradient clipping.

The helpers work on :func:`~distfuse.interop.model_map.map_model`'s map of a model (the distfuse
layers' blocks under their keys in the equivalent ``torch.nn`` model; the plain modules' state,
replicated).  All but :func:`make_optimizer` and :func:`replicated_parameters` are collective over
the world, and a problem found on one rank (a model built differently elsewhere, a missing key)
raises the same :class:`~distfuse.errors.ShapeError` on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from distfuse._compat import all_gather_flat
from distfuse.errors import DistfuseError, UnsupportedError, where
from distfuse.groups import world_group
from distfuse.interop.model_map import agree, gather_block_dtypes, map_model
from distfuse.layers._params import collect_sequential as layer_collect_sequential
from distfuse.layers._params import load_sequential as layer_load_sequential
from distfuse.partition import Partition

__all__ = ["load_sequential", "collect_sequential", "make_optimizer", "clip_grad_norm_", "replicated_parameters"]


def _source_problem(state: dict | None, mm, strict: bool) -> str | None:
    """What is wrong with the source's sequential state (checked on the source only)."""
    if state is None:
        return "this rank is the source but passed no sequential model or state dict"
    expected = {e.key: tuple(e.layout.global_shape) for e in mm.blocks}
    expected.update({k: tuple(t.shape) for k, t in mm.plain.items()})
    for key, shape in expected.items():
        if key not in state:
            return f"the sequential state has no {key!r}"
        if tuple(state[key].shape) != shape:
            return f"sequential {key}: expected shape {shape}, got {tuple(state[key].shape)}"
    extra = sorted(set(state) - set(expected))
    if strict and extra:
        return f"the sequential state has keys this model does not: {extra} (strict=False ignores them)"
    return None


@torch.no_grad()
def load_sequential(model: nn.Module, sequential: nn.Module | dict | None, src: int = 0, strict: bool = True) -> None:
    """Copy a ``torch.nn`` model's state (held by world rank ``src``) into ``model``.

    ``sequential`` is the equivalent ``torch.nn`` model or its ``state_dict`` on rank
    ``src``; other ranks pass None.  Every distfuse layer gets its part through its own
    layouts (:func:`distfuse.layers._params.load_sequential`: blocks scattered, copies
    broadcast); plain parameters and buffers are broadcast to every rank.  ``strict``:
    refuse sequential keys that ``model`` lacks.  Collective over the world.
    """
    op = "load_sequential"
    mm = map_model(model)
    gather_block_dtypes(mm, op)  # same model on every rank
    me = dist.get_rank()
    state = None
    if me == src and sequential is not None:
        state = sequential.state_dict() if isinstance(sequential, nn.Module) else dict(sequential)
    agree(_source_problem(state, mm, strict) if me == src else None, op)
    for _, layer, entries in _layers(mm):
        part = {e.layout.seq_name: state[e.key].detach() for e in entries} if me == src else None
        layer_load_sequential(layer, part, src=src)
    for key, t in mm.plain.items():
        buf = state[key].detach().to(t.device, t.dtype).contiguous() if me == src else torch.empty_like(t)
        dist.broadcast(buf, src, group=world_group())  # distfuse's group: DISTFUSE_TIMEOUT bounds the wait
        t.copy_(buf)


@torch.no_grad()
def collect_sequential(model: nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The ``state_dict`` of the equivalent ``torch.nn`` model, assembled on world rank ``dst`` (None elsewhere).

    Every distfuse layer's tensors are gathered through its layouts
    (:func:`distfuse.layers._params.collect_sequential`); plain parameters and buffers
    are rank ``dst``'s own (they are replicated).  Collective over the world.
    """
    op = "collect_sequential"
    mm = map_model(model)
    gather_block_dtypes(mm, op)
    out: dict[str, torch.Tensor] = {}
    for path, layer, _ in _layers(mm):
        part = layer_collect_sequential(layer, dst=dst)
        if part is not None:
            out.update({(f"{path}.{k}" if path else k): v for k, v in part.items()})
    if dist.get_rank() != dst:
        return None
    out.update({k: t.detach().clone() for k, t in mm.plain.items()})
    return out


def _layers(mm) -> list[tuple[str, nn.Module, list]]:
    """``(module path, layer, its entries)`` per distfuse layer, in model order."""
    out: dict[str, tuple[nn.Module, list]] = {}
    for e in mm.blocks:
        out.setdefault(e.module_path, (e.module, []))[1].append(e)
    return [(path, layer, entries) for path, (layer, entries) in out.items()]


def make_optimizer(optimizer_cls: type, params, **kwargs) -> torch.optim.Optimizer:
    """``optimizer_cls(params, **kwargs)``, also on a rank whose ``params`` are empty.

    ``params`` is what torch optimizers take (tensors or param-group dicts) or a module
    (its ``parameters()``).  torch refuses an empty parameter list, so a rank that owns no
    parameter gets one empty group: ``step``/``zero_grad`` do nothing, ``state_dict``,
    ``load_state_dict`` and LR schedulers work as on the other ranks.  Local (no
    communication).  Closure-driven optimizers that read their first parameter (LBFGS)
    still need one.
    """
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    return optimizer_cls(params or [{"params": []}], **kwargs)


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters every rank holds whole: those of plain modules, outside every distfuse layer (local).

    A plain module that runs on each rank's blocks (a LayerNorm over features, a PReLU)
    gives each rank a part of its gradient; sum those over the ranks (as data
    parallelism does) before :func:`clip_grad_norm_` and the optimizer step.
    """
    blocks = map_model(model).block_param_ids()
    return [p for p in model.parameters() if id(p) not in blocks]


def _local_part(grads: list[torch.Tensor], p: float, device) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (the max of ``|g|`` for p = inf), in float64 on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(p):
        return torch.stack([g.detach().abs().max().to(device, torch.float64) if g.numel() else
                            torch.zeros((), dtype=torch.float64, device=device) for g in grads]).max()
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64).to(device) for g in grads])
    return (norms ** p).sum()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip every gradient of ``model`` by the norm of the whole model's gradient, alike on every rank.

    The norm is that of the equivalent ``torch.nn`` model's gradient, as
    ``torch.nn.utils.clip_grad_norm_`` computes it there:

    * each distributed block (a parameter in some layer's ``param_layouts()``) counts
      once: it lives on one worker, or, for a layout with ``split_dims`` (a norm layer's
      weight), each worker holding a copy of the block holds the whole gradient of it
      and only the first copy counts;
    * each replicated parameter (a plain module's) counts once, not once per rank: its
      contribution is the largest over the ranks holding a gradient (each replica's when
      they are in sync, the one rank's when only one rank ran the module).

    Every rank then scales all its gradients by ``min(1, max_norm / (norm + 1e-6))``.
    ``norm_type``: any p > 0 or ``inf``.  Returns the norm as a 0-d float64 tensor on the
    world's device, bitwise equal on every rank (each rank reduces the same gathered
    partial sums in the same order).  ``error_if_nonfinite`` raises
    :class:`~distfuse.errors.DistfuseError` on every rank for a NaN or infinite norm.
    Collective over the world: one all-gather of two float64 per rank.
    """
    op = "clip_grad_norm_"
    p = float(norm_type)
    if not p > 0:
        raise UnsupportedError(f"{where(op)}: norm_type must be > 0 or inf, got {norm_type}")
    mm = map_model(model)
    block_ids = mm.block_param_ids()
    held = [e for e in mm.blocks if e.tensor is not None and e.tensor.grad is not None]
    split = [e.tensor.grad for e in held if e.primary]
    copies = [e.tensor.grad for e in held if not e.primary]  # counted through their first copy, clipped alike
    replicated = [q.grad for q in model.parameters() if id(q) not in block_ids and q.grad is not None]
    world = Partition.world()
    device = world.device
    local = torch.stack([_local_part(split, p, device), _local_part(replicated, p, device)])
    rows = torch.empty(2 * world.size, dtype=torch.float64, device=device)
    all_gather_flat(rows, local, group=world.group)
    rows = rows.view(world.size, 2)
    if math.isinf(p):
        total = rows.max()
    else:
        total = (rows[:, 0].sum() + rows[:, 1].max()) ** (1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise DistfuseError(f"{where(op)}: the total norm of order {norm_type} of the gradients is non-finite "
                            f"({float(total)}), so it cannot be clipped; error_if_nonfinite=False skips this check")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in split + copies + replicated:
        g.mul_(coef.to(g.device, g.dtype))
    return total
