"""The agreement flags on the host round (the CUDA default) keep every misuse guarantee, with no device read.

On a CUDA partition the agreement flags travel in a one-integer all-reduce on the host
meta group before the plain data collective (``distfuse/primitives/_flag_transport.py``),
because reading a flag element of a CUDA message would synchronise the device on every
call.  No GPU here: these tests force that transport on CPU partitions
(``flag_transport("host")``) and rerun the misuse scenarios of
``tests/test_misuse_agreement.py`` with their own assertions (steady state gathers no
metadata; fp16 against bf16, other row counts, fp64 and int64 raise ShapeError on every
worker of the collective within half of ``DISTFUSE_TIMEOUT``; a legitimate change of
global shape, also one that leaves some blocks unchanged, just works and matches torch.nn).
In every rank the in-band read of a received flag is made to fail, and the host rounds
are counted, so the scenarios can only pass through the host transport.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import distfuse.primitives._axes_flagged as axes_flagged
import distfuse.primitives._flag_transport as transport
import tests.test_misuse_agreement as scenarios
from distfuse.primitives._flag_transport import flag_transport, flags_on_host


@contextlib.contextmanager
def _host_only():
    """Host transport; an in-band flag read raises; counts the host rounds (returned list's length)."""
    rounds = []
    real_round, real_read = transport.flag_round, axes_flagged._flag_set

    def counted(P, flag, op):
        rounds.append(op)
        return real_round(P, flag, op)

    def refused(flags):
        raise AssertionError("an in-band flag was read under the host transport")

    transport.flag_round, axes_flagged._flag_set = counted, refused
    try:
        with flag_transport("host"):
            yield rounds
    finally:
        transport.flag_round, axes_flagged._flag_set = real_round, real_read


def _on_host(scenario):
    with _host_only() as rounds:
        out = scenario()
    out["host_rounds"] = len(rounds)
    return out


# The scenarios themselves, taken before the tests swap the module's names for the wrappers below (rank
# processes forked after the swap must still reach the originals).
_SCENARIOS = {name: getattr(scenarios, name) for name in
              ("_all_gather_linear", "_sequence_parallel", "_feature_conv", "_primitive_modules")}


def _all_gather_linear():
    return _on_host(_SCENARIOS["_all_gather_linear"])


def _sequence_parallel():
    return _on_host(_SCENARIOS["_sequence_parallel"])


def _feature_conv():
    return _on_host(_SCENARIOS["_feature_conv"])


def _primitive_modules():
    return _on_host(_SCENARIOS["_primitive_modules"])


CASES = [
    ("_all_gather_linear", _all_gather_linear, scenarios.test_all_gather_linear_agrees_or_raises_on_the_row),
    ("_sequence_parallel", _sequence_parallel,
     scenarios.test_sequence_parallel_gather_learns_uneven_changes_and_refuses_unbalanced_blocks),
    ("_feature_conv", _feature_conv,
     scenarios.test_feature_conv_gathers_only_on_change_and_raises_everywhere_on_disagreement),
    ("_primitive_modules", _primitive_modules, scenarios.test_primitive_modules_raise_on_every_worker_of_the_sub_grid),
]


@pytest.mark.parametrize("name, on_host, check", CASES, ids=[c[0].strip("_") for c in CASES])
def test_misuse_scenario_on_the_host_flag_transport(monkeypatch, name, on_host, check):
    seen = []
    real_run = scenarios._run

    def run(fn, world: int = 4):
        res = real_run(fn, world)
        seen.append(res)
        return res

    monkeypatch.setattr(scenarios, name, on_host)
    monkeypatch.setattr(scenarios, "_run", run)
    check()  # the scenario's own assertions
    assert seen and any(r["host_rounds"] > 0 for r in seen[0])  # the flags did take the host round


def test_transport_follows_the_partition_device_type():
    assert not flags_on_host("cpu") and flags_on_host("cuda") and flags_on_host(torch.device("cuda", 1))
    with flag_transport("host"):
        assert flags_on_host("cpu")
    with flag_transport("inband"):
        assert not flags_on_host("cuda")
    with pytest.raises(ValueError, match="flag_transport"):
        with flag_transport("sometimes"):
            pass
