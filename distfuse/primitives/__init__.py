"""Autograd-aware data-movement primitives, one file each (Function + nn.Module + functional form).

The functional forms (``broadcast``, ``all_gather``, ...) share their submodule's name,
so they are imported from the submodule (``from distfuse.primitives.broadcast import
broadcast``) rather than re-exported here, where they would shadow it.
"""

from distfuse.primitives.all_gather import AllGather, axes_subgrid
from distfuse.primitives.all_sum_reduce import AllSumReduce, AllSumReduceFunction
from distfuse.primitives.broadcast import Broadcast, broadcast_plan
from distfuse.primitives.distribute import collect_tensor, distribute_tensor
from distfuse.primitives.halo_exchange import HaloExchange
from distfuse.primitives.reduce_scatter import ReduceScatter
from distfuse.primitives.repartition import Repartition, RepartitionFunction
from distfuse.primitives.sum_reduce import SumReduce, sum_reduce_plan

__all__ = [
    "AllGather", "axes_subgrid",
    "AllSumReduce", "AllSumReduceFunction",
    "Broadcast", "broadcast_plan",
    "HaloExchange",
    "ReduceScatter",
    "Repartition", "RepartitionFunction", "distribute_tensor", "collect_tensor",
    "SumReduce", "sum_reduce_plan",
]
