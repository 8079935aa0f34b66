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
import torch.distributed as dist
from torch import nn

from distfuse.errors import ShapeError, where
from distfuse.geometry.decomposition import local_slices
from distfuse.groups import metadata_group
from distfuse.partition import CartesianPartition
from distfuse.primitives.distribute import collect_tensor, distribute_tensor

__all__ = ["ParamLayout", "load_sequential", "collect_sequential"]


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives.

    Attributes:
        name: attribute of the distributed layer (``"weight"``, ``"bias"``).
        seq_name: its key in the sequential layer's ``state_dict``.
        P: the owners; block ``index`` of the global parameter lives on the worker at ``index``.
        global_shape: the sequential parameter's shape.
        split_dims: None (the default) for the layout above.  A tuple for a parameter or buffer
            that every worker of ``P`` holds a copy of (a norm's weight, its running statistics):
            ``P``'s dimension ``split_dims[i]`` splits the tensor's dimension ``i`` into balanced
            blocks (dimensions past ``len(split_dims)`` stay whole), and ``P``'s other dimensions
            replicate them; ``()`` replicates the whole tensor.
            Such tensors move as pickled host objects over the metadata group: they are small.
    """

    name: str
    seq_name: str
    P: CartesianPartition
    global_shape: tuple[int, ...]
    split_dims: tuple[int, ...] | None = None

    def replica_slices(self) -> tuple[slice, ...]:
        """This worker's block of a replicated layout (``split_dims`` set; an active worker of ``P``)."""
        whole = len(self.global_shape) - len(self.split_dims)
        grid = [self.P.shape[d] for d in self.split_dims] + [1] * whole
        return local_slices(self.global_shape, grid, [self.P.index[d] for d in self.split_dims] + [0] * whole)


def _layouts(layer: nn.Module) -> list[ParamLayout]:
    if not hasattr(layer, "param_layouts"):
        raise TypeError(f"{where('load_sequential')}: {type(layer).__name__} is not a distributed distfuse layer "
                        "(it has no param_layouts())")
    return list(layer.param_layouts())


def _check_sequential_state(layer: nn.Module, state: dict | None, layouts: list[ParamLayout], src: int) -> None:
    """Check the source's state dict on the source, then tell every rank the verdict (one object broadcast).

    Without this a missing key or a wrong shape would raise on ``src`` alone while the
    other ranks wait inside the scatter until the process-group timeout.
    """
    problem = None
    if dist.get_rank() == src:
        if state is None:
            problem = f"world rank {src} is the source but passed no sequential layer or state dict"
        else:
            for lay in layouts:
                if lay.seq_name not in state:
                    problem = f"the sequential state has no {lay.seq_name!r} (keys: {sorted(state)})"
                    break
                if tuple(state[lay.seq_name].shape) != lay.global_shape:
                    problem = (f"sequential {lay.seq_name}: expected shape {lay.global_shape}, got "
                               f"{tuple(state[lay.seq_name].shape)}")
                    break
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=src, group=metadata_group())
    if verdict[0] is not None:
        raise ShapeError(f"{where(type(layer).__name__ + '.load_sequential')}: {verdict[0]}")


@torch.no_grad()
def load_sequential(layer: nn.Module, sequential: nn.Module | dict | None, src: int = 0) -> None:
    """Copy a sequential layer's parameters (held by world rank ``src``) into ``layer``'s blocks.

    Collective over the world.  Other ranks pass None.
    """
    state = None
    if sequential is not None:
        state = sequential.state_dict() if isinstance(sequential, nn.Module) else sequential
    layouts = _layouts(layer)
    _check_sequential_state(layer, state, layouts, src)
    for lay in layouts:
        full = state[lay.seq_name] if state is not None and dist.get_rank() == src else None
        if lay.split_dims is not None:
            _load_replicated(layer, lay, full, src)
            continue
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
        if lay.split_dims is not None:
            out[lay.seq_name] = _collect_replicated(layer, lay, dst)
            continue
        local = getattr(layer, lay.name).detach() if lay.P.active else None
        out[lay.seq_name] = collect_tensor(local, lay.P, dst=dst)
    return out if torch.distributed.get_rank() == dst else None


def _load_replicated(layer: nn.Module, lay: ParamLayout, full: torch.Tensor | None, src: int) -> None:
    """Every worker of ``lay.P`` copies its block of ``src``'s tensor (one object broadcast over the world)."""
    box = [full.detach().cpu() if full is not None else None]
    dist.broadcast_object_list(box, src=src, group=metadata_group())
    if lay.P.active:
        target = getattr(layer, lay.name)
        block = box[0][lay.replica_slices()]
        if tuple(target.shape) != tuple(block.shape):
            raise ShapeError(f"{where(type(layer).__name__)}: block of {lay.name} has shape "
                             f"{tuple(target.shape)}, expected {tuple(block.shape)}")
        target.copy_(block.to(target.dtype))


def _collect_replicated(layer: nn.Module, lay: ParamLayout, dst: int) -> torch.Tensor | None:
    """Assemble a replicated layout's blocks on ``dst`` from one copy of each (one object gather over the world)."""
    piece = None
    if lay.P.active and all(i == 0 for d, i in enumerate(lay.P.index) if d not in lay.split_dims):
        piece = (lay.replica_slices(), getattr(layer, lay.name).detach().cpu())
    pieces = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(piece, pieces, dst=dst, group=metadata_group())
    if pieces is None:
        return None
    pieces = [p for p in pieces if p is not None]
    full = torch.empty(lay.global_shape, dtype=pieces[0][1].dtype)
    for slices, block in pieces:
        full[slices] = block
    return full.to(lay.P.device)
