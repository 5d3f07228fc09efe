"""Job sizes for a cluster executor, and what the data stages cost from the measured per-core
throughputs (each data rule's rate and the rules it waits for: pipeline/rules.py).

* `job_resources(cfg, rule)`: ``threads`` and ``resources`` (``cpus_per_task``, ``mem_mb``,
  ``runtime`` in minutes, and for GPU rules ``gpu`` / ``gres``, ``nodes``, ``tasks``) of each rule,
  computed from the config (the train job's ``mem_mb``: `train_host_memory`, which the plan reports).
  The rules declare them; Snakemake's SLURM executor turns them into
  ``sbatch`` options (a local run uses ``threads`` capped at ``--cores``, and ignores the rest but
  ``mem_mb`` when given ``--resources mem_mb=…``).
* `data_costs(cfg, documents, tokens, data_cpus)`: the data stages' job counts, CPU-hours (from
  `THROUGHPUT`) and wall time on `data_cpus` cores — printed by ``python -m pipeline.plan``.

Sizes come from the measured figures where BENCHMARKS.md has one (the dedup candidate job's memory
per document, the per-core throughputs) and otherwise from stated, generous defaults; a profile's
``set-resources`` overrides any of them. Torch-free; imported by the Snakefile at parse time.
"""
from __future__ import annotations

import heapq
import math

from pipeline.budget import count_params
from pipeline.config import sample_shards, source_shards
from pipeline.rules import BY_NAME, RULES
from pipeline.stages import mix_targets, tokenizer_sources

# The data stages' cost (pipeline.rules: each rule's rate beside the rules it waits for).
RATES = {r.name: r.rate for r in RULES}  # stage: (unit, units per CPU-second, CPU seconds per job)
# rustbpe's training threads kept busy on the 2-core VM (its CPU ÷ wall seconds): the tokenizer job's
# speed-up over one core in the wall-time estimate (more cores are not assumed to help more).
TOKENIZER_PARALLELISM = 1.85
DEDUP_JOB_BASE_MB = 500       # 802 MB measured at 0.5M documents per job (20M documents, 40 jobs)
DEDUP_JOB_BYTES_PER_DOC = 700
DEDUP_MERGE_BYTES_PER_DOC = 60  # 976 MB measured at 20M documents (2.0M candidate pairs)
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
# (265 MB resident after the imports and the process group: BENCHMARKS.md "Building the model on the
# meta device"); the CUDA figure is a stated, generous assumption, not yet measured on a GPU node
# (a rank's ru_maxrss in a real run should replace it).
TRAIN_RANK_HOST_MB = {"cuda": 8_000, "cpu": 1_000}
# build_model draws one fp32 weight at a time on the host: a rank's peak growth beyond its shards was
# measured at 1.7–2× the largest weight (the value plus allocator slack; 128 MB and 16 MB weights, 2 gloo
# ranks: BENCHMARKS.md "Building the model on the meta device").
TRAIN_INIT_WEIGHTS = 2
TRAIN_HOST_MARGIN = 1.25
SIZE_FIELDS = ("documents", "tokens", "bytes")


def threads(cfg: dict) -> int:
    """Threads of the multi-threaded rules: hardware.cpus_per_task, or 0 → 256 ("all": a local run's
    --cores caps it)."""
    return cfg["hardware"]["cpus_per_task"] or 256


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


def shard_sizes(cfg: dict, measured: dict | None = None) -> dict[str, dict[str, float]]:
    """{source: {documents, tokens, bytes}} per shard: the measured means when given (`measured_sizes`),
    else from the source's tokens_per_shard_estimate (GPT-2 tokens: BYTES_PER_ESTIMATED_TOKEN,
    TOKENS_PER_DOCUMENT), else 0 (unknown)."""
    out = {}
    for s, src in cfg["sources"].items():
        m = (measured or {}).get(s)
        if m:
            out[s] = {f: m[f] for f in SIZE_FIELDS}
        else:
            t = src.get("tokens_per_shard_estimate") or 0
            out[s] = {"documents": t / TOKENS_PER_DOCUMENT, "tokens": t, "bytes": t * BYTES_PER_ESTIMATED_TOKEN}
    return out


def _n_shards(cfg: dict, source: str) -> int:
    return len(source_shards(cfg, source))


def _all_shards(cfg: dict) -> int:
    return sum(_n_shards(cfg, s) for s in cfg["sources"])


def corpus(cfg: dict, measured: dict | None = None) -> dict[str, float]:
    """{documents, tokens, bytes, shards} of every configured shard."""
    sizes = shard_sizes(cfg, measured)
    n = {s: _n_shards(cfg, s) for s in cfg["sources"]}
    return {**{f: sum(sizes[s][f] * n[s] for s in n) for f in SIZE_FIELDS}, "shards": sum(n.values())}


def dedup_job_mb(docs_per_job: float) -> int:
    return math.ceil(DEDUP_JOB_BASE_MB + DEDUP_JOB_BYTES_PER_DOC * docs_per_job / 2**20)


def job_cpu_s(stage: str, units: float, shards: int = 0) -> float:
    """CPU seconds of one job of `stage` doing `units` of work (RATES); a dedup candidate job also opens
    the band-key files of every one of the corpus's `shards`."""
    _, rate, per_job = RATES[stage]
    opens = shards * DEDUP_JOB_SHARD_CPU_S if stage == "dedup_candidates" else 0.0
    return per_job + opens + (units / rate if rate else 0.0)


def job_resources(cfg: dict, rule: str, documents: float = 0, tokens: float = 0, train_hours: float = 0) -> dict:
    """{"threads": int, "resources": {...}} of `rule`; `documents`/`tokens`: the corpus (see `corpus`);
    `train_hours`: the plan's estimate (`pipeline.plan.train_hours`), the train job's runtime × 1.5."""
    hw = cfg["hardware"]
    many = threads(cfg)
    cuda = hw["device"] == "cuda"
    spj = cfg["shards_per_job"]
    sizes = list(shard_sizes(cfg).values()) or [dict.fromkeys(SIZE_FIELDS, 0)]
    shard_tokens = max(z["tokens"] for z in sizes)
    shard_bytes = max(z["bytes"] for z in sizes)
    one = {"threads": 1}
    if rule == "download":
        return {**one, "resources": {"mem_mb": 2000, "runtime": 30 + 10 * spj}}  # network-bound: 10 min a shard
    if rule == "tokenize":  # (the count tables are joined from its metadata: nothing else tokenizes)
        # one shard at a time: its text (~4.5 B/token) and tokens (4 B), twice over while converting
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(17 * shard_tokens / 2**20),
                                     "runtime": _minutes(job_cpu_s(rule, spj * shard_bytes))}}
    if rule == "filter":  # one shard's kept rows and decisions at a time: its text, twice over while writing
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(9 * shard_tokens / 2**20),
                                     "runtime": _minutes(job_cpu_s(rule, spj * shard_bytes))}}
    if rule in ("dedup_signatures", "decontaminate_flags"):  # one record batch of text at a time
        return {**one, "resources": {"mem_mb": 2000 + math.ceil(9 * shard_tokens / 2**20),
                                     "runtime": _minutes(job_cpu_s(rule, spj * shard_bytes))}}
    if rule == "dedup_candidates":
        parts = cfg["dedup"]["partitions"]
        return {**one, "resources": {"mem_mb": dedup_job_mb(documents / parts),
                                     "runtime": _minutes(job_cpu_s(rule, documents / parts, _all_shards(cfg)))}}
    if rule == "dedup":  # the merge: candidate pairs of the whole corpus, then one shard's keep list at a time
        return {**one, "resources": {"mem_mb": 1000 + math.ceil(DEDUP_MERGE_BYTES_PER_DOC * documents / 2**20),
                                     "runtime": _minutes(job_cpu_s(rule, documents))}}
    if rule == "tokenizer":
        chars = cfg["tokenizer"]["train_chars"]
        return {"threads": many, "resources": {"cpus_per_task": many, "mem_mb": 4000 + math.ceil(12 * chars / 2**20),
                                               "runtime": _minutes(job_cpu_s(rule, chars), safety=5)}}
    if rule in ("plan", "accounting", "eval_data", "decontaminate_grams", "stages_report", "filter_report"):
        return {**one, "resources": {"mem_mb": 2000, "runtime": MIN_RUNTIME}}
    if rule in ("split", "mix", "pack"):  # memory not measured at scale: a generous default (profile's set-resources)
        cpu = job_cpu_s(rule, tokens if rule == "pack" else documents)
        return {**one, "resources": {"mem_mb": UNMEASURED_MB, "runtime": _minutes(cpu, safety=10)}}
    if rule == "train":
        nodes, nproc = hw["nodes"], hw["nproc_per_node"]
        res = {"cpus_per_task": many, "nodes": nodes, "runtime": math.ceil(90 * train_hours) + 30,
               "mem_mb": train_host_memory(cfg)["node_mb"]}
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


def train_host_memory(cfg: dict) -> dict:
    """Host memory of one node of the train job, in MB (2^20 bytes), from the config: what the train
    rule requests (``mem_mb``) and the plan reports. Every rank of the node holds its fixed footprint
    (`TRAIN_RANK_HOST_MB`), the weight being initialised (`TRAIN_INIT_WEIGHTS` × the largest fp32
    weight: the model is built on the meta device and each weight drawn on the host in turn,
    pipeline.training.step.build_model — no rank holds the whole model) and the loader's batches (one
    step read ahead and the one in use, each also in pinned memory on CUDA: 4 int64-sized tensors per
    token position, inputs, targets, mask, document ids); on a CPU run also its training state, which
    lives on the host (`pipeline.perf.memory`'s total per rank). Under fsdp, rank 0 gathers the whole fp32
    model on the host to write final.pt (pipeline.training.checkpoint.full_model_state); ``parallel:
    auto`` not yet resolved counts as fsdp, the larger. The sum × `TRAIN_HOST_MARGIN`, rounded up, is
    ``node_mb``; the parts are in MB per rank (``rank_mb`` their sum) and per node (``final_gather_mb``)."""
    from pipeline.budget import BatchLayout
    from pipeline.perf import StepSetup, memory

    model, train, hw = cfg["model"], cfg["train"], cfg["hardware"]
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
        "state_mb": 0.0 if cuda else memory(StepSetup.from_config(cfg))["total"] * 1e9 / 2**20,
    }
    gather = 4 * count_params(model)[0] / 2**20 if train.get("parallel", "ddp") != "ddp" else 0.0
    rank = sum(parts.values())
    node = math.ceil(TRAIN_HOST_MARGIN * (hw["nproc_per_node"] * rank + gather))
    return {**{k: round(v, 1) for k, v in parts.items()}, "rank_mb": round(rank, 1),
            "ranks_per_node": hw["nproc_per_node"], "final_gather_mb": round(gather, 1), "node_mb": node}


# ----------------------------------------------------------------------------- the data stages' cost

def _mix_tokens(cfg: dict, mix: str) -> tuple[int, int]:
    """(train, val) tokens the pack jobs of `mix` write: its target (the plan's for `tokens: plan`) and at
    most split.val_tokens per source."""
    tokens = cfg["mixes"][mix]["tokens"]
    train = mix_targets(cfg, mix) if tokens == "plan" else tokens
    return train or 0, cfg["split"]["val_tokens"] * len(cfg["mixes"][mix]["weights"])


def data_jobs(cfg: dict, measured: dict | None = None) -> list[dict]:
    """Every data job of the DAG (download … pack, accounting): {name, stage, units, after: [names],
    threads}, in the order Snakemake would find them ready; `units` of RATES[stage]'s unit. A job waits
    for the jobs of its rule's `after` rules (pipeline.rules) that share its wildcards and that it reads."""
    sizes = shard_sizes(cfg, measured)
    spj, parts = cfg["shards_per_job"], cfg["dedup"]["partitions"]
    c = corpus(cfg, measured)
    jobs: list[dict] = []
    wildcards: dict[str, dict] = {}  # job name -> its wildcards (source, group, mix, part)
    reads: dict[str, set] = {}  # job name -> the (source, group)s it reads, where not all of them

    def add(name, stage, units=0.0, threads=1, groups_read=None, **wild):
        jobs.append({"name": name, "stage": stage, "units": units, "threads": threads})
        wildcards[name] = wild
        if groups_read is not None:
            reads[name] = set(groups_read)

    shards = {s: source_shards(cfg, s) for s in cfg["sources"]}
    members = {s: [shards[s][i:i + spj] for i in range(0, len(shards[s]), spj)] for s in shards}
    groups = {s: [len(m) for m in members[s]] for s in shards}
    sample = {s: set(sample_shards(cfg, s)) for s in shards}
    in_sample = {(s, g) for s in shards for g, m in enumerate(members[s]) if set(m) & sample[s]}
    # the plan's sample first, as the rules' priorities run them (workflow/rules/common.smk)
    gname = sorted(((s, g) for s in groups for g in range(len(groups[s]))), key=lambda sg: sg not in in_sample)
    for s, g in gname:
        add(f"download/{s}/{g}", "download", groups[s][g] * sizes[s]["bytes"], source=s, group=g)
    for s, g in gname:
        add(f"filter/{s}/{g}", "filter", groups[s][g] * sizes[s]["bytes"], source=s, group=g)
    train_src = tokenizer_sources(cfg)
    chars = min(cfg["tokenizer"]["train_chars"], sum(sizes[s]["bytes"] * sum(groups[s]) for s in train_src))
    add("tokenizer", "tokenizer", chars if cfg["tokenizer"]["kind"] == "bpe" else 0, threads=threads(cfg),
        groups_read=[(s, g) for s, g in gname if s in train_src])
    add("eval_data", "eval_data")
    add("decontaminate_grams", "decontaminate_grams")
    for s, g in gname:
        add(f"tokenize/{s}/{g}", "tokenize", groups[s][g] * sizes[s]["bytes"], source=s, group=g)
    sample_docs = sum(len(sample[s]) * sizes[s]["documents"] for s in shards)  # (each shard's doc_rows)
    add("count_sample", "count_sample", sample_docs, groups_read=in_sample)
    add("plan", "plan")
    for s, g in gname:
        add(f"dedup_signatures/{s}/{g}", "dedup_signatures", groups[s][g] * sizes[s]["bytes"], source=s, group=g)
        add(f"decontaminate_flags/{s}/{g}", "decontaminate_flags", groups[s][g] * sizes[s]["bytes"],
            source=s, group=g)
    add("count", "count", c["documents"])
    add("dedup_index", "dedup_index", c["shards"])
    for p in range(parts):
        add(f"dedup_candidates/{p}", "dedup_candidates", c["documents"] / parts, part=p)
    add("dedup", "dedup", c["documents"])
    add("decontaminate", "decontaminate", c["shards"])
    add("split", "split", c["documents"])
    for m in cfg["mixes"]:
        docs = sum(sizes[s]["documents"] * sum(groups[s]) for s in cfg["mixes"][m]["weights"])
        add(f"mix/{m}", "mix", docs, mix=m)
        for split, tokens in zip(("train", "val"), _mix_tokens(cfg, m)):
            add(f"pack/{m}/{split}", "pack", tokens, mix=m,
                groups_read=[(s, g) for s, g in gname if s in cfg["mixes"][m]["weights"]])
    add("accounting", "accounting", c["documents"])
    add("filter_report", "filter_report")

    by_stage: dict[str, list[str]] = {}
    for j in jobs:
        by_stage.setdefault(j["stage"], []).append(j["name"])
    for j in jobs:
        own, read = wildcards[j["name"]], reads.get(j["name"])
        j["after"] = [u for rule in BY_NAME[j["stage"]].after for u in by_stage.get(rule, [])
                      if all(own[k] == v for k, v in wildcards[u].items() if k in own)
                      and (read is None or "group" not in wildcards[u]
                           or (wildcards[u]["source"], wildcards[u]["group"]) in read)]
    return jobs


def schedule(jobs: list[dict], cores: int) -> dict[str, tuple[float, float]]:
    """{name: (start, end) seconds} of `jobs` (`data_jobs`, with a `cpu_s` each) run on `cores` cores by a
    greedy list scheduler, as Snakemake runs them: whenever cores are free, the first ready jobs in
    order take them; a job of t threads holds min(t, cores) cores. A tokenizer job runs
    TOKENIZER_PARALLELISM times faster than its CPU seconds."""
    waiting = {j["name"]: set(j["after"]) for j in jobs}
    users: dict[str, list[str]] = {}
    for j in jobs:
        for a in j["after"]:
            users.setdefault(a, []).append(j["name"])
    by_name = {j["name"]: j for j in jobs}
    order = {j["name"]: i for i, j in enumerate(jobs)}
    ready = [order[n] for n, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    running: list[tuple[float, str]] = []
    free, now, out = cores, 0.0, {}
    while ready or running:
        while ready:
            j = jobs[ready[0]]
            need = min(j["threads"], cores)
            if need > free:
                break
            heapq.heappop(ready)
            free -= need
            out[j["name"]] = (now, now + _duration(j, cores))
            heapq.heappush(running, (out[j["name"]][1], j["name"]))
        now, name = heapq.heappop(running)
        free += min(by_name[name]["threads"], cores)
        for u in users.get(name, []):
            waiting[u].discard(name)
            if not waiting[u]:
                heapq.heappush(ready, order[u])
    return out


def _duration(job: dict, cores: int) -> float:
    """Seconds a job runs: its CPU seconds, the tokenizer's divided by its threads' speed-up."""
    if job["stage"] == "tokenizer":
        return job["cpu_s"] / max(1.0, min(job["threads"], cores, TOKENIZER_PARALLELISM))
    return job["cpu_s"]


def critical_path(jobs: list[dict], cores: int) -> float:
    """Seconds of the longest chain of dependent jobs: the wall time no number of `cores` goes below."""
    done: dict[str, float] = {}
    for j in jobs:  # data_jobs lists every job after the jobs it waits for
        done[j["name"]] = max((done[a] for a in j["after"]), default=0.0) + _duration(j, cores)
    return max(done.values(), default=0.0)


def data_costs(cfg: dict, measured: dict | None = None, data_cpus: int = 64) -> dict:
    """The data stages' cost on `data_cpus` cores (a prediction from RATES): per stage its jobs, units,
    CPU hours, wall hours (from its first job's start to its last job's end in `schedule`) and memory per
    job; the whole half's CPU hours, its wall hours (`schedule`'s makespan: the critical path and the
    cores both count) and the critical path alone."""
    jobs = data_jobs(cfg, measured)
    c = corpus(cfg, measured)
    for j in jobs:
        j["cpu_s"] = job_cpu_s(j["stage"], j["units"], c["shards"])
    times = schedule(jobs, data_cpus)
    out = {**{k: round(v) for k, v in c.items()}, "data_cpus": data_cpus,
           "basis": "measured counts" if measured else "estimate (tokens_per_shard_estimate)", "stages": {}}
    for j in jobs:
        st = out["stages"].setdefault(j["stage"], {"unit": RATES[j["stage"]][0], "jobs": 0, "units": 0.0,
                                                   "cpu_hours": 0.0, "start": math.inf, "end": 0.0})
        st["jobs"] += 1
        st["units"] += j["units"]
        st["cpu_hours"] += j["cpu_s"] / 3600
        st["start"], st["end"] = min(st["start"], times[j["name"]][0]), max(st["end"], times[j["name"]][1])
    for stage, st in out["stages"].items():
        st["wall_hours"] = (st.pop("end") - st.pop("start")) / 3600
        reducer = stage in ("count", "count_sample", "dedup_index", "decontaminate")  # sized as the plan rule
        rule = "plan" if reducer else stage
        st["job_mem_mb"] = job_resources(cfg, rule, c["documents"], c["tokens"])["resources"]["mem_mb"]
    out["cpu_hours"] = sum(st["cpu_hours"] for st in out["stages"].values())
    out["wall_hours"] = max(t[1] for t in times.values()) / 3600
    out["critical_path_hours"] = critical_path(jobs, data_cpus) / 3600
    return out


def stage_work(cfg: dict, measured: dict | None = None) -> dict[str, dict]:
    """{stage: {jobs, units}} of the data half (`data_jobs`): what `benchmarks/data_scale.py calibrate`
    fits RATES to."""
    out: dict[str, dict] = {}
    for j in data_jobs(cfg, measured):
        w = out.setdefault(j["stage"], {"jobs": 0, "units": 0.0})
        w["jobs"] += 1
        w["units"] += j["units"]
    return out


def format_costs(c: dict) -> str:
    lines = [f"data stages on {c['data_cpus']} CPU cores (a prediction from pipeline.cluster.RATES; {c['shards']:,} "
             f"shards, {c['bytes'] / 1e9:,.1f} GB of text, {c['tokens'] / 1e9:,.1f}B tokens, "
             f"{c['documents'] / 1e6:,.1f}M documents: {c['basis']})",
             f"  {'stage':<22}{'jobs':>7}{'CPU-hours':>11}{'wall h':>9}{'mem/job':>10}"]
    for name, s in c["stages"].items():
        lines.append(f"  {name:<22}{s['jobs']:>7,}{s['cpu_hours']:>11,.2f}{s['wall_hours']:>9,.2f}"
                     f"{s['job_mem_mb'] / 1000:>8,.1f}GB")
    lines.append(f"  {'total':<22}{sum(s['jobs'] for s in c['stages'].values()):>7,}{c['cpu_hours']:>11,.2f}"
                 f"{c['wall_hours']:>9,.2f}   (wall: the stages overlap; critical path alone "
                 f"{c['critical_path_hours']:,.2f} h)")
    lines.append("  download is costed as a local copy (an hf source's is network-bound); the tokenizer at a 4,096 "
                 "vocabulary (a larger one's extra merges are not measured)")
    return "\n".join(lines)
