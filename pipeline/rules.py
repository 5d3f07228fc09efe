"""Every rule of the workflow, one `Rule` each: what a rule is, in one place (like datatrove's
`examples/fineweb.py`, where a step's config, resources and `depends=` sit at one call site).

A rule's entry says its `modules` (the ``python -m`` modules its code hash covers), `params` and `scope`
(its config slice: a function of pipeline/config/rule_params.py, or `MODULE_SLICE`, the `Keys` its module
declares), `size` (pipeline/planning/job_sizes.py), for a data rule its cost `rate` and `after` edges, and
`shard_chain` (its SLURM group job).

- `RULES`, `BY_NAME`, `DATA_RULES`, `rule(name)`: the table;
- `rule_params`, `job_params`: what workflow/rules/common.smk reads for a job.

Torch-free and snakemake-free. The fields in full and how the rates were fitted: docs/architecture.md,
"The rule table"; adding a rule: docs/adding-a-rule.md.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import rule_params as rp
from pipeline.errors import ConfigError
from pipeline.planning import job_sizes, sweep
from pipeline.planning.stages import stage_config
from pipeline.run_config import RunConfig, run_config

SCOPES = ("run", "source", "mix", "stage", "point", "fit")  # what narrows a rule's slice per job
MODULE_SLICE = "SLICE"  # a spec's `params`: the `SLICE = Keys(...)` its first module declares (`declared_slice`)


def declared_slice(module: str) -> rp.Keys:
    """The `SLICE = Keys(...)` that package module `module` declares at its top level, read from its source (not
    imported: the table stays light, and the module's code hash holds its slice without the table). Its
    arguments are literals or constants of pipeline/config/rule_params.py (`TEXT_KEYS`)."""
    path = Path(__file__).resolve().parent.parent.joinpath(*module.split(".")).with_suffix(".py")
    where = f"{module}:{MODULE_SLICE}"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [MODULE_SLICE]:
            call = node.value
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Keys"):
                break

            def value(arg):
                if isinstance(arg, ast.Name) and isinstance(getattr(rp, arg.id, None), (str, tuple)):
                    return getattr(rp, arg.id)
                return ast.literal_eval(arg)

            try:
                return rp.Keys(*map(value, call.args), **{k.arg: value(k.value) for k in call.keywords},
                               where=where)
            except (ValueError, TypeError, SyntaxError) as e:
                raise ConfigError(f"{where}: Keys(...) takes literals or rule_params constants ({e})") from None
    raise ConfigError(f"{path}: no top-level `{MODULE_SLICE} = Keys(...)` (its rule's spec has params=MODULE_SLICE)")


@dataclass(frozen=True)
class Rule:
    """One rule of the workflow (see docs/architecture.md, "The rule table")."""

    name: str
    modules: tuple[str, ...]
    params: Callable | str | None  # a slice function, or MODULE_SLICE (read as the module's Keys)
    size: Callable[[RunConfig, job_sizes.Demand], dict]
    scope: str = "run"
    rate: tuple[str, float | None, float] | None = None
    after: tuple[str, ...] = ()
    shard_chain: bool = False

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"pipeline/rules.py: rule {self.name}'s scope {self.scope!r} is not one of {SCOPES}")
        if self.params == MODULE_SLICE:
            object.__setattr__(self, "params", declared_slice(self.entries[0]))

    @property
    def entries(self) -> tuple[str, ...]:
        """The full names of `modules` (what `python -m` runs and `pipeline.codehash.code_version` takes)."""
        return tuple(f"{__package__}.{m}" for m in self.modules)


RULES = (
    # ---- the data rules, in DAG order (each after the rules it waits for)
    Rule("download", ("data.download",), rp.download_slice, job_sizes.download_size, "source",
         rate=("bytes", 198e6, 0.51), shard_chain=True),
    # filter: its bytes per CPU-second are its config's chain's, the sum of each filter's measured rate
    # (pipeline.planning.data_cost.rate, filter_rates.json) with its caches warm, plus each job's cache fill;
    # its per-job start is not measured
    Rule("filter", ("data.filter",), rp.filter_slice, job_sizes.shard_text_size, "source",
         rate=("bytes", None, 0.5), after=("download",), shard_chain=True),
    Rule("tokenizer", ("data.train_tokenizer",), rp.tokenizer_slice, job_sizes.tokenizer_size,
         rate=("train_chars", 6.4e6, 0.5), after=("filter",)),
    Rule("tokenize", ("data.tokenize",), rp.tokenize_slice, job_sizes.tokenize_size, "source",
         rate=("bytes", 8.77e6, 0.43), after=("filter", "tokenizer"), shard_chain=True),
    Rule("count_sample", ("data.count",), None, job_sizes.small_size,
         rate=("documents", 12.2e6, 0.49), after=("tokenize",)),
    Rule("count", ("data.count",), None, job_sizes.small_size,
         rate=("documents", 12.2e6, 0.47), after=("tokenize",)),
    Rule("plan", ("plan",), rp.plan_slice, job_sizes.small_size,
         rate=("none", None, 0.62), after=("count_sample",)),
    Rule("eval_data", ("data.eval_data",), rp.eval_data_slice, job_sizes.small_size,
         rate=("none", None, 2.27)),
    Rule("decontaminate_grams", ("data.decontaminate",), rp.decontaminate_grams_slice, job_sizes.small_size,
         rate=("none", None, 2.07), after=("eval_data",)),
    Rule("decontaminate_flags", ("data.decontaminate",), rp.decontaminate_slice, job_sizes.shard_text_size,
         "source", rate=("bytes", 27.4e6, 0.74), after=("filter", "tokenize", "decontaminate_grams")),
    Rule("decontaminate", ("data.decontaminate",), rp.decontaminate_grams_slice, job_sizes.small_size,
         rate=("shards", None, 0.71), after=("decontaminate_grams", "decontaminate_flags")),
    Rule("dedup_signatures", ("data.dedup",), rp.dedup_signatures_slice, job_sizes.shard_text_size, "source",
         rate=("bytes", 37.5e6, 0.67), after=("filter", "tokenize"), shard_chain=True),
    # dedup_index, dedup_candidates and dedup run per segment (a fresh run is one; workflow/rules/dedup.smk); the
    # index job checks the dedup.reference files' sha256, which the rehearsal (no reference) does not measure
    Rule("dedup_index", ("data.dedup",), rp.dedup_slice, job_sizes.small_size,
         rate=("shards", None, 0.37), after=("dedup_signatures",)),
    Rule("dedup_candidates", ("data.dedup",), rp.dedup_slice, job_sizes.dedup_candidates_size,
         rate=("documents", 138e3, 0.55), after=("dedup_index",)),
    Rule("dedup", ("data.dedup",), rp.dedup_slice, job_sizes.dedup_size,
         rate=("documents", 1.13e6, 0.57), after=("dedup_index", "dedup_candidates")),
    # dedup_report sums the segments' reports and writes the index manifest: only a job's start (not measured)
    Rule("dedup_report", ("data.dedup",), rp.dedup_slice, job_sizes.small_size,
         rate=("none", None, 0.6), after=("dedup",)),
    Rule("split", ("data.split",), rp.split_slice, job_sizes.unmeasured_size,
         rate=("documents", 299e3, 0.59), after=("dedup_report", "decontaminate", "tokenize")),
    Rule("mix", ("data.mix",), rp.mix_slice, job_sizes.unmeasured_size, "mix",
         rate=("documents", 893e3, 0.63), after=("split",)),
    Rule("pack", ("data.pack",), rp.pack_slice, job_sizes.unmeasured_size, "mix",
         rate=("tokens", 45.3e6, 0.56), after=("mix", "tokenize")),
    # filter_report reads every shard's decisions and a few raw rows; its work is not measured: only a job's start
    Rule("filter_report", ("data.filter_report",), rp.filter_report_slice, job_sizes.small_size,
         rate=("none", None, 0.6), after=("filter", "tokenize")),
    Rule("accounting", ("data.accounting",), rp.accounting_slice, job_sizes.small_size,
         rate=("documents", 781e3, 0.58),
         after=("count", "filter", "dedup_report", "decontaminate", "split", "tokenize", "pack")),
    # ---- training, evaluation and what follows them
    Rule("train", ("training.launch", "training.rendezvous", "training.train"),
         rp.train_slice, job_sizes.train_size, "stage"),
    # a stage's jobs before its last when it is longer than the cluster's job limit (workflow/rules/train.smk)
    Rule("train_segment", ("training.launch", "training.rendezvous", "training.train"),
         rp.train_slice, job_sizes.train_size, "stage"),
    Rule("evaluate", ("evaluation.evaluate",), rp.evaluate_slice, job_sizes.evaluate_size, "stage"),
    Rule("stages_report", ("evaluation.stages_report",), rp.evaluate_slice, job_sizes.small_size),
    Rule("export", ("evaluation.export",), rp.export_slice, job_sizes.export_size),
    # the IsoFLOP sweep: a point trains and evaluates with the train rule's trainer (its params: its own view of
    # the config, pipeline.planning.sweep); the fit reads the points
    Rule("scaling_point", ("training.launch", "training.train", "evaluation.evaluate"),
         sweep.point_params, job_sizes.scaling_point_size, "point"),
    Rule("scaling", ("evaluation.scaling",), sweep.fit_params, job_sizes.fit_size, "fit"),
)
BY_NAME = {r.name: r for r in RULES}
DATA_RULES = tuple(r.name for r in RULES if r.rate is not None)


def rule(name: str) -> Rule:
    """The spec of rule `name`; a KeyError naming the rules when there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no rule {name!r} in pipeline/rules.py (rules: {', '.join(BY_NAME)})") from None


def rule_params(cfg: dict, name: str, source: str | None = None, mix: str | None = None) -> dict:
    """The config slice of rule `name` (its `params`), narrowed to `source` / `mix` when given: what the rule
    declares as `params:` (for a `stage` rule, before `pipeline.planning.stages.stage_config` takes the job's stage)."""
    spec = rule(name)
    if spec.params is None or spec.scope in ("point", "fit"):
        raise KeyError(f"rule {name!r} has no config slice of its own ({spec.scope} params)" if spec.params
                       else f"rule {name!r} takes no config slice")
    return rp.cut(spec.params, cfg, source, mix)


def job_params(cfg: dict, name: str, wildcards=None) -> dict:
    """What a job of rule `name` declares as its `p` param: the rule's config slice narrowed by its `scope` to
    the job's `wildcards` (its source, its mix, its training stage through `stage_config`, its scaling point);
    a `run` or `fit` rule has one slice for all its jobs (no wildcards). `cfg` is plain data (Snakemake's config);
    what pipeline.planning computes a slice with is typed here."""
    spec = rule(name)
    if spec.scope == "run":
        return rule_params(cfg, name)
    if spec.scope == "fit":
        return spec.params(run_config(cfg))
    if spec.scope == "source":
        return rule_params(cfg, name, source=wildcards.source)
    if spec.scope == "mix":
        return rule_params(cfg, name, mix=wildcards.mix)
    if spec.scope == "stage":
        return stage_config(run_config(rule_params(cfg, name)), wildcards.stage)
    return spec.params(run_config(cfg), float(wildcards.budget), int(wildcards.depth))  # point


def feeds_tokenizer(name: str) -> bool:
    """Whether the tokenizer job waits, directly or not, for rule `name`'s jobs (download, filter)."""
    todo, seen = list(BY_NAME["tokenizer"].after), set()
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo += BY_NAME[r].after
    return name in seen
