"""Multi-head self-attention on a ``[context, tensor]`` grid: heads split over the tensor axis, sequence on a ring.

Partitions and shapes (``P = [P_cp, P_tp]``; either extent may be 1; ``E = embed_dim``, ``H`` query
heads and ``Hkv`` key/value heads of size ``D = E / H``, ``H_t = H / P_tp`` and ``Hkv_t = Hkv / P_tp``
of them on each tensor worker)::

    x          [B, S_r, E]        the rows of the context axis's block (``layout``: balanced blocks, or zigzag
                                  chunks), replicated over the tensor axis
    key_padding_mask [B, S_r]     optional bool, True = padding (torch's convention): the ring's key mask
    q_proj     weight [H_t D, E]  rows of this worker's query heads (column-parallel), bias [H_t D]
    k_proj,    weight [Hkv_t D, E], bias [Hkv_t D]: rows of this worker's key/value heads
    v_proj
    out_proj   weight [E, H_t D]  columns of this worker's heads (row-parallel); bias [E] whole
    y          [B, S_r, E]        MultiheadSelfAttention's rows, replicated over the tensor axis

    forward  x' = replicate(x) over the tensor axis                  (identity; adjoint: sum of dx over it)
             q, k, v = F.linear(x', w_q, b_q), ...  -> [B, H_t, S_r, D], [B, Hkv_t, S_r, D]      local
             o = ring attention over the context axis (distributed_attention: K/V blocks travel the ring)
             y = replicated_sum(F.linear(o, w_o)) over the tensor axis  + b_o     (one all-reduce; adjoint identity)
    params   every block enters through replicate over the context axis (one flat copy per forward where
             they take a gradient, one all-reduce of the gradients in backward): the context workers see
             different tokens of one sum

Every worker of the tensor axis holds the same ``y`` and seeds the whole ``dy`` (Megatron's
"f" and "g", :mod:`distfuse.primitives.all_sum_reduce`), so the output's sum has the
identity as adjoint, and ``replicate``'s adjoint sums the tensor workers' ``dx``.  The bias
of ``out_proj`` is added after the sum (each copy gets the whole gradient).  Grouped-query
attention splits without moving anything: query head ``h`` uses key/value head ``h // (H /
Hkv)``, and the tensor worker holding query heads ``[t H_t, (t+1) H_t)`` holds exactly their
key/value heads ``[t Hkv_t, (t+1) Hkv_t)``.

Sequence-parallel (``sequence_parallel=True``, Megatron's layout between the projections): ``x``
and ``y`` are ``[B, S_rt, E]``, the tensor worker's balanced block of its context index's rows,
and the two sums over the tensor axis become a gather and a scatter of rows::

    qkv   = all_gather_rows(x) @ [w_q; w_k; w_v].T + [b_q; b_k; b_v]    [B, S_r, (H_t + 2 Hkv_t) D]
    y     = reduce_scatter_rows(o @ w_o.T) + b_o on this worker's rows   [B, S_rt, E]
    adjoint  dx = reduce_scatter_rows(dqkv @ [w_q; w_k; w_v]); do = all_gather_rows(dy) @ w_o

The two are the ops of the sequence-parallel linears (:class:`~distfuse.layers.DistributedLinearAllGather`
with ``P_x``, :class:`~distfuse.layers.DistributedLinearReduceScatter` with ``P_y``): fused where
dispatch chooses them (``last_decisions``), else the primitives around ``F.linear``.  The
three input projections share one gather (their weight blocks stacked for one GEMM); the
output bias goes through ``replicate`` over the tensor axis, since each worker adds it to
its own rows only.  The volume moved equals the replicated layout's, the gathers and
scatters can hide behind their GEMMs, and every activation outside the attention is
``P_tp`` times smaller.

The sequential twin is :class:`MultiheadSelfAttention` (torch's ``nn.MultiheadAttention``
has no grouped-query or causal flag); ``param_layouts()`` names its keys for
``load_sequential`` / ``collect_sequential``.

The agreed call (over ``P``, one flag round; it covers the ring's call too,
:meth:`~distfuse.layers.attention_ring.DistributedAttention.agreed`): ``x`` 3-D with ``E``
features, the parameters' dtype, the same batch, dtype and grad settings everywhere, the
same rows over the tensor axis (trusted; compared under ``DISTFUSE_DEBUG=1``), row counts
that are the layout's blocks of one ``S``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distfuse import debug
from distfuse.errors import PartitionError, ShapeError, UnsupportedError, where
from distfuse.fused import registry
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._conv_common import AgreedLayer, cached_partition
from distfuse.layers._linear_common import decide
from distfuse.layers._norm_common import subgrid
from distfuse.layers._params import BlockIdentityMixin, ParamLayout
from distfuse.layers.attention_ring import LAYOUTS, DistributedAttention, _local_len, check_agreed
from distfuse.layers.dispatch import Decision
from distfuse.ops.fused_linear import make_call
from distfuse.partition import CartesianPartition, zero_volume_tensor
from distfuse.primitives._common import check_inactive_input, dtype_code, dtype_of_code, gather_records
from distfuse.primitives.all_gather import all_gather
from distfuse.primitives.all_sum_reduce import SubGridSum, replicate, replicated_sum
from distfuse.primitives.reduce_scatter import reduce_scatter

__all__ = ["DistributedMultiheadAttention", "MultiheadSelfAttention"]

#: The projections in torch's draw order (that of MultiheadSelfAttention's construction).
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def _check_heads(op: str, embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
    if embed_dim < 1 or num_heads < 1 or num_kv_heads < 1:
        raise UnsupportedError(f"{where(op)}: embed_dim, num_heads and num_kv_heads must be >= 1, got {embed_dim}, "
                               f"{num_heads} and {num_kv_heads}")
    if embed_dim % num_heads:
        raise UnsupportedError(f"{where(op)}: embed_dim={embed_dim} must be a multiple of num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise UnsupportedError(f"{where(op)}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
                               "(grouped-query attention)")


class MultiheadSelfAttention(nn.Module):
    """Sequential batch-first self-attention with grouped-query heads: the twin of
    :class:`DistributedMultiheadAttention` (the same parameter names, initialisation and result).

    ``x [B, S, E] -> [B, S, E]``: ``q_proj`` (``E -> E``), ``k_proj`` and ``v_proj`` (``E -> Hkv D``),
    ``scaled_dot_product_attention(is_causal=causal, enable_gqa=...)`` over ``num_heads`` heads of size
    ``D = E / num_heads``, then ``out_proj`` (``E -> E``).  ``key_padding_mask``: optional bool ``[B, S]``,
    True where a key is padding (``nn.MultiheadAttention``'s convention), combined with the causal mask.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, bias: bool = True,
                 causal: bool = False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_heads(type(self).__name__, embed_dim, num_heads, num_kv_heads)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.causal = embed_dim // num_heads, bool(causal)
        kv = num_kv_heads * self.head_dim
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim, **kw), nn.Linear(embed_dim, kv, **kw)
        self.v_proj, self.out_proj = nn.Linear(embed_dim, kv, **kw), nn.Linear(embed_dim, embed_dim, **kw)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        keep = None
        if key_padding_mask is not None:  # SDPA's bool mask: True = attend; the causal mask folded in
            keep = ~key_padding_mask.bool()[:, None, None, :]
            if self.causal:
                keep = keep & torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=self.causal and keep is None,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return self.out_proj(o.transpose(1, 2).reshape(B, S, self.embed_dim))

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, causal={self.causal}"


# ---------------------------------------------------------------- the agreement

_PROBLEMS = (
    "",
    "x must be a 3-D tensor [B, S_local, embed_dim]",
    "x's last dimension must be embed_dim",
    "x must have the parameters' floating dtype",
    "x must be on the partition's device type",
    "key_padding_mask must be a bool tensor [B, S_local] of x's rows (True = padding), on x's device",
)


@dataclass(frozen=True)
class MhaCall:
    """What a call's metadata gather established: the global sequence length and the grad settings."""

    S: int
    input_grad: bool
    param_grad: bool
    lengths: tuple[int, ...]  # the rows of each context index (summed over the tensor axis when sequence-parallel)


class DistributedMultiheadAttention(BlockIdentityMixin, AgreedLayer, nn.Module):
    """:class:`MultiheadSelfAttention` with its heads split over the tensor axis of ``P = [P_cp, P_tp]`` and its
    sequence over the context axis (see the module docstring).

    Args:
        P: CartesianPartition ``[P_cp, P_tp]``: the context (sequence) axis, then the tensor (heads) axis.
        embed_dim, num_heads: ``E`` and ``H``; ``E % H == 0`` and ``H % P_tp == 0``.
        num_kv_heads: ``Hkv`` (default ``H``); ``H % Hkv == 0`` and ``Hkv % P_tp == 0``.
        bias: biases on the four projections.
        causal: mask by global position (a query attends to the keys at or before it).
        layout: the rows a context worker holds: ``"contiguous"`` (balanced blocks, any ``S``) or ``"zigzag"``
            (:func:`~distfuse.layers.attention_ring.load_balanced_split`, ``S % (2 P_cp) == 0``).
        sequence_parallel: the input and output rows split over the tensor axis too (Megatron's sequence
            parallelism): the projections are then the fused all-gather + GEMM and GEMM + reduce-scatter ops where
            dispatch says so (see the module docstring).
        device, dtype: of the parameter blocks (default: ``P``'s device, torch's default dtype).

    Attributes: ``{q,k,v}_proj_weight`` / ``_bias`` this worker's rows, ``out_proj_weight`` its columns,
    ``out_proj_bias`` the whole bias; ``attention`` the :class:`~distfuse.layers.attention_ring.DistributedAttention`
    on the context sub-grid; ``last_decisions`` the path each projection took in the latest sequence-parallel
    forward (``{"qkv": Decision, "out_proj": Decision}``).
    """

    def __init__(self, P: CartesianPartition, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, causal: bool = False, layout: str = "contiguous", sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        op = type(self).__name__
        if not isinstance(P, CartesianPartition) or P.dim != 2:
            raise PartitionError(f"{where(op)}: P must be a 2-D CartesianPartition [P_cp, P_tp] (context axis, "
                                 f"tensor axis), got {getattr(P, 'shape', type(P).__name__)}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_heads(op, embed_dim, num_heads, num_kv_heads)
        p_tp = P.shape[1]
        if num_heads % p_tp or num_kv_heads % p_tp:
            raise PartitionError(f"{where(op)}: the tensor axis of P ({p_tp} workers) splits the heads, so it must "
                                 f"divide num_heads={num_heads} and num_kv_heads={num_kv_heads}")
        if layout not in LAYOUTS:
            raise UnsupportedError(f"{where(op)}: layout must be one of {LAYOUTS}, got {layout!r}")
        self.P = P
        self.embed_dim, self.num_heads, self.num_kv_heads = int(embed_dim), int(num_heads), int(num_kv_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.use_bias, self.causal, self.layout = bool(bias), bool(causal), layout
        self.local_heads, self.local_kv_heads = self.num_heads // p_tp, self.num_kv_heads // p_tp
        # Collective over the world, in the same order on every rank (the handles name them in graphs).
        self._ctx = SubGridSum(op, subgrid(P, [0]))
        self._tp = SubGridSum(op, subgrid(P, [1]))
        # out_proj.weight's layout [P_cp, 1, P_tp]: its rows stay whole, its columns split over the tensor axis.
        self._P_out = cached_partition(("out_proj", P.ranks, P.shape),
                                       lambda: P.create_cartesian_topology_partition((P.shape[0], 1, P.shape[1])))
        self.sequence_parallel = bool(sequence_parallel)
        self.last_decisions: dict[str, Decision] = {}
        if self.sequence_parallel:
            # The rows split over the tensor axis: [1, P_tp, 1] within each context index, the group of the gathers,
            # the scatters and their fused GEMMs (collective over the world).
            P_seq = cached_partition(("seq", P.ranks, P.shape),
                                     lambda: P.create_cartesian_topology_partition((P.shape[0], P.shape[1], 1)))
            self._P_rows = subgrid(P_seq, [1])
            self._gather_gemm = make_call("all_gather_matmul", self._P_rows, owner=op)
            self._gemm_scatter = make_call("matmul_reduce_scatter", self._P_rows, owner=op)
        self._agree_over(P)
        self.attention = DistributedAttention(self._ctx.P, causal=self.causal, layout=layout)
        device = torch.device(device) if device is not None else P.device
        kw = dict(device=device, dtype=dtype)
        E, D = self.embed_dim, self.head_dim
        rows = {"q_proj": self.local_heads * D, "k_proj": self.local_kv_heads * D, "v_proj": self.local_kv_heads * D}
        for name in _PROJECTIONS[:3]:
            self._param(f"{name}_weight", (rows[name], E), kw)
            self._param(f"{name}_bias", (rows[name],), kw, self.use_bias)
        self._param("out_proj_weight", (E, self.local_heads * D), kw)
        self._param("out_proj_bias", (E,), kw, self.use_bias)
        self._dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.reset_parameters()

    def _param(self, name: str, shape: tuple[int, ...], kw: dict, make: bool = True) -> None:
        self.register_parameter(name, nn.Parameter(torch.empty(shape, **kw)) if make and self.P.active else None)

    def _global_shapes(self) -> dict[str, tuple[int, int]]:
        """The sequential ``[out, in]`` of each projection."""
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (E, E), "k_proj": (kv, E), "v_proj": (kv, E), "out_proj": (E, E)}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """:class:`MultiheadSelfAttention`'s initialisation (``torch.nn.Linear``'s, projection by projection) of the
        global tensors, on every rank; each worker keeps its block."""
        if not self.P.active:
            return
        like = self.q_proj_weight
        full = MultiheadSelfAttention(self.embed_dim, self.num_heads, self.num_kv_heads, self.use_bias,
                                      device=like.device, dtype=like.dtype).state_dict()
        for lay in self.param_layouts():
            getattr(self, lay.name).copy_(full[lay.seq_name][lay.replica_slices()])

    def param_layouts(self) -> list[ParamLayout]:
        """Column-parallel ``q/k/v_proj`` (rows split over the tensor axis, copies over the context axis), row-parallel
        ``out_proj.weight`` (columns split over the tensor axis), ``out_proj.bias`` whole on every worker."""
        out = []
        for name, shape in self._global_shapes().items():
            P_w, w_split, b_split = (self._P_out, (1, 2), ()) if name == "out_proj" else (self.P, (1,), (1,))
            out.append(ParamLayout(f"{name}_weight", f"{name}.weight", P_w, shape, split_dims=w_split))
            if self.use_bias:
                out.append(ParamLayout(f"{name}_bias", f"{name}.bias", self.P, shape[:1], split_dims=b_split))
        return out

    def _params(self) -> list[torch.Tensor | None]:
        names = [f"{n}_{kind}" for n in _PROJECTIONS for kind in ("weight", "bias")]
        return [getattr(self, n) for n in names]

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This worker's rows ``[B, S_r, E]`` (zero-volume outside ``P``); returns ``[B, S_r, E]``, replicated over the
        tensor axis.  ``key_padding_mask``: optional bool ``[B, S_r]`` of the same rows, True where a key is padding
        (``nn.MultiheadAttention``'s convention); every worker of ``P`` passes one, or none.  Sequence-parallel, its
        rows are gathered over the tensor axis with ``x``'s (one more small gather per call)."""
        if not self.P.active:
            for t in (x,) if key_padding_mask is None else (x, key_padding_mask):
                check_inactive_input(type(self).__name__, t)
            return zero_volume_tensor(dtype=self._dtype, device=x.device)
        params = self._params()
        grad_on = torch.is_grad_enabled()
        input_grad = grad_on and x.requires_grad
        mask = sum(1 << i for i, p in enumerate(params) if p is not None and grad_on and p.requires_grad)
        has_mask = key_padding_mask is not None
        problem = self._local_problem(x, key_padding_mask)
        signature = (tuple(x.shape), x.dtype, x.device.type, input_grad, mask, has_mask)
        record = self.session.agree(x, signature, problem == 0,
                                    lambda: self._gather(problem, x, input_grad, mask, has_mask), deferrable=True)
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return x.new_empty((0,))
        if self.session.poisoned:  # this worker's call changed and its peers went on: NaN rows of the agreed sizes
            x, has_mask = self.session.stand_in(x), self.session.site.signature[5]  # (the agreed signature's)
            key_padding_mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device) if has_mask else None
        if debug.enabled() and not self.sequence_parallel and self.session.may_read_host:
            self._check_replicated(x)
        wq, bq, wk, bk, wv, bv, wo, bo = self._over_context(params, record.param_grad)
        B, D, tp = x.shape[0], self.head_dim, self._tp.P.size > 1
        keep = ~key_padding_mask if has_mask else None  # the ring's key mask (True = attend)
        if self.sequence_parallel:  # one gather for the three: their weight blocks stacked for one GEMM
            S_r = record.lengths[self.P.index[0]]  # the context index's rows, gathered over the tensor axis
            packed_b = torch.cat([bq, bk, bv]) if bq is not None else None
            qkv = self._projection("qkv", x, torch.cat([wq, wk, wv]), packed_b, S_r)
            q, k, v = qkv.split([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
            if has_mask:
                keep = all_gather(keep.to(torch.uint8)[..., None], self._P_rows, out_shape=[B, S_r, 1])[..., 0].bool()
        else:  # three GEMMs on the blocks themselves: no per-call copy of the weights
            x = replicate(x, self._tp.handle) if record.input_grad and tp else x
            S_r = x.shape[1]
            q, k, v = (F.linear(x, w, b) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        heads = (self.local_heads, self.local_kv_heads, self.local_kv_heads)
        q, k, v = (t.reshape(B, S_r, h, D).transpose(1, 2) for t, h in zip((q, k, v), heads, strict=True))
        # the layer's agreement covers the ring's call (shapes, dtype, grad settings, the layout's blocks of S)
        o = self.attention.agreed(q, k, v, record.S, self.session, keep)
        o = o.transpose(1, 2).reshape(B, S_r, self.local_heads * D)
        if not self.sequence_parallel:
            y = replicated_sum(F.linear(o, wo), self._tp.handle) if tp else F.linear(o, wo)
            return y + bo if bo is not None else y
        if bo is not None and record.param_grad and tp:
            bo = replicate(bo, self._tp.handle)  # each tensor worker adds it to its own rows: a partial gradient
        return self._projection("out_proj", o, wo, bo, S_r)

    def _projection(self, kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
        """A sequence-parallel projection: ``"qkv"`` gathers the rows ``[B, n_t, E]`` over the tensor axis into
        ``[B, n, E]`` and multiplies (``y [B, n, rows of w]``); ``"out_proj"`` multiplies ``[B, n, H_t D]`` and
        reduce-scatters the rows (``y [B, n_t, E]``, ``b`` added to this worker's rows).  Fused or unfused as
        :func:`~distfuse.layers._linear_common.decide` says, the decision remembered for compiled calls."""
        op, P_rows = type(self).__name__, self._P_rows
        entry = registry.ALL_GATHER_MATMUL if kind == "qkv" else registry.MATMUL_REDUCE_SCATTER
        gemm = dict(m=x.shape[0] * n, n=w.shape[0], k=w.shape[1])

        def available():
            from distfuse.fused.matmul_common import fused_linear_available

            return fused_linear_available(P_rows, x.device, x.dtype)

        decision = self.session.remember((kind, gemm["m"], x.dtype), lambda: decide(
            entry.name, f"{op}.{kind}", gemm, x.dtype, P_rows.size, x.device, available=available))
        self.last_decisions[kind] = decision
        if kind == "qkv":
            if decision.path == "fused":
                return self._gather_gemm(x, w, b, n)
            return F.linear(all_gather(x, P_rows, out_shape=[x.shape[0], n, x.shape[2]]), w, b)
        if decision.path == "fused":
            return self._gemm_scatter(x, w, b)
        y = reduce_scatter(F.linear(x, w), P_rows)
        return y + b if b is not None else y

    def _check_replicated(self, x: torch.Tensor) -> None:
        """``DISTFUSE_DEBUG=1``: the tensor axis's workers must hold the same ``x`` bits (trusted otherwise).

        One host all-gather over ``P`` of a 63-bit digest of each worker's bytes, so every worker raises the same
        :class:`~distfuse.errors.ShapeError` (a check over the tensor axis alone would leave the other context
        indices waiting in the ring)."""
        op, P = type(self).__name__, self.P
        raw = x.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
        rows = gather_records(op, P, [digest])
        differ = sorted({P.index_of(j)[0] for j, r in enumerate(rows)
                         if r[0] != rows[P.rank_of((P.index_of(j)[0], 0))][0]})
        if differ:
            ranks = {c: [P.ranks[P.rank_of((c, t))] for t in range(P.shape[1])] for c in differ}
            raise ShapeError(f"{where(op)}: x is replicated over the tensor axis, so the workers of a context index "
                             f"must hold the same values (DISTFUSE_DEBUG=1 compares them); they differ at context "
                             f"indices {differ} (world ranks {ranks})")

    def _over_context(self, params: list, param_grad: bool) -> list:
        """The parameter blocks through ``replicate`` over the context axis (their gradients summed there), as one flat
        tensor: one all-reduce in backward instead of one per parameter."""
        present = [p for p in params if p is not None]
        if not param_grad or self._ctx.P.size == 1:
            return params
        flat = replicate(torch.cat([p.reshape(-1) for p in present]), self._ctx.handle)
        pieces = iter(flat.split([p.numel() for p in present]))
        return [next(pieces).view(p.shape) if p is not None else None for p in params]

    def _local_problem(self, x: torch.Tensor, key_padding_mask) -> int:
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return 1
        if x.shape[2] != self.embed_dim:
            return 2
        if x.dtype != self.q_proj_weight.dtype:
            return 3
        if x.device.type != self.P.device.type:
            return 4
        if key_padding_mask is not None and not (
                isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dtype == torch.bool
                and tuple(key_padding_mask.shape) == tuple(x.shape[:2]) and key_padding_mask.device == x.device):
            return 5
        return 0

    def _gather(self, problem: int, x: torch.Tensor, input_grad: bool, mask: int, has_mask: bool) -> MhaCall:
        """The metadata gather over ``P`` and its checks (the same error on every worker): the agreed record."""
        op, P = type(self).__name__, self.P
        shape = list(x.shape) if problem != 1 else [-1, -1, -1]
        rows = gather_records(op, P, [problem, *shape, dtype_code(x.dtype), int(input_grad), mask, int(has_mask)])
        bad = [(P.ranks[j], r) for j, r in enumerate(rows) if r[0] != 0]
        if bad:
            raise ShapeError(f"{where(op)}: " + "; ".join(
                f"world rank {w}: {_PROBLEMS[r[0]]} (got x {r[1:4]})" for w, r in bad))
        check_agreed(op, "P", P, rows, {1: "the batch B", 4: "the dtype",
                                        5: "the grad setting of x (grad mode on and x.requires_grad)",
                                        6: "the grad settings of the parameters (grad mode on and requires_grad, "
                                           "one bit per parameter)",
                                        7: "whether a key_padding_mask is passed"},
                     {4: lambda v: str(dtype_of_code(v))})
        (p_cp, p_tp), sp = P.shape, self.sequence_parallel
        # each context index's rows: split over the tensor axis (sequence-parallel), else held by each of its workers
        lengths = [sum(rows[P.rank_of((c, t))][2] for t in range(p_tp)) if sp else rows[P.rank_of((c, 0))][2]
                   for c in range(p_cp)]
        for j, r in enumerate(rows):
            c, t = P.index_of(j)
            want = block_extent(lengths[c], p_tp, t) if sp else lengths[c]
            if r[2] == want:
                continue
            if sp:
                raise ShapeError(f"{where(op)}: sequence-parallel: the tensor axis splits each context index's rows "
                                 f"into balanced blocks; world rank {P.ranks[j]} (P index {(c, t)}) holds {r[2]} rows, "
                                 f"block {t} of {lengths[c]} over {p_tp} workers is {want}")
            raise ShapeError(f"{where(op)}: x is replicated over the tensor axis, so every worker of a context index "
                             f"holds the same rows; world rank {P.ranks[j]} (P index {(c, t)}) holds {r[2]}, "
                             f"world rank {P.ranks[P.rank_of((c, 0))]} holds {want}")
        S, zigzag = sum(lengths), self.layout == "zigzag"
        blocks = [_local_len(S, p_cp, c, self.layout) for c in range(p_cp)]
        if lengths != blocks or (zigzag and S % (2 * p_cp)):
            want = "S // P_cp rows each, S a multiple of 2 P_cp" if zigzag else f"the balanced blocks {blocks}"
            raise ShapeError(f"{where(op)}: the context axis's row counts {lengths} are not the {self.layout} "
                             f"layout's blocks of S = {S} over {p_cp} workers (expected {want})")
        return MhaCall(S, bool(rows[0][5]), bool(rows[0][6]), tuple(lengths))

    def extra_repr(self) -> str:
        return (f"P={list(self.P.shape)}, {self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, layout={self.layout!r}, "
                f"sequence_parallel={self.sequence_parallel}")

