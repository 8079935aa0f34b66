"""Triton autotuner caches: harvest the configs a sweep's autotuners picked, seed them back in a later process.

On CUDA the loopback GEMM kernels autotune (``DISTFUSE_AUTOTUNE``); the configs they picked
go into the table's ``triton_configs`` (:func:`harvest_autotune_caches`), and
:func:`seed_autotune_caches` puts them back in a later process, so the first launch of a
tuned shape skips the benchmarking (a launcher also takes one as its explicit ``config=``).
Configs saved under the GEMM launchers' former names (``gemm_rs``, ``ag_gemm``) are read
under the current ones (:data:`RENAMED_TUNERS`).
"""

from __future__ import annotations

import torch

from distfuse.fused.crossover_table import read_json
from distfuse.fused.registry import RENAMED_KERNELS

__all__ = ["config_to_json", "harvest_autotune_caches", "seed_autotune_caches", "autotuners", "cache_keys",
           "RENAMED_TUNERS"]

#: Former autotuner names -> current ones: each renamed launcher and its ``_fp32`` twin.
RENAMED_TUNERS = {f"{old}{size}": f"{new}{size}" for old, new in RENAMED_KERNELS.items() for size in ("", "_fp32")}


def config_to_json(cfg) -> dict:
    """A ``triton.Config`` as JSON (kwargs, num_warps, num_stages, and num_ctas / maxnreg when set)."""
    out = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if getattr(cfg, "num_ctas", 1) not in (None, 1):
        out["num_ctas"] = cfg.num_ctas
    if getattr(cfg, "maxnreg", None) is not None:
        out["maxnreg"] = cfg.maxnreg
    return out


def _key_to_json(key) -> list:
    return [k if isinstance(k, (int, float, str, bool)) or k is None else str(k) for k in key]


def autotuners() -> dict:
    """The GEMM kernels' ``triton.autotune`` objects (None entries dropped: no autotuning without CUDA)."""
    try:
        import distfuse.kernels.all_gather_matmul as all_gather_kernels
        import distfuse.kernels.chunk_reduce as chunk_reduce_kernels
        import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
    except Exception:  # noqa: BLE001 - kernels unavailable (no Triton): nothing to harvest
        return {}
    tuners = {"chunk_reduce": getattr(chunk_reduce_kernels, "_chunk_reduce_tuned", None),
              "ag_push": getattr(all_gather_kernels, "_push_tuned", None)}
    # The GEMMs have one autotuner per operand size (fp32 tiles have their own configs).
    for name, by_size in (("matmul_scatter", getattr(reduce_scatter_kernels, "_matmul_scatter_tuned", {})),
                          ("gathered_matmul", getattr(all_gather_kernels, "_gathered_matmul_tuned", {}))):
        for size, tuner in (by_size or {}).items():
            tuners[name if size == 2 else f"{name}_fp32"] = tuner
    return {k: v for k, v in tuners.items() if v is not None and isinstance(getattr(v, "cache", None), dict)}


def harvest_autotune_caches(tuners: dict | None = None, skip: dict | None = None) -> dict:
    """``kernel -> [{"key": [...], **config}]`` from the autotuners' caches, minus the keys in ``skip``.

    ``skip`` is an earlier harvest (``kernel -> set of key tuples``, see :func:`cache_keys`),
    so that each sweep records the configs its own shapes produced.
    """
    tuners = autotuners() if tuners is None else tuners
    out = {}
    for name, tuner in tuners.items():
        seen = (skip or {}).get(name, set())
        got = [dict(key=_key_to_json(k), **config_to_json(c)) for k, c in tuner.cache.items() if k not in seen]
        if got:
            out[name] = got
    return out


def cache_keys(tuners: dict) -> dict:
    return {name: set(t.cache) for name, t in tuners.items()}


def seed_autotune_caches(table: dict | None = None, device_name: str | None = None, world_size: int | None = None,
                         dtype: torch.dtype | None = None, tuners: dict | None = None) -> int:
    """Put saved configs back into the autotuners' caches; returns how many were seeded.

    Only entries of this device (and world size / dtype when given) are used, and only
    when the table was written by the installed Triton version (autotune keys and
    config semantics may change between versions).  Call it before the first fused launch.
    """
    import triton

    table = read_json() if table is None else table
    tuners = autotuners() if tuners is None else tuners
    saved = table.get("triton_configs", {})
    runs = table.get("_meta", {}).get("runs", {})
    n = 0
    for key, kernels in saved.items():
        dev, world, dt, _op = key.split("|")
        if (device_name is not None and dev != device_name) or (world_size is not None and int(world) != world_size) \
                or (dtype is not None and dt != str(dtype).removeprefix("torch.")):
            continue
        if runs.get(f"{dev}|{world}", {}).get("triton") != triton.__version__:
            continue  # written by another Triton version (or unknown): its keys and configs may not apply
        for name, configs in kernels.items():
            tuner = tuners.get(RENAMED_TUNERS.get(name, name))
            if tuner is None:
                continue
            for c in configs:
                extra = {k: c[k] for k in ("num_ctas", "maxnreg") if k in c}
                tuner.cache[tuple(c["key"])] = triton.Config(dict(c["kwargs"]), num_warps=c["num_warps"],
                                                             num_stages=c["num_stages"], **extra)
                n += 1
    return n
