r"""Train stage: DDP or FSDP2 (+ torch.compile) training of the Llama-3-style model on the packed rows.

One launch trains one stage of `train.stages` (or one job of it, ``--segment K/N``) and writes
``outdir/final.pt``, ``metrics.jsonl``, ``ckpt/``, ``summary.json`` and ``wandb/``. The train rule runs::

    python -m pipeline.training.launch -- \
    torchrun --standalone --nproc_per_node N -m pipeline.training.train --params JSON [--plan R/plan.json] \
        --train R/pack/M/train.json --val R/pack/M/val.json --tokenizer R/tokenizer/encoding.json \
        --outdir R/train/STAGE [--stage STAGE] [--init R/train/PREV/final.pt] [--resume auto|require|never]

Without torchrun it runs as one process. `train(...)` is the library entry (set-up, `run_steps`, `finish`);
`main` the CLI. Jobs and stops, stages, what runs per optimizer step (the exact token-weighted loss
normalisation), checkpoints and metrics: docs/training.md, "The trainer".
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from pipeline.config import RunLayout, add_config_args, params_from_args, train_slice
from pipeline.data.encoding import Tokenizer, load_tokenizer
from pipeline.data.loader import DataExhausted, PackedLoader
from pipeline.distributed import Dist, all_reduce_sum, close_distributed, init_distributed, seed_everything
from pipeline.errors import PipelineError
from pipeline.evaluation import chat_core, core_benchmark
from pipeline.io import get_logger, provenance, read_json, run_cli, sha256_file, write_json
from pipeline.model.checkpoint_io import save_checkpoint, versions
from pipeline.model.engine import greedy_sample
from pipeline.model.losses import chunked_eval_stats
from pipeline.model.model import Transformer
from pipeline.planning.compute import BatchLayout, StepPlan, canonical_gpu_type, gpu_type_of, peak_flops
from pipeline.planning.stages import epoch_steps, is_chat_stage, stage_budget, stage_config, stage_names
from pipeline.planning.train_jobs import resolve_ckpt_interval
from pipeline.run_config import plain, run_config
from pipeline.training import checkpoint as ckpt
from pipeline.training.lease import Lease
from pipeline.training.metrics import MetricsLogger, UpdateRatio, group_norms, memory_stats, mfu, watched_groups
from pipeline.training.optim import build_optimizer, lr_factor, set_lr
from pipeline.training.parallelize import (
    LossModel,
    autocast_dtype,
    build_model,
    ce_matmul,
    gathered,
    parallelism,
    set_matmul_precision,
    use_compile,
    wrap,
)
from pipeline.training.processes import EXIT_STOPPED, die_with_parent, register_worker, report_exit
from pipeline.training.step import (
    StepBatches,
    accumulate_gradients,
    clip_gradients,
    next_micro_batches,
    plain_hidden,
    zero_gradients,
)
from pipeline.training.stopping import SIGNALS, StopControl, Stopped

log = get_logger(__name__)

FIXED_BATCH_ROWS = 8  # rows of the fixed validation batch behind ce_fp32 / top1_acc

# ----------------------------------------------------------------------------- validation

@torch.no_grad()
def validate(model: Transformer, val_meta: str, cfg: dict, layout: BatchLayout,
             dist: Dist) -> tuple[float, tuple | None]:
    """Mean CE over up to `train.val_batches` validation micro-batches per rank, the training
    precision (all ranks; one all-reduce). Also returns rank's first batch (the fixed batch)."""
    view = run_config(cfg)
    train_cfg = view.train
    loss_model = LossModel(model, autocast_dtype(cfg, dist.device), train_cfg.ce_chunk_tokens, ce_matmul(cfg))
    loader = val_loader(val_meta, cfg, layout, dist)
    totals = torch.zeros(2, device=dist.device, dtype=torch.float64)
    first = None
    it = iter(loader)
    for _ in range(train_cfg.val_batches):
        try:
            (batch,) = next_micro_batches(it, 1, dist.device)
        except (StopIteration, DataExhausted):
            break
        if first is None:
            first = batch
        loss_sum, count = loss_model(*batch)
        totals += torch.stack([loss_sum.double(), count.double()])
    all_reduce_sum(totals, dist)
    return float(totals[0] / totals[1]) if totals[1] > 0 else math.nan, first


@torch.no_grad()
def fixed_batch_stats(model: Transformer, batch: tuple, chunk: int) -> dict:
    """CE and top-1 accuracy of the whole model in true fp32 (no autocast, no TF32) on the first
    `FIXED_BATCH_ROWS` rows of a batch: the reference that exposes a training loss which only looks
    good in lower precision. fp8 linears run as plain linears here (`plain_hidden`), so an fp8 run's
    reference is fp32 too; under FSDP in a bf16 run the blocks' weights exist only bf16-rounded (gathered
    in bf16, `step.gathered`), and `plain_hidden` computes in fp32 on them, upcast one at a time.
    (Few rows: fp32 attention may fall back to a kernel that materialises the T×T scores.)"""
    x, y, m, d = (None if t is None else t[:FIXED_BATCH_ROWS] for t in (*batch, None)[:4])
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(x.device.type, enabled=False):
            hidden = plain_hidden(model, x, d)
        s = chunked_eval_stats(hidden, model.lm_head_weight, y, m, chunk=chunk)
    finally:
        torch.set_float32_matmul_precision(precision)
    if not s["count"]:  # every target of these rows masked out (an assistant-only loss, empty rows)
        return {}
    return {"ce_fp32": s["loss_sum"] / s["count"], "top1_acc": s["correct"] / s["count"]}


# ----------------------------------------------------------------------------- checks

def check_plan(plan: StepPlan, layout: BatchLayout, dist: Dist) -> None:
    """The plan must describe this launch: its world size, and this config's batch layout."""
    if plan.world_size != dist.world_size:
        raise PipelineError(
            f"launched with {dist.world_size} process(es) but the plan is for world_size {plan.world_size} "
            "(hardware.nproc_per_node × hardware.nodes); launch with that many or re-plan"
        )
    planned = {k: getattr(plan, k) for k in layout.plan_figures()}
    if planned != layout.plan_figures():
        raise PipelineError(
            f"the plan's batch layout {planned} is not this config's {layout.plan_figures()} (tokens_per_step = "
            "micro_batch × seq_len × grad_accum × world); the plan was made for another config — rerun the plan rule"
        )


def check_data(loader, plan: StepPlan, layout: BatchLayout, cfg: dict, train_meta: str) -> None:
    """Fail before training when the packed rows cannot supply the planned steps."""
    view = run_config(cfg)
    have = loader.steps_available(layout.rows_per_step)
    if have < plan.num_steps:
        meta, mix = loader.meta, view.train.mix
        raise PipelineError(
            f"{train_meta}: {meta['n_rows']} packed rows ({meta['tokens_packed']} tokens of mix '{mix}') supply "
            f"{have} steps of {layout.tokens_per_step} tokens, but the plan needs {plan.num_steps} steps "
            f"({plan.num_steps * layout.tokens_per_step} tokens, the target); give the mix more tokens "
            f"(mixes.{mix}.tokens) or lower train.target_tokens"
        )


def val_loader(val_meta: str, cfg: dict, layout: BatchLayout, dist: Dist) -> PackedLoader:
    """A fresh, unshuffled loader over the validation rows (the same rows every time), with the
    stage's loss mask and doc ids."""
    view = run_config(cfg)
    st = view.stage
    return PackedLoader(val_meta, layout.micro_batch, rank=dist.rank, world_size=dist.world_size,
                        seed=view.seed, shuffle=False, loss=st["loss"], with_doc_ids=st["doc_mask"])


def stage_steps(params: dict, layout: BatchLayout, train_meta: str) -> tuple[int, int | None]:
    """(optimizer steps, rows to read or None) of this stage: an epochs budget counts the packed
    rows (rows mode), any other budget is known from the config (pipeline/planning/stages.py)."""
    view = run_config(params)
    st = view.stage
    if st["budget"]["kind"] == "epochs":
        return epoch_steps(st["budget"]["value"], read_json(train_meta)["n_rows"], layout.rows_per_step)
    return stage_budget(view, {**st, "train": view.train})["num_steps"], None


def check_gpu_type(params: dict, device: torch.device) -> None:
    """Warn when the GPU in use is not `hardware.gpu_type` (by its exact device name,
    pipeline.planning.compute.GPU_SPECS): the logged MFU and the plan's predictions use the configured type."""
    view = run_config(params)
    configured = view.hardware.gpu_type
    name = torch.cuda.get_device_properties(device).name
    try:
        actual = gpu_type_of(name)
    except PipelineError as e:
        log.warning("%s; MFU is computed against hardware.gpu_type %s", e, configured)
        return
    if canonical_gpu_type(actual) != canonical_gpu_type(configured):
        log.warning("this GPU is %r (%s) but hardware.gpu_type is %s: MFU and the plan use %s's peak; set "
                    "hardware.gpu_type: %s", name, actual, configured, configured, actual)


def with_init(params: dict, init: str | None) -> dict:
    """The stage's params with its init's identity (`stage.init_sha256`: a checkpoint of a stage trained
    from an older init is never resumed); refuses an --init the stage does not start from, or its absence."""
    st = run_config(params).stage
    if st["init_from"] and init is None:
        raise PipelineError(f"stage '{st['name']}' starts from stage '{st['init_from']}': pass --init "
                            f"R/train/{st['init_from']}/final.pt")
    if init is not None and not st["init_from"]:
        raise PipelineError(f"stage '{st['name']}' starts from scratch (init_from: none) but --init {init} was "
                            "given; drop --init or set the stage's init_from")
    if init is None:
        return params
    return {**params, "stage": {**st, "init_sha256": sha256_file(init)}}


# ----------------------------------------------------------------------------- schedule and segments

@dataclass(frozen=True)
class Schedule:
    """Which steps log, validate, score CORE and checkpoint: functions of the step and the stage only, never
    of where a job started or stopped, so that a run stopped and resumed any number of times logs exactly
    the records of an uninterrupted run. (A job also checkpoints where it ends: its segment's target, a
    clean stop, --max-steps.)"""

    num_steps: int
    val_interval: int
    log_interval: int
    ckpt_interval: int
    core_every: int = 0

    @classmethod
    def of(cls, params: dict, num_steps: int, core_every: int) -> Schedule:
        view = run_config(params)
        t = view.train
        return cls(num_steps, t.val_interval, t.log_interval, t.ckpt_interval, core_every)

    def is_val(self, done: int) -> bool:
        return done % self.val_interval == 0 or done == self.num_steps

    def is_core(self, done: int) -> bool:
        return bool(self.core_every) and (done % self.core_every == 0 or done == self.num_steps)

    def is_log(self, done: int) -> bool:
        return self.is_val(done) or self.is_core(done) or done % self.log_interval == 0 or done == 1

    def is_ckpt(self, done: int) -> bool:
        return done % self.ckpt_interval == 0 or done == self.num_steps

    def last_logged(self, step: int) -> int | None:
        """The last step at or before `step` that logs a record (where a complete history ends)."""
        return next((d for d in range(step, 0, -1) if self.is_log(d)), None)


def parse_segment(text: str) -> tuple[int, int]:
    """``K/N`` (1 <= K <= N) of ``--segment``."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--segment {text!r}: expected K/N, e.g. 2/5") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--segment {text!r}: K must be between 1 and N")
    return k, n


def segment_target(segment: tuple[int, int], num_steps: int) -> int:
    """The step job K of N trains to: ceil(K × num_steps / N) (N/N: the stage's last step)."""
    k, n = segment
    return -(-k * num_steps // n)


def segment_marker(outdir: Path, segment: tuple[int, int]) -> Path:
    return Path(RunLayout.segment_in(outdir, segment[0]))


def write_segment_marker(outdir: Path, params: dict, segment: tuple[int, int], target: int, step: int,
                         num_steps: int, tokens_seen: int) -> None:
    """`outdir/segments/K.json` (atomically): segment K of N reached its target step (a checkpoint there)."""
    path = segment_marker(outdir, segment)
    path.parent.mkdir(parents=True, exist_ok=True)
    view = run_config(params)
    write_json(path, {"stage": view.stage["name"], "segment": segment[0], "of": segment[1],
                      "target_step": target, "step": step, "num_steps": num_steps, "tokens_seen": tokens_seen,
                      "meta": provenance("train", params)})
    log.info("segment %d/%d of stage %s reached step %d (target %d of %d): %s", *segment, view.stage["name"],
             step, target, num_steps, path)


def reached_checkpoint(ckpt_dir: Path, params: dict) -> dict | None:
    """The train state of the newest step checkpoint if this config would resume it, read without loading or
    verifying its tensors (a file's are memory-mapped, a sharded one's stay in its DCP files); None otherwise.
    For a segment already done (below): should that checkpoint prove unreadable, the next segment's resume
    takes the one before it and trains through, so nothing is lost but time."""
    newest = ckpt.step_checkpoints(ckpt_dir)[:1]
    if not newest:
        return None
    try:
        state = ckpt.load_step_checkpoint(newest[0], verify=False)
    except PipelineError:
        return None
    return None if ckpt.resume_mismatch(state, params) else state


# ----------------------------------------------------------------------------- the run

def finish(outdir: Path, dist: Dist, model: Transformer, params: dict, plan: StepPlan, layout: BatchLayout,
           state: ckpt.TrainState, total_rows: int | None = None) -> dict:
    """Check the token count against the plan, then write summary.json and (last) final.pt. In rows
    mode (an epochs budget) the count includes the last step's empty rows (`empty_rows`)."""
    planned = plan.num_steps * layout.tokens_per_step
    rows_read = plan.num_steps * layout.rows_per_step
    view = run_config(params)
    summary = {
        "stage": view.stage["name"],
        "init_from": view.stage["init_from"],
        "loss": view.stage["loss"],
        "empty_rows": 0 if total_rows is None else rows_read - total_rows,
        "tokens_trained": state.tokens_seen,
        "tokens_planned": planned,
        "loss_tokens": state.loss_tokens,
        "num_steps": plan.num_steps,
        "tokens_per_step": layout.tokens_per_step,
        "world_size": dist.world_size,
        "final_val_loss": state.last_val_loss,
        "best_val_loss": state.best_val_loss,
    }
    if state.tokens_seen != planned:
        raise PipelineError(f"trained {state.tokens_seen} tokens but the plan says num_steps × tokens_per_step = "
                            f"{planned}; the loader or the plan is inconsistent — not writing final.pt")
    weights = ckpt.full_model_state(model)  # fsdp: gathered to rank 0 (a collective), on the CPU
    if dist.is_main:
        write_json(outdir / "summary.json", {**summary, "meta": provenance("train", params)})
        save_checkpoint(outdir / "final.pt", {"model": weights, "params": params, "plan": dataclasses.asdict(plan),
                                              "summary": summary, "versions": versions()})
        log.info("trained %d tokens in %d steps (= plan); final val loss %.4f", state.tokens_seen,
                 plan.num_steps, state.last_val_loss)
    return summary


def train(params: dict, plan: StepPlan, train_meta: str, val_meta: str, tokenizer_path: str, outdir: str,
          resume: str | None = None, max_steps: int | None = None, keep_ckpts: int = 2,
          eval_data: str | None = None, init: str | None = None, segment: tuple[int, int] = (1, 1)) -> dict | None:
    """Run (or resume) one training stage (`params` from `stage_config`; a whole run config trains its
    first stage), or job K of its N (`segment`: to step ceil(K × num_steps / N)). Returns the run summary,
    or None when the job ended before the stage's end (`max_steps`, a segment K < N). Raises
    `pipeline.training.stopping.Stopped` after a clean stop before the target (a deadline, a signal: the
    CLI exits 75).

    `resume` (auto | require | never) defaults to `train.resume`. The process that writes the outputs
    (rank 0) holds the folder's lease (`pipeline.training.lease`) throughout: a second trainer on `outdir`, on
    this host or another, fails at once.
    """
    view = run_config(params)
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else int(os.environ.get("RANK", 0))
    lock = Lease(outdir).acquire() if rank == 0 else None
    try:
        return _train(params, plan, train_meta, val_meta, tokenizer_path, outdir,
                      resume or view.train.resume, max_steps, keep_ckpts, eval_data, init, segment, rank)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class Run:
    """What the loop works with, made by `set_up`: the stage's params and plan (its num_steps filled),
    the batch layout, the process group, the model, optimizer and loaders, the tokenizer (samples,
    CORE) and the CORE tasks (and, in a chat stage, the ChatCORE tasks)."""

    params: dict
    plan: StepPlan
    layout: BatchLayout
    dist: Dist
    model: Transformer
    optimizer: torch.optim.Optimizer
    loader: PackedLoader
    val_meta: str
    tokenizer: Tokenizer
    core_every: int
    core_tasks: dict | None
    chat_tasks: dict | None
    total_rows: int | None  # rows to read (an epochs budget), else None


def set_up(params: dict, plan: StepPlan, train_meta: str, val_meta: str, tokenizer_path: str,
           eval_data: str | None, dist: Dist) -> Run:
    """Check the plan, the data and the tokenizer against the stage, and build the model, optimizer and
    loaders (fresh: `pipeline.training.checkpoint.resume` then loads a checkpoint into them)."""
    view = run_config(params)
    layout = BatchLayout.from_config(view)
    plan = StepPlan.from_plan(plan)
    check_plan(plan, layout, dist)
    if dist.device.type == "cuda" and dist.is_main:
        check_gpu_type(params, dist.device)
    num_steps, total_rows = stage_steps(params, layout, train_meta)
    plan = dataclasses.replace(plan, num_steps=num_steps, stage=view.stage["name"])
    set_matmul_precision(ce_matmul(params))

    seed_everything(view.seed)
    fsdp = parallelism(params, dist) == "fsdp"  # sharded before initialisation: each rank writes its shards
    model = build_model(params, dist.device, dist if fsdp else None, use_compile(params, dist.device))
    optimizer = build_optimizer(model, view.train, dist.device.type)
    st = view.stage
    loader = PackedLoader(train_meta, layout.micro_batch, rank=dist.rank, world_size=dist.world_size,
                          seed=view.seed, shuffle=True, loss=st["loss"], with_doc_ids=st["doc_mask"],
                          total_rows=total_rows)
    if total_rows is None:
        check_data(loader, plan, layout, params, train_meta)
    val_loader(val_meta, params, layout, dist)  # fails now, not at the first validation, if val is too small
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.n_vocab > view.model.vocab_size:
        raise PipelineError(f"{tokenizer_path} has {tokenizer.n_vocab} token ids but model.vocab_size is "
                            f"{params['model']['vocab_size']}: set model.vocab_size to at least {tokenizer.n_vocab}")
    core_every = view.eval.core_interval if eval_data is not None else 0
    core_tasks = core_benchmark.load_tasks(eval_data, view.eval.tasks) if core_every else None
    chat_tasks = (core_benchmark.load_tasks(eval_data, view.eval.chat_tasks, chat=True)
                  if core_every and view.eval.chat_tasks and is_chat_stage(view) else None)
    return Run(params, plan, layout, dist, model, optimizer, loader, val_meta, tokenizer, core_every, core_tasks,
               chat_tasks, total_rows)


def run_steps(run: Run, state: ckpt.TrainState, metrics: MetricsLogger | None, stop_at: int, control: StopControl,
              checkpointer: ckpt.Checkpointer) -> tuple[weakref.ref, bool]:
    """Train steps state.step + 1 .. stop_at, updating `state`: log, validate, score CORE and checkpoint
    on their intervals (`Schedule`; `checkpointer.save`, the caller waits for the last save:
    `Checkpointer.close`), and stop cleanly at a step
    boundary when the ranks agree to (pipeline/training/stopping.py: a checkpoint there). Returns a weak
    reference to the DDP module, or under fsdp to the loss model (for `close_distributed`), and whether the
    run stopped before `stop_at`."""
    params, plan, dist, model, optimizer = run.params, run.plan, run.dist, run.model, run.optimizer
    view = run_config(params)
    train_cfg, num_steps, accum = view.train, plan.num_steps, run.layout.grad_accum_steps
    sched, clock, allow, watchdog = Schedule.of(params, num_steps, run.core_every), control.clock, control.allow, \
        control.watchdog
    peak = peak_flops(view)
    loss_model = LossModel(model, autocast_dtype(params, dist.device), train_cfg.ce_chunk_tokens, ce_matmul(params))
    ddp, fwd = wrap(loss_model, dist, use_compile(params, dist.device))
    ref = weakref.ref(fwd if ddp is model else ddp)  # fsdp: no DDP module; the loss model is freed here

    def cost(done: int, with_save: bool = True) -> float:  # seconds of step `done` and what is due at it
        return clock.cost(sched.is_val(done), sched.is_core(done), with_save and sched.is_ckpt(done))

    # Before the first step: is there time for its checkpoint, and has no one asked to stop (one all-reduce per
    # job)? A job measures its own steps before it trusts the clock with them: until then only the save and the
    # margin count (a prediction far above the real step would otherwise stop every attempt before a step).
    if state.step < stop_at:
        flag = torch.tensor([int(control.vote(0.0))], device=dist.device)
        if int(all_reduce_sum(flag, dist)[0]):
            return ref, True
    trainable = [p for p in model.parameters() if p.requires_grad]
    watched = watched_groups(model)
    prompt = (view.eval.prompts or [""])[0]
    steps = StepBatches(run.loader, accum, dist)  # pinned, read one step ahead; its state is the consumed one
    counted = torch.zeros(2, dtype=torch.int64, device=dist.device)  # [targets, inputs] since the start
    base_tokens, base_loss_tokens = state.tokens_seen, state.loss_tokens
    mark_time, mark_tokens = time.perf_counter(), state.tokens_seen
    log.info("training steps %d..%d of %d: %d tokens/step = %d micro-steps × %d rows × %d tokens × world %d",
             state.step + 1, stop_at, num_steps, run.layout.tokens_per_step, accum, run.layout.micro_batch,
             train_cfg.seq_len, dist.world_size)

    model.train()
    first, after = state.step, 0.0  # after: the allowance of the last step's phases (others wait for rank 0's)
    stopped = False
    for step in range(state.step, stop_at):
        done = step + 1
        began = time.perf_counter()
        watchdog.beat(done, "first step" if step == first else "step", allow["first step" if step == first else
                                                                             "step"] + after)
        # The vote cast now is read after this step: a stop comes after it, so look two steps ahead.
        vote = done < stop_at and control.vote(cost(done) + cost(done + 1, with_save=False) if clock.steps else 0.0)
        batches, counts = steps.next_step(vote)  # counts: global [target tokens, input tokens] of this step
        set_lr(optimizer, lr_factor(step, num_steps, train_cfg))
        local_loss = accumulate_gradients(ddp, fwd, batches, counts[0], dist.world_size)
        is_val, is_core, is_log = sched.is_val(done), sched.is_core(done), sched.is_log(done)

        record = group_norms(watched, "grad_norm", grads=True) if is_log else {}
        grad_norm = clip_gradients(trainable, train_cfg.grad_clip)
        update = UpdateRatio(watched) if is_log else None
        optimizer.step()
        zero_gradients(optimizer)  # keeps DDP's bucket views (see zero_gradients)
        stopped = done < stop_at and steps.stop_agreed()  # every rank: the same all-reduced votes
        is_ckpt = sched.is_ckpt(done) or done == stop_at or stopped
        counted += counts
        state.step = done
        if is_log or is_ckpt:  # host sync only when needed
            state.tokens_seen, state.loss_tokens = base_tokens + int(counted[1]), base_loss_tokens + int(counted[0])

        if is_log:
            loss = all_reduce_sum(local_loss.double(), dist) / counts[0].clamp(min=1)
            tps = (state.tokens_seen - mark_tokens) / max(time.perf_counter() - mark_time, 1e-9)
            record = {"step": done, "tokens": state.tokens_seen, "loss": float(loss), "grad_norm": float(grad_norm),
                      **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups}, **record,
                      **group_norms(watched, "param_norm"), **update.ratios(), "tokens_per_s": tps,
                      "mfu": mfu(plan.flops_per_token, tps, dist.world_size, peak), **memory_stats(dist.device)}
        update = None  # its snapshot (the watched weights) is not held through validation and CORE scoring
        phases, after = 0.0, 0.0
        if is_val:
            watchdog.beat(done, "validation", allow["validation"])
            t = time.perf_counter()
            model.eval()
            with gathered(model):  # fsdp: whole on every rank, so rank 0 alone can score and sample
                state.last_val_loss, fixed = validate(model, run.val_meta, params, run.layout, dist)
                state.best_val_loss = min(state.best_val_loss, state.last_val_loss)
                record["val_loss"] = state.last_val_loss
                if dist.is_main and fixed is not None:
                    record.update(fixed_batch_stats(model, fixed, train_cfg.ce_chunk_tokens))
                    record["sample"] = greedy_sample(model, run.tokenizer, prompt, view.eval.max_new_tokens,
                                                     dist.device, autocast_dtype(params, dist.device))
            model.train()
            clock.val_s = time.perf_counter() - t
            phases, after = phases + clock.val_s, after + allow["validation"]
        if is_core:  # every rank scores its share of the items (evaluate_tasks restores train mode)
            watchdog.beat(done, "core", allow["core"])
            t = time.perf_counter()
            with gathered(model):
                record.update(core_benchmark.core_record(core_benchmark.evaluate_tasks(
                    model, run.tokenizer, run.core_tasks, dist=dist,
                    **core_benchmark.core_settings(params, "core_interval_items"))))
                if run.chat_tasks:
                    record.update(chat_core.chat_record(chat_core.evaluate_chat(
                        model, run.tokenizer, run.chat_tasks, dist=dist,
                        **chat_core.chat_settings(params, "core_interval_items"))))
            clock.core_s = time.perf_counter() - t
            phases, after = phases + clock.core_s, after + allow["core"]
        if is_log and dist.is_main:
            metrics.log(record)
        if is_ckpt:
            watchdog.beat(done, "checkpoint", allow["checkpoint"])
            t = time.perf_counter()
            state.wandb_id = metrics.wandb_id if metrics else None
            checkpointer.save(model=model, optimizer=optimizer, loader=steps, params=params,
                              plan=dataclasses.asdict(plan), state=state)
            clock.save_s = checkpointer.save_s  # what a save costs a job that must end right after it
            phases, after = phases + checkpointer.blocked_s, after + allow["checkpoint"]
        if is_log:  # throughput excludes validation and checkpoint time; memory peaks are per interval
            mark_time, mark_tokens = time.perf_counter(), state.tokens_seen
            if dist.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dist.device)
        clock.step_done(time.perf_counter() - began - phases)
        if stopped:
            break
    steps.close()
    return ref, stopped


def _train(params: dict, plan: StepPlan, train_meta: str, val_meta: str, tokenizer_path: str, outdir: str,
           resume: str, max_steps: int | None, keep_ckpts: int, eval_data: str | None,
           init: str | None, segment: tuple[int, int], rank: int) -> dict | None:
    """Set up, resume or start afresh, train to the segment's target (`max_steps` at most), finish."""
    if "stage" not in params:  # a whole run config: its first stage
        view = run_config(params)
        params = stage_config(view, stage_names(view)[0])
    params = plain(resolve_ckpt_interval(run_config(with_init(params, init))))  # plain data, as the job's params
    outdir = Path(outdir)
    ckpt_dir = outdir / "ckpt"
    if segment[0] < segment[1] and resume != "never":  # a rerun of a segment done: no model, no process group
        num_steps = stage_steps(params, BatchLayout.from_config(run_config(params)), train_meta)[0]
        target = segment_target(segment, num_steps)
        reached = reached_checkpoint(ckpt_dir, params)
        if reached is not None and reached["step"] >= target:
            log.info("%s is at step %d: segment %d/%d (to step %d) has nothing to train", ckpt_dir, reached["step"],
                     *segment, target)
            if rank == 0:
                write_segment_marker(outdir, params, segment, target, reached["step"], num_steps,
                                     reached["tokens_seen"])
            return None
    control = StopControl(params, rank)  # the watchdog watches from here
    try:
        return _run(params, plan, train_meta, val_meta, tokenizer_path, outdir, resume, max_steps, keep_ckpts,
                    eval_data, init, segment, control)
    finally:
        control.close()


def _run(params: dict, plan: StepPlan, train_meta: str, val_meta: str, tokenizer_path: str, outdir: Path,
         resume: str, max_steps: int | None, keep_ckpts: int, eval_data: str | None, init: str | None,
         segment: tuple[int, int], control: StopControl) -> dict | None:
    view = run_config(params)
    dist = init_distributed(view.hardware.device, view.hardware.process_group_timeout_min)
    timeout_s = 60 * view.hardware.process_group_timeout_min
    if dist.distributed and dist.is_main and timeout_s < max(control.allow.values()):
        log.warning("hardware.process_group_timeout_min (%g) is below the watchdog's longest allowance (%.0f s): "
                    "a collective may time out before the watchdog names the hung phase",
                    view.hardware.process_group_timeout_min, max(control.allow.values()))
    ckpt_dir = outdir / "ckpt"
    run = set_up(params, plan, train_meta, val_meta, tokenizer_path, eval_data, dist)
    checkpointer = ckpt.Checkpointer(ckpt_dir, dist, keep_ckpts, async_save=view.train.async_ckpt)
    state = checkpointer.resume(resume, model=run.model, optimizer=run.optimizer, loader=run.loader, params=params,
                                init=init)
    metrics = None
    if dist.is_main:
        metrics = MetricsLogger(outdir / "metrics.jsonl", view.wandb, outdir, params, view.run_name,
                                resume_step=state.step or None, wandb_id=state.wandb_id)
    num_steps = run.plan.num_steps
    target = segment_target(segment, num_steps)
    stop_at = target if max_steps is None else min(max_steps, target)

    try:
        ddp_ref, stopped = run_steps(run, state, metrics, stop_at, control, checkpointer)
        control.watchdog.beat(state.step, "checkpoint", control.allow["checkpoint"])
        checkpointer.close()  # every rank: the last checkpoint complete (fsdp: finalized, a collective) before final.pt
    except BaseException:
        checkpointer.abort()  # this rank alone, no collective: its background write ends; the error is the one raised
        raise

    expected = Schedule.of(params, num_steps, run.core_every).last_logged(state.step)
    if metrics and (metrics.steps[-1] if metrics.steps else None) != expected:
        raise PipelineError(f"{metrics.path} ends at step {metrics.steps[-1] if metrics.steps else None}, not at "
                            f"step {expected}: the metric history of this run is incomplete (was it written by "
                            "another process?); rerun with train.resume: never to train again from scratch")
    control.watchdog.beat(state.step, "finish", control.allow["finish"])
    summary = None
    if stopped:
        log.warning("stopped at step %d of this job's target %d (stage %d steps; %s): the next attempt resumes from "
                    "step %d", state.step, stop_at, num_steps, control.reason or "another rank asked",
                    state.step)
    elif state.step == num_steps:
        summary = finish(outdir, dist, run.model, params, run.plan, run.layout, state, run.total_rows)
    elif state.step >= target:
        if dist.is_main:
            write_segment_marker(outdir, params, segment, target, state.step, num_steps, state.tokens_seen)
    else:
        log.info("stopped after step %d of %d (--max-steps); rerun with --resume auto to continue", stop_at, num_steps)
    if metrics:
        metrics.close()
    close_distributed(dist, ddp_ref)  # its barrier: no rank exits before rank 0 has written
    if stopped:
        raise Stopped(state.step, stop_at, control.reason or "another rank asked")
    return summary


def main(argv=None) -> None:
    die_with_parent()  # first: a worker whose launcher is killed must not train on, orphaned
    SIGNALS.install()  # SIGUSR1 / SIGTERM: stop at the next step boundary (pipeline/training/stopping.py)
    register_worker(os.environ.get("RANK", ""))  # the supervisor may now send it SIGUSR1
    p = argparse.ArgumentParser(prog="python -m pipeline.training.train", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--plan", default=None, help="R/plan.json (default: the batch layout and FLOPs per token of "
                                                 "the params, pipeline.planning.compute: what the plan computes)")
    p.add_argument("--train", required=True, help="packed train rows metadata, R/pack/{mix}/train.json")
    p.add_argument("--val", required=True, help="packed validation rows metadata, R/pack/{mix}/val.json")
    p.add_argument("--tokenizer", required=True, help="R/tokenizer/encoding.json")
    p.add_argument("--outdir", required=True, help="R/train/{stage}")
    p.add_argument("--stage", default=None, help="with --configfile: the stage of train.stages to train (default "
                                                   "the first); --params from the rule already name it")
    p.add_argument("--init", default=None, help="R/train/{init_from}/final.pt for a stage with init_from")
    p.add_argument("--resume", choices=("auto", "require", "never"), default=None,
                   help="default train.resume. auto: continue from the newest readable checkpoint in outdir/ckpt "
                        "when it matches this run's config (at any world size: resharded), else move it aside and "
                        "start over; "
                        "require: continue or fail; never: start over")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps, leaving a checkpoint and no final.pt (testing)")
    p.add_argument("--keep-ckpts", type=int, default=2, help="step checkpoints kept on disk (newest)")
    p.add_argument("--eval-data", help="R/eval_data: score a CORE subset every eval.core_interval steps")
    p.add_argument("--segment", type=parse_segment, default=(1, 1), metavar="K/N",
                   help="job K of the N that train the stage: to step ceil(K × num_steps / N), then (K < N) "
                        "outdir/segments/K.json and no final.pt (default 1/1)")
    args = p.parse_args(argv)
    params = params_from_args(args, train_slice)
    if "stage" not in params:
        view = run_config(params)
        params = stage_config(view, args.stage or stage_names(view)[0])
    plan = StepPlan.from_plan(read_json(args.plan)) if args.plan is not None else StepPlan.of(run_config(params))
    try:
        train(params, plan, args.train, args.val, args.tokenizer, args.outdir,
              resume=args.resume, max_steps=args.max_steps, keep_ckpts=args.keep_ckpts, eval_data=args.eval_data,
              init=args.init, segment=args.segment)
    except Stopped:
        report_exit(EXIT_STOPPED)
        raise SystemExit(EXIT_STOPPED) from None
    report_exit(0)


if __name__ == "__main__":
    run_cli(main)
