"""Config resolution: schema defaults, one clear error naming the key, cross-field checks, presets."""
import pytest
import yaml

from pipeline.config import load_config, resolve_config
from pipeline.errors import ConfigError
from pipeline.rules import rule_params


def _cfg(**over):
    base = {"sources": {"web": {"type": "local", "glob": "x/*.parquet"}}}
    base.update(over)
    return base


def test_defaults_filled_from_schema():
    cfg = resolve_config(_cfg())
    assert cfg["tokenizer"]["kind"] == "bpe"
    assert cfg["sources"]["web"]["text_column"] == "text"
    assert cfg["mixes"]["pretrain"]["max_epochs"] == 1.0
    assert cfg["train"]["ce_chunk_tokens"] == 8192


@pytest.mark.parametrize(
    "over, key, hint",
    [
        ({"model": {"vocab_szie": 10}}, "model.vocab_szie", "vocab_size"),
        ({"trian": {}}, "trian", "train"),
        ({"train": {"micro_batch": "8"}}, "train.micro_batch", "integer"),
        ({"tokenizer": {"delimiter": "eot"}}, "tokenizer.delimiter", "bos"),
        ({"train": {"micro_batch": 7}}, "train.global_batch_tokens", "micro_batch × seq_len × world_size"),
        ({"model": {"n_heads": 5}}, "model.n_heads", "divisible"),
        ({"dedup": {"bands": 7}}, "dedup.num_perm", "bands × rows"),
        ({"mixes": {"m": {"weights": {"nope": 1.0}}}, "train": {"mix": "m"}}, "mixes.m.weights.nope", "unknown source"),
        ({"train": {"mix": "nope"}}, "train.mix", "unknown mix"),
        ({"mixes": {"pretrain": {"weights": {"web": 1}, "tokens": -5}}}, "mixes.pretrain.tokens",
         "expected an integer >= 1 or 'plan'"),
        ({"sources": {"fw": {"type": "hf", "repo": "a/b", "pattern": "s.parquet", "shards": [0, 3]}},
          "mixes": {"pretrain": {"weights": {"fw": 1}}}}, "sources.fw.pattern", "format field"),
        ({"sources": {"fw": {"type": "hf", "repo": "a/b"}}}, "sources.fw.pattern", "required"),
        ({"tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"}, "model": {"vocab_size": 100_000}},
         "model.vocab_size", "100282 token ids of cl100k_base"),
        ({"train": {"ce_matmul": "tf32", "precision": "fp32"}}, "train.ce_matmul", "needs train.precision: bf16"),
        ({"train": {"ce_matmul": "fp16"}}, "train.ce_matmul", "bf16"),
        ({"train": {"micro_batch": 16.0}}, "train.micro_batch", "must be an integer, got 16.0 (write 16)"),
        ({"train": {"seq_len": 256.0}}, "train.seq_len", "must be an integer, got 256.0"),
        ({"train": {"target_tokens": 1.5e5}}, "train.target_tokens", "must be an integer or null, got 150000.0"),
        ({"scaling": {"depths": [4, 6, 4]}}, "scaling.depths", "lists 4 more than once"),
        ({"scaling": {"budgets": [1e18, 3e18, 1.0e18]}}, "scaling.budgets", "lists 1e+18 more than once"),
        ({"hardware": {"nccl_env": "sockets"}}, "hardware.nccl_env", "'default' or 'socket' or 'socket-lo' or"),

        ({"train": {"parallel": "fsdp", "optimizer": "adamw8bit"}, "hardware": {"device": "cuda"}},
         "train.optimizer", "adamw8bit cannot step train.parallel: fsdp's sharded parameters"),
        ({"train": {"parallel": "fsdp", "stages": [{"name": "a"}, {"name": "b", "optimizer": "adamw8bit"}]},
          "hardware": {"device": "cuda"}}, "train.stages[1].optimizer", "use adamw or muon, or train.parallel: ddp"),
    ],
)
def test_bad_config_names_the_key(over, key, hint):
    with pytest.raises(ConfigError) as e:
        resolve_config(_cfg(**over))
    msg = str(e.value)
    assert f"'{key}'" in msg and hint in msg
    assert "\n" not in msg  # one message, one line


def test_world_size_enters_divisibility():
    ok = _cfg(train={"global_batch_tokens": 2 * 16 * 256, "micro_batch": 16}, hardware={"nproc_per_node": 2})
    resolve_config(ok)
    with pytest.raises(ConfigError, match="world_size"):
        resolve_config(_cfg(train={"global_batch_tokens": 16 * 256, "micro_batch": 16}, hardware={"nproc_per_node": 2}))


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


@pytest.mark.parametrize("preset", ["config.yaml", "configs/llama3-1b-fineweb.yaml", "configs/gpt-500m-fineweb.yaml",
                                    "configs/llama3-8b-fineweb.yaml"])
def test_shipped_configs_validate(root, preset, monkeypatch):
    monkeypatch.chdir(root)
    cfg = load_config(root / preset)
    raw = yaml.safe_load((root / preset).read_text())
    assert set(raw) <= set(cfg)


def test_stage_params_are_slices():
    cfg = resolve_config(_cfg())
    assert rule_params(cfg, "dedup") == {"dedup": cfg["dedup"], "seed": cfg["seed"]}
    assert "download" not in rule_params(cfg, "train")
    # Changing the tokenizer must not change what download depends on.
    other = resolve_config(_cfg(tokenizer={"vocab_size": 8192}, model={"vocab_size": 8192}))
    assert rule_params(cfg, "download") == rule_params(other, "download")
    assert rule_params(cfg, "tokenizer") != rule_params(other, "tokenizer")


def test_plan_params_ignore_optimizer_hyperparameters():
    """An lr edit must rerun train and evaluate only, not the plan and the data stages after it."""
    cfg = resolve_config(_cfg())
    other = resolve_config(_cfg(train={"lr": 1e-2, "warmup_steps": 5}))
    assert rule_params(cfg, "plan") == rule_params(other, "plan")
    assert rule_params(cfg, "train") != rule_params(other, "train")


# ----------------------------------------------------------------------------- command-line overrides

def test_overrides_are_typed_by_the_schema():
    """What `snakemake --config train='{...}'` hands the Snakefile: every nested scalar a string (Snakemake
    reads the YAML with BaseLoader). Retyped, the config validates with the intended values."""
    from pipeline.config import typed_overrides

    raw = {
        "train": {"target_tokens": "300000", "lr": "1e-2", "grad_clip": "0.5", "betas": ["0.9", "0.99"],
                  "compile": "false", "target_flops": "null"},
        "mixes": {"pretrain": {"weights": {"web": "0.5"}, "tokens": "plan"},
                  "m2": {"weights": {"web": "1"}, "tokens": "8000"}},
        "run_name": "007",
        "seed": 3,  # top-level values arrive typed already
    }
    with pytest.raises(ConfigError, match="expected"):  # the bug: strings where numbers belong
        resolve_config(_cfg(**raw))
    typed = typed_overrides(raw)
    assert typed["train"] == {"target_tokens": 300000, "lr": 0.01, "grad_clip": 0.5, "betas": [0.9, 0.99],
                              "compile": False, "target_flops": None}
    assert typed["mixes"] == {"pretrain": {"weights": {"web": 0.5}, "tokens": "plan"},
                              "m2": {"weights": {"web": 1}, "tokens": 8000}}
    assert typed["run_name"] == "007" and typed["seed"] == 3
    cfg = resolve_config(_cfg(**typed))
    assert cfg["train"]["target_tokens"] == 300000 and cfg["train"]["betas"] == [0.9, 0.99]


def test_an_override_that_fits_no_type_still_names_its_key():
    from pipeline.config import typed_overrides

    with pytest.raises(ConfigError, match=r"train.micro_batch' has value 'eight'; expected integer"):
        resolve_config(_cfg(**typed_overrides({"train": {"micro_batch": "eight"}})))


def test_dotted_overrides(tmp_path):
    """`--set` on the stage CLIs and the planner: dotted keys, YAML values, the same typing."""
    from pipeline.config import parse_overrides

    over = parse_overrides(["train.target_tokens=300000", "train.betas=[0.9, 0.99]", "mixes.pretrain.weights={web: 2}",
                            "train.lr=3e-4", "run_name=007"])
    assert over == {"train": {"target_tokens": 300000, "betas": [0.9, 0.99], "lr": 3e-4},
                    "mixes": {"pretrain": {"weights": {"web": 2}}}, "run_name": "007"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg()))
    assert load_config(path, over)["train"]["target_tokens"] == 300000
    for bad in ("train.lr", "train..lr=1", "train=1"):
        with pytest.raises(ConfigError):
            parse_overrides([bad, "train.lr=1"] if bad == "train=1" else [bad])


def test_split_by_shards_must_hold_out_a_shard_of_every_mix():
    """split.method: shards with no held-out shard of a mix's sources: that mix's validation set would be
    empty (the pack stage would fail after the data half); refused at parse, naming the key."""
    with pytest.raises(ConfigError, match=r"split\.val_shards.*holds out no shard of mix 'pretrain'"):
        resolve_config({"split": {"method": "shards"}})
