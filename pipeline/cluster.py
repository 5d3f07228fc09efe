"""Job sizes for a cluster executor, and what the data stages cost: the one place the measured
per-core throughputs live.

* `job_resources(cfg, rule)`: ``threads`` and ``resources`` (``cpus_per_task``, ``mem_mb``,
  ``runtime`` in minutes, and for GPU rules ``gpu`` / ``gres``, ``nodes``, ``tasks``) of each rule,
  computed from the config. The rules declare them; Snakemake's SLURM executor turns them into
  ``sbatch`` options (a local run uses ``threads`` capped at ``--cores``, and ignores the rest but
  ``mem_mb`` when given ``--resources mem_mb=…``).
* `data_costs(cfg, documents, tokens, data_cpus)`: the data stages' job counts, CPU-hours (from
  `THROUGHPUT`) and wall time on `data_cpus` cores — printed by ``python -m pipeline.plan``.

Sizes come from the measured figures where BENCHMARKS.md has one (the dedup candidate job's memory
per document, the per-core throughputs) and otherwise from stated, generous defaults; a profile's
``set-resources`` overrides any of them. Torch-free; imported by the Snakefile at parse time.
"""
from __future__ import annotations

import math

from pipeline.budget import count_params
from pipeline.config import source_shards

# Per-core throughputs measured in BENCHMARKS.md (2-core development VM, one single-threaded process,
# end to end through the stage's code). The cost model below and nothing else uses them.
THROUGHPUT = {
    "tokenize": 5.35e6,         # tokens / cpu-s ("tokenize end to end")
    "dedup_signatures": 3_351,  # documents / cpu-s (a per-shard job through its CLI, 1,596-word documents)
    "dedup_scan": 450_000,      # documents / cpu-s the merge job reads (every shard's doc and tokens columns)
    "dedup_candidates": 210_000,  # documents / cpu-s of the whole candidate stage (each job reads its 1/P)
    "pack": 167e6,              # tokens / cpu-s ("pack (concat)")
}
# A dedup candidate job's peak memory (BENCHMARKS.md, "Dedup at scale"): a fixed part (interpreter,
# libraries, one shard being read) plus a part per document of its slice, which includes the
# signatures of its slice's duplicate candidates at a 10 % duplicate rate.
DEDUP_JOB_BASE_MB = 500       # 802 MB measured at 0.5M documents per job (20M documents, 40 jobs)
DEDUP_JOB_BYTES_PER_DOC = 700
DEDUP_JOB_START_CPU_S = 1.0  # a candidate job's interpreter and imports (0.7-1.0 measured, P = 8 .. 200)
DEDUP_JOB_SHARD_CPU_S = 0.0015  # per candidate job and shard: opening its lsh files (1M docs, 19 shards, P = 200)
DEDUP_MERGE_BYTES_PER_DOC = 60  # 976 MB measured at 20M documents (2.0M candidate pairs)
# Where no measured counts give the number of documents: FineWeb-Edu's order of magnitude (an
# assumption, used for job sizes and the cost estimate only; the tokenize jobs count it).
TOKENS_PER_DOCUMENT = 1_000
MIN_RUNTIME = 10  # minutes: scheduling slack for the smallest job
UNMEASURED_MB = 16_000  # jobs whose memory at scale is not measured yet (split, mix, pack): a generous default


def threads(cfg: dict) -> int:
    """Threads of the multi-threaded rules: hardware.cpus_per_task, or 0 → 256 ("all": a local run's
    --cores caps it)."""
    return cfg["hardware"]["cpus_per_task"] or 256


def _minutes(cpu_seconds: float, cpus: int = 1, safety: float = 3.0) -> int:
    return max(MIN_RUNTIME, math.ceil(safety * cpu_seconds / max(1, cpus) / 60) + MIN_RUNTIME)


def measured_sizes(counts_path) -> tuple[dict, dict]:
    """({source: documents per shard}, {source: tokens per shard}), means over the shards in the count
    stage's counts.parquet; ({}, {}) when there is none yet."""
    from pathlib import Path

    if counts_path is None or not Path(counts_path).exists():
        return {}, {}
    import pyarrow.parquet as pq

    cols = pq.read_table(counts_path, columns=["source", "documents", "tokens"]).to_pydict()
    docs, toks, n = {}, {}, {}
    for s, d, t in zip(cols["source"], cols["documents"], cols["tokens"]):
        docs[s], toks[s], n[s] = docs.get(s, 0) + d, toks.get(s, 0) + t, n.get(s, 0) + 1
    return {s: docs[s] / n[s] for s in n}, {s: toks[s] / n[s] for s in n}


def shard_sizes(cfg: dict, documents: dict | None = None, tokens: dict | None = None) -> dict[str, tuple[float, float]]:
    """(documents, tokens) per shard of each source: measured means when given, else the
    source's tokens_per_shard_estimate (and TOKENS_PER_DOCUMENT), else 0 (unknown)."""
    out = {}
    for s, src in cfg["sources"].items():
        t = (tokens or {}).get(s) or src.get("tokens_per_shard_estimate") or 0
        d = (documents or {}).get(s) or t / TOKENS_PER_DOCUMENT
        out[s] = (d, t)
    return out


def _n_shards(cfg: dict, source: str) -> int:
    return len(source_shards(cfg, source))


def corpus(cfg: dict, documents: dict | None = None, tokens: dict | None = None) -> tuple[float, float, int]:
    """(documents, tokens, shards) of every configured shard."""
    sizes = shard_sizes(cfg, documents, tokens)
    n = {s: _n_shards(cfg, s) for s in cfg["sources"]}
    return (sum(sizes[s][0] * n[s] for s in n), sum(sizes[s][1] * n[s] for s in n), sum(n.values()))


def dedup_job_mb(docs_per_job: float) -> int:
    return math.ceil(DEDUP_JOB_BASE_MB + DEDUP_JOB_BYTES_PER_DOC * docs_per_job / 2**20)


def job_resources(cfg: dict, rule: str, documents: float = 0, tokens: float = 0, train_hours: float = 0) -> dict:
    """{"threads": int, "resources": {...}} of `rule`; `documents`/`tokens`: the corpus (see `corpus`);
    `train_hours`: the plan's estimate (`pipeline.plan.train_hours`), the train job's runtime × 1.5."""
    hw = cfg["hardware"]
    many = threads(cfg)
    cuda = hw["device"] == "cuda"
    spj = cfg["shards_per_job"]
    sizes = list(shard_sizes(cfg).values()) or [(0, 0)]
    shard_docs, shard_tokens = max(d for d, _ in sizes), max(t for _, t in sizes)
    one = {"threads": 1}
    if rule == "download":
        return {**one, "resources": {"mem_mb": 2000, "runtime": 30 + 10 * spj}}  # network-bound: 10 min a shard
    if rule == "tokenize":  # (the count tables are joined from its metadata: nothing else tokenizes)
        cpu = spj * shard_tokens / THROUGHPUT[rule]
        # one shard at a time: its text (~4.5 B/token) and tokens (4 B), twice over while converting
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(17 * shard_tokens / 2**20), "runtime": _minutes(cpu)}}
    if rule == "dedup_signatures":
        cpu = spj * shard_docs / THROUGHPUT[rule]
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(9 * shard_tokens / 2**20), "runtime": _minutes(cpu)}}
    if rule == "dedup_candidates":
        parts = cfg["dedup"]["partitions"]
        cpu = documents / parts / THROUGHPUT["dedup_candidates"] + DEDUP_JOB_START_CPU_S \
            + sum(_n_shards(cfg, s) for s in cfg["sources"]) * DEDUP_JOB_SHARD_CPU_S
        return {**one, "resources": {"mem_mb": dedup_job_mb(documents / parts), "runtime": _minutes(cpu)}}
    if rule == "dedup":  # the merge: candidate pairs of the whole corpus, then one shard's keep list at a time
        return {**one, "resources": {"mem_mb": 1000 + math.ceil(DEDUP_MERGE_BYTES_PER_DOC * documents / 2**20),
                                     "runtime": _minutes(documents / THROUGHPUT["dedup_scan"])}}
    if rule == "tokenizer":
        chars = cfg["tokenizer"]["train_chars"]
        return {"threads": many, "resources": {"cpus_per_task": many, "mem_mb": 4000 + math.ceil(12 * chars / 2**20),
                                               "runtime": 60 + math.ceil(chars / 2e6)}}
    if rule == "decontaminate_flags":  # a shard group's word n-grams, one process: not measured at scale;
        # assumed as fast as the MinHash signatures (a similar per-word hashing pass), one shard's text at a time
        cpu = spj * shard_docs / THROUGHPUT["dedup_signatures"]
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(9 * shard_tokens / 2**20), "runtime": _minutes(cpu)}}
    if rule in ("plan", "accounting", "eval_data", "decontaminate_grams", "stages_report"):
        return {**one, "resources": {"mem_mb": 2000, "runtime": MIN_RUNTIME}}
    if rule in ("split", "mix", "pack"):  # not measured at scale: generous defaults (profile's set-resources)
        cpu = tokens / THROUGHPUT["pack"] * (10 if rule != "pack" else 1)
        return {**one, "resources": {"mem_mb": UNMEASURED_MB, "runtime": _minutes(cpu, safety=10)}}
    if rule == "train":
        nodes, nproc = hw["nodes"], hw["nproc_per_node"]
        res = {"cpus_per_task": many, "nodes": nodes, "runtime": math.ceil(90 * train_hours) + 30,
               "mem_mb": nproc * (32_000 if cuda else 4_000)}
        if nodes > 1:  # one task (a torchrun agent) per node; the rule's shell runs srun itself
            res.update(tasks=nodes, mpi="srun")
            if cuda:
                res["gres"] = f"gpu:{nproc}"  # per node; `gpu` would be a total spread over the nodes
        elif cuda:
            res["gpu"] = nproc
        return {"threads": many, "resources": res}
    if rule == "export":  # the fp32 model, its state dict and the safetensors copy in memory at once
        params = count_params(cfg["model"])[0]
        return {**one, "resources": {"mem_mb": 4000 + math.ceil(12 * params / 2**20), "runtime": 60}}
    if rule == "evaluate":
        res = {"cpus_per_task": many, "mem_mb": 16_000 if cuda else 4_000, "runtime": 120}
        if cuda:
            res["gpu"] = 1
        return {"threads": many, "resources": res}
    raise KeyError(f"no resources for rule '{rule}'")


def data_costs(cfg: dict, documents: dict | None = None, tokens: dict | None = None, data_cpus: int = 64) -> dict:
    """Jobs, CPU-hours and wall hours on `data_cpus` cores of each data stage, from THROUGHPUT (a
    prediction). A stage's wall time is its jobs in waves of `data_cpus` (single-threaded jobs, the
    longest setting the pace); stages are summed as if run one after the other (an upper bound:
    Snakemake overlaps the per-shard stages)."""
    docs, toks, shards = corpus(cfg, documents, tokens)
    groups = sum(math.ceil(_n_shards(cfg, s) / cfg["shards_per_job"]) for s in cfg["sources"])
    parts = cfg["dedup"]["partitions"]
    stages = {
        "tokenize": (groups, toks / THROUGHPUT["tokenize"]),
        "dedup_signatures": (groups, docs / THROUGHPUT["dedup_signatures"]),
        "dedup_candidates": (parts, docs / THROUGHPUT["dedup_candidates"]
                             + parts * (DEDUP_JOB_START_CPU_S + shards * DEDUP_JOB_SHARD_CPU_S)),
        "pack": (2 * len(cfg["mixes"]), toks / THROUGHPUT["pack"]),  # train and val of each mix
    }
    out = {"documents": round(docs), "tokens": round(toks), "shards": shards, "data_cpus": data_cpus,
           "documents_basis": "measured counts" if documents else f"estimate ({TOKENS_PER_DOCUMENT:,} tokens/document)",
           "stages": {}, "not_costed": ["download (network-bound)", "tokenizer", "decontaminate", "dedup merge",
                                        "split", "mix", "accounting"]}
    for name, (jobs, cpu_s) in stages.items():
        waves = math.ceil(jobs / max(1, data_cpus))
        out["stages"][name] = {"jobs": jobs, "cpu_hours": cpu_s / 3600, "wall_hours": waves * cpu_s / jobs / 3600,
                               "job_mem_mb": job_resources(cfg, name if name != "pack" else "pack", docs, toks)
                               ["resources"]["mem_mb"]}
    out["jobs"] = {"download": groups, **{k: v["jobs"] for k, v in out["stages"].items()},
                   "dedup (merge)": 1, "tokenizer": 1, "decontaminate (flags)": groups,
                   "decontaminate (grams, report)": 2, "split": 1, "mix": len(cfg["mixes"]), "accounting": 1}
    out["cpu_hours"] = sum(v["cpu_hours"] for v in out["stages"].values())
    out["wall_hours"] = sum(v["wall_hours"] for v in out["stages"].values())
    return out


def format_costs(c: dict) -> str:
    lines = [f"data stages on {c['data_cpus']} CPU cores (a prediction from BENCHMARKS.md per-core throughputs; "
             f"{c['shards']:,} shards, {c['tokens'] / 1e9:,.1f}B tokens, {c['documents'] / 1e6:,.1f}M documents: "
             f"{c['documents_basis']})",
             f"  {'stage':<18}{'jobs':>7}{'CPU-hours':>12}{'wall h':>9}{'mem/job':>10}"]
    for name, s in c["stages"].items():
        lines.append(f"  {name:<18}{s['jobs']:>7,}{s['cpu_hours']:>12,.1f}{s['wall_hours']:>9,.2f}"
                     f"{s['job_mem_mb'] / 1000:>8,.1f}GB")
    lines.append(f"  {'total':<18}{sum(c['jobs'].values()):>7,}{c['cpu_hours']:>12,.1f}{c['wall_hours']:>9,.2f}"
                 f"   (jobs: all data jobs; hours: costed stages)")
    lines.append(f"  not costed (not measured): {', '.join(c['not_costed'])}")
    return "\n".join(lines)
