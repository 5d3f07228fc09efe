"""Dedup clustering at scale: peak memory of one candidate job and of the merge job vs corpus size.

    python benchmarks/dedup_scale.py --docs 1e6 4e6 8e6 20e6 --docs-per-job 1e6 [--merge-jobs K] [--all-jobs]
    python benchmarks/dedup_scale.py --docs 1e6 --parts-sweep 8 64 200 [--baseline OLD_CHECKOUT]

For each size N it writes N synthetic documents' signature files (the dedup_signatures format, the
default hashing parameters: 120 permutations, 20 bands of 6 rows) in shards of --shard-docs, with
--dup-rate of the documents copies of a pool of templates, perturbed in 0 (exact), a few (near) or
half (a rejected candidate) of their signature positions. Then it runs, each in its own process
(`python -m pipeline.data.dedup candidates`), candidate job 0 of P = ceil(N / docs-per-job) — the jobs are
alike by construction (band keys are uniform hashes), so one is measured — and the merge job
(`clusters --pairs`: union-find, keep lists, report) over
all P jobs' pairs (the other P - 1 candidate jobs are run too when --all-jobs). Peak memory is the
child's ru_maxrss (resource.getrusage(RUSAGE_CHILDREN) after it exits), CPU is its user+sys time.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.config import resolve_config  # noqa: E402
from pipeline.data import dedup, minhash  # noqa: E402
from pipeline.rules import rule_params  # noqa: E402

DD = {"ngram": 5, "num_perm": 120, "bands": 20, "rows": 6, "seed": 1}


def write_synthetic(outdir: Path, n_docs: int, shard_docs: int, dup_rate: float = 0.1, seed: int = 0,
                    dd: dict = DD, sources: tuple[str, ...] = ("web", "code"), parts: int = 1) -> list[Path]:
    """Signature files for `n_docs` synthetic documents (see the module docstring), with their band
    keys partitioned for `parts` candidate jobs; returns their paths. A template's copies are spread
    over every shard and source, so clusters span them."""
    rng = np.random.default_rng(seed)
    n_templates = max(1, int(n_docs * dup_rate / 4))  # about 4 copies per template
    tsig = rng.integers(0, 1 << 32, (n_templates, dd["num_perm"]), dtype=np.uint32)
    thash = rng.integers(0, 1 << 63, n_templates, dtype=np.uint64)
    paths = []
    n_shards = math.ceil(n_docs / shard_docs)
    for i in range(n_shards):
        n = min(shard_docs, n_docs - i * shard_docs)
        sig = rng.integers(0, 1 << 32, (n, dd["num_perm"]), dtype=np.uint32)
        exact = rng.integers(0, 1 << 63, n, dtype=np.uint64)
        dup = np.flatnonzero(rng.random(n) < dup_rate)
        t = rng.integers(0, n_templates, len(dup))
        sig[dup] = tsig[t]
        # 0 changed positions: an exact copy; 3 or 12: near (J ≈ 0.95, 0.8); 60: a likely-rejected candidate
        changed = rng.choice([0, 3, 12, 60], len(dup), p=[0.25, 0.35, 0.25, 0.15])
        exact[dup] = np.where(changed == 0, thash[t], exact[dup])
        for m in (3, 12, 60):
            rows = dup[changed == m]
            cols = rng.random((len(rows), dd["num_perm"])).argsort(axis=1)[:, :m]
            sig[rows[:, None], cols] = rng.integers(0, 1 << 32, (len(rows), m), dtype=np.uint32)
        hashed = {"exact": exact, "sig": sig, "bands": minhash.band_keys(sig, dd["bands"], dd["rows"])}
        source = sources[i % len(sources)]
        path = outdir / source / f"shard_{i:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        tokens = np.full(n, 1000, np.int64)
        meta = {"source": source, "shard": path.stem, "n_docs": n, **{k: dd[k] for k in dedup.HASH_PARAMS}}
        dedup._write_signature_file(path, dedup.signature_table(tokens, hashed), meta)
        dedup.write_lsh_files(path, hashed, parts, meta)
        paths.append(path)
    return paths


def repartition(paths: list[Path], parts: int) -> None:
    """Rewrite the signature files' lsh files for `parts` candidate jobs (what dedup_signatures writes
    when `dedup.partitions` is `parts`)."""
    for path in paths:
        t = dedup.pq.read_table(path)
        hashed = {"exact": t.column("exact").to_numpy(), "bands": dedup._fixed_list(t, "bands"),
                  "sig": dedup._fixed_list(t, "sig")}
        dedup.write_lsh_files(path, hashed, parts, dedup.read_parquet_meta(path))


def measured(cmd: list[str], cwd: Path = ROOT) -> dict:
    """Run `cmd` under /usr/bin/time: its wall time, CPU time and peak RSS. (The child's own
    ru_maxrss from os.wait4 would include this process's pages at fork time, which Linux keeps across
    exec; `time` is a small process, so the command it forks starts small.)"""
    with tempfile.NamedTemporaryFile("r") as rep:
        proc = subprocess.run(["/usr/bin/time", "-o", rep.name, "-f", "%e %U %S %M", *cmd], capture_output=True,
                              text=True, cwd=cwd)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-3000:]}")
        wall, user, system, rss_kb = rep.read().split()[-4:]
    return {"wall_s": float(wall), "cpu_s": float(user) + float(system), "peak_mb": int(rss_kb) / 1024,
            "stdout": proc.stdout}


def sweep(args) -> None:
    """--parts-sweep: every candidate job of P = each given count over the same corpus (the first
    --docs): the stage's total CPU, as job processes (each under /usr/bin/time) and as the work alone
    (the same jobs in this process, without each process's interpreter start), and with --baseline
    TREE the same job processes run from another checkout (the code before a change)."""
    n = int(args.docs[0])
    work = Path(args.workdir) / f"sweep{n}"
    shutil.rmtree(work, ignore_errors=True)
    sigs = write_synthetic(work / "sig", n, args.shard_docs, args.dup_rate)
    rows, stats = [], None
    for parts in args.parts_sweep:
        repartition(sigs, parts)
        cfg = resolve_config({"dedup": {"partitions": parts}})
        params = rule_params(cfg, "dedup")
        dd = params["dedup"]
        shards = dedup.catalogue(sigs, dd)
        t0 = time.process_time()
        tables = [dedup.candidates(shards, dd, p, parts) for p in range(parts)]
        work_cpu = time.process_time() - t0
        got = dedup.merge_pairs(tables, dd).stats
        assert stats is None or got == stats, (parts, got, stats)  # the same pairs for every P
        stats = got

        def stage(cwd: Path, parts=parts, params=params) -> tuple[float, float]:
            jobs = [measured([sys.executable, "-m", "pipeline.data.dedup", "candidates", "--params", json.dumps(params),
                              "--inputs", *map(str, sigs), "--part", str(p), "--out", str(work / f"pairs-{p}.parquet")],
                             cwd=cwd) for p in range(parts)]
            return sum(j["cpu_s"] for j in jobs), max(j["peak_mb"] for j in jobs)

        cpu, peak = stage(ROOT)
        row = {"docs": n, "shards": len(sigs), "parts": parts, "work_cpu_s": round(work_cpu, 1),
               "jobs_cpu_s": round(cpu, 1), "job_peak_mb": round(peak)}
        if args.baseline:
            base_cpu, base_peak = stage(Path(args.baseline))
            row |= {"baseline_jobs_cpu_s": round(base_cpu, 1), "baseline_job_peak_mb": round(base_peak)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    start = measured([sys.executable, "-c", "import pipeline.data.dedup"])["cpu_s"]
    print(f"candidate pairs {stats['candidate_pairs']:,}, confirmed {stats['confirmed_pairs']:,} for every P; "
          f"one job process's interpreter + imports: {start:.2f} CPU s")
    base = " | baseline job processes CPU s | baseline job peak MB" if args.baseline else ""
    print(f"| documents | shards | P | work CPU s (in process) | job processes CPU s | job peak MB{base} |")
    print("|---|---|---|---|---|---|" + ("---|---|" if args.baseline else ""))
    for r in rows:
        extra = f" | {r['baseline_jobs_cpu_s']} | {r['baseline_job_peak_mb']}" if args.baseline else ""
        print(f"| {r['docs']:,} | {r['shards']} | {r['parts']} | {r['work_cpu_s']} | {r['jobs_cpu_s']} | "
              f"{r['job_peak_mb']}{extra} |")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=float, nargs="+", default=[1e6, 4e6, 8e6, 20e6])
    ap.add_argument("--docs-per-job", type=float, default=1e6)
    ap.add_argument("--shard-docs", type=int, default=55_000, help="FineWeb's 1,823 shards average ~55k documents")
    ap.add_argument("--dup-rate", type=float, default=0.1)
    ap.add_argument("--workdir", default="/tmp/tokenfarm-dedup-scale")
    ap.add_argument("--all-jobs", action="store_true", help="run every candidate job, not only job 0")
    ap.add_argument("--merge-jobs", type=int, default=0,
                    help="make the merge's input with this many candidate jobs (default: as many as measured)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files")
    ap.add_argument("--parts-sweep", type=int, nargs="+",
                    help="instead: the whole candidate stage for each of these P over the first --docs")
    ap.add_argument("--baseline", help="with --parts-sweep: a checkout whose candidate CLI to run beside")
    args = ap.parse_args()
    if args.parts_sweep:
        return sweep(args)
    rows = []
    for n in (int(x) for x in args.docs):
        work = Path(args.workdir) / f"n{n}"
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.perf_counter()
        parts = max(1, math.ceil(n / args.docs_per_job))
        sigs = write_synthetic(work / "sig", n, args.shard_docs, args.dup_rate, parts=parts)
        gen_s = time.perf_counter() - t0
        k = args.merge_jobs or parts

        def run(command: str, sigs=sigs, **extra) -> dict:
            cfg = resolve_config({"dedup": {"partitions": extra.pop("partitions")}})
            flags = [a for kv in extra.items() for a in (f"--{kv[0]}", *kv[1])]
            return measured([sys.executable, "-m", "pipeline.data.dedup", command, "--params",
                             json.dumps(rule_params(cfg, "dedup")), "--inputs", *map(str, sigs), *flags])

        jobs = [run("candidates", partitions=parts, part=[str(p)], out=[str(work / f"pairs-{p}.parquet")])
                for p in range(parts if args.all_jobs else 1)]
        # The merge's inputs: every job's pairs, or (--merge-jobs K) the same pairs from K coarser jobs.
        if k != parts or not args.all_jobs:
            for p in range(k):
                run("candidates", partitions=k, part=[str(p)], out=[str(work / f"merge-in-{p}.parquet")])
            merge_in = [str(work / f"merge-in-{p}.parquet") for p in range(k)]
        else:
            merge_in = [str(work / f"pairs-{p}.parquet") for p in range(parts)]
        merge = run("clusters", partitions=k, pairs=merge_in, outdir=[str(work / "out")],
                    report=[str(work / "out/report.json")])
        stats = json.loads((work / "out/report.json").read_text())["candidates"]
        row = {"docs": n, "jobs": parts, "docs_per_job": n / parts, "shards": len(sigs), "generate_s": round(gen_s, 1),
               "candidate_peak_mb": round(max(j["peak_mb"] for j in jobs)),
               "candidate_cpu_s": round(sum(j["cpu_s"] for j in jobs) / len(jobs), 1),
               "candidate_wall_s": round(sum(j["wall_s"] for j in jobs) / len(jobs), 1),
               "merge_inputs": k, "merge_peak_mb": round(merge["peak_mb"]), "merge_cpu_s": round(merge["cpu_s"], 1),
               **stats}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("| documents | jobs | docs/job | candidate job peak MB | candidate job CPU s | merge peak MB | "
          "merge CPU s | candidate pairs | confirmed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['docs']:,} | {r['jobs']} | {r['docs_per_job']:,.0f} | {r['candidate_peak_mb']:,} | "
              f"{r['candidate_cpu_s']} | {r['merge_peak_mb']:,} | {r['merge_cpu_s']} | {r['candidate_pairs']:,} | "
              f"{r['confirmed_pairs']:,} |")


if __name__ == "__main__":
    main()
