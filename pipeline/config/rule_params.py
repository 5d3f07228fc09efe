"""What each rule depends on: its slice of the config, one `*_slice` function per kind of rule, which the
rule's spec (pipeline/rules.py, `Rule.params`) names, or a slice declared as data (`Keys`) in the rule's module.

A rule declares its slice as `params:` (so an edit to it reruns the rule and its downstream, and
nothing else) and passes it to its module's CLI as ``--params JSON``; by hand the CLI takes
``--configfile`` (and ``--set``) and cuts the same slice here (`params_from_args(args, mix_slice)`: a
module names its slice function, not its rule, so the table of every rule is not in its code hash). What a
rule's *code* is (the other half of its identity) is its `code` param (pipeline/codehash.py): the
definitions the module it runs can reach, its own slice function among them and no other rule's.

For the per-shard rules (download, filter, tokenize, dedup_signatures, decontaminate_flags) `source` narrows
the slice to the job's own source, so editing one source reruns no job of another; for mix and pack `mix` narrows it
to the job's own mix, so editing one mix (or a training stage on another mix) reruns no job of
another.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.config.resolve import load_config, parse_overrides
from pipeline.errors import ConfigError
from pipeline.planning.stages import mix_targets, tokenizer_sources
from pipeline.run_config import run_config


def params_json(obj: Any) -> str:
    """Canonical JSON of a config slice, passed to a rule's module as --params."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


TEXT_KEYS = ("type", "format", "text_column", "messages_column")  # how a source's text is read
# What the per-shard rules read of a source: its text and the filters applied at tokenize time.
SHARD_KEYS = (*TEXT_KEYS, "min_chars", "max_conversation_tokens")
# What the download rule does not depend on: an edit to these reruns no download.
NOT_DOWNLOAD_KEYS = ("min_chars", "max_conversation_tokens", "tokens_per_shard_estimate")
# What dedup_signatures depend on: a threshold edit reruns the clustering only.
SIGNATURE_KEYS = ("ngram", "num_perm", "bands", "rows", "seed", "partitions")  # band keys are written partitioned

PLAN_TRAIN_KEYS = (
    "mix", "seq_len", "global_batch_tokens", "micro_batch", "tokens_per_param", "target_tokens", "target_flops",
    "precision", "optimizer", "activation_checkpointing", "checkpoint_every_n", "ce_chunk_tokens", "ce_matmul",
    "compile", "fp8", "parallel", "ckpt_interval", "async_ckpt",
)

RESOURCE_KEYS = ("cpus_per_task",)  # hardware keys that size jobs and change no output


def _source_slice(cfg: dict, names, keep: tuple[str, ...] = SHARD_KEYS) -> dict:
    return {n: {k: cfg["sources"][n][k] for k in keep if k in cfg["sources"][n]} for n in names}


def _sources_without(cfg: dict, names, drop: tuple[str, ...]) -> dict:
    return {n: {k: v for k, v in cfg["sources"][n].items() if k not in drop} for n in names}


def _run_description(cfg: dict) -> dict:
    """The config as the rules downstream of the measured counts see it: without the planner's per-shard
    estimate (the plan rule reads the measured counts of every source, so editing the estimate reruns
    nothing: it serves dry runs and `python -m pipeline.plan`) and without the hardware keys that size
    jobs rather than compute anything (they reach rules as threads), nor `count.sample_shards` (which
    tokenized shards the plan's sample reads: the plan rule sees the edit through its input)."""
    return {**cfg, "sources": _sources_without(cfg, cfg["sources"], ("tokens_per_shard_estimate",)),
            "hardware": {k: v for k, v in cfg["hardware"].items() if k not in RESOURCE_KEYS},
            "count": {k: v for k, v in cfg["count"].items() if k != "sample_shards"}}


# ----------------------------------------------------------------------------- one slice per rule
# Each takes (cfg, names of the sources in scope, the mix in scope or None).

def download_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {"sources": _sources_without(cfg, names, NOT_DOWNLOAD_KEYS), "download": cfg["download"]}


def tokenizer_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # sampling reads text only: min_chars (and the chat cap) apply at tokenize time
    return {"tokenizer": cfg["tokenizer"], "sources": _source_slice(cfg, tokenizer_sources(run_config(cfg)), TEXT_KEYS),
            "seed": cfg["seed"]}


def tokenize_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # count.sample_shards picks the plan's sample (which tokenized shards it reads), never an output of these
    return {"sources": _source_slice(cfg, names), "count": {"batch_size": cfg["count"]["batch_size"]}}


def filter_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # the chain and how the source's text is read: the filtered shards and decisions depend on nothing else
    return {"filter": cfg["filter"], "sources": _source_slice(cfg, names, TEXT_KEYS)}


def filter_report_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # the funnel of every source: the chain (its removal order), how each source's text is read, the examples' seed
    return {**filter_slice(cfg, list(cfg["sources"]), mix), "seed": cfg["seed"]}


def dedup_signatures_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {**tokenize_slice(cfg, names, mix), "dedup": {k: cfg["dedup"][k] for k in SIGNATURE_KEYS}}


def dedup_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {"dedup": cfg["dedup"], "seed": cfg["seed"]}


def split_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {"split": cfg["split"], "seed": cfg["seed"]}


def eval_data_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # the task files depend on the task lists and the pool only
    evaluation = cfg["eval"]
    return {"tasks": evaluation["tasks"], "pool_size": evaluation["core_pool_size"], "seed": cfg["seed"],
            "chat_tasks": evaluation["chat_tasks"]}


def decontaminate_grams_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # the eval n-gram table and the report: no source's key (a source edit reruns that source's flags only)
    return {"decontaminate": cfg["decontaminate"], "eval_tasks": cfg["eval"]["tasks"]}


def decontaminate_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {**decontaminate_grams_slice(cfg, names, mix), "sources": _source_slice(cfg, names, TEXT_KEYS)}


def pack_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    mixes = cfg["mixes"] if mix is None else {mix: cfg["mixes"][mix]}
    return {"mixes": mixes, "seq_len": cfg["train"]["seq_len"], "seed": cfg["seed"]}


def mix_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    params = pack_slice(cfg, names, mix)
    plan_mixes = [name for name, spec in params["mixes"].items() if spec["tokens"] == "plan"]
    if plan_mixes:
        # `tokens: plan` resolved here rather than read from plan.json: the figure (the most any
        # training stage on the mix consumes, pipeline.planning.stages.mix_targets) depends on the budgets,
        # model and global batch only, so a micro-batch or hardware edit (which rewrites plan.json)
        # reruns no data rule, while a budget edit reruns the mix.
        typed = run_config(cfg)
        params["trained_tokens"] = {name: mix_targets(typed, name) for name in plan_mixes}
    return params


def export_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # what an exported model directory depends on (the checkpoint brings the weights)
    return {"model": cfg["model"], "tokenizer": cfg["tokenizer"], "train": {"seq_len": cfg["train"]["seq_len"]}}


def plan_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # budget, batch layout and memory only: an lr edit reruns train, not the data rules
    run = _run_description(cfg)
    keep = ("run_name", "seed", "tokenizer", "split", "mixes", "model", "hardware", "sources")
    return {**{k: run[k] for k in keep}, "train": {k: run["train"][k] for k in (*PLAN_TRAIN_KEYS, "stages")},
            "eval": {"core_batch_tokens": run["eval"]["core_batch_tokens"]}}  # the evaluation memory


# The hardware keys that say how training is scheduled on a cluster (the chain of jobs of a long stage, the
# retries), not what it computes: the train jobs see them as their chain ("K/N") and resources, the plan shows them.
SCHEDULING_KEYS = ("max_job_hours", "train_retries")


# train, evaluate and accounting depend on (almost) the whole run description.
def evaluate_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    run = _run_description(cfg)
    return {**{k: v for k, v in run.items() if k != "download"},
            "hardware": {k: v for k, v in run["hardware"].items() if k not in SCHEDULING_KEYS}}


def train_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    # training's CORE subset has its own item cap: an edit of the final evaluation's cap reruns evaluate only
    params = evaluate_slice(cfg, names, mix)
    return {**params, "eval": {k: v for k, v in params["eval"].items() if k != "core_max_items"}}


def accounting_slice(cfg: dict, names: list[str], mix: str | None) -> dict:
    return {k: v for k, v in evaluate_slice(cfg, names, mix).items() if k != "eval"}  # reads no eval.* key


# ----------------------------------------------------------------------------- a slice declared as data

@dataclass(frozen=True, init=False)
class Keys:
    """A rule's slice declared as data, called like the `*_slice` functions: the config `keys` it reads, each a
    top-level key or a dotted path to a nested one ("train.seq_len" is {"train": {"seq_len": ...}}), and with
    `sources` those keys of each source in scope. A key "mixes" is narrowed to the mix in scope, "sources" to the
    sources in scope. A rule's module declares it (``SLICE = Keys("dedup", "seed")``); its spec reads it there
    (`pipeline.rules.MODULE_SLICE`), and `where` names that declaration."""

    keys: tuple[str, ...]
    sources: tuple[str, ...] | None = None
    where: str = field(default="", compare=False)

    def __init__(self, *keys: str, sources: tuple[str, ...] | None = None, where: str = ""):
        paths = [k.split(".") for k in keys]
        for i, a in enumerate(paths):
            for b in paths[i + 1:]:
                if a[:len(b)] == b[:len(a)]:
                    raise ConfigError(f"slice {where or keys}: keys {'.'.join(a)!r} and {'.'.join(b)!r} overlap")
        if sources is not None and any(p[0] == "sources" for p in paths):
            raise ConfigError(f"slice {where or keys}: 'sources' is both a key and sources=")
        object.__setattr__(self, "keys", tuple(keys))
        object.__setattr__(self, "sources", None if sources is None else tuple(sources))
        object.__setattr__(self, "where", where)

    def __call__(self, cfg: dict, names: list[str], mix: str | None) -> dict:
        out: dict = {}
        for key in self.keys:
            path = key.split(".")
            if key == "sources":
                value = {n: cfg["sources"][n] for n in names}
            elif key == "mixes":
                value = cfg["mixes"] if mix is None else {mix: cfg["mixes"][mix]}
            else:
                value = cfg
                for i, part in enumerate(path):
                    if not isinstance(value, Mapping) or part not in value:
                        raise ConfigError(f"slice {self.where or self.keys}: the config has no key "
                                          f"{'.'.join(path[:i + 1])!r}")
                    value = value[part]
            into = out
            for part in path[:-1]:
                into = into.setdefault(part, {})
            into[path[-1]] = value
        if self.sources is not None:
            out["sources"] = _source_slice(cfg, names, self.sources)
        return out


Slice = Callable[[dict, list[str], "str | None"], dict]


def cut(slice_of: Slice, cfg: dict, source: str | None = None, mix: str | None = None) -> dict:
    """The config slice `slice_of` (one of the `*_slice` functions above, or a `Keys`) of `cfg`, narrowed to
    `source` / `mix` when given (a per-shard job's own source, a per-mix job's own mix)."""
    return slice_of(cfg, list(cfg["sources"]) if source is None else [source], mix)


# ----------------------------------------------------------------------------- a module's CLI

def add_config_args(parser) -> None:
    """--params JSON (what rules pass) or --configfile FILE (for hand use) on a rule module's CLI."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--params", help="the rule's config slice as JSON (what the Snakemake rule passes)")
    group.add_argument("--configfile", help="a full config YAML; the module takes its rule's slice from it")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="with --configfile: override a key (dotted, e.g. train.resume=never; the value is "
                             "read as YAML and typed by the schema); repeatable")


def params_from_args(args, slice_of: Slice) -> dict:
    """A rule's params from its CLI's --params, or cut from its --configfile (and --set) by `slice_of`, the
    rule's slice function (the one its spec in pipeline/rules.py names; a module names it rather than the rule,
    so its code hash reaches its own slice only)."""
    overrides = getattr(args, "set", None)
    if args.params is not None:
        if overrides:
            raise ConfigError("--set applies to --configfile only; --params is the resolved slice a rule passes")
        return json.loads(args.params)
    return cut(slice_of, load_config(args.configfile, parse_overrides(overrides)))
