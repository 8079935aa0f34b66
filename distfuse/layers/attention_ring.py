"""Context-parallel ring attention (unfused): the sequence split over ``P_cp``, K/V blocks travel round the ring.

Shapes (``W`` workers on the ring, worker ``r`` at ring position ``P_cp.rank``; ``G = Hq / Hkv``)::

    q        [B, Hq,  S_r, D]   this worker's query rows: global positions local_positions(S, W, r, layout)
    k, v     [B, Hkv, S_r, D]   the keys and values of the same positions (only the Hkv heads travel)
    attn_mask [B, S_r] bool     optional key-padding mask of the local keys (True = attend); travels with k, v
    out      [B, Hq,  S_r, D]   softmax(scale * q k^T + mask) v over ALL S global keys, this worker's rows
    lse      [B, Hq,  S_r]      (kept for the backward) log-sum-exp of each row's scores, fp32 for 16-bit inputs

Forward (``W`` steps; at step ``t`` worker ``r`` holds the K/V block of worker ``src = (r - t) mod W``)::

    step t:   post  send block(src) -> r+1,  recv block(src-1) <- r-1          (t < W-1; one flat message)
              local for each (query run, key run) pair that is not fully masked:
                        s = scale q_i k_j^T  (masked to -inf)
                        m' = max(m, rowmax s);  l = l e^(m-m') + rowsum e^(s-m');  acc = acc e^(m-m') + e^(s-m') v_j
              wait
    end:      out = acc / l,  lse = m + log l

GQA expands nothing: ``q`` is viewed as ``[B, Hkv, G * S_r, D]`` (query head ``h`` uses K/V head
``h // G``), so each K/V head's scores are one batched GEMM against its ``G`` query heads, and
``dS^T q`` sums the group's gradients by the same GEMM.  16-bit inputs are computed in fp32
(the blocks travel in the input dtype).

Backward (the standard ring-attention adjoint, ``distfuse::ring_attention_backward``).  With
``P = exp(s - lse)`` (the softmax, recomputed block by block from the saved global ``lse``) and
``dO`` the output gradient, for each block ``j`` of keys::

    dV_j  = P_j^T dO                    [B, Hkv, S_j, D]   (sums the G query heads of a group)
    dP_j  = dO V_j^T                    [B, Hkv, G S_r, S_j]
    dS_j  = P_j * (dP_j - delta),       delta = rowsum(dO * out)   (= rowsum(P * dP) over ALL keys,
                                                                     so it is local: no extra round)
    dQ   += scale dS_j K_j              (stays on this worker)
    dK_j  = scale dS_j^T q              [B, Hkv, S_j, D]

Why it is the adjoint: ``out = P V`` with ``P = softmax(s)`` row by row; ``d out / d V`` gives
``P^T dO``; the softmax's Jacobian ``diag(P) - P P^T`` applied to ``dP`` gives ``P * (dP - rowsum(P
* dP))``, and ``rowsum(P * dP) = rowsum(P * (dO V^T)) = dO . (P V) = dO . out``.  Every key block's
terms are additive, so the blocks may be visited in any order, as long as each block's ``dK_j, dV_j``
(summed over every worker's queries) reach its owner.  Hence the ring again, the ``dK, dV``
accumulators one step behind the K/V blocks: at step ``t`` worker ``r`` adds its terms for block
``src`` to the accumulator that arrived from ``r - 1`` and passes it on; after ``W`` sends every
accumulator is back with its block's owner::

    step t:   post  kv send/recv as in the forward                           (t < W-1)
              local dQ, dK_src, dV_src terms
              wait  dkv(src) <- r-1  (posted in step t-1);  add it          (t > 0)
              post  send dkv(src) -> r+1,  recv dkv(src-1) <- r-1
              wait  kv
    end:      wait  dkv(own block)

So each step's GEMMs run while the next K/V block and the previous accumulator are in flight.

Layouts (``layout=``, :func:`local_positions`; only the causal mask reads them).
``"contiguous"``: the balanced block (any ``S``; causal attention is then unbalanced, worker
``W - 1`` computing ``W`` blocks and worker 0 one).  ``"zigzag"`` (:func:`load_balanced_split`):
fully masked (query run, key run) pairs are skipped, so every worker computes half a block
per causal step.  A query row with nothing to attend to returns zeros and gets zero
gradients (``scaled_dot_product_attention`` returns NaN there).

``P_cp`` is a 1-D partition whose rank order is the ring order (such as the sequence axis
of a ``[data, context]`` grid).  Each step is one ``batch_isend_irecv`` on distfuse's world
group, waited on later; on the fused path (registry entry ``ring_attention``, default
"never") the sender instead pushes the block into the next worker's slot of the ring's
symmetric workspace (:mod:`distfuse.fused.ring_push`), bitwise the same result.  The workers
agree on the call over ``P_cp``: 4-D ``q, k, v`` of one dtype, ``Hq % Hkv == 0``, the same
``B, Hq, Hkv, D``, ``causal``, ``layout``, ``scale``, mask presence and grad setting, and
local lengths that are the layout's blocks of one ``S``.  The functional form keeps one
session per ``P_cp``; :class:`DistributedAttention` owns its own (one module per call site).

The whole ring is one op, ``distfuse::ring_attention(q, k, v, mask?, handle, S, causal,
layout, scale, fused) -> (out, lse)``, with its registered backward
``distfuse::ring_attention_backward`` (both ``ORDERED``), built like the fused linears'
phase ops.  First-order only: ``create_graph=True`` is refused by name.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, where
from distfuse.geometry.decomposition import block_extent, block_start
from distfuse.groups import WorldTable, world_group
from distfuse.partition import Partition, zero_volume_tensor
from distfuse.primitives._common import (
    check_inactive_input,
    collective_guard,
    dtype_code,
    dtype_of_code,
    first_order_only,
    gather_records,
)
from distfuse.primitives._handles import HandleOwner, lookup, new_handle
from distfuse.primitives._op_pair import OpEntry, ordered
from distfuse.primitives.agreement_session import AgreementSession

__all__ = ["distributed_attention", "DistributedAttention", "load_balanced_split", "load_balanced_order",
           "local_positions", "check_agreed"]

OP = "distributed_attention"
LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------- layouts (pure arithmetic)

def _check_zigzag(S: int, W: int, op: str = OP) -> int:
    if W < 1 or S < 0 or S % (2 * W):
        raise ShapeError(f"{where(op)}: the zigzag layout cuts the sequence into 2W = {2 * W} equal chunks, so the "
                         f"global length must be a multiple of {2 * W}; got S = {S} (use layout='contiguous' for "
                         "any S)")
    return S // (2 * W)


def load_balanced_split(S: int, W: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The zigzag layout: worker ``i`` holds the global ranges ``[i c, (i+1) c)`` and ``[(2W-1-i) c, (2W-i) c)``.

    ``c = S / (2W)``; ``S`` must be a multiple of ``2W``.  Returns one pair of half-open ranges per worker,
    early chunk first (the local rows are the early chunk, then the late one).  Under a causal mask every
    worker then has the same work (see the module docstring).
    """
    c = _check_zigzag(S, W, "load_balanced_split")
    return [((i * c, (i + 1) * c), ((2 * W - 1 - i) * c, (2 * W - i) * c)) for i in range(W)]


def load_balanced_order(S: int, W: int) -> torch.Tensor:
    """Global positions in zigzag order (int64 ``[S]``): ``x.index_select(dim, order)`` followed by an even split
    into ``W`` blocks gives each worker its zigzag rows; ``order.argsort()`` undoes it."""
    return torch.cat([torch.arange(a, b) for pair in load_balanced_split(S, W) for a, b in pair])


def _runs(S: int, W: int, i: int, layout: str) -> list[tuple[int, int, int]]:
    """Worker ``i``'s rows as runs ``(local start, global start, length)`` (empty runs kept)."""
    if layout == "zigzag":
        c = _check_zigzag(S, W)
        return [(0, i * c, c), (c, (2 * W - 1 - i) * c, c)]
    return [(0, block_start(S, W, i), block_extent(S, W, i))]


def _local_len(S: int, W: int, i: int, layout: str) -> int:
    return S // W if layout == "zigzag" else block_extent(S, W, i)


def local_positions(S: int, W: int, index: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions (int64 ``[S_index]``) of worker ``index``'s rows under ``layout`` (for rotary embeddings,
    position ids, and tests)."""
    if layout not in LAYOUTS:
        raise UnsupportedError(f"local_positions: layout must be one of {LAYOUTS}, got {layout!r}")
    return torch.cat([torch.arange(g, g + n) for _, g, n in _runs(S, W, index, layout)])


# ---------------------------------------------------------------- the agreement

_PROBLEMS = (
    "",
    "q, k and v must be tensors, and attn_mask a tensor or None",
    "q, k and v must be 4-D: [B, H, S_local, D]",
    "q, k and v must share one floating dtype",
    "k and v must have the same shape [B, Hkv, S_local, D]",
    "q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D] must agree on B, S_local and D",
    "Hq (q's heads) must be a positive multiple of Hkv (k's and v's heads)",
    "attn_mask must be a bool key-padding mask [B, S_local] (True = attend)",
    "q, k, v (and attn_mask) must be on the partition's device type",
    f"layout must be one of {LAYOUTS}",
)


def _local_problem(P, q, k, v, mask, layout) -> int:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not (mask is None or isinstance(mask, torch.Tensor)):
        return 1
    if layout not in LAYOUTS:
        return 9
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return 2
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return 3
    if k.shape != v.shape:
        return 4
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        return 5
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        return 6
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (q.shape[0], q.shape[2])):
        return 7
    if any(t.device.type != P.device.type for t in (q, k, v) + ((mask,) if mask is not None else ())):
        return 8
    return 0


def _shape4(t) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4


def _record(problem, q, k, v, mask, causal, layout, scale, grad) -> list[int]:
    ok = problem == 0
    return [problem, *_shape4(q), *_shape4(k), *_shape4(v),
            dtype_code(q.dtype) if ok else -1,
            int(mask is not None), *(list(mask.shape) if ok and mask is not None else [-1, -1]),
            int(bool(causal)), LAYOUTS.index(layout) if layout in LAYOUTS else -1,
            struct.unpack("<q", struct.pack("<d", float(scale) if scale is not None else math.nan))[0],
            int(grad)]


def _signature(problem, q, k, v, mask, causal, layout, scale, grad, devices) -> tuple:
    """This worker's signature of a call: what decides the agreed state (no host packing, so it traces)."""
    ok = problem == 0
    return (problem, tuple(_shape4(q)), tuple(_shape4(k)), tuple(_shape4(v)), q.dtype if ok else None,
            None if mask is None or not ok else tuple(mask.shape), bool(causal), layout, scale, bool(grad), devices)


def check_agreed(op: str, what: str, P, rows: list[list[int]], names: dict[int, str], show: dict | None = None) -> None:
    """Raise the same ShapeError on every worker unless every worker's record holds one value in each slot of
    ``names`` (``show`` formats a slot's values for the message)."""
    for slot, name in names.items():
        vals = {P.ranks[i]: r[slot] for i, r in enumerate(rows)}
        if len(set(vals.values())) > 1:
            fmt = (show or {}).get(slot, lambda x: x)
            raise ShapeError(f"{where(op)}: the workers of {what} must agree on {name}; got "
                             f"{ {w: fmt(x) for w, x in vals.items()} } (world rank: value)")


def _check_records(op: str, P, rows: list[list[int]], layout: str) -> int:
    """The agreed global length ``S``; every worker runs this on the same records, so it raises the same error
    everywhere."""
    bad = [(P.ranks[i], r) for i, r in enumerate(rows) if r[0] != 0]
    if bad:
        raise ShapeError(f"{where(op)}: " + "; ".join(
            f"world rank {w}: {_PROBLEMS[r[0]]} (got q {r[1:5]}, k {r[5:9]}, v {r[9:13]})" for w, r in bad))
    check_agreed(op, "P_cp", P, rows, {1: "batch B", 2: "query heads Hq", 6: "key/value heads Hkv", 4: "head dim D",
                                       13: "dtype", 14: "attn_mask given", 17: "causal", 18: "layout", 19: "scale",
                                       20: "grad setting (grad mode on and an input that requires grad)"},
                 {13: lambda x: str(dtype_of_code(x)), 18: lambda x: LAYOUTS[x],
                  19: lambda x: struct.unpack("<d", struct.pack("<q", x))[0]})
    W, S = P.size, sum(r[3] for r in rows)
    for i, r in enumerate(rows):
        want = _local_len(S, W, i, layout)  # raises for a zigzag S that 2W does not divide
        if r[3] != want:
            raise ShapeError(f"{where(op)}: the local sequence lengths are not the {layout} layout's blocks of "
                             f"S = {S} over W = {W}: world rank {P.ranks[i]} (ring position {i}) holds {r[3]} rows, "
                             f"expected {want} (got {[x[3] for x in rows]} in ring order)")
    return S


class _Ring(HandleOwner):
    """A call site's ring: ``P`` (``P_cp``) and its :class:`AgreementSession`; ``handle`` names it in graphs (made
    in the same order on every worker, so that the handles agree)."""

    def __init__(self, op: str, P):
        self.P = P
        self.session = AgreementSession(op, P)
        self.handle = new_handle(self)
        self.last_decision = None  # the path of the latest call (the transport: fused push or isend / irecv)


_RINGS: WorldTable = WorldTable()  # per world: a ring holds its partition's groups


def _ring_of(P) -> _Ring:
    """The functional form's ring of ``P``: one agreement session per partition, made on its first call (a compiled
    call before any eager one is refused by the fresh session's replay, as a module's)."""
    key = (P.ranks, getattr(P, "shape", None))
    rings = _RINGS.current()
    if key not in rings:
        rings[key] = _Ring(OP, P)
    return rings[key]


def _check_partition(P) -> None:
    if not isinstance(P, Partition):
        raise PartitionError(f"{where(OP)}: P_cp must be a distfuse Partition, got {type(P).__name__}")
    shape = getattr(P, "shape", (P.size,))
    if sum(1 for s in shape if s > 1) > 1:
        raise PartitionError(f"{where(OP)}: P_cp must be 1-D (one extent above 1: the ring), got shape {list(shape)}; "
                             "take the sequence axis of a larger grid with create_cartesian_subtopology_partition")


# ---------------------------------------------------------------- point-to-point rounds

class _PointToPoint:
    """The unfused ring's transport: each exchange one ``batch_isend_irecv`` on distfuse's world group (send to the
    next worker, receive from the previous one), waited on in ``finish``.  Channel 0 carries K/V blocks, channel 1
    the dK/dV accumulators; their tags keep the two streams apart (both run r -> r+1 and overlap in time)."""

    _TAGS = (0x2A71, 0x2A72)

    def __init__(self, geo: _Geo):
        self.next, self.prev = geo.ranks[(geo.r + 1) % geo.W], geo.ranks[(geo.r - 1) % geo.W]

    def post(self, channel: int, block: torch.Tensor, recv_numel: int):
        recv, group = block.new_empty(recv_numel), world_group()
        ops = [dist.P2POp(fn, t, peer, group=group, tag=self._TAGS[channel])
               for fn, t, peer in ((dist.isend, block, self.next), (dist.irecv, recv, self.prev)) if t.numel()]
        with collective_guard(OP, "ring step (post)", [o.peer for o in ops], group):
            works = dist.batch_isend_irecv(ops) if ops else []
        return recv, works, block  # the block stays referenced until finish: the send may still read it

    def finish(self, pending) -> torch.Tensor:
        recv, works, _ = pending
        with collective_guard(OP, "ring step", (self.next, self.prev)):
            for w in works:
                w.wait()
        return recv


def _transport(geo: _Geo, k: torch.Tensor, acc_t: torch.dtype | None = None):
    """The ring's transport, a context manager: the symmetric-memory push where the call's decision was ``fused``,
    else point-to-point.  ``acc_t``: the dK/dV accumulators' dtype (a backward ring: both channels)."""
    if not geo.fused or geo.W == 1:
        return contextlib.nullcontext(_PointToPoint(geo))
    from distfuse.fused.ring_push import SymmetricRing

    kv = max(_kv_numel(geo, i) for i in range(geo.W)) * k.dtype.itemsize
    dkv = 0 if acc_t is None else max(2 * geo.B * geo.Hkv * geo.length(i) * geo.D for i in range(geo.W)) * \
        acc_t.itemsize
    return SymmetricRing(lookup(geo.handle).P, k.device, max(kv, dkv), OP)


@dataclass(frozen=True)
class _Geo:
    """One call's ring geometry, the same on every worker but ``r``."""

    ranks: tuple[int, ...]
    r: int
    W: int
    S: int
    B: int
    Hkv: int
    G: int
    D: int
    layout: str
    causal: bool
    scale: float
    has_mask: bool
    fused: bool = False  # the transport: the symmetric-memory push (distfuse.fused.ring_push), else isend / irecv
    handle: int = -1

    def length(self, i: int) -> int:
        return _local_len(self.S, self.W, i % self.W, self.layout)

    def runs(self, i: int) -> list[tuple[int, int, int]]:
        """Worker ``i``'s non-empty runs; without the causal mask positions do not matter: one run, one GEMM."""
        runs = _runs(self.S, self.W, i % self.W, self.layout) if self.causal else [(0, 0, self.length(i))]
        return [r for r in runs if r[2] > 0]


def _kv_numel(geo: _Geo, i: int) -> int:
    n = geo.length(i)
    return 2 * geo.B * geo.Hkv * n * geo.D + (geo.B * n if geo.has_mask else 0)


def _unpack(geo: _Geo, buf: torch.Tensor, i: int):
    shape = (geo.B, geo.Hkv, geo.length(i), geo.D)
    e = math.prod(shape)
    k, v = buf[:2 * e].view(2, *shape)
    return k, v, buf[2 * e:].view(geo.B, shape[2]) != 0 if geo.has_mask else None


def _pairs(geo: _Geo, src: int):
    """``(query run index, q local start, q global start, n, k local start, k global start, m, partial)`` for every
    (query run, key run) pair of block ``src`` that is not fully masked; ``partial``: needs the causal mask."""
    for qi, (ql, qg, n) in enumerate(geo.runs(geo.r)):
        for kl, kg, m in geo.runs(src):
            if geo.causal and kg > qg + n - 1:
                continue  # every key after every query
            yield qi, ql, qg, n, kl, kg, m, geo.causal and kg + m - 1 > qg


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if torch.finfo(dtype).bits < 32 else dtype


def _query_runs(geo: _Geo, x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` [B, Hq, S_r, D'] cut into its runs, each ``[B, Hkv, G n, D']`` (query head h = kv head h // G)."""
    x5 = x.reshape(geo.B, geo.Hkv, geo.G, x.shape[2], x.shape[3])
    return [x5[:, :, :, ql:ql + n].reshape(geo.B, geo.Hkv, geo.G * n, x.shape[3]) for ql, _, n in geo.runs(geo.r)]


def _join_runs(geo: _Geo, parts: Sequence[torch.Tensor], last: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Inverse of :func:`_query_runs`: ``[B, Hq, S_r, last]`` (``last = 0``: the parts are ``[B, Hkv, G n]``)."""
    Sr, e = geo.length(geo.r), max(last, 1)
    out = torch.zeros((geo.B, geo.Hkv, geo.G, Sr, e), dtype=dtype, device=device)
    for (ql, _, n), p in zip(geo.runs(geo.r), parts, strict=True):
        out[:, :, :, ql:ql + n] = p.reshape(geo.B, geo.Hkv, geo.G, n, e)
    out = out.view(geo.B, geo.Hkv * geo.G, Sr, e)
    return out if last else out[..., 0]


# ---------------------------------------------------------------- forward and backward

def _kv_steps(geo: _Geo, k, v, mask, ring):
    """The ring's ``W`` steps: ``(src, k, v, mask)`` of the block this worker holds at step ``t`` (that of worker
    ``src = (r - t) mod W``).  The next block's transfer is posted on ``ring`` (the transport) before the yield
    and finished after it, so the caller's work on this block overlaps it."""
    cur = torch.cat([k.reshape(-1), v.reshape(-1)] + ([mask.reshape(-1).to(k.dtype)] if mask is not None else []))
    for t in range(geo.W):
        src = (geo.r - t) % geo.W
        pending = ring.post(0, cur, _kv_numel(geo, src - 1)) if t < geo.W - 1 else None
        yield (src, *_unpack(geo, cur, src))
        if pending is not None:
            cur = ring.finish(pending)


def _block_scores(geo: _Geo, src: int, qr: list, kb, vb, maskb, acc_t):
    """``(query run index, the key run's local slice, k_j, v_j, s)`` for every (query run, key run) pair of block
    ``src`` that is not fully masked (:func:`_pairs`): ``k_j, v_j`` in the accumulation dtype, the scores
    ``s = q_i k_j^T`` [B, Hkv, G n, m] with the causal and padding masks applied (-inf)."""
    for qi, _, qg, n, kl, kg, m, partial in _pairs(geo, src):
        ks = slice(kl, kl + m)
        kj, vj = kb[:, :, ks].to(acc_t), vb[:, :, ks].to(acc_t)
        s = qr[qi] @ kj.transpose(-1, -2)
        allowed = None if maskb is None else maskb[:, ks].view(geo.B, 1, 1, 1, m)
        if partial:
            qpos, kpos = torch.arange(qg, qg + n, device=s.device), torch.arange(kg, kg + m, device=s.device)
            causal = kpos[None, :] <= qpos[:, None]  # [n, m]
            allowed = causal if allowed is None else causal & allowed
        if allowed is not None:
            s5 = s.view(geo.B, geo.Hkv, geo.G, n, m).masked_fill(~allowed, -math.inf)
            s = s5.view(geo.B, geo.Hkv, geo.G * n, m)
        yield qi, ks, kj, vj, s


def _geo_of(handle: int, q, k, mask, S: int, causal: bool, layout: str, scale: float, fused: bool) -> _Geo:
    """The ring geometry of an agreed call (the local shapes are every worker's: the agreement checked them)."""
    P = lookup(handle).P
    return _Geo(ranks=tuple(P.ranks), r=P.rank, W=P.size, S=S, B=q.shape[0], Hkv=k.shape[1], G=q.shape[1] // k.shape[1],
                D=q.shape[3], layout=layout, causal=causal, scale=scale, has_mask=mask is not None, fused=fused,
                handle=handle)


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, handle: int, S: int,
                  causal: bool, layout: str, scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S_r, D] in q's dtype, lse [B, Hq, S_r] in the accumulation dtype)``: each block's scores merged
    into the running max ``m``, sum ``lsum`` and output ``acc`` (log-sum-exp)."""
    geo, acc_t = _geo_of(handle, q, k, mask, S, causal, layout, scale, fused), _acc_dtype(q.dtype)
    qr = [t.to(acc_t) * geo.scale for t in _query_runs(geo, q)]
    m = [torch.full(t.shape[:-1], -math.inf, dtype=acc_t, device=q.device) for t in qr]
    lsum = [torch.zeros(t.shape[:-1], dtype=acc_t, device=q.device) for t in qr]
    acc = [torch.zeros_like(t) for t in qr]
    with _transport(geo, k) as ring:
        for src, kb, vb, maskb in _kv_steps(geo, k, v, mask, ring):
            for qi, _, _, vj, s in _block_scores(geo, src, qr, kb, vb, maskb, acc_t):
                m_new = torch.maximum(m[qi], s.amax(-1))
                m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # a row with nothing to attend to yet
                p = torch.exp(s - m_safe.unsqueeze(-1))
                alpha = torch.exp(m[qi] - m_safe)
                lsum[qi] = lsum[qi] * alpha + p.sum(-1)
                acc[qi] = acc[qi] * alpha.unsqueeze(-1) + p @ vj
                m[qi] = m_new
    # a row with no key at all: out 0 (acc is 0 there), lse -inf
    outs = [ai / li.masked_fill(li == 0, 1.0).unsqueeze(-1) for li, ai in zip(lsum, acc, strict=True)]
    lses = [mi.masked_fill(mi == -math.inf, 0.0) + torch.log(li) for mi, li in zip(m, lsum, strict=True)]
    return _join_runs(geo, outs, geo.D, acc_t, q.device).to(q.dtype), _join_runs(geo, lses, 0, acc_t, q.device)


def _backward_impl(dout, q, k, v, mask, out, lse, handle, S, causal, layout, scale, fused):
    """``(dq, dk, dv)`` in the inputs' dtypes (see the module docstring for the schedule)."""
    geo, acc_t = _geo_of(handle, q, k, mask, S, causal, layout, scale, fused), _acc_dtype(q.dtype)
    qr = [t.to(acc_t) * geo.scale for t in _query_runs(geo, q)]
    dor = [t.to(acc_t) for t in _query_runs(geo, dout.contiguous())]
    delta = [(d * o.to(acc_t)).sum(-1) for d, o in zip(dor, _query_runs(geo, out), strict=True)]
    # exp(s - lse) with lse = -inf (a row with no key) must give 0, not NaN
    lser = [t.masked_fill(t == -math.inf, math.inf)[..., 0] for t in _query_runs(geo, lse.unsqueeze(-1))]
    dq = [torch.zeros_like(t) for t in qr]
    pending = None
    with _transport(geo, k, acc_t) as ring:
        for src, kb, vb, maskb in _kv_steps(geo, k, v, mask, ring):
            dkv = torch.zeros((2, geo.B, geo.Hkv, geo.length(src), geo.D), dtype=acc_t, device=q.device)
            dk, dv = dkv  # views: the two halves of one message
            for qi, ks, kj, vj, s in _block_scores(geo, src, qr, kb, vb, maskb, acc_t):
                p = torch.exp(s - lser[qi].unsqueeze(-1))
                dv[:, :, ks] += p.transpose(-1, -2) @ dor[qi]
                ds = p * (dor[qi] @ vj.transpose(-1, -2) - delta[qi].unsqueeze(-1))
                dq[qi] += ds @ kj
                dk[:, :, ks] += ds.transpose(-1, -2) @ qr[qi]
            if pending is not None:  # the accumulator of block src, with the terms of workers src .. r-1
                dkv += ring.finish(pending).view_as(dkv)
            if geo.W > 1:
                pending = ring.post(1, dkv.view(-1), 2 * geo.B * geo.Hkv * geo.length(src - 1) * geo.D)
        if pending is not None:  # after W sends, this worker's own block's gradients
            dkv = ring.finish(pending).view(2, geo.B, geo.Hkv, geo.length(geo.r), geo.D)
    dq_full = _join_runs(geo, [t * geo.scale for t in dq], geo.D, acc_t, q.device)
    return dq_full.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# ---------------------------------------------------------------- the ring as custom ops (module docstring)


def _backward_op_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      out: torch.Tensor, lse: torch.Tensor, handle: int, S: int, causal: bool, layout: str,
                      scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _backward_impl(dout, q, k, v, mask, out, lse, handle, S, causal, layout, scale, fused)
    # dk and dv are the two halves of one accumulator (when no cast copies them): a custom op's outputs must not
    # share memory.  The copy is exact.
    return dq, dk, dv.clone() if dv.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() else dv


def _save(ctx, inputs: tuple, output: tuple) -> None:
    ctx.args = tuple(inputs[4:])  # handle, S, causal, layout, scale, fused
    ctx.save_for_backward(*inputs[:4], *output)


def _gradients(backward):
    """The ring's autograd backward over ``backward`` (the implementation eagerly, the backward op compiled)."""

    def gradients(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        return (*backward(dout, q, k, v, mask, out, lse, *ctx.args), *(None,) * 7)  # mask, handle, .., fused

    return gradients


class _RingAttention(torch.autograd.Function):
    """The eager ring: the implementations of the two ops below."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _forward_impl(*inputs)
        _save(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    backward = staticmethod(_gradients(_backward_impl))


def _register():
    fwd = torch.library.custom_op("distfuse::ring_attention", _forward_impl, mutates_args=())
    fwd.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))))
    bwd = torch.library.custom_op("distfuse::ring_attention_backward", _backward_op_impl, mutates_args=())
    bwd.register_fake(lambda dout, q, k, v, *_: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))
    fwd.register_autograd(_gradients(bwd), setup_context=_save)
    ordered(fwd, bwd)
    return fwd


#: ``ring_attention(q, k, v, mask, handle, S, causal, layout, scale, fused) -> (out, lse)``: the custom op while
#: compiling, else _RingAttention (an input requires grad) or the implementation.
ring_attention = OpEntry(_register(), _RingAttention, _forward_impl, inputs=(0, 1, 2))


# ---------------------------------------------------------------- entry points

def _decide(P_cp, q: torch.Tensor, k: torch.Tensor, S: int, layout: str):
    """The ring's path (:func:`~distfuse.layers.dispatch.select_path` for ``ring_attention``, sized by the largest
    K/V block's elements): the symmetric-memory push (fused) or isend / irecv."""
    from distfuse.fused.symmetric_availability import symmetric_memory_available
    from distfuse.layers._linear_common import decide

    longest = max(_local_len(S, P_cp.size, i, layout) for i in range(P_cp.size))
    shapes = dict(elements=2 * q.shape[0] * k.shape[1] * longest * q.shape[3])
    return decide("ring_attention", OP, shapes, q.dtype, P_cp.size, q.device,
                  available=lambda: symmetric_memory_available(P_cp, q.device))


def _attention(q, k, v, causal, attn_mask, scale, layout, ring: _Ring) -> torch.Tensor:
    """A call on ``ring`` (its ``P_cp`` checked): its agreement, then :func:`_run_ring`."""
    P_cp = ring.P
    if not P_cp.active:
        for t in (q, k, v) + ((attn_mask,) if attn_mask is not None else ()):
            check_inactive_input(OP, t)
        return zero_volume_tensor(dtype=q.dtype, device=q.device)
    problem = _local_problem(P_cp, q, k, v, attn_mask, layout)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if scale is None and problem == 0:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    devices = tuple(t.device.type for t in (q, k, v) if isinstance(t, torch.Tensor))
    signature = _signature(problem, q, k, v, attn_mask, causal, layout, scale, grad, devices)

    def gather():
        record = _record(problem, q, k, v, attn_mask, causal, layout, scale, grad)
        return _check_records(OP, P_cp, gather_records(OP, P_cp, record), layout)

    S = ring.session.agree(q, signature, problem == 0, gather, deferrable=True)
    if S is None:  # a replayed call that flagged: the flag round raises on every worker
        return q.new_empty((0,))
    if ring.session.poisoned:  # this worker's call changed and its peers went on: NaN of the agreed shapes
        session, agreed = ring.session, ring.session.site.signature  # (_signature's entries)
        q, k, v = (session.stand_in(t, i, dtype_at=4) for i, t in ((1, q), (2, k), (3, v)))
        attn_mask = None if agreed[5] is None else torch.zeros(agreed[5], dtype=torch.bool, device=q.device)
        causal, layout, scale = agreed[6:9]
    return _run_ring(ring, ring.session, q, k, v, attn_mask, S, causal, layout, scale)


def _run_ring(ring: _Ring, session, q, k, v, mask, S: int, causal: bool, layout: str, scale: float):
    """The agreed call: its transport decided (remembered in ``session``, so compiled calls replay it; every worker
    decides alike: the shapes are agreed, availability is collective over ``P_cp``), then the ring op."""
    ring.last_decision = session.remember(("ring", S, q.dtype), lambda: _decide(ring.P, q, k, S, layout))
    out, _ = ring_attention(q, k, v, mask, ring.handle, S, bool(causal), layout, float(scale),
                            ring.last_decision.path == "fused")
    return first_order_only(out, OP, "ring attention (its backward is a ring of messages)")


def distributed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P_cp: Partition, *, causal: bool = False,
                          attn_mask: torch.Tensor | None = None, scale: float | None = None,
                          layout: str = "contiguous") -> torch.Tensor:
    """Scaled dot-product attention over a sequence split on the ring ``P_cp`` (see the module docstring).

    Args:
        q: ``[B, Hq, S_local, D]`` this worker's query rows.
        k, v: ``[B, Hkv, S_local, D]`` the keys and values of the same positions; ``Hq % Hkv == 0``.
        P_cp: the 1-D context-parallel partition (ring order = its rank order).
        causal: mask by global position (a query attends to keys at or before it).
        attn_mask: optional bool ``[B, S_local]`` key-padding mask of the local keys (True = attend).
        scale: score scale, default ``1 / sqrt(D)``.
        layout: ``"contiguous"`` (balanced blocks, any ``S``) or ``"zigzag"`` (:func:`load_balanced_split`).

    Returns ``[B, Hq, S_local, D]`` in ``q``'s dtype: the rows of ``scaled_dot_product_attention`` on the
    global tensors.  Collective over ``P_cp`` (forward and backward).
    """
    _check_partition(P_cp)
    return _attention(q, k, v, causal, attn_mask, scale, layout, _ring_of(P_cp))


class DistributedAttention(nn.Module):
    """:func:`distributed_attention` as a module with its own agreement session (one per call site).

    ``forward(q, k, v, attn_mask=None)``; no parameters (the projections are the caller's).
    """

    def __init__(self, P_cp: Partition, causal: bool = False, scale: float | None = None,
                 layout: str = "contiguous"):
        super().__init__()
        _check_partition(P_cp)
        if layout not in LAYOUTS:
            raise UnsupportedError(f"{where(type(self).__name__)}: layout must be one of {LAYOUTS}, got {layout!r}")
        self.P_cp, self.causal, self.scale, self.layout = P_cp, bool(causal), scale, layout
        self.ring = _Ring(type(self).__name__, P_cp)
        self.session = self.ring.session
        self.agreement = self.session.site

    def forward(self, q, k, v, attn_mask=None):
        return _attention(q, k, v, self.causal, attn_mask, self.scale, self.layout, self.ring)

    def agreed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int, session,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` for a caller whose own agreement covers the call: ``q, k, v`` of one dtype and grad
        setting with the same ``B, H, D`` on every worker of ``P_cp``, local lengths that are the layout's blocks
        of ``S``, and a bool ``attn_mask [B, S_local]`` (True = attend) on every worker or on none.  No flag round
        of the ring's own; the path is remembered in the caller's ``session`` (the mode of its current call), so
        eager and compiled calls decide alike."""
        if not self.P_cp.active:
            return zero_volume_tensor(dtype=q.dtype, device=q.device)
        scale = self.scale if self.scale is not None else (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
        return _run_ring(self.ring, session, q, k, v, attn_mask, S, self.causal, self.layout, scale)

    @property
    def last_decision(self):
        """The :class:`~distfuse.layers.dispatch.Decision` of the latest call: the ring's transport and why."""
        return self.ring.last_decision

    def extra_repr(self) -> str:
        return f"P_cp={list(getattr(self.P_cp, 'shape', (self.P_cp.size,)))}, causal={self.causal}, " \
               f"layout={self.layout!r}"
