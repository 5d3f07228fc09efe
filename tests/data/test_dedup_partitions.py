"""Dedup clustering split into P candidate jobs + a merge job: the clusters, keepers and statistics of
an independent one-process reference (a dict of band groups, a Python union-find), for every P."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
from builders import ROOT

from pipeline.config import resolve_config
from pipeline.data import dedup, minhash
from pipeline.errors import PipelineError
from pipeline.rules import rule_params

sys.path.insert(0, str(ROOT / "benchmarks"))
from dedup_scale import write_synthetic


def dedup_params(**overrides) -> dict:
    return rule_params(resolve_config({"dedup": overrides}), "dedup")


@pytest.fixture(scope="module")
def sigs(tmp_path_factory):
    """24,000 synthetic documents in 5 shards of 2 sources, 30 % copies of shared templates: exact,
    near and far (mostly rejected) copies, clusters spanning shards and sources."""
    return write_synthetic(tmp_path_factory.mktemp("sigs"), 24_000, 5_000, dup_rate=0.3, seed=3, parts=8)


def test_each_band_row_is_in_exactly_one_partition_file_row_group(sigs):
    """The signatures job's lsh file: job p of the P it was written for reads one row group, the rows
    whose band key mod P == p, and the P jobs between them read every row once."""
    dd = dedup_params(partitions=8)["dedup"]
    for shard in dedup.catalogue(sigs, dd):
        t = shard.read(["exact", "bands"])
        bands = t.column("bands").to_pylist()
        want = sorted([(-1, int(h), d) for d, h in enumerate(t.column("exact").to_pylist())]
                      + [(b, int(k), d) for d, ks in enumerate(bands) for b, k in enumerate(ks)])
        got = []
        for p in range(8):
            band, bkey, doc = shard.partition(p, 8)
            assert (bkey % 8 == p).all() and (band[1:] >= band[:-1]).all()
            got += zip(band.tolist(), bkey.tolist(), doc.tolist())
        assert sorted(got) == want
        assert pq.ParquetFile(dedup.lsh_paths(shard.path)[0]).num_row_groups == 8


def reference(shards, dd) -> tuple[dict, dict]:
    """{key: (root, same text as root)} for documents on confirmed edges, and the pair statistics."""
    groups, exact_of, sig_of = defaultdict(list), {}, {}
    for s in shards:
        t = s.read(["doc", "exact", "bands", "sig"])
        keys = dedup._doc_keys(s, t)
        bands, sig, exact = dedup._fixed_list(t, "bands"), dedup._fixed_list(t, "sig"), t.column("exact").to_numpy()
        for i, k in enumerate(keys.tolist()):
            exact_of[k], sig_of[k] = int(exact[i]), sig[i]
            if dd["near"]:
                for b in range(bands.shape[1]):
                    groups[(b, int(bands[i, b]))].append(k)
            if dd["exact"]:
                groups[(-1, int(exact[i]))].append(k)
    pairs = {}
    for (band, _), members in groups.items():
        rep = min(members)
        for k in members:
            if k != rep:
                pairs[(k, rep)] = pairs.get((k, rep), False) or band == -1
    ok = {p: e or minhash.estimated_jaccard(sig_of[p[0]][None], sig_of[p[1]][None])[0] >= dd["threshold"]
          for p, e in pairs.items()}
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for (a, b), good in ok.items():
        if good:
            ra, rb = find(a), find(b)
            parent[max(ra, rb)] = min(ra, rb)
    clusters = {k: (find(k), exact_of[k] == exact_of[find(k)]) for k in parent}
    stats = {"candidate_pairs": len(pairs), "exact_pairs": sum(pairs.values()),
             "band_pairs": len(pairs) - sum(pairs.values()), "confirmed_pairs": sum(ok.values()),
             "rejected_pairs": len(ok) - sum(ok.values())}
    return clusters, stats


@pytest.mark.parametrize("flags", [{}, {"near": False}, {"exact": False}])
def test_partitioned_clusters_equal_the_reference_for_every_partition_count(sigs, flags):
    dd = dedup_params(**flags)["dedup"]
    shards = dedup.catalogue(sigs, dd)
    want, want_stats = reference(shards, dd)
    assert want_stats["confirmed_pairs"] > (1000 if dd["near"] else 100) and len(want) > 500
    if dd["near"]:
        assert want_stats["rejected_pairs"] > 50
        assert 0 < sum(same for _, same in want.values()) < len(want)
    for parts in (1, 3, 8, 21):
        tables = [dedup.candidates(shards, dd, p, parts) for p in range(parts)]
        if parts > 1:  # each job holds a slice: none sees every pair
            assert max(t.num_rows for t in tables) < want_stats["candidate_pairs"]
        got = dedup.merge_pairs(tables, dd)
        assert dict(zip(got.nodes.tolist(), zip(got.root.tolist(), got.exact.tolist()))) == want, parts
        assert got.stats == want_stats, parts


@pytest.mark.slow  # the CLI's processes against one process
def test_candidate_jobs_and_merge_through_the_cli_equal_one_process(sigs, tmp_path):
    params = dedup_params(partitions=3)
    py = [sys.executable, "-m", "pipeline.data.dedup"]
    manifests = []  # as dedup_signatures writes them: one per group of shards
    for i, group in enumerate((sigs[:2], sigs[2:])):
        manifests.append(tmp_path / f"m{i}.json")
        manifests[-1].write_text(json.dumps({"files": [{"path": str(p)} for p in group]}))
    subprocess.run([*py, "index", "--manifests", *map(str, manifests), "--out", str(tmp_path / "index.json")],
                   check=True, cwd=ROOT)
    args = ["--params", json.dumps(params), "--index", str(tmp_path / "index.json")]
    pairs = [tmp_path / f"pairs/{p}.parquet" for p in range(3)]
    for p, out in enumerate(pairs):
        subprocess.run([*py, "candidates", *args, "--part", str(p), "--out", str(out)], check=True, cwd=ROOT)
    subprocess.run([*py, "clusters", *args, "--pairs", *map(str, pairs), "--outdir", str(tmp_path / "jobs"),
                    "--report", str(tmp_path / "jobs/report.json")], check=True, cwd=ROOT)
    one = dedup.run_clusters(sigs, tmp_path / "one", tmp_path / "one/report.json", dedup_params(partitions=1))
    jobs = json.loads((tmp_path / "jobs/report.json").read_text())
    assert jobs["candidates"] == one["candidates"] and jobs["total"] == one["total"]
    assert jobs["total"]["removed_documents"] > 1000
    for f in sorted((tmp_path / "one/keep").rglob("*.parquet")):
        assert pq.read_table(tmp_path / "jobs/keep" / f.relative_to(tmp_path / "one/keep")).equals(pq.read_table(f))


def test_merge_refuses_missing_or_foreign_partitions(sigs, tmp_path):
    params = dedup_params(partitions=2)
    pairs = [tmp_path / f"{p}.parquet" for p in range(2)]
    for p, out in enumerate(pairs):
        dedup.write_candidates(sigs, p, out, params)
    with pytest.raises(PipelineError, match=r"partition\(s\) \[1\] of 2 are missing"):
        dedup.run_clusters(sigs, tmp_path / "a", tmp_path / "a/r.json", params, pairs[:1])
    with pytest.raises(PipelineError, match="over 3 partition"):
        dedup.run_clusters(sigs, tmp_path / "b", tmp_path / "b/r.json", dedup_params(partitions=3), pairs)
    with pytest.raises(PipelineError, match="rerun dedup_candidates"):
        dedup.run_clusters(sigs[:-1], tmp_path / "c", tmp_path / "c/r.json", params, pairs)
    with pytest.raises(PipelineError, match=r"--part 2 is not in 0\.\.1"):
        dedup.write_candidates(sigs, 2, tmp_path / "x.parquet", params)
    assert not list(tmp_path.glob("[abc]/keep"))  # nothing partial
