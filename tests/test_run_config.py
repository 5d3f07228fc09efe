"""RunConfig (pipeline/run_config.py) against the schema it mirrors, its exact round trip on every
config and rule slice, the refusal of a key a slice lacks, and the count of string-keyed config reads left
in the package (a ratchet: it may only go down)."""
from __future__ import annotations

import re
from dataclasses import fields

import pytest
import yaml
from builders import ROOT

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.rules import RULES, rule_params
from pipeline.run_config import ABSENT, RunConfig, _Section, run_config

SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
CONFIGS = [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]
SIMPLE = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "None"}


def annotation(node: dict) -> set[str]:
    """The Python types a schema node admits, as the class annotations spell them (nested objects: '<obj>')."""
    alts = node.get("oneOf") or node.get("anyOf")
    if alts:
        return set().union(*(annotation(a) for a in alts))
    if "const" in node or ("enum" in node and "type" not in node):
        values = [node["const"]] if "const" in node else node["enum"]
        return {{str: "str", int: "int", float: "float", bool: "bool", type(None): "None"}[type(v)] for v in values}
    t = node.get("type")
    if isinstance(t, list):
        return set().union(*(annotation({**node, "type": x}) for x in t))
    if t == "object" or (t is None and ("properties" in node or "additionalProperties" in node)):
        if node.get("properties"):
            return {"<obj>"}
        ap = node.get("additionalProperties")
        return {"dict[str, " + "|".join(sorted(annotation(ap))) + "]"} if isinstance(ap, dict) else {"dict"}
    if t == "array":
        items = node.get("items")
        return {"list[" + "|".join(sorted(annotation(items))) + "]"} if isinstance(items, dict) else {"list"}
    return {SIMPLE[t]}


def canonical(part: str) -> str:
    """One alternative without spaces, a container's inner alternatives sorted: 'list[int|str]'."""
    part = part.replace(" ", "")
    m = re.fullmatch(r"(list\[|dict\[str,)(.*)\]", part)
    return f"{m.group(1)}{'|'.join(sorted(m.group(2).split('|')))}]" if m else part


def spelled(ann: str) -> set[str]:
    """A class annotation's alternatives, nested config classes as '<obj>'."""
    ann = re.sub(r"\b\w+Config\b", "<obj>", ann)
    return {canonical(p) for p in re.split(r" \| (?![^\[]*\])", ann)}


DERIVED = {"stage"}  # RunConfig keys the pipeline adds (a stage's view), not the user's


def schema_nodes(node: dict, cls: type, where: str = ""):
    """(key path, schema node, config class field) of every property, walking nested classes."""
    by_name = {f.name: f for f in fields(cls) if not (cls is RunConfig and f.name in DERIVED)}
    assert set(by_name) == set(node["properties"]), (where or "<root>", set(by_name) ^ set(node["properties"]))
    for key, sub in node["properties"].items():
        f = by_name[key]
        yield f"{where}{key}", sub, f
        nested = cls._kinds()[key]
        if nested:
            inner = sub if nested[0] == "one" else (sub.get("items") if nested[0] == "list"
                                                     else sub.get("additionalProperties"))
            yield from schema_nodes(inner, nested[1], f"{where}{key}.")


def test_the_classes_mirror_the_schema_key_for_key_and_type_for_type():
    seen = 0
    for path, node, f in schema_nodes(SCHEMA, RunConfig):
        want = annotation(node) | ({"None"} if "default" not in node and path.count(".") else set())
        got, want = spelled(str(f.type)), {canonical(w) for w in want}
        assert got == want or got == want | {"None"}, (path, got, want)
        # a key with a schema default is ABSENT only in a slice that lacks it; one without may be omitted
        assert (f.default is ABSENT) == ("default" in node or not path.count(".")), path
        seen += 1
    assert seen > 150


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_config_and_every_rule_slice_round_trip_exactly(path):
    cfg = load_config(path)
    typed = run_config(cfg)
    assert typed.to_dict() == cfg and list(typed.to_dict()) == list(cfg)
    assert typed.train.seq_len == cfg["train"]["seq_len"] and typed["model"]["dim"] == cfg["model"]["dim"]
    assert run_config(typed) is typed
    source, mix = next(iter(cfg["sources"])), cfg["train"]["mix"]
    for rule in RULES:
        try:
            p = rule_params(cfg, rule.name, source, mix)
        except Exception:  # the rules without a slice of their own (count, scaling points)
            continue
        assert run_config(p).to_dict() == p, rule.name


def test_a_key_outside_the_slice_is_refused_naming_it():
    cfg = load_config(ROOT / "config.yaml")
    tok = run_config(rule_params(cfg, "tokenize", "web"))
    assert tok.sources["web"].format == cfg["sources"]["web"]["format"] and tok.count.batch_size > 0
    with pytest.raises(ConfigError, match="config key 'train' is not in these params"):
        tok.train  # noqa: B018
    with pytest.raises(ConfigError, match="'count.sample_shards'"):
        tok.count.sample_shards  # noqa: B018
    partial = run_config({"train": {"seq_len": 8}})
    with pytest.raises(ConfigError, match="'train.micro_batch'"):
        partial.train.micro_batch  # noqa: B018
    assert "stages" not in partial.train and partial.train.seq_len == 8
    assert isinstance(partial.train, _Section) and dict(partial.train) == {"seq_len": 8}


# String-keyed config reads (`cfg["…"]`, `params["…"]`, `config["…"]`) outside pipeline/config: the code reads
# attributes (RunConfig, or a small typed record where the dict is not the run config: a Hugging Face
# config.json, the sandbox child's settings); this number may only go down.
STRING_READS_MAX = 0
READ = re.compile(r'\b(?:cfg|params|config)\["')


def test_string_keyed_config_reads_only_go_down():
    per_file = {p: len(READ.findall(p.read_text())) for p in (ROOT / "pipeline").rglob("*.py")
                if "config" not in p.relative_to(ROOT / "pipeline").parts[:1]}
    total = sum(per_file.values())
    assert total <= STRING_READS_MAX, sorted(((n, str(p.relative_to(ROOT))) for p, n in per_file.items() if n),
                                             reverse=True)[:10]
    assert not any(n for p, n in per_file.items() if "planning" in p.parts), "the planning package reads attributes"
