"""Dedup against a reference (an earlier run's index) and in segments: the kept documents of the later
shards are those one dedup over every shard keeps when the earlier shards come first; a stale or edited
index is refused with one line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from builders import ROOT

from pipeline.config import resolve_config
from pipeline.data import dedup, dedup_index
from pipeline.errors import PipelineError
from pipeline.rules import rule_params

sys.path.insert(0, str(ROOT / "benchmarks"))
from dedup_scale import write_synthetic


def params(**overrides) -> dict:
    return rule_params(resolve_config({"dedup": overrides}), "dedup")


def keep_of(outdir, sigs) -> dict:
    return {dedup._shard_of(p): pq.read_table(outdir / "keep" / f"{dedup._shard_of(p)}.parquet").to_pydict()
            for p in sigs}


def build_run(d, sigs, p, run, earlier=(), manifests_dir=None) -> dict:
    """What the rules do for one segment: its index, its merge (in one process) and the run's report."""
    manifest = (manifests_dir or d) / f"manifest-{run}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"files": [{"path": str(s)} for s in sigs]}))
    k = len(earlier)
    seg = dedup.write_index([manifest], d / f"seg/{k}/index.json", None,
                            [d / f"index/{j}/segment.json" for j in range(k)], p, d / "index")
    seg = dedup.read_segment_index(d / f"seg/{k}/index.json")
    dedup.run_clusters(seg["files"], d, None, p, segment=seg, segment_dir=d / f"index/{k}", run=run)
    return dedup.write_report([d / f"index/{j}/segment.json" for j in range(k + 1)], d / "report.json", p,
                              d / "index", run, "fp")


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """24,000 synthetic documents in 8 shards of one source, 30 % copies of shared templates spread over
    every shard: A is the first 4 shards, B the last 4."""
    root = tmp_path_factory.mktemp("ref")
    sigs = write_synthetic(root / "sig", 24_000, 3_000, dup_rate=0.3, seed=11, sources=("web",), parts=4)
    whole = params(partitions=4)
    dedup.run_clusters(sigs, root / "all", root / "all/report.json", whole)
    a = build_run(root / "a", sigs[:4], whole, "a")
    return root, sigs, keep_of(root / "all", sigs), a


@pytest.mark.parametrize("parts", [4, 3])
def test_b_against_a_keeps_what_one_dedup_over_both_keeps(halves, parts):
    """B (its own partition count or A's) keeps exactly the B documents one dedup over A + B keeps; it
    reads A's index, not A's signature files (moved away)."""
    root, sigs, whole, a = halves
    assert a["total"]["removed_documents"] > 500 and a["total"]["reference_documents"] == 0
    p = params(partitions=parts, reference=[str(root / "a")])
    b = build_run(root / f"b{parts}", sigs[4:], p, "b")
    got = keep_of(root / f"b{parts}", sigs[4:])
    for name, table in got.items():
        assert table["keep"] == whole[name]["keep"], name
        assert table["doc"] == whole[name]["doc"]
    t = b["total"]
    assert t["reference_documents"] > 500 and t["removed_documents"] - t["reference_documents"] > 100
    assert b["removals"]["against_reference"] == t["reference_documents"]
    flags = np.concatenate([g["reference"] for g in got.values()])
    clusters = np.concatenate([g["cluster"] for g in got.values()])
    assert flags.sum() == t["reference_documents"] and (clusters[flags] < 0).all() and (clusters[~flags] >= 0).all()
    assert b["reference"]["documents"] == 12_000 and b["reference"]["indexes"][0]["sha256"] == a_sha(root)


def a_sha(root) -> str:
    return json.loads((root / "a/index/index.json").read_text())["sha256"]


def test_a_second_segment_of_a_run_keeps_what_one_dedup_keeps(halves):
    """Shards added to a finished run are a second segment deduplicated against the first: the same kept
    documents as one dedup over all; removed ones carry the run's cluster ids, not reference ones."""
    root, sigs, whole, _ = halves
    d = root / "seg"
    p = params(partitions=4)
    build_run(d, sigs[:4], p, "s")
    report = build_run(d, sigs[4:], p, "s", earlier=[0])
    got = keep_of(d, sigs[4:])
    for name, table in got.items():
        assert table["keep"] == whole[name]["keep"], name
    assert report["total"]["documents"] == 24_000 and report["total"]["reference_documents"] == 0
    assert report["total"]["removed_documents"] == sum(len(w["keep"]) - sum(w["keep"]) for w in whole.values())
    clusters = np.concatenate([g["cluster"] for g in got.values()])
    assert (clusters >= 0).all()
    index = json.loads((d / "index/index.json").read_text())
    assert [len(s["shards"]) for s in index["segments"]] == [4, 4]
    names = [f"web/{p.stem}" for p in sigs]
    assert dedup_index.plan_segments(d / "none", ["web/b", "chat/a"], "fp") == [["chat/a", "web/b"]]
    assert dedup_index.plan_segments(d / "index", names, "fp") == [names[:4], names[4:]]
    assert dedup_index.plan_segments(d / "index", names + ["web/new"], "fp") == [names[:4], names[4:], ["web/new"]]
    assert dedup_index.plan_segments(d / "index", names[1:], "fp") == [names[1:]]  # a shard gone: one again
    assert dedup_index.plan_segments(d / "index", names, "other settings") == [names]


def test_kept_index_appends_segments_and_serves_as_reference(halves, tmp_path):
    root, sigs, whole, _ = halves
    kept = tmp_path / "kept"
    idx = dedup_index.append(kept, root / "a", params()["dedup"])
    assert [len(s["shards"]) for s in idx["segments"]] == [4]
    assert dedup_index.append(kept, root / "a/index", params()["dedup"])["sha256"] == idx["sha256"]  # held already
    p = params(partitions=4, reference=[str(kept)])
    build_run(tmp_path / "b", sigs[4:], p, "b")
    for name, table in keep_of(tmp_path / "b", sigs[4:]).items():
        assert table["keep"] == whole[name]["keep"], name


def test_a_stale_or_edited_reference_is_refused_in_one_line(halves, tmp_path):
    root, sigs, _, _ = halves
    import shutil
    a = tmp_path / "a"
    shutil.copytree(root / "a/index", a / "index")
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"files": [{"path": str(s)} for s in sigs[4:]]}))

    def index_b(**kw):
        return dedup.write_index([manifest], tmp_path / "b.json", None, [], params(reference=[str(a)], **kw),
                                 tmp_path / "own")

    index_b()
    with pytest.raises(PipelineError, match="hashed with"):
        index_b(num_perm=64, bands=8, rows=8)
    with pytest.raises(PipelineError, match="no dedup index"):
        dedup.write_index([manifest], tmp_path / "b.json", None, [], params(reference=[str(tmp_path / "nope")]))
    with pytest.raises(PipelineError, match="own dedup index"):
        dedup.write_index([manifest], tmp_path / "b.json", None, [], params(reference=[str(a)]), a / "index")
    arr = a / "index/0/clusters.npy"
    data = bytearray(arr.read_bytes())
    data[-1] ^= 1
    arr.write_bytes(bytes(data))  # same size, other content
    with pytest.raises(PipelineError, match=r"clusters\.npy is not the file its index recorded") as e:
        index_b()
    assert "\n" not in str(e.value)
    arr.unlink()
    with pytest.raises(PipelineError, match="missing or changed"):
        index_b()
    index = json.loads((a / "index/index.json").read_text())
    index["segments"][0]["docs"] += 1
    (a / "index/index.json").write_text(json.dumps(index))
    with pytest.raises(PipelineError, match="was edited"):
        index_b()


def test_accounting_splits_removals_within_the_run_and_against_the_reference(tmp_path):
    import pyarrow as pa

    from pipeline.config.layout import RunLayout
    from pipeline.data import accounting

    run = RunLayout.at(tmp_path)
    path = Path(run.dedup_keep("web", "s"))
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"doc": np.arange(5), "cluster": np.array([0, 0, -7, 3, -7]),
                             "keep": np.array([True, False, False, True, False]),
                             "reason": ["keep", "exact", "near", "keep", "exact"],
                             "reference": np.array([False, False, True, False, True])}), path)
    q = {}
    spans = np.array([10, 20, 30, 40, 50])
    keep = accounting._dedup_keep(run, "web", "s", 5, q, spans, True)
    assert keep.tolist() == [True, False, False, True, False]
    assert (q["removed_within_docs"], q["removed_reference_docs"]) == (1, 2)
    assert (q["removed_within_tokens"], q["removed_reference_tokens"]) == (20, 80)
    assert q["removed_tokens"] == q["removed_within_tokens"] + q["removed_reference_tokens"]
