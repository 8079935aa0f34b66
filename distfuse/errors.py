"""Errors raised by distfuse.

Every message names the op (layer or primitive), the rank that raised it, and the
expected against the actual value, so that a failure in a many-rank job can be traced
from any one rank's log.
"""

from __future__ import annotations

__all__ = ["DistfuseError", "PartitionError", "ShapeError", "DisagreedCallError", "CollectiveMismatchError",
           "CollectiveTimeoutError", "UnsupportedError", "NotPicklableError", "ConfigError", "where", "expect"]


class DistfuseError(RuntimeError):
    """Base class of every error distfuse raises on purpose."""


class PartitionError(DistfuseError, ValueError):
    """Partitions that do not fit together (broadcast rules, sizes, dimensions)."""


class ShapeError(DistfuseError, ValueError):
    """A tensor whose shape, dtype or device does not fit its partition or layer."""


class DisagreedCallError(ShapeError):
    """Raised on every worker at the call after one whose workers disagreed (the deferred agreement transport, the
    CUDA default of every layer): that call's outputs were NaN."""


class UnsupportedError(DistfuseError, NotImplementedError):
    """An option or combination distfuse refuses rather than answer wrongly."""


class NotPicklableError(UnsupportedError, TypeError):
    """Pickling an object that holds process groups (a partition, so any distributed layer).

    A ``TypeError`` too, as Python's own refusals to pickle are, so that code probing
    whether something pickles (torch.compile's caches) treats it as unpicklable.
    """


class CollectiveMismatchError(DistfuseError):
    """Ranks entered a collective with different metadata (caught in debug mode)."""


class CollectiveTimeoutError(DistfuseError, TimeoutError):
    """A collective did not complete within distfuse's timeout (``DISTFUSE_TIMEOUT``)."""


class ConfigError(DistfuseError, ValueError):
    """A bad setting: an environment variable (``DISTFUSE_TIMEOUT``) or a tune-table file, named in the message."""


def where(op: str) -> str:
    """Prefix naming the op and this process's world rank.

    ``torch.distributed`` is imported here so that the geometry layer, which raises these errors, imports none.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"{op} [rank {rank}]"


def expect(op: str, what: str, expected, actual, cls: type[DistfuseError] = ShapeError) -> DistfuseError:
    """Build an error that reads ``Op [rank r]: what: expected X, got Y``."""
    return cls(f"{where(op)}: {what}: expected {expected}, got {actual}")
