"""The fused GEMM + collective linears as custom op pairs, and the one entry the layers call in every mode.

One op pair per fused op of :mod:`distfuse.fused`, all with one schema (``P`` the op's
group, ``r`` this worker's index in it, ``*`` the leading dims)::

    distfuse::<op>(x, weight, bias?, handle, needs, n)                    -> [y, *extras]
    distfuse::<op>_backward(dy, x, weight, bias?, extras, handle, needs, n) -> [dx, dweight, dbias]

    op                              x               weight        y                   extras (when kept)
    matmul_reduce_scatter           [*, n, K_r]     [N, K_r]      [*, n_r, N]         -
    matmul_reduce_scatter_features  [*, K_r]        [N, K_r]      [*, N_r]            -
    all_gather_matmul               [*, n_r, K]     [N_r, K]      [*, n, N_r]         gathered x [*, n, K]
    all_gather_features_matmul      [*, K_r]        [N_r, K]      [*, N_r]            gathered x [*, K]
    matmul_all_reduce               [*, K_r]        [N, K_r]      [*, N]              -
    zero_linear                     x               ZeRO shard    see zero_linear     W_m, gathered x

The implementations are the fused op's two phases
(:class:`~distfuse.fused.matmul_common.Phases`): the forward op runs the forward phase and
returns the extras, so the compiler holds them between the two graphs like any
activation; the backward op, the forward's registered backward, runs the backward phase.
``handle`` names a :class:`FusedCall` (the group and options such as ``keep_gathered``);
``needs`` says which of ``x, weight, bias`` want a gradient (a compile-time constant: the
compiler guards on ``requires_grad``); ``n`` is the sequence extent where the op needs it
(-1 elsewhere).  The plan the forward phase ran on is kept per shape signature for the backward.

:meth:`FusedCall.__call__` is the entry: the custom op while compiling, else the same two
phases through :func:`~distfuse.fused.matmul_common.run_phases` (no custom-op dispatch in
eager calls), so eager and compiled calls launch the same kernels and agree bitwise.  The
ops are first-order only: an eager backward with ``create_graph=True`` is refused by name
(:data:`FUSED_FIRST_ORDER`), and a compiled region refuses it too.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.primitives._common import first_order_only
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import ordered

__all__ = ["FusedCall", "FUSED_OPS", "FUSED_FIRST_ORDER", "make_call", "run_fused", "ZeroLinearCall"]

#: What the fused linear paths tell a backward with create_graph=True (see ``first_order_only``).
FUSED_FIRST_ORDER = "the fused GEMM + collective (the unfused path, DISTFUSE_PATH=unfused, computes them exactly)"

_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias, int handle, bool[] needs, int n) -> Tensor[]"
_BACKWARD_SCHEMA = ("(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor[] extras, int handle, bool[] needs, "
                    "int n) -> Tensor[]")


class FusedCall(HandleOwner, ABC):
    """One layer's call site of one fused op: the group and options; subclasses give the plan and the shapes.

    ``op`` is the fused op's name (the custom op's and its module's in :mod:`distfuse.fused`),
    ``P`` its group, ``owner`` the layer whose name a refused ``create_graph=True`` carries.
    ``plans`` keeps, per shape signature, the plan a compiled forward ran on, for its backward.
    """

    op = ""

    def __init__(self, P, keep_gathered: bool = True, owner: str | None = None):
        self.P, self.keep_gathered, self.owner = P, bool(keep_gathered), owner or self.op
        self.plans: dict[tuple, object] = {}
        self.handle = new_handle(self)

    def __getstate__(self) -> dict:
        # A copy keeps no plan for backwards it never ran forwards of: they hold the original's process groups.
        return {**self.__dict__, "plans": {}}

    @property
    def module(self):
        """The fused op's module (imported on first use: the kernels load only where a fused path runs)."""
        return importlib.import_module(f"distfuse.fused.{self.op}")

    @abstractmethod
    def plan(self, x, weight, bias, n):
        """The fused op's checks and plan (its ``<op>_plan`` function) for one call."""

    @abstractmethod
    def out_shape(self, x, weight, n) -> tuple[int, ...]:
        """The output's shape, from the inputs' shapes alone (the fake implementation's)."""

    def fake_out(self, x, weight, n) -> torch.Tensor:
        """An empty ``y`` with the fused op's strides (the compiler plans views on them)."""
        return x.new_empty(self.out_shape(x, weight, n))

    def saved_shapes(self, x, weight, needs, n) -> list[tuple[int, ...]]:
        """The shapes of the forward phase's extras (the tensors it keeps that are not inputs), in its order."""
        return []

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int = -1) -> torch.Tensor:
        """``y``: the custom op while compiling, else the phases eagerly (first-order: see the module doc)."""
        if torch.compiler.is_compiling():
            return run_fused(self.op, self.handle, x, weight, bias, n)
        from distfuse.fused.matmul_common import run_phases

        y = run_phases(self.module.PHASES, self.plan(x, weight, bias, n), [x], [weight], [bias])[0]
        return first_order_only(y, self.owner, FUSED_FIRST_ORDER)


class _PipelineCall(FusedCall):
    """A fused linear of the pipeline (the module's ``SPEC``, a
    :class:`~distfuse.fused.matmul_phases.PipelineLinear`): its plan and shapes are the spec's.  ``n``: the gathered
    sequence extent of all_gather_matmul (agreed in eager calls; the op then gathers nothing else; -1 sums the
    blocks' extents, one host round), else -1."""

    def plan(self, x, weight, bias, n):
        return self.module.SPEC.plan(x, weight, bias, self.P, keep_gathered=self.keep_gathered,
                                     n=n if n >= 0 else None)

    def out_shape(self, x, weight, n):
        return self.module.SPEC.out_shape(x, weight, self.P.size, self.P.rank, n)

    def saved_shapes(self, x, weight, needs, n):
        return self.module.SPEC.kept_shapes(x, weight, self.keep_gathered, needs[1], n)


class _MatmulReduceScatter(_PipelineCall):
    op = "matmul_reduce_scatter"


class _MatmulReduceScatterFeatures(_PipelineCall):
    op = "matmul_reduce_scatter_features"


class _AllGatherMatmul(_PipelineCall):
    op = "all_gather_matmul"


class _AllGatherFeaturesMatmul(_PipelineCall):
    op = "all_gather_features_matmul"


class _MatmulAllReduce(_PipelineCall):
    """``sum over P of (x @ weight.T + bias)`` on every worker, ``grad_output="sum"`` (the sum-reduce's adjoint)."""

    op = "matmul_all_reduce"

    def plan(self, x, weight, bias, n):
        return self.module.matmul_all_reduce_plan(x, weight, bias, self.P, grad_output="sum")


class ZeroLinearCall(FusedCall):
    """:func:`~distfuse.fused.zero_linear.zero_linear`: ``weight`` is the ZeRO shard, ``P`` the data-parallel
    workers, ``P_m`` the model-parallel ones (None: one); ``n`` for the all-gather linear's sequence
    form (the gathered extent), else -1."""

    op = "zero_linear"

    def __init__(self, P_d, P_m, split: str, axis: str, out_features: int, in_features: int,
                 keep_gathered: bool = True, owner: str | None = None):
        super().__init__(P_d, keep_gathered, owner)
        self.P_m, self.split, self.axis = P_m, split, axis
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.Wm, self.m = (1, 0) if P_m is None else (P_m.size, P_m.rank)

    def plan(self, x, weight, bias, n):
        return self.module.zero_linear_plan(x, weight, self.P, self.P_m, split=self.split, axis=self.axis,
                                            out_features=self.out_features, in_features=self.in_features,
                                            n=n if n >= 0 else None, keep_gathered=self.keep_gathered)

    def _gathered_x(self, x, n) -> tuple[int, ...]:
        """The all-gather linear's input gathered over the model-parallel workers."""
        if self.axis == "features":
            return (*x.shape[:-1], self.in_features)
        return (*x.shape[:-2], n, self.in_features)

    def out_shape(self, x, weight, n):
        if self.split == "rows":
            if self.axis == "features":
                return (*x.shape[:-1], block_extent(self.out_features, self.Wm, self.m))
            return (*x.shape[:-2], block_extent(x.shape[-2], self.Wm, self.m), self.out_features)
        return (*self._gathered_x(x, n)[:-1], weight.shape[0])

    def fake_out(self, x, weight, n):
        # The GEMM runs on the transposed product: y.T [features, rows] is what the kernels write.
        shape = self.out_shape(x, weight, n)
        if self.split == "rows" and self.Wm > 1:  # then reduce-scattered into a fresh contiguous block
            return x.new_empty(shape)
        return x.new_empty((shape[-1], math.prod(shape[:-1]))).t().reshape(shape)

    def saved_shapes(self, x, weight, needs, n):
        need_dx, need_dshard = needs[0], needs[1]
        shapes = []
        if self.keep_gathered and need_dx:  # W_m, gathered in forward
            shapes.append((self.out_features, weight.shape[1]) if self.split == "rows"
                          else (weight.shape[0], self.in_features))
        if need_dshard and self.split == "columns" and self.keep_gathered and self.Wm > 1:
            shapes.append(self._gathered_x(x, n))  # the gathered input (with one worker, x itself)
        return shapes


FUSED_OPS = {cls.op: cls for cls in (_MatmulReduceScatter, _MatmulReduceScatterFeatures, _AllGatherMatmul,
                                     _AllGatherFeaturesMatmul, _MatmulAllReduce, ZeroLinearCall)}


def make_call(op: str, *args, **kwargs) -> FusedCall:
    """A :class:`FusedCall` of the fused op named ``op`` (a key of :data:`FUSED_OPS`)."""
    return FUSED_OPS[op](*args, **kwargs)


def run_fused(op: str, handle: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              n: int = -1) -> torch.Tensor:
    """``y`` of the fused op ``op`` through its custom op; ``handle`` names the layer's :class:`FusedCall`.

    Traceable: ``needs`` is read from grad mode and the tensors' ``requires_grad``.
    """
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    return _OPS[op](x, weight, bias, handle, needs, int(n))[0]


# ---------------------------------------------------------------- the custom ops' implementations


def _key(x, weight, bias, needs, n) -> tuple:
    shapes = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in (x, weight, bias))
    return shapes, tuple(bool(need) for need in needs), int(n)


def _fresh(t: torch.Tensor, inputs) -> torch.Tensor:
    """``t``, copied if it shares memory with an input (a custom op's outputs must not alias its inputs)."""
    ptr = t.untyped_storage().data_ptr()
    if t.numel() and any(i is not None and i.numel() and i.untyped_storage().data_ptr() == ptr for i in inputs):
        return t.clone()
    return t


def _forward(x, weight, bias, handle, needs, n):
    call: FusedCall = lookup(handle)
    inputs = (x, weight, bias)
    plan = call.plans[_key(x, weight, bias, needs, n)] = call.plan(x, weight, bias, n)
    (y,), extras = call.module.PHASES.forward(plan, tuple(needs), [x], [weight], [bias])
    want = call.fake_out(x.to("meta"), weight.to("meta"), n)
    if y.stride() != want.stride():  # the strides the fake implementation gave the compiler
        y = torch.empty_strided(want.shape, want.stride(), dtype=y.dtype, device=y.device).copy_(y)
    return [_fresh(y, inputs), *(_fresh(t.contiguous(), inputs) for t in extras)]


def _forward_fake(x, weight, bias, handle, needs, n):
    call: FusedCall = lookup(handle)
    return [call.fake_out(x, weight, n), *(x.new_empty(s) for s in call.saved_shapes(x, weight, needs, n))]


def _backward(dy, x, weight, bias, extras, handle, needs, n):
    call: FusedCall = lookup(handle)
    plan = call.plans.get(_key(x, weight, bias, needs, n))
    if plan is None:
        raise UnsupportedError(f"{where(call.op)}: backward of a compiled fused call whose forward did not run "
                               "on this worker")
    inputs = (x, weight, bias)
    grads = call.module.PHASES.backward(plan, tuple(needs), [x], [weight], [bias], list(extras), [dy])
    return [_fresh(g[0], (dy, *inputs, *extras)) if need and g[0] is not None else dy.new_empty((0,))
            for need, g in zip(needs, grads, strict=True)]


def _backward_fake(dy, x, weight, bias, extras, handle, needs, n):
    return [t.new_empty(t.shape) if need and t is not None else dy.new_empty((0,)) for t, need in
            zip((x, weight, bias), needs, strict=True)]


def _register(op: str):
    """``distfuse::<op>`` and ``distfuse::<op>_backward``, the forward's registered backward (both ORDERED)."""
    fwd = torch.library.custom_op(f"distfuse::{op}", _forward, mutates_args=(), schema=_SCHEMA)
    fwd.register_fake(_forward_fake)
    bwd = torch.library.custom_op(f"distfuse::{op}_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA)
    bwd.register_fake(_backward_fake)

    def setup(ctx, inputs, output):
        x, weight, bias, handle, needs, n = inputs
        ctx.args = (handle, list(needs), int(n))
        ctx.save_for_backward(x, weight, bias, *output[1:])

    def backward(ctx, grads):
        x, weight, bias, *extras = ctx.saved_tensors
        dx_dw_db = bwd(grads[0].contiguous(), x, weight, bias, extras, *ctx.args)
        return (*(g if need else None for g, need in zip(dx_dw_db, ctx.args[1], strict=True)), None, None, None)

    fwd.register_autograd(backward, setup_context=setup)
    ordered(fwd, bwd)
    return fwd


_OPS = {name: _register(name) for name in FUSED_OPS}
