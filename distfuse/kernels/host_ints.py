"""Integer helpers for launch grids and block sizes on the host: ``cdiv`` and ``next_power_of_2``.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called on
host ints they unwrap every argument first, which a fused op's launch path (where an eager
fused call spends its host time, ``docs/gpu.md``) pays several times per call.  These are
the same functions in plain Python.  Inside ``@triton.jit`` code keep ``tl.cdiv``.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n``, as ``triton.next_power_of_2`` (which gives 0 for 0)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
