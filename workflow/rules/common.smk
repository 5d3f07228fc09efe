# Configuration and the helpers every rule uses. Rules are thin shells around `python -m pipeline.…`;
# all logic lives in the `pipeline` package (file formats: docs/data-contract.md).
import json
import math
import shlex
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version
from snakemake_interface_executor_plugins.settings import DeploymentMethod

min_version("9.0")

BASE = Path(workflow.basedir)
sys.path.insert(0, str(BASE))
from pipeline.planning import data_cost as tfcl  # noqa: E402
from pipeline import config as tfc  # noqa: E402
from pipeline.planning import job_sizes as tfsz  # noqa: E402
from pipeline import codehash as tfch  # noqa: E402
from pipeline.planning import train_jobs as tfres  # noqa: E402
from pipeline import rules as tfr  # noqa: E402
from pipeline import run_config as tfrc  # noqa: E402
from pipeline.data.text_filters import build_chain  # noqa: E402
from pipeline.errors import ConfigError, PlanError  # noqa: E402
from pipeline.planning.parallel import resolve_parallel  # noqa: E402
from pipeline.planning.token_plan import format_plan, make_plan, run_counts, train_hours  # noqa: E402
from pipeline.planning.sweep import describe_ratio as tfsc_describe, resolve_tokens_per_param  # noqa: E402
from pipeline.planning.stages import mix_targets, stage_list, tokenizer_sources  # noqa: E402
from pipeline.training.lease import wait_for_writers  # noqa: E402


def stop(message):
    """A configuration problem: one line in the main process; a job re-parsing the Snakefile (a
    remote or subprocess job) raises, so its own error names the problem instead of exiting quietly."""
    if workflow.is_main_process:
        sys.exit(f"tokenfarm: {message}")
    raise WorkflowError(f"tokenfarm: {message}")


# config.yaml is the default run. A --configfile replaces it (presets are complete configs, never
# merged key-by-key with the default); --config overrides apply on top of either. Snakemake takes only
# identifiers as --config keys, so a nested key is given as a YAML mapping, e.g.
# --config train='{target_tokens: 300000, betas: [0.9, 0.99]}'; Snakemake hands its values over as
# strings, typed here as the schema says (README "Configuration").
_overrides = tfc.typed_overrides(workflow.config_settings.config)
if not workflow.overwrite_configfiles:
    _default = Path("config.yaml") if Path("config.yaml").exists() else BASE / "config.yaml"
    with open(_default) as _f:
        _merged = tfc.deep_merge(yaml.safe_load(_f) or {}, config)
    config.clear()
    config.update(_merged)
config.update(tfc.deep_merge(config, _overrides))
# The one validation of the config: the schema (workflow/schemas/config.schema.yaml) with its defaults
# filled in, then the cross-field checks, by pipeline.config (the stage CLIs' --configfile goes the same
# way), each failure one line naming the key. Snakemake's own `validate` would only repeat the schema part.
# train.tokens_per_param: scaling is the ratio the IsoFLOP sweep fitted (pipeline/planning/sweep.py), resolved here
# to a number, so a new fit reruns what the budget sizes. Without a fit only the sweep can be built (its
# points do not depend on the run's budget): the main process stops with the command to run unless that
# command names the sweep (the targets are not known at parse time, so its arguments are looked at);
# a job sized by the run's budget fails in pipeline.planning.compute.token_target, naming the same command.
SWEEP_TARGETED = any(a in ("scaling", "scaling_point") or "/scaling/" in a for a in sys.argv[1:])
# train.parallel: auto is resolved here to ddp or fsdp (pipeline.planning.parallel.resolve_parallel: fsdp when ddp's predicted
# memory per GPU does not fit), so every rule's params and the trainer hold a concrete value; a parallelism
# whose prediction does not fit stops the run here, naming train.parallel and the fix.
# pipeline.planning takes the config typed (pipeline.run_config.RunConfig): typed here once; each step that
# resolves a key returns a RunConfig, made plain data once, for Snakemake's `config`.
try:
    _typed, TOKENS_PER_PARAM_FIT = resolve_tokens_per_param(
        tfrc.run_config(tfc.resolve_config(config)), required=workflow.is_main_process and not SWEEP_TARGETED)
    PARALLEL_REQUESTED = _typed.train.parallel
    _typed = tfres.resolve_ckpt_interval(resolve_parallel(_typed))  # ckpt_interval: auto → steps
except (ConfigError, PlanError) as _e:
    stop(_e)
config.clear()
config.update(tfrc.plain(_typed))
# The same config, typed (pipeline.run_config): what the estimators read. `config` stays the plain mapping
# Snakemake holds; the rule slices are cut from it.
RC = _typed
# The filter chain's settings (ranges, language codes, a classifier file): the schema checks the filter names
# only; pipeline.data.text_filters.build_chain (which the filter stage runs) checks the rest, naming the key.
try:
    build_chain(config["filter"], "filter")
except ConfigError as _e:
    stop(_e)

# Every path of this run (R = results_dir/run_name, logs/run_name): pipeline.config.layout.RunLayout
L = tfc.RunLayout.of(config)
DATA_DIR = config["data_dir"]  # ingested shards
SOURCES = list(config["sources"])
try:
    SHARDS = {s: tfc.source_shards(config, s) for s in SOURCES}
    GROUPS = {s: tfc.shard_groups(config, s) for s in SOURCES}
    SAMPLE = {s: tfc.sample_shards(config, s) for s in SOURCES}  # the plan's sample (count_sample)
except ConfigError as _e:
    stop(_e)
# Training stages in order (train.stages; pipeline/planning/stages.py): R/train/{stage}/final.pt of one is the
# input of the stages that init from it.
STAGES = {s["name"]: s for s in stage_list(RC)}

# Every rule's facts are its spec in pipeline/rules.py: the modules it runs (`rule_code`), its config slice
# (`rule_params`), its size (`job_threads`, `job_resources`) and whether it runs in its shard group's SLURM
# job (`job_group`); a rule's .smk holds its inputs, outputs and command, and names its spec through these.
# Job sizes (pipeline/planning/job_sizes.py): every rule's threads and resources (cpus_per_task, mem_mb, runtime,
# gpu, nodes) from the config and the corpus size (the measured counts once they exist: the exact table,
# else the plan's sample; else the sources' estimates). A cluster executor turns them into its job
# requests; locally, --cores caps threads.
_corpus = tfsz.corpus(RC, tfsz.measured_sizes(run_counts(L.root)))
CORPUS_DOCS, CORPUS_TOKENS = _corpus["documents"], _corpus["tokens"]


TRAIN_HOURS = 0 if TOKENS_PER_PARAM_FIT and TOKENS_PER_PARAM_FIT.get("missing") else train_hours(RC)
# A failed or early-stopped train job is resubmitted by the controller (a new job, a new allocation), never retried
# inside the job it failed in: a job's own Snakemake (a cluster job's) would rerun it at once, past its deadline.
TRAIN_RETRIES = config["hardware"]["train_retries"] if workflow.is_main_process else 0
# Each training stage's chain of jobs (pipeline.planning.train_jobs.stage_jobs): how many (1 unless the stage is longer than
# hardware.max_job_hours allows one job) and the runtime each asks for (never above the limit). The supervisor's
# grace after a signal: a step and a checkpoint save, predicted.
if TOKENS_PER_PARAM_FIT and TOKENS_PER_PARAM_FIT.get("missing"):
    TRAIN_JOBS = {s: {"jobs": 1, "runtime_min": 30} for s in STAGES}
    TRAIN_GRACE_S = 60
else:
    try:
        TRAIN_JOBS = tfres.stage_jobs(RC)
    except PlanError as _e:
        stop(_e)
    TRAIN_GRACE_S = math.ceil(tfres.predicted_save_s(RC) + 2 * tfres.predicted_step_s(RC)) + 30


def job_threads(rule):
    return tfcl.job_resources(RC, rule, CORPUS_DOCS, CORPUS_TOKENS, TRAIN_HOURS)["threads"]


def job_resources(rule):
    return tfcl.job_resources(RC, rule, CORPUS_DOCS, CORPUS_TOKENS, TRAIN_HOURS)["resources"]


# A cluster executor cannot request "all cores" (hardware.cpus_per_task 0) for a job. Snakemake sets its
# executor up only after parsing, so this is checked when jobs are really about to be submitted
# (onstart: not in a dry run, nor in --unlock, --summary, --dag, --report, … which run no job).
# A controller restarted while a train job of an earlier one still runs (its snakemake killed, logged out) waits
# for that job before scheduling anything, so it never starts a second writer into the same checkpoint folder
# (pipeline.training.lease: the folder's lease, and under SLURM the train jobs queued from this directory).
onstart:
    if not workflow.local_exec and not config["hardware"]["cpus_per_task"]:
        sys.exit("tokenfarm: hardware.cpus_per_task is 0 (all cores), which a cluster job cannot request: set "
                 "it to the cores one job may use, e.g. --config hardware='{cpus_per_task: 16}'")
    if workflow.is_main_process:
        wait_for_writers([L.train_dir(s) for s in STAGES], say=lambda m: print(m, file=sys.stderr))


def rule_code(rule):
    """A rule's code param: the hash of the definitions the `python -m` modules of its spec can run
    (pipeline/codehash.py), each hash's definitions kept in .snakemake/tokenfarm-codehash/ for codehash's
    `--why RULE` (docs/code-hash.md)."""
    return tfch.code_version(*tfr.rule(rule).entries, record=tfch.RECORD_DIR)


def rule_params(rule):
    """A rule's config slice (its spec's `params`) as canonical JSON, declared as params so that editing it
    reruns the rule; narrowed per job by the spec's `scope` (`pipeline.rules.job_params`: the job's source,
    its mix, its training stage, its scaling point: an edit to another reruns nothing of this job)."""
    if tfr.rule(rule).scope in ("run", "fit"):
        return tfc.params_json(tfr.job_params(config, rule))
    return lambda w: tfc.params_json(tfr.job_params(config, rule, w))


def stage_pack(split):
    """Input function: the packed rows of the job's training stage's mix."""
    return lambda w: L.pack(STAGES[w.stage]['mix'], split)


def stage_init(w):
    """Input function: the final.pt of the stage the job's training stage starts from (none for scratch)."""
    init = STAGES[w.stage]["init_from"]
    return [L.final(init)] if init else []


# The train rules (workflow/rules/train.smk): their inputs, params and command, shared by train_segment and train.
TRAIN_ARGS = (
    "-m pipeline.training.train --params {params.p:q} --train {input.train:q} --val {input.val:q} "
    "--tokenizer {input.tokenizer:q} --outdir {params.outdir:q} {params.init} {params.core} "
    "--segment {params.segment}"
)
TRAIN_SHELL = (
    "python -m pipeline.training.launch --grace {params.grace} -- python -m pipeline.training.rendezvous "
    f"--params {{params.p:q}} --cpus-per-node {{threads}} -- {TRAIN_ARGS} 2>&1 | tee -a {{log:q}}"
)


def train_inputs():
    return dict(
        train=stage_pack("train"),
        val=stage_pack("val"),
        tokenizer=L.tokenizer(),
        init=stage_init,
        # the quick CORE subset scored during training (eval.core_interval > 0 only)
        tasks=[L.eval_tasks()] if config["eval"]["core_interval"] else [],
    )


def train_params(segment):
    """The params of a train job: the stage's view of the config, the code, and `segment` (a function of the
    wildcards giving "K/N": the job's place in its stage's chain)."""
    return dict(
        p=rule_params("train"),
        code=rule_code("train"),
        outdir=lambda w: L.train_dir(w.stage),
        init=lambda w, input: f"--init {shlex.quote(str(input.init[0]))}" if input.init else "",
        core=lambda w, input: f"--eval-data {Path(input.tasks[0]).parent}" if input.tasks else "",
        segment=segment,
        # seconds the supervisor gives the workers to stop cleanly (a step and a checkpoint save) after a signal
        grace=TRAIN_GRACE_S,
    )


def segment_marker(stage, k):
    return L.segment(stage, k)


def previous_segment(w):
    k = int(w.segment)
    return [segment_marker(w.stage, k - 1)] if k > 1 else []


def last_segment(w):
    n = TRAIN_JOBS[w.stage]["jobs"]
    return [segment_marker(w.stage, n - 1)] if n > 1 else []



# Per-shard stages run one job per group of `shards_per_job` shards, one process per job: the stage
# writes each shard's files, then the group manifest `<dir>/{source}/_manifest/{group}.json`, the
# job's declared output. Downstream rules depend on manifests and are handed the per-shard paths,
# which keeps the DAG small for thousands of shards.
def group_manifests(prefix, sources=None):
    return [f"{prefix}/{s}/_manifest/{g}.json" for s in (sources or SOURCES) for g in GROUPS[s]]


def shard_files(pattern, sources=None):
    """`pattern` expanded over every shard of `sources` (default: all)."""
    return [pattern.format(source=s, shard=sh) for s in (sources or SOURCES) for sh in SHARDS[s]]


def group_files(pattern):
    """Param function: `pattern` expanded over the shards of the job's group."""
    return lambda w: [pattern.format(source=w.source, shard=sh) for sh in GROUPS[w.source][w.group]]


def group_shards(w):
    return GROUPS[w.source][w.group]


# The plan's sample first: the download and tokenize jobs of a group holding a sample shard, and the
# count_sample and plan jobs, go before the other ready jobs, so a budget the shards cannot meet stops the
# run after a few shards instead of after all of them.
SAMPLE_PRIORITY = 10


def sample_priority(w):
    return SAMPLE_PRIORITY if set(GROUPS[w.source][w.group]) & set(SAMPLE[w.source]) else 0


# The per-shard chain of one shard group (download → filter → tokenize → dedup_signatures: the rules whose
# spec has `shard_chain`) is one cluster job, the group job "shards-{source}-{group}", joined by its edges (the
# cluster profile's `group-components` puts every component of one resolved group id in one job).
# decontaminate_flags stays out of it: the chain does not wait for the eval tasks (eval_data), which only the
# flags need. A source the tokenizer is trained on keeps its download and its filter jobs of their own
# (`job_group`): the tokenizer job (which needs every such filtered shard) sits between them and the rest, and
# a group job may not be left and entered again. Locally (`--cores`) Snakemake runs no group jobs: every job is
# its own process as before.
SHARD_CHAIN = "shards-{source}-{group}"


def job_group(rule):
    """`group:` of the rules in the shard chain (`shard_chain` in pipeline/rules.py), the shard group's job; for
    those the tokenizer waits for, that job only for the sources the tokenizer does not read."""
    if not tfr.rule(rule).shard_chain:
        raise ValueError(f"rule {rule} is not in the shard chain (pipeline/rules.py)")
    if not tfr.feeds_tokenizer(rule):
        return SHARD_CHAIN
    return lambda w: (None if w.source in tokenizer_sources(RC)
                      else SHARD_CHAIN.format(source=w.source, group=w.group))


def mix_sources(mix):
    return list(config["mixes"][mix]["weights"])


# What the default target (`all`, Snakefile) builds besides the run's reports: a rule whose outputs no other rule
# reads adds them here from its .smk (`TARGETS += group_manifests(L.stage_dir("myrule"))`).
TARGETS = []


# Rules find the project's venv and package without activation; with --sdm conda the env's python
# is used instead and the package is found through PYTHONPATH. A prefix of our own replaces
# Snakemake's default `set -euo pipefail`, so it is restated: a stage failing inside
# `… 2>&1 | tee log` must fail the job. (shell.prefix is formatted by Snakemake: doubled braces.)
_prefix = (
    f'set -euo pipefail; export PYTHONPATH="{BASE}:${{{{PYTHONPATH:-}}}}"; '
    'export TOKENFARM_PROGRESS="${{TOKENFARM_PROGRESS:-0}}"; '
)
if DeploymentMethod.CONDA not in workflow.deployment_settings.deployment_method:
    _prefix += f'export PATH="{Path(sys.executable).parent}:$PATH"; '
shell.prefix(_prefix)


wildcard_constraints:
    source="|".join(SOURCES),
    group=r"[A-Za-z0-9_.\-]+",
    mix="|".join(config["mixes"]),
    split="train|val",
    part=r"\d+",
    stage="|".join(STAGES),
    segment=r"[1-9]\d*",


# The plan, up front: computed at parse time from the config and, once they exist, the measured token
# counts (the exact table, else the plan's sample: `run_counts`), else the sources' estimates, so every
# invocation (`snakemake -n` included) shows it before anything is downloaded. Only
# the main Snakemake process prints and checks it: jobs that re-parse the Snakefile (the subprocess of
# a local job, every job of a cluster executor) skip it and never exit over it.
if workflow.is_main_process and TOKENS_PER_PARAM_FIT and TOKENS_PER_PARAM_FIT.get("missing"):
    print(f"token-budget plan: none yet, {tfsc_describe(TOKENS_PER_PARAM_FIT)}", file=sys.stderr)
elif workflow.is_main_process:
    try:
        PLAN = make_plan(RC, counts=run_counts(L.root), strict_counts=False,
                         tokens_per_param_fit=TOKENS_PER_PARAM_FIT, parallel_requested=PARALLEL_REQUESTED)
    except (PlanError, ConfigError) as _e:
        stop(f"the token-budget plan is not feasible:\n  {_e}")
    print(format_plan(PLAN), file=sys.stderr)
