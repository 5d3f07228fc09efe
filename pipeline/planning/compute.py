"""Budget arithmetic shared by config validation, the planner and the trainer: parameters, FLOPs,
token targets, the batch layout and the peak FLOP/s table (definitions: docs/planning.md).

Pure functions of the resolved config, torch-free and import-light (the Snakefile imports them at
parse time through `pipeline.config` and `pipeline.plan`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.errors import ConfigError, PipelineError, PlanError
from pipeline.run_config import ModelConfig, RunConfig, TrainConfig


def world_size(cfg: RunConfig) -> int:
    hw = cfg.hardware
    return hw.nproc_per_node * hw.nodes


# GPU types: dense peak FLOP/s (NVIDIA datasheets, no sparsity: the datasheets' "with sparsity"
# figures halved), memory bandwidth in bytes/s, and the exact device names that identify them
# (`torch.cuda.get_device_properties(i).name`; matched exactly, never by substring: "GH200" contains
# "H200", and "H100 PCIe" has 76 % of an H100 SXM's bf16 rate and 60 % of its bandwidth). "fp32" is
# true fp32 (CUDA cores: what an fp32 run gets, since it sets `highest` matmul precision); "tf32" is
# tensor-core fp32 math with inputs rounded to 10 mantissa bits; "fp8" of a GPU without fp8 (A100)
# is its bf16 rate. Datasheets: H100 (SXM 80 GB / PCIe 80 GB / NVL 94 GB), H200 (SXM / NVL 141 GB),
# GH200 Grace Hopper Superchip (96 GB HBM3, 144 GB HBM3e), A100 (40 / 80 GB), L40S (48 GB GDDR6).
GPU_SPECS = {
    "H100-SXM": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12, "hbm": 3.35e12,
                 "names": ("NVIDIA H100 80GB HBM3",)},
    "H100-PCIe": {"bf16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51.2e12, "hbm": 2.0e12,
                  "names": ("NVIDIA H100 PCIe",)},
    "H100-NVL": {"bf16": 835.5e12, "fp8": 1670.5e12, "tf32": 417.5e12, "fp32": 60e12, "hbm": 3.9e12,
                 "names": ("NVIDIA H100 NVL",)},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12, "hbm": 4.8e12,
             "names": ("NVIDIA H200",)},
    "H200-NVL": {"bf16": 835.5e12, "fp8": 1670.5e12, "tf32": 417.5e12, "fp32": 60e12, "hbm": 4.8e12,
                 "names": ("NVIDIA H200 NVL",)},
    "GH200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12, "hbm": 4.0e12,
              "names": ("NVIDIA GH200 480GB",)},
    "GH200-144GB": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12, "hbm": 4.9e12,
                    "names": ("NVIDIA GH200 144G HBM3e",)},
    "A100-40GB": {"bf16": 312e12, "fp8": 312e12, "tf32": 156e12, "fp32": 19.5e12, "hbm": 1.555e12,
                  "names": ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")},
    "A100-80GB": {"bf16": 312e12, "fp8": 312e12, "tf32": 156e12, "fp32": 19.5e12, "hbm": 2.039e12,
                  "names": ("NVIDIA A100-SXM4-80GB",)},
    "A100-80GB-PCIe": {"bf16": 312e12, "fp8": 312e12, "tf32": 156e12, "fp32": 19.5e12, "hbm": 1.935e12,
                       "names": ("NVIDIA A100 80GB PCIe",)},
    "L40S": {"bf16": 362.05e12, "fp8": 733e12, "tf32": 183e12, "fp32": 91.6e12, "hbm": 0.864e12,
             "names": ("NVIDIA L40S",)},
}
# Config values of earlier versions, kept: "H100" is the SXM part, "A100" the 80 GB SXM part.
GPU_TYPE_ALIASES = {"H100": "H100-SXM", "A100": "A100-80GB"}
_CPU = {"bf16": 1e12, "fp8": 1e12, "tf32": 1e12, "fp32": 1e12, "hbm": 20e9}  # nominal, not a measurement
_ALL = {**GPU_SPECS, **{a: GPU_SPECS[t] for a, t in GPU_TYPE_ALIASES.items()}, "cpu": _CPU}
PEAK_FLOPS = {g: {k: v[k] for k in ("bf16", "fp8", "tf32", "fp32")} for g, v in _ALL.items()}
HBM_BYTES_PER_S = {g: v["hbm"] for g, v in _ALL.items()}
GPU_NAMES = {name: g for g, v in GPU_SPECS.items() for name in v["names"]}


def gpu_type_of(device_name: str) -> str:
    """The GPU type (a `GPU_SPECS` key) of a CUDA device name, matched exactly ("cpu" for the CPU);
    an unknown name is refused with the known ones (a wrong peak would silently skew MFU and the
    planner's predictions)."""
    if device_name == "cpu":
        return "cpu"
    try:
        return GPU_NAMES[device_name.strip()]
    except KeyError:
        known = ", ".join(f"{n!r} ({g})" for n, g in GPU_NAMES.items())
        raise PipelineError(f"unknown GPU {device_name!r}: its peak FLOP/s and bandwidth are not in "
                            f"pipeline.planning.compute.GPU_SPECS (known devices: {known}); add a row with its "
                            "datasheet figures and exact torch.cuda.get_device_properties(...).name") from None


def canonical_gpu_type(gpu_type: str) -> str:
    """`hardware.gpu_type` with the aliases resolved ("H100" → "H100-SXM")."""
    return GPU_TYPE_ALIASES.get(gpu_type, gpu_type)


def parts_of(vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
             tied: bool) -> dict[str, int]:
    """Parameter counts of `pipeline.model.model.Transformer` by part, from its shape: embedding, lm_head
    (0 when tied), blocks (all L blocks, norms included), final_norm."""
    V, d, L, f = vocab, dim, n_layers, ffn_dim
    d_kv = n_kv_heads * (d // n_heads)
    attention = 2 * d * d + 2 * d * d_kv
    block = attention + 3 * d * f + 2 * d
    return {
        "embedding": V * d,
        "lm_head": 0 if tied else V * d,
        "blocks": L * block,
        "final_norm": d,
    }


def param_parts(model: ModelConfig) -> dict[str, int]:
    """`parts_of` the model a config's ``model`` section describes."""
    return parts_of(model.vocab_size, model.dim, model.n_layers, model.n_heads, model.n_kv_heads, model.ffn_dim,
                    model.tie_embeddings)


def count_params(model: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters of the model described by ``cfg.model``; non-embedding
    excludes the token embedding and an untied lm_head (see docs/planning.md)."""
    p = param_parts(model)
    return sum(p.values()), p["blocks"] + p["final_norm"]


def flops_of(vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
             seq_len: int) -> int:
    """Training FLOPs per token of a model of this shape at sequence length `seq_len`:
    6·(N_non_embedding + V·d) + 12·L·d·T (docs/planning.md). The one formula MFU is computed with."""
    p = parts_of(vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim, tied=True)
    return 6 * (p["blocks"] + p["final_norm"] + vocab * dim) + 12 * n_layers * dim * seq_len


def flops_per_token(cfg: RunConfig) -> int:
    """Training FLOPs per token of a run config (``model`` and ``train.seq_len``): `flops_of` its model."""
    m = cfg.model
    return flops_of(m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, cfg.train.seq_len)


class BatchLayoutError(ConfigError, PlanError):
    """A global batch that is no whole number of micro-steps: a config error, raised by the config's
    validation and by the planner (which may be handed an unvalidated config) with one message."""


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step is laid out: `grad_accum_steps` micro-steps of `micro_batch` rows of
    `seq_len` tokens on each of `world_size` ranks, `tokens_per_step` (= train.global_batch_tokens)
    tokens in all. The one place the layout is computed (config validation, the planner, the memory
    and step-time model, the trainer)."""

    micro_batch: int
    seq_len: int
    world_size: int
    grad_accum_steps: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> BatchLayout:
        """The layout of a run config (``train`` and ``hardware``); refuses a global batch that is not a
        whole number of micro-steps (`BatchLayoutError`, naming the keys and the hardware)."""
        train = cfg.train
        micro_batch, seq_len, ws = train.micro_batch, train.seq_len, world_size(cfg)
        per_micro = micro_batch * seq_len * ws
        if train.global_batch_tokens % per_micro:
            raise BatchLayoutError(
                f"config key 'train.global_batch_tokens': {train.global_batch_tokens} is not divisible by "
                f"micro_batch × seq_len × world_size (hardware.nodes × hardware.nproc_per_node) = {micro_batch} × "
                f"{seq_len} × {ws} = {per_micro}, so gradient accumulation would not be a whole number of "
                "micro-steps; change train.global_batch_tokens, train.micro_batch or the hardware"
            )
        return cls(micro_batch, seq_len, ws, train.global_batch_tokens // per_micro)

    @property
    def rows_per_micro_step(self) -> int:
        """Rows of one micro-step over all ranks."""
        return self.micro_batch * self.world_size

    @property
    def rows_per_step(self) -> int:
        """Rows of one optimizer step over all ranks and micro-steps."""
        return self.rows_per_micro_step * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of one optimizer step (= train.global_batch_tokens)."""
        return self.rows_per_step * self.seq_len

    def plan_figures(self) -> dict[str, int]:
        """The plan's batch keys: tokens_per_step, micro_batch, world_size, grad_accum_steps."""
        return {"tokens_per_step": self.tokens_per_step, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "grad_accum_steps": self.grad_accum_steps}


@dataclass(frozen=True)
class StepPlan:
    """What the trainer takes from the plan: the batch layout's figures, FLOPs per token, the stage's
    optimizer steps and its name (both set by the trainer for the stage it trains). A checkpoint keeps
    it as a dict (`dataclasses.asdict`)."""

    tokens_per_step: int
    micro_batch: int
    world_size: int
    grad_accum_steps: int
    flops_per_token: int
    num_steps: int | None = None
    stage: str | None = None

    @classmethod
    def of(cls, cfg: RunConfig) -> StepPlan:
        """The figures of a resolved config, by the planner's own functions."""
        return cls(**BatchLayout.from_config(cfg).plan_figures(), flops_per_token=flops_per_token(cfg))

    @classmethod
    def from_plan(cls, plan) -> StepPlan:
        """The figures of a `Plan`, or of plan.json's dict."""
        get = plan.get if isinstance(plan, dict) else (lambda k: getattr(plan, k))
        return cls(**{k: get(k) for k in ("tokens_per_step", "micro_batch", "world_size", "grad_accum_steps",
                                          "flops_per_token", "num_steps")})


def token_target(train: TrainConfig, n_params: int, fpt: int) -> tuple[int, str]:
    """(target tokens, the config key that set it) of a run's ``train`` section."""
    if train.get("target_tokens") is not None:
        return int(train.target_tokens), "train.target_tokens"
    if train.get("target_flops") is not None:
        return math.ceil(train.target_flops / fpt), "train.target_flops"
    if train.tokens_per_param == "scaling":  # resolved from the sweep's fit by pipeline.planning.sweep
        raise PlanError("train.tokens_per_param: scaling has no fitted ratio here: run `snakemake --cores all "
                        "scaling` first (its fit sets the ratio), or set a number")
    return math.ceil(train.tokens_per_param * n_params), "train.tokens_per_param"


def trained_tokens(cfg: RunConfig) -> int:
    """num_steps × tokens_per_step: the training targets the run consumes, what a mix's ``tokens: plan``
    means. Depends on the budget, the model and the global batch only (not the micro-batch, world
    size or the measured counts), so the mix stage can take it as a parameter."""
    n_params, _ = count_params(cfg.model)
    target, _ = token_target(cfg.train, n_params, flops_per_token(cfg))
    step = cfg.train.global_batch_tokens
    return math.ceil(target / step) * step


def peak_flops(cfg: RunConfig) -> float:
    """The peak MFU is measured against: bf16 for a bf16 body on CUDA, else true fp32 (an fp32 run
    sets `highest` matmul precision, so TF32's 7× higher peak would make its MFU look 7× too low)."""
    bf16 = cfg.train.precision == "bf16" and cfg.hardware.device == "cuda"
    return PEAK_FLOPS[cfg.hardware.gpu_type]["bf16" if bf16 else "fp32"]
