r"""Stages report: every training stage of the run side by side, and their loss curves on one plot.

    python -m pipeline.evaluation.stages_report --params JSON --run-dir R --out-json R/eval/stages.json \
        --out-md R/eval/stages.md --out-png R/eval/stages.png

`stages_report(...)` reads each stage's summary, metrics and evaluation report, reconciles its tokens
(a stage that does not reconcile fails the rule), compares each stage with the one before on the
benchmarks both evaluated, and writes ``stages.json``, ``stages.md`` and ``stages.png``.

What is reconciled and how the plot reads: docs/evaluation.md, "The stages report".
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.config import add_config_args, evaluate_slice, params_from_args
from pipeline.config.layout import RunLayout
from pipeline.errors import PipelineError
from pipeline.evaluation import compare
from pipeline.io import atomic_path, atomic_write, get_logger, provenance, read_json, run_cli, write_json
from pipeline.planning.stages import stage_list
from pipeline.run_config import run_config

log = get_logger(__name__)


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def reconcile(name: str, summary: dict) -> None:
    """One stage's token accounting (docs/evaluation.md); a PipelineError names what does not add up."""
    expected = summary["num_steps"] * summary["tokens_per_step"]
    if summary["tokens_trained"] != expected or summary["tokens_trained"] != summary["tokens_planned"]:
        raise PipelineError(f"stage '{name}': trained {summary['tokens_trained']} tokens but num_steps × "
                            f"tokens_per_step = {expected} and {summary['tokens_planned']} were planned; "
                            "rerun its train rule")
    if not 0 < summary["loss_tokens"] <= summary["tokens_trained"]:
        raise PipelineError(f"stage '{name}': {summary['loss_tokens']} loss tokens of {summary['tokens_trained']} "
                            "trained is impossible; rerun its train rule")


def stage_rows(params: dict, run: RunLayout) -> tuple[list[dict], dict[str, list[dict]]]:
    rows, curves = [], {}
    for st in stage_list(run_config(params)):
        name = st["name"]
        summary = read_json(run.train_summary(name))
        reconcile(name, summary)
        report = read_json(run.eval(name))
        curves[name] = read_metrics(Path(run.train_dir(name)) / "metrics.jsonl")
        rows.append({
            "stage": name, "mix": st["mix"], "loss": st["loss"], "init_from": st["init_from"],
            "budget": st["budget"], "num_steps": summary["num_steps"], "tokens_trained": summary["tokens_trained"],
            "loss_tokens": summary["loss_tokens"], "val_loss": report["val_loss"],
            "chat_val_loss": report.get("chat_val_loss"), "answers": report.get("answers", []),
            "chat_core": report.get("chat_core"),
            # what the stage's CORE score is over: its task list and baseline table (compare refuses a mismatch)
            "core_tasks": list((report.get("core") or {}).get("tasks", {})),
            "core_baselines": (report.get("core") or {}).get("baselines"),
        })
    return rows, curves


def consecutive_comparisons(run: RunLayout, names: list[str]) -> list[dict]:
    """Each stage against the one before it (pipeline/evaluation/compare.py): the paired differences, or
    why the two evaluations cannot be paired."""
    out = []
    for prev, cur in zip(names, names[1:]):
        a, b = run.eval(prev), run.eval(cur)
        try:
            out.append({**compare.compare_reports(a, b), "a": prev, "b": cur})
        except PipelineError as e:
            out.append({"a": prev, "b": cur, "refused": str(e)})
    return out


def plot_stages(curves: dict[str, list[dict]], out_png: str | Path) -> None:
    """Loss curves of all stages on one cumulative-token axis (docs/evaluation.md, "The stages report")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    offset = 0
    for i, (name, records) in enumerate(curves.items()):
        color = f"C{i}"
        train = [r for r in records if "loss" in r]
        val = [r for r in records if "val_loss" in r]
        ax.plot([offset + r["tokens"] for r in train], [r["loss"] for r in train], color=color, lw=1,
                label=f"{name} train")
        ax.plot([offset + r["tokens"] for r in val], [r["val_loss"] for r in val], "o--", color=color, ms=3,
                label=f"{name} val")
        if i:
            ax.axvline(offset, color="gray", ls=":", lw=1)
        offset += max((r["tokens"] for r in records if "tokens" in r), default=0)
    ax.set_xlabel("tokens trained (all stages)")
    ax.set_ylabel("cross-entropy (nats / target token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def markdown(rows: list[dict], comparisons: list[dict] = ()) -> str:
    lines = ["# Training stages", "", "![loss curves of all stages](stages.png)", "",
             "| stage | mix | loss | init from | steps | tokens trained | loss tokens | val loss | chat val loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chat = "–" if r["chat_val_loss"] is None else f"{r['chat_val_loss']:.4f}"
        lines.append(f"| {r['stage']} | {r['mix']} | {r['loss']} | {r['init_from'] or 'scratch'} | {r['num_steps']:,} "
                     f"| {r['tokens_trained']:,} | {r['loss_tokens']:,} | {r['val_loss']:.4f} | {chat} |")
    lines.append(f"| **total** | | | | {sum(r['num_steps'] for r in rows):,} "
                 f"| {sum(r['tokens_trained'] for r in rows):,} | {sum(r['loss_tokens'] for r in rows):,} | | |")
    core = [f"- {r['stage']}: {len(r['core_tasks'])} tasks ({', '.join(r['core_tasks'])}); random baselines "
            f"{r.get('core_baselines') or 'unrecorded'}" for r in rows if r.get("core_tasks")]
    if core:
        lines += ["", "CORE tasks and baseline table per stage:", "", *core]
    for r in rows:
        if r.get("chat_core"):
            from pipeline.evaluation.chat_core import markdown_table as chat_table

            lines += ["", f"## {r['stage']}: ChatCORE", "", chat_table(r["chat_core"])]
    for c in comparisons:
        lines += ["", f"## {c['a']} → {c['b']}: paired differences", ""]
        lines.append(f"Not comparable: {c['refused']}" if "refused" in c else compare.markdown(c, c["a"], c["b"]))
    for r in rows:
        if r["answers"]:
            lines += ["", f"## {r['stage']}: answers to the fixed questions", ""]
            for a in r["answers"]:
                lines += [f"**{a['question']}**", "", "```", a["answer"], "```", ""]
    return "\n".join(lines) + "\n"


def stages_report(params: dict, run_dir: str | Path, out_json, out_md, out_png) -> dict:
    run = RunLayout.at(run_dir)
    rows, curves = stage_rows(params, run)
    comparisons = consecutive_comparisons(run, [r["stage"] for r in rows])
    plot_stages(curves, out_png)
    with atomic_write(out_md, encoding="utf-8") as f:
        f.write(markdown(rows, comparisons))
    inputs = [run.train_summary(r["stage"]) for r in rows]
    report = {"stages": rows, "comparisons": comparisons, "total_steps": sum(r["num_steps"] for r in rows),
              "total_tokens": sum(r["tokens_trained"] for r in rows), "meta": provenance("stages", params, inputs)}
    write_json(out_json, report)
    log.info("%d stage(s), %d tokens trained in all", len(rows), report["total_tokens"])
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.stages_report",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--run-dir", required=True, help="R (the run's results directory)")
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    p.add_argument("--out-png", required=True)
    args = p.parse_args(argv)
    stages_report(params_from_args(args, evaluate_slice), args.run_dir, args.out_json, args.out_md, args.out_png)


if __name__ == "__main__":
    run_cli(main)
