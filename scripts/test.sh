#!/usr/bin/env bash
# Set up (if needed), lint, then run the tests. Extra arguments go to pytest.
#
# Pass 1 (every machine): the whole suite with Triton interpreted on CPU tensors.
# Pass 2 (machines with a CUDA GPU): the tests marked `cuda`, with the kernels compiled
# for the GPU.  One process cannot hold both kinds of kernel (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${DISTFUSE_VENV:-.venv}
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q "$@"
if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "test.sh: a CUDA GPU is present: compiled pass (pytest -m cuda)"
  env -u TRITON_INTERPRET DISTFUSE_TEST_COMPILED=1 "$VENV/bin/python" -m pytest -q -m "cuda or multigpu" "$@"
fi
