#!/usr/bin/env python3
"""Kernel table from an Nsight Compute raw CSV (ncu --csv --page raw): one row per kernel (name and grid),
its launches, total and mean time, share of the total, and the time-weighted DRAM throughput and tensor-pipe
activity when the CSV has them. For the question "where does a step's time go, and how far is each kernel from
its bound": the bandwidth kernels' DRAM column against ~80-90%, the products' tensor column against ~90%.

  python3 bench/ncu_table.py FILE.csv [--top N] [--by name|grid] [--steps S]

--steps divides the times by S (the CSV holds S steps' kernels)."""
import argparse
import csv
import re
import sys

TIME = "gpu__time_duration.sum"
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
GRID = "launch__grid_size"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read(path):
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no ncu CSV header (run ncu with --csv --page raw)")
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], rows[2:]  # rows[1]: units
    if TIME not in header:
        sys.exit(f"{path}: no {TIME} column (add it to ncu's --metrics)")
    return {name: i for i, name in enumerate(header)}, body


def short_name(name):
    name = re.sub(r"\(.*", "", name).strip()
    return re.sub(r"^void ", "", name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by", choices=["name", "grid"], default="grid")
    ap.add_argument("--steps", type=float, default=1.0)
    a = ap.parse_args()
    col, body = read(a.csv)
    table = {}
    for r in body:
        t = number(r[col[TIME]])
        if t is None:
            continue
        key = (short_name(r[col["Kernel Name"]]), r[col[GRID]] if a.by == "grid" and GRID in col else "")
        e = table.setdefault(key, {"n": 0, "t": 0.0, "dram": 0.0, "tensor": 0.0})
        e["n"] += 1
        e["t"] += t
        for metric, field in ((DRAM, "dram"), (TENSOR, "tensor")):
            v = number(r[col[metric]]) if metric in col else None
            e[field] += (v or 0.0) * t
    total = sum(e["t"] for e in table.values())
    if total == 0:
        sys.exit(f"{a.csv}: no kernel times")
    print(f"{len(body)} launches, {total / 1e6 / a.steps:.2f} ms of kernels a step")
    print(f"{'ms a step':>10} {'share':>6} {'launches':>8} {'mean us':>9} {'DRAM %':>7} {'tensor %':>8}  kernel")
    for (name, grid), e in sorted(table.items(), key=lambda kv: -kv[1]["t"])[: a.top]:
        where = f" [grid {grid}]" if grid else ""
        print(f"{e['t'] / 1e6 / a.steps:10.3f} {100 * e['t'] / total:5.1f}% {e['n'] / a.steps:8.0f} "
              f"{e['t'] / e['n'] / 1e3:9.1f} {e['dram'] / e['t']:7.1f} {e['tensor'] / e['t']:8.1f}  {name[:90]}{where}")


if __name__ == "__main__":
    main()
