"""Reliability: bad inputs, mismatched calls in debug mode, and injected faults (raise, exit) on one rank.

Bad inputs.  One table, one representative bad input per public entry point (partition
creation, every primitive's module and functional form, every layer family,
``distribute_tensor``/``collect_tensor``, ``load_sequential``).  Each row says which
ranks must raise which error (the op's name, ``[rank r]`` and the expected-vs-actual
text), which ranks wait for them until the process-group timeout (local checks of the
functional forms, documented), and every other rank must succeed.  Rows run in a pool
whose collectives time out after :data:`PG_BAD` seconds, so an unexpected hang costs
seconds, not the default 30.

Faults.  One rank raises mid-forward, mid-backward or mid-fused-op (the fused halo
convolution forced with ``DISTFUSE_PATH=fused``, and the symmetric-workspace GEMM ops),
or exits outright (``os._exit``).  Every other rank must get its own error (a
:class:`~distfuse.errors.CollectiveTimeoutError` that names the op and the rank) within
the process-group timeout :data:`PG_FAULT` plus a slack, the pool must be rebuilt and
work, the workspaces must be freed and ``/dev/shm`` must hold nothing of the pool.
"""

from __future__ import annotations

import gc
import os
import re
import time
import traceback
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfuse import Partition, PartitionError, zero_volume_tensor
from distfuse.geometry.decomposition import block_extent
from distfuse.kernels._utils import INTERPRET
from distfuse.layers import (
    DistributedConv1d,
    DistributedConv2d,
    DistributedLinear,
    DistributedLinearAllGather,
    DistributedLinearReduceScatter,
    load_sequential,
)
from distfuse.primitives import (
    AllGather,
    AllSumReduce,
    Broadcast,
    HaloExchange,
    ReduceScatter,
    Repartition,
    SumReduce,
    collect_tensor,
    distribute_tensor,
)
from distfuse.primitives.broadcast import broadcast
from distfuse.primitives.repartition import repartition
from distfuse.testing import RankFailure, run_ranks
from distfuse.testing.pool import discard_pool
from tests.tolerances import tol

PG_BAD = 3.0  # process-group timeout (s) of the bad-input pool: rows whose peers wait cost this much
PG_FAULT = 3.0  # process-group timeout (s) of the fault pools
SLACK = 4.0  # loaded 2-core machine: start-up of the failing call, scheduling, the pool's bookkeeping
WORLD = 4
# The ranks' fused kernels run on CPU tensors, which needs the Triton interpreter (conftest sets it without CUDA).
interpreted = pytest.mark.skipif(not INTERPRET, reason="fused kernels on CPU tensors need TRITON_INTERPRET=1")

_GRIDS: dict = {}


def _grid(ranks, shape):
    """A partition over world ranks, cached per rank process (creation is collective over the world)."""
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


def _r() -> int:
    return dist.get_rank()


def _debug(fn):
    """Run ``fn`` with DISTFUSE_DEBUG=1 in this rank."""
    os.environ["DISTFUSE_DEBUG"] = "1"
    try:
        return fn()
    finally:
        os.environ.pop("DISTFUSE_DEBUG", None)


# ---------------------------------------------------------------- bad inputs: one scenario per entry point

_SCENARIOS: dict = {}


def _scenario(fn):
    _SCENARIOS[fn.__name__] = fn
    return fn


G4 = ((0, 1, 2, 3), (2, 2))


@_scenario
def part_repeated_ranks():
    Partition.world().create_partition_inclusive([0, 0])


@_scenario
def part_rank_out_of_range():
    Partition.world().create_partition_inclusive([0, 9])


@_scenario
def part_cartesian_volume():
    Partition.world().create_cartesian_topology_partition([3, 3])


@_scenario
def part_subtopology_dims():
    _grid(*G4).create_cartesian_subtopology_partition([True])


@_scenario
def bcast_not_broadcastable():
    Broadcast(_grid((0, 1), (2,)), _grid((0, 1, 2), (3,)))


@_scenario
def bcast_ndim():
    B = Broadcast(_grid((0,), (1, 1)), _grid(*G4))
    B(torch.randn(3) if _r() == 0 else zero_volume_tensor())


@_scenario
def bcast_dtypes_disagree():
    B = Broadcast(_grid((0, 1), (1, 2)), _grid(*G4))
    B(torch.randn(2, 2, dtype=torch.float64 if _r() == 1 else torch.float32) if _r() < 2 else zero_volume_tensor())


@_scenario
def bcast_device():
    B = Broadcast(_grid((0,), (1, 1)), _grid(*G4))
    B(torch.randn(2, 2, device="meta") if _r() == 0 else zero_volume_tensor())


@_scenario
def bcast_data_on_inactive_rank():
    B = Broadcast(_grid((0,), (1, 1)), _grid((0, 1), (1, 2)))
    B(torch.randn(2, 2) if _r() in (0, 3) else zero_volume_tensor())


@_scenario
def bcast_functional_without_y_shape():
    B = Broadcast(_grid((0,), (1, 1)), _grid(*G4))
    broadcast(torch.randn(2, 2) if _r() == 0 else zero_volume_tensor(), B.plan)


@_scenario
def sumreduce_block_shapes():
    SumReduce(_grid(*G4), _grid((0, 1), (1, 2)))(torch.randn(2, 3 if _r() == 3 else 2))


@_scenario
def allsum_axis_out_of_range():
    AllSumReduce(_grid(*G4), axes_reduce=(2,))


@_scenario
def allsum_not_a_tensor():
    AllSumReduce(_grid(*G4), axes_reduce=(0,))([1.0, 2.0])


@_scenario
def allsum_device():
    AllSumReduce(_grid(*G4), axes_reduce=(0, 1))(torch.randn(3, device="meta"))


@_scenario
def allgather_blocks_do_not_tile():
    AllGather(_grid(*G4), axes_all_gather=(0, 1))(torch.randn(2, 3 if _r() == 3 else 2))


@_scenario
def allgather_dtypes_disagree():
    AllGather(_grid(*G4), axes_all_gather=(0,))(torch.randn(2, 2, dtype=torch.float64 if _r() == 1 else torch.float32))


@_scenario
def allgather_ndim():
    AllGather(_grid(*G4), axes_all_gather=(0,))(torch.randn(2, 2, 2))


@_scenario
def allgather_out_shape_misfit():
    """Functional form with ``out_shape``: local checks only; the peers wait (documented)."""
    A = AllGather(_grid(*G4), axes_all_gather=(0,))
    A(torch.randn(2, 2), out_shape=(5, 2) if _r() in (0, 1) else (4, 2))


@_scenario
def reducescatter_ndim():
    ReduceScatter(_grid(*G4), axes_reduce_scatter=(1,))(torch.randn(4))


@_scenario
def halo_too_many_spatial_axes():
    HaloExchange(_grid(range(4), (4,)), kernel_size=(3, 3))


@_scenario
def halo_padding_mode():
    HaloExchange(_grid(range(4), (1, 1, 4)), kernel_size=(3,), padding_mode="mirror")


@_scenario
def halo_same_with_stride():
    HaloExchange(_grid(range(4), (1, 1, 4)), kernel_size=(3,), stride=2, padding="same")


@_scenario
def halo_unbalanced_blocks():
    HaloExchange(_grid(range(4), (1, 1, 4)), kernel_size=(3,), padding=1)(torch.randn(1, 1, 3 if _r() == 3 else 2))


@_scenario
def halo_reflect_wider_than_input():
    H = HaloExchange(_grid(range(4), (1, 1, 4)), kernel_size=(5,), padding=4, padding_mode="reflect")
    H(torch.randn(1, 1, 1))


@_scenario
def halo_global_shape_misfit():
    """Functional form (``global_shape`` given): rank 0's block does not fit, its neighbour waits (documented)."""
    H = HaloExchange(_grid(range(4), (1, 1, 4)), kernel_size=(3,), padding=1)
    H(torch.randn(1, 1, 2), global_shape=(1, 1, 9))


@_scenario
def repart_partition_dims():
    Repartition(_grid(*G4), _grid(range(4), (4,)))


@_scenario
def repart_not_cartesian():
    Repartition(Partition.world(), _grid(range(4), (4,)))


@_scenario
def repart_unbalanced_blocks():
    Repartition(_grid(*G4), _grid(range(4), (1, 4)))(torch.randn(2, 3 if _r() == 0 else 2))


@_scenario
def repart_dtypes_disagree():
    Repartition(_grid(*G4), _grid(range(4), (1, 4)))(torch.randn(2, 2, dtype=torch.float64 if _r() == 2 else
                                                                 torch.float32))


@_scenario
def repart_device():
    Repartition(_grid(*G4), _grid(range(4), (1, 4)))(torch.randn(2, 2, device="meta" if _r() == 1 else "cpu"))


@_scenario
def repart_functional_global_shape():
    repartition(torch.randn(2, 2), _grid(*G4), _grid(range(4), (1, 4)), (4,))


@_scenario
def repart_functional_local_shape():
    repartition(torch.randn(2, 3), _grid(*G4), _grid(range(4), (1, 4)), (4, 4))


@_scenario
def distribute_src_out_of_range():
    distribute_tensor(torch.randn(4, 4), _grid(*G4), src=7)


@_scenario
def distribute_ndim():
    distribute_tensor(torch.randn(4) if _r() == 0 else None, _grid(*G4))


@_scenario
def collect_block_shape():
    collect_tensor(torch.randn(2, 3 if _r() == 2 else 2), _grid(*G4))


_P_FEAT = ((0, 1, 2, 3), (1, 1, 4))


@_scenario
def conv_feature_channels_split():
    DistributedConv1d(_grid(range(4), (1, 2, 2)), 4, 4, 3)


@_scenario
def conv_groups():
    DistributedConv1d(_grid(*_P_FEAT), 4, 6, 3, groups=4)


@_scenario
def conv_padding_mode():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3, padding_mode="mirror")


@_scenario
def conv_kernel_size():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 0)


@_scenario
def conv_negative_padding():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3, padding=-1)


@_scenario
def conv_stride_entries():
    DistributedConv2d(_grid(range(4), (1, 1, 2, 2)), 4, 4, 3, stride=(1, 1, 1))


@_scenario
def conv_input_channels():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.randn(2, 3, 5))


@_scenario
def conv_dtype_vs_parameters():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.randn(2, 4, 5, dtype=torch.float64))


@_scenario
def conv_integer_input():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.ones(2, 4, 5, dtype=torch.int64))


@_scenario
def conv_input_ndim():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.randn(2, 4, 5, 5))


@_scenario
def conv_unbalanced_blocks():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.randn(2, 4, 6 if _r() == 3 else 5))


@_scenario
def conv_reflect_wider_than_input():
    DistributedConv1d(_grid(*_P_FEAT), 2, 2, 9, padding=4, padding_mode="reflect")(torch.randn(1, 2, 1))


@_scenario
def conv_device():
    DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)(torch.randn(2, 4, 5, device="meta" if _r() == 1 else "cpu"))


@_scenario
def conv_data_on_inactive_rank():
    c = DistributedConv1d(_grid((0, 1), (1, 1, 2)), 4, 4, 3)
    c(torch.randn(2, 4, 5) if _r() in (0, 1, 3) else zero_volume_tensor())


@_scenario
def conv_P_w_without_P_y():
    DistributedConv1d(_grid((0, 1), (1, 2, 1)), 4, 4, 3, P_w=_grid(range(4), (2, 2, 1)))


@_scenario
def conv_general_partitions():
    DistributedConv1d(_grid((0, 1), (1, 2, 1)), 4, 4, 3, P_y=_grid((2, 3), (1, 2, 1)),
                      P_w=_grid(range(4), (2, 1, 2)))


@_scenario
def conv_channel_groups():
    DistributedConv1d(_grid((0, 1), (1, 2, 1)), 4, 4, 3, groups=2, P_y=_grid((2, 3), (1, 2, 1)),
                      P_w=_grid(range(4), (2, 2, 1)))


@_scenario
def conv_channel_input_channels():
    c = DistributedConv1d(_grid((0, 1), (1, 2, 1)), 4, 4, 3, P_y=_grid((2, 3), (1, 2, 1)),
                          P_w=_grid(range(4), (2, 2, 1)))
    c(torch.randn(2, 3, 5) if _r() < 2 else zero_volume_tensor())


@_scenario
def linear_P_w_shape():
    DistributedLinear(_grid((0, 1), (1, 2)), _grid((2, 3), (1, 2)), _grid(range(4), (1, 4)), 4, 4)


@_scenario
def linear_features():
    DistributedLinearAllGather(_grid(range(4), (1, 4)), 0, 4)


@_scenario
def linear_input_features():
    DistributedLinearAllGather(_grid(range(4), (1, 4)), 8, 4)(torch.randn(3, 3))


@_scenario
def linear_input_ndim():
    DistributedLinearReduceScatter(_grid(range(4), (1, 1, 4)), 8, 4)(torch.randn(3, 2))


@_scenario
def linear_general_block():
    layer = DistributedLinear(_grid((0, 1), (1, 2)), _grid((2, 3), (1, 2)), _grid(range(4), (2, 2)), 5, 3)
    layer(torch.randn(2, 3) if _r() < 2 else zero_volume_tensor())


@_scenario
def load_sequential_not_a_layer():
    load_sequential(nn.Linear(2, 2), None)


@_scenario
def load_sequential_shape():
    """The source finds the bad shape; every rank raises it (the verdict is broadcast first)."""
    c = DistributedConv1d(_grid(*_P_FEAT), 4, 4, 3)
    load_sequential(c, nn.Conv1d(4, 4, 5) if _r() == 0 else None)


def _run_scenario(name: str):
    """Run one scenario on this rank; return None or ``(type name, message)``."""
    try:
        _SCENARIOS[name]()
    except Exception as exc:  # noqa: BLE001 - the parent checks type and message
        return type(exc).__name__, str(exc)
    return None


class Bad(NamedTuple):
    scenario: str
    op: str  # the op every raiser names, as "<op> [rank r]"
    error: str  # the error class name
    match: str  # regex on the message: what was expected and what came
    raisers: tuple = (0, 1, 2, 3)
    waiters: tuple = ()  # ranks that wait for a raiser and get a CollectiveTimeoutError
    named: bool = True  # the message names the op and the rank (False: a gap, reported in docs/reliability.md)


ALL = (0, 1, 2, 3)
BAD = [
    Bad("part_repeated_ranks", "Partition", "PartitionError", r"repeated ranks \[0, 0\]"),
    Bad("part_rank_out_of_range", "Partition", "PartitionError", r"ranks \[9\] are outside this partition of size 4"),
    Bad("part_cartesian_volume", "Partition", "PartitionError", r"volume 9, expected the partition size 4"),
    Bad("part_subtopology_dims", "Partition", "PartitionError", r"remain_dims has 1 entries, expected 2"),
    Bad("bcast_not_broadcastable", "Broadcast", "PartitionError", r"extent 2 must be 1 or equal 3"),
    Bad("bcast_ndim", "Broadcast", "ShapeError", r"world rank 0: number of tensor dimensions .*expected 2, got 1"),
    Bad("bcast_dtypes_disagree", "Broadcast", "CollectiveMismatchError",
        r"one dtype; got rank 0: torch.float32, rank 1: torch.float64"),
    Bad("bcast_device", "Broadcast", "ShapeError",
        r"device type: expected cpu on every worker, got world rank 0: meta"),
    Bad("bcast_data_on_inactive_rank", "Broadcast", "ShapeError", r"must pass a zero-volume tensor; got shape \(2, 2\)",
        raisers=(3,)),
    Bad("bcast_functional_without_y_shape", "Broadcast", "ShapeError", r"needs y_shape"),
    Bad("sumreduce_block_shapes", "SumReduce", "ShapeError",
        r"summed into world rank 1 must have one shape; got \{1: \(2, 2\), 3: \(2, 3\)\}"),
    Bad("allsum_axis_out_of_range", "AllSumReduce", "PartitionError", r"expected in \[-2, 2\), got 2"),
    Bad("allsum_not_a_tensor", "AllSumReduce", "ShapeError", r"input type: expected torch.Tensor, got list"),
    Bad("allsum_device", "AllSumReduce", "ShapeError", r"device type: expected cpu on every worker, got world rank 0: "
        "meta"),
    Bad("allgather_blocks_do_not_tile", "AllGather", "ShapeError", r"do not tile.*rank 3 index \(1, 1\): \(2, 3\)"),
    # Only the sub-grid {1, 3} holds mismatched dtypes; the sub-grid {0, 2} gathers normally.
    Bad("allgather_dtypes_disagree", "AllGather", "ShapeError", r"same dtype; got rank 1: torch.float64, rank 3",
        raisers=(1, 3)),
    Bad("allgather_ndim", "AllGather", "ShapeError", r"number of tensor dimensions .*expected 2, got 3"),
    Bad("allgather_out_shape_misfit", "AllGather", "ShapeError", r"local block shape: expected \(3, 2\), got \(2, 2\)",
        raisers=(0, 1), waiters=(2, 3)),
    Bad("reducescatter_ndim", "ReduceScatter", "ShapeError", r"number of tensor dimensions .*expected 2, got 1"),
    Bad("halo_too_many_spatial_axes", "HaloExchange", "UnsupportedError",
        r"number of spatial axes.*expected <= 1, got 2"),
    Bad("halo_padding_mode", "HaloExchange", "UnsupportedError", r"padding_mode must be one of .*got 'mirror'"),
    Bad("halo_same_with_stride", "HaloExchange", "UnsupportedError",
        r"padding='same' needs stride 1.*got stride \(2,\)"),
    Bad("halo_unbalanced_blocks", "HaloExchange", "ShapeError",
        r"not the balanced decomposition .*expected local shape \(1, 1, 3\), got \(1, 1, 2\)"),
    Bad("halo_reflect_wider_than_input", "HaloExchange", "UnsupportedError",
        r"reflect padding 4 must be smaller than the global input extent 4"),
    # Rank 0's only neighbour (rank 1) waits; ranks 2 and 3 do not exchange with rank 0 and finish.
    Bad("halo_global_shape_misfit", "HaloExchange", "ShapeError", r"local spatial shape \(2,\) is not this worker's "
        r"block \(3,\)", raisers=(0,), waiters=(1,)),
    Bad("repart_partition_dims", "Repartition", "PartitionError", r"P_y.dim .*expected 2, got 1"),
    Bad("repart_not_cartesian", "Repartition", "PartitionError", r"P_x must be a CartesianPartition.*got Partition"),
    Bad("repart_unbalanced_blocks", "Repartition", "ShapeError", r"world rank 2 .*expected \(2, 3\), got \(2, 2\)"),
    Bad("repart_dtypes_disagree", "Repartition", "ShapeError", r"agree on a supported dtype.*2: 'torch.float64'"),
    Bad("repart_device", "Repartition", "ShapeError", r"device type of the input on world rank 1: expected cpu"),
    Bad("repart_functional_global_shape", "repartition", "ShapeError", r"length of global_shape .*expected 2, got 1"),
    Bad("repart_functional_local_shape", "repartition", "ShapeError",
        r"local input shape .*expected \(2, 2\), got \(2, 3\)"),
    Bad("distribute_src_out_of_range", "distribute_tensor", "PartitionError", r"expected 0 <= rank < 4, got 7"),
    Bad("distribute_ndim", "distribute_tensor", "ShapeError", r"world rank 0 .*expected 2, got 1"),
    Bad("collect_block_shape", "collect_tensor", "ShapeError", r"world rank 2 .*expected \(2, 2\), got \(2, 3\)"),
    Bad("conv_feature_channels_split", "DistributedFeatureConv1d", "PartitionError",
        r"unsplit along channels .*got \[1, 2, 2\]"),
    Bad("conv_groups", "DistributedFeatureConv1d", "ShapeError", r"groups=4, in_channels=4, out_channels=6"),
    Bad("conv_padding_mode", "DistributedFeatureConv1d", "UnsupportedError", r"padding_mode: expected .*got 'mirror'"),
    Bad("conv_kernel_size", "DistributedFeatureConv1d", "UnsupportedError",
        r"kernel_size must be a positive int.*got 0"),
    Bad("conv_negative_padding", "DistributedFeatureConv1d", "UnsupportedError", r"negative padding -1"),
    Bad("conv_stride_entries", "DistributedFeatureConv2d", "UnsupportedError", r"stride must be .*got \(1, 1, 1\)"),
    Bad("conv_input_channels", "DistributedFeatureConv1d", "ShapeError", r"input channels .*expected 4, got 3"),
    Bad("conv_dtype_vs_parameters", "DistributedFeatureConv1d", "ShapeError",
        r"parameters' dtype.*expected \['torch.float32'\], got torch.float64"),
    Bad("conv_integer_input", "DistributedFeatureConv1d", "ShapeError", r"world rank 0 passed a non-floating input"),
    Bad("conv_input_ndim", "DistributedFeatureConv1d", "ShapeError", r"input dimensions on world rank 0 .*expected 3, "
        r"got 4"),
    Bad("conv_unbalanced_blocks", "DistributedFeatureConv1d", "ShapeError",
        r"global shape \(2, 4, 21\).*expected \(2, 4, 6\), got \(2, 4, 5\)"),
    Bad("conv_reflect_wider_than_input", "DistributedFeatureConv1d", "UnsupportedError",
        r"reflect padding 4 must be smaller than the global input extent 4"),
    Bad("conv_device", "DistributedFeatureConv1d", "ShapeError", r"device type of the input on world rank 1: expected "
        r"cpu"),
    Bad("conv_data_on_inactive_rank", "DistributedFeatureConv1d", "ShapeError", r"must pass a zero-volume tensor",
        raisers=(3,)),
    Bad("conv_P_w_without_P_y", "DistributedConv1d", "PartitionError", r"P_w is given but P_y is not"),
    Bad("conv_general_partitions", "DistributedGeneralConv1d", "PartitionError",
        r"P_w.shape\[1\] == P_x.shape\[1\] \(input channels\): 1 vs 2"),
    Bad("conv_channel_groups", "DistributedChannelConv1d", "UnsupportedError", r"groups=2 with split channels"),
    Bad("conv_channel_input_channels", "DistributedChannelConv1d", "ShapeError", r"input channels .*expected 4, got 6"),
    Bad("linear_P_w_shape", "DistributedLinear", "PartitionError", r"expected \[2, 2\], got \[1, 4\]"),
    Bad("linear_features", "DistributedLinearAllGather", "PartitionError", r"in_features: expected an integer >= 1, "
        r"got 0"),
    Bad("linear_input_features", "DistributedLinearAllGather", "ShapeError", r"input feature extent .*expected 2, got "
        r"3"),
    Bad("linear_input_ndim", "DistributedLinearReduceScatter", "ShapeError", r"input dimensions .*expected 3, got 2"),
    Bad("linear_general_block", "DistributedLinear", "ShapeError", r"world rank 1 \(P_x worker 1\) passed shape "
        r"\(2, 3\)"),
    Bad("load_sequential_not_a_layer", "load_sequential", "TypeError",
        r"Linear is not a distributed distfuse layer"),
    # The source checks its state dict and broadcasts the verdict, so every rank raises the same error.
    Bad("load_sequential_shape", "DistributedFeatureConv1d.load_sequential", "ShapeError",
        r"sequential weight: expected shape \(4, 4, 3\), got \(4, 4, 5\)"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b.scenario for b in BAD])
def test_bad_input_raises_named_error(bad):
    start = time.monotonic()
    out = run_ranks(WORLD, _run_scenario, bad.scenario, pg_timeout=PG_BAD, timeout=60)
    elapsed = time.monotonic() - start
    if bad.waiters:
        discard_pool(WORLD, pg_timeout=PG_BAD)  # the waiters' collectives timed out: the world is spent
    for r, got in enumerate(out):
        if r in bad.raisers:
            assert got is not None, f"rank {r} did not raise"
            kind, msg = got
            assert kind == bad.error, (r, kind, msg)
            assert (f"{bad.op} [rank {r}]" in msg) == bad.named, (r, msg)
            assert re.search(bad.match, msg, re.S), (r, msg)
        elif r in bad.waiters:
            assert got is not None and got[0] == "CollectiveTimeoutError", (r, got)
            assert f"[rank {r}]" in got[1], (r, got)
            assert re.search(r"did not complete|within the timeout", got[1]), (r, got)
        else:
            assert got is None, (r, got)
    if not bad.waiters:  # nobody waited for a peer: no timeout was involved
        assert elapsed < PG_BAD + SLACK, elapsed
    else:
        assert elapsed < 2 * PG_BAD + SLACK, elapsed


def test_every_scenario_is_in_the_table():
    assert sorted(b.scenario for b in BAD) == sorted(_SCENARIOS)


def test_partition_world_needs_an_initialised_process_group():
    if dist.is_initialized():  # CUDA tests may run a one-rank world in the test process
        pytest.skip("this process has a process group")
    with pytest.raises(PartitionError, match="not initialised; call torch.distributed.init_process_group"):
        Partition.world()


# ---------------------------------------------------------------- DISTFUSE_DEBUG=1: mismatched calls


def _debug_mismatched_primitive():
    """ReduceScatter with a different full shape on rank 1 (gloo aborts a process on this without debug mode)."""
    R = ReduceScatter(_grid(*G4), axes_reduce_scatter=(0, 1))
    return _debug(lambda: R(torch.randn(4, 5 if _r() == 1 else 4)))


def _debug_mismatched_layer():
    """Rank 0 calls one convolution, the others another one on the same partition (a call-order bug)."""
    P = _grid(*_P_FEAT)
    a = DistributedConv1d(P, 2, 2, 3, padding=1)
    b = DistributedConv1d(P, 2, 2, 5, padding=2)
    return _debug(lambda: (a if _r() == 0 else b)(torch.randn(1, 2, 3)))


@pytest.mark.parametrize("fn,op,differs", [
    pytest.param(_debug_mismatched_primitive, "ReduceScatter", "'full shape': (4, 5)", id="primitive-ReduceScatter"),
    pytest.param(_debug_mismatched_layer, "DistributedFeatureConv1d", "kernel_size=(5,)", id="layer-FeatureConv1d"),
])
def test_debug_mode_turns_a_mismatched_call_into_an_error_on_every_rank(fn, op, differs):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(WORLD, fn, pg_timeout=PG_BAD, timeout=60)
    assert time.monotonic() - start < PG_BAD + SLACK  # an error from the agreement check, not from a timeout
    errors = info.value.errors
    assert sorted(errors) == list(ALL)
    for r, tb in errors.items():
        assert f"CollectiveMismatchError: {op} [rank {r}]: ranks entered a collective with different metadata" in tb
        assert all(f"  rank {w}: call #" in tb for w in ALL), tb  # one line per rank
        assert differs in tb, tb


# ---------------------------------------------------------------- faults on one rank


class InjectedFaultError(RuntimeError):
    pass


def _shm_names(pid: int) -> list[str]:
    """``/dev/shm`` entries that a workspace of the pool whose rank 0 has ``pid`` would own."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"distfuse-{pid}-")]


def _pid() -> int:
    return os.getpid()


def _fail(how: str, where: str):
    if how == "exit":
        os._exit(17)
    raise InjectedFaultError(f"injected fault {where} on rank {dist.get_rank()}")


def _patch(module, name: str, how: str, where: str) -> None:
    """Replace ``module.name`` in this rank with a function that fails (raises or exits)."""
    def failing(*args, **kwargs):
        _fail(how, where)

    setattr(module, name, failing)


FAULT_WORLD = 3  # every rank is a neighbour of the faulty one; three processes on two cores keep the pools quick
_LAYERS: dict = {}
_FAULT: dict = {}  # armed in the faulty rank: {"backward": "raise" | "exit"}


def _conv_layer():
    if "conv" not in _LAYERS:
        _LAYERS["conv"] = DistributedConv1d(_grid(range(3), (1, 1, 3)), 2, 3, 3, padding=1, padding_mode="circular")
    return _LAYERS["conv"]


def _linear_layer():
    if "linear" not in _LAYERS:
        _LAYERS["linear"] = DistributedLinearReduceScatter(_grid(range(3), (1, 1, 3)), 6, 6)
    return _LAYERS["linear"]


def _step(kind: str, path: str = "unfused"):
    """One training step: forward, backward, then the loss summed over the world (every rank depends on every rank)."""
    os.environ["DISTFUSE_PATH"] = path
    try:
        if kind == "conv":
            layer = _conv_layer()
            x = torch.randn(2, 2, 3, requires_grad=True)  # global spatial extent 9 over 3 workers
        else:
            layer = _linear_layer()
            x = torch.randn(2, 3, 2, requires_grad=True)  # 6 input features over 3 workers
        y = layer(x)
        if _FAULT.get("backward"):
            y.register_hook(lambda g: _fail(_FAULT["backward"], "in the backward hook"))
        y.square().sum().backward()
        loss = AllSumReduce(_grid(range(3), (3,)), axes_reduce=(0,))(y.detach().square().sum().reshape(1))
        return float(loss), getattr(layer, "last_path", None)
    finally:
        os.environ.pop("DISTFUSE_PATH", None)


def _warm(kind: str, path: str):
    """A healthy step: builds the partitions, the layer and its plans before the fault is armed."""
    _step(kind, path)
    return os.getpid()


def _faulty_step(kind: str, path: str, faulty: int, where: str, how: str):
    if dist.get_rank() == faulty:
        import distfuse.fused.halo_conv as halo_conv
        import distfuse.primitives._axes as axes
        import distfuse.primitives._axes_flagged as axes_flagged
        import distfuse.primitives.halo_exchange as halo_exchange

        if where == "halo-exchange":  # forward, inside HaloExchange, before its messages are posted
            _patch(halo_exchange, "exchange", how, "in the forward halo exchange")
        elif where == "fused-pack":  # forward, inside the fused halo conv, before its messages are posted
            _patch(halo_conv, "halo_pack", how, "in the fused halo conv's pack kernel")
        elif where == "fused-unstage":  # backward, inside the fused halo conv's adjoint
            _patch(halo_conv, "halo_unstage", how, "in the fused halo conv's unstage kernel")
        elif where == "reduce-scatter":  # forward, the linear layer's reduce-scatter collective (plain or flagged)
            _patch(axes, "reduce_scatter_flat", how, "in the reduce-scatter")
            _patch(axes_flagged, "reduce_scatter_flat", how, "in the reduce-scatter")
        elif where == "backward":
            _FAULT["backward"] = how
        else:
            raise AssertionError(where)
    return _step(kind, path)


# Each case costs a pool start and the timeout (~5 s); docs/reliability.md also lists variants measured once
# with the same functions (exit mid-forward in the halo exchange, exit mid-backward in the fused halo conv).
FAULTS = [
    pytest.param("conv", "unfused", "halo-exchange", "raise", id="conv-raise-mid-forward"),
    pytest.param("conv", "unfused", "backward", "raise", id="conv-raise-mid-backward"),
    pytest.param("conv", "fused", "fused-pack", "raise", id="fused-halo-conv-raise-mid-forward", marks=interpreted),
    pytest.param("linear", "unfused", "reduce-scatter", "exit", id="linear-exit-in-reduce-scatter"),
]


@pytest.mark.parametrize("kind,path,where,how", FAULTS)
def test_fault_on_one_rank_reaches_every_rank_in_time(kind, path, where, how):
    faulty = 1
    pids = run_ranks(FAULT_WORLD, _warm, kind, path, pg_timeout=PG_FAULT)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(FAULT_WORLD, _faulty_step, kind, path, faulty, where, how, pg_timeout=PG_FAULT, timeout=60)
    wall = time.monotonic() - start
    errors, times = info.value.errors, info.value.times
    assert sorted(errors) == list(range(FAULT_WORLD)), errors.keys()  # nothing lost: an error from every rank
    if how == "exit":
        assert errors[faulty] == f"rank {faulty} died (exit code 17) during _faulty_step"
    else:
        assert "InjectedFaultError: injected fault" in errors[faulty] and f"on rank {faulty}" in errors[faulty]
    for r in range(FAULT_WORLD):
        if r == faulty:
            continue
        tb = errors[r]
        last = tb.strip().splitlines()[-1]
        assert last.startswith("distfuse.errors.CollectiveTimeoutError: ") and f"[rank {r}]" in last, tb
        assert re.search(r"(Timed out|Connection (reset|closed)|pair closure)", last), last
        assert times[r] < PG_FAULT + SLACK, (r, times)
    assert wall < PG_FAULT + SLACK + 2.0, wall  # no deadlock: the call came back within the timeout
    again = run_ranks(FAULT_WORLD, _pid, pg_timeout=PG_FAULT)  # the pool was rebuilt and works
    assert set(again).isdisjoint(pids)
    assert not _shm_names(pids[0])


# ---------------------------------------------------------------- faults inside the symmetric-workspace GEMM ops

GEMM_WORLD = FAULT_WORLD


def _shm_mappings() -> int:
    """Mappings of distfuse ``/dev/shm`` segments in this process (unlinked segments stay mapped until closed)."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/distfuse-" in line for line in f)


def _gemm_body(op: str, faulty: int, how: str | None):
    from distfuse.fused.symmetric import get_workspace
    from distfuse.kernels.all_gather_matmul import ag_push, gathered_matmul, gathered_matmul_workspace_bytes
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter, matmul_scatter_workspace_bytes

    P = Partition.world()
    W, r = P.size, P.rank
    n, K, N = 5, 8, 6
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(1, n, K, generator=g) for _ in range(W)]  # matmul_scatter: every rank's full-length partial input
    w = [torch.randn(N, K, generator=g) for _ in range(W)]
    x = torch.randn(1, n, K, generator=g)  # ag_push: the global input, one row block per rank
    shards = [x[:, slice(*_rows(n, W, p))].contiguous() for p in range(W)]
    nbytes = max(matmul_scatter_workspace_bytes(1, n, N, W, torch.float32),
                 gathered_matmul_workspace_bytes(1, n, K, torch.float32))
    ws = get_workspace(P, nbytes)
    with ws.in_flight(op):
        if op == "matmul_reduce_scatter":
            matmul_scatter(a[r], w[r], ws, r, W)
        else:
            ag_push(shards[r], ws, r, W, n)
        if how is not None and r == faulty:
            _fail(how, f"between the {op} producer and its consumer")
        if op == "matmul_reduce_scatter":
            rows = slice(*_rows(n, W, r))
            out = torch.full((1, rows.stop - rows.start, N), float("nan"))  # poisoned: unwritten stays NaN
            y = chunk_reduce(ws, r, W, 1, n, N, partial_dtype=torch.float32, out=out)
            ref = sum(p[:, rows].double() @ v.double().t() for p, v in zip(a, w))
            terms = K * W  # each rank's partial sums K products; the chunk's W partials are added
        else:
            out = torch.full((1, n, N), float("nan"))
            y = gathered_matmul(shards[r], w[r], ws, r, W, n, out=out)
            ref = x.double() @ w[r].double().t()
            terms = K
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(y).any(), "an output element was never written"
    # fp32 GEMMs of unit-variance data against float64: the products are of size 1
    torch.testing.assert_close(y.double(), ref, **tol(torch.float32, terms=terms))
    return ws.segment_names


def _rows(n, W, r):
    start = sum(block_extent(n, W, q) for q in range(r))
    return start, start + block_extent(n, W, r)


def _gemm_step(op: str, faulty: int, how: str | None):
    """Run the op; on failure free every workspace, count what stays mapped, and report both with the error."""
    from distfuse.fused import symmetric

    try:
        names = _gemm_body(op, faulty, how)
        failure = None
    except Exception as exc:  # noqa: BLE001 - re-raised below with the clean-up report
        failure = f"{type(exc).__name__}: {exc}"
        traceback.clear_frames(exc.__traceback__)  # frames hold typed views that pin the mappings
        names = None
    if failure is None:
        return names, os.getpid()
    failure = " | ".join(line.strip() for line in failure.splitlines() if line.strip())  # one line
    symmetric.close_all()
    gc.collect()
    report = f"cleanup: cached={len(symmetric._CACHE)} mapped={_shm_mappings()}"
    raise RuntimeError(f"{failure} || {report}")


@interpreted
@pytest.mark.parametrize("op,how", [
    pytest.param("matmul_reduce_scatter", "raise", id="matmul_reduce_scatter-raise-mid-op"),
    pytest.param("all_gather_matmul", "exit", id="all_gather_matmul-exit-mid-op")])
def test_fault_mid_gemm_op_frees_workspaces_and_shm(op, how):
    faulty = 1
    warm = run_ranks(GEMM_WORLD, _gemm_step, op, faulty, None, pg_timeout=PG_FAULT)  # healthy, values checked
    pid0 = warm[0][1]
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(GEMM_WORLD, _gemm_step, op, faulty, how, pg_timeout=PG_FAULT, timeout=60)
    errors, times = info.value.errors, info.value.times
    assert sorted(errors) == list(range(GEMM_WORLD))
    for r, tb in errors.items():
        if r == faulty and how == "exit":
            assert tb == f"rank {faulty} died (exit code 17) during _gemm_step"
            continue
        last = tb.strip().splitlines()[-1]
        assert last.endswith("cleanup: cached=0 mapped=0"), last  # every workspace freed, nothing left mapped
        if r == faulty:
            assert "InjectedFaultError: injected fault between" in last, last
        else:
            assert "CollectiveTimeoutError" in last and f"[rank {r}]" in last and "workspace barrier" in last, last
            assert times[r] < PG_FAULT + SLACK + 2.0, times  # interpreted kernels run before the barrier
    assert time.monotonic() - start < PG_FAULT + SLACK + 4.0
    assert not _shm_names(pid0)  # set-up unlinked every segment; nothing in /dev/shm after the fault
    assert all(not os.path.exists(os.path.join("/dev/shm", n)) for names, _ in warm for n in names)
