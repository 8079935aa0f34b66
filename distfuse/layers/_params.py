"""Moving parameters between a sequential ``torch.nn`` layer and a distributed one.

Each distributed layer describes where its parameters live with :class:`ParamLayout`:
the parameter's global shape (the sequential layer's), and the CartesianPartition
whose workers each own one balanced block of it (partition dimension d splits
parameter dimension d).  Workers outside that partition hold no such parameter; they
receive copies by broadcast in forward, and their gradients are summed back to the
owners by the broadcast's adjoint.

With that description two generic, collective helpers interoperate with sequential
``state_dict`` s:

* :func:`load_sequential` scatters a sequential layer's parameters (on one rank) into
  the distributed layer's blocks;
* :func:`collect_sequential` gathers them back into a sequential ``state_dict`` on one
  rank.

Checkpointing itself needs nothing special: each rank's ``state_dict()`` holds its own
blocks, and loading it back on the same partition layout restores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distfuse.errors import ShapeError, where
from distfuse.partition import CartesianPartition
from distfuse.primitives.repartition import collect_tensor, distribute_tensor

__all__ = ["ParamLayout", "load_sequential", "collect_sequential"]


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives.

    Attributes:
        name: attribute of the distributed layer (``"weight"``, ``"bias"``).
        seq_name: its key in the sequential layer's ``state_dict``.
        P: the owners; block ``index`` of the global parameter lives on the worker at ``index``.
        global_shape: the sequential parameter's shape.
    """

    name: str
    seq_name: str
    P: CartesianPartition
    global_shape: tuple[int, ...]


def _layouts(layer: nn.Module) -> list[ParamLayout]:
    if not hasattr(layer, "param_layouts"):
        raise TypeError(f"{type(layer).__name__} does not describe its parameter layout (param_layouts())")
    return list(layer.param_layouts())


@torch.no_grad()
def load_sequential(layer: nn.Module, sequential: nn.Module | dict | None, src: int = 0) -> None:
    """Copy a sequential layer's parameters (held by world rank ``src``) into ``layer``'s blocks.

    Collective over the world.  Other ranks pass None.
    """
    state = None
    if sequential is not None:
        state = sequential.state_dict() if isinstance(sequential, nn.Module) else sequential
    for lay in _layouts(layer):
        full = None
        if state is not None:
            full = state[lay.seq_name]
            if tuple(full.shape) != lay.global_shape:
                raise ShapeError(f"{where(type(layer).__name__)}: sequential {lay.seq_name} has shape "
                                 f"{tuple(full.shape)}, expected {lay.global_shape}")
        block = distribute_tensor(None if full is None else full.detach(), lay.P, src=src)
        if lay.P.active:
            param = getattr(layer, lay.name)
            if tuple(param.shape) != tuple(block.shape):
                raise ShapeError(f"{where(type(layer).__name__)}: block of {lay.name} has shape "
                                 f"{tuple(param.shape)}, expected {tuple(block.shape)}")
            param.copy_(block.to(param.dtype))


@torch.no_grad()
def collect_sequential(layer: nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The sequential ``state_dict`` assembled from ``layer``'s blocks on world rank ``dst`` (None elsewhere).

    Collective over the world.
    """
    out = {}
    for lay in _layouts(layer):
        local = getattr(layer, lay.name).detach() if lay.P.active else None
        out[lay.seq_name] = collect_tensor(local, lay.P, dst=dst)
    return out if torch.distributed.get_rank() == dst else None
