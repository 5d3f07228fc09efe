"""Exact per-shard document / token / byte / character counts, and the run's count table.

    python -m pipeline.data.count shards --params JSON --tokenizer T --source S --inputs D/S/{shard}.parquet ... \\
        --outputs R/counts/S/{shard}.json ... [--manifest M]
    python -m pipeline.data.count aggregate --inputs R/counts/*/*.json --out R/counts/counts.parquet \\
        --summary R/counts/summary.json

`shards` counts each raw shard of a group (one process for the group) with the run's tokenizer;
`aggregate` joins the per-shard JSONs into one table (one row per shard) and a summary (totals per
source and overall, mean tokens per shard, bytes per token). The fields and what they promise
(every row counted, none silently dropped; exactly what tokenize will write): docs/data-contract.md
("Counts").
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeline.config import add_config_args, params_from_args
from pipeline.data.contract import DocBatch, add_group_args, iter_documents, raw_label, run_group, shard_name, token_cap
from pipeline.data.encoding import Tokenizer, load_tokenizer
from pipeline.errors import PipelineError
from pipeline.io import get_logger, progress, provenance, read_json, run_cli, write_json, write_parquet

log = get_logger(__name__)

COUNT_FIELDS = (
    "documents",
    "empty_documents",
    "invalid_utf8_documents",
    "tokens",
    "delimiter_tokens",
    "bytes",
    "chars",
    "short_documents",
    "short_tokens",
    "null_content_documents",
    "no_assistant_documents",
    "long_documents",
    "long_tokens",
)


# ----------------------------------------------------------------------------- one shard

def count_shard(path: str | os.PathLike, tokenizer: Tokenizer, source: dict, batch_size: int,
                num_threads: int = 1) -> dict[str, int]:
    """Count one raw shard (see the module docstring for the fields); streams `batch_size` rows
    at a time, so memory holds one batch's token lists, never the shard's."""
    counts = dict.fromkeys(COUNT_FIELDS, 0)
    min_chars = source.get("min_chars", 0)
    chat = source.get("format", "text") == "chat"
    cap = token_cap(source)
    for batch in progress(iter_documents(path, source, batch_size), desc=f"count {Path(path).name}", unit="batch"):
        lengths = _token_lengths(tokenizer, batch, chat, num_threads, path)
        counts["documents"] += batch.n_rows
        counts["empty_documents"] += batch.empty
        counts["invalid_utf8_documents"] += batch.invalid_utf8
        counts["null_content_documents"] += batch.null_content
        counts["no_assistant_documents"] += batch.no_assistant
        counts["tokens"] += sum(lengths)
        counts["bytes"] += sum(batch.n_bytes)
        counts["chars"] += sum(batch.n_chars)
        short = [chars < min_chars for chars in batch.n_chars]
        counts["short_documents"] += sum(short)
        counts["short_tokens"] += sum(n for n, s in zip(lengths, short) if s)
        long = [n for n, s in zip(lengths, short) if not s and n > cap]  # (tokenize drops short ones first)
        counts["long_documents"] += len(long)
        counts["long_tokens"] += sum(long)
    kept = counts["documents"] - sum(counts[f] for f in NOT_DOCUMENTS)
    counts["delimiter_tokens"] = kept * tokenizer.n_delimiters()
    if counts["documents"] == 0:
        log.warning("%s has no rows; counted as 0 documents", path)
    if any(counts[f] for f in NOT_DOCUMENTS):
        log.warning("%s: %s (counted, skipped downstream)", path,
                    ", ".join(f"{counts[f]} {f.removesuffix('_documents')}" for f in NOT_DOCUMENTS if counts[f]))
    if counts["long_documents"]:
        log.warning("%s: %d conversations over max_conversation_tokens = %d (%d tokens; counted, dropped at tokenize)",
                    path, counts["long_documents"], cap, counts["long_tokens"])
    return counts


# Rows the reader does not pass on as documents (`DocBatch`): they have no tokens and no delimiters.
NOT_DOCUMENTS = ("empty_documents", "invalid_utf8_documents", "null_content_documents", "no_assistant_documents")



def _token_lengths(tokenizer: Tokenizer, batch: DocBatch, chat: bool, num_threads: int, path) -> list[int]:
    """Tokens of each document of the batch (chat: of its rendered conversation)."""
    if not chat:
        return tokenizer.count_tokens(batch.docs, num_threads)
    lengths = []
    for row, messages in zip(batch.rows, batch.docs):
        try:
            lengths.append(len(tokenizer.render_chat(messages)[0]))
        except ValueError as e:
            raise PipelineError(f"{raw_label(path)}: row {row}: {e}; fix or drop that row") from None
    return lengths


def write_shard_counts(params: dict, tokenizer: Tokenizer, input_path: str, source: str, shard: str, out: str,
                       num_threads: int = 1) -> dict:
    """The `count shards` stage for one shard: count `input_path` and write its JSON (fields +
    identity + meta)."""
    if source not in params["sources"]:
        raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(params['sources'])})")
    counts = count_shard(input_path, tokenizer, params["sources"][source], params["count"]["batch_size"], num_threads)
    record = {
        "source": source,
        "shard": shard,
        **counts,
        "tokenizer_sha256": tokenizer.sha256,
        "meta": provenance("count", params, [input_path, tokenizer.path]),
    }
    write_json(out, record)
    log.info("%s/%s: %d documents, %d tokens", source, shard, counts["documents"], counts["tokens"])
    return record


# ----------------------------------------------------------------------------- all shards

def read_shard_counts(paths: list[str | os.PathLike]) -> list[dict]:
    """Per-shard count records (without meta), sorted by (source, shard); checks they agree."""
    rows = []
    for p in paths:
        try:
            rec = read_json(p)
            rows.append({k: rec[k] for k in ("source", "shard", *COUNT_FIELDS, "tokenizer_sha256")})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PipelineError(f"{p}: not a per-shard count file ({e!r}); rerun its count_shard rule") from None
    rows.sort(key=lambda r: (r["source"], r["shard"]))
    seen = set()
    for r in rows:
        if (r["source"], r["shard"]) in seen:
            raise PipelineError(f"shard {r['source']}/{r['shard']} is given twice in --inputs")
        seen.add((r["source"], r["shard"]))
    shas = {r["tokenizer_sha256"] for r in rows}
    if len(shas) > 1:
        raise PipelineError(f"the count files were made with {len(shas)} different tokenizers; rerun count_shard for "
                            "all shards")
    return rows


def totals(rows: list[dict]) -> dict:
    """Sums of every count field over `rows`, plus shards, mean tokens per shard and bytes per token."""
    out = {"shards": len(rows), **{f: sum(r[f] for r in rows) for f in COUNT_FIELDS}}
    out["mean_tokens_per_shard"] = out["tokens"] / len(rows) if rows else 0.0
    out["bytes_per_token"] = out["bytes"] / out["tokens"] if out["tokens"] else None
    return out


def summarize(rows: list[dict]) -> dict:
    """summary.json content (without meta): totals per source and overall."""
    sources = sorted({r["source"] for r in rows})
    return {
        "tokenizer_sha256": rows[0]["tokenizer_sha256"] if rows else None,
        "sources": {s: totals([r for r in rows if r["source"] == s]) for s in sources},
        "total": totals(rows),
    }


def write_aggregate(inputs: list[str], out: str, summary_out: str) -> dict:
    """The `count aggregate` stage: counts.parquet (one row per shard), then summary.json."""
    import pyarrow as pa

    rows = read_shard_counts(inputs)
    schema = pa.schema([("source", pa.string()), ("shard", pa.string()), *((f, pa.int64()) for f in COUNT_FIELDS),
                        ("tokenizer_sha256", pa.string())])
    meta = provenance("count", None, inputs)
    write_parquet(out, pa.Table.from_pylist(rows, schema=schema), meta=meta)
    summary = {**summarize(rows), "meta": meta}
    write_json(summary_out, summary)
    t = summary["total"]
    log.info("%d shards: %d documents, %d tokens, %.3f bytes/token", t["shards"], t["documents"], t["tokens"],
             t["bytes_per_token"] or 0.0)
    return summary


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.count", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("shards", help="count a group of raw shards of one source")
    add_config_args(sh)
    sh.add_argument("--tokenizer", required=True, help="R/tokenizer/encoding.json")
    sh.add_argument("--source", required=True)
    add_group_args(sh, "raw shards D/{source}/{shard}.parquet", "R/counts/{source}/{shard}.json, one per input")
    sh.add_argument("--threads", type=int, default=1, help="tokenizer threads (default 1: one core per job)")
    ag = sub.add_parser("aggregate", help="join per-shard counts into one table and a summary")
    ag.add_argument("--inputs", nargs="+", required=True, help="R/counts/*/*.json")
    ag.add_argument("--out", required=True, help="R/counts/counts.parquet")
    ag.add_argument("--summary", required=True, help="R/counts/summary.json")
    args = ap.parse_args(argv)
    if args.cmd == "shards":
        params, tokenizer = params_from_args(args, "count"), load_tokenizer(args.tokenizer)
        run_group("count", args.inputs, args.outputs, args.manifest,
                  lambda inp, out: write_shard_counts(params, tokenizer, inp, args.source, shard_name(inp), out,
                                                      args.threads))
    else:
        write_aggregate(args.inputs, args.out, args.summary)


if __name__ == "__main__":
    run_cli(main)
