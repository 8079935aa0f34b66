"""CUDA-graph capture safety of the halo-convolution and linear hot paths, checked on CPU; and captures on a GPU.

A CUDA graph replays device work only: a captured region must not read a device tensor on
the host (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``: illegal while capturing),
must not run host-side collectives (their effect is not replayed), and must not allocate
workspaces that a replay would not see.  The feature convolution's steady state reads
one agreement flag per call on the host; :func:`distfuse.primitives._agreement.capture_safe`
(entered by itself while a CUDA stream captures) trusts the agreement made in eager
warm-up instead.

On CPU (gloo, the fused path interpreted by Triton), a training step (forward and backward)
of ``DistributedConv2d`` over ``[1, 1, 2, 2]``, fused and unfused, after two eager warm-up
steps and inside ``capture_safe()``:

* performs no host read of a tensor (a dispatch mode counts ``_local_scalar_dense`` and
  ``nonzero``; the same step outside ``capture_safe()`` reads the flag, the control that
  shows the counter sees host reads);
* runs no host-side collective (the metadata all-gather, barriers, object collectives
  are counted); the halo and parameter rounds are point-to-point (``batch_isend_irecv``,
  capturable under NCCL);
* creates or grows no symmetric workspace (the halo path uses none; the check keeps it so);
* gives bitwise the results of the eager step.

Epochs: the halo path has none (its rounds are matched point-to-point messages).  The GEMM
fusions' flags carry the workspace's *device* epoch, which every claim advances in stream
order and every kernel loads, so a replayed graph raises and expects a new epoch.  On CPU
(three of four gloo ranks, permuted, the fused ops interpreted), a warm training step of
the all-gather + GEMM (copy-engine push) and of the GEMM + reduce-scatter (cuBLAS-per-chunk
producer):

* reads no tensor on the host through a torch op: the status words (once per consumer, the
  CPU check; on CUDA the check is skipped while a stream captures) are read through numpy
  when they are clear, so the watcher sees no read at all;
* runs no host-side collective except the workspace barrier (``monitored_barrier``, the
  CPU stand-in for the symmetric-memory device barrier on the stream);
* creates or grows no workspace, and advances the device epoch by one per claim;
* gives bitwise the eager results, also after the device epoch has been moved on behind
  the host's back (as replays do): the kernels read the device epoch, not the host's.

The linear layers (all-gather into reduce-scatter on ``[2, 2]``, and ``DistributedLinear``
with ``P_w`` workers outside ``P_x``), a warm training step inside ``capture_safe()`` on CPU:
no host read, no host-side collective (int64 records and flag rounds; the data collectives
and point-to-point rounds are counted apart), one trusted call per layer, bitwise the eager
results, and no round on the shared-memory flag board; outside ``capture_safe()`` the same step
reads its flags, or takes its board rounds (``DistributedLinear``'s host round on one host: the control).  A call
that changes its shape inside ``capture_safe()`` raises ``UnsupportedError`` on its worker.

The ``cuda`` tests capture forward and backward of the halo layer in a ``torch.cuda.CUDAGraph``
(one rank, NCCL), a training step of the three linear layers (one rank, NCCL), and forward
and backward of the fused GEMM ops on a loopback workspace (every virtual rank on one GPU),
and replay them on new data against eager (the linears: against float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import distfuse._compat as compat
from distfuse.fused import symmetric
from distfuse.geometry.decomposition import local_slices
from distfuse.layers.conv import DistributedConv2d
from distfuse.primitives import _flag_board
from distfuse.primitives._agreement import capture_safe
from distfuse.testing import run_ranks
from tests.test_conv_support import grid, with_path
from tests.tolerances import tol


def _typical(t: torch.Tensor) -> float:
    """The root mean square of a float64 reference: the size of its partial sums (random-sign terms)."""
    return float(t.double().pow(2).mean().sqrt())


def _close64(got: torch.Tensor, ref: torch.Tensor, what: str, terms: int, steps: int = 1) -> None:
    """An fp32 result against its float64 reference: the rounding bound of sums of ``terms`` terms on the
    reference's scale, ``steps`` chained sums (layers) deep."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape and not torch.isnan(got).any(), (what, tuple(got.shape), tuple(ref.shape))
    torch.testing.assert_close(got, ref, **tol(torch.float32, terms=terms, steps=steps, scale=_typical(ref)),
                               msg=lambda m: f"{what}: {m}")


class _HostReads(TorchDispatchMode):
    """Counts the aten ops that read a tensor's value on the host (a device sync on CUDA)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class _HostCollectives:
    """Counts host-side collectives (patched for the duration of a ``with``) and point-to-point batches."""

    NAMES = ("all_gather_object", "broadcast_object_list", "monitored_barrier", "barrier", "all_reduce",
             "all_gather_into_tensor", "gather_object")

    def __enter__(self):
        self.calls, self.p2p, self._saved = [], 0, []

        def counting(name, fn):
            def wrapper(*args, **kwargs):
                self.calls.append(name)
                return fn(*args, **kwargs)
            return wrapper

        for name in self.NAMES:
            self._saved.append((dist, name, getattr(dist, name)))
            setattr(dist, name, counting(name, getattr(dist, name)))
        for name in ("_ALL_GATHER", "_REDUCE_SCATTER"):  # distfuse's flat collectives (the metadata gathers)
            self._saved.append((compat, name, getattr(compat, name)))
            setattr(compat, name, counting(f"distfuse {name}", getattr(compat, name)))
        batch = dist.batch_isend_irecv

        def counting_batch(ops):
            self.p2p += 1
            return batch(ops)

        self._saved.append((dist, "batch_isend_irecv", batch))
        dist.batch_isend_irecv = counting_batch
        self._saved.append((symmetric, "get_workspace", symmetric.get_workspace))
        symmetric.get_workspace = counting("get_workspace", symmetric.get_workspace)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)



def _hot_path(path: str):
    P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
    torch.manual_seed(0)
    layer = DistributedConv2d(P_x, 3, 4, 3, padding=1)
    gen = torch.Generator().manual_seed(3)
    xg = torch.randn(2, 3, 7, 6, generator=gen)
    dyg = torch.randn(2, 4, 7, 6, generator=gen)
    sl, sl_y = local_slices(xg.shape, P_x.shape, P_x.index), local_slices(dyg.shape, P_x.shape, P_x.index)

    def step():
        x = xg[sl].clone().requires_grad_(True)
        y = with_path(path, lambda: layer(x))
        y.backward(dyg[sl_y])
        out = [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return out

    step(), step()  # warm-up: the agreement settles, plans and tables are built
    eager = step()
    workspaces = dict(symmetric._CACHE)
    with _HostCollectives() as coll, _HostReads() as reads, capture_safe():
        trusted = step()
    with _HostReads() as control:  # outside capture_safe the steady state reads the agreement flag
        step()
    same = all(torch.equal(a, b) for a, b in zip(trusted, eager, strict=True))
    return dict(reads=reads.reads, collectives=coll.calls, p2p=coll.p2p, control=control.reads, same=same,
                workspaces_same=dict(symmetric._CACHE) == workspaces, path=layer.last_path)


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_halo_conv_step_is_capture_safe(path):
    if path == "fused":
        pytest.importorskip("triton")
    for rank, r in enumerate(run_ranks(4, _hot_path, path)):
        assert r["path"] == path
        assert r["reads"] == [], f"rank {rank}: host reads inside the capture-safe step: {r['reads']}"
        assert r["collectives"] == [], f"rank {rank}: host-side collectives: {r['collectives']}"
        assert r["p2p"] > 0, f"rank {rank}: no point-to-point round counted (the counter has no teeth)"
        assert r["control"], f"rank {rank}: the eager steady state read no flag (the read counter has no teeth)"
        assert r["workspaces_same"], f"rank {rank}: a symmetric workspace was created or grown"
        assert r["same"], f"rank {rank}: the capture-safe step differs from the eager one"


def _window_layers_path(path: str):
    """A max pool whose windows reach the padding (3/2/1), then a bilinear upsampling, over [1, 1, 2, 2] permuted."""
    from distfuse.layers.pool import DistributedMaxPool2d
    from distfuse.layers.upsample import DistributedUpsample

    P_x = grid((2, 0, 3, 1), (1, 1, 2, 2))
    pool, up = DistributedMaxPool2d(P_x, 3, stride=2, padding=1), DistributedUpsample(P_x, scale_factor=1.5,
                                                                                       mode="bilinear")
    gen = torch.Generator().manual_seed(4)
    xg = torch.randn(2, 3, 9, 8, generator=gen)
    sl = local_slices(xg.shape, P_x.shape, P_x.index)

    def step():
        x = xg[sl].clone().requires_grad_(True)
        y = with_path(path, lambda: up(pool(x)))
        y.backward(torch.ones_like(y))
        return [y.detach(), x.grad]

    step(), step()  # warm-up: the agreements settle, windows and plans are built
    eager = step()
    calls = [m.agreement.calls for m in (pool, up)]
    with _HostCollectives() as coll, _HostReads() as reads, capture_safe():
        trusted = step()
    trusted_calls = [m.agreement.calls - c for m, c in zip((pool, up), calls, strict=True)]
    modes = [m.session.last_mode for m in (pool, up)]
    with _HostReads() as control:  # outside capture_safe the steady state reads the agreement flag
        step()
    return dict(reads=reads.reads, collectives=coll.calls, p2p=coll.p2p, control=control.reads,
                same=all(torch.equal(a, b) for a, b in zip(trusted, eager, strict=True)), trusted_calls=trusted_calls,
                modes=modes, control_modes=[m.session.last_mode for m in (pool, up)],
                paths=[m.last_path for m in (pool, up)])


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_pool_and_upsample_step_is_capture_safe(path):
    """Pooling and upsampling (one agreement session each, one forward) inside ``capture_safe()``: the session
    trusts its settled record (no flag round, no metadata gather), the max pool skips its host check of the
    all--inf windows, the halo rounds still run, and the step is bitwise the eager one."""
    if path == "fused":
        pytest.importorskip("triton")
    for rank, r in enumerate(run_ranks(4, _window_layers_path, path)):
        assert r["paths"] == [path, path], r["paths"]
        assert r["reads"] == [], f"rank {rank}: host reads inside the capture-safe step: {r['reads']}"
        assert r["collectives"] == [], f"rank {rank}: host-side collectives: {r['collectives']}"
        assert r["p2p"] > 0, f"rank {rank}: no point-to-point round counted (the counter has no teeth)"
        assert r["control"], f"rank {rank}: the eager steady state read no flag (the read counter has no teeth)"
        assert r["trusted_calls"] == [1, 1] and r["modes"] == ["trust", "trust"], r
        assert r["control_modes"] == ["settle", "settle"], r
        assert r["same"], f"rank {rank}: the capture-safe step differs from the eager one"


def _shape_change_refused():
    from distfuse.errors import UnsupportedError

    P_x = grid(range(4), (1, 1, 2, 2))
    layer = DistributedConv2d(P_x, 2, 3, 3, padding=1)
    x = torch.randn(2, 2, 3, 3)
    layer(x)
    try:
        with capture_safe():
            layer(torch.randn(1, 2, 3, 3))  # every worker changes its batch: every worker refuses locally
    except UnsupportedError as exc:
        return str(exc)
    return None


def test_capture_safe_refuses_a_changed_call():
    for msg in run_ranks(4, _shape_change_refused):
        assert msg is not None and "warm up" in msg


# ---------------------------------------------------------------- the linear layers


class _CollectiveKinds:
    """Counts host-side collectives apart from data collectives (patched for the duration of a ``with``).

    On gloo the metadata records, the agreement flag rounds and the data share a group, so
    the kind is read from the tensors: int64 records and flags are host-side (they run on
    the host meta group under NCCL too), floating tensors are data (which NCCL captures);
    object collectives and barriers are host-side.  Point-to-point batches are counted
    apart.
    """

    def __enter__(self):
        self.host, self.data, self.p2p, self._saved = [], 0, 0, []

        def counting(name, fn):
            def wrapper(*args, **kwargs):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if tensors and all(t.is_floating_point() for t in tensors):
                    self.data += 1
                else:
                    self.host.append(name)
                return fn(*args, **kwargs)
            return wrapper

        for mod, names in ((dist, _HostCollectives.NAMES), (compat, ("_ALL_GATHER", "_REDUCE_SCATTER"))):
            for name in names:
                self._saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, counting(name, getattr(mod, name)))
        batch = dist.batch_isend_irecv

        def counting_batch(ops):
            self.p2p += 1
            return batch(ops)

        self._saved.append((dist, "batch_isend_irecv", batch))
        dist.batch_isend_irecv = counting_batch
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)


def _linear_layers(kind: str):
    """``(forward function, the layers, the input partition, x global, dy global)`` of a small training step."""
    from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter

    gen = torch.Generator().manual_seed(5)
    if kind == "mlp":  # all-gather linear into reduce-scatter linear on [2, 2], ranks permuted, uneven blocks
        P = grid((2, 0, 3, 1), (2, 2))
        torch.manual_seed(1)
        ag, rs = DistributedLinearAllGather(P, 7, 9), DistributedLinearReduceScatter(P, 9, 5)
        return (lambda x: rs(ag(x))), [ag, rs], P, P, torch.randn(5, 7, generator=gen), torch.randn(5, 5,
                                                                                                      generator=gen)
    P_x, P_y, P_w = grid((0, 1), (1, 2)), grid((3, 2), (1, 2)), grid((2, 0, 3, 1), (2, 2))  # P_w outside P_x too
    torch.manual_seed(1)
    layer = DistributedLinear(P_x, P_y, P_w, 7, 5)
    return layer, [layer], P_x, P_y, torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)


def _linear_hot_path(kind: str):
    from distfuse import zero_volume_tensor

    fn, layers, P_in, P_out, xg, dyg = _linear_layers(kind)

    def step():
        x = (xg[local_slices(xg.shape, P_in.shape, P_in.index)] if P_in.active else zero_volume_tensor()).clone()
        x.requires_grad_(True)
        y = fn(x)
        dy = dyg[local_slices(dyg.shape, P_out.shape, P_out.index)] if P_out.active else torch.zeros_like(y)
        y.backward(dy)
        out = [y.detach(), x.grad if x.grad is not None else torch.zeros(0)]
        out += [p.grad.clone() for m in layers for p in m.parameters()]
        for m in layers:
            m.zero_grad(set_to_none=True)
        return out

    step(), step()  # warm-up: the agreement settles
    eager = step()
    calls = [m.agreement.calls for m in layers]
    boards = _flag_board.rounds_taken()
    with _CollectiveKinds() as coll, _HostReads() as reads, capture_safe():
        trusted = step()
    trusted_calls = [m.agreement.calls - c for m, c in zip(layers, calls, strict=True)]
    trusted_rounds, boards = _flag_board.rounds_taken() - boards, _flag_board.rounds_taken()
    with _CollectiveKinds() as control_coll, _HostReads() as control:  # outside capture_safe: the flag is read
        step()
    return dict(reads=reads.reads, collectives=coll.host, data=coll.data, p2p=coll.p2p,
                control=control.reads, control_collectives=control_coll.host, trusted_calls=trusted_calls,
                trusted_board_rounds=trusted_rounds, control_board_rounds=_flag_board.rounds_taken() - boards,
                same=all(torch.equal(a, b) for a, b in zip(trusted, eager, strict=True)), n=len(eager),
                paths=[m.last_path for m in layers])


@pytest.mark.parametrize("kind", ["mlp", "general"])
def test_linear_training_step_is_capture_safe(kind):
    """A warm training step of the linears inside ``capture_safe()``: no host read, no host collective, bitwise eager.

    ``mlp``: all-gather linear into reduce-scatter linear (the flag in the data message on
    CPU); ``general``: ``DistributedLinear`` with P_w workers outside P_x (the flag in a
    host round).  The control (the same step outside ``capture_safe()``) must read the flag.
    """
    for rank, r in enumerate(run_ranks(4, _linear_hot_path, kind)):
        assert set(r["paths"]) <= {"unfused"}, r["paths"]
        assert r["reads"] == [], f"rank {rank}: host reads inside the capture-safe step: {r['reads']}"
        assert r["collectives"] == [], f"rank {rank}: host-side collectives: {r['collectives']}"
        assert r["data"] + r["p2p"] > 0, f"rank {rank}: no data round counted (the counters have no teeth)"
        assert r["trusted_board_rounds"] == 0, f"rank {rank}: flag-board rounds inside the capture-safe step"
        if kind == "general":  # its flag is a host round, on one host the shared-memory board's: counted outside
            assert r["control_board_rounds"] > 0 or "all_reduce" in r["control_collectives"], r
        else:  # the flag in the data message: read on the host
            assert r["control"], f"rank {rank}: the eager steady state read no flag (the read counter has no teeth)"
        assert all(c == 1 for c in r["trusted_calls"]), f"rank {rank}: {r['trusted_calls']} trusted calls per layer"
        assert r["same"], f"rank {rank}: the capture-safe step differs from the eager one"


def _linear_shape_change_refused():
    from distfuse.errors import UnsupportedError
    from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter

    P = grid(range(4), (2, 2))
    P_x, P_y = grid((1, 0, 2, 3), (1, 4)), grid((1,), (1, 1))  # every worker of the general layer holds an input
    layers = {"all_gather": (DistributedLinearAllGather(P, 4, 4), 2), "reduce_scatter":
              (DistributedLinearReduceScatter(P, 4, 4), 2), "general": (DistributedLinear(P_x, P_y, P_x, 4, 3), 1)}
    out = {}
    for name, (layer, features) in layers.items():
        layer(torch.randn(3, features))
        try:
            with capture_safe():
                layer(torch.randn(2, features))  # every worker changes its rows: every worker refuses locally
            out[name] = None
        except UnsupportedError as exc:
            out[name] = str(exc)
    return out


def test_linear_capture_safe_refuses_a_changed_call():
    for rank, res in enumerate(run_ranks(4, _linear_shape_change_refused)):
        for name, msg in res.items():
            assert msg is not None and "warm up" in msg and f"[rank {rank}]" in msg, (name, msg)


# ---------------------------------------------------------------- the fused GEMM ops: device epochs


def _fused_hot_path(which: str):
    from distfuse import Partition
    from distfuse.fused.all_gather_matmul import all_gather_matmul
    from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter
    from distfuse.fused.workspace import _Workspace

    P = Partition.world().create_partition_inclusive([2, 0, 3]).create_cartesian_topology_partition([1, 3, 1])
    if not P.active:
        return None
    W, r = P.size, P.rank
    n, K, N = 7, 6, 5
    gen = torch.Generator().manual_seed(11 + r)
    if which == "all_gather_copy_engine":
        x0 = torch.randn(2, (n // W) + (r < n % W), K, generator=gen)
        w, b, dy = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen), torch.randn(2, n, N, generator=gen)

        def op(x):
            return all_gather_matmul(x, w, b, P, n=n, provider="copy_engine")
    else:
        x0 = torch.randn(2, n, K, generator=gen)
        w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
        dy = torch.randn(2, (n // W) + (r < n % W), N, generator=gen)

        def op(x):
            return matmul_reduce_scatter(x, w, b, P, provider="cublas_chunks")
    w.requires_grad_(True)
    b.requires_grad_(True)

    def step():
        x = x0.clone().requires_grad_(True)
        y = op(x)
        y.backward(dy)
        out = [y.detach(), x.grad, w.grad.clone(), b.grad.clone()]
        w.grad = b.grad = None
        return out

    step(), step()  # warm-up: the workspace, the peer tables
    eager = step()
    ws = symmetric._CACHE[(P.ranks, "cpu")]
    cache, nbytes, host0, dev0 = dict(symmetric._CACHE), ws.nbytes, ws.epoch, int(ws.epoch_dev)
    checks = []
    real_raise = _Workspace.raise_on_status

    def counted(self, *args, **kwargs):
        checks.append(args[-1])
        return real_raise(self, *args, **kwargs)

    _Workspace.raise_on_status = counted
    try:
        with _HostCollectives() as coll, _HostReads() as reads:
            trusted = step()
    finally:
        _Workspace.raise_on_status = real_raise
    same_ws = dict(symmetric._CACHE) == cache and ws.nbytes == nbytes
    claims, dev1 = ws.epoch - host0, int(ws.epoch_dev)
    apart = dev1 - ws.epoch
    ws.epoch_dev.add_(5)  # five claims replayed by a graph: the device epoch moves on, the host's does not
    after = step()
    apart = int(ws.epoch_dev) - ws.epoch - apart
    symmetric.close_all()
    return dict(reads=reads.reads, checks=len(checks), collectives=coll.calls, claims=claims, dev_moved=dev1 - dev0,
                epochs_apart=apart, same_ws=same_ws,
                same=all(torch.equal(a, b) for a, b in zip(trusted, eager, strict=True)),
                same_after=all(torch.equal(a, b) for a, b in zip(after, eager, strict=True)))


@pytest.mark.parametrize("which", ["all_gather_copy_engine", "matmul_reduce_scatter_cublas"])
def test_fused_gemm_step_is_capture_safe(which):
    pytest.importorskip("triton")
    results = [r for r in run_ranks(4, _fused_hot_path, which) if r is not None]
    assert len(results) == 3
    for rank, r in enumerate(results):
        assert r["claims"] == 2, f"rank {rank}: forward and backward each claim the workspace once: {r['claims']}"
        assert r["dev_moved"] == r["claims"], f"rank {rank}: the device epoch moved {r['dev_moved']} for " \
                                              f"{r['claims']} claims"
        assert r["reads"] == [] and r["checks"] >= 2, \
            f"rank {rank}: host reads through torch ops (the clear status words are read through numpy): " \
            f"{r['reads']} ({r['checks']} checks)"
        assert set(r["collectives"]) == {"monitored_barrier"}, f"rank {rank}: host collectives: {r['collectives']}"
        assert r["same_ws"], f"rank {rank}: a symmetric workspace was created or grown"
        assert r["same"], f"rank {rank}: the steady-state step differs from the eager one"
        assert r["epochs_apart"] == 5, f"rank {rank}: host and device epochs should be 5 apart"
        assert r["same_after"], f"rank {rank}: after the device epoch moved on alone, the step differs"


# ---------------------------------------------------------------- on a GPU


def _cuda_capture_worker(init_file: str, out_file: str) -> None:  # pragma: no cover - runs on a GPU only
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions in fp32 on both sides
        torch.backends.cuda.matmul.allow_tf32 = False
        P_x = grid([0], (1, 1, 1, 1))
        torch.manual_seed(0)
        layer = DistributedConv2d(P_x, 8, 16, 3, padding=1)
        static_x = torch.randn(2, 8, 16, 16, device="cuda", requires_grad=True)
        static_dy = torch.randn(2, 16, 16, 16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: agreement, plans, cuDNN algorithms
                layer(static_x).backward(static_dy)
        torch.cuda.current_stream().wait_stream(side)
        for p in layer.parameters():
            p.grad = None
        static_x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
            static_y.backward(static_dy)
        x_new, dy_new = torch.randn_like(static_x), torch.randn_like(static_dy)
        with torch.no_grad():
            static_x.copy_(x_new)
            static_dy.copy_(dy_new)
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.Conv2d(8, 16, 3, padding=1).cuda().double()  # float64, the same weights
        with torch.no_grad():
            ref.weight.copy_(layer.weight)
            ref.bias.copy_(layer.bias)
        xr = x_new.double().requires_grad_(True)
        yr = ref(xr)
        yr.backward(dy_new.double())
        # the longest sums: y over 8 channels x 3 x 3, dx over 16 channels x 3 x 3, dw and db over 2 x 16 x 16
        pairs = [("y", static_y, yr, 8 * 9), ("dx", static_x.grad, xr.grad, 16 * 9),
                 ("dw", layer.weight.grad, ref.weight.grad, 2 * 16 * 16), ("db", layer.bias.grad, ref.bias.grad,
                                                                             2 * 16 * 16)]
        torch.save([(what, a.detach().cpu(), b.detach().cpu(), terms) for what, a, b, terms in pairs], out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_of_a_training_step(tmp_path):  # pragma: no cover - runs on a GPU only
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = tmp_path / "errs.pt"
    proc = ctx.Process(target=_cuda_capture_worker, args=(str(tmp_path / "init"), str(out)))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the capture process failed (exit code {proc.exitcode})"
    for what, got, ref, terms in torch.load(out):  # fp32 replay (tf32 off) against float64
        _close64(got, ref, what, terms)


def _cuda_linear_capture_worker(init_file: str, out_file: str) -> None:  # pragma: no cover - runs on a GPU only
    """Capture a training step of ``DistributedLinear`` and of an all-gather/reduce-scatter pair (one rank, NCCL)."""
    from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in fp32 on both sides
        P = grid([0], (1, 1))
        torch.manual_seed(0)
        general = DistributedLinear(P, P, P, 32, 48)
        ag, rs = DistributedLinearAllGather(P, 48, 64), DistributedLinearReduceScatter(P, 64, 16)
        layers = [general, ag, rs]
        static_x = torch.randn(8, 32, device="cuda", requires_grad=True)
        static_dy = torch.randn(8, 16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: the agreement settles
                rs(ag(general(static_x))).backward(static_dy)
        torch.cuda.current_stream().wait_stream(side)
        for m in layers:
            m.zero_grad(set_to_none=True)
        static_x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = rs(ag(general(static_x)))
            static_y.backward(static_dy)
        x_new, dy_new = torch.randn_like(static_x), torch.randn_like(static_dy)
        with torch.no_grad():
            static_x.copy_(x_new)
            static_dy.copy_(dy_new)
        graph.replay()
        torch.cuda.synchronize()
        refs = [torch.nn.Linear(32, 48), torch.nn.Linear(48, 64), torch.nn.Linear(64, 16)]
        with torch.no_grad():
            for ref, m in zip(refs, layers, strict=True):
                ref.double().cuda()
                ref.weight.copy_(m.weight)
                ref.bias.copy_(m.bias)
        xr = x_new.double().requires_grad_(True)
        yr = refs[2](refs[1](refs[0](xr)))
        yr.backward(dy_new.double())
        pairs = [("y", static_y, yr), ("dx", static_x.grad, xr.grad)]
        pairs += [(f"{type(m).__name__}.{n} gradient", getattr(m, n).grad, getattr(ref, n).grad)
                  for m, ref in zip(layers, refs, strict=True) for n in ("weight", "bias")]
        torch.save([(what, a.detach().cpu(), b.detach().cpu()) for what, a, b in pairs], out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_of_a_linear_training_step(tmp_path):  # pragma: no cover - runs on a GPU only
    """The three linears captured in one graph (their agreement trusted while the stream captures), replayed on new
    data against float64 ``torch.nn.Linear``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = tmp_path / "errs.pt"
    proc = ctx.Process(target=_cuda_linear_capture_worker, args=(str(tmp_path / "init"), str(out)))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the capture process failed (exit code {proc.exitcode})"
    # fp32 GEMMs (tf32 off) against float64: three chained layers (sums of 32, 48 and 64 features forward; 16, 64
    # and 48 backward; the weight gradients over 8 rows of signals that passed up to two other layers), each adding
    # its own rounding: the bound of the longest sum, 64, three layers deep
    for what, got, ref in torch.load(out):
        _close64(got, ref, what, terms=64, steps=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("which", ["all_gather_triton", "all_gather_copy_engine", "reduce_scatter_cublas"])
def test_cuda_graph_replays_a_fused_gemm_step(which):  # pragma: no cover - runs on a GPU only
    """Capture forward and backward of a fused GEMM op (loopback: every virtual rank on one GPU), replay on new data:
    the replay advances the device epoch by its claims and matches an eager step and float64."""
    from distfuse.fused.all_gather_matmul import all_gather_matmul_loopback, all_gather_matmul_workspace_bytes
    from distfuse.fused.matmul_reduce_scatter import (
        matmul_reduce_scatter_loopback,
        matmul_reduce_scatter_workspace_bytes,
    )
    from distfuse.fused.workspace import LoopbackWorkspace

    torch.backends.cuda.matmul.allow_tf32 = False
    W, n, K, N, dev = 2, 256, 128, 192, torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    gather = which.startswith("all_gather")
    if gather:
        xs = [torch.randn(1, n // W, K, generator=gen).to(dev).requires_grad_() for _ in range(W)]
        wts = [torch.randn(N, K, generator=gen).div(K ** 0.5).to(dev).requires_grad_() for _ in range(W)]
        dys = [torch.randn(1, n, N, generator=gen).to(dev) for _ in range(W)]
        ws = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(1, n, K, W, torch.float32), dev)

        def step():
            ys = all_gather_matmul_loopback(xs, wts, None, ws, provider=which.split("_", 2)[2])
            torch.autograd.backward(ys, dys)
            return ys
    else:
        xs = [torch.randn(1, n, K, generator=gen).to(dev).requires_grad_() for _ in range(W)]
        wts = [torch.randn(N, K, generator=gen).div(K ** 0.5).to(dev).requires_grad_() for _ in range(W)]
        dys = [torch.randn(1, n // W, N, generator=gen).to(dev) for _ in range(W)]
        ws = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(1, n, N, W, torch.float32), dev)

        def step():
            ys = matmul_reduce_scatter_loopback(xs, wts, None, ws, provider="cublas_chunks")
            torch.autograd.backward(ys, dys)
            return ys

    def clear():
        for t in xs + wts:
            t.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
            clear()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_ys = step()
    new_x = [torch.randn_like(x) for x in xs]
    new_dy = [torch.randn_like(dy) for dy in dys]
    with torch.no_grad():
        for t, v in zip(xs + dys, new_x + new_dy, strict=True):
            t.copy_(v)
    for t in xs + wts:
        t.grad.zero_()
    before = int(ws.epoch_dev)
    graph.replay()
    torch.cuda.synchronize()
    assert int(ws.epoch_dev) == before + 2, "a replay must advance the device epoch by its two claims"
    got = [y.clone() for y in static_ys] + [t.grad.clone() for t in xs + wts]
    clear()
    eager = [y.detach() for y in step()] + [t.grad for t in xs + wts]
    for i, (a, b) in enumerate(zip(got, eager, strict=True)):  # the same kernels on the same data, in the same order
        assert not torch.isnan(a).any() and torch.equal(a, b), f"output {i}: the replay differs from the eager step"
    x64 = [x.detach().double() for x in xs]
    w64 = [w.detach().double() for w in wts]
    dy64 = [dy.double() for dy in dys]
    rows = [slice(r * (n // W), (r + 1) * (n // W)) for r in range(W)]
    if gather:  # y_p = x_full w_p^T (K terms); dx_full = sum_p dy_p w_p (W N terms); dw_p = dy_p^T x_full (n terms)
        x_full = torch.cat(x64, dim=-2)
        dx_full = sum(dy @ w for dy, w in zip(dy64, w64, strict=True))
        refs = [(x_full @ w.t(), K) for w in w64] + [(dx_full[:, rows[r]], W * N) for r in range(W)]
        refs += [(dy[0].t() @ x_full[0], n) for dy in dy64]
    else:  # y_r = rows r of sum_p x_p w_p^T (W K terms); dx_p = dy_full w_p (N terms); dw_p = dy_full^T x_p (n terms)
        full = sum(x @ w.t() for x, w in zip(x64, w64, strict=True))
        dy_full = torch.cat(dy64, dim=-2)
        refs = [(full[:, rows[r]], W * K) for r in range(W)] + [(dy_full @ w, N) for w in w64]
        refs += [(dy_full[0].t() @ x[0], n) for x in x64]
    for i, (a, (ref, terms)) in enumerate(zip(got, refs, strict=True)):
        _close64(a, ref, f"{which} output {i} against float64", terms)
