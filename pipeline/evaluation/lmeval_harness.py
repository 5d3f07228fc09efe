"""EleutherAI lm-eval on local task files, offline: the harness the export tests and benchmark scorers share.

    tasks = [LocalTask("tf_cloze", "loglikelihood", docs=[{"context": ..., "continuation": ...}, ...])]
    task_dir = write_tasks(workdir / "tasks", tasks)        # NAME.yaml + NAME.jsonl
    out = run_lmeval(model_dir, task_dir, [t.name for t in tasks], workdir / "lmeval.json")
    out["results"][name], out["requests"][name], out["docs"][name]

`run_lmeval` runs lm-eval's `simple_evaluate` in a child process, offline; `chat_lmeval_task` writes a
ChatCORE task as such a task; `split_pair` and `loglikelihood` score a request with our own tokenizer and
model, so it can be checked against lm-eval's.

The outputs, the offline flags and the same run from a shell: docs/evaluation.md, "lm-eval on local task
files".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import atomic_write, get_logger, read_json, run_cli, write_json

log = get_logger(__name__)

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "generate_until")
# doc fields each output type reads (documents may carry more)
FIELDS = {"loglikelihood": ("context", "continuation"), "multiple_choice": ("context", "choices", "gold"),
          "generate_until": ("context", "target")}


@dataclass
class LocalTask:
    """An lm-eval task over `docs` (dicts with FIELDS[output_type]). loglikelihood: one request
    (context, continuation); metrics perplexity and acc (the continuation is the greedy one).
    multiple_choice: one request (context, target_delimiter + choice) per choice, `gold` is the
    right choice's index; metrics acc and acc_norm. generate_until: one generation from the context
    (greedy unless `extra` says otherwise; `extra["generation_kwargs"]` sets until and max_gen_toks),
    metric exact_match against `target` unless `extra` gives metric_list (and filter_list)."""

    name: str
    output_type: str
    docs: list[dict]
    target_delimiter: str = " "
    extra: dict = field(default_factory=dict)  # more task YAML keys (num_fewshot, description, ...)

    def yaml_config(self, data_file: Path) -> dict:
        if self.output_type not in OUTPUT_TYPES:
            raise PipelineError(f"task {self.name}: output_type {self.output_type!r} is not one of {OUTPUT_TYPES}")
        for i, doc in enumerate(self.docs):
            missing = [f for f in FIELDS[self.output_type] if f not in doc]
            if missing:
                raise PipelineError(f"task {self.name}: document {i} has no {', '.join(missing)}")
        task = {  # lm-eval's task YAML
            "task": self.name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(Path(data_file).resolve())}},
            "test_split": "test",
            "output_type": self.output_type,
            "doc_to_text": "context",
            "target_delimiter": self.target_delimiter,
        }
        if self.output_type == "loglikelihood":
            scoring = {"doc_to_target": "continuation",
                       "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                       {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
        elif self.output_type == "generate_until":
            scoring = {"doc_to_target": "target",
                       "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0},
                       "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
        else:
            scoring = {"doc_to_choice": "choices", "doc_to_target": "gold",
                       "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                       {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
        return {**task, **scoring, **self.extra}


def write_tasks(task_dir: str | os.PathLike, tasks: list[LocalTask]) -> Path:
    """Write each task as task_dir/NAME.yaml and its documents as task_dir/NAME.jsonl (absolute path)."""
    import yaml

    task_dir = Path(task_dir).resolve()
    for task in tasks:
        data = task_dir / f"{task.name}.jsonl"
        config = task.yaml_config(data)
        with atomic_write(data, encoding="utf-8") as f:
            f.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in task.docs)
        with atomic_write(task_dir / f"{task.name}.yaml", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False, allow_unicode=True)
    return task_dir


def run_lmeval(model_dir: str | os.PathLike, task_dir: str | os.PathLike, tasks: list[str], out: str | os.PathLike,
               batch_size: int = 8, device: str = "cpu", dtype: str = "float32", timeout: float | None = None) -> dict:
    """lm-eval on `tasks` (defined in `task_dir`) for the transformers model directory `model_dir`,
    offline in a child process; writes and returns {"results", "requests"} (docs/evaluation.md)."""
    out = Path(out).resolve()
    env = {**os.environ, **OFFLINE_ENV}
    env.setdefault("HF_DATASETS_CACHE", str(out.parent / "hf_datasets_cache"))
    cmd = [sys.executable, "-m", "pipeline.evaluation.lmeval_harness", "--model", str(Path(model_dir).resolve()),
           "--include", str(Path(task_dir).resolve()), "--tasks", *tasks, "--out", str(out),
           "--batch-size", str(batch_size), "--device", device, "--dtype", dtype]
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(root)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise PipelineError(f"lm-eval on {model_dir} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return read_json(out)


def _requests(sample: dict) -> list[dict]:
    """A logged lm-eval sample's loglikelihood requests as plain records."""
    out = []
    for args, resp in zip(sample["arguments"], sample["filtered_resps"]):
        ll, greedy = resp
        out.append({"doc_id": sample["doc_id"], "context": args[0], "continuation": args[1],
                    "loglikelihood": float(ll), "is_greedy": bool(greedy)})
    return out


def _doc(sample: dict) -> dict:
    """A logged lm-eval sample (one document under one filter) as a plain record."""
    rec = {"doc_id": sample["doc_id"], "filter": sample["filter"], "metrics": {m: sample[m] for m in sample["metrics"]}}
    if _generated(sample):
        rec.update(context=sample["arguments"][0][0], generation=sample["resps"][0][0],
                   filtered=sample["filtered_resps"][0])
    return rec


def _generated(sample: dict) -> bool:
    return isinstance(sample["resps"][0][0], str)


def evaluate_local(model_dir: str, task_dir: str, tasks: list[str], batch_size: int, device: str, dtype: str) -> dict:
    """lm-eval's simple_evaluate in this process (offline flags must already be set)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="hf", model_args={"pretrained": model_dir, "dtype": dtype}, tasks=tasks,
                          task_manager=TaskManager(include_path=task_dir), batch_size=batch_size, device=device,
                          log_samples=True, bootstrap_iters=0)
    samples = {t: sorted(res["samples"][t], key=lambda s: (s["doc_id"], s["filter"])) for t in tasks}
    return {
        "results": res["results"],
        "requests": {t: [r for s in samples[t] if not _generated(s) for r in _requests(s)] for t in tasks},
        "docs": {t: [_doc(s) for s in samples[t]] for t in tasks},
    }


def chat_lmeval_task(name: str, tokenizer, task: dict, items: list[dict], max_new_tokens: int) -> LocalTask:
    """A ChatCORE task's `items` as an lm-eval task (docs/evaluation.md). Categorical: multiple_choice over
    the letters A, B, … with no delimiter, so each request's continuation is the one letter token our
    scorer reads at the same position; lm-eval's `acc` takes the highest log-likelihood, i.e. the
    highest letter logit. GSM8K: generate_until with lm-eval's gsm8k metric and filters
    (strict-match, flexible-extract), the full upstream solution as target."""
    import lm_eval
    import yaml

    from pipeline.evaluation.chat import stop_ids
    from pipeline.evaluation.chat_core import LETTERS, user_message

    def context(item: dict) -> str:
        return tokenizer.decode(tokenizer.render_prompt([{"role": "user", "content": user_message(task, item)}]))

    if task["kind"] == "categorical":
        docs = [{"context": context(it), "choices": list(LETTERS[:len(it["choices"])]), "gold": it["gold"]}
                for it in items]
        return LocalTask(name, "multiple_choice", docs, target_delimiter="")
    if task["kind"] != "gsm8k":
        raise PipelineError(f"chat task {task['task']!r} ({task['kind']}) has no lm-eval counterpart here")
    upstream = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    until = [tokenizer.decode([t]) for t in stop_ids(tokenizer)]
    return LocalTask(name, "generate_until", [{"context": context(it), "target": it["solution"]} for it in items],
                     target_delimiter="", extra={
                         "metric_list": upstream["metric_list"], "filter_list": upstream["filter_list"],
                         "generation_kwargs": {"until": until, "do_sample": False, "temperature": 0.0,
                                               "max_gen_toks": max_new_tokens}})


# ----------------------------------------------------------------------------- our side of the comparison

def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids of a request as lm-eval's HF model makes them with the exported
    tokenizer: trailing spaces of the context move to the continuation, both strings are encoded
    with <|bos|> first, and the continuation is what the whole adds to the context."""
    if not context:
        raise ValueError("an empty context is scored by lm-eval from its prefix token; give a context")
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = [tokenizer.bos_id] + tokenizer.encode(context)
    whole = [tokenizer.bos_id] + tokenizer.encode(context + continuation)
    return ctx, whole[len(ctx):]


def loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of our model's fp32 log-probabilities of `cont` after `ctx`, and whether greedy decoding
    gives it; the window is cropped to the model's max_seq_len on the left, as lm-eval does."""
    import torch

    ids = (ctx + cont)[-(model.cfg.max_seq_len + 1):][:-1]
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0, -len(cont):].log_softmax(-1)
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.evaluation.lmeval_harness",
                                 description="Run lm-eval (offline) on local tasks; write results and per-request "
                                             "log-likelihoods as JSON.")
    ap.add_argument("--model", required=True, help="a transformers model directory (pipeline.evaluation.export)")
    ap.add_argument("--include", required=True, help="directory of task YAMLs (write_tasks)")
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    write_json(args.out, evaluate_local(args.model, args.include, args.tasks, args.batch_size, args.device, args.dtype))


if __name__ == "__main__":
    run_cli(main)
