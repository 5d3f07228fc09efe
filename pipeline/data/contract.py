"""The data contract between stages: the one place that knows the stages' file formats.

Every data stage reads and writes through these helpers instead of importing another stage, so a
format has exactly one reader and one writer here (the formats: docs/data-contract.md):

* raw shards: `iter_documents` / `DocBatch` (which rows are documents), `open_parquet`, `doc_text`,
  `iter_document_texts` / `document_texts`, `token_cap`, `raw_label`, `chat_field_problem`;
* tokenized shards: `DROP_REASONS`, `COUNT_FIELDS` / `NOT_DOCUMENTS`, `token_paths`, `load_shard_meta`,
  `open_tokens`, `load_doc_tokens`; group manifests: `write_manifest`, `run_group`;
* ranking: `salt`, `rank_by_hash`; schedules and packed rows: `SCHEDULE_COLUMNS`, `read_schedule`,
  `shard_keys`, `token_column_mismatches`, `pack_paths`, `span_index`.

What each helper is for: docs/data-stages.md, "The data contract module".
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.data.minhash import fmix64
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, read_json, write_json

log = get_logger(__name__)

# ----------------------------------------------------------------------------- raw shards


@dataclass
class DocBatch:
    """The documents of consecutive rows of one shard.

    `docs[i]` is the document of shard row `rows[i]`: a `str` for text sources, a list of
    `{"role", "content"}` dicts for chat sources. Rows that are not documents are only counted:
    `empty` (null, empty or whitespace-only text; a conversation with no non-blank content),
    `invalid_utf8` (bytes that are not UTF-8), and for chat `null_content` (a message whose content
    is null: the row is broken, not an empty answer to learn) and `no_assistant` (no assistant turn:
    nothing to learn under the assistant-only loss). `n_bytes[i]`/`n_chars[i]` measure document i's
    text (for chat: the message contents).
    """

    n_rows: int
    rows: list[int] = field(default_factory=list)
    docs: list = field(default_factory=list)
    n_bytes: list[int] = field(default_factory=list)
    n_chars: list[int] = field(default_factory=list)
    empty: int = 0
    invalid_utf8: int = 0
    null_content: int = 0
    no_assistant: int = 0


def source_column(pf: pq.ParquetFile, path: str | os.PathLike, source: dict) -> str:
    """The column a raw shard's documents are read from (`text_column`, or `messages_column` for
    `format: chat`); a shard without it is one error naming the keys to set (the source is named by the
    shard's directory: raw shards live in `<data_dir>/raw/<source>/`, docs/data-contract.md)."""
    chat = source.get("format", "text") == "chat"
    key = "messages_column" if chat else "text_column"
    column = source.get(key, "messages" if chat else "text")
    if column not in pf.schema_arrow.names:
        name = Path(path).parent.name
        holds = "conversations" if not chat else "plain text"
        raise PipelineError(f"{path}: no column '{column}' (columns: {', '.join(pf.schema_arrow.names)}); set "
                            f"sources.{name}.{key}, or sources.{name}.format: {'text' if chat else 'chat'} if "
                            f"it holds {holds}")
    return column


def iter_documents(path: str | os.PathLike, source: dict, batch_size: int,
                   row_group: int | None = None) -> Iterator[DocBatch]:
    """Stream a raw shard (or one of its row groups) as DocBatches of at most `batch_size` rows;
    only the needed column is read.

    `source` is the source's config slice (`format`, `text_column`, `messages_column`). Text is read
    as bytes and decoded per document, so one bad document is counted as invalid instead of failing
    the shard. A missing column or an unreadable / truncated file raises one PipelineError.
    """
    chat = source.get("format", "text") == "chat"
    pf = open_parquet(path)
    column = source_column(pf, path, source)
    as_bytes = _bytes_type(pf.schema_arrow.field(column).type, chat)
    if as_bytes is None:
        raise PipelineError(
            f"{path}: column '{column}' has type {pf.schema_arrow.field(column).type}; expected "
            + ("list<struct<role: string, content: string>>" if chat else "string or binary")
        )
    problem = chat_field_problem(pf, column) if chat else None
    if problem:  # refused here: the cast below would fail as if the file were unreadable
        raise PipelineError(f"{raw_label(path)}: {problem}; every message's role and content must be a string: fix "
                            "the export that wrote the file")
    decode = _decode_chat_rows if chat else _decode_text_rows
    groups = None if row_group is None else [row_group]
    start = 0 if row_group is None else sum(pf.metadata.row_group(g).num_rows for g in range(row_group))
    try:
        for rb in pf.iter_batches(batch_size=batch_size, columns=[column], row_groups=groups, use_threads=False):
            yield decode(rb.column(0).cast(as_bytes).to_pylist(), start)
            start += rb.num_rows
    except (OSError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: cannot read column '{column}' ({e}); the file is corrupt or truncated, "
                            "re-download it") from None


def open_parquet(path: str | os.PathLike) -> pq.ParquetFile:
    """`pyarrow.parquet.ParquetFile(path)`, or one PipelineError naming the unreadable file."""
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: not a readable parquet file ({e}); delete it and rerun the download") from None


def _bytes_type(typ: pa.DataType, chat: bool) -> pa.DataType | None:
    """The arrow type to cast a text / messages column to so that strings arrive as raw bytes
    (None if the column cannot hold documents). An all-null column has type null: all rows empty."""
    chat_bytes = pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))
    if pa.types.is_null(typ):
        return chat_bytes if chat else pa.binary()
    if chat:
        is_messages = ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type)
                       and {"role", "content"} <= {f.name for f in typ.value_type})
        return chat_bytes if is_messages else None
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        return pa.binary()
    if pa.types.is_large_string(typ) or pa.types.is_large_binary(typ):
        return pa.large_binary()
    return None


def _is_text(typ: pa.DataType) -> bool:
    """A field a chat message's role or content may have: text, or null only (every value missing)."""
    return any(is_kind(typ) for is_kind in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                            pa.types.is_large_binary, pa.types.is_null))


def chat_field_problem(pf: pq.ParquetFile, column: str) -> str | None:
    """Which field of a messages column (a list of structs with role and content) holds something other
    than text, named with the first row that holds such a value: e.g. "row 3, message 1: field 'content'
    of column 'messages' is 5 (int64), not a string". None when both are text, or when the column is not
    shaped as messages at all (its type is the other check's)."""
    typ = pf.schema_arrow.field(column).type
    if not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type)):
        return None
    bad = [f for f in typ.value_type if f.name in ("role", "content") and not _is_text(f.type)]
    if not bad:
        return None
    name, kind = bad[0].name, bad[0].type
    start = 0
    for rb in pf.iter_batches(columns=[column], use_threads=False):
        conversations = rb.column(0)
        values = pc.struct_field(pc.list_flatten(conversations), name)
        hits = pc.indices_nonzero(pc.is_valid(values))
        if len(hits):
            i = hits[0].as_py()  # the first value, as a position among the batch's messages
            row = pc.list_parent_indices(conversations)[i].as_py()
            message = i - (conversations.offsets[row].as_py() - conversations.offsets[0].as_py())
            shown = repr(values[i].as_py())
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return (f"row {start + row}, message {message}: field '{name}' of column '{column}' is {shown} "
                    f"({kind}), not a string")
        start += rb.num_rows
    return f"field '{name}' of column '{column}' has type {kind}, not string (every value of it is null)"


def _decode_text_rows(values: list[bytes | None], start: int) -> DocBatch:
    batch = DocBatch(n_rows=len(values))
    for row, raw in enumerate(values, start):
        if not raw:
            batch.empty += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            batch.invalid_utf8 += 1
            continue
        if text.isspace():
            batch.empty += 1
            continue
        batch.rows.append(row)
        batch.docs.append(text)
        batch.n_bytes.append(len(raw))
        batch.n_chars.append(len(text))
    return batch


def _decode_chat_rows(values: list[list[dict] | None], start: int) -> DocBatch:
    batch = DocBatch(n_rows=len(values))
    for row, conv in enumerate(values, start):
        if any(m is None or m["content"] is None for m in conv or ()):  # (a null message: the same)
            batch.null_content += 1
            continue
        try:
            messages = [{"role": (m["role"] or b"").decode("utf-8"), "content": m["content"].decode("utf-8")}
                        for m in conv or ()]
        except UnicodeDecodeError:
            batch.invalid_utf8 += 1
            continue
        if all(not m["content"] or m["content"].isspace() for m in messages):
            batch.empty += 1
            continue
        if not any(m["role"] == "assistant" for m in messages):
            batch.no_assistant += 1
            continue
        batch.rows.append(row)
        batch.docs.append(messages)
        batch.n_bytes.append(sum(len(m["content"].encode("utf-8")) for m in messages))
        batch.n_chars.append(sum(len(m["content"]) for m in messages))
    return batch


def token_cap(source: dict) -> float:
    """The most tokens a document of `source` may have (more: dropped at tokenize time and counted as
    `long`, by count and tokenize alike): `max_conversation_tokens` for a chat source, its rendered
    conversation without delimiters (null: no cap); no cap for text (a long text spans rows)."""
    cap = source.get("max_conversation_tokens") if source.get("format", "text") == "chat" else None
    return float("inf") if cap is None else cap


def raw_label(path: str | os.PathLike) -> str:
    """How an error names a raw shard: the user's file it was placed from (`origin` in its download
    sidecar `{path}.json`; the copy is byte-identical, so row numbers hold there), then the copy."""
    try:
        origin = read_json(f"{path}.json").get("origin")
    except (OSError, ValueError, AttributeError):
        origin = None
    return f"{origin} (placed as {path})" if origin and origin != str(Path(path).resolve()) else str(path)


def doc_text(doc: str | list[dict]) -> str:
    """Plain text of a document (a conversation's contents joined by newlines), for BPE training."""
    return doc if isinstance(doc, str) else "\n".join(m["content"] for m in doc)


# ----------------------------------------------------------------------------- tokenized shards


# Why a raw row is not in a tokenized shard (its `dropped` counts, by reason; docs/data-contract.md).
DROP_REASONS = ("empty", "invalid_utf8", "short", "null_content", "no_assistant", "long")
# The exact counts of a raw shard, tallied by the tokenize job as it reads the shard (its metadata's
# `counts`) and joined into the run's count table (pipeline.data.count; docs/data-contract.md, "Counts").
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
# Rows the reader does not pass on as documents (`DocBatch`): they have no tokens and no delimiters.
NOT_DOCUMENTS = ("empty_documents", "invalid_utf8_documents", "null_content_documents", "no_assistant_documents")


def token_dtype(n_vocab: int) -> np.dtype:
    """uint16 while every id fits (n_vocab <= 2**16), else uint32."""
    return np.dtype("<u2") if n_vocab <= 1 << 16 else np.dtype("<u4")


def token_paths(out_json: str | os.PathLike) -> dict[str, Path]:
    """The sibling files of a tokenized shard's metadata `{stem}.json`."""
    out_json = Path(out_json)
    stem = out_json.parent / out_json.name.removesuffix(".json")
    return {
        "bin": Path(f"{stem}.bin"),
        "idx": Path(f"{stem}.idx.npy"),
        "mask": Path(f"{stem}.mask.bin"),
        "json": out_json,
    }


def load_shard_meta(out_json: str | os.PathLike) -> dict:
    """Read a tokenized shard's metadata; a clear error if it is missing."""
    p = Path(out_json)
    if not p.exists():
        raise PipelineError(f"{p}: tokenized shard metadata not found; run the tokenize stage for this shard")
    return read_json(p)


def open_tokens(out_json: str | os.PathLike) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray | None]:
    """Memory-map a tokenized shard: (metadata, tokens, offsets, mask or None)."""
    meta = load_shard_meta(out_json)
    paths = token_paths(out_json)
    expect = int(meta["n_tokens"])
    needed = [paths["bin"], paths["idx"]] + ([paths["mask"]] if meta.get("has_mask") else [])
    if any(not p.exists() for p in needed):
        raise PipelineError(f"{paths['json']}: its {', '.join(p.name for p in needed if not p.exists())} is missing; "
                            "rerun the tokenize stage for this shard")
    off = np.load(paths["idx"], mmap_mode="r")
    if paths["bin"].stat().st_size != expect * np.dtype(meta["dtype"]).itemsize or len(off) != meta["n_docs"] + 1:
        raise PipelineError(f"{paths['bin']}: size does not match {paths['json']}; rerun the tokenize stage for this "
                            "shard")
    tokens = np.memmap(paths["bin"], dtype=meta["dtype"], mode="r") if expect else np.zeros(0, meta["dtype"])
    mask = None
    if meta.get("has_mask"):
        mask = np.memmap(paths["mask"], dtype=np.uint8, mode="r") if expect else np.zeros(0, np.uint8)
    return meta, tokens, off, mask


def load_doc_tokens(tokens_json: str | os.PathLike) -> tuple[dict, np.ndarray]:
    """A tokenized shard's metadata and each document's span length (delimiters included)."""
    meta = load_shard_meta(tokens_json)
    if not isinstance(meta.get("n_docs"), int) or not isinstance(meta.get("doc_rows"), list):
        raise PipelineError(f"{tokens_json}: no n_docs / doc_rows; not a tokenized-shard metadata file, "
                            "rerun the tokenize stage")
    idx_path = token_paths(tokens_json)["idx"]
    try:
        off = np.load(idx_path)
    except (OSError, ValueError) as e:
        raise PipelineError(f"{idx_path}: cannot read the document offsets ({e}); "
                            "rerun the tokenize stage for this shard") from None
    if len(off) != meta["n_docs"] + 1 or len(meta["doc_rows"]) != meta["n_docs"]:
        raise PipelineError(f"{tokens_json}: n_docs {meta['n_docs']}, doc_rows and {idx_path.name} disagree; "
                            "rerun the tokenize stage for this shard")
    return meta, np.diff(off).astype(np.int64)


def _chat_texts(conversations: pa.Array) -> pa.Array:
    """Each conversation's message contents joined by newlines (null contents count as empty)."""
    contents = pc.struct_field(pc.list_flatten(conversations), "content").cast(pa.large_string())
    lengths = pc.fill_null(pc.list_value_length(conversations), 0).to_numpy().astype(np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]))
    lists = pa.LargeListArray.from_arrays(offsets, pc.fill_null(contents, ""))
    return pc.binary_join(lists, pa.scalar("\n", pa.large_string()))


TEXT_BATCH_ROWS = 1024  # raw rows read and decoded at once by iter_document_texts


def iter_document_texts(path: str | os.PathLike, source: dict, doc_rows: list[int],
                        batch_rows: int = TEXT_BATCH_ROWS) -> Iterator[pa.Array]:
    """The text of each tokenized document (raw rows `doc_rows` of the shard, ascending) as
    consecutive chunks of large strings, in document order. The raw column is read one record batch
    of `batch_rows` rows at a time, so memory is bounded by a batch, not by the shard."""
    chat = source.get("format", "text") == "chat"
    pf = open_parquet(path)
    column = source_column(pf, path, source)
    rows = np.asarray(doc_rows, dtype=np.int64)
    n_rows = pf.metadata.num_rows
    if len(rows) and (rows.min() < 0 or rows.max() >= n_rows):
        raise PipelineError(f"{path}: the tokenized shard names rows up to {rows.max()} but the file has "
                            f"{n_rows}; rerun the tokenize stage for this shard")
    if np.any(rows[1:] <= rows[:-1]):
        raise PipelineError(f"{path}: the tokenized shard's doc_rows are not ascending; "
                            "rerun the tokenize stage for this shard")
    batches = pf.iter_batches(batch_size=batch_rows, columns=[column], use_threads=False)
    start = pos = 0
    while pos < len(rows):
        try:
            batch = next(batches)
        except (OSError, pa.ArrowException) as e:
            raise PipelineError(f"{path}: cannot read column '{column}' ({e}); "
                                "the file is corrupt or truncated, re-download it") from None
        end = start + batch.num_rows
        hi = int(np.searchsorted(rows, end))
        if hi > pos:
            taken = batch.column(0)
            if hi - pos < batch.num_rows:  # some rows are not documents
                taken = taken.take(pa.array(rows[pos:hi] - start))
            try:
                texts = _chat_texts(taken) if chat else taken.cast(pa.large_string())
            except (pa.ArrowException, KeyError) as e:
                raise PipelineError(f"{path}: column '{column}' has type {taken.type}, which is not "
                                    f"{'list<struct<role, content>>' if chat else 'string'} ({e})") from None
            yield texts
        start, pos = end, hi


def document_texts(path: str | os.PathLike, source: dict, doc_rows: list[int]) -> pa.Array:
    """The text of each tokenized document (raw rows `doc_rows` of the shard, ascending), as large
    strings: `iter_document_texts` in one array."""
    chunks = list(iter_document_texts(path, source, doc_rows))
    return pa.concat_arrays(chunks) if chunks else pa.array([], pa.large_string())



# ----------------------------------------------------------------------------- group manifests


def write_manifest(stage: str, out: str | Path, files: list[str]) -> dict:
    """The group manifest of a per-shard job: every file it wrote (path and size) with provenance.

    Per-shard stages run one job per group of `shards_per_job` shards; each shard's own outputs are
    written atomically by the stage, and when every shard of the group is done this manifest — the
    job's declared output — is written last, so a job killed part-way is rerun whole."""
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise PipelineError(f"{stage}: expected outputs are missing: {', '.join(missing[:5])}"
                            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    manifest = {
        "stage": stage,
        "files": [{"path": str(f), "bytes": Path(f).stat().st_size} for f in files],
        "meta": provenance("manifest", {"stage": stage}),
    }
    write_json(out, manifest)
    return manifest


def add_group_args(ap, inputs: str, outputs: str) -> None:
    """The arguments of a per-shard CLI, which handles a whole group of shards in one process:
    `--inputs` and `--outputs` (one output per input, in order) and the optional `--manifest`."""
    ap.add_argument("--inputs", nargs="+", required=True, help=inputs)
    ap.add_argument("--outputs", nargs="+", required=True, help=outputs)
    ap.add_argument("--manifest", help="the group manifest to write last (the rule's declared output)")


def run_group(stage: str, inputs: list, outputs: list[str], manifest: str | None, work) -> None:
    """One process for a whole group of shards: `work(input, output)` for each pair, in order, then
    the group manifest (when given) listing `outputs`. The caller loads what the group shares (the
    tokenizer, the parameters) once, before; heavy imports happen where they are used."""
    if len(inputs) != len(outputs):
        raise PipelineError(f"{stage}: {len(inputs)} inputs but {len(outputs)} --outputs; pass one output per input")
    for inp, out in zip(inputs, outputs, strict=True):
        work(inp, out)
    if manifest is not None:
        write_manifest(stage, manifest, outputs)


def shard_name(path: str | os.PathLike) -> str:
    """A shard's name: its raw file's stem (`D/web/shard_00000.parquet` -> `shard_00000`)."""
    return Path(path).name.removesuffix(".parquet")


# ----------------------------------------------------------------------------- ranking


def salt(seed: int, *names: str) -> np.uint64:
    """A 64-bit salt from the run seed and names (stable across machines and library versions)."""
    digest = hashlib.sha256(repr((seed, *names)).encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def rank_by_hash(shard_names: list[str], shard: np.ndarray, doc: np.ndarray, seed: int, *names: str) -> np.ndarray:
    """Indices that order documents (`shard` indexes `shard_names`; `doc` is the index in the shard)
    by `fmix64(doc ^ salt(seed, *names, shard name))`, ties by (shard, doc): a seeded, reproducible
    shuffle in which a document's hash depends on its own shard's name and its index only, so adding
    shards or sources, or listing them in another order, leaves the relative order of the others as
    it was."""
    salts = np.array([salt(seed, *names, n) for n in shard_names], dtype=np.uint64)
    h = fmix64(doc.astype(np.int64).view(np.uint64) ^ salts[shard])
    return np.lexsort((doc, shard, h))


# ----------------------------------------------------------------------------- schedules and packed rows


SCHEDULE_COLUMNS = ("source", "shard", "doc", "tokens", "epoch")

# Bits of a bestfit pack's `.mask.bin` (one uint8 per token): MASK_ASSISTANT marks an assistant
# target of a chat source (its content and <|assistant_end|>, from the tokenized chat mask), MASK_REAL
# every real token (not padding). The loader turns them into a stage's loss mask: loss `assistant`
# counts MASK_ASSISTANT targets, loss `all` MASK_REAL targets.
MASK_ASSISTANT, MASK_REAL = 1, 2


def read_schedule(path: str | os.PathLike):
    """The mix schedule as a pyarrow table, checked for the contract's columns and non-empty."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise PipelineError(f"{path}: cannot read the mix schedule ({e}); rerun the mix stage") from None
    missing = [c for c in SCHEDULE_COLUMNS if c not in table.column_names]
    if missing:
        raise PipelineError(f"{path}: schedule lacks column(s) {', '.join(missing)}; rerun the mix stage")
    if table.num_rows == 0:
        raise PipelineError(f"{path}: the schedule holds no documents; check the mix's weights and the split")
    return table


def shard_keys(table) -> tuple[list[str], np.ndarray]:
    """The distinct `source/shard` names of a schedule (first-seen order) and each row's index into them."""
    import pyarrow.compute as pc

    keys = pc.binary_join_element_wise(table["source"], table["shard"], "/")
    names = pc.unique(keys)
    return names.to_pylist(), pc.index_in(keys, value_set=names).to_numpy().astype(np.int64)


def token_column_mismatches(tokens: np.ndarray, spans: np.ndarray, delimiters_per_doc: int) -> np.ndarray:
    """Indices where a `tokens` column (split / mix files) disagrees with the tokenized span lengths.

    The column may count a document's tokens with its delimiter(s) (= the span length) or without
    (= span − delimiters_per_doc); the convention of the first row must hold for every row.
    """
    if not len(tokens):
        return np.zeros(0, np.int64)
    without = int(tokens[0] == spans[0] - delimiters_per_doc and delimiters_per_doc > 0)
    return np.flatnonzero(tokens != spans - without * delimiters_per_doc)


def pack_paths(out_json: str | os.PathLike) -> dict[str, Path]:
    out_json = Path(out_json)
    stem = out_json.parent / out_json.name.removesuffix(".json")
    return {"bin": Path(f"{stem}.bin"), "docs": Path(f"{stem}.docs.npy"), "mask": Path(f"{stem}.mask.bin"),
            "json": out_json}


def span_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated `arange(s, s + n)` for every (s, n), without a Python loop."""
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths
    return np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
