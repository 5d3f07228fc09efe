"""benchmarks/data_scale.py: the realistic corpus it builds, and its rehearsal through the real DAG on a tiny
corpus (every data rule measured from its jobs' own logs and benchmark tables, beside the cost plan)."""
from __future__ import annotations

import argparse
import collections
import json
import sys

import pyarrow.parquet as pq
import pytest
from builders import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import data_scale

from pipeline.planning import data_cost as cluster

pytestmark = pytest.mark.slow  # real DAG runs on built corpora


def test_corpus_is_fineweb_shaped_with_planted_duplicates_and_contamination(tmp_path):
    c = data_scale.build_corpus(tmp_path, shards=3, docs=400, contam_rate=0.02)
    files = sorted(tmp_path.glob("shard_*.parquet"))
    assert [f.name for f in files] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    texts = [t for f in files for t in pq.read_table(f)["text"].to_pylist()]
    assert pq.read_schema(files[0]).names == ["id", "text"] and len(texts) == c["documents"] == 1200
    assert 1000 < c["text_bytes"] / len(texts) < 3500  # ~2 KB a document, as the FineWeb shards
    counts = collections.Counter(texts)
    copies = sum(n - 1 for n in counts.values())
    assert c["planted"]["exact"] > 10 and c["planted"]["near"] > 10 and c["planted"]["contaminated"] > 5
    assert copies >= c["planted"]["exact"] * 0.9  # an exact copy is another document's text (bar a later edit)
    assert copies < c["planted"]["exact"] + c["planted"]["near"]  # no chance duplicates: sentences drawn at random


def test_rehearsal_measures_every_data_rule_beside_the_cost_plan(tmp_path):
    args = argparse.Namespace(workdir=str(tmp_path), shards=2, docs=200, shards_per_job=1, partitions=2,
                              train_chars=200_000, cores=2, seed=0, filter="default")
    result = data_scale.run(args)
    rows = {r["stage"]: r for r in result["rows"]}
    assert set(rows) == set(cluster.RATES)
    measured = data_scale.measure(tmp_path)
    for stage, r in rows.items():
        m = measured[stage]
        assert m["logged_jobs"] == m["jobs"] >= 1, stage  # every job's log ends with its own CPU
        assert r["cpu_s"] > 0.1 and r["wall_s"] > 0 and r["max_rss_mb"] > 1 and r["ratio"] > 0, stage
    assert rows["tokenize"]["jobs"] == rows["dedup_signatures"]["jobs"] == 2 and rows["dedup_candidates"]["jobs"] == 2
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["corpus"]["documents"] == 400 and saved["wall_s"] > 0
    assert saved["predicted"]["wall_hours"] >= saved["predicted"]["critical_path_hours"]
