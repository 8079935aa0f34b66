"""Bridges from distfuse to the rest of the PyTorch stack.

* :mod:`~distfuse.interop.device_mesh`: ``DeviceMesh`` <-> :class:`~distfuse.partition.CartesianPartition`
  (``device_mesh_of(P)``, ``partition_from_device_mesh(mesh)``).
* :mod:`~distfuse.interop.dtensor`: block tensors <-> ``DTensor`` (balanced split <-> ``torch.chunk`` split).
* :mod:`~distfuse.interop.checkpoint`: whole models (and optimizers) as ``torch.distributed.checkpoint``
  checkpoints that load into other partitions or into plain ``torch.nn`` models.

Whole-model helpers (``load_sequential``, ``collect_sequential``, ``make_optimizer``,
``clip_grad_norm_``) are in :mod:`distfuse.model`.

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
