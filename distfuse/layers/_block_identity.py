"""Block identity in per-rank checkpoints: a layer's ``state_dict()`` says which blocks it holds.

Each rank's ``state_dict()`` of a distributed layer holds that rank's blocks only.  Two
ranks' blocks often have equal shapes (2 over 2 workers, or any even split), so a rank
that loads another rank's file, or a file saved on another grid, would load the wrong
blocks without any error.  :class:`BlockIdentityMixin` adds an ``_extra_state`` entry,
derived from ``param_layouts()``, describing per parameter (and per buffer a layout
lists)::

    global_shape     the sequential tensor's shape
    block            the global box this rank holds, [[lo, hi], ...] per dimension
                     (None where it holds none)
    partition_shape, index, split_dims    where that box comes from (for messages)

plus the layer's class and the saving rank.  Loading compares the file's global shapes
and boxes with the layer's own *before* any tensor is copied and raises
:class:`~distfuse.errors.PartitionError` naming the first difference.  The box is what
decides whether the data fits: the same box on another rank (a permuted partition of
the same grid) or held by another replica (a layout with ``split_dims``) is the same
data, and is accepted; another box of equal shape is refused.

Use: list the mixin first among the bases, ``class MyLayer(BlockIdentityMixin,
nn.Module)``.  The check runs in ``load_state_dict`` on the rank that loads (it is
local, like ``load_state_dict``); a state dict without the entry is refused under
``strict=True`` (torch reports the missing ``_extra_state`` key) and loaded unchecked
under ``strict=False``.
"""

from __future__ import annotations

from torch import nn

from distfuse.errors import PartitionError, where
from distfuse.geometry.decomposition import block_range

__all__ = ["BlockIdentityMixin", "block_identity", "check_block_identity", "layout_box", "is_primary"]

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
    import torch.distributed as dist

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
