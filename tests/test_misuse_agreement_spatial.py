"""Misuse and steady state of the spatial layers without a data collective that reaches every worker.

Pooling, upsampling and the transposed convolution agree on the global shape as the
feature convolution does (:mod:`distfuse.primitives._agreement`): while every worker's
signature repeats no metadata gather runs (``agreement.slow_calls`` stays put), a
legitimate change of global shape on every worker works, including one that leaves some
workers' blocks unchanged (an extent of 8 becoming 7 over two workers), and a worker that
disagrees (fp16 against bf16, fp32 against fp64, a block that is not the balanced one)
makes every worker raise the same :class:`~distfuse.errors.ShapeError`, fast (the flag,
not a timeout).  The pooling layer with kernel 2 over even blocks takes the "local" path
and sends no halo at all, so only the flag round can tell its workers.

Five ranks: ``P_x`` is ``[1, 1, 2, 2]`` over world ranks ``(2, 0, 3, 1)`` (permuted) and
rank 4 is inactive.  The world group keeps torch's default timeout;
``DISTFUSE_TIMEOUT=3`` in the ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.layers import load_sequential
from distfuse.layers.conv_transpose import DistributedConvTranspose2d
from distfuse.layers.pool import DistributedAvgPool2d, DistributedMaxPool2d
from distfuse.layers.upsample import DistributedUpsample
from distfuse.testing import run_ranks
from tests.misuse_support import catch as _catch
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
T = 3.0
RANKS = (2, 0, 3, 1)
_GRIDS: dict = {}


def _grid():
    if "P" not in _GRIDS:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
        _GRIDS["P"] = Partition.world().create_partition_inclusive(list(RANKS)).create_cartesian_topology_partition(
            [1, 1, 2, 2])
    return _GRIDS["P"]



def _layers(name: str, P):
    """``(distributed layer, float64 torch reference)``."""
    if name == "maxpool-local":  # kernel 2, stride 2 over even blocks: no halo at all
        return DistributedMaxPool2d(P, 2), nn.MaxPool2d(2)
    if name == "avgpool-halo":
        return DistributedAvgPool2d(P, 3, stride=1, padding=1), nn.AvgPool2d(3, stride=1, padding=1)
    if name == "upsample":
        return DistributedUpsample(P, scale_factor=2, mode="bilinear"), nn.Upsample(scale_factor=2, mode="bilinear")
    torch.manual_seed(5)
    seq = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, dtype=torch.float64)
    layer = DistributedConvTranspose2d(P, 2, 3, 3, stride=2, padding=1, dtype=torch.float64)
    load_sequential(layer, seq if dist.get_rank() == 0 else None)  # from world rank 0 to the root
    return layer, seq


def _check_call(layer, seq, P, xg: torch.Tensor, seed: int) -> bool:
    """One call on the blocks of ``xg`` (forward and every gradient) against torch in float64."""
    if not P.active:
        y = layer(zero_volume_tensor(dtype=xg.dtype))
        return y.numel() == 0
    x = xg[local_slices(xg.shape, P.shape, P.index)].clone().requires_grad_(True)
    y = layer(x)
    xr = xg.double().clone().requires_grad_(True)
    seq.zero_grad()
    ref = seq.double()(xr)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref.backward(gy)
    own = local_slices(ref.shape, P.shape, P.index)
    y.backward(gy[own].to(y.dtype))
    t = tol(xg.dtype)
    torch.testing.assert_close(y.double(), ref.detach()[own], **t)
    torch.testing.assert_close(x.grad.double(), xr.grad[local_slices(xg.shape, P.shape, P.index)], **t)
    if getattr(layer, "weight", None) is not None:  # the root: parameter gradients too
        torch.testing.assert_close(layer.weight.grad, seq.weight.grad, **t)
        torch.testing.assert_close(layer.bias.grad, seq.bias.grad, **t)
        layer.weight.grad = layer.bias.grad = None
    return True


def _scenario(name: str):
    me = dist.get_rank()
    P = _grid()
    layer, seq = _layers(name, P)
    g = torch.Generator().manual_seed(3)
    x8 = torch.randn(2, 2, 8, 4, generator=g, dtype=torch.float64)
    x7 = torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64)
    out = {"steady": all(_check_call(layer, seq, P, x8, s) for s in range(3))}
    site = layer.agreement if P.active else None
    out["slow_steady"] = site.slow_calls if site else None
    if P.active:
        out["path"] = layer.last_path if hasattr(layer, "last_path") else None
    # 8 -> 7 rows over two workers: the first row of workers keeps its block [4, 2]
    out["change"] = all(_check_call(layer, seq, P, x7, 10 + s) for s in range(2))
    out["slow_change"] = site.slow_calls if site else None
    xb = x7[local_slices(x7.shape, P.shape, P.index)] if P.active else zero_volume_tensor(dtype=torch.float64)
    if name == "convT":  # parameters in float64: one worker in float32 is the dtype disagreement
        out["dtype"] = _catch(lambda: layer(xb.float() if me == 3 else xb))
    else:  # bf16 everywhere first (agreed and right), then one worker in fp16
        out["bf16"] = _check_call(layer, seq, P, x7.bfloat16(), 20)
        out["dtype"] = _catch(lambda: layer(xb.half() if me == 3 else xb.bfloat16()))
    out["settled"] = _check_call(layer, seq, P, x7, 25)  # the error reset the site: agree again first,
    out["unbalanced"] = _catch(lambda: layer(xb[..., :1, :] if me == 0 else xb))  # so the flag finds this
    out["again"] = _check_call(layer, seq, P, x7, 30)
    out["slow_end"] = site.slow_calls if site else None
    return out


OPS = {"maxpool-local": "DistributedMaxPool2d", "avgpool-halo": "DistributedAvgPool2d",
       "upsample": "DistributedUpsample", "convT": "DistributedConvTranspose2d"}


@pytest.mark.parametrize("name", list(OPS))
def test_spatial_layer_gathers_only_on_change_and_raises_everywhere(name):
    res = run_ranks(5, _scenario, name, pg_timeout=PG_DEFAULT, timeout=90)
    assert res[4]["steady"] and res[4]["change"] and res[4]["again"]  # inactive: zero-volume in, out
    for r in RANKS:
        assert res[r]["steady"] and res[r]["change"] and res[r]["settled"] and res[r]["again"], res[r]
        assert res[r]["slow_steady"] == 1, res[r]  # three calls, one metadata gather
        assert res[r]["slow_change"] == 2, res[r]  # the change, seen by the workers whose block repeats too
        # then the slow path for: bf16 (pools only), the dtype error, the call after it, the unbalanced error,
        # the call after that
        assert res[r]["slow_end"] == (7 if name != "convT" else 6), res[r]
        for key in ("dtype", "unbalanced"):
            kind, msg, secs = res[r][key]
            assert kind == "ShapeError", (r, key, res[r][key])
            assert f"{OPS[name]} [rank {r}]" in msg, msg
            assert secs < T / 2, (r, key, secs)
        assert "balanced decomposition" in res[r]["unbalanced"][1]
    if name == "maxpool-local":
        assert all(res[r]["path"] == "local" for r in RANKS)  # nothing but the flag travelled
