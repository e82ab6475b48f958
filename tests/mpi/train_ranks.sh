#!/usr/bin/env bash
# Data-parallel training over MPI ranks on the CPU, run by ctest:
#   tests/mpi/train_ranks.sh LINTAPE WORKDIR SOURCE_DIR
# 1. Two ranks train `tiny` (a small shape) with the global batch of one rank: the losses match one
#    rank's within 1e-5 (relative), step by step.
#    The same with ZeRO-1 (--zero 1), whose peak memory per rank is lower by the moments' half.
#    The gradient all-reduce in many small buckets started during backward (--bucket-mib 0.01) gives
#    the same losses and gradient norms, bit for bit, as one bucket after backward (--bucket-mib 0);
#    with gradient accumulation (2 micro-batches) too, and then equals one rank within 1e-5.
# 2. Resume: a 2-rank checkpoint continues on 1 rank and a 1-rank checkpoint on 2 ranks; both give the
#    uninterrupted run's next losses.
# 3. Documents (--documents): each rank trains its rows with their own boundaries; within 1e-5 of one
#    rank, with and without accumulation (each micro-batch's loss weighs by its share of the targets).
# 4. A rank killed (SIGKILL) mid-run, and a rank stopped (SIGSTOP, so the other waits in a collective
#    until its timeout), make the job exit nonzero within 60 s.
set -uo pipefail
lintape=$1
work=$2
src=$3
mpirun=(mpirun --allow-run-as-root --oversubscribe)
rm -rf "$work" && mkdir -p "$work"
cat "$src"/README.md "$src"/docs/*.md "$src"/../shared/spec/*.md 2>/dev/null >"$work/text.txt"
failures=0
fail() {
  echo "FAILED: $*"
  failures=$((failures + 1))
}
train=(train --device cpu --preset tiny --data "$work/text.txt" --batch 4 --seq 64 --seed 3)

# step_losses LOG: "step loss" for each training row of a JSONL log
step_losses() {
  grep '"loss"' "$1" | while read -r row; do
    step=$(grep -o '"step":[0-9]*' <<<"$row" | cut -d: -f2)
    loss=$(grep -o '"loss":[-0-9.e+]*' <<<"$row" | cut -d: -f2)
    echo "$step $loss"
  done
}
# same A B FIRST LAST: the losses of steps FIRST..LAST agree within 1e-5 (relative)
same() {
  awk -v first="$3" -v last="$4" '
    NR == FNR { a[$1] = $2; next }
    { b[$1] = $2 }
    END {
      bad = 0
      for (s = first; s <= last; ++s) {
        d = a[s] - b[s]; if (d < 0) d = -d
        ok = (s in a) && (s in b) && d <= 1e-5 * (a[s] < 0 ? -a[s] : a[s])
        printf "  step %d: %s %s%s\n", s, a[s], b[s], ok ? "" : "  <- differs"
        if (!ok) bad = 1
      }
      exit bad
    }' <(step_losses "$1") <(step_losses "$2")
}

echo "== one rank and two ranks, the same global batch"
"$lintape" "${train[@]}" --steps 6 --log "$work/one/log.jsonl" --checkpoint-dir "$work/one/ck" \
  --checkpoint-every 3 >"$work/one.out" 2>&1 || fail "one rank: $(tail -n3 "$work/one.out")"
"${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 6 --log "$work/two/log.jsonl" --checkpoint-dir "$work/two/ck" \
  --checkpoint-every 3 >"$work/two.out" 2>&1 || fail "two ranks: $(tail -n3 "$work/two.out")"
grep -q "2 ranks" "$work/two.out" || fail "the two-rank run does not say it runs on 2 ranks"
grep -q '"peak_mem_mib_per_rank":\[[0-9.]*,[0-9.]*\]' "$work/two/log.jsonl" || fail "no per-rank peak memory in the log"
same "$work/one/log.jsonl" "$work/two/log.jsonl" 1 6 || fail "two ranks differ from one rank"

# exact A B: the same losses and gradient norms, bit for bit (the log's shortest round-trip decimals)
exact() {
  diff <(grep '"loss"' "$1" | grep -o '"grad_norm":[^,]*\|"loss":[^,]*\|"step":[0-9]*') \
    <(grep '"loss"' "$2" | grep -o '"grad_norm":[^,]*\|"loss":[^,]*\|"step":[0-9]*') >/dev/null
}
# buckets OUT: how many buckets the run's start line names
buckets() { grep -o 'in [0-9]* buckets\? started' "$1" | grep -o '[0-9]*'; }

echo "== the gradient all-reduce in buckets started during backward"
"${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 6 --bucket-mib 0.01 --log "$work/buckets/log.jsonl" \
  >"$work/buckets.out" 2>&1 || fail "small buckets: $(tail -n3 "$work/buckets.out")"
"${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 6 --bucket-mib 0 --log "$work/whole/log.jsonl" \
  >"$work/whole.out" 2>&1 || fail "one bucket: $(tail -n3 "$work/whole.out")"
echo "  buckets: $(buckets "$work/buckets.out") of 10 KiB, $(buckets "$work/whole.out") with --bucket-mib 0"
[ "$(buckets "$work/buckets.out")" -ge 10 ] 2>/dev/null || fail "--bucket-mib 0.01 does not give many buckets"
[ "$(buckets "$work/whole.out")" = 1 ] || fail "--bucket-mib 0 does not give one bucket"
exact "$work/buckets/log.jsonl" "$work/whole/log.jsonl" || fail "small buckets differ from one bucket"
same "$work/one/log.jsonl" "$work/buckets/log.jsonl" 1 6 || fail "two ranks with small buckets differ from one rank"
# Gradient accumulation over 2 micro-batches: only the last one's backward starts the buckets.
sed -n '/^  "config": {/,/^  },/p' "$work/one/log.summary.json" | sed '1s/.*/{/; $s/.*/}/' |
  sed 's/"grad_accum": 1,/"grad_accum": 2,/' >"$work/accum.json"
grep -q '"grad_accum": 2' "$work/accum.json" || fail "no gradient accumulation config made from the summary"
for run in one:1:0 buckets:2:0.01 whole:2:0; do
  IFS=: read -r name ranks mib <<<"$run"
  "${mpirun[@]}" -np "$ranks" "$lintape" train --device cpu --config "$work/accum.json" --steps 4 --bucket-mib "$mib" \
    --log "$work/accum-$name/log.jsonl" >"$work/accum-$name.out" 2>&1 || fail "accumulation, $name: $(tail -n3 "$work/accum-$name.out")"
done
exact "$work/accum-buckets/log.jsonl" "$work/accum-whole/log.jsonl" || fail "accumulation: small buckets differ from one"
same "$work/accum-one/log.jsonl" "$work/accum-buckets/log.jsonl" 1 4 || fail "accumulation: two ranks differ from one"

echo "== ZeRO-1: the AdamW moments sharded over two ranks"
"${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 6 --zero 1 --log "$work/zero/log.jsonl" \
  --checkpoint-dir "$work/zero/ck" --checkpoint-every 3 >"$work/zero.out" 2>&1 || fail "ZeRO-1: $(tail -n3 "$work/zero.out")"
same "$work/one/log.jsonl" "$work/zero/log.jsonl" 1 6 || fail "ZeRO-1 on two ranks differs from one rank"
# Peak memory per rank: below plain data parallel by at least 80% of the moments' half (m and v, float32),
# read at step 3, before the first checkpoint (which gathers the moments for a moment).
params=$(grep -o 'training [0-9]* parameters' "$work/two.out" | grep -o '[0-9]*')
peak() { grep '"loss"' "$1" | grep '"step":3[,}]' | grep -o '"peak_mem_mib":[0-9.]*' | cut -d: -f2; }
awk -v plain="$(peak "$work/two/log.jsonl")" -v zero="$(peak "$work/zero/log.jsonl")" -v p="$params" 'BEGIN {
  want = 0.8 * (2 * p * 4 / 2) / 1048576
  printf "  peak per rank: plain %.2f MiB, ZeRO-1 %.2f MiB; saved %.2f MiB, at least %.2f expected\n", plain, zero, plain - zero, want
  exit !(plain - zero >= want) }' || fail "ZeRO-1 does not save the moments' memory"
mkdir -p "$work/zero-on-one"
cp -r "$work/zero/ck" "$work/zero-on-one/ck" && printf 'step_00000003' >"$work/zero-on-one/ck/latest"
"$lintape" train --device cpu --resume --checkpoint-dir "$work/zero-on-one/ck" --steps 6 --log "$work/zero-on-one/log.jsonl" \
  >"$work/zero-on-one.out" 2>&1 || fail "resume a ZeRO-1 checkpoint on one rank: $(tail -n3 "$work/zero-on-one.out")"
same "$work/one/log.jsonl" "$work/zero-on-one/log.jsonl" 4 6 || fail "a ZeRO-1 checkpoint resumed on 1 rank differs"

echo "== resume with another number of ranks"
mkdir -p "$work/two-on-one" "$work/one-on-two"
cp -r "$work/two/ck" "$work/two-on-one/ck" && printf 'step_00000003' >"$work/two-on-one/ck/latest"
cp -r "$work/one/ck" "$work/one-on-two/ck" && printf 'step_00000003' >"$work/one-on-two/ck/latest"
"$lintape" train --device cpu --resume --checkpoint-dir "$work/two-on-one/ck" --steps 6 --log "$work/two-on-one/log.jsonl" \
  >"$work/two-on-one.out" 2>&1 || fail "resume on one rank: $(tail -n3 "$work/two-on-one.out")"
"${mpirun[@]}" -np 2 "$lintape" train --device cpu --resume --checkpoint-dir "$work/one-on-two/ck" --steps 6 \
  --log "$work/one-on-two/log.jsonl" >"$work/one-on-two.out" 2>&1 || fail "resume on two ranks: $(tail -n3 "$work/one-on-two.out")"
same "$work/one/log.jsonl" "$work/two-on-one/log.jsonl" 4 6 || fail "a 2-rank checkpoint resumed on 1 rank differs"
same "$work/one/log.jsonl" "$work/one-on-two/log.jsonl" 4 6 || fail "a 1-rank checkpoint resumed on 2 ranks differs"

echo "== documents: each rank's rows with their own boundaries"
"$lintape" "${train[@]}" --steps 3 --documents --log "$work/docs1/log.jsonl" >"$work/docs1.out" 2>&1 ||
  fail "documents, one rank: $(tail -n3 "$work/docs1.out")"
"${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 3 --documents --log "$work/docs2/log.jsonl" \
  >"$work/docs2.out" 2>&1 || fail "documents, two ranks: $(tail -n3 "$work/docs2.out")"
grep -q "rows packed from documents cut at blank lines" "$work/docs2.out" ||
  fail "the two-rank run does not say it packs documents"
same "$work/docs1/log.jsonl" "$work/docs2/log.jsonl" 1 3 || fail "documents: two ranks differ from one rank"
# With accumulation too: each micro-batch's loss weighs by its share of the targets (their counts differ).
for run in one:1 two:2; do
  IFS=: read -r name ranks <<<"$run"
  "${mpirun[@]}" -np "$ranks" "$lintape" train --device cpu --config "$work/accum.json" --steps 3 --documents \
    --log "$work/docs-accum-$name/log.jsonl" >"$work/docs-accum-$name.out" 2>&1 ||
    fail "documents with accumulation, $name: $(tail -n3 "$work/docs-accum-$name.out")"
done
same "$work/docs-accum-one/log.jsonl" "$work/docs-accum-two/log.jsonl" 1 3 ||
  fail "documents with accumulation: two ranks differ from one rank"

echo "== a rank that dies or stops ends the job"
for signal in KILL STOP; do
  LINTAPE_COMM_TIMEOUT_S=10 "${mpirun[@]}" -np 2 "$lintape" "${train[@]}" --steps 100000 \
    --log "$work/$signal/log.jsonl" >"$work/$signal.out" 2>&1 &
  job=$!
  for _ in $(seq 1 300); do  # until a few steps are logged
    [ "$(cat "$work/$signal/log.jsonl" 2>/dev/null | grep -c '"loss"')" -ge 2 ] && break
    sleep 0.2
  done
  victim=$(pgrep -f -n -- "--log $work/$signal/log.jsonl" | head -n1)
  # the newest process of the job is one of its ranks, not mpirun
  start=$(date +%s)
  kill -s "$signal" "$victim"
  wait "$job"
  rc=$?
  took=$(($(date +%s) - start))
  kill -s KILL "$victim" 2>/dev/null
  echo "  SIG$signal to rank process $victim: job exit status $rc after ${took} s"
  [ "$rc" -ne 0 ] || fail "SIG$signal: the job exited with status 0"
  [ "$took" -le 60 ] || fail "SIG$signal: the job took ${took} s to end"
done

[ "$failures" -eq 0 ] && echo "all passed" || echo "$failures FAILED"
exit "$failures"
