"""Exact geometry of a spatially partitioned pooling layer (pure Python, no communication).

A pooling window is a convolution window: output ``o`` of one axis reads the taps
``o*s - pad + j*d`` (``j < k``), so the halo of a worker's output block is the one
:class:`~distfuse.geometry.halo_plan.AxisGeometry` computes for a convolution.  Two
things differ from a convolution, and this module holds both:

**The output extent** follows torch's pooling rule::

    m = floor((n + 2*pad - d*(k-1) - 1 + (s-1 if ceil_mode else 0)) / s) + 1
    ceil_mode: if (m-1)*s >= n + pad: m -= 1      (the last window starts inside the
                                                  input or the left padding)

A ceil-mode window may run past the padded input.  The halo plan sees such a layer as
a floor-mode one whose high padding is just wide enough for the last window
(:func:`pool_axis`): the positions past the padded edge are staged like padding, and the
layers make them neutral (``-inf`` for max, excluded from the divisor for average).

**What padding means.**  torch ignores padded taps: a max window returns its largest
*input* element (``-inf`` padding gives that), and when every input element of the
window is ``-inf`` torch returns the index of the window's first tap inside the input
(:func:`first_taps`).  An average divides by (torch's ``avg_pool`` kernels):

=======================  ====================================================================
``divisor_override=D``   ``D``
``count_include_pad``    ``prod_axes (min(start + k, n + pad) - start)``: padding counts, but a
                         ceil-mode window is clipped at the padded edge
otherwise                ``prod_axes (min(start + k, n) - max(start, 0))``: input taps only
=======================  ====================================================================

with ``start = o*s - pad`` (:func:`avg_divisors`).

Geometry torch refuses is refused here with the same reasons (:func:`check_pool_axis`):
padding over half the kernel (``pad > k // 2``, whatever the dilation), an output
extent below 1, and, beyond torch, a dilated window none of whose taps falls inside the
input (torch returns ``-inf`` there with an index outside the input, and its backward
writes out of bounds).
"""

from __future__ import annotations

from distfuse.errors import ShapeError, UnsupportedError
from distfuse.geometry.halo_plan import AxisGeometry

__all__ = ["pool_output_extent", "check_pool_axis", "pool_axis", "first_taps", "avg_divisors"]


def pool_output_extent(n: int, kernel: int, stride: int, dilation: int, pad: int, ceil_mode: bool) -> int:
    """torch's pooling output extent along one axis (may be <= 0: torch then refuses the input)."""
    span = n + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    m = span // stride + 1  # Python's // floors, as torch's div_rtn does for negative spans
    if ceil_mode and (m - 1) * stride >= n + pad:
        m -= 1
    return m


def _taps(o: int, kernel: int, stride: int, dilation: int, pad: int) -> range:
    start = o * stride - pad
    return range(start, start + dilation * (kernel - 1) + 1, dilation)


def check_pool_axis(n: int, kernel: int, stride: int, dilation: int, pad: int, ceil_mode: bool) -> int:
    """Validate one axis of a pooling geometry the way torch does; return the output extent.

    Raises :class:`UnsupportedError` for arguments torch rejects (non-positive kernel,
    stride or dilation, negative padding, padding over half the kernel) and
    :class:`ShapeError` for an input too small (output extent below 1) or a window
    that covers no input element.
    """
    if min(kernel, stride, dilation) < 1:
        raise UnsupportedError(f"kernel_size, stride and dilation must be positive, got kernel_size={kernel}, "
                               f"stride={stride}, dilation={dilation}")
    if pad < 0 or pad > kernel // 2:
        raise UnsupportedError(f"padding must be between 0 and half the kernel size (kernel_size // 2 = "
                               f"{kernel // 2}, as torch requires), got padding={pad}")
    m = pool_output_extent(n, kernel, stride, dilation, pad, ceil_mode)
    if m < 1:
        raise ShapeError(f"global input extent {n} is too small for kernel_size={kernel}, stride={stride}, "
                         f"padding={pad}, dilation={dilation}, ceil_mode={ceil_mode}: output extent {m}")
    if dilation > 1:  # a window starting at or after 0 holds its first tap (every window starts below n)
        for o in range(min(m, pad // stride + 1)):
            if not any(0 <= t < n for t in _taps(o, kernel, stride, dilation, pad)):
                raise ShapeError(f"pooling window {o} (taps {list(_taps(o, kernel, stride, dilation, pad))}) covers "
                                 f"no element of the global input extent {n}; torch answers -inf with an index "
                                 f"outside the input there, so distfuse refuses the geometry")
    return m


def pool_axis(n: int, p: int, kernel: int, stride: int, dilation: int, pad: int, ceil_mode: bool) -> AxisGeometry:
    """The halo geometry of one pooled axis split over ``p`` workers (call :func:`check_pool_axis` first).

    Returns a zero-padded :class:`AxisGeometry` whose output extent is torch's pooling
    extent: ceil mode widens the high padding so that the last window fits.
    """
    m = pool_output_extent(n, kernel, stride, dilation, pad, ceil_mode)
    last_window_end = (m - 1) * stride + dilation * (kernel - 1) + 1 - pad  # global, exclusive
    pad_hi = max(pad, last_window_end - n)
    ax = AxisGeometry(n, p, kernel, stride, dilation, pad, pad_hi, "zeros")
    if ax.m != m:  # the widened padding reproduces torch's extent exactly; anything else is a bug here
        raise AssertionError(f"pool_axis: halo extent {ax.m} != pooling extent {m} for {ax}")
    return ax


def first_taps(n: int, kernel: int, stride: int, dilation: int, pad: int, o0: int, o1: int) -> list[int]:
    """Global index of the first tap inside ``[0, n)`` of each window ``o0 <= o < o1``.

    torch's max pooling returns this index (per axis) when no element of the window is
    larger than ``-inf``.  Windows that cover no input element are refused by
    :func:`check_pool_axis`, so the tap exists.
    """
    return [next(t for t in _taps(o, kernel, stride, dilation, pad) if 0 <= t < n) for o in range(o0, o1)]


def avg_divisors(n: int, kernel: int, stride: int, pad: int, count_include_pad: bool, o0: int,
                 o1: int) -> list[int]:
    """Per-axis factor of torch's average-pooling divisor for windows ``o0 <= o < o1`` (see the module docstring).

    The N-D divisor is the product of the axes' factors.  Every factor is at least 1:
    a window starts inside the input or the left padding (``pad <= k // 2``), so it
    reaches the input.
    """
    out = []
    for o in range(o0, o1):
        start = o * stride - pad
        end = min(start + kernel, n + pad)
        out.append(end - start if count_include_pad else min(end, n) - max(start, 0))
    return out
