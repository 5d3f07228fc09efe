"""The mix stage's input: every shard's split table of one source, read into train and val pools.

    POLARS_MAX_THREADS=1 python benchmarks/mix_input.py --shards 100 --docs 50000 [--repeat 3]

Synthetic split files (`doc`, `cluster`, `tokens` int64, `split` string: ~80 % train, 10 % val, 10 % dup,
as the split stage writes them) in a temporary directory, then (a) `pipeline.data.mix.load_source`
(one lazy polars scan over the files, filtered per split) against (b) the pyarrow reader it replaced
(below, as it was: a table per file, the split column through Python strings), interleaved, best of
`--repeat`; the pools must be equal. Wall and CPU seconds of this process (CPU counts every thread:
set POLARS_MAX_THREADS=1 for a per-core comparison), and the peak RSS after each.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's package, installed or not

from pipeline.data import mix


def pyarrow_load_source(paths: list[Path]) -> dict[str, mix.Pool]:
    """`load_source` before polars (error handling left out)."""
    parts = []
    for i, p in enumerate(paths):
        t = pq.read_table(p, columns=["doc", "tokens", "split"])
        split = np.asarray(t.column("split").to_pylist(), dtype=object)
        parts.append((np.full(len(split), i), t.column("doc").to_numpy(), t.column("tokens").to_numpy(), split))
    shard, doc, tokens, split = (np.concatenate(c) for c in zip(*parts))
    pool = mix.Pool([p.stem for p in paths], shard.astype(np.int64), doc.astype(np.int64), tokens.astype(np.int64))
    return {name: pool.take(np.flatnonzero(split == name)) for name in ("train", "val")}


def write_files(root: Path, shards: int, docs: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    names = np.array(["train", "val", "dup"])
    paths = []
    for i in range(shards):
        doc = np.arange(docs, dtype=np.int64)
        split = names[rng.choice(3, size=docs, p=[0.8, 0.1, 0.1])]
        table = pa.table({"doc": doc, "cluster": doc, "tokens": rng.integers(20, 4000, docs, dtype=np.int64),
                          "split": pa.array(split, pa.string())})
        paths.append(root / f"shard_{i:05d}.parquet")
        pq.write_table(table, paths[-1])
    return paths


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python benchmarks/mix_input.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--docs", type=int, default=50_000, help="documents per shard")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp), args.shards, args.docs)
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            for name, fn in (("polars scan (load_source)", lambda: mix.load_source(paths, "web")),
                             ("pyarrow per file (before)", lambda: pyarrow_load_source(paths))):
                pools, wall, cpu = timed(fn)
                best[name] = min(best.get(name, (wall, cpu)), (wall, cpu))
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(f"{name:28s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  peak RSS so far {rss:,.0f} MB")
        a, b = mix.load_source(paths, "web"), pyarrow_load_source(paths)
        for split in ("train", "val"):
            for f in ("shard", "doc", "tokens"):
                assert np.array_equal(getattr(a[split], f), getattr(b[split], f)), (split, f)
    rows = args.shards * args.docs
    print(f"{args.shards} shards × {args.docs:,} documents = {rows:,} rows; best of {args.repeat}:")
    for name, (wall, cpu) in best.items():
        print(f"  {name:28s} {wall:6.2f} s wall, {cpu:6.2f} cpu-s, {rows / cpu / 1e6:6.2f} M rows/cpu-s")
    return best


if __name__ == "__main__":
    main()
