"""Distributed layers: Linear, Conv and ConvTranspose, pooling, upsampling, norms, losses and the embedding.

Each layer is interchangeable with its ``torch.nn`` counterpart: the same outputs and
gradients on the gathered global tensors, and ``load_sequential`` / ``collect_sequential``
move parameters between the two.  Layers with a fused path choose it per call through
:func:`distfuse.layers.dispatch.select_path` and record ``last_path``.
"""

from distfuse.layers._params import ParamLayout, collect_sequential, load_sequential
from distfuse.layers.attention_mha import DistributedMultiheadAttention, MultiheadSelfAttention
from distfuse.layers.attention_ring import DistributedAttention, distributed_attention
from distfuse.layers.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d, select_conv
from distfuse.layers.conv_feature import DistributedFeatureConv1d, DistributedFeatureConv2d, DistributedFeatureConv3d
from distfuse.layers.conv_general import (
    DistributedChannelConv1d,
    DistributedChannelConv2d,
    DistributedChannelConv3d,
    DistributedGeneralConv1d,
    DistributedGeneralConv2d,
    DistributedGeneralConv3d,
)
from distfuse.layers.conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
)
from distfuse.layers.dispatch import Decision, select_path
from distfuse.layers.embedding import DistributedEmbedding
from distfuse.layers.linear import DistributedLinear
from distfuse.layers.linear_all_gather import DistributedLinearAllGather, DistributedLinearAllGatherZero
from distfuse.layers.linear_reduce_scatter import DistributedLinearReduceScatter, DistributedLinearReduceScatterZero
from distfuse.layers.loss import (
    DistributedBCELoss,
    DistributedBCEWithLogitsLoss,
    DistributedKLDivLoss,
    DistributedL1Loss,
    DistributedMSELoss,
)
from distfuse.layers.loss_class import DistributedCrossEntropyLoss, DistributedNLLLoss
from distfuse.layers.loss_vocab import DistributedVocabCrossEntropyLoss
from distfuse.layers.norm_batch import (
    DistributedBatchNorm,
    DistributedBatchNorm1d,
    DistributedBatchNorm2d,
    DistributedBatchNorm3d,
)
from distfuse.layers.norm_group import (
    DistributedGroupNorm,
    DistributedInstanceNorm1d,
    DistributedInstanceNorm2d,
    DistributedInstanceNorm3d,
    DistributedLayerNorm,
)
from distfuse.layers.pool import (
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
)
from distfuse.layers.upsample import DistributedUpsample, interpolate

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
    "DistributedConvTranspose1d",
    "DistributedConvTranspose2d",
    "DistributedConvTranspose3d",
    "DistributedMaxPool1d",
    "DistributedMaxPool2d",
    "DistributedMaxPool3d",
    "DistributedAvgPool1d",
    "DistributedAvgPool2d",
    "DistributedAvgPool3d",
    "DistributedUpsample",
    "interpolate",
    "DistributedBatchNorm",
    "DistributedBatchNorm1d",
    "DistributedBatchNorm2d",
    "DistributedBatchNorm3d",
    "DistributedGroupNorm",
    "DistributedInstanceNorm1d",
    "DistributedInstanceNorm2d",
    "DistributedInstanceNorm3d",
    "DistributedLayerNorm",
    "DistributedMSELoss",
    "DistributedL1Loss",
    "DistributedBCELoss",
    "DistributedBCEWithLogitsLoss",
    "DistributedCrossEntropyLoss",
    "DistributedNLLLoss",
    "DistributedKLDivLoss",
    "DistributedEmbedding",
    "DistributedVocabCrossEntropyLoss",
    "select_conv",
    "select_path",
    "Decision",
    "ParamLayout",
    "load_sequential",
    "collect_sequential",
    "DistributedAttention",
    "distributed_attention",
    "DistributedMultiheadAttention", "MultiheadSelfAttention",
]
