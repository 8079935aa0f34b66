"""GPU session, phase 1: what this machine's torch, Triton and symmetric memory offer.

Prints and writes (``--json``) the versions, the device (through nvidia-ml-py), the
``torch.distributed._symmetric_memory`` API names, whether the implicit symmetric-memory
pool is in use, the peer addresses of a two-buffer rendezvous on a one-rank group, and
how distfuse reads the CUDA backend of a group created the torchrun way
(``init_process_group()`` with no backend).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def probe() -> dict:
    import torch
    import torch.distributed as dist
    import triton

    from bench.harness import environment

    out = dict(env=environment(), python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    props = torch.cuda.get_device_properties(0)
    out["device"] = dict(name=props.name, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                         memory_gib=round(props.total_memory / 2**30, 1),
                         l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    import torch.distributed._symmetric_memory as symm_mem

    out["symm_mem_api"] = sorted(n for n in dir(symm_mem) if not n.startswith("__"))
    # torch.ops namespaces resolve ops lazily (dir() lists none), so ask for the ones distfuse compares with.
    known = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_all_gather_scaled_matmul",
             "fused_scaled_matmul_reduce_scatter", "one_shot_all_reduce", "two_shot_all_reduce_",
             "multimem_all_reduce_", "multimem_one_shot_all_reduce", "reduce_scatter_out", "stream_write_value32_")
    out["symm_mem_ops"] = {n: hasattr(torch.ops.symm_mem, n) for n in known}
    try:  # the persistent GEMM's host-side TMA descriptors
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        out["host_tensor_descriptor"] = True
    except ImportError:
        out["host_tensor_descriptor"] = False
    use_pool = getattr(symm_mem, "_should_use_implicit_mempool", None)
    try:
        out["implicit_pool"] = bool(use_pool()) if use_pool else None
    except Exception as exc:  # noqa: BLE001
        out["implicit_pool"] = f"unknown: {exc}"
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group(init_method=f"file://{path}", rank=0, world_size=1)  # no backend: the torchrun way
    try:
        from distfuse import Partition
        from distfuse.groups import cuda_backend_of

        out["backend_string"] = str(dist.get_backend())
        out["distfuse_cuda_backend"] = cuda_backend_of(dist.group.WORLD)
        out["partition_device"] = str(Partition.world().device)
        bufs = []
        for n in (4096, 1000):
            buf = symm_mem.empty(n, dtype=torch.uint8, device="cuda")
            h = symm_mem.rendezvous(buf, dist.group.WORLD)
            rec = dict(data_ptr=buf.data_ptr(), buffer_ptrs=[int(p) for p in h.buffer_ptrs],
                       offset=int(getattr(h, "offset", -1)), buffer_size=int(getattr(h, "buffer_size", -1)),
                       has_get_buffer=hasattr(h, "get_buffer"))
            if hasattr(h, "get_buffer"):  # what distfuse.fused.peer_views builds peer views from
                off = buf.data_ptr() - int(h.buffer_ptrs[0])
                view = h.get_buffer(0, (n,), torch.uint8, off)
                rec["get_buffer_aliases"] = view.data_ptr() == buf.data_ptr()
            bufs.append(rec)
        out["rendezvous"] = bufs
    finally:
        dist.destroy_process_group()
    return out


def dry_probe() -> dict:
    """What a machine without a GPU can say (``--dry-run``: the lab's dry run checks the JSON path)."""
    import torch
    import triton

    from bench.harness import environment

    out = dict(env=environment(), python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
               dry_run=True, cuda_available=torch.cuda.is_available())
    try:
        import torch.distributed._symmetric_memory as symm_mem

        out["symm_mem_api"] = sorted(n for n in dir(symm_mem) if not n.startswith("__"))
    except ImportError as exc:
        out["symm_mem_api"] = f"not importable: {exc}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="no GPU: versions and API names only")
    args = p.parse_args(argv)
    res = dry_probe() if args.dry_run else probe()
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    short = {k: v for k, v in res.items() if k not in ("env", "symm_mem_api")}
    print(json.dumps(short, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
