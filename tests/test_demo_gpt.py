"""``python -m distfuse.demo gpt`` run once as a user would (4 forked gloo ranks), as the other demos are in
``tests/test_teeth_entrypoints.py``: exit code 0, one distinct per-step check per step (the distributed loss next
to the torch.nn twin's), a falling loss, and the closing verdicts on every step's loss and on the final weights
(the demo itself checks both against its float64 twin within the derived float32 bound, and exits non-zero
otherwise)."""

import re

from distfuse import demo_gpt
from tests.test_teeth_entrypoints import _printed_losses_agree, _run


def test_gpt_demo_trains_in_step_with_torch_nn(tmp_path):
    steps = 3
    proc, out = _run(["-m", "distfuse.demo", "gpt", "--steps", str(steps)], tmp_path)
    assert proc.returncode == 0, out[-4000:]
    pairs = re.findall(r"loss=([0-9.eE+-]+), sequential=([0-9.eE+-]+)", out)
    assert len({a for a, _ in pairs}) == steps, pairs
    assert _printed_losses_agree(pairs, demo_gpt.TERMS), pairs
    assert float(pairs[-1][0]) < float(pairs[0][0]), f"the loss should fall over {steps} steps: {pairs}"
    assert "(context x tensor, zigzag layout)" in out, out[-4000:]
    assert "every step's loss matched the sequential torch.nn GPT" in out, out[-4000:]
    assert "weights agree with the float64 twin" in out, out[-4000:]


def test_gpt_demo_on_the_fused_paths(tmp_path):
    """``--path fused``: every projection (the attention's packed QKV all-gather + GEMM and its GEMM +
    reduce-scatter, the MLP's and the head's sequence-parallel linears) runs its fused op, Triton interpreted over
    /dev/shm, and each block's ring its symmetric-memory push; the run still matches the float64 twin step by step."""
    proc, out = _run(["-m", "distfuse.demo", "gpt", "--steps", "2", "--path", "fused"], tmp_path)
    assert proc.returncode == 0, out[-4000:]
    paths = re.findall(r"^  (\S+)\s+Distributed\w+\s+(fused|unfused) ", out, flags=re.M)
    assert len(paths) == 11 and all(p == "fused" for _, p in paths), paths  # 9 projections, 2 rings
    assert sum(name.endswith(".attention") for name, _ in paths) == 2, paths
    assert "every step's loss matched the sequential torch.nn GPT" in out, out[-4000:]
