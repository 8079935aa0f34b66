"""Benchmark: transformer attention, forward + backward, against anchors measured in the same run.

Multi-rank (``W`` ranks: forked gloo CPU ranks, or the torchrun world), causal attention on
the global problem ``q, k, v, dO [B, H, S, D]``, each rank holding ``S / W`` rows:

* op ``attention`` (1-D context partition of every rank):
  - ``ring_contiguous``  ``distributed_attention(..., causal=True, layout="contiguous")``: balanced blocks,
                         the causal work unbalanced (the last rank computes ``W`` blocks, the first one);
  - ``ring_zigzag``      the same with ``layout="zigzag"`` (``load_balanced_split``: chunks ``r`` and ``2W-1-r``);
  - ``ring_zigzag_fused`` the zig-zag ring on its fused transport (``DISTFUSE_PATH=fused``: each block pushed into
                         the next rank's symmetric buffer, :mod:`distfuse.fused.ring_push`; on CPU ``/dev/shm`` and
                         a host barrier per step, so its CPU ratio measures the protocol, not the overlap); dropped
                         (with the reason in the suite's status) where symmetric memory is unavailable;
  - ``context_parallel`` (anchor where it runs) torch's DTensor context parallelism:
                         ``torch.distributed.tensor.experimental.context_parallel`` on a 1-D ``DeviceMesh`` of the
                         same ranks, ``scaled_dot_product_attention(is_causal=True)`` inside it, on the zig-zag blocks
                         (its default head-tail load balancer is the same layout); its ops are the CUDA
                         flash / efficient / cuDNN SDPA kernels only, so on CPU it does not run (the reason goes in
                         the rows' ``extra.context_parallel`` and the suite's status);
  - ``sdpa_allgather``   (anchor where ``context_parallel`` does not run) the simple context-parallel baseline:
                         one ``all_gather_into_tensor`` of the packed K/V blocks (zig-zag layout), put in global
                         order, then per local query chunk ``scaled_dot_product_attention`` on its causal key
                         prefix (a bool mask on the diagonal chunk); its backward reduce-scatters dK/dV
                         (``reduce_scatter_tensor``).
  ``ratio`` = provider / the anchor that ran (each row's ``anchor`` names it).
* op ``mha``: ``DistributedMultiheadAttention`` (causal, zig-zag rows) on a ``[P_cp, P_tp]`` grid of every rank,
  the same global problem ``x [B, S, E]``: ``tp_only`` (anchor) ``[1, W]`` (heads over every rank, no context
  split), ``cp_tp`` ``[W/2, 2]`` (context x tensor), ``cp_only`` ``[W, 1]`` (context only), and the
  sequence-parallel forms ``tp_sp`` ``[1, W]`` and ``cp_tp_sp`` ``[W/2, 2]`` (``sequence_parallel=True``: rows
  split over the tensor axis too, the projections the all-gather / reduce-scatter GEMMs, fused where dispatch
  says so); a grid that the heads or ``S`` do not fit (or that repeats another of the same form, as
  ``[W/2, 2]`` at ``W = 2``) is left out.

One rank's block (``torch.cuda.is_available()``; in-process, a one-rank partition; bf16):

* op ``attention_block``: ``ring_local`` = ``distributed_attention`` on a one-rank partition (the ring code's
  block work: no message moves) against ``sdpa`` = ``torch.nn.functional.scaled_dot_product_attention``
  (anchor), same shapes, causal;
* op ``ring_message``: ``ring_pack``, the ring's per-step message (K and V packed into one flat buffer, as the
  ring does before each send), against ``copy`` = ``Tensor.copy_`` of the same bytes into a preallocated
  buffer (anchor, the ring-push ceiling on one device).  ``rate`` GB/s counts bytes read + written.

Without CUDA these rows are unmeasured; ``--smoke`` and ``--dry-run`` run that code on CPU at tiny shapes
(``extra.dry_run``: the times mean nothing) so it cannot rot.  ``--single`` runs only these rows (on the GPU
where there is one: the lab's ``attention`` phase), ``--out DIR`` writes them.

Every provider's output and input gradients are checked, before timing, against the global
``scaled_dot_product_attention`` (fp32) at the rows the rank holds, so the providers do the same work.
Modes: ``full`` only (forward + backward; gradients reset to None before each run).
``rate`` (TFLOP/s, all ranks) is nominal: causal attention forward ``2 B H S^2 D``, backward 2.5x
(the FlashAttention convention); ``mha`` adds ``8 B S E^2`` forward for the projections, 3x for fwd + bwd.

Timing: ``bench.harness.time_interleaved`` (providers alternate in rounds; each run's time is the slowest
rank's); quantiles [0.5, 0.2, 0.8].  CPU/gloo numbers are ratios between CPU providers, never GPU claims.

    python -m bench run attention                          # 4 forked gloo CPU ranks
    python bench/bench_attention.py --world-size 2 --smoke
    python bench/bench_attention.py --dry-run              # the GPU rows' code on CPU, tiny (times mean nothing)
    torchrun --nproc-per-node 8 -m bench run attention     # NCCL; the one-rank block rows on every GPU, rank 0's kept
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spatial_common import check_agree  # noqa: E402

NAME = "attention"
CP = "context_parallel"
ALLGATHER = "sdpa_allgather"
FUSED_RING = "ring_zigzag_fused"
MHA_ANCHOR = "tp_only"
BLOCK_ANCHOR = "sdpa"
COPY_ANCHOR = "copy"
# (B, H, S, D) of the global problem.  CPU: 4 ranks on 2 cores, tens of ms per step.
SHAPES = [(1, 4, 256, 32), (1, 4, 1024, 32)]
GPU_SHAPES = [(1, 32, 8192, 128), (1, 32, 16384, 128)]
SMOKE_SHAPES = [(1, 2, 16, 8)]
# (B, S, E, heads) of the multi-head layer
MHA = (1, 512, 128, 8)
GPU_MHA = (1, 8192, 4096, 32)
SMOKE_MHA = (1, 16, 16, 4)
# (B, H, S_r, D) of one rank's block (bf16)
BLOCK_SHAPES = [(1, 32, 4096, 128), (1, 32, 8192, 128)]
DRY_BLOCK_SHAPES = [(1, 2, 16, 8)]
BLOCK_DTYPE = torch.bfloat16
SEED = 1234
CPU_TIMING = "CPU/gloo wall clock, 1 thread per rank; not a GPU result"
NO_CUDA = "unmeasured: no CUDA in this run (attention_block and ring_message rows need a GPU)"


def _config(smoke: bool, dtype: torch.dtype, cuda: bool) -> dict:
    if smoke:
        return dict(shapes=SMOKE_SHAPES, mha=SMOKE_MHA, warmup=1, rounds=1, reps=2, dtype=dtype)
    if cuda:
        return dict(shapes=GPU_SHAPES, mha=GPU_MHA, warmup=5, rounds=6, reps=5, dtype=dtype)
    return dict(shapes=SHAPES, mha=MHA, warmup=3, rounds=8, reps=6, dtype=dtype)


def attention_flops(B: int, H: int, S: int, D: int) -> float:
    """Nominal causal forward + backward FLOPs: forward ``2 B H S^2 D`` (half of ``4 B H S^2 D``), backward 2.5x."""
    return 3.5 * 2.0 * B * H * S * S * D


def mha_flops(B: int, S: int, E: int) -> float:
    """Nominal forward + backward FLOPs of the layer (3x the forward: 4 projections + causal attention)."""
    return 3.0 * (8.0 * B * S * E * E + 2.0 * B * S * S * E)


# ---------------------------------------------------------------- the all-gather baseline


class _GatherKV(torch.autograd.Function):
    """``[2, B, H, S_r, D] -> [W, 2, B, H, S_r, D]``: one all-gather; backward one reduce-scatter."""

    @staticmethod
    def forward(ctx, kv):
        W = dist.get_world_size()
        out = kv.new_empty(W * kv.numel())  # flat: gloo wants the gathered tensor as [W * n]
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, kv.contiguous().view(-1))
        return out.view((W,) + tuple(kv.shape))

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty(g[0].shape)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out.view(-1), g.contiguous().view(-1))
        return out


class _AllGatherAttention:
    """The simple context-parallel baseline on the zig-zag blocks (see the module docstring)."""

    def __init__(self, S: int, W: int, r: int, device: torch.device):
        from distfuse.layers.attention_ring import load_balanced_order, load_balanced_split

        self.inv = load_balanced_order(S, W).argsort().to(device)
        (e0, e1), (l0, l1) = load_balanced_split(S, W)[r]
        c = e1 - e0
        self.chunks = []  # (local start, length, key prefix, the mask of the prefix [c, prefix])
        for local, start in ((0, e0), (c, l0)):
            end = start + c
            mask = torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]
            self.chunks.append((local, c, end, mask))

    def __call__(self, q, k, v):
        B, H, S_r, D = k.shape
        g = _GatherKV.apply(torch.stack([k, v]))  # [W, 2, B, H, S_r, D], the ranks' blocks in zig-zag order
        g = g.permute(1, 2, 3, 0, 4, 5).reshape(2, B, H, -1, D).index_select(3, self.inv)  # global order
        outs = [F.scaled_dot_product_attention(q[:, :, a:a + n], g[0, :, :, :end], g[1, :, :, :end], attn_mask=mask)
                for a, n, end, mask in self.chunks]
        return torch.cat(outs, 2)


# ---------------------------------------------------------------- per-rank work

_CACHE: dict = {}


def _context_partition(W: int):
    key = ("cp", W)
    if key not in _CACHE:
        from distfuse import Partition

        _CACHE[key] = Partition.world().create_partition_inclusive(range(W))
    return _CACHE[key]


def _mesh(device: torch.device):
    key = ("mesh", device.type)
    if key not in _CACHE:
        from torch.distributed.device_mesh import init_device_mesh

        _CACHE[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _CACHE[key]


def _context_parallel_fn(device: torch.device, W: int):
    """SDPA inside torch's ``context_parallel`` (entered per step: its SDPA patch must not reach other providers).

    The inputs are already the zig-zag blocks; the one buffer handed to the context manager is a ``[1, 2W]``
    dummy, which selects its head-tail load balancer (the zig-zag layout) and is restored on exit.
    """
    from torch.distributed.tensor.experimental import context_parallel

    mesh = _mesh(device)
    dummy = torch.zeros(1, 2 * W, device=device)

    def fn(q, k, v, dout):
        with context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[1]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)
        return out

    return fn


class _AttentionCase:
    def __init__(self, shape, dtype: torch.dtype, device: torch.device):
        from distfuse.layers.attention_ring import DistributedAttention, distributed_attention, local_positions
        from distfuse.tune.cases import forced_path

        B, H, S, D = shape
        W, r = dist.get_world_size(), dist.get_rank()
        self.shape = dict(batch=B, heads=H, seq=S, head_dim=D, causal=True, grid=[W])
        self.flops = attention_flops(B, H, S, D)
        self.dtype = dtype
        gen = torch.Generator().manual_seed(SEED)
        glob = [torch.randn((B, H, S, D), generator=gen).to(device=device, dtype=dtype) for _ in range(4)]
        ref = [t.float().clone().requires_grad_(i < 3) for i, t in enumerate(glob)]  # not glob's own tensors
        out = F.scaled_dot_product_attention(*ref[:3], is_causal=True)
        out.backward(ref[3])
        self.ref = dict(out=out.detach(), dq=ref[0].grad, dk=ref[1].grad, dv=ref[2].grad)
        P = _context_partition(W)
        pos = {lay: local_positions(S, W, r, lay).to(device) for lay in ("contiguous", "zigzag")}

        def inputs(layout):
            q, k, v, do = (t.index_select(2, pos[layout]).contiguous() for t in glob)
            return [t.requires_grad_(True) for t in (q, k, v)], do, pos[layout]

        def autograd_step(fn):
            def step(q, k, v, dout):
                out = fn(q, k, v)
                out.backward(dout)
                return out
            return step

        self.providers = {}
        for layout in ("contiguous", "zigzag"):
            ring = (lambda q, k, v, layout=layout:
                    distributed_attention(q, k, v, P, causal=True, layout=layout))
            self.providers[f"ring_{layout}"] = (autograd_step(ring), *inputs(layout))
        fused_ring = DistributedAttention(P, causal=True, layout="zigzag")

        def fused_step(q, k, v, dout):
            with forced_path("fused"):
                out = fused_ring(q, k, v)
                out.backward(dout)
            return out

        self.fused_ring = fused_ring
        self.providers[FUSED_RING] = (fused_step, *inputs("zigzag"))
        self.providers[CP] = (_context_parallel_fn(device, W), *inputs("zigzag"))
        self.providers[ALLGATHER] = (autograd_step(_AllGatherAttention(S, W, r, device)), *inputs("zigzag"))
        self.cp_status = "ran"
        self.fused_status = "ran"

    def _once(self, name: str):
        fn, qkv, dout, _ = self.providers[name]
        for t in qkv:
            t.grad = None
        return fn(*qkv, dout)

    def verify(self, sync) -> None:
        """Every provider against the reference; ``context_parallel`` dropped (with the reason) where it fails."""
        for name in list(self.providers):
            _, qkv, _, pos = self.providers[name]
            problem = None
            try:
                out = self._once(name)
                got = [out.detach()] + [t.grad for t in qkv]
                want = [self.ref[k].index_select(2, pos) for k in ("out", "dq", "dk", "dv")]
                for what, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
                    check_agree(f"attention {name}: {what}", a, b, self.dtype)
            except Exception as exc:  # noqa: BLE001 - context_parallel: recorded as not run; others re-raised
                if name != CP:
                    raise
                problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
            if name == FUSED_RING and self.fused_ring.last_decision.path != "fused":
                # the same decision on every rank (availability is collective): dropped on all of them
                self.fused_status = f"not run: {self.fused_ring.last_decision.reason}"[:400]
                del self.providers[FUSED_RING]
            if name == CP:  # every rank must agree whether it runs (it is collective)
                bad = torch.tensor([int(problem is not None)])
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=sync)
                if int(bad):
                    self.cp_status = "not run: " + (problem or "failed on another rank")
                    del self.providers[CP]

    def step(self, name: str):
        return lambda: self._once(name)


def _mha_grids(W: int, S: int, heads: int) -> dict:
    """``name -> (grid, sequence_parallel)`` of the grids the heads and ``S`` fit, each (grid, form) once."""
    grids = {MHA_ANCHOR: (1, W), "cp_tp": (W // 2, 2), "cp_only": (W, 1), "tp_sp": (1, W), "cp_tp_sp": (W // 2, 2)}
    out, seen = {}, set()
    for name, (p_cp, p_tp) in grids.items():
        sp = name.endswith("_sp")
        if p_cp * p_tp != W or heads % p_tp or S % (2 * p_cp) or (p_cp, p_tp, sp) in seen or (sp and p_tp == 1):
            continue
        seen.add((p_cp, p_tp, sp))
        out[name] = ((p_cp, p_tp), sp)
    return out


class _MhaCase:
    def __init__(self, mha, dtype: torch.dtype, device: torch.device):
        from distfuse import Partition
        from distfuse.geometry.decomposition import block_range
        from distfuse.layers.attention_mha import DistributedMultiheadAttention, MultiheadSelfAttention
        from distfuse.layers.attention_ring import local_positions

        B, S, E, heads = mha
        W = dist.get_world_size()
        self.dtype = dtype
        self.shape = dict(batch=B, seq=S, embed=E, heads=heads, causal=True)
        self.flops = mha_flops(B, S, E)
        gen = torch.Generator().manual_seed(SEED)
        x, dy = (torch.randn((B, S, E), generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        torch.manual_seed(SEED)
        ref = MultiheadSelfAttention(E, heads, causal=True, device=device, dtype=torch.float32)
        xr = x.float().clone().requires_grad_(True)
        y = ref(xr)
        y.backward(dy.float())
        self.ref_y, self.ref_dx = y.detach(), xr.grad
        world = Partition.world().create_partition_inclusive(range(W))
        self.providers, self.grids, self.paths = {}, {}, {}
        for name, (grid, sp) in _mha_grids(W, S, heads).items():
            P = world.create_cartesian_topology_partition(list(grid))  # collective: every rank, every grid
            torch.manual_seed(SEED)  # the blocks of one MultiheadSelfAttention (the same global draw)
            layer = DistributedMultiheadAttention(P, E, heads, causal=True, layout="zigzag", device=device,
                                                  dtype=dtype, sequence_parallel=sp)
            pos = local_positions(S, grid[0], P.index[0], "zigzag").to(device)
            if sp:  # the tensor worker's balanced block of its context index's rows
                pos = pos[slice(*block_range(len(pos), grid[1], P.index[1]))]
            xb = x.index_select(1, pos).contiguous().requires_grad_(True)
            self.providers[name] = (layer, xb, dy.index_select(1, pos).contiguous(), pos)
            self.grids[name] = list(grid)

    def _once(self, name: str):
        layer, x, dy, _ = self.providers[name]
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        y = layer(x)
        y.backward(dy)
        return y

    def verify(self) -> None:
        for name, (_, x, _, pos) in self.providers.items():
            y = self._once(name)
            check_agree(f"mha {name}: output", y.detach(), self.ref_y.index_select(1, pos), self.dtype)
            check_agree(f"mha {name}: dx", x.grad, self.ref_dx.index_select(1, pos), self.dtype)
            decisions = getattr(self.providers[name][0], "last_decisions", None)
            if decisions:  # the sequence-parallel projections: which path each took (fused or not, and why)
                self.paths[name] = {k: d.describe() for k, d in decisions.items()}

    def step(self, name: str):
        return lambda: self._once(name)


def _row(op, name, shape, dtype, W, times, flops=None, rate_unit="TFLOP/s", extra=None) -> dict:
    from bench.harness import summarize

    ms, q20, q80 = summarize(times)
    rate = (flops / (ms * 1e-3) / (1e12 if rate_unit == "TFLOP/s" else 1e9)) if flops else None
    return dict(op=op, provider=name, mode="full", shape=shape, dtype=str(dtype).split(".")[-1], world_size=W,
                ms=ms, ms_q20=q20, ms_q80=q80, rate=rate, rate_unit=rate_unit if flops else None,
                extra=dict(samples=len(times), **(extra or {})))


def bench_rank(cfg: dict) -> list:
    """The ``attention`` and ``mha`` cases on this rank; returns plain dicts (the same on every rank)."""
    from bench.harness import time_interleaved
    from distfuse.groups import metadata_group

    W = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = metadata_group()
    dtype = cfg["dtype"]
    base = dict(device=device.type, backend=dist.get_backend())
    if device.type == "cpu":
        base.update(timing=CPU_TIMING, cuda=NO_CUDA)
    timing = dict(warmup=cfg["warmup"], rounds=cfg["rounds"], reps=cfg["reps"], device=device, sync_group=sync)
    rows = []
    for shape in cfg["shapes"]:
        if shape[2] % (2 * W):
            if dist.get_rank() == 0:
                print(f"attention: S={shape[2]} left out (the zig-zag layout needs S % 2W == 0, W={W})")
            continue
        case = _AttentionCase(shape, dtype, device)
        case.verify(sync)
        anchor = CP if CP in case.providers else ALLGATHER
        times = time_interleaved({n: case.step(n) for n in case.providers}, **timing)
        for n in case.providers:
            extra = dict(base, anchor_used=anchor, context_parallel=case.cp_status, ring_fused=case.fused_status,
                         layout="contiguous" if n == "ring_contiguous" else "zigzag")
            rows.append(_row("attention", n, case.shape, dtype, W, times[n], case.flops, extra=extra))
        del case
    case = _MhaCase(cfg["mha"], dtype, device)
    case.verify()
    times = time_interleaved({n: case.step(n) for n in case.providers}, **timing)
    for n in case.providers:
        rows.append(_row("mha", n, case.shape, dtype, W, times[n], case.flops,  # the grid in extra: one key
                         extra=dict(base, layout="zigzag", grid=case.grids[n], grid_axes="[P_cp, P_tp]",
                                    sequence_parallel=n.endswith("_sp"), paths=case.paths.get(n))))
    return rows


# ---------------------------------------------------------------- one rank's block (GPU; CPU dry run)


def _own_partition():
    """A one-rank partition of this rank (collective over the world: every rank creates every one)."""
    from distfuse import Partition

    key = ("own", dist.get_world_size())
    if key not in _CACHE:
        world = Partition.world()
        mine = None
        for i in range(world.size):
            p = world.create_partition_inclusive([i])
            if i == dist.get_rank():
                mine = p
        _CACHE[key] = mine
    return _CACHE[key]


def _pack_message(k, v):
    """The ring's per-step message: K and V in one flat buffer (the ring's own packer where it has one)."""
    from distfuse.layers import attention_ring

    pack = getattr(attention_ring, "_pack", None)
    if pack is not None:
        return pack(k, v, None)
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _block_case(shape, P1, device: torch.device, timing: dict, extra: dict) -> list:
    """One shape's ``attention_block`` and ``ring_message`` rows."""
    from bench.harness import time_interleaved
    from distfuse.layers.attention_ring import distributed_attention

    B, H, S, D = shape
    dtype = BLOCK_DTYPE
    gen = torch.Generator().manual_seed(SEED)
    q, k, v, do = (torch.randn((B, H, S, D), generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    qkv = [t.requires_grad_(True) for t in (q, k, v)]
    fns = {"ring_local": lambda: distributed_attention(*qkv, P1, causal=True),
           BLOCK_ANCHOR: lambda: F.scaled_dot_product_attention(*qkv, is_causal=True)}

    def step(fn):
        def run():
            for t in qkv:
                t.grad = None
            out = fn()
            out.backward(do)
            return out
        return run

    got = {}
    for n, fn in fns.items():
        out = step(fn)()
        got[n] = [out.detach()] + [t.grad.clone() for t in qkv]
    for n in fns:
        for what, a, b in zip(("output", "dq", "dk", "dv"), got[n], got[BLOCK_ANCHOR], strict=True):
            check_agree(f"attention_block {n}: {what}", a, b, dtype)
    times = time_interleaved({n: step(fn) for n, fn in fns.items()}, **timing)
    geometry = dict(batch=B, heads=H, seq=S, head_dim=D, causal=True)
    rows = [_row("attention_block", n, geometry, dtype, 1, times[n], attention_flops(B, H, S, D), extra=extra)
            for n in fns]

    kd, vd = k.detach(), v.detach()
    msg = _pack_message(kd, vd)
    dst = torch.empty_like(msg)
    check_agree("ring_message ring_pack", msg, torch.cat([kd.reshape(-1), vd.reshape(-1)]), dtype)
    msg_fns = {"ring_pack": lambda: _pack_message(kd, vd), COPY_ANCHOR: lambda: dst.copy_(msg)}
    times = time_interleaved(msg_fns, **timing)
    nbytes = msg.numel() * msg.element_size()
    rows += [_row("ring_message", n, dict(geometry, message_bytes=nbytes), dtype, 1, times[n], 2 * nbytes,
                  rate_unit="GB/s", extra=extra) for n in msg_fns]  # GB/s of bytes read + written
    return rows


def block_rows(shapes, device: torch.device, warmup: int, rounds: int, reps: int, dry_run: bool) -> list:
    """``attention_block`` and ``ring_message`` rows of this rank (ratios not set)."""
    P1 = _own_partition()
    extra = dict(device=device.type, one_rank="distributed_attention on a one-rank partition: no message moves")
    if dry_run:
        extra["dry_run"] = "CPU dry run of the GPU rows' code at tiny shapes: the times mean nothing"
    timing = dict(warmup=warmup, rounds=rounds, reps=reps, device=device)
    rows = []
    for shape in shapes:
        rows += _block_case(shape, P1, device, timing, extra)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _one_rank_world():
    """The torchrun world where there is one; else a one-rank group in this process (NCCL + gloo on CUDA, gloo on
    CPU), destroyed afterwards."""
    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="distfuse-attention-")
    os.close(fd)
    os.unlink(path)
    if torch.cuda.is_available():
        dist.init_process_group(init_method=f"file://{path}", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        _CACHE.clear()
        dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.unlink(path)


def single_rows(smoke: bool = False, dry_run: bool | None = None) -> list:
    """The one-rank block rows: on CUDA measured (``smoke``: one small shape), else a CPU dry run (tiny); rank 0's
    rows under a multi-rank world (every rank runs its own)."""
    from bench.harness import Row, add_ratios

    cuda = torch.cuda.is_available() and not dry_run
    with _one_rank_world():
        if cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            shapes = BLOCK_SHAPES[:1] if smoke else BLOCK_SHAPES
            raw = block_rows(shapes, device, 2 if smoke else 5, 1 if smoke else 6, 2 if smoke else 5, False)
        else:
            raw = block_rows(DRY_BLOCK_SHAPES, torch.device("cpu"), 1, 1, 2, True)
        rank = dist.get_rank()
    rows = [Row(**r) for r in raw] if rank == 0 else []
    add_ratios([r for r in rows if r.op == "attention_block"], BLOCK_ANCHOR)
    add_ratios([r for r in rows if r.op == "ring_message"], COPY_ANCHOR)
    return rows


# ---------------------------------------------------------------- entry points


def run(smoke: bool = False, world_size: int = 4, dtype: torch.dtype = torch.float32) -> list:
    """The multi-rank rows (ratios to the anchor that ran: ``context_parallel``, else ``sdpa_allgather``;
    ``tp_only`` for ``mha``), then the one-rank block rows where CUDA is there (or their CPU dry run with
    ``smoke``)."""
    from bench.harness import add_ratios, run_multirank

    rows = run_multirank(bench_rank, _config, ALLGATHER, smoke, world_size, dtype)
    add_ratios(rows, CP)  # where context_parallel ran it is the anchor (same key: op, mode, shape, dtype, W)
    add_ratios(rows, MHA_ANCHOR)
    if torch.cuda.is_available() or dist.is_initialized():
        rows += single_rows(smoke=smoke)
    elif smoke:
        # the CPU dry run on a forked one-rank world, not on a process group made and destroyed in this process:
        # after one (and a backward), rank pools this process forks later stalled in their compiled calls
        from distfuse.testing import run_ranks

        rows += run_ranks(1, single_rows, smoke=True, timeout=600)[0]
    return rows


def status_message(rows) -> str:
    """What ran: the anchor of ``attention`` (and why ``context_parallel`` did not run), the GPU rows' state."""
    att = [r for r in rows if r.op == "attention"]
    parts = []
    if att:
        cp = att[0].extra.get("context_parallel", "")
        used = att[0].extra.get("anchor_used")
        parts.append(f"attention anchor: {used}" + ("" if used == CP else f" (context_parallel {cp})"))
    block = [r for r in rows if r.op in ("attention_block", "ring_message")]
    if not block:
        parts.append(NO_CUDA)
    elif any("dry_run" in r.extra for r in block):
        parts.append("attention_block / ring_message: CPU dry run only (times mean nothing); unmeasured on GPU")
    return "; ".join(parts)


def roles(rows) -> dict:
    att = [r for r in rows if r.op == "attention"]
    anchor = att[0].extra.get("anchor_used", ALLGATHER) if att else ALLGATHER
    return {"attention": dict(unfused="ring_zigzag", anchor=anchor),
            "mha": dict(unfused="cp_tp", anchor=MHA_ANCHOR),
            "attention_block": dict(unfused="ring_local", anchor=BLOCK_ANCHOR),
            "ring_message": dict(unfused="ring_pack", anchor=COPY_ANCHOR)}


def suite(opts):
    """The ``attention`` suite for ``python -m bench run`` (:class:`bench.suites.SuiteResult`)."""
    from bench.suites import SuiteResult

    rows = run(smoke=opts.smoke, world_size=opts.world_size, dtype=opts.dtype)
    return SuiteResult(rows, "ok", status_message(rows), roles(rows))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.harness import environment, multirank_main, print_table, write_results

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--single", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    known, rest = p.parse_known_args(argv)
    if not (known.dry_run or known.single):
        return multirank_main(NAME, __doc__.split("\n\n")[0] + " (--single: only the one-GPU rows; --dry-run: "
                              "their code on CPU, tiny)", run, argv)
    dry = known.dry_run or not torch.cuda.is_available()
    rows = single_rows(dry_run=dry)
    print_table(rows)
    if known.out is not None:
        env = environment()
        if dry:
            env["dry_run"] = True
        path = write_results(NAME, rows, env=env, out_dir=known.out, smoke=dry)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
