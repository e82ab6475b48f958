#!/usr/bin/env bash
# The TPA attention's workspace floor against its speed (notes: bench/notes/tpa-hopper.md, section 10), one call
# on the GPU machine over binaries built elsewhere (Release, sm_90a) and carried in STAGE/lintape-bin.tgz:
# every TPA CUDA case; memcheck, racecheck and synccheck on the several-launches and split-backward cases; then
# `lintape bench tpa-attention` (forward and backward, speed and memory) under each LINTAPE_TPA_WORKSPACE_MIB
# of FLOORS (0: the built-in floor), the PyTorch peer (einsum + SDPA) in the same call, and the small model's
# training step with TPA mixers (`bench train`) under the first two floors.
#   bench/notes/tpa-memory.sh OUTDIR STAGE [FLOORS] [NS]
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
stage=$2
floors=${3:-0 256 0}
ns=${4:-2048,8192}
. "$(dirname "$0")/staged.sh"
log "floors $floors; n $ns"
sanitize '*cuda tpa attention: the batch in several launches*,*cuda tpa attention split backward*' \
  '*cuda tpa attention: the batch in several launches*,*cuda tpa attention split backward*'

for f in $floors; do
  log "bench floor $f MiB"
  echo "=== floor $f MiB" >>"$out/bench.txt"
  LINTAPE_TPA_WORKSPACE_MIB=$f timeout 150 "$cli" bench tpa-attention --mode all --metric all --n "$ns" --reps 10 \
    >>"$out/bench.txt" 2>&1
  log "  rc=$?"
done
log "peer"
(cd bench/peers && timeout 200 python3 tpa_peer.py --attention-ns "$ns" --attention-shapes 8x16,16x6 --no-decode) \
  >"$out/peer.txt" 2>&1
log "peer rc=$?"
set -- $floors
for f in "$1" "$2"; do
  log "bench train, TPA mixers, floor $f MiB"
  echo "=== floor $f MiB" >>"$out/train.txt"
  LINTAPE_TPA_WORKSPACE_MIB=$f timeout 150 "$cli" bench train --mixers tpa --steps 10 --warmup 3 >>"$out/train.txt" 2>&1
  log "  rc=$?"
done
