"""One definition of a linear communication op for every mode: a ``torch.library`` op pair and its eager entry.

A distfuse data movement ``F`` (a halo exchange, a window staging) is linear, and its
adjoint ``F*`` moves the gradients back; the adjoint of ``F*`` is ``F`` again.
:func:`op_pair` defines both from two Python implementations, once::

    forward(x, *args)          -> y     F: the communication core, no autograd
    adjoint(g, *adjoint_args)  -> dx    F*: likewise
    forward_fake, adjoint_fake          output shape, dtype and memory format from the arguments alone
    adjoint_args(x, *args)              what F* needs of a call of F (handle, shapes, format)
    forward_args(g, *adjoint_args)      what F needs of a call of F* (the adjoint's adjoint)

It registers ``distfuse::<name>`` and ``distfuse::<name>_adjoint`` as custom ops, each the
other's registered backward (so gradients of any order are exact when compiled too) and
an ``ORDERED`` effect, and returns one :class:`OpEntry` per op, which every caller calls::

    entry(x, *args)   inside torch.compile      the custom op: one node of the graph
                      eager, x needs a grad     an autograd.Function generated here from the
                                                same two implementations (backward: the
                                                adjoint's entry, so double backward is exact)
                      eager, no grad            the implementation itself

:func:`op_entry` defines one op that is not half of a linear pair the same way.

Why eager calls do not go through the custom op: its eager call passes the dispatcher,
torch's generated autograd wrapper and a redispatch below autograd before it reaches the
implementation, tens of microseconds a call more than an ``autograd.Function`` over the
same core (``scripts/dispatch_cost.py``; ``docs/design.md``, "One forward per layer").

Why ``ORDERED``: communication must run in program order on every rank.  The ranks'
graphs differ a little (a root concatenates parameters, its peers do not), so a compiler
that reorders independent nodes can put one rank's rounds in another order than its
peers' (gloo then aborts: "Received data size doesn't match").  The effect keeps the ops
in program order under ``eager`` / ``aot_eager`` and keeps an op whose result is unused
in the graph; inductor's memory and locality reordering does not honour it (compile with
``distfuse.ops.INDUCTOR_OPTIONS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

__all__ = ["OpEntry", "op_pair", "op_entry", "ordered", "ANCHOR", "anchor"]

#: The anchor of an op pair's call whose adjoint must run (see :func:`op_pair`): a leaf that requires grad and never
#: gets a gradient; a graph input when compiled, so an op that takes it is never folded as a constant.
ANCHOR = torch.empty(0, requires_grad=True)


def anchor(needed: bool, ties: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
    """:data:`ANCHOR` when ``needed`` under grad mode, else None (the op's output then follows its input alone).

    ``ties``: outputs of earlier ops that this worker does not use; where they require grad
    the anchor is made of them (an empty tensor that is no leaf), so that their adjoints
    run when this op's does (see :func:`op_pair`).
    """
    ties = [t.reshape(-1)[:0] for t in ties if t.requires_grad]
    if ties and torch.is_grad_enabled():
        return torch.cat(ties)
    return ANCHOR if needed and torch.is_grad_enabled() else None


def ordered(*ops) -> None:
    """Register custom ops as ``ORDERED`` effects (see the module docstring)."""
    for op in ops:
        torch.library._register_effectful_op(op._qualname, torch.library.EffectType.ORDERED)


class OpEntry:
    """How distfuse calls one op: the custom op while compiling, else the eager path (module docstring).

    ``op`` is the ``torch.library`` custom op, ``function`` the generated
    ``autograd.Function`` (None for an op without gradient), ``impl`` the implementation.
    ``inputs`` are the positions of the differentiable arguments (an op pair's: the first).
    """

    def __init__(self, op, function: type[torch.autograd.Function] | None, impl: Callable,
                 inputs: tuple[int, ...] = (0,)):
        self.op, self.function, self.impl, self.inputs = op, function, impl, inputs

    def __call__(self, t: torch.Tensor, *args):
        if torch.compiler.is_compiling():
            return self.op(t, *args)
        if torch.is_grad_enabled() and self._needs_grad(t, args):
            return self.function.apply(t, *args)
        return self.impl(t, *args)

    def _needs_grad(self, t: torch.Tensor, args: tuple) -> bool:
        if self.inputs == (0,):  # an op pair's: the input, or an anchor that requires grad (see op_pair)
            return t.requires_grad or bool(args and isinstance(args[-1], torch.Tensor) and args[-1].requires_grad)
        every = (t,) + args
        return any(every[i] is not None and every[i].requires_grad for i in self.inputs)


def _tie(args: tuple):
    """``(shape, dtype, device)`` of a last argument that is a tied anchor (see :func:`op_pair`), else None."""
    a = args[-1] if args else None
    if isinstance(a, torch.Tensor) and a.requires_grad and not a.is_leaf:
        return tuple(a.shape), a.dtype, a.device
    return None


def _rest(tie, n: int) -> tuple:
    """The gradients of the ``n`` arguments after the input: none, but zeros for a tied anchor."""
    if tie is None:
        return (None,) * n
    return (None,) * (n - 1) + (torch.zeros(tie[0], dtype=tie[1], device=tie[2]),)


def _title(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def _function(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(backward)})


def _define(name: str, impl: Callable, fake: Callable):
    """``distfuse::<name>`` over ``impl``, with its fake implementation, as an ``ORDERED`` effect."""
    op = torch.library.custom_op(f"distfuse::{name}", impl, mutates_args=())
    op.register_fake(fake)
    ordered(op)
    return op


def _half(name: str, impl: Callable, fake: Callable, next_args: Callable, other: Callable[[], OpEntry]) -> OpEntry:
    """One half of an op pair: the custom op over ``impl`` and its eager ``autograd.Function``, each of whose
    backward is ``other()`` (the other half's custom op, resp. entry) on ``next_args(inputs)``."""

    def keep(ctx, t, args: tuple) -> None:
        ctx.next_args, ctx.n, ctx.tie = next_args(t, *args), len(args), _tie(args)

    def backward(entry: Callable[[], Callable]):
        return lambda ctx, g: (entry()(g, *ctx.next_args),) + _rest(ctx.tie, ctx.n)

    def forward(ctx, t, *args):
        keep(ctx, t, args)
        return impl(t, *args)

    op = _define(name, impl, fake)  # setup_context's inputs: every argument, defaults filled in
    op.register_autograd(backward(lambda: other().op),
                         setup_context=lambda ctx, inputs, output: keep(ctx, inputs[0], tuple(inputs[1:])))
    return OpEntry(op, _function(_title(name), forward, backward(other)), impl)


def op_pair(name: str, forward: Callable, forward_fake: Callable, adjoint: Callable, adjoint_fake: Callable, *,
            adjoint_args: Callable, forward_args: Callable) -> tuple[OpEntry, OpEntry]:
    """``(F, F*)`` as :class:`OpEntry` objects over ``distfuse::<name>`` and ``distfuse::<name>_adjoint``.

    ``forward`` and ``adjoint`` must carry type annotations (the ops' schemas are inferred
    from them) and return new tensors.  Either may end in an optional *anchor*
    (``anchor: torch.Tensor | None = None``, also the last argument ``adjoint_args`` /
    ``forward_args`` receive): an empty tensor whose ``requires_grad`` makes the output
    require grad.  A worker whose input is a placeholder, or does not require grad while
    its peers' does, passes :data:`ANCHOR` (:func:`anchor`), so that it runs the adjoint
    round its peers wait for (a compiled graph cannot make its input require grad).  An
    anchor that is not a leaf (:func:`anchor` with ``ties``) gets a zero gradient, so that
    the tied ops' adjoints run here too and every worker's backward holds the same ops.
    """
    pair: list[OpEntry] = []
    pair.append(_half(name, forward, forward_fake, adjoint_args, lambda: pair[1]))
    pair.append(_half(f"{name}_adjoint", adjoint, adjoint_fake, forward_args, lambda: pair[0]))
    return pair[0], pair[1]


def _save(ctx, values: tuple) -> None:
    """Keep ``values`` for the backward: tensors through ``save_for_backward``, anything else on ``ctx``."""
    ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)))
    ctx.kept = tuple(None if isinstance(v, torch.Tensor) else v for v in values)
    ctx.is_tensor = tuple(isinstance(v, torch.Tensor) for v in values)


def _saved(ctx) -> tuple:
    tensors = iter(ctx.saved_tensors)
    return tuple(next(tensors) if t else v for v, t in zip(ctx.kept, ctx.is_tensor, strict=True))


def _grads(ctx, g, backward: Callable, inputs: tuple[int, ...], n: int) -> tuple:
    """``backward(g, *saved, needs)``'s gradients at the positions ``inputs`` of ``n`` arguments (None elsewhere)."""
    needs = [bool(ctx.needs_input_grad[i]) for i in inputs]
    out = [None] * n
    for i, grad, need in zip(inputs, backward(g, *_saved(ctx), needs), needs, strict=True):
        out[i] = grad if need else None
    return tuple(out)


def op_entry(name: str, forward: Callable, forward_fake: Callable, backward: Callable | None = None,
             backward_fake: Callable | None = None, *, saved: Callable | None = None,
             inputs: tuple[int, ...] = ()) -> OpEntry:
    """One op that is not half of a linear pair, as an :class:`OpEntry` over ``distfuse::<name>``.

    For a communication step without gradient (``backward`` None, ``inputs`` empty: the
    norms' statistics gather) or one whose gradient is not a linear adjoint (the
    normalisation: several differentiable inputs, a backward that reads saved inputs)::

        forward(*args) -> y
        saved(*args)   -> what the backward keeps of a call (tensors, None and scalars)
        backward(g, *saved, needs: list[bool]) -> one gradient per input in ``inputs`` (their
                          positions among the arguments), an empty tensor where ``needs`` is False

    ``backward`` becomes ``distfuse::<name>_backward``, the forward op's registered
    backward; the eager ``autograd.Function`` calls the same implementation (once
    differentiable: the backward has no gradient of its own).  Both ops are ``ORDERED``
    (module docstring).  Implementations must carry type annotations and return new tensors.
    """
    op = _define(name, forward, forward_fake)
    if backward is None:
        return OpEntry(op, None, forward, ())
    back = _define(f"{name}_backward", backward, backward_fake)
    n = len(op._opoverload._schema.arguments)
    op.register_autograd(lambda ctx, g: _grads(ctx, g, back, inputs, n),  # (setup_context's names are torch's)
                         setup_context=lambda ctx, inputs, output: _save(ctx, saved(*inputs)))

    def function_forward(ctx, *args):
        _save(ctx, saved(*args))
        return forward(*args)

    @once_differentiable
    def function_backward(ctx, g):
        return _grads(ctx, g, backward, inputs, n)

    return OpEntry(op, _function(_title(name), function_forward, function_backward), forward, inputs)
