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
dtypes), not of what may differ (each rank's own weight block).  Every rank compares every
peer's word with its own, so all ranks raise :class:`~distfuse.errors.ShapeError` (the
workspace's status check turns MISMATCH into it).  A signature is published before the
flags of the same op, which carry the epoch, so a word read after the flag wait is this
op's, never a stale one.

Two reserved (negative) words let a rank take part in an op without a payload, so that
its peers learn at once why it has none instead of waiting for a timeout (:func:`abstain`)::

    REFUSED  its own checks refused its input (a shard whose rows do not fit its block);
             it raises its own error, every peer a ShapeError naming it
    GROW     its call needs more workspace than the cached one holds; where every rank
             says GROW they grow it together, else every rank raises a ShapeError

A peer's status word keeps the reserved word it saw (MISMATCH otherwise), so the error
says which case it was.  The signature is a host integer baked into the launch: a captured
CUDA graph keeps it, which is right (a graph replays the captured shapes).  Costs two
one-program launches per op on a GPU (the check's grid also covers the output for the
poison, which is written only on a mismatch).
"""

from __future__ import annotations

import zlib

import torch
import triton
import triton.language as tl

from distfuse.kernels._utils import TIMED_WAITS, claimed_rank_view, timeout_arg
from distfuse.kernels.host_ints import cdiv, next_power_of_2
from distfuse.kernels.jit_helpers import wait_flag
from distfuse.kernels.launch_cache import cached_launch

__all__ = ["MISMATCH", "REFUSED", "GROW", "SCATTER_FLAGS", "GATHER_FLAGS", "consumer_flags", "shape_signature",
           "publish_signature", "check_signatures", "abstain", "agree_with_peers", "peer_signatures",
           "signatures_agree"]

#: The status word of a peer whose signature differs from this rank's (timeouts write the epoch, which is > 0).
MISMATCH = -1
#: The word of a rank whose own checks refused its input: it takes part without a payload, then raises its error.
REFUSED = -2
#: The word of a rank whose call needs a larger workspace than the cached one (see :func:`abstain`).
GROW = -3
#: Where a consumer finds the flag of peer ``s``: a reduce-scatter phase reads ``flags[rank, s]`` (the slot ``s``
#: wrote for this rank), an all-gather phase ``flags[s, s]`` (chunk ``s``, pushed by ``s``).
SCATTER_FLAGS, GATHER_FLAGS = "scatter", "gather"
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


@triton.jit
def peer_signatures(sigs_ptr, sig, pending, rank, W, W_BLOCK: tl.constexpr):
    """The ``[W_BLOCK]`` signature words of the peers whose flag came (``pending`` false), ``sig`` in every other
    lane (this rank, absent peers, peers whose flag never came), for :func:`signatures_agree`.

    A peer publishes its word before its flags (release), so once its flag is acquired the word is this op's.  A
    peer whose flag never came is the flag wait's failure, not a disagreement: its stale word is not read.  Apart
    from the comparison so that a consumer can issue the load, run its sums while it is in flight, and compare
    after them (``chunk_reduce``: one memory round trip fewer before its first block; one vector carried across
    the sums, which the masked load's ``other`` keeps to one).
    """
    src = tl.arange(0, W_BLOCK)
    read = (src < W) & (src != rank) & (pending == 0)
    return tl.load(sigs_ptr + src, mask=read, other=sig, volatile=True)


@triton.jit
def signatures_agree(got, sig, status_ptr, report, W_BLOCK: tl.constexpr):
    """Whether every word of :func:`peer_signatures` equals ``sig``.  ``report`` (one program): a disagreeing
    peer's status word gets its reserved word (negative: it refused or needed more room) or :data:`MISMATCH`, so
    the host can say why."""
    bad = got != sig
    if report:
        tl.store(status_ptr + tl.arange(0, W_BLOCK), tl.where(got < 0, got, -1), mask=bad)
    return tl.sum(bad.to(tl.int32), axis=0) == 0


@triton.jit
def agree_with_peers(sigs_ptr, sig, pending, rank, W, W_BLOCK: tl.constexpr, status_ptr, report):
    """Compare the signature word of every peer whose flag came (``pending`` false) with ``sig``; all agree?

    :func:`peer_signatures` then :func:`signatures_agree`: the comparison of :func:`check_signatures` (and of
    ``chunk_reduce``'s kernel, which splits the two around its sums).
    """
    return signatures_agree(peer_signatures(sigs_ptr, sig, pending, rank, W, W_BLOCK), sig, status_ptr, report,
                            W_BLOCK)


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
    # every peer's word is read: after a flag wait that gave up, a stale word may read as a disagreement (either way
    # the host raises)
    agree = agree_with_peers(sigs_ptr, sig, tl.zeros([W_BLOCK], tl.int32), rank, W, W_BLOCK, status_ptr, pid == 0)
    n_bad = 1 - agree.to(tl.int32)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    nan = tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    # The scalar count broadcast to the block first: the interpreter refuses a block & scalar mask.
    tl.store(out_ptr + offs, nan, mask=(offs < numel) & ((tl.zeros([BLOCK], tl.int32) + n_bad) > 0))


@triton.jit(do_not_specialize=["rank", "W", "word", "sig_offset"])
def _abstain_kernel(flag_ptrs, rank, W, word, sig_offset, epoch_ptr):
    """One program: ``sigs[rank] = word`` on every peer, then every flag ``flags[c, rank]`` of every rank (release).

    Every flag whose source is this rank, whatever the phase: the peers' consumers find the
    ones they wait on (a reduce-scatter's ``flags[p, rank]``, an all-gather's ``flags[rank, rank]``).
    """
    epoch = tl.load(epoch_ptr)
    for p in range(0, W):
        words = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        if p != rank:
            tl.atomic_xchg(words + sig_offset + rank, word, sem="release", scope="sys")
        for c in range(0, W):
            tl.atomic_xchg(words + c * W + rank, epoch, sem="release", scope="sys")


#: The per-op launches, through their binaries once the JIT has chosen them (:mod:`distfuse.kernels.launch_cache`).
_PUBLISH = cached_launch(_publish_signature_kernel)
_CHECK = cached_launch(_check_signatures_kernel)


def consumer_flags(layout: str, rank: int, world_size: int) -> dict:
    """``flag_base`` and ``flag_stride`` of :func:`check_signatures` for a phase's layout (``SCATTER_FLAGS`` or
    ``GATHER_FLAGS``)."""
    if layout == SCATTER_FLAGS:
        return dict(flag_base=rank * world_size, flag_stride=1)
    if layout == GATHER_FLAGS:
        return dict(flag_base=0, flag_stride=world_size + 1)
    raise ValueError(f"consumer_flags: layout {layout!r} is not {SCATTER_FLAGS!r} or {GATHER_FLAGS!r}")


def _sig_offset(st) -> int:
    """The signature words' offset in the header in int32 words (the same on every rank), from this rank's views."""
    return (st.sigs.data_ptr() - st.flags.data_ptr()) // 4


def _launch_check(st, rank: int, world_size: int, sig: int, flat: torch.Tensor, flag_base: int,
                  flag_stride: int) -> None:
    grid = (max(1, cdiv(flat.numel(), _POISON_BLOCK)),)
    _CHECK[grid](st.flags, st.sigs, st.status, flat, flat.numel(), rank, world_size, sig, flag_base, flag_stride,
                 st.epoch_dev, timeout_arg(st), TIMED=TIMED_WAITS, W_BLOCK=next_power_of_2(world_size),
                 BLOCK=_POISON_BLOCK)


def publish_signature(ws, rank: int, world_size: int, sig: int, op: str = "publish_signature") -> None:
    """Write ``sig`` into this rank's signature word on every peer; call inside the claim, before the producer."""
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    if world_size > 1:
        _PUBLISH[(1,)](st.flag_ptrs, rank, world_size, sig, _sig_offset(st))


def check_signatures(ws, rank: int, world_size: int, sig: int, out: torch.Tensor, *, flag_base: int,
                     flag_stride: int, op: str, what: str) -> None:
    """After this rank's consumer: compare every peer's signature with ``sig``; raise (every rank) on a mismatch.

    ``flags[flag_base + s * flag_stride]`` is the flag peer ``s`` raised for this rank's
    consumer (:func:`consumer_flags`).  ``out`` (contiguous) is poisoned on a mismatch.
    ``what`` describes this rank's call for the error message.
    """
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    if world_size == 1:
        return
    _launch_check(st, rank, world_size, sig, out.view(-1), flag_base, flag_stride)
    st.check_status(op, what)


def abstain(ws, rank: int, world_size: int, word: int, layout: str, *, op: str, what: str,
            raise_on_mismatch: bool) -> None:
    """Take part in this claim without a payload: publish ``word`` (:data:`REFUSED` or :data:`GROW`), raise every
    flag this rank owes its peers, pass the consumer's host barrier, wait for the peers' flags and compare words.

    Call inside the claim, in place of the phase's producer and consumer, so every peer's
    flag waits and barriers are met.  The peers' slots in this rank's buffer are left
    unread.  ``layout`` is the phase's (``SCATTER_FLAGS`` or ``GATHER_FLAGS``).
    ``raise_on_mismatch``: raise :class:`~distfuse.errors.ShapeError` if a peer's word
    differs from ``word`` (:data:`GROW`: the peers did not all ask to grow); else the caller
    raises its own error (:data:`REFUSED`).  Either way the status words are read before
    returning (a device sync), so no peer still writes into this rank's buffer once the
    caller lets the claim go.
    """
    st = claimed_rank_view(op, ws, rank, world_size, ws.device)
    if world_size == 1:
        return
    _abstain_kernel[(1,)](st.flag_ptrs, rank, world_size, word, _sig_offset(st), st.epoch_dev)
    st.wait_producers()  # the consumer's host barrier on CPU (every peer's consumer passes one)
    _launch_check(st, rank, world_size, word, torch.empty(0, device=ws.device), **consumer_flags(layout, rank,
                                                                                                   world_size))
    status = st.read_status_now()  # a sync: every flag wait of the check has finished
    if raise_on_mismatch:
        ws.raise_on_status(status, rank, ws.epoch, op, what)
