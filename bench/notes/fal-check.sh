#!/usr/bin/env bash
# The FAL kernels' device check (notes: bench/notes/fal-hopper.md, sessions 13 and 15), one call on the GPU machine
# over binaries built elsewhere (bench/notes/staged.sh): the FAL CUDA cases (and the sanitizers over MEM_CASES /
# RACE_CASES when given), then the benchmarks under each of VARIANTS in the same call, ncu over NCU_KERNELS under
# each of NCU_VARIANTS, the step. (Session 13 compared LINTAPE_FAL_WG=thread and LINTAPE_FAL_ROWS_PREFETCH=0, session
# 15 LINTAPE_FAL_GRAD_PREFETCH=0: switches since removed with the losing forms.)
#   stage=.stage/cN out=$OUT bash bench/notes/fal-check.sh [STEPS]
# STEPS: a comma list of tests,causal,noncausal,ncu,train (default all). VARIANTS: the env settings compared, each a
# word of NAME=VALUE pairs joined by '+' ('base' for none; default: base). NCU_VARIANTS: default the first variant.
set -uo pipefail
steps=,${1:-tests,causal,noncausal,ncu,train},
has() { [[ $steps == *,$1,* ]]; }
source bench/notes/staged.sh
variants=(${VARIANTS:-base})
if has tests; then
  timeout 400 "$tests" -tc="${TEST_CASES:-*cuda*fal*}" >"$out/tests.log" 2>&1
  log "tests rc=$? $(counts "$out/tests.log")"
  grep -E 'ERROR|FAILED|failed' "$out/tests.log" | head -20 >>"$out/summary.txt"
  if [[ -n ${MEM_CASES:-} ]]; then
    timeout "${SAN_S:-200}" compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc="$MEM_CASES" \
      >"$out/sanitizer.log" 2>&1
    log "memcheck rc=$? $(grep -h 'ERROR SUMMARY' "$out/sanitizer.log")"
  fi
  if [[ -n ${RACE_CASES:-} ]]; then
    for tool in racecheck synccheck; do
      timeout "${SAN_S:-200}" compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc="$RACE_CASES" \
        >>"$out/sanitizer.log" 2>&1
      log "$tool rc=$? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -n1)"
    done
  fi
fi
if has causal; then
  for v in "${variants[@]}"; do
    echo "== $v" >>"$out/bench.txt"
    with "$v" "$cli" bench fal-causal --n "${CAUSAL_NS:-2048,8192}" --reps 5 --metric speed >>"$out/bench.txt" 2>&1
    log "bench fal-causal $v rc=$?"
  done
fi
if has noncausal; then
  for v in "${variants[@]}" ${NONCAUSAL_VARIANTS:-}; do
    echo "== $v" >>"$out/bench.txt"
    with "$v" "$cli" bench fal --n 4096,8192 --reps 5 --metric speed >>"$out/bench.txt" 2>&1
    log "bench fal $v rc=$?"
  done
  "$cli" bench copy --n 1024 --reps 5 >>"$out/bench.txt" 2>&1
fi
if has ncu; then
  for v in ${NCU_VARIANTS:-${variants[0]}}; do
    echo "== $v" >>"$out/ncu.txt"
    with "$v" timeout 120 ncu -k "regex:${NCU_KERNELS:-hopper_forward_kernel|walk_kernel|hopper_grad_kernel}" \
      -c "${NCU_COUNT:-3}" --section SpeedOfLight --section InstructionStats --section SchedulerStats \
      --section LaunchStats --section MemoryWorkloadAnalysis \
      "$cli" bench fal-causal --n 2048 --mode bwd --reps 1 >>"$out/ncu.txt" 2>&1
    log "ncu causal $v rc=$?"
    if [[ -z ${NCU_CAUSAL_ONLY:-} ]]; then
      with "$v" timeout 120 ncu -k 'regex:hopper_row_kernel|reduce_kernel' -c 5 \
        --section SpeedOfLight --section InstructionStats --section SchedulerStats --section LaunchStats \
        "$cli" bench fal --n 8192 --mode bwd --reps 1 >>"$out/ncu.txt" 2>&1
      log "ncu noncausal $v rc=$?"
    fi
  done
fi
if has train; then
  for v in "${variants[@]}"; do
    echo "== $v" >>"$out/train.txt"
    with "$v" timeout 120 "$cli" bench train --mixers fal --steps 10 >>"$out/train.txt" 2>&1
    log "bench train $v rc=$? $(grep -E 'tok/s|tokens' "$out/train.txt" | tail -n1 | tr -s ' ')"
  done
fi
log "done"
