"""Misuse of the linear layers under the agreement protocol: one named error on every rank, at once.

``DistributedLinear`` has no collective that reaches every worker, so its agreement flag
takes a one-integer host round over the union of ``P_x``, ``P_y`` and ``P_w`` before any
data moves (its :class:`~distfuse.primitives.agreement_session.AgreementSession`).  Asserted here:

* **Steady state**: three calls with repeating shapes gather the records once (the first
  call) and run one flag round per later call; no metadata otherwise.
* **Legitimate changes** (every input-holding worker called with new leading extents;
  the workers that hold no input see no change of their own and learn it from the flag)
  just work and match ``torch.nn.Linear`` in float64, forward and every gradient, in
  float64 and bfloat16.
* **Disagreements** (one worker's rows, its dtype, a feature block that is not its own,
  data on a worker outside ``P_x``, a non-floating input) raise
  :class:`~distfuse.errors.ShapeError` on every worker of the layer, both where every
  worker holds an input (which used to end in ``CollectiveTimeoutError`` after the
  timeout) and where some hold none (which used to gather metadata on every call).
* **Local checks** of the all-gather and reduce-scatter linears (a wrong feature
  extent, a block that does not fit ``seq_len``, a wrong number of dimensions) that
  fail on one worker raise on every worker of its row (they used to leave the peers in
  the collective until the timeout); other rows are unaffected.

The pools keep the world group at torch's default timeout, and the ranks run with
``DISTFUSE_TIMEOUT=60`` (fresh pools, made for this module and dropped after it), so an
error that waited for a timeout would take a minute: every one must come within
:data:`PROMPT` seconds of the call.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import distfuse.layers.linear as linear_module
import distfuse.primitives.agreement_session as agreement_session
from distfuse import Partition, zero_volume_tensor
from distfuse.geometry.decomposition import local_slices
from distfuse.groups import group_timeout
from distfuse.layers import DistributedLinear, DistributedLinearAllGather, DistributedLinearReduceScatter
from distfuse.testing import run_ranks
from distfuse.testing.pool import discard_pool
from tests.misuse_support import catch as _catch
from tests.test_linear_general import _check
from tests.test_linear_layers import _data
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
LIMIT = "60"  # DISTFUSE_TIMEOUT in the ranks
PROMPT = 5.0  # seconds from the call to the error on the loaded 2-core machine (measured: well under 0.1 s)
WORLDS = (4, 6)


@pytest.fixture(scope="module", autouse=True)
def _fresh_pools():
    """Pools whose distfuse groups are made with DISTFUSE_TIMEOUT=60 (made here, dropped after)."""
    for w in WORLDS:
        discard_pool(w, PG_DEFAULT)
    yield
    for w in WORLDS:
        discard_pool(w, PG_DEFAULT)


def _run(fn, world: int, *args):
    return run_ranks(world, fn, *args, pg_timeout=PG_DEFAULT, timeout=120)


def _grid(ranks, shape):
    os.environ["DISTFUSE_TIMEOUT"] = LIMIT  # before the first Partition.world() of the fresh pool
    return Partition.world().create_partition_inclusive(list(ranks)).create_cartesian_topology_partition(list(shape))



class _Counts:
    """Counts ``DistributedLinear``'s record gathers and the agreement flag rounds while active."""

    def __enter__(self):
        self.gathers = self.flags = 0
        self._gather, self._flag = linear_module.gather_records, agreement_session.flag_round  # the session's round

        def gather(*a, **k):
            self.gathers += 1
            return self._gather(*a, **k)

        def flag(*a, **k):
            self.flags += 1
            return self._flag(*a, **k)

        linear_module.gather_records, agreement_session.flag_round = gather, flag
        return self

    def __exit__(self, *exc):
        linear_module.gather_records, agreement_session.flag_round = self._gather, self._flag


def _assert_prompt_shape_errors(results, ranks, op, *needles):
    """Every rank in ``ranks`` raised ShapeError naming ``op``, itself and the needles, within PROMPT seconds."""
    for r in ranks:
        assert results[r][0] == "ShapeError", (r, results[r])
        kind, msg, secs = results[r]
        assert f"{op} [rank {r}]" in msg, msg
        assert all(n in msg for n in needles), (needles, msg)
        assert secs < PROMPT, (r, secs)


# ---------------------------------------------------------------- DistributedLinear


def _general(spec, gshape, bad):
    """Steady state, a legitimate change (fp64 and bf16), then each disagreement in ``bad`` (fp64)."""
    (x_spec, y_spec, w_spec), me = spec, dist.get_rank()
    P_x, P_y, P_w = _grid(*x_spec), _grid(*y_spec), _grid(*w_spec)
    in_f, out_f = gshape[-1], 5
    out = {"timeout": group_timeout()}
    for k, dtype in enumerate((torch.float64, torch.bfloat16)):
        torch.manual_seed(7 + k)
        layer = DistributedLinear(P_x, P_y, P_w, in_f, out_f, dtype=dtype)
        torch.manual_seed(7 + k)
        seq = torch.nn.Linear(in_f, out_f, dtype=dtype)
        checks = []
        with _Counts() as counts:
            for n in (gshape[-2], gshape[-2], gshape[-2], gshape[-2] + 1):  # three repeats, then a new row count
                shape = (*gshape[:-2], n, in_f)
                checks.append(_check(layer, seq, P_x, P_y, _data(shape, 30 + n, dtype), _data(
                    (*shape[:-1], out_f), 40 + n, dtype), dtype))
                layer.zero_grad(set_to_none=True)
                if n == gshape[-2] and len(checks) == 3:
                    out[f"steady_{k}"] = (counts.gathers, counts.flags, layer.agreement.slow_calls)
        out[f"checks_{k}"] = checks
        out[f"after_change_{k}"] = (counts.gathers, counts.flags, layer.agreement.slow_calls)
    # Disagreements (fp64): each starts from an agreed state, so the flag round is what finds it.
    layer = DistributedLinear(P_x, P_y, P_w, in_f, out_f, dtype=torch.float64)
    X = _data(gshape, 5, torch.float64)
    good = X[local_slices(X.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor(dtype=torch.float64)
    layer(good)
    for name, who, make in bad:
        x = make(good) if me == who else good
        out[name] = _catch(lambda x=x: layer(x))
    out["again"] = _catch(lambda: tuple(layer(good).shape))
    return out


def _more_rows(x):
    return torch.randn(*x.shape[:-2], x.shape[-2] + 1, x.shape[-1], dtype=x.dtype)


def _other_block(x):
    return torch.randn(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)


def _fp32(x):
    return x.float()


def _int64(x):
    return x.long()


def _outsider_data(x):
    return torch.randn(2, 3, 4, dtype=x.dtype)


# Every P_w and P_y worker holds an input block (P_fo = 1); world rank 1 holds no part of the layer.
EVERY_WORKER = (((2, 0, 3), (1, 3)), ((0,), (1, 1)), ((0, 3, 2), (1, 3)))
EVERY_WORKER_BAD = [("rows", 0, _more_rows), ("features", 3, _other_block), ("fp32", 2, _fp32)]


def test_general_linear_where_every_worker_holds_an_input():
    res = _run(_general, 4, EVERY_WORKER, (4, 7), EVERY_WORKER_BAD)
    layer_ranks = (0, 2, 3)
    for r in layer_ranks:
        assert res[r]["timeout"] == 60.0
        for k in (0, 1):
            assert all(c > 0 for c in res[r][f"checks_{k}"]), res[r]
            assert res[r][f"steady_{k}"] == (1, 2, 1), res[r]  # one gather, then a flag round per call
            assert res[r][f"after_change_{k}"] == (2, 3, 2), res[r]  # the change: one flag round, one gather
        assert res[r]["again"] == ("ok", (4, 5) if r == 0 else (0,)), res[r]["again"]
    op = "DistributedLinear"
    _assert_prompt_shape_errors({r: res[r]["rows"] for r in layer_ranks}, layer_ranks, op, "leading extents")
    _assert_prompt_shape_errors({r: res[r]["features"] for r in layer_ranks}, layer_ranks, op, "world rank 3")
    _assert_prompt_shape_errors({r: res[r]["fp32"] for r in layer_ranks}, layer_ranks, op, "torch.float32")
    for name in ("rows", "features", "fp32", "again"):  # world rank 1 holds no part of the layer
        assert res[1][name][0] == "ok", res[1][name]


# Some workers hold no input: P_w on four ranks, two of them outside P_x; P_y on 0 and 4; world rank 5 inactive.
SOME_WITHOUT = (((4, 1), (1, 1, 2)), ((0, 4), (1, 1, 2)), ((3, 1, 0, 2), (2, 2)))
SOME_WITHOUT_BAD = [("rows", 1, _more_rows), ("outsider_data", 3, _outsider_data), ("int64", 4, _int64)]


def test_general_linear_where_some_workers_hold_no_input():
    res = _run(_general, 6, SOME_WITHOUT, (2, 3, 7), SOME_WITHOUT_BAD)
    layer_ranks = range(5)
    for r in layer_ranks:
        assert res[r]["timeout"] == 60.0
        for k in (0, 1):
            assert all(c > 0 for c in res[r][f"checks_{k}"]), res[r]
            # It used to gather on every call: 3 gathers in three calls.
            assert res[r][f"steady_{k}"] == (1, 2, 1), res[r]
            assert res[r][f"after_change_{k}"] == (2, 3, 2), res[r]
        assert res[r]["again"][0] == "ok", res[r]["again"]
    op = "DistributedLinear"
    _assert_prompt_shape_errors({r: res[r]["rows"] for r in layer_ranks}, layer_ranks, op, "leading extents")
    _assert_prompt_shape_errors({r: res[r]["outsider_data"] for r in layer_ranks}, layer_ranks, op,
                                "world rank 3 is not in P_x")
    _assert_prompt_shape_errors({r: res[r]["int64"] for r in layer_ranks}, layer_ranks, op, "torch.int64")
    assert all(res[5][name][0] == "ok" for name in ("rows", "outsider_data", "int64", "again"))


# ---------------------------------------------------------------- local checks of the row-parallel linears


def _local_checks():
    me = dist.get_rank()
    out = {"timeout": None}
    # The all-gather linear, features gathered: rows {3, 1} (d = 0) and {0, 2} (d = 1), ranks permuted.
    P = _grid((3, 1, 0, 2), (2, 2))
    out["timeout"] = group_timeout()
    torch.manual_seed(1)
    ag = DistributedLinearAllGather(P, 6, 5)
    torch.manual_seed(1)
    seq = torch.nn.Linear(6, 5).double()
    xg = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    x = xg[local_slices(xg.shape, P.shape, P.index)]
    ag(x)
    out["ag_features"] = _catch(lambda: ag(x[..., :2] if me == 1 else x))  # block 1 of 6 features is 3
    fresh = DistributedLinearAllGather(P, 6, 5)  # a local failure on the very first call
    out["ag_first"] = _catch(lambda: fresh(x[None] if me == 0 else x))  # 3-D on a 2-D partition
    y = ag(x)
    ref = seq(xg.double())
    out["ag_again"] = bool(torch.allclose(y.double(), ref[local_slices(ref.shape, P.shape, P.index)], **tol(
        torch.float32)))
    # The sequence-parallel form: world ranks 1, 0 gather a 7-long sequence (blocks 4, 3); ranks 2, 3 inactive.
    P_y, P_x = _grid((1, 0), (1, 1, 2)), _grid((1, 0), (1, 2, 1))
    sp = DistributedLinearAllGather(P_y, 4, 3, P_x=P_x)
    xs = torch.randn(2, 7, 4)
    mine = xs[local_slices(xs.shape, P_x.shape, P_x.index)] if P_x.active else zero_volume_tensor()
    sp(mine, seq_len=7)
    out["sp_seq_len"] = _catch(lambda: sp(mine, seq_len=8 if me == 0 else 7))  # rank 0: block 1 of 8 is 4, not 3
    out["sp_again"] = _catch(lambda: tuple(sp(mine, seq_len=7).shape))
    # The reduce-scatter linear: rows {0, 1} and {2, 3}.
    Q = _grid((0, 1, 2, 3), (2, 2))
    rs = DistributedLinearReduceScatter(Q, 7, 6)
    xr = torch.randn(3, 4 if Q.index[1] == 0 else 3)
    rs(xr)
    bad = {1: xr[:, :2], 2: xr[None]}  # a wrong feature block on rank 1, a 3-D input on rank 2
    out["rs"] = _catch(lambda: rs(bad.get(me, xr)))
    out["rs_again"] = _catch(lambda: tuple(rs(xr).shape))
    return out


def test_local_checks_raise_on_every_worker_of_the_row():
    res = _run(_local_checks, 4)
    assert all(res[r]["timeout"] == 60.0 for r in range(4))
    op = "DistributedLinearAllGather"
    _assert_prompt_shape_errors({r: res[r]["ag_features"] for r in (3, 1)}, (3, 1), op, "world rank(s) [1]",
                                "input feature extent")
    assert res[0]["ag_features"][0] == res[2]["ag_features"][0] == "ok"  # the other row
    _assert_prompt_shape_errors({r: res[r]["ag_first"] for r in (0, 2)}, (0, 2), op)
    assert res[3]["ag_first"][0] == res[1]["ag_first"][0] == "ok"
    assert all(res[r]["ag_again"] for r in range(4))
    _assert_prompt_shape_errors({r: res[r]["sp_seq_len"] for r in (0, 1)}, (0, 1), op, "world rank(s) [0]", "seq_len=8")
    assert all(res[r]["sp_again"][0] == "ok" for r in range(4))
    op = "DistributedLinearReduceScatter"
    _assert_prompt_shape_errors({r: res[r]["rs"] for r in (0, 1)}, (0, 1), op, "world rank(s) [1]")
    _assert_prompt_shape_errors({r: res[r]["rs"] for r in (2, 3)}, (2, 3), op, "world rank(s) [2]",
                                "number of input dimensions")
    assert all(res[r]["rs_again"][0] == "ok" for r in range(4))
