"""Exact per-shard counts, tallied by the tokenize job from its one pass (its metadata's `counts`, checked
against an independent computation), chat counts, bad-input errors that leave nothing behind, and
pipeline.data.count: the table and summary joined from tokenized shards' metadata."""
from __future__ import annotations

import json
import logging
import pydoc_data.topics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import tiktoken.load
from builders import write_chat_shard, write_text_shard

from pipeline.data import tokenize
from pipeline.data.contract import COUNT_FIELDS
from pipeline.data.count import main
from pipeline.data.encoding import load_tokenizer
from pipeline.data.train_tokenizer import build_tokenizer
from pipeline.errors import PipelineError
from pipeline.io import read_parquet_meta

CORPUS = [p for text in pydoc_data.topics.topics.values() for p in text.split("\n\n") if p.strip()]
TEXT = {"type": "local", "format": "text", "text_column": "text", "min_chars": 0}
CHAT = {"type": "local", "format": "chat", "messages_column": "messages", "min_chars": 0}
RAW_DOCS = [  # the rows of the test shard, as bytes
    b"A plain English sentence.",
    b"",
    None,
    b" \n\t ",
    b"bad \xff\xfe bytes",
    "Unicode: 日本語, émoji 😀👍🏽, and a literal <|bos|>.".encode(),
    b"\xc3",  # a truncated 2-byte sequence
    CORPUS[10].encode(),
    b"x",
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    shard = write_text_shard(d / "web" / "shard_00000.parquet", CORPUS)
    params = {"tokenizer": {"kind": "bpe", "vocab_size": 400, "train_chars": 50_000, "max_doc_chars": 2000,
                            "delimiter": "both"}, "sources": {"web": TEXT}, "seed": 3}
    build_tokenizer(params, [str(shard)], d / "encoding.json")
    return str(d / "encoding.json")


@pytest.fixture(scope="module")
def reference_encoding(tok_path):
    """The tokenizer rebuilt straight from its files with tiktoken (no pipeline code)."""
    spec = json.loads(open(tok_path).read())
    ranks = tiktoken.load.load_tiktoken_bpe(tok_path.replace("encoding.json", spec["ranks_file"]))
    return tiktoken.Encoding("ref", pat_str=spec["pattern"], mergeable_ranks=ranks, special_tokens={})


def write_raw_shard(path, raw_docs, column_type):
    """A shard whose text column holds the given bytes, typed binary or string (string columns can
    hold invalid UTF-8 bytes when an upstream writer did not validate them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = pa.array(raw_docs, type=pa.binary())
    if column_type == "string":
        arr = arr.view(pa.string())
    pq.write_table(pa.table({"id": list(range(len(raw_docs))), "text": arr}), path)
    return path


def expected_counts(raw_docs, enc, n_delimiters, min_chars=0):
    """Independent computation of the count fields (plain Python + tiktoken)."""
    c = dict.fromkeys(COUNT_FIELDS, 0)
    for raw in raw_docs:
        c["documents"] += 1
        try:
            text = (raw or b"").decode("utf-8")
        except UnicodeDecodeError:
            c["invalid_utf8_documents"] += 1
            continue
        if text.strip() == "":
            c["empty_documents"] += 1
            continue
        n = len(enc.encode_ordinary(text))
        c["tokens"] += n
        c["delimiter_tokens"] += n_delimiters
        c["bytes"] += len(raw)
        c["chars"] += len(text)
        if len(text) < min_chars:
            c["short_documents"] += 1
            c["short_tokens"] += n
    return c


def shard_args(params, tok_path, shard, out, source="web"):
    """The tokenize CLI for one shard: it writes the shard's counts in its metadata."""
    return ["--params", json.dumps(params), "--tokenizer", tok_path, "--source", source,
            "--inputs", str(shard), "--outputs", str(out)]


def count_shard(path, tok, source: dict, batch_size: int, num_threads: int = 1) -> dict:
    """The counts the tokenize job tallies for one shard (its metadata's `counts`)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        meta = tokenize.tokenize_shard(tok, path, f"{d}/s/x.json", "s", "x",
                                       {"sources": {"s": source}, "count": {"batch_size": batch_size}}, num_threads)
    return meta["counts"]


def count_params(batch_size=2, min_chars=0):
    return {"sources": {"web": {**TEXT, "min_chars": min_chars}, "chat": CHAT}, "count": {"batch_size": batch_size}}


@pytest.mark.parametrize("column_type", ["binary", "string"])
def test_shard_counts_match_independent_computation(tmp_path, tok_path, reference_encoding, column_type):
    shard = write_raw_shard(tmp_path / "web" / "shard_00000.parquet", RAW_DOCS, column_type)
    out = tmp_path / "tokens" / "web" / "shard_00000.json"
    tokenize.main(shard_args(count_params(batch_size=2, min_chars=30), tok_path, shard, out))
    meta = json.loads(out.read_text())
    rec = meta["counts"]
    assert {k: rec[k] for k in COUNT_FIELDS} == expected_counts(RAW_DOCS, reference_encoding, 2, min_chars=30)
    assert rec["documents"] == 9 and rec["empty_documents"] == 3 and rec["invalid_utf8_documents"] == 2
    assert rec["short_documents"] == 2  # "A plain English sentence." and "x"
    assert meta["source"] == "web" and meta["shard"] == "shard_00000"
    assert meta["tokenizer_sha256"] == load_tokenizer(tok_path).sha256
    assert meta["meta"]["stage"] == "tokenize" and meta["meta"]["params"]["count"]["batch_size"] == 2
    # the same pass wrote the tokens: the counts agree with what it kept and dropped
    assert rec["tokens"] == meta["n_doc_tokens"] + meta["dropped_tokens"]["short"]
    assert rec["delimiter_tokens"] == (meta["n_docs"] + meta["dropped"]["short"]) * 2


def test_counts_do_not_depend_on_batch_size(tmp_path, tok_path):
    shard = write_text_shard(tmp_path / "s.parquet", CORPUS[:50] + ["", "tail"])
    tok = load_tokenizer(tok_path)
    results = [count_shard(shard, tok, TEXT, batch_size=b) for b in (1, 7, 1000)]
    assert results[0] == results[1] == results[2] and results[0]["documents"] == 52


def test_threads_do_not_change_counts(tmp_path, tok_path):
    shard = write_text_shard(tmp_path / "s.parquet", CORPUS[:40])
    tok = load_tokenizer(tok_path)
    assert count_shard(shard, tok, TEXT, 8, num_threads=1) == count_shard(shard, tok, TEXT, 8, num_threads=2)


def test_chat_counts_rendered_conversations(tmp_path, tok_path, reference_encoding):
    convs = [
        [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello 😀 how can I help?"}],
        [],
        [{"role": "user", "content": "  "}, {"role": "assistant", "content": ""}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "ok <|bos|>"}, {"role": "assistant", "content": "Bye."}],
    ]
    shard = write_chat_shard(tmp_path / "chat" / "c.parquet", convs)
    rec = count_shard(shard, load_tokenizer(tok_path), CHAT, batch_size=3)
    kept = [convs[0], convs[3]]
    contents = [m["content"] for c in kept for m in c]
    # render_chat wraps every message in two chat tokens
    assert rec["tokens"] == sum(len(reference_encoding.encode_ordinary(t)) for t in contents) + 2 * len(contents)
    assert rec["documents"] == 4 and rec["empty_documents"] == 2 and rec["invalid_utf8_documents"] == 0
    assert rec["chars"] == sum(map(len, contents)) and rec["bytes"] == sum(len(t.encode()) for t in contents)
    assert rec["delimiter_tokens"] == 2 * 2


def test_chat_with_unknown_role_names_file_and_row(tmp_path, tok_path):
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]
    shard = write_chat_shard(tmp_path / "chat" / "c.parquet", [good, [{"role": "tool", "content": "b"}, good[1]]])
    with pytest.raises(PipelineError, match=r"c\.parquet: row 1: .*'tool'"):
        count_shard(shard, load_tokenizer(tok_path), CHAT, batch_size=8)
    # no assistant turn: counted (and dropped by tokenize), not an error
    shard = write_chat_shard(tmp_path / "chat" / "d.parquet", [good, [{"role": "user", "content": "a"}]])
    rec = count_shard(shard, load_tokenizer(tok_path), CHAT, batch_size=8)
    assert rec["documents"] == 2 and rec["no_assistant_documents"] == 1 and rec["delimiter_tokens"] == 2


def test_zero_row_shard_counts_zero_with_warning(tmp_path, tok_path, caplog):
    shard = write_text_shard(tmp_path / "web" / "empty.parquet", [])
    out = tmp_path / "tokens" / "web" / "empty.json"
    with caplog.at_level(logging.WARNING):
        tokenize.main(shard_args(count_params(), tok_path, shard, out))
    rec = json.loads(out.read_text())["counts"]
    assert all(rec[k] == 0 for k in COUNT_FIELDS)
    assert "no rows" in caplog.text


def _corrupt(path):
    path.write_bytes(b"this is not parquet at all" * 10)


def _truncated(path):
    write_text_shard(path, CORPUS[:200])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbled_pages(path):
    write_text_shard(path, CORPUS[:200])
    data = bytearray(path.read_bytes())
    data[100:3000] = bytes(2900)  # zero the data pages; the footer still parses
    path.write_bytes(bytes(data))


def _missing_column(path):
    write_text_shard(path, ["a", "b"], column="body")


@pytest.mark.parametrize("make_bad", [_corrupt, _truncated, _garbled_pages, _missing_column])
def test_bad_input_is_one_error_naming_file_and_no_output(tmp_path, tok_path, make_bad):
    shard = tmp_path / "web" / "bad_shard.parquet"
    shard.parent.mkdir(parents=True)
    make_bad(shard)
    out = tmp_path / "tokens" / "web" / "bad_shard.json"
    with pytest.raises(PipelineError, match="bad_shard.parquet") as e:
        tokenize.main(shard_args(count_params(), tok_path, shard, out))
    if make_bad is _missing_column:
        assert "'text'" in str(e.value) and "body" in str(e.value) and "text_column" in str(e.value)
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_cli_error_is_one_line_and_exit_1(tmp_path, tok_path, capsys):
    from pipeline.io import run_cli

    shard = tmp_path / "web" / "bad.parquet"
    shard.parent.mkdir(parents=True)
    _corrupt(shard)
    with pytest.raises(SystemExit) as e:
        run_cli(tokenize.main, shard_args(count_params(), tok_path, shard, tmp_path / "o.json"))
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "bad.parquet" in err[-1]


def test_unknown_source_is_an_error(tmp_path, tok_path):
    shard = write_text_shard(tmp_path / "s.parquet", ["a"])
    with pytest.raises(PipelineError, match="source 'code'"):
        tokenize.main(shard_args(count_params(), tok_path, shard, tmp_path / "o.json", source="code"))


# ----------------------------------------------------------------------------- aggregate

@pytest.fixture
def shard_jsons(tmp_path, tok_path):
    docs = {("web", "shard_00000"): CORPUS[:30] + [""], ("web", "shard_00001"): CORPUS[30:45],
            ("chat", "shard_00000"): [[{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}]
                                      for p in CORPUS[45:50]]}
    outs = []
    for (source, name), rows in docs.items():
        path = tmp_path / "data" / source / f"{name}.parquet"
        (write_chat_shard if source == "chat" else write_text_shard)(path, rows)
        out = tmp_path / "tokens" / source / f"{name}.json"
        tokenize.main(shard_args(count_params(batch_size=8), tok_path, path, out, source=source))
        outs.append(out)
    return outs


def test_aggregate_table_and_totals(tmp_path, shard_jsons):
    table, summary = tmp_path / "counts" / "counts.parquet", tmp_path / "counts" / "summary.json"
    main(["--inputs", *map(str, shard_jsons), "--out", str(table), "--summary", str(summary)])
    recs = [{**json.loads(p.read_text())["counts"], **json.loads(p.read_text())} for p in shard_jsons]
    t = pq.read_table(table).to_pylist()
    assert [(r["source"], r["shard"]) for r in t] == [("chat", "shard_00000"), ("web", "shard_00000"),
                                                      ("web", "shard_00001")]
    by_key = {(r["source"], r["shard"]): r for r in recs}
    for row in t:
        assert all(row[f] == by_key[(row["source"], row["shard"])][f] for f in COUNT_FIELDS)
    assert read_parquet_meta(table)["stage"] == "count"
    s = json.loads(summary.read_text())
    web = [r for r in recs if r["source"] == "web"]
    for f in COUNT_FIELDS:
        assert s["sources"]["web"][f] == sum(r[f] for r in web)
        assert s["total"][f] == sum(r[f] for r in recs)
    assert s["sources"]["web"]["shards"] == 2 and s["total"]["shards"] == 3
    assert s["sources"]["web"]["empty_documents"] == 1
    assert s["sources"]["web"]["mean_tokens_per_shard"] == pytest.approx(sum(r["tokens"] for r in web) / 2)
    assert s["total"]["bytes_per_token"] == pytest.approx(sum(r["bytes"] for r in recs)
                                                          / sum(r["tokens"] for r in recs))
    assert s["tokenizer_sha256"] == recs[0]["tokenizer_sha256"] and s["meta"]["stage"] == "count"


def _dup(paths):
    return [*paths, paths[0]]


def _mixed_tokenizers(paths):
    rec = json.loads(paths[0].read_text())
    rec["tokenizer_sha256"] = "0" * 64
    paths[0].write_text(json.dumps(rec))
    return paths


def _not_json(paths):
    paths[1].write_text("{truncated")
    return paths


@pytest.mark.parametrize("spoil,match", [(_dup, "given twice"), (_mixed_tokenizers, "different tokenizers"),
                                         (_not_json, "shard_00001.json")])
def test_aggregate_bad_inputs(tmp_path, shard_jsons, spoil, match):
    table, summary = tmp_path / "agg" / "counts.parquet", tmp_path / "agg" / "summary.json"
    with pytest.raises(PipelineError, match=match):
        main(["--inputs", *map(str, spoil(shard_jsons)), "--out", str(table), "--summary", str(summary)])
    assert not (tmp_path / "agg").exists()
