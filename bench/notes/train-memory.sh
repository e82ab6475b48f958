#!/usr/bin/env bash
# Session 14's device check of the norms made again in the backward (`rms_norm_linear`, `add_rms_norm_linear`;
# notes: bench/notes/train-step.md, "Session 14"), one call on the GPU machine over binaries built elsewhere
# (bench/notes/staged.sh), fla-core and einops carried as wheels in .whl when at hand:
#   stage=.stage/cN out=$OUT bash bench/notes/train-memory.sh [STEPS]
# STEPS, a comma list (default all): tests (every CUDA case, then memcheck over the new op's case), train (`bench
# train`, both mixers, the rows made again against LINTAPE_KEEP_NORMED=1, alternating), compare (compare_train.py
# against compiled PyTorch, with fla's kernels for FAL), profile (`lintape profile`, FAL), fal (`bench fal-causal`
# around fla's kernel alone).
set -uo pipefail
steps=,${1:-tests,train,compare,profile,fal},
has() { [[ $steps == *,$1,* ]]; }
source bench/notes/staged.sh
use_wheels
if has tests; then
  timeout 300 "$tests" -tc='*cuda*' >"$out/tests.log" 2>&1
  log "every CUDA case rc=$? $(counts "$out/tests.log")"
  grep -E 'ERROR|FAILED|failed' "$out/tests.log" | head -20 >>"$out/summary.txt"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc='*cuda*rms_norm_linear*' \
    >"$out/sanitizer.log" 2>&1
  log "memcheck rc=$? $(grep -h 'ERROR SUMMARY' "$out/sanitizer.log")"
fi
if has train; then
  for mixer in fal tpa; do
    for v in base LINTAPE_KEEP_NORMED=1 base LINTAPE_KEEP_NORMED=1; do
      echo "== $mixer $v" >>"$out/train.txt"
      with "$v" timeout 120 "$cli" bench train --mixers $mixer --steps 10 >>"$out/train.txt" 2>&1
      log "bench train $mixer $v rc=$? $(grep -A1 "tokens/s" "$out/train.txt" | tail -n1 | tr -s " ")"
    done
  done
fi
if has compare; then
  timeout 420 python3 bench/torch_ref/compare_train.py --lintape "$cli" --mixers fal,tpa --modes compile --steps 6 \
    --timeout 200 >"$out/compare.txt" 2>&1
  log "compare rc=$?"
  tail -n 8 "$out/compare.txt" >>"$out/summary.txt"
fi
if has profile; then
  timeout 120 "$cli" profile --preset small --steps 3 --warmup 2 >"$out/profile.txt" 2>&1
  log "profile rc=$? $(grep -E 'peak' "$out/profile.txt" | tail -n1)"
fi
if has fal; then
  "$cli" bench fal-causal --n 2048,8192 --reps 5 --metric speed >"$out/fal.txt" 2>&1
  timeout 200 python3 bench/peers/fal_peer.py --causal-only --kernel-only >>"$out/fal.txt" 2>&1
  log "fal peer rc=$?"
  "$cli" bench fal-causal --n 2048,8192 --reps 5 --metric speed >>"$out/fal.txt" 2>&1
  "$cli" bench copy --n 1024 --reps 5 >>"$out/fal.txt" 2>&1
  log "fal rc=$?"
fi
log "done"
