"""Distributed layers: the Linear family and the Conv1d/2d/3d family.

Each layer is interchangeable with its ``torch.nn`` counterpart: the same outputs and
gradients on the gathered global tensors, and ``load_sequential`` / ``collect_sequential``
move parameters between the two.  Layers with a fused path choose it per call through
:func:`distfuse.layers.dispatch.select_path` and record ``last_path``.
"""

from distfuse.layers._params import ParamLayout, collect_sequential, load_sequential
from distfuse.layers.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d, select_conv
from distfuse.layers.conv_channel import DistributedChannelConv1d, DistributedChannelConv2d, DistributedChannelConv3d
from distfuse.layers.conv_feature import DistributedFeatureConv1d, DistributedFeatureConv2d, DistributedFeatureConv3d
from distfuse.layers.conv_general import DistributedGeneralConv1d, DistributedGeneralConv2d, DistributedGeneralConv3d
from distfuse.layers.dispatch import Decision, select_path
from distfuse.layers.linear import DistributedLinear
from distfuse.layers.linear_all_gather import DistributedLinearAllGather, DistributedLinearAllGatherZero
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatter, DistributedLinearReduceScatterZero

__all__ = [
    "DistributedLinear",
    "DistributedLinearAllGather",
    "DistributedLinearAllGatherZero",
    "DistributedLinearReduceScatter",
    "DistributedLinearReduceScatterZero",
    "DistributedConv1d",
    "DistributedConv2d",
    "DistributedConv3d",
    "DistributedFeatureConv1d",
    "DistributedFeatureConv2d",
    "DistributedFeatureConv3d",
    "DistributedChannelConv1d",
    "DistributedChannelConv2d",
    "DistributedChannelConv3d",
    "DistributedGeneralConv1d",
    "DistributedGeneralConv2d",
    "DistributedGeneralConv3d",
    "select_conv",
    "select_path",
    "Decision",
    "ParamLayout",
    "load_sequential",
    "collect_sequential",
]
