"""Walk one layer call as data: the distfuse files it enters, in order, and how often it comes back to one.

``python scripts/walk.py`` prints the two walks ``docs/design.md`` records ("Two forwards,
walked as data"), on 4 forked gloo ranks, as seen from world rank 0, for the ``distfuse`` of the
working directory (run it from another checkout to walk that one):

* ``conv``: ``DistributedFeatureConv2d`` forward on ``P_x = [1, 1, 2, 2]``, eager, unfused,
  a 3 x 3 kernel, input that requires grad, a settled call (its signature repeats);
* ``linear_rs``: ``DistributedLinearReduceScatter`` forward on ``P_x = [2, 2]`` (the weight
  broadcast along ``d``), ``DISTFUSE_PATH=fused`` with the Triton interpreter, a settled call,
  the workspace already set up.

The rule: a profile hook sees every Python call; a call counts when the function's file is a
distfuse file other than the file of the nearest distfuse frame below it on the stack (calls
through torch, such as ``autograd.Function.apply``, are followed).  **Files** is the number
of distinct files entered; **edges** the distinct (caller file, callee file) pairs;
**returns** ``edges - (files - 1)``: the edges beyond a tree, each a return to a file already
entered (a loop over messages counts once).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # the distfuse of the working directory (to walk another checkout: run it there)
import distfuse  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(distfuse.__file__)) + os.sep


def _rel(filename: str) -> str | None:
    return filename[len(ROOT):] if filename.startswith(ROOT) else None


def _nearest_distfuse(frame) -> str | None:
    while frame is not None:
        rel = _rel(frame.f_code.co_filename)
        if rel is not None:
            return rel
        frame = frame.f_back
    return None


def walk(call, start: str) -> tuple[list[str], set[tuple[str, str]]]:
    """Run ``call()`` under the profile hook; returns the files in first-entry order and the edges."""
    order, edges = [start], set()

    def hook(frame, event, arg):
        if event != "call":
            return
        callee = _rel(frame.f_code.co_filename)
        if callee is None:
            return
        caller = _nearest_distfuse(frame.f_back)
        if caller is None or caller == callee:
            return
        edges.add((caller, callee))
        if callee not in order:
            order.append(callee)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return order, edges


def _conv_walk():
    import torch.distributed as dist

    from distfuse import Partition
    from distfuse.layers import DistributedConv2d

    P = Partition.world().create_partition_inclusive(range(4)).create_cartesian_topology_partition([1, 1, 2, 2])
    layer = DistributedConv2d(P, 3, 4, 3, padding=1)
    x = torch.randn(1, 3, 4, 4, requires_grad=True)
    for _ in range(2):  # settle the agreement
        layer(x)
    out = walk(lambda: layer(x), "layers/conv_feature.py")
    return out if dist.get_rank() == 0 else None


def _linear_walk():
    import torch.distributed as dist

    from distfuse import Partition
    from distfuse.fused import symmetric
    from distfuse.layers import DistributedLinearReduceScatter

    os.environ["DISTFUSE_PATH"] = "fused"
    P = Partition.world().create_partition_inclusive(range(4)).create_cartesian_topology_partition([2, 2])
    layer = DistributedLinearReduceScatter(P, 8, 6)
    x = torch.randn(4, 4, requires_grad=True)  # in_features 8 over P_m = 2
    try:
        for _ in range(2):
            layer(x)
        out = walk(lambda: layer(x), "layers/linear_reduce_scatter.py")
    finally:
        os.environ.pop("DISTFUSE_PATH")
        symmetric.close_all()
    return out if dist.get_rank() == 0 else None


def main() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from distfuse.testing import run_ranks

    for name, fn in (("conv", _conv_walk), ("linear_rs", _linear_walk)):
        order, edges = run_ranks(4, fn)[0]
        print(f"{name}: {len(order)} files, {len(edges)} edges, {len(edges) - (len(order) - 1)} returns")
        print("  " + " -> ".join(order))


if __name__ == "__main__":
    main()
