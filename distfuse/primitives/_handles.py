"""Integer handles for the objects behind distfuse's ``torch.library`` custom ops.

A custom op's schema takes tensors and plain scalars, not Python objects, so a compiled
graph names the exchange it runs (a :class:`~distfuse.primitives.halo_exchange.HaloExchange`,
a layer's parameter broadcast) by an integer.  Handles are handed out in creation order;
layers are constructed collectively, in the same order on every rank, so one layer's
objects get the same handles everywhere and every rank's graph is the same text.  The
table holds weak references.  A copy of such an object (``copy.deepcopy(model)``) gets a
handle of its own (:class:`HandleOwner`): one that kept the original's would route the
copy's compiled graphs to the original.
"""

from __future__ import annotations

import itertools
import weakref

from distfuse.errors import UnsupportedError

__all__ = ["new_handle", "lookup", "HandleOwner"]

_NEXT = itertools.count(1)
_TABLE: dict[int, weakref.ref] = {}


def new_handle(obj) -> int:
    """A fresh handle for ``obj`` (held weakly); ``obj`` must be a :class:`HandleOwner` (its copies get theirs)."""
    if not isinstance(obj, HandleOwner):
        raise TypeError(f"new_handle: {type(obj).__name__} must derive from distfuse.primitives._handles.HandleOwner, "
                        "so that a copy of it (copy.deepcopy(model)) gets a handle of its own")
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


class HandleOwner:
    """Base of the objects behind handles (``self.handle``): a copy, or an unpickled object, gets a handle of its own.

    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` all rebuild the object through
    ``__setstate__``; so do nn.Modules (``HaloExchange``), whose own ``__setstate__`` runs
    first when this class precedes ``nn.Module`` among the bases.
    """

    handle: int

    def __setstate__(self, state) -> None:
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        self.handle = new_handle(self)
