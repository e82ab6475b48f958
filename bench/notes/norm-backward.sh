#!/usr/bin/env bash
# Session 14's device check of the rms_norm backward kernel (notes: bench/notes/train-step.md, "Session 14"), one
# call over binaries built elsewhere (bench/notes/staged.sh): the norm's CUDA cases under each of VARIANTS (every
# CUDA case with TEST_CASES='*cuda*'), the sanitizers over the norm's cases, `bench rms-norm` (backward) and ncu of its
# kernel under each, the training steps, compare_train.py against compiled PyTorch (fla's kernels from .whl), the
# profile.
#   stage=.stage/cN out=$OUT bash bench/notes/norm-backward.sh [STEPS]
# STEPS: a comma list of tests,sanitize,bench,ncu,train,compare,profile (default all). VARIANTS: env settings compared, each a word
# of NAME=VALUE pairs joined by '+' ('base' for none; default: base).
set -uo pipefail
steps=,${1:-tests,sanitize,bench,ncu,train,compare,profile},
has() { [[ $steps == *,$1,* ]]; }
source bench/notes/staged.sh
variants=(${VARIANTS:-base})
if has tests; then
  for v in "${variants[@]}"; do
    with "$v" timeout 200 "$tests" -tc="${TEST_CASES:-*cuda*norm*,*cuda*LanguageModel*}" >>"$out/tests.log" 2>&1
    log "tests $v rc=$? $(counts "$out/tests.log" | tail -c 200)"
  done
  grep -E 'ERROR|FAILED|failed' "$out/tests.log" | head -20 >>"$out/summary.txt"
fi
if has sanitize; then
  cases='*cuda*rms_norm*,*cuda*add_rms_norm*,*cuda*normed rows*'
  for tool in memcheck racecheck synccheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc="$cases" >>"$out/sanitizer.log" 2>&1
    log "$tool rc=$? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -n1)"
  done
fi
if has bench; then
  for round in 1 2; do
    for v in "${variants[@]}"; do
      echo "== $v" >>"$out/bench.txt"
      with "$v" "$cli" bench rms-norm --n 16384,32768 --mode bwd --metric speed --reps 20 >>"$out/bench.txt" 2>&1
      log "bench rms-norm $v rc=$? $(grep -A3 'speed-bwd' "$out/bench.txt" | tail -n2 | tr -s ' ' | tr '\n' ';')"
    done
  done
fi
if has ncu; then
  for v in "${variants[@]}"; do
    echo "== $v" >>"$out/ncu.txt"
    with "$v" timeout 120 ncu -k 'regex:^(backward_kernel|reduce_partials_kernel)' -c 2 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      "$cli" bench rms-norm --n 32768 --mode bwd --metric speed --reps 1 >>"$out/ncu.txt" 2>&1
    log "ncu $v rc=$? $(grep -E '^\s+Duration' "$out/ncu.txt" | tail -n2 | tr -s ' ' | tr '\n' ';')"
  done
fi
if has train; then
  for mixer in fal tpa; do
    for v in "${variants[@]}"; do
      echo "== $mixer $v" >>"$out/train.txt"
      with "$v" timeout 120 "$cli" bench train --mixers $mixer --steps 10 >>"$out/train.txt" 2>&1
      log "bench train $mixer $v rc=$? $(grep -A1 'tokens/s' "$out/train.txt" | tail -n1 | tr -s ' ')"
    done
  done
fi
if has compare; then
  use_wheels
  timeout 420 python3 bench/torch_ref/compare_train.py --lintape "$cli" --mixers fal,tpa --modes compile --steps 6 \
    --timeout 200 >"$out/compare.txt" 2>&1
  log "compare rc=$?"
  tail -n 7 "$out/compare.txt" >>"$out/summary.txt"
fi
if has profile; then
  for mixer in ${PROFILE_MIXERS:-fal}; do
    timeout 120 "$cli" profile --preset small --mixers $mixer --steps 3 --warmup 2 >>"$out/profile.txt" 2>&1
    log "profile $mixer rc=$? $(grep -E 'peak' "$out/profile.txt" | tail -n1)"
  done
fi
log "done"
