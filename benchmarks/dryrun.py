"""Time the token-budget dry run: `snakemake -n` over the 1.2B preset's 1,823 shards, no data.

    python benchmarks/dryrun.py [--configfile configs/llama3-1b-fineweb.yaml] [--repeat 3]

Runs in a fresh temp directory (nothing downloaded, nothing written there) and prints wall-clock
seconds per run and the median. Target: ≤ 10 s on the 2-core development machine.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", default=str(ROOT / "configs/llama3-1b-fineweb.yaml"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    snakemake = str(Path(sys.executable).parent / "snakemake")
    times = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            proc = subprocess.run(
                [snakemake, "-s", str(ROOT / "Snakefile"), "-d", d, "-n", "--quiet", "rules",
                 "--configfile", args.configfile],
                capture_output=True, text=True,
            )
            times.append(time.perf_counter() - t0)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            jobs = next((ln for ln in proc.stdout.splitlines() if ln.startswith("total")), "total ?")
    print(f"dry run ({Path(args.configfile).name}, {jobs.split()[-1]} jobs): " + ", ".join(f"{t:.2f}s" for t in times)
          + f"; median {statistics.median(times):.2f}s")


if __name__ == "__main__":
    main()
