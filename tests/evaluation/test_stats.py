"""Error bars and paired comparisons (pipeline/evaluation/stats.py, compare.py) against oracles: intervals
that cover what they must, shrink as they must, pair as they must, and refusals that name the reason."""
import json

import numpy as np
import pytest

from pipeline.errors import PipelineError
from pipeline.evaluation import compare, stats
from pipeline.evaluation.evaluate import DocumentSums


def test_task_interval_covers_the_estimate_and_shrinks_with_items():
    rng = np.random.default_rng(1)
    small, large = rng.random(50) < 0.6, rng.random(2000) < 0.6
    ci = stats.score_intervals({"s": small, "l": large}, {"s": 0.25, "l": 0.25})
    for name, c in (("s", small), ("l", large)):
        lo, hi = ci["tasks"][name]["accuracy_ci"]
        assert lo <= c.mean() <= hi
        clo, chi = ci["tasks"][name]["centered_ci"]
        assert clo == pytest.approx((lo - 0.25) / 0.75) and chi == pytest.approx((hi - 0.25) / 0.75)
    width = {n: np.diff(ci["tasks"][n]["accuracy_ci"])[0] for n in "sl"}
    # the normal approximation's 95 % width 2·1.96·sqrt(p(1-p)/n), within bootstrap noise
    assert width["s"] == pytest.approx(2 * 1.96 * np.sqrt(0.24 / 50), rel=0.25)
    assert width["l"] < width["s"] / 4
    # the aggregate: its interval contains the mean centered accuracy, narrower than the small task's alone
    score = np.mean([stats.centered(c.mean(), 0.25) for c in (small, large)])
    lo, hi = ci["score_ci"]
    assert lo <= score <= hi and hi - lo < ci["tasks"]["s"]["centered_ci"][1] - ci["tasks"]["s"]["centered_ci"][0]
    assert stats.score_intervals({"s": small, "l": large}, {"s": 0.25, "l": 0.25}) == ci  # seeded
    assert stats.score_intervals({"e": np.array([], bool)}, {"e": 0.5}) == {
        "tasks": {"e": {"accuracy_ci": None, "centered_ci": None}}, "score_ci": None}


def test_clean_scores_are_the_scores_of_the_unseen_items():
    """The clean subset's accuracy and intervals are those of `score_intervals` over the unseen items alone."""
    rng = np.random.default_rng(3)
    correct = {"a": rng.random(200) < 0.7, "b": rng.random(50) < 0.4}
    ids = {n: [f"{n}{i}" for i in range(len(c))] for n, c in correct.items()}
    seen = {"a": {f"a{i}" for i in range(0, 200, 4)} | {"not-scored"}, "b": set()}
    base = {"a": 0.25, "b": 0.5}
    r = stats.clean_scores(correct, ids, seen, base)
    keep = np.arange(200) % 4 != 0
    ref = stats.score_intervals({"a": correct["a"][keep], "b": correct["b"]}, base)
    a = r["tasks"]["a"]
    assert a["contaminated"] == 50 and a["clean_items"] == 150
    assert a["clean_accuracy"] == pytest.approx(correct["a"][keep].mean())
    assert a["clean_centered"] == pytest.approx((a["clean_accuracy"] - 0.25) / 0.75)
    assert a["clean_centered_ci"] == ref["tasks"]["a"]["centered_ci"] and r["clean_score_ci"] == ref["score_ci"]
    b = r["tasks"]["b"]
    assert b["contaminated"] == 0 and b["clean_accuracy"] == pytest.approx(correct["b"].mean())
    assert r["clean_score"] == pytest.approx((a["clean_centered"] + b["clean_centered"]) / 2)
    part = stats.clean_scores(correct, ids, {"a": seen["a"]}, base)  # b not checked: no clean aggregate
    assert part["tasks"]["b"]["contaminated"] is None and part["clean_score"] is None
    assert part["tasks"]["a"] == a


def test_ratio_interval_resamples_documents():
    rng = np.random.default_rng(2)
    tokens = rng.integers(10, 200, size=400).astype(float)
    nats = tokens * rng.normal(3.0, 0.3, size=400)
    lo, hi = stats.ratio_interval(nats, tokens)
    assert lo < nats.sum() / tokens.sum() < hi and hi - lo < 0.1
    assert stats.ratio_interval(np.array([]), np.array([])) is None


def test_paired_difference_is_narrower_than_independent_intervals_and_flags_a_real_gain():
    rng = np.random.default_rng(3)
    a = rng.random(400) < 0.5
    b = a.copy()
    flip = np.flatnonzero(~a)[:20]  # B fixes 20 items A got wrong, breaks none
    b[flip] = True
    r = stats.paired({"t": a}, {"t": b}, {"t": 0.5})
    d = r["tasks"]["t"]
    assert d["diff"] == pytest.approx(20 / 400) and d["significant"] and d["diff_ci"][0] > 0
    ia, ib = (stats.score_intervals({"t": x}, {"t": 0.5})["tasks"]["t"]["accuracy_ci"] for x in (a, b))
    assert ia[1] > ib[0]  # unpaired, the two intervals overlap ...
    assert d["diff_ci"][1] - d["diff_ci"][0] < 0.6 * (ia[1] - ia[0])  # ... the paired one is far narrower
    assert r["score"]["diff"] == pytest.approx(0.05 / 0.5)  # centered units
    same = stats.paired({"t": a}, {"t": a}, {"t": 0.5})["tasks"]["t"]
    assert same["diff"] == 0 and same["diff_ci"] == [0.0, 0.0] and not same["significant"]


def test_document_sums_split_at_bos_and_continue_across_rows():
    BOS, EOS = 1, 2
    docs = DocumentSums(BOS, EOS)
    ones = lambda n: np.ones((3, n))
    docs.add(np.array([BOS, 5, 6, BOS, 7]), ones(5))
    docs.add(np.array([8, 9, BOS, 4]), ones(4))  # the second document continues into this row
    assert docs.arrays()[1].tolist() == [3, 4, 2]
    eos_policy = DocumentSums(None, EOS)  # documents end with <|eos|>, none starts with <|bos|>
    eos_policy.add(np.array([5, 6, EOS, 7, EOS, 8]), ones(6))
    assert eos_policy.arrays()[1].tolist() == [3, 2, 1]
    both = DocumentSums(BOS, EOS)  # <|bos|> doc <|eos|>: one start per document, not two
    both.add(np.array([BOS, 5, EOS, BOS, 6, EOS]), ones(6))
    assert both.arrays()[1].tolist() == [3, 3]


def write_eval(d, tasks: dict, shots=0, baseline=0.25, table_version="dclm-v1"):
    """A minimal evaluation directory: report.json with a CORE table and core_items.jsonl."""
    d.mkdir(parents=True)
    table = {n: {"type": "multiple_choice", "shots": shots, "random_baseline": baseline, "items": len(c),
                 "accuracy": float(np.mean(c))} for n, c in tasks.items()}
    (d / "report.json").write_text(json.dumps({"core": {"score_name": f"core_{len(tasks)}", "tasks": table,
                                                        "baselines": table_version}, "chat_core": None}))
    stats.write_items(d / "core_items.jsonl", [{"task": n, "index": i, "id": f"{n}-{i}", "correct": bool(x)}
                                               for n, c in tasks.items() for i, x in enumerate(c)])
    return d


def test_compare_prints_a_paired_table_and_refuses_what_differs(tmp_path, capsys):
    rng = np.random.default_rng(4)
    a = {"copa": rng.random(300) < 0.5, "hellaswag": rng.random(200) < 0.4}
    b = {"copa": a["copa"] | (rng.random(300) < 0.3), "hellaswag": a["hellaswag"].copy()}
    A, B = write_eval(tmp_path / "a", a), write_eval(tmp_path / "b", b)
    compare.main([str(A), str(B / "report.json")])
    out = capsys.readouterr().out
    assert "| copa (accuracy) |" in out and "| hellaswag (accuracy) | " in out and "**core_2** (centered)" in out
    copa = next(line for line in out.splitlines() if line.startswith("| copa"))
    hella = next(line for line in out.splitlines() if line.startswith("| hellaswag"))
    assert " *" in copa and " *" not in hella  # B's gain on copa is real; hellaswag is identical
    with pytest.raises(PipelineError, match="shots"):
        compare.compare_reports(A, write_eval(tmp_path / "c", a, shots=5))
    with pytest.raises(PipelineError, match="task lists differ"):
        compare.compare_reports(A, write_eval(tmp_path / "d", {"copa": a["copa"]}))
    with pytest.raises(PipelineError, match="random baseline"):
        compare.compare_reports(A, write_eval(tmp_path / "e", a, baseline=0.5))
    # the same per-task baselines but another table's version: refused, naming both
    with pytest.raises(PipelineError, match="core: random baselines from table 'dclm-v1' vs 'dclm-v2'"):
        compare.compare_reports(A, write_eval(tmp_path / "v", a, table_version="dclm-v2"))
    with pytest.raises(PipelineError, match="copa: the scored items differ"):
        compare.compare_reports(A, write_eval(tmp_path / "f", {"copa": a["copa"][:100], "hellaswag": a["hellaswag"]}))
    with pytest.raises(PipelineError, match="neither an evaluation report"):
        compare.compare_reports(A, tmp_path)
