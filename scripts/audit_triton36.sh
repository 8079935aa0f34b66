#!/usr/bin/env bash
# The compile audit with the GPU machines' Triton (3.6.0) on a CPU machine, beside CI's (3.9).
#
#   bash scripts/audit_triton36.sh                         # every kernel, sm_90, spills reported
#   bash scripts/audit_triton36.sh --kernel matmul_scatter # arguments go to distfuse.kernels.compile_audit
#   bash scripts/audit_triton36.sh --install-only          # install only; prints the folder (scripts/test.sh)
#
# triton==3.6.0 is a 188 MB wheel (641 MB installed; about 10 s from a local mirror).  It is
# installed once with `pip install --target` into $DISTFUSE_TRITON36_DIR (default
# ~/.cache/distfuse/triton-3.6.0), not into the venv: the audit runs with that folder first on
# PYTHONPATH, so `import triton` is 3.6 while torch and distfuse come from the venv.  The full
# audit takes about 3 minutes on 2 cores.  scripts/test.sh (CI) installs it the same way and sets
# DISTFUSE_TRITON36_DIR, under which tests/test_compile_audit.py runs this whole audit in the
# background beside CI's own (Triton 3.9) and checks that no case fails or spills under either.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DISTFUSE_VENV:-.venv}
PY=$VENV/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
DIR=${DISTFUSE_TRITON36_DIR:-$HOME/.cache/distfuse/triton-3.6.0}
if ! PYTHONPATH="$DIR" "$PY" -c "import triton, sys; sys.exit(triton.__version__ != '3.6.0')" 2>/dev/null; then
  echo "audit_triton36: installing triton==3.6.0 into $DIR"
  mkdir -p "$DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --upgrade --retries 2 --timeout 30 \
    --target "$DIR" "triton==3.6.0" \
    2> >(grep -v "is ignored: it is neither" >&2)
fi
if [ "${1:-}" = "--install-only" ]; then
  echo "$DIR"
  exit 0
fi
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--arch 90 --jobs "$(nproc 2>/dev/null || echo 2)")
env -u TRITON_INTERPRET PYTHONPATH="$DIR:$PWD" TRITON_DEFAULT_FP_FUSION=1 "$PY" -m distfuse.kernels.compile_audit "${ARGS[@]}"
