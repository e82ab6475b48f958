#!/usr/bin/env bash
# One device call (bench/notes/documents-fal.md): build this tree and main (4a3c4a9, from `git archive` into
# main-4a3c4a9/), the FAL CUDA cases, the benches with and without documents, sanitizers on the new cases.
set -uo pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"
S="$O/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$S"
t0=$(date +%s)
cfg() { cmake -S "$1" -B "$2" -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release; }
( cfg . build-gpu && cmake --build build-gpu -j11 --target lintape_cli lintape_tests ) > "$O/build.log" 2>&1 &
p1=$!
( cfg main-4a3c4a9 main-4a3c4a9/build-gpu && cmake --build main-4a3c4a9/build-gpu -j5 --target lintape_cli ) > "$O/build-main.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "build ours rc=$r1 main rc=$r2 after $(( $(date +%s) - t0 )) s" | tee -a "$S"
T=build-gpu/tests/lintape_tests
timeout 150 $T -tc='*cuda*fal*' > "$O/tests.log" 2>&1; echo "fal cuda tests rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$S"
grep -E "test cases|assertions" "$O/tests.log" | tee -a "$S"
B="bench fal-causal --n 2048,8192 --metric speed"
el() { echo $(( $(date +%s) - t0 )); }
bench() { echo "=== $1"; shift; timeout 100 "$@"; }
for i in 1 2; do
  { bench "main no documents ($i)" main-4a3c4a9/build-gpu/lintape $B
    bench "ours no documents ($i)" build-gpu/lintape $B
    bench "ours --documents 512 ($i)" build-gpu/lintape $B --documents 512; } >> "$O/bench.txt" 2>&1
done
echo "bench done after $(el) s" | tee -a "$S"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
san() {
  timeout $2 $CS --tool $1 --error-exitcode 99 $T -tc="$3" > "$O/san-$1.log" 2>&1
  echo "sanitizer $1 ($3) rc=$? after $(el) s" | tee -a "$S"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test cases" "$O/san-$1.log" | tail -2 | tee -a "$S"
}
san racecheck 80 '*cuda*fal*documents*long rows*'
san memcheck $(( 395 - $(el) )) '*cuda*fal*'
true
