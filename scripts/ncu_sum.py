#!/usr/bin/env python3
"""Sums the kernel times in an `ncu --csv --metrics gpu__time_duration.sum` log (other output lines, such
as the program's own, are skipped): prints the kernel count, the total, and the total per kernel name,
largest first. Usage: scripts/ncu_sum.py LOG"""
import csv
import sys
from collections import defaultdict

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def main(path):
    with open(path, errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]
    if not lines:
        sys.exit(f"{path}: no ncu CSV rows (was anything profiled?)")
    per_name = defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        us = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
        name = row["Kernel Name"].split("(")[0]
        per_name[name][0] += 1
        per_name[name][1] += us
    count = sum(n for n, _ in per_name.values())
    total = sum(t for _, t in per_name.values())
    print(f"{count} kernels, {total:.1f} us in all")
    for name, (n, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name}: {n} x, {t:.1f} us")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
