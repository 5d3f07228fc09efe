"""Each rule's spec (pipeline/rules.py) is what Snakemake parses: its modules' code hash, its config slice per
job, its threads and resources, its SLURM group; and a rule's module reaches its own slice, never the table."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from builders import ROOT, snakemake_workflow

from pipeline import codehash
from pipeline.config import Keys, load_config, params_json
from pipeline.config import rule_params as rp
from pipeline.errors import ConfigError
from pipeline.planning import data_cost as cluster
from pipeline.planning.stages import stage_config
from pipeline.rules import BY_NAME, RULES, declared_slice, feeds_tokenizer, job_params, rule_params
from pipeline.run_config import run_config

CONFIGS = ("config.yaml", "configs/llama3-1b-fineweb.yaml")


@pytest.fixture(scope="module", params=CONFIGS)
def parsed(request, tmp_path_factory):
    """(the rules Snakemake parses for a config, its resolved config, the corpus the sizes were computed for)."""
    path = tmp_path_factory.mktemp("rules")
    (path / "data").symlink_to(ROOT / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        with snakemake_workflow(path, ROOT / request.param) as workflow:
            g = workflow.globals
            return ({r.name: r for r in workflow.rules if r.name != "all"}, dict(workflow.config),
                    (g["CORPUS_DOCS"], g["CORPUS_TOKENS"], g["TRAIN_HOURS"]))


def job_wildcards(cfg: dict, spec) -> list[SimpleNamespace]:
    """A job's wildcards for each value of the spec's scope (every source, mix, stage; one scaling point)."""
    if spec.scope == "source":
        return [SimpleNamespace(source=s) for s in cfg["sources"]]
    if spec.scope == "mix":
        return [SimpleNamespace(mix=m) for m in cfg["mixes"]]
    if spec.scope == "stage":
        return [SimpleNamespace(stage=s["name"]) for s in cfg["train"]["stages"]]
    return [SimpleNamespace(budget=str(cfg["scaling"]["budgets"][0]), depth=str(cfg["scaling"]["depths"][0]))]


def test_every_rule_snakemake_parses_is_its_spec(parsed):
    rules, cfg, corpus = parsed
    assert set(rules) == set(BY_NAME)
    for name, rule in rules.items():
        spec = BY_NAME[name]
        # the code param: the hash of the spec's modules
        assert rule.params.code == codehash.code_version(*spec.entries), name
        # the config slice, per job as the scope narrows it
        assert ("p" in rule.params.keys()) == (spec.params is not None), name
        p = rule.params.get("p")
        if spec.params is None:
            pass
        elif spec.scope in ("run", "fit"):
            assert p == params_json(job_params(cfg, name)), name
        else:
            for w in job_wildcards(cfg, spec):
                assert p(w) == params_json(job_params(cfg, name, w)), (name, w)
        # its size
        want = cluster.job_resources(run_config(cfg), name, *corpus)
        got = {k: v.value for k, v in rule.resources.items() if not v.is_evaluable()}
        for key, value in want["resources"].items():
            if key == "runtime" and name == "scaling_point":  # per point, from the point's own config
                assert rule.resources["runtime"].is_evaluable()
                continue
            if key == "runtime" and name in ("train", "train_segment"):  # per stage: its chain's jobs
                assert rule.resources["runtime"].is_evaluable()
                continue
            assert got[key] == value, (name, key)
        assert rule.resources["_cores"].value == want["threads"], name
        # its SLURM group: the shard group's job, or (upstream of the tokenizer) a function of the source
        group = rule._group  # (Rule.group answers None in a local run)
        if not spec.shard_chain:
            assert group is None, name
        elif feeds_tokenizer(name):
            assert callable(group), name
        else:
            assert group == "shards-{source}-{group}", name


def test_the_shard_chain_is_the_per_shard_rules_before_the_signatures():
    assert [r.name for r in RULES if r.shard_chain] == ["download", "filter", "tokenize", "dedup_signatures"]
    assert [r.name for r in RULES if r.shard_chain and feeds_tokenizer(r.name)] == ["download", "filter"]


def test_a_rules_module_reaches_its_own_slice_and_never_the_table_of_rules():
    """A rule's code hash holds the slice function its spec names (its module reads its params through it) and
    none of the table: no spec, size or rate. Only `plan` (which prints the costs) reaches the table, so an edit
    of one rule's size or rate reruns the plan and nothing else."""
    for spec in RULES:
        defs = codehash.package().definitions(*spec.entries)
        if spec.params is not None and spec.scope not in ("point", "fit"):  # (pipeline.planning.sweep's, at parse time)
            declared = spec.params.where if isinstance(spec.params, Keys) else \
                f"{spec.params.__module__}:{spec.params.__name__}"
            assert declared in defs, spec.name
        table = {k for k in defs
                 if k.split(":")[0] in ("pipeline.rules", "pipeline.planning.job_sizes", "pipeline.planning.data_cost")}
        assert bool(table) == (spec.name == "plan"), (spec.name, sorted(table)[:5])
    slices = {k for k in codehash.package().definitions(*BY_NAME["mix"].entries) if k.endswith("_slice")}
    assert slices == {"pipeline.config.rule_params:mix_slice", "pipeline.config.rule_params:pack_slice"}


def test_rule_params_names_the_rules_and_refuses_a_rule_without_a_slice(tmp_path):
    from pipeline.config import resolve_config

    cfg = resolve_config({})
    with pytest.raises(KeyError, match="no rule 'mixx'.*rules: download, filter"):
        rule_params(cfg, "mixx")
    with pytest.raises(KeyError, match="rule 'count' takes no config slice"):
        rule_params(cfg, "count")
    assert json.loads(params_json(rule_params(cfg, "dedup_candidates"))) == rule_params(cfg, "dedup")


def test_a_jobs_params_are_its_slice_narrowed_to_its_wildcards():
    """`job_params` (what common.smk declares as each job's `p`): a per-source job sees its own source only, a
    per-mix job its own mix, a training stage its own stage's view (`stage_config`), a run-wide rule the slice."""
    from pipeline.config import load_config

    cfg = load_config(ROOT / "config.yaml")  # sources web, chat, crawl; mixes pretrain, midtrain, sft
    tokenize = job_params(cfg, "tokenize", SimpleNamespace(source="chat"))
    assert set(tokenize["sources"]) == {"chat"} and tokenize == rule_params(cfg, "tokenize", source="chat")
    assert set(job_params(cfg, "pack", SimpleNamespace(mix="sft"))["mixes"]) == {"sft"}
    train = run_config(rule_params(cfg, "train"))
    assert job_params(cfg, "train", SimpleNamespace(stage="sft")) == stage_config(train, "sft")
    assert job_params(cfg, "train", SimpleNamespace(stage="sft")) != job_params(cfg, "train", SimpleNamespace(
        stage="pretrain"))
    assert job_params(cfg, "dedup") == rule_params(cfg, "dedup")


# The slices of the rules that read whole keys, declared as data: each is its rule's hand-written slice.
AS_KEYS = {
    "dedup": Keys("dedup", "seed"),
    "split": Keys("split", "seed"),
    "filter": Keys("filter", sources=rp.TEXT_KEYS),
    "filter_report": Keys("filter", "seed", sources=rp.TEXT_KEYS),
    "tokenize": Keys("count.batch_size", sources=rp.SHARD_KEYS),
    "dedup_signatures": Keys("count.batch_size", *(f"dedup.{k}" for k in rp.SIGNATURE_KEYS), sources=rp.SHARD_KEYS),
    "export": Keys("model", "tokenizer", "train.seq_len"),
}


PRESETS = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("configs/*.yaml"))


@pytest.mark.parametrize("configfile", ["config.yaml", *PRESETS])
def test_a_slice_declared_as_keys_is_the_hand_written_one(configfile):
    """`Keys` (a slice a module declares as data) cuts what the hand-written slices cut: whole keys, dotted keys
    nested, a source's keys for the sources in scope, `mixes` narrowed to the mix in scope."""
    cfg = load_config(ROOT / configfile)
    for name, keys in AS_KEYS.items():
        for source in [None, *(cfg["sources"] if BY_NAME[name].scope == "source" else ())]:
            assert rp.cut(keys, cfg, source) == rule_params(cfg, name, source), (name, source)
    for mix in [None, *cfg["mixes"]]:
        pack = {k: v for k, v in rule_params(cfg, "pack", mix=mix).items() if k != "seq_len"}
        assert rp.cut(Keys("mixes", "seed"), cfg, mix=mix) == pack, mix
    source = next(iter(cfg["sources"]))
    assert rp.cut(Keys("sources"), cfg, source) == {"sources": {source: cfg["sources"][source]}}


def test_keys_refuse_an_unknown_or_overlapping_key_and_a_module_without_a_slice():
    cfg = load_config(ROOT / "config.yaml")
    with pytest.raises(ConfigError, match="no key 'train.seq_lenn'"):
        rp.cut(Keys("train.seq_lenn", where="pipeline.data.x:SLICE"), cfg)
    with pytest.raises(ConfigError, match="'train' and 'train.seq_len' overlap"):
        Keys("train", "train.seq_len")
    with pytest.raises(ConfigError, match="no top-level `SLICE = Keys"):
        declared_slice("pipeline.data.mix")  # mix names its slice function
