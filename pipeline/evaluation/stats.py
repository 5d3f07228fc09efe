"""Error bars and paired comparisons for every score a report shows: pure numpy functions.

Every interval is a 95 % percentile bootstrap with `N_BOOT` replicates seeded with `SEED`.

- `score_intervals(correct, baselines)`: each task's accuracy and centered accuracy, and the aggregate;
- `clean_scores(...)`: the same over the items no training document shared an n-gram with;
- `ratio_interval(numerators, denominators)`: val loss and bits per byte, documents resampled;
- `paired(a, b, baselines)`: model B − model A on the same items, flagged ``significant`` when 0 is outside;
- `write_items` / `item_correctness`: the per-item log beside a report.

What each interval resamples and why: docs/evaluation.md, "Error bars and paired comparisons".
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.io import atomic_write

N_BOOT = 1000
SEED = 0
CONFIDENCE = 0.95


def _bounds(samples: np.ndarray) -> list[float]:
    a = (1.0 - CONFIDENCE) / 2
    lo, hi = np.quantile(samples, [a, 1.0 - a], axis=-1)
    return [float(lo), float(hi)]


def _resampled_means(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[N_BOOT] means of `values` resampled with replacement."""
    idx = rng.integers(0, values.size, size=(N_BOOT, values.size))
    return values[idx].mean(axis=1)


def centered(accuracy, baseline: float):
    return (accuracy - baseline) / (1.0 - baseline)


def score_intervals(correct: dict[str, np.ndarray], baselines: dict[str, float]) -> dict:
    """Intervals of each task's accuracy and centered accuracy and of the mean centered accuracy over the
    tasks with items: ``{"tasks": {name: {"accuracy_ci", "centered_ci"}}, "score_ci"}`` (None when no
    task has an item). Tasks in the order given; each task's replicates from its own seeded stream."""
    tasks, replicates = {}, []
    for i, (name, c) in enumerate(correct.items()):
        c = np.asarray(c, dtype=np.float64)
        if not c.size:
            tasks[name] = {"accuracy_ci": None, "centered_ci": None}
            continue
        means = _resampled_means(c, np.random.default_rng([SEED, i]))
        cen = centered(means, baselines[name])
        replicates.append(cen)
        tasks[name] = {"accuracy_ci": _bounds(means), "centered_ci": _bounds(cen)}
    score_ci = _bounds(np.mean(replicates, axis=0)) if replicates else None
    return {"tasks": tasks, "score_ci": score_ci}


def clean_scores(correct: dict[str, np.ndarray], ids: dict[str, list[str]], seen: dict[str, set] | None,
                 baselines: dict[str, float]) -> dict:
    """Scores on the uncontaminated items. `correct` and `ids` per task in item order; `seen`: per task the
    ids of its items a training document shared an n-gram with (a task absent, or `seen` None: not
    checked). ``{"tasks": {name: {"contaminated", "clean_items", "clean_accuracy", "clean_centered",
    "clean_accuracy_ci", "clean_centered_ci"}}, "clean_score", "clean_score_ci"}``; None where not checked
    or no clean item is left."""
    seen = seen or {}
    tasks, clean = {}, {}
    for name, c in correct.items():
        tasks[name] = dict.fromkeys(("contaminated", "clean_items", "clean_accuracy", "clean_centered",
                                     "clean_accuracy_ci", "clean_centered_ci"))
        if name not in seen:
            continue
        dirty = np.array([i in seen[name] for i in ids[name]], dtype=bool)
        clean[name] = np.asarray(c, dtype=bool)[~dirty]
        acc = float(clean[name].mean()) if clean[name].size else None
        tasks[name].update(contaminated=int(dirty.sum()), clean_items=int(clean[name].size), clean_accuracy=acc,
                           clean_centered=None if acc is None else float(centered(acc, baselines[name])))
    ci = score_intervals(clean, baselines)
    for name, t in ci["tasks"].items():
        tasks[name].update(clean_accuracy_ci=t["accuracy_ci"], clean_centered_ci=t["centered_ci"])
    kept = [n for n in clean if clean[n].size]
    checked = all(n in clean for n, c in correct.items() if len(c))
    score = float(np.mean([tasks[n]["clean_centered"] for n in kept])) if checked and kept else None
    return {"tasks": tasks, "clean_score": score, "clean_score_ci": ci["score_ci"] if score is not None else None}


def ratio_interval(numerators: np.ndarray, denominators: np.ndarray, scale: float = 1.0) -> list[float] | None:
    """Interval of scale × Σ numerators / Σ denominators with the units (documents) resampled."""
    num, den = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    if not num.size or den.sum() <= 0:
        return None
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, num.size, size=(N_BOOT, num.size))
    return _bounds(scale * num[idx].sum(axis=1) / np.maximum(den[idx].sum(axis=1), 1e-300))


def paired(a: dict[str, np.ndarray], b: dict[str, np.ndarray], baselines: dict[str, float]) -> dict:
    """B − A per task (accuracy and centered accuracy) and for the mean centered accuracy, with paired
    intervals; `a` and `b` hold the same tasks with the same items in the same order (the caller checks).
    ``{"tasks": {name: {"a", "b", "diff", "diff_ci", "significant"}}, "score": {...}}`` in centered units
    for the aggregate, accuracy units per task."""
    tasks, reps = {}, []
    for i, name in enumerate(a):
        ca, cb = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        if not ca.size:
            continue
        rng = np.random.default_rng([SEED, i])
        idx = rng.integers(0, ca.size, size=(N_BOOT, ca.size))
        d = cb[idx].mean(axis=1) - ca[idx].mean(axis=1)
        reps.append(d / (1.0 - baselines[name]))
        tasks[name] = _difference(float(ca.mean()), float(cb.mean()), d)
    out = {"tasks": tasks, "score": None}
    if reps:
        sa = float(np.mean([centered(np.mean(a[n]), baselines[n]) for n in tasks]))
        sb = float(np.mean([centered(np.mean(b[n]), baselines[n]) for n in tasks]))
        out["score"] = _difference(sa, sb, np.mean(reps, axis=0))
    return out


def _difference(a: float, b: float, replicates: np.ndarray) -> dict:
    ci = _bounds(replicates)
    return {"a": a, "b": b, "diff": b - a, "diff_ci": ci, "significant": ci[0] > 0 or ci[1] < 0}


def items_path(report: str | Path, kind: str = "core") -> Path:
    """The per-item log beside a report: ``<dir>/<kind>_items.jsonl`` (kind: core or chat_core)."""
    return Path(report).parent / f"{kind}_items.jsonl"


def write_items(path: str | Path, rows: list[dict]) -> None:
    """Per-item log (one JSON object per line, like lm-eval's --log_samples), written atomically."""
    with atomic_write(path, encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def item_correctness(path: str | Path) -> dict[str, dict[str, bool]]:
    """{task: {item id: correct}} of a per-item log; items that were not scored (too long) are left out."""
    out: dict[str, dict[str, bool]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r["correct"] is not None:
                    out.setdefault(r["task"], {})[r["id"]] = bool(r["correct"])
    return out
