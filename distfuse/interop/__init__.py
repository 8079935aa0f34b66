"""Bridges from distfuse to the rest of the PyTorch stack: ``DeviceMesh`` (:mod:`~distfuse.interop.device_mesh`),
``DTensor`` (:mod:`~distfuse.interop.dtensor`) and ``torch.distributed.checkpoint``
(:mod:`~distfuse.interop.checkpoint`); the whole-model helpers are in :mod:`distfuse.model`.

The names below load their module on first use: ``device_mesh_of`` imports only the
DeviceMesh bridge, not the checkpoint machinery (DCP, the layers).
"""

import importlib

_EXPORTS = {name: module for module, names in (  # name -> the module that defines it
    ("device_mesh", ("device_mesh_of", "partition_from_device_mesh", "canonical_partition")),
    ("dtensor", ("to_dtensor", "from_dtensor", "empty_dtensor", "placements_of", "param_to_dtensor",
                 "param_from_dtensor", "empty_param_dtensor")),
    ("checkpoint", ("save_checkpoint", "load_checkpoint")),
) for name in names}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distfuse.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distfuse.interop.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
