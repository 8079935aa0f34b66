"""Integer handles for the objects behind distfuse's ``torch.library`` custom ops.

A custom op's schema takes tensors and plain scalars, not Python objects, so a compiled
graph names the exchange it runs (a :class:`~distfuse.primitives.halo_exchange.HaloExchange`,
a layer's parameter broadcast) by an integer.  Handles are handed out in creation order;
layers are constructed collectively, in the same order on every rank, so one layer's
objects get the same handles everywhere and every rank's graph is the same text.  The
table holds weak references: a handle outlives nothing.
"""

from __future__ import annotations

import itertools
import weakref

from distfuse.errors import UnsupportedError

__all__ = ["new_handle", "lookup"]

_NEXT = itertools.count(1)
_TABLE: dict[int, weakref.ref] = {}


def new_handle(obj) -> int:
    """A fresh handle for ``obj`` (held weakly)."""
    handle = next(_NEXT)
    _TABLE[handle] = weakref.ref(obj, lambda _ref, h=handle: _TABLE.pop(h, None))  # freed objects leave the table
    return handle


def lookup(handle: int):
    """The object behind ``handle``; :class:`UnsupportedError` when it is gone (a graph outlived its layer)."""
    ref = _TABLE.get(int(handle))
    obj = ref() if ref is not None else None
    if obj is None:
        raise UnsupportedError(f"distfuse custom op: handle {handle} names no live object (the layer of this "
                               "compiled graph was freed)")
    return obj
