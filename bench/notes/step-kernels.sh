#!/usr/bin/env bash
# Every kernel of one training step under ncu (duration, DRAM and SM throughput, registers, grid), one call on the
# GPU machine over binaries built elsewhere (bench/notes/staged.sh); the CSV comes back as step-kernels.csv and
# bench/notes/step-kernels.py sums it by kernel (notes: bench/notes/train-step.md, session 15).
#   stage=.stage/cN out=$OUT bash bench/notes/step-kernels.sh [MIXERS]
# MIXERS: fal (default) or tpa. VARIANTS: env settings, each a run (NAME=VALUE pairs joined by '+'; default base).
set -uo pipefail
mixers=${1:-fal}
source bench/notes/staged.sh
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size
for v in ${VARIANTS:-base}; do
  with "$v" timeout 300 ncu --csv --page raw --metrics "$metrics" \
    "$cli" bench train --mixers "$mixers" --steps 1 --warmup 0 --no-cuda-graph >"$out/step-kernels-$v.csv" 2>&1
  log "ncu step $mixers $v rc=$? $(grep -c '^"' "$out/step-kernels-$v.csv") rows"
done
log "done"
