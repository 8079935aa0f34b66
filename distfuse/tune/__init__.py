"""``distfuse-tune``: measure fused against unfused over shapes, write the crossover table that dispatch reads.

Run it once per cluster (device type x world size x dtype), on every rank::

    torchrun --nproc-per-node 8 -m distfuse.tune --dtype bfloat16      # NCCL, all 8 GPUs
    torchrun --nproc-per-node 8 -m distfuse.tune --world-sizes 2 4 8   # also the TP=2 and TP=4 groups
    distfuse-tune --quick                                             # one process (world size 1)
    distfuse-tune project [--check]                                   # projected entries (distfuse.tune.project)
    distfuse-tune tiles diagnose.json [--write]                       # measured tiles (distfuse.tune.tiles)

For each registered fused op (:mod:`distfuse.fused.registry`), dtype and world size it
times both paths over the op's grid of shapes (:func:`default_grid`), finds the size
interval where fused wins (:func:`crossover`) and, on rank 0, merges one entry per
``table_key(device, world, dtype, op)`` into the table that
:func:`distfuse.layers.dispatch.select_path` reads (``--out``, else :func:`table_path`).

Modules: ``table`` (the atomic writer; format and reader are :mod:`distfuse.fused.crossover_table`'s),
``crossover_fit`` (the crossover maths), ``autotune_cache`` (the Triton autotuners' configs), ``cases``
(the built-in ops' timing cases and grids), ``sweeper`` (:func:`sweep`: ``"source": "measured"``
entries), ``project`` (``"source": "projected"`` entries: the table the package ships), ``tiles`` (the
measured launch configs the pinned rules read: :mod:`distfuse.kernels.tile_table`) and ``cli``.
"""

from distfuse.fused.registry import size_of
from distfuse.tune.autotune_cache import config_to_json, harvest_autotune_caches, seed_autotune_caches
from distfuse.tune.cli import main, parse_args, run
from distfuse.tune.crossover_fit import Crossover, crossover, entry_for
from distfuse.tune.sweeper import SweepResult, default_grid, sweep
from distfuse.tune.table import load_table, table_key, table_path, write_table

__all__ = ["Crossover", "crossover", "entry_for", "default_grid", "size_of", "sweep", "SweepResult", "load_table",
           "table_key", "table_path", "write_table", "config_to_json", "harvest_autotune_caches",
           "seed_autotune_caches", "main", "parse_args", "run"]
