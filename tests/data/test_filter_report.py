"""The filter funnel report (pipeline/data/filter_report.py) over decisions the filter library really made.

Two small raw shards are run through `pipeline.data.text_filters.run_chain` (the default chain) and written as the
filter stage's decisions files (docs/filters.md's contract); the report's numbers are checked against the
chain's own result, document by document.
"""
from __future__ import annotations

import json
import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from filter_corpora import PROSE as CORPUS_PROSE

from pipeline.data import text_filters as F
from pipeline.data.filter_report import filter_report, main
from pipeline.errors import PipelineError

PROSE = CORPUS_PROSE[:8]
FRENCH = ("Le chat est assis sur le tapis et regarde la pluie par la fenêtre pendant que la famille prépare le "
          "dîner dans la cuisine de la vieille maison.")


def _docs(seed: int) -> list[str]:
    """Pages that each default filter removes (or edits), and clean ones, shuffled by `seed`."""
    rng = random.Random(seed)
    prose = lambda: "\n".join(rng.sample(PROSE, 7))
    docs = [prose() for _ in range(4)]
    docs += [FRENCH] * 2  # language
    docs += ["\n".join([PROSE[0]] * 6 + PROSE[1:5])]  # gopher_repetition: dup_line_frac
    docs += ["\n".join(PROSE[:2])]  # gopher_quality: n_words (34 < 50)
    docs += ["\n".join(PROSE[:7] + [PROSE[0]])]  # fineweb_quality: char_dup_ratio (one line repeated once)
    docs += [prose() + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."]  # c4: lorem_ipsum
    docs += [prose() + "\nHome | About | Contact"]  # c4 removes the menu line, keeps the page
    docs += [prose() + f"\nWrite to jane.doe{seed}@mail-host.com or ping 8.8.8.{seed}."]  # pii
    rng.shuffle(docs)
    return docs


def _write_run(tmp_path, seeds=(0, 1)):
    """Raw shards under tmp/raw/web/ and their decisions under tmp/filtered/web/, as the filter rule writes them."""
    raws, decisions, results = [], [], []
    chain = F.build_chain()
    for i, seed in enumerate(seeds):
        texts = _docs(seed)
        raw = tmp_path / "raw" / "web" / f"shard_{i:05d}.parquet"
        raw.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts}), raw, row_group_size=5)  # examples are read by row group
        res = F.run_chain(texts, chain)
        dec = tmp_path / "filtered" / "web" / f"shard_{i:05d}.decisions.parquet"
        dec.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(F.decisions_table(texts, res), dec)
        raws.append(str(raw))
        decisions.append(str(dec))
        results.append((texts, res))
    return raws, decisions, results


PARAMS = {"filter": None, "sources": {"web": {"format": "text"}}, "seed": 7}


def _run(tmp_path, raws, decisions, **kw):
    out = tmp_path / "report"
    return filter_report(PARAMS, raws, decisions, out / "r.json", out / "r.md", out / "funnel.png", **kw)


def test_funnel_accounts_for_every_document(tmp_path):
    raws, decisions, results = _write_run(tmp_path)
    rep = _run(tmp_path, raws, decisions)
    (src,) = rep["sources"]
    texts = [t for ts, _ in results for t in ts]
    kept = [k for _, r in results for k in r.kept]
    by_filter = Counter(f for _, r in results for f, k in zip(r.filter, r.kept) if not k)
    assert rep["filters"] == [e["name"] for e in F.DEFAULT_CHAIN]
    assert [s["filter"] for s in src["funnel"]] == rep["filters"]
    assert src["documents_in"] == len(texts) == 24
    assert src["documents_kept"] == sum(kept)
    assert src["documents_in"] == src["documents_kept"] + sum(s["documents_removed"] for s in src["funnel"])
    assert {s["filter"]: s["documents_removed"] for s in src["funnel"]} == {
        f: by_filter.get(f, 0) for f in rep["filters"]}
    # every filter of the default chain has something to show on these pages (pii: spans, not documents)
    assert all(s["documents_removed"] > 0 for s in src["funnel"] if s["filter"] != "pii")
    assert src["funnel"][-1]["documents_left"] == src["documents_kept"]
    # characters: in = removed + edited away + out
    removed_chars = sum(len(t) for t, k in zip(texts, kept) if not k)
    assert sum(s["chars_removed"] for s in src["funnel"]) == removed_chars
    out_chars = sum(len(t) for _, r in results for t, k in zip(r.text, r.kept) if k)
    assert src["chars_out"] == out_chars
    assert src["chars_in"] == removed_chars + src["chars_edited"] + out_chars
    c4 = next(s for s in src["funnel"] if s["filter"] == "c4")
    pii = next(s for s in src["funnel"] if s["filter"] == "pii")
    assert c4["lines_removed"] == src["lines_removed"] == sum(int(r.lines_removed[r.kept].sum()) for _, r in results)
    assert c4["rules"] == {"lorem_ipsum": 2}
    assert pii["spans_replaced"] == src["spans_replaced"] == 4  # one e-mail and one IP per shard
    assert src["languages"] == dict(Counter(lang for _, r in results for lang in r.language).most_common())


def test_examples_are_seeded_and_read_from_the_raw_rows(tmp_path):
    raws, decisions, results = _write_run(tmp_path)
    a = _run(tmp_path, raws, decisions, examples=2)
    b = _run(tmp_path, raws, decisions, examples=2)
    assert [s["examples"] for s in a["sources"][0]["funnel"]] == [s["examples"] for s in b["sources"][0]["funnel"]]
    seen = 0
    for step in a["sources"][0]["funnel"]:
        assert len(step["examples"]) == min(2, step["documents_removed"])
        for e in step["examples"]:
            texts, res = results[int(e["shard"][6:11])]
            assert not res.kept[e["row"]] and res.filter[e["row"]] == step["filter"]
            assert (e["rule"], e["value"]) == (res.rule[e["row"]], pytest.approx(res.value[e["row"]]))
            assert texts[e["row"]].startswith(e["excerpt"].removesuffix("…"))
            seen += 1
    assert seen >= 6
    # another seed samples from the same removed documents, not necessarily the same ones
    other = filter_report({**PARAMS, "seed": 8}, raws, decisions, tmp_path / "o.json", tmp_path / "o.md",
                          tmp_path / "o.png", examples=1)
    lang = next(s for s in other["sources"][0]["funnel"] if s["filter"] == "language")
    assert lang["examples"][0]["rule"] == "language_fr"


def test_markdown_png_and_cli(tmp_path):
    raws, decisions, _ = _write_run(tmp_path)
    out = tmp_path / "cli"
    main(["--params", json.dumps(PARAMS), "--raw", *raws, "--decisions", *decisions, "--out-json",
          str(out / "r.json"), "--out-md", str(out / "r.md"), "--out-png", str(out / "funnel.png")])
    md = (out / "r.md").read_text()
    assert "![documents left after each filter](funnel.png)" in md
    assert "| language | 4 |" in md and "### web: removed by gopher_quality" in md
    assert (out / "funnel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "r.json").read_text())["meta"]["stage"] == "filter_report"


def test_tokens_after_tokenize_reconcile(tmp_path):
    raws, decisions, results = _write_run(tmp_path)
    metas = []
    for i, (_, res) in enumerate(results):
        m = tmp_path / "tokens" / "web" / f"shard_{i:05d}.json"
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps({"source": "web", "shard": f"shard_{i:05d}",
                                 "counts": {"documents": int(res.kept.sum()), "tokens": 100 + i}}))
        metas.append(str(m))
    assert _run(tmp_path, raws, decisions, tokens=metas)["sources"][0]["tokens_kept"] == 201
    m = json.loads(open(metas[1]).read())
    m["counts"]["documents"] += 1
    open(metas[1], "w").write(json.dumps(m))
    with pytest.raises(PipelineError, match=r"shard_00001\.json: tokenize read \d+ rows of web/shard_00001 but the "
                                            r"filter kept \d+; .*rerun tokenize"):
        _run(tmp_path, raws, decisions, tokens=metas)


def test_bad_decisions_are_one_clear_error(tmp_path):
    raws, decisions, _ = _write_run(tmp_path)
    with pytest.raises(PipelineError,
                       match=r"shard_00001\.decisions\.parquet: not the decisions of .*shard_00000\.parquet"):
        _run(tmp_path, raws, decisions[::-1])
    with pytest.raises(PipelineError, match="2 raw shards but 1 decisions files"):
        _run(tmp_path, raws, decisions[:1])
    missing = tmp_path / "filtered" / "web" / "shard_00001.decisions.parquet"
    missing.unlink()
    with pytest.raises(PipelineError, match=r"shard_00001\.decisions\.parquet: decisions file not found; run the "
                                            r"filter rule"):
        _run(tmp_path, raws, decisions)
    pq.write_table(pq.read_table(decisions[0]).slice(1), missing)  # one row short of its raw shard
    with pytest.raises(PipelineError, match=r"11 decisions for the 12 rows of .*shard_00001\.parquet; .*rerun the "
                                            "filter rule"):
        _run(tmp_path, raws, decisions)
    pq.write_table(pq.read_table(decisions[0]).drop(["rule"]), missing)
    with pytest.raises(PipelineError, match=r"no column\(s\) rule; .*rerun the filter rule"):
        _run(tmp_path, raws, decisions)
    with pytest.raises(PipelineError, match=r"decisions name filter\(s\) c4, fineweb_quality, gopher_repetition, "
                                            r"language that the filter list \(gopher_quality\) does not enable"):
        filter_report({**PARAMS, "filter": [{"name": "gopher_quality"}]}, raws[:1], decisions[:1], tmp_path / "x.json",
                      tmp_path / "x.md", tmp_path / "x.png")


def test_filter_funnel_script_writes_the_same_decisions_and_report(tmp_path):
    """scripts/filter_funnel.py (the chain and the report outside a run) agrees with the report over the
    decisions written here, examples included."""
    import importlib.util

    from filter_corpora import ROOT

    raws, decisions, _ = _write_run(tmp_path)
    spec = importlib.util.spec_from_file_location("filter_funnel", ROOT / "scripts" / "filter_funnel.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path / "script"), "--seed", str(PARAMS["seed"]), *raws])
    for d in decisions:
        written = pq.read_table(tmp_path / "script" / "web" / d.rsplit("/", 1)[1])
        assert written.schema == pq.read_table(d).schema
        assert written.to_pandas().equals(pq.read_table(d).to_pandas())  # NaN values (kept rows) compare equal
    ours = _run(tmp_path, raws, decisions)
    theirs = json.loads((tmp_path / "script" / "report.json").read_text())
    assert theirs["sources"] == json.loads(json.dumps(ours["sources"]))
    assert (tmp_path / "script" / "report.md").read_text() == (tmp_path / "report" / "r.md").read_text()


def test_chat_source_beside_a_text_source(tmp_path):
    """Each source has its own funnel; a chat source's examples are its conversations' contents."""
    raws, decisions, _ = _write_run(tmp_path, seeds=(0,))
    convs = [[{"role": "user", "content": "Hello there, how are you?"}, {"role": "assistant", "content": "Fine."}]]
    convs += [[{"role": "user", "content": PROSE[i]}, {"role": "assistant", "content": " ".join(PROSE[i + 1:i + 6])}]
              for i in range(3)]
    raw = tmp_path / "raw" / "chat" / "shard_00000.parquet"
    raw.parent.mkdir(parents=True)
    pq.write_table(pa.table({"messages": convs}), raw)
    texts = ["\n".join(m["content"] for m in c) for c in convs]
    res = F.run_chain(texts, F.build_chain(), chat=True)
    dec = tmp_path / "filtered" / "chat" / "shard_00000.decisions.parquet"
    dec.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(F.decisions_table(texts, res), dec)
    params = {**PARAMS, "sources": {"web": {"format": "text"}, "chat": {"format": "chat"}}}
    rep = filter_report(params, [*raws, str(raw)], [*decisions, str(dec)], tmp_path / "r.json", tmp_path / "r.md",
                        tmp_path / "r.png")
    web, chat = rep["sources"]
    assert (web["source"], web["documents_in"], chat["source"], chat["documents_in"]) == ("web", 12, "chat", len(convs))
    assert chat["documents_kept"] == int(res.kept.sum()) < len(convs)
    examples = [e for st in chat["funnel"] for e in st["examples"]]
    assert examples and all(texts[e["row"]].startswith(e["excerpt"].removesuffix("…")) for e in examples)


def test_the_filtered_shard_holds_the_kept_documents(tmp_path):
    raws, decisions, results = _write_run(tmp_path)
    for d, (_, res) in zip(decisions, results):
        kept = [t for t, k in zip(res.text, res.kept) if k]
        pq.write_table(pa.table({"text": kept}), d.replace(".decisions.parquet", ".parquet"))
    assert _run(tmp_path, raws, decisions)["sources"][0]["documents_kept"] == sum(int(r.kept.sum()) for _, r in results)
    pq.write_table(pa.table({"text": kept[:-1]}), decisions[1].replace(".decisions.parquet", ".parquet"))
    with pytest.raises(PipelineError, match=rf"shard_00001\.parquet: {len(kept) - 1} documents but its decisions keep "
                                            rf"{len(kept)}; .*rerun the filter rule"):
        _run(tmp_path, raws, decisions)
