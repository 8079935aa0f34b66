#!/usr/bin/env bash
# A GPU session's first device call: the lab, then the host-cost diagnosis in the time the call has left.
#
#   bash scripts/gpu_first_call.sh                          # on the device machine ($OUT from the device tool)
#   DISTFUSE_LAB_DRY_RUN=1 bash scripts/gpu_first_call.sh   # here, without a GPU: both in their CPU-safe forms
#
# 1. scripts/gpu_lab.sh into a scratch folder (at most 540 s; it took 213 s on an H100), whose launch canary decides
#    how the kernels launch here (exported for the diagnosis too);
# 2. scripts/gpu_diagnose.py --sections host attrib latency forms halo persistent gathered: host time against kernel
#    time per fused op (eager rows are bound by the host: docs/gpu.md), the persistent producer's forms against
#    cuBLAS, the halo steps, then the persistent producer's and consumer's tiles at M = 8192 (DISTFUSE_SWEEP_M:
#    M = 512 was swept on 2026-11-28 and its tiles are committed; at 8192 the 8B rows stay at 0.86-0.88 of
#    cuBLAS in graph replays, and only the forms section's two tiles were ever timed there; CUDA graph replays
#    beside the loop times), with what is left of 585 s, if 30 s or more (each section stops at the budget, so
#    the sweeps take only the time the rest left; the 8B shapes come first);
# 2b. before it, scripts/host_cost.py --kernels (the host's Python on the launchers, about 15 s) if 90 s are left;
# 2c. after the diagnosis' halo section, and after its GEMM sweeps: what they measured pinned into a table of this
#    call's (distfuse-tune tiles), and the halo phase, then the GEMM phase at M = 8192, again with it where an entry
#    for their kernels was written (below);
# 3. everything into $OUT/lab.tgz (the device tool brings back at most 8 files), with lab.json and
#    lab.log beside it for a first look: packed once after the lab and again at the end;
# 4. the digest of what the lab and the diagnosis answer (scripts/lab_digest.py), printed last.
# DISTFUSE_FIRST_CALL_BUDGET (default 585 s): the seconds lab and diagnosis may take together (a shorter rerun).
# DISTFUSE_LAB_PHASES (scripts/gpu_lab.sh) and DISTFUSE_DIAGNOSE_SECTIONS (default: the seven above) narrow a rerun.
#
# Collect here:  mkdir d && tar xzf <files_at>/lab.tgz -C d && python scripts/lab_record.py collect --out d
# (copies the benchmark files, lab.json, tests, probe, two_process and diagnose.json into bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DISTFUSE_LAB_DRY_RUN:-0}
[ "$DRY" = 0 ] && DRY=""
DEST=${OUT:-/tmp/distfuse-first-call}
if [ -n "$DRY" ]; then PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}; else PY=${PYTHON:-python3}; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export DISTFUSE_COMMIT=${DISTFUSE_COMMIT:-$(cat .lab_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$SECONDS
OUT=$WORK/lab bash scripts/gpu_lab.sh
echo "gpu_first_call: lab exit $?"
pack() {  # after the lab and again at the end: a call cut off during the diagnosis keeps the lab's files
  mkdir -p "$DEST"
  tar czf "$DEST/lab.tgz.part" -C "$WORK/lab" . && mv -f "$DEST/lab.tgz.part" "$DEST/lab.tgz"
  cp "$WORK/lab/lab.json" "$WORK/lab/lab.log" "$DEST/" 2>/dev/null
}
pack
# The lab's launch canary decided how the kernels launch on this GPU (nothing, DISTFUSE_FAST_LAUNCH=0 or
# DISTFUSE_LAUNCH_CACHE=0): the diagnosis runs the same way.
LAUNCH_ENV=$("$PY" scripts/launch_canary.py --env-of "$WORK/lab/probe.json" 2>/dev/null)
[ -n "$LAUNCH_ENV" ] && export $LAUNCH_ENV && echo "gpu_first_call: the diagnosis runs with $LAUNCH_ENV"
# The device host's Python speed on the launchers (every launch a stubbed cache hit, CPU tensors, ~15 s): the same
# harness as on a CI or desktop CPU, so host-time changes measured there can be scaled to this host.
if [ $((${DISTFUSE_FIRST_CALL_BUDGET:-585} - (SECONDS - T0))) -ge 90 ]; then
  PYTHONPATH="$PWD" timeout --kill-after=5 60 "$PY" scripts/host_cost.py --kernels >"$WORK/lab/host_cost.json" \
    2>"$WORK/lab/host_cost.log"
  echo "gpu_first_call: host_cost exit $?"
fi
SECTIONS=${DISTFUSE_DIAGNOSE_SECTIONS:-host attrib latency forms halo persistent gathered}
# The diagnosis in two parts, one file: the sections up to the halo staging's (whose tile and form rows the tile table
# takes), then, after the pinned halo rerun below, the GEMM sweeps with what is left
FIRST=""; REST=""; SPLIT_DONE=""
for s in $SECTIONS; do
  if [ -z "$REST$SPLIT_DONE" ]; then FIRST="$FIRST $s"; [ "$s" = halo ] && SPLIT_DONE=1; else REST="$REST $s"; fi
done
diagnose() {  # diagnose SECTIONS... : one part, appended to diagnose.json after the first; RESERVE seconds kept
  local left=$((${DISTFUSE_FIRST_CALL_BUDGET:-585} - (SECONDS - T0) - ${RESERVE:-0}))
  if [ "$left" -lt 30 ]; then echo "gpu_first_call: diagnose $* skipped: ${left}s left"; return; fi
  PYTHONPATH="$PWD:$PWD/scripts" DISTFUSE_TIMEOUT=30 DISTFUSE_AUTOTUNE=0 timeout --kill-after=5 $((left - 5)) \
    "$PY" scripts/gpu_diagnose.py ${DRY:+--dry-run} --json "$WORK/lab/diagnose.json" --sections "$@" \
    --sweep-m ${DISTFUSE_SWEEP_M:-8192} --graph --budget $((left - 20)) \
    $([ -f "$WORK/lab/diagnose.json" ] && echo --append) >>"$WORK/lab/diagnose.log" 2>&1
  echo "gpu_first_call: diagnose $* exit $? ($(grep -c '^diag: {' "$WORK/lab/diagnose.log") rows in all)"
}
# 2c. What this call's sweeps measured, pinned where it beat the rules' own choice (distfuse-tune tiles, into a table
# of this call's: $WORK/lab/tiles_pinned.json), and a lab benchmark run again with that table where an entry for its
# kernels was written and its cap (+ 20 s) is left: the halo phase after the diagnosis' halo section (the staging's
# tile and forms: DISTFUSE_PINNED_HALO_S, default 90 s), the GEMM phase at M = 8192 after the GEMM sweeps (their
# tiles: DISTFUSE_PINNED_GEMM_S, default 60 s, kept from the sweeps' budget).  The rows go to <file>-pinned.json
# beside the phase's (the fused rows name their config: the halo bench's extra.stage_config_source "measured", the
# GEMM bench's kernel config), so a session with one call still measures what it pinned.  The dry run takes both
# reruns' paths whatever was written.
pinned_rerun() {  # pinned_rerun NAME LAB_FILE CAP KERNEL_REGEX BENCH_ARGS...
  local name=$1 lab_file=$2 cap=$3 kernels=$4
  shift 4
  [ -f "$WORK/lab/diagnose.json" ] && [ -n "$lab_file" ] || return
  PYTHONPATH="$PWD" "$PY" -m distfuse.tune.tiles "$WORK/lab/diagnose.json" --write --out "$WORK/lab/tiles_pinned.json" \
    >>"$WORK/lab/tiles_pinned.log" 2>&1
  local entries left
  entries=$(grep -cE "\"kernel\": \"($kernels)\"" "$WORK/lab/tiles_pinned.json" 2>/dev/null)
  left=$((${DISTFUSE_FIRST_CALL_BUDGET:-585} - (SECONDS - T0)))
  if { [ -n "$DRY" ] || [ "${entries:-0}" -gt 0 ]; } && [ "$left" -ge $((cap + 20)) ]; then
    DISTFUSE_TILE_TABLE="$WORK/lab/tiles_pinned.json" DISTFUSE_TIMEOUT=30 DISTFUSE_AUTOTUNE=0 \
      timeout --kill-after=5 "$cap" "$PY" "$@" --out "${lab_file%.json}-pinned.json" >"$WORK/lab/${name}_pinned.log" 2>&1
    echo "gpu_first_call: pinned $name rerun exit $? (${entries:-0} entries; $(grep -c '"provider"' \
      "${lab_file%.json}-pinned.json" 2>/dev/null || echo 0) rows)"
  else
    echo "gpu_first_call: pinned $name rerun skipped (${entries:-0} entries for $kernels written, ${left}s left)"
  fi
}
lab_file() { ls "$WORK"/lab/"$1"-*.json 2>/dev/null | grep -v -- -pinned | head -1; }
HALO_CAP=${DISTFUSE_PINNED_HALO_S:-90}
GEMM_CAP=${DISTFUSE_PINNED_GEMM_S:-60}
if [ -n "$DRY" ]; then HALO_ARGS=(--dry-run); GEMM_ARGS=(--dry-run --sides rs ag); else
  HALO_ARGS=(--dims 3 2 --channels 256 64 --extents 64 512 --halos 1 --dtypes bfloat16 --modes stage graph full
             --max-gib 16)
  GEMM_ARGS=(--models llama3-8b llama3-70b --m ${DISTFUSE_SWEEP_M:-8192} --sides rs ag --dtype bfloat16 --reps 30); fi
[ -n "$FIRST" ] && diagnose $FIRST
pinned_rerun halo "$(lab_file halo_conv)" "$HALO_CAP" halo_stage bench/bench_halo_conv.py "${HALO_ARGS[@]}"
GEMM_JSON=$(lab_file gemm_fused)
[ -n "$REST" ] && RESERVE=$([ -n "$GEMM_JSON" ] && echo $((GEMM_CAP + 20)) || echo 0) diagnose $REST
pinned_rerun gemm "$GEMM_JSON" "$GEMM_CAP" "matmul_scatter_persistent|gathered_matmul_persistent|chunk_reduce" \
  bench/bench_gemm_fused.py "${GEMM_ARGS[@]}"
pack
# The answers in one page (scripts/lab_digest.py), last: what the device tool's output shows first
PYTHONPATH="$PWD" "$PY" scripts/lab_digest.py "$WORK/lab" 2>&1 | head -190
echo "gpu_first_call: done in $((SECONDS - T0)) s: $(ls "$DEST" | tr '\n' ' ')"
