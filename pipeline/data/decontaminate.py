"""Decontaminate stage: flag every document that shares a word n-gram with a configured benchmark item.

    python -m pipeline.data.decontaminate --params JSON --eval-data R/eval_data \\
        --raw D/{source}/{shard}.parquet ... --tokens R/tokens/{source}/{shard}.json ... \\
        --outdir R/decontam --report R/decontam/report.json

Runs after tokenize and before split, so a changed task list reruns this stage and what follows, never
tokenize. The split stage takes every flagged document out of train and val (split `contam`).

Eval side. For every item of every configured task (scored items and few-shot pool alike) the texts
are the item's upstream `text` (question, passage, gold answer; no template words) and, for
multiple-choice tasks, every choice. Texts are normalised exactly as MinHash dedup normalises
documents (`pipeline.data.minhash`: ASCII-lower-cased words of letters and digits, NFKC for non-ASCII);
a text of at least `ngram` words contributes all its word `ngram`-grams; a shorter one of at least
`min_words` words contributes itself as one gram ("short items use their whole text"); a shorter one
still is too short to be evidence and is only counted (`texts_too_short`).

Hash. A gram of words w_1..w_L hashes to `fmix64(Horner(SHINGLE_SEED, SHINGLE_MULT; word_hash(w_i)))`
over uint64 (the MinHash shingle polynomial, all 64 bits kept and finalised). All grams of all texts
are hashed vectorised (one numpy pass per word position of the gram) into one sorted array per gram
length, with the task each came from.

Document side. The documents are the tokenized ones (as for dedup: document `doc` is raw row
`doc_rows[doc]`, chat documents are their message contents joined by newlines). A shard's documents
are hashed in batches with the same kernels: every window of `ngram` words, and every window of
each short-text length L, inside a document; a document is contaminated when any window's hash is
in the eval set of its length (a 2^-64 false-positive rate per window).

Outputs. `outdir/{source}/{shard}.parquet`, one row per tokenized document in order: `doc` (int64),
`contaminated` (bool), `tasks` (string: the matching tasks, comma-separated, "" when none); and the
report: per source and per task documents and tokens flagged (tokens = the document's span in the
token file, delimiters included, as dedup and split count them), the eval-side counts, a few examples
(source, shard, doc, task, the matching words) and the throughput. With `enabled: false` no document
is flagged. Params: `{"decontaminate": {"enabled", "ngram", "min_words"}, "eval_tasks": [...],
"sources": {name: {format, text_column, messages_column}}}`.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import add_config_args, params_from_args
from pipeline.data.contract import document_texts, load_doc_tokens
from pipeline.data.minhash import SHINGLE_MULT, SHINGLE_SEED, doc_word_hashes, normalize_text, word_hash
from pipeline.data.tasks import load_tasks
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, run_cli, write_json, write_parquet

log = get_logger(__name__)

U64 = np.uint64
BATCH_BYTES = 1 << 19  # text hashed per vectorised batch: its arrays stay in a core's cache (as dedup's)
N_EXAMPLES = 5


# ----------------------------------------------------------------------------- gram hashing

_INV_MULT = U64(pow(int(SHINGLE_MULT), -1, 1 << 64))  # SHINGLE_MULT is odd, so invertible mod 2^64


class Windows:
    """Hashes of word windows of any length in a batch of documents, each in O(1) vector operations.

    The gram hash is Horner's polynomial `SEED * M^L + sum_t w_(i+t) * M^(L-1-t)` (mod 2^64; M odd).
    With the prefix sums `Q_k = sum_(j<k) w_j * M^-j` the sum for the window [i, i+L) is
    `M^(i+L-1) * (Q_(i+L) - Q_i)`: one prefix pass serves every length."""

    def __init__(self, wh: np.ndarray, word_off: np.ndarray):
        n = len(wh)
        self.pow = np.cumprod(np.concatenate([[U64(1)], np.full(n, SHINGLE_MULT, U64)]), dtype=U64)
        inv = np.cumprod(np.concatenate([[U64(1)], np.full(max(n - 1, 0), _INV_MULT, U64)]), dtype=U64)
        self.prefix = np.concatenate([[U64(0)], np.cumsum(wh * inv[:n], dtype=U64)])
        self.end = np.repeat(word_off[1:], np.diff(word_off))  # each word's document end (word index)

    def all_hashes(self, L: int) -> np.ndarray:
        """Hash of the window of L words starting at every word position (contiguous slices only;
        windows that cross a document's end included: `inside` tells them apart)."""
        n = max(len(self.end) - L + 1, 0)
        h = self.pow[L - 1:L - 1 + n] * (self.prefix[L:L + n] - self.prefix[:n])
        h += self.pow[L:L + 1] * SHINGLE_SEED  # (an array product: wraps mod 2^64 silently, as intended)
        return h

    def inside(self, pos: np.ndarray, L: int) -> np.ndarray:
        """Whether the L-word windows starting at `pos` end within their document."""
        return pos + L <= self.end[pos]

    def hashes(self, L: int) -> tuple[np.ndarray, np.ndarray]:
        """(hash, start position) of every window of L words inside one document."""
        h = self.all_hashes(L)
        pos = np.flatnonzero(self.inside(np.arange(len(h)), L))
        return h[pos], pos


def window_hashes(wh: np.ndarray, word_off: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every window of `n` consecutive words that lies inside one document, and the word
    position where each starts. `wh`/`word_off` as `minhash.doc_word_hashes` returns them."""
    return Windows(wh, word_off).hashes(n)


def gram_hash(words: list[str]) -> int:
    """Scalar reference of one gram's hash (Horner's rule; tests check the vectorised kernel against it)."""
    acc = np.array([SHINGLE_SEED], dtype=U64)
    for w in words:
        acc = acc * SHINGLE_MULT + U64(word_hash(w.encode()))
    return int(acc[0])


@dataclass
class EvalGrams:
    """Sorted gram hashes per gram length, each with the index of the task it came from, and per length
    a filter indexed by the hashes' top bits (about 16 slots per gram): a window whose slot is clear
    is no eval gram; the exact lookup (binary search) runs only for the few percent whose slot is set."""

    tasks: list[str]
    hashes: dict[int, np.ndarray]
    task_of: dict[int, np.ndarray]
    counts: dict
    shift: dict[int, np.uint64] = field(default_factory=dict)
    filters: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        for L, h in self.hashes.items():
            b = int(min(max(np.ceil(np.log2(max(len(h), 1) * 16)), 12), 28))  # <= 256 MiB for huge sets
            self.shift[L] = U64(64 - b)
            self.filters[L] = np.zeros(1 << b, bool)
            self.filters[L][h >> self.shift[L]] = True

    def lookup(self, L: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices into `h` that are eval grams of length L, their index in `hashes[L]`)."""
        table = self.hashes[L]
        cand = np.flatnonzero(self.filters[L][h >> self.shift[L]])
        at = np.minimum(np.searchsorted(table, h[cand]), len(table) - 1)
        hit = table[at] == h[cand]
        return cand[hit], at[hit]


def eval_texts(task: dict) -> list[str]:
    """The texts of a task that training documents must not share n-grams with (module docstring)."""
    out = []
    for item in task["pool"] + task["items"]:
        out.append(item["text"])
        if task["type"] == "multiple_choice":
            out += item["continuations"]
    return out


def eval_grams(tasks: dict[str, dict], ngram: int, min_words: int) -> EvalGrams:
    names = list(tasks)
    hashes: dict[int, list] = {}
    owners: dict[int, list] = {}
    counts = {}
    for t, name in enumerate(names):
        texts = eval_texts(tasks[name])
        wh, off = doc_word_hashes(pa.array(texts, pa.large_string()))
        n_words = np.diff(off)
        windows = Windows(wh, off)
        short = np.flatnonzero((n_words < ngram) & (n_words >= min_words))
        h, _ = windows.hashes(ngram)
        hashes.setdefault(ngram, []).append(h)
        owners.setdefault(ngram, []).append(np.full(len(h), t, np.int32))
        for L in np.unique(n_words[short]).tolist():
            hs, pos = windows.hashes(L)  # a short text's only L-window starts at its first word
            hs = hs[np.isin(pos, off[short[n_words[short] == L]])]
            hashes.setdefault(L, []).append(hs)
            owners.setdefault(L, []).append(np.full(len(hs), t, np.int32))
        counts[name] = {"texts": len(texts), "texts_long": int((n_words >= ngram).sum()), "texts_short": len(short),
                        "texts_too_short": int((n_words < min_words).sum()), "grams": len(h) + len(short)}
    out_h, out_t = {}, {}
    for L in hashes:
        h, t = np.concatenate(hashes[L]), np.concatenate(owners[L])
        order = np.argsort(h, kind="stable")
        h, t = h[order], t[order]
        first = np.ones(len(h), bool)  # one owner per hash: the first configured task
        first[1:] = h[1:] != h[:-1]
        out_h[L], out_t[L] = h[first], t[first]
    return EvalGrams(names, out_h, out_t, counts)


def find_hits(grams: EvalGrams, wh: np.ndarray, word_off: np.ndarray) -> tuple[np.ndarray, ...]:
    """(document index, task index, first word position, gram length) of every matching window of a batch."""
    docs, tasks, starts, lengths = [], [], [], []
    windows = Windows(wh, word_off)
    for L, table in grams.hashes.items():
        if len(table) == 0:
            continue
        hit, at = grams.lookup(L, windows.all_hashes(L))
        keep = windows.inside(hit, L)  # drop windows that run into the next document
        pos, at = hit[keep], at[keep]  # window start = word position
        docs.append(np.searchsorted(word_off, pos, side="right") - 1)
        tasks.append(grams.task_of[L][at])
        starts.append(pos)
        lengths.append(np.full(len(pos), L))
    if not docs:
        return (np.zeros(0, np.int64),) * 4
    return tuple(np.concatenate(x) for x in (docs, tasks, starts, lengths))


# ----------------------------------------------------------------------------- the stage

def _name(path: Path, suffix: str) -> tuple[str, str]:
    return path.parent.name, path.name.removesuffix(suffix)


def flag_shard(texts: pa.Array, grams: EvalGrams, enabled: bool) -> tuple[np.ndarray, list[set], list]:
    """(contaminated bool per document, matching task indices per document, one example per flagged
    document as (doc, task index, word position in the document, gram length))."""
    n = len(texts)
    flags = np.zeros(n, dtype=bool)
    which: list[set] = [set() for _ in range(n)]
    examples = []
    if not enabled:
        return flags, which, examples
    ends = np.cumsum(pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False))
    cuts = np.unique(np.searchsorted(ends, np.arange(BATCH_BYTES, ends[-1] if n else 0, BATCH_BYTES)) + 1)
    bounds = [0, *cuts[cuts < n].tolist(), n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        wh, off = doc_word_hashes(texts.slice(a, b - a))
        docs, tasks, starts, lengths = find_hits(grams, wh, off)
        for d, t, s, L in zip(docs.tolist(), tasks.tolist(), starts.tolist(), lengths.tolist()):
            if not which[a + d]:
                examples.append((a + d, t, s - int(off[d]), L))
            which[a + d].add(t)
        flags[a + np.unique(docs)] = True
    return flags, which, examples


def decontaminate_shard(raw: Path, tokens_json: Path, source: dict, grams: EvalGrams, enabled: bool, out: Path,
                        meta: dict) -> tuple:
    """One shard: read its documents' text, flag them, write the flag file. Returns (texts, span
    tokens, flags, matching task indices, examples) for the report."""
    tok_meta, tokens = load_doc_tokens(tokens_json)
    texts = document_texts(raw, source, tok_meta["doc_rows"])
    flags, which, examples = flag_shard(texts, grams, enabled)
    names = [",".join(grams.tasks[t] for t in sorted(w)) for w in which]
    table = pa.table({"doc": np.arange(len(texts), dtype=np.int64), "contaminated": flags,
                      "tasks": pa.array(names, pa.string())})
    write_parquet(out, table, meta)
    return texts, tokens, flags, which, examples


def run_decontaminate(params: dict, eval_dir, raw_paths: list, token_paths: list, outdir, report_path) -> dict:
    """The stage (module docstring); returns the report."""
    dc = params["decontaminate"]
    raws = {_name(Path(p), ".parquet"): Path(p) for p in raw_paths}
    toks = {_name(Path(p), ".json"): Path(p) for p in token_paths}
    if set(raws) != set(toks) or not raws:
        missing = sorted(set(raws) ^ set(toks))
        raise PipelineError("raw shards and tokenized shards must name the same shards (--raw, --tokens); "
                            f"differ for: {', '.join(map('/'.join, missing)) or 'none given'}")
    tasks = load_tasks(eval_dir, params["eval_tasks"])
    grams = eval_grams(tasks, dc["ngram"], dc["min_words"])
    per_source: dict = {}
    examples = []
    t0, n_docs = time.perf_counter(), 0
    for (source, shard) in sorted(raws):
        if source not in params["sources"]:
            raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(params['sources'])})")
        meta = provenance("decontaminate", params, [raws[source, shard], toks[source, shard]], source=source,
                          shard=shard)
        texts, tokens, flags, which, ex = decontaminate_shard(
            raws[source, shard], toks[source, shard], params["sources"][source], grams, dc["enabled"],
            Path(outdir) / source / f"{shard}.parquet", meta)
        n_docs += len(texts)
        src = per_source.setdefault(source, {"documents": 0, "tokens": 0, "flagged": {"documents": 0, "tokens": 0},
                                             "by_task": {}})
        src["documents"] += len(texts)
        src["tokens"] += int(tokens.sum())
        src["flagged"]["documents"] += int(flags.sum())
        src["flagged"]["tokens"] += int(tokens[flags].sum())
        for d in np.flatnonzero(flags):
            for t in which[d]:
                bt = src["by_task"].setdefault(grams.tasks[t], {"documents": 0, "tokens": 0})
                bt["documents"] += 1
                bt["tokens"] += int(tokens[d])
        for d, t, s, L in ex[:max(0, N_EXAMPLES - len(examples))]:
            words = normalize_text(texts[d].as_py()).split()
            examples.append({"source": source, "shard": shard, "doc": d, "task": grams.tasks[t],
                             "words": " ".join(words[s:s + L])})
    seconds = time.perf_counter() - t0
    report = {
        "enabled": dc["enabled"], "ngram": dc["ngram"], "min_words": dc["min_words"], "tasks": grams.tasks,
        "eval": grams.counts, "per_source": per_source,
        "total": {k: sum(s["flagged"][k] for s in per_source.values()) for k in ("documents", "tokens")},
        "examples": examples, "documents": n_docs, "seconds": seconds,
        "docs_per_s": n_docs / seconds if seconds > 0 else None,
        "meta": provenance("decontaminate", params, [*raw_paths, *token_paths]),
    }
    write_json(report_path, report)
    log.info("%d of %d documents share a %d-gram with %s (%.0f docs/s)", report["total"]["documents"], n_docs,
             dc["ngram"], ", ".join(grams.tasks), report["docs_per_s"] or 0)
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.decontaminate", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--eval-data", required=True, help="R/eval_data (task files of the eval_data stage)")
    ap.add_argument("--raw", nargs="+", required=True, help="D/{source}/{shard}.parquet, every shard")
    ap.add_argument("--tokens", nargs="+", required=True, help="R/tokens/{source}/{shard}.json, every shard")
    ap.add_argument("--outdir", required=True, help="R/decontam")
    ap.add_argument("--report", required=True, help="R/decontam/report.json")
    args = ap.parse_args(argv)
    run_decontaminate(params_from_args(args, "decontaminate"), args.eval_data, args.raw, args.tokens, args.outdir,
                      args.report)


if __name__ == "__main__":
    run_cli(main)
