"""The sample corpus shipped in data/sample/ (built by scripts/build_sample_corpus.py; nothing here downloads).

The first group checks the shipped files against MANIFEST.json and the raw-shard contract of
docs/data-contract.md; the second checks the builder's pure functions on small inputs.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from filter_corpora import sample_builder

from pipeline.io import sha256_file

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"
MAX_BYTES = 15 * 1024 * 1024


builder = sample_builder()


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((SAMPLE / "MANIFEST.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def web() -> dict[str, pa.Table]:
    return {p.stem: pq.read_table(p) for p in sorted((SAMPLE / "web").glob("*.parquet"))}


@pytest.fixture(scope="module")
def chat() -> dict[str, pa.Table]:
    return {p.stem: pq.read_table(p) for p in sorted((SAMPLE / "chat").glob("*.parquet"))}


# ---------------------------------------------------------------------------------------------
# Shipped files


def test_files_match_manifest(manifest):
    shipped = sorted(str(p.relative_to(SAMPLE)) for p in SAMPLE.glob("*/*.parquet"))
    assert shipped == sorted(manifest["files"])
    for rel, entry in manifest["files"].items():
        path = SAMPLE / rel
        assert path.stat().st_size == entry["bytes"], rel
        assert sha256_file(path) == entry["sha256"], f"{rel} changed; rebuild with scripts/build_sample_corpus.py"
        assert pq.read_metadata(path).num_rows == entry["rows"], rel


def test_total_size_within_budget():
    total = sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file())
    assert total <= MAX_BYTES


def test_provenance_names_every_package(manifest):
    text = (SAMPLE / "PROVENANCE.md").read_text(encoding="utf-8")
    for source in manifest["sources"].values():
        for pkg in source["packages"]:
            assert pkg["name"] in text and pkg["version"] in text and pkg["sha256"] in text
    assert "python scripts/build_sample_corpus.py" in text


def test_web_shards_are_fineweb_shaped(web, manifest):
    assert len(web) == manifest["sources"]["web"]["shards"] >= 2
    ids = []
    for name, table in web.items():
        assert table.schema.names == ["id", "text"], name
        assert table.schema.field("id").type == pa.string() and table.schema.field("text").type == pa.string()
        table.validate(full=True)  # includes UTF-8 validity of every string
        assert table.column("text").null_count == 0 and table.column("id").null_count == 0
        assert all(len(t.split()) >= builder.MIN_WORDS for t in table.column("text").to_pylist()), name
        ids += table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == manifest["sources"]["web"]["documents"]


def test_web_documents_are_document_sized(web):
    words = [len(t.split()) for table in web.values() for t in table.column("text").to_pylist()]
    longest_allowed = builder.MAX_WORDS + 50  # planted near-duplicates add a short header and footer
    assert sum(w > longest_allowed for w in words) <= len(words) // 100  # only unsplittable code blocks
    assert sorted(words)[len(words) // 2] >= 300


def test_planted_duplicates_are_present(web, manifest):
    planted = manifest["sources"]["web"]["planted_duplicates"]
    assert {d["kind"] for d in planted} == {"exact", "near"}
    texts = {(name, i): t for name, table in web.items() for i, t in zip(table.column("id").to_pylist(),
                                                                        table.column("text").to_pylist())}
    for dup in planted:
        assert dup["shard"] != dup["original_shard"]
        copy, original = texts[(dup["shard"], dup["id"])], texts[(dup["original_shard"], dup["original_id"])]
        jaccard = builder.shingle_jaccard(copy, original)
        assert jaccard == pytest.approx(dup["word_5gram_jaccard"], abs=1e-4)
        if dup["kind"] == "exact":
            assert copy == original
        else:
            assert copy != original and jaccard >= 0.8


def test_chat_shards_alternate_roles(chat, manifest):
    assert len(chat) == manifest["sources"]["chat"]["shards"]
    ids = []
    for name, table in chat.items():
        assert table.schema.names == ["id", "messages"], name
        typ = table.schema.field("messages").type
        assert pa.types.is_list(typ) and typ.value_type == builder.CHAT_TYPE.value_type, name
        table.validate(full=True)
        for conv in table.column("messages").to_pylist():
            assert len(conv) >= 2
            assert [m["role"] for m in conv] == [("user", "assistant")[i % 2] for i in range(len(conv))]
            assert all(m["content"] and m["content"].strip() for m in conv)
        ids += table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == manifest["sources"]["chat"]["documents"]


def test_crawl_is_regenerated_from_the_shipped_web_shards(web, manifest, tmp_path):
    texts = [t for table in web.values() for t in table.column("text").to_pylist()]
    shards = builder.crawl_shards(texts)
    assert len(shards) == manifest["sources"]["crawl"]["shards"]
    assert sum(map(len, shards)) == manifest["sources"]["crawl"]["documents"]
    for i, shard in enumerate(shards):
        rel = f"crawl/{builder.shard_name(i)}.parquet"
        builder.write_shard(tmp_path / rel, builder.web_table(shard))
        assert (tmp_path / rel).read_bytes() == (SAMPLE / rel).read_bytes(), rel


def test_every_default_filter_removes_some_crawl_pages():
    """The crawl/ source shows the whole default filter chain at work (docs/filters.md), and some pages survive."""
    from pipeline.data import text_filters as F

    shards = sorted((SAMPLE / "crawl").glob("*.parquet"))
    res = F.run_chain([t for p in shards for t in pq.read_table(p).column("text").to_pylist()], F.build_chain())
    removed = Counter(f for f, k in zip(res.filter, res.kept) if not k)
    for name in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb_quality"):
        assert removed[name] > 0, name
    assert {"language_ru", "language_zh"} <= set(res.rule)  # whole pages in another language
    assert res.lines_removed[res.kept].sum() > 0 and res.spans_replaced[res.kept].sum() > 0  # c4 lines, pii
    assert 0.1 < res.kept.mean() < 0.5


# ---------------------------------------------------------------------------------------------
# Builder functions


def test_split_even_keeps_text_and_bounds_length():
    paragraphs = [" ".join(f"w{i}_{j}" for j in range(30 + i % 17)) for i in range(60)]
    text = "\n\n".join(paragraphs)
    pieces = builder.split_even(text, 400)
    assert "".join(pieces) == text
    assert len(pieces) == -(-builder.n_words(text) // 400)
    assert all(builder.n_words(p) <= 400 for p in pieces)


def test_split_even_falls_back_to_line_breaks():
    text = "\n".join(" ".join(["verse"] * 10) for _ in range(100))  # no blank lines at all
    pieces = builder.split_even(text, 300)
    assert "".join(pieces) == text and all(builder.n_words(p) <= 300 for p in pieces) and len(pieces) == 4


def test_plays_are_cut_at_scenes_with_their_act_heading():
    play = "THE TEMPEST\n\nPersons.\n\nACT I.\n\nSCENE I. A ship.\n\nText one.\n\nSCENE II. An island.\n\n" \
           "Text two.\n\nACT II.\n\nScene 1. Another part.\n\nText three."
    sections = builder.cut_at(play, builder.section_starts(play))
    assert [s.strip().split("\n")[0] for s in sections] == ["THE TEMPEST", "ACT I.", "SCENE II. An island.", "ACT II."]


def test_pack_merges_short_units_and_splits_long_ones():
    short = ["alpha " * 100, "beta " * 100, "gamma " * 100]
    long = "\n\n".join(["delta " * 50] * 20)
    docs = builder.pack([*short, long], 250)
    assert [builder.n_words(d) for d in docs] == [200, 100, 250, 250, 250, 250]


def test_rst_to_text_strips_markup():
    rst = """.. _tut-if:

*******************
  Control flow
*******************

.. index::
   statement: if

Use :keyword:`!if` and :func:`~os.path.join` with ``x`` (see `the docs <https://python.org>`_)::

   >>> x = 1

.. note::
   Be careful.

.. versionadded:: 3.10
"""
    assert builder.rst_to_text(rst) == ("Control flow\n\nUse if and join with x (see the docs):\n\n   >>> x = 1\n\n"
                                        "Note:\n   Be careful.\n\nNew in version 3.10")


def test_to_messages_maps_speakers_and_merges_turns():
    def utt(sender, text):
        return {"sender": sender, "text": text}

    turns = [[utt("a", "hi"), utt("a", "there")], [utt("b", "hello")], [utt("b", " ")], [utt("b", "how are you")],
             [utt("a", "fine")]]
    assert builder.to_messages(turns) == [
        {"role": "user", "content": "hi\nthere"},
        {"role": "assistant", "content": "hello\nhow are you"},
        {"role": "user", "content": "fine"},
    ]
    assert builder.to_messages([[utt("a", "x")], [utt("b", "y")], [utt("c", "z")]]) is None


def test_chat_conversations_drop_unanswered_openers():
    data = {"b": {"messages": [[{"sender": "s", "text": "anyone?"}]]},
            "a": {"messages": [[{"sender": "s", "text": "hi"}], [{"sender": "t", "text": "yo"}]]}}
    rows, dropped = builder.chat_conversations(data)
    assert [r["id"] for r in rows] == ["chitchat-a"] and dropped == {"single_speaker": 1, "more_than_two_speakers": 0}


def test_deal_is_a_seeded_partition():
    items = list(range(103))
    shards = builder.deal(items, 8, random.Random("s"))
    assert sorted(x for s in shards for x in s) == items
    assert {len(s) for s in shards} <= {12, 13}
    assert shards == builder.deal(items, 8, random.Random("s")) != builder.deal(items, 8, random.Random("t"))


def test_near_duplicate_is_a_light_edit():
    text = "\n\n".join(" ".join(f"p{i}w{j}" for j in range(40)) for i in range(30))
    copy, edit = builder.near_duplicate(text, random.Random(0))
    assert copy != text and "removed paragraph" in edit
    assert 0.8 <= builder.shingle_jaccard(text, copy) < 1.0


def test_write_shard_is_byte_reproducible(tmp_path):
    docs = [builder.Doc(f"k/{i}", "test", f"document {i} " * 50) for i in range(20)]
    chats = [{"id": "c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    for name, table in (("web", builder.web_table(docs)), ("chat", builder.chat_table(chats))):
        a, b = tmp_path / f"{name}_a.parquet", tmp_path / f"{name}_b.parquet"
        builder.write_shard(a, table)
        builder.write_shard(b, table)
        assert a.read_bytes() == b.read_bytes()
        assert pq.read_table(a).equals(table)
    assert builder.Doc("k/1", "x", "").id == docs[1].id and docs[1].id != docs[2].id


def test_fetch_reports_a_failed_download(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        raise builder.subprocess.CalledProcessError(100, cmd, stderr="E: Version '3.11.2-6+deb12u9' not found")

    monkeypatch.setattr(builder.subprocess, "run", failing_run)
    with pytest.raises(builder.PipelineError, match=r"cannot fetch python3\.11-doc=.*not found.*apt-get update"):
        builder.fetch(builder.PYDOC, tmp_path)


def test_fetch_rejects_a_file_with_the_wrong_hash(tmp_path, monkeypatch):
    (tmp_path / builder.CHITCHAT.filename).write_bytes(b"not the pinned wheel")
    monkeypatch.setattr(builder, "_download", lambda art, dest: None)
    with pytest.raises(builder.PipelineError, match="does not match the pinned"):
        builder.fetch(builder.CHITCHAT, tmp_path)
