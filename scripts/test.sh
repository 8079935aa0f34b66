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
# The GPU machines' Triton (3.6) beside the venv's, for the compile audit under both (tests/test_compile_audit.py):
# installed once into a cache folder, never into the venv.  Where it cannot be installed (no index), the audit's
# Triton 3.6 tests skip and say why; DISTFUSE_TRITON36=0 skips the install, and so does a venv whose Triton is 3.6
# already (a GPU machine's: the audit under the venv's Triton is that one).
if [ -z "${DISTFUSE_TRITON36_DIR:-}" ] && [ "${DISTFUSE_TRITON36:-1}" != 0 ] \
   && ! "$VENV/bin/python" -c "import sys, triton; sys.exit(triton.__version__ != '3.6.0')" 2>/dev/null; then
  if DIR=$(timeout 600 bash scripts/audit_triton36.sh --install-only | tail -1); then
    export DISTFUSE_TRITON36_DIR=$DIR
  else
    echo "test.sh: triton==3.6.0 could not be installed: the compile audit runs under the venv's Triton only" >&2
  fi
fi
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q "$@"
if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "test.sh: a CUDA GPU is present: compiled pass (pytest -m cuda)"
  env -u TRITON_INTERPRET DISTFUSE_TEST_COMPILED=1 "$VENV/bin/python" -m pytest -q -m "cuda or multigpu" "$@"
fi
