"""CPU, wall and peak memory per rule of a finished run, from Snakemake's `benchmark:` files.

    python benchmarks/rule_cpu.py R/benchmarks

Sums the `cpu_time` and `s` (wall) columns of every job's table under `R/benchmarks/<rule>/…` (or
`<rule>.tsv`) per rule, with the largest `max_rss`, largest CPU first, and the totals: what the
before/after comparisons in BENCHMARKS.md quote.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path


def per_rule(root: Path) -> dict[str, list]:
    rows: dict[str, list] = {}
    for tsv in sorted(root.rglob("*.tsv")):
        rule = tsv.relative_to(root).parts[0].removesuffix(".tsv")
        with open(tsv) as f:
            r = next(csv.DictReader(f, delimiter="\t"))
        c = rows.setdefault(rule, [0, 0.0, 0.0, 0.0])
        c[0] += 1
        c[1] += float(r["cpu_time"])
        c[2] += float(r["s"])
        c[3] = max(c[3], float(r["max_rss"]))
    return rows


def main(argv=None) -> None:
    root = Path((argv or sys.argv[1:])[0])
    rows = per_rule(root)
    print(f"{'rule':<22}{'jobs':>5}{'cpu_s':>9}{'wall_s':>9}{'max_rss':>9}")
    for rule, (n, cpu, wall, rss) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"{rule:<22}{n:>5}{cpu:>9.2f}{wall:>9.2f}{rss:>9.1f}")
    print(f"{'total':<22}{sum(r[0] for r in rows.values()):>5}{sum(r[1] for r in rows.values()):>9.2f}"
          f"{sum(r[2] for r in rows.values()):>9.2f}")


if __name__ == "__main__":
    main()
