"""pipeline.training.optim: parameter groups, optimizers, learning-rate schedules."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.model.model import ModelConfig, Transformer
from pipeline.training.optim import CombinedOptimizer, build_optimizer, lr_factor, param_groups, set_lr

TRAIN = {"lr": 1e-2, "embed_lr": 3e-2, "lm_head_lr": 2e-3, "weight_decay": 0.1, "betas": [0.9, 0.95],
         "optimizer": "adamw", "schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "decay_frac": 0.2}


def tiny(tied: bool) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                   tie_embeddings=tied, max_seq_len=8))


def names_by_group(model, groups) -> dict[str, set[str]]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {ids[id(p)] for p in g["params"]} for g in groups}


def test_untied_groups_lrs_and_weight_decay():
    model = tiny(tied=False)
    groups = param_groups(model, TRAIN)
    by = names_by_group(model, groups)
    assert by["embedding"] == {"tok_embeddings.weight"}
    assert by["lm_head"] == {"lm_head.weight"}
    assert all(n.endswith(("attention_norm.weight", "ffn_norm.weight")) or n == "norm.weight" for n in by["no_decay"])
    assert len(by["no_decay"]) == 2 * 2 + 1
    assert all("_proj" in n for n in by["matrix"]) and len(by["matrix"]) == 2 * 7
    everything = set().union(*by.values())
    assert everything == {n for n, _ in model.named_parameters()}
    assert sum(len(v) for v in by.values()) == len(everything)  # each parameter in exactly one group
    cfg = {g["name"]: (g["lr"], g["base_lr"], g["weight_decay"]) for g in groups}
    assert cfg == {"embedding": (3e-2, 3e-2, 0.0), "lm_head": (2e-3, 2e-3, 0.1),
                   "matrix": (1e-2, 1e-2, 0.1), "no_decay": (1e-2, 1e-2, 0.0)}


def test_tied_model_has_one_embedding_param_and_default_lrs(caplog):
    model = tiny(tied=True)
    groups = param_groups(model, {**TRAIN, "embed_lr": None, "lm_head_lr": 5e-3})
    by = names_by_group(model, groups)
    assert "lm_head" not in by and by["embedding"] == {"tok_embeddings.weight"}
    assert model.lm_head_weight is model.tok_embeddings.weight
    assert {g["name"]: g["lr"] for g in groups}["embedding"] == TRAIN["lr"]  # embed_lr unset -> lr
    assert "lm_head_lr is ignored" in caplog.text


def test_weight_decay_only_touches_decayed_groups():
    """With zero gradients an AdamW step is pure decoupled weight decay: matrices shrink by lr·wd,
    embeddings and norms stay put."""
    model = tiny(tied=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TRAIN, "cpu")
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in ("tok_embeddings.weight", "norm.weight") or n.endswith("norm.weight"):
            assert torch.equal(p, before[n]), n
        else:
            lr = TRAIN["lm_head_lr"] if n == "lm_head.weight" else TRAIN["lr"]
            assert torch.allclose(p, before[n] * (1 - lr * TRAIN["weight_decay"])), n


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = tiny(tied=False)
    opt = build_optimizer(model, {**TRAIN, "optimizer": "muon"}, "cpu")
    assert isinstance(opt, CombinedOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [g["name"] for g in muon.param_groups] == ["matrix"]
    assert [g["name"] for g in opt.param_groups] == ["matrix", "embedding", "lm_head", "no_decay"]
    x = torch.randint(0, 64, (2, 8))
    model(x).logsumexp(-1).mean().backward()
    before = model.layers[0].attention.q_proj.weight.detach().clone()
    opt.step()
    opt.zero_grad()
    assert not torch.equal(model.layers[0].attention.q_proj.weight, before)
    state = opt.state_dict()
    fresh = build_optimizer(tiny(tied=False), {**TRAIN, "optimizer": "muon"}, "cpu")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.optimizers[0].state_dict()["state"][0]["momentum_buffer"],
                       muon.state_dict()["state"][0]["momentum_buffer"])


def test_muon_on_cpu_is_torchs_step_with_newton_schulz_in_fp32(monkeypatch):
    """On the CPU our Muon takes torch's step bit for bit, its Newton-Schulz iteration run in fp32 instead of
    bf16 (a tall, a wide and a square matrix, nesterov on and off, three steps); off the CPU `newton_schulz`
    is torch's bf16 iteration itself."""
    import torch.optim._muon as M

    from pipeline.training.optim import Muon, newton_schulz

    def ns_fp32(grad, coefficients, steps, eps):  # torch's iteration, written out in fp32
        a, b, c = coefficients
        x = grad.float()
        x = x.T if grad.size(0) > grad.size(1) else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    g = torch.Generator().manual_seed(0)
    shapes = [(24, 8), (8, 24), (12, 12)]
    for nesterov in (True, False):
        ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        torchs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        bf16 = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        settings = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
        opts = Muon(ours, **settings), torch.optim.Muon(torchs, **settings), torch.optim.Muon(bf16, **settings)
        for _ in range(3):
            for p, q, r in zip(ours, torchs, bf16):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad, r.grad = p.grad.clone(), p.grad.clone()
            opts[0].step()
            opts[2].step()
            with monkeypatch.context() as m:
                m.setattr(M, "_zeropower_via_newtonschulz", ns_fp32)
                opts[1].step()
        assert all(torch.equal(p, q) for p, q in zip(ours, torchs))
        assert not any(torch.equal(p, r) for p, r in zip(ours, bf16))  # fp32 is what differs from torch's
    x, group = torch.randn(24, 8, generator=g), opts[0].param_groups[0]
    assert newton_schulz(x, group).dtype == torch.float32
    want = M._zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
    assert want.dtype == torch.bfloat16 and torch.equal(newton_schulz(x, group, on="cuda"), want)


def test_adamw8bit_needs_cuda():
    with pytest.raises(PipelineError, match="adamw8bit needs hardware.device: cuda"):
        build_optimizer(tiny(tied=True), {**TRAIN, "optimizer": "adamw8bit"}, "cpu")


def test_cosine_schedule_values():
    t = TRAIN  # warmup 10, min ratio 0.1
    n = 110
    assert lr_factor(0, n, t) == pytest.approx(0.1)
    assert lr_factor(4, n, t) == pytest.approx(0.5)
    assert lr_factor(9, n, t) == pytest.approx(1.0)
    assert lr_factor(10, n, t) == pytest.approx(1.0)
    # p = (s - 10) / 99: halfway (s = 59.5) is (1 + 0.1) / 2; the last step (109) is the floor
    assert (lr_factor(59, n, t) + lr_factor(60, n, t)) / 2 == pytest.approx(0.55, abs=1e-3)
    assert lr_factor(109, n, t) == pytest.approx(0.1)
    assert lr_factor(43, n, t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)))
    values = [lr_factor(s, n, t) for s in range(10, n)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_wsd_schedule_values():
    t = {**TRAIN, "schedule": "wsd", "warmup_steps": 5, "decay_frac": 0.2, "min_lr_ratio": 0.0}
    n = 100  # decay over the last 20 steps: 80..99
    assert lr_factor(2, n, t) == pytest.approx(0.6)
    assert lr_factor(5, n, t) == lr_factor(79, n, t) == 1.0
    assert lr_factor(80, n, t) == pytest.approx(1 - 1 / 20)
    assert lr_factor(89, n, t) == pytest.approx(0.5)
    assert lr_factor(99, n, t) == pytest.approx(0.0)


def test_set_lr_scales_every_group_from_its_base():
    model = tiny(tied=False)
    opt = build_optimizer(model, TRAIN, "cpu")
    set_lr(opt, 0.5)
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {
        "embedding": 1.5e-2, "lm_head": 1e-3, "matrix": 5e-3, "no_decay": 5e-3}
