"""One training step, shared by the trainer, the benchmark and evaluation: the model under the run's
precision, `LossModel` (body under autocast, then the fp32 chunked cross-entropy), DDP + compile
wrapping or FSDP2 sharding, gradient accumulation with exact token-weighted normalisation, and clipping
(the normalisation argument: the `pipeline.training.train` docstring).

**FSDP2** (``train.parallel: fsdp``, `shard_model`): ``fully_shard`` on every transformer block, then on
the root `Transformer` (its own parameters: the embedding — the output weight when tied —, the final norm
and an untied ``lm_head``). Parameters, gradients and optimizer state are DTensors sharded on dim 0 over
the ranks; the optimizer holds fp32 master shards.

* **Construction** (`build_model`): the model is built on the ``meta`` device, fp8-converted, sharded,
  materialized with ``to_empty`` (each rank allocates its shards only) and initialised one weight at a
  time on the host, with the values a host-built model of the same seed has, bit for bit: no rank ever
  holds the whole model on the host (the 8B preset's 32 GB per rank, × 8 ranks per node, before).
* **Mixed precision** (`MixedPrecisionPolicy`): the blocks' parameters are all-gathered in the body's
  autocast dtype (bf16 on CUDA with ``train.precision: bf16``; fp32 on CPU and in fp32 runs, where FSDP
  then computes exactly what DDP does), gradients reduce-scattered in fp32. The root keeps fp32
  parameters: the chunked fp32 CE reads the **gathered fp32 output weight** (the root's forward method
  ``hidden`` is registered with FSDP, the root is not resharded after its forward, so in the loss
  ``model.lm_head_weight`` is the whole fp32 [vocab, dim] matrix, as under DDP; its gradient is
  reduce-scattered with the root's at the end of backward). Block inputs are not cast
  (``cast_forward_inputs=False``): the residual stream stays fp32 and autocast casts each matmul, as
  under DDP; only the norms' gains are applied in bf16.
* **Compile** (``train.compile``): each block is compiled in place (``block.compile()``, before sharding,
  as torchtitan does), the parameter names unchanged; the loss runs eager.
* **Activation checkpointing**: unchanged (``mlp`` / ``attention`` inside a block, ``block`` /
  ``every_n`` around the sharded block: its recompute in backward finds the parameters gathered).
* **Gradient accumulation** (`accumulate_gradients`): when the unsharded model fits comfortably
  (`keep_unsharded`: the gathered parameters in their compute dtype plus fp32 unsharded gradients, at
  most `UNSHARDED_ACCUM_FRACTION` of the GPU's memory; always on CPU), the micro-steps of a step run with
  ``set_reshard_after_forward(False)``, and all but the last with ``set_requires_gradient_sync(False)``
  and ``set_reshard_after_backward(False)``: the parameters are gathered once per step and gradients
  reduce-scattered once per step (DDP's ``no_sync``), for 2 + 4 bytes per parameter of the whole model
  held between micro-steps. Otherwise (large models) every micro-step re-gathers each block in forward
  and backward and reduce-scatters its gradients, which accumulate sharded: no whole-model buffer ever.
* **Evaluation** inside training (validation, the fixed batch, samples, CORE) runs under
  `gathered(model)`: every rank gathers the whole model once and keeps it (the blocks in their compute
  dtype: + 2 bytes per parameter in a bf16 run) until the block ends, so rank 0 alone can sample without
  collectives. The gathered blocks hold their compute dtype, so in a bf16 run nothing may feed them an
  fp32 input: validation runs `LossModel` (the body under autocast), the sample and CORE / ChatCORE run
  the body under the same bf16 autocast (`pipeline.model.engine.greedy_sample`,
  `pipeline.evaluation.core.body_dtype`), and the fixed batch's ``ce_fp32`` computes in fp32 with the
  blocks' bf16-rounded weights, each upcast at its use (`plain_hidden`; under DDP: the fp32 master
  weights); on CPU and in fp32 runs nothing differs. Tests take this path on the CPU with
  ``TOKENFARM_CPU_AS_CUDA_PRECISION=1`` (`autocast_dtype`).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

from pipeline.distributed import Dist, all_reduce_sum
from pipeline.errors import PipelineError
from pipeline.model.losses import chunked_cross_entropy
from pipeline.model.model import ModelConfig, Transformer
from pipeline.planning.memory import ce_matmul_precision, fp8_converts

# Test-only: set to 1, a CPU run takes the CUDA precision path (`autocast_dtype`), so that CPU tests run
# the dtypes a GPU run does. Not a config key: a CPU run for real has no reason to compute in bf16.
CPU_AS_CUDA_PRECISION = "TOKENFARM_CPU_AS_CUDA_PRECISION"


def autocast_dtype(cfg: dict, device: torch.device) -> torch.dtype | None:
    """bf16 for the body on CUDA when train.precision is bf16; None (fp32) otherwise. With the test-only
    environment variable `CPU_AS_CUDA_PRECISION` set to 1, the CPU as CUDA: bf16 autocast of the body and
    (`shard_model`) bf16-gathered FSDP blocks — the one place it is read."""
    cuda_like = device.type == "cuda" or os.environ.get(CPU_AS_CUDA_PRECISION) == "1"
    return torch.bfloat16 if cuda_like and cfg["train"]["precision"] == "bf16" else None


def ce_matmul(cfg: dict) -> str:
    """``train.ce_matmul`` resolved (auto: bf16 beside a bf16 body on CUDA, else fp32)."""
    return ce_matmul_precision(cfg)


def set_matmul_precision(ce_matmul_precision: str) -> None:
    """fp32 matmuls run on TF32 tensor cores (inputs rounded to 10 mantissa bits, fp32 accumulation
    and output) only when ``train.ce_matmul`` is tf32 (a bf16 run's only fp32 matmuls are the CE's);
    otherwise in full fp32 (``highest``), which is also the peak an fp32 run's MFU is measured
    against (`pipeline.planning.compute.peak_flops`)."""
    torch.set_float32_matmul_precision("high" if ce_matmul_precision == "tf32" else "highest")


def parallelism(cfg: dict, dist: Dist) -> str:
    """``train.parallel`` as this launch runs it: ``ddp`` or ``fsdp``. ``auto`` is resolved by the plan at
    parse time; should it still reach training, one process or CPU takes ddp (nothing to shard worth the
    collectives), several GPUs fsdp (which fits wherever ddp does). A single process without a process
    group (no torchrun) runs plain whatever the setting: fsdp over one rank computes the same."""
    setting = cfg["train"].get("parallel", "ddp")
    if setting == "auto":
        setting = "ddp" if dist.world_size == 1 or dist.device.type != "cuda" else "fsdp"
    return setting if dist.distributed else "ddp"


def use_compile(cfg: dict, device: torch.device) -> bool:
    setting = cfg["train"]["compile"]
    return device.type == "cuda" if setting == "auto" else bool(setting)


def fp8_filter(recipe: str):
    """The module filter of `apply_fp8`: an nn.Linear that torchao's H100 thresholds for `recipe` say
    is faster in fp8 (`pipeline.planning.memory.fp8_converts`, the function the planner's fp8 speed-up uses)."""
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


def build_model(cfg: dict, device: torch.device, dist: Dist | None = None, compile_blocks: bool = False) -> Transformer:
    """The transformer of `cfg` on `device`, with fp8 linears when `train.fp8` asks for them, FSDP2-sharded
    over `dist`'s ranks when `dist` is given (`shard_model`, each block compiled when `compile_blocks`),
    initialised with the values a model built on the CPU from the current torch seed has.

    Built on the ``meta`` device, so no rank ever holds the whole model on the host: construction (no
    memory), `Transformer.replay_construction_draws` (the CPU generator advanced past the values a host
    construction draws, one layer at a time), fp8 conversion (before sharding, as torchtitan orders it),
    sharding, ``to_empty`` on `device` (this rank's shards only), then ``init_weights`` drawing each
    weight on the host and writing this rank's slice of it (`_write_initial`). Host memory for the
    weights: the largest weight (the embedding or the output layer) at a time, plus on the CPU the
    model's own storage (its shards under FSDP)."""
    fp8 = cfg["train"]["fp8"]
    if fp8 != "none" and device.type != "cuda":
        raise PipelineError("train.fp8 needs hardware.device: cuda")
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_config(cfg))
    model.replay_construction_draws()
    if fp8 != "none":
        apply_fp8(model, fp8)
    if dist is not None:
        shard_model(model, cfg, dist, compile_blocks)
    model.to_empty(device=device)
    model.init_weights(load=_write_initial)
    return model


def _write_initial(weight: nn.Parameter, value: torch.Tensor) -> None:
    """Write a weight's whole initial `value` (host, fp32) into `weight`: for a sharded (DTensor) weight
    its local shard only — the slice of `value` its placements give this rank, taken locally
    (``src_data_rank=None``: every rank drew the same value, nothing is sent)."""
    if isinstance(weight, DTensor):
        value = distribute_tensor(value, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight = weight.to_local()
    weight.copy_(value)


class LossModel(nn.Module):
    """What DDP wraps and torch.compile compiles: the body under autocast, then the fp32 chunked CE
    outside autocast, its logit matmuls at `ce_matmul` precision (pipeline/model/losses.py). The body
    traces into one graph; the loss is the one, deliberate, graph break (``torch.compiler.disable``: it
    runs eagerly, one chunk's [vocab, dim] product at a time; tested with torch._dynamo.explain).

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


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` sharded this model (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# At most this fraction of a GPU's memory may hold the whole model unsharded between micro-steps
# (compute-dtype parameters + fp32 gradients) for the no-resharding accumulation (module docstring).
UNSHARDED_ACCUM_FRACTION = 0.25


def keep_unsharded(n_params: int, param_bytes: int, device: torch.device) -> bool:
    """Whether FSDP gradient accumulation keeps the model gathered between micro-steps (module docstring):
    always on CPU; on CUDA when ``n_params × (param_bytes + 4)`` ≤ `UNSHARDED_ACCUM_FRACTION` of the
    device's memory."""
    if device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    return n_params * (param_bytes + 4) <= UNSHARDED_ACCUM_FRACTION * total


def shard_model(model: Transformer, cfg: dict, dist: Dist, compile_blocks: bool) -> None:
    """FSDP2 in place (module docstring): compile each block when `compile_blocks`, ``fully_shard`` each
    block (compute dtype = the body's autocast dtype, fp32 reduce) and the root (fp32), with the root's
    ``hidden`` registered as a forward method. `build_model` calls it on the meta-device model, before
    materializing it; on a materialized model it shards the weights it has. Call before building the
    optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    body = MixedPrecisionPolicy(param_dtype=autocast_dtype(cfg, dist.device), reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    for block in model.layers:
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=body, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False),
                reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden")
    n_params = sum(p.numel() for p in model.parameters())
    model.keep_unsharded = keep_unsharded(n_params, (body.param_dtype or torch.float32).itemsize, dist.device)


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Within the block, a sharded model's parameters are whole on every rank (all ranks enter; gathered
    once, kept through every forward, resharded at the exit), so evaluation may run any code path — rank 0
    alone included — without collectives. A no-op for an unsharded model."""
    if not is_sharded(model):
        yield
        return
    modules = _fsdp_modules(model)
    blocks = [m for m in modules if m is not model]
    for m in modules:
        m.unshard()
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


def no_buffer_sync() -> dict:
    """DDP's keyword argument for no buffer broadcast per forward (`wrap`): ``forward_sync_buffers=False``
    where DDP has it (torch ≥ 2.13, which deprecates the other), else ``broadcast_buffers=False`` (older
    torch, e.g. the 2.11 of a lent H100; it also skips the sync at construction, harmless for tables every
    rank computes alike)."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def wrap(loss_model: LossModel, dist: Dist, compile_model: bool) -> tuple[nn.Module, nn.Module]:
    """(ddp, fwd): for a sharded model (`shard_model`, compiled per block there) the sharded root and the
    loss model; else DDP around the loss model when a process group exists, then torch.compile
    around that. `fwd` is what to call; `ddp` owns `no_sync`. No buffer broadcast per forward
    (`no_buffer_sync`: ``forward_sync_buffers=False``, torch 2.13's name for ``broadcast_buffers=False``,
    which older torch takes instead): the only buffers are the RoPE cos/sin tables, computed identically
    on every rank from the config, so DDP's default (broadcast them from rank 0 before every forward) is
    a wasted collective per micro-step. DDP still syncs them once at construction (torch ≥ 2.13)."""
    if is_sharded(loss_model.model):
        return loss_model.model, loss_model
    ddp = loss_model
    if dist.distributed:
        ids = [dist.local_rank] if dist.device.type == "cuda" else None
        ddp = DDP(loss_model, device_ids=ids, gradient_as_bucket_view=True, **no_buffer_sync())
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
    """Set up a sharded model for one micro-step (module docstring: gradient accumulation)."""
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
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
