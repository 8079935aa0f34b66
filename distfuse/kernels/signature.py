"""The agreement check of the GEMM fusions: each rank publishes a signature of its call; consumers compare them.

Ranks that enter a fused op with different shapes or dtypes (one rank's row count, fp16
on one rank and bf16 on another) would otherwise read each other's bytes as whatever
they expect: garbage that passes for a result.  A host-side check would cost a
collective per call.  Instead, inside the op's claim::

    producer side  publish_signature: sigs[rank] = sig on every peer (release, system scope),
                   issued before the producer, whose flags follow it in stream order
    consumer side  (after the consumer kernel) check_signatures: wait for each peer's flag
                   of this epoch (immediate: the consumer already waited), then compare
                   each peer's published word with this rank's signature; a mismatch sets
                   the peer's status word to MISMATCH (-1) and poisons the output (NaN)

``sig`` is a 31-bit hash (:func:`shape_signature`) of what every rank must agree on (the
op, the leading dims, the gathered or scattered extent, the shared feature extent, the
dtypes); what may differ between ranks (each rank's own weight block) stays out of it.
Every rank compares every peer's word with its own, so a rank that differs sees all its
peers differ and each peer sees it: all ranks raise :class:`~distfuse.errors.ShapeError`
(the workspace's status check turns MISMATCH into it, see
:meth:`~distfuse.fused.workspace._Workspace.raise_on_status`).  Flags carry the epoch, and
a signature is published before the flags of the same op, so a word read after the flag
wait is this op's, never a stale one.

The signature is a host integer baked into the launch: a captured CUDA graph keeps it,
which is right (a graph replays the captured shapes).  Costs two one-program launches
per op on a GPU (the check's grid also covers the output for the poison, which is written
only on a mismatch).
"""

from __future__ import annotations

import zlib

import torch
import triton
import triton.language as tl

from distfuse.kernels._utils import TIMED_WAITS, claimed_rank_view, timeout_arg
from distfuse.kernels.jit_helpers import wait_flag

__all__ = ["MISMATCH", "shape_signature", "publish_signature", "check_signatures"]

#: The status word of a peer whose signature differs from this rank's (timeouts write the epoch, which is > 0).
MISMATCH = -1
_POISON_BLOCK = 1024


def shape_signature(*parts) -> int:
    """A 31-bit, never-zero hash of ``parts`` (ints, strings, dtypes, tuples): equal calls, equal words."""
    h = zlib.crc32(repr(tuple(str(p) for p in parts)).encode()) & 0x7FFFFFFF
    return h or 1


@triton.jit(do_not_specialize=["rank", "W", "sig", "sig_offset"])
def _publish_signature_kernel(flag_ptrs, rank, W, sig, sig_offset):
    """One program: ``sigs[rank] = sig`` in every peer's header (``flag_ptrs``: every peer's header words)."""
    for p in range(0, W):
        if p != rank:
            word = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32)) + sig_offset + rank
            tl.atomic_xchg(word, sig, sem="release", scope="sys")


@triton.jit(do_not_specialize=["numel", "rank", "W", "sig", "flag_base", "flag_stride", "timeout"])
def _check_signatures_kernel(flags_ptr, sigs_ptr, status_ptr, out_ptr, numel, rank, W, sig, flag_base, flag_stride,
                             epoch_ptr, timeout, TIMED: tl.constexpr, W_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Wait for every peer's flag ``flags[flag_base + s * flag_stride]`` of this epoch, compare ``sigs[s]`` with
    ``sig``; a mismatch sets ``status[s] = MISMATCH`` (program 0) and fills ``out`` with NaN (every program a block)."""
    epoch = tl.load(epoch_ptr)
    pid = tl.program_id(0)
    for s in range(0, W):
        if s != rank:
            wait_flag(flags_ptr + flag_base + s * flag_stride, epoch, status_ptr + s, timeout, TIMED)
    src = tl.arange(0, W_BLOCK)
    peer = (src < W) & (src != rank)
    got = tl.load(sigs_ptr + src, mask=peer, other=0, volatile=True)
    bad = peer & (got != sig)
    if pid == 0:
        tl.store(status_ptr + src, tl.full([W_BLOCK], -1, tl.int32), mask=bad)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    nan = tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    # The scalar count broadcast to the block first: the interpreter refuses a block & scalar mask.
    tl.store(out_ptr + offs, nan, mask=(offs < numel) & ((tl.zeros([BLOCK], tl.int32) + n_bad) > 0))


def publish_signature(ws, rank: int, world_size: int, sig: int, op: str = "publish_signature") -> None:
    """Write ``sig`` into this rank's signature word on every peer; call inside the claim, before the producer."""
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    if world_size > 1:
        # The signature words' offset in the header (the same on every rank), from this rank's own views of it.
        sig_offset = (st.sigs.data_ptr() - st.flags.data_ptr()) // 4
        _publish_signature_kernel[(1,)](st.flag_ptrs, rank, world_size, sig, sig_offset)


def check_signatures(ws, rank: int, world_size: int, sig: int, out: torch.Tensor, *, flag_base: int,
                     flag_stride: int, op: str, what: str) -> None:
    """After this rank's consumer: compare every peer's signature with ``sig``; raise (every rank) on a mismatch.

    ``flags[flag_base + s * flag_stride]`` is the flag peer ``s`` raised for this rank's
    consumer (the all-gather: ``flags[s, s]``, base 0, stride W + 1; the reduce-scatter:
    ``flags[rank, s]``, base ``rank * W``, stride 1).  ``out`` (contiguous) is poisoned on a
    mismatch.  ``what`` describes this rank's call for the error message.
    """
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    if world_size == 1:
        return
    flat = out.view(-1)
    grid = (max(1, triton.cdiv(flat.numel(), _POISON_BLOCK)),)
    _check_signatures_kernel[grid](st.flags, st.sigs, st.status, flat, flat.numel(), rank, world_size, sig,
                                   flag_base, flag_stride, st.epoch_dev, timeout_arg(st), TIMED=TIMED_WAITS,
                                   W_BLOCK=triton.next_power_of_2(world_size), BLOCK=_POISON_BLOCK)
    st.check_status(op, what)
