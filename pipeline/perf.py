"""Per-GPU memory and step-time model of a training step, calibrated on the reference run's measurements.

Pure functions of a resolved run config (torch-free, import-light: the planner runs it at parse
time). `StepSetup.from_config(cfg, logits=...)` reads what the trainer will do; `memory(setup)`
and `step_time(setup)` predict it. Every number below is a **prediction**; the only measurements
are the reference's rows the constants were fitted to (tests/test_perf.py lists them with their
source: Part 1/2 of the reference write-up, one H100 80 GB, the 1.24B model) and what a user
measures with `python -m pipeline.bench` (which `pipeline.plan --measured-step` feeds back).

``logits`` names the loss implementation being described:

* ``ours`` (default): pipeline/model/losses.py — fp32 cross-entropy outside autocast, chunked over
  ``train.ce_chunk_tokens`` tokens with the backward fused into the forward, so no [tokens, vocab]
  tensor ever exists; the logit matmuls run at ``train.ce_matmul`` precision.
* ``bf16-materialized``: the reference trainer — ``lm_head`` under autocast materialises bf16
  [tokens, vocab] logits and their gradient (compiled: one buffer, the gradient written in place;
  eager: plus an fp32 copy, the fp32 log-softmax and its fp32 gradient). It also frees gradients at
  every ``zero_grad`` (``set_to_none=True``), where ours keeps them allocated (DDP bucket views).

Memory (bytes; GB = 1e9, as torch reports) — n = micro_batch × seq_len tokens, P parameters:

* state: fp32 weights 4P; optimizer: AdamW 8P, 8-bit AdamW 2P, Muon 4 B per block-matrix
  parameter (momentum) + AdamW's 8 B for the rest; bf16 autocast copies of the block matrices
  (2 B each) held from forward to backward by an *eager* step outside checkpointed regions; a
  compiled ddp step holds the casts of every block matrix whatever the checkpointing (`autocast_copies`).
* gradients: fp32 4P, held throughout by ours; allocated during backward by the reference (only the
  lm-head/embedding gradient 4·V·d exists when the loss backward starts).
* activations per token and layer, a = 2 under bf16 autocast else 4, the residual stream fp32:
  attention = 4d (norm input) + l·2d (the q/k/v and o_proj inputs) + a·(d + 2·d_kv) (q, k, v)
  (+ a·3d eager: pre-RoPE q/k and GQA-expanded k/v kept alive; + 4·heads·T for the fp32
  math-kernel attention, see below); mlp = 4d + l·(d + f) (the gate/up and down inputs) + a·k·f
  (gate and up outputs, k = 2 compiled; + silu's output eager, k = 3); l = a, or 1 B for fp8 linears.
  A checkpointed region stores its 4d-byte input and is rebuilt one region at a time in backward.
  fp32 SDPA on CUDA cannot use flash attention and falls back to the math kernel, which stores the
  [heads, T, T] fp32 probabilities (the reference measured this); bf16 uses flash (no T² term).
* logits / CE: ``ours`` holds one chunk's fp32 logits 4·c·V (+ 2·c·V and 2·V·d for the bf16 copies
  of the probabilities and the weight under ``ce_matmul: bf16``, + 4·V·d on CUDA there: the chunk's
  fp32 d(W) product, which fp32 operands accumulate in place) and, from forward to backward,
  the fp32 gradients w.r.t. hidden (4nd) and the output weight (4Vd), scaled in place by backward
  (+ 2nd: the hidden gradient's bf16 copy for a bf16 body). ``bf16-materialized``: 2nV
  compiled; eager 12nV at the loss backward (bf16 logits, fp32 log-softmax, its gradient, the input
  gradient).
* the peak is the larger of two moments: the loss backward starting (state, gradients so far,
  every stored activation, the logits term) and the first checkpointed block's backward (state, all
  gradients, stored activations, one rebuilt region and its backward buffers, 3 × 4nd); an
  unfused AdamW adds a third: the optimizer step's temporaries (4P).
* the compiled step, from its parts (issue 28): the loss is never compiled (pipeline/model/losses.py:
  a deliberate graph break), so its memory is the eager loss's above — one chunk's temporaries, one
  d(W) product at a time — whatever ``train.compile`` says; the compiled body holds the bf16 casts of
  every block matrix unless every block is checkpointed (`autocast_copies`). The H100 rows
  (2026-11-25, BENCHMARKS.md "Measured on an H100") were measured while the loss was still traced
  into the step's graph, where Inductor kept several chunks' fp32 d(W) products alive at once (issue
  28 counted 3 at 4 chunks and 16 at 16 on CPU; 7 at 8 is interpolated); those products plus the
  casts put the 16 × 2048 rows (none / every 2nd / every block) and the 32 × 2048 block row within
  −2 … +4 % of the measured peaks, but leave 10.9 GB of the 64 × 2048 block row (75.9 GB)
  unexplained. Whether that part went with the traced loss (e.g. several chunks' [chunk, vocab] logits
  kept alive, 4.3 GB each) is not established: `make gpu-check`'s loss-memory rows measure the
  untraced loss at 16 / 32 / 64 rows against this model. fsdp compiles per block (no casts: the
  gathered bf16 parameters are the compute copies), which nothing here has measured.
* reserved = peak × (1 + `ALLOCATOR_SLACK`) (the caching allocator's rounding and fragmentation: 6 %,
  from the H100's near-capacity rows; the constant's comment gives every measured ratio);
  total = reserved + ``outside_allocator`` (`CUDA_CONTEXT_GB`: CUDA context and cuBLAS workspace, and in a
  multi-GPU job `NCCL_BUFFERS_GB`: NCCL's FIFOs, sourced from NVIDIA's reports, not measured here) — what
  must fit in the GPU, whose nominal ``hardware.gpu_memory_gb`` is GiB (an "80 GB" H100 has 85.9e9 bytes).

Step time of one optimizer step on one GPU = grad_accum × micro-step + optimizer, divided by
`DDP_EFFICIENCY` when several GPUs train (the reference's 8×H100 rate over its 1×H100 bench):

* matmul work at the body precision's dense peak (`pipeline.budget.PEAK_FLOPS`) times a fitted
  efficiency `ETA` (``train``: forward + backward; ``recompute``: a checkpointed region's second
  forward, which runs faster per FLOP). FLOPs: 6·(block matrices) per token + causal attention
  6·L·T·d (flash computes half the square; the math kernel all of it: 12·L·T·d) + the logit matmuls
  6·V·d; recomputation adds each rebuilt region's forward.
* fp8 linears divide their matmul time by `FP8_SPEEDUP` (fitted on the reference, which converted
  every block linear: the cast/scale overhead eats most of the 2× tensor-core rate on a 2048-wide
  model). Which linears are fp8 is `fp8_converts`, the trainer's own filter (torchao's H100
  thresholds): the others keep the bf16 time and store bf16 inputs.
* logits: ``bf16-materialized`` runs its matmuls with the body; ``ours`` runs them at ``ce_matmul``'s
  peak (bf16 989, TF32 494.5, fp32 67 TFLOP/s on an H100) × ETA, plus the chunked softmax's memory
  traffic (`CE_BYTES_PER_LOGIT` per logit: the loss runs eagerly, compiled step or not) at the HBM
  bandwidth × `ETA["memory"]`.
* uncompiled runs: the body's time × `EAGER_FACTOR` (kernel launches and unfused elementwise ops).
* optimizer: bytes moved per parameter (`OPTIMIZER_BYTES`, incl. clipping) at the HBM bandwidth,
  plus Muon's Newton–Schulz matmuls (5 iterations of 4m²n + 2m³ FLOPs per m×n matrix, m ≤ n) in bf16;
  under fsdp each matrix has one owner rank (pipeline/training/optim.py), so a rank runs 1/W of them.

FSDP (``train.parallel: fsdp``: FSDP2 ``fully_shard`` per transformer block and on the root, bf16
parameters in compute under bf16 training, fp32 reduce-scatter, fp32 master weights), W = world size
(hardware.nodes × nproc_per_node: the state is sharded over every rank of the job, multi-node included),
B = one block's parameters (its matrices and two norm gains), R = the root unit's (embedding, final
norm, an untied lm_head), p = 2 (bf16) or 4 (fp32) bytes per gathered block parameter; the root
unit keeps fp32 parameters (`FSDP_ROOT_BYTES`: the trainer's mixed-precision policy covers the blocks
only, so the chunked fp32 CE reads the gathered fp32 output weight, pipeline/training/step.py):

* memory: fp32 weights, optimizer state and fp32 gradients are a 1/W shard (4P/W, optimizer/W, 4P/W);
  ``gathered`` = `FSDP_GATHERED_BLOCKS` · B · p + R · 4, held throughout the step (FSDP2's prefetch keeps
  the current and the next block unsharded; the root stays unsharded from its forward to the end of
  backward); ``reduce_buffers`` (from the first block backward on) = B · (p + 4 if p = 2, else 4): one
  block's gradients in the gathered dtype and their fp32 reduce-scatter copy, + 4·V·d: the lm_head's
  fp32 gradient, reduce-scattered with the root at the end of backward. No autocast copies (the gathered
  bf16 parameters are the compute copies). Activations, the fp32 CE chunk and the moments are ddp's,
  plus a third: the root's reduce-scatter at the end of backward (activations freed; the root's unsharded
  fp32 gradients and FSDP2's fp32 reduce-scatter input, 8 bytes per root parameter, beside its gathered
  fp32 parameters: `fsdp_root_reduce_bytes`). CORE scoring in the training loop holds the same shards
  and, under ``gathered()``, the whole model unsharded (`fsdp_evaluation_gathered_bytes`: every block in
  the gathered dtype, the root in fp32); the standalone evaluate stage loads the consolidated final.pt
  (ddp's figure).
* time: the compute is ddp's, with the optimizer on the 1/W shard, and the multi-GPU overhead
  `DDP_EFFICIENCY` fitted on the reference's 8-GPU run applies to both; fsdp adds the exposed part of
  its collectives (`fsdp_comm`): per micro-step all-gathers of `FSDP_BLOCK_GATHERS` · L · B · p +
  `FSDP_ROOT_GATHERS` · R · 4 bytes and a reduce-scatter of P · `FSDP_REDUCE_BYTES`, each ring moving
  (W−1)/W of them through a GPU's link at `collective_bytes_per_s` (NVLink within a node,
  `INTRA_NODE_BYTES_PER_S`; across nodes min(that, GPUs per node × `IB_BYTES_PER_S_PER_GPU`); ×
  `COLLECTIVE_EFFICIENCY`); exposed = max(0, comm − edge − `FSDP_OVERLAP` × compute) + edge per
  micro-step, the edge (the root's and one block's all-gather and reduce-scatter, before the first and
  after the last compute) never hidden. The trainer is priced as resharding and reduce-scattering every
  micro-step; one that keeps parameters gathered across accumulation micro-steps would send fewer bytes
  and hold more. None of these constants is fitted: no FSDP step has been measured here.
* ``auto`` (`choose_parallel`): ddp when ddp's predicted total fits the GPU, else fsdp;
  `resolve_parallel` refuses a choice that does not fit, naming train.parallel and the fix. ddp
  across nodes keeps the single-node `DDP_EFFICIENCY` (its all-reduce over InfiniBand is not modelled).

Predicted MFU = flops_per_token (pipeline.budget's formula, the one MFU is logged with) × tokens /
(step time × peak of the body precision: bf16, or true fp32 when the run is fp32, since an fp32 run
sets ``highest`` matmul precision). On CPU the peak (1 TFLOP/s) and bandwidth are nominal: the
model then gives a number, not a prediction worth trusting.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipeline.budget import GPU_TYPE_ALIASES, HBM_BYTES_PER_S, PEAK_FLOPS, BatchLayout, flops_per_token, peak_flops
from pipeline.errors import PlanError
from pipeline.stages import ADAMW8BIT_FSDP, adamw8bit_keys

GB = 1e9
GIB = 2 ** 30
LOGITS_MODES = ("ours", "bf16-materialized")

# ---- which linears fp8 converts: torchao's own H100 thresholds (one function, the trainer's and the model's)

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_FILTERS = ("torchao", "all")


def fp8_converts(recipe: str, out_features: int, in_features: int, fp8_filter: str = "torchao") -> bool:
    """Whether fp8 training converts an nn.Linear of weight [out_features, in_features] (N, K).

    ``torchao`` (what the trainer does, `pipeline.training.step.apply_fp8`): torchao's
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


# ---- fitted to the reference's measured rows (tests/test_perf.py: REFERENCE_ROWS) — one place.
ETA = {
    "train": {"bf16": 0.53, "fp32": 0.70},  # compiled forward+backward matmul FLOPs / (peak × time)
    "recompute": 0.72,                      # a checkpointed region's second forward (bf16)
    "memory": 0.8,                          # achieved / datasheet HBM bandwidth of streaming kernels
}
EAGER_FACTOR = {"bf16": 1.42, "fp32": 1.10}  # uncompiled body time / compiled (8×2048 bf16; 3 vs 4×2048 fp32)
FP8_SPEEDUP = {"tensorwise": 1.146, "rowwise": 0.975}  # fp8 linears' matmul time ÷ this (reference −10% / +2%)
OPTIMIZER_BYTES = {"adamw-fused": 36, "adamw-foreach": 81, "adamw8bit": 24, "muon": 36}  # per parameter, with clipping
CE_BYTES_PER_LOGIT = 32  # ours: memory traffic of the chunked softmax per logit (eager: never compiled)
DDP_EFFICIENCY = 50_000 / 55_540  # 8×H100 run: 400k tok/s ÷ 8 GPUs vs the 1-GPU bench's 64×2048 / 2.36 s
# reserved / peak allocated − 1 of the caching allocator (rounding, fragmentation, cache). Measured on the H100
# (BENCHMARKS.md "Measured on an H100": our 7 steps and 2 CORE scorings) 3–11 %: 3.0 / 4.2 / 6.0 % for the
# three steps that reserved within 7 GB of the 85.5 GB card (under pressure the allocator frees its cached
# blocks and retries before it reports out-of-memory, so what remains is fragmentation), 5.8–11.4 % where the
# cache had room to grow; the reference write-up's rows (tests/test_perf.py) 1–8 % (37 % in its eager SDPA
# row). 6 %: the largest of the near-capacity steps, the ratio a plan at the edge of the GPU must leave.
ALLOCATOR_SLACK = 0.06
# CUDA context and cuBLAS workspace of one process: assumed (typically 0.3-0.6 GB on an H100 with CUDA 12; the
# H100 session recorded torch's allocator only, so this part of the card was not measured here).
CUDA_CONTEXT_GB = 0.5
# NCCL's device memory per process of a multi-GPU job, outside torch's allocator (one communicator: the job's
# process group; DDP and FSDP2 use no other): per channel and peer a FIFO per protocol (Simple 4 MiB =
# NCCL_BUFFSIZE, LL128 ~4.6 MiB, LL 256 KiB: NCCL docs, env.html), up to 32 channels on NVLink H100s; reported
# about 1.06 GB on 8 H100s after init (NVIDIA/nccl#1685) and 1.6 GB with one communicator after an all-reduce,
# context included (NVIDIA/nccl#864). 1 GB: the latter less `CUDA_CONTEXT_GB`, rounded. Not measured here.
NCCL_BUFFERS_GB = 1.0
MUON_NS_STEPS = 5

# ---- FSDP2 (train.parallel: fsdp): stated assumptions, not fitted (no FSDP step has been measured on a GPU
# here); the module docstring's "FSDP" paragraphs say where each enters.
PARALLEL_MODES = ("ddp", "fsdp")
FSDP_GATHERED_BLOCKS = 2      # unsharded blocks at once: the current one and the next, which FSDP2's implicit
                              # prefetch all-gathers during the current one's compute (forward and backward)
FSDP_BLOCK_GATHERS = 2        # all-gathers of a block per micro-step: forward, and again in backward
                              # (reshard_after_forward=True, FSDP2's default for the non-root units)
FSDP_ROOT_BYTES = 4           # the root unit's gathered parameters stay fp32 (the trainer's policy: blocks only)
FSDP_ROOT_GATHERS = 1         # the root unit (embedding, final norm, lm_head): FSDP2 keeps the root unsharded
                              # from its forward to the end of backward, so it is gathered once
FSDP_REDUCE_BYTES = 4         # gradient bytes per parameter reduce-scattered: fp32 (reduce_dtype=float32)
FSDP_OVERLAP = 0.8            # share of a micro-step's compute under which its collectives can hide (the
                              # collectives' kernels take SMs and HBM bandwidth from the compute they overlap)
# One direction of a GPU's link to the other GPUs of its node, bytes/s (NVIDIA datasheets): NVLink 4
# (H100/H200 SXM, GH200) 900 GB/s bidirectional, NVLink 3 (A100 SXM) 600 GB/s; parts whose NVLink bridge joins
# 2 or 4 GPUs only (H100 PCIe/NVL, H200 NVL) reach the rest of an 8-GPU node over PCIe Gen5 x16 (128 GB/s
# bidirectional), A100 PCIe and L40S over PCIe Gen4 x16 (64 GB/s). cpu: a nominal figure for gloo.
INTRA_NODE_BYTES_PER_S = {
    "H100-SXM": 450e9, "H200": 450e9, "GH200": 450e9, "GH200-144GB": 450e9,
    "H100-PCIe": 64e9, "H100-NVL": 64e9, "H200-NVL": 64e9,
    "A100-40GB": 300e9, "A100-80GB": 300e9, "A100-80GB-PCIe": 32e9, "L40S": 32e9,
    "cpu": 5e9,
}
# Between nodes: one 400 Gb/s NDR InfiniBand NIC (ConnectX-7) per GPU, as in NVIDIA's DGX H100 / HGX
# reference architecture (8 NICs per 8-GPU node): 50 GB/s per GPU and direction.
IB_BYTES_PER_S_PER_GPU = 50e9
# Achieved bus bandwidth of NCCL's ring collectives / the link rate above (an assumption: nccl-tests report
# about 75-85 % on NVLink and NDR fabrics; not measured here).
COLLECTIVE_EFFICIENCY = 0.8


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
    def from_config(cls, cfg: dict, logits: str = "ours", parallel: str | None = None) -> StepSetup:
        """The trainer's step for a resolved run config; ``logits="bf16-materialized"`` describes the
        reference trainer instead (its loss, and gradients freed at every zero_grad). ``parallel``
        (ddp | fsdp) replaces ``train.parallel``; ``auto`` is resolved by `choose_parallel`."""
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        model, train, hw = cfg["model"], cfg["train"], cfg["hardware"]
        parallel = parallel or train["parallel"]
        if parallel == "auto":
            parallel = choose_parallel(cfg)["parallel"]
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        cuda = hw["device"] == "cuda"
        batch = BatchLayout.from_config(cfg)
        bf16 = cuda and train["precision"] == "bf16"
        return cls(
            vocab=model["vocab_size"], dim=model["dim"], n_layers=model["n_layers"], n_heads=model["n_heads"],
            n_kv_heads=model["n_kv_heads"], ffn_dim=model["ffn_dim"], tied=model["tie_embeddings"],
            micro_batch=batch.micro_batch, seq_len=batch.seq_len, grad_accum=batch.grad_accum_steps,
            world_size=batch.world_size, device=hw["device"], gpu_type=hw["gpu_type"] if cuda else "cpu", bf16=bf16,
            compile=cuda if train["compile"] == "auto" else bool(train["compile"]),
            checkpoint=train["activation_checkpointing"], every_n=train["checkpoint_every_n"],
            optimizer=train["optimizer"],
            adamw_kernel="fused" if cuda else "foreach", fp8=train["fp8"], logits=logits,
            fp8_filter="torchao" if logits == "ours" else "all",
            ce_chunk=train["ce_chunk_tokens"], ce_matmul=ce_matmul_precision(cfg),
            grads_persistent=logits == "ours", parallel=parallel, nodes=hw["nodes"],
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


def ce_matmul_precision(cfg: dict) -> str:
    """``train.ce_matmul`` resolved: ``auto`` is bf16 beside a bf16 body on CUDA, else fp32 (the one
    place the trainer and the model read it from)."""
    train = cfg["train"]
    setting = train.get("ce_matmul", "auto")
    if setting != "auto":
        return setting
    return "bf16" if cfg["hardware"]["device"] == "cuda" and train["precision"] == "bf16" else "fp32"


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
    """What the loss adds when its backward starts (see the module docstring)."""
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
    the traced loss's products, module docstring; with every block checkpointed the reference
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
    blocks and root) and ``reduce_buffers`` (backward's unsharded gradients) are added (module docstring)."""
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
# the cap on the CPU, where the batch is bounded by the caches, not by memory: the default model's evaluate
# stage (997 CORE items, seq_len 256, one thread) took 91 CPU-s in batches of 131072 tokens (their MLP
# activations 268 MB a tensor: memory traffic and 29 s of page faults) and 51 CPU-s in batches of 4096
EVAL_CPU_BATCH_TOKENS = 4096


def eval_memory(s: StepSetup, batch_tokens: int, in_loop: bool) -> dict[str, float]:
    """Predicted per-GPU memory in GB of CORE scoring (pipeline/evaluation/core.py `score_requests`)
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
    """The unsharded parameters of an evaluation under fsdp: ``gathered()`` (pipeline/training/step.py)
    unshards every unit and keeps them through the evaluation: all L blocks in the gathered dtype
    (`StepSetup.param_bytes`) and the root in fp32 (`FSDP_ROOT_BYTES`)."""
    return s.n_layers * s.block_params * s.param_bytes + s.root_params * FSDP_ROOT_BYTES


def default_eval_batch_tokens(s: StepSetup, capacity: float) -> int:
    """``eval.core_batch_tokens: null``: the most padded tokens per scoring batch — a multiple of
    seq_len (one full-length request per row), at most `EVAL_MAX_BATCH_TOKENS` (`EVAL_CPU_BATCH_TOKENS` on
    the CPU) — whose in-loop scoring (`eval_memory`, beside the training state) fits `capacity` GB;
    seq_len when none does (the plan then reports that it does not fit). Memory, not the training
    micro-batch, bounds it.

    `eval_memory` grows with the batch, so a bisection over the row count finds it in ~9 evaluations (a
    row-by-row scan took 512 at seq_len 256: 0.3 s of every Snakefile parse, which prices each sweep point)."""
    most = EVAL_MAX_BATCH_TOKENS if s.device == "cuda" else EVAL_CPU_BATCH_TOKENS
    fits, unfits = 0, max(1, most // s.seq_len) + 1  # rows known to fit / not to (a sentinel)
    while unfits - fits > 1:
        rows = (fits + unfits) // 2
        if eval_memory(s, rows * s.seq_len, in_loop=True)["total"] > capacity:
            unfits = rows
        else:
            fits = rows
    return max(1, fits) * s.seq_len


def eval_batch_tokens(cfg: dict) -> int:
    """The scoring batch of a resolved config: ``eval.core_batch_tokens``, or when null
    `default_eval_batch_tokens` for its model, optimizer and ``hardware.gpu_memory_gb``."""
    explicit = cfg["eval"]["core_batch_tokens"]
    if explicit is not None:
        return explicit
    hw = cfg["hardware"]
    return default_eval_batch_tokens(StepSetup.from_config(cfg), capacity_gb(hw["gpu_memory_gb"], hw["device"]))


# ----------------------------------------------------------------------------- time

def body_flops(s: StepSetup) -> dict[str, float]:
    """Per-token FLOPs the GPU executes in the body: ``train`` (forward + backward, fp8-able linears
    apart) and ``recompute`` (checkpointed regions' second forward)."""
    T, d, L = s.seq_len, s.dim, s.n_layers
    attn_fwd = (4 if s.math_attention else 2) * T * d  # QKᵀ and AV per layer; causal flash does half
    attention = 2 * s.attention_matrix_params  # per layer
    mlp = 2 * s.mlp_matrix_params
    linear = 3 * L * (attention + mlp)
    sdpa = 3 * L * attn_fwd
    rebuilt = {
        "none": 0,
        "mlp": L * mlp,
        "attention": L * (attention + attn_fwd),
        "block": L * (attention + mlp + attn_fwd),
        "every_n": math.ceil(L / s.every_n) * (attention + mlp + attn_fwd),
    }[s.checkpoint]
    return {"linear": linear, "sdpa": sdpa, "recompute": rebuilt}


def _peak(s: StepSetup, precision: str) -> float:
    return PEAK_FLOPS[s.gpu_type][precision]


def step_time(s: StepSetup) -> dict[str, float]:
    """Predicted seconds of one optimizer step on one GPU, by component, with ``total``."""
    n, V, d = s.tokens, s.vocab, s.dim
    body_precision = "bf16" if s.bf16 else "fp32"
    peak, bw = _peak(s, body_precision), HBM_BYTES_PER_S[s.gpu_type] * ETA["memory"]
    f = body_flops(s)
    rate = peak * ETA["train"][body_precision]
    linear = n * f["linear"] / rate
    if s.fp8 != "none" and s.bf16:  # only the converted linears' matmuls (`fp8_converts`) speed up
        conv, shapes = s.fp8_linears(), s.linear_shapes()
        share = sum(o * i for k, (o, i) in shapes.items() if conv[k]) / sum(o * i for o, i in shapes.values())
        linear *= 1 - share + share / FP8_SPEEDUP[s.fp8]
    body = linear + n * f["sdpa"] / rate + n * f["recompute"] / (peak * ETA["recompute"])
    lm_flops = 6 * V * d * n
    if s.logits == "bf16-materialized":
        body += lm_flops / rate
        logits = 0.0
    else:
        ce_peak = _peak(s, s.ce_matmul) if s.device == "cuda" else peak
        eta = ETA["train"]["fp32" if s.ce_matmul == "fp32" else "bf16"]
        logits = lm_flops / (ce_peak * eta) + n * V * CE_BYTES_PER_LOGIT / bw
    if not s.compile:
        body *= EAGER_FACTOR[body_precision]
    kernel = s.optimizer if s.optimizer != "adamw" else f"adamw-{s.adamw_kernel}"
    fsdp = s.parallel == "fsdp"
    optimizer = s.params / (s.world_size if fsdp else 1) * OPTIMIZER_BYTES[kernel] / bw  # fsdp: its shard
    if s.optimizer == "muon":  # fsdp: one owner rank per matrix orthogonalises it
        optimizer += muon_flops(s) / (s.world_size if fsdp else 1) / (_peak(s, "bf16") * ETA["train"]["bf16"])
    out = {"body": s.grad_accum * body, "logits": s.grad_accum * logits, "optimizer": optimizer}
    total = sum(out.values())
    if s.world_size > 1:
        out["ddp"] = total / DDP_EFFICIENCY - total
    if fsdp:
        out["fsdp_comm"] = fsdp_comm(s, body + logits)["exposed_s"]
    out["total"] = sum(out.values())
    return out


def collective_bytes_per_s(s: StepSetup) -> float:
    """Achieved bus bandwidth of the job's ring collectives: NVLink (or PCIe) within a node; across
    nodes each of a node's rings crosses to the next node on its own NIC, so a ring of several nodes
    runs at min(intra-node link, GPUs per node × one NIC), × `COLLECTIVE_EFFICIENCY`."""
    gpu = "cpu" if s.device != "cuda" else GPU_TYPE_ALIASES.get(s.gpu_type, s.gpu_type)
    link = INTRA_NODE_BYTES_PER_S[gpu]
    if s.nodes > 1:
        link = min(link, s.gpus_per_node * IB_BYTES_PER_S_PER_GPU)
    return link * COLLECTIVE_EFFICIENCY


def fsdp_comm(s: StepSetup, micro_compute_s: float) -> dict[str, float]:
    """FSDP2's collectives of one optimizer step and the part of them compute does not hide.

    Per micro-step (the trainer reshards and reduce-scatters every micro-step): all-gather bytes =
    `FSDP_BLOCK_GATHERS` × L × block × gathered bytes + `FSDP_ROOT_GATHERS` × root × `FSDP_ROOT_BYTES`;
    reduce-scatter bytes = P × `FSDP_REDUCE_BYTES`. A ring collective over W ranks moves (W−1)/W of
    those bytes through each GPU's link: seconds = bytes × (W−1)/W / `collective_bytes_per_s`. FSDP2
    prefetches the next unit's all-gather during the current unit's compute and reduce-scatters a
    block while the previous one runs backward, so a micro-step exposes max(0, comm − edge −
    `FSDP_OVERLAP` × compute) + edge, where the edge (the first unit's all-gather before any compute,
    the last unit's reduce-scatter after it: the root and one block, each way) cannot hide."""
    W = s.world_size
    ring = (W - 1) / W / collective_bytes_per_s(s) if W > 1 else 0.0
    pb = s.param_bytes
    gather = FSDP_BLOCK_GATHERS * s.n_layers * s.block_params * pb + FSDP_ROOT_GATHERS * s.root_params * FSDP_ROOT_BYTES
    reduce = s.params * FSDP_REDUCE_BYTES
    edge = (s.block_params * (pb + FSDP_REDUCE_BYTES) + s.root_params * (FSDP_ROOT_BYTES + FSDP_REDUCE_BYTES)) * ring
    comm = (gather + reduce) * ring
    exposed = max(0.0, comm - edge - FSDP_OVERLAP * micro_compute_s) + min(edge, comm)
    return {"allgather_bytes": s.grad_accum * gather, "reduce_scatter_bytes": s.grad_accum * reduce,
            "comm_s": s.grad_accum * comm, "exposed_s": s.grad_accum * exposed,
            "bus_bytes_per_s": collective_bytes_per_s(s)}


def muon_flops(s: StepSetup) -> float:
    """Newton–Schulz FLOPs of one Muon step over the block matrices."""
    d, dkv, f = s.dim, s.d_kv, s.ffn_dim
    shapes = [(d, d), (d, d), (dkv, d), (dkv, d), (f, d), (f, d), (d, f)]
    per_layer = sum(4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3 for a, b in shapes)
    return MUON_NS_STEPS * s.n_layers * per_layer


def model_flops_per_token(s: StepSetup) -> float:
    """pipeline.budget.flops_per_token of this setup's model: the FLOPs MFU is logged with."""
    model = {"vocab_size": s.vocab, "dim": s.dim, "n_layers": s.n_layers, "n_heads": s.n_heads,
             "n_kv_heads": s.n_kv_heads, "ffn_dim": s.ffn_dim, "tie_embeddings": s.tied}
    return flops_per_token({"model": model, "train": {"seq_len": s.seq_len}})


def step_seconds(cfg: dict, logits: str = "ours") -> tuple[float, str]:
    """Seconds of one optimizer step and their basis: at `hardware.assumed_mfu` when set, else predicted
    (`step_time`). A measured step (`pipeline.plan --measured-step`) overrides both in the plan."""
    setup = StepSetup.from_config(cfg, logits)
    mfu = cfg["hardware"]["assumed_mfu"]
    if mfu is None:
        return step_time(setup)["total"], "predicted (pipeline.perf)"
    flops = flops_per_token(cfg) * cfg["train"]["global_batch_tokens"]
    return flops / (setup.world_size * peak_flops(cfg) * mfu), "hardware.assumed_mfu"


def predicted_mfu(s: StepSetup, seconds: float | None = None) -> float:
    """MFU of a step of `seconds` (default: the predicted step time) against the body precision's peak."""
    seconds = step_time(s)["total"] if seconds is None else seconds
    tokens = s.tokens * s.grad_accum
    return model_flops_per_token(s) * tokens / (seconds * _peak(s, "bf16" if s.bf16 else "fp32"))


def measured_step_seconds(s: StepSetup, micro_step_s: float) -> float:
    """An optimizer step's seconds from one measured `pipeline.bench` step (one micro-batch with its
    optimizer step, one GPU): × grad_accum (counting the optimizer once per micro-step, an over-
    estimate of (grad_accum − 1) optimizer steps), with the predicted DDP overhead on several GPUs."""
    seconds = s.grad_accum * micro_step_s
    return seconds / DDP_EFFICIENCY if s.world_size > 1 else seconds


# ----------------------------------------------------------------------------- ddp or fsdp

def _gpu_words(cfg: dict, cap: float) -> str:
    hw = cfg["hardware"]
    if hw["device"] != "cuda":
        return f"the {cap:.1f} GB of host memory hardware.gpu_memory_gb gives a process"
    return f"an {hw['gpu_type']}'s {cap:.1f} GB (hardware.gpu_memory_gb {hw['gpu_memory_gb']:g} GiB)"


def choose_parallel(cfg: dict) -> dict:
    """``train.parallel`` of a resolved config, resolved: ``auto`` is ddp when ddp's predicted memory per
    GPU (`memory`) fits ``hardware.gpu_memory_gb`` (`capacity_gb`), else fsdp. Returns the choice
    (``parallel``), what was asked (``requested``), why (``reason``), the capacity and, for ddp and
    fsdp, the predicted memory and whether it fits. Does not refuse (`resolve_parallel` does)."""
    hw = cfg["hardware"]
    cap = capacity_gb(hw["gpu_memory_gb"], hw["device"])
    requested = cfg["train"]["parallel"]
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


def smaller_micro_batch(cfg: dict, parallel: str) -> tuple[int, float] | None:
    """(the largest train.micro_batch below the config's whose layout divides the global batch and whose
    predicted memory under `parallel` fits, its total GB), or None."""
    hw, train = cfg["hardware"], cfg["train"]
    cap = capacity_gb(hw["gpu_memory_gb"], hw["device"])
    base = StepSetup.from_config(cfg, parallel=parallel)
    row_tokens = train["seq_len"] * base.world_size
    if train["global_batch_tokens"] % row_tokens:
        return None
    rows = train["global_batch_tokens"] // row_tokens  # micro_batch must divide it
    divisors = {k for i in range(1, math.isqrt(rows) + 1) if rows % i == 0 for k in (i, rows // i)}
    for mb in sorted((k for k in divisors if k < train["micro_batch"]), reverse=True):
        total = memory(base.replace(micro_batch=mb, grad_accum=rows // mb))["total"]
        if total <= cap:
            return mb, total
    return None


def resolve_parallel(cfg: dict) -> dict:
    """`cfg` with ``train.parallel`` resolved to ddp or fsdp (`choose_parallel`), refusing a choice whose
    predicted memory per GPU does not fit: one `PlanError` naming train.parallel and the fix (fsdp, a
    smaller micro-batch that fits, more GPUs or activation checkpointing), and ``auto`` resolving to fsdp
    beside adamw8bit (`ADAMW8BIT_FSDP`; an explicit fsdp is refused by pipeline.config's checks). What the
    Snakefile does at parse time, so rules and the trainer receive a concrete value."""
    c = choose_parallel(cfg)
    parallel, cap, mem, fits = c["parallel"], c["capacity_gb"], c["memory"], c["fits"]
    if not fits[parallel]:
        m = mem[parallel]
        state = m["weights"] + m["optimizer"] + m["gradients"]
        asked = "auto (neither fits)" if c["requested"] == "auto" else parallel
        what = ("a full replica of weights, gradients and optimizer state" if parallel == "ddp"
                else "weights, gradients and optimizer state sharded over the world size")
        fixes = []
        if parallel == "ddp" and fits["fsdp"]:
            fixes.append(f"set train.parallel: fsdp (or auto), {mem['fsdp']['total']:.1f} GB per GPU")
        for mode in ("ddp", "fsdp") if parallel == "ddp" else ("fsdp",):
            smaller = smaller_micro_batch(cfg, mode)
            if smaller and (mode == parallel or len(fixes) < 2 and not fits["fsdp"]):
                where = "" if mode == parallel else f" with train.parallel: {mode}"
                fixes.append(f"lower train.micro_batch to {smaller[0]}{where} ({smaller[1]:.1f} GB per GPU)")
                if mode == parallel and not fits["fsdp"]:
                    break  # a smaller micro-batch of the asked parallelism is the one fix to name
        if not fixes:
            fixes.append("add GPUs (hardware.nodes: fsdp shards over all of them)"
                         + ("" if cfg["train"]["activation_checkpointing"] == "block"
                            else " or checkpoint activations (train.activation_checkpointing: block)"))
        raise PlanError(
            f"config key 'train.parallel': {asked} does not fit the GPU's memory: {parallel} needs "
            f"{m['total']:.1f} GB per GPU (predicted by pipeline.perf; {what}: {state:.1f} GB) of "
            f"{_gpu_words(cfg, cap)}" + (f"; fsdp would need {mem['fsdp']['total']:.1f} GB"
                                          if parallel == "ddp" and not fits["fsdp"] else "")
            + "; " + " or ".join(fixes))
    if parallel == "fsdp" and adamw8bit_keys(cfg):
        raise PlanError(
            f"config key 'train.parallel': {c['reason']}, but {' and '.join(adamw8bit_keys(cfg))} set "
            f"adamw8bit: {ADAMW8BIT_FSDP}; use adamw or muon there, or "
            "make ddp fit (a smaller train.micro_batch, train.activation_checkpointing: block)")
    out = {**cfg, "train": {**cfg["train"], "parallel": parallel}}
    return out
