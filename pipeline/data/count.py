r"""The run's count table: exact per-shard document / token / byte / character counts, joined.

    python -m pipeline.data.count --inputs R/tokens/S/{shard}.json ... --out R/counts/counts.parquet \
        --summary R/counts/summary.json

Nothing here tokenizes: each tokenize job tallied its shard's counts; this joins them into one table and
a summary (`write_aggregate`). Built twice: the exact table over every shard, and the plan's sample over
``count.sample_shards`` shards per source. Fields: docs/data-contract.md ("Counts").

The two tables and who reads them: docs/data-stages.md, "The count table".
"""
from __future__ import annotations

import argparse
import os

from pipeline.data.contract import COUNT_FIELDS
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, read_json, run_cli, write_json, write_parquet

log = get_logger(__name__)


# ----------------------------------------------------------------------------- all shards

def read_shard_counts(paths: list[str | os.PathLike]) -> list[dict]:
    """Per-shard count records (the `counts` of tokenized shards' metadata, `paths` = R/tokens/S/{shard}.json),
    sorted by (source, shard); checks they agree."""
    rows = []
    for p in paths:
        try:
            rec = read_json(p)
            rows.append({"source": rec["source"], "shard": rec["shard"], **{k: rec["counts"][k] for k in COUNT_FIELDS},
                         "tokenizer_sha256": rec["tokenizer_sha256"]})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PipelineError(f"{p}: not a tokenized shard's metadata with its counts ({e!r}); rerun the tokenize "
                                "rule for it") from None
    rows.sort(key=lambda r: (r["source"], r["shard"]))
    seen = set()
    for r in rows:
        if (r["source"], r["shard"]) in seen:
            raise PipelineError(f"shard {r['source']}/{r['shard']} is given twice in --inputs")
        seen.add((r["source"], r["shard"]))
    shas = {r["tokenizer_sha256"] for r in rows}
    if len(shas) > 1:
        raise PipelineError(f"the tokenized shards were made with {len(shas)} different tokenizers; rerun tokenize "
                            "for all shards")
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
    """The stage: the table (one row per shard), then the summary."""
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
    ap.add_argument("--inputs", nargs="+", required=True, help="R/tokens/*/*.json (tokenized shards' metadata)")
    ap.add_argument("--out", required=True, help="R/counts/counts.parquet (or the plan's sample.parquet)")
    ap.add_argument("--summary", required=True, help="R/counts/summary.json (or sample.json)")
    args = ap.parse_args(argv)
    write_aggregate(args.inputs, args.out, args.summary)


if __name__ == "__main__":
    run_cli(main)
