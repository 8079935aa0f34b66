"""Test support that users can reuse: forked gloo rank pools, the adjoint test, tolerances derived from rounding."""

from distfuse.testing.adjoint import adjoint_check
from distfuse.testing.pool import RankFailure, RankPool, RankTimeout, run_ranks, shutdown_pools
from distfuse.testing.tolerance import compare_state, rounding_bound, unit_roundoff

__all__ = ["adjoint_check", "RankPool", "RankFailure", "RankTimeout", "run_ranks", "shutdown_pools",
           "compare_state", "rounding_bound", "unit_roundoff"]
