"""Block tensors <-> DTensor on uneven extents, checked against the global tensor.

The reference is built without the code under test: the global tensor is cut into
distfuse blocks with ``local_slices`` (balanced) and into DTensor shards with
``torch.chunk`` (the rule DTensor documents for uneven shards), and ``full_tensor()``
assembles a DTensor through DTensor's own collectives.  The conversions only move
elements, so values must be bit-exact (``torch.equal``), in every dtype.  Gradients
flow through both conversions; their values are again exact moves of the upstream
gradient.
"""

from dataclasses import dataclass

import pytest
import torch

from distfuse import PartitionError, ShapeError, UnsupportedError, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.interop.dtensor import from_dtensor, to_dtensor
from distfuse.testing import run_ranks
from tests.test_conv_support import grid


@dataclass(frozen=True)
class Case:
    id: str
    world: int
    src: tuple  # (world ranks, shape) of the partition the blocks start on
    dst: tuple  # ... of the partition from_dtensor returns to
    shape: tuple
    dtype: torch.dtype = torch.float64


CASES = [
    Case("10-over-4-is-3332-vs-3322", 4, (range(4), (4, 1)), ((3, 2, 1, 0), (2, 2)), (10, 3)),
    Case("1x3-7-is-331-vs-322-to-3x1", 4, (range(3), (1, 3)), ((1, 2, 3), (3, 1)), (4, 7)),
    Case("permuted-4-over-3-inactive-bf16", 4, ((3, 1, 0), (3, 1)), ((2, 0), (1, 2)), (4, 5), torch.bfloat16),
    Case("1d-5-over-4-empty-shard-fp16", 4, (range(4), (4,)), ((0, 2), (2,)), (5,), torch.float16),
    Case("2x4-10-over-4-8w", 8, (range(8), (2, 4)), ((7, 6, 5, 4, 3, 2), (3, 2)), (5, 10), torch.float32),
    Case("world1", 1, ((0,), (1, 1)), ((0,), (1, 1)), (3, 2)),
]


def _global(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _block(g, P):
    return g[local_slices(g.shape, P.shape, P.index)]


def _chunk_reference(g, mesh, placements):
    """This rank's DTensor shard by torch.chunk (mesh dimensions applied left to right)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    local = g
    for k, p in enumerate(placements):
        if p.is_shard():
            chunks = torch.chunk(local, mesh.size(k), dim=p.dim)
            c = coord[k]
            local = chunks[c] if c < len(chunks) else local.narrow(p.dim, local.shape[p.dim], 0)
    return local


def _run_case(case, seed):
    bad = []
    P, Q = grid(*case.src), grid(*case.dst)
    g = _global(case.shape, seed, case.dtype)
    # Forward, metadata gathered (a placeholder of another dtype on ranks outside P).
    x = _block(g, P).clone().requires_grad_(True) if P.active else zero_volume_tensor(dtype=torch.float32)
    dt = to_dtensor(x, P)
    if dt.dtype != case.dtype or tuple(dt.shape) != case.shape:
        bad.append(f"DTensor {dt.dtype} {tuple(dt.shape)}")
    want_local = _chunk_reference(g, dt.device_mesh, dt.placements)
    if want_local is not None and not torch.equal(dt.to_local(), want_local):
        bad.append(f"local shard {tuple(dt.to_local().shape)} is not torch.chunk's {tuple(want_local.shape)}")
    full = dt.full_tensor()
    in_mesh = dt.device_mesh.get_coordinate() is not None
    if in_mesh and not torch.equal(full, g):
        bad.append("full_tensor differs from the global tensor")
    # Gradient through to_dtensor: d(sum(full * w))/dx is w's block.
    w = _global(case.shape, seed + 1, case.dtype)
    if in_mesh:  # a rank outside the mesh cannot differentiate through DTensor (see distfuse.interop.dtensor)
        (full * w).sum().backward()
    if P.active and not torch.equal(x.grad, _block(w, P)):
        bad.append("to_dtensor gradient")
    # With global_shape given: no metadata gather, the same DTensor.
    x2 = _block(g, P) if P.active else zero_volume_tensor(dtype=case.dtype)
    dt2 = to_dtensor(x2, P, case.shape)
    if in_mesh and not torch.equal(dt2.to_local(), want_local):
        bad.append("global_shape= form")
    # Back to blocks on another partition, with gradients into the DTensor.
    src = dt.detach().requires_grad_(True)
    y = from_dtensor(src, Q)
    if Q.active and not torch.equal(y, _block(g, Q)):
        bad.append(f"from_dtensor block on Q {Q.index}")
    if not Q.active and y.numel() != 0:
        bad.append("from_dtensor outside Q is not zero-volume")
    dy = _block(w, Q) if Q.active else torch.zeros_like(y)
    y.backward(dy)
    if in_mesh and not torch.equal(src.grad.to_local(), _chunk_reference(w, dt.device_mesh, dt.placements)):
        bad.append("from_dtensor gradient")
    return bad


def _run_cases(cases):
    return {c.id: _run_case(c, seed=300 + k) for k, c in enumerate(cases)}


@pytest.fixture(scope="module")
def world_results():
    cache = {}

    def get(world):
        if world not in cache:
            try:
                cache[world] = run_ranks(world, _run_cases, [c for c in CASES if c.world == world])
            except Exception as exc:  # every case of this world size reports the same failure
                cache[world] = exc
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_round_trip_values_and_gradients(case, world_results):
    failures = {r: out[case.id] for r, out in enumerate(world_results(case.world)) if out[case.id]}
    assert not failures, failures


def _torch_made_dtensors():
    """DTensors torch distributed itself (nested shards, a replicated mesh dimension) into distfuse blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    bad = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    g = _global((7, 5), 11, torch.float64)
    w = _global((7, 5), 12, torch.float64)
    Q = grid((3, 0, 2), (1, 3))
    for placements in ([Shard(0), Shard(0)], [Shard(1), Shard(0)], [Replicate(), Shard(1)]):
        dt = distribute_tensor(g, mesh, placements).requires_grad_(True)
        y = from_dtensor(dt, Q)
        if Q.active and not torch.equal(y, _block(g, Q)):
            bad.append(f"{placements}: block")
        y.backward(_block(w, Q) if Q.active else torch.zeros_like(y))
        # Replicas of a box each receive the whole gradient of that box (DTensor's Replicate gradient).
        if not torch.equal(dt.grad.full_tensor(), w) or not torch.equal(dt.grad.to_local(),
                                                                     _chunk_reference(w, mesh, placements)):
            bad.append(f"{placements}: gradient")
    errors = {}
    try:
        from_dtensor(_partial(g, mesh), Q)
    except UnsupportedError as exc:
        errors["partial"] = "Partial" in str(exc)
    try:
        from_dtensor(distribute_tensor(g, mesh, [Shard(0), Shard(1)]), grid((0, 1, 2, 3), (4,)))
    except ShapeError as exc:
        errors["dims"] = "dimensions" in str(exc)
    P = grid((0, 1, 2, 3), (4, 1))
    x = torch.zeros(1 if P.index[0] == 0 else 2, 5, dtype=torch.float64)  # 1,2,2,2 is no balanced split of 7
    try:
        to_dtensor(x, P)
    except ShapeError as exc:
        errors["block"] = "balanced decomposition" in str(exc)
    try:
        to_dtensor(torch.zeros(3), grid((0, 1, 2, 3), (4,)), global_shape=(3, 1))
    except ShapeError:
        errors["global_shape"] = True
    try:
        to_dtensor(torch.zeros(3), "P")
    except PartitionError:
        errors["partition"] = True
    return bad, errors


def _partial(g, mesh):
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(g[:4] / 2 if mesh.get_coordinate()[1] == 0 else g[4:] / 2, mesh,
                              [Partial(), Shard(0)], run_check=False)


def test_torch_made_dtensors_and_errors_on_every_rank():
    for bad, errors in run_ranks(4, _torch_made_dtensors):
        assert not bad, bad
        assert errors == {"partial": True, "dims": True, "block": True, "global_shape": True, "partition": True}
