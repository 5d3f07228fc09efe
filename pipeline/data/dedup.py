"""Dedup stage: exact and MinHash-LSH near-duplicate clusters across every shard of every source.

Three CLIs, one per Snakemake rule (the hashing maths is in `pipeline.data.minhash`):

    python -m pipeline.data.dedup signatures --params JSON --source S --inputs D/S/{shard}.parquet ... \
        --tokens R/tokens/S/{shard}.json ... --outputs R/dedup/sig/S/{shard}.parquet ... [--manifest M]
    python -m pipeline.data.dedup index --manifests R/dedup/sig/*/_manifest/*.json --out R/dedup/sig/index.json
    python -m pipeline.data.dedup candidates --params JSON (--index R/dedup/sig/index.json | --inputs SIG...) \
        --part P --out R/dedup/pairs/P.parquet                                  (P = 0 .. partitions - 1)
    python -m pipeline.data.dedup clusters --params JSON (--index R/dedup/sig/index.json | --inputs SIG...) \
        [--pairs R/dedup/pairs/*.parquet] --outdir R/dedup --report R/dedup/report.json

**signatures** (each shard of a group, in one process). The documents are the tokenized ones:
document `doc` is raw row `doc_rows[doc]` of the shard (from the tokenize stage's `.json`), its text
the `text_column`, or for chat sources the message contents joined by newlines (roles are ignored).
The signature file (columns, metadata): docs/data-contract.md ("Dedup signatures"); `clusters`
checks that every file's hashing parameters agree with its own.

**candidates** and **clusters**: clustering is split into `partitions` candidate jobs, each holding a
bounded slice of the band keys, and one merge job (`clusters`), so no process holds the band keys of
the whole corpus (memory model and measurements: BENCHMARKS.md, "Dedup at scale"). `clusters`
without `--pairs` runs the candidate slices itself, one after the other.

- Document key: every document gets the globally unique int64
  `key = source_index << 56 | shard_index << 32 | doc`, where `source_index` is the position of the
  source among the inputs' source names sorted, and `shard_index` the position of the shard among
  that source's shard names sorted (limits: 127 sources, 2^24 shards per source, 2^32 documents
  per shard). Key order is (source, shard, doc) order.
- Candidates, job p of P: every shard's (band, band key) rows and, with `exact`, its exact hashes (as
  band -1) whose key mod P == p, read one shard at a time; a (band, band key) group therefore lies
  whole in one job. The signatures job writes these rows already partitioned (`write_lsh_files`:
  one row group per partition), so job p reads only its row group of each shard and the P jobs
  between them read each row once: the stage's work is linear in the corpus, not P times it.
  Grouped one band at a time (sort), a group of k >= 2 documents yields the k - 1 edges member ->
  the group's smallest document key; a pair from several groups is kept once,
  `exact` when an exact-hash group gave it.
- Confirmation, in the candidate job: an exact-hash edge holds as is; a band edge holds when the
  estimated Jaccard similarity (fraction of equal signature positions) of the two documents is
  >= `threshold`. Only the signatures of documents on the job's edges are loaded (4 * num_perm bytes
  each), from the memory-mapped `lsh/{shard}.npy` rows, so only their pages are read. The job writes
  its edges (docs/data-contract.md, "Dedup candidate pairs").
- Merge: the union of the jobs' edges, each distinct pair once (`exact`/confirmed if any job says so),
  is the candidate set one process grouping every band key would find, so clusters, keepers and
  statistics do not depend on P (tested).
- Clusters: connected components of the confirmed edges. The cluster id is the smallest document
  key in the cluster, and that document is its keeper (deterministic, independent of input order).
  A document on no confirmed edge is its own cluster (id = its key), kept.
- Outputs: `outdir/keep/{source}/{shard}.parquet` for every input shard (docs/data-contract.md,
  "Dedup"; `reason` is `exact` for a removed document whose normalised text equals its keeper's,
  `near` for the other removed ones), and the report:
  documents and tokens removed per source (tokens are the `tokens` column: spans with delimiters),
  exact vs near removals, cluster-size histogram, clusters spanning shards / sources, candidate
  counts, params. With `enabled: false` every document is its own cluster and kept.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import add_config_args, dedup_signatures_slice, dedup_slice, params_from_args
from pipeline.data import minhash
from pipeline.data.contract import (
    add_group_args,
    iter_document_texts,
    load_doc_tokens,
    run_group,
    shard_name,
    write_manifest,
)
from pipeline.errors import PipelineError
from pipeline.io import (
    META_KEY,
    atomic_path,
    get_logger,
    progress,
    provenance,
    read_parquet_meta,
    run_cli,
    write_json,
    write_parquet,
)

log = get_logger(__name__)

HASH_PARAMS = ("ngram", "num_perm", "bands", "rows", "seed")
BATCH_BYTES = 1 << 19  # text hashed per vectorised batch: its arrays stay in a core's cache
SOURCE_SHIFT, SHARD_SHIFT = 56, 32
MAX_SOURCES, MAX_SHARDS, MAX_DOCS = 1 << 7, 1 << 24, 1 << 32
EXACT_BAND = -1  # the pseudo-band of exact-hash groups


# ============================================================================= signatures


def tune_allocator() -> None:
    """Make glibc's malloc keep freed memory for reuse: no trimming, no mmap below 32 MiB.

    Hashing allocates many megabyte-sized numpy temporaries per batch; by default glibc hands them
    back to the OS and the next batch page-faults fresh pages, which costs ~30% of the signatures
    stage on a VM. The `signatures` CLI (and its benchmark) calls this once; a no-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def _batches(texts: pa.Array) -> list[tuple[int, int]]:
    """Consecutive document ranges [lo, hi) of about BATCH_BYTES of text each (at least one document)."""
    ends = np.cumsum(pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False))
    cuts = np.unique(np.searchsorted(ends, np.arange(BATCH_BYTES, ends[-1] if len(ends) else 0, BATCH_BYTES)) + 1)
    bounds = [0, *cuts[cuts < len(texts)].tolist(), len(texts)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def hash_documents(texts: pa.Array | Iterable[pa.Array], dd: dict, n: int | None = None) -> dict[str, np.ndarray]:
    """Exact hashes (n,), band keys (n, bands) and signatures (n, num_perm) of the documents: one
    array of texts, or `n` documents' texts as consecutive chunks (`iter_document_texts`), hashed as
    they come so only one chunk's text is held."""
    chunks = [texts] if isinstance(texts, pa.Array) else texts
    n = len(texts) if isinstance(texts, pa.Array) else n
    perms = minhash.permutations(dd["num_perm"], dd["seed"])
    out = {"exact": np.empty(n, np.uint64), "bands": np.empty((n, dd["bands"]), np.uint64),
           "sig": np.empty((n, dd["num_perm"]), np.uint32)}
    done = 0
    for chunk in progress(chunks, desc="minhash", unit="chunk"):
        for lo, hi in _batches(chunk):
            wh, word_off = minhash.doc_word_hashes(chunk.slice(lo, hi - lo))
            lo, hi = lo + done, hi + done
            out["exact"][lo:hi] = minhash.exact_hashes(wh, word_off)
            out["sig"][lo:hi] = minhash.signatures(*minhash.shingle_hashes(wh, word_off, dd["ngram"]), perms)
            out["bands"][lo:hi] = minhash.band_keys(out["sig"][lo:hi], dd["bands"], dd["rows"])
        done += len(chunk)
    if done != n:
        raise PipelineError(f"{done} document texts for {n} documents")
    return out


def signature_table(tokens: np.ndarray, hashed: dict[str, np.ndarray]) -> pa.Table:
    def fixed(values: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])

    return pa.table({
        "doc": pa.array(np.arange(len(tokens), dtype=np.int64)),
        "tokens": pa.array(tokens),
        "exact": pa.array(hashed["exact"]),
        "bands": fixed(hashed["bands"]),
        "sig": fixed(hashed["sig"]),
    })


def _write_signature_file(path, table: pa.Table, meta: dict) -> None:
    """`pipeline.io.write_parquet` without dictionary encoding: every hash value is distinct, and
    trying to dictionary-encode 120 of them per document costs more than writing them (5x)."""
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, use_dictionary=False)


def write_signatures(input_path, tokens_json, source: str, shard: str, params: dict, out) -> dict:
    """The `signatures` CLI: hash one shard's tokenized documents into `out`; returns its metadata."""
    if source not in params["sources"]:
        raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(params['sources'])})")
    dd = params["dedup"]
    tok_meta, tokens = load_doc_tokens(tokens_json)
    texts = iter_document_texts(input_path, params["sources"][source], tok_meta["doc_rows"])
    hashed = hash_documents(texts, dd, len(tokens))
    meta = provenance("dedup_signatures", params, [input_path, tokens_json], source=source, shard=shard,
                      n_docs=len(tokens), **{k: dd[k] for k in HASH_PARAMS})
    _write_signature_file(out, signature_table(tokens, hashed), meta)
    write_lsh_files(out, hashed, dd["partitions"], meta)
    log.info("%s/%s: signatures of %d documents", source, shard, len(tokens))
    return meta


def lsh_paths(sig_path: str | os.PathLike) -> tuple[Path, Path]:
    """The two files written beside a signature file `D/{shard}.parquet` for the candidate jobs:
    `D/lsh/{shard}.parquet` (its band keys, one row group per partition) and `D/lsh/{shard}.npy`
    (its exact hashes and signatures, row = document, read by memory map)."""
    sig_path = Path(sig_path)
    return sig_path.parent / "lsh" / sig_path.name, sig_path.parent / "lsh" / f"{sig_path.stem}.npy"


LSH_SCHEMA = pa.schema([("band", pa.int16()), ("bkey", pa.uint64()), ("doc", pa.uint32())])


def write_lsh_files(sig_path: str | os.PathLike, hashed: dict[str, np.ndarray], parts: int, meta: dict) -> None:
    """The candidate jobs' view of one shard's hashes (docs/data-contract.md, "Dedup signatures"):
    every (band, band key, doc) row, the exact hash as band EXACT_BAND, sorted by (key mod `parts`,
    band) and written one row group per non-empty partition, so candidate job p reads only its rows;
    and the (n, 2 + num_perm) uint32 array [exact hash as two uint32, signature] per document, which
    the jobs memory-map to confirm their edges reading only those documents' pages."""
    exact, bands, sig = hashed["exact"], hashed["bands"], hashed["sig"]
    n, nb = bands.shape
    bkey = np.concatenate([exact, bands.T.reshape(-1)])
    band = np.repeat(np.arange(EXACT_BAND, nb, dtype=np.int16), n)
    part = (bkey % np.uint64(parts)).astype(np.int64)
    order = np.argsort(part * (nb + 1) + (band.astype(np.int64) - EXACT_BAND), kind="stable")
    doc = np.tile(np.arange(n, dtype=np.uint32), nb + 1)[order]
    band, bkey = band[order], bkey[order]
    counts = np.bincount(part, minlength=parts)
    ends = np.cumsum(counts)
    rows_path, npy_path = lsh_paths(sig_path)
    lsh_meta = {**meta, "parts": parts, "part_rows": counts.tolist()}
    schema = LSH_SCHEMA.with_metadata({META_KEY: json.dumps(lsh_meta).encode()})
    table = pa.table([band, bkey, doc], schema=schema)
    with atomic_path(rows_path) as tmp:
        with pq.ParquetWriter(tmp, schema, use_dictionary=["band"], write_statistics=False) as w:
            for p in np.flatnonzero(counts):
                w.write_table(table.slice(ends[p] - counts[p], counts[p]), row_group_size=int(counts[p]))
    with atomic_path(npy_path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.concatenate([exact.view(np.uint32).reshape(n, 2), sig], axis=1))


# ============================================================================= clusters

@dataclass(frozen=True)
class ShardSig:
    """One input signatures file and its place in the key space."""

    source: str
    shard: str
    path: Path
    base: int  # key of document 0

    @property
    def name(self) -> str:
        return f"{self.source}/{self.shard}"

    def partition(self, part: int, parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(band, band key, doc) of the shard's rows whose band key mod `parts` == `part`, sorted by
        band: one row group of its lsh file, or (a file partitioned for another count, as in the
        one-process `clusters` without --pairs) the whole file filtered."""
        path = lsh_paths(self.path)[0]
        try:
            pf = pq.ParquetFile(path)
            meta = json.loads(pf.schema_arrow.metadata[META_KEY])
            rows = meta["part_rows"]
            if meta["parts"] == parts:
                t = pf.read_row_group(sum(1 for c in rows[:part] if c)) if rows[part] else LSH_SCHEMA.empty_table()
            else:
                t = pf.read()
        except (OSError, pa.ArrowException, KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"{path}: cannot read the partitioned band keys ({e}); "
                                f"rerun dedup_signatures for {self.name}") from None
        band, bkey, doc = (t.column(c).to_numpy() for c in LSH_SCHEMA.names)
        if meta["parts"] != parts:
            sel = np.flatnonzero(bkey % np.uint64(parts) == np.uint64(part))
            sel = sel[np.argsort(band[sel], kind="stable")]
            band, bkey, doc = band[sel], bkey[sel], doc[sel]
        return band, bkey, doc

    def hashes(self) -> np.ndarray:
        """The (n_docs, 2 + num_perm) uint32 exact-hash + signature rows, memory-mapped."""
        path = lsh_paths(self.path)[1]
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise PipelineError(f"{path}: cannot read the signatures ({e}); "
                                f"rerun dedup_signatures for {self.name}") from None

    def read(self, columns: list[str]) -> pa.Table:
        try:
            return pq.read_table(self.path, columns=columns)
        except (OSError, pa.ArrowException) as e:
            raise PipelineError(f"{self.path}: cannot read the signatures ({e}); "
                                f"rerun dedup_signatures for {self.name}") from None


def catalogue(paths: list[str | os.PathLike], dd: dict) -> list[ShardSig]:
    """The signature files in key order, each checked to carry the current hashing parameters."""
    found = []
    for p in paths:
        try:
            meta = read_parquet_meta(p)
        except (OSError, pa.ArrowException) as e:
            raise PipelineError(f"{p}: not a readable signatures file ({e}); rerun dedup_signatures") from None
        if "source" not in meta or "shard" not in meta:
            raise PipelineError(f"{p}: no source/shard metadata; "
                                "it was not written by `pipeline.data.dedup signatures`")
        stale = {k: meta.get(k) for k in HASH_PARAMS if meta.get(k) != dd[k]}
        if stale:
            raise PipelineError(f"{p}: signatures were made with {stale}, but the config says "
                                f"{ {k: dd[k] for k in stale} }; rerun dedup_signatures")
        found.append((meta["source"], meta["shard"], Path(p)))
    names = [(s, sh) for s, sh, _ in found]
    if len(set(names)) != len(names):
        dup = next(n for n, c in Counter(names).items() if c > 1)
        raise PipelineError(f"two signature inputs are for {dup[0]}/{dup[1]}; pass each shard once")
    sources = sorted({s for s, _, _ in found})
    if len(sources) > MAX_SOURCES:
        raise PipelineError(f"{len(sources)} sources exceed the document-key limit of {MAX_SOURCES}")
    out = []
    for si, source in enumerate(sources):
        shards = sorted((sh, p) for s, sh, p in found if s == source)
        if len(shards) > MAX_SHARDS:
            raise PipelineError(f"source '{source}' has {len(shards)} shards, over the document-key limit "
                                f"of {MAX_SHARDS}")
        out += [ShardSig(source, sh, p, (si << SOURCE_SHIFT) | (hi << SHARD_SHIFT))
                for hi, (sh, p) in enumerate(shards)]
    return out


def _fixed_list(table: pa.Table, column: str) -> np.ndarray:
    """A fixed_size_list column as a 2-D numpy array."""
    arr = table.column(column).combine_chunks()
    return arr.flatten().to_numpy().reshape(len(arr), arr.type.list_size)


def _doc_keys(shard: ShardSig, table: pa.Table) -> np.ndarray:
    doc = table.column("doc").to_numpy()
    if len(doc) and doc.max() >= MAX_DOCS:
        raise PipelineError(f"{shard.path}: {doc.max() + 1} documents exceed the document-key limit "
                            f"of {MAX_DOCS} per shard")
    return shard.base + doc.astype(np.int64)


def load_nodes(shards: list[ShardSig], nodes: np.ndarray, sig_nodes: np.ndarray,
               num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact hashes (len(nodes),) of the documents whose keys are `nodes` (sorted), and signatures
    (len(sig_nodes), num_perm) of those in `sig_nodes` (sorted, a subset), reading only their rows
    of the shards' memory-mapped lsh arrays."""
    exact = np.zeros(len(nodes), np.uint64)
    sig = np.zeros((len(sig_nodes), num_perm), np.uint32)
    by_id = {s.base >> SHARD_SHIFT: s for s in shards}
    ids = nodes >> SHARD_SHIFT
    for sid in np.unique(ids).tolist():
        shard = by_id[sid]
        lo, hi = np.searchsorted(ids, [sid, sid + 1])
        arr = shard.hashes()
        docs = nodes[lo:hi] - shard.base
        if arr.ndim != 2 or arr.shape[1] != 2 + num_perm or docs[-1] >= len(arr):
            raise PipelineError(f"{lsh_paths(shard.path)[1]}: shape {arr.shape} does not hold document "
                                f"{docs[-1]} of {2 + num_perm} columns; rerun dedup_signatures for {shard.name}")
        rows = arr[docs]
        exact[lo:hi] = np.ascontiguousarray(rows[:, :2]).view(np.uint64).reshape(-1)
        slo, shi = np.searchsorted(sig_nodes, [shard.base, shard.base + (1 << SHARD_SHIFT)])
        if shi > slo:
            sig[slo:shi] = rows[np.searchsorted(nodes[lo:hi], sig_nodes[slo:shi]), 2:]
        del arr, rows
    return exact, sig


def connected_components(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Components of the undirected graph with edges (u[i], v[i]) over int64 node ids.

    Returns (nodes: the sorted distinct ids, root: for each node the smallest id in its component).
    Vectorised union-find: hook every edge's larger root under its smaller root, compress paths by
    pointer jumping, repeat until every edge has one root.
    """
    nodes, idx = np.unique(np.concatenate([u, v]), return_inverse=True)
    a, b = idx[:len(u)], idx[len(u):]
    parent = np.arange(len(nodes))
    while True:
        ra, rb = parent[a], parent[b]
        if np.array_equal(ra, rb):
            return nodes, nodes[parent]
        low = np.minimum(ra, rb)
        np.minimum.at(parent, ra, low)
        np.minimum.at(parent, rb, low)
        while not np.array_equal(parent[parent], parent):
            parent = parent[parent]


@dataclass
class Clusters:
    """Confirmed duplicate structure: for each document key on a confirmed edge (`nodes`, sorted),
    its cluster's keeper key (`root`) and whether its text equals the keeper's (`exact`)."""

    nodes: np.ndarray
    root: np.ndarray
    exact: np.ndarray
    stats: dict

    def assign(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cluster id, reason) for documents with the given keys."""
        cluster = keys.copy()
        reason = np.full(len(keys), "keep", dtype=object)
        if len(self.nodes):
            pos = np.minimum(np.searchsorted(self.nodes, keys), len(self.nodes) - 1)
            hit = self.nodes[pos] == keys
            cluster[hit] = self.root[pos[hit]]
            removed = hit & (cluster != keys)
            reason[removed] = np.where(self.exact[pos[removed]], "exact", "near")
        return cluster, reason


PAIR_SCHEMA = pa.schema([("key", pa.int64()), ("rep", pa.int64()), ("exact", pa.bool_()), ("ok", pa.bool_()),
                         ("key_hash", pa.uint64()), ("rep_hash", pa.uint64())])
JACCARD_CHUNK = 1 << 15  # band edges whose signatures are compared at once (2 × 480 B each at num_perm 120)


def partition_rows(shards: list[ShardSig], dd: dict, part: int, parts: int) -> dict[int, list]:
    """{band: [(band keys, document keys), ...]} of every shard's rows whose band key mod `parts` ==
    `part`; band EXACT_BAND holds the exact hashes. Each shard's lsh file holds these rows as one row
    group, so the P jobs between them read each row once."""
    chunks: dict[int, list] = {}
    for shard in shards:
        band, bkey, doc = shard.partition(part, parts)
        keys = shard.base + doc.astype(np.int64)
        for b in np.unique(band).tolist():
            if not (dd["exact"] if b == EXACT_BAND else dd["near"]):
                continue
            lo, hi = np.searchsorted(band, [b, b + 1])
            if hi > lo:
                chunks.setdefault(b, []).append((bkey[lo:hi], keys[lo:hi]))
    return chunks


def group_edges(chunks: dict[int, list]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct edges (key, rep, exact), sorted by (key, rep): each member of a (band, band key) group
    of >= 2 documents to the group's smallest key; `exact` when some exact-hash group gave the pair.
    Consumes `chunks` band by band, so only one band's rows are sorted at a time."""
    e_key, e_rep, e_exact = [], [], []
    for band in sorted(chunks):
        parts = chunks.pop(band)
        bkey = np.concatenate([c[0] for c in parts])
        key = np.concatenate([c[1] for c in parts])
        del parts
        order = np.lexsort((key, bkey))
        bkey, key = bkey[order], key[order]
        del order
        first = np.ones(len(key), bool)
        first[1:] = bkey[1:] != bkey[:-1]
        del bkey
        start = np.flatnonzero(first)
        rep = np.repeat(key[start], np.diff(np.append(start, len(key))))
        member = ~first
        e_key.append(key[member])
        e_rep.append(rep[member])
        e_exact.append(np.full(int(member.sum()), band == EXACT_BAND))
        del key, rep, member, first, start
    if not e_key:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
    e_key, e_rep, e_exact = np.concatenate(e_key), np.concatenate(e_rep), np.concatenate(e_exact)
    order = np.lexsort((e_rep, e_key))
    e_key, e_rep, e_exact = e_key[order], e_rep[order], e_exact[order]
    new = np.ones(len(e_key), bool)
    new[1:] = (e_key[1:] != e_key[:-1]) | (e_rep[1:] != e_rep[:-1])
    starts = np.flatnonzero(new)
    exact = np.logical_or.reduceat(e_exact, starts) if len(starts) else np.zeros(0, bool)
    return e_key[starts], e_rep[starts], exact


def confirm(shards: list[ShardSig], dd: dict, key: np.ndarray, rep: np.ndarray,
            exact: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ok, key_hash, rep_hash) of the edges: ok = exact or estimated Jaccard >= threshold. Signatures
    are loaded for the ends of band edges only (an exact edge holds without them)."""
    ends = np.unique(np.concatenate([key, rep]))
    if not len(ends):
        return np.zeros(0, bool), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    near = np.flatnonzero(~exact)
    sig_ends = np.unique(np.concatenate([key[near], rep[near]]))
    hashes, sig = load_nodes(shards, ends, sig_ends, dd["num_perm"])
    ok = exact.copy()
    for lo in range(0, len(near), JACCARD_CHUNK):
        edges = near[lo:lo + JACCARD_CHUNK]
        a, b = np.searchsorted(sig_ends, key[edges]), np.searchsorted(sig_ends, rep[edges])
        ok[edges] = minhash.estimated_jaccard(sig[a], sig[b]) >= dd["threshold"]
    return ok, hashes[np.searchsorted(ends, key)], hashes[np.searchsorted(ends, rep)]


def candidates(shards: list[ShardSig], dd: dict, part: int, parts: int) -> pa.Table:
    """Candidate job `part` of `parts`: its confirmed-or-not edges as a PAIR_SCHEMA table."""
    if not 0 <= part < parts:
        raise ValueError(f"partition {part} is not in 0..{parts - 1}")
    if not dd["enabled"] or not (dd["exact"] or dd["near"]):
        return PAIR_SCHEMA.empty_table()
    key, rep, exact = group_edges(partition_rows(shards, dd, part, parts))
    ok, key_hash, rep_hash = confirm(shards, dd, key, rep, exact)
    return pa.table([key, rep, exact, ok, key_hash, rep_hash], schema=PAIR_SCHEMA)


def merge_pairs(tables: list[pa.Table], dd: dict) -> Clusters:
    """Clusters from every candidate job's pairs (see the module docstring)."""
    if not dd["enabled"] or not (dd["exact"] or dd["near"]):
        empty = np.zeros(0, np.int64)
        return Clusters(empty, empty, np.zeros(0, bool), {"candidate_pairs": 0, "confirmed_pairs": 0})
    pairs = pa.concat_tables([t.select(PAIR_SCHEMA.names).cast(PAIR_SCHEMA) for t in tables]) if tables \
        else PAIR_SCHEMA.empty_table()
    key, rep = (pairs.column(c).to_numpy() for c in ("key", "rep"))
    exact, ok = (pairs.column(c).to_numpy(zero_copy_only=False) for c in ("exact", "ok"))
    key_hash, rep_hash = (pairs.column(c).to_numpy() for c in ("key_hash", "rep_hash"))
    del pairs
    order = np.lexsort((rep, key))
    key, rep, exact, ok = key[order], rep[order], exact[order], ok[order]
    key_hash, rep_hash = key_hash[order], rep_hash[order]
    new = np.ones(len(key), bool)
    new[1:] = (key[1:] != key[:-1]) | (rep[1:] != rep[:-1])
    starts = np.flatnonzero(new)
    if len(starts):
        exact, ok = np.logical_or.reduceat(exact, starts), np.logical_or.reduceat(ok, starts)
    key, rep, key_hash, rep_hash = key[starts], rep[starts], key_hash[starts], rep_hash[starts]
    stats = {"candidate_pairs": len(key), "exact_pairs": int(exact.sum()), "band_pairs": int((~exact).sum()),
             "confirmed_pairs": int(ok.sum()), "rejected_pairs": int((~ok).sum())}
    nodes, root = connected_components(key[ok], rep[ok])
    ends = np.concatenate([key[ok], rep[ok]])
    end_hash = np.concatenate([key_hash[ok], rep_hash[ok]])
    node_hash = np.zeros(len(nodes), np.uint64)
    node_hash[np.searchsorted(nodes, ends)] = end_hash
    same_text = node_hash == node_hash[np.searchsorted(nodes, root)]
    return Clusters(nodes, root, same_text, stats)


def find_clusters(shards: list[ShardSig], dd: dict) -> Clusters:
    """Every candidate slice in this process, one after the other, then the merge: what the
    `candidates` jobs and the `clusters` job compute between them."""
    return merge_pairs([candidates(shards, dd, p, dd["partitions"]) for p in range(dd["partitions"])], dd)


def _spanning(root: np.ndarray, ids: np.ndarray) -> int:
    """Number of clusters (members' `root`) whose members carry more than one distinct id."""
    if not len(root):
        return 0
    pairs = np.unique(np.stack([root, ids]), axis=1)
    return int((np.unique(pairs[0], return_counts=True)[1] > 1).sum())


def cluster_report(clusters: Clusters, per_source: dict, shards: list[ShardSig], dd: dict, params: dict) -> dict:
    """The report JSON: removals per source, cluster sizes, cross-shard / cross-source clusters."""
    roots, sizes = np.unique(clusters.root, return_counts=True)
    totals = {k: sum(s[k] for s in per_source.values()) for k in ("documents", "tokens", "removed_documents",
                                                                     "removed_tokens", "exact", "near")}
    for s in [*per_source.values(), totals]:
        s["duplicate_rate_documents"] = s["removed_documents"] / s["documents"] if s["documents"] else 0.0
        s["duplicate_rate_tokens"] = s["removed_tokens"] / s["tokens"] if s["tokens"] else 0.0
    return {
        "enabled": dd["enabled"],
        "total": totals,
        "per_source": per_source,
        "removals": {"exact": totals["exact"], "near": totals["near"]},
        "clusters": {
            "with_duplicates": len(roots),
            "spanning_shards": _spanning(clusters.root, clusters.nodes >> SHARD_SHIFT),
            "spanning_sources": _spanning(clusters.root, clusters.nodes >> SOURCE_SHIFT),
            "size_histogram": {str(k): int(v) for k, v in zip(*np.unique(sizes, return_counts=True))},
            "largest": int(sizes.max(initial=1)),
        },
        "candidates": clusters.stats,
        "keeper": "smallest document key = first in (source, shard, doc) order",
        "params": params,
        "meta": provenance("dedup", params, [s.path for s in shards], n_shards=len(shards)),
    }


def write_index(manifests: list[str | os.PathLike], out) -> list[str]:
    """The `index` CLI: one manifest listing every signature file of the run (from the group
    manifests), so the candidate and merge jobs each depend on one file, not on every group."""
    files = []
    for m in manifests:
        try:
            files += [f["path"] for f in json.loads(Path(m).read_text())["files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PipelineError(f"{m}: not a group manifest ({e}); rerun dedup_signatures") from None
    write_manifest("dedup_signatures", out, files)
    return files


def signature_files(args) -> list[str]:
    """--inputs, or the files listed by --index (a `write_index` manifest)."""
    if args.inputs:
        return args.inputs
    try:
        return [f["path"] for f in json.loads(Path(args.index).read_text())["files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PipelineError(f"{args.index}: not a signature index ({e}); rerun dedup_index") from None


def write_candidates(sig_paths: list[str | os.PathLike], part: int, out, params: dict) -> dict:
    """The `candidates` CLI: candidate job `part` of `dedup.partitions`; returns the file's metadata."""
    dd = params["dedup"]
    if not sig_paths:
        raise PipelineError("no signature files given (--inputs); run dedup_signatures first")
    if not 0 <= part < dd["partitions"]:
        raise PipelineError(f"--part {part} is not in 0..{dd['partitions'] - 1} "
                            f"(dedup.partitions = {dd['partitions']})")
    shards = catalogue(sig_paths, dd)
    table = candidates(shards, dd, part, dd["partitions"])
    meta = provenance("dedup_candidates", params, [s.path for s in shards], part=part, parts=dd["partitions"],
                      n_shards=len(shards), shards=[s.name for s in shards])
    write_parquet(out, table, meta)
    log.info("partition %d/%d: %d candidate pairs, %d confirmed", part, dd["partitions"], table.num_rows,
             pc.sum(table.column("ok")).as_py() or 0)
    return meta


def read_candidates(pair_paths: list[str | os.PathLike], shards: list[ShardSig], dd: dict) -> list[pa.Table]:
    """Every candidate job's pairs, checked to be partitions 0..P-1 of the current P over these shards."""
    tables, parts = {}, dd["partitions"]
    names = [s.name for s in shards]
    for p in pair_paths:
        try:
            meta = read_parquet_meta(p)
            table = pq.read_table(p)
        except (OSError, pa.ArrowException) as e:
            raise PipelineError(f"{p}: not a readable candidate-pairs file ({e}); rerun dedup_candidates") from None
        if meta.get("parts") != parts or meta.get("part") in tables or meta.get("shards") != names:
            raise PipelineError(f"{p}: candidate pairs of partition {meta.get('part')}/{meta.get('parts')} over "
                                f"{len(meta.get('shards') or [])} shard(s), but this merge is over {parts} "
                                f"partition(s) of {len(names)} shard(s); rerun dedup_candidates")
        tables[meta["part"]] = table
    if sorted(tables) != list(range(parts)):
        missing = sorted(set(range(parts)) - set(tables))
        raise PipelineError(f"candidate pairs of partition(s) {missing} of {parts} are missing (--pairs); "
                            "run every dedup_candidates job")
    return [tables[p] for p in range(parts)]


def run_clusters(sig_paths: list[str | os.PathLike], outdir, report_path, params: dict,
                 pair_paths: list[str | os.PathLike] | None = None) -> dict:
    """The `clusters` CLI: keep lists for every input shard plus the report; returns the report. With
    `pair_paths` (the candidate jobs' outputs) it merges them, else it computes the candidates itself."""
    dd = params["dedup"]
    if not sig_paths:
        raise PipelineError("no signature files given (--inputs); run dedup_signatures first")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    shards = catalogue(sig_paths, dd)
    if pair_paths is None:
        clusters = find_clusters(shards, dd)
    else:
        clusters = merge_pairs(read_candidates(pair_paths, shards, dd), dd)
    tables, per_source = [], {}
    for shard in shards:
        t = shard.read(["doc", "tokens"])
        keys = _doc_keys(shard, t)
        cluster, reason = clusters.assign(keys)
        keep = cluster == keys
        tables.append(pa.table({"doc": t.column("doc"), "cluster": pa.array(cluster), "keep": pa.array(keep),
                                "reason": pa.array(reason, pa.string())}))
        tokens = t.column("tokens").to_numpy()
        s = per_source.setdefault(shard.source, dict.fromkeys(("documents", "tokens", "removed_documents",
                                                                 "removed_tokens", "exact", "near"), 0))
        s["documents"] += len(keys)
        s["tokens"] += int(tokens.sum())
        s["removed_documents"] += int((~keep).sum())
        s["removed_tokens"] += int(tokens[~keep].sum())
        s["exact"] += int((reason == "exact").sum())
        s["near"] += int((reason == "near").sum())
    report = cluster_report(clusters, per_source, shards, dd, params)
    for shard, table in zip(shards, tables):
        meta = provenance("dedup", params, [shard.path], source=shard.source, shard=shard.shard)
        write_parquet(outdir / "keep" / shard.source / f"{shard.shard}.parquet", table, meta)
    write_json(report_path, report)
    t = report["total"]
    log.info("%d of %d documents removed (%d exact, %d near) in %d clusters with duplicates",
             t["removed_documents"], t["documents"], t["exact"], t["near"], report["clusters"]["with_duplicates"])
    return report


# ============================================================================= CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.dedup", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sig = sub.add_parser("signatures", help="hash the documents of a group of shards of one source")
    add_config_args(sig)
    sig.add_argument("--source", required=True)
    add_group_args(sig, "raw shards D/{source}/{shard}.parquet", "R/dedup/sig/{source}/{shard}.parquet, one per input")
    sig.add_argument("--tokens", nargs="+", required=True, help="R/tokens/{source}/{shard}.json, one per input")
    idx = sub.add_parser("index", help="list every signature file of the run in one manifest")
    idx.add_argument("--manifests", nargs="+", required=True, help="R/dedup/sig/{source}/_manifest/{group}.json")
    idx.add_argument("--out", required=True, help="R/dedup/sig/index.json")

    def add_signature_inputs(p) -> None:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--inputs", nargs="+", help="R/dedup/sig/*/*.parquet")
        g.add_argument("--index", help="R/dedup/sig/index.json (what the rules pass)")

    cand = sub.add_parser("candidates", help="candidate pairs of one band-key partition")
    add_config_args(cand)
    add_signature_inputs(cand)
    cand.add_argument("--part", type=int, required=True, help="0 .. dedup.partitions - 1")
    cand.add_argument("--out", required=True, help="R/dedup/pairs/{part}.parquet")
    clu = sub.add_parser("clusters", help="cluster all shards' signatures")
    add_config_args(clu)
    add_signature_inputs(clu)
    clu.add_argument("--pairs", nargs="+", help="R/dedup/pairs/*.parquet: every candidates job's output "
                     "(without: computed here)")
    clu.add_argument("--outdir", required=True, help="R/dedup (keep lists go to OUTDIR/keep/{source}/{shard}.parquet)")
    clu.add_argument("--report", required=True, help="R/dedup/report.json")
    args = ap.parse_args(argv)
    if args.command == "signatures":
        tune_allocator()
        params = params_from_args(args, dedup_signatures_slice)
        if len(args.tokens) != len(args.inputs):
            raise PipelineError(f"{len(args.inputs)} --inputs but {len(args.tokens)} --tokens; pass one per shard")
        run_group("dedup_signatures", list(zip(args.inputs, args.tokens, strict=True)), args.outputs, args.manifest,
                  lambda inp, out: write_signatures(inp[0], inp[1], args.source, shard_name(inp[0]), params, out))
    elif args.command == "index":
        write_index(args.manifests, args.out)
    elif args.command == "candidates":
        write_candidates(signature_files(args), args.part, args.out, params_from_args(args, dedup_slice))
    else:
        run_clusters(signature_files(args), args.outdir, args.report, params_from_args(args, dedup_slice), args.pairs)


if __name__ == "__main__":
    run_cli(main)
