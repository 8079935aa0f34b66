"""Exact geometry of a spatially partitioned transposed convolution (pure Python, no communication).

Along one spatial axis, a transposed convolution with kernel ``k``, stride ``s``,
dilation ``d``, padding ``p`` and output padding ``q`` maps a global input extent ``n``
to the global output extent

    m = (n - 1)*s - 2p + d*(k - 1) + q + 1

and input ``i`` writes, through kernel tap ``t``, output ``o = i*s - p + t*d``.  It is
the adjoint of the convolution with the same ``k, s, d, p``; ``q`` only lengthens the
output on the high side, and positions that no input reaches (there, or in the gaps a
stride larger than the kernel leaves) hold zero plus the bias.

The output is split by the balanced decomposition of ``m``, *not* by the images of the
input blocks (which overlap, and whose union reaches into the cropped padding and stops
short of ``q``).  Worker ``w`` owns outputs ``[o0, o1)``; through tap ``t`` the inputs
that reach them are

    ceil((o0 + p - t*d) / s)  ..  floor((o1 - 1 + p - t*d) / s)

and the worker's needed range ``[a, b)`` is the hull of these over the taps, clipped to
``[0, n)`` (a transposed convolution pads nothing, so the range is clipped rather than
zero-filled).  The worker stages ``[a, b)`` (its own inputs and halos, possibly from
several blocks away), computes the local transposed convolution of the staged block with
padding 0, whose outputs cover the global window

    [a*s - p,  (b-1)*s - p + d*(k-1) + 1)

and crops that window to ``[o0, o1)``, extending it with zeros where it is shorter
(:meth:`TransposeAxisGeometry.block_pads`, in ``F.pad``'s convention).

:class:`TransposeAxisGeometry` is an :class:`~distfuse.geometry.halo_plan.AxisGeometry`
whose output extent and needed input range are the transposed ones; everything else is
:class:`~distfuse.geometry.halo_plan.HaloPlan`'s, so the exchange that stages a transposed
convolution is the ordinary halo exchange, message for message, and every piece a plain
copy (step +1) from one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distfuse.errors import ShapeError, UnsupportedError
from distfuse.geometry.halo_plan import AxisGeometry, HaloPlan

__all__ = ["TransposeAxisGeometry", "check_output_padding", "transpose_plan", "block_pads"]


def check_output_padding(output_padding: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> None:
    """torch's rule: each output padding must be >= 0 and smaller than the stride or the dilation of its axis."""
    for q, s, d in zip(output_padding, stride, dilation, strict=True):
        if q < 0 or (q >= s and q >= d):
            raise UnsupportedError(f"output padding must be >= 0 and smaller than either stride or dilation (as in "
                                   f"torch), got output_padding {tuple(output_padding)}, stride {tuple(stride)}, "
                                   f"dilation {tuple(dilation)}")


@dataclass(frozen=True)
class TransposeAxisGeometry(AxisGeometry):
    """Transposed-convolution geometry along one spatial axis split over ``p`` workers.

    ``pad_lo``/``pad_hi`` are the (equal) padding ``p`` of torch's ``ConvTranspose``,
    which crops the output; ``output_padding`` lengthens it on the high side.  The
    mode is always ``"zeros"``.
    """

    output_padding: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.mode != "zeros":
            raise UnsupportedError(f"a transposed convolution pads nothing (padding_mode 'zeros' only), "
                                   f"got {self.mode!r}")
        if self.n < 1:
            raise ShapeError(f"the global input extent must be >= 1 (torch refuses empty spatial inputs), got {self.n}")
        if self.m < 1:
            raise ShapeError(f"the global output extent (n-1)*stride - 2*padding + dilation*(kernel-1) + "
                             f"output_padding + 1 = {self.m} is below 1 for input extent {self.n} ({self})")

    @property
    def m(self) -> int:
        return ((self.n - 1) * self.stride - self.pad_lo - self.pad_hi + self.dilation * (self.kernel - 1)
                + self.output_padding + 1)

    def needed_range(self, i: int) -> tuple[int, int]:
        """The smallest global input range ``[a, b)`` holding every input that reaches worker ``i``'s outputs.

        The hull over the kernel taps of the module docstring's ranges, clipped to ``[0, n)``
        (so dilation gaps at its ends are not staged); ``(0, 0)`` when no input reaches them.
        """
        o0, o1 = self.output_range(i)
        s, lo = self.stride, self.pad_lo
        a, b = self.n, 0
        for t in range(self.kernel if o1 > o0 else 0):
            shift = lo - t * self.dilation
            first = max(0, -((-(o0 + shift)) // s))  # ceil((o0 + shift) / s)
            last = min(self.n - 1, (o1 - 1 + shift) // s)
            if first <= last:
                a, b = min(a, first), max(b, last + 1)
        return (a, b) if a < b else (0, 0)

    def window(self, i: int) -> tuple[int, int]:
        """Global output range ``[start, stop)`` of the local transposed convolution of the staged inputs."""
        a, b = self.needed_range(i)
        if a == b:
            return self.output_range(i)[0], self.output_range(i)[0]
        start = a * self.stride - self.pad_lo
        return start, start + (b - a - 1) * self.stride + self.dilation * (self.kernel - 1) + 1

    def block_pads(self, i: int) -> tuple[int, int]:
        """``(lo, hi)`` to pad the window by to get exactly ``[o0, o1)``: negative crops, positive adds zeros."""
        o0, o1 = self.output_range(i)
        start, stop = self.window(i)
        return start - o0, o1 - stop


def transpose_plan(global_spatial: Sequence[int], grid: Sequence[int], kernel_size: Sequence[int],
                   stride: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
                   output_padding: Sequence[int]) -> HaloPlan:
    """The staging exchange of every worker of a spatial grid, for one global input shape.

    Raises :class:`~distfuse.errors.ShapeError` where torch refuses the geometry (an
    empty input extent, an output extent below 1).
    """
    return HaloPlan([TransposeAxisGeometry(n, g, k, s, d, p, p, "zeros", q)
                     for n, g, k, s, d, p, q in zip(global_spatial, grid, kernel_size, stride, dilation, padding,
                                                    output_padding, strict=True)])


def block_pads(plan: HaloPlan, index: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per spatial axis, :meth:`TransposeAxisGeometry.block_pads` of the worker at ``index``."""
    return tuple(ax.block_pads(i) for ax, i in zip(plan.axes, index, strict=True))
