"""Train stage: DDP (+ torch.compile) training of the Llama-3-style model on the packed rows.

Launch (the `train` rule; `--nproc_per_node` = `hardware.nproc_per_node`)::

    torchrun --standalone --nproc_per_node N -m pipeline.train --params JSON --plan R/plan.json \\
        --train R/pack/M/train.json --val R/pack/M/val.json --tokenizer R/tokenizer/tokenizer.json \\
        --outdir R/train [--resume auto|never] [--max-steps K] [--keep-ckpts 2]

Without torchrun it runs as a single process (world size 1, no process group). Under torchrun the
process group is gloo on CPU and nccl on CUDA (one GPU per local rank).

What runs, per optimizer step (`plan.grad_accum_steps` micro-steps of `plan.micro_batch` rows per
rank; `plan.num_steps` steps):

* **Model**: `LossModel` = the transformer body (`Transformer.hidden`) under bf16 autocast on CUDA
  when `train.precision` is bf16 (CPU always runs fp32), followed by `chunked_cross_entropy`
  *outside* autocast: fp32 logits, chunked over `train.ce_chunk_tokens` tokens
  (pipeline/losses.py). DDP wraps `LossModel` first, then `torch.compile` wraps DDP
  (`train.compile`: auto = on for CUDA, off on CPU). With bf16 on CUDA, fp32 matmuls may use TF32.
* **Loss normalisation**: before the micro-steps each rank counts the target tokens of its
  micro-batches (the loss mask's ones, or every target), and one all-reduce gives the global count
  N. Each micro-step backpropagates ``loss_sum × world_size / N``; DDP averages gradients over the
  ranks (÷ world_size), so the final gradient is exactly the gradient of
  ``Σ per-token loss / N`` over the global batch — masked tokens, uneven masks across ranks and
  micro-steps included. `model.no_sync()` skips the gradient all-reduce on all but the last
  micro-step. The logged `loss` is the same global mean.
* **Token count**: the same all-reduce sums the input tokens of the step; the total trained must
  equal ``plan.num_steps × plan.tokens_per_step`` at the end (checked; the run fails otherwise).
* **Optimizer**: pipeline/optim.py (AdamW / Muon / 8-bit AdamW, per-group LRs, warmup + cosine or
  WSD), gradient clipping at `train.grad_clip` (global norm before clipping is logged).
* **Checkpoints** every `train.ckpt_interval` steps, at `--max-steps` and at the end
  (pipeline/checkpoint.py); `--resume auto` continues from `outdir/ckpt/latest` exactly: same
  per-step losses as an uninterrupted run (bitwise on CPU). A checkpoint made with a different
  config (other than the logging keys in `OBSERVABILITY_KEYS`) or world size is never resumed:
  `auto` moves it aside to `ckpt/stale-<time>/` and starts over (a Snakemake rerun after a config
  edit), `--resume require` fails instead.
* **Metrics**: pipeline/metrics.py (JSONL + wandb), validation every `train.val_interval` steps.

Outputs: `outdir/final.pt` (written last: model state dict, params, plan, tokens trained, final
validation loss; `torch.load(..., weights_only=True)`), `outdir/metrics.jsonl`, `outdir/ckpt/`,
`outdir/summary.json` (token accounting of the run), `outdir/wandb/`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline import checkpoint as ckpt
from pipeline.config import add_config_args, params_from_args
from pipeline.io import PipelineError, get_logger, provenance, read_json, run_cli, write_json
from pipeline.losses import chunked_cross_entropy, chunked_eval_stats
from pipeline.metrics import MetricsLogger, UpdateRatio, group_norms, memory_stats, mfu, watched_groups
from pipeline.model import ModelConfig, Transformer
from pipeline.optim import build_optimizer, lr_factor, set_lr
from pipeline.plan import peak_flops

log = get_logger(__name__)

FIXED_BATCH_ROWS = 8  # rows of the fixed validation batch behind ce_fp32 / top1_acc

# Config keys that change what is logged but not the training trajectory: a checkpoint made under
# other values of these may be resumed.
OBSERVABILITY_KEYS = {
    "wandb": None,
    "eval": None,
    "hardware": ("assumed_mfu", "gpu_memory_gb"),
    "train": ("log_interval", "val_interval", "val_batches", "ckpt_interval"),
}


# ----------------------------------------------------------------------------- processes

@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # this process created the process group (and destroys it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return torch_dist.is_available() and torch_dist.is_initialized()


def init_distributed(device_type: str) -> Dist:
    """Join the torchrun job (gloo on CPU, nccl on CUDA; one GPU per local rank), use a process
    group the caller already initialised, or run alone (world size 1, no process group)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PipelineError("hardware.device is cuda but no CUDA device is visible; set hardware.device: cpu")
    joined = torch_dist.is_initialized()
    if not joined and "RANK" not in os.environ:
        return Dist(0, 0, 1, torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not joined:
        backend = "nccl" if device_type == "cuda" else "gloo"
        torch_dist.init_process_group(backend=backend, device_id=device if device_type == "cuda" else None)
    return Dist(torch_dist.get_rank(), local_rank, torch_dist.get_world_size(), device, owns_group=not joined)


def all_reduce_sum(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.distributed:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t


def close_distributed(dist: Dist, ddp_ref: weakref.ref) -> None:
    """End of training: a barrier, then free the DDP module (`ddp_ref`; the caller has dropped its
    references), then destroy the process group if this process created it.

    The order matters. The DDP reducer holds a reference to the process group, and pybind frees the
    reducer without releasing the GIL. Were the reducer the group's last holder, ~ProcessGroupGloo
    would join gloo's worker threads under the GIL while a worker waits for the GIL to free a
    finished collective's tensors (those whose Python objects are gone, as all_gather_object's
    are): a deadlock at exit, seen in about one 2-process run in fifteen. Freed first (by refcount,
    else by the cycle collector, else after dropping torch.compile's caches), the module leaves the
    group's own Python object as its last holder, and that one's destructor releases the GIL.
    """
    if not dist.distributed:
        return
    if dist.owns_group:
        torch_dist.barrier()
    if ddp_ref() is not None:  # not freed by refcount alone: reference cycles
        gc.collect()
    if ddp_ref() is not None:  # held by torch.compile's caches
        torch._dynamo.reset()
        gc.collect()
    if ddp_ref() is not None:
        log.warning("the DDP module is still referenced after training; destroying the process group may hang")
    if dist.owns_group:
        torch_dist.destroy_process_group()


def gather_objects(obj, dist: Dist) -> list:
    """`obj` of every rank, indexed by rank (a collective: every rank must call it)."""
    if not dist.distributed:
        return [obj]
    out = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ----------------------------------------------------------------------------- model

def autocast_dtype(cfg: dict, device: torch.device) -> torch.dtype | None:
    """bf16 for the body on CUDA when train.precision is bf16; None (fp32) otherwise."""
    return torch.bfloat16 if device.type == "cuda" and cfg["train"]["precision"] == "bf16" else None


def set_matmul_precision(body_dtype: torch.dtype | None) -> None:
    """With a bf16 body, fp32 matmuls (the CE's logits) may use TF32 tensor cores: inputs rounded to
    10 mantissa bits, fp32 accumulation and fp32 output. An fp32 run keeps full fp32 matmuls."""
    torch.set_float32_matmul_precision("high" if body_dtype is not None else "highest")


def use_compile(cfg: dict, device: torch.device) -> bool:
    setting = cfg["train"]["compile"]
    return device.type == "cuda" if setting == "auto" else bool(setting)


def apply_fp8(model: Transformer, recipe: str) -> None:
    """Swap the blocks' linears for torchao Float8Linear (`tensorwise` or `rowwise` scaling).
    Master weights stay fp32; linears whose dims are not multiples of 16 are left alone."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise PipelineError("train.fp8 needs the torchao package: pip install torchao "
                            "(or set train.fp8: none)") from None

    def fits(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model.layers, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=fits)


def build_model(cfg: dict, device: torch.device) -> Transformer:
    """The transformer of `cfg` (initialised on CPU from the current torch seed, then moved), with
    fp8 linears when `train.fp8` asks for them."""
    model = Transformer(ModelConfig.from_config(cfg)).to(device)
    fp8 = cfg["train"]["fp8"]
    if fp8 != "none":
        if device.type != "cuda":
            raise PipelineError("train.fp8 needs hardware.device: cuda")
        apply_fp8(model, fp8)
    return model


class LossModel(nn.Module):
    """What DDP wraps and torch.compile compiles: the body under autocast, then the fp32 chunked CE
    (which always runs eagerly, a graph break; see pipeline/losses.py).

    forward(inputs, targets, mask=None) -> (loss_sum, count).
    """

    def __init__(self, model: Transformer, body_dtype: torch.dtype | None, ce_chunk: int):
        super().__init__()
        self.model = model
        self.body_dtype = body_dtype
        self.ce_chunk = ce_chunk

    def forward(self, inputs, targets, mask=None):
        dtype, on = self.body_dtype or torch.float32, self.body_dtype is not None
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=on):
            hidden = self.model.hidden(inputs)
        return chunked_cross_entropy(hidden, self.model.lm_head_weight, targets, mask, chunk=self.ce_chunk)


def wrap(loss_model: LossModel, dist: Dist, compile_model: bool) -> tuple[nn.Module, nn.Module]:
    """(ddp, fwd): DDP around the loss model when a process group exists, then torch.compile
    around that. `fwd` is what to call; `ddp` owns `no_sync`."""
    ddp = loss_model
    if dist.distributed:
        ids = [dist.local_rank] if dist.device.type == "cuda" else None
        ddp = DDP(loss_model, device_ids=ids, gradient_as_bucket_view=True)
    fwd = torch.compile(ddp) if compile_model else ddp
    return ddp, fwd


# ----------------------------------------------------------------------------- one step

def next_micro_batches(it, n: int, device: torch.device) -> list[tuple]:
    """The next `n` (inputs, targets, mask-or-None) micro-batches, on `device`."""
    out = []
    for _ in range(n):
        x, y, m = next(it)
        nb = device.type == "cuda"
        out.append((x.to(device, non_blocking=nb), y.to(device, non_blocking=nb),
                    None if m is None else m.to(device, non_blocking=nb)))
    return out


def count_tokens(batches: list[tuple], dist: Dist) -> torch.Tensor:
    """Global [target tokens, input tokens] of one step's micro-batches (one all-reduce)."""
    device = batches[0][0].device
    targets = sum(int(y.numel()) if m is None else m.sum() for _, y, m in batches)
    inputs = sum(int(x.numel()) for x, _, _ in batches)
    counts = torch.stack([torch.as_tensor(targets, device=device, dtype=torch.int64),
                          torch.tensor(inputs, device=device, dtype=torch.int64)])
    return all_reduce_sum(counts, dist)


def accumulate_gradients(ddp: nn.Module, fwd: nn.Module, batches: list[tuple], n_targets: torch.Tensor,
                         world_size: int) -> torch.Tensor:
    """Forward/backward over the micro-batches so that, after DDP's averaging, the gradients are
    those of (global loss sum) / n_targets. Returns this rank's loss sum (detached)."""
    scale = world_size / n_targets.clamp(min=1).to(torch.float32)
    local_sum = torch.zeros((), device=batches[0][0].device)
    for i, (x, y, m) in enumerate(batches):
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last or not isinstance(ddp, DDP) else ddp.no_sync()
        with sync:
            loss_sum, _ = fwd(x, y, m)
            (loss_sum * scale).backward()
        local_sum += loss_sum.detach()
    return local_sum


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm (before clipping); grads are scaled down to `max_norm` when > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# ----------------------------------------------------------------------------- validation

@torch.no_grad()
def validate(model: Transformer, val_meta: str, cfg: dict, plan: dict, dist: Dist) -> tuple[float, tuple | None]:
    """Mean CE over up to `train.val_batches` validation micro-batches per rank, the training
    precision (all ranks; one all-reduce). Also returns rank's first batch (the fixed batch)."""
    from pipeline.loader import DataExhausted

    t = cfg["train"]
    loss_model = LossModel(model, autocast_dtype(cfg, dist.device), t["ce_chunk_tokens"])
    loader = val_loader(val_meta, cfg, plan, dist)
    totals = torch.zeros(2, device=dist.device, dtype=torch.float64)
    first = None
    it = iter(loader)
    for _ in range(t["val_batches"]):
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
    good in lower precision. (Few rows: fp32 attention may fall back to a kernel that materialises
    the T×T scores.)"""
    x, y, m = (None if t is None else t[:FIXED_BATCH_ROWS] for t in batch)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(x.device.type, enabled=False):
            hidden = model.hidden(x)
        s = chunked_eval_stats(hidden, model.lm_head_weight, y, m, chunk=chunk)
    finally:
        torch.set_float32_matmul_precision(precision)
    return {"ce_fp32": s["loss_sum"] / s["count"], "top1_acc": s["correct"] / s["count"]}


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the model saw documents start: BOS first (every delimiter policy reserves it)."""
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


@torch.no_grad()
def greedy_sample(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
    out = model.generate(ids, max_new_tokens, temperature=0.0)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:].tolist())


# ----------------------------------------------------------------------------- checks

def check_plan(plan: dict, cfg: dict, dist: Dist) -> None:
    """The plan must describe this launch: world size, micro-batch and tokens per step."""
    t = cfg["train"]
    if plan["world_size"] != dist.world_size:
        raise PipelineError(
            f"launched with {dist.world_size} process(es) but the plan is for world_size {plan['world_size']} "
            "(hardware.nproc_per_node × hardware.nodes); launch with that many or re-plan"
        )
    per_step = plan["micro_batch"] * t["seq_len"] * plan["grad_accum_steps"] * dist.world_size
    if per_step != plan["tokens_per_step"]:
        raise PipelineError(
            f"plan tokens_per_step {plan['tokens_per_step']} != micro_batch × seq_len × grad_accum × world "
            f"= {per_step}; the plan was made for another config — rerun the plan rule"
        )


def check_data(loader, plan: dict, cfg: dict, train_meta: str) -> None:
    """Fail before training when the packed rows cannot supply the planned steps."""
    have = loader.steps_available(plan["micro_batch"] * loader.world_size * plan["grad_accum_steps"])
    if have < plan["num_steps"]:
        meta, mix = loader.meta, cfg["train"]["mix"]
        raise PipelineError(
            f"{train_meta}: {meta['n_rows']} packed rows ({meta['tokens_packed']} tokens of mix '{mix}') supply "
            f"{have} steps of {plan['tokens_per_step']} tokens, but the plan needs {plan['num_steps']} steps "
            f"({plan['num_steps'] * plan['tokens_per_step']} tokens, the target); give the mix more tokens "
            f"(mixes.{mix}.tokens) or lower train.target_tokens"
        )


def val_loader(val_meta: str, cfg: dict, plan: dict, dist: Dist):
    """A fresh, unshuffled loader over the validation rows (the same rows every time)."""
    from pipeline.loader import PackedLoader

    return PackedLoader(val_meta, plan["micro_batch"], rank=dist.rank, world_size=dist.world_size,
                        seed=cfg["seed"], shuffle=False)


def trajectory_params(params: dict) -> dict:
    """`params` without the OBSERVABILITY_KEYS (what must match for a resume to be exact)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    for section, keys in OBSERVABILITY_KEYS.items():
        if keys is None:
            out.pop(section, None)
        elif section in out:
            for k in keys:
                out[section].pop(k, None)
    return out


def resume_mismatch(state: dict, params: dict, dist: Dist) -> str | None:
    """Why a checkpoint cannot be resumed exactly by this launch, or None when it can."""
    if state["world_size"] != dist.world_size:
        return f"it was written by {state['world_size']} process(es), this launch has {dist.world_size}"
    old, new = trajectory_params(state["params"]), trajectory_params(params)
    if old != new:
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return f"it was made with a different config (sections differing: {', '.join(diff)})"
    return None


# ----------------------------------------------------------------------------- the run

def save_training_checkpoint(ckpt_dir: Path, dist: Dist, *, model, optimizer, loader, params: dict, plan: dict,
                             step: int, tokens_seen: int, loss_tokens: int, best_val_loss: float,
                             last_val_loss: float, wandb_id: str | None, keep: int) -> None:
    """Gather every rank's loader and RNG state, then rank 0 writes step_XXXXXX.pt and `latest`."""
    loaders = gather_objects(loader.state_dict(), dist)
    rngs = gather_objects(ckpt.rng_state(), dist)
    if not dist.is_main:
        return
    name = ckpt.checkpoint_name(step)
    ckpt.save_checkpoint(ckpt_dir / name, {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": {"step": step},
        "loader": loaders,
        "rng": rngs,
        "step": step,
        "tokens_seen": tokens_seen,
        "loss_tokens": loss_tokens,
        "best_val_loss": best_val_loss,
        "last_val_loss": last_val_loss,
        "world_size": dist.world_size,
        "wandb_id": wandb_id,
        "params": params,
        "plan": plan,
        "versions": ckpt.versions(),
    })
    ckpt.write_latest(ckpt_dir, name)
    ckpt.prune_checkpoints(ckpt_dir, keep)
    log.info("checkpoint %s", ckpt_dir / name)


def finish(outdir: Path, dist: Dist, model: Transformer, params: dict, plan: dict, tokens_trained: int,
           loss_tokens: int, best_val_loss: float, last_val_loss: float) -> dict:
    """Check the token count against the plan, then write summary.json and (last) final.pt."""
    planned = plan["num_steps"] * plan["tokens_per_step"]
    summary = {
        "tokens_trained": tokens_trained,
        "tokens_planned": planned,
        "loss_tokens": loss_tokens,
        "num_steps": plan["num_steps"],
        "tokens_per_step": plan["tokens_per_step"],
        "world_size": dist.world_size,
        "final_val_loss": last_val_loss,
        "best_val_loss": best_val_loss,
    }
    if tokens_trained != planned:
        raise PipelineError(f"trained {tokens_trained} tokens but the plan says num_steps × tokens_per_step = "
                            f"{planned}; the loader or the plan is inconsistent — not writing final.pt")
    if dist.is_main:
        write_json(outdir / "summary.json", {**summary, "meta": provenance("train", params)})
        ckpt.save_checkpoint(outdir / "final.pt", {"model": model.state_dict(), "params": params, "plan": plan,
                                                   "summary": summary, "versions": ckpt.versions()})
        log.info("trained %d tokens in %d steps (= plan); final val loss %.4f", tokens_trained, plan["num_steps"],
                 last_val_loss)
    return summary


def train(params: dict, plan: dict, train_meta: str, val_meta: str, tokenizer_path: str, outdir: str,
          resume: str = "auto", max_steps: int | None = None, keep_ckpts: int = 2) -> dict | None:
    """Run (or resume) training. Returns the run summary, or None when stopped early by `max_steps`."""
    from pipeline.loader import PackedLoader
    from pipeline.tokenizer import load_tokenizer

    t = params["train"]
    dist = init_distributed(params["hardware"]["device"])
    outdir, peak = Path(outdir), peak_flops(params)
    ckpt_dir = outdir / "ckpt"
    check_plan(plan, params, dist)
    num_steps, accum = plan["num_steps"], plan["grad_accum_steps"]
    stop_at = num_steps if max_steps is None else min(max_steps, num_steps)
    body_dtype = autocast_dtype(params, dist.device)
    set_matmul_precision(body_dtype)

    seed_everything(params["seed"])
    model = build_model(params, dist.device)
    optimizer = build_optimizer(model, t, dist.device.type)
    loader = PackedLoader(train_meta, plan["micro_batch"], rank=dist.rank, world_size=dist.world_size,
                          seed=params["seed"], shuffle=True)
    check_data(loader, plan, params, train_meta)
    val_loader(val_meta, params, plan, dist)  # fails now, not at the first validation, if val is too small
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.n_vocab > params["model"]["vocab_size"]:
        raise PipelineError(f"{tokenizer_path} has {tokenizer.n_vocab} token ids but model.vocab_size is "
                            f"{params['model']['vocab_size']}: set model.vocab_size to at least {tokenizer.n_vocab}")

    # ---- fresh start, or exact resume from the latest checkpoint
    start, tokens_seen, loss_tokens, best_val, last_val, wandb_id = 0, 0, 0, math.inf, math.nan, None
    latest = ckpt.latest_checkpoint(ckpt_dir) if resume != "never" else None
    state = ckpt.load_checkpoint(latest) if latest is not None else None
    stale = resume_mismatch(state, params, dist) if state is not None else None
    if stale:
        if resume == "require":
            raise PipelineError(f"{latest} cannot be resumed: {stale}; resume with the same config and "
                                "nproc_per_node, or pass --resume auto to start over")
        # A rerun after a config edit (what Snakemake does when the rule's params change) starts over;
        # the old checkpoints are kept aside, never silently resumed into a different run.
        log.warning("%s cannot be resumed (%s): starting over", latest, stale)
        state = None
    if dist.distributed:
        torch_dist.barrier()  # every rank has read the checkpoint before rank 0 moves it aside
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"][dist.rank])
        ckpt.set_rng_state(state["rng"][dist.rank])
        start, tokens_seen, loss_tokens = state["step"], state["tokens_seen"], state["loss_tokens"]
        best_val, last_val, wandb_id = state["best_val_loss"], state["last_val_loss"], state["wandb_id"]
        log.info("resumed from %s at step %d (%d tokens)", latest, start, tokens_seen)
        del state
    elif dist.is_main:
        if stale:
            log.warning("stale checkpoints moved to %s", ckpt.archive_checkpoints(ckpt_dir))
        ckpt.clear_checkpoints(ckpt_dir)
    metrics = None
    if dist.is_main:
        metrics = MetricsLogger(outdir / "metrics.jsonl", params["wandb"], outdir, params, params["run_name"],
                                resume_step=start if start else None, wandb_id=wandb_id)

    ddp, fwd = wrap(LossModel(model, body_dtype, t["ce_chunk_tokens"]), dist, use_compile(params, dist.device))
    trainable = [p for p in model.parameters() if p.requires_grad]
    watched = watched_groups(model)
    prompt = (params["eval"]["prompts"] or [""])[0]
    it = iter(loader)
    counted = torch.zeros(2, dtype=torch.int64, device=dist.device)  # [targets, inputs] since `start`
    base_tokens, base_loss_tokens = tokens_seen, loss_tokens
    mark_time, mark_tokens = time.perf_counter(), tokens_seen
    log.info("training steps %d..%d of %d: %d tokens/step = %d micro-steps × %d rows × %d tokens × world %d",
             start + 1, stop_at, num_steps, plan["tokens_per_step"], accum, plan["micro_batch"], t["seq_len"],
             dist.world_size)

    model.train()
    for step in range(start, stop_at):
        done = step + 1
        batches = next_micro_batches(it, accum, dist.device)
        counts = count_tokens(batches, dist)  # global [target tokens, input tokens] of this step
        set_lr(optimizer, lr_factor(step, num_steps, t))
        local_loss = accumulate_gradients(ddp, fwd, batches, counts[0], dist.world_size)
        is_val = done % t["val_interval"] == 0 or done == num_steps
        is_log = is_val or done % t["log_interval"] == 0 or done in (1, stop_at)

        record = group_norms(watched, "grad_norm", grads=True) if is_log else {}
        grad_norm = clip_gradients(trainable, t["grad_clip"])
        update = UpdateRatio(watched) if is_log else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counted += counts
        if is_log or done % t["ckpt_interval"] == 0 or done == stop_at:  # host sync only when needed
            tokens_seen, loss_tokens = base_tokens + int(counted[1]), base_loss_tokens + int(counted[0])

        if is_log:
            loss = all_reduce_sum(local_loss.double(), dist) / counts[0].clamp(min=1)
            tps = (tokens_seen - mark_tokens) / max(time.perf_counter() - mark_time, 1e-9)
            record = {"step": done, "tokens": tokens_seen, "loss": float(loss), "grad_norm": float(grad_norm),
                      **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups}, **record,
                      **group_norms(watched, "param_norm"), **update.ratios(), "tokens_per_s": tps,
                      "mfu": mfu(plan["flops_per_token"], tps, dist.world_size, peak), **memory_stats(dist.device)}
        if is_val:
            model.eval()
            last_val, fixed = validate(model, val_meta, params, plan, dist)
            best_val = min(best_val, last_val)
            record["val_loss"] = last_val
            if dist.is_main and fixed is not None:
                record.update(fixed_batch_stats(model, fixed, t["ce_chunk_tokens"]))
                record["sample"] = greedy_sample(model, tokenizer, prompt, params["eval"]["max_new_tokens"],
                                                 dist.device)
            model.train()
        if is_log and dist.is_main:
            metrics.log(record)
        if done % t["ckpt_interval"] == 0 or done == stop_at:
            save_training_checkpoint(
                ckpt_dir, dist, model=model, optimizer=optimizer, loader=loader, params=params, plan=plan, step=done,
                tokens_seen=tokens_seen, loss_tokens=loss_tokens, best_val_loss=best_val, last_val_loss=last_val,
                wandb_id=metrics.wandb_id if metrics else None, keep=keep_ckpts,
            )
        if is_log:  # throughput excludes validation and checkpoint time; memory peaks are per interval
            mark_time, mark_tokens = time.perf_counter(), tokens_seen
            if dist.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dist.device)

    summary = None
    if stop_at == num_steps:
        summary = finish(outdir, dist, model, params, plan, tokens_seen, loss_tokens, best_val, last_val)
    else:
        log.info("stopped after step %d of %d (--max-steps); rerun with --resume auto to continue", stop_at, num_steps)
    if metrics:
        metrics.close()
    ddp_ref = weakref.ref(ddp)
    del ddp, fwd
    close_distributed(dist, ddp_ref)
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--plan", required=True, help="R/plan.json")
    p.add_argument("--train", required=True, help="packed train rows metadata, R/pack/{mix}/train.json")
    p.add_argument("--val", required=True, help="packed validation rows metadata, R/pack/{mix}/val.json")
    p.add_argument("--tokenizer", required=True, help="R/tokenizer/tokenizer.json")
    p.add_argument("--outdir", required=True, help="R/train")
    p.add_argument("--resume", choices=("auto", "require", "never"), default="auto",
                   help="auto: continue from outdir/ckpt/latest when it matches this run's config and world "
                        "size, else move it aside and start over; require: continue or fail; never: start over")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps, leaving a checkpoint and no final.pt (testing)")
    p.add_argument("--keep-ckpts", type=int, default=2, help="step checkpoints kept on disk (newest)")
    args = p.parse_args(argv)
    params = params_from_args(args, "train")
    train(params, read_json(args.plan), args.train, args.val, args.tokenizer, args.outdir,
          resume=args.resume, max_steps=args.max_steps, keep_ckpts=args.keep_ckpts)


if __name__ == "__main__":
    run_cli(main)
