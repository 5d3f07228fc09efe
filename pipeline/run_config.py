"""`RunConfig`: the resolved config as frozen, typed dataclasses, built once from the validated YAML.

    cfg = run_config(load_config("config.yaml"))      # or of a rule's params slice
    cfg.train.seq_len, cfg.sources["web"].glob, cfg.train.stages[0].mix

The schema (workflow/schemas/config.schema.yaml) stays the contract and the one source of defaults; the
classes mirror it key for key (tests/test_run_config.py checks them against it, so they cannot drift). A
rule's params slice holds some keys only: reading one it lacks raises ConfigError naming the key. A stage's
view adds `stage` (the resolved stage, plain data); other keys the pipeline derives (a mix's `trained_tokens`,
the pack slice's `seq_len`) are kept in `extra`. `to_dict()` gives back exactly the mapping it was made from:
rule slices, params and code hashes compare plain data. Each object is also a read-only Mapping (`key in
cfg`, `cfg.get(key, default)`, iteration), for a key a slice may lack and for code that takes plain data too.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pipeline.errors import ConfigError


class _Absent:
    """A key the mapping did not hold (a rule's slice): reading it is refused."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()
_NESTED = re.compile(r"(?:(list)\[|(dict)\[str, )?(\w+Config)\]?")


class _Section(Mapping):
    """The behaviour every config class shares: built from a mapping, read by attribute or key."""

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if value is ABSENT:
            where = object.__getattribute__(self, "_where")
            raise ConfigError(f"config key '{where}{name}' is not in these params (a rule reads only its slice: "
                              "add the key to the rule's slice in pipeline/config/rule_params.py)")
        return value

    @classmethod
    def _kinds(cls) -> dict[str, tuple[str, type] | None]:
        """Per field: ("one" | "list" | "map", its config class) for a nested section, else None."""
        cached = cls.__dict__.get("_kinds_cache")
        if cached is None:
            classes = {c.__name__: c for c in _Section.__subclasses__()}
            cached = {}
            for f in fields(cls):
                m = _NESTED.fullmatch(str(f.type).split(" | ")[0])
                cached[f.name] = ((m.group(1) or m.group(2) or "one"), classes[m.group(3)]) if m else None
            cls._kinds_cache = cached
        return cached

    @classmethod
    def from_dict(cls, data: Mapping, where: str = ""):
        if isinstance(data, cls):
            return data
        kinds = cls._kinds()
        values, extra = {}, {}
        for key, value in data.items():
            if key not in kinds:
                extra[key] = value
                continue
            kind = kinds[key]
            if kind is not None and value is not None:
                how, sub = kind
                if how == "one":
                    value = sub.from_dict(value, f"{where}{key}.")
                elif how == "list":
                    value = [sub.from_dict(v, f"{where}{key}[{i}].") for i, v in enumerate(value)]
                else:
                    value = {k: sub.from_dict(v, f"{where}{key}.{k}.") for k, v in value.items()}
            values[key] = value
        obj = cls(**values)
        object.__setattr__(obj, "_where", where)
        object.__setattr__(obj, "_order", tuple(data))
        object.__setattr__(obj, "extra", extra)
        return obj

    def to_dict(self) -> dict:
        """The mapping this was made from, key for key and in its order."""
        return {k: plain(self[k]) for k in object.__getattribute__(self, "_order")}

    def __getitem__(self, key: str):
        """As the mapping it was made from: a key it did not hold is a KeyError (an attribute would read an
        optional key's None)."""
        if key in object.__getattribute__(self, "extra"):
            return object.__getattribute__(self, "extra")[key]
        if key not in object.__getattribute__(self, "_order"):
            raise KeyError(key)
        return object.__getattribute__(self, key)

    def __iter__(self):
        return iter(object.__getattribute__(self, "_order"))

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "_order"))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and self.to_dict() == (other.to_dict() if isinstance(other, _Section)
                                                                  else dict(other))

    __hash__ = None  # a config is compared by value, never hashed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"


def plain(value):
    """`value` with every config object in it as the plain mapping it was made from (what JSON and YAML take)."""
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, eq=False, repr=False)
class SourceConfig(_Section):
    type: str | None = None  # optional: no default
    format: str = ABSENT
    text_column: str = ABSENT
    messages_column: str = ABSENT
    glob: str | None = None  # optional: no default
    repo: str | None = None  # optional: no default
    repo_type: str = ABSENT
    revision: str = ABSENT
    pattern: str | None = None  # optional: no default
    shards: list[int] | None = None  # optional: no default
    sha256: dict[str, str] = ABSENT
    tokens_per_shard_estimate: int | None = None  # optional: no default
    min_chars: int = ABSENT
    max_conversation_tokens: int | None = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class DownloadConfig(_Section):
    retries: int = ABSENT
    backoff_seconds: float = ABSENT
    timeout_seconds: float = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class TokenizerConfig(_Section):
    kind: str = ABSENT
    vocab_size: int = ABSENT
    train_sources: list[str] | None = None  # optional: no default
    train_chars: int = ABSENT
    max_doc_chars: int = ABSENT
    encoding: str = ABSENT
    cache_dir: str | None = ABSENT
    delimiter: str = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class CountConfig(_Section):
    batch_size: int = ABSENT
    sample_shards: int = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class DedupConfig(_Section):
    enabled: bool = ABSENT
    exact: bool = ABSENT
    near: bool = ABSENT
    ngram: int = ABSENT
    num_perm: int = ABSENT
    bands: int = ABSENT
    rows: int = ABSENT
    threshold: float = ABSENT
    partitions: int = ABSENT
    seed: int = ABSENT
    reference: list[str] = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class SplitConfig(_Section):
    method: str = ABSENT
    val_tokens: int = ABSENT
    val_shards: dict[str, list[str]] = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class MixConfig(_Section):
    weights: dict[str, float] | None = None  # optional: no default
    tokens: int | str = ABSENT
    max_epochs: float = ABSENT
    packing: str = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class ModelConfig(_Section):
    vocab_size: int = ABSENT
    dim: int = ABSENT
    n_layers: int = ABSENT
    n_heads: int = ABSENT
    n_kv_heads: int = ABSENT
    ffn_dim: int = ABSENT
    rope_theta: float = ABSENT
    norm_eps: float = ABSENT
    tie_embeddings: bool = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class TrainConfig(_Section):
    mix: str = ABSENT
    seq_len: int = ABSENT
    global_batch_tokens: int = ABSENT
    micro_batch: int = ABSENT
    tokens_per_param: float | str = ABSENT
    target_tokens: int | None = ABSENT
    target_flops: float | None = ABSENT
    precision: str = ABSENT
    compile: str | bool = ABSENT
    parallel: str = ABSENT
    optimizer: str = ABSENT
    lr: float = ABSENT
    embed_lr: float | None = ABSENT
    lm_head_lr: float | None = ABSENT
    weight_decay: float = ABSENT
    betas: list[float] = ABSENT
    grad_clip: float = ABSENT
    schedule: str = ABSENT
    warmup_steps: int = ABSENT
    min_lr_ratio: float = ABSENT
    decay_frac: float = ABSENT
    activation_checkpointing: str = ABSENT
    checkpoint_every_n: int = ABSENT
    fp8: str = ABSENT
    ce_chunk_tokens: int = ABSENT
    ce_matmul: str = ABSENT
    ckpt_interval: int | str = ABSENT
    async_ckpt: bool = ABSENT
    val_interval: int = ABSENT
    val_batches: int = ABSENT
    log_interval: int = ABSENT
    resume: str = ABSENT
    stages: list[StageConfig] = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class StageConfig(_Section):
    name: str | None = None  # optional: no default
    mix: str | None = None  # optional: no default
    tokens: int | None = None  # optional: no default
    steps: int | None = None  # optional: no default
    epochs: float | None = None  # optional: no default
    loss: str = ABSENT
    init_from: str | None = None  # optional: no default
    carry_optimizer: bool = ABSENT
    doc_mask: bool | None = ABSENT
    optimizer: str | None = None  # optional: no default
    lr: float | None = None  # optional: no default
    embed_lr: float | None = None  # optional: no default
    lm_head_lr: float | None = None  # optional: no default
    weight_decay: float | None = None  # optional: no default
    betas: list[float] | None = None  # optional: no default
    grad_clip: float | None = None  # optional: no default
    schedule: str | None = None  # optional: no default
    warmup_steps: int | None = None  # optional: no default
    min_lr_ratio: float | None = None  # optional: no default
    decay_frac: float | None = None  # optional: no default


@dataclass(frozen=True, eq=False, repr=False)
class HardwareConfig(_Section):
    device: str = ABSENT
    gpu_type: str = ABSENT
    gpu_memory_gb: float = ABSENT
    nproc_per_node: int = ABSENT
    process_group_timeout_min: float = ABSENT
    nodes: int = ABSENT
    cpus_per_task: int = ABSENT
    nccl_env: str | dict[str, str | int] = ABSENT
    max_job_hours: float | None = ABSENT
    gpu_mtbf_hours: float = ABSENT
    storage_gb_per_s: float = ABSENT
    train_retries: int = ABSENT
    hang_timeout_min: float | None = ABSENT
    assumed_mfu: float | None = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class WandbConfig(_Section):
    mode: str = ABSENT
    project: str = ABSENT
    entity: str | None = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class EvalConfig(_Section):
    prompts: list[str] = ABSENT
    max_new_tokens: int = ABSENT
    temperature: float = ABSENT
    tasks: list[str] = ABSENT
    core_shots: int | None = ABSENT
    core_max_items: int | None = ABSENT
    core_pool_size: int = ABSENT
    core_batch_tokens: int | None = ABSENT
    core_interval: int = ABSENT
    core_interval_items: int = ABSENT
    chat_tasks: list[str] = ABSENT
    chat_max_items: int | None = ABSENT
    chat_max_new_tokens: int = ABSENT
    chat_questions: list[str] = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class ScalingConfig(_Section):
    budgets: list[float] = ABSENT
    depths: list[int] = ABSENT
    aspect: float | None = ABSENT
    head_dim: int | None = ABSENT
    kv_group: int | None = ABSENT
    ffn_ratio: float | None = ABSENT
    global_batch_tokens: int | None = ABSENT
    warmup_frac: float | None = ABSENT
    bootstrap: int = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class FilterStepConfig(_Section):
    name: str | None = None  # optional: no default
    enabled: bool | None = None  # optional: no default
    settings: dict | None = None  # optional: no default


@dataclass(frozen=True, eq=False, repr=False)
class DecontaminateConfig(_Section):
    enabled: bool = ABSENT
    ngram: int = ABSENT
    min_words: int = ABSENT


@dataclass(frozen=True, eq=False, repr=False)
class RunConfig(_Section):
    run_name: str = ABSENT
    data_dir: str = ABSENT
    results_dir: str = ABSENT
    seed: int = ABSENT
    shards_per_job: int = ABSENT
    sources: dict[str, SourceConfig] = ABSENT
    download: DownloadConfig = ABSENT
    tokenizer: TokenizerConfig = ABSENT
    count: CountConfig = ABSENT
    dedup: DedupConfig = ABSENT
    split: SplitConfig = ABSENT
    mixes: dict[str, MixConfig] = ABSENT
    model: ModelConfig = ABSENT
    train: TrainConfig = ABSENT
    hardware: HardwareConfig = ABSENT
    wandb: WandbConfig = ABSENT
    eval: EvalConfig = ABSENT
    scaling: ScalingConfig = ABSENT
    filter: list[FilterStepConfig] = ABSENT
    decontaminate: DecontaminateConfig = ABSENT
    # derived, not in the schema: a training stage's view (`pipeline.planning.stages.stage_config`) adds it
    stage: dict | None = None


def with_section(cfg: RunConfig, section: str, **values) -> RunConfig:
    """A new RunConfig of `cfg` with keys of one section replaced (what a resolution step returns, e.g.
    train.parallel auto -> ddp); `plain` of it is the mapping Snakemake's config and the rule slices hold."""
    data = cfg.to_dict()
    return run_config({**data, section: {**data[section], **values}})


def run_config(cfg: Mapping) -> RunConfig:
    """`cfg` as a RunConfig (itself when it is one): the entry of code that reads attributes."""
    return RunConfig.from_dict(cfg)
