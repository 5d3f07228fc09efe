"""Language ID in numpy (pipeline/data/lid.py) against fasttext-predict on the same lid.176.ftz.

fasttext-predict runs fastText's own C++ on each text (as one line, newlines as spaces); pipeline.data.lid reads
the model file and computes the same prediction from cached per-word row sums. The top label must be the same on
every text and its probability within 1e-4 (the sums are float64 where fastText's are float32, so they differ in
the last digits); every label fastText returns with k=-1 must come back with its probability. The texts: the
broad corpus (tests/data/broad_corpus.py), the sample's shards (web, crawl, chat), the language filter's own
samples of long documents, and hand-made edge cases (empty and whitespace-only lines, NUL and the other
whitespace bytes, a word "</s>", "__label__" words, emoji, CJK and RTL text, code, very long words and lines).
"""
from __future__ import annotations

import glob

import numpy as np
import pyarrow.parquet as pq
import pytest
from broad_corpus import broad_corpus
from filter_corpora import ROOT, raw_web, sample_web

from pipeline.data import lid
from pipeline.data import text_filters as F
from pipeline.data.contract import doc_text

EDGE = [
    "", " ", "\n", "\n\n  \t ", "\x00", "\x0b\x0c\r", "hello", "hello world", "bonjour le monde",
    "hello\x00bonjour le monde", "hello\x01bonjour le monde", "hello\x1cbonjour\x85le\xa0monde\u2028ici",
    "hello </s> bonjour le monde", "</s>", "a</s> b", "__label__en hello", "__label__fr", "__label__zz x y",
    "日本語のテキストです。", "这是一个中文句子，没有空格。", "한국어 문장입니다.",
    "مرحبا بالعالم", "שלום עולם", "سلام دنیا",
    "😀 🇫🇷 👩‍👩‍👧 👍🏽", "def f(x):\n    return x ** 2  # square\n", "SELECT * FROM t WHERE a = 1;",
    "x" * 5000, "ab" * 20000, " ".join(["lorem"] * 3000), "\u00e9" * 300 + " caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "\U0001f600" * 50, "a\tb\nc\rd\ve\ff", "Ünïcödé wörds ünd ëmöjï 🎉 mixed with English words here",
    "1234567890 12345678901234567 123456789012345678901234567890", "ok " * 100 + "très bien " * 100,
]


@pytest.fixture(scope="module")
def models():
    return lid.load(F._lid_model_path()), F._fasttext_model(F._lid_model_path())


def _texts() -> dict[str, list[str]]:
    files = sorted(glob.glob(str(ROOT / "data/sample/*/*.parquet")))
    crawl = [t for f in files if "/crawl/" in f for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    chat = [doc_text(m) for f in files if "/chat/" in f
            for m in pq.read_table(f, columns=["messages"]).column("messages").to_pylist()]
    web = sample_web()
    return {"edge": EDGE, "broad": [t for _, t in broad_corpus()], "web": web[::6], "crawl": crawl,
            "chat": chat[::8], "raw": raw_web(200),
            "samples": [F._spread(t, c, w) for t in web[1::6] for c, w, _ in F.LID_STAGES if len(t) > c * 3 // 2]}


def test_top_label_and_score_as_fasttext_predict(models):
    ours, ref = models
    for name, texts in _texts().items():
        got = ours.predict_many(texts)
        assert got[0] == ours.predict(texts[0])
        same = diff = 0
        worst = 0.0
        for text, (labels, scores) in zip(texts, got):
            want_labels, want_scores = ref.predict(text.replace("\n", " "), k=1)
            if labels != want_labels:
                diff += 1
                continue
            same += 1
            worst = max(worst, abs(scores[0] - want_scores[0]))
        print(f"{name}: {same} of {len(texts)} top labels as fasttext-predict's; largest score difference {worst:.2g}")
        assert diff == 0 and worst < 1e-4, name


def test_every_label_as_fasttext_predict(models):
    ours, ref = models
    texts = EDGE + [t for _, t in broad_corpus(400, seed=1)]
    for text in texts:
        labels, scores = ours.predict(text, k=-1)
        want_labels, want_scores = ref.predict(text.replace("\n", " "), k=-1)
        assert set(labels) == set(want_labels), text[:60]
        want = dict(zip(want_labels, want_scores))
        assert max(abs(s - want[label]) for label, s in zip(labels, scores)) < 1e-4, text[:60]
        assert list(scores) == sorted(scores, reverse=True)


def test_labels_from_the_model_file(models):
    ours, ref = models
    assert len(ours.labels) == 176 and len(set(ours.labels)) == 176
    assert set(ref.predict("", k=-1)[0]) <= set(ours.labels)  # fastText leaves out labels under 1e-5
    assert F.lid_languages() == {label.removeprefix("__label__") for label in ours.labels}


def test_the_cache_changes_no_result(models, monkeypatch):
    """Batches, a cold or warm cache and a cache emptied when full give the same sums and predictions."""
    ours, _ = models
    texts = [t for _, t in broad_corpus(300, seed=2)] + EDGE
    ours.clear()
    cold = ours.line_sums(texts)
    warm = ours.line_sums(texts)
    one_by_one = np.array([ours.line_sums([t])[0] for t in texts])
    assert np.array_equal(cold, warm) and np.array_equal(cold, one_by_one)
    monkeypatch.setattr(lid, "CACHE_WORDS", 500)  # emptied many times over
    ours.clear()
    small = ours.line_sums(texts)
    assert ours._n <= 500
    assert np.array_equal(cold, small)
    monkeypatch.setattr(lid, "_CHUNK_BYTES", 4096)
    assert np.array_equal(cold, ours.line_sums(texts))
    assert ours.predict_many(texts) == [ours.predict(t) for t in texts]


def test_word_rows_as_fasttext_computes_them(models):
    """A word's rows: its dictionary id's and the pruned index's rows of the FNV-1a hashes (signed bytes) of
    its character 2..4-grams of "<word>", written out here byte by byte."""
    ours, _ = models

    def fnv(b: bytes) -> int:
        h = 2166136261
        for c in b:
            h = ((h ^ (c if c < 128 else c | 0xFFFFFF00)) * 16777619) & 0xFFFFFFFF
        return h

    def rows(word: str) -> np.ndarray:
        s, out = f"<{word}>", []
        if ours.word_id.get(word.encode(), -1) >= 0:
            out.append(ours.word_id[word.encode()])
        for i in range(len(s)):
            for n in range(ours.minn, ours.maxn + 1):
                if i + n <= len(s):
                    r = ours._bucket_row[fnv(s[i:i + n].encode()) % ours.bucket]
                    out += [r] if r >= 0 else []
        return np.append(ours._rows[out].sum(axis=0), len(out))

    words = ["the", "hello", "world", "café", "naïve", "日本語", "😀x", "a", "ab", "ünïcödé", "straße", "x" * 40]
    got = ours.word_rows([w.encode() for w in words])
    for w, g in zip(words, got):
        assert np.allclose(g, rows(w), rtol=0, atol=1e-12), w
