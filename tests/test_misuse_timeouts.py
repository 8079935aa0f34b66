"""Misuse: ``DISTFUSE_TIMEOUT`` bounds every distfuse wait, whatever the world group's timeout; bad values are refused.

Every multi-rank test here runs with the world group left at torch's default timeout (30
minutes: the pool's ``init_process_group`` gets torch's own default, checked in every
rank) and ``DISTFUSE_TIMEOUT=3`` set in the ranks before distfuse makes its first group.
A rank skips a call, raises in a backward hook, skips a metadata gather or a partition
creation; the others must get a :class:`~distfuse.errors.CollectiveTimeoutError` naming
the op, their rank, the peers and the timeout in force within the timeout plus a slack,
never the world's 30 minutes.  The times are measured inside the ranks, from the start
of the failing call to the error.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from distfuse import Partition, PartitionError
from distfuse.errors import CollectiveTimeoutError, ConfigError
from distfuse.geometry.decomposition import local_slices
from distfuse.groups import default_timeout, group_timeout
from distfuse.layers import DistributedConv1d, DistributedLinearAllGather
from distfuse.testing import RankFailure, run_ranks
from distfuse.testing.pool import discard_pool

PG_DEFAULT = default_pg_timeout.total_seconds()  # torch's default (1800 s): the world group keeps it
T = 3.0  # DISTFUSE_TIMEOUT in the ranks
SLACK = 5.0  # loaded 2-core machine: scheduling, the failing call's own work
W = 3


def _use_timeout(value: str = "3") -> None:
    """This rank's DISTFUSE_TIMEOUT, and a check that the world group still has torch's default timeout."""
    os.environ["DISTFUSE_TIMEOUT"] = value
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    assert world == default_pg_timeout, world


def _run(fn, *args, fresh: bool = False, world: int = W):
    """Run ``fn`` on a pool whose world group has torch's default timeout; ``fresh``: before distfuse made groups."""
    if fresh:
        discard_pool(world, PG_DEFAULT)
    return run_ranks(world, fn, *args, pg_timeout=PG_DEFAULT, timeout=90)


def _timed(fn) -> tuple[str | None, str, float]:
    """``(error type or None, message, seconds)`` of ``fn()``."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects every kind
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


# ---------------------------------------------------------------- the variable itself


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "-inf", "nan", "1e400", " "])
def test_bad_values_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("DISTFUSE_TIMEOUT", value)
    if not value.strip():  # blank means unset: the default
        assert default_timeout().total_seconds() == 600
        return
    with pytest.raises(ConfigError) as info:
        default_timeout()
    assert "DISTFUSE_TIMEOUT" in str(info.value) and repr(value) in str(info.value)
    assert "positive, finite number of seconds" in str(info.value) or "too large" in str(info.value)


def test_good_values_and_the_default(monkeypatch):
    monkeypatch.setenv("DISTFUSE_TIMEOUT", "2.5")
    assert default_timeout().total_seconds() == 2.5
    monkeypatch.delenv("DISTFUSE_TIMEOUT")
    assert default_timeout().total_seconds() == 600


def _world_with(values: dict[int, str]):
    _use_timeout(values.get(dist.get_rank(), "3"))
    return _timed(lambda: Partition.world())


def test_a_bad_value_on_every_rank_is_refused_at_once_on_every_rank():
    with pytest.raises(RankFailure) as info:
        _run(_world_with_raising, {r: "abc" for r in range(W)}, fresh=True)
    assert set(info.value.errors) == set(range(W))
    for r, tb in info.value.errors.items():
        assert "ConfigError" in tb and f"DISTFUSE_TIMEOUT [rank {r}]" in tb and "'abc'" in tb, tb
        assert info.value.times[r] < SLACK, info.value.times  # before any collective: no waiting


def _world_with_raising(values: dict[int, str]):
    _use_timeout(values.get(dist.get_rank(), "3"))
    Partition.world()


def test_a_bad_value_on_one_rank_ends_in_errors_everywhere_within_the_others_timeout():
    out = _run(_world_with, {1: "-1"}, fresh=True)
    discard_pool(W, PG_DEFAULT)  # the others' group creation timed out: the world is spent
    kind, msg, secs = out[1]
    assert kind == "ConfigError" and "'-1'" in msg and secs < 1.0, out[1]
    for r in (0, 2):
        kind, msg, secs = out[r]
        assert kind == "CollectiveTimeoutError", out[r]
        assert f"Partition [rank {r}]" in msg and "DISTFUSE_TIMEOUT=3 s" in msg, msg
        assert T - 0.5 <= secs <= T + SLACK, out[r]


def test_ranks_with_different_timeouts_are_refused_on_every_rank():
    out = _run(_world_with, {0: "3", 1: "4", 2: "3"}, fresh=True)
    discard_pool(W, PG_DEFAULT)
    for r, (kind, msg, secs) in enumerate(out):
        assert kind == "PartitionError", out[r]
        assert "DISTFUSE_TIMEOUT=3 s" in msg and "DISTFUSE_TIMEOUT=4 s" in msg and f"[rank {r}]" in msg, msg
        assert secs < T, out[r]  # found by the creation record, not by a timeout


def _creation_arguments_disagree():
    _use_timeout()
    world = Partition.world()
    shape = [3, 1] if dist.get_rank() == 1 else [1, 3]
    first = _timed(lambda: world.create_cartesian_topology_partition(shape))
    P = world.create_cartesian_topology_partition([1, 3])
    remain = [True, False] if dist.get_rank() == 2 else [False, True]
    second = _timed(lambda: P.create_cartesian_subtopology_partition(remain))
    return first, second, group_timeout()


def test_partition_creation_with_different_arguments_is_refused_on_every_rank():
    for r, (first, second, timeout) in enumerate(_run(_creation_arguments_disagree)):
        assert timeout == T
        for kind, msg, secs in (first, second):
            assert kind == PartitionError.__name__ and f"Partition [rank {r}]" in msg and secs < T, (first, second)
        assert "'shape': (3, 1)" in first[1] and "'shape': (1, 3)" in first[1], first[1]
        assert "(True, False)" in second[1] and "(False, True)" in second[1], second[1]


# ---------------------------------------------------------------- faults: the world group keeps its 30 minutes


class InjectedFaultError(RuntimeError):
    pass


def _conv_setup():
    _use_timeout()
    P_x = Partition.world().create_cartesian_topology_partition([1, 1, W])  # spans every rank
    torch.manual_seed(0)
    conv = DistributedConv1d(P_x, 2, 3, 3, padding=1)
    xg = torch.randn(2, 2, 10)
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].requires_grad_(True)
    conv(x).sum().backward()  # one healthy step: partitions, plans, agreement settled
    return conv, x


def _fault(kind: str):
    me = dist.get_rank()
    if kind == "partition_creation":
        _use_timeout()
        world = Partition.world()
        if me == 1:
            return None, "", 0.0
        return _timed(lambda: world.create_partition_inclusive([0, 1]))
    if kind == "metadata_gather":  # the first call of a layer gathers every worker's input record
        _use_timeout()
        P = Partition.world().create_cartesian_topology_partition([1, W])
        layer = DistributedLinearAllGather(P, 6, 4)
        if me == 1:
            return None, "", 0.0
        return _timed(lambda: layer(torch.randn(5, 2)))
    conv, x = _conv_setup()
    if kind == "skip_call":
        if me == 1:
            return None, "", 0.0
        return _timed(lambda: conv(x))
    if kind == "backward_hook":
        y = conv(x)
        if me == 1:
            y.register_hook(lambda g: (_ for _ in ()).throw(InjectedFaultError("injected in a backward hook")))
        return _timed(lambda: y.sum().backward())
    raise ValueError(kind)


# (scenario, ops a peer's error may name, what): every peer must time out in one of those ops.  The feature conv
# spans every rank: its root (rank 0) waits for rank 1's agreement flag, rank 2 for the root's parameters.
FAULTS = [
    ("skip_call", ("DistributedFeatureConv1d", "Broadcast"), "point-to-point exchange"),
    ("backward_hook", ("DistributedFeatureConv1d (adjoint)",), "point-to-point exchange"),  # its halo's adjoint
    ("metadata_gather", ("DistributedLinearAllGather",), "metadata all-gather"),
    ("partition_creation", ("Partition",), "partition creation"),
]


@pytest.mark.parametrize("kind, ops, what", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_fault_on_one_rank_ends_in_errors_everywhere_within_distfuse_timeout(kind, ops, what):
    out = _run(_fault, kind)
    discard_pool(W, PG_DEFAULT)  # the peers' groups timed out: the world is spent
    if kind == "backward_hook":
        assert out[1][0] == "InjectedFaultError" and out[1][2] < 1.0, out[1]
    peers = [r for r in range(W) if r != 1]
    if kind == "backward_hook":
        peers = [0, 2]
    for r in peers:
        err, msg, secs = out[r]
        assert err == CollectiveTimeoutError.__name__, (r, out[r])
        assert any(f"{op} [rank {r}]" in msg for op in ops) and what in msg, msg
        assert "DISTFUSE_TIMEOUT=3 s" in msg and "world ranks [" in msg, msg
        assert T - 0.5 <= secs <= T + SLACK, (r, secs)
        assert not math.isclose(secs, PG_DEFAULT, rel_tol=0.1)


# ---------------------------------------------------------------- no variable: the user's world timeout rules

WORLD_T = 4.0  # the world group's timeout the "user" gave init_process_group; DISTFUSE_TIMEOUT unset


def _user_timeout_fault():
    """A reduce-scatter linear whose rank 1 sleeps past the others' timeout instead of calling."""
    os.environ.pop("DISTFUSE_TIMEOUT", None)
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    assert world == WORLD_T, world
    from distfuse.layers import DistributedLinearReduceScatter

    P = Partition.world().create_cartesian_topology_partition([1, W])
    in_force = group_timeout()
    torch.manual_seed(0)
    layer = DistributedLinearReduceScatter(P, 6, 4)
    x = torch.randn(5, 2)
    layer(x)  # one healthy call: agreement settled
    if dist.get_rank() == 1:
        time.sleep(WORLD_T + SLACK + 1.0)  # alive but absent
        return None, "", 0.0, in_force
    return (*_timed(lambda: layer(x)), in_force)


def test_the_world_groups_timeout_bounds_waits_when_the_variable_is_unset():
    discard_pool(W, WORLD_T)
    try:
        out = run_ranks(W, _user_timeout_fault, pg_timeout=WORLD_T, timeout=90)
    finally:
        discard_pool(W, WORLD_T)  # the peers' groups timed out: the world is spent
    for r in (0, 2):
        err, msg, secs, in_force = out[r]
        assert in_force == WORLD_T, out[r]  # not distfuse's 600 s default
        assert err == CollectiveTimeoutError.__name__, (r, out[r])
        assert f"{WORLD_T:g} s, the world group's timeout (DISTFUSE_TIMEOUT unset)" in msg, msg
        assert WORLD_T - 0.5 <= secs <= WORLD_T + SLACK, (r, secs)


def test_the_default_is_the_shorter_of_the_world_timeout_and_600_s(monkeypatch):
    import distfuse.groups as groups

    monkeypatch.delenv("DISTFUSE_TIMEOUT", raising=False)
    for world, want in ((60.0, 60.0), (1800.0, 600.0), (None, 600.0)):
        monkeypatch.setattr(groups, "world_group_timeout", lambda w=world: w)
        assert default_timeout().total_seconds() == want, (world, want)
    monkeypatch.setenv("DISTFUSE_TIMEOUT", "900")  # the variable, when set, still rules
    assert default_timeout().total_seconds() == 900
