#!/usr/bin/env bash
# The GPU lab's optional second call (at most 9 minutes), when device time is left after scripts/gpu_lab.sh.
#
#   DISTFUSE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_lab_extra.sh
#   DISTFUSE_LAB_DRY_RUN=1 bash scripts/gpu_lab_extra.sh          # here: bash syntax, each command's --help
#
# Phase (cap)        what                                                                  writes under $OUT
# audit (120 s)      the compile audit loaded on this GPU: registers and spills from the    audit.json
#                    driver, with the machine's Triton (3.6)
# sanitizer (150 s)  compute-sanitizer memcheck over the GEMM and halo kernels' CUDA tests   sanitizer.log
# sweep (240 s)      bench_gemm_fused.py, every side, M = 64 ... 16384 (LLaMA-3 8B/70B),     sweep_gemm_fused-<dev>-<date>.json
#                    and bench_halo_conv.py in bf16 and fp32                                 sweep_halo_conv-<dev>-<date>.json
# plus lab_extra.json (env and the phases) and lab_extra.log.  Same rules as gpu_lab.sh: each phase under
# `timeout` with the smaller of its cap and what is left of 540 s, JSON written as each phase (and each
# benchmark case) ends, at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${DISTFUSE_LAB_DRY_RUN:-0}
[ "$DRY" = 0 ] && DRY=""
PY=${PYTHON:-$([ -n "$DRY" ] && [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-/tmp/distfuse-lab-extra}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export DISTFUSE_TIMEOUT=30 DISTFUSE_AUTOTUNE=0 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET DISTFUSE_PATH DISTFUSE_PROVIDER
export DISTFUSE_COMMIT=${DISTFUSE_COMMIT:-$(cat .lab_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUDGET=${DISTFUSE_LAB_BUDGET:-540}
LOG=$OUT/lab_extra.log
T0=$SECONDS
SUMMARY=$OUT/lab_extra.json
echo "{\"commit\": \"$DISTFUSE_COMMIT\", \"date\": \"$(date -u +%FT%TZ)\", \"phases\": []}" >"$SUMMARY"

phase() {  # NAME CAP COMMAND...
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0) - 10))
  local limit=$((cap < left ? cap : left)) t=$SECONDS rc
  if [ "$limit" -lt 15 ]; then rc=-1; else
    echo "=== gpu_lab_extra: $name (limit ${limit}s)" | tee -a "$LOG"
    if [ -n "$DRY" ]; then "$@" --help >>"$LOG" 2>&1; else timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1; fi
    rc=$?
    tail -n 8 "$LOG"
  fi
  $PY - "$SUMMARY" "$name" "$cap" "$limit" "$rc" $((SECONDS - t)) <<'PY'
import json, sys
path, name, cap, limit, rc, secs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
data = json.load(open(path))
status = "skipped" if rc == -1 else ("ok" if rc == 0 else ("timed out" if rc in (124, 137) else f"failed ({rc})"))
data["phases"].append(dict(name=name, cap_s=cap, limit_s=limit, rc=rc, seconds=secs, status=status))
json.dump(data, open(path, "w"), indent=1)
print(f"=== gpu_lab_extra: {name}: {status} in {secs} s")
PY
}

phase audit 120 $PY -m distfuse.kernels.compile_audit --arch 90 --load --jobs 12 --json "$OUT/audit.json"
if command -v compute-sanitizer >/dev/null || [ -n "$DRY" ]; then
  SAN=(compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all)
  [ -n "$DRY" ] && SAN=()
  DISTFUSE_TEST_COMPILED=1 phase sanitizer 150 "${SAN[@]}" $PY -m pytest -q -p no:cacheprovider -m cuda \
    tests/test_first_contact.py tests/test_persistent_gemm.py tests/test_gemm_kernels.py \
    "tests/test_halo_kernels.py::test_kernels_cuda_realistic"
else
  echo "gpu_lab_extra: compute-sanitizer not found" | tee -a "$LOG"
fi
phase sweep_gemm 170 $PY bench/bench_gemm_fused.py --models llama3-8b llama3-70b --shapes llama --reps 10 \
  --out-dir "$OUT"
phase sweep_halo 70 $PY bench/bench_halo_conv.py --dims 2 3 --channels 16 64 256 --halos 1 2 --dtypes bfloat16 float32 \
  --max-gib 16 --out-dir "$OUT"
# The sweep's files must not overwrite the lab's of the same device and date once collected into bench/results.
for f in "$OUT"/gemm_fused-*.json "$OUT"/halo_conv-*.json; do
  [ -f "$f" ] && mv "$f" "$OUT/sweep_$(basename "$f")"
done
echo "=== gpu_lab_extra: done in $((SECONDS - T0)) s; files: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
