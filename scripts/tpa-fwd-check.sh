#!/usr/bin/env bash
# The TPA attention forward kernels in one command on the GPU machine: a Release sm_90a build, the launcher
# case (every forward kernel on poisoned outputs), the forward benchmark with each kernel (LINTAPE_TPA_FWD),
# the einsum + SDPA peer, the other TPA CUDA cases, compute-sanitizer memcheck and synccheck on a small case
# with each producer-warp kernel; a table of forward times last. Every step has a time limit and runs even
# when an earlier one failed.
#
#   scripts/tpa-fwd-check.sh OUTDIR [KERNEL ...]     (kernels: mma wgmma tma pingpong, the default)
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" && out=$(cd "$1" && pwd)
shift
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(mma wgmma tma pingpong)
build=${LINTAPE_GPU_BUILD:-$root/build-gpu}
tests=$build/tests/lintape_tests
cli=$build/lintape
status=0
step() {  # step NAME SECONDS LOG COMMAND...
  local name=$1 limit=$2 log=$3 rc
  shift 3
  echo "== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "$name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/summary.txt"
step configure 120 "$out/build.log" cmake -S "$root" -B "$build" -G Ninja -DLINTAPE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release
step build 300 "$out/build.log" cmake --build "$build" -j16 || { tail -n 40 "$out/build.log"; exit 1; }
step "launcher case" 150 "$out/tests.log" "$tests" -tc='*fused forward and six gradients*'
for k in "${kernels[@]}"; do
  LINTAPE_TPA_FWD=$k step "bench $k" 90 "$out/bench-$k.txt" "$cli" bench tpa-attention --mode fwd --metric speed \
    --n 2048,8192 --reps 10
done
if [ -n "${PYTHONPATH:-}" ]; then
  step peer 150 "$out/peer.txt" python3 "$root/bench/peers/tpa_peer.py" --no-decode --attention-ns 2048,8192 \
    --attention-shapes 8x16,16x6
fi
step "tpa cases" 200 "$out/tests.log" "$tests" -tc='*cuda*tpa*' -tce='*fused forward and six gradients*'
for k in tma pingpong; do
  for tool in memcheck synccheck; do
    LINTAPE_TPA_FWD=$k step "$tool $k" 60 "$out/sanitizer.log" compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$tests" -tc='*fused reads views of wider projections*'
  done
done
# The table: each kernel's forward rows (ms), then the peer's.
for k in "${kernels[@]}"; do
  echo "-- $k"
  grep -E "speed-fwd|fused|^ *[0-9]+ " "$out/bench-$k.txt" | head -n 20
done
[ -f "$out/peer.txt" ] && tail -n 20 "$out/peer.txt"
cat "$out/summary.txt"
exit $status
