"""One training step, shared by the trainer, the benchmark and evaluation: the model under the run's
precision, `LossModel` (body under autocast, then the fp32 chunked cross-entropy), DDP + compile
wrapping, gradient accumulation with exact token-weighted normalisation, and clipping (the
normalisation argument: the `pipeline.training.train` docstring)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.errors import PipelineError
from pipeline.training.distributed import Dist, all_reduce_sum
from pipeline.training.losses import chunked_cross_entropy
from pipeline.training.model import ModelConfig, Transformer


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
    (which always runs eagerly, a graph break; see pipeline/training/losses.py).

    forward(inputs, targets, mask=None, doc_ids=None) -> (loss_sum, count); with `doc_ids` [B, T]
    attention stays within each packed document (`model.hidden(..., doc_mask=doc_ids)`).
    """

    def __init__(self, model: Transformer, body_dtype: torch.dtype | None, ce_chunk: int):
        super().__init__()
        self.model = model
        self.body_dtype = body_dtype
        self.ce_chunk = ce_chunk

    def forward(self, inputs, targets, mask=None, doc_ids=None):
        dtype, on = self.body_dtype or torch.float32, self.body_dtype is not None
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=on):
            hidden = self.model.hidden(inputs, doc_ids)
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


def next_micro_batches(it, n: int, device: torch.device) -> list[tuple]:
    """The next `n` (inputs, targets, mask-or-None, doc-ids-or-None) micro-batches, on `device` (a
    loader without doc ids yields 3-tuples)."""
    nb = device.type == "cuda"
    return [tuple(None if t is None else t.to(device, non_blocking=nb) for t in (*next(it), None)[:4])
            for _ in range(n)]


def count_tokens(batches: list[tuple], dist: Dist) -> torch.Tensor:
    """Global [target tokens, input tokens] of one step's micro-batches (one all-reduce)."""
    device = batches[0][0].device
    targets = sum(int(y.numel()) if m is None else m.sum() for _, y, m, *_ in batches)
    inputs = sum(int(x.numel()) for x, *_ in batches)
    counts = torch.stack([torch.as_tensor(targets, device=device, dtype=torch.int64),
                          torch.tensor(inputs, device=device, dtype=torch.int64)])
    return all_reduce_sum(counts, dist)


def accumulate_gradients(ddp: nn.Module, fwd: nn.Module, batches: list[tuple], n_targets: torch.Tensor,
                         world_size: int) -> torch.Tensor:
    """Forward/backward over the micro-batches so that, after DDP's averaging, the gradients are
    those of (global loss sum) / n_targets. Returns this rank's loss sum (detached)."""
    scale = world_size / n_targets.clamp(min=1).to(torch.float32)
    local_sum = torch.zeros((), device=batches[0][0].device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last or not isinstance(ddp, DDP) else ddp.no_sync()
        with sync:
            loss_sum, _ = fwd(*batch)
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
