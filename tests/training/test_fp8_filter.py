"""Issue 18 item 3: fp8 converts only the linears torchao's own H100 thresholds call faster in fp8, and
the planner's fp8 speed-up and memory follow the same function (`pipeline.planning.memory.fp8_converts`)."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pipeline.config import load_config
from pipeline.model.model import ModelConfig, Transformer
from pipeline.planning.memory import StepSetup, fp8_converts, memory
from pipeline.planning.step_time import step_time
from pipeline.run_config import run_config
from pipeline.training.parallelize import fp8_filter

PRESET = "configs/llama3-1b-fineweb.yaml"
DIMS = [16, 17, 512, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192]


def _torchao_filter():
    try:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
    except ImportError:  # torchao is a GPU extra; the thresholds are reproduced in pipeline.planning
        pytest.skip("torchao is not installed")
    return _auto_filter_for_recipe


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_same_decisions_as_torchaos_own_filter(recipe):
    auto = _torchao_filter()(recipe, filter_fqns=[])
    ours = fp8_filter(recipe)
    for n, k in itertools.product(DIMS, DIMS):
        lin = nn.Linear(k, n, bias=False, device="meta")
        assert ours(lin, "layers.0.x") == auto(lin, "layers.0.x") == fp8_converts(recipe, n, k), (recipe, n, k)


def test_preset_keeps_attention_and_down_in_bf16_under_rowwise(monkeypatch):
    cfg = load_config(PRESET)

    def linears(fp8: str) -> dict[str, bool]:
        return StepSetup.from_config(run_config({**cfg, "train": {**cfg["train"], "fp8": fp8}})).fp8_linears()

    rowwise = linears("rowwise")
    assert [k for k, v in rowwise.items() if v] == ["gate", "up"]  # q/k/v/o/down stay bf16 at 1.2B
    tensorwise = linears("tensorwise")
    assert [k for k, v in tensorwise.items() if not v] == ["k", "v"]  # N = 512 ≤ 1024 with K = 2048 ≤ 4096
    # the trainer's conversion selects the same modules (one block of the preset on the meta device)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_config({**cfg, "train": {**cfg["train"], "seq_len": 16}}))
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down"}
    for recipe, expected in (("rowwise", rowwise), ("tensorwise", tensorwise)):
        keep = fp8_filter(recipe)
        chosen = {names[n.split(".")[-1]]: keep(m, n) for n, m in model.layers[0].named_modules()
                  if isinstance(m, nn.Linear)}
        assert chosen == expected


def test_planner_speedup_follows_the_filter():
    """Before: any fp8 setting divided every linear's time by FP8_SPEEDUP. A model whose linears
    torchao leaves all in bf16 now predicts the bf16 step, and the preset only the converted share."""
    small = StepSetup(vocab=32768, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=2048, tied=True,
                      micro_batch=8, seq_len=2048)
    assert not any(small.replace(fp8="rowwise").fp8_linears().values())
    assert step_time(small.replace(fp8="rowwise"))["total"] == step_time(small)["total"]
    assert memory(small.replace(fp8="rowwise"))["activations"] == memory(small)["activations"]
    cfg = load_config(PRESET)
    s = StepSetup.from_config(run_config(cfg)).replace(micro_batch=16, checkpoint="none")
    bf16, fp8, every = (step_time(s.replace(**c))["body"] for c in (
        {}, {"fp8": "tensorwise"}, {"fp8": "tensorwise", "fp8_filter": "all"}))
    assert every < fp8 < bf16  # tensorwise speeds up what it converts: less than converting everything
    assert memory(s.replace(fp8="tensorwise", fp8_filter="all"))["activations"] < \
        memory(s.replace(fp8="tensorwise"))["activations"] < memory(s)["activations"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_apply_fp8_converts_exactly_the_filtered_linears(recipe):
    """torchao's real conversion (on the meta device: no GPU needed to build Float8Linear)."""
    _torchao_filter()
    from pipeline.training.parallelize import apply_fp8

    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=1024, dim=2048, n_layers=1, n_heads=32, n_kv_heads=8,
                                        ffn_dim=8192, max_seq_len=16))
    apply_fp8(model, recipe)
    converted = {n.split(".")[-1].removesuffix("_proj"): type(m).__name__ == "Float8Linear"
                 for n, m in model.layers[0].named_modules() if isinstance(m, nn.Linear)}
    setup = StepSetup(vocab=1024, dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=8192, tied=True,
                      micro_batch=1, seq_len=16, fp8=recipe)
    assert converted == setup.fp8_linears()
