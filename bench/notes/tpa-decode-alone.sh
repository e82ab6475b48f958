#!/usr/bin/env bash
# The TPA decode's one-block exit for short caches (notes: bench/notes/tpa-decode.md, session 11) and the TPA
# CUDA cases after the attention's workspace change, one call on the GPU machine over binaries built elsewhere
# (Release, sm_90a) carried in STAGE/lintape-bin.tgz: every TPA CUDA case; memcheck on the decode and attention
# cases that changed, racecheck and synccheck on the decode's cluster case; `lintape bench tpa-decode` at short
# caches, replayed from CUDA graphs and eager, twice; the cluster sizes 4, 8 and 16 at m 1024, 2048 and 8192.
# (Session 11's call 3 ran it on 01cebfd, whose LINTAPE_TPA_DECODE_ALONE=0 turned the exit off for the comparison;
# the switch is gone since, so the rounds now time the exit alone.)
#   bench/notes/tpa-decode-alone.sh OUTDIR STAGE
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
stage=$2
. "$(dirname "$0")/staged.sh"
sanitize '*cuda tpa decode*,*cuda tpa documents: fused packed*,*cuda tpa attention split backward*' \
  '*cuda tpa decode cluster schedule matches*'

short=1,64,128,256,1024,2048
for round in 1 2; do
  for graph in --cuda-graph ""; do
    echo "=== round $round ${graph:-eager}" >>"$out/bench.txt"
    timeout 90 "$cli" bench tpa-decode --n $short --metric speed --reps 20 $graph >>"$out/bench.txt" 2>&1
    log "bench round $round ${graph:-eager} rc=$?"
  done
done
for c in 4 8 16; do
  echo "=== LINTAPE_TPA_DECODE_CLUSTER=$c --cuda-graph" >>"$out/bench.txt"
  LINTAPE_TPA_DECODE_CLUSTER=$c timeout 90 "$cli" bench tpa-decode --n 1024,2048,8192 --metric speed --reps 20 \
    --cuda-graph >>"$out/bench.txt" 2>&1
  log "bench cluster $c rc=$?"
done
