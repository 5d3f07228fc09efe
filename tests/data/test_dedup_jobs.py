"""Dedup clustering split into P candidate jobs + a merge job gives exactly the single-job clusters."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline import dedup
from pipeline.data import dedup_jobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from dedup_scale import DD, write_synthetic  # noqa: E402

DEDUP = {"enabled": True, "exact": True, "near": True, "threshold": 0.7, "partitions": 8, **DD}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigs")
    return dedup.catalogue(write_synthetic(root, 24_000, 5_000, dup_rate=0.3, seed=3), DEDUP)


@pytest.mark.parametrize("parts", [1, 3, 8])
def test_partitioned_clusters_equal_single_job(shards, tmp_path, parts):
    single = dedup.find_clusters(shards, DEDUP, tmp_path)
    assert single.stats["confirmed_pairs"] > 1000 and single.stats["rejected_pairs"] > 50  # a real workload
    assert 0 < single.exact.sum() < len(single.exact)
    tables = [dedup_jobs.candidates(shards, DEDUP, p, parts) for p in range(parts)]
    if parts > 1:  # the jobs hold disjoint slices: none sees every pair
        assert max(t.num_rows for t in tables) < single.stats["candidate_pairs"]
    got = dedup_jobs.merge_pairs(tables, DEDUP)
    np.testing.assert_array_equal(got.nodes, single.nodes)
    np.testing.assert_array_equal(got.root, single.root)
    np.testing.assert_array_equal(got.exact, single.exact)
    assert got.stats == single.stats


@pytest.mark.parametrize("flags", [{"near": False}, {"exact": False}, {"enabled": False}])
def test_partitioned_clusters_equal_single_job_per_mode(shards, tmp_path, flags):
    dd = {**DEDUP, **flags}
    single = dedup.find_clusters(shards, dd, tmp_path)
    got = dedup_jobs.merge_pairs([dedup_jobs.candidates(shards, dd, p, 4) for p in range(4)], dd)
    np.testing.assert_array_equal(got.root, single.root)
    np.testing.assert_array_equal(got.exact, single.exact)
    assert got.stats == single.stats
