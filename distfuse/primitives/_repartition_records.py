"""Repartition's checks and per-call metadata: the records every worker gathers and validates alike.

:class:`~distfuse.primitives.repartition.Repartition` learns the global shape, the dtype
and whether any input requires grad from one record per worker of ``P_x ∪ P_y``
(``[ndim, dtype code, requires_grad, problem, shape...]``, ``4 + 8`` int64 all-gathered on
the union's host gloo group; see that module's docstring for when it runs).  Every worker
validates every record with :func:`_resolve`, so a bad block raises the same error on all
of them.  The functional form's local checks (:func:`_check_local`), the zero-volume
outputs of idle workers and the cached union partitions live here too.
"""

from __future__ import annotations

import math

import torch

from distfuse._compat import all_gather_flat
from distfuse.errors import PartitionError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.partition import CartesianPartition, Partition, union_partition
from distfuse.primitives._common import collective_guard

# Record layout of the per-call metadata gather: [ndim, dtype code, requires_grad, problem, shape...].
_MAX_DIM = 8
_HEAD = 4
_OK, _BAD_DEVICE, _TOO_MANY_DIMS = 0, 1, 2
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]

# Union partitions for the functional form's debug check, keyed by the two partitions.
_UNIONS: dict[tuple, Partition] = {}


def _check_partitions(op: str, P_x, P_y) -> None:
    for name, P in (("P_x", P_x), ("P_y", P_y)):
        if not isinstance(P, CartesianPartition):
            raise PartitionError(f"{where(op)}: {name} must be a CartesianPartition (one partition dimension per "
                                 f"tensor dimension), got {type(P).__name__}")
    if P_x.dim != P_y.dim:
        raise expect(op, "P_y.dim (partition dimensions must match one to one)", P_x.dim, P_y.dim, PartitionError)


def _idle_output(x: torch.Tensor, P_x, preserve_batch: bool, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the zero-volume output of a union worker that is not in ``P_y``.

    In ``P_x``: ``[b, 0]`` with the input's first extent (DistDL's ``preserve_batch``).
    In neither (a helper's extra union worker): the input's own zero-volume shape.
    """
    if not preserve_batch:
        return (0,), dtype
    if not P_x.active:
        return tuple(x.shape), dtype
    return ((int(x.shape[0]), 0) if x.dim() > 0 else (0,)), dtype


def _outside(op: str, x: torch.Tensor, preserve_batch: bool) -> torch.Tensor:
    """A worker in neither partition: no communication; a clone of its zero-volume input."""
    if x.numel() != 0:
        raise ShapeError(f"{where(op)}: this rank is in neither P_x nor P_y, so it must pass a zero-volume "
                         f"tensor; got shape {tuple(x.shape)}")
    return x.clone() if preserve_batch else x.reshape(0)


def _gather_records(P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                    op: str = "Repartition") -> list[tuple]:
    """Every union worker's ``(shape, dtype, requires_grad, problem)`` in union order; host-side gloo."""
    rec = torch.full((_HEAD + _MAX_DIM,), -1, dtype=torch.int64)
    problem = _OK
    if P_x.active and x.device.type != P_x.device.type:
        problem = _BAD_DEVICE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
    rec[0] = min(x.dim(), _MAX_DIM)
    rec[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    rec[2] = int(x.requires_grad and torch.is_grad_enabled())
    rec[3] = problem
    if problem == _OK and x.dim() > 0:
        rec[_HEAD:_HEAD + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    out = torch.empty(P_union.size * rec.numel(), dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P_union.ranks):
        all_gather_flat(out, rec, group=P_union.meta_group)
    rows = out.view(P_union.size, rec.numel()).tolist()
    return [(tuple(r[_HEAD:_HEAD + r[0]]), _DTYPES[r[1]] if r[1] >= 0 else None, bool(r[2]), r[3]) for r in rows]


def _resolve(op: str, P_union: Partition, P_x: CartesianPartition, records: list[tuple]):
    """Validate every record identically on every worker; return ``(global shape, dtype, any requires_grad)``."""
    pos = {w: k for k, w in enumerate(P_union.ranks)}
    in_x = set(P_x.ranks)
    for w, (shape, _, _, problem) in zip(P_union.ranks, records, strict=True):
        if problem == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_x.device.type, "another device")
        if problem == _TOO_MANY_DIMS:
            raise ShapeError(f"{where(op)}: world rank {w} passed a tensor of more than {_MAX_DIM} dimensions")
        if w not in in_x and math.prod(shape) != 0:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor; "
                             f"got shape {shape}")
    x_recs = [records[pos[w]] for w in P_x.ranks]  # in P_x partition order
    for r, (shape, _, _, _) in enumerate(x_recs):
        if len(shape) != P_x.dim:
            raise expect(op, f"number of tensor dimensions on world rank {P_x.ranks[r]} (one per partition "
                         "dimension)", P_x.dim, len(shape))
    dtypes = {d for _, d, _, _ in x_recs}
    if len(dtypes) != 1 or None in dtypes:
        raise ShapeError(f"{where(op)}: the workers of P_x must agree on a supported dtype; got "
                         f"{ {P_x.ranks[r]: str(d) for r, (_, d, _, _) in enumerate(x_recs)} } (world rank: dtype)")
    # G[d] = extents along d of the blocks on the axis through index 0; then every block must fit G.
    G = tuple(sum(x_recs[P_x.rank_of([k if e == d else 0 for e in range(P_x.dim)])][0][d]
                  for k in range(P_x.shape[d])) for d in range(P_x.dim))
    for r, (shape, _, _, _) in enumerate(x_recs):
        want = local_shape(G, P_x.shape, P_x.index_of(r))
        if shape != want:
            raise expect(op, f"local input shape on world rank {P_x.ranks[r]} (P_x index {P_x.index_of(r)}; the "
                         f"blocks must be the balanced decomposition of the global shape {G} inferred from them)",
                         want, shape)
    return G, dtypes.pop(), any(rg for _, _, rg, _ in records)


def _check_local(op: str, P_x: CartesianPartition, x: torch.Tensor, global_shape: tuple[int, ...]) -> None:
    """Local checks of the functional form (no communication)."""
    if len(global_shape) != P_x.dim:
        raise expect(op, "length of global_shape (one entry per partition dimension)", P_x.dim, len(global_shape))
    if not P_x.active:
        if x.numel() != 0:
            raise ShapeError(f"{where(op)}: this rank is not in P_x, so it must pass a zero-volume tensor; got "
                             f"shape {tuple(x.shape)}")
        return
    if x.dim() != P_x.dim:
        raise expect(op, "number of tensor dimensions (one per partition dimension)", P_x.dim, x.dim())
    if x.device.type != P_x.device.type:
        raise expect(op, "device type", P_x.device.type, x.device.type)
    want = local_shape(global_shape, P_x.shape, P_x.index)
    if tuple(x.shape) != want:
        raise expect(op, f"local input shape (P_x index {P_x.index} of global shape {global_shape})", want,
                     tuple(x.shape))


def _union_of(P_x: CartesianPartition, P_y: CartesianPartition) -> Partition:
    key = (P_x.ranks, P_x.shape, P_y.ranks, P_y.shape)
    if key not in _UNIONS:
        _UNIONS[key] = union_partition(P_x, P_y)
    return _UNIONS[key]
