#!/usr/bin/env bash
# Set up (if needed), lint, then run the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${DISTFUSE_VENV:-.venv}
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q "$@"
