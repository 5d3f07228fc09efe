"""Predicted seconds of a training step by component: `step_time(setup)`, `step_seconds(cfg)`, MFU
(the formulas: docs/performance-model.md)."""
from __future__ import annotations

import math

from pipeline.planning.compute import (
    GPU_TYPE_ALIASES,
    HBM_BYTES_PER_S,
    PEAK_FLOPS,
    flops_of,
    flops_per_token,
    peak_flops,
)
from pipeline.planning.fitted import (
    CE_BYTES_PER_LOGIT,
    COLLECTIVE_EFFICIENCY,
    DDP_EFFICIENCY,
    EAGER_FACTOR,
    ETA,
    FP8_SPEEDUP,
    FSDP_BLOCK_GATHERS,
    FSDP_OVERLAP,
    FSDP_REDUCE_BYTES,
    FSDP_ROOT_BYTES,
    FSDP_ROOT_GATHERS,
    IB_BYTES_PER_S_PER_GPU,
    INTRA_NODE_BYTES_PER_S,
    MUON_NS_STEPS,
    OPTIMIZER_BYTES,
)
from pipeline.planning.memory import StepSetup
from pipeline.run_config import RunConfig


def body_flops(s: StepSetup) -> dict[str, float]:
    """Per-token FLOPs the GPU executes in the body: ``train`` (forward + backward, fp8-able linears
    apart) and ``recompute`` (checkpointed regions' second forward)."""
    T, d, L = s.seq_len, s.dim, s.n_layers
    attn_fwd = (4 if s.math_attention else 2) * T * d  # QKᵀ and AV per layer; causal flash does half
    attention = 2 * s.attention_matrix_params  # per layer
    mlp = 2 * s.mlp_matrix_params
    linear = 3 * L * (attention + mlp)
    sdpa = 3 * L * attn_fwd
    rebuilt = {
        "none": 0,
        "mlp": L * mlp,
        "attention": L * (attention + attn_fwd),
        "block": L * (attention + mlp + attn_fwd),
        "every_n": math.ceil(L / s.every_n) * (attention + mlp + attn_fwd),
    }[s.checkpoint]
    return {"linear": linear, "sdpa": sdpa, "recompute": rebuilt}


def _peak(s: StepSetup, precision: str) -> float:
    return PEAK_FLOPS[s.gpu_type][precision]


def step_time(s: StepSetup) -> dict[str, float]:
    """Predicted seconds of one optimizer step on one GPU, by component, with ``total``."""
    n, V, d = s.tokens, s.vocab, s.dim
    body_precision = "bf16" if s.bf16 else "fp32"
    peak, bw = _peak(s, body_precision), HBM_BYTES_PER_S[s.gpu_type] * ETA["memory"]
    f = body_flops(s)
    rate = peak * ETA["train"][body_precision]
    linear = n * f["linear"] / rate
    if s.fp8 != "none" and s.bf16:  # only the converted linears' matmuls (`fp8_converts`) speed up
        conv, shapes = s.fp8_linears(), s.linear_shapes()
        share = sum(o * i for k, (o, i) in shapes.items() if conv[k]) / sum(o * i for o, i in shapes.values())
        linear *= 1 - share + share / FP8_SPEEDUP[s.fp8]
    body = linear + n * f["sdpa"] / rate + n * f["recompute"] / (peak * ETA["recompute"])
    lm_flops = 6 * V * d * n
    if s.logits == "bf16-materialized":
        body += lm_flops / rate
        logits = 0.0
    else:
        ce_peak = _peak(s, s.ce_matmul) if s.device == "cuda" else peak
        eta = ETA["train"]["fp32" if s.ce_matmul == "fp32" else "bf16"]
        logits = lm_flops / (ce_peak * eta) + n * V * CE_BYTES_PER_LOGIT / bw
    if not s.compile:
        body *= EAGER_FACTOR[body_precision]
    kernel = s.optimizer if s.optimizer != "adamw" else f"adamw-{s.adamw_kernel}"
    fsdp = s.parallel == "fsdp"
    optimizer = s.params / (s.world_size if fsdp else 1) * OPTIMIZER_BYTES[kernel] / bw  # fsdp: its shard
    if s.optimizer == "muon":  # fsdp: one owner rank per matrix orthogonalises it
        optimizer += muon_flops(s) / (s.world_size if fsdp else 1) / (_peak(s, "bf16") * ETA["train"]["bf16"])
    out = {"body": s.grad_accum * body, "logits": s.grad_accum * logits, "optimizer": optimizer}
    total = sum(out.values())
    if s.world_size > 1:
        out["ddp"] = total / DDP_EFFICIENCY - total
    if fsdp:
        out["fsdp_comm"] = fsdp_comm(s, body + logits)["exposed_s"]
    out["total"] = sum(out.values())
    return out


def collective_bytes_per_s(s: StepSetup) -> float:
    """Achieved bus bandwidth of the job's ring collectives: NVLink (or PCIe) within a node; across
    nodes each of a node's rings crosses to the next node on its own NIC, so a ring of several nodes
    runs at min(intra-node link, GPUs per node × one NIC), × `COLLECTIVE_EFFICIENCY`."""
    gpu = "cpu" if s.device != "cuda" else GPU_TYPE_ALIASES.get(s.gpu_type, s.gpu_type)
    link = INTRA_NODE_BYTES_PER_S[gpu]
    if s.nodes > 1:
        link = min(link, s.gpus_per_node * IB_BYTES_PER_S_PER_GPU)
    return link * COLLECTIVE_EFFICIENCY


def fsdp_comm(s: StepSetup, micro_compute_s: float) -> dict[str, float]:
    """FSDP2's collectives of one optimizer step and the part of them compute does not hide.

    Per micro-step (the trainer reshards and reduce-scatters every micro-step): all-gather bytes =
    `FSDP_BLOCK_GATHERS` × L × block × gathered bytes + `FSDP_ROOT_GATHERS` × root × `FSDP_ROOT_BYTES`;
    reduce-scatter bytes = P × `FSDP_REDUCE_BYTES`. A ring collective over W ranks moves (W−1)/W of
    those bytes through each GPU's link: seconds = bytes × (W−1)/W / `collective_bytes_per_s`. FSDP2
    prefetches the next unit's all-gather during the current unit's compute and reduce-scatters a
    block while the previous one runs backward, so a micro-step exposes max(0, comm − edge −
    `FSDP_OVERLAP` × compute) + edge, where the edge (the first unit's all-gather before any compute,
    the last unit's reduce-scatter after it: the root and one block, each way) cannot hide."""
    W = s.world_size
    ring = (W - 1) / W / collective_bytes_per_s(s) if W > 1 else 0.0
    pb = s.param_bytes
    gather = FSDP_BLOCK_GATHERS * s.n_layers * s.block_params * pb + FSDP_ROOT_GATHERS * s.root_params * FSDP_ROOT_BYTES
    reduce = s.params * FSDP_REDUCE_BYTES
    edge = (s.block_params * (pb + FSDP_REDUCE_BYTES) + s.root_params * (FSDP_ROOT_BYTES + FSDP_REDUCE_BYTES)) * ring
    comm = (gather + reduce) * ring
    exposed = max(0.0, comm - edge - FSDP_OVERLAP * micro_compute_s) + min(edge, comm)
    return {"allgather_bytes": s.grad_accum * gather, "reduce_scatter_bytes": s.grad_accum * reduce,
            "comm_s": s.grad_accum * comm, "exposed_s": s.grad_accum * exposed,
            "bus_bytes_per_s": collective_bytes_per_s(s)}


def muon_flops(s: StepSetup) -> float:
    """Newton–Schulz FLOPs of one Muon step over the block matrices."""
    d, dkv, f = s.dim, s.d_kv, s.ffn_dim
    shapes = [(d, d), (d, d), (dkv, d), (dkv, d), (f, d), (f, d), (d, f)]
    per_layer = sum(4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3 for a, b in shapes)
    return MUON_NS_STEPS * s.n_layers * per_layer


def model_flops_per_token(s: StepSetup) -> float:
    """pipeline.planning.compute.flops_per_token of this setup's model: the FLOPs MFU is logged with."""
    return flops_of(s.vocab, s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.ffn_dim, s.seq_len)


def step_seconds(cfg: RunConfig, logits: str = "ours", parallel: str | None = None) -> tuple[float, str]:
    """Seconds of one optimizer step and their basis: at `hardware.assumed_mfu` when set, else predicted
    (`step_time`). A measured step (`pipeline.plan --measured-step`) overrides both in the plan. ``parallel``
    (ddp | fsdp) replaces ``train.parallel``, as in `StepSetup.from_config`."""
    setup = StepSetup.from_config(cfg, logits, parallel)
    mfu = cfg.hardware.assumed_mfu
    if mfu is None:
        return step_time(setup)["total"], "predicted (pipeline.planning.step_time)"
    flops = flops_per_token(cfg) * cfg.train.global_batch_tokens
    return flops / (setup.world_size * peak_flops(cfg) * mfu), "hardware.assumed_mfu"


def predicted_mfu(s: StepSetup, seconds: float | None = None) -> float:
    """MFU of a step of `seconds` (default: the predicted step time) against the body precision's peak."""
    seconds = step_time(s)["total"] if seconds is None else seconds
    tokens = s.tokens * s.grad_accum
    return model_flops_per_token(s) * tokens / (seconds * _peak(s, "bf16" if s.bf16 else "fp32"))


def measured_step_seconds(s: StepSetup, micro_step_s: float) -> float:
    """An optimizer step's seconds from one measured `pipeline.bench` step (one micro-batch with its
    optimizer step, one GPU): × grad_accum (counting the optimizer once per micro-step, an over-
    estimate of (grad_accum − 1) optimizer steps), with the predicted DDP overhead on several GPUs."""
    seconds = s.grad_accum * micro_step_s
    return seconds / DDP_EFFICIENCY if s.world_size > 1 else seconds


