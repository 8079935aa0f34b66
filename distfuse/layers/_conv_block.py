"""The local convolution of one worker's staged block, also where the block is empty.

* :func:`conv_block` is the local convolution, also where a worker's block is empty
  (torch refuses those, or answers with the wrong shape for zero input channels).
* Under ``torch.autocast`` the layers cast the input and the parameters first
  (:func:`~distfuse.layers._conv_call_info.cast_for_compute`) and :func:`conv_block` runs
  with autocast off, so that its fp32 computation of 16-bit CPU convolutions is not cast back.
* :func:`conv_output_format` asks torch which memory format its convolution returns, so
  that workers holding no input agree with the ones that do.
* :func:`pad_locally` pads a block that spans the whole spatial domain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from distfuse.layers._conv_common import ConvOptions
from distfuse.primitives._layout import memory_format_of, zeros_in

__all__ = ["conv_block", "conv_output_format", "pad_locally"]

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class _ZeroBlock(torch.autograd.Function):
    """Zeros of a given shape that keep ``x`` and ``w`` in the graph (their gradients are zero).

    A worker whose output block is empty, or whose input channel block is empty, still
    has to run the adjoints of the exchanges that produced ``x`` and ``w``: its peers
    wait for its (empty or zero) contribution.
    """

    @staticmethod
    def forward(ctx, x, w, shape, memory_format=torch.contiguous_format):
        ctx.x_meta = (x.shape, x.dtype, x.device, memory_format_of(x))
        ctx.w_meta = (w.shape, w.dtype, w.device)
        return zeros_in(shape, memory_format, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        xs, xd, xdev, xfmt = ctx.x_meta
        ws, wd, wdev = ctx.w_meta
        return zeros_in(xs, xfmt, dtype=xd, device=xdev), torch.zeros(ws, dtype=wd, device=wdev), None, None


_OUTPUT_FORMATS: dict[tuple, torch.memory_format] = {}


def conv_output_format(device: torch.device, dtype: torch.dtype, input_format: torch.memory_format,
                       nd: int) -> torch.memory_format:
    """The memory format torch's ``convNd`` returns for an input in ``input_format`` (contiguous weight).

    Asked of torch once per (device type, dtype, format, nd) with a tiny convolution,
    because it differs by backend and version (torch 2.13: CPU Conv2d keeps
    ``channels_last``, CPU Conv3d returns NCDHW for ``channels_last_3d``).  Workers that
    hold no input (the receivers of a sum-reduce) use it to agree with the ones that do.
    """
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # conv_block computes 16-bit CPU convolutions in fp32
    key = (device.type, dtype, input_format, nd)
    if key not in _OUTPUT_FORMATS:
        if input_format == torch.contiguous_format:
            _OUTPUT_FORMATS[key] = input_format
        else:
            x = torch.zeros((1, 2) + (3,) * nd, dtype=dtype, device=device).contiguous(memory_format=input_format)
            w = torch.zeros((2, 2) + (1,) * nd, dtype=dtype, device=device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                y = CONV[nd](x, w)
            _OUTPUT_FORMATS[key] = memory_format_of(y)
    return _OUTPUT_FORMATS[key]


def conv_block(opts: ConvOptions, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               out_shape: Sequence[int], input_format: torch.memory_format | None = None) -> torch.Tensor:
    """``convNd(x, w, b, stride, padding=0, dilation, groups)`` with the expected ``out_shape``.

    ``x`` is already padded (staged).  Where the output or the reduction is empty the
    result is zeros (plus the bias), still differentiable in ``x``, ``w`` and ``b``, in
    the format torch's convolution returns for ``input_format`` (default: ``x``'s; an
    empty block is dense in every format, so the layers pass the agreed one).
    """
    if torch.is_autocast_enabled(x.device.type):
        # The caller cast x, w and b to the autocast dtype already (cast_for_compute); autocast would otherwise
        # cast this function's fp32 computation of 16-bit CPU convolutions back to 16 bits.
        with torch.autocast(x.device.type, enabled=False):
            return conv_block(opts, x, w, b, out_shape, input_format)
    nd = opts.nd
    if 0 in out_shape or 0 in x.shape[1:] or 0 in w.shape[:2]:
        fmt = conv_output_format(x.device, x.dtype, input_format or memory_format_of(x), nd)
        y = _ZeroBlock.apply(x, w, tuple(out_shape), fmt)
        if b is not None:
            y = y + b.view(1, -1, *([1] * nd))
        return y
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        # torch 2.13's CPU oneDNN path computes 16-bit strided conv3d wrongly on one thread (x [1,1,5,5,3],
        # w [2,1,3,3,3], stride (1,1,3): errors of ~10 on outputs of ~5; right with 2 threads).  Rank pools
        # run one thread per rank, so compute in fp32 and round once: the accurate result of the 16-bit op.
        y = CONV[nd](x.float(), w.float(), None if b is None else b.float(), opts.stride, 0, opts.dilation,
                     opts.groups)
        return y.to(x.dtype)
    return CONV[nd](x, w, b, opts.stride, 0, opts.dilation, opts.groups)


def pad_locally(opts: ConvOptions, x: torch.Tensor) -> torch.Tensor:
    """Pad a block that spans the whole spatial domain (torch's own ``F.pad`` modes are then global)."""
    flat = [v for lo_hi in reversed(opts.padding) for v in lo_hi]
    if not any(flat):
        return x
    if opts.padding_mode == "zeros" or x.numel() == 0:  # torch's other modes refuse empty channel blocks
        return F.pad(x, flat)
    return F.pad(x, flat, mode=opts.padding_mode)
