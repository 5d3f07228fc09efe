"""train.parallel: auto resolved to ddp or fsdp by predicted memory per GPU, refusing a choice that does
not fit with the fix named (`resolve_parallel`)."""
from __future__ import annotations

import math

from pipeline.errors import PlanError
from pipeline.planning.memory import StepSetup, capacity_gb, choose_parallel, memory
from pipeline.planning.stages import ADAMW8BIT_FSDP, adamw8bit_keys
from pipeline.run_config import RunConfig, with_section

# ----------------------------------------------------------------------------- ddp or fsdp

def _gpu_words(cfg: RunConfig, cap: float) -> str:
    hw = cfg.hardware
    if hw.device != "cuda":
        return f"the {cap:.1f} GB of host memory hardware.gpu_memory_gb gives a process"
    return f"an {hw.gpu_type}'s {cap:.1f} GB (hardware.gpu_memory_gb {hw.gpu_memory_gb:g} GiB)"


def smaller_micro_batch(cfg: RunConfig, parallel: str) -> tuple[int, float] | None:
    """(the largest train.micro_batch below the config's whose layout divides the global batch and whose
    predicted memory under `parallel` fits, its total GB), or None."""
    cap = capacity_gb(cfg.hardware.gpu_memory_gb, cfg.hardware.device)
    base = StepSetup.from_config(cfg, parallel=parallel)
    row_tokens = cfg.train.seq_len * base.world_size
    if cfg.train.global_batch_tokens % row_tokens:
        return None
    rows = cfg.train.global_batch_tokens // row_tokens  # micro_batch must divide it
    divisors = {k for i in range(1, math.isqrt(rows) + 1) if rows % i == 0 for k in (i, rows // i)}
    for mb in sorted((k for k in divisors if k < cfg.train.micro_batch), reverse=True):
        total = memory(base.replace(micro_batch=mb, grad_accum=rows // mb))["total"]
        if total <= cap:
            return mb, total
    return None


def resolve_parallel(cfg: RunConfig) -> RunConfig:
    """A RunConfig of `cfg` with ``train.parallel`` resolved to ddp or fsdp (`choose_parallel`), refusing a choice whose
    predicted memory per GPU does not fit: one `PlanError` naming train.parallel and the fix (fsdp, a
    smaller micro-batch that fits, more GPUs or activation checkpointing), and ``auto`` resolving to fsdp
    beside adamw8bit (`ADAMW8BIT_FSDP`; an explicit fsdp is refused by pipeline.config's checks). What the
    Snakefile does at parse time, so rules and the trainer receive a concrete value."""
    c = choose_parallel(cfg)
    parallel, cap, mem, fits = c["parallel"], c["capacity_gb"], c["memory"], c["fits"]
    if not fits[parallel]:
        m = mem[parallel]
        state = m["weights"] + m["optimizer"] + m["gradients"]
        asked = "auto (neither fits)" if c["requested"] == "auto" else parallel
        what = ("a full replica of weights, gradients and optimizer state" if parallel == "ddp"
                else "weights, gradients and optimizer state sharded over the world size")
        fixes = []
        if parallel == "ddp" and fits["fsdp"]:
            fixes.append(f"set train.parallel: fsdp (or auto), {mem['fsdp']['total']:.1f} GB per GPU")
        for mode in ("ddp", "fsdp") if parallel == "ddp" else ("fsdp",):
            smaller = smaller_micro_batch(cfg, mode)
            if smaller and (mode == parallel or len(fixes) < 2 and not fits["fsdp"]):
                where = "" if mode == parallel else f" with train.parallel: {mode}"
                fixes.append(f"lower train.micro_batch to {smaller[0]}{where} ({smaller[1]:.1f} GB per GPU)")
                if mode == parallel and not fits["fsdp"]:
                    break  # a smaller micro-batch of the asked parallelism is the one fix to name
        if not fixes:
            fixes.append("add GPUs (hardware.nodes: fsdp shards over all of them)"
                         + ("" if cfg.train.activation_checkpointing == "block"
                            else " or checkpoint activations (train.activation_checkpointing: block)"))
        raise PlanError(
            f"config key 'train.parallel': {asked} does not fit the GPU's memory: {parallel} needs "
            f"{m['total']:.1f} GB per GPU (predicted by pipeline.planning.memory; {what}: {state:.1f} GB) of "
            f"{_gpu_words(cfg, cap)}" + (f"; fsdp would need {mem['fsdp']['total']:.1f} GB"
                                          if parallel == "ddp" and not fits["fsdp"] else "")
            + "; " + " or ".join(fixes))
    if parallel == "fsdp" and adamw8bit_keys(cfg):
        raise PlanError(
            f"config key 'train.parallel': {c['reason']}, but {' and '.join(adamw8bit_keys(cfg))} set "
            f"adamw8bit: {ADAMW8BIT_FSDP}; use adamw or muon there, or "
            "make ddp fit (a smaller train.micro_batch, train.activation_checkpointing: block)")
    return with_section(cfg, "train", parallel=parallel)
