#!/usr/bin/env bash
# FAL rotate on the chunk kernels (notes: bench/notes/fal-rotate.md), one call on the GPU machine: builds this
# tree (Release, sm_90a), runs the rotate cases and the FAL CUDA cases around them, compute-sanitizer memcheck on
# the rotate cases, then `lintape bench fal-causal` (its last table is rotate at B 16, H 6).
#   bench/notes/fal-rotate.sh OUTDIR [STEPS]
# STEPS: a comma list of build,tests,memcheck,bench (default: all, in that order; memcheck stops after SAN_S
# seconds, default 120).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
steps=,${2:-build,tests,memcheck,bench},
cli=build-gpu/lintape
tests=build-gpu/tests/lintape_tests
rotate_cases='*cuda fal rotate*,*cuda fal documents rotate*'
has() { [[ $steps == *,$1,* ]]; }
log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }

log "tree $(cat .stage-commit 2>/dev/null); steps $steps"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$out/summary.txt"
if has build; then
  (cmake -S . -B build-gpu -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build-gpu -j16 --target lintape_cli lintape_tests) >"$out/build.log" 2>&1
  log "build rc=$?"
fi
if has tests; then
  "$tests" -tc="$rotate_cases" >"$out/tests.log" 2>&1
  log "rotate cases rc=$?: $(tail -n2 "$out/tests.log" | tr '\n' ' ')"
  "$tests" -tc='*cuda*fal*' -tce="$rotate_cases" >>"$out/tests.log" 2>&1
  log "other FAL CUDA cases rc=$?: $(tail -n2 "$out/tests.log" | tr '\n' ' ')"
fi
if has memcheck; then
  timeout "${SAN_S:-120}" compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" \
    -tc='*cuda fal rotate noncausal*,*cuda fal rotate on the chunk kernels reads*,*cuda fal documents rotate*' \
    >"$out/sanitizer.log" 2>&1
  log "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -n1)"
fi
if has bench; then
  "$cli" bench fal-causal --n 2048,8192 --reps 5 >"$out/bench.txt" 2>&1
  log "bench rc=$?"
fi
log done
