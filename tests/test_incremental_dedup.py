"""Incremental dedup through the real DAG, on the sample's documents in a temp dir.

Run A dedups half of the shards; run B, the other half with `dedup.reference` = A after A's raw,
filtered and tokenized shards and signatures are gone, keeps exactly the B documents one run over
every shard (A's first) keeps; a shard added to finished A schedules its own jobs and one new segment.
Only the dedup target is built (no training).
"""
from __future__ import annotations

import copy
import json
import re
import shutil

import pyarrow.parquet as pq
import pytest
from builders import ROOT, TINY, planned_jobs, sample_docs, snakemake, write_config, write_text_shard

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("snakemake_cli")]  # Snakemake imported once

PARTS = 2


def config(run: str, sources: dict, reference: list[str] = ()) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg.update(run_name=run, data_dir=f"data/{run}")
    cfg["sources"] = {name: {"type": "local", "glob": glob} for name, glob in sources.items()}
    cfg["tokenizer"]["train_sources"] = ["web"]
    cfg["mixes"] = {"pretrain": {"weights": {s: 1.0 / len(sources) for s in sources}, "tokens": "plan",
                                 "max_epochs": 4}}
    cfg["train"]["stages"] = [{"name": "pretrain"}]
    cfg["dedup"] = {"partitions": PARTS, "reference": list(reference)}
    return cfg


def near_copy(text: str) -> str:
    words = text.split(" ")
    for i in (len(words) // 3, 2 * len(words) // 3):
        words[i] = "zebra"
    return " ".join(words)


def run(path, cfg, *args, check=True):
    write_config(path, cfg)
    return snakemake(path, f"results/{cfg['run_name']}/dedup/report.json", *args, check=check)


def jobs_with_wildcards(proc) -> list[tuple[str, str]]:
    """(rule, wildcards) of each job a dry run lists."""
    text = proc.stdout + proc.stderr
    return re.findall(r"^ *rule (\w+):\n(?: +(?!wildcards).*\n)*? +wildcards: (.*)$", text, re.M)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs A (aux + web shards 0, 1), G (aux + web 0-3: one dedup over everything, A's shards first)
    and B (web 2, 3 against A's index only), with duplicates planted across and within the halves; in
    between, a dry run of A with an aux shard added."""
    path = tmp_path_factory.mktemp("incremental")
    web = sample_docs(n_shards=4, per_shard=30, max_chars=1500)
    web[2][0] = web[0][0]  # B: an exact copy of a kept A document
    web[3][1] = near_copy(web[1][2])  # B: a near copy of an A document
    web[1][7] = web[0][3]  # A: a copy A removes ...
    web[2][9] = near_copy(web[0][3])  # ... and B: a near copy of both
    web[3][4] = web[2][5]  # within B
    aux = [pq.read_table(f, columns=["text"]).column("text").to_pylist()[:30]
           for f in sorted((ROOT / "data/sample/crawl").glob("*.parquet"))]
    for i, texts in enumerate(web):
        for half in (("a",) if i < 2 else ("b",)) + ("g",):
            write_text_shard(path / f"src/{half}/web/shard_{i:05d}.parquet", texts)
    for half in ("a", "g"):
        write_text_shard(path / f"src/{half}/aux/shard_00000.parquet", aux[0])
    # (sources not in sorted order: a finished run's recorded segments must still be its DAG)
    a = config("a", {"web": "src/a/web/*.parquet", "aux": "src/a/aux/*.parquet"})
    g = config("g", {"web": "src/g/web/*.parquet", "aux": "src/g/aux/*.parquet"})
    b = config("b", {"web": "src/b/web/*.parquet"}, reference=["results/a"])
    run(path, a)
    run(path, g)
    out = {"path": path, "a_again": planned_jobs(run(path, a, "-n"))}
    added = path / "src/a/aux/shard_00001.parquet"
    write_text_shard(added, aux[1])
    dry = run(path, a, "-n")
    out["added"], out["added_jobs"] = planned_jobs(dry), jobs_with_wildcards(dry)
    added.unlink()
    for gone in ("src/a", "data/a", "results/a/filtered", "results/a/tokens", "results/a/dedup/sig",
                 "results/a/dedup/keep"):
        shutil.rmtree(path / gone)
    run(path, b)
    out["b_again"] = planned_jobs(run(path, b, "-n"))
    return out


def keep_list(path, run_name, shard):
    return pq.read_table(path / f"results/{run_name}/dedup/keep/web/{shard}.parquet").to_pydict()


def doc_of(path, run_name, shard, raw_row) -> int:
    """The document index (keep lists' `doc`) of a raw row: its place among the filter's kept rows, then
    among the tokenized documents."""
    kept = pq.read_table(path / f"results/{run_name}/filtered/web/{shard}.decisions.parquet").column("kept").to_pylist()
    assert kept[raw_row], (shard, raw_row)
    rows = json.loads((path / f"results/{run_name}/tokens/web/{shard}.json").read_text())["doc_rows"]
    return rows.index(sum(kept[:raw_row]))


def test_b_against_a_keeps_what_one_dedup_over_all_keeps(runs):
    path = runs["path"]
    for shard in ("shard_00002", "shard_00003"):
        b, g = keep_list(path, "b", shard), keep_list(path, "g", shard)
        assert b["doc"] == g["doc"] and b["keep"] == g["keep"], shard
        tok_b = json.loads((path / f"results/b/tokens/web/{shard}.json").read_text())["doc_rows"]
        assert tok_b == json.loads((path / f"results/g/tokens/web/{shard}.json").read_text())["doc_rows"]
    report = json.loads((path / "results/b/dedup/report.json").read_text())
    t = report["total"]
    assert t["reference_documents"] >= 3 and t["removed_documents"] - t["reference_documents"] >= 1, t
    assert report["removals"]["against_reference"] == t["reference_documents"]
    assert report["reference"]["indexes"][0]["path"] == str((path / "results/a/dedup/index").resolve())
    b2, b3 = keep_list(path, "b", "shard_00002"), keep_list(path, "b", "shard_00003")
    for shard, table, row, against in (("shard_00002", b2, 0, True),  # an exact copy of a kept A document
                                       ("shard_00003", b3, 1, True),  # a near copy of an A document
                                       ("shard_00002", b2, 9, True),  # a near copy of a document A holds twice
                                       ("shard_00003", b3, 4, False)):  # a copy within B
        d = doc_of(path, "b", shard, row)
        assert not table["keep"][d] and table["reference"][d] == against, (shard, row)
        assert (table["cluster"][d] < 0) == against


def test_a_finished_run_is_stable_and_b_reads_none_of_as_documents(runs):
    assert runs["a_again"] == {} and runs["b_again"] == {}  # the recorded segments are the DAG
    path = runs["path"]
    assert not (path / "data/a").exists() and not (path / "results/a/filtered").exists()
    assert not (path / "results/a/dedup/sig").exists()


def test_adding_a_shard_schedules_its_jobs_and_one_new_segment(runs):
    per_shard = ("download", "filter", "tokenize", "dedup_signatures")
    assert runs["added"] == {**dict.fromkeys(per_shard, 1), "dedup_index": 1, "dedup_candidates": PARTS,
                             "dedup": 1, "dedup_report": 1}, runs["added"]
    jobs = runs["added_jobs"]
    assert {w for r, w in jobs if r in per_shard} == {"source=aux, group=shard_00001"}
    assert sorted(w for r, w in jobs if r.startswith("dedup_candidates")) == [f"seg=1, part={p}" for p in range(PARTS)]
    assert [w for r, w in jobs if r in ("dedup", "dedup_index")] == ["seg=1", "seg=1"]


def test_a_stale_or_edited_reference_is_refused_in_one_line(runs, tmp_path):
    path = runs["path"]
    edited = tmp_path / "a-index"
    shutil.copytree(path / "results/a/dedup/index", edited)
    index = json.loads((edited / "index.json").read_text())
    index["segments"][0]["docs"] += 1
    (edited / "index.json").write_text(json.dumps(index))
    cfg = config("b", {"web": "src/b/web/*.parquet"}, reference=[str(edited)])
    proc = run(path, cfg, "-n", check=False)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("tokenfarm:")]
    assert proc.returncode != 0 and len(lines) == 1 and "was edited" in lines[0], lines
    assert str(edited.resolve()) in lines[0]
    shutil.rmtree(edited)
    shutil.copytree(path / "results/a/dedup/index", edited)
    npy = next(edited.glob("0/docs/web/*.npy"))
    data = bytearray(npy.read_bytes())
    data[-1] ^= 1  # same size, other content: found by the dedup_index job
    npy.write_bytes(bytes(data))
    proc = run(path, cfg, check=False)
    assert proc.returncode != 0 and f"{npy.resolve()} is not the file its index recorded" in proc.stdout + proc.stderr
    write_config(path, config("b", {"web": "src/b/web/*.parquet"}, reference=["results/a"]))
