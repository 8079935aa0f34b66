"""Where a distributed layer's parameters live: moving them to and from a sequential layer, and per-rank files.

Each distributed layer describes where its parameters live with :class:`ParamLayout`: the
parameter's global shape (the sequential layer's) and the CartesianPartition whose workers
each own one balanced block of it.  With that description two generic, collective helpers
interoperate with sequential ``state_dict`` s: :func:`load_sequential` scatters a sequential
layer's parameters (on one rank) into the distributed layer's blocks, and
:func:`collect_sequential` gathers them back on one rank.

Block identity in per-rank checkpoints.  Each rank's ``state_dict()`` holds that rank's
blocks only, and two ranks' blocks often have equal shapes, so a rank that loads another
rank's file, or a file saved on another grid, would load the wrong blocks without any
error.  :class:`BlockIdentityMixin` (list it first among a layer's bases) adds an
``_extra_state`` entry derived from ``param_layouts()``, per parameter (and per buffer a
layout lists)::

    global_shape     the sequential tensor's shape
    block            the global box this rank holds, [[lo, hi], ...] per dimension
                     (None where it holds none)
    partition_shape, index, split_dims    where that box comes from (for messages)

plus the layer's class and the saving rank.  ``load_state_dict`` compares the boxes *before*
any tensor is copied and raises :class:`~distfuse.errors.PartitionError` naming the first
difference: the same box on another rank or replica is the same data; another box of equal
shape is refused.  Without the entry: refused under ``strict=True``, unchecked otherwise.

:class:`WeightAndBias` holds the blocks of a ``weight`` and an optional ``bias``, drawn as
``torch.nn.Linear`` and ``ConvNd`` draw them: the linears' and the convolutions' parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import init

from distfuse.errors import PartitionError, ShapeError, where
from distfuse.geometry.decomposition import block_range, local_shape, local_slices
from distfuse.groups import metadata_group
from distfuse.partition import CartesianPartition
from distfuse.primitives.distribute import collect_tensor, distribute_tensor

__all__ = ["ParamLayout", "load_sequential", "collect_sequential", "BlockIdentityMixin", "block_identity",
           "check_block_identity", "layout_box", "is_primary", "WeightAndBias"]


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives: ``name`` on the distributed layer, ``seq_name`` in the sequential layer's
    ``state_dict``, ``global_shape`` the sequential shape, ``P`` the owners (block ``index`` on the worker at
    ``index``).  ``split_dims`` (a tuple) instead marks a tensor every worker of ``P`` holds a copy of (a norm's
    weight, its running statistics): ``P``'s dimension ``split_dims[i]`` splits the tensor's dimension ``i``,
    later dimensions stay whole, and ``P``'s other dimensions replicate them (``()``: the whole tensor).  Such
    tensors move as pickled host objects over the metadata group: they are small.
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
    """Check the source's state dict on the source, then tell every rank the verdict (one object broadcast;
    otherwise a missing key would raise on ``src`` alone while the other ranks wait inside the scatter)."""
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
    """Copy a sequential layer's parameters (held by world rank ``src``; other ranks pass None) into ``layer``'s
    blocks.  Collective over the world."""
    state = None
    if sequential is not None:
        state = sequential.state_dict() if isinstance(sequential, nn.Module) else sequential
    layouts = _layouts(layer)
    _check_sequential_state(layer, state, layouts, src)
    for lay in layouts:
        full = state[lay.seq_name] if state is not None and dist.get_rank() == src else None
        if lay.split_dims is not None:  # every worker of lay.P takes its block of src's tensor (one object broadcast)
            box = [full.detach().cpu() if full is not None else None]
            dist.broadcast_object_list(box, src=src, group=metadata_group())
            block = box[0][lay.replica_slices()] if lay.P.active else None
        else:
            block = distribute_tensor(None if full is None else full.detach(), lay.P, src=src)
        if lay.P.active:
            target = getattr(layer, lay.name)
            if tuple(target.shape) != tuple(block.shape):
                raise ShapeError(f"{where(type(layer).__name__)}: block of {lay.name} has shape "
                                 f"{tuple(target.shape)}, expected {tuple(block.shape)}")
            target.copy_(block.to(target.dtype))


@torch.no_grad()
def collect_sequential(layer: nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The sequential ``state_dict`` assembled from ``layer``'s blocks on world rank ``dst`` (None elsewhere);
    collective over the world."""
    out = {}
    for lay in _layouts(layer):
        if lay.split_dims is not None:
            out[lay.seq_name] = _collect_replicated(layer, lay, dst)
            continue
        local = getattr(layer, lay.name).detach() if lay.P.active else None
        out[lay.seq_name] = collect_tensor(local, lay.P, dst=dst)
    return out if torch.distributed.get_rank() == dst else None


def _collect_replicated(layer: nn.Module, lay: ParamLayout, dst: int) -> torch.Tensor | None:
    """Assemble a replicated layout's blocks on ``dst`` from one copy of each (one object gather over the world)."""
    piece = None
    if lay.P.active and is_primary(lay, lay.P.index):
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


# ---------------------------------------------------------------- block identity

FORMAT = 2
Box = tuple[tuple[int, int], ...]


def layout_box(lay, index) -> Box:
    """The global box that the worker at ``index`` of ``lay.P`` holds of the layout's tensor.

    Without ``split_dims``: the balanced block at ``index`` (partition dimension ``d``
    splits tensor dimension ``d``).  With ``split_dims``: partition dimension
    ``split_dims[i]`` splits tensor dimension ``i``, trailing tensor dimensions stay
    whole, and the other partition dimensions hold copies.
    """
    G = tuple(int(n) for n in lay.global_shape)
    split = getattr(lay, "split_dims", None)
    if split is None:
        return tuple(block_range(n, p, i) for n, p, i in zip(G, lay.P.shape, index, strict=True))
    box = [block_range(G[i], lay.P.shape[d], index[d]) for i, d in enumerate(split)]
    return tuple(box + [(0, n) for n in G[len(split):]])


def is_primary(lay, index) -> bool:
    """Whether the worker at ``index`` holds the first copy of its box (always, without ``split_dims``)."""
    split = getattr(lay, "split_dims", None)
    return split is None or all(i == 0 for d, i in enumerate(index) if d not in split)


def block_identity(layer: nn.Module) -> dict:
    """The identity record of ``layer``'s blocks on this rank (plain Python: picklable, JSON-able)."""
    blocks = {}
    for lay in layer.param_layouts():
        owned = lay.P.active
        split = getattr(lay, "split_dims", None)
        tensor = getattr(layer, lay.name, None) if owned else None
        blocks[lay.name] = {
            "global_shape": list(lay.global_shape),
            "block": [list(r) for r in layout_box(lay, lay.P.index)] if owned else None,
            "block_shape": list(tensor.shape) if tensor is not None else None,
            "partition_shape": list(lay.P.shape),
            "index": list(lay.P.index) if owned else None,
            "split_dims": list(split) if split is not None else None,
        }
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return {"format": FORMAT, "layer": type(layer).__name__, "saved_by_world_rank": rank, "blocks": blocks}


def check_block_identity(layer: nn.Module, saved) -> None:
    """Raise :class:`PartitionError` unless ``saved`` describes the blocks ``layer`` holds on this rank."""
    op = f"{type(layer).__name__}.load_state_dict"
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or not isinstance(saved.get("blocks"), dict):
        raise PartitionError(f"{where(op)}: the state dict's block identity is not one this version writes "
                             f"(format {FORMAT}); got {type(saved).__name__}")
    mine = block_identity(layer)
    origin = f"saved by world rank {saved.get('saved_by_world_rank')} from a {saved.get('layer')}"
    if set(saved["blocks"]) != set(mine["blocks"]):
        raise PartitionError(f"{where(op)}: the state dict ({origin}) describes tensors "
                             f"{sorted(saved['blocks'])}, this layer has {sorted(mine['blocks'])}")
    for name, want in mine["blocks"].items():
        got = saved["blocks"][name]
        for field in ("global_shape", "block", "block_shape"):
            if got.get(field) != want[field]:
                where_from = (f"partition {got.get('partition_shape')} index {got.get('index')}",
                              f"partition {want['partition_shape']} index {want['index']}")
                raise PartitionError(
                    f"{where(op)}: refusing to load {name}: the state dict ({origin}, {where_from[0]}) holds "
                    f"{field} {got.get(field)}, this rank's layer ({where_from[1]}) needs {want[field]}; load "
                    "the file this rank saved, or reshard a distributed checkpoint (distfuse.interop.checkpoint)")


class BlockIdentityMixin:
    """Adds the block identity to a distributed layer's state dict and checks it on load (see the module docstring)."""

    def get_extra_state(self) -> dict:
        return block_identity(self)

    def set_extra_state(self, state) -> None:
        check_block_identity(self, state)  # already checked before the copy; kept for direct callers

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:  # before torch copies any tensor: a refused load leaves this layer untouched
            check_block_identity(self, state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class WeightAndBias(BlockIdentityMixin):
    """``weight`` and an optional ``bias``, each held as balanced blocks of the sequential layer's tensor.

    Subclasses call :meth:`_set_param_home`, set ``P_weight`` and ``P_bias`` (the owners: block
    ``index`` on the worker at ``index``) and define ``param_shapes`` (the global weight shape,
    then the bias's if there is one).  A rank that owns no block of a parameter registers it as
    None (as ``bias=False`` does), so its ``state_dict`` has no entry.  Every world rank draws
    the full global tensors (:mod:`distfuse.layers`): one global weight of transient memory per
    rank; for a model too big for that, initialise the blocks yourself or use :func:`load_sequential`.
    The dtype and device of a rank without parameters (it draws them, or receives them) come from
    a zero-size buffer (``_dtype_probe``, not persistent) that ``Module.to`` / ``.half()`` convert
    with the owners' parameters: gloo receives a message into a buffer of another dtype without error.
    """

    def _set_param_home(self, device, dtype) -> None:
        """The parameters' device and dtype (None: torch's default dtype), kept in ``_dtype_probe``."""
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.register_buffer("_dtype_probe", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def param_layouts(self) -> list[ParamLayout]:
        """Where the blocks live (for :func:`load_sequential` / :func:`collect_sequential`)."""
        return [ParamLayout(name, name, P, shape) for name, P, shape in
                zip(("weight", "bias"), (self.P_weight, self.P_bias), self.param_shapes, strict=False)]

    def _register_params(self) -> None:
        """Register this rank's blocks of ``weight`` and ``bias`` (None where it owns none, and without a bias),
        then initialise them (:meth:`reset_parameters`)."""
        layouts = {lay.name: lay for lay in self.param_layouts()}
        for name in ("weight", "bias"):
            lay, block = layouts.get(name), None
            if lay is not None and lay.P.active:
                shape = local_shape(lay.global_shape, lay.P.shape, lay.P.index)
                block = nn.Parameter(torch.empty(shape, dtype=self._dtype_probe.dtype, device=self._dtype_probe.device))
            self.register_parameter(name, block)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``reset_parameters`` of ``torch.nn.Linear`` / ``ConvNd`` on the global tensors (every rank draws them with
        the same calls, order, dtype and device: one generator state gives one set of values); owners keep blocks."""
        dtype, device = self._dtype_probe.dtype, self._dtype_probe.device
        full = {"weight": torch.empty(self.param_shapes[0], dtype=dtype, device=device)}
        init.kaiming_uniform_(full["weight"], a=math.sqrt(5))
        if len(self.param_shapes) > 1:
            full["bias"] = torch.empty(self.param_shapes[1], dtype=dtype, device=device)
            fan_in, _ = init._calculate_fan_in_and_fan_out(full["weight"])
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(full["bias"], -bound, bound)
        for lay in self.param_layouts():
            if lay.P.active:
                getattr(self, lay.name).copy_(full[lay.name][local_slices(lay.global_shape, lay.P.shape, lay.P.index)])
