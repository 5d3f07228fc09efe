"""What one training step does (`StepSetup.from_config(cfg)`) and its predicted per-GPU memory
(`memory(setup)`), of CORE scoring too (`eval_memory`); `choose_parallel` picks ddp or fsdp by it.
Torch-free; the formulas: docs/planning.md."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipeline.planning.compute import BatchLayout
from pipeline.planning.fitted import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_GB,
    FSDP_GATHERED_BLOCKS,
    FSDP_REDUCE_BYTES,
    FSDP_ROOT_BYTES,
    NCCL_BUFFERS_GB,
)
from pipeline.run_config import RunConfig

GB = 1e9
GIB = 2 ** 30
LOGITS_MODES = ("ours", "bf16-materialized")

# ---- which linears fp8 converts: torchao's own H100 thresholds (one function, the trainer's and the model's)

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_FILTERS = ("torchao", "all")


def fp8_converts(recipe: str, out_features: int, in_features: int, fp8_filter: str = "torchao") -> bool:
    """Whether fp8 training converts an nn.Linear of weight [out_features, in_features] (N, K).

    ``torchao`` (what the trainer does, `pipeline.training.parallelize.apply_fp8`): torchao's
    ``_auto_filter_for_recipe`` (torchao 0.18.0, torchao/float8/float8_linear_utils.py,
    ``_auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise``), reproduced here because the
    planner imports no torch (tests/training/test_fp8_filter.py checks it against torchao's own
    function when torchao is installed). Both need N and K multiples of 16; then, from torchao's
    H100 benchmarks of fp8 vs bf16 linears ("dims below these thresholds may result in worse
    performance"), tensorwise keeps in bf16 a linear with K ≤ 4096 and N ≤ 1024, rowwise one with
    N ≤ 2048, or K ≤ 1024, or N ≤ 4096 and K ≤ 2048. On the 1.2B preset (d 2048, d_kv 512, f 8192)
    rowwise converts gate/up only (q/k/v/o/down stay bf16); tensorwise converts all but k/v.
    ``all``: every linear with both dims multiples of 16 (the reference's conversion, which the
    `FP8_SPEEDUP` fit describes)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    if fp8_filter not in FP8_FILTERS:
        raise ValueError(f"fp8_filter must be one of {FP8_FILTERS}, got {fp8_filter!r}")
    N, K = out_features, in_features
    if N % 16 or K % 16:
        return False
    if fp8_filter == "all":
        return True
    if recipe == "tensorwise":
        return not (K <= 4096 and N <= 1024)
    return not (N <= 2048 or K <= 1024 or (N <= 4096 and K <= 2048))


PARALLEL_MODES = ("ddp", "fsdp")



@dataclass(frozen=True)
class StepSetup:
    """What one training step does, as far as memory and time depend on it."""

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tied: bool
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    world_size: int = 1
    device: str = "cuda"
    gpu_type: str = "H100"
    bf16: bool = True                  # body under bf16 autocast (CUDA only)
    compile: bool = True
    checkpoint: str = "none"           # none | mlp | attention | block | every_n
    every_n: int = 2
    optimizer: str = "adamw"           # adamw | adamw8bit | muon
    adamw_kernel: str = "fused"        # fused | foreach (the reference's first rows: torch's default)
    fp8: str = "none"                  # none | tensorwise | rowwise
    fp8_filter: str = "torchao"        # which linears fp8 converts (`fp8_converts`): torchao | all (the reference)
    logits: str = "ours"               # ours | bf16-materialized
    ce_chunk: int = 8192
    ce_matmul: str = "tf32"            # bf16 | tf32 | fp32 (ours only)
    grads_persistent: bool = True      # ours: zero_grad(set_to_none=False); the reference frees them
    parallel: str = "ddp"              # ddp | fsdp (`train.parallel` resolved: `resolve_parallel`)
    nodes: int = 1                     # hardware.nodes: world_size / nodes GPUs per node

    @classmethod
    def from_config(cls, cfg: RunConfig, logits: str = "ours", parallel: str | None = None) -> StepSetup:
        """The trainer's step for a resolved run config; ``logits="bf16-materialized"`` describes the
        reference trainer instead (its loss, and gradients freed at every zero_grad). ``parallel``
        (ddp | fsdp) replaces ``train.parallel``; ``auto`` is resolved by `choose_parallel`."""
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        model, train, hw = cfg.model, cfg.train, cfg.hardware
        parallel = parallel or train.parallel
        if parallel == "auto":
            parallel = choose_parallel(cfg)["parallel"]
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        cuda = hw.device == "cuda"
        batch = BatchLayout.from_config(cfg)
        bf16 = cuda and train.precision == "bf16"
        return cls(
            vocab=model.vocab_size, dim=model.dim, n_layers=model.n_layers, n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim, tied=model.tie_embeddings,
            micro_batch=batch.micro_batch, seq_len=batch.seq_len, grad_accum=batch.grad_accum_steps,
            world_size=batch.world_size, device=hw.device, gpu_type=hw.gpu_type if cuda else "cpu", bf16=bf16,
            compile=cuda if train.compile == "auto" else bool(train.compile),
            checkpoint=train.activation_checkpointing, every_n=train.checkpoint_every_n,
            optimizer=train.optimizer,
            adamw_kernel="fused" if cuda else "foreach", fp8=train.fp8, logits=logits,
            fp8_filter="torchao" if logits == "ours" else "all",
            ce_chunk=train.ce_chunk_tokens, ce_matmul=ce_matmul_precision(cfg),
            grads_persistent=logits == "ours", parallel=parallel, nodes=hw.nodes,
        )

    def replace(self, **changes) -> StepSetup:
        return dataclasses.replace(self, **changes)

    # ---- shapes
    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def d_kv(self) -> int:
        return self.n_kv_heads * (self.dim // self.n_heads)

    @property
    def attention_matrix_params(self) -> int:
        return 2 * self.dim * self.dim + 2 * self.dim * self.d_kv

    @property
    def mlp_matrix_params(self) -> int:
        return 3 * self.dim * self.ffn_dim

    @property
    def matrix_params(self) -> int:
        """Block matrices (all layers): what autocast copies, fp8 converts and Muon updates."""
        return self.n_layers * (self.attention_matrix_params + self.mlp_matrix_params)

    @property
    def params(self) -> int:
        vocab = self.vocab * self.dim * (1 if self.tied else 2)
        return vocab + self.matrix_params + self.n_layers * 2 * self.dim + self.dim

    @property
    def block_params(self) -> int:
        """One transformer block: its matrices and two norm gains (one FSDP2 unit under fsdp)."""
        return self.attention_matrix_params + self.mlp_matrix_params + 2 * self.dim

    @property
    def root_params(self) -> int:
        """What the root FSDP2 unit holds: the token embedding, the final norm and an untied lm_head."""
        return self.params - self.n_layers * self.block_params

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.world_size // max(1, self.nodes))

    @property
    def param_bytes(self) -> int:
        """Bytes of a gathered (unsharded) FSDP2 parameter: bf16 under FSDP2's mixed precision, else fp32."""
        return 2 if self.bf16 else 4

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """One block's linears: name -> (out_features, in_features)."""
        d, kv, f = self.dim, self.d_kv, self.ffn_dim
        return {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (f, d), "up": (f, d), "down": (d, f)}

    def fp8_linears(self) -> dict[str, bool]:
        """Which of a block's linears run in fp8 (`fp8_converts`; none without fp8 or a bf16 body)."""
        on = self.fp8 != "none" and self.bf16
        return {k: on and fp8_converts(self.fp8, *shape, self.fp8_filter) for k, shape in self.linear_shapes().items()}

    @property
    def math_attention(self) -> bool:
        """fp32 SDPA on CUDA: no flash kernel for fp32, the math kernel materialises [heads, T, T]."""
        return self.device == "cuda" and not self.bf16


def ce_matmul_precision(cfg: RunConfig) -> str:
    """``train.ce_matmul`` resolved: ``auto`` is bf16 beside a bf16 body on CUDA, else fp32 (the one
    place the trainer and the model read it from)."""
    setting = cfg.train.get("ce_matmul", "auto")
    if setting != "auto":
        return setting
    return "bf16" if cfg.hardware.device == "cuda" and cfg.train.precision == "bf16" else "fp32"




# ----------------------------------------------------------------------------- memory

def _region_bytes(s: StepSetup) -> dict[str, float]:
    """Bytes per token of one layer's attention and mlp regions when stored, and a region's input."""
    a = 2 if s.bf16 else 4
    conv = s.fp8_linears()

    def saved(names: tuple[str, ...]) -> int:  # bytes per element of one input shared by `names`:
        fp8 = any(conv[n] for n in names)  # fp8 linears save an fp8 copy, the others the bf16 input
        return (1 if fp8 else 0) + (a if not all(conv[n] for n in names) else 0)

    d, f = s.dim, s.ffn_dim
    # norm input; the q/k/v and o_proj inputs; q, k, v
    attention = 4 * d + (saved(("q", "k", "v")) + saved(("o",))) * d + a * (d + 2 * s.d_kv)
    # norm input; the gate/up and down inputs; gate, up (+ silu's output eager)
    mlp = 4 * d + saved(("gate", "up")) * d + saved(("down",)) * f + a * (2 if s.compile else 3) * f
    if not s.compile:
        attention += a * 3 * d
    if s.math_attention:
        attention += 4 * s.n_heads * s.seq_len
    return {"attention": attention, "mlp": mlp, "input": 4 * d}


def activations(s: StepSetup) -> dict[str, float]:
    """Activation bytes per micro-batch: ``stored`` (forward to backward, all layers) and
    ``recompute`` (the largest region rebuilt at once in backward)."""
    r = _region_bytes(s)
    layer = r["attention"] + r["mlp"]
    L = s.n_layers
    if s.checkpoint == "every_n":
        k = math.ceil(L / s.every_n)
        stored, rebuilt = k * r["input"] + (L - k) * layer, layer
    else:
        per_layer, rebuilt = {
            "none": (layer, 0),
            "mlp": (r["attention"] + r["input"], r["mlp"]),
            "attention": (r["input"] + r["mlp"], r["attention"]),
            "block": (r["input"], layer),
        }[s.checkpoint]
        stored = L * per_layer
    n = s.tokens
    return {"stored": n * (stored + 4 * s.dim), "recompute": n * rebuilt}  # + the final norm's input


def logits_bytes(s: StepSetup) -> float:
    """What the loss adds when its backward starts (see docs/planning.md, "Memory and step time of a training step")."""
    n, V, d = s.tokens, s.vocab, s.dim
    if s.logits == "bf16-materialized":
        return (2 if s.compile else 12) * n * V + 2 * n * d
    c = min(s.ce_chunk, n)
    # bf16 operands: their copies (2cV probabilities, 2Vd weight) and, on CUDA, d(W)'s per-chunk fp32
    # product (4Vd: torch cannot accumulate bf16 products into an fp32 tensor in place; losses._mm_into)
    bf16_extra = 2 * c * V + 2 * V * d + (4 * V * d if s.device == "cuda" else 0)
    chunk = 4 * c * V + (bf16_extra if s.ce_matmul == "bf16" else 0)
    return chunk + 4 * n * d + 4 * V * d + (2 * n * d if s.bf16 else 0)


def optimizer_bytes(s: StepSetup) -> float:
    P = s.params
    if s.optimizer == "adamw8bit":
        return 2 * P
    if s.optimizer == "muon":
        return 4 * s.matrix_params + 8 * (P - s.matrix_params)
    return 8 * P


def autocast_copies(s: StepSetup) -> float:
    """bf16 copies of the block matrices held from forward to backward: eager autocast saves them for
    the matmul backward, except inside checkpointed regions (rebuilt there); a compiled step holds
    every block matrix's cast unless every block is checkpointed (inferred from the H100 rows beside
    the traced loss's products, docs/planning.md; with every block checkpointed the reference
    write-up's compiled step (29.0 GB at 16 × 2048, tests/test_perf.py) leaves no room for them and
    on CPU the compiled forward graph does not save them — not seen in a GPU memory snapshot)."""
    if not s.bf16:
        return 0.0
    if s.compile and s.checkpoint != "block":
        return 2.0 * s.matrix_params
    L = s.n_layers
    held = {
        "none": L * (s.attention_matrix_params + s.mlp_matrix_params),
        "mlp": L * s.attention_matrix_params,
        "attention": L * s.mlp_matrix_params,
        "block": 0,
        "every_n": (L - math.ceil(L / s.every_n)) * (s.attention_matrix_params + s.mlp_matrix_params),
    }[s.checkpoint]
    return 2.0 * held


def memory(s: StepSetup) -> dict[str, float]:
    """Predicted per-GPU memory in GB by component, the ``peak`` (allocated), ``reserved`` and
    ``total`` (reserved + CUDA context), and which moment of the step sets the peak. Under fsdp the
    weights, optimizer state and gradients are a 1/world_size shard, and ``gathered`` (the unsharded
    blocks and root) and ``reduce_buffers`` (backward's unsharded gradients) are added (docs/planning.md)."""
    P, V, d, n = s.params, s.vocab, s.dim, s.tokens
    act = activations(s)
    fsdp = s.parallel == "fsdp"
    W = s.world_size if fsdp else 1
    parts = {
        "weights": 4 * P / W,
        "optimizer": optimizer_bytes(s) / W,
        "autocast_copies": 0.0 if fsdp else autocast_copies(s),
        "gradients": 4 * P / W,
        "gathered": fsdp_gathered_bytes(s) if fsdp else 0.0,
        "reduce_buffers": fsdp_reduce_buffer_bytes(s) if fsdp else 0.0,
        "activations": act["stored"],
        "logits": logits_bytes(s),
        "recompute": act["recompute"],
    }
    state = parts["weights"] + parts["optimizer"] + parts["autocast_copies"] + parts["gathered"]
    if s.grads_persistent:
        grads_at_loss = parts["gradients"]
    else:
        grads_at_loss = 0 if fsdp else 4 * V * d
    moments = {
        "loss backward": state + grads_at_loss + parts["activations"] + parts["logits"],
        "block backward": state + parts["gradients"] + parts["reduce_buffers"] + parts["activations"]
        + parts["recompute"] + 3 * 4 * n * d,
    }
    if fsdp:  # the root unit's reduce-scatter, when every activation is freed (`fsdp_root_reduce_bytes`)
        moments["root reduce-scatter"] = state + parts["gradients"] + fsdp_root_reduce_bytes(s)
    if s.optimizer == "adamw" and s.adamw_kernel == "foreach":
        moments["optimizer step"] = state - parts["gathered"] + 2 * parts["gradients"]
    where = max(moments, key=moments.get)
    peak = moments[where]
    out = {k: v / GB for k, v in parts.items()}
    out.update(peak=peak / GB, reserved=peak * (1 + ALLOCATOR_SLACK) / GB, outside_allocator=outside_allocator_gb(s))
    out["total"] = out["reserved"] + out["outside_allocator"]
    out = {k: round(v, 3) for k, v in out.items()}
    out["peak_at"] = where
    return out


def outside_allocator_gb(s: StepSetup) -> float:
    """GPU memory outside torch's caching allocator, in GB: the CUDA context (`CUDA_CONTEXT_GB`) and, when
    several processes train, NCCL's buffers (`NCCL_BUFFERS_GB`); none on the CPU."""
    if s.device != "cuda":
        return 0.0
    return CUDA_CONTEXT_GB + (NCCL_BUFFERS_GB if s.world_size > 1 else 0.0)


def fsdp_gathered_bytes(s: StepSetup) -> float:
    """Unsharded parameters held at once under fsdp: `FSDP_GATHERED_BLOCKS` blocks and the root unit
    (embedding, final norm, an untied lm_head): blocks in the gathered dtype (`StepSetup.param_bytes`),
    the root in fp32 (`FSDP_ROOT_BYTES`)."""
    return FSDP_GATHERED_BLOCKS * s.block_params * s.param_bytes + s.root_params * FSDP_ROOT_BYTES


def fsdp_root_reduce_bytes(s: StepSetup) -> float:
    """What the root unit adds at the end of fsdp's backward, beyond its gathered parameters: its unsharded
    fp32 gradients (the embedding's, computed last, and an untied lm_head's) and FSDP2's fp32 reduce-scatter
    input, into which they are copied before they are freed: 2 × 4 bytes per root parameter."""
    return 2 * 4 * s.root_params


def fsdp_reduce_buffer_bytes(s: StepSetup) -> float:
    """Backward's unsharded gradients under fsdp: one block's, in the gathered dtype, and its fp32 copy
    for the reduce-scatter (none when the parameters are fp32 already), and the lm_head's fp32 gradient
    (tied or not), which the root unit reduce-scatters only at the end of backward."""
    copy = FSDP_REDUCE_BYTES if s.param_bytes != FSDP_REDUCE_BYTES else 0
    return s.block_params * (s.param_bytes + copy) + 4 * s.vocab * s.dim


def capacity_gb(gpu_memory_gb: float, device: str) -> float:
    """Bytes (in GB) a GPU of nominal ``gpu_memory_gb`` holds: HBM sizes are GiB. Host memory as given."""
    return gpu_memory_gb * GIB / GB if device == "cuda" else gpu_memory_gb


# ----------------------------------------------------------------------------- evaluation (CORE scoring)

EVAL_MAX_BATCH_TOKENS = 131072  # cap of the default scoring batch: a no-grad forward gains little beyond it
# the cap on the CPU, where the batch is bounded by the caches, not by memory: larger batches cost more CPU
# time there (memory traffic and page faults; BENCHMARKS.md: "CI time", the evaluate rows)
EVAL_CPU_BATCH_TOKENS = 4096


def eval_memory(s: StepSetup, batch_tokens: int, in_loop: bool) -> dict[str, float]:
    """Predicted per-GPU memory in GB of CORE scoring (pipeline/evaluation/core_benchmark.py `score_requests`)
    over batches of `batch_tokens` padded tokens: ``in_loop`` beside the training state (training's
    quick subset every ``eval.core_interval`` steps: fp32 weights, optimizer state and the gradients,
    which zero_grad keeps allocated; the step's activations are freed by then), else standalone (the
    evaluate stage: the fp32 weights only). Under fsdp in the loop the weights, optimizer state and
    gradients are 1/world_size shards and ``gathered`` is the whole model, which ``gathered()`` keeps
    unsharded through the evaluation (`fsdp_evaluation_gathered_bytes`). On CUDA the body runs under bf16
    autocast whatever the training precision (flash attention: no [heads, T, T] scores), which caches
    bf16 copies of the block matrices for the forward (none when fsdp gathered them in bf16); the logits
    are fp32, ``ce_chunk`` continuation positions at a time.
    The peak is the larger of two moments of a batch: inside a block's MLP (the fp32 residual and
    norm output 8d, and silu(gate), up and their product 3·a·f per token, a = 2 bf16 / 4 fp32) and
    the LM head (the fp32 final hidden states 4nd and one chunk's fp32 logits with log-sum-exp's
    same-sized temporary, 8·c·V)."""
    P, V, d, f, n = s.params, s.vocab, s.dim, s.ffn_dim, batch_tokens
    bf16 = s.device == "cuda"
    a = 2 if bf16 else 4
    c = min(s.ce_chunk, n)
    sharded = in_loop and s.parallel == "fsdp"  # the FSDP2 model scores as it trains; standalone: final.pt whole
    W = s.world_size if sharded else 1
    # autocast caches a bf16 copy of every block matrix it casts: none when fsdp gathered them in bf16 already
    copies = 2 * s.matrix_params if bf16 and not (sharded and s.param_bytes == 2) else 0
    parts = {
        "weights": 4 * P / W,
        "optimizer": optimizer_bytes(s) / W if in_loop else 0,
        "gradients": 4 * P / W if in_loop else 0,
        "autocast_copies": copies,
        "gathered": fsdp_evaluation_gathered_bytes(s) if sharded else 0,
        "forward": n * (8 * d + 3 * a * f),
        "logits": 4 * n * d + 8 * c * V,
    }
    state = parts["weights"] + parts["optimizer"] + parts["gradients"] + parts["autocast_copies"] + parts["gathered"]
    moments = {"block forward": state + parts["forward"], "lm head": state + parts["logits"]}
    where = max(moments, key=moments.get)
    out = {k: v / GB for k, v in parts.items()}
    out.update(peak=moments[where] / GB, reserved=moments[where] * (1 + ALLOCATOR_SLACK) / GB,
               outside_allocator=outside_allocator_gb(s))
    out["total"] = out["reserved"] + out["outside_allocator"]
    out = {k: round(v, 3) for k, v in out.items()}
    out["peak_at"] = where
    out["batch_tokens"] = batch_tokens
    return out


def fsdp_evaluation_gathered_bytes(s: StepSetup) -> float:
    """The unsharded parameters of an evaluation under fsdp: ``gathered()`` (pipeline/training/parallelize.py)
    unshards every unit and keeps them through the evaluation: all L blocks in the gathered dtype
    (`StepSetup.param_bytes`) and the root in fp32 (`FSDP_ROOT_BYTES`)."""
    return s.n_layers * s.block_params * s.param_bytes + s.root_params * FSDP_ROOT_BYTES


def default_eval_batch_tokens(s: StepSetup, capacity: float) -> int:
    """``eval.core_batch_tokens: null``: the most padded tokens per scoring batch — a multiple of
    seq_len (one full-length request per row), at most `EVAL_MAX_BATCH_TOKENS` (`EVAL_CPU_BATCH_TOKENS` on
    the CPU) — whose in-loop scoring (`eval_memory`, beside the training state) fits `capacity` GB;
    seq_len when none does (the plan then reports that it does not fit). Memory, not the training
    micro-batch, bounds it.

    `eval_memory` grows with the batch, so a bisection over the row count finds it (a row-by-row scan cost
    every Snakefile parse, which prices each sweep point: BENCHMARKS.md, "CI time")."""
    most = EVAL_MAX_BATCH_TOKENS if s.device == "cuda" else EVAL_CPU_BATCH_TOKENS
    fits, unfits = 0, max(1, most // s.seq_len) + 1  # rows known to fit / not to (a sentinel)
    while unfits - fits > 1:
        rows = (fits + unfits) // 2
        if eval_memory(s, rows * s.seq_len, in_loop=True)["total"] > capacity:
            unfits = rows
        else:
            fits = rows
    return max(1, fits) * s.seq_len


def eval_batch_tokens(cfg: RunConfig, parallel: str | None = None) -> int:
    """The scoring batch of a resolved config: ``eval.core_batch_tokens``, or when null
    `default_eval_batch_tokens` for its model, optimizer and ``hardware.gpu_memory_gb``; ``parallel`` (ddp |
    fsdp) replaces ``train.parallel``, as in `StepSetup.from_config`."""
    if cfg.eval.core_batch_tokens is not None:
        return cfg.eval.core_batch_tokens
    return default_eval_batch_tokens(StepSetup.from_config(cfg, parallel=parallel),
                                     capacity_gb(cfg.hardware.gpu_memory_gb, cfg.hardware.device))


# ----------------------------------------------------------------------------- time


# ----------------------------------------------------------------------------- ddp or fsdp

def choose_parallel(cfg: RunConfig, requested: str | None = None) -> dict:
    """``train.parallel`` of a resolved config (or `requested` in its place), resolved: ``auto`` is ddp when
    ddp's predicted memory per GPU (`memory`) fits ``hardware.gpu_memory_gb`` (`capacity_gb`), else fsdp.
    Returns the choice (``parallel``), what was asked (``requested``), why (``reason``), the capacity and, for
    ddp and fsdp, the predicted memory and whether it fits. Does not refuse (`resolve_parallel` does)."""
    cap = capacity_gb(cfg.hardware.gpu_memory_gb, cfg.hardware.device)
    requested = requested or cfg.train.parallel
    mem = {m: memory(StepSetup.from_config(cfg, parallel=m)) for m in PARALLEL_MODES}
    fits = {m: mem[m]["total"] <= cap for m in PARALLEL_MODES}
    ddp, fsdp = mem["ddp"]["total"], mem["fsdp"]["total"]
    if requested == "auto":
        parallel = "ddp" if fits["ddp"] else "fsdp"
        reason = (f"auto: ddp fits ({ddp:.1f} GB of {cap:.1f} GB per GPU)" if fits["ddp"] else
                  f"auto: ddp does not fit ({ddp:.1f} GB > {cap:.1f} GB per GPU), fsdp shards the state "
                  f"({fsdp:.1f} GB)")
    else:
        parallel = requested
        if requested == "ddp":
            reason = f"train.parallel: ddp ({ddp:.1f} GB of {cap:.1f} GB per GPU)"
        elif fits["ddp"]:
            reason = f"train.parallel: fsdp (ddp would fit too, {ddp:.1f} GB of {cap:.1f} GB: auto would pick ddp)"
        else:
            reason = f"train.parallel: fsdp (ddp does not fit: {ddp:.1f} GB > {cap:.1f} GB per GPU)"
    return {"parallel": parallel, "requested": requested, "reason": reason, "capacity_gb": cap,
            "memory": mem, "fits": fits}


