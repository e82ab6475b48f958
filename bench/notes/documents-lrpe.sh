#!/usr/bin/env bash
# The GPU check of bench/notes/documents-lrpe.md, from the root of a staged tree: build, the LRPE and
# documents CUDA tests, the sanitizers on the documents launcher cases, and the LRPE benches with and without
# documents (softmax over the sequence and over features among them), and a variant of the rotate backward's
# register bound with documents; logs into $OUT.
set -uo pipefail
out=${OUT:?}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
t0=$SECONDS
(cmake -S . -B build-gpu -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release &&
  cmake --build build-gpu -j16 --target lintape_tests lintape_cli) >"$out/build.log" 2>&1
echo "build rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
# The variant measured beside it: rotate's documents backward behind a feature softmax bounded for 6 blocks
# (80 registers, 24 warps per SM, spilling 32 bytes) instead of 5 (96, 20 warps, 4 bytes).
var=/tmp/lrpe-var
mkdir -p $var && tar --exclude=./build-gpu -cf - . | tar -xf - -C $var
sed -i 's/return ROT \&\& CLS != kNoAct ? 5 : 6;/return ROT \&\& CLS != kNoAct \&\& CLS != kFeature ? 5 : 6;/' $var/ops/lrpe/rows.cu
grep -c "CLS != kFeature ? 5" $var/ops/lrpe/rows.cu | tee -a "$out/device.txt"
(cmake -S $var -B $var/build-gpu -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release &&
  cmake --build $var/build-gpu -j14 --target lintape_cli) >"$out/build-var.log" 2>&1 &
pvar=$!
T=build-gpu/tests/lintape_tests
cli=build-gpu/lintape
timeout 100 "$T" -tc='*cuda*lrpe*' >"$out/tests.log" 2>&1
echo "tests lrpe rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
timeout 60 "$T" -tc='*cuda*documents*' >>"$out/tests.log" 2>&1
echo "tests documents rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
grep -E "test cases:|assertions:" "$out/tests.log" | tee -a "$out/device.txt"
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
cases='*cuda lrpe documents: launchers*,*cuda lrpe documents: softmax over the sequence*'
timeout 120 "$san" --tool memcheck --error-exitcode 99 "$T" -tc="$cases" >"$out/sanitizer.log" 2>&1
echo "memcheck rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
timeout 100 "$san" --tool racecheck --error-exitcode 99 "$T" -tc="$cases" >>"$out/sanitizer.log" 2>&1
echo "racecheck rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test cases:" "$out/sanitizer.log" | tee -a "$out/device.txt"
b() {  # op, flags...
  local op=$1
  shift
  echo "##### $op $*" >>"$out/bench.txt"
  timeout 60 "$cli" bench "$op" --metric speed "$@" >>"$out/bench.txt" 2>&1
  echo "bench $op $* rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
}
wait $pvar
echo "variant build rc $? at $((SECONDS - t0)) s" | tee -a "$out/device.txt"
for op in lrpe-rotate lrpe-cosine; do
  b $op --n 1024,4096,16384 --reps 20
  b $op --n 1024,4096,16384 --reps 20 --documents 512
done
cli=$var/build-gpu/lintape
b lrpe-rotate --mode bwd --n 1024,4096,16384 --reps 20 --documents 512
b lrpe-rotate --mode bwd --n 1024,4096,16384 --reps 20
cli=build-gpu/lintape
[ $((SECONDS - t0)) -lt 330 ] && b lrpe-rotate --mode bwd --n 1024,4096,16384 --reps 20 --documents 512
[ $((SECONDS - t0)) -lt 360 ] && b lrpe-rotate --mode bwd --n 1024,4096,16384 --reps 20
