"""`python -m pipeline.bench --suite reference`: the reference write-up's 1×H100 rows on the visible device.

    python -m pipeline.bench --suite reference [--configfile configs/llama3-1b-fineweb.yaml] [--device cuda]
        [--steps 10] [--warmup 3] [--out results/bench/reference.md] [--json]

`run_suite` runs `REFERENCE_SUITE` as steps of our trainer and `format_suite` prints measured step time,
tokens/s, MFU and memory beside pipeline.planning's prediction; rows that cannot run are listed as skipped
or OOM, and ``--out`` is rewritten after every row.

How rows run and are isolated from each other: docs/bench.md, "The reference suite".
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from pipeline.config import deep_merge
from pipeline.io import atomic_write, get_logger, write_json
from pipeline.planning.memory import StepSetup, memory
from pipeline.planning.step_time import predicted_mfu, step_time
from pipeline.run_config import run_config

log = get_logger(__name__)

# (name, micro_batch, activation_checkpointing, fp8, optimizer): the reference's bf16 rows (Part 1:
# micro-batch 16 without and with checkpointing, 64 with every block; Part 2: per-region
# checkpointing at 16, 8-bit AdamW, fp8 tensorwise / rowwise at 64).
REFERENCE_SUITE = [
    ("16 none", 16, "none", "none", "adamw"),
    ("16 every_n", 16, "every_n", "none", "adamw"),
    ("16 attention", 16, "attention", "none", "adamw"),
    ("16 mlp", 16, "mlp", "none", "adamw"),
    ("16 block", 16, "block", "none", "adamw"),
    ("8 block adamw8bit", 8, "block", "none", "adamw8bit"),
    ("64 block", 64, "block", "none", "adamw"),
    ("64 block adamw8bit", 64, "block", "none", "adamw8bit"),
    ("64 block fp8 tensorwise", 64, "block", "tensorwise", "adamw"),
    ("64 block fp8 rowwise", 64, "block", "rowwise", "adamw"),
]
CUDA_ONLY = "needs CUDA (fp8 / 8-bit AdamW)"


def suite_config(cfg: dict, micro_batch: int, checkpoint: str, fp8: str, optimizer: str) -> dict:
    """`cfg` set to one suite row, with a checkpoint_every_n of 2 (the reference's every second layer)."""
    train = {"micro_batch": micro_batch, "activation_checkpointing": checkpoint, "fp8": fp8, "optimizer": optimizer,
             "checkpoint_every_n": 2}
    return deep_merge(cfg, {"train": train})


def predict(cfg: dict) -> dict:
    """pipeline.planning's prediction of one single-GPU bench step (no accumulation, no DDP): `cfg` with a
    global batch of one micro-batch on one GPU (a suite row's micro-batch need not divide the config's)."""
    train = run_config(cfg).train
    one_step = deep_merge(cfg, {"train": {"global_batch_tokens": train.micro_batch * train.seq_len},
                                "hardware": {"nodes": 1, "nproc_per_node": 1}})
    s = StepSetup.from_config(run_config(one_step))
    mem = memory(s)
    seconds = step_time(s)["total"]
    return {"step_time_s": seconds, "tokens_per_s": s.tokens / seconds, "mfu": predicted_mfu(s, seconds),
            "peak_gb": mem["peak"], "reserved_gb": mem["reserved"]}


def skip_reason(e: BaseException) -> str:
    """A failed row's reason: "OOM", or the exception's type and first line (kept short for the table)."""
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    first = (str(e).strip().splitlines() or [""])[0].replace("|", "/")  # a markdown table cell
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"failed: {type(e).__name__}" + (f": {first}" if first else "")


def release_device(device: str) -> None:
    """After a row: drop compiled graphs, collect the row's model/optimizer (reference cycles hold
    them), then return the freed blocks to the driver (only collected tensors can be)."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_suite(cfg: dict, steps: int, warmup: int, bench, on_row=None, suite=None, skip=None) -> list[dict]:
    """Every row of `suite` (default REFERENCE_SUITE) on cfg's device, each timed by
    ``bench(cfg, steps, warmup)`` (`pipeline.bench.throughput.run_bench`): {name, settings, predicted,
    measured (or None), skipped (None, a reason, "OOM", or "failed: <exception>")}. Any exception of
    a row is recorded in its row (`skip_reason`), never raised. `on_row(row, rows)` is called after
    each row with the rows so far (to write them as they finish). ``skip(name, row_cfg)``, when
    given, returns a reason to leave a row out (`pipeline.bench.gpu_check`'s time budget) or None."""
    device = run_config(cfg).hardware.device
    rows = []
    for name, mb, ckpt, fp8, opt in suite or REFERENCE_SUITE:
        row_cfg = suite_config(cfg, mb, ckpt, fp8, opt)
        row = {"name": name, "micro_batch": mb, "activation_checkpointing": ckpt, "fp8": fp8, "optimizer": opt,
               "predicted": predict(row_cfg), "measured": None, "skipped": None}
        if device != "cuda" and (fp8 != "none" or opt == "adamw8bit"):
            row["skipped"] = CUDA_ONLY
        elif skip and (reason := skip(name, row_cfg)):
            row["skipped"] = reason
        else:
            try:
                r = bench(row_cfg, steps, warmup)
                row["measured"] = {"step_time_s": r["step_time_s"], "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                                   "peak_gb": r.get("mem/peak_gb"), "reserved_gb": r.get("mem/reserved_gb"),
                                   "device": r["device"]}
            except Exception as e:  # one row's failure is that row's result
                row["skipped"] = skip_reason(e)
                log.warning("suite row %r: %s", name, row["skipped"])
                del e  # its traceback holds the row's frames (model, optimizer) alive
            finally:  # free this row's model, optimizer and compiled graphs before the next
                release_device(device)
        rows.append(row)
        if on_row:
            on_row(row, rows)
    return rows


def _cell(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def format_suite(rows: list[dict], title: str) -> str:
    """Markdown: measured | predicted | ratio for step time, tokens/s, MFU, peak and reserved GB."""
    head = ("| row | step s (meas. / pred. / ratio) | tokens/s (meas. / pred.) | MFU (meas. / pred.) "
            "| peak GB (meas. / pred.) | reserved GB (meas. / pred. / ratio) |")
    lines = [f"## {title}", "", head, "|---|---|---|---|---|---|"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        if m is None:
            lines.append(f"| {r['name']} | {r['skipped']}; pred. {p['step_time_s']:.3f} | — / {p['tokens_per_s']:,.0f} "
                         f"| — / {p['mfu']:.1%} | — / {p['peak_gb']:.1f} | — / {p['reserved_gb']:.1f} / — |")
            continue
        ratio = m["step_time_s"] / p["step_time_s"]
        mem_ratio = None if m["reserved_gb"] is None else m["reserved_gb"] / p["reserved_gb"]
        lines.append(
            f"| {r['name']} | {m['step_time_s']:.3f} / {p['step_time_s']:.3f} / {ratio:.2f} "
            f"| {m['tokens_per_s']:,.0f} / {p['tokens_per_s']:,.0f} | {m['mfu']:.1%} / {p['mfu']:.1%} "
            f"| {_cell(m['peak_gb'], '.1f')} / {p['peak_gb']:.1f} "
            f"| {_cell(m['reserved_gb'], '.1f')} / {p['reserved_gb']:.1f} / {_cell(mem_ratio, '.2f')} |")
    lines += ["", "Predicted: pipeline.planning (a model, not a measurement). Measured: this run's median step."]
    return "\n".join(lines) + "\n"


def write_suite(out: str | Path, text: str, header: dict, rows: list[dict]) -> None:
    """The markdown table at `out` and {**header, rows} as JSON beside it (.json), atomically."""
    out = Path(out)
    with atomic_write(out, encoding="utf-8") as f:
        f.write(text)
    write_json(out.with_suffix(".json"), {**header, "rows": rows})
