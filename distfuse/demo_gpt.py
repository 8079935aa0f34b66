"""The GPT demo: a small decoder-only transformer on 4 ranks, 2 (context) x 2 (tensor), checked against torch.nn.

``python -m distfuse.demo gpt`` starts 4 CPU ranks with gloo by itself (under ``torchrun`` it
uses the ranks it is given).  The sequence is split over the context axis in the zigzag
layout (each context worker holds 2 of 4 chunks, so the causal work is balanced), the heads,
the MLP's hidden features and the vocabulary over the tensor axis::

    ids      [B, S] = [2, 12]       worker (c, t) holds ids[:, local_positions(S, 2, c, "zigzag")]  [2, 6]
    tok      DistributedEmbedding(V=50, E=16)   vocabulary rows over t; one all-reduce over t
    pos      + a fixed sinusoidal table at the worker's global positions            [2, 6, 16]
    2 x      h = h + attn(ln1(h)); h = h + mlp(ln2(h))
             ln     torch.nn.LayerNorm(16), its parameters through ``replicate`` over c
             attn   DistributedMultiheadAttention(16, 4 heads, causal): heads over t, ring over c
             mlp    Linear(16 -> 64) column-parallel over t, GELU, Linear(64 -> 16) row-parallel
                    (``replicated_sum`` over t), written here with distfuse's f / g primitives
    ln_f     LayerNorm(16)
    head     Linear(16 -> 50, no bias) column-parallel over t: logits [2, 6, 25], never gathered
    loss     DistributedVocabCrossEntropyLoss (mean over the 24 tokens): two all-reduces over t, one over c

Partitions (the same 4 workers, worker ``r`` at context index ``c = r // 2``, tensor index ``t = r % 2``
in all three; row-major grids)::

    P      [2, 2]      context x tensor: the attention, the MLP, the head and the layer norms
    P_tok  [1, 2, 2]   batch x context x vocabulary: the embedding's and the loss's P_x.  Both split
                       their ids / logits over the leading axes of P_x, one per ids dimension, and the
                       vocabulary over the last; the ids are [B, S_r], so the leading axes are
                       [batch (1), context (2)] and the vocabulary axis is the tensor axis
    P_rows [2, 1, 2]   the row-parallel weight's layout: [E, hidden] with the rows whole (the unit axis)
                       and the columns over t, copies over c (``ParamLayout`` splits tensor dim i over
                       partition dim ``split_dims[i]``; a 2-D grid has no axis that leaves the rows whole)

The residual stream ``h [B, S_r, E]`` is replicated over the tensor axis (the same bits on both
workers: every sum that makes it is an all-reduce) and split over the context axis.  So a
parameter held whole by every worker (the layer norms', the row-parallel bias) takes the sum of
its gradients over the context axis (different tokens) but not over the tensor axis (the same
tokens, each worker already holds the whole gradient): ``replicate`` over the context axis,
the embedding's treatment of its table.  The MLP is written here rather than with the
library's all-gather / reduce-scatter linears because those move the tokens (sequence
parallel: the input split over the tensor axis, gathered before the GEMM), while here the
tokens stay on their context worker for the ring attention and the input is already
replicated over the tensor axis: Megatron's f (``replicate``: identity, gradient summed over t)
and g (``replicated_sum``: sum over t, gradient identity) are all it needs.

Rank 0 trains the ``torch.nn`` twins (:class:`MultiheadSelfAttention` for the attention)
alongside and checks every step's loss and the final weights (:mod:`distfuse.demo_check`). GELU
and softmax are smooth, so training is a continuous function of the rounding
(:mod:`distfuse.testing.tolerance`); SGD with momentum, not Adam, for the same reason (Adam's
first step is ``lr * sign(g)``, which jumps where a gradient is within rounding of zero).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distfuse.layers._params import BlockIdentityMixin

WORLD = 4
GRID = (2, 2)  # context x tensor
BATCH, SEQ, VOCAB, EMBED, HEADS, HIDDEN, BLOCKS = 2, 12, 50, 16, 4, 64, 2
LAYOUT = "zigzag"
# The longest sum of a training step: the MLP's hidden features (the second linear's output and the first's
# input gradient sum over 64); the loss's softmax sums over VOCAB = 50, the weight gradients over the 24 tokens.
TERMS = HIDDEN


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    """The fixed positional table ``[length, dim]`` of "Attention is all you need" (sin on even, cos on odd)."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


class Block(nn.Module):
    """Pre-LayerNorm transformer block; ``make`` supplies the layers (torch.nn's or the distributed ones)."""

    def __init__(self, make):
        super().__init__()
        self.ln1, self.attn = make.LayerNorm(EMBED), make.Attention(EMBED, HEADS)
        self.ln2 = make.LayerNorm(EMBED)
        self.mlp = nn.Sequential(make.ColumnLinear(EMBED, HIDDEN), nn.GELU(), make.RowLinear(HIDDEN, EMBED))

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """Token embedding plus fixed positions, :data:`BLOCKS` blocks, final norm, vocabulary head.

    With ``make = Sequential`` it is the torch.nn model; with :class:`Distributed` the same model
    over the grid: the module paths match, so state moves between them by name.
    """

    def __init__(self, make):
        super().__init__()
        self.tok = make.Embedding(VOCAB, EMBED)
        self.register_buffer("pos_table", sinusoidal(SEQ, EMBED).to(torch.get_default_dtype()), persistent=False)
        self.blocks = nn.Sequential(*[Block(make) for _ in range(BLOCKS)])
        self.ln_f = make.LayerNorm(EMBED)
        self.head = make.ColumnLinear(EMBED, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos_table[positions]
        return self.head(self.ln_f(self.blocks(h)))


class Sequential:
    """The torch.nn layers under the names :class:`GPT` asks for."""

    Embedding, LayerNorm, ColumnLinear, RowLinear = nn.Embedding, nn.LayerNorm, nn.Linear, nn.Linear

    @staticmethod
    def Attention(embed_dim, num_heads):  # noqa: N802 - a layer factory, named like the class it makes
        from distfuse.layers import MultiheadSelfAttention

        return MultiheadSelfAttention(embed_dim, num_heads, causal=True)


# ---------------------------------------------------------------- the distributed side


class ContextLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` on this worker's tokens, its parameters through ``replicate`` over the context axis.

    The hidden dimension is whole on every worker, so the normalisation is local; the weight and bias are copies
    on every worker (a plain module's state: :func:`distfuse.model.collect_sequential` takes rank 0's).  Each
    context worker sees other tokens, so their gradients sum over the context axis; the tensor axis's workers see
    the same tokens and each already holds the whole gradient, so nothing sums there.
    """

    def __init__(self, normalized_shape, ctx, **kwargs):
        super().__init__(normalized_shape, **kwargs)
        self._ctx = ctx

    def forward(self, x):
        from distfuse.primitives.all_sum_reduce import replicate

        w, b = self.weight, self.bias
        if self._ctx.P.size > 1 and torch.is_grad_enabled() and w.requires_grad:
            w, b = replicate(w, self._ctx.handle), replicate(b, self._ctx.handle)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class TensorParallelLinear(BlockIdentityMixin, nn.Module):
    """``torch.nn.Linear`` split over the tensor axis of ``P = [P_cp, P_tp]``, Megatron's two halves.

    ``columns``: the input ``[*, in]`` is replicated over the tensor axis and enters through ``replicate`` (f); the
    worker holds the rows of ``W`` and ``b`` of its output block and returns ``[*, out_t]``.  ``rows``: the input is
    that block of features ``[*, in_t]``; the worker holds the columns ``W[:, in_t]``, sums its product over the
    tensor axis with ``replicated_sum`` (g) and adds the whole bias: ``[*, out]``, replicated over the tensor axis.
    Every parameter enters through ``replicate`` over the context axis (other tokens, one sum).  The demo's own
    layer: it trusts its inputs (no agreement round); the attention, embedding and loss around it agree on theirs.
    """

    def __init__(self, P, ctx, tp, in_features: int, out_features: int, bias: bool = True, *, split: str,
                 P_rows=None):
        from distfuse.geometry.decomposition import block_range

        super().__init__()
        self.P, self._ctx, self._tp, self.split, self._P_rows = P, ctx, tp, split, P_rows
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        lo, hi = block_range(out_features if split == "columns" else in_features, P.shape[1], P.index[1])
        self._block = slice(lo, hi)
        self.weight = nn.Parameter(torch.empty((hi - lo, in_features) if split == "columns" else (out_features,
                                                                                                    hi - lo)))
        self.bias = nn.Parameter(torch.empty(hi - lo if split == "columns" else out_features)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torch.nn.Linear's draws on the global tensors (every rank alike), each worker keeping its block."""
        full = nn.Linear(self.in_features, self.out_features, bias=self.use_bias, dtype=self.weight.dtype)
        for lay in self.param_layouts():
            getattr(self, lay.name).copy_(getattr(full, lay.seq_name)[lay.replica_slices()])

    def param_layouts(self):
        from distfuse.layers import ParamLayout

        shape = (self.out_features, self.in_features)
        if self.split == "columns":
            out = [ParamLayout("weight", "weight", self.P, shape, split_dims=(1,))]
            bias = ParamLayout("bias", "bias", self.P, shape[:1], split_dims=(1,))
        else:
            out = [ParamLayout("weight", "weight", self._P_rows, shape, split_dims=(1, 2))]
            bias = ParamLayout("bias", "bias", self.P, shape[:1], split_dims=())
        return out + ([bias] if self.use_bias else [])

    def forward(self, x):
        from distfuse.primitives.all_sum_reduce import replicate, replicated_sum

        w, b = self.weight, self.bias
        if self._ctx.P.size > 1 and torch.is_grad_enabled() and w.requires_grad:
            w = replicate(w, self._ctx.handle)
            b = replicate(b, self._ctx.handle) if b is not None else None
        if self.split == "columns":
            if self._tp.P.size > 1 and torch.is_grad_enabled() and x.requires_grad:
                x = replicate(x, self._tp.handle)  # f
            return F.linear(x, w, b)
        y = F.linear(x, w)
        if self._tp.P.size > 1:
            y = replicated_sum(y, self._tp.handle)  # g
        return y + b if b is not None else y


class Distributed:
    """The distributed layers under the names :class:`GPT` asks for, over the demo's three partitions."""

    def __init__(self, P, P_tok, P_rows):
        from distfuse.layers._norm_common import subgrid
        from distfuse.primitives.all_sum_reduce import SubGridSum

        self.P, self.P_tok, self.P_rows = P, P_tok, P_rows
        # Collective over the world, in the same order on every rank (the handles name them in graphs).
        self.ctx = SubGridSum("demo_gpt", subgrid(P, [0]))
        self.tp = SubGridSum("demo_gpt", subgrid(P, [1]))

    def Embedding(self, num, dim):  # noqa: N802 - layer factories, named like the torch.nn classes they stand for
        from distfuse.layers import DistributedEmbedding

        return DistributedEmbedding(self.P_tok, num, dim)

    def LayerNorm(self, dim):  # noqa: N802
        return ContextLayerNorm(dim, self.ctx)

    def Attention(self, embed_dim, num_heads):  # noqa: N802
        from distfuse.layers import DistributedMultiheadAttention

        return DistributedMultiheadAttention(self.P, embed_dim, num_heads, causal=True, layout=LAYOUT)

    def ColumnLinear(self, n_in, n_out, bias=True):  # noqa: N802
        return TensorParallelLinear(self.P, self.ctx, self.tp, n_in, n_out, bias, split="columns")

    def RowLinear(self, n_in, n_out, bias=True):  # noqa: N802
        return TensorParallelLinear(self.P, self.ctx, self.tp, n_in, n_out, bias, split="rows", P_rows=self.P_rows)


# ---------------------------------------------------------------- training


def _batch(step: int, device):
    """Random token sequences; the target of each token is the next id of a fixed cyclic map (learnable)."""
    gen = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids.to(device), ((ids * 7 + 3) % VOCAB).to(device)


def _sequential_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, target: torch.Tensor) -> float:
    """One training step of a ``torch.nn`` twin; returns its loss."""
    opt.zero_grad()
    logits = model(ids, torch.arange(SEQ, device=ids.device))
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.detach())


def train(steps: int = 8, lr: float = 0.5, quiet: bool = False) -> list[tuple[float, float]]:
    """Train on an initialised process group of 4 ranks; returns (distributed, sequential) losses on rank 0."""
    from distfuse import Partition
    from distfuse.demo_check import make_twins, report, train_checked
    from distfuse.geometry.decomposition import block_range
    from distfuse.layers import DistributedVocabCrossEntropyLoss
    from distfuse.layers.attention_ring import local_positions
    from distfuse.model import collect_sequential, make_optimizer

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"distfuse.demo gpt needs {WORLD} ranks, got {dist.get_world_size()}")
    P4 = Partition.world().create_partition_inclusive(range(WORLD))
    P = P4.create_cartesian_topology_partition(GRID)
    P_tok = P4.create_cartesian_topology_partition((1,) + GRID)
    P_rows = P4.create_cartesian_topology_partition((GRID[0], 1, GRID[1]))
    device = P.device
    positions = local_positions(SEQ, GRID[0], P.index[0], LAYOUT).to(device)

    def twin(dtype: torch.dtype) -> GPT:
        model = GPT(Sequential).to(device=device, dtype=dtype)
        model.pos_table.copy_(sinusoidal(SEQ, EMBED))  # the float64 table in float64, not a widened float32 one
        return model

    torch.manual_seed(0)
    model = GPT(Distributed(P, P_tok, P_rows)).to(device)
    start, twins = make_twins(twin, collect_sequential(model, dst=0),  # collective: every rank takes part
                              lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
    opt = make_optimizer(torch.optim.SGD, model.parameters(), lr=lr, momentum=0.9)
    loss_fn = DistributedVocabCrossEntropyLoss(P_tok, num_classes=VOCAB)

    if dist.get_rank() == 0 and not quiet:
        print(f"distfuse GPT demo: {WORLD} ranks, backend {dist.get_backend()}, device {device}, tokens "
              f"{[BATCH, SEQ]} over P {list(GRID)} (context x tensor, {LAYOUT} layout), vocabulary {VOCAB}, "
              f"{BLOCKS} blocks of {HEADS} heads")
        print(f"{'rank':>6}  {'P index':<10}{'positions':<28}{'heads':<8}{'vocabulary rows':<16}")
        for r in range(WORLD):
            c, t = P.index_of(r)
            pos = local_positions(SEQ, GRID[0], c, LAYOUT).tolist()
            per, (lo, hi) = HEADS // GRID[1], block_range(VOCAB, GRID[1], t)
            print(f"{r:>6}  {str((c, t)):<10}{str(pos):<28}{f'{t * per}..{t * per + per - 1}':<8}"
                  f"{f'{lo}..{hi - 1}':<16}")

    def distributed_step(step: int) -> torch.Tensor:
        ids_global, t_global = _batch(step, device)
        ids, t = ids_global[:, positions].contiguous(), t_global[:, positions].contiguous()
        loss = loss_fn(model(ids, positions), t)  # the global mean, the same on every rank
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def twin_step(dtype: torch.dtype, step: int) -> float:
        return _sequential_step(*twins[dtype], *_batch(step, device))

    losses, times = train_checked(steps, TERMS, quiet, distributed_step, twin_step, device)
    report(collect_sequential(model, dst=0), twins, TERMS, steps, start, losses, times, "weights", "GPT", quiet)
    return losses
