"""Accounting: a whole synthetic run balances exactly; any lost or invented token fails the stage."""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import CHATS, corpus, make_tokenizer, write_chat_shard

from pipeline.config import params_json, resolve_config
from pipeline.data.accounting import main, reconcile
from pipeline.data.count import write_aggregate
from pipeline.data.filter import filter_shard
from pipeline.data.pack import pack
from pipeline.data.text_filters import build_chain
from pipeline.data.tokenize import tokenize_shard
from pipeline.errors import PipelineError
from pipeline.io import read_json, write_json
from pipeline.rules import rule_params

SHARDS = [("web", "a"), ("web", "b"), ("chat", "c")]
SPAM = "\n".join(["buy cheap watches now"] * 20)  # a page the filter stage removes
# SFT rows that are dropped and counted (null content, no assistant turn, over max_conversation_tokens),
# and one with a system turn, which is kept
BAD_CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
    [{"role": "user", "content": "anyone?"}],
    [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "stone river " * 400}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}],
]


def config(tmp, dedup=True):
    return resolve_config({
        "data_dir": f"{tmp}/raw",
        # duplicated lines only: removes the planted SPAM page and nothing the checks below count
        "filter": [{"name": "gopher_repetition", "settings": {
            "dup_para_frac": None, "dup_line_char_frac": None, "dup_para_char_frac": None, "top_n_grams": {},
            "dup_n_grams": {}}}, {"name": "pii"}],
        "sources": {"web": {"type": "local", "glob": f"{tmp}/raw/web/*.parquet", "min_chars": 12},
                    "chat": {"type": "local", "glob": f"{tmp}/raw/chat/*.parquet", "format": "chat",
                             "max_conversation_tokens": 400}},
        "dedup": {"enabled": dedup},
        "mixes": {"pre": {"weights": {"web": 1.0}},
                  "mid": {"weights": {"web": 0.3, "chat": 0.7}, "packing": "bestfit", "max_epochs": 2}},
        "train": {"mix": "pre", "seq_len": 16, "micro_batch": 4, "global_batch_tokens": 640},
    })


def write_web_shard(path, texts):
    """Text shard with an empty, a null, an invalid-UTF-8 and a short row among the documents."""
    raw = [t.encode() for t in texts] + [b"", None, b"\xff\xfe bad", b"tiny"]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary())}), path)


def dedup_and_split(run, source, shard, dedup: bool):
    """Keep file (every 5th document duplicates its predecessor), decontamination flags (every 7th
    document from the 4th) and split file (flagged keepers → contam, cluster % 4 == 0 → val).
    Returns the flagged tokens."""
    n = read_json(run / f"tokens/{source}/{shard}.json")["n_docs"]
    spans = np.diff(np.load(run / f"tokens/{source}/{shard}.idx.npy"))
    doc = np.arange(n)
    dup = (doc % 5 == 4) if dedup else np.zeros(n, bool)
    cluster = np.where(dup, doc - 1, doc) + 1000 * len(source + shard)
    if dedup:
        pq.write_table(pa.table({"doc": doc, "cluster": cluster, "keep": ~dup,
                                 "reason": np.where(dup, "exact", "keep")}),
                       _mk(run / f"dedup/keep/{source}/{shard}.parquet"))
    flagged = doc % 7 == 3
    pq.write_table(pa.table({"doc": doc, "contaminated": flagged, "tasks": np.where(flagged, "copa", "")}),
                   _mk(run / f"decontam/{source}/{shard}.parquet"))
    split = np.where(dup, "dup", np.where(flagged, "contam", np.where(cluster % 4 == 0, "val", "train")))
    pq.write_table(pa.table({"doc": doc, "cluster": cluster, "tokens": spans, "split": split}),
                   _mk(run / f"split/{source}/{shard}.parquet"))
    return int(spans[flagged].sum())


def _mk(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_mix(run, mix, sources, epochs, seed=0):
    """Schedules: train = the sources' train docs, shuffled, for `epochs` epochs (the last one half);
    val = all their val docs."""
    rng = random.Random(seed)
    for split, n_epochs in (("train", epochs), ("val", 1)):
        rows = []
        for e in range(n_epochs):
            part = []
            for source, shard in SHARDS:
                if source in sources:
                    t = pq.read_table(run / f"split/{source}/{shard}.parquet").to_pylist()
                    part += [(source, shard, r["doc"], r["tokens"], e) for r in t if r["split"] == split]
            rng.shuffle(part)
            rows += part[: len(part) // 2] if e and e == n_epochs - 1 else part
        cols = dict(zip(("source", "shard", "doc", "tokens", "epoch"), map(list, zip(*rows))))
        pq.write_table(pa.table(cols), _mk(run / f"mix/{mix}/{split}.parquet"))


def build_run(tmp, dedup=True):
    """A complete run directory made by the real tokenizer, tokenize, count (table) and pack stages
    (dedup / split / mix files written here by their contract)."""
    cfg = config(tmp, dedup)
    run = tmp / "run"
    tok = make_tokenizer(tmp, "bos")
    write_web_shard(tmp / "raw/web/a.parquet", corpus(40, seed=20) + [SPAM])
    write_web_shard(tmp / "raw/web/b.parquet", corpus(25, seed=21))
    write_chat_shard(tmp / "raw/chat/c.parquet", CHATS + BAD_CHATS)
    flagged = {}
    chain = build_chain(cfg["filter"])
    for source, shard in SHARDS:
        raw = tmp / f"raw/{source}/{shard}.parquet"
        write_json(f"{raw}.json", {"rows": pq.read_metadata(raw).num_rows})  # the download sidecar's row count
        filtered = run / f"filtered/{source}/{shard}.parquet"
        filter_shard(chain, raw, filtered, source, rule_params(cfg, "filter"))
        tokenize_shard(tok, filtered, run / f"tokens/{source}/{shard}.json", source, shard,
                       rule_params(cfg, "tokenize"))
        flagged[source] = flagged.get(source, 0) + dedup_and_split(run, source, shard, dedup)
    write_json(run / "decontam/report.json",
               {"per_source": {s: {"flagged": {"tokens": t}} for s, t in flagged.items()}})
    # the count table: joined from the tokenize jobs' metadata, as the count rule does
    write_aggregate([str(run / f"tokens/{s}/{sh}.json") for s, sh in SHARDS], run / "counts/counts.parquet",
                    run / "counts/summary.json")
    write_mix(run, "pre", {"web"}, epochs=2)
    write_mix(run, "mid", {"web", "chat"}, epochs=2, seed=1)
    for mix in cfg["mixes"]:
        for split in ("train", "val"):
            pack(rule_params(cfg, "pack"), mix, split, run / f"mix/{mix}/{split}.parquet", run / "tokens",
                 run / f"pack/{mix}/{split}.json")
    return cfg, run


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_run(tmp_path_factory.mktemp("acct"))


def test_balanced_run(built, tmp_path):
    cfg, run = built
    out, md = tmp_path / "accounting.json", tmp_path / "accounting.md"
    main(["--params", params_json(rule_params(cfg, "accounting")), "--run-dir", str(run), "--out", str(out),
          "--out-md", str(md)])
    rep = read_json(out)
    t = rep["total"]
    assert rep["ok"] and all(ln["lhs"] == ln["rhs"] for ln in rep["lines"])
    assert t["downloaded_rows"] == t["decision_rows"] > t["filter_kept_rows"] == t["counted_rows"]  # some removed
    assert {"download → filter", "filter → tokenize", "count → tokenize", "tokenize → dedup",
            "tokenize → decontaminate", "dedup → split", "decontaminate → split", "split → mix", "mix → pack",
            "pack"} <= {ln["arrow"] for ln in rep["lines"]}
    web = rep["sources"]["web"]
    short = sum(len(t) < 12 for t in corpus(40, seed=20) + corpus(25, seed=21)) + 2  # + one "tiny" per shard
    assert (web["dropped_empty"], web["dropped_invalid_utf8"], web["dropped_short"]) == (4, 2, short)
    assert web["dropped_short_tokens"] > 0
    chat = rep["sources"]["chat"]
    assert (chat["dropped_null_content"], chat["dropped_no_assistant"], chat["dropped_long"]) == (1, 1, 1)
    assert chat["counted_long"] == 1 and chat["dropped_long_tokens"] > 400
    assert t["dup_tokens"] > 0 and t["contam_tokens"] > 0
    assert t["train_tokens"] + t["val_tokens"] + t["dup_tokens"] + t["contam_tokens"] == t["tokenized_tokens"]
    assert t["counted_tokens"] == read_json(run / "counts/summary.json")["total"]["tokens"]
    mid = rep["mixes"]["mid"]["train"]
    assert mid["sources"]["chat"]["epochs"] == 2 and mid["sources"]["chat"]["unused"] > 0
    assert mid["pack"]["pad_tokens"] > 0 and rep["mixes"]["pre"]["train"]["pack"]["dropped_tail_tokens"] >= 0
    text = md.read_text()
    assert "| web |" in text and "| mid/train | bestfit |" in text and "✗" not in text
    assert f"| 1 / 1 / 1 ({chat['dropped_long_tokens']:,} tok) |" in text


def test_dedup_disabled_without_keep_files(tmp_path):
    cfg, run = build_run(tmp_path, dedup=False)
    assert not (run / "dedup").exists()
    rep = reconcile(rule_params(cfg, "accounting"), run)
    assert rep["total"]["removed_tokens"] == rep["total"]["dup_tokens"] == 0


def _drop_split_row(run):
    t = pq.read_table(run / "split/web/a.parquet")
    pq.write_table(t.slice(1), run / "split/web/a.parquet")


def _count_plus_one(run):
    t = pq.read_table(run / "counts/counts.parquet").to_pylist()
    t[0]["tokens"] += 1
    pq.write_table(pa.Table.from_pylist(t), run / "counts/counts.parquet")


def _pack_loses_a_token(run):
    p = read_json(run / "pack/pre/train.json")
    p["tokens_packed"] -= 1
    write_json(run / "pack/pre/train.json", p)


def _schedule_a_dup(run):
    split = pq.read_table(run / "split/web/b.parquet").to_pylist()
    dup = next(r for r in split if r["split"] == "dup")
    t = pq.read_table(run / "mix/pre/train.parquet").to_pylist()
    t[0].update(shard="b", doc=dup["doc"], tokens=dup["tokens"])
    pq.write_table(pa.Table.from_pylist(t), run / "mix/pre/train.parquet")


def _flag_a_train_document(run):
    t = pq.read_table(run / "decontam/web/a.parquet").to_pylist()
    split = pq.read_table(run / "split/web/a.parquet").column("split").to_pylist()
    t[split.index("train")]["contaminated"] = True
    pq.write_table(pa.Table.from_pylist(t), run / "decontam/web/a.parquet")


def _report_misses_a_token(run):
    r = read_json(run / "decontam/report.json")
    r["per_source"]["chat"]["flagged"]["tokens"] -= 1
    write_json(run / "decontam/report.json", r)


def _split_disagrees_with_dedup(run):
    t = pq.read_table(run / "split/web/b.parquet").to_pylist()
    r = next(r for r in t if r["split"] == "train")
    r["split"] = "dup"
    pq.write_table(pa.Table.from_pylist(t), run / "split/web/b.parquet")


def _filter_keeps_a_char_more(run):
    path = run / "filtered/web/a.decisions.parquet"
    d = pq.read_table(path).to_pydict()
    d["chars_out"][0] += 1
    pq.write_table(pa.table(d, schema=pq.read_schema(path)), path)


@pytest.mark.parametrize("tamper, line", [
    (_filter_keeps_a_char_more, r"web/a: characters: filter_chars_out = \d+ but counted_chars = \d+ \(off by -1\)"),
    (_drop_split_row, r"web/a: split-file rows: tokenized_docs = \d+ but split_rows = \d+"),
    (_count_plus_one, r"chat/c: document tokens: counted_tokens = \d+ but .*\(off by -1\)"),
    (_pack_loses_a_token, r"pre/train: tokens in: tokens_in = (\d+) but packed \+ dropped tail \+ truncated = \d+ "
                          r"\(off by -1\)"),
    (_schedule_a_dup, r"pre/train: scheduled documents not in the split: 0 = 0 but count = 1"),
    (_split_disagrees_with_dedup, r"web/b: documents whose split disagrees with dedup"),
    (_flag_a_train_document, r"web/a: flagged kept tokens: flagged_kept_tokens = \d+ but contam_tokens"),
    (_report_misses_a_token, r"chat: flagged tokens: flag files = \d+ but decontaminate report = \d+ \(off by -1\)"),
])
def test_unbalanced_run_fails(built, tmp_path, tamper, line):
    cfg, run = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    tamper(copy)
    out = tmp_path / "accounting.json"
    with pytest.raises(PipelineError, match=line):
        main(["--params", json.dumps(rule_params(cfg, "accounting")), "--run-dir", str(copy), "--out", str(out),
              "--out-md", str(tmp_path / "accounting.md")])
    assert not out.exists() and not (tmp_path / "accounting.md").exists()


def _unknown_split_value(run):
    t = pq.read_table(run / "split/chat/c.parquet").to_pylist()
    t[3]["split"] = "test"
    pq.write_table(pa.Table.from_pylist(t), run / "split/chat/c.parquet")


@pytest.mark.parametrize("tamper, match", [
    (lambda run: (run / "pack/mid/val.json").unlink(), "mid/val.json: not found; run the pack stage"),
    (lambda run: (run / "dedup/keep/web/b.parquet").unlink(), "b.parquet: not found; run the dedup stage"),
    (_unknown_split_value, r"unknown split value\(s\) \['test'\]"),
])
def test_bad_stage_output_names_it(built, tmp_path, tamper, match):
    cfg, run = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    tamper(copy)
    with pytest.raises(PipelineError, match=match):
        reconcile(rule_params(cfg, "accounting"), copy)
