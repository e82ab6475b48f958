#!/usr/bin/env bash
# The FAL causal chunk kernels' device check (notes: bench/notes/fal-hopper.md), one call on the GPU machine:
# builds this tree (and a base tree's CLI beside it, when given), runs the FAL CUDA cases, then
# `lintape bench fal-causal` for this tree (the state passes' wgmma walks, LINTAPE_FAL_STATE_PASS=new, and the
# mma.sync slices, the default; chunk states saved by the forward, and not) and the base, the fla kernel alone in
# the same call, compute-sanitizer on the chunked causal cases and ncu on the kernels. The build alone took 4
# minutes of a 7-minute call (session 4): give the sanitizers their own call, or run fewer steps.
#   bench/notes/fal-hopper.sh OUTDIR [BASE_TREE] [STEPS]
# STEPS: a comma list of build,tests,bench,peer,racecheck,memcheck,nosave,ncu (default: all, in that order;
# racecheck runs racecheck and synccheck on RACE_CASES, default the chunk-edge case; memcheck on MEM_CASES,
# default the chunk-edge and saved-states cases; nosave benches without saved states; each sanitizer run stops
# after SAN_S seconds, default 90).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
base=${2:-}
steps=,${3:-build,tests,bench,peer,racecheck,memcheck,nosave,ncu},
root=$(pwd)
cli=$root/build-gpu/lintape
tests=$root/build-gpu/tests/lintape_tests
cfg=(-G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release)
has() { [[ $steps == *,$1,* ]]; }
log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }

log "tree $(cat .stage-commit 2>/dev/null), base ${base:-none}; steps $steps"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv |
  tee -a "$out/summary.txt"
if has build; then
  if [ -n "$base" ]; then
    (cd "$base" && cmake -S . -B build-gpu "${cfg[@]}" && cmake --build build-gpu -j8 --target lintape) \
      >"$out/build-base.log" 2>&1 &
  fi
  (cmake -S . -B build-gpu "${cfg[@]}" && cmake --build build-gpu -j12 --target lintape lintape_tests) \
    >"$out/build.log" 2>&1
  log "build rc=$? ($(grep -c 'spill' "$out/build.log") spill lines)"
  wait
  [ -n "$base" ] && log "base build: $(tail -n1 "$out/build-base.log")"
fi
if has tests; then
  "$tests" -tc='*cuda*fal*' >"$out/tests.log" 2>&1
  log "FAL CUDA tests rc=$?: $(tail -n2 "$out/tests.log" | tr '\n' ' ')"
fi
bench() {  # label, cli, env...
  local label=$1 bin=$2
  shift 2
  env "$@" "$bin" bench fal-causal --n 2048,8192 --reps 5 >>"$out/bench.txt" 2>&1
  log "bench $label rc=$?"
}
if has bench; then
  echo "== new (walks), LINTAPE_FAL_STATE_PASS=new" >>"$out/bench.txt"
  bench new "$cli" LINTAPE_FAL_STATE_PASS=new
  echo "== old (slices), LINTAPE_FAL_STATE_PASS=old" >>"$out/bench.txt"
  bench old "$cli" LINTAPE_FAL_STATE_PASS=old
  if [ -n "$base" ]; then
    echo "== base" >>"$out/bench.txt"
    bench base "$root/$base/build-gpu/lintape"
  fi
fi
if has peer; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$root"/../../.whl/*.whl
  export PYTHONPATH=/tmp/site
  (cd bench/peers && python3 fal_peer.py --causal-only --kernel-only --ns 2048,8192 &&
    python3 fal_peer.py --causal-only --kernel-only --ns 2048,8192 --shape 16x6) >"$out/peer.txt" 2>&1
  log "peer rc=$?"
fi
if has racecheck; then
  for tool in racecheck synccheck; do
    timeout "${SAN_S:-90}" compute-sanitizer --tool $tool --error-exitcode 1 "$tests" \
      -tc="${RACE_CASES:-*cuda fal chunked causal state passes*}" >>"$out/sanitizer.log" 2>&1
    log "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -n1)"
  done
fi
if has memcheck; then
  timeout "${SAN_S:-90}" compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" \
    -tc="${MEM_CASES:-*cuda fal chunked causal state passes*,*cuda fal chunked causal saves*}" \
    >>"$out/sanitizer.log" 2>&1
  log "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -n1)"
fi
if has nosave; then
  echo "== new (walks), LINTAPE_FAL_SAVE_STATES=0 LINTAPE_FAL_STATE_PASS=new" >>"$out/bench.txt"
  bench new-nosave "$cli" LINTAPE_FAL_SAVE_STATES=0 LINTAPE_FAL_STATE_PASS=new
  echo "== old (slices), LINTAPE_FAL_SAVE_STATES=0 LINTAPE_FAL_STATE_PASS=old" >>"$out/bench.txt"
  bench old-nosave "$cli" LINTAPE_FAL_SAVE_STATES=0 LINTAPE_FAL_STATE_PASS=old
fi
if has ncu; then
  sections=(--section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
  for pass in new old; do  # the first reverse state pass of each kernel
    timeout "${NCU_S:-60}" env LINTAPE_FAL_STATE_PASS=$pass ncu --clock-control none "${sections[@]}" \
      -k regex:'walk_kernel|state_kernel' -c 1 "$cli" bench fal-causal --n 2048 --reps 1 >>"$out/ncu.txt" 2>&1
    log "ncu $pass rc=$?"
  done
fi
log done
