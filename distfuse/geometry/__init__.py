"""Pure geometry below the primitives and the kernels: who owns what, who sends what to whom.

Nothing here communicates, and no module here imports ``torch`` or ``torch.distributed``
itself (the error classes come from :mod:`distfuse.errors`, which reads the rank for its
messages).  Every function is a pure function of shapes, so every rank computes the same
answer without talking.

* :mod:`~distfuse.geometry.decomposition`: the balanced decomposition of extents over grids.
* :mod:`~distfuse.geometry.halo_plan`: the exact halo geometry of a partitioned convolution
  (:class:`HaloPlan`), and :func:`read_box` / :func:`adjoint_box`, which apply a piece's
  per-axis steps to a tensor box.
* :mod:`~distfuse.geometry.broadcast_plan`: the source of every destination worker in a
  Broadcast or a SumReduce (:class:`BroadcastPlan`).

Layering: ``primitives/`` and ``kernels/`` import this package; it imports neither of
them, nor ``fused/`` or ``layers/``.
"""

from distfuse.geometry.broadcast_plan import BroadcastPlan, check_gathered_inputs, grid_shape
from distfuse.geometry.decomposition import (
    block_extent,
    block_range,
    block_start,
    local_shape,
    local_slices,
    local_start,
    owner_of,
)
from distfuse.geometry.halo_plan import (
    PADDING_MODES,
    AxisGeometry,
    HaloPlan,
    Piece,
    Segment,
    adjoint_box,
    conv_output_extent,
    read_box,
    resolve_padding,
)

__all__ = [
    "block_extent", "block_start", "block_range", "local_shape", "local_start", "local_slices", "owner_of",
    "PADDING_MODES", "AxisGeometry", "Segment", "Piece", "HaloPlan", "resolve_padding", "conv_output_extent",
    "read_box", "adjoint_box",
    "BroadcastPlan", "grid_shape", "check_gathered_inputs",
]
