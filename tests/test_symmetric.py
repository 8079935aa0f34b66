"""Symmetric workspaces: loopback and /dev/shm backends, the in-flight rule, leak-free set-up, availability."""

import ctypes
import glob
import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, ShapeError
from distfuse.fused import symmetric
from distfuse.fused.symmetric import (
    LoopbackWorkspace,
    WorkspaceBrokenError,
    WorkspaceBusyError,
    close_all,
    get_workspace,
    header_bytes,
    log_fallback_once,
    symmetric_memory_available,
)
from distfuse.testing import run_ranks, shutdown_pools

# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_header_holds_flags_counters_and_status(W):
    hdr = header_bytes(W)
    assert hdr % 256 == 0 and hdr >= 4 * (W * W + 2 * W)
    ws = LoopbackWorkspace(W, 1000)
    v = ws.rank_view(W - 1)
    assert v.flags.shape == (W, W) and v.counters.shape == (W,) and v.status.shape == (W,)
    assert v.nbytes >= 1000 and v.nbytes % 4096 == 0
    # Fresh flags are 0, below every epoch.
    assert int(v.flags.abs().sum()) == 0


def test_loopback_address_table_points_at_every_virtual_rank():
    W = 3
    ws = LoopbackWorkspace(W, 4096)
    for r in range(W):
        own = ws.rank_view(r)
        own.data(torch.int32, 4).copy_(torch.arange(4, dtype=torch.int32) + 100 * r)
        assert int(own.flag_ptrs[r]) == own.flags.data_ptr()
    table = ws.rank_view(0).data_ptrs.tolist()
    for r, addr in enumerate(table):
        seen = list((ctypes.c_int32 * 4).from_address(addr))
        assert seen == [100 * r + i for i in range(4)]


def test_typed_view_checks_capacity_and_alignment():
    ws = LoopbackWorkspace(2, 4096)
    v = ws.rank_view(0)
    assert v.data(torch.bfloat16, 2048).numel() == 2048
    with pytest.raises(ShapeError, match="expected at least 4196 bytes, got 4096"):
        v.data(torch.float32, 1025, offset=96)
    with pytest.raises(ShapeError, match="not a multiple"):
        v.data(torch.float32, 1, offset=2)


def test_in_flight_rule_on_loopback():
    ws = LoopbackWorkspace(2, 4096)
    with ws.in_flight("first") as epoch:
        assert epoch == 1 and ws.in_use == "first"
        with pytest.raises(WorkspaceBusyError, match="in use by 'first'"), ws.in_flight("second"):
            pass
        ws.require_in_flight("launcher")  # inside a claim: fine
    assert ws.in_use is None
    with pytest.raises(WorkspaceBusyError, match="outside an op"):
        ws.require_in_flight("launcher")
    with ws.in_flight("third") as epoch:
        assert epoch == 2
    # An error inside a claim breaks the workspace: peers may still be writing into it.
    with pytest.raises(ValueError), ws.in_flight("fails"):
        raise ValueError("boom")
    with pytest.raises(WorkspaceBrokenError), ws.in_flight("after"):
        pass


def test_log_fallback_once(caplog):
    reason = f"test reason {os.getpid()}"
    with caplog.at_level(logging.WARNING, logger="distfuse.fused"):
        assert log_fallback_once(reason) is True
        assert log_fallback_once(reason) is False
    assert sum(reason in rec.getMessage() for rec in caplog.records) == 1


# ---------------------------------------------------------------- /dev/shm across processes


def _leftovers(names):
    return [n for n in names if os.path.exists(os.path.join(symmetric.SHM_DIR, n))]


def _rank_setup_and_exchange():
    P = Partition.world()
    W, me = P.size, P.rank
    ws = get_workspace(P, 3000)
    assert ws.backend == "shm" and ws.nbytes >= 3000
    # Leak-free: every name is unlinked as soon as set-up returns, while the memory lives on.
    early_leftovers = _leftovers(ws.segment_names)
    v = ws.rank_view(me)
    ws.view(torch.int64, 4).copy_(torch.arange(4) + 1000 * me)
    assert ws.buffer.numel() == ws.nbytes and ws.flags.shape == (W, W)
    ws.barrier()
    seen = [list((ctypes.c_int64 * 4).from_address(int(a))) for a in ws.peer_ptrs.tolist()]
    # Writes through a peer's address land in the peer's own buffer.
    right = (me + 1) % W
    (ctypes.c_int64 * 1).from_address(int(v.data_ptrs[right]) + 32)[0] = 7000 + me
    ws.barrier()
    got_from_left = int(v.data(torch.int64, 5)[4])
    same = get_workspace(P, 2000) is ws
    with ws.in_flight("outer"):
        try:
            with ws.in_flight("inner"):
                pass
            busy = None
        except WorkspaceBusyError as exc:
            busy = str(exc)
    grown = get_workspace(P, 3 * 4096)
    out = dict(rank=me, seen=seen, got_from_left=got_from_left, same=same, busy=busy,
               early_leftovers=early_leftovers, names=ws.segment_names + grown.segment_names,
               old_closed=ws.closed, gen=ws.generation, grown_gen=grown.generation, grown_nbytes=grown.nbytes)
    close_all()
    return out


@pytest.mark.parametrize("W", [2, 4])
def test_shm_workspace_maps_every_peer_and_leaves_nothing(W):
    out = run_ranks(W, _rank_setup_and_exchange)
    for r, o in enumerate(out):
        assert o["seen"] == [[1000 * p + i for i in range(4)] for p in range(W)]
        assert o["got_from_left"] == 7000 + (r - 1) % W
        assert o["same"] and o["old_closed"]
        assert o["grown_gen"] == o["gen"] + 1 and o["names"][-1].endswith(f"-g{o['grown_gen']}-r{W - 1}")
        assert o["grown_nbytes"] >= 3 * 4096
        assert o["busy"] is not None and "one fused op in flight" in o["busy"]
        assert o["early_leftovers"] == []
    names = {n for o in out for n in o["names"]}
    assert len(names) == 2 * W  # two generations, one segment per rank
    assert _leftovers(names) == []


def _rank_setup_fault(faulty: int):
    P = Partition.world()
    symmetric._inject_fault_for_tests = "after_create" if P.rank == faulty else None
    try:
        get_workspace(P, 4096, timeout=1.5)
        result = ("ok", "")
    except CollectiveTimeoutError as exc:
        result = ("timeout", str(exc))
    except RuntimeError as exc:
        result = ("raised", str(exc))
    finally:
        symmetric._inject_fault_for_tests = None
    return dict(result=result, pid=os.getpid())


def test_setup_fault_times_out_on_peers_and_leaves_no_segment():
    try:
        out = run_ranks(3, _rank_setup_fault, 1)
    finally:
        shutdown_pools()  # the timed-out monitored barrier leaves the gloo world inconsistent
    assert out[1]["result"] == ("raised", "injected fault at set-up step 'after_create'")
    for r in (0, 2):
        kind, msg = out[r]["result"]
        assert kind == "timeout" and "did not complete within 1.5 s" in msg, msg
    # Names carry rank 0's pid; none may survive.
    assert glob.glob(os.path.join(symmetric.SHM_DIR, f"{symmetric.SHM_PREFIX}{out[0]['pid']}-*")) == []


def _rank_availability(fake_host_rank):
    P = Partition.world()
    symmetric._AVAILABLE.clear()
    real = socket.gethostname
    if P.rank == fake_host_rank:
        socket.gethostname = lambda: "elsewhere"
    try:
        return symmetric_memory_available(P, torch.device("cpu"))
    finally:
        socket.gethostname = real
        symmetric._AVAILABLE.clear()


def test_availability_is_collective_and_detects_several_hosts():
    ok = run_ranks(2, _rank_availability, -1)
    assert ok == [(True, "CPU shared memory (/dev/shm) with the Triton interpreter")] * 2
    split = run_ranks(2, _rank_availability, 1)
    for got, why in split:
        assert got is False and "span 2 hosts" in why


def _rank_inactive_rank_refused():
    P = Partition.world().create_partition_inclusive([0])
    if P.active:
        return "active"
    try:
        get_workspace(P, 64)
    except Exception as exc:  # noqa: BLE001 - the type is asserted by the caller
        return type(exc).__name__
    return "no error"


def test_get_workspace_refuses_an_inactive_rank():
    assert run_ranks(2, _rank_inactive_rank_refused) == ["active", "PartitionError"]
    assert dist.is_available()
