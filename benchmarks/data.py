"""Data-stage benchmarks: each subcommand times a stage end to end against its raw kernel, in one run.

    python benchmarks/data.py tokenize --tokenizer T --input D/web/shard_00000.parquet [--repeat 3]
    python benchmarks/data.py pack --tokenizer T --input D/web/*.parquet [--seq-len 2048 --epochs 8]
    python benchmarks/data.py loader --tokenizer T --input D/web/*.parquet [--micro-batch 16 --steps 2000]

`tokenize`: (a) `pipeline.data.tokenize.tokenize_shard` end to end (read, decode, encode, delimit, the
shard's counts, write .bin/.idx.npy/.json) versus (b) raw tiktoken on the same documents already in
memory, three ways (`raw_tiktoken`): `encode_ordinary_batch`, a plain loop over `encode_ordinary` (no
thread pool), and a loop over `encode_to_numpy` (no Python list per document). All run with one
tokenizer thread; throughput is reported per core as tokens per CPU-second of the process (all its
threads counted), and per wall-second; the ratio is taken against the fastest raw kernel of the run.
Target: (a) ≥ 90% of the fastest. (There is no count stage to time: the count tables are joined from
tokenize's metadata, `pipeline.data.count`.)

`pack` and `loader` tokenize the `--input` shards into a temp dir and write a schedule of all their
documents, shuffled, repeated `--epochs` times (untimed). `pack` times `pipeline.data.pack.pack` with
concat and with bestfit packing (target ≥ 20M tokens per CPU-second for concat). `loader` times
`PackedLoader` batches (int64 inputs/targets tensors; bestfit adds the mask, `+doc_ids` the
document ids) against the raw kernel (fancy-index memmap rows + one numpy→torch conversion),
input tokens per CPU-second (target ≥ 10M per process).

    python benchmarks/data.py minhash --input D/web/*.parquet [--words 500] [--datasketch-docs 200]

`minhash`: (a) `pipeline.data.dedup.write_signatures` — what the `dedup signatures` CLI runs: parquet
read, normalisation, word and shingle hashing, 120-permutation MinHash, band keys, exact hash,
signature-file write — over every input document (all rows taken as tokenized documents), versus
datasketch on a sample of the same documents: `MinHash.update` per shingle (the naive use) and
`update_batch`, with its default SHA-1 hash, on the same normalised 5-word shingles. One thread;
documents per CPU-second. `--words N` first cuts the documents at whitespace into pieces of N words.
Target: (a) >= 5,000 documents per CPU-second on 500-1,000-word documents.

    python benchmarks/data.py decontam --input D/web/*.parquet [--tasks hellaswag ...] [--words 1000]

`decontam`: (a) `pipeline.data.decontaminate.decontaminate_shard` — parquet read, normalisation, every
window of `ngram` words (and of each short-item length) hashed and looked up in the eval n-gram set,
flag-file write — versus (b) the MinHash signatures stage end to end (`write_signatures`, as in
`minhash`) on the same documents in the same run. The eval set is built first from the tasks' files
(`eval_data`, untimed; its time is printed). One thread; documents per CPU-second. Target: (a) >= 50%
of (b).

Timing helpers (`measure`, `Timing`, `report`) are shared by every subcommand: the candidates are
run interleaved `repeat` times (so background load hits both alike) and the best run of each counts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's package, installed or not

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


# ----------------------------------------------------------------------------- tokenize

def raw_tiktoken(enc, texts: list[str]) -> dict[str, Callable[[], int]]:
    """The raw kernels tokenize is measured against: tiktoken's own single-thread ways to
    encode the same texts (each returns the number of tokens)."""
    return {
        "encode_ordinary_batch": lambda: sum(map(len, enc.encode_ordinary_batch(texts, num_threads=1))),
        "encode_ordinary loop": lambda: sum(len(enc.encode_ordinary(t)) for t in texts),  # no thread pool
        "encode_to_numpy loop": lambda: sum(len(enc.encode_to_numpy(t, disallowed_special=())) for t in texts),
    }


def fastest_raw(timings: dict[str, Timing]) -> str:
    """The fastest raw kernel of a run (the baseline ratios are taken against)."""
    return max((n for n in timings if "(e2e)" not in n), key=lambda n: timings[n].per_cpu_s)


# ----------------------------------------------------------------------------- tokenize, pack, loader

def bench_tokenize(args) -> dict[str, Timing]:
    import tempfile

    from pipeline.data.contract import iter_documents
    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.tokenize import tokenize_shard

    tok = load_tokenizer(args.tokenizer)
    source = {"format": "text", "text_column": args.text_column}
    params = {"sources": {"bench": source}, "count": {"batch_size": args.batch_size}}
    texts = [doc for batch in iter_documents(args.input, source, args.batch_size) for doc in batch.docs]
    with tempfile.TemporaryDirectory() as tmp:

        def end_to_end() -> int:
            return tokenize_shard(tok, args.input, f"{tmp}/bench/shard.json", "bench", "shard", params)["n_doc_tokens"]

        logging.getLogger("pipeline.data.tokenize").setLevel(logging.ERROR)
        timings = measure({"tokenize_shard (e2e)": end_to_end, **raw_tiktoken(tok.enc, texts)}, args.repeat)
    assert len({t.items for t in timings.values()}) == 1, "all paths must see the same tokens"
    print(f"{args.input}: {len(texts):,} documents, {timings['encode_ordinary loop'].items:,} tokens; tokenizer "
          f"{tok.enc.name} (n_vocab {tok.n_vocab}); 1 thread; best of {args.repeat}")
    report(timings, "tokens", baseline=fastest_raw(timings))
    return timings


def _packed_inputs(args, tmp: str) -> tuple[dict, str]:
    """Tokenize `args.input` into `tmp`; write a shuffled schedule of every document × `args.epochs`.
    Returns (pack params for mixes 'concat' and 'bestfit', schedule path)."""
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.tokenize import tokenize_shard

    tok = load_tokenizer(args.tokenizer)
    source = {"format": args.format, "text_column": args.text_column}
    names, docs, spans = [], [], []
    for path in args.input:
        name = Path(path).stem
        meta = tokenize_shard(tok, path, f"{tmp}/tokens/bench/{name}.json", "bench", name,
                              {"sources": {"bench": source}, "count": {"batch_size": 1024}})
        names += [name] * meta["n_docs"]
        docs.append(np.arange(meta["n_docs"]))
        spans.append(np.diff(np.load(f"{tmp}/tokens/bench/{name}.idx.npy")))
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(len(names)) for _ in range(args.epochs)])
    schedule = pa.table({"source": ["bench"] * len(order), "shard": np.asarray(names)[order],
                         "doc": np.concatenate(docs)[order], "tokens": np.concatenate(spans)[order],
                         "epoch": np.repeat(np.arange(args.epochs), len(names))})
    pq.write_table(schedule, f"{tmp}/schedule.parquet")
    mixes = {p: {"weights": {"bench": 1.0}, "packing": p} for p in ("concat", "bestfit")}
    return {"mixes": mixes, "seq_len": args.seq_len, "seed": 0}, f"{tmp}/schedule.parquet"


def bench_pack(args) -> dict[str, Timing]:
    import tempfile

    from pipeline.data.pack import pack

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        params, schedule = _packed_inputs(args, tmp)

        def run(packing: str) -> int:
            return pack(params, packing, "train", schedule, f"{tmp}/tokens",
                        f"{tmp}/pack/{packing}/train.json")["tokens_in"]

        timings = measure({"pack concat": lambda: run("concat"), "pack bestfit": lambda: run("bestfit")}, args.repeat)
    print(f"{len(args.input)} shard(s) × {args.epochs} epochs = {timings['pack concat'].items:,} scheduled tokens; "
          f"seq_len {args.seq_len}; best of {args.repeat}")
    report(timings, "tokens", baseline="pack concat")
    return timings


def bench_loader(args) -> dict[str, Timing]:
    import tempfile

    import numpy as np
    import torch

    from pipeline.data.loader import PackedLoader, epoch_permutation
    from pipeline.data.pack import pack

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        params, schedule = _packed_inputs(args, tmp)
        metas = {p: pack(params, p, "train", schedule, f"{tmp}/tokens", f"{tmp}/pack/{p}/train.json")
                 for p in ("concat", "bestfit")}
        rows = np.memmap(f"{tmp}/pack/concat/train.bin", dtype=metas["concat"]["dtype"],
                         mode="r").reshape(-1, args.seq_len + 1)
        perm = epoch_permutation(len(rows), 0, 0)

        def raw() -> int:  # the kernel: fancy-index rows of the memmap, one numpy -> torch conversion
            n = 0
            for i in range(args.steps):
                lo = i * args.micro_batch % (len(rows) - args.micro_batch)
                x = torch.from_numpy(rows[perm[lo:lo + args.micro_batch]].astype(np.int64))
                n += x[:, :-1].numel()
            return n

        def loader(packing: str, doc_ids: bool = False):
            def run() -> int:
                it = PackedLoader(f"{tmp}/pack/{packing}/train.json", args.micro_batch, max_epochs=10**6,
                                  with_doc_ids=doc_ids)
                return sum(next(it)[0].numel() for _ in range(args.steps))
            return run

        raw()  # warm the page cache and torch
        for p in metas:  # the integrity check of each pack (once per process, then cached): not timed
            PackedLoader(f"{tmp}/pack/{p}/train.json", args.micro_batch)
        timings = measure({"raw memmap rows": raw, "loader concat": loader("concat"),
                           "loader bestfit": loader("bestfit"), "loader concat +doc_ids": loader("concat", True)},
                          args.repeat)
    print(f"{args.steps} batches of {args.micro_batch} × {args.seq_len} tokens; best of {args.repeat}")
    report(timings, "tokens", baseline="raw memmap rows")
    return timings


# ----------------------------------------------------------------------------- minhash

def _word_pieces(paths: list[str], column: str, words: int | None) -> list[str]:
    """The documents of `paths`, or (with `words`) their pieces of `words` words cut at whitespace,
    formatting kept; a shorter last piece is kept when it has at least half as many words."""
    import re

    import pyarrow.parquet as pq

    docs = [t for p in paths for t in pq.read_table(p, columns=[column]).column(0).to_pylist() if t]
    if not words:
        return docs
    pieces = []
    for doc in docs:
        parts = re.split(r"(\s+)", doc)
        tokens = [w + s for w, s in zip(parts[0::2], parts[1::2] + [""])]
        pieces += ["".join(tokens[i:i + words]) for i in range(0, len(tokens), words)
                   if len(tokens[i:i + words]) >= words // 2]
    return pieces


def bench_minhash(args) -> dict[str, Timing]:
    import tempfile

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasketch import MinHash

    from pipeline.config import resolve_config
    from pipeline.data import dedup, minhash

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    dedup.tune_allocator()  # as the `dedup signatures` CLI does
    dd = resolve_config({})["dedup"]
    params = {"sources": {"bench": {"format": "text", "text_column": "text"}}, "dedup": dd}
    docs = _word_pieces(args.input, args.text_column, args.words)
    sample = docs[:args.datasketch_docs]
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.table({"text": docs}), f"{tmp}/bench.parquet")
        np.save(f"{tmp}/bench.idx.npy", np.arange(len(docs) + 1, dtype=np.int64))
        with open(f"{tmp}/bench.json", "w") as f:
            json.dump({"n_docs": len(docs), "doc_rows": list(range(len(docs)))}, f)

        def end_to_end() -> int:
            return dedup.write_signatures(f"{tmp}/bench.parquet", f"{tmp}/bench.json", "bench", "bench", params,
                                          f"{tmp}/sig.parquet")["n_docs"]

        def shingles(text: str) -> list[bytes]:
            w = minhash.normalize_text(text).encode().split()
            return [b" ".join(w[i:i + dd["ngram"]]) for i in range(len(w) - dd["ngram"] + 1)] or [b" ".join(w)]

        def datasketch(batch: bool):
            def run() -> int:
                for text in sample:
                    m = MinHash(num_perm=dd["num_perm"], seed=dd["seed"])
                    if batch:
                        m.update_batch(shingles(text))
                    else:
                        for s in shingles(text):
                            m.update(s)
                return len(sample)
            return run

        timings = measure({"write_signatures (e2e)": end_to_end, "datasketch update": datasketch(False),
                           "datasketch update_batch": datasketch(True)}, args.repeat)
    words = sum(len(d.split()) for d in docs) / max(len(docs), 1)
    print(f"{len(args.input)} file(s): {len(docs):,} documents of {words:,.0f} words on average (datasketch: first "
          f"{len(sample):,}); num_perm {dd['num_perm']}, {dd['bands']} bands × {dd['rows']} rows, {dd['ngram']}-word "
          f"shingles; 1 thread; best of {args.repeat}")
    report(timings, "docs", baseline="datasketch update")
    return timings


def bench_decontam(args) -> dict[str, Timing]:
    import tempfile

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import resolve_config
    from pipeline.data import decontaminate, dedup
    from pipeline.data.eval_data import build_eval_data
    from pipeline.data.tasks import load_tasks

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    dedup.tune_allocator()
    cfg = resolve_config({})
    tasks, dc = args.tasks or cfg["eval"]["tasks"], cfg["decontaminate"]
    source = {"format": "text", "text_column": "text"}
    params = {"sources": {"bench": source}, "dedup": cfg["dedup"]}
    docs = _word_pieces(args.input, args.text_column, args.words)
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        build_eval_data({"tasks": tasks, "pool_size": cfg["eval"]["core_pool_size"], "seed": 0}, f"{tmp}/eval")
        t0 = time.perf_counter()
        grams = decontaminate.eval_grams(load_tasks(f"{tmp}/eval", tasks), dc["ngram"], dc["min_words"])
        build_s = time.perf_counter() - t0
        pq.write_table(pa.table({"text": docs}), f"{tmp}/bench.parquet")
        np.save(f"{tmp}/bench.idx.npy", np.arange(len(docs) + 1, dtype=np.int64))
        with open(f"{tmp}/bench.json", "w") as f:
            json.dump({"n_docs": len(docs), "doc_rows": list(range(len(docs)))}, f)
        flagged = []

        def decontam() -> int:
            out = decontaminate.decontaminate_shard(f"{tmp}/bench.parquet", f"{tmp}/bench.json", source, grams, True,
                                                    f"{tmp}/flags.parquet", {})
            flagged.append(int(out[2].sum()))
            return len(out[0])

        def signatures() -> int:
            return dedup.write_signatures(f"{tmp}/bench.parquet", f"{tmp}/bench.json", "bench", "bench", params,
                                          f"{tmp}/sig.parquet")["n_docs"]

        timings = measure({"decontaminate (e2e)": decontam, "minhash signatures (e2e)": signatures}, args.repeat)
    words = sum(len(d.split()) for d in docs) / max(len(docs), 1)
    grams_n = sum(len(h) for h in grams.hashes.values())
    print(f"{len(args.input)} file(s): {len(docs):,} documents of {words:,.0f} words on average; eval set: "
          f"{len(tasks)} tasks, {grams_n:,} distinct grams ({dc['ngram']}-grams + short items), built in "
          f"{build_s:.2f} s (untimed); {flagged[-1]} documents flagged; 1 thread; best of {args.repeat}")
    report(timings, "docs", baseline="minhash signatures (e2e)")
    return timings


# ----------------------------------------------------------------------------- per-group jobs through the CLI

GROUP_STAGES = ("tokenize", "signatures")


def run_child(cmd: list[str]) -> float:
    """Run `cmd` to completion (it must succeed) and return its CPU seconds (user + system, all its
    threads and children), measured with os.wait4 so that nothing else on the machine is counted."""
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): {err[-2000:]}")
    return usage.ru_utime + usage.ru_stime


def bench_group(args) -> dict:
    """One per-shard job as the `tokenize` / `dedup_signatures` rule runs it: a new
    Python process handling a group of `--shards` copies of `--input` (interpreter start-up, imports,
    tokenizer load and the group manifest included), against the fastest raw kernel in-process on the
    same documents (tiktoken for tokenize: tokens per CPU-second; for signatures the in-process
    `write_signatures` of one shard: documents per CPU-second)."""
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    from pipeline.config import params_json, resolve_config
    from pipeline.data.contract import iter_documents
    from pipeline.data.encoding import load_tokenizer
    from pipeline.io import read_json
    from pipeline.rules import rule_params

    tok = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        raw = [f"{tmp}/raw/bench/shard_{i:05d}.parquet" for i in range(args.shards)]
        for r in raw:
            Path(r).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.input, r)
        cfg = resolve_config({"sources": {"bench": {"type": "local", "glob": f"{tmp}/raw/bench/*.parquet"}},
                              "mixes": {"m": {"weights": {"bench": 1.0}, "tokens": 1}}, "train": {"mix": "m"}})
        py = [sys.executable, "-m"]
        stage = {"tokenize": "tokenize", "signatures": "dedup_signatures"}[args.stage]
        params = params_json(rule_params(cfg, stage, "bench"))
        tokens = [f"{tmp}/tokens/bench/shard_{i:05d}.json" for i in range(args.shards)]
        tokenize_cmd = py + ["pipeline.data.tokenize", "--params", params_json(rule_params(cfg, "tokenize", "bench")),
                             "--tokenizer", args.tokenizer, "--source", "bench", "--inputs", *raw,
                             "--outputs", *tokens, "--manifest", f"{tmp}/tokens/manifest.json"]
        if args.stage == "tokenize":
            outs, cmd = tokens, tokenize_cmd
        else:
            run_child(tokenize_cmd)  # untimed: signatures read the tokenized shards' metadata
            outs = [f"{tmp}/sig/shard_{i:05d}.parquet" for i in range(args.shards)]
            cmd = py + ["pipeline.data.dedup", "signatures", "--params", params, "--source", "bench", "--inputs", *raw,
                        "--tokens", *tokens, "--outputs", *outs, "--manifest", f"{tmp}/s.json"]
        cpu = min(run_child(cmd) for _ in range(args.repeat))
        if args.stage == "tokenize":
            items, unit = sum(read_json(o)["n_doc_tokens"] for o in outs), "tokens"
        else:
            items, unit = sum(read_json(t)["n_docs"] for t in tokens), "docs"
        texts = [d for b in iter_documents(args.input, {"format": "text"}, 1024) for d in b.docs]
        if args.stage == "signatures":
            from pipeline.data import dedup

            dedup.tune_allocator()
            sig_params = rule_params(cfg, "dedup_signatures", "bench")
            one = {"in-process write_signatures": lambda: dedup.write_signatures(
                raw[0], tokens[0], "bench", "shard_00000", sig_params, f"{tmp}/one.parquet")["n_docs"]}
            logging.getLogger("pipeline").setLevel(logging.ERROR)
            base = measure(one, args.repeat)
        else:
            base = measure(raw_tiktoken(tok.enc, texts), args.repeat)
    best = max(base.values(), key=lambda t: t.per_cpu_s)
    rate = items / cpu
    print(f"{args.stage}: one process for {args.shards} shards ({items:,} {unit}), best of {args.repeat}: "
          f"{cpu:.3f} cpu-s, {rate:,.0f} {unit}/cpu-s = {rate / best.per_cpu_s:.1%} of {best.name} "
          f"({best.per_cpu_s:,.0f} {unit}/cpu-s in-process on one shard)")
    return {"stage": args.stage, "shards": args.shards, "items": items, "cpu_s": cpu, "per_cpu_s": rate,
            "baseline": best.name, "baseline_per_cpu_s": best.per_cpu_s, "ratio": rate / best.per_cpu_s}


def _data_args(p, repeat: int = 3) -> None:
    p.add_argument("--tokenizer", required=True, help="the run's encoding.json (R/tokenizer/encoding.json)")
    p.add_argument("--input", nargs="+", required=True, help="raw shards (parquet) to tokenize and pack")
    p.add_argument("--format", choices=["text", "chat"], default="text")
    p.add_argument("--text-column", default="text")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=8, help="times the schedule repeats the documents")
    p.add_argument("--repeat", type=int, default=repeat)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> Any:
    ap = argparse.ArgumentParser(prog="python benchmarks/data.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize", help="tokenize stage end to end vs raw tiktoken encode, tokens per core")
    t.add_argument("--tokenizer", required=True, help="the run's encoding.json (R/tokenizer/encoding.json)")
    t.add_argument("--input", required=True, help="a raw text shard (parquet)")
    t.add_argument("--text-column", default="text")
    t.add_argument("--batch-size", type=int, default=1024, help="count.batch_size (documents per batch)")
    t.add_argument("--repeat", type=int, default=3)
    t.set_defaults(func=bench_tokenize)
    pk = sub.add_parser("pack", help="pack concat / bestfit, tokens per core")
    _data_args(pk)
    pk.set_defaults(func=bench_pack)
    ld = sub.add_parser("loader", help="PackedLoader batches vs raw memmap rows, tokens per core")
    _data_args(ld)
    ld.add_argument("--micro-batch", type=int, default=16)
    ld.add_argument("--steps", type=int, default=2000, help="batches per timed run")
    ld.set_defaults(func=bench_loader)
    mh = sub.add_parser("minhash", help="dedup signatures end to end vs datasketch, documents per core")
    mh.add_argument("--input", nargs="+", required=True, help="raw text shards (parquet)")
    mh.add_argument("--text-column", default="text")
    mh.add_argument("--words", type=int, help="cut documents into pieces of this many words first")
    mh.add_argument("--datasketch-docs", type=int, default=200, help="documents datasketch hashes per run")
    mh.add_argument("--repeat", type=int, default=3)
    mh.set_defaults(func=bench_minhash)
    dc = sub.add_parser("decontam", help="decontaminate stage end to end vs MinHash signatures, documents per core")
    dc.add_argument("--input", nargs="+", required=True, help="raw text shards (parquet)")
    dc.add_argument("--text-column", default="text")
    dc.add_argument("--words", type=int, help="cut documents into pieces of this many words first")
    dc.add_argument("--tasks", nargs="+", help="eval tasks (default: the schema's eval.tasks)")
    dc.add_argument("--repeat", type=int, default=3)
    dc.set_defaults(func=bench_decontam)
    g = sub.add_parser("group", help="a per-shard job through its CLI (new process, group of shards) vs the kernel")
    g.add_argument("--stage", choices=GROUP_STAGES, required=True)
    g.add_argument("--tokenizer", required=True, help="the run's encoding.json (R/tokenizer/encoding.json)")
    g.add_argument("--input", required=True, help="a raw text shard (parquet), copied --shards times")
    g.add_argument("--shards", type=int, default=16, help="shards in the group (shards_per_job)")
    g.add_argument("--repeat", type=int, default=3)
    g.set_defaults(func=bench_group)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    run_cli(main)
