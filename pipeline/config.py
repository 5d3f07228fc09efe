"""Configuration: load, fill defaults from the schema, validate, and derive what stages share.

`workflow/schemas/config.schema.yaml` is the single source of defaults and per-key validation; this
module applies it with jsonschema (Draft 2020-12 with defaults, as Snakemake's `validate` does) and adds
the cross-field checks a schema cannot express. Every failure is one `ConfigError` that names the
offending key and the fix.
"""
from __future__ import annotations

import copy
import difflib
import glob
import json
import os
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import yaml

from pipeline.budget import world_size
from pipeline.errors import ConfigError
from pipeline.stages import tokenizer_sources

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "workflow" / "schemas" / "config.schema.yaml"




@lru_cache(maxsize=1)
def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _validator_with_defaults():
    from jsonschema import Draft202012Validator, validators

    validate_props = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if "default" in sub and prop not in instance:
                    instance[prop] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})


def _key_path(path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _describe_type(schema: dict) -> str:
    """'an integer >= 1', "'plan'": one alternative of a oneOf, with its bounds."""
    if "const" in schema:
        return repr(schema["const"])
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
    if err.validator in ("type", "enum", "const", "oneOf"):
        want = err.schema.get("type") or err.schema.get("enum") or err.schema.get("const")
        if err.validator == "oneOf":
            want = " or ".join(_describe_type(s) for s in err.schema["oneOf"])
        return f"config key '{key}' has value {err.instance!r}; expected {want}"
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


# ----------------------------------------------------------------------------- cross-field checks


# Token ids of the stock tiktoken encodings (their own special tokens included); tokenfarm's
# special tokens are appended after them (pipeline.data.tokenizer.build_tokenizer).
STOCK_VOCAB = {"r50k_base": 50257, "p50k_base": 50281, "cl100k_base": 100277, "o200k_base": 200019}


def n_special_tokens(delimiter: str) -> int:
    """How many special tokens a tokenizer reserves: <|bos|>, <|eos|> for the eos/both policies, and
    the 4 chat tokens (the list itself: pipeline.data.encoding.special_token_names)."""
    return 6 if delimiter in ("eos", "both") else 5


def check_consistency(cfg: dict) -> None:
    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"config key '{key}': {msg}")

    sources = cfg["sources"]
    for name, src in sources.items():
        if src["type"] == "local":
            if "glob" not in src:
                fail(f"sources.{name}.glob", "a local source needs a glob of parquet files")
            for k in ("repo", "pattern", "shards"):
                if k in src:
                    fail(f"sources.{name}.{k}", "only valid for type: hf")
        else:
            for k in ("repo", "pattern", "shards"):
                if k not in src:
                    fail(f"sources.{name}.{k}", "required for type: hf (repo, pattern, shards: [start, stop])")
            if "glob" in src:
                fail(f"sources.{name}.glob", "only valid for type: local")
            a, b = src["shards"]
            if b <= a:
                fail(f"sources.{name}.shards", f"empty range [{a}, {b}); give [start, stop) with stop > start")
            if "{" not in src["pattern"]:
                fail(f"sources.{name}.pattern",
                     "needs a format field for the shard index, e.g. shard_{index:05d}.parquet")

    tok = cfg["tokenizer"]
    for s in tok.get("train_sources", []):
        if s not in sources:
            fail("tokenizer.train_sources", f"unknown source '{s}' (sources: {', '.join(sources)})")

    d = cfg["dedup"]
    if d["bands"] * d["rows"] != d["num_perm"]:
        fail("dedup.num_perm", f"bands × rows must equal num_perm ({d['bands']} × {d['rows']} != {d['num_perm']})")

    if cfg["split"]["method"] == "shards":
        for s, names in cfg["split"]["val_shards"].items():
            if s not in sources:
                fail(f"split.val_shards.{s}", f"unknown source '{s}'")
            known = set(source_shards(cfg, s))
            for n in names:
                if n not in known:
                    fail(f"split.val_shards.{s}", f"unknown shard '{n}' of source '{s}'")

    for mname, mix in cfg["mixes"].items():
        for s in mix["weights"]:
            if s not in sources:
                fail(f"mixes.{mname}.weights.{s}", f"unknown source (sources: {', '.join(sources)})")
    if cfg["train"]["mix"] not in cfg["mixes"]:
        fail("train.mix", f"unknown mix '{cfg['train']['mix']}' (mixes: {', '.join(cfg['mixes'])})")

    m = cfg["model"]
    if m["dim"] % m["n_heads"]:
        fail("model.n_heads", f"dim {m['dim']} is not divisible by n_heads {m['n_heads']}")
    if (m["dim"] // m["n_heads"]) % 2:
        fail("model.n_heads", "head dim (dim / n_heads) must be even for RoPE")
    if m["n_heads"] % m["n_kv_heads"]:
        fail("model.n_kv_heads", f"n_heads {m['n_heads']} is not divisible by n_kv_heads {m['n_kv_heads']}")
    if tok["kind"] == "bpe" and m["vocab_size"] < tok["vocab_size"]:
        fail("model.vocab_size", f"{m['vocab_size']} is smaller than tokenizer.vocab_size {tok['vocab_size']}")
    if tok["kind"] == "tiktoken" and tok["encoding"] in STOCK_VOCAB:
        ids = STOCK_VOCAB[tok["encoding"]] + n_special_tokens(tok["delimiter"])
        if m["vocab_size"] < ids:
            fail("model.vocab_size", f"{m['vocab_size']} is smaller than the {ids} token ids of {tok['encoding']} "
                                     f"with tokenfarm's {n_special_tokens(tok['delimiter'])} special tokens appended")

    t = cfg["train"]
    per_micro = t["micro_batch"] * t["seq_len"] * world_size(cfg)
    if t["global_batch_tokens"] % per_micro:
        fail(
            "train.global_batch_tokens",
            f"{t['global_batch_tokens']} is not divisible by micro_batch × seq_len × world_size "
            f"(hardware.nodes × hardware.nproc_per_node) = {t['micro_batch']} × {t['seq_len']} × {world_size(cfg)} "
            f"= {per_micro}; change global_batch_tokens, micro_batch or the hardware",
        )
    if t["target_tokens"] is not None and t["target_flops"] is not None:
        fail("train.target_flops", "set at most one of train.target_tokens and train.target_flops")
    if cfg["hardware"]["device"] == "cpu" and (t["fp8"] != "none" or t["optimizer"] == "adamw8bit"):
        fail("train.fp8" if t["fp8"] != "none" else "train.optimizer", "fp8 and adamw8bit need hardware.device: cuda")
    if t["ce_matmul"] == "tf32" and (t["precision"] != "bf16" or cfg["hardware"]["device"] != "cuda"):
        fail("train.ce_matmul", "tf32 sets torch's float32 matmul precision for the whole step, so it needs "
                                "train.precision: bf16 on hardware.device: cuda; use fp32 or bf16")
    from pipeline.stages import stage_list  # stages imports budget and errors only

    stage_list(cfg)  # train.stages: one ConfigError per bad stage


# ----------------------------------------------------------------------------- derived values

def run_dir(cfg: dict) -> Path:
    return Path(cfg["results_dir"]) / cfg["run_name"]


def hf_filenames(src: dict) -> list[str]:
    a, b = src["shards"]
    return [src["pattern"].format(index=i) for i in range(a, b)]


def source_files(cfg: dict, name: str) -> dict[str, str]:
    """Shard name -> origin (local path, or hf file name in the repo), in a stable order."""
    src = cfg["sources"][name]
    if src["type"] == "local":
        paths = sorted(glob.glob(src["glob"]))
        if not paths:
            raise ConfigError(f"config key 'sources.{name}.glob': no files match {src['glob']!r} (relative to "
                              f"{os.getcwd()})")
        out = {Path(p).name.removesuffix(".parquet"): p for p in paths}
        if len(out) != len(paths):
            raise ConfigError(f"config key 'sources.{name}.glob': two files share a name; shard names must be unique")
        return out
    return {Path(f).name.removesuffix(".parquet"): f for f in hf_filenames(src)}


def source_shards(cfg: dict, name: str) -> list[str]:
    return list(source_files(cfg, name))


def shard_groups(cfg: dict, name: str) -> dict[str, list[str]]:
    """Consecutive shards of a source in groups of `shards_per_job`, named by their first shard."""
    shards = source_shards(cfg, name)
    n = cfg["shards_per_job"]
    return {shards[i]: shards[i:i + n] for i in range(0, len(shards), n)}


def params_json(obj: Any) -> str:
    """Canonical JSON of a config slice, passed to a stage as --params."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------- per-stage params

def _source_slice(cfg: dict, names, keep=("type", "format", "text_column", "messages_column", "min_chars",
                                          "max_conversation_tokens")) -> dict:
    return {n: {k: cfg["sources"][n][k] for k in keep if k in cfg["sources"][n]} for n in names}


def _sources_without(cfg: dict, names, drop: tuple[str, ...]) -> dict:
    return {n: {k: v for k, v in cfg["sources"][n].items() if k not in drop} for n in names}


# What the download stage does not depend on: an edit to these reruns no download.
NOT_DOWNLOAD_KEYS = ("min_chars", "max_conversation_tokens", "tokens_per_shard_estimate")


PLAN_TRAIN_KEYS = (
    "mix", "seq_len", "global_batch_tokens", "micro_batch", "tokens_per_param", "target_tokens", "target_flops",
    "precision", "optimizer", "activation_checkpointing", "checkpoint_every_n", "ce_chunk_tokens", "ce_matmul",
    "compile", "fp8",
)


RESOURCE_KEYS = ("cpus_per_task",)  # hardware keys that size jobs and change no output


def stage_params(cfg: dict, stage: str, source: str | None = None, mix: str | None = None) -> dict:
    """The config slice a stage depends on. Rules declare it as `params:` (so an edit to it reruns
    the rule and its downstream) and pass it to the stage CLI as --params JSON. For the per-shard
    stages (download, count, tokenize, dedup_signatures) `source` narrows it to the job's own source,
    so editing one source reruns no job of another; for mix and pack `mix` narrows it to the job's own
    mix, so editing one mix (or a training stage on another mix) reruns no job of another."""
    names = list(cfg["sources"]) if source is None else [source]
    if stage == "download":
        return {"sources": _sources_without(cfg, names, NOT_DOWNLOAD_KEYS), "download": cfg["download"]}
    if stage == "tokenizer":  # sampling reads text only: min_chars (and the chat cap) apply at tokenize time
        sources = _source_slice(cfg, tokenizer_sources(cfg), ("type", "format", "text_column", "messages_column"))
        return {"tokenizer": cfg["tokenizer"], "sources": sources, "seed": cfg["seed"]}
    if stage in ("count", "tokenize", "dedup_signatures"):
        p = {"sources": _source_slice(cfg, names), "count": cfg["count"]}
        if stage == "dedup_signatures":  # what the signatures depend on: a threshold edit reruns clustering only
            p["dedup"] = {k: cfg["dedup"][k] for k in ("ngram", "num_perm", "bands", "rows", "seed")}
        return p
    if stage == "dedup":
        return {"dedup": cfg["dedup"], "seed": cfg["seed"]}
    if stage == "split":
        return {"split": cfg["split"], "seed": cfg["seed"]}
    if stage == "eval_data":  # the task files depend on the task list and the pool only
        e = cfg["eval"]
        return {"tasks": e["tasks"], "pool_size": e["core_pool_size"], "seed": cfg["seed"]}
    if stage == "decontaminate":
        return {"decontaminate": cfg["decontaminate"], "eval_tasks": cfg["eval"]["tasks"],
                "sources": _source_slice(cfg, names, ("type", "format", "text_column", "messages_column"))}
    if stage in ("mix", "pack"):
        mixes = cfg["mixes"] if mix is None else {mix: cfg["mixes"][mix]}
        p = {"mixes": mixes, "seq_len": cfg["train"]["seq_len"], "seed": cfg["seed"]}
        plan_mixes = [m for m, v in mixes.items() if v["tokens"] == "plan"]
        if stage == "mix" and plan_mixes:
            # `tokens: plan` resolved here rather than read from plan.json: the figure (the most any
            # training stage on the mix consumes, pipeline.stages.mix_targets) depends on the budgets,
            # model and global batch only, so a micro-batch or hardware edit (which rewrites plan.json)
            # reruns no data stage, while a budget edit reruns the mix.
            from pipeline.stages import mix_targets

            p["trained_tokens"] = {m: mix_targets(cfg, m) for m in plan_mixes}
        return p
    if stage == "export":  # what an exported model directory depends on (the checkpoint brings the weights)
        return {"model": cfg["model"], "tokenizer": cfg["tokenizer"], "train": {"seq_len": cfg["train"]["seq_len"]}}
    # The plan rule reads measured counts of every source, so the planner's per-shard estimate is an
    # input of no rule: editing it reruns nothing (it serves dry runs and `python -m pipeline.plan`).
    sources = _sources_without(cfg, cfg["sources"], ("tokens_per_shard_estimate",))
    # How big a job is, not what it computes: editing these reruns nothing (they reach rules as threads).
    cfg = {**cfg, "hardware": {k: v for k, v in cfg["hardware"].items() if k not in RESOURCE_KEYS}}
    if stage == "plan":  # budget, batch layout and memory only: an lr edit reruns train, not the data stages
        keep = ("run_name", "seed", "tokenizer", "split", "mixes", "model", "hardware")
        return {**{k: cfg[k] for k in keep}, "sources": sources,
                "train": {k: cfg["train"][k] for k in (*PLAN_TRAIN_KEYS, "stages")},
                "eval": {"core_batch_tokens": cfg["eval"]["core_batch_tokens"]}}  # the evaluation memory
    if stage in ("train", "evaluate", "accounting"):
        # These depend on (almost) the whole run description. Accounting reads no eval.* key, and
        # training's CORE subset has its own item cap: an edit of the final evaluation's cap reruns
        # evaluate only.
        p = {**{k: v for k, v in cfg.items() if k != "download"}, "sources": sources}
        if stage == "train":
            p["eval"] = {k: v for k, v in cfg["eval"].items() if k != "core_max_items"}
        if stage == "accounting":
            del p["eval"]
        return p
    raise KeyError(f"unknown stage {stage!r}")


def add_config_args(parser) -> None:
    """--params JSON (what rules pass) or --configfile FILE (for hand use) on a stage CLI."""
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--params", help="the stage's config slice as JSON (what the Snakemake rule passes)")
    g.add_argument("--configfile", help="a full config YAML; the stage takes its slice from it")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="with --configfile: override a key (dotted, e.g. train.resume=never; the value is "
                             "read as YAML and typed by the schema); repeatable")


def params_from_args(args, stage: str) -> dict:
    overrides = getattr(args, "set", None)
    if args.params is not None:
        if overrides:
            raise ConfigError("--set applies to --configfile only; --params is the resolved slice a rule passes")
        return json.loads(args.params)
    return stage_params(load_config(args.configfile, parse_overrides(overrides)), stage)


# ----------------------------------------------------------------------------- command-line overrides

def _valid(value: Any, schema: dict) -> bool:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(schema).is_valid(value)


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


# ----------------------------------------------------------------------------- local source contents

SOURCE_HASH_CACHE = ".source-sha256.json"  # under data_dir


@cache
def _local_hashes(data_dir: str, pattern: str) -> dict[str, str]:
    """sha256 of every file `pattern` matches, keyed by shard name; cached on disk by file identity."""
    from pipeline.io import sha256_file, write_json

    cache_path = Path(data_dir) / SOURCE_HASH_CACHE
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    out, changed = {}, False
    for p in sorted(glob.glob(pattern)):
        st = os.stat(p)
        key, ident = str(Path(p).resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = cache.get(key)
        if not (isinstance(hit, dict) and hit.get("stat") == ident):
            hit, changed = {"stat": ident, "sha256": sha256_file(p)}, True
            cache[key] = hit
        out[Path(p).name.removesuffix(".parquet")] = hit["sha256"]
    if changed:
        try:
            write_json(cache_path, cache)
        except OSError:
            pass  # a read-only data_dir: hashes are recomputed next time
    return out


def local_shard_hashes(cfg: dict, source: str, shards: list[str]) -> dict[str, str]:
    """Shard -> sha256 of its local source file, for `shards` of a local source ({} for an hf source).

    The download rule declares it as a param: a local shard whose *content* changed reruns its download
    and everything downstream, while a file that was only touched (same content, new mtime) reruns
    nothing, which declaring the file as an input (mtime) would not give. Hashes are cached in
    `{data_dir}/.source-sha256.json` by (path, size, mtime, inode), so a parse hashes only new or
    changed files.
    """
    src = cfg["sources"][source]
    if src["type"] != "local":
        return {}
    hashes = _local_hashes(cfg["data_dir"], src["glob"])
    return {s: hashes[s] for s in shards}
