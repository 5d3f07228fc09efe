"""One optimizer step's pieces, shared by the trainer, the benchmark and evaluation: the micro-batches
(`StepBatches`), exact token-weighted gradient accumulation (`accumulate_gradients`), clipping, and
the fp32 reference hidden states (`plain_hidden`). The normalisation argument: docs/training.md.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

from pipeline.distributed import Dist, all_reduce_sum, is_dtensor
from pipeline.model.model import ModelConfig, Transformer
from pipeline.training.parallelize import _fsdp_modules, is_sharded


def to_device(batch: tuple, device: torch.device) -> tuple:
    """A host batch on `device`: on CUDA from pinned memory with non-blocking copies (the host does not
    wait for the copy; the default stream orders it before the step's kernels)."""
    if device.type != "cuda":
        return batch
    return tuple(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in batch)


class StepBatches:
    """One optimizer step's micro-batches, read and pinned by a background thread one step ahead.

    ``next_step(stop_vote)`` returns ``(batches on device, global [target, input] token counts)``. The
    counts are summed on the host from the host batches and travel with them (non-blocking), then one
    all-reduce: no device-to-host sync in the step. The same all-reduce carries this rank's stop vote
    (pipeline/training/stopping.py), summed over the ranks: ``stop_agreed()`` is true when any rank voted
    at this step; on CUDA it waits for that all-reduce only (a pinned copy and an event), not for the
    step's kernels queued after it. The loader runs one step ahead in the thread, so
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
        self._votes = self._votes_host = self._votes_event = None
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

    def next_step(self, stop_vote: bool = False) -> tuple[list[tuple], torch.Tensor]:
        item = self._queue.get() if self._thread is not None else self._read()
        if isinstance(item, BaseException):
            raise item
        batches, self._state = item
        counts = count_tokens(batches, self.dist, vote=stop_vote)
        self._votes = counts[2:]
        if self.dist.device.type == "cuda":
            if self._votes_host is None:
                self._votes_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
                self._votes_event = torch.cuda.Event()
            self._votes_host.copy_(self._votes, non_blocking=True)
            self._votes_event.record()
        return [to_device(b, self.dist.device) for b in batches], counts[:2]

    def stop_agreed(self) -> bool:
        """Whether any rank voted to stop in the last `next_step` (the same answer on every rank)."""
        if self._votes is None:
            return False
        if self._votes_event is not None:
            self._votes_event.synchronize()
            return bool(self._votes_host[0])
        return bool(self._votes[0])

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


def count_tokens(batches: list[tuple], dist: Dist, vote: bool | None = None) -> torch.Tensor:
    """Global [target tokens, input tokens] of *host* micro-batches: summed on the host (masks
    included), one pinned non-blocking copy, one all-reduce — no device-to-host sync in the step.
    With `vote` (a stop vote, `StepBatches`), a third element: the number of ranks that voted."""
    targets = sum(y.numel() if m is None else int(m.sum()) for _, y, m, *_ in batches)
    values = [targets, sum(x.numel() for x, *_ in batches)] + ([] if vote is None else [int(vote)])
    local = torch.tensor(values, dtype=torch.int64)
    return all_reduce_sum(to_device((local,), dist.device)[0], dist)


def _fsdp_micro_step(root: nn.Module, last: bool, keep: bool) -> contextlib.AbstractContextManager:
    """Set up a sharded model for one micro-step (docs/training.md: gradient accumulation)."""
    if keep:
        blocks = [m for m in _fsdp_modules(root) if m is not root]
        for m in blocks:
            m.set_reshard_after_forward(False, recurse=False)
        root.set_requires_gradient_sync(last)
        root.set_reshard_after_backward(last)
        if last:  # the next step (or an evaluation) starts from the sharded state again
            return _restore_reshard_after_forward(blocks)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restore_reshard_after_forward(blocks: list):
    try:
        yield
    finally:
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)


def accumulate_gradients(ddp: nn.Module, fwd: nn.Module, batches: list[tuple], n_targets: torch.Tensor,
                         world_size: int) -> torch.Tensor:
    """Forward/backward over the micro-batches so that, after DDP's (or FSDP's reduce-scatter's)
    averaging, the gradients are those of (global loss sum) / n_targets. Returns this rank's loss sum
    (detached)."""
    scale = world_size / n_targets.clamp(min=1).to(torch.float32)
    local_sum = torch.zeros((), device=batches[0][0].device)
    sharded = is_sharded(ddp)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if sharded:
            sync = _fsdp_micro_step(ddp, last, getattr(ddp, "keep_unsharded", False) and len(batches) > 1)
        else:
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


class _Fp32Weights(TorchFunctionMode):
    """Linears and norms compute in fp32 whatever their weights' dtype: a bf16 weight is upcast at its
    call, so one weight's fp32 copy exists at a time."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.linear, F.rms_norm):
            up = lambda a: a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            args, kwargs = tuple(map(up, args)), {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def plain_hidden(model: Transformer, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``model.hidden(x)`` in fp32 with every linear that fp8 conversion replaced (torchao's Float8Linear
    subclasses nn.Linear and keeps its high-precision ``weight``) run as a plain nn.Linear, and weights
    below fp32 (FSDP's blocks gathered in bf16, `gathered`) upcast at their use: fp32 compute on the
    bf16-rounded weights. Then the model's own tensors run through a plain skeleton built on the meta
    device (`torch.func.functional_call`), so the trained model — and the compiled graph's guards on
    it — is never modified."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if all(type(m) is nn.Linear for m in linears) and all(p.dtype == torch.float32 for p in model.parameters()):
        return model.hidden(x, doc_ids)
    skeleton = _PlainHidden(model.cfg)
    names = {k for k, _ in (*skeleton.named_parameters(), *skeleton.named_buffers())}
    tensors = {f"model.{k}": v for k, v in (*model.named_parameters(), *model.named_buffers())}
    with _Fp32Weights():
        return torch.func.functional_call(skeleton, {k: v for k, v in tensors.items() if k in names}, (x, doc_ids),
                                         strict=True)


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm (before clipping); grads are scaled down to `max_norm` when > 0. Sharded
    (DTensor) gradients: the norm of their shards' norms is a partial result, made whole (one all-reduce)
    before it scales them: the same norm as DDP's full gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
