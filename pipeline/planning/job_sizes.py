"""How big each job is: the size functions the rule specs name (`Rule.size`, pipeline/rules.py), and the
corpus figures they read.

A size function takes the config and a `Demand` (the rule's cost rate, the corpus's documents and tokens, the
plan's training hours) and returns ``{"threads": int, "resources": {...}}``: ``cpus_per_task``, ``mem_mb``,
``runtime`` in minutes, and for GPU rules ``gpu`` / ``gres``, ``nodes``, ``tasks`` (the train job's
``mem_mb``: `train_host_memory`, which the plan reports). The rules declare them through
`pipeline.planning.data_cost.job_resources`; Snakemake's SLURM executor turns them into ``sbatch`` options (a local run
uses ``threads`` capped at ``--cores``, and ignores the rest but ``mem_mb`` when given ``--resources
mem_mb=…``).

Sizes come from the measured figures where BENCHMARKS.md has one (the dedup candidate job's memory per
document, the per-core throughputs of the rules' rates) and otherwise from stated, generous defaults; a
profile's ``set-resources`` overrides any of them. Torch-free; imported by the Snakefile at parse time.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.config import source_shards
from pipeline.planning.compute import count_params
from pipeline.run_config import RunConfig, with_section

DEDUP_JOB_BASE_MB = 500       # fitted: BENCHMARKS.md "Dedup at scale" (a candidate job's peak)
DEDUP_JOB_BYTES_PER_DOC = 700
DEDUP_MERGE_BYTES_PER_DOC = 60  # fitted: BENCHMARKS.md "Dedup at scale" (the merge job's peak)
DEDUP_JOB_SHARD_CPU_S = 0.0014  # per candidate job and shard: opening its lsh files (1M docs, 19 shards, P = 200)
# Where no measured counts give the number of documents: FineWeb-Edu's order of magnitude (an
# assumption, used for job sizes and the cost estimate only; the tokenize jobs count it).
TOKENS_PER_DOCUMENT = 1_000
# A tokens_per_shard_estimate is in GPT-2 tokens (the datasets' published counts): FineWeb-Edu's
# shards hold ~250M characters for ~54.9M GPT-2 tokens (nanochat's figures).
BYTES_PER_ESTIMATED_TOKEN = 4.6
MIN_RUNTIME = 10  # minutes: scheduling slack for the smallest job
UNMEASURED_MB = 16_000  # jobs whose memory at scale is not measured yet (split, mix, pack): a generous default
# The train job's host memory (`train_host_memory`). A rank's fixed footprint, whatever the model: the
# process with torch and its libraries resident; on CUDA also the CUDA context, cuBLAS/NCCL host state,
# pinned staging buffers and inductor's compile worker processes. The CPU figure covers a gloo rank
# (BENCHMARKS.md "Figures behind code comments"); the CUDA figure is a stated, generous assumption, not yet
# measured on a GPU node (a rank's ru_maxrss in a real run should replace it).
TRAIN_RANK_HOST_MB = {"cuda": 8_000, "cpu": 1_000}
# build_model draws one fp32 weight at a time on the host: a rank's peak growth beyond its shards is about
# twice the largest weight (the value plus allocator slack: BENCHMARKS.md "Building the model on the meta
# device").
TRAIN_INIT_WEIGHTS = 2
TRAIN_HOST_MARGIN = 1.25
SIZE_FIELDS = ("documents", "tokens", "bytes")


def threads(cfg: RunConfig) -> int:
    """Threads of the multi-threaded rules: hardware.cpus_per_task, or 0 → 256 ("all": a local run's
    --cores caps it)."""
    return cfg.hardware.cpus_per_task or 256


def _minutes(cpu_seconds: float, cpus: int = 1, safety: float = 3.0) -> int:
    return max(MIN_RUNTIME, math.ceil(safety * cpu_seconds / max(1, cpus) / 60) + MIN_RUNTIME)


def measured_sizes(counts_path) -> dict[str, dict[str, float]]:
    """{source: {documents, tokens, bytes: mean per shard}} over the shards of a count table (the plan's
    sample, R/counts/sample.parquet, or the exact counts.parquet); {} when there is none yet."""
    from pathlib import Path

    if counts_path is None or not Path(counts_path).exists():
        return {}
    import pyarrow.parquet as pq

    cols = pq.read_table(counts_path, columns=["source", *SIZE_FIELDS]).to_pydict()
    sums: dict[str, list] = {}
    for i, s in enumerate(cols["source"]):
        acc = sums.setdefault(s, [0, 0, 0, 0])
        for k, f in enumerate(SIZE_FIELDS):
            acc[k] += cols[f][i]
        acc[3] += 1
    return {s: {f: acc[k] / acc[3] for k, f in enumerate(SIZE_FIELDS)} for s, acc in sums.items()}


def shard_sizes(cfg: RunConfig, measured: dict | None = None) -> dict[str, dict[str, float]]:
    """{source: {documents, tokens, bytes}} per shard: the measured means when given (`measured_sizes`),
    else from the source's tokens_per_shard_estimate (GPT-2 tokens: BYTES_PER_ESTIMATED_TOKEN,
    TOKENS_PER_DOCUMENT), else 0 (unknown)."""
    out = {}
    for s, src in cfg.sources.items():
        m = (measured or {}).get(s)
        if m:
            out[s] = {f: m[f] for f in SIZE_FIELDS}
        else:
            t = src.get("tokens_per_shard_estimate") or 0
            out[s] = {"documents": t / TOKENS_PER_DOCUMENT, "tokens": t, "bytes": t * BYTES_PER_ESTIMATED_TOKEN}
    return out


def _n_shards(cfg: RunConfig, source: str) -> int:
    return len(source_shards(cfg, source))


def _all_shards(cfg: RunConfig) -> int:
    return sum(_n_shards(cfg, s) for s in cfg.sources)


def corpus(cfg: RunConfig, measured: dict | None = None) -> dict[str, float]:
    """{documents, tokens, bytes, shards} of every configured shard."""
    sizes = shard_sizes(cfg, measured)
    n = {s: _n_shards(cfg, s) for s in cfg.sources}
    return {**{f: sum(sizes[s][f] * n[s] for s in n) for f in SIZE_FIELDS}, "shards": sum(n.values())}


def dedup_job_mb(docs_per_job: float) -> int:
    return math.ceil(DEDUP_JOB_BASE_MB + DEDUP_JOB_BYTES_PER_DOC * docs_per_job / 2**20)


class Rate(NamedTuple):
    """A data rule's cost: `per_s` of its `unit` per CPU-second (None: no units), `per_job` CPU seconds a job,
    and `fill`, where a job fills per-process caches, the CPU seconds of that fill as a function of its units
    (`pipeline.planning.data_cost.filter_fill_cpu_s`)."""

    unit: str
    per_s: float | None
    per_job: float
    fill: Callable[[float], float] | None = None


@dataclass(frozen=True)
class Demand:
    """What a job's size depends on beyond the config: its rule's cost `rate` (`Rate`: pipeline/rules.py), the
    corpus's `documents` and `tokens` (`corpus`), and the plan's `train_hours`
    (`pipeline.planning.token_plan.train_hours`)."""

    rate: Rate | None = None
    documents: float = 0
    tokens: float = 0
    train_hours: float = 0

    def cpu_s(self, units: float, shards: int = 0) -> float:
        """CPU seconds of one job doing `units` of work at the rate (`job_cpu_s`)."""
        return job_cpu_s(self.rate, units, shards)


def job_cpu_s(rate: Rate, units: float, shards: int = 0) -> float:
    """CPU seconds of one job doing `units` of work at `rate`, its caches' fill included; with `shards`, a dedup
    candidate job, which also opens the band-key files of every one of the corpus's shards."""
    fill = rate.fill(units) if rate.fill else 0.0
    return rate.per_job + fill + shards * DEDUP_JOB_SHARD_CPU_S + (units / rate.per_s if rate.per_s else 0.0)


def _shard_max(cfg: RunConfig, field: str) -> float:
    """The largest per-shard `field` of the sources (`shard_sizes`' estimates)."""
    sizes = list(shard_sizes(cfg).values()) or [dict.fromkeys(SIZE_FIELDS, 0)]
    return max(z[field] for z in sizes)


def _one(mem_mb: int, runtime: int) -> dict:
    return {"threads": 1, "resources": {"mem_mb": mem_mb, "runtime": runtime}}


# ----------------------------------------------------------------------------- one size per kind of job

def download_size(cfg: RunConfig, d: Demand) -> dict:
    return _one(2000, 30 + 10 * cfg.shards_per_job)  # network-bound: 10 min a shard


def tokenize_size(cfg: RunConfig, d: Demand) -> dict:
    # one shard at a time: its text (~4.5 B/token) and tokens (4 B), twice over while converting
    return _one(2000 + math.ceil(17 * _shard_max(cfg, "tokens") / 2**20),
                _minutes(d.cpu_s(cfg.shards_per_job * _shard_max(cfg, "bytes"))))


def shard_text_size(cfg: RunConfig, d: Demand) -> dict:
    # one shard's (or record batch's) text at a time, twice over while writing: filter, dedup_signatures,
    # decontaminate_flags
    return _one(2000 + math.ceil(9 * _shard_max(cfg, "tokens") / 2**20),
                _minutes(d.cpu_s(cfg.shards_per_job * _shard_max(cfg, "bytes"))))


def dedup_candidates_size(cfg: RunConfig, d: Demand) -> dict:
    per_job = d.documents / cfg.dedup.partitions
    return _one(dedup_job_mb(per_job), _minutes(d.cpu_s(per_job, _all_shards(cfg))))


def dedup_size(cfg: RunConfig, d: Demand) -> dict:
    # the merge: candidate pairs of the whole corpus, then one shard's keep list at a time
    return _one(1000 + math.ceil(DEDUP_MERGE_BYTES_PER_DOC * d.documents / 2**20), _minutes(d.cpu_s(d.documents)))


def tokenizer_size(cfg: RunConfig, d: Demand) -> dict:
    chars, many = cfg.tokenizer.train_chars, threads(cfg)
    return {"threads": many, "resources": {"cpus_per_task": many, "mem_mb": 4000 + math.ceil(12 * chars / 2**20),
                                           "runtime": _minutes(d.cpu_s(chars), safety=5)}}


def small_size(cfg: RunConfig, d: Demand) -> dict:
    # a reducer over small per-shard files, a report, the plan: one core, its start dominates
    return _one(2000, MIN_RUNTIME)


def unmeasured_size(cfg: RunConfig, d: Demand) -> dict:
    # split, mix (documents), pack (tokens): memory not measured at scale, a generous default (the profile's
    # set-resources overrides it)
    return _one(UNMEASURED_MB, _minutes(d.cpu_s(d.tokens if d.rate.unit == "tokens" else d.documents), safety=10))


def train_minutes(hours: float) -> int:
    """A train job's runtime request without a job limit: its predicted hours × 1.5, plus 30 minutes."""
    return math.ceil(90 * hours) + 30


def train_size(cfg: RunConfig, d: Demand) -> dict:
    hw, many = cfg.hardware, threads(cfg)
    nodes, nproc, cuda = hw["nodes"], hw["nproc_per_node"], hw["device"] == "cuda"
    res = {"cpus_per_task": many, "nodes": nodes, "runtime": train_minutes(d.train_hours),
           "mem_mb": train_host_memory(cfg)["node_mb"]}
    if nodes > 1:  # one task (a torchrun agent) per node; the rule's shell runs srun itself
        res.update(tasks=nodes, mpi="srun")
        if cuda:
            res["gres"] = f"gpu:{nproc}"  # per node; `gpu` would be a total spread over the nodes
    elif cuda:
        res["gpu"] = nproc
    return {"threads": many, "resources": res}


def scaling_point_size(cfg: RunConfig, d: Demand) -> dict:
    # one process per point: one GPU, or on CPU one core (points run side by side on --cores); its runtime is
    # the point's own (workflow/rules/scaling.smk, from its config)
    # the point's process: the run's config on one GPU, a config of its own
    one = train_size(with_section(cfg, "hardware", nproc_per_node=1, nodes=1), d)
    if cfg.hardware.device == "cpu":
        return {"threads": 1, "resources": {**one["resources"], "cpus_per_task": 1}}
    return one


def fit_size(cfg: RunConfig, d: Demand) -> dict:
    return _one(2000, 30)  # the scaling fit: a bootstrap over a few dozen points


def export_size(cfg: RunConfig, d: Demand) -> dict:
    # the fp32 model, its state dict and the safetensors copy in memory at once
    return _one(4000 + math.ceil(12 * count_params(cfg.model)[0] / 2**20), 60)


def evaluate_size(cfg: RunConfig, d: Demand) -> dict:
    many, cuda = threads(cfg), cfg.hardware.device == "cuda"
    res = {"cpus_per_task": many, "mem_mb": 16_000 if cuda else 4_000, "runtime": 120}
    if cuda:
        res["gpu"] = 1
    return {"threads": many, "resources": res}


def train_host_memory(cfg: RunConfig, parallel: str | None = None) -> dict:
    """Host memory of one node of the train job, in MB (2^20 bytes), from the config: what the train
    rule requests (``mem_mb``) and the plan reports. Every rank of the node holds its fixed footprint
    (`TRAIN_RANK_HOST_MB`), the weight being initialised (`TRAIN_INIT_WEIGHTS` × the largest fp32
    weight: the model is built on the meta device and each weight drawn on the host in turn,
    pipeline.training.parallelize.build_model — no rank holds the whole model) and the loader's batches (one
    step read ahead and the one in use, each also in pinned memory on CUDA: 4 int64-sized tensors per
    token position, inputs, targets, mask, document ids); on a CPU run also its training state, which
    lives on the host (`pipeline.planning.memory.memory`'s total per rank). Under fsdp, rank 0 gathers the whole fp32
    model on the host to write final.pt (pipeline.training.checkpoint.full_model_state); ``parallel:
    auto`` not yet resolved counts as fsdp, the larger. The sum × `TRAIN_HOST_MARGIN`, rounded up, is
    ``node_mb``; the parts are in MB per rank (``rank_mb`` their sum) and per node (``final_gather_mb``).
    ``parallel`` (ddp | fsdp) replaces ``train.parallel`` (the plan's resolution of auto)."""
    from pipeline.planning.compute import BatchLayout
    from pipeline.planning.memory import StepSetup, memory

    model, train, hw = cfg.model, cfg.train, cfg.hardware
    cuda = hw["device"] == "cuda"
    d, V = model["dim"], model["vocab_size"]
    d_kv = model["n_kv_heads"] * (d // model["n_heads"])
    largest = 4 * max(V * d, d * model["ffn_dim"], d * d, d * d_kv)
    layout = BatchLayout.from_config(cfg)
    loader = 2 * (2 if cuda else 1) * layout.grad_accum_steps * layout.micro_batch * train["seq_len"] * 4 * 8
    parts = {
        "process_mb": TRAIN_RANK_HOST_MB["cuda" if cuda else "cpu"],
        "init_mb": TRAIN_INIT_WEIGHTS * largest / 2**20,
        "loader_mb": loader / 2**20,
        "state_mb": 0.0 if cuda else memory(StepSetup.from_config(cfg, parallel=parallel))["total"] * 1e9 / 2**20,
    }
    gather = 4 * count_params(model)[0] / 2**20 if (parallel or train.get("parallel", "ddp")) != "ddp" else 0.0
    rank = sum(parts.values())
    node = math.ceil(TRAIN_HOST_MARGIN * (hw["nproc_per_node"] * rank + gather))
    return {**{k: round(v, 1) for k, v in parts.items()}, "rank_mb": round(rank, 1),
            "ranks_per_node": hw["nproc_per_node"], "final_gather_mb": round(gather, 1), "node_mb": node}
