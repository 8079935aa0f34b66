#!/usr/bin/env bash
# Everything a session with one lent GPU should run, in phases (each well inside 9 minutes).
#
#   bash scripts/gpu_session.sh [PHASE ...]     # default: probe audit tests sanitizer twoproc bench
#
#   probe      versions, symm_mem API names, implicit pool, CUDA backend detection   (~20 s)
#   audit      compile audit of every kernel/config/dtype, registers and spills read
#              on this GPU                                                            (~1 min)
#   tests      the compiled pass: pytest -m cuda (pinned configs, no autotune)        (~2-3 min)
#   sanitizer  compute-sanitizer memcheck on the CUDA kernel tests                    (~2 min)
#   twoproc    two processes on one GPU through real torch symmetric memory:
#              fused forward and backward against float64, both rank orders,
#              40 iterations, a workspace growth                                      (~1 min)
#   bench      GEMM fusion and halo staging benchmarks with ratios to cuBLAS, the
#              device copy and F.pad/cat staging; the GEMM sides include the feature
#              forms, GEMM + all-reduce, ZeRO and the three producers   (up to ~9.5 min:
#              run it as its own call)
#
# Results: bench/results/gpu_session-<device>-<date>.json (each call appends a run of one record per phase, with
# the device, versions and date) plus each benchmark's own JSON; logs in $SESSION_DIR.
# Where $OUT is set (the device tool), the JSON files and a log archive are copied there.
# Uses only what the GPU machine has: torch, triton, pytest, nvidia-ml-py, the repo.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(probe audit tests sanitizer twoproc bench)
DATE=$(date -u +%Y-%m-%d)
DEV=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo none)
if [ "$DEV" = none ]; then echo "gpu_session: no CUDA device" >&2; exit 2; fi
SESSION_DIR=${SESSION_DIR:-/tmp/distfuse-gpu-session}
RESULTS=bench/results
mkdir -p "$SESSION_DIR" "$RESULTS"
SUMMARY="$SESSION_DIR/phases.jsonl"

record() {  # phase, status, seconds, detail file (json or text)
  $PY - "$@" >> "$SUMMARY" <<'PY'
import json, sys, pathlib
phase, status, secs, detail = sys.argv[1], sys.argv[2], float(sys.argv[3]), pathlib.Path(sys.argv[4])
body = None
if detail.exists():
    text = detail.read_text(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = text[-6000:]
print(json.dumps(dict(phase=phase, status=status, seconds=round(secs, 1), detail=body)))
PY
}

run_phase() {  # name, timeout seconds, detail file, command...
  local name=$1 limit=$2 detail=$3; shift 3
  echo "=== gpu_session: $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$SESSION_DIR/$name.log" 2>&1
  local rc=$?
  local status=ok
  [ $rc -ne 0 ] && status="failed (exit $rc)"
  [ $rc -eq 124 ] && status="timed out after ${limit}s"
  tail -n 15 "$SESSION_DIR/$name.log"
  [ -s "$detail" ] || cp "$SESSION_DIR/$name.log" "$detail"
  record "$name" "$status" $((SECONDS - t0)) "$detail"
  echo "=== gpu_session: $name: $status ($((SECONDS - t0)) s)"
  # Keep what is done so far where the device tool collects it, in case a later phase is cut off.
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_session_logs.tgz" -C "$SESSION_DIR" . 2>/dev/null
  return 0
}

for phase in "${PHASES[@]}"; do
  case $phase in
    probe)
      run_phase probe 60 "$SESSION_DIR/probe.json" $PY scripts/gpu_probe.py --json "$SESSION_DIR/probe.json" ;;
    audit)
      run_phase audit 180 "$SESSION_DIR/audit.json" \
        $PY -m distfuse.kernels.compile_audit --arch 90 --load --jobs 12 --json "$SESSION_DIR/audit.json" ;;
    tests)
      DISTFUSE_AUTOTUNE=0 DISTFUSE_TEST_COMPILED=1 run_phase tests 300 "$SESSION_DIR/tests.txt" \
        $PY -m pytest -q -p no:cacheprovider -m "cuda or multigpu" -rfEs --timeout 200 ;;
    sanitizer)
      if command -v compute-sanitizer >/dev/null; then
        DISTFUSE_AUTOTUNE=0 DISTFUSE_TEST_COMPILED=1 run_phase sanitizer 200 "$SESSION_DIR/sanitizer.txt" \
          compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all \
          $PY -m pytest -q -p no:cacheprovider -x -m cuda --timeout 280 \
          tests/test_gemm_kernels.py tests/test_conv_implicit.py "tests/test_halo_kernels.py::test_kernels_cuda_realistic"
      else
        echo "compute-sanitizer not found" > "$SESSION_DIR/sanitizer.txt"
        record sanitizer "skipped: no compute-sanitizer" 0 "$SESSION_DIR/sanitizer.txt"
      fi ;;
    twoproc)
      run_phase twoproc 180 "$SESSION_DIR/twoproc.json" $PY scripts/gpu_two_process.py --json "$SESSION_DIR/twoproc.json" ;;
    bench)
      run_phase bench_gemm 420 "$SESSION_DIR/bench_gemm.txt" \
        $PY bench/bench_gemm_fused.py --models llama3-8b llama3-70b --m 8192 512 --reps 10 --out-dir "$RESULTS"
      run_phase bench_halo 150 "$SESSION_DIR/bench_halo.txt" \
        $PY bench/bench_halo_conv.py --channels 64 256 --dtypes bfloat16 float32 \
        --out "$RESULTS/halo_conv-$DEV-$DATE.json" ;;
    *) echo "gpu_session: unknown phase $phase" >&2; exit 2 ;;
  esac
done

OUTFILE="$RESULTS/gpu_session-$DEV-$DATE.json"
$PY - "$SUMMARY" "$OUTFILE" <<'PY'
import json, sys, pathlib
sys.path.insert(0, ".")
from bench.harness import environment
phases = [json.loads(l) for l in pathlib.Path(sys.argv[1]).read_text().splitlines() if l.strip()]
out = pathlib.Path(sys.argv[2])
old = json.loads(out.read_text()) if out.exists() else {}
env = environment()
# One file per device and day: each call of this script appends a run (earlier runs are kept).
runs = old.get("runs", [])
runs.append(dict(run=f"{len(runs) + 1}: {' '.join(p['phase'] for p in phases)}", date=env["date"], phases=phases))
out.write_text(json.dumps(dict(old, env=env, runs=runs), indent=1, default=str))
print(f"gpu_session: wrote {out}")
for p in phases:
    print(f"  {p['phase']:<12} {p['status']:<28} {p['seconds']:>7.1f} s")
PY
rm -f "$SUMMARY"
if [ -n "${OUT:-}" ]; then
  cp "$OUTFILE" "$OUT/" 2>/dev/null
  for f in "$RESULTS"/gemm_fused-*"$DATE"*.json "$RESULTS"/halo_conv-*"$DATE"*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tar czf "$OUT/gpu_session_logs.tgz" -C "$SESSION_DIR" . 2>/dev/null
fi
