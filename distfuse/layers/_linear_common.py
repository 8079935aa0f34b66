"""Pieces shared by the distributed linear layers: partitions, parameters (blocks, broadcast, ZeRO gather), init.

Grid vocabulary.  The all-gather and reduce-scatter linears run on a grid whose first
dimension holds the data-parallel workers (``P_d``) and one later dimension the
model-parallel workers (``P_m``); worker ``(d, m)`` is partition rank ``d * P_m + m``.
Parameters are split over the model-parallel workers; the plain layers keep each block on
the ``d = 0`` worker and broadcast it along ``d`` in forward (the adjoint sum-reduces the
gradients back), the ``Zero`` layers shard it over ``d`` as well and all-gather it.

* The blocks, their registration and torch-equal draw: :class:`~distfuse.layers._params.WeightAndBias`;
  blocks that travel along one plan (weight and bias from ``(0, m)`` to ``(d, m)``) are
  packed into one message (:class:`LinearParams`): one latency-bound round instead of two.
* Under ``torch.is_grad_enabled()`` every worker passes the op pair's anchor
  (:func:`~distfuse.primitives._op_pair.anchor`): a receive-only worker cannot know whether
  its source's tensor requires grad, and a gradient sent to a source that never runs its
  backward waits until the timeout.  It costs one unneeded gradient message for frozen
  parameters or a first layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import PartitionError, expect, where
from distfuse.layers._params import WeightAndBias
from distfuse.layers.dispatch import Decision, DryExplain, device_caps, select_path
from distfuse.partition import CartesianPartition
from distfuse.primitives._axes import balanced_layout
from distfuse.primitives._gather_scatter import BlockCollective, all_gather_op
from distfuse.primitives._op_pair import anchor
from distfuse.primitives.broadcast import NO_FLAG, broadcast_blocks, broadcast_plan, move_of, placeholder

__all__ = ["INACTIVE", "LinearBase", "ParamBroadcast", "LinearParams", "check_cartesian", "check_row_partitions",
           "check_block_features", "decide", "not_servable"]


def check_cartesian(op: str, name: str, P, min_dim: int = 1) -> None:
    if not isinstance(P, CartesianPartition):
        raise expect(op, f"type of {name}", "CartesianPartition", type(P).__name__, cls=PartitionError)
    if len(P.ranks) != P.size:
        raise PartitionError(f"{where(op)}: {name} must be a partition every world rank holds (made with "
                             "create_partition_inclusive + create_cartesian_topology_partition), not a sub-grid "
                             "placeholder")
    if P.dim < min_dim:
        raise expect(op, f"number of dimensions of {name}", f">= {min_dim}", P.dim, cls=PartitionError)


def check_row_partitions(op: str, P_feat, feat: str, P_seq, seq: str, swapped_hint: bool = False) -> None:
    """A row linear's partitions: ``P_feat`` ``[P_d, 1, ..., 1, P_m]`` (the features split), and the optional
    ``P_seq`` ``[P_d, 1, ..., P_m, 1]`` (the sequence split) on the same ranks; named ``feat`` / ``seq``."""
    check_cartesian(op, feat, P_feat, min_dim=2)
    if any(s != 1 for s in P_feat.shape[1:-1]):
        want = [P_feat.shape[0]] + [1] * (P_feat.dim - 2) + [P_feat.shape[-1]]
        err = expect(op, f"shape of {feat} ([P_d, 1, ..., 1, P_m]: only the first and last dimensions split)", want,
                     list(P_feat.shape), cls=PartitionError)
        if swapped_hint and P_seq is not None and _looks_swapped(P_feat, P_seq):
            err = PartitionError(f"{err}; {feat} and {seq} look swapped: the first argument is the output "
                                 f"partition [P_d, 1, ..., P_m] and {seq} the sequence-split input partition "
                                 "[P_d, 1, ..., P_m, 1]")
        raise err
    if P_seq is None:
        return
    check_cartesian(op, seq, P_seq, min_dim=3)
    want = [P_feat.shape[0]] + [1] * (P_feat.dim - 3) + [P_feat.shape[-1], 1]
    if list(P_seq.shape) != want:
        raise expect(op, f"shape of {seq} ([P_d, 1, ..., P_m, 1] for {feat} {list(P_feat.shape)}: {seq} splits the "
                         f"sequence dim where {feat} splits the features)", want, list(P_seq.shape), cls=PartitionError)
    # Worker (d, m) must be the same process in both partitions; the message names P_x first.
    (a, P_a), (b, P_b) = sorted([(feat, P_feat), (seq, P_seq)], key=lambda named: named[0])
    if tuple(P_a.ranks) != tuple(P_b.ranks):
        raise PartitionError(
            f"{where(op)}: {a} and {b} must list the same world ranks in the same order, so that worker (d, m) is "
            f"one process in both; got {a} ranks {list(P_a.ranks)} and {b} ranks {list(P_b.ranks)}")


def _looks_swapped(P_feat, P_seq) -> bool:
    """``P_feat`` shaped like a sequence split and ``P_seq`` like a feature split (the other way round)."""
    sy, sx = list(getattr(P_feat, "shape", ())), list(getattr(P_seq, "shape", ()))
    return (len(sy) == len(sx) >= 3 and sy[-1] == 1 and all(s == 1 for s in sy[1:-2] + sx[1:-1])
            and sy[0] == sx[0] and sy[-2] == sx[-1])


def check_block_features(op: str, x: torch.Tensor, P, expected: int, what: str) -> None:
    """An active worker's input: one dimension per partition dimension, the expected last extent, the device."""
    if not isinstance(x, torch.Tensor):
        raise expect(op, "input type", "torch.Tensor", type(x).__name__)
    if x.dim() != P.dim:
        raise expect(op, f"number of input dimensions (one per partition dimension, partition {list(P.shape)})",
                     P.dim, f"{x.dim()} (shape {tuple(x.shape)})")
    if x.shape[-1] != expected:
        raise expect(op, f"input feature extent ({what}; input shape {tuple(x.shape)})", expected, x.shape[-1])
    if x.device.type != P.device.type:
        raise expect(op, "input device", P.device, x.device)


class ParamBroadcast:
    """Copy parameter blocks from their owners ``P_src`` to their users ``P_dst``, packed into one message.

    ``shapes``: the blocks a user receives.  Adjoint: each owner gets the sum of its users'
    gradients (fp32-accumulated for bf16); the identity where ``P_d = 1``.
    """

    def __init__(self, P_src: CartesianPartition, P_dst: CartesianPartition, shapes: Sequence[Sequence[int]]):
        self.plan = broadcast_plan(P_src, P_dst)
        me = dist.get_rank()
        self.is_src, self.is_dst = self.plan.is_src(me), self.plan.is_dst(me)
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self._move = move_of(self.plan)

    def __call__(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype, device,
                 like: torch.Tensor) -> list[torch.Tensor]:
        """The blocks on this worker (``tensors``: the owner's, in ``shapes`` order; ``like``: the call's input)."""
        if self.plan.identity or not self.shapes:
            return list(tensors)
        n = sum(self.sizes)
        flat = torch.cat([t.reshape(-1) for t in tensors]).view(1, -1) if self.is_src else \
            placeholder(like, dtype, device)
        out = broadcast_blocks(flat, self._move.handle, [1, n] if self.is_dst else [0], 0, NO_FLAG, anchor(True))
        return [p.view(s) for p, s in zip(out.view(-1).split(self.sizes), self.shapes, strict=True)]


class LinearParams:
    """The parameters a model-parallel linear multiplies with on this worker: one component both linears hold.

    ``blocks`` lists ``(P_src, {name: block shape})``: the named parameters, packed into one
    message from their owners ``P_src`` to ``P_users`` (``sends``: its :class:`ParamBroadcast`
    and the names).  ``zero``, for the ZeRO layers, is ``(P_wgather, shape)``: ``W_m``
    all-gathered from its shards over the data-parallel workers (the adjoint reduce-scatters
    ``dW_m``, so each worker keeps its shard's gradient).
    """

    def __init__(self, op: str, P_users: CartesianPartition,
                 blocks: Sequence[tuple[CartesianPartition, dict[str, tuple[int, ...]]]],
                 zero: tuple[CartesianPartition, Sequence[int]] | None = None):
        self.sends = [(ParamBroadcast(P_src, P_users, list(named.values())), tuple(named))
                      for P_src, named in blocks if named]
        self._wgather = self._wblocks = None
        if zero is not None:
            P_wgather, shape = zero
            self._wgather = BlockCollective(op, P_wgather)
            self._wblocks = balanced_layout(P_wgather, shape).blocks if P_wgather.active else ()

    def fetch(self, layer, x: torch.Tensor, gather_weight: bool = True
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(W, b)`` on this worker (None where the layer has no bias; ``W`` None for ZeRO with
        ``gather_weight=False``: the fused op streams the shards into its GEMM)."""
        dtype, device = layer._param_dtype(), layer._param_device()
        got = {}
        for bc, names in self.sends:
            mine = [getattr(layer, name) for name in names] if bc.is_src else []
            got.update(zip(names, bc(mine, dtype, device, x), strict=True))
        W = got.get("weight")
        if self._wgather is not None:  # one data-parallel worker: its shard is all of W_m
            W = None if not gather_weight else layer.weight if self._wgather.P_sub.size == 1 else all_gather_op(
                layer.weight, self._wgather.handle, self._wblocks, None, -1)
        return W, got.get("bias")


def decide(op: str, layer: str, shapes: dict, dtype: torch.dtype, world_size: int, device,
           available=None) -> Decision:
    """The path this call takes, and why: ``select_path``'s verdict (assuming symmetric memory), a ``"fused"`` one
    confirmed with ``available()`` (collective the first time, then cached).  Where it says no, the unfused
    composition runs and the reason is logged once and recorded: ``last_path`` never claims a path that did not run.
    """
    choice = select_path(op, shapes, dtype, world_size, device_caps(torch.device(device), symmetric_memory=True))
    if choice.path != "fused":
        return choice
    if available is None:
        return Decision("unfused", f"select_path chose fused ({choice.reason}), but {layer} has no fused form for "
                                   "this call; ran the unfused composition", entry=choice.entry)
    from distfuse.fused.symmetric_availability import NotProbedError

    try:
        ok, why = available()
    except NotProbedError as exc:  # layer.explain (dispatch.dry_run): the first probe is collective, so it is not run
        return dataclasses.replace(choice, caveat=f"fused if symmetric memory is available: {exc}")
    if not ok:
        from distfuse.fused.symmetric import log_fallback_once

        log_fallback_once(f"{layer}: {why}")
        return Decision("unfused", f"select_path chose fused ({choice.reason}), but {why}; ran the unfused "
                                   "composition", entry=choice.entry)
    return choice


def not_servable(layer: str, why: str) -> Decision:
    return Decision("unfused", f"{layer}: {why}; no fused path serves this form")


INACTIVE = Decision("unfused", "this rank is not in the layer's partitions; it does no work")


class LinearBase(DryExplain, WeightAndBias, nn.Module):
    """Bookkeeping every distributed linear shares: parameter blocks, torch-equal init, dispatch records
    (``last_path``, ``last_decision``).  Subclasses set ``use_bias``, ``P_weight`` and ``P_bias`` (the owners)
    before :meth:`_register_params`."""

    def __init__(self, in_features: int, out_features: int, device, dtype):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 1:
                raise expect(type(self).__name__, name, "an integer >= 1", repr(v), cls=PartitionError)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.last_path: str | None = None
        self.last_decision: Decision | None = None
        self._set_param_home(device, dtype)

    @property
    def _op(self) -> str:
        return type(self).__name__

    def _param_dtype(self) -> torch.dtype:
        return self._dtype_probe.dtype

    def _param_device(self) -> torch.device:
        return self._dtype_probe.device

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        weight = (self.out_features, self.in_features)
        return (weight, (self.out_features,)) if self.use_bias else (weight,)

    def extra_repr(self) -> str:
        forms = [f"{name}={list(P.shape)}" for name in ("P_x", "P_y", "P_w")
                 if (P := getattr(self, name, None)) is not None]
        return ", ".join([f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}",
                          *forms])

    def _record(self, decision: Decision) -> None:
        self.last_decision, self.last_path = decision, decision.path

    def _record_kernel(self, fused_op: str | None) -> None:
        """After a fused call: name in ``last_decision`` the kernel that ran (``providers.last_kernel``), which may
        differ from the provider asked for (:mod:`distfuse.kernels.matmul_scatter_select`)."""
        from distfuse.fused.providers import last_kernel

        choice = last_kernel(fused_op) if fused_op and self.last_decision is not None else None
        if choice is not None and self.last_decision.path == "fused":
            self.last_decision = dataclasses.replace(self.last_decision, kernel=choice.kernel,
                                                     kernel_reason=choice.reason)
