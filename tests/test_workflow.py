"""The Snakemake DAG end to end, on tiny data in a temp dir: the way users run it.

One module-scoped run of the whole DAG (download → … → train → evaluate) is shared by the tests
below; rerun tests then edit the config and ask Snakemake (dry run) which jobs it would rerun.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from builders import (
    ROOT,
    SNAKEMAKE,
    TINY,
    copa_item,
    insert_pass,
    kill_group,
    lambada_passage,
    logged_steps,
    make_project,
    pass_insertable,
    past_checkpoint,
    planned_jobs,
    reword_docs,
    sample_docs,
    snakemake,
    user_env,
    wait_for,
    workflow_rule_facts,
    write_config,
    write_text_shard,
)
from snakemake.benchmark import BENCHMARK_INTERVAL_SHORT

from pipeline.codehash import Package, definition_at, module_name, module_path
from pipeline.io import read_parquet_meta
from pipeline.run_config import run_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("snakemake_cli")]  # Snakemake imported once


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    path = make_project(tmp_path_factory.mktemp("tiny"), TINY)
    # every stage process records the package functions it runs (pipeline.io.run_cli), for
    # test_every_function_a_rule_ran_is_hashed
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENFARM_TRACE_CALLS", str(traced(path)))
        snakemake(path, timeout=1800)  # (a traced run, on a shared machine: more than the usual 900 s)
        snakemake(path, "export")  # export is built on request only
    return path


def traced(project: Path) -> Path:
    return project.with_name(project.name + "-traced")


def test_end_to_end(project):
    R = project / "results/t"
    for rel in ["tokenizer/encoding.json", "counts/counts.parquet", "counts/sample.parquet", "plan.json",
                "accounting.json",
                "pack/pretrain/train.json", "pack/midtrain/train.json", "pack/sft/train.json",
                *[f"train/{s}/final.pt" for s in ("pretrain", "midtrain", "sft")],
                *[f"eval/{s}/{f}" for s in ("pretrain", "midtrain", "sft") for f in ("report.json", "loss.png")],
                "eval/stages.json", "eval/stages.md", "eval/stages.png"]:
        assert (R / rel).exists(), rel
    plan = json.loads((R / "plan.json").read_text())
    assert plan["num_steps"] == 100 and plan["grad_accum_steps"] == 2
    assert [s["name"] for s in plan["stages"]] == ["pretrain", "midtrain", "sft"]
    assert [s["num_steps"] for s in plan["stages"][:2]] == [100, 5] and plan["stages"][2]["estimate"]
    report = json.loads((R / "eval/pretrain/report.json").read_text())
    assert report["val_loss"] < report["unigram_baseline"] - 0.1  # learned more than token frequencies
    assert "chat_val_loss" not in report  # a text stage
    stages = json.loads((R / "eval/stages.json").read_text())["stages"]
    assert [(s["stage"], s["init_from"], s["loss"]) for s in stages] == [
        ("pretrain", None, "all"), ("midtrain", "pretrain", "all"), ("sft", "midtrain", "assistant")]
    summaries = {s: json.loads((R / f"train/{s}/summary.json").read_text()) for s in ("pretrain", "midtrain", "sft")}
    assert [summaries[s]["num_steps"] for s in ("pretrain", "midtrain")] == [100, 5]
    sft_rows = json.loads((R / "pack/sft/train.json").read_text())["n_rows"]
    assert summaries["sft"]["num_steps"] == -(-sft_rows // 32)  # one epoch over every packed row, 32 rows a step
    assert summaries["sft"]["empty_rows"] == summaries["sft"]["num_steps"] * 32 - sft_rows
    sft = json.loads((R / "eval/sft/report.json").read_text())
    assert sft["chat_val_loss"] == pytest.approx(sft["val_loss"])  # an assistant-only stage on a chat-only mix
    assert [a["question"] for a in sft["answers"]] == TINY["eval"]["chat_questions"]
    # ChatCORE in every chat stage's report and in the stages report (issue 20); at seq_len 32 no prompt
    # fits, so every item is counted as too long (never truncated) and no score is claimed
    assert report["chat_core"] is None
    for s in ("midtrain", "sft"):
        cc = json.loads((R / f"eval/{s}/report.json").read_text())["chat_core"]
        assert list(cc["tasks"]) == ["arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval"]
        assert all(t["items"] + t["too_long"] == 4 for t in cc["tasks"].values())
        assert "## ChatCORE" in (R / f"eval/{s}/report.md").read_text()
    assert "## sft: ChatCORE" in (R / "eval/stages.md").read_text()
    # issue 31: intervals on every score, per-item logs, consecutive stages paired in the stages report
    assert report["val_loss_ci"][0] <= report["val_loss"] <= report["val_loss_ci"][1]
    items = [json.loads(line) for line in (R / "eval/pretrain/core_items.jsonl").read_text().splitlines()]
    assert len(items) == report["core"]["items"] and {"id", "gold", "pick", "scores", "correct"} <= set(items[0])
    assert (R / "eval/pretrain/chat_core_items.jsonl").read_text() == ""  # a text stage: no chat tasks
    comparisons = json.loads((R / "eval/stages.json").read_text())["comparisons"]
    assert [(c["a"], c["b"]) for c in comparisons] == [("pretrain", "midtrain"), ("midtrain", "sft")]
    assert all("refused" not in c and "core" in c for c in comparisons), comparisons
    assert "## pretrain → midtrain: paired differences" in (R / "eval/stages.md").read_text()
    out = subprocess.run([sys.executable, "-m", "pipeline.evaluation.compare", str(R / "eval/pretrain"),
                          str(R / "eval/sft")], capture_output=True, text=True, check=True).stdout
    assert "95 % interval" in out and "| copa (accuracy) |" in out
    assert (project / "logs/t/train/sft.log").exists()
    assert (project / "data/raw/web/shard_00000.parquet").exists()
    # Every stage output carries metadata saying what made it.
    assert read_parquet_meta(R / "counts/counts.parquet")["stage"] == "count"
    # One tokenization pass: the count tables are the tokenize jobs' counts, joined; the plan reads the sample
    tokens = {(s, p.stem): json.loads(p.read_text()) for s in ("web", "chat")
              for p in (R / "tokens" / s).glob("*.json")}
    table = pq.read_table(R / "counts/counts.parquet").to_pylist()
    assert {(r["source"], r["shard"]): r["tokens"] for r in table} == {k: t["counts"]["tokens"]
                                                                       for k, t in tokens.items()}
    sample = pq.read_table(R / "counts/sample.parquet").to_pylist()
    assert [(r["source"], r["shard"]) for r in sample] == [("chat", "shard_00000"), ("web", "shard_00000"),
                                                           ("web", "shard_00002")]  # 2 of web's 3, chat's 1
    assert "sampled (2 of 3 shards" in plan["shards_per_source"]["web"]["tokens_per_shard_basis"]
    # The candidate pairs are temp(): gone once the merge job read them; its keep lists stay.
    assert not list((R / "dedup/pairs").glob("*.parquet")) and (R / "dedup/keep/web/shard_00000.parquet").exists()


DATA_RULES = tuple(r for r, f in workflow_rule_facts().items() if f["benchmark"])  # every data rule has a table


def test_every_data_job_leaves_its_benchmark(project):
    """R/benchmarks/{rule}/{wildcards}.tsv: Snakemake's wall, peak RSS and CPU time of every data job."""
    bench = project / "results/t/benchmarks"
    assert {p.stem if p.suffix else p.name for p in bench.iterdir()} == set(DATA_RULES)
    assert len(list((bench / "tokenize").rglob("*.tsv"))) == 4 and len(list((bench / "pack").rglob("*.tsv"))) == 6
    assert len(list((bench / "decontaminate_flags").rglob("*.tsv"))) == 4  # one flags job per shard group
    for tsv in bench.rglob("*.tsv"):
        header, row = tsv.read_text().splitlines()[:2]
        cols = dict(zip(header.split("\t"), row.split("\t")))
        # Snakemake samples a job's memory every 0.5 s from soon after its start (snakemake.benchmark): a job
        # that ends before the first sample (dedup_index once, in 0.37 s) has none, and its max_rss is 0
        assert float(cols["s"]) > 0 and "cpu_time" in cols, tsv
        assert float(cols["max_rss"]) > 0 or float(cols["s"]) < 2 * BENCHMARK_INTERVAL_SHORT, tsv


def test_core_table_in_the_report_and_curve_during_training(project):
    R = project / "results/t"
    core = json.loads((R / "eval/pretrain/report.json").read_text())["core"]
    # seq_len 32: an item that does not fit even alone is not scored (never truncated), LAMBADA's passages
    # never fit, and a task with no scored item is left out of core_<n> (issue 20 item 4)
    scored = [n for n, t in core["tasks"].items() if t["items"]]
    assert set(core["tasks"]) == {"copa", "winogrande", "lambada"} and core["score_name"] == f"core_{len(scored)}"
    assert "copa" in scored and core["tasks"]["lambada"]["too_long"] == 8
    assert all(t["items"] + t["too_long"] == 8 and t["truncated"] == 0 for t in core["tasks"].values())
    assert "| winogrande | schema | 0 (0) |" in (R / "eval/pretrain/report.md").read_text()
    assert (R / "eval/pretrain/core.png").stat().st_size > 0
    records = [json.loads(ln) for ln in (R / "train/pretrain/metrics.jsonl").read_text().splitlines()]
    in_loop = [r for r in records if any(k.startswith("core_") for k in r)]
    assert [r["step"] for r in in_loop] == [50, 100] and all("core/copa" in r for r in in_loop)
    assert json.loads((R / "eval_data/tasks.json").read_text())["tasks"]["copa"]["licence"] == "BSD-2-Clause"


def test_leaked_benchmark_document_is_removed_before_the_split(project):
    R = project / "results/t"
    decontam = json.loads((R / "decontam/report.json").read_text())
    assert decontam["per_source"]["web"]["by_task"]["lambada"]["documents"] == 1
    flags = pq.read_table(R / "decontam/web/shard_00001.parquet").to_pydict()
    doc = flags["contaminated"].index(True)
    assert flags["tasks"][doc] == "lambada" and sum(flags["contaminated"]) == 1
    split = pq.read_table(R / "split/web/shard_00001.parquet").to_pydict()
    assert split["split"][split["doc"].index(doc)] == "contam"
    acct = json.loads((R / "accounting.json").read_text())
    assert acct["total"]["contam_tokens"] == decontam["total"]["tokens"] > 0
    # issue 31 item 4, the other direction: the leaked items are reported seen although split removed their
    # documents; the planted COPA item (the first the run scores) is left out of COPA's clean subset
    passage = lambada_passage()
    lam = next(it["id"] for it in json.loads((R / "eval_data/lambada.json").read_text())["items"]
               if it["contexts"][0] in passage)
    assert decontam["contaminated_items"]["lambada"]["ids"] == [lam]
    copa = copa_item(project / "config.yaml")["id"]
    assert decontam["contaminated_items"]["copa"]["ids"] == [copa]
    report = json.loads((R / "eval/pretrain/report.json").read_text())["core"]
    items = [json.loads(line) for line in (R / "eval/pretrain/core_items.jsonl").read_text().splitlines()]
    assert [(i["task"], i["id"]) for i in items if i["contaminated"]] == [("copa", copa)]
    assert all(i["contaminated"] is False for i in items if i["id"] != copa)
    t = report["tasks"]["copa"]
    clean = [i["correct"] for i in items if i["task"] == "copa" and i["id"] != copa]
    assert t["contaminated"] == 1 and t["clean_items"] == t["items"] - 1 == len(clean)
    assert t["clean_accuracy"] == sum(clean) / len(clean) and len(t["clean_centered_ci"]) == 2
    assert report["clean_score"] is not None and report["tasks"]["lambada"]["contaminated"] == 0  # not scored: too long
    md = (R / "eval/pretrain/report.md").read_text()
    assert "| contaminated | clean accuracy | clean centered |" in md and "On clean items (1 scored items" in md
    chat = json.loads((R / "eval/sft/report.json").read_text())["chat_core"]
    assert all(t["contaminated"] is None for t in chat["tasks"].values()) and chat["clean_score"] is None
    assert "not checked" in (R / "eval/sft/report.md").read_text()


def test_report_shows_the_evaluation(project):
    snakemake(project, "--report", str(project / "report.html"))
    html = (project / "report.html").read_text(errors="replace")
    assert "loss.png" in html and "report.md" in html and "plan.md" in html and "stages.png" in html
    assert "core.png" in html


def test_export_target_writes_a_model_transformers_loads_with_our_logits(project):
    """`snakemake export` (the `project` fixture's): the trained model as a transformers directory with the same
    logits as final.pt. (The rule runs `python -m pipeline.evaluation.export`, whose output lm-eval scores
    offline in README's sequence, tests/test_user_path.py, and against our loglikelihoods in
    tests/evaluation/test_export.py.)"""
    import torch
    from transformers import LlamaForCausalLM

    from pipeline.model.checkpoint_io import load_checkpoint
    from pipeline.model.model import ModelConfig, Transformer

    out = project / "results/t/export/hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    final = load_checkpoint(project / "results/t/train/sft/final.pt")  # the last stage's model
    ours = Transformer(ModelConfig.from_config(final["params"]))
    ours.load_state_dict(final["model"])
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        assert (ours.eval()(ids) - hf(ids).logits).abs().max() < 1e-4
    assert planned_jobs(snakemake(project, "-n", "export")) == {}


def test_nothing_to_do_after_a_run(project):
    assert planned_jobs(snakemake(project, "-n")) == {}


# ----------------------------------------------------------------------------- code edits

def scheduled_for_code(proc: subprocess.CompletedProcess) -> dict[str, set[str]]:
    """{rule: reasons} of the jobs a dry run lists (a dry run prints the jobs of a group job indented
    under it: the per-shard chain's `group:`)."""
    out: dict[str, set[str]] = {}
    job = re.compile(r"^[ \t]*(?:local)?rule (\w+):\n(.*?)(?=\n[ \t]*\n|\n[ \t]*\[|\n[ \t]*(?:local)?rule \w+:|\Z)",
                     re.S | re.M)  # a job's block ends at a blank line, the next job's [timestamp] or rule line
    for m in job.finditer(proc.stdout + proc.stderr):
        reason = re.search(r"reason: (.*)", m.group(2))
        out.setdefault(m.group(1), set()).add(reason.group(1) if reason else "")
    return out


@pytest.fixture(scope="module")
def code_copy(project, tmp_path_factory):
    """A copy of the workflow and the package whose modules a test may edit (the finished `project` run
    recorded the same code, so its dry run plans nothing until an edit)."""
    import shutil

    path = tmp_path_factory.mktemp("code")
    for rel in ("workflow", "pipeline"):
        shutil.copytree(ROOT / rel, path / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("Snakefile", "config.yaml"):
        shutil.copy2(ROOT / rel, path / rel)
    return path


# Each rule of the workflow that runs code: the `python -m pipeline.…` modules of its shell command, as
# Snakemake parses the workflow (tests/builders.py).
ENTRIES = {r: f["modules"] for r, f in workflow_rule_facts().items() if f["modules"]}


def test_every_rule_hashes_the_modules_its_command_runs():
    """Each rule's code param hashed exactly the `python -m` modules of its shell command (the entries codehash
    recorded for the param's value); the definitions hashed are those they reach (pipeline/codehash.py), never
    a hand-kept list."""
    facts = workflow_rule_facts()
    assert len(ENTRIES) >= 21
    for rule, mods in ENTRIES.items():
        assert facts[rule]["code_entries"] is not None and sorted(facts[rule]["code_entries"]) == sorted(mods), rule


def hashed() -> dict[str, set[str]]:
    """{rule: the definitions ("module:name") its code param hashes}."""
    p = Package()
    return {r: set(p.definitions(*m)) for r, m in ENTRIES.items()}


def test_rules_hash_what_their_entries_reach():
    h = hashed()
    assert {"pipeline.planning.parallel:resolve_parallel", "pipeline.planning.stages:stage_list"} <= h["plan"]
    assert "pipeline.planning.memory:choose_parallel" in h["train"]
    assert "pipeline.training.rendezvous:main" in h["train"]
    assert all("pipeline.data.contract:shard_name" in h[r] for r in ("tokenize", "dedup_signatures"))
    assert any(d.startswith("pipeline.evaluation.core_benchmark:") for d in h["train"])  # imported inside a function
    # issue 29: the import closure of 12 rules held minhash; its functions are hashed by the rules that call them
    minhash = {r for r, d in h.items() if any(k.startswith("pipeline.data.minhash:") and k[22].islower() for k in d)}
    assert {"dedup_signatures", "dedup", "decontaminate_grams"} <= minhash
    assert not minhash & {"download", "tokenizer", "tokenize", "count", "train", "evaluate", "plan"}


def editable(definitions: set[str]) -> list[str]:
    """The definitions among `definitions` that `insert_pass` can edit, sorted."""
    out = []
    for module in sorted({d.split(":")[0] for d in definitions}):
        names = pass_insertable(module_path(module).read_text())
        out += sorted(d for d in definitions if d.split(":")[0] == module and d.split(":")[1] in names)
    return out


@pytest.fixture(scope="module")
def outputs_by_rule(project) -> dict[str, list[str]]:
    """Every output of the finished run (export included: the `project` fixture built it) by the rule that wrote
    it: `snakemake --summary`."""
    rows = [ln.split("\t") for ln in snakemake(project, "--summary", "export", "all").stdout.splitlines()[1:]]
    out: dict[str, list[str]] = {}
    for row in rows:
        if len(row) > 2:
            out.setdefault(row[2], []).append(row[0])
    return out


@contextlib.contextmanager
def edited_copy(code_copy: Path, edits: dict):
    """The workflow copy, edited for the `with` block: `edits` maps a module to its edit (source -> source),
    or a definition ("module:name") to None, a `pass` inserted in its body."""
    olds = {}
    try:
        for target, edit in edits.items():
            module, _, name = target.partition(":")
            path = module_path(module, code_copy / "pipeline")
            olds[path] = path.read_text()
            path.write_text(edit(olds[path]) if edit else insert_pass(olds[path], name))
        yield code_copy
    finally:
        for path, old in olds.items():
            path.write_text(old)


def run_after_editing(project: Path, code_copy: Path, edits: dict, *args: str) -> subprocess.CompletedProcess:
    """Snakemake with `args` on the workflow copy after `edits` (edited_copy)."""
    with edited_copy(code_copy, edits):
        return snakemake(project, *args, snakefile=code_copy / "Snakefile")


def dry_run_after_editing(project: Path, code_copy: Path, definition: str, *args: str) -> dict[str, set[str]]:
    """{rule: reasons} of a dry run of the workflow copy after a `pass` is inserted in `definition`."""
    return scheduled_for_code(run_after_editing(project, code_copy, {definition: None}, "-n", *args))


def summary_status(proc: subprocess.CompletedProcess, outputs: list[str]) -> set[str]:
    """The status column of `snakemake --summary` for `outputs`."""
    rows = [ln.split("\t") for ln in proc.stdout.splitlines()[1:]]
    return {row[4] for row in rows if len(row) > 4 and row[0] in outputs}


# Rules whose outputs are temp() (removed once read) and the one rule that reads them.
TEMP_CONSUMERS = {"dedup_candidates": "dedup"}


def test_temp_outputs_are_those_of_the_rules_listed():
    assert {r for r, f in workflow_rule_facts().items() if f["temp_outputs"]} == set(TEMP_CONSUMERS)


# The IsoFLOP sweep's rules are outside `all` (the finished run has no sweep outputs): their reruns are
# tests/test_scaling_workflow.py's; their code params are checked by test_every_rule_hashes_the_modules_...
SWEEP_RULES = {"scaling", "scaling_point"}
# A stage runs as one train job without hardware.max_job_hours (the default run): no train_segment job exists to
# rerun; its command and code hash are train's (tests/test_rules.py checks its code param; tests/slurm runs a chain).
UNUSED_HERE = {"train_segment"}


CODE_EDIT_RULES = sorted(set(ENTRIES) - SWEEP_RULES - UNUSED_HERE)


@functools.cache
def code_edits(rule: str) -> tuple[str, str, frozenset[str]]:
    """(inside, outside, partners) of test_a_code_edit_reruns_the_rules_that_run_it for `rule`: a definition it
    reaches beyond its entry modules (the one the fewest rules reach), one that neither it nor its temp() partner
    reaches (the one the most rules reach), and that partner."""
    c = hashed()
    inside = [d for d in editable(c[rule]) if d.split(":")[0] not in ENTRIES[rule]]  # reached, not the entry
    edit = min(inside, key=lambda d: (sum(d in other for other in c.values()), d))
    partners = frozenset({r for pair in TEMP_CONSUMERS.items() if rule in pair for r in pair} - {rule})
    outside = max(editable(set().union(*c.values()) - c[rule] - set().union(*(c[p] for p in partners))),
                  key=lambda d: sum(d in other for other in c.values()))
    return edit, outside, partners


def allowed_alone(rules, outputs_by_rule) -> list[str]:
    """The dry run's arguments for `rules`: they and their partners alone allowed, their outputs asked for (for the
    writer of temp() outputs, those of the rule reading them)."""
    allowed = sorted(set(rules).union(*(code_edits(r)[2] for r in rules)))
    targets = sorted({o for r in rules for o in outputs_by_rule[TEMP_CONSUMERS.get(r, r)]})
    return ["--allowed-rules", *allowed, "--", *targets]


@pytest.fixture(scope="module")
def outside_plans(project, code_copy, outputs_by_rule):
    """The plan of the dry run after a rule's `outside` edit (code_edits), asked once per definition for every rule
    it is outside of: all of them (and their partners) allowed and all their outputs asked for, it plans nothing
    exactly when none of the rules' own dry runs would (a rule's changed params, or an input rewritten, schedule its
    outputs in both)."""
    plans = {}

    def plan(outside: str) -> dict[str, set[str]]:
        if outside not in plans:
            rules = [r for r in CODE_EDIT_RULES if code_edits(r)[1] == outside]
            plans[outside] = dry_run_after_editing(project, code_copy, outside, *allowed_alone(rules, outputs_by_rule))
        return plans[outside]
    return plan


@pytest.mark.parametrize("rule", CODE_EDIT_RULES)
def test_a_code_edit_reruns_the_rules_that_run_it(project, code_copy, outputs_by_rule, outside_plans, rule):
    """A body edit of a definition the rule reaches makes its own params (the code hash) differ: the rule
    alone allowed (so that no upstream rerun hides its own check), its outputs are scheduled for "params
    changed". A definition it does not reach does not (one dry run for every rule that definition is outside of).

    temp() outputs are gone once the run is over: for the rule writing them the outputs asked for are
    those of the rule reading them (Snakemake keeps the removed outputs' metadata, so it reruns the
    writer for its changed params, then the reader), and a rerun of the reader reruns the writer first
    (so either is allowed with its partner, and an edit outside both reruns neither); the reader's own
    reason is then the writer's new outputs, so its params change is read from `--summary`."""
    edit, outside, partners = code_edits(rule)
    target = TEMP_CONSUMERS.get(rule, rule)
    plan = dry_run_after_editing(project, code_copy, edit, *allowed_alone([rule], outputs_by_rule))
    assert set(plan) == {rule, *partners}, (edit, plan)
    if rule in TEMP_CONSUMERS.values():
        summary = run_after_editing(project, code_copy, {edit: None}, "--summary", *outputs_by_rule[target])
        assert summary_status(summary, outputs_by_rule[rule]) == {"params changed"}, (edit, summary.stdout[-3000:])
    else:  # a stage's train job after another's: its input (the earlier stage's final.pt) is rewritten too
        params = lambda r: "Params have changed" in r or "params before and now" in r
        assert any(map(params, plan[rule])), (edit, plan)
        assert all(params(r) or r.startswith("Input files updated by another job: results/t/train/")
                   for r in plan[rule]), (edit, plan)
    assert outside_plans(outside) == {}, outside


def test_a_definition_no_rule_reaches_reruns_nothing(project, code_copy):
    unused = editable({f"pipeline.bench.suite:{n}" for n in Package().summary("pipeline.bench.suite")["defs"]}
                      - set().union(*hashed().values()))
    assert unused
    assert dry_run_after_editing(project, code_copy, unused[0]) == {}


def test_every_function_a_rule_ran_is_hashed(project):
    """Sound: in the fixture's run (every rule but the IsoFLOP sweep's, export included), each process recorded
    the package functions it ran (TOKENFARM_TRACE_CALLS, pipeline.io.run_cli); every one of them is among the
    definitions hashed by each rule that runs its module. (Functions only: a module's or class's body, run by
    an import, is not checked this way; the effects hashed are those of every module a rule's processes import.)"""
    records = [json.loads(p.read_text()) for p in traced(project).glob("*.json")]
    rules = sorted(set(ENTRIES) - SWEEP_RULES)
    assert {m for r in rules for m in ENTRIES[r]} <= {r["main"] for r in records}  # every entry ran, traced
    h = hashed()
    at = functools.cache(definition_at)  # parses the module: once per function, not once per process that ran it
    missing, ran = set(), set()
    for record in records:
        for file, line, qualname in record["calls"]:
            module = module_name(Path(file))
            definition = f"{module}:{at(module, line)}"
            ran.add(definition)
            missing |= {(r, definition, qualname) for r in rules if record["main"] in ENTRIES[r]
                        and definition not in h[r]}
    assert not missing, sorted(missing)
    # dedup's maths ran; so did the trainer under torchrun, and rendezvous, which execs torchrun
    assert {"pipeline.data.minhash:signatures", "pipeline.training.train:main", "pipeline.training.rendezvous:main"
            } <= ran


def test_docstring_comment_and_formatting_edits_rerun_nothing(project, code_copy):
    """Issue 29: the hash was over raw bytes, so a docstring typo fixed in pipeline/io.py reran every rule."""
    edits = {module_name(p): reword_docs for p in ROOT.joinpath("pipeline").rglob("*.py")}
    assert planned_jobs(run_after_editing(project, code_copy, edits, "-n", "all", "export")) == {}


DEDUP_AND_AFTER = {"dedup_signatures", "dedup_index", "dedup_candidates", "dedup", "dedup_report", "split", "mix",
                   "pack", "accounting", "train", "evaluate", "stages_report", "export", "all"}


def test_a_minhash_edit_reruns_dedup_and_after_and_why_names_it(project, code_copy):
    """Dedup's maths: every dedup rule and what follows reruns, not download, tokenizer or tokenize (whose
    modules import minhash too); `python -m pipeline.codehash --why` names the edited function."""
    with edited_copy(code_copy, {"pipeline.data.minhash:signatures": None}):
        plan = planned_jobs(snakemake(project, "-n", "all", "export", snakefile=code_copy / "Snakefile"))
        why = subprocess.run([sys.executable, "-m", "pipeline.codehash", "--why", "dedup_signatures"], cwd=project,
                             env=dict(user_env(), PYTHONPATH=str(code_copy)), capture_output=True, text=True,
                             timeout=300)
    assert {"dedup_signatures", "dedup_index", "dedup", "split", "train"} <= set(plan) <= DEDUP_AND_AFTER, plan
    assert why.returncode == 0, why.stderr
    assert re.match(r"rule dedup_signatures: \d+ output\(s\) made with code \w{16}, now \w{16}", why.stdout), why.stdout
    assert [ln.split() for ln in why.stdout.splitlines()[1:]] == [["changed", "pipeline.data.minhash:signatures"]]


def test_a_training_edit_reruns_training_and_after_not_the_data(project, code_copy):
    """A function only the trainer reaches (no data rule, nor the plan): train and what follows."""
    h = hashed()
    data = set().union(*(h[r] for r in DATA_RULES))
    edit = editable({d for d in h["train"] - data if d.startswith("pipeline.training.")})[0]
    plan = planned_jobs(run_after_editing(project, code_copy, {edit: None}, "-n", "all", "export"))
    assert "train" in plan and set(plan) <= {"train", "evaluate", "stages_report", "export", "all"}, (edit, plan)


_PLANNED_AFTER_EDIT: dict[tuple[str, str], dict[str, int]] = {}


def planned_after_edit(project, edit) -> dict[str, int]:
    """The jobs a dry run plans after `edit(config)`; the config is restored afterwards. An edited config already
    asked (by another test: the project's outputs do not change between them) is answered from that dry run."""
    cfg = json.loads(json.dumps(TINY))
    edit(cfg)
    key = (str(project), json.dumps(cfg, sort_keys=True))
    if key not in _PLANNED_AFTER_EDIT:
        write_config(project, cfg)
        try:
            _PLANNED_AFTER_EDIT[key] = planned_jobs(snakemake(project, "-n"))
        finally:
            write_config(project, TINY)
    return dict(_PLANNED_AFTER_EDIT[key])


def test_tokenizer_edit_reruns_tokenizer_and_downstream_not_download(project):
    def vocab(cfg):
        cfg["tokenizer"]["vocab_size"] = 640
        cfg["model"]["vocab_size"] = 640
    jobs = planned_after_edit(project, vocab)
    assert "download" not in jobs
    assert jobs["tokenizer"] == 1 and jobs["tokenize"] == 4 and jobs["decontaminate_flags"] == 4
    assert jobs["count"] == 1 and jobs["count_sample"] == 1  # joined again from the new tokenize metadata


def test_filter_edit_reruns_filter_and_after_not_download(project):
    """A filter's setting, a filter added at the end or one removed: every filter job and what reads the
    filtered shards rerun, never download; an unrelated edit (a dedup threshold) reruns no filter job."""
    def setting(cfg):
        cfg["filter"][1]["settings"]["dup_line_frac"] = 0.5
    def added(cfg):
        cfg["filter"].append({"name": "language", "settings": {"languages": None}})
    def removed(cfg):
        cfg["filter"].pop()  # pii
    for edit in (setting, added, removed):
        jobs = planned_after_edit(project, edit)
        assert "download" not in jobs, edit.__name__
        assert jobs["filter"] == 4 and jobs["tokenizer"] == 1 and jobs["tokenize"] == 4, edit.__name__
        assert {"dedup_signatures", "decontaminate_flags", "count", "split", "train"} <= set(jobs), edit.__name__

    def threshold(cfg):
        cfg["dedup"] = {"threshold": 0.8}
    assert "filter" not in planned_after_edit(project, threshold)


def test_dedup_edit_reruns_dedup_and_after_not_tokenize(project):
    def threshold(cfg):
        cfg["dedup"] = {"threshold": 0.8}
    jobs = planned_after_edit(project, threshold)
    assert {"dedup", "split", "mix", "pack", "accounting", "train", "evaluate"} <= set(jobs)
    assert not {"download", "filter", "tokenizer", "tokenize", "count", "dedup_signatures",
                "decontaminate_flags"} & set(jobs)

    def partitions(cfg):  # the signatures write their band keys partitioned for the candidate jobs
        cfg["dedup"] = {"partitions": 3}
    jobs = planned_after_edit(project, partitions)
    assert jobs["dedup_signatures"] >= 1 and jobs["dedup_candidates"] == 3 and "dedup" in jobs
    assert not {"download", "tokenizer", "tokenize", "count"} & set(jobs)


def test_task_list_edit_reruns_decontamination_and_after_not_tokenize(project):
    def tasks(cfg):
        cfg["eval"]["tasks"] = ["copa", "lambada"]
    jobs = planned_after_edit(project, tasks)
    assert {"eval_data", "decontaminate_grams", "decontaminate", "split", "mix", "pack", "accounting", "train",
            "evaluate"} <= set(jobs)
    assert jobs["decontaminate_flags"] == 4  # every shard group, against the new eval table
    assert not {"download", "tokenizer", "tokenize", "count", "count_sample", "dedup_signatures", "dedup"} & set(jobs)

    def cap(cfg):
        cfg["eval"]["core_max_items"] = 6  # the final evaluation's item cap: evaluate only
    # every stage's evaluation, and the stages report that reads them
    assert planned_after_edit(project, cap) == {"evaluate": 3, "stages_report": 1, "all": 1}


def test_source_edit_reruns_only_that_sources_jobs(project):
    def min_chars(cfg):
        cfg["sources"]["chat"]["min_chars"] = 50  # a tokenize-time filter of one source
    jobs = planned_after_edit(project, min_chars)
    assert jobs["tokenize"] == 1 and jobs["dedup_signatures"] == 1 and jobs["decontaminate_flags"] == 1  # chat's one
    assert not {"download", "tokenizer"} & set(jobs)

    def sample(cfg):  # which tokenized shards the plan reads: the sample table and the plan, no data job
        cfg["count"] = {"sample_shards": 3}
    assert planned_after_edit(project, sample) == {"count_sample": 1, "plan": 1, "all": 1}

    def estimate(cfg):
        cfg["sources"]["web"]["tokens_per_shard_estimate"] = 123_456  # the planner's, overridden by counts
    assert planned_after_edit(project, estimate) == {}


def test_chat_cli_answers_from_the_sft_checkpoint(project):
    out = subprocess.run([sys.executable, "-m", "pipeline.evaluation.chat", "--ckpt",
                          str(project / "results/t/train/sft/final.pt"), "--prompt", "Hi! How are you?",
                          "--temperature", "0", "--max-new-tokens", "8"],
                         cwd=project, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    answers = json.loads((project / "results/t/eval/sft/report.json").read_text())["answers"]
    assert out.stdout == answers[0]["answer"] + "\n"  # the same greedy answer as the stage report's


def test_sft_edit_reruns_sft_and_its_evaluation_not_pretraining(project):
    def sft_lr(cfg):
        cfg["train"]["stages"][2]["lr"] = 1e-3
    jobs = planned_after_edit(project, sft_lr)
    # sft's train and evaluate only (plan and accounting report every stage: cheap, not a training input)
    assert jobs == {"train": 1, "evaluate": 1, "stages_report": 1, "plan": 1, "accounting": 1, "all": 1}, jobs

    def sft_mix(cfg):
        cfg["mixes"]["sft"]["tokens"] = 5000
    jobs = planned_after_edit(project, sft_mix)
    assert jobs == {"mix": 1, "pack": 2, "accounting": 1, "train": 1, "evaluate": 1, "stages_report": 1,
                    "all": 1, "plan": 1}, jobs

    def midtrain_tokens(cfg):  # an earlier stage: it and every later stage rerun
        cfg["train"]["stages"][1]["tokens"] = 6144
    jobs = planned_after_edit(project, midtrain_tokens)
    assert jobs["train"] == 2 and jobs["evaluate"] == 2


def test_micro_batch_edit_reruns_plan_and_training_not_the_data(project):
    def micro_batch(cfg):
        cfg["train"]["micro_batch"] //= 2  # more accumulation steps, same global batch and budget
    jobs = planned_after_edit(project, micro_batch)
    assert {"plan", "train", "evaluate"} <= set(jobs)
    assert not {"download", "tokenize", "dedup", "split", "mix", "pack"} & set(jobs)


def test_nested_config_overrides_reach_any_key_with_its_type(project):
    """`--config` takes identifiers only, so nested keys go as YAML mappings; Snakemake hands their values
    over as strings ('102400'), which the Snakefile types by the schema: int, float, list, nested mapping."""
    proc = snakemake(project, "-n", "--config", "train={target_tokens: 51200, lr: 1e-2, betas: [0.9, 0.99]}",
                     "mixes={midtrain: {weights: {web: 0.25, chat: 0.75}}}")
    jobs = planned_jobs(proc)
    assert "51.2 K (from train.target_tokens)" in proc.stderr, proc.stderr[-2000:]
    assert "50 → 51.2 K tokens trained" in proc.stderr
    # both mixes (pretrain's budget, midtrain's weights); every stage retrains (each starts from the one before)
    assert jobs["mix"] == 2 and jobs["train"] == 3
    assert not {"download", "tokenize", "dedup", "split"} & set(jobs)
    bad = snakemake(project, "-n", "--config", "train={micro_batch: eight}", check=False)
    assert bad.returncode != 0 and "train.micro_batch' has value 'eight'; expected integer" in bad.stderr


def test_edited_local_shard_reruns_its_download_and_what_follows(project):
    """A local source is hashed: new content reruns that shard's download and everything downstream; the
    same content with a new mtime reruns nothing."""
    shard = project / "src/web/shard_00001.parquet"
    original = shard.read_bytes()
    try:
        write_text_shard(shard, [t + " Edited." for t in sample_docs()[1]])
        jobs = planned_jobs(snakemake(project, "-n"))
        assert jobs["download"] == 1 and {"tokenize", "dedup", "split", "pack", "train", "evaluate"} <= set(jobs)
        shard.write_bytes(original)  # the old content back, with a new mtime
        assert planned_jobs(snakemake(project, "-n")) == {}
    finally:
        shard.write_bytes(original)


def test_multi_node_train_job_needs_slurm(tmp_path):
    """A 2-node config: the train job is the multi-node launcher, which outside a SLURM allocation
    stops with one message naming the SLURM profile (tests/slurm runs it inside one)."""
    cfg = json.loads(json.dumps(TINY))
    cfg["hardware"] = {"nodes": 2}
    make_project(tmp_path, cfg)
    out = snakemake(tmp_path, "-n", "-p").stdout
    train = out[out.index("rule train:"):]
    resources = re.search(r"resources: (.*)", train).group(1).split(", ")
    assert {"nodes=2", "tasks=2", "mpi=srun"} <= set(resources), resources
    command = train[train.index("Shell command:"):].splitlines()[0]
    assert "python -m pipeline.training.rendezvous --params" in command and '"nodes":2' in command
    params = re.search(r"--params '([^']*)'", command).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "pipeline.training.rendezvous", "--params", params, "--",
                           "-m", "pipeline.training.train"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 1
    assert "one SLURM job of 2 nodes" in proc.stderr and "workflow/profiles/slurm" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_typo_is_one_clear_error(tmp_path):
    cfg = json.loads(json.dumps(TINY))
    cfg["model"]["vocab_szie"] = 512
    make_project(tmp_path, cfg)
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert "model.vocab_szie" in proc.stderr and "did you mean 'vocab_size'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_shard_fails_with_named_file_and_no_output(tmp_path):
    make_project(tmp_path, TINY)
    bad = tmp_path / "src/web/shard_00001.parquet"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated parquet
    proc = snakemake(tmp_path, "--until", "download", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "shard_00001.parquet" in out
    # the stage's exit status fails the job (behind `| tee log`), not a missing output noticed later
    assert "CalledProcessError" in out and "MissingOutputException" not in out
    assert not (tmp_path / "data/raw/web/shard_00001.parquet").exists()


def test_a_budget_the_shards_cannot_meet_stops_the_run_after_the_plans_sample(tmp_path):
    """The sample's download and tokenize jobs, count_sample and plan go first (their priority), so the
    plan's refusal comes after the sample is tokenized, not after every shard."""
    for i, texts in enumerate(sample_docs(n_shards=6, per_shard=15)):
        write_text_shard(tmp_path / f"src/web/shard_{i:05d}.parquet", texts)
    cfg = {**TINY, "sources": {"web": TINY["sources"]["web"]}, "count": {"sample_shards": 1},
           "mixes": {"pretrain": TINY["mixes"]["pretrain"]},
           "train": {**TINY["train"], "target_tokens": 10**9, "stages": [{"name": "pretrain"}]}}
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, "--cores", "1", check=False)
    assert proc.returncode != 0
    assert "Error in rule plan" in proc.stdout + proc.stderr
    assert "budget" in (tmp_path / "logs/t/plan.log").read_text()
    tokenized = sorted(p.stem for p in (tmp_path / "results/t/tokens/web").glob("shard_*.json"))
    assert tokenized == ["shard_00000"]  # the sample; the other five shards were never tokenized


def test_preset_dry_run_plans_all_shards_without_data(tmp_path, snakemake_cli):
    proc = snakemake_cli.run(
        [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "-n",
         "--configfile", str(ROOT / "configs/llama3-1b-fineweb.yaml")], Path.cwd(), user_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc)
    assert jobs["download"] == 114 and jobs["tokenize"] == 114 and jobs["train"] == 1
    from pipeline.config import load_config
    from pipeline.planning.token_plan import make_plan

    preset = run_config(load_config(ROOT / "configs/llama3-1b-fineweb.yaml"))
    gpu_hours = make_plan(preset).est_gpu_hours  # pipeline.planning's
    for shown in ("1.242 B total", "1,048,576 = 64 rows × 2048 tokens × 8 rank(s) × 1 accumulation step(s)",
                  "23,682 → 24.83 B tokens trained", "fineweb: 454 of 1823 shards", f"{gpu_hours:.1f} GPU-hours"):
        assert shown in proc.stderr, shown
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("preset", ["llama3-1b-fineweb", "llama3-8b-fineweb"])
def test_a_job_limit_splits_training_into_a_chain_of_jobs_within_it(tmp_path, snakemake_cli, preset):
    """A 24-hour limit: the dry run shows each stage's train jobs (train_segment 1 … N-1, then train), each asking
    SLURM for 24 h and never more, as many as the plan says, and the plan's jobs and wall time per stage."""
    from pipeline.config import load_config
    from pipeline.planning.parallel import resolve_parallel
    from pipeline.planning.train_jobs import stage_jobs

    proc = snakemake_cli.run(
        [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "-n", "--workflow-profile",
         str(ROOT / "workflow/profiles/slurm"), "--slurm-no-account", "--configfile",
         str(ROOT / f"configs/{preset}.yaml"), "--config", "hardware={max_job_hours: 24, cpus_per_task: 32}"],
        Path.cwd(), user_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = resolve_parallel(run_config(load_config(ROOT / f"configs/{preset}.yaml",
                                                       {"hardware": {"max_job_hours": 24}})))
    planned = stage_jobs(resolved)
    jobs = planned_jobs(proc)
    assert jobs["train"] == len(planned)
    assert jobs.get("train_segment", 0) == sum(s["jobs"] - 1 for s in planned.values())
    if preset == "llama3-8b-fineweb":  # ≈ 676 h of pretraining
        assert planned["pretrain"]["jobs"] >= 676 // 24
    blocks = re.findall(r"^rule (train|train_segment):\n(.*?)(?=^\S|\Z)", proc.stdout, flags=re.S | re.M)
    runtimes = [int(re.search(r"runtime=(\d+)", body).group(1)) for _, body in blocks]
    assert len(runtimes) == jobs["train"] + jobs.get("train_segment", 0) and set(runtimes) == {24 * 60}
    for name, stage in planned.items():
        assert re.search(rf"jobs: {name} +{stage['jobs']} jobs? × .*≤ 24 h .*h wall", proc.stderr), proc.stderr[-3000:]


# ----------------------------------------------------------------------------- interrupted runs

def start_snakemake(path: Path, *args: str) -> subprocess.Popen:
    """Snakemake in a session of its own, as from a terminal: its process group is what `kill -9 -PGID` hits."""
    env = user_env()
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(path), "--configfile", str(path / "config.yaml"),
           "--cores", "2", *args]
    log = open(path / f"snakemake-{len(list(path.glob('snakemake-*.log')))}.log", "w")
    return subprocess.Popen(cmd, cwd=path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_killed_runs_lose_nothing(project, tmp_path):
    """The README's recovery, end to end: kill -9 the Snakemake process group during a per-shard stage and
    during training (after a checkpoint, with steps logged past it), rerun the way the README says, and
    get exactly the uninterrupted run (`project`): same data files, same model tensors, every metric step
    exactly once, no stray process, no temp file."""
    path = make_project(tmp_path, TINY)
    train, ref = path / "results/t/train/pretrain", project / "results/t"  # killed while pretraining

    run = start_snakemake(path)
    wait_for(lambda: any((path / "results/t/tokens").rglob("*.bin*")), run, "tokenize wrote a file")
    kill_group(run, path)

    assert snakemake(path, "--unlock").returncode == 0
    run = start_snakemake(path, "--rerun-incomplete")
    wait_for(lambda: past_checkpoint(train), run, "training logged a step after a checkpoint")
    kill_group(run, path)
    assert not (train / "final.pt").exists()

    snakemake(path, "--unlock")
    snakemake(path, "--rerun-incomplete")

    import torch

    for stage in ("pretrain", "midtrain", "sft"):  # every stage equals the uninterrupted run's
        ours, theirs = (torch.load(d / f"train/{stage}/final.pt", weights_only=True)["model"]
                        for d in (path / "results/t", ref))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), stage
    assert logged_steps(train) == logged_steps(ref / "train/pretrain")  # each step once, in order, the whole run
    def losses(d: Path) -> list[tuple]:
        return [(r["step"], r["loss"], r.get("val_loss")) for r in map(json.loads, d.read_text().splitlines())]

    assert losses(train / "metrics.jsonl") == losses(ref / "train/pretrain/metrics.jsonl")
    data = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.suffix in (".bin", ".npy"))
    assert len(data) > 10 and [p for p in data if "pack" in p.parts]
    for rel in data:
        assert (path / "results/t" / rel).read_bytes() == (ref / rel).read_bytes(), rel
    assert [p for p in path.rglob("*") if ".tmp-" in p.name or p.name.endswith(".part")] == []
    assert planned_jobs(snakemake(path, "-n")) == {}
