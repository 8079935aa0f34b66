"""Make Triton 3.6's interpreter work with numpy 2.x (the Triton the GPU machines ship).

Triton 3.6's interpreter gives a scalar tensor ``__index__`` as ``int(handle.data)``, but
interpreted scalars are 1-element arrays, and numpy 2.x refuses ``int()`` of an array with
a dimension ("only 0-dimensional arrays can be converted to Python scalars").  Every
``for k in range(0, K, BLOCK_K)`` over a runtime bound then fails.  Triton 3.7 and later
squeeze the array first; this module applies the same fix to older interpreters, at
import of :mod:`distfuse.kernels`, and only when ``TRITON_INTERPRET`` is set.  Compiled
kernels are untouched.
"""

from __future__ import annotations

import inspect
import os

__all__ = ["patch_interpreter_index"]


def patch_interpreter_index() -> bool:
    """Install the squeeze fix where the interpreter lacks it; return whether it was installed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without an interpreter
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "distfuse_index_fix", False):
        return False
    if "squeeze" in inspect.getsource(original):  # Triton >= 3.7 has the fix
        return False

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.distfuse_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True
