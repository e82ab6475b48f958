#!/usr/bin/env bash
# The TPA attention backward kernels in one command on the GPU machine: a Release sm_90a build (the CLI and
# the tests), the backward-kernel and split cases (every backward kernel, both split forms included), the
# backward benchmark for each name in BENCHES (default "default wgmma-split": the default kernel, tma, then
# LINTAPE_TPA_BWD=NAME; also mma, wgmma, tma, and wgmma-unordered or tma-unordered: that kernel with
# LINTAPE_TPA_BWD_ORDER=0, the turns' cost), the einsum + SDPA peer when PYTHONPATH is set, then at once (no
# timing runs beside them) the TPA CUDA cases with LINTAPE_TPA_BWD=$KERNEL (default tma), memcheck on the
# backward-kernel and split cases, racecheck and synccheck on the split case; with NCU=1 Nsight Compute's speed
# of light of one $KERNEL backward at B 8 H 16 N 2048; last a table of backward times. Every step has a time
# limit and runs even when an earlier one failed.
#
#   scripts/tpa-bwd-check.sh OUTDIR
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" && out=$(cd "$1" && pwd)
build=${LINTAPE_GPU_BUILD:-$root/build-gpu}
tests=$build/tests/lintape_tests
cli=$build/lintape
case='*backward kernels at the tiles*'
split='*split backward*'
kernel=${KERNEL:-tma}
status=0
source "$root/scripts/gpu-steps.sh"

build_release "$build" lintape_cli lintape_tests
step "backward-kernel case" 90 "$out/tests.log" "$tests" -tc="$case,$split"
bench() {  # bench NAME VAR=VALUE...
  local name=$1
  shift
  echo "== bench $name: $*" >>"$out/bench.txt"
  timeout 90 env "$@" "$cli" bench tpa-attention --mode bwd --metric speed --n 2048,8192 --reps 10 \
    >>"$out/bench.txt" 2>&1
  echo "bench $name: exit $? at $(date +%T)" | tee -a "$out/summary.txt"
}
for name in ${BENCHES:-default wgmma-split}; do
  case $name in
    default) bench default ;;
    wgmma-unordered) bench wgmma-unordered LINTAPE_TPA_BWD=wgmma LINTAPE_TPA_BWD_ORDER=0 ;;
    tma-unordered) bench tma-unordered LINTAPE_TPA_BWD=tma LINTAPE_TPA_BWD_ORDER=0 ;;
    *) bench "$name" LINTAPE_TPA_BWD="$name" ;;
  esac
done
if [ -n "${PYTHONPATH:-}" ]; then
  step peer 120 "$out/peer.txt" python3 "$root/bench/peers/tpa_peer.py" --no-decode --attention-ns 2048,8192 \
    --attention-shapes 8x16,16x6
fi
step "tpa cases, backward $kernel" 180 "$out/tests.log" env LINTAPE_TPA_BWD="$kernel" "$tests" -tc='*cuda*tpa*' &
step memcheck 180 "$out/sanitizer-memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" \
  -tc="$case,$split" &
step racecheck 180 "$out/sanitizer-racecheck.log" compute-sanitizer --tool racecheck --error-exitcode 1 "$tests" \
  -tc="$split" &
step synccheck 180 "$out/sanitizer-synccheck.log" compute-sanitizer --tool synccheck --error-exitcode 1 "$tests" \
  -tc="$split" &
wait
tail -n 3 "$out"/sanitizer-*.log
grep -E "test cases|assertions" "$out/tests.log"
if [ "${NCU:-0}" = 1 ]; then  # the backward's kernels past the first calls, at B 8 H 16 N 2048, one by one
  step ncu 60 "$out/ncu.txt" env LINTAPE_TPA_BWD="$kernel" ncu --clock-control none --section SpeedOfLight \
    --launch-skip 10 --launch-count 14 -k 'regex:attention_delta|build_rows|backward|factor_grads' "$cli" bench \
    tpa-attention --mode bwd --metric speed --n 2048 --reps 1
  grep -E "\)x\(|Duration|Compute \(SM\) Throughput|Memory Throughput" "$out/ncu.txt" | cut -c1-150 | head -n 56
fi
# The table: each kernel's backward rows (ms: fused, composed, TFLOP/s), then the peer's.
grep -E "^== bench|speed-bwd|^ *[0-9]+ " "$out/bench.txt"
[ -f "$out/peer.txt" ] && tail -n 20 "$out/peer.txt"
cat "$out/summary.txt"
exit $status
