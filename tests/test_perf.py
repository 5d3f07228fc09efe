"""pipeline.planning against the reference run's measured rows (the calibration targets of issue 14).

Source: ../shared/reference/how-to-train-an-llm-part1.md and part2.md — the 1.24B Llama-3-style
model (vocab 131,072, dim 2048, 16 layers, 32/8 heads, SwiGLU 8192, tied), [micro_batch, 2048]
random tokens, one H100 80 GB, their trainer: bf16 [tokens, vocab] logits (`bf16-materialized`),
`optimizer.zero_grad()` freeing gradients, torch.compile unless noted. Memory rows are the range
[step-1 peak allocated, steady reserved] in GB (torch's 1e9 bytes); the model's predicted reserved
memory must lie within ±10% of that range. Step time: median of the steady steps the write-up
prints (steps 2-4), seconds; the prediction must lie within ±10%.

Rows the write-up gives relative to another row are derived from that row and say so; their
checkpoint mode or optimizer is inferred where the write-up leaves it implicit (noted).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from builders import ROOT

from pipeline.planning.fitted import DDP_EFFICIENCY
from pipeline.planning.memory import StepSetup, capacity_gb, eval_memory, memory
from pipeline.planning.step_time import predicted_mfu, step_time

REFERENCE = StepSetup(vocab=131072, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tied=True,
                      micro_batch=16, seq_len=2048, logits="bf16-materialized", grads_persistent=False)

# (source section, setup changes from REFERENCE, [peak, reserved] GB or None, step seconds or None)
P1, P2 = "Part 1", "Part 2"
REFERENCE_ROWS = [
    (f"{P1}, Torch Compile: no optimizations (fp32 eager, torch AdamW's default foreach kernel)",
     dict(micro_batch=3, bf16=False, compile=False, adamw_kernel="foreach"), (69.83, 72.32), 1.234),
    (f"{P1}, Torch Compile: reduce-overhead, fullgraph (fp32)",
     dict(micro_batch=4, bf16=False, adamw_kernel="foreach"), (77.23, 82.94), 1.480),
    (f"{P1}, Mixed Precision (bf16 autocast, foreach AdamW)",
     dict(adamw_kernel="foreach"), (73.05, 78.59), 0.525),
    (f"{P1}, Fused AdamW", dict(), (73.05, 73.63), 0.504),
    (f"{P1}, Gradient Checkpointing: every second layer", dict(checkpoint="every_n", every_n=2), (49.09, 49.73), 0.568),
    (f"{P1}, Gradient Checkpointing: all layers", dict(checkpoint="block"), (29.03, 29.67), 0.600),
    (f"{P1}, Gradient Checkpointing: [64, 2048]", dict(checkpoint="block", micro_batch=64), (68.09, 73.77), 2.360),
    (f"{P2}, Flash Attention 3: PyTorch SDPA without torch.compile, [8, 2048] (checkpointing all layers as in "
     "Part 1's final setting; allocated 14.97 GB = fp32 AdamW)",
     dict(micro_batch=8, checkpoint="block", compile=False), (39.33, 53.70), 0.427),
    (f"{P2}, Flash Attention 3: PyTorch SDPA with torch.compile, [8, 2048] (allocated 7.45 GB = 6 B/param: "
     "8-bit AdamW; checkpointing all layers)",
     dict(micro_batch=8, checkpoint="block", optimizer="adamw8bit"), (16.56, 18.23), 0.301),
    (f"{P2}, Gradient Checkpointing table: Attention (+6% compute, -11% reserved vs the fused-AdamW row)",
     dict(checkpoint="attention"), (73.05 * 0.89, 73.63 * 0.89), 0.504 * 1.06),
    (f"{P2}, Gradient Checkpointing table: SwiGLU (+6%, -40%)",
     dict(checkpoint="mlp"), (73.05 * 0.60, 73.63 * 0.60), 0.504 * 1.06),
    (f"{P2}, Gradient Checkpointing table: Full Block (+17%, -56%)",
     dict(checkpoint="block"), (73.05 * 0.44, 73.63 * 0.44), 0.504 * 1.17),
    (f"{P1}, Extras + {P2}, 8-bit AdamW: [64, 2048], reserved 10 GB lower, allocated 6 B/param lower (7.45 GB), "
     "MFU ~0.1% lower", dict(checkpoint="block", micro_batch=64, optimizer="adamw8bit"),
     (68.09 - 7.45, 73.77 - 10), 2.360 / 0.999),
    # fp8 (torchao): the write-up gives "step time -10% (tensorwise) / +2% (rowwise), memory -20%" at
    # [64, 2048]. Memory is not a calibration target: with every block checkpointed no linear input is
    # stored, so fp8 cannot reduce the logits-dominated peak by 20% in this model; the write-up does not
    # say which memory figure or which base it compared (see test_fp8_memory_is_not_calibrated).
    (f"{P2}, FP8 Math: TorchAO tensorwise, [64, 2048] (-10% step time)",
     dict(checkpoint="block", micro_batch=64, fp8="tensorwise", fp8_filter="all"), None, 2.360 * 0.90),
    (f"{P2}, FP8 Math: TorchAO rowwise, [64, 2048] (+2% step time)",
     dict(checkpoint="block", micro_batch=64, fp8="rowwise", fp8_filter="all"), None, 2.360 * 1.02),
]
# Part 1, Battling the training overlords / end: the 8×H100 run at [64, 2048] per GPU, every block
# checkpointed, no accumulation: "400k tok/s" over 8 GPUs.
MEASURED_8XH100_TOKENS_PER_S_PER_GPU = 400_000 / 8


def _ids(rows):
    return [r[0].split(":")[0][:60] + f"#{i}" for i, r in enumerate(rows)]


MEMORY_ROWS = [r for r in REFERENCE_ROWS if r[2] is not None]


@pytest.mark.parametrize("source,changes,measured,_", MEMORY_ROWS, ids=_ids(MEMORY_ROWS))
def test_memory_within_10_percent_of_measured_range(source, changes, measured, _):
    peak, reserved = measured
    predicted = memory(REFERENCE.replace(**changes))["reserved"]
    assert 0.9 * peak <= predicted <= 1.1 * reserved, (source, predicted, measured)


@pytest.mark.parametrize("source,changes,_,seconds", REFERENCE_ROWS, ids=_ids(REFERENCE_ROWS))
def test_step_time_within_10_percent(source, changes, _, seconds):
    predicted = step_time(REFERENCE.replace(**changes))["total"]
    assert predicted == pytest.approx(seconds, rel=0.10), (source, predicted, seconds)


def test_8xh100_rate_per_gpu():
    s = REFERENCE.replace(checkpoint="block", micro_batch=64, world_size=8)
    rate = s.tokens / step_time(s)["total"]
    assert rate == pytest.approx(MEASURED_8XH100_TOKENS_PER_S_PER_GPU, rel=0.10)
    assert 0.8 < DDP_EFFICIENCY < 1


def test_fp8_memory_is_not_calibrated():
    """The documented gap: the model predicts fp8 at the bf16 row's memory (compiled casts are
    recomputed, checkpointed blocks store only their inputs), not the write-up's −20%."""
    bf16 = memory(REFERENCE.replace(checkpoint="block", micro_batch=64))
    fp8 = memory(REFERENCE.replace(checkpoint="block", micro_batch=64, fp8="tensorwise"))
    assert fp8["reserved"] <= bf16["reserved"]
    no_ckpt = REFERENCE.replace(micro_batch=4)
    assert memory(no_ckpt.replace(fp8="tensorwise"))["activations"] < memory(no_ckpt)["activations"]


def test_fits_where_the_reference_ran():
    """Every measured row ran on an 80 GB H100: none may be predicted over the card's capacity."""
    cap = capacity_gb(80, "cuda")
    for source, changes, _, _ in REFERENCE_ROWS:
        assert memory(REFERENCE.replace(**changes))["total"] <= cap, source


# ----------------------------------------------------------------------------- our trainer vs the reference's

# Our trainer's step measured on one H100 80GB HBM3 (2026-11-25, torch 2.11.0+cu130; BENCHMARKS.md "Measured
# on an H100"): `python -m pipeline.bench --configfile configs/llama3-1b-fineweb.yaml --micro-batch B
# --checkpoint C [--no-compile] --device cuda --json`, peak allocated GB after the warm-up steps.
OURS = REFERENCE.replace(logits="ours", grads_persistent=True, ce_matmul="bf16")
MEASURED_H100 = [  # (micro_batch, checkpoint, compile, measured peak allocated GB)
    (16, "none", True, 78.7), (16, "every_n", True, 55.8), (16, "block", True, 36.81),
    (32, "block", True, 45.67), (64, "block", True, 75.87), (64, "block", False, 57.35),
]


# The rows were measured while the loss was traced into the compiled step (issue 28), where Inductor kept several
# chunks' fp32 [vocab, dim] d(W) products alive at once: chunks -> products alive (ce_chunk_tokens 8192: 4 chunks at
# 16 rows, 8 at 32, 16 at 64). 4 -> 3 and 16 -> 16 are issue 28's count (on CPU, the loss alone); 8 -> 7 is
# interpolated, not counted. (At a tiny shape, vocab 1000 × dim 24, this branch's CPU count of the traced loss's
# Inductor code was 3 at 2 chunks and 4 at 4, 8 and 16: the 16 at 16 was not reproduced there; the count
# depends on Inductor's schedule and the shapes.) The loss no longer compiles (one product at a time, what `memory`
# counts), so these extra products are the old step's, not ours.
TRACED_LOSS_PRODUCTS = {4: 3, 8: 7, 16: 16}


def _as_measured(m: dict, s: StepSetup) -> float:
    """`memory`'s peak of the step as it ran on the H100: with the traced loss's extra products at the moment
    the loss ran (the loss-backward moment's parts: the products were summed into d(W) in the forward)."""
    if not s.compile:
        return m["peak"]
    extra = (TRACED_LOSS_PRODUCTS[s.tokens // s.ce_chunk] - 1) * 4 * s.vocab * s.dim / 1e9
    loss = sum(m[k] for k in ("weights", "optimizer", "autocast_copies", "gradients", "activations", "logits"))
    return max(m["peak"], loss + extra)


@pytest.mark.parametrize("micro_batch,checkpoint,compile_,measured", MEASURED_H100)
def test_our_step_against_the_h100(micro_batch, checkpoint, compile_, measured):
    """The mechanism, not a fitted excess: the byte counts (the compiled body holding the bf16 casts of the
    block matrices) plus the traced loss's products explain every row within −3 … +5 % but the compiled
    64 × 2048 block row, of which 10.9 ± 1.5 GB stays unexplained (BENCHMARKS.md "The compiled loss's memory");
    this test fails when a change to the model explains it or makes it worse. Every row ran: each fits."""
    s = OURS.replace(micro_batch=micro_batch, checkpoint=checkpoint, compile=compile_)
    m = memory(s)
    if (micro_batch, checkpoint, compile_) == (64, "block", True):
        assert measured - _as_measured(m, s) == pytest.approx(10.9, abs=1.5), m
    else:
        assert 0.97 * measured <= _as_measured(m, s) <= 1.05 * measured, (_as_measured(m, s), m)
    assert m["total"] <= capacity_gb(80, "cuda")


def test_compiled_loss_memory_does_not_grow_with_the_chunk_count():
    """Issue 28: with the loss traced, a smaller ce_chunk_tokens raised the compiled step's memory (more products
    alive). Now the loss term is one chunk's: fewer tokens per chunk, less memory, compiled or not."""
    s = OURS.replace(micro_batch=64, checkpoint="block")
    for compile_ in (True, False):
        loss = [memory(s.replace(compile=compile_, ce_chunk=c))["logits"] for c in (2048, 4096, 8192)]
        assert loss[0] < loss[1] < loss[2]
    assert memory(s)["logits"] == memory(s.replace(compile=False))["logits"]


# The same steps' reserved GB (`torch.cuda.max_memory_reserved`, BENCHMARKS.md): 3–11 % above the peak.
MEASURED_H100_RESERVED = [(16, "none", True, 83.4), (16, "every_n", True, 61.1), (16, "block", True, 41.0),
                          (32, "block", True, 50.2), (64, "block", True, 79.1), (64, "block", False, 63.5)]


@pytest.mark.parametrize("row,reserved", list(zip(MEASURED_H100, [r[3] for r in MEASURED_H100_RESERVED])))
def test_reserved_against_the_h100(row, reserved):
    """`ALLOCATOR_SLACK` against the H100's own reserved / peak pairs (the peaks' prediction is
    test_our_step_against_the_h100's): the measured peak with the slack lands within 10 % of what the
    allocator reserved; with the 2 % once assumed, three rows (16 none, 16 every_n, 64 eager) fell 10 % under."""
    from pipeline.planning.fitted import ALLOCATOR_SLACK

    micro_batch, checkpoint, compile_, peak = row
    assert MEASURED_H100_RESERVED[MEASURED_H100.index(row)][:3] == (micro_batch, checkpoint, compile_)
    m = memory(OURS.replace(micro_batch=micro_batch, checkpoint=checkpoint, compile=compile_))
    assert m["reserved"] == pytest.approx(m["peak"] * (1 + ALLOCATOR_SLACK), abs=2e-3)
    assert 0.9 * reserved <= peak * (1 + ALLOCATOR_SLACK) <= 1.1 * reserved


def test_memory_outside_the_allocator():
    """The CUDA context on every GPU, NCCL's buffers only when several processes train; nothing on the CPU."""
    from pipeline.planning.fitted import CUDA_CONTEXT_GB, NCCL_BUFFERS_GB

    one, eight = memory(OURS), memory(OURS.replace(world_size=8))
    assert one["outside_allocator"] == CUDA_CONTEXT_GB and one["total"] == pytest.approx(one["reserved"] + 0.5)
    assert eight["outside_allocator"] == CUDA_CONTEXT_GB + NCCL_BUFFERS_GB == 1.5
    assert eight["total"] - eight["reserved"] == pytest.approx(1.5, abs=2e-3)
    cpu = memory(OURS.replace(device="cpu", bf16=False))
    assert cpu["outside_allocator"] == 0 and cpu["total"] == cpu["reserved"]
    core = eval_memory(OURS.replace(world_size=8), 131072, in_loop=True)
    assert core["total"] == pytest.approx(core["reserved"] + 1.5, abs=2e-3)


def test_default_eval_batch_tokens_is_the_row_by_row_answer():
    """The bisection finds what a row-by-row scan finds (the most seq_len rows whose in-loop scoring fits, at
    most EVAL_MAX_BATCH_TOKENS, EVAL_CPU_BATCH_TOKENS on the CPU; seq_len when none fits): capacities from
    none fitting to all, CPU and CUDA, ddp and fsdp, three sequence lengths."""
    from pipeline.planning.memory import EVAL_CPU_BATCH_TOKENS, EVAL_MAX_BATCH_TOKENS, default_eval_batch_tokens

    def most(s):
        return EVAL_MAX_BATCH_TOKENS if s.device == "cuda" else EVAL_CPU_BATCH_TOKENS

    def scan(s, capacity):
        best = s.seq_len
        for rows in range(1, most(s) // s.seq_len + 1):
            if eval_memory(s, rows * s.seq_len, in_loop=True)["total"] > capacity:
                break
            best = rows * s.seq_len
        return best

    setups = [OURS, OURS.replace(seq_len=256, device="cpu", bf16=False), OURS.replace(seq_len=4096),
              OURS.replace(parallel="fsdp", world_size=8)]
    for s in setups:
        smallest, largest = (eval_memory(s, n, in_loop=True)["total"] for n in (s.seq_len, most(s)))
        found = set()
        for capacity in [smallest - 1, smallest, *(smallest + (largest - smallest) * k / 7 for k in range(1, 7)),
                         largest, largest + 1]:
            found.add(default_eval_batch_tokens(s, capacity))
            assert default_eval_batch_tokens(s, capacity) == scan(s, capacity), (s, capacity)
        assert {s.seq_len, most(s)} <= found and len(found) > 2  # none fits, all fit, between


def test_eval_memory_against_the_h100():
    """CORE scoring of the 1.24B preset at 131,072 tokens a batch, measured on the same H100
    (`python benchmarks/eval_memory.py`): standalone 16.578 GB, in the training loop 31.477 GB allocated."""
    setup = OURS.replace(micro_batch=64, checkpoint="block")
    assert eval_memory(setup, 131072, in_loop=False)["peak"] == pytest.approx(16.578, rel=0.02)
    assert eval_memory(setup, 131072, in_loop=True)["peak"] == pytest.approx(31.477, rel=0.02)


def test_our_loss_needs_less_memory_than_materialized_logits():
    ours = REFERENCE.replace(logits="ours", grads_persistent=True)
    for changes in (dict(checkpoint="block", micro_batch=64), dict(checkpoint="block"), dict()):
        a, b = memory(ours.replace(**changes)), memory(REFERENCE.replace(grads_persistent=True, **changes))
        assert a["logits"] < b["logits"]
        assert a["reserved"] < b["reserved"]
    big = dict(checkpoint="block", micro_batch=64)
    assert memory(ours.replace(**big))["logits"] < memory(REFERENCE.replace(**big))["logits"] / 3
    # one chunk's fp32 logits, never [tokens, vocab]: the term grows with the micro-batch only by the
    # [tokens, dim] hidden-state gradient (fp32, and its bf16 copy for the bf16 body)
    m16, m64 = (memory(ours.replace(checkpoint="block", micro_batch=b))["logits"] for b in (16, 64))
    assert m64 - m16 == pytest.approx((4 + 2) * 48 * 2048 * 2048 / 1e9, rel=1e-3)


def test_ce_matmul_precision_sets_the_loss_time():
    ours = REFERENCE.replace(logits="ours", grads_persistent=True, checkpoint="block", micro_batch=64)
    t = {p: step_time(ours.replace(ce_matmul=p))["logits"] for p in ("bf16", "tf32", "fp32")}
    assert t["bf16"] < t["tf32"] < t["fp32"]
    # the estimate: TF32 eager chunked CE costs ≥ 0.4 s more than bf16-materialized on a 2.36 s step
    eager_tf32 = step_time(ours.replace(ce_matmul="tf32", compile=True))
    assert eager_tf32["total"] - step_time(REFERENCE.replace(checkpoint="block", micro_batch=64))["total"] > 0.4
    assert step_time(ours.replace(ce_matmul="bf16"))["logits"] < 0.7 * t["tf32"]


def test_fp32_run_mfu_uses_the_fp32_peak():
    fp32 = REFERENCE.replace(micro_batch=4, bf16=False)
    assert 0.5 < predicted_mfu(fp32) < 0.8  # against 66.9 TFLOP/s; against TF32's 494.5 it would be ~0.09


def test_grads_freed_vs_held():
    held, freed = REFERENCE.replace(grads_persistent=True), REFERENCE
    assert memory(held)["peak"] - memory(freed)["peak"] == pytest.approx(4 * (held.params - 131072 * 2048) / 1e9,
                                                                         rel=1e-3)


def test_capacity_is_gib():
    assert capacity_gb(80, "cuda") == pytest.approx(85.899, rel=1e-4)
    assert capacity_gb(24, "cpu") == 24


def test_module_is_torch_free():
    code = "import sys, pipeline.planning; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_bf16_ce_counts_the_weight_gradient_product_on_cuda():
    """Issue 18 item 5: with bf16 CE operands on CUDA each chunk's d(W) product is an fp32 [vocab, dim]
    temporary (fp32 operands accumulate in place): the loss term counts its 4·V·d bytes."""
    from pipeline.planning.memory import logits_bytes

    s = StepSetup(vocab=131072, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tied=True,
                  micro_batch=16, seq_len=2048, ce_matmul="bf16")
    assert logits_bytes(s) - logits_bytes(s.replace(device="cpu")) == 4 * 131072 * 2048  # 1.07 GB
    assert logits_bytes(s.replace(ce_matmul="tf32")) == logits_bytes(s.replace(ce_matmul="tf32", device="cpu"))


# ----------------------------------------------------------------------------- FSDP (issue 21, item 4)

# d 1024, 8 heads of 128, 2 kv heads (d_kv 256), SwiGLU 4096, 4 layers, vocab 32,000 untied, 8 GPUs.
SMALL_FSDP = StepSetup(vocab=32000, dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=4096, tied=False,
                       micro_batch=2, seq_len=1024, world_size=8, parallel="fsdp")


def test_fsdp_memory_against_a_hand_computation():
    """Per-GPU state is 1/8 of ddp's; the gathered units and backward's buffers by hand."""
    s = SMALL_FSDP
    # a block: q, o 1024² each (2,097,152) + k, v 1024·256 each (524,288) + 3·1024·4096 (12,582,912) + 2 norms (2,048)
    block = 2_097_152 + 524_288 + 12_582_912 + 2_048
    root = 2 * 32_000 * 1024 + 1024  # embedding, lm_head, final norm
    P = 4 * block + root
    assert (s.block_params, s.root_params, s.params) == (block, root, P) == (15_206_400, 65_537_024, 126_362_624)
    fsdp, ddp = memory(s), memory(s.replace(parallel="ddp"))
    assert fsdp["weights"] == round(4 * P / 8 / 1e9, 3) == 0.063
    assert fsdp["optimizer"] == round(8 * P / 8 / 1e9, 3) == 0.126  # AdamW's two fp32 moments, sharded
    assert fsdp["gradients"] == round(4 * P / 8 / 1e9, 3)
    # FSDP_GATHERED_BLOCKS = 2 blocks gathered in bf16, and the root, which stays fp32
    assert fsdp["gathered"] == round((2 * block * 2 + root * 4) / 1e9, 3) == 0.323
    # one block's bf16 gradients and their fp32 reduce-scatter copy, the lm_head's fp32 gradient
    assert fsdp["reduce_buffers"] == round((block * (2 + 4) + 4 * 32_000 * 1024) / 1e9, 3) == 0.222
    assert ddp["gathered"] == ddp["reduce_buffers"] == 0
    # the same activations and loss; at the loss backward (the peak of both, no checkpointing) the peaks
    # differ by 7/8 of the 16 B/param state less the gathered units (backward's buffers come later), and by
    # ddp's compiled body's bf16 casts of the block matrices (fsdp's gathered bf16 parameters are its casts)
    for k in ("activations", "logits", "recompute"):
        assert fsdp[k] == ddp[k]
    assert fsdp["peak_at"] == ddp["peak_at"] == "loss backward"
    assert fsdp["autocast_copies"] == 0 and ddp["autocast_copies"] == round(2 * 4 * (block - 2_048) / 1e9, 3)
    saved = 16 * P * 7 / 8 - (2 * block * 2 + root * 4) + 2 * 4 * (block - 2_048)
    assert ddp["peak"] - fsdp["peak"] == pytest.approx(saved / 1e9, abs=2e-3)
    # fp32 training gathers fp32 parameters and reduce-scatters them without a copy
    fp32 = memory(s.replace(bf16=False))
    assert fp32["gathered"] == round((2 * block + root) * 4 / 1e9, 3)
    assert fp32["reduce_buffers"] == round((block * 4 + 4 * 32_000 * 1024) / 1e9, 3)


def test_fsdp_root_reduce_scatter_can_set_the_peak():
    """At the end of backward the root's unsharded fp32 gradients and FSDP2's fp32 reduce-scatter input (8 B per
    root parameter) sit beside its gathered fp32 parameters: with few activations (one short row, one layer,
    a large vocabulary) that moment is the peak."""
    s = SMALL_FSDP.replace(n_layers=1, micro_batch=1, seq_len=128)
    m = memory(s)
    assert m["peak_at"] == "root reduce-scatter"
    state = (4 + 8 + 4) * s.params / 8 + 2 * s.block_params * 2 + 4 * s.root_params
    assert m["peak"] == pytest.approx((state + 8 * s.root_params) / 1e9, abs=2e-3)
    assert "root reduce-scatter" not in memory(s.replace(parallel="ddp"))  # (a moment, not a part)


def test_fsdp_eval_memory_counts_the_whole_gathered_model():
    """`gathered()` unshards every unit for an evaluation: all L blocks in the gathered dtype and the fp32
    root, not the two blocks of a training step (the 8B: 14.0 GB of bf16 blocks, not 0.87). In bf16 the
    gathered blocks are the compute copies; fp32 training gathers fp32 blocks, which autocast copies."""
    s = SMALL_FSDP
    block, root = s.block_params, s.root_params
    core = eval_memory(s, 1024, in_loop=True)
    assert core["gathered"] == round((4 * block * 2 + root * 4) / 1e9, 3) == 0.384
    assert core["weights"] == round(4 * s.params / 8 / 1e9, 3) and core["autocast_copies"] == 0
    fp32 = eval_memory(s.replace(bf16=False), 1024, in_loop=True)
    assert fp32["gathered"] == round((4 * block + root) * 4 / 1e9, 3)
    assert fp32["autocast_copies"] == round(2 * s.matrix_params / 1e9, 3)
    assert eval_memory(s, 1024, in_loop=False)["gathered"] == 0  # the evaluate stage loads final.pt whole
    eight_b = StepSetup(vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, tied=False,
                        micro_batch=1, seq_len=8192, world_size=8, parallel="fsdp")
    blocks = 32 * eight_b.block_params * 2
    assert blocks / 1e9 == pytest.approx(13.96, abs=0.01)
    assert eval_memory(eight_b, 8192, in_loop=True)["gathered"] == pytest.approx(
        (blocks + 4 * eight_b.root_params) / 1e9, abs=1e-3)


def test_fsdp_muon_orthogonalises_one_share_per_rank():
    """Under fsdp each block matrix has one owner rank for Newton-Schulz: a rank's share is 1/W of the FLOPs
    (beside the optimizer's bytes, on its 1/W shard); ddp orthogonalises every matrix on every rank."""
    from pipeline.planning.compute import HBM_BYTES_PER_S, PEAK_FLOPS
    from pipeline.planning.fitted import ETA, OPTIMIZER_BYTES
    from pipeline.planning.step_time import muon_flops

    s = SMALL_FSDP.replace(optimizer="muon")
    ns = muon_flops(s) / (PEAK_FLOPS["H100"]["bf16"] * ETA["train"]["bf16"])
    bw = HBM_BYTES_PER_S["H100"] * ETA["memory"]
    assert step_time(s)["optimizer"] == pytest.approx(s.params / 8 * OPTIMIZER_BYTES["muon"] / bw + ns / 8)
    assert step_time(s.replace(parallel="ddp"))["optimizer"] == pytest.approx(
        s.params * OPTIMIZER_BYTES["muon"] / bw + ns)


def test_fsdp_shards_over_every_rank_of_the_job():
    """Multi-node: the state is sharded over nodes × GPUs per node, the gathered units are not."""
    one, four = memory(SMALL_FSDP), memory(SMALL_FSDP.replace(world_size=32, nodes=4))
    assert four["weights"] == pytest.approx(one["weights"] / 4, abs=1e-3)
    assert four["optimizer"] == pytest.approx(one["optimizer"] / 4, abs=1e-3)
    assert four["gathered"] == one["gathered"] and four["peak"] < one["peak"]


def test_fsdp_collectives_against_a_hand_computation():
    from pipeline.planning.fitted import COLLECTIVE_EFFICIENCY
    from pipeline.planning.step_time import collective_bytes_per_s, fsdp_comm

    s = SMALL_FSDP.replace(grad_accum=3)
    block, root, P = 15_206_400, 65_537_024, 126_362_624
    gather = 2 * 4 * block * 2 + root * 4  # each block forward and backward in bf16, the root once in fp32
    reduce = 4 * P  # fp32 gradients
    bus = 450e9 * COLLECTIVE_EFFICIENCY  # NVLink 4, one direction
    assert collective_bytes_per_s(s) == bus
    c = fsdp_comm(s, micro_compute_s=1.0)
    assert c["allgather_bytes"] == 3 * gather and c["reduce_scatter_bytes"] == 3 * reduce
    assert c["comm_s"] == pytest.approx(3 * (gather + reduce) * 7 / 8 / bus)
    # a second of compute hides all but the edge: the root and one block's all-gather and reduce-scatter
    assert c["exposed_s"] == pytest.approx(3 * (block * (2 + 4) + root * (4 + 4)) * 7 / 8 / bus)
    # two nodes: a ring crossing nodes runs at min(NVLink, 8 GPUs × 50 GB/s NDR)
    assert collective_bytes_per_s(s.replace(world_size=16, nodes=2)) == 400e9 * COLLECTIVE_EFFICIENCY
    assert fsdp_comm(s.replace(world_size=1), 1.0)["comm_s"] == 0


def test_fsdp_exposed_comm_is_monotonic(monkeypatch):
    """Exposed communication grows with the bytes and shrinks with bandwidth, compute to hide under and
    the overlap fraction; it never exceeds the communication, and the step time adds it."""
    import pipeline.planning.step_time as perf

    s = SMALL_FSDP
    exposed = [perf.fsdp_comm(s, t)["exposed_s"] for t in (0.0, 1e-4, 1e-3, 1e-2, 1.0)]
    assert exposed == sorted(exposed, reverse=True)
    assert exposed[0] == pytest.approx(perf.fsdp_comm(s, 0.0)["comm_s"])
    slower = [perf.fsdp_comm(s.replace(world_size=8 * n, nodes=n, gpu_type=g), 1e-3)
              for n, g in ((1, "H100"), (2, "H100"), (1, "A100"), (1, "L40S"))]
    assert [c["bus_bytes_per_s"] for c in slower] == sorted((c["bus_bytes_per_s"] for c in slower), reverse=True)
    bigger = [perf.fsdp_comm(s.replace(dim=d, n_heads=d // 128), 1e-3) for d in (512, 1024, 2048)]
    assert all(a["comm_s"] < b["comm_s"] and a["exposed_s"] <= b["exposed_s"] for a, b in zip(bigger, bigger[1:]))
    by_overlap = []
    for overlap in (0.0, 0.5, 0.8, 1.0):
        monkeypatch.setattr(perf, "FSDP_OVERLAP", overlap)
        by_overlap.append(perf.fsdp_comm(s, 1e-3)["exposed_s"])
    assert by_overlap == sorted(by_overlap, reverse=True) and by_overlap[0] > by_overlap[-1]
    monkeypatch.undo()
    t = step_time(s)
    assert t["fsdp_comm"] == pytest.approx(perf.fsdp_comm(s, (t["body"] + t["logits"]) / s.grad_accum)["exposed_s"])
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))
    # the optimizer updates its shard only
    assert t["optimizer"] == pytest.approx(step_time(s.replace(parallel="ddp"))["optimizer"] / 8)


def test_every_gpu_type_has_a_link_bandwidth():
    """Every hardware.gpu_type the schema accepts prices fsdp's collectives (aliases through their part)."""
    from pipeline.planning.compute import GPU_SPECS, GPU_TYPE_ALIASES
    from pipeline.planning.fitted import INTRA_NODE_BYTES_PER_S
    from pipeline.planning.step_time import collective_bytes_per_s

    assert set(INTRA_NODE_BYTES_PER_S) == set(GPU_SPECS) | {"cpu"}
    for gpu in (*GPU_SPECS, *GPU_TYPE_ALIASES):
        assert collective_bytes_per_s(SMALL_FSDP.replace(gpu_type=gpu)) > 0
