"""Host-side sizing of persistent grids: how many programs a persistent kernel launches.

A persistent kernel launches at most one program per SM (or a fixed multiple) and
each program loops over work items ``pid, pid + num_programs, ...``; what a program
does once per launch (polling flags, building tensor descriptors) is then paid once per
SM instead of once per tile.  Under the Triton interpreter programs run one after the
other, so a small count (:data:`INTERPRETED_PROGRAMS`) still makes every program walk
several items, which is what the tests must exercise.
"""

from __future__ import annotations

import functools

import torch

from distfuse.kernels._utils import INTERPRET

__all__ = ["persistent_programs", "sm_count", "INTERPRETED_PROGRAMS"]

#: Programs of a persistent grid under the interpreter (CPU tests): small, so that each walks several items.
INTERPRETED_PROGRAMS = 2


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached: the query is a driver call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, override: int | None = None, per_sm: int = 1) -> int:
    """Programs of a persistent grid on ``device``: ``override`` if given, else ``per_sm`` per SM.

    CPU (interpreter): :data:`INTERPRETED_PROGRAMS`.  Callers take the minimum with the
    number of work items, so a small problem never launches idle programs.
    """
    if override is not None:
        if int(override) < 1:
            raise ValueError(f"persistent_programs: expected at least 1 program, got {override}")
        return int(override)
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return INTERPRETED_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * sm_count(index)
