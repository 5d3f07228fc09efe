r"""CORE-style in-context evaluation: pure functions that render, tokenize and score benchmark items, and
a thin CLI.

    [torchrun --nproc_per_node N] python -m pipeline.evaluation.core_benchmark --params JSON \
        --ckpt R/train/final.pt --tokenizer R/tokenizer/encoding.json --tasks-dir R/eval_data --out R/eval/core.json

- `evaluate_tasks(model, tokenizer, tasks, ...)`: the library entry (evaluate and the trainer's in-loop
  CORE call it): per-task accuracy, centered accuracy and ``core_<n>``, with 95 % intervals and the
  clean subset; `markdown_table`, `core_record`, `plot_core` present it;
- `item_requests`, `encode_pair`, `task_shots`, `score_requests`: prompt, boundary tokenization, the shots
  that fit the context, scoring by mean per-token loss.

Prompt, shots that fit, scoring, precision, batching, error bars and the clean subset: docs/evaluation.md,
"CORE-style in-context evaluation".
"""
from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pipeline.config import add_config_args, evaluate_slice, params_from_args
from pipeline.data.encoding import load_tokenizer
from pipeline.data.tasks import BASELINES, load_tasks, score_name, task_path
from pipeline.distributed import Dist, gather_objects, init_distributed
from pipeline.errors import PipelineError
from pipeline.evaluation import stats
from pipeline.io import atomic_path, get_logger, provenance, run_cli, write_json
from pipeline.model.load import load_model
from pipeline.planning.memory import eval_batch_tokens
from pipeline.run_config import run_config

log = get_logger(__name__)

FEWSHOT_SEPARATOR = "\n\n"


# ----------------------------------------------------------------------------- prompts

def gold_example(item: dict, task_type: str) -> str:
    """An item rendered as a solved few-shot example."""
    g = item["gold"]
    if task_type == "schema":
        return item["contexts"][g] + item["continuations"][0]
    return item["contexts"][0] + item["continuations"][g if task_type == "multiple_choice" else 0]


def fewshot_prefix(task: dict, item: dict, k: int, seed: int, k_max: int | None = None) -> str:
    """k solved examples from the task's pool: the first k of the `k_max` (default k) drawn by an RNG
    seeded with (seed, task, item id), so fewer shots are a prefix of the same draw."""
    if k == 0:
        return ""
    k_max = k if k_max is None else max(k, k_max)
    pool = [ex for ex in task["pool"] if ex["id"] != item["id"]]
    if len(pool) < k_max:
        raise PipelineError(f"task {task['task']!r}: {k_max} shots asked but its few-shot pool has {len(pool)} "
                            "examples; lower eval.core_shots or raise eval.core_pool_size")
    rng = random.Random(f"{seed}:{task['task']}:{item['id']}")
    return "".join(gold_example(ex, task["type"]) + FEWSHOT_SEPARATOR for ex in rng.sample(pool, k_max)[:k])


def item_requests(task: dict, item: dict, k: int, seed: int, k_max: int | None = None) -> list[tuple[str, str]]:
    """The (context, continuation) strings to score for one item, one per choice."""
    prefix = fewshot_prefix(task, item, k, seed, k_max)
    if task["type"] == "schema":
        return [(prefix + c, item["continuations"][0]) for c in item["contexts"]]
    return [(prefix + item["contexts"][0], c) for c in item["continuations"]]


def split_boundary(context: str, continuation: str) -> tuple[str, str]:
    """Move the context's trailing whitespace to the front of the continuation (lm-eval)."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids with BOS first, continuation ids): the whole string encoded once and split at the
    encoded context's length (docs/evaluation.md, "CORE-style in-context evaluation")."""
    context, continuation = split_boundary(context, continuation)
    whole = tokenizer.encode(context + continuation)
    n_ctx = len(tokenizer.encode(context))
    return [tokenizer.bos_id] + whole[:n_ctx], whole[n_ctx:]


FIT_FRACTION = 0.9  # a task's k is the largest whose prompts fit the context for this share of its items


def item_fit(tokenizer, task: dict, item: dict, k_max: int, seed: int, max_len: int
             ) -> tuple[int, list[tuple[list[int], list[int]]] | None]:
    """(the most shots j <= k_max with which every request of the item fits the context — at most
    `max_len` + 1 ids —, those requests' ids); (-1, None) when even the item alone does not fit.
    Binary search over j (a prompt grows with its shots)."""
    def encoded(j):
        reqs = [encode_pair(tokenizer, c, x) for c, x in item_requests(task, item, j, seed, k_max)]
        return reqs if all(len(c) + len(x) <= max_len + 1 for c, x in reqs) else None

    best = encoded(0)
    if best is None:
        return -1, None
    lo, hi = 0, k_max
    while lo < hi:
        mid = (lo + hi + 1) // 2
        reqs = encoded(mid)
        if reqs is None:
            hi = mid - 1
        else:
            lo, best = mid, reqs
    return lo, best


def task_k(fits: list[int], k_max: int) -> int:
    """The task's shots: the largest k <= k_max such that at least FIT_FRACTION of its items fit with k
    shots (0 when fewer than that fit even alone)."""
    need = math.ceil(FIT_FRACTION * len(fits))
    for k in range(k_max, 0, -1):
        if sum(f >= k for f in fits) >= need:
            return k
    return 0


# ----------------------------------------------------------------------------- scoring

@dataclass
class Scored:
    logprob: float  # sum of the continuation tokens' log-probabilities
    n_tokens: int
    greedy: bool  # every continuation token is the argmax at its position
    truncated: bool


def truncate(ctx: list[int], cont: list[int], max_len: int) -> tuple[list[int], int, bool]:
    """(the request's ids left-truncated to max_len + 1 — the model sees at most max_len inputs —, how
    many continuation tokens are scored, whether it was truncated). A continuation longer than max_len
    (only with a tiny context window) keeps its last max_len tokens, each predicted from the window."""
    if not cont:
        raise PipelineError("a continuation encodes to no token; check the task file (rerun eval_data)")
    ids = ctx + cont
    return ids[-(max_len + 1):], min(len(cont), max_len), len(ids) > max_len + 1


def scoring_dtype(device: torch.device) -> torch.dtype | None:
    """The body's autocast dtype when scoring: bf16 on CUDA, whatever the training precision (fp32
    SDPA with GQA has only the math kernel there, which materialises the [rows, heads, W, W] fp32 scores
    and softmax: docs/evaluation.md, CORE, "Precision"; bf16 runs flash attention). None (fp32) on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


def body_dtype(model, device: torch.device) -> torch.dtype | None:
    """The autocast dtype the scorers run the body under: `scoring_dtype`, or else the dtype of the
    model's weights when any is below fp32 — FSDP's blocks gathered in the training's bf16 inside
    training (`pipeline.training.parallelize.gathered`) take no fp32 input, so their matmuls must cast the
    fp32 residual as training's autocast does."""
    low = (p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32)
    return scoring_dtype(device) or next(low, None)


@torch.no_grad()
def score_requests(model, pairs: list[tuple[list[int], list[int]]], max_len: int, batch_tokens: int,
                   device: torch.device, dtype: torch.dtype | None = None, head_chunk: int = 8192) -> list[Scored]:
    """Score (context ids, continuation ids) pairs in length-sorted batches of <= batch_tokens padded
    tokens (a single longer request still gets its own batch). The body runs under `dtype` autocast
    (None: fp32); the LM head and log-softmax in fp32, over at most `head_chunk` continuation
    positions at a time (one [head_chunk, vocab] fp32 logits tensor, not one per batch)."""
    if head_chunk < 1:
        raise ValueError(f"head_chunk must be >= 1, got {head_chunk}")
    prepared = [truncate(c, x, max_len) for c, x in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(prepared[i][0]))
    out: list[Scored | None] = [None] * len(pairs)
    weight = model.lm_head_weight
    start = 0
    while start < len(order):
        width = len(prepared[order[start]][0]) - 1  # longest input of the batch (sorted descending)
        rows = max(1, batch_tokens // max(width, 1))
        batch = order[start:start + rows]
        start += len(batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        pos_rows, pos_cols, targets = [], [], []
        for r, i in enumerate(batch):
            ids = prepared[i][0]
            inputs[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            n_cont = prepared[i][1]
            pos_rows += [r] * n_cont
            pos_cols += range(len(ids) - 1 - n_cont, len(ids) - 1)
            targets += ids[-n_cont:]
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = model.hidden(inputs.to(device))
        h = hidden[torch.tensor(pos_rows, device=device), torch.tensor(pos_cols, device=device)].float()
        del hidden
        tgt = torch.tensor(targets, device=device)
        lps, hits = [], []
        for a in range(0, len(targets), head_chunk):
            logits = F.linear(h[a:a + head_chunk], weight.float())  # fp32 logits, outside autocast
            t = tgt[a:a + head_chunk]
            lps.append((logits.gather(1, t[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).double().cpu())
            hits.append((logits.argmax(dim=-1) == t).cpu())
            del logits
        tok_lp, hit = torch.cat(lps), torch.cat(hits)
        at = 0
        for i in batch:
            n = prepared[i][1]
            out[i] = Scored(float(tok_lp[at:at + n].sum()), n, bool(hit[at:at + n].all()), prepared[i][2])
            at += n
    return out  # type: ignore[return-value]


def item_pick(task_type: str, scored: list[Scored]) -> int | bool:
    """The model's answer to an item: multiple_choice / schema, the choice with the lowest mean per-token
    loss (ties: first); language_modeling, whether the greedy decode reproduces the continuation."""
    if task_type == "language_modeling":
        return scored[0].greedy
    means = [s.logprob / s.n_tokens for s in scored]
    return max(range(len(means)), key=means.__getitem__)


def item_correct(task_type: str, gold: int, scored: list[Scored]) -> bool:
    """Whether `item_pick` is right: the gold choice, or the exact greedy continuation."""
    pick = item_pick(task_type, scored)
    return pick if task_type == "language_modeling" else pick == gold


def centered(accuracy: float, baseline: float) -> float:
    return (accuracy - baseline) / (1.0 - baseline)


def task_shots(task: dict, shots: int | None) -> int:
    return task["shots"] if shots is None else shots


# ----------------------------------------------------------------------------- the suite

def begin_scoring(model, dist: Dist | None) -> tuple:
    """What a scorer runs with: (device, autocast dtype, context length, rank, world size, whether the
    model was training); the model is put in eval mode (the scorer restores train mode when it was)."""
    device = next(model.parameters()).device
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    was_training = model.training
    model.eval()
    return device, body_dtype(model, device), model.cfg.max_seq_len, rank, world, was_training


def evaluate_tasks(model, tokenizer, tasks: dict[str, dict], *, seed: int, batch_tokens: int,
                   shots: int | None = None, max_items: int | None = None, dist: Dist | None = None,
                   head_chunk: int = 8192, seen: dict[str, set] | None = None) -> dict:
    """Score the first `max_items` items (all when None) of every task on this rank's share, gather,
    and return the table: per task accuracy, centered accuracy, items, truncated requests, the clean
    subset's scores given `seen` (docs/evaluation.md); and `core_<n>`. The body runs at `body_dtype` (bf16
    autocast on CUDA or with bf16 weights). With a distributed `dist` it is a collective: every rank must
    call it."""
    device, dtype, max_len, rank, world, was_training = begin_scoring(model, dist)
    t0 = time.perf_counter()
    local = []  # (task, item index, correct, truncated requests, requests, shots, pick, per-request scores)
    fitted = {}  # task -> (k, items with fewer shots, items too long even alone); the same on every rank
    for name, task in tasks.items():
        k_max = task_shots(task, shots)
        items = task["items"][:max_items] if max_items is not None else task["items"]
        if not items:
            raise PipelineError(f"task {name!r}: no item to score; rerun eval_data or raise eval.core_max_items")
        fits = [item_fit(tokenizer, task, it, k_max, seed, max_len) for it in items]
        k = task_k([f for f, _ in fits], k_max)
        fitted[name] = (k, sum(0 <= f < k for f, _ in fits), sum(f < 0 for f, _ in fits))
        pairs, spans = [], []
        mine = [i for i in range(rank, len(items), world) if fits[i][0] >= 0]
        for i in mine:
            f, reqs = fits[i]
            if f > k:
                reqs = [encode_pair(tokenizer, c, x) for c, x in item_requests(task, items[i], k, seed, k_max)]
            spans.append((len(pairs), len(pairs) + len(reqs)))
            pairs += reqs
        try:
            scored = score_requests(model, pairs, max_len, batch_tokens, device, dtype, head_chunk)
        except PipelineError as e:
            raise PipelineError(f"task {name!r}: {e}") from None
        for i, (a, b) in zip(mine, spans):
            mine_scored = scored[a:b]
            pick = item_pick(task["type"], mine_scored)
            local.append((name, i, item_correct(task["type"], items[i]["gold"], mine_scored),
                          sum(s.truncated for s in mine_scored), b - a, min(fits[i][0], k),
                          None if task["type"] == "language_modeling" else pick,  # LM: `correct` is the greedy match
                          [round(s.logprob / s.n_tokens, 6) for s in mine_scored]))
    model.train(was_training)
    results = [r for part in (gather_objects(local, dist) if dist is not None else [local]) for r in part]
    seconds = time.perf_counter() - t0
    table, item_log, correct, ids = {}, [], {}, {}
    for name, task in tasks.items():
        rows = sorted((r for r in results if r[0] == name), key=lambda r: r[1])
        ids[name] = [task["items"][r[1]]["id"] for r in rows]
        acc = sum(r[2] for r in rows) / len(rows) if rows else None  # None: no item fits the context
        b = task["random_baseline"]
        k, fewer, too_long = fitted[name]
        table[name] = {"type": task["type"], "shots": k, "shots_asked": task_shots(task, shots),
                       "fewer_shots": fewer, "too_long": too_long, "items": len(rows),
                       "accuracy": acc, "random_baseline": b, "centered": None if acc is None else centered(acc, b),
                       "requests": sum(r[4] for r in rows), "truncated": sum(r[3] for r in rows)}
        correct[name] = np.array([r[2] for r in rows], dtype=bool)
        item_log += [{"task": name, "index": r[1], "id": i, "shots": r[5], "gold": task["items"][r[1]]["gold"],
                      "pick": r[6], "scores": r[7], "correct": bool(r[2]), "contaminated": contaminated(seen, name, i)}
                     for r, i in zip(rows, ids[name])]
    baselines = {n: t["random_baseline"] for n, t in table.items()}
    ci, clean = stats.score_intervals(correct, baselines), stats.clean_scores(correct, ids, seen, baselines)
    for name, t in table.items():
        t.update(ci["tasks"][name], **clean["tasks"][name])
    scored = [n for n, t in table.items() if t["items"]]
    if len(scored) < len(table):
        log.warning("not scored (no item fits the context of %d tokens even without shots): %s", max_len,
                    ", ".join(n for n in table if n not in scored))
    score = sum(table[n]["centered"] for n in scored) / len(scored) if scored else None
    n_items = sum(t["items"] for t in table.values())
    return {"score_name": score_name(scored), "score": score, "score_ci": ci["score_ci"], "baselines": BASELINES,
            "clean_score": clean["clean_score"], "clean_score_ci": clean["clean_score_ci"], "tasks": table,
            "items": n_items, "seconds": seconds, "items_per_s": n_items / seconds if seconds > 0 else math.inf,
            "world_size": world, "item_log": item_log}


def contaminated(seen: dict[str, set] | None, task: str, item_id: str) -> bool | None:
    """Whether a training document shared an n-gram with the item (None: its task was not checked)."""
    return None if seen is None or task not in seen else item_id in seen[task]


def headline(result: dict, what: str = "") -> str:
    """The score line above a table: `**core_<n>** (mean centered accuracy over n tasks): **score**`."""
    scored = sum(1 for t in result["tasks"].values() if t["items"])
    score = "–" if result["score"] is None else f"{result['score']:.4f}"
    ci = result.get("score_ci")
    ci = f" (95 % CI {ci[0]:+.4f} … {ci[1]:+.4f})" if ci else ""
    return f"**{result['score_name']}** ({what}mean centered accuracy over {scored} tasks): **{score}**{ci}"


def clean_line(result: dict, why: str = "no decontamination report given") -> str:
    """The clean-subset line under a headline: the aggregate over the items no training document shared an
    n-gram with, or which tasks were not checked and `why`."""
    unchecked = [n for n, t in result["tasks"].items() if t.get("contaminated") is None]
    if unchecked:
        return f"Contamination not checked for {', '.join(unchecked)} ({why}): no clean-subset score."
    score, ci = result.get("clean_score"), result.get("clean_score_ci")
    value = "–" if score is None else f"{score:.4f}" + (f" (95 % CI {ci[0]:+.4f} … {ci[1]:+.4f})" if ci else "")
    n = sum(t["contaminated"] for t in result["tasks"].values())
    return (f"On clean items ({n} scored items share a decontamination n-gram with a training document of "
            f"the run, removed or not; left out): {result['score_name']} **{value}**.")


def clean_cells(t: dict) -> tuple[str, str, str]:
    """A task row's contaminated count and clean-subset accuracy and centered accuracy with intervals."""
    if t.get("contaminated") is None:
        return "not checked", "–", "–"
    if t["clean_accuracy"] is None:
        return str(t["contaminated"]), "–", "–"
    return (str(t["contaminated"]), f"{t['clean_accuracy']:.4f} {ci_cell(t['clean_accuracy_ci'])}",
            f"{t['clean_centered']:+.4f} {ci_cell(t['clean_centered_ci'], '+')}")


def ci_cell(ci: list[float] | None, sign: str = "") -> str:
    """An interval as a table cell ("–" when there is none)."""
    return "–" if not ci else f"[{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]"


def accuracy_cells(t: dict) -> tuple[str, str]:
    """A task row's accuracy and centered accuracy, each with its 95 % interval ("–" for a task with no
    scored item)."""
    if t["accuracy"] is None:
        return "–", "–"
    return (f"{t['accuracy']:.4f} {ci_cell(t.get('accuracy_ci'))}",
            f"{t['centered']:+.4f} {ci_cell(t.get('centered_ci'), '+')}")


def markdown_table(result: dict) -> str:
    """The per-task table for reports, under the score, the task list and the baseline table's version."""
    lines = [headline(result), "", f"Tasks ({len(result['tasks'])}): {', '.join(result['tasks'])}; random "
             f"baselines: {result.get('baselines', 'unrecorded')} (pipeline/data/tasks.py BASELINES).", "",
             clean_line(result), "",
             "| task | type | shots (asked) | items | accuracy | random | centered | fewer shots | too long | "
             "contaminated | clean accuracy | clean centered |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in result["tasks"].items():
        acc, cen = accuracy_cells(t)
        lines.append(f"| {name} | {t['type']} | {t['shots']} ({t['shots_asked']}) | {t['items']} | {acc} | "
                     f"{t['random_baseline']:.2f} | {cen} | {t['fewer_shots']} | {t['too_long']} | "
                     + " | ".join(clean_cells(t)) + " |")
    lines += ["", f"Shots: per task the largest k ≤ the asked shots whose prompts fit the context for at least "
              f"{FIT_FRACTION:.0%} of its items; an item that does not fit with k takes the most shots that fit "
              "(fewer shots); an item that does not fit even alone is not scored (too long), and a task none of "
              "whose items fit is left out of the mean. No item is truncated. Brackets: 95 % bootstrap intervals "
              "over the items (pipeline/evaluation/stats.py). Contaminated: scored items that share a "
              "decontamination n-gram with a training document of the run (R/decontam/report.json); clean: the "
              "others."]
    return "\n".join(lines)


def core_record(result: dict, prefix: str = "core") -> dict:
    """A result as metrics-record keys: its score (`core_<n>`) and `{prefix}/<task>` (centered accuracies);
    nothing when no task was scored. ChatCORE's records use the prefix `chat_core`."""
    if result["score"] is None:
        return {}
    return {result["score_name"]: result["score"],
            **{f"{prefix}/{n}": t["centered"] for n, t in result["tasks"].items() if t["centered"] is not None}}


def plot_core(records: list[dict], final: dict, out_png: str | Path, final_step: int | None) -> None:
    """CORE-vs-step: the in-training subsets (metrics records with the score's key) and the final score
    of the evaluate stage, per task faintly (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    name = final["score_name"]
    seen = [r for r in records if name in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for task in final["tasks"]:
        pts = [(r["step"], r[f"core/{task}"]) for r in seen if f"core/{task}" in r]
        if pts:
            ax.plot(*zip(*pts), lw=0.7, alpha=0.35)
    if seen:
        ax.plot([r["step"] for r in seen], [r[name] for r in seen], "o-", ms=3, color="black",
                label=f"{name} during training (subset)")
    x = final_step if final_step is not None else (seen[-1]["step"] if seen else 0)
    n_items = max(t["items"] for t in final["tasks"].values())
    if final["score"] is not None:
        ax.plot([x], [final["score"]], "*", ms=12, color="tab:red", label=f"{name} final (≤ {n_items} items/task)")
    ax.axhline(0.0, ls="--", color="gray", lw=0.8, label="random (centered accuracy 0)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("centered accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def core_settings(params: dict, items_key: str = "core_max_items") -> dict:
    """The scorer's keyword arguments from a stage's params (eval.* keys, seed, and for the default
    batch the model, train and hardware sections); `items_key` names the item cap (training's quick
    subset: core_interval_items). ``eval.core_batch_tokens: null`` is bounded by memory
    (`pipeline.planning.memory.eval_batch_tokens`: what fits beside the training state on the configured GPU),
    not by the training micro-batch; the LM head takes ``train.ce_chunk_tokens`` positions at a time."""
    view = run_config(params)
    eval_cfg = view.eval
    return {"seed": view.seed, "batch_tokens": eval_batch_tokens(view), "shots": eval_cfg.core_shots,
            "max_items": getattr(eval_cfg, items_key), "head_chunk": view.train.ce_chunk_tokens}


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.core_benchmark",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--ckpt", required=True, help="R/train/final.pt")
    p.add_argument("--tokenizer", required=True, help="R/tokenizer/encoding.json")
    p.add_argument("--tasks-dir", required=True, help="R/eval_data (task files of the eval_data stage)")
    p.add_argument("--out", required=True, help="the table as JSON (written by rank 0; the per-item log beside it, "
                                                "core_items.jsonl)")
    args = p.parse_args(argv)
    params = params_from_args(args, evaluate_slice)
    view = run_config(params)

    dist = init_distributed(view.hardware.device, view.hardware.process_group_timeout_min)
    try:
        tasks = load_tasks(args.tasks_dir, view.eval.tasks)
        result = evaluate_tasks(load_model(args.ckpt, dist.device), load_tokenizer(args.tokenizer), tasks,
                                dist=dist, **core_settings(params))
        if dist.is_main:
            result["meta"] = provenance("core", params, [args.ckpt, args.tokenizer]
                                        + [task_path(args.tasks_dir, n) for n in tasks])
            stats.write_items(stats.items_path(args.out), result.pop("item_log"))
            write_json(args.out, result)
            log.info("%s = %s over %d items (%.1f items/s)", result["score_name"], result["score"], result["items"],
                     result["items_per_s"])
    finally:
        if dist.owns_group:
            torch_dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
