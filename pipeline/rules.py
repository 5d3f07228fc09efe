"""The data rules as the cost plan sees them: one `DataRule` per rule, its cost rate beside the rules its
jobs wait for, at one call site each (like datatrove's `examples/fineweb.py`, where a step's resources
and `depends=` sit together).

`pipeline.cluster` reads these: `RATES` is their `rate`s, and `data_jobs` links each job to the jobs of
its `after` rules, the edges Snakemake builds from the rules' inputs (tests/test_cluster.py compares
them with `snakemake --d3dag` on the default config and a preset, edge for edge). Adding a data rule is
one entry here and its `.smk` file (docs/adding-a-rule.md).

Which jobs of an `after` rule a job waits for follows from the wildcards they share: a per-group job
(`{source}/{group}`) waits for the same group's job of a per-group rule, a per-mix job for the same
mix's; otherwise it waits for every job of that rule that it reads (a job's `sources`: count_sample's
sample groups, pack's mix's sources). Torch-free, and imported by no rule's module (so editing a rate
reruns no job but `plan`, which prints the costs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataRule:
    """A data rule: `rate` = (unit, units per CPU-second or None, CPU seconds per job) (see `RULES`);
    `after`: the data rules whose outputs it reads."""

    name: str
    rate: tuple[str, float | None, float]
    after: tuple[str, ...] = ()


# The data stages' cost: CPU seconds of a stage = its jobs × the CPU of a job's start (interpreter,
# imports, its fixed reads) + its work in `unit`s ÷ the rate (units per CPU-second, one single-threaded
# process). Units: bytes of UTF-8 text of the shards it reads (known from a shard's size before any
# tokenizer exists, and the same whatever the vocabulary), documents, packed tokens, shards, the
# tokenizer's train_chars, or none. Fitted by `python benchmarks/data_scale.py calibrate` through two
# Snakemake runs of realistic shards (FineWeb-shaped, 500 and 50K documents of ~2 KB each, 16 and 8
# shards, on the 2-core VM, idle), the tokenizer by its `tokenizer` sweep (16M-256M characters, the
# mean of two sweeps that differed by 23 %; rustbpe at a 4,096 vocabulary): BENCHMARKS.md "The data
# half at scale", with the 1M-document rehearsal that checks them. download is a local copy (an hf
# source's download is network-bound and not predicted). The count jobs parse each shard's doc_rows
# list (documents; count_sample takes count's rate, its own fit was within the noise). A rate of None:
# the work per unit was below the measurement's resolution (these jobs read one small file per shard;
# 8 vs 16 shards made no difference), so only the job's start counts: the mean of the two runs'.
RULES = (
    DataRule("download", ("bytes", 198e6, 0.51)),
    # filter: the whole default chain's 0.61 MB/CPU-s (BENCHMARKS.md "Filter chain", language ID included; the
    # presets' language ID + PII only is faster, so this prices them high); its per-job start is not measured
    DataRule("filter", ("bytes", 0.61e6, 0.5), after=("download",)),
    DataRule("tokenizer", ("train_chars", 6.4e6, 0.5), after=("filter",)),
    DataRule("tokenize", ("bytes", 8.77e6, 0.43), after=("filter", "tokenizer")),
    DataRule("count_sample", ("documents", 12.2e6, 0.49), after=("tokenize",)),
    DataRule("count", ("documents", 12.2e6, 0.47), after=("tokenize",)),
    DataRule("plan", ("none", None, 0.62), after=("count_sample",)),
    DataRule("eval_data", ("none", None, 2.27)),
    DataRule("decontaminate_grams", ("none", None, 2.07), after=("eval_data",)),
    DataRule("decontaminate_flags", ("bytes", 27.4e6, 0.74), after=("filter", "tokenize", "decontaminate_grams")),
    DataRule("decontaminate", ("shards", None, 0.71), after=("decontaminate_grams", "decontaminate_flags")),
    DataRule("dedup_signatures", ("bytes", 37.5e6, 0.67), after=("filter", "tokenize")),
    DataRule("dedup_index", ("shards", None, 0.37), after=("dedup_signatures",)),
    DataRule("dedup_candidates", ("documents", 138e3, 0.55), after=("dedup_index",)),
    DataRule("dedup", ("documents", 1.13e6, 0.57), after=("dedup_index", "dedup_candidates")),
    DataRule("split", ("documents", 299e3, 0.59), after=("dedup", "decontaminate", "tokenize")),
    DataRule("mix", ("documents", 893e3, 0.63), after=("split",)),
    DataRule("pack", ("tokens", 45.3e6, 0.56), after=("mix", "tokenize")),
    # filter_report reads every shard's decisions and a few raw rows; its work is not measured: only a job's start
    DataRule("filter_report", ("none", None, 0.6), after=("filter", "tokenize")),
    DataRule("accounting", ("documents", 781e3, 0.58),
             after=("count", "filter", "dedup", "decontaminate", "split", "tokenize", "pack")),
)
BY_NAME = {r.name: r for r in RULES}
