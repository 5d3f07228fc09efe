"""Each filter alone, at the published defaults, against datatrove 0.10.1's on a broad generated corpus.

Dev-only (datatrove and spaCy are dev dependencies): tests/data/broad_corpus.py's documents of every kind go
through one of our filters and through datatrove's corresponding step; the keep/drop decisions (PII: the
scrubbed text; C4: the kept text too) must agree on >= 99.5 % of documents per filter. Language ID runs
datatrove's ``LanguageFilter`` logic on our lid.176.ftz (its own lid.176.bin is a run-time download). The
word splitter is checked against spaCy itself on every distinct whitespace-free chunk of the corpus, and the
shipped tables (pipeline/data/word_tables.json) against the installed spaCy and datatrove.
"""
from __future__ import annotations

import collections
import time

import numpy as np
import pytest
from broad_corpus import CATEGORIES, broad_corpus

from pipeline.data import text_filters as F

pytestmark = pytest.mark.slow  # parity with datatrove on generated corpora, not unit tests

pytest.importorskip("datatrove", reason="dev-only: datatrove 0.10.1 is the oracle (pip install -e '.[dev]')")
pytest.importorskip("spacy", reason="dev-only: datatrove's English word tokenizer is spaCy's (pip install -e '.[dev]')")

MIN_AGREEMENT = 0.995


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, str]]:
    return broad_corpus()


def _datatrove_step(name: str):
    """A function text -> (kept, text) running datatrove's step for our filter ``name``."""
    from datatrove.data import Document
    from datatrove.pipeline import filters as dtf
    from datatrove.pipeline.formatters import PIIFormatter

    if name == "pii":
        return lambda text: (True, PIIFormatter().format(text))  # fresh: placeholders cycle per document
    if name == "language":
        import datatrove.pipeline.filters.language_filter as lf

        class NumpyScores:  # fasttext-predict returns floats where datatrove expects fasttext's numpy arrays
            def predict(self, text, k=1):
                labels, scores = F._fasttext_model(F._lid_model_path()).predict(text, k=k)
                return labels, np.asarray(scores)

        saved = lf.LanguageFilter._requires_dependencies
        lf.LanguageFilter._requires_dependencies = []  # `fasteners` guards only the model download
        try:
            step = lf.LanguageFilter(languages=["en"])
        finally:
            lf.LanguageFilter._requires_dependencies = saved
        step.model._model = NumpyScores()
    else:
        step = {"gopher_repetition": dtf.GopherRepetitionFilter, "gopher_quality": dtf.GopherQualityFilter,
                "c4": dtf.C4QualityFilter, "fineweb_quality": dtf.FineWebQualityFilter}[name]()

    def run(text: str) -> tuple[bool, str]:
        doc = Document(text=text, id="0")
        try:
            kept = step.filter(doc) is True
        except ZeroDivisionError:  # FineWeb on a document without words; we remove it
            kept = False
        return kept, doc.text

    return run


@pytest.mark.parametrize("name", ["gopher_repetition", "gopher_quality", "c4", "fineweb_quality", "pii", "language"])
def test_each_filter_agrees_with_datatrove(corpus, name):
    docs = [text for _, text in corpus]
    reference = _datatrove_step(name)
    chain = F.build_chain([{"name": name}])
    F.run_chain(docs[:50], chain)  # load tables and model outside the timing
    t = time.process_time()
    ours = F.run_chain(docs, chain)
    ours_s = time.process_time() - t
    t = time.process_time()
    theirs = [reference(d) for d in docs]
    theirs_s = time.process_time() - t
    if name == "pii":
        differ = [i for i, (_, text) in enumerate(theirs) if ours.text[i] != text]
    else:
        differ = [i for i, (kept, _) in enumerate(theirs) if bool(ours.kept[i]) != kept]
    agreement = 1 - len(differ) / len(docs)
    detail = [(corpus[i][0], ours.reason(i) or "kept", docs[i][:100]) for i in differ[:20]]
    print(f"{name}: agreement {agreement:.4f} over {len(docs)} documents "
          f"({dict(collections.Counter(corpus[i][0] for i in differ))}); ours {ours_s:.2f} CPU-s, "
          f"datatrove {theirs_s:.2f} CPU-s")
    assert agreement >= MIN_AGREEMENT, detail
    # The corpus is not trivially all kept or all removed for a removing filter.
    if name != "pii":
        assert 0.05 < ours.kept.mean() < 0.95, ours.kept.mean()
    if name == "c4":  # the kept text: the same lines removed, the citations stripped
        same = [i for i, (kept, _) in enumerate(theirs) if kept and ours.kept[i]]
        assert all(ours.text[i] == theirs[i][1] for i in same)


def test_corpus_covers_every_category(corpus):
    counts = collections.Counter(cat for cat, _ in corpus)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 150, counts
    texts = [t for _, t in corpus]
    for probe in ("$$$", "!!!", "😀", "```", "| ", "https://", "猫", "ال", "ש", "«"):
        assert any(probe in t for t in texts), probe
    assert max(max(map(len, t.split("\n"))) for t in texts) > 10_000  # very long lines
    assert broad_corpus(50, seed=0) == corpus[:50]  # deterministic


def test_words_are_spacys_on_every_chunk(corpus):
    import spacy

    nlp = spacy.blank("en")
    chunks = sorted({c for _, text in corpus for c in text.split()})
    differ = [c for c in chunks if F.words(c) != [t.text for t in nlp(c)]]
    assert not differ, differ[:20]
    # Whole documents: whitespace tokens dropped, as datatrove's strip_strings does.
    for _, text in corpus[:300]:
        assert F.words(text) == [t.text.strip() for t in nlp(text) if t.text.strip()]


def test_sentences_are_spacys(corpus):
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    lines = sorted({ln.strip() for _, text in corpus[:1400] for ln in text.splitlines() if ln.strip()})
    differ = [ln for ln in lines if F.sentences(ln) != len(list(nlp(ln).sents))]
    assert not differ, differ[:10]


def test_shipped_tables_are_the_installed_versions():
    import json

    from word_tables import TABLES, build_tables

    assert json.loads(TABLES.read_text(encoding="utf-8")) == build_tables(), (
        "pipeline/data/word_tables.json is stale: PYTHONPATH=. python tests/data/word_tables.py")
