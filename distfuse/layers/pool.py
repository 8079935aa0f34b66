"""Distributed pooling layers: torch's ``MaxPoolNd`` and ``AvgPoolNd`` over spatially partitioned inputs.

Each worker passes its block of the global input (the balanced decomposition over
``P_x``) and gets back its block of torch's pooled output, with the same gradients as
``torch.nn`` on the gathered tensor.  The max layers live in
:mod:`distfuse.layers.pool_max`, the average layers in :mod:`distfuse.layers.pool_avg`,
what they share in :mod:`distfuse.layers._pool_common` and the window staging in
:mod:`distfuse.layers.pool_staging`.
"""

from distfuse.layers.pool_avg import DistributedAvgPool1d, DistributedAvgPool2d, DistributedAvgPool3d
from distfuse.layers.pool_max import DistributedMaxPool1d, DistributedMaxPool2d, DistributedMaxPool3d

__all__ = ["DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d", "DistributedAvgPool1d",
           "DistributedAvgPool2d", "DistributedAvgPool3d"]
