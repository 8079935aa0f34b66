"""The process groups behind distfuse's partitions: creation, caching, timeouts, the world and metadata groups.

**Timeouts.** Every process group distfuse uses is its own, created with
:func:`default_timeout` and cached by its tuple of world ranks, so equal partitions share
one group.  That includes the groups over the whole world: :meth:`Partition.world`
creates them on its first call (so that first call is collective: every rank must make
it), instead of borrowing the default group, whose timeout is whatever the user gave
``init_process_group`` (torch's default is 30 minutes).  The primitives' point-to-point
rounds run on that world group too (:func:`world_group`).  So every distfuse collective,
point-to-point round and metadata gather fails after ``DISTFUSE_TIMEOUT`` at most.  A
group's timeout is fixed when it is created (:func:`group_timeout` says which one is in
force), and ranks whose values differ raise :class:`PartitionError` at the first
partition creation.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from distfuse.errors import CollectiveTimeoutError, ConfigError, PartitionError, where

__all__ = ["TIMEOUT_VARIABLE", "world_generation", "WorldTable", "default_timeout", "world_group_timeout",
           "timeout_label", "group_timeout", "world_group", "metadata_group", "cuda_backend_of", "groups_for",
           "world_partition_groups", "default_device"]

_GROUPS: dict[tuple[int, ...], tuple] = {}
_CREATION_SEQ = [0]
# distfuse's own groups over the whole world: "data" (the world's backend), "meta" (gloo), "timeout" (seconds),
# "world" (the world_generation() they were made for; a re-initialised world gets fresh ones).
_WORLD: dict = {}
_TIMEOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> the timeout it was created with (s)
_WORLD_SEEN: list = [None, 0]  # a weak reference to the default group seen last, and its generation

TIMEOUT_VARIABLE = "DISTFUSE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


def world_generation() -> int:
    """A number naming the current default process group (``dist.group.WORLD``), for caches of what is made over it.

    It changes whenever the default group is another object than the one seen last, so after
    ``destroy_process_group()`` and a new ``init_process_group()`` every cache keyed by it misses
    (distfuse's world groups, the layers' cached partitions, the DeviceMesh views).  The check is by
    identity through a weak reference, not by ``id()``: the new default group may be allocated at
    the address of the destroyed one, and an ``id`` key would then hand back the destroyed world's
    groups.  The weak reference keeps nothing alive, so no process group outlives its world here
    (nor in a forked child).
    """
    world = dist.group.WORLD if dist.is_available() else None
    seen = _WORLD_SEEN[0]
    if (seen() if seen is not None else None) is not world:
        _WORLD_SEEN[0] = weakref.ref(world) if world is not None else None
        _WORLD_SEEN[1] += 1
    return _WORLD_SEEN[1]


class WorldTable(dict):
    """A cache of what is made over the current world's process groups (partitions, layers, workspaces), by key.

    Read it through :meth:`current`, which empties it first when the default group changed since its last use
    (:func:`world_generation`): after ``destroy_process_group()`` and a new ``init_process_group()`` in one
    process (an in-process restart), an entry made over the destroyed world would run its collectives on dead
    groups, or on live ones whose ranks now belong to other processes.  ``drop(value)``, when given, releases each
    dropped entry (locally: the destroyed world can no longer run a collective).
    """

    def __init__(self, drop: Callable[[object], None] | None = None):
        super().__init__()
        self.generation = 0
        self._drop = drop

    def current(self) -> WorldTable:
        """This table, emptied when the world changed since its last use."""
        generation = world_generation()
        if generation != self.generation:
            if self._drop is not None:
                for value in list(self.values()):
                    self._drop(value)
            self.clear()
            self.generation = generation
        return self


def world_group_timeout() -> float | None:
    """Seconds of the timeout the world group was created with (``init_process_group(timeout=...)``), or None.

    Read from the world group's device backends (the shortest one when several differ);
    None before ``init_process_group`` or where this torch does not expose it.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    found = []
    for device_type in ("cpu", "cuda"):
        try:
            timeout = dist.group.WORLD._get_backend(torch.device(device_type)).options._timeout
        except (RuntimeError, ValueError, TypeError, AttributeError):  # no backend for this device type
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            found.append(timeout.total_seconds())
    return min(found) if found else None


def default_timeout() -> timedelta:
    """The timeout of every process group distfuse creates.

    ``DISTFUSE_TIMEOUT`` seconds when the variable is set.  Unset, the shorter of the
    world group's timeout (:func:`world_group_timeout`) and 600 s: a user who asked torch
    for 60 s gets errors after about 60 s, and torch's 30-minute default is cut to 10 minutes.

    Validated on every read, before any collective: anything but a positive, finite number
    of seconds (``"abc"``, ``0``, ``inf``, ``nan``) raises :class:`~distfuse.errors.ConfigError`
    naming the variable and the value, so every rank with a bad value refuses it at once
    instead of entering a collective it would leave early.
    """
    raw = os.environ.get(TIMEOUT_VARIABLE)
    if raw is None or not raw.strip():
        world = world_group_timeout()
        return timedelta(seconds=min(DEFAULT_TIMEOUT_S, world) if world is not None else DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{where(TIMEOUT_VARIABLE)}: {TIMEOUT_VARIABLE} must be a positive, finite number of "
                          f"seconds, got {raw!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ConfigError(f"{where(TIMEOUT_VARIABLE)}: {TIMEOUT_VARIABLE}={raw!r} is too large for a timeout "
                          "(at most about 8e13 seconds)") from None


def timeout_label(seconds: float) -> str:
    """How an error names the timeout in force: the variable when it is set, else where the value came from."""
    raw = os.environ.get(TIMEOUT_VARIABLE)
    if raw is not None and raw.strip():
        return f"{TIMEOUT_VARIABLE}={seconds:g} s"
    if seconds < DEFAULT_TIMEOUT_S:
        return f"{seconds:g} s, the world group's timeout ({TIMEOUT_VARIABLE} unset)"
    return f"{seconds:g} s, distfuse's default ({TIMEOUT_VARIABLE} unset)"


def group_timeout(group=None) -> float:
    """Seconds after which a wait on ``group`` (default: distfuse's world group) fails: the timeout in force.

    That is the timeout the group was created with (the variable may have changed since);
    groups distfuse did not create report the variable's current value.
    """
    if group is None and _WORLD:
        return _WORLD["timeout"]
    try:
        recorded = _TIMEOUTS.get(group)
    except TypeError:  # None, or a non-member's placeholder (an int): no group of ours
        recorded = None
    return recorded or default_timeout().total_seconds()  # positive when recorded


def _new_group(ranks: Sequence[int], timeout: timedelta, backend: str | None, what: str):
    """``dist.new_group`` with distfuse's timeout; a rank that never arrives ends in CollectiveTimeoutError."""
    try:
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
    except RuntimeError as exc:  # the store barrier inside new_group: "Wait timeout", or a closed connection
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise CollectiveTimeoutError(
            f"{where('Partition')}: creating {what} over world ranks {list(ranks)} did not complete within "
            f"{timeout_label(timeout.total_seconds())}: {cause}"
            ". Creation is collective over the world: a rank that raised before the call (a bad "
            f"{TIMEOUT_VARIABLE} on that rank, for example), died or made another call ends here") from exc
    if isinstance(group, dist.ProcessGroup):  # a rank outside ``ranks`` gets a placeholder (an int)
        _TIMEOUTS[group] = timeout.total_seconds()
    return group


def _world_groups() -> dict:
    """distfuse's own groups over every world rank, created on the first call (collective over the world).

    ``meta`` is a gloo group for host-side metadata; ``data`` the group for tensors on the
    partitions' device (the same gloo group unless the world's CUDA backend is NCCL, then
    a group of the world's backend, warmed up: NCCL creates communicators lazily, and a
    ``batch_isend_irecv`` that is the first call on a communicator must include every rank
    of it, which the primitives' rounds do not).  Both carry :func:`default_timeout`, read
    once here before the first collective; then every rank checks that the others chose
    the same timeout.
    """
    generation = world_generation()
    if _WORLD and _WORLD["world"] == generation:
        return _WORLD
    timeout = default_timeout()  # raises ConfigError before any collective
    _WORLD.clear()
    _GROUPS.clear()
    ranks = tuple(range(dist.get_world_size()))
    meta = _new_group(ranks, timeout, "gloo", "the metadata group")
    nccl = cuda_backend_of(dist.group.WORLD) == "nccl"  # then partitions live on the GPU and need the warm-up
    data = _new_group(ranks, timeout, None, "the world data group") if nccl else meta
    _WORLD.update(data=data, meta=meta, timeout=timeout.total_seconds(), world=generation)
    try:
        _check_creation_consistent("Partition.world", [ranks], args={"timeout_s": timeout.total_seconds()})
    except Exception:
        _WORLD.clear()
        raise
    if nccl:
        _warm_up_nccl(data)
    return _WORLD


def world_group():
    """distfuse's data group over every world rank: the primitives' point-to-point rounds run on it.

    It exists once :meth:`Partition.world` has been called (on every rank); before that
    there is no partition to communicate over, so this raises :class:`PartitionError`.
    """
    if not _WORLD or _WORLD["world"] != world_generation():
        raise PartitionError(f"{where('Partition')}: distfuse's world group does not exist yet; call "
                             "Partition.world() on every rank first")
    return _WORLD["data"]


def metadata_group():
    """distfuse's CPU (gloo) group over the whole world for small host-side metadata collectives.

    Created by the first :meth:`Partition.world` or the first call here, which is then collective over the world.
    """
    return _world_groups()["meta"]


def _check_creation_consistent(call: str, groups: Sequence[tuple[int, ...]], args: dict | None = None) -> None:
    """All world ranks must be creating the same groups, with the same arguments, now; raise on every rank if not."""
    _CREATION_SEQ[0] += 1
    timeout = _WORLD["timeout"]  # callers create the world groups first
    record = (_CREATION_SEQ[0], call, tuple(groups), tuple(sorted((args or {}).items())), timeout)
    records: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(records, record, group=_WORLD["meta"])
    except RuntimeError as exc:  # a rank that never arrives surfaces as a timeout or a closed connection
        raise CollectiveTimeoutError(
            f"{where('Partition')}: partition creation is collective over the world (world ranks "
            f"{list(range(len(records)))}), but not every rank made call #{record[0]} ({call}) within the timeout "
            f"in force ({timeout_label(timeout)}): {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    if any(r != record for r in records):
        lines = "\n".join(f"  rank {i}: call #{r[0]} {r[1]} groups={list(r[2])} arguments={dict(r[3])} "
                          f"{TIMEOUT_VARIABLE}={r[4]:g} s" for i, r in enumerate(records))
        raise PartitionError(
            f"{where('Partition')}: partition creation is collective over the world and every rank must make the "
            f"same call with the same arguments (and the same {TIMEOUT_VARIABLE}); the ranks disagree:\n{lines}"
        )


def groups_for(call: str, rank_sets: Sequence[tuple[int, ...]], args: dict | None = None) -> list:
    """Create (or reuse) one process group per rank set; collective over the world.

    Returns ``(group, meta_group)`` per rank set, or None where this rank is not a
    member.  ``meta_group`` is a gloo group over the same ranks for host-side
    metadata (shapes); under gloo it is the data group itself.  A rank set holding
    every world rank (in any order: groups sort their ranks) gets distfuse's world
    groups, never the default group (whose timeout is the user's).
    """
    world = _world_groups()
    _check_creation_consistent(call, rank_sets, args)
    gloo = world["data"] is world["meta"]
    everyone = set(range(dist.get_world_size()))
    timeout = timedelta(seconds=world["timeout"])
    out = []
    for ranks in rank_sets:
        if ranks not in _GROUPS:
            if set(ranks) == everyone:
                data, meta = world["data"], world["meta"]
            else:
                data = _new_group(ranks, timeout, None, "a partition's group")
                meta = data if gloo else _new_group(ranks, timeout, "gloo", "a partition's metadata group")
            _GROUPS[ranks] = (data, meta)
        out.append(_GROUPS[ranks] if dist.get_rank() in ranks else None)
    return out


def _cuda_backend_in_spec(spec: str) -> str | None | bool:
    """The CUDA backend named by a backend string, None if it names none, False if it cannot tell.

    A bare name (``"nccl"``) serves every device type it supports; ``"device:backend"``
    pairs (``"cpu:gloo,cuda:nccl"``) name each; ``"undefined"`` (``init_process_group()``
    without a backend, torchrun's usual form) says nothing about the device backends.
    """
    spec = str(spec).strip().lower()
    if not spec or spec == "undefined":
        return False
    if ":" not in spec:
        return spec
    pairs = dict(item.split(":", 1) for item in spec.split(",") if ":" in item)
    return pairs.get("cuda", "").strip() or None


def cuda_backend_of(group=None) -> str | None:
    """Name of the backend that runs ``group``'s collectives on CUDA tensors (``"nccl"``, ``"gloo"``), or None.

    ``group`` defaults to the world.  Not ``dist.get_backend(group) == "nccl"``: that string
    reads ``"undefined"`` after ``init_process_group()`` with no backend, and
    ``"cpu:gloo,cuda:nccl"`` as written; taking such an NCCL world for a CPU one skips the
    communicator warm-up, and a later partial ``batch_isend_irecv`` can hang.  So ask, in
    order, what torch 2.5 to 2.13 offer: the group's backend config
    (``dist.get_backend_config``), the backend the group holds for the CUDA device type
    (``ProcessGroup._get_backend``, private), and last the backend string.  None when the
    group has no CUDA backend or none of these can tell.
    """
    get_config = getattr(dist, "get_backend_config", None)
    found = _asked(get_config, group) if get_config is not None else False
    if found is not False:
        return found
    try:  # raises "No backend type associated with ... cuda" where the group has none
        name = (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cuda")).name
        name = name() if callable(name) else name
    except (RuntimeError, ValueError, TypeError, AttributeError):
        name = None
    return str(name).lower() if name else _asked(dist.get_backend, group) or None


def _asked(get, group) -> str | None | bool:
    """:func:`_cuda_backend_in_spec` of ``get(group)``; False where torch cannot say (not a member, not initialised)."""
    try:
        return _cuda_backend_in_spec(get(group))
    except (RuntimeError, ValueError, TypeError, AttributeError, KeyError):
        return False


def default_device() -> torch.device:
    """``cuda:<current>`` when the world's CUDA backend is NCCL (however the backend was spelt), else CPU."""
    if cuda_backend_of() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _warm_up_nccl(group) -> None:
    """One collective on every rank of ``group``, so that NCCL creates its communicator now (:func:`_world_groups`)."""
    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=group)


def world_partition_groups() -> tuple[tuple[int, ...], tuple]:
    """``(ranks, (data group, metadata group))`` of the partition over every world rank (collective on the first
    call, which creates distfuse's world groups: :func:`_world_groups`)."""
    world = _world_groups()
    ranks = tuple(range(dist.get_world_size()))
    return ranks, _GROUPS.setdefault(ranks, (world["data"], world["meta"]))
