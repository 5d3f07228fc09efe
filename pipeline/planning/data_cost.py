"""Job sizes for a cluster executor, and what the data stages cost from the measured per-core
throughputs: both read from each rule's spec (pipeline/rules.py: its size function, its rate and the rules it
waits for).

* `job_resources(cfg, rule)`: ``threads`` and ``resources`` of `rule` (its spec's size, pipeline/planning/job_sizes.py).
* `data_costs(cfg, documents, tokens, data_cpus)`: the data stages' job counts, CPU-hours (from `RATES`) and
  wall time on `data_cpus` cores, printed by ``python -m pipeline.plan``.

Torch-free; imported by the Snakefile at parse time.
"""
from __future__ import annotations

import functools
import heapq
import json
import math
from collections.abc import Mapping
from pathlib import Path

from pipeline.config import sample_shards, source_shards
from pipeline.errors import ConfigError
from pipeline.planning.job_sizes import Demand, Rate, corpus, job_cpu_s, shard_sizes, threads
from pipeline.planning.stages import mix_targets, tokenizer_sources
from pipeline.rules import BY_NAME, DATA_RULES, RULES, rule
from pipeline.run_config import RunConfig

# The data stages' cost (pipeline.rules: each data rule's rate beside the rules it waits for).
RATES = {r.name: Rate(*r.rate) for r in RULES if r.rate is not None}  # stage: its Rate
# rustbpe's training threads kept busy on the 2-core VM (its CPU ÷ wall seconds): the tokenizer job's
# speed-up over one core in the wall-time estimate (more cores are not assumed to help more).
TOKENIZER_PARALLELISM = 1.85


FILTER_RATES = Path(__file__).with_name("filter_rates.json")  # benchmarks/filter_chain.py rates --write
WORD_FILTERS = ("gopher_repetition", "gopher_quality", "c4", "fineweb_quality")  # they share one word split


@functools.cache
def filter_rates() -> dict:
    """Each filter's measured rate, the job's ``base`` and the word split's, each ``cpu_s_per_mb`` of the stage's
    input text beside the command, date and machine that measured it, and for the two per-process caches (the
    word split's, language ID's) their fill (pipeline/planning/filter_rates.json)."""
    return json.loads(FILTER_RATES.read_text(encoding="utf-8"))


def _enabled(chain, rates: dict) -> list[str]:
    """The names of the enabled filters of `chain` (a config's ``filter:`` list, or the built filters) that
    `rates` (a rates file's) prices."""
    names = []
    rates = rates["filters"]
    for entry in chain:
        if isinstance(entry, Mapping):
            name = entry["name"]
            enabled = (entry.get("settings") or {}).get("enabled", entry.get("enabled", True))
        else:
            name, enabled = entry.name, entry.enabled
        if name not in rates:
            raise ConfigError(f"filter: no measured rate for filter {name!r}; known: {', '.join(rates)}")
        if enabled:
            names.append(name)
    return names


def _caches(names: list[str], rates: dict) -> list[dict]:
    """The rate entries (with a ``cache``) of the per-process caches a chain of enabled filters `names` fills."""
    out = [rates["words"]] if set(names) & set(WORD_FILTERS) else []
    return out + [rates["filters"][n] for n in names if "cache" in rates["filters"][n]]


def filter_cpu_s_per_mb(chain, rates: dict | None = None) -> float:
    """CPU seconds per MB (10**6 bytes of UTF-8 input text) of a ``filter`` job running `chain` with its caches
    warm: the job's base cost (the shard's read, the decisions' write), the word split once if a word-based
    filter is enabled, and each enabled filter's measured rate, each as if it read every document (a filter
    after one that removes documents reads fewer: the sum errs high). `filter_fill_cpu_s` adds the caches' fill;
    `rates`: a rates file's (default `filter_rates()`)."""
    rates = rates or filter_rates()
    names = _enabled(chain, rates)
    split = rates["words"]["cpu_s_per_mb"] if set(names) & set(WORD_FILTERS) else 0.0
    return rates["base"]["cpu_s_per_mb"] + split + sum(rates["filters"][n]["cpu_s_per_mb"] for n in names)


def cache_misses(cache: dict, mb: float) -> float:
    """The keys a job reading `mb` MB of text computes for `cache` (a rate's ``cache`` entry): its distinct keys
    by Heaps' law, ``keys_per_mb * mb ** beta`` (fitted on real text), while they fit in the cache's ``cap``; past
    that the cache is emptied each time it fills, so the misses grow linearly, a cap's worth per stretch of text
    that holds ``cap`` distinct keys."""
    k, beta, cap = cache["keys_per_mb"], cache["beta"], cache["cap"]
    full_mb = (cap / k) ** (1 / beta)  # the text that fills the cache
    return k * mb ** beta if mb <= full_mb else cap * mb / full_mb


def filter_fill_cpu_s(chain, nbytes: float, rates: dict | None = None) -> float:
    """CPU seconds a ``filter`` job over `nbytes` of text spends filling its per-process caches (the word
    split's chunks, language ID's words), beyond `filter_cpu_s_per_mb`'s warm rate: each cache's misses
    (`cache_misses`) times its measured CPU seconds per key."""
    rates = rates or filter_rates()
    return sum(c["cache"]["cpu_s_per_key"] * cache_misses(c["cache"], nbytes / 1e6)
               for c in _caches(_enabled(chain, rates), rates))


def rate(cfg: RunConfig, stage: str) -> Rate:
    """A data rule's `Rate`: its spec's, the filter's priced from the config's own chain (`filter_cpu_s_per_mb`
    with its caches warm, `filter_fill_cpu_s` per job)."""
    r = RATES[stage]
    if stage == "filter":
        chain = cfg.filter
        r = r._replace(per_s=1e6 / filter_cpu_s_per_mb(chain), fill=functools.partial(filter_fill_cpu_s, chain))
    return r


def job_resources(cfg: RunConfig, name: str, documents: float = 0, tokens: float = 0, train_hours: float = 0) -> dict:
    """{"threads": int, "resources": {...}} of rule `name` (its spec's `size`); `documents`/`tokens`: the corpus
    (`pipeline.planning.job_sizes.corpus`); `train_hours`: the plan's estimate
    (`pipeline.planning.token_plan.train_hours`), the train job's
    runtime × 1.5."""
    spec = rule(name)
    return spec.size(cfg, Demand(rate(cfg, name) if spec.rate else None, documents, tokens, train_hours))


# ----------------------------------------------------------------------------- the data stages' cost

def _mix_tokens(cfg: RunConfig, mix: str) -> tuple[int, int]:
    """(train, val) tokens the pack jobs of `mix` write: its target (the plan's for `tokens: plan`) and at
    most split.val_tokens per source."""
    tokens = cfg.mixes[mix]["tokens"]
    train = mix_targets(cfg, mix) if tokens == "plan" else tokens
    return train or 0, cfg.split.val_tokens * len(cfg.mixes[mix]["weights"])


def data_jobs(cfg: RunConfig, measured: dict | None = None) -> list[dict]:
    """Every data job of the DAG (download … pack, accounting): {name, stage, units, after: [names],
    threads}, in the order Snakemake would find them ready; `units` of RATES[stage]'s unit. A job waits
    for the jobs of its rule's `after` rules (pipeline.rules) that share its wildcards and that it reads.
    A rule's jobs follow from its spec (`_spec_jobs`), but the tokenizer's, count_sample's, dedup_candidates'
    and pack's, listed here; the rules are placed here in the order Snakemake runs ready jobs in, and a data
    rule not placed here comes last (and `_dependency_order` moves a job that waits for it after it)."""
    sizes = shard_sizes(cfg, measured)
    spj, parts = cfg.shards_per_job, cfg.dedup.partitions
    c = corpus(cfg, measured)
    jobs: list[dict] = []
    wildcards: dict[str, dict] = {}  # job name -> its wildcards (source, group, mix, part)
    reads: dict[str, set] = {}  # job name -> the (source, group)s it reads, where not all of them

    def add(name, stage, units=0.0, threads=1, groups_read=None, **wild):
        jobs.append({"name": name, "stage": stage, "units": units, "threads": threads})
        wildcards[name] = wild
        if groups_read is not None:
            reads[name] = set(groups_read)

    def from_spec(*rules):  # the rules' jobs in turn: a shard group's job of each, then the next group's
        for batch in zip(*(_spec_jobs(BY_NAME[r], cfg, sizes, groups, gname) for r in rules), strict=True):
            for r, (name, units, wild, groups_read) in zip(rules, batch):
                add(name, r, units, groups_read=groups_read, **wild)

    shards = {s: source_shards(cfg, s) for s in cfg.sources}
    members = {s: [shards[s][i:i + spj] for i in range(0, len(shards[s]), spj)] for s in shards}
    groups = {s: [len(m) for m in members[s]] for s in shards}
    sample = {s: set(sample_shards(cfg, s)) for s in shards}
    in_sample = {(s, g) for s in shards for g, m in enumerate(members[s]) if set(m) & sample[s]}
    # the plan's sample first, as the rules' priorities run them (workflow/rules/common.smk)
    gname = sorted(((s, g) for s in groups for g in range(len(groups[s]))), key=lambda sg: sg not in in_sample)
    from_spec("download")
    from_spec("filter")
    train_src = tokenizer_sources(cfg)
    chars = min(cfg.tokenizer.train_chars, sum(sizes[s]["bytes"] * sum(groups[s]) for s in train_src))
    add("tokenizer", "tokenizer", chars if cfg.tokenizer.kind == "bpe" else 0, threads=threads(cfg),
        groups_read=[(s, g) for s, g in gname if s in train_src])
    from_spec("eval_data")
    from_spec("decontaminate_grams")
    from_spec("tokenize")
    sample_docs = sum(len(sample[s]) * sizes[s]["documents"] for s in shards)  # (each shard's doc_rows)
    add("count_sample", "count_sample", sample_docs, groups_read=in_sample)
    from_spec("plan")
    from_spec("dedup_signatures", "decontaminate_flags")
    from_spec("count")
    from_spec("dedup_index")
    for p in range(parts):
        add(f"dedup_candidates/{p}", "dedup_candidates", c["documents"] / parts, part=p)
    from_spec("dedup")  # one dedup segment: a fresh run's
    from_spec("dedup_report")
    from_spec("decontaminate")
    from_spec("split")
    mixes = _spec_jobs(BY_NAME["mix"], cfg, sizes, groups, gname)
    for m, (name, units, wild, groups_read) in zip(cfg.mixes, mixes, strict=True):
        add(name, "mix", units, groups_read=groups_read, **wild)
        for split, tokens in zip(("train", "val"), _mix_tokens(cfg, m)):
            add(f"pack/{m}/{split}", "pack", tokens, mix=m,
                groups_read=[(s, g) for s, g in gname if s in cfg.mixes[m]["weights"]])
    from_spec("accounting")
    from_spec("filter_report")
    placed = {j["stage"] for j in jobs}
    for r in DATA_RULES:
        if r not in placed:
            from_spec(r)

    by_stage: dict[str, list[str]] = {}
    for j in jobs:
        by_stage.setdefault(j["stage"], []).append(j["name"])
    for j in jobs:
        own, read = wildcards[j["name"]], reads.get(j["name"])
        j["after"] = [u for r in BY_NAME[j["stage"]].after for u in by_stage.get(r, [])
                      if all(own[k] == v for k, v in wildcards[u].items() if k in own)
                      and (read is None or "group" not in wildcards[u]
                           or (wildcards[u]["source"], wildcards[u]["group"]) in read)]
    return _dependency_order(jobs)


def _spec_jobs(spec, cfg: RunConfig, sizes: dict, groups: dict,
               gname: list) -> list[tuple[str, float, dict, list | None]]:
    """(name, units, wildcards, the (source, group)s it reads or None for all) of each job of data rule `spec`
    as its `scope` makes them: a `source` rule runs one job per shard group, a `mix` rule one per mix (reading
    its mix's sources), a `run` rule one; a job's units are those of its shards (`bytes`, `documents`,
    `tokens` of `sizes`, or `shards`; `none`: 0)."""
    unit = spec.rate[0]

    def units(shards: dict[str, int]) -> float:
        if unit == "none":
            return 0.0
        if unit == "shards":
            return sum(shards.values())
        if unit not in ("bytes", "documents", "tokens"):
            raise ConfigError(f"rule {spec.name}: a job's {unit!r} do not follow from its shards: list its jobs "
                              "in pipeline/planning/data_cost.py data_jobs")
        return sum(sizes[s][unit] * n for s, n in shards.items())

    if spec.scope == "source":
        return [(f"{spec.name}/{s}/{g}", units({s: groups[s][g]}), {"source": s, "group": g}, None)
                for s, g in gname]
    if spec.scope == "mix":
        out = []
        for m in cfg.mixes:
            mine = list(cfg.mixes[m]["weights"])
            out.append((f"{spec.name}/{m}", units({s: sum(groups[s]) for s in mine}), {"mix": m},
                        [(s, g) for s, g in gname if s in mine]))
        return out
    if spec.scope == "run":
        return [(spec.name, units({s: sum(groups[s]) for s in groups}), {}, None)]
    raise ConfigError(f"rule {spec.name}: a data rule of scope {spec.scope!r} has no jobs by default: list them in "
                      "pipeline/planning/data_cost.py data_jobs")


def _dependency_order(jobs: list[dict]) -> list[dict]:
    """`jobs` each after the jobs it waits for, moved no more than that needs (the first ready job in the given
    order goes next: a list already in dependency order comes back as it is)."""
    index = {j["name"]: i for i, j in enumerate(jobs)}
    waiting = {j["name"]: len(set(j["after"])) for j in jobs}
    users: dict[str, list[str]] = {}
    for j in jobs:
        for a in set(j["after"]):
            users.setdefault(a, []).append(j["name"])
    ready = [index[n] for n, w in waiting.items() if not w]
    heapq.heapify(ready)
    out = []
    while ready:
        j = jobs[heapq.heappop(ready)]
        out.append(j)
        for u in users.get(j["name"], []):
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, index[u])
    if len(out) != len(jobs):
        raise ConfigError("pipeline/rules.py: the data rules' `after` edges make a cycle")
    return out


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


def data_costs(cfg: RunConfig, measured: dict | None = None, data_cpus: int = 64) -> dict:
    """The data stages' cost on `data_cpus` cores (a prediction from RATES): per stage its jobs, units,
    CPU hours, wall hours (from its first job's start to its last job's end in `schedule`) and memory per
    job; the whole half's CPU hours, its wall hours (`schedule`'s makespan: the critical path and the
    cores both count) and the critical path alone."""
    jobs = data_jobs(cfg, measured)
    c = corpus(cfg, measured)
    for j in jobs:
        shards = c["shards"] if j["stage"] == "dedup_candidates" else 0
        j["cpu_s"] = job_cpu_s(rate(cfg, j["stage"]), j["units"], shards)
    times = schedule(jobs, data_cpus)
    out = {**{k: round(v) for k, v in c.items()}, "data_cpus": data_cpus,
           "basis": "measured counts" if measured else "estimate (tokens_per_shard_estimate)", "stages": {}}
    for j in jobs:
        st = out["stages"].setdefault(j["stage"], {"unit": RATES[j["stage"]].unit, "jobs": 0, "units": 0.0,
                                                   "cpu_hours": 0.0, "start": math.inf, "end": 0.0})
        st["jobs"] += 1
        st["units"] += j["units"]
        st["cpu_hours"] += j["cpu_s"] / 3600
        st["start"], st["end"] = min(st["start"], times[j["name"]][0]), max(st["end"], times[j["name"]][1])
    for stage, st in out["stages"].items():
        st["wall_hours"] = (st.pop("end") - st.pop("start")) / 3600
        st["job_mem_mb"] = job_resources(cfg, stage, c["documents"], c["tokens"])["resources"]["mem_mb"]
    out["cpu_hours"] = sum(st["cpu_hours"] for st in out["stages"].values())
    out["wall_hours"] = max(t[1] for t in times.values()) / 3600
    out["critical_path_hours"] = critical_path(jobs, data_cpus) / 3600
    return out


def stage_work(cfg: RunConfig, measured: dict | None = None) -> dict[str, dict]:
    """{stage: {jobs, units}} of the data half (`data_jobs`): what `benchmarks/data_scale.py calibrate`
    fits RATES to."""
    out: dict[str, dict] = {}
    for j in data_jobs(cfg, measured):
        w = out.setdefault(j["stage"], {"jobs": 0, "units": 0.0})
        w["jobs"] += 1
        w["units"] += j["units"]
    return out


def format_costs(c: dict) -> str:
    lines = [f"data stages on {c['data_cpus']} CPU cores (a prediction from pipeline.planning.data_cost.RATES; "
             f"{c['shards']:,} "
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
