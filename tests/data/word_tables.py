"""Builds pipeline/data/word_tables.json from spaCy and datatrove (dev-only: both are dev dependencies).

    PYTHONPATH=. python tests/data/word_tables.py          # rewrite the file from the installed versions

The file holds what `pipeline.data.text_filters.words` and the sentence counter need to split text exactly as
datatrove's English `SpaCyTokenizer` does (``spacy.blank("en")`` plus its ``sentencizer``): the tokenizer's
prefix, suffix, infix and URL expressions, its special cases, the sentencizer's punctuation, and datatrove's
punctuation and terminal-punctuation sets. tests/data/test_word_split.py checks the file against them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "pipeline" / "data" / "word_tables.json"


def build_tables() -> dict:
    from importlib.metadata import version

    import spacy
    from datatrove.utils.text import PUNCTUATION_SET, TERMINAL_PUNCTUATION
    from spacy.attrs import ORTH

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    tok = nlp.tokenizer
    assert tok.token_match is None, "the port assumes English has no token_match"
    rules = {}
    for orth, subs in sorted(tok.rules.items()):
        rules[orth] = [s[ORTH] if ORTH in s else s["ORTH"] for s in subs]
        assert "".join(rules[orth]) == orth
    return {
        "source": f"spacy {spacy.__version__} blank('en') + sentencizer; datatrove {version('datatrove')}",
        "prefix": tok.prefix_search.__self__.pattern,
        "suffix": tok.suffix_search.__self__.pattern,
        "infix": tok.infix_finditer.__self__.pattern,
        "url": tok.url_match.__self__.pattern,
        "flags": [p.__self__.flags for p in (tok.prefix_search, tok.suffix_search, tok.infix_finditer, tok.url_match)],
        "rules": rules,
        "sentence_punct": "".join(sorted(nlp.get_pipe("sentencizer").punct_chars)),
        "punctuation": "".join(sorted(PUNCTUATION_SET)),
        "terminal": "".join(sorted(TERMINAL_PUNCTUATION)),
    }


if __name__ == "__main__":
    TABLES.write_text(json.dumps(build_tables(), ensure_ascii=False, indent=0, sort_keys=True) + "\n")
    print(f"wrote {TABLES} ({TABLES.stat().st_size:,} bytes)", file=sys.stderr)
