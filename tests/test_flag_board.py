"""The shared-memory flag board: the flag round of a one-host partition, with no gloo message in steady state.

Oracle: each round's flags are drawn from a seed every rank shares, so each rank computes the
expected "any flag" itself, independently of the board.  The board must give it in every
round, with one rank running late (a peer never reads a word overwritten by a later round),
send no gloo message once set up, fail by name within ``DISTFUSE_TIMEOUT`` when a peer never
arrives (world group at torch's default timeout), and fall back to the gloo round on every
worker when any worker disables it.
"""

from __future__ import annotations

import os
import random
import time

import torch.distributed as dist

from distfuse import Partition
from distfuse.primitives import _flag_board
from distfuse.primitives._agreement import flag_round
from distfuse.testing import run_ranks
from tests.misuse_support import catch, run_misuse


def _partition(ranks):
    """A partition of ``ranks`` (collective over the world) whose board is made afresh at its first round."""
    P = Partition.world().create_partition_inclusive(list(ranks))
    if P.active:
        _flag_board._BOARDS.pop(id(P.meta_group), None)
    return P


def _rounds(P, seed: int, n: int, late: int | None):
    """``n`` rounds with shared random flags; world rank ``late`` sleeps before some rounds. Returns the
    mismatches against the independently computed answer and the gloo messages sent after set-up."""
    gen = random.Random(seed)
    draws = [[gen.random() < 0.15 for _ in range(P.size)] for _ in range(n)]
    flag_round(P, False, "test_flag_board")  # set-up (collective: gloo here, once)
    sent = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        sent.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        wrong = []
        for k, flags in enumerate(draws):
            if dist.get_rank() == late and k % 7 == 0:
                time.sleep(0.002)
            got = flag_round(P, flags[P.rank], "test_flag_board")
            if got != any(flags):
                wrong.append(k)
    finally:
        dist.all_reduce = real
    return wrong, len(sent), _flag_board.flag_board(P) is not None


def _board_rounds():
    P = _partition([2, 0, 3])  # permuted: partition rank != world rank
    if not P.active:
        return None
    return _rounds(P, seed=11, n=400, late=3)


def test_rounds_match_the_flags_with_a_late_rank_and_send_no_message():
    out = run_ranks(4, _board_rounds)
    assert out[1] is None
    for res in (out[0], out[2], out[3]):
        wrong, sent, used = res
        assert used, "the ranks of one host must share a board"
        assert wrong == [] and sent == 0, res


def _disabled_on(rank_off: int):
    if dist.get_rank() == rank_off:
        os.environ[_flag_board.BOARD_VARIABLE] = "0"
    try:
        P = _partition(range(3))
        if not P.active:
            return None
        flag_round(P, False, "test_flag_board")
        wrong = [k for k, f in enumerate([False, True, False, True]) if flag_round(P, f and P.rank == 2, "t") != f]
        return _flag_board.flag_board(P) is None, wrong
    finally:
        os.environ.pop(_flag_board.BOARD_VARIABLE, None)


def test_one_worker_without_the_board_sends_every_worker_to_the_gloo_round():
    out = run_ranks(3, _disabled_on, 1)
    assert out == [(True, [])] * 3, out


def _missing_rank():
    P = _partition(range(3))
    flag_round(P, False, "test_flag_board")
    # The board waits for the meta group's timeout (the one the pool's groups were made with, 10 s or more here);
    # 2 s keeps the test short and proves the same bound.
    from distfuse.groups import group_timeout

    board = _flag_board.flag_board(P)
    assert board.timeout_s == group_timeout(P.meta_group), (board.timeout_s, group_timeout(P.meta_group))
    board.timeout_s = limit = 2.0
    try:
        if dist.get_rank() == 1:
            time.sleep(limit + 1)  # never takes the second round in time: its peers must give up by name
            return "skipped", limit
        return catch(lambda: flag_round(P, False, "test_flag_board")), limit
    finally:
        _flag_board._BOARDS.pop(id(P.meta_group), None)  # the rounds are out of step now: set up afresh next time


def test_a_peer_that_never_arrives_ends_in_a_named_timeout():
    out = run_misuse(3, _missing_rank, seconds="3")
    assert out[1][0] == "skipped"
    for res, limit in (out[0], out[2]):
        kind, msg, seconds = res
        assert kind == "CollectiveTimeoutError", res
        assert "agreement flag" in msg and "world ranks [1] did not reach" in msg and "timeout in force (" in msg, msg
        assert limit - 0.5 < seconds < limit + 1, res
