"""The command-line entry points nothing else executes, each run once as a user would.

* ``python -m distfuse.demo`` (4 forked gloo ranks) on the default path and with
  ``--path fused`` (the Triton kernels interpreted over ``/dev/shm`` workspaces): exit code
  0, one line of per-step check per step (the distributed loss next to the sequential
  model's), the closing verdict, and which path every layer took.
* ``python -m distfuse.demo unet``: the 3-D U-Net (conv, batch norm, pooling, transposed conv,
  a skip connection, cross-entropy) checked per step and, at the end, on its whole state.
* ``bench/bench_gemm_fused.py --smoke`` and ``bench/bench_halo_conv.py --smoke``: their CPU
  correctness passes (``python -m bench run conv_layers --smoke`` is run by
  ``tests/test_bench_tools.py``; these two GPU benches are not).

Subprocesses get ``TRITON_INTERPRET=1``, this checkout first on ``PYTHONPATH``, no path
override, and a crossover table that does not exist (so the dispatch is the defaults').
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distfuse import demo, demo_unet
from distfuse.testing.tolerance import rounding_bound

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("conv1", "conv2", "fc1", "fc2")


def _printed_losses_agree(pairs, terms: int) -> bool:
    """Each step's printed losses (5 decimals) within two float32 runs' rounding bound of each other.

    The demo itself checks each loss and the final state against its float64 twin at full precision;
    this reads back what it printed.
    """
    steps = list(dict.fromkeys(pairs))  # tqdm prints a step's postfix at every refresh
    return all(abs(float(a) - float(b)) <= 2 * rounding_bound(torch.float32, terms, step + 1) * abs(float(b)) + 1e-5
               for step, (a, b) in enumerate(steps))


def _run(args, tmp_path, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("DISTFUSE_PATH", "DISTFUSE_HALO_CONV")}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["DISTFUSE_TUNE_TABLE"] = str(tmp_path / "no-crossover-table.json")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", ["auto", "fused"])
def test_demo_runs_and_checks_every_step(path, tmp_path):
    steps = 2
    args = ["-m", "distfuse.demo", "--steps", str(steps)] + (["--path", path] if path != "auto" else [])
    proc, out = _run(args, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    # tqdm's postfix carries each step's check: the distributed loss next to the sequential model's
    pairs = re.findall(r"loss=([0-9.eE+-]+), sequential=([0-9.eE+-]+)", out)
    assert pairs, out[-4000:]
    assert _printed_losses_agree(pairs, demo.TERMS), pairs
    assert len({a for a, _ in pairs}) == steps, f"expected {steps} distinct per-step losses, got {set(pairs)}"
    assert f"{steps}/{steps}" in out
    assert "every step's loss matched the sequential torch.nn model" in out, out[-4000:]
    want = "fused" if path == "fused" else "unfused"
    for name in LAYERS:
        line = re.search(rf"^\s*{name}\s+\S+\s+(\S+)", out, flags=re.M)
        assert line and line.group(1) == want, (name, line and line.group(0), out[-3000:])


def test_unet_demo_trains_in_step_with_torch_nn(tmp_path):
    steps = 3
    proc, out = _run(["-m", "distfuse.demo", "unet", "--steps", str(steps)], tmp_path)
    assert proc.returncode == 0, out[-4000:]
    pairs = re.findall(r"loss=([0-9.eE+-]+), sequential=([0-9.eE+-]+)", out)
    assert len({a for a, _ in pairs}) == steps, pairs
    assert _printed_losses_agree(pairs, demo_unet.TERMS), pairs
    assert float(pairs[-1][0]) < float(pairs[0][0]), f"the loss should fall over {steps} steps: {pairs}"
    assert "every step's loss matched the sequential torch.nn U-Net" in out, out[-4000:]
    assert "weights and running statistics agree" in out, out[-4000:]


@pytest.mark.parametrize("script,verdict", [
    ("bench/bench_gemm_fused.py", "smoke: ok: cublas/torch.mm, fused matmul_scatter + chunk_reduce"),
    ("bench/bench_halo_conv.py", "smoke: ok (correctness only"),
])
def test_gpu_bench_smoke_passes_on_cpu(script, verdict, tmp_path):
    proc, out = _run([script, "--smoke"], tmp_path)
    assert proc.returncode == 0, out[-4000:]
    assert verdict in proc.stdout, out[-4000:]
    assert "FAILED" not in out and "differ" not in proc.stderr, out[-4000:]
