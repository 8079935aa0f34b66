"""A one-program kernel that raises every owner's chunk flag, for producers that are not Triton kernels.

A library GEMM (cuBLAS) cannot raise a flag in its epilogue; launched after the last of
the W chunk GEMMs on the same stream, :func:`raise_every_chunk_flag_kernel` does, with the
same protocol as the Triton producers (:func:`~distfuse.kernels.jit_helpers.raise_flag`:
release at system scope): stream order puts it after the GEMMs' stores, and no host sync is
needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from distfuse.kernels.jit_helpers import raise_flag

__all__ = ["raise_every_chunk_flag_kernel"]


@triton.jit(do_not_specialize=["W", "rank"])
def raise_every_chunk_flag_kernel(flag_ptrs, W, rank, epoch_ptr):
    """One program: ``flags[c, rank] = epoch`` on every owner ``c`` (the system-scope release of each publishes every
    store the stream ordered before this launch)."""
    epoch = tl.load(epoch_ptr)
    c = tl.full([], 0, tl.int32)  # typed: a loop-carried counter keeps one type when compiled
    while c < W:  # a while loop: no runtime range bound
        flag = tl.load(flag_ptrs + c).to(tl.pointer_type(tl.int32)) + c * W + rank
        raise_flag(flag, epoch)
        c += 1
