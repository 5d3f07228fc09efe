r"""Pack stage: a mix's document schedule + tokenized shards -> fixed rows of `seq_len + 1` tokens.

    python -m pipeline.data.pack --params JSON --mix M --split train|val --schedule R/mix/M/train.parquet \
        --tokens-dir R/tokens --out R/pack/M/train.json

Two modes (the mix's ``packing``): `pack_concat` (the spans concatenated and cut into rows, no padding,
no loss mask) and `pack_bestfit` (whole documents best-fit-decreasing into rows, long ones split, padded
with ``<|bos|>`` masked out of the loss). `pack` runs the stage. Formats: docs/data-contract.md ("Mix",
"Packed rows").

The two modes in detail: docs/data-stages.md, "Pack".
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import add_config_args, pack_slice, params_from_args
from pipeline.data.contract import (
    MASK_REAL,
    open_tokens,
    pack_paths,
    read_schedule,
    shard_keys,
    span_index,
    token_column_mismatches,
)
from pipeline.errors import PipelineError
from pipeline.io import HashingFile, atomic_path, get_logger, progress, provenance, run_cli, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)

CHUNK_TOKENS = 1 << 22  # tokens gathered per vectorised copy


# ----------------------------------------------------------------------------- inputs

@dataclass
class Shard:
    """One memory-mapped tokenized shard."""

    name: str
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None
    meta: dict


@dataclass
class Spans:
    """The scheduled documents as spans of their shards, in schedule order."""

    shard: np.ndarray  # int64 index into the shard list
    start: np.ndarray  # int64 token offset in the shard's .bin
    length: np.ndarray  # int64 tokens, delimiters included


def open_shards(table, tokens_dir: Path) -> tuple[list[Shard], np.ndarray]:
    """Memory-map every shard the schedule names; return them and each row's index into them."""
    names, shard_id = shard_keys(table)
    shards = []
    for name in names:
        meta, tokens, offsets, mask = open_tokens(tokens_dir / f"{name}.json")
        shards.append(Shard(name, tokens, offsets, mask, meta))
    for key in ("tokenizer_sha256", "dtype"):
        values = {s.meta[key] for s in shards}
        if len(values) > 1:
            raise PipelineError(f"{tokens_dir}: tokenized shards disagree on {key} ({sorted(values)}); rerun tokenize "
                                "for all shards")
    return shards, shard_id


def schedule_spans(table, shards: list[Shard], shard_id: np.ndarray, path) -> Spans:
    """Look up each scheduled document's span; the schedule's `tokens` must agree with it."""
    doc = table["doc"].to_numpy().astype(np.int64)
    start = np.empty_like(doc)
    length = np.empty_like(doc)
    for k, s in enumerate(shards):
        sel = shard_id == k
        d = doc[sel]
        if len(d) and (d.min() < 0 or d.max() >= len(s.offsets) - 1):
            raise PipelineError(f"{path}: document index out of range for tokenized shard {s.name} "
                                f"({len(s.offsets) - 1} docs); rerun split and mix")
        start[sel] = s.offsets[d]
        length[sel] = s.offsets[d + 1] - s.offsets[d]
    tokens = table["tokens"].to_numpy().astype(np.int64)
    bad = token_column_mismatches(tokens, length, int(shards[0].meta["delimiters_per_doc"]))
    if len(bad):
        i = bad[0]
        raise PipelineError(
            f"{path}: row {i} ({shards[shard_id[i]].name} doc {doc[i]}) has tokens={tokens[i]} but the tokenized span "
            f"holds {length[i]} tokens with its delimiter(s); the schedule is stale, rerun split and mix"
        )
    return Spans(shard_id, start, length)


# ----------------------------------------------------------------------------- vectorised gather


def gather(shards: list[Shard], spans: Spans, dest: np.ndarray, out: np.ndarray, field: str = "tokens") -> None:
    """Copy each span into `out[dest[i]:dest[i] + length[i]]`, one fancy-indexed copy per shard.

    `field="mask"` writes the mask bits instead (contract MASK_*): MASK_REAL on every span token, plus
    MASK_ASSISTANT where a chat shard's tokenized mask is 1 (text shards have no assistant tokens).
    """
    for k in np.unique(spans.shard):
        sel = spans.shard == k
        dst = span_index(dest[sel], spans.length[sel])
        src = getattr(shards[k], field)
        if field == "mask":
            out[dst] = MASK_REAL if src is None else MASK_REAL | src[span_index(spans.start[sel], spans.length[sel])]
        else:
            out[dst] = src[span_index(spans.start[sel], spans.length[sel])]


def subset(spans: Spans, sel) -> Spans:
    return Spans(spans.shard[sel], spans.start[sel], spans.length[sel])


# ----------------------------------------------------------------------------- concat

def chunk_bounds(lengths: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Split consecutive items into runs [lo, hi) of about `chunk_tokens` tokens each."""
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, np.arange(chunk_tokens, int(ends[-1]), chunk_tokens), side="right")
    edges = np.unique(np.concatenate([[0], cuts, [len(lengths)]]))
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def pack_concat(shards, spans: Spans, row_len: int, dtype, writer: HashingFile) -> dict:
    """Concatenate spans in schedule order and write full rows; returns counts and doc starts."""
    starts_flat = np.cumsum(spans.length) - spans.length
    total = int(spans.length.sum())
    n_rows = total // row_len
    packed = n_rows * row_len
    carry = np.zeros(0, dtype)
    for lo, hi in progress(chunk_bounds(spans.length, CHUNK_TOKENS), desc="pack concat", unit="chunk"):
        part = subset(spans, slice(lo, hi))
        buf = np.empty(len(carry) + int(part.length.sum()), dtype)
        buf[: len(carry)] = carry
        gather(shards, part, starts_flat[lo:hi] - starts_flat[lo] + len(carry), buf)
        full = len(buf) // row_len * row_len
        writer.write(np.ascontiguousarray(buf[:full]).data)
        carry = buf[full:]
    return {
        "n_rows": n_rows,
        "tokens_packed": packed,
        "dropped_tail_tokens": total - packed,
        "pad_tokens": 0,
        "truncated_tokens": 0,
        "doc_starts": starts_flat[starts_flat < packed],
    }


# ----------------------------------------------------------------------------- bestfit

def split_long(spans: Spans, row_len: int) -> Spans:
    """Cut spans longer than a row into full rows plus a remainder piece (schedule order kept)."""
    n_pieces = -(-spans.length // row_len)
    idx = np.repeat(np.arange(len(spans.length)), n_pieces)
    j = np.arange(len(idx)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    length = np.minimum(row_len, spans.length[idx] - j * row_len)
    return Spans(spans.shard[idx], spans.start[idx] + j * row_len, length)


def best_fit_decreasing(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign items (each <= row_len) to rows: returns (row index, offset within the row) per item.

    Items are placed longest first (ties in input order) into the open row with the least
    remaining room that fits, else a new row. Full-row items get their own rows up front.
    Open rows are bucketed by remaining room; `has_room[c]` says a row with room c exists.
    """
    n = len(lengths)
    row, off = np.empty(n, np.int64), np.empty(n, np.int64)
    full = np.flatnonzero(lengths == row_len)
    row[full], off[full] = np.arange(len(full)), 0
    n_rows = len(full)
    buckets: list[list[int]] = [[] for _ in range(row_len + 1)]
    fill: list[int] = []  # used tokens per bestfit row, indexed by row - len(full)
    has_room = np.zeros(row_len + 1, bool)
    rest = np.flatnonzero(lengths < row_len)
    for i in rest[np.argsort(-lengths[rest], kind="stable")].tolist():
        size = int(lengths[i])
        room = size + int(has_room[size:].argmax())
        if has_room[room]:
            r = buckets[room].pop()
            has_room[room] = bool(buckets[room])
        else:
            r, room = n_rows, row_len
            n_rows += 1
            fill.append(0)
        row[i], off[i] = r, fill[r - len(full)]
        fill[r - len(full)] += size
        if room - size:
            buckets[room - size].append(r)
            has_room[room - size] = True
    return row, off


def pack_bestfit(shards, spans: Spans, row_len: int, dtype, pad_id: int, writer: HashingFile, mask_f,
                 rows_per_chunk: int) -> dict:
    """Best-fit-decreasing rows with padding and a loss mask; returns counts and piece starts."""
    pieces = split_long(spans, row_len)
    row, off = best_fit_decreasing(pieces.length, row_len)
    n_rows = int(row.max()) + 1 if len(row) else 0
    order = np.lexsort((off, row))  # pieces in output order
    pieces, row, off = subset(pieces, order), row[order], off[order]
    for first_row in progress(range(0, n_rows, rows_per_chunk), desc="pack bestfit", unit="chunk"):
        rows_here = min(rows_per_chunk, n_rows - first_row)
        a, b = np.searchsorted(row, [first_row, first_row + rows_here])
        part = subset(pieces, slice(a, b))
        dest = (row[a:b] - first_row) * row_len + off[a:b]
        buf = np.full(rows_here * row_len, pad_id, dtype)
        mask = np.zeros(rows_here * row_len, np.uint8)
        gather(shards, part, dest, buf)
        gather(shards, part, dest, mask, field="mask")
        writer.write(buf.data)
        mask_f.write(mask.data)
    tokens = int(pieces.length.sum())
    return {
        "n_rows": n_rows,
        "tokens_packed": tokens,
        "dropped_tail_tokens": 0,
        "pad_tokens": n_rows * row_len - tokens,
        "truncated_tokens": 0,
        "split_docs": int((spans.length > row_len).sum()),
        "doc_starts": row * row_len + off,
    }


# ----------------------------------------------------------------------------- stage

def pack(params: dict, mix: str, split: str, schedule_path, tokens_dir, out_json, rows_per_chunk: int = 4096) -> dict:
    """Pack one mix split; writes the files in docs/data-stages.md, "Pack" and returns the metadata."""
    view = run_config(params)
    if mix not in view.mixes:
        raise PipelineError(f"mix '{mix}' is not in params.mixes ({', '.join(view.mixes)})")
    packing = view.mixes[mix].get("packing", "concat")
    row_len = int(view.extra["seq_len"]) + 1  # train.seq_len, which the slice carries as a key of its own
    paths = pack_paths(out_json)
    paths["json"].unlink(missing_ok=True)
    table = read_schedule(schedule_path)
    shards, shard_id = open_shards(table, Path(tokens_dir))
    spans = schedule_spans(table, shards, shard_id, schedule_path)
    dtype = np.dtype(shards[0].meta["dtype"])
    pad_id = int(shards[0].meta["bos_id"])
    if packing == "concat" and any(s.mask is not None for s in shards):
        log.warning("mix %s packs chat sources with concat: their loss masks are not used (use packing: bestfit)", mix)
    with contextlib.ExitStack() as stack:
        writer = HashingFile(stack.enter_context(open(stack.enter_context(atomic_path(paths["bin"])), "wb")))
        mask_f = None
        if packing == "bestfit":
            mask_f = HashingFile(stack.enter_context(open(stack.enter_context(atomic_path(paths["mask"])), "wb")))
            stats = pack_bestfit(shards, spans, row_len, dtype, pad_id, writer, mask_f, rows_per_chunk)
        else:
            stats = pack_concat(shards, spans, row_len, dtype, writer)
        if stats["n_rows"] == 0:
            raise PipelineError(
                f"{schedule_path}: {int(spans.length.sum())} scheduled tokens do not fill one row of seq_len + 1 = "
                f"{row_len} "
                f"tokens; give the mix more data (mixes.{mix}.tokens, split.val_tokens) or lower train.seq_len"
            )
        with open(stack.enter_context(atomic_path(paths["docs"])), "wb") as f:
            np.save(f, np.asarray(stats.pop("doc_starts"), np.int64))
    meta = {
        "mix": mix,
        "split": split,
        "packing": packing,
        "seq_len": row_len - 1,
        "dtype": dtype.name,
        "n_docs": len(spans.length),
        "tokens_in": int(spans.length.sum()),
        **stats,
        "pad_id": pad_id if packing == "bestfit" else None,
        "has_mask": packing == "bestfit",
        "sha256": writer.sha256.hexdigest(),
        "mask_sha256": mask_f.sha256.hexdigest() if mask_f is not None else None,
        "tokens_by_source": tokens_by_source(table, spans),
        "tokenizer_sha256": shards[0].meta["tokenizer_sha256"],
        "meta": provenance("pack", params, [schedule_path] + [Path(tokens_dir) / f"{s.name}.json" for s in shards]),
    }
    write_json(paths["json"], meta)
    log.info("%s/%s: %d rows × %d (%s), %d tokens in, tail %d, pad %d", mix, split, meta["n_rows"], row_len, packing,
             meta["tokens_in"], meta["dropped_tail_tokens"], meta["pad_tokens"])
    return meta


def tokens_by_source(table, spans: Spans) -> dict[str, int]:
    import pyarrow as pa

    sums = pa.table({"source": table["source"], "n": spans.length}).group_by("source").aggregate([("n", "sum")])
    return dict(zip(sums["source"].to_pylist(), sums["n_sum"].to_pylist()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.pack", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--mix", required=True)
    ap.add_argument("--split", required=True, choices=["train", "val"])
    ap.add_argument("--schedule", required=True, help="R/mix/{mix}/{split}.parquet")
    ap.add_argument("--tokens-dir", required=True, help="R/tokens")
    ap.add_argument("--out", required=True, help="R/pack/{mix}/{split}.json (siblings .bin, .docs.npy, .mask.bin)")
    args = ap.parse_args(argv)
    pack(params_from_args(args, pack_slice), args.mix, args.split, args.schedule, args.tokens_dir, args.out)


if __name__ == "__main__":
    run_cli(main)
