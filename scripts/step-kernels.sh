#!/usr/bin/env bash
# Every kernel of one training step under Nsight Compute, as a table: which kernels a step spends its time in
# and how far each is from its bound (DRAM throughput for the bandwidth kernels, tensor-pipe activity for the
# products). Runs one eager step (`lintape bench train --steps 1 --warmup 0 --no-cuda-graph`; the kernels are
# the graph's) of the `small` model with the given mixers, on the GPU machine.
#
#   scripts/step-kernels.sh LINTAPE OUTDIR [MIXERS] [NCU FLAGS ...]
#     LINTAPE     the lintape executable
#     MIXERS      fal or tpa (default tpa)
#     NCU FLAGS   passed to ncu, e.g. -k 'regex:swiglu|backward' to time a few kernels only
#
# OUTDIR receives step-MIXERS.csv (ncu's raw CSV) and step-MIXERS.txt (bench/ncu_table.py's table). About two
# minutes for a whole step on an H100 or H200; a few kernels (-k) take seconds. The model's set-up kernels
# (initialisation, the first copies of the weights) are in the table too, as the rows with one launch.
set -uo pipefail
if [ $# -lt 2 ] || [[ $1 == -* ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
cli=$1 out=$2 mixers=${3:-tpa}
shift $(($# < 3 ? $# : 3))
mkdir -p "$out"
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__grid_size
ncu --clock-control none --metrics "$metrics" --csv --page raw "$@" \
  "$cli" bench train --mixers "$mixers" --steps 1 --warmup 0 --no-cuda-graph >"$out/step-$mixers.csv" || exit $?
python3 "$root/bench/ncu_table.py" "$out/step-$mixers.csv" | tee "$out/step-$mixers.txt"
