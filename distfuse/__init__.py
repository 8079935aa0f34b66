"""distfuse: model-parallel layers on Cartesian worker grids, with fused communication kernels."""

from distfuse.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    DisagreedCallError,
    DistfuseError,
    NotPicklableError,
    PartitionError,
    ShapeError,
    UnsupportedError,
)
from distfuse.partition import CartesianPartition, Partition, union_partition, zero_volume_tensor

__version__ = "0.1.0"

__all__ = [
    "Partition",
    "CartesianPartition",
    "union_partition",
    "zero_volume_tensor",
    "DistfuseError",
    "PartitionError",
    "ShapeError",
    "DisagreedCallError",
    "UnsupportedError",
    "NotPicklableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "check_pending",
    "__version__",
]


def check_pending() -> None:
    """A sync point: raise now, by name, what the CUDA defaults would raise later (on every worker, at one place).

    A fused op whose flag wait gave up, and a layer call whose workers disagreed under the
    deferred agreement transport, raise at the next distfuse call that can notice; this
    waits for the device and raises them now.  Call it on every worker before
    ``optimizer.step()`` so that no step applies a disagreeing call's NaN.  Cheap when
    nothing is pending.  See :func:`distfuse.fused.workspace.check_pending`.
    """
    from distfuse.fused.workspace import check_pending as check

    check()
