"""Budget arithmetic shared by config validation, the planner and the trainer: parameters, FLOPs,
token targets, the batch layout and the peak FLOP/s table (definitions: the `pipeline.plan` docstring).

Pure functions of the resolved config, torch-free and import-light (the Snakefile imports them at
parse time through `pipeline.config` and `pipeline.plan`).
"""
from __future__ import annotations

import math

from pipeline.errors import PlanError


def world_size(cfg: dict) -> int:
    hw = cfg["hardware"]
    return hw["nproc_per_node"] * hw["nodes"]


# Dense peak FLOP/s per GPU (NVIDIA datasheets, SXM parts, no sparsity). "fp32" is true fp32 (CUDA
# cores: what an fp32 run gets, since it sets `highest` matmul precision); "tf32" is tensor-core fp32
# math with inputs rounded to 10 mantissa bits. "cpu" is a nominal 1 TFLOP/s, not a measurement.
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp8": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "cpu": {"bf16": 1e12, "fp8": 1e12, "tf32": 1e12, "fp32": 1e12},
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.04e12, "cpu": 20e9}  # datasheets; cpu nominal


def param_parts(model_cfg: dict) -> dict[str, int]:
    """Parameter counts of `pipeline.training.model.Transformer` by part: embedding, lm_head (0 when tied),
    blocks (all L blocks, norms included), final_norm."""
    V, d, L, f = model_cfg["vocab_size"], model_cfg["dim"], model_cfg["n_layers"], model_cfg["ffn_dim"]
    d_kv = model_cfg["n_kv_heads"] * (d // model_cfg["n_heads"])
    attention = 2 * d * d + 2 * d * d_kv
    block = attention + 3 * d * f + 2 * d
    return {
        "embedding": V * d,
        "lm_head": 0 if model_cfg["tie_embeddings"] else V * d,
        "blocks": L * block,
        "final_norm": d,
    }


def count_params(model_cfg: dict) -> tuple[int, int]:
    """(total, non-embedding) parameters of the model described by ``cfg["model"]``; non-embedding
    excludes the token embedding and an untied lm_head (see the module docstring)."""
    p = param_parts(model_cfg)
    return sum(p.values()), p["blocks"] + p["final_norm"]


def flops_per_token(cfg: dict) -> int:
    """Training FLOPs per token of a run config (``model`` and ``train.seq_len``):
    6·(N_non_embedding + V·d) + 12·L·d·T (module docstring). The one formula MFU is computed with."""
    m = cfg["model"]
    _, non_embedding = count_params(m)
    V, d, L = m["vocab_size"], m["dim"], m["n_layers"]
    return 6 * (non_embedding + V * d) + 12 * L * d * cfg["train"]["seq_len"]


def batch_layout(cfg: dict) -> dict[str, int]:
    """tokens_per_step, micro_batch, world_size, grad_accum_steps; refuses a non-integer accumulation."""
    t = cfg["train"]
    ws = world_size(cfg)
    per_micro = t["micro_batch"] * t["seq_len"] * ws
    if t["global_batch_tokens"] % per_micro:
        raise PlanError(
            f"train.global_batch_tokens = {t['global_batch_tokens']} is not a multiple of train.micro_batch × "
            f"train.seq_len × world_size = {t['micro_batch']} × {t['seq_len']} × {ws} = {per_micro}, so gradient "
            "accumulation would not be a whole number of micro-steps: "
            "change train.global_batch_tokens or train.micro_batch"
        )
    return {"tokens_per_step": t["global_batch_tokens"], "micro_batch": t["micro_batch"], "world_size": ws,
            "grad_accum_steps": t["global_batch_tokens"] // per_micro}


def token_target(train_cfg: dict, n_params: int, fpt: int) -> tuple[int, str]:
    """(target tokens, the config key that set it)."""
    if train_cfg.get("target_tokens") is not None:
        return int(train_cfg["target_tokens"]), "train.target_tokens"
    if train_cfg.get("target_flops") is not None:
        return math.ceil(train_cfg["target_flops"] / fpt), "train.target_flops"
    return math.ceil(train_cfg["tokens_per_param"] * n_params), "train.tokens_per_param"


def trained_tokens(cfg: dict) -> int:
    """num_steps × tokens_per_step: the training targets the run consumes, what a mix's ``tokens: plan``
    means. Depends on the budget, the model and the global batch only (not the micro-batch, world
    size or the measured counts), so the mix stage can take it as a parameter."""
    n_params, _ = count_params(cfg["model"])
    target, _ = token_target(cfg["train"], n_params, flops_per_token(cfg))
    step = cfg["train"]["global_batch_tokens"]
    return math.ceil(target / step) * step


def peak_flops(cfg: dict) -> float:
    """The peak MFU is measured against: bf16 for a bf16 body on CUDA, else true fp32 (an fp32 run
    sets `highest` matmul precision, so TF32's 7× higher peak would make its MFU look 7× too low)."""
    hw = cfg["hardware"]
    bf16 = cfg["train"]["precision"] == "bf16" and hw["device"] == "cuda"
    return PEAK_FLOPS[hw["gpu_type"]]["bf16" if bf16 else "fp32"]
