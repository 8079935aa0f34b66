"""Where a model's state lives: distfuse blocks found by module path, and the replicated rest.

The whole-model helpers (:mod:`distfuse.model`) and the checkpoints
(:mod:`distfuse.interop.checkpoint`) share one map of a model that mixes distfuse layers
(each describes its parameters with ``param_layouts()``, :mod:`distfuse.layers._params`)
and plain torch modules:

* **blocks**: per distfuse layer at module path ``p`` and per layout, the key ``p.<seq_name>``
  the tensor has in the equivalent ``torch.nn`` model's ``state_dict`` (``0.weight`` for the
  first layer of a ``Sequential``), its global shape, and the partition whose workers each
  hold one balanced block (or, with ``split_dims``, copies of blocks: a norm's weight and
  statistics);
* **plain**: every other entry of ``model.state_dict()``, held whole by every rank (replicated).

A distfuse layer's descendants are not searched (its layouts speak for it), and its state
may hold only its layout parameters and its block identity (``_extra_state``): anything else
would be dropped silently, so :func:`map_model` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.groups import metadata_group
from distfuse.layers._params import ParamLayout, is_primary

__all__ = ["BlockEntry", "ModelMap", "map_model", "is_distributed_layer", "gather_block_dtypes", "agree"]

EXTRA_STATE = "_extra_state"


def is_distributed_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a distfuse layer (it describes its parameters with ``param_layouts()``)."""
    return callable(getattr(module, "param_layouts", None))


@dataclass(frozen=True)
class BlockEntry:
    """One distributed parameter: its sequential key, its layer and its layout."""

    key: str
    module_path: str
    module: nn.Module
    layout: ParamLayout

    @property
    def tensor(self) -> torch.Tensor | None:
        """This rank's block (None where this rank holds none)."""
        return getattr(self.module, self.layout.name) if self.layout.P.active else None

    @property
    def primary(self) -> bool:
        """Whether this rank holds the first copy of its block (every holder, unless the layout has ``split_dims``)."""
        return self.layout.P.active and is_primary(self.layout, self.layout.P.index)


@dataclass(frozen=True)
class ModelMap:
    blocks: tuple[BlockEntry, ...]
    plain: dict[str, torch.Tensor]  # key -> the model's own tensor (Parameter or buffer), replicated

    def block_param_ids(self) -> set[int]:
        return {id(e.tensor) for e in self.blocks if e.tensor is not None}


def map_model(model: nn.Module) -> ModelMap:
    """The :class:`ModelMap` of ``model`` (local: no communication)."""
    blocks: list[BlockEntry] = []
    layer_paths: list[str] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") or p == "" for p in layer_paths):
            continue  # inside a distfuse layer: its layouts speak for it
        if not is_distributed_layer(module):
            continue
        layer_paths.append(path)
        layouts = list(module.param_layouts())
        names = {lay.name for lay in layouts}
        for key in module.state_dict(keep_vars=True):
            if key not in names and key != EXTRA_STATE:
                raise UnsupportedError(
                    f"{where('map_model')}: the distfuse layer {path or '<model>'} ({type(module).__name__}) holds "
                    f"state {key!r} that its param_layouts() does not describe; it would be dropped")
        blocks.extend(BlockEntry(f"{path}.{lay.seq_name}" if path else lay.seq_name, path, module, lay)
                      for lay in layouts)
    plain = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if any(key.startswith(p + ".") or p == "" for p in layer_paths):
            continue
        if not isinstance(value, torch.Tensor):
            raise UnsupportedError(f"{where('map_model')}: state {key!r} is a {type(value).__name__}, not a tensor")
        plain[key] = value
    keys = [e.key for e in blocks] + list(plain)
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ShapeError(f"{where('map_model')}: keys {dup} appear twice in the sequential naming of this model")
    return ModelMap(tuple(blocks), plain)


def gather_block_dtypes(mm: ModelMap, op: str, local: bool = False) -> dict[str, torch.dtype]:
    """Every block's dtype, learnt from its owners, on every rank; checks that the ranks built the same model.

    One object all-gather over the world.  Raises the same :class:`ShapeError` on every
    rank when the manifests differ (a model built differently on some rank) or when
    owners of one parameter disagree on its dtype.  ``local``: one process on its own (no
    communication), which cannot hold distributed blocks.
    """
    if local:
        if mm.blocks:
            raise UnsupportedError(f"{where(op)}: a single process cannot hold the blocks of distfuse layers "
                                   f"({mm.blocks[0].module_path or '<model>'}); use the collective form")
        return {}
    owned = {e.key: str(e.tensor.dtype) for e in mm.blocks if e.tensor is not None}
    # what every rank must agree on: block keys and global shapes, plain keys, shapes and dtypes
    manifest = (tuple((e.key, tuple(e.layout.global_shape)) for e in mm.blocks),
                tuple((k, tuple(t.shape), str(t.dtype)) for k, t in mm.plain.items()))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (manifest, owned), group=metadata_group())
    bad = [w for w, (m, _) in enumerate(rows) if m != rows[0][0]]
    if bad:
        raise ShapeError(f"{where(op)}: the ranks hold different models (world ranks {bad} differ from rank 0 in "
                         "their distributed parameters or their plain state); build the model alike on every rank")
    dtypes: dict[str, set] = {}
    for _, row in rows:
        for key, dt in row.items():
            dtypes.setdefault(key, set()).add(dt)
    mixed = {k: sorted(v) for k, v in dtypes.items() if len(v) > 1}
    if mixed:
        raise ShapeError(f"{where(op)}: the owners of one parameter hold blocks of different dtypes: {mixed}")
    missing = [e.key for e in mm.blocks if e.key not in dtypes]
    if missing:
        raise ShapeError(f"{where(op)}: no rank owns a block of {missing}")
    return {k: getattr(torch, v.pop().replace("torch.", "")) for k, v in dtypes.items()}


def agree(problem: str | None, op: str, cls: type = ShapeError, local: bool = False) -> None:
    """Raise ``cls`` on every rank when any rank found a problem (one object all-gather over the world).

    ``local``: this process alone (no communication).
    """
    if local:
        rows = [problem]
    else:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, problem, group=metadata_group())
    by_problem: dict[str, list[int]] = {}
    for w, p in enumerate(rows):
        if p is not None:
            by_problem.setdefault(p, []).append(w)
    if by_problem:
        lines = "; ".join(f"{p} (found on world ranks {ws})" for p, ws in by_problem.items())
        raise cls(f"{where(op)}: {lines}")
