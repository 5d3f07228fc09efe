"""Documents for the filter tests and benchmark: the sample's web shards, a raw-web-like set, threshold sweeps.

Shared by tests/data/test_filters.py (agreement with datatrove) and benchmarks/filters.py (speed).
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import random
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]

# Plain English prose lines that pass every filter: the threshold sweeps and the report tests build on them.
PROSE = [
    "The river that runs through the old town has been a source of water and trade for centuries.",
    "Farmers brought their grain to the market by boat, and merchants built warehouses along the banks.",
    "In the spring the water rises quickly, so the people who live there have learned to build on stilts.",
    "A stone bridge was finished in the last century to connect the two halves of the growing city.",
    "Today the quays are lined with cafes, and tourists come to watch the boats pass under the arches.",
    "Local historians have collected letters and maps that describe how the harbour changed over time.",
    "Some of the oldest houses still have iron rings in their walls where ropes were once tied.",
    "The museum near the cathedral keeps a model of the port as it looked before the great flood.",
    "Children learn about the river at school, and many of them spend their summers swimming in it.",
    "Engineers are now studying how to protect the banks from erosion without harming the wildlife.",
    "Every autumn a festival celebrates the harvest with music, food and a parade of decorated barges.",
    "Visitors who stay longer often take the ferry downstream to the villages and vineyards by the sea.",
]


def sample_web() -> list[str]:
    """Every document of data/sample/web/*.parquet (FineWeb-shaped: already filtered upstream)."""
    return [t for f in sorted(glob.glob(str(ROOT / "data/sample/web/*.parquet")))
            for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]


@functools.cache
def sample_builder():
    """scripts/build_sample_corpus.py as a module (the sample corpus's builder, whose raw-web generator makes the
    sample's crawl/ source too)."""
    spec = importlib.util.spec_from_file_location("build_sample_corpus", ROOT / "scripts" / "build_sample_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def raw_web(n: int = 400, seed: int = 0) -> list[str]:
    """Raw-crawl-like pages (`raw_web_pages` of the sample builder: menus, lorem ipsum, javascript, spam lists,
    repeated lines, bullets, non-Latin script, e-mail and IP addresses) around prose lines of the sample's
    first 300 web documents (seeded)."""
    b = sample_builder()
    return b.raw_web_pages(b.prose_lines(sample_web()[:300]), n, random.Random(seed))


def _sentences(rng: random.Random, k: int) -> list[str]:
    words = ("the of and to in that have with be it for not on as you do at this but his by from they we say "
             "her she or an will my one all would there their what so up out if about who get which go me when make "
             "can like time no just him know take people into year your good some could them see other than then "
             "now look only come its over think also back after use two how our work first well way even new want "
             "because any these give day most us river mountain history science language market").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(k)]


def threshold_sweeps(seed: int = 0) -> list[str]:
    """For every rule, documents whose measured value steps across its threshold, plus empty/one-word ones."""
    rng = random.Random(seed)
    b = sample_builder()
    docs = ["", " ", "\n", "word", "Word.", "the and", "#", "...", b.RUSSIAN, b.CHINESE, "a\n\nb",
            "{}", "lorem ipsum"]
    base = _sentences(rng, 40)
    for k in range(0, 21):  # duplicated lines / paragraphs / line characters
        lines = base[:20] + [base[0]] * k
        docs += ["\n".join(lines), "\n\n".join(lines)]
    for k in range(0, 30, 2):  # a repeated phrase: top 2-4-gram and duplicated 5-10-gram fractions
        docs.append(" ".join(base[:10]) + (" market river history science") * k)
        docs.append("\n".join(base[:12] + [" ".join(base[3:3 + k // 4 + 1])] * (k // 6 + 1)))
    for n in range(40, 60):  # word count around 50
        docs.append(" ".join((" ".join(base)).split()[:n]) + ".")
    for length in range(1, 14):  # mean word length around 3 and 10
        docs.append(" ".join(["the", "and", "x" * length] * 25) + ".")
    for k in range(0, 16):  # hashes and ellipses per word around 0.1
        docs.append(" ".join(base[:10]) + " #tag" * k)
        docs.append(" ".join(base[:10]) + " wait..." * k)
    for k in range(0, 21):  # bullet lines around 90 %, ellipsis lines around 30 %
        docs.append("\n".join(("- " if i < k else "") + s for i, s in enumerate(base[:20])))
        docs.append("\n".join(s[:-1] + ("..." if i < k else ".") for i, s in enumerate(base[:20])))
    for k in range(0, 40, 2):  # words without letters around 20 %
        docs.append(" ".join(base[:8]) + " 42" * k)
    for k in range(0, 4):  # stop words
        docs.append(" ".join(["Alpha", "beta", "gamma", "delta", "epsilon"] * 12 + ["the", "of", "and"][:k]))
    for k in range(2, 9):  # C4: sentences left, lines removed
        docs.append("\n".join(base[:k]))
        docs.append("\n".join(base[:k] + ["Menu", "Home About", "enable javascript please now.",
                                          "Our privacy policy applies here.", "x" * 1001 + " end."]))
        docs.append(" ".join(base[:k]) + " Mr. Smith and Dr. Who went to the U.S. on Jan. 5. It was fine.")
    for k in range(0, 21):  # FineWeb: punctuated lines around 12 %, short lines around 67 %, newlines per word
        docs.append("\n".join(s if i < k else s[:-1] for i, s in enumerate(base[:20])))
        docs.append("\n".join(s if i >= k else "Short line." for i, s in enumerate(base[:20])))
        docs.append(" ".join(base[:3]) + "\n" + "\n".join("word." for _ in range(k)))
    return docs
