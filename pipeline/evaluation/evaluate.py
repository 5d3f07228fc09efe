r"""Evaluate stage: validation loss, bits per byte, a unigram baseline, CORE-style benchmarks, generations, curves.

    python -m pipeline.evaluation.evaluate --params JSON --ckpt R/train/S/final.pt --val R/pack/M/val.json \
        --train R/pack/M/train.json --tokenizer R/tokenizer/encoding.json \
        --metrics R/train/S/metrics.jsonl --outdir R/eval/S [--eval-data R/eval_data] \
        [--decontam R/decontam/report.json] [--batch-rows 8]

`evaluate(...)` is the library entry; it writes ``report.json``, ``report.md``, ``loss.png`` and, with
``--eval-data``, ``core.png`` (atomically). A chat stage adds the assistant-only loss, answers to
``eval.chat_questions`` and the ChatCORE table.

The definitions (val_loss, val_bpb, the unigram baseline, CORE, generations, per-stage masks):
docs/evaluation.md, "The evaluate stage".
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from pipeline.config import add_config_args, evaluate_slice, params_from_args
from pipeline.data.encoding import load_tokenizer
from pipeline.data.loader import PackedLoader
from pipeline.errors import PipelineError
from pipeline.evaluation import stats
from pipeline.evaluation.chat import answer_questions
from pipeline.evaluation.chat_core import chat_settings, evaluate_chat
from pipeline.evaluation.core_benchmark import (
    ci_cell,
    core_settings,
    evaluate_tasks,
    load_tasks,
    markdown_table,
    plot_core,
)
from pipeline.io import atomic_path, atomic_write, get_logger, provenance, run_cli, write_json
from pipeline.model.engine import generate_texts
from pipeline.model.load import load_trained
from pipeline.planning.stages import is_chat_stage, stage_config, stage_names
from pipeline.run_config import run_config

log = get_logger(__name__)

ROWS_PER_READ = 4096  # rows per chunk when counting the train split
BATCH_ROWS = 8  # rows per fp32 forward (fp32 attention may materialise the T×T scores)


def token_byte_lengths(tokenizer, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: UTF-8 bytes of each token id; 0 for special tokens and unused ids."""
    special = set(tokenizer.special.values())
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(min(vocab_size, tokenizer.n_vocab)):
        if i not in special:
            try:
                out[i] = len(tokenizer.enc.decode_single_token_bytes(i))
            except KeyError:  # a gap in a stock encoding's id space
                pass
    return out


def iter_rows(loader, rows: int):
    """Every row of a packed split in order, as (inputs, targets, mask-or-None) batches of `rows`."""
    for start in range(0, loader.n_rows, rows):
        yield loader.batch(np.arange(start, min(start + rows, loader.n_rows)))


def counted_targets(targets: torch.Tensor, mask: torch.Tensor | None) -> np.ndarray:
    """The target ids the loss counts, as a flat numpy array."""
    t = targets.reshape(-1)
    return (t if mask is None else t[mask.reshape(-1)]).numpy()


def token_nats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 cross-entropy of every position, [tokens], with the chunked loss's arithmetic (fp32 logits of
    `chunk` positions at a time, log-sum-exp minus the target's logit; pipeline/model/losses.py)."""
    h, t, w = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), weight.float()
    out = torch.empty(t.numel(), dtype=torch.float32, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, t.numel(), chunk):
            logits = h[s:s + chunk].float() @ w.T
            out[s:s + chunk] = torch.logsumexp(logits, dim=-1) - logits.gather(1, t[s:s + chunk, None])[:, 0]
    return out


class DocumentSums:
    """Per-document sums of a split read row by row in order (the unit `stats.ratio_interval` resamples).
    A document starts at an input ``<|bos|>``, or after an input ``<|eos|>`` not followed by one (the eos
    policy); a document a concat pack splits across rows continues in the next row. Positions are the
    documents' of their input token."""

    def __init__(self, bos: int | None, eos: int | None):
        self.bos, self.eos, self.prev = bos, eos, None
        self.sums: list[np.ndarray] = []  # [3] nats, tokens, bytes per document, in order

    def add(self, inputs: np.ndarray, values: np.ndarray) -> None:
        """inputs: [n] input ids in reading order; values: [3, n] nats, counted tokens, bytes per position."""
        prev = np.concatenate([[-1 if self.prev is None else self.prev], inputs[:-1]])
        starts = inputs == self.bos if self.bos is not None else np.zeros(inputs.shape, bool)
        if self.eos is not None:
            starts |= (prev == self.eos) & ~starts
        if self.prev is None:
            starts[0] = True
        doc = np.cumsum(starts) - int(starts[0])  # 0: the first segment (a new document, or a continued one)
        local = np.stack([np.bincount(doc, weights=v, minlength=doc[-1] + 1) for v in values], axis=1)
        if self.sums and not starts[0]:
            self.sums[-1] = self.sums[-1] + local[0]
            local = local[1:]
        self.sums.extend(local)
        self.prev = int(inputs[-1])

    def arrays(self) -> np.ndarray:
        """[3, documents]: nats, tokens, bytes."""
        return np.array(self.sums, dtype=np.float64).reshape(-1, 3).T


@torch.no_grad()
def evaluate_rows(model, loaders: list[PackedLoader], device: torch.device, rows: int, chunk: int,
                  byte_lengths: np.ndarray, delimiters: tuple[int | None, int | None] = (None, None)) -> list[dict]:
    """Per loader of `loaders` (one packed split read with different loss masks: a chat stage's own loss and
    its assistant-only loss), Σ fp32 CE (nats), counted target tokens and their UTF-8 bytes over all rows, and
    under ``docs`` the same per document ([3, documents]: `DocumentSums` with the tokenizer's (bos, eos) ids;
    without them a row is the unit). The model runs once per batch of rows, whatever the number of masks."""
    model.eval()
    first = loaders[0]
    if any(ld.n_rows != first.n_rows or ld.seq_len != first.seq_len for ld in loaders):
        raise ValueError("evaluate_rows: the loaders must read one packed split")
    docs_sums = [DocumentSums(*delimiters) for _ in loaders]
    for start in range(0, first.n_rows, rows):
        idx = np.arange(start, min(start + rows, first.n_rows))
        x, y, m, *docs = first.batch(idx)
        hidden = model.hidden(x.to(device), docs[0].to(device) if docs else None)
        nats = token_nats(hidden, model.lm_head_weight, y.to(device), chunk).cpu().double().numpy()
        lengths = byte_lengths[y.reshape(-1).numpy()]
        masks = [m] + [ld.batch(idx)[2] for ld in loaders[1:]]  # each loader's mask of these rows
        for mask, sums in zip(masks, docs_sums):
            counted = np.ones(nats.shape) if mask is None else mask.reshape(-1).double().numpy()
            values = np.stack([nats * counted, counted, lengths * counted])
            if delimiters == (None, None):  # every row its own unit
                for r in range(x.shape[0]):
                    sums.prev = None
                    sums.add(x[r].numpy(), values[:, r * x.shape[1]:(r + 1) * x.shape[1]])
            else:
                sums.add(x.reshape(-1).numpy(), values)
    out = []
    for sums in docs_sums:
        per_doc = sums.arrays()
        out.append({"nats": float(per_doc[0].sum()), "tokens": int(per_doc[1].sum()),
                    "bytes": int(per_doc[2].sum()), "docs": per_doc})
    return out


def delimiters(tokenizer) -> tuple[int | None, int | None]:
    """The (bos, eos) ids that mark documents in packed rows under the tokenizer's delimiter policy
    (`DocumentSums`; None: that token does not delimit documents)."""
    return tokenizer.bos_id if tokenizer.delimiter in ("bos", "both") else None, tokenizer.eos_id


def loss_intervals(sums: dict) -> dict:
    """95 % intervals of val loss and bits per byte, documents resampled (pipeline/evaluation/stats.py)."""
    nats, tokens, n_bytes = sums["docs"]
    return {"loss_ci": stats.ratio_interval(nats, tokens),
            "bpb_ci": stats.ratio_interval(nats, n_bytes, 1 / math.log(2)), "documents": int(nats.size)}


def unigram_counts(loader, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id is a counted target in the split of `loader`."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for _, y, m in iter_rows(loader, ROWS_PER_READ):
        counts += np.bincount(counted_targets(y, m), minlength=vocab_size)[:vocab_size]
    return counts


def unigram_baseline(train_counts: np.ndarray, val_loader, n_vocab: int, byte_lengths: np.ndarray) -> dict:
    """Σ nats of the validation targets under add-one-smoothed train unigram frequencies."""
    logp = np.log(train_counts[:n_vocab] + 1.0) - math.log(train_counts.sum() + n_vocab)
    nats, tokens, n_bytes = 0.0, 0, 0
    for _, y, m, *_ in iter_rows(val_loader, ROWS_PER_READ):
        t = counted_targets(y, m)
        nats -= float(logp[t].sum())
        tokens += t.size
        n_bytes += int(byte_lengths[t].sum())
    return {"nats": nats, "tokens": tokens, "bytes": n_bytes}


def per_token_and_bpb(sums: dict) -> tuple[float, float]:
    """(nats per token, bits per byte) of {"nats", "tokens", "bytes"}."""
    return sums["nats"] / sums["tokens"], sums["nats"] / math.log(2) / sums["bytes"]


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: list[dict], out_png: str | Path, baseline: float) -> None:
    """Train loss per logged step and validation loss, with the unigram baseline (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss", ms=3)
    ax.axhline(baseline, ls="--", color="gray", label=f"unigram baseline ({baseline:.3f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def markdown_report(report: dict) -> str:
    s = report["summary"]
    lines = [
        "# Evaluation", "",
        "| metric | value |", "|---|---|",
        f"| validation loss (fp32 CE, nats/token) | {report['val_loss']:.4f} {ci_cell(report.get('val_loss_ci'))} |",
        f"| validation perplexity | {report['val_perplexity']:.2f} |",
        f"| validation bits per byte | {report['val_bpb']:.4f} {ci_cell(report.get('val_bpb_ci'))} |",
        f"| unigram baseline (nats/token) | {report['unigram_baseline']:.4f} |",
        f"| unigram baseline (bits per byte) | {report['unigram_baseline_bpb']:.4f} |",
        f"| beats the unigram baseline | {'yes' if report['beats_unigram'] else '**no**'} |",
        f"| validation target tokens / bytes | {report['val_tokens']:,} / {report['val_bytes']:,} |",
        f"| tokens trained (planned) | {s.get('tokens_trained', 0):,} ({s.get('tokens_planned', 0):,}) |",
        "", f"Brackets: 95 % bootstrap intervals (validation: its {report.get('val_documents', 0):,} documents "
        "resampled; benchmarks: their items; pipeline/evaluation/stats.py). Per-item logs: core_items.jsonl, "
        "chat_core_items.jsonl.", "", "![loss curve](loss.png)", "",
    ]
    if report.get("core"):
        lines += ["## CORE-style benchmarks", "", markdown_table(report["core"]), "", "![CORE vs step](core.png)", ""]
    lines += ["## Generations", ""]
    for g in report["generations"]:
        lines += [f"**{g['prompt']}**", "", "```", g["prompt"] + g["completion"], "```", ""]
    if "answers" in report:
        chat = "–" if report["chat_val_loss"] is None else \
            f"{report['chat_val_loss']:.4f} {ci_cell(report.get('chat_val_loss_ci'))}"
        lines += ["## Chat", "", f"Chat-format validation loss (assistant tokens only, nats/token): {chat} over "
                  f"{report['chat_val_tokens']:,} tokens.", ""]
        for a in report["answers"]:
            lines += [f"**{a['question']}**", "", "```", a["answer"], "```", ""]
    if report.get("chat_core"):
        from pipeline.evaluation.chat_core import markdown_table as chat_table

        lines += ["## ChatCORE", "", chat_table(report["chat_core"]), ""]
    return "\n".join(lines)


def chat_val_loader(params: dict, val_meta: str) -> PackedLoader | None:
    """A chat stage's (its mix has a chat source and a bestfit pack) validation rows with the assistant-only
    loss mask (content and <|assistant_end|>); None for a text stage."""
    view = run_config(params)
    if not is_chat_stage(view):
        return None
    return PackedLoader(val_meta, 1, shuffle=False, loss="assistant", with_doc_ids=view.stage["doc_mask"])


def chat_evaluation(model, tokenizer, params: dict, sums: dict | None) -> dict:
    """For a chat stage (`sums`: its validation rows' assistant-only sums, `chat_val_loader`): ``chat_val_loss``,
    the mean CE over the assistant tokens of the held-out conversations, and ``answers`` to
    ``eval.chat_questions`` (greedy, chat template, KV-cache engine). Empty for a text stage (`sums` None)."""
    if sums is None:
        return {}
    view = run_config(params)
    return {"chat_val_loss": sums["nats"] / sums["tokens"] if sums["tokens"] else None,
            "chat_val_loss_ci": loss_intervals(sums)["loss_ci"],
            "chat_val_tokens": sums["tokens"],
            "answers": answer_questions(model, tokenizer, view.eval.chat_questions, view.eval.max_new_tokens)}


def read_seen(path: str | Path, tasks: list[str]) -> dict[str, set]:
    """Per task of `tasks` the ids of the items that training documents shared an n-gram with, from the
    decontamination report's ``contaminated_items``; {} (nothing checked) when decontamination is off.
    One error when the report is unreadable or predates the item side, or misses a task."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        if not report["enabled"]:
            return {}
        items = report["contaminated_items"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PipelineError(f"{path}: not a decontamination report with contaminated_items ({e!r}); rerun the "
                            "decontaminate rule") from None
    missing = [t for t in tasks if t not in items]
    if missing:
        raise PipelineError(f"{path}: no contaminated_items for {', '.join(missing)} (eval.tasks changed since it "
                            "was written); rerun the decontaminate rule")
    return {t: set(items[t]["ids"]) for t in tasks}


def evaluate(params: dict, ckpt_path: str, val_meta: str, train_meta: str, tokenizer_path: str, metrics_path: str,
             outdir: str, batch_rows: int = BATCH_ROWS, eval_data: str | None = None,
             decontam: str | None = None) -> dict:
    """Compute the report (docs/evaluation.md, "The evaluate stage") and write report.json, report.md and loss.png."""
    view = run_config(params)
    outdir = Path(outdir)
    want_cuda = view.hardware.device == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda" if want_cuda else "cpu")
    model, final = load_trained(ckpt_path, device)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = model.cfg.vocab_size
    byte_lengths = token_byte_lengths(tokenizer, vocab)
    if "stage" not in params:  # a whole run config: its first stage
        params = stage_config(view, stage_names(view)[0])
    st = run_config(params).stage
    val = PackedLoader(val_meta, 1, shuffle=False, loss=st["loss"], with_doc_ids=st["doc_mask"])
    train = PackedLoader(train_meta, 1, shuffle=False, loss=st["loss"])

    chat_val = chat_val_loader(params, val_meta)
    val_sums, *chat_sums = evaluate_rows(model, [val] + ([chat_val] if chat_val else []), device, batch_rows,
                                         view.train.ce_chunk_tokens, byte_lengths, delimiters(tokenizer))
    val_ci = loss_intervals(val_sums)
    chat = chat_evaluation(model, tokenizer, params, chat_sums[0] if chat_sums else None)
    uni_sums = unigram_baseline(unigram_counts(train, vocab), val, tokenizer.n_vocab, byte_lengths)
    val_loss, val_bpb = per_token_and_bpb(val_sums)
    uni_loss, uni_bpb = per_token_and_bpb(uni_sums)
    eval_cfg = view.eval
    report = {
        "val_loss": val_loss,
        "val_loss_ci": val_ci["loss_ci"],
        "val_perplexity": math.exp(val_loss),
        "val_bpb": val_bpb,
        "val_bpb_ci": val_ci["bpb_ci"],
        "val_documents": val_ci["documents"],
        "val_tokens": val_sums["tokens"],
        "val_bytes": val_sums["bytes"],
        "val_nats": val_sums["nats"],
        "unigram_baseline": uni_loss,
        "unigram_baseline_bpb": uni_bpb,
        "beats_unigram": val_loss < uni_loss,
        "generations": generate_texts(model, tokenizer, eval_cfg.prompts, eval_cfg.max_new_tokens,
                                      eval_cfg.temperature, view.seed, device),
        **chat,
        "stage": st["name"],
        "summary": final.get("summary", {}),
        "core": None,
        "chat_core": None,
        "meta": provenance("evaluate", params, [ckpt_path, val_meta, train_meta, tokenizer_path, metrics_path,
                                                *([decontam] if decontam is not None else [])]),
    }
    item_logs = {"core": [], "chat_core": []}  # per-item logs, written beside the report with --eval-data
    if eval_data is not None:
        tasks = load_tasks(eval_data, eval_cfg.tasks)
        seen = read_seen(decontam, eval_cfg.tasks) if decontam is not None else None
        report["core"] = evaluate_tasks(model, tokenizer, tasks, seen=seen, **core_settings(params))
        item_logs["core"] = report["core"].pop("item_log")
        plot_core(read_metrics(metrics_path), report["core"], outdir / "core.png", report["summary"].get("num_steps"))
        log.info("%s = %s over %d items", report["core"]["score_name"], report["core"]["score"],
                 report["core"]["items"])
    if eval_data is not None and chat and eval_cfg.chat_tasks:
        chat_tasks = load_tasks(eval_data, eval_cfg.chat_tasks, chat=True)
        report["chat_core"] = evaluate_chat(model, tokenizer, chat_tasks, **chat_settings(params))
        item_logs["chat_core"] = report["chat_core"].pop("item_log")
        log.info("%s = %s over %d items", report["chat_core"]["score_name"], report["chat_core"]["score"],
                 report["chat_core"]["items"])
    if not report["beats_unigram"]:
        log.warning("validation loss %.4f does not beat the unigram baseline %.4f", val_loss, uni_loss)
    plot_loss(read_metrics(metrics_path), outdir / "loss.png", uni_loss)
    if eval_data is not None:
        for kind, rows in item_logs.items():
            stats.write_items(stats.items_path(outdir / "report.json", kind), rows)
    with atomic_write(outdir / "report.md", encoding="utf-8") as f:
        f.write(markdown_report(report))
    write_json(outdir / "report.json", report)
    log.info("val loss %.4f (bpb %.4f), unigram %.4f (bpb %.4f)", val_loss, val_bpb, uni_loss, uni_bpb)
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.evaluate", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--ckpt", required=True, help="R/train/{stage}/final.pt")
    p.add_argument("--val", required=True, help="packed validation rows metadata, R/pack/{mix}/val.json")
    p.add_argument("--train", required=True, help="packed train rows metadata (for the unigram baseline)")
    p.add_argument("--tokenizer", required=True, help="R/tokenizer/encoding.json")
    p.add_argument("--metrics", required=True, help="R/train/{stage}/metrics.jsonl (for the loss curve)")
    p.add_argument("--outdir", required=True, help="R/eval")
    p.add_argument("--decontam", help="R/decontam/report.json: count the contaminated items and score the clean ones")
    p.add_argument("--batch-rows", type=int, default=BATCH_ROWS, help="validation rows per forward pass")
    p.add_argument("--eval-data", help="R/eval_data: score the CORE-style tasks (eval.tasks) too")
    args = p.parse_args(argv)
    evaluate(params_from_args(args, evaluate_slice), args.ckpt, args.val, args.train, args.tokenizer, args.metrics,
             args.outdir, args.batch_rows, args.eval_data, args.decontam)


if __name__ == "__main__":
    run_cli(main)
