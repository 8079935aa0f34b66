"""The GPT demo: a small decoder-only transformer on 4 ranks, 2 (context) x 2 (tensor), checked against torch.nn.

``python -m distfuse.demo gpt`` starts 4 CPU ranks with gloo by itself (under ``torchrun`` it
uses the ranks it is given).  The sequence is split over the context axis in the zigzag
layout (each context worker holds 2 of 4 chunks, so the causal work is balanced); the heads,
the MLP's hidden features and the vocabulary over the tensor axis; and between them the
residual stream's rows over the tensor axis too (Megatron's sequence parallelism), so that
every projection is an all-gather + GEMM or a GEMM + reduce-scatter, the fused ops' forms::

    ids      [B, S] = [2, 12]      worker (c, t) holds ids[:, local_positions(S, 2, c, "zigzag")]   [2, 6]
    tok      DistributedEmbedding(V=50, E=16, sequence_parallel): vocabulary rows over t; the sum over t
             is a reduce-scatter of the rows: h holds rows[t] = the t-th block of the 6      [2, 3, 16]
    pos      + a fixed sinusoidal table at those rows' global positions
    2 x      h = h + attn(ln1(h)); h = h + mlp(ln2(h))
             ln     DistributedLayerNorm(P_seq, 16): local per token, weights replicated on every worker
             attn   DistributedMultiheadAttention(16, 4 heads, causal, sequence_parallel): all-gather + QKV
                    GEMM over t, heads over t, ring over c, out GEMM + reduce-scatter over t
             mlp    DistributedLinearAllGather(16 -> 64, P_x=P_seq), GELU,
                    DistributedLinearReduceScatter(64 -> 16, P_y=P_seq)
    ln_f     DistributedLayerNorm(P_seq, 16)
    head     DistributedLinearAllGather(16 -> 50, no bias, P_x=P_seq): logits [2, 6, 25], vocabulary over t,
             never gathered
    loss     DistributedVocabCrossEntropyLoss (mean over the 24 tokens): two all-reduces over t, one over c

Partitions (the same 4 workers, worker ``r`` at context index ``c = r // 2``, tensor index ``t = r % 2``
in all four; row-major grids)::

    P      [2, 2]      context x tensor: the attention
    P_tok  [1, 2, 2]   batch x context x vocabulary: the embedding's and the loss's P_x (ids / logits
                       [B, S_c] over the leading axes, the vocabulary over the last)
    P_seq  [2, 2, 1]   the residual stream [B, S_ct, E]: its rows over t (the layer norms' P_x, the
                       linears' sequence partition); the context axis is their first, data-parallel axis
    P_feat [2, 1, 2]   the linears' feature partition: [B, S_c, features over t]

Every layer is distfuse's: the linears keep their weight blocks on context index 0 and broadcast
them over the context axis (its adjoint sums the gradients of the context workers' tokens); the
layer norms' weights are copies on every worker whose gradients sum over both axes (each worker
sees other tokens).

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
        """``ids [B, S_c]`` -> logits; ``positions``: the global positions of the embedding's output rows."""
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


class Distributed:
    """The distributed layers under the names :class:`GPT` asks for, over the demo's four partitions."""

    def __init__(self, P, P_tok, P_seq, P_feat):
        from distfuse import layers

        self.P, self.P_tok, self.P_seq, self.P_feat, self._layers = P, P_tok, P_seq, P_feat, layers

    def Embedding(self, num, dim):  # noqa: N802 - layer factories, named like the torch.nn classes they stand for
        return self._layers.DistributedEmbedding(self.P_tok, num, dim, sequence_parallel=True)

    def LayerNorm(self, dim):  # noqa: N802
        return self._layers.DistributedLayerNorm(self.P_seq, dim)

    def Attention(self, embed_dim, num_heads):  # noqa: N802
        return self._layers.DistributedMultiheadAttention(self.P, embed_dim, num_heads, causal=True, layout=LAYOUT,
                                                          sequence_parallel=True)

    def ColumnLinear(self, n_in, n_out, bias=True):  # noqa: N802
        return self._layers.DistributedLinearAllGather(self.P_feat, n_in, n_out, bias, P_x=self.P_seq)

    def RowLinear(self, n_in, n_out, bias=True):  # noqa: N802
        return self._layers.DistributedLinearReduceScatter(self.P_feat, n_in, n_out, bias, P_y=self.P_seq)


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
    from distfuse.demo_check import make_twins, print_paths, report, train_checked
    from distfuse.geometry.decomposition import block_range
    from distfuse.layers import DistributedVocabCrossEntropyLoss
    from distfuse.layers.attention_ring import local_positions
    from distfuse.model import collect_sequential, make_optimizer

    if dist.get_world_size() != WORLD:
        raise SystemExit(f"distfuse.demo gpt needs {WORLD} ranks, got {dist.get_world_size()}")
    P4 = Partition.world().create_partition_inclusive(range(WORLD))
    P = P4.create_cartesian_topology_partition(GRID)
    P_tok = P4.create_cartesian_topology_partition((1,) + GRID)
    P_seq = P4.create_cartesian_topology_partition((GRID[0], GRID[1], 1))
    P_feat = P4.create_cartesian_topology_partition((GRID[0], 1, GRID[1]))
    device = P.device
    positions = local_positions(SEQ, GRID[0], P.index[0], LAYOUT).to(device)  # the context block's
    rows = positions[slice(*block_range(len(positions), GRID[1], P.index[1]))]  # the residual stream's

    def twin(dtype: torch.dtype) -> GPT:
        model = GPT(Sequential).to(device=device, dtype=dtype)
        model.pos_table.copy_(sinusoidal(SEQ, EMBED))  # the float64 table in float64, not a widened float32 one
        return model

    torch.manual_seed(0)
    model = GPT(Distributed(P, P_tok, P_seq, P_feat)).to(device)
    start, twins = make_twins(twin, collect_sequential(model, dst=0),  # collective: every rank takes part
                              lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
    opt = make_optimizer(torch.optim.SGD, model.parameters(), lr=lr, momentum=0.9)
    loss_fn = DistributedVocabCrossEntropyLoss(P_tok, num_classes=VOCAB)

    if dist.get_rank() == 0 and not quiet:
        print(f"distfuse GPT demo: {WORLD} ranks, backend {dist.get_backend()}, device {device}, tokens "
              f"{[BATCH, SEQ]} over P {list(GRID)} (context x tensor, {LAYOUT} layout), vocabulary {VOCAB}, "
              f"{BLOCKS} blocks of {HEADS} heads")
        print(f"{'rank':>6}  {'P index':<10}{'context positions':<24}{'stream rows':<14}{'heads':<8}"
              f"{'vocabulary rows':<16}")
        for r in range(WORLD):
            c, t = P.index_of(r)
            pos = local_positions(SEQ, GRID[0], c, LAYOUT).tolist()
            mine = pos[slice(*block_range(len(pos), GRID[1], t))]
            per, (lo, hi) = HEADS // GRID[1], block_range(VOCAB, GRID[1], t)
            print(f"{r:>6}  {str((c, t)):<10}{str(pos):<24}{str(mine):<14}{f'{t * per}..{t * per + per - 1}':<8}"
                  f"{f'{lo}..{hi - 1}':<16}")

    def distributed_step(step: int) -> torch.Tensor:
        ids_global, t_global = _batch(step, device)
        ids, t = ids_global[:, positions].contiguous(), t_global[:, positions].contiguous()
        loss = loss_fn(model(ids, rows), t)  # the global mean, the same on every rank
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def twin_step(dtype: torch.dtype, step: int) -> float:
        return _sequential_step(*twins[dtype], *_batch(step, device))

    losses, times = train_checked(steps, TERMS, quiet, distributed_step, twin_step, device)
    if dist.get_rank() == 0 and not quiet:
        print_paths(model)
    report(collect_sequential(model, dst=0), twins, TERMS, steps, start, losses, times, "weights", "GPT", quiet)
    return losses
