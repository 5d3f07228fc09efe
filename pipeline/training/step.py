"""One training step, shared by the trainer, the benchmark and evaluation: the model under the run's
precision, `LossModel` (body under autocast, then the fp32 chunked cross-entropy), DDP + compile
wrapping, gradient accumulation with exact token-weighted normalisation, and clipping (the
normalisation argument: the `pipeline.training.train` docstring)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.distributed import Dist, all_reduce_sum
from pipeline.errors import PipelineError
from pipeline.model.losses import chunked_cross_entropy
from pipeline.model.model import ModelConfig, Transformer
from pipeline.perf import ce_matmul_precision, fp8_converts


def autocast_dtype(cfg: dict, device: torch.device) -> torch.dtype | None:
    """bf16 for the body on CUDA when train.precision is bf16; None (fp32) otherwise."""
    return torch.bfloat16 if device.type == "cuda" and cfg["train"]["precision"] == "bf16" else None


def ce_matmul(cfg: dict) -> str:
    """``train.ce_matmul`` resolved (auto: bf16 beside a bf16 body on CUDA, else fp32)."""
    return ce_matmul_precision(cfg)


def set_matmul_precision(ce_matmul_precision: str) -> None:
    """fp32 matmuls run on TF32 tensor cores (inputs rounded to 10 mantissa bits, fp32 accumulation
    and output) only when ``train.ce_matmul`` is tf32 (a bf16 run's only fp32 matmuls are the CE's);
    otherwise in full fp32 (``highest``), which is also the peak an fp32 run's MFU is measured
    against (`pipeline.budget.peak_flops`)."""
    torch.set_float32_matmul_precision("high" if ce_matmul_precision == "tf32" else "highest")


def use_compile(cfg: dict, device: torch.device) -> bool:
    setting = cfg["train"]["compile"]
    return device.type == "cuda" if setting == "auto" else bool(setting)


def fp8_filter(recipe: str):
    """The module filter of `apply_fp8`: an nn.Linear that torchao's H100 thresholds for `recipe` say
    is faster in fp8 (`pipeline.perf.fp8_converts`, the function the planner's fp8 speed-up uses)."""
    def converts(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fp8_converts(recipe, *module.weight.shape)

    return converts


def apply_fp8(model: Transformer, recipe: str) -> None:
    """Swap the blocks' linears that `fp8_filter` selects for torchao Float8Linear (`tensorwise` or
    `rowwise` scaling); the others stay bf16 (on the 1.2B preset rowwise converts gate/up only).
    Master weights stay fp32."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise PipelineError("train.fp8 needs the torchao package: pip install torchao "
                            "(or set train.fp8: none)") from None
    convert_to_float8_training(model.layers, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=fp8_filter(recipe))


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
    outside autocast, its logit matmuls at `ce_matmul` precision (pipeline/model/losses.py). The
    whole of it traces into one graph (no graph break: tested with torch._dynamo.explain).

    forward(inputs, targets, mask=None, doc_ids=None) -> (loss_sum, count); with `doc_ids` [B, T]
    attention stays within each packed document (`model.hidden(..., doc_mask=doc_ids)`).
    """

    def __init__(self, model: Transformer, body_dtype: torch.dtype | None, ce_chunk: int, ce_matmul: str = "fp32"):
        super().__init__()
        self.model = model
        self.body_dtype = body_dtype
        self.ce_chunk = ce_chunk
        self.ce_matmul = ce_matmul

    def forward(self, inputs, targets, mask=None, doc_ids=None):
        dtype, on = self.body_dtype or torch.float32, self.body_dtype is not None
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=on):
            hidden = self.model.hidden(inputs, doc_ids)
        return chunked_cross_entropy(hidden, self.model.lm_head_weight, targets, mask, chunk=self.ce_chunk,
                                     matmul=self.ce_matmul)


def wrap(loss_model: LossModel, dist: Dist, compile_model: bool) -> tuple[nn.Module, nn.Module]:
    """(ddp, fwd): DDP around the loss model when a process group exists, then torch.compile
    around that. `fwd` is what to call; `ddp` owns `no_sync`. No buffer broadcast per forward
    (``forward_sync_buffers=False``, torch 2.13's name for ``broadcast_buffers=False``, which it
    deprecates): the only buffers are the RoPE cos/sin tables, computed identically on every rank
    from the config, so DDP's default (broadcast them from rank 0 before every forward) is a wasted
    collective per micro-step. DDP still syncs them once at construction."""
    ddp = loss_model
    if dist.distributed:
        ids = [dist.local_rank] if dist.device.type == "cuda" else None
        ddp = DDP(loss_model, device_ids=ids, gradient_as_bucket_view=True, forward_sync_buffers=False)
    fwd = torch.compile(ddp) if compile_model else ddp
    return ddp, fwd


def to_device(batch: tuple, device: torch.device) -> tuple:
    """A host batch on `device`: on CUDA from pinned memory with non-blocking copies (the host does not
    wait for the copy; the default stream orders it before the step's kernels)."""
    if device.type != "cuda":
        return batch
    return tuple(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in batch)


class StepBatches:
    """One optimizer step's micro-batches, read and pinned by a background thread one step ahead.

    ``next_step()`` returns ``(batches on device, global [target, input] token counts)``. The counts
    are summed on the host from the host batches and travel with them (non-blocking), then one
    all-reduce: no device-to-host sync in the step. The loader runs one step ahead in the thread, so
    ``state_dict()`` is the loader state after the *consumed* steps (what a checkpoint must hold); a
    loader exception (DataExhausted) is raised by the ``next_step()`` that would have needed it.
    """

    def __init__(self, loader, micro_steps: int, dist: Dist, prefetch: bool = True):
        import queue
        import threading

        self.loader, self.n, self.dist = loader, micro_steps, dist
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = None
        if prefetch:
            self._thread = threading.Thread(target=self._fill, name="step-batches", daemon=True)
            self._thread.start()

    def _read(self):
        it = iter(self.loader)
        batches = [next(it) for _ in range(self.n)]
        pin = self.dist.device.type == "cuda"
        batches = [tuple(None if t is None else (t.pin_memory() if pin else t) for t in b) for b in batches]
        return batches, self.loader.state_dict()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._read()
            except BaseException as e:  # handed to the consumer, raised where the step needs the data
                item = e
            self._queue.put(item)
            if isinstance(item, BaseException):
                return

    def next_step(self) -> tuple[list[tuple], torch.Tensor]:
        item = self._queue.get() if self._thread is not None else self._read()
        if isinstance(item, BaseException):
            raise item
        batches, self._state = item
        return [to_device(b, self.dist.device) for b in batches], count_tokens(batches, self.dist)

    def state_dict(self) -> dict:
        return self._state

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except Exception:
                    pass
                self._thread.join(timeout=0.05)


def next_micro_batches(it, n: int, device: torch.device) -> list[tuple]:
    """The next `n` (inputs, targets, mask-or-None, doc-ids-or-None) micro-batches of `it`, on `device`
    (validation; a loader without doc ids yields 3-tuples)."""
    return [to_device((*next(it), None)[:4], device) for _ in range(n)]


def count_tokens(batches: list[tuple], dist: Dist) -> torch.Tensor:
    """Global [target tokens, input tokens] of *host* micro-batches: summed on the host (masks
    included), one pinned non-blocking copy, one all-reduce — no device-to-host sync in the step."""
    targets = sum(y.numel() if m is None else int(m.sum()) for _, y, m, *_ in batches)
    local = torch.tensor([targets, sum(x.numel() for x, *_ in batches)], dtype=torch.int64)
    return all_reduce_sum(to_device((local,), dist.device)[0], dist)


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


def zero_gradients(optimizer) -> None:
    """Zero the gradients in place, keeping their storage. Under DDP with ``gradient_as_bucket_view``
    the gradients *are* views into the reducer's buckets; ``set_to_none=True`` would drop them, and
    the next micro-step's backward under ``no_sync`` would allocate fresh gradients beside the
    buckets: the whole gradient held twice (+4 B per parameter)."""
    optimizer.zero_grad(set_to_none=False)


class _PlainHidden(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        with torch.device("meta"):
            self.model = Transformer(cfg)

    def forward(self, x, doc_ids=None):
        return self.model.hidden(x, doc_ids)


def plain_hidden(model: Transformer, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``model.hidden(x)`` with every linear that fp8 conversion replaced (torchao's Float8Linear
    subclasses nn.Linear and keeps its high-precision ``weight``) run as a plain nn.Linear: the
    model's own tensors through a plain skeleton built on the meta device (`torch.func.functional_call`),
    so the trained model — and the compiled graph's guards on it — is never modified."""
    if all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear)):
        return model.hidden(x, doc_ids)
    skeleton = _PlainHidden(model.cfg)
    names = {k for k, _ in (*skeleton.named_parameters(), *skeleton.named_buffers())}
    tensors = {f"model.{k}": v for k, v in (*model.named_parameters(), *model.named_buffers())}
    return torch.func.functional_call(skeleton, {k: v for k, v in tensors.items() if k in names}, (x, doc_ids),
                                     strict=True)


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm (before clipping); grads are scaled down to `max_norm` when > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
