#!/usr/bin/env bash
# One device call (bench/notes/documents-fal-sweep.md): build this tree and main (main.tar beside it, from
# `git archive f234951`), the FAL CUDA cases, sanitizers on the new sweep cases, and `bench fal-causal` with
# and without documents (f32 and bf16: cosine on the chunk kernels, rotate on the sweep).
set -uo pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"
S="$O/summary.txt"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$S"
cfg() { cmake -S "$1" -B "$2" -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release; }
mkdir -p base && tar -xf main.tar -C base
( cfg . build-gpu && cmake --build build-gpu -j16 --target lintape_cli lintape_tests ) > "$O/build.log" 2>&1
echo "build ours rc=$? after $(el) s" | tee -a "$S"
( cfg base base/build-gpu && cmake --build base/build-gpu -j10 --target lintape_cli ) > "$O/build-main.log" 2>&1 &
p2=$!
T=build-gpu/tests/lintape_tests
timeout 120 $T -tc='*cuda*fal*' > "$O/tests.log" 2>&1
echo "fal cuda tests rc=$? after $(el) s" | tee -a "$S"
grep -E "test cases|assertions|FAILED|ERROR" "$O/tests.log" | head -20 | tee -a "$S"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
san() {
  local lim=$2
  [ "$lim" -gt 120 ] && lim=120
  [ "$lim" -lt 10 ] && { echo "sanitizer $1 skipped (no time)" | tee -a "$S"; return; }
  timeout "$lim" "$CS" --tool "$1" --error-exitcode 99 $T -tc="$3" > "$O/san-$1.log" 2>&1
  echo "sanitizer $1 ($3, limit $lim s) rc=$? after $(el) s" | tee -a "$S"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test cases" "$O/san-$1.log" | tail -3 | tee -a "$S"
}
san memcheck 100 '*cuda*fal*documents*sweep*'
wait $p2
echo "build main rc=$? after $(el) s" | tee -a "$S"
B="bench fal-causal --n 2048,8192 --metric speed --reps 10"
bench() { echo "=== $1 (start $(el) s)"; shift; timeout 75 "$@"; echo "=== rc $? (end $(el) s)"; }
{ bench "main f32" base/build-gpu/lintape $B --dtype f32
  bench "ours f32" build-gpu/lintape $B --dtype f32
  bench "ours f32 --documents 512" build-gpu/lintape $B --dtype f32 --documents 512
  bench "ours bf16" build-gpu/lintape $B
  bench "ours bf16 --documents 512" build-gpu/lintape $B --documents 512; } > "$O/bench.txt" 2>&1
echo "bench done after $(el) s" | tee -a "$S"
san racecheck $(( 400 - $(el) )) '*cuda*fal*documents*sweep equals*'
left=$(( 405 - $(el) ))
if [ $left -gt 20 ]; then
  { echo "=== main bf16 (start $(el) s)"; timeout $left base/build-gpu/lintape $B; } >> "$O/bench.txt" 2>&1
fi
echo "all done after $(el) s" | tee -a "$S"
true
