"""Symmetric workspaces: loopback and /dev/shm backends, the in-flight rule, leak-free set-up, availability."""

import contextlib
import ctypes
import glob
import logging
import os
import socket
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, ShapeError, UnsupportedError
from distfuse.fused import symmetric, symmetric_availability
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
    assert hdr % 256 == 0 and hdr >= 4 * (W * W + 2 * W)  # flags, counters, signature words
    ws = LoopbackWorkspace(W, 1000)
    v = ws.rank_view(W - 1)
    assert v.flags.shape == (W, W) and v.counters.shape == (W,) and v.status.shape == (W,) == v.sigs.shape
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
    symmetric_availability._AVAILABLE.clear()
    real = socket.gethostname
    if P.rank == fake_host_rank:
        socket.gethostname = lambda: "elsewhere"
    try:
        return symmetric_memory_available(P, torch.device("cpu"))
    finally:
        socket.gethostname = real
        symmetric_availability._AVAILABLE.clear()


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


# ---------------------------------------------------------------- several ranks on one GPU

OVERLAP = symmetric.ALLOW_OVERLAP_ENV


def _infos(*rows, host="node"):
    """Gathered ``(host, uuid, device, ok, reason)`` rows, in group-rank order."""
    return [(host, uuid, dev, True, "CUDA symmetric memory") for uuid, dev in rows]


def _verdict(infos, group_ranks=(0, 1), *, allow=False, can_access=lambda i, j: True, visible=None,
             device_index=0):
    return symmetric_availability._group_verdict(True, "CUDA symmetric memory", infos, list(group_ranks),
                                                 device_index, visible=visible if visible is not None else {},
                                                 can_access=can_access, allow_overlapping=allow)


def test_ranks_sharing_one_gpu_are_refused_with_the_ranks_device_and_env_var():
    ok, why = _verdict(_infos(("GPU-aaa", "cuda:0"), ("GPU-aaa", "cuda:0")), group_ranks=(3, 5))
    assert not ok
    assert "world ranks 3 (cuda:0), 5 (cuda:0) share one GPU" in why
    assert "GPU-aaa" in why and f"{OVERLAP}=1" in why


def test_sharing_one_gpu_is_allowed_with_the_env_var():
    ok, why = _verdict(_infos(("GPU-aaa", "cuda:0"), ("GPU-aaa", "cuda:0")), allow=True,
                       visible={"GPU-aaa": 0}, can_access=lambda i, j: False)
    assert ok and OVERLAP in why


def test_distinct_gpus_pass_and_p2p_is_still_checked():
    infos = _infos(("GPU-aaa", "cuda:0"), ("GPU-bbb", "cuda:1"))
    assert _verdict(infos, visible={"GPU-aaa": 0, "GPU-bbb": 1}) == (True, "CUDA symmetric memory")
    ok, why = _verdict(infos, group_ranks=(2, 7), visible={"GPU-aaa": 0, "GPU-bbb": 1},
                       can_access=lambda i, j: False)
    assert not ok and why == "no P2P access from cuda:0 to cuda:1 (world rank 7)"


def test_unknown_uuids_and_cpu_never_count_as_shared():
    # No uuid reported (per-rank CUDA_VISIBLE_DEVICES makes every GPU cuda:0): nothing to compare.
    assert _verdict(_infos(("", "cuda:0"), ("", "cuda:0")))[0]
    cpu = [("node", "", "cpu", True, "CPU shared memory")] * 2
    assert symmetric_availability._group_verdict(True, "CPU shared memory", cpu, [0, 1], None, visible={},
                                                 can_access=None,
                                                 allow_overlapping=False) == (True, "CPU shared memory")


def test_hosts_and_local_failures_come_first():
    infos = _infos(("GPU-aaa", "cuda:0")) + _infos(("GPU-aaa", "cuda:0"), host="other")
    ok, why = _verdict(infos)
    assert not ok and "span 2 hosts" in why
    assert symmetric_availability._group_verdict(False, "CUDA is not available", infos, [0, 1], 0, visible={},
                                                 can_access=None,
                                                 allow_overlapping=True) == (False, "CUDA is not available")


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False), ("true", False)])
def test_overlap_env_var_is_read_as_torch_reads_it(monkeypatch, value, expected):
    monkeypatch.setenv(OVERLAP, value)
    assert symmetric._allow_overlapping_devices() is expected
    monkeypatch.delenv(OVERLAP)
    assert symmetric._allow_overlapping_devices() is False


def _rank_availability_on_one_gpu(allow, order):
    """symmetric_memory_available over a 2-rank group whose ranks (listed in ``order``) report one GPU."""
    P = Partition.world().create_partition_inclusive(order)
    symmetric_availability._AVAILABLE.clear()
    try:
        with mock.patch.dict(os.environ), \
                mock.patch.object(symmetric_availability, "_local_verdict",
                                  lambda device: (True, "CUDA symmetric memory")), \
                mock.patch.object(symmetric_availability, "_device_uuid", lambda index: "GPU-one"), \
                mock.patch.object(torch.cuda, "device_count", lambda: 1), \
                mock.patch.object(torch.cuda, "can_device_access_peer", lambda i, j: True):
            if allow:
                os.environ[OVERLAP] = "1"
            else:
                os.environ.pop(OVERLAP, None)
            return symmetric_memory_available(P, torch.device("cuda", 0))
    finally:
        symmetric_availability._AVAILABLE.clear()


def test_availability_refuses_two_ranks_on_one_gpu_unless_allowed():
    for ok, why in run_ranks(2, _rank_availability_on_one_gpu, False, [1, 0]):
        assert not ok
        assert "world ranks 0 (cuda:0), 1 (cuda:0) share one GPU (uuid GPU-one)" in why and OVERLAP in why
    for ok, why in run_ranks(2, _rank_availability_on_one_gpu, True, [1, 0]):
        assert ok, why


# ---------------------------------------------------------------- peer addresses from per-rank offsets


def test_peer_addresses_use_each_ranks_own_offset_in_partition_order():
    # Group order is sorted world ranks [1, 3, 4]; the partition lists them as (4, 1, 3).
    bases = [0x10000, 0x90000, 0x50000]
    offsets = [0x0, 0x200, 0x400]
    got = symmetric._peer_addresses(bases, offsets, [0x8000] * 3, [1, 3, 4], (4, 1, 3), total=0x1000)
    assert got == [0x50400, 0x10000, 0x90200]


def test_peer_addresses_without_reported_sizes_check_only_the_sign():
    assert symmetric._peer_addresses([100, 200], [8, 16], [None, None], [0, 1], [0, 1], total=64) == [108, 216]
    with pytest.raises(UnsupportedError, match=r"partition rank 1 \(world rank 0\).*got -8"):
        symmetric._peer_addresses([100, 200], [-8, 0], [None, None], [0, 1], [1, 0], total=64)


def test_peer_addresses_refuse_a_buffer_outside_its_allocation():
    # World rank 3 (partition rank 2) places its 0x1000-byte buffer at 0x7800 in a 0x8000-byte allocation.
    with pytest.raises(UnsupportedError, match=r"partition rank 2 \(world rank 3\).*\[0, 28672\].*got 30720"):
        symmetric._peer_addresses([0, 0, 0], [0, 0x7800, 0], [0x8000] * 3, [1, 3, 4], (4, 1, 3), total=0x1000)
    # Exactly at the end fits.
    symmetric._peer_addresses([0, 0, 0], [0, 0x7000, 0], [0x8000] * 3, [1, 3, 4], (4, 1, 3), total=0x1000)


class _FakeSymmHandle:
    def __init__(self, buffer_ptrs, buffer_size):
        self.buffer_ptrs = buffer_ptrs
        self.buffer_size = buffer_size

    def barrier(self, channel=0, timeout_ms=None):
        pass


def _rank_cuda_setup_with_pool_offsets(order, offsets, short):
    """``_setup_cuda`` on CPU with torch's symmetric-memory calls stubbed: each rank's pool puts its
    buffer at ``offsets[world rank]``; ``short`` world rank reports an allocation 1 byte too small."""
    import torch.distributed._symmetric_memory as symm_mem

    P = Partition.world().create_partition_inclusive(order)
    me, total = dist.get_rank(), 4096
    keep = {}

    def fake_empty(n, dtype, device):
        keep["backing"] = torch.zeros(offsets[me] + n + 64, dtype=dtype)
        return keep["backing"][offsets[me]: offsets[me] + n]

    def fake_rendezvous(buf, group):
        bases: list = [None] * P.size
        dist.all_gather_object(bases, keep["backing"].data_ptr(), group=P.meta_group)  # group-rank order
        size = keep["backing"].numel() - (65 if me == short else 0)
        return _FakeSymmHandle(bases, size)

    ws = symmetric.SymmetricWorkspace.__new__(symmetric.SymmetricWorkspace)
    ws.device, ws.rank, ws.world_size, ws.timeout, ws.backend = torch.device("cuda", 0), P.rank, P.size, 5.0, "cuda"
    with mock.patch.object(symmetric, "_symm_mem_api", lambda: "rendezvous"), \
            mock.patch.object(symm_mem, "empty", fake_empty), \
            mock.patch.object(symm_mem, "rendezvous", fake_rendezvous), \
            mock.patch.object(symm_mem, "enable_symm_mem_for_group", None, create=True), \
            mock.patch.object(torch.cuda, "device", lambda device: contextlib.nullcontext()):
        try:
            buf, ptrs = ws._setup_cuda(P, total)
        except UnsupportedError as exc:
            return "error", str(exc)
    by_world: list = [None] * dist.get_world_size()
    dist.all_gather_object(by_world, buf.data_ptr())
    return ptrs, [by_world[w] for w in P.ranks]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_cuda_setup_addresses_every_peer_at_its_own_offset(order):
    for ptrs, expected in run_ranks(3, _rank_cuda_setup_with_pool_offsets, order, {0: 0, 1: 512, 2: 4096}, -1):
        assert ptrs == expected


def test_cuda_setup_refuses_a_peer_buffer_outside_its_allocation():
    for kind, why in run_ranks(3, _rank_cuda_setup_with_pool_offsets, [2, 0, 1], {0: 0, 1: 512, 2: 4096}, 1):
        assert kind == "error" and "partition rank 2 (world rank 1)" in why and "got 512" in why
