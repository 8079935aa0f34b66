"""Defects a first GPU contact would hit, caught on CPU (issue 21, section 1).

* A launch off the main thread: the persistent GEMM + scatter kernel reads its operands
  through host-side tensor descriptors, so no per-thread Triton allocator is needed (CUDA
  autograd runs backward on its own thread).  Launched from a ``threading.Thread``,
  against a float64 reference with poisoned outputs.
* Peer views: every tensor over a peer's workspace memory comes from
  :mod:`distfuse.fused.peer_views`, aliases the peer's address (checked), and a view that
  does not (a silent copy) raises :class:`~distfuse.fused.peer_views.PeerViewError` by name.
  On the ``/dev/shm`` backend across processes.
* Deferred status checks: forced on CPU, a flag wait that gave up does not raise inside
  the op (no host sync there) but at the next claim of the workspace, naming the op.
* The kernel that ran: a forced fallback of ``triton_persistent`` is recorded as the pointer
  kernel, with its reason, by the selector, by ``run_producer`` and in a layer's ``last_decision``.
"""

import math
import os
import threading

import pytest
import torch

from distfuse import Partition
from distfuse.errors import CollectiveTimeoutError, UnsupportedError
from distfuse.fused import peer_views
from distfuse.fused.providers import last_kernel, run_producer
from distfuse.fused.symmetric import close_all
from distfuse.fused.workspace import LoopbackWorkspace, check_pending, status_check_mode
from distfuse.geometry.decomposition import block_extent, block_range
from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter_workspace_bytes
from distfuse.kernels.matmul_scatter_select import PROVIDER_KERNELS, select_scatter_kernel
from distfuse.testing import run_ranks
from tests.tolerances import tol

BLOCKS = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, PROGRAMS=2)


def _inputs(n, W, K, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(2, n, K, generator=g).to(dtype) for _ in range(W)]
    w = [(torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype) for _ in range(W)]
    return a, w


def _ref64(a, w, r):
    n = a[0].shape[-2]
    rows = slice(*block_range(n, len(a), r))
    return sum(x[:, rows].double() @ v.double().t() for x, v in zip(a, w, strict=True))


def _persistent_op(a, w, W, n, N, device, config):
    """Every virtual rank's persistent producer, then every consumer, into poisoned outputs."""
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32), device)
    outs = []
    with ws.in_flight("threaded"):
        for r in range(W):
            choice = run_producer("triton_persistent", a[r], w[r], ws, r, W, torch.float32, config=config)
            assert choice.kernel == "matmul_scatter_persistent", choice
        for r in range(W):
            out = torch.full((2, block_extent(n, W, r), N), float("nan"), device=device)
            outs.append(chunk_reduce(ws, r, W, 2, n, N, partial_dtype=torch.float32, out=out))
    return outs


def _allocator_in_this_thread():
    """Triton's allocator as this thread sees it (a ContextVar), or None where the private API moved."""
    try:
        from triton.runtime import _allocation
    except ImportError:
        return None
    return _allocation._allocator.get()


def _launch_in_thread(device, config, dtype=torch.float32):
    """``dtype`` operands (fp32 partials either way: products of 16-bit inputs are exact in fp32, so the fp32
    tolerance holds for both)."""
    W, n, K, N = 3, 10, 32, 24
    a, w = _inputs(n, W, K, N, dtype, seed=11)
    a, w = [x.to(device) for x in a], [v.to(device) for v in w]
    result = {}

    def body():
        try:
            result["allocator"] = type(_allocator_in_this_thread()).__name__
            result["outs"] = [o.cpu() for o in _persistent_op(a, w, W, n, N, device, config)]
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            result["error"] = exc

    t = threading.Thread(target=body, name="not-main")
    t.start()
    t.join(timeout=300)
    assert not t.is_alive(), "the launch in the second thread hung"
    if "error" in result:
        raise result["error"]
    for r, out in enumerate(result["outs"]):
        assert not torch.isnan(out).any(), f"rank {r}: an output element was never written"
        torch.testing.assert_close(out.double(), _ref64([x.cpu() for x in a], [v.cpu() for v in w], r),
                                   **tol(torch.float32))
    return result


def test_persistent_launch_from_a_second_thread():
    """A thread that never called ``triton.set_allocator`` launches the persistent kernel (host descriptors)."""
    result = _launch_in_thread(torch.device("cpu"), BLOCKS)
    # The thread sees no allocator (the ContextVar's default), so the launch cannot have relied on one.
    assert result["allocator"] in ("NullAllocator", "NoneType"), result["allocator"]


@pytest.mark.cuda
def test_persistent_launch_from_a_second_thread_cuda():
    """Compiled: the same from a thread that never set an allocator (device descriptors raised here before).

    bf16 operands: for fp32 with IEEE products the selector runs the pointer kernel (the persistent one spills)."""
    _launch_in_thread(torch.device("cuda"), None, torch.bfloat16)


@pytest.mark.cuda
def test_persistent_recompute_on_the_autograd_thread_cuda():
    """Compiled: a checkpointed forward through the persistent provider is recomputed in backward, on autograd's
    own device thread (which never called ``triton.set_allocator``); forward and gradients against float64."""
    from torch.utils.checkpoint import checkpoint

    from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter_loopback
    from tests.tolerances import assert_rel_close

    W, n, K, N = 4, 256, 512, 256
    g = torch.Generator().manual_seed(5)
    dev = torch.device("cuda")
    xs64 = [torch.randn(1, n, K, generator=g, dtype=torch.float64) for _ in range(W)]
    ws64 = [torch.randn(N, K, generator=g, dtype=torch.float64) / math.sqrt(K) for _ in range(W)]
    xs = [x.to(dev, torch.bfloat16).requires_grad_() for x in xs64]
    wts = [w.to(dev, torch.bfloat16) for w in ws64]
    ws = LoopbackWorkspace(W, 4 * W * n * N * 4, dev)
    threads = []

    def forward(*x):
        threads.append(threading.current_thread().name)
        return tuple(matmul_reduce_scatter_loopback(list(x), wts, None, ws, provider="triton_persistent"))

    ys = checkpoint(forward, *xs, use_reentrant=False)
    torch.autograd.backward([y.float().sum() for y in ys])
    torch.cuda.synchronize()
    check_pending()
    assert len(threads) == 2  # the forward, then its recompute inside backward
    x64 = [x.to(torch.bfloat16).double() for x in xs64]
    w64 = [w.to(torch.bfloat16).double() for w in ws64]
    for r in range(W):
        rows = slice(*block_range(n, W, r))
        ref = sum(x[:, rows] @ w.t() for x, w in zip(x64, w64, strict=True))
        assert_rel_close(ys[r].detach().cpu(), ref, torch.bfloat16, f"y[{r}]")
        # d(sum of every y)/dx_r = ones [n, N] @ w_r
        assert_rel_close(xs[r].grad.cpu(), torch.ones(1, n, N, dtype=torch.float64) @ w64[r], torch.bfloat16,
                         f"dx[{r}]")


# ---------------------------------------------------------------- peer views


def test_peer_views_alias_the_peer_table_in_loopback():
    W = 3
    ws = LoopbackWorkspace(W, 4096)
    view = ws.rank_view(0)
    table = view.data_ptrs.tolist()
    for p in range(W):
        t = peer_views.peer_data(view, p, torch.float32, 8, 64)
        assert t.data_ptr() == table[p] + 64
        t.fill_(p + 1)  # written through the view, read through the owner's own buffer
        assert torch.equal(ws.rank_view(p).data(torch.float32, 8, 64), torch.full((8,), float(p + 1)))
        assert peer_views.peer_flags(view, p).data_ptr() == view.flag_ptrs.tolist()[p]


def test_a_view_that_is_a_copy_raises_by_name(monkeypatch):
    ws = LoopbackWorkspace(2, 4096)
    with pytest.raises(peer_views.PeerViewError, match=r"matmul_scatter_cublas.*peer 1.*expected data_ptr 0x"):
        peer_views.check_peer_view(torch.zeros(4), ws.rank_view(0).data_ptrs.tolist()[1], op="matmul_scatter_cublas",
                                   peer=1)
    real = peer_views._raw_buffer
    monkeypatch.setattr(peer_views, "_raw_buffer", lambda *args: real(*args).clone())  # what a silent copy looks like
    with pytest.raises(peer_views.PeerViewError, match="peer 0's workspace memory is not that memory"):
        peer_views.peer_data(ws.rank_view(1), 0, torch.float32, 4)
    assert issubclass(peer_views.PeerViewError, UnsupportedError)


def _rank_peer_views():
    from distfuse.fused.symmetric import SymmetricWorkspace

    P = Partition.world()
    ws = SymmetricWorkspace(P, 4096)
    try:
        W, r = ws.world_size, ws.rank
        view = ws.rank_view(r)
        table = view.data_ptrs.tolist()
        got = []
        for p in range(W):
            t = peer_views.peer_data(view, p, torch.int32, 4, 16 * r)
            got.append(t.data_ptr() == table[p] + 16 * r)
            t.copy_(torch.tensor([100 * r + p] * 4, dtype=torch.int32))  # into peer p's region, slot r
        ws.barrier("test")
        mine = view.data(torch.int32, 4 * W).view(W, 4)[:, 0].tolist()  # what every peer wrote here
        try:
            peer_views.check_peer_view(torch.zeros(4), table[(r + 1) % W], op="test_peer", peer=(r + 1) % W)
            raised = None
        except peer_views.PeerViewError as exc:
            raised = str(exc)
        ws.barrier("test")
        return dict(rank=r, aliased=got, mine=mine, raised=raised)
    finally:
        ws.close()


def test_peer_views_across_processes_on_dev_shm():
    out = run_ranks(3, _rank_peer_views)
    for o in out:
        r = o["rank"]
        assert all(o["aliased"]), o
        assert o["mine"] == [100 * s + r for s in range(3)], o  # every source's write landed in rank r's memory
        assert o["raised"] and "test_peer" in o["raised"] and f"peer {(r + 1) % 3}" in o["raised"]


# ---------------------------------------------------------------- deferred status checks


def test_status_check_defaults(monkeypatch):
    monkeypatch.delenv("DISTFUSE_STATUS_CHECK", raising=False)
    monkeypatch.delenv("DISTFUSE_DEBUG", raising=False)
    assert status_check_mode("cpu") == "sync"  # CPU tests see errors at once
    assert status_check_mode("cuda") == "deferred"  # no host sync per fused op on CUDA
    monkeypatch.setenv("DISTFUSE_STATUS_CHECK", "sync")
    assert status_check_mode("cuda") == "sync"
    monkeypatch.setenv("DISTFUSE_STATUS_CHECK", "bogus")
    with pytest.raises(ValueError, match="DISTFUSE_STATUS_CHECK"):
        status_check_mode("cpu")


def _missing_source(ws, W, n, N, out):
    """Virtual ranks 0 and 2 produce; rank 1 never does; rank 0's consumer waits for its flag and gives up."""
    a, w = _inputs(n, W, 16, N, torch.float32, seed=4)
    with ws.in_flight("missing source"):
        for r in (0, 2):
            run_producer("triton", a[r], w[r], ws, r, W, torch.float32, config=BLOCKS)
        chunk_reduce(ws, 0, W, 2, n, N, partial_dtype=torch.float32, out=out)


@pytest.mark.parametrize("sync_point", [False, True], ids=["next-claim", "check_pending"])
def test_deferred_status_surfaces_at_the_next_call_by_name(monkeypatch, sync_point):
    monkeypatch.setenv("DISTFUSE_STATUS_CHECK", "deferred")
    W, n, N = 3, 6, 16
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32))
    assert ws.status_mode == "deferred"
    out = torch.zeros(2, block_extent(n, W, 0), N)
    _missing_source(ws, W, n, N, out)  # no error inside the op: no host read of the status words
    assert ws.deferred and not ws.broken
    assert torch.isnan(out).all(), "the data that never came is NaN, not a plausible partial sum"
    match = r"chunk_reduce.*flag of peer\(s\) \[1\] was not raised"
    if sync_point:
        with pytest.raises(CollectiveTimeoutError, match=match):
            check_pending()
    else:
        with pytest.raises(CollectiveTimeoutError, match=match), ws.in_flight("the next fused op"):
            pass
    assert ws.broken and not ws.deferred


def test_sync_status_still_raises_inside_the_op_on_cpu(monkeypatch):
    monkeypatch.delenv("DISTFUSE_STATUS_CHECK", raising=False)
    W, n, N = 3, 6, 16
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32))
    with pytest.raises(CollectiveTimeoutError, match=r"chunk_reduce.*peer\(s\) \[1\]"):
        _missing_source(ws, W, n, N, torch.zeros(2, block_extent(n, W, 0), N))


# ---------------------------------------------------------------- the kernel that ran


def test_a_forced_fallback_names_the_kernel_that_ran():
    """K = 6 fp32 rows are 24 bytes apart: no tensor descriptor; the pointer kernel runs and is named."""
    W, n, K, N = 2, 5, 6, 16
    a, w = _inputs(n, W, K, N, torch.float32, seed=2)
    assert {p: select_scatter_kernel(a[0], w[0], p).kernel for p in PROVIDER_KERNELS} == {
        "triton": "matmul_scatter", "triton_persistent": "matmul_scatter", "cublas_chunks": "matmul_scatter_cublas"}
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(2, n, N, W, torch.float32))
    with ws.in_flight("fallback"):
        for r in range(W):
            choice = run_producer("triton_persistent", a[r], w[r], ws, r, W, torch.float32, config=BLOCKS)
        outs = [chunk_reduce(ws, r, W, 2, n, N, partial_dtype=torch.float32) for r in range(W)]
    assert choice.provider == "triton_persistent" and choice.kernel == "matmul_scatter" and choice.fell_back
    assert "16-byte" in choice.reason
    assert last_kernel("matmul_reduce_scatter") == choice
    for r in range(W):
        torch.testing.assert_close(outs[r].double(), _ref64(a, w, r), **tol(torch.float32))


def test_compiled_fp32_without_tf32_runs_the_pointer_kernel(monkeypatch):
    """The persistent kernel's fp32 IEEE dot spills kilobytes per thread: the selector says so and falls back."""
    a, w = _inputs(8, 2, 16, 16, torch.float32, seed=1)
    from distfuse.kernels import matmul_scatter_select

    monkeypatch.setattr(matmul_scatter_select, "tf32_allowed", lambda: False)  # torch's default: IEEE fp32
    choice = select_scatter_kernel(a[0], w[0], "triton_persistent", compiled=True)
    assert choice.kernel == "matmul_scatter" and "IEEE" in choice.reason
    bf = select_scatter_kernel(a[0].bfloat16(), w[0].bfloat16(), "triton_persistent", compiled=True)
    assert bf.kernel == "matmul_scatter_persistent" and not bf.fell_back
    assert select_scatter_kernel(a[0], w[0], "triton_persistent", compiled=False).kernel == \
        "matmul_scatter_persistent"  # the interpreter computes IEEE fp32 anyway: the tests keep the kernel


def _rank_layer_kernel(provider):
    from distfuse.layers import DistributedLinearReduceScatter

    P = Partition.world()
    P_feat = P.create_cartesian_topology_partition([1, 1, P.size])
    P_seq = P.create_cartesian_topology_partition([1, P.size, 1])
    torch.manual_seed(0)
    layer = DistributedLinearReduceScatter(P_feat, 12, 16, P_y=P_seq)  # in block 6 fp32: 24-byte rows
    x = torch.randn(2, 5, 6)
    os.environ["DISTFUSE_PATH"], os.environ["DISTFUSE_PROVIDER"] = "fused", provider
    try:
        layer(x)
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
        os.environ.pop("DISTFUSE_PROVIDER", None)
        close_all()  # the rank pool outlives the test: leave no cached workspace behind
    d = layer.last_decision
    return dict(path=d.path, provider=d.provider, kernel=d.kernel, reason=d.kernel_reason)


def test_last_decision_names_the_kernel_that_ran():
    for o in run_ranks(2, _rank_layer_kernel, "triton_persistent"):
        assert o["path"] == "fused" and o["provider"] == "triton_persistent", o
        assert o["kernel"] == "matmul_scatter" and "fell back" in o["reason"], o


def _rank_all_gather_kernel():
    from distfuse.layers import DistributedLinearAllGather

    P = Partition.world()
    P_feat = P.create_cartesian_topology_partition([1, 1, P.size])
    P_seq = P.create_cartesian_topology_partition([1, P.size, 1])
    torch.manual_seed(0)
    layer = DistributedLinearAllGather(P_feat, 6, 8, P_x=P_seq)
    x = torch.randn(2, 3 if P.rank == 0 else 2, 6)  # a sequence of 5 over 2 workers
    os.environ["DISTFUSE_PATH"] = "fused"
    try:
        layer(x)
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
        close_all()
    d = layer.last_decision
    return dict(path=d.path, kernel=d.kernel, reason=d.kernel_reason)


def test_last_decision_names_the_all_gather_consumer():
    """The all-gather linear names the consumer kernel that ran (the selector's choice), as the producers do."""
    for o in run_ranks(2, _rank_all_gather_kernel):
        assert o["path"] == "fused" and o["kernel"] in ("gathered_matmul_persistent", "gathered_matmul"), o
        assert o["reason"], o


def test_a_claim_does_not_wait_for_the_gpu_until_too_many_checks_pend():
    """Deferred copies whose event has not completed stay pending at a claim; past MAX_DEFERRED it waits for the
    oldest (fake events: what a CUDA event answers while the GPU is still busy)."""
    from distfuse.fused import workspace as wsmod
    from distfuse.fused.workspace_layout import PendingCheck

    class Busy:
        def __init__(self):
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    ws = LoopbackWorkspace(2, 4096)
    clean = torch.zeros(2, dtype=torch.int32)
    events = [Busy() for _ in range(wsmod.MAX_DEFERRED + 2)]
    ws.deferred = [PendingCheck(clean, e, 0, i + 1, "op", "what") for i, e in enumerate(events)]
    with ws.in_flight("next"):
        pass
    assert [e.waited for e in events] == [True, True] + [False] * wsmod.MAX_DEFERRED  # only the oldest two
    assert len(ws.deferred) == wsmod.MAX_DEFERRED and not ws.broken
    check_pending()  # the sync point waits for the rest
    assert all(e.waited for e in events) and not ws.deferred and not ws.broken
