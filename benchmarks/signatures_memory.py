"""Peak memory of one dedup_signatures job on a FineWeb-shaped shard: the text read in record batches.

    python benchmarks/signatures_memory.py [--docs 50000] [--words 300] [--row-group 10000] [--baseline OLD_CHECKOUT]

Builds a raw shard of --docs documents (pieces of --words words of the sample corpus's web
documents, each with its own id prefix; 300 words ≈ 1.8 KB, FineWeb's mean) written in row groups
of --row-group rows, and a tokenized-shard `.json` naming every row a document, then runs the
`signatures` CLI on it under /usr/bin/time (peak RSS, CPU), and with --baseline the same CLI from
another checkout on the same inputs; it checks that both signature files hold the same table and
metadata (but `created_at`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from dedup_scale import measured  # noqa: E402

from pipeline.config import resolve_config  # noqa: E402
from pipeline.rules import rule_params  # noqa: E402


def build_shard(out: Path, n_docs: int, row_group: int, words: int = 300) -> int:
    """A raw shard of `n_docs` documents of about `words` words from the sample corpus; its bytes."""
    files = sorted((ROOT / "data/sample/web").glob("*.parquet"))
    texts = [t for f in files for t in pq.read_table(f)["text"].to_pylist()]
    pieces = [" ".join(w[i:i + words]) for w in (t.split() for t in texts) for i in range(0, len(w), words)]
    rng = np.random.default_rng(0)
    docs = [f"document {i}: {pieces[j]}" for i, j in enumerate(rng.integers(0, len(pieces), n_docs))]
    pq.write_table(pa.table({"id": [str(i) for i in range(n_docs)], "text": docs}), out, row_group_size=row_group)
    return out.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--row-group", type=int, default=10_000)
    ap.add_argument("--words", type=int, default=300, help="words per document")
    ap.add_argument("--baseline", help="a checkout whose signatures CLI to run beside")
    ap.add_argument("--workdir", default="/tmp/tokenfarm-sig-memory")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = build_shard(work / "shard.parquet", args.docs, args.row_group, args.words)
    (work / "shard.json").write_text(json.dumps({"n_docs": args.docs, "doc_rows": list(range(args.docs))}))
    np.save(work / "shard.idx.npy", np.arange(0, 1000 * (args.docs + 1), 1000, dtype=np.int64))
    p = rule_params(resolve_config({}), "dedup_signatures")
    params = json.dumps({**p, "sources": {"web": {"format": "text", "text_column": "text"}}})
    runs = {}
    for name, tree in [("streamed", ROOT), *([("baseline", Path(args.baseline))] if args.baseline else [])]:
        out = work / name / "shard.parquet"
        runs[name] = measured([sys.executable, "-m", "pipeline.data.dedup", "signatures", "--params", params,
                               "--source", "web", "--inputs", str(work / "shard.parquet"),
                               "--tokens", str(work / "shard.json"), "--outputs", str(out)], cwd=tree)
        print(f"{name}: peak {runs[name]['peak_mb']:.0f} MB, CPU {runs[name]['cpu_s']:.1f} s", flush=True)
    print(f"shard: {args.docs:,} documents, {size / 2**20:.0f} MB, row groups of {args.row_group:,}")
    if args.baseline:
        a, b = (pq.read_table(work / n / "shard.parquet") for n in ("streamed", "baseline"))
        ma, mb = (json.loads(t.schema.metadata[b"tokenfarm"]) for t in (a, b))
        for m in (ma, mb):
            m.pop("created_at")
        same = a.replace_schema_metadata().equals(b.replace_schema_metadata()) and ma == mb
        print("signature files: same table and metadata (but created_at)" if same else "signature files DIFFER")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
