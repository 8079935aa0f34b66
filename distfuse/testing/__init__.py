"""Test support that users can reuse: forked gloo rank pools and the adjoint test."""

from distfuse.testing.adjoint import adjoint_check
from distfuse.testing.pool import RankFailure, RankPool, RankTimeout, run_ranks, shutdown_pools

__all__ = ["adjoint_check", "RankPool", "RankFailure", "RankTimeout", "run_ranks", "shutdown_pools"]
