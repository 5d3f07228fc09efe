"""Configuration, along its three concerns:

* `pipeline.config.resolve`: load a config file, apply command-line overrides, fill the schema's
  defaults and validate (`workflow/schemas/config.schema.yaml`, the single source of defaults), then
  the cross-field checks of `pipeline.config.checks`;
* `pipeline.config.sources`: a source's shards, the shard groups of the per-shard rules, and the
  content hashes of local shards;
* `pipeline.config.rule_params`: the table of what each rule depends on (its params slice) and the
  `--params` / `--configfile` arguments of a rule module's CLI.

The public names are re-exported here: `from pipeline.config import load_config, rule_params`.
Torch-free and snakemake-free (the Snakefile imports it at parse time).
"""
from pipeline.config.checks import STOCK_VOCAB, check_consistency, n_special_tokens
from pipeline.config.resolve import (
    ROOT,
    SCHEMA_PATH,
    deep_merge,
    load_config,
    load_schema,
    parse_overrides,
    resolve_config,
    run_dir,
    typed_overrides,
)
from pipeline.config.rule_params import (
    NOT_DOWNLOAD_KEYS,
    PLAN_TRAIN_KEYS,
    RESOURCE_KEYS,
    RULE_PARAMS,
    add_config_args,
    params_from_args,
    params_json,
    rule_params,
)
from pipeline.config.sources import (
    SOURCE_HASH_CACHE,
    hf_filenames,
    local_shard_hashes,
    sample_shards,
    shard_groups,
    source_files,
    source_shards,
)

__all__ = [
    "NOT_DOWNLOAD_KEYS", "PLAN_TRAIN_KEYS", "RESOURCE_KEYS", "ROOT", "RULE_PARAMS", "SCHEMA_PATH", "SOURCE_HASH_CACHE",
    "STOCK_VOCAB", "add_config_args", "check_consistency", "deep_merge", "hf_filenames", "load_config",
    "load_schema", "local_shard_hashes", "n_special_tokens", "params_from_args", "params_json", "parse_overrides",
    "resolve_config", "rule_params", "run_dir", "sample_shards", "shard_groups", "source_files", "source_shards",
    "typed_overrides",
]
