#!/usr/bin/env bash
# The TPA decode schedules' device check (notes: bench/notes/tpa-decode.md), one call on the GPU machine:
# builds this tree, runs the TPA CUDA cases (the decode ones again under the cluster schedule), times
# `lintape bench tpa-decode` under each schedule (LINTAPE_TPA_DECODE_CLUSTER), runs the PyTorch peer,
# compute-sanitizer on the decode cases and ncu on the kernel.
#   bench/notes/tpa-decode.sh OUTDIR [STEPS] [SCHEDULES]
# STEPS: a comma list of build,tests,bench,peer,ncu,memcheck,racecheck (default: all, in that order).
# SCHEDULES: LINTAPE_TPA_DECODE_CLUSTER values to time (default 0,8,1,4; the first two at every m).
# The tests run with the default schedule and again (the decode cases) with OTHER_SCHEDULE (default 0),
# memcheck beside them; racecheck and synccheck together on RACE_CASES (default the decode cases); ncu on
# NCU_SCHEDULES x NCU_MS (default 0 8 x 2048 8192, batch 8).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
steps=,${2:-build,tests,bench,peer,ncu,memcheck,racecheck},
schedules=${3:-0,8,1,4}
root=$(pwd)
cli=$root/build-gpu/lintape
tests=$root/build-gpu/tests/lintape_tests
cfg=(-G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release)
has() { [[ $steps == *,$1,* ]]; }
log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }
decode_cases='*cuda tpa decode*'

log "tree $(cat .stage-commit 2>/dev/null); steps $steps; schedules $schedules"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv |
  tee -a "$out/summary.txt"
if has build; then
  (cmake -S . -B build-gpu "${cfg[@]}" && cmake --build build-gpu -j16 --target lintape lintape_tests) \
    >"$out/build.log" 2>&1
  log "build rc=$? ($(grep -c 'spill' "$out/build.log") spill lines)"
fi
if has tests; then  # correctness only: the three runs share the GPU
  timeout 150 "$tests" -tc='*cuda*tpa*' >"$out/tests.log" 2>&1 &
  p1=$!
  LINTAPE_TPA_DECODE_CLUSTER=${OTHER_SCHEDULE:-0} timeout 100 "$tests" -tc="$decode_cases" \
    >"$out/tests-other.log" 2>&1 &
  p2=$!
  if has memcheck; then
    LINTAPE_TPA_DECODE_CLUSTER=8 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" \
      -tc="$decode_cases" -tce='*seeds*' >>"$out/sanitizer.log" 2>&1 &
    p3=$!
  fi
  wait $p1
  log "TPA CUDA tests rc=$?: $(grep -E '^\[doctest\] (test cases|assertions)' "$out/tests.log" | tr '\n' ' ')"
  wait $p2
  log "decode cases, LINTAPE_TPA_DECODE_CLUSTER=${OTHER_SCHEDULE:-0} rc=$?: \
$(grep -E '^\[doctest\] (test cases|assertions)' "$out/tests-other.log" | tr '\n' ' ')"
  if has memcheck; then
    wait $p3
    log "memcheck (decode cases, cluster 8) rc=$?: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -n1)"
  fi
fi
if has bench; then
  first=1
  for c in ${schedules//,/ }; do
    n=()
    [ $first -le 2 ] || n=(--n 256,2048,8192,32768)
    echo "== LINTAPE_TPA_DECODE_CLUSTER=$c" >>"$out/bench.txt"
    LINTAPE_TPA_DECODE_CLUSTER=$c timeout 90 "$cli" bench tpa-decode --reps 10 --metric speed "${n[@]}" \
      >>"$out/bench.txt" 2>&1
    log "bench cluster=$c rc=$?"
    first=$((first + 1))
  done
fi
if has peer; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$root"/../../.whl/*.whl >/dev/null 2>&1
  (cd bench/peers && PYTHONPATH=/tmp/site timeout 150 python3 tpa_peer.py --attention-ns 1024 \
    --decode-ms 2048,8192,32768) >"$out/peer.txt" 2>&1
  log "peer rc=$?"
fi
if has ncu; then
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
            --section WarpStateStats)
  for c in ${NCU_SCHEDULES:-0 8}; do
    for m in ${NCU_MS:-2048 8192}; do
      echo "== cluster $c, m $m (B = 8)" >>"$out/ncu.txt"
      LINTAPE_TPA_DECODE_CLUSTER=$c timeout 60 ncu --clock-control none "${sections[@]}" -k regex:decode_tc -c 1 \
        "$cli" bench tpa-decode --n $m --reps 1 --metric speed >>"$out/ncu.txt" 2>&1
      log "ncu cluster=$c m=$m rc=$?: $(grep -E 'Duration' "$out/ncu.txt" | tail -n1 | tr -s ' ')"
    done
  done
fi
if has racecheck; then  # both tools at once
  pids=()
  for tool in racecheck synccheck; do
    timeout 100 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc="${RACE_CASES:-$decode_cases}" \
      -tce='*seeds*' >"$out/$tool.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}"
  log "racecheck rc=$?: $(grep -E 'RACECHECK SUMMARY' "$out/racecheck.log" | tail -n1)"
  wait "${pids[1]}"
  log "synccheck rc=$?: $(grep -E 'ERROR SUMMARY' "$out/synccheck.log" | tail -n1)"
fi
log "done"
