"""Block tensors <-> DTensor.

A distfuse tensor is one balanced block per worker of a CartesianPartition ``P`` (partition
dimension ``d`` splits tensor dimension ``d``); a DTensor is one local shard per rank of a
DeviceMesh with one placement per mesh dimension.  They split an uneven extent differently, so
the conversions move the elements that change hands in one point-to-point round
(:mod:`distfuse.interop._box_move`); even splits move nothing across ranks.

Shapes (``G`` the global shape, ``B(P, i)`` the balanced block of worker ``i``,
``C(mesh, c)`` the DTensor shard at mesh coordinate ``c``)::

    to_dtensor     x  B(P, i) on worker i of P            ->  DTensor(G) with local C(M, c)
                   M = device_mesh_of(canonical_partition(P)),
                   placements Shard(d) where P.shape[d] > 1, else Replicate()
    from_dtensor   dt DTensor(G) on any mesh, Shard / Replicate placements  ->  B(P, i)

Both are differentiable: the adjoint of each is the other's data movement
(``from_local``/``to_local`` carry the gradient in and out of DTensor).  Every rank of ``P``
and of the mesh must call backward when one does; ranks outside both must not differentiate
through their empty DTensor (torch 2.13's ``full_tensor`` backward fails on a rank outside
the mesh: its local tensor has one dimension, the global shape more).

A partition listed out of rank order has no mesh of its own (:mod:`distfuse.interop.device_mesh`):
:func:`to_dtensor` uses the mesh of the same ranks in increasing order, and the move places
the blocks.  A layer's parameters and buffers (a :class:`~distfuse.layers._params.ParamLayout`,
possibly with copies, ``split_dims``) convert with :func:`param_to_dtensor` /
:func:`param_from_dtensor`: split partition dimensions become ``Shard``, copying ones ``Replicate``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.groups import metadata_group
from distfuse.interop._box_move import BoxLayout, balanced_layout, move, param_layout
from distfuse.interop.device_mesh import _my_view, canonical_partition, device_mesh_of
from distfuse.partition import CartesianPartition, zero_volume_tensor
from distfuse.primitives._axes import check_cartesian
from distfuse.primitives._common import summed_extents

__all__ = ["to_dtensor", "from_dtensor", "empty_dtensor", "dtensor_layout", "placements_of", "param_to_dtensor",
           "param_from_dtensor", "empty_param_dtensor"]


def placements_of(P: CartesianPartition) -> list:
    """DTensor placements of ``P``'s blocks: ``Shard(d)`` where ``P`` splits dimension ``d``, else ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) if p > 1 else Replicate() for d, p in enumerate(P.shape)]


def _check_placements(op: str, placements, ndim: int, mesh_ndim: int) -> list:
    """Normalise Shard dims; refuse what has no box layout (Partial and the private placements)."""
    from torch.distributed.tensor import Replicate, Shard

    if len(placements) != mesh_ndim:
        raise expect(op, "number of placements (one per mesh dimension)", mesh_ndim, len(placements), PartitionError)
    out = []
    for p in placements:
        if type(p) is Shard:
            if not -ndim <= p.dim < ndim:
                raise ShapeError(f"{where(op)}: placement {p} names a dimension of a {ndim}-D tensor that is missing")
            out.append(Shard(p.dim % ndim))
        elif type(p) is Replicate:
            out.append(p)
        else:
            raise UnsupportedError(f"{where(op)}: placement {p} is not supported; only Shard and Replicate "
                                   "describe whole boxes (redistribute a Partial DTensor to Replicate or Shard "
                                   "first)")
    return out


def dtensor_layout(mesh_ranks: Sequence[int], mesh_shape: Sequence[int], placements,
                   global_shape: Sequence[int]) -> BoxLayout:
    """The boxes of a DTensor: which world rank holds which shard, and which replica is primary.

    Mesh dimensions are applied left to right, as DTensor does: a ``Shard(t)`` splits the
    current extent of tensor dimension ``t`` by ``torch.chunk``'s rule
    (``Shard.local_shard_size_and_offset``).  The primary of a replicated box is the
    holder at coordinate 0 along every ``Replicate`` mesh dimension.
    """
    from torch.distributed.tensor import Replicate, Shard

    G = tuple(int(n) for n in global_shape)
    shape = tuple(int(s) for s in mesh_shape)
    holders = []
    for flat, coord in enumerate(itertools.product(*(range(s) for s in shape))):
        lo, size = [0] * len(G), list(G)
        for k, p in enumerate(placements):
            if type(p) is Shard:
                n, off = Shard.local_shard_size_and_offset(size[p.dim], shape[k], coord[k])
                lo[p.dim] += int(off) if n > 0 else 0
                size[p.dim] = int(n)
        primary = all(c == 0 for c, p in zip(coord, placements, strict=True) if type(p) is Replicate)
        box = tuple((a, a + s) for a, s in zip(lo, size, strict=True))
        holders.append((int(mesh_ranks[flat]), box, primary))
    return BoxLayout(G, tuple(holders))


def _outside_shape(G: Sequence[int]) -> tuple[int, ...]:
    """The empty local tensor of a rank outside the mesh: the global number of dimensions, which DTensor's
    backward needs there; ``[0]`` for a 0-d tensor (DTensor's own convention), which has no empty shape."""
    return (0,) * len(G) if len(G) else (0,)


def _gather_blocks(op: str, P: CartesianPartition, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """Every rank's ``(shape, dtype, requires_grad)``; checked alike everywhere; the global shape."""
    mine = (tuple(x.shape), str(x.dtype).replace("torch.", ""), bool(x.requires_grad and torch.is_grad_enabled()),
            x.device.type)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine, group=metadata_group())
    for w, (shape, _, _, dev) in enumerate(rows):
        if w not in P.ranks and math.prod(shape) != 0:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P, so it must pass a zero-volume tensor; got "
                             f"shape {shape}")
        if w in P.ranks and dev != P.device.type:
            raise expect(op, f"device type of the block on world rank {w}", P.device.type, dev)
    blocks = [rows[w] for w in P.ranks]
    for r, (shape, _, _, _) in enumerate(blocks):
        if len(shape) != P.dim:
            raise expect(op, f"dimensions of the block on world rank {P.ranks[r]} (one per partition dimension)",
                         P.dim, len(shape))
    dtypes = {d for _, d, _, _ in blocks}
    if len(dtypes) != 1:
        raise ShapeError(f"{where(op)}: the workers of P must agree on the dtype; got "
                         f"{ {P.ranks[r]: d for r, (_, d, _, _) in enumerate(blocks)} } (world rank: dtype)")
    G = summed_extents(P, [shape for shape, *_ in blocks])
    for r, (shape, _, _, _) in enumerate(blocks):
        want = local_shape(G, P.shape, P.index_of(r))
        if shape != want:
            raise expect(op, f"block on world rank {P.ranks[r]} (P index {P.index_of(r)}; the blocks must be the "
                         f"balanced decomposition of the global shape {G} they imply)", want, shape)
    return G, getattr(torch, dtypes.pop()), any(g for _, _, g, _ in rows)


def to_dtensor(x: torch.Tensor, P: CartesianPartition, global_shape: Sequence[int] | None = None, *,
               dtype: torch.dtype | None = None, mesh_dim_names: Sequence[str] | None = None):
    """The DTensor whose global value is the tensor of blocks ``x`` on ``P``.

    Args:
        x: this worker's balanced block on ``P``; a zero-volume tensor elsewhere.
        P: the CartesianPartition the blocks live on.
        global_shape: skip the metadata gather (then every rank must pass the same one,
            and ranks outside ``P`` take ``dtype``, default their placeholder's dtype).
        mesh_dim_names: names of the mesh dimensions (default ``dim0, dim1, ...``).

    Returns the DTensor of the module docstring's table on every world rank (ranks outside
    the mesh hold an empty local tensor, as DTensor's own non-members do).

    Without ``global_shape`` it is collective over the world: one object all-gather, after
    which every rank knows the global shape, dtype and grad flag and has checked every block
    (a bad block raises the same :class:`~distfuse.errors.ShapeError` everywhere); with it the
    checks are local.  The first call for a partition creates the mesh's groups (collective).
    """
    op = "to_dtensor"
    check_cartesian(op, P)
    if global_shape is None:
        G, dtype, needs_grad = _gather_blocks(op, P, x)
        if needs_grad and P.active and not x.requires_grad:
            x = x.detach().requires_grad_(True)  # every holder runs the adjoint, or its peers wait for it
    else:
        G = tuple(int(n) for n in global_shape)
        if len(G) != P.dim:
            raise expect(op, "length of global_shape (one entry per partition dimension)", P.dim, len(G))
        dtype = dtype if dtype is not None else x.dtype
        if P.active and tuple(x.shape) != local_shape(G, P.shape, P.index):
            raise expect(op, f"block shape (P index {P.index} of global shape {G})", local_shape(G, P.shape, P.index),
                         tuple(x.shape))
        if P.active and x.dtype != dtype:
            raise expect(op, "dtype of the block", dtype, x.dtype)
    Pc = canonical_partition(P)
    return _into_dtensor(x, balanced_layout(P, G), Pc, placements_of(Pc), G, dtype, P.device, op, mesh_dim_names)


def _into_dtensor(x, src: BoxLayout, Pc: CartesianPartition, placements, G, dtype, device, op: str,
                  mesh_dim_names=None):
    """Move ``x`` from ``src`` into the DTensor layout of ``placements`` on ``Pc``'s mesh and wrap it."""
    mesh = device_mesh_of(Pc, mesh_dim_names)
    dst = dtensor_layout(Pc.ranks, Pc.shape, placements, G)
    local = move(x, src, dst, dtype, device, op=op)
    if dst.box_of(dist.get_rank()) is None:
        local = local.reshape(_outside_shape(G))
    return _wrap(local, mesh, placements, G)


def from_dtensor(dt, P: CartesianPartition) -> torch.Tensor:
    """This worker's balanced block on ``P`` of the DTensor ``dt`` (zero-volume on ranks outside ``P``).

    ``dt`` may live on any mesh (sliced or not) with ``Shard`` and ``Replicate``
    placements; a ``Partial`` one must be redistributed first
    (:class:`~distfuse.errors.UnsupportedError` on every rank).  ``P`` needs as many
    dimensions as ``dt``.  Collective over the ranks of ``P`` and of ``dt``'s mesh; no metadata
    exchange (the DTensor knows its global shape).
    """
    op = "from_dtensor"
    check_cartesian(op, P)
    G = tuple(int(n) for n in dt.shape)
    if len(G) != P.dim:
        raise expect(op, "tensor dimensions of the DTensor (one per partition dimension)", P.dim, len(G), ShapeError)
    mesh = dt.device_mesh
    placements = _check_placements(op, dt.placements, len(G), mesh.ndim)
    if mesh.device_type != P.device.type:
        raise expect(op, "device type of the DTensor's mesh", P.device.type, mesh.device_type)
    return _out_of_dtensor(dt, placements, balanced_layout(P, G), P, op)


def _out_of_dtensor(dt, placements, dst: BoxLayout, P: CartesianPartition, op: str) -> torch.Tensor:
    """Move ``dt``'s shards into the boxes of ``dst`` (holders of ``dst`` are the workers of ``P``)."""
    G = dst.global_shape
    view = _my_view(dt.device_mesh)
    if view is None:
        if P.active:
            raise PartitionError(f"{where(op)}: this rank is in P but cannot read the DTensor's mesh (a slice of a "
                                 "mesh that does not contain it); pass a DTensor on a mesh every rank of P belongs to")
        return zero_volume_tensor(dtype=dt.dtype, device=P.device)
    src = dtensor_layout(*view, placements, G)
    if src.box_of(dist.get_rank()) is not None:
        local = dt.to_local()
    else:  # outside the mesh: torch 2.13 cannot differentiate to_local() here; a placeholder carries the adjoint
        local = torch.empty((0,), dtype=dt.dtype, device=P.device).requires_grad_(
            dt.requires_grad and torch.is_grad_enabled())
    y = move(local, src, dst, dt.dtype, P.device, op=op)
    return y if P.active else y.reshape(0)


def empty_dtensor(P: CartesianPartition, global_shape: Sequence[int], dtype: torch.dtype):
    """A DTensor of ``global_shape`` laid out as :func:`to_dtensor` lays out ``P``'s blocks, values unset.

    A destination to read into (``torch.distributed.checkpoint.load`` fills its local
    shards in place), then :func:`from_dtensor` gives the blocks.  No data moves; the
    first call for a partition creates its mesh (collective over the world for n-D).
    """
    check_cartesian("empty_dtensor", P)
    Pc = canonical_partition(P)
    return _empty(Pc, placements_of(Pc), global_shape, dtype, P.device)


def _empty(Pc: CartesianPartition, placements, global_shape: Sequence[int], dtype: torch.dtype, device):
    """A DTensor of ``global_shape`` with ``placements`` on ``Pc``'s mesh, values unset."""
    G = tuple(int(n) for n in global_shape)
    mesh = device_mesh_of(Pc)
    box = dtensor_layout(Pc.ranks, Pc.shape, placements, G).box_of(dist.get_rank())
    shape = tuple(hi - lo for lo, hi in box) if box is not None else _outside_shape(G)
    return _wrap(torch.empty(shape, dtype=dtype, device=device), mesh, placements, G)


def _wrap(local: torch.Tensor, mesh, placements, G: tuple[int, ...]):
    """The DTensor of global shape ``G`` (contiguous) whose local shard here is ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(G),
                              stride=torch.empty(G, device="meta").stride())  # contiguous


# ---------------------------------------------------------------- a layer's parameters (ParamLayout)


def param_placements(lay, Pc: CartesianPartition) -> list:
    """DTensor placements of a ParamLayout's blocks on the mesh of ``Pc`` (``lay.P`` in increasing rank order)."""
    from torch.distributed.tensor import Replicate, Shard

    split = getattr(lay, "split_dims", None)
    if split is None:
        return placements_of(Pc)
    return [Shard(split.index(d)) if d in split and p > 1 else Replicate() for d, p in enumerate(Pc.shape)]


def param_to_dtensor(block: torch.Tensor, lay, dtype: torch.dtype):
    """The DTensor of a layer's parameter (or buffer) described by ``lay`` (a ParamLayout), from this rank's block.

    Workers of ``lay.P`` pass their block (every copy, for a layout with ``split_dims``);
    the others a zero-volume tensor.  No metadata exchange (the layout gives the global
    shape); the first call for a partition creates its mesh (collective over the world
    for n-D partitions).
    """
    G = tuple(int(n) for n in lay.global_shape)
    Pc = canonical_partition(lay.P)
    return _into_dtensor(block, param_layout(lay), Pc, param_placements(lay, Pc), G, dtype, lay.P.device,
                         "param_to_dtensor")


def empty_param_dtensor(lay, dtype: torch.dtype):
    """A DTensor laid out as :func:`param_to_dtensor` lays out ``lay``'s tensor, values unset (a load target)."""
    Pc = canonical_partition(lay.P)
    return _empty(Pc, param_placements(lay, Pc), lay.global_shape, dtype, lay.P.device)


def param_from_dtensor(dt, lay) -> torch.Tensor:
    """This rank's block of ``lay``'s tensor from the DTensor ``dt`` (zero-volume outside ``lay.P``)."""
    op = "param_from_dtensor"
    G = tuple(int(n) for n in lay.global_shape)
    # A 0-d DTensor reads as shape (0,) outside its mesh (torch infers it from the empty local
    # tensor there, an empty torch.Size counting as no shape given): check where it is held.
    if dt.device_mesh.get_coordinate() is not None and tuple(dt.shape) != G:
        raise expect(op, "global shape of the DTensor", G, tuple(dt.shape))
    placements = _check_placements(op, dt.placements, len(G), dt.device_mesh.ndim)
    return _out_of_dtensor(dt, placements, param_layout(lay), lay.P, op)
