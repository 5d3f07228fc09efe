"""Data-stage benchmarks: each subcommand times a stage end to end against its raw kernel, in one run.

    python -m pipeline.bench_data count --tokenizer R/tokenizer/tokenizer.json --input D/web/shard_00000.parquet [--repeat 3]

`count`: (a) `pipeline.count.count_shard` — the function the `count shard` CLI runs: parquet read,
UTF-8 decode, empty/invalid checks, tokenization, sums — versus (b) `tiktoken.Encoding.
encode_ordinary_batch` on the same documents already in memory (and, as a second raw kernel, a plain
loop over `encode_ordinary`, which skips tiktoken's thread pool). All run with one tokenizer thread;
throughput is reported per core as tokens per CPU-second of the process (all its threads counted),
and per wall-second; the ratio is taken against the faster raw kernel. Target: (a) ≥ 90% of (b).

Timing helpers (`measure`, `Timing`, `report`) are shared by every subcommand: the candidates are
run interleaved `repeat` times (so background load hits both alike) and the best run of each counts.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.io import run_cli


@dataclass
class Timing:
    """Best run of one candidate: `items` processed (tokens, documents, ...) in `wall_s` / `cpu_s`."""

    name: str
    items: int
    wall_s: float
    cpu_s: float

    @property
    def per_cpu_s(self) -> float:
        """Items per CPU-second: throughput per core, whatever the number of threads."""
        return self.items / self.cpu_s

    @property
    def per_wall_s(self) -> float:
        return self.items / self.wall_s


def measure(candidates: dict[str, Callable[[], int]], repeat: int) -> dict[str, Timing]:
    """Run each candidate (a callable returning the number of items it processed) `repeat` times,
    interleaved; return each one's fastest run (by CPU time) as a Timing."""
    best: dict[str, Timing] = {}
    for _ in range(repeat):
        for name, fn in candidates.items():
            w0, c0 = time.perf_counter(), time.process_time()
            items = fn()
            t = Timing(name, items, time.perf_counter() - w0, time.process_time() - c0)
            if name not in best or t.cpu_s < best[name].cpu_s:
                best[name] = t
    return best


def report(timings: dict[str, Timing], unit: str, baseline: str) -> None:
    """Print one line per candidate with its throughput and its ratio to `baseline`."""
    base = timings[baseline]
    for t in timings.values():
        print(f"{t.name:<24} {t.items:>12,} {unit}  {t.wall_s:8.3f} s wall  {t.cpu_s:8.3f} s cpu  "
              f"{t.per_cpu_s:>12,.0f} {unit}/cpu-s  {t.per_wall_s:>12,.0f} {unit}/s  "
              f"{t.per_cpu_s / base.per_cpu_s:6.1%} of {baseline}")


# ----------------------------------------------------------------------------- count

def bench_count(args) -> dict[str, Timing]:
    from pipeline.count import count_shard
    from pipeline.tokenizer import iter_documents, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    source = {"format": "text", "text_column": args.text_column}
    texts = [doc for batch in iter_documents(args.input, source, args.batch_size) for doc in batch.docs]
    counted = count_shard(args.input, tok, source, args.batch_size, num_threads=1)

    def end_to_end() -> int:
        return count_shard(args.input, tok, source, args.batch_size, num_threads=1)["tokens"]

    def raw_batch() -> int:
        return sum(map(len, tok.enc.encode_ordinary_batch(texts, num_threads=1)))

    def raw_loop() -> int:  # the same kernel without tiktoken's thread pool
        return sum(len(tok.enc.encode_ordinary(t)) for t in texts)

    logging.getLogger("pipeline.count").setLevel(logging.ERROR)  # not one warning per repeat
    timings = measure({"count_shard (e2e)": end_to_end, "encode_ordinary_batch": raw_batch,
                       "encode_ordinary loop": raw_loop}, args.repeat)
    assert {t.items for t in timings.values()} == {counted["tokens"]}, "all paths must see the same tokens"
    print(f"{args.input}: {counted['documents']:,} rows ({len(texts):,} documents), {counted['bytes']:,} bytes, "
          f"{counted['tokens']:,} tokens; tokenizer {tok.enc.name} (n_vocab {tok.n_vocab}); 1 thread; "
          f"best of {args.repeat}")
    fastest_raw = max(("encode_ordinary_batch", "encode_ordinary loop"), key=lambda n: timings[n].per_cpu_s)
    report(timings, "tokens", baseline=fastest_raw)
    return timings


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> Any:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench_data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("count", help="count stage end to end vs raw tiktoken encode, tokens per core")
    c.add_argument("--tokenizer", required=True, help="tokenizer.json")
    c.add_argument("--input", required=True, help="a raw text shard (parquet)")
    c.add_argument("--text-column", default="text")
    c.add_argument("--batch-size", type=int, default=1024, help="count.batch_size (documents per batch)")
    c.add_argument("--repeat", type=int, default=3)
    c.set_defaults(func=bench_count)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    run_cli(main)
