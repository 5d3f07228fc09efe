"""The raw-web-text filters (pipeline/data/text_filters.py): decisions, config errors, agreement with datatrove.

Agreement: datatrove 0.10.1's GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter,
FineWebQualityFilter and PIIFormatter run, in that order, beside our chain on the same documents: a slice
of the sample's web shards, a raw-web-like set and threshold sweeps (tests/data/filter_corpora.py). The
keep/drop decisions must agree on >= 99.5 % of documents. Words and sentences are split as datatrove's
spaCy tokenizer splits them (`filters.words`, `filters.sentences`); each filter alone is compared on a
broad generated corpus in tests/data/test_filter_agreement.py (dev-only, like this file's datatrove test).
Language ID is checked on hand-made examples and against itself on whole documents (its bounded sample).
"""
from __future__ import annotations

import random
import time

import pytest
from broad_corpus import broad_corpus
from filter_corpora import PROSE, raw_web, sample_web, threshold_sweeps

from pipeline.data import text_filters as F
from pipeline.errors import ConfigError

NO_LANG = [{"name": n} for n in ("gopher_repetition", "gopher_quality", "c4", "fineweb_quality", "pii")]




def _prose(n: int = 12) -> str:
    return "\n".join(PROSE[:n])


def test_kept_document_and_decision_columns():
    res = F.run_chain([_prose()], F.build_chain())
    assert res.kept.tolist() == [True] and res.reason(0) == ""
    assert res.language == ["en"] and res.language_score[0] > 0.65
    assert res.lines_removed[0] == 0 and res.spans_replaced[0] == 0


def test_removal_names_filter_rule_and_measured_value():
    text = "\n".join(["Same line repeated here, with the words of the day."] * 6 + _prose(4).split("\n"))
    res = F.run_chain([text], F.build_chain(NO_LANG))
    assert not res.kept[0]
    assert (res.filter[0], res.rule[0]) == ("gopher_repetition", "dup_line_frac")
    assert res.value[0] == pytest.approx(5 / 10) and res.threshold[0] == 0.3
    assert res.reason(0) == "gopher_repetition: dup_line_frac 0.5 > 0.3"


def test_ngram_rules_hand_computed():
    text = " ".join(["aa", "bb"] * 3 + ["cc"])  # 20 characters; "aa bb" three times = 15 characters
    res = F.run_chain([text], F.build_chain([{"name": "gopher_repetition"}]))
    assert (res.rule[0], res.value[0]) == ("top_2_gram_char_frac", pytest.approx(15 / 20))
    # 12 words aa bb ...: the 5-gram at 2 repeats the one at 0 (10 characters), the scan skips to 7, whose
    # 5-gram repeats the one at 1 (10 more): 20 of 35 characters.
    only_5 = {"top_n_grams": {}, "dup_n_grams": {5: 0.15}}
    res = F.run_chain([" ".join(["aa", "bb"] * 6)], F.build_chain([{"name": "gopher_repetition", "settings": only_5}]))
    assert (res.rule[0], res.value[0]) == ("dup_5_gram_char_frac", pytest.approx(20 / 35))


def test_c4_sentences_and_fineweb_ratios_hand_computed():
    four = "One sentence here. Two sentences here! Mr. Smith said three? Yes, four of them."
    res = F.run_chain([four], F.build_chain([{"name": "c4"}]))
    assert (res.rule[0], res.value[0]) == ("sentences", 4)  # "Mr." ends no sentence
    lines = "\n".join(["A line that ends with a full stop and is long."] + [f"menu item {i}" for i in range(9)])
    res = F.run_chain([lines], F.build_chain([{"name": "fineweb_quality"}]))
    assert (res.rule[0], res.value[0]) == ("line_punct_ratio", pytest.approx(0.1))


def test_c4_removes_lines_and_pii_counts_spans():
    text = _prose(6) + "\nHome | About\nPlease enable javascript to see this page now.\nMail bob@corp.com or 8.8.8.8."
    res = F.run_chain([text], F.build_chain([{"name": "c4"}, {"name": "pii"}]))
    assert res.kept[0] and res.lines_removed[0] == 2
    assert res.spans_replaced[0] == 2
    assert "email@example.com" in res.text[0] and "22.214.171.124" in res.text[0]
    assert "javascript" not in res.text[0] and "Home" not in res.text[0]


def test_private_ips_are_kept():
    res = F.run_chain(["host 192.168.1.1 and 10.0.0.1 and 8.8.4.4"], F.build_chain([{"name": "pii"}]))
    assert res.text[0] == "host 192.168.1.1 and 10.0.0.1 and 22.214.171.124" and res.spans_replaced[0] == 1


def test_chat_documents_are_never_line_filtered():
    text = _prose(6) + "\nuser: hi\nassistant: Use a dict such as {1: 2} for that, it is simple."
    chain = F.build_chain([{"name": "c4"}])
    assert not F.run_chain([text], chain).kept[0]  # the curly bracket removes the web document
    res = F.run_chain([text], chain, chat=True)
    assert res.kept[0] and res.text[0] == text and res.lines_removed[0] == 0


def test_every_filter_switches_off_and_rules_take_null():
    junk = "lorem ipsum {"
    assert not F.run_chain([junk], F.build_chain(NO_LANG)).kept[0]
    off = [{"name": e["name"], "enabled": False} for e in NO_LANG]
    assert F.run_chain([junk], F.build_chain(off)).kept[0]
    short = "Few words here."
    assert not F.run_chain([short], F.build_chain([{"name": "gopher_quality"}])).kept[0]
    nulls = {k: None for k in ("min_doc_words", "min_avg_word_length", "min_stop_words", "min_alpha_words_ratio")}
    assert F.run_chain([short], F.build_chain([{"name": "gopher_quality", "settings": nulls}])).kept[0]


def test_language_id_hand_checked():
    texts = ["The cat sat on the mat and looked out of the window at the rain.",
             "Le chat est assis sur le tapis et regarde la pluie par la fenêtre.",
             "Die Katze sitzt auf der Matte und schaut aus dem Fenster in den Regen.",
             "猫はマットの上に座って、窓の外の雨を見ていた。"]
    res = F.run_chain(texts, F.build_chain([{"name": "language"}]))
    assert res.language == ["en", "fr", "de", "ja"]
    assert res.kept.tolist() == [True, False, False, False]
    assert res.rule[1] == "language_fr" and res.reason(1).startswith("language: language_fr (score")
    both = F.run_chain(texts, F.build_chain([{"name": "language", "settings": {"languages": ["fr", "de"]}}]))
    assert both.kept.tolist() == [False, True, True, False]
    low = F.run_chain(texts[:1], F.build_chain([{"name": "language", "settings": {"min_score": 1.0}}]))
    assert low.rule[0] == "language_score" and not low.kept[0]


@pytest.mark.parametrize("spec, key", [
    ([{"name": "gopher_qualty"}], r"filter\[0\]\.name: unknown filter 'gopher_qualty'"),
    ([{"name": "c4"}, {"name": "gopher_repetition", "settings": {"dup_line_frac": 1.5}}],
     r"filter\[1\]\.settings\.dup_line_frac: 1\.5 is outside 0\.\.1"),
    ([{"name": "gopher_quality", "settings": {"min_doc_words": 2.5}}], r"min_doc_words: 2\.5 is not an integer"),
    ([{"name": "pii", "settings": {"remove_email": True}}], r"settings\.remove_email: unknown setting of pii"),
    ([{"name": "language", "settings": {"languages": ["en", "xx"]}}], r"languages: xx unknown to the lid\.176"),
    ([{"name": "fasttext_classifier", "settings": {"path": "/nonexistent.bin", "label": "hq"}}],
     r"settings\.path: classifier file '/nonexistent\.bin' not found"),
    ([{"name": "fasttext_classifier", "settings": {"label": "hq"}}], r"settings\.path: required"),
    (["c4"], r"filter\[0\]: give \{name"),
])
def test_bad_config_is_one_error_naming_the_key(spec, key):
    with pytest.raises(ConfigError, match=key):
        F.build_chain(spec)


def test_fasttext_classifier_hook(tmp_path):
    # fasttext-predict cannot train; the bundled lid.176 model stands in for a user's supervised classifier.
    chain = F.build_chain([{"name": "fasttext_classifier",
                            "settings": {"path": str(F._lid_model_path()), "label": "en", "min_score": 0.5}}])
    res = F.run_chain(["The cat sat on the mat.", "Le chat est assis sur le tapis."], chain)
    assert res.kept.tolist() == [True, False] and res.rule[1] == "score_en" and res.value[1] < 0.5


# ------------------------------------------------------------------------------------ agreement with datatrove


def _datatrove_chain():
    pytest.importorskip("datatrove")
    pytest.importorskip("spacy")  # datatrove's English word tokenizer
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter

    steps = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter()]

    def run(text: str) -> tuple[bool, str]:
        doc = Document(text=text, id="0")
        for step in steps:
            if step.filter(doc) is not True:
                return False, doc.text
        return True, PIIFormatter().format(doc.text)  # fresh: its placeholders cycle from the first per document

    return run


@pytest.mark.slow
def test_agreement_with_datatrove():
    reference = _datatrove_chain()
    parts = [sample_web()[::10], raw_web(300), threshold_sweeps()]
    docs = [d for part in parts for d in part]
    t = time.perf_counter()
    ours = F.run_chain(docs, F.build_chain(NO_LANG))
    ours_s = time.perf_counter() - t
    t = time.perf_counter()
    theirs = [reference(d) for d in docs]
    theirs_s = time.perf_counter() - t
    disagree = [i for i, (k, _) in enumerate(theirs) if bool(ours.kept[i]) != k]
    agreement = 1 - len(disagree) / len(docs)
    detail = [(ours.reason(i) or "kept", docs[i][:80]) for i in disagree]
    assert agreement >= 0.995, (agreement, detail)
    # Each corpus part has documents kept and removed, so the agreement is not trivially all-kept or all-removed.
    start = 0
    for part in parts:
        assert 0 < ours.kept[start:start + len(part)].sum() < len(part)
        start += len(part)
    # Kept documents carry the same text: C4's line removal and the PII placeholders agree.
    same = [i for i, (k, text) in enumerate(theirs) if k and ours.kept[i]]
    assert sum(ours.text[i] == theirs[i][1] for i in same) >= 0.99 * len(same)
    print(f"agreement {agreement:.4f} over {len(docs)} docs; ours {ours_s:.2f}s, datatrove {theirs_s:.2f}s")


# ------------------------------------------------------------------------------ exact and bounded shortcuts


def test_pii_skips_only_texts_its_expressions_cannot_match():
    """PII runs its e-mail expression only on text with an "@" and its IP expression only on text that the hint
    finds: the output equals running both expressions on every text."""
    pii = F.PII()

    def unconditional(text: str) -> str:
        n = 0

        def email(_m):
            nonlocal n
            n += 1
            return F.EMAIL_PLACEHOLDERS[(n - 1) % 2]

        text, k = F._EMAIL.sub(email, text), 0

        def ip(m):
            nonlocal k
            try:
                addr = F.ipaddress.ip_address(m.group(0))
            except ValueError:
                return m.group(0)
            if not addr.is_global:
                return m.group(0)
            k += 1
            return F.IP_PLACEHOLDERS[(k - 1) % len(F.IP_PLACEHOLDERS)]

        return F._IP.sub(ip, text)

    rng = random.Random(0)
    alphabet = "0123456789.@ ab-_[]:\n\t\xa0\u2003!#'"
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(6000)]
    fuzz += ["1.2.3.4", "8.8.8.8", "a 255.255.255.255 b", "999.1.1.1", "01.02.03.04", "x@y", "a@b.c", "١.٢.٣.٤",
             "8.8.8", "8.8.8.8.8", "user@[8.8.8.8]", "v1.2.3.4-rc",
             "a@b.co\xa0c@d.org", "x\u2003y@z.io@w.com", "@@a.b@c.de", "mail:joe@acme.com,ann@acme.com."]
    texts = fuzz + [t for _, t in broad_corpus(700)] + sample_web()[::20] + raw_web(100)
    skipped = 0
    for text in texts:
        _, out, _ = pii.edit(text)
        assert out == unconditional(text), text
        skipped += "@" not in text and not F._IP_HINT.search(text)
    assert skipped > len(texts) // 4  # the shortcut is taken on many texts


@pytest.mark.slow
def test_language_sample_decides_like_the_whole_document():
    """Language ID on a bounded sample of long documents (filters.LID_STAGES) keeps or removes the same
    documents as identification on the whole text, on >= 99.5 % of each corpus."""
    lang = F.Language()
    model = F._fasttext_model(F._lid_model_path())

    def whole(text: str) -> bool:
        labels, scores = F._top_label(model, text)
        return lang.judge(labels[0].removeprefix("__label__"), float(scores[0]), text) is None

    for name, docs in (("broad", [t for _, t in broad_corpus()]), ("sample", sample_web()), ("raw", raw_web(400))):
        sampled = F.run_chain(docs, [lang]).kept
        differ = [i for i, d in enumerate(docs) if bool(sampled[i]) != whole(d)]
        agreement = 1 - len(differ) / len(docs)
        print(f"{name}: {agreement:.4f} ({len(differ)} of {len(docs)})")
        assert agreement >= 0.995, (name, agreement, [docs[i][:80] for i in differ[:5]])
    long_docs = [d for d in sample_web() if len(d) > 6000]
    assert len(long_docs) > 100  # the sample path is exercised


def test_the_plan_prices_a_chain_as_the_sum_of_its_enabled_filters_rates():
    from pipeline.planning.data_cost import filter_cpu_s_per_mb, filter_rates

    rates = filter_rates()
    for r in [rates["base"], rates["words"], *rates["filters"].values()]:
        assert r["cpu_s_per_mb"] > 0 and r["command"].startswith("PYTHONPATH=. python benchmarks/filter_chain.py")
        assert r["date"] and r["machine"]
    rate = {name: r["cpu_s_per_mb"] for name, r in rates["filters"].items()}
    base, split = rates["base"]["cpu_s_per_mb"], rates["words"]["cpu_s_per_mb"]
    assert set(rate) == set(F.FILTERS)
    # the default chain: its filters' rates, and the word split once (its word-based filters share it)
    assert filter_cpu_s_per_mb(F.DEFAULT_CHAIN) == pytest.approx(base + split + sum(rate[e["name"]]
                                                                                   for e in F.DEFAULT_CHAIN))
    assert filter_cpu_s_per_mb([{"name": "c4"}]) == pytest.approx(base + split + rate["c4"])
    presets = [{"name": "language"}, {"name": "pii"}]
    assert filter_cpu_s_per_mb(presets) == pytest.approx(base + rate["language"] + rate["pii"])
    assert filter_cpu_s_per_mb(presets) < filter_cpu_s_per_mb(F.DEFAULT_CHAIN)
    off = [{"name": "language", "enabled": False}, {"name": "pii", "settings": {"enabled": False}}]
    assert filter_cpu_s_per_mb(off) == pytest.approx(base) == filter_cpu_s_per_mb([])
    assert filter_cpu_s_per_mb(F.build_chain(presets)) == filter_cpu_s_per_mb(presets)  # a built chain too
    with pytest.raises(ConfigError, match="no measured rate for filter 'gopher_qualty'"):
        filter_cpu_s_per_mb([{"name": "gopher_qualty"}])


def test_a_filter_job_is_priced_warm_plus_its_caches_fill():
    from pipeline.data.lid import CACHE_WORDS
    from pipeline.planning.data_cost import cache_misses, filter_fill_cpu_s, filter_rates

    rates = filter_rates()
    words, lang = rates["words"]["cache"], rates["filters"]["language"]["cache"]
    # the caps are the code's: the split's chunk cache and language ID's word cache
    assert (words["cap"], lang["cap"]) == (F._WordSplitter.MAX_CACHE, CACHE_WORDS)
    for c in (words, lang):
        assert c["cpu_s_per_key"] > 0 and c["keys_per_mb"] > 0 and 0 < c["beta"] < 1
        # Heaps' law while the keys fit; past the cap the misses grow linearly, continuous at the cap
        assert cache_misses(c, 1.0) == pytest.approx(c["keys_per_mb"])
        full = (c["cap"] / c["keys_per_mb"]) ** (1 / c["beta"])
        assert cache_misses(c, full * 0.999) == pytest.approx(c["cap"], rel=1e-3)
        assert cache_misses(c, 3 * full) == pytest.approx(3 * c["cap"])
        assert cache_misses(c, 0.5 * full) / cache_misses(c, 0.25 * full) == pytest.approx(2 ** c["beta"])
    # a chain fills the caches it uses: language ID's alone, the split's with any word-based filter
    mb = 200.0
    fill = {k: c["cpu_s_per_key"] * cache_misses(c, mb) for k, c in (("words", words), ("language", lang))}
    assert filter_fill_cpu_s([{"name": "pii"}], mb * 1e6) == 0
    assert filter_fill_cpu_s([{"name": "language"}, {"name": "pii"}], mb * 1e6) == pytest.approx(fill["language"])
    assert filter_fill_cpu_s([{"name": "c4"}], mb * 1e6) == pytest.approx(fill["words"])
    assert filter_fill_cpu_s(F.DEFAULT_CHAIN, mb * 1e6) == pytest.approx(fill["words"] + fill["language"])
    assert filter_fill_cpu_s([{"name": "language", "enabled": False}], mb * 1e6) == 0
