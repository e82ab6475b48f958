#!/usr/bin/env bash
# The documents check on the GPU machine (bench/notes/documents-lrpe-tpa.md), from the root of a staged tree
# with main 4a3c4a9 in base/: build both, the LRPE/TPA/documents CUDA tests, the sanitizers on the new cases,
# the LRPE and TPA benches with and without documents and main's without; logs into $OUT.
set -uo pipefail
out=${OUT:?}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
cfg=(-G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release)
t0=$SECONDS
(cmake -S . -B build-gpu "${cfg[@]}" && cmake --build build-gpu -j11) >"$out/build.log" 2>&1 &
p1=$!
(cmake -S base -B base/build-gpu "${cfg[@]}" && cmake --build base/build-gpu -j5 --target lintape_cli) >"$out/build-base.log" 2>&1 &
p2=$!
wait $p1; echo "build rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
T=build-gpu/tests/lintape_tests
cli=build-gpu/lintape
timeout 90 "$T" -tc='*cuda*lrpe*,*cuda*tpa*,*documents*' >"$out/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
tail -4 "$out/tests.log" | tee -a "$out/device.txt"
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 60 "$san" --tool memcheck --error-exitcode 99 "$T" -tc='*cuda*documents*' >"$out/sanitizer.log" 2>&1
echo "memcheck rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
timeout 40 "$san" --tool racecheck --error-exitcode 99 "$T" \
  -tc='*cuda tpa documents: fused launchers*,*cuda lrpe documents: launchers*' >>"$out/sanitizer.log" 2>&1
echo "racecheck rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test cases:" "$out/sanitizer.log" | tee -a "$out/device.txt"
wait $p2; echo "base build rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
b() {  # label, cli, op, flags...
  local label=$1 c=$2 op=$3; shift 3
  echo "##### $label $op $*" >>"$out/bench.txt"
  timeout 45 "$c" bench "$op" --metric speed "$@" >>"$out/bench.txt" 2>&1
  echo "bench $label $op $* rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
}
for op in lrpe-cosine lrpe-rotate; do
  for rep in 1 2; do
    b main base/build-gpu/lintape $op --n 16384 --reps 30
    b this "$cli" $op --n 16384 --reps 30
    b this "$cli" $op --n 16384 --reps 30 --documents 512
  done
done
b main base/build-gpu/lintape tpa-attention --n 4096,8192 --reps 10
b this "$cli" tpa-attention --n 4096,8192 --reps 10
b this "$cli" tpa-attention --n 4096,8192 --reps 10 --documents 512
