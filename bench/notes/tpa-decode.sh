#!/usr/bin/env bash
# The TPA decode schedules' device check (notes: bench/notes/tpa-decode.md), one call on the GPU machine:
# builds this tree, runs the TPA CUDA cases (the decode ones again under the cluster schedule), times
# `lintape bench tpa-decode` under each schedule (LINTAPE_TPA_DECODE_CLUSTER), runs the PyTorch peer,
# compute-sanitizer on the decode cases and ncu on the kernel.
#   bench/notes/tpa-decode.sh OUTDIR [STEPS] [SCHEDULES]
# STEPS: a comma list of build,tests,bench,ncu,peer (default: all, in that order).
# SCHEDULES: LINTAPE_TPA_DECODE_CLUSTER values to time (default 8,16,0; the first two at every m).
# The correctness runs share the GPU, all at once: the TPA CUDA cases with the default schedule, the decode
# cases again under each of OTHER_SCHEDULES (default 0 16), memcheck, racecheck and synccheck under
# CHECK_SCHEDULE (default 16; memcheck on the decode cases, the other two on RACE_CASES). ncu on
# NCU_SCHEDULES x NCU_MS (default 16 x 2048 8192, batch 8), with the warp-stall samples per source line.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
steps=,${2:-build,tests,bench,ncu,peer},
schedules=${3:-8,16,0}
root=$(pwd)
cli=$root/build-gpu/lintape
tests=$root/build-gpu/tests/lintape_tests
cfg=(-G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release)
has() { [[ $steps == *,$1,* ]]; }
log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }
counts() { grep -E '^\[doctest\] (test cases|assertions)' "$1" | tr '\n' ' '; }
decode_cases='*cuda tpa decode*'
race_cases=${RACE_CASES:-*cuda tpa decode schedules: one*}
check=${CHECK_SCHEDULE:-16}

log "tree $(cat .stage-commit 2>/dev/null); steps $steps; schedules $schedules"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv |
  tee -a "$out/summary.txt"
if has build; then
  (cmake -S . -B build-gpu "${cfg[@]}" && cmake --build build-gpu -j16 --target lintape_cli lintape_tests) \
    >"$out/build.log" 2>&1
  log "build rc=$? ($(grep -c 'spill' "$out/build.log") spill lines)"
fi
if has tests; then  # correctness only: every run shares the GPU
  declare -A jobs=()
  timeout 150 "$tests" -tc='*cuda*tpa*' >"$out/tests.log" 2>&1 &
  jobs[tests]=$!
  for c in ${OTHER_SCHEDULES:-0 16}; do
    LINTAPE_TPA_DECODE_CLUSTER=$c timeout 150 "$tests" -tc="$decode_cases" >"$out/tests-$c.log" 2>&1 &
    jobs[tests-$c]=$!
  done
  export LINTAPE_TPA_DECODE_CLUSTER=$check
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc="$decode_cases" -tce='*seeds*' \
    >"$out/memcheck.log" 2>&1 &
  jobs[memcheck]=$!
  for tool in racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc="$race_cases" -tce='*seeds*' \
      >"$out/$tool.log" 2>&1 &
    jobs[$tool]=$!
  done
  unset LINTAPE_TPA_DECODE_CLUSTER
  for name in tests ${OTHER_SCHEDULES:-0 16}; do
    [ "$name" = tests ] && key=tests || key=tests-$name
    wait "${jobs[$key]}"
    log "$key rc=$?: $(counts "$out/$key.log")"
  done
  wait "${jobs[memcheck]}"
  log "memcheck (decode cases, cluster $check) rc=$?: $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -n1)"
  wait "${jobs[racecheck]}"
  log "racecheck (cluster $check) rc=$?: $(grep -E 'RACECHECK SUMMARY' "$out/racecheck.log" | tail -n1) \
$(counts "$out/racecheck.log")"
  wait "${jobs[synccheck]}"
  log "synccheck (cluster $check) rc=$?: $(grep -E 'ERROR SUMMARY' "$out/synccheck.log" | tail -n1) \
$(counts "$out/synccheck.log")"
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
  # The fixed part alone: caches of 1 to 128 rows (one block, at most two tiles, a sequence).
  echo "== LINTAPE_TPA_DECODE_CLUSTER=16, short caches" >>"$out/bench.txt"
  LINTAPE_TPA_DECODE_CLUSTER=16 timeout 60 "$cli" bench tpa-decode --reps 10 --metric speed --n 1,64,128 \
    >>"$out/bench.txt" 2>&1
  log "bench short caches rc=$?"
fi
if has ncu; then
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
            --section WarpStateStats --section SourceCounters)
  for c in ${NCU_SCHEDULES:-16}; do
    for m in ${NCU_MS:-2048 8192}; do
      echo "== cluster $c, m $m (B = 8)" >>"$out/ncu.txt"
      LINTAPE_TPA_DECODE_CLUSTER=$c timeout 90 ncu --clock-control none "${sections[@]}" -k regex:decode_tc -s 1 \
        -c 1 --import-source yes -o "$out/ncu-$c-$m" "$cli" bench tpa-decode --n $m --reps 1 --metric speed \
        >>"$out/ncu.txt" 2>&1
      ncu -i "$out/ncu-$c-$m.ncu-rep" --page details >>"$out/ncu.txt" 2>&1
      # Warp-stall samples per CUDA source line and per SASS instruction (the kernel is built with -lineinfo).
      ncu -i "$out/ncu-$c-$m.ncu-rep" --page source --csv --print-source cuda >"$out/ncu-$c-$m-cuda.csv" 2>&1
      ncu -i "$out/ncu-$c-$m.ncu-rep" --page source --csv --print-source sass >"$out/ncu-$c-$m-sass.csv" 2>&1
      log "ncu cluster=$c m=$m: $(grep -E 'Duration' "$out/ncu.txt" | tail -n1 | tr -s ' ')"
    done
  done
fi
if has peer; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$root"/../../.whl/*.whl >/dev/null 2>&1
  (cd bench/peers && PYTHONPATH=/tmp/site timeout 120 python3 tpa_peer.py --attention-ns 1024 \
    --decode-ms 2048,8192,32768) >"$out/peer.txt" 2>&1
  log "peer rc=$?"
fi
log "done"
