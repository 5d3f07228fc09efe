"""Configuration: load a config file, apply command-line overrides, fill defaults from the schema and
validate it.

`workflow/schemas/config.schema.yaml` is the single source of defaults and per-key validation; this
module applies it with jsonschema (Draft 2020-12 with defaults, as Snakemake's `validate` does), then
the cross-field checks a schema cannot express (`pipeline.config.checks`). Every failure is one
`ConfigError` that names the offending key and the fix.

One departure from JSON Schema: `type: integer` takes integers only. The standard accepts any number
with a zero fractional part, so `train.micro_batch: 16.0` would pass and reach the code as a float
(a slice bound, a tensor shape) long after the parse; here it is refused, naming the key.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.checks import check_consistency
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA_PATH = ROOT / "workflow" / "schemas" / "config.schema.yaml"


@lru_cache(maxsize=1)
def load_schema() -> dict:
    # libyaml's safe loader where PyYAML has it: an order of magnitude faster, in every parse (BENCHMARKS.md:
    # "Figures behind code comments")
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@lru_cache(maxsize=1)
def _validator_class():
    """The schema's validator: `type: integer` is an int, not a float with no fractional part (JSON Schema's
    reading) nor a bool. jsonschema is imported here, on first use: a stage job reads its params, validated
    when Snakemake parsed the config, and need not pay the import."""
    from jsonschema import Draft202012Validator, validators

    strict = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return validators.extend(Draft202012Validator, type_checker=strict)


@lru_cache(maxsize=1)
def _validator_with_defaults():
    from jsonschema import validators

    validate_props = _validator_class().VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if "default" in sub and prop not in instance:
                    instance[prop] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return validators.extend(_validator_class(), {"properties": set_defaults})


def _key_path(path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _describe_type(schema: dict) -> str:
    """'an integer >= 1', "'plan'", "'a' or 'b'": one alternative of a oneOf, with its bounds."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return " or ".join(map(repr, schema["enum"]))
    bounds = [f"{op} {schema[k]}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                                                ("exclusiveMaximum", "<")) if k in schema]
    return " ".join([f"{'an' if str(schema.get('type'))[0] in 'aeiou' else 'a'} {schema.get('type')}", *bounds])


def _format_error(err, schema: dict) -> str:
    key = _key_path(err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = [k for k in err.instance if k not in allowed] if isinstance(err.instance, dict) else []
        msgs = []
        for k in extra:
            full = f"{key}.{k}" if key != "<root>" else k
            hint = difflib.get_close_matches(k, allowed, n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else f"allowed keys: {', '.join(allowed)}"
            msgs.append(f"config key '{full}' is not a known key ({fix})")
        return "; ".join(msgs) if msgs else err.message
    types = err.schema.get("type") if isinstance(err.schema.get("type"), list) else [err.schema.get("type")]
    if err.validator == "type" and "integer" in types and isinstance(err.instance, float):
        want = " or ".join("null" if t == "null" else f"{'an' if t[0] in 'aeiou' else 'a'} {t}" for t in types)
        fix = f" (write {int(err.instance)})" if err.instance.is_integer() else ""
        return f"config key '{key}' must be {want}, got {err.instance!r}{fix}"
    if err.validator in ("type", "enum", "const", "oneOf"):
        want = err.schema.get("type") or err.schema.get("enum") or err.schema.get("const")
        if err.validator == "oneOf":
            want = " or ".join(_describe_type(s) for s in err.schema["oneOf"])
        return f"config key '{key}' has value {err.instance!r}; expected {want}"
    if err.validator == "uniqueItems":
        twice = next(v for i, v in enumerate(err.instance) if v in err.instance[:i])
        return f"config key '{key}' lists {twice!r} more than once; give each value once"
    if err.validator == "required":
        return f"config key '{key}': {err.message}"
    return f"config key '{key}': {err.message}"


def resolve_config(config: dict) -> dict:
    """Return a validated copy of `config` with schema defaults filled in.

    Raises ConfigError naming the first offending key.
    """
    cfg = copy.deepcopy(dict(config))
    schema = load_schema()
    validator = _validator_with_defaults()(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        raise ConfigError(_format_error(errors[0], schema)
                          + " — fix it in your config file (see workflow/schemas/config.schema.yaml).")
    # Defaults may have been inserted after a nested default object was created: run again to fill them.
    validator.validate(cfg)
    check_consistency(cfg)
    # The filter settings' n-gram sizes (`top_n_grams: {2: 0.2}`) as strings, as JSON has them: a config written
    # in YAML (int keys) and the same config passed through JSON (--config, a rule's params) are then one config,
    # and every rule's params (sorted JSON) compare equal.
    cfg["filter"] = json.loads(json.dumps(cfg["filter"]))
    return cfg


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    if overrides:
        raw = deep_merge(raw, overrides)
    return resolve_config(raw)


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def run_dir(cfg: dict) -> Path:
    return Path(cfg["results_dir"]) / cfg["run_name"]


# ----------------------------------------------------------------------------- command-line overrides

def _valid(value: Any, schema: dict) -> bool:
    return _validator_class()(schema).is_valid(value)


def _subschema(schema: dict, key: str) -> dict:
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def _retype(value: Any, schema: dict) -> Any:
    """`value` with every scalar the schema does not accept as given re-read as YAML (then as a number)."""
    if isinstance(value, dict):
        return {k: _retype(v, _subschema(schema, k)) for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [_retype(v, items) for v in value]
    if not schema or _valid(value, schema):
        return value
    if not isinstance(value, str):  # a top-level value Snakemake already read as int/float/bool
        return str(value) if _valid(str(value), schema) else value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    if isinstance(parsed, (dict, list)):
        return _retype(parsed, schema)
    candidates = [parsed]
    for number in (int, float):  # YAML 1.1 reads 1e-2 (no dot) as a string
        try:
            candidates.append(number(value))
        except ValueError:
            pass
    return next((c for c in candidates if _valid(c, schema)), parsed)


def typed_overrides(overrides: dict) -> dict:
    """Config overrides from the command line, typed as the schema says.

    Snakemake reads a top-level ``--config KEY=VALUE`` as int, float, bool or YAML, but reads the YAML
    with BaseLoader, so every scalar *inside* a mapping or list arrives as a string:
    ``--config train='{target_tokens: 300000}'`` gives ``{"target_tokens": "300000"}``, which the schema
    refuses. Here each such string that its key's schema does not accept is read again as YAML (then
    as an int or float): ``"300000"`` becomes 300000, ``"1e-2"`` 0.01, ``"null"`` None, while a
    string the key does accept stays a string (``run_name: "007"``, ``tokens: plan``). A value that
    fits nothing is left as it is, for validation to name the key.
    """
    return _retype(dict(overrides), load_schema())


def parse_overrides(items: list[str] | None) -> dict:
    """``KEY=VALUE`` items with dotted keys (``train.target_tokens=300000``, ``mixes.pretrain.weights={web: 1}``)
    as one nested mapping, typed by `typed_overrides`."""
    out: dict = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {item!r} is not KEY=VALUE (a dotted key, e.g. train.target_tokens=300000)")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' was given a value by an earlier override")
        node[parts[-1]] = value
    return typed_overrides(out)
