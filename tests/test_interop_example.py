"""The DCP resume example at smoke size: trains with ``--spawn``, resumes on another partition in a rank pool.

The example checks itself against a ``torch.nn`` twin on rank 0 at every step (and fails
otherwise).  On top of that the resumed run must reproduce, step for step, the losses
of a run that never stopped: the checkpoint carried the weights, the momentum buffers
and the step across a change of world size and rank order.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import torch

from distfuse.testing import run_ranks
from tests.tolerances import tol

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_dcp_resume.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_dcp_resume", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(**kwargs):
    return _example().run(quiet=True, **kwargs)


def _printed_losses(stdout: str) -> dict[int, float]:
    """``step -> torch.nn twin loss`` from the example's step lines."""
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["step"] and "twin" in words:
            out[int(words[1])] = float(words[-1])
    return out


#: Both runs train to this step.
STEPS = 4
#: The step lines print the losses to 15 significant digits: a relative rounding of at most half a unit in the 15th.
PRINTED = 0.5 * 10.0 ** (1 - 15)


def _loss_rtol(example, steps: int) -> float:
    """The relative distance allowed between two float64 runs' losses at a step of a run of ``steps`` steps.

    The longest sums of a step are the global gradient norm the clipping divides by (every parameter's gradient:
    the LayerNorm's ``2 IN``, fc1's ``IN HID + HID``, fc2's ``HID IN + IN``) and the loss itself (``BATCH SEQ IN``
    squared errors).  The loss is a sum of positive terms, so its bound is relative to the loss, and a loss is
    rounded after at most ``steps - 1`` updates and its own forward: ``steps`` steps.  Both runs (the resumed one,
    on another partition, and the uninterrupted twin) are rounded, and the uninterrupted loss is read back from
    its printed digits."""
    IN, HID = example.IN, example.HID
    params = 2 * IN + (IN * HID + HID) + (HID * IN + IN)
    terms = max(params, example.BATCH * example.SEQ * IN)
    return 2 * tol(torch.float64, terms=terms, steps=steps)["rtol"] + PRINTED


def test_spawned_training_then_resume_on_another_world_size_matches_an_uninterrupted_run(tmp_path):
    ckpt = os.fspath(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(EXAMPLE), "--spawn", "2", "--ckpt", ckpt, "--steps", str(STEPS),
                           "--save-every", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every loss matches the torch.nn twin" in done.stdout, done.stdout
    straight = _printed_losses(done.stdout)
    assert sorted(straight) == list(range(STEPS)), done.stdout
    # Resume from step 2 on 4 ranks laid out backwards: steps 2 and 3 again, as the run that never stopped.
    os.rename(os.path.join(ckpt, f"step_{STEPS}"), os.path.join(tmp_path, "later"))
    resumed = run_ranks(4, _run, ckpt=ckpt, steps=STEPS, save_every=0, resume=True, reverse_ranks=True)[0]
    assert [s for s, _, _ in resumed] == [2, 3]
    rtol = _loss_rtol(_example(), steps=STEPS)
    for step, loss, twin in resumed:
        want = straight[step]
        assert abs(loss - want) <= rtol * abs(want), (step, loss, want, rtol)
        assert abs(twin - want) <= rtol * abs(want), (step, twin, want, rtol)
