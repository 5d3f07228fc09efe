"""Dedup stage: exact and MinHash-LSH near-duplicate clusters across every shard of every source, per segment.

    python -m pipeline.data.dedup signatures --params JSON --source S --inputs R/filtered/S/{shard}.parquet \
        ... --tokens R/tokens/S/{shard}.json ... --outputs R/dedup/sig/S/{shard}.parquet ... [--manifest M]
    python -m pipeline.data.dedup index [--params JSON] --manifests M... [--shards S/SH...] [--earlier SEG...] --out I
    python -m pipeline.data.dedup candidates --params JSON (--index I | --inputs SIG...) --part P --out PAIRS \
        [--bands-out B]
    python -m pipeline.data.dedup clusters --params JSON (--index I | --inputs SIG...) [--pairs PAIRS...] \
        --outdir R/dedup [--report R] [--segment-dir R/dedup/index/{seg}]
    python -m pipeline.data.dedup report --params JSON --segments R/dedup/index/*/segment.json --index-dir D --out R
    python -m pipeline.data.dedup append --params JSON --kept DIR --source INDEX_OR_RUN

Documents are the tokenized ones (chat: the message contents joined by newlines). Keys, candidates, the merge,
keepers (the reference first), segments: docs/architecture.md ("Dedup"); files: docs/data-contract.md.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import add_config_args, dedup_signatures_slice, dedup_slice, params_from_args
from pipeline.data import dedup_index, minhash
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
from pipeline.run_config import run_config

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
    view = run_config(params)
    if source not in view.sources:
        raise PipelineError(f"source '{source}' is not in the config's sources ({', '.join(view.sources)})")
    dd = view.dedup
    tok_meta, tokens = load_doc_tokens(tokens_json)
    texts = iter_document_texts(input_path, view.sources[source], tok_meta["doc_rows"])
    hashed = hash_documents(texts, dd, len(tokens))
    meta = provenance("dedup_signatures", params, [input_path, tokens_json], source=source, shard=shard,
                      n_docs=len(tokens), **{k: dd[k] for k in HASH_PARAMS})
    _write_signature_file(out, signature_table(tokens, hashed), meta)
    write_lsh_files(out, hashed, dd.partitions, meta)
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
    docs: int = 0  # its documents
    offset: int = 0  # row of its document 0 in its segment (the shards in key order, back to back)

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


def catalogue(paths: list[str | os.PathLike], dd: dict, earlier: Iterable[str] = ()) -> list[ShardSig]:
    """The signature files in key order, each checked to carry the current hashing parameters.

    `earlier`: the `source/shard` names of the run's earlier segments, in their order. Source and
    shard indices go by first appearance over `earlier` and then these shards sorted, so keys stay
    unique across a run's segments; without `earlier` they are the sorted positions."""
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
        found.append((meta["source"], meta["shard"], Path(p), int(meta.get("n_docs", 0))))
    names = [(s, sh) for s, sh, _, _ in found]
    if len(set(names)) != len(names):
        dup = next(n for n, c in Counter(names).items() if c > 1)
        raise PipelineError(f"two signature inputs are for {dup[0]}/{dup[1]}; pass each shard once")
    before = [tuple(n.split("/", 1)) for n in earlier]
    again = sorted(set(before) & set(names))
    if again:
        raise PipelineError(f"{'/'.join(again[0])} is in an earlier dedup segment of this run; rerun the dedup")
    src_index: dict[str, int] = {}
    shard_index: dict[tuple[str, str], int] = {}
    per_source: Counter = Counter()
    for s, sh in [*before, *sorted(names)]:
        src_index.setdefault(s, len(src_index))
        shard_index[(s, sh)] = per_source[s]
        per_source[s] += 1
    if len(src_index) > MAX_SOURCES:
        raise PipelineError(f"{len(src_index)} sources exceed the document-key limit of {MAX_SOURCES}")
    if per_source and max(per_source.values()) > MAX_SHARDS:
        source = max(per_source, key=per_source.get)
        raise PipelineError(f"source '{source}' has {per_source[source]} shards, over the document-key limit "
                            f"of {MAX_SHARDS}")
    out = sorted((ShardSig(s, sh, p, (src_index[s] << SOURCE_SHIFT) | (shard_index[(s, sh)] << SHARD_SHIFT), n)
                  for s, sh, p, n in found), key=lambda x: x.base)
    offset = 0
    for i, shard in enumerate(out):
        out[i] = ShardSig(shard.source, shard.shard, shard.path, shard.base, shard.docs, offset)
        offset += shard.docs
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


# ============================================================================= the reference

REF_BASE = -(1 << 62)  # id of the reference's first document: reference ids are negative, in reference order
EMPTY_BANDS = np.zeros((3, 0), np.uint64)  # a partition's index rows: [band + 1, band key, row], sorted


def save_bands(path, rows: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, rows)


@dataclass
class RefSegment:
    """One segment of a dedup index (docs/data-contract.md, "Dedup index")."""

    dir: Path
    start: int  # position of its first document among the reference's documents
    docs: int
    parts: int
    files: list[Path]  # its shards' hash arrays, in its row order
    ends: np.ndarray  # cumulative documents per file
    own: bool  # one of this run's earlier segments: its stored clusters are the run's
    cache: dict = field(default_factory=dict)  # the mapped index rows of the partition being read

    def _band_rows(self, part: int, parts: int) -> np.ndarray:
        """Its index rows of partition `part` of `parts`, memory-mapped (read whole and filtered when it
        was written for another partition count)."""
        paths = [self.dir / "bands" / f"{p}.npy" for p in ([part] if self.parts == parts else range(self.parts))]
        try:
            arrays = [np.load(path, mmap_mode="r") for path in paths]
        except (OSError, ValueError) as e:
            raise PipelineError(f"{paths[0].parent}: cannot read the dedup index ({e}); rebuild it (rerun the "
                                "dedup of the run that wrote it)") from None
        if self.parts == parts:
            return arrays[0]
        rows = np.concatenate(arrays, axis=1)
        rows = rows[:, rows[1] % np.uint64(parts) == np.uint64(part)]
        return rows[:, np.lexsort((rows[1], rows[0]))]

    def lookup(self, part: int, parts: int, band: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of the sorted band keys `keys` of `band` it holds, their first documents' ids). Binary
        search in the memory-mapped rows: only their pages are read."""
        if (part, parts) not in self.cache:
            self.cache.clear()
            self.cache[(part, parts)] = self._band_rows(part, parts)
        rows = self.cache[(part, parts)]
        lo, hi = np.searchsorted(rows[0], [band + 1, band + 2])
        if hi == lo or not len(keys):
            return np.zeros(len(keys), bool), np.zeros(0, np.int64)
        held = rows[1, lo:hi]
        pos = np.minimum(np.searchsorted(held, keys), hi - lo - 1)
        hit = held[pos] == keys
        return hit, REF_BASE + self.start + rows[2, lo:hi][pos[hit]].astype(np.int64)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The exact-hash + signature rows of its documents `rows` (sorted), from the memory-mapped arrays."""
        fi = np.searchsorted(self.ends, rows, side="right")
        out = []
        for f in np.unique(fi).tolist():
            lo, hi = np.searchsorted(fi, [f, f + 1])
            try:
                arr = np.load(self.files[f], mmap_mode="r")
                out.append(np.asarray(arr[rows[lo:hi] - (self.ends[f - 1] if f else 0)]))
            except (OSError, ValueError, IndexError) as e:
                raise PipelineError(f"{self.files[f]}: cannot read the dedup index's signatures ({e}); rebuild "
                                    "the index (rerun the dedup of the run that wrote it)") from None
        return np.concatenate(out)


class Reference:
    """What a segment is deduplicated against: the `dedup.reference` indexes' segments, then the run's
    earlier segments, in that order (a document's id: REF_BASE + its position in that order)."""

    def __init__(self, descriptors: list[dict]):
        self.segments, start = [], 0
        for d in descriptors:
            seg_dir = Path(d["dir"])
            files = [seg_dir / "docs" / f"{s['name']}.npy" for s in d["shards"]]
            ends = np.cumsum([s["docs"] for s in d["shards"]], dtype=np.int64)
            self.segments.append(RefSegment(seg_dir, start, d["docs"], d["parts"], files, ends, bool(d.get("own"))))
            start += d["docs"]
        self.starts = np.array([s.start for s in self.segments], np.int64)
        self.docs = start

    def first(self, part: int, parts: int, band: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of the sorted band keys `keys` of `band` (partition `part` of `parts`) the reference
        holds, the id of each one's first document: the earliest segment's smallest)."""
        best = np.zeros(len(keys), np.int64)  # 0: none yet (ids are below 0)
        for seg in self.segments:
            hit, ids = seg.lookup(part, parts, band, keys)
            idx = np.flatnonzero(hit)
            unset = best[idx] == 0
            best[idx[unset]] = ids[unset]
        hit = best < 0
        return hit, best[hit]

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = ids - REF_BASE
        si = np.searchsorted(self.starts, pos, side="right") - 1
        return si, pos - self.starts[si]

    def hashes(self, ids: np.ndarray) -> np.ndarray:
        """The exact-hash + signature rows of reference documents `ids` (sorted)."""
        si, rows = self._locate(ids)
        out = []
        for s in np.unique(si).tolist():
            lo, hi = np.searchsorted(si, [s, s + 1])
            out.append(self.segments[s].rows(rows[lo:hi]))
        return np.concatenate(out)

    def clusters(self, ids: np.ndarray) -> np.ndarray:
        """The run's cluster id of reference documents: an earlier segment's stored one (its keeper's
        key, or an id below 0 when it was removed against the reference), else the id itself."""
        out = ids.copy()
        si, rows = self._locate(ids)
        for s in np.unique(si).tolist():
            seg = self.segments[s]
            if seg.own:
                sel = si == s
                out[sel] = np.load(seg.dir / "clusters.npy", mmap_mode="r")[rows[sel]]
        return out


def load_nodes(shards: list[ShardSig], nodes: np.ndarray, sig_nodes: np.ndarray,
               num_perm: int, reference: Reference | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact hashes (len(nodes),) of the documents whose keys are `nodes` (sorted), and signatures
    (len(sig_nodes), num_perm) of those in `sig_nodes` (sorted, a subset), reading only their rows
    of the shards' memory-mapped lsh arrays (the reference's, for ids below 0)."""
    exact = np.zeros(len(nodes), np.uint64)
    sig = np.zeros((len(sig_nodes), num_perm), np.uint32)
    n_ref = int(np.searchsorted(nodes, 0))
    if n_ref:
        rows = reference.hashes(nodes[:n_ref])
        if rows.shape[1] != 2 + num_perm:
            raise PipelineError(f"the dedup reference holds signatures of {rows.shape[1] - 2} permutations, "
                                f"this run {num_perm}; rebuild it with the same dedup.num_perm")
        exact[:n_ref] = np.ascontiguousarray(rows[:, :2]).view(np.uint64).reshape(-1)
        s_ref = int(np.searchsorted(sig_nodes, 0))
        if s_ref:
            sig[:s_ref] = rows[np.searchsorted(nodes[:n_ref], sig_nodes[:s_ref]), 2:]
    by_id = {s.base >> SHARD_SHIFT: s for s in shards}
    ids = nodes >> SHARD_SHIFT
    for sid in np.unique(ids[n_ref:]).tolist():
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


def group_edges(chunks: dict[int, list], firsts: list | None = None,
                reference=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct edges (key, rep, exact), sorted by (key, rep): each member of a (band, band key) group
    of >= 2 documents to the group's smallest key — every member to the group's first reference document
    when `reference(band, sorted band keys)` (-> which it holds, their ids) holds one; `exact` when some
    exact-hash group gave the pair. Consumes `chunks` band by band, so only one band's rows are sorted at
    a time. `firsts` (a list) receives (band, band key, key) of every group the reference does not hold."""
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
        start = np.flatnonzero(first)
        rep_of = key[start]
        member = ~first
        if reference is not None:
            held, ids = reference(band, bkey[start])
            rep_of[held] = ids
            member |= np.repeat(held, np.diff(np.append(start, len(key))))
            start_mine = start[~held]
        else:
            start_mine = start
        if firsts is not None:
            firsts.append((np.full(len(start_mine), band, np.int16), bkey[start_mine], key[start_mine]))
        del bkey
        rep = np.repeat(rep_of, np.diff(np.append(start, len(key))))
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
            exact: np.ndarray, reference: Reference | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ok, key_hash, rep_hash) of the edges: ok = exact or estimated Jaccard >= threshold. Signatures
    are loaded for the ends of band edges only (an exact edge holds without them)."""
    ends = np.unique(np.concatenate([key, rep]))
    if not len(ends):
        return np.zeros(0, bool), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    near = np.flatnonzero(~exact)
    sig_ends = np.unique(np.concatenate([key[near], rep[near]]))
    hashes, sig = load_nodes(shards, ends, sig_ends, dd["num_perm"], reference)
    ok = exact.copy()
    for lo in range(0, len(near), JACCARD_CHUNK):
        edges = near[lo:lo + JACCARD_CHUNK]
        a, b = np.searchsorted(sig_ends, key[edges]), np.searchsorted(sig_ends, rep[edges])
        ok[edges] = minhash.estimated_jaccard(sig[a], sig[b]) >= dd["threshold"]
    return ok, hashes[np.searchsorted(ends, key)], hashes[np.searchsorted(ends, rep)]


def index_rows(shards: list[ShardSig], firsts: list) -> np.ndarray:
    """The segment's index rows of one partition, [band + 1, band key, row] (3, n) uint64, from
    `group_edges`' `firsts`: each band group's first document as its row in the segment, sorted by
    (band, band key)."""
    if not firsts:
        return EMPTY_BANDS
    band, bkey, key = (np.concatenate(c) for c in zip(*firsts))
    bases = np.array([s.base for s in shards], np.int64)
    si = np.searchsorted(bases, key, side="right") - 1
    row = np.array([s.offset for s in shards], np.int64)[si] + (key - bases[si])
    return np.stack([(band.astype(np.int64) + 1).astype(np.uint64), bkey, row.astype(np.uint64)])


def candidates(shards: list[ShardSig], dd: dict, part: int, parts: int, reference: Reference | None = None,
               bands: list | None = None) -> pa.Table:
    """Candidate job `part` of `parts`: its confirmed-or-not edges as a PAIR_SCHEMA table (ends below 0
    are reference documents); `bands` (a list) receives the segment's index rows of the partition."""
    if not 0 <= part < parts:
        raise ValueError(f"partition {part} is not in 0..{parts - 1}")
    if not dd["enabled"] or not (dd["exact"] or dd["near"]):
        if bands is not None:
            bands.append(EMPTY_BANDS)
        return PAIR_SCHEMA.empty_table()
    firsts = [] if bands is not None else None
    lookup = None
    if reference is not None and reference.segments:
        def lookup(band, keys):
            return reference.first(part, parts, band, keys)
    key, rep, exact = group_edges(partition_rows(shards, dd, part, parts), firsts, lookup)
    if bands is not None:
        bands.append(index_rows(shards, firsts))
    ok, key_hash, rep_hash = confirm(shards, dd, key, rep, exact, reference)
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


def find_clusters(shards: list[ShardSig], dd: dict, reference: Reference | None = None,
                  bands: list | None = None) -> Clusters:
    """Every candidate slice in this process, one after the other, then the merge: what the
    `candidates` jobs and the `clusters` job compute between them."""
    return merge_pairs([candidates(shards, dd, p, dd["partitions"], reference, bands)
                        for p in range(dd["partitions"])], dd)


def _spanning(root: np.ndarray, ids: np.ndarray) -> int:
    """Number of clusters (members' `root`) whose members carry more than one distinct id."""
    if not len(root):
        return 0
    pairs = np.unique(np.stack([root, ids]), axis=1)
    return int((np.unique(pairs[0], return_counts=True)[1] > 1).sum())


COUNTS = ("documents", "tokens", "removed_documents", "removed_tokens", "exact", "near",
          "reference_documents", "reference_tokens")


def cluster_report(clusters: Clusters, per_source: dict, shards: list[ShardSig], dd: dict, params: dict) -> dict:
    """The report JSON: removals per source (`reference_*`: of them, those removed against the
    reference), cluster sizes, cross-shard / cross-source clusters."""
    roots, sizes = np.unique(clusters.root, return_counts=True)
    totals = {k: sum(s[k] for s in per_source.values()) for k in COUNTS}
    _rates([*per_source.values(), totals])
    return {
        "enabled": dd["enabled"],
        "total": totals,
        "per_source": per_source,
        "removals": _removals(totals),
        "clusters": {
            "with_duplicates": len(roots),
            "spanning_shards": _spanning(clusters.root, clusters.nodes >> SHARD_SHIFT),
            "spanning_sources": _spanning(clusters.root, clusters.nodes >> SOURCE_SHIFT),
            "size_histogram": {str(k): int(v) for k, v in zip(*np.unique(sizes, return_counts=True))},
            "largest": int(sizes.max(initial=1)),
        },
        "candidates": clusters.stats,
        "keeper": "the reference first (what was kept earlier wins), then the smallest document key = first in "
                  "(source, shard, doc) order",
        "params": params,
        "meta": provenance("dedup", params, [s.path for s in shards], n_shards=len(shards)),
    }


def _rates(rows: list[dict]) -> None:
    for s in rows:
        s["duplicate_rate_documents"] = s["removed_documents"] / s["documents"] if s["documents"] else 0.0
        s["duplicate_rate_tokens"] = s["removed_tokens"] / s["tokens"] if s["tokens"] else 0.0


def _removals(t: dict) -> dict:
    return {"exact": t["exact"], "near": t["near"], "within_run": t["removed_documents"] - t["reference_documents"],
            "against_reference": t["reference_documents"]}


# ============================================================================= segments and their jobs

def _shard_of(sig_path: str | os.PathLike) -> str:
    return f"{Path(sig_path).parent.name}/{Path(sig_path).stem}"


def write_index(manifests: list[str | os.PathLike], out, shards: list[str] | None = None,
                earlier: list[str | os.PathLike] = (), params: dict | None = None, index_dir=None) -> dict:
    """The `index` CLI: one segment's inputs in one file, so its candidate and merge jobs each depend on
    one file, not on every group: its signature files (of the group manifests, those of `shards` when
    given), the run's `earlier` segments (their segment.json) and the `dedup.reference` indexes'
    segments, each reference file checked against its recorded sha256 here, once per segment."""
    files = []
    for m in manifests:
        try:
            files += [f["path"] for f in json.loads(Path(m).read_text())["files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PipelineError(f"{m}: not a group manifest ({e}); rerun dedup_signatures") from None
    if shards is not None:
        files = [f for f in files if _shard_of(f) in set(shards)]
        missing = sorted(set(shards) - {_shard_of(f) for f in files})
        if missing:
            raise PipelineError(f"no signature file of {', '.join(missing[:3])} in the group manifests; "
                                "rerun dedup_signatures")
    resolved = {"indexes": [], "segments": []}
    dd = None if params is None else run_config(params).dedup
    if dd is not None and dd.get("reference"):
        resolved = dedup_index.resolve_references(dd.reference, dd, own=index_dir)
        dedup_index.verify_segments(resolved["segments"])
    own, names = [], []
    for e in earlier:
        try:
            seg = json.loads(Path(e).read_text())
        except (OSError, ValueError) as err:
            raise PipelineError(f"{e}: not a dedup segment ({err}); rerun dedup_merge") from None
        own.append({**seg, "dir": str(Path(e).parent), "own": True})
        names += [s["name"] for s in seg["shards"]]
    write_manifest("dedup_signatures", out, files)
    manifest = {**json.loads(Path(out).read_text()), "earlier": names, "indexes": resolved["indexes"],
                "reference": [{k: v for k, v in s.items() if k != "report"} for s in resolved["segments"]] + own}
    write_json(out, manifest)
    return manifest


def read_segment_index(path) -> dict:
    try:
        index = json.loads(Path(path).read_text())
        index["files"] = [f["path"] for f in index["files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PipelineError(f"{path}: not a signature index ({e}); rerun dedup_index") from None
    return {"earlier": [], "indexes": [], "reference": [], **index}


def signature_files(args) -> list[str]:
    """--inputs, or the files listed by --index (a `write_index` manifest)."""
    return args.inputs if args.inputs else read_segment_index(args.index)["files"]


def _segment_inputs(args) -> tuple[list[str], dict]:
    if args.inputs:
        return args.inputs, {"earlier": [], "indexes": [], "reference": []}
    seg = read_segment_index(args.index)
    return seg["files"], seg


def write_candidates(sig_paths: list[str | os.PathLike], part: int, out, params: dict, segment: dict | None = None,
                     bands_out=None) -> dict:
    """The `candidates` CLI: candidate job `part` of `dedup.partitions` (of a segment: its earlier
    segments and reference from its index); with `bands_out`, the segment's index rows of the
    partition there. Returns the pairs file's metadata."""
    dd = run_config(params).dedup
    segment = segment or {}
    if not sig_paths:
        raise PipelineError("no signature files given (--inputs); run dedup_signatures first")
    if not 0 <= part < dd.partitions:
        raise PipelineError(f"--part {part} is not in 0..{dd.partitions - 1} "
                            f"(dedup.partitions = {dd.partitions})")
    shards = catalogue(sig_paths, dd, segment.get("earlier", ()))
    reference = Reference(segment.get("reference", []))
    bands = [] if bands_out else None
    table = candidates(shards, dd, part, dd.partitions, reference, bands)
    meta = provenance("dedup_candidates", params, [s.path for s in shards], part=part, parts=dd.partitions,
                      n_shards=len(shards), shards=[s.name for s in shards], reference_docs=reference.docs)
    if bands_out:
        save_bands(bands_out, bands[0])
    write_parquet(out, table, meta)
    log.info("partition %d/%d: %d candidate pairs, %d confirmed", part, dd.partitions, table.num_rows,
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


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        os.link(src, tmp)
    except OSError:
        import shutil
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_segment(segment_dir, shards: list[ShardSig], clusters: np.ndarray, dd: dict, report: dict,
                  run: str, bands: list[pa.Table] | None = None) -> dict:
    """The run's dedup index segment in `segment_dir` (docs/data-contract.md, "Dedup index"): its shards'
    hash arrays (hard links of their lsh .npy), each document's cluster id, and `bands/{p}.npy` (the
    candidate jobs wrote them, or `bands` here); `segment.json` last, with the files' sha256 and `report`."""
    segment_dir = Path(segment_dir)
    for p, rows in enumerate(bands or []):
        save_bands(segment_dir / "bands" / f"{p}.npy", rows)
    for shard in shards:
        _link(lsh_paths(shard.path)[1], segment_dir / "docs" / shard.source / f"{shard.shard}.npy")
    with atomic_path(segment_dir / "clusters.npy") as tmp, open(tmp, "wb") as f:
        np.save(f, clusters.astype(np.int64))
    rel = [f"bands/{p}.npy" for p in range(dd["partitions"])] + \
        [f"docs/{s.name}.npy" for s in shards] + ["clusters.npy"]
    files = []
    for r in rel:
        if not (segment_dir / r).is_file():
            raise PipelineError(f"{segment_dir / r} is missing; rerun dedup_candidates")
        files.append({"path": r, "bytes": (segment_dir / r).stat().st_size,
                      "sha256": dedup_index.file_sha256(segment_dir / r)})
    seg = {"format": dedup_index.FORMAT, "run": run, "shards": [{"name": s.name, "docs": s.docs} for s in shards],
           "docs": sum(s.docs for s in shards), "parts": dd["partitions"],
           "hash": {k: dd[k] for k in HASH_PARAMS}, "flags": {k: dd[k] for k in ("enabled", "exact", "near")},
           "files": files}
    seg["sha256"] = dedup_index.segment_digest(seg)
    seg["report"] = report
    write_json(segment_dir / dedup_index.SEGMENT_FILE, seg)
    return seg


def run_clusters(sig_paths: list[str | os.PathLike], outdir, report_path, params: dict,
                 pair_paths: list[str | os.PathLike] | None = None, segment: dict | None = None,
                 segment_dir=None, run: str = "") -> dict:
    """The `clusters` CLI: keep lists for every input shard plus the report; returns the report. With
    `pair_paths` (the candidate jobs' outputs) it merges them, else it computes the candidates itself.
    `segment`: its earlier segments and reference (`write_index`); `segment_dir`: write the segment there."""
    dd = run_config(params).dedup
    segment = segment or {}
    if not sig_paths:
        raise PipelineError("no signature files given (--inputs); run dedup_signatures first")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    shards = catalogue(sig_paths, dd, segment.get("earlier", ()))
    reference = Reference(segment.get("reference", []))
    bands = [] if segment_dir is not None and pair_paths is None else None
    if pair_paths is None:
        clusters = find_clusters(shards, dd, reference, bands)
    else:
        clusters = merge_pairs(read_candidates(pair_paths, shards, dd), dd)
    tables, per_source, seg_clusters = [], {}, []
    for shard in shards:
        t = shard.read(["doc", "tokens"])
        keys = _doc_keys(shard, t)
        cluster, reason = clusters.assign(keys)
        keep = cluster == keys
        against = cluster < 0
        if against.any():
            cluster[against] = reference.clusters(cluster[against])
        ref = cluster < 0
        seg_clusters.append(cluster)
        tables.append(pa.table({"doc": t.column("doc"), "cluster": pa.array(cluster), "keep": pa.array(keep),
                                "reason": pa.array(reason, pa.string()), "reference": pa.array(ref)}))
        tokens = t.column("tokens").to_numpy()
        s = per_source.setdefault(shard.source, dict.fromkeys(COUNTS, 0))
        s["documents"] += len(keys)
        s["tokens"] += int(tokens.sum())
        s["removed_documents"] += int((~keep).sum())
        s["removed_tokens"] += int(tokens[~keep].sum())
        s["exact"] += int((reason == "exact").sum())
        s["near"] += int((reason == "near").sum())
        s["reference_documents"] += int(ref.sum())
        s["reference_tokens"] += int(tokens[ref].sum())
    report = cluster_report(clusters, per_source, shards, dd, params)
    report["reference"] = {"indexes": segment.get("indexes", []), "documents": reference.docs,
                           "segments": len(reference.segments)}
    for shard, table in zip(shards, tables):
        meta = provenance("dedup", params, [shard.path], source=shard.source, shard=shard.shard)
        write_parquet(outdir / "keep" / shard.source / f"{shard.shard}.parquet", table, meta)
    if segment_dir is not None:
        write_segment(segment_dir, shards, np.concatenate(seg_clusters) if seg_clusters else np.zeros(0, np.int64),
                      dd, report, run, bands)
    if report_path is not None:
        write_json(report_path, report)
    t = report["total"]
    log.info("%d of %d documents removed (%d exact, %d near; %d against the reference) in %d clusters with "
             "duplicates", t["removed_documents"], t["documents"], t["exact"], t["near"], t["reference_documents"],
             report["clusters"]["with_duplicates"])
    return report


def _sum_histograms(hists: list[dict]) -> dict:
    total: Counter = Counter()
    for h in hists:
        total.update({int(k): v for k, v in h.items()})
    return {str(k): total[k] for k in sorted(total)}


def write_report(segment_files: list[str | os.PathLike], out, params: dict, index_dir, run: str,
                 fingerprint: str) -> dict:
    """The final `dedup` job: the run's report (its segments' reports summed; one segment's report is
    the run's) and the index manifest `index_dir/index.json` over the segments, written last."""
    segs = []
    for f in segment_files:
        try:
            segs.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            raise PipelineError(f"{f}: not a dedup segment ({e}); rerun dedup_merge") from None
    reports = [s["report"] for s in segs]
    if len(reports) == 1:
        report = dict(reports[0])
    else:
        per_source: dict = {}
        for r in reports:
            for src, c in r["per_source"].items():
                acc = per_source.setdefault(src, dict.fromkeys(COUNTS, 0))
                for k in COUNTS:
                    acc[k] += c[k]
        totals = {k: sum(s[k] for s in per_source.values()) for k in COUNTS}
        _rates([*per_source.values(), totals])
        cl = [r["clusters"] for r in reports]
        report = {**reports[-1], "total": totals, "per_source": per_source, "removals": _removals(totals),
                  "clusters": {"with_duplicates": sum(c["with_duplicates"] for c in cl),
                               "spanning_shards": sum(c["spanning_shards"] for c in cl),
                               "spanning_sources": sum(c["spanning_sources"] for c in cl),
                               "size_histogram": _sum_histograms([c["size_histogram"] for c in cl]),
                               "largest": max(c["largest"] for c in cl)},
                  "candidates": {k: sum(r["candidates"].get(k, 0) for r in reports) for k in reports[0]["candidates"]}}
    report["segments"] = [{"segment": i, "shards": len(s["shards"]), "documents": s["docs"],
                           "removed_documents": s["report"]["total"]["removed_documents"],
                           "against_reference": s["report"]["total"]["reference_documents"]}
                          for i, s in enumerate(segs)]
    report["reference"] = {"indexes": reports[0]["reference"]["indexes"],
                           "documents": reports[0]["reference"]["documents"]}
    report["meta"] = provenance("dedup", params, segment_files, n_segments=len(segs))
    index_dir = Path(index_dir)
    listed = [{**{k: v for k, v in s.items() if k != "report"}, "dir": Path(f).parent.name}
              for s, f in zip(segs, segment_files)]
    dedup_index.write_index(index_dir, listed, report["reference"]["indexes"], run_config(params).dedup, run,
                            fingerprint, provenance("dedup", params, segment_files))
    for d in index_dir.iterdir():  # segments of an earlier layout
        if d.is_dir() and d.name.isdigit() and d.name not in {s["dir"] for s in listed}:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    write_json(out, report)
    t = report["total"]
    log.info("%d segment(s): %d of %d documents removed, %d of them against the reference", len(segs),
             t["removed_documents"], t["documents"], t["reference_documents"])
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
    idx = sub.add_parser("index", help="one segment's inputs in one manifest (its signature files and reference)")
    idx.add_argument("--params", help="the rule's config slice as JSON (its dedup.reference is resolved here)")
    idx.add_argument("--configfile", help="a full config YAML")
    idx.set_defaults(set=None)
    idx.add_argument("--manifests", nargs="+", required=True, help="R/dedup/sig/{source}/_manifest/{group}.json")
    idx.add_argument("--shards", nargs="+", help="the segment's source/shard names (default: every listed file)")
    idx.add_argument("--earlier", nargs="*", default=[], help="R/dedup/index/{k}/segment.json of earlier segments")
    idx.add_argument("--index-dir", help="R/dedup/index (this run's own index: refused as a reference)")
    idx.add_argument("--out", required=True, help="R/dedup/seg/{seg}/index.json")

    def add_signature_inputs(p) -> None:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--inputs", nargs="+", help="R/dedup/sig/*/*.parquet")
        g.add_argument("--index", help="R/dedup/seg/{seg}/index.json (what the rules pass)")

    cand = sub.add_parser("candidates", help="candidate pairs of one band-key partition")
    add_config_args(cand)
    add_signature_inputs(cand)
    cand.add_argument("--part", type=int, required=True, help="0 .. dedup.partitions - 1")
    cand.add_argument("--out", required=True, help="R/dedup/seg/{seg}/pairs/{part}.parquet")
    cand.add_argument("--bands-out", help="R/dedup/index/{seg}/bands/{part}.npy: the segment's index rows")
    clu = sub.add_parser("clusters", help="cluster all shards' signatures")
    add_config_args(clu)
    add_signature_inputs(clu)
    clu.add_argument("--pairs", nargs="+", help="R/dedup/seg/{seg}/pairs/*.parquet: every candidates job's output "
                     "(without: computed here)")
    clu.add_argument("--outdir", required=True, help="R/dedup (keep lists go to OUTDIR/keep/{source}/{shard}.parquet)")
    clu.add_argument("--report", help="the report JSON (default: only inside the segment's segment.json)")
    clu.add_argument("--segment-dir", help="R/dedup/index/{seg}: write the index segment there")
    clu.add_argument("--run", default="", help="the run's name, recorded in the segment")
    rep = sub.add_parser("report", help="the run's report from its segments, and the index manifest")
    add_config_args(rep)
    rep.add_argument("--segments", nargs="+", required=True, help="R/dedup/index/{seg}/segment.json, in order")
    rep.add_argument("--index-dir", required=True, help="R/dedup/index")
    rep.add_argument("--run", required=True)
    rep.add_argument("--fingerprint", default="", help="the settings the segments were made with")
    rep.add_argument("--out", required=True, help="R/dedup/report.json")
    app = sub.add_parser("append", help="append an index's segments to a kept index directory")
    add_config_args(app)
    app.add_argument("--kept", required=True, help="the kept index directory (created if absent)")
    app.add_argument("--source", required=True, help="an index directory, R/dedup or a run's results directory")
    args = ap.parse_args(argv)
    if args.command == "signatures":
        tune_allocator()
        params = params_from_args(args, dedup_signatures_slice)
        if len(args.tokens) != len(args.inputs):
            raise PipelineError(f"{len(args.inputs)} --inputs but {len(args.tokens)} --tokens; pass one per shard")
        run_group("dedup_signatures", list(zip(args.inputs, args.tokens, strict=True)), args.outputs, args.manifest,
                  lambda inp, out: write_signatures(inp[0], inp[1], args.source, shard_name(inp[0]), params, out))
    elif args.command == "index":
        params = params_from_args(args, dedup_slice) if (args.params or args.configfile) else None
        write_index(args.manifests, args.out, args.shards, args.earlier, params, args.index_dir)
    elif args.command == "candidates":
        files, segment = _segment_inputs(args)
        write_candidates(files, args.part, args.out, params_from_args(args, dedup_slice), segment, args.bands_out)
    elif args.command == "clusters":
        files, segment = _segment_inputs(args)
        run_clusters(files, args.outdir, args.report, params_from_args(args, dedup_slice), args.pairs, segment,
                     args.segment_dir, args.run)
    elif args.command == "report":
        write_report(args.segments, args.out, params_from_args(args, dedup_slice), args.index_dir, args.run,
                     args.fingerprint)
    else:
        dedup_index.append(args.kept, args.source, params_from_args(args, dedup_slice)["dedup"])


if __name__ == "__main__":
    run_cli(main)
