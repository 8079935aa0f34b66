"""Channel- and general-distributed convolutions against the sequential torch.nn.ConvNd.

The cases place P_x, P_w and P_y on overlapping, disjoint and reordered ranks, so every
worker role appears: in all three, P_w only, P_x only, P_y only, and outside all of
them; channel and spatial extents smaller than the partition leave empty blocks.
"""

import dataclasses

import pytest
import torch

from distfuse.testing import run_ranks
from tests.test_conv_support import Case, run_cases

MODES = ["zeros", "reflect", "replicate", "circular"]


def _case(name, world, kind, shape, cout, kernel, x, y, w, **kw):
    """``x``, ``y``, ``w``: (grid, world ranks) of P_x, P_y, P_w."""
    return pytest.param(world, Case(name, kind, shape, cout, kernel, x[0], tuple(x[1]), grid_y=y[0],
                                    y_ranks=tuple(y[1]), grid_w=w[0], w_ranks=tuple(w[1]), **kw), id=name)


CASES = [
    _case("channel-1d-2x3-overlap-6w", 6, "channel", (2, 7, 10), 5, 3,
          x=((1, 3, 1), range(3)), y=((1, 2, 1), range(2)), w=((2, 3, 1), range(6)), padding=1),
    _case("channel-2d-disjoint-xwy-8w", 8, "channel", (2, 3, 6, 5), 4, (3, 2),
          x=((1, 2, 1, 1), (4, 5)), y=((1, 2, 1, 1), (6, 7)), w=((2, 2, 1, 1), range(4)), stride=2, padding=1),
    _case("channel-1d-cin2-over-3-inactive-5w", 5, "channel", (1, 2, 9), 3, 4,
          x=((1, 3, 1), (2, 1, 0)), y=((1, 1, 1), (3,)), w=((1, 3, 1), range(3)), padding="same"),
    _case("channel-3d-reordered-4w", 4, "channel", (1, 3, 4, 3, 5), 2, 3,
          x=((1, 2, 1, 1, 1), (2, 3)), y=((1, 2, 1, 1, 1), (3, 1)), w=((2, 2, 1, 1, 1), range(4)), padding=1,
          bias=False),
    _case("general-1d-2x2-4w", 4, "general", (2, 5, 13), 3, 3,
          x=((1, 2, 2), range(4)), y=((1, 1, 2), (1, 0)), w=((1, 2, 2), range(4)), padding=2, dilation=2),
    _case("general-2d-xw-y-disjoint-8w", 8, "general", (2, 5, 7, 9), 3, 3,
          x=((1, 2, 1, 2), range(4)), y=((1, 2, 1, 2), range(4, 8)), w=((2, 2, 1, 2), range(8)), padding=1,
          dilation=(1, 2)),
    _case("general-2d-cout1-over-2-extent3-stride2-8w", 8, "general", (1, 2, 3, 6), 1, 3,
          x=((1, 1, 2, 2), range(4)), y=((1, 2, 2, 2), range(8)), w=((2, 1, 2, 2), range(8)), stride=2, padding=1),
    _case("general-3d-even-k-inactive-5w", 5, "general", (1, 3, 4, 5, 6), 2, (2, 3, 2),
          x=((1, 2, 1, 1, 2), range(4)), y=((1, 1, 1, 1, 2), (3, 2)), w=((1, 2, 1, 1, 2), range(4)),
          padding=(1, 1, 1)),
    _case("general-2d-groups2-unsplit-channels-4w", 4, "general", (2, 4, 6, 8), 6, 3,
          x=((1, 1, 2, 2), range(4)), y=((1, 1, 2, 2), range(4)), w=((1, 1, 2, 2), range(4)), padding=1, groups=2),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world,case", CASES)
def test_channel_and_general_conv_match_sequential(world, case, mode):
    cases = [dataclasses.replace(case, mode=mode, dtype=dt, seed=s)
             for s, dt in enumerate((torch.float32, torch.bfloat16))]
    for rank_results in run_ranks(world, run_cases, cases):
        for seen in rank_results:
            assert seen["kind"] == f"Distributed{case.kind.capitalize()}Conv{case.nd}d"
