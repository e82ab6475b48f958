#!/usr/bin/env bash
# The TPA attention forward kernels in one command on the GPU machine: a Release sm_90a build, the launcher
# case (every forward kernel on poisoned outputs), the forward benchmark with each kernel (LINTAPE_TPA_FWD),
# the einsum + SDPA peer, the other TPA CUDA cases with the default forward and with each kernel named in
# LINTAPE_TPA_CASES_WITH (default: persist), compute-sanitizer memcheck and synccheck on a small case with each
# producer-warp kernel; a table of forward times last. Every step has a time limit and runs even when an
# earlier one failed.
#
#   scripts/tpa-fwd-check.sh OUTDIR [KERNEL ...]
#     kernels (LINTAPE_TPA_FWD): mma wgmma tma pingpong persist persist-pingpong, the default
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" && out=$(cd "$1" && pwd)
shift
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(mma wgmma tma pingpong persist persist-pingpong)
build=${LINTAPE_GPU_BUILD:-$root/build-gpu}
tests=$build/tests/lintape_tests
cli=$build/lintape
status=0
source "$root/scripts/gpu-steps.sh"

build_release "$build"
step "launcher case" 150 "$out/tests.log" "$tests" -tc='*fused forward and six gradients*'
for k in "${kernels[@]}"; do
  LINTAPE_TPA_FWD=$k step "bench $k" 90 "$out/bench.txt" "$cli" bench tpa-attention --mode fwd --metric speed \
    --n 2048,8192 --reps 10
done
if [ -n "${PYTHONPATH:-}" ]; then
  step peer 150 "$out/peer.txt" python3 "$root/bench/peers/tpa_peer.py" --no-decode --attention-ns 2048,8192 \
    --attention-shapes 8x16,16x6
fi
step "tpa cases" 150 "$out/tests.log" "$tests" -tc='*cuda*tpa*' -tce='*fused forward and six gradients*'
for k in ${LINTAPE_TPA_CASES_WITH:-persist}; do
  LINTAPE_TPA_FWD=$k step "tpa cases with $k" 150 "$out/tests.log" "$tests" -tc='*cuda*tpa*' \
    -tce='*fused forward and six gradients*'
done
for k in tma pingpong persist persist-pingpong; do
  for tool in memcheck synccheck; do
    LINTAPE_TPA_FWD=$k step "$tool $k" 45 "$out/sanitizer.log" compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$tests" -tc='*fused reads views of wider projections*'
  done
done
# The table: each kernel's forward rows (ms: fused, composed, TFLOP/s), then the peer's.
grep -E "^== bench|speed-fwd|^ *[0-9]+ " "$out/bench.txt"
[ -f "$out/peer.txt" ] && tail -n 20 "$out/peer.txt"
cat "$out/summary.txt"
exit $status
