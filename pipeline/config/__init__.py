"""Configuration, along its three concerns:

* `pipeline.config.resolve`: load a config file, apply command-line overrides, fill the schema's
  defaults and validate (`workflow/schemas/config.schema.yaml`, the single source of defaults), then
  the cross-field checks of `pipeline.config.checks`;
* `pipeline.config.layout`: `RunLayout`, the one owner of every path of a run;
* `pipeline.config.sources`: a source's shards, the shard groups of the per-shard rules, and the
  content hashes of local shards;
* `pipeline.config.rule_params`: what each rule depends on (its params slice: the `*_slice` functions, which
  each rule's spec in pipeline/rules.py names) and the `--params` / `--configfile` arguments of a rule
  module's CLI.

The public names are re-exported here: `from pipeline.config import load_config, mix_slice`.
Torch-free and snakemake-free (the Snakefile imports it at parse time).
"""
from pipeline.config.checks import STOCK_VOCAB, check_consistency, n_special_tokens
from pipeline.config.layout import RunLayout
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
    Keys,
    accounting_slice,
    add_config_args,
    cut,
    decontaminate_grams_slice,
    decontaminate_slice,
    dedup_signatures_slice,
    dedup_slice,
    download_slice,
    eval_data_slice,
    evaluate_slice,
    export_slice,
    filter_report_slice,
    filter_slice,
    mix_slice,
    pack_slice,
    params_from_args,
    params_json,
    plan_slice,
    split_slice,
    tokenize_slice,
    tokenizer_slice,
    train_slice,
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
    "RunLayout",
    "accounting_slice", "add_config_args", "check_consistency", "cut", "decontaminate_grams_slice",
    "decontaminate_slice", "dedup_signatures_slice", "dedup_slice", "deep_merge", "download_slice",
    "eval_data_slice", "evaluate_slice", "export_slice", "filter_report_slice", "filter_slice", "hf_filenames",
    "Keys", "load_config", "load_schema", "local_shard_hashes", "mix_slice", "n_special_tokens", "NOT_DOWNLOAD_KEYS",
    "pack_slice", "params_from_args", "params_json", "parse_overrides", "plan_slice", "PLAN_TRAIN_KEYS",
    "resolve_config", "RESOURCE_KEYS", "ROOT", "run_dir", "sample_shards", "SCHEMA_PATH", "shard_groups",
    "source_files", "SOURCE_HASH_CACHE", "source_shards", "split_slice", "STOCK_VOCAB", "tokenize_slice",
    "tokenizer_slice", "train_slice", "typed_overrides",
]
