"""Is B better than A? Paired differences of two evaluations on the same benchmark items.

    python -m pipeline.evaluation.compare A B [--json]

A and B are each an evaluation report (``R/eval/<stage>/report.json``), a stage's evaluation directory
(``R/eval/<stage>``), or a run directory (``R``: its last training stage). For CORE and ChatCORE it prints
per task and for the aggregate A, B, B − A and the 95 % paired bootstrap interval of the difference
(pipeline/evaluation/stats.py), flagging (``*``) the differences whose interval excludes 0.
`compare_reports(path_a, path_b)` is the library entry (the stages report uses it).

When two tables are comparable: docs/evaluation.md, "Comparing two evaluations".
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pipeline.config.layout import RunLayout
from pipeline.errors import PipelineError
from pipeline.evaluation import stats
from pipeline.io import read_json, run_cli

KINDS = ("core", "chat_core")


def resolve(path: str | Path) -> Path:
    """The report.json a command-line argument names (docs/evaluation.md, "Comparing two evaluations")."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / "report.json").is_file():
        return p / "report.json"
    run = RunLayout.at(p)
    if Path(run.stages_report()).is_file():
        last = read_json(run.stages_report())["stages"][-1]["stage"]
        return Path(run.eval(last))
    raise PipelineError(f"{p}: neither an evaluation report (report.json), a stage's evaluation directory "
                        "(R/eval/<stage>) nor a run directory with R/eval/stages.json; run the evaluate rule first")


def _tasks_signature(table: dict) -> dict:
    return {n: (t.get("shots"), t["random_baseline"]) for n, t in table["tasks"].items()}


def comparable(a: dict, b: dict, kind: str) -> None:
    """Refuse (PipelineError) two tables that do not measure the same thing: tasks, shots, baselines
    (the baseline table's version and each task's baseline)."""
    if a.get("baselines") != b.get("baselines"):
        raise PipelineError(f"{kind}: random baselines from table {a.get('baselines')!r} vs {b.get('baselines')!r} "
                            "(CORE scores of two baseline tables are not comparable); rerun the older evaluation")
    ta, tb = _tasks_signature(a), _tasks_signature(b)
    if list(ta) != list(tb):
        raise PipelineError(f"{kind}: the task lists differ ({', '.join(ta)} vs {', '.join(tb)}); compare "
                            "evaluations of the same eval.tasks / eval.chat_tasks")
    for name in ta:
        (sa, ba), (sb, bb) = ta[name], tb[name]
        if sa != sb:
            raise PipelineError(f"{kind}/{name}: scored with {sa} shots vs {sb}; compare evaluations with the same "
                                "eval.core_shots and context length")
        if ba != bb:
            raise PipelineError(f"{kind}/{name}: random baseline {ba} vs {bb} (another baseline table); rerun "
                                "the older evaluation")


def aligned(items_a: dict, items_b: dict, kind: str) -> tuple[dict, dict]:
    """{task: bool array} of A and B over the same items in one order, or a PipelineError naming the task
    whose scored items differ."""
    out_a, out_b = {}, {}
    for name in items_a.keys() | items_b.keys():
        ia, ib = items_a.get(name, {}), items_b.get(name, {})
        if ia.keys() != ib.keys():
            raise PipelineError(f"{kind}/{name}: the scored items differ ({len(ia)} vs {len(ib)} items, "
                                f"{len(ia.keys() ^ ib.keys())} not in both); compare evaluations of the same "
                                "items (eval.core_max_items / eval.chat_max_items, the same eval_data)")
        ids = sorted(ia)
        out_a[name] = np.array([ia[i] for i in ids], dtype=bool)
        out_b[name] = np.array([ib[i] for i in ids], dtype=bool)
    return out_a, out_b


def compare_reports(path_a: str | Path, path_b: str | Path) -> dict:
    """{kind: stats.paired(...) plus its score name} for each benchmark table both reports hold."""
    ra, rb = resolve(path_a), resolve(path_b)
    a, b = read_json(ra), read_json(rb)
    out = {"a": str(ra), "b": str(rb)}
    for kind in KINDS:
        if not (a.get(kind) and b.get(kind)):
            continue
        comparable(a[kind], b[kind], kind)
        logs = [stats.items_path(r, kind) for r in (ra, rb)]
        for r, log in zip((ra, rb), logs):
            if not log.is_file():
                raise PipelineError(f"{log} is missing: the per-item log of {r}; rerun its evaluate rule "
                                    "(evaluations before per-item logs cannot be paired)")
        ca, cb = aligned(*(stats.item_correctness(log) for log in logs), kind)
        order = [n for n in a[kind]["tasks"] if n in ca]
        baselines = {n: t["random_baseline"] for n, t in a[kind]["tasks"].items()}
        result = stats.paired({n: ca[n] for n in order}, {n: cb[n] for n in order}, baselines)
        out[kind] = {"score_name": a[kind]["score_name"], **result}
    return out


def markdown(result: dict, label_a: str = "A", label_b: str = "B") -> str:
    """The comparison as tables (one per benchmark), `*` marking an interval that excludes 0."""
    lines = []
    for kind in KINDS:
        if kind not in result:
            continue
        r = result[kind]
        lines += [f"**{kind}**: {label_b} − {label_a}, paired 95 % bootstrap intervals over the same items "
                  "(* : the interval excludes 0)", "",
                  f"| task | {label_a} | {label_b} | difference | 95 % interval |", "|---|---|---|---|---|"]
        rows = [(f"**{r['score_name']}** (centered)", r["score"])] if r["score"] else []
        rows += [(f"{n} (accuracy)", d) for n, d in r["tasks"].items()]
        for name, d in rows:
            flag = " *" if d["significant"] else ""
            lines.append(f"| {name} | {d['a']:.4f} | {d['b']:.4f} | {d['diff']:+.4f}{flag} | "
                         f"[{d['diff_ci'][0]:+.4f}, {d['diff_ci'][1]:+.4f}] |")
        lines.append("")
    return "\n".join(lines) if lines else "no benchmark table in both reports\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="report.json, R/eval/<stage> or a run directory R")
    p.add_argument("b", help="the same for the other evaluation")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args(argv)
    result = compare_reports(args.a, args.b)
    print(json.dumps(result, indent=2) if args.json else f"A = {result['a']}\nB = {result['b']}\n\n" + markdown(result))


if __name__ == "__main__":
    run_cli(main)
