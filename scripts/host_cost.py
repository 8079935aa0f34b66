"""Per-call host time of small layer forwards in one gloo process (world 1): the Python path of each layer.

Prints one JSON object, microseconds per call (the best of 5 runs of 300 calls, under no_grad).
Run it from two checkouts to compare their per-call cost::

    git worktree add /tmp/base <commit>
    (cd /tmp/base && python /path/to/scripts/host_cost.py)   # imports /tmp/base's distfuse
    python scripts/host_cost.py

At world size 1 no message moves, so the time is the layer's own Python and the local
compute of tiny tensors: what a refactoring can make worse.  CPU host time, not a GPU result.
"""

from __future__ import annotations

import json
import tempfile
import time

import torch
import torch.distributed as dist


def _layers() -> dict:
    from distfuse import Partition
    from distfuse.layers import (
        DistributedConv2d,
        DistributedLayerNorm,
        DistributedLinear,
        DistributedLinearAllGather,
        DistributedLinearReduceScatter,
        DistributedMaxPool2d,
    )

    P = Partition.world()
    P4 = P.create_cartesian_topology_partition([1, 1, 1, 1])
    P3 = P.create_cartesian_topology_partition([1, 1, 1])
    P2 = P.create_cartesian_topology_partition([1, 1])
    return {
        "conv2d": (DistributedConv2d(P4, 4, 4, 3, padding=1), torch.randn(1, 4, 8, 8)),
        "maxpool2d": (DistributedMaxPool2d(P4, 2), torch.randn(1, 4, 8, 8)),
        "linear_all_gather": (DistributedLinearAllGather(P3, 16, 16, P_x=P3), torch.randn(2, 8, 16)),
        "linear_reduce_scatter": (DistributedLinearReduceScatter(P3, 16, 16, P_y=P3), torch.randn(2, 8, 16)),
        "layernorm": (DistributedLayerNorm(P3, 16), torch.randn(2, 8, 16)),
        "linear_general": (DistributedLinear(P2, P2, P2, 16, 16), torch.randn(8, 16)),
    }


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        out = {}
        with torch.no_grad():
            for name, (layer, x) in _layers().items():
                for _ in range(50):
                    layer(x)
                runs = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(300):
                        layer(x)
                    runs.append((time.perf_counter() - t0) / 300 * 1e6)
                out[name] = round(min(runs), 2)
        dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
