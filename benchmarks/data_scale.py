"""The data half at scale: realistic shards through the Snakemake DAG, each stage's measured cost beside
the cost plan's prediction (`pipeline.planning.data_cost`).

    python benchmarks/data_scale.py run --shards 20 --docs 50000 --workdir /tmp/tf-scale [--cores 2]
    python benchmarks/data_scale.py report /tmp/tf-scale
    python benchmarks/data_scale.py calibrate /tmp/tf-cal-small /tmp/tf-cal-large
    python benchmarks/data_scale.py tokenizer /tmp/tf-scale [--chars 16000000 64000000 256000000]

`run` builds a corpus of --shards FineWeb-shaped parquet shards of --docs documents each (`build_corpus`:
English sentences of the sample corpus, data/sample/web, drawn at random into documents of a
log-normal length, ~2 KB mean, so that no two documents share text by chance; --dup-rate of them
copies or near copies of an earlier document, in any shard; --contam-rate of them carry an item of an
eval task), writes a complete config for it (one local source, `rehearsal_config`), and runs the data
half of the DAG (the default target without training and what follows it: download … pack, the
accounting, the filter funnel and every other data rule) with `snakemake --cores C --omit-from train
train_segment`, timed. Then per rule: jobs, CPU seconds (each job's own count, the `resources:`
line `pipeline.io.run_cli` ends its log with; Snakemake's `benchmark:` tables sample it every second,
then every 30 s, and miss a job's last moments), wall seconds and peak RSS (the `benchmark:` tables,
every data rule has one), beside `pipeline.planning.data_cost.data_costs` for the same config and cores, fed what
the plan knows before the run (the count sample, `R/counts/sample.parquet`); the ratio is
measured / predicted. Last the whole run's wall time beside the plan's critical-path estimate.
Results land in WORKDIR/result.json; `report` prints a finished run's measurement beside the cost plan
as it is now (after a change of `pipeline.planning.data_cost`, without running again).

`calibrate` reads two finished runs of different sizes (same tokenizer vocabulary, different
train_chars) and fits, per stage, the CPU seconds per job and the units (bytes, documents, tokens, …
as `pipeline.planning.data_cost.RATES` declares) per CPU-second by a line through the two points: the
`RATES` table to commit. `tokenizer` times the tokenizer CLI alone at larger train_chars than a
calibration run reaches (rustbpe's cost per character settles above ~16M characters; the presets
train on 2B), on the shards of a finished run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from rule_cpu import per_rule  # noqa: E402

from pipeline.config import resolve_config, run_dir  # noqa: E402
from pipeline.io import RESOURCE_LINE  # noqa: E402
from pipeline.planning import data_cost, job_sizes  # noqa: E402
from pipeline.rules import BY_NAME  # noqa: E402
from pipeline.run_config import run_config  # noqa: E402

# Each data rule's logs under logs/{run_name}/ (workflow/rules/*.smk `log:`), each wildcard a *: a rule's own
# L.log(rule, ...wildcards of its scope) (a per-shard-group rule's L.log(rule, "{source}", "{group}"), a per-mix
# rule's L.log(rule, "{mix}")) unless listed; benchmark tables are at R/benchmarks/{rule}/… (`rule_cpu.per_rule`).
SCOPE_LOGS = {"run": "{rule}.log", "source": "{rule}/*/*.log", "mix": "{rule}/*.log"}
OWN_LOGS = {
    "count_sample": "count/sample.log", "count": "count/aggregate.log",
    "decontaminate_grams": "decontaminate/grams.log",
    "decontaminate_flags": "decontaminate/flags/*/*.log", "decontaminate": "decontaminate/report.log",
    "dedup_signatures": "dedup/sig/*/*.log", "dedup_index": "dedup/index/*.log",
    "dedup_candidates": "dedup/candidates/*/*.log", "dedup": "dedup/clusters/*.log",
    "dedup_report": "dedup/report.log", "pack": "pack/*/*.log",
}
LOGS = {r: OWN_LOGS.get(r) or SCOPE_LOGS[BY_NAME[r].scope].format(rule=r) for r in data_cost.RATES}


def sentences() -> list[str]:
    """The sample corpus's web text cut into sentences (at '. ')."""
    files = sorted((ROOT / "data/sample/web").glob("*.parquet"))
    texts = [t for f in files for t in pq.read_table(f)["text"].to_pylist()]
    out = [s.strip() for t in texts for s in t.replace("\n", " ").split(". ") if len(s.split()) >= 4]
    return [s if s.endswith(".") else s + "." for s in out]


def contamination(n: int = 200) -> list[str]:
    """Up to `n` eval items' texts (the tasks of the default config), as decontamination sees them."""
    import tempfile

    from pipeline.data.decontaminate import eval_texts
    from pipeline.data.eval_data import build_eval_data
    from pipeline.rules import rule_params

    with tempfile.TemporaryDirectory() as tmp:
        build_eval_data(rule_params(resolve_config({}), "eval_data"), tmp)
        tasks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json")) if p.name != "tasks.json"]
    texts = [t for task in tasks for t in eval_texts(task) if len(t.split()) >= 20]
    return texts[:: max(1, len(texts) // n)][:n]


def build_corpus(out: Path, shards: int, docs: int, dup_rate: float = 0.05, contam_rate: float = 0.001,
                 mean_sentences: float = 16.0, seed: int = 0) -> dict:
    """`shards` parquet files (`id`, `text`; row groups of 1,024) of `docs` documents each in `out`;
    returns the corpus's totals and what was planted. Duplicates copy one of 5,000 documents drawn from
    the previous shard (shard 0: from its own), half exactly, half with one sentence replaced (a near
    duplicate): clusters stay of a few documents whatever the corpus's size, so the candidate pairs grow
    with it linearly (a corpus whose clusters grow with it costs the dedup stages more per document)."""
    out.mkdir(parents=True, exist_ok=True)
    pool = np.array(sentences(), dtype=object)
    evals = contamination()
    rng = np.random.default_rng(seed)
    planted = {"exact": 0, "near": 0, "contaminated": 0}
    total_bytes = 0
    for s in range(shards):
        lengths = np.maximum(1, rng.lognormal(math.log(mean_sentences) - 0.32, 0.8, docs).astype(int))
        picks = rng.integers(0, len(pool), int(lengths.sum()))
        ends = np.cumsum(lengths)
        texts = [" ".join(pool[picks[e - n:e]]) for e, n in zip(ends, lengths)]
        if s == 0:
            kept = [texts[j] for j in rng.integers(0, docs, min(docs, 5000))]
        for i in np.flatnonzero(rng.random(docs) < dup_rate):
            src = kept[rng.integers(len(kept))]
            if rng.random() < 0.5:
                texts[i], planted["exact"] = src, planted["exact"] + 1
            else:
                parts = src.split(". ")
                parts[rng.integers(len(parts))] = str(pool[rng.integers(len(pool))]).rstrip(".")
                texts[i], planted["near"] = ". ".join(parts), planted["near"] + 1
        for i in np.flatnonzero(rng.random(docs) < contam_rate):
            texts[i] = f"{texts[i]} {evals[rng.integers(len(evals))]}"
            planted["contaminated"] += 1
        kept = [texts[j] for j in rng.integers(0, docs, min(docs, 5000))]
        total_bytes += sum(len(t.encode()) for t in texts)
        table = pa.table({"id": [f"{s}-{i}" for i in range(docs)], "text": texts})
        tmp = out / f".shard_{s:05d}.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=1024)
        tmp.rename(out / f"shard_{s:05d}.parquet")
    return {"shards": shards, "documents": shards * docs, "text_bytes": total_bytes, "planted": planted}


# --filter: config.yaml's chain (six filters), or the FineWeb presets' (language ID + PII)
FILTER_CHAINS = {"default": "config.yaml", "preset": "configs/llama3-1b-fineweb.yaml"}


def rehearsal_config(workdir: Path, corpus_dir: Path, corpus: dict, shards_per_job: int, partitions: int,
                     train_chars: int, filter_chain: str = "default") -> dict:
    """The default config (config.yaml) with one local source, the corpus: the tiny model's pretraining
    mix at about a third of the corpus's tokens (a text byte is ~0.3 tokens of a 4,096 vocabulary); the
    filter chain of `FILTER_CHAINS[filter_chain]`."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["filter"] = yaml.safe_load((ROOT / FILTER_CHAINS[filter_chain]).read_text())["filter"]
    cfg.update(run_name="rehearsal", data_dir=str(workdir / "raw"), results_dir=str(workdir / "results"),
               shards_per_job=shards_per_job)
    cfg["sources"] = {"web": {"type": "local", "glob": str(corpus_dir / "*.parquet"), "format": "text"}}
    cfg["tokenizer"].update(train_sources=["web"], train_chars=train_chars)
    cfg["dedup"]["partitions"] = partitions
    cfg["mixes"] = {"pretrain": {"weights": {"web": 1.0}, "tokens": "plan"}}
    cfg["train"].update(target_tokens=int(corpus["text_bytes"] * 0.3 / 3), stages=[{"name": "pretrain"}])
    cfg["split"]["val_tokens"] = int(corpus["text_bytes"] * 0.3 / 100)
    return cfg


def job_cpu(log_root: Path) -> dict[str, list[float]]:
    """{rule: [CPU seconds of each job]} from the `resources:` line that ends each job's log."""
    out: dict[str, list[float]] = {}
    for rule, pattern in LOGS.items():
        for log in sorted(log_root.glob(pattern)):
            found = [m for m in RESOURCE_LINE.finditer(log.read_text(errors="replace"))]
            if found:
                out.setdefault(rule, []).append(float(found[-1]["cpu_s"]))
    return out


def measure(workdir: Path) -> dict:
    """Per rule of the finished run in `workdir`: jobs, CPU s (the jobs' own), wall s and peak RSS
    (benchmark: tables) and the benchmark tables' sampled CPU."""
    cfg = resolve_config(yaml.safe_load((workdir / "config.yaml").read_text()))
    rdir = workdir / run_dir(cfg)
    bench = per_rule(rdir / "benchmarks")
    cpu = job_cpu(workdir / "logs" / cfg["run_name"])
    out = {}
    for rule, (n, sampled, wall, rss) in bench.items():
        out[rule] = {"jobs": n, "cpu_s": sum(cpu.get(rule, [])), "logged_jobs": len(cpu.get(rule, [])),
                     "benchmark_cpu_s": sampled, "wall_s": wall, "max_rss_mb": rss}
    return out


def predict(workdir: Path, cores: int) -> dict:
    """The cost plan for the run in `workdir` from what the plan rule knows: the count sample."""
    cfg = resolve_config(yaml.safe_load((workdir / "config.yaml").read_text()))
    measured = job_sizes.measured_sizes(workdir / run_dir(cfg) / "counts" / "sample.parquet")
    return data_cost.data_costs(run_config(cfg), measured, data_cpus=cores)


def compare(measured: dict, predicted: dict) -> list[dict]:
    rows = []
    for rule, p in predicted["stages"].items():
        m = measured.get(rule)
        rows.append({"stage": rule, "jobs": m["jobs"] if m else 0, "predicted_cpu_s": p["cpu_hours"] * 3600,
                     "cpu_s": m["cpu_s"] if m else None, "wall_s": m["wall_s"] if m else None,
                     "max_rss_mb": m["max_rss_mb"] if m else None,
                     "ratio": m["cpu_s"] / (p["cpu_hours"] * 3600) if m and p["cpu_hours"] else None})
    return rows


def format_rows(rows: list[dict], wall: float | None, predicted: dict) -> str:
    lines = [f"{'stage':<22}{'jobs':>5}{'CPU s':>10}{'predicted':>11}{'meas/pred':>11}{'wall s':>9}{'peak RSS':>10}"]
    for r in rows:
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        wall_s = "-" if r["wall_s"] is None else f"{r['wall_s']:.1f}"
        rss = "-" if r["max_rss_mb"] is None else f"{r['max_rss_mb']:.0f} MB"
        lines.append(f"{r['stage']:<22}{r['jobs']:>5}{cpu:>10}{r['predicted_cpu_s']:>11.1f}{ratio:>11}{wall_s:>9}{rss:>10}")
    total = sum(r["cpu_s"] or 0 for r in rows)
    lines.append(f"{'total':<22}{'':>5}{total:>10.1f}{predicted['cpu_hours'] * 3600:>11.1f}"
                 f"{total / (predicted['cpu_hours'] * 3600):>11.2f}")
    if wall is not None:
        lines.append(f"whole run: {wall:.1f} s wall on {predicted['data_cpus']} cores; predicted "
                     f"{predicted['wall_hours'] * 3600:.1f} s (critical path "
                     f"{predicted['critical_path_hours'] * 3600:.1f} s)")
    return "\n".join(lines)


def run(args) -> dict:
    work = Path(args.workdir).resolve()
    corpus_dir = work / "corpus"
    manifest = corpus_dir / "corpus.json"
    want = {"shards": args.shards, "docs": args.docs, "seed": args.seed, "builder": 2}
    if not manifest.exists() or json.loads(manifest.read_text()).get("request") != want:
        t = time.perf_counter()
        corpus = build_corpus(corpus_dir, args.shards, args.docs, seed=args.seed)
        manifest.write_text(json.dumps({"request": want, **corpus}, indent=1))
        print(f"built {args.shards} shards × {args.docs:,} documents, {corpus['text_bytes'] / 1e9:.2f} GB of text "
              f"in {time.perf_counter() - t:.0f} s: {corpus['planted']}", flush=True)
    corpus = json.loads(manifest.read_text())
    cfg = rehearsal_config(work, corpus_dir, corpus, args.shards_per_job, args.partitions, args.train_chars,
                           args.filter)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "-s",
           str(ROOT / "Snakefile"), "-d", str(work), "--configfile", str(work / "config.yaml"), "--cores",
           str(args.cores), "--forceall", "--quiet", "rules", "--omit-from", "train", "train_segment"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    wall = time.perf_counter() - t
    predicted = predict(work, args.cores)
    rows = compare(measure(work), predicted)
    print(format_rows(rows, wall, predicted))
    result = {"command": " ".join(sys.argv), "corpus": corpus, "wall_s": wall, "rows": rows, "predicted": predicted}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    return result


def calibrate(small: Path, large: Path) -> dict:
    """Per stage, (CPU s per job, units per CPU-s) through the two runs' points (jobs, units, CPU s)."""
    points = []
    for work in (small, large):
        cfg = resolve_config(yaml.safe_load((work / "config.yaml").read_text()))
        measured = job_sizes.measured_sizes(work / run_dir(cfg) / "counts" / "counts.parquet")  # the exact table
        points.append((data_cost.stage_work(run_config(cfg), measured), measure(work)))
    fitted = {}
    for stage, (unit, _, _) in data_cost.RATES.items():
        (w0, m0), (w1, m1) = points
        j0, u0, c0 = w0[stage]["jobs"], w0[stage]["units"], m0[stage]["cpu_s"]
        j1, u1, c1 = w1[stage]["jobs"], w1[stage]["units"], m1[stage]["cpu_s"]
        # c = j × fixed + u / rate: two equations, two unknowns; where the work does not show (no units, or
        # a slope within the noise: not positive), the job's start is the mean of the two runs' per job
        det = j0 * u1 - j1 * u0
        fixed = (c0 * u1 - c1 * u0) / det if det else 0.0
        per_unit = (c1 - j1 * fixed) / u1 if u1 else 0.0
        if not det or fixed < 0 or per_unit <= 0:
            fixed, per_unit = (c0 / j0 + c1 / j1) / 2, 0.0
        fitted[stage] = (unit, round(1 / per_unit) if per_unit > 0 else None, round(fixed, 2))
        print(f"    {stage!r}: ({unit!r}, {fitted[stage][1]!r}, {fitted[stage][2]!r}),")
    return fitted


def tokenizer_sweep(workdir: Path, chars: list[int]) -> list[tuple[int, float, float]]:
    """The tokenizer CLI (what the rule runs, 2 rustbpe threads) on the run's downloaded shards at each
    train_chars: [(chars, CPU s, wall s)], and the line through the two largest (the rate and the
    per-job CPU for RATES; rustbpe's CPU ÷ wall for TOKENIZER_PARALLELISM)."""
    import resource
    import tempfile

    from pipeline.rules import rule_params

    cfg = resolve_config(yaml.safe_load((workdir / "config.yaml").read_text()))
    files = [str(p) for p in sorted((Path(cfg["data_dir"]) / "web").glob("*.parquet"))]
    env = {**os.environ, "RAYON_NUM_THREADS": "2"}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in chars:
            p = rule_params({**cfg, "tokenizer": {**cfg["tokenizer"], "train_chars": n}}, "tokenizer")
            before, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            subprocess.run([sys.executable, "-m", "pipeline.data.train_tokenizer", "--params", json.dumps(p),
                            "--inputs",
                            *files, "--out", f"{tmp}/{n}/encoding.json"], check=True, capture_output=True, env=env)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            out.append((n, cpu, time.perf_counter() - t))
            print(f"train_chars {n:>13,}: {cpu:7.2f} CPU s, {out[-1][2]:7.2f} s wall", flush=True)
    (c0, cpu0, _), (c1, cpu1, wall1) = sorted(out)[-2:]
    rate = (c1 - c0) / (cpu1 - cpu0)
    print(f"    'tokenizer': ('train_chars', {rate:.3g}, {max(0.0, cpu1 - c1 / rate):.2f}),  "
          f"TOKENIZER_PARALLELISM = {cpu1 / wall1:.2f}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/data_scale.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workdir", required=True)
    r.add_argument("--shards", type=int, default=20)
    r.add_argument("--docs", type=int, default=50_000, help="documents per shard")
    r.add_argument("--shards-per-job", type=int, default=2)
    r.add_argument("--partitions", type=int, default=8, help="dedup.partitions")
    r.add_argument("--train-chars", type=int, default=20_000_000, help="tokenizer.train_chars")
    r.add_argument("--cores", type=int, default=2)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--filter", choices=sorted(FILTER_CHAINS), default="default",
                   help="the filter chain: config.yaml's or the FineWeb presets'")
    c = sub.add_parser("calibrate")
    c.add_argument("small")
    c.add_argument("large")
    rep = sub.add_parser("report", help="a finished run's measurement beside the current cost plan (no run)")
    rep.add_argument("workdir")
    rep.add_argument("--cores", type=int, default=2)
    t = sub.add_parser("tokenizer")
    t.add_argument("workdir", help="a finished `run`'s workdir (its downloaded shards are read)")
    t.add_argument("--chars", type=int, nargs="+", default=[16_000_000, 64_000_000, 256_000_000])
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args)
    elif args.cmd == "report":
        work = Path(args.workdir)
        predicted = predict(work, args.cores)
        print(format_rows(compare(measure(work), predicted), json.loads((work / "result.json").read_text())["wall_s"],
                          predicted))
    elif args.cmd == "calibrate":
        calibrate(Path(args.small), Path(args.large))
    else:
        tokenizer_sweep(Path(args.workdir), args.chars)


if __name__ == "__main__":
    main()
