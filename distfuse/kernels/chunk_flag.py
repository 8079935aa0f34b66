"""A one-program kernel that raises one chunk flag, for producers that are not Triton kernels.

A library GEMM (cuBLAS) cannot raise a flag in its epilogue; launched right after it on
the same stream, :func:`raise_chunk_flag_kernel` does, with the same protocol as the
Triton producers (:func:`~distfuse.kernels.jit_helpers.raise_flag`: release at system
scope): stream order puts it after the GEMM's stores, and no host sync is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from distfuse.kernels.jit_helpers import raise_flag

__all__ = ["raise_chunk_flag_kernel"]


@triton.jit(do_not_specialize=["chunk", "W", "rank"])
def raise_chunk_flag_kernel(flag_ptrs, chunk, W, rank, epoch_ptr):
    """One program: ``flags[chunk, rank] = epoch`` on owner ``chunk`` (``flag_ptrs``: every owner's flag words)."""
    epoch = tl.load(epoch_ptr)  # the workspace's device epoch (advanced in stream order)
    flag = tl.load(flag_ptrs + chunk).to(tl.pointer_type(tl.int32)) + chunk * W + rank
    raise_flag(flag, epoch)
