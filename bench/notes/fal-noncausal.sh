#!/usr/bin/env bash
# The noncausal FAL row passes' device check (notes: bench/notes/fal-hopper.md, "Noncausal"), one call on the GPU
# machine over binaries built elsewhere (bench/notes/staged.sh): the FAL CUDA cases; memcheck over the chunked
# noncausal cases and racecheck / synccheck over the first of them, beside the cases; then `lintape bench fal`
# with the wgmma row passes and with the mma.sync ones (LINTAPE_FAL_NONCAUSAL_ROWS=mma), the plain PyTorch peer
# (eager and torch.compile) in the same call, and ncu's kernel times. (Session 12 also timed the kernels with the
# acts as arguments, through a switch since removed: bench/notes/fal-hopper.md.)
#   stage=.stage/cN out=$OUT bash bench/notes/fal-noncausal.sh [STEPS]
# STEPS: a comma list of tests,bench,peer,ncu,causal,source,train (default: tests,bench,peer,ncu; causal: `bench
# fal-causal`; source: ncu's per-line report of the backward's two row passes). MEM_CASES and RACE_CASES replace
# the sanitizers' cases (SAN_S: their limit in seconds, default 300), TEST_CASES the cases run beside them (default the FAL CUDA cases); train: `bench train
# --mixers fal`.
set -uo pipefail
steps=,${1:-tests,bench,peer,ncu},
has() { [[ $steps == *,$1,* ]]; }
source bench/notes/staged.sh
ns=${NS:-4096,8192}
if has tests; then
  "$tests" -tc="${TEST_CASES:-*cuda*fal*}" >"$out/tests.log" 2>&1 &
  pids=($!)
  timeout "${SAN_S:-300}" compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc="${MEM_CASES:-*cuda fal chunked noncausal*}" \
    >"$out/memcheck.log" 2>&1 &
  pids+=($!)
  for tool in racecheck synccheck; do
    timeout "${SAN_S:-300}" compute-sanitizer --tool $tool --error-exitcode 1 "$tests" \
      -tc="${RACE_CASES:-*cuda fal chunked noncausal matches*}" >"$out/$tool.log" 2>&1 &
    pids+=($!)
  done
  names=(tests memcheck racecheck synccheck)
  for i in 0 1 2 3; do
    wait "${pids[$i]}"
    log "${names[$i]} rc=$? $(counts "$out/${names[$i]}.log") $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' \
      "$out/${names[$i]}.log")"
  done
  grep -E 'ERROR|FAILED|failed' "$out/tests.log" | head -20 >>"$out/summary.txt"
  LINTAPE_FAL_NONCAUSAL_ROWS=mma "$tests" -tc='*cuda fal chunked noncausal*' >"$out/tests-mma.log" 2>&1
  log "noncausal cases on the mma.sync row passes rc=$? $(counts "$out/tests-mma.log")"
  cat "$out"/{memcheck,racecheck,synccheck,tests-mma}.log >"$out/sanitizer.log" 2>/dev/null
  rm -f "$out"/{memcheck,racecheck,synccheck,tests-mma}.log
fi
if has bench; then
  for rows in wgmma mma wgmma; do
    echo "== rows $rows" >>"$out/bench.txt"
    LINTAPE_FAL_NONCAUSAL_ROWS=$rows "$cli" bench fal --n "$ns" --reps 5 >>"$out/bench.txt" 2>&1
    log "bench fal rows=$rows rc=$?"
  done
  "$cli" bench copy --n 256,1024 --reps 5 >>"$out/bench.txt" 2>&1
fi
if has peer; then
  (cd bench/peers && timeout 200 python3 fal_peer.py --noncausal-only --ns "$ns") >"$out/peer.txt" 2>&1
  log "peer rc=$?"
fi
if has ncu; then
  # The first forward and backward's kernels (reduce, rows; then reduce, query rows, key rows) with their stall
  # reasons, and the instructions a kernel executed.
  timeout 200 ncu -k 'regex:row_kernel|reduce_kernel' --launch-count 5 --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section SchedulerStats --section WarpStateStats --section InstructionStats \
    "$cli" bench fal --n 8192 --mode bwd --reps 1 >"$out/ncu.txt" 2>&1
  log "ncu rc=$?"
fi
if has causal; then
  "$cli" bench fal-causal --n 2048,8192 --reps 5 >>"$out/causal.txt" 2>&1
  log "bench fal-causal rc=$?"
fi
if has source; then
  timeout 200 ncu -k regex:hopper_row_kernel -s 1 -c 2 --section WarpStateStats --section SourceCounters \
    --import-source yes -o "$out/rows" "$cli" bench fal --n 8192 --mode bwd --reps 1 >"$out/ncu-source.txt" 2>&1
  log "ncu source rc=$?"
  ncu -i "$out/rows.ncu-rep" --page source --csv --print-source cuda >"$out/rows-cuda.csv" 2>&1
  rm -f "$out/rows.ncu-rep"
fi
if has train; then
  timeout 120 "$cli" bench train --mixers fal --steps 10 >"$out/train.txt" 2>&1
  log "bench train rc=$? $(grep -E 'tok/s|tokens' "$out/train.txt" | tail -n2 | tr -s ' ' | tr '\n' ' ')"
fi
