"""Tokenize stage: exact token accounting, delimiter policies, round trips, chat masks, bad inputs.

`make_tokenizer` (a real tiny BPE trained with pipeline.data.train_tokenizer) and `corpus` are imported by the
other data-stage tests.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
from builders import ROOT, corpus, make_tokenizer, write_chat_shard, write_text_shard

from pipeline.data.contract import open_tokens, token_dtype
from pipeline.data.contract import token_paths as output_paths
from pipeline.data.encoding import BOS, Tokenizer, special_token_names
from pipeline.data.tokenize import main, tokenize_shard
from pipeline.errors import PipelineError
from pipeline.io import read_json


def params(fmt="text", min_chars=0, batch_size=7):
    return {"sources": {"s": {"type": "local", "format": fmt, "text_column": "text", "messages_column": "messages",
                              "min_chars": min_chars}}, "count": {"batch_size": batch_size}}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("toks")
    return {p: make_tokenizer(d, p) for p in ("bos", "eos", "both")}


def spans(out_json):
    meta, tokens, off, mask = open_tokens(out_json)
    return meta, [np.asarray(tokens[off[i]:off[i + 1]]) for i in range(meta["n_docs"])], mask, off


def strip(tok, span):
    head = 1 if tok.delimiter in ("bos", "both") else 0
    tail = 1 if tok.delimiter in ("eos", "both") else 0
    return span[head:len(span) - tail]


def write_binary_shard(path, values):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(values, pa.binary())}), path)
    return path


TRICKY = [
    "plain words here",
    "",  # empty
    None,  # null
    "   \n\t ",  # whitespace-only = empty
    "a literal <|bos|> and <|eos|> and <|assistant_start|> inside the text",
    "hi",  # short when min_chars = 5
    "unicode: café naïve 東京 😀 — done",
]


@pytest.mark.parametrize("delimiter", ["bos", "eos", "both"])
def test_accounting_roundtrip_and_delimiters(tmp_path, toks, delimiter):
    tok = toks[delimiter]
    texts = corpus(40, seed=1) + TRICKY
    raw = [t.encode() if t is not None else None for t in texts] + [b"bad \xff\xfe utf8"]
    shard = write_binary_shard(tmp_path / "raw" / "s" / "sh0.parquet", raw)
    out = tmp_path / "tokens" / "s" / "sh0.json"
    meta = tokenize_shard(tok, shard, out, "s", "sh0", params(min_chars=5))

    kept = [i for i, t in enumerate(texts) if t and not t.isspace() and len(t) >= 5]
    short = [i for i, t in enumerate(texts) if t and not t.isspace() and len(t) < 5]
    assert meta["doc_rows"] == kept
    assert meta["n_rows"] == len(raw)
    assert meta["dropped"] == {"empty": 3, "invalid_utf8": 1, "short": len(short), "null_content": 0,
                               "no_assistant": 0, "long": 0}
    assert meta["dropped_tokens"]["short"] == sum(len(tok.encode(texts[i])) for i in short)

    meta2, docs, _, off = spans(out)
    assert meta2 == read_json(out) and meta["n_docs"] == len(kept)
    assert meta["n_tokens"] == int(off[-1]) == meta["n_doc_tokens"] + meta["n_docs"] * tok.n_delimiters()
    assert meta["n_doc_tokens"] == sum(len(tok.encode(texts[i])) for i in kept)
    assert output_paths(out)["bin"].stat().st_size == meta["n_tokens"] * 2 and meta["dtype"] == "uint16"
    specials = set(tok.special.values())
    for i, span in zip(kept, docs):
        assert span.tolist() == tok.delimit(tok.encode(texts[i]))  # the batch-vectorised delimit == delimit
        body = strip(tok, span)
        assert tok.decode(body) == texts[i]
        assert not specials & set(body.tolist()), "a special id inside a document"
        assert len(span) == len(body) + tok.n_delimiters()
        if delimiter in ("bos", "both"):
            assert span[0] == tok.bos_id
        if delimiter in ("eos", "both"):
            assert span[-1] == tok.eos_id
    assert not output_paths(out)["mask"].exists()

    counts = meta["counts"]  # tallied in the same pass, before the drops (the count table joins them)
    assert counts == tokenize_shard(tok, shard, tmp_path / "bs5" / "s" / "sh0.json", "s", "sh0",
                                    params(min_chars=5, batch_size=5))["counts"]
    assert counts["tokens"] == meta["n_doc_tokens"] + meta["dropped_tokens"]["short"]
    assert counts["short_documents"] == len(short) and counts["short_tokens"] == meta["dropped_tokens"]["short"]
    assert counts["delimiter_tokens"] == (len(kept) + len(short)) * tok.n_delimiters()
    assert counts["documents"] == meta["n_rows"]
    assert ((counts["empty_documents"], counts["invalid_utf8_documents"])
            == (meta["dropped"]["empty"], meta["dropped"]["invalid_utf8"]))


def test_batch_size_does_not_change_output(tmp_path, toks):
    shard = write_text_shard(tmp_path / "raw" / "s" / "a.parquet", corpus(25, seed=2))
    outs = []
    for bs in (1, 4, 1000):
        out = tmp_path / f"tok{bs}" / "s" / "a.json"
        tokenize_shard(toks["bos"], shard, out, "s", "a", params(batch_size=bs))
        outs.append(out)
    ref = [output_paths(outs[0])[k].read_bytes() for k in ("bin", "idx")]
    for out in outs[1:]:
        assert [output_paths(out)[k].read_bytes() for k in ("bin", "idx")] == ref


def test_uint32_when_vocab_exceeds_uint16(tmp_path):
    ranks = {bytes([i]): i for i in range(256)}
    special = {name: 70_000 + i for i, name in enumerate(special_token_names("bos"))}
    enc = tiktoken.Encoding("wide", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens=special)
    tok = Tokenizer(enc, special, "bos", "f" * 64, str(tmp_path / "encoding.json"))
    assert tok.n_vocab > 65536 and token_dtype(tok.n_vocab) == np.uint32 and token_dtype(65536) == np.uint16
    texts = corpus(5, seed=3)
    shard = write_text_shard(tmp_path / "raw" / "s" / "w.parquet", texts)
    out = tmp_path / "tokens" / "s" / "w.json"
    meta = tokenize_shard(tok, shard, out, "s", "w", params())
    assert meta["dtype"] == "uint32"
    _, docs, _, _ = spans(out)
    assert output_paths(out)["bin"].stat().st_size == 4 * meta["n_tokens"]
    assert [int(d[0]) for d in docs] == [special[BOS]] * 5 and [tok.decode(d[1:]) for d in docs] == texts


@pytest.mark.parametrize("delimiter", ["bos", "both"])
def test_chat_mask(tmp_path, toks, delimiter):
    tok = toks[delimiter]
    convs = [
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the river of stone"}],
        [],  # empty conversation
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1 café"},
         {"role": "user", "content": "q2 <|bos|>"}, {"role": "assistant", "content": "winter light 42"}],
    ]
    shard = write_chat_shard(tmp_path / "raw" / "c" / "c0.parquet", convs)
    out = tmp_path / "tokens" / "c" / "c0.json"
    p = {"sources": {"c": {"type": "local", "format": "chat", "messages_column": "messages"}},
         "count": {"batch_size": 2}}
    meta = tokenize_shard(tok, shard, out, "c", "c0", p)
    assert meta["doc_rows"] == [0, 2] and meta["dropped"]["empty"] == 1 and meta["has_mask"]
    _, docs, mask, off = spans(out)
    assert len(mask) == meta["n_tokens"]
    for conv, span, a, b in zip([convs[0], convs[2]], docs, off[:-1], off[1:]):
        m = np.asarray(mask[a:b])
        ids, expect = tok.render_chat(conv)
        assert strip(tok, span).tolist() == ids and strip(tok, m).tolist() == expect
        assert m[0] == 0 and (delimiter == "bos" or m[-1] == 0)
        # masked tokens are exactly the assistant replies, each followed by <|assistant_end|>
        end = tok.special["<|assistant_end|>"]
        replies = "".join(c["content"] for c in conv if c["role"] == "assistant")
        assert tok.decode([t for t in span[m == 1].tolist() if t != end]) == replies
        assert int((span[m == 1] == end).sum()) == sum(c["role"] == "assistant" for c in conv)


def test_unknown_role_is_one_error_naming_the_users_file_and_row_and_nothing_left(tmp_path, toks):
    # the placed copy under data/raw is not the file the user can fix: the error names the origin its
    # download sidecar records (the same bytes, so the same row numbers), then the copy
    good = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    bad = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "hello"}]
    mine = write_chat_shard(tmp_path / "my data" / "chats-07.parquet", [good, bad])
    shard = tmp_path / "raw" / "c" / "c0.parquet"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(mine.read_bytes())
    (tmp_path / "raw" / "c" / "c0.parquet.json").write_text(json.dumps({"origin": str(mine.resolve())}))
    out = tmp_path / "tokens" / "c" / "c0.json"
    p = {"sources": {"c": {"type": "local", "format": "chat", "messages_column": "messages"}},
         "count": {"batch_size": 2}}
    message = (f"{mine.resolve()} (placed as {shard}): row 1: chat role 'tool' is not one of 'system', 'user', "
               "'assistant'; fix or drop that row")
    with pytest.raises(PipelineError) as e:
        tokenize_shard(toks["bos"], shard, out, "c", "c0", p)
    assert str(e.value) == message
    assert not list(out.parent.glob("*"))


def test_a_chat_content_that_is_not_a_string_names_the_row_and_field_not_a_corrupt_file(tmp_path, toks):
    """A messages column shaped right whose content is a number (here, or a list of parts elsewhere): the
    file reads fine, so the error is the row and field to fix, not "corrupt or truncated, re-download it"."""
    typ = pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())]))
    convs = [[{"role": "user", "content": None}], [{"role": "user", "content": None}, {"role": "assistant",
                                                                                       "content": 7}]]
    shard = tmp_path / "raw" / "c" / "c0.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.table({"messages": pa.array(convs, type=typ)}), shard)
    out = tmp_path / "tokens" / "c" / "c0.json"
    p = {"sources": {"c": {"type": "local", "format": "chat", "messages_column": "messages"}},
         "count": {"batch_size": 1}}
    with pytest.raises(PipelineError) as e:
        tokenize_shard(toks["bos"], shard, out, "c", "c0", p)
    assert str(e.value) == (f"{shard}: row 1, message 1: field 'content' of column 'messages' is 7 (int64), not a "
                            "string; every message's role and content must be a string: fix the export that wrote "
                            "the file")
    assert not out.parent.exists() or not list(out.parent.glob("*"))


def test_bad_sft_data_is_dropped_and_counted_not_trained_on(tmp_path, toks):
    """A huge conversation (over max_conversation_tokens), a null content and a conversation with no
    assistant turn are dropped and counted — in the counts the tokenize pass tallies and in what it
    drops alike, so the accounting balances — instead of becoming a large share of the loss targets,
    an empty answer, or a stopped run. A system turn is rendered (into the next user turn) and never a
    loss target."""
    tok = toks["bos"]
    ok = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the river of stone"}]
    system = [{"role": "system", "content": "Answer in one line."}, *ok]
    huge = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "stone " * 3000}]
    null = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    no_answer = [{"role": "user", "content": "anyone there?"}]
    convs = [ok, huge, null, system, no_answer, ok, [None, *ok]]
    shard = write_chat_shard(tmp_path / "raw" / "c" / "c0.parquet", convs)
    src = {"type": "local", "format": "chat", "messages_column": "messages", "max_conversation_tokens": 500}
    out = tmp_path / "tokens" / "c" / "c0.json"
    meta = tokenize_shard(tok, shard, out, "c", "c0", {"sources": {"c": src}, "count": {"batch_size": 4}})
    assert meta["doc_rows"] == [0, 3, 5]
    assert meta["dropped"] == {"empty": 0, "invalid_utf8": 0, "short": 0, "null_content": 2, "no_assistant": 1,
                               "long": 1}
    assert meta["dropped_tokens"]["long"] == len(tok.render_chat(huge)[0]) > 500
    _, docs, mask, off = spans(out)
    ids, m = tok.render_chat(system)
    assert strip(tok, docs[1]).tolist() == ids and strip(tok, np.asarray(mask[off[1]:off[2]])).tolist() == m
    assert tok.decode([t for t, b in zip(ids, m) if not b]).startswith("<|user_start|>Answer in one line.\n\nhello")
    assert tok.decode([t for t, b in zip(ids, m) if b]) == "the river of stone<|assistant_end|>"  # targets: the answer
    counts = meta["counts"]
    assert (counts["null_content_documents"], counts["no_assistant_documents"], counts["long_documents"]) == (2, 1, 1)
    assert counts["long_tokens"] == meta["dropped_tokens"]["long"]
    assert counts["tokens"] == meta["n_doc_tokens"] + meta["dropped_tokens"]["long"]
    assert counts["delimiter_tokens"] == (meta["n_docs"] + 1) * tok.n_delimiters()  # the long one is a document
    no_cap = tokenize_shard(tok, shard, out, "c", "c0",
                            {"sources": {"c": {**src, "max_conversation_tokens": None}}, "count": {"batch_size": 4}})
    assert no_cap["doc_rows"] == [0, 1, 3, 5] and no_cap["dropped"]["long"] == 0


def _truncated(d):
    data = write_text_shard(d / "good.parquet", corpus(50, seed=4)).read_bytes()
    (d / "raw/s/trunc.parquet").write_bytes(data[: len(data) // 2])
    return d / "raw/s/trunc.parquet"


def _garbage(d):
    (d / "raw/s/junk.parquet").write_bytes(b"not parquet at all")
    return d / "raw/s/junk.parquet"


def _wrong_column(d):
    return write_text_shard(d / "raw/s/col.parquet", ["a b c"], column="body")


@pytest.mark.parametrize(
    "make, match",
    [(_truncated, "not a readable parquet"), (_garbage, "not a readable parquet"), (_wrong_column, "no column 'text'")],
    ids=["truncated", "garbage", "missing-column"],
)
def test_bad_input_clear_error_nothing_left(tmp_path, toks, make, match):
    (tmp_path / "raw" / "s").mkdir(parents=True)
    shard = make(tmp_path)
    outdir = tmp_path / "tokens" / "s"
    out = outdir / f"{shard.stem}.json"
    outdir.mkdir(parents=True)
    out.write_text("{}")  # a stale done-marker from an earlier run must not survive a failure
    with pytest.raises(PipelineError, match=match) as e:
        tokenize_shard(toks["bos"], shard, out, "s", shard.stem, params())
    assert str(shard) in str(e.value)
    assert list(outdir.iterdir()) == []


def test_cli(tmp_path, toks):
    shard = write_text_shard(tmp_path / "raw" / "s" / "a.parquet", corpus(10, seed=5))
    out = tmp_path / "tokens" / "s" / "a.json"
    p = json.dumps(params())
    main(["--params", p, "--tokenizer", toks["eos"].path, "--source", "s", "--inputs", str(shard),
          "--outputs", str(out)])
    assert read_json(out)["n_docs"] == 10 and read_json(out)["delimiter"] == "eos"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.data.tokenize", "--params", p, "--tokenizer", toks["eos"].path,
         "--inputs", str(shard), "--source", "nope", "--outputs", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: source 'nope'")


def test_a_text_shard_read_as_chat_names_the_format_key(tmp_path):
    """sources.web.format: chat on a text shard: the error names the source's keys to change."""
    from pipeline.data.contract import iter_documents

    shard = write_text_shard(tmp_path / "raw" / "web" / "s.parquet", ["a document"])
    with pytest.raises(PipelineError, match=r"s\.parquet: no column 'messages' \(columns: id, text\); set "
                                            r"sources\.web\.messages_column, or sources\.web\.format: text if it holds "
                                            r"plain text$"):
        next(iter_documents(shard, {"format": "chat"}, 8))
