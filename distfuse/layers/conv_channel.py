"""Channel-distributed convolution: input and output split along channels only.

Partitions and shapes (``i`` output-channel block, ``j`` input-channel block)::

    P_x     [1, P_ci, 1, ...]       x        [B, Ci_j, *n]       on P_x worker (0, j)
    P_y     [1, P_co, 1, ...]       y        [B, Co_i, *m]       on P_y worker (0, i)
    P_w     [P_co, P_ci, 1, ...]    weight   [Co_i, Ci_j, *k]    on P_w worker (i, j)
                                    bias     [Co_i]              on P_w worker (i, 0)

    forward   xb_ij = Broadcast(P_x -> P_w)(x_j)                  along the P_co dimension
              y_ij  = convNd(pad(xb_ij), w_ij, b_i if j == 0, padding=0, stride, dilation)
              y_i   = SumReduce(P_w -> P_y)(y_ij)                 over j
    adjoint   dy_ij = Broadcast(dy_i); conv adjoints give dw_ij, db_i and dxb_ij;
              dx_j  = SumReduce(dxb_ij) over i                    (the x Broadcast's adjoint)

The spatial axes are whole on every worker, so torch's own padding (``F.pad`` with the
layer's mode) is already global; the input travels unpadded, which makes the broadcast
smaller than the general convolution's (which broadcasts the staged input).  Every
worker owns its weight block, so no weight moves.  This is the general convolution
(:mod:`~distfuse.layers.conv_general`) with ``P_s = 1``; it shares its construction,
checks, parameter handling and worker roles, including: ``groups > 1`` only with unsplit
channels (otherwise :class:`~distfuse.errors.UnsupportedError`), the agreement on the
call's metadata over the union of the partitions (a gather on the first call and on a
change, a one-element flag round while the workers' signatures repeat), every worker of
the union calling backward, and the compiled forward (here without a halo round).
"""

from __future__ import annotations

import torch

from distfuse.errors import PartitionError, where
from distfuse.layers._conv_block import pad_locally
from distfuse.layers.conv_general import DistributedGeneralConvBase
from distfuse.primitives._layout import memory_format_of

__all__ = ["DistributedChannelConvBase", "DistributedChannelConv1d", "DistributedChannelConv2d",
           "DistributedChannelConv3d"]


class DistributedChannelConvBase(DistributedGeneralConvBase):
    """Convolution with channels split and spatial axes whole (see the module docstring).

    Args: as :class:`~distfuse.layers.conv_general.DistributedGeneralConvBase`, with
    P_x ``[1, P_ci, 1, ...]``, P_y ``[1, P_co, 1, ...]`` and P_w ``[P_co, P_ci, 1, ...]``.
    """

    _stages_with_halo = False  # the input travels unpadded; compiled calls need no halo round

    def _check_partitions(self, op, P_x, P_y, P_w) -> None:
        for name, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
            if any(p != 1 for p in P.shape[2:]):
                raise PartitionError(f"{where(op)}: the channel-distributed convolution needs unsplit spatial axes, "
                                     f"but {name} is {list(P.shape)}; use the general distributed convolution")
        super()._check_partitions(op, P_x, P_y, P_w)

    def _stage(self, x: torch.Tensor, G) -> torch.Tensor:
        return x  # broadcast unpadded; every P_w worker pads its copy

    def _broadcast_spatial(self, plan, s) -> tuple[int, ...]:
        return plan.input_shape(s)

    def _local_input(self, xb: torch.Tensor) -> torch.Tensor:
        padded = pad_locally(self.opts, xb)
        fmt = memory_format_of(xb)
        if fmt != torch.contiguous_format and padded.dim() == xb.dim():
            # F.pad keeps channels_last except in circular mode (torch 2.13), which already copies: restore it.
            padded = padded.contiguous(memory_format=fmt)
        return padded


class DistributedChannelConv1d(DistributedChannelConvBase):
    """Channel-distributed ``Conv1d``: P_x ``[1, P_ci, 1]``, P_y ``[1, P_co, 1]``, P_w ``[P_co, P_ci, 1]``."""

    nd = 1


class DistributedChannelConv2d(DistributedChannelConvBase):
    """Channel-distributed ``Conv2d``."""

    nd = 2


class DistributedChannelConv3d(DistributedChannelConvBase):
    """Channel-distributed ``Conv3d``."""

    nd = 3
