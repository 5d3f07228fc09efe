"""How the model runs on the devices: built under the run's precision (`build_model`, `LossModel`: the body
under autocast, then the fp32 chunked cross-entropy), fp8-converted, compiled, and wrapped in DDP or sharded
with FSDP2 (`wrap`, `shard_model`, `gathered`). What torchtitan calls parallelize; docs/training.md
explains the FSDP2 choices (mixed precision, construction on meta, accumulation, evaluation).
"""
import contextlib
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.distributed import Dist, is_dtensor
from pipeline.errors import PipelineError
from pipeline.model.losses import chunked_cross_entropy, eager_cross_entropy
from pipeline.model.model import ModelConfig, Transformer
from pipeline.planning.memory import ce_matmul_precision, fp8_converts
from pipeline.run_config import run_config

# Test-only: set to 1, a CPU run takes the CUDA precision path (`autocast_dtype`), so that CPU tests run
# the dtypes a GPU run does. Not a config key: a CPU run for real has no reason to compute in bf16.
CPU_AS_CUDA_PRECISION = "TOKENFARM_CPU_AS_CUDA_PRECISION"


def autocast_dtype(cfg: dict, device: torch.device) -> torch.dtype | None:
    """bf16 for the body on CUDA when train.precision is bf16; None (fp32) otherwise. With the test-only
    environment variable `CPU_AS_CUDA_PRECISION` set to 1, the CPU as CUDA: bf16 autocast of the body and
    (`shard_model`) bf16-gathered FSDP blocks — the one place it is read."""
    cuda_like = device.type == "cuda" or os.environ.get(CPU_AS_CUDA_PRECISION) == "1"
    return torch.bfloat16 if cuda_like and run_config(cfg).train.precision == "bf16" else None


def ce_matmul(cfg: dict) -> str:
    """``train.ce_matmul`` resolved (auto: bf16 beside a bf16 body on CUDA, else fp32)."""
    return ce_matmul_precision(run_config(cfg))


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
    setting = run_config(cfg).train.get("parallel", "ddp")
    if setting == "auto":
        setting = "ddp" if dist.world_size == 1 or dist.device.type != "cuda" else "fsdp"
    return setting if dist.distributed else "ddp"


def use_compile(cfg: dict, device: torch.device) -> bool:
    setting = run_config(cfg).train.compile
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
    fp8 = run_config(cfg).train.fp8
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
    if is_dtensor(weight):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight = weight.to_local()
    weight.copy_(value)


class LossModel(nn.Module):
    """What DDP wraps and torch.compile compiles: the body under autocast, then the fp32 chunked CE
    outside autocast, its logit matmuls at `ce_matmul` precision (pipeline/model/losses.py). Compiled
    (`compiled`), the body traces into one graph; the loss is the one, deliberate, graph break
    (``torch.compiler.disable``: it runs eagerly, one chunk's [vocab, dim] product at a time; tested with
    torch._dynamo.explain).

    forward(inputs, targets, mask=None, doc_ids=None) -> (loss_sum, count); with `doc_ids` [B, T]
    attention stays within each packed document (`model.hidden(..., doc_mask=doc_ids)`).
    """

    def __init__(self, model: Transformer, body_dtype: torch.dtype | None, ce_chunk: int, ce_matmul: str = "fp32"):
        super().__init__()
        self.model = model
        self.body_dtype = body_dtype
        self.ce_chunk = ce_chunk
        self.ce_matmul = ce_matmul
        self.loss = chunked_cross_entropy

    def keep_loss_eager(self) -> None:
        """The loss out of any graph a compile traces (losses.eager_cross_entropy)."""
        self.loss = eager_cross_entropy()

    def compiled(self, around: nn.Module | None = None, **options) -> nn.Module:
        """torch.compile of this loss model, or of `around` (the DDP that wraps it), the loss left eager:
        every compiled step goes through here."""
        self.keep_loss_eager()
        return torch.compile(self if around is None else around, **options)

    def forward(self, inputs, targets, mask=None, doc_ids=None):
        dtype, on = self.body_dtype or torch.float32, self.body_dtype is not None
        with torch.autocast(inputs.device.type, dtype=dtype, enabled=on):
            hidden = self.model.hidden(inputs, doc_ids)
        return self.loss(hidden, self.model.lm_head_weight, targets, mask, chunk=self.ce_chunk,
                         matmul=self.ce_matmul)


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` sharded this model (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# At most this fraction of a GPU's memory may hold the whole model unsharded between micro-steps
# (compute-dtype parameters + fp32 gradients) for the no-resharding accumulation (docs/training.md).
UNSHARDED_ACCUM_FRACTION = 0.25


def keep_unsharded(n_params: int, param_bytes: int, device: torch.device) -> bool:
    """Whether FSDP gradient accumulation keeps the model gathered between micro-steps (docs/training.md):
    always on CPU; on CUDA when ``n_params × (param_bytes + 4)`` ≤ `UNSHARDED_ACCUM_FRACTION` of the
    device's memory."""
    if device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    return n_params * (param_bytes + 4) <= UNSHARDED_ACCUM_FRACTION * total


def shard_model(model: Transformer, cfg: dict, dist: Dist, compile_blocks: bool) -> None:
    """FSDP2 in place (docs/training.md): compile each block when `compile_blocks`, ``fully_shard`` each
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
    fwd = loss_model.compiled(ddp) if compile_model else ddp
    return ddp, fwd


