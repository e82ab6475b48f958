"""One table: lintape's training step beside PyTorch's (eager, torch.compile and its reduce-overhead mode), same
model and shapes.

Runs `lintape bench train --json` and bench_train.py for each mixer kind in one call on one card and
prints a Markdown table (tokens/s, ms/step, MFU, peak MiB, and lintape's speed-up and memory ratio
against each PyTorch step); --json writes the rows. lintape's step is a CUDA graph by default; --eager-too
adds a row of lintape with --no-cuda-graph.

Usage: python3 bench/torch_ref/compare_train.py --lintape build-gpu/lintape [--preset small|tiny]
           [--mixers fal,tpa] [--batch 16] [--seq 2048] [--vocab 32768] [--steps 10]
           [--modes eager,compile,reduce-overhead] [--eager-too] [--timeout S] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd, path, timeout):
    print("$ " + " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  stopped after {timeout} s", flush=True)
        return None
    if done.returncode != 0 or not os.path.exists(path):
        print(f"  failed with status {done.returncode}", flush=True)
        return None
    return json.load(open(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lintape", required=True)
    ap.add_argument("--preset", default="small", choices=["small", "tiny"])
    ap.add_argument("--mixers", default="fal,tpa", help="the mixer kinds to compare, one model each")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="eager,compile",
                    help="the PyTorch runs, comma-separated: eager, compile, reduce-overhead")
    ap.add_argument("--eager-too", action="store_true", help="also lintape with --no-cuda-graph")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed to each command (default: no limit)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not set(args.modes.split(",")) <= {"eager", "compile", "reduce-overhead"}:
        ap.error(f"--modes takes eager, compile and reduce-overhead, comma-separated; got {args.modes}")
    shape = ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab), "--steps", str(args.steps)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mixer in args.mixers.split(","):
            runs = [("lintape", [])] + ([("lintape eager", ["--no-cuda-graph"])] if args.eager_too else [])
            for provider, extra in runs:
                path = f"{tmp}/{provider.replace(' ', '-')}-{mixer}.json"
                ours = run_json([args.lintape, "bench", "train", "--preset", args.preset, "--mixers", mixer, "--device",
                                 "cuda", "--json", path] + extra + shape, path, args.timeout)
                if ours:
                    rows.append({"mixers": mixer, "provider": provider, "tokens_per_s": ours["tokens_per_s"],
                                 "step_ms": ours["step_ms"], "mfu": ours["mfu"], "peak_mib": ours["peak_mib"]})
            for mode in args.modes.split(","):  # apart, so that a compilation stopped by --timeout loses only itself
                path = f"{tmp}/torch-{mixer}-{mode}.json"
                theirs = run_json([sys.executable, os.path.join(HERE, "bench_train.py"), "--preset", args.preset,
                                   "--mixers", mixer, "--mode", mode, "--json", path] + shape, path, args.timeout)
                for r in (theirs or {}).get("rows", []):
                    rows.append({k: r[k] for k in ("provider", "tokens_per_s", "step_ms", "mfu", "peak_mib")} |
                                {"mixers": mixer})
    print(f"\n| mixers | provider | tokens/s | ms/step | MFU | peak MiB | lintape speed-up | lintape memory |")
    print("|---|---|---|---|---|---|---|---|")
    for mixer in args.mixers.split(","):
        mine = next((r for r in rows if r["mixers"] == mixer and r["provider"] == "lintape"), None)
        for r in (r for r in rows if r["mixers"] == mixer):
            speed = memory = ""
            if mine and not r["provider"].startswith("lintape"):
                speed = f"{mine['tokens_per_s'] / r['tokens_per_s']:.2f}x"
                memory = f"{mine['peak_mib'] / r['peak_mib']:.2f}x"
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            print(f"| {mixer} | {r['provider']} | {r['tokens_per_s'] / 1e3:.1f} K | {r['step_ms']:.1f} | {mfu} | "
                  f"{r['peak_mib']:.0f} | {speed} | {memory} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "rows": rows},
                      f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
