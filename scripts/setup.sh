#!/usr/bin/env bash
# Set up .venv with distfuse and its test extras.
#
# CPU-only machines get the CPU build of torch: it is pinned as torch==2.13.0+cpu, a
# local version that only CPU builds carry, so pip can never fall back to the CUDA
# build and its ~2.5 GB of nvidia wheels.  pip finds it through its configured
# find-links / indexes; elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel
# index first.  On a GPU machine a preinstalled torch (and triton) is reused through
# --system-site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${DISTFUSE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.5"
  else
    "${PIP[@]}" "torch==2.13.0+cpu" 2> >(grep -v "is ignored: it is neither" >&2) || {
      echo "setup: could not install the CPU build of torch (torch==2.13.0+cpu)." >&2
      echo "setup: set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index and run again." >&2
      exit 1
    }
  fi
fi
# torch is present now, so the ranges in pyproject.toml keep it as it is.
# (pip warns once per missing local mirror folder; those lines are filtered, its exit status is kept)
"${PIP[@]}" -e ".[test,bench]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$VENV/bin/python" -c "import distfuse, torch, triton; print(f'distfuse {distfuse.__version__}, torch {torch.__version__}, triton {triton.__version__}')"
