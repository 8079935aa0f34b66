"""distfuse's communication as ``torch.library`` custom ops, for ``torch.compile`` without graph breaks.

Each op is opaque to the compiler: its eager implementation runs the same point-to-point
rounds as the autograd primitives (it calls the same functions), its fake implementation
gives the output's shape, dtype and memory format from the op's arguments alone, and its
backward is registered with ``torch.library.register_autograd`` (the adjoint op).  The
ops defined with :func:`~distfuse.primitives._op_pair.op_pair` or ``op_entry`` (the halo
exchange, the broadcast, the fused halo staging, the replicated sums, the norms' statistics) live with
their primitive or layer and are called through one entry in every
mode: the custom op while compiling, the same implementations through a generated
``autograd.Function`` in eager calls (no custom-op dispatch cost there).

=================================  ==========================================================
op                                 what it is
=================================  ==========================================================
``distfuse::halo_exchange``        the halo round (:mod:`distfuse.primitives.halo_exchange`):
                                   block -> staged input (adjoint:
                                   ``distfuse::halo_exchange_adjoint``, and back)
``distfuse::halo_staging``         the same staging by the Triton halo kernels
                                   (:mod:`distfuse.fused.halo_staging`; adjoint:
                                   ``distfuse::halo_staging_adjoint``)
``distfuse::all_gather``           a sub-grid's all-gather of blocks (adjoint:
                                   ``distfuse::all_gather_adjoint``, the reduce-scatter, and
                                   back), optionally with every worker's agreement flag
                                   (:mod:`distfuse.primitives._gather_scatter`): AllGather,
                                   ReduceScatter, the linears' collectives and ZeRO weights
``distfuse::broadcast``            blocks along a broadcast plan, sources to destinations, in an
                                   agreed memory format, optionally with every worker's
                                   agreement flag (adjoint: ``distfuse::broadcast_adjoint``, the
                                   destinations summed onto their sources, and back;
                                   :mod:`distfuse.primitives.broadcast`): Broadcast, SumReduce,
                                   every layer's input, parameter and partial-output moves
``distfuse::flag_check``           the agreement flag round of a layer without a collective
                                   (pooling, upsampling), a replayed call's
                                   (:mod:`distfuse.primitives.agreement_session`): raises on
                                   every worker when any worker's call changed
``distfuse::moments``              the norms' (count, mean, M2) all-gather and Chan combine, and
``distfuse::normalize``            xhat [* w + b] (backward: ``distfuse::normalize_backward``, the
                                   all-reduce of [sum dy, sum dy * xhat]; :mod:`distfuse.layers._norm_common`)
``distfuse::replicate``            a replicated parameter (adjoint: ``distfuse::replicate_adjoint``, the
                                   sum over a sub-grid: the losses' reduction;
                                   :mod:`distfuse.primitives.all_sum_reduce`)
``distfuse::halo_conv``            the fused halo convolution (:mod:`distfuse.fused.halo_conv`;
                                   backward: ``distfuse::halo_conv_backward``, first order only)
``distfuse::<fused op>``           the fused GEMM + collective linears (``all_gather_matmul``,
                                   ``matmul_reduce_scatter``, their ``_features`` forms,
                                   ``matmul_all_reduce``, ``zero_linear``); backward:
                                   ``distfuse::<fused op>_backward`` (:mod:`.fused_linear`)
``distfuse::ring_attention``       the context-parallel ring attention, returning the output and
                                   its log-sum-exp (:mod:`distfuse.layers.attention_ring`);
                                   backward: ``distfuse::ring_attention_backward`` (the ring
                                   again, first order only)
=================================  ==========================================================

Communication must run in the same order on every rank.  The graphs of the ranks differ
a little (the root of a parameter broadcast concatenates the parameters, the others do
not), so a compiler that reorders independent nodes by its own heuristics can order one
rank's rounds differently from its peers'.  The ops are registered as ``ORDERED``
effects, and ``eager`` / ``aot_eager`` keep program order; inductor's memory and
locality reordering does not honour the effect order (measured: the root ran its halo
round before its parameter round, and gloo aborted with "Received data size doesn't
match"), so compile with :data:`INDUCTOR_OPTIONS`::

    torch.compile(model, fullgraph=True, options=distfuse.ops.INDUCTOR_OPTIONS)

The objects an op needs (plans, partitions) are named by integer handles
(:mod:`distfuse.primitives._handles`), so every rank's graph is the same.  Shapes are
static in a compiled graph: the layers agree on metadata in eager calls and, inside a
compiled region, only check that the call repeats the agreed one (see
``docs/design.md``, "torch.compile").
"""

from distfuse.ops.fused_linear import FusedCall, run_fused
from distfuse.primitives._gather_scatter import all_gather_op, reduce_scatter_op
from distfuse.primitives.agreement_session import FlagRound, flag_check
from distfuse.primitives.broadcast import broadcast_blocks, sum_reduce_blocks
from distfuse.primitives.halo_exchange import halo_exchange, halo_exchange_adjoint

#: ``torch.compile(..., backend="inductor", options=INDUCTOR_OPTIONS)``: keep program order for the
#: communication ops (see the module docstring).
INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False, "reorder_for_locality": False}

__all__ = ["INDUCTOR_OPTIONS", "halo_exchange", "halo_exchange_adjoint", "broadcast_blocks", "sum_reduce_blocks",
           "all_gather_op", "reduce_scatter_op", "flag_check", "FlagRound", "FusedCall", "run_fused"]
