"""A world destroyed and initialised again in one process (an in-process restart) gets fresh groups everywhere.

distfuse caches what it makes over the world's process groups: its own world groups, the layers' partitions, the
DeviceMesh views, the functional forms' helpers, the symmetric workspaces.  Each cache is a
:class:`~distfuse.groups.WorldTable`, emptied when the default group is another object than the one it was filled
under (:func:`~distfuse.groups.world_generation`).  An entry of the destroyed world would otherwise run its
collectives on dead groups, or on live gloo pairs whose ranks now belong to other processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
import types
import weakref

import pytest
import torch
import torch.distributed as dist

from distfuse import groups


@pytest.fixture
def fake_world(monkeypatch):
    """``groups.dist`` with a settable default group, and a fresh record of the group seen last."""
    fake = types.SimpleNamespace(is_available=lambda: True, group=types.SimpleNamespace(WORLD=None))
    monkeypatch.setattr(groups, "dist", fake)
    monkeypatch.setattr(groups, "_WORLD_SEEN", [None, 0])
    return fake.group


class _Group:
    """A stand-in for a default process group: weakly referenceable, like torch's."""


def test_world_generation_follows_identity_not_address(fake_world):
    fake_world.WORLD = first = _Group()
    g1 = groups.world_generation()
    assert groups.world_generation() == g1  # the same world: the same generation
    address, alive = id(first), weakref.ref(first)
    fake_world.WORLD = None
    del first  # freed here (no cycle holds it)
    # A new default group at the destroyed one's address: what an id() key cannot tell apart.  CPython's allocator
    # hands the freed block of this size class back first, so one of the next few objects lands there.
    fresh = [_Group() for _ in range(256)]
    assert alive() is None
    reused = [g for g in fresh if id(g) == address]
    if not reused:
        pytest.skip("this interpreter did not reuse the freed address (the hazard needs it)")
    fake_world.WORLD = reused[0]
    assert groups.world_generation() != g1


def test_world_generation_changes_with_the_world(fake_world):
    a, b = _Group(), _Group()
    fake_world.WORLD = a
    ga = groups.world_generation()
    fake_world.WORLD = b  # the old one still alive: another world all the same
    gb = groups.world_generation()
    assert gb != ga
    fake_world.WORLD = None  # destroyed, not yet re-initialised: a change too (the caches may go)
    gone = groups.world_generation()
    assert gone != gb and groups.world_generation() == gone
    fake_world.WORLD = _Group()
    assert groups.world_generation() not in (ga, gb, gone)


def test_world_table_empties_and_drops_on_a_new_world(fake_world):
    dropped = []
    table = groups.WorldTable(drop=dropped.append)
    fake_world.WORLD = first = _Group()
    table.current()["k"] = "made over the first world"
    assert table.current()["k"] == "made over the first world" and not dropped
    fake_world.WORLD = _Group()
    assert "k" not in table.current()
    assert dropped == ["made over the first world"]
    del first


def _two_worlds(p: int, root: str, conn) -> None:
    """Process ``p`` joins a 2-rank world as rank ``p``, then, after destroying it, a new one as rank ``1 - p``."""
    from distfuse import Partition
    from distfuse.errors import PartitionError
    from distfuse.fused import symmetric
    from distfuse.interop.device_mesh import device_mesh_of
    from distfuse.layers import DistributedLinearAllGather
    from distfuse.layers._conv_common import grid_of
    from distfuse.primitives import Repartition
    from distfuse.primitives.distribute import distribute_tensor

    torch.set_num_threads(1)
    os.environ["DISTFUSE_TIMEOUT"] = "30"
    out, workspaces, stale = [], [], []
    try:
        for world, rank in enumerate((p, 1 - p)):
            dist.init_process_group("gloo", init_method=f"file://{root}/world{world}", rank=rank, world_size=2)
            if world == 1:  # what the first world built refuses by name, without a message (the old pairs still work)
                for made, x in stale:
                    try:
                        made(x)
                        stale_errors = "no error"
                    except PartitionError as exc:
                        stale_errors = str(exc)
                    out.append(dict(stale=type(made).__name__, error=stale_errors))
            P = Partition.world().create_cartesian_topology_partition([2])
            if world == 0:
                P_x = Partition.world().create_cartesian_topology_partition([1, 2, 1])
                P_y = Partition.world().create_cartesian_topology_partition([1, 1, 2])
                stale = [(DistributedLinearAllGather(P_y, 8, 8, P_x=P_x), torch.randn(2, 3, 8)),
                         (Repartition(P_x, P_y), torch.randn(2, 3, 8))]
                for made, x in stale:
                    made(x)
            pids = [None, None]
            dist.all_gather_object(pids, os.getpid(), group=groups.world_group())
            mesh_pids = [None, None]
            dist.all_gather_object(mesh_pids, os.getpid(), group=device_mesh_of(P).get_group())
            x = torch.arange(6, dtype=torch.float64) * (world + 1) if rank == 0 else None
            block = distribute_tensor(x, P, src=0)
            workspaces.append(symmetric.get_workspace(P, 256))
            out.append(dict(rank=rank, pids=pids, mesh_pids=mesh_pids, block=block.tolist(),
                            root_active=grid_of([0], [1], "cpu").active,
                            timeout=groups.group_timeout(groups.world_group())))
            dist.destroy_process_group()
        out.append(dict(first_workspace_closed=workspaces[0].closed, second_workspace_closed=workspaces[1].closed))
        conn.send(("ok", out))
    except BaseException:  # noqa: B036 - every failure goes back to the test
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)  # no interpreter teardown in a forked child (gloo's exit races)


def test_reinitialised_world_uses_its_own_groups():
    """Ranks swap between the two worlds: anything cached over the first world would gather in its order, and a
    layer or module the first world built refuses to run in the second."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as root:
        pipes, procs = [], []
        for p in range(2):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_two_worlds, args=(p, root, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        results = []
        for p, pipe in enumerate(pipes):
            if not pipe.poll(120):
                for proc in procs:
                    proc.kill()
                pytest.fail(f"process {p} did not answer within 120 s")
            status, value = pipe.recv()
            assert status == "ok", f"process {p}:\n{value}"
            results.append(value)
        for proc in procs:
            proc.join(30)
    pids = [proc.pid for proc in procs]
    for r in results:
        stale = [e for e in r if "stale" in e]
        assert [e["stale"] for e in stale] == ["DistributedLinearAllGather", "Repartition"]
        for e in stale:
            assert "was made over a process-group world that has since been destroyed" in e["error"], e
    results = [[e for e in r if "stale" not in e] for r in results]
    for world in range(2):
        by_rank = {r[world]["rank"]: r[world] for r in results}
        in_rank_order = [pids[p if world == 0 else 1 - p] for p in range(2)]  # process p is rank p, then 1 - p
        for rank, r in by_rank.items():
            assert r["pids"] == in_rank_order, (world, rank, r)
            assert r["mesh_pids"] == in_rank_order, (world, rank, r)
            assert r["block"] == [float(v * (world + 1)) for v in range(3 * rank, 3 * rank + 3)], (world, rank, r)
            assert r["root_active"] == (rank == 0), (world, rank, r)
            assert r["timeout"] == 30.0
    for r in results:
        assert r[2] == dict(first_workspace_closed=True, second_workspace_closed=False)
