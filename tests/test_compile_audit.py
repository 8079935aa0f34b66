"""The compile audit in CI: every kernel, every config, three dtypes, compiled for sm_90 without a GPU.

The interpreter accepts code the compiler rejects and says nothing about shared memory or
the PTX of the flag protocol; ``distfuse.kernels.compile_audit`` checks both.  It runs in
a subprocess without ``TRITON_INTERPRET`` (the decorators choose at import).  Negative
controls show that each check can fail: an fp32 tile that overflows shared memory, and
remote stores that cannot be vectorised when the row stride is not known to be aligned.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run alone with a cold Triton cache, the two audits take 5-7 minutes on 2 cores, which the first test waits for in
# its fixture: longer than the suite's per-test limit (in the whole suite they end long before their tests run).
pytestmark = pytest.mark.timeout(1200)

_SCRIPT = r"""
import json, sys, dataclasses
import torch
from distfuse.kernels import compile_audit as ca, matmul_reduce_scatter as reduce_scatter_kernels

import os
jobs = min(4, os.cpu_count() or 1)
out = {"all": [dataclasses.asdict(r) for r in ca.run_audit((90,), jobs=jobs)]}
# sm_80 (A100) for the 16-bit GEMM configs: the largest tiles must fit its 163 KB too.
out["sm80"] = [dataclasses.asdict(r) for r in ca.run_audit((80,), (torch.bfloat16,), only="matmul_scatter")]
tables = {"data_ptrs": "i64", "flag_ptrs": "i64", "counter_ptr": "i32", "epoch_ptr": "i32"}
big = ca.KernelCase("matmul_scatter", reduce_scatter_kernels._matmul_scatter_kernel, torch.float32,
                    dict(UPCAST=False, INPUT_PRECISION="tf32", ROUND_BF16=False, BLOCK_M=128, BLOCK_N=256,
                         BLOCK_K=64, GROUP_M=8), 8, 3, pointer_dtypes=tables, aligned=("N", "K", "ld"),
                    checks=("vector_store",))
unaligned = ca.KernelCase("matmul_scatter", reduce_scatter_kernels._matmul_scatter_kernel, torch.bfloat16,
                          dict(UPCAST=False, INPUT_PRECISION="tf32", ROUND_BF16=False, BLOCK_M=64, BLOCK_N=64,
                               BLOCK_K=32, GROUP_M=8), 4, 3, pointer_dtypes=tables, aligned=(),
                          checks=("vector_store",))
# the implicit conv's former GPU tile with IEEE fp32 products: 272-536 bytes of spills a thread
from distfuse.kernels import conv_implicit
from distfuse.kernels.compile_audit_cases import _LUTS
spilling = ca.KernelCase("conv_implicit", conv_implicit._conv_implicit_kernel, torch.float32,
                         dict(conv_implicit._constexprs(torch.float32, True, (64, 32, 32), interpret=False),
                              INPUT_PRECISION="ieee"), 4, 2, pointer_dtypes={**_LUTS, "ptab_ptr": "i64"})
out["controls"] = [dataclasses.asdict(ca.compile_case(c)) for c in (big, unaligned, spilling)]
json.dump(out, sys.stdout)
"""


# The GPU machines' Triton (3.6), where scripts/test.sh installed it: the whole sm_90 audit under it.
_GPU_SCRIPT = r"""
import json, sys, os, dataclasses, triton
from distfuse.kernels import compile_audit as ca
recs = [dataclasses.asdict(r) for r in ca.run_audit((90,), jobs=min(4, os.cpu_count() or 1))]
json.dump(dict(version=triton.__version__, all=recs), sys.stdout)
"""
GPU_TRITON = "DISTFUSE_TRITON36_DIR"  #: a triton==3.6.0 install (scripts/audit_triton36.sh --install-only)


_BACKGROUND: dict = {}  # the audits started by start_background_audit: name -> {"proc", "out", "err"}


def _start(name: str, script: str, pythonpath: str | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, ROOT])
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=out, stderr=err, text=True,
                            preexec_fn=lambda: os.nice(19))
    _BACKGROUND[name] = dict(proc=proc, out=out, err=err)


def start_background_audit() -> None:
    """Start the audits' subprocesses now, at the lowest CPU priority (``tests/conftest.py`` calls this at collection
    and runs this module's tests last): CI's Triton and, where ``DISTFUSE_TRITON36_DIR`` names an install, the GPU
    machines', about two minutes of compiler time each that needs no test process, taken from the time the rest of
    the suite leaves a CPU idle.  Their output goes to temporary files (no pipe to fill)."""
    if _BACKGROUND or importlib.util.find_spec("triton.backends.nvidia.compiler") is None:
        return
    _start("ci", _SCRIPT)
    if os.environ.get(GPU_TRITON):
        _start("gpu", _GPU_SCRIPT, os.environ[GPU_TRITON])


def stop_background_audit() -> None:
    """End a background audit no test waited for (a run cut short, or its tests deselected)."""
    for name in list(_BACKGROUND):
        _stop(name)


def _stop(name: str) -> None:
    entry = _BACKGROUND.pop(name, None) or {}
    proc = entry.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)
    for key in ("out", "err"):
        if entry.get(key) is not None:
            entry[key].close()


def _collect(name: str) -> dict:
    """The output of the background audit ``name`` (started now if it was not), once it has ended."""
    start_background_audit()  # already running when the whole suite was collected
    entry = _BACKGROUND[name]
    proc, out, err = entry["proc"], entry["out"], entry["err"]
    try:
        proc.wait(timeout=1100)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    finally:
        _stop(name)
    if proc.returncode != 0 and "ptxas" in stderr and "not found" in stderr.lower():
        pytest.skip("triton's CUDA toolchain (ptxas) is not installed")
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(stdout)


@pytest.fixture(scope="module")
def audit():
    pytest.importorskip("triton.backends.nvidia.compiler")
    return _collect("ci")


@pytest.fixture(scope="module")
def gpu_audit():
    if not os.environ.get(GPU_TRITON):
        pytest.skip(f"set {GPU_TRITON} to a triton==3.6.0 install (scripts/test.sh installs one: "
                    "scripts/audit_triton36.sh --install-only)")
    pytest.importorskip("triton.backends.nvidia.compiler")
    return _collect("gpu")


def test_every_kernel_and_config_compiles_for_sm90_and_fits(audit):
    recs = audit["all"]
    bad = [(r["case"], r["problems"]) for r in recs if not r["ok"]]
    assert not bad, bad
    families = {r["kernel"] for r in recs}
    assert families >= {"matmul_scatter", "gathered_matmul", "chunk_reduce", "ag_push", "halo_lut_gather",
                        "halo_box_gather", "halo_accumulate", "conv_implicit"}, families
    # no arithmetic on values: one 16-bit dtype (compile_audit_cases)
    moving = {"halo_stage", "halo_lut_gather", "halo_stage_words"}
    for fam in families:  # every family in all three dtypes, the pure data movers in fp32 and bf16
        want = {"fp32", "bf16"} if fam in moving else {"fp32", "fp16", "bf16"}
        assert {r["dtype"] for r in recs if r["kernel"] == fam} == want, fam
    assert all(0 < r["shared"] <= r["shared_limit"] for r in recs if r["shared"])


def test_16bit_gemm_configs_fit_sm80(audit):
    recs = audit["sm80"]
    assert recs and not [(r["case"], r["problems"]) for r in recs if not r["ok"]]


def test_the_audit_can_fail(audit):
    big, unaligned, spilling = audit["controls"]
    assert not big["ok"] and any("exceeds sm_90" in p for p in big["problems"]), big
    assert not unaligned["ok"] and any("not vectorised" in p for p in unaligned["problems"]), unaligned
    assert spilling["spills"] > 0, "the spill count reads ptxas's, so the no-spill tests can fail"



def test_the_pipelined_check_tells_multi_buffered_tiles_from_single_ones(audit):
    """Every audited persistent GEMM + scatter config is pipelined; the check reads the TTGIR's shared allocations
    (a leading stage dimension of 2 or more), so a one-buffer loop (what a barrier in the flattened loop gave) fails."""
    recs = [r for r in audit["all"] if r["kernel"] == "matmul_scatter_persistent"]
    assert recs and all(r["ok"] for r in recs)
    many = "%a = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>"
    one = "%a = ttg.local_alloc : () -> !ttg.memdesc<128x64xbf16, #shared, #smem, mutable>"
    barrier = "%t = ttg.local_alloc : () -> !ttg.memdesc<3x1xi64, #shared1, #smem, mutable>"
    from distfuse.kernels.compile_audit import _PIPELINED

    assert _PIPELINED.search(many) and not _PIPELINED.search(one) and not _PIPELINED.search(barrier)


def test_chunk_reduce_programs_fit_on_an_sm(audit):
    """The reduction's persistent grid is PER_SM programs per SM: all of them must be resident at once (a second
    wave would repeat the flag wait), so registers x threads x PER_SM fit sm_90's 64K registers, for every audited
    world size, dtype and layout (registers allocated in units of 8 per thread), and nothing spills."""
    import re

    import torch

    from distfuse.kernels._utils import pinned_reduce_config

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    recs = [r for r in audit["all"] if r["kernel"] == "chunk_reduce" and r["registers"] is not None]
    if not recs:
        pytest.skip("cuobjdump unavailable: no register counts")
    for r in recs:
        w = int(re.search(r"\bW_UNROLL=(\d+)", r["case"]).group(1))
        pinned = pinned_reduce_config(1 << 22, dtypes[r["dtype"]], w)
        assert int(re.search(r"\bBLOCK=(\d+)", r["case"]).group(1)) == pinned["BLOCK"], r["case"]
        regs = -(-r["registers"] // 8) * 8
        assert pinned["PER_SM"] * pinned["num_warps"] * 32 * regs <= 65536, (r["case"], r["registers"])
        assert not r["spills"], (r["case"], r["spills"])


def test_gathered_persistent_loads_through_tma_without_spills(audit):
    """The all-gather GEMM consumer's persistent form: TMA loads (checked per case), and no config the selector
    can run (16-bit, fp32 with TF32) spills registers under CI's Triton."""
    recs = [r for r in audit["all"] if r["kernel"] == "gathered_matmul_persistent"]
    assert recs and {r["dtype"] for r in recs} == {"fp32", "fp16", "bf16"}
    assert [(r["case"], r["spills"]) for r in recs if r["spills"]] == []


def test_no_case_spills_under_ci_triton(audit):
    """Every config a launcher or autotuner can pick, in every dtype and product precision, fits its registers
    under CI's Triton (fp32 IEEE products have lists of their own: kernels/_utils._GEMM_SHAPES)."""
    spilling = [(r["case"], r["spills"]) for r in audit["all"] if r["spills"]]
    assert not spilling, spilling


def test_every_case_compiles_without_spills_under_the_gpu_triton(audit, gpu_audit):
    """The GPU machines run Triton 3.6 (CI: the venv's), whose register allocation differs: the same cases compile
    there, none fails, and none spills."""
    assert gpu_audit["version"].startswith("3.6"), gpu_audit["version"]
    recs = gpu_audit["all"]
    assert sorted(r["case"] for r in recs) == sorted(r["case"] for r in audit["all"]), "the same cases"
    bad = [(r["case"], r["problems"]) for r in recs if not r["ok"]]
    assert not bad, bad
    spilling = [(r["case"], r["spills"]) for r in recs if r["spills"]]
    assert not spilling, spilling
