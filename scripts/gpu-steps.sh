# Sourced by the kernel check scripts (scripts/tpa-fwd-check.sh, scripts/tpa-bwd-check.sh) after they set
# $out (the output folder) and $status (0): the device's line in summary.txt, a time-limited step runner and
# the Release sm_90a build into $1 (the build folder; more arguments name the targets).
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/summary.txt"

step() {  # step NAME SECONDS LOG COMMAND...: the verdict and the time go to summary.txt; a failure sets status
  local name=$1 limit=$2 log=$3 rc
  shift 3
  echo "== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "$name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") at $(date +%T)" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

build_release() {  # build_release BUILD [TARGET ...]: stops the script when the build fails
  local build=$1 targets=()
  shift
  [ $# -gt 0 ] && targets=(--target "$@")
  step configure 120 "$out/build.log" cmake -S "$root" -B "$build" -G Ninja -DLINTAPE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release &&
    step build 300 "$out/build.log" cmake --build "$build" -j16 "${targets[@]}" ||
    { tail -n 40 "$out/build.log"; exit 1; }
}
