"""Distributed checkpoints of distfuse models with ``torch.distributed.checkpoint`` (DCP), resharding on load.

What is saved (one DCP checkpoint, keys as DCP flattens nested dicts)::

    model.<key>                 every parameter and buffer under its key in the equivalent torch.nn
                                model (``0.weight`` for the first layer of a Sequential); a distfuse
                                layer's as a DTensor (:func:`~distfuse.interop.dtensor.param_to_dtensor`:
                                blocks are shards, copies of a block are replicas, written once),
                                a plain module's tensor whole (replicated: DCP writes it once)
    optim.state.<key>.<name>    optimizer state: a tensor shaped like its parameter is
                                sharded like it; 0-d tensors (``step``) and numbers are replicated
    optim.param_groups          the optimizer's hyperparameters, one dict per group (one opaque entry)
    extra                       any picklable object (epoch, data-loader position; one opaque entry)

Every entry is described by its global shape and the chunk each rank holds, so DCP reshards
on load: :func:`load_checkpoint` reads into a model built on other partitions, another grid
or another world size.  The ``model`` entries are a plain ``torch.nn`` state dict in DCP
form, which the equivalent ``torch.nn`` model ``seq`` reads and writes without distfuse::

    sd = {"model": seq.state_dict()}
    dcp.load(sd, checkpoint_id=path, no_dist=True); seq.load_state_dict(sd["model"])
    dcp.save({"model": seq.state_dict()}, checkpoint_id=path, no_dist=True)   # and back

and ``load_checkpoint(path, seq, seq_optimizer, single_process=True)`` (or ``save_checkpoint``)
moves the optimizer state too, in one process on its own.

Both functions are collective over the world (``model`` built alike on every rank; ranks that
own no block pass it all the same); DCP's coordination runs on distfuse's gloo metadata group,
so it never syncs a GPU stream.  A problem found on one rank (a model built differently,
owners whose optimizer state differs, a missing key) raises the same error on every rank.
The first save or load of a model creates a DeviceMesh per parameter partition (collective;
cached); a block moves once between the balanced and the ``torch.chunk`` layout
(:mod:`distfuse.interop.dtensor`).

``checkpoint_id`` is a directory every rank can read (DCP's ``FileSystemWriter``/``Reader``).
``param_groups`` and ``extra`` are stored whole as ``torch.save`` bytes (DCP would flatten a
list or dict into one entry per leaf): loading unpickles them, so load only checkpoints you
trust, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import io
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from distfuse.errors import ShapeError, UnsupportedError, where
from distfuse.groups import metadata_group
from distfuse.interop.dtensor import empty_param_dtensor, param_from_dtensor, param_to_dtensor
from distfuse.interop.model_map import ModelMap, agree, gather_block_dtypes, map_model
from distfuse.partition import zero_volume_tensor

__all__ = ["save_checkpoint", "load_checkpoint"]


def _opaque(obj) -> io.BytesIO:
    """``obj`` as one DCP entry (DCP flattens lists and dicts into one entry per leaf)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unwrap(value):
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=False)
    return value


def _param_keys(mm: ModelMap, optimizer) -> dict[int, str]:
    """``id(param) -> key`` for every parameter of ``optimizer`` (they must belong to the model)."""
    keys = {id(e.tensor): e.key for e in mm.blocks if e.tensor is not None}
    keys.update({id(t): k for k, t in mm.plain.items() if isinstance(t, nn.Parameter)})
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in keys:
                raise UnsupportedError(f"{where('checkpoint')}: the optimizer holds a parameter of shape "
                                       f"{tuple(p.shape)} that is not in the model")
    return keys


def _is_block_state(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


def _optimizer_layout(mm: ModelMap, optimizer, op: str, local: bool) -> dict[str, dict[str, str]]:
    """Per block key, ``state name -> dtype`` of its block-shaped optimizer state, agreed by all owners."""
    if local:
        return {}
    held = {e.key: e.tensor for e in mm.blocks if e.tensor is not None and optimizer is not None}
    mine = {key: {k: str(v.dtype) for k, v in optimizer.state.get(t, {}).items() if _is_block_state(v, t)}
            for key, t in held.items()}
    rows: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, mine, group=metadata_group())
    merged: dict[str, dict[str, str]] = {}
    for row in rows:
        for key, states in row.items():
            if key in merged and merged[key] != states:
                raise ShapeError(f"{where(op)}: the owners of {key} hold different optimizer state ({merged[key]} vs "
                                 f"{states}); step the optimizer on every rank before saving")
            merged[key] = states
    return merged


def _optimizer_state(mm: ModelMap, optimizer, op: str, local: bool) -> dict:
    """The ``optim`` part of the saved dict (collective: block-shaped state becomes DTensors)."""
    layout = _optimizer_layout(mm, optimizer, op, local)
    out: dict = {"state": {}}
    if optimizer is not None:
        keys = _param_keys(mm, optimizer)
        block_ids = mm.block_param_ids()
        for group in optimizer.param_groups:
            for p in group["params"]:  # a plain parameter's state is replicated whole; a block's only where 0-d
                entries = {k: v for k, v in optimizer.state.get(p, {}).items()
                           if id(p) not in block_ids or not _is_block_state(v, p)}
                if entries:
                    out["state"][keys[id(p)]] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                                 for k, v in entries.items()}
        out["param_groups"] = _opaque([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    for e in mm.blocks:
        for name, dtype_name in sorted(layout.get(e.key, {}).items()):
            block = optimizer.state[e.tensor][name] if e.tensor is not None else None
            dt = _block_dtensor(block, e.layout, getattr(torch, dtype_name.replace("torch.", "")))
            if dt is not None:
                out["state"].setdefault(e.key, {})[name] = dt
    return out


def _block_dtensor(block: torch.Tensor | None, lay, dtype: torch.dtype):
    """:func:`param_to_dtensor` of this rank's ``block`` (None where it holds none, which takes part all the same);
    None there."""
    if block is None:
        param_to_dtensor(zero_volume_tensor(dtype=dtype, device=lay.P.device), lay, dtype)
        return None
    return param_to_dtensor(block.detach(), lay, dtype)


def _single(single_process: bool) -> bool:
    return single_process or not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _run_dcp(fn, state: dict, checkpoint_id, local: bool) -> None:
    """``dcp.save`` or ``dcp.load`` on the metadata group, or in this process alone (``local``: then DCP's warning
    that it assumes a single process is what was asked for, and is silenced)."""
    with warnings.catch_warnings():
        if local:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=checkpoint_id, process_group=None if local else metadata_group(), no_dist=local)


@torch.no_grad()
def save_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer=None, extra=None, *,
                    single_process: bool = False) -> None:
    """Save ``model`` (and ``optimizer``, ``extra``) as one DCP checkpoint; collective over the world.

    ``single_process``: save a plain ``torch.nn`` model from this process alone (no
    communication; the default when ``torch.distributed`` is not initialised), in the
    same format, so that a distributed model can load it.
    """
    op = "save_checkpoint"
    local = _single(single_process)
    mm = map_model(model)
    dtypes = gather_block_dtypes(mm, op, local)
    dts = [(e.key, _block_dtensor(e.tensor, e.layout, dtypes[e.key])) for e in mm.blocks]  # collective, in order
    model_state = {key: dt for key, dt in dts if dt is not None}
    model_state.update({k: t.detach() for k, t in mm.plain.items()})
    state = {"model": model_state, "optim": _optimizer_state(mm, optimizer, op, local), "extra": _opaque(extra)}
    _run_dcp(dcp.save, state, checkpoint_id, local)


def _placeholder(md, device):
    """A tensor to read a replicated entry into, or None for a pickled object."""
    size = getattr(md, "size", None)
    if size is None:
        return None
    return torch.empty(tuple(size), dtype=md.properties.dtype, device=device)


@torch.no_grad()
def load_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer=None, *,
                    single_process: bool = False):
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` (and ``optimizer``), resharding as needed.

    ``model`` may be built on other partitions or another world size than the saved one;
    it must have the same parameters (same sequential keys and global shapes).  Returns
    the saved ``extra`` object.  Collective over the world.  ``single_process``: load into
    a plain ``torch.nn`` model (and its optimizer) in this process alone, for example on
    one rank of a running job (the default when ``torch.distributed`` is not initialised).
    """
    op = "load_checkpoint"
    local = _single(single_process)
    mm = map_model(model)
    dtypes = gather_block_dtypes(mm, op, local)
    saved = dict(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    shapes = {f"model.{e.key}": tuple(e.layout.global_shape) for e in mm.blocks}
    shapes.update({f"model.{k}": tuple(t.shape) for k, t in mm.plain.items()})
    missing = [k for k in shapes if k not in saved]
    wrong = [f"{k}: saved {tuple(getattr(saved[k], 'size', ()))}, model {s}" for k, s in shapes.items()
             if k in saved and tuple(getattr(saved[k], "size", ())) != s]
    agree(f"the checkpoint has no {missing[:5]}" if missing else
          (f"shapes differ: {wrong[:5]}" if wrong else None), op, local=local)

    targets = [(e, empty_param_dtensor(e.layout, dtypes[e.key])) for e in mm.blocks]
    model_state = {e.key: dt for e, dt in targets if e.tensor is not None}
    model_state.update({k: t.detach() for k, t in mm.plain.items()})  # DCP reads into them in place
    state: dict = {"model": model_state}
    if "extra" in saved:
        state["extra"] = None
    opt_targets = _optimizer_targets(mm, optimizer, saved, state, op, local) if optimizer is not None else None
    _run_dcp(dcp.load, state, checkpoint_id, local)

    for e, dt in targets:
        block = param_from_dtensor(dt, e.layout)
        if e.tensor is not None:
            e.tensor.copy_(block)
    if optimizer is not None:
        _apply_optimizer_state(mm, optimizer, state, opt_targets, op, local)
    return _unwrap(state.get("extra"))


def _optimizer_targets(mm: ModelMap, optimizer, saved: dict, state: dict, op: str, local: bool) -> list:
    """Fill ``state["optim"]`` with destinations for the saved optimizer entries; returns the DTensor ones."""
    prefix = "optim.state."
    block_targets = []
    optim: dict = {"state": {}}
    for e in mm.blocks:
        head = f"{prefix}{e.key}."
        for name in sorted(k[len(head):] for k in saved if k.startswith(head)):
            md = saved[head + name]
            size = tuple(getattr(md, "size", ()) or ())
            if size == tuple(e.layout.global_shape) and len(size) > 0:
                target = empty_param_dtensor(e.layout, md.properties.dtype)
                block_targets.append((e, name, target))
            else:
                target = _placeholder(md, torch.device("cpu"))
            if e.tensor is not None:
                optim["state"].setdefault(e.key, {})[name] = target
    for key, t in mm.plain.items():
        if not isinstance(t, nn.Parameter):
            continue
        head = f"{prefix}{key}."
        for k in saved:
            if k.startswith(head) and "." not in k[len(head):]:
                optim["state"].setdefault(key, {})[k[len(head):]] = _placeholder(saved[k], torch.device("cpu"))
    if "optim.param_groups" not in saved:
        agree("the checkpoint holds no optimizer (save it with optimizer=...)", op, local=local)
    optim["param_groups"] = None
    state["optim"] = optim
    return block_targets


def _apply_optimizer_state(mm: ModelMap, optimizer, state: dict, block_targets: list, op: str, local: bool) -> None:
    """Turn the loaded entries into ``optimizer.load_state_dict`` form (torch then casts each value)."""
    loaded = state["optim"]["state"]
    for e, name, dt in block_targets:
        block = param_from_dtensor(dt, e.layout)
        if e.tensor is not None:
            loaded[e.key][name] = block
    groups = _unwrap(state["optim"]["param_groups"])
    current = optimizer.state_dict()
    problem = None
    if not isinstance(groups, list) or len(groups) != len(current["param_groups"]):
        problem = (f"the checkpoint has {len(groups) if isinstance(groups, list) else 'no'} optimizer param groups, "
                   f"this optimizer {len(current['param_groups'])}")
    agree(problem, op, local=local)
    keys = _param_keys(mm, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    new_state = {i: dict(loaded[keys[id(p)]]) for i, p in enumerate(params) if loaded.get(keys[id(p)])}
    new_groups = [dict(saved_group, params=cur["params"])
                  for saved_group, cur in zip(groups, current["param_groups"], strict=True)]
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
