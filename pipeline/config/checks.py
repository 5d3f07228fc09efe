"""The cross-field checks of a resolved config: what the schema cannot express (a source's keys by its
type, names that must refer to a source or mix, the model's head arithmetic, the batch layout, the
training stages). Each failure is one `ConfigError` naming the key and the fix."""
from __future__ import annotations

from pipeline.config.sources import source_shards
from pipeline.errors import ConfigError
from pipeline.planning.compute import BatchLayout
from pipeline.planning.stages import ADAMW8BIT_FSDP, adamw8bit_keys, stage_list
from pipeline.run_config import run_config

# Token ids of the stock tiktoken encodings (their own special tokens included); tokenfarm's
# special tokens are appended after them (pipeline.data.train_tokenizer.build_tokenizer).
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

    dedup = cfg["dedup"]
    if dedup["bands"] * dedup["rows"] != dedup["num_perm"]:
        fail("dedup.num_perm",
             f"bands × rows must equal num_perm ({dedup['bands']} × {dedup['rows']} != {dedup['num_perm']})")

    if cfg["split"]["method"] == "shards":
        for s, names in cfg["split"]["val_shards"].items():
            if s not in sources:
                fail(f"split.val_shards.{s}", f"unknown source '{s}'")
            known = set(source_shards(cfg, s))
            for n in names:
                if n not in known:
                    fail(f"split.val_shards.{s}", f"unknown shard '{n}' of source '{s}'")
        held_out = {s for s, names in cfg["split"]["val_shards"].items() if names}
        for mname, mix in cfg["mixes"].items():  # a mix's val rows come from its sources' held-out shards
            if not held_out & set(mix["weights"]):
                first = next(iter(mix["weights"]))
                example = (source_shards(cfg, first) or ["<shard>"])[0]
                fail("split.val_shards", f"method shards holds out no shard of mix '{mname}' (sources: "
                     f"{', '.join(mix['weights'])}), so its validation set would be empty: list at least one, "
                     f"e.g. split.val_shards: {{{first}: [{example}]}}")

    for mname, mix in cfg["mixes"].items():
        for s in mix["weights"]:
            if s not in sources:
                fail(f"mixes.{mname}.weights.{s}", f"unknown source (sources: {', '.join(sources)})")
    if cfg["train"]["mix"] not in cfg["mixes"]:
        fail("train.mix", f"unknown mix '{cfg['train']['mix']}' (mixes: {', '.join(cfg['mixes'])})")

    model = cfg["model"]
    if model["dim"] % model["n_heads"]:
        fail("model.n_heads", f"dim {model['dim']} is not divisible by n_heads {model['n_heads']}")
    if (model["dim"] // model["n_heads"]) % 2:
        fail("model.n_heads", "head dim (dim / n_heads) must be even for RoPE")
    if model["n_heads"] % model["n_kv_heads"]:
        fail("model.n_kv_heads", f"n_heads {model['n_heads']} is not divisible by n_kv_heads {model['n_kv_heads']}")
    if tok["kind"] == "bpe" and model["vocab_size"] < tok["vocab_size"]:
        fail("model.vocab_size", f"{model['vocab_size']} is smaller than tokenizer.vocab_size {tok['vocab_size']}")
    if tok["kind"] == "tiktoken" and tok["encoding"] in STOCK_VOCAB:
        ids = STOCK_VOCAB[tok["encoding"]] + n_special_tokens(tok["delimiter"])
        if model["vocab_size"] < ids:
            fail("model.vocab_size", f"{model['vocab_size']} is smaller than the {ids} token ids of {tok['encoding']} "
                                     f"with tokenfarm's {n_special_tokens(tok['delimiter'])} special tokens appended")

    typed = run_config(cfg)  # what pipeline.planning's checks below read
    BatchLayout.from_config(typed)  # a global batch of whole micro-steps, or one error naming the hardware
    train = cfg["train"]
    if train["target_tokens"] is not None and train["target_flops"] is not None:
        fail("train.target_flops", "set at most one of train.target_tokens and train.target_flops")
    if cfg["hardware"]["device"] == "cpu" and (train["fp8"] != "none" or train["optimizer"] == "adamw8bit"):
        fail("train.fp8" if train["fp8"] != "none" else "train.optimizer",
             "fp8 and adamw8bit need hardware.device: cuda")
    if train["parallel"] == "fsdp" and adamw8bit_keys(typed):
        fail(adamw8bit_keys(typed)[0], f"{ADAMW8BIT_FSDP}; use adamw or muon, or train.parallel: ddp")
    if train["ce_matmul"] == "tf32" and (train["precision"] != "bf16" or cfg["hardware"]["device"] != "cuda"):
        fail("train.ce_matmul", "tf32 sets torch's float32 matmul precision for the whole step, so it needs "
                                "train.precision: bf16 on hardware.device: cuda; use fp32 or bf16")
    stage_list(typed)  # train.stages: one ConfigError per bad stage
