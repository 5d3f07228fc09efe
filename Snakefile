# tokenfarm: raw web-text shards -> tokenizer -> counts -> tokenize -> dedup -> split -> mixes ->
# packed rows -> plan -> DDP training -> evaluation. Rules are thin shells around
# `python -m pipeline.<stage>`; all logic lives in the `pipeline` package (see docs/data-contract.md).
import sys
from pathlib import Path

import yaml
from snakemake.utils import min_version, validate
from snakemake_interface_executor_plugins.settings import DeploymentMethod

min_version("9.0")

BASE = Path(workflow.basedir)
sys.path.insert(0, str(BASE))
from pipeline import config as tfc  # noqa: E402
from pipeline.plan import PlanError, format_plan, make_plan  # noqa: E402

# ---------------------------------------------------------------------------- configuration
# config.yaml is the default run. A --configfile replaces it (presets are complete configs, never
# merged key-by-key with the default); --config KEY=VALUE overrides apply on top of either.
if not workflow.overwrite_configfiles:
    _default = Path("config.yaml") if Path("config.yaml").exists() else BASE / "config.yaml"
    with open(_default) as _f:
        _merged = tfc.deep_merge(yaml.safe_load(_f) or {}, config)
    config.clear()
    config.update(_merged)
try:
    _resolved = tfc.resolve_config(config)
except tfc.ConfigError as _e:
    sys.exit(f"tokenfarm: {_e}")
config.clear()
config.update(_resolved)
validate(config, BASE / "workflow" / "schemas" / "config.schema.yaml")

RUN = config["run_name"]
R = str(tfc.run_dir(config))  # results of this run
D = config["data_dir"]  # ingested shards
LOGS = f"logs/{RUN}"
SOURCES = list(config["sources"])
try:
    SHARDS = {s: tfc.source_shards(config, s) for s in SOURCES}
    GROUPS = {s: tfc.shard_groups(config, s) for s in SOURCES}
except tfc.ConfigError as _e:
    sys.exit(f"tokenfarm: {_e}")
TOKENIZER = f"{R}/tokenizer/tokenizer.json"
ALL_CORES = 256  # "as many threads as allowed": Snakemake caps a job's threads at --cores
TRAIN_MIX = config["train"]["mix"]


def P(stage):
    """A stage's config slice as canonical JSON: declared as params so edits rerun the rule."""
    return tfc.params_json(tfc.stage_params(config, stage))


def P_source(stage):
    """Param function of a per-shard rule: the slice for the job's own source only."""
    return lambda w: tfc.params_json(tfc.stage_params(config, stage, w.source))


def CODE(*modules):
    """Hash of the stage's module source: declared as params so code edits rerun the rule."""
    return tfc.code_version(*modules)


# Per-shard stages run one job per group of `shards_per_job` shards (see pipeline/manifest.py): each
# shard's files are written by the stage, and the job's declared output is the group's manifest
# `<dir>/{source}/_manifest/{group}.json`. Downstream rules depend on manifests and are handed the
# per-shard paths, which keeps the DAG small for thousands of shards.
def manifests(prefix, sources=None):
    return [f"{prefix}/{s}/_manifest/{g}.json" for s in (sources or SOURCES) for g in GROUPS[s]]


def shard_paths(pattern, sources=None):
    """Expand `pattern` over every shard of `sources` (default: all)."""
    return [pattern.format(source=s, shard=sh) for s in (sources or SOURCES) for sh in SHARDS[s]]


def group_shards(w):
    return " ".join(GROUPS[w.source][w.group])


def group_paths(pattern):
    """Input/param function: `pattern` expanded over the shards of the job's group."""
    return lambda w: [pattern.format(source=w.source, shard=sh) for sh in GROUPS[w.source][w.group]]


def mix_sources(mix):
    return list(config["mixes"][mix]["weights"])


# Rules find the project's venv and package without activation; with --sdm conda the env's python
# is used instead and the package is found through PYTHONPATH. A prefix of our own replaces
# Snakemake's default `set -euo pipefail`, so it is restated: a stage failing inside
# `… 2>&1 | tee log` or inside a per-shard loop must fail the job.
# (shell.prefix is formatted by Snakemake, hence the doubled braces.)
_prefix = f'set -euo pipefail; export PYTHONPATH="{BASE}:${{{{PYTHONPATH:-}}}}"; export TOKENFARM_PROGRESS="${{{{TOKENFARM_PROGRESS:-0}}}}"; '
if DeploymentMethod.CONDA not in workflow.deployment_settings.deployment_method:
    _prefix += f'export PATH="{Path(sys.executable).parent}:$PATH"; '
shell.prefix(_prefix)

wildcard_constraints:
    source="|".join(SOURCES),
    group=r"[A-Za-z0-9_.\-]+",
    mix="|".join(config["mixes"]),
    split="train|val",

# ---------------------------------------------------------------------------- the plan, up front
# Computed at parse time from the config and, once they exist, the measured token counts: every
# invocation (including `snakemake -n`) shows it before anything is downloaded.
_counts = Path(R) / "counts" / "counts.parquet"
try:
    PLAN = make_plan(config, counts=_counts if _counts.exists() else None, strict_counts=False)
except (PlanError, tfc.ConfigError) as _e:
    sys.exit(f"tokenfarm: the token-budget plan is not feasible:\n  {_e}")
print(format_plan(PLAN), file=sys.stderr)


include: "workflow/rules/download.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/count.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/dedup.smk"
include: "workflow/rules/split.smk"
include: "workflow/rules/mix.smk"
include: "workflow/rules/pack.smk"
include: "workflow/rules/accounting.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"


rule all:
    default_target: True
    input:
        f"{R}/plan.json",
        f"{R}/accounting.json",
        f"{R}/eval/report.json",
