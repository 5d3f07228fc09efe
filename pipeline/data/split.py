r"""Split stage: train / val / dup / contam per document, decided per duplicate cluster so no cluster leaks.

    python -m pipeline.data.split --params JSON --keep R/dedup/keep/*/*.parquet --tokens R/tokens/*/*.json \
        [--decontam R/decontam/*/*.parquet] --outdir R/split --report R/split/report.json

Every document dedup removed is ``dup``, a flagged keeper ``contam``; every other cluster's keeper is
``train`` or ``val`` by ``method: hash`` (`assign_by_hash`: a seeded ranking per source) or ``shards``
(`assign_by_shards`), and `leak_check` fails the stage when a cluster sits on both sides.
`run_split` is the stage; it writes ``R/split/{source}/{shard}.parquet`` and the report.

The inputs and how each method picks val: docs/data-stages.md, "Split".
"""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import add_config_args, params_from_args, split_slice
from pipeline.data.contract import load_doc_tokens, rank_by_hash
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, read_json, run_cli, write_json, write_parquet
from pipeline.run_config import run_config

log = get_logger(__name__)

SPLITS = ("train", "val", "dup", "contam")
TRAIN, VAL, DUP, CONTAM = range(4)


# ----------------------------------------------------------------------------- inputs

@dataclass
class Docs:
    """Every tokenized document of the run, shard after shard (arrays of equal length)."""

    shards: list[tuple[str, str]]  # (source, shard), sorted
    paths: list[tuple[Path, Path]]  # each shard's (keep list, tokenized-shard json)
    shard: np.ndarray  # index into `shards`
    doc: np.ndarray
    cluster: np.ndarray
    keep: np.ndarray  # dedup's keeper flag
    contam: np.ndarray  # flagged by decontaminate
    tokens: np.ndarray

    def source_of(self) -> np.ndarray:
        return np.array([s for s, _ in self.shards], dtype=object)[self.shard]


def _name(path: Path, suffix: str) -> tuple[str, str]:
    return path.parent.name, path.name.removesuffix(suffix)


def _read_keep(path: Path, n_docs: int) -> pa.Table:
    try:
        t = pq.read_table(path, columns=["doc", "cluster", "keep"])
    except (OSError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: not a readable keep list with doc, cluster, keep ({e}); "
                            "rerun the dedup stage") from None
    if not np.array_equal(t.column("doc").to_numpy(), np.arange(n_docs)):
        raise PipelineError(f"{path}: does not list the tokenized shard's {n_docs} documents in order; "
                            "rerun the dedup stage")
    return t


def _read_flags(path: Path, n_docs: int) -> np.ndarray:
    try:
        t = pq.read_table(path, columns=["doc", "contaminated"])
    except (OSError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: not a readable decontamination file with doc, contaminated ({e}); "
                            "rerun the decontaminate stage") from None
    if not np.array_equal(t.column("doc").to_numpy(), np.arange(n_docs)):
        raise PipelineError(f"{path}: does not list the tokenized shard's {n_docs} documents in order; "
                            "rerun the decontaminate stage")
    return t.column("contaminated").to_numpy(zero_copy_only=False).astype(bool)


def load_docs(keep_paths: list, token_paths: list, decontam_paths: list | None = None) -> Docs:
    """Join each keep list (and decontamination file) with its tokenized shard's spans; the lists must
    name the same shards."""
    keeps = {_name(Path(p), ".parquet"): Path(p) for p in keep_paths}
    tokens = {_name(Path(p), ".json"): Path(p) for p in token_paths}
    flags = {_name(Path(p), ".parquet"): Path(p) for p in decontam_paths or []}
    given = [set(keeps), set(tokens)] + ([set(flags)] if decontam_paths is not None else [])
    missing = sorted(set.union(*given) - set.intersection(*given))
    if missing:
        raise PipelineError(f"keep lists, tokenized shards and decontamination files differ for "
                            f"{', '.join(map('/'.join, missing))}; pass one of each per shard (--keep, --tokens, "
                            "--decontam)")
    if not keeps:
        raise PipelineError("no shards given (--keep, --tokens)")
    names = sorted(keeps)
    parts = []
    for i, name in enumerate(names):
        _, spans = load_doc_tokens(tokens[name])
        t = _read_keep(keeps[name], len(spans))
        contam = _read_flags(flags[name], len(spans)) if name in flags else np.zeros(len(spans), bool)
        parts.append((np.full(len(spans), i), np.arange(len(spans)), t.column("cluster").to_numpy(),
                      t.column("keep").to_numpy(zero_copy_only=False), contam, spans))
    shard, doc, cluster, keep, contam, spans = (np.concatenate(c) for c in zip(*parts))
    return Docs(names, [(keeps[n], tokens[n]) for n in names], shard.astype(np.int64), doc.astype(np.int64),
                cluster.astype(np.int64), keep.astype(bool), contam.astype(bool), spans.astype(np.int64))


def check_sources_kept_documents(token_paths: list) -> None:
    """A source of whose rows tokenize kept none (every document too short, too long, empty) has nothing
    to split: one error naming the source, what tokenize dropped, and the key that decides it."""
    rows, docs, dropped = Counter(), Counter(), {}
    for p in token_paths:
        meta = read_json(p)
        source = meta["source"]
        rows[source] += meta["n_rows"]
        docs[source] += meta["n_docs"]
        dropped.setdefault(source, Counter()).update(meta.get("dropped", {}))
    for source in sorted(rows):
        if docs[source]:
            continue
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped[source].items()) if n) or "no rows"
        fixes = {"short": f"lower sources.{source}.min_chars",
                 "long": f"raise sources.{source}.max_conversation_tokens"}
        fix = " or ".join(f for reason, f in fixes.items() if dropped[source][reason]) or \
            f"check sources.{source}.glob and its {'messages' if dropped[source]['no_assistant'] else 'text'} column"
        raise PipelineError(f"source '{source}': tokenize kept none of its {rows[source]} rows (dropped: {why}); {fix}")


# ----------------------------------------------------------------------------- assignment

def val_prefix(cum_tokens: np.ndarray, target: int, cap: int) -> int:
    """How many ranked clusters go to val: the prefix whose token total (`cum_tokens[k-1]`) is closest
    to `target` without exceeding `cap`; ties go to the shorter prefix. A positive target gets at least
    the first cluster where it fits under `cap` (a val set of no documents measures nothing)."""
    k = int(np.searchsorted(cum_tokens, target, side="right"))
    below = int(cum_tokens[k - 1]) if k else 0
    closer = cum_tokens[k] - target < target - below if k < len(cum_tokens) else False
    if k < len(cum_tokens) and cum_tokens[k] <= cap and (closer or (k == 0 and target > 0)):
        return k + 1
    return k


def base_split(docs: Docs) -> np.ndarray:
    """dup for dedup's removals, contam for flagged keepers, train for the rest (before val is chosen)."""
    return np.where(docs.keep, np.where(docs.contam, CONTAM, TRAIN), DUP).astype(np.int8)


def assign_by_hash(docs: Docs, val_tokens: int, seed: int) -> tuple[np.ndarray, dict]:
    """Split codes for `method: hash` and the val target per source."""
    split = base_split(docs)
    source = docs.source_of()
    targets = {}
    shard_names = [f"{src}/{sh}" for src, sh in docs.shards]
    for s in sorted(set(source)):
        idx = np.flatnonzero((split == TRAIN) & (source == s))
        order = idx[rank_by_hash(shard_names, docs.shard[idx], docs.doc[idx], seed, "split")]
        cum = np.cumsum(docs.tokens[order])
        total = int(cum[-1]) if len(cum) else 0
        target = min(val_tokens, total // 2)
        k = val_prefix(cum, target, total // 2)
        split[order[:k]] = VAL
        targets[s] = {"target_tokens": target, "kept_tokens": total}
        if k == 0:
            log.warning("source '%s' gets no val documents (val target %d tokens, %d kept tokens)", s, target, total)
    return split, targets


def assign_by_shards(docs: Docs, val_shards: dict[str, list[str]]) -> np.ndarray:
    """Split codes for `method: shards`: keepers of clusters touching a listed shard are val."""
    known = set(docs.shards)
    listed = [(s, sh) for s, names in val_shards.items() for sh in names]
    unknown = [f"{s}/{sh}" for s, sh in listed if (s, sh) not in known]
    if unknown:
        raise PipelineError(f"split.val_shards names shard(s) not among the inputs: {', '.join(unknown)}")
    in_listed = np.isin(docs.shard, [docs.shards.index(x) for x in listed])
    val_cluster = np.isin(docs.cluster, np.unique(docs.cluster[in_listed]))
    split = base_split(docs)
    split[(split == TRAIN) & val_cluster] = VAL
    return split


def leak_check(docs: Docs, split: np.ndarray) -> dict:
    """Clusters whose kept members are on both sides (must be 0) and dedup-consistency of `dup`."""
    kept = (split == TRAIN) | (split == VAL)
    pairs = np.unique(np.stack([docs.cluster[kept], split[kept]]), axis=1) if kept.any() else np.zeros((2, 0), np.int64)
    leaking = int((np.unique(pairs[0], return_counts=True)[1] > 1).sum())
    result = {"clusters": int(len(np.unique(docs.cluster))), "clusters_on_both_sides": leaking,
              "dup_disagreeing_with_dedup": int(((split == DUP) != ~docs.keep).sum())}
    if leaking or result["dup_disagreeing_with_dedup"]:
        raise PipelineError(f"split leak check failed: {result}; the keep lists are inconsistent, "
                            "rerun the dedup stage")
    return result


# ----------------------------------------------------------------------------- stage

def split_report(docs: Docs, split: np.ndarray, params: dict, targets: dict, leak: dict, inputs: list) -> dict:
    source = docs.source_of()
    per_source = {}
    for s in sorted(set(source)):
        sel = source == s
        per_source[s] = {name: {"documents": int((sel & (split == code)).sum()),
                                "tokens": int(docs.tokens[sel & (split == code)].sum())}
                         for code, name in enumerate(SPLITS)}
        if s in targets:
            per_source[s]["val_target"] = targets[s]
    totals = {name: {k: sum(v[name][k] for v in per_source.values()) for k in ("documents", "tokens")}
              for name in SPLITS}
    shards = {s: [sh for src, sh in docs.shards if src == s] for s in sorted(set(source))}
    return {"method": run_config(params).split.method, "per_source": per_source, "total": totals, "leak_check": leak,
            "shards": shards, "params": params, "meta": provenance("split", params, inputs)}


def run_split(params: dict, keep_paths: list, token_paths: list, outdir, report_path,
              decontam_paths: list | None = None) -> dict:
    """The stage: assign, check, write every shard's split file and the report; returns the report."""
    view = run_config(params)
    sp = view.split
    check_sources_kept_documents(token_paths)
    docs = load_docs(keep_paths, token_paths, decontam_paths)
    targets = {}
    if sp.method == "hash":
        split, targets = assign_by_hash(docs, sp.val_tokens, view.seed)
    else:
        split = assign_by_shards(docs, sp.val_shards)
    leak = leak_check(docs, split)
    report = split_report(docs, split, params, targets, leak, [*keep_paths, *token_paths, *(decontam_paths or [])])
    names = np.array(SPLITS)
    for i, (source, shard) in enumerate(docs.shards):
        sel = docs.shard == i
        table = pa.table({"doc": docs.doc[sel], "cluster": docs.cluster[sel], "tokens": docs.tokens[sel],
                          "split": pa.array(names[split[sel]], pa.string())})
        write_parquet(Path(outdir) / source / f"{shard}.parquet", table,
                      provenance("split", params, docs.paths[i], source=source, shard=shard))
    write_json(report_path, report)
    t = report["total"]
    log.info("train %d docs / %d tokens, val %d / %d, dup %d / %d, contam %d / %d; 0 clusters on both sides",
             *(t[name][k] for name in SPLITS for k in ("documents", "tokens")))
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.split", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--keep", nargs="+", required=True, help="R/dedup/keep/{source}/{shard}.parquet, every shard")
    ap.add_argument("--tokens", nargs="+", required=True, help="R/tokens/{source}/{shard}.json, every shard")
    ap.add_argument("--decontam", nargs="+", help="R/decontam/{source}/{shard}.parquet, every shard (optional)")
    ap.add_argument("--outdir", required=True, help="R/split")
    ap.add_argument("--report", required=True, help="R/split/report.json")
    args = ap.parse_args(argv)
    run_split(params_from_args(args, split_slice), args.keep, args.tokens, args.outdir, args.report, args.decontam)


if __name__ == "__main__":
    run_cli(main)
