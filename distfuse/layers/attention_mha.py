"""Multi-head self-attention on a ``[context, tensor]`` grid: heads split over the tensor axis, sequence on a ring.

Partitions and shapes (``P = [P_cp, P_tp]``; either extent may be 1; ``E = embed_dim``, ``H`` query
heads and ``Hkv`` key/value heads of size ``D = E / H``, ``H_t = H / P_tp`` and ``Hkv_t = Hkv / P_tp``
of them on each tensor worker)::

    x          [B, S_r, E]        the rows of the context axis's block (``layout``: balanced blocks, or zigzag
                                  chunks), replicated over the tensor axis
    q_proj     weight [H_t D, E]  rows of this worker's query heads (column-parallel), bias [H_t D]
    k_proj,    weight [Hkv_t D, E], bias [Hkv_t D]: rows of this worker's key/value heads
    v_proj
    out_proj   weight [E, H_t D]  columns of this worker's heads (row-parallel); bias [E] whole
    y          [B, S_r, E]        MultiheadSelfAttention's rows, replicated over the tensor axis

    forward  x' = replicate(x) over the tensor axis                  (identity; adjoint: sum of dx over it)
             q, k, v = F.linear(x', w_q, b_q), ...  -> [B, H_t, S_r, D], [B, Hkv_t, S_r, D]      local
             o = ring attention over the context axis (distributed_attention: K/V blocks travel the ring)
             y = replicated_sum(F.linear(o, w_o)) over the tensor axis  + b_o     (one all-reduce; adjoint identity)
    params   every block enters through replicate over the context axis (one flat copy, one all-reduce of
             the gradients in backward): the context workers see different tokens of one sum

Every worker of the tensor axis holds the same ``y``, and the layers after it compute the same
function of it (Megatron's "f" and "g": ``replicate`` / ``replicated_sum`` of
:mod:`distfuse.primitives.all_sum_reduce`), so each seeds the whole ``dy``: the output's sum has the
identity as adjoint, and each tensor worker's ``dx`` is the part of its heads, summed over the tensor
axis by ``replicate``'s adjoint.  The bias of ``out_proj`` is added after the sum on every worker
(one copy per tensor worker, each with the whole gradient, so no sum over the tensor axis); like
every parameter, its gradient is summed over the context axis.  Grouped-query attention splits
without moving anything: query head ``h`` uses key/value head ``h // (H / Hkv)``, and the tensor
worker ``t`` holding query heads ``[t H_t, (t+1) H_t)`` holds exactly their key/value heads
``[t Hkv_t, (t+1) Hkv_t)``.

Cost per call: one all-reduce of ``[B, S_r, E]`` over the tensor axis and the ring's ``P_cp - 1``
K/V steps (forward); in backward the ring again, one all-reduce of ``dx`` over the tensor axis and
one of the flattened parameter gradients over the context axis.  The parameters are copied once per
forward into one flat buffer when the context axis has more than one worker and they take a
gradient (the replicate's copy, which its adjoint needs).

The sequential twin is :class:`MultiheadSelfAttention` (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj`` linears and ``scaled_dot_product_attention``; torch's ``nn.MultiheadAttention`` fuses the
input projections and has no grouped-query or causal flag): ``param_layouts()`` names its keys, so
``load_sequential`` / ``collect_sequential`` move weights between the two, and with one seed on every
rank the initial blocks are those of one ``MultiheadSelfAttention`` (every rank draws the global
tensors in torch's order and keeps its block).

Checks.  The call (``x`` 3-D with ``E`` features, one dtype with the parameters, the same batch,
dtype and grad settings on every worker, the same rows on every worker of the tensor axis, row
counts that are the layout's blocks of one ``S`` over the context axis) is agreed through the
layer's :class:`~distfuse.primitives.agreement_session.AgreementSession` over ``P`` before any data
moves; a misuse raises the same :class:`~distfuse.errors.ShapeError` on every worker of ``P``.  The
values of ``x`` are trusted to be the same over the tensor axis (not hashed).  The ring attention
agrees on its own call over the context axis as well (its own session).

One forward for every mode: ``torch.compile(fullgraph=True)`` traces the layer without a graph
break once an eager call has settled both sessions.  The compiled forward graph holds, in order,
the layer's ``distfuse::flag_check`` (over ``P``), ``distfuse::replicate`` of the flat parameters
(context axis) and of ``x`` (tensor axis) where they take a gradient, the ring's
``distfuse::flag_check`` (context axis) and ``distfuse::ring_attention`` (the whole ring, one op),
and ``distfuse::replicate_adjoint`` (the sum over the tensor axis); the backward graph their
adjoints, ``distfuse::ring_attention_backward`` among them.  Eager and compiled calls run the
same implementations and agree bitwise.  A compiled call before any eager call is refused on
every worker; a changed sequence length under the compiled layer raises the same ``ShapeError``
on every worker (the layer's flag), and one eager call agrees afresh.

Workers outside ``P`` pass a zero-volume tensor and get one back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse.errors import PartitionError, ShapeError, UnsupportedError, where
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._block_identity import BlockIdentityMixin
from distfuse.layers._norm_common import subgrid
from distfuse.layers._params import ParamLayout
from distfuse.layers.attention_ring import LAYOUTS, DistributedAttention
from distfuse.partition import CartesianPartition, zero_volume_tensor
from distfuse.primitives._common import check_inactive_input, dtype_code, dtype_of_code, gather_records
from distfuse.primitives.agreement_session import AgreementSession
from distfuse.primitives.all_sum_reduce import SubGridSum, replicate, replicated_sum

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
    ``D = E / num_heads``, then ``out_proj`` (``E -> E``).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
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
)


@dataclass(frozen=True)
class MhaCall:
    """What a call's metadata gather established: the global sequence length and the grad settings."""

    S: int
    input_grad: bool
    param_grad: bool


_O_GRIDS: dict[tuple, CartesianPartition] = {}


def _out_grid(P: CartesianPartition) -> CartesianPartition:
    """``[P_cp, 1, P_tp]`` over ``P``'s workers, cached: ``out_proj.weight``'s layout, whose rows stay whole (a unit
    axis splits them) and whose columns split over the tensor axis (collective over the world, like every partition
    creation)."""
    key = (id(dist.group.WORLD), P.ranks, P.shape)
    if key not in _O_GRIDS:
        _O_GRIDS[key] = P.create_cartesian_topology_partition((P.shape[0], 1, P.shape[1]))
    return _O_GRIDS[key]


class DistributedMultiheadAttention(BlockIdentityMixin, nn.Module):
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
        device, dtype: of the parameter blocks (default: ``P``'s device, torch's default dtype).

    Attributes:
        q_proj_weight, q_proj_bias, k_proj_weight, k_proj_bias, v_proj_weight, v_proj_bias: this worker's rows.
        out_proj_weight: this worker's columns; out_proj_bias: the whole bias (None outside ``P``, biases None
            without ``bias``).
        attention: the :class:`~distfuse.layers.attention_ring.DistributedAttention` on the context sub-grid.
        session: the layer's :class:`~distfuse.primitives.agreement_session.AgreementSession` over ``P``.
    """

    def __init__(self, P: CartesianPartition, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, causal: bool = False, layout: str = "contiguous", device=None, dtype=None):
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
        self._P_out = _out_grid(P)
        self.session = AgreementSession(op, P)
        self.agreement = self.session.site
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
        """``torch.nn.Linear``'s initialisation of each projection on the global tensors, in
        :class:`MultiheadSelfAttention`'s order; each worker keeps its block.

        Every rank draws every tensor (as :class:`~distfuse.layers.embedding.DistributedEmbedding` does): with one
        seed on every rank the blocks are those of one ``MultiheadSelfAttention`` and the copies are equal.
        """
        if not self.P.active:
            return
        like = self.q_proj_weight
        full = {}
        for name, (n_out, n_in) in self._global_shapes().items():
            w = torch.empty((n_out, n_in), dtype=like.dtype, device=like.device)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            full[f"{name}.weight"] = w
            if self.use_bias:
                b = torch.empty((n_out,), dtype=like.dtype, device=like.device)
                bound = 1 / math.sqrt(n_in)
                nn.init.uniform_(b, -bound, bound)
                full[f"{name}.bias"] = b
        for lay in self.param_layouts():
            getattr(self, lay.name).copy_(full[lay.seq_name][lay.replica_slices()])

    def param_layouts(self) -> list[ParamLayout]:
        """Column-parallel ``q/k/v_proj`` (rows split over the tensor axis, copies over the context axis), row-parallel
        ``out_proj.weight`` (columns split over the tensor axis), ``out_proj.bias`` whole on every worker."""
        P, out = self.P, []
        for name, shape in self._global_shapes().items():
            if name == "out_proj":
                out.append(ParamLayout("out_proj_weight", "out_proj.weight", self._P_out, shape, split_dims=(1, 2)))
            else:
                out.append(ParamLayout(f"{name}_weight", f"{name}.weight", P, shape, split_dims=(1,)))
            if self.use_bias:
                split = () if name == "out_proj" else (1,)
                out.append(ParamLayout(f"{name}_bias", f"{name}.bias", P, shape[:1], split_dims=split))
        return out

    def _params(self) -> list[torch.Tensor | None]:
        names = [f"{n}_{kind}" for n in _PROJECTIONS for kind in ("weight", "bias")]
        return [getattr(self, n) for n in names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This worker's rows ``[B, S_r, E]`` (zero-volume outside ``P``); returns ``[B, S_r, E]``, replicated over the
        tensor axis."""
        op = type(self).__name__
        if not self.P.active:
            check_inactive_input(op, x)
            return zero_volume_tensor(dtype=self._dtype, device=x.device)
        params = self._params()
        present = [p for p in params if p is not None]
        grad_on = torch.is_grad_enabled()
        input_grad = grad_on and x.requires_grad
        mask = sum(1 << i for i, p in enumerate(params) if p is not None and grad_on and p.requires_grad)
        problem = self._local_problem(x, present[0])
        signature = (tuple(x.shape), x.dtype, x.device.type, input_grad, mask)
        record = self.session.agree(x, signature, problem == 0,
                                    lambda: self._gather(problem, x, input_grad, mask))
        if record is None:  # a replayed call that flagged: the flag round raises on every worker
            return x.new_empty((0,))
        wq, bq, wk, bk, wv, bv, wo, bo = self._over_context(params, record.param_grad)
        if record.input_grad and self._tp.P.size > 1:
            x = replicate(x, self._tp.handle)
        B, S_r, D = x.shape[0], x.shape[1], self.head_dim
        q = F.linear(x, wq, bq).view(B, S_r, self.local_heads, D).transpose(1, 2)
        k = F.linear(x, wk, bk).view(B, S_r, self.local_kv_heads, D).transpose(1, 2)
        v = F.linear(x, wv, bv).view(B, S_r, self.local_kv_heads, D).transpose(1, 2)
        o = self.attention(q, k, v).transpose(1, 2).reshape(B, S_r, self.local_heads * D)
        y = F.linear(o, wo)
        if self._tp.P.size > 1:
            y = replicated_sum(y, self._tp.handle)
        return y + bo if bo is not None else y

    def _over_context(self, params: list, param_grad: bool) -> list:
        """The parameter blocks through ``replicate`` over the context axis (their gradients summed there), as one flat
        tensor: one all-reduce in backward instead of one per parameter."""
        present = [p for p in params if p is not None]
        if not param_grad or self._ctx.P.size == 1:
            return params
        flat = replicate(torch.cat([p.reshape(-1) for p in present]), self._ctx.handle)
        pieces = iter(flat.split([p.numel() for p in present]))
        return [next(pieces).view(p.shape) if p is not None else None for p in params]

    def _local_problem(self, x: torch.Tensor, weight: torch.Tensor) -> int:
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return 1
        if x.shape[2] != self.embed_dim:
            return 2
        if x.dtype != weight.dtype:
            return 3
        if x.device.type != self.P.device.type:
            return 4
        return 0

    def _gather(self, problem: int, x: torch.Tensor, input_grad: bool, mask: int) -> MhaCall:
        """The metadata gather over ``P`` and its checks (the same error on every worker): the agreed record."""
        op, P = type(self).__name__, self.P
        shape = list(x.shape) if problem != 1 else [-1, -1, -1]
        rows = gather_records(op, P, [problem, *shape, dtype_code(x.dtype), int(input_grad), mask])
        bad = [(P.ranks[j], r) for j, r in enumerate(rows) if r[0] != 0]
        if bad:
            raise ShapeError(f"{where(op)}: " + "; ".join(
                f"world rank {w}: {_PROBLEMS[r[0]]} (got x {r[1:4]})" for w, r in bad))
        names = ("batch B", "dtype", "grad setting of x (grad mode on and x.requires_grad)",
                 "grad settings of the parameters (grad mode on and requires_grad, one bit per parameter)")
        for name, slot in zip(names, (1, 4, 5, 6), strict=True):
            vals = {P.ranks[j]: r[slot] for j, r in enumerate(rows)}
            if len(set(vals.values())) > 1:
                shown = {w: str(dtype_of_code(v)) for w, v in vals.items()} if slot == 4 else vals
                raise ShapeError(f"{where(op)}: the workers of P must agree on the {name}; got {shown} "
                                 "(world rank: value)")
        p_cp, p_tp = P.shape
        lengths = [rows[P.rank_of((c, 0))][2] for c in range(p_cp)]
        for j, r in enumerate(rows):
            c = P.index_of(j)[0]
            if r[2] != lengths[c]:
                raise ShapeError(f"{where(op)}: x is replicated over the tensor axis, so every worker of a context "
                                 f"index holds the same rows; world rank {P.ranks[j]} (P index {P.index_of(j)}) holds "
                                 f"{r[2]}, world rank {P.ranks[P.rank_of((c, 0))]} holds {lengths[c]}")
        S = sum(lengths)
        if self.layout == "zigzag":
            ok = S % (2 * p_cp) == 0 and all(n == S // p_cp for n in lengths)
            want = "S // P_cp rows each, S a multiple of 2 P_cp"
        else:
            ok = all(n == block_extent(S, p_cp, c) for c, n in enumerate(lengths))
            want = f"the balanced blocks {[block_extent(S, p_cp, c) for c in range(p_cp)]}"
        if not ok:
            raise ShapeError(f"{where(op)}: the context axis's row counts {lengths} are not the {self.layout} "
                             f"layout's blocks of S = {S} over {p_cp} workers (expected {want})")
        return MhaCall(S, bool(rows[0][5]), bool(rows[0][6]))

    def extra_repr(self) -> str:
        return (f"P={list(self.P.shape)}, {self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, layout={self.layout!r}")

