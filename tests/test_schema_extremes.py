"""Every value the schema accepts runs or is refused at parse time, with one message naming the key.

The schema is walked for every numeric key (at its minimum, just above an exclusive minimum, at its
maximum, and at a large value) and every enum value; each case is the default config.yaml with that one
key set (a key under a named source, mix or stage: the default's first such entry). Each is parsed by
Snakemake itself, through its API, in one child process (the Snakefile's whole parse: config
resolution, schema validation, shard discovery, job sizes, the plan): it must parse, or stop with
`tokenfarm: …` naming the key, never a traceback. The values that parse and change a data stage are then
run through the data half of the DAG (`test_data_stage_extremes_run`).

Every integer key is also given a float (16.0 for 16): refused at parse time, naming the key
(`test_every_integer_key_refuses_a_float`; one case through Snakemake's parse). The tests that run Snakemake
are marked slow: `make test-fast` runs the two in-process ones.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import resolve_config
from pipeline.errors import ConfigError
from pipeline.rules import rule_params

# builders.ROOT, not imported from builders: parse_all's children run this file, and builders imports torch,
# which no parse needs
ROOT = Path(__file__).resolve().parent.parent
SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "config.yaml").read_text())
LARGE = 10**9
# A wildcard of the schema (a mapping's entries, a list's items) -> the entry a case edits.
ENTRY = {"sources": "web", "mixes": "pretrain", "weights": "web", "stages": 1, "filter": 0}
CHAT_ONLY = {"max_conversation_tokens"}  # source keys only a chat source reads: walked on the default's chat source


def schema_keys(node: dict, path: tuple = ()):
    """(path, node) of every numeric or enum leaf; path parts are keys, '*' (any entry) or '[]' (items)."""
    t = node.get("type")
    types = t if isinstance(t, list) else [t]
    if "enum" in node or {"integer", "number"} & set(types):
        yield path, node
    for k, v in node.get("properties", {}).items():
        yield from schema_keys(v, (*path, k))
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_keys(node["additionalProperties"], (*path, "*"))
    if isinstance(node.get("items"), dict):
        yield from schema_keys(node["items"], (*path, "[]"))
    for v in node.get("oneOf", []):
        if v.get("type") != "object":  # nccl_env's free mapping of variables: no value to walk
            yield from schema_keys(v, path)


def values(node: dict) -> list:
    if "enum" in node:
        return list(node["enum"])
    integer = "integer" in (node["type"] if isinstance(node["type"], list) else [node["type"]])
    out = []
    if "minimum" in node:
        out.append(node["minimum"])
    if "exclusiveMinimum" in node:
        out.append(node["exclusiveMinimum"] + (1 if integer else 1e-6))
    if "maximum" in node:
        out.append(node["maximum"])
    out.append(LARGE if integer else float(LARGE))
    return out


def with_value(path: tuple, value, base: dict | None = None) -> tuple[dict, str]:
    """`base` (the default config) with the key at `path` set to `value`; the key as a user writes it."""
    cfg = copy.deepcopy(DEFAULT if base is None else base)
    parent, key, node, shown = None, None, cfg, []
    for i, part in enumerate(path):
        if part == "[]" and i == len(path) - 1:  # a list of scalars (betas, eval.tasks): set whole
            parent[key] = [value] * (2 if key == "betas" else 1)
            return cfg, ".".join(shown)
        if part in ("*", "[]"):
            part = "chat" if path[-1] in CHAT_ONLY else ENTRY[path[i - 1]]
        shown.append(f"[{part}]" if isinstance(part, int) else str(part))
        if i == len(path) - 1:
            node[part] = value
        else:
            parent, key = node, part
            node = node[part] if isinstance(node, list) else node.setdefault(part, {})
    return cfg, ".".join(shown).replace(".[", "[")


def cases() -> list[tuple[str, object, dict]]:
    return [(key, v, cfg) for path, v in walk() for cfg, key in [with_value(path, v)]]


def walk() -> list[tuple[tuple, object]]:
    """(schema path, value) of every case."""
    return [(path, v) for path, node in schema_keys(SCHEMA) for v in values(node)]


def test_the_walk_covers_the_schema():
    keys = {k for k, _, _ in cases()}
    assert len(keys) > 90
    for key in ("dedup.threshold", "decontaminate.ngram", "filter[0].name", "sources.web.min_chars",
                "mixes.pretrain.weights.web", "train.stages[1].epochs", "eval.tasks", "hardware.nccl_env",
                "train.betas"):
        assert key in keys, key


def node_at(path: tuple) -> dict:
    """The schema node at a path of `schema_keys`."""
    node = SCHEMA
    for part in path:
        node = node["items"] if part == "[]" else node["additionalProperties"] if part == "*" \
            else node["properties"][part]
    return node


def float_cases() -> list[tuple[str, float, dict]]:
    """(key, value, config) of every integer key given a float that equals one of its valid integers (16.0 for
    16); an integer list's first item (the list at its shortest, its other items integers)."""
    out = []
    for path, node in schema_keys(SCHEMA):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "integer" not in types:
            continue
        valid = values(node)[0]
        if path[-1] == "[]":
            items = [float(valid)] + [valid + i for i in range(1, node_at(path[:-1]).get("minItems", 1))]
            cfg, key = with_value(path[:-1], items)
        else:
            cfg, key = with_value(path, float(valid))
        out.append((key, float(valid), cfg))
    return out


def test_every_integer_key_refuses_a_float(monkeypatch):
    """`type: integer` is an int: JSON Schema's own reading (any number with no fractional part) let
    `train.micro_batch: 16.0` through the parse and the plan, to crash training after the data half ran."""
    monkeypatch.chdir(ROOT)  # the default config's source globs
    cases = float_cases()
    assert {"train.micro_batch", "train.seq_len", "scaling.depths", "sources.web.shards", "train.stages[1].tokens",
            "mixes.pretrain.tokens", "eval.core_batch_tokens"} <= {key for key, _, _ in cases}
    assert len(cases) > 50
    bad = []
    for key, value, cfg in cases:
        try:
            resolve_config(cfg)
            bad.append(f"{key}={value!r} accepted")
        except ConfigError as e:
            msg = str(e)
            shown = key.replace("[", ".").replace("]", "")  # a list index as the error names it: stages.1
            if not (f"config key '{shown}" in msg and "integer" in msg and repr(value) in msg and "\n" not in msg):
                bad.append(f"{key}={value!r}: {msg}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_a_float_for_an_integer_key_stops_snakemakes_parse(tmp_path):
    """The same refusal through the Snakefile: one `tokenfarm:` line naming the key, no job planned."""
    (tmp_path / "data").symlink_to(ROOT / "data")
    cfg, _ = with_value(("train", "micro_batch"), 16.0)
    proc = data_half(tmp_path, cfg, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "tokenfarm: config key 'train.micro_batch' must be an integer, got 16.0 (write 16)" in out, out[-2000:]


def parse_all(workdir: Path, configs: list[dict], procs: int = 2) -> list[tuple[str, str]]:
    """Each config parsed by Snakemake's API in `procs` child processes: ("ok"|"exit"|"error", message).
    A config equal to an earlier one (an enum's default value, as the default config has it) is parsed once."""
    texts = [json.dumps(c) for c in configs]  # what a child reads
    distinct = dict(zip(texts, configs))
    if len(distinct) < len(configs):
        found = dict(zip(distinct, parse_all(workdir, list(distinct.values()), procs)))
        return [found[t] for t in texts]
    children = []
    for k in range(procs):
        (workdir / str(k)).mkdir()
        (workdir / str(k) / "data").symlink_to(ROOT / "data")
        (workdir / str(k) / "cases.json").write_text(json.dumps(configs[k::procs]))
        children.append(subprocess.Popen([sys.executable, __file__, str(workdir / str(k))], cwd=workdir / str(k),
                                         stderr=subprocess.PIPE, text=True))
    parts = []
    for k, child in enumerate(children):
        _, err = child.communicate(timeout=1200)
        assert child.returncode == 0, err[-4000:]
        parts.append(json.loads((workdir / str(k) / "outcomes.json").read_text()))
    return [parts[i % procs][i // procs] for i in range(len(configs))]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> tuple[list, list]:
    """Every case of the walk and every config of BAD_FILTERS, parsed by one parse_all (one pair of children):
    (key, value, kind, message) of each case, and (kind, message) of each bad filter."""
    workdir = tmp_path_factory.mktemp("extremes")
    all_cases = cases()
    found = parse_all(workdir, [c for _, _, c in all_cases] + [with_filter(f) for f, _ in BAD_FILTERS])
    return [(key, v, *o) for (key, v, _), o in zip(all_cases, found)], found[len(all_cases):]


@pytest.fixture(scope="module")
def outcomes(parsed):
    return parsed[0]


def names_a_key(message: str, leaf: str) -> bool:
    """The key itself, or the key to change instead (a budget too large for the shards: the shards' glob)."""
    return leaf in message or re.search(r"\b(?:" + "|".join(SCHEMA["properties"]) + r")\.\w+", message) is not None


@pytest.mark.slow
def test_every_schema_value_parses_or_is_refused_naming_its_key(outcomes):
    bad = []
    for key, value, kind, message in outcomes:
        leaf = key.rsplit(".", 1)[-1].split("[")[0]
        if kind == "error" or "Traceback" in message:
            bad.append(f"{key}={value!r}: {message[-300:]}")
        elif kind == "exit" and not (message.startswith("tokenfarm: ") and names_a_key(message, leaf)):
            bad.append(f"{key}={value!r} stopped without naming the key: {message[:300]}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_refusals_are_real(outcomes):
    """The walk reaches both sides: values that parse, and values refused (e.g. a 10^9-token budget the
    sample corpus cannot cover)."""
    kinds = {kind for *_, kind, _ in outcomes}
    assert kinds == {"ok", "exit"}
    refused = {(k, v) for k, v, kind, _ in outcomes if kind == "exit"}
    assert {("dedup.partitions", LARGE), ("hardware.nodes", LARGE), ("tokenizer.kind", "tiktoken")} <= refused
    assert ("shards_per_job", LARGE) not in refused


BAD_FILTERS = [
    ([{"name": "gopher"}], "filter[0].name"),  # an unknown filter (the schema's enum)
    ([{"name": "pii"}, {"name": "c4", "settings": {"min_num_sentences": 2.5}}], "filter[1].settings.min_num_sentences"),
    ([{"name": "gopher_repetition", "settings": {"dup_line_frac": 1.5}}], "filter[0].settings.dup_line_frac"),
    ([{"name": "language", "settings": {"languages": ["xx"]}}], "filter[0].settings.languages"),
    ([{"name": "gopher_quality", "settings": {"min_words": 3}}], "filter[0].settings.min_words"),  # unknown setting
    ([{"name": "fasttext_classifier", "settings": {"path": "no/such/model.bin", "label": "hq"}}],
     "filter[0].settings.path"),
    ([{"name": "pii", "enabled": "no"}], "filter[0].enabled"),
]


def with_filter(chain: list) -> dict:
    return {**copy.deepcopy(DEFAULT), "filter": chain}


@pytest.mark.slow
def test_a_bad_filter_stops_snakemakes_parse_naming_its_key(parsed):
    """The schema (names, types) and build_chain (ranges, language codes, the classifier file) through the
    Snakefile: one `tokenfarm:` line naming the key (parsed with the walk's cases, by the same children)."""
    def flat(text):  # the schema names a list item filter.0.name, build_chain filter[0].name
        return text.replace("[", ".").replace("]", "").replace("'", "")
    outcomes = parsed[1]
    assert len(outcomes) == len(BAD_FILTERS)
    for (_, key), (kind, message) in zip(BAD_FILTERS, outcomes):
        assert kind == "exit" and message.startswith("tokenfarm: ") and flat(key) in flat(message), (key, message)


# ----------------------------------------------------------------------------- the data stages, run

DATA_RULES = ("download", "tokenizer", "tokenize", "dedup_signatures", "dedup", "split", "eval_data",
              "decontaminate_grams", "decontaminate", "mix", "pack")
DATA_SECTIONS = {"sources", "tokenizer", "count", "download", "dedup", "decontaminate", "split", "mixes",
                 "shards_per_job", "seed"}
# Values no parse can refuse: they are refused by the rule that first knows the data's size (the token counts a
# fresh run has not made when Snakemake parses), with one `error:` line naming the key to change.
AT_RUN_TIME = {
    ("train.target_tokens", LARGE): "a budget the sample corpus cannot cover within mixes.pretrain.max_epochs",
    ("mixes.pretrain.tokens", LARGE): "the same, asked of the mix directly",
    ("sources.web.format", "chat"): "a shard's columns are known when a job reads it (downloaded after the parse)",
    ("sources.web.min_chars", LARGE): "every document is shorter: the split names sources.web.min_chars",
    ("sources.chat.max_conversation_tokens", 1): "no conversation fits: the split names the cap",
    ("tokenizer.train_chars", 1000): "the merges a sample supports are known once the tokenizer job reads it: "
                                     "1,000 characters cannot give the default's 4,096-token vocabulary",
}

# Values that run, too slowly for the suite: their DAG is dry-run only (`test_slow_data_stage_extremes_plan`).
DRY_RUN_ONLY = {
    ("dedup.partitions", 4096): "4,096 candidate jobs of ~1 CPU-s each; that clusters do not depend on the "
                                "partition count is tests/data/test_dedup_partitions.py",
}


PARSED = "refused at parse:"  # run_batch's mark of a value Snakemake refused before running anything


def touches_data(cfg: dict, section: str) -> bool:
    """Whether a case changes what a data stage makes: its section is a data section, or a data rule's params
    differ from the default's (e.g. a training budget that sizes the pretrain mix)."""
    if section in DATA_SECTIONS:
        return True
    params = lambda c: {r: rule_params(resolve_config(c), r) for r in DATA_RULES}
    return params(cfg) != params(DEFAULT)


# The data half's base: the default config with each source's shards in one job (shards_per_job is walked too),
# so a run is ~25 jobs instead of 59: a job is ~1 CPU-s of start-up on the sample corpus, most of a run; and the
# presets' filter chain (language ID + PII: 2.4 CPU-s a sample web shard, the default's whole chain 5.5), which
# every batch editing a source reruns. The default chain runs in test_workflow's DAG and tests/data.
# Its benchmarks are one small task and no ChatCORE task: the default's task files made the eval n-gram table
# and every source's decontamination flags the largest part of a run, and the flags rerun with every source edit.
# The batch walking eval.tasks and eval.chat_tasks sets every task at once, so the whole table is still built and
# matched once; the default's decontamination runs in test_workflow's DAG.
# Its corpus is the sample's first shards: 3 of the 8 web shards (~1.4M tokens: the pretrain budget fits, and the
# budgets too large for the sample are still refused by the plan), 1 of the 2 chat shards (~1.5M tokens for the
# chat mixes' ~330K) and 1 of the 2 crawl shards. Every stage still runs on each source; the shards a stage reads
# set its work, which no walked value's outcome depends on (the same outcome for each of the 59 values, measured),
# and at shards_per_job 1 the job count (5 jobs per per-shard rule instead of 12).
PRESET_FILTER = yaml.safe_load((ROOT / "configs/llama3-1b-fineweb.yaml").read_text())["filter"]
FIRST_SHARDS = {"web": "shard_0000[0-2]", "chat": "shard_00000", "crawl": "shard_00000"}
GROUPED = {**DEFAULT, "shards_per_job": 8, "filter": PRESET_FILTER,
           "eval": {**DEFAULT["eval"], "tasks": ["copa"], "chat_tasks": []},
           "sources": {name: {**src, "glob": src["glob"].replace("*", FIRST_SHARDS[name])}
                       for name, src in DEFAULT["sources"].items()}}


def merged(batch: list[tuple[tuple, object]]) -> dict:
    cfg = GROUPED
    for path, value in batch:
        cfg, _ = with_value(path, value, cfg)
    return cfg


def data_half(project: Path, cfg: dict, *args: str) -> subprocess.CompletedProcess:
    """`snakemake … --until accounting` of `cfg` in `project`; within `served_snakemake()` (the data_runs fixture)
    through its server, Snakemake's CLI forked from one process that imported it once."""
    from builders import SNAKEMAKE, run_snakemake_cli  # here, not at the top: see ROOT

    (project / "case.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(project),
           "--configfile", "case.yaml", "--cores", "2", "--until", "accounting", "-q", *args]
    return run_snakemake_cli(cmd, project, 1800)


def ran_a_job(proc: subprocess.CompletedProcess) -> bool:
    """Whether a run started a job (Snakemake's `Execute N jobs...`): one that stops at its parse (or while
    its DAG is built) starts none, exactly where a dry run of it stops."""
    return re.search(r"^Execute \d+ jobs", proc.stdout + proc.stderr, re.M) is not None


def parse_groups(project: Path, batch: list, refused: bool = False) -> tuple[list[list], list]:
    """`batch` cut by dry runs alone (halved where one fails) into groups that each parse, and the values
    refused at parse on their own: (path, value, the dry run's output marked PARSED). `refused`: the batch is
    known to be refused at parse (its own run was), so it is halved without a dry run."""
    if not refused:
        dry = data_half(project, merged(batch), "-n")
        if dry.returncode == 0:
            return [batch], []
        if len(batch) == 1:
            return [], [(*batch[0], f"{PARSED}\n{dry.stdout}{dry.stderr}")]
    half = len(batch) // 2
    (first, refused_first), (second, refused_second) = (parse_groups(project, batch[:half]),
                                                        parse_groups(project, batch[half:]))
    return first + second, refused_first + refused_second


def run_batch(project: Path, batch: list, parse_checked: bool = False) -> list[tuple[tuple, object, str | None]]:
    """Run the data half with every value of `batch` set at once; where that fails, halve the batch until
    each failure is one value's: (path, value, None) for a value that ran, else its failure's output (marked
    PARSED where Snakemake refused it before running anything). A batch refused at parse has the values that
    parse found by dry runs (which run nothing), and those run together, not half by half."""
    proc = data_half(project, merged(batch))
    if proc.returncode == 0:
        return [(path, v, None) for path, v in batch]
    output = proc.stdout + proc.stderr
    if len(batch) == 1:  # a value refused at parse once the counts are known (the plan), or failing
        return [(*batch[0], output if ran_a_job(proc) else f"{PARSED}\n{output}")]
    if not ran_a_job(proc) and not parse_checked:
        groups, refused = parse_groups(project, batch, refused=True)
        parses = [case for group in groups for case in group]
        return refused + (run_batch(project, parses, parse_checked=True) if parses else [])
    half = len(batch) // 2
    return run_batch(project, batch[:half], parse_checked) + run_batch(project, batch[half:], parse_checked)


@pytest.fixture(scope="module")
def data_runs(outcomes, tmp_path_factory):
    """Every value that parses and changes a data stage, run through the data half of the DAG (download →
    accounting) on the default config (GROUPED). Values are batched (the k-th value of every key at once) in one
    project, so each run redoes only the stages its values change; a failing batch is halved down to the
    values that fail. A value GROUPED already has, written or by the schema's default (tokenizer.delimiter: bos,
    dedup.partitions: 1), ran in the base's own run: it takes no batch."""
    parsed = {(key, str(v)) for key, v, kind, _ in outcomes if kind == "ok"}
    by_key: dict[str, list] = {}
    alone = []  # refused when the data is known: each run on its own, not halved out of a batch
    for path, v in walk():
        cfg, key = with_value(path, v)
        if (key, str(v)) in parsed and touches_data(cfg, path[0]) and (key, v) not in DRY_RUN_ONLY:
            (alone if (key, v) in AT_RUN_TIME else by_key.setdefault(key, [])).append((path, v))
    # Straight after the base, the values a mix refuses rerun the pretrain mix alone; a source's value then reruns
    # that source (and the next one reverts it), and the batches rerun nearly every stage whatever comes before.
    alone.sort(key=lambda case: case[0][0] == "sources")
    for key, vals in by_key.items():  # a list of enum values (eval.tasks): every value at once, one list
        if vals[0][0][-1] == "[]" and len(vals) > 1:
            by_key[key] = [(vals[0][0][:-1], [v for _, v in vals])]
    covered = [case for vals in by_key.values() for case in vals
               if resolve_config(merged([case])) == resolve_config(GROUPED)]
    by_key = {key: rest for key, vals in by_key.items() if (rest := [case for case in vals if case not in covered])}
    from builders import served_snakemake

    project = tmp_path_factory.mktemp("data-extremes")
    (project / "data").symlink_to(ROOT / "data")
    batches = [[vals[k] for vals in by_key.values() if len(vals) > k] for k in range(max(map(len, by_key.values())))]
    with served_snakemake():
        assert data_half(project, GROUPED).returncode == 0  # the base's data half, which the batches edit
        runs = [(path, v, None) for path, v in covered]
        runs += [r for batch in [[case] for case in alone] + batches for r in run_batch(project, batch)]
    return [(with_value(path, v)[1], v, failure) for path, v, failure in runs]


@pytest.mark.slow
def test_data_stage_extremes_run(data_runs):
    """Each value the parse lets through runs the data stages to the end, is refused at parse once the counts
    are known (the plan's `tokenfarm:` message naming a key), or (listed in AT_RUN_TIME, with the reason no
    parse can know) is refused by its stage with one `error:` line that names a config key."""
    assert len(data_runs) > 40
    bad = []
    for key, value, failure in data_runs:
        listed = not isinstance(value, list) and (key, value) in AT_RUN_TIME
        if failure is None:
            assert not listed, f"{key}={value!r} runs now: take it out of AT_RUN_TIME"
            continue
        if failure.startswith(PARSED):  # refused before any job ran: one `tokenfarm:` message naming a key
            message = failure[failure.find("tokenfarm: "):]
            if "Traceback" in failure or "tokenfarm: " not in failure or not names_a_key(message, key.split(".")[-1]):
                bad.append(f"{key}={value!r}: {failure[-1500:]}")
            continue
        # a stage CLI's one line per failed job; jobs that ran side by side each print theirs, naming their shard
        lines = {re.sub(r"\S*shard_\d+\S*", "<shard>", ln) for ln in failure.splitlines() if ln.startswith("error: ")}
        if not listed or "Traceback" in failure or len(lines) != 1 \
                or not names_a_key(next(iter(lines)), key.rsplit(".", 1)[-1]):
            bad.append(f"{key}={value!r}: {failure[-1500:]}")
    assert not bad, "\n\n".join(bad)


@pytest.mark.slow
def test_slow_data_stage_extremes_plan(tmp_path):
    """The values too slow to run in the suite: their DAG builds (every job planned, nothing run)."""
    (tmp_path / "data").symlink_to(ROOT / "data")
    planned = []
    for path, v in walk():
        cfg, key = with_value(path, v)
        if (key, v) in DRY_RUN_ONLY:
            proc = data_half(tmp_path, cfg, "-n")
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            planned.append((key, v))
    assert sorted(planned) == sorted(DRY_RUN_ONLY)  # every entry is a value the walk reaches


def translate_once() -> None:
    """Snakemake translates each Snakefile it includes (its grammar into Python) before running it: the same
    code for every config, which was a third of a parse here. Within a child each file is translated once;
    every config still runs the whole translated Snakefile (config resolution, validation, the plan...)."""
    import snakemake.parser
    import snakemake.workflow

    translate, done = snakemake.workflow.parse, {}

    def parse(path, workflow, linemap, overwrite_shellcmd=None, rulecount=0):
        key = (path.get_path_or_uri(secret_free=True), overwrite_shellcmd, rulecount)
        snakemake.parser.Shell.overwrite_cmd = overwrite_shellcmd  # what a translation sets besides its code
        if key not in done:
            lines: dict[int, int] = {}
            done[key] = (*translate(path, workflow, linemap=lines, overwrite_shellcmd=overwrite_shellcmd,
                                    rulecount=rulecount), lines)
        code, count, lines = done[key]
        linemap.update(lines)
        return code, count

    snakemake.workflow.parse = parse


def _parse_child(workdir: Path) -> None:
    """Child process: parse each config with Snakemake's API, record the outcome."""
    import contextlib
    import io
    import resource

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a runaway case fails, not the machine
    translate_once()
    out = []
    for i, cfg in enumerate(json.loads((workdir / "cases.json").read_text())):
        # JSON, which Snakemake reads before it tries YAML (its YAML reader was a tenth of a parse): the config the
        # parent sent, its keys in yaml.safe_dump's order
        f = workdir / f"case-{i}.json"
        f.write_text(json.dumps(cfg, sort_keys=True))
        sink = io.StringIO()
        try:
            with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
                with SnakemakeApi(OutputSettings()) as api:
                    api.workflow(resource_settings=ResourceSettings(cores=1),
                                 config_settings=ConfigSettings(configfiles=[f]), snakefile=ROOT / "Snakefile",
                                 workdir=workdir).list_rules()
            out.append(("ok", ""))
        except SystemExit as e:
            out.append(("exit", str(e)))
        except Exception as e:
            import traceback

            out.append(("error", "".join(traceback.format_exception(e))))
    (workdir / "outcomes.json").write_text(json.dumps(out))


if __name__ == "__main__":
    _parse_child(Path(sys.argv[1]))
