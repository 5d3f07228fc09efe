"""Long runs on a cluster: checkpoint size and save time, the checkpoint interval, and each training stage
as a chain of jobs that fit the cluster's time limit (`hardware.max_job_hours`).

    from pipeline.resilience import stage_jobs, predicted_save_s
    stage_jobs(cfg)["pretrain"]["jobs"]      # SLURM jobs the stage runs as (1 without a limit)

The planner shows these figures (pipeline.plan), the Snakefile chains each stage's jobs (rule train_segment, then
train), and the trainer sizes its stop margin and watchdog from them (pipeline.training). Import-light: no torch.
"""
from __future__ import annotations

import math

from pipeline.budget import BatchLayout, count_params
from pipeline.perf import step_seconds
from pipeline.stages import stage_budget, stage_list

__all__ = ["predicted_step_s", "predicted_save_s", "predicted_startup_s", "resolve_ckpt_interval", "stage_jobs"]

STORAGE_GB_PER_S = 2.0  # per node, to and from the filesystem holding R/ (placeholder until the planner's model)
STARTUP_S = 120.0       # placeholder: a restart's process start, checkpoint load, compile, loader seek


def predicted_step_s(cfg: dict) -> float:
    """Seconds of one optimizer step: the plan's step time (`pipeline.perf.step_seconds`)."""
    return float(step_seconds(cfg)[0])


def predicted_save_s(cfg: dict) -> float:
    """Seconds one checkpoint save blocks training (placeholder: weights + AdamW state over the storage bandwidth)."""
    n_params = count_params(cfg["model"])[0]
    nodes = cfg["hardware"]["nodes"]
    return 12 * n_params / (STORAGE_GB_PER_S * 1e9 * nodes)


def predicted_startup_s(cfg: dict) -> float:
    """Seconds a job spends before its first step (placeholder)."""
    return STARTUP_S


def resolve_ckpt_interval(cfg: dict) -> dict:
    """`cfg` with ``train.ckpt_interval: auto`` replaced by a number of steps (placeholder: 1000)."""
    if cfg["train"]["ckpt_interval"] != "auto":
        return cfg
    return {**cfg, "train": {**cfg["train"], "ckpt_interval": 1000}}


def stage_jobs(cfg: dict) -> dict[str, dict]:
    """Per training stage: ``jobs`` (the chain's length: 1 without `hardware.max_job_hours`) and ``runtime_min``
    (what each job asks the scheduler for, never above the limit)."""
    limit_h = cfg["hardware"]["max_job_hours"]
    step_s = predicted_step_s(cfg)
    rows_per_step = BatchLayout.from_config(cfg).rows_per_step
    out = {}
    for st in stage_list(cfg):
        steps = stage_budget(cfg, st)["num_steps"]
        if steps is None:  # an epochs budget: estimated from its mix's tokens
            rows = -(-int(cfg["mixes"][st["mix"]]["tokens"]) // cfg["train"]["seq_len"])
            steps = -(-math.ceil(st["budget"]["value"] * rows) // rows_per_step)
        hours = steps * step_s / 3600
        if limit_h is None:
            out[st["name"]] = {"jobs": 1, "runtime_min": math.ceil(90 * hours) + 30, "num_steps": steps}
            continue
        usable_h = max(limit_h - (predicted_startup_s(cfg) + predicted_save_s(cfg)) / 3600, limit_h / 4)
        jobs = max(1, min(steps, math.ceil(hours / usable_h)))
        out[st["name"]] = {"jobs": jobs, "runtime_min": max(1, math.floor(limit_h * 60)), "num_steps": steps}
    return out
