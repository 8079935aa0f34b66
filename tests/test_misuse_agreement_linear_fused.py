"""Local checks of the row-parallel linears that fail on one worker, on the fused paths: every worker raises, at once.

``DISTFUSE_PATH=fused`` forces the fused GEMM ops (the Triton kernels run interpreted over
``/dev/shm`` workspaces on CPU).  A worker whose input fails the layer's own checks (a
feature block that is not its own, a 3-D input on a 2-D grid, a ``seq_len`` its block does
not fit, a list instead of a tensor) still enters the fused op its peers enter, and the
op refuses with the layer's error at its first claim
(:func:`distfuse.fused.agreement.refusing`): that worker raises its own ShapeError, each
peer of its row a ShapeError saying a peer refused its input.  Before, the worker raised
alone and its peers waited in the fused op until ``DISTFUSE_TIMEOUT``.

Covered: the all-gather linear (features and sequence gathered), the reduce-scatter
linear (features and sequence scattered), the ZeRO layers with one model-parallel worker
(the data-parallel workers' fused claim carries the refusal) and with two, where the
dispatch's row-count round runs as on CUDA under the size-based dispatch (it spans the
grid and carries the failure: patched in, since on CPU the count is not exchanged),
``DistributedLinear`` given a list (its flag round), and the plain layers with one
model-parallel worker under ``torch.no_grad()`` (the failing worker takes part in the
parameter broadcast before it raises, so its peers finish).  World ranks are permuted in
the grids and some world ranks hold no part of a layer (they pass zero-volume tensors).
After the errors, a good call on the fused path matches ``torch.nn.Linear`` in float64 on
the global tensors, output and every gradient (input, weight, bias).

The pool keeps the world group at torch's default timeout and every distfuse group and
workspace waits ``DISTFUSE_TIMEOUT=60`` (a fresh pool, made for this module and dropped
after it; asserted on the layer's own groups): an error that waited for a timeout would
take a minute, and each must come within :data:`PROMPT` seconds.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import distfuse.fused.zero_linear_dispatch as zero_linear_dispatch
from distfuse import Partition, zero_volume_tensor
from distfuse.fused.symmetric import close_all
from distfuse.geometry.decomposition import local_slices
from distfuse.groups import group_timeout
from distfuse.layers import (
    DistributedLinear,
    DistributedLinearAllGather,
    DistributedLinearAllGatherZero,
    DistributedLinearReduceScatter,
    DistributedLinearReduceScatterZero,
)
from distfuse.testing import run_ranks
from distfuse.testing.pool import discard_pool
from tests.misuse_support import catch
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
LIMIT = "60"  # DISTFUSE_TIMEOUT in the ranks
PROMPT = 10.0  # seconds: far below DISTFUSE_TIMEOUT=60 (fused refusals: about a second on 2 loaded cores)
WORLD = 4
_GRIDS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _fresh_pools():
    """Pools whose partitions are made with DISTFUSE_TIMEOUT=60 (made here, dropped after)."""
    for w in (WORLD, 6):
        discard_pool(w, PG_DEFAULT)
    yield
    for w in (WORLD, 6):
        discard_pool(w, PG_DEFAULT)


def _grid(ranks, shape):
    """A partition whose groups, and those the layers derive from it, wait DISTFUSE_TIMEOUT=60.

    (The layers make their sub-grids from the world partition, so the variable is set
    before the fresh pool's first ``Partition.world()``.)
    """
    os.environ["DISTFUSE_TIMEOUT"] = LIMIT
    key = (tuple(ranks), tuple(shape))
    if key not in _GRIDS:
        _GRIDS[key] = Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(
            list(shape))
    return _GRIDS[key]


def _made(cls, seed: int, *args, **kwargs):
    """The layer and ``torch.nn.Linear`` in float64 with the same global initial tensors."""
    torch.manual_seed(seed)
    layer = cls(*args, **kwargs)
    torch.manual_seed(seed)
    return layer, torch.nn.Linear(layer.in_features, layer.out_features, dtype=layer._param_dtype()).double()


def _local(xg, P):
    return xg[local_slices(xg.shape, P.shape, P.index)] if P.active else zero_volume_tensor()


def _good_call(layer, seq, P_in, P_out, gshape, seed: int, path: str | None = "fused", **kw) -> bool:
    """A call on the fused path with fresh data in the layer's dtype, against ``seq`` in float64: output and every
    gradient (input, weight, bias), with :func:`tests.tolerances.tol` of the dtype."""
    dtype = layer._param_dtype()
    gen = torch.Generator().manual_seed(seed)
    xg = torch.randn(gshape, generator=gen, dtype=torch.float64).to(dtype).double()  # representable in dtype
    dyg = torch.randn((*gshape[:-1], layer.out_features), generator=gen, dtype=torch.float64).to(dtype).double()
    layer.zero_grad(set_to_none=True)
    seq.zero_grad(set_to_none=True)
    if P_in.active:
        x = xg[local_slices(xg.shape, P_in.shape, P_in.index)].to(dtype).requires_grad_(True)
    else:
        x = zero_volume_tensor(dtype=dtype, requires_grad=True)
    y = layer(x, **kw)
    dy = dyg[local_slices(dyg.shape, P_out.shape, P_out.index)].to(dtype) if P_out.active else torch.zeros_like(y)
    y.backward(dy)
    if not P_in.active and not any(lay.P.active for lay in layer.param_layouts()):
        return y.numel() == 0
    x_ref = xg.clone().requires_grad_(True)
    y_ref = seq(x_ref)
    y_ref.backward(dyg)
    t = tol(dtype)

    def close(got, want):
        return got.shape == want.shape and torch.allclose(got.double(), want, rtol=t["rtol"], atol=t["atol"] * max(
            1.0, float(want.abs().max())))

    ok = path is None or layer.last_path == path
    if P_out.active:
        ok &= close(y, y_ref.detach()[local_slices(y_ref.shape, P_out.shape, P_out.index)])
    else:
        ok &= y.numel() == 0
    if P_in.active:
        ok &= close(x.grad, x_ref.grad[local_slices(xg.shape, P_in.shape, P_in.index)])
    for lay in layer.param_layouts():
        if lay.P.active:
            want = getattr(seq, lay.seq_name).grad[local_slices(lay.global_shape, lay.P.shape, lay.P.index)]
            ok &= close(getattr(layer, lay.name).grad, want)
    return bool(ok)


def _scenarios():
    me = dist.get_rank()
    os.environ["DISTFUSE_PATH"] = "fused"
    out = {}
    try:
        # All-gather linear, features gathered: rows {3, 1} (d = 0) and {0, 2} (d = 1), world ranks permuted.
        P = _grid((3, 1, 0, 2), (2, 2))
        ag, seq = _made(DistributedLinearAllGather, 1, P, 6, 5)
        x = _local(torch.randn(5, 6, generator=torch.Generator().manual_seed(2)), P)
        ag(x)
        out["ag_path"] = ag.last_path
        out["timeouts"] = (group_timeout(ag.P_gather.group), group_timeout(ag.P_gather.meta_group))
        out["ag_features"] = catch(lambda: ag(x[..., :2] if me == 1 else x))  # block 1 of 6 features is 3
        out["ag_list"] = catch(lambda: ag(x.tolist() if me == 0 else x))  # not a tensor
        out["ag_1d"] = catch(lambda: ag(x[0] if me == 3 else x))  # one dimension on a 2-D grid
        out["ag_again"] = _good_call(ag, seq, P, P, (5, 6), 3)
        # The sequence-parallel form on world ranks 1, 0 (a 7-long sequence: blocks 4, 3); ranks 2, 3 hold no part.
        P_y, P_x = _grid((1, 0), (1, 1, 2)), _grid((1, 0), (1, 2, 1))
        sp, seq = _made(DistributedLinearAllGather, 4, P_y, 4, 3, P_x=P_x)
        xs = _local(torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(5)), P_x)
        sp(xs, seq_len=7)
        out["sp_path"] = sp.last_path
        out["sp_seq_len"] = catch(lambda: sp(xs, seq_len=8 if me == 0 else 7))  # rank 0: block 1 of 8 is 4, not 3
        sp(xs)  # without seq_len: the first such call learns the length (one metadata gather), later ones do not
        out["sp_ndim"] = catch(lambda: sp(xs[0] if me == 1 else xs))  # 2-D on a 3-D grid, no seq_len
        out["sp_again"] = _good_call(sp, seq, P_x, P_y, (2, 7, 4), 6, seq_len=7)
        # Reduce-scatter linear, output features scattered: rows {0, 1} and {2, 3}.
        Q = _grid((0, 1, 2, 3), (2, 2))
        rs, seq = _made(DistributedLinearReduceScatter, 7, Q, 7, 6)
        xr = _local(torch.randn(3, 7, generator=torch.Generator().manual_seed(8)), Q)
        rs(xr)
        out["rs_path"] = rs.last_path
        bad = {1: xr[:, :2], 2: xr[None]}  # a wrong feature block on rank 1, a 3-D input on rank 2
        out["rs"] = catch(lambda: rs(bad.get(me, xr)))
        out["rs_again"] = _good_call(rs, seq, Q, Q, (3, 7), 9)
        # ZeRO with one model-parallel worker: four data-parallel workers, world ranks permuted.
        Z = _grid((2, 0, 3, 1), (4, 1))
        for name, cls in (("zag", DistributedLinearAllGatherZero), ("zrs", DistributedLinearReduceScatterZero)):
            layer, seq = _made(cls, 10, Z, 5, 6)
            xz = _local(torch.randn(7, 5, generator=torch.Generator().manual_seed(11)), Z)
            layer(xz)
            out[f"{name}_path"] = layer.last_path
            out[name] = catch(lambda layer=layer, xz=xz: layer(xz[:, :3] if me == 3 else xz))
            out[f"{name}_list"] = catch(lambda layer=layer, xz=xz: layer(xz.tolist() if me == 0 else xz))
            out[f"{name}_again"] = _good_call(layer, seq, Z, Z, (7, 5), 12)
        # ZeRO with two model-parallel workers, the row count exchanged as on CUDA under the size-based dispatch:
        # that round (over the whole grid) carries the failure, so the plain model-parallel collective never starts.
        exchanges = zero_linear_dispatch._exchanges_rows
        zero_linear_dispatch._exchanges_rows = lambda P_d, device: P_d.size > 1
        try:
            G = _grid((1, 3, 0, 2), (2, 2))
            for name, cls in (("zag2", DistributedLinearAllGatherZero), ("zrs2", DistributedLinearReduceScatterZero)):
                layer, seq = _made(cls, 22, G, 6, 5)
                xz2 = _local(torch.randn(5, 6, generator=torch.Generator().manual_seed(23)), G)
                layer(xz2)
                out[f"{name}_path"] = layer.last_path
                out[name] = catch(lambda layer=layer, xz2=xz2: layer(xz2[:, :1] if me == 0 else xz2))
                out[f"{name}_again"] = _good_call(layer, seq, G, G, (5, 6), 24)
        finally:
            zero_linear_dispatch._exchanges_rows = exchanges
        # DistributedLinear (no row collective: a host flag round), a list on world rank 3; world rank 1 outside.
        P_x, P_y, P_w = _grid((2, 0, 3), (1, 3)), _grid((0,), (1, 1)), _grid((0, 3, 2), (1, 3))
        general, seq = _made(DistributedLinear, 19, P_x, P_y, P_w, 7, 5)
        xl = _local(torch.randn(4, 7, generator=torch.Generator().manual_seed(20)), P_x)
        general(xl)
        out["general_list"] = catch(lambda: general(xl.tolist() if me == 3 else xl))
        out["general_again"] = _good_call(general, seq, P_x, P_y, (4, 7), 21, path=None)
        # The plain layer with one model-parallel worker, no grad: the failing worker joins the broadcast first.
        plain = DistributedLinearAllGather(Z, 5, 6)
        with torch.no_grad():
            plain(xz)
            out["pm1"] = catch(lambda: plain(xz[:, :3] if me == 3 else xz))
            out["pm1_1d"] = catch(lambda: plain(xz[0] if me == 2 else xz))
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
        close_all()
    return out


def _six():
    """World 6, bf16, the sequence forms: world ranks 1 and 4 hold no part of the layers (zero-volume inputs)."""
    me = dist.get_rank()
    os.environ["DISTFUSE_PATH"] = "fused"
    out = {}
    try:
        ranks = (5, 0, 3, 2)  # (d, m) = (0, 0), (0, 1), (1, 0), (1, 1)
        P_feat, P_seq = _grid(ranks, (2, 1, 2)), _grid(ranks, (2, 2, 1))
        rs, seq = _made(DistributedLinearReduceScatter, 13, P_feat, 7, 6, P_y=P_seq, dtype=torch.bfloat16)
        x = _local(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(14)), P_feat).bfloat16()
        rs(x)
        out["rs_path"] = rs.last_path
        out["rs"] = catch(lambda: rs(x[..., :1] if me == 3 else x))  # block 0 of 7 features over 2 is 4
        out["rs_again"] = _good_call(rs, seq, P_feat, P_seq, (3, 5, 7), 15)
        ag, seq = _made(DistributedLinearAllGather, 16, P_feat, 6, 5, P_x=P_seq, dtype=torch.bfloat16)
        xs = _local(torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(17)), P_seq).bfloat16()
        ag(xs, seq_len=5)
        out["ag_path"] = ag.last_path
        out["ag"] = catch(lambda: ag({"not": "a tensor"} if me == 2 else xs, seq_len=5))
        out["ag_again"] = _good_call(ag, seq, P_seq, P_feat, (3, 5, 6), 18, seq_len=5)
    finally:
        os.environ.pop("DISTFUSE_PATH", None)
        close_all()
    return out


def _assert_row(res, key, ranks, failing, *needles):
    """Every rank of ``ranks`` raised a ShapeError within PROMPT: ``failing`` its own, naming the needles; the
    others one saying a peer refused its input."""
    for r in ranks:
        kind, msg, secs = res[r][key]
        assert kind == "ShapeError", (key, r, res[r][key])
        assert secs < PROMPT, (key, r, secs)
        if r == failing:
            assert all(n in msg for n in needles), (key, r, needles, msg)
        else:
            assert "refused their input" in msg, (key, r, msg)


def test_local_checks_on_the_fused_paths_raise_on_every_worker():
    res = run_ranks(WORLD, _scenarios, pg_timeout=PG_DEFAULT, timeout=180)
    op = "DistributedLinearAllGather"
    assert all(res[r]["ag_path"] == "fused" for r in range(WORLD))
    assert all(res[r]["timeouts"] == (60.0, 60.0) for r in range(WORLD)), [res[r]["timeouts"] for r in range(WORLD)]
    _assert_row(res, "ag_features", (3, 1), 1, f"{op} [rank 1]", "input feature extent")
    assert res[0]["ag_features"][0] == res[2]["ag_features"][0] == "ok"  # the other row
    _assert_row(res, "ag_list", (0, 2), 0, f"{op} [rank 0]", "input type", "list")
    assert res[3]["ag_list"][0] == res[1]["ag_list"][0] == "ok"
    _assert_row(res, "ag_1d", (3, 1), 3, f"{op} [rank 3]", "number of input dimensions")
    assert res[1]["sp_path"] == res[0]["sp_path"] == "fused"
    _assert_row(res, "sp_seq_len", (1, 0), 0, f"{op} [rank 0]", "seq_len=8")
    _assert_row(res, "sp_ndim", (1, 0), 1, f"{op} [rank 1]", "number of input dimensions")
    assert all(res[r][k][0] == "ok" for r in (2, 3) for k in ("sp_seq_len", "sp_ndim"))  # outside the layer
    op = "DistributedLinearReduceScatter"
    assert all(res[r]["rs_path"] == "fused" for r in range(WORLD))
    _assert_row(res, "rs", (0, 1), 1, f"{op} [rank 1]", "input feature extent")
    _assert_row(res, "rs", (2, 3), 2, f"{op} [rank 2]", "number of input dimensions")
    for name, op in (("zag", "DistributedLinearAllGatherZero"), ("zrs", "DistributedLinearReduceScatterZero")):
        assert all(res[r][f"{name}_path"] == "fused" for r in range(WORLD)), name
        _assert_row(res, name, range(WORLD), 3, f"{op} [rank 3]", "input feature extent")
        _assert_row(res, f"{name}_list", range(WORLD), 0, f"{op} [rank 0]", "input type")
    for name, op in (("zag2", "DistributedLinearAllGatherZero"), ("zrs2", "DistributedLinearReduceScatterZero")):
        assert all(res[r][f"{name}_path"] == "fused" for r in range(WORLD)), name
        for r in range(WORLD):
            kind, msg, secs = res[r][name]
            assert kind == "ShapeError" and secs < PROMPT and f"{op} [rank {r}]" in msg, (name, r, res[r][name])
            assert ("input feature extent" if r == 0 else "world rank 0 (at least) failed its local checks") in msg, msg
    for r in (2, 0, 3):
        kind, msg, secs = res[r]["general_list"]
        assert kind == "ShapeError" and secs < PROMPT, (r, res[r]["general_list"])
        assert "DistributedLinear [rank" in msg and "world rank(s) [3] passed something else" in msg, msg
    assert res[1]["general_list"][0] == "ok"
    kind, msg, _ = res[3]["pm1"]
    assert kind == "ShapeError" and "input feature extent" in msg, res[3]["pm1"]
    assert all(res[r]["pm1"][0] == "ok" for r in (0, 1, 2)), [res[r]["pm1"] for r in range(WORLD)]
    kind, msg, _ = res[2]["pm1_1d"]
    assert kind == "ShapeError" and "number of input dimensions" in msg, res[2]["pm1_1d"]
    assert all(res[r]["pm1_1d"][0] == "ok" for r in (0, 1, 3)), [res[r]["pm1_1d"] for r in range(WORLD)]
    for key in ("ag_again", "sp_again", "rs_again", "zag_again", "zrs_again", "zag2_again", "zrs2_again",
                "general_again"):
        assert all(res[r][key] for r in range(WORLD)), (key, [res[r][key] for r in range(WORLD)])


def test_sequence_forms_in_bf16_at_world_six():
    res = run_ranks(6, _six, pg_timeout=PG_DEFAULT, timeout=180)
    layer_ranks = (5, 0, 3, 2)
    assert all(res[r]["rs_path"] == res[r]["ag_path"] == "fused" for r in layer_ranks)
    _assert_row(res, "rs", (3, 2), 3, "DistributedLinearReduceScatter [rank 3]", "input feature extent")
    assert res[5]["rs"][0] == res[0]["rs"][0] == "ok"  # the other row
    _assert_row(res, "ag", (3, 2), 2, "DistributedLinearAllGather [rank 2]", "input type", "dict")
    assert res[5]["ag"][0] == res[0]["ag"][0] == "ok"
    for r in (1, 4):  # outside the layers
        assert res[r]["rs"][0] == res[r]["ag"][0] == "ok", res[r]
    for key in ("rs_again", "ag_again"):
        assert all(res[r][key] for r in range(6)), (key, [res[r][key] for r in range(6)])
