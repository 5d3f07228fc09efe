"""Decontaminate stage: flag every document that shares a word n-gram with a configured benchmark item.

    python -m pipeline.data.decontaminate grams --params JSON --eval-data R/eval_data --out R/decontam/grams.parquet
    python -m pipeline.data.decontaminate flags --params JSON --grams R/decontam/grams.parquet --source S ...
    python -m pipeline.data.decontaminate report --params JSON --grams R/decontam/grams.parquet ...

Three jobs: `grams` builds the eval n-gram table once, `flags` runs per shard group (each shard's flag file
and its report part), `report` joins the parts; `run_decontaminate` is the same stage in one process (the
reference the jobs are tested against). It runs after tokenize and before split, which takes every flagged
document out of train and val; the report's ``contaminated_items`` let evaluation score the clean items.

The eval and document sides, the hash, the item side and the outputs: docs/data-stages.md,
"Decontamination".
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import add_config_args, decontaminate_slice, params_from_args
from pipeline.data.contract import add_group_args, document_texts, load_doc_tokens, write_manifest
from pipeline.data.minhash import SHINGLE_MULT, SHINGLE_SEED, doc_word_hashes, normalize_text, word_hash
from pipeline.data.tasks import load_tasks
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, read_json, read_parquet_meta, run_cli, write_json, write_parquet
from pipeline.run_config import run_config

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


def _increasing(h: np.ndarray, t: np.ndarray, item: np.ndarray) -> bool:
    """Whether the rows (h, t, item) are strictly increasing: sorted and distinct."""
    same_h, same_t = h[1:] == h[:-1], t[1:] == t[:-1]
    return bool(np.all((h[1:] > h[:-1]) | same_h & ((t[1:] > t[:-1]) | same_t & (item[1:] > item[:-1]))))


@dataclass
class EvalGrams:
    """The eval grams per gram length as rows (hash, task index, scored item index or -1 for a pool
    item's gram) sorted by hash, task, item (`rows`: one per distinct triple); derived from them, the
    distinct hashes (`hashes`) each with the first task it came from (`task_of`, what a document's flag
    names), and per length a filter indexed by the hashes' top bits (about 16 slots per gram): a window
    whose slot is clear is no eval gram; the exact lookup (binary search) runs only for the few percent
    whose slot is set. `item_ids`: per task the ids of its scored items (an item index's id)."""

    tasks: list[str]
    rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    counts: dict
    item_ids: dict[str, list[str]]
    hashes: dict[int, np.ndarray] = field(default_factory=dict)
    task_of: dict[int, np.ndarray] = field(default_factory=dict)
    shift: dict[int, np.uint64] = field(default_factory=dict)
    filters: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        for L, (h, t, item) in self.rows.items():
            if not _increasing(h, t, item):  # (rows read back from the table are: no sort in every flags job)
                order = np.lexsort((item, t, h))
                h, t, item = h[order], t[order], item[order]
                new = np.ones(len(h), bool)
                new[1:] = (h[1:] != h[:-1]) | (t[1:] != t[:-1]) | (item[1:] != item[:-1])
                h, t, item = h[new], t[new], item[new]
            self.rows[L] = h, t, item
            first = np.ones(len(h), bool)  # one owner per hash: the first configured task
            first[1:] = h[1:] != h[:-1]
            self.hashes[L], self.task_of[L] = h[first], t[first]
            h = self.hashes[L]
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

    def items_of(self, L: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(task index, scored item index) of every scored item one of the length-L grams `h` came from."""
        rh, rt, ri = self.rows[L]
        u = np.unique(h)
        lo, hi = np.searchsorted(rh, u, "left"), np.searchsorted(rh, u, "right")
        n = hi - lo
        at = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())  # every row of each hash
        at = at[ri[at] >= 0]
        return rt[at], ri[at]


def eval_texts(task: dict) -> list[str]:
    """The texts of a task that training documents must not share n-grams with (docs/data-stages.md)."""
    return [text for text, _ in _owned_texts(task)]


def _owned_texts(task: dict) -> list[tuple[str, int]]:
    """`eval_texts` with the scored item each text belongs to (its index in `items`; -1: the pool)."""
    out = []
    for i, item in enumerate(task["pool"] + task["items"]):
        owner = i - len(task["pool"])
        out.append((item["text"], owner))
        if task["type"] == "multiple_choice":
            out += [(c, owner) for c in item["continuations"]]
    return out


def eval_grams(tasks: dict[str, dict], ngram: int, min_words: int) -> EvalGrams:
    names = list(tasks)
    rows: dict[int, list] = {}
    counts = {}
    for t, name in enumerate(names):
        owned = _owned_texts(tasks[name])
        texts, owner = [x for x, _ in owned], np.array([i for _, i in owned], np.int32)
        wh, off = doc_word_hashes(pa.array(texts, pa.large_string()))
        n_words = np.diff(off)
        windows = Windows(wh, off)
        text_of = np.repeat(np.arange(len(texts)), n_words)  # each word's text
        short = np.flatnonzero((n_words < ngram) & (n_words >= min_words))
        h, pos = windows.hashes(ngram)
        rows.setdefault(ngram, []).append((h, np.full(len(h), t, np.int32), owner[text_of[pos]]))
        for L in np.unique(n_words[short]).tolist():
            hs, pos = windows.hashes(L)  # a short text's only L-window starts at its first word
            keep = np.isin(pos, off[short[n_words[short] == L]])
            hs, pos = hs[keep], pos[keep]
            rows.setdefault(L, []).append((hs, np.full(len(hs), t, np.int32), owner[text_of[pos]]))
        counts[name] = {"texts": len(texts), "texts_long": int((n_words >= ngram).sum()), "texts_short": len(short),
                        "texts_too_short": int((n_words < min_words).sum()), "grams": len(h) + len(short),
                        "items": len(tasks[name]["items"])}
    return EvalGrams(names, {L: tuple(map(np.concatenate, zip(*parts))) for L, parts in rows.items()}, counts,
                     {name: [it["id"] for it in tasks[name]["items"]] for name in names})


def find_hits(grams: EvalGrams, wh: np.ndarray, word_off: np.ndarray) -> tuple[np.ndarray, ...]:
    """(document index, task index, first word position, gram length, gram hash) of every matching window
    of a batch."""
    docs, tasks, starts, lengths, hashes = [], [], [], [], []
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
        hashes.append(grams.hashes[L][at])
    if not docs:
        return (*(np.zeros(0, np.int64),) * 4, np.zeros(0, U64))
    return tuple(np.concatenate(x) for x in (docs, tasks, starts, lengths, hashes))


# ----------------------------------------------------------------------------- the stage

def _name(path: Path, suffix: str) -> tuple[str, str]:
    return path.parent.name, path.name.removesuffix(suffix)


def flag_shard(texts: pa.Array, grams: EvalGrams, enabled: bool) -> tuple[np.ndarray, list[set], list, dict]:
    """(contaminated bool per document, matching task indices per document, one example per flagged
    document as (doc, task index, word position in the document, gram length), and the item side:
    {task index: sorted indices of the scored items that share a gram with a document of the shard})."""
    n = len(texts)
    flags = np.zeros(n, dtype=bool)
    which: list[set] = [set() for _ in range(n)]
    examples = []
    matched: dict[int, list] = {}  # gram length -> the hashes that matched, per batch
    if not enabled:
        return flags, which, examples, {}
    ends = np.cumsum(pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False))
    cuts = np.unique(np.searchsorted(ends, np.arange(BATCH_BYTES, ends[-1] if n else 0, BATCH_BYTES)) + 1)
    bounds = [0, *cuts[cuts < n].tolist(), n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        wh, off = doc_word_hashes(texts.slice(a, b - a))
        docs, tasks, starts, lengths, hashes = find_hits(grams, wh, off)
        for d, t, s, L in zip(docs.tolist(), tasks.tolist(), starts.tolist(), lengths.tolist()):
            if not which[a + d]:
                examples.append((a + d, t, s - int(off[d]), L))
            which[a + d].add(t)
        flags[a + np.unique(docs)] = True
        for L in np.unique(lengths).tolist():
            matched.setdefault(L, []).append(np.unique(hashes[lengths == L]))
    seen: dict[int, set] = {}  # the matched grams' scored items: every owner, not only the flag's first task
    for L, hs in matched.items():
        for t, i in zip(*(x.tolist() for x in grams.items_of(L, np.concatenate(hs)))):
            seen.setdefault(t, set()).add(i)
    return flags, which, examples, {t: sorted(v) for t, v in sorted(seen.items())}


def decontaminate_shard(raw: Path, tokens_json: Path, source: dict, grams: EvalGrams, enabled: bool, out: Path,
                        meta: dict) -> tuple:
    """One shard: read its documents' text, flag them, write the flag file. Returns (texts, span
    tokens, flags, matching task indices, examples, scored items seen) for the report."""
    tok_meta, tokens = load_doc_tokens(tokens_json)
    texts = document_texts(raw, source, tok_meta["doc_rows"])
    flags, which, examples, seen = flag_shard(texts, grams, enabled)
    names = [",".join(grams.tasks[t] for t in sorted(w)) for w in which]
    table = pa.table({"doc": np.arange(len(texts), dtype=np.int64), "contaminated": flags,
                      "tasks": pa.array(names, pa.string())})
    write_parquet(out, table, meta)
    return texts, tokens, flags, which, examples, seen


# ----------------------------------------------------------------------------- the eval n-gram table (one job)

def write_grams(grams: EvalGrams, out, meta: dict) -> None:
    """The eval side as one parquet file (`grams` job): a row per (gram length, hash, task index, scored
    item index or -1), the task names, per-task counts and scored item ids in its metadata (with the
    provenance)."""
    lengths = sorted(grams.rows)

    def column(k, dtype):
        return pa.array(np.concatenate([grams.rows[L][k] for L in lengths]) if lengths else np.zeros(0, dtype))

    table = pa.table({
        "length": pa.array(np.concatenate([np.full(len(grams.rows[L][0]), L, np.int32) for L in lengths])
                           if lengths else np.zeros(0, np.int32)),
        "hash": column(0, U64), "task": column(1, np.int32), "item": column(2, np.int32),
    })
    write_parquet(out, table, {**meta, "tasks": grams.tasks, "eval": grams.counts, "lengths": lengths,
                               "item_ids": grams.item_ids})


def read_grams(path) -> EvalGrams:
    """`write_grams`' file back as the EvalGrams it was written from (hashes sorted per length)."""
    import pyarrow.parquet as pq

    try:
        info = read_parquet_meta(path)
        table = pq.ParquetFile(path).read()  # not pq.read_table: it imports pyarrow.dataset (slow)
        lengths, tasks, counts, item_ids = info["lengths"], info["tasks"], info["eval"], info["item_ids"]
        length, h, t, item = (table[k].to_numpy() for k in ("length", "hash", "task", "item"))
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: not an eval n-gram table ({e!r}); rerun the decontaminate_grams rule") from None
    return EvalGrams(tasks, {int(L): (h[length == L], t[length == L], item[length == L]) for L in lengths}, counts,
                     item_ids)


# ----------------------------------------------------------------------------- flags per shard group

def stats_path(flag_file) -> Path:
    """The per-shard report part beside a flag file: R/decontam/{source}/{shard}.json."""
    return Path(flag_file).with_suffix(".json")


def flag_one(params: dict, grams: EvalGrams, source: str, raw, tokens_json, out) -> dict:
    """Flag one shard: its flag file `out`, then its part of the report (`stats_path(out)`), which it returns."""
    view = run_config(params)
    if source not in view.sources:
        raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(view.sources)})")
    shard = Path(tokens_json).name.removesuffix(".json")
    meta = provenance("decontaminate", params, [raw, tokens_json], source=source, shard=shard)
    t0 = time.perf_counter()
    texts, tokens, flags, which, ex, seen = decontaminate_shard(Path(raw), Path(tokens_json), view.sources[source],
                                                          grams, view.decontaminate.enabled, Path(out), meta)
    by_task: dict = {}
    for d in np.flatnonzero(flags):
        for t in which[d]:
            bt = by_task.setdefault(grams.tasks[t], {"documents": 0, "tokens": 0})
            bt["documents"] += 1
            bt["tokens"] += int(tokens[d])
    examples = []
    for d, t, s, L in ex[:N_EXAMPLES]:
        words = normalize_text(texts[d].as_py()).split()
        examples.append({"source": source, "shard": shard, "doc": d, "task": grams.tasks[t],
                         "words": " ".join(words[s:s + L])})
    part = {"source": source, "shard": shard, "documents": len(texts), "tokens": int(tokens.sum()),
            "flagged": {"documents": int(flags.sum()), "tokens": int(tokens[flags].sum())}, "by_task": by_task,
            "items_seen": {grams.tasks[t]: items for t, items in seen.items()},
            "examples": examples, "seconds": time.perf_counter() - t0, "meta": meta}
    write_json(stats_path(out), part)
    return part


def flag_group(params: dict, grams: EvalGrams, source: str, raws: list, tokens: list, outputs: list,
               manifest=None) -> list[dict]:
    """The `flags` job: every shard of a group (raws[i], tokens[i] -> outputs[i]), then the group manifest
    (flag files and report parts). Returns the report parts."""
    names = [(Path(r).parent.name, Path(r).name.removesuffix(".parquet")) for r in raws]
    tnames = [(Path(t).parent.name, Path(t).name.removesuffix(".json")) for t in tokens]
    if names != tnames or len(outputs) != len(raws):
        differ = ", ".join(map("/".join, sorted(set(names) ^ set(tnames)))) or "their order or number"
        raise PipelineError("raw shards and tokenized shards must name the same shards in the same order, with one "
                            f"flag file each (--inputs, --tokens, --outputs); differ for: {differ}")
    parts = [flag_one(params, grams, source, r, t, o) for r, t, o in zip(raws, tokens, outputs)]
    if manifest is not None:
        write_manifest("decontaminate", manifest, [f for o in outputs for f in (str(o), str(stats_path(o)))])
    return parts


# ----------------------------------------------------------------------------- the report (one small job)

def merge_report(params: dict, grams: EvalGrams, parts: list[dict], inputs: list) -> dict:
    """The report from the shards' parts, in (source, shard) order: per source and per task documents and
    tokens flagged, the eval-side counts, per task the scored items seen, the first examples, the
    throughput (docs/data-stages.md, "Decontamination")."""
    view = run_config(params)
    dc = view.decontaminate
    seen = set()
    per_source: dict = {}
    examples = []
    items_seen: dict[str, set] = {name: set() for name in grams.tasks}
    for part in sorted(parts, key=lambda p: (p["source"], p["shard"])):
        key = (part["source"], part["shard"])
        if key in seen:
            raise PipelineError(f"shard {'/'.join(key)} is given twice")
        seen.add(key)
        src = per_source.setdefault(part["source"], {"documents": 0, "tokens": 0,
                                                     "flagged": {"documents": 0, "tokens": 0}, "by_task": {}})
        src["documents"] += part["documents"]
        src["tokens"] += part["tokens"]
        for k in ("documents", "tokens"):
            src["flagged"][k] += part["flagged"][k]
        for task, v in part["by_task"].items():
            bt = src["by_task"].setdefault(task, {"documents": 0, "tokens": 0})
            bt["documents"] += v["documents"]
            bt["tokens"] += v["tokens"]
        for task, items in part["items_seen"].items():
            items_seen[task].update(items)
        examples += part["examples"][:max(0, N_EXAMPLES - len(examples))]
    seconds = sum(p["seconds"] for p in parts)
    n_docs = sum(p["documents"] for p in parts)
    return {
        "enabled": dc.enabled, "ngram": dc.ngram, "min_words": dc.min_words, "tasks": grams.tasks,
        "eval": grams.counts, "per_source": per_source,
        "total": {k: sum(s["flagged"][k] for s in per_source.values()) for k in ("documents", "tokens")},
        "contaminated_items": {task: {"items": len(grams.item_ids[task]), "count": len(items_seen[task]),
                                      "ids": [grams.item_ids[task][i] for i in sorted(items_seen[task])]}
                               for task in grams.tasks},
        "examples": examples, "documents": n_docs, "seconds": seconds,
        "docs_per_s": n_docs / seconds if seconds > 0 else None,
        "meta": provenance("decontaminate", params, inputs),
    }


def write_report(params: dict, grams: EvalGrams, parts: list[dict], inputs: list, report_path) -> dict:
    view = run_config(params)
    report = merge_report(params, grams, parts, inputs)
    write_json(report_path, report)
    log.info("%d of %d documents share a %d-gram with %s (%.0f docs/s)", report["total"]["documents"],
             report["documents"], view.decontaminate.ngram, ", ".join(grams.tasks), report["docs_per_s"] or 0)
    return report


def read_parts(paths: list) -> list[dict]:
    out = []
    for p in paths:
        try:
            out.append(read_json(p))
        except (OSError, ValueError) as e:
            raise PipelineError(f"{p}: not a decontamination report part ({e!r}); rerun its decontaminate_flags "
                                "job") from None
    return out


def build_grams(params: dict, eval_dir) -> EvalGrams:
    view = run_config(params)
    dc = view.decontaminate
    # eval_tasks: eval.tasks, which the slice carries under a key of its own (not a RunConfig key)
    return eval_grams(load_tasks(eval_dir, view.extra["eval_tasks"]), dc.ngram, dc.min_words)


def run_decontaminate(params: dict, eval_dir, raw_paths: list, token_paths: list, outdir, report_path) -> dict:
    """The whole stage in one process (the reference the per-group jobs are tested against): the eval
    table, every shard's flag file and report part under `outdir`, the report. Returns the report."""
    raws = {_name(Path(p), ".parquet"): Path(p) for p in raw_paths}
    toks = {_name(Path(p), ".json"): Path(p) for p in token_paths}
    if set(raws) != set(toks) or not raws:
        missing = sorted(set(raws) ^ set(toks))
        raise PipelineError("raw shards and tokenized shards must name the same shards (--raw, --tokens); "
                            f"differ for: {', '.join(map('/'.join, missing)) or 'none given'}")
    grams = build_grams(params, eval_dir)
    parts = [flag_one(params, grams, source, raws[source, shard], toks[source, shard],
                      Path(outdir) / source / f"{shard}.parquet") for source, shard in sorted(raws)]
    return write_report(params, grams, parts, [*raw_paths, *token_paths], report_path)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.decontaminate", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grams", help="the eval n-gram table, once")
    add_config_args(g)
    g.add_argument("--eval-data", required=True, help="R/eval_data (task files of the eval_data stage)")
    g.add_argument("--out", required=True, help="R/decontam/grams.parquet")
    f = sub.add_parser("flags", help="flag the documents of a group of shards of one source")
    add_config_args(f)
    f.add_argument("--grams", required=True, help="R/decontam/grams.parquet")
    f.add_argument("--source", required=True)
    f.add_argument("--tokens", nargs="+", required=True, help="R/tokens/{source}/{shard}.json, one per input")
    add_group_args(f, "raw shards D/{source}/{shard}.parquet",
                   "R/decontam/{source}/{shard}.parquet, one per input (report part beside it: {shard}.json)")
    r = sub.add_parser("report", help="the report from every shard's part")
    add_config_args(r)
    r.add_argument("--grams", required=True, help="R/decontam/grams.parquet")
    r.add_argument("--parts", nargs="+", required=True, help="R/decontam/{source}/{shard}.json, every shard")
    r.add_argument("--report", required=True, help="R/decontam/report.json")
    args = ap.parse_args(argv)
    params = params_from_args(args, decontaminate_slice)
    if args.cmd == "grams":
        grams = build_grams(params, args.eval_data)
        write_grams(grams, args.out, provenance("decontaminate", params, [Path(args.eval_data) / "tasks.json"]))
        log.info("eval table: %d grams of %s", sum(len(h) for h in grams.hashes.values()), ", ".join(grams.tasks))
    elif args.cmd == "flags":
        flag_group(params, read_grams(args.grams), args.source, args.inputs, args.tokens, args.outputs, args.manifest)
    else:
        write_report(params, read_grams(args.grams), read_parts(args.parts), args.parts, args.report)


if __name__ == "__main__":
    run_cli(main)
