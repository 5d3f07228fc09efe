"""Training stages in the config: resolution, budgets, init_from chains and one clear error per bad stage."""
from __future__ import annotations

import pytest

from pipeline.config import resolve_config
from pipeline.errors import ConfigError
from pipeline.planning.stages import epoch_steps, mix_targets, stage_budget, stage_config, stage_list
from pipeline.run_config import run_config

SOURCES = {"web": {"type": "local", "glob": "data/sample/web/*.parquet"},
           "chat": {"type": "local", "glob": "data/sample/chat/*.parquet", "format": "chat"}}
MIXES = {"pretrain": {"weights": {"web": 1.0}}, "mid": {"weights": {"web": 0.3, "chat": 0.7}, "tokens": 50000,
                                                       "packing": "bestfit"},
         "sft": {"weights": {"chat": 1.0}, "tokens": 20000, "packing": "bestfit"}}
STAGES = [{"name": "pretrain"}, {"name": "mid", "mix": "mid", "tokens": 20000, "lr": 1e-3, "schedule": "decay"},
          {"name": "sft", "mix": "sft", "epochs": 2, "loss": "assistant", "warmup_steps": 0}]


def cfg(stages=STAGES, mixes=MIXES, **train):
    return resolve_config({"sources": SOURCES, "mixes": mixes,
                           "train": {"target_tokens": 100_000, "global_batch_tokens": 8192, "micro_batch": 16,
                                     "seq_len": 256, "stages": stages, **train}})


def test_stages_resolve_in_order_with_overrides_and_init_chain():
    c = run_config(cfg())
    pre, mid, sft = stage_list(c)
    assert [s["name"] for s in (pre, mid, sft)] == ["pretrain", "mid", "sft"]
    assert (pre["init_from"], mid["init_from"], sft["init_from"]) == (None, "pretrain", "mid")
    assert pre["train"]["mix"] == "pretrain" and mid["train"]["lr"] == 1e-3 and mid["train"]["schedule"] == "decay"
    assert pre["train"]["lr"] == c["train"]["lr"] and "stages" not in pre["train"]
    assert (pre["doc_mask"], mid["doc_mask"], sft["doc_mask"]) == (False, True, True)  # on for bestfit
    assert (pre["loss"], sft["loss"]) == ("all", "assistant")
    sc = stage_config(c, "sft")
    assert sc["train"]["warmup_steps"] == 0 and sc["stage"]["name"] == "sft" and "train" not in sc["stage"]


def test_a_stage_sees_only_the_sources_its_mix_reads():
    """A chat-only source edit is no part of the pretraining's identity (params, resume check)."""
    from pipeline.rules import rule_params

    edited = {**SOURCES, "chat": {**SOURCES["chat"], "min_chars": 1, "glob": "elsewhere/*.parquet"}}
    before, after = cfg(), resolve_config({**cfg(), "sources": edited})
    typed = run_config(before)
    assert set(stage_config(typed, "pretrain")["sources"]) == {"web"}
    assert set(stage_config(typed, "mid")["sources"]) == {"web", "chat"}
    assert set(stage_config(typed, "sft")["sources"]) == {"web", "chat"}  # the tokenizer's source too
    assert rule_params(stage_config(typed, "sft"), "tokenizer") == rule_params(before, "tokenizer")
    for stage in ("train", "evaluate"):
        was, now = run_config(rule_params(before, stage)), run_config(rule_params(after, stage))
        assert stage_config(was, "pretrain") == stage_config(now, "pretrain")
        assert stage_config(was, "sft") != stage_config(now, "sft")


def test_budgets_tokens_steps_run_and_epochs():
    c = run_config(cfg())
    pre, mid, sft = stage_list(c)
    assert stage_budget(c, pre) == {"num_steps": 13, "trained_tokens": 13 * 8192, "basis": "train.target_tokens"}
    assert stage_budget(c, mid) == {"num_steps": 3, "trained_tokens": 3 * 8192, "basis": "train.stages[1].tokens"}
    assert stage_budget(c, sft)["num_steps"] is None
    assert mix_targets(c, "pretrain") == 13 * 8192 and mix_targets(c, "mid") == 3 * 8192
    assert epoch_steps(2, 10, 4) == (5, 20) and epoch_steps(1.5, 7, 4) == (3, 11) and epoch_steps(1, 8, 4) == (2, 8)


def test_no_stages_is_one_stage_named_after_the_mix():
    (only,) = stage_list(run_config(cfg(stages=[])))
    assert only["name"] == "pretrain" and only["init_from"] is None and only["budget"]["kind"] == "run"


@pytest.mark.parametrize("stages, match", [
    ([{"name": "a"}, {"name": "a"}], "listed twice"),
    ([{"name": "a", "mix": "nope"}], "unknown mix 'nope'"),
    ([{"name": "a", "tokens": 5, "steps": 3}], "at most one of tokens, steps, epochs"),
    ([{"name": "a", "init_from": "previous"}], "has no previous stage"),
    ([{"name": "a"}, {"name": "b", "init_from": "c"}], "'c' is not a stage listed before 'b'"),
    ([{"name": "a"}, {"name": "b", "mix": "mid", "loss": "assistant"}], "includes text source\\(s\\) web"),
    ([{"name": "a", "mix": "pretrain", "epochs": 1}], "mixes.pretrain.tokens"),
    ([{"name": "a", "carry_optimizer": True}], "carry_optimizer needs init_from"),
])
def test_bad_stages_are_one_clear_config_error(stages, match):
    with pytest.raises(ConfigError, match=match):
        stage_list(run_config(cfg(stages=stages)))


def test_assistant_loss_over_a_concat_mix_is_refused():
    mixes = {**MIXES, "sft": {"weights": {"chat": 1.0}, "tokens": 20000}}
    with pytest.raises(ConfigError, match="packing: concat, which keeps no loss mask"):
        stage_list(run_config(cfg(mixes=mixes)))


def test_unknown_stage_key_is_refused_by_the_schema():
    with pytest.raises(ConfigError, match="train.stages.0.epoch' is not a known key .*did you mean 'epochs'"):
        cfg(stages=[{"name": "a", "epoch": 1}])
