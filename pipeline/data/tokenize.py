r"""Tokenize stage: each raw shard of a group -> a flat token file, document offsets, (chat) loss
mask and metadata, with exactly one delimiter policy (`Tokenizer.delimit`).

    python -m pipeline.data.tokenize --params JSON --tokenizer T --source S --inputs D/S/{shard}.parquet ... \
        --outputs R/tokens/S/{shard}.json ... [--manifest M]

`tokenize_shard` streams a shard in batches (`encode_docs`, `delimit_into`, `write_batch`) and tallies the
exact per-shard counts (`tally_counts`) from the same pass. Formats: docs/data-contract.md ("Tokenized
shard").

How rows are read, the batch-wise delimiting and the counts: docs/data-stages.md, "Tokenize".
"""
from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.config import add_config_args, params_from_args, tokenize_slice
from pipeline.data.contract import (
    COUNT_FIELDS,
    DROP_REASONS,
    NOT_DOCUMENTS,
    DocBatch,
    add_group_args,
    iter_documents,
    raw_label,
    run_group,
    shard_name,
    token_cap,
    token_dtype,
    token_paths,
)
from pipeline.data.encoding import Tokenizer, load_tokenizer
from pipeline.errors import PipelineError
from pipeline.io import atomic_path, get_logger, progress, provenance, run_cli, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)


# ----------------------------------------------------------------------------- encoding

@dataclass
class ShardStats:
    """Running totals for one shard; they become the metadata JSON."""

    n_rows: int = 0
    doc_rows: list[int] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)  # per batch: delimited length of each kept doc
    n_doc_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    dropped_short_tokens: int = 0
    dropped_long_tokens: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_FIELDS, 0))

    def offsets(self) -> np.ndarray:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def encode_docs(tok: Tokenizer, batch: DocBatch, chat: bool, num_threads: int, path) -> tuple[list, list | None]:
    """Token ids (and, for chat, the assistant loss mask) of each document of the batch, no delimiters."""
    if not chat:
        return tok.encode_arrays(batch.docs, num_threads=num_threads), None
    ids, masks = [], []
    for row, messages in zip(batch.rows, batch.docs):
        try:
            i, m = tok.render_chat(messages)
        except ValueError as e:
            raise PipelineError(f"{raw_label(path)}: row {row}: {e}; fix or drop that row") from None
        ids.append(i)
        masks.append(m)
    return ids, masks


def tally_counts(counts: dict, batch: DocBatch, lengths: list[int], min_chars: int, cap: float) -> None:
    """Add one batch to a shard's `counts` (docs/data-stages.md, "Tokenize"): `lengths` are the tokens of each of the
    batch's documents, before any is dropped. Delimiters are added once the shard is done
    (`finish_counts`): every document the reader passes on, short and long ones included, has them."""
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
    long = [n for n, s in zip(lengths, short) if not s and n > cap]  # short ones are dropped first
    counts["long_documents"] += len(long)
    counts["long_tokens"] += sum(long)


def finish_counts(counts: dict, delimiters_per_doc: int) -> dict:
    counts["delimiter_tokens"] = (counts["documents"] - sum(counts[f] for f in NOT_DOCUMENTS)) * delimiters_per_doc
    return counts


def delimiter_layout(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids `Tokenizer.delimit` puts before and after every document, read off `delimit` itself."""
    probe = tok.delimit([-1])
    i = probe.index(-1)
    return probe[:i], probe[i + 1:]


def delimit_into(ids: list, lengths: np.ndarray, head: list[int], tail: list[int],
                 dtype) -> tuple[np.ndarray, np.ndarray]:
    """`Tokenizer.delimit` over a batch in one pass: each document's ids, with `head` before and `tail`
    after it, back to back in one array of `dtype` → (that array, where each document's own ids start)."""
    ends = np.cumsum(lengths + len(head) + len(tail))
    body_starts = ends - lengths - len(tail)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    for j, t in enumerate(head):
        out[body_starts - len(head) + j] = t
    for j, t in enumerate(tail):
        out[ends - len(tail) + j] = t
    for at, x in zip(body_starts.tolist(), ids):
        out[at:at + len(x)] = x
    return out, body_starts


def drop_short(batch: DocBatch, ids: list, masks: list | None, min_chars: int, stats: ShardStats):
    """Count and remove documents with fewer than `min_chars` characters; returns (rows, ids, masks)."""
    keep = [c >= min_chars for c in batch.n_chars]
    if all(keep):
        return batch.rows, ids, masks
    stats.dropped["short"] += keep.count(False)
    stats.dropped_short_tokens += sum(len(x) for x, k in zip(ids, keep) if not k)
    return _kept(batch.rows, keep), _kept(ids, keep), None if masks is None else _kept(masks, keep)


def drop_long(rows: list, ids: list, masks: list | None, cap: float, stats: ShardStats):
    """Count and remove documents of more than `cap` tokens (`contract.token_cap`: chat conversations
    over max_conversation_tokens); returns (rows, ids, masks)."""
    keep = [len(x) <= cap for x in ids]
    if all(keep):
        return rows, ids, masks
    stats.dropped["long"] += keep.count(False)
    stats.dropped_long_tokens += sum(len(x) for x, k in zip(ids, keep) if not k)
    return _kept(rows, keep), _kept(ids, keep), None if masks is None else _kept(masks, keep)


def _kept(items: list, keep: list[bool]) -> list:
    return [x for x, k in zip(items, keep) if k]


def write_batch(layout, ids: list, masks: list | None, dtype: np.dtype, bin_f, mask_f, stats: ShardStats) -> None:
    """Delimit each document (`layout` from `delimiter_layout`), append its tokens (and loss mask,
    0 on delimiters) to the open files, record its length."""
    head, tail = layout
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens, body_starts = delimit_into(ids, lengths, head, tail, dtype)
    tokens.tofile(bin_f)
    if mask_f is not None:
        mask = np.zeros(len(tokens), np.uint8)
        for at, m in zip(body_starts.tolist(), masks):
            mask[at:at + len(m)] = m
        mask.tofile(mask_f)
    stats.lengths.append(lengths + len(head) + len(tail))
    stats.n_doc_tokens += int(lengths.sum())


def tokenize_shard(
    tok: Tokenizer,
    input_path: str | os.PathLike,
    out_json: str | os.PathLike,
    source: str,
    shard: str,
    params: dict,
    num_threads: int = 1,
) -> dict:
    """Tokenize one raw shard into the files described in docs/data-stages.md, "Tokenize"; returns the metadata."""
    view = run_config(params)
    if source not in view.sources:
        raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(view.sources)})")
    src = view.sources[source]
    chat = src.get("format", "text") == "chat"
    min_chars = src.get("min_chars", 0)
    cap = token_cap(src)
    dtype = token_dtype(tok.n_vocab)
    paths = token_paths(out_json)
    paths["json"].unlink(missing_ok=True)  # the done-marker of an earlier run no longer holds
    stats = ShardStats()
    layout = delimiter_layout(tok)
    with contextlib.ExitStack() as stack:
        bin_f = stack.enter_context(open(stack.enter_context(atomic_path(paths["bin"])), "wb"))
        mask_f = stack.enter_context(open(stack.enter_context(atomic_path(paths["mask"])), "wb")) if chat else None
        idx_tmp = stack.enter_context(atomic_path(paths["idx"]))
        batches = iter_documents(input_path, src, view.count.batch_size)
        for batch in progress(batches, desc=f"tokenize {source}/{shard}", unit="batch"):
            stats.n_rows += batch.n_rows
            stats.dropped["empty"] += batch.empty
            stats.dropped["invalid_utf8"] += batch.invalid_utf8
            stats.dropped["null_content"] += batch.null_content
            stats.dropped["no_assistant"] += batch.no_assistant
            ids, masks = encode_docs(tok, batch, chat, num_threads, input_path)
            tally_counts(stats.counts, batch, [len(x) for x in ids], min_chars, cap)
            rows, ids, masks = drop_short(batch, ids, masks, min_chars, stats)
            rows, ids, masks = drop_long(rows, ids, masks, cap, stats)
            stats.doc_rows.extend(rows)
            write_batch(layout, ids, masks, dtype, bin_f, mask_f, stats)
        with open(idx_tmp, "wb") as f:
            np.save(f, stats.offsets())
    if stats.n_rows == 0:
        log.warning("%s has no rows; wrote an empty tokenized shard", input_path)
    finish_counts(stats.counts, tok.n_delimiters())
    meta = shard_metadata(tok, stats, dtype, source, shard, chat,
                          provenance("tokenize", params, [input_path, tok.path]))
    write_json(paths["json"], meta)
    log.info("%s/%s: %d docs, %d tokens (%d delimiters), dropped %s",
             source, shard, meta["n_docs"], meta["n_tokens"], meta["n_delimiter_tokens"], meta["dropped"])
    return meta


def shard_metadata(tok: Tokenizer, stats: ShardStats, dtype, source: str, shard: str, chat: bool, meta: dict) -> dict:
    off = stats.offsets()
    n_docs, n_tokens = len(off) - 1, int(off[-1])
    return {
        "source": source,
        "shard": shard,
        "format": "chat" if chat else "text",
        "dtype": dtype.name,
        "n_vocab": tok.n_vocab,
        "n_rows": stats.n_rows,
        "n_docs": n_docs,
        "n_tokens": n_tokens,
        "n_doc_tokens": stats.n_doc_tokens,
        "n_delimiter_tokens": n_tokens - stats.n_doc_tokens,
        "delimiter": tok.delimiter,
        "delimiters_per_doc": tok.n_delimiters(),
        "bos_id": tok.bos_id,
        "has_mask": chat,
        "dropped": stats.dropped,
        "dropped_tokens": {"short": stats.dropped_short_tokens, "long": stats.dropped_long_tokens},
        "tokenizer_sha256": tok.sha256,
        "counts": stats.counts,
        "doc_rows": stats.doc_rows,
        "meta": meta,
    }


# ----------------------------------------------------------------------------- reading outputs


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.tokenize", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--tokenizer", required=True, help="R/tokenizer/encoding.json")
    ap.add_argument("--source", required=True)
    add_group_args(ap, "raw shards D/{source}/{shard}.parquet",
                   "R/tokens/{source}/{shard}.json, one per input (siblings .bin, .idx.npy, .mask.bin)")
    ap.add_argument("--threads", type=int, default=1, help="tiktoken encoding threads (default 1: one job per core)")
    args = ap.parse_args(argv)
    params = params_from_args(args, tokenize_slice)
    tok = load_tokenizer(args.tokenizer)
    run_group("tokenize", args.inputs, args.outputs, args.manifest,
              lambda inp, out: tokenize_shard(tok, inp, out, args.source, shard_name(inp), params,
                                              num_threads=args.threads))


if __name__ == "__main__":
    run_cli(main)
