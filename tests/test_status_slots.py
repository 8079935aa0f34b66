"""Per-launch status words (``distfuse.fused.status_slots``): one clear slot per consumer launch, reused once a
check found it clear, kept for good once a CUDA graph holds it, and mapped pinned host memory on CUDA.

On CPU the kernels are interpreted in this process and the slots are ordinary memory; a
CUDA capture is simulated by patching ``torch.cuda.is_current_stream_capturing`` (the check
only asks whether the stream captures).  The compiled pass (``pytest -m cuda``) checks that
the slots are pinned and that the probe's store landed; the missing-source tests of
``tests/test_gemm_kernels.py`` run the kernels' stores into them.
"""

from __future__ import annotations

import math

import pytest
import torch

from distfuse.errors import CollectiveTimeoutError, UnsupportedError
from distfuse.fused import status_slots
from distfuse.fused.status_slots import STATUS_WORDS_ENV, mapped_host_words, slot_stride
from distfuse.fused.workspace import LoopbackWorkspace
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter, matmul_scatter_workspace_bytes

BLOCKS = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
W, B, n, K, N = 3, 1, 6, 16, 16


def _op(ws, a, w, sources, consumers, outs):
    """One claim: the producers of ``sources``, then the consumers of ``consumers`` into ``outs``."""
    with ws.in_flight("status slots"):
        for r in sources:
            matmul_scatter(a[r], w[r], ws, r, W, config=BLOCKS)
        for r in consumers:
            chunk_reduce(ws, r, W, B, n, N, partial_dtype=torch.float32, out=outs[r])


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(B, n, K, generator=g) for _ in range(W)]
    w = [torch.randn(N, K, generator=g) / math.sqrt(K) for _ in range(W)]
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32))
    outs = [torch.full((B, block_extent(n, W, r), N), float("nan")) for r in range(W)]
    return ws, a, w, outs


@pytest.mark.parametrize("mode", ["sync", "deferred"])
def test_each_launch_gets_a_clear_slot_and_the_pool_is_reused(mode):
    ws, a, w, outs = _setup()
    ws.status_mode = mode
    slots = ws.status_slots
    blocks = len(slots._blocks)
    seen = set()
    for _ in range(5):
        _op(ws, a, w, range(W), range(W), outs)
        for r in range(W):
            words = ws.rank_view(r).last_status
            seen.add(words.data_ptr())
            assert words.shape == (W,) and not words.any(), words
            assert not torch.isnan(outs[r]).any()
    with ws.in_flight("the claim that reads the deferred checks"):
        pass
    assert not ws.deferred and not ws.broken
    assert len(slots._blocks) == blocks, "the steady state takes no new status memory"
    assert len(seen) <= W + 1, f"clear slots go back to the pool and are reused: {len(seen)} distinct slots"
    stride = slot_stride(W)
    assert stride % 4 == 0 and all(s.data_ptr() % 16 == 0 for s in slots._free), \
        "every slot 16-byte aligned: one Triton specialisation for all of them"


def test_launches_within_one_claim_give_their_slots_back():
    """Many consumer launches inside one claim (a benchmark's timing loop, a loop over virtual ranks): past
    ``DRAIN_DEFERRED`` pending checks a launch reads the finished ones, so the pending list stays bounded and the
    steady state takes no new status memory.  A failure among them still raises, by name, within the claim."""
    from distfuse.fused.workspace_layout import DRAIN_DEFERRED

    ws, a, w, outs = _setup(seed=3)
    ws.status_mode = "deferred"
    slots = ws.status_slots
    blocks, launches = len(slots._blocks), 3 * DRAIN_DEFERRED
    with ws.in_flight("one claim, many launches"):
        for r in range(W):
            matmul_scatter(a[r], w[r], ws, r, W, config=BLOCKS)
        most = 0
        for i in range(launches):
            chunk_reduce(ws, i % W, W, B, n, N, partial_dtype=torch.float32, out=outs[i % W])
            most = max(most, len(ws.deferred))
    assert most == DRAIN_DEFERRED - 1 and len(slots._blocks) == blocks and not ws.broken
    assert launches > DRAIN_DEFERRED * 2 and not any(torch.isnan(o).any() for o in outs)
    with pytest.raises(CollectiveTimeoutError, match=r"peer\(s\) \[2\]"), ws.in_flight("a missing source"):
        for r in (0, 1):
            matmul_scatter(a[r], w[r], ws, r, W, config=BLOCKS)
        for _ in range(DRAIN_DEFERRED):  # rank 1's consumer gives up on source 2 at once, then later launches
            chunk_reduce(ws, 1, W, B, n, N, partial_dtype=torch.float32, out=outs[1])  # read it within the claim
    assert ws.broken


def test_a_deferred_failure_is_read_from_its_own_launch():
    """Claim 1 is clean, claim 2 misses source 1: claim 2's entry reads claim 1's checks (clear, back to the
    pool), the next claim raises with claim 2's epoch, and the failed slot keeps its word (never reused)."""
    ws, a, w, outs = _setup(seed=1)
    ws.status_mode = "deferred"
    _op(ws, a, w, range(W), range(W), outs)
    assert len(ws.deferred) == W
    free_before = len(ws.status_slots._free)
    _op(ws, a, w, (0, 2), (0,), outs)
    assert [c.epoch for c in ws.deferred] == [2] and not ws.broken
    assert len(ws.status_slots._free) == free_before + W - 1, "claim 1's clear slots are back; claim 2 holds one"
    with pytest.raises(CollectiveTimeoutError, match=r"expected flag epoch 2, but the flag of peer\(s\) \[1\]"), \
            ws.in_flight("next"):
        pass
    assert ws.broken and not ws.deferred
    failed = ws.rank_view(0).last_status
    assert failed.tolist() == [0, 2, 0] and all(s.data_ptr() != failed.data_ptr() for s in ws.status_slots._free)
    assert torch.isnan(outs[0]).all()


def test_a_captured_slot_is_kept_and_read_at_every_claim(monkeypatch):
    """While a stream captures, every launch of a rank shares one slot, kept for good; after the capture the
    next launch takes a fresh one; a replay's failure written there raises at the next claim, by name."""
    ws, a, w, outs = _setup(seed=2)
    st = ws.rank_view(0)
    monkeypatch.setattr(st, "device", torch.device("cuda"))  # the check asks only the device type and the stream
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = st.status
    st.check_status("chunk_reduce", "partials of chunk 0")
    assert st.status is captured, "launches inside one capture share the slot"
    st.check_status("chunk_reduce", "partials of chunk 0")
    assert [c[0] for c in ws.status_slots.captured] == [captured] and not ws.deferred
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(st, "device", torch.device("cpu"))
    assert st.status is not captured, "the first launch after the capture takes a fresh slot"
    _op(ws, a, w, range(W), range(W), outs)  # eager ops go on; the captured slot is read at each claim
    assert not ws.broken and all(s.data_ptr() != captured.data_ptr() for s in ws.status_slots._free)
    captured[1] = 9  # a replay's flag wait for source 1 gave up at epoch 9
    with pytest.raises(CollectiveTimeoutError, match=r"epoch 9 \(in a CUDA graph replay\).*peer\(s\) \[1\]"), \
            ws.in_flight("after the replay"):
        pass
    assert ws.broken
    _forked_child_forgets(ws)


def _child_check_pending(queue):
    from distfuse import check_pending
    from distfuse.primitives import _flag_deferred

    try:
        check_pending()
        queue.put(("ok", len(_flag_deferred._PENDING)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
        queue.put((type(exc).__name__, str(exc)[:300]))


def _forked_child_forgets(ws):
    """A child forked now (a pool of forked ranks, a DataLoader worker) ran none of this process's ops: its sync
    point must not raise their failures, nor hold their pending flag records.  This process still raises them."""
    import multiprocessing as mp

    from distfuse import check_pending
    from distfuse.primitives import _flag_deferred

    class Record:  # a stand-in for a layer's pending flag record
        _order = -1

        def settle_previous(self):
            pass

    held = Record()
    _flag_deferred._PENDING.add(held)
    try:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_check_pending, args=(queue,))
        child.start()
        got = queue.get(timeout=60)
        child.join(60)
        assert got == ("ok", 0) and child.exitcode == 0, got
        with pytest.raises(CollectiveTimeoutError, match="epoch 9"):
            check_pending()  # here, the failure is still this process's to raise
    finally:
        _flag_deferred._PENDING.discard(held)
        ws.status_slots.captured.clear()  # leave no broken workspace for later tests of this process


@pytest.mark.parametrize("world", [1, 3, 4, 5])
def test_words_clear_reads_each_slot_in_place(world):
    """A pool's slots carry their numpy view (``host_words``), which reads the slot's memory as it is now: a word the
    kernel stores after the slot was handed out (any of them; a timed-out wait's epoch, a mismatch's -1..-3) makes
    the check fail, and the pool's padding words beside a slot (slots are 16 bytes apart) never count."""
    pool = status_slots.StatusSlots(world, torch.device("cpu"))
    slot = pool.take()
    assert slot.host_words.shape == (world,) and status_slots.words_clear(slot)
    for i in range(world):
        for value in (7, -1, -2, -3, 1 << 24):
            slot[i] = value  # as a kernel's store: the numpy view made at the pool's growth sees it
            assert not status_slots.words_clear(slot), (i, value)
            slot[i] = 0
            assert status_slots.words_clear(slot)
    block = pool._blocks[0]
    block.fill_(5)
    block[slot.storage_offset(): slot.storage_offset() + world] = 0  # only the slot's own words count
    assert status_slots.words_clear(slot)
    other = torch.tensor([0, 0, 9], dtype=torch.int32)  # words without a numpy view of their own (a pinned copy)
    assert not status_slots.words_clear(other) and status_slots.words_clear(torch.zeros(3, dtype=torch.int32))


def test_the_status_words_knob(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setenv(STATUS_WORDS_ENV, "device")
    assert mapped_host_words(dev) is False  # no probe at all
    monkeypatch.setenv(STATUS_WORDS_ENV, "bogus")
    with pytest.raises(ValueError, match=STATUS_WORDS_ENV):
        mapped_host_words(dev)
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(status_slots, "_probe_mapped", lambda index: (False, "RuntimeError: no CUDA here"))
    monkeypatch.setenv(STATUS_WORDS_ENV, "auto")
    assert mapped_host_words(dev) is False  # the words stay on the device
    monkeypatch.setenv(STATUS_WORDS_ENV, "host")
    with pytest.raises(UnsupportedError, match=r"cuda:0 cannot write pinned host memory \(RuntimeError: no CUDA"):
        mapped_host_words(dev)


@pytest.mark.cuda
def test_status_words_are_mapped_pinned_memory_on_cuda():
    """Compiled: the probe's store into pinned host memory landed, so every slot is pinned and read in place."""
    dev = torch.device("cuda", torch.cuda.current_device())
    assert status_slots._probe_mapped(dev.index) == (True, "")
    ws = LoopbackWorkspace(2, 4096, dev)
    slot = ws.rank_view(0).status
    assert ws.status_slots.mapped and slot.device.type == "cpu" and slot.is_pinned() and slot.data_ptr() % 16 == 0


@pytest.mark.cuda
def test_a_launch_on_another_stream_is_read_after_that_stream_cuda():
    """Compiled, deferred: a consumer launched on a side stream inside a claim taken on the default stream; its
    check waits for the side stream (an event recorded on the claim's idle stream would read the words before the
    kernel wrote them, and miss the failure)."""
    from distfuse.fused.workspace import check_pending

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(B, n, K, generator=g).to(dev) for _ in range(W)]
    w = [(torch.randn(N, K, generator=g) / math.sqrt(K)).to(dev) for _ in range(W)]
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(B, n, N, W, torch.float32), dev, timeout=0.5)
    ws.status_mode = "deferred"
    out = torch.zeros(B, block_extent(n, W, 0), N, device=dev)
    side = torch.cuda.Stream(dev)
    with ws.in_flight("side stream"):
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for r in (0, 2):  # source 1 never produces: the consumer waits out the 0.5 s timeout
                matmul_scatter(a[r], w[r], ws, r, W)
            chunk_reduce(ws, 0, W, B, n, N, partial_dtype=torch.float32, out=out)
        torch.cuda.current_stream(dev).wait_stream(side)
    assert ws.deferred and not ws.broken
    with pytest.raises(CollectiveTimeoutError, match=r"flag of peer\(s\) \[1\] was not raised"):
        check_pending()
    assert torch.isnan(out).all()


def test_claims_and_checks_find_the_stream_by_its_raw_handle(monkeypatch):
    """The CUDA bookkeeping with stand-ins for the stream calls (the CPU build has none): a claim builds a Stream
    object only when the raw handle changed (and then orders the new stream after the last one); a deferred check
    records its event on the claim's stream while that is current, else on the stream torch reports."""
    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

    class Event:
        def record(self, stream=None):
            self.stream = stream

        def query(self):  # the launch has finished: the next claim reads its words
            return True

    streams = {1: Stream("default"), 2: Stream("side")}
    current = {"raw": 1}
    built = []

    def current_stream(device=None):
        built.append(current["raw"])
        return streams[current["raw"]]

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current["raw"], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    ws = LoopbackWorkspace(2, 4096)
    ws.status_mode = "deferred"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(ws, "device", cuda)
    st = ws.rank_view(0)
    monkeypatch.setattr(st, "device", cuda)
    monkeypatch.setattr(ws.status_slots, "mapped", True)  # host words: the check reads them in place
    for _ in range(3):
        with ws.in_flight("same stream"):
            st.check_status("op", "what")
            assert ws.deferred[-1].event.stream.name == "default"
    assert built == [1], "one Stream object for three claims on one stream"
    current["raw"] = 2
    with ws.in_flight("another stream"):
        pass
    assert built == [1, 2] and streams[2].waited == ["default"], "a claim on a new stream waits for the last one"
    with ws.in_flight("launch on a third stream"):
        current["raw"] = 3
        streams[3] = Stream("third")
        st.check_status("op", "what")
    assert ws.deferred[-1].event.stream.name == "third", "the event goes where the launch went"
    ws.deferred.clear()  # stand-in events: no later check_pending reads them
