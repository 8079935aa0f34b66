"""Autograd-aware data-movement primitives, one file each (Function + nn.Module + functional form)."""

from distfuse.primitives.all_gather import AllGather, AllGatherFunction, all_gather, axes_subgrid
from distfuse.primitives.all_sum_reduce import AllSumReduce, AllSumReduceFunction, all_sum_reduce
from distfuse.primitives.broadcast import Broadcast, BroadcastFunction, broadcast, broadcast_plan
from distfuse.primitives.halo_exchange import HaloExchange, HaloExchangeFunction
from distfuse.primitives.halo_plan import HaloPlan, resolve_padding
from distfuse.primitives.reduce_scatter import ReduceScatter, ReduceScatterFunction, reduce_scatter
from distfuse.primitives.repartition import (
    Repartition,
    RepartitionFunction,
    collect_tensor,
    distribute_tensor,
    repartition,
)
from distfuse.primitives.sum_reduce import SumReduce, SumReduceFunction, sum_reduce, sum_reduce_plan

__all__ = [
    "AllGather", "AllGatherFunction", "all_gather", "axes_subgrid",
    "AllSumReduce", "AllSumReduceFunction", "all_sum_reduce",
    "Broadcast", "BroadcastFunction", "broadcast", "broadcast_plan",
    "HaloExchange", "HaloExchangeFunction", "HaloPlan", "resolve_padding",
    "ReduceScatter", "ReduceScatterFunction", "reduce_scatter",
    "Repartition", "RepartitionFunction", "repartition", "distribute_tensor", "collect_tensor",
    "SumReduce", "SumReduceFunction", "sum_reduce", "sum_reduce_plan",
]
