"""distfuse's communication as ``torch.library`` custom ops, for ``torch.compile`` without graph breaks.

Each op is opaque to the compiler: a fake implementation gives the output's shape, dtype
and memory format from the arguments alone, and its backward is registered on it (the
adjoint op).  The ops live with their primitive or layer, made by
:func:`~distfuse.primitives._op_pair.op_pair` or ``op_entry`` (one entry for every mode:
see that module), or here (the fused linears).

=================================  ==========================================================
op (``distfuse::``)                what it is (backward: the adjoint op, unless said otherwise)
=================================  ==========================================================
``halo_exchange``                  the halo round, block -> staged input
                                   (:mod:`distfuse.primitives.halo_exchange`)
``halo_staging``                   the same staging by the Triton halo kernels
                                   (:mod:`distfuse.fused.halo_staging`)
``all_gather``                     a sub-grid's all-gather of blocks, optionally with every
                                   worker's agreement flag (adjoint: the reduce-scatter;
                                   :mod:`distfuse.primitives._gather_scatter`)
``broadcast``                      blocks along a broadcast plan in an agreed memory format,
                                   optionally with the agreement flag (adjoint: the
                                   destinations summed onto their sources;
                                   :mod:`distfuse.primitives.broadcast`)
``flag_check``                     the agreement flag round of a layer without a collective
                                   (:mod:`distfuse.primitives.agreement_session`)
``moments``, ``normalize``         the norms' statistics and ``xhat [* w + b]`` (backward:
                                   ``normalize_backward``; :mod:`distfuse.layers._norm_common`)
``replicate``                      a replicated parameter (adjoint: the sum over a sub-grid;
                                   :mod:`distfuse.primitives.all_sum_reduce`)
``halo_conv``                      the fused halo convolution (:mod:`distfuse.fused.halo_conv`;
                                   backward: ``halo_conv_backward``, first order only)
``<fused op>``                     the fused GEMM + collective linears (:mod:`.fused_linear`;
                                   backward: ``<fused op>_backward``)
``ring_attention``                 the context-parallel ring attention
                                   (:mod:`distfuse.layers.attention_ring`; backward:
                                   ``ring_attention_backward``, first order only)
=================================  ==========================================================

The ops are ``ORDERED`` effects, which inductor's memory and locality reordering does not
honour (the root of a parameter broadcast ran its halo round before its parameter round,
and gloo aborted; :mod:`~distfuse.primitives._op_pair`), so compile with :data:`INDUCTOR_OPTIONS`::

    torch.compile(model, fullgraph=True, options=distfuse.ops.INDUCTOR_OPTIONS)

The objects an op needs (plans, partitions) are named by integer handles
(:mod:`distfuse.primitives._handles`), so every rank's graph is the same.  Shapes are
static in a compiled graph (see ``docs/design.md``, "torch.compile").
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
