"""Memory formats: which layout a block is in, and buffers and messages in an agreed layout.

torch's convolutions keep ``channels_last`` (4-D) and ``channels_last_3d`` (5-D) inputs in
that layout where the backend computes in it, so the primitives follow the input instead
of forcing NCHW: the halo exchange stages into a buffer in the input's format, and a
broadcast or sum-reduce of blocks moves them in a format both ends agreed on (the sender's
block is then its message as it is, and the receiver's buffer has the same byte order).
Small messages (halo boxes, packed parameters) stay plain contiguous.  A tensor dense in
both layouts (one channel, or one spatial element) is reported as contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["memory_format_of", "format_code", "format_of_code", "empty_in", "zeros_in", "copy_in", "as_message",
           "stacked_in", "FORMAT_CODES"]

FORMAT_CODES = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
_FORMAT_OF_DIM = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """``channels_last`` / ``channels_last_3d`` when ``t`` is dense in it and not plain contiguous, else contiguous."""
    fmt = _FORMAT_OF_DIM.get(t.dim())
    if fmt is not None and not t.is_contiguous() and t.is_contiguous(memory_format=fmt):
        return fmt
    return torch.contiguous_format


def format_code(fmt: torch.memory_format) -> int:
    return FORMAT_CODES.index(fmt)


def format_of_code(code: int) -> torch.memory_format:
    return FORMAT_CODES[int(code)] if 0 <= int(code) < len(FORMAT_CODES) else torch.contiguous_format


def _applied(shape: Sequence[int], fmt) -> torch.memory_format:
    """``fmt`` where it applies to a tensor of ``shape``'s rank (None: never), else contiguous."""
    return fmt if fmt is not None and _FORMAT_OF_DIM.get(len(shape)) == fmt else torch.contiguous_format


def empty_in(shape: Sequence[int], fmt, *, dtype, device) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` in ``fmt`` (contiguous where ``fmt`` does not apply to its rank)."""
    shape = tuple(int(s) for s in shape)
    return torch.empty(shape, dtype=dtype, device=device, memory_format=_applied(shape, fmt))


def zeros_in(shape: Sequence[int], fmt, *, dtype, device) -> torch.Tensor:
    """Zeros of ``shape`` in ``fmt`` (see :func:`empty_in`)."""
    return empty_in(shape, fmt, dtype=dtype, device=device).zero_()


def copy_in(t: torch.Tensor, fmt, *, dtype) -> torch.Tensor:
    """A new tensor of ``t``'s values as ``dtype``, dense in ``fmt`` (see :func:`empty_in`): one pass."""
    return t.to(dtype, copy=True, memory_format=_applied(t.shape, fmt))


def as_message(t: torch.Tensor, fmt) -> torch.Tensor:
    """``t`` dense in ``fmt`` (its bytes are the message); no copy when it already is."""
    return t.contiguous(memory_format=_applied(t.shape, fmt))


def stacked_in(k: int, shape: Sequence[int], fmt, *, dtype, device) -> torch.Tensor:
    """``[k, *shape]`` whose every ``[i]`` is dense in ``fmt``: one buffer for ``k`` messages of one block shape."""
    shape = tuple(int(s) for s in shape)
    if _applied(shape, fmt) != torch.contiguous_format and k > 0:
        return empty_in((k * shape[0],) + shape[1:], fmt, dtype=dtype, device=device).view((k,) + shape)
    return torch.empty((k,) + shape, dtype=dtype, device=device)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of ``t``'s bytes for a point-to-point message (gloo and NCCL take contiguous tensors).

    A block dense in ``channels_last`` is the contiguous ``[B, H, W, C]`` tensor of the same
    memory, so it travels without a copy; both ends hold the same format (the layers agree on it).
    """
    if memory_format_of(t) is torch.contiguous_format:
        return t  # contiguous, or torch.distributed names the problem ("input tensor has to be contiguous")
    return t.permute(0, *range(2, t.dim()), 1)  # [B, *spatial, C]
