"""Host memory of building the model, per rank: `build_model` (meta construction, FSDP2 sharding, each
weight drawn on the host and written into the rank's shard) against the host build it replaced.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/init_memory.py \\
        [--dim 1024] [--layers 8] [--ffn-dim 4096] [--vocab 32768] [--host-build] [--json OUT]

On CPU under gloo. Each rank reports the growth of its peak resident set (``ru_maxrss``) across the
build, and that growth less the bytes of its own parameter storage (its shards: on the CPU they are
host memory by necessity, on a GPU they are not) — the **overhead**, what the build holds on the host
beyond the model's place. ``--host-build`` measures the old construction instead (the whole fp32
model built and initialised on the host, then sharded): its overhead is the whole model; the meta
build's is bounded by the largest weight plus a constant. Rank 0 prints one JSON object (and writes
it to ``--json``): the model's, a shard's and the largest weight's MB, and per rank the growth and the
overhead in MB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource

import torch
import torch.distributed as torch_dist

from pipeline.distributed import Dist
from pipeline.model.model import ModelConfig, Transformer
from pipeline.training.parallelize import build_model, shard_model

MB = 2**20


def params_for(dim: int, layers: int, ffn_dim: int, vocab: int) -> dict:
    """The slice of a resolved config that `build_model` and `shard_model` read (fp32 on the CPU)."""
    return {"model": {"vocab_size": vocab, "dim": dim, "n_layers": layers, "n_heads": dim // 64,
                      "n_kv_heads": dim // 128, "ffn_dim": ffn_dim, "rope_theta": 10000.0, "norm_eps": 1e-5,
                      "tie_embeddings": False},
            "train": {"seq_len": 256, "fp8": "none", "precision": "fp32"}}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameter storage (a DTensor's local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn-dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--host-build", action="store_true", help="measure the old construction (whole model on the host)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    dist = Dist(rank, int(os.environ.get("LOCAL_RANK", rank)), world, torch.device("cpu"))
    params = params_for(args.dim, args.layers, args.ffn_dim, args.vocab)
    with torch.device("meta"):
        skeleton = Transformer(ModelConfig.from_config(params))
    model_bytes = sum(p.nbytes for p in skeleton.parameters())
    largest = max(p.nbytes for p in skeleton.parameters())
    del skeleton

    torch_dist.barrier()
    before = peak_rss_mb()
    torch.manual_seed(0)
    if args.host_build:
        model = Transformer(ModelConfig.from_config(params))
        shard_model(model, params, dist, compile_blocks=False)
    else:
        model = build_model(params, dist.device, dist)
    growth = peak_rss_mb() - before
    overhead = growth - local_bytes(model) / MB
    ranks = [None] * world
    torch_dist.all_gather_object(ranks, {"growth_mb": round(growth, 1), "overhead_mb": round(overhead, 1)})
    result = {"build": "host" if args.host_build else "meta", "world_size": world,
              "model_mb": round(model_bytes / MB, 1), "shard_mb": round(model_bytes / world / MB, 1),
              "largest_weight_mb": round(largest / MB, 1), "ranks": ranks}
    if rank == 0:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    torch_dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
