"""Long runs on a cluster: what a checkpoint costs, how often to write one, and each training stage as a chain of
jobs that fit the cluster's time limit (`hardware.max_job_hours`). Every figure is a prediction.

    from pipeline.planning.train_jobs import stage_jobs, checkpointing
    stage_jobs(cfg)["pretrain"]["jobs"]   # SLURM jobs the stage runs as (1 without a limit)
    checkpointing(cfg)["interval_steps"]  # Young/Daly: √(2 × save cost × the job's MTBF), in steps

The planner shows them (pipeline.plan), the Snakefile chains each stage's jobs (train_segment, then train) and
resolves ``train.ckpt_interval: auto``, the trainer sizes its stop margin and watchdog from them. `cfg` is a
resolved config or one stage's params (`pipeline.planning.stages.stage_config`). Import-light: no torch.
"""
from __future__ import annotations

import math

from pipeline.errors import PlanError
from pipeline.planning.compute import world_size
from pipeline.planning.job_sizes import train_minutes
from pipeline.planning.memory import StepSetup, optimizer_bytes
from pipeline.planning.stages import estimated_epoch_steps, stage_budget, stage_list
from pipeline.planning.step_time import step_seconds
from pipeline.run_config import RunConfig, with_section

__all__ = ["predicted_step_s", "predicted_save_s", "predicted_startup_s", "checkpointing", "resolve_ckpt_interval",
           "stage_jobs"]

# Assumptions (each a per-process or per-node rate; `make gpu-check`'s checkpoint rows measure the GPU node's):
STAGING_GB_PER_S = {"cuda": 25.0, "cpu": 5.0}  # device → pinned host copy (PCIe Gen5 x16 ≈ 50 GB/s peak); host memcpy
HASH_GB_PER_S = 1.0             # sha256 of a written file, one core (every checkpoint file is hashed, read back)
PROCESS_START_S = {"cuda": 60.0, "cpu": 10.0}  # python + torch imports, CUDA and NCCL init, the rendezvous
COMPILE_S = 120.0               # torch.compile's first step on CUDA (per block under fsdp), when compiling
LOADER_SEEK_S = 5.0             # the packed loader's position restored: an index, not a replay
STOP_MARGIN_S = 30.0            # the trainer's margin before its deadline (TOKENFARM_STOP_MARGIN_S)
TRAIN_STATE_BYTES = 64e6        # loader and RNG states, the params: small beside the tensors


def _setup(cfg: RunConfig, parallel: str | None = None) -> tuple[StepSetup, str, int, int]:
    return StepSetup.from_config(cfg, parallel=parallel), cfg.hardware.device, world_size(cfg), cfg.hardware.nodes


def predicted_step_s(cfg: RunConfig, parallel: str | None = None) -> float:
    """Seconds of one optimizer step: the plan's step time (`pipeline.planning.step_time.step_seconds`)."""
    return float(step_seconds(cfg, parallel=parallel)[0])


def _compiles(cfg: RunConfig) -> bool:
    return cfg.hardware.device == "cuda" if cfg.train.compile == "auto" else bool(cfg.train.compile)


def _costs(cfg: RunConfig, parallel: str | None = None) -> dict:
    """A checkpoint's size, what a save blocks and writes, and a restart's start-up, with their terms."""
    setup, device, world, nodes = _setup(cfg, parallel)
    state = 4 * setup.params + optimizer_bytes(setup)  # fp32 weights + the optimizer's state
    sharded = (parallel or cfg.train.parallel) == "fsdp"
    rank = state / world if sharded else state        # ddp: rank 0 writes the whole file
    node = state / nodes if sharded else state        # what one node's link carries
    bw = cfg.hardware.storage_gb_per_s * 1e9
    stage = rank / (STAGING_GB_PER_S[device] * 1e9)
    write = node / bw + rank / (HASH_GB_PER_S * 1e9)  # written, then read back and hashed
    asynchronous = cfg.train.async_ckpt
    startup = {"process": PROCESS_START_S[device],
               "verify": state / min(bw, HASH_GB_PER_S * 1e9),  # rank 0 hashes every file before trusting it
               "load": node / bw,
               "compile": COMPILE_S if _compiles(cfg) else 0.0,
               "loader_seek": LOADER_SEEK_S}
    return {"size_gb_rank": (rank + TRAIN_STATE_BYTES) / 1e9, "size_gb_total": (state + TRAIN_STATE_BYTES) / 1e9,
            "block_s": stage if asynchronous else stage + write, "write_s": write if asynchronous else 0.0,
            "async": asynchronous, "startup": startup, "startup_s": sum(startup.values())}


def predicted_save_s(cfg: RunConfig) -> float:
    """Seconds one checkpoint save blocks training (async: the staging copy; else the whole write)."""
    return _costs(cfg)["block_s"]


def predicted_startup_s(cfg: RunConfig) -> float:
    """Seconds a job (or a restart) spends before its first step: start, verify, load, compile, loader seek."""
    return _costs(cfg)["startup_s"]


def checkpointing(cfg: RunConfig, step_s: float | None = None, parallel: str | None = None) -> dict:
    """The checkpoint figures of the plan: size per rank and in all (GB), the seconds a save blocks and writes in
    the background, a restart's start-up (by term), the job's MTBF (`hardware.gpu_mtbf_hours` / GPUs), the
    Young/Daly interval (seconds, steps: `train.ckpt_interval` when a number) and the work one failure loses.
    ``parallel`` (ddp | fsdp) replaces ``train.parallel`` (the plan's resolution of auto)."""
    step_s = predicted_step_s(cfg, parallel) if step_s is None else step_s
    c = _costs(cfg, parallel)
    mtbf_h = cfg.hardware.gpu_mtbf_hours / world_size(cfg)
    # Young/Daly on what a checkpoint costs the run; a save's background write must end before the next save
    young_daly_s = max(math.sqrt(2 * c["block_s"] * mtbf_h * 3600), c["block_s"] + c["write_s"])
    configured = cfg.train.ckpt_interval
    steps = max(1, round(young_daly_s / step_s)) if configured == "auto" else int(configured)
    interval_s = steps * step_s
    # a failure loses half an interval on average, the last save's write if it had not ended, and a start-up
    lost_s = interval_s / 2 + c["write_s"] + c["startup_s"]
    return {**c, "mtbf_hours": mtbf_h, "young_daly_s": young_daly_s, "interval_steps": steps,
            "interval_hours": interval_s / 3600, "lost_hours_per_failure": lost_s / 3600, "step_s": step_s}


def resolve_ckpt_interval(cfg: RunConfig) -> RunConfig:
    """A RunConfig of `cfg` with ``train.ckpt_interval: auto`` replaced by the Young/Daly interval in steps
    (`checkpointing`); `cfg` itself when it sets a number."""
    if cfg.train.ckpt_interval != "auto":
        return cfg
    return with_section(cfg, "train", ckpt_interval=checkpointing(cfg)["interval_steps"])


def stage_jobs(cfg: RunConfig, step_s: float | None = None, parallel: str | None = None) -> dict[str, dict]:
    """Per training stage (a whole run config's stages): ``jobs`` (the chain's length: 1 without
    `hardware.max_job_hours`), ``runtime_min`` (what each job asks the scheduler for, never above the limit),
    ``num_steps``, ``hours_per_job``, ``checkpoints``, ``restarts`` (planned ones and expected failures) and
    ``wall_hours``: its compute, every save and every restart's start-up and lost work. Raises PlanError for a
    limit too short to train a step. ``parallel``: as in `checkpointing`."""
    ck = checkpointing(cfg, step_s, parallel)
    step_s, start_s, final_s = ck["step_s"], ck["startup_s"], ck["block_s"] + ck["write_s"]
    limit_h = cfg.hardware.get("max_job_hours")
    out = {}
    for st in stage_list(cfg):
        steps = stage_budget(cfg, st)["num_steps"] or estimated_epoch_steps(cfg, st)
        saves = math.ceil(steps / ck["interval_steps"])
        train_s = steps * step_s + saves * ck["block_s"]
        if limit_h is None:
            jobs, runtime = 1, train_minutes(train_s / 3600)
        else:
            # a job: its start-up, then steps until its stop leaves time for two steps, the last save and a margin
            usable_s = limit_h * 3600 - start_s - final_s - STOP_MARGIN_S - 2 * step_s
            if usable_s < step_s:
                raise PlanError(
                    f"hardware.max_job_hours = {limit_h:g} h leaves no time to train: a job needs "
                    f"{(start_s + final_s + STOP_MARGIN_S + 3 * step_s) / 3600:.3g} h for its start-up, a step and "
                    "its checkpoint (predicted); raise it to the partition's real time limit")
            jobs, runtime = max(1, min(steps, math.ceil(train_s / usable_s))), math.floor(limit_h * 60)
        planned_s = train_s + jobs * (start_s + final_s)
        failures = planned_s / 3600 / ck["mtbf_hours"]
        wall_s = planned_s + failures * ck["lost_hours_per_failure"] * 3600
        out[st["name"]] = {"jobs": jobs, "runtime_min": runtime, "num_steps": steps, "checkpoints": saves,
                           "hours_per_job": planned_s / jobs / 3600, "compute_hours": steps * step_s / 3600,
                           "expected_failures": failures, "restarts": jobs - 1 + failures,
                           "wall_hours": wall_s / 3600}
    return out
