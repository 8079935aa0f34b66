"""The stateless functional collectives with ``agree=True``: one host round, the same error on every worker.

``all_gather(x, P, out_shape, agree=True)``, ``reduce_scatter(x, P, agree=True)`` and
``all_sum_reduce(x, P, agree=True)`` hash what every worker must share (shape or
``out_shape``, dtype, grad flag) with the outcome of the local checks, and compare the
digests in one host all-reduce before any data moves
(``distfuse/primitives/_call_agreement.py``).  On 4 ranks (permuted), with the world
group at torch's default timeout and ``DISTFUSE_TIMEOUT=60`` on the partitions, asserted:

* agreeing calls give the float64 reference built from the global tensor, forward and
  input gradient;
* fp16 against bf16 (same element size: without the check, garbage), another
  ``out_shape``, a block that is not the balanced one, another shape in a reduce-scatter
  (without the check, a gloo abort), fp32 against fp64 in a sum, and a grad flag on one
  worker only (without the check, its peers would wait in the backward) each raise
  ShapeError on every worker of the sub-grid, naming the op, within 5 s;
* workers of another sub-grid are not involved.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from distfuse import Partition
from distfuse.geometry.decomposition import local_slices
from distfuse.primitives._axes import axes_subgrid
from distfuse.primitives.all_gather import all_gather
from distfuse.primitives.all_sum_reduce import all_sum_reduce
from distfuse.primitives.reduce_scatter import reduce_scatter
from distfuse.testing import run_ranks
from tests.misuse_support import catch as _catch
from tests.tolerances import tol

PG_DEFAULT = default_pg_timeout.total_seconds()
PROMPT = 5.0
_GRIDS: dict = {}


def _subgrid():
    """``P = [2, 2]`` over ranks (3, 1, 0, 2); the sub-grid along axis 1: {3, 1} and {0, 2}."""
    if "P" not in _GRIDS:
        os.environ["DISTFUSE_TIMEOUT"] = "60"
        P = Partition.world().create_partition_inclusive([3, 1, 0, 2]).create_cartesian_topology_partition([2, 2])
        _GRIDS["P"], _GRIDS["sub"] = P, axes_subgrid(P, (1,))
    return _GRIDS["P"], _GRIDS["sub"]



def _scenario():
    me = dist.get_rank()
    P, sub = _subgrid()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(3, 5, dtype=torch.float64, generator=gen)  # columns split 3 | 2 over the sub-grid
    x = full[local_slices(full.shape, P.shape, P.index)][:, :].clone()
    row = full[local_slices(full.shape, [P.shape[0], 1], [P.index[0], 0])]  # this worker's rows, every column
    out = {}

    def gather_ok():
        xi = x.clone().requires_grad_(True)
        y = all_gather(xi, sub, row.shape, agree=True)
        def dy_of(rank):
            return torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11 + rank))

        y.backward(dy_of(me))
        torch.testing.assert_close(y, row, rtol=0, atol=0)
        total = sum(dy_of(r) for r in sub.ranks)  # the gather's adjoint: the sub-grid's sum, my columns
        want = total[local_slices(total.shape, [1, P.shape[1]], [0, P.index[1]])]
        torch.testing.assert_close(xi.grad, want, **tol(torch.float64))  # a sum over the sub-grid
        return True

    out["gather"] = _catch(gather_ok)
    b16 = x.to(torch.float16 if me == 1 else torch.bfloat16)
    out["gather_dtype"] = _catch(lambda: all_gather(b16, sub, row.shape, agree=True))
    out["gather_out_shape"] = _catch(lambda: all_gather(x, sub, (row.shape[0], 6) if me == 0 else row.shape,
                                                        agree=True))
    out["gather_block"] = _catch(lambda: all_gather(x[:, :1] if me == 2 else x, sub, row.shape, agree=True))
    out["gather_grad"] = _catch(lambda: all_gather(x.clone().requires_grad_(me == 3), sub, row.shape, agree=True))

    part = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + me))

    def rs_ok():
        y = reduce_scatter(part, sub, agree=True)
        parts = [torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + r))
                 for r in sub.ranks]
        want = sum(parts)[local_slices((2, 5), [1, sub.shape[1]], [0, P.index[1]])]
        torch.testing.assert_close(y, want, **tol(torch.float64))
        return True

    out["rs"] = _catch(rs_ok)
    out["rs_shape"] = _catch(lambda: reduce_scatter(part[:, :4] if me == 3 else part, sub, agree=True))
    out["sum"] = _catch(lambda: all_sum_reduce(part, sub, agree=True).shape)
    out["sum_dtype"] = _catch(lambda: all_sum_reduce(part.float() if me == 0 else part, sub, agree=True))
    return out


def test_functional_collectives_with_agree_raise_on_every_worker_of_the_sub_grid():
    res = run_ranks(4, _scenario, pg_timeout=PG_DEFAULT, timeout=120)
    for r in range(4):
        assert res[r]["gather"] == ("ok", True) and res[r]["rs"] == ("ok", True), res[r]
        assert res[r]["sum"] == ("ok", torch.Size([2, 5])), res[r]
    groups = {"gather_dtype": (3, 1), "gather_out_shape": (0, 2), "gather_block": (0, 2), "gather_grad": (3, 1),
              "rs_shape": (3, 1), "sum_dtype": (0, 2)}
    ops = {"gather": "AllGather", "rs": "ReduceScatter", "sum": "AllSumReduce"}
    for case, ranks in groups.items():
        op = ops[case.split("_")[0]]
        for r in range(4):
            got = res[r][case]
            if r in ranks:
                assert got[0] == "ShapeError" and f"{op} [rank {r}]" in got[1] and got[2] < PROMPT, (case, r, got)
            else:
                assert got[0] == "ok", (case, r, got)  # the other sub-grid agreed among itself
    assert "torch.float16" in res[3]["gather_dtype"][1] and "torch.bfloat16" in res[3]["gather_dtype"][1]
    assert "out_shape" in res[2]["gather_out_shape"][1]
    assert "balanced block" in res[0]["gather_block"][1] and "world rank 2" in res[0]["gather_block"][1]
    assert "grad" in res[1]["gather_grad"][1]
