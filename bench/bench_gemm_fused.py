"""Benchmark: the fused GEMM + reduce-scatter / all-gather + GEMM kernels on one GPU, with an 8-GPU projection.

Shapes: the per-rank GEMMs of the LLaMA-3 MLPs at tensor parallelism 8 (``H`` hidden,
``I`` intermediate; ``M`` = rows of the full sequence, batch folded in)::

    model          H      I       RS side (down proj)  m x n x k = M x H x I/8
    llama3-8b      4096   14336   AG side (up proj)    m x n x k = M x I/8 x H
    llama3-70b     8192   28672   M in {4096, 8192, 16384} (training / prefill)
    llama3-405b    16384  53248     and {64, 512} (decode)

What is measured (one GPU; the W = 8 peers are virtual, a LoopbackWorkspace with eight
buffers in this GPU's HBM, so "remote" stores land in local memory):

* ``op=matmul_scatter``: ``matmul_scatter`` of one virtual rank, the whole GEMM with the
  scatter epilogue (each tile stored into its owner's slot, flags raised), against
  ``torch.mm`` (cuBLAS, anchor ``cublas``) on the same shape.  Target: >= 90% of the
  cuBLAS TFLOP/s (``extra.rate_ratio``, ``extra.meets_target``).
* ``op=gathered_matmul``: ``gathered_matmul`` of one virtual rank once every shard is in
  place (the GEMM reading the local shard and the gathered buffer), against cuBLAS.
  Same target.
* ``op=chunk_reduce``: the sum of the W partial slots of one chunk (+ rounding), and
  ``op=ag_push``: the push copy of one shard into W - 1 buffers, each against a
  device-to-device copy (``dst.copy_(src)``) that moves the same bytes, measured in the
  same run (anchor ``copy``).  Target for chunk_reduce: >= 85% of the copy bandwidth.
* The same rows for the feature-direction pair, DistDL's own linear forms (sides
  ``rs_features`` and ``ag_features``, the same per-rank GEMM shapes):
  ``op=matmul_scatter_columns`` (each tile's columns stored into their owner's slot) with
  ``op=column_reduce``, and ``op=gathered_k_matmul`` (the GEMM walking the K chunks, own
  chunk first) with ``op=ag_push_columns``.  **Not yet measured on a GPU**: these kernels
  were written after the last GPU session; the rows are runnable and their registry
  defaults say "not measured on a GPU yet".
* Side ``all_reduce`` (the row-parallel down projection with a replicated output, the
  one-shot GEMM + all-reduce): ``op=matmul_push`` (the GEMM storing each tile into every
  peer's slot) against cuBLAS, and ``op=all_reduce_slots`` (the W slots summed) against the
  copy; its ``symm_mem`` anchor is ``torch.mm`` into a symmetric buffer followed by
  ``torch.ops.symm_mem.one_shot_all_reduce``.  Not yet measured on a GPU either.
* The other producers of GEMM + reduce-scatter (``distfuse.fused.providers``), on the ``rs``
  side beside ``fused`` (the one-tile-per-program Triton kernel): ``op=matmul_scatter``
  with ``provider=triton_persistent`` (persistent grid, tensor-descriptor loads, one flag
  per chunk) and ``provider=cublas_chunks`` (one cuBLAS GEMM per chunk into its owner's
  slot, then one launch for every flag; under 128 rows a chunk, one GEMM of every row, then
  one scatter launch: each row's ``kernel_reason`` names the schedule), each against cuBLAS
  with the same >= 90% target, and each with its own projection row
  (``projection-fused-<provider>-8gpu``).  Measured on the H100 and H200 since (docs/gpu.md);
  the cuBLAS provider's two schedules of 2026-11-28 not yet.
* Sides ``zero_rows`` and ``zero_columns``: the ZeRO layers' weight streaming
  (``distfuse/fused/zero_linear.py``), the all-gather GEMMs on the transposed product
  ``y.T = W_m @ x.T`` with the weight shards as the gathered operand and the rows ``x`` as
  the "weight": ``op=gathered_matmul`` / ``ag_push`` for the reduce-scatter linear's shards
  (``m x n x k = H x M x I/8``, the down projection's ``W_m`` split by rows over the W
  data-parallel workers) and ``op=gathered_k_matmul`` / ``ag_push_columns`` for the
  all-gather linear's (``I/8 x M x H``, split by columns); rows carry ``shape.zero``.  Their
  projection is the AG one with ``t_comm`` of the gathered weight.  The weight-gradient
  GEMM + reduce-scatter of the same layers is the ``rs`` / ``rs_features`` kernels at
  ``out x in x M``, not timed separately.  **Not yet measured on a GPU.**
* ``provider=symm_mem``: ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` /
  ``fused_all_gather_matmul`` on the same per-rank shapes (``scatter_dim`` / ``gather_dim``
  1 for the feature sides), on a one-rank NCCL group
  (the only group one GPU can form: no communication, so this times the ops' local
  path).  Rows are skipped, with the reason printed, where the ops do not run.
* ``provider=projection-*`` (``extra.projection = true``): **a projection, not a
  measurement**, of one rank of an 8-GPU H200 node, from the kernel times above and
  the NVLink bandwidth (900 GB/s bidirectional, 450 GB/s per direction, taken as fully
  achieved; latency ignored, so decode rows are optimistic for every provider).  With
  ``t_comm = (W - 1) / W * bytes / 450 GB/s`` (RS: the partial ``[M, H]``; AG: the
  gathered input ``[M, H]``):

      RS  unfused = t_cublas + t_comm                       (GEMM, then NCCL reduce-scatter)
          fused   = max(t_matmul_scatter, t_comm) + t_chunk_reduce (tiles leave during the GEMM)
      AG  unfused = t_comm + t_cublas                       (NCCL all-gather, then GEMM)
          fused   = t_comm + t_gathered_matmul              (ag_push runs before the GEMM on
                                                             the same stream: no overlap)

  The loopback kernel times assume remote NVLink stores cost what local HBM stores do.
  The all-reduce side: ``unfused = t_cublas + 2 t_comm`` (a ring all-reduce) and ``fused =
  max(t_matmul_push, W t_comm) + t_all_reduce_slots`` (one-shot: W - 1 copies leave).
  Projection rows are named by the registry op they model (``matmul_reduce_scatter``,
  ``all_gather_matmul``).  Result files before the rename call the rows ``gemm_rs``,
  ``ag_gemm``, ``linear_rs`` and ``linear_ag``; ``bench compare`` matches them to the
  current names.

Timings: ``bench.harness.time_fn`` (CUDA events, L2 flushed before every run, the runs
issued back to back as ``triton.testing.do_bench`` issues them; median and 20th/80th
percentiles).  Each eager row on CUDA also carries ``extra.ms_synced``: the median of cold
calls, each issued once the previous one has synchronised (the timing of rows before
2026-11-29), where host time beyond the L2 flush shows.  Rows go to ``bench/results/gemm_fused-<device>-<date>.json``
through ``bench.harness.write_results``.

Without a CUDA device the benchmark is not run (interpreted kernel times would mean
nothing).  ``--smoke`` runs a tiny CPU correctness pass of every provider under the
Triton interpreter instead and reports no timings.

    python bench/bench_gemm_fused.py                          # full sweep (bf16), --shapes llama
    python bench/bench_gemm_fused.py --shapes decode          # M = 64, 512 only (--shapes train: 4096-16384)
    python bench/bench_gemm_fused.py --models llama3-8b --m 4096 64
    python bench/bench_gemm_fused.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import sys
import types
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672), "llama3-405b": (16384, 53248)}
M_TRAIN = (4096, 8192, 16384)
M_DECODE = (64, 512)
TP = 8
NVLINK_GBPS_PER_DIRECTION = 450.0  # H200 NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GEMM_TARGET = 0.90  # fused GEMM TFLOP/s over cuBLAS
#: ``--shapes``: the LLaMA-3 MLP shapes at TP 8 (``--models``) over these row counts M.
SHAPE_SETS = {"llama": M_TRAIN + M_DECODE, "train": M_TRAIN, "decode": M_DECODE}
#: The other producers of GEMM + reduce-scatter (distfuse.fused.providers), timed beside ``fused`` (``triton``) on
#: the ``rs`` side, each with its own projection row.
RS_PROVIDERS = ("triton_persistent", "cublas_chunks")
REDUCE_TARGET = 0.85  # chunk_reduce GB/s over the device-to-device copy
# The four per-rank GEMM fusions: the kernel rows (GEMM, bandwidth step) and the registry op each projection models.
# ``scatters``: GEMM + reduce-scatter (else all-gather + GEMM); ``features``: along the last dim (DistDL's forms).
SIDES = {
    "rs": dict(scatters=True, features=False, gemm="matmul_scatter", bw="chunk_reduce", op="MATMUL_REDUCE_SCATTER"),
    "ag": dict(scatters=False, features=False, gemm="gathered_matmul", bw="ag_push", op="ALL_GATHER_MATMUL"),
    "rs_features": dict(scatters=True, features=True, gemm="matmul_scatter_columns", bw="column_reduce",
                        op="MATMUL_REDUCE_SCATTER_FEATURES"),
    "ag_features": dict(scatters=False, features=True, gemm="gathered_k_matmul", bw="ag_push_columns",
                        op="ALL_GATHER_FEATURES_MATMUL"),
    # GEMM + one-shot all-reduce: every rank's tile pushed into every peer's slot, then the W slots summed.
    "all_reduce": dict(scatters=True, features=False, gemm="matmul_push", bw="all_reduce_slots",
                       op="MATMUL_ALL_REDUCE"),
    # The ZeRO layers' weight streaming (distfuse/fused/zero_linear.py): the all-gather GEMMs on the transposed
    # product y.T = W_m @ x.T, the weight shards the gathered operand (``zero``: which ZeRO split; see cases()).
    "zero_rows": dict(scatters=False, features=False, gemm="gathered_matmul", bw="ag_push", op="ZERO_LINEAR_ROWS",
                      zero="rows"),
    "zero_columns": dict(scatters=False, features=True, gemm="gathered_k_matmul", bw="ag_push_columns",
                         op="ZERO_LINEAR_COLUMNS", zero="columns"),
}


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--shapes", default="llama", choices=sorted(SHAPE_SETS),
                   help="row counts M: llama (training 4096-16384 and decode 64, 512), train or decode")
    p.add_argument("--m", type=int, nargs="+", default=None, help="rows M of the full sequence (overrides --shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--world", type=int, default=TP, help="virtual ranks (tensor-parallel degree)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-symm-mem", action="store_true", help="skip torch's symm_mem fused ops")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES),
                   help="which per-rank GEMMs (default all; the lab's decisive ratios: rs ag)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench/results)")
    p.add_argument("--out", type=Path, default=None,
                   help="the result file (default <out-dir>/gemm_fused-<device>-<date>.json)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU correctness pass of every provider, no timings")
    p.add_argument("--no-graphs", action="store_true",
                   help="skip the rows of mode 'graph' (each anchor and fused kernel replayed from a CUDA graph)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the GPU run's pipeline (every provider's rows, anchors, the JSON written after every "
                        "case) at tiny shapes on CPU, interpreted; its times mean nothing")
    return p.parse_args(argv)


# ---------------------------------------------------------------- shapes, rates, projection


def cases(models: dict, ms, world, sides=None):
    """(model, side, m, n, k) of the per-rank GEMMs (see the module doc); ``models``: name -> (H, I)."""
    for model, (hidden, inter) in models.items():
        for m in ms:
            for side in sides or SIDES:
                if SIDES[side].get("zero") == "rows":  # down proj's W_m [H, I/8], its rows over W: m = out
                    yield model, side, hidden, m, inter // world
                elif SIDES[side].get("zero") == "columns":  # up proj's W_m [I/8, H], its columns over W
                    yield model, side, inter // world, m, hidden
                elif SIDES[side]["scatters"]:
                    yield model, side, m, hidden, inter // world
                else:
                    yield model, side, m, inter // world, hidden


def tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def comm_ms(nbytes_full: int, world: int, gbps_per_direction: float = NVLINK_GBPS_PER_DIRECTION) -> float:
    """Time for one rank to send (RS) or receive (AG) its (W - 1) / W share of a full tensor over NVLink."""
    return (world - 1) / world * nbytes_full / (gbps_per_direction * 1e9) * 1e3


def project(side: str, *, t_cublas: float, t_fused_gemm: float, t_comm: float, t_reduce: float = 0.0,
            world: int = TP) -> dict:
    """Projected per-rank times (ms) of the unfused and fused op on 8 GPUs; see the module doc for the model."""
    if side == "all_reduce":
        # Unfused: the GEMM, then a ring all-reduce (2 t_comm).  Fused one-shot: W - 1 copies of the partial leave
        # during the GEMM (W t_comm), then the W slots are summed.
        return dict(unfused=t_cublas + 2 * t_comm, fused=max(t_fused_gemm, world * t_comm) + t_reduce)
    if SIDES[side]["scatters"]:
        return dict(unfused=t_cublas + t_comm, fused=max(t_fused_gemm, t_comm) + t_reduce)
    return dict(unfused=t_comm + t_cublas, fused=t_comm + t_fused_gemm)


# ---------------------------------------------------------------- providers


@functools.lru_cache(maxsize=None)
def _kernels() -> types.SimpleNamespace:
    """The launchers the timed calls use, imported once: an import statement inside a timed method costs the fused
    rows host time (about 1 us each on a fast host, several times that on the GPU machines' hosts) that the cuBLAS
    and copy anchors, plain torch calls, do not pay.  Imported on first use, not at module load, so that
    ``--dry-run`` and ``--smoke`` can set ``TRITON_INTERPRET`` before ``distfuse.kernels`` loads."""
    from distfuse.fused.providers import run_producer, run_push
    from distfuse.kernels.all_gather_features_matmul import ag_push_columns, gathered_k_matmul
    from distfuse.kernels.all_gather_matmul import ag_push, gathered_matmul
    from distfuse.kernels.gathered_matmul_select import last_gather_choice
    from distfuse.kernels.matmul_all_reduce import all_reduce_slots, matmul_push
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter
    from distfuse.kernels.matmul_reduce_scatter_features import column_reduce, matmul_scatter_columns

    return types.SimpleNamespace(**{f.__name__: f for f in (
        run_producer, run_push, ag_push_columns, gathered_k_matmul, ag_push, gathered_matmul, last_gather_choice,
        all_reduce_slots, matmul_push, chunk_reduce, matmul_scatter, column_reduce, matmul_scatter_columns)})


def persistent_config(side: Side, kernel: str) -> dict:
    """``config`` and ``config_source`` of a persistent kernel's launch at this side's shape (its block sizes and
    forms as the launch takes them without a config: ``"measured"``, a tile-table entry, or ``"rules"``); {} for
    another kernel.  The rows of a run with a table of measured tiles say which they took."""
    from distfuse.kernels import gathered_matmul_persistent as gp
    from distfuse.kernels import matmul_scatter_persistent as mp
    from distfuse.kernels.tile_table import device_name, measured_tile, portable_config

    device = side.out.device
    W, rows = side.world, side.m
    if kernel == "matmul_scatter_persistent":
        meta = mp._default_launch(side.dtype, 1, rows, W, side.n, side.k, device)[0]
        key, fn = (rows, side.n, side.k, W), mp._matmul_scatter_persistent_kernel
    elif kernel == "gathered_matmul_persistent":
        q1 = -(-rows // W)
        meta = gp._default_launch(side.dtype, 1, q1, W, side.n, side.k, device)[0]
        key, fn = (q1 * W, side.n, side.k, W), gp._gathered_matmul_persistent_kernel
    else:
        return {}
    config = portable_config(meta)
    measured = measured_tile(kernel, fn, device_name(device), side.dtype, *key)
    took = measured is not None and all(config.get(k) == v for k, v in measured.items())  # the entry, as launched
    return dict(config=config, config_source="measured" if took else "rules")


class Side:
    """One per-rank GEMM of the W-way op (a side of :data:`SIDES`), its loopback workspace and cuBLAS's operands.

    The gathering sides split the input among the virtual ranks (``ag``: rows of the sequence, ``ag_features``:
    the K columns); the scattering sides give every virtual rank the same ``a`` and weight.
    """

    def __init__(self, side, m, n, k, world, dtype, device, seed=0, provider="triton"):
        from distfuse.fused.workspace import LoopbackWorkspace
        from distfuse.geometry.decomposition import block_extent
        from distfuse.kernels.all_gather_features_matmul import gathered_k_workspace_bytes
        from distfuse.kernels.all_gather_matmul import gathered_matmul_workspace_bytes
        from distfuse.kernels.matmul_reduce_scatter import matmul_scatter_workspace_bytes
        from distfuse.kernels.matmul_reduce_scatter_features import matmul_scatter_columns_workspace_bytes

        self.side, self.m, self.n, self.k, self.world, self.dtype = side, m, n, k, world, dtype
        self.spec = SIDES[side]
        self.provider = provider  # the rs side's producer or the ag side's push (distfuse.fused.providers)
        self.gather_kernel = None  # the gathering sides' consumer asked for (None: the selector's default)
        self.gather_choice = None  # and the one that ran (distfuse.kernels.gathered_matmul_select)
        g = torch.Generator(device="cpu").manual_seed(seed)

        def rnd(*shape, scale=1.0):
            return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)

        self.weight = rnd(n, k, scale=1.0 / math.sqrt(k))  # nn.Linear layout [out, in]
        self.out = torch.empty(m, n, dtype=dtype, device=device)
        # The consumer's output as the layers hand it over: [B_, n, N] of the shards' batch (the same memory)
        self.out3 = self.out.view(1, m, n)
        if side == "rs":
            self.a = rnd(1, m, k)  # batch 1, the full sequence
            nbytes = matmul_scatter_workspace_bytes(1, m, n, world, dtype)
        elif side == "rs_features":
            self.a = rnd(1, m, k)
            nbytes = matmul_scatter_columns_workspace_bytes(m, n, world, dtype)
        elif side == "all_reduce":
            from distfuse.kernels.matmul_all_reduce import one_shot_workspace_bytes

            self.a = rnd(1, m, k)
            nbytes = one_shot_workspace_bytes(m, n, world, dtype)
        elif side in ("ag", "zero_rows"):  # the rows of a split over the virtual ranks
            self.shards = [rnd(1, block_extent(m, world, r), k) for r in range(world)]
            self.a = torch.cat(self.shards, dim=1)
            nbytes = gathered_matmul_workspace_bytes(1, m, k, dtype)
        else:
            self.shards = [rnd(1, m, block_extent(k, world, r)) for r in range(world)]
            self.a = torch.cat(self.shards, dim=2)
            nbytes = gathered_k_workspace_bytes(m, k, dtype)
        self.ws = LoopbackWorkspace(world, nbytes, device)

    # -- anchors
    def cublas(self):
        return torch.mm(self.a.view(self.m, self.k), self.weight.t(), out=self.out)

    # -- fused kernels (inside a claim: see prepare)
    def prepare(self):
        """Claim the workspace and run every virtual rank's producer once, so every flag of this epoch is up."""
        self._claim = self.ws.in_flight(f"bench {self.side}")
        self._claim.__enter__()
        for r in range(self.world):
            if self.spec["scatters"]:
                self._scatter(r)
            else:
                self._push(r)

    def release(self):
        self._claim.__exit__(None, None, None)

    def _scatter(self, r):
        k = _kernels()
        if self.side == "rs" and self.provider != "triton":
            self.choice = k.run_producer(self.provider, self.a, self.weight, self.ws, r, self.world, self.dtype)
            return self.choice
        launch = {"rs": k.matmul_scatter, "rs_features": k.matmul_scatter_columns, "all_reduce": k.matmul_push}
        return launch[self.side](self.a, self.weight, self.ws, r, self.world)

    def _push(self, r):
        k = _kernels()
        if self.spec["features"]:
            return k.ag_push_columns(self.shards[r], self.ws, r, self.world, self.k)
        if self.side == "ag" and self.provider != "triton":
            return k.run_push(self.provider, self.shards[r], self.ws, r, self.world, self.m)
        return k.ag_push(self.shards[r], self.ws, r, self.world, self.m)

    def fused_gemm(self):
        if self.spec["scatters"]:
            return self._scatter(0)
        k = _kernels()
        if self.spec["features"]:
            return k.gathered_k_matmul(self.shards[0], self.weight, self.ws, 0, self.world, out=self.out)
        y = k.gathered_matmul(self.shards[0], self.weight, self.ws, 0, self.world, self.m, out=self.out3,
                              kernel=self.gather_kernel)
        self.gather_choice = k.last_gather_choice()  # the kernel that ran: a fallback is named, not hidden
        return y

    def chunk_reduce(self, out=None):
        """The scattering sides' reduction of virtual rank 0's chunk (``chunk_reduce`` or ``column_reduce``)."""
        k = _kernels()
        if self.side == "all_reduce":
            return k.all_reduce_slots(self.ws, 0, self.world, self.m, self.n, partial_dtype=self.dtype, out=out)
        if self.spec["features"]:
            return k.column_reduce(self.ws, 0, self.world, self.m, self.n, partial_dtype=self.dtype, out=out)
        return k.chunk_reduce(self.ws, 0, self.world, 1, self.m, self.n, partial_dtype=self.dtype, out=out)

    def push(self):
        return self._push(0)

    def reduce_bytes(self):
        from distfuse.geometry.decomposition import block_extent

        if self.side == "all_reduce":
            chunk = self.m * self.n * self.dtype.itemsize
        elif self.spec["features"]:
            chunk = self.m * block_extent(self.n, self.world, 0) * self.dtype.itemsize
        else:
            chunk = block_extent(self.m, self.world, 0) * self.n * self.dtype.itemsize
        return (self.world + 1) * chunk  # W slots read, one output written

    def push_bytes(self):
        shard = self.shards[0].numel() * self.dtype.itemsize
        return self.world * shard  # one read, W - 1 writes

    # -- references
    def check(self, dtype_tol: float) -> list[str]:
        """Correctness of every provider on this (small) case; returns the failures."""
        from distfuse.kernels.all_gather_features_matmul import all_gather_features_matmul_reference
        from distfuse.kernels.all_gather_matmul import all_gather_matmul_reference
        from distfuse.kernels.matmul_all_reduce import matmul_all_reduce_reference
        from distfuse.kernels.matmul_reduce_scatter import matmul_reduce_scatter_reference
        from distfuse.kernels.matmul_reduce_scatter_features import matmul_reduce_scatter_features_reference

        bad = []
        ref = self.a.view(self.m, self.k).double() @ self.weight.double().t()
        if not torch.allclose(self.cublas().double(), ref, rtol=dtype_tol, atol=dtype_tol):
            bad.append(f"{self.side}: torch.mm")
        W = self.world
        self.prepare()
        try:
            if self.spec["scatters"]:
                y = self.chunk_reduce()
                if self.side == "all_reduce":
                    want = matmul_all_reduce_reference([self.a] * W, [self.weight] * W)
                else:
                    reference = (matmul_reduce_scatter_features_reference if self.spec["features"] else
                                 matmul_reduce_scatter_reference)
                    want = reference([self.a] * W, [self.weight] * W, 0)
            else:
                y = self.fused_gemm()
                want = (all_gather_features_matmul_reference([s.view(self.m, -1) for s in self.shards], self.weight, 0)
                        if self.spec["features"] else all_gather_matmul_reference(self.shards, self.weight))
            if not torch.allclose(y.double().view(want.shape), want.double(), rtol=dtype_tol, atol=dtype_tol):
                bad.append(f"{self.side}: {self.spec['gemm']} + {self.spec['bw']} (loopback)")
        finally:
            self.release()
        return bad


class SymmMem:
    """torch's symm_mem fused ops on a one-rank NCCL group (the only group a single GPU can form)."""

    def __init__(self):
        import torch.distributed as dist

        self.error = None
        self.group_name = None
        try:
            import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

            if not hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter"):
                raise RuntimeError(f"torch {torch.__version__} has no torch.ops.symm_mem fused matmul ops")
            if not torch.cuda.is_available():
                raise RuntimeError("the symm_mem ops have CUDA kernels only")
            if not dist.is_initialized():
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
                self._owner = True
            self.group_name = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(self.group_name)
        except Exception as exc:  # noqa: BLE001 - any failure means "does not run here"; reported per row
            self.error = f"{type(exc).__name__}: {exc}"

    def op(self, side: Side):
        if side.side == "all_reduce":
            return self._mm_one_shot_all_reduce(side)
        dim = 1 if side.spec["features"] else 0  # scatter the output's / gather the input's columns or rows
        if side.spec["scatters"]:
            A, B = side.a.view(side.m, side.k), side.weight.t()
            return lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", dim, self.group_name)
        A, Bs = side.a.view(side.m, side.k), [side.weight.t()]
        return lambda: torch.ops.symm_mem.fused_all_gather_matmul(A, Bs, dim, self.group_name, return_A=False)

    def _mm_one_shot_all_reduce(self, side: Side):
        """``torch.mm`` into a symmetric buffer, then ``one_shot_all_reduce`` (the unfused symm_mem anchor)."""
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty((side.m, side.n), dtype=side.dtype, device=side.a.device)
        symm_mem.rendezvous(buf, self.group_name)
        A, B = side.a.view(side.m, side.k), side.weight.t()

        def run():
            torch.mm(A, B, out=buf)
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        return run

    def close(self):
        import torch.distributed as dist

        if getattr(self, "_owner", False) and dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- the sweep (GPU; CPU in the smoke pass)


#: The kernel each provider of a row runs where no selector decides (the rs side's producers report theirs).
ROW_KERNELS = {"cublas": "torch.mm", "copy": "Tensor.copy_", "copy_engine": "Tensor.copy_ (one stream per peer)"}


def add_all_ratios(rows, world: int) -> None:
    """The ratios of every row to its anchor measured in the same run: cuBLAS, the copy, the unfused projection."""
    from bench.harness import add_ratios

    add_ratios(rows, "cublas")
    add_ratios(rows, "copy")
    add_ratios(rows, f"projection-unfused-{world}gpu")


def graph_rows(side, shape, row, timed, src, dst, nbytes, m, n, k) -> None:
    """Mode ``graph``: the anchors and the fused kernels of one case, each replayed from a CUDA graph.

    A replay issues the captured launches without the host work of a call (argument checks, the
    Triton launcher, tensor-descriptor encoding), so these rows time the device work alone, as a
    training or decode step captured in a graph (``torch.cuda.graph``, ``torch.compile(mode=
    "reduce-overhead")``) runs it.  The eager rows (mode ``fwd``) keep the host's share.  Each row
    is compared only with the anchor of its own mode.  A capture that fails is reported, not hidden.
    """
    from bench.harness import graphed

    spec = SIDES[side.side]
    op, op_bw = spec["gemm"], spec["bw"]
    bw_shape = dict(shape, bytes=nbytes)

    def one(op_name, provider, case_shape, fn, claim_provider=None, kernel=None):
        """Capture ``fn`` (inside a claim whose producers ran, for the fused kernels) and time its replay."""
        try:
            if claim_provider is not None:
                side.provider = claim_provider
                side.prepare()
            try:
                replay = graphed(fn)
                name = kernel() if callable(kernel) else kernel
                q = timed(replay)
            finally:
                if claim_provider is not None:
                    side.release()
                    side.provider = "triton"
        except Exception as exc:  # noqa: BLE001 - the case goes on; the log says which row is missing and why
            print(f"graph {op_name} {provider} {case_shape}: not captured: {type(exc).__name__}: {str(exc)[:200]}")
            return
        row(op_name, provider, case_shape, q, kernel=name, mode="graph", extra=dict(loopback=True, graph=True))

    one(op, "cublas", shape, side.cublas)
    one(op_bw, "copy", bw_shape, lambda: dst.copy_(src))
    if spec["scatters"]:
        for provider in ("triton", *RS_PROVIDERS):
            one(op, "fused" if provider == "triton" else provider, shape, side.fused_gemm, claim_provider=provider,
                kernel=op if provider == "triton" else (lambda: side.choice.kernel))
        one(op_bw, "fused", bw_shape, side.chunk_reduce, claim_provider="triton", kernel=op_bw)
    else:
        one(op, "fused", shape, side.fused_gemm, claim_provider="triton",
            kernel=lambda: side.gather_choice.kernel if side.gather_choice is not None else op)
        one(op_bw, "fused", bw_shape, side.push, claim_provider="triton", kernel=op_bw)


class Timed(NamedTuple):
    """An eager row's timing (ms): median, q20 and q80 of runs issued back to back, and the median of cold calls
    (each after a synchronise; None off CUDA)."""

    ms: float
    q20: float
    q80: float
    synced_ms: float | None


def sweep(models: dict, ms, world: int, dtype_name: str, reps: int, device: torch.device, symm, sides=None,
          on_case=None, graphs: bool = True) -> list:
    """Every provider on every case; returns harness Rows (ratios set).  ``models``: name -> (H, I).

    ``on_case(rows)``, if given, is called after each case with every row so far, ratios set (the GPU
    run writes its JSON there, so a run cut off keeps what it measured).
    """
    from bench.harness import Row, time_fn
    from distfuse.fused import registry

    dtype = DTYPES[dtype_name]
    W = world
    rows: list[Row] = []

    def row(op, provider, shape, q, kernel=None, mode="fwd", **kw):
        kernel = kernel or ROW_KERNELS.get(provider) or ("symm_mem." + op if provider == "symm_mem" else None) or \
            ("none: modelled" if provider.startswith("projection") else None)
        if isinstance(q, Timed) and q.synced_ms is not None:  # the cold call's time beside the row's (see timed)
            kw["extra"] = dict(kw.get("extra") or {}, ms_synced=q.synced_ms)
        rows.append(Row(op=op, provider=provider, mode=mode, shape=dict(shape), dtype=dtype_name, world_size=W,
                        ms=q[0], ms_q20=q[1], ms_q80=q[2], kernel=kernel, **kw))

    def timed(fn):
        """The eager rows' time: runs issued back to back (``distfuse.timing``: the host runs ahead, as in a
        training step), and on CUDA also the median of cold calls, each after a synchronise (``ms_synced``: where
        the call's host time outlasts its L2 flush, that shows there and not in ``ms``)."""
        warmup = 3 if device.type == "cuda" else 1
        q = time_fn(fn, warmup=warmup, reps=reps, device=device)
        synced = time_fn(fn, warmup=0, reps=reps, device=device, synced=True)[0] if device.type == "cuda" else None
        return Timed(*q, synced)

    def replayed(fn):  # a graph replay has no host work to hide: one timing
        return time_fn(fn, warmup=3 if device.type == "cuda" else 1, reps=reps, device=device)

    for model, side_name, m, n, k in cases(models, ms, W, sides):
        shape = dict(model=model, m=m, n=n, k=k)
        if SIDES[side_name].get("zero"):  # the same kernels as ag / ag_features: keep their rows apart
            shape["zero"] = SIDES[side_name]["zero"]
        side = Side(side_name, m, n, k, W, dtype, device)
        spec = SIDES[side_name]
        op, op_bw, scatters = spec["gemm"], spec["bw"], spec["scatters"]
        q_cublas = timed(side.cublas)
        row(op, "cublas", shape, q_cublas, rate=tflops(m, n, k, q_cublas[0]), rate_unit="TFLOP/s")
        side.prepare()
        try:
            q_fused = timed(side.fused_gemm)
            ratio = q_cublas[0] / q_fused[0]
            gathered = side.gather_choice  # the gathering consumers name the kernel their selector ran
            why = {} if gathered is None else dict(kernel_reason=gathered.reason, fell_back=gathered.fell_back,
                                                   **persistent_config(side, gathered.kernel))
            if side_name == "ag" and gathered.kernel != "gathered_matmul":
                # The pointer consumer (the fallback) on the same shards, kept in the row's extra: it is a kernel
                # of the same provider, not a provider the crossover projection could pick.
                side.gather_kernel = "gathered_matmul"
                try:
                    q_ptr = timed(side.fused_gemm)
                finally:
                    side.gather_kernel = None
                why.update(fallback_kernel=side.gather_choice.kernel, fallback_ms=q_ptr[0],
                           fallback_rate_ratio=q_cublas[0] / q_ptr[0])
            row(op, "fused", shape, q_fused, rate=tflops(m, n, k, q_fused[0]), rate_unit="TFLOP/s",
                kernel=op if gathered is None else gathered.kernel,
                extra=dict(rate_ratio=ratio, target=GEMM_TARGET, meets_target=ratio >= GEMM_TARGET, loopback=True,
                           **why))
            if scatters:
                nbytes = side.reduce_bytes()
                q_bw = timed(side.chunk_reduce)
            else:
                nbytes = side.push_bytes()
                q_bw = timed(side.push)
        finally:
            side.release()
        bw_op = gbps(nbytes, q_bw[0])
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        q_copy = timed(lambda s=src, d=dst: d.copy_(s))  # reads nbytes / 2, writes nbytes / 2
        bw_copy = gbps(src.numel() * 2, q_copy[0])
        bw_shape = dict(shape, bytes=nbytes)
        row(op_bw, "copy", bw_shape, q_copy, rate=bw_copy, rate_unit="GB/s")
        extra = dict(rate_ratio=bw_op / bw_copy, loopback=True)
        if scatters:
            extra.update(target=REDUCE_TARGET, meets_target=bw_op / bw_copy >= REDUCE_TARGET)
        row(op_bw, "fused", bw_shape, q_bw, rate=bw_op, rate_unit="GB/s", kernel=op_bw, extra=extra)
        if side_name == "ag":  # the copy-engine push (DMA on a side stream, joined in loopback) beside the kernel
            side.provider = "copy_engine"
            side.prepare()
            try:
                q_ce = timed(side.push)
            finally:
                side.release()
                side.provider = "triton"
            bw_ce = gbps(nbytes, q_ce[0])
            row(op_bw, "copy_engine", bw_shape, q_ce, rate=bw_ce, rate_unit="GB/s",
                extra=dict(rate_ratio=bw_ce / bw_copy, loopback=True))
        if symm is not None and symm.error is None:
            try:
                q_symm = timed(symm.op(side))
                row(op, "symm_mem", shape, q_symm, rate=tflops(m, n, k, q_symm[0]), rate_unit="TFLOP/s",
                    extra=dict(group="one-rank NCCL group: no communication"))
            except Exception as exc:  # noqa: BLE001 - record that the op does not run on this shape
                print(f"symm_mem {op} {shape}: not run: {type(exc).__name__}: {exc}")
        # Projection of one rank of an 8-GPU node (modelled, not measured; see the module doc).
        full_bytes = m * (n if scatters else k) * dtype.itemsize
        t_comm = comm_ms(full_bytes, W)
        t_reduce = q_bw[0] if scatters else 0.0
        proj = project(side_name, t_cublas=q_cublas[0], t_fused_gemm=q_fused[0], t_comm=t_comm, t_reduce=t_reduce,
                       world=W)
        inputs = dict(t_cublas=q_cublas[0], t_fused_gemm=q_fused[0], t_comm=t_comm,
                      t_chunk_reduce=t_reduce if scatters else None,
                      nvlink_GBps_per_direction=NVLINK_GBPS_PER_DIRECTION)
        # The projection rows model the whole op: named by its registry entry.
        proj_op = getattr(registry, spec["op"]).name
        for p in ("unfused", "fused"):
            ms_p = proj[p]
            row(proj_op, f"projection-{p}-{W}gpu", shape,
                (ms_p, ms_p, ms_p), rate=tflops(m, n, k, ms_p), rate_unit="TFLOP/s",
                extra=dict(projection=True, inputs_ms=inputs))
        if side_name == "rs":  # the other producers, consumed by the same chunk_reduce
            for provider in RS_PROVIDERS:
                side.provider = provider
                side.prepare()
                try:
                    q_p = timed(side.fused_gemm)
                finally:
                    side.release()
                ratio = q_cublas[0] / q_p[0]
                choice = side.choice  # the kernel that ran: a fallback is named, not hidden behind the provider
                row(op, provider, shape, q_p, rate=tflops(m, n, k, q_p[0]), rate_unit="TFLOP/s", kernel=choice.kernel,
                    extra=dict(rate_ratio=ratio, target=GEMM_TARGET, meets_target=ratio >= GEMM_TARGET,
                               loopback=True, kernel_reason=choice.reason, fell_back=choice.fell_back,
                               **persistent_config(side, choice.kernel)))
                ms_p = project(side_name, t_cublas=q_cublas[0], t_fused_gemm=q_p[0], t_comm=t_comm,
                               t_reduce=t_reduce, world=W)["fused"]
                row(proj_op, f"projection-fused-{provider}-{W}gpu", shape, (ms_p, ms_p, ms_p),
                    rate=tflops(m, n, k, ms_p), rate_unit="TFLOP/s",
                    extra=dict(projection=True, inputs_ms=dict(inputs, t_fused_gemm=q_p[0])))
        if graphs and device.type == "cuda":
            graph_rows(side, shape, row, replayed, src, dst, nbytes, m, n, k)
        del side, src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_case is not None:
            add_all_ratios(rows, W)
            on_case(rows)
    add_all_ratios(rows, W)
    return rows


def warm_clocks(device, seconds: float = 1.0) -> None:
    """Busy the GPU for about ``seconds`` before the first case, so that the first case's anchor is not timed while
    the clocks still ramp up (an idle GPU starts near its lowest SM clock)."""
    import time

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def gpu_run(args) -> int:
    from bench.harness import environment, print_table, results_path, write_json

    if args.dry_run:  # CPU, interpreted, tiny: checks the pipeline and the file, not the GPU
        device, W, models, ms = torch.device("cpu"), 2, {"tiny": (16, 48)}, [8]
        args.reps = 1
    else:
        device, W = torch.device("cuda", torch.cuda.current_device()), args.world
        models, ms = {name: MODELS[name] for name in args.models}, args.m or list(SHAPE_SETS[args.shapes])
    env = environment()
    env["world_size_note"] = (f"per-rank kernels of a {W}-way op on one GPU (loopback: {W} virtual ranks); "
                              "projection rows are modelled, not measured; the copy-engine push's copy_ runs on "
                              "the SMs on one GPU (a correctness check there, not a copy-engine measurement)")
    env["autotune"] = os.environ.get("DISTFUSE_AUTOTUNE", "1") != "0"
    path = args.out or results_path("gemm_fused", env, args.out_dir)

    def on_case(rows):  # after every case: a run cut off by its time limit keeps every row measured so far
        write_json(path, env, rows, partial=True)

    env["dry_run"] = bool(args.dry_run)
    symm = None if (args.no_symm_mem or args.dry_run) else SymmMem()
    if symm is not None and symm.error:
        print(f"symm_mem ops not run: {symm.error}")
    if device.type == "cuda":
        warm_clocks(device)
    try:
        rows = sweep(models, ms, W, "float32" if args.dry_run else args.dtype, args.reps, device, symm,
                     sides=args.sides, on_case=on_case, graphs=not args.no_graphs)
    finally:
        if symm is not None:
            symm.close()
    write_json(path, env, rows, partial=False)
    print_table(rows)
    _summary(rows)
    print(f"wrote {path}")
    return 0


def _summary(rows) -> None:
    """Per target op: eager calls (the rows' own ratios) and, where measured, CUDA-graph replays (against the
    anchor replayed in the same case)."""
    targets = {spec["gemm"]: GEMM_TARGET for spec in SIDES.values()}
    targets.update({spec["bw"]: REDUCE_TARGET for spec in SIDES.values() if spec["scatters"]})
    for op, target in targets.items():
        mine = [r for r in rows if r.op == op and r.provider == "fused" and r.mode == "fwd"]
        if mine:
            met = sum(bool(r.extra.get("meets_target")) for r in mine)
            worst = min(mine, key=lambda r: r.extra["rate_ratio"])
            print(f"{op}: {met}/{len(mine)} shapes meet >= {target:.0%} of the anchor; worst "
                  f"{worst.extra['rate_ratio']:.1%} at {worst.shape}")
        anchor = "copy" if op in {spec["bw"] for spec in SIDES.values()} else "cublas"
        graphs = {}
        for r in rows:
            if r.op == op and r.mode == "graph":
                graphs.setdefault(json.dumps(r.shape, sort_keys=True), {})[r.provider] = r
        ratios = [(g[anchor].ms / g["fused"].ms, shape) for shape, g in graphs.items() if anchor in g and "fused" in g]
        if ratios:
            worst_ratio, shape = min(ratios)
            met = sum(q >= target for q, _ in ratios)
            print(f"{op} [graph]: {met}/{len(ratios)} shapes meet >= {target:.0%} of the anchor; worst "
                  f"{worst_ratio:.1%} at {shape}")


# ---------------------------------------------------------------- CPU smoke pass


def multirank_ops_check() -> dict:
    """On each gloo rank: the feature-direction ops, the GEMM + all-reduce and the ZeRO weight streaming (autograd)
    against their unfused compositions, forward and every gradient, on a ``[1, 1, W]`` partition (uneven features;
    ZeRO: ``[W, 1]``, uneven rows); returns the largest absolute difference per op."""
    import torch.nn.functional as F

    from distfuse import Partition
    from distfuse.fused.all_gather_features_matmul import all_gather_features_matmul
    from distfuse.fused.matmul_all_reduce import matmul_all_reduce
    from distfuse.fused.matmul_reduce_scatter_features import matmul_reduce_scatter_features
    from distfuse.fused.symmetric import close_all
    from distfuse.geometry.decomposition import block_extent
    from distfuse.primitives.all_gather import all_gather
    from distfuse.primitives.all_sum_reduce import all_sum_reduce
    from distfuse.primitives.reduce_scatter import reduce_scatter

    P = Partition.world().create_cartesian_topology_partition([1, 1, Partition.world().size])
    W, r = P.size, P.rank
    g = torch.Generator().manual_seed(5 + r)
    K, N = 7, 9
    k_r, n_r = block_extent(K, W, r), block_extent(N, W, r)
    x = torch.randn(2, 3, k_r, generator=g)
    ops = {"matmul_reduce_scatter_features": (torch.randn(N, k_r, generator=g), torch.randn(n_r, generator=g),
                                               lambda x, w, b: matmul_reduce_scatter_features(x, w, b, P),
                                               lambda x, w, b: reduce_scatter(F.linear(x, w), P) + b),
           "all_gather_features_matmul": (torch.randn(n_r, K, generator=g), torch.randn(n_r, generator=g),
                                          lambda x, w, b: all_gather_features_matmul(x, w, b, P),
                                          lambda x, w, b: F.linear(all_gather(x, P, (2, 3, K)), w, b)),
           "matmul_all_reduce": (torch.randn(N, k_r, generator=g), torch.randn(N, generator=g),
                                 lambda x, w, b: matmul_all_reduce(x, w, b, P, algorithm="two_shot"),
                                 lambda x, w, b: all_sum_reduce(F.linear(x, w, b), P))}
    errs = {}
    for name, (w, b, fused, unfused) in ops.items():
        dy = torch.randn(2, 3, N if name == "matmul_all_reduce" else n_r, generator=g)
        got = []
        for fn in (fused, unfused):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            y = fn(*leaves)
            y.backward(dy)
            got.append([y.detach()] + [t.grad for t in leaves])
        errs[name] = max(float((a - b).abs().max()) for a, b in zip(*got, strict=True))
    # The ZeRO weight streaming over the W data-parallel workers (uneven rows and shards) against the all-gathered
    # weight and F.linear: the output, dx and the shard's gradient.
    from distfuse.fused.zero_linear import zero_linear

    P_d = Partition.world().create_cartesian_topology_partition([W, 1])
    x = torch.randn(3 + r, K, generator=g)
    shard = torch.randn(block_extent(N, W, r), K, generator=g)
    dy = torch.randn(3 + r, N, generator=g)
    got = []
    for fn in (lambda x, s: zero_linear(x, s, P_d, split="rows", out_features=N, in_features=K),
               lambda x, s: F.linear(x, all_gather(s, P_d, (N, K)))):
        leaves = [t.clone().requires_grad_() for t in (x, shard)]
        y = fn(*leaves)
        y.backward(dy)
        got.append([y.detach()] + [t.grad for t in leaves])
    errs["zero_linear"] = max(float((a - b).abs().max()) for a, b in zip(*got, strict=True))
    close_all()
    return errs


def smoke(out_dir: Path | None = None) -> int:
    """Every provider once at tiny shapes under the Triton interpreter; correctness only, no timings."""
    from distfuse.fused.all_gather_matmul import all_gather_matmul_loopback, all_gather_matmul_workspace_bytes
    from distfuse.fused.matmul_reduce_scatter import (
        matmul_reduce_scatter_loopback,
        matmul_reduce_scatter_workspace_bytes,
    )
    from distfuse.fused.workspace import LoopbackWorkspace

    bad = []
    W, device = 2, torch.device("cpu")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for side_name, m, n, k in (("rs", 10, 12, 8), ("ag", 10, 6, 16), ("rs_features", 10, 12, 8),
                                   ("ag_features", 10, 6, 16), ("all_reduce", 10, 12, 8), ("zero_rows", 12, 10, 8),
                                   ("zero_columns", 6, 10, 16)):
            bad += Side(side_name, m, n, k, W, dtype, device).check(tol)
        for provider in RS_PROVIDERS:  # the other producers of GEMM + reduce-scatter, K a multiple of 16 bytes
            bad += [f"{b} [{provider}]" for b in Side("rs", 10, 12, 16, W, dtype, device, provider=provider).check(tol)]
        copy_side = Side("ag", 10, 6, 16, W, dtype, device, provider="copy_engine")  # all-gather + GEMM's other push
        bad += [f"{b} [copy_engine]" for b in copy_side.check(tol)]
    # The autograd ops in loopback (what a fused layer runs), forward and backward against torch.
    xs = [torch.randn(2, 5, 4, requires_grad=True) for _ in range(W)]
    wts = [torch.randn(6, 4, requires_grad=True) for _ in range(W)]
    ws_rs = LoopbackWorkspace(W, matmul_reduce_scatter_workspace_bytes(2, 5, 6, W, torch.float32))
    ys = matmul_reduce_scatter_loopback(xs, wts, None, ws_rs)
    full = sum(x.detach() @ w.detach().t() for x, w in zip(xs, wts, strict=True))
    if not torch.allclose(torch.cat(ys, dim=1), full, atol=1e-4):
        bad.append("matmul_reduce_scatter_loopback forward")
    shards = [torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 2, 4, requires_grad=True)]
    ws_ag = LoopbackWorkspace(W, all_gather_matmul_workspace_bytes(2, 5, 4, W, torch.float32))
    ys2 = all_gather_matmul_loopback(shards, wts, None, ws_ag)
    if not torch.allclose(ys2[1], torch.cat([s.detach() for s in shards], dim=1) @ wts[1].detach().t(), atol=1e-4):
        bad.append("all_gather_matmul_loopback forward")
    (sum(y.sum() for y in ys) + sum(y.sum() for y in ys2)).backward()
    if any(t.grad is None or torch.isnan(t.grad).any() for t in xs + wts + shards):
        bad.append("loopback autograd backward")
    # The feature-direction ops across processes (gloo ranks, /dev/shm workspaces): fused against unfused.
    from distfuse.testing import run_ranks, shutdown_pools

    try:
        bad += [f"multi-rank {name} (rank {r}): {err:.2e} from the unfused composition"
                for r, errs in enumerate(run_ranks(2, multirank_ops_check)) for name, err in errs.items()
                if not err <= 1e-4]
    finally:
        shutdown_pools()
    # torch's symm_mem ops: CUDA kernels only.
    symm = SymmMem()
    print(f"smoke: symm_mem provider {'available' if symm.error is None else 'not run: ' + symm.error}")
    # The projection is consistent: fused RS hides comm behind a longer GEMM; fused AG never beats comm + GEMM.
    p = project("rs", t_cublas=1.0, t_fused_gemm=1.05, t_comm=0.5, t_reduce=0.1)
    if not (abs(p["fused"] - 1.15) < 1e-12 and abs(p["unfused"] - 1.5) < 1e-12):
        bad.append("projection (rs)")
    p = project("ag", t_cublas=1.0, t_fused_gemm=1.05, t_comm=0.5)
    if not abs(p["fused"] - 1.55) < 1e-12 or abs(comm_ms(450e9 * 8 / 7 * 1e-3, 8) - 1.0) > 1e-9:
        bad.append("projection (ag) or comm_ms")
    # The whole sweep pipeline at tiny shapes (rows, ratios, projection, summary, JSON); its CPU times mean
    # nothing, so the file is marked smoke and goes to a temporary folder unless --out-dir says otherwise.
    import json
    import tempfile

    from bench.harness import environment, write_results

    rows = sweep({"tiny": (16, 48)}, (10, 4), 2, "float32", 1, device, None)
    # 2 m x the sides x (cublas, fused, copy, bandwidth op, 2 projections), + 2 m x the other rs producers x 2 rows,
    # + 2 m x the ag side's copy-engine push
    want = 2 * len(SIDES) * 6 + 2 * len(RS_PROVIDERS) * 2 + 2
    if len(rows) != want or any(r.ratio is None for r in rows if r.provider in ("fused", "projection-fused-2gpu")):
        bad.append(f"sweep rows: expected {want} with ratios, got {len(rows)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_results("gemm_fused", rows, env=environment(), out_dir=out_dir or Path(tmp), smoke=True)
        if len(json.loads(path.read_text())["rows"]) != want:
            bad.append("results JSON")
    with contextlib.redirect_stdout(io.StringIO()):  # exercised, not shown: CPU ratios are meaningless
        _summary(rows)
    for b in bad:
        print(f"smoke: FAILED: {b}", file=sys.stderr)
    if bad:
        return 1
    print("smoke: ok: cublas/torch.mm, fused matmul_scatter + chunk_reduce, ag_push + gathered_matmul, "
          "matmul_scatter_columns + column_reduce, ag_push_columns + gathered_k_matmul, matmul_push + "
          "all_reduce_slots, the ZeRO weight-streaming sides, the loopback autograd ops, the feature-direction, "
          "all-reduce and ZeRO autograd ops on 2 gloo ranks, the projection and the sweep pipeline agree "
          "(correctness only; CPU times are not results)")
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    has_cuda = torch.cuda.is_available()
    if args.smoke:
        if not has_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before distfuse.kernels is imported
        return smoke(args.out_dir)
    if args.dry_run:
        if not has_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return gpu_run(args)
    if not has_cuda:
        print("no CUDA device; benchmark not run (use --smoke for a CPU correctness pass)")
        return 0
    return gpu_run(args)


if __name__ == "__main__":
    sys.exit(main())
