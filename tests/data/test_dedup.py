"""Dedup: signatures equal datasketch's, planted near-duplicates are found across shards and sources,
dissimilar documents survive, keepers are deterministic, bad inputs fail clearly."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import add_shard, make_config, run_dedup, write_text_shard, write_token_index
from datasketch import MinHash

from pipeline.data import contract, dedup, minhash
from pipeline.errors import PipelineError
from pipeline.rules import rule_params

NGRAM = 5


# ----------------------------------------------------------------------------- helpers

def shingles(text: str) -> set:
    w = minhash.normalize_text(text).split()
    return {tuple(w[i:i + NGRAM]) for i in range(len(w) - NGRAM + 1)}


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def random_doc(rng: random.Random, vocab: list[str]) -> list[str]:
    return [rng.choice(vocab) for _ in range(rng.randint(200, 400))]


def edited(rng: random.Random, words: list[str], vocab: list[str], n_edits: int) -> list[str]:
    """Substitute, insert or delete `n_edits` words at random positions."""
    w = list(words)
    for _ in range(n_edits):
        i = rng.randrange(len(w))
        op = rng.choice(("sub", "ins", "del"))
        if op == "sub":
            w[i] = rng.choice(vocab)
        elif op == "ins":
            w.insert(i, rng.choice(vocab))
        else:
            del w[i]
    return w


# ----------------------------------------------------------------------------- hashing

TRICKY = [
    "Hello,  WORLD!\n\tsecond\u00a0line", "", "   ", "!!!", "one", "two words", "a b c d", "a b c d e",
    "“Curly” quotes — dashes… ﬁne Ｆｕｌｌｗｉｄｔｈ ΣΑΣ e\u0301 İstanbul 日本語のテキスト",
    "averyveryverylongwordofmorethansixteenbytes short x" * 3,
    "snake_case and-dashes and.dots 3.14 x2 naïve café",
]


def test_signatures_equal_datasketch_oracle():
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzéß"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 19))) for _ in range(500)]
    docs = TRICKY + [" ".join(rng.choice(vocab) for _ in range(rng.choice([3, 7, 60, 400]))) for _ in range(40)]
    num_perm, seed = 64, 7
    wh, word_off = minhash.doc_word_hashes(pa.array(docs))
    hashes, off = minhash.shingle_hashes(wh, word_off, NGRAM)
    sig = minhash.signatures(hashes, off, minhash.permutations(num_perm, seed))
    for d, text in enumerate(docs):
        words = minhash.normalize_text(text).encode().split()
        assert list(wh[word_off[d]:word_off[d + 1]]) == [minhash.word_hash(w) for w in words], text
        grams = [b" ".join(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)] or [b" ".join(words)]
        ref = MinHash(num_perm=num_perm, seed=seed, hashfunc=minhash.shingle_hash32, scheme="affine32")
        for g in grams:
            ref.update(g)
        np.testing.assert_array_equal(sig[d], ref.hashvalues, err_msg=text)



def test_an_ngram_longer_than_every_document_is_one_shingle_per_document():
    """dedup.ngram: 10^9 (the schema accepts it): every document is its single whole-document shingle,
    as with an ngram just past the longest document; the work is bounded by the words, not by ngram."""
    wh, word_off = minhash.doc_word_hashes(pa.array(TRICKY))
    longest = int(np.diff(word_off).max())
    huge, off = minhash.shingle_hashes(wh, word_off, 10**9)
    just_past, off_past = minhash.shingle_hashes(wh, word_off, longest + 1)
    np.testing.assert_array_equal(off, np.arange(len(TRICKY) + 1))
    np.testing.assert_array_equal(huge, just_past)
    np.testing.assert_array_equal(off, off_past)

def test_normalisation_folds_case_space_punctuation_and_unicode():
    assert minhash.normalize_text("Hello,  WORLD!\n") == "hello world"
    assert minhash.normalize_text("“Naïve” café—ﬁne… ＡＢＣ") == "naïve café fine abc"
    assert minhash.normalize_text("e\u0301t\u00e9") == "été"  # NFKC composes the accent
    assert minhash.normalize_text("snake_case x") == "snake case x"


def test_band_keys_depend_on_band_and_values():
    sig = np.arange(2 * 12, dtype=np.uint32).reshape(2, 12)
    sig[1, :6] = sig[0, :6]
    keys = minhash.band_keys(sig, bands=2, rows=6)
    assert keys.shape == (2, 2) and keys.dtype == np.uint64
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] != keys[1, 1]
    same_values = np.tile(sig[:1, :6], (1, 2))  # identical values in both bands: keys still differ
    k = minhash.band_keys(same_values, bands=2, rows=6)
    assert k[0, 0] != k[0, 1]


def test_connected_components_roots_are_component_minima():
    u = np.array([9, 5, 7, 100, 3], np.int64)
    v = np.array([5, 7, 2, 200, 50], np.int64)
    nodes, root = dedup.connected_components(u, v)
    got = dict(zip(nodes.tolist(), root.tolist()))
    assert got == {2: 2, 5: 2, 7: 2, 9: 2, 100: 100, 200: 100, 3: 3, 50: 3}


# ----------------------------------------------------------------------------- quality

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Originals in web/shard_a; near copies (J >= 0.8) and far copies (J ~ 0.3) in web/shard_b;
    exact variants (case, spacing, punctuation) in web/shard_b and as conversations in chat."""
    rng = random.Random(1234)
    vocab = [f"w{i}x{rng.randrange(10**6)}" for i in range(50_000)]
    originals = [random_doc(rng, vocab) for _ in range(300)]
    near, far, exact, chat = [], [], [], []
    for i in range(120):
        near.append((i, " ".join(edited(rng, originals[i], vocab, rng.randint(1, 5)))))
    for i in range(120, 180):
        far.append((i, " ".join(edited(rng, originals[i], vocab, len(originals[i]) // 6))))
    for i in range(180, 200):
        exact.append((i, "  ".join(w.upper() + "," for w in originals[i])))
    for i in range(200, 220):
        chat.append((i, " ".join(originals[i])))
    root = tmp_path_factory.mktemp("planted")
    shard_b = near + far + exact
    shards = [
        add_shard(root, "web", "shard_a", [" ".join(w) for w in originals]),
        add_shard(root, "web", "shard_b", [t for _, t in shard_b]),
        add_shard(root, "chat", "shard_c", [t for _, t in chat], chat=True),
    ]
    keep, report = run_dedup(root, shards, make_config())
    return {"root": root, "originals": [" ".join(w) for w in originals], "shard_b": shard_b, "chat": chat,
            "near": near, "far": far, "keep": keep, "report": report, "shards": shards}


def test_planted_near_duplicates_are_found(planted):
    a, b = planted["keep"][("web", "shard_a")], planted["keep"][("web", "shard_b")]
    hits = total = 0
    for j, (i, text) in enumerate(planted["near"]):
        if jaccard(planted["originals"][i], text) < 0.8:
            continue
        total += 1
        hits += b["cluster"][j] == a["cluster"][i]
    assert total >= 100
    assert hits / total >= 0.95
    # the keeper is the original (smallest key: shard_a sorts first); copies are removed as near
    found = [j for j, (i, _) in enumerate(planted["near"]) if b["cluster"][j] == a["cluster"][i]]
    assert all(a["keep"][planted["near"][j][0]] and not b["keep"][j] for j in found)
    assert {b["reason"][j] for j in found} == {"near"}


def test_dissimilar_pairs_survive(planted):
    a, b = planted["keep"][("web", "shard_a")], planted["keep"][("web", "shard_b")]
    offset = len(planted["near"])
    similarity = [jaccard(planted["originals"][i], text) for i, text in planted["far"]]
    assert max(similarity) < 0.45 and sum(0.25 <= s <= 0.35 for s in similarity) >= 40
    for j, (i, _text) in enumerate(planted["far"]):
        assert b["keep"][offset + j] and a["keep"][i]
        assert b["cluster"][offset + j] != a["cluster"][i]


def test_exact_variants_across_shards_and_sources(planted):
    a, b = planted["keep"][("web", "shard_a")], planted["keep"][("web", "shard_b")]
    c = planted["keep"][("chat", "shard_c")]
    offset = len(planted["near"]) + len(planted["far"])
    for j in range(offset, len(planted["shard_b"])):
        i = planted["shard_b"][j][0]
        assert (b["cluster"][j], b["keep"][j], b["reason"][j]) == (a["cluster"][i], False, "exact")
    # chat sorts before web, so the conversation is the keeper and the web original is removed
    for j, (i, _) in enumerate(planted["chat"]):
        assert c["keep"][j] and c["cluster"][j] == a["cluster"][i]
        assert not a["keep"][i] and a["reason"][i] == "exact"
    clusters = planted["report"]["clusters"]
    assert clusters["spanning_sources"] == len(planted["chat"])
    assert clusters["spanning_shards"] >= len(planted["chat"]) + 100


def test_keep_lists_follow_the_contract(planted):
    for (source, shard), t in planted["keep"].items():
        n = len(t["doc"])
        assert t["doc"] == list(range(n))
        _cluster, keep = np.array(t["cluster"]), np.array(t["keep"])
        assert set(t["reason"]) <= {"keep", "exact", "near"}
        assert all((r == "keep") == k for r, k in zip(t["reason"], keep))
        path = planted["root"] / "dedup" / "keep" / source / f"{shard}.parquet"
        meta = json.loads(pq.read_schema(path).metadata[b"tokenfarm"])
        assert (meta["source"], meta["shard"], meta["stage"]) == (source, shard, "dedup")
    allc = np.concatenate([np.array(t["cluster"]) for t in planted["keep"].values()])
    allk = np.concatenate([np.array(t["keep"]) for t in planted["keep"].values()])
    kept_clusters, counts = np.unique(allc[allk], return_counts=True)
    assert (counts == 1).all() and set(kept_clusters) == set(allc)  # exactly one keeper per cluster


def test_report_counts_agree_with_keep_lists(planted):
    rep = planted["report"]
    removed = sum(1 for t in planted["keep"].values() for k in t["keep"] if not k)
    assert rep["total"]["removed_documents"] == removed
    assert rep["total"]["exact"] + rep["total"]["near"] == removed
    assert rep["per_source"]["chat"]["removed_documents"] == 0
    members = sum(int(size) * n for size, n in rep["clusters"]["size_histogram"].items())
    assert members == removed + rep["clusters"]["with_duplicates"]
    for source in ("web", "chat"):
        removed_tokens = 0
        for (s, shard), t in planted["keep"].items():
            if s == source:
                spans = np.diff(np.load(planted["root"] / "tokens" / s / f"{shard}.idx.npy"))
                removed_tokens += int(spans[~np.array(t["keep"])].sum())
        assert rep["per_source"][source]["removed_tokens"] == removed_tokens


def test_keepers_are_deterministic(planted, tmp_path):
    root = planted["root"]
    sigs = sorted((root / "dedup" / "sig").glob("*/*.parquet"), reverse=True)  # another input order
    params = rule_params(make_config(), "dedup")
    dedup.run_clusters(sigs, tmp_path, tmp_path / "report.json", params)
    for source, shard in planted["keep"]:
        again = pq.read_table(tmp_path / "keep" / source / f"{shard}.parquet").to_pydict()
        assert again == planted["keep"][(source, shard)]


def test_partition_count_does_not_change_clusters(planted, tmp_path):
    sigs = sorted((planted["root"] / "dedup" / "sig").glob("*/*.parquet"))
    report = dedup.run_clusters(sigs, tmp_path, tmp_path / "r.json", rule_params(make_config(partitions=5), "dedup"))
    for source, shard in planted["keep"]:
        t = pq.read_table(tmp_path / "keep" / source / f"{shard}.parquet").to_pydict()
        assert t == planted["keep"][(source, shard)]
    assert report["candidates"] == planted["report"]["candidates"]


def test_disabled_keeps_every_document(planted, tmp_path):
    root = planted["root"]
    sigs = sorted((root / "dedup" / "sig").glob("*/*.parquet"))
    params = rule_params(make_config(enabled=False), "dedup")
    report = dedup.run_clusters(sigs, tmp_path, tmp_path / "report.json", params)
    clusters = []
    for source, shard in planted["keep"]:
        t = pq.read_table(tmp_path / "keep" / source / f"{shard}.parquet").to_pydict()
        assert all(t["keep"]) and set(t["reason"]) == {"keep"}
        clusters += t["cluster"]
    assert len(set(clusters)) == len(clusters)
    assert report["total"]["removed_documents"] == 0


def test_exact_only_still_catches_variants_but_not_near(planted, tmp_path):
    sigs = sorted((planted["root"] / "dedup" / "sig").glob("*/*.parquet"))
    report = dedup.run_clusters(sigs, tmp_path, tmp_path / "r.json", rule_params(make_config(near=False), "dedup"))
    assert report["total"]["near"] == 0
    assert report["total"]["exact"] == planted["report"]["total"]["exact"]


# ----------------------------------------------------------------------------- failures

def test_missing_text_column_fails_clearly(tmp_path):
    raw = write_text_shard(tmp_path / "raw" / "web" / "s.parquet", ["a b c"], column="body")
    tok = tmp_path / "tokens" / "web" / "s.json"
    write_token_index(tok, [0], [4], "web", "s")
    with pytest.raises(PipelineError, match="no column 'text'.*text_column"):
        params = rule_params(make_config(), "dedup_signatures")
        dedup.write_signatures(raw, tok, "web", "s", params, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_token_index_naming_missing_rows_fails(tmp_path):
    raw = write_text_shard(tmp_path / "raw" / "web" / "s.parquet", ["a b c"])
    tok = tmp_path / "tokens" / "web" / "s.json"
    write_token_index(tok, [0, 5], [4, 4], "web", "s")
    with pytest.raises(PipelineError, match="rerun the tokenize stage"):
        params = rule_params(make_config(), "dedup_signatures")
        dedup.write_signatures(raw, tok, "web", "s", params, tmp_path / "out.parquet")


def test_corrupt_shard_fails_clearly(tmp_path):
    raw = tmp_path / "raw" / "web" / "s.parquet"
    raw.parent.mkdir(parents=True)
    raw.write_bytes(b"PAR1 not really")
    tok = tmp_path / "tokens" / "web" / "s.json"
    write_token_index(tok, [0], [4], "web", "s")
    with pytest.raises(PipelineError, match="s.parquet"):
        params = rule_params(make_config(), "dedup_signatures")
        dedup.write_signatures(raw, tok, "web", "s", params, tmp_path / "out.parquet")


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_texts_hash_as_the_whole_column(tmp_path, chat):
    """Signatures read the text one record batch at a time: batches of 2 rows, with rows that are not
    documents between and at their edges, give the texts and hashes of the whole column at once."""
    docs = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + 3 * i)) for i in range(9)]
    raw, tok, _, _ = add_shard(tmp_path, "web", "s", docs, chat=chat)
    source = make_config()["sources"]["chat" if chat else "web"]
    rows = [1, 2, 4, 5, 6, 9]  # row 0 is add_shard's empty row; 3, 7, 8 are skipped here too
    chunks = list(contract.iter_document_texts(raw, source, rows, batch_rows=2))
    assert [len(c) for c in chunks] == [1, 1, 2, 1, 1]  # rows 0-1, 2-3, 4-5, 6-7, 8-9
    whole = pa.concat_arrays(chunks)

    def text(doc: str) -> str:  # add_shard splits a chat document over a user and an assistant message
        w = doc.split(" ")
        return " ".join(w[:len(w) // 2]) + "\n" + " ".join(w[len(w) // 2:]) if chat else doc
    assert whole.to_pylist() == [text(docs[r - 1]) for r in rows]
    assert contract.document_texts(raw, source, rows).equals(whole)
    dd = rule_params(make_config(), "dedup_signatures")["dedup"]
    streamed, at_once = dedup.hash_documents(iter(chunks), dd, len(rows)), dedup.hash_documents(whole, dd)
    assert all(np.array_equal(streamed[k], at_once[k]) for k in ("exact", "bands", "sig"))
    assert len(set(streamed["exact"].tolist())) == len(rows)
    with pytest.raises(PipelineError, match="not ascending"):
        list(contract.iter_document_texts(raw, source, [2, 1]))


def test_stale_signatures_fail_clearly(tmp_path):
    shards = [add_shard(tmp_path, "web", "s", ["one two three four five six", "seven eight"])]
    run_dedup(tmp_path, shards, make_config())
    sig = tmp_path / "dedup" / "sig" / "web" / "s.parquet"
    params = rule_params(make_config(num_perm=60, bands=10, rows=6), "dedup")
    with pytest.raises(PipelineError, match="rerun dedup_signatures"):
        dedup.run_clusters([sig], tmp_path / "o", tmp_path / "o" / "r.json", params)
    assert not (tmp_path / "o" / "keep").exists()


def test_empty_shard_gets_an_empty_keep_list(tmp_path):
    shards = [add_shard(tmp_path, "web", "empty", []), add_shard(tmp_path, "web", "full", ["a b c", "a b c"])]
    keep, report = run_dedup(tmp_path, shards, make_config())
    assert keep[("web", "empty")]["doc"] == []
    assert keep[("web", "full")]["keep"] == [True, False]
    assert report["total"]["documents"] == 2


def test_cli_signatures_and_clusters(tmp_path):
    raw, tok, _, _ = add_shard(tmp_path, "web", "s", ["The same text.", "the SAME text", "other words here"])
    cfg = make_config()
    sig = tmp_path / "sig" / "web" / "s.parquet"
    dedup.main(["signatures", "--params", json.dumps(rule_params(cfg, "dedup_signatures")), "--inputs", str(raw),
                "--tokens", str(tok), "--source", "web", "--outputs", str(sig)])
    t = pq.read_table(sig)
    assert t.column_names == ["doc", "tokens", "exact", "bands", "sig"]
    assert t.schema.field("sig").type == pa.list_(pa.uint32(), 120)
    dedup.main(["clusters", "--params", json.dumps(rule_params(cfg, "dedup")), "--inputs", str(sig),
                "--outdir", str(tmp_path / "d"), "--report", str(tmp_path / "d" / "report.json")])
    keep = pq.read_table(tmp_path / "d" / "keep" / "web" / "s.parquet").to_pydict()
    assert keep["keep"] == [True, False, True] and keep["reason"] == ["keep", "exact", "keep"]
