# Sourced by the notes' device scripts that run binaries built elsewhere (Release, sm_90a) and carried in
# $stage/lintape-bin.tgz (lintape, liblintape.so.0*, lintape_tests, lintape_comm_checks) with $stage/commit.txt:
# unpacks them into build/, sets cli and tests, and gives log (a line to $out/summary.txt), counts (a doctest
# log's totals), with (a command under a variant: NAME=VALUE pairs joined by '+', or 'base' for none), use_wheels
# (installs the Python wheels carried in .whl, fla-core and einops, and puts them on PYTHONPATH) and sanitize (the TPA CUDA cases, then memcheck on MEMCHECK_CASES and racecheck and synccheck on
# RACE_CASES, all at once, their verdicts logged; tests.log and sanitizer.log in $out).
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

sanitize() {
  local memcheck_cases=$1 race_cases=$2 pids names i rc
  timeout 300 "$tests" -tc='*cuda*tpa*' >"$out/tests.log" 2>&1 &
  pids=($!)
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" -tc="$memcheck_cases" -tce='*seeds*' \
    >"$out/memcheck.log" 2>&1 &
  pids+=($!)
  for tool in racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" -tc="$race_cases" >"$out/$tool.log" 2>&1 &
    pids+=($!)
  done
  names=(tests memcheck racecheck synccheck)
  for i in 0 1 2 3; do
    wait "${pids[$i]}"
    rc=$?
    log "${names[$i]} rc=$rc $(counts "$out/${names[$i]}.log") $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' \
      "$out/${names[$i]}.log")"
  done
  cat "$out"/{memcheck,racecheck,synccheck}.log >"$out/sanitizer.log" && rm -f "$out"/{memcheck,racecheck,synccheck}.log
}

with() {  # variant, command...
  local v=$1
  shift
  if [[ $v == base ]]; then "$@"; else env ${v//+/ } "$@"; fi
}

use_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
  log "wheels rc=$? $(python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -n1)"
}
