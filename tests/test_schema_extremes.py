"""Every value the schema accepts runs or is refused at parse time, with one message naming the key.

The schema is walked for every numeric key (at its minimum, just above an exclusive minimum, at its
maximum, and at a large value) and every enum value; each case is the default config.yaml with that one
key set (a key under a named source, mix or stage: the default's first such entry). Each is parsed by
Snakemake itself, through its API, in one child process (the Snakefile's whole parse: config
resolution, schema validation, shard discovery, job sizes, the plan): it must parse, or stop with
`tokenfarm: …` naming the key, never a traceback. The data-stage values that parse are then run
(`test_data_stage_extremes_run`).
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
from builders import ROOT

SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "config.yaml").read_text())
LARGE = 10**9
# A wildcard of the schema (a mapping's entries, a list's items) -> the entry a case edits.
ENTRY = {"sources": "web", "mixes": "pretrain", "weights": "web", "stages": 1}


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


def with_value(path: tuple, value) -> tuple[dict, str]:
    """The default config with the key at `path` set to `value`; the key as a user writes it."""
    cfg = copy.deepcopy(DEFAULT)
    parent, key, node, shown = None, None, cfg, []
    for i, part in enumerate(path):
        if part == "[]" and i == len(path) - 1:  # a list of scalars (betas, eval.tasks): set whole
            parent[key] = [value] * (2 if key == "betas" else 1)
            return cfg, ".".join(shown)
        if part in ("*", "[]"):
            part = ENTRY[path[i - 1]]
        shown.append(f"[{part}]" if isinstance(part, int) else str(part))
        if i == len(path) - 1:
            node[part] = value
        else:
            parent, key = node, part
            node = node[part] if isinstance(node, list) else node.setdefault(part, {})
    return cfg, ".".join(shown).replace(".[", "[")


def cases() -> list[tuple[str, object, dict]]:
    out = []
    for path, node in schema_keys(SCHEMA):
        for v in values(node):
            cfg, key = with_value(path, v)
            out.append((key, v, cfg))
    return out


def test_the_walk_covers_the_schema():
    keys = {k for k, _, _ in cases()}
    assert len(keys) > 90
    for key in ("dedup.threshold", "decontaminate.ngram", "sources.web.min_chars", "mixes.pretrain.weights.web",
                "train.stages[1].epochs", "eval.tasks", "hardware.nccl_env", "train.betas"):
        assert key in keys, key


def parse_all(workdir: Path, configs: list[dict], procs: int = 2) -> list[tuple[str, str]]:
    """Each config parsed by Snakemake's API in `procs` child processes: ("ok"|"exit"|"error", message)."""
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
def outcomes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("extremes")
    all_cases = cases()
    return [(key, v, *o) for (key, v, _), o in zip(all_cases, parse_all(workdir, [c for _, _, c in all_cases]))]


def names_a_key(message: str, leaf: str) -> bool:
    """The key itself, or the key to change instead (a budget too large for the shards: the shards' glob)."""
    return leaf in message or re.search(r"\b(?:" + "|".join(SCHEMA["properties"]) + r")\.\w+", message) is not None


def test_every_schema_value_parses_or_is_refused_naming_its_key(outcomes):
    bad = []
    for key, value, kind, message in outcomes:
        leaf = key.rsplit(".", 1)[-1].split("[")[0]
        if kind == "error" or "Traceback" in message:
            bad.append(f"{key}={value!r}: {message[-300:]}")
        elif kind == "exit" and not (message.startswith("tokenfarm: ") and names_a_key(message, leaf)):
            bad.append(f"{key}={value!r} stopped without naming the key: {message[:300]}")
    assert not bad, "\n".join(bad)


def test_refusals_are_real(outcomes):
    """The walk reaches both sides: values that parse, and values refused (e.g. a 10^9-token budget the
    sample corpus cannot cover)."""
    kinds = {kind for *_, kind, _ in outcomes}
    assert kinds == {"ok", "exit"}
    refused = {(k, v) for k, v, kind, _ in outcomes if kind == "exit"}
    assert {("dedup.partitions", LARGE), ("hardware.nodes", LARGE), ("tokenizer.kind", "tiktoken")} <= refused
    assert ("shards_per_job", LARGE) not in refused


def _parse_child(workdir: Path) -> None:
    """Child process: parse each config with Snakemake's API, record the outcome."""
    import contextlib
    import io
    import resource

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a runaway case fails, not the machine
    out = []
    for i, cfg in enumerate(json.loads((workdir / "cases.json").read_text())):

        f = workdir / f"case-{i}.yaml"
        f.write_text(yaml.safe_dump(cfg))
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
