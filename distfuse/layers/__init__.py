"""Distributed layers: Linear, Conv and ConvTranspose, pooling, upsampling, norms, losses, embedding, attention.

Each layer is interchangeable with its ``torch.nn`` counterpart: the same outputs and
gradients on the gathered global tensors, and ``load_sequential`` / ``collect_sequential``
move parameters between the two.  Layers with a fused path choose it per call through
:func:`distfuse.layers.dispatch.select_path` and record ``last_path``.

What every layer shares (the modules say only where they differ):

* Agreement.  Workers holding no input must learn the global shape, and every worker must
  take part in the adjoints any worker runs (else its peers wait until the timeout).  Each
  layer agrees through its :class:`~distfuse.primitives.agreement_session.AgreementSession`
  (``session``; ``agreement``, its site, counts ``calls`` and ``slow_calls``): a host-side
  metadata gather, checked alike on every worker, on the first call and when some worker's
  call changed; while calls repeat only a one-element flag moves (a round of its own, or
  riding in a collective the layer runs anyway).  ``static_shapes`` changes nothing.
* One forward for eager calls, ``capture_safe()`` and ``torch.compile(fullgraph=True)``: the
  moves are ``distfuse::`` op pairs whose eager calls run the same implementations, so both
  send the same messages and compute the same bits; a compiled call replays the record (and
  the path) of the last eager call, with the flag as ``distfuse::flag_check``.
* Workers outside a layer's partitions pass and get back zero-volume tensors (and hold no
  parameters: None there); every worker of the partitions must call backward when one does.
* Construction is collective over the world wherever a layer creates partitions (sub-grids,
  its root's grids).  Every rank draws the global parameters as the ``torch.nn`` layer does
  (the same calls in the same order) and keeps its block, so that the ranks' generators stay
  in step and, with one seed on every rank, the blocks are the sequential layer's.
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
    "DistributedLinear", "DistributedLinearAllGather", "DistributedLinearAllGatherZero",
    "DistributedLinearReduceScatter", "DistributedLinearReduceScatterZero",
    "DistributedConv1d", "DistributedConv2d", "DistributedConv3d",
    "DistributedFeatureConv1d", "DistributedFeatureConv2d", "DistributedFeatureConv3d",
    "DistributedChannelConv1d", "DistributedChannelConv2d", "DistributedChannelConv3d",
    "DistributedGeneralConv1d", "DistributedGeneralConv2d", "DistributedGeneralConv3d",
    "DistributedConvTranspose1d", "DistributedConvTranspose2d", "DistributedConvTranspose3d",
    "DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d",
    "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d",
    "DistributedUpsample", "interpolate",
    "DistributedBatchNorm", "DistributedBatchNorm1d", "DistributedBatchNorm2d", "DistributedBatchNorm3d",
    "DistributedGroupNorm", "DistributedInstanceNorm1d", "DistributedInstanceNorm2d", "DistributedInstanceNorm3d",
    "DistributedLayerNorm",
    "DistributedMSELoss", "DistributedL1Loss", "DistributedBCELoss", "DistributedBCEWithLogitsLoss",
    "DistributedCrossEntropyLoss", "DistributedNLLLoss", "DistributedKLDivLoss",
    "DistributedEmbedding", "DistributedVocabCrossEntropyLoss",
    "select_conv", "select_path", "Decision", "ParamLayout", "load_sequential", "collect_sequential",
    "DistributedAttention", "distributed_attention", "DistributedMultiheadAttention", "MultiheadSelfAttention",
]
