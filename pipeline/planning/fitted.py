"""The constants the planner's predictions rest on, each with its source beside it: fitted to the
reference run's measured rows (tests/test_perf.py: REFERENCE_ROWS), measured here (BENCHMARKS.md), or
stated assumptions (datasheets, NCCL docs). Data only: the formulas are in memory, step_time, train_jobs."""
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
# here); docs/planning.md's "FSDP" paragraphs say where each enters.
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

