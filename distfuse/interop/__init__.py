"""Bridges from distfuse to the rest of the PyTorch stack: ``DeviceMesh`` (:mod:`~distfuse.interop.device_mesh`),
``DTensor`` (:mod:`~distfuse.interop.dtensor`) and ``torch.distributed.checkpoint``
(:mod:`~distfuse.interop.checkpoint`); the whole-model helpers are in :mod:`distfuse.model`.

The names below load their module on first use: ``device_mesh_of`` imports only the
DeviceMesh bridge, not the checkpoint machinery (DCP, the layers).
"""

import importlib

_EXPORTS = {
    "device_mesh_of": "device_mesh",
    "partition_from_device_mesh": "device_mesh",
    "canonical_partition": "device_mesh",
    "to_dtensor": "dtensor",
    "from_dtensor": "dtensor",
    "empty_dtensor": "dtensor",
    "placements_of": "dtensor",
    "param_to_dtensor": "dtensor",
    "param_from_dtensor": "dtensor",
    "empty_param_dtensor": "dtensor",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distfuse.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distfuse.interop.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
