"""The launch-cache hits' kill switch (``DISTFUSE_FAST_LAUNCH``) and the GPU lab's launch canary that sets it.

The canary's check itself (every bound op's hits bitwise the JIT's) needs a GPU:
``tests/test_launch_cache.py::test_bound_launches_match_the_jit_cuda`` runs it there.  Here: the setting, and the
canary's decision, its children and its record, with stand-in children and the dry run's real ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from distfuse.kernels import launch_cache

ROOT = Path(__file__).resolve().parent.parent


def _canary():
    spec = importlib.util.spec_from_file_location("launch_canary", ROOT / "scripts" / "launch_canary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


canary = _canary()


def test_the_fast_launch_setting(monkeypatch):
    monkeypatch.delenv(launch_cache.FAST_LAUNCH_ENV, raising=False)
    assert launch_cache.fast_launch_enabled()
    for value, want in (("1", True), ("0", False), (" 0 ", False), ("", True)):
        monkeypatch.setenv(launch_cache.FAST_LAUNCH_ENV, value)
        assert launch_cache.fast_launch_enabled() is want, value
    monkeypatch.setenv(launch_cache.FAST_LAUNCH_ENV, "off")
    with pytest.raises(ValueError, match="DISTFUSE_FAST_LAUNCH='off'"):
        launch_cache.fast_launch_enabled()


def test_without_the_fast_launch_a_hit_calls_the_binarys_runner(monkeypatch):
    """Off: the hit launcher is the binary's ``run`` with its own leading arguments, even where the C launcher
    would be found (here a ``run`` whose module claims Triton 3.6's format), and tensors go as themselves."""
    class Run:  # Triton 3.6's CudaLauncher as far as raw_launch reads it; its C function stood in by a builtin
        launch, launch_cooperative_grid, launch_pdl = print, False, False
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, *args):
            raise AssertionError("not called here")

    module = types.ModuleType("fake_driver")
    module._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    Run.__module__ = "fake_driver"
    monkeypatch.setitem(sys.modules, "fake_driver", module)
    run = Run()
    binary = types.SimpleNamespace(run=run, function=0xBEEF, packed_metadata=("packed",))
    monkeypatch.setattr(launch_cache, "FAST_LAUNCH", True)
    assert launch_cache.hit_launcher(binary)[0] is print, "on (the default): the C launcher"
    monkeypatch.setattr(launch_cache, "FAST_LAUNCH", False)
    assert launch_cache.hit_launcher(binary) == (run, 0xBEEF, (("packed",), None, None, None))
    code = ("import os; os.environ['DISTFUSE_FAST_LAUNCH'] = '0'; from distfuse.kernels import launch_cache as c; "
            "import torch; t = torch.zeros(4); "
            "print(c.FAST_LAUNCH, c._BY_ADDRESS, c.fingerprint_and_addresses((t,))[1][0] is t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["False", "is_meta", "True"], out.stderr[-2000:]


def _runs(*results):
    """A stand-in ``run(env, timeout)`` returning ``results`` in turn, recording what it was asked."""
    asked = []

    def run(env, timeout):
        asked.append((dict(env), timeout))
        return dict(env=env, **results[len(asked) - 1])

    return run, asked


def test_the_canary_keeps_the_first_setting_that_passes():
    run, asked = _runs(dict(ok=True))
    assert canary.decide(run, 50)["env"] == {} and [a[0] for a in asked] == [{}]
    run, asked = _runs(dict(ok=False, why="output 3 differs"), dict(ok=True))
    res = canary.decide(run, 50)
    assert res["env"] == {"DISTFUSE_FAST_LAUNCH": "0"} and [a[0] for a in asked] == [{}, {"DISTFUSE_FAST_LAUNCH": "0"}]
    assert [r["ok"] for r in res["runs"]] == [False, True]
    run, asked = _runs(dict(ok=False, rc=-11), dict(ok=False, rc=1))
    assert canary.decide(run, 50)["env"] == {"DISTFUSE_LAUNCH_CACHE": "0"}, "none passed: no launch cache"


def test_a_timed_out_first_try_runs_again_before_the_next_setting():
    """A cold Triton cache compiles every kernel: a first child that timed out runs once more (with the binaries on
    disk) before the canary gives the fast launch up; a second timeout moves on."""
    run, asked = _runs(dict(ok=False, why="timed out after 50 s"), dict(ok=True))
    assert canary.decide(run, 50)["env"] == {} and [a[0] for a in asked] == [{}, {}]
    run, asked = _runs(dict(ok=False, why="timed out after 50 s"), dict(ok=False, why="timed out after 20 s"),
                       dict(ok=True))
    assert canary.decide(run, 50)["env"] == {"DISTFUSE_FAST_LAUNCH": "0"}
    assert [a[0] for a in asked] == [{}, {}, {"DISTFUSE_FAST_LAUNCH": "0"}]


def test_the_canary_stays_within_its_budget():
    """The first child (the one that compiles) gets at most ``FIRST_SHARE`` of the budget, so a rerun or the next
    setting has the rest; each later child gets what is left (the stand-ins take no time: all of it); with under
    5 s left no child starts, and the lab runs with the hits through Triton's own launcher (the path the lab ran
    on before; the fast one was never shown to work), or, where that one ran and failed, without the launch
    cache."""
    run, asked = _runs(dict(ok=False, why="output 0 differs"))
    res = canary.decide(run, 4)
    assert asked == [] and res["env"] == {"DISTFUSE_FAST_LAUNCH": "0"} and "not run" in res["runs"][0]["why"]
    run, asked = _runs(dict(ok=True))
    canary.decide(run, 30)
    assert asked[0][1] == pytest.approx(canary.FIRST_SHARE * 30)
    run, asked = _runs(dict(ok=False, why="timed out after 19 s"), dict(ok=True))
    canary.decide(run, 30)
    assert asked[1][1] == pytest.approx(30, abs=1), "the rerun: what is left"
    run, asked = _runs(dict(ok=False, why="output 0 differs"), dict(ok=False, why="output 1 differs"))
    assert canary.decide(run, 30, tries=({}, {"DISTFUSE_FAST_LAUNCH": "0"}))["env"] == {"DISTFUSE_LAUNCH_CACHE": "0"}


def test_a_canary_whose_jit_path_fails_switches_nothing():
    """Where the JIT's own path fails, the launch cache is not what is wrong: the canary keeps the defaults and says
    why, rather than turning the cache off for the whole lab."""
    run, asked = _runs(dict(ok=False, inconclusive=True, why="the JIT's path failed: RuntimeError: CUDA error"))
    res = canary.decide(run, 50)
    assert res["env"] == {} and len(asked) == 1 and res["runs"][0]["inconclusive"]


def test_a_child_that_fails_is_recorded_with_its_output(tmp_path):
    """A real child process: one that exits non-zero or prints no result is a failure, with its exit code and the
    tail of its output; a timeout is named."""
    res = canary.run_child({}, 60, dry_run=True)
    assert res["ok"] and res["dry_run"] and res["rc"] == 0
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; print('canary: {\"ok\": true}'); print('boom', file=sys.stderr); sys.exit(3)\n")
    res = _with_file(canary.run_child, bad, {}, 60)
    assert not res["ok"] and res["rc"] == 3 and "boom" in res["tail"]
    slow = tmp_path / "slow.py"
    slow.write_text("import time; time.sleep(30)\n")
    res = _with_file(canary.run_child, slow, {}, 1)
    assert not res["ok"] and res["why"].startswith("timed out")


def _with_file(fn, path, *args):
    """Call ``fn`` with the canary's child command pointed at ``path`` (a script standing in for the child)."""
    saved = canary.__file__
    canary.__file__ = str(path)
    try:
        return fn(*args)
    finally:
        canary.__file__ = saved


def test_the_decision_goes_into_probe_json_and_back_out(tmp_path):
    """``--probe-json`` merges the record into the probe's file (its keys kept); ``--env-of`` prints the assignment
    the lab exports: nothing for the defaults, the setting otherwise, nothing for a probe without a canary."""
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"torch": "2.11"}))
    script = str(ROOT / "scripts" / "launch_canary.py")
    out = subprocess.run([sys.executable, script, "--dry-run", "--probe-json", str(probe), "--timeout", "60"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "the lab runs with the defaults" in out.stdout, out.stderr[-2000:]
    data = json.loads(probe.read_text())
    assert data["torch"] == "2.11" and data["launch_canary"]["env"] == {} and data["launch_canary"]["runs"][0]["ok"]

    def env_of(path):
        return subprocess.run([sys.executable, script, "--env-of", str(path)], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert env_of(probe) == ""
    data["launch_canary"]["env"] = {"DISTFUSE_FAST_LAUNCH": "0"}
    probe.write_text(json.dumps(data))
    assert env_of(probe) == "DISTFUSE_FAST_LAUNCH=0"
    assert env_of(tmp_path / "missing.json") == ""


def _ops(monkeypatch, cached=None, jit_calls=None, hits=1):
    """Point the canary at stand-in ops: ``jit_calls[i]`` (default: the same ones each call) through the JIT, then
    ``cached`` (default the same) through the launch cache; every family reports ``hits`` hits.  Returns the default
    outputs."""
    import torch

    base = [torch.linspace(-3, 5, 64), torch.arange(12.0).reshape(3, 4)]
    jit_calls = list(jit_calls or [base, base])
    cached = base if cached is None else cached

    def bound_ops(device):
        def op():
            if os.environ.get(launch_cache.LAUNCH_CACHE_ENV) == "0":
                return [t.clone() for t in jit_calls.pop(0)]
            return [t.clone() for t in cached]

        op.stage_key = None
        return op

    monkeypatch.setattr(canary, "bound_ops", bound_ops)
    monkeypatch.setattr(canary, "hit_counts", lambda key: dict(stage=hits, chunk_reduce=hits, producer=hits,
                                                                 consumer=hits))
    monkeypatch.delenv(launch_cache.LAUNCH_CACHE_ENV, raising=False)
    return base


def test_the_canary_compares_bit_for_bit_with_the_jit(monkeypatch):
    """The judgement: bitwise where the JIT repeats itself bitwise; one flipped low bit is a failure; a NaN or an
    empty output is a failure; the JIT's setting is restored after its calls."""
    import torch

    base = _ops(monkeypatch, cached=None)
    res = canary.compare("cpu")
    assert res["ok"] and res["problems"] == [] and res["warnings"] == [] and res["nondeterministic"] == []
    assert launch_cache.LAUNCH_CACHE_ENV not in os.environ
    flipped = base[0].clone()
    flipped[7] = torch.nextafter(flipped[7], torch.tensor(float("inf")))
    _ops(monkeypatch, cached=[flipped, base[1]])
    res = canary.compare("cpu")
    assert not res["ok"] and res["problems"] == ["output 0 differs from the JIT's"]
    nan = base[1].clone()
    nan[1, 2] = float("nan")
    _ops(monkeypatch, cached=[base[0], nan], jit_calls=[[base[0], nan], [base[0], nan]])
    assert "output 1 is empty or not finite" in canary.compare("cpu")["problems"]
    empty = [base[0], torch.empty(0, 4)]
    _ops(monkeypatch, cached=empty, jit_calls=[empty, empty])
    assert canary.compare("cpu")["problems"] == ["output 1 is empty or not finite"]


def test_an_op_the_jit_does_not_repeat_bitwise_is_compared_within_its_rounding(monkeypatch):
    """Where the JIT's two calls differ (a summation order that varies), the cached outputs need only agree within
    4 bf16 ulps of the largest element; further off fails.  A family without hits is a warning only."""
    base = _ops(monkeypatch, cached=None)  # for the default outputs
    wobble = base[0] + 2**-9  # within 2**-6 * max |x| = 5/64
    _ops(monkeypatch, cached=[wobble, base[1]], jit_calls=[base, [base[0] + 2**-8, base[1]]], hits=0)
    res = canary.compare("cpu")
    assert res["ok"] and res["nondeterministic"] == [0] and len(res["warnings"]) == 4
    _ops(monkeypatch, cached=[base[0] + 0.5, base[1]], jit_calls=[base, [base[0] + 2**-8, base[1]]])
    res = canary.compare("cpu")
    assert not res["ok"] and res["problems"] == ["output 0 differs from the JIT's"]


def test_a_failing_jit_path_or_hit_count_is_not_a_failure_of_the_cache(monkeypatch):
    """``compare`` itself: an exception on the JIT's path is inconclusive (the child exits 0, the lab keeps its
    settings); one while counting the hits is a warning; an exception on the cache's path fails the setting."""
    import torch

    def broken(device):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(canary, "bound_ops", broken)
    res = canary.compare("cpu")
    assert res["inconclusive"] and not res["ok"] and "RuntimeError: no GPU here" in res["why"]
    _ops(monkeypatch)
    monkeypatch.setattr(canary, "hit_counts", lambda key: 1 / 0)
    res = canary.compare("cpu")
    assert res["ok"] and res["warnings"] and "ZeroDivisionError" in res["warnings"][0]

    def cache_fails(device):
        def op():
            if os.environ.get(launch_cache.LAUNCH_CACHE_ENV) != "0":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return [torch.ones(4)]

        op.stage_key = None
        return op

    monkeypatch.setattr(canary, "bound_ops", cache_fails)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        canary.compare("cpu")  # the child exits non-zero: the setting failed
