#!/usr/bin/env bash
# The whole GPU check in one command, on the GPU machine: configure for Hopper (sm_90a) with Ninja, build,
# run every test (CUDA included), run compute-sanitizer memcheck, racecheck and synccheck over the CUDA test cases,
# then `lintape info` and the quick benchmarks. Every step runs even when an earlier one failed; the
# exit status is nonzero if any failed.
#
#   scripts/gpu-check.sh OUTDIR [OP ...] [BENCH FLAGS ...]
#     OP ...        benchmarks to run (default: all), e.g.  scripts/gpu-check.sh out matmul copy
#     BENCH FLAGS   passed on to every `lintape bench`, e.g. --n 1024,4096 --dtype f32
#
# OUTDIR receives 7 files: summary.txt (device, test counts, sanitizer verdicts, copy bandwidth, matmul
# TFLOP/s), build.log, tests.log, sanitizer.log, bench.txt, bench.json and svg.tar.gz (every SVG plot); on a
# machine with two or more GPUs and mpirun also ranks.log (NCCL checks, 1 and 2 GPU training tokens/s).
# The build folder is build-gpu/ in the repository (LINTAPE_GPU_BUILD overrides it); a second run
# rebuilds only what changed. The sanitizers run the doctest cases matching LINTAPE_SANITIZE_CASES
# (default '*cuda*'; racecheck over every case takes longer than one device call, so narrow it to the
# kernels that changed, e.g. '*cuda*tpa*', or for FAL '*for the sanitizers*': the FAL kernels once at small
# shapes, about 30 s under racecheck on an H200).
set -uo pipefail

if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" && out=$(cd "$1" && pwd)
shift
ops=()
while [ $# -gt 0 ] && [[ $1 != -* ]]; do
  ops+=("$1")
  shift
done
[ ${#ops[@]} -gt 0 ] || ops=(all)
bench_flags=("$@")

build=${LINTAPE_GPU_BUILD:-$root/build-gpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -f "$out"/{summary.txt,build.log,tests.log,sanitizer.log,ranks.log,bench.txt,bench.json,svg.tar.gz}
failed=()

note() { echo "$*" | tee -a "$out/summary.txt"; }
# step NAME LOG COMMAND...: runs COMMAND with its output appended to LOG, and records the verdict.
step() {
  local name=$1 log=$2 rc
  shift 2
  echo "== $name: $*" >>"$log"
  "$@" >>"$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    note "$name: ok"
  else
    note "$name: FAILED (exit $rc; see $(basename "$log"))"
    failed+=("$name")
  fi
  return $rc
}

commit=${LINTAPE_COMMIT:-unknown}  # the device copy of the tree has no .git: the caller may pass it
if rev=$(git -C "$root" rev-parse --short HEAD 2>/dev/null); then
  commit=$rev
  git -C "$root" diff --quiet HEAD 2>/dev/null || commit+=" with local changes"
fi
note "lintape GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit"
note "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | paste -sd ';' || echo 'nvidia-smi failed')"
nvidia-smi

# -- build
step configure "$out/build.log" cmake -S "$root" -B "$build" -G Ninja -DLINTAPE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release
step build "$out/build.log" cmake --build "$build" -j16
tests=$build/tests/lintape_tests
cli=$build/lintape

# -- tests
nvidia-smi >>"$out/tests.log" 2>&1
step tests "$out/tests.log" ctest --test-dir "$build" -j8 --timeout 900 --output-on-failure
note "  $(grep -E 'tests passed(,| out of)' "$out/tests.log" | tail -n1 || echo 'no ctest summary')"
note "  skipped: $(grep -c '(Skipped)' "$out/tests.log"), CUDA test cases: $("$tests" -ltc -tc='*cuda*' 2>/dev/null | grep -oE '[0-9]+$' | tail -n1)"

# -- compute-sanitizer over the CUDA test cases, but the one that asks cudaMalloc for more than the card has
# on purpose (the sanitizer would report its expected out-of-memory error). synccheck also leaves out the two TPA
# decode cases that force several clusters of 16 blocks a sequence at B 8: there it reports divergent warps at
# barriers every thread reaches, as it does for a kernel of nothing but uniform loops, __syncthreads and one cluster
# barrier (bench/notes/cluster-sync-probe.cu; bench/notes/tpa-decode.md, session 25). memcheck and racecheck run them.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck synccheck; do
  skip='*cuda out of memory*'
  [ "$tool" = synccheck ] && skip+=',*tpa decode cluster schedule matches*,*tpa decode schedules: two head slices*'
  step "compute-sanitizer $tool" "$out/sanitizer.log" \
    "$sanitizer" --tool "$tool" --error-exitcode 99 "$tests" -tc="${LINTAPE_SANITIZE_CASES:-*cuda*}" -tce="$skip"
  case $? in
    0) ;;
    99) note "  the sanitizer found errors" ;;
    *) note "  a test failed or crashed under the sanitizer" ;;
  esac
  note "  $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -n1 | sed 's/^=* *//' || true)"
done

# -- several GPUs: with two or more and mpirun, the NCCL collectives on two ranks, then the small model's
# tokens/s on one GPU and on two at the same per-GPU batch, with and without ZeRO-1 (mqar: no data file).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ] && command -v mpirun >/dev/null; then
  mpirun=(mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE=0)
  step "nccl collectives, 2 ranks" "$out/ranks.log" "${mpirun[@]}" "$build/tests/lintape_comm_checks" cuda
  # The step's CUDA graph on two ranks equals the eager queued step, and many small gradient buckets
  # (started during backward, inside the graph) equal one, bit for bit (two ranks sum a + b either way).
  bits=(train --preset tiny --data mqar --batch 16 --seq 256 --steps 6 --seed 7)
  for run in "graph:--bucket-mib 0" "eager:--bucket-mib 0 --no-cuda-graph" "buckets:--bucket-mib 0.05"; do
    # shellcheck disable=SC2086  # the run's flags are split on purpose
    step "train bits, 2 GPUs, ${run%%:*}" "$out/ranks.log" "${mpirun[@]}" "$cli" "${bits[@]}" ${run#*:} \
      --log "$work/bits-${run%%:*}.jsonl"
  done
  same_losses() { [ -s "$work/bits-$1.jsonl" ] && cmp -s <(grep -o '"loss":[^,]*,"lr"' "$work/bits-$1.jsonl") \
    <(grep -o '"loss":[^,]*,"lr"' "$work/bits-$2.jsonl"); }
  step "2 GPUs: graph == eager, bit for bit" "$out/ranks.log" same_losses graph eager
  step "2 GPUs: buckets in the graph == one bucket, bit for bit" "$out/ranks.log" same_losses buckets graph
  small=(train --preset small --data mqar --seq 2048 --steps 25 --seed 3)
  step "train, 1 GPU, batch 16" "$out/ranks.log" "$cli" "${small[@]}" --batch 16
  step "train, 2 GPUs, batch 32" "$out/ranks.log" "${mpirun[@]}" "$cli" "${small[@]}" --batch 32
  step "train, 2 GPUs, batch 32, ZeRO-1" "$out/ranks.log" "${mpirun[@]}" "$cli" "${small[@]}" --batch 32 --zero 1
  step "train, 2 GPUs, batch 32, one bucket" "$out/ranks.log" "${mpirun[@]}" "$cli" "${small[@]}" --batch 32 \
    --bucket-mib 0
  grep -E '^loss .* tok/s' "$out/ranks.log" | sed 's/^/  /' | tee -a "$out/summary.txt"
else
  note "several GPUs: skipped (${gpus:-0} GPU, or no mpirun)"
fi

# -- info and the quick benchmarks
step info "$out/bench.txt" "$cli" info
for op in "${ops[@]}"; do
  step "bench $op" "$out/bench.txt" "$cli" bench "$op" --quick --json "$work/bench-$op.json" "${bench_flags[@]}"
done
jsons=("$work"/bench-*.json)
if [ -e "${jsons[0]}" ]; then
  if [ ${#jsons[@]} -eq 1 ]; then
    cp "${jsons[0]}" "$out/bench.json"
  else  # one document: the first run's fields, every run's rows
    python3 -c 'import json, sys
docs = [json.load(open(p)) for p in sys.argv[1:]]
docs[0]["rows"] = [r for d in docs for r in d["rows"]]
json.dump(docs[0], sys.stdout, indent=1)' "${jsons[@]}" >"$out/bench.json" || failed+=("merge bench json")
  fi
fi
svgs=$(cd "$work" && ls -- *.plots/*.svg 2>/dev/null)
if [ -n "$svgs" ]; then
  (cd "$work" && tar -czf "$out/svg.tar.gz" -- *.plots)
fi
note "svg plots: $(echo "$svgs" | grep -c . || true)"

copy=$(grep -m1 -oE 'copy bandwidth: [0-9.]+ GB/s' "$out/bench.txt" | grep -oE '[0-9.]+' | head -n1)
if [ -n "$copy" ]; then
  note "copy: $(awk -v g="$copy" 'BEGIN { printf "%.2f", g / 1000 }') TB/s (device-to-device, bytes read + written)"
else
  note "copy: not measured"
fi
matmul=$(awk '/^matmul-speed/ { p = 1 } p { print } /^$/ { p = 0 }' "$out/bench.txt")
[ -z "$matmul" ] || note "$matmul"

if [ ${#failed[@]} -eq 0 ]; then
  note "verdict: PASSED"
else
  note "verdict: FAILED: ${failed[*]}"
  exit 1
fi
