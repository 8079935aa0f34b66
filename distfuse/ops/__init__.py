"""distfuse's communication as ``torch.library`` custom ops, for ``torch.compile`` without graph breaks.

Each op is opaque to the compiler: its eager implementation runs the same point-to-point
rounds as the autograd primitives (it calls the same functions), its fake implementation
gives the output's shape, dtype and memory format from the op's arguments alone, and its
backward is registered with ``torch.library.register_autograd`` (the adjoint op).

=================================  ==========================================================
op                                 what it is
=================================  ==========================================================
``distfuse::halo_exchange``        :class:`~distfuse.primitives.halo_exchange.HaloExchange`'s
                                   round: block -> staged input (adjoint:
                                   ``distfuse::halo_exchange_adjoint``, and back)
``distfuse::flagged_root_broadcast``  a root's packed parameters to every worker, with every
                                   worker's agreement flag (adjoint: the sum onto the root)
``distfuse::gather``,              a sub-grid's all-gather and reduce-scatter of balanced
``distfuse::scatter_sum``          blocks (each the other's adjoint)
``distfuse::agreed_gather``,       the same with the agreement flag (the linear layers'
``distfuse::agreed_scatter_sum``   steady state)
``distfuse::broadcast_packed``     packed parameter blocks, owners to users (adjoint:
                                   ``distfuse::sum_packed``)
``distfuse::flag_check``           the agreement flag round of a layer without a collective
                                   (pooling, upsampling): raises on every worker when any
                                   worker's call changed
``distfuse::moments``              the norms' (count, mean, M2) all-gather and Chan combine
``distfuse::normalize``            xhat [* w + b] (adjoint: ``distfuse::normalize_backward``,
                                   the all-reduce of [sum dy, sum dy * xhat])
``distfuse::all_sum``,             a sub-grid's all-reduce; a replicated parameter (adjoint:
``distfuse::replicate``            ``all_sum`` of its gradient)
``distfuse::replicated_total``     the losses' all-reduce (adjoint: the identity)
``distfuse::plan_copy``,           blocks along a broadcast plan, sources to destinations, and
``distfuse::plan_sum``             destinations summed onto sources (each the other's adjoint;
                                   ``DistributedLinear``'s input broadcast and sum-reduce)
``distfuse::block_broadcast``,     the same in an agreed memory format (the channel and general
``distfuse::block_sum_reduce``,    convolutions' input, parameter and partial-output moves);
``distfuse::conv_halo``            their halo round, callable off P_x (:mod:`.conv_blocks`)
``distfuse::<fused op>``           the fused GEMM + collective linears (``all_gather_matmul``,
                                   ``matmul_reduce_scatter``, their ``_features`` forms,
                                   ``matmul_all_reduce``, ``zero_linear``); backward:
                                   ``distfuse::<fused op>_backward`` (:mod:`.fused_linear`)
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

from distfuse.ops.collectives import (
    GRAD_ANCHOR,
    NO_ANCHOR,
    FlaggedSite,
    PackedBroadcast,
    agreed_gather,
    agreed_scatter_sum,
    broadcast_packed,
    gather,
    scatter_sum,
    sum_packed,
)
from distfuse.ops.conv_blocks import block_broadcast, block_sum_reduce, conv_halo
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.ops.fused_linear import FusedCall, run_fused
from distfuse.ops.halo import halo_exchange, halo_exchange_adjoint
from distfuse.ops.norm_collectives import moments, normalize, normalize_backward
from distfuse.ops.plan_blocks import plan_copy, plan_sum
from distfuse.ops.reductions import all_sum, replicate, replicated_total
from distfuse.ops.root_broadcast import RootBroadcast, flagged_root_broadcast

#: ``torch.compile(..., backend="inductor", options=INDUCTOR_OPTIONS)``: keep program order for the
#: communication ops (see the module docstring).
INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False, "reorder_for_locality": False}

__all__ = ["INDUCTOR_OPTIONS", "halo_exchange", "halo_exchange_adjoint", "flagged_root_broadcast", "RootBroadcast",
           "FlaggedSite", "PackedBroadcast", "gather", "scatter_sum", "agreed_gather", "agreed_scatter_sum",
           "broadcast_packed", "sum_packed", "GRAD_ANCHOR", "NO_ANCHOR", "moments", "normalize",
           "normalize_backward", "all_sum", "replicate", "replicated_total", "flag_check", "FlagRound",
           "plan_copy", "plan_sum", "FusedCall", "run_fused", "block_broadcast", "block_sum_reduce", "conv_halo"]
