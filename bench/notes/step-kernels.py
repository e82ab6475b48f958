#!/usr/bin/env python3
"""Sums bench/notes/step-kernels.sh's ncu CSV by kernel: launches, total ms, mean us, DRAM and SM % (time-weighted).
   python3 bench/notes/step-kernels.py FILE.csv [--skip-steps K]  (the warm-up step's launches come first: the
   second half of the launches is the timed step when --half is given)."""
import csv, re, sys
from collections import defaultdict

def main():
    path = sys.argv[1]
    half = "--half" in sys.argv
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.DictReader(lines)
    for r in reader:
        try:
            t = float(r["gpu__time_duration.sum"].replace(",", ""))
        except (KeyError, ValueError):
            continue  # the units row
        rows.append(r | {"t": t})
    if half:
        rows = rows[len(rows) // 2:]
    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0, ""])
    for r in rows:
        name = re.sub(r"\(.*", "", r["Kernel Name"]).strip()
        name = re.sub(r"^void ", "", name)[:70]
        a = agg[name]
        a[0] += 1
        a[1] += r["t"]
        a[2] += r["t"] * float(r["dram__throughput.avg.pct_of_peak_sustained_elapsed"].replace(",", ""))
        a[3] += r["t"] * float(r["sm__throughput.avg.pct_of_peak_sustained_elapsed"].replace(",", ""))
        a[4] = r["launch__registers_per_thread"]
    unit = 1e-6  # ncu reports ns
    total = sum(a[1] for a in agg.values())
    print(f"{len(rows)} launches, {total * unit:.2f} ms of kernels")
    print(f"{'kernel':70s} {'n':>4s} {'ms':>8s} {'share':>6s} {'us/launch':>9s} {'DRAM%':>6s} {'SM%':>5s} {'regs':>4s}")
    for name, a in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        if a[1] < 0.002 * total:
            continue
        print(f"{name:70s} {a[0]:4d} {a[1] * unit:8.3f} {100 * a[1] / total:5.1f}% {a[1] / a[0] / 1e3:9.1f} "
              f"{a[2] / a[1]:6.1f} {a[3] / a[1]:5.1f} {a[4]:>4s}")

main()
