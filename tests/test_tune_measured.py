"""``distfuse-tune`` on several ranks writes ``"source": "measured"`` entries: gains, margins, providers, kernels.

On CPU the fused kernels run interpreted, so the times come from a synthetic timer (each
path still runs once, through the same cases the GPU sweep times); the plumbing, the
entries and the precedence over projected entries are what is checked.  On GPUs the same
code path times with CUDA events (``distfuse.timing``).
"""

from __future__ import annotations

import torch

from distfuse.fused import registry
from distfuse.fused.crossover_table import load_table, table_key
from distfuse.testing import run_ranks
from distfuse.timing import summarize
from distfuse.tune.sweeper import one_process_note

RS = registry.MATMUL_REDUCE_SCATTER.name
#: Synthetic medians (ms) per timed path; every sample set is the median +-2%.
TIMES = {"unfused": 1.0, "fused:triton": 0.8, "fused:triton_persistent": 0.7, "fused:cublas_chunks": 0.9}


def _samples(label):
    base = TIMES[label]
    return [base * 0.98, base, base * 1.02]


def _tune_rank(out: str):
    from distfuse.tune import cli

    ran = []

    def timer(label, fn, rotations, timing):
        fn(0)  # the path runs (interpreted): a case that cannot run fails here, as on a GPU
        ran.append(label)
        return _samples(label)

    args = cli.parse_args(["--ops", RS, "--dtype", "float32", "--quick", "--mode", "fwd", "--out", out,
                           "--no-progress", "--time-interpreted", "--world-sizes", "1", "2"])
    res = cli.run(args, timer=timer)
    return ran, res.entries, res.sweeps, res.notes


def test_measured_entries_from_two_ranks(tmp_path):
    out = tmp_path / "crossover.json"
    results = run_ranks(2, _tune_rank, str(out), timeout=600)
    ran, entries, sweeps, notes = results[0]
    key = table_key("cpu", 2, torch.float32, RS)
    assert set(ran) == set(TIMES) and results[1][1] == {}  # every provider timed; rank 0 holds the entries
    assert list(entries) == [key]  # world size 1: nothing to fuse, no entry
    assert any("world size 1" in n for n in notes["cpu|1"])
    e = entries[key]
    assert e["source"] == "measured" and e["fused"] == "always" and e["mode"] == "fwd" and e["win_margin"] == 0.0
    assert e["provider"] == "triton_persistent"
    u, f = summarize(_samples("unfused")), summarize(_samples("fused:triton_persistent"))
    gain, margin = u[0] / f[0] - 1, u[0] / f[0] - u[1] / f[2]
    assert [g[1:] for g in e["gains"]] == [[round(gain, 4), round(margin, 4)]] * 2
    assert e["gain"] == round(gain, 4) and e["margin"] == round(margin, 4)
    points = sweeps[key]["points"]
    assert all(p["provider_ms"] == {p_: TIMES[f"fused:{p_}"] for p_ in ("triton", "triton_persistent",
                                                                        "cublas_chunks")} for p in points)
    # the kernel each provider ran, named by the one selector (a fallback would show here)
    assert all(set(p["kernels"]) == {"triton", "triton_persistent", "cublas_chunks"} for p in points)
    # rank 0 wrote the table; a projected entry written later does not replace the measured one
    written = load_table(out)[key]
    assert written["source"] == "measured" and written["gains"] == e["gains"]
    from distfuse.tune.table import write_table

    write_table(out, {key: dict(fused="never", max_size=-1.0, source="projected", gain=-0.5, margin=0.1)})
    assert load_table(out)[key]["source"] == "measured"


def test_one_process_says_why_nothing_is_measured():
    note = one_process_note([1])
    assert "world size 1" in note and "torchrun" in note and "distfuse-tune project" in note
    assert one_process_note([1, 2]) is None and one_process_note([8]) is None
