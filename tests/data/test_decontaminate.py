"""pipeline.data.decontaminate: planted contaminated documents (exact item text, item text inside a
long document, a short item's whole text) are flagged; near misses and clean documents stay; the report
adds up; the vectorised gram hash equals its scalar definition."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import write_text_shard

from pipeline.data import decontaminate as dc
from pipeline.data.eval_data import build_eval_data
from pipeline.data.minhash import doc_word_hashes, normalize_text
from pipeline.data.tasks import load_task

TASKS = ["copa", "boolq", "lambada"]
FILLER = ("river stone lantern quietly orchard seven paper violet engine harbor candle meadow tunnel "
          "glass thunder basket pepper marble fabric silver").split()


def params(enabled=True, ngram=13, min_words=8):
    return {"decontaminate": {"enabled": enabled, "ngram": ngram, "min_words": min_words}, "eval_tasks": TASKS,
            "sources": {"web": {"type": "local", "format": "text", "text_column": "text", "min_chars": 0}}}


def filler(rng, n):
    return " ".join(rng.choice(FILLER) for _ in range(n))


def write_shard(root, shard, docs):
    """Raw shard (an empty row first, as tokenize drops it) + the tokenized-shard index (doc i = docs[i])."""
    raw = write_text_shard(root / "raw" / "web" / f"{shard}.parquet", [""] + docs)
    tok = root / "tokens" / "web" / f"{shard}.json"
    tok.parent.mkdir(parents=True, exist_ok=True)
    tokens = [len(d.split()) + 1 for d in docs]
    np.save(tok.parent / f"{shard}.idx.npy", np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64))
    tok.write_text(json.dumps({"source": "web", "shard": shard, "n_docs": len(docs), "n_tokens": sum(tokens),
                               "doc_rows": list(range(1, len(docs) + 1)), "delimiters_per_doc": 1}))
    return raw, tok


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("decontam")
    build_eval_data({"tasks": TASKS, "pool_size": 10, "seed": 0}, root / "eval_data")
    tasks = {n: load_task(root / "eval_data" / f"{n}.json") for n in TASKS}
    rng = random.Random(0)
    lam = tasks["lambada"]["items"][0]["text"]
    passage = tasks["boolq"]["pool"][0]["text"].split()[:40]  # a few-shot pool item counts too
    near = list(passage[:20])
    near[10] = "zebra"  # every 13-gram of these 20 words contains the edit
    copa = next(it["text"] for it in tasks["copa"]["items"] if 8 <= len(normalize_text(it["text"]).split()) < 13)
    copa_near = normalize_text(copa).split()
    copa_near[3] = "zebra"
    docs = {
        "exact": lam,
        "shouted": lam.upper().replace(" ", "  ,"),  # case and punctuation do not hide it
        "inside": filler(rng, 300) + " " + " ".join(passage[5:25]) + " " + filler(rng, 300),
        "near_miss": filler(rng, 100) + " " + " ".join(near) + " " + filler(rng, 100),
        "short_whole": filler(rng, 50) + ". " + copa + " " + filler(rng, 50),
        "short_near": filler(rng, 50) + ". " + " ".join(copa_near) + " " + filler(rng, 50),
        "clean": filler(rng, 400),
        "empty_words": "!!! ...",
    }
    names = list(docs)
    shard_a = write_shard(root, "a", [docs[n] for n in names[:4]])
    shard_b = write_shard(root, "b", [docs[n] for n in names[4:]])
    report = dc.run_decontaminate(params(), root / "eval_data", [shard_a[0], shard_b[0]], [shard_a[1], shard_b[1]],
                                  root / "decontam", root / "decontam" / "report.json")
    flags = {}
    for shard, part in (("a", names[:4]), ("b", names[4:])):
        t = pq.read_table(root / "decontam" / "web" / f"{shard}.parquet").to_pylist()
        assert [r["doc"] for r in t] == list(range(len(part)))
        flags.update({n: r for n, r in zip(part, t)})
    return root, report, flags, docs


def test_planted_contamination_is_flagged_and_near_misses_stay(planted):
    _, _, flags, _ = planted
    assert flags["exact"]["contaminated"] and flags["exact"]["tasks"] == "lambada"
    assert flags["shouted"]["contaminated"]
    assert flags["inside"]["contaminated"] and flags["inside"]["tasks"] == "boolq"
    assert flags["short_whole"]["contaminated"] and flags["short_whole"]["tasks"] == "copa"
    for name in ("near_miss", "short_near", "clean", "empty_words"):
        assert not flags[name]["contaminated"] and flags[name]["tasks"] == "", name


def test_report_reconciles_with_the_flag_files(planted):
    root, report, flags, docs = planted
    tokens = {n: len(d.split()) + 1 for n, d in docs.items()}
    flagged = [n for n, r in flags.items() if r["contaminated"]]
    web = report["per_source"]["web"]
    assert web["documents"] == len(docs) and web["tokens"] == sum(tokens.values())
    assert web["flagged"] == {"documents": len(flagged), "tokens": sum(tokens[n] for n in flagged)}
    assert report["total"] == web["flagged"]
    assert web["by_task"]["boolq"] == {"documents": 1, "tokens": tokens["inside"]}
    assert web["by_task"]["copa"] == {"documents": 1, "tokens": tokens["short_whole"]}
    assert sum(v["documents"] for v in web["by_task"].values()) == len(flagged)  # no document matched two tasks
    assert len(report["examples"]) == len(flagged)
    inside = next(e for e in report["examples"] if e["task"] == "boolq")
    assert len(inside["words"].split()) == 13 and inside["words"] in normalize_text(docs["inside"])
    assert report["eval"]["copa"]["texts_short"] > 0 and report["docs_per_s"] > 0


def test_the_report_names_the_scored_items_documents_shared_grams_with(planted):
    """The item side: the lambada item copied whole and the short COPA item are seen; the boolq passage
    came from the few-shot pool, which is not scored (its passage's scored questions, if any share it, are)."""
    root, report, _, docs = planted
    tasks = {n: load_task(root / "eval_data" / f"{n}.json") for n in TASKS}
    seen = report["contaminated_items"]
    assert seen["lambada"] == {"items": len(tasks["lambada"]["items"]), "count": 1,
                               "ids": [tasks["lambada"]["items"][0]["id"]]}
    copa = [it["id"] for it in tasks["copa"]["items"] if it["text"] in docs["short_whole"]]
    assert seen["copa"]["ids"] == copa and seen["copa"]["count"] == 1
    passage = " ".join(normalize_text(tasks["boolq"]["pool"][0]["text"]).split()[5:25])
    assert seen["boolq"]["ids"] == [it["id"] for it in tasks["boolq"]["items"]
                                    if passage in " ".join(normalize_text(it["text"]).split())]


def test_the_evaluation_reads_the_seen_items_of_removed_documents(planted, tmp_path):
    """The join: the lambada item whose text a document held is seen by the evaluation although that
    document is flagged, so the split took it out of train and val; a disabled stage checked nothing; a
    report without the item side, or without a configured task, is one error naming the fix."""
    from pipeline.evaluation.evaluate import read_seen

    root, report, flags, _ = planted
    assert flags["exact"]["contaminated"]  # split's `contam`: removed from the run
    lam = load_task(root / "eval_data" / "lambada.json")["items"][0]["id"]
    seen = read_seen(root / "decontam" / "report.json", TASKS)
    assert seen["lambada"] == {lam} and set(seen) == set(TASKS)
    for name, body, match in (("off.json", {**report, "enabled": False}, None),
                              ("old.json", {k: v for k, v in report.items() if k != "contaminated_items"},
                               "old.json: not a decontamination report with contaminated_items.*decontaminate rule"),
                              ("fewer.json", {**report, "contaminated_items": {"copa": report["contaminated_items"]
                                                                                ["copa"]}},
                               "fewer.json: no contaminated_items for boolq, lambada.*rerun the decontaminate rule")):
        (tmp_path / name).write_text(json.dumps(body))
        if match is None:
            assert read_seen(tmp_path / name, TASKS) == {}
        else:
            with pytest.raises(dc.PipelineError, match=match):
                read_seen(tmp_path / name, TASKS)


def test_an_item_is_seen_whichever_task_its_gram_is_flagged_under():
    """Two tasks share a text: a document holding it is flagged under the first task only, but the
    scored items of both are seen; a pool item is never reported, a clean item never seen."""
    words = " ".join(FILLER[:14])
    lm = lambda i, text: {"id": f"x{i}", "text": text}
    tasks = {"first": {"type": "language_modeling", "pool": [lm(9, "zulu " + words)], "items": [lm(0, words)]},
             "second": {"type": "multiple_choice", "pool": [],
                        "items": [{"id": "q0", "text": "an unrelated question", "continuations": [words, " no"]},
                                  {"id": "q1", "text": " ".join(FILLER[5:]), "continuations": [" yes"]}]}}
    grams = dc.eval_grams(tasks, ngram=13, min_words=8)
    flags, which, _, seen = dc.flag_shard(pa.array(["intro " + words + " outro", "clean text"], pa.large_string()),
                                          grams, True)
    assert flags.tolist() == [True, False] and which[0] == {0}
    assert seen == {0: [0], 1: [0]}
    assert dc.flag_shard(pa.array([words], pa.large_string()), grams, False)[3] == {}


def test_disabled_flags_nothing(planted, tmp_path):
    root, *_ = planted
    raws = sorted((root / "raw" / "web").glob("*.parquet"))
    toks = sorted((root / "tokens" / "web").glob("*.json"))
    report = dc.run_decontaminate(params(enabled=False), root / "eval_data", raws, toks, tmp_path, tmp_path / "r.json")
    assert report["total"] == {"documents": 0, "tokens": 0}


def test_vectorised_gram_hash_equals_the_scalar_definition():
    texts = ["The cat sat on the mat, and then — naïvely — the DOG sat too.", "", "one two three",
             "Ünïcode ﬁne words"]
    wh, off = doc_word_hashes(pa.array(texts, pa.large_string()))
    for n in (1, 3, 5):
        h, pos = dc.window_hashes(wh, off, n)
        expect = []
        for text in texts:
            words = normalize_text(text).split()
            expect += [dc.gram_hash(words[i:i + n]) for i in range(len(words) - n + 1)]
        assert h.tolist() == expect
        doc_of = np.searchsorted(off, pos, side="right") - 1
        assert all(pos[i] + n <= off[doc_of[i] + 1] for i in range(len(pos)))  # no window crosses a document


def cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.data.decontaminate", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def per_group_run(root, out, p, groups):
    """The stage as the workflow runs it, through the CLIs: the eval table once, one flags job per group of
    shards (each a list of shard names of source web), the report from every shard's part."""
    assert cli("grams", "--params", json.dumps(p), "--eval-data", root / "eval_data", "--out",
               out / "grams.parquet").returncode == 0
    for g, shards in enumerate(groups):
        r = cli("flags", "--params", json.dumps(p), "--grams", out / "grams.parquet", "--source", "web",
                "--inputs", *[root / f"raw/web/{s}.parquet" for s in shards],
                "--tokens", *[root / f"tokens/web/{s}.json" for s in shards],
                "--outputs", *[out / f"web/{s}.parquet" for s in shards], "--manifest", out / f"web/_manifest/{g}.json")
        assert r.returncode == 0, r.stderr
    parts = [out / f"web/{s}.json" for shards in groups for s in shards]
    r = cli("report", "--params", json.dumps(p), "--grams", out / "grams.parquet", "--parts", *reversed(parts),
            "--report", out / "report.json")
    assert r.returncode == 0, r.stderr
    return json.loads((out / "report.json").read_text())


SAME = lambda report: {k: v for k, v in report.items() if k not in ("meta", "seconds", "docs_per_s")}


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False])
def test_per_group_jobs_equal_the_one_process_stage(planted, tmp_path, enabled):
    """One flags job per shard group (the eval table read back from its file) writes the flag files the
    one-process reference writes, and the report joined from the shards' parts is the reference's."""
    root, report, *_ = planted
    ref = tmp_path / "ref"
    raws, toks = [root / "raw/web/a.parquet", root / "raw/web/b.parquet"], [root / "tokens/web/a.json",
                                                                           root / "tokens/web/b.json"]
    report = dc.run_decontaminate(params(enabled=enabled), root / "eval_data", raws, toks, ref, ref / "report.json")
    for groups in ([["a"], ["b"]], [["a", "b"]]):
        out = tmp_path / f"groups{len(groups)}"
        joined = per_group_run(root, out, params(enabled=enabled), groups)
        assert SAME(joined) == SAME(report)
        for shard in ("a", "b"):
            assert (pq.read_table(out / f"web/{shard}.parquet").to_pylist()
                    == pq.read_table(ref / f"web/{shard}.parquet").to_pylist())
        manifest = json.loads((out / "web/_manifest/0.json").read_text())
        assert {Path(f["path"]).name for f in manifest["files"]} >= {"a.parquet", "a.json"}
    assert (report["total"]["documents"] > 0) == enabled


def test_the_eval_table_reads_back_as_built(planted, tmp_path):
    root, *_ = planted
    grams = dc.build_grams(params(), root / "eval_data")
    dc.write_grams(grams, tmp_path / "grams.parquet", {"stage": "decontaminate"})
    back = dc.read_grams(tmp_path / "grams.parquet")
    assert back.tasks == grams.tasks and back.counts == grams.counts and set(back.hashes) == set(grams.hashes)
    for L in grams.hashes:
        assert back.hashes[L].tolist() == grams.hashes[L].tolist()
        assert back.task_of[L].tolist() == grams.task_of[L].tolist()
        assert [x.tolist() for x in back.rows[L]] == [x.tolist() for x in grams.rows[L]]
    assert back.item_ids == grams.item_ids
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(dc.PipelineError, match="bad.parquet.*decontaminate_grams"):
        dc.read_grams(tmp_path / "bad.parquet")


def test_mismatched_inputs_are_one_error(planted, tmp_path):
    root, *_ = planted
    per_group_run(root, tmp_path, params(), [["a"]])
    r = cli("flags", "--params", json.dumps(params()), "--grams", tmp_path / "grams.parquet", "--source", "web",
            "--inputs", root / "raw/web/a.parquet", "--tokens", root / "tokens/web/b.json",
            "--outputs", tmp_path / "x/web/a.parquet")
    assert r.returncode == 1 and "must name the same shards" in r.stderr and "web/a" in r.stderr
    with pytest.raises(dc.PipelineError, match="must name the same shards.*web/a"):
        dc.run_decontaminate(params(), root / "eval_data", [root / "raw/web/a.parquet"], [root / "tokens/web/b.json"],
                             tmp_path / "y", tmp_path / "y/r.json")


def test_an_ngram_longer_than_every_benchmark_text_works(planted):
    """ngram 40 over COPA (every item shorter): no long grams, the short items match whole, no IndexError."""
    root = planted[0]
    tasks = {"copa": load_task(root / "eval_data" / "copa.json")}
    grams = dc.eval_grams(tasks, ngram=40, min_words=8)
    assert grams.counts["copa"]["texts_long"] == 0 and len(grams.hashes[40]) == 0
    assert grams.counts["copa"]["texts_short"] > 0
