"""Version differences of torch.distributed that distfuse papers over (torch 2.5 to 2.13).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns on every call of the old
names; 2.5 to 2.11 have only the old names.  Both take flat buffers: gloo rejects a
``[P, n]`` output for an ``[n]`` input ("invalid tensor size"), so callers pass a 1-D
output of ``P * n`` elements and view it afterwards.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output, input, group=None, async_op: bool = False):  # noqa: A002 - torch's names
    """``output[i*n:(i+1)*n] = input of rank i``; ``output`` is 1-D with ``P * input.numel()`` elements."""
    return _ALL_GATHER(output, input.reshape(-1), group=group, async_op=async_op)


def reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):  # noqa: A002
    """``output = sum over ranks of input[rank*n:(rank+1)*n]``; ``input`` is 1-D with ``P * output.numel()``."""
    return _REDUCE_SCATTER(output.view(-1), input.reshape(-1), op=op, group=group, async_op=async_op)
