#!/usr/bin/env python
"""The filter funnel of some raw text shards, outside a run: the filter chain, then its report.

    python scripts/filter_funnel.py --out /tmp/funnel data/sample/web/*.parquet data/sample/crawl/*.parquet
    python scripts/filter_funnel.py --out /tmp/funnel --filter '[{"name": "gopher_quality"}]' data/sample/web/*.parquet

Runs `pipeline.data.text_filters.run_chain` (the default chain, or ``--filter``: a ``filter:`` list as JSON) over
every row of each shard (text sources: column ``--text-column``; a null row is an empty document), writes
``OUT/{source}/{shard}.decisions.parquet`` as the filter stage would (`filters.decisions_table`; the source
is the shard's directory name), then `pipeline.data.filter_report` over them: ``OUT/report.json``,
``OUT/report.md`` and ``OUT/funnel.png``. docs/filters.md's table of the sample's web shards comes from it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.data.filter_report import filter_report
from pipeline.data.text_filters import build_chain, decisions_table, run_chain
from pipeline.io import atomic_path, get_logger, run_cli

log = get_logger("filter_funnel")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shards", nargs="+", type=Path, help="raw text shards, .../{source}/{shard}.parquet")
    ap.add_argument("--out", type=Path, required=True, help="directory for the decisions and the report")
    ap.add_argument("--filter", type=json.loads, default=None,
                    help="a filter: list as JSON (default: the default chain)")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--seed", type=int, default=1337, help="seeds the report's sampled examples")
    ap.add_argument("--examples", type=int, default=3)
    args = ap.parse_args(argv)
    chain = build_chain(args.filter)
    decisions = []
    for shard in args.shards:
        texts = [t or "" for t in pq.read_table(shard, columns=[args.text_column]).column(0).to_pylist()]
        out = args.out / shard.parent.name / f"{shard.stem}.decisions.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            pq.write_table(decisions_table(texts, run_chain(texts, chain)), tmp)
        decisions.append(str(out))
        log.info("%s: %d documents judged", shard, len(texts))
    sources = {s.parent.name: {"format": "text", "text_column": args.text_column} for s in args.shards}
    params = {"filter": args.filter, "sources": sources, "seed": args.seed}
    filter_report(params, [str(s) for s in args.shards], decisions, args.out / "report.json",
                  args.out / "report.md", args.out / "funnel.png", examples=args.examples)


if __name__ == "__main__":
    run_cli(main)
