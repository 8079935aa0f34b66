"""distfuse: model-parallel layers on Cartesian worker grids, with fused communication kernels."""

from distfuse.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
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
    "UnsupportedError",
    "NotPicklableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "__version__",
]
