#!/usr/bin/env bash
# The GPU lab: one device call of at most 9 minutes on a lent H100/H200, phases in order of value.
#
#   DISTFUSE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_lab.sh     # on the device machine
#   DISTFUSE_LAB_DRY_RUN=1 bash scripts/gpu_lab.sh                           # here, without a GPU
#
# Phase (cap)            what it measures / checks                                     writes under $OUT
# 1 probe (30 s)         versions, symm_mem API names, get_buffer aliasing, backend    probe.json
# 2 canary (90 s)        the launch cache's hits against the JIT, bitwise, in child    probe.json (launch_canary)
#                        processes: the fast hits, else DISTFUSE_FAST_LAUNCH=0, else
#                        DISTFUSE_LAUNCH_CACHE=0, exported for every later phase
#                        (scripts/launch_canary.py: a faulting launch would poison them)
# 3 tests (140 s)        DISTFUSE_TEST_COMPILED=1 pytest -m cuda on the kernel tests,  tests.json
#                        a launch off the main thread included
# 4 gemm (60 s)          GEMM + scatter (every producer) and all-gather + GEMM vs      gemm_fused-<dev>-<date>.json
#                        cuBLAS, chunk_reduce and the pushes vs the device copy:
#                        LLaMA-3 8B/70B MLP at TP 8, M = 8192 and 512, bf16
# 5 halo (110 s)         halo staging vs the device copy (eager, and replayed from a   halo_conv-<dev>-<date>.json
#                        CUDA graph), fused halo conv vs torch.cat staging + cuDNN
# 6 two_process (55 s)   two processes on one GPU through real symmetric memory,       two_process.json
#                        one short run per provider and of the ring attention's
#                        fused push, against float64
# 7 attention (45 s)     one rank's ring block vs SDPA, the ring's message vs the     attention-<dev>-<date>.json
#                        device copy (bench/bench_attention.py --single)
# and lab.json (env: device, versions, commit, date; every phase's status, time, limit; the ratios) and lab.log.
#
# Each phase runs under `timeout` with min(its cap, what is left of the 540 s budget); a phase
# with under 15 s left is skipped.  Each phase's JSON is written under $OUT as soon as it ends,
# and the benchmarks rewrite theirs after every case, so a phase cut off loses only its last
# case.  At most 8 files go under $OUT (the device tool brings back no more).
#
# Pinned configs: DISTFUSE_AUTOTUNE=0 (the real groups' configs; no autotuning time).  Bounded
# waits: DISTFUSE_TIMEOUT=30 (a hang costs 30 s, not 30 minutes).  Uses what the machine has
# (torch 2.11, Triton 3.6, pytest, nvidia-ml-py): no installs, the repo on PYTHONPATH.
# The device copy of the tree has no .git: pass the commit in DISTFUSE_COMMIT (or a .lab_commit file).
#
# Dry run (DISTFUSE_LAB_DRY_RUN=1, no GPU): the same phases, caps and files, each command in a
# CPU-safe form (the probe's --dry-run, the cuda tests collected and skipped, the benchmarks'
# --dry-run pipelines at tiny interpreted shapes, the two-process summary of no cases), then
# scripts/lab_record.py check: phase order, caps, files, row schema, anchors, and the gpu_ratios
# tool reading the files (DISTFUSE_LAB_RATIOS_TOOL, default /work/shared/tools/gpu_ratios.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${DISTFUSE_LAB_DRY_RUN:-0}
[ "$DRY" = 0 ] && DRY=""
if [ -n "$DRY" ]; then
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  OUT=${OUT:-/tmp/distfuse-lab-dry}
  rm -rf "$OUT"
else
  PY=${PYTHON:-python3}
  OUT=${OUT:-/tmp/distfuse-lab}
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export DISTFUSE_TIMEOUT=30 DISTFUSE_AUTOTUNE=0 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET DISTFUSE_PATH DISTFUSE_PROVIDER
export DISTFUSE_COMMIT=${DISTFUSE_COMMIT:-$(cat .lab_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUDGET=${DISTFUSE_LAB_BUDGET:-540}
RESERVE=10    # seconds kept for the bookkeeping after the last phase
MIN_PHASE=15  # a phase with less left is skipped
LOG=$OUT/lab.log
DATE=$(date -u +%Y-%m-%d)
T0=$SECONDS

echo "=== gpu_lab ${DRY:+(dry run) }$(date -u +%FT%TZ) commit $DISTFUSE_COMMIT budget ${BUDGET}s out $OUT" | tee -a "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version \
  --format=csv,noheader >>"$LOG" 2>&1
$PY scripts/lab_record.py init --out "$OUT" --budget "$BUDGET" 2>&1 | tee -a "$LOG"

# phase NAME CAP FILE COMMAND...: run under timeout, append to lab.log, record in lab.json, show the tail
phase() {
  local name=$1 cap=$2 file=$3; shift 3
  local left=$((BUDGET - (SECONDS - T0) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt "$MIN_PHASE" ]; then
    echo "=== gpu_lab: $name skipped: ${left}s left" | tee -a "$LOG"
    $PY scripts/lab_record.py phase --out "$OUT" --name "$name" --cap "$cap" --limit "$limit" --rc -1 --seconds 0
    return
  fi
  echo "=== gpu_lab: $name (limit ${limit}s) $(date -u +%T)" >>"$LOG"
  echo "=== gpu_lab: $name (limit ${limit}s)"
  local start=$(($(stat -c %s "$LOG") + 1)) t=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  tail -c +"$start" "$LOG" | tail -n 12
  if [ "$name" = tests ]; then  # the plugin's lines -> tests.json, cut off or not
    $PY scripts/lab_record.py tests "$WORK/tests.jsonl" "$OUT/tests.json" --rc "$rc" 2>&1 | tee -a "$LOG"
  fi
  $PY scripts/lab_record.py phase --out "$OUT" --name "$name" --cap "$cap" --limit "$limit" --rc "$rc" \
    --seconds $((SECONDS - t)) ${file:+--file "$file"} 2>&1 | tee -a "$LOG"
}

# Newest first: the phase's cap has cut the list (2026-11-28, 53 of 65 tests in 130 s), so what never ran on a GPU
# leads: the launch cache's hits through Triton's C launcher (every bound op against the JIT, bitwise; the raw
# launch against Triton 3.6's own wrappers), the unfused exchange's indexed add of the boxes that come back and its
# gathered staging of small blocks (torch ops, deterministic by torch's list), chunk_reduce with its flags polled by acquire loads as well as atomics
# (DISTFUSE_FLAG_POLL), the split staging, the staging's words form, the overlap passes, the deferred checks drained
# within a claim, then the halo kernels' file (22 tests: its realistic ones run the rebuilt box gather and
# accumulate against their references), then the files that passed on the H200 before.
TESTS=(tests/test_launch_cache.py tests/test_raw_launch.py
       tests/test_halo_pieces_assembly.py::test_the_boxes_that_come_back_are_added_at_once_in_box_order_cuda
       tests/test_halo_gathering.py::test_the_gather_on_fixed_workers_cuda
       tests/test_gemm_kernels.py::test_chunk_reduce_pinned_launch_cuda
       tests/test_gemm_kernels.py::test_missing_source_on_cuda_poisons_and_raises tests/test_halo_stage_split.py
       tests/test_halo_stage_words.py::test_words_staging_cuda tests/test_halo_overlap_passes.py tests/test_status_slots.py tests/test_halo_kernels.py
       tests/test_scatter_partial.py tests/test_agreement_deferred.py
       tests/test_first_contact.py tests/test_providers.py tests/test_persistent_gemm.py tests/test_fused_copy_engine.py
       tests/test_gemm_kernels.py)
TIMEOUT_ARG=()
$PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 90)
DEV=$($PY -c "import re, torch; print(re.sub(r'[^A-Za-z0-9._-]', '_', torch.cuda.get_device_name()) if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
GEMM_JSON=$OUT/gemm_fused-$DEV-$DATE.json
HALO_JSON=$OUT/halo_conv-$DEV-$DATE.json

if [ -n "$DRY" ]; then
  PROBE=($PY scripts/gpu_probe.py --dry-run --json "$OUT/probe.json")
  CANARY=($PY scripts/launch_canary.py --dry-run --probe-json "$OUT/probe.json" --timeout 80)
  GEMM=($PY bench/bench_gemm_fused.py --dry-run --sides rs ag --out-dir "$OUT")
  HALO=($PY bench/bench_halo_conv.py --dry-run --out-dir "$OUT")
  TWO=($PY scripts/gpu_two_process.py --dry-run --iters 4 --json "$OUT/two_process.json")
  ATT=($PY bench/bench_attention.py --dry-run --out "$OUT")
else
  PROBE=($PY scripts/gpu_probe.py --json "$OUT/probe.json")
  CANARY=($PY scripts/launch_canary.py --probe-json "$OUT/probe.json" --timeout 80)
  GEMM=($PY bench/bench_gemm_fused.py --models llama3-8b llama3-70b --m 8192 512 --sides rs ag --dtype bfloat16
        --reps 30 --out-dir "$OUT")
  HALO=($PY bench/bench_halo_conv.py --dims 2 3 --channels 64 256 --extents 64 512 --halos 1 --dtypes bfloat16
        --modes stage graph full --max-gib 16 --out-dir "$OUT")
  TWO=($PY scripts/gpu_two_process.py --iters 4 --json "$OUT/two_process.json")
  ATT=($PY bench/bench_attention.py --single --out "$OUT")
fi

# DISTFUSE_LAB_PHASES (default every phase): the phases to run, e.g. "probe tests gemm halo" for a rerun that
# must fit what is left of a session's device time; the others are recorded as skipped.
PHASES=" ${DISTFUSE_LAB_PHASES:-probe canary tests gemm halo two_process attention} "
want() {
  case "$PHASES" in *" $1 "*) return 0 ;; esac
  echo "=== gpu_lab: $1 skipped: not in DISTFUSE_LAB_PHASES" | tee -a "$LOG"
  $PY scripts/lab_record.py phase --out "$OUT" --name "$1" --cap "$2" --limit 0 --rc -2 --seconds 0
  return 1
}
want probe 30 && phase probe 30 "$OUT/probe.json" "${PROBE[@]}"
want canary 90 && phase canary 90 "$OUT/probe.json" "${CANARY[@]}"
# What the canary decided (nothing, DISTFUSE_FAST_LAUNCH=0 or DISTFUSE_LAUNCH_CACHE=0), for every later phase
LAUNCH_ENV=$($PY scripts/launch_canary.py --env-of "$OUT/probe.json" 2>>"$LOG")
[ -n "$LAUNCH_ENV" ] && export $LAUNCH_ENV && echo "=== gpu_lab: the later phases run with $LAUNCH_ENV" | tee -a "$LOG"
want tests 140 && DISTFUSE_LAB_TESTS_JSONL=$WORK/tests.jsonl DISTFUSE_TEST_COMPILED=1 \
  phase tests 140 "$OUT/tests.json" $PY -m pytest -q -p no:cacheprovider -p lab_pytest -m cuda -rfEs \
  "${TIMEOUT_ARG[@]}" "${TESTS[@]}"
want gemm 60 && phase gemm 60 "$GEMM_JSON" "${GEMM[@]}"
want halo 110 && phase halo 110 "$HALO_JSON" "${HALO[@]}"
want two_process 55 && phase two_process 55 "$OUT/two_process.json" "${TWO[@]}"
want attention 45 && phase attention 45 "" "${ATT[@]}"

$PY scripts/lab_record.py ratios --out "$OUT" 2>&1 | tee -a "$LOG"
RC=0
if [ -n "$DRY" ]; then
  TOOL=${DISTFUSE_LAB_RATIOS_TOOL:-/work/shared/tools/gpu_ratios.py}
  [ -f "$TOOL" ] || TOOL=""
  $PY scripts/lab_record.py check --out "$OUT" --budget "$BUDGET" ${TOOL:+--ratios-tool "$TOOL"} 2>&1 | tee -a "$LOG"
  RC=${PIPESTATUS[0]}
fi
echo "=== gpu_lab: done in $((SECONDS - T0)) s; files: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
exit "$RC"
