"""The filter stage (pipeline.data.filter): filtered shards, per-document decisions, the unchanged shard's link."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from builders import write_chat_shard, write_text_shard

from pipeline.data.filter import DECISION_SCHEMA, decisions_path, main

PROSE = ("The history of the city is long, and it has been told by many of the people who lived there. "
         "Merchants wrote about the river and the market; priests kept records of births and deaths. "
         "In the spring floods came down from the hills, so the old bridge had to be rebuilt of stone. "
         "Later a railway reached the valley, bringing coal, newspapers and visitors from the capital. "
         "Today the museum near the harbour shows maps, letters and tools that survived those years.")
SPAM = "\n".join(["buy now"] * 30)  # one line repeated: Gopher repetition's dup_line_frac


def run(tmp_path, source: str, fmt: str, inputs: list, chain: list) -> list:
    params = {"filter": chain, "sources": {source: {"type": "local", "format": fmt}}}
    outs = [str(tmp_path / "filtered" / source / os.path.basename(p)) for p in inputs]
    main(["--params", json.dumps(params), "--source", source, "--inputs", *map(str, inputs), "--outputs", *outs,
          "--manifest", str(tmp_path / "filtered" / source / "_manifest" / "0.json")])
    return outs


def test_text_shard_keeps_filters_and_decides_every_row_in_order(tmp_path):
    texts = [None, PROSE + "\nContact jane.doe@example.com for more.", SPAM, PROSE]  # a first row not a document
    raw = write_text_shard(tmp_path / "raw/web/shard_00000.parquet", texts)
    chain = [{"name": "gopher_repetition"}, {"name": "pii"}]
    (out,) = run(tmp_path, "web", "text", [raw], chain)

    kept = pq.read_table(out)
    assert kept.schema == pq.read_schema(raw)  # every column of the raw shard, same types
    assert kept.column("id").to_pylist() == ["shard_00000-0", "shard_00000-1", "shard_00000-3"]
    first = kept.column("text").to_pylist()[1]
    assert "jane.doe@example.com" not in first and "email@example.com" in first  # PIIFormatter's placeholder
    assert kept.column("text").to_pylist()[::2] == [None, PROSE]  # None: not a document, left to tokenize to count

    d = pq.read_table(decisions_path(out))
    assert d.schema == DECISION_SCHEMA and d.num_rows == 4
    rows = d.to_pylist()
    assert [r["kept"] for r in rows] == [True, True, False, True]
    assert (rows[2]["filter"], rows[2]["rule"]) == ("gopher_repetition", "dup_line_frac")
    assert rows[2]["value"] > rows[2]["threshold"] == 0.3 and rows[2]["chars_out"] == 0
    assert rows[2]["chars_in"] == len(SPAM)
    assert rows[1]["spans_replaced"] == 1 and rows[1]["chars_out"] == len(first) and rows[1]["filter"] == ""
    assert rows[0]["chars_in"] == 0 and rows[3]["chars_in"] == rows[3]["chars_out"] == len(PROSE)
    side = json.loads((tmp_path / "filtered/web/shard_00000.parquet.json").read_text())
    assert (side["rows_in"], side["rows_out"], side["unchanged"]) == (4, 3, False)
    assert not os.path.samefile(raw, out)


def test_unchanged_shard_is_a_hard_link(tmp_path):
    raw = write_text_shard(tmp_path / "raw/web/shard_00001.parquet", [PROSE, PROSE + " More."])
    (out,) = run(tmp_path, "web", "text", [raw], [{"name": "gopher_quality"}, {"name": "pii"}])
    assert os.path.samefile(raw, out)
    assert pq.read_table(decisions_path(out)).column("kept").to_pylist() == [True, True]
    assert json.loads((tmp_path / "filtered/web/shard_00001.parquet.json").read_text())["unchanged"] is True


def test_chat_is_never_line_filtered_and_scrubbed_per_message(tmp_path):
    # c4 would drop every line without terminal punctuation (all of these), and the whole conversation
    convs = [[{"role": "user", "content": "hi there my friend"},
              {"role": "assistant", "content": "write to me at bob@example.org any time"}]]
    raw = write_chat_shard(tmp_path / "raw/chat/shard_00000.parquet", convs)
    (out,) = run(tmp_path, "chat", "chat", [raw], [{"name": "c4"}, {"name": "pii"}])
    messages = pq.read_table(out).column("messages").to_pylist()[0]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "hi there my friend"
    assert messages[1]["content"] == "write to me at email@example.com any time"
    row = pq.read_table(decisions_path(out)).to_pylist()[0]
    assert row["kept"] and row["lines_removed"] == 0 and row["spans_replaced"] == 1


@pytest.mark.parametrize("chain", [[{"name": "gopher_repetition", "settings": {"dup_n_grams": {5: 0.5}}}]])
def test_ngram_settings_survive_the_rules_json_params(tmp_path, chain):
    raw = write_text_shard(tmp_path / "raw/web/shard_00002.parquet", [PROSE])
    (out,) = run(tmp_path, "web", "text", [raw], chain)  # JSON turns the n-gram size 5 into "5"
    assert pq.read_table(decisions_path(out)).column("kept").to_pylist() == [True]
