r"""Filter stage: each downloaded shard of a group -> its kept documents, filtered, and a decision per document.

    python -m pipeline.data.filter --params JSON --source S --inputs D/S/{shard}.parquet ... \
        --outputs R/filtered/S/{shard}.parquet ... [--manifest M]

`filter_shard` runs the config's ``filter:`` chain (pipeline/data/text_filters.py, docs/filters.md) over a
shard and writes ``R/filtered/S/{shard}.parquet`` (the kept rows, text filtered; hard-linked when nothing
changed) and ``{shard}.decisions.parquet`` (one row per raw row, `DECISION_SCHEMA`). Formats:
docs/data-contract.md, "Filtered shard".

Rows that are not documents, chat sources: docs/data-stages.md, "Filter".
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import add_config_args, filter_slice, params_from_args
from pipeline.data.contract import add_group_args, doc_text, iter_documents, open_parquet, run_group, source_column
from pipeline.data.text_filters import DECISION_SCHEMA, PII, Filter, build_chain, run_chain
from pipeline.io import atomic_path, get_logger, provenance, run_cli, write_json
from pipeline.run_config import plain, run_config

log = get_logger(__name__)

STAGE = "filter"
BATCH_ROWS = 1024  # raw rows filtered at once; the results do not depend on it



def decisions_path(out: str | os.PathLike) -> Path:
    """`R/filtered/S/{shard}.parquet` -> its decisions file `R/filtered/S/{shard}.decisions.parquet`."""
    return Path(str(out).removesuffix(".parquet") + ".decisions.parquet")


def _scrub_messages(messages: list[dict], scrubbers: list[Filter]) -> tuple[list[dict], int]:
    """A kept conversation with the scrubbing filters applied to each message's content on its own."""
    out, spans = [], 0
    for m in messages:
        content = m["content"]
        for f in scrubbers:
            _, content, count = f.edit(content)
            spans += count
        out.append({**m, "content": content})
    return out, spans


def _filter_batch(table: pa.Table, start: int, batch, column: str, chain: list[Filter], chat: bool
                  ) -> tuple[pa.Table, dict, bool]:
    """One batch of raw rows from row `start`: (its kept rows, filtered; its decision columns; whether any row
    changed)."""
    n = table.num_rows
    res = run_chain([doc_text(d) for d in batch.docs], chain, chat=chat)
    local = np.asarray(batch.rows, dtype=np.int64) - start  # the documents' rows within the batch
    keep = np.ones(n, dtype=bool)
    keep[local] = res.kept
    chars_in = np.zeros(n, np.int64)
    chars_in[local] = batch.n_chars
    chars_out = chars_in.copy()
    cols = {"filter": [""] * n, "rule": [""] * n, "language": [""] * n}
    value, threshold, score = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan, np.float32)
    lines, spans = np.zeros(n, np.int32), np.zeros(n, np.int32)
    values = table.column(column).to_pylist()
    changed = False
    scrubbers = [f for f in chain if f.enabled and isinstance(f, PII)] if chat else []
    for j, r in enumerate(local):
        cols["filter"][r], cols["rule"][r], cols["language"][r] = res.filter[j], res.rule[j], res.language[j]
        value[r], threshold[r], score[r] = res.value[j], res.threshold[j], res.language_score[j]
        lines[r], spans[r] = res.lines_removed[j], res.spans_replaced[j]
        if not res.kept[j]:
            chars_out[r] = 0
            continue
        if chat:
            values[r], spans[r] = _scrub_messages(values[r], scrubbers)
            chars_out[r] = sum(len(m["content"]) for m in values[r])
            changed |= spans[r] > 0
        elif res.text[j] != batch.docs[j]:
            values[r], chars_out[r], changed = res.text[j], len(res.text[j]), True
    if changed:
        i = table.schema.get_field_index(column)
        table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
    decisions = {"kept": keep, **cols, "value": value, "threshold": threshold, "chars_in": chars_in,
                 "chars_out": chars_out, "lines_removed": lines, "spans_replaced": spans, "language_score": score}
    return table.filter(pa.array(keep)), decisions, changed or not keep.all()


def _place_unchanged(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """Hard-link the raw shard at `out` (a copy where the two are on different devices)."""
    with atomic_path(out) as tmp:
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def filter_shard(chain: list[Filter], input_path: str | os.PathLike, out: str | os.PathLike, source: str,
                 params: dict) -> dict:
    """Filter one raw shard into `out` (and its decisions and sidecar); returns the sidecar record."""
    src = run_config(params).sources[source]
    chat = src.get("format", "text") == "chat"
    pf = open_parquet(input_path)
    column = source_column(pf, input_path, src)
    tables = pf.iter_batches(batch_size=BATCH_ROWS, use_threads=False)
    kept_parts, decisions, changed, start = [], {name: [] for name in DECISION_SCHEMA.names}, False, 0
    for batch in iter_documents(input_path, src, BATCH_ROWS):
        table = pa.Table.from_batches([next(tables)])
        kept, dec, c = _filter_batch(table, start, batch, column, chain, chat)
        start += table.num_rows
        kept_parts.append(kept)
        changed |= c
        for name in decisions:
            decisions[name].append(dec[name])
    columns = {name: (np.concatenate(parts) if parts else []) for name, parts in decisions.items()}
    with atomic_path(decisions_path(out)) as tmp:
        pq.write_table(pa.Table.from_pydict(columns, schema=DECISION_SCHEMA), tmp)
    kept_rows = int(columns["kept"].sum()) if len(columns["kept"]) else 0
    record = {"source": source, "shard": Path(out).name.removesuffix(".parquet"), "rows_in": pf.metadata.num_rows,
              "rows_out": kept_rows, "chars_in": int(np.sum(columns["chars_in"])),
              "chars_out": int(np.sum(columns["chars_out"]))}
    # the sidecar first: the shard's rename makes the pair current (as download does)
    write_json(f"{out}.json", {**record, "unchanged": not changed, "meta": provenance(STAGE, params, [input_path])})
    if changed:
        with atomic_path(out) as tmp, contextlib.closing(pq.ParquetWriter(tmp, pf.schema_arrow)) as w:
            for part in kept_parts:
                w.write_table(part.cast(pf.schema_arrow))
    else:
        _place_unchanged(input_path, out)
    log.info("%s/%s: kept %d of %d rows (%s)", source, record["shard"], kept_rows, record["rows_in"],
             "filtered" if changed else "unchanged")
    return record


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.filter", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--source", required=True)
    add_group_args(ap, "raw shards D/{source}/{shard}.parquet",
                   "R/filtered/{source}/{shard}.parquet, one per input (siblings .decisions.parquet, .parquet.json)")
    args = ap.parse_args(argv)
    params = params_from_args(args, filter_slice)
    chain = build_chain(plain(run_config(params).filter))  # build_chain validates the plain list
    run_group(STAGE, args.inputs, args.outputs, args.manifest,
              lambda inp, out: filter_shard(chain, inp, out, args.source, params))


if __name__ == "__main__":
    run_cli(main)
