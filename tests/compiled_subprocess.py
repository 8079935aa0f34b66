"""Run a test's compile step in a subprocess without the Triton interpreter (the suite runs interpreted).

Compiling for sm_90 on a CPU needs the JIT's own functions, which ``TRITON_INTERPRET=1`` replaces
at import; a subprocess without it compiles with the ptxas that Triton ships, and no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(code: str, timeout: int = 300) -> str:
    """Run ``python -c code`` from the repository root without the interpreter; return its stdout.

    Skips the calling test where Triton's CUDA toolchain is missing; fails it, with the end of stderr, on any other
    error."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's CUDA toolchain (ptxas) is not installed")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stdout
