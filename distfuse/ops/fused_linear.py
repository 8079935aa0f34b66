"""The fused GEMM + collective linears as custom ops, so a compiled layer runs its fused path.

One op pair per fused op of :mod:`distfuse.fused`, all with one schema (``P`` the op's
group, ``r`` this worker's index in it, ``*`` the leading dims)::

    distfuse::<op>(x, weight, bias?, handle, needs, n) -> [y, *saved]
    distfuse::<op>_backward(dy, x, weight, bias?, saved, handle, needs, n) -> [dx, dweight, dbias]

    op                              x               weight        y                   saved (when kept)
    matmul_reduce_scatter           [*, n, K_r]     [N, K_r]      [*, n_r, N]         -
    matmul_reduce_scatter_features  [*, K_r]        [N, K_r]      [*, N_r]            -
    all_gather_matmul               [*, n_r, K]     [N_r, K]      [*, n, N_r]         gathered x [*, n, K]
    all_gather_features_matmul      [*, K_r]        [N_r, K]      [*, N_r]            gathered x [*, K]
    matmul_all_reduce               [*, K_r]        [N, K_r]      [*, N]              -
    zero_linear                     x               ZeRO shard    see zero_linear     W_m, gathered x

``handle`` names a :class:`FusedCall` (the group, the options such as ``keep_gathered``);
``needs`` says which of ``x, weight, bias`` want a gradient (a compile-time constant:
the compiler guards on ``requires_grad``); ``n`` is the sequence extent where
the op needs it (-1 elsewhere).  The forward's eager implementation calls the fused op's public
function (:func:`~distfuse.fused.all_gather_matmul.all_gather_matmul`, ...) on detached
leaves and keeps what its autograd node saved: tensors that are inputs are named by
position, the others (the gathered input the all-gather ops keep for the weight
gradient) become extra outputs, so the compiler holds them between the two graphs like
any activation.  The backward rebuilds the node's context from those tensors and the
node's own attributes (the plan: group, workspace size, provider; identical for every
call with the same shapes, so cached per shape signature) and runs the fused op's own
backward: compiled and eager calls launch the same kernels on the same data and agree
bitwise.  The extras' shapes are known from the arguments (the fake implementation
gives them); a fused op that saves anything else raises
:class:`~distfuse.errors.UnsupportedError` instead of running a graph the compiler
shaped otherwise.

Like the eager fused paths, these are first-order only: the backward op has no
gradient of its own, and a compiled region refuses ``create_graph=True``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from types import SimpleNamespace

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.primitives._handles import lookup, new_handle

__all__ = ["FusedCall", "FUSED_OPS", "make_call", "run_fused", "ZeroLinearCall"]

_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias, int handle, bool[] needs, int n) -> Tensor[]"
_BACKWARD_SCHEMA = ("(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor[] saved, int handle, bool[] needs, "
                    "int n) -> Tensor[]")


class FusedCall(ABC):
    """One layer's call site of one fused op: the group and options; subclasses give the shapes and the call.

    ``op`` is the fused op's name (the custom op's), ``P`` its group.  ``states`` caches,
    per shape signature, what the backward needs of the autograd node (see the module doc).
    """

    op = ""

    def __init__(self, P, keep_gathered: bool = True):
        self.P, self.keep_gathered = P, bool(keep_gathered)
        self.states: dict[tuple, tuple] = {}
        self.handle = new_handle(self)

    @abstractmethod
    def call(self, x, weight, bias, n):
        """Run the fused op eagerly; returns its autograd output."""

    @abstractmethod
    def out_shape(self, x, weight, n) -> tuple[int, ...]:
        """The output's shape, from the inputs' shapes alone (the fake implementation's)."""

    def fake_out(self, x, weight, n) -> torch.Tensor:
        """An empty ``y`` with the fused op's strides (the compiler plans views on them)."""
        return x.new_empty(self.out_shape(x, weight, n))

    def saved_shapes(self, x, weight, needs, n) -> list[tuple[int, ...]]:
        """The shapes of the tensors the fused op saves that are not its inputs, in the order it saves them."""
        return []


class _MatmulReduceScatter(FusedCall):
    op = "matmul_reduce_scatter"

    def call(self, x, weight, bias, n):
        from distfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter

        return matmul_reduce_scatter(x, weight, bias, self.P, bias_grad="partial")

    def out_shape(self, x, weight, n):
        return (*x.shape[:-2], block_extent(x.shape[-2], self.P.size, self.P.rank), weight.shape[0])


class _MatmulReduceScatterFeatures(FusedCall):
    op = "matmul_reduce_scatter_features"

    def call(self, x, weight, bias, n):
        from distfuse.fused.matmul_reduce_scatter_features import matmul_reduce_scatter_features

        return matmul_reduce_scatter_features(x, weight, bias, self.P)

    def out_shape(self, x, weight, n):
        return (*x.shape[:-1], block_extent(weight.shape[0], self.P.size, self.P.rank))


class _AllGatherMatmul(FusedCall):
    """``n``: the gathered sequence extent (agreed in eager calls; the op then gathers nothing else)."""

    op = "all_gather_matmul"

    def call(self, x, weight, bias, n):
        from distfuse.fused.all_gather_matmul import all_gather_matmul

        return all_gather_matmul(x, weight, bias, self.P, keep_gathered=self.keep_gathered, n=n)

    def out_shape(self, x, weight, n):
        return (*x.shape[:-2], n, weight.shape[0])

    def saved_shapes(self, x, weight, needs, n):
        return [(*x.shape[:-2], n, x.shape[-1])] if self.keep_gathered and needs[1] else []


class _AllGatherFeaturesMatmul(FusedCall):
    op = "all_gather_features_matmul"

    def call(self, x, weight, bias, n):
        from distfuse.fused.all_gather_features_matmul import all_gather_features_matmul

        return all_gather_features_matmul(x, weight, bias, self.P, keep_gathered=self.keep_gathered)

    def out_shape(self, x, weight, n):
        return (*x.shape[:-1], weight.shape[0])

    def saved_shapes(self, x, weight, needs, n):
        return [(*x.shape[:-1], weight.shape[1])] if self.keep_gathered and needs[1] else []


class _MatmulAllReduce(FusedCall):
    """``sum over P of (x @ weight.T + bias)`` on every worker, ``grad_output="sum"`` (the sum-reduce's adjoint)."""

    op = "matmul_all_reduce"

    def call(self, x, weight, bias, n):
        from distfuse.fused.matmul_all_reduce import matmul_all_reduce

        return matmul_all_reduce(x, weight, bias, self.P, grad_output="sum")

    def out_shape(self, x, weight, n):
        return (*x.shape[:-1], weight.shape[0])


class ZeroLinearCall(FusedCall):
    """:func:`~distfuse.fused.zero_linear.zero_linear`: ``weight`` is the ZeRO shard, ``P`` the data-parallel
    workers, ``P_m`` the model-parallel ones (None: one); ``n`` for the all-gather linear's sequence
    form (the gathered extent), else empty."""

    op = "zero_linear"

    def __init__(self, P_d, P_m, split: str, axis: str, out_features: int, in_features: int,
                 keep_gathered: bool = True):
        super().__init__(P_d, keep_gathered)
        self.P_m, self.split, self.axis = P_m, split, axis
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.Wm, self.m = (1, 0) if P_m is None else (P_m.size, P_m.rank)

    def call(self, x, weight, bias, n):
        from distfuse.fused.zero_linear import zero_linear

        return zero_linear(x, weight, self.P, self.P_m, split=self.split, axis=self.axis,
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


# ---------------------------------------------------------------- eager implementations


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
    leaves = tuple(None if t is None else t.detach().requires_grad_(bool(need)) for t, need in zip(inputs, needs,
                                                                                             strict=True))
    with torch.enable_grad():
        y = call.call(*leaves, n)
    saved = []
    node = y.grad_fn
    if node is not None:
        recipe = []
        for t in node.saved_tensors:
            if t is None:
                recipe.append(("none", 0))
                continue
            at = next((i for i, leaf in enumerate(leaves) if leaf is not None and t is leaf), None)
            if at is not None:
                recipe.append(("input", at))
            else:
                recipe.append(("saved", len(saved)))
                saved.append(_fresh(t.detach().contiguous(), inputs))
        want = [tuple(s) for s in call.saved_shapes(x, weight, needs, n)]
        if [tuple(t.shape) for t in saved] != want:
            raise UnsupportedError(f"{where(call.op)}: inside torch.compile the fused op saved tensors of shapes "
                                   f"{[tuple(t.shape) for t in saved]} for its backward, where its custom op "
                                   f"expects {want}; run this layer eagerly (or DISTFUSE_PATH=unfused)")
        call.states[_key(x, weight, bias, needs, n)] = (node._forward_cls, dict(node.__dict__), recipe,
                                                            tuple(node.needs_input_grad))
    want = call.fake_out(x.to("meta"), weight.to("meta"), n)
    y = y.detach()
    if y.stride() != want.stride():  # the strides the fake implementation gave the compiler
        y = torch.empty_strided(want.shape, want.stride(), dtype=y.dtype, device=y.device).copy_(y)
    return [_fresh(y, inputs), *saved]


def _forward_fake(x, weight, bias, handle, needs, n):
    call: FusedCall = lookup(handle)
    y = call.fake_out(x, weight, n)
    return [y, *(x.new_empty(s) for s in call.saved_shapes(x, weight, needs, n))]


def _backward(dy, x, weight, bias, saved, handle, needs, n):
    call: FusedCall = lookup(handle)
    state = call.states.get(_key(x, weight, bias, needs, n))
    if state is None:
        raise UnsupportedError(f"{where(call.op)}: backward of a compiled fused call whose forward did not run "
                               "on this worker")
    cls, attrs, recipe, needs_input_grad = state
    inputs = (x, weight, bias)
    tensors = tuple(None if kind == "none" else inputs[i] if kind == "input" else saved[i] for kind, i in recipe)
    ctx = SimpleNamespace(**attrs, saved_tensors=tensors, needs_input_grad=needs_input_grad)
    grads = cls.backward(ctx, dy)[1:]
    grads = list(grads) + [None] * (3 - len(grads))  # zero_linear has no bias
    return [_fresh(g, (dy, *inputs, *saved)) if need and g is not None else dy.new_empty((0,))
            for need, g in zip(needs, grads, strict=True)]


def _backward_fake(dy, x, weight, bias, saved, handle, needs, n):
    return [t.new_empty(t.shape) if need and t is not None else dy.new_empty((0,)) for t, need in
            zip((x, weight, bias), needs, strict=True)]


def _register(op: str):
    """``distfuse::<op>`` and ``distfuse::<op>_backward`` (both ORDERED effects: program order on every rank)."""
    fwd = torch.library.custom_op(f"distfuse::{op}", _forward, mutates_args=(), schema=_SCHEMA)
    fwd.register_fake(_forward_fake)
    bwd = torch.library.custom_op(f"distfuse::{op}_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA)
    bwd.register_fake(_backward_fake)

    def setup(ctx, inputs, output):
        x, weight, bias, handle, needs, n = inputs
        ctx.args = (handle, list(needs), int(n))
        ctx.save_for_backward(x, weight, bias, *output[1:])

    def backward(ctx, grads):
        x, weight, bias, *saved = ctx.saved_tensors
        dx, dw, db = bwd(grads[0].contiguous(), x, weight, bias, saved, *ctx.args)
        needs = ctx.args[1]
        return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, None, None, None)

    fwd.register_autograd(backward, setup_context=setup)
    for o in (fwd, bwd):
        torch.library._register_effectful_op(o._qualname, torch.library.EffectType.ORDERED)
    return fwd


_OPS = {name: _register(name) for name in FUSED_OPS}


def run_fused(op: str, handle: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              n: int = -1) -> torch.Tensor:
    """``y`` of the fused op ``op`` through its custom op; ``handle`` names the layer's :class:`FusedCall`.

    Traceable: ``needs`` is read from grad mode and the tensors' ``requires_grad``.
    """
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    return _OPS[op](x, weight, bias, handle, needs, int(n))[0]
