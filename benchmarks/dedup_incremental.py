"""Incremental dedup: the CPU of adding 10 % new shards to a deduplicated corpus vs one full dedup.

    python benchmarks/dedup_incremental.py --docs 1e6 --shard-docs 25000 --new-shards 4 --partitions 2

Synthetic signature files (benchmarks/dedup_scale.py's, templates copied across every shard) stand for
the corpus; the clustering jobs run as the rules run them (`python -m pipeline.data.dedup index |
candidates | clusters | report`, each under /usr/bin/time): one segment over every shard (the full
dedup), then the first shards as segment 0 and the new ones as segment 1 against it (the increment).
The signature step, which the synthetic files skip, is measured separately: the `signatures` job on the
sample corpus's web text (its start + CPU per byte, the least of three runs), priced at --doc-bytes per
document and one job per --shards-per-job shards. The new shards' keep lists must equal the full dedup's (checked).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dedup_scale import measured, write_synthetic  # noqa: E402

from pipeline.config import resolve_config  # noqa: E402
from pipeline.rules import rule_params  # noqa: E402

PY = [sys.executable, "-m", "pipeline.data.dedup"]


def signature_job_cpu(work: Path) -> tuple[float, float, float]:
    """(CPU s of a job's start, CPU s per byte of text, the sample's mean bytes per document) of the
    signatures job as the rule runs it (`python -m pipeline.data.dedup signatures`: read each filtered
    shard and its tokenized metadata, hash, write the signature and lsh files), on the sample's web text
    as one group of shards; the start is the interpreter and imports (`python -c "import …"`)."""
    import numpy as np
    import pyarrow as pa

    cfg = resolve_config({"sources": {"web": {"type": "local", "glob": "unused/*.parquet"}}})
    inputs, tokens, outputs, n_bytes, n_docs = [], [], [], 0, 0
    for f in sorted((ROOT / "data/sample/web").glob("*.parquet")):
        texts = pq.read_table(f, columns=["text"]).column("text").to_pylist()
        inputs.append(work / f"filtered/web/{f.name}")
        inputs[-1].parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts}), inputs[-1])
        tokens.append(work / f"tokens/web/{f.stem}.json")
        tokens[-1].parent.mkdir(parents=True, exist_ok=True)
        np.save(work / f"tokens/web/{f.stem}.idx.npy", np.arange(len(texts) + 1, dtype=np.int64))
        tokens[-1].write_text(json.dumps({"source": "web", "shard": f.stem, "n_rows": len(texts), "n_docs": len(texts),
                                          "doc_rows": list(range(len(texts)))}))
        outputs.append(work / f"sig/web/{f.name}")
        n_bytes += sum(len(t.encode()) for t in texts)
        n_docs += len(texts)
    job = min(measured([*PY, "signatures", "--params", json.dumps(rule_params(cfg, "dedup_signatures")), "--source",
                        "web", "--inputs", *map(str, inputs), "--tokens", *map(str, tokens), "--outputs",
                        *map(str, outputs), "--manifest", str(work / "manifest.json")])["cpu_s"] for _ in range(3))
    start = min(measured([sys.executable, "-c", "import pipeline.data.dedup, pipeline.config"])["cpu_s"]
                for _ in range(3))
    return start, (job - start) / n_bytes, n_bytes / n_docs


def segment(work: Path, sigs: list[Path], params: dict, k: int, earlier: list[Path], run: str) -> dict:
    """The jobs of segment `k` (index, every candidate job, the merge) as processes: {step: CPU s}."""
    parts = params["dedup"]["partitions"]
    manifest = work / f"manifest-{k}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"files": [{"path": str(s)} for s in sigs]}))
    seg_index, seg_dir = work / f"seg/{k}/index.json", work / f"index/{k}"
    p = json.dumps(params)
    cpu = {"index": measured([*PY, "index", "--params", p, "--manifests", str(manifest), "--earlier",
                              *map(str, earlier), "--index-dir", str(work / "index"),
                              "--out", str(seg_index)])["cpu_s"]}
    cpu["candidates"] = sum(measured([*PY, "candidates", "--params", p, "--index", str(seg_index), "--part", str(q),
                                      "--out", str(work / f"seg/{k}/pairs/{q}.parquet"),
                                      "--bands-out", str(seg_dir / f"bands/{q}.npy")])["cpu_s"]
                            for q in range(parts))
    cpu["merge"] = measured([*PY, "clusters", "--params", p, "--index", str(seg_index), "--pairs",
                             *(str(work / f"seg/{k}/pairs/{q}.parquet") for q in range(parts)),
                             "--outdir", str(work), "--segment-dir", str(seg_dir), "--run", run])["cpu_s"]
    return cpu


def report(work: Path, params: dict, segments: int) -> float:
    return measured([*PY, "report", "--params", json.dumps(params), "--segments",
                     *(str(work / f"index/{k}/segment.json") for k in range(segments)),
                     "--index-dir", str(work / "index"), "--run", "bench", "--out", str(work / "report.json")])["cpu_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=float, default=1e6)
    ap.add_argument("--shard-docs", type=int, default=25_000)
    ap.add_argument("--new-shards", type=int, default=4, help="the shards added (10 %% of 40 by default)")
    ap.add_argument("--partitions", type=int, default=2, help="dedup.partitions (about documents / 500,000)")
    ap.add_argument("--dup-rate", type=float, default=0.1)
    ap.add_argument("--shards-per-job", type=int, default=1, help="shards_per_job: signature jobs per shard group")
    ap.add_argument("--doc-bytes", type=float, default=2000.0,
                    help="UTF-8 bytes per document for the signature step (FineWeb-shaped, as the data-scale "
                         "rehearsal's; 0: the sample corpus's mean)")
    ap.add_argument("--workdir", default="/tmp/tokenfarm-dedup-incremental")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files and the jobs' outputs")
    args = ap.parse_args()
    n, parts = int(args.docs), args.partitions
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    sigs = write_synthetic(work / "sig", n, args.shard_docs, args.dup_rate, seed=1, sources=("web",), parts=parts)
    old, new = sigs[:-args.new_shards], sigs[-args.new_shards:]
    params = rule_params(resolve_config({"dedup": {"partitions": parts}}), "dedup")

    full = segment(work / "full", sigs, params, 0, [], "full")
    full["report"] = report(work / "full", params, 1)
    base = segment(work / "inc", old, params, 0, [], "inc")
    base["report"] = report(work / "inc", params, 1)
    inc = segment(work / "inc", new, params, 1, [work / "inc/index/0/segment.json"], "inc")
    inc["report"] = report(work / "inc", params, 2)
    for s in new:
        name = f"{s.parent.name}/{s.stem}.parquet"
        a, b = (pq.read_table(work / d / "keep" / name).column("keep") for d in ("full", "inc"))
        assert a.equals(b), f"{name}: the increment's keep list differs from the full dedup's"

    start, per_byte, mean_bytes = signature_job_cpu(work / "signatures")
    doc_bytes = args.doc_bytes or mean_bytes
    new_docs = sum(pq.read_metadata(s).num_rows for s in new)
    jobs = math.ceil(len(sigs) / args.shards_per_job), math.ceil(len(new) / args.shards_per_job)
    sig_full = jobs[0] * start + n * doc_bytes * per_byte
    sig_new = jobs[1] * start + new_docs * doc_bytes * per_byte
    full_cpu, inc_cpu = sig_full + sum(full.values()), sig_new + sum(inc.values())
    row = {"docs": n, "shards": len(sigs), "new_shards": len(new), "new_docs": new_docs, "partitions": parts,
           "doc_bytes": round(doc_bytes), "signature_mb_per_cpu_s": round(1 / per_byte / 1e6, 1),
           "signature_job_start_cpu_s": round(start, 2), "signature_jobs": jobs,
           "full": {"signatures": round(sig_full, 1), **{k: round(v, 2) for k, v in full.items()}},
           "base": {k: round(v, 2) for k, v in base.items()},
           "increment": {"signatures": round(sig_new, 1), **{k: round(v, 2) for k, v in inc.items()}},
           "full_cpu_s": round(full_cpu, 1), "increment_cpu_s": round(inc_cpu, 1),
           "ratio": round(inc_cpu / full_cpu, 3),
           "clustering_ratio": round(sum(inc.values()) / sum(full.values()), 3)}
    print(json.dumps(row, indent=1))
    print(f"| documents | new | full dedup CPU s (signatures + clustering) | increment CPU s | ratio |\n"
          f"|---|---|---|---|---|\n| {n:,} in {len(sigs)} shards | {len(new)} shards, {new_docs:,} docs | "
          f"{full_cpu:.1f} ({sig_full:.1f} + {sum(full.values()):.1f}) | {inc_cpu:.1f} ({sig_new:.1f} + "
          f"{sum(inc.values()):.1f}) | **{inc_cpu / full_cpu:.1%}** |")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
