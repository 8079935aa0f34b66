"""``DistributedConv1d/2d/3d``: pick the feature-, channel- or general-distributed convolution from the partitions.

================================  ==============================  ======================================
given                             partitions                      layer
================================  ==============================  ======================================
P_x only (P_y None or P_x)        P_x ``[P_b, 1, *P_s]``          :mod:`~distfuse.layers.conv_feature`
P_x, P_y and P_w                  every spatial extent 1          :mod:`~distfuse.layers.conv_general`
P_x, P_y and P_w                  some spatial extent > 1         :mod:`~distfuse.layers.conv_general`
================================  ==============================  ======================================

As DistDL's selector: without P_w the weights live on one worker and P_x may not split the
channels; with P_w, P_y is required too.  ``DistributedConv2d(...)`` returns an instance of
the chosen class, and ``isinstance(layer, DistributedConv2d)`` holds for all three.
"""

from __future__ import annotations

from distfuse.errors import PartitionError, UnsupportedError, where
from distfuse.layers._conv_common import spatial_classes
from distfuse.layers.conv_feature import FEATURE_CONVS
from distfuse.layers.conv_general import CHANNEL_CONVS, GENERAL_CONVS

__all__ = ["select_conv", "DistributedConv1d", "DistributedConv2d", "DistributedConv3d"]

_IMPLS = {nd: (FEATURE_CONVS[nd - 1], CHANNEL_CONVS[nd - 1], GENERAL_CONVS[nd - 1]) for nd in (1, 2, 3)}


def select_conv(nd: int, P_x, P_y=None, P_w=None) -> type:
    """The convolution class for ``nd`` spatial axes and these partitions (pure: no communication)."""
    op = f"DistributedConv{nd}d"
    feature, channel, general = _IMPLS[nd]
    if P_w is None:
        if P_y is not None and P_y != P_x:
            raise PartitionError(f"{where(op)}: P_y differs from P_x but P_w is None; the feature-distributed "
                                 "convolution writes its output on P_x; give P_w for a channel or general one")
        return feature
    if P_y is None:
        raise PartitionError(f"{where(op)}: P_w is given but P_y is not; channel and general distributed "
                             "convolutions need both")
    spatial = [P.shape[2:] for P in (P_x, P_y, P_w) if hasattr(P, "shape")]
    if all(all(p == 1 for p in s) for s in spatial):
        return channel
    return general


class _Selector(type):
    """Calling the class builds the selected layer; isinstance accepts all three implementations."""

    def __call__(cls, P_x, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", P_y=None, P_w=None, device=None, dtype=None,
                 static_shapes=False):
        impl = select_conv(cls.nd, P_x, P_y, P_w)
        args = (P_x, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)
        if impl is _IMPLS[cls.nd][0]:
            return impl(*args, device=device, dtype=dtype, static_shapes=static_shapes)
        if static_shapes:
            raise UnsupportedError(f"{where(f'DistributedConv{cls.nd}d')}: static_shapes is implemented for the "
                                   "feature-distributed convolution only")
        return impl(*args, P_y=P_y, P_w=P_w, device=device, dtype=dtype)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _IMPLS[cls.nd])


class _SelectorBase(metaclass=_Selector):
    nd = 0


DistributedConv1d, DistributedConv2d, DistributedConv3d = spatial_classes(
    _SelectorBase, "DistributedConv", "Distributed ``Conv{nd}d``: ``DistributedConv{nd}d(P_x, in_channels, "
    "out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True, padding_mode='zeros', "
    "P_y=None, P_w=None, device=None, dtype=None, static_shapes=False)`` returns the feature-, channel- or "
    "general-distributed layer (see the module docstring).")
