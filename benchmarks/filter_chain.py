"""The filter chain's cost, one thread, CPU time of this process (`time.process_time`), best of --repeat.

    python benchmarks/filter_chain.py rates [--docs 3000] [--repeat 3] [--write pipeline/planning/filter_rates.json]
    python benchmarks/filter_chain.py tokenize [--tokenizer T] [--input data/sample/web/*.parquet | --rehearsal N]
    python benchmarks/filter_chain.py datatrove [--docs 1400]

`rates`: on FineWeb-shaped documents made as benchmarks/data_scale.py makes its rehearsal's and on the sample's
web shards: `base` (`filter_shard` with an empty chain: read and write), `words` (the word split, cold, as in
a new job), each filter alone (CPU-s per MB, its words split; language ID through `run_chain` from an empty
cache), and beside them the measured totals of config.yaml's six-filter chain, the schema's default chain and
the presets' language ID + PII (cold caches).
`--write` stores the rates `pipeline.planning.data_cost.filter_cpu_s_per_mb` sums.
`tokenize`: the presets' chain (`filter_shard`
and `run_chain`) beside `tokenize_shard` and raw tiktoken on the same shard (the inputs written as one), same
run; without --tokenizer a 4,096-token BPE is trained on the sample first. `datatrove`: each filter alone
beside datatrove 0.10.1's step on the same documents (the broad corpus and every 4th sample document).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import logging
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "data"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline.data import text_filters as F  # noqa: E402

SAMPLE = sorted(glob.glob(str(ROOT / "data/sample/web/*.parquet")))
PRESETS = [{"name": "language"}, {"name": "pii"}]


def config_chain() -> list[dict]:
    import yaml

    return yaml.safe_load((ROOT / "config.yaml").read_text())["filter"]


def cold() -> None:
    """Empty the per-process caches, as a new job starts."""
    F._splitter().cache.clear()
    F._IS_PUNCT.clear()
    F._lid().clear()


def cpu(fn, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        cold()
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def rehearsal_docs(n: int, seed: int = 0) -> list[str]:
    """FineWeb-shaped documents as benchmarks/data_scale.py's `build_corpus` makes them (no duplicates)."""
    from data_scale import sentences

    pool = np.array(sentences(), dtype=object)
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(math.log(16.0) - 0.32, 0.8, n).astype(int))
    picks = rng.integers(0, len(pool), int(lengths.sum()))
    ends = np.cumsum(lengths)
    return [" ".join(pool[picks[e - k:e]]) for e, k in zip(ends, lengths)]


def sample_docs() -> list[str]:
    return [t for f in SAMPLE for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]


def mb_of(docs: list[str]) -> float:
    return sum(len(d.encode()) for d in docs) / 1e6


def base_rate(docs: list[str], repeat: int) -> float:
    """`filter_shard` with an empty chain over ``docs`` written as one shard: CPU-s per MB."""
    from pipeline.data.filter import filter_shard

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "raw" / "web" / "shard.parquet"
        src.parent.mkdir(parents=True)
        pq.write_table(pa.table({"text": docs}), src, row_group_size=1024)
        out = Path(tmp) / "out" / "web"
        out.mkdir(parents=True)
        params = {"sources": {"web": {"format": "text", "text_column": "text"}}}
        n = [0]

        def run():
            n[0] += 1
            filter_shard([], src, out / f"shard{n[0]}.parquet", "web", params)

        return cpu(run, repeat) / mb_of(docs)


def cold_warm(fn, keys, repeat: int) -> tuple[float, float, int]:
    """(cold, warm, keys): `fn`'s CPU seconds from empty caches and then again with them filled (best of
    `repeat` each), and `keys()`, the keys the cold run put in its cache."""
    c = w = math.inf
    for _ in range(repeat):
        cold()
        t = time.process_time()
        fn()
        c, n = min(c, time.process_time() - t), keys()
        t = time.process_time()
        fn()
        w = min(w, time.process_time() - t)
    return c, w, n


def cache_entry(cold_s: float, warm_s: float, keys: int, mb: float) -> dict:
    return {"cold_cpu_s_per_mb": round(cold_s / mb, 4), "keys": keys,
            "cpu_s_per_key": float(f"{max(cold_s - warm_s, 0.0) / keys:.3g}")}


def alone_rate(docs: list[str], words: list[list[str]], spec: dict, repeat: int) -> tuple[float, dict | None]:
    """One filter over every document, the words already split (as the chain shares them): CPU-s per MB, and
    for language ID (documents in batches through `run_chain`, as the chain runs it) its word cache's fill:
    the rate is then the warm one."""
    (f,) = F.build_chain([spec])
    if isinstance(f, F.Language):
        c, w, n = cold_warm(lambda: F.run_chain(docs, [f]), lambda: F._lid()._n, repeat)
        return w / mb_of(docs), cache_entry(c, w, n, mb_of(docs))
    if hasattr(f, "edit"):
        run = lambda: [f.edit(d) for d in docs]
    else:
        run = lambda: [f.check(d, {"words": w}) for d, w in zip(docs, words)]
    run()
    best = math.inf
    for _ in range(repeat):  # warm: the words' chunks were split by `words` (a chain shares that work too)
        t = time.process_time()
        run()
        best = min(best, time.process_time() - t)
    return best / mb_of(docs), None


def real_docs() -> list[str]:
    """The sample's web text in its own order, cut at sentences into documents shaped as `rehearsal_docs`'s
    (whose sentences are drawn at random from the same pool, so their vocabulary stops growing)."""
    from data_scale import sentences

    pool = sentences()
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(math.log(16.0) - 0.32, 0.8, len(pool)).astype(int))
    ends = np.minimum(np.cumsum(lengths), len(pool))
    return [" ".join(pool[a:b]) for a, b in zip([0, *ends[:-1]], ends) if a < b]


def heaps(docs: list[str], parts: int = 6) -> dict:
    """Each cache's distinct keys after growing prefixes of `docs` (1/2**(parts-1) .. all), and Heaps' law
    ``keys = keys_per_mb * mb ** beta`` fitted to them (least squares in log-log)."""
    (lang,) = F.build_chain([{"name": "language"}])
    points = []
    for i in reversed(range(parts)):
        head = docs[:len(docs) >> i]
        cold()
        F.run_chain(head, [lang])
        for d in head:
            F.words(d)
        points.append((mb_of(head), len(F._splitter().cache), F._lid()._n))
    mb = np.log([p[0] for p in points])
    out = {}
    for name, col in (("words", 1), ("language", 2)):
        beta, log_k = np.polyfit(mb, np.log([p[col] for p in points]), 1)
        out[name] = {"keys_per_mb": round(float(np.exp(log_k)), 1), "beta": round(float(beta), 4),
                     "points": [[round(p[0], 3), p[col]] for p in points]}
    return out


def cmd_rates(args) -> None:
    from pipeline.data.lid import CACHE_WORDS
    from pipeline.planning.data_cost import filter_cpu_s_per_mb, filter_fill_cpu_s

    inputs = {"rehearsal": rehearsal_docs(args.docs), "sample": sample_docs()}
    chains = {"config.yaml": config_chain(), "schema default": F.DEFAULT_CHAIN, "presets": PRESETS}
    fit = heaps(real_docs())
    print("Heaps' law on the sample's text as FineWeb-shaped documents: " + ", ".join(
        f"{k} {v['keys_per_mb']:.0f} * MB^{v['beta']:.3f}" for k, v in fit.items()), flush=True)
    caps = {"words": F._WordSplitter.MAX_CACHE, "language": CACHE_WORDS}
    result: dict = {"heaps": fit}
    for name in args.inputs:
        docs = inputs[name]
        mb = mb_of(docs)
        print(f"{name}: {len(docs):,} documents, {mb:.2f} MB", flush=True)
        c, w, n = cold_warm(lambda docs=docs: [F.words(d) for d in docs], lambda: len(F._splitter().cache),
                            args.repeat)
        words = [F.words(d) for d in docs]
        rates = {"base": round(base_rate(docs, args.repeat), 4), "words": round(w / mb, 4)}
        caches = {"words": cache_entry(c, w, n, mb)}
        specs = [*F.DEFAULT_CHAIN, {"name": "fasttext_classifier", "settings": {  # lid.176 as a stand-in classifier
            "path": str(F._lid_model_path()), "label": "en"}}]
        for spec in specs:
            r, cache = alone_rate(docs, words, spec, args.repeat)
            rates[spec["name"]] = round(r, 4)
            if cache:
                caches[spec["name"]] = cache
        print("  " + ", ".join(f"{k} {v:.4f}" for k, v in rates.items()) + " CPU-s/MB (words, language: warm)")
        said = [f"{k} {v['keys']:,} keys, {v['cpu_s_per_key'] * 1e6:.1f} us a key (cold {v['cold_cpu_s_per_mb']:.4f} "
                "CPU-s/MB)" for k, v in caches.items()]
        print("  caches: " + ", ".join(said), flush=True)
        result[name] = {"documents": len(docs), "mb": round(mb, 3), "rates": rates, "caches": caches, "chains": {}}
        priced = rates_file(result, name, caps, "")
        for cname, spec in chains.items():
            chain = F.build_chain(spec)
            total = cpu(lambda chain=chain, docs=docs: F.run_chain(docs, chain), args.repeat) / mb + rates["base"]
            summed = filter_cpu_s_per_mb(spec, priced) + filter_fill_cpu_s(spec, mb * 1e6, priced) / mb
            kept = float(F.run_chain(docs, chain).kept.mean())
            result[name]["chains"][cname] = {"measured": round(total, 4), "summed": round(summed, 4),
                                             "kept_fraction": round(kept, 4)}
            print(f"  {cname}: measured {total:.4f} CPU-s/MB ({1 / total:.2f} MB/CPU-s; run_chain + base, cold "
                  f"caches), priced {summed:.4f} = {summed / total:.2f}x; kept {kept:.2f}", flush=True)
    if args.write:
        command = ("PYTHONPATH=. python benchmarks/filter_chain.py rates --write pipeline/planning/filter_rates.json "
                   f"--docs {args.docs} --repeat {args.repeat}")
        Path(args.write).write_text(json.dumps(rates_file(result, "rehearsal", caps, command), indent=1) + "\n")
        print(f"wrote {args.write}")


def rates_file(result: dict, name: str, caps: dict, command: str) -> dict:
    """The rates file: input `name`'s rates (the FineWeb-shaped one's when written), each with its command and
    date, the word split's and language ID's cache fill (CPU-s a key; keys by `heaps`), and every input's run."""
    when = datetime.date.today().isoformat()
    machine = f"{platform.machine()} {platform.python_version()}, one thread, shared 2-core VM"

    def entry(rate: float, what: str, cache: str | None = None) -> dict:
        e = {"cpu_s_per_mb": rate, "what": what, "command": command, "date": when, "machine": machine}
        if cache:
            fit = result["heaps"][cache]
            e["cache"] = {"cpu_s_per_key": result[name]["caches"][cache]["cpu_s_per_key"], "cap": caps[cache],
                          "keys_per_mb": fit["keys_per_mb"], "beta": fit["beta"],
                          "what": "a job's cache fill: CPU-s a key missed, the keys by Heaps' law fitted on the "
                                  "sample's text (pipeline.planning.data_cost.cache_misses)"}
        return e

    rates = result[name]["rates"]
    return {
        "unit": "CPU-s per MB (10**6 bytes of UTF-8 text in the filter stage's input)",
        "base": entry(rates["base"], "filter_shard with an empty chain: the shard's read, the decisions' write"),
        "words": entry(rates["words"], "splitting the words (warm cache), once per chain with a word-based filter",
                       "words"),
        "filters": {n: entry(r, "the filter alone over every document, " + (
            "through run_chain, its word cache warm" if n == "language" else "its words already split"),
                             "language" if n == "language" else None)
                    for n, r in rates.items() if n not in ("base", "words")},
        "inputs": result,
    }


def trained_tokenizer(tmp: str) -> str:
    from pipeline.config import resolve_config
    from pipeline.data.train_tokenizer import build_tokenizer
    from pipeline.rules import rule_params

    params = rule_params(resolve_config({}), "tokenizer")
    out = Path(tmp) / "tokenizer" / "encoding.json"
    out.parent.mkdir(parents=True)
    links = Path(tmp) / "web"
    links.mkdir()
    for f in SAMPLE:
        (links / Path(f).name).symlink_to(f)
    build_tokenizer(params, sorted(str(p) for p in links.iterdir()), out)
    return str(out)


def cmd_tokenize(args) -> None:
    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.filter import filter_shard
    from pipeline.data.tokenize import tokenize_shard

    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tokenizer or trained_tokenizer(tmp)
        tok = load_tokenizer(path)
        texts = ([t for f in args.input for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
                 if not args.rehearsal else rehearsal_docs(args.rehearsal))
        shard = Path(tmp) / "one" / "shard.parquet"  # the inputs as one shard
        shard.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"text": texts}), shard, row_group_size=1024)
        mb = mb_of(texts)
        params = {"sources": {"web": {"format": "text", "text_column": "text"}}, "count": {"batch_size": 1024}}
        chain = F.build_chain(PRESETS)
        F.run_chain(texts[:20], chain)
        n = [0]

        def filter_e2e():
            n[0] += 1
            filter_shard(chain, shard, Path(tmp) / f"f{n[0]}.parquet", "web", params)

        def tokenize_e2e():
            tokenize_shard(tok, shard, f"{tmp}/tok/web/shard.json", "web", "shard", params)

        fns = {
            "presets' chain, filter_shard (read, language ID + PII, write)": filter_e2e,
            "presets' chain, run_chain only": lambda: F.run_chain(texts, chain),
            "tokenize_shard (read, encode, write)": tokenize_e2e,
            "raw tiktoken encode_ordinary_batch": lambda: tok.enc.encode_ordinary_batch(texts, num_threads=1),
        }
        rows = dict.fromkeys(fns, math.inf)
        for _ in range(args.repeat):  # interleaved, so that a change of the machine's load hits every row alike
            for name, fn in fns.items():
                rows[name] = min(rows[name], cpu(fn, 1))
    what = (f"{args.rehearsal} rehearsal-shaped documents" if args.rehearsal
            else " ".join(Path(f).name for f in args.input))
    print(f"{what} as one shard: {len(texts):,} documents, {mb:.2f} MB; tokenizer {tok.enc.name} "
          f"(n_vocab {tok.n_vocab}); best of {args.repeat}, one thread")
    ref = rows["tokenize_shard (read, encode, write)"]
    for name, t in rows.items():
        print(f"  {name:<62} {t:7.3f} CPU-s  {mb / t:7.2f} MB/CPU-s  {ref / t:5.2f}x tokenize_shard's speed")


def cmd_datatrove(args) -> None:
    from broad_corpus import broad_corpus
    from test_filter_agreement import _datatrove_step

    docs = [t for _, t in broad_corpus(args.docs)] + sample_docs()[::4]
    mb = mb_of(docs)
    print(f"{len(docs):,} documents (broad corpus + every 4th of the sample's), {mb:.2f} MB; best of {args.repeat}")
    for name in ("gopher_repetition", "gopher_quality", "c4", "fineweb_quality", "pii", "language"):
        chain = F.build_chain([{"name": name}])
        F.run_chain(docs[:20], chain)
        ours = cpu(lambda chain=chain: F.run_chain(docs, chain), args.repeat)
        step = _datatrove_step(name)
        step(docs[0])
        theirs = min(_timed(lambda step=step: [step(d) for d in docs]) for _ in range(args.dt_repeat))
        print(f"  {name:<18} ours {mb / ours:7.2f} MB/CPU-s  datatrove {mb / theirs:6.2f} MB/CPU-s  "
              f"{theirs / ours:5.1f}x")


def _timed(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rates")
    r.add_argument("--docs", type=int, default=3000)
    r.add_argument("--inputs", nargs="+", default=["rehearsal", "sample"], choices=["rehearsal", "sample"])
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--write", default=None)
    t = sub.add_parser("tokenize")
    t.add_argument("--tokenizer", default=None)
    t.add_argument("--input", nargs="+", default=SAMPLE)
    t.add_argument("--rehearsal", type=int, default=0, help="N FineWeb-shaped documents instead of --input")
    t.add_argument("--repeat", type=int, default=3)
    d = sub.add_parser("datatrove")
    d.add_argument("--docs", type=int, default=1400)
    d.add_argument("--repeat", type=int, default=3)
    d.add_argument("--dt-repeat", type=int, default=1)
    args = ap.parse_args()
    {"rates": cmd_rates, "tokenize": cmd_tokenize, "datatrove": cmd_datatrove}[args.cmd](args)


if __name__ == "__main__":
    main()
