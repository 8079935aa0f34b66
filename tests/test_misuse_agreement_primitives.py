"""Misuse and steady state of the point-to-point primitive modules under the agreement protocol.

``Broadcast``, ``SumReduce``, ``Repartition`` and ``HaloExchange`` (without
``global_shape``) move data point to point, so no message reaches every worker: their
agreement flag is a one-element host all-reduce on the union (or ``P_x``), run before any
data moves (:func:`~distfuse.primitives._agreement.agreed_by_flag_round`).  Asserted here,
on 5 ranks with permuted partitions, every worker role and a rank outside the partitions:

* while every worker's block shape, dtype and device repeat, no metadata gather runs
  (``agreement.slow_calls`` stays put);
* a legitimate change on every worker, including one that leaves some workers' blocks as
  they were, agrees again; forward and input gradient match references built from the
  global tensors in float64;
* a worker that disagrees makes every worker of the op raise the same named error,
  promptly (the world group keeps torch's default timeout, the partitions'
  ``DISTFUSE_TIMEOUT=60``): dtypes, a block that is not the balanced one, blocks summed
  into one worker of different shapes, data on a worker outside ``P_x``, a wrong number of
  dimensions, and a tensor of more than 8 dimensions (before, a check that raised on that
  worker alone, leaving its peers in the metadata gather until the timeout);
* the functional forms with ``agree=True`` turn a local check that fails on one worker
  into the same error on every worker (without it, that worker alone raises and its
  peers wait in the exchange until the timeout).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.constants import default_pg_timeout

from distfuse import zero_volume_tensor
from distfuse.geometry.decomposition import block_range, local_slices
from distfuse.primitives import Broadcast, HaloExchange, Repartition, SumReduce
from distfuse.primitives.broadcast import broadcast
from distfuse.primitives.repartition import repartition
from distfuse.primitives.sum_reduce import sum_reduce
from distfuse.testing import run_ranks
from tests.misuse_support import catch as _catch
from tests.misuse_support import patient_grid
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
PROMPT = 5.0  # seconds: far below DISTFUSE_TIMEOUT=60
_GRIDS: dict = {}


def _grid(ranks, shape):
    """A partition whose groups wait ``DISTFUSE_TIMEOUT=60`` (see ``tests.misuse_support.patient_grid``)."""
    return patient_grid(_GRIDS, ranks, shape)



def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _eq(got, want) -> bool:
    torch.testing.assert_close(got, want, **tol(torch.float64))  # sums over at most 8 workers
    return True


# ---------------------------------------------------------------- Broadcast and SumReduce


def _broadcast_call(mod, P_a, P_b, rows, dtype=torch.float64, bad=None) -> bool:
    """P_a worker j holds ``x_j [rows[j], 3]``; P_b worker (i, j) must get ``x_j``; dx_j = sum over i of dy_ij."""
    me = dist.get_rank()
    if P_a.active:
        j = P_a.index[1]
        x = _rand(rows[j], 3, seed=rows[j] + 10 * j).to(dtype).requires_grad_(True)
    else:
        x = zero_volume_tensor(dtype=dtype, requires_grad=True)
    if bad is not None and me in bad:
        x = bad[me](x)
    y = mod(x)
    if P_b.active:
        i, j = P_b.index
        assert _eq(y, _rand(rows[j], 3, seed=rows[j] + 10 * j).to(dtype))
        y.backward(_rand(rows[j], 3, seed=100 + 10 * i + j).to(dtype))
    else:
        y.backward(torch.zeros_like(y))
    if P_a.active:
        j = P_a.index[1]
        assert _eq(x.grad, sum(_rand(rows[j], 3, seed=100 + 10 * i + j) for i in range(2)).to(dtype))
    return True


def _sum_reduce_call(mod, P_b, P_a, rows, bad=None) -> bool:
    """P_b worker (i, j) holds ``x_ij [rows[j], 3]``; P_a worker j gets their sum over i; dx_ij = dy_j."""
    me = dist.get_rank()
    if P_b.active:
        i, j = P_b.index
        x = _rand(rows[j], 3, seed=200 + 10 * i + j).requires_grad_(True)
    else:
        x = zero_volume_tensor(dtype=torch.float64, requires_grad=True)
    if bad is not None and me in bad:
        x = bad[me](x)
    y = mod(x)
    if P_a.active:
        j = P_a.index[1]
        assert _eq(y, sum(_rand(rows[j], 3, seed=200 + 10 * i + j) for i in range(2)))
        y.backward(_rand(rows[j], 3, seed=300 + j))
    else:
        y.backward(torch.zeros_like(y))
    if P_b.active:
        assert _eq(x.grad, _rand(rows[P_b.index[1]], 3, seed=300 + P_b.index[1]))
    return True


def _broadcast_and_sum_reduce():
    P_a, P_b = _grid((1, 3), (1, 2)), _grid((0, 2, 4, 1), (2, 2))  # rank 1 in both, 3 only in P_a
    bc, sr = Broadcast(P_a, P_b), SumReduce(P_b, P_a)
    out = {}
    try:
        out["bc_steady"] = all(_broadcast_call(bc, P_a, P_b, (4, 3)) for _ in range(3))
        out["bc_slow_steady"] = bc.agreement.slow_calls
        out["bc_change"] = all(_broadcast_call(bc, P_a, P_b, (4, 5)) for _ in range(2))  # worker 0's block repeats
        out["bc_slow_change"] = bc.agreement.slow_calls
        out["bc_dtype"] = _catch(lambda: _broadcast_call(bc, P_a, P_b, (4, 5), bad={3: lambda x: x.float()}))
        out["bc_ok1"] = _catch(lambda: _broadcast_call(bc, P_a, P_b, (4, 5)))
        nine = {1: lambda x: x.reshape(4, 3, *([1] * 7))}  # 9 dimensions: more than the metadata record holds
        out["bc_9d"] = _catch(lambda: _broadcast_call(bc, P_a, P_b, (4, 5), bad=nine))
        out["bc_ok2"] = _catch(lambda: _broadcast_call(bc, P_a, P_b, (4, 5)))
        outside = {4: lambda x: torch.ones(2, 3, dtype=torch.float64)}  # rank 4 is only in P_y
        out["bc_outside"] = _catch(lambda: _broadcast_call(bc, P_a, P_b, (4, 5), bad=outside))
        out["bc_slow_end"] = bc.agreement.slow_calls
        out["sr_steady"] = all(_sum_reduce_call(sr, P_b, P_a, (2, 3)) for _ in range(3))
        out["sr_slow_steady"] = sr.agreement.slow_calls
        out["sr_change"] = _sum_reduce_call(sr, P_b, P_a, (2, 4))
        out["sr_shape"] = _catch(lambda: _sum_reduce_call(sr, P_b, P_a, (2, 4), bad={2: lambda x: x[:1]}))
        out["sr_ok"] = _catch(lambda: _sum_reduce_call(sr, P_b, P_a, (2, 4)))
        out["sr_slow_end"] = sr.agreement.slow_calls
    finally:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
    return out


def _assert_everywhere(res, key, ranks, op, kind="ShapeError", text=""):
    for r in ranks:
        got = res[r][key]
        assert got[0] == kind, (r, key, got)
        assert f"{op} [rank {r}]" in got[1] and text in got[1], (r, key, got[1])
        assert got[2] < PROMPT, (r, key, got[2])


def test_broadcast_and_sum_reduce_agree_or_raise_everywhere():
    res = run_ranks(5, _broadcast_and_sum_reduce, pg_timeout=PG_DEFAULT, timeout=120)
    for r in range(5):
        o = res[r]
        assert o["bc_steady"] and o["bc_change"] and o["sr_steady"] and o["sr_change"], o
        assert (o["bc_slow_steady"], o["bc_slow_change"], o["sr_slow_steady"]) == (1, 2, 1), o
        assert o["bc_ok1"] == o["bc_ok2"] == o["sr_ok"] == ("ok", True), o
        assert o["bc_slow_end"] == 7 and o["sr_slow_end"] == 4, o  # each error, and the call after it, gather
    every = range(5)
    _assert_everywhere(res, "bc_dtype", every, "Broadcast", "CollectiveMismatchError", "one dtype")
    _assert_everywhere(res, "bc_9d", every, "Broadcast", text="more than 8 dimensions")
    _assert_everywhere(res, "bc_outside", every, "Broadcast", text="zero-volume")
    _assert_everywhere(res, "sr_shape", every, "SumReduce", text="must have one shape")


# ---------------------------------------------------------------- Repartition and HaloExchange


def _repartition_call(mod, P_x, P_y, rows, bad=None) -> bool:
    me = dist.get_rank()
    xg, gy = _rand(rows, 5, seed=rows), _rand(rows, 5, seed=50 + rows)
    x = xg[local_slices(xg.shape, P_x.shape, P_x.index)].clone().requires_grad_(True) if P_x.active else \
        zero_volume_tensor(dtype=torch.float64, requires_grad=True)
    if bad is not None and me in bad:
        x = bad[me](x)
    y = mod(x)
    if P_y.active:
        own = local_slices(xg.shape, P_y.shape, P_y.index)
        assert _eq(y, xg[own])
        y.backward(gy[own])
    else:
        y.backward(torch.zeros_like(y))
    if P_x.active:
        assert _eq(x.grad, gy[local_slices(xg.shape, P_x.shape, P_x.index)])
    return True


def _halo_call(mod, P, rows, bad=None) -> bool:
    """Staged block = the zero-padded global tensor's window; the input gradient from the same windows in torch."""
    me = dist.get_rank()
    if not P.active:
        return mod(zero_volume_tensor(dtype=torch.float64)).numel() == 0
    xg = _rand(1, 2, rows, 5, seed=rows)
    xr = xg.clone().requires_grad_(True)
    padded = F.pad(xr, (1, 1, 1, 1))
    total, mine = 0, None
    for p in range(2):
        for q in range(2):
            (a, b), (c, d) = block_range(rows, 2, p), block_range(5, 2, q)
            win = padded[..., a:b + 2, c:d + 2]
            g = _rand(*win.shape, seed=70 + 2 * p + q)
            total = total + (win * g).sum()
            if (p, q) == tuple(P.index[2:]):
                mine = (win.detach(), g)
    total.backward()
    x = xg[local_slices(xg.shape, P.shape, P.index)].clone().requires_grad_(True)
    if bad is not None and me in bad:
        x = bad[me](x)
    staged = mod(x)
    assert _eq(staged, mine[0])
    staged.backward(mine[1])
    return _eq(x.grad, xr.grad[local_slices(xg.shape, P.shape, P.index)])


def _repartition_and_halo():
    P_x, P_y = _grid((3, 1, 0, 2), (2, 2)), _grid((4, 0, 2), (1, 3))  # union: every rank
    P_h = _grid((2, 0, 3, 1), (1, 1, 2, 2))  # rank 4 outside
    rp, halo = Repartition(P_x, P_y), HaloExchange(P_h, (3, 3), padding=1)
    out = {}
    try:
        out["rp_steady"] = all(_repartition_call(rp, P_x, P_y, 8) for _ in range(3))
        out["rp_slow_steady"] = rp.agreement.slow_calls
        out["rp_change"] = _repartition_call(rp, P_x, P_y, 7)  # 8 -> 7 rows: (4, 4) -> (4, 3), row 0 repeats
        out["rp_slow_change"] = rp.agreement.slow_calls
        out["rp_unbalanced"] = _catch(lambda: _repartition_call(rp, P_x, P_y, 7, bad={0: lambda x: x[:1]}))
        out["rp_ok"] = _catch(lambda: _repartition_call(rp, P_x, P_y, 7))
        out["rp_dtype"] = _catch(lambda: _repartition_call(rp, P_x, P_y, 7, bad={1: lambda x: x.float()}))
        out["rp_slow_end"] = rp.agreement.slow_calls
        out["halo_steady"] = all(_halo_call(halo, P_h, 8) for _ in range(3))
        out["halo_slow_steady"] = halo.agreement.slow_calls if P_h.active else None
        out["halo_change"] = _halo_call(halo, P_h, 7)
        out["halo_slow_change"] = halo.agreement.slow_calls if P_h.active else None
        out["halo_ndim"] = _catch(lambda: _halo_call(halo, P_h, 7, bad={0: lambda x: x[0]}))  # a local check
        out["halo_ok"] = _catch(lambda: _halo_call(halo, P_h, 7))
        out["halo_dtype"] = _catch(lambda: _halo_call(halo, P_h, 7, bad={3: lambda x: x.float()}))
        out["halo_slow_end"] = halo.agreement.slow_calls if P_h.active else None
    finally:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
    return out


def test_repartition_and_halo_exchange_agree_or_raise_everywhere():
    res = run_ranks(5, _repartition_and_halo, pg_timeout=PG_DEFAULT, timeout=120)
    for r in range(5):
        o = res[r]
        assert o["rp_steady"] and o["rp_change"] and o["rp_ok"] == ("ok", True), o
        assert (o["rp_slow_steady"], o["rp_slow_change"], o["rp_slow_end"]) == (1, 2, 5), o
        assert o["halo_steady"] and o["halo_change"] and o["halo_ok"] == ("ok", True), o
    _assert_everywhere(res, "rp_unbalanced", range(5), "Repartition", text="balanced decomposition")
    _assert_everywhere(res, "rp_dtype", range(5), "Repartition", text="agree on a supported dtype")
    halo_ranks = (2, 0, 3, 1)
    for r in halo_ranks:
        o = res[r]
        assert (o["halo_slow_steady"], o["halo_slow_change"], o["halo_slow_end"]) == (1, 2, 5), o
    _assert_everywhere(res, "halo_ndim", halo_ranks, "HaloExchange", text="dimensions")
    _assert_everywhere(res, "halo_dtype", halo_ranks, "HaloExchange", text="disagree on dtype")
    assert res[4]["halo_ndim"] == res[4]["halo_dtype"] == ("ok", True)  # outside P_h: nothing to agree on


# ---------------------------------------------------------------- the functional forms with agree=True


def _functional_forms():
    me = dist.get_rank()
    P_a, P_b = _grid((1, 3), (1, 2)), _grid((0, 2, 4, 1), (2, 2))
    P_x, P_y = _grid((3, 1, 0, 2), (2, 2)), _grid((4, 0, 2), (1, 3))
    P_h = _grid((2, 0, 3, 1), (1, 1, 2, 2))
    bc, sr = Broadcast(P_a, P_b), SumReduce(P_b, P_a)  # their plans and unions
    halo = HaloExchange(P_h, (3, 3), padding=1)
    out = {}
    try:
        x_a = _rand(4, 3, seed=P_a.index[1]) if P_a.active else zero_volume_tensor(dtype=torch.float64)
        y_shape = (4, 3) if P_b.active else None
        y = broadcast(x_a, bc.plan, y_shape, torch.float64, P_union=bc.P_union, agree=True)
        out["bc_ok"] = _eq(y, _rand(4, 3, seed=P_b.index[1])) if P_b.active else y.numel() == 0
        out["bc_ndim"] = _catch(lambda: broadcast(x_a[None] if me == 3 else x_a, bc.plan, y_shape, torch.float64,
                                                  P_union=bc.P_union, agree=True))
        out["bc_no_shape"] = _catch(lambda: broadcast(x_a, bc.plan, None if me == 4 else y_shape, torch.float64,
                                                      P_union=bc.P_union, agree=True))
        x_b = _rand(2, 3, seed=5) if P_b.active else zero_volume_tensor(dtype=torch.float64)
        out["sr_ndim"] = _catch(lambda: sum_reduce(x_b[0] if me == 2 else x_b, sr.plan, (2, 3) if P_a.active
                                                   else None, torch.float64, P_union=sr.P_union, agree=True))
        xg = _rand(7, 5, seed=7)
        x = xg[local_slices(xg.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor(
            dtype=torch.float64)
        y = repartition(x, P_x, P_y, (7, 5), agree=True)
        out["rp_ok"] = _eq(y, xg[local_slices(xg.shape, P_y.shape, P_y.index)]) if P_y.active else y.numel() == 0
        out["rp_block"] = _catch(lambda: repartition(x[:1] if me == 1 else x, P_x, P_y, (7, 5), agree=True))
        xh = _rand(1, 2, 7, 5, seed=8)
        x = xh[local_slices(xh.shape, P_h.shape, P_h.index)] if P_h.active else zero_volume_tensor(
            dtype=torch.float64)
        out["halo_block"] = _catch(lambda: halo(x[..., :1, :] if me == 3 else x, global_shape=(1, 2, 7, 5),
                                                agree=True))
    finally:
        os.environ["DISTFUSE_TIMEOUT"] = "3"
    return out


def test_functional_forms_with_agree_raise_on_every_worker():
    res = run_ranks(5, _functional_forms, pg_timeout=PG_DEFAULT, timeout=120)
    assert all(res[r]["bc_ok"] and res[r]["rp_ok"] for r in range(5)), res
    every = range(5)
    _assert_everywhere(res, "bc_ndim", every, "Broadcast", text="local checks failed on world rank(s) [3]")
    _assert_everywhere(res, "bc_no_shape", every, "Broadcast", text="needs y_shape")
    _assert_everywhere(res, "sr_ndim", every, "SumReduce", text="world rank 2: SumReduce [rank 2]")
    _assert_everywhere(res, "rp_block", every, "repartition", text="world rank(s) [1]")
    _assert_everywhere(res, "halo_block", (2, 0, 3, 1), "HaloExchange", text="is not this worker's block")
    assert res[4]["halo_block"][0] == "ok"  # outside P_h
