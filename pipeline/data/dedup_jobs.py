"""Dedup clustering split into bounded-memory jobs: P candidate jobs, then one merge job.

    candidates(shards, dd, part, parts) -> pair table    job p of P: band keys with key mod P == p
    merge_pairs(pair tables)            -> Clusters       union-find over every job's pairs

**Candidate job p of P.** Reads the `doc`, `exact` and `bands` columns of every signatures file, one
shard at a time, and keeps the (band, band key, document key) rows whose band key mod P == p (the
exact hash, as band -1, likewise). A (band, band key) group therefore lies whole in one job. Each
group of k >= 2 documents yields the k - 1 edges member -> the group's smallest key; a pair found in
several groups is kept once, `exact` when an exact-hash group gave it. Each edge is confirmed in the
job: `ok` when `exact`, or when the estimated Jaccard of the two documents' signatures is at least
`threshold` (only signatures of documents on this job's edges are read). Output rows, sorted by
(key, rep):

    key int64, rep int64, exact bool, ok bool, key_hash uint64, rep_hash uint64 (exact text hashes)

Memory is the job's rows (≈ 18 B × (bands + 1) × documents / P, 2.5× that while sorting) plus its
edges: flat in the corpus size when P grows with it (BENCHMARKS.md, "Dedup at scale").

**Merge.** The union of the jobs' pairs, each distinct (key, rep) once (`exact`/`ok`: any job's),
gives the same candidate and confirmed pair sets as grouping every band key in one process, hence
the same connected components, keepers and statistics. Memory is proportional to the candidate
pairs (the duplicates), not to the documents.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline import minhash
from pipeline.dedup import EXACT_BAND, Clusters, ShardSig, _doc_keys, _fixed_list, connected_components, load_nodes

PAIR_SCHEMA = pa.schema([("key", pa.int64()), ("rep", pa.int64()), ("exact", pa.bool_()), ("ok", pa.bool_()),
                         ("key_hash", pa.uint64()), ("rep_hash", pa.uint64())])
JACCARD_CHUNK = 1 << 18  # edges whose signatures are compared at once (2 × 480 B each at num_perm 120)


def partition_rows(shards: list[ShardSig], dd: dict, part: int, parts: int) -> dict[int, tuple]:
    """{band: (band keys, document keys)} of every shard's rows whose band key mod `parts` == `part`;
    band EXACT_BAND holds the exact hashes. One shard's columns in memory at a time besides the result."""
    chunks: dict[int, list] = {}
    for shard in shards:
        t = shard.read(["doc", "exact", "bands"])
        keys = _doc_keys(shard, t)
        cols = []
        if dd["near"]:
            bands = _fixed_list(t, "bands")
            cols += [(b, bands[:, b]) for b in range(bands.shape[1])]
        if dd["exact"]:
            cols.append((EXACT_BAND, t.column("exact").to_numpy()))
        del t
        for band, bkey in cols:
            sel = (bkey % np.uint64(parts)) == np.uint64(part) if parts > 1 else slice(None)
            chunks.setdefault(band, []).append((bkey[sel], keys[sel]))
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
    """(ok, key_hash, rep_hash) of the edges: ok = exact or estimated Jaccard >= threshold."""
    ends = np.unique(np.concatenate([key, rep]))
    if not len(ends):
        return np.zeros(0, bool), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    hashes, sig = load_nodes(shards, ends, dd["num_perm"])
    ki, ri = np.searchsorted(ends, key), np.searchsorted(ends, rep)
    ok = exact.copy()
    for lo in range(0, len(key), JACCARD_CHUNK):
        hi = min(lo + JACCARD_CHUNK, len(key))
        ok[lo:hi] |= minhash.estimated_jaccard(sig[ki[lo:hi]], sig[ri[lo:hi]]) >= dd["threshold"]
    return ok, hashes[ki], hashes[ri]


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


# ============================================================================= CLI

def main(argv=None) -> None:
    import argparse
    import json
    import sys

    import pyarrow.parquet as pq

    from pipeline.config import load_config, resolve_config, stage_params

    ap = argparse.ArgumentParser(prog="python -m pipeline.data.dedup_jobs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    cand = sub.add_parser("candidates")
    cand.add_argument("--configfile")
    cand.add_argument("--inputs-from", required=True, help="a file listing the signature files, one a line")
    cand.add_argument("--part", type=int, required=True)
    cand.add_argument("--parts", type=int, required=True)
    cand.add_argument("--out", required=True)
    mer = sub.add_parser("merge")
    mer.add_argument("--pairs", nargs="+", required=True)
    args = ap.parse_args(argv)
    if args.command == "candidates":
        cfg = load_config(args.configfile) if args.configfile else resolve_config({})
        dd = stage_params(cfg, "dedup")["dedup"]
        from pipeline.dedup import catalogue

        shards = catalogue(open(args.inputs_from).read().split(), dd)
        pq.write_table(candidates(shards, dd, args.part, args.parts), args.out)
    else:
        c = merge_pairs([pq.read_table(p) for p in args.pairs], resolve_config({})["dedup"])
        json.dump({**c.stats, "nodes": len(c.nodes)}, sys.stdout)


if __name__ == "__main__":
    main()
