#!/usr/bin/env bash
# The TPA decode's one-block exit for short caches (notes: bench/notes/tpa-decode.md, session 11) and the TPA
# CUDA cases after the attention's workspace change, one call on the GPU machine over binaries built elsewhere
# (Release, sm_90a) carried in STAGE/lintape-bin.tgz: every TPA CUDA case; memcheck on the decode and attention
# cases that changed, racecheck and synccheck on the decode's cluster case; `lintape bench tpa-decode` at short
# caches with the exit and without (LINTAPE_TPA_DECODE_ALONE=0), replayed from CUDA graphs and eager; the
# cluster sizes 4, 8 and 16 at m 1024 and 2048.
#   bench/notes/tpa-decode-alone.sh OUTDIR STAGE
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
stage=$2
root=$(pwd)
mkdir -p "$root/build/tests"
tar xzf "$stage/lintape-bin.tgz" -C "$root/build"
mv "$root/build/lintape_tests" "$root/build/lintape_comm_checks" "$root/build/tests/" 2>/dev/null
export LD_LIBRARY_PATH=$root/build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cli=$root/build/lintape
tests=$root/build/tests/lintape_tests
log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }
counts() { grep -E '^\[doctest\] (test cases|assertions)' "$1" | tr '\n' ' '; }
log "tree $(cat "$stage/commit.txt" 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a "$out/summary.txt"

changed='*cuda tpa decode*,*cuda tpa documents: fused packed*,*cuda tpa attention split backward*'
timeout 300 "$tests" -tc='*cuda*tpa*' >"$out/tests.log" 2>&1 &
pids=($!)
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc="$changed" -tce='*seeds*' \
  >"$out/memcheck.log" 2>&1 &
pids+=($!)
for tool in racecheck synccheck; do
  timeout 300 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc='*cuda tpa decode cluster schedule matches*' \
    >"$out/$tool.log" 2>&1 &
  pids+=($!)
done
names=(tests memcheck racecheck synccheck)
for i in 0 1 2 3; do
  wait "${pids[$i]}"
  rc=$?
  log "${names[$i]} rc=$rc $(counts "$out/${names[$i]}.log") $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/${names[$i]}.log")"
done
cat "$out"/{memcheck,racecheck,synccheck}.log >"$out/sanitizer.log" && rm -f "$out"/{memcheck,racecheck,synccheck}.log

short=1,64,128,256,1024,2048
for round in 1 2; do
  for alone in 1 0; do
    for graph in --cuda-graph ""; do
      echo "=== round $round, LINTAPE_TPA_DECODE_ALONE=$alone ${graph:-eager}" >>"$out/bench.txt"
      LINTAPE_TPA_DECODE_ALONE=$alone timeout 90 "$cli" bench tpa-decode --n $short --metric speed --reps 20 $graph \
        >>"$out/bench.txt" 2>&1
      log "bench round $round alone=$alone ${graph:-eager} rc=$?"
    done
  done
done
for c in 4 8 16; do
  echo "=== LINTAPE_TPA_DECODE_CLUSTER=$c --cuda-graph" >>"$out/bench.txt"
  LINTAPE_TPA_DECODE_CLUSTER=$c timeout 90 "$cli" bench tpa-decode --n 1024,2048,8192 --metric speed --reps 20 \
    --cuda-graph >>"$out/bench.txt" 2>&1
  log "bench cluster $c rc=$?"
done
