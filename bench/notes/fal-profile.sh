#!/usr/bin/env bash
# Per-line and per-instruction profiles of the FAL chunk kernels on Hopper (notes: bench/notes/fal-hopper.md,
# session 13), one call on the GPU machine over binaries built elsewhere (bench/notes/staged.sh): the causal
# forward, the reverse state pass walk and the gradient kernel at B = H = 12, N = 2048 (the first of `bench
# fal-causal`), and the noncausal reductions and row passes at N = 8192, each its first launch under ncu with the
# source counters (executed instructions and warp-stall samples per CUDA line and per SASS instruction), then
# `bench fal-causal` and `bench fal` for the times of the same binaries. The CSVs come back in profile.tgz.
#   stage=.stage/cN out=$OUT bash bench/notes/fal-profile.sh [KERNELS]
# KERNELS: a comma list of fwd,walk,grad,reduce,rows (default all).
set -uo pipefail
kernels=,${1:-fwd,walk,grad,reduce,rows},
has() { [[ $kernels == *,$1,* ]]; }
source bench/notes/staged.sh
mkdir -p /tmp/prof
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
          --section WarpStateStats --section InstructionStats --section SourceCounters)
profile() {  # name, kernel regex, launches to skip, bench arguments...
  local name=$1 regex=$2 skip=$3
  shift 3
  timeout 150 ncu "${sections[@]}" -k "regex:$regex" -s "$skip" -c 1 --import-source yes -o "/tmp/prof/$name" \
    "$cli" bench "$@" --reps 1 >"/tmp/prof/$name.log" 2>&1
  log "ncu $name rc=$?"
  ncu -i "/tmp/prof/$name.ncu-rep" --page details >>"$out/ncu.txt" 2>&1
  ncu -i "/tmp/prof/$name.ncu-rep" --page source --csv --print-source cuda >"/tmp/prof/$name-cuda.csv" 2>&1
  ncu -i "/tmp/prof/$name.ncu-rep" --page source --csv --print-source sass >"/tmp/prof/$name-sass.csv" 2>&1
  rm -f "/tmp/prof/$name.ncu-rep"
}
has fwd && profile fwd hopper_forward_kernel 0 fal-causal --n 2048 --mode fwd
has walk && profile walk walk_kernel 0 fal-causal --n 2048 --mode bwd
has grad && profile grad hopper_grad_kernel 0 fal-causal --n 2048 --mode bwd
has reduce && profile reduce reduce_kernel 1 fal --n 8192 --mode bwd
has rows && profile rows hopper_row_kernel 1 fal --n 8192 --mode bwd
tar czf "$out/profile.tgz" -C /tmp/prof .
"$cli" bench fal-causal --n 2048,8192 --reps 5 >"$out/bench.txt" 2>&1
log "bench fal-causal rc=$?"
"$cli" bench fal --n 8192 --reps 5 >>"$out/bench.txt" 2>&1
log "bench fal rc=$?"
log "done"
