"""CORE scoring memory on the visible device, measured beside `pipeline.planning.memory.eval_memory`'s prediction.

    python benchmarks/eval_memory.py [--configfile configs/llama3-1b-fineweb.yaml] [--device cuda]
        [--batch-tokens N] [--requests 96] [--json OUT]

Builds the config's model (fp32 weights, as the trainer holds them) and scores full-context requests
(random ids, `seq_len` tokens each, a 4-token continuation) through `pipeline.evaluation.core_benchmark.score_requests`
— the scorer the evaluate stage and training's in-loop CORE both call — in two moments:

* **standalone** (the evaluate stage): the weights only;
* **in the training loop**: the weights plus the optimizer's state and the gradients the trainer keeps
  allocated (`zero_grad(set_to_none=False)`), made by one optimizer step over zero gradients (the step's
  activations are freed before training scores, so none are held here).

For each it prints the measured peak allocated and reserved GB (``torch.cuda.max_memory_*`` after a
reset) beside the prediction's ``peak`` / ``reserved`` at the same batch (`eval.core_batch_tokens`, or
when null `pipeline.planning.memory.eval_batch_tokens`). On CPU it runs the same code on the tiny default (the
plumbing; CPU has no allocator statistics, so only the prediction is printed).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pipeline.config import load_config
from pipeline.evaluation.core_benchmark import score_requests, scoring_dtype
from pipeline.planning.memory import GB, StepSetup, eval_batch_tokens, eval_memory
from pipeline.run_config import run_config
from pipeline.training.optim import build_optimizer
from pipeline.training.parallelize import build_model


def measure(cfg: dict, device: torch.device, batch_tokens: int, n_requests: int, in_loop: bool) -> dict:
    torch.manual_seed(0)
    model = build_model(cfg, device)
    optimizer = None
    if in_loop:
        optimizer = build_optimizer(model, cfg["train"], device.type)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # allocates the optimizer's state; the gradients stay allocated, as in training
    model.eval()
    T, V = cfg["train"]["seq_len"], cfg["model"]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(0, V, (T - 3,), generator=g).tolist(), torch.randint(0, V, (4,), generator=g).tolist())
             for _ in range(n_requests)]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    score_requests(model, pairs, T, batch_tokens, device, scoring_dtype(device), cfg["train"]["ce_chunk_tokens"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    predicted = eval_memory(StepSetup.from_config(run_config(cfg)), batch_tokens, in_loop)
    row = {"moment": "in the training loop" if in_loop else "standalone", "batch_tokens": batch_tokens,
           "requests": n_requests, "seconds": round(seconds, 3),
           "predicted_peak_gb": predicted["peak"], "predicted_reserved_gb": predicted["reserved"],
           "measured_peak_gb": round(torch.cuda.max_memory_allocated() / GB, 3) if cuda else None,
           "measured_reserved_gb": round(torch.cuda.max_memory_reserved() / GB, 3) if cuda else None}
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configfile", default="configs/llama3-1b-fineweb.yaml")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-tokens", type=int, help="default: eval.core_batch_tokens, or the plan's when null")
    p.add_argument("--requests", type=int, default=96, help="full-context requests scored per moment")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    overrides = {"hardware": {"device": args.device}}
    if args.device == "cpu":
        overrides["hardware"]["gpu_type"] = "cpu"
    cfg = load_config(args.configfile, overrides=overrides)
    batch_tokens = args.batch_tokens or eval_batch_tokens(run_config(cfg))
    device = torch.device(args.device)
    name = torch.cuda.get_device_properties(0).name if device.type == "cuda" else "cpu"
    rows = [measure(cfg, device, batch_tokens, args.requests, in_loop) for in_loop in (False, True)]
    for r in rows:
        print(f"{name} {args.configfile} {r['moment']}: batch {r['batch_tokens']} tokens, {r['requests']} requests, "
              f"{r['seconds']} s; peak allocated measured {r['measured_peak_gb']} GB vs predicted "
              f"{r['predicted_peak_gb']} GB; reserved measured {r['measured_reserved_gb']} GB vs predicted "
              f"{r['predicted_reserved_gb']} GB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "configfile": args.configfile, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
