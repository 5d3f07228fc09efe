"""Filter-chain speed (issue 30 item 5): `pipeline.data.text_filters` versus datatrove on the same documents, one run.

    python benchmarks/filters.py [--input data/sample/web/*.parquet] [--raw 400] [--datatrove-docs 400]

Times (a) `run_chain` with the whole default chain — language ID, Gopher repetition, Gopher quality,
C4 (line and document removal), FineWeb quality, PII — over every input document plus ``--raw``
raw-web-like pages (tests/data/filter_corpora.py: menus, spam lists, repeats, e-mails...), versus (b)
datatrove 0.10.1's same chain (GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter,
FineWebQualityFilter, PIIFormatter, one `Document` per input) on the first ``--datatrove-docs`` of
the same documents, in the same process. datatrove's LanguageFilter needs lid.176.bin downloaded, so
(b) runs without language ID and (a) is timed both with it (the default chain) and without it (the
like-for-like ratio). One thread; documents and MB (UTF-8) per CPU-second of the process. The keep/drop
agreement of (a) without language ID and (b) on (b)'s documents is printed too. Target: (a) >= 3x (b).
"""
from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "data"))

from filter_corpora import raw_web  # noqa: E402

from pipeline.data import text_filters as F  # noqa: E402


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def _datatrove(docs: list[str]) -> list[bool]:
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter

    steps = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter()]
    pii = PIIFormatter()
    kept = []
    for i, text in enumerate(docs):
        doc = Document(text=text, id=str(i))
        ok = all(step.filter(doc) is True for step in steps)
        if ok:
            doc.text = pii.format(doc.text)
        kept.append(ok)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", default=sorted(glob.glob(str(ROOT / "data/sample/web/*.parquet"))))
    ap.add_argument("--raw", type=int, default=400)
    ap.add_argument("--datatrove-docs", type=int, default=400)
    args = ap.parse_args()
    docs = [t for f in args.input for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    docs += raw_web(args.raw)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    full, no_lang = F.build_chain(), F.build_chain([e for e in F.DEFAULT_CHAIN if e["name"] != "language"])
    F.run_chain(docs[:5], full)  # load the language model outside the timing

    def report(name: str, n: int, size: float, cpu: float, wall: float) -> float:
        print(f"{name:<38} {n:>6} docs {size:7.2f} MB  {n / cpu:9.1f} docs/CPU-s  {size / cpu:6.3f} MB/CPU-s"
              f"  ({cpu:.2f} CPU-s, {wall:.2f} s wall)")
        return n / cpu

    res, cpu, wall = _timed(lambda: F.run_chain(docs, full))
    report("tokenfarm default chain (with langid)", len(docs), mb, cpu, wall)
    print(f"  kept {int(res.kept.sum())}/{len(docs)}")
    _, cpu, wall = _timed(lambda: F.run_chain(docs, no_lang))
    ours = report("tokenfarm chain without langid", len(docs), mb, cpu, wall)

    sub = docs[:args.datatrove_docs] if args.datatrove_docs < len(docs) // 2 else docs
    if sub is not docs:  # an even spread of the sample and the raw pages
        step = len(docs) / args.datatrove_docs
        sub = [docs[int(i * step)] for i in range(args.datatrove_docs)]
    sub_mb = sum(len(d.encode()) for d in sub) / 1e6
    _, cpu, wall = _timed(lambda: F.run_chain(sub, no_lang))
    ours_sub = report("tokenfarm without langid (dt's docs)", len(sub), sub_mb, cpu, wall)
    theirs_kept, cpu, wall = _timed(lambda: _datatrove(sub))
    theirs = report("datatrove 0.10.1 same chain", len(sub), sub_mb, cpu, wall)
    agree = sum(a == b for a, b in zip(F.run_chain(sub, no_lang).kept.tolist(), theirs_kept)) / len(sub)
    print(f"speed-up (same docs, no langid): {ours_sub / theirs:.1f}x; on all docs {ours / theirs:.1f}x;"
          f" keep/drop agreement {agree:.4f}")


if __name__ == "__main__":
    main()
