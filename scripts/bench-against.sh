#!/usr/bin/env bash
# Times this tree against another one (e.g. the last release's sources) on the same GPU in one call:
# builds both for Hopper, then runs each benchmark on both builds in turns, ROUNDS times, and prints per row
# the median of each side, their ratio and each side's spread over the rounds.
#
#   scripts/bench-against.sh BASE_SRC OUTDIR ROUNDS 'BENCH ARGS' ['BENCH ARGS' ...]
#     BASE_SRC    the other tree's source folder (e.g. from `git archive v0.1.0 | tar -x -C base`)
#     ROUNDS      how many turns of every benchmark on each build (3 or more gives a spread)
#     BENCH ARGS  one `lintape bench` command line each, e.g. 'fal-causal --quick' 'train --mixers fal'
#
# OUTDIR receives compare.txt (the table), runs.json (every row of every run) and build.log. The builds
# are build-gpu/ (this tree, as scripts/gpu-check.sh makes it) and BASE_SRC/build-gpu/.
set -uo pipefail

if [ $# -lt 4 ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$1" && pwd) || exit 2
mkdir -p "$2" && out=$(cd "$2" && pwd)
rounds=$3
shift 3
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT

build() {  # build SRC: configure and build SRC/build-gpu for sm_90a
  cmake -S "$1" -B "$1/build-gpu" -G Ninja -DLINTAPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_BUILD_TYPE=Release >>"$out/build.log" 2>&1 &&
    cmake --build "$1/build-gpu" -j16 --target lintape_cli >>"$out/build.log" 2>&1
}
for src in "$root" "$base"; do
  build "$src" || { echo "bench-against: the build of $src failed (see build.log)"; exit 1; }
done

i=0
for spec in "$@"; do
  i=$((i + 1))
  for round in $(seq 1 "$rounds"); do
    for side in base this; do
      src=$root
      [ "$side" = base ] && src=$base
      # shellcheck disable=SC2086  # each spec is a command line
      "$src/build-gpu/lintape" bench $spec --json "$runs/$i.$round.$side.json" >>"$out/bench.log" 2>&1 ||
        echo "bench-against: '$spec' failed on $side (round $round)" | tee -a "$out/compare.txt"
    done
  done
done

python3 - "$runs" "$out" <<'EOF'
import glob, json, os, statistics, sys
runs, out = sys.argv[1], sys.argv[2]
rows, everything = {}, []
for path in sorted(glob.glob(os.path.join(runs, "*.json"))):
    spec, _, side = os.path.basename(path)[:-5].split(".")
    doc = json.load(open(path))
    if "rows" not in doc:  # bench train: one document per run
        doc["rows"] = [{"op": "train", "title": doc["model"], "metric": m, "mode": "step", "unit": m,
                        "n": doc["tokens_per_step"], "provider": "lintape", "value": doc[m]}
                       for m in ("step_ms", "tokens_per_s", "peak_mib")]
    for r in doc["rows"]:
        if r.get("value") is None or r["value"] < 0:  # not measured (e.g. composed over memory)
            continue
        everything.append(dict(r, side=side, spec=int(spec)))
        key = (int(spec), r["op"], r["title"], r["metric"], r["mode"], r["n"], r["provider"], r["unit"])
        rows.setdefault(key, {"base": [], "this": []})[side].append(r["value"])
lines = ["%-14s %-52s %-5s %-6s %8s %-12s %11s %11s %6s %8s %8s" % (
    "op", "table", "mode", "metric", "n", "provider", "base", "this", "ratio", "spread-b", "spread-t")]
for key, sides in rows.items():
    _, op, title, metric, mode, n, provider, unit = key
    b, t = sides["base"], sides["this"]
    if not b or not t:
        continue
    mb, mt = statistics.median(b), statistics.median(t)
    spread = lambda v: (max(v) - min(v)) / statistics.median(v) * 100 if statistics.median(v) else 0
    lines.append("%-14s %-52s %-5s %-6s %8s %-12s %11.4g %11.4g %6.3f %7.1f%% %7.1f%%" % (
        op[:14], title[-52:], mode, metric, n, provider[:12], mb, mt, mt / mb if mb else float("nan"),
        spread(b), spread(t)))
text = "\n".join(lines) + "\n(ratio: this / base of the medians; spread: (max - min) / median over the rounds)\n"
open(os.path.join(out, "compare.txt"), "a").write(text)
json.dump(everything, open(os.path.join(out, "runs.json"), "w"), indent=1)
print(text)
EOF
